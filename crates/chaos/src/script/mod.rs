//! The script: phases of faults over time.
//!
//! A budget is proven against a story, not a constant: healthy traffic, then a storm (errors just
//! above the budget, or the slow dependency that trips no breaker), then recovery. A [`Script`] is
//! that story as a list of [`Phase`]s; each phase lasts its `duration`, or until it is advanced by
//! hand (`POST /phase/next`, `SIGUSR1` to `stormguard chaos`, or [`ChaosServer::next_phase`]).
//!
//! ```toml
//! seed = 7                  # the sampler's seed (default 0)
//! repeat = false            # after the last phase: stay in it (false) or start over (true)
//! on_disconnect = "finish"  # or "cancel"
//!
//! [[phase]]
//! name = "healthy"
//! duration = "10s"
//! latency_p50 = "20ms"
//! latency_p99 = "80ms"
//!
//! [[phase]]
//! name = "storm"
//! duration = "30s"
//! error_rate = 0.3
//! status = 503
//! latency = { dist = "pareto", p50 = "50ms", p99 = "2s" }
//! max_concurrency = 20
//!
//! [[phase]]
//! name = "overloaded"       # a provider's burst of 529s (needs [provider] to shape them)
//! duration = "2s"
//! overloaded_rate = 1.0
//!
//! [provider]                # serve as a model provider (see crate::provider)
//! kind = "anthropic"
//! rpm = 50
//! itpm = 30000
//! otpm = 8000
//! ```
//!
//! Every key is documented on [`Phase`] and in `docs/chaos-and-load.md`. The file is read by
//! [`stormguard_config`], like every stormguard file; a mistake is reported as
//! `file:line:column: key.path: reason`, and a broken rule can be matched as its [`PhaseError`]:
//!
//! ```
//! use stormguard_chaos::{PhaseError, Script};
//!
//! let err = Script::parse("[[phase]]\nerror_rate = 1.5\n", "storm.toml").unwrap_err();
//! assert_eq!(
//!     err.to_string(),
//!     "storm.toml:2:14: phase[0].error_rate: must be a fraction between 0 and 1, got 1.5"
//! );
//! assert_eq!(
//!     err.rule::<PhaseError>(),
//!     Some(&PhaseError::NotAFraction { key: "error_rate", got: 1.5 })
//! );
//! ```
//!
//! [`ChaosServer::next_phase`]: crate::ChaosServer::next_phase

mod file;

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use stormguard_core::decimal::parse_duration;

use crate::provider::{ProviderConfig, ProviderError, ProviderOptions};
use crate::sampler::{Latency, LatencyError};

/// The default error status: 503, the one a struggling dependency sends most.
pub const DEFAULT_STATUS: u16 = 503;
/// The default cap on any drawn latency: 60 s.
pub const DEFAULT_LATENCY_MAX: Duration = Duration::from_secs(60);
/// The default success body: `ok\n`, 3 bytes.
pub const DEFAULT_BODY_BYTES: usize = 3;
/// The largest body a phase may send: 64 MiB (the body is built once and shared).
pub const MAX_BODY_BYTES: usize = 64 << 20;

/// What the server does with a request whose client went away before the answer.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum OnDisconnect {
    /// Keep working until the drawn latency has passed, still counted in flight: what real
    /// servers do, and the case that makes a client's timeout no relief to the dependency.
    #[default]
    Finish,
    /// Stop at once: the request leaves the in-flight count when its client does.
    Cancel,
}

/// A word that is not an [`OnDisconnect`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("`{0}` is not finish or cancel")]
pub struct UnknownOnDisconnect(pub String);

impl FromStr for OnDisconnect {
    type Err = UnknownOnDisconnect;
    fn from_str(s: &str) -> Result<Self, UnknownOnDisconnect> {
        match s {
            "finish" => Ok(OnDisconnect::Finish),
            "cancel" => Ok(OnDisconnect::Cancel),
            other => Err(UnknownOnDisconnect(other.to_string())),
        }
    }
}

