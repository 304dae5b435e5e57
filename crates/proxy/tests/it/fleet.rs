//! Three proxies, one fleet: `placement = "fleet"` against a real `redis-server` (started here on
//! an ephemeral loopback port, no persistence), in front of one chaos upstream that counts
//! exactly what reaches it. Each guarantee is run beside the same three proxies with local
//! placement, which break it. The Redis-kill, instance-kill, FLUSHALL and Lua-concurrency tests
//! are in crates/redis.

use crate::common;

use common::*;

use std::time::Duration;

use stormguard_chaos::load::{self, Live, LoadConfig, Mode};
use stormguard_chaos::{ChaosServer, Latency, Phase};
use stormguard_proxy::config::{FleetPlacement, ProxyConfig, ProxyDependency, RedisSource};
use stormguard_proxy::{ProxyHandle, start};
use stormguard_redis::FleetMode;
use stormguard_redis::resp::Connection;
use stormguard_redis::server::RedisProcess;

/// An established fleet: its epoch is old, so no test waits out the quiet period of a new one.
async fn established(redis: &RedisProcess) {
    let mut c = Connection::connect(&redis.target()).await.unwrap();
    c.command(&[b"SET", b"stormguard:{upstream}:epoch", b"0"]).await.unwrap();
}

/// Three proxies with `cap = 20` each in front of `upstream`; with `redis`, placed in one fleet
/// with a fleet cap of 20.
async fn three_proxies(
    upstream: &ChaosServer,
    redis: Option<&RedisProcess>,
    edit: impl Fn(&mut ProxyDependency),
) -> Vec<ProxyHandle> {
    let mut proxies = Vec::new();
    for i in 0..3 {
        let mut d = ProxyDependency::new("upstream", upstream.url("").parse().unwrap());
        d.cap = 20;
        d.queue = 10_000;
        d.queue_timeout = Duration::from_secs(10);
        edit(&mut d);
        if let Some(redis) = redis {
            let mut f = FleetPlacement::new(3);
            f.redis = RedisSource::Target(redis.target());
            f.lease_ttl = ms(1_000);
            f.interval = ms(100);
            f.instance = Some(format!("proxy-{i}"));
            d.fleet = Some(f);
        }
        let mut c = ProxyConfig::single("127.0.0.1:0".parse().unwrap(), d);
        c.admin = Some("127.0.0.1:0".parse().unwrap());
        proxies.push(start(c).await.unwrap());
    }
    if redis.is_some() {
        for _ in 0..100 {
            if proxies.iter().all(|p| p.fleet("upstream").unwrap().mode() == FleetMode::Fleet) {
                break;
            }
            tokio::time::sleep(ms(50)).await;
        }
        for p in &proxies {
            assert_eq!(p.fleet("upstream").unwrap().mode(), FleetMode::Fleet);
        }
    }
    proxies
}

/// Closed-loop callers on each proxy at once; every request must get an answer.
async fn load_all(
    proxies: &[ProxyHandle],
    concurrency: usize,
    duration: Duration,
) -> Vec<load::LoadReport> {
    let runs = proxies.iter().map(|p| {
        let mut l = LoadConfig::new(&format!("http://{}/", p.listen_addrs()[0])).unwrap();
        l.mode = Mode::Closed { concurrency };
        l.duration = Some(duration);
        l.timeout = Duration::from_secs(15);
        async move { load::run(&l, &Live::default()).await.unwrap() }
    });
    let reports = futures_join(runs.collect()).await;
    for r in &reports {
        assert_eq!(r.outcomes.total(), r.scheduled, "count in = count out: {:?}", r.outcomes);
        assert_eq!(
            r.outcomes.dropped + r.outcomes.reset + r.outcomes.connect_error + r.outcomes.timeout,
            0,
            "{:?}",
            r.outcomes
        );
    }
    reports
}

async fn futures_join<F: Future<Output = load::LoadReport> + Send + 'static>(
    fs: Vec<F>,
) -> Vec<load::LoadReport> {
    let handles: Vec<_> = fs.into_iter().map(tokio::spawn).collect();
    let mut out = Vec::new();
    for h in handles {
        out.push(h.await.unwrap());
    }
    out
}

