//! Helpers the proxy's chaos-driven tests share (e2e, failover, fleet, operate, deploy_kit).

use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use stormguard_chaos::{ChaosConfig, ChaosServer, OnDisconnect, Phase};

pub fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// A chaos upstream on an ephemeral loopback port playing `phase`, that works on a request to
/// its end when the client leaves (`finish`), as real servers do: its in-flight count is what
/// the dependency really has.
pub async fn chaos(phase: Phase) -> ChaosServer {
    let mut c = ChaosConfig::single(phase);
    c.on_disconnect = OnDisconnect::Finish;
    stormguard_chaos::spawn(c, "127.0.0.1:0".parse().unwrap()).await.unwrap()
}

/// A fresh request id (`x-request-id`, or an `Idempotency-Key`): each test request is its own,
/// as independent callers' are, so the proxy does not take an identical request after a
/// failure for its caller's own retry (`caller_retries`, docs/proxy.md).
pub fn request_id() -> http::HeaderValue {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    http::HeaderValue::from_str(&format!("test-{n}")).expect("ASCII")
}

/// The callers' HTTP/1.1 client.
pub type TestClient = Client<HttpConnector, Full<Bytes>>;

pub fn client() -> TestClient {
    Client::builder(TokioExecutor::new()).build_http()
}

/// An address on loopback where nothing listens, kept so while the returned socket lives: bound
/// but never listening, so a connect is refused and no other test can be given the port (a
/// listener bound and dropped frees its port for whoever binds next).
pub fn refused_addr() -> (std::net::SocketAddr, tokio::net::TcpSocket) {
    let s = tokio::net::TcpSocket::new_v4().unwrap();
    s.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    (s.local_addr().unwrap(), s)
}
