//! The unprotected path of the demo (and of `stormguard verify`'s naive policies): a forwarder
//! that retries each failure, with no cap and no budget — what most clients do by default. It
//! is the baseline that shows the storm: retrying once at 40 % errors its dependency sees 1.4×
//! the load, and when the dependency slows down every timed-out attempt is sent again while
//! the first one is still being worked on.
//!
//! Its retries carry `x-stormguard-attempt: 2`, so chaos counts them as retries exactly as it
//! counts the proxy's.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Request, Response, StatusCode, Uri};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo};
use stormguard_core::backoff::{Backoff, BackoffConfig};
use stormguard_core::random::SplitMix64;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinSet;

type NaiveClient = Client<HttpConnector, Full<Bytes>>;

/// A running naive forwarder; dropping it stops it.
#[derive(Debug)]
pub struct Naive {
    addr: SocketAddr,
    stop: watch::Sender<bool>,
}

impl Naive {
    /// Where callers connect.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for Naive {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
    }
}

/// How the naive forwarder retries.
#[derive(Debug, Clone, Copy)]
pub struct Retries {
    /// Each attempt's limit; `None`: none.
    pub per_try_timeout: Option<Duration>,
    /// Retries per request after the first try.
    pub max: u32,
    /// The wait before each retry; `None`: at once.
    pub backoff: Option<BackoffConfig>,
}

/// Starts the forwarder on `127.0.0.1:0` in front of `upstream` (`http://host:port`): each
/// request is sent, with `retries.per_try_timeout`, and sent again while it fails (a 5xx, a
/// transport error or the timeout), up to `retries.max` more times.
pub async fn start(upstream: Uri, retries: Retries) -> std::io::Result<Naive> {
    let listener = TcpListener::bind(("127.0.0.1", 0)).await?;
    let addr = listener.local_addr()?;
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    let client: NaiveClient = Client::builder(TokioExecutor::new()).build(connector);
    let (stop, mut stopped) = watch::channel(false);
    tokio::spawn(async move {
        let mut conns = JoinSet::new();
        loop {
            let stream = tokio::select! {
                _ = stopped.changed() => break,
                r = listener.accept() => match r {
                    Ok((s, _)) => s,
                    Err(_) => {
                        tokio::time::sleep(Duration::from_millis(10)).await;
                        continue;
                    }
                },
                Some(_) = conns.join_next(), if !conns.is_empty() => continue,
            };
            let _ = stream.set_nodelay(true);
            let (client, upstream) = (client.clone(), upstream.clone());
            conns.spawn(async move {
                let svc = hyper::service::service_fn(move |req| {
                    let (client, upstream) = (client.clone(), upstream.clone());
                    async move {
                        Ok::<_, Infallible>(forward(&client, &upstream, retries, req).await)
                    }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
    Ok(Naive { addr, stop })
}

fn answer(status: StatusCode, body: Bytes) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(body));
    *r.status_mut() = status;
    r
}

/// Sends the request, and again while that fails; answers with the last attempt's result.
async fn forward(
    client: &NaiveClient,
    upstream: &Uri,
    retries: Retries,
    req: Request<Incoming>,
) -> Response<Full<Bytes>> {
    let (parts, body) = req.into_parts();
    let Ok(body) = body.collect().await.map(|b| b.to_bytes()) else {
        return answer(StatusCode::BAD_REQUEST, Bytes::from_static(b"unreadable body\n"));
    };
    let mut target = upstream.clone().into_parts();
    target.path_and_query = parts.uri.path_and_query().cloned();
    let Ok(uri) = Uri::from_parts(target) else {
        return answer(StatusCode::BAD_REQUEST, Bytes::from_static(b"bad target\n"));
    };
    let mut last = answer(StatusCode::BAD_GATEWAY, Bytes::new());
    let backoff = retries.backoff.and_then(|b| Backoff::try_new(b).ok());
    // Each request its own stream of jitter.
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let mut rng = SplitMix64::new(NEXT.fetch_add(1, Ordering::Relaxed));
    let mut waited = None;
    for attempt in 1..=retries.max.saturating_add(1) {
        if let (Some(b), true) = (&backoff, attempt > 1) {
            let wait = b.wait(attempt - 1, waited, &mut rng);
            waited = Some(wait);
            tokio::time::sleep(wait).await;
        }
        let mut req = Request::new(Full::new(body.clone()));
        *req.method_mut() = parts.method.clone();
        *req.uri_mut() = uri.clone();
        req.headers_mut().insert("x-stormguard-attempt", HeaderValue::from(attempt));
        let sent = async {
            let resp = client.request(req).await.map_err(|_| ())?;
            let (head, body) = resp.into_parts();
            let body = body.collect().await.map_err(|_| ())?.to_bytes();
            Ok::<_, ()>((head.status, body))
        };
        let per_try = retries.per_try_timeout.unwrap_or(Duration::MAX);
        last = match tokio::time::timeout(per_try, sent).await {
            Ok(Ok((status, body))) if !status.is_server_error() => return answer(status, body),
            Ok(Ok((status, body))) => answer(status, body),
            Ok(Err(())) => {
                answer(StatusCode::BAD_GATEWAY, Bytes::from_static(b"upstream failed\n"))
            }
            Err(_) => answer(StatusCode::GATEWAY_TIMEOUT, Bytes::from_static(b"per-try timeout\n")),
        };
    }
    last
}
