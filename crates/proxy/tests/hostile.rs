//! A caller's failure is the caller's: request bodies that break, stall or dawdle never open the
//! breaker for everyone, never spend the budget, and never hold a slot of the cap while the
//! caller takes its time. Raw sockets on 127.0.0.1, as an attacker on the same host would.

mod common;

use common::*;

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};
use stormguard_chaos::{Latency, Phase};
use stormguard_core::breaker::BreakerConfig;
use stormguard_proxy::config::{ProxyConfig, ProxyDependency};
use stormguard_proxy::{ProxyHandle, start};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

async fn proxy(d: ProxyDependency, body_idle: Duration) -> ProxyHandle {
    let mut c = ProxyConfig::single("127.0.0.1:0".parse().unwrap(), d);
    c.admin = None;
    c.body_idle_timeout = body_idle;
    start(c).await.unwrap()
}

async fn get(c: &TestClient, addr: SocketAddr) -> (StatusCode, http::HeaderMap) {
    let req = Request::get(format!("http://{addr}/ok")).body(Full::new(Bytes::new())).unwrap();
    let resp = tokio::time::timeout(Duration::from_secs(2), c.request(req))
        .await
        .expect("answered within 2 s")
        .unwrap();
    let (parts, body) = resp.into_parts();
    body.collect().await.unwrap();
    (parts.status, parts.headers)
}

/// Sends `head` and `body` on a new connection, then closes its sending side.
async fn abort_after(addr: SocketAddr, head: &str, body: &[u8]) -> String {
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(head.as_bytes()).await.unwrap();
    s.write_all(body).await.unwrap();
    s.shutdown().await.unwrap();
    let mut out = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut out)).await;
    String::from_utf8_lossy(&out).into_owned()
}

fn breaker() -> BreakerConfig {
    BreakerConfig { consecutive_failures: Some(10), ..BreakerConfig::default() }
}

/// 25 POSTs that promise 100 bytes (or 100 KiB, past the replay buffer, so the attempt is
/// already at the upstream) and close after a few: the breaker stays closed, and a normal GET
/// is answered by the upstream. The same number of failures the upstream causes (resets) does
/// open it: the breaker was armed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aborted_bodies_do_not_open_the_breaker() {
    let upstream = chaos(Phase::default()).await;
    let mut d = ProxyDependency::new("pay", upstream.url("").parse().unwrap());
    d.breaker = Some(breaker());
    let p = proxy(d, Duration::from_secs(10)).await;
    let addr = p.listen_addrs()[0];
    for _ in 0..25 {
        abort_after(addr, "POST /pay HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n", b"hello")
            .await;
    }
    let big = vec![b'x'; 70 * 1024];
    for _ in 0..25 {
        abort_after(addr, "POST /pay HTTP/1.1\r\nhost: x\r\ncontent-length: 102400\r\n\r\n", &big)
            .await;
    }
    let c = client();
    let (status, headers) = get(&c, addr).await;
    assert_eq!(status, StatusCode::OK, "{headers:?}");
    assert!(!headers.contains_key("x-stormguard-denied"));
    let s = p.dependency("pay").unwrap().snapshot();
    assert_eq!(format!("{:?}", s.breaker.unwrap()), "Closed");
    assert_eq!(s.counters.retries, 0, "no caller failure was retried");
    assert!(upstream.stats().total.requests <= 26, "only the large bodies' attempts reached it");
    p.shutdown().await;

    // The unprotected path: failures the upstream causes open it.
    let resets = chaos(Phase { reset_rate: 1.0, ..Phase::default() }).await;
    let mut d = ProxyDependency::new("pay", resets.url("").parse().unwrap());
    d.breaker = Some(breaker());
    d.max_retries = 0;
    let p = proxy(d, Duration::from_secs(10)).await;
    for _ in 0..10 {
        let _ = get(&c, p.listen_addrs()[0]).await;
    }
    let (status, headers) = get(&c, p.listen_addrs()[0]).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(headers["x-stormguard-denied"], "breaker");
    p.shutdown().await;
}

/// A malformed chunked body is the caller's error: 400 with `x-stormguard-error:
/// body-malformed`, not a 502 `reset`; the upstream never sees it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_body_is_answered_400() {
    let upstream = chaos(Phase::default()).await;
    let d = ProxyDependency::new("pay", upstream.url("").parse().unwrap());
    let p = proxy(d, Duration::from_secs(10)).await;
    let mut s = TcpStream::connect(p.listen_addrs()[0]).await.unwrap();
    s.write_all(
        b"POST /pay HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\nzz\r\nhello\r\n",
    )
    .await
    .unwrap();
    let mut out = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut out)).await;
    let text = String::from_utf8_lossy(&out);
    assert!(text.starts_with("HTTP/1.1 400"), "{text}");
    assert!(text.contains("x-stormguard-error: body-malformed"), "{text}");
    assert_eq!(upstream.stats().total.requests, 0);
    p.shutdown().await;
}

