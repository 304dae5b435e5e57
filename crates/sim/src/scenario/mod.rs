//! Scenario files: the fleet, the dependency and its timeline, the client, and the policies to
//! compare, in TOML.
//!
//! A scenario is validated once, when it is read, by [`stormguard_config`] like every stormguard
//! file: every refusal names the file, the line, the column and the key, indices from 0
//! (`storm.toml:9:11: policy[0].retries: must be between 0 and 10, got 12`), an unknown key is an
//! error rather than a silent default, and a broken rule can be matched as its
//! [`InvalidScenario`]. The built-in scenarios in `crates/sim/scenarios/` are complete examples;
//! `docs/simulator.md` lists every key.
//!
//! - this module: the scenario's model;
//! - `file`: the TOML shapes and reading;
//! - `validate`: the rules, from the shapes to the model.
//!
//! ```
//! use stormguard_sim::Scenario;
//! use stormguard_sim::scenario::InvalidScenario;
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
//! let err = Scenario::parse("bad.toml", "[fleet]\nrate = 10\n[dependency]\ncapacity = 0\n")
//!     .unwrap_err();
//! assert_eq!(
//!     err.to_string(),
//!     "bad.toml:4:12: dependency.capacity: must be between 1 and 1000000, got 0"
//! );
//! assert_eq!(
//!     err.rule::<InvalidScenario>(),
//!     Some(&InvalidScenario::OutOfRange { min: 1, max: 1_000_000, got: 0 })
//! );
//! # Ok::<(), stormguard_sim::ScenarioError>(())
//! ```

mod file;
mod validate;

use std::time::Duration;

use serde::Deserialize;
use stormguard_core::ConfigError;
use stormguard_core::adaptive::AdaptiveConfig;
use stormguard_core::backoff::{BackoffConfig, Jitter};
use stormguard_core::breaker::BreakerConfig;
use stormguard_core::budget::BudgetSpec;
use stormguard_core::conditions::RetryOn;
use stormguard_core::decimal::{Fraction, format_duration};
use stormguard_core::decision::RetryConfig;
use stormguard_core::limiter::LimiterConfig;

use crate::dist::ServiceTime;

/// A scenario that could not be read or is wrong: `file:line:column: key.path: reason`, the
/// shape of every stormguard file's errors. A broken rule is
/// [`rule::<InvalidScenario>()`](stormguard_config::FileError::rule).
pub type ScenarioError = stormguard_config::FileError;

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
    pub dependency: SimDependency,
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
    /// With [`Arrivals::Recorded`]: the recorded first tries' instants from the start of the
    /// run, in nanoseconds, in order (those before `duration`).
    pub recorded: Option<std::sync::Arc<[u64]>>,
    /// What each call sends a model provider: its prompt, in tokens, 0..=10^8. Default 0.
    pub input_tokens: u64,
    /// The most output tokens each call asks for (a request's `max_tokens`), 0..=10^8.
    /// Default 0. Rate admission books `input_tokens + max_tokens` before sending, as the proxy
    /// estimates a request's cost from its body.
    pub max_tokens: u64,
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

/// How open-loop arrivals are spaced (`arrivals = "poisson"` or `"uniform"`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Arrivals {
    /// Exponential gaps (the default).
    Poisson,
    /// Evenly spaced, each instance offset by a share of the gap: the worked example's
    /// arithmetic, without the noise.
    Uniform,
    /// At the instants of a recorded trace (`[fleet] trace = "FILE"`): the first tries the
    /// proxy's record mode wrote, so a real incident's arrivals run through the model.
    #[serde(skip)]
    Recorded,
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
    /// the proxy's ([`defaults::TIMEOUT_SLOT_HOLD`](stormguard_core::defaults::TIMEOUT_SLOT_HOLD)).
    pub timeout_slot_hold: Duration,
    /// The failures that are retried, by every policy. Default the proxy's
    /// ([`defaults::RETRY_ON`](stormguard_core::defaults::RETRY_ON)): `5xx,reset,connect-failure,refused-stream,timeout`.
    pub retry_on: RetryOn,
    /// An action counts as fast when it succeeds within this. Default: none (not reported).
    pub fast_within: Option<Duration>,
    /// When a timed-out attempt's held slot comes back. Default
    /// [`OnAnswer`](HeldSlotRelease::OnAnswer).
    pub held_slot: HeldSlotRelease,
    /// The fraction of requests that are not idempotent (POST-like), in `[0, 1]`, drawn per
    /// request. Default 0. stormguard neither hedges them nor retries a failure that may have
    /// reached the dependency (core's `non-idempotent`); naive retries retry them anyway, as
    /// a retry loop that does not look at the method does.
    pub non_idempotent: f64,
    /// The caller's own retries, on top of any policy's (`own_retries`, 0..=10): a request whose
    /// final answer failed — an error, a timeout, or a refusal — is sent again by the caller, up
    /// to this many times within its deadline, after `own_backoff`, as urllib3's `Retry` or a
    /// hand-written loop does (reading no advice). Default 0.
    pub own_retries: u32,
    /// The caller's wait before its own retry (`own_backoff`). Default 0: at once.
    pub own_backoff: Duration,
}

