//! Callers that retry on their own: the proxy recognises their retries and charges them to the
//! budget (`caller_retries`), counted at the upstream. Each guarantee also runs with
//! `caller_retries = "off"`, where the caller's loop passes the budget by.

use crate::common;
use common::*;

use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use stormguard_chaos::{ChaosServer, Phase};
use stormguard_proxy::callers::CallerRetries;
use stormguard_proxy::config::{ProxyConfig, ProxyDependency};
use stormguard_proxy::{ProxyHandle, start};

async fn proxy(upstream: &ChaosServer, f: impl FnOnce(&mut ProxyDependency)) -> ProxyHandle {
    let mut d = ProxyDependency::new("dep", upstream.url("").parse().unwrap());
    f(&mut d);
    let mut c = ProxyConfig::single("127.0.0.1:0".parse().unwrap(), d);
    c.admin = None;
    start(c).await.unwrap()
}

/// One GET with `headers`; the status and the answer's headers.
async fn get(
    c: &TestClient,
    p: &ProxyHandle,
    headers: &[(&str, String)],
) -> (StatusCode, HeaderMap) {
    let mut req = Request::get(format!("http://{}/item?id=7", p.listen_addrs()[0]));
    for (k, v) in headers {
        req = req.header(*k, v);
    }
    let resp = tokio::time::timeout(
        Duration::from_secs(10),
        c.request(req.body(Full::new(Bytes::new())).unwrap()),
    )
    .await
    .expect("an answer within 10 s")
    .unwrap();
    let (parts, body) = resp.into_parts();
    body.collect().await.unwrap();
    (parts.status, parts.headers)
}

/// A caller's loop: up to `retries` more tries on a 503, without waiting (the loop a
/// hand-written client has; it reads neither `x-should-retry` nor `Retry-After`).
async fn call_with_retries(c: &TestClient, p: &ProxyHandle, retries: u32) -> StatusCode {
    let mut status = StatusCode::OK;
    for _ in 0..=retries {
        status = get(c, p, &[]).await.0;
        if status != StatusCode::SERVICE_UNAVAILABLE {
            break;
        }
    }
    status
}

/// 200 calls of a loop retrying a 503 three times, against 40 % errors, stormguard's own
/// retries off (so every retry the upstream sees is the caller's): with caller_retries
/// enforced, the retries at the upstream stay within the budget (25 % of first tries and its
/// reserve); with it off, the caller's loop sends about 0.6 retries a call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_callers_retry_loop_is_held_to_the_budget() {
    const CALLS: u64 = 200;
    // percent 0.25, reserve 0.5/s × 10 s = 5 retries a window.
    const BOUND: f64 = 0.25 * CALLS as f64 + 5.0;
    let upstream = chaos(Phase { error_rate: 0.4, ..Phase::default() }).await;
    let c = client();
    for mode in [CallerRetries::Enforce, CallerRetries::Off] {
        let p = proxy(&upstream, |d| {
            d.budget = "ratio:percent=0.25,min_per_sec=0.5".parse().unwrap();
            d.max_retries = 0;
            d.caller_retries = mode;
        })
        .await;
        upstream.reset();
        let started = std::time::Instant::now();
        for _ in 0..CALLS {
            call_with_retries(&c, &p, 3).await;
        }
        // Within one window of the budget (its reserve is counted once).
        assert!(started.elapsed() < Duration::from_secs(9), "{:?}", started.elapsed());
        let seen = upstream.stats().total;
        // What the caller's loop cost the upstream beyond one attempt a call (below zero when
        // a call's first try was taken for the repeat of the call before it, and refused).
        let extra = seen.requests as f64 - CALLS as f64;
        let s = p.dependency("dep").unwrap().snapshot().counters;
        p.shutdown().await;
        eprintln!(
            "caller_retries={mode}: {} attempts at the upstream for {CALLS} calls ({} marked as \
             retries), caller retries allowed/refused {:?}",
            seen.requests,
            seen.retries,
            &s.caller_retries[..2]
        );
        match mode {
            CallerRetries::Enforce => {
                assert!(extra <= BOUND, "{extra} attempts beyond one a call > {BOUND}");
                // The budget's own terms: the retries it let through (marked at the upstream)
                // within 25 % of the first tries plus the reserve.
                let firsts = (seen.requests - seen.retries) as f64;
                assert!(seen.retries as f64 <= 0.25 * firsts + 5.0, "{seen:?}");
                assert_eq!(s.retries, seen.retries, "each one charged, and only those");
                assert!(s.caller_retries[1] > 0, "some refused: {s:?}");
            }
            _ => {
                assert!(
                    extra > BOUND,
                    "off: {extra} attempts beyond one a call should pass {BOUND}"
                );
                assert_eq!(seen.retries, 0, "unmarked: the budget never heard of them");
            }
        }
    }
}

