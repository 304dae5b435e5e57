//! Operating the proxy: reload under load, a refused reload, a limiter's switch-over, drain.
//! On 127.0.0.1 with ephemeral ports against chaos upstreams.

use crate::common;

use common::*;

use std::time::Duration;

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};
use stormguard_chaos::load::{self, Live, LoadConfig, Mode};
use stormguard_chaos::{ChaosServer, Latency, Phase};
use stormguard_proxy::config::{ListenerConfig, ProxyConfig, ProxyDependency};
use stormguard_proxy::{ProxyHandle, ReloadError, start};

async fn get(c: &TestClient, uri: &str) -> Result<(StatusCode, Bytes), String> {
    let req = Request::get(uri)
        .header("x-request-id", crate::common::request_id())
        .body(Full::new(Bytes::new()))
        .unwrap();
    let resp = tokio::time::timeout(Duration::from_secs(10), c.request(req))
        .await
        .map_err(|_| format!("{uri}: no answer in 10 s"))?
        .map_err(|e| format!("{uri}: {e}"))?;
    let status = resp.status();
    Ok((status, resp.into_body().collect().await.map_err(|e| e.to_string())?.to_bytes()))
}

/// Two listeners, one per dependency: `steady` (a token bucket that failures drain) and
/// `moving` (what the reloads change).
fn two(steady: &ChaosServer, moving: &ChaosServer) -> ProxyConfig {
    let mut a = ProxyDependency::new("steady", steady.url("").parse().unwrap());
    a.budget = "token-bucket:max_tokens=10,token_ratio=0.5".parse().unwrap();
    a.max_retries = 1;
    let mut b = ProxyDependency::new("moving", moving.url("").parse().unwrap());
    b.budget = "token-bucket:max_tokens=10,token_ratio=0.5".parse().unwrap();
    b.max_retries = 1;
    let mut c = ProxyConfig::single("127.0.0.1:0".parse().unwrap(), a);
    c.listeners.push(ListenerConfig::new("127.0.0.1:0".parse().unwrap(), Some("moving".into())));
    c.dependencies.push(b);
    c.admin = Some("127.0.0.1:0".parse().unwrap());
    c
}

fn url(p: &ProxyHandle, listener: usize) -> String {
    format!("http://{}/", p.listen_addrs()[listener])
}

fn balance(p: &ProxyHandle, name: &str) -> f64 {
    p.dependency(name).unwrap().snapshot().budget.balance
}

