//! HTTP strictness where it matters: what the upstream acts on is what the route was chosen
//! by (one Host, the absolute-form's authority, an h2 caller's `:authority`), a caller's body is
//! never lost, and an upstream's invalid answer is a 502 that is not retried.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::rt::{TokioExecutor, TokioIo};
use stormguard_core::breaker::BreakerConfig;
use stormguard_proxy::config::{ProxyConfig, ProxyDependency};
use stormguard_proxy::{ProxyHandle, start};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

async fn proxy(d: ProxyDependency) -> ProxyHandle {
    let mut c = ProxyConfig::single("127.0.0.1:0".parse().unwrap(), d);
    c.admin = None;
    start(c).await.unwrap()
}

/// An upstream that answers each request with what it received: `host|body length`.
async fn echo() -> (SocketAddr, Arc<AtomicU64>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let seen = Arc::new(AtomicU64::new(0));
    let count = seen.clone();
    tokio::spawn(async move {
        while let Ok((s, _)) = listener.accept().await {
            let count = count.clone();
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(move |req: Request<hyper::body::Incoming>| {
                    let count = count.clone();
                    async move {
                        count.fetch_add(1, Ordering::SeqCst);
                        let path = req.uri().path().to_string();
                        let hosts: Vec<String> = req
                            .headers()
                            .get_all(http::header::HOST)
                            .iter()
                            .map(|h| h.to_str().unwrap_or("?").to_string())
                            .collect();
                        let len = req.into_body().collect().await.unwrap().to_bytes().len();
                        let text = format!("{}|{len}", hosts.join(","));
                        let mut resp = Response::new(Full::new(Bytes::from(text)));
                        resp.headers_mut().insert("x-path", path.parse().unwrap());
                        Ok::<_, std::convert::Infallible>(resp)
                    }
                });
                let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(s), svc)
                    .await;
            });
        }
    });
    (addr, seen)
}

/// An upstream that answers every request with `answer`, raw, and closes; counts requests.
async fn raw_upstream(answer: &'static [u8]) -> (SocketAddr, Arc<AtomicU64>) {
    split_upstream(answer, b"", Duration::ZERO).await
}

/// An upstream that answers every request with `head`, then after `pause` with `rest`, and
/// closes; counts requests.
async fn split_upstream(
    head: &'static [u8],
    rest: &'static [u8],
    pause: Duration,
) -> (SocketAddr, Arc<AtomicU64>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let seen = Arc::new(AtomicU64::new(0));
    let count = seen.clone();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            let count = count.clone();
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let mut chunk = [0u8; 1024];
                while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
                    match s.read(&mut chunk).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => buf.extend_from_slice(&chunk[..n]),
                    }
                }
                count.fetch_add(1, Ordering::SeqCst);
                let _ = s.write_all(head).await;
                if !rest.is_empty() {
                    tokio::time::sleep(pause).await;
                    let _ = s.write_all(rest).await;
                }
                let _ = s.shutdown().await;
            });
        }
    });
    (addr, seen)
}

/// Writes `bytes` on a new connection and returns what came back until the proxy closed it
/// (or 5 s passed).
async fn raw(addr: SocketAddr, bytes: &[u8]) -> String {
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(bytes).await.unwrap();
    let mut out = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut out)).await;
    String::from_utf8_lossy(&out).into_owned()
}

fn body_of(text: &str) -> &str {
    text.split("\r\n\r\n").nth(1).unwrap_or("")
}

/// Two Host headers are refused (RFC 9112 §3.2: 400) and never forwarded; one is forwarded as
/// the caller sent it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicate_host_is_refused() {
    let (up, seen) = echo().await;
    let p = proxy(ProxyDependency::new("api", format!("http://{up}").parse().unwrap())).await;
    let addr = p.listen_addrs()[0];
    let text = raw(
        addr,
        b"GET /x HTTP/1.1\r\nhost: a.example\r\nhost: b.example\r\nconnection: close\r\n\r\n",
    )
    .await;
    assert!(text.starts_with("HTTP/1.1 400"), "{text}");
    assert_eq!(seen.load(Ordering::SeqCst), 0, "never forwarded");
    let text = raw(addr, b"GET /x HTTP/1.1\r\nhost: a.example\r\nconnection: close\r\n\r\n").await;
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    assert_eq!(body_of(&text), "a.example|0");
    p.shutdown().await;
}

