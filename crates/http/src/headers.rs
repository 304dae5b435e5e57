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
/// Fractional digits kept when scaling a decimal; later ones are dropped (rounding down).
const FRACTION_DIGITS: u32 = 18;

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

// ---------------------------------------------------------------------------------------------
// Pure parsers
// ---------------------------------------------------------------------------------------------

/// `Retry-After`: delta-seconds or an HTTP-date (all three forms of RFC 9110 §5.6.7), as a wait
/// from `now_wall`. A date in the past is a zero wait.
///
/// Leniencies beyond RFC 9110: optional whitespace around the value, and a decimal fraction of a
/// second (`1.5`; digits past the 18th are dropped). Errors: [`Malformed::Empty`],
/// [`NotANumber`](Malformed::NotANumber), [`Negative`](Malformed::Negative),
/// [`Overflow`](Malformed::Overflow), [`BadHttpDate`](Malformed::BadHttpDate), and
/// [`TooFar`](Malformed::TooFar) for a wait longer than `max_plausible`.
pub fn parse_retry_after(
    value: &[u8],
    now_wall: SystemTime,
    max_plausible: Duration,
) -> Result<Duration, Malformed> {
    let text = trim_ows(value);
    match text.first() {
        None => Err(Malformed::Empty),
        Some(b) if b.is_ascii_digit() || matches!(b, b'-' | b'+' | b'.') => {
            plausible(parse_number(text, true)?.nanos(NANOS_PER_SEC), max_plausible)
        }
        Some(_) => until(http_date_nanos(text)?, now_wall, max_plausible),
    }
}

/// `retry-after-ms` (and Azure's `x-ms-retry-after-ms`): a wait in milliseconds. A decimal
/// fraction is accepted (`1500.5`). Errors as for [`parse_retry_after`]'s delta-seconds.
pub fn parse_retry_after_ms(value: &[u8], max_plausible: Duration) -> Result<Duration, Malformed> {
    plausible(parse_number(value, true)?.nanos(NANOS_PER_MILLI), max_plausible)
}

/// `grpc-retry-pushback-ms`, as gRFC A6 reads it: a non-negative integer is the wait in
/// milliseconds; a negative one means do not retry.
///
/// An `Err` is a value that cannot be read (not an integer, or outside `i64`), and gRFC A6 says
/// that too means **do not retry**: a caller maps every `Err` to [`Pushback::DontRetry`]
/// ([`PushbackHeaders::read_pushback`] does). There is no `max_plausible` here: any wait longer
/// than core's `max_pushback` already means no retry. A leading `+` is accepted, and `-0` is a
/// zero wait, as gRPC's own parsers read them.
pub fn parse_grpc_pushback(value: &[u8]) -> Result<Pushback, Malformed> {
    let text = trim_ows(value);
    let (negative, digits) = match text.split_first() {
        None => return Err(Malformed::Empty),
        Some((b'-', rest)) => (true, rest),
        Some((b'+', rest)) => (false, rest),
        Some(_) => (false, text),
    };
    if digits.is_empty() || !digits.iter().all(u8::is_ascii_digit) {
        return Err(Malformed::NotANumber);
    }
    let millis = digits_to_u64(digits).ok_or(Malformed::Overflow)?;
    if millis > i64::MAX as u64 {
        return Err(Malformed::Overflow);
    }
    Ok(match (negative, millis) {
        (true, 1..) => Pushback::DontRetry,
        _ => Pushback::RetryAfter(Duration::from_millis(millis)),
    })
}

/// A count such as `X-Concurrency-Limit-Limit` or `RateLimit-Remaining`: a non-negative integer
/// (whitespace around it allowed). Errors: [`Malformed::Empty`],
/// [`NotANumber`](Malformed::NotANumber) (including fractions and comma lists),
/// [`Negative`](Malformed::Negative), [`Overflow`](Malformed::Overflow) (more than `u64::MAX`).
pub fn parse_count(value: &[u8]) -> Result<u64, Malformed> {
    Ok(parse_number(value, false)?.int)
}

/// A Go-style duration (what Go's `time.Duration` prints and `time.ParseDuration` reads):
/// `6m0s`, `1h2m3.5s`, `250ms`, `1.5µs`, `0`. Units `ns`, `us` (or `µs`, `μs`), `ms`, `s`, `m`,
/// `h`; each component may have a decimal fraction; a leading `+` is allowed.
///
/// Errors: [`Malformed::Empty`], [`Negative`](Malformed::Negative) (`-1s`),
/// [`Overflow`](Malformed::Overflow) (more than `u64::MAX` nanoseconds, about 584 years) and
/// [`BadDuration`](Malformed::BadDuration) for anything else, such as a number without a unit.
pub fn parse_go_duration(value: &[u8]) -> Result<Duration, Malformed> {
    let text = trim_ows(value);
    let (negative, mut rest) = match text.split_first() {
        None => return Err(Malformed::Empty),
        Some((b'-', rest)) => (true, rest),
        Some((b'+', rest)) => (false, rest),
        Some(_) => (false, text),
    };
    if rest == b"0" {
        return Ok(Duration::ZERO);
    }
    if rest.is_empty() {
        return Err(Malformed::BadDuration);
    }
    let mut total: u128 = 0;
    while !rest.is_empty() {
        let int_len = rest.iter().take_while(|b| b.is_ascii_digit()).count();
        let (int_digits, after) = rest.split_at(int_len);
        rest = after;
        let mut frac_digits: &[u8] = &[];
        if let Some((b'.', after)) = rest.split_first() {
            let len = after.iter().take_while(|b| b.is_ascii_digit()).count();
            (frac_digits, rest) = after.split_at(len);
        }
        if int_digits.is_empty() && frac_digits.is_empty() {
            return Err(Malformed::BadDuration);
        }
        let unit_len = rest.iter().take_while(|b| !(b.is_ascii_digit() || **b == b'.')).count();
        let (unit, after) = rest.split_at(unit_len);
        rest = after;
        let nanos_per_unit: u64 = match unit {
            b"ns" => 1,
            // `µs` as U+00B5 (what Go prints) or U+03BC, in UTF-8.
            b"us" | b"\xc2\xb5s" | b"\xce\xbcs" => 1_000,
            b"ms" => NANOS_PER_MILLI,
            b"s" => NANOS_PER_SEC,
            b"m" => 60 * NANOS_PER_SEC,
            b"h" => 3_600 * NANOS_PER_SEC,
            _ => return Err(Malformed::BadDuration),
        };
        let number = Decimal {
            int: digits_to_u64(int_digits).ok_or(Malformed::Overflow)?,
            ..Decimal::fraction(frac_digits)
        };
        total = total.saturating_add(number.nanos(nanos_per_unit));
        if total > u128::from(u64::MAX) {
            return Err(Malformed::Overflow);
        }
    }
    if negative && total > 0 {
        return Err(Malformed::Negative);
    }
    Ok(nanos_to_duration(total))
}

/// An RFC 3339 date-time: `2026-11-30T12:00:00Z`, `2026-11-30T13:00:00.25+01:00`. `T` may be `t`
/// or a space and `Z` may be `z`, as RFC 3339 allows; fractional seconds have any number of
/// digits (nanoseconds kept); a leap second (`:60`) counts as the next minute's first.
///
/// Errors: [`Malformed::Empty`], [`BadRfc3339`](Malformed::BadRfc3339) (wrong shape, or a field
/// out of range: month 13, 31 April, 29 February outside a leap year, hour 24, offset `+24:00`),
/// [`Overflow`](Malformed::Overflow) if the platform's `SystemTime` cannot hold the date.
pub fn parse_rfc3339(value: &[u8]) -> Result<SystemTime, Malformed> {
    let nanos = rfc3339_unix_nanos(value)?;
    let magnitude = nanos_to_duration(nanos.unsigned_abs());
    if nanos >= 0 { UNIX_EPOCH.checked_add(magnitude) } else { UNIX_EPOCH.checked_sub(magnitude) }
        .ok_or(Malformed::Overflow)
}

/// How a rate-limit reset header says when its window reopens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ResetFormat {
    /// A number of seconds (a fraction allowed): at or above 10^9 ([`UNIX_THRESHOLD`]) it is a
    /// unix time, below it a wait from now. The default for `X-RateLimit-Reset` and
    /// `RateLimit-Reset`, which servers send both ways. Token `unix-or-delta`.
    UnixOrDelta,
    /// Unix time in seconds (a fraction allowed). Token `unix`.
    UnixSeconds,
    /// Unix time in milliseconds (a fraction allowed). Token `unix-ms`.
    UnixMillis,
    /// Seconds from now (a fraction allowed). Token `delta`.
    DeltaSeconds,
    /// An RFC 3339 date-time; the default for `anthropic-ratelimit-*-reset`. Token `rfc3339`.
    Rfc3339,
    /// A Go-style duration from now such as `6m0s`; the default for `x-ratelimit-reset-*`.
    /// Token `go-duration`.
    GoDuration,
    /// An HTTP-date (any of its three forms). Token `http-date`.
    HttpDate,
}

impl ResetFormat {
    /// Every format, in declaration order.
    pub const ALL: [ResetFormat; 7] = [
        ResetFormat::UnixOrDelta,
        ResetFormat::UnixSeconds,
        ResetFormat::UnixMillis,
        ResetFormat::DeltaSeconds,
        ResetFormat::Rfc3339,
        ResetFormat::GoDuration,
        ResetFormat::HttpDate,
    ];

    /// The token this format is configured with.
    pub fn as_str(self) -> &'static str {
        match self {
            ResetFormat::UnixOrDelta => "unix-or-delta",
            ResetFormat::UnixSeconds => "unix",
            ResetFormat::UnixMillis => "unix-ms",
            ResetFormat::DeltaSeconds => "delta",
            ResetFormat::Rfc3339 => "rfc3339",
            ResetFormat::GoDuration => "go-duration",
            ResetFormat::HttpDate => "http-date",
        }
    }
}

impl fmt::Display for ResetFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A reset format token that is not one of [`ResetFormat`]'s.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "`{0}` is not a reset format (unix-or-delta, unix, unix-ms, delta, rfc3339, go-duration or \
     http-date)"
)]
pub struct UnknownResetFormat(pub String);

impl FromStr for ResetFormat {
    type Err = UnknownResetFormat;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let token = s.trim();
        ResetFormat::ALL
            .into_iter()
            .find(|f| f.as_str() == token)
            .ok_or_else(|| UnknownResetFormat(s.to_string()))
    }
}

/// A rate-limit reset header in the given `format`, as a wait from `now_wall` (a time in the past
/// is a zero wait). Errors as for the format's parser, plus [`Malformed::TooFar`] for a wait
/// longer than `max_plausible`.
pub fn parse_reset(
    value: &[u8],
    format: ResetFormat,
    now_wall: SystemTime,
    max_plausible: Duration,
) -> Result<Duration, Malformed> {
    match format {
        ResetFormat::UnixOrDelta => {
            let number = parse_number(value, true)?;
            let nanos = number.nanos(NANOS_PER_SEC);
            if number.int >= UNIX_THRESHOLD {
                until(to_i128(nanos), now_wall, max_plausible)
            } else {
                plausible(nanos, max_plausible)
            }
        }
        ResetFormat::UnixSeconds => {
            until(to_i128(parse_number(value, true)?.nanos(NANOS_PER_SEC)), now_wall, max_plausible)
        }
        ResetFormat::UnixMillis => until(
            to_i128(parse_number(value, true)?.nanos(NANOS_PER_MILLI)),
            now_wall,
            max_plausible,
        ),
        ResetFormat::DeltaSeconds => {
            plausible(parse_number(value, true)?.nanos(NANOS_PER_SEC), max_plausible)
        }
        ResetFormat::Rfc3339 => until(rfc3339_unix_nanos(value)?, now_wall, max_plausible),
        ResetFormat::GoDuration => plausible(parse_go_duration(value)?.as_nanos(), max_plausible),
        ResetFormat::HttpDate => until(http_date_nanos(trim_ows(value))?, now_wall, max_plausible),
    }
}

