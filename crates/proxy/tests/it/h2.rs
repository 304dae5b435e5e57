//! HTTP/2 upstreams keep the cap honest: an h2c upstream that takes 4 streams at once
//! (SETTINGS_MAX_CONCURRENT_STREAMS 4) behind a dependency whose cap is 20. hyper's client
//! would park the streams over 4 in a queue of its own while they hold a stormguard slot; the
//! proxy lowers the cap to the peer's 4 instead, so every admitted attempt is at the upstream
//! and the rest wait, visibly, in stormguard's queue. The handler holds each request until the
//! test lets it go, so nothing depends on timing.

use crate::support;

use std::sync::Arc;
use std::sync::atomic::Ordering;

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::Full;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use stormguard_proxy::config::ProxyDependency;
use support::{Counts, Serve, Upstream, answer, dep, full, proxy, until, upstream};
use tokio::sync::Semaphore;

const PEER_STREAMS: u32 = 4;
const BURST: usize = 12;

/// An h2c upstream with 4 streams at once; each request waits for a permit of `gate`.
async fn gated_upstream(gate: Arc<Semaphore>) -> Upstream {
    let serve = Serve { max_streams: Some(PEER_STREAMS), ..Serve::default() };
    upstream(serve, move |_req| {
        let gate = gate.clone();
        async move {
            gate.acquire().await.unwrap().forget();
            http::Response::new(full("ok"))
        }
    })
    .await
}

fn h2_dep(up: &Upstream) -> ProxyDependency {
    let mut d = dep(&format!("http://{}", up.addr));
    d.http2.prior_knowledge = true;
    d.cap = 20;
    d.queue = 100;
    d.queue_timeout = std::time::Duration::from_secs(10);
    d
}

type Caller = Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>>;

fn get(url: String) -> Request<Full<Bytes>> {
    Request::get(url).body(Full::new(Bytes::new())).unwrap()
}

fn post(url: String) -> Request<Full<Bytes>> {
    Request::builder().method("POST").uri(url).body(Full::new(Bytes::from_static(b"x"))).unwrap()
}

/// Sends `BURST` POSTs at once through the proxy, checks that every admitted attempt is at the
/// upstream while the others queue in stormguard, then lets them all finish.
async fn burst(p: &stormguard_proxy::ProxyHandle, up: &Upstream, gate: &Semaphore, before: u64) {
    let caller: Caller = Client::builder(TokioExecutor::new()).build_http();
    let url = format!("http://{}/", p.listen_addrs()[0]);
    let calls: Vec<_> = (0..BURST)
        .map(|_| {
            let (c, req) = (caller.clone(), post(url.clone()));
            tokio::spawn(async move { answer(c.request(req).await.unwrap()).await })
        })
        .collect();
    let d = p.dependency("upstream").unwrap();
    let limiter = &d.upstream().limiter;
    until("the burst to reach the proxy", || {
        limiter.in_flight() + limiter.queued() == BURST as u64
    })
    .await;
    until("4 requests at the upstream", || {
        Counts::get(&up.counts.in_flight) == u64::from(PEER_STREAMS)
    })
    .await;
    // No hidden queue: what stormguard counts in flight is exactly what the upstream has.
    assert_eq!(limiter.effective_cap(), u64::from(PEER_STREAMS));
    assert_eq!(limiter.in_flight(), u64::from(PEER_STREAMS));
    assert_eq!(limiter.queued(), (BURST as u64) - u64::from(PEER_STREAMS));
    gate.add_permits(BURST);
    for c in calls {
        assert_eq!(c.await.unwrap().status, StatusCode::OK);
    }
    assert_eq!(Counts::get(&up.counts.max_in_flight), u64::from(PEER_STREAMS));
    assert_eq!(Counts::get(&up.counts.handled), before + BURST as u64);
    // Nothing was refused with REFUSED_STREAM (it would have been retried).
    assert_eq!(d.snapshot().counters.retries, 0);
}

