//! The upstream client: HTTP/1.1 and HTTP/2, plaintext and TLS, with no queue hidden under
//! the limiter.
//!
//! The limiter is only honest if nothing below it queues (docs/proxy.md, "HTTP/2 and gRPC upstreams"). Over
//! HTTP/1.1 that means a pool of at least `cap` connections. Over HTTP/2 every request to an
//! upstream shares one connection (hyper-util's pool keeps one per host), and the peer says in
//! its SETTINGS how many streams it takes at once (`SETTINGS_MAX_CONCURRENT_STREAMS`). hyper's
//! client does not refuse a request over that number: `h2` parks it in a queue of its own until
//! a stream closes, while it holds a stormguard slot. So the effective cap must be at most the
//! peer's streams × 1 connection. hyper does not expose the peer's settings, so this client
//! reads them itself: each HTTP/2 connection's first frame from the server is its SETTINGS
//! (RFC 9113 §3.4), and [`PeerStreams`] remembers the value it carries; the stack lowers the
//! limiter to it ([`PeerStreams::apply`]). Until the first connection's SETTINGS arrive, a
//! configured `max_concurrent_streams` bounds the cap and the number of streams hyper opens.
//!
//! TLS is rustls with the `ring` provider: the operating system's roots by default
//! (rustls-native-certs), or only those of a configured CA file; SNI from the upstream's host;
//! HTTP/2 by ALPN (`h2`, then `http/1.1`); an optional client certificate. Certificates and keys
//! are read when the config is checked, so a bad file is a config error, not a failed request.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use http::{Request, Response, Uri};
use hyper::body::Incoming;
use hyper::rt::{Read, ReadBuf, ReadBufCursor, Write};
use hyper_rustls::{HttpsConnector, HttpsConnectorBuilder, MaybeHttpsStream};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::{Connected, Connection, HttpConnector};
use hyper_util::rt::{TokioExecutor, TokioIo};
use stormguard_core::limiter::Limiter;
use stormguard_tower::Dependency;
use tower::Service;

use crate::config::{ProxyDependency, TlsConfig};

/// How long a learned stream limit holds the cap down without being renewed. Every attempt
/// renews it, so it only runs out on a dependency that has gone quiet.
const PEER_LIMIT_TTL: Duration = Duration::from_secs(30);

/// The connector: TCP (`TCP_NODELAY`), TLS for `https://`, the SETTINGS reader on top.
type Connector = ReadSettings<HttpsConnector<HttpConnector>>;

/// The client of one dependency's upstreams. Cheap to clone: clones share the pool.
#[derive(Clone, Debug)]
pub struct UpstreamClient {
    send: Sender,
    peer: PeerStreams,
}

/// The body sent upstream.
type Outgoing = crate::outgoing::OutgoingBody;

/// How a dependency's requests go out.
#[derive(Clone, Debug)]
enum Sender {
    /// Plaintext HTTP/1.1 upstreams: stormguard's own pool over hyper's `client::conn`.
    Pool(Arc<crate::pool::Pool<Outgoing>>),
    /// TLS or HTTP/2: hyper-util's pooled client, with the SETTINGS reader.
    Client(Arc<Client<Connector, Outgoing>>),
}

impl UpstreamClient {
    /// What the upstream's HTTP/2 SETTINGS allow, once a connection has seen them.
    pub fn peer_streams(&self) -> PeerStreams {
        self.peer.clone()
    }
}

impl Service<Request<Outgoing>> for UpstreamClient {
    type Response = Response<Incoming>;
    type Error = stormguard_tower::BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<Response<Incoming>, Self::Error>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        // Both are always ready: a connection is found or made inside the call.
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<Outgoing>) -> Self::Future {
        match &self.send {
            Sender::Pool(pool) => pool.send(req),
            Sender::Client(client) => {
                let answer = client.request(req);
                Box::pin(async move { answer.await.map_err(Into::into) })
            }
        }
    }
}

