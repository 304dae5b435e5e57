//! Pushback and rate-limit headers: what the dependency said, in stormguard-core's terms.
//!
//! A dependency that is shedding load usually says so: how long to stay away (`Retry-After`,
//! `retry-after-ms`, gRPC's `grpc-retry-pushback-ms`), when its rate-limit window reopens
//! (`X-RateLimit-Reset`, `RateLimit-Reset`, provider headers such as
//! `anthropic-ratelimit-requests-reset` or `x-ratelimit-reset-requests`), and how much room it has
//! left (`X-Concurrency-Limit-Limit`, `RateLimit-Remaining`). Retrying before it asked is a retry
//! storm in miniature. But these values come from the network: dates in three formats, resets as
//! unix seconds or as seconds from now or as `6m0s`, and negative, overflowing or years-away values
//! from misconfigured servers. This module turns them into what core understands — a [`Pushback`]
//! and a limit hint ([`LimitInfo`], for [`Limiter::set_limit_hint`]) — and ignores, and counts in
//! [`HeaderStats`], anything it cannot trust. No input makes it panic.
//!
//! Wall-clock dates are converted here, against a `now_wall` the caller passes, so core only ever
//! sees durations from now. Each value has a pure parser (`parse_*`, bytes in, a typed
//! [`Malformed`] reason out); [`PushbackHeaders`] and [`LimitHeaders`] read a whole header map by
//! configured names and formats, and decide what wins when several headers speak. The behaviour,
//! header by header, is listed in `docs/headers.md`.
//!
//! ```
//! use std::time::{Duration, SystemTime};
//! use http::{HeaderMap, HeaderValue, StatusCode};
//! use stormguard_core::backoff::Pushback;
//! use stormguard_http::headers::{
//!     HeaderKind, HeaderStats, LimitHeaders, LimitInfo, PushbackHeaders,
//! };
//!
//! let pushback = PushbackHeaders::default();
//! let stats = HeaderStats::new();
//! // 2025-11-30T12:00:00Z, as the caller's wall clock reads it.
//! let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_764_504_000);
//! let secs = Duration::from_secs;
//!
//! // `Retry-After` counts on 429 and 503.
//! let mut headers = HeaderMap::new();
//! headers.insert("retry-after", HeaderValue::from_static("2"));
//! let read = |h: &HeaderMap, status| pushback.read_pushback(h, status, now, &stats);
//! assert_eq!(read(&headers, StatusCode::TOO_MANY_REQUESTS), Some(Pushback::RetryAfter(secs(2))));
//! assert_eq!(read(&headers, StatusCode::INTERNAL_SERVER_ERROR), None);
//!
//! // A provider's reset, in RFC 3339, becomes a wait from now.
//! let mut headers = HeaderMap::new();
//! let reset = HeaderValue::from_static("2025-11-30T12:00:30Z");
//! headers.insert("anthropic-ratelimit-requests-reset", reset);
//! assert_eq!(read(&headers, StatusCode::TOO_MANY_REQUESTS), Some(Pushback::RetryAfter(secs(30))));
//!
//! // gRPC: a negative pushback means "do not retry", whatever the status.
//! headers.insert("grpc-retry-pushback-ms", HeaderValue::from_static("-1"));
//! assert_eq!(read(&headers, StatusCode::OK), Some(Pushback::DontRetry));
//!
//! // Garbage is ignored, and counted.
//! let mut headers = HeaderMap::new();
//! headers.insert("retry-after", HeaderValue::from_static("soon"));
//! assert_eq!(read(&headers, StatusCode::SERVICE_UNAVAILABLE), None);
//! assert_eq!(stats.snapshot().get(HeaderKind::RetryAfter), 1);
//!
//! // The dependency's own limits: a cap hint, and what is left until the window resets.
//! let mut headers = HeaderMap::new();
//! headers.insert("x-concurrency-limit-limit", HeaderValue::from_static("8"));
//! headers.insert("x-ratelimit-remaining", HeaderValue::from_static("0"));
//! headers.insert("x-ratelimit-reset", HeaderValue::from_static("1764504060")); // unix seconds
//! assert_eq!(
//!     LimitHeaders::default().read_limits(&headers, now, &stats),
//!     LimitInfo { limit: Some(8), remaining: Some(0), reset: Some(secs(60)) }
//! );
//! ```
//!
//! [`Limiter::set_limit_hint`]: stormguard_core::limiter::Limiter::set_limit_hint

use std::fmt;
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use http::{HeaderMap, HeaderName, StatusCode};
use stormguard_core::backoff::Pushback;
use stormguard_core::decimal::{Decimal, Digits, DurationError, DurationSyntax, read_duration};

/// The default `max_plausible`: a wait more than a year away is garbage (a unix time in
/// milliseconds read as seconds, a date in year 9999), not a rate-limit window.
pub const DEFAULT_MAX_PLAUSIBLE: Duration = Duration::from_secs(366 * 86_400);
/// The largest `max_plausible` a config may have: a hundred years.
pub const LONGEST_MAX_PLAUSIBLE: Duration = Duration::from_secs(100 * 365 * 86_400);
/// For [`ResetFormat::UnixOrDelta`]: values at or above this (2001-09-09T01:46:40Z) are unix
/// seconds, smaller ones are seconds from now.
pub const UNIX_THRESHOLD: u64 = 1_000_000_000;

const NANOS_PER_SEC: u64 = 1_000_000_000;
const NANOS_PER_MILLI: u64 = 1_000_000;

/// Why a header value was not used.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, thiserror::Error)]
#[non_exhaustive]
pub enum Malformed {
    /// Nothing but whitespace.
    #[error("empty value")]
    Empty,
    /// Not the number the header should hold.
    #[error("not a number")]
    NotANumber,
    /// A negative number where only non-negative ones mean something.
    #[error("negative value")]
    Negative,
    /// Too large to represent (more than `u64`).
    #[error("value too large to represent")]
    Overflow,
    /// A wait further away than `max_plausible`: garbage, not a rate-limit window.
    #[error("further away than max_plausible")]
    TooFar,
    /// Not an HTTP-date (IMF-fixdate, RFC 850 or asctime form).
    #[error("not an http-date")]
    BadHttpDate,
    /// Not an RFC 3339 date-time.
    #[error("not an rfc 3339 date-time")]
    BadRfc3339,
    /// Not a Go-style duration such as `6m0s`.
    #[error("not a duration such as 6m0s")]
    BadDuration,
}

mod lex;
mod limits;
mod parse;
mod pushback;
mod stats;
#[cfg(test)]
mod tests;
mod time;

use lex::*;
pub use limits::*;
pub use parse::*;
pub use pushback::*;
pub use stats::*;
use time::*;
