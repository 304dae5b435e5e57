//! What failed, and which failures a dependency's `retry_on` covers.
//!
//! A retry policy names the conditions it retries with the same tokens everywhere (flags,
//! config, docs): `connect-failure`, `refused-stream`, `reset`, `timeout` (the per-try timeout),
//! `5xx`, `gateway-error` (502, 503, 504), `429`, any listed status code (`409`), and gRPC codes
//! by name (`unavailable`, `resource-exhausted`, `deadline-exceeded`, …). The default is
//! [`defaults::RETRY_ON`](crate::defaults::RETRY_ON),
//! `5xx,reset,connect-failure,refused-stream,timeout`: a timeout, a reset or a 5xx is retried
//! only for an idempotent request, since the request may have run (the retry decision refuses
//! the rest as `non-idempotent`).
//!
//! ```
//! use stormguard_core::conditions::{AttemptFailure, RetryOn};
//!
//! let retry_on: RetryOn = "gateway-error,reset".parse()?;
//! assert!(retry_on.matches(AttemptFailure::Status(503)));
//! assert!(!retry_on.matches(AttemptFailure::Status(500)));
//! assert!(RetryOn::default().matches(AttemptFailure::Timeout));
//! assert!(!RetryOn::default().matches(AttemptFailure::Status(429)));
//! # Ok::<(), stormguard_core::conditions::UnknownCondition>(())
//! ```

use std::fmt;
use std::str::FromStr;

use crate::budget::FailureKind;

/// How an attempt failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AttemptFailure {
    /// The connection could not be made: the request was never sent.
    ConnectFailure,
    /// HTTP/2 REFUSED_STREAM, or a GOAWAY whose last-stream-id is below the stream: never
    /// processed.
    RefusedStream,
    /// The connection or stream was reset after the request was (perhaps) written.
    Reset,
    /// The per-try timeout expired before response headers.
    Timeout,
    /// A response with this HTTP status (only failures are passed here: 4xx and 5xx).
    Status(u16),
    /// A gRPC status code other than OK (from `grpc-status`).
    Grpc(u8),
    /// The dependency's answer was not valid HTTP (a malformed status line or header, headers
    /// past the client's limit, an unsolicited `101`). Deterministic: no `retry_on` condition
    /// matches it, so it is never retried; the breaker counts it (the dependency is broken).
    Protocol,
    /// A failure the caller's own classifier called worth retrying, outside HTTP (the closure
    /// API: a deadlock, a serialization failure, an unavailable service): it may have run, so
    /// only an idempotent call is retried unless the classifier says it never took effect.
    /// Every `retry_on` but an empty one covers it — the classifier is its condition.
    Transient,
}

/// gRPC's status codes by name, in code order (0 is OK).
pub const GRPC_CODES: [&str; 17] = [
    "ok",
    "cancelled",
    "unknown",
    "invalid-argument",
    "deadline-exceeded",
    "not-found",
    "already-exists",
    "permission-denied",
    "resource-exhausted",
    "failed-precondition",
    "aborted",
    "out-of-range",
    "unimplemented",
    "internal",
    "unavailable",
    "data-loss",
    "unauthenticated",
];

impl AttemptFailure {
    /// The budget's view of it: a throttle (429, RESOURCE_EXHAUSTED), a timeout, or an error.
    pub fn kind(self) -> FailureKind {
        match self {
            AttemptFailure::Timeout => FailureKind::Timeout,
            AttemptFailure::Status(429) | AttemptFailure::Grpc(8) => FailureKind::Throttle,
            _ => FailureKind::Error,
        }
    }

    /// Whether the request provably never reached the dependency's application, so even a
    /// non-idempotent request may be retried.
    pub fn provably_unsent(self) -> bool {
        matches!(self, AttemptFailure::ConnectFailure | AttemptFailure::RefusedStream)
    }

