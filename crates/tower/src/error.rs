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

/// Reads an inner service's error by the types in its source chain — never by its message, so a
/// client's new wording cannot change what is retried:
/// - stormguard's own errors, and [`ProtocolError`](stormguard_http::classify::ProtocolError);
/// - hyper: a parse error is [`Protocol`](TransportError::Protocol) (the dependency's answer was
///   not valid HTTP); hyper-util's client error that [`is_connect`] is a connect failure (TLS
///   handshakes included: the connector failed, nothing was sent);
/// - `h2`: `REFUSED_STREAM` from the peer is [`RefusedStream`](TransportError::RefusedStream); a
///   GOAWAY received with `NO_ERROR` is [`GoAwayUnprocessed`](TransportError::GoAwayUnprocessed)
///   (h2 reports a graceful GOAWAY only to streams above its last-stream-id and to requests
///   started after it, never to a stream the server may have processed);
/// - `std::io::Error` by its kind ([`classify_io`](stormguard_http::classify::classify_io)).
///
/// Anything else counts as a reset: it may have reached the dependency, so a non-idempotent
/// request is not retried after it. A client of another kind can wrap its errors in
/// [`StormguardError::Transport`] to say what they are.
///
/// [`is_connect`]: hyper_util::client::legacy::Error::is_connect
pub fn classify_error(error: &(dyn std::error::Error + 'static)) -> TransportError {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(error);
    let mut connecting = false;
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
        if e.downcast_ref::<hyper_util::client::legacy::Error>().is_some_and(|e| e.is_connect()) {
            connecting = true;
        }
        if let Some(h2) = e.downcast_ref::<h2::Error>() {
            if let Some(io) = h2.get_io() {
                return stormguard_http::classify::classify_io(io, connecting);
            }
            return match h2.reason() {
                Some(h2::Reason::REFUSED_STREAM) if !h2.is_library() => {
                    TransportError::RefusedStream
                }
                Some(h2::Reason::NO_ERROR) if h2.is_go_away() && h2.is_remote() => {
                    TransportError::GoAwayUnprocessed
                }
                _ => TransportError::Reset,
            };
        }
        if let Some(io) = e.downcast_ref::<std::io::Error>() {
            return stormguard_http::classify::classify_io(io, connecting);
        }
        cur = e.source();
    }
    if connecting { TransportError::Connect } else { TransportError::Reset }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("{0}")]
    struct Wrapped(&'static str, #[source] Box<dyn std::error::Error + Send + Sync>);

    #[test]
    fn reads_io_errors_through_the_chain() {
        let reset = std::io::Error::from(std::io::ErrorKind::ConnectionReset);
        assert_eq!(classify_error(&reset), TransportError::Reset);
        let wrapped = Wrapped("connection error", Box::new(reset));
        assert_eq!(classify_error(&wrapped), TransportError::Reset);
        let timed_out = Wrapped("x", Box::new(std::io::Error::from(std::io::ErrorKind::TimedOut)));
        assert_eq!(classify_error(&timed_out), TransportError::Timeout);
        // A refusal is a connect failure only when the client says it was connecting: without
        // that, nothing proves the request was not written.
        let refused = std::io::Error::from(std::io::ErrorKind::ConnectionRefused);
        assert_eq!(classify_error(&refused), TransportError::Reset);
        assert_eq!(classify_error(&std::fmt::Error), TransportError::Reset);
    }

    /// The words of an error decide nothing: a message that says "connect" or "refused stream"
    /// is still a reset unless its type says otherwise.
    #[test]
    fn messages_are_not_read() {
        #[derive(Debug, thiserror::Error)]
        #[error("client error (Connect): stream error received: refused stream")]
        struct Says;
        assert_eq!(classify_error(&Says), TransportError::Reset);
    }

    #[test]
    fn reads_h2_reasons() {
        let refused = Wrapped("x", Box::new(h2::Error::from(h2::Reason::REFUSED_STREAM)));
        assert_eq!(classify_error(&refused), TransportError::RefusedStream);
        let cancel = Wrapped("x", Box::new(h2::Error::from(h2::Reason::CANCEL)));
        assert_eq!(classify_error(&cancel), TransportError::Reset);
        // NO_ERROR outside a GOAWAY received from the peer says nothing about the stream.
        let no_error = Wrapped("x", Box::new(h2::Error::from(h2::Reason::NO_ERROR)));
        assert_eq!(classify_error(&no_error), TransportError::Reset);
    }

    #[test]
    fn reads_stormguards_own() {
        let protocol = stormguard_http::classify::ProtocolError::UnsolicitedUpgrade;
        assert_eq!(classify_error(&protocol), TransportError::Protocol);
        let timeout = StormguardError::Timeout;
        assert_eq!(classify_error(&timeout), TransportError::Timeout);
        let said = StormguardError::Transport {
            kind: TransportError::Connect,
            source: Box::new(std::fmt::Error),
        };
        assert_eq!(classify_error(&said), TransportError::Connect);
    }
}