impl fmt::Display for OnDisconnect {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            OnDisconnect::Finish => "finish",
            OnDisconnect::Cancel => "cancel",
        })
    }
}

/// A rate: `count` events per `per`. Written `100/s`, `5/100ms`, `6000/m`, or a bare number (per
/// second).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Rate {
    /// Events per period (> 0, finite).
    pub count: f64,
    /// The period (> 0).
    pub per: Duration,
}

impl Rate {
    /// Events per second.
    pub fn per_second(&self) -> f64 {
        self.count / self.per.as_secs_f64()
    }
}

/// Why a text is not a [`Rate`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum BadRate {
    /// Not `COUNT/PERIOD` or a bare count.
    #[error("`{0}` is not a rate like 100/s, 5/100ms or 6000/m")]
    Syntax(String),
    /// A count or period of zero (or not finite).
    #[error("`{0}`: a rate must be above zero")]
    NotAboveZero(String),
}

impl FromStr for Rate {
    type Err = BadRate;
    fn from_str(text: &str) -> Result<Rate, BadRate> {
        let bad = || BadRate::Syntax(text.to_string());
        let (count, per) = match text.trim().split_once('/') {
            Some((c, p)) => {
                let p = p.trim();
                // `/s` means one second: give a bare unit its 1.
                let p = if p.starts_with(|c: char| c.is_ascii_digit()) {
                    parse_duration(p)
                } else {
                    parse_duration(&format!("1{p}"))
                };
                (c.trim(), p.map_err(|_| bad())?)
            }
            None => (text.trim(), Duration::from_secs(1)),
        };
        let count: f64 = count.parse().map_err(|_| bad())?;
        if !(count > 0.0 && count.is_finite()) || per.is_zero() {
            return Err(BadRate::NotAboveZero(text.to_string()));
        }
        Ok(Rate { count, per })
    }
}

impl fmt::Display for Rate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.count, stormguard_core::decimal::format_duration(self.per))
    }
}

/// A token-bucket rate limit: `rate` sustained, bursts of up to `burst` requests.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RateLimit {
    /// Sustained rate.
    pub rate: Rate,
    /// Bucket size in requests (>= 1). Default: the rate's count rounded up (`100/s` allows a
    /// burst of 100).
    pub burst: u64,
}

impl RateLimit {
    /// A limit of `rate` with the default burst.
    pub fn new(rate: Rate) -> RateLimit {
        RateLimit { rate, burst: (rate.count.ceil() as u64).max(1) }
    }
}