#[tokio::test]
async fn the_peers_max_concurrent_streams_lowers_the_cap_once_learned() {
    let gate = Arc::new(Semaphore::new(0));
    let up = gated_upstream(gate.clone()).await;
    let p = proxy(h2_dep(&up)).await;
    let d = p.dependency("upstream").unwrap();
    assert_eq!(d.upstream().limiter.effective_cap(), 20, "nothing learned before a connection");
    // The first request opens the connection; the upstream's SETTINGS come with it.
    gate.add_permits(1);
    let caller: Caller = Client::builder(TokioExecutor::new()).build_http();
    let a = answer(caller.request(post(format!("http://{}/", p.listen_addrs()[0]))).await.unwrap())
        .await;
    assert_eq!(a.status, StatusCode::OK);
    burst(&p, &up, &gate, 1).await;
    println!(
        "h2 (learned): cap 20, peer streams 4: upstream in flight max {}, stormguard in flight 4 with {} queued, retries 0",
        Counts::get(&up.counts.max_in_flight),
        BURST - 4
    );
    p.shutdown().await;
}

#[tokio::test]
async fn a_configured_max_concurrent_streams_holds_from_the_first_request() {
    let gate = Arc::new(Semaphore::new(0));
    let up = gated_upstream(gate.clone()).await;
    let mut d = h2_dep(&up);
    d.http2.max_concurrent_streams = Some(PEER_STREAMS);
    let p = proxy(d).await;
    // A cold burst: no connection yet, so no SETTINGS seen.
    burst(&p, &up, &gate, 0).await;
    p.shutdown().await;
}

/// The unprotected path: hyper's h2 client alone. All 12 calls are outstanding — each would
/// hold a slot under a limiter above the client — while the upstream has 4: 8 wait in a queue
/// inside the client that no limiter sees.
#[tokio::test]
async fn without_the_cap_hypers_h2_client_queues_streams_out_of_sight() {
    let gate = Arc::new(Semaphore::new(0));
    let up = gated_upstream(gate.clone()).await;
    let client: Caller = Client::builder(TokioExecutor::new()).http2_only(true).build_http();
    // Warm: the connection and the upstream's SETTINGS are in place.
    gate.add_permits(1);
    let url = format!("http://{}/", up.addr);
    assert_eq!(answer(client.request(post(url.clone())).await.unwrap()).await.status, 200);
    let outstanding = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let calls: Vec<_> = (0..BURST)
        .map(|_| {
            let (c, req, n) = (client.clone(), post(url.clone()), outstanding.clone());
            n.fetch_add(1, Ordering::SeqCst);
            tokio::spawn(async move {
                let a = answer(c.request(req).await.unwrap()).await;
                n.fetch_sub(1, Ordering::SeqCst);
                a
            })
        })
        .collect();
    until("4 requests at the upstream", || Counts::get(&up.counts.in_flight) == 4).await;
    // Give the client every chance to send more: it cannot, the peer said 4.
    for _ in 0..100 {
        tokio::task::yield_now().await;
    }
    assert_eq!(Counts::get(&up.counts.in_flight), 4);
    let hidden = outstanding.load(Ordering::SeqCst) - Counts::get(&up.counts.in_flight);
    assert_eq!(hidden, (BURST - 4) as u64, "calls waiting inside the client");
    gate.add_permits(BURST);
    for c in calls {
        assert_eq!(c.await.unwrap().status, StatusCode::OK);
    }
    println!(
        "h2 (hyper alone): {BURST} calls outstanding, 4 at the upstream: {hidden} in a hidden queue"
    );
}

/// An h2 upstream (the `h2` crate's server, so the test chooses the RST_STREAM code): the
/// first stream is reset with `first_reset`, the others answered 200. Returns the address and
/// (streams received, streams answered).
async fn resetting_upstream(
    first_reset: h2::Reason,
) -> (std::net::SocketAddr, Arc<(std::sync::atomic::AtomicU64, std::sync::atomic::AtomicU64)>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let counts = Arc::new(Default::default());
    let c: Arc<(std::sync::atomic::AtomicU64, std::sync::atomic::AtomicU64)> = Arc::clone(&counts);
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            let c = c.clone();
            tokio::spawn(async move {
                let Ok(mut conn) = h2::server::handshake(tcp).await else { return };
                while let Some(Ok((_req, mut respond))) = conn.accept().await {
                    if c.0.fetch_add(1, Ordering::SeqCst) == 0 {
                        respond.send_reset(first_reset);
                    } else {
                        c.1.fetch_add(1, Ordering::SeqCst);
                        let _ = respond.send_response(http::Response::new(()), true);
                    }
                }
            });
        }
    });
    (addr, counts)
}

