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
//! ```
//!
//! Every key is documented on [`Phase`] and in `docs/chaos-and-load.md`. A mistake is reported as
//! `file:line:column: key: reason`:
//!
//! ```
//! use stormguard_chaos::Script;
//!
//! let err = Script::parse("[[phase]]\nerror_rate = 1.5\n", "storm.toml").unwrap_err();
//! assert_eq!(
//!     err.to_string(),
//!     "storm.toml:2:14: phase[0].error_rate: must be a fraction between 0 and 1, got 1.5"
//! );
//! ```
//!
//! [`ChaosServer::next_phase`]: crate::ChaosServer::next_phase

use std::collections::BTreeMap;
use std::fmt;
use std::ops::Range;
use std::path::Path;
use std::str::FromStr;
use std::time::Duration;

use serde::Deserialize;
use stormguard_core::decimal::parse_duration;
use toml::{Spanned, Value};

use crate::sampler::Latency;

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
    /// default 0. The sum of the three rates is at most 1.
    pub truncate_rate: f64,
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
            latency: Latency::default(),
            latency_max: DEFAULT_LATENCY_MAX,
            max_concurrency: None,
            workers: None,
            rate_limit: None,
            body_bytes: DEFAULT_BODY_BYTES,
            slow_body: None,
        }
    }
}

/// A phase field that is out of range: the TOML key and one plain reason.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{key}: {reason}")]
pub struct InvalidPhase {
    /// The TOML key (the CLI maps it to its flag).
    pub key: &'static str,
    /// What is wrong.
    pub reason: String,
}

/// Why a script was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum InvalidScript {
    /// A script without phases.
    #[error("a script needs at least one phase")]
    NoPhases,
    /// Phase `index` (from 0) is out of range.
    #[error("phase[{index}].{source}")]
    Phase {
        /// The phase, from 0.
        index: usize,
        /// What is wrong with it.
        source: InvalidPhase,
    },
}

fn fraction(key: &'static str, v: f64) -> Result<(), InvalidPhase> {
    if (0.0..=1.0).contains(&v) {
        Ok(())
    } else {
        Err(InvalidPhase { key, reason: format!("must be a fraction between 0 and 1, got {v}") })
    }
}