/// A reload under steady load loses no request; the unchanged dependency keeps its budget
/// balance (and its counters), while the changed one starts a fresh budget.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reload_under_load_loses_nothing_and_keeps_unchanged_state() {
    let steady = chaos(Phase { error_rate: 0.5, ..Phase::default() }).await;
    let moving = chaos(Phase {
        error_rate: 0.5,
        latency: Latency::Uniform { min: ms(0), max: ms(4) },
        ..Phase::default()
    })
    .await;
    let config = two(&steady, &moving);
    let p = start(config.clone()).await.unwrap();
    let c = client();
    // Failures drain both buckets below full.
    for _ in 0..20 {
        get(&c, &url(&p, 0)).await.unwrap();
        get(&c, &url(&p, 1)).await.unwrap();
    }
    let (steady_before, moving_before) = (balance(&p, "steady"), balance(&p, "moving"));
    let requests_before = p.dependency("steady").unwrap().snapshot().counters.primaries;
    assert!(steady_before < 10.0 && moving_before < 10.0, "{steady_before} {moving_before}");

    // Steady load on `moving` while it is reloaded five times (its budget and cap change).
    let mut l = LoadConfig::new(&url(&p, 1)).unwrap();
    l.mode = Mode::Closed { concurrency: 16 };
    l.requests = Some(4_000);
    l.timeout = Duration::from_secs(10);
    let load = tokio::spawn(async move { load::run(&l, &Live::default()).await.unwrap() });
    let mut reports = Vec::new();
    for i in 0..5u64 {
        tokio::time::sleep(ms(100)).await;
        let mut next = config.clone();
        next.dependencies[1].budget =
            format!("token-bucket:max_tokens={},token_ratio=0.5", 11 + i).parse().unwrap();
        next.dependencies[1].cap = 19 - i;
        reports.push(p.reload(next).await.unwrap());
    }
    let r = load.await.unwrap();
    assert_eq!(r.outcomes.total(), 4_000, "count in = count out: {:?}", r.outcomes);
    assert_eq!(
        r.outcomes.reset + r.outcomes.timeout + r.outcomes.connect_error,
        0,
        "no connection dropped: {:?}",
        r.outcomes
    );
    for report in &reports {
        assert_eq!(
            (report.unchanged.as_slice(), report.changed.as_slice()),
            (&["steady".to_string()][..], &["moving".to_string()][..])
        );
    }
    // The unchanged dependency is the same one: its bucket and its counters went on.
    assert_eq!(balance(&p, "steady"), steady_before, "the budget balance is kept");
    assert_eq!(p.dependency("steady").unwrap().snapshot().counters.primaries, requests_before);
    // The changed one runs its new config.
    let moving_now = p.dependency("moving").unwrap();
    assert_eq!(moving_now.config().limiter.cap, 15);
    // A changed budget SPEC starts full; the kept one above did not.
    assert!(balance(&p, "moving") < 15.0, "the load drained it");
    let mut next = config.clone();
    next.dependencies[1].budget = "token-bucket:max_tokens=16,token_ratio=0.5".parse().unwrap();
    p.reload(next).await.unwrap();
    assert_eq!(balance(&p, "moving"), 16.0);
    p.shutdown().await;
}

/// A bad config is refused, logged and counted; the running one keeps serving. So is one
/// that changes what needs a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_reload_is_refused_and_traffic_continues() {
    let upstream = chaos(Phase::default()).await;
    let config = two(&upstream, &upstream);
    let p = start(config.clone()).await.unwrap();
    let c = client();
    let mut bad = config.clone();
    bad.dependencies[0].cap = 0;
    let refused = p.reload(bad).await;
    let Err(ReloadError::Invalid(v)) = &refused else { panic!("{refused:?}") };
    assert_eq!(v.key.to_string(), "dependency[0].cap");
    assert!(matches!(
        v.error,
        stormguard_proxy::config::RuleError::Core(stormguard_core::ConfigError::OutOfRange {
            key: "cap",
            ..
        })
    ));
    let mut moved = config.clone();
    moved.listeners[0].listen = "127.0.0.1:1".parse().unwrap();
    assert!(matches!(p.reload(moved).await, Err(ReloadError::Fixed(_))));
    assert!(matches!(p.reload_from_source().await, Err(ReloadError::NoSource)));
    assert_eq!(get(&c, &url(&p, 0)).await.unwrap().0, StatusCode::OK);
    assert_eq!(p.dependency("steady").unwrap().config().limiter.cap, 20);
    let admin = format!("http://{}", p.admin_addr().unwrap());
    let (_, metrics) = get(&c, &format!("{admin}/metrics")).await.unwrap();
    let metrics = String::from_utf8(metrics.to_vec()).unwrap();
    assert!(metrics.contains("stormguard_reloads_total{result=\"refused\"} 3"), "{metrics}");
    assert!(metrics.contains("stormguard_reloads_total{result=\"applied\"} 0"), "{metrics}");
    p.shutdown().await;
}

