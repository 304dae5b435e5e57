//! End to end on 127.0.0.1 with ephemeral ports: callers → the proxy → a chaos upstream that
//! counts exactly what reaches it (`on_disconnect = finish`, like real servers). Request counts
//! are a few thousand, except the 100 000 of the count-in = count-out test against a fast
//! upstream; the suite takes about half a minute in debug on 2 cores.

use crate::common;

use common::*;

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use stormguard_chaos::load::{self, Live, LoadConfig, Mode};
use stormguard_chaos::{ChaosConfig, ChaosServer, Latency, OnDisconnect, Phase};
use stormguard_proxy::config::{ProxyConfig, ProxyDependency};
use stormguard_proxy::{ProxyHandle, start};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn dep(upstream: &ChaosServer) -> ProxyDependency {
    ProxyDependency::new("upstream", upstream.url("").parse().unwrap())
}

async fn proxy(dep: ProxyDependency) -> ProxyHandle {
    let mut c = ProxyConfig::single("127.0.0.1:0".parse().unwrap(), dep);
    c.admin = Some("127.0.0.1:0".parse().unwrap());
    start(c).await.unwrap()
}

fn url(p: &ProxyHandle, path: &str) -> String {
    format!("http://{}{path}", p.listen_addrs()[0])
}

/// Sends one request; returns the status, the headers and the body.
async fn send(
    c: &TestClient,
    method: &str,
    uri: &str,
    body: &'static [u8],
) -> (StatusCode, http::HeaderMap, Bytes) {
    let req = Request::builder()
        .method(method)
        .uri(uri)
        .header("x-request-id", request_id())
        .body(Full::new(Bytes::from_static(body)))
        .unwrap();
    let resp = tokio::time::timeout(Duration::from_secs(10), c.request(req))
        .await
        .unwrap_or_else(|_| panic!("{method} {uri}: no answer in 10 s"))
        .unwrap();
    let (parts, body) = resp.into_parts();
    (parts.status, parts.headers, body.collect().await.unwrap().to_bytes())
}

/// A state change on the admin listener: `POST` with a JSON body, as a script sends it.
async fn admin_post(c: &TestClient, uri: &str, body: &'static [u8]) -> StatusCode {
    let req = Request::post(uri)
        .header(http::header::CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from_static(body)))
        .unwrap();
    let resp = tokio::time::timeout(Duration::from_secs(10), c.request(req))
        .await
        .unwrap_or_else(|_| panic!("POST {uri}: no answer in 10 s"))
        .unwrap();
    resp.status()
}

/// Writes raw bytes on a new connection and returns what came back until the server closed or
/// 2 s passed.
async fn raw(addr: SocketAddr, bytes: &[u8]) -> String {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(bytes).await.unwrap();
    let mut out = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(2), s.read_to_end(&mut out)).await;
    String::from_utf8_lossy(&out).into_owned()
}

fn load_config(target: &str, upstream: &ChaosServer) -> LoadConfig {
    let mut l = LoadConfig::new(target).unwrap();
    l.stats = Some(upstream.url("/stats").parse().unwrap());
    l.timeout = Duration::from_secs(10);
    l
}

fn upstream_max(r: &load::LoadReport) -> u64 {
    r.upstream.as_ref().unwrap()["in_flight"]["max"].as_u64().unwrap()
}

/// 40 % errors under open-loop load above the cap: the upstream never sees more than the cap,
/// and every request gets exactly one answer. The same load through a proxy with retries and
/// no cap to speak of goes over 20.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cap_holds_at_40_percent_errors_under_open_loop_load() {
    let upstream =
        chaos(Phase { error_rate: 0.4, latency: Latency::Fixed(ms(25)), ..Phase::default() }).await;
    let run = |cap: u64| {
        let mut d = dep(&upstream);
        d.cap = cap;
        d.queue = 10_000;
        d.queue_timeout = Duration::from_secs(5);
        d.budget = if cap == 20 {
            "ratio:percent=0.25,min_per_sec=3"
        } else {
            "ratio:percent=10,min_per_sec=1000"
        }
        .parse()
        .unwrap();
        d.per_try_timeout = Some(ms(500));
        d
    };
    for (cap, must_hold) in [(20, true), (10_000, false)] {
        let p = proxy(run(cap)).await;
        let mut l = load_config(&url(&p, "/"), &upstream);
        // 20 slots of 25 ms serve 800/s; arrivals come at 1 000/s.
        l.mode = Mode::Open { rate: "1000/s".parse().unwrap(), max_outstanding: 2000 };
        l.duration = Some(ms(1500));
        let r = load::run(&l, &Live::default()).await.unwrap();
        let max = upstream_max(&r);
        assert_eq!(r.outcomes.total(), r.scheduled, "count in = count out: {:?}", r.outcomes);
        assert_eq!(
            r.outcomes.dropped + r.outcomes.reset + r.outcomes.connect_error,
            0,
            "{:?}",
            r.outcomes
        );
        if must_hold {
            assert!(max <= 20, "cap 20, the upstream saw {max}");
        } else {
            assert!(max > 20, "without a cap the same load should pass 20; saw {max}");
        }
        p.shutdown().await;
    }
}

