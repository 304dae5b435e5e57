//! The cap holds whatever the caller does: callers that give up before a slow dependency
//! answers, and requests whose deadline cuts their attempts, never make the dependency see
//! more than the cap — counted at the dependency, which keeps working on every request it was
//! sent, whoever still waits for it. Each guarantee is shown beside the unprotected path
//! (the hold turned off), which breaks it.

use std::sync::atomic::Ordering;
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request};
use http_body_util::Full;
use stormguard_core::signals::Abandoned;
use stormguard_tower::{
    Deadline, Dependency, DependencyConfig, ReplayBody, Spawner, StormguardError, StormguardLayer,
};
use tower::{Layer, ServiceExt};

use crate::support;

use support::Upstream;

type Req = Request<ReplayBody<Full<Bytes>>>;

fn request() -> Req {
    Request::builder()
        .method(Method::GET)
        .uri("http://dep/x")
        .body(ReplayBody::new(Full::new(Bytes::new()), 1024))
        .unwrap()
}

fn dependency(f: impl FnOnce(&mut DependencyConfig)) -> Dependency {
    let mut c = DependencyConfig::new("payments");
    c.limiter.cap = 20;
    c.budget = "ratio:percent=0.25,min_per_sec=3".parse().unwrap();
    c.background = Some(Spawner::tokio());
    f(&mut c);
    Dependency::try_new(c).unwrap()
}

/// Callers arriving at 80/s in open loop for `seconds`, each giving up after `patience`
/// (dropping its request's future); returns once every caller has ended and the dependency
/// has finished everything it was sent.
async fn open_loop(dep: &Dependency, upstream: &Upstream, seconds: u64, patience: Duration) {
    let stack = StormguardLayer::new(dep.clone()).layer(upstream.clone());
    let mut callers = Vec::new();
    let gap = Duration::from_micros(12_500);
    let start = tokio::time::Instant::now();
    for i in 0..(80 * seconds) {
        tokio::time::sleep_until(start + gap * i as u32).await;
        let call = stack.clone().oneshot(request());
        callers.push(tokio::spawn(tokio::time::timeout(patience, call)));
    }
    for c in callers {
        let _ = c.await;
    }
    // Everything the dependency was sent ends within its latency, holds after it.
    tokio::time::sleep(Duration::from_secs(60)).await;
    assert_eq!(upstream.in_flight.load(Ordering::SeqCst), 0);
}

/// The case: a 500 ms caller timeout, a 700 ms dependency, 80 requests/s, cap 20.
#[tokio::test(start_paused = true)]
async fn callers_that_give_up_never_push_the_dependency_past_the_cap() {
    let upstream = Upstream::new(Duration::from_millis(700));
    let dep = dependency(|_| {});
    open_loop(&dep, &upstream, 10, Duration::from_millis(500)).await;
    let s = dep.snapshot();
    assert!(upstream.max() <= 20, "the dependency saw {} in flight", upstream.max());
    assert_eq!(upstream.max(), 20, "the cap was reached: the test had load enough to fail");
    let finished = s.counters.abandoned(Abandoned::Finished);
    assert_eq!(
        finished,
        upstream.received.load(Ordering::SeqCst),
        "every attempt was abandoned by its caller, and each one counted when it finished"
    );
    assert_eq!(s.counters.abandoned(Abandoned::Cut), 0);
    assert_eq!(s.limiter.in_flight, 0, "every slot came back");
    assert_eq!(s.limiter.holds_expired, 0);
}

/// The unprotected path: the same callers, with the hold turned off (a dropped attempt frees
/// its slot at once, as it does without a spawner), push the dependency well past the cap.
#[tokio::test(start_paused = true)]
async fn without_the_hold_callers_that_give_up_push_it_past_the_cap() {
    for off in [
        Box::new(|c: &mut DependencyConfig| c.abandon_hold = Duration::ZERO)
            as Box<dyn FnOnce(&mut DependencyConfig)>,
        Box::new(|c: &mut DependencyConfig| c.background = None),
    ] {
        let upstream = Upstream::new(Duration::from_millis(700));
        let dep = dependency(off);
        open_loop(&dep, &upstream, 10, Duration::from_millis(500)).await;
        eprintln!("without the hold: {} in flight at the dependency (cap 20)", upstream.max());
        assert!(upstream.max() > 30, "the dependency saw {} in flight", upstream.max());
    }
}

