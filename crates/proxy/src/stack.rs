//! The per-dependency middleware stack, assembled in one function that reads top to bottom.

use std::sync::Arc;

use bytes::Bytes;
use http::{HeaderValue, Response, StatusCode};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full};
use stormguard_core::Denied;
use stormguard_tower::{BoxError, Dependency, Stormguard, StormguardError, StormguardLayer};
use tower::Layer;

use crate::attempt::{self, ProxyPolicy};
use crate::config::ProxyDependency;
use crate::hop::strip_hop_by_hop;
pub use crate::upstream::UpstreamClient;

/// The body the proxy answers with.
pub type ProxyBody = UnsyncBoxBody<Bytes, BoxError>;

/// A response extension: the proxy wrote the response itself ([`local`]), it was not relayed
/// from an upstream.
#[derive(Clone, Copy, Debug)]
pub(crate) struct LocalAnswer;
/// One dependency's stack: stormguard's layer over the attempt (cloned per request: its parts
/// are shared, nothing is allocated). Its answer becomes the caller's with [`relayed`], its
/// error with [`refusal`].
pub(crate) type ProxyService = Stormguard<attempt::Attempt, ProxyPolicy>;

/// The header that carries the reason stormguard refused (a primary) or did not retry.
pub static DENIED_HEADER: http::HeaderName = http::HeaderName::from_static("x-stormguard-denied");
/// The header that says what failed below HTTP when the proxy answers 502 or 504 itself.
pub static ERROR_HEADER: http::HeaderName = http::HeaderName::from_static("x-stormguard-error");

/// The upstream client of a dependency (see [`crate::upstream`]): HTTP/1.1 with a pool of at
/// least `cap` idle connections, HTTP/2 with the cap held under the peer's streams, TLS for
/// `https://`. The error names the key of a TLS file that cannot be used.
pub fn client(dep: &ProxyDependency) -> Result<UpstreamClient, crate::upstream::TlsError> {
    crate::upstream::client(dep)
}

/// The stack of one dependency: the request's life, every attempt under the cap with its
/// per-try timeout (connect time counts; a retry takes its slot now or never, so it can never
/// queue), each readied as it is sent ([`ProxyPolicy`]: counted for the access log, numbered,
/// sent to the upstream the request's life chose, told its gRPC deadline); below the cap, one
/// service and one future per attempt, seeing exactly what the upstream sees: its cap held under
/// the HTTP/2 peer's streams, timed, an OpenAI 429's body read for a spent quota, an upgrade
/// nobody asked for refused. The caller's answer is the upstream's ([`relayed`]) or the
/// proxy's own ([`refusal`]).
pub fn stack(
    dependency: &Dependency,
    client: UpstreamClient,
    upstreams: Arc<[http::Uri]>,
) -> ProxyService {
    let peer = client.peer_streams();
    // Each HTTP/2 peer's stream limit lowers its upstream's cap.
    peer.attach(dependency);
    let dep = dependency.clone();
    let provider = dependency.config().rate.provider;
    StormguardLayer::new(dependency.clone())
        .with_policy(ProxyPolicy { upstreams })
        .layer(attempt::Attempt { client, peer, dependency: dep, provider })
}

/// The upstream's answer as the caller gets it: hop-by-hop headers removed, a refused retry's
/// reason in `x-stormguard-denied` (and typed in the extensions, for the edge). Its body is read
/// ahead at the edge (the relay), which also answers `502` for a body that breaks before
/// anything of it arrived.
pub(crate) fn relayed<B>(mut resp: Response<B>) -> Response<B> {
    strip_hop_by_hop(resp.headers_mut());
    if let Some(reason) = resp.extensions().get::<Denied>().copied() {
        resp.headers_mut().insert(DENIED_HEADER.clone(), HeaderValue::from_static(reason.as_str()));
    }
    resp
}

