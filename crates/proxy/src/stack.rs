//! The per-dependency middleware stack, assembled in one function that reads top to bottom.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Instant;

use crate::body::CallerBody;
use bytes::Bytes;
use http::{HeaderValue, Request, Response, StatusCode};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full};
use stormguard_core::Denied;
use stormguard_http::classify::ProtocolError;
use stormguard_http::stacked::ATTEMPT_HEADER;
use stormguard_tower::{
    BoxError, CapLayer, Dependency, ReplayBody, RetryLayer, StormguardError, TimeLeft,
    UpstreamTarget,
};
use tower::util::BoxCloneSyncService;
use tower::{Service, ServiceBuilder};

use crate::config::DependencyConfig;
use crate::hop::strip_hop_by_hop;
use crate::upstream::PeerStreams;
pub use crate::upstream::UpstreamClient;

/// The body the proxy answers with.
pub type ProxyBody = UnsyncBoxBody<Bytes, BoxError>;
/// A request on its way to the upstream: the caller's body, copied for retries while sent.
pub type UpstreamRequest = Request<ReplayBody<CallerBody>>;
/// One dependency's stack. Refusals and upstream failures are responses; the error is only
/// the client's readiness failing (hyper's client is always ready).
pub type ProxyService = BoxCloneSyncService<UpstreamRequest, Response<ProxyBody>, BoxError>;

/// The header that carries the reason stormguard refused (a primary) or did not retry.
pub static DENIED_HEADER: http::HeaderName = http::HeaderName::from_static("x-stormguard-denied");
/// The header that says what failed below HTTP when the proxy answers 502 or 504 itself.
pub static ERROR_HEADER: http::HeaderName = http::HeaderName::from_static("x-stormguard-error");

/// The upstream client of a dependency (see [`crate::upstream`]): HTTP/1.1 with a pool of at
/// least `cap` idle connections, HTTP/2 with the cap held under the peer's streams, TLS for
/// `https://`. The error names the key of a TLS file that cannot be used.
pub fn client(dep: &DependencyConfig) -> Result<UpstreamClient, crate::upstream::TlsError> {
    crate::upstream::client(dep)
}

/// The stack of one dependency, outermost first.
pub fn stack(
    dependency: &Dependency,
    client: UpstreamClient,
    upstreams: Arc<[http::Uri]>,
) -> ProxyService {
    let peer = client.peer_streams();
    // Each HTTP/2 peer's stream limit lowers its upstream's cap.
    peer.attach(dependency);
    let dep = dependency.clone();
    let svc = ServiceBuilder::new()
        // Outermost: stormguard's own refusals and transport failures become responses (503,
        // 504, 502 with the reason), so every caller gets exactly one answer.
        .then(answer)
        // Retry outside the cap: every attempt takes its own slot, and a retry uses
        // try_acquire, so it can never queue.
        .layer(RetryLayer::new(dependency.clone()))
        // Each attempt notes when it asked the cap for a slot, for the access log's slot wait.
        .map_request(|mut req: UpstreamRequest| {
            req.extensions_mut().insert(AskedForSlot(Instant::now()));
            req
        })
        // The cap around each attempt, with its per-try timeout: connect time counts.
        .layer(CapLayer::new(dependency.clone()))
        // Innermost, so it sees exactly what the upstream sees: every attempt numbered, counted
        // and timed, a gRPC attempt told its deadline, the cap held under the HTTP/2 peer's
        // streams, and an attempt for another upstream sent there.
        .layer(tower::layer::layer_fn(move |inner| Attempts {
            inner,
            peer: peer.clone(),
            dependency: dep.clone(),
            upstreams: upstreams.clone(),
        }))
        .service(client);
    BoxCloneSyncService::new(svc)
}

/// Per request, shared by its attempts (request extensions are copied to each attempt): how
/// many were sent and how long the upstream took, for the access log.
#[derive(Clone, Debug, Default)]
pub struct AttemptLog(Arc<AttemptCounts>);

