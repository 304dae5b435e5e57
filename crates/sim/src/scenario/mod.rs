//! Scenario files: the fleet, the dependency and its timeline, the client, and the policies to
//! compare, in TOML.
//!
//! A scenario is validated once, when it is read: every refusal names the file, the line and
//! the key (`storm.toml:9: policy[1].retries: must be between 0 and 10, got 12`), and an unknown key is an
//! error rather than a silent default. The built-in scenarios in `crates/sim/scenarios/` are
//! complete examples; `docs/simulator.md` lists every key.
//!
//! ```
//! use stormguard_sim::Scenario;
//!
//! let scenario = Scenario::parse("inline.toml", r#"
//!     duration = "10s"
//!     [fleet]
//!     rate = 100
//!     [dependency]
//!     capacity = 20
//!     service_time = "exponential 50ms"
//!     [[policy]]
//!     retries = 1
//! "#)?;
//! assert_eq!(scenario.policies[0].name, "retry-once");
//! let err = Scenario::parse("bad.toml", "[fleet]\nrate = 10\n[dependency]\ncapacity = 0\n");
//! assert_eq!(
//!     err.unwrap_err().to_string(),
//!     "bad.toml:4: dependency.capacity: must be between 1 and 1000000, got 0"
//! );
//! # Ok::<(), stormguard_sim::ScenarioError>(())
//! ```

use std::fmt;
use std::ops::Range;
use std::time::Duration;

use stormguard_core::backoff::{BackoffConfig, Jitter};
use stormguard_core::breaker::BreakerConfig;
use stormguard_core::budget::BudgetSpec;
use stormguard_core::conditions::RetryOn;
use stormguard_core::decimal::{Fraction, format_duration, parse_duration};
use stormguard_core::decision::{MAX_RETRIES_LIMIT, RetryConfig};
use stormguard_core::defaults;
use stormguard_core::limiter::{LimiterConfig, MAX_CAP};
use toml_edit::{ImDocument, Item, Key, TableLike};

use crate::dist::ServiceTime;

/// Why a scenario was refused: where, which key, and one plain reason.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub struct ScenarioError {
    /// The file (or `--builtin NAME`) the scenario came from.
    pub origin: String,
    /// The 1-based line of the offending key (or of the syntax error).
    pub line: usize,
    /// The key's dotted path (`policy[2].budget`); empty for a syntax error.
    pub key: String,
    /// The reason.
    pub message: String,
}

impl fmt::Display for ScenarioError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.key.is_empty() {
            write!(f, "{}:{}: {}", self.origin, self.line, self.message)
        } else {
            write!(f, "{}:{}: {}: {}", self.origin, self.line, self.key, self.message)
        }
    }
}

/// The most attempts (first tries and retries) one policy's run may send: 50 000 000. An
/// open-loop scenario whose first tries alone pass it is refused when it is read (the key
/// `fleet.rate`); a run that passes it later (retries, a closed loop) stops with an error. It
/// bounds how long `simulate` can work on any file: well under a minute per policy on one core
/// of a release build.
pub const MAX_ATTEMPTS: u64 = 50_000_000;

/// A validated scenario.
#[derive(Debug, Clone)]
pub struct Scenario {
    /// Its name, for the report. Default: the file name without `.toml`.
    pub name: String,
    /// One paragraph on what it shows.
    pub description: String,
    /// The seed every random draw derives from. Default 1.
    pub seed: u64,
    /// How long arrivals run (requests in flight at the end are followed to their end).
    /// Default 60 s; at most 24 h.
    pub duration: Duration,
    /// The width of one time-series bucket (the report's charts, goodput over time, recovery).
    /// Default 1 s.
    pub bucket: Duration,
    /// Who calls the dependency.
    pub fleet: Fleet,
    /// The client's timeouts.
    pub client: ClientConfig,
    /// The dependency.
    pub dependency: DependencyConfig,
    /// The timeline: conditions that differ from the dependency's baseline, in time order,
    /// never overlapping.
    pub phases: Vec<Phase>,
    /// The policies compared on the same arrivals.
    pub policies: Vec<PolicyConfig>,
    /// A bucket counts as recovered when at least this fraction of the actions that started in
    /// it succeeded. Default 0.95.
    pub recovered_at: f64,
}

/// The client fleet.
#[derive(Debug, Clone, PartialEq)]
pub struct Fleet {
    /// Client instances, 1..=10 000. Default 1.
    pub instances: u32,
    /// How each instance generates user actions.
    pub load: Load,
    /// Parallel calls to the dependency per user action, 1..=100. Default 1.
    pub fan_out: u32,
}

impl Fleet {
    /// The calls (first tries) an open-loop fleet starts over `duration`:
    /// `instances × rate × duration × fan_out`. `None` for a closed loop, whose rate depends on
    /// how fast the dependency answers.
    pub fn expected_calls(&self, duration: Duration) -> Option<f64> {
        match self.load {
            Load::Open { rate, .. } => Some(
                f64::from(self.instances) * rate * duration.as_secs_f64() * f64::from(self.fan_out),
            ),
            Load::Closed { .. } => None,
        }
    }
}

/// How an instance generates user actions.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Load {
    /// Actions arrive whatever happens to earlier ones (a public endpoint).
    Open {
        /// Actions per second per instance, above 0.
        rate: f64,
        /// How arrivals are spaced.
        arrivals: Arrivals,
    },
    /// A fixed number of workers per instance, each starting its next action when the last
    /// one ends (a batch job, a connection pool).
    Closed {
        /// Workers per instance, 1..=100 000.
        concurrency: u32,
        /// The pause between one action's end and the next one's start. Default 0.
        think: Duration,
    },
}

