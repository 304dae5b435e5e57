//! Which `retry_on` condition a response or a transport error is, and whether a request may be
//! sent twice.
//!
//! A retry is only safe if sending the request twice does no harm. Idempotent methods (GET,
//! HEAD, OPTIONS, TRACE, PUT, DELETE), a request carrying an idempotency key, or a route or
//! method marked `idempotent = true` (every gRPC call is a POST) may be retried. Anything else is
//! retried only when it provably never reached the dependency: a connect failure, HTTP/2
//! REFUSED_STREAM, or a GOAWAY whose last-stream-id is below the stream. A reset or a timeout
//! after the request was written is not proof: a budget must never buy a double payment.
//!
//! ```
//! use http::{HeaderMap, Method, StatusCode};
//! use stormguard_core::conditions::AttemptFailure;
//! use stormguard_http::classify::{classify_response, is_idempotent, IDEMPOTENCY_KEY};
//!
//! assert_eq!(classify_response(StatusCode::SERVICE_UNAVAILABLE, &HeaderMap::new()),
//!            Some(AttemptFailure::Status(503)));
//! assert_eq!(classify_response(StatusCode::OK, &HeaderMap::new()), None);
//!
//! let mut headers = HeaderMap::new();
//! assert!(!is_idempotent(&Method::POST, &headers, &IDEMPOTENCY_KEY, false));
//! headers.insert("idempotency-key", "order-7".parse().unwrap());
//! assert!(is_idempotent(&Method::POST, &headers, &IDEMPOTENCY_KEY, false));
//! ```

use http::header::{CONTENT_TYPE, HeaderName};
use http::{HeaderMap, Method, StatusCode};
use stormguard_core::conditions::AttemptFailure;

/// The default idempotency key header.
pub static IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");

/// Whether a request may be retried after it may have reached the dependency: an idempotent
/// method, the key header present (non-empty), or a route or method marked idempotent.
pub fn is_idempotent(
    method: &Method,
    headers: &HeaderMap,
    key_header: &HeaderName,
    marked: bool,
) -> bool {
    marked
        || matches!(
            *method,
            Method::GET
                | Method::HEAD
                | Method::OPTIONS
                | Method::TRACE
                | Method::PUT
                | Method::DELETE
        )
        || headers
            .get(key_header)
            .is_some_and(|v| !v.as_bytes().iter().all(u8::is_ascii_whitespace))
}

/// Whether the response is gRPC (`content-type: application/grpc...`).
pub fn is_grpc(headers: &HeaderMap) -> bool {
    headers
        .get(CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|ct| ct.starts_with("application/grpc"))
}

/// The gRPC status in `headers` (response headers of a trailers-only response, or trailers):
/// `Some(code)` for a valid code 0..=16, `None` when absent or malformed.
pub fn grpc_status(headers: &HeaderMap) -> Option<u8> {
    // By name, not text: a lookup by text parses the name before it hashes it.
    static GRPC_STATUS: HeaderName = HeaderName::from_static("grpc-status");
    let v = headers.get(&GRPC_STATUS)?.to_str().ok()?.trim();
    v.parse::<u8>().ok().filter(|c| *c <= 16)
}

/// The failure a response is, or `None` for a success.
///
/// An HTTP status of 400 or more is `Status`. A gRPC response whose headers carry a non-zero
/// `grpc-status` (a trailers-only response, the only gRPC response that may be retried) is
/// `Grpc`, whatever its HTTP status. A gRPC response without `grpc-status` in its headers is
/// streaming: its outcome comes in trailers, after bytes went to the caller, so it is never
/// retried and counts as a success here.
pub fn classify_response(status: StatusCode, headers: &HeaderMap) -> Option<AttemptFailure> {
    if is_grpc(headers)
        && let Some(code) = grpc_status(headers)
    {
        return (code != 0).then_some(AttemptFailure::Grpc(code));
    }
    (status.as_u16() >= 400).then_some(AttemptFailure::Status(status.as_u16()))
}

/// What went wrong below HTTP, as a client reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TransportError {
    /// The connection could not be established (refused, unreachable, TLS handshake failed).
    Connect,
    /// HTTP/2 RST_STREAM with REFUSED_STREAM: the server did not process the stream.
    RefusedStream,
    /// HTTP/2 GOAWAY with this last-stream-id, for a request on `stream_id`.
    GoAway {
        /// The highest stream the server says it may have processed.
        last_stream_id: u32,
        /// The request's stream.
        stream_id: u32,
    },
    /// HTTP/2 GOAWAY reported for a stream the server never took up, by a client that does not
    /// give the stream ids: hyper (through `h2`) reports a graceful GOAWAY (`NO_ERROR`) only to
    /// streams above its last-stream-id and to requests started after it; streams the server
    /// may have processed run on to their answer, or fail as a reset.
    GoAwayUnprocessed,
    /// The connection or stream was reset, or closed before a response.
    Reset,
    /// The per-try timeout expired (connect time included) before response headers.
    Timeout,
    /// The dependency's answer was not valid HTTP: deterministic, never retried.
    Protocol,
}

/// The dependency's answer was not valid HTTP, as a client reports it: wrap a client's parse
/// error in this (or return it for a response no request asked for, such as an unsolicited
/// `101`) so that it is classified [`TransportError::Protocol`] — sending it again would get the
/// same answer.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ProtocolError {
    /// The status line or headers could not be parsed, or were too large.
    #[error("the upstream's answer is not valid HTTP: {0}")]
    Malformed(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// `101 Switching Protocols` to a request that asked for no upgrade.
    #[error("the upstream answered 101 Switching Protocols to a request that asked for no upgrade")]
    UnsolicitedUpgrade,
}