/// The client for `dep`'s upstreams: reads the TLS files (an error names the key, as
/// [`ProxyDependency::validate`] reports it). The HTTP/1.1 pool keeps at least `cap` idle
/// connections, so the limiter is the only queue; connect time (TLS handshake included) is
/// inside the per-try timeout, since the cap times the whole call. Plaintext HTTP/1.1
/// upstreams go through [`crate::pool`]; TLS and HTTP/2 through hyper-util's client.
pub fn client(dep: &ProxyDependency) -> Result<UpstreamClient, TlsError> {
    let cap = dep.largest_upstream_cap();
    let max_idle = usize::try_from(cap).unwrap_or(usize::MAX).max(1);
    let plaintext = dep.upstreams.iter().all(|u| u.scheme_str() == Some("http"));
    if plaintext && !dep.http2.prior_knowledge {
        // No TLS files to read, no SETTINGS to learn (HTTP/1.1 only).
        tls_config_for(&dep.tls, None)?;
        let pool = crate::pool::Pool::new(&dep.upstreams, max_idle);
        return Ok(UpstreamClient {
            send: Sender::Pool(Arc::new(pool)),
            peer: PeerStreams::new(&dep.upstreams),
        });
    }
    let mut http = HttpConnector::new();
    http.set_nodelay(true);
    // https:// URIs go through the TLS layer, which needs the TCP connector to accept them.
    http.enforce_http(false);
    // Roots matter only to a dependency with an https:// upstream: only it warns when there are
    // none.
    let https = dep.upstreams.iter().any(|u| u.scheme_str() == Some("https"));
    let tls = tls_config_for(&dep.tls, https.then_some(dep.name.as_str()))?;
    let builder = HttpsConnectorBuilder::new().with_tls_config(tls).https_or_http();
    let https = if dep.http2.prior_knowledge {
        // HTTP/2 only: ALPN offers `h2` alone.
        builder.enable_http2().wrap_connector(http)
    } else {
        builder.enable_all_versions().wrap_connector(http)
    };
    let peer = PeerStreams::new(&dep.upstreams);
    let connector =
        ReadSettings { inner: https, peer: peer.clone(), h2_only: dep.http2.prior_knowledge };
    let mut builder = Client::builder(TokioExecutor::new());
    builder
        .pool_max_idle_per_host(max_idle)
        // Before the peer's SETTINGS arrive, hyper would open up to 100 streams; never more
        // than the cap (bounded by `max_concurrent_streams` when configured), so a first burst
        // is not refused with REFUSED_STREAM by a peer that takes fewer.
        .http2_initial_max_send_streams(usize::try_from(cap).unwrap_or(usize::MAX));
    if dep.http2.prior_knowledge {
        builder.http2_only(true);
    }
    Ok(UpstreamClient { send: Sender::Client(Arc::new(builder.build(connector))), peer })
}

pub use stormguard_tls::TlsError;

/// The rustls client config of the dependency `needs_roots` names when it has an https://
/// upstream (roots, ALPN set by the connector, client certificate): with no `ca_file` and no
/// system root, it logs one warning (every handshake will fail). The config check reads the
/// same files through `stormguard_tls::client_config`.
fn tls_config_for(
    tls: &TlsConfig,
    needs_roots: Option<&str>,
) -> Result<rustls::ClientConfig, TlsError> {
    stormguard_tls::client_config(tls, needs_roots)
}

/// Each upstream's `SETTINGS_MAX_CONCURRENT_STREAMS`, as its last HTTP/2 connection's first
/// SETTINGS frame said (unknown until one arrives, and when the peer states no limit). One
/// client serves one dependency: an entry per upstream, in the dependency's order, found by the
/// connection's authority.
#[derive(Clone, Debug, Default)]
pub struct PeerStreams {
    upstreams: Arc<[(String, PeerStream)]>,
}

/// One upstream's peer limit.
#[derive(Clone, Debug, Default)]
pub struct PeerStream(Arc<PeerInner>);

#[derive(Debug, Default)]
struct PeerInner {
    /// The limit; 0 while unknown or unlimited.
    limit: AtomicU64,
    /// The limiter to lower the moment a connection's SETTINGS are read.
    limiter: std::sync::OnceLock<Limiter>,
}

impl PeerStreams {
    /// An entry for each upstream (their authorities, in the dependency's order).
    fn new(upstreams: &[Uri]) -> PeerStreams {
        PeerStreams {
            upstreams: upstreams.iter().map(|u| (authority(u), PeerStream::default())).collect(),
        }
    }

    /// Upstream `i`'s entry.
    pub fn upstream(&self, i: usize) -> Option<&PeerStream> {
        self.upstreams.get(i).map(|(_, p)| p)
    }

    /// The entry of the upstream a connection to `uri` reaches.
    fn for_uri(&self, uri: &Uri) -> Option<PeerStream> {
        let a = authority(uri);
        self.upstreams.iter().find(|(u, _)| *u == a).map(|(_, p)| p.clone())
    }

    /// Lowers each upstream's limiter as soon as its limit is learned.
    pub fn attach(&self, dep: &Dependency) {
        for (i, (_, p)) in self.upstreams.iter().enumerate() {
            p.attach(&dep.upstream_at(i).limiter);
        }
    }

