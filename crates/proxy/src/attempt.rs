//! What happens to each attempt below the cap. As the layer sends it ([`ProxyPolicy`]'s
//! `sending`, with what the layer knows of the attempt — its upstream, the deadline left, its
//! slot wait): counted for the access log ([`AttemptLog`]), numbered, sent to its upstream, told
//! its gRPC deadline. Then one service and one future ([`Attempt`]): its cap held under the
//! HTTP/2 peer's streams, timed, its answer's unsolicited upgrade refused, an OpenAI 429 read for
//! a spent quota.
//!
//! An attempt's request carries no extension map of the proxy's: the request's [`AttemptLog`]
//! travels in its body ([`OutgoingBody`], `crate::outgoing`), copied with it for each attempt,
//! and the layer's facts come typed (`stormguard_tower::Sending`), not as extensions.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use http::{HeaderValue, Request, Response, StatusCode};
use stormguard_http::classify::ProtocolError;
use stormguard_http::stacked::ATTEMPT_HEADER;
use stormguard_tower::{AttemptPolicy, BoxError, Sending};
use tower::Service;

use crate::outgoing::{AttemptLog, OutgoingBody};

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

/// The layer's policy for the proxy's requests: a body is copied as its replay buffer allows
/// ([`OutgoingBody`]), and an attempt is readied as the layer sends it — counted in its
/// request's [`AttemptLog`] (with its slot wait), numbered, pointed at the upstream the
/// request's life chose, told its gRPC deadline.
#[derive(Clone)]
pub(crate) struct ProxyPolicy {
    pub(crate) upstreams: Arc<[http::Uri]>,
}

impl AttemptPolicy<OutgoingBody> for ProxyPolicy {
    fn clone_body(&self, body: &OutgoingBody) -> Option<OutgoingBody> {
        Some(body.clone())
    }

    fn is_replayable(&self, body: &OutgoingBody) -> bool {
        body.is_replayable()
    }

    fn sending(&self, req: &mut Request<OutgoingBody>, attempt: Sending) {
        req.body().log().sent(attempt.target, attempt.slot_wait);
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
        let log = Some(req.body().log().clone());
        let started = Instant::now();
        // The upstream [`ProxyPolicy::sending`] just logged for this attempt.
        self.peer.apply(&self.dependency, req.body().log().target());
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
            l.answered(this.started.elapsed());
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