/// The upstream slows past the per-try timeout and keeps working on what the proxy gave up on:
/// the slot of a timed-out attempt is held, so the upstream stays at the cap (Envoy and HAProxy
/// let it reach 31–32 of 20 here). Without the cap, the same load passes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cap_holds_when_latency_passes_the_per_try_timeout() {
    // Every attempt outlives the 100 ms per-try timeout, many by far more than one more per-try
    // timeout: the timed-out call runs on in the proxy and its slot comes back at the upstream's
    // answer, so a generous hold keeps the cap without wasting slots.
    let upstream = chaos(Phase {
        latency: Latency::Uniform { min: ms(120), max: ms(400) },
        ..Phase::default()
    })
    .await;
    for (cap, must_hold) in [(20, true), (10_000, false)] {
        let mut d = dep(&upstream);
        d.cap = cap;
        d.queue = 10_000;
        d.queue_timeout = Duration::from_secs(5);
        d.per_try_timeout = Some(ms(100));
        d.timeout_slot_hold = ms(2_000);
        d.retry_on = "5xx,reset,connect-failure,timeout".parse().unwrap();
        d.budget = "ratio:percent=10,min_per_sec=1000".parse().unwrap();
        let p = proxy(d).await;
        let mut l = load_config(&url(&p, "/"), &upstream);
        l.mode = Mode::Closed { concurrency: 40 };
        l.duration = Some(ms(1500));
        let r = load::run(&l, &Live::default()).await.unwrap();
        let max = upstream_max(&r);
        assert_eq!(r.outcomes.total(), r.scheduled, "{:?}", r.outcomes);
        if must_hold {
            assert!(max <= 20, "cap 20, the upstream saw {max}");
        } else {
            assert!(max > 20, "without the cap the upstream should pass 20; saw {max}");
        }
        p.shutdown().await;
        // Let the upstream finish what the proxy gave up on before the next round counts.
        tokio::time::sleep(ms(250)).await;
    }
}

/// Resets, 429 storms, truncated and slow bodies, timeouts: every request gets exactly one
/// outcome, the upstream stays under the cap.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn count_in_equals_count_out_under_faults() {
    let upstream = chaos(Phase {
        reset_rate: 0.1,
        error_rate: 0.15,
        status: 429,
        truncate_rate: 0.05,
        latency: Latency::Uniform { min: ms(0), max: ms(60) },
        slow_body: Some(ms(20)),
        body_bytes: 2048,
        ..Phase::default()
    })
    .await;
    let mut d = dep(&upstream);
    d.cap = 16;
    d.per_try_timeout = Some(ms(50));
    // A timed-out attempt's slot comes back when the upstream has sent its whole answer; the
    // hold only bounds that wait. Slow bodies on a busy machine can outlast a hold of one more
    // per-try timeout, so give it room: a generous hold costs nothing when the answer comes.
    d.timeout_slot_hold = ms(2_000);
    d.retry_on = "5xx,reset,connect-failure,timeout,429".parse().unwrap();
    d.budget = "ratio:percent=0.25,min_per_sec=5".parse().unwrap();
    let p = proxy(d).await;
    let mut l = load_config(&url(&p, "/"), &upstream);
    l.mode = Mode::Closed { concurrency: 24 };
    l.requests = Some(3_000);
    let r = load::run(&l, &Live::default()).await.unwrap();
    assert_eq!(r.scheduled, 3_000);
    assert_eq!(r.outcomes.total(), 3_000, "{:?}", r.outcomes);
    assert_eq!(
        r.outcomes.reset + r.outcomes.timeout + r.outcomes.connect_error,
        0,
        "the proxy answers: {:?}",
        r.outcomes
    );
    assert!(upstream_max(&r) <= 16);
    p.shutdown().await;
}