    /// Lowers upstream `target`'s cap to its peer's limit (× 1 connection) when it is above it.
    /// Called on every attempt, so a higher hint (a concurrency-limit header) cannot keep it
    /// raised.
    pub fn apply(&self, dep: &Dependency, target: usize) {
        if let Some(p) = self.upstream(target) {
            p.lower(&dep.upstream_at(target).limiter);
        }
    }
}

/// `host:port` of an upstream or a connection's URI, the scheme's default port filled in.
fn authority(u: &Uri) -> String {
    crate::config::upstream_label(u).to_ascii_lowercase()
}

impl PeerStream {
    /// The limit, once known.
    pub fn get(&self) -> Option<u64> {
        // Relaxed: a lone value, read to lower a bound; a stale read only delays that.
        Some(self.0.limit.load(Ordering::Relaxed)).filter(|n| *n > 0)
    }

    fn set(&self, limit: Option<u32>) {
        self.0.limit.store(limit.map_or(0, u64::from), Ordering::Relaxed);
        if let Some(l) = self.0.limiter.get() {
            self.lower(l);
        }
    }

    /// Lowers this limiter as soon as a limit is learned (the first one attached wins).
    fn attach(&self, limiter: &Limiter) {
        let _ = self.0.limiter.set(limiter.clone());
        self.lower(limiter);
    }

    fn lower(&self, limiter: &Limiter) {
        if let Some(n) = self.get()
            && limiter.effective_cap() > n
        {
            limiter.set_limit_hint(n, PEER_LIMIT_TTL);
        }
    }
}

/// A connector that reads the server's first SETTINGS frame on each HTTP/2 connection.
#[derive(Clone, Debug)]
struct ReadSettings<C> {
    inner: C,
    peer: PeerStreams,
    /// HTTP/2 by prior knowledge: every connection is HTTP/2 (else only those ALPN made so).
    h2_only: bool,
}

type IoStream = MaybeHttpsStream<TokioIo<tokio::net::TcpStream>>;

impl<C> Service<Uri> for ReadSettings<C>
where
    C: Service<Uri, Response = IoStream> + Send,
    C::Future: Send + 'static,
    C::Error: Send,
{
    type Response = SettingsStream;
    type Error = C::Error;
    type Future = Pin<Box<dyn Future<Output = Result<SettingsStream, C::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), C::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        let peer = self.peer.for_uri(&uri);
        let connect = self.inner.call(uri);
        let h2_only = self.h2_only;
        Box::pin(async move {
            let io = connect.await?;
            let h2 = h2_only || io.connected().is_negotiated_h2();
            let reader = peer.filter(|_| h2).map(|peer| (SettingsReader::default(), peer));
            Ok(SettingsStream { io, reader })
        })
    }
}

/// A connection whose first incoming HTTP/2 frame is read on its way through.
#[derive(Debug)]
pub struct SettingsStream {
    io: IoStream,
    /// Until the first frame has been read (then `None`: reads go straight through).
    reader: Option<(SettingsReader, PeerStream)>,
}

impl Connection for SettingsStream {
    fn connected(&self) -> Connected {
        self.io.connected()
    }
}

impl Read for SettingsStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        mut buf: ReadBufCursor<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let Some((reader, peer)) = &mut this.reader else {
            return Pin::new(&mut this.io).poll_read(cx, buf);
        };
        // Read into a scratch buffer we can look at, then hand the bytes on: only until the
        // first frame is through (usually the first read).
        let mut scratch = [0u8; 1024];
        let n = buf.remaining().min(scratch.len());
        let mut rb = ReadBuf::new(&mut scratch[..n]);
        match Pin::new(&mut this.io).poll_read(cx, rb.unfilled()) {
            Poll::Ready(Ok(())) => {}
            other => return other,
        }
        let filled = rb.filled();
        buf.put_slice(filled);
        if filled.is_empty() {
            this.reader = None;
        } else if let Some(outcome) = reader.feed(filled) {
            if let Some(limit) = outcome {
                tracing::debug!(limit, "upstream SETTINGS_MAX_CONCURRENT_STREAMS");
            }
            peer.set(outcome);
            this.reader = None;
        }
        Poll::Ready(Ok(()))
    }
}

impl Write for SettingsStream {
    crate::forward::forward_writes!(io);
}

/// Reads an HTTP/2 server's first frame, which must be SETTINGS (RFC 9113 §3.4): a 9-byte
/// header (length: 24 bits, type 0x4, flags, stream 0), then 6-byte entries (id: 16 bits,
/// value: 32 bits); `SETTINGS_MAX_CONCURRENT_STREAMS` is id 0x3.
#[derive(Debug, Default)]
pub(crate) struct SettingsReader {
    bytes: Vec<u8>,
}