/// The `retry_on` condition of a transport error, and whether it proves the request was never
/// processed (so even a non-idempotent request may be retried).
pub fn classify_transport(error: TransportError) -> (AttemptFailure, bool) {
    match error {
        TransportError::Connect => (AttemptFailure::ConnectFailure, true),
        TransportError::RefusedStream => (AttemptFailure::RefusedStream, true),
        // Streams above last-stream-id were not processed and may be retried; the rest may have.
        TransportError::GoAway { last_stream_id, stream_id } => {
            (AttemptFailure::Reset, stream_id > last_stream_id)
        }
        TransportError::GoAwayUnprocessed => (AttemptFailure::Reset, true),
        TransportError::Reset => (AttemptFailure::Reset, false),
        TransportError::Timeout => (AttemptFailure::Timeout, false),
        TransportError::Protocol => (AttemptFailure::Protocol, false),
    }
}

/// A best-effort reading of an I/O error: connection refused or unreachable is a connect
/// failure (only if no byte was written, which the caller knows); resets and broken pipes are
/// `Reset`; a timeout is `Timeout`.
pub fn classify_io(error: &std::io::Error, before_write: bool) -> TransportError {
    use std::io::ErrorKind::*;
    match error.kind() {
        ConnectionRefused | AddrNotAvailable | NetworkUnreachable | HostUnreachable
            if before_write =>
        {
            TransportError::Connect
        }
        TimedOut | WouldBlock => TransportError::Timeout,
        _ if before_write => TransportError::Connect,
        // What the dependency sent could not be read (hyper's decoder says so of a malformed
        // chunk): the same request would get it again.
        InvalidData | InvalidInput => TransportError::Protocol,
        _ => TransportError::Reset,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn grpc(status: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(CONTENT_TYPE, "application/grpc+proto".parse().unwrap());
        h.insert("grpc-status", status.parse().unwrap());
        h
    }

    #[test]
    fn responses() {
        let none = HeaderMap::new();
        for (code, want) in
            [(200, None), (304, None), (404, Some(404)), (429, Some(429)), (502, Some(502))]
        {
            let s = StatusCode::from_u16(code).unwrap();
            assert_eq!(classify_response(s, &none), want.map(AttemptFailure::Status), "{code}");
        }
        assert_eq!(classify_response(StatusCode::OK, &grpc("14")), Some(AttemptFailure::Grpc(14)));
        assert_eq!(classify_response(StatusCode::OK, &grpc("0")), None);
        // Malformed grpc-status falls back to the HTTP status.
        assert_eq!(classify_response(StatusCode::OK, &grpc("99")), None);
        assert_eq!(classify_response(StatusCode::OK, &grpc("x")), None);
        // grpc-status without a gRPC content type is ignored.
        let mut h = HeaderMap::new();
        h.insert("grpc-status", "14".parse().unwrap());
        assert_eq!(classify_response(StatusCode::OK, &h), None);
    }

    #[test]
    fn idempotency() {
        let h = HeaderMap::new();
        for m in
            [Method::GET, Method::HEAD, Method::OPTIONS, Method::TRACE, Method::PUT, Method::DELETE]
        {
            assert!(is_idempotent(&m, &h, &IDEMPOTENCY_KEY, false), "{m}");
        }
        for m in [Method::POST, Method::PATCH, Method::CONNECT] {
            assert!(!is_idempotent(&m, &h, &IDEMPOTENCY_KEY, false), "{m}");
            assert!(is_idempotent(&m, &h, &IDEMPOTENCY_KEY, true), "{m} marked");
        }
        let mut blank = HeaderMap::new();
        blank.insert("idempotency-key", " ".parse().unwrap());
        assert!(!is_idempotent(&Method::POST, &blank, &IDEMPOTENCY_KEY, false));
        let custom = HeaderName::from_static("x-request-key");
        let mut h = HeaderMap::new();
        h.insert("x-request-key", "k".parse().unwrap());
        assert!(is_idempotent(&Method::POST, &h, &custom, false));
        assert!(!is_idempotent(&Method::POST, &h, &IDEMPOTENCY_KEY, false));
    }

    #[test]
    fn transport() {
        assert_eq!(
            classify_transport(TransportError::Connect),
            (AttemptFailure::ConnectFailure, true)
        );
        assert_eq!(
            classify_transport(TransportError::RefusedStream),
            (AttemptFailure::RefusedStream, true)
        );
        let below = TransportError::GoAway { last_stream_id: 5, stream_id: 7 };
        let at = TransportError::GoAway { last_stream_id: 7, stream_id: 7 };
        assert_eq!(classify_transport(below), (AttemptFailure::Reset, true));
        assert_eq!(classify_transport(at), (AttemptFailure::Reset, false));
        assert_eq!(
            classify_transport(TransportError::GoAwayUnprocessed),
            (AttemptFailure::Reset, true)
        );
        assert_eq!(classify_transport(TransportError::Reset), (AttemptFailure::Reset, false));
        assert_eq!(classify_transport(TransportError::Timeout), (AttemptFailure::Timeout, false));
        let refused = std::io::Error::from(std::io::ErrorKind::ConnectionRefused);
        assert_eq!(classify_io(&refused, true), TransportError::Connect);
        let reset = std::io::Error::from(std::io::ErrorKind::ConnectionReset);
        assert_eq!(classify_io(&reset, false), TransportError::Reset);
    }
}
