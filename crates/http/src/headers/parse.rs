//! The pure parsers: one header value in bytes, a typed [`Malformed`] reason out.

use super::*;

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
            plausible(parse_number(text, true)?.floor_mul(NANOS_PER_SEC), max_plausible)
        }
        Some(_) => until(http_date_nanos(text)?, now_wall, max_plausible),
    }
}

/// `retry-after-ms` (and Azure's `x-ms-retry-after-ms`): a wait in milliseconds. A decimal
/// fraction is accepted (`1500.5`). Errors as for [`parse_retry_after`]'s delta-seconds.
pub fn parse_retry_after_ms(value: &[u8], max_plausible: Duration) -> Result<Duration, Malformed> {
    plausible(parse_number(value, true)?.floor_mul(NANOS_PER_MILLI), max_plausible)
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
    let (number, rest) = Digits::lex(digits);
    if number.int.is_empty() || number.frac.is_some() || !rest.is_empty() {
        return Err(Malformed::NotANumber);
    }
    let millis = number.value().ok_or(Malformed::Overflow)?.int();
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
    Ok(parse_number(value, false)?.int())
}

/// A Go-style duration (what Go's `time.Duration` prints and `time.ParseDuration` reads):
/// `6m0s`, `1h2m3.5s`, `250ms`, `1.5µs`, `0`. Units `ns`, `us` (or `µs`, `μs`), `ms`, `s`, `m`,
/// `h`; each component may have a decimal fraction; a leading `+` is allowed. Read by core's one
/// duration grammar in its Go syntax ([`DurationSyntax::Go`]), after trimming whitespace.
///
/// Errors: [`Malformed::Empty`], [`Negative`](Malformed::Negative) (`-1s`),
/// [`Overflow`](Malformed::Overflow) (more than `u64::MAX` nanoseconds, about 584 years) and
/// [`BadDuration`](Malformed::BadDuration) for anything else, such as a number without a unit.
pub fn parse_go_duration(value: &[u8]) -> Result<Duration, Malformed> {
    match read_duration(trim_ows(value), DurationSyntax::Go) {
        Ok(d) => Ok(d),
        Err(DurationError::Empty) => Err(Malformed::Empty),
        Err(DurationError::Negative) => Err(Malformed::Negative),
        Err(DurationError::TooLarge) => Err(Malformed::Overflow),
        Err(_) => Err(Malformed::BadDuration),
    }
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
            let nanos = number.floor_mul(NANOS_PER_SEC);
            if number.int() >= UNIX_THRESHOLD {
                until(to_i128(nanos), now_wall, max_plausible)
            } else {
                plausible(nanos, max_plausible)
            }
        }
        ResetFormat::UnixSeconds => until(
            to_i128(parse_number(value, true)?.floor_mul(NANOS_PER_SEC)),
            now_wall,
            max_plausible,
        ),
        ResetFormat::UnixMillis => until(
            to_i128(parse_number(value, true)?.floor_mul(NANOS_PER_MILLI)),
            now_wall,
            max_plausible,
        ),
        ResetFormat::DeltaSeconds => {
            plausible(parse_number(value, true)?.floor_mul(NANOS_PER_SEC), max_plausible)
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
