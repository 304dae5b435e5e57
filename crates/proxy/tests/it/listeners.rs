//! No caller can hold the proxy itself: connections that send nothing, half a request head, a
//! byte at a time or a bare HTTP/2 preface are closed at the header read or idle timeout, on
//! the caller listeners and the admin listener alike; each listener holds a bounded number of
//! connections, and the admin listener stays reachable when the callers' is full. Raw sockets
//! on 127.0.0.1, as a caller on the same host would. Each expiry is counted in
//! `stormguard_proxy_connections_closed_total`, and the counts are asserted.
//!
//! Timeouts are short (1 s and 2 s) so the tests are quick; what is asserted of time is only
//! that nothing closed before its deadline (the proxy cannot close a connection early) and that
//! each closed within a generous bound (on a proxy without these timeouts they stay open for
//! ever, and the bound fails the test). One test tells the header deadline from a later idle
//! one: 2.2 s against 10 s, its bound 6 s.

use crate::common;

use common::*;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};
use stormguard_chaos::{Latency, Phase};
use stormguard_proxy::config::{AdminToken, ProxyConfig, ProxyDependency};
use stormguard_proxy::{StartError, start};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const HEADER: Duration = Duration::from_secs(1);
const IDLE: Duration = Duration::from_secs(2);
/// Closed at the idle timeout, not the header timeout, as the client sees it: past the midpoint
/// of the two. The proxy starts its idle timer once it has sent the answer, a moment before the
/// client has read it, so the client can see the close a little before `IDLE` (1.9992 s, once).
const PAST_HEADER: Duration = Duration::from_millis(1_500);
/// How long a test waits for a close that should come at 1 or 2 s.
const BOUND: Duration = Duration::from_secs(15);

fn config(upstream: &str) -> ProxyConfig {
    let d = ProxyDependency::new("pay", upstream.parse().unwrap());
    let mut c = ProxyConfig::single("127.0.0.1:0".parse().unwrap(), d);
    c.admin = Some("127.0.0.1:0".parse().unwrap());
    c.connections.header_read_timeout = HEADER;
    c.connections.idle_timeout = IDLE;
    c
}

/// Reads until the server closes the connection (or resets it); the bytes read and how long
/// after `since` the close came. Panics if it does not close within [`BOUND`].
async fn until_closed(s: &mut TcpStream, since: Instant) -> (Vec<u8>, Duration) {
    let mut out = Vec::new();
    let read = tokio::time::timeout(BOUND, async {
        let mut buf = [0u8; 4096];
        loop {
            match s.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => out.extend_from_slice(&buf[..n]),
            }
        }
    })
    .await;
    assert!(read.is_ok(), "the proxy kept the connection open past {BOUND:?}");
    (out, since.elapsed())
}

/// A raw HTTP/1.1 exchange on a new connection (`Connection: close` is added); the whole answer.
async fn exchange(addr: SocketAddr, head: &str, body: &str) -> String {
    let mut s = TcpStream::connect(addr).await.unwrap();
    let req = format!("{head}Content-Length: {}\r\nConnection: close\r\n\r\n{body}", body.len());
    s.write_all(req.as_bytes()).await.unwrap();
    let (out, _) = until_closed(&mut s, Instant::now()).await;
    String::from_utf8_lossy(&out).into_owned()
}

/// A connection with one `GET /ok` answered on it, kept alive.
async fn kept_alive_get(addr: SocketAddr) -> TcpStream {
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(b"GET /ok HTTP/1.1\r\nHost: x\r\n\r\n").await.unwrap();
    let mut answer = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&answer).contains("ok\n") {
        let n = s.read(&mut buf).await.unwrap();
        assert!(n > 0, "closed before the answer");
        answer.extend_from_slice(&buf[..n]);
    }
    s
}

/// `GET /metrics` from the admin listener.
async fn metrics(admin: SocketAddr) -> String {
    let text = exchange(admin, &format!("GET /metrics HTTP/1.1\r\nHost: {admin}\r\n"), "").await;
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    text
}