/// A caller that repeats a request after a success (polling) is never charged: with a budget
/// of nothing, every poll still reaches the upstream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn polling_after_a_success_is_never_charged() {
    let upstream = chaos(Phase::default()).await;
    let p = proxy(&upstream, |d| d.budget = "ratio:percent=0,min_per_sec=0".parse().unwrap()).await;
    let c = client();
    for _ in 0..30 {
        assert_eq!(get(&c, &p, &[]).await.0, StatusCode::OK);
    }
    assert_eq!(upstream.stats().total.requests, 30);
    assert_eq!(p.dependency("dep").unwrap().snapshot().counters.caller_retries, [0, 0, 0]);
    p.shutdown().await;
}

/// Distinct users' identical requests carrying distinct `traceparent`s are never charged as
/// each other's retries, even after failures and with no budget; without an identity on the
/// wire, the same requests after a failure are taken for a loop's retries (three) and refused,
/// the fourth is a new call — and with `caller_retries = "off"` they all go.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn distinct_traceparents_are_never_each_others_retries() {
    let upstream = chaos(Phase { error_rate: 1.0, ..Phase::default() }).await;
    let c = client();
    for (mode, traced, reach) in [
        (CallerRetries::Enforce, true, 20),
        (CallerRetries::Enforce, false, 5),
        (CallerRetries::Off, false, 20),
    ] {
        let p = proxy(&upstream, |d| {
            d.budget = "ratio:percent=0,min_per_sec=0".parse().unwrap();
            d.max_retries = 0;
            d.caller_retries = mode;
        })
        .await;
        upstream.reset();
        for i in 0..20u32 {
            let trace = format!("00-{:032x}-00f067aa0ba902b7-01", 0xabc0_0000 + i);
            let headers = if traced { vec![("traceparent", trace)] } else { vec![] };
            let (status, h) = get(&c, &p, &headers).await;
            assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
            if i % 4 != 0 && reach == 5 {
                assert_eq!(h["x-stormguard-denied"], "budget", "{i}");
                // A refusal says when to come back, and not to retry now.
                assert_eq!(h["retry-after"], "1");
                assert_eq!(h["x-should-retry"], "false");
            }
        }
        assert_eq!(upstream.stats().total.requests, reach, "{mode} traced={traced}");
        p.shutdown().await;
    }
}