/// When a timed-out attempt's slot under the cap is released.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
pub enum HeldSlotRelease {
    /// When the dependency answers (the late answer is seen) or the hold passes, whichever is
    /// first (`HeldSlot::upstream_answered`): what the proxy, and the tower layer given a spawner,
    /// do. `held_slot = "until-answer"`.
    #[serde(rename = "until-answer")]
    OnAnswer,
    /// Only when the hold passes, answer or not: what a placement that stops reading the
    /// connection at the timeout does. `held_slot = "full-hold"`.
    #[serde(rename = "full-hold")]
    FullHold,
}

/// The dependency's conditions at one time.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Conditions {
    /// Attempts served in parallel, 1..=1 000 000 (with `workers` and no `capacity`: 1 000 000,
    /// every attempt served at once).
    pub capacity: u32,
    /// Past this many attempts in flight, each attempt takes `in flight / workers` times its
    /// drawn service time (fixed when its service starts, never past 60 s nor below the draw):
    /// a server whose work slows as it is overloaded, as chaos's `workers` plays one. `None`:
    /// load does not change the service time.
    pub workers: Option<u32>,
    /// The fraction of attempts answered with a 503, drawn when each arrives, in `[0, 1]`.
    pub error_rate: f64,
    /// How long serving one attempt takes, drawn when it starts.
    pub service_time: ServiceTime,
    /// How long a failing attempt takes instead; `None`: the same as a success.
    pub error_time: Option<ServiceTime>,
}

impl Conditions {
    /// The servers, or `None` when every attempt is served at once (`workers` without a
    /// `capacity`).
    pub fn servers(&self) -> Option<u32> {
        (self.workers.is_none() || self.capacity < 1_000_000).then_some(self.capacity)
    }

    /// The servers and workers in words: `20 servers`, `22 workers`, `20 servers, 22 workers`.
    pub fn describe_servers(&self) -> String {
        match (self.servers(), self.workers) {
            (Some(s), None) => format!("{s} servers"),
            (None, Some(w)) => format!("{w} workers"),
            (Some(s), Some(w)) => format!("{s} servers, {w} workers"),
            (None, None) => unreachable!("servers() is None only with workers"),
        }
    }
}

/// The dependency: its baseline conditions, its queue and its rate limit.
#[derive(Debug, Clone, PartialEq)]
pub struct SimDependency {
    /// Attempts that may wait for a server; a full queue answers 503 at once. `None`:
    /// unbounded (the default).
    pub queue: Option<u32>,
    /// The conditions outside every phase.
    pub base: Conditions,
    /// A model provider's requests and tokens per minute, if it has either.
    pub rate: Option<ProviderRate>,
    /// How much of a call's `max_tokens` the model writes, in `(0, 1]`: a served call's output
    /// is `max_tokens × output_fraction`, rounded up, and the provider counts that (its answer's
    /// `usage`). Default 1.
    pub output_fraction: f64,
    /// How long every attempt holds its server past its service time (drawn, and stretched by
    /// `workers`): a live dependency's own share, which a drawn time leaves out — its timer's
    /// tick, its scheduling, writing the answer. Zero by default (not read from a file);
    /// `stormguard verify` sets it to what chaos measured of itself, to calibrate the model.
    pub overhead: std::time::Duration,
}

