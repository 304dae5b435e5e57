//! The defaults engage on a slow dependency: a per-try timeout is in the default `retry_on`, so
//! an idempotent request whose attempt times out is retried (within the budget), and a POST,
//! which may have run, is not. Counted at a real upstream (the chaos server on 127.0.0.1) that
//! answers every request after 3 s, far past the 100 ms per-try timeout: every attempt times
//! out, and the upstream's request count is the number of attempts the stack sent.

use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request};
use http_body_util::Full;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use stormguard_chaos::{ChaosConfig, ChaosServer, Latency, OnDisconnect, Phase};
use stormguard_core::Denied;
use stormguard_tower::{
    Dependency, DependencyConfig, ReplayBody, StormguardError, StormguardLayer,
};
use tower::{Layer, ServiceExt};

type Body = ReplayBody<Full<Bytes>>;

async fn slow_upstream() -> ChaosServer {
    let phase = Phase { latency: Latency::Fixed(Duration::from_secs(3)), ..Phase::default() };
    let mut c = ChaosConfig::single(phase);
    c.on_disconnect = OnDisconnect::Finish;
    stormguard_chaos::spawn(c, "127.0.0.1:0".parse().unwrap()).await.unwrap()
}

/// Every default, and a 100 ms per-try timeout (there is no default one).
fn config(change: impl FnOnce(&mut DependencyConfig)) -> Dependency {
    let mut c = DependencyConfig::new("slow");
    c.per_try_timeout = Some(Duration::from_millis(100));
    change(&mut c);
    Dependency::try_new(c).unwrap()
}

/// Sends one request through the stack; returns the attempts the upstream saw, the retries
/// among them (marked `x-stormguard-attempt` > 1), and why the last timeout was not retried
/// (`None`: the timeout is not in `retry_on`).
async fn attempts(
    dep: &Dependency,
    upstream: &ChaosServer,
    method: Method,
    key: bool,
) -> (u64, u64, Option<Denied>) {
    let client: Client<HttpConnector, Body> = Client::builder(TokioExecutor::new()).build_http();
    let stack = StormguardLayer::new(dep.clone()).layer(client);
    let mut req = Request::builder().method(method).uri(upstream.url("/"));
    if key {
        req = req.header("idempotency-key", "order-7");
    }
    let req = req.body(ReplayBody::new(Full::new(Bytes::from_static(b"{}")), 1024)).unwrap();
    let err = tokio::time::timeout(Duration::from_secs(10), stack.oneshot(req))
        .await
        .expect("the stack answers within 10 s")
        .expect_err("every attempt times out");
    let reason = match err.downcast_ref::<StormguardError>() {
        Some(StormguardError::Timeout) => None,
        Some(StormguardError::NotRetried { reason, source }) => {
            let last = source.downcast_ref::<StormguardError>();
            assert!(matches!(last, Some(StormguardError::Timeout)), "{err}");
            Some(*reason)
        }
        _ => panic!("every attempt times out: {err}"),
    };
    let seen = upstream.reset();
    (seen.total.requests, seen.total.retries, reason)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_get_that_times_out_is_retried_by_default_a_post_is_not() {
    let upstream = slow_upstream().await;
    let dep = config(|_| {});
    // GET: the first try and max_retries (2) retries, every one timed out at the upstream.
    let get = attempts(&dep, &upstream, Method::GET, false).await;
    assert_eq!(get, (3, 2, Some(Denied::Attempts)));
    // POST: it may have run; the timeout is refused as non-idempotent, nothing is resent.
    let post = attempts(&dep, &upstream, Method::POST, false).await;
    assert_eq!(post, (1, 0, Some(Denied::NonIdempotent)));
    assert_eq!(dep.snapshot().counters.denied(Denied::NonIdempotent), 1);
    // A POST with an idempotency key is safe to resend.
    let keyed = attempts(&dep, &upstream, Method::POST, true).await;
    assert_eq!(keyed, (3, 2, Some(Denied::Attempts)));
    assert_eq!(dep.snapshot().counters.retries, 4);
}

/// The same GET without `timeout` in `retry_on` (the default before it was added) is sent once:
/// the test above fails if timeouts are not retried by default.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_timeout_in_retry_on_the_get_is_sent_once() {
    let upstream = slow_upstream().await;
    let dep =
        config(|c| c.retry.retry_on = "5xx,reset,connect-failure,refused-stream".parse().unwrap());
    assert_eq!(attempts(&dep, &upstream, Method::GET, false).await, (1, 0, None));
    assert_eq!(dep.snapshot().counters.not_retryable, 1);
}

/// Within the budget: a budget with nothing to spend refuses the retry of a timed-out GET.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_budget_bounds_timeout_retries() {
    let upstream = slow_upstream().await;
    let dep = config(|c| c.budget = "ratio:percent=0,min_per_sec=0".parse().unwrap());
    let get = attempts(&dep, &upstream, Method::GET, false).await;
    assert_eq!(get, (1, 0, Some(Denied::Budget)));
    assert_eq!(dep.snapshot().counters.denied(Denied::Budget), 1);
}
