//! Several upstreams behind one dependency: failover spends the shared budget, each upstream's
//! cap holds at that upstream, an open breaker sends primaries on, and a stated `remaining`
//! at the reserve holds retries to that upstream before any 429.

use crate::common;

use common::*;

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use stormguard_chaos::load::{self, Live, LoadConfig, Mode};
use stormguard_chaos::{ChaosServer, Latency, Phase};
use stormguard_core::breaker::BreakerConfig;
use stormguard_proxy::config::{ProxyConfig, ProxyDependency};
use stormguard_proxy::{ProxyHandle, start};

fn providers(a: &ChaosServer, b: &str) -> ProxyDependency {
    let mut d = ProxyDependency::new("models", a.url("").parse().unwrap());
    d.upstreams.push(b.parse().unwrap());
    d.backoff = stormguard_core::backoff::BackoffConfig::parse_range("1ms..2ms").unwrap();
    d.max_retries = 1;
    d
}

async fn proxy(d: ProxyDependency) -> ProxyHandle {
    let mut c = ProxyConfig::single("127.0.0.1:0".parse().unwrap(), d);
    c.admin = Some("127.0.0.1:0".parse().unwrap());
    start(c).await.unwrap()
}

async fn get(c: &TestClient, p: &ProxyHandle) -> (StatusCode, http::HeaderMap) {
    let req = Request::get(format!("http://{}/v1/chat", p.listen_addrs()[0]))
        .header("x-request-id", crate::common::request_id())
        .body(Full::new(Bytes::new()))
        .unwrap();
    let resp =
        tokio::time::timeout(Duration::from_secs(10), c.request(req)).await.unwrap().unwrap();
    let (parts, body) = resp.into_parts();
    body.collect().await.unwrap();
    (parts.status, parts.headers)
}

/// The first provider fails: each request's retry fails over to the second, spending the
/// dependency's one budget. With that budget spent, the caller gets the first provider's
/// answer and the second sees nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failover_to_the_second_provider_spends_the_shared_budget() {
    let a = chaos(Phase { error_rate: 1.0, status: 503, ..Phase::default() }).await;
    let b = chaos(Phase::default()).await;
    let mut d = providers(&a, &b.url(""));
    d.budget = "token-bucket:max_tokens=10,token_ratio=1".parse().unwrap();
    let p = proxy(d).await;
    let c = client();
    for _ in 0..3 {
        let (status, headers) = get(&c, &p).await;
        assert_eq!(status, StatusCode::OK, "answered by the second provider");
        assert!(!headers.contains_key("x-stormguard-denied"));
    }
    assert_eq!((a.stats().total.requests, b.stats().total.requests), (3, 3));
    assert_eq!(b.stats().total.retries, 3, "each one a retry (x-stormguard-attempt: 2)");
    let s = p.dependency("models").unwrap().snapshot();
    assert_eq!((s.counters.primaries, s.counters.retries), (3, 3), "failovers are retries");
    // 10 tokens, -1 per failure, +1 per success: still above 5.
    assert_eq!(s.budget.balance, 10.0);
    p.shutdown().await;

    // No budget: no failover.
    a.reset();
    b.reset();
    let mut d = providers(&a, &b.url(""));
    d.budget = "ratio:percent=0,min_per_sec=0".parse().unwrap();
    let p = proxy(d).await;
    let (status, headers) = get(&c, &p).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "the first provider's answer");
    assert_eq!(headers["x-stormguard-denied"], "budget");
    assert_eq!((a.stats().total.requests, b.stats().total.requests), (1, 0));
    p.shutdown().await;
}

/// Each provider has its own cap, held at that provider, under open-loop load above both; the
/// same load with one cap of 20 for each goes over the small ones.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_upstream_caps_each_held_at_their_upstream() {
    let a =
        chaos(Phase { error_rate: 0.5, latency: Latency::Fixed(ms(30)), ..Phase::default() }).await;
    let b = chaos(Phase { latency: Latency::Fixed(ms(30)), ..Phase::default() }).await;
    for own_caps in [true, false] {
        a.reset();
        b.reset();
        let mut d = providers(&a, &b.url(""));
        d.cap = 20;
        if own_caps {
            d.upstream_caps = vec![Some(6), Some(3)];
        }
        d.queue = 10_000;
        d.queue_timeout = Duration::from_secs(5);
        d.budget = "ratio:percent=10,min_per_sec=1000".parse().unwrap();
        let p = proxy(d).await;
        let mut l = LoadConfig::new(&format!("http://{}/", p.listen_addrs()[0])).unwrap();
        // 6 slots of 30 ms serve 200/s; 400/s arrive, half of them fail over to b.
        l.mode = Mode::Open { rate: "400/s".parse().unwrap(), max_outstanding: 2000 };
        l.duration = Some(ms(1000));
        l.timeout = Duration::from_secs(10);
        let r = load::run(&l, &Live::default()).await.unwrap();
        assert_eq!(r.outcomes.total(), r.scheduled, "count in = count out: {:?}", r.outcomes);
        let (max_a, max_b) = (a.stats().total.in_flight.max, b.stats().total.in_flight.max);
        if own_caps {
            assert!(max_a <= 6 && max_b <= 3, "each cap held at its upstream: {max_a}, {max_b}");
            assert!(b.stats().total.requests > 0, "b served the failovers");
        } else {
            assert!(max_a > 6, "one cap of 20 each lets the first provider go past 6: {max_a}");
        }
        p.shutdown().await;
    }
}