/// Of two things the dependency said, the one that keeps retries away longer: `DontRetry` wins,
/// else the longer wait. [`PushbackHeaders::read_pushback`] combines its headers this way; use it
/// to combine what it read from the response headers with what it read from the trailers (where
/// gRPC sends `grpc-retry-pushback-ms`).
pub fn stricter(a: Option<Pushback>, b: Option<Pushback>) -> Option<Pushback> {
    match (a, b) {
        (Some(Pushback::DontRetry), _) | (_, Some(Pushback::DontRetry)) => {
            Some(Pushback::DontRetry)
        }
        (Some(Pushback::RetryAfter(x)), Some(Pushback::RetryAfter(y))) => {
            Some(Pushback::RetryAfter(x.max(y)))
        }
        (a, None) => a,
        (None, b) => b,
    }
}

// ---------------------------------------------------------------------------------------------
// Counting what was ignored
// ---------------------------------------------------------------------------------------------

/// The kinds of header [`HeaderStats`] counts malformed values of.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum HeaderKind {
    /// `Retry-After` (or a configured equivalent).
    RetryAfter,
    /// `retry-after-ms` (or a configured equivalent).
    RetryAfterMs,
    /// A rate-limit reset header.
    Reset,
    /// `grpc-retry-pushback-ms` that could not be read (and so meant "do not retry").
    GrpcPushback,
    /// A concurrency limit header.
    Limit,
    /// A remaining-quota header.
    Remaining,
}

impl HeaderKind {
    /// Every kind, in declaration order.
    pub const ALL: [HeaderKind; 6] = [
        HeaderKind::RetryAfter,
        HeaderKind::RetryAfterMs,
        HeaderKind::Reset,
        HeaderKind::GrpcPushback,
        HeaderKind::Limit,
        HeaderKind::Remaining,
    ];

    /// A label for metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            HeaderKind::RetryAfter => "retry-after",
            HeaderKind::RetryAfterMs => "retry-after-ms",
            HeaderKind::Reset => "reset",
            HeaderKind::GrpcPushback => "grpc-retry-pushback-ms",
            HeaderKind::Limit => "limit",
            HeaderKind::Remaining => "remaining",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

impl fmt::Display for HeaderKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Counts of header values that were ignored because they were malformed or implausible, per
/// [`HeaderKind`]. Share one per dependency (behind an `Arc`) and export its
/// [`snapshot`](HeaderStats::snapshot) as a counter.
#[derive(Debug, Default)]
pub struct HeaderStats {
    malformed: [AtomicU64; 6],
}

impl HeaderStats {
    /// All counts zero.
    pub fn new() -> HeaderStats {
        HeaderStats::default()
    }

    /// Counts one ignored value of `kind`.
    pub fn record(&self, kind: HeaderKind) {
        // Relaxed: a counter read only for metrics; nothing else is published through it.
        self.malformed[kind.index()].fetch_add(1, Ordering::Relaxed);
    }

    /// The ignored values of `kind` so far.
    pub fn get(&self, kind: HeaderKind) -> u64 {
        self.malformed[kind.index()].load(Ordering::Relaxed)
    }

    /// Every count now (each read on its own: not one atomic instant across kinds).
    pub fn snapshot(&self) -> HeaderStatsSnapshot {
        HeaderStatsSnapshot { malformed: HeaderKind::ALL.map(|k| self.get(k)) }
    }
}

/// A copy of [`HeaderStats`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct HeaderStatsSnapshot {
    malformed: [u64; 6],
}

impl HeaderStatsSnapshot {
    /// The ignored values of `kind`.
    pub fn get(&self, kind: HeaderKind) -> u64 {
        self.malformed[kind.index()]
    }

    /// The ignored values of every kind.
    pub fn total(&self) -> u64 {
        self.malformed.iter().fold(0, |sum, n| sum.saturating_add(*n))
    }
}

// ---------------------------------------------------------------------------------------------
// Configuration
// ---------------------------------------------------------------------------------------------

/// A configuration that cannot be used, with the one reason.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HeaderConfigError {
    /// Not a valid HTTP header name.
    #[error("`{0}` is not a valid header name")]
    BadName(String),
    /// A reset header pattern with more than one `*`, or nothing around it.
    #[error("`{0}` is not a header name pattern (at most one `*`, and a name around it)")]
    BadPattern(String),
    /// Not an HTTP status code.
    #[error("{0} is not an http status code (100 to 999)")]
    BadStatus(u16),
    /// `max_plausible` out of range.
    #[error("max_plausible must be from 1s to 100 years, got {0:?}")]
    MaxPlausible(Duration),
}

/// A rate-limit reset header and how to read it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResetHeader {
    /// The header name, case-insensitive. One `*` matches one or more characters, so
    /// `x-ratelimit-reset-*` covers `x-ratelimit-reset-requests` and `-tokens` (and not
    /// `x-ratelimit-reset` itself).
    ///
    /// Its **remaining** counter is the header of the same name with its last `reset` replaced
    /// by `remaining` (`anthropic-ratelimit-tokens-reset` → `anthropic-ratelimit-tokens-remaining`):
    /// [`PushbackHeaders::read_pushback`] uses a reset only when that counter is 0, or absent on
    /// a pushback status.
    pub name: String,
    /// How its value is written.
    pub format: ResetFormat,
}

impl ResetHeader {
    /// A reset header `name` in `format`.
    pub fn new(name: impl Into<String>, format: ResetFormat) -> ResetHeader {
        ResetHeader { name: name.into(), format }
    }
}

/// The reset headers read by default (docs/headers.md): `x-ratelimit-reset` and `ratelimit-reset`
/// as [`ResetFormat::UnixOrDelta`], `anthropic-ratelimit-*-reset` as RFC 3339, and
/// `x-ratelimit-reset-*` as Go durations.
pub fn default_reset_headers() -> Vec<ResetHeader> {
    vec![
        ResetHeader::new("x-ratelimit-reset", ResetFormat::UnixOrDelta),
        ResetHeader::new("ratelimit-reset", ResetFormat::UnixOrDelta),
        ResetHeader::new("anthropic-ratelimit-*-reset", ResetFormat::Rfc3339),
        ResetHeader::new("x-ratelimit-reset-*", ResetFormat::GoDuration),
    ]
}

/// Which headers are server pushback, and how to read them. See [`PushbackHeaders`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PushbackHeadersConfig {
    /// The statuses on which `retry_after`, `retry_after_ms` and the reset headers are pushback.
    /// HTTP status codes (100–999). Default `[429, 503]`.
    pub statuses: Vec<u16>,
    /// Delta-seconds-or-HTTP-date headers. Default `["retry-after"]`.
    pub retry_after: Vec<String>,
    /// Millisecond headers. Default `["retry-after-ms", "x-ms-retry-after-ms"]`.
    pub retry_after_ms: Vec<String>,
    /// gRPC pushback headers, read on any status. Default `["grpc-retry-pushback-ms"]`.
    pub grpc_retry_pushback_ms: Vec<String>,
    /// Rate-limit reset headers; the first whose name matches a header decides its format.
    /// Default [`default_reset_headers`].
    pub resets: Vec<ResetHeader>,
    /// A wait further away than this is garbage: ignored and counted. Core's `max_pushback`
    /// (at most 24 h) decides later whether a plausible wait is too long to retry at all, so this
    /// only catches values no server means. From 1 s to 100 years; default 366 days.
    pub max_plausible: Duration,
}

impl Default for PushbackHeadersConfig {
    fn default() -> Self {
        PushbackHeadersConfig {
            statuses: vec![429, 503],
            retry_after: vec!["retry-after".to_string()],
            retry_after_ms: vec!["retry-after-ms".to_string(), "x-ms-retry-after-ms".to_string()],
            grpc_retry_pushback_ms: vec!["grpc-retry-pushback-ms".to_string()],
            resets: default_reset_headers(),
            max_plausible: DEFAULT_MAX_PLAUSIBLE,
        }
    }
}

/// Reads server pushback from a response's headers. See the [module docs](self) and
/// `docs/headers.md`.
#[derive(Debug, Clone)]
pub struct PushbackHeaders {
    config: PushbackHeadersConfig,
    statuses: Vec<StatusCode>,
    retry_after: Vec<HeaderName>,
    retry_after_ms: Vec<HeaderName>,
    grpc: Vec<HeaderName>,
    resets: Vec<(NamePattern, ResetFormat)>,
}

impl Default for PushbackHeaders {
    fn default() -> Self {
        PushbackHeaders::try_new(PushbackHeadersConfig::default())
            .expect("the default pushback headers are valid")
    }
}

impl PushbackHeaders {
    /// Builds the reader, refusing an invalid configuration.
    pub fn try_new(config: PushbackHeadersConfig) -> Result<PushbackHeaders, HeaderConfigError> {
        check_max_plausible(config.max_plausible)?;
        let statuses = config
            .statuses
            .iter()
            .map(|&s| StatusCode::from_u16(s).map_err(|_| HeaderConfigError::BadStatus(s)))
            .collect::<Result<_, _>>()?;
        Ok(PushbackHeaders {
            statuses,
            retry_after: header_names(&config.retry_after)?,
            retry_after_ms: header_names(&config.retry_after_ms)?,
            grpc: header_names(&config.grpc_retry_pushback_ms)?,
            resets: reset_patterns(&config.resets)?,
            config,
        })
    }

    /// The configuration it was built with.
    pub fn config(&self) -> &PushbackHeadersConfig {
        &self.config
    }