impl Phase {
    /// Checks every field; the first problem found is returned.
    pub fn validate(&self) -> Result<(), InvalidPhase> {
        fraction("error_rate", self.error_rate)?;
        fraction("reset_rate", self.reset_rate)?;
        fraction("truncate_rate", self.truncate_rate)?;
        let sum = self.error_rate + self.reset_rate + self.truncate_rate;
        if sum > 1.0 + 1e-12 {
            return Err(InvalidPhase {
                key: "error_rate",
                reason: format!(
                    "error_rate + reset_rate + truncate_rate must be at most 1, got {sum}"
                ),
            });
        }
        if !(400..=599).contains(&self.status) {
            return Err(InvalidPhase {
                key: "status",
                reason: format!("an injected error status is 400 to 599, got {}", self.status),
            });
        }
        if self.duration.is_some_and(|d| d.is_zero()) {
            return Err(InvalidPhase { key: "duration", reason: "must be above zero".into() });
        }
        self.latency
            .validate()
            .map_err(|e| InvalidPhase { key: "latency", reason: e.to_string() })?;
        if self.workers == Some(0) {
            return Err(InvalidPhase { key: "workers", reason: "must be at least 1".into() });
        }
        if self.max_concurrency == Some(0) {
            return Err(InvalidPhase {
                key: "max_concurrency",
                reason: "must be at least 1".into(),
            });
        }
        if let Some(limit) = self.rate_limit {
            if limit.burst == 0 {
                return Err(InvalidPhase {
                    key: "rate_burst",
                    reason: "must be at least 1".into(),
                });
            }
            if !(limit.rate.count > 0.0 && limit.rate.count.is_finite()) || limit.rate.per.is_zero()
            {
                return Err(InvalidPhase {
                    key: "rate_limit",
                    reason: "must be above zero".into(),
                });
            }
        }
        if self.body_bytes > MAX_BODY_BYTES {
            return Err(InvalidPhase {
                key: "body_bytes",
                reason: format!("at most {MAX_BODY_BYTES} (64 MiB), got {}", self.body_bytes),
            });
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
}

impl Script {
    /// A script of one phase that lasts forever.
    pub fn single(phase: Phase) -> Script {
        Script { phases: vec![phase], repeat: false, seed: None, on_disconnect: None }
    }

    /// Checks every phase.
    pub fn validate(&self) -> Result<(), InvalidScript> {
        if self.phases.is_empty() {
            return Err(InvalidScript::NoPhases);
        }
        for (i, p) in self.phases.iter().enumerate() {
            p.validate().map_err(|source| InvalidScript::Phase { index: i, source })?;
        }
        Ok(())
    }

    /// Reads and checks a script file.
    pub fn load(path: &Path) -> Result<Script, ScriptError> {
        let text = stormguard_input::read_to_string(path, stormguard_input::MAX_FILE)
            .map_err(|source| ScriptError::Read { path: path.display().to_string(), source })?;
        Script::parse(&text, &path.display().to_string())
    }

    /// Parses and checks a script; `file` names it in errors.
    pub fn parse(text: &str, file: &str) -> Result<Script, ScriptError> {
        let at = |span: Range<usize>, key: String, reason: String| {
            let (line, column) = line_col(text, span.start);
            ScriptError::Invalid { file: file.to_string(), line, column, key, reason }
        };
        let raw: RawScript = toml::from_str(text).map_err(|e| {
            let span = e.span().unwrap_or(0..0);
            at(
                span.clone(),
                stormguard_core::text::toml_key_at(text, span.start, e.message()),
                e.message().to_string(),
            )
        })?;
        let mut phases = Vec::with_capacity(raw.phase.len());
        for (i, table) in raw.phase.iter().enumerate() {
            let phase = parse_phase(i, table)
                .map_err(|(span, key, reason)| at(span, format!("phase[{i}].{key}"), reason))?;
            phases.push(phase);
        }
        if phases.is_empty() {
            return Err(at(0..0, "phase".into(), "a script needs at least one [[phase]]".into()));
        }
        let on_disconnect = match raw.on_disconnect {
            Some(s) => Some(s.get_ref().parse().map_err(|e: UnknownOnDisconnect| {
                at(s.span(), "on_disconnect".into(), e.to_string())
            })?),
            None => None,
        };
        Ok(Script {
            phases,
            repeat: raw.repeat.unwrap_or(false),
            seed: raw.seed.map(Spanned::into_inner),
            on_disconnect,
        })
    }
}

/// A script that could not be read or is wrong.
#[derive(Debug, thiserror::Error)]
pub enum ScriptError {
    /// The file could not be read.
    #[error("{path}: {source}")]
    Read {
        /// The path given.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// The file is not a valid script.
    #[error("{file}:{line}:{column}: {}{reason}", if key.is_empty() { String::new() } else { format!("{key}: ") })]
    Invalid {
        /// The file name.
        file: String,
        /// 1-based line.
        line: usize,
        /// 1-based column, in characters.
        column: usize,
        /// The key at fault (`phase[1].error_rate`), or empty for a syntax error.
        key: String,
        /// What is wrong.
        reason: String,
    },
}

/// The 1-based line and column (in characters) of byte `offset` in `text`.
pub use stormguard_core::text::line_col;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawScript {
    seed: Option<Spanned<u64>>,
    repeat: Option<bool>,
    on_disconnect: Option<Spanned<String>>,
    #[serde(default)]
    phase: Vec<BTreeMap<Spanned<String>, Spanned<Value>>>,
}

type Bad = (Range<usize>, String, String);

const PHASE_KEYS: &[&str] = &[
    "name",
    "duration",
    "error_rate",
    "status",
    "reset_rate",
    "truncate_rate",
    "latency",
    "latency_p50",
    "latency_p99",
    "latency_dist",
    "latency_max",
    "max_concurrency",
    "workers",
    "rate_limit",
    "rate_burst",
    "body_bytes",
    "slow_body",
];

fn bad(v: &Spanned<Value>, key: &str, reason: impl Into<String>) -> Bad {
    (v.span(), key.to_string(), reason.into())
}

fn as_duration(v: &Spanned<Value>, key: &str) -> Result<Duration, Bad> {
    match v.get_ref() {
        Value::String(s) => parse_duration(s).map_err(|e| bad(v, key, e.to_string())),
        other => Err(bad(
            v,
            key,
            format!("a duration is a string with a unit, like \"50ms\"; got {}", other.type_str()),
        )),
    }
}

fn as_fraction(v: &Spanned<Value>, key: &str) -> Result<f64, Bad> {
    match v.get_ref() {
        Value::Float(f) => Ok(*f),
        Value::Integer(i) => Ok(*i as f64),
        other => Err(bad(v, key, format!("expected a number, got {}", other.type_str()))),
    }
}

fn as_count(v: &Spanned<Value>, key: &str) -> Result<u64, Bad> {
    match v.get_ref() {
        Value::Integer(i) if *i >= 0 => Ok(*i as u64),
        Value::Integer(i) => Err(bad(v, key, format!("must not be negative, got {i}"))),
        other => Err(bad(v, key, format!("expected a whole number, got {}", other.type_str()))),
    }
}

fn as_str<'a>(v: &'a Spanned<Value>, key: &str) -> Result<&'a str, Bad> {
    v.get_ref()
        .as_str()
        .ok_or_else(|| bad(v, key, format!("expected a string, got {}", v.get_ref().type_str())))
}

/// `latency = { dist = ..., ... }`: the inner keys have no spans of their own, so errors point
/// at the table and name the inner key.
fn latency_table(v: &Spanned<Value>, table: &toml::Table) -> Result<Latency, Bad> {
    let get = |k: &str| table.get(k);
    let dur = |k: &str| -> Result<Duration, Bad> {
        let key = format!("latency.{k}");
        match get(k) {
            Some(Value::String(s)) => parse_duration(s).map_err(|e| bad(v, &key, e.to_string())),
            Some(other) => Err(bad(
                v,
                &key,
                format!("a duration is a string like \"50ms\"; got {}", other.type_str()),
            )),
            None => Err(bad(v, &key, "missing")),
        }
    };
    let dist = match get("dist") {
        Some(Value::String(s)) => s.as_str(),
        Some(_) => return Err(bad(v, "latency.dist", "expected a string")),
        None => {
            return Err(bad(v, "latency.dist", "missing: fixed, uniform, lognormal or pareto"));
        }
    };
    let allowed: &[&str] = match dist {
        "fixed" => &["dist", "value"],
        "uniform" => &["dist", "min", "max"],
        "lognormal" => &["dist", "p50", "p99"],
        "pareto" => &["dist", "p50", "p99", "min", "alpha"],
        other => {
            return Err(bad(
                v,
                "latency.dist",
                format!("`{other}` is not fixed, uniform, lognormal or pareto"),
            ));
        }
    };
    if let Some(k) = table.keys().find(|k| !allowed.contains(&k.as_str())) {
        return Err(bad(
            v,
            &format!("latency.{k}"),
            format!("not a key of a {dist} latency (expected {})", allowed[1..].join(", ")),
        ));
    }
    let latency = match dist {
        "fixed" => Latency::Fixed(dur("value")?),
        "uniform" => Latency::Uniform { min: dur("min")?, max: dur("max")? },
        "lognormal" => Latency::LogNormal { p50: dur("p50")?, p99: dur("p99")? },
        _ if get("alpha").is_some() || get("min").is_some() => {
            let alpha = match get("alpha") {
                Some(Value::Float(f)) => *f,
                Some(Value::Integer(i)) => *i as f64,
                _ => {
                    return Err(bad(
                        v,
                        "latency.alpha",
                        "a Pareto tail by min needs alpha, a number",
                    ));
                }
            };
            Latency::Pareto { min: dur("min")?, alpha }
        }
        _ => Latency::pareto_from_quantiles(dur("p50")?, dur("p99")?)
            .map_err(|r| bad(v, "latency.p99", r.to_string()))?,
    };
    latency.validate().map_err(|r| bad(v, "latency", r.to_string()))?;
    Ok(latency)
}

fn parse_phase(i: usize, table: &BTreeMap<Spanned<String>, Spanned<Value>>) -> Result<Phase, Bad> {
    let mut phase = Phase { name: format!("phase-{}", i + 1), ..Phase::default() };
    let mut spans: BTreeMap<&str, Range<usize>> = BTreeMap::new();
    let (mut p50, mut p99, mut dist, mut rate, mut burst) = (None, None, None, None, None);
    for (k, v) in table {
        let key = k.get_ref().as_str();
        spans.insert(key, v.span());
        match key {
            "name" => phase.name = as_str(v, key)?.to_string(),
            "duration" => phase.duration = Some(as_duration(v, key)?),
            "error_rate" => phase.error_rate = as_fraction(v, key)?,
            "reset_rate" => phase.reset_rate = as_fraction(v, key)?,
            "truncate_rate" => phase.truncate_rate = as_fraction(v, key)?,
            "status" => {
                phase.status = u16::try_from(as_count(v, key)?).unwrap_or(u16::MAX);
            }
            "latency" => {
                phase.latency = match v.get_ref() {
                    Value::String(_) => Latency::Fixed(as_duration(v, key)?),
                    Value::Table(t) => latency_table(v, t)?,
                    other => {
                        return Err(bad(
                            v,
                            key,
                            format!(
                                "expected a duration string or a table with dist; got {}",
                                other.type_str()
                            ),
                        ));
                    }
                }
            }
            "latency_p50" => p50 = Some(as_duration(v, key)?),
            "latency_p99" => p99 = Some(as_duration(v, key)?),
            "latency_dist" => dist = Some(as_str(v, key)?),
            "latency_max" => phase.latency_max = as_duration(v, key)?,
            "max_concurrency" => phase.max_concurrency = Some(as_count(v, key)?),
            "workers" => phase.workers = Some(as_count(v, key)?),
            "rate_limit" => {
                rate =
                    Some(as_str(v, key)?.parse::<Rate>().map_err(|r| bad(v, key, r.to_string()))?);
            }
            "rate_burst" => burst = Some(as_count(v, key)?),
            "body_bytes" => {
                phase.body_bytes = usize::try_from(as_count(v, key)?).unwrap_or(usize::MAX);
            }
            "slow_body" => phase.slow_body = Some(as_duration(v, key)?),
            other => {
                return Err((
                    k.span(),
                    other.to_string(),
                    format!("unknown key; a phase has {}", PHASE_KEYS.join(", ")),
                ));
            }
        }
    }
    let span_of = |k: &str| spans.get(k).cloned().unwrap_or(0..0);
    match (p50, p99) {
        (None, None) => {
            if dist.is_some() {
                let reason = "latency_dist needs latency_p50 and latency_p99";
                return Err((span_of("latency_dist"), "latency_dist".into(), reason.into()));
            }
        }
        (Some(p50), Some(p99)) => {
            if spans.contains_key("latency") {
                let reason = "give either latency or latency_p50 + latency_p99, not both";
                return Err((span_of("latency_p50"), "latency_p50".into(), reason.into()));
            }
            phase.latency = match dist.unwrap_or("lognormal") {
                "lognormal" => Latency::LogNormal { p50, p99 },
                "pareto" => Latency::pareto_from_quantiles(p50, p99).map_err(|r| {
                    (span_of("latency_p99"), "latency_p99".to_string(), r.to_string())
                })?,
                other => {
                    return Err((
                        span_of("latency_dist"),
                        "latency_dist".into(),
                        format!("`{other}` is not lognormal or pareto"),
                    ));
                }
            };
        }
        (Some(_), None) => {
            let reason =
                "latency_p50 needs latency_p99 (for a fixed delay write latency = \"50ms\")";
            return Err((span_of("latency_p50"), "latency_p50".into(), reason.into()));
        }
        (None, Some(_)) => {
            let reason = "latency_p99 needs latency_p50";
            return Err((span_of("latency_p99"), "latency_p99".into(), reason.into()));
        }
    }
    match (rate, burst) {
        (Some(rate), burst) => {
            let mut limit = RateLimit::new(rate);
            if let Some(b) = burst {
                limit.burst = b;
            }
            phase.rate_limit = Some(limit);
        }
        (None, Some(_)) => {
            let reason = "rate_burst needs rate_limit";
            return Err((span_of("rate_burst"), "rate_burst".into(), reason.into()));
        }
        (None, None) => {}
    }
    phase.validate().map_err(|e| {
        // Point at the key at fault, or, for a default that clashes, at the phase's first key.
        let span = spans
            .get(e.key)
            .or_else(|| ["reset_rate", "truncate_rate"].iter().find_map(|k| spans.get(k)))
            .cloned()
            .or_else(|| table.keys().next().map(|k| k.span()))
            .unwrap_or(0..0);
        (span, e.key.to_string(), e.reason)
    })?;
    Ok(phase)
}

#[cfg(test)]
mod tests {
    use super::*;