/// A retry loop resends a request's identity unchanged: an `Idempotency-Key` (or the trace id
/// of a `traceparent` whose parent id changes per attempt) makes the repeat a retry; a retry
/// another layer marked (`x-envoy-attempt-count: 2`) is one without any failure seen here.
/// With `caller_retries = "count"` they are counted and sent as first tries.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_resent_with_its_identity_or_marked_is_a_retry() {
    let upstream = chaos(Phase { error_rate: 1.0, ..Phase::default() }).await;
    let c = client();
    for (mode, reach) in [(CallerRetries::Enforce, 2), (CallerRetries::Count, 5)] {
        let p = proxy(&upstream, |d| {
            d.budget = "ratio:percent=0,min_per_sec=0".parse().unwrap();
            d.max_retries = 0;
            d.caller_retries = mode;
        })
        .await;
        upstream.reset();
        let key = || vec![("idempotency-key", "pay-42".to_string())];
        let trace = |parent: &str| {
            vec![("traceparent", format!("00-4bf92f3577b34da6a3ce929d0e0e4736-{parent}-01"))]
        };
        get(&c, &p, &key()).await;
        let keyed = get(&c, &p, &key()).await.1;
        get(&c, &p, &trace("00f067aa0ba902b7")).await;
        let traced = get(&c, &p, &trace("b7ad6b7169203331")).await.1;
        let marked = get(&c, &p, &[("x-envoy-attempt-count", "2".into())]).await.1;
        let denied = |h: &HeaderMap| h.get("x-stormguard-denied").cloned();
        let s = p.dependency("dep").unwrap().snapshot().counters;
        p.shutdown().await;
        // Enforced, only the first keyed and the first traced request reach the upstream (the
        // marked one is a retry wherever it failed before); counted, all five.
        assert_eq!(upstream.stats().total.requests, reach, "{mode}");
        match mode {
            CallerRetries::Enforce => {
                for h in [&keyed, &traced, &marked] {
                    assert_eq!(denied(h).unwrap(), "budget");
                }
                assert_eq!(s.caller_retries, [0, 3, 0]);
            }
            _ => {
                assert_eq!(s.caller_retries, [0, 0, 3]);
                assert!(denied(&marked).is_none_or(|d| d != "budget"));
            }
        }
    }
}

/// Record mode writes a caller's retry as a retry of its own request (no `request` event: it
/// deposits nothing), so `stormguard replay` charges it as the proxy did.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_callers_retry_is_recorded_as_a_retry() {
    let upstream = chaos(Phase { error_rate: 1.0, ..Phase::default() }).await;
    let dir = std::env::temp_dir().join(format!("stormguard-callers-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let trace = dir.join("trace.jsonl");
    let mut d = ProxyDependency::new("dep", upstream.url("").parse().unwrap());
    d.max_retries = 0;
    let mut config = ProxyConfig::single("127.0.0.1:0".parse().unwrap(), d);
    config.admin = None;
    config.record = Some(trace.clone());
    let p = start(config).await.unwrap();
    let c = client();
    get(&c, &p, &[]).await;
    let (_, h) = get(&c, &p, &[]).await;
    // Allowed (the default budget's reserve), sent, failed, and not retried on top.
    assert!(h.contains_key("x-stormguard-denied"), "{h:?}");
    p.shutdown().await;
    let text = std::fs::read_to_string(&trace).unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    let ops: Vec<String> = text
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .map(|v| format!("{} {}", v["id"], v["op"].as_str().unwrap()))
        .collect();
    assert_eq!(
        ops,
        ["1 request", "1 failure", "2 active", "2 retry", "2 failure", "2 retry_done"],
        "{text}"
    );
    assert_eq!(upstream.stats().total.retries, 1, "marked as a retry at the upstream");
}

/// A sender that numbers its attempts is taken at its word: its first try
/// (`x-stainless-retry-count: 0`, as the OpenAI and Anthropic SDKs send) is never the retry of
/// an identical request that failed before it, where the same request unnumbered is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_numbered_first_try_is_a_first_try() {
    let upstream = chaos(Phase { error_rate: 1.0, ..Phase::default() }).await;
    let c = client();
    for (numbered, reach) in [(true, 3), (false, 1)] {
        let p = proxy(&upstream, |d| {
            d.budget = "ratio:percent=0,min_per_sec=0".parse().unwrap();
            d.max_retries = 0;
        })
        .await;
        upstream.reset();
        let headers = if numbered { vec![("x-stainless-retry-count", "0".into())] } else { vec![] };
        for _ in 0..3 {
            get(&c, &p, &headers).await;
        }
        assert_eq!(upstream.stats().total.requests, reach, "numbered={numbered}");
        p.shutdown().await;
    }
}