#[derive(Debug, Default)]
struct AttemptCounts {
    attempts: AtomicU32,
    /// The upstream of the last attempt.
    target: std::sync::atomic::AtomicUsize,
    upstream_us: AtomicU64,
    slot_wait_us: AtomicU64,
}

/// When an attempt asked the cap for its slot.
#[derive(Clone, Copy, Debug)]
struct AskedForSlot(Instant);

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
    pub fn slot_wait(&self) -> std::time::Duration {
        std::time::Duration::from_micros(self.0.slot_wait_us.load(Ordering::Relaxed))
    }

    /// Time the attempts spent waiting for response headers from the upstream.
    pub fn upstream_time(&self) -> std::time::Duration {
        std::time::Duration::from_micros(self.0.upstream_us.load(Ordering::Relaxed))
    }
}

/// Numbers each attempt (`x-stormguard-attempt: 1` on a first try that carries none; the retry
/// layer numbers the retries) and records it in the request's [`AttemptLog`]. On a gRPC
/// request it writes the time left as `grpc-timeout` (never above the caller's) and restores
/// `te: trailers` (removed with the hop-by-hop headers; gRPC servers require it). It keeps the
/// dependency's cap at most the HTTP/2 peer's streams ([`PeerStreams::apply`]).
#[derive(Clone, Debug)]
struct Attempts<S> {
    inner: S,
    /// The dependency's upstreams: an attempt for upstream `i > 0` is sent there.
    upstreams: Arc<[http::Uri]>,
    peer: PeerStreams,
    dependency: Dependency,
}

impl<S, B, RB> Service<Request<B>> for Attempts<S>
where
    S: Service<Request<B>, Response = Response<RB>>,
    S::Future: Send + 'static,
    S::Error: Into<BoxError>,
{
    type Response = S::Response;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<S::Response, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, mut req: Request<B>) -> Self::Future {
        if !req.headers().contains_key(&ATTEMPT_HEADER) {
            req.headers_mut().insert(ATTEMPT_HEADER.clone(), HeaderValue::from_static("1"));
        }
        let target = req.extensions().get::<UpstreamTarget>().map_or(0, |t| t.0);
        if target != 0
            && let Some(u) = self.upstreams.get(target)
        {
            let mut parts = u.clone().into_parts();
            parts.path_and_query = req.uri().path_and_query().cloned();
            if let Ok(uri) = http::Uri::from_parts(parts) {
                *req.uri_mut() = uri;
            }
        }
        if crate::grpc::is_grpc_request(req.headers()) {
            req.headers_mut().insert(http::header::TE, HeaderValue::from_static("trailers"));
            if let Some(TimeLeft(left)) = req.extensions().get::<TimeLeft>().copied() {
                crate::grpc::propagate(req.headers_mut(), left);
            }
        }
        self.peer.apply(&self.dependency, target);
        let log = req.extensions().get::<AttemptLog>().cloned();
        let started = Instant::now();
        if let Some(l) = &log {
            l.0.attempts.fetch_add(1, Ordering::Relaxed);
            l.0.target.store(target, Ordering::Relaxed);
            if let Some(asked) = req.extensions().get::<AskedForSlot>() {
                let us = started.saturating_duration_since(asked.0).as_micros();
                l.0.slot_wait_us
                    .fetch_add(u64::try_from(us).unwrap_or(u64::MAX), Ordering::Relaxed);
            }
        }
        let fut = self.inner.call(req);
        Box::pin(async move {
            let r = fut.await;
            if let Some(l) = log {
                let us = u64::try_from(started.elapsed().as_micros()).unwrap_or(u64::MAX);
                l.0.upstream_us.fetch_add(us, Ordering::Relaxed);
            }
            match r {
                // The proxy forwards no upgrade (`Upgrade` is hop-by-hop): a 101 answers a
                // request nobody made, and relaying it would hand the caller a connection in
                // an unknown protocol.
                Ok(resp) if resp.status() == StatusCode::SWITCHING_PROTOCOLS => {
                    Err(ProtocolError::UnsolicitedUpgrade.into())
                }
                r => r.map_err(Into::into),
            }
        })
    }
}