    const FULL: &str = r#"
seed = 7
repeat = true
on_disconnect = "cancel"

[[phase]]
name = "healthy"
duration = "2s"
latency_p50 = "20ms"
latency_p99 = "80ms"

[[phase]]
name = "storm"
error_rate = 0.3
status = 502
reset_rate = 0.01
truncate_rate = 0.02
latency = { dist = "pareto", p50 = "50ms", p99 = "2s" }
latency_max = "5s"
max_concurrency = 20
rate_limit = "100/s"
rate_burst = 10
body_bytes = 1024
slow_body = "1s"

[[phase]]
latency = { dist = "uniform", min = "1ms", max = "3ms" }
"#;

    fn err(text: &str) -> String {
        Script::parse(text, "s.toml").unwrap_err().to_string()
    }

    #[test]
    fn a_full_script_parses() {
        let s = Script::parse(FULL, "s.toml").unwrap();
        assert_eq!(s.seed, Some(7));
        assert!(s.repeat);
        assert_eq!(s.on_disconnect, Some(OnDisconnect::Cancel));
        assert_eq!(s.phases.len(), 3);
        let healthy = &s.phases[0];
        assert_eq!(healthy.duration, Some(Duration::from_secs(2)));
        assert_eq!(
            healthy.latency,
            Latency::LogNormal { p50: Duration::from_millis(20), p99: Duration::from_millis(80) }
        );
        let storm = &s.phases[1];
        assert_eq!((storm.error_rate, storm.status, storm.max_concurrency), (0.3, 502, Some(20)));
        assert_eq!(storm.rate_limit.unwrap().burst, 10);
        assert_eq!(storm.rate_limit.unwrap().rate.per_second(), 100.0);
        assert!(matches!(storm.latency, Latency::Pareto { .. }));
        assert_eq!(storm.slow_body, Some(Duration::from_secs(1)));
        assert_eq!(storm.body_bytes, 1024);
        assert_eq!(s.phases[2].name, "phase-3");
        assert_eq!(s.phases[2].duration, None);
    }