/// When the first provider's breaker opens, primaries go to the second as primaries (no
/// retry, no budget).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_open_breaker_sends_primaries_to_the_next_upstream() {
    let a = chaos(Phase { error_rate: 1.0, status: 503, ..Phase::default() }).await;
    let b = chaos(Phase::default()).await;
    let mut d = providers(&a, &b.url(""));
    d.budget = "ratio:percent=0,min_per_sec=0".parse().unwrap();
    d.breaker = Some(BreakerConfig {
        consecutive_failures: Some(3),
        break_duration: Duration::from_secs(30),
        ..BreakerConfig::default()
    });
    let p = proxy(d).await;
    let c = client();
    for _ in 0..3 {
        assert_eq!(get(&c, &p).await.0, StatusCode::SERVICE_UNAVAILABLE);
    }
    for _ in 0..5 {
        assert_eq!(get(&c, &p).await.0, StatusCode::OK, "the second provider, as a primary");
    }
    assert_eq!(a.stats().total.requests, 3, "nothing more to the open breaker");
    assert_eq!((b.stats().total.requests, b.stats().total.retries), (5, 0));
    let s = p.dependency("models").unwrap().snapshot();
    assert_eq!((s.counters.primaries, s.counters.retries), (8, 0));
    let admin = format!("http://{}/metrics", p.admin_addr().unwrap());
    let req = Request::get(admin).body(Full::new(Bytes::new())).unwrap();
    let text = c.request(req).await.unwrap().into_body().collect().await.unwrap().to_bytes();
    let text = String::from_utf8(text.to_vec()).unwrap();
    let open = format!(
        "stormguard_upstream_breaker_open{{dependency=\"models\",upstream=\"{}\"}} 1",
        a.local_addr()
    );
    assert!(text.contains(&open), "{open}\n{text}");
    p.shutdown().await;
}

/// A rate-limited provider: each answer says how many requests are left in its window
/// (`x-ratelimit-remaining`, reset in 30 s), and 429 once none is.
async fn rate_limited(limit: u64) -> (std::net::SocketAddr, Arc<AtomicU64>, Arc<AtomicU64>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (used, throttled) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let (u, t) = (used.clone(), throttled.clone());
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else { return };
            let (u, t) = (u.clone(), t.clone());
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(move |_req| {
                    let n = u.fetch_add(1, Ordering::SeqCst) + 1;
                    let mut resp = Response::new(Full::new(Bytes::from_static(b"ok\n")));
                    if n > limit {
                        t.fetch_add(1, Ordering::SeqCst);
                        *resp.status_mut() = StatusCode::TOO_MANY_REQUESTS;
                    }
                    let left = limit.saturating_sub(n);
                    resp.headers_mut().insert("x-ratelimit-remaining", left.into());
                    resp.headers_mut().insert("x-ratelimit-reset", 30.into());
                    async move { Ok::<_, Infallible>(resp) }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
    (addr, used, throttled)
}

/// The second provider says it has 3 requests left, then 0: from then on retries to it are
/// held (refused `pushback`) until its reset — it never answers 429. The first provider's
/// failures reach the caller with the reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remaining_at_the_reserve_holds_retries_before_any_429() {
    let a = chaos(Phase { error_rate: 1.0, status: 503, ..Phase::default() }).await;
    let (b, used, throttled) = rate_limited(3).await;
    let mut d = providers(&a, &format!("http://{b}"));
    d.budget = "ratio:percent=10,min_per_sec=1000".parse().unwrap();
    let p = proxy(d).await;
    let c = client();
    let mut answers = Vec::new();
    for _ in 0..8 {
        let (status, headers) = get(&c, &p).await;
        let denied = headers.get("x-stormguard-denied").map(|v| v.to_str().unwrap().to_string());
        answers.push((status.as_u16(), denied));
    }
    let ok = (200, None);
    let held = (503, Some("pushback".to_string()));
    assert_eq!(
        answers,
        [ok.clone(), ok.clone(), ok, held.clone(), held.clone(), held.clone(), held.clone(), held]
    );
    assert_eq!(used.load(Ordering::SeqCst), 3, "three requests used the window");
    assert_eq!(throttled.load(Ordering::SeqCst), 0, "no 429, ever");
    // The hold is the second provider's: the first still gets every primary.
    assert_eq!(a.stats().total.requests, 8);
    p.shutdown().await;
}

/// A total cap across the providers: one chaos server reached under two names (so it counts
/// what both "providers" send it) with caps of 12 each and a total of 14 never sees more than
/// 14; without the total cap it sees up to 24.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_total_cap_holds_across_the_upstreams() {
    let both =
        chaos(Phase { error_rate: 0.5, latency: Latency::Fixed(ms(30)), ..Phase::default() }).await;
    let other_name = format!("http://localhost:{}", both.local_addr().port());
    for total in [Some(14), None] {
        both.reset();
        let mut d = providers(&both, &other_name);
        d.upstream_caps = vec![Some(12), Some(12)];
        d.total_cap = total;
        d.queue = 10_000;
        d.queue_timeout = Duration::from_secs(5);
        d.budget = "ratio:percent=10,min_per_sec=1000".parse().unwrap();
        let p = proxy(d).await;
        let mut l = LoadConfig::new(&format!("http://{}/", p.listen_addrs()[0])).unwrap();
        // 12 slots of 30 ms serve 400/s; 600/s arrive and half of them fail over.
        l.mode = Mode::Open { rate: "600/s".parse().unwrap(), max_outstanding: 4000 };
        l.duration = Some(ms(1000));
        l.timeout = Duration::from_secs(10);
        let r = load::run(&l, &Live::default()).await.unwrap();
        assert_eq!(r.outcomes.total(), r.scheduled, "count in = count out: {:?}", r.outcomes);
        let max = both.stats().total.in_flight.max;
        match total {
            Some(t) => assert!(max <= t, "the total cap held across both names: {max}"),
            None => assert!(max > 14, "two caps of 12 add up: {max}"),
        }
        p.shutdown().await;
    }
}
