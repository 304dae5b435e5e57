//! Loom models of the limiter's and the budgets' atomics and wake-ups.
//!
//! Run with `RUSTFLAGS="--cfg stormguard_loom" CARGO_TARGET_DIR=target/loom cargo test -p
//! stormguard-loom --release` (scripts/test does). The project's own cfg name is used because `--cfg loom` would also
//! switch dependencies that know loom.

#![cfg(stormguard_loom)]

use std::sync::Arc as StdArc;
use std::time::Duration;

use loom::sync::Arc;
use loom::sync::atomic::{AtomicU64, Ordering};
use loom::thread;
use stormguard_core::budget::{BudgetSpec, FailureKind, RetryBudget};
use stormguard_core::clock::{ManualClock, Timestamp};
use stormguard_core::limiter::{AttemptKind, Limiter, LimiterConfig};

fn limiter(cap: u64, queue_len: u64) -> Limiter {
    Limiter::try_new(
        LimiterConfig { cap, queue_len, queue_timeout: Duration::from_secs(3600), adaptive: None },
        StdArc::new(ManualClock::new()),
    )
    .unwrap()
}

fn model(f: impl Fn() + Sync + Send + 'static) {
    let mut b = loom::model::Builder::new();
    if b.preemption_bound.is_none() {
        b.preemption_bound = Some(3);
    }
    b.check(f);
}

/// Two racing attempts on one slot: never both in, and the slot comes back.
#[test]
fn racing_try_acquire_never_exceeds_the_cap() {
    model(|| {
        let l = limiter(1, 0);
        let inside = Arc::new(AtomicU64::new(0));
        let spawn = |l: Limiter, inside: Arc<AtomicU64>| {
            thread::spawn(move || {
                if let Ok(p) = l.try_acquire(AttemptKind::Retry) {
                    assert_eq!(
                        inside.fetch_add(1, Ordering::SeqCst),
                        0,
                        "two attempts in one slot"
                    );
                    inside.fetch_sub(1, Ordering::SeqCst);
                    drop(p);
                }
            })
        };
        let a = spawn(l.clone(), inside.clone());
        let b = spawn(l.clone(), inside.clone());
        a.join().unwrap();
        b.join().unwrap();
        assert_eq!(l.in_flight(), 0);
    });
}

/// A primary queues while the holder releases: the slot is handed over and the waiter is woken
/// (a lost wake-up would leave `block_on` parked forever, which loom reports).
#[test]
fn release_racing_a_new_waiter_never_loses_the_wake_up() {
    model(|| {
        let l = limiter(1, 4);
        let held = l.try_acquire(AttemptKind::Primary).unwrap();
        let l2 = l.clone();
        let waiter = thread::spawn(move || {
            let p = loom::future::block_on(l2.acquire()).expect("the slot is handed over");
            drop(p);
        });
        drop(held);
        waiter.join().unwrap();
        assert_eq!((l.in_flight(), l.queued()), (0, 0));
    });
}

/// A retry racing a release while a primary waits never takes the waiting primary's slot.
#[test]
fn a_retry_never_jumps_a_waiting_primary() {
    model(|| {
        let l = limiter(1, 4);
        let held = l.try_acquire(AttemptKind::Primary).unwrap();
        let l2 = l.clone();
        let waiter = thread::spawn(move || {
            loom::future::block_on(l2.acquire()).map(drop).expect("granted");
        });
        let l3 = l.clone();
        let retry = thread::spawn(move || {
            // Either no slot is free, or the primary is already done with it.
            let _ = l3.try_acquire(AttemptKind::Retry);
        });
        drop(held);
        waiter.join().unwrap();
        retry.join().unwrap();
        assert_eq!((l.in_flight(), l.queued()), (0, 0));
    });
}

