//! Downstream pushback, judged by what the caller receives: a request stormguard will not try
//! again for load is answered with `x-should-retry: false` (the OpenAI and Anthropic SDKs' own
//! signal), `Retry-After` when the breaker says how long, and for a gRPC caller a trailers-only
//! `UNAVAILABLE` with `grpc-retry-pushback-ms: -1`; with `downstream_pushback = false` the same
//! refusals carry none of it. (The SDKs themselves are driven in `tests/sdk/`, by
//! `scripts/test`.)

use crate::common;

use common::*;

use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Request, StatusCode};
use http_body_util::Full;
use stormguard_chaos::{ChaosServer, Latency, Phase};
use stormguard_core::breaker::BreakerConfig;
use stormguard_proxy::config::{ProxyConfig, ProxyDependency};
use stormguard_proxy::{ProxyHandle, start};

async fn proxy(
    upstream: &ChaosServer,
    pushback: bool,
    change: impl FnOnce(&mut ProxyDependency),
) -> ProxyHandle {
    let mut d = ProxyDependency::new("dep", upstream.url("").parse().unwrap());
    change(&mut d);
    let mut c = ProxyConfig::single("127.0.0.1:0".parse().unwrap(), d);
    c.admin = None;
    c.listeners[0].downstream_pushback = pushback;
    start(c).await.unwrap()
}

async fn send(p: &ProxyHandle, grpc: bool) -> (StatusCode, HeaderMap) {
    let mut req = Request::builder().method("GET").uri(format!("http://{}/x", p.listen_addrs()[0]));
    if grpc {
        req = req.method("POST").header("content-type", "application/grpc");
    }
    let req = req.body(Full::new(Bytes::new())).unwrap();
    let resp = tokio::time::timeout(Duration::from_secs(10), client().request(req))
        .await
        .expect("the proxy answers within 10 s")
        .unwrap();
    (resp.status(), resp.headers().clone())
}

fn failing() -> Phase {
    Phase { error_rate: 1.0, status: 503, ..Phase::default() }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_retry_tells_the_caller_not_to_retry_and_only_then() {
    let upstream = chaos(failing()).await;
    for pushback in [true, false] {
        let p = proxy(&upstream, pushback, |d| d.max_retries = 1).await;
        let (status, h) = send(&p, false).await;
        // The upstream's 503, relayed after the one retry allowed.
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(h["x-stormguard-denied"], "attempts");
        if pushback {
            assert_eq!(h["x-should-retry"], "false");
        } else {
            assert!(!h.contains_key("x-should-retry"), "{h:?}");
        }
        p.shutdown().await;
    }
    // An answer stormguard did not refuse is untouched.
    let fine = chaos(Phase::default()).await;
    let p = proxy(&fine, true, |_| {}).await;
    let (status, h) = send(&p, false).await;
    assert_eq!(status, StatusCode::OK);
    assert!(!h.contains_key("x-should-retry") && !h.contains_key("retry-after"), "{h:?}");
    p.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_open_breaker_says_when_to_come_back() {
    let upstream = chaos(failing()).await;
    let breaker = |d: &mut ProxyDependency| {
        d.max_retries = 0;
        d.breaker = Some(BreakerConfig {
            consecutive_failures: Some(1),
            break_duration: Duration::from_secs(5),
            ..BreakerConfig::default()
        });
    };
    for pushback in [true, false] {
        let p = proxy(&upstream, pushback, breaker).await;
        // The first failure opens the breaker; the next first try is shed by it.
        let _ = send(&p, false).await;
        let (status, h) = send(&p, false).await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(h["x-stormguard-denied"], "breaker");
        if pushback {
            assert_eq!(h["x-should-retry"], "false");
            // Whole seconds rounded up, of a break kept in whole milliseconds: a refusal within
            // a millisecond of the opening reads 5.000x s, so 6.
            let secs: u64 = h["retry-after"].to_str().unwrap().parse().unwrap();
            assert!((1..=6).contains(&secs), "{secs}");
        } else {
            assert!(!h.contains_key("retry-after") && !h.contains_key("x-should-retry"));
        }
        p.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shed_grpc_call_gets_unavailable_with_pushback() {
    // One slot, no queue: while a slow call holds the slot, the next is shed at once.
    let upstream =
        chaos(Phase { latency: Latency::Fixed(Duration::from_millis(800)), ..Phase::default() })
            .await;
    for pushback in [true, false] {
        let p = proxy(&upstream, pushback, |d| {
            d.cap = 1;
            d.queue = 0;
        })
        .await;
        let addr = p.listen_addrs()[0];
        let holder = tokio::spawn(async move {
            let req = Request::get(format!("http://{addr}/slow")).body(Full::new(Bytes::new()));
            client().request(req.unwrap()).await.map(|r| r.status())
        });
        // Wait until the upstream has the first call (it holds the only slot).
        while upstream.stats().in_flight_now == 0 {
            tokio::time::sleep(ms(5)).await;
        }
        let (status, h) = send(&p, true).await;
        assert_eq!(h["x-stormguard-denied"], "queue");
        if pushback {
            assert_eq!(status, StatusCode::OK);
            assert_eq!(h["content-type"], "application/grpc");
            assert_eq!(h["grpc-status"], "14");
            assert_eq!(h["grpc-retry-pushback-ms"], "-1");
            assert_eq!(h["x-should-retry"], "false");
        } else {
            assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
            assert!(!h.contains_key("grpc-retry-pushback-ms"));
        }
        assert_eq!(holder.await.unwrap().unwrap(), StatusCode::OK);
        p.shutdown().await;
    }
}