    #[test]
    fn errors_name_file_line_column_and_key() {
        assert_eq!(
            err("[[phase]]\nerror_rate = 1.5\n"),
            "s.toml:2:14: phase[0].error_rate: must be a fraction between 0 and 1, got 1.5"
        );
        assert_eq!(
            err("[[phase]]\nname = \"a\"\n\n[[phase]]\n  latency = \"fast\"\n"),
            "s.toml:5:13: phase[1].latency: `fast` is not a duration (e.g. 250ms, 10s, 2m)"
        );
        let e = err("[[phase]]\neror_rate = 0.1\n");
        assert!(
            e.starts_with("s.toml:2:1: phase[0].eror_rate: unknown key; a phase has name,"),
            "{e}"
        );
        let e = err("sed = 1\n[[phase]]\n");
        assert!(e.starts_with("s.toml:1:1: sed: unknown field `sed`"), "{e}");
        let e = err("seed = -1\n[[phase]]\n");
        assert!(e.starts_with("s.toml:1:8: seed: invalid value"), "{e}");
        let e = err("[[phase]]\nstatus = 200\n");
        assert_eq!(
            e,
            "s.toml:2:10: phase[0].status: an injected error status is 400 to 599, got 200"
        );
        let e = err("[[phase]]\nerror_rate = 0.6\nreset_rate = 0.6\n");
        assert!(e.starts_with("s.toml:2:14: phase[0].error_rate: error_rate + reset_rate"), "{e}");
        let e = err("[[phase]]\nlatency_p50 = \"50ms\"\nlatency_p99 = \"10ms\"\n");
        assert!(e.contains("phase[0].latency: a log-normal latency needs p99 >= p50"), "{e}");
        let e = err("[[phase]]\nlatency_p99 = \"10ms\"\n");
        assert_eq!(e, "s.toml:2:15: phase[0].latency_p99: latency_p99 needs latency_p50");
        let e = err("[[phase]]\nlatency = { dist = \"uniform\", min = \"1ms\" }\n");
        assert_eq!(e, "s.toml:2:11: phase[0].latency.max: missing");
        let e = err("[[phase]]\nlatency = { dist = \"gamma\" }\n");
        assert!(e.contains("phase[0].latency.dist: `gamma` is not fixed"), "{e}");
        let e = err("[[phase]]\nrate_limit = \"fast\"\n");
        assert!(e.starts_with("s.toml:2:14: phase[0].rate_limit: `fast` is not a rate"), "{e}");
        let e = err("[[phase]]\nduration = 5\n");
        assert!(e.starts_with("s.toml:2:12: phase[0].duration: a duration is a string"), "{e}");
        let e = err("[[phase]]\nduration = \"0s\"\n");
        assert_eq!(e, "s.toml:2:12: phase[0].duration: must be above zero");
        let e = err("on_disconnect = \"later\"\n[[phase]]\n");
        assert_eq!(e, "s.toml:1:17: on_disconnect: `later` is not finish or cancel");
        let e = err("seed = 1\n");
        assert_eq!(e, "s.toml:1:1: phase: a script needs at least one [[phase]]");
        // A syntax error has no key.
        let e = err("[[phase]]\nerror_rate = \n");
        assert!(e.starts_with("s.toml:2:14: phase[0].error_rate: "), "{e}");
        let e = err("[[phase]\n");
        assert!(e.starts_with("s.toml:1:"), "{e}");
    }

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

        #[test]
        fn parse_never_panics(text in "[\\[\\]a-z_=\"0-9. \n{}]{0,80}") {
            let _ = Script::parse(&text, "p.toml");
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
        assert_eq!(bad.validate().unwrap_err().key, "max_concurrency");
        let s = Script { phases: vec![], ..Script::single(Phase::default()) };
        assert!(s.validate().is_err());
    }
}
