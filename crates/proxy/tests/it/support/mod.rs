//! Upstreams for the tls, h2 and grpc tests: hyper servers on 127.0.0.1 with ephemeral ports,
//! over TLS or plaintext (HTTP/1.1, and HTTP/2 by ALPN or prior knowledge), that count what
//! reaches their handler; and a PKI generated at test time with rcgen.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair,
    KeyUsagePurpose,
};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use stormguard_proxy::config::{ProxyConfig, ProxyDependency};
use stormguard_proxy::{ProxyHandle, start};

pub type Body = BoxBody<Bytes, Infallible>;

pub fn full(b: impl Into<Bytes>) -> Body {
    Full::new(b.into()).boxed()
}

/// A CA, a server certificate for 127.0.0.1 and localhost, and a client certificate, all
/// signed by the CA; PEM files in a fresh directory.
pub struct Pki {
    pub dir: PathBuf,
    pub ca_pem: PathBuf,
    pub client_cert: PathBuf,
    pub client_key: PathBuf,
    pub ca_der: CertificateDer<'static>,
    pub server_chain: Vec<CertificateDer<'static>>,
    pub server_key: PrivatePkcs8KeyDer<'static>,
}

pub fn pki() -> Pki {
    static N: AtomicU64 = AtomicU64::new(0);
    let dir = std::env::temp_dir().join(format!(
        "stormguard-pki-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let ca_key = KeyPair::generate().unwrap();
    let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.distinguished_name.push(DnType::CommonName, "stormguard test CA");
    ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    let ca = ca.self_signed(&ca_key).unwrap();

    let server_key = KeyPair::generate().unwrap();
    let mut sp = CertificateParams::new(vec!["localhost".into(), "127.0.0.1".into()]).unwrap();
    sp.distinguished_name.push(DnType::CommonName, "localhost");
    sp.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    let server = sp.signed_by(&server_key, &ca, &ca_key).unwrap();

    let client_key = KeyPair::generate().unwrap();
    let mut cp = CertificateParams::new(Vec::<String>::new()).unwrap();
    cp.distinguished_name.push(DnType::CommonName, "stormguard proxy");
    cp.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
    let client = cp.signed_by(&client_key, &ca, &ca_key).unwrap();

    let write = |name: &str, text: String| {
        let p = dir.join(name);
        std::fs::write(&p, text).unwrap();
        p
    };
    Pki {
        ca_pem: write("ca.pem", ca.pem()),
        client_cert: write("client.pem", client.pem()),
        client_key: write("client.key", client_key.serialize_pem()),
        ca_der: ca.der().clone(),
        server_chain: vec![server.der().clone()],
        server_key: PrivatePkcs8KeyDer::from(server_key.serialize_der()),
        dir,
    }
}

impl Pki {
    /// The upstream's TLS: ALPN `h2` and `http/1.1`; a client certificate signed by the CA
    /// required when `require_client_cert`.
    pub fn server_config(&self, require_client_cert: bool) -> Arc<rustls::ServerConfig> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = rustls::ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .unwrap();
        let builder = if require_client_cert {
            let mut roots = rustls::RootCertStore::empty();
            roots.add(self.ca_der.clone()).unwrap();
            let verifier =
                rustls::server::WebPkiClientVerifier::builder_with_provider(roots.into(), provider)
                    .build()
                    .unwrap();
            builder.with_client_cert_verifier(verifier)
        } else {
            builder.with_no_client_auth()
        };
        let mut c = builder
            .with_single_cert(
                self.server_chain.clone(),
                PrivateKeyDer::Pkcs8(self.server_key.clone_key()),
            )
            .unwrap();
        c.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        Arc::new(c)
    }
}

impl Drop for Pki {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// What an upstream counts.
#[derive(Default, Debug)]
pub struct Counts {
    /// Requests that reached the handler.
    pub handled: AtomicU64,
    /// Requests in the handler now, and the most at once.
    pub in_flight: AtomicU64,
    pub max_in_flight: AtomicU64,
    /// TLS handshakes that failed.
    pub tls_failures: AtomicU64,
}

impl Counts {
    pub fn get(n: &AtomicU64) -> u64 {
        n.load(Ordering::SeqCst)
    }
}

pub struct Upstream {
    pub addr: SocketAddr,
    pub counts: Arc<Counts>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Upstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// How an upstream listens.
#[derive(Clone, Default)]
pub struct Serve {
    pub tls: Option<Arc<rustls::ServerConfig>>,
    /// SETTINGS_MAX_CONCURRENT_STREAMS of its HTTP/2 connections.
    pub max_streams: Option<u32>,
}

/// An upstream on 127.0.0.1:0 that speaks HTTP/1.1 and HTTP/2 (by ALPN or prior knowledge),
/// calling `handler` for each request and counting it.
pub async fn upstream<F, Fut>(serve: Serve, handler: F) -> Upstream
where
    F: Fn(Request<Incoming>) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = Response<Body>> + Send + 'static,
{
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let counts = Arc::new(Counts::default());
    let c = counts.clone();
    let task = tokio::spawn(async move {
        loop {
            let Ok((tcp, _)) = listener.accept().await else { continue };
            let (serve, handler, counts) = (serve.clone(), handler.clone(), c.clone());
            tokio::spawn(async move {
                let conn_counts = counts.clone();
                let svc = hyper::service::service_fn(move |req| {
                    let (handler, counts) = (handler.clone(), conn_counts.clone());
                    async move {
                        counts.handled.fetch_add(1, Ordering::SeqCst);
                        let now = counts.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
                        counts.max_in_flight.fetch_max(now, Ordering::SeqCst);
                        let resp = handler(req).await;
                        counts.in_flight.fetch_sub(1, Ordering::SeqCst);
                        Ok::<_, Infallible>(resp)
                    }
                });
                let mut builder = auto::Builder::new(TokioExecutor::new());
                if let Some(n) = serve.max_streams {
                    builder.http2().max_concurrent_streams(n);
                }
                match serve.tls {
                    Some(tls) => {
                        let tls = match tokio_rustls::TlsAcceptor::from(tls).accept(tcp).await {
                            Ok(s) => s,
                            Err(_) => {
                                counts.tls_failures.fetch_add(1, Ordering::SeqCst);
                                return;
                            }
                        };
                        let _ = builder.serve_connection(TokioIo::new(tls), svc).await;
                    }
                    None => {
                        let _ = builder.serve_connection(TokioIo::new(tcp), svc).await;
                    }
                }
            });
        }
    });
    Upstream { addr, counts, task }
}

pub async fn proxy(dep: ProxyDependency) -> ProxyHandle {
    let mut c = ProxyConfig::single("127.0.0.1:0".parse().unwrap(), dep);
    c.admin = None;
    start(c).await.unwrap()
}

/// A dependency with quick backoffs, so retries do not slow the tests.
pub fn dep(upstream: &str) -> ProxyDependency {
    let mut d = ProxyDependency::new("upstream", upstream.parse().unwrap());
    d.backoff = stormguard_core::backoff::BackoffConfig::parse_range("1ms..5ms").unwrap();
    d
}

/// Waits (at most 10 s) until `cond` holds.
pub async fn until(what: &str, mut cond: impl FnMut() -> bool) {
    let end = tokio::time::Instant::now() + Duration::from_secs(10);
    while !cond() {
        assert!(tokio::time::Instant::now() < end, "gave up waiting for {what}");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// Everything a response said, its body read whole.
pub struct Answer {
    pub status: http::StatusCode,
    pub headers: http::HeaderMap,
    pub body: Bytes,
    pub trailers: Option<http::HeaderMap>,
}

/// Reads a response whole (at most 10 s).
pub async fn answer<B>(resp: Response<B>) -> Answer
where
    B: http_body::Body<Data = Bytes>,
    B::Error: std::fmt::Debug,
{
    let (parts, body) = resp.into_parts();
    let collected =
        tokio::time::timeout(Duration::from_secs(10), body.collect()).await.unwrap().unwrap();
    let trailers = collected.trailers().cloned();
    Answer { status: parts.status, headers: parts.headers, body: collected.to_bytes(), trailers }
}
