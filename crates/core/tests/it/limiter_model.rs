//! The limiter against a small reference model, under random interleavings of acquire, release,
//! timeout holds, queue waits and limit hints from many simulated callers on a manual clock;
//! and a multi-threaded stress test that counts what a dependency behind it would see.

#![cfg(not(stormguard_loom))]

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::task::{Context, Poll, Wake, Waker};
use std::time::Duration;

use proptest::prelude::*;
use stormguard_core::Denied;
use stormguard_core::clock::ManualClock;
use stormguard_core::limiter::{Acquire, AttemptKind, HeldSlot, Limiter, LimiterConfig, Permit};

struct Noop;
impl Wake for Noop {
    fn wake(self: Arc<Self>) {}
}

#[derive(Debug, Clone)]
enum Op {
    TryAcquire(bool),
    StartWait,
    PollWaiter(usize),
    DropWaiter(usize),
    Release(usize),
    Hold(usize, u64),
    Answer(usize),
    Advance(u64),
    Hint(u64, u64),
    Snapshot,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => any::<bool>().prop_map(Op::TryAcquire),
        3 => Just(Op::StartWait),
        3 => any::<usize>().prop_map(Op::PollWaiter),
        1 => any::<usize>().prop_map(Op::DropWaiter),
        4 => any::<usize>().prop_map(Op::Release),
        1 => (any::<usize>(), 1u64..200).prop_map(|(i, h)| Op::Hold(i, h)),
        1 => any::<usize>().prop_map(Op::Answer),
        2 => (0u64..60).prop_map(Op::Advance),
        1 => (0u64..8, 1u64..300).prop_map(|(l, t)| Op::Hint(l, t)),
        1 => Just(Op::Snapshot),
    ]
}

/// The rules, written plainly: a count, a FIFO of waiter ids, a list of granted ids, holds.
#[derive(Debug, Default)]
struct Model {
    cap: u64,
    queue_len: u64,
    queue_timeout: u64,
    now: u64,
    in_flight: u64,
    queue: VecDeque<u64>,
    granted: Vec<u64>,
    holds: Vec<(u64, u64)>,   // (until, hold id)
    hint: Option<(u64, u64)>, // (limit, until)
}

impl Model {
    fn cap_now(&self) -> u64 {
        match self.hint {
            Some((limit, until)) if self.now < until => limit.clamp(1, self.cap),
            _ => self.cap,
        }
    }

    fn release(&mut self) {
        if !self.queue.is_empty() && self.in_flight <= self.cap_now() {
            let w = self.queue.pop_front().unwrap();
            self.granted.push(w);
        } else {
            self.in_flight -= 1;
        }
    }

    fn reclaim(&mut self) {
        let now = self.now;
        let due: Vec<_> = self.holds.iter().filter(|(u, _)| *u <= now).cloned().collect();
        self.holds.retain(|(u, _)| *u > now);
        for _ in due {
            self.release();
        }
    }

    fn fill(&mut self) {
        while !self.queue.is_empty() && self.in_flight < self.cap_now() {
            self.in_flight += 1;
            let w = self.queue.pop_front().unwrap();
            self.granted.push(w);
        }
    }

    fn can_take(&self) -> bool {
        self.queue.is_empty() && self.in_flight < self.cap_now()
    }
}

struct Waiting {
    id: u64,
    acquire: Acquire,
    deadline: u64,
}

