//! The connection pool of a plaintext HTTP/1.1 dependency, over hyper's `client::conn`.
//!
//! The cap already bounds what is sent to each upstream, so the pool needs no queue and no
//! limit of its own: a stack of idle senders per upstream, most recently used on top. A request
//! takes the first ready sender (one still relaying its last answer's body is skipped, a closed
//! one dropped) or opens a connection; the sender goes back on the stack as soon as the answer's
//! head has arrived — it is ready again once that body has been read, which the next checkout
//! sees. No task per request, no checkout future, no key hashing: what hyper-util's pooled client
//! spends per request beyond the connection itself (measured in BENCHMARKS.md, issue 27).
//!
//! What the pooled client did and this keeps: hyper-util's connector (its resolver, the fallback
//! between address families after 300 ms, `TCP_NODELAY`); origin-form request targets, a `Host`
//! from the upstream's authority when the request has none, HTTP/1.1 on the wire; a request that
//! never left (its reused connection closed first) is sent once more on a new connection; a
//! failure to connect is a connect failure (nothing was sent: retryable even when not
//! idempotent); at most `max_idle` idle connections per upstream. Unlike it, nothing runs in the
//! background: a connection idle past [`IDLE_TIMEOUT`] (counted from its last answer's head) is
//! closed when the pool is next used for its upstream, not on a timer, so a dependency gone
//! quiet keeps its idle connections until its server closes them. TLS and HTTP/2 upstreams keep
//! hyper-util's client.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use http::header::HOST;
use http::uri::PathAndQuery;
use http::{HeaderValue, Request, Response, Uri, Version};
use hyper::body::Incoming;
use hyper::client::conn::http1::SendRequest;
use hyper_util::client::legacy::connect::HttpConnector;
use stormguard_http::classify::TransportError;
use stormguard_tower::{BoxError, StormguardError};
use tower::Service;

/// How long an idle connection is kept (hyper-util's pooled client's default).
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(90);

/// The idle connections of each upstream of one dependency.
pub struct Pool<B> {
    upstreams: Box<[Upstream<B>]>,
    max_idle: usize,
    connector: HttpConnector,
}

impl<B> std::fmt::Debug for Pool<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names: Vec<_> = self.upstreams.iter().map(|u| u.uri.to_string()).collect();
        f.debug_struct("Pool").field("upstreams", &names).field("max_idle", &self.max_idle).finish()
    }
}

struct Upstream<B> {
    /// `Host` for a request that has none: the authority without the scheme's default port.
    host: HeaderValue,
    /// Where to connect, and the authority requests to this upstream carry: `http://authority/`.
    uri: Uri,
    idle: Mutex<Vec<(SendRequest<B>, Instant)>>,
}

/// No upstream of this dependency has the request's authority (the stack only sends to its
/// dependency's upstreams, so this is a bug, reported rather than sent somewhere else).
#[derive(Debug, thiserror::Error)]
#[error("no upstream of this dependency is {0}")]
pub struct UnknownUpstream(String);

