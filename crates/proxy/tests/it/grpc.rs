//! gRPC through an h2c upstream: a trailers-only UNAVAILABLE is retried on a method marked
//! idempotent (and only there: every gRPC call is a POST); a response that has streamed is
//! never retried, whatever its trailers say; `grpc-retry-pushback-ms` is honoured; each attempt
//! carries what is left of the deadline as `grpc-timeout`, never more than the caller asked.
//! The caller speaks h2c to the proxy, as gRPC clients do.

use crate::support;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderMap, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use stormguard_proxy::config::{ProxyConfig, ProxyDependency, RouteConfig};
use stormguard_proxy::grpc::parse_timeout;
use stormguard_proxy::{ProxyHandle, start};
use support::{Body, Counts, Serve, Upstream, answer, dep, full, upstream};

const METHOD: &str = "/pay.Payments/Charge";

/// What each attempt looked like at the upstream.
#[derive(Clone, Debug)]
struct Seen {
    at: Instant,
    grpc_timeout: Option<Duration>,
    te: Option<String>,
}

type Log = Arc<Mutex<Vec<Seen>>>;

fn grpc_headers(resp: &mut Response<Body>) {
    resp.headers_mut().insert("content-type", "application/grpc".parse().unwrap());
}

/// A trailers-only response: HEADERS with END_STREAM, the status in the headers.
fn trailers_only(status: u8, extra: &[(&'static str, &'static str)]) -> Response<Body> {
    let mut r = Response::new(full(Bytes::new()));
    grpc_headers(&mut r);
    r.headers_mut().insert("grpc-status", status.to_string().parse().unwrap());
    for (k, v) in extra {
        r.headers_mut().insert(*k, v.parse().unwrap());
    }
    r
}

/// A streamed response: headers, a message, then trailers with `status`.
fn streamed(status: u8) -> Response<Body> {
    let mut trailers = HeaderMap::new();
    trailers.insert("grpc-status", status.to_string().parse().unwrap());
    let body = Full::new(Bytes::from_static(b"\0\0\0\0\x02hi"))
        .with_trailers(async move { Some(Ok(trailers)) })
        .boxed();
    let mut r = Response::new(body);
    grpc_headers(&mut r);
    r
}

/// An h2c upstream that logs each attempt and answers the nth with `answers(n)`.
async fn grpc_upstream(
    answers: impl Fn(usize) -> Response<Body> + Send + Sync + 'static,
) -> (Upstream, Log) {
    let log: Log = Arc::default();
    let answers = Arc::new(answers);
    let l = log.clone();
    let up = upstream(Serve::default(), move |req| {
        let (log, answers) = (l.clone(), answers.clone());
        async move {
            let h = req.headers();
            let seen = Seen {
                at: Instant::now(),
                grpc_timeout: h.get("grpc-timeout").and_then(|v| parse_timeout(v.as_bytes())),
                te: h.get("te").and_then(|v| v.to_str().ok()).map(str::to_string),
            };
            let n = {
                let mut log = log.lock().unwrap();
                log.push(seen);
                log.len()
            };
            answers(n)
        }
    })
    .await;
    (up, log)
}

fn grpc_dep(up: &Upstream) -> ProxyDependency {
    let mut d = dep(&format!("http://{}", up.addr));
    d.http2.prior_knowledge = true;
    d.retry_on = "5xx,reset,connect-failure,refused-stream,unavailable".parse().unwrap();
    d
}

/// A proxy whose `METHOD` route is marked idempotent (or not).
async fn proxy(d: ProxyDependency, idempotent: bool) -> ProxyHandle {
    let mut c = ProxyConfig::single("127.0.0.1:0".parse().unwrap(), d);
    c.admin = None;
    c.routes.push(RouteConfig {
        host: None,
        path_prefix: METHOD.into(),
        dependency: "upstream".into(),
        budget: None,
        idempotent,
    });
    start(c).await.unwrap()
}

type Caller = Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>>;

/// One unary call over h2c, with optional request headers.
async fn call(p: &ProxyHandle, headers: &[(&str, &str)]) -> support::Answer {
    let caller: Caller = Client::builder(TokioExecutor::new()).http2_only(true).build_http();
    let mut req = Request::builder()
        .method("POST")
        .uri(format!("http://{}{METHOD}", p.listen_addrs()[0]))
        .header("content-type", "application/grpc")
        .body(Full::new(Bytes::from_static(b"\0\0\0\0\x02hi")))
        .unwrap();
    for (k, v) in headers {
        req.headers_mut()
            .insert(http::HeaderName::from_bytes(k.as_bytes()).unwrap(), v.parse().unwrap());
    }
    answer(caller.request(req).await.unwrap()).await
}

fn grpc_status(a: &support::Answer) -> Option<String> {
    a.trailers
        .as_ref()
        .and_then(|t| t.get("grpc-status"))
        .or_else(|| a.headers.get("grpc-status"))
        .map(|v| v.to_str().unwrap().to_string())
}