    /// Whether the breaker counts it: the dependency failed (connect failure, reset, timeout,
    /// 5xx, or a gRPC server error). 4xx, 429 and refused streams never count, so one tenant's
    /// bad requests cannot open the breaker for everyone.
    pub fn counts_for_breaker(self) -> bool {
        match self {
            AttemptFailure::ConnectFailure
            | AttemptFailure::Reset
            | AttemptFailure::Timeout
            | AttemptFailure::Protocol
            | AttemptFailure::Transient => true,
            AttemptFailure::Status(s) => (500..600).contains(&s),
            // UNKNOWN, INTERNAL, UNAVAILABLE, DATA_LOSS, DEADLINE_EXCEEDED.
            AttemptFailure::Grpc(c) => matches!(c, 2 | 4 | 13 | 14 | 15),
            AttemptFailure::RefusedStream => false,
        }
    }
}

impl fmt::Display for AttemptFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AttemptFailure::ConnectFailure => f.write_str("connect-failure"),
            AttemptFailure::RefusedStream => f.write_str("refused-stream"),
            AttemptFailure::Reset => f.write_str("reset"),
            AttemptFailure::Timeout => f.write_str("timeout"),
            AttemptFailure::Protocol => f.write_str("protocol"),
            AttemptFailure::Transient => f.write_str("transient"),
            AttemptFailure::Status(s) => write!(f, "{s}"),
            AttemptFailure::Grpc(c) => {
                f.write_str(GRPC_CODES.get(usize::from(*c)).copied().unwrap_or("grpc-unknown-code"))
            }
        }
    }
}

const CONNECT: u16 = 1;
const REFUSED: u16 = 1 << 1;
const RESET: u16 = 1 << 2;
const TIMEOUT: u16 = 1 << 3;
const ANY_5XX: u16 = 1 << 4;
const GATEWAY: u16 = 1 << 5;

/// The set of conditions a policy retries.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct RetryOn {
    flags: u16,
    statuses: Vec<u16>,
    /// Bit `c` set: gRPC code `c` is retried.
    grpc: u32,
}

impl Default for RetryOn {
    /// [`defaults::RETRY_ON`](crate::defaults::RETRY_ON):
    /// `5xx,reset,connect-failure,refused-stream,timeout`.
    fn default() -> Self {
        crate::defaults::RETRY_ON.parse().expect("defaults::RETRY_ON is a valid retry_on")
    }
}

/// A `retry_on` token that is not a condition.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "`{0}` is not a retry condition (expected connect-failure, refused-stream, reset, timeout, \
     5xx, gateway-error, 429, a status code 400-599, or a gRPC code name such as unavailable)"
)]
pub struct UnknownCondition(pub String);

impl RetryOn {
    /// Retries nothing.
    pub fn none() -> RetryOn {
        RetryOn { flags: 0, statuses: Vec::new(), grpc: 0 }
    }

    /// Whether `failure` is one of the conditions.
    pub fn matches(&self, failure: AttemptFailure) -> bool {
        match failure {
            AttemptFailure::ConnectFailure => self.flags & CONNECT != 0,
            AttemptFailure::RefusedStream => self.flags & REFUSED != 0,
            AttemptFailure::Reset => self.flags & RESET != 0,
            AttemptFailure::Timeout => self.flags & TIMEOUT != 0,
            AttemptFailure::Status(s) => {
                ((500..600).contains(&s) && self.flags & ANY_5XX != 0)
                    || (matches!(s, 502..=504) && self.flags & GATEWAY != 0)
                    || self.statuses.contains(&s)
            }
            AttemptFailure::Grpc(c) => c < 32 && self.grpc & (1 << c) != 0,
            AttemptFailure::Protocol => false,
            AttemptFailure::Transient => *self != RetryOn::none(),
        }
    }

    fn add(&mut self, token: &str) -> Result<(), UnknownCondition> {
        let unknown = || UnknownCondition(token.to_string());
        match token {
            "connect-failure" => self.flags |= CONNECT,
            "refused-stream" => self.flags |= REFUSED,
            "reset" => self.flags |= RESET,
            "timeout" => self.flags |= TIMEOUT,
            "5xx" => self.flags |= ANY_5XX,
            "gateway-error" => self.flags |= GATEWAY,
            t if t.bytes().all(|b| b.is_ascii_digit()) => {
                let s: u16 = t.parse().map_err(|_| unknown())?;
                if !(400..600).contains(&s) {
                    return Err(unknown());
                }
                if !self.statuses.contains(&s) {
                    self.statuses.push(s);
                }
            }
            t => {
                let name = t.replace('_', "-");
                let code = GRPC_CODES.iter().position(|c| *c == name).filter(|c| *c != 0);
                self.grpc |= 1 << code.ok_or_else(unknown)?;
            }
        }
        Ok(())
    }
}

