//! The storm test that proves it: open-loop arrivals at 16/L per second to an in-process
//! dependency with latency L, on paused tokio time (so every run is the same run).
//!
//! 1. 30 % of attempts fail (just above the 25 % budget), cap 20,
//!    `ratio:percent=0.25,min_per_sec=0`: the dependency never sees more than 20 at once, and in
//!    every 10 s window the retries stay within 25 % of the originals. The same arrivals through
//!    a naive retry-once client put 16 × 1.3 = 20.8 in flight on average.
//! 2. The slow dependency: no errors, but latency rises past the per-try timeout. The budgeted
//!    stack keeps the dependency at the cap (a timed-out attempt keeps its slot while the
//!    dependency works on it); a naive client with a concurrency limit that frees the slot at
//!    the timeout does not.

use crate::support;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, Response};
use http_body_util::{BodyExt, Full};
use stormguard_core::Denied;
use stormguard_core::random::{RandomSource, SplitMix64};
use stormguard_tower::{Dependency, DependencyConfig, ReplayBody, StormguardLayer};
use support::{Answer, Req};
use tokio::time::Instant;
use tower::{Layer, Service, ServiceExt};

const L: Duration = Duration::from_millis(100);
const PLANNED: f64 = 16.0;
const RUN: Duration = Duration::from_secs(60);

/// The dependency: answers after a latency that depends on the (virtual) time, fails a seeded
/// share of attempts, keeps working when the caller gives up, and records what it sees.
#[derive(Clone)]
struct Upstream {
    start: Instant,
    error_rate: f64,
    latency: fn(Duration) -> Duration,
    in_flight: Arc<AtomicU64>,
    max: Arc<AtomicU64>,
    /// (time since start, +1 / -1): arrivals and completions, to integrate in-flight over time.
    events: Arc<Mutex<Vec<(Duration, i64)>>>,
    /// (time since start, attempt number) of each attempt that arrived.
    arrivals: Arc<Mutex<Vec<(Duration, u32)>>>,
    rng: Arc<Mutex<SplitMix64>>,
    failures: Arc<AtomicU64>,
}

impl Upstream {
    fn new(error_rate: f64, latency: fn(Duration) -> Duration) -> Upstream {
        Upstream {
            start: Instant::now(),
            error_rate,
            latency,
            in_flight: Arc::default(),
            max: Arc::default(),
            events: Arc::default(),
            arrivals: Arc::default(),
            rng: Arc::new(Mutex::new(SplitMix64::new(30))),
            failures: Arc::default(),
        }
    }

    fn handle(&self, attempt: u32) -> impl std::future::Future<Output = u16> + Send + 'static {
        let now = self.start.elapsed();
        let n = self.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        self.max.fetch_max(n, Ordering::SeqCst);
        self.events.lock().unwrap().push((now, 1));
        self.arrivals.lock().unwrap().push((now, attempt));
        let fail = (self.rng.lock().unwrap().below(1_000_000) as f64) < self.error_rate * 1e6;
        if fail {
            self.failures.fetch_add(1, Ordering::SeqCst);
        }
        let latency = (self.latency)(now);
        let this = self.clone();
        // The work runs on its own: a caller that gives up does not stop the dependency.
        let work = tokio::spawn(async move {
            tokio::time::sleep(latency).await;
            this.in_flight.fetch_sub(1, Ordering::SeqCst);
            this.events.lock().unwrap().push((this.start.elapsed(), -1));
        });
        async move {
            let _ = work.await;
            if fail { 503 } else { 200 }
        }
    }

    /// Time-averaged in flight between `from` and `to`.
    fn mean_in_flight(&self, from: Duration, to: Duration) -> f64 {
        let mut events = self.events.lock().unwrap().clone();
        events.sort_by_key(|e| e.0);
        let (mut level, mut area, mut last) = (0i64, 0f64, Duration::ZERO);
        for (t, d) in events {
            let (a, b) = (last.max(from), t.min(to));
            if b > a {
                area += level as f64 * (b - a).as_secs_f64();
            }
            level += d;
            last = t;
        }
        if to > last.max(from) {
            area += level as f64 * (to - last.max(from)).as_secs_f64();
        }
        area / (to - from).as_secs_f64()
    }
}

serve_as_service!(Upstream);

