//! Reading a whole header map for the dependency's own limits: a cap hint, what is left, and when it resets.

use super::*;

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
/// [module docs](crate::headers) and `docs/headers.md`.
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
        if headers.keys_len() < self.limit.len() + self.remaining.len() {
            // A message with fewer names than the list (most): its names compared with the
            // list's, where a lookup would hash each of the list's.
            headers.keys().any(|k| self.limit.contains(k) || self.remaining.contains(k))
        } else {
            self.limit.iter().chain(&self.remaining).any(|name| headers.contains_key(name))
        }
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