/// An absolute-form request is routed by its authority, so the upstream must act on the same
/// host: the Host header is set from the request target (RFC 9112 §3.2.2), whatever the caller
/// wrote in Host.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn absolute_form_sets_the_host_from_the_target() {
    let (up, _) = echo().await;
    let p = proxy(ProxyDependency::new("api", format!("http://{up}").parse().unwrap())).await;
    let req = format!(
        "GET http://{up}/x HTTP/1.1\r\nhost: elsewhere.example\r\nconnection: close\r\n\r\n"
    );
    let text = raw(p.listen_addrs()[0], req.as_bytes()).await;
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    assert_eq!(body_of(&text), format!("{up}|0"));
    p.shutdown().await;
}

/// A route is chosen by the path with dot segments resolved and slashes merged:
/// `/checkout/../admin` is not the `/checkout` route's (its dependency, its budget), whatever way
/// its dots are spelled. The upstream gets the path as the caller sent it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routes_are_matched_on_the_normalized_path() {
    let (checkout, to_checkout) = echo().await;
    let (other, to_other) = echo().await;
    let mut c = ProxyConfig::single(
        "127.0.0.1:0".parse().unwrap(),
        ProxyDependency::new("other", format!("http://{other}").parse().unwrap()),
    );
    c.dependencies
        .push(ProxyDependency::new("checkout", format!("http://{checkout}").parse().unwrap()));
    c.routes.push(stormguard_proxy::config::RouteConfig {
        host: None,
        path_prefix: "/checkout".into(),
        dependency: "checkout".into(),
        budget: None,
        idempotent: false,
    });
    c.admin = None;
    let p = start(c).await.unwrap();
    let addr = p.listen_addrs()[0];
    for (target, to_route) in [
        ("/checkout/../admin", false),
        ("/checkout/%2e%2E/admin?x=1", false),
        ("/checkout/./pay", true),
        ("//checkout//pay", true),
        ("/checkout/pay", true),
    ] {
        let forwarded = target.split('?').next().unwrap();
        let before = (to_checkout.load(Ordering::SeqCst), to_other.load(Ordering::SeqCst));
        let req = format!("GET {target} HTTP/1.1\r\nhost: a\r\nconnection: close\r\n\r\n");
        let text = raw(addr, req.as_bytes()).await;
        assert!(text.starts_with("HTTP/1.1 200"), "{target}: {text}");
        assert!(text.contains(&format!("x-path: {forwarded}\r\n")), "{target}: {text}");
        let after = (to_checkout.load(Ordering::SeqCst), to_other.load(Ordering::SeqCst));
        let want = if to_route { (before.0 + 1, before.1) } else { (before.0, before.1 + 1) };
        assert_eq!(after, want, "{target}");
    }
    p.shutdown().await;
}

/// An HTTP/2 caller names the host in `:authority`: the upstream gets it as Host.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_h2_callers_authority_is_the_upstreams_host() {
    let (up, _) = echo().await;
    let p = proxy(ProxyDependency::new("api", format!("http://{up}").parse().unwrap())).await;
    let c: hyper_util::client::legacy::Client<_, Full<Bytes>> =
        hyper_util::client::legacy::Client::builder(TokioExecutor::new())
            .http2_only(true)
            .build_http();
    // `localhost` is loopback: the client connects to the proxy and names it in `:authority`
    // (no Host header in HTTP/2).
    let authority = format!("localhost:{}", p.listen_addrs()[0].port());
    let req = Request::get(format!("http://{authority}/x")).body(Full::new(Bytes::new())).unwrap();
    let resp = c.request(req).await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(body, Bytes::from(format!("{authority}|0")));
    p.shutdown().await;
}

/// A GET's chunked body reaches the upstream whole (Transfer-Encoding is hop-by-hop: the proxy
/// frames the body itself).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_get_with_a_chunked_body_keeps_it() {
    let (up, _) = echo().await;
    let p = proxy(ProxyDependency::new("api", format!("http://{up}").parse().unwrap())).await;
    let text = raw(
        p.listen_addrs()[0],
        b"GET /search HTTP/1.1\r\nhost: a\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
    )
    .await;
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    assert_eq!(body_of(&text), "a|5");
    // Past the replay buffer the body streams to the upstream as it arrives: still whole.
    let mut req = b"GET /search HTTP/1.1\r\nhost: a\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n".to_vec();
    for _ in 0..4 {
        req.extend_from_slice(format!("{:x}\r\n", 25_600).as_bytes());
        req.extend_from_slice(&[b'x'; 25_600]);
        req.extend_from_slice(b"\r\n");
    }
    req.extend_from_slice(b"0\r\n\r\n");
    let text = raw(p.listen_addrs()[0], &req).await;
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    assert_eq!(body_of(&text), "a|102400");
    p.shutdown().await;
}