async fn get(url: &str) -> String {
    let c = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<http_body_util::Empty<bytes::Bytes>>();
    let req = http::Request::get(url)
        .header("x-request-id", crate::common::request_id())
        .body(http_body_util::Empty::new())
        .unwrap();
    let resp = c.request(req).await.unwrap();
    let body = http_body_util::BodyExt::collect(resp.into_body()).await.unwrap().to_bytes();
    String::from_utf8_lossy(&body).into_owned()
}

/// 90 callers through three proxies with a cap of 20 each: placed in one fleet with a fleet cap
/// of 20, the upstream's exact maximum in flight stays at or under 20 and every request is
/// answered (the waiting happens in the proxies' queues); the same three with local caps reach
/// well above 20.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_proxies_hold_one_fleet_cap_of_20_local_caps_reach_60() {
    let redis = RedisProcess::start();
    established(&redis).await;
    let upstream = chaos(Phase { latency: Latency::Fixed(ms(20)), ..Phase::default() }).await;
    for fleet in [true, false] {
        let proxies = three_proxies(&upstream, fleet.then_some(&redis), |_| {}).await;
        upstream.reset();
        let reports = load_all(&proxies, 30, ms(1_500)).await;
        let seen = upstream.stats();
        let max = seen.total.in_flight.max;
        let ok: u64 = reports.iter().map(|r| r.outcomes.success).sum();
        eprintln!(
            "fleet={fleet}: upstream max in flight {max}, {} requests, {ok} succeeded",
            seen.total.requests
        );
        assert_eq!(ok, reports.iter().map(|r| r.scheduled).sum::<u64>(), "every request succeeded");
        if fleet {
            assert!(max <= 20, "fleet cap 20, the upstream saw {max}");
            assert!(max >= 15, "the fleet used its cap: {max}");
            let metrics =
                get(&format!("http://{}/metrics", proxies[0].admin_addr().unwrap())).await;
            assert!(
                metrics.contains("stormguard_fleet_mode{dependency=\"upstream\",mode=\"fleet\"} 1"),
                "{metrics}"
            );
            assert!(metrics.contains("stormguard_fleet_sync_lag_seconds{dependency=\"upstream\"}"));
            let config = get(&format!("http://{}/config", proxies[0].admin_addr().unwrap())).await;
            assert!(config.contains("\"placement\": \"fleet\""), "{config}");
        } else {
            assert!(max > 20, "three local caps of 20 should pass 20; the upstream saw {max}");
        }
        for p in proxies {
            p.shutdown().await;
        }
        tokio::time::sleep(ms(100)).await;
    }
}

/// Low traffic against an upstream that fails everything, where the reserve is all the budget
/// there is (`percent = 0`, a reserve of 2/s × 10 s = 20 retries): the fleet's three proxies
/// retry at most one reserve between them; three local budgets retry three reserves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_proxies_at_low_traffic_retry_one_reserve_not_three() {
    let redis = RedisProcess::start();
    established(&redis).await;
    let upstream =
        chaos(Phase { error_rate: 1.0, latency: Latency::Fixed(ms(2)), ..Phase::default() }).await;
    for fleet in [true, false] {
        let proxies = three_proxies(&upstream, fleet.then_some(&redis), |d| {
            d.budget = "ratio:percent=0,min_per_sec=2,ttl=10s".parse().unwrap();
            d.backoff = stormguard_core::backoff::BackoffConfig::parse_range("5ms..20ms").unwrap();
        })
        .await;
        upstream.reset();
        load_all(&proxies, 2, ms(2_000)).await;
        let seen = upstream.stats().total;
        eprintln!(
            "fleet={fleet}: {} requests reached the upstream, {} of them retries",
            seen.requests, seen.retries
        );
        assert!(seen.requests > 300, "the load ran: {}", seen.requests);
        if fleet {
            assert!(
                seen.retries <= 20,
                "one reserve is 20 retries; the fleet sent {}",
                seen.retries
            );
            assert!(seen.retries >= 10, "the fleet's reserve was used: {}", seen.retries);
        } else {
            assert!(seen.retries > 40, "three local reserves allow 60; sent {}", seen.retries);
        }
        for p in proxies {
            p.shutdown().await;
        }
        // The fleet's reserve window outlives this run; the next test round is local anyway.
    }
}