/// An abandoned attempt the dependency never answers is cut at `abandon_hold`, counted, and
/// its slot comes back then.
#[tokio::test(start_paused = true)]
async fn an_abandoned_attempt_is_cut_at_the_hold() {
    let upstream = Upstream::new(Duration::from_secs(3_600));
    let dep = dependency(|c| {
        c.limiter.cap = 1;
        c.abandon_hold = Duration::from_secs(2);
    });
    let stack = StormguardLayer::new(dep.clone()).layer(upstream.clone());
    let gave_up = tokio::time::timeout(Duration::from_millis(100), stack.oneshot(request())).await;
    assert!(gave_up.is_err());
    tokio::time::sleep(Duration::from_millis(1_800)).await;
    assert_eq!(dep.snapshot().limiter.in_flight, 1, "held while the dependency works");
    assert_eq!(dep.snapshot().limiter.held, 1);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let s = dep.snapshot();
    assert_eq!(s.limiter.in_flight, 0, "cut at the hold");
    assert_eq!(s.counters.abandoned(Abandoned::Cut), 1);
    assert_eq!(s.counters.abandoned(Abandoned::Finished), 0);
}

/// A primary still waiting in the queue when its caller leaves gives its place back at once: it
/// never reached the dependency, so nothing is held for it.
#[tokio::test(start_paused = true)]
async fn a_queued_primary_leaves_at_once() {
    let upstream = Upstream::new(Duration::from_secs(10));
    let dep = dependency(|c| c.limiter.cap = 1);
    let stack = StormguardLayer::new(dep.clone()).layer(upstream.clone());
    let first = tokio::spawn(stack.clone().oneshot(request()));
    tokio::time::sleep(Duration::from_millis(1)).await;
    let queued = tokio::time::timeout(Duration::from_millis(100), stack.oneshot(request())).await;
    assert!(queued.is_err());
    let s = dep.snapshot();
    assert_eq!((s.limiter.queued, s.limiter.held, s.limiter.in_flight), (0, 0, 1));
    assert_eq!(upstream.received.load(Ordering::SeqCst), 1);
    first.abort();
}

/// The deadline case: per-try 300 ms, deadline 400 ms, a 700 ms dependency. Each request's
/// attempt is cut by stormguard (its per-try timeout, then the deadline leaves no room for a
/// retry), and its slot is held until the dependency answers — never shortened to what was
/// left of the deadline. Without the hold the dependency sees far more than the cap.
#[tokio::test(start_paused = true)]
async fn the_deadline_cuts_but_the_slot_is_held_until_the_answer() {
    for hold in [true, false] {
        let upstream = Upstream::new(Duration::from_millis(700));
        let dep = dependency(|c| {
            c.per_try_timeout = Some(Duration::from_millis(300));
            c.deadline = Some(Duration::from_millis(400));
            c.retry.retry_on = "5xx,timeout".parse().unwrap();
            if !hold {
                c.timeout_slot_hold = Duration::ZERO;
            }
        });
        let stack = StormguardLayer::new(dep.clone()).layer(upstream.clone());
        let mut callers = Vec::new();
        let start = tokio::time::Instant::now();
        for i in 0..800u32 {
            tokio::time::sleep_until(start + Duration::from_micros(12_500) * i).await;
            let mut req = request();
            // The caller's own deadline may be shorter; here it is the same.
            req.extensions_mut().insert(Deadline::after(Duration::from_millis(400)));
            callers.push(tokio::spawn(stack.clone().oneshot(req)));
        }
        let mut timed_out = 0;
        for c in callers {
            if let Err(e) = c.await.unwrap() {
                let e = e.downcast_ref::<StormguardError>();
                if matches!(e, Some(StormguardError::Timeout | StormguardError::NotRetried { .. }))
                {
                    timed_out += 1;
                }
            }
        }
        tokio::time::sleep(Duration::from_secs(60)).await;
        assert!(timed_out > 100, "{timed_out} attempts were cut by stormguard");
        if hold {
            assert!(upstream.max() <= 20, "the dependency saw {} in flight", upstream.max());
            assert_eq!(upstream.max(), 20, "the cap was reached");
        } else {
            assert!(upstream.max() > 20, "without the hold it saw {}", upstream.max());
        }
    }
}
