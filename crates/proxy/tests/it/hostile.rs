//! A caller's failure is the caller's: request bodies that break, stall or dawdle never open the
//! breaker for everyone, never spend the budget, and never hold a slot of the cap while the
//! caller takes its time. Raw sockets on 127.0.0.1, as an attacker on the same host would.

use crate::common;

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
    get_path(c, addr, "/ok").await
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

// ---- The cap belongs to the dependency: callers that read slowly, dribble, or an upstream that
// lies must not hold it. Each test also runs the unprotected setting and shows the attack work.

use crate::support;

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};

use support::{Serve, Upstream, upstream};

/// Answers the upstream is sending now: counted from the handler until its body is dropped
/// (sent whole, or its connection gone). What the dependency has in flight, exactly.
#[derive(Default)]
struct Sending(AtomicU64);

struct Counted {
    left: usize,
    sending: Arc<Sending>,
    /// Sent 8 KiB at a time, 2 ms apart (`/drip/N`): no read takes it whole.
    drip: Option<Pin<Box<tokio::time::Sleep>>>,
    /// Sends 8 KiB, then nothing more, ever (`/hang`): an upstream that goes quiet.
    hang: bool,
}

impl Drop for Counted {
    fn drop(&mut self) {
        self.sending.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl http_body::Body for Counted {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, Self::Error>>> {
        static CHUNK: [u8; 64 * 1024] = [b'x'; 64 * 1024];
        if self.left == 0 {
            return Poll::Ready(None);
        }
        if self.hang && self.left <= 8 * 1024 {
            return Poll::Pending;
        }
        let mut n = self.left.min(CHUNK.len());
        if self.hang {
            n = 8 * 1024;
        }
        if let Some(t) = self.drip.as_mut() {
            if t.as_mut().poll(cx).is_pending() {
                return Poll::Pending;
            }
            t.as_mut().reset(tokio::time::Instant::now() + ms(2));
            n = n.min(8 * 1024);
        }
        self.left -= n;
        Poll::Ready(Some(Ok(http_body::Frame::data(Bytes::from_static(&CHUNK[..n])))))
    }

    fn size_hint(&self) -> http_body::SizeHint {
        http_body::SizeHint::with_exact(self.left as u64)
    }
}

/// `/big/N` answers N bytes; `/sink` reads the whole request body, then answers; anything else
/// `ok`. Every answer counts in `sending` until its body is gone.
async fn hostile_upstream() -> (Upstream, Arc<Sending>) {
    let sending = Arc::new(Sending::default());
    let s = sending.clone();
    let up = upstream(Serve::default(), move |req: http::Request<hyper::body::Incoming>| {
        let sending = s.clone();
        async move {
            sending.0.fetch_add(1, Ordering::SeqCst);
            let path = req.uri().path().to_string();
            let drip =
                path.starts_with("/drip/").then(|| Box::pin(tokio::time::sleep(Duration::ZERO)));
            let hang = path == "/hang";
            let left = match path.strip_prefix("/big/").or_else(|| path.strip_prefix("/drip/")) {
                Some(n) => n.parse().unwrap(),
                None if hang => 16 * 1024,
                None => {
                    if path == "/sink" {
                        let _ = req.into_body().collect().await;
                    }
                    2
                }
            };
            let body = Counted { left, sending, drip, hang };
            http::Response::new(http_body_util::BodyExt::boxed(body))
        }
    })
    .await;
    (up, sending)
}

async fn relay_proxy(up: &Upstream, cap: u64, tune: impl FnOnce(&mut ProxyConfig)) -> ProxyHandle {
    let mut d = ProxyDependency::new("pay", format!("http://{}", up.addr).parse().unwrap());
    d.cap = cap;
    d.queue_timeout = ms(300);
    let mut c = ProxyConfig::single("127.0.0.1:0".parse().unwrap(), d);
    c.admin = None;
    tune(&mut c);
    start(c).await.unwrap()
}

/// A GET of `path`, its body read whole, answered within 2 s.
async fn get_path(c: &TestClient, addr: SocketAddr, path: &str) -> (StatusCode, http::HeaderMap) {
    let req = Request::get(format!("http://{addr}{path}")).body(Full::new(Bytes::new())).unwrap();
    let resp = tokio::time::timeout(Duration::from_secs(2), c.request(req))
        .await
        .expect("answered within 2 s")
        .unwrap();
    let (parts, body) = resp.into_parts();
    body.collect().await.unwrap();
    (parts.status, parts.headers)
}

/// Opens one HTTP/2 connection and 20 streams of `/drip/102400`, takes their heads and reads
/// nothing (no WINDOW_UPDATE is ever sent; PINGs are answered). Returns what keeps them open.
async fn stalled_h2_streams(addr: SocketAddr) -> Vec<h2::RecvStream> {
    let tcp = TcpStream::connect(addr).await.unwrap();
    let (send, conn) = h2::client::handshake(tcp).await.unwrap();
    tokio::spawn(async move {
        let _ = conn.await;
    });
    let mut heads = Vec::new();
    for _ in 0..20 {
        let mut send = send.clone().ready().await.unwrap();
        let req = Request::get(format!("http://{addr}/drip/102400")).body(()).unwrap();
        heads.push(send.send_request(req, true).unwrap().0);
    }
    let mut bodies = Vec::new();
    for h in heads {
        let resp = tokio::time::timeout(Duration::from_secs(5), h).await.unwrap().unwrap();
        assert_eq!(resp.status(), StatusCode::OK);
        bodies.push(resp.into_body());
    }
    bodies
}

/// One HTTP/2 connection with 20 streams that never grant window, each answered 100 KiB (8 KiB
/// every 2 ms, so no answer is whole when its head is): with
/// a cap of 20 they held every slot. Read ahead (the default 1 MiB buffer) the upstream
/// finishes every answer and the slots come back: a normal GET is answered 200 within 1 s.
/// With reading ahead off, the same 20 streams take the cap and the GET is refused `queue`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_h2_streams_hold_no_slot_once_the_upstream_has_answered() {
    let (up, sending) = hostile_upstream().await;
    let p = relay_proxy(&up, 20, |_| {}).await;
    let addr = p.listen_addrs()[0];
    let _held = stalled_h2_streams(addr).await;
    let dep = p.dependency("pay").unwrap();
    let end = tokio::time::Instant::now() + Duration::from_secs(5);
    while sending.0.load(Ordering::SeqCst) > 0 || dep.snapshot().limiter.in_flight > 0 {
        assert!(tokio::time::Instant::now() < end, "the upstream finished every answer");
        tokio::time::sleep(ms(5)).await;
    }
    let c = client();
    let started = tokio::time::Instant::now();
    let (status, headers) = get_path(&c, addr, "/ok").await;
    assert_eq!(status, StatusCode::OK, "{headers:?}");
    assert!(started.elapsed() < Duration::from_secs(1));
    p.shutdown().await;

    // Unprotected: the caller's reading paces the upstream, and 20 stalled streams hold 20 slots.
    let p = relay_proxy(&up, 20, |c| c.response_buffer = 0).await;
    let addr = p.listen_addrs()[0];
    let _held = stalled_h2_streams(addr).await;
    tokio::time::sleep(ms(300)).await;
    assert_eq!(p.dependency("pay").unwrap().snapshot().limiter.in_flight, 20);
    let (status, headers) = get_path(&c, addr, "/ok").await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(headers["x-stormguard-denied"], "queue");
    p.shutdown().await;
}

/// Asks for a 50 MB answer on a raw HTTP/1.1 connection and reads nothing of it.
async fn stalled_reader(addr: SocketAddr) -> TcpStream {
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(b"GET /big/50000000 HTTP/1.1\r\nhost: x\r\n\r\n").await.unwrap();
    s
}

/// A caller that reads nothing of a 50 MB answer, with a cap of 1: past the 1 MiB read-ahead
/// its answer is cut at `response_idle_timeout` (here 1 s), the upstream's answer ends (counted
/// at the upstream), the slot comes back and the next caller is served; the stalled caller's
/// connection is closed, and the cut is counted. With the timeout off the slot stays held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_reader_of_a_large_answer_gets_its_slot_back() {
    let (up, sending) = hostile_upstream().await;
    let p = relay_proxy(&up, 1, |c| c.response_idle_timeout = ms(1_000)).await;
    let addr = p.listen_addrs()[0];
    let mut stalled = stalled_reader(addr).await;
    let c = client();
    tokio::time::sleep(ms(300)).await;
    assert_eq!(sending.0.load(Ordering::SeqCst), 1, "the upstream is held back by the caller");
    let (status, _) = get_path(&c, addr, "/ok").await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "the stalled reader holds the one slot");
    let started = tokio::time::Instant::now();
    while sending.0.load(Ordering::SeqCst) > 0 {
        assert!(started.elapsed() < Duration::from_secs(4), "cut within response_idle_timeout");
        tokio::time::sleep(ms(10)).await;
    }
    let (status, headers) = get_path(&c, addr, "/ok").await;
    assert_eq!(status, StatusCode::OK, "{headers:?}");
    // The stalled connection was closed: reading it now ends (after what was buffered).
    let mut sink = vec![0u8; 1 << 20];
    let closed = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            match stalled.read(&mut sink).await {
                Ok(0) | Err(_) => break,
                Ok(_) => {}
            }
        }
    })
    .await;
    assert!(closed.is_ok(), "the stalled caller's connection is closed");
    p.shutdown().await;

    // Unprotected: the timeout off, the slot held as long as the caller likes.
    let p = relay_proxy(&up, 1, |c| c.response_idle_timeout = Duration::ZERO).await;
    let addr = p.listen_addrs()[0];
    let _stalled = stalled_reader(addr).await;
    tokio::time::sleep(ms(2_000)).await;
    assert_eq!(sending.0.load(Ordering::SeqCst), 1, "still held back");
    let (status, headers) = get_path(&c, addr, "/ok").await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(headers["x-stormguard-denied"], "queue");
    p.shutdown().await;
}