/// The value of the series `name{labels}` in a scrape, 0 when absent.
fn series(text: &str, name: &str, labels: &str) -> u64 {
    let key = format!("{name}{{{labels}}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&key))
        .map_or(0, |v| v.trim().parse::<f64>().unwrap() as u64)
}

fn closed(text: &str, listener: &str, reason: &str) -> u64 {
    series(
        text,
        "stormguard_proxy_connections_closed_total",
        &format!("listener=\"{listener}\",reason=\"{reason}\""),
    )
}

async fn normal_get(addr: SocketAddr) -> StatusCode {
    let c = client();
    let req = Request::get(format!("http://{addr}/ok")).body(Full::new(Bytes::new())).unwrap();
    let resp = tokio::time::timeout(Duration::from_secs(5), c.request(req))
        .await
        .expect("answered within 5 s")
        .unwrap();
    let status = resp.status();
    resp.into_body().collect().await.unwrap();
    status
}

/// The HTTP/2 connection preface.
const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
/// An empty SETTINGS frame.
const SETTINGS: &[u8] = &[0, 0, 0, 4, 0, 0, 0, 0, 0];

/// 200 connections that send nothing are closed at the header read timeout and counted; a
/// normal request is served meanwhile and after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_are_closed_at_the_header_timeout() {
    let upstream = chaos(Phase::default()).await;
    let p = start(config(&upstream.url(""))).await.unwrap();
    let (addr, admin) = (p.listen_addrs()[0], p.admin_addr().unwrap());
    let mut conns = Vec::new();
    for _ in 0..200 {
        let since = Instant::now();
        conns.push((TcpStream::connect(addr).await.unwrap(), since));
    }
    assert_eq!(normal_get(addr).await, StatusCode::OK, "served while 200 sit idle");
    let waits = conns
        .into_iter()
        .map(|(mut s, since)| tokio::spawn(async move { until_closed(&mut s, since).await }));
    for w in waits {
        let (bytes, after) = w.await.unwrap();
        assert!(bytes.is_empty(), "closed without an answer");
        assert!(after >= HEADER, "closed after {after:?}, before the header timeout");
    }
    let m = metrics(admin).await;
    assert_eq!(closed(&m, &addr.to_string(), "header-timeout"), 200, "{m}");
    assert_eq!(closed(&m, &addr.to_string(), "idle"), 0);
    assert_eq!(normal_get(addr).await, StatusCode::OK);
    p.shutdown().await;
}