/// A primary refused by a full queue gets 503 with the reason; a retry refused by the budget
/// gives the caller the upstream's last response, marked with the reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_carry_the_reason() {
    let slow = chaos(Phase { latency: Latency::Fixed(ms(400)), ..Phase::default() }).await;
    let mut d = dep(&slow);
    d.cap = 1;
    d.queue = 0;
    let p = proxy(d).await;
    let c = client();
    let u = url(&p, "/");
    let first = tokio::spawn({
        let (c, u) = (c.clone(), u.clone());
        async move { send(&c, "GET", &u, b"").await }
    });
    tokio::time::sleep(ms(100)).await;
    let (status, headers, _) = send(&c, "GET", &u, b"").await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(headers["x-stormguard-denied"], "queue");
    assert_eq!(first.await.unwrap().0, StatusCode::OK);
    p.shutdown().await;

    let failing = chaos(Phase { error_rate: 1.0, status: 502, ..Phase::default() }).await;
    let mut d = dep(&failing);
    d.budget = "ratio:percent=0,min_per_sec=0".parse().unwrap();
    let p = proxy(d).await;
    let (status, headers, _) = send(&c, "GET", &url(&p, "/"), b"").await;
    assert_eq!(status, StatusCode::BAD_GATEWAY, "the upstream's own answer");
    assert_eq!(headers["x-stormguard-denied"], "budget");
    assert!(headers.contains_key("x-chaos-phase"), "the upstream's headers");
    assert_eq!(failing.stats().total.requests, 1);
    p.shutdown().await;
}

/// A POST is never resent after a reset (it may have been processed), and is retried after a
/// connect failure (provably unsent).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn post_not_duplicated_on_reset_but_retried_on_connect_failure() {
    let resetting = chaos(Phase { reset_rate: 1.0, ..Phase::default() }).await;
    let p = proxy(dep(&resetting)).await;
    let c = client();
    let (status, headers, _) = send(&c, "POST", &url(&p, "/pay"), b"pay 10 EUR").await;
    assert_eq!(status, StatusCode::BAD_GATEWAY);
    assert_eq!(headers["x-stormguard-error"], "reset");
    assert_eq!(resetting.stats().total.requests, 1, "sent once");
    // The same with GET is retried.
    let (status, _, _) = send(&c, "GET", &url(&p, "/"), b"").await;
    assert_eq!(status, StatusCode::BAD_GATEWAY);
    assert_eq!(resetting.stats().total.requests, 4, "1 + a GET and its 2 retries");
    p.shutdown().await;

    let (closed, _refusing) = crate::common::refused_addr();
    let p = proxy(ProxyDependency::new("gone", format!("http://{closed}").parse().unwrap())).await;
    let (status, headers, _) = send(&c, "POST", &url(&p, "/pay"), b"pay 10 EUR").await;
    assert_eq!(status, StatusCode::BAD_GATEWAY);
    assert_eq!(headers["x-stormguard-error"], "connect-failure");
    let s = p.dependency("gone").unwrap().snapshot();
    assert_eq!((s.counters.primaries, s.counters.retries), (1, 2), "retried: never sent");
    p.shutdown().await;
}

/// A body larger than the copy limit is forwarded once, whole, and not retried.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_body_forwarded_once_whole() {
    let failing = chaos(Phase { error_rate: 1.0, ..Phase::default() }).await;
    let mut d = dep(&failing);
    d.body_limit = 1024;
    let p = proxy(d).await;
    let big: &'static [u8] = Box::leak(vec![b'x'; 200_000].into_boxed_slice());
    let (status, headers, _) = send(&client(), "PUT", &url(&p, "/"), big).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(headers["x-stormguard-denied"], "body");
    assert_eq!(failing.stats().total.requests, 1);
    p.shutdown().await;
}

