//! The errors the stack adds to the inner service's own.

use stormguard_core::Denied;
use stormguard_http::classify::TransportError;

/// A boxed error, as tower services return.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// What stormguard itself reports. The stack's error type is [`BoxError`]; downcast to this.
#[derive(Debug, thiserror::Error)]
pub enum StormguardError {
    /// stormguard refused the attempt (a primary's `queue`, `breaker` or `deadline`; a retry's
    /// reasons are reported on the last response instead, when there is one).
    #[error("refused by stormguard: {0}")]
    Denied(Denied),
    /// The per-try timeout expired before response headers, and no retry followed.
    #[error("attempt timed out before response headers")]
    Timeout,
    /// The last attempt failed below HTTP (a per-try timeout, a transport failure) and its
    /// retry was refused for `reason`: the caller is told why, as for a refused retry after a
    /// failed response (where the reason is in the response's extensions).
    #[error("not retried ({reason}): {source}")]
    NotRetried {
        /// Why the retry was refused.
        reason: Denied,
        /// The last attempt's error: [`StormguardError::Timeout`] or
        /// [`StormguardError::Transport`].
        #[source]
        source: BoxError,
    },
    /// The caller's own request body failed — it ended early, was malformed, or the caller
    /// was still sending it when the per-try timeout passed ([`BodyReceived`](crate::BodyReceived)).
    /// The caller's failure, not the dependency's: the breaker and the budget do not count it,
    /// and it is never retried.
    #[error("the request body failed: {source}")]
    CallerBody {
        /// What failed: the body's error (a [`ReplayError::Body`](stormguard_http::body::ReplayError)
        /// in its chain), or [`CallerTooSlow`].
        #[source]
        source: BoxError,
    },
    /// The inner service failed below HTTP.
    #[error("{kind:?}: {source}")]
    Transport {
        /// How it failed, as the retry decision reads it.
        kind: TransportError,
        /// The inner service's error.
        #[source]
        source: BoxError,
    },
}

impl StormguardError {
    /// The denial reason, if stormguard refused the request, or refused its retry after a
    /// failure below HTTP.
    pub fn denied(&self) -> Option<Denied> {
        match self {
            StormguardError::Denied(d) => Some(*d),
            StormguardError::NotRetried { reason, .. } => Some(*reason),
            _ => None,
        }
    }
}

/// The per-try timeout passed while the caller was still sending its request body.
#[derive(Debug, thiserror::Error)]
#[error("the caller was still sending its request body when the per-try timeout passed")]
pub struct CallerTooSlow;