/// Half a request head, a head trickled a byte every 100 ms, a bare HTTP/2 preface and a
/// preface with SETTINGS but no stream: all closed, the heads at the header timeout whatever
/// they trickle, the HTTP/2 connections at the idle timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partial_heads_and_bare_prefaces_are_closed() {
    let upstream = chaos(Phase::default()).await;
    let p = start(config(&upstream.url(""))).await.unwrap();
    let (addr, admin) = (p.listen_addrs()[0], p.admin_addr().unwrap());

    let since = Instant::now();
    let mut partial = TcpStream::connect(addr).await.unwrap();
    partial.write_all(b"GET /ok HTTP/1.1\r\nHost: x\r\n").await.unwrap();
    let partial = tokio::spawn(async move { until_closed(&mut partial, since).await });

    let since = Instant::now();
    let trickle = TcpStream::connect(addr).await.unwrap();
    let (mut rd, mut wr) = trickle.into_split();
    let writer = tokio::spawn(async move {
        let head = b"GET /ok HTTP/1.1\r\nHost: x\r\nX-Slow: ";
        let mut sent = 0usize;
        for b in head.iter().chain(std::iter::repeat(&b'a')) {
            if wr.write_all(&[*b]).await.is_err() {
                break;
            }
            sent += 1;
            tokio::time::sleep(ms(100)).await;
            if since.elapsed() > BOUND {
                break;
            }
        }
        sent
    });
    let trickled = tokio::spawn(async move {
        let mut buf = [0u8; 1024];
        let closed = tokio::time::timeout(BOUND, async {
            while let Ok(n) = rd.read(&mut buf).await {
                if n == 0 {
                    break;
                }
            }
        })
        .await;
        assert!(closed.is_ok(), "the trickled head was kept open past {BOUND:?}");
        since.elapsed()
    });

    let since = Instant::now();
    let mut bare = TcpStream::connect(addr).await.unwrap();
    bare.write_all(PREFACE).await.unwrap();
    let bare = tokio::spawn(async move { until_closed(&mut bare, since).await });

    let since = Instant::now();
    let mut settings = TcpStream::connect(addr).await.unwrap();
    settings.write_all(PREFACE).await.unwrap();
    settings.write_all(SETTINGS).await.unwrap();
    let settings = tokio::spawn(async move { until_closed(&mut settings, since).await });

    let (bytes, after) = partial.await.unwrap();
    assert!(bytes.is_empty() && after >= HEADER, "{after:?} {bytes:?}");
    let after = trickled.await.unwrap();
    assert!(after >= HEADER, "{after:?}");
    let sent = writer.await.unwrap();
    assert!(sent >= 2, "the caller kept sending ({sent} bytes) and was closed all the same");
    for h2 in [bare, settings] {
        let (bytes, after) = h2.await.unwrap();
        assert!(after >= IDLE, "an HTTP/2 connection closed after {after:?}");
        // The server's SETTINGS, then a GOAWAY (type 7) before the close.
        assert_eq!(bytes.get(3), Some(&4), "{bytes:?}");
        assert!(frames(&bytes).contains(&7), "a GOAWAY was sent: {bytes:?}");
    }
    let m = metrics(admin).await;
    let l = addr.to_string();
    assert_eq!(closed(&m, &l, "header-timeout"), 2, "{m}");
    assert_eq!(closed(&m, &l, "idle"), 2, "{m}");
    p.shutdown().await;
}

/// The frame types in a run of HTTP/2 frames.
fn frames(mut bytes: &[u8]) -> Vec<u8> {
    let mut types = Vec::new();
    while bytes.len() >= 9 {
        let len = usize::from(bytes[0]) << 16 | usize::from(bytes[1]) << 8 | usize::from(bytes[2]);
        types.push(bytes[3]);
        bytes = &bytes[(9 + len).min(bytes.len())..];
    }
    types
}

/// A kept-alive connection is idle between requests: closed at the idle timeout (2 s), not the
/// header timeout (1 s), and an HTTP/2 connection with no stream open likewise.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kept_alive_connections_are_closed_when_idle() {
    let upstream = chaos(Phase::default()).await;
    let p = start(config(&upstream.url(""))).await.unwrap();
    let (addr, admin) = (p.listen_addrs()[0], p.admin_addr().unwrap());

    let mut s = kept_alive_get(addr).await;
    let answered = Instant::now();
    let (more, after) = until_closed(&mut s, answered).await;
    assert!(more.is_empty());
    assert!(after >= PAST_HEADER, "closed {after:?} after its answer, before the idle timeout");

    // HTTP/2: a request, then no stream open.
    let tcp = TcpStream::connect(addr).await.unwrap();
    let (mut h2, conn) = h2::client::handshake(tcp).await.unwrap();
    let conn = tokio::spawn(conn);
    let req = Request::get(format!("http://{addr}/ok")).body(()).unwrap();
    let (resp, _) = h2.send_request(req, true).unwrap();
    let mut body = resp.await.unwrap().into_body();
    while let Some(d) = body.data().await {
        let _ = body.flow_control().release_capacity(d.unwrap().len());
    }
    let answered = Instant::now();
    drop(body);
    let ended = tokio::time::timeout(BOUND, conn).await;
    assert!(ended.is_ok(), "the idle HTTP/2 connection was kept open past {BOUND:?}");
    assert!(answered.elapsed() >= PAST_HEADER, "closed after {:?}", answered.elapsed());

    let m = metrics(admin).await;
    let l = addr.to_string();
    assert_eq!(closed(&m, &l, "idle"), 2, "{m}");
    assert_eq!(closed(&m, &l, "header-timeout"), 0, "{m}");
    p.shutdown().await;
}