impl SimDependency {
    /// The output tokens the model writes for a call that asks for at most `max_tokens`.
    pub fn output_tokens(&self, max_tokens: u64) -> u64 {
        // Rounded up: a fraction above 0 writes at least one token of a non-zero maximum.
        ((max_tokens as f64) * self.output_fraction).ceil().min(max_tokens as f64) as u64
    }
}

/// A provider's requests and tokens per minute, counted the way OpenAI and Anthropic describe
/// theirs: a bucket per limit refilled continuously over a minute. An attempt arrives asking
/// for one request and its `input_tokens + max_tokens`; when either bucket lacks room it is
/// answered 429 at once, with the time until both have refilled as its retry-after. A served
/// attempt's unused tokens come back when it is answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProviderRate {
    /// Requests per minute (`requests_per_minute`, `requests_remaining`), if limited.
    pub requests: Option<ProviderLimit>,
    /// Tokens per minute, input and output together (`tokens_per_minute`,
    /// `tokens_remaining`), if limited.
    pub tokens: Option<ProviderLimit>,
}

/// One of a provider's limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProviderLimit {
    /// Units per minute, 1..=10^12.
    pub per_minute: u64,
    /// What is left of them when the run starts (other callers used the rest), from 0 to
    /// `per_minute`. Default: all of them (a full bucket).
    pub remaining: u64,
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
    /// Rate admission against the provider's requests and tokens per minute, if any (needs a
    /// cap).
    pub rate: Option<RateAdmissionConfig>,
    /// Hedged requests, if any.
    pub hedge: Option<HedgeConfig>,
    /// Whether stormguard sees the caller's own retries (`client.own_retries`) as retries
    /// (`caller_retries = "enforce"`, the proxy's default: each charged to the budget and
    /// admitted with `try_acquire`, or refused) or as first tries (`"off"`). Budget policies
    /// only; a naive policy sees every request as a first try.
    pub caller_retries: bool,
}

/// Hedging: an attempt still unanswered after [`after`](HedgeConfig::after) gets a second
/// attempt (a hedge) beside it; the first successful answer is the caller's, and the other
/// attempt keeps its slot until the dependency finishes it.
///
/// Under a budget policy a hedge is a retry in all but its cause: it is sent only for an
/// idempotent request, never while the breaker refuses retries or a pushback hold is on, is
/// paid from the same budget (`try_retry`), and takes its slot with `try_acquire` (refused
/// `cap` when none is free, never queued). Refusals are counted by the retry reasons. Without
/// a budget (a naive hedger) only the request's idempotency, the breaker and a cap, if the
/// policy has them, stand in its way.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct HedgeConfig {
    /// When an unanswered attempt is hedged.
    pub after: HedgeAfter,
    /// Hedges per request, 1..=3 (`max_hedges`, default 1; 0 turns hedging off). A hedge that
    /// is itself unanswered after the delay may be hedged again.
    pub max_hedges: u32,
}

impl HedgeConfig {
    /// The same hedging in core's terms: the retry rules' hedge decision
    /// ([`RetryPolicy::decide_hedge`](stormguard_core::decision::RetryPolicy::decide_hedge)),
    /// and the delay ([`HedgeDelay`](stormguard_core::hedge::HedgeDelay)), read as the layer
    /// reads it from the cap's histogram of attempt times.
    pub fn to_core(&self) -> stormguard_core::hedge::HedgeConfig {
        use stormguard_core::hedge::HedgeAfter as Core;
        let after = match self.after {
            HedgeAfter::Fixed(d) => Core::Fixed(d),
            HedgeAfter::Percentile { quantile, floor } => {
                Core::Percentile { permille: (quantile * 1000.0).round() as u16, floor }
            }
        };
        stormguard_core::hedge::HedgeConfig { after, max_hedges: self.max_hedges }
    }
}