#[tokio::test]
async fn a_trailers_only_unavailable_is_retried_on_an_idempotent_method() {
    let answer = |n| if n == 1 { trailers_only(14, &[]) } else { streamed(0) };
    let (up, _) = grpc_upstream(answer).await;
    let p = proxy(grpc_dep(&up), true).await;
    let a = call(&p, &[]).await;
    assert_eq!(a.status, StatusCode::OK);
    assert_eq!(grpc_status(&a).as_deref(), Some("0"));
    assert_eq!(Counts::get(&up.counts.handled), 2, "the UNAVAILABLE and its retry");
    p.shutdown().await;

    // Unprotected: the same method not marked idempotent is a plain POST, which may have
    // been processed — the caller gets the UNAVAILABLE, and nothing is sent twice.
    let (up, _) = grpc_upstream(answer).await;
    let p = proxy(grpc_dep(&up), false).await;
    let a = call(&p, &[]).await;
    assert_eq!(grpc_status(&a).as_deref(), Some("14"));
    assert_eq!(a.headers["x-stormguard-denied"], "non-idempotent");
    assert_eq!(Counts::get(&up.counts.handled), 1);
    p.shutdown().await;
}

#[tokio::test]
async fn a_streamed_response_is_never_retried() {
    // Headers (200, application/grpc), a message, then trailers with UNAVAILABLE: bytes
    // went to the caller before the status was known.
    let (up, _) = grpc_upstream(|_| streamed(14)).await;
    let p = proxy(grpc_dep(&up), true).await;
    let a = call(&p, &[]).await;
    assert_eq!(a.status, StatusCode::OK);
    assert_eq!(a.body.as_ref(), b"\0\0\0\0\x02hi");
    assert_eq!(grpc_status(&a).as_deref(), Some("14"), "the trailers reach the caller");
    assert_eq!(Counts::get(&up.counts.handled), 1);
    assert_eq!(p.dependency("upstream").unwrap().snapshot().counters.retries, 0);
    p.shutdown().await;
}

#[tokio::test]
async fn grpc_retry_pushback_ms_is_honoured() {
    // "Do not retry" (negative): no retry, the reason on the response.
    let (up, _) = grpc_upstream(|_| trailers_only(14, &[("grpc-retry-pushback-ms", "-1")])).await;
    let p = proxy(grpc_dep(&up), true).await;
    let a = call(&p, &[]).await;
    assert_eq!(grpc_status(&a).as_deref(), Some("14"));
    assert_eq!(a.headers["x-stormguard-denied"], "pushback");
    assert_eq!(Counts::get(&up.counts.handled), 1);
    p.shutdown().await;

    // A wait: the retry comes no sooner (the backoff is 1–5 ms; the pushback replaces it).
    let (up, log) = grpc_upstream(|n| {
        if n == 1 { trailers_only(14, &[("grpc-retry-pushback-ms", "80")]) } else { streamed(0) }
    })
    .await;
    let p = proxy(grpc_dep(&up), true).await;
    let a = call(&p, &[]).await;
    assert_eq!(grpc_status(&a).as_deref(), Some("0"));
    let log = log.lock().unwrap().clone();
    assert_eq!(log.len(), 2);
    let gap = log[1].at - log[0].at;
    assert!(gap >= Duration::from_millis(80), "retried after {gap:?}");
    println!("grpc: pushback 80 ms, retried after {gap:?}");
    p.shutdown().await;
}

#[tokio::test]
async fn each_attempt_carries_the_time_left_as_grpc_timeout() {
    let answer = |n| if n == 1 { trailers_only(14, &[]) } else { streamed(0) };
    let (up, log) = grpc_upstream(answer).await;
    let mut d = grpc_dep(&up);
    d.deadline = Some(Duration::from_secs(2));
    let p = proxy(d, true).await;
    let a = call(&p, &[]).await;
    assert_eq!(grpc_status(&a).as_deref(), Some("0"));
    let seen = log.lock().unwrap().clone();
    let t: Vec<Duration> = seen.iter().map(|s| s.grpc_timeout.expect("grpc-timeout")).collect();
    assert!(t[0] <= Duration::from_secs(2) && t[0] > Duration::from_millis(1500), "{t:?}");
    assert!(t[1] < t[0], "the retry has less left: {t:?}");
    // gRPC servers require `te: trailers`; it is hop-by-hop, so the proxy sends its own.
    assert!(seen.iter().all(|s| s.te.as_deref() == Some("trailers")));
    println!("grpc: deadline 2 s, grpc-timeout on the attempts: {t:?}");

    // A caller's own smaller timeout is the deadline: never raised, and shrinking.
    let a = call(&p, &[("grpc-timeout", "300m")]).await;
    assert_eq!(grpc_status(&a).as_deref(), Some("0"));
    let seen = log.lock().unwrap().clone();
    assert_eq!(seen.len(), 3, "the third attempt succeeded at once");
    let t = seen[2].grpc_timeout.unwrap();
    assert!(t <= Duration::from_millis(300) && t > Duration::from_millis(100), "{t:?}");
    // A caller's larger one is cut to the dependency's deadline.
    call(&p, &[("grpc-timeout", "1H")]).await;
    let t = log.lock().unwrap()[3].grpc_timeout.unwrap();
    assert!(t <= Duration::from_secs(2), "{t:?}");
    p.shutdown().await;

    // No deadline anywhere: nothing is made up.
    let (up, log) = grpc_upstream(|_| streamed(0)).await;
    let p = proxy(grpc_dep(&up), true).await;
    call(&p, &[]).await;
    assert_eq!(log.lock().unwrap()[0].grpc_timeout, None);
    p.shutdown().await;
}
