//! One `tracing` span per attempt, named as OpenTelemetry names an HTTP client's resends, so a
//! service that exports its traces (`tracing-opentelemetry`) sees every retry and every refusal
//! in the trace of the request that made it.
//!
//! The layer ([`Stormguard`](crate::Stormguard)) opens a span `stormguard.attempt` (target
//! [`TARGET`], level `INFO`) for each attempt — the first try, each retry, and a retry whose
//! slot was refused when its backoff ended — and enters it while the attempt runs, so the
//! cap's and the inner client's own spans and events are its children. Its fields:
//!
//! | field | value |
//! | --- | --- |
//! | `otel.name`, `http.request.method` | the method (OpenTelemetry names an HTTP client span by its method) |
//! | `otel.kind` | `client` |
//! | `http.request.resend_count` | on a retry only: 1 on the first retry, 2 on the second |
//! | `http.response.status_code` | the status the attempt got |
//! | `error.type` | a failed attempt's failure: the status (`503`), a gRPC code (`unavailable`), or `reset`, `timeout`, `connect-failure`, `refused-stream`, `protocol` |
//! | `server.address`, `server.port` | the request URI's host and port, with one upstream |
//! | `stormguard.dependency` | the dependency's name |
//! | `stormguard.upstream` | with several upstreams, the name of the one this attempt went to |
//! | `stormguard.denied` | the reason stormguard refused: on an attempt that failed, why it was not retried (`budget`, `attempts`, `breaker`, …); on an attempt with no status, why it was refused itself (`queue`, `breaker`, `cap`) |
//!
//! A span ends when its attempt has been judged: at once for a success, after the retry decision
//! for a failure (the backoff is not inside it). Nothing is built when no subscriber wants the
//! span: the macro checks the callsite's interest first, and recording into a disabled span is a
//! no-op.

use stormguard_core::Denied;
use stormguard_core::conditions::AttemptFailure;
use tracing::Span;
use tracing::field::Empty;

use crate::dependency::Dependency;

/// The spans' target, for a filter: `stormguard::attempt=info`.
pub const TARGET: &str = "stormguard::attempt";

/// The span of one attempt of a request (its `method` and `uri`) to upstream `upstream`;
/// `resend_count` is 0 for the first try, n for the nth retry. Disabled when no subscriber
/// wants it (then nothing else is read).
#[inline]
pub fn attempt_span(
    dependency: &Dependency,
    method: &http::Method,
    uri: &http::Uri,
    upstream: usize,
    resend_count: u32,
) -> Span {
    let span = span_for(dependency, method.as_str(), upstream, resend_count);
    if !span.is_disabled() && dependency.config().upstreams.len() <= 1 {
        let port = uri.port_u16().or(match uri.scheme_str() {
            Some("https") => Some(443),
            Some("http") => Some(80),
            _ => None,
        });
        record_server(&span, uri.host(), port);
    }
    span
}

/// [`attempt_span`] for request types other than `http::Request`: the method, the upstream's
/// index and the resend count; add where it goes with [`record_server`].
#[inline]
pub fn span_for(dependency: &Dependency, method: &str, upstream: usize, resend_count: u32) -> Span {
    let span = tracing::info_span!(
        target: "stormguard::attempt",
        "stormguard.attempt",
        otel.name = method,
        otel.kind = "client",
        http.request.method = method,
        http.request.resend_count = Empty,
        http.response.status_code = Empty,
        error.type = Empty,
        server.address = Empty,
        server.port = Empty,
        stormguard.dependency = dependency.name(),
        stormguard.upstream = Empty,
        stormguard.denied = Empty,
    );
    if span.is_disabled() {
        return span;
    }
    if resend_count > 0 {
        span.record("http.request.resend_count", resend_count);
    }
    let upstreams = &dependency.config().upstreams;
    // With several upstreams a failover may rewrite the request below this layer: name the
    // upstream, not a host.
    if upstreams.len() > 1
        && let Some(u) = upstreams.get(upstream)
    {
        span.record("stormguard.upstream", u.name.as_str());
    }
    span
}

/// Records the host and port an attempt goes to (`server.address`, `server.port`).
pub fn record_server(span: &Span, host: Option<&str>, port: Option<u16>) {
    if let Some(host) = host {
        span.record("server.address", host);
    }
    if let Some(port) = port {
        span.record("server.port", port);
    }
}

/// Records the status an attempt got, and its failure if it is one.
#[inline]
pub fn record_response(span: &Span, status: http::StatusCode, failure: Option<AttemptFailure>) {
    span.record("http.response.status_code", status.as_u16());
    if let Some(f) = failure {
        record_failure(span, f);
    }
}

/// Records how an attempt failed (`error.type`).
pub fn record_failure(span: &Span, failure: AttemptFailure) {
    span.record("error.type", tracing::field::display(failure));
}

/// Records why stormguard refused: the attempt's retry, or the attempt itself.
pub fn record_denied(span: &Span, reason: Denied) {
    span.record("stormguard.denied", reason.as_str());
}
