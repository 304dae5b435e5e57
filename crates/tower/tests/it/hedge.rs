//! Hedged requests, judged at the dependency and on a virtual clock (tokio's paused time, so
//! the latencies are exact and nothing depends on the machine): a dependency whose every 20th
//! attempt takes 1 s and the rest 20 ms, and 16 callers in a closed loop. With `hedge_after =
//! 100ms` (and a cap of 40: room for the losers that run on) the callers' p99 falls from the tail (1 s) to about the hedge's delay plus a fast
//! answer; the extra attempts stay within the budget; the dependency never works on more than
//! the cap, losers included (they run on to their answers, holding their slots). A POST is
//! never hedged. At 40 % errors, retries and hedges share one budget.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, Response};
use http_body_util::{BodyExt, Full};
use stormguard_core::hedge::{HedgeAfter, HedgeConfig};
use stormguard_tower::{
    BoxError, Dependency, DependencyConfig, ReplayBody, Spawner, StormguardLayer,
};
use tower::{Layer, Service, ServiceExt};

type Req = Request<ReplayBody<Full<Bytes>>>;

/// Every `slow_every`-th attempt takes 1 s, the rest 20 ms; every attempt whose number modulo
/// 10 is below `errors_in_10` answers 503. The work runs in its own task: it goes on after its
/// client has gone, as a real server's does, and the count in flight is taken there.
#[derive(Clone)]
struct LongTail {
    slow_every: u64,
    errors_in_10: u64,
    received: Arc<AtomicU64>,
    hedges: Arc<AtomicU64>,
    in_flight: Arc<AtomicU64>,
    max: Arc<AtomicU64>,
}

impl LongTail {
    fn new(slow_every: u64, errors_in_10: u64) -> LongTail {
        LongTail {
            slow_every,
            errors_in_10,
            received: Arc::default(),
            hedges: Arc::default(),
            in_flight: Arc::default(),
            max: Arc::default(),
        }
    }
}

impl Service<Req> for LongTail {
    type Response = Response<Full<Bytes>>;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, BoxError>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Req) -> Self::Future {
        let n = self.received.fetch_add(1, Ordering::SeqCst);
        if req
            .headers()
            .get("x-stormguard-attempt")
            .is_some_and(|v| v.as_bytes().ends_with(b"hedge"))
        {
            self.hedges.fetch_add(1, Ordering::SeqCst);
        }
        let now = self.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        self.max.fetch_max(now, Ordering::SeqCst);
        let slow = n % self.slow_every == self.slow_every - 1;
        let status = if n % 10 < self.errors_in_10 { 503 } else { 200 };
        let in_flight = self.in_flight.clone();
        let (tx, rx) = tokio::sync::oneshot::channel();
        tokio::spawn(async move {
            let took = if slow { Duration::from_secs(1) } else { Duration::from_millis(20) };
            tokio::time::sleep(took).await;
            in_flight.fetch_sub(1, Ordering::SeqCst);
            let _ = tx.send(status);
        });
        Box::pin(async move {
            let status = rx.await.unwrap_or(500);
            Ok(Response::builder().status(status).body(Full::new(Bytes::new())).unwrap())
        })
    }
}

const CAP: u64 = 40;

fn dependency(hedge: bool, budget: &str) -> Dependency {
    let mut c = DependencyConfig::new("tail");
    c.limiter.cap = CAP;
    c.budget = budget.parse().unwrap();
    c.background = Some(Spawner::tokio());
    c.timeout_slot_hold = Duration::from_secs(5);
    c.abandon_hold = Duration::from_secs(5);
    if hedge {
        c.retry.hedge = Some(HedgeConfig::new(HedgeAfter::Fixed(Duration::from_millis(100))));
    }
    Dependency::try_new(c).unwrap()
}

fn request(method: Method) -> Req {
    Request::builder()
        .method(method)
        .uri("http://tail/x")
        .body(ReplayBody::new(Full::new(Bytes::new()), 1024))
        .unwrap()
}

/// 16 callers, `each` requests apiece, closed loop: every latency (virtual), and the statuses.
async fn run(dep: &Dependency, up: &LongTail, method: Method, each: usize) -> (Vec<Duration>, u64) {
    let svc = StormguardLayer::new(dep.clone()).layer(up.clone());
    let mut callers = Vec::new();
    for _ in 0..16 {
        let svc = svc.clone();
        let method = method.clone();
        callers.push(tokio::spawn(async move {
            let mut out = Vec::new();
            let mut ok = 0u64;
            for _ in 0..each {
                let start = tokio::time::Instant::now();
                if let Ok(resp) = svc.clone().oneshot(request(method.clone())).await {
                    ok += u64::from(resp.status() == 200);
                    let _ = resp.into_body().collect().await;
                }
                out.push(start.elapsed());
            }
            (out, ok)
        }));
    }
    let mut all = Vec::new();
    let mut ok = 0;
    for c in callers {
        let (l, o) = c.await.unwrap();
        all.extend(l);
        ok += o;
    }
    // The losers finish their work.
    tokio::time::sleep(Duration::from_secs(2)).await;
    all.sort();
    (all, ok)
}

