//! reqwest's own retries (since 0.12.23) sit below every middleware: a `Client` built with its
//! defaults resends a request refused by an HTTP/2 protocol NACK (`REFUSED_STREAM`, a graceful
//! `GOAWAY`) up to twice, with no budget. Under stormguard that multiplies every attempt it
//! admits, uncounted. The README's setting, `.retry(reqwest::retry::never())`, turns them off:
//! then the upstream sees exactly the attempts stormguard decided.

use crate::support;

use std::sync::atomic::Ordering;

use reqwest_middleware::ClientBuilder;
use stormguard_reqwest::{Denied, Refusal, StormguardMiddleware};
use support::{dependency, refusing_h2};

/// One GET through stormguard (max_retries 2, a budget that never refuses) to an upstream that
/// refuses every stream; returns (streams the upstream saw, attempts stormguard sent).
async fn one_call(reqwest: reqwest::Client) -> (u64, u64) {
    let (addr, streams) = refusing_h2().await;
    let dep = dependency(|c| c.budget = "ratio:percent=10,min_per_sec=100".parse().unwrap());
    let client = ClientBuilder::new(reqwest).with(StormguardMiddleware::new(dep.clone())).build();
    let err = client.get(format!("http://{addr}/")).send().await.unwrap_err();
    assert_eq!(err.denied(), Some(Denied::Attempts), "{err:?}");
    let c = dep.snapshot().counters;
    (streams.load(Ordering::SeqCst), c.primaries + c.retries)
}

#[tokio::test]
async fn reqwest_retries_stack_under_stormguard_unless_turned_off() {
    // reqwest's defaults: each of stormguard's three attempts is sent three times.
    let defaults = reqwest::Client::builder().http2_prior_knowledge().build().unwrap();
    let (streams, attempts) = one_call(defaults).await;
    assert_eq!(attempts, 3);
    assert_eq!(streams, 9, "reqwest's own retries: {streams} streams for {attempts} attempts");

    // The README's setting: the upstream sees what stormguard decided, and nothing more.
    let never = reqwest::Client::builder()
        .http2_prior_knowledge()
        .retry(reqwest::retry::never())
        .build()
        .unwrap();
    let (streams, attempts) = one_call(never).await;
    assert_eq!((streams, attempts), (3, 3));
}