/// Whether an inner service's error is the caller's own request body failing: a
/// [`ReplayError::Body`](stormguard_http::body::ReplayError::Body) in its source chain (the
/// client reports the error of the body it was sending).
pub fn is_caller_body_error(error: &(dyn std::error::Error + 'static)) -> bool {
    let mut cur = Some(error);
    while let Some(e) = cur {
        if matches!(
            e.downcast_ref::<stormguard_http::body::ReplayError>(),
            Some(stormguard_http::body::ReplayError::Body(_))
        ) || matches!(
            e.downcast_ref::<StormguardError>(),
            Some(StormguardError::CallerBody { .. })
        ) {
            return true;
        }
        cur = e.source();
    }
    false
}

/// Reads an inner service's error: connect failures, resets and timeouts from the `std::io`
/// errors in its source chain, and from what common clients say in their messages ("connect",
/// "connection refused"); HTTP/2 REFUSED_STREAM and a graceful GOAWAY as `h2` words them
/// (hyper's HTTP/2 errors carry the `h2` error). Anything else counts as a reset: it may have
/// reached the dependency, so a non-idempotent request is not retried after it.
pub fn classify_error(error: &(dyn std::error::Error + 'static)) -> TransportError {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(error);
    let mut said_connect = false;
    while let Some(e) = cur {
        if let Some(se) = e.downcast_ref::<StormguardError>() {
            match se {
                StormguardError::Transport { kind, .. } => return *kind,
                StormguardError::Timeout => return TransportError::Timeout,
                StormguardError::Denied(_)
                | StormguardError::NotRetried { .. }
                | StormguardError::CallerBody { .. } => {}
            }
        }
        // The dependency's answer was not valid HTTP: the same request would get it again.
        if e.downcast_ref::<stormguard_http::classify::ProtocolError>().is_some()
            || e.downcast_ref::<hyper::Error>().is_some_and(hyper::Error::is_parse)
        {
            return TransportError::Protocol;
        }
        if let Some(io) = e.downcast_ref::<std::io::Error>() {
            return stormguard_http::classify::classify_io(io, said_connect);
        }
        let text = e.to_string().to_ascii_lowercase();
        // "connect" as a step ("client error (Connect)", "tcp connect error", "connection
        // refused"), not as in "connection error", which hyper reports for a reset.
        if text.contains("(connect)")
            || text.contains("connect error")
            || text.contains("tcp connect")
            || text.contains("connection refused")
            || (text.starts_with("connect") && !text.starts_with("connection"))
        {
            said_connect = true;
        }
        if text.contains("refused_stream") || text.contains("refused stream") {
            return TransportError::RefusedStream;
        }
        // `h2`'s words for a GOAWAY received with NO_ERROR: it reports one only to streams above
        // the last-stream-id (and to requests started after it), never to a stream the server
        // may have processed — those run on, or end as a reset when the connection closes.
        if text.contains("connection error received: not a result of an error") {
            return TransportError::GoAwayUnprocessed;
        }
        cur = e.source();
    }
    if said_connect { TransportError::Connect } else { TransportError::Reset }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("client error (Connect)")]
    struct ConnectErr(#[source] std::io::Error);

    #[derive(Debug, thiserror::Error)]
    #[error("{0}")]
    struct Wrapped(&'static str, #[source] std::io::Error);

    #[test]
    fn reads_the_source_chain() {
        let refused = ConnectErr(std::io::Error::from(std::io::ErrorKind::ConnectionRefused));
        assert_eq!(classify_error(&refused), TransportError::Connect);
        let reset = std::io::Error::from(std::io::ErrorKind::ConnectionReset);
        assert_eq!(classify_error(&reset), TransportError::Reset);
        // hyper's "connection error" around a reset is a reset, not a connect failure.
        let hyper_reset =
            Wrapped("connection error", std::io::Error::from(std::io::ErrorKind::ConnectionReset));
        assert_eq!(classify_error(&hyper_reset), TransportError::Reset);
        let other = std::fmt::Error;
        assert_eq!(classify_error(&other), TransportError::Reset);
    }

    #[derive(Debug, thiserror::Error)]
    #[error("{0}")]
    struct Said(&'static str);

    #[derive(Debug, thiserror::Error)]
    #[error("client error (SendRequest)")]
    struct Outer(#[source] Said);

    /// What hyper's HTTP/2 client reports, as `h2` words it (`h2::Error`'s Display).
    #[test]
    fn reads_h2_refusals() {
        let refused = Outer(Said(
            "stream error received: refused stream before processing any application logic",
        ));
        assert_eq!(classify_error(&refused), TransportError::RefusedStream);
        let graceful = Outer(Said("connection error received: not a result of an error"));
        assert_eq!(classify_error(&graceful), TransportError::GoAwayUnprocessed);
        // A GOAWAY with an error code also reaches streams the server may have processed.
        let failed = Outer(Said("connection error received: unspecific protocol error detected"));
        assert_eq!(classify_error(&failed), TransportError::Reset);
        // Our own GOAWAY (sent, not received) says nothing about the server.
        let ours = Outer(Said("connection error detected: not a result of an error"));
        assert_eq!(classify_error(&ours), TransportError::Reset);
        // Another stream error is a reset.
        let cancel = Outer(Said("stream error received: stream no longer needed"));
        assert_eq!(classify_error(&cancel), TransportError::Reset);
    }
}