fn p99(sorted: &[Duration]) -> Duration {
    sorted[(sorted.len() * 99).div_ceil(100) - 1]
}

#[tokio::test(start_paused = true)]
async fn a_long_tail_is_cut_by_hedges_within_the_budget_and_the_cap() {
    const EACH: usize = 50;
    let requests = 16 * EACH as u64;
    for hedge in [true, false] {
        let up = LongTail::new(20, 0);
        let dep = dependency(hedge, "ratio:percent=0.2,min_per_sec=10,ttl=10s");
        let (latencies, ok) = run(&dep, &up, Method::GET, EACH).await;
        let extra = up.received.load(Ordering::SeqCst) - requests;
        let p99 = p99(&latencies);
        let c = dep.snapshot().counters;
        eprintln!(
            "hedge={hedge}: p99 {p99:?}, {extra} extra attempts ({} hedges, {} won, refused: cap {} budget {}), max in flight {}",
            c.hedges,
            c.hedges_won,
            c.hedge_denied(stormguard_core::Denied::Cap),
            c.hedge_denied(stormguard_core::Denied::Budget),
            up.max.load(Ordering::SeqCst)
        );
        assert_eq!(ok, requests, "every request answered 200");
        assert!(up.max.load(Ordering::SeqCst) <= CAP, "the cap holds, losers included");
        if hedge {
            assert!(p99 <= Duration::from_millis(200), "p99 with hedging: {p99:?}");
            assert!(
                extra > 0 && extra == up.hedges.load(Ordering::SeqCst),
                "every extra attempt a hedge"
            );
            // The budget: 20 % of the requests plus its floor's reserve.
            assert!(extra as f64 <= 0.2 * requests as f64 + 100.0, "{extra}");
            assert_eq!(c.hedges, extra);
        } else {
            assert!(p99 >= Duration::from_secs(1), "p99 without hedging: {p99:?}");
            assert_eq!(extra, 0);
        }
    }
}

#[tokio::test(start_paused = true)]
async fn a_post_is_never_hedged() {
    let up = LongTail::new(2, 0); // every other attempt is slow
    let dep = dependency(true, "ratio:percent=1,min_per_sec=100");
    let (latencies, _) = run(&dep, &up, Method::POST, 4).await;
    assert_eq!(up.hedges.load(Ordering::SeqCst), 0);
    assert_eq!(up.received.load(Ordering::SeqCst), 64);
    assert!(p99(&latencies) >= Duration::from_secs(1));
    assert_eq!(dep.snapshot().counters.hedge_denied(stormguard_core::Denied::NonIdempotent), 32);
}

/// At 40 % errors, retries and hedges spend one budget: all the extra attempts together stay
/// within it (20 % of the requests, no floor), and the cap holds. The same requests with the
/// budget's percent at 100 % draw far more.
#[tokio::test(start_paused = true)]
async fn retries_and_hedges_share_one_budget() {
    const EACH: usize = 50;
    let requests = 16 * EACH as u64;
    for percent in ["0.2", "1"] {
        let up = LongTail::new(20, 4);
        let budget = format!("ratio:percent={percent},min_per_sec=0,ttl=60s");
        let dep = dependency(true, &budget);
        let _ = run(&dep, &up, Method::GET, EACH).await;
        let extra = up.received.load(Ordering::SeqCst) - requests;
        let c = dep.snapshot().counters;
        eprintln!(
            "percent={percent}: {extra} extra attempts ({} retries, {} hedges), max in flight {}",
            c.retries,
            c.hedges,
            up.max.load(Ordering::SeqCst)
        );
        assert!(up.max.load(Ordering::SeqCst) <= CAP);
        assert_eq!(extra, c.retries + c.hedges);
        if percent == "0.2" {
            assert!(c.retries > 0 && c.hedges > 0, "both spent it");
            assert!(extra as f64 <= 0.2 * requests as f64 + 1.0, "{extra} extra attempts");
        } else {
            assert!(extra as f64 > 0.2 * requests as f64 + 1.0, "{extra}");
        }
    }
}

/// Hedges are extra attempts of the call tree too: with the tree's allowance at 1.1 they stay
/// within a tenth of the requests though the budget would allow every one, the rest refused
/// as `tree`.
#[tokio::test(start_paused = true)]
async fn hedges_are_charged_to_the_call_tree() {
    let up = LongTail::new(2, 0); // every other attempt is slow: a hedge is due for half
    let dep = dependency(true, "ratio:percent=1,min_per_sec=100");
    let svc = StormguardLayer::new(dep.clone()).layer(up.clone());
    let requests = 200u64;
    for _ in 0..requests {
        let mut req = request(Method::GET);
        req.headers_mut().insert("baggage", "stormguard-tree=1.1".parse().unwrap());
        let resp = svc.clone().oneshot(req).await.unwrap();
        let _ = resp.into_body().collect().await;
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let hedges = up.hedges.load(Ordering::SeqCst);
    let c = dep.snapshot().counters;
    assert!(hedges > 0 && hedges <= requests / 10 + 1, "{hedges} hedges");
    assert!(c.hedge_denied(stormguard_core::Denied::Tree) > 0);
    let t = dep.snapshot().tree;
    assert_eq!(t.charged - t.refunded, hedges);
}