impl Upstream {
    fn serve(&mut self, req: Req) -> Answer {
        let attempt = req
            .headers()
            .get("x-stormguard-attempt")
            .and_then(|v| v.to_str().ok()?.parse().ok())
            .unwrap_or(1);
        let answer = self.handle(attempt);
        Box::pin(async move {
            let status = answer.await;
            Ok(Response::builder()
                .status(status)
                .body(Full::new(Bytes::from_static(b"x")))
                .unwrap())
        })
    }
}

fn request() -> Req {
    Request::builder()
        .method(Method::GET)
        .uri("http://dep/")
        .body(ReplayBody::new(Full::new(Bytes::new()), 1024))
        .unwrap()
}

/// Poisson arrivals at `rate` per second for `RUN`, each running `call` in its own task.
async fn open_loop<F, Fut>(rate: f64, call: F) -> u64
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let mut rng = SplitMix64::new(16);
    let start = Instant::now();
    let mut at = Duration::ZERO;
    let mut tasks = Vec::new();
    loop {
        // Exponential inter-arrival time.
        let u = (rng.below(1 << 53) as f64 + 1.0) / (1u64 << 53) as f64;
        at += Duration::from_secs_f64(-u.ln() / rate);
        if at >= RUN {
            break;
        }
        tokio::time::sleep_until(start + at).await;
        tasks.push(tokio::spawn(call()));
    }
    let n = tasks.len() as u64;
    for t in tasks {
        let _ = t.await;
    }
    n
}

type Call = Box<dyn Fn() -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>>;

fn budgeted(upstream: &Upstream, f: impl FnOnce(&mut DependencyConfig)) -> (Dependency, Call) {
    let mut c = DependencyConfig::new("storm");
    c.limiter.cap = 20;
    c.limiter.queue_len = 10_000;
    c.limiter.queue_timeout = Duration::from_secs(5);
    c.budget = "ratio:percent=0.25,min_per_sec=0".parse().unwrap();
    f(&mut c);
    let dep = Dependency::try_new(c).unwrap();
    let stack = StormguardLayer::new(dep.clone()).layer(upstream.clone());
    let call = move || {
        let s = stack.clone();
        Box::pin(async move {
            if let Ok(resp) = s.oneshot(request()).await {
                let _ = resp.into_body().collect().await;
            }
        }) as std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>
    };
    (dep, Box::new(call))
}

#[tokio::test(start_paused = true)]
async fn a_retry_storm_at_30_percent_errors_stays_under_the_cap_and_the_budget() {
    let rate = PLANNED / L.as_secs_f64();

    // The budgeted stack.
    let upstream = Upstream::new(0.30, |_| L);
    let (dep, call) = budgeted(&upstream, |_| {});
    let sent = open_loop(rate, call).await;
    let max = upstream.max.load(Ordering::SeqCst);
    assert!(max <= 20, "the dependency saw {max} in flight, over the cap of 20");
    let arrivals = upstream.arrivals.lock().unwrap().clone();
    let originals = arrivals.iter().filter(|a| a.1 == 1).count() as u64;
    let retries = arrivals.len() as u64 - originals;
    // Every 10 s window (aligned to zero, as the budget's slices are), with one slice (1 s) of
    // slack for a retry granted before the window and sent in it.
    for w in 0..(RUN.as_secs() / 10) {
        let (from, to) = (Duration::from_secs(w * 10), Duration::from_secs(w * 10 + 10));
        let in_w = |a: &&(Duration, u32)| a.0 >= from && a.0 < to;
        let r = arrivals.iter().filter(in_w).filter(|a| a.1 > 1).count() as u64;
        let o = arrivals
            .iter()
            .filter(|a| a.0 >= from.saturating_sub(Duration::from_secs(1)) && a.0 < to && a.1 == 1)
            .count() as u64;
        assert!(r <= o / 4, "window {w}: {r} retries for {o} originals, over 25 %");
    }
    let s = dep.snapshot();
    let c = &s.counters;
    assert_eq!(c.retries, retries, "every retry sent reached the dependency");
    // At 16 planned under a cap of 20, Poisson bursts fill the cap and queue primaries, and a
    // retry never takes a waiting primary's slot: here the cap binds before the budget does.
    assert!(c.denied(Denied::Cap) > 0, "{c:?}");
    // No failure vanished: each 503 was retried or refused with a reason.
    let failures = upstream.failures.load(Ordering::SeqCst);
    let refused: u64 =
        Denied::ALL.iter().filter(|d| **d != Denied::Queue).map(|d| c.denied(*d)).sum();
    assert_eq!(failures, c.retries + refused, "{c:?}");
    assert_eq!(c.primaries + c.denied(Denied::Queue), sent, "every request admitted or refused");
    let fraction = retries as f64 / originals as f64;
    assert!(fraction <= 0.25 && fraction > 0.1, "retry fraction {fraction}");

    // With a cap that never binds, the budget does: retries stop at 25 % of originals.
    let roomy = Upstream::new(0.30, |_| L);
    let (dep, call) = budgeted(&roomy, |c| c.limiter.cap = 200);
    open_loop(rate, call).await;
    let c = dep.snapshot().counters;
    assert!(c.denied(Denied::Budget) > 0, "the budget was spent and refused retries: {c:?}");
    assert_eq!(c.denied(Denied::Cap), 0);
    let fraction = c.retries as f64 / c.primaries as f64;
    assert!(fraction <= 0.25 && fraction > 0.23, "retry fraction {fraction}");

    // The same arrivals through a naive retry-once client, no cap.
    let naive = Upstream::new(0.30, |_| L);
    let n = naive.clone();
    open_loop(rate, move || {
        let mut svc = n.clone();
        async move {
            for _ in 0..2 {
                let resp = svc.call(request()).await.unwrap();
                if resp.status() == 200 {
                    break;
                }
            }
        }
    })
    .await;
    let mean = naive.mean_in_flight(Duration::from_secs(5), RUN);
    assert!((mean - 20.8).abs() <= 20.8 * 0.05, "naive mean in flight {mean}, expected 20.8 ± 5 %");
    let mean_budgeted = upstream.mean_in_flight(Duration::from_secs(5), RUN);
    eprintln!(
        "storm: budgeted max {max}, mean {mean_budgeted:.2}, retries/originals {retries}/{originals}; naive mean {mean:.2}"
    );
    assert!(mean_budgeted < mean, "budgeted {mean_budgeted} vs naive {mean}");
}