/// How open-loop arrivals are spaced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arrivals {
    /// Exponential gaps (the default).
    Poisson,
    /// Evenly spaced, each instance offset by a share of the gap: the worked example's
    /// arithmetic, without the noise.
    Uniform,
}

/// The client's timeouts and what it retries.
#[derive(Debug, Clone, PartialEq)]
pub struct ClientConfig {
    /// The per-try timeout: an attempt unanswered after this fails as `timeout`, and the
    /// dependency keeps working on it. Default none.
    pub per_try_timeout: Option<Duration>,
    /// The user action's deadline, from its start. Default 10 s.
    pub deadline: Duration,
    /// How long a timed-out attempt keeps its slot under the cap, at most (it comes back
    /// earlier when the dependency answers, unless `held_slot = "full-hold"`). Default 30 s,
    /// the proxy's ([`defaults::TIMEOUT_SLOT_HOLD`]).
    pub timeout_slot_hold: Duration,
    /// The failures that are retried, by every policy. Default the proxy's
    /// ([`defaults::RETRY_ON`]): `5xx,reset,connect-failure,refused-stream,timeout`.
    pub retry_on: RetryOn,
    /// An action counts as fast when it succeeds within this. Default: none (not reported).
    pub fast_within: Option<Duration>,
    /// When a timed-out attempt's held slot comes back. Default
    /// [`OnAnswer`](HeldSlotRelease::OnAnswer).
    pub held_slot: HeldSlotRelease,
}

/// When a timed-out attempt's slot under the cap is released.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeldSlotRelease {
    /// When the dependency answers (the late answer is seen) or the hold passes, whichever is
    /// first (`HeldSlot::upstream_answered`): what the proxy, and the tower layer given a spawner,
    /// do. `held_slot = "until-answer"`.
    OnAnswer,
    /// Only when the hold passes, answer or not: what a placement that stops reading the
    /// connection at the timeout does. `held_slot = "full-hold"`.
    FullHold,
}

/// The dependency's conditions at one time.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Conditions {
    /// Attempts served in parallel, 1..=1 000 000.
    pub capacity: u32,
    /// The fraction of attempts answered with a 503, drawn when each arrives, in `[0, 1]`.
    pub error_rate: f64,
    /// How long serving one attempt takes, drawn when it starts.
    pub service_time: ServiceTime,
    /// How long a failing attempt takes instead; `None`: the same as a success.
    pub error_time: Option<ServiceTime>,
}

/// The dependency: its baseline conditions and its queue.
#[derive(Debug, Clone, PartialEq)]
pub struct DependencyConfig {
    /// Attempts that may wait for a server; a full queue answers 503 at once. `None`:
    /// unbounded (the default).
    pub queue: Option<u32>,
    /// The conditions outside every phase.
    pub base: Conditions,
}

/// A stretch of the timeline with its own conditions.
#[derive(Debug, Clone, PartialEq)]
pub struct Phase {
    /// Its name in the report.
    pub name: String,
    /// When it starts.
    pub start: Duration,
    /// When it ends.
    pub end: Duration,
    /// The baseline with this phase's keys applied.
    pub conditions: Conditions,
    /// Whether it is the trigger that recovery is measured from (the end of the last one).
    pub trigger: bool,
}

/// One policy to compare.
#[derive(Debug, Clone, PartialEq)]
pub struct PolicyConfig {
    /// Its name in the report (unique). Default: one that says what it is (`retry-once`,
    /// `ratio-budget+breaker`).
    pub name: String,
    /// Whether and how failed attempts are retried.
    pub retry: RetryRule,
    /// stormguard's shared cap over every attempt, if any.
    pub cap: Option<CapConfig>,
    /// A circuit breaker, if any.
    pub breaker: Option<BreakerConfig>,
    /// Whether the cap, the budget and the breaker are per instance or shared by the fleet.
    pub share: Share,
    /// Whole retries per user action, shared by its calls (on top of the budget), if any.
    pub scope_retries: Option<u64>,
}

/// How a policy retries.
#[derive(Debug, Clone, PartialEq)]
pub enum RetryRule {
    /// Never.
    None,
    /// Up to `max_retries` per request, every retryable failure, no budget: what most clients
    /// do.
    Naive {
        /// Retries per request.
        max_retries: u32,
        /// `None`: immediately.
        backoff: Option<BackoffConfig>,
    },
    /// stormguard: `RetryPolicy::decide` over a budget, then `admit` under the cap. Every key
    /// left out takes the proxy's default ([`defaults`]).
    Budget {
        /// The budget.
        spec: BudgetSpec,
        /// Retries per request (`RetryConfig::max_retries`). Default 2.
        max_retries: u32,
        /// `None` (`backoff = "none"`): immediately. Default the proxy's: 25 ms..250 ms, full
        /// jitter.
        backoff: Option<BackoffConfig>,
    },
}

/// stormguard's cap for one policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CapConfig {
    /// Attempts in flight, 1..=2^24. A budget policy without one has the proxy's, 20.
    pub cap: u64,
    /// Primaries that may wait for a slot. Default 100, the proxy's.
    pub queue_len: u64,
    /// The longest a primary waits. Default 1 s, the proxy's.
    pub queue_timeout: Duration,
    /// `Some(n)`: retries take slots from a separate pool of `n` instead of the shared cap
    /// (the arrangement the worked example warns against: the pools add up).
    pub retry_pool: Option<u64>,
}

/// Whether a policy's cap, budget and breaker belong to each instance or to the fleet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Share {
    /// One of each per instance: caps and floors multiply with the instance count.
    Instance,
    /// One of each for the fleet (what stormguard's Redis mode shares: cap slots and the
    /// reserve; the percent is scale-invariant either way).
    Fleet,
}

