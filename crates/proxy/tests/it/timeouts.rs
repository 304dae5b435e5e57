//! The defaults engage on a slow dependency, through the proxy: with nothing configured but a
//! per-try timeout, a GET whose attempt times out is retried (within the budget) and a POST is
//! not. Counted at a chaos upstream on 127.0.0.1 that answers after 3 s, far past the 100 ms
//! per-try timeout, so every attempt times out and the upstream's request count is the number
//! of attempts the proxy sent.

use crate::common;

use common::*;

use std::time::Duration;

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::Full;
use stormguard_chaos::{ChaosServer, Latency, Phase};
use stormguard_proxy::config::{ProxyConfig, ProxyDependency};
use stormguard_proxy::{ProxyHandle, start};

async fn slow_upstream() -> ChaosServer {
    chaos(Phase { latency: Latency::Fixed(Duration::from_secs(3)), ..Phase::default() }).await
}

/// A proxy with every default but a 100 ms per-try timeout (there is no default one), and no
/// admin listener.
async fn proxy(upstream: &ChaosServer, change: impl FnOnce(&mut ProxyDependency)) -> ProxyHandle {
    let mut d = ProxyDependency::new("slow", upstream.url("").parse().unwrap());
    d.per_try_timeout = Some(ms(100));
    change(&mut d);
    let mut c = ProxyConfig::single("127.0.0.1:0".parse().unwrap(), d);
    c.admin = None;
    start(c).await.unwrap()
}

/// Sends one request through the proxy; returns its status, its `x-stormguard-denied` (why the
/// timeout was not retried, if it was a refusal) and the attempts and retries the upstream saw.
async fn attempts(
    p: &ProxyHandle,
    upstream: &ChaosServer,
    method: &str,
    key: bool,
) -> (StatusCode, Option<String>, u64, u64) {
    let mut req =
        Request::builder().method(method).uri(format!("http://{}/pay", p.listen_addrs()[0]));
    if key {
        req = req.header("idempotency-key", "order-7");
    }
    let req = req.body(Full::new(Bytes::from_static(b"{}"))).unwrap();
    let resp = tokio::time::timeout(Duration::from_secs(10), client().request(req))
        .await
        .expect("the proxy answers within 10 s")
        .unwrap();
    let denied = resp.headers().get("x-stormguard-denied").map(|v| v.to_str().unwrap().to_string());
    let seen = upstream.reset();
    (resp.status(), denied, seen.total.requests, seen.total.retries)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_get_that_times_out_is_retried_by_default_a_post_is_not() {
    let upstream = slow_upstream().await;
    let p = proxy(&upstream, |_| {}).await;
    let timeout = StatusCode::GATEWAY_TIMEOUT;
    let why = |r: &str| Some(r.to_string());
    // GET: the first try and max_retries (2) retries, each timed out at the upstream.
    let get = attempts(&p, &upstream, "GET", false).await;
    assert_eq!(get, (timeout, why("attempts"), 3, 2));
    // POST: it may have run; nothing is resent.
    let post = attempts(&p, &upstream, "POST", false).await;
    assert_eq!(post, (timeout, why("non-idempotent"), 1, 0));
    // A POST with an idempotency key is safe to resend.
    let keyed = attempts(&p, &upstream, "POST", true).await;
    assert_eq!(keyed, (timeout, why("attempts"), 3, 2));
    p.shutdown().await;
}

/// Without `timeout` in `retry_on` (the default before it was added) the same GET is sent once:
/// the test above fails if the default does not retry timeouts. And a budget with nothing to
/// spend holds the retries to none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_timeout_in_retry_on_or_budget_the_get_is_sent_once() {
    let upstream = slow_upstream().await;
    let old = "5xx,reset,connect-failure,refused-stream";
    let p = proxy(&upstream, |d| d.retry_on = old.parse().unwrap()).await;
    let get = attempts(&p, &upstream, "GET", false).await;
    assert_eq!(get, (StatusCode::GATEWAY_TIMEOUT, None, 1, 0));
    p.shutdown().await;
    let p = proxy(&upstream, |d| d.budget = "ratio:percent=0,min_per_sec=0".parse().unwrap()).await;
    let get = attempts(&p, &upstream, "GET", false).await;
    assert_eq!(get, (StatusCode::GATEWAY_TIMEOUT, Some("budget".to_string()), 1, 0));
    p.shutdown().await;
}