/// One phase of a script: the faults injected while it lasts.
///
/// The draws (error, reset, truncation and latency) come from the server's seeded
/// [`Sampler`](crate::Sampler); the limits depend on the traffic. Limits are checked first and
/// answer at once: a request refused by a limit draws nothing and waits for nothing.
#[derive(Debug, Clone, PartialEq)]
pub struct Phase {
    /// Shown in `/stats`. TOML `name`; default `phase-N` (N from 1).
    pub name: String,
    /// How long the phase lasts; `None` (the default) lasts until advanced by hand. TOML
    /// `duration`, e.g. `"30s"`; must be above zero.
    pub duration: Option<Duration>,
    /// Fraction of requests answered with `status`, in `[0, 1]`. TOML `error_rate`; default 0.
    pub error_rate: f64,
    /// The injected error status, 400–599. TOML `status`; default 503.
    pub status: u16,
    /// Fraction of requests reset instead of answered: the connection (HTTP/1.1) or the stream
    /// (h2) is reset after the latency. TOML `reset_rate`; default 0.
    pub reset_rate: f64,
    /// Fraction of requests answered 200 whose body stops halfway (HTTP/1.1: the connection
    /// closes short of the declared length; h2: the stream is reset). TOML `truncate_rate`;
    /// default 0.
    pub truncate_rate: f64,
    /// Fraction of requests answered at once that the provider is overloaded (Anthropic's 529
    /// `overloaded_error`; OpenAI's 503 when chaos plays OpenAI), before any limit or bucket is
    /// touched. A burst is a phase with `overloaded_rate = 1` and a `duration`. TOML
    /// `overloaded_rate`; default 0. The sum of the four rates is at most 1.
    pub overloaded_rate: f64,
    /// How long the server works before answering. TOML `latency = "50ms"` (fixed),
    /// `latency_p50` + `latency_p99` (log-normal fitted to them; `latency_dist = "pareto"` fits a
    /// Pareto tail instead), or `latency = { dist = "uniform", min = "10ms", max = "30ms" }`,
    /// `{ dist = "lognormal", p50, p99 }`, `{ dist = "pareto", p50, p99 }` or
    /// `{ dist = "pareto", min, alpha }`. Default: zero.
    pub latency: Latency,
    /// No draw waits longer than this. TOML `latency_max`; default 60 s.
    pub latency_max: Duration,
    /// At most this many requests in flight (>= 1); the next is answered 429 at once. Every
    /// traffic response carries `X-Concurrency-Limit-Limit` and `-Remaining`. TOML
    /// `max_concurrency`; default none.
    pub max_concurrency: Option<u64>,
    /// How many requests the server works on at full speed (>= 1), like a server with that
    /// many cores: a request that arrives with more in flight takes its drawn latency × in
    /// flight / `workers` (up to `latency_max`), so overload slows every caller down, as it
    /// does a real dependency. TOML `workers`; default none (latency does not depend on load).
    pub workers: Option<u64>,
    /// How many requests the server works on at once (>= 1), like a server with that many
    /// threads and a queue in front of them: a request that arrives with every server busy
    /// waits, first come first served, then takes its drawn latency — the simulator's
    /// dependency (`capacity` servers and a queue). Waiting requests count as in flight (the
    /// dependency has them). The servers are one pool across the phases: a phase's number
    /// resizes it when the phase begins (fewer: busy servers retire as they finish, no work is
    /// cut short), and a request waiting from an earlier phase keeps its place in line. TOML
    /// `servers`; default none (every request is worked on at once). Not with `workers`.
    pub servers: Option<u64>,
    /// With `servers`: how many requests may wait for one (>= 0); a request that finds every
    /// server busy and this many waiting is answered at once with the phase's `status` — the
    /// simulator's `queue`. TOML `queue`; default none (the queue has no bound).
    pub queue: Option<u64>,
    /// A token bucket; a request that finds it empty is answered 429 with `Retry-After` (whole
    /// seconds, at least 1) and `retry-after-ms`. TOML `rate_limit = "100/s"`, with `rate_burst`
    /// for the bucket size; default none.
    pub rate_limit: Option<RateLimit>,
    /// Size of the 200 body in bytes (`ok\n` repeated), up to 64 MiB. TOML `body_bytes`;
    /// default 3.
    pub body_bytes: usize,
    /// Spread the 200 body over this long, in up to 10 chunks. TOML `slow_body = "2s"`; default
    /// none (sent at once).
    pub slow_body: Option<Duration>,
}

impl Default for Phase {
    fn default() -> Phase {
        Phase {
            name: "phase-1".to_string(),
            duration: None,
            error_rate: 0.0,
            status: DEFAULT_STATUS,
            reset_rate: 0.0,
            truncate_rate: 0.0,
            overloaded_rate: 0.0,
            latency: Latency::default(),
            latency_max: DEFAULT_LATENCY_MAX,
            max_concurrency: None,
            workers: None,
            servers: None,
            queue: None,
            rate_limit: None,
            body_bytes: DEFAULT_BODY_BYTES,
            slow_body: None,
        }
    }
}