/// Twenty callers post `Content-Length: 200000`, send 70 000 bytes (past the replay buffer, so
/// each attempt holds a slot at the upstream), then one byte every 300 ms: never a gap as long
/// as `body_idle_timeout` (2 s here). The whole-body bound (`body_timeout`, 1.5 s here) cuts
/// them: 408, the slots back, and a normal GET is answered. With it off they hold the cap.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dribbled_bodies_are_cut_by_the_whole_body_bound() {
    async fn dribblers(addr: SocketAddr) -> Vec<tokio::task::JoinHandle<String>> {
        let first = vec![b'x'; 70_000];
        let mut all = Vec::new();
        for _ in 0..20 {
            let mut s = TcpStream::connect(addr).await.unwrap();
            s.write_all(b"POST /sink HTTP/1.1\r\nhost: x\r\ncontent-length: 200000\r\n\r\n")
                .await
                .unwrap();
            s.write_all(&first).await.unwrap();
            all.push(tokio::spawn(async move {
                let mut out = vec![0u8; 4096];
                for _ in 0..30 {
                    tokio::select! {
                        r = s.read(&mut out) => {
                            return match r {
                                Ok(n) => String::from_utf8_lossy(&out[..n]).into_owned(),
                                Err(_) => String::new(),
                            };
                        }
                        () = tokio::time::sleep(ms(300)) => {
                            if s.write_all(b"x").await.is_err() {
                                return String::new();
                            }
                        }
                    }
                }
                String::new()
            }));
        }
        all
    }
    let (up, _) = hostile_upstream().await;
    let tune = |c: &mut ProxyConfig| {
        c.body_idle_timeout = ms(2_000);
        c.body_timeout = ms(1_500);
    };
    let p = relay_proxy(&up, 20, tune).await;
    let addr = p.listen_addrs()[0];
    let dep = p.dependency("pay").unwrap();
    let all = dribblers(addr).await;
    let c = client();
    let end = tokio::time::Instant::now() + Duration::from_secs(5);
    while up.counts.in_flight.load(Ordering::SeqCst) < 20 {
        assert!(tokio::time::Instant::now() < end, "the dribblers' attempts reach the upstream");
        tokio::time::sleep(ms(10)).await;
    }
    for d in all {
        let text = tokio::time::timeout(Duration::from_secs(5), d).await.unwrap().unwrap();
        assert!(text.starts_with("HTTP/1.1 408"), "{text}");
        assert!(text.contains("x-stormguard-error: body-timeout"), "{text}");
    }
    assert_eq!(dep.snapshot().limiter.in_flight, 0);
    // Counted at the upstream: the cut attempts are over there too.
    let counts = up.counts.clone();
    support::until("the upstream sees the cut attempts end", || {
        counts.in_flight.load(Ordering::SeqCst) == 0
    })
    .await;
    let (status, _) = get_path(&c, addr, "/ok").await;
    assert_eq!(status, StatusCode::OK);
    p.shutdown().await;

    // Unprotected: only the gap bound, which a byte every 300 ms never reaches.
    let p = relay_proxy(&up, 20, |c| {
        c.body_idle_timeout = ms(2_000);
        c.body_timeout = Duration::ZERO;
    })
    .await;
    let addr = p.listen_addrs()[0];
    let all = dribblers(addr).await;
    tokio::time::sleep(ms(2_500)).await;
    assert_eq!(p.dependency("pay").unwrap().snapshot().limiter.in_flight, 20);
    assert_eq!(up.counts.in_flight.load(Ordering::SeqCst), 20, "all 20 still at the upstream");
    let (status, headers) = get_path(&c, addr, "/ok").await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(headers["x-stormguard-denied"], "queue");
    for d in all {
        d.abort();
    }
    p.shutdown().await;
}