impl Scenario {
    /// Reads and validates a scenario; `origin` names it in errors (a path, or
    /// `--builtin NAME`).
    pub fn parse(origin: &str, text: &str) -> Result<Scenario, ScenarioError> {
        let ctx = Ctx { origin, text };
        let doc = ImDocument::parse(text).map_err(|e| ScenarioError {
            origin: origin.to_string(),
            line: ctx.line(e.span().map_or(0, |s| s.start)),
            key: String::new(),
            message: e.message().trim().to_string(),
        })?;
        let root = Section { ctx: &ctx, table: doc.as_table(), path: String::new(), line: 1 };
        root.deny_unknown(&[
            "name",
            "description",
            "seed",
            "duration",
            "bucket",
            "recovered_at",
            "fleet",
            "client",
            "dependency",
            "phase",
            "policy",
        ])?;
        let default_name = origin
            .rsplit('/')
            .next()
            .unwrap_or(origin)
            .trim_end_matches(".toml")
            .trim_start_matches("--builtin ")
            .to_string();
        let name = root.string("name")?.unwrap_or(default_name);
        let description = root.string("description")?.unwrap_or_default();
        let seed = root.u64("seed", 0..=u64::MAX)?.unwrap_or(1);
        let duration = root.duration("duration")?.unwrap_or(Duration::from_secs(60));
        if duration.is_zero() || duration > Duration::from_secs(86_400) {
            return Err(root.fail("duration", "must be above 0 and at most 24h"));
        }
        let bucket = root.duration("bucket")?.unwrap_or(Duration::from_secs(1));
        if bucket < Duration::from_millis(1) || bucket > duration {
            return Err(root.fail("bucket", "must be at least 1ms and at most the duration"));
        }
        if duration.as_nanos() / bucket.as_nanos() > 1_000_000 {
            return Err(root.fail("bucket", "more than 1 000 000 buckets: make it wider"));
        }
        let recovered_at = root.fraction("recovered_at")?.unwrap_or(0.95);

        let fleet_section = root.sub("fleet")?;
        let fleet = parse_fleet(&fleet_section)?;
        let client = parse_client(&root.sub("client")?)?;
        let dep = root.sub("dependency")?;
        let dependency = parse_dependency(&dep)?;
        let phases = parse_phases(&root, &dependency.base, duration)?;
        let policies = parse_policies(&root)?;
        if let Some(calls) = fleet.expected_calls(duration)
            && calls > MAX_ATTEMPTS as f64
        {
            let key = if fleet_section.item("rate").is_some() { "rate" } else { "instances" };
            return Err(fleet_section.fail(
                key,
                format!(
                    "the fleet starts about {calls:.0} calls per policy (instances × rate × \
                     duration × fan_out), more than the {MAX_ATTEMPTS} attempts the simulator \
                     runs per policy: shorten duration, or lower rate, instances or fan_out"
                ),
            ));
        }
        Ok(Scenario {
            name,
            description,
            seed,
            duration,
            bucket,
            fleet,
            client,
            dependency,
            phases,
            policies,
            recovered_at,
        })
    }

    /// Reads a scenario file.
    pub fn from_file(path: &std::path::Path) -> Result<Scenario, ScenarioError> {
        let origin = path.display().to_string();
        let text =
            stormguard_input::read_to_string(path, stormguard_input::MAX_FILE).map_err(|e| {
                ScenarioError {
                    origin: origin.clone(),
                    line: 0,
                    key: String::new(),
                    message: format!("cannot read the scenario: {e}"),
                }
            })?;
        Scenario::parse(&origin, &text)
    }

    /// When the last trigger phase ends, if there is one.
    pub fn trigger_end(&self) -> Option<Duration> {
        self.phases.iter().filter(|p| p.trigger).map(|p| p.end).max()
    }

    /// The timeline as consecutive segments covering `[0, duration)`: the phases, and the
    /// baseline stretches between them (named `baseline` before the first phase and
    /// `after NAME` after one).
    pub fn segments(&self) -> Vec<Phase> {
        let mut out = Vec::new();
        let mut t = Duration::ZERO;
        let mut previous: Option<&str> = None;
        // A scenario shortened in code may end before some of its phases.
        for p in self.phases.iter().filter(|p| p.start < self.duration) {
            let p = &Phase { end: p.end.min(self.duration), ..p.clone() };
            if p.start > t {
                out.push(Phase {
                    name: previous.map_or("baseline".to_string(), |n| format!("after {n}")),
                    start: t,
                    end: p.start,
                    conditions: self.dependency.base,
                    trigger: false,
                });
            }
            out.push(p.clone());
            t = p.end;
            previous = Some(out.last().map_or("", |p| p.name.as_str()));
        }
        if t < self.duration || out.is_empty() {
            out.push(Phase {
                name: previous.map_or("baseline".to_string(), |n| format!("after {n}")),
                start: t,
                end: self.duration,
                conditions: self.dependency.base,
                trigger: false,
            });
        }
        out
    }
}

struct Ctx<'a> {
    origin: &'a str,
    text: &'a str,
}

impl Ctx<'_> {
    fn line(&self, offset: usize) -> usize {
        let end = offset.min(self.text.len());
        self.text.as_bytes()[..end].iter().filter(|b| **b == b'\n').count() + 1
    }
}

/// A table being read, with its dotted path for messages.
struct Section<'a> {
    ctx: &'a Ctx<'a>,
    table: &'a dyn TableLike,
    path: String,
    /// The line of the table's header, for keys that are missing.
    line: usize,
}

type Res<T> = Result<T, ScenarioError>;

impl<'a> Section<'a> {
    fn key_path(&self, key: &str) -> String {
        if self.path.is_empty() { key.to_string() } else { format!("{}.{key}", self.path) }
    }