impl<B> Pool<B>
where
    B: http_body::Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<BoxError>,
{
    /// A pool for `upstreams` (all `http://`), keeping at most `max_idle` idle connections
    /// each.
    pub fn new(upstreams: &[Uri], max_idle: usize) -> Pool<B> {
        let upstreams = upstreams
            .iter()
            .filter_map(|u| {
                let header = match u.port_u16() {
                    Some(p) if p != 80 => format!("{}:{p}", u.host()?),
                    _ => u.host()?.to_string(),
                };
                Some(Upstream {
                    uri: Uri::builder()
                        .scheme("http")
                        .authority(u.authority()?.clone())
                        .path_and_query("/")
                        .build()
                        .ok()?,
                    host: HeaderValue::from_str(&header).ok()?,
                    idle: Mutex::new(Vec::new()),
                })
            })
            .collect();
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        Pool { upstreams, max_idle: max_idle.max(1), connector }
    }

    /// Sends `req` (its URI absolute, to one of the upstreams) and returns the answer's head.
    pub fn send(
        self: &Arc<Self>,
        mut req: Request<B>,
    ) -> Pin<Box<dyn Future<Output = Result<Response<Incoming>, BoxError>> + Send>> {
        let pool = self.clone();
        Box::pin(async move {
            let Some(i) = pool.find(req.uri()) else {
                return Err(UnknownUpstream(req.uri().to_string()).into());
            };
            let up = &pool.upstreams[i];
            prepare(&mut req, &up.host);
            let (mut sender, reused) = match pool.checkout(i) {
                Some(s) => (s, true),
                None => (connect(&pool.connector, up).await?, false),
            };
            match sender.try_send_request(req).await {
                Ok(resp) => {
                    pool.checkin(i, sender);
                    Ok(resp)
                }
                // A reused connection closed before the request left: once more, on a new one.
                Err(mut e) if reused && e.message().is_some() => {
                    let req = e.take_message().expect("checked above");
                    tracing::debug!(error = %e.error(), "a pooled connection was closed; sending on a new one");
                    let mut sender = connect(&pool.connector, up).await?;
                    let resp = sender.send_request(req).await?;
                    pool.checkin(i, sender);
                    Ok(resp)
                }
                Err(e) => Err(e.into_error().into()),
            }
        })
    }

    fn find(&self, uri: &Uri) -> Option<usize> {
        let a = uri.authority()?;
        self.upstreams.iter().position(|u| u.uri.authority() == Some(a))
    }

    /// A ready idle sender to upstream `i`, most recent first; closed ones and ones idle past
    /// [`IDLE_TIMEOUT`] are dropped, busy ones (still relaying their last answer's body) stay.
    fn checkout(&self, i: usize) -> Option<SendRequest<B>> {
        let now = Instant::now();
        let mut idle = self.upstreams[i].idle.lock().unwrap_or_else(PoisonError::into_inner);
        let mut cx = Context::from_waker(Waker::noop());
        let mut k = idle.len();
        while k > 0 {
            k -= 1;
            let stale = now.duration_since(idle[k].1) > IDLE_TIMEOUT;
            match idle[k].0.poll_ready(&mut cx) {
                Poll::Ready(Ok(())) if !stale => return Some(idle.remove(k).0),
                Poll::Ready(_) => {
                    idle.remove(k);
                }
                Poll::Pending => {}
            }
        }
        None
    }

    /// Puts `sender` back on upstream `i`'s stack. A full stack first drops its closed and
    /// expired entries; if it is still full, `sender` is closed.
    fn checkin(&self, i: usize, sender: SendRequest<B>) {
        if sender.is_closed() {
            return;
        }
        let now = Instant::now();
        let mut idle = self.upstreams[i].idle.lock().unwrap_or_else(PoisonError::into_inner);
        if idle.len() >= self.max_idle {
            idle.retain(|(s, since)| !s.is_closed() && now.duration_since(*since) <= IDLE_TIMEOUT);
        }
        if idle.len() < self.max_idle {
            idle.push((sender, now));
        }
    }
}

/// HTTP/1.1 on the wire, origin-form, a `Host` when the caller sent none.
fn prepare<B>(req: &mut Request<B>, host: &HeaderValue) {
    *req.version_mut() = Version::HTTP_11;
    req.headers_mut().entry(HOST).or_insert_with(|| host.clone());
    let origin =
        req.uri().path_and_query().cloned().unwrap_or_else(|| PathAndQuery::from_static("/"));
    *req.uri_mut() = Uri::from(origin);
}