/// A provider-shaped upstream: a POST is answered with the `usage` its `x-usage` header asks for
/// (a count the upstream makes up), or 429 with a one-day reset when asked `x-reset: day`.
async fn lying_provider() -> Upstream {
    upstream(Serve::default(), |req: http::Request<hyper::body::Incoming>| async move {
        let h =
            |name: &str| req.headers().get(name).and_then(|v| v.to_str().ok()).map(str::to_string);
        if h("x-reset").is_some() {
            let mut resp =
                http::Response::new(support::full("{\"error\":{\"type\":\"requests\"}}"));
            *resp.status_mut() = StatusCode::TOO_MANY_REQUESTS;
            resp.headers_mut().insert("x-ratelimit-reset-requests", "23h59m0s".parse().unwrap());
            return resp;
        }
        let prompt = h("x-usage").unwrap_or_else(|| "5".into());
        http::Response::new(support::full(format!(
            "{{\"id\":\"x\",\"usage\":{{\"prompt_tokens\":{prompt},\"completion_tokens\":5}}}}"
        )))
    })
    .await
}

async fn provider_proxy(up: &Upstream, tune: impl FnOnce(&mut ProxyDependency)) -> ProxyHandle {
    let mut d = ProxyDependency::new("llm", format!("http://{}", up.addr).parse().unwrap());
    d.rate.provider = Some(stormguard_tower::Provider::OpenAi);
    d.queue_timeout = ms(300);
    tune(&mut d);
    let mut c = ProxyConfig::single("127.0.0.1:0".parse().unwrap(), d);
    c.admin = None;
    start(c).await.unwrap()
}

