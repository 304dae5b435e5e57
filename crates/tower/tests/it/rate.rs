//! Rate admission's bookings never leak: 10 000 requests through the tower stack to a provider
//! that answers with `usage`, with 429s, with resets, and too slowly (the per-try timeout cuts
//! the attempt, which runs on in the background), while some callers give up. When every
//! attempt has ended, nothing is outstanding in any limit, and the tokens counted are the ones
//! the provider stated (settled), or the estimate (an attempt whose answer never came).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, Response};
use http_body_util::{BodyExt, Full};
use stormguard_tower::extensions::RateCost;
use stormguard_tower::{
    BoxError, Dependency, DependencyConfig, ReplayBody, Spawner, StormguardLayer,
};
use tower::{Layer, Service, ServiceExt};

type Req = Request<ReplayBody<Full<Bytes>>>;

/// A provider with five ways to answer, in turn.
#[derive(Clone, Default)]
struct Provider {
    calls: Arc<AtomicU64>,
}

impl Service<Req> for Provider {
    type Response = Response<Full<Bytes>>;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, BoxError>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, _req: Req) -> Self::Future {
        let n = self.calls.fetch_add(1, Ordering::SeqCst);
        Box::pin(async move {
            let ok = |body: &'static str| {
                Ok(Response::builder()
                    .header("x-ratelimit-limit-requests", "1000000")
                    .header("x-ratelimit-limit-tokens", "100000000")
                    .body(Full::new(Bytes::from_static(body.as_bytes())))
                    .unwrap())
            };
            match n % 5 {
                0 => ok(r#"{"usage":{"prompt_tokens":3,"completion_tokens":7}}"#),
                1 => Ok(Response::builder()
                    .status(429)
                    .header("x-ratelimit-limit-requests", "1000000")
                    .header("x-ratelimit-limit-tokens", "100000000")
                    .header("retry-after-ms", "1")
                    .body(Full::new(Bytes::new()))
                    .unwrap()),
                2 => Err(std::io::Error::from(std::io::ErrorKind::ConnectionReset).into()),
                3 => {
                    // Past the per-try timeout: cut, and run on in the background.
                    tokio::time::sleep(Duration::from_millis(300)).await;
                    ok(r#"{"usage":{"prompt_tokens":3,"completion_tokens":7}}"#)
                }
                _ => ok(r#"{"id":"no usage stated"}"#),
            }
        })
    }
}

fn request() -> Req {
    let mut req = Request::builder()
        .method(Method::POST)
        .uri("http://provider/v1/chat/completions")
        .header("idempotency-key", "k")
        .body(ReplayBody::new(Full::new(Bytes::from_static(b"{}")), 1024))
        .unwrap();
    req.extensions_mut().insert(RateCost { input: 10, output: 20 });
    req
}

#[tokio::test(start_paused = true)]
async fn bookings_balance_to_zero_after_10_000_requests() {
    let mut c = DependencyConfig::new("llm");
    c.limiter.cap = 50;
    c.limiter.queue_len = 1_000;
    c.per_try_timeout = Some(Duration::from_millis(100));
    c.background = Some(Spawner::tokio());
    c.rate.requests_per_minute = Some(1_000_000);
    c.rate.tokens_per_minute = Some(100_000_000);
    c.rate.learn = true;
    c.retry.retry_on = "5xx,429,reset,timeout".parse().unwrap();
    let dep = Dependency::try_new(c).unwrap();
    let provider = Provider::default();
    let svc = StormguardLayer::new(dep.clone()).layer(provider.clone());
    let rates = dep.rates().unwrap().clone();
    let mut seen_outstanding = 0;
    for batch in 0..100u64 {
        let mut calls = Vec::new();
        for i in 0..100u64 {
            let svc = svc.clone();
            calls.push(tokio::spawn(async move {
                let call = async move {
                    if let Ok(resp) = svc.oneshot(request()).await {
                        // Read the answer to its end: that settles the booking.
                        let _ = resp.into_body().collect().await;
                    }
                };
                if (batch * 100 + i) % 7 == 0 {
                    // The caller gives up before the answer.
                    let _ = tokio::time::timeout(Duration::from_millis(50), call).await;
                } else {
                    call.await;
                }
            }));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
        seen_outstanding = seen_outstanding.max(rates.snapshot(dep.now()).tokens.outstanding);
        for c in calls {
            c.await.unwrap();
        }
    }
    // Every attempt cut by its timeout or left by its caller runs on until the provider
    // answers (300 ms at most).
    tokio::time::sleep(Duration::from_secs(1)).await;
    let s = rates.snapshot(dep.now());
    assert!(seen_outstanding > 0, "bookings are seen while attempts are in flight");
    let calls = provider.calls.load(Ordering::SeqCst);
    assert!(calls >= 10_000, "{calls} attempts reached the provider");
    for (what, limit) in [
        ("requests", s.requests),
        ("tokens", s.tokens),
        ("input tokens", s.input_tokens),
        ("output tokens", s.output_tokens),
    ] {
        assert_eq!(limit.outstanding, 0, "{what}: a booking leaked");
    }
    assert_eq!(dep.snapshot().limiter.in_flight, 0);
}

/// First tries that find the window empty wait for their turns, first come first served:
/// three at once on a 60-a-minute limit whose bucket the provider said is empty reach the
/// provider one second apart, in the order they came, and the waits are counted. Without rate
/// admission all three are sent at once.
#[tokio::test(start_paused = true)]
async fn first_tries_wait_their_turns_in_order() {
    for rated in [true, false] {
        let mut c = DependencyConfig::new("llm");
        c.limiter.queue_timeout = Duration::from_secs(5);
        if rated {
            c.rate.requests_per_minute = Some(60);
        }
        let dep = Dependency::try_new(c).unwrap();
        if let Some(r) = dep.rates() {
            let mut h = http::HeaderMap::new();
            h.insert("x-ratelimit-remaining-requests", "0".parse().unwrap());
            r.observe(dep.now(), &stormguard_http::provider::read_limits(&h).stated());
        }
        let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
        let svc = tower::service_fn({
            let seen = seen.clone();
            let start = tokio::time::Instant::now();
            move |req: Req| {
                let n = req.headers()["x-n"].to_str().unwrap().to_string();
                seen.lock().unwrap().push((n, start.elapsed().as_millis()));
                async { Ok::<_, BoxError>(Response::new(Full::new(Bytes::new()))) }
            }
        });
        let svc = StormguardLayer::new(dep.clone()).layer(svc);
        let mut calls = Vec::new();
        for n in 0..3 {
            let mut req = request();
            req.headers_mut().insert("x-n", n.to_string().parse().unwrap());
            calls.push(tokio::spawn(svc.clone().oneshot(req)));
            tokio::task::yield_now().await;
        }
        for c in calls {
            assert_eq!(c.await.unwrap().unwrap().status(), 200);
        }
        let seen = seen.lock().unwrap().clone();
        if rated {
            let want: Vec<(String, u128)> =
                vec![("0".into(), 1_000), ("1".into(), 2_000), ("2".into(), 3_000)];
            assert_eq!(seen, want);
            let s = dep.rates().unwrap().snapshot(dep.now());
            assert_eq!((s.waits, s.waited), (3, Duration::from_secs(6)));
        } else {
            assert!(seen.iter().all(|(_, at)| *at == 0), "{seen:?}");
        }
    }
}

/// A first try whose caller leaves while it waits for its turn gives the turn back: the next
/// caller's turn comes a refill sooner (at 2 s, beside the one booked before it, not at 3 s),
/// and the provider never sees more than the refill allows.
#[tokio::test(start_paused = true)]
async fn a_caller_that_leaves_before_its_turn_gives_it_back() {
    let mut c = DependencyConfig::new("llm");
    c.limiter.queue_timeout = Duration::from_secs(5);
    c.rate.requests_per_minute = Some(60);
    let dep = Dependency::try_new(c).unwrap();
    let mut h = http::HeaderMap::new();
    h.insert("x-ratelimit-remaining-requests", "0".parse().unwrap());
    dep.rates().unwrap().observe(dep.now(), &stormguard_http::provider::read_limits(&h).stated());
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let start = tokio::time::Instant::now();
    let svc = tower::service_fn({
        let seen = seen.clone();
        move |req: Req| {
            let n = req.headers()["x-n"].to_str().unwrap().to_string();
            seen.lock().unwrap().push((n, start.elapsed().as_millis()));
            async { Ok::<_, BoxError>(Response::new(Full::new(Bytes::new()))) }
        }
    });
    let svc = StormguardLayer::new(dep.clone()).layer(svc);
    let call = |n: &str| {
        let mut req = request();
        req.headers_mut().insert("x-n", n.parse().unwrap());
        tokio::spawn(svc.clone().oneshot(req))
    };
    let leaves = call("a"); // turn at 1 s
    tokio::task::yield_now().await;
    let b = call("b"); // turn at 2 s
    tokio::task::yield_now().await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    leaves.abort();
    let _ = leaves.await;
    let c = call("c");
    b.await.unwrap().unwrap();
    c.await.unwrap().unwrap();
    let seen = seen.lock().unwrap().clone();
    assert_eq!(seen, vec![("b".to_string(), 2_000), ("c".to_string(), 2_000)]);
    assert_eq!(dep.rates().unwrap().snapshot(dep.now()).requests.outstanding, 0);
}