/// A new connection to `up` through hyper-util's connector, its task spawned; a failure is a
/// connect failure.
async fn connect<B>(connector: &HttpConnector, up: &Upstream<B>) -> Result<SendRequest<B>, BoxError>
where
    B: http_body::Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<BoxError>,
{
    let failed = |e: BoxError| -> BoxError {
        StormguardError::Transport { kind: TransportError::Connect, source: e }.into()
    };
    let io = connector.clone().call(up.uri.clone()).await.map_err(|e| failed(e.into()))?;
    let (sender, conn) =
        hyper::client::conn::http1::handshake(io).await.map_err(|e| failed(e.into()))?;
    tokio::spawn(async move {
        if let Err(e) = conn.await {
            tracing::debug!(error = %e, "upstream connection ended");
        }
    });
    Ok(sender)
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use bytes::Bytes;
    use http_body_util::{BodyExt, Empty};
    use stormguard_tower::error::classify_error;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    use super::*;

    /// A raw HTTP/1.1 upstream on loopback: counts connections, keeps every request head, and
    /// answers each `200 ok` (closing the connection after each answer when `close`).
    async fn upstream(close: bool) -> (Uri, Arc<AtomicUsize>, Arc<Mutex<Vec<String>>>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let uri: Uri = format!("http://{}", listener.local_addr().unwrap()).parse().unwrap();
        let (conns, heads) = (Arc::new(AtomicUsize::new(0)), Arc::new(Mutex::new(Vec::new())));
        let (c, h) = (conns.clone(), heads.clone());
        tokio::spawn(async move {
            while let Ok((mut s, _)) = listener.accept().await {
                c.fetch_add(1, Ordering::SeqCst);
                let h = h.clone();
                tokio::spawn(async move {
                    let mut buf = Vec::new();
                    let mut chunk = [0u8; 1024];
                    loop {
                        let Ok(n) = s.read(&mut chunk).await else { return };
                        if n == 0 {
                            return;
                        }
                        buf.extend_from_slice(&chunk[..n]);
                        while let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                            let head: Vec<u8> = buf.drain(..end + 4).collect();
                            h.lock().unwrap().push(String::from_utf8_lossy(&head).into_owned());
                            let ok = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";
                            if s.write_all(ok).await.is_err() || close {
                                return;
                            }
                        }
                    }
                });
            }
        });
        (uri, conns, heads)
    }

    async fn get(pool: &Arc<Pool<Empty<Bytes>>>, uri: &Uri) -> Result<String, BoxError> {
        let target = format!("http://{}/x?y=1", uri.authority().unwrap());
        let req = Request::get(target).body(Empty::new()).unwrap();
        let resp = pool.send(req).await?;
        let body = resp.into_body().collect().await?.to_bytes();
        Ok(String::from_utf8_lossy(&body).into_owned())
    }

    #[tokio::test]
    async fn one_connection_carries_requests_one_after_another() {
        let (uri, conns, heads) = upstream(false).await;
        let pool = Arc::new(Pool::new(std::slice::from_ref(&uri), 4));
        for _ in 0..50 {
            assert_eq!(get(&pool, &uri).await.unwrap(), "ok");
        }
        assert_eq!(conns.load(Ordering::SeqCst), 1);
        // Origin-form, HTTP/1.1, the upstream's authority as Host.
        let first = heads.lock().unwrap()[0].clone();
        assert!(first.starts_with("GET /x?y=1 HTTP/1.1\r\n"), "{first}");
        let host = format!("host: {}", uri.authority().unwrap());
        assert!(first.to_ascii_lowercase().contains(&host), "{first}");
    }

    #[tokio::test]
    async fn a_caller_host_is_kept() {
        let (uri, _, heads) = upstream(false).await;
        let pool = Arc::new(Pool::new(std::slice::from_ref(&uri), 4));
        let req = Request::get(format!("{uri}/"))
            .header(HOST, "api.example")
            .body(Empty::<Bytes>::new())
            .unwrap();
        pool.send(req).await.unwrap();
        let head = heads.lock().unwrap()[0].to_ascii_lowercase();
        assert!(head.contains("host: api.example\r\n") && head.matches("host:").count() == 1);
    }

    #[tokio::test]
    async fn concurrent_requests_open_a_connection_each_and_reuse_them() {
        let (uri, conns, _) = upstream(false).await;
        let pool = Arc::new(Pool::new(std::slice::from_ref(&uri), 8));
        for _ in 0..5 {
            let all: Vec<_> = (0..8)
                .map(|_| {
                    let (pool, uri) = (pool.clone(), uri.clone());
                    tokio::spawn(async move { get(&pool, &uri).await.unwrap() })
                })
                .collect();
            for t in all {
                assert_eq!(t.await.unwrap(), "ok");
            }
        }
        // Eight at once need eight; the rounds after reuse them.
        assert_eq!(conns.load(Ordering::SeqCst), 8);
    }

    #[tokio::test]
    async fn a_connection_the_upstream_closed_is_not_reused() {
        let (uri, conns, _) = upstream(true).await;
        let pool = Arc::new(Pool::new(std::slice::from_ref(&uri), 4));
        for _ in 0..5 {
            assert_eq!(get(&pool, &uri).await.unwrap(), "ok");
            // The close has arrived before the next request.
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(conns.load(Ordering::SeqCst), 5);
    }

    #[tokio::test]
    async fn nobody_listening_is_a_connect_failure() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let uri: Uri = format!("http://{}", listener.local_addr().unwrap()).parse().unwrap();
        drop(listener);
        let pool = Arc::new(Pool::new(std::slice::from_ref(&uri), 4));
        let e = get(&pool, &uri).await.unwrap_err();
        assert_eq!(classify_error(&*e), TransportError::Connect, "{e}");
        // An upstream the dependency does not have is refused, not sent anywhere.
        let other: Uri = "http://127.0.0.1:9".parse().unwrap();
        let e = get(&pool, &other).await.unwrap_err();
        assert!(e.is::<UnknownUpstream>(), "{e}");
    }
}