/// The proxy's own answer when the stack gives none: stormguard's refusals and the failures below
/// HTTP as responses (503, 504, 502 with the reason), so every caller gets exactly one answer.
pub(crate) fn refusal(
    e: &(dyn std::error::Error + Send + Sync + 'static),
    provider: Option<stormguard_tower::Provider>,
) -> Response<ProxyBody> {
    match e.downcast_ref::<StormguardError>() {
        // A first try refused for the provider's window is a rate limit, said as one: 429, in
        // the provider's own error shape, so an SDK raises its rate-limit error (the advice
        // headers, `Retry-After` included, are added at the edge).
        Some(StormguardError::Denied(Denied::Rate)) => rate_refusal(provider),
        Some(StormguardError::Denied(reason)) => {
            let status = if *reason == Denied::Deadline {
                StatusCode::GATEWAY_TIMEOUT
            } else {
                StatusCode::SERVICE_UNAVAILABLE
            };
            local(status, Some(Why::Denied(*reason)), &format!("stormguard: refused ({reason})\n"))
        }
        // The caller's own body failed during the attempt: the caller's failure.
        Some(StormguardError::CallerBody { source }) => {
            match crate::body::caller_body_error(&**source) {
                Some(e) => caller_body_answer(e),
                // The per-try timeout passed while the caller was still sending.
                None => local(
                    StatusCode::REQUEST_TIMEOUT,
                    Some(Why::Error(LocalError::BodyTimeout)),
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
            resp.extensions_mut().insert(*reason);
            resp
        }
        _ => failed(e),
    }
}

/// The answer to a caller whose request body failed: `408` (`x-stormguard-error:
/// body-timeout`) when it stalled, `400` (`body-malformed`) when it broke. The connection is
/// closed after it: what is left of the body cannot be read as a request.
pub fn caller_body_answer(e: &crate::body::CallerBodyError) -> Response<ProxyBody> {
    let (status, kind) = if e.timed_out() {
        (StatusCode::REQUEST_TIMEOUT, LocalError::BodyTimeout)
    } else {
        (StatusCode::BAD_REQUEST, LocalError::BodyMalformed)
    };
    let mut resp = local(status, Some(Why::Error(kind)), &format!("stormguard: {e}\n"));
    resp.headers_mut().insert(http::header::CONNECTION, HeaderValue::from_static("close"));
    resp
}

/// The proxy's answer to an attempt that failed below HTTP: 504 after the per-try timeout,
/// 502 otherwise, with what failed in `x-stormguard-error`.
pub(crate) fn failed(e: &(dyn std::error::Error + Send + Sync + 'static)) -> Response<ProxyBody> {
    if let Some(StormguardError::Timeout) = e.downcast_ref::<StormguardError>() {
        return local(
            StatusCode::GATEWAY_TIMEOUT,
            Some(Why::Error(LocalError::Timeout)),
            "stormguard: the upstream did not answer within the per-try timeout\n",
        );
    }
    let kind = match stormguard_tower::error::classify_error(e) {
        // A failed handshake is a connect failure (nothing was sent) that the caller is told
        // apart: retrying will not fix a certificate.
        stormguard_http::classify::TransportError::Connect if crate::upstream::is_tls_error(e) => {
            LocalError::Tls
        }
        stormguard_http::classify::TransportError::Connect => LocalError::ConnectFailure,
        stormguard_http::classify::TransportError::Timeout => LocalError::Timeout,
        stormguard_http::classify::TransportError::Protocol => LocalError::Protocol,
        _ => LocalError::Reset,
    };
    tracing::debug!(error = %e, "upstream failed");
    local(
        StatusCode::BAD_GATEWAY,
        Some(Why::Error(kind)),
        &format!("stormguard: upstream {}\n", kind.as_str()),
    )
}

/// stormguard's refusal for the provider's window: `429` with `x-stormguard-denied: rate`, its
/// body in the shape the provider's own 429 has (OpenAI's `rate_limit_exceeded`, Anthropic's
/// `rate_limit_error`), plain text otherwise.
fn rate_refusal(provider: Option<stormguard_tower::Provider>) -> Response<ProxyBody> {
    use stormguard_tower::Provider;
    const MESSAGE: &str =
        "stormguard: refused (rate): the provider's rate limit leaves no room for this request now";
    let json = match provider {
        Some(Provider::OpenAi) => Some(format!(
            r#"{{"error":{{"message":"{MESSAGE}","type":"requests","param":null,"code":"rate_limit_exceeded"}}}}"#
        )),
        Some(Provider::Anthropic) => Some(format!(
            r#"{{"type":"error","error":{{"type":"rate_limit_error","message":"{MESSAGE}"}}}}"#
        )),
        _ => None,
    };
    let mut resp = local(
        StatusCode::TOO_MANY_REQUESTS,
        Some(Why::Denied(Denied::Rate)),
        &json.clone().unwrap_or_else(|| format!("{MESSAGE}\n")),
    );
    if json.is_some() {
        resp.headers_mut()
            .insert(http::header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    }
    resp
}

/// A response the proxy makes itself.
pub fn local(status: StatusCode, why: Option<Why>, body: &str) -> Response<ProxyBody> {
    let mut resp = Response::new(
        Full::new(Bytes::from(body.to_string())).map_err(|never| match never {}).boxed_unsync(),
    );
    *resp.status_mut() = status;
    resp.headers_mut()
        .insert(http::header::CONTENT_TYPE, HeaderValue::from_static("text/plain; charset=utf-8"));
    match why {
        Some(Why::Denied(reason)) => {
            resp.headers_mut()
                .insert(DENIED_HEADER.clone(), HeaderValue::from_static(reason.as_str()));
            resp.extensions_mut().insert(reason);
        }
        Some(Why::Error(kind)) => {
            resp.headers_mut()
                .insert(ERROR_HEADER.clone(), HeaderValue::from_static(kind.as_str()));
            resp.extensions_mut().insert(kind);
        }
        None => {}
    }
    resp.extensions_mut().insert(LocalAnswer);
    resp
}

/// Why the proxy answered itself, typed: the header it writes for the caller
/// (`x-stormguard-denied` or `x-stormguard-error`), and the same value in the response's
/// extensions, which the edge reads (the access log, the caller-retry table, pushback advice)
/// instead of parsing the header back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Why {
    /// stormguard refused: the request, or the retry of its last failure.
    Denied(Denied),
    /// What failed below HTTP, or the caller's body.
    Error(LocalError),
}

/// What failed when the proxy answers `502`, `504`, `408` or `400` itself: the value of
/// `x-stormguard-error`, and a response extension.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LocalError {
    /// The caller's request body stalled past `body_idle_timeout`, or was still arriving when
    /// the per-try timeout passed (`408`).
    BodyTimeout,
    /// The caller's request body broke (`400`).
    BodyMalformed,
    /// The upstream did not answer in time (`504`).
    Timeout,
    /// The TLS handshake with the upstream failed (`502`).
    Tls,
    /// The upstream could not be reached (`502`).
    ConnectFailure,
    /// The upstream broke HTTP (`502`).
    Protocol,
    /// The connection to the upstream was reset (`502`).
    Reset,
}

impl LocalError {
    /// The header's value.
    pub fn as_str(self) -> &'static str {
        match self {
            LocalError::BodyTimeout => "body-timeout",
            LocalError::BodyMalformed => "body-malformed",
            LocalError::Timeout => "timeout",
            LocalError::Tls => "tls",
            LocalError::ConnectFailure => "connect-failure",
            LocalError::Protocol => "protocol",
            LocalError::Reset => "reset",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;
    use stormguard_tower::Provider;

    async fn body(r: Response<ProxyBody>) -> String {
        let b = r.into_body().collect().await.unwrap().to_bytes();
        String::from_utf8(b.to_vec()).unwrap()
    }

    /// Each provider's SDK reads its own 429 shape: the refusal is in it, and is JSON.
    #[tokio::test]
    async fn a_rate_refusal_has_the_providers_shape() {
        for (provider, has) in [
            (Some(Provider::OpenAi), r#""code":"rate_limit_exceeded""#),
            (Some(Provider::Anthropic), r#""type":"rate_limit_error""#),
            (None, "refused (rate)"),
        ] {
            let r = rate_refusal(provider);
            assert_eq!(r.status(), StatusCode::TOO_MANY_REQUESTS);
            assert_eq!(r.headers()[&DENIED_HEADER], "rate");
            let json = provider.is_some();
            let text = body(r).await;
            assert!(text.contains(has), "{text}");
            if json {
                serde_json::from_str::<serde_json::Value>(&text).expect("valid JSON");
            }
        }
    }
}