async fn chat(
    c: &TestClient,
    addr: SocketAddr,
    header: Option<(&str, &str)>,
) -> (StatusCode, http::HeaderMap) {
    let mut req = Request::post(format!("http://{addr}/v1/chat/completions"))
        .header("content-type", "application/json");
    if let Some((k, v)) = header {
        req = req.header(k, v);
    }
    let req = req.body(Full::new(Bytes::from_static(br#"{"max_tokens":100}"#))).unwrap();
    let resp = tokio::time::timeout(Duration::from_secs(2), c.request(req)).await.unwrap().unwrap();
    let (parts, body) = resp.into_parts();
    body.collect().await.unwrap();
    (parts.status, parts.headers)
}

/// An answer whose `usage` says `1e30` (or 2^64 − 1) prompt tokens, under 100 000 tokens a
/// minute: the count is clamped to 16 × the request's estimate, so the next first try within the
/// limit is served. A negative count is ignored, not read as positive. Both are counted as
/// malformed. With no clamp (`usage_max_factor` at its maximum) the bucket falls a whole window
/// into debt and the next first try is refused `rate` — for one window, not for ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lying_usage_count_does_not_stop_traffic() {
    use stormguard_http::headers::HeaderKind;
    let up = lying_provider().await;
    let c = client();
    for lie in ["1e30", "18446744073709551615", "-100000000", "12.5", "1e1"] {
        let p = provider_proxy(&up, |d| d.rate.tokens_per_minute = Some(100_000)).await;
        let addr = p.listen_addrs()[0];
        let (status, _) = chat(&c, addr, Some(("x-usage", lie))).await;
        assert_eq!(status, StatusCode::OK);
        let (status, headers) = chat(&c, addr, None).await;
        assert_eq!(status, StatusCode::OK, "after a usage of {lie}: {headers:?}");
        let malformed = p.dependency("llm").unwrap().snapshot().malformed_headers;
        let expected = u64::from(lie != "1e1"); // 1e1 is 10: a count
        assert_eq!(malformed.get(HeaderKind::Usage), expected, "{lie}");
        p.shutdown().await;
    }

    // Unprotected: no clamp.
    let unclamped = |d: &mut ProxyDependency| {
        d.rate.tokens_per_minute = Some(100_000);
        d.rate.usage_max_factor = u64::MAX;
    };
    let lie = (("x-usage", "1e30"), StatusCode::OK);
    refused_rate_after(&up, unclamped, lie, Duration::ZERO).await;
}

/// Starts a provider proxy tuned by `tune`, sends one request with `lie` (its answer's status
/// checked), waits `then`, and checks that the next first try is refused `rate`.
async fn refused_rate_after(
    up: &Upstream,
    tune: impl FnOnce(&mut ProxyDependency),
    lie: ((&str, &str), StatusCode),
    then: Duration,
) {
    let c = client();
    let p = provider_proxy(up, tune).await;
    let addr = p.listen_addrs()[0];
    let (status, _) = chat(&c, addr, Some(lie.0)).await;
    assert_eq!(status, lie.1);
    tokio::time::sleep(then).await;
    let (status, headers) = chat(&c, addr, None).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(headers["x-stormguard-denied"], "rate");
    p.shutdown().await;
}

/// A 429 whose `x-ratelimit-reset-requests` says 23h59m: admission is held for `max_hold` (1 s
/// here), then first tries are served again. With `max_hold` past a day, the one answer refuses
/// every first try for the day.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_day_long_reset_holds_admission_at_most_max_hold() {
    let up = lying_provider().await;
    let c = client();
    let tune = |d: &mut ProxyDependency| {
        d.rate.requests_per_minute = Some(600);
        d.rate.max_hold = ms(1_000);
    };
    let p = provider_proxy(&up, tune).await;
    let addr = p.listen_addrs()[0];
    let (status, _) = chat(&c, addr, Some(("x-reset", "day"))).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    let held = tokio::time::Instant::now();
    let (status, headers) = chat(&c, addr, None).await;
    assert_eq!(headers.get("x-stormguard-denied").map(|v| v.to_str().unwrap()), Some("rate"));
    // A rate refusal is said as one: 429, when to come back, and not to retry before.
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(headers["retry-after"], "1", "the hold is max_hold, 1 s: {headers:?}");
    assert_eq!(headers["x-should-retry"], "false");
    assert_eq!(headers["content-type"], "application/json");
    loop {
        let (status, _) = chat(&c, addr, None).await;
        if status == StatusCode::OK {
            break;
        }
        assert!(held.elapsed() < ms(2_500), "served again within max_hold");
        tokio::time::sleep(ms(100)).await;
    }
    p.shutdown().await;

    // Unprotected: the hold as long as the upstream says.
    let unbounded = |d: &mut ProxyDependency| {
        d.rate.requests_per_minute = Some(600);
        d.rate.max_hold = Duration::from_secs(2 * 86_400);
    };
    let lie = (("x-reset", "day"), StatusCode::TOO_MANY_REQUESTS);
    refused_rate_after(&up, unbounded, lie, ms(2_500)).await;
}

/// 1 000 idle connections on the admin listener (64 at most): each new one pushes out the one
/// idle longest, so `/healthz` is answered within 1 s however many idle connections come.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_probes_are_answered_under_an_idle_flood() {
    let (up, _) = hostile_upstream().await;
    let mut d = ProxyDependency::new("pay", format!("http://{}", up.addr).parse().unwrap());
    d.cap = 20;
    let mut c = ProxyConfig::single("127.0.0.1:0".parse().unwrap(), d);
    c.admin = Some("127.0.0.1:0".parse().unwrap());
    let p = start(c).await.unwrap();
    let admin = p.admin_addr().unwrap();
    let mut flood = Vec::new();
    for _ in 0..1_000 {
        if let Ok(s) = TcpStream::connect(admin).await {
            flood.push(s);
        }
    }
    let started = tokio::time::Instant::now();
    let probe = async {
        let mut s = TcpStream::connect(admin).await.unwrap();
        s.write_all(format!("GET /healthz HTTP/1.1\r\nhost: {admin}\r\n\r\n").as_bytes())
            .await
            .unwrap();
        let mut out = vec![0u8; 1024];
        let n = s.read(&mut out).await.unwrap();
        String::from_utf8_lossy(&out[..n]).into_owned()
    };
    let text = tokio::time::timeout(Duration::from_secs(1), probe).await.expect("within 1 s");
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    assert!(started.elapsed() < Duration::from_secs(1));
    drop(flood);
    p.shutdown().await;
}