/// REFUSED_STREAM proves the stream was not processed: a POST is retried. Another reset code
/// proves nothing, and the same POST is not.
#[tokio::test]
async fn refused_stream_is_retried_even_for_a_post_and_another_reset_is_not() {
    let caller: Caller = Client::builder(TokioExecutor::new()).build_http();
    for (reason, status, streams, answered, retries) in [
        (h2::Reason::REFUSED_STREAM, StatusCode::OK, 2, 1, 1),
        (h2::Reason::INTERNAL_ERROR, StatusCode::BAD_GATEWAY, 1, 0, 0),
    ] {
        let (addr, counts) = resetting_upstream(reason).await;
        let mut d = dep(&format!("http://{addr}"));
        d.http2.prior_knowledge = true;
        let p = proxy(d).await;
        let a =
            answer(caller.request(post(format!("http://{}/", p.listen_addrs()[0]))).await.unwrap())
                .await;
        assert_eq!(a.status, status, "{reason:?}");
        if status == StatusCode::BAD_GATEWAY {
            assert_eq!(a.headers["x-stormguard-error"], "reset");
        }
        assert_eq!(counts.0.load(Ordering::SeqCst), streams, "{reason:?}");
        assert_eq!(counts.1.load(Ordering::SeqCst), answered, "{reason:?}");
        assert_eq!(p.dependency("upstream").unwrap().snapshot().counters.retries, retries);
        p.shutdown().await;
    }
}

/// A raw HTTP/2 upstream whose first connection reads the client's first HEADERS, then sends
/// SETTINGS and GOAWAY(`last_stream_id`, NO_ERROR) and closes; later connections are served by
/// hyper (200). Returns the address and the requests hyper served.
async fn goaway_upstream(
    last_stream_id: u32,
) -> (std::net::SocketAddr, Arc<std::sync::atomic::AtomicU64>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let served = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let s = served.clone();
    tokio::spawn(async move {
        let (mut tcp, _) = listener.accept().await.unwrap();
        let mut preface = [0u8; 24];
        tcp.read_exact(&mut preface).await.unwrap();
        loop {
            let mut head = [0u8; 9];
            tcp.read_exact(&mut head).await.unwrap();
            let len = usize::from(head[0]) << 16 | usize::from(head[1]) << 8 | usize::from(head[2]);
            let mut payload = vec![0u8; len];
            tcp.read_exact(&mut payload).await.unwrap();
            if head[3] == 0x1 {
                break; // HEADERS: the request's stream is open
            }
        }
        let mut out = vec![0, 0, 0, 0x4, 0, 0, 0, 0, 0]; // SETTINGS, empty
        out.extend_from_slice(&[0, 0, 8, 0x7, 0, 0, 0, 0, 0]); // GOAWAY
        out.extend_from_slice(&last_stream_id.to_be_bytes());
        out.extend_from_slice(&0u32.to_be_bytes()); // NO_ERROR
        tcp.write_all(&out).await.unwrap();
        // Let the client read it, then close.
        let _ =
            tokio::time::timeout(std::time::Duration::from_millis(200), tcp.read(&mut [0u8; 1024]))
                .await;
        drop(tcp);
        while let Ok((tcp, _)) = listener.accept().await {
            let s = s.clone();
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(move |_req| {
                    s.fetch_add(1, Ordering::SeqCst);
                    async { Ok::<_, std::convert::Infallible>(http::Response::new(full("ok"))) }
                });
                let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                    .serve_connection(hyper_util::rt::TokioIo::new(tcp), svc)
                    .await;
            });
        }
    });
    (addr, served)
}