/// On a kept-alive connection, the next request's first byte starts the header timeout (1 s),
/// which ends before the idle timeout (here 10 s) in force until then: the connection is closed
/// at the header timeout, though nothing wakes the watch when the byte comes. The byte comes
/// after the watch has already found the connection idle (about 1 s after the answer), so a
/// watch that slept until the idle deadline would close it 10 s after the answer, not 2.2 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_second_head_is_closed_at_the_header_timeout() {
    let upstream = chaos(Phase::default()).await;
    let mut c = config(&upstream.url(""));
    c.connections.idle_timeout = Duration::from_secs(10);
    let p = start(c).await.unwrap();
    let (addr, admin) = (p.listen_addrs()[0], p.admin_addr().unwrap());

    let mut s = kept_alive_get(addr).await;
    let answered = Instant::now();
    tokio::time::sleep(Duration::from_millis(1_200)).await;
    s.write_all(b"GET /ok HTTP/1.1\r\nHo").await.unwrap();
    let (more, after) = until_closed(&mut s, answered).await;
    assert!(more.is_empty(), "{more:?}");
    // The header deadline is 2.2 s after the answer; the idle one was 10 s.
    assert!(
        after >= Duration::from_millis(2_200) && after < Duration::from_secs(6),
        "closed {after:?} after the answer"
    );
    let m = metrics(admin).await;
    let l = addr.to_string();
    assert_eq!(closed(&m, &l, "header-timeout"), 1, "{m}");
    assert_eq!(closed(&m, &l, "idle"), 0, "{m}");
    p.shutdown().await;
}

/// The admin listener has the same timeouts: idle connections and a partial head are closed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_listener_closes_idle_and_partial_connections() {
    let upstream = chaos(Phase::default()).await;
    let p = start(config(&upstream.url(""))).await.unwrap();
    let admin = p.admin_addr().unwrap();
    let mut waits = Vec::new();
    for i in 0..20 {
        let since = Instant::now();
        let mut s = TcpStream::connect(admin).await.unwrap();
        if i == 0 {
            s.write_all(b"POST /dependencies/pay/retries HTTP/1.1\r\nHost: x\r\n").await.unwrap();
        }
        waits.push(tokio::spawn(async move { until_closed(&mut s, since).await }));
    }
    for w in waits {
        let (bytes, after) = w.await.unwrap();
        assert!(bytes.is_empty() && after >= HEADER, "{after:?} {bytes:?}");
    }
    let m = metrics(admin).await;
    assert_eq!(closed(&m, "admin", "header-timeout"), 20, "{m}");
    assert_eq!(
        series(&m, "stormguard_proxy_connections_max", "listener=\"admin\""),
        64,
        "the admin listener's default limit"
    );
    p.shutdown().await;
}

/// Waits until the series reads `want` (each read is a scrape).
async fn until_series(admin: SocketAddr, name: &str, labels: &str, want: u64) {
    for _ in 0..500 {
        if series(&metrics(admin).await, name, labels) == want {
            return;
        }
        tokio::time::sleep(ms(10)).await;
    }
    panic!("{name}{{{labels}}} never reached {want}");
}