/// A caller that goes away while the upstream is quiet mid-answer (8 KiB sent, then nothing):
/// the task reading ahead stops with it, the upstream's answer is dropped and the slot comes back
/// at once — not at the upstream's next byte, which never comes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caller_that_leaves_a_quiet_answer_gives_its_slot_back() {
    let (up, sending) = hostile_upstream().await;
    let p = relay_proxy(&up, 1, |_| {}).await;
    let addr = p.listen_addrs()[0];
    let dep = p.dependency("pay").unwrap();
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(b"GET /hang HTTP/1.1\r\nhost: x\r\n\r\n").await.unwrap();
    let mut head = vec![0u8; 4096];
    let n = tokio::time::timeout(Duration::from_secs(2), s.read(&mut head)).await.unwrap().unwrap();
    assert!(head[..n].starts_with(b"HTTP/1.1 200"), "{}", String::from_utf8_lossy(&head[..n]));
    assert_eq!(dep.snapshot().limiter.in_flight, 1);
    drop(s);
    let left = tokio::time::Instant::now();
    while dep.snapshot().limiter.in_flight > 0 || sending.0.load(Ordering::SeqCst) > 0 {
        assert!(left.elapsed() < Duration::from_secs(2), "the slot came back when the caller left");
        tokio::time::sleep(ms(5)).await;
    }
    let (status, _) = get_path(&client(), addr, "/ok").await;
    assert_eq!(status, StatusCode::OK);
    p.shutdown().await;
}