    fn span_of(&self, key: &str) -> Option<Range<usize>> {
        let (k, item): (&Key, &Item) = self.table.get_key_value(key)?;
        k.span().or_else(|| item.span())
    }

    fn fail(&self, key: &str, message: impl Into<String>) -> ScenarioError {
        ScenarioError {
            origin: self.ctx.origin.to_string(),
            line: self.span_of(key).map_or(self.line, |s| self.ctx.line(s.start)),
            key: self.key_path(key),
            message: message.into(),
        }
    }

    fn deny_unknown(&self, allowed: &[&str]) -> Res<()> {
        for (k, _) in self.table.iter() {
            if !allowed.contains(&k) {
                return Err(
                    self.fail(k, format!("unknown key (expected one of: {})", allowed.join(", ")))
                );
            }
        }
        Ok(())
    }

    fn item(&self, key: &str) -> Option<&'a Item> {
        self.table.get(key)
    }

    /// A sub-table (`[fleet]`); an empty one when absent.
    fn sub(&self, key: &str) -> Res<Section<'a>> {
        static EMPTY: std::sync::OnceLock<toml_edit::Table> = std::sync::OnceLock::new();
        let table: &'a dyn TableLike = match self.item(key) {
            None => EMPTY.get_or_init(toml_edit::Table::new),
            Some(item) => item.as_table_like().ok_or_else(|| {
                self.fail(key, format!("expected a table, got {}", item.type_name()))
            })?,
        };
        let line = self.span_of(key).map_or(self.line, |s| self.ctx.line(s.start));
        Ok(Section { ctx: self.ctx, table, path: self.key_path(key), line })
    }

    /// The tables of `[[key]]`.
    fn array(&self, key: &str) -> Res<Vec<Section<'a>>> {
        match self.item(key) {
            None => Ok(Vec::new()),
            Some(item) => {
                let tables = item.as_array_of_tables().ok_or_else(|| {
                    self.fail(key, format!("expected [[{key}]] tables, got {}", item.type_name()))
                })?;
                Ok(tables
                    .iter()
                    .enumerate()
                    .map(|(i, t)| Section {
                        ctx: self.ctx,
                        table: t,
                        path: format!("{}[{}]", self.key_path(key), i + 1),
                        line: t.span().map_or(self.line, |s| self.ctx.line(s.start)),
                    })
                    .collect())
            }
        }
    }

    fn string(&self, key: &str) -> Res<Option<String>> {
        match self.item(key) {
            None => Ok(None),
            Some(item) => item.as_str().map(|s| Some(s.to_string())).ok_or_else(|| {
                self.fail(key, format!("expected a string, got {}", item.type_name()))
            }),
        }
    }

    fn bool(&self, key: &str) -> Res<Option<bool>> {
        match self.item(key) {
            None => Ok(None),
            Some(item) => item.as_bool().map(Some).ok_or_else(|| {
                self.fail(key, format!("expected true or false, got {}", item.type_name()))
            }),
        }
    }

    fn u64(&self, key: &str, range: std::ops::RangeInclusive<u64>) -> Res<Option<u64>> {
        let Some(item) = self.item(key) else { return Ok(None) };
        let n = item.as_integer().ok_or_else(|| {
            self.fail(key, format!("expected an integer, got {}", item.type_name()))
        })?;
        let n = u64::try_from(n)
            .map_err(|_| self.fail(key, format!("must not be negative, got {n}")))?;
        if !range.contains(&n) {
            let (lo, hi) = (*range.start(), *range.end());
            let msg = match (lo, hi) {
                (1, u64::MAX) => format!("must be at least 1, got {n}"),
                (lo, hi) => format!("must be between {lo} and {hi}, got {n}"),
            };
            return Err(self.fail(key, msg));
        }
        Ok(Some(n))
    }

    fn u32(&self, key: &str, range: std::ops::RangeInclusive<u32>) -> Res<Option<u32>> {
        let (lo, hi) = (u64::from(*range.start()), u64::from(*range.end()));
        let hi = if hi == u64::from(u32::MAX) { u64::MAX } else { hi };
        Ok(self.u64(key, lo..=hi)?.map(|n| u32::try_from(n).unwrap_or(u32::MAX)))
    }

    fn number(&self, key: &str) -> Res<Option<f64>> {
        let Some(item) = self.item(key) else { return Ok(None) };
        let v =
            item.as_float().or_else(|| item.as_integer().map(|i| i as f64)).ok_or_else(|| {
                self.fail(key, format!("expected a number, got {}", item.type_name()))
            })?;
        if !v.is_finite() {
            return Err(self.fail(key, "must be a finite number"));
        }
        Ok(Some(v))
    }

    fn fraction(&self, key: &str) -> Res<Option<f64>> {
        match self.number(key)? {
            Some(v) if !(0.0..=1.0).contains(&v) => {
                Err(self.fail(key, format!("must be a fraction in [0, 1], got {v}")))
            }
            v => Ok(v),
        }
    }

    fn duration(&self, key: &str) -> Res<Option<Duration>> {
        match self.string(key)? {
            None => Ok(None),
            Some(s) => parse_duration(&s).map(Some).map_err(|e| self.fail(key, e.to_string())),
        }
    }

    fn service_time(&self, key: &str) -> Res<Option<ServiceTime>> {
        match self.string(key)? {
            None => Ok(None),
            Some(s) => ServiceTime::parse(&s).map(Some).map_err(|e| self.fail(key, e.to_string())),
        }
    }
}