    /// What the dependency said about retrying, if anything; malformed values are ignored and
    /// counted in `stats`. Call it with a failed attempt's response headers (and again with its
    /// trailers, combining the two with [`stricter`]). `now_wall` is the wall clock now, for
    /// dates.
    ///
    /// 1. The `grpc_retry_pushback_ms` headers, on any status: a wait, or `DontRetry` when
    ///    negative, unreadable or on several field lines (gRFC A6, and grpc-go's reading of it).
    /// 2. On a configured status (429, 503): every `retry_after` and `retry_after_ms` field line.
    /// 3. Only if neither said anything usable: the reset headers. A reset counts when its
    ///    remaining counter (see [`ResetHeader::name`]) is 0, on any status; when that counter
    ///    is above 0 it does not (that window is not the one that is exhausted); when the counter
    ///    is absent or unreadable, it counts on a configured status.
    ///
    /// Of everything that counts, the strictest wins: `DontRetry`, else the longest wait, so a
    /// retry never comes back sooner than any header asked.
    pub fn read_pushback(
        &self,
        headers: &HeaderMap,
        status: StatusCode,
        now_wall: SystemTime,
        stats: &HeaderStats,
    ) -> Option<Pushback> {
        let max = self.config.max_plausible;
        let mut said = None;
        for name in &self.grpc {
            let mut lines = headers.get_all(name).iter();
            let Some(first) = lines.next() else { continue };
            let pushback = if lines.next().is_some() {
                stats.record(HeaderKind::GrpcPushback);
                Pushback::DontRetry
            } else {
                parse_grpc_pushback(first.as_bytes()).unwrap_or_else(|_| {
                    stats.record(HeaderKind::GrpcPushback);
                    Pushback::DontRetry
                })
            };
            said = stricter(said, Some(pushback));
        }
        let on_status = self.statuses.contains(&status);
        if on_status {
            for name in &self.retry_after {
                for value in headers.get_all(name) {
                    match parse_retry_after(value.as_bytes(), now_wall, max) {
                        Ok(d) => said = stricter(said, Some(Pushback::RetryAfter(d))),
                        Err(_) => stats.record(HeaderKind::RetryAfter),
                    }
                }
            }
            for name in &self.retry_after_ms {
                for value in headers.get_all(name) {
                    match parse_retry_after_ms(value.as_bytes(), max) {
                        Ok(d) => said = stricter(said, Some(Pushback::RetryAfter(d))),
                        Err(_) => stats.record(HeaderKind::RetryAfterMs),
                    }
                }
            }
        }
        if said.is_some() {
            return said;
        }
        for (name, format) in matched_resets(&self.resets, headers) {
            let applies = match remaining_of(headers, name.as_str()) {
                Some(0) => true,
                Some(_) => false,
                None => on_status,
            };
            if !applies {
                continue;
            }
            for value in headers.get_all(name) {
                match parse_reset(value.as_bytes(), format, now_wall, max) {
                    Ok(d) => said = stricter(said, Some(Pushback::RetryAfter(d))),
                    Err(_) => stats.record(HeaderKind::Reset),
                }
            }
        }
        said
    }
}

/// Which headers carry the dependency's own limits. See [`LimitHeaders`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LimitHeadersConfig {
    /// The dependency's concurrency limit, for [`Limiter::set_limit_hint`]. Default
    /// `["x-concurrency-limit-limit"]`.
    ///
    /// [`Limiter::set_limit_hint`]: stormguard_core::limiter::Limiter::set_limit_hint
    pub limit: Vec<String>,
    /// What is left of a concurrency or rate limit. Default `["x-concurrency-limit-remaining",
    /// "ratelimit-remaining", "x-ratelimit-remaining"]`.
    pub remaining: Vec<String>,
    /// When the remaining quota is refilled. Default `x-ratelimit-reset` and `ratelimit-reset`
    /// as [`ResetFormat::UnixOrDelta`].
    pub resets: Vec<ResetHeader>,
    /// A reset further away than this is ignored and counted. From 1 s to 100 years; default
    /// 366 days.
    pub max_plausible: Duration,
}

impl Default for LimitHeadersConfig {
    fn default() -> Self {
        LimitHeadersConfig {
            limit: vec!["x-concurrency-limit-limit".to_string()],
            remaining: vec![
                "x-concurrency-limit-remaining".to_string(),
                "ratelimit-remaining".to_string(),
                "x-ratelimit-remaining".to_string(),
            ],
            resets: vec![
                ResetHeader::new("x-ratelimit-reset", ResetFormat::UnixOrDelta),
                ResetHeader::new("ratelimit-reset", ResetFormat::UnixOrDelta),
            ],
            max_plausible: DEFAULT_MAX_PLAUSIBLE,
        }
    }
}

/// What a response said about the dependency's limits. Every field is `None` when no configured
/// header held a usable value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LimitInfo {
    /// The smallest concurrency limit stated (0 is passed through; core's limiter clamps a hint
    /// to at least 1).
    pub limit: Option<u64>,
    /// The smallest remaining count stated.
    pub remaining: Option<u64>,
    /// The longest reset stated, as a wait from now (zero if it already passed).
    pub reset: Option<Duration>,
}

impl LimitInfo {
    /// No header said anything usable.
    pub fn is_empty(&self) -> bool {
        *self == LimitInfo::default()
    }
}

/// Reads the dependency's limits from a response's headers, on any status. See the
/// [module docs](self) and `docs/headers.md`.
#[derive(Debug, Clone)]
pub struct LimitHeaders {
    config: LimitHeadersConfig,
    limit: Vec<HeaderName>,
    remaining: Vec<HeaderName>,
    resets: Vec<(NamePattern, ResetFormat)>,
}

impl Default for LimitHeaders {
    fn default() -> Self {
        LimitHeaders::try_new(LimitHeadersConfig::default())
            .expect("the default limit headers are valid")
    }
}

impl LimitHeaders {
    /// Builds the reader, refusing an invalid configuration.
    pub fn try_new(config: LimitHeadersConfig) -> Result<LimitHeaders, HeaderConfigError> {
        check_max_plausible(config.max_plausible)?;
        Ok(LimitHeaders {
            limit: header_names(&config.limit)?,
            remaining: header_names(&config.remaining)?,
            resets: reset_patterns(&config.resets)?,
            config,
        })
    }

    /// The configuration it was built with.
    pub fn config(&self) -> &LimitHeadersConfig {
        &self.config
    }

    /// Whether `headers` hold any configured limit or remaining header (a reset alone changes
    /// nothing a caller applies). A cheap check before [`read_limits`](Self::read_limits).
    pub fn mentions_limits(&self, headers: &HeaderMap) -> bool {
        !headers.is_empty()
            && self.limit.iter().chain(&self.remaining).any(|name| headers.contains_key(name))
    }