/// An upstream's invalid answer — an unsolicited 101, a malformed status line — is a 502
/// (`x-stormguard-error: protocol`), never retried (the same request gets the same answer),
/// and counted by the breaker. A reset, by contrast, is retried: the test's upstream counts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_invalid_upstream_answer_is_a_502_not_retried() {
    for answer in [
        &b"HTTP/1.1 101 Switching Protocols\r\nupgrade: foo\r\nconnection: upgrade\r\n\r\n"[..],
        &b"HTTP/1.1 2x0 OK\r\ncontent-length: 0\r\n\r\n"[..],
    ] {
        let (up, seen) = raw_upstream(answer).await;
        let mut d = ProxyDependency::new("api", format!("http://{up}").parse().unwrap());
        d.breaker =
            Some(BreakerConfig { consecutive_failures: Some(1), ..BreakerConfig::default() });
        d.backoff = stormguard_core::backoff::BackoffConfig::parse_range("1ms..2ms").unwrap();
        let p = proxy(d).await;
        let text =
            raw(p.listen_addrs()[0], b"GET /x HTTP/1.1\r\nhost: a\r\nconnection: close\r\n\r\n")
                .await;
        assert!(text.starts_with("HTTP/1.1 502"), "{text}");
        assert!(text.contains("x-stormguard-error: protocol"), "{text}");
        assert_eq!(seen.load(Ordering::SeqCst), 1, "not retried");
        let s = p.dependency("api").unwrap().snapshot();
        assert!(format!("{:?}", s.breaker.unwrap()).starts_with("Open"), "the breaker counts it");
        p.shutdown().await;
    }
    // The unprotected path: an upstream that closes without answering is a reset, retried.
    let (up, seen) = raw_upstream(b"").await;
    let mut d = ProxyDependency::new("api", format!("http://{up}").parse().unwrap());
    d.backoff = stormguard_core::backoff::BackoffConfig::parse_range("1ms..2ms").unwrap();
    let p = proxy(d).await;
    let text =
        raw(p.listen_addrs()[0], b"GET /x HTTP/1.1\r\nhost: a\r\nconnection: close\r\n\r\n").await;
    assert!(text.starts_with("HTTP/1.1 502"), "{text}");
    assert!(text.contains("x-stormguard-error: reset"), "{text}");
    assert_eq!(seen.load(Ordering::SeqCst), 3, "a reset is retried twice");
    p.shutdown().await;
}

/// An upstream 200 whose body breaks (an invalid chunk size) before the proxy has relayed
/// anything: the caller gets an answer — a 502 when the break is already there when the
/// response is relayed, else the 200's head and a cut body — never a silently closed
/// connection. Before, it got nothing at all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_upstream_body_never_leaves_the_caller_with_nothing() {
    for (answer, kind) in [
        // Not valid HTTP: `protocol`, as docs/proxy.md promises.
        (&b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\nhello\r\n"[..], "protocol"),
        // Valid, but the connection closed early: `reset`.
        (&b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nshort"[..], "reset"),
    ] {
        let (up, _) = raw_upstream(answer).await;
        let p = proxy(ProxyDependency::new("api", format!("http://{up}").parse().unwrap())).await;
        let text =
            raw(p.listen_addrs()[0], b"GET /x HTTP/1.1\r\nhost: a\r\nconnection: close\r\n\r\n")
                .await;
        assert!(
            text.starts_with("HTTP/1.1 502") || text.starts_with("HTTP/1.1 200"),
            "the caller got no answer: {text:?}"
        );
        if text.starts_with("HTTP/1.1 200") {
            assert!(!text.contains("hello") || !text.ends_with("0\r\n\r\n"), "cut short: {text:?}");
        } else {
            assert!(text.contains(&format!("x-stormguard-error: {kind}")), "{text:?}");
        }
        eprintln!("caller saw: {:?}", text.lines().next());
        p.shutdown().await;
    }
    // The break comes after the head: the head reaches the caller, then the body is cut.
    let (up, _) = split_upstream(
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n",
        b"zz\r\nhello\r\n",
        Duration::from_millis(200),
    )
    .await;
    let p = proxy(ProxyDependency::new("api", format!("http://{up}").parse().unwrap())).await;
    let text =
        raw(p.listen_addrs()[0], b"GET /x HTTP/1.1\r\nhost: a\r\nconnection: close\r\n\r\n").await;
    assert!(
        text.starts_with("HTTP/1.1 200") || text.starts_with("HTTP/1.1 502"),
        "the caller got no answer: {text:?}"
    );
    eprintln!("caller saw: {:?}", text.lines().next());
    p.shutdown().await;
}