fn parse_fleet(s: &Section<'_>) -> Res<Fleet> {
    s.deny_unknown(&["instances", "rate", "arrivals", "concurrency", "think", "fan_out"])?;
    let instances = s.u32("instances", 1..=10_000)?.unwrap_or(1);
    let fan_out = s.u32("fan_out", 1..=100)?.unwrap_or(1);
    let rate = s.number("rate")?;
    let concurrency = s.u32("concurrency", 1..=100_000)?;
    let load = match (rate, concurrency) {
        (Some(_), Some(_)) => {
            return Err(s.fail(
                "concurrency",
                "give rate (open loop) or concurrency (closed loop), not both",
            ));
        }
        (None, None) => {
            return Err(s.fail(
                "rate",
                "missing: give rate (actions per second per instance, open loop) or concurrency \
                 (workers per instance, closed loop)",
            ));
        }
        (Some(rate), None) => {
            if rate <= 0.0 || rate > 10_000_000.0 {
                return Err(s.fail(
                    "rate",
                    format!("must be above 0 and at most 10 000 000 per second, got {rate}"),
                ));
            }
            if s.item("think").is_some() {
                return Err(s.fail("think", "think time is for closed loop (concurrency)"));
            }
            let arrivals = match s.string("arrivals")?.as_deref() {
                None | Some("poisson") => Arrivals::Poisson,
                Some("uniform") => Arrivals::Uniform,
                Some(other) => {
                    return Err(
                        s.fail("arrivals", format!("`{other}`: expected poisson or uniform"))
                    );
                }
            };
            Load::Open { rate, arrivals }
        }
        (None, Some(concurrency)) => {
            if s.item("arrivals").is_some() {
                return Err(s.fail("arrivals", "arrivals are for open loop (rate)"));
            }
            Load::Closed { concurrency, think: s.duration("think")?.unwrap_or(Duration::ZERO) }
        }
    };
    Ok(Fleet { instances, load, fan_out })
}

fn parse_client(s: &Section<'_>) -> Res<ClientConfig> {
    s.deny_unknown(&[
        "per_try_timeout",
        "deadline",
        "timeout_slot_hold",
        "held_slot",
        "retry_on",
        "fast_within",
    ])?;
    let per_try_timeout = s.duration("per_try_timeout")?;
    if per_try_timeout.is_some_and(|d| d.is_zero()) {
        return Err(s.fail("per_try_timeout", "must be above 0"));
    }
    let deadline = s.duration("deadline")?.unwrap_or(Duration::from_secs(10));
    if deadline.is_zero() || deadline > Duration::from_secs(3_600) {
        return Err(s.fail("deadline", "must be above 0 and at most 1h"));
    }
    let retry_on = match s.string("retry_on")? {
        None => RetryOn::default(),
        Some(t) => t.parse::<RetryOn>().map_err(|e| s.fail("retry_on", e.to_string()))?,
    };
    let timeout_slot_hold = s.duration("timeout_slot_hold")?.unwrap_or(defaults::TIMEOUT_SLOT_HOLD);
    if timeout_slot_hold.is_zero() {
        return Err(s.fail("timeout_slot_hold", "must be above 0"));
    }
    Ok(ClientConfig {
        per_try_timeout,
        deadline,
        timeout_slot_hold,
        retry_on,
        fast_within: s.duration("fast_within")?,
        held_slot: match s.string("held_slot")?.as_deref() {
            None | Some("until-answer") => HeldSlotRelease::OnAnswer,
            Some("full-hold") => HeldSlotRelease::FullHold,
            Some(other) => {
                return Err(
                    s.fail("held_slot", format!("`{other}`: expected until-answer or full-hold"))
                );
            }
        },
    })
}

const CONDITION_KEYS: [&str; 4] = ["capacity", "error_rate", "service_time", "error_time"];

fn parse_conditions(s: &Section<'_>, base: Option<&Conditions>) -> Res<Conditions> {
    let capacity = s.u32("capacity", 1..=1_000_000)?;
    let error_rate = s.fraction("error_rate")?;
    let service_time = s.service_time("service_time")?;
    let error_time = s.service_time("error_time")?;
    match base {
        Some(b) => Ok(Conditions {
            capacity: capacity.unwrap_or(b.capacity),
            error_rate: error_rate.unwrap_or(b.error_rate),
            service_time: service_time.unwrap_or(b.service_time),
            error_time: error_time.or(b.error_time),
        }),
        None => Ok(Conditions {
            capacity: capacity.ok_or_else(|| {
                s.fail("capacity", "missing: how many attempts the dependency serves in parallel")
            })?,
            error_rate: error_rate.unwrap_or(0.0),
            service_time: service_time
                .ok_or_else(|| s.fail("service_time", "missing: e.g. \"exponential 50ms\""))?,
            error_time,
        }),
    }
}

fn parse_dependency(s: &Section<'_>) -> Res<DependencyConfig> {
    let mut keys = CONDITION_KEYS.to_vec();
    keys.push("queue");
    s.deny_unknown(&keys)?;
    let queue = match s.item("queue") {
        None => None,
        Some(item) if item.as_str() == Some("unbounded") => None,
        Some(item) if item.as_integer().is_some() => s.u32("queue", 0..=10_000_000)?,
        Some(_) => return Err(s.fail("queue", "expected an integer or \"unbounded\"")),
    };
    Ok(DependencyConfig { queue, base: parse_conditions(s, None)? })
}