/// With `max_connections = 10` and ten connections each with a request in flight, the 11th
/// connection is closed at once (counted `limit`), and the admin listener still answers
/// `/healthz`. Once the ten are idle (answered, kept alive), a new connection pushes out the one
/// idle longest (counted `evicted`) and is served. The admin listener's own limit works the same
/// way: three idle connections fill it, and a probe still gets in.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_connection_limit_refuses_past_it_and_admin_stays_reachable() {
    let upstream = chaos(Phase { latency: Latency::Fixed(ms(1_500)), ..Phase::default() }).await;
    let mut c = config(&upstream.url(""));
    // Long enough that nothing here expires: the limit alone is tested.
    c.connections.header_read_timeout = Duration::from_secs(3600);
    c.connections.max_connections = Some(10);
    let p = start(c.clone()).await.unwrap();
    let (addr, admin) = (p.listen_addrs()[0], p.admin_addr().unwrap());
    let l = format!("listener=\"{addr}\"");
    let mut busy = Vec::new();
    for _ in 0..10 {
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(b"GET /ok HTTP/1.1\r\nHost: x\r\n\r\n").await.unwrap();
        busy.push(s);
    }
    until_series(admin, "stormguard_proxy_connections", &l, 10).await;
    // Every one has its request in flight (the upstream takes 1.5 s): none may be evicted.
    tokio::time::sleep(ms(100)).await;
    let mut eleventh = TcpStream::connect(addr).await.unwrap();
    let _ = eleventh.write_all(b"GET /ok HTTP/1.1\r\nHost: x\r\n\r\n").await;
    let (bytes, _) = until_closed(&mut eleventh, Instant::now()).await;
    assert!(
        bytes.is_empty(),
        "the 11th connection was served: {}",
        String::from_utf8_lossy(&bytes)
    );
    let health = exchange(admin, &format!("GET /healthz HTTP/1.1\r\nHost: {admin}\r\n"), "").await;
    assert!(health.starts_with("HTTP/1.1 200"), "{health}");
    let m = metrics(admin).await;
    assert_eq!(closed(&m, &addr.to_string(), "limit"), 1, "{m}");
    assert_eq!(series(&m, "stormguard_proxy_connections_max", &l), 10);
    assert_eq!(series(&m, "stormguard_proxy_connections_accepted_total", &l), 10);

    // Answered, the ten sit idle: a new caller pushes the idlest out and is served.
    for s in &mut busy {
        let mut buf = vec![0u8; 4096];
        let n =
            tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf)).await.unwrap().unwrap();
        assert!(buf[..n].starts_with(b"HTTP/1.1 200"), "{}", String::from_utf8_lossy(&buf[..n]));
    }
    assert_eq!(normal_get(addr).await, StatusCode::OK);
    let m = metrics(admin).await;
    assert_eq!(closed(&m, &addr.to_string(), "evicted"), 1, "{m}");
    assert_eq!(closed(&m, &addr.to_string(), "limit"), 1, "{m}");
    drop(busy);
    p.shutdown().await;

    // The admin listener's own limit, on a proxy whose admin listener nothing else has used:
    // three idle connections fill it, and a probe pushes the oldest out.
    c.connections.admin_max_connections = 3;
    let p = start(c).await.unwrap();
    let admin = p.admin_addr().unwrap();
    let mut admin_held = Vec::new();
    for _ in 0..3 {
        admin_held.push(TcpStream::connect(admin).await.unwrap());
    }
    let health = exchange(admin, &format!("GET /healthz HTTP/1.1\r\nHost: {admin}\r\n"), "").await;
    assert!(health.starts_with("HTTP/1.1 200"), "{health}");
    // The first held connection was the one pushed out: it reads its end.
    let (bytes, _) = until_closed(&mut admin_held[0], Instant::now()).await;
    assert!(bytes.is_empty(), "{}", String::from_utf8_lossy(&bytes));
    let m = metrics(admin).await;
    assert!(closed(&m, "admin", "evicted") >= 1, "{m}");
    assert_eq!(closed(&m, "admin", "limit"), 0, "{m}");
    drop(admin_held);
    p.shutdown().await;
}

