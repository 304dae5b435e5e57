//! The numbers say what the dependency sees: a refused retry after a transport failure says
//! why, a Prometheus scrape's high-water mark is not reset by `/stats.json` readers, and with
//! several upstreams each one's histograms move with its own traffic.

use crate::common;

use common::*;

use std::time::Duration;

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};
use stormguard_chaos::{ChaosServer, Latency, Phase};
use stormguard_proxy::config::{ProxyConfig, ProxyDependency};
use stormguard_proxy::{ProxyHandle, start};

async fn proxy(d: ProxyDependency) -> ProxyHandle {
    let mut c = ProxyConfig::single("127.0.0.1:0".parse().unwrap(), d);
    c.admin = Some("127.0.0.1:0".parse().unwrap());
    start(c).await.unwrap()
}

async fn call(c: &TestClient, method: &str, url: &str) -> (StatusCode, http::HeaderMap, Bytes) {
    let req = Request::builder().method(method).uri(url).body(Full::new(Bytes::new())).unwrap();
    let resp =
        tokio::time::timeout(Duration::from_secs(10), c.request(req)).await.unwrap().unwrap();
    let (parts, body) = resp.into_parts();
    (parts.status, parts.headers, body.collect().await.unwrap().to_bytes())
}

fn traffic(p: &ProxyHandle) -> String {
    format!("http://{}/pay", p.listen_addrs()[0])
}

async fn metrics(c: &TestClient, p: &ProxyHandle) -> String {
    let (status, _, body) =
        call(c, "GET", &format!("http://{}/metrics", p.admin_addr().unwrap())).await;
    assert_eq!(status, StatusCode::OK);
    String::from_utf8(body.to_vec()).unwrap()
}

/// The value of the first series named `name` whose line holds every one of `labels`.
fn series(text: &str, name: &str, labels: &[&str]) -> Option<f64> {
    text.lines()
        .filter(|l| l.starts_with(&format!("{name}{{")) || l.starts_with(&format!("{name} ")))
        .find(|l| labels.iter().all(|want| l.contains(want)))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

/// A retry refused after a per-try timeout or a connect failure — answers the proxy makes
/// itself (504, 502) — carries `x-stormguard-denied` like any refused retry, and the per-route
/// denied series counts it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_refused_after_a_transport_failure_says_why() {
    let slow = chaos(Phase { latency: Latency::Fixed(ms(400)), ..Phase::default() }).await;
    let mut d = ProxyDependency::new("pay", slow.url("").parse().unwrap());
    d.per_try_timeout = Some(ms(50));
    d.retry_on = "5xx,reset,connect-failure,timeout".parse().unwrap();
    d.budget = "ratio:percent=0,min_per_sec=0".parse().unwrap();
    let p = proxy(d).await;
    let c = client();
    // A GET may be retried after a timeout, but the budget is empty.
    let (status, headers, _) = call(&c, "GET", &traffic(&p)).await;
    assert_eq!(status, StatusCode::GATEWAY_TIMEOUT);
    assert_eq!(headers["x-stormguard-error"], "timeout");
    assert_eq!(headers["x-stormguard-denied"], "budget");
    // A POST is never retried after a timeout: it may have been processed.
    let (status, headers, _) = call(&c, "POST", &traffic(&p)).await;
    assert_eq!(status, StatusCode::GATEWAY_TIMEOUT);
    assert_eq!(headers["x-stormguard-denied"], "non-idempotent");
    let text = metrics(&c, &p).await;
    for reason in ["budget", "non-idempotent"] {
        let n = series(&text, "stormguard_route_denied_total", &[&format!("reason=\"{reason}\"")]);
        assert_eq!(n, Some(1.0), "{reason}:\n{text}");
    }
    p.shutdown().await;

    // A connect failure (nothing listens there), its retry refused by the budget.
    let (closed, _refusing) = crate::common::refused_addr();
    let mut d = ProxyDependency::new("pay", format!("http://{closed}").parse().unwrap());
    d.budget = "ratio:percent=0,min_per_sec=0".parse().unwrap();
    let p = proxy(d).await;
    let (status, headers, _) = call(&c, "GET", &traffic(&p)).await;
    assert_eq!(status, StatusCode::BAD_GATEWAY);
    assert_eq!(headers["x-stormguard-error"], "connect-failure");
    assert_eq!(headers["x-stormguard-denied"], "budget");
    p.shutdown().await;
}