fn parse_phases(root: &Section<'_>, base: &Conditions, duration: Duration) -> Res<Vec<Phase>> {
    let mut phases: Vec<Phase> = Vec::new();
    for s in root.array("phase")? {
        let mut keys = CONDITION_KEYS.to_vec();
        keys.extend(["name", "start", "end", "duration", "trigger"]);
        s.deny_unknown(&keys)?;
        let start = s
            .duration("start")?
            .ok_or_else(|| s.fail("start", "missing: when the phase starts"))?;
        let end = match (s.duration("end")?, s.duration("duration")?) {
            (Some(_), Some(_)) => return Err(s.fail("duration", "give end or duration, not both")),
            (Some(e), None) => e,
            (None, Some(d)) => start + d,
            (None, None) => duration,
        };
        if end <= start {
            return Err(s.fail("end", format!("must be after start ({})", format_duration(start))));
        }
        if start >= duration {
            return Err(s.fail(
                "start",
                format!("is past the scenario's duration ({})", format_duration(duration)),
            ));
        }
        if let Some(prev) = phases.last()
            && start < prev.end
        {
            return Err(s.fail(
                "start",
                format!("overlaps phase `{}`, which ends at {}: phases are in time order and do not overlap", prev.name, format_duration(prev.end)),
            ));
        }
        let name = s.string("name")?.unwrap_or_else(|| format!("phase {}", phases.len() + 1));
        phases.push(Phase {
            name,
            start,
            end: end.min(duration),
            conditions: parse_conditions(&s, Some(base))?,
            trigger: s.bool("trigger")?.unwrap_or(false),
        });
    }
    Ok(phases)
}

/// A policy's backoff: `None` retries at once. `default` is what an absent `backoff` means:
/// none for a naive policy, the proxy's for a budget policy (and then `jitter` alone applies to
/// it).
fn parse_backoff(s: &Section<'_>, default: Option<BackoffConfig>) -> Res<Option<BackoffConfig>> {
    let jitter = match s.string("jitter")? {
        None => None,
        Some(j) => Some(j.parse::<Jitter>().map_err(|e| s.fail("jitter", e.to_string()))?),
    };
    match s.string("backoff")?.as_deref() {
        None if default.is_some() => {
            let mut b = default.expect("checked");
            if let Some(j) = jitter {
                b.jitter = j;
            }
            Ok(Some(b))
        }
        None | Some("none") => {
            if jitter.is_some() && s.item("backoff").is_none() {
                return Err(
                    s.fail("jitter", "jitter needs a backoff (e.g. backoff = \"25ms..250ms\")")
                );
            }
            Ok(None)
        }
        Some(range) => {
            let mut b =
                BackoffConfig::parse_range(range).map_err(|e| s.fail("backoff", e.to_string()))?;
            if let Some(j) = jitter {
                b.jitter = j;
            }
            Ok(Some(b))
        }
    }
}

fn parse_breaker(s: &Section<'_>) -> Res<Option<BreakerConfig>> {
    let Some(item) = s.item("breaker") else { return Ok(None) };
    if let Some(b) = item.as_bool() {
        return Ok(b.then(BreakerConfig::default));
    }
    let t = s.sub("breaker")?;
    t.deny_unknown(&[
        "failure_ratio",
        "min_requests",
        "window",
        "consecutive_failures",
        "break_duration",
        "half_open_probes",
    ])?;
    let mut c = BreakerConfig::default();
    if let Some(r) = t.fraction("failure_ratio")? {
        c.failure_ratio = Fraction::from_millionths((r * 1e6).round() as u64);
    }
    if let Some(n) = t.u64("min_requests", 1..=u64::MAX)? {
        c.min_requests = n;
    }
    if let Some(w) = t.duration("window")? {
        c.window = w;
    }
    if let Some(n) = t.u64("consecutive_failures", 0..=u64::MAX)? {
        c.consecutive_failures = (n > 0).then_some(n);
    }
    if let Some(d) = t.duration("break_duration")? {
        c.break_duration = d;
    }
    if let Some(n) = t.u64("half_open_probes", 1..=1_000)? {
        c.half_open_probes = n;
    }
    c.validate().map_err(|e| s.fail("breaker", e.to_string()))?;
    Ok(Some(c))
}

fn parse_policies(root: &Section<'_>) -> Res<Vec<PolicyConfig>> {
    let sections = root.array("policy")?;
    if sections.is_empty() {
        return Err(root.fail("policy", "missing: no [[policy]] to simulate"));
    }
    if sections.len() > 32 {
        return Err(root.fail("policy", "at most 32 policies"));
    }
    let mut out: Vec<PolicyConfig> = Vec::new();
    for s in sections {
        s.deny_unknown(&[
            "name",
            "retries",
            "backoff",
            "jitter",
            "budget",
            "cap",
            "queue",
            "queue_timeout",
            "retry_pool",
            "breaker",
            "share",
            "scope_retries",
        ])?;
        let retries = s.u32("retries", 0..=MAX_RETRIES_LIMIT)?;
        let retry = match s.string("budget")? {
            Some(text) => {
                let spec = BudgetSpec::parse(&text).map_err(|e| s.fail("budget", e.to_string()))?;
                let stormguard = RetryConfig::default();
                RetryRule::Budget {
                    spec,
                    max_retries: retries.unwrap_or(stormguard.max_retries),
                    backoff: parse_backoff(&s, Some(stormguard.backoff))?,
                }
            }
            None => match retries.unwrap_or(0) {
                0 => {
                    parse_backoff(&s, None)?;
                    if s.item("backoff").is_some() {
                        return Err(s.fail("backoff", "a policy without retries has no backoff"));
                    }
                    RetryRule::None
                }
                n => RetryRule::Naive { max_retries: n, backoff: parse_backoff(&s, None)? },
            },
        };
        let budgeted = matches!(retry, RetryRule::Budget { .. });
        // A budget runs under stormguard's cap: without `cap`, the proxy's.
        let cap = match s.u64("cap", 1..=MAX_CAP)?.or(budgeted.then_some(defaults::CAP)) {
            None => {
                for k in ["queue", "queue_timeout", "retry_pool"] {
                    if s.item(k).is_some() {
                        return Err(s.fail(k, "needs a cap"));
                    }
                }
                None
            }
            Some(cap) => {
                let stormguard = LimiterConfig::default();
                Some(CapConfig {
                    cap,
                    queue_len: s.u64("queue", 0..=MAX_CAP)?.unwrap_or(stormguard.queue_len),
                    queue_timeout: s.duration("queue_timeout")?.unwrap_or(stormguard.queue_timeout),
                    retry_pool: s.u64("retry_pool", 1..=MAX_CAP)?,
                })
            }
        };
        let share = match s.string("share")?.as_deref() {
            None | Some("instance") => Share::Instance,
            Some("fleet") => Share::Fleet,
            Some(other) => {
                return Err(s.fail("share", format!("`{other}`: expected instance or fleet")));
            }
        };
        let scope_retries = s.u64("scope_retries", 0..=1_000)?;
        if scope_retries.is_some() && !matches!(retry, RetryRule::Budget { .. }) {
            return Err(s.fail(
                "scope_retries",
                "scopes are charged by RetryPolicy: give the policy a budget",
            ));
        }
        let mut p = PolicyConfig {
            name: String::new(),
            retry,
            cap,
            breaker: parse_breaker(&s)?,
            share,
            scope_retries,
        };
        p.name = match s.string("name")? {
            Some(n) if n.trim().is_empty() => return Err(s.fail("name", "must not be empty")),
            Some(n) => n,
            None => p.default_name(),
        };
        if out.iter().any(|q| q.name == p.name) {
            let key = if s.item("name").is_some() { "name" } else { "retries" };
            return Err(s.fail(
                key,
                format!("a policy named `{}` is already listed: give this one a name", p.name),
            ));
        }
        out.push(p);
    }
    Ok(out)
}