/// A SETTINGS frame is a few entries; a server preface that claims more is not read.
const MAX_SETTINGS_PAYLOAD: usize = 6 * 64;

impl SettingsReader {
    /// Takes the next bytes from the server. `Some(limit)` once the first frame is read
    /// (`Some(None)`: no limit stated, or the frame was not SETTINGS); `None`: more bytes
    /// needed.
    pub(crate) fn feed(&mut self, mut data: &[u8]) -> Option<Option<u32>> {
        loop {
            let mut need = 9;
            if let [l0, l1, l2, kind, flags, ..] = self.bytes[..] {
                let len = usize::from(l0) << 16 | usize::from(l1) << 8 | usize::from(l2);
                if kind != 0x4 || flags & 0x1 != 0 || len > MAX_SETTINGS_PAYLOAD {
                    return Some(None);
                }
                need += len;
                if self.bytes.len() == need {
                    let limit = self.bytes[9..]
                        .chunks_exact(6)
                        .filter(|e| u16::from_be_bytes([e[0], e[1]]) == 0x3)
                        .map(|e| u32::from_be_bytes([e[2], e[3], e[4], e[5]]))
                        .next_back();
                    return Some(limit);
                }
            }
            if data.is_empty() {
                return None;
            }
            let take = (need - self.bytes.len()).min(data.len());
            self.bytes.extend_from_slice(&data[..take]);
            data = &data[take..];
        }
    }
}

/// An upstream's port: the one it names, else 443 for `https://` and 80 for `http://`.
pub fn port_of(upstream: &Uri) -> u16 {
    upstream.port_u16().unwrap_or(if upstream.scheme_str() == Some("https") { 443 } else { 80 })
}

/// Whether a TLS handshake failed somewhere in `e`'s source chain (an untrusted or expired
/// certificate, a name mismatch, no common protocol).
pub fn is_tls_error(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut cur = Some(e);
    while let Some(e) = cur {
        if e.downcast_ref::<rustls::Error>().is_some() {
            return true;
        }
        // `io::Error::source` skips the error it wraps: look inside (hyper-rustls wraps
        // rustls' error in two of them).
        cur = match e.downcast_ref::<io::Error>().and_then(io::Error::get_ref) {
            Some(inner) => Some(inner as &(dyn std::error::Error + 'static)),
            None => e.source(),
        };
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(entries: &[(u16, u32)]) -> Vec<u8> {
        let len = entries.len() * 6;
        let mut f = vec![(len >> 16) as u8, (len >> 8) as u8, len as u8, 0x4, 0, 0, 0, 0, 0];
        for (id, v) in entries {
            f.extend_from_slice(&id.to_be_bytes());
            f.extend_from_slice(&v.to_be_bytes());
        }
        f
    }

    #[test]
    fn an_h2c_client_learns_the_streams_at_its_first_connection() {
        let mut dep =
            crate::config::ProxyDependency::new("grpc", "http://127.0.0.1:50051".parse().unwrap());
        dep.http2.prior_knowledge = true; // h2c
        let client = client(&dep).unwrap();
        assert_eq!(client.peer_streams().upstream(0).and_then(|p| p.get()), None);
    }

    #[test]
    fn reads_max_concurrent_streams_from_the_first_frame() {
        let frame = settings(&[(0x1, 4096), (0x3, 4), (0x4, 65535)]);
        assert_eq!(SettingsReader::default().feed(&frame), Some(Some(4)));
        // Split anywhere, with the next frame behind it.
        let mut more = frame.clone();
        more.extend_from_slice(&settings(&[(0x3, 99)]));
        for cut in 1..frame.len() {
            let mut r = SettingsReader::default();
            assert_eq!(r.feed(&more[..cut]), None, "cut {cut}");
            assert_eq!(r.feed(&more[cut..]), Some(Some(4)), "cut {cut}");
        }
        // No limit stated; the last value wins when stated twice.
        assert_eq!(SettingsReader::default().feed(&settings(&[(0x4, 1)])), Some(None));
        assert_eq!(SettingsReader::default().feed(&settings(&[(0x3, 8), (0x3, 2)])), Some(Some(2)));
        // Not SETTINGS, a SETTINGS ack, or an oversized frame: nothing learned.
        let mut ping = settings(&[(0x3, 1)]);
        ping[3] = 0x6;
        assert_eq!(SettingsReader::default().feed(&ping), Some(None));
        let mut ack = settings(&[]);
        ack[4] = 0x1;
        assert_eq!(SettingsReader::default().feed(&ack), Some(None));
        let huge = settings(&vec![(0x3, 1); 100]);
        assert_eq!(SettingsReader::default().feed(&huge), Some(None));
    }
}