/// When a reload changes a dependency's limiter, the new one starts lowered by what the old
/// one still has in flight: the upstream never sees the two caps added up. The same reload
/// naming the upstream differently (a new upstream as far as the proxy knows) gets a fresh
/// limiter, and the upstream sees both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_changed_limiter_switches_over_as_permits_return() {
    let slow = chaos(Phase { latency: Latency::Fixed(ms(600)), ..Phase::default() }).await;
    for same_upstream in [true, false] {
        let mut d = ProxyDependency::new("slow", slow.url("").parse().unwrap());
        d.cap = 10;
        d.queue = 100;
        d.queue_timeout = Duration::from_secs(5);
        let mut config = ProxyConfig::single("127.0.0.1:0".parse().unwrap(), d);
        config.admin = None;
        let p = start(config.clone()).await.unwrap();
        let c = client();
        slow.reset();
        let u = format!("http://{}/", p.listen_addrs()[0]);
        let mut calls = Vec::new();
        for _ in 0..6 {
            let (c, u) = (c.clone(), u.clone());
            calls.push(tokio::spawn(async move { get(&c, &u).await }));
        }
        tokio::time::sleep(ms(150)).await;
        let mut next = config.clone();
        next.dependencies[0].queue_timeout = Duration::from_secs(4);
        if !same_upstream {
            next.dependencies[0].upstreams[0] =
                format!("http://localhost:{}", slow.local_addr().port()).parse().unwrap();
        }
        let report = p.reload(next).await.unwrap();
        assert_eq!(report.changed, ["slow"]);
        for _ in 0..10 {
            let (c, u) = (c.clone(), u.clone());
            calls.push(tokio::spawn(async move { get(&c, &u).await }));
        }
        for call in calls {
            assert_eq!(call.await.unwrap().unwrap().0, StatusCode::OK);
        }
        let max = slow.stats().total.in_flight.max;
        if same_upstream {
            assert!(max <= 10, "the switch-over kept the cap: {max}");
        } else {
            assert!(max > 10, "a fresh limiter next to the old one: {max}");
        }
        p.shutdown().await;
    }
}

/// A drain fails `/readyz` at once, stops accepting, lets requests in flight finish, and
/// reports nothing cut; a drain shorter than the requests cuts them at its timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drain_finishes_in_flight_requests_and_fails_readiness_at_once() {
    let slow = chaos(Phase { latency: Latency::Fixed(ms(500)), ..Phase::default() }).await;
    for (timeout, cut) in [(ms(5_000), false), (ms(100), true)] {
        let mut config = ProxyConfig::single(
            "127.0.0.1:0".parse().unwrap(),
            ProxyDependency::new("slow", slow.url("").parse().unwrap()),
        );
        config.admin = Some("127.0.0.1:0".parse().unwrap());
        let p = start(config).await.unwrap();
        let c = client();
        let u = url(&p, 0);
        let admin = format!("http://{}/readyz", p.admin_addr().unwrap());
        assert_eq!(get(&c, &admin).await.unwrap().0, StatusCode::OK);
        let mut calls = Vec::new();
        for _ in 0..5 {
            let (c, u) = (c.clone(), u.clone());
            calls.push(tokio::spawn(async move { get(&c, &u).await }));
        }
        tokio::time::sleep(ms(100)).await;
        let listen = p.listen_addrs()[0];
        let drain = tokio::spawn(p.drain(timeout));
        tokio::time::sleep(ms(50)).await;
        assert_eq!(get(&c, &admin).await.unwrap().0, StatusCode::SERVICE_UNAVAILABLE);
        assert!(
            tokio::net::TcpStream::connect(listen).await.is_err(),
            "the listener stopped accepting"
        );
        let report = drain.await.unwrap();
        let answered = futures_ok(calls).await;
        if cut {
            assert!(report.cut > 0, "{report:?}");
            assert!(answered < 5, "cut at the timeout: {answered} answered");
        } else {
            assert_eq!(report.cut, 0, "{report:?}");
            assert_eq!(answered, 5, "every request in flight finished");
        }
    }
}

async fn futures_ok(
    calls: Vec<tokio::task::JoinHandle<Result<(StatusCode, Bytes), String>>>,
) -> usize {
    let mut ok = 0;
    for c in calls {
        if matches!(c.await.unwrap(), Ok((StatusCode::OK, _))) {
            ok += 1;
        }
    }
    ok
}