/// A broken rule of one phase: one variant per rule. [`PhaseError::key`] names the key it
/// is about (the CLI maps it to its flag); the message is one plain reason, lowercase without
/// a trailing period.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum PhaseError {
    /// A rate outside `[0, 1]`.
    #[error("must be a fraction between 0 and 1, got {got}")]
    NotAFraction {
        /// `error_rate`, `reset_rate`, `truncate_rate` or `overloaded_rate`.
        key: &'static str,
        /// The value given.
        got: f64,
    },
    /// The four rates add up to more than 1.
    #[error(
        "error_rate + reset_rate + truncate_rate + overloaded_rate must be at most 1, got {sum}"
    )]
    RatesAboveOne {
        /// Their sum.
        sum: f64,
    },
    /// An injected status outside 400–599.
    #[error("an injected error status is 400 to 599, got {got}")]
    Status {
        /// The status given.
        got: u64,
    },
    /// A `duration` of zero.
    #[error("must be above zero")]
    ZeroDuration,
    /// Latency parameters the distribution refuses.
    #[error("{error}")]
    Latency {
        /// `latency`, or the key the parameters came from (`latency_p99`, `latency.p99`).
        key: &'static str,
        /// Which rule.
        error: LatencyError,
    },
    /// Zero where at least 1 is needed.
    #[error("must be at least 1")]
    Zero {
        /// `workers`, `max_concurrency` or `rate_burst`.
        key: &'static str,
    },
    /// A rate limit of zero (or not finite).
    #[error("must be above zero")]
    ZeroRate,
    /// A body over [`MAX_BODY_BYTES`].
    #[error("at most {MAX_BODY_BYTES} (64 MiB), got {got}")]
    BodyTooLarge {
        /// The size given.
        got: usize,
    },
    /// `latency_dist` without the quantiles it fits.
    #[error("latency_dist needs latency_p50 and latency_p99")]
    DistWithoutQuantiles,
    /// Both `latency` and `latency_p50` + `latency_p99`.
    #[error("give either latency or latency_p50 + latency_p99, not both")]
    LatencyTwice,
    /// `latency_p50` alone.
    #[error("latency_p50 needs latency_p99 (for a fixed delay write latency = \"50ms\")")]
    P50WithoutP99,
    /// `latency_p99` alone.
    #[error("latency_p99 needs latency_p50")]
    P99WithoutP50,
    /// Both `workers` and `servers`.
    #[error(
        "give either workers (overload stretches every answer) or servers (a queue in front of them), not both"
    )]
    WorkersAndServers,
    /// `queue` without `servers`.
    #[error("queue needs servers (it is the line in front of them)")]
    QueueWithoutServers,
    /// `rate_burst` without `rate_limit`.
    #[error("rate_burst needs rate_limit")]
    BurstWithoutRate,
    /// A latency table without `dist`.
    #[error("missing: fixed, uniform, lognormal or pareto")]
    LatencyDistMissing,
    /// A latency table's key that its `dist` does not have.
    #[error("not a key of a {dist} latency (expected {expected})")]
    NotALatencyKey {
        /// `latency.p50`, `latency.value`, ...
        key: &'static str,
        /// The table's `dist`.
        dist: &'static str,
        /// The keys it has.
        expected: &'static str,
    },
    /// A latency table without a key its `dist` needs.
    #[error("missing (a {dist} latency has {expected})")]
    LatencyKeyMissing {
        /// `latency.max`, `latency.p99`, ...
        key: &'static str,
        /// The table's `dist`.
        dist: &'static str,
        /// The keys it has.
        expected: &'static str,
    },
    /// A Pareto tail by `min` without its `alpha`.
    #[error("a Pareto tail by min needs alpha, a number")]
    ParetoNeedsAlpha,
    /// A Pareto tail given both ways.
    #[error("a Pareto tail is p50 + p99 or min + alpha, not both")]
    ParetoTwoWays,
}

