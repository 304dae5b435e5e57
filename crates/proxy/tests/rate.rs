//! Rate admission, judged at the provider: chaos plays an OpenAI-shaped API with 120 requests a
//! minute (a bucket of 120, refilled at 2 a second). After a burst that empties its bucket, an
//! open loop at twice the limit goes through the proxy: with rate admission the provider
//! answers almost nothing with 429 (the proxy follows the `remaining` it states and holds first
//! tries back), and serves about its limit; without it, about half of what reaches it is a 429.

mod common;

use common::*;

use std::time::Duration;

use bytes::Bytes;
use http::Request;
use http_body_util::Full;
use stormguard_chaos::{ChaosConfig, ChaosServer, Phase, ProviderConfig, ProviderKind};
use stormguard_proxy::config::{ProxyConfig, ProxyDependency};
use stormguard_proxy::{ProxyHandle, start};

const RPM: u64 = 120;

async fn provider() -> ChaosServer {
    let mut config = ChaosConfig::single(Phase::default());
    config.provider =
        Some(ProviderConfig { kind: ProviderKind::OpenAi, rpm: Some(RPM), tpm: None });
    stormguard_chaos::spawn(config, "127.0.0.1:0".parse().unwrap()).await.unwrap()
}

async fn proxy(upstream: &ChaosServer, admission: bool) -> ProxyHandle {
    let mut d = ProxyDependency::new("llm", upstream.url("").parse().unwrap());
    d.cap = 200;
    d.queue = 1_000;
    d.queue_timeout = Duration::from_secs(5);
    // A 429 is not retried here: the count at the provider is of first tries.
    d.max_retries = 0;
    if admission {
        d.rate.learn = true;
    }
    let mut c = ProxyConfig::single("127.0.0.1:0".parse().unwrap(), d);
    c.admin = None;
    start(c).await.unwrap()
}

async fn post(addr: std::net::SocketAddr) -> u16 {
    let req = Request::post(format!("http://{addr}/v1/chat/completions"))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from_static(br#"{"max_tokens":1}"#)))
        .unwrap();
    match tokio::time::timeout(Duration::from_secs(30), client().request(req)).await {
        Ok(Ok(r)) => r.status().as_u16(),
        _ => 0,
    }
}

/// (429s at the provider, 200s at the provider) for an open loop at twice the limit for
/// `secs` seconds, after a burst of the whole bucket.
async fn run(admission: bool, secs: u64) -> (u64, u64) {
    let upstream = provider().await;
    let p = proxy(&upstream, admission).await;
    let addr = p.listen_addrs()[0];
    // Empty the provider's bucket (and teach the proxy its limit and what is left).
    for _ in 0..RPM {
        post(addr).await;
    }
    upstream.reset();
    let mut tasks = Vec::new();
    let every = Duration::from_secs(60) / (2 * RPM as u32);
    for _ in 0..(secs * 2 * RPM / 60) {
        let at = tokio::time::Instant::now();
        tasks.push(tokio::spawn(post(addr)));
        tokio::time::sleep_until(at + every).await;
    }
    for t in tasks {
        t.await.unwrap();
    }
    let seen = upstream.stats().total.status_counts;
    p.shutdown().await;
    (seen.get(&429).copied().unwrap_or(0), seen.get(&200).copied().unwrap_or(0))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twice_the_request_limit_draws_no_429s_with_rate_admission_and_many_without() {
    let secs = 6;
    let (limited, served) = run(true, secs).await;
    let reached = limited + served;
    eprintln!("with rate admission: {served} served, {limited} 429s at the provider");
    assert!(limited * 100 <= reached.max(1), "{limited} 429s of {reached} at the provider");
    // What the refill allows over the run: 2 a second.
    let refill = secs * RPM / 60;
    assert!(served * 10 >= refill * 9, "{served} served, the limit allows {refill}");
    let (limited, served) = run(false, secs).await;
    eprintln!("without: {served} served, {limited} 429s at the provider");
    assert!(limited * 3 >= (limited + served), "{limited} 429s of {}", limited + served);
}
