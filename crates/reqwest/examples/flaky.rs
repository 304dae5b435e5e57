//! reqwest against a flaky upstream, through stormguard and through reqwest-retry.
//!
//!     cargo run -p stormguard-reqwest --example flaky
//!
//! Starts the chaos upstream on 127.0.0.1 (an ephemeral port): 30 % of requests fail with 503,
//! each takes 20 ms. Then 16 callers send it 640 requests, first through stormguard (a cap of
//! 20, a 25 % budget), then through `RetryTransientMiddleware` with the same two retries, and
//! prints what the upstream saw each time — counted at the upstream, not at the client.
//!
//! The budget is the trade made visible: reqwest-retry turns 30 % errors into about 40 % more
//! load on a dependency that is already failing, and hides most failures from its callers;
//! stormguard holds the extra load to 25 % of the calls, and the failures past it reach the
//! callers at once, each with its reason. (The storm test, `tests/it/storm.rs`, adds the other
//! half: with open-loop arrivals reqwest-retry also goes over the cap; stormguard never does.)

use std::time::Duration;

use reqwest_middleware::{ClientBuilder, ClientWithMiddleware};
use reqwest_retry::RetryTransientMiddleware;
use reqwest_retry::policies::ExponentialBackoff;
use stormguard_chaos::{ChaosConfig, Latency, Phase};
use stormguard_reqwest::{Dependency, DependencyConfig, Refusal, StormguardMiddleware};

const CALLERS: usize = 16;
const PER_CALLER: usize = 40;

/// Runs the callers; returns how many calls ended in a success.
async fn drive(client: &ClientWithMiddleware, url: &str) -> usize {
    let mut callers = Vec::new();
    for _ in 0..CALLERS {
        let (client, url) = (client.clone(), url.to_string());
        callers.push(tokio::spawn(async move {
            let mut ok = 0;
            for _ in 0..PER_CALLER {
                let result = client.get(&url).send().await;
                if let Some(reason) = result.denied() {
                    tracing::debug!(%reason, "stormguard refused a retry");
                }
                if let Ok(resp) = result {
                    ok += usize::from(resp.status().is_success());
                    let _ = resp.bytes().await;
                }
            }
            ok
        }));
    }
    let mut ok = 0;
    for c in callers {
        ok += c.await.unwrap_or(0);
    }
    ok
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let phase = Phase {
        error_rate: 0.3,
        latency: Latency::Fixed(Duration::from_millis(20)),
        ..Phase::default()
    };
    let upstream =
        stormguard_chaos::spawn(ChaosConfig::single(phase), "127.0.0.1:0".parse()?).await?;
    let url = upstream.url("/");
    let reqwest = || reqwest::Client::builder().retry(reqwest::retry::never()).build();

    let mut config = DependencyConfig::new("flaky");
    config.limiter.cap = 20;
    config.budget = "ratio:percent=0.25,min_per_sec=1".parse()?;
    let dependency = Dependency::try_new(config)?;
    let guarded =
        ClientBuilder::new(reqwest()?).with(StormguardMiddleware::new(dependency.clone())).build();
    let ok = drive(&guarded, &url).await;
    let seen = upstream.reset();
    let c = dependency.snapshot().counters;
    println!(
        "stormguard:    {ok}/{} succeeded; the upstream saw {} requests ({} retries), at most {} \
         at once (cap 20); retries refused: {} budget, {} cap, {} attempts",
        CALLERS * PER_CALLER,
        seen.total.requests,
        seen.total.retries,
        seen.total.in_flight.max,
        c.denied(stormguard_reqwest::Denied::Budget),
        c.denied(stormguard_reqwest::Denied::Cap),
        c.denied(stormguard_reqwest::Denied::Attempts),
    );

    let policy = ExponentialBackoff::builder()
        .retry_bounds(Duration::from_millis(10), Duration::from_millis(100))
        .build_with_max_retries(2);
    let naive = ClientBuilder::new(reqwest()?)
        .with(RetryTransientMiddleware::new_with_policy(policy))
        .build();
    let ok = drive(&naive, &url).await;
    let seen = upstream.reset();
    println!(
        "reqwest-retry: {ok}/{} succeeded; the upstream saw {} requests ({} retries), at most {} \
         at once",
        CALLERS * PER_CALLER,
        seen.total.requests,
        seen.total.requests - (CALLERS * PER_CALLER) as u64,
        seen.total.in_flight.max,
    );
    upstream.shutdown().await;
    Ok(())
}