    /// The limits stated in `headers`, the most conservative of each when several headers or
    /// field lines speak: the smallest limit, the smallest remaining, the longest reset.
    /// Malformed values are ignored and counted in `stats`.
    pub fn read_limits(
        &self,
        headers: &HeaderMap,
        now_wall: SystemTime,
        stats: &HeaderStats,
    ) -> LimitInfo {
        let counts = |names: &[HeaderName], kind| {
            let mut least: Option<u64> = None;
            for value in names.iter().flat_map(|name| headers.get_all(name)) {
                match parse_count(value.as_bytes()) {
                    Ok(n) => least = Some(least.map_or(n, |l| l.min(n))),
                    Err(_) => stats.record(kind),
                }
            }
            least
        };
        let mut reset: Option<Duration> = None;
        for (name, format) in matched_resets(&self.resets, headers) {
            for value in headers.get_all(name) {
                match parse_reset(value.as_bytes(), format, now_wall, self.config.max_plausible) {
                    Ok(d) => reset = Some(reset.map_or(d, |r| r.max(d))),
                    Err(_) => stats.record(HeaderKind::Reset),
                }
            }
        }
        LimitInfo {
            limit: counts(&self.limit, HeaderKind::Limit),
            remaining: counts(&self.remaining, HeaderKind::Remaining),
            reset,
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Internals
// ---------------------------------------------------------------------------------------------

/// A configured header name: exact, or with one `*` matching one or more characters.
#[derive(Debug, Clone)]
enum NamePattern {
    Exact(HeaderName),
    Glob { prefix: String, suffix: String },
}

impl NamePattern {
    fn parse(name: &str) -> Result<NamePattern, HeaderConfigError> {
        let bad = || HeaderConfigError::BadPattern(name.to_string());
        let Some((prefix, suffix)) = name.split_once('*') else {
            return header_name(name).map(NamePattern::Exact);
        };
        if suffix.contains('*') || (prefix.is_empty() && suffix.is_empty()) {
            return Err(bad());
        }
        // Each side must be a run of header-name characters on its own.
        for side in [prefix, suffix] {
            if !side.is_empty() && HeaderName::from_bytes(side.as_bytes()).is_err() {
                return Err(bad());
            }
        }
        Ok(NamePattern::Glob {
            prefix: prefix.to_ascii_lowercase(),
            suffix: suffix.to_ascii_lowercase(),
        })
    }

    fn matches(&self, name: &HeaderName) -> bool {
        match self {
            NamePattern::Exact(exact) => exact == name,
            NamePattern::Glob { prefix, suffix } => {
                let name = name.as_str();
                name.len() > prefix.len() + suffix.len()
                    && name.starts_with(prefix.as_str())
                    && name.ends_with(suffix.as_str())
            }
        }
    }
}

fn header_name(name: &str) -> Result<HeaderName, HeaderConfigError> {
    // `from_bytes` lowercases, so configured names are case-insensitive.
    HeaderName::from_bytes(name.trim().as_bytes())
        .map_err(|_| HeaderConfigError::BadName(name.to_string()))
}

fn header_names(names: &[String]) -> Result<Vec<HeaderName>, HeaderConfigError> {
    names.iter().map(|n| header_name(n)).collect()
}

fn reset_patterns(
    resets: &[ResetHeader],
) -> Result<Vec<(NamePattern, ResetFormat)>, HeaderConfigError> {
    resets.iter().map(|r| Ok((NamePattern::parse(r.name.trim())?, r.format))).collect()
}

fn check_max_plausible(max: Duration) -> Result<(), HeaderConfigError> {
    if max < Duration::from_secs(1) || max > LONGEST_MAX_PLAUSIBLE {
        return Err(HeaderConfigError::MaxPlausible(max));
    }
    Ok(())
}

/// Each header in `headers` that a reset rule matches, with the format of the first rule that
/// matches it.
fn matched_resets<'h>(
    rules: &'h [(NamePattern, ResetFormat)],
    headers: &'h HeaderMap,
) -> impl Iterator<Item = (&'h HeaderName, ResetFormat)> + 'h {
    headers.keys().filter_map(move |name| {
        rules.iter().find(|(pattern, _)| pattern.matches(name)).map(|(_, format)| (name, *format))
    })
}

/// The smallest readable value of the remaining counter paired with the reset header
/// `reset_name`, if any. Unreadable values are left to [`LimitHeaders`] to count.
fn remaining_of(headers: &HeaderMap, reset_name: &str) -> Option<u64> {
    let at = reset_name.rfind("reset")?;
    let name = format!("{}remaining{}", &reset_name[..at], &reset_name[at + "reset".len()..]);
    headers.get_all(name.as_str()).iter().filter_map(|v| parse_count(v.as_bytes()).ok()).min()
}

/// Optional whitespace (SP / HTAB, RFC 9110 §5.6.3) removed from both ends.
fn trim_ows(value: &[u8]) -> &[u8] {
    let is_ows = |b: &u8| *b == b' ' || *b == b'\t';
    let start = value.iter().position(|b| !is_ows(b)).unwrap_or(value.len());
    let end = value.iter().rposition(|b| !is_ows(b)).map_or(start, |i| i + 1);
    &value[start..end]
}

/// A non-negative decimal: `int` and the first [`FRACTION_DIGITS`] digits of its fraction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Decimal {
    int: u64,
    /// The fraction's digits as an integer: `frac / 10^frac_digits`.
    frac: u64,
    frac_digits: u32,
}

impl Decimal {
    /// The fraction `.digits` alone (digits already checked to be ASCII digits).
    fn fraction(digits: &[u8]) -> Decimal {
        let kept = &digits[..digits.len().min(FRACTION_DIGITS as usize)];
        Decimal {
            int: 0,
            // At most 18 digits: fits in a u64.
            frac: digits_to_u64(kept).unwrap_or(0),
            frac_digits: kept.len() as u32,
        }
    }

    /// The value times `unit`, rounded down. At most `u64::MAX × unit × 2`: fits in a `u128`.
    fn nanos(&self, unit: u64) -> u128 {
        let unit = u128::from(unit);
        u128::from(self.int) * unit + u128::from(self.frac) * unit / 10u128.pow(self.frac_digits)
    }
}

/// `1*DIGIT [ "." 1*DIGIT ]` (the fraction only if `fraction`), after trimming whitespace; a
/// leading `-` on an otherwise valid number is [`Malformed::Negative`].
fn parse_number(value: &[u8], fraction: bool) -> Result<Decimal, Malformed> {
    let text = trim_ows(value);
    if text.is_empty() {
        return Err(Malformed::Empty);
    }
    if let Some(rest) = text.strip_prefix(b"-") {
        return match unsigned_decimal(rest, fraction) {
            Ok(_) | Err(Malformed::Overflow) => Err(Malformed::Negative),
            Err(_) => Err(Malformed::NotANumber),
        };
    }
    unsigned_decimal(text, fraction)
}

fn unsigned_decimal(text: &[u8], fraction: bool) -> Result<Decimal, Malformed> {
    let (int_digits, frac_digits) = match text.iter().position(|b| *b == b'.') {
        Some(point) if fraction => (&text[..point], Some(&text[point + 1..])),
        _ => (text, None),
    };
    let all_digits = |d: &[u8]| !d.is_empty() && d.iter().all(u8::is_ascii_digit);
    if !all_digits(int_digits) || frac_digits.is_some_and(|f| !all_digits(f)) {
        return Err(Malformed::NotANumber);
    }
    Ok(Decimal {
        int: digits_to_u64(int_digits).ok_or(Malformed::Overflow)?,
        ..Decimal::fraction(frac_digits.unwrap_or(&[]))
    })
}

/// ASCII digits (already checked) as a `u64`, `None` if larger.
fn digits_to_u64(digits: &[u8]) -> Option<u64> {
    digits.iter().try_fold(0u64, |n, d| n.checked_mul(10)?.checked_add(u64::from(d - b'0')))
}

fn nanos_to_duration(nanos: u128) -> Duration {
    let secs = u64::try_from(nanos / u128::from(NANOS_PER_SEC)).unwrap_or(u64::MAX);
    // The remainder is below 10^9: it fits in a u32.
    Duration::new(secs, (nanos % u128::from(NANOS_PER_SEC)) as u32)
}

fn to_i128(nanos: u128) -> i128 {
    // Every caller's value is at most about 2 × 10^28: far inside i128.
    i128::try_from(nanos).unwrap_or(i128::MAX)
}

/// A wait of `nanos`, unless it is further away than `max`.
fn plausible(nanos: u128, max: Duration) -> Result<Duration, Malformed> {
    if nanos > max.as_nanos() { Err(Malformed::TooFar) } else { Ok(nanos_to_duration(nanos)) }
}

/// The wait from `now_wall` until `target` (nanoseconds since the unix epoch, negative before
/// it): zero if it has passed.
fn until(target: i128, now_wall: SystemTime, max: Duration) -> Result<Duration, Malformed> {
    let wait = target.saturating_sub(unix_nanos(now_wall));
    plausible(u128::try_from(wait).unwrap_or(0), max)
}

fn unix_nanos(t: SystemTime) -> i128 {
    match t.duration_since(UNIX_EPOCH) {
        Ok(after) => to_i128(after.as_nanos()),
        Err(before) => -to_i128(before.duration().as_nanos()),
    }
}

fn http_date_nanos(text: &[u8]) -> Result<i128, Malformed> {
    let text = std::str::from_utf8(text).map_err(|_| Malformed::BadHttpDate)?;
    let date = httpdate::parse_http_date(text).map_err(|_| Malformed::BadHttpDate)?;
    Ok(unix_nanos(date))
}

/// An RFC 3339 date-time as nanoseconds since the unix epoch (negative before it).
fn rfc3339_unix_nanos(value: &[u8]) -> Result<i128, Malformed> {
    let text = trim_ows(value);
    if text.is_empty() {
        return Err(Malformed::Empty);
    }
    let bad = Malformed::BadRfc3339;
    // `YYYY-MM-DDTHH:MM:SS`, then an optional fraction and the offset.
    let Some((fixed, rest)) = text.split_at_checked(19) else { return Err(bad) };
    let field = |range: std::ops::Range<usize>| {
        let digits = &fixed[range];
        if digits.iter().all(u8::is_ascii_digit) {
            digits_to_u64(digits).ok_or(bad)
        } else {
            Err(bad)
        }
    };
    let separators_ok = fixed[4] == b'-'
        && fixed[7] == b'-'
        && matches!(fixed[10], b'T' | b't' | b' ')
        && fixed[13] == b':'
        && fixed[16] == b':';
    if !separators_ok {
        return Err(bad);
    }
    let (year, month, day) = (field(0..4)?, field(5..7)?, field(8..10)?);
    let (hour, minute, second) = (field(11..13)?, field(14..16)?, field(17..19)?);
    let (frac, rest) = match rest.split_first() {
        Some((b'.', after)) => {
            let len = after.iter().take_while(|b| b.is_ascii_digit()).count();
            if len == 0 {
                return Err(bad);
            }
            let (digits, rest) = after.split_at(len);
            (Decimal::fraction(digits).nanos(NANOS_PER_SEC), rest)
        }
        _ => (0, rest),
    };
    let offset_secs: i64 = match rest {
        b"Z" | b"z" => 0,
        [sign @ (b'+' | b'-'), h1, h2, b':', m1, m2] => {
            let two = |a: u8, b: u8| {
                if a.is_ascii_digit() && b.is_ascii_digit() {
                    Ok(i64::from(a - b'0') * 10 + i64::from(b - b'0'))
                } else {
                    Err(bad)
                }
            };
            let (hours, minutes) = (two(*h1, *h2)?, two(*m1, *m2)?);
            if hours > 23 || minutes > 59 {
                return Err(bad);
            }
            let secs = hours * 3_600 + minutes * 60;
            if *sign == b'-' { -secs } else { secs }
        }
        _ => return Err(bad),
    };
    let in_range = (1..=12).contains(&month)
        && day >= 1
        && day <= days_in_month(year, month)
        && hour <= 23
        && minute <= 59
        && second <= 60;
    if !in_range {
        return Err(bad);
    }
    // Every field is now small (year ≤ 9999): no overflow below.
    let days = days_from_civil(year as i64, month as i64, day as i64);
    let secs = days * 86_400 + (hour * 3_600 + minute * 60 + second) as i64 - offset_secs;
    Ok(i128::from(secs) * i128::from(NANOS_PER_SEC) + to_i128(frac))
}

fn days_in_month(year: u64, month: u64) -> u64 {
    match month {
        2 if year.is_multiple_of(4) && (!year.is_multiple_of(100) || year.is_multiple_of(400)) => {
            29
        }
        2 => 28,
        4 | 6 | 9 | 11 => 30,
        _ => 31,
    }
}

/// Days from 1970-01-01 to a date of the proleptic Gregorian calendar (Howard Hinnant's
/// `days_from_civil`).
fn days_from_civil(year: i64, month: i64, day: i64) -> i64 {
    let year = if month <= 2 { year - 1 } else { year };
    let era = year.div_euclid(400);
    let year_of_era = year - era * 400;
    let day_of_year = (153 * ((month + 9) % 12) + 2) / 5 + day - 1;
    let day_of_era = year_of_era * 365 + year_of_era / 4 - year_of_era / 100 + day_of_year;
    era * 146_097 + day_of_era - 719_468
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;
    use proptest::prelude::*;

    const YEAR: Duration = DEFAULT_MAX_PLAUSIBLE;

    fn secs(s: u64) -> Duration {
        Duration::from_secs(s)
    }

    fn ms(m: u64) -> Duration {
        Duration::from_millis(m)
    }

    fn at(unix_secs: u64) -> SystemTime {
        UNIX_EPOCH + secs(unix_secs)
    }

    /// 1994-11-06T08:49:00Z, 37 s before the HTTP-date examples of RFC 9110.
    const RFC_NOW: u64 = 784_111_777 - 37;
    /// 2026-11-30T12:00:00Z.
    const NOV_30: u64 = 1_796_040_000;

    fn map(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut headers = HeaderMap::new();
        for (name, value) in pairs {
            headers.append(
                HeaderName::from_bytes(name.as_bytes()).unwrap(),
                HeaderValue::from_str(value).unwrap(),
            );
        }
        headers
    }

    #[test]
    fn retry_after_delta_seconds() {
        let now = at(NOV_30);
        let cases: &[(&str, Result<Duration, Malformed>)] = &[
            ("0", Ok(Duration::ZERO)),
            ("120", Ok(secs(120))),
            ("007", Ok(secs(7))),
            (" 5 ", Ok(secs(5))),
            ("\t9\t", Ok(secs(9))),
            ("1.5", Ok(ms(1_500))),
            ("0.000000001", Ok(Duration::from_nanos(1))),
            ("1.0000000009", Ok(secs(1))),
            ("31622400", Ok(YEAR)),
            ("", Err(Malformed::Empty)),
            ("   ", Err(Malformed::Empty)),
            ("-1", Err(Malformed::Negative)),
            ("-0", Err(Malformed::Negative)),
            ("-99999999999999999999999", Err(Malformed::Negative)),
            ("-", Err(Malformed::NotANumber)),
            ("--5", Err(Malformed::NotANumber)),
            ("+5", Err(Malformed::NotANumber)),
            ("5s", Err(Malformed::NotANumber)),
            ("1e3", Err(Malformed::NotANumber)),
            ("5.", Err(Malformed::NotANumber)),
            (".5", Err(Malformed::NotANumber)),
            ("1.2.3", Err(Malformed::NotANumber)),
            ("5, 10", Err(Malformed::NotANumber)),
            ("31622401", Err(Malformed::TooFar)),
            ("999999999", Err(Malformed::TooFar)),
            ("18446744073709551615", Err(Malformed::TooFar)),
            ("18446744073709551616", Err(Malformed::Overflow)),
            ("99999999999999999999999999999999", Err(Malformed::Overflow)),
        ];
        for (text, want) in cases {
            assert_eq!(parse_retry_after(text.as_bytes(), now, YEAR), *want, "{text:?}");
        }
        assert_eq!(parse_retry_after(b"\xff", now, YEAR), Err(Malformed::BadHttpDate));
        assert_eq!(parse_retry_after(b"5\xff", now, YEAR), Err(Malformed::NotANumber));
        assert_eq!(parse_retry_after(b"5", now, secs(4)), Err(Malformed::TooFar));
    }

    #[test]
    fn retry_after_all_three_http_date_forms() {
        let now = at(RFC_NOW);
        for form in [
            "Sun, 06 Nov 1994 08:49:37 GMT",  // IMF-fixdate
            "Sunday, 06-Nov-94 08:49:37 GMT", // obsolete RFC 850
            "Sun Nov  6 08:49:37 1994",       // ANSI C asctime()
            "  Sun, 06 Nov 1994 08:49:37 GMT\t",
        ] {
            assert_eq!(parse_retry_after(form.as_bytes(), now, YEAR), Ok(secs(37)), "{form}");
            assert_eq!(
                parse_reset(form.as_bytes(), ResetFormat::HttpDate, now, YEAR),
                Ok(secs(37)),
                "{form}"
            );
        }
        // A date in the past is "now"; sub-second wall clocks round the wait down.
        assert_eq!(
            parse_retry_after(b"Sun, 06 Nov 1994 08:48:00 GMT", now, YEAR),
            Ok(Duration::ZERO)
        );
        assert_eq!(
            parse_retry_after(b"Sun, 06 Nov 1994 08:49:37 GMT", now + ms(250), YEAR),
            Ok(ms(36_750))
        );
        let bad = Err(Malformed::BadHttpDate);
        for text in [
            "Mon, 06 Nov 1994 08:49:37 GMT", // wrong weekday
            "Sun, 06 Nov 1994 08:49:37 UTC",
            "Sun, 06 Nov 1994 08:49:37 gmt",
            "Sun, 06 Nov 1994 24:00:00 GMT",
            "Thu, 30 Feb 1995 08:49:37 GMT",
            "Sun, 6 Nov 1994 08:49:37 GMT",
            "Sun, 06 Nov 1994",
            "Sun Nov 6 08:49:37 1994",
            "Thu, 01 Jan 1969 00:00:00 GMT",
            "soon",
            "Sun, 06 Nov 1994 08:49:37 GMT, Sun, 06 Nov 1994 08:49:37 GMT",
        ] {
            assert_eq!(parse_retry_after(text.as_bytes(), now, YEAR), bad, "{text}");
        }
        assert_eq!(parse_retry_after("Sün, 06 Nov".as_bytes(), now, YEAR), bad);
        // Years away: implausible.
        assert_eq!(
            parse_retry_after(b"Fri, 31 Dec 9999 23:59:59 GMT", now, YEAR),
            Err(Malformed::TooFar)
        );
    }

    #[test]
    fn retry_after_ms() {
        let cases: &[(&str, Result<Duration, Malformed>)] = &[
            ("1500", Ok(ms(1_500))),
            ("0", Ok(Duration::ZERO)),
            (" 20 ", Ok(ms(20))),
            ("1500.5", Ok(Duration::from_micros(1_500_500))),
            ("31622400000", Ok(YEAR)),
            ("31622400001", Err(Malformed::TooFar)),
            ("-5", Err(Malformed::Negative)),
            ("abc", Err(Malformed::NotANumber)),
            ("1.5s", Err(Malformed::NotANumber)),
            ("", Err(Malformed::Empty)),
            ("184467440737095516150", Err(Malformed::Overflow)),
        ];
        for (text, want) in cases {
            assert_eq!(parse_retry_after_ms(text.as_bytes(), YEAR), *want, "{text:?}");
        }
    }

    #[test]
    fn grpc_pushback_follows_grfc_a6() {
        use Pushback::{DontRetry, RetryAfter};
        let cases: &[(&str, Result<Pushback, Malformed>)] = &[
            ("100", Ok(RetryAfter(ms(100)))),
            ("0", Ok(RetryAfter(Duration::ZERO))),
            ("+5", Ok(RetryAfter(ms(5)))),
            ("-0", Ok(RetryAfter(Duration::ZERO))),
            ("-1", Ok(DontRetry)),
            ("-9223372036854775807", Ok(DontRetry)),
            ("9223372036854775807", Ok(RetryAfter(ms(i64::MAX as u64)))),
            ("9223372036854775808", Err(Malformed::Overflow)),
            ("-99999999999999999999999", Err(Malformed::Overflow)),
            ("1.5", Err(Malformed::NotANumber)),
            ("abc", Err(Malformed::NotANumber)),
            ("-", Err(Malformed::NotANumber)),
            ("", Err(Malformed::Empty)),
        ];
        for (text, want) in cases {
            assert_eq!(parse_grpc_pushback(text.as_bytes()), *want, "{text:?}");
        }
    }

    #[test]
    fn counts() {
        let cases: &[(&str, Result<u64, Malformed>)] = &[
            ("0", Ok(0)),
            ("42", Ok(42)),
            (" 42 ", Ok(42)),
            ("18446744073709551615", Ok(u64::MAX)),
            ("18446744073709551616", Err(Malformed::Overflow)),
            ("-1", Err(Malformed::Negative)),
            ("1.0", Err(Malformed::NotANumber)),
            ("10, 10", Err(Malformed::NotANumber)),
            ("ten", Err(Malformed::NotANumber)),
            ("", Err(Malformed::Empty)),
        ];
        for (text, want) in cases {
            assert_eq!(parse_count(text.as_bytes()), *want, "{text:?}");
        }
    }

    #[test]
    fn go_durations() {
        let cases: &[(&str, Result<Duration, Malformed>)] = &[
            ("6m0s", Ok(secs(360))),
            ("1h", Ok(secs(3_600))),
            ("1.5s", Ok(ms(1_500))),
            ("300ms", Ok(ms(300))),
            ("2h45m", Ok(secs(9_900))),
            ("1h2m3.5s", Ok(ms(3_723_500))),
            ("1h0m0s", Ok(secs(3_600))),
            ("7.66s", Ok(ms(7_660))),
            ("0", Ok(Duration::ZERO)),
            ("0s", Ok(Duration::ZERO)),
            ("-0", Ok(Duration::ZERO)),
            ("+1s", Ok(secs(1))),
            (" 20ms ", Ok(ms(20))),
            ("1.5µs", Ok(Duration::from_nanos(1_500))),
            ("1μs", Ok(Duration::from_micros(1))),
            ("1us", Ok(Duration::from_micros(1))),
            ("10ns", Ok(Duration::from_nanos(10))),
            (".5s", Ok(ms(500))),
            ("1.s", Ok(secs(1))),
            ("1s1s", Ok(secs(2))),
            ("1.0000000009s", Ok(secs(1))),
            ("0.1h", Ok(secs(360))),
            ("", Err(Malformed::Empty)),
            ("-1s", Err(Malformed::Negative)),
            ("6", Err(Malformed::BadDuration)),
            ("1.5", Err(Malformed::BadDuration)),
            ("s", Err(Malformed::BadDuration)),
            ("6x", Err(Malformed::BadDuration)),
            ("6S", Err(Malformed::BadDuration)),
            ("1 s", Err(Malformed::BadDuration)),
            ("1h-1m", Err(Malformed::BadDuration)),
            (".s", Err(Malformed::BadDuration)),
            ("..5s", Err(Malformed::BadDuration)),
            ("+", Err(Malformed::BadDuration)),
            ("1d", Err(Malformed::BadDuration)),
            ("99999999999999999999s", Err(Malformed::Overflow)),
            ("9999999999999999999h", Err(Malformed::Overflow)),
            ("18446744073709551615ns", Ok(Duration::from_nanos(u64::MAX))),
            ("18446744073709551615ns1ns", Err(Malformed::Overflow)),
        ];
        for (text, want) in cases {
            assert_eq!(parse_go_duration(text.as_bytes()), *want, "{text:?}");
        }
        assert_eq!(parse_go_duration(b"1\xffs"), Err(Malformed::BadDuration));
        // As a reset, it is a wait from now, held to max_plausible.
        let now = at(NOV_30);
        assert_eq!(parse_reset(b"6m0s", ResetFormat::GoDuration, now, YEAR), Ok(secs(360)));
        assert_eq!(
            parse_reset(b"8784h0m1s", ResetFormat::GoDuration, now, YEAR),
            Err(Malformed::TooFar)
        );
    }

    #[test]
    fn rfc3339_dates() {
        let t = |s: &str| parse_rfc3339(s.as_bytes());
        let nov_30 = at(NOV_30);
        for same in [
            "2026-11-30T12:00:00Z",
            "2026-11-30t12:00:00z",
            "2026-11-30 12:00:00Z",
            "2026-11-30T13:00:00+01:00",
            "2026-11-30T06:30:00-05:30",
            "2026-12-01T11:59:00+23:59",
            "2026-11-30T12:00:00-00:00",
            "2026-11-30T12:00:00.000Z",
            " 2026-11-30T12:00:00Z ",
        ] {
            assert_eq!(t(same), Ok(nov_30), "{same}");
        }
        assert_eq!(t("2026-11-30T12:00:00.25Z"), Ok(nov_30 + ms(250)));
        assert_eq!(
            t("2026-11-30T12:00:00.123456789123Z"),
            Ok(nov_30 + Duration::from_nanos(123_456_789))
        );
        assert_eq!(t("1970-01-01T00:00:00Z"), Ok(UNIX_EPOCH));
        assert_eq!(t("2024-02-29T00:00:00Z"), Ok(at(1_709_164_800)));
        assert_eq!(t("2000-02-29T00:00:00Z"), Ok(at(951_782_400)));
        assert_eq!(t("2026-11-30T11:59:60Z"), Ok(nov_30)); // a leap second
        assert_eq!(t("1969-12-31T23:59:59Z"), Ok(UNIX_EPOCH - secs(1)));
        assert_eq!(t(""), Err(Malformed::Empty));
        for bad in [
            "2026-13-01T00:00:00Z",
            "2026-00-01T00:00:00Z",
            "2026-11-00T00:00:00Z",
            "2026-04-31T00:00:00Z",
            "2023-02-29T00:00:00Z",
            "1900-02-29T00:00:00Z",
            "2026-11-30T24:00:00Z",
            "2026-11-30T12:60:00Z",
            "2026-11-30T12:00:61Z",
            "2026-11-30T12:00:00",
            "2026-11-30",
            "2026-11-30T12:00Z",
            "2026-11-30T12:00:00+0100",
            "2026-11-30T12:00:00+24:00",
            "2026-11-30T12:00:00+01:60",
            "2026-11-30T12:00:00.Z",
            "2026-11-30T12:00:00ZZ",
            "2026-11-30X12:00:00Z",
            "2026/11/30T12:00:00Z",
            "+2026-11-30T12:00:00Z",
            "26-11-30T12:00:00Z",
            "2026-1-30T12:00:00Z",
            "2026-11-30T12:00:00 Z",
            "１０26-11-30T12:00:00Z",
        ] {
            assert_eq!(t(bad), Err(Malformed::BadRfc3339), "{bad}");
        }

        let wait = |s: &str, now| parse_reset(s.as_bytes(), ResetFormat::Rfc3339, now, YEAR);
        assert_eq!(wait("2026-11-30T12:00:30Z", nov_30), Ok(secs(30)));
        assert_eq!(wait("2026-11-30T11:00:00Z", nov_30), Ok(Duration::ZERO));
        // Go's zero time, which Go servers send for "no reset": long past, so "now".
        assert_eq!(wait("0001-01-01T00:00:00Z", nov_30), Ok(Duration::ZERO));
        assert_eq!(wait("9999-12-31T23:59:59Z", nov_30), Err(Malformed::TooFar));
        assert_eq!(wait("2027-12-01T12:00:00Z", nov_30), Ok(YEAR));
        assert_eq!(wait("2027-12-01T12:00:00.000000001Z", nov_30), Err(Malformed::TooFar));
    }

    #[test]
    fn unix_or_delta_splits_at_ten_to_the_ninth() {
        // 2027-01-15T08:00:00Z.
        let now = at(1_800_000_000);
        let far = LONGEST_MAX_PLAUSIBLE;
        let read = |s: &str, max| parse_reset(s.as_bytes(), ResetFormat::UnixOrDelta, now, max);
        assert_eq!(read("999999999", far), Ok(secs(999_999_999)));
        assert_eq!(read("999999999", YEAR), Err(Malformed::TooFar));
        assert_eq!(read("999999999.9", far), Ok(secs(999_999_999) + ms(900)));
        assert_eq!(read("1000000000", far), Ok(Duration::ZERO)); // 2001: long past
        assert_eq!(read("60", YEAR), Ok(secs(60)));
        assert_eq!(read("0", YEAR), Ok(Duration::ZERO));
        assert_eq!(read("1800000060", YEAR), Ok(secs(60)));
        assert_eq!(read("1800000060.5", YEAR), Ok(ms(60_500)));
        assert_eq!(read("1799999999", YEAR), Ok(Duration::ZERO));
        // Unix milliseconds read as seconds: thousands of years away.
        assert_eq!(read("1800000060000", YEAR), Err(Malformed::TooFar));
        assert_eq!(read("-60", YEAR), Err(Malformed::Negative));
        assert_eq!(read("6m0s", YEAR), Err(Malformed::NotANumber));
    }

    #[test]
    fn each_reset_format() {
        let now = at(1_800_000_000);
        let read = |s: &str, f| parse_reset(s.as_bytes(), f, now, YEAR);
        assert_eq!(read("1800000030", ResetFormat::UnixSeconds), Ok(secs(30)));
        assert_eq!(read("0", ResetFormat::UnixSeconds), Ok(Duration::ZERO));
        assert_eq!(read("30", ResetFormat::UnixSeconds), Ok(Duration::ZERO));
        assert_eq!(read("1800000030500", ResetFormat::UnixMillis), Ok(ms(30_500)));
        assert_eq!(read("1800000030", ResetFormat::UnixMillis), Ok(Duration::ZERO));
        assert_eq!(read("1800000030", ResetFormat::DeltaSeconds), Err(Malformed::TooFar));
        assert_eq!(read("30", ResetFormat::DeltaSeconds), Ok(secs(30)));
        assert_eq!(read("Fri, 15 Jan 2027 08:00:30 GMT", ResetFormat::HttpDate), Ok(secs(30)));
        assert_eq!(read("30", ResetFormat::HttpDate), Err(Malformed::BadHttpDate));
        assert_eq!(read("2027-01-15T08:00:30Z", ResetFormat::Rfc3339), Ok(secs(30)));
        assert_eq!(read("30s", ResetFormat::GoDuration), Ok(secs(30)));
        for format in ResetFormat::ALL {
            assert!(read("", format).is_err(), "{format}");
            assert_eq!(format.as_str().parse::<ResetFormat>(), Ok(format));
            assert_eq!(format.to_string(), format.as_str());
        }
        assert_eq!(" rfc3339 ".parse::<ResetFormat>(), Ok(ResetFormat::Rfc3339));
        let err = "iso8601".parse::<ResetFormat>().unwrap_err();
        assert!(err.to_string().starts_with("`iso8601` is not a reset format"), "{err}");
    }

    #[test]
    fn a_wall_clock_before_the_epoch_still_works() {
        let now = UNIX_EPOCH - secs(10);
        assert_eq!(parse_reset(b"0", ResetFormat::UnixSeconds, now, YEAR), Ok(secs(10)));
        assert_eq!(
            parse_reset(b"1969-12-31T23:59:55Z", ResetFormat::Rfc3339, now, YEAR),
            Ok(secs(5))
        );
    }

    #[test]
    fn malformed_messages_are_lowercase_without_a_period() {
        for m in [
            Malformed::Empty,
            Malformed::NotANumber,
            Malformed::Negative,
            Malformed::Overflow,
            Malformed::TooFar,
            Malformed::BadHttpDate,
            Malformed::BadRfc3339,
            Malformed::BadDuration,
        ] {
            let text = m.to_string();
            assert!(text.chars().next().unwrap().is_lowercase() && !text.ends_with('.'), "{text}");
        }
    }

    // ---- readers ------------------------------------------------------------------------------

    fn pushback_of(pairs: &[(&str, &str)], status: u16) -> (Option<Pushback>, HeaderStatsSnapshot) {
        let stats = HeaderStats::new();
        let status = StatusCode::from_u16(status).unwrap();
        let p = PushbackHeaders::default().read_pushback(&map(pairs), status, at(NOV_30), &stats);
        (p, stats.snapshot())
    }

    fn after(d: Duration) -> Option<Pushback> {
        Some(Pushback::RetryAfter(d))
    }

    #[test]
    fn retry_after_counts_on_429_and_503_only() {
        for status in [429, 503] {
            assert_eq!(pushback_of(&[("Retry-After", "3")], status).0, after(secs(3)));
            assert_eq!(pushback_of(&[("retry-after-ms", "250")], status).0, after(ms(250)));
            assert_eq!(pushback_of(&[("x-ms-retry-after-ms", "250")], status).0, after(ms(250)));
        }
        for status in [200, 302, 400, 500, 502, 504] {
            let (p, stats) = pushback_of(&[("retry-after", "3"), ("retry-after-ms", "x")], status);
            assert_eq!(p, None, "{status}");
            // Not read, so not counted.
            assert_eq!(stats.total(), 0);
        }
        assert_eq!(
            pushback_of(&[("retry-after", "Mon, 30 Nov 2026 12:00:10 GMT")], 503).0,
            after(secs(10))
        );
    }

    #[test]
    fn the_strictest_statement_wins() {
        // Several explicit waits: the longest.
        assert_eq!(
            pushback_of(&[("retry-after", "2"), ("retry-after-ms", "2500")], 429).0,
            after(ms(2_500))
        );
        assert_eq!(
            pushback_of(&[("retry-after", "1"), ("retry-after", "4"), ("retry-after", "2")], 429).0,
            after(secs(4))
        );
        // A gRPC don't-retry beats any wait.
        assert_eq!(
            pushback_of(&[("retry-after", "1"), ("grpc-retry-pushback-ms", "-1")], 429).0,
            Some(Pushback::DontRetry)
        );
        assert_eq!(
            pushback_of(&[("retry-after", "1"), ("grpc-retry-pushback-ms", "3000")], 429).0,
            after(secs(3))
        );
        // An explicit wait beats the reset headers, even a longer one.
        assert_eq!(
            pushback_of(&[("retry-after", "1"), ("x-ratelimit-reset-requests", "6m0s")], 429).0,
            after(secs(1))
        );
        // A malformed explicit wait leaves the resets to speak.
        let (p, stats) =
            pushback_of(&[("retry-after", "soon"), ("x-ratelimit-reset-requests", "6m0s")], 429);
        assert_eq!(p, after(secs(360)));
        assert_eq!(stats.get(HeaderKind::RetryAfter), 1);
        // Several lines: the bad one counted, the good one used.
        let (p, stats) = pushback_of(&[("retry-after", "-1"), ("retry-after", "5")], 503);
        assert_eq!(p, after(secs(5)));
        assert_eq!(stats.get(HeaderKind::RetryAfter), 1);
    }

    #[test]
    fn grpc_pushback_on_any_status() {
        for status in [200, 429, 503] {
            assert_eq!(pushback_of(&[("grpc-retry-pushback-ms", "150")], status).0, after(ms(150)));
            for dont in ["-1", "-300"] {
                let (p, stats) = pushback_of(&[("grpc-retry-pushback-ms", dont)], status);
                assert_eq!(p, Some(Pushback::DontRetry));
                assert_eq!(stats.total(), 0, "a negative pushback is not malformed");
            }
            for garbage in ["", "abc", "1.5", "99999999999999999999"] {
                let (p, stats) = pushback_of(&[("grpc-retry-pushback-ms", garbage)], status);
                assert_eq!(p, Some(Pushback::DontRetry), "{garbage:?}");
                assert_eq!(stats.get(HeaderKind::GrpcPushback), 1);
            }
        }
        // Several values: do not retry (as grpc-go reads A6).
        let (p, stats) =
            pushback_of(&[("grpc-retry-pushback-ms", "10"), ("grpc-retry-pushback-ms", "20")], 200);
        assert_eq!(p, Some(Pushback::DontRetry));
        assert_eq!(stats.get(HeaderKind::GrpcPushback), 1);
    }

    #[test]
    fn provider_reset_headers() {
        // OpenAI style: Go durations, one per limit.
        assert_eq!(pushback_of(&[("x-ratelimit-reset-requests", "6m0s")], 429).0, after(secs(360)));
        assert_eq!(pushback_of(&[("x-ratelimit-reset-tokens", "7.66s")], 429).0, after(ms(7_660)));
        // Anthropic style: RFC 3339.
        assert_eq!(
            pushback_of(&[("anthropic-ratelimit-tokens-reset", "2026-11-30T12:00:42Z")], 429).0,
            after(secs(42))
        );
        // Both windows given, no remaining counters: the longer.
        let both = [("x-ratelimit-reset-requests", "1s"), ("x-ratelimit-reset-tokens", "6m0s")];
        assert_eq!(pushback_of(&both, 429).0, after(secs(360)));
        // With counters: only the exhausted window's reset counts.
        let paired = [
            ("x-ratelimit-reset-requests", "1s"),
            ("x-ratelimit-remaining-requests", "0"),
            ("x-ratelimit-reset-tokens", "6m0s"),
            ("x-ratelimit-remaining-tokens", "15000"),
        ];
        assert_eq!(pushback_of(&paired, 429).0, after(secs(1)));
        let anthropic = [
            ("anthropic-ratelimit-requests-reset", "2026-11-30T12:00:01Z"),
            ("anthropic-ratelimit-requests-remaining", "3"),
            ("anthropic-ratelimit-tokens-reset", "2026-11-30T12:00:20Z"),
            ("anthropic-ratelimit-tokens-remaining", "0"),
        ];
        assert_eq!(pushback_of(&anthropic, 429).0, after(secs(20)));
        // Resets are pushback on 429/503 only, unless their counter is 0.
        assert_eq!(pushback_of(&[("x-ratelimit-reset-requests", "6m0s")], 500).0, None);
        assert_eq!(pushback_of(&[("ratelimit-reset", "30")], 500).0, None);
    }

    #[test]
    fn an_exhausted_counter_makes_a_reset_pushback_on_any_status() {
        // GitHub: 403 with the primary limit exhausted.
        let github = [("x-ratelimit-remaining", "0"), ("x-ratelimit-reset", "1796040090")];
        assert_eq!(pushback_of(&github, 403).0, after(secs(90)));
        // A secondary limit (remaining > 0): the hourly reset is not the window to wait for.
        let secondary = [("x-ratelimit-remaining", "4000"), ("x-ratelimit-reset", "1796043600")];
        assert_eq!(pushback_of(&secondary, 403).0, None);
        assert_eq!(pushback_of(&secondary, 429).0, None);
        // IETF draft headers, delta seconds.
        assert_eq!(
            pushback_of(&[("ratelimit-remaining", "0"), ("ratelimit-reset", "30")], 200).0,
            after(secs(30))
        );
        // An unreadable counter is as good as none.
        let unreadable = [("x-ratelimit-remaining", "lots"), ("x-ratelimit-reset", "30")];
        assert_eq!(pushback_of(&unreadable, 403).0, None);
        assert_eq!(pushback_of(&unreadable, 429).0, after(secs(30)));
    }

    #[test]
    fn malformed_and_implausible_resets_are_ignored_and_counted() {
        for (name, value) in [
            ("x-ratelimit-reset", "-5"),
            ("x-ratelimit-reset", "1796040000000"), // milliseconds
            ("x-ratelimit-reset", "999999999"),     // 31 years
            ("ratelimit-reset", "soon"),
            ("anthropic-ratelimit-requests-reset", "2026-13-01T00:00:00Z"),
            ("anthropic-ratelimit-requests-reset", "9999-12-31T23:59:59Z"),
            ("x-ratelimit-reset-tokens", "6min"),
            ("x-ratelimit-reset-tokens", "60"),
            ("x-ratelimit-reset-tokens", "-1s"),
        ] {
            let (p, stats) = pushback_of(&[(name, value)], 429);
            assert_eq!(p, None, "{name}: {value}");
            assert_eq!(stats.get(HeaderKind::Reset), 1, "{name}: {value}");
            assert_eq!(stats.total(), 1);
        }
    }

    #[test]
    fn configured_names_and_formats() {
        let config = PushbackHeadersConfig {
            statuses: vec![429, 502],
            retry_after: vec!["X-Wait".to_string()],
            retry_after_ms: vec![],
            grpc_retry_pushback_ms: vec![],
            resets: vec![
                ResetHeader::new("x-rate-limit-reset", ResetFormat::HttpDate),
                ResetHeader::new("X-Acme-*-Reset", ResetFormat::UnixMillis),
                ResetHeader::new("x-acme-*", ResetFormat::DeltaSeconds),
            ],
            max_plausible: secs(3_600),
        };
        let headers = PushbackHeaders::try_new(config).unwrap();
        let stats = HeaderStats::new();
        let now = at(NOV_30);
        let read = |pairs: &[(&str, &str)], status| {
            headers.read_pushback(&map(pairs), StatusCode::from_u16(status).unwrap(), now, &stats)
        };
        assert_eq!(read(&[("x-wait", "7")], 502), after(secs(7)));
        assert_eq!(read(&[("x-wait", "7")], 503), None);
        assert_eq!(read(&[("retry-after", "7")], 429), None);
        assert_eq!(read(&[("grpc-retry-pushback-ms", "-1")], 429), None);
        assert_eq!(
            read(&[("x-rate-limit-reset", "Mon, 30 Nov 2026 12:00:05 GMT")], 429),
            after(secs(5))
        );
        // The first matching rule decides the format.
        assert_eq!(read(&[("x-acme-quota-reset", "1796040000250")], 429), after(ms(250)));
        assert_eq!(read(&[("x-acme-other", "9")], 429), after(secs(9)));
        // max_plausible of an hour.
        assert_eq!(read(&[("x-wait", "3601")], 429), None);
        assert_eq!(stats.get(HeaderKind::RetryAfter), 1);
        assert_eq!(headers.config().max_plausible, secs(3_600));
    }

    #[test]
    fn refuses_bad_configs() {
        let with = |f: &dyn Fn(&mut PushbackHeadersConfig)| {
            let mut c = PushbackHeadersConfig::default();
            f(&mut c);
            PushbackHeaders::try_new(c).map(|_| ())
        };
        assert_eq!(with(&|_| {}), Ok(()));
        assert_eq!(with(&|c| c.statuses = vec![42]), Err(HeaderConfigError::BadStatus(42)));
        assert_eq!(
            with(&|c| c.retry_after = vec!["bad name".to_string()]),
            Err(HeaderConfigError::BadName("bad name".to_string()))
        );
        for pattern in ["*", "a-*-*", "a b-*", "x-*-\u{e9}"] {
            assert_eq!(
                with(&|c| c.resets = vec![ResetHeader::new(pattern, ResetFormat::UnixSeconds)]),
                Err(HeaderConfigError::BadPattern(pattern.to_string())),
                "{pattern}"
            );
        }
        for max in [Duration::ZERO, ms(999), LONGEST_MAX_PLAUSIBLE + secs(1)] {
            assert_eq!(with(&|c| c.max_plausible = max), Err(HeaderConfigError::MaxPlausible(max)));
        }
        assert_eq!(with(&|c| c.max_plausible = LONGEST_MAX_PLAUSIBLE), Ok(()));
        let mut limits = LimitHeadersConfig::default();
        limits.remaining.push(String::new());
        assert_eq!(
            LimitHeaders::try_new(limits).unwrap_err(),
            HeaderConfigError::BadName(String::new())
        );
        assert_eq!(
            HeaderConfigError::MaxPlausible(Duration::ZERO).to_string(),
            "max_plausible must be from 1s to 100 years, got 0ns"
        );
    }

    #[test]
    fn stricter_orders_dont_retry_then_longest() {
        use Pushback::{DontRetry, RetryAfter};
        let (a, b) = (Some(RetryAfter(secs(1))), Some(RetryAfter(secs(2))));
        assert_eq!(stricter(a, b), b);
        assert_eq!(stricter(b, a), b);
        assert_eq!(stricter(a, None), a);
        assert_eq!(stricter(None, a), a);
        assert_eq!(stricter(None, None), None);
        assert_eq!(stricter(a, Some(DontRetry)), Some(DontRetry));
        assert_eq!(stricter(Some(DontRetry), None), Some(DontRetry));
    }

    fn limits_of(pairs: &[(&str, &str)]) -> (LimitInfo, HeaderStatsSnapshot) {
        let stats = HeaderStats::new();
        let info = LimitHeaders::default().read_limits(&map(pairs), at(NOV_30), &stats);
        (info, stats.snapshot())
    }

    #[test]
    fn limits_take_the_most_conservative_value() {
        assert_eq!(limits_of(&[]).0, LimitInfo::default());
        assert!(limits_of(&[]).0.is_empty());
        let (info, stats) = limits_of(&[
            ("x-concurrency-limit-limit", "12"),
            ("x-concurrency-limit-limit", "9"),
            ("x-concurrency-limit-remaining", "4"),
            ("ratelimit-remaining", "7"),
            ("x-ratelimit-remaining", "2"),
            ("ratelimit-reset", "30"),
            ("x-ratelimit-reset", "1796040060"),
        ]);
        assert_eq!(info, LimitInfo { limit: Some(9), remaining: Some(2), reset: Some(secs(60)) });
        assert!(!info.is_empty());
        assert_eq!(stats.total(), 0);
        assert_eq!(limits_of(&[("x-concurrency-limit-limit", "0")]).0.limit, Some(0));
        assert_eq!(limits_of(&[("x-ratelimit-reset", "1796030000")]).0.reset, Some(Duration::ZERO));
    }

    #[test]
    fn malformed_limits_are_ignored_and_counted() {
        let (info, stats) = limits_of(&[
            ("x-concurrency-limit-limit", "-3"),
            ("x-concurrency-limit-limit", "lots"),
            ("x-concurrency-limit-limit", "8"),
            ("x-concurrency-limit-remaining", "1.5"),
            ("ratelimit-remaining", "99999999999999999999999"),
            ("x-ratelimit-reset", "1796040000000"),
            ("ratelimit-reset", ""),
        ]);
        assert_eq!(info, LimitInfo { limit: Some(8), remaining: None, reset: None });
        assert_eq!(stats.get(HeaderKind::Limit), 2);
        assert_eq!(stats.get(HeaderKind::Remaining), 2);
        assert_eq!(stats.get(HeaderKind::Reset), 2);
        assert_eq!(stats.total(), 6);
    }

    #[test]
    fn non_utf8_header_values_are_counted_not_fatal() {
        let mut headers = HeaderMap::new();
        for name in ["retry-after", "retry-after-ms", "x-ratelimit-reset-tokens"] {
            headers.insert(name, HeaderValue::from_bytes(b"\xfa\xfb").unwrap());
        }
        headers.insert("x-concurrency-limit-limit", HeaderValue::from_bytes(b"\xff").unwrap());
        let stats = HeaderStats::new();
        let status = StatusCode::TOO_MANY_REQUESTS;
        assert_eq!(
            PushbackHeaders::default().read_pushback(&headers, status, at(NOV_30), &stats),
            None
        );
        assert!(LimitHeaders::default().read_limits(&headers, at(NOV_30), &stats).is_empty());
        let snapshot = stats.snapshot();
        assert_eq!(snapshot.total(), 4);
        for kind in HeaderKind::ALL {
            assert_eq!(snapshot.get(kind), stats.get(kind), "{kind}");
        }
    }

    // ---- formatters for the round trips (test-only) -------------------------------------------

    /// As Go's `time.Duration.String()` prints it.
    fn go_format(d: Duration) -> String {
        let n = u64::try_from(d.as_nanos()).unwrap();
        let fraction = |rest: u64, scale: u64| {
            let digits = scale.ilog10() as usize;
            let text = format!("{rest:0digits$}");
            let text = text.trim_end_matches('0');
            if text.is_empty() { String::new() } else { format!(".{text}") }
        };
        if n == 0 {
            return "0s".to_string();
        }
        if n < NANOS_PER_SEC {
            let (unit, scale) = if n < 1_000 {
                ("ns", 1)
            } else if n < 1_000_000 {
                ("µs", 1_000)
            } else {
                ("ms", 1_000_000)
            };
            let frac = if scale == 1 { String::new() } else { fraction(n % scale, scale) };
            return format!("{}{frac}{unit}", n / scale);
        }
        let frac = fraction(n % NANOS_PER_SEC, NANOS_PER_SEC);
        let s = n / NANOS_PER_SEC;
        match (s / 3_600, s / 60 % 60, s % 60) {
            (0, 0, sec) => format!("{sec}{frac}s"),
            (0, min, sec) => format!("{min}m{sec}{frac}s"),
            (h, min, sec) => format!("{h}h{min}m{sec}{frac}s"),
        }
    }

    #[test]
    fn go_format_matches_go() {
        for (d, go) in [
            (secs(360), "6m0s"),
            (secs(3_600), "1h0m0s"),
            (ms(1_500), "1.5s"),
            (ms(250), "250ms"),
            (Duration::from_nanos(1_500), "1.5µs"),
            (Duration::from_nanos(3_723_500_000_000), "1h2m3.5s"),
            (Duration::from_nanos(u64::MAX), "5124095h34m33.709551615s"),
            (Duration::ZERO, "0s"),
        ] {
            assert_eq!(go_format(d), go);
        }
    }

    /// Howard Hinnant's `civil_from_days`: the inverse of [`days_from_civil`].
    fn civil_from_days(days: i64) -> (i64, i64, i64) {
        let z = days + 719_468;
        let era = z.div_euclid(146_097);
        let doe = z - era * 146_097;
        let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
        let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
        let mp = (5 * doy + 2) / 153;
        let day = doy - (153 * mp + 2) / 5 + 1;
        let month = if mp < 10 { mp + 3 } else { mp - 9 };
        (yoe + era * 400 + i64::from(month <= 2), month, day)
    }

    /// RFC 3339 text for `unix_secs` + `nanos`, written at an offset of `offset_min` minutes.
    fn rfc3339_format(unix_secs: i64, nanos: u32, offset_min: i64) -> String {
        let local = unix_secs + offset_min * 60;
        let (y, mo, d) = civil_from_days(local.div_euclid(86_400));
        let s = local.rem_euclid(86_400);
        let frac = if nanos == 0 { String::new() } else { format!(".{nanos:09}") };
        let offset = match offset_min {
            0 => "Z".to_string(),
            m => {
                format!("{}{:02}:{:02}", if m < 0 { '-' } else { '+' }, m.abs() / 60, m.abs() % 60)
            }
        };
        format!(
            "{y:04}-{mo:02}-{d:02}T{:02}:{:02}:{:02}{frac}{offset}",
            s / 3_600,
            s / 60 % 60,
            s % 60
        )
    }

    #[test]
    fn rfc3339_format_anchors() {
        assert_eq!(rfc3339_format(0, 0, 0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339_format(NOV_30 as i64, 0, 60), "2026-11-30T13:00:00+01:00");
        assert_eq!(rfc3339_format(-62_135_596_800, 5, -90), "0000-12-31T22:30:00.000000005-01:30");
        assert_eq!(civil_from_days(19_782), (2024, 2, 29));
    }

    /// The three HTTP-date forms of one instant (1970–9999).
    fn http_date_forms(unix_secs: u64) -> [String; 3] {
        const DAYS: [&str; 7] =
            ["Thursday", "Friday", "Saturday", "Sunday", "Monday", "Tuesday", "Wednesday"];
        const MONTHS: [&str; 12] =
            ["Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"];
        let days = (unix_secs / 86_400) as i64;
        let (y, m, d) = civil_from_days(days);
        let weekday = DAYS[days.rem_euclid(7) as usize];
        let month = MONTHS[(m - 1) as usize];
        let s = unix_secs % 86_400;
        let time = format!("{:02}:{:02}:{:02}", s / 3_600, s / 60 % 60, s % 60);
        [
            format!("{}, {d:02} {month} {y:04} {time} GMT", &weekday[..3]),
            format!("{weekday}, {d:02}-{month}-{:02} {time} GMT", y % 100),
            format!("{} {month} {d:>2} {time} {y:04}", &weekday[..3]),
        ]
    }

    #[test]
    fn http_date_forms_anchor() {
        assert_eq!(
            http_date_forms(784_111_777),
            [
                "Sun, 06 Nov 1994 08:49:37 GMT".to_string(),
                "Sunday, 06-Nov-94 08:49:37 GMT".to_string(),
                "Sun Nov  6 08:49:37 1994".to_string(),
            ]
        );
        assert_eq!(http_date_forms(0)[0], httpdate::fmt_http_date(UNIX_EPOCH));
    }

    /// Byte strings that look like header values: mostly the characters the parsers care about.
    fn near_valid() -> impl Strategy<Value = Vec<u8>> {
        prop_oneof![
            proptest::collection::vec(any::<u8>(), 0..48),
            "[0-9 .:+\\-TZtzsmhnuµμ,]{0,32}".prop_map(String::into_bytes),
            "[0-9]{1,30}(\\.[0-9]{0,25})?".prop_map(String::into_bytes),
            "[-+]?([0-9]{0,3}(\\.[0-9]{0,3})?(ns|us|µs|ms|s|m|h|x)?){0,4}".prop_map(String::into_bytes),
            "[0-9]{4}-[0-9]{2}-[0-9]{2}[Tt ][0-9]{2}:[0-9]{2}:[0-9]{2}(\\.[0-9]{0,12})?(Z|[+-][0-9]{2}:[0-9]{2})?"
                .prop_map(String::into_bytes),
            "(Sun|Mon|Sunday), [0-9 ]{2}[ -](Nov|Feb)[ -][0-9]{2,4} [0-9]{2}:[0-9]{2}:[0-9]{2}( GMT)?"
                .prop_map(String::into_bytes),
        ]
    }

    fn any_wall_clock() -> impl Strategy<Value = SystemTime> {
        (any::<bool>(), 0u64..=1 << 40, 0u32..1_000_000_000).prop_map(|(before, s, n)| {
            let d = Duration::new(s, n);
            if before { UNIX_EPOCH - d } else { UNIX_EPOCH + d }
        })
    }

    fn any_format() -> impl Strategy<Value = ResetFormat> {
        proptest::sample::select(ResetFormat::ALL.to_vec())
    }

    proptest! {
        #[test]
        fn no_bytes_make_a_parser_panic(
            value in near_valid(),
            now in any_wall_clock(),
            max_nanos: u64,
            format in any_format(),
        ) {
            let max = Duration::from_nanos(max_nanos);
            if let Ok(d) = parse_retry_after(&value, now, max) { prop_assert!(d <= max); }
            if let Ok(d) = parse_retry_after_ms(&value, max) { prop_assert!(d <= max); }
            if let Ok(d) = parse_reset(&value, format, now, max) { prop_assert!(d <= max); }
            let _ = parse_grpc_pushback(&value);
            let _ = parse_count(&value);
            let _ = parse_go_duration(&value);
            let _ = parse_rfc3339(&value);
        }

        #[test]
        fn no_header_map_makes_a_reader_panic(
            pairs in proptest::collection::vec(
                (
                    proptest::sample::select(vec![
                        "retry-after", "retry-after-ms", "x-ms-retry-after-ms",
                        "grpc-retry-pushback-ms", "x-ratelimit-reset", "ratelimit-reset",
                        "x-ratelimit-remaining", "ratelimit-remaining",
                        "anthropic-ratelimit-requests-reset",
                        "anthropic-ratelimit-requests-remaining",
                        "x-ratelimit-reset-tokens", "x-ratelimit-remaining-tokens",
                        "x-concurrency-limit-limit", "x-concurrency-limit-remaining",
                    ]),
                    near_valid(),
                ),
                0..8,
            ),
            status in 100u16..600,
            now in any_wall_clock(),
        ) {
            let mut headers = HeaderMap::new();
            for (name, value) in pairs {
                if let Ok(value) = HeaderValue::from_bytes(&value) {
                    headers.append(name, value);
                }
            }
            let stats = HeaderStats::new();
            let status = StatusCode::from_u16(status).unwrap();
            let pushback = PushbackHeaders::default().read_pushback(&headers, status, now, &stats);
            // gRPC pushback has no max_plausible (core's max_pushback refuses a long one).
            if let Some(Pushback::RetryAfter(d)) = pushback
                && !headers.contains_key("grpc-retry-pushback-ms")
            {
                prop_assert!(d <= DEFAULT_MAX_PLAUSIBLE);
            }
            let info = LimitHeaders::default().read_limits(&headers, now, &stats);
            prop_assert!(info.reset.is_none_or(|d| d <= DEFAULT_MAX_PLAUSIBLE));
        }

        #[test]
        fn delta_seconds_and_millis_round_trip(s in 0u64..=31_622_400, m in 0u64..=31_622_400_000) {
            let now = at(NOV_30);
            prop_assert_eq!(parse_retry_after(s.to_string().as_bytes(), now, YEAR), Ok(secs(s)));
            prop_assert_eq!(
                parse_reset(s.to_string().as_bytes(), ResetFormat::DeltaSeconds, now, YEAR),
                Ok(secs(s))
            );
            prop_assert_eq!(parse_retry_after_ms(m.to_string().as_bytes(), YEAR), Ok(ms(m)));
            prop_assert_eq!(
                parse_grpc_pushback(m.to_string().as_bytes()),
                Ok(Pushback::RetryAfter(ms(m)))
            );
            prop_assert_eq!(parse_count(m.to_string().as_bytes()), Ok(m));
            if m > 0 {
                prop_assert_eq!(
                    parse_grpc_pushback(format!("-{m}").as_bytes()),
                    Ok(Pushback::DontRetry)
                );
            }
        }

        #[test]
        fn go_durations_round_trip(nanos in 0u64..=u64::MAX, small in 0u64..=3_600_000_000_000) {
            for n in [nanos, small] {
                let d = Duration::from_nanos(n);
                let text = go_format(d);
                prop_assert_eq!(parse_go_duration(text.as_bytes()), Ok(d), "{}", text);
            }
        }

        #[test]
        fn rfc3339_round_trips(
            // 0000-01-01T00:00:00Z ..= 9999-12-31T23:59:59Z, kept inside 0000–9999 locally.
            unix_secs in -62_167_219_200i64 + 86_400..=253_402_300_799 - 86_400,
            nanos in 0u32..1_000_000_000,
            offset_min in -(23 * 60 + 59)..=23i64 * 60 + 59,
            now_secs in 0u64..=4_102_444_800,
        ) {
            let text = rfc3339_format(unix_secs, nanos, offset_min);
            let want = i128::from(unix_secs) * 1_000_000_000 + i128::from(nanos);
            prop_assert_eq!(rfc3339_unix_nanos(text.as_bytes()), Ok(want), "{}", &text);
            let now = at(now_secs);
            let wait = want - i128::from(now_secs) * 1_000_000_000;
            let got = parse_reset(text.as_bytes(), ResetFormat::Rfc3339, now, YEAR);
            if wait <= 0 {
                prop_assert_eq!(got, Ok(Duration::ZERO));
            } else if wait <= YEAR.as_nanos() as i128 {
                prop_assert_eq!(got, Ok(nanos_to_duration(wait as u128)));
            } else {
                prop_assert_eq!(got, Err(Malformed::TooFar));
            }
        }

        #[test]
        fn http_dates_round_trip_in_every_form(
            now_secs in 0u64..=253_402_300_799 - 31_622_400,
            ahead in 0u64..=31_622_400,
            behind in 0u64..=1_000_000,
        ) {
            let now = at(now_secs);
            let target = now_secs + ahead;
            let [imf, rfc850, asctime] = http_date_forms(target);
            prop_assert_eq!(&imf, &httpdate::fmt_http_date(at(target)));
            prop_assert_eq!(parse_retry_after(imf.as_bytes(), now, YEAR), Ok(secs(ahead)));
            prop_assert_eq!(parse_retry_after(asctime.as_bytes(), now, YEAR), Ok(secs(ahead)));
            // RFC 850 has a two-digit year, which httpdate reads as 1970–2069.
            let (year, ..) = civil_from_days((target / 86_400) as i64);
            if (1970..2070).contains(&year) {
                prop_assert_eq!(parse_retry_after(rfc850.as_bytes(), now, YEAR), Ok(secs(ahead)));
            }
            // A date in the past is a zero wait.
            let past = httpdate::fmt_http_date(at(now_secs.saturating_sub(behind)));
            prop_assert_eq!(parse_retry_after(past.as_bytes(), now, YEAR), Ok(Duration::ZERO));
        }

        #[test]
        fn unix_resets_round_trip(
            now_secs in UNIX_THRESHOLD..=4_102_444_800,
            ahead in 0u64..=31_622_400,
            millis in 0u64..1_000,
        ) {
            let now = at(now_secs);
            let target = now_secs + ahead;
            for format in [ResetFormat::UnixOrDelta, ResetFormat::UnixSeconds] {
                prop_assert_eq!(
                    parse_reset(target.to_string().as_bytes(), format, now, YEAR),
                    Ok(secs(ahead))
                );
            }
            let target_ms = format!("{target}{millis:03}");
            prop_assert_eq!(
                parse_reset(target_ms.as_bytes(), ResetFormat::UnixMillis, now, YEAR),
                Ok(secs(ahead) + ms(millis))
            );
            // Below 10^9, the same format reads a wait from now.
            let delta = ahead.min(UNIX_THRESHOLD - 1);
            prop_assert_eq!(
                parse_reset(delta.to_string().as_bytes(), ResetFormat::UnixOrDelta, now, YEAR),
                Ok(secs(delta))
            );
        }
    }
}