fn run(cap: u64, queue_len: u64, ops: Vec<Op>) -> Result<(), TestCaseError> {
    let clock = ManualClock::new();
    let limiter = Limiter::try_new(
        LimiterConfig { cap, queue_len, queue_timeout: Duration::from_millis(100), adaptive: None },
        Arc::new(clock.clone()),
    )
    .unwrap();
    let mut m = Model { cap, queue_len, queue_timeout: 100, ..Default::default() };
    let waker = Waker::from(Arc::new(Noop));
    let mut cx = Context::from_waker(&waker);
    let mut permits: Vec<Permit> = Vec::new();
    let mut held: Vec<(HeldSlot, u64)> = Vec::new();
    let mut waiting: Vec<Waiting> = Vec::new();
    let mut next_id = 0u64;
    let mut next_hold = 0u64;
    let mut grant_order = Vec::new();

    for (step, op) in ops.into_iter().enumerate() {
        match op {
            Op::TryAcquire(retry) => {
                let kind = if retry { AttemptKind::Retry } else { AttemptKind::Primary };
                m.reclaim();
                let expect = m.can_take();
                let got = limiter.try_acquire(kind);
                prop_assert_eq!(got.is_ok(), expect, "step {}: try_acquire", step);
                match got {
                    Ok(p) => {
                        m.in_flight += 1;
                        permits.push(p);
                    }
                    Err(d) => prop_assert_eq!(d, Denied::Cap),
                }
            }
            Op::StartWait => {
                let mut acquire = limiter.acquire();
                let id = next_id;
                next_id += 1;
                m.reclaim();
                let r = acquire.poll_acquire(&mut cx);
                let expect = if m.can_take() {
                    Some(true)
                } else {
                    m.fill();
                    if m.can_take() {
                        Some(true)
                    } else if m.queue.len() as u64 >= m.queue_len {
                        Some(false)
                    } else {
                        None
                    }
                };
                match (r, expect) {
                    (Poll::Ready(Ok(p)), Some(true)) => {
                        m.in_flight += 1;
                        permits.push(p);
                    }
                    (Poll::Ready(Err(Denied::Queue)), Some(false)) => {}
                    (Poll::Pending, None) => {
                        m.queue.push_back(id);
                        waiting.push(Waiting { id, acquire, deadline: m.now + m.queue_timeout });
                    }
                    (r, e) => prop_assert!(false, "step {step}: wait start {r:?}, model {e:?}"),
                }
            }
            Op::PollWaiter(i) if !waiting.is_empty() => {
                let i = i % waiting.len();
                m.reclaim();
                m.fill();
                let id = waiting[i].id;
                let r = waiting[i].acquire.poll_acquire(&mut cx);
                if let Some(pos) = m.granted.iter().position(|g| *g == id) {
                    m.granted.swap_remove(pos);
                    let Poll::Ready(Ok(p)) = r else {
                        return Err(TestCaseError::fail(format!(
                            "step {step}: granted waiter got {r:?}"
                        )));
                    };
                    grant_order.push(id);
                    permits.push(p);
                    waiting.swap_remove(i);
                } else if m.now >= waiting[i].deadline {
                    prop_assert!(
                        matches!(r, Poll::Ready(Err(Denied::Queue))),
                        "step {step}: timeout {r:?}"
                    );
                    m.queue.retain(|q| *q != id);
                    waiting.swap_remove(i);
                } else {
                    prop_assert!(r.is_pending(), "step {step}: still waiting, got {r:?}");
                }
            }
            Op::DropWaiter(i) if !waiting.is_empty() => {
                let w = waiting.swap_remove(i % waiting.len());
                if let Some(pos) = m.granted.iter().position(|g| *g == w.id) {
                    m.granted.swap_remove(pos);
                    m.release();
                } else {
                    m.queue.retain(|q| *q != w.id);
                }
                drop(w.acquire);
            }
            Op::Release(i) if !permits.is_empty() => {
                drop(permits.swap_remove(i % permits.len()));
                m.release();
            }
            Op::Hold(i, ms) if !permits.is_empty() => {
                let p = permits.swap_remove(i % permits.len());
                let h = p.hold(Duration::from_millis(ms));
                m.holds.push((m.now + ms, next_hold));
                held.push((h, next_hold));
                next_hold += 1;
            }
            Op::Answer(i) if !held.is_empty() => {
                let (h, id) = held.swap_remove(i % held.len());
                if let Some(pos) = m.holds.iter().position(|(_, hid)| *hid == id) {
                    m.holds.swap_remove(pos);
                    m.release();
                }
                h.upstream_answered();
            }
            Op::Advance(ms) => {
                clock.advance(Duration::from_millis(ms));
                m.now += ms;
            }
            Op::Hint(limit, ttl) => {
                limiter.set_limit_hint(limit, Duration::from_millis(ttl));
                m.hint = Some((limit, m.now + ttl));
                m.fill();
            }
            Op::Snapshot => {
                m.reclaim();
                m.fill();
                let s = limiter.snapshot();
                prop_assert_eq!(s.held, m.holds.len() as u64, "step {}: held", step);
            }
            _ => {}
        }
        prop_assert_eq!(
            limiter.in_flight(),
            m.in_flight,
            "step {}: in flight after {:?}",
            step,
            op
        );
        prop_assert_eq!(limiter.queued(), m.queue.len() as u64, "step {}: queued", step);
        prop_assert!(limiter.in_flight() <= cap, "step {}: over the configured cap", step);
        // Live permits + held slots + granted-not-taken waiters are what the dependency sees.
        let seen = permits.len() as u64 + m.holds.len() as u64 + m.granted.len() as u64;
        prop_assert_eq!(seen, m.in_flight, "step {}: in flight is what was admitted", step);
    }
    // FIFO: every poll agreed with the model on whether that waiter had been handed a slot,
    // and the model hands slots strictly to the front of its queue.
    prop_assert!(grant_order.len() <= next_id as usize);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]

    #[test]
    fn limiter_matches_the_reference_model(
        cap in 1u64..6,
        queue_len in 0u64..5,
        ops in proptest::collection::vec(op(), 1..200),
    ) {
        run(cap, queue_len, ops)?;
    }
}