/// A GOAWAY whose last-stream-id is below the stream proves the stream was not processed: the
/// POST is retried on a new connection. The same GOAWAY naming the stream (the server may have
/// processed it) followed by a close is not proof, and the POST is not retried.
#[tokio::test]
async fn goaway_below_the_stream_is_retried_even_for_a_post() {
    let caller: Caller = Client::builder(TokioExecutor::new()).build_http();
    for (last_stream_id, status, served, retries) in
        [(0, StatusCode::OK, 1, 1), (1, StatusCode::BAD_GATEWAY, 0, 0)]
    {
        let (addr, count) = goaway_upstream(last_stream_id).await;
        let mut d = dep(&format!("http://{addr}"));
        d.http2.prior_knowledge = true;
        let p = proxy(d).await;
        let a =
            answer(caller.request(post(format!("http://{}/", p.listen_addrs()[0]))).await.unwrap())
                .await;
        assert_eq!(a.status, status, "last_stream_id {last_stream_id}");
        assert_eq!(count.load(Ordering::SeqCst), served, "last_stream_id {last_stream_id}");
        assert_eq!(p.dependency("upstream").unwrap().snapshot().counters.retries, retries);
        p.shutdown().await;
    }
}

/// With several h2 upstreams, each one's stream limit lowers its own cap: the first provider
/// fails at once, so every request's retry fails over to the second, which takes 2 streams at
/// once. Once its SETTINGS are read, at most 2 retries are admitted there — in stormguard's
/// count as at the upstream — and the rest are refused (`cap`) instead of waiting in hyper's
/// client.
#[tokio::test]
async fn each_upstreams_peer_limit_lowers_its_own_cap() {
    let failing = upstream(Serve::default(), |_req| async {
        let mut r = http::Response::new(full("down"));
        *r.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
        r
    })
    .await;
    let gate = Arc::new(Semaphore::new(0));
    let second = {
        let gate = gate.clone();
        let serve = Serve { max_streams: Some(2), ..Serve::default() };
        upstream(serve, move |_req| {
            let gate = gate.clone();
            async move {
                gate.acquire().await.unwrap().forget();
                http::Response::new(full("ok"))
            }
        })
        .await
    };
    let mut d = dep(&format!("http://{}", failing.addr));
    d.upstreams.push(format!("http://{}", second.addr).parse().unwrap());
    d.http2.prior_knowledge = true;
    d.cap = 20;
    d.max_retries = 1;
    d.budget = "ratio:percent=10,min_per_sec=1000".parse().unwrap();
    let p = proxy(d).await;
    let caller: Caller = Client::builder(TokioExecutor::new()).build_http();
    let url = format!("http://{}/", p.listen_addrs()[0]);
    // One request opens the connection to the second provider: its SETTINGS arrive.
    gate.add_permits(1);
    assert_eq!(
        answer(caller.request(get(url.clone())).await.unwrap()).await.status,
        StatusCode::OK
    );
    let d = p.dependency("upstream").unwrap();
    let second_limiter = &d.upstream_at(1).limiter;
    until("the second provider's limit to be learned", || second_limiter.effective_cap() == 2)
        .await;
    assert_eq!(d.upstream_at(0).limiter.effective_cap(), 20, "the first provider's is its own");
    let calls: Vec<_> = (0..6)
        .map(|_| {
            let (c, req) = (caller.clone(), get(url.clone()));
            tokio::spawn(async move { answer(c.request(req).await.unwrap()).await })
        })
        .collect();
    until("2 retries at the second provider", || Counts::get(&second.counts.in_flight) == 2).await;
    until("the other 4 refused", || {
        d.snapshot().counters.denied(stormguard_core::Denied::Cap) == 4
    })
    .await;
    assert_eq!(second_limiter.in_flight(), 2, "no hidden queue in the client");
    gate.add_permits(6);
    let mut statuses: Vec<u16> = Vec::new();
    for c in calls {
        statuses.push(c.await.unwrap().status.as_u16());
    }
    statuses.sort_unstable();
    assert_eq!(statuses, [200, 200, 503, 503, 503, 503]);
    assert_eq!(Counts::get(&second.counts.max_in_flight), 2);
    p.shutdown().await;
}
