//! What happens to each attempt below the cap. As the layer sends it ([`ProxyPolicy`]'s
//! `sending`, with what the layer knows of the attempt — its upstream, the deadline left, its
//! slot wait): counted for the access log ([`AttemptLog`]), numbered, sent to its upstream, told
//! its gRPC deadline. Then one service and one future ([`Attempt`]): its cap held under the
//! HTTP/2 peer's streams, timed, its answer's unsolicited upgrade refused, an OpenAI 429 read for
//! a spent quota.
//!
//! An attempt's request carries no extension map of the proxy's: the request's [`AttemptLog`]
//! travels in its body ([`OutgoingBody`]), copied with it for each attempt, and the layer's
//! facts come typed (`stormguard_tower::Sending`), not as extensions.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderValue, Request, Response, StatusCode};
use http_body::{Body, Frame, SizeHint};
use stormguard_http::body::{ReplayBody, ReplayError};
use stormguard_http::classify::ProtocolError;
use stormguard_http::stacked::ATTEMPT_HEADER;
use stormguard_tower::{AttemptPolicy, BoxError, Sending};
use tower::Service;

use crate::body::CallerBody;

/// Per request, shared by its attempts (each attempt's body carries it): how many were sent
/// and how long the upstream took, for the access log.
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
fn number_first<B>(req: &mut Request<B>) {
    // One lookup: the name is hashed once whether or not it is there.
    req.headers_mut().entry(&ATTEMPT_HEADER).or_insert(HeaderValue::from_static("1"));
}

/// An attempt for upstream `i > 0` is sent there, path and query kept.
fn failover<B>(upstreams: &[http::Uri], i: usize, req: &mut Request<B>) {
    if i != 0
        && let Some(u) = upstreams.get(i)
    {
        let mut parts = u.clone().into_parts();
        parts.path_and_query = req.uri().path_and_query().cloned();
        if let Ok(uri) = http::Uri::from_parts(parts) {
            *req.uri_mut() = uri;
        }
    }
}

/// On a gRPC request: the time left as `grpc-timeout` (never above the caller's), and `te:
/// trailers` restored (removed with the hop-by-hop headers; gRPC servers require it).
fn grpc_deadline<B>(time_left: Option<Duration>, req: &mut Request<B>) {
    if crate::grpc::is_grpc_request(req.headers()) {
        req.headers_mut().insert(http::header::TE, HeaderValue::from_static("trailers"));
        if let Some(left) = time_left {
            crate::grpc::propagate(req.headers_mut(), left);
        }
    }
}

/// An attempt's body: the caller's, copied while sent for the attempts after it
/// ([`ReplayBody`]), with the request's [`AttemptLog`], which each copy carries to its attempt.
pub struct OutgoingBody {
    body: ReplayBody<CallerBody>,
    log: AttemptLog,
}

impl OutgoingBody {
    /// The caller's body, sent with `log`; copied for retries up to `limit` bytes.
    pub(crate) fn new(body: CallerBody, limit: usize, log: AttemptLog) -> OutgoingBody {
        OutgoingBody { body: ReplayBody::new(body, limit), log }
    }
}

impl Body for OutgoingBody {
    type Data = Bytes;
    type Error = ReplayError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, ReplayError>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

/// The layer's policy for the proxy's requests: a body is copied as [`ReplayBody`] copies it,
/// and an attempt is readied as the layer sends it — counted in its request's [`AttemptLog`]
/// (with its slot wait), numbered, pointed at the upstream the request's life chose, told its
/// gRPC deadline.
#[derive(Clone)]
pub(crate) struct ProxyPolicy {
    pub(crate) upstreams: Arc<[http::Uri]>,
}

impl AttemptPolicy<OutgoingBody> for ProxyPolicy {
    fn clone_body(&self, body: &OutgoingBody) -> Option<OutgoingBody> {
        Some(OutgoingBody { body: body.body.clone(), log: body.log.clone() })
    }

    fn is_replayable(&self, body: &OutgoingBody) -> bool {
        body.body.is_replayable()
    }

    fn sending(&self, req: &mut Request<OutgoingBody>, attempt: Sending) {
        let log = &req.body().log.0;
        log.attempts.fetch_add(1, Ordering::Relaxed);
        log.target.store(attempt.target, Ordering::Relaxed);
        if let Some(waited) = attempt.slot_wait {
            let us = u64::try_from(waited.as_micros()).unwrap_or(u64::MAX);
            log.slot_wait_us.fetch_add(us, Ordering::Relaxed);
        }
        number_first(req);
        failover(&self.upstreams, attempt.target, req);
        grpc_deadline(attempt.time_left, req);
    }
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

/// An attempt's request (the stack's `UpstreamRequest`).
type Outgoing = Request<OutgoingBody>;

/// What happens to an attempt under the cap once [`ProxyPolicy`] readied it, as one service and
/// one future (each step used to be a layer of its own, each moving the request in and the
/// response out): its cap held under the HTTP/2 peer's streams, the upstream's time to response
/// headers in the request's [`AttemptLog`]; then the answer: an unsolicited upgrade refused, an
/// OpenAI 429's body read for a spent quota.
#[derive(Clone)]
pub(crate) struct Attempt {
    pub(crate) client: crate::upstream::UpstreamClient,
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
        let log = Some(req.body().log.clone());
        let started = Instant::now();
        // The upstream [`ProxyPolicy::sending`] just logged for this attempt.
        self.peer.apply(&self.dependency, req.body().log.target());
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