impl CapConfig {
    /// The limiter this cap runs (the shared cap; a `retry_pool` is a limiter of its own).
    pub fn limiter_config(&self) -> LimiterConfig {
        LimiterConfig {
            cap: self.cap,
            queue_len: self.queue_len,
            queue_timeout: self.queue_timeout,
        }
    }
}

/// A backoff that is no wait at all, for budget policies configured to retry at once
/// (`BackoffConfig` refuses a zero base; the engine takes waits under 1 µs at once).
fn immediate_backoff() -> BackoffConfig {
    BackoffConfig {
        base: Duration::from_nanos(1),
        max: Duration::from_nanos(1),
        multiplier: Fraction::ONE,
        jitter: Jitter::None,
    }
}

impl PolicyConfig {
    /// The retry rules a budget policy runs (`None` for a naive policy or none): the client's
    /// `retry_on`, the policy's retries and backoff, and the proxy's default for everything
    /// else, so a scenario that sets nothing models what `stormguard proxy` does with nothing
    /// set.
    pub fn retry_config(&self, client: &ClientConfig) -> Option<RetryConfig> {
        match &self.retry {
            RetryRule::Budget { max_retries, backoff, .. } => Some(RetryConfig {
                retry_on: client.retry_on.clone(),
                max_retries: *max_retries,
                backoff: backoff.unwrap_or_else(immediate_backoff),
                ..RetryConfig::default()
            }),
            _ => None,
        }
    }

    /// A name that says what the policy is: `no-retries`, `retry-once`, `retry-3-backoff`,
    /// `ratio-budget`, with `+cap20`, `+breaker`, `+retry-pool4`, `+scope1` and `/fleet`
    /// added for what it has.
    pub fn default_name(&self) -> String {
        let mut name = match &self.retry {
            RetryRule::None => "no-retries".to_string(),
            RetryRule::Naive { max_retries: 1, backoff: None } => "retry-once".to_string(),
            RetryRule::Naive { max_retries, backoff: None } => format!("retry-{max_retries}"),
            RetryRule::Naive { max_retries, backoff: Some(_) } => {
                format!("retry-{max_retries}-backoff")
            }
            RetryRule::Budget { spec, .. } => match spec {
                BudgetSpec::TokenBucket(_) => "token-bucket".to_string(),
                other => format!("{}-budget", other.kind()),
            },
        };
        if let (Some(c), false) = (&self.cap, matches!(self.retry, RetryRule::Budget { .. })) {
            name.push_str(&format!("+cap{}", c.cap));
        }
        if let Some(n) = self.cap.and_then(|c| c.retry_pool) {
            name.push_str(&format!("+retry-pool{n}"));
        }
        if let Some(n) = self.scope_retries {
            name.push_str(&format!("+scope{n}"));
        }
        if self.breaker.is_some() {
            name.push_str("+breaker");
        }
        if self.share == Share::Fleet {
            name.push_str("/fleet");
        }
        name
    }