/// Malformed requests and oversized headers are refused with 4xx, a Content-Length +
/// Transfer-Encoding request cannot smuggle a second one; absolute-form requests for hosts the proxy does not serve are refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_and_other_hosts_are_refused() {
    let upstream = chaos(Phase::default()).await;
    let p = proxy(dep(&upstream)).await;
    let addr = p.listen_addrs()[0];
    let smuggle = raw(
        addr,
        b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\nGET /smuggled HTTP/1.1\r\nHost: a\r\n\r\n",
    )
    .await;
    // hyper frames such a request by Transfer-Encoding alone, drops the Content-Length, and
    // closes the connection after answering (RFC 9112 §6.3, the alternative to a 400 that the
    // RFC allows): the bytes after the chunked body are never read as a request, and the
    // proxy re-frames every body it forwards, so nothing reaches the upstream but the POST.
    assert!(smuggle.starts_with("HTTP/1.1 200"), "{smuggle}");
    assert!(smuggle.to_ascii_lowercase().contains("connection: close"), "{smuggle}");
    assert_eq!(smuggle.matches("HTTP/1.1 ").count(), 1, "one answer: {smuggle}");
    assert_eq!(upstream.stats().total.requests, 1, "only the POST reached the upstream");
    upstream.reset();
    let garbage = raw(addr, b"NOT HTTP AT ALL\r\n\r\n").await;
    assert!(garbage.starts_with("HTTP/1.1 400"), "{garbage}");
    let huge = format!("GET / HTTP/1.1\r\nHost: a\r\nX-Big: {}\r\n\r\n", "y".repeat(1 << 20));
    let oversized = raw(addr, huge.as_bytes()).await;
    assert!(oversized.starts_with("HTTP/1.1 4"), "{oversized}");
    let other = raw(
        addr,
        b"GET http://example.com/ HTTP/1.1\r\nHost: example.com\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert!(other.starts_with("HTTP/1.1 403"), "{other}");
    let own = format!(
        "GET http://{}/ HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        upstream.local_addr()
    );
    let own = raw(addr, own.as_bytes()).await;
    assert!(own.starts_with("HTTP/1.1 200"), "{own}");
    assert_eq!(upstream.stats().total.requests, 1, "only the configured upstream was reached");
    p.shutdown().await;
}