/// What the caller gets: the upstream's response (hop-by-hop headers removed, a refused
/// retry's reason in `x-stormguard-denied`), or the proxy's own answer.
async fn answer<B>(result: Result<Response<B>, BoxError>) -> Result<Response<ProxyBody>, BoxError>
where
    B: http_body::Body<Data = Bytes, Error = BoxError> + Send + Unpin + 'static,
{
    Ok(match result {
        Ok(resp) => {
            let (mut parts, mut body) = resp.into_parts();
            // The body's first frame, if it is there already: an upstream whose answer breaks
            // before the proxy has sent anything (a malformed first chunk) gets the caller a
            // 502, not a closed connection.
            let first = if body.is_end_stream() {
                Peek::End
            } else {
                std::future::poll_fn(|cx| {
                    Poll::Ready(match Pin::new(&mut body).poll_frame(cx) {
                        Poll::Ready(Some(Ok(f))) => Peek::Frame(f),
                        Poll::Ready(Some(Err(e))) => Peek::Failed(e),
                        Poll::Ready(None) => Peek::End,
                        Poll::Pending => Peek::Pending,
                    })
                })
                .await
            };
            let body = match first {
                Peek::Failed(e) => {
                    tracing::debug!(error = %e, "the upstream's answer broke before it was relayed");
                    return Ok(failed(&*e));
                }
                Peek::Frame(f) => Peeked { first: Some(f), yield_once: false, inner: body },
                Peek::End => Peeked { first: None, yield_once: false, inner: body },
                Peek::Pending => Peeked { first: None, yield_once: true, inner: body },
            };
            strip_hop_by_hop(&mut parts.headers);
            if let Some(reason) = parts.extensions.get::<Denied>().copied() {
                parts
                    .headers
                    .insert(DENIED_HEADER.clone(), HeaderValue::from_static(reason.as_str()));
            }
            Response::from_parts(parts, body.boxed_unsync())
        }
        Err(e) => match e.downcast_ref::<StormguardError>() {
            Some(StormguardError::Denied(reason)) => {
                let status = if *reason == Denied::Deadline {
                    StatusCode::GATEWAY_TIMEOUT
                } else {
                    StatusCode::SERVICE_UNAVAILABLE
                };
                local(
                    status,
                    Some((&DENIED_HEADER, reason.as_str())),
                    &format!("stormguard: refused ({reason})\n"),
                )
            }
            // The caller's own body failed during the attempt: the caller's failure.
            Some(StormguardError::CallerBody { source }) => {
                match crate::body::caller_body_error(&**source) {
                    Some(e) => caller_body_answer(e),
                    // The per-try timeout passed while the caller was still sending.
                    None => local(
                        StatusCode::REQUEST_TIMEOUT,
                        Some((&ERROR_HEADER, "body-timeout")),
                        "stormguard: the request body was still arriving when the per-try timeout passed\n",
                    ),
                }
            }
            // The last attempt failed below HTTP and its retry was refused: the failure's own
            // answer (502/504), with the reason it was not retried, like any refused retry.
            Some(StormguardError::NotRetried { reason, source }) => {
                let mut resp = failed(&**source);
                resp.headers_mut()
                    .insert(DENIED_HEADER.clone(), HeaderValue::from_static(reason.as_str()));
                resp
            }
            _ => failed(&*e),
        },
    })
}