/// Many threads, each an attempt at a time: a counter incremented after admission and
/// decremented before release is what a dependency behind the limiter would see. It never
/// passes the cap. The same load with no limiter does.
#[test]
fn threads_never_see_more_than_the_cap() {
    const CAP: u64 = 4;
    let limiter = Limiter::try_new(
        LimiterConfig {
            cap: CAP,
            queue_len: 64,
            queue_timeout: Duration::from_secs(30),
            adaptive: None,
        },
        Arc::new(stormguard_core::clock::MonotonicClock::new()),
    )
    .unwrap();
    let at_dependency = Arc::new(AtomicU64::new(0));
    let peak = Arc::new(AtomicU64::new(0));
    let go = Arc::new(AtomicBool::new(false));
    let threads: Vec<_> = (0..8)
        .map(|t| {
            let (l, dep, peak, go) =
                (limiter.clone(), at_dependency.clone(), peak.clone(), go.clone());
            std::thread::spawn(move || {
                while !go.load(Ordering::Acquire) {
                    std::hint::spin_loop();
                }
                for i in 0..2_000 {
                    let permit = if (t + i) % 3 == 0 {
                        match l.try_acquire(AttemptKind::Retry) {
                            Ok(p) => p,
                            Err(_) => continue,
                        }
                    } else {
                        l.acquire_blocking().expect("a 30 s queue timeout is not reached")
                    };
                    let n = dep.fetch_add(1, Ordering::SeqCst) + 1;
                    peak.fetch_max(n, Ordering::SeqCst);
                    std::hint::spin_loop();
                    dep.fetch_sub(1, Ordering::SeqCst);
                    drop(permit);
                }
            })
        })
        .collect();
    go.store(true, Ordering::Release);
    threads.into_iter().for_each(|t| t.join().unwrap());
    assert!(peak.load(Ordering::SeqCst) <= CAP, "peak {}", peak.load(Ordering::SeqCst));
    assert_eq!(limiter.in_flight(), 0);
    assert_eq!(limiter.queued(), 0);
    assert!(limiter.snapshot().high_water <= CAP);
}

#[test]
fn without_a_limiter_the_same_threads_pass_the_cap() {
    // The unprotected path: the same attempts with nothing admitting them.
    let at_dependency = Arc::new(AtomicU64::new(0));
    let peak = Arc::new(AtomicU64::new(0));
    let barrier = Arc::new(std::sync::Barrier::new(8));
    let threads: Vec<_> = (0..8)
        .map(|_| {
            let (dep, peak, barrier) = (at_dependency.clone(), peak.clone(), barrier.clone());
            std::thread::spawn(move || {
                let n = dep.fetch_add(1, Ordering::SeqCst) + 1;
                peak.fetch_max(n, Ordering::SeqCst);
                barrier.wait(); // all eight are in flight at once
                dep.fetch_sub(1, Ordering::SeqCst);
            })
        })
        .collect();
    threads.into_iter().for_each(|t| t.join().unwrap());
    assert_eq!(peak.load(Ordering::SeqCst), 8, "eight attempts in flight past a cap of 4");
}