/// The kill switch and shadow mode take effect on the next request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_switch_and_shadow_mode_take_effect_on_the_next_request() {
    let failing = chaos(Phase { error_rate: 1.0, ..Phase::default() }).await;
    let mut d = dep(&failing);
    d.budget = "ratio:percent=0,min_per_sec=1".parse().unwrap();
    let p = proxy(d).await;
    let c = client();
    let admin = format!("http://{}", p.admin_addr().unwrap());
    let count = || failing.stats().total.requests;
    send(&c, "GET", &url(&p, "/"), b"").await;
    assert_eq!(count(), 3, "a first try and two retries");
    let status =
        admin_post(&c, &format!("{admin}/dependencies/upstream/retries"), br#"{"enabled": false}"#)
            .await;
    assert_eq!(status, StatusCode::OK);
    let (_, headers, _) = send(&c, "GET", &url(&p, "/"), b"").await;
    assert_eq!(count(), 4, "no retry with the switch off");
    assert!(!headers.contains_key("x-stormguard-denied"), "not a denial");
    let status =
        admin_post(&c, &format!("{admin}/dependencies/upstream/retries"), br#"{"enabled": true}"#)
            .await;
    assert_eq!(status, StatusCode::OK);
    // The reserve is spent (10 retries per 10 s): retries are denied by the budget...
    for _ in 0..5 {
        send(&c, "GET", &url(&p, "/"), b"").await;
    }
    let before = count();
    let (_, headers, _) = send(&c, "GET", &url(&p, "/"), b"").await;
    assert_eq!(headers["x-stormguard-denied"], "budget");
    assert_eq!(count(), before + 1);
    // ... until shadow mode lets them through, counting what it would have denied.
    let status =
        admin_post(&c, &format!("{admin}/dependencies/upstream/shadow"), br#"{"enabled": true}"#)
            .await;
    assert_eq!(status, StatusCode::OK);
    let (_, headers, _) = send(&c, "GET", &url(&p, "/"), b"").await;
    assert_eq!(count(), before + 4);
    // The request's own rules still hold in shadow mode: two retries, then `attempts`.
    assert_eq!(headers["x-stormguard-denied"], "attempts");
    let s = p.dependency("upstream").unwrap().snapshot();
    assert!(s.counters.shadow_denied(stormguard_core::Denied::Budget) >= 2);
    p.shutdown().await;
}

/// h2c by prior knowledge reaches the same stack; the admin listener serves metrics and stats.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h2c_and_admin_endpoints() {
    let upstream = chaos(Phase::default()).await;
    let p = proxy(dep(&upstream)).await;
    let h2: TestClient = Client::builder(TokioExecutor::new()).http2_only(true).build_http();
    let (status, _, body) = send(&h2, "GET", &url(&p, "/"), b"").await;
    assert_eq!((status, &body[..]), (StatusCode::OK, &b"ok\n"[..]));
    let c = client();
    let admin = format!("http://{}", p.admin_addr().unwrap());
    let (status, headers, body) = send(&c, "GET", &format!("{admin}/metrics"), b"").await;
    assert_eq!(status, StatusCode::OK);
    assert!(headers["content-type"].to_str().unwrap().starts_with("application/openmetrics-text"));
    let text = String::from_utf8(body.to_vec()).unwrap();
    assert!(text.ends_with("# EOF\n"), "{text}");
    assert!(text.contains("stormguard_requests_total{dependency=\"upstream\"} 1"), "{text}");
    assert!(text.contains("stormguard_retries_enabled{dependency=\"upstream\"} 1"), "{text}");
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        assert!(line.starts_with("stormguard_"), "{line}");
    }
    let (_, _, body) = send(&c, "GET", &format!("{admin}/stats.json"), b"").await;
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
    let d = &v["dependencies"][0];
    assert_eq!(d["requests"], 1);
    // What the dashboard reads: successes, refused primaries, the in-flight and wait buckets.
    assert_eq!((&d["succeeded"], &d["primaries_refused"]), (&1.into(), &0.into()), "{d}");
    assert_eq!(d["in_flight_histogram"], serde_json::json!([0, 1]), "one attempt saw itself");
    assert_eq!(d["slot_wait"]["counts"].as_array().unwrap().iter().filter(|c| **c == 1).count(), 1);
    let (status, headers, body) = send(&c, "GET", &format!("{admin}/dashboard"), b"").await;
    assert_eq!(status, StatusCode::OK);
    assert!(headers["content-type"].to_str().unwrap().starts_with("text/html"));
    let page = String::from_utf8(body.to_vec()).unwrap();
    assert!(page.contains("<td data-f=\"requests\">1</td>"), "{page}");
    assert!(page.contains("<td data-f=\"success\">100.0 %</td>"), "{page}");
    let (_, _, body) = send(&c, "GET", &format!("{admin}/config"), b"").await;
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(v["dependencies"][0]["cap"], 20);
    assert_eq!(send(&c, "GET", &format!("{admin}/healthz"), b"").await.0, StatusCode::OK);
    p.shutdown().await;
}

/// Retries stop when the budget is spent and resume as it refills: a token bucket (gRPC's
/// retry throttling) of 4 tokens allows retries while above 2; failures spend tokens,
/// successes add them back. The same failures through a budget that never runs out are all
/// retried: it is the budget that stops them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retries_stop_when_the_budget_is_spent_and_resume_as_it_refills() {
    let failing =
        Phase { name: "failing".into(), error_rate: 1.0, status: 503, ..Phase::default() };
    let healthy = Phase { name: "healthy".into(), ..Phase::default() };
    let mut script = stormguard_chaos::Script::single(failing.clone());
    script.phases.extend([healthy, failing]);
    let mut c = ChaosConfig::new(script);
    c.on_disconnect = OnDisconnect::Finish;
    let upstream = stormguard_chaos::spawn(c, "127.0.0.1:0".parse().unwrap()).await.unwrap();
    let run = |budget: &str| {
        let mut d = dep(&upstream);
        d.max_retries = 1;
        d.backoff = stormguard_core::backoff::BackoffConfig::parse_range("1ms..2ms").unwrap();
        d.budget = budget.parse().unwrap();
        d
    };
    let c = client();
    // What happened to each of `n` failing requests: "attempts" (retried once, failed again)
    // or "budget" (its retry refused).
    async fn outcomes(c: &TestClient, u: &str, n: usize) -> Vec<String> {
        let mut out = Vec::new();
        for _ in 0..n {
            let (status, headers, _) = send(c, "GET", u, b"").await;
            assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
            out.push(headers["x-stormguard-denied"].to_str().unwrap().to_string());
        }
        out
    }
    let p = proxy(run("token-bucket:max_tokens=4,token_ratio=1")).await;
    let u = url(&p, "/");
    // 4 tokens: the first failure leaves 3 (> 2: retried), its retry's failure 2, and from
    // then on every retry is refused.
    assert_eq!(outcomes(&c, &u, 4).await, ["attempts", "budget", "budget", "budget"]);
    let sent = upstream.stats().total.requests;
    assert_eq!(sent, 5, "4 first tries and one retry");
    // Successes refill the bucket...
    assert_eq!(upstream.next_phase(), "healthy");
    for _ in 0..4 {
        assert_eq!(send(&c, "GET", &u, b"").await.0, StatusCode::OK);
    }
    // ...and retries resume.
    assert_eq!(upstream.next_phase(), "failing");
    assert_eq!(outcomes(&c, &u, 2).await, ["attempts", "budget"]);
    p.shutdown().await;

    // Unprotected: a budget that never runs out retries every failure.
    let p = proxy(run("ratio:percent=10,min_per_sec=1000")).await;
    assert_eq!(outcomes(&c, &url(&p, "/"), 4).await, ["attempts"; 4]);
    p.shutdown().await;
}