/// Twenty callers send headers promising 1 000 bytes and then one byte: with a cap of 20 they
/// hold no slot (a body that fits the replay buffer is received before its attempt asks for
/// one), so a normal GET is answered at once; each dawdler is answered 408 at the body idle
/// timeout. Twenty callers that stall past the replay buffer (their attempts hold slots) are cut
/// at the same timeout and their slots come back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dawdling_bodies_hold_no_slot() {
    let upstream = chaos(Phase { latency: Latency::Fixed(ms(5)), ..Phase::default() }).await;
    let mut d = ProxyDependency::new("pay", upstream.url("").parse().unwrap());
    d.cap = 20;
    d.queue_timeout = ms(500);
    let p = proxy(d, Duration::from_secs(1)).await;
    let addr = p.listen_addrs()[0];
    let dep = p.dependency("pay").unwrap();
    let mut dawdlers = Vec::new();
    for _ in 0..20 {
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(b"POST /pay HTTP/1.1\r\nhost: x\r\ncontent-length: 1000\r\n\r\nx")
            .await
            .unwrap();
        dawdlers.push(s);
    }
    tokio::time::sleep(ms(200)).await;
    assert_eq!(dep.snapshot().limiter.in_flight, 0, "no dawdler holds a slot");
    let c = client();
    let (status, _) = get(&c, addr).await;
    assert_eq!(status, StatusCode::OK, "a normal caller is served while they dawdle");
    for mut s in dawdlers {
        let mut out = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut out)).await;
        let text = String::from_utf8_lossy(&out);
        assert!(text.starts_with("HTTP/1.1 408"), "{text}");
        assert!(text.contains("x-stormguard-error: body-timeout"), "{text}");
    }

    // Past the replay buffer the attempt takes its slot once the first 64 KiB are in, and a
    // caller that then stalls is cut at the body idle timeout: its slot comes back.
    let big = vec![b'x'; 65 * 1024 + 1];
    let mut stalled = Vec::new();
    for _ in 0..20 {
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(b"POST /pay HTTP/1.1\r\nhost: x\r\ncontent-length: 204800\r\n\r\n")
            .await
            .unwrap();
        s.write_all(&big).await.unwrap();
        stalled.push(s);
    }
    let mut held = 0;
    for _ in 0..50 {
        held = dep.snapshot().limiter.in_flight;
        if held == 20 {
            break;
        }
        tokio::time::sleep(ms(20)).await;
    }
    assert_eq!(held, 20, "the large bodies' attempts hold their slots while they stream");
    for mut s in stalled {
        let mut out = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut out)).await;
        let text = String::from_utf8_lossy(&out);
        assert!(text.starts_with("HTTP/1.1 408"), "{text}");
    }
    assert_eq!(dep.snapshot().limiter.in_flight, 0, "every stalled attempt's slot came back");
    let (status, _) = get(&c, addr).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(format!("{:?}", dep.snapshot().breaker), "None");
    p.shutdown().await;
}

/// A per-try timeout that passes while the caller is still sending a large body is the
/// caller's slowness: 408, the slot back at once, the breaker untouched. The same timeout with
/// the body received and the upstream slow is the upstream's: 504, counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_per_try_timeout_while_the_caller_sends_is_the_callers() {
    let upstream = chaos(Phase { latency: Latency::Fixed(ms(2_000)), ..Phase::default() }).await;
    let mut d = ProxyDependency::new("pay", upstream.url("").parse().unwrap());
    d.per_try_timeout = Some(ms(300));
    d.breaker = Some(BreakerConfig { consecutive_failures: Some(1), ..BreakerConfig::default() });
    let p = proxy(d, Duration::from_secs(10)).await;
    let addr = p.listen_addrs()[0];
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(b"POST /pay HTTP/1.1\r\nhost: x\r\ncontent-length: 204800\r\n\r\n").await.unwrap();
    s.write_all(&vec![b'x'; 65 * 1024 + 1]).await.unwrap();
    let mut out = vec![0u8; 512];
    let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut out)).await.unwrap().unwrap();
    let text = String::from_utf8_lossy(&out[..n]);
    assert!(text.starts_with("HTTP/1.1 408"), "{text}");
    let dep = p.dependency("pay").unwrap();
    assert_eq!(format!("{:?}", dep.snapshot().breaker.unwrap()), "Closed");
    assert_eq!(dep.snapshot().limiter.held, 0, "nothing held: the upstream never had it whole");
    // The upstream's own slowness opens it (one failure, for this test).
    let (status, headers) = {
        let c = client();
        let req = Request::get(format!("http://{addr}/ok")).body(Full::new(Bytes::new())).unwrap();
        let resp = c.request(req).await.unwrap();
        (resp.status(), resp.headers().clone())
    };
    assert_eq!(status, StatusCode::GATEWAY_TIMEOUT, "{headers:?}");
    assert_eq!(format!("{:?}", dep.snapshot().breaker.unwrap()).split(' ').next(), Some("Open"));
    p.shutdown().await;
}