/// Twenty requests in flight at once, then a dashboard polling `/stats.json` every 100 ms: the
/// JSON reader's high-water mark falls to what is in flight, but the next Prometheus scrape still
/// reports the interval's true peak — each reader has its own mark.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_polling_dashboard_does_not_hide_the_scrapes_peak() {
    let upstream = chaos(Phase { latency: Latency::Fixed(ms(1_000)), ..Phase::default() }).await;
    let mut d = ProxyDependency::new("pay", upstream.url("").parse().unwrap());
    d.cap = 20;
    let p = proxy(d).await;
    let c = client();
    let _ = metrics(&c, &p).await; // the scrape interval starts here
    let burst: Vec<_> = (0..20)
        .map(|_| {
            let (c, url) = (c.clone(), traffic(&p));
            tokio::spawn(async move { call(&c, "GET", &url).await.0 })
        })
        .collect();
    for b in burst {
        assert_eq!(b.await.unwrap(), StatusCode::OK);
    }
    // The peak the upstream really had (20, unless the machine was too slow to open them all
    // within the upstream's latency): every reader's first reading must show it.
    let peak = upstream.stats().total.in_flight.max;
    assert!(peak >= 2, "{peak}");
    let stats = format!("http://{}/stats.json", p.admin_addr().unwrap());
    let mut json_max = Vec::new();
    for _ in 0..10 {
        let (_, _, body) = call(&c, "GET", &stats).await;
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
        json_max.push(v["dependencies"][0]["in_flight_max"].as_u64().unwrap());
        tokio::time::sleep(ms(100)).await;
    }
    assert_eq!(json_max[0], peak, "the JSON reader's first reading sees the peak");
    assert_eq!(json_max[9], 0, "and its later readings only what came after: {json_max:?}");
    let text = metrics(&c, &p).await;
    assert_eq!(
        series(&text, "stormguard_in_flight_max", &["dependency=\"pay\""]),
        Some(peak as f64),
        "the scrape still sees its interval's peak"
    );
    let text = metrics(&c, &p).await;
    assert_eq!(series(&text, "stormguard_in_flight_max", &["dependency=\"pay\""]), Some(0.0));
    p.shutdown().await;
}

fn label(u: &ChaosServer) -> String {
    let url = u.url("");
    let hostport = url.trim_start_matches("http://").trim_end_matches('/');
    format!("upstream=\"{hostport}\"")
}

/// Two upstreams: while the first answers, only its series move; when it fails and traffic
/// fails over to the second, the second's in-flight, slot-wait and execution histograms move
/// too, and so do the total cap's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_second_upstreams_series_move_when_traffic_fails_over() {
    let a = chaos(Phase { error_rate: 1.0, status: 503, ..Phase::default() }).await;
    let b = chaos(Phase::default()).await;
    let mut d = ProxyDependency::new("models", a.url("").parse().unwrap());
    d.upstreams.push(b.url("").parse().unwrap());
    d.max_retries = 1;
    d.total_cap = Some(10);
    d.backoff = stormguard_core::backoff::BackoffConfig::parse_range("1ms..2ms").unwrap();
    d.budget = "ratio:percent=10,min_per_sec=100".parse().unwrap();
    let p = proxy(d).await;
    let c = client();
    let (la, lb) = (label(&a), label(&b));
    let before = metrics(&c, &p).await;
    for name in
        ["stormguard_upstream_in_flight_count", "stormguard_upstream_execution_seconds_count"]
    {
        assert_eq!(series(&before, name, &[&lb]), Some(0.0), "{name} before:\n{before}");
    }
    for _ in 0..5 {
        let (status, _, _) = call(&c, "GET", &traffic(&p)).await;
        assert_eq!(status, StatusCode::OK, "answered by the second upstream");
    }
    assert_eq!(b.stats().total.requests, 5);
    let after = metrics(&c, &p).await;
    for name in [
        "stormguard_upstream_in_flight_count",
        "stormguard_upstream_slot_wait_seconds_count",
        "stormguard_upstream_execution_seconds_count",
    ] {
        assert_eq!(series(&after, name, &[&la]), Some(5.0), "{name} of the first:\n{after}");
        assert_eq!(series(&after, name, &[&lb]), Some(5.0), "{name} of the second:\n{after}");
    }
    for name in ["stormguard_total_in_flight_count", "stormguard_total_slot_wait_seconds_count"] {
        assert_eq!(series(&after, name, &["dependency=\"models\""]), Some(10.0), "{name}");
    }
    p.shutdown().await;
}