/// The per-route series carry dependency, upstream, route and client labels, and the client
/// label is bounded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn route_series_label_dependency_upstream_route_and_a_bounded_client() {
    let upstream = chaos(Phase::default()).await;
    let mut config = ProxyConfig::single("127.0.0.1:0".parse().unwrap(), dep(&upstream));
    config.admin = Some("127.0.0.1:0".parse().unwrap());
    config.routes.push(stormguard_proxy::config::RouteConfig {
        host: None,
        path_prefix: "/api".into(),
        dependency: "upstream".into(),
        budget: None,
        idempotent: false,
    });
    config.client_header = Some(http::HeaderName::from_static("x-client-id"));
    config.client_max = 3;
    let p = start(config).await.unwrap();
    let c = client();
    for i in 0..10 {
        let req = Request::builder()
            .uri(url(&p, if i % 2 == 0 { "/api/x" } else { "/other" }))
            .header("x-client-id", format!("caller-{}", i % 5))
            .body(Full::new(Bytes::new()))
            .unwrap();
        assert_eq!(c.request(req).await.unwrap().status(), StatusCode::OK);
    }
    let admin = format!("http://{}/metrics", p.admin_addr().unwrap());
    let (_, _, body) = send(&c, "GET", &admin, b"").await;
    let text = String::from_utf8(body.to_vec()).unwrap();
    let up = upstream.local_addr();
    let want = format!(
        "stormguard_route_requests_total{{dependency=\"upstream\",upstream=\"{up}\",route=\"/api\",client=\"caller-0\",class=\"2xx\"}} 1"
    );
    assert!(text.contains(&want), "{want}\n{text}");
    let clients: std::collections::BTreeSet<&str> = text
        .lines()
        .filter(|l| l.starts_with("stormguard_route_requests_total"))
        .filter_map(|l| l.split("client=\"").nth(1)?.split('"').next())
        .collect();
    assert_eq!(
        clients.into_iter().collect::<Vec<_>>(),
        ["caller-0", "caller-1", "caller-2", "other"]
    );
    let attempts: u64 = text
        .lines()
        .filter(|l| l.starts_with("stormguard_route_attempts_total"))
        .map(|l| l.rsplit(' ').next().unwrap().parse::<u64>().unwrap())
        .sum();
    assert_eq!(attempts, 10);
    p.shutdown().await;
}

/// Count in = count out over 100 000 requests with resets, 429 storms, timeouts and truncated
/// bodies: every request gets exactly one answer from the proxy, and the upstream stays under
/// the cap. (The slower fault mix, slow bodies included, is `count_in_equals_count_out_under_faults`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn count_in_equals_count_out_over_100k_requests() {
    let upstream = chaos(Phase {
        reset_rate: 0.03,
        error_rate: 0.1,
        status: 429,
        truncate_rate: 0.02,
        latency: Latency::Uniform { min: ms(0), max: ms(2) },
        ..Phase::default()
    })
    .await;
    let mut d = dep(&upstream);
    d.cap = 32;
    d.queue = 1000;
    d.queue_timeout = Duration::from_secs(10);
    d.per_try_timeout = Some(ms(500));
    d.timeout_slot_hold = ms(2_000);
    d.retry_on = "5xx,reset,connect-failure,timeout,429".parse().unwrap();
    d.backoff = stormguard_core::backoff::BackoffConfig::parse_range("1ms..5ms").unwrap();
    d.budget = "ratio:percent=0.25,min_per_sec=5".parse().unwrap();
    let p = proxy(d).await;
    let mut l = load_config(&url(&p, "/"), &upstream);
    l.mode = Mode::Closed { concurrency: 32 };
    l.requests = Some(100_000);
    let r = load::run(&l, &Live::default()).await.unwrap();
    assert_eq!(r.scheduled, 100_000);
    assert_eq!(r.outcomes.total(), 100_000, "{:?}", r.outcomes);
    assert_eq!(
        r.outcomes.reset + r.outcomes.timeout + r.outcomes.connect_error,
        0,
        "the proxy answers every request itself: {:?}",
        r.outcomes
    );
    let s = p.dependency("upstream").unwrap().snapshot();
    assert_eq!(s.counters.primaries, 100_000, "every request reached the stack once");
    assert!(upstream_max(&r) <= 32);
    p.shutdown().await;
}

