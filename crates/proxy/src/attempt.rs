//! What happens to each attempt below the cap, one service and one future ([`Attempt`]), each
//! concern a function it calls in order: counted and timed for the access log
//! ([`AttemptLog`]), numbered, sent to its upstream, told its gRPC deadline, its cap held under
//! the HTTP/2 peer's streams; its answer's unsolicited upgrade refused, an OpenAI 429 read for a
//! spent quota.
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
use tower::Service;

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
fn number_first<B>(mut req: Request<B>) -> Request<B> {
    // One lookup: the name is hashed once whether or not it is there.
    req.headers_mut().entry(&ATTEMPT_HEADER).or_insert(HeaderValue::from_static("1"));
    req
}

/// The upstream an attempt goes to: [`UpstreamTarget`], 0 when the layer set none.
pub(crate) fn target<B>(req: &Request<B>) -> usize {
    req.extensions().get::<UpstreamTarget>().map_or(0, |t| t.0)
}

/// An attempt for upstream `i > 0` is sent there, path and query kept.
fn failover<B>(upstreams: &[http::Uri], mut req: Request<B>) -> Request<B> {
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
fn grpc_deadline<B>(mut req: Request<B>) -> Request<B> {
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
fn no_upgrade<RB, E: Into<BoxError>>(r: Result<Response<RB>, E>) -> Result<Response<RB>, BoxError> {
    match r {
        Ok(resp) if resp.status() == StatusCode::SWITCHING_PROTOCOLS => {
            Err(ProtocolError::UnsolicitedUpgrade.into())
        }
        r => r.map_err(Into::into),
    }
}

/// An attempt's request (the stack's `UpstreamRequest`): the caller's body, copied for retries
/// while sent.
type Outgoing = Request<stormguard_http::body::ReplayBody<crate::body::CallerBody>>;

/// Every step of an attempt below the cap, as one service and one future (each step used to be
/// a layer of its own, each moving the request in and the response out): the attempt counted
/// and timed for the request's [`AttemptLog`] (its slot wait, [`SlotWait`], when it waited;
/// the upstream's time to response headers), numbered, sent to the upstream the request's
/// life chose, told its gRPC deadline, its cap held under the HTTP/2 peer's streams; then the
/// answer: an unsolicited upgrade refused, an OpenAI 429's body read for a spent quota.
#[derive(Clone)]
pub(crate) struct Attempt {
    pub(crate) client: crate::upstream::UpstreamClient,
    pub(crate) upstreams: Arc<[http::Uri]>,
    pub(crate) peer: crate::upstream::PeerStreams,
    pub(crate) dependency: stormguard_tower::Dependency,
    pub(crate) provider: Option<stormguard_tower::Provider>,
}

impl Service<Outgoing> for Attempt {
    type Response = Response<crate::provider::ProviderBody>;
    type Error = BoxError;
    type Future = AttemptFuture;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.client.poll_ready(cx)
    }

    fn call(&mut self, req: Outgoing) -> AttemptFuture {
        let log = req.extensions().get::<AttemptLog>().cloned();
        let started = Instant::now();
        let i = target(&req);
        if let Some(l) = &log {
            l.0.attempts.fetch_add(1, Ordering::Relaxed);
            l.0.target.store(i, Ordering::Relaxed);
            if let Some(SlotWait(waited)) = req.extensions().get::<SlotWait>() {
                let us = waited.as_micros();
                l.0.slot_wait_us
                    .fetch_add(u64::try_from(us).unwrap_or(u64::MAX), Ordering::Relaxed);
            }
        }
        let req = grpc_deadline(failover(&self.upstreams, number_first(req)));
        self.peer.apply(&self.dependency, i);
        AttemptFuture {
            state: Sent::Call(self.client.call(req)),
            log,
            started,
            provider: self.provider,
        }
    }
}

/// The response future of [`Attempt`]: the upstream's call, then (only for an OpenAI 429) its
/// body read for a spent quota.
pub(crate) struct AttemptFuture {
    state: Sent,
    log: Option<AttemptLog>,
    started: Instant,
    provider: Option<stormguard_tower::Provider>,
}

/// Where an attempt is.
enum Sent {
    /// At the upstream (the client's future is boxed already).
    Call(<crate::upstream::UpstreamClient as Service<Outgoing>>::Future),
    /// An OpenAI 429's body being read.
    Inspecting(
        Pin<
            Box<
                dyn Future<Output = Result<Response<crate::provider::ProviderBody>, BoxError>>
                    + Send,
            >,
        >,
    ),
}

impl Future for AttemptFuture {
    type Output = Result<Response<crate::provider::ProviderBody>, BoxError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = &mut *self;
        let result = match &mut this.state {
            Sent::Inspecting(read) => return read.as_mut().poll(cx),
            Sent::Call(call) => std::task::ready!(call.as_mut().poll(cx)),
        };
        if let Some(l) = this.log.take() {
            let us = u64::try_from(this.started.elapsed().as_micros()).unwrap_or(u64::MAX);
            l.0.upstream_us.fetch_add(us, Ordering::Relaxed);
        }
        let resp = match no_upgrade(result) {
            Ok(resp) => resp,
            Err(e) => return Poll::Ready(Err(e)),
        };
        if !crate::provider::needs_inspection(this.provider, &resp) {
            return Poll::Ready(Ok(resp.map(crate::provider::ProviderBody::untouched)));
        }
        let mut read = Box::pin(crate::provider::inspect(this.provider, Ok(resp)));
        let polled = read.as_mut().poll(cx);
        this.state = Sent::Inspecting(read);
        polled
    }
}