/// When an attempt is hedged (`hedge_after`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum HedgeAfter {
    /// A fixed delay after the attempt was sent: `hedge_after = "100ms"`.
    Fixed(Duration),
    /// A percentile of recent attempts' times under the cap (core's
    /// [`HedgeDelay`](stormguard_core::hedge::HedgeDelay), as in the layer: the cap's histogram
    /// since the percentile was last read, at least a second of virtual time and 20 attempts
    /// before it is trusted; an attempt cut by its per-try timeout counts at the timeout), by
    /// the same instance or the fleet when shared, never below `floor`: `hedge_after = "p95"`,
    /// `hedge_floor = "10ms"`. Needs a cap.
    Percentile {
        /// The quantile, in `[0.5, 0.999]` (`p95` is 0.95).
        quantile: f64,
        /// The least delay (`hedge_floor`, default 10 ms, above 0).
        floor: Duration,
    },
}

impl HedgeAfter {
    /// Reads `100ms` or `p95` (`p50` to `p99.9`), with `floor` for a percentile.
    pub fn parse(text: &str, floor: Duration) -> Option<HedgeAfter> {
        let text = text.trim();
        match text.strip_prefix('p') {
            Some(n) => {
                let pct: f64 = n.parse().ok()?;
                let tenths = pct * 10.0;
                ((500.0..=999.0).contains(&tenths) && tenths.fract() == 0.0)
                    .then_some(HedgeAfter::Percentile { quantile: pct / 100.0, floor })
            }
            None => stormguard_core::decimal::parse_duration(text)
                .ok()
                .filter(|d| !d.is_zero())
                .map(HedgeAfter::Fixed),
        }
    }
}

impl std::fmt::Display for HedgeAfter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match *self {
            HedgeAfter::Fixed(d) => f.write_str(&format_duration(d)),
            HedgeAfter::Percentile { quantile, .. } => {
                let pct = quantile * 100.0;
                if pct.fract() == 0.0 { write!(f, "p{pct:.0}") } else { write!(f, "p{pct:.1}") }
            }
        }
    }
}

/// Rate admission, as the proxy's `requests_per_minute`, `tokens_per_minute` and
/// `learn_rate_limits` configure it: core's `RateLimit`s in front of the cap, one for requests
/// and one for tokens. A first try books its request and its `input_tokens + max_tokens`, and
/// when there is no room waits for its turn (at most the cap's `queue_timeout`, and never past
/// its deadline; else it is refused `rate`), then queues for its slot; a retry never waits
/// (refused `rate`). An answer settles the booking at the tokens the provider counted; every
/// answer's limits and remaining are observed, and a 429 holds admission for its retry-after and
/// lowers the limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RateAdmissionConfig {
    /// The starting limit, requests per minute (1..=10^12). `None`: every request is admitted
    /// until an answer states the provider's limit.
    pub requests_per_minute: Option<u64>,
    /// The starting limit, tokens per minute (1..=10^12). `None`: as for requests.
    pub tokens_per_minute: Option<u64>,
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
    /// left out takes the proxy's default ([`defaults`](stormguard_core::defaults)).
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
    /// An adaptive cap (`adaptive = { min, max }`, the proxy's key): core's
    /// [`AdaptiveLimit`](stormguard_core::adaptive::AdaptiveLimit) moves the shared cap's
    /// working cap within `[min, max]`, starting at [`cap`](Self::cap) (clamped into the
    /// range). A retry pool stays fixed.
    pub adaptive: Option<AdaptiveConfig>,
}

/// Whether a policy's cap, budget and breaker belong to each instance or to the fleet
/// (`share = "instance"` or `"fleet"`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Share {
    /// One of each per instance: caps and floors multiply with the instance count.
    Instance,
    /// One of each for the fleet (what stormguard's Redis mode shares: cap slots and the
    /// reserve; the percent is scale-invariant either way).
    Fleet,
}

impl Scenario {
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

impl CapConfig {
    /// The limiter this cap runs (the shared cap; a `retry_pool` is a limiter of its own).
    pub fn limiter_config(&self) -> LimiterConfig {
        LimiterConfig {
            cap: self.cap,
            queue_len: self.queue_len,
            queue_timeout: self.queue_timeout,
            adaptive: self.adaptive,
        }
    }

    /// Where the working cap starts: the cap, clamped into an adaptive cap's range.
    pub fn initial(&self) -> u64 {
        self.adaptive.map_or(self.cap, |a| self.cap.clamp(a.min, a.max))
    }

