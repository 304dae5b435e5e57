//! The storm guarantee through reqwest, judged where it matters: at the upstream, which the chaos
//! server counts exactly.
//!
//! The worked example: a dependency with a cap of 20, planned for 16 calls in flight — open-loop
//! arrivals at 16 / L per second (L = the upstream's latency), so 16 are in flight on average —
//! and 30 % of attempts fail, just above a 25 % budget. Through stormguard the upstream never sees
//! more than 20 at once and retries stay within 25 % of the originals (the budget has no floor
//! here: `min_per_sec=0`, over one window longer than the run, so the bound is exact). The same
//! arrivals through `reqwest-retry`'s `RetryTransientMiddleware`, and through plain reqwest with
//! a naive retry-once loop, put more than 20 in flight, and retry more than 25 %.
//!
//! Nothing here depends on timing to pass: the cap and the budget are bounds stormguard holds
//! whatever the scheduling; the unprotected clients go over because the arrivals are open-loop
//! (a slower machine only raises what is in flight).

use crate::support;

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use reqwest_middleware::ClientBuilder;
use reqwest_retry::RetryTransientMiddleware;
use reqwest_retry::policies::ExponentialBackoff;
use stormguard_chaos::{Latency, Phase, Stats};
use stormguard_core::random::{RandomSource, SplitMix64};
use stormguard_reqwest::Denied;
use support::{chaos, dependency, guarded, plain};

/// The upstream's latency.
const L: Duration = Duration::from_millis(50);
/// How long arrivals go on.
const RUN: Duration = Duration::from_millis(2_500);
const CAP: u64 = 20;

fn storm() -> Phase {
    Phase { error_rate: 0.3, latency: Latency::Fixed(L), ..Phase::default() }
}

/// Seeded Poisson arrivals at 16 / L per second for `RUN`, each call in its own task; returns
/// how many calls were made once every one has finished.
async fn open_loop<F, Fut>(call: F) -> u64
where
    F: Fn() -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    let rate = 16.0 / L.as_secs_f64();
    let mut rng = SplitMix64::new(16);
    let start = tokio::time::Instant::now();
    let mut at = Duration::ZERO;
    let mut tasks = Vec::new();
    loop {
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
        t.await.unwrap();
    }
    n
}

/// The upstream's retries: marked ones when the client marks them, else every request past the
/// first of each call.
fn retries(stats: &Stats, calls: u64) -> u64 {
    stats.total.retries.max(stats.total.requests.saturating_sub(calls))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_30_percent_errors_the_upstream_sees_the_cap_and_the_budget_and_no_more() {
    let upstream = chaos(storm()).await;
    let dep = dependency(|c| {
        c.limiter.cap = CAP;
        c.limiter.queue_len = 10_000;
        c.limiter.queue_timeout = Duration::from_secs(60);
        c.budget = "ratio:percent=0.25,min_per_sec=0,ttl=60s".parse().unwrap();
    });
    let client = guarded(&dep);
    let url = upstream.url("/");
    let failed = Arc::new(AtomicU64::new(0));
    let f = failed.clone();
    let calls = open_loop(move || {
        let (client, url, failed) = (client.clone(), url.clone(), f.clone());
        async move {
            match client.get(&url).send().await {
                Ok(resp) => {
                    if !resp.status().is_success() {
                        // A 503 whose retry was refused comes back with the reason.
                        assert!(resp.extensions().get::<Denied>().is_some(), "{resp:?}");
                        failed.fetch_add(1, Ordering::SeqCst);
                    }
                    resp.bytes().await.unwrap();
                }
                Err(e) => panic!("no call fails below HTTP here: {e}"),
            }
        }
    })
    .await;
    let stats = upstream.stats();
    let (requests, retried) = (stats.total.requests, stats.total.retries);
    let originals = requests - retried;
    eprintln!(
        "stormguard: {calls} calls, upstream saw {requests} requests ({retried} retries), \
         max in flight {}, {} calls ended on a refused retry",
        stats.total.in_flight.max,
        failed.load(Ordering::SeqCst)
    );
    assert_eq!(originals, calls, "each call reached the upstream once as an original");
    assert!(
        stats.total.in_flight.max <= CAP,
        "the upstream saw {} in flight, over the cap of {CAP}",
        stats.total.in_flight.max
    );
    // The floor is 0 (`min_per_sec=0`) and the window (60 s) outlasts the run, so the budget's
    // bound is exact: floor(25 % of the originals admitted).
    assert!(retried <= originals / 4, "{retried} retries for {originals} originals, over 25 %");
    assert!(retried > 0, "failures were retried while the budget allowed");
    let c = dep.snapshot().counters;
    assert_eq!(c.retries, retried, "every retry stormguard sent reached the upstream: {c:?}");
    assert_eq!(c.primaries, originals);
    assert!(
        c.denied(Denied::Budget) + c.denied(Denied::Cap) > 0,
        "30 % errors against a 25 % budget: some retries were refused: {c:?}"
    );
    upstream.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_storm_through_reqwest_retry_goes_over_the_cap_and_the_budget() {
    let upstream = chaos(storm()).await;
    // Two retries, as stormguard's default `max_retries`, with short backoffs.
    let policy = ExponentialBackoff::builder()
        .retry_bounds(Duration::from_millis(10), Duration::from_millis(100))
        .build_with_max_retries(2);
    let client =
        ClientBuilder::new(plain()).with(RetryTransientMiddleware::new_with_policy(policy)).build();
    let url = upstream.url("/");
    let calls = open_loop(move || {
        let (client, url) = (client.clone(), url.clone());
        async move {
            if let Ok(resp) = client.get(&url).send().await {
                let _ = resp.bytes().await;
            }
        }
    })
    .await;
    let stats = upstream.stats();
    let retried = retries(&stats, calls);
    eprintln!(
        "reqwest-retry: {calls} calls, upstream saw {} requests ({retried} retries), max in flight {}",
        stats.total.requests, stats.total.in_flight.max
    );
    assert!(
        stats.total.in_flight.max > CAP,
        "reqwest-retry alone kept the upstream at {} in flight",
        stats.total.in_flight.max
    );
    assert!(retried > calls / 4, "{retried} retries for {calls} calls");
    upstream.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_storm_through_a_naive_retry_once_loop_goes_over_the_cap() {
    let upstream = chaos(storm()).await;
    let client = plain();
    let url = upstream.url("/");
    let calls = open_loop(move || {
        let (client, url) = (client.clone(), url.clone());
        async move {
            for _ in 0..2 {
                let Ok(resp) = client.get(&url).send().await else { continue };
                let ok = resp.status().is_success();
                let _ = resp.bytes().await;
                if ok {
                    break;
                }
            }
        }
    })
    .await;
    let stats = upstream.stats();
    let retried = retries(&stats, calls);
    eprintln!(
        "naive loop: {calls} calls, upstream saw {} requests ({retried} retries), max in flight {}",
        stats.total.requests, stats.total.in_flight.max
    );
    assert!(stats.total.in_flight.max > CAP, "{}", stats.total.in_flight.max);
    assert!(retried > calls / 4, "{retried} retries for {calls} calls");
    upstream.shutdown().await;
}