/// The first sentence of the problem: callers give up after 500 ms, the upstream takes 700 ms
/// and keeps working on every request after its caller has gone, callers arrive at 80/s in
/// open loop, cap 20. Each abandoned attempt keeps its slot until the upstream has answered
/// (the proxy reads the answer and discards it), so the upstream never has more than 20 in
/// flight, and every abandoned attempt is counted. With the hold turned off
/// (`abandon_hold = 0`: the slot comes back the moment the caller disconnects) the same load
/// pushes the upstream far past the cap.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn callers_that_give_up_never_push_the_upstream_past_the_cap() {
    let upstream = chaos(Phase { latency: Latency::Fixed(ms(700)), ..Phase::default() }).await;
    for hold in [true, false] {
        let mut d = dep(&upstream);
        d.cap = 20;
        d.budget = "ratio:percent=0.25,min_per_sec=3".parse().unwrap();
        if !hold {
            d.abandon_hold = Duration::ZERO;
        }
        let p = proxy(d).await;
        let mut l = load_config(&url(&p, "/"), &upstream);
        l.mode = Mode::Open { rate: "80/s".parse().unwrap(), max_outstanding: 2_000 };
        l.duration = Some(ms(4_000));
        l.timeout = ms(500);
        let r = load::run(&l, &Live::default()).await.unwrap();
        let max = upstream_max(&r);
        eprintln!(
            "abandon_hold {}: the upstream had {max} in flight (cap 20)",
            if hold { "30s" } else { "0" }
        );
        assert_eq!(r.outcomes.total(), r.scheduled, "{:?}", r.outcomes);
        assert!(r.outcomes.timeout > 200, "the callers gave up: {:?}", r.outcomes);
        // Everything the upstream was sent ends within its 700 ms; then the holds are gone.
        let dependency = p.dependency("upstream").unwrap();
        let mut s = dependency.snapshot();
        for _ in 0..100 {
            if s.limiter.in_flight == 0 {
                break;
            }
            tokio::time::sleep(ms(50)).await;
            s = dependency.snapshot();
        }
        assert_eq!(s.limiter.in_flight, 0, "every slot came back");
        let stats: serde_json::Value = {
            let c = client();
            let admin = format!("http://{}/stats.json", p.admin_addr().unwrap());
            let (_, _, body) = send(&c, "GET", &admin, b"").await;
            serde_json::from_slice(&body).unwrap()
        };
        let abandoned = &stats["dependencies"][0]["abandoned"];
        if hold {
            assert!(max <= 20, "cap 20, the upstream saw {max}");
            assert_eq!(max, 20, "the load reached the cap");
            // Every attempt the upstream received was abandoned by its caller (each one takes
            // 700 ms, past the callers' 500 ms), and each was counted when it finished.
            let (_, _, body) = send(&client(), "GET", &upstream.url("/stats"), b"").await;
            let now: serde_json::Value = serde_json::from_slice(&body).unwrap();
            let received = now["requests"].as_u64().unwrap();
            assert!(received > 20, "{now}");
            assert_eq!(abandoned["finished"].as_u64(), Some(received), "{stats}");
            assert_eq!(abandoned["cut"].as_u64(), Some(0));
        } else {
            assert!(max > 30, "without the hold the upstream should pass the cap; saw {max}");
            assert_eq!(abandoned["finished"].as_u64(), Some(0), "cut at once: {stats}");
        }
        p.shutdown().await;
        tokio::time::sleep(ms(800)).await;
    }
}