impl PhaseError {
    /// The key in a phase the rule is about: `error_rate`, `latency_p99`, `latency.max`.
    pub fn key(&self) -> &'static str {
        match self {
            PhaseError::NotAFraction { key, .. }
            | PhaseError::Latency { key, .. }
            | PhaseError::Zero { key }
            | PhaseError::NotALatencyKey { key, .. }
            | PhaseError::LatencyKeyMissing { key, .. } => key,
            PhaseError::RatesAboveOne { .. } => "error_rate",
            PhaseError::Status { .. } => "status",
            PhaseError::ZeroDuration => "duration",
            PhaseError::ZeroRate => "rate_limit",
            PhaseError::BodyTooLarge { .. } => "body_bytes",
            PhaseError::DistWithoutQuantiles => "latency_dist",
            PhaseError::LatencyTwice | PhaseError::P50WithoutP99 => "latency_p50",
            PhaseError::P99WithoutP50 => "latency_p99",
            PhaseError::WorkersAndServers => "servers",
            PhaseError::QueueWithoutServers => "queue",
            PhaseError::BurstWithoutRate => "rate_burst",
            PhaseError::LatencyDistMissing => "latency.dist",
            PhaseError::ParetoNeedsAlpha => "latency.alpha",
            PhaseError::ParetoTwoWays => "latency",
        }
    }
}

/// Why a script was refused.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum InvalidScript {
    /// A script without phases.
    #[error("a script needs at least one phase")]
    NoPhases,
    /// Phase `index` (from 0) breaks a rule.
    #[error("phase[{index}].{}: {error}", error.key())]
    Phase {
        /// The phase, from 0.
        index: usize,
        /// Which rule.
        error: PhaseError,
    },
    /// The provider breaks a rule.
    #[error("provider.{key}: {0}", key = .0.key())]
    Provider(ProviderError),
}

fn fraction(key: &'static str, got: f64) -> Result<(), PhaseError> {
    if (0.0..=1.0).contains(&got) { Ok(()) } else { Err(PhaseError::NotAFraction { key, got }) }
}

impl Phase {
    /// Checks every field; the first problem found is returned.
    pub fn validate(&self) -> Result<(), PhaseError> {
        fraction("error_rate", self.error_rate)?;
        fraction("reset_rate", self.reset_rate)?;
        fraction("truncate_rate", self.truncate_rate)?;
        fraction("overloaded_rate", self.overloaded_rate)?;
        let sum = self.error_rate + self.reset_rate + self.truncate_rate + self.overloaded_rate;
        if sum > 1.0 + 1e-12 {
            return Err(PhaseError::RatesAboveOne { sum });
        }
        if !(400..=599).contains(&self.status) {
            return Err(PhaseError::Status { got: u64::from(self.status) });
        }
        if self.duration.is_some_and(|d| d.is_zero()) {
            return Err(PhaseError::ZeroDuration);
        }
        self.latency.validate().map_err(|error| PhaseError::Latency { key: "latency", error })?;
        if self.workers == Some(0) {
            return Err(PhaseError::Zero { key: "workers" });
        }
        if self.servers == Some(0) {
            return Err(PhaseError::Zero { key: "servers" });
        }
        if self.workers.is_some() && self.servers.is_some() {
            return Err(PhaseError::WorkersAndServers);
        }
        if self.queue.is_some() && self.servers.is_none() {
            return Err(PhaseError::QueueWithoutServers);
        }
        if self.max_concurrency == Some(0) {
            return Err(PhaseError::Zero { key: "max_concurrency" });
        }
        if let Some(limit) = self.rate_limit {
            if limit.burst == 0 {
                return Err(PhaseError::Zero { key: "rate_burst" });
            }
            if !(limit.rate.count > 0.0 && limit.rate.count.is_finite()) || limit.rate.per.is_zero()
            {
                return Err(PhaseError::ZeroRate);
            }
        }
        if self.body_bytes > MAX_BODY_BYTES {
            return Err(PhaseError::BodyTooLarge { got: self.body_bytes });
        }
        Ok(())
    }
}

