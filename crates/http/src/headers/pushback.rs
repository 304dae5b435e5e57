//! Reading a whole header map for pushback, by configured names and formats.

use super::*;

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
    /// Headers by which the server says whether to retry (`true` / `false`, read on any
    /// status): `false` is "do not retry"; `true` forces nothing (what may be retried stays
    /// `retry_on`'s). Default `["x-should-retry"]` (OpenAI's and Anthropic's, which their SDKs
    /// obey).
    pub should_retry: Vec<String>,
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
            should_retry: vec!["x-should-retry".to_string()],
            resets: default_reset_headers(),
            max_plausible: DEFAULT_MAX_PLAUSIBLE,
        }
    }
}

/// Reads server pushback from a response's headers. See the [module docs](crate::headers) and
/// `docs/headers.md`.
#[derive(Debug, Clone)]
pub struct PushbackHeaders {
    config: PushbackHeadersConfig,
    statuses: Vec<StatusCode>,
    retry_after: Vec<HeaderName>,
    retry_after_ms: Vec<HeaderName>,
    should_retry: Vec<HeaderName>,
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
            should_retry: header_names(&config.should_retry)?,
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
        for name in &self.should_retry {
            for value in headers.get_all(name) {
                let v = value.as_bytes().trim_ascii();
                if v.eq_ignore_ascii_case(b"false") {
                    said = stricter(said, Some(Pushback::DontRetry));
                } else if !v.eq_ignore_ascii_case(b"true") {
                    stats.record(HeaderKind::ShouldRetry);
                }
            }
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