/// The answer to a caller whose request body failed: `408` (`x-stormguard-error:
/// body-timeout`) when it stalled, `400` (`body-malformed`) when it broke. The connection is
/// closed after it: what is left of the body cannot be read as a request.
pub fn caller_body_answer(e: &crate::body::CallerBodyError) -> Response<ProxyBody> {
    let (status, kind) = match e {
        crate::body::CallerBodyError::Stalled(_) => (StatusCode::REQUEST_TIMEOUT, "body-timeout"),
        _ => (StatusCode::BAD_REQUEST, "body-malformed"),
    };
    let mut resp = local(status, Some((&ERROR_HEADER, kind)), &format!("stormguard: {e}\n"));
    resp.headers_mut().insert(http::header::CONNECTION, HeaderValue::from_static("close"));
    resp
}

/// The proxy's answer to an attempt that failed below HTTP: 504 after the per-try timeout,
/// 502 otherwise, with what failed in `x-stormguard-error`.
fn failed(e: &(dyn std::error::Error + Send + Sync + 'static)) -> Response<ProxyBody> {
    if let Some(StormguardError::Timeout) = e.downcast_ref::<StormguardError>() {
        return local(
            StatusCode::GATEWAY_TIMEOUT,
            Some((&ERROR_HEADER, "timeout")),
            "stormguard: the upstream did not answer within the per-try timeout\n",
        );
    }
    let kind = match stormguard_tower::error::classify_error(e) {
        // A failed handshake is a connect failure (nothing was sent) that the caller is told
        // apart: retrying will not fix a certificate.
        stormguard_http::classify::TransportError::Connect if crate::upstream::is_tls_error(e) => {
            "tls"
        }
        stormguard_http::classify::TransportError::Connect => "connect-failure",
        stormguard_http::classify::TransportError::Timeout => "timeout",
        stormguard_http::classify::TransportError::Protocol => "protocol",
        _ => "reset",
    };
    tracing::debug!(error = %e, "upstream failed");
    local(
        StatusCode::BAD_GATEWAY,
        Some((&ERROR_HEADER, kind)),
        &format!("stormguard: upstream {kind}\n"),
    )
}

/// The first frame of an upstream body, looked at before its response is answered.
enum Peek {
    Frame(http_body::Frame<Bytes>),
    Failed(BoxError),
    End,
    Pending,
}

/// An upstream body whose first frame was looked at. When it was not there yet, the first poll
/// yields once, so the response head goes out before anything the body does later: a body that
/// breaks after that cuts the answer short, and never leaves the caller with no answer at all.
struct Peeked<B> {
    first: Option<http_body::Frame<Bytes>>,
    yield_once: bool,
    inner: B,
}

impl<B> http_body::Body for Peeked<B>
where
    B: http_body::Body<Data = Bytes, Error = BoxError> + Unpin,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, BoxError>>> {
        if let Some(f) = self.first.take() {
            return Poll::Ready(Some(Ok(f)));
        }
        if self.yield_once {
            self.yield_once = false;
            cx.waker().wake_by_ref();
            return Poll::Pending;
        }
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.first.is_none() && self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        let first = self.first.as_ref().and_then(|f| f.data_ref()).map_or(0, |d| d.len() as u64);
        let h = self.inner.size_hint();
        let mut s = http_body::SizeHint::new();
        s.set_lower(h.lower() + first);
        if let Some(u) = h.upper() {
            s.set_upper(u + first);
        }
        s
    }
}

/// A response the proxy makes itself.
pub fn local(
    status: StatusCode,
    header: Option<(&http::HeaderName, &'static str)>,
    body: &str,
) -> Response<ProxyBody> {
    let mut resp = Response::new(
        Full::new(Bytes::from(body.to_string())).map_err(|never| match never {}).boxed_unsync(),
    );
    *resp.status_mut() = status;
    resp.headers_mut()
        .insert(http::header::CONTENT_TYPE, HeaderValue::from_static("text/plain; charset=utf-8"));
    if let Some((name, value)) = header {
        resp.headers_mut().insert(name.clone(), HeaderValue::from_static(value));
    }
    resp
}