/// A provider's requests per minute are per key, so the fleet's: two proxies placed in one
/// fleet, each learning the provider's 600 a minute from its headers, meter 300 each (the limit
/// divided by the live instances), and the provider — its bucket emptied first — answers at
/// most 1 % of an open loop at twice its limit (10 a second through each proxy, 10 s) with a
/// 429. The same two proxies placed locally each meter the whole 600: together twice the limit,
/// and the provider refuses a good part of it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_proxies_share_one_providers_requests_per_minute() {
    use bytes::Bytes;
    use stormguard_chaos::{ChaosConfig, ProviderConfig, ProviderKind};
    const RPM: u64 = 600;
    const SECS: u64 = 10;
    let redis = RedisProcess::start();
    established(&redis).await;
    let post = |addr: std::net::SocketAddr| async move {
        let req = http::Request::post(format!("http://{addr}/v1/chat/completions"))
            .header("content-type", "application/json")
            .body(http_body_util::Full::new(Bytes::from_static(br#"{"max_tokens":1}"#)))
            .unwrap();
        let _ = tokio::time::timeout(Duration::from_secs(30), client().request(req)).await;
    };
    for fleet in [true, false] {
        let mut config = ChaosConfig::single(Phase::default());
        config.provider =
            Some(ProviderConfig { kind: ProviderKind::OpenAi, rpm: Some(RPM), tpm: None });
        let upstream =
            stormguard_chaos::spawn(config, "127.0.0.1:0".parse().unwrap()).await.unwrap();
        let mut proxies = Vec::new();
        for i in 0..2 {
            let mut d = ProxyDependency::new("upstream", upstream.url("").parse().unwrap());
            d.cap = 200;
            d.queue = 1_000;
            d.queue_timeout = Duration::from_secs(5);
            d.max_retries = 0;
            d.rate.learn = true;
            if fleet {
                let mut f = FleetPlacement::new(2);
                f.redis = RedisSource::Target(redis.target());
                f.lease_ttl = ms(1_000);
                f.interval = ms(100);
                f.instance = Some(format!("llm-{i}"));
                d.fleet = Some(f);
            }
            let mut c = ProxyConfig::single("127.0.0.1:0".parse().unwrap(), d);
            c.admin = None;
            proxies.push(start(c).await.unwrap());
        }
        let addrs: Vec<_> = proxies.iter().map(|p| p.listen_addrs()[0]).collect();
        // Empty the provider's bucket, and teach both proxies what is left.
        for k in 0..RPM {
            post(addrs[k as usize % 2]).await;
        }
        upstream.reset();
        let mut tasks = Vec::new();
        let every = Duration::from_secs(60) / (2 * RPM as u32);
        for k in 0..(SECS * 2 * RPM / 60) {
            let at = tokio::time::Instant::now();
            tasks.push(tokio::spawn(post(addrs[k as usize % 2])));
            tokio::time::sleep_until(at + every).await;
        }
        for t in tasks {
            t.await.unwrap();
        }
        let seen = upstream.stats().total.status_counts;
        for p in proxies {
            p.shutdown().await;
        }
        let limited = seen.get(&429).copied().unwrap_or(0);
        let served = seen.get(&200).copied().unwrap_or(0);
        eprintln!("fleet={fleet}: {served} served, {limited} 429s at the provider");
        if fleet {
            assert!(
                limited * 100 <= (limited + served).max(1),
                "{limited} 429s of {}",
                limited + served
            );
            let refill = SECS * RPM / 60;
            assert!(served * 10 >= refill * 9, "{served} served, the limit allows {refill}");
        } else {
            assert!(
                limited * 10 >= (limited + served),
                "local: {limited} 429s of {}",
                limited + served
            );
        }
    }
}