/// Phases over time, plus the run-wide settings a script file may carry.
#[derive(Debug, Clone, PartialEq)]
pub struct Script {
    /// At least one phase; the first starts when the server does.
    pub phases: Vec<Phase>,
    /// After the last timed phase ends: start over (`true`) or stay in it (`false`, the default).
    pub repeat: bool,
    /// The sampler's seed, when the script sets one (TOML `seed`).
    pub seed: Option<u64>,
    /// The disconnect behaviour, when the script sets one (TOML `on_disconnect`).
    pub on_disconnect: Option<OnDisconnect>,
    /// The model provider chaos plays, when the script sets one (TOML `[provider]`, `kind`,
    /// `rpm`, `tpm`).
    pub provider: Option<ProviderConfig>,
    /// The rest of the provider's behaviour (TOML `[provider]`, `itpm`, `otpm`,
    /// `stream_event_delay`, `stream_break_rate`, `quota_exhausted_after`); the defaults when
    /// the script has no `[provider]`.
    pub provider_options: ProviderOptions,
}

impl Script {
    /// A script of one phase that lasts forever.
    pub fn single(phase: Phase) -> Script {
        Script {
            phases: vec![phase],
            repeat: false,
            seed: None,
            on_disconnect: None,
            provider: None,
            provider_options: ProviderOptions::default(),
        }
    }

    /// `base` forever, except during `windows` (times since the server's start), when every
    /// request is answered overloaded: the phases `base`, `overloaded`, `base`, ... with the
    /// durations the windows give. In a burst the other injected faults are off (their rates
    /// would pass 1 with `overloaded_rate = 1`); latency and limits are `base`'s. `base`'s own
    /// `duration` is not used: the last phase lasts until the server stops. What
    /// `stormguard chaos --overloaded 2s..4s` serves.
    ///
    /// ```
    /// use std::time::Duration;
    /// use stormguard_chaos::{Phase, Script, Window};
    ///
    /// let s = Script::overloaded_during(Phase::default(), &["2s..4s".parse().unwrap()]).unwrap();
    /// let names: Vec<&str> = s.phases.iter().map(|p| p.name.as_str()).collect();
    /// assert_eq!(names, ["phase-1", "overloaded", "phase-1"]);
    /// assert_eq!(s.phases[1].duration, Some(Duration::from_secs(2)));
    /// assert_eq!(s.phases[1].overloaded_rate, 1.0);
    /// assert_eq!(s.phases[2].duration, None);
    /// ```
    pub fn overloaded_during(base: Phase, windows: &[Window]) -> Result<Script, BadWindow> {
        let mut sorted = windows.to_vec();
        sorted.sort_by_key(|w| w.start);
        let mut phases = Vec::with_capacity(2 * sorted.len() + 1);
        let mut at = Duration::ZERO;
        for w in &sorted {
            if w.end <= w.start {
                return Err(BadWindow::Empty(*w));
            }
            if w.start < at {
                return Err(BadWindow::Overlap(*w));
            }
            if w.start > at {
                phases.push(Phase { duration: Some(w.start - at), ..base.clone() });
            }
            phases.push(Phase {
                name: "overloaded".to_string(),
                duration: Some(w.end - w.start),
                error_rate: 0.0,
                reset_rate: 0.0,
                truncate_rate: 0.0,
                overloaded_rate: 1.0,
                ..base.clone()
            });
            at = w.end;
        }
        phases.push(Phase { duration: None, ..base });
        Ok(Script { phases, ..Script::single(Phase::default()) })
    }

    /// Checks every phase, and the provider when the script sets one.
    pub fn validate(&self) -> Result<(), InvalidScript> {
        if self.phases.is_empty() {
            return Err(InvalidScript::NoPhases);
        }
        for (index, p) in self.phases.iter().enumerate() {
            p.validate().map_err(|error| InvalidScript::Phase { index, error })?;
        }
        if let Some(provider) = &self.provider {
            provider.validate(&self.provider_options).map_err(InvalidScript::Provider)?;
        }
        Ok(())
    }
}

/// A span of time since the server's start, written `2s..4s`: when a burst lasts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Window {
    /// When it starts.
    pub start: Duration,
    /// When it ends (after `start`).
    pub end: Duration,
}