/// An HTTP/2 caller whose stream is open but who answers no PING is gone: its connection is
/// closed at the keep-alive timeout and counted `h2-keepalive`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http2_peer_that_answers_no_ping_is_closed() {
    let upstream = chaos(Phase { latency: Latency::Fixed(ms(60_000)), ..Phase::default() }).await;
    let mut c = config(&upstream.url(""));
    c.connections.http2_keepalive_interval = ms(300);
    let p = start(c).await.unwrap();
    let (addr, admin) = (p.listen_addrs()[0], p.admin_addr().unwrap());
    let since = Instant::now();
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(PREFACE).await.unwrap();
    s.write_all(SETTINGS).await.unwrap();
    // HEADERS on stream 1, END_STREAM | END_HEADERS: GET http://x/ in HPACK (indexed :method
    // GET, :scheme http, :path /; :authority "x" literal).
    let block = [0x82, 0x86, 0x84, 0x41, 0x01, b'x'];
    let mut frame = vec![0, 0, block.len() as u8, 1, 0x05, 0, 0, 0, 1];
    frame.extend_from_slice(&block);
    s.write_all(&frame).await.unwrap();
    // Nothing is read until the close: the server's PINGs go unanswered.
    let (bytes, after) = until_closed(&mut s, since).await;
    assert!(after >= ms(600), "closed after {after:?}");
    assert!(frames(&bytes).contains(&6), "the server sent a PING: {bytes:?}");
    let m = metrics(admin).await;
    assert_eq!(closed(&m, &addr.to_string(), "h2-keepalive"), 1, "{m}");
    assert_eq!(closed(&m, &addr.to_string(), "idle"), 0, "a stream was open: not idle");
    p.shutdown().await;
}

/// A request head past `max_header_bytes` (64 KiB by default) is answered 431; one under it
/// is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_head_past_max_header_bytes_is_refused() {
    let upstream = chaos(Phase::default()).await;
    let p = start(config(&upstream.url(""))).await.unwrap();
    let addr = p.listen_addrs()[0];
    let head = |n: usize| format!("GET /ok HTTP/1.1\r\nHost: x\r\nX-Big: {}\r\n", "y".repeat(n));
    let big = exchange(addr, &head(80 * 1024), "").await;
    assert!(big.starts_with("HTTP/1.1 431"), "{big}");
    let fits = exchange(addr, &head(40 * 1024), "").await;
    assert!(fits.starts_with("HTTP/1.1 200"), "{fits}");
    p.shutdown().await;
}

