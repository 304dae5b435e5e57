//! What happens to each attempt below the cap, one concern a function or layer: counted and
//! timed for the access log ([`AttemptLog`]), numbered, sent to its upstream, told its gRPC
//! deadline, its cap held under the HTTP/2 peer's streams, an unsolicited upgrade refused.
//! the stack (`stack.rs`) assembles them in order.
//!
//! The extensions they read are set above: [`UpstreamTarget`] (which upstream the request's
//! life chose), [`TimeLeft`] (the deadline left) and [`SlotWait`] (how long a first try waited
//! for its slot) by stormguard-tower's layer, [`AttemptLog`] by the server.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use http::{HeaderValue, Request, Response, StatusCode};
use stormguard_http::classify::ProtocolError;
use stormguard_http::stacked::ATTEMPT_HEADER;
use stormguard_tower::{BoxError, SlotWait, TimeLeft, UpstreamTarget};
use tower::{Layer, Service};

/// Per request, shared by its attempts (request extensions are copied to each attempt): how
/// many were sent and how long the upstream took, for the access log.
#[derive(Clone, Debug, Default)]
pub struct AttemptLog(Arc<AttemptCounts>);

#[derive(Debug, Default)]
struct AttemptCounts {
    attempts: AtomicU32,
    /// The upstream of the last attempt.
    target: AtomicUsize,
    upstream_us: AtomicU64,
    slot_wait_us: AtomicU64,
}

impl AttemptLog {
    /// The upstream the last attempt went to (an index into the dependency's upstreams).
    pub fn target(&self) -> usize {
        self.0.target.load(Ordering::Relaxed)
    }

    /// Attempts sent to the upstream.
    pub fn attempts(&self) -> u32 {
        self.0.attempts.load(Ordering::Relaxed)
    }

    /// Time the attempts spent waiting for their slot (a primary in the queue; a retry never
    /// waits).
    pub fn slot_wait(&self) -> Duration {
        Duration::from_micros(self.0.slot_wait_us.load(Ordering::Relaxed))
    }

    /// Time the attempts spent waiting for response headers from the upstream.
    pub fn upstream_time(&self) -> Duration {
        Duration::from_micros(self.0.upstream_us.load(Ordering::Relaxed))
    }
}

/// `x-stormguard-attempt: 1` on a first try that carries none (the layer numbers the retries).
pub(crate) fn number_first<B>(mut req: Request<B>) -> Request<B> {
    // One lookup: the name is hashed once whether or not it is there.
    req.headers_mut().entry(&ATTEMPT_HEADER).or_insert(HeaderValue::from_static("1"));
    req
}

/// The upstream an attempt goes to: [`UpstreamTarget`], 0 when the layer set none.
pub(crate) fn target<B>(req: &Request<B>) -> usize {
    req.extensions().get::<UpstreamTarget>().map_or(0, |t| t.0)
}

/// An attempt for upstream `i > 0` is sent there, path and query kept.
pub(crate) fn failover<B>(upstreams: &[http::Uri], mut req: Request<B>) -> Request<B> {
    let i = target(&req);
    if i != 0
        && let Some(u) = upstreams.get(i)
    {
        let mut parts = u.clone().into_parts();
        parts.path_and_query = req.uri().path_and_query().cloned();
        if let Ok(uri) = http::Uri::from_parts(parts) {
            *req.uri_mut() = uri;
        }
    }
    req
}

/// On a gRPC request: the time left as `grpc-timeout` (never above the caller's), and `te:
/// trailers` restored (removed with the hop-by-hop headers; gRPC servers require it).
pub(crate) fn grpc_deadline<B>(mut req: Request<B>) -> Request<B> {
    if crate::grpc::is_grpc_request(req.headers()) {
        req.headers_mut().insert(http::header::TE, HeaderValue::from_static("trailers"));
        if let Some(TimeLeft(left)) = req.extensions().get::<TimeLeft>().copied() {
            crate::grpc::propagate(req.headers_mut(), left);
        }
    }
    req
}

/// The proxy forwards no upgrade (`Upgrade` is hop-by-hop): a 101 answers a request nobody
/// made, and relaying it would hand the caller a connection in an unknown protocol.
pub(crate) fn no_upgrade<RB, E: Into<BoxError>>(
    r: Result<Response<RB>, E>,
) -> Result<Response<RB>, BoxError> {
    match r {
        Ok(resp) if resp.status() == StatusCode::SWITCHING_PROTOCOLS => {
            Err(ProtocolError::UnsolicitedUpgrade.into())
        }
        r => r.map_err(Into::into),
    }
}

/// Counts each attempt in the request's [`AttemptLog`] and times it: its slot wait
/// ([`SlotWait`], when it waited) and the upstream's time to response headers.
#[derive(Clone, Copy, Debug)]
pub(crate) struct LogLayer;

impl<S> Layer<S> for LogLayer {
    type Service = Logged<S>;

    fn layer(&self, inner: S) -> Logged<S> {
        Logged { inner }
    }
}

/// The service [`LogLayer`] makes.
#[derive(Clone, Debug)]
pub(crate) struct Logged<S> {
    inner: S,
}

impl<S, B> Service<Request<B>> for Logged<S>
where
    S: Service<Request<B>>,
    S::Future: Send + 'static,
    S::Error: Into<BoxError>,
{
    type Response = S::Response;
    type Error = BoxError;
    type Future = LoggedFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        let log = req.extensions().get::<AttemptLog>().cloned();
        let started = Instant::now();
        if let Some(l) = &log {
            l.0.attempts.fetch_add(1, Ordering::Relaxed);
            l.0.target.store(target(&req), Ordering::Relaxed);
            if let Some(SlotWait(waited)) = req.extensions().get::<SlotWait>() {
                let us = waited.as_micros();
                l.0.slot_wait_us
                    .fetch_add(u64::try_from(us).unwrap_or(u64::MAX), Ordering::Relaxed);
            }
        }
        LoggedFuture { call: self.inner.call(req), log, started }
    }
}

pin_project_lite::pin_project! {
    /// The response future of [`Logged`]: the attempt's call, timed to its response headers
    /// (in place: no allocation per attempt).
    pub(crate) struct LoggedFuture<F> {
        #[pin]
        call: F,
        log: Option<AttemptLog>,
        started: Instant,
    }
}

impl<F, T, E> Future for LoggedFuture<F>
where
    F: Future<Output = Result<T, E>>,
    E: Into<BoxError>,
{
    type Output = Result<T, BoxError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let r = std::task::ready!(this.call.poll(cx));
        if let Some(l) = this.log.take() {
            let us = u64::try_from(this.started.elapsed().as_micros()).unwrap_or(u64::MAX);
            l.0.upstream_us.fetch_add(us, Ordering::Relaxed);
        }
        Poll::Ready(r.map_err(Into::into))
    }
}
