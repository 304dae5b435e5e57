//! HTTP/2 upstreams keep the cap honest: an h2c upstream that takes 4 streams at once
//! (SETTINGS_MAX_CONCURRENT_STREAMS 4) behind a dependency whose cap is 20. hyper's client
//! would park the streams over 4 in a queue of its own while they hold a stormguard slot; the
//! proxy lowers the cap to the peer's 4 instead, so every admitted attempt is at the upstream
//! and the rest wait, visibly, in stormguard's queue. The handler holds each request until the
//! test lets it go, so nothing depends on timing.

#[allow(dead_code)]
mod support;

use std::sync::Arc;
use std::sync::atomic::Ordering;

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::Full;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use stormguard_proxy::config::DependencyConfig;
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

fn h2_dep(up: &Upstream) -> DependencyConfig {
    let mut d = dep(&format!("http://{}", up.addr));
    d.http2.prior_knowledge = true;
    d.cap = 20;
    d.queue = 100;
    d.queue_timeout = std::time::Duration::from_secs(10);
    d
}

type Caller = Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>>;

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