/// What one admin request got: its status line.
async fn admin_post(admin: SocketAddr, path: &str, headers: &str) -> String {
    let text =
        exchange(admin, &format!("POST {path} HTTP/1.1\r\n{headers}"), r#"{"enabled": false}"#)
            .await;
    text.lines().next().unwrap_or("").to_string()
}

/// A web page in a browser on the host cannot turn enforcement off: a cross-origin POST, one
/// through a DNS-rebound name (a foreign Host) and one with a form's content type are refused
/// and the switch stays on; the same-origin JSON one and a script's (no Origin) work.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cross_origin_kill_switch_is_refused() {
    let upstream = chaos(Phase::default()).await;
    let p = start(config(&upstream.url(""))).await.unwrap();
    let admin = p.admin_addr().unwrap();
    let port = admin.port();
    let dep = p.dependency("pay").unwrap();
    let switch = "/dependencies/pay/retries";
    let json = "Content-Type: application/json\r\n";

    let cross = format!("Host: {admin}\r\nOrigin: http://evil.example\r\n{json}");
    assert_eq!(admin_post(admin, switch, &cross).await, "HTTP/1.1 403 Forbidden");
    assert!(dep.policy().retries_enabled(), "a cross-origin POST turned retries off");
    let null_origin = format!("Host: {admin}\r\nOrigin: null\r\n{json}");
    assert_eq!(admin_post(admin, switch, &null_origin).await, "HTTP/1.1 403 Forbidden");
    let rebound = format!("Host: evil.example:{port}\r\n{json}");
    assert_eq!(admin_post(admin, switch, &rebound).await, "HTTP/1.1 403 Forbidden");
    let rebound_same_origin =
        format!("Host: evil.example:{port}\r\nOrigin: http://evil.example:{port}\r\n{json}");
    assert_eq!(admin_post(admin, switch, &rebound_same_origin).await, "HTTP/1.1 403 Forbidden");
    for form in ["application/x-www-form-urlencoded", "text/plain", "multipart/form-data"] {
        let h = format!("Host: {admin}\r\nOrigin: http://{admin}\r\nContent-Type: {form}\r\n");
        assert_eq!(admin_post(admin, switch, &h).await, "HTTP/1.1 415 Unsupported Media Type");
    }
    let none = format!("Host: {admin}\r\n");
    assert_eq!(admin_post(admin, switch, &none).await, "HTTP/1.1 415 Unsupported Media Type");
    assert_eq!(
        admin_post(admin, "/reload", &cross).await,
        "HTTP/1.1 403 Forbidden",
        "reload is a state change too"
    );
    assert!(dep.policy().retries_enabled(), "every refused POST left the switch on");

    let same = format!("Host: {admin}\r\nOrigin: http://{admin}\r\n{json}");
    assert_eq!(admin_post(admin, switch, &same).await, "HTTP/1.1 200 OK");
    assert!(!dep.policy().retries_enabled(), "the same-origin JSON POST works");
    let script =
        format!("Host: localhost:{port}\r\nContent-Type: application/json; charset=utf-8\r\n");
    let on =
        exchange(admin, &format!("POST {switch} HTTP/1.1\r\n{script}"), r#"{"enabled": true}"#)
            .await;
    assert!(on.starts_with("HTTP/1.1 200"), "{on}");
    assert!(dep.policy().retries_enabled());
    assert_eq!(admin_post(admin, "/reload", &same).await, "HTTP/1.1 409 Conflict");

    let m = metrics(admin).await;
    let refused =
        |r: &str| series(&m, "stormguard_admin_refused_total", &format!("reason=\"{r}\""));
    assert_eq!(
        (refused("origin"), refused("host"), refused("content-type"), refused("token")),
        (3, 2, 4, 0),
        "{m}"
    );
    p.shutdown().await;
}

/// With `admin_token`, a state change needs the bearer token, whatever its Host and Origin.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_admin_token_is_required_when_configured() {
    let upstream = chaos(Phase::default()).await;
    let mut c = config(&upstream.url(""));
    let token = "0123456789abcdef0123456789abcdef";
    c.admin_access.token = Some(AdminToken::Value(token.into()));
    let p = start(c).await.unwrap();
    let admin = p.admin_addr().unwrap();
    let dep = p.dependency("pay").unwrap();
    let switch = "/dependencies/pay/retries";
    let same =
        format!("Host: {admin}\r\nOrigin: http://{admin}\r\nContent-Type: application/json\r\n");
    assert_eq!(admin_post(admin, switch, &same).await, "HTTP/1.1 401 Unauthorized");
    let wrong = format!("{same}Authorization: Bearer 0123456789abcdef0123456789abcdeX\r\n");
    assert_eq!(admin_post(admin, switch, &wrong).await, "HTTP/1.1 401 Unauthorized");
    let short = format!("{same}Authorization: Bearer 0123\r\n");
    assert_eq!(admin_post(admin, switch, &short).await, "HTTP/1.1 401 Unauthorized");
    assert!(dep.policy().retries_enabled());
    let remote = format!(
        "Host: stormguard.internal:9901\r\nContent-Type: application/json\r\nAuthorization: Bearer {token}\r\n"
    );
    assert_eq!(admin_post(admin, switch, &remote).await, "HTTP/1.1 200 OK");
    assert!(!dep.policy().retries_enabled());
    // Reading needs no token.
    let m = metrics(admin).await;
    assert_eq!(series(&m, "stormguard_admin_refused_total", "reason=\"token\""), 3, "{m}");
    // The token is never shown.
    let config = exchange(admin, &format!("GET /config HTTP/1.1\r\nHost: {admin}\r\n"), "").await;
    assert!(!config.contains(token), "{config}");
    p.shutdown().await;
}

/// A non-loopback admin address needs `admin_allow_remote`: refused at start, naming the key.
#[tokio::test]
async fn a_remote_admin_address_is_refused_without_admin_allow_remote() {
    let mut c = config("http://127.0.0.1:9");
    c.admin = Some("0.0.0.0:0".parse().unwrap());
    let Err(StartError::Invalid(e)) = start(c).await else {
        panic!("a 0.0.0.0 admin address was accepted")
    };
    assert_eq!(e.key.to_string(), "admin");
    assert!(matches!(e.error, stormguard_proxy::config::RuleError::RemoteAdmin(_)));
    assert!(e.error.to_string().contains("admin_allow_remote = true"), "{e}");
}