    /// One line on what the policy does, for the report.
    pub fn describe(&self) -> String {
        let retries = |n: u32| if n == 1 { "1 retry".to_string() } else { format!("{n} retries") };
        let backoff = |b: &Option<BackoffConfig>| match b {
            None => "at once".to_string(),
            Some(b) => format!(
                "after {}..{} {} jitter",
                format_duration(b.base),
                format_duration(b.max),
                b.jitter
            ),
        };
        let mut parts = vec![match &self.retry {
            RetryRule::None => "no retries".to_string(),
            RetryRule::Naive { max_retries, backoff: b } => {
                format!("up to {} {}", retries(*max_retries), backoff(b))
            }
            RetryRule::Budget { spec, max_retries, backoff: b } => {
                format!("{spec}, up to {} {}", retries(*max_retries), backoff(b))
            }
        }];
        if let Some(c) = &self.cap {
            match c.retry_pool {
                None => parts.push(format!("cap {} shared by every attempt", c.cap)),
                Some(n) => parts.push(format!(
                    "cap {} for primaries + a separate pool of {n} for retries",
                    c.cap
                )),
            }
        }
        if let Some(n) = self.scope_retries {
            parts.push(format!("{n} retries per user action"));
        }
        if let Some(b) = &self.breaker {
            parts.push(format!(
                "breaker ({} probe(s) half-open, {} break)",
                b.half_open_probes,
                format_duration(b.break_duration)
            ));
        }
        if self.cap.is_some() || self.breaker.is_some() {
            parts.push(match self.share {
                Share::Instance => "per instance".to_string(),
                Share::Fleet => "shared by the fleet".to_string(),
            });
        }
        parts.join("; ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIN: &str = "[fleet]\nrate = 10\n[dependency]\ncapacity = 4\nservice_time = \"10ms\"\n";

    fn parse(extra: &str) -> Result<Scenario, ScenarioError> {
        Scenario::parse("t.toml", &format!("{MIN}{extra}"))
    }

    #[test]
    fn defaults() {
        let s = parse("[[policy]]\n").unwrap();
        assert_eq!(s.name, "t");
        assert_eq!(s.seed, 1);
        assert_eq!(s.duration, Duration::from_secs(60));
        assert_eq!(s.policies[0].name, "no-retries");
        assert_eq!(s.dependency.queue, None);
        assert_eq!(s.segments().len(), 1);
        // What stormguard itself does comes from core's defaults, as in the proxy.
        assert_eq!(s.client.retry_on, RetryOn::default());
        assert_eq!(s.client.timeout_slot_hold, defaults::TIMEOUT_SLOT_HOLD);
        let s = parse("[[policy]]\nbudget = \"ratio\"\n").unwrap();
        let p = &s.policies[0];
        assert_eq!(p.name, "ratio-budget");
        assert_eq!(p.cap.unwrap().limiter_config(), LimiterConfig::default());
        assert_eq!(p.retry_config(&s.client), Some(RetryConfig::default()));
        // A naive policy retries at once unless given a backoff; `none` keeps a budget's at once.
        let s =
            parse("[[policy]]\nretries = 2\n[[policy]]\nbudget = \"ratio\"\nbackoff = \"none\"\n")
                .unwrap();
        assert_eq!(s.policies[0].retry, RetryRule::Naive { max_retries: 2, backoff: None });
        assert_eq!(s.policies[1].retry_config(&s.client).unwrap().backoff, immediate_backoff());
    }

    #[test]
    fn errors_name_line_and_key() {
        let e = |extra: &str| parse(extra).unwrap_err().to_string();
        assert_eq!(
            e("[[policy]]\nretries = 11\n"),
            "t.toml:7: policy[1].retries: must be between 0 and 10, got 11"
        );
        assert_eq!(
            e("[[policy]]\nbudget = \"ratio:percent=2000\"\ncap = 20\n"),
            "t.toml:7: policy[1].budget: percent must be a fraction in [0, 1000], got 2000"
        );
        assert!(e("[[policy]]\nbogus = 1\n").starts_with("t.toml:7: policy[1].bogus: unknown key"));
        assert!(e("[[policy]]\n[[policy]]\n").contains("already listed"));
        assert!(
            e("[[policy]]\ncap = 5\nretry_pool = 0\n")
                .contains("retry_pool: must be between 1 and 16777216, got 0")
        );
        assert!(
            e("[[phase]]\nstart = \"5s\"\nend = \"10s\"\n[[phase]]\nstart = \"8s\"\n[[policy]]\n")
                .starts_with("t.toml:10: phase[2].start: overlaps phase `phase 1`")
        );
        assert!(
            e("[[policy]]\nbreaker = { window = \"0s\" }\n")
                .contains("policy[1].breaker: window must be between")
        );
        let syntax = Scenario::parse("t.toml", "a = \n").unwrap_err();
        assert_eq!((syntax.line, syntax.key.as_str()), (1, ""));
        let missing = Scenario::parse("t.toml", "[[policy]]\n").unwrap_err();
        assert!(missing.to_string().contains("fleet.rate: missing"), "{missing}");
    }

    #[test]
    fn phases_and_segments() {
        let s = Scenario::parse(
            "t.toml",
            &format!("duration = \"30s\"\n{MIN}[[phase]]\nname = \"spike\"\nstart = \"10s\"\nduration = \"5s\"\nservice_time = \"exponential 40ms\"\ntrigger = true\n[[policy]]\n"),
        )
        .unwrap();
        let segs = s.segments();
        let names: Vec<_> = segs.iter().map(|p| p.name.as_str()).collect();
        assert_eq!(names, ["baseline", "spike", "after spike"]);
        assert_eq!(segs[1].conditions.capacity, 4);
        assert_eq!(s.trigger_end(), Some(Duration::from_secs(15)));
    }

    #[test]
    fn policy_names_say_what_they_are() {
        let s = parse(
            "[[policy]]\nretries = 1\n[[policy]]\nretries = 3\nbackoff = \"10ms..100ms\"\n\
             [[policy]]\nbudget = \"ratio:percent=0.25\"\ncap = 20\nbreaker = true\nshare = \"fleet\"\n\
             [[policy]]\nbudget = \"ratio\"\ncap = 20\nretry_pool = 4\n[[policy]]\nretries = 1\ncap = 20\n",
        )
        .unwrap();
        let names: Vec<_> = s.policies.iter().map(|p| p.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "retry-once",
                "retry-3-backoff",
                "ratio-budget+breaker/fleet",
                "ratio-budget+retry-pool4",
                "retry-once+cap20"
            ]
        );
    }
}