impl FromStr for RetryOn {
    type Err = UnknownCondition;

    /// Comma-separated tokens; an empty string retries nothing.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let mut r = RetryOn::none();
        for token in s.split(',').map(str::trim).filter(|t| !t.is_empty()) {
            r.add(&token.to_ascii_lowercase())?;
        }
        Ok(r)
    }
}

impl fmt::Display for RetryOn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut parts: Vec<String> = [
            (ANY_5XX, "5xx"),
            (GATEWAY, "gateway-error"),
            (RESET, "reset"),
            (CONNECT, "connect-failure"),
            (REFUSED, "refused-stream"),
            (TIMEOUT, "timeout"),
        ]
        .iter()
        .filter(|(bit, _)| self.flags & bit != 0)
        .map(|(_, name)| name.to_string())
        .collect();
        parts.extend(self.statuses.iter().map(u16::to_string));
        parts.extend(
            (1..GRPC_CODES.len())
                .filter(|c| self.grpc & (1 << c) != 0)
                .map(|c| GRPC_CODES[c].into()),
        );
        f.write_str(&parts.join(","))
    }
}

#[cfg(all(test, not(stormguard_loom)))]
mod tests {
    use super::*;

    #[test]
    fn tokens() {
        let r: RetryOn = "timeout,429,409,unavailable,RESOURCE_EXHAUSTED".parse().unwrap();
        assert!(r.matches(AttemptFailure::Timeout));
        assert!(r.matches(AttemptFailure::Status(429)));
        assert!(r.matches(AttemptFailure::Status(409)));
        assert!(!r.matches(AttemptFailure::Status(500)));
        assert!(r.matches(AttemptFailure::Grpc(14)));
        assert!(r.matches(AttemptFailure::Grpc(8)));
        assert!(!r.matches(AttemptFailure::Reset));
        let d = RetryOn::default();
        assert!(d.matches(AttemptFailure::Status(500)) && d.matches(AttemptFailure::Status(599)));
        assert!(!d.matches(AttemptFailure::Status(429)));
        assert!(d.matches(AttemptFailure::Timeout));
        assert_eq!(d.to_string(), "5xx,reset,connect-failure,refused-stream,timeout");
        assert_eq!(d.to_string().parse::<RetryOn>().unwrap(), d);
        assert!("".parse::<RetryOn>().unwrap() == RetryOn::none());
    }

    #[test]
    fn unknown_tokens_are_refused() {
        for bad in ["5XXX", "200", "999", "slow", "ok"] {
            assert!(bad.parse::<RetryOn>().is_err(), "{bad}");
        }
    }

    #[test]
    fn a_classifiers_transient_failure_is_covered_unless_retries_are_off() {
        assert!(RetryOn::default().matches(AttemptFailure::Transient));
        assert!("429".parse::<RetryOn>().unwrap().matches(AttemptFailure::Transient));
        assert!(!RetryOn::none().matches(AttemptFailure::Transient));
        assert_eq!(AttemptFailure::Transient.to_string(), "transient");
        assert!(!AttemptFailure::Transient.provably_unsent());
    }

    #[test]
    fn kinds_and_breaker() {
        assert_eq!(AttemptFailure::Status(429).kind(), FailureKind::Throttle);
        assert_eq!(AttemptFailure::Timeout.kind(), FailureKind::Timeout);
        assert!(!AttemptFailure::Status(429).counts_for_breaker());
        assert!(!AttemptFailure::Status(404).counts_for_breaker());
        assert!(AttemptFailure::Status(503).counts_for_breaker());
        assert!(AttemptFailure::ConnectFailure.provably_unsent());
        assert!(!AttemptFailure::Reset.provably_unsent());
    }
}