fn rising(t: Duration) -> Duration {
    // Healthy for 10 s, then three times slower than the per-try timeout allows.
    if t < Duration::from_secs(10) { L } else { Duration::from_millis(300) }
}

#[tokio::test(start_paused = true)]
async fn a_slow_dependency_stays_at_the_cap_with_held_slots_and_not_without() {
    let rate = PLANNED / L.as_secs_f64();
    let per_try = Duration::from_millis(200);

    let upstream = Upstream::new(0.0, rising);
    let (dep, call) = budgeted(&upstream, |c| {
        c.per_try_timeout = Some(per_try);
        c.retry.retry_on = "5xx,timeout".parse().unwrap();
        c.limiter.queue_timeout = Duration::from_millis(500);
    });
    open_loop(rate, call).await;
    let max = upstream.max.load(Ordering::SeqCst);
    assert!(max <= 20, "the dependency saw {max} in flight, over the cap of 20");
    assert!(dep.snapshot().counters.denied(Denied::Queue) > 0, "excess primaries were shed");

    // The same stack with the hold turned off: the slot frees at the timeout while the
    // dependency works on, and the cap no longer holds at the dependency.
    let unheld = Upstream::new(0.0, rising);
    let (_, call) = budgeted(&unheld, |c| {
        c.per_try_timeout = Some(per_try);
        c.timeout_slot_hold = Duration::ZERO;
        c.retry.retry_on = "5xx,timeout".parse().unwrap();
        c.limiter.queue_timeout = Duration::from_millis(500);
    });
    open_loop(rate, call).await;
    let unheld_max = unheld.max.load(Ordering::SeqCst);
    assert!(unheld_max > 20, "without the hold the dependency saw only {unheld_max}");

    // A client with a concurrency limit of 20 that frees the slot when it times an attempt out,
    // and retries a timeout once: the dependency is still working on what it gave up.
    let naive = Upstream::new(0.0, rising);
    let limit = Arc::new(tokio::sync::Semaphore::new(20));
    let n = naive.clone();
    open_loop(rate, move || {
        let (mut svc, limit) = (n.clone(), limit.clone());
        async move {
            for _ in 0..2 {
                let Ok(permit) = limit.clone().acquire_owned().await else { return };
                let r = tokio::time::timeout(per_try, svc.call(request())).await;
                drop(permit);
                if let Ok(Ok(resp)) = r
                    && resp.status() == 200
                {
                    break;
                }
            }
        }
    })
    .await;
    let naive_max = naive.max.load(Ordering::SeqCst);
    eprintln!(
        "slow dependency: max in flight {max} with held slots, {unheld_max} without, {naive_max} naive"
    );
    assert!(naive_max > 25, "the naive client kept the dependency at {naive_max}");
}