    /// The most attempts the shared cap ever lets in flight: an adaptive cap's ceiling, or the
    /// cap.
    pub fn ceiling(&self) -> u64 {
        self.limiter_config().ceiling()
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
                hedge: self.hedge.filter(|h| h.max_hedges > 0).map(|h| h.to_core()),
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
        if let Some(a) = self.cap.and_then(|c| c.adaptive) {
            name.push_str(&format!("+adaptive{}-{}", a.min, a.max));
        }
        if let Some(n) = self.cap.and_then(|c| c.retry_pool) {
            name.push_str(&format!("+retry-pool{n}"));
        }
        if let Some(n) = self.scope_retries {
            name.push_str(&format!("+scope{n}"));
        }
        if self.rate.is_some() {
            name.push_str("+rate");
        }
        if let Some(h) = &self.hedge {
            name.push_str(&format!("+hedge-{}", h.after));
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
            let cap = match c.adaptive {
                None => format!("cap {}", c.cap),
                Some(a) => format!(
                    "adaptive cap {}..{} ({}), starting at {}",
                    a.min,
                    a.max,
                    a.algorithm,
                    c.initial()
                ),
            };
            match c.retry_pool {
                None => parts.push(format!("{cap} shared by every attempt")),
                Some(n) => {
                    parts.push(format!("{cap} for primaries + a separate pool of {n} for retries"))
                }
            }
        }
        if let Some(n) = self.scope_retries {
            parts.push(format!("{n} retries per user action"));
        }
        match self.rate.map(|r| (r.requests_per_minute, r.tokens_per_minute)) {
            None => {}
            Some((None, None)) => parts.push("rate admission learned from the answers".to_string()),
            Some((Some(n), None)) => parts.push(format!("rate admission from {n} requests/min")),
            Some((None, Some(t))) => parts.push(format!("rate admission from {t} tokens/min")),
            Some((Some(n), Some(t))) => {
                parts.push(format!("rate admission from {n} requests/min and {t} tokens/min"))
            }
        }
        if let Some(h) = &self.hedge {
            let after = match h.after {
                HedgeAfter::Fixed(d) => format_duration(d),
                HedgeAfter::Percentile { floor, .. } => format!(
                    "the {} of recent attempts (at least {})",
                    h.after,
                    format_duration(floor)
                ),
            };
            let paid = match self.retry {
                RetryRule::Budget { .. } => "paid from the retry budget",
                _ => "without a budget",
            };
            parts.push(format!("up to {} hedge(s) after {after}, {paid}", h.max_hedges));
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

/// A broken rule of a scenario: one variant per rule, each located at its key by the reader.
/// The message is one plain reason, lowercase without a trailing period.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum InvalidScenario {
    /// A whole number outside `[min, max]`.
    #[error("must be between {min} and {max}, got {got}")]
    OutOfRange {
        /// The smallest allowed.
        min: u64,
        /// The largest allowed.
        max: u64,
        /// The value given.
        got: u64,
    },
    /// Zero where at least 1 is needed (and there is no upper bound).
    #[error("must be at least 1, got 0")]
    Zero,
    /// A number that is infinite or not a number.
    #[error("must be a finite number")]
    NotFinite,
    /// A fraction outside `[0, 1]`.
    #[error("must be a fraction in [0, 1], got {got}")]
    NotAFraction {
        /// The value given.
        got: f64,
    },
    /// A duration of zero where time must pass (`per_try_timeout`, `timeout_slot_hold`).
    #[error("must be above 0")]
    ZeroDuration,
    /// A duration of zero or above its bound (`duration`: 24h, `deadline`: 1h).
    #[error("must be above 0 and at most {max}")]
    DurationOutOfRange {
        /// The bound, as written (`24h`).
        max: &'static str,
    },
    /// A `bucket` under 1 ms or longer than the scenario.
    #[error("must be at least 1ms and at most the duration")]
    Bucket,
    /// A `bucket` so narrow the run has more than a million.
    #[error("more than 1 000 000 buckets: make it wider")]
    TooManyBuckets,
    /// An open-loop fleet whose first tries alone pass [`MAX_ATTEMPTS`].
    #[error(
        "the fleet starts about {calls:.0} calls per policy (instances × rate × duration × \
         fan_out), more than the {max} attempts the simulator runs per policy: shorten \
         duration, or lower rate, instances or fan_out"
    )]
    TooMuchWork {
        /// The first tries one policy's run would start.
        calls: f64,
        /// [`MAX_ATTEMPTS`].
        max: u64,
    },
    /// Both `rate` and `concurrency`.
    #[error("give rate (open loop) or concurrency (closed loop), not both")]
    OpenAndClosed,
    /// Neither `rate` nor `concurrency`.
    #[error(
        "missing: give rate (actions per second per instance, open loop) or concurrency \
         (workers per instance, closed loop)"
    )]
    NoLoad,
    /// A `rate` of 0 or above 10 000 000 per second.
    #[error("must be above 0 and at most 10 000 000 per second, got {got}")]
    Rate {
        /// The rate given.
        got: f64,
    },
    /// `think` with an open loop.
    #[error("think time is for closed loop (concurrency)")]
    ThinkInOpenLoop,
    /// `arrivals` with a closed loop.
    #[error("arrivals are for open loop (rate)")]
    ArrivalsInClosedLoop,
    /// A trace that cannot be used as arrivals.
    #[error("{reason}")]
    Trace {
        /// Why: the file, and the line where it went wrong.
        reason: String,
    },
    /// A key the scenario needs.
    #[error("missing: {what}")]
    Missing {
        /// What it is, and an example.
        what: &'static str,
    },
    /// A phase with both `end` and `duration`.
    #[error("give end or duration, not both")]
    EndAndDuration,
    /// A phase that ends before it starts.
    #[error("must be after start ({})", format_duration(*start))]
    EndNotAfterStart {
        /// Its start.
        start: Duration,
    },
    /// A phase that starts after the scenario ends.
    #[error("is past the scenario's duration ({})", format_duration(*duration))]
    StartPastEnd {
        /// The scenario's duration.
        duration: Duration,
    },
    /// A phase that starts before the previous one ends.
    #[error(
        "overlaps phase `{previous}`, which ends at {}: phases are in time order and do not \
         overlap",
        format_duration(*ends)
    )]
    Overlap {
        /// The previous phase's name.
        previous: String,
        /// When it ends.
        ends: Duration,
    },
    /// `jitter` on a policy without a backoff.
    #[error("jitter needs a backoff (e.g. backoff = \"25ms..250ms\")")]
    JitterWithoutBackoff,
    /// `backoff` on a policy that never retries.
    #[error("a policy without retries has no backoff")]
    BackoffWithoutRetries,
    /// A backoff or breaker that core refuses.
    #[error("{0}")]
    Core(ConfigError),
    /// More than 32 policies.
    #[error("at most 32 policies")]
    TooManyPolicies,
    /// `queue`, `queue_timeout`, `retry_pool`, `adaptive` or rate admission on a policy without
    /// a cap.
    #[error("needs a cap")]
    NeedsCap,
    /// `scope_retries` on a policy without a budget.
    #[error("scopes are charged by RetryPolicy: give the policy a budget")]
    ScopeWithoutBudget,
    /// `caller_retries` on a policy without a budget.
    #[error("a caller's own retries are charged to a budget: give the policy a budget")]
    CallerRetriesWithoutBudget,
    /// A `hedge_after` that is neither a duration above 0 nor a percentile from p50 to p99.9.
    #[error(
        "must be a delay above 0 (\"100ms\") or a percentile of recent attempt latency from \
         p50 to p99.9 (\"p95\"), got `{got}`"
    )]
    HedgeAfter {
        /// The text given.
        got: String,
    },
    /// `max_hedges` or `hedge_floor` without `hedge_after`.
    #[error("needs hedge_after (when an unanswered attempt is hedged)")]
    NeedsHedgeAfter,
    /// `hedge_floor` with a fixed `hedge_after`.
    #[error("a floor is for a percentile hedge_after (\"p95\"), not a fixed delay")]
    FloorWithFixedHedge,
    /// `requests_remaining` without `requests_per_minute` on the dependency (or
    /// `tokens_remaining` without `tokens_per_minute`).
    #[error("needs {limit} (the provider's limit)")]
    NeedsProviderLimit {
        /// The key it needs.
        limit: &'static str,
    },
    /// A provider's `tokens_per_minute` when the calls cost no tokens.
    #[error("the calls cost no tokens: give [fleet] input_tokens or max_tokens")]
    NoTokenCost,
    /// An `output_fraction` outside `(0, 1]`.
    #[error("must be above 0 and at most 1, got {got}")]
    NotAnOutputFraction {
        /// The value given.
        got: f64,
    },
    /// Rate admission with `share = "fleet"`: the proxy meters one instance's requests.
    #[error(
        "rate admission meters each instance's own requests, as the proxy does: not with \
         share = \"fleet\""
    )]
    RateWithFleetShare,
    /// An empty policy name.
    #[error("must not be empty")]
    EmptyName,
    /// Two policies with one name.
    #[error("a policy named `{name}` is already listed: give this one a name")]
    DuplicateName {
        /// The name.
        name: String,
    },
}