/// Why a text or a list is not a set of [`Window`]s.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum BadWindow {
    /// Not `FROM..TO` with two durations.
    #[error("`{0}` is not a window like 2s..4s")]
    Syntax(String),
    /// A window that ends where (or before) it starts.
    #[error("the window {0} ends before it starts")]
    Empty(Window),
    /// A window that starts inside an earlier one.
    #[error("the window {0} overlaps another")]
    Overlap(Window),
}

impl fmt::Display for Window {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        use stormguard_core::decimal::format_duration;
        write!(f, "{}..{}", format_duration(self.start), format_duration(self.end))
    }
}

impl FromStr for Window {
    type Err = BadWindow;

    fn from_str(text: &str) -> Result<Window, BadWindow> {
        let syntax = || BadWindow::Syntax(text.to_string());
        let (start, end) = text.split_once("..").ok_or_else(syntax)?;
        let start = parse_duration(start.trim()).map_err(|_| syntax())?;
        let end = parse_duration(end.trim()).map_err(|_| syntax())?;
        let w = Window { start, end };
        if end <= start {
            return Err(BadWindow::Empty(w));
        }
        Ok(w)
    }
}

/// A script file that could not be read or is wrong: `file:line:column: key.path: reason`,
/// the same shape as every stormguard file. A broken rule is
/// [`rule::<PhaseError>()`](stormguard_config::FileError::rule) (or `InvalidScript` for a
/// script without phases).
pub type ScriptError = stormguard_config::FileError;

/// The 1-based line and column (in characters) of byte `offset` in `text`.
pub use stormguard_core::text::line_col;

#[cfg(test)]
mod tests {
    use super::*;

    proptest::proptest! {
        #[test]
        fn line_col_agrees_with_walking(text in "[a-zµ=\n ]{0,60}", offset in 0usize..80) {
            // The oracle walks the characters before the offset one by one.
            let (mut line, mut column) = (1, 1);
            for (i, c) in text.char_indices() {
                if i + c.len_utf8() > offset {
                    break;
                }
                if c == '\n' {
                    (line, column) = (line + 1, 1);
                } else {
                    column += 1;
                }
            }
            proptest::prop_assert_eq!(line_col(&text, offset), (line, column));
        }
    }

    #[test]
    fn rates() {
        let r: Rate = "100/s".parse().unwrap();
        assert_eq!(r.per_second(), 100.0);
        assert_eq!("5/100ms".parse::<Rate>().unwrap().per_second(), 50.0);
        assert_eq!("6000/m".parse::<Rate>().unwrap().per_second(), 100.0);
        assert_eq!("250".parse::<Rate>().unwrap().per_second(), 250.0);
        assert_eq!("1/10s".parse::<Rate>().unwrap().per_second(), 0.1);
        assert_eq!(RateLimit::new("0.5/s".parse().unwrap()).burst, 1);
        for bad in ["", "0/s", "-1/s", "x/s", "10/parsec", "10/0s", "inf/s"] {
            assert!(bad.parse::<Rate>().is_err(), "{bad}");
        }
    }

    #[test]
    fn defaults_are_valid_and_checked() {
        assert!(Phase::default().validate().is_ok());
        assert!(Script::single(Phase::default()).validate().is_ok());
        let bad = Phase { max_concurrency: Some(0), ..Phase::default() };
        assert_eq!(bad.validate().unwrap_err(), PhaseError::Zero { key: "max_concurrency" });
        assert_eq!(bad.validate().unwrap_err().key(), "max_concurrency");
        let s = Script { phases: vec![], ..Script::single(Phase::default()) };
        assert_eq!(s.validate(), Err(InvalidScript::NoPhases));
        let s = Script::single(Phase { error_rate: 2.0, ..Phase::default() });
        assert_eq!(
            s.validate().unwrap_err().to_string(),
            "phase[0].error_rate: must be a fraction between 0 and 1, got 2"
        );
    }
}