/// The concurrency budget's last place goes to one of two racing retries.
#[test]
fn concurrency_budget_grants_the_last_place_once() {
    model(|| {
        let b = Arc::new(BudgetSpec::parse("concurrency:slots=1").unwrap().build().unwrap());
        let granted = Arc::new(AtomicU64::new(0));
        let hs: Vec<_> = (0..2)
            .map(|_| {
                let (b, granted) = (b.clone(), granted.clone());
                thread::spawn(move || {
                    if let Ok(p) = b.try_retry(Timestamp::ZERO, FailureKind::Error) {
                        granted.fetch_add(1, Ordering::SeqCst);
                        std::mem::forget(p); // keep it in flight for the rest of the model
                    }
                })
            })
            .collect();
        hs.into_iter().for_each(|h| h.join().unwrap());
        assert_eq!(granted.load(Ordering::SeqCst), 1);
    });
}

/// Two racing withdrawals from a ratio budget holding one retry: at most one is granted.
#[test]
fn ratio_budget_never_spends_one_credit_twice() {
    model(|| {
        let b =
            Arc::new(BudgetSpec::parse("ratio:percent=1,min_per_sec=0").unwrap().build().unwrap());
        b.record_request(Timestamp::ZERO);
        let granted = Arc::new(AtomicU64::new(0));
        let hs: Vec<_> = (0..2)
            .map(|_| {
                let (b, granted) = (b.clone(), granted.clone());
                thread::spawn(move || {
                    if b.try_retry(Timestamp::ZERO, FailureKind::Error).is_ok() {
                        granted.fetch_add(1, Ordering::SeqCst);
                    }
                })
            })
            .collect();
        hs.into_iter().for_each(|h| h.join().unwrap());
        assert!(granted.load(Ordering::SeqCst) <= 1);
    });
}

/// The quota's bucket is charged exactly once per grant under a race.
#[test]
fn quota_charges_each_grant_once() {
    model(|| {
        let b =
            Arc::new(BudgetSpec::parse("quota:capacity=10,retry_cost=5").unwrap().build().unwrap());
        let hs: Vec<_> = (0..3)
            .map(|_| {
                let b = b.clone();
                thread::spawn(move || b.try_retry(Timestamp::ZERO, FailureKind::Error).is_ok())
            })
            .collect();
        let granted = hs.into_iter().map(|h| h.join().unwrap()).filter(|g| *g).count();
        assert_eq!(granted, 2);
        assert_eq!(b.snapshot(Timestamp::ZERO).balance, 0.0);
    });
}

/// Half-open: two racing callers for one probe place; at most one probe gets through.
#[test]
fn half_open_admits_one_probe_at_a_time() {
    use stormguard_core::breaker::{AttemptResult, Breaker, BreakerConfig};
    model(|| {
        let b = Breaker::try_new(BreakerConfig {
            consecutive_failures: Some(1),
            break_duration: Duration::from_millis(1),
            half_open_probes: 1,
            ..Default::default()
        })
        .unwrap();
        b.record(Timestamp::ZERO, AttemptResult::UpstreamFailure);
        let after = Timestamp::from_millis(1);
        let hs: Vec<_> = (0..2)
            .map(|_| {
                let b = b.clone();
                // Each keeps its probe permit until both have tried.
                thread::spawn(move || b.try_acquire(after).ok())
            })
            .collect();
        let permits: Vec<_> = hs.into_iter().filter_map(|h| h.join().unwrap()).collect();
        assert_eq!(permits.len(), 1);
    });
}

/// Two holds set at once: the later time wins, whichever lands first (`fetch_max`). (It lived
/// in core's `backoff` under the loom cfg, where no loom run reached it.)
#[test]
fn racing_holds_keep_the_later_time() {
    use stormguard_core::backoff::PushbackHold;
    model(|| {
        let hold = Arc::new(PushbackHold::new());
        let other = hold.clone();
        let t = thread::spawn(move || other.hold_until(Timestamp::from_millis(5)));
        hold.hold_until(Timestamp::from_millis(9));
        t.join().unwrap();
        assert_eq!(hold.is_held(Timestamp::ZERO), Some(Timestamp::from_millis(9)));
    });
}