#[cfg(test)]
mod tests {
    use super::*;
    use stormguard_core::defaults;

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
    fn errors_name_line_column_and_key() {
        let e = |extra: &str| parse(extra).unwrap_err().to_string();
        assert_eq!(
            e("[[policy]]\nretries = 11\n"),
            "t.toml:7:11: policy[0].retries: must be between 0 and 10, got 11"
        );
        assert_eq!(
            e("[[policy]]\nbudget = \"ratio:percent=2000\"\ncap = 20\n"),
            "t.toml:7:10: policy[0].budget: percent must be a fraction in [0, 1000], got 2000"
        );
        let bogus = e("[[policy]]\nbogus = 1\n");
        assert!(bogus.starts_with("t.toml:7:1: policy[0].bogus: unknown field `bogus`"), "{bogus}");
        let twice = parse("[[policy]]\n[[policy]]\n").unwrap_err();
        assert_eq!(
            twice.rule::<InvalidScenario>(),
            Some(&InvalidScenario::DuplicateName { name: "no-retries".into() })
        );
        assert!(twice.to_string().starts_with("t.toml:7:1: policy[1].retries: a policy named"));
        assert!(
            e("[[policy]]\ncap = 5\nretry_pool = 0\n")
                .contains("retry_pool: must be between 1 and 16777216, got 0")
        );
        assert!(
            e("[[phase]]\nstart = \"5s\"\nend = \"10s\"\n[[phase]]\nstart = \"8s\"\n[[policy]]\n")
                .starts_with("t.toml:10:9: phase[1].start: overlaps phase `phase 1`")
        );
        let window = e("[[policy]]\nbreaker = { window = \"0s\" }\n");
        assert!(
            window.starts_with("t.toml:7:22: policy[0].breaker.window: window must be between"),
            "{window}"
        );
        assert_eq!(
            e("[[policy]]\nbudget = \"ratio\"\nadaptive = { min = 4, max = 0 }\n"),
            "t.toml:8:29: policy[0].adaptive.max: must be between 1 and 16777216, got 0"
        );
        assert!(
            e("[[policy]]\nbudget = \"ratio\"\n[policy.adaptive]\nmin = 4\nmax = 40\nwindow = \"0s\"\n")
                .starts_with("t.toml:11:10: policy[0].adaptive.window: ")
        );
        // A syntax error in a value names the key it is the value of; one elsewhere, none.
        let syntax = Scenario::parse("t.toml", "a = \n").unwrap_err();
        assert_eq!(syntax.position().map(|(line, _)| line), Some(1));
        assert_eq!(syntax.key().unwrap().to_string(), "a");
        let syntax = Scenario::parse("t.toml", "[[policy\n").unwrap_err();
        assert!(syntax.key().unwrap().is_root());
        let missing = Scenario::parse("t.toml", "[[policy]]\n").unwrap_err();
        assert!(missing.to_string().starts_with("t.toml:1:1: fleet.rate: missing"), "{missing}");
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
             [[policy]]\nbudget = \"ratio\"\ncap = 20\nretry_pool = 4\n[[policy]]\nretries = 1\ncap = 20\n\
             [[policy]]\nbudget = \"ratio\"\nlearn_rate_limits = true\n",
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
                "retry-once+cap20",
                "ratio-budget+rate"
            ]
        );
    }
}
