//! A scenario's rules: from the file's shapes to the model, each broken rule an
//! [`InvalidScenario`] at the key path it is about (the reader finds the key in the file, or,
//! for one the file leaves out, the table that lacks it).

use std::time::Duration;

use stormguard_config::de::ScalarOrTable;
use stormguard_config::{Invalid, KeyPath};
use stormguard_core::adaptive::AdaptiveConfig;
use stormguard_core::backoff::BackoffConfig;
use stormguard_core::breaker::BreakerConfig;
use stormguard_core::decimal::Fraction;
use stormguard_core::decision::{MAX_RETRIES_LIMIT, RetryConfig};
use stormguard_core::defaults;
use stormguard_core::limiter::{LimiterConfig, MAX_CAP};

use super::file::{
    AdaptiveFile, BreakerFile, ClientFile, ConditionsFile, DependencyFile, FleetFile, PhaseFile,
    PolicyFile, Queue, ScenarioFile,
};
use super::{
    Arrivals, CapConfig, ClientConfig, Conditions, Fleet, HedgeAfter, HedgeConfig, HeldSlotRelease,
    InvalidScenario, Load, MAX_ATTEMPTS, Phase, PolicyConfig, ProviderLimit, ProviderRate,
    RateAdmissionConfig, RetryRule, Scenario, Share, SimDependency,
};

/// The most requests or tokens per minute a limit may state (the proxy's bound).
const MAX_PER_MINUTE: u64 = 1_000_000_000_000;

/// A percentile `hedge_after`'s least delay when `hedge_floor` is left out.
const DEFAULT_HEDGE_FLOOR: Duration = Duration::from_millis(10);

/// The most tokens one call may send or ask for: well past any model's context window.
const MAX_CALL_TOKENS: u64 = 100_000_000;

type Rule<T> = Result<T, Invalid<InvalidScenario>>;

/// A table being checked: where it is, for the keys of its rules.
struct Table(KeyPath);

impl Table {
    fn root() -> Table {
        Table(KeyPath::root())
    }

    fn sub(&self, key: &str) -> Table {
        Table(self.key(key))
    }

    fn item(&self, key: &str, index: usize) -> Table {
        Table(self.key(key).index(index))
    }

    fn key(&self, key: &str) -> KeyPath {
        self.0.clone().key(key)
    }

    fn fail(&self, key: &str, error: InvalidScenario) -> Invalid<InvalidScenario> {
        Invalid::new(self.key(key), error)
    }

    /// A whole number in `[min, max]`.
    fn range(&self, key: &str, v: Option<u64>, min: u64, max: u64) -> Rule<Option<u64>> {
        match v {
            Some(got) if !(min..=max).contains(&got) => Err(self.fail(
                key,
                if (min, max) == (1, u64::MAX) {
                    InvalidScenario::Zero
                } else {
                    InvalidScenario::OutOfRange { min, max, got }
                },
            )),
            v => Ok(v),
        }
    }

    /// A whole number in `[min, max]`, `max` at most `u32::MAX`.
    fn range32(&self, key: &str, v: Option<u64>, min: u32, max: u32) -> Rule<Option<u32>> {
        let n = self.range(key, v, u64::from(min), u64::from(max))?;
        Ok(n.map(|n| u32::try_from(n).unwrap_or(max)))
    }

    fn finite(&self, key: &str, v: Option<f64>) -> Rule<Option<f64>> {
        match v {
            Some(v) if !v.is_finite() => Err(self.fail(key, InvalidScenario::NotFinite)),
            v => Ok(v),
        }
    }

    /// A provider's limit (`(key, value)` of the per-minute limit and of what is left of it):
    /// the limit in `[1, 10^12]`, what is left in `[0, limit]` (default all of it), and no
    /// remaining without a limit.
    fn provider_limit(
        &self,
        (limit_key, limit): (&'static str, Option<u64>),
        (remaining_key, remaining): (&str, Option<u64>),
    ) -> Rule<Option<ProviderLimit>> {
        match (self.range(limit_key, limit, 1, MAX_PER_MINUTE)?, remaining) {
            (None, None) => Ok(None),
            (None, Some(_)) => {
                Err(self
                    .fail(remaining_key, InvalidScenario::NeedsProviderLimit { limit: limit_key }))
            }
            (Some(per_minute), remaining) => Ok(Some(ProviderLimit {
                per_minute,
                remaining: self
                    .range(remaining_key, remaining, 0, per_minute)?
                    .unwrap_or(per_minute),
            })),
        }
    }

    fn fraction(&self, key: &str, v: Option<f64>) -> Rule<Option<f64>> {
        match self.finite(key, v)? {
            Some(got) if !(0.0..=1.0).contains(&got) => {
                Err(self.fail(key, InvalidScenario::NotAFraction { got }))
            }
            v => Ok(v),
        }
    }
}

impl ScenarioFile {
    pub(super) fn into_scenario(
        self,
        default_name: String,
        base: Option<&std::path::Path>,
    ) -> Rule<Scenario> {
        let root = Table::root();
        let duration = self.duration.unwrap_or(Duration::from_secs(60));
        if duration.is_zero() || duration > Duration::from_secs(86_400) {
            return Err(root.fail("duration", InvalidScenario::DurationOutOfRange { max: "24h" }));
        }
        let bucket = self.bucket.unwrap_or(Duration::from_secs(1));
        if bucket < Duration::from_millis(1) || bucket > duration {
            return Err(root.fail("bucket", InvalidScenario::Bucket));
        }
        if duration.as_nanos() / bucket.as_nanos() > 1_000_000 {
            return Err(root.fail("bucket", InvalidScenario::TooManyBuckets));
        }
        let recovered_at = root.fraction("recovered_at", self.recovered_at)?.unwrap_or(0.95);
        let fleet_table = root.sub("fleet");
        let fleet = self.fleet.check(&fleet_table, base, duration)?;
        let client = self.client.check(&root.sub("client"))?;
        let call_tokens = fleet.input_tokens.saturating_add(fleet.max_tokens);
        let dependency = self.dependency.check(&root.sub("dependency"), call_tokens)?;
        let phases = phases(self.phase, &dependency.base, duration)?;
        let policies = policies(self.policy)?;
        if let Some(calls) = fleet.expected_calls(duration)
            && calls > MAX_ATTEMPTS as f64
        {
            let key = if self.fleet.rate.is_some() { "rate" } else { "instances" };
            let error = InvalidScenario::TooMuchWork { calls, max: MAX_ATTEMPTS };
            return Err(fleet_table.fail(key, error));
        }
        Ok(Scenario {
            name: self.name.unwrap_or(default_name),
            description: self.description.unwrap_or_default(),
            seed: self.seed.unwrap_or(1),
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
}

impl FleetFile {
    fn check(&self, t: &Table, base: Option<&std::path::Path>, duration: Duration) -> Rule<Fleet> {
        let instances = t.range32("instances", self.instances, 1, 10_000)?.unwrap_or(1);
        let fan_out = t.range32("fan_out", self.fan_out, 1, 100)?.unwrap_or(1);
        let mut recorded = None;
        let rate = match &self.trace {
            Some(path) => {
                for (key, given) in [
                    ("rate", self.rate.is_some()),
                    ("concurrency", self.concurrency.is_some()),
                    ("arrivals", self.arrivals.is_some()),
                ] {
                    if given {
                        let reason = format!("give either trace or {key}, not both");
                        return Err(t.fail(key, InvalidScenario::Trace { reason }));
                    }
                }
                if instances != 1 {
                    let reason = "a trace is the whole fleet's arrivals: leave instances at 1";
                    return Err(
                        t.fail("instances", InvalidScenario::Trace { reason: reason.into() })
                    );
                }
                let at = base.map_or_else(|| std::path::PathBuf::from(path), |b| b.join(path));
                let times =
                    crate::trace::first_tries(&at, self.trace_dependency.as_deref(), duration)
                        .map_err(|reason| t.fail("trace", InvalidScenario::Trace { reason }))?;
                // At least one first try (an empty trace is refused): the rate is above zero.
                let rate = times.len() as f64 / duration.as_secs_f64();
                recorded = Some(times.into());
                Some(rate)
            }
            None => {
                if self.trace_dependency.is_some() {
                    let reason = "trace_dependency needs trace".to_string();
                    return Err(t.fail("trace_dependency", InvalidScenario::Trace { reason }));
                }
                t.finite("rate", self.rate)?
            }
        };
        let concurrency = t.range32("concurrency", self.concurrency, 1, 100_000)?;
        let load = match (rate, concurrency) {
            (Some(_), Some(_)) => {
                return Err(t.fail("concurrency", InvalidScenario::OpenAndClosed));
            }
            (None, None) => return Err(t.fail("rate", InvalidScenario::NoLoad)),
            (Some(rate), None) if recorded.is_some() => {
                Load::Open { rate, arrivals: Arrivals::Recorded }
            }
            (Some(rate), None) => {
                if rate <= 0.0 || rate > 10_000_000.0 {
                    return Err(t.fail("rate", InvalidScenario::Rate { got: rate }));
                }
                if self.think.is_some() {
                    return Err(t.fail("think", InvalidScenario::ThinkInOpenLoop));
                }
                Load::Open { rate, arrivals: self.arrivals.unwrap_or(Arrivals::Poisson) }
            }
            (None, Some(concurrency)) => {
                if self.arrivals.is_some() {
                    return Err(t.fail("arrivals", InvalidScenario::ArrivalsInClosedLoop));
                }
                Load::Closed { concurrency, think: self.think.unwrap_or(Duration::ZERO) }
            }
        };
        let input_tokens = t.range("input_tokens", self.input_tokens, 0, MAX_CALL_TOKENS)?;
        let max_tokens = t.range("max_tokens", self.max_tokens, 0, MAX_CALL_TOKENS)?;
        Ok(Fleet {
            instances,
            load,
            recorded,
            fan_out,
            input_tokens: input_tokens.unwrap_or(0),
            max_tokens: max_tokens.unwrap_or(0),
        })
    }
}

impl ClientFile {
    fn check(self, t: &Table) -> Rule<ClientConfig> {
        if self.per_try_timeout.is_some_and(|d| d.is_zero()) {
            return Err(t.fail("per_try_timeout", InvalidScenario::ZeroDuration));
        }
        let deadline = self.deadline.unwrap_or(Duration::from_secs(10));
        if deadline.is_zero() || deadline > Duration::from_secs(3_600) {
            return Err(t.fail("deadline", InvalidScenario::DurationOutOfRange { max: "1h" }));
        }
        let timeout_slot_hold = self.timeout_slot_hold.unwrap_or(defaults::TIMEOUT_SLOT_HOLD);
        if timeout_slot_hold.is_zero() {
            return Err(t.fail("timeout_slot_hold", InvalidScenario::ZeroDuration));
        }
        Ok(ClientConfig {
            per_try_timeout: self.per_try_timeout,
            deadline,
            timeout_slot_hold,
            retry_on: self.retry_on.unwrap_or_default(),
            fast_within: self.fast_within,
            held_slot: self.held_slot.unwrap_or(HeldSlotRelease::OnAnswer),
            non_idempotent: t.fraction("non_idempotent", self.non_idempotent)?.unwrap_or(0.0),
            own_retries: t.range32("own_retries", self.own_retries, 0, 10)?.unwrap_or(0),
            own_backoff: self.own_backoff.unwrap_or(Duration::ZERO),
        })
    }
}

impl ConditionsFile {
    /// The conditions these keys give: over `base` (a phase), or on their own (the
    /// dependency's baseline, where `capacity` and `service_time` are needed).
    fn check(self, t: &Table, base: Option<&Conditions>) -> Rule<Conditions> {
        let capacity = t.range32("capacity", self.capacity, 1, 1_000_000)?;
        let workers = t.range32("workers", self.workers, 1, 1_000_000)?;
        let error_rate = t.fraction("error_rate", self.error_rate)?;
        match base {
            Some(b) => Ok(Conditions {
                capacity: capacity.unwrap_or(b.capacity),
                workers: workers.or(b.workers),
                error_rate: error_rate.unwrap_or(b.error_rate),
                service_time: self.service_time.unwrap_or(b.service_time),
                error_time: self.error_time.or(b.error_time),
            }),
            None => {
                let missing = |key, what| t.fail(key, InvalidScenario::Missing { what });
                Ok(Conditions {
                    capacity: match (capacity, workers) {
                        (Some(c), _) => c,
                        (None, Some(_)) => 1_000_000,
                        (None, None) => Err(missing(
                            "capacity",
                            "how many attempts the dependency serves in parallel (or workers)",
                        ))?,
                    },
                    workers,
                    error_rate: error_rate.unwrap_or(0.0),
                    service_time: self
                        .service_time
                        .ok_or_else(|| missing("service_time", "e.g. \"exponential 50ms\""))?,
                    error_time: self.error_time,
                })
            }
        }
    }
}

impl DependencyFile {
    /// `call_tokens`: what one call asks for (`input_tokens + max_tokens`), which a token
    /// limit needs to be more than zero.
    fn check(&self, t: &Table, call_tokens: u64) -> Rule<SimDependency> {
        let queue = match self.queue {
            None | Some(Queue::Unbounded) => None,
            Some(Queue::Bounded(n)) => t.range32("queue", Some(n), 0, 10_000_000)?,
        };
        let base = self.conditions().check(t, None)?;
        let requests = t.provider_limit(
            ("requests_per_minute", self.requests_per_minute),
            ("requests_remaining", self.requests_remaining),
        )?;
        let tokens = t.provider_limit(
            ("tokens_per_minute", self.tokens_per_minute),
            ("tokens_remaining", self.tokens_remaining),
        )?;
        if tokens.is_some() && call_tokens == 0 {
            return Err(t.fail("tokens_per_minute", InvalidScenario::NoTokenCost));
        }
        let rate =
            (requests.is_some() || tokens.is_some()).then_some(ProviderRate { requests, tokens });
        let output_fraction = match t.finite("output_fraction", self.output_fraction)? {
            Some(got) if !(got > 0.0 && got <= 1.0) => {
                return Err(t.fail("output_fraction", InvalidScenario::NotAnOutputFraction { got }));
            }
            v => v.unwrap_or(1.0),
        };
        Ok(SimDependency {
            queue,
            base,
            rate,
            output_fraction,
            overhead: std::time::Duration::ZERO,
        })
    }
}

fn phases(files: Vec<PhaseFile>, base: &Conditions, duration: Duration) -> Rule<Vec<Phase>> {
    let mut phases: Vec<Phase> = Vec::with_capacity(files.len());
    for (i, f) in files.into_iter().enumerate() {
        let t = Table::root().item("phase", i);
        let start = f.start.ok_or_else(|| {
            t.fail("start", InvalidScenario::Missing { what: "when the phase starts" })
        })?;
        let end = match (f.end, f.duration) {
            (Some(_), Some(_)) => return Err(t.fail("duration", InvalidScenario::EndAndDuration)),
            (Some(e), None) => e,
            (None, Some(d)) => start + d,
            (None, None) => duration,
        };
        if end <= start {
            return Err(t.fail("end", InvalidScenario::EndNotAfterStart { start }));
        }
        if start >= duration {
            return Err(t.fail("start", InvalidScenario::StartPastEnd { duration }));
        }
        if let Some(prev) = phases.last()
            && start < prev.end
        {
            let error = InvalidScenario::Overlap { previous: prev.name.clone(), ends: prev.end };
            return Err(t.fail("start", error));
        }
        // Named from 1, as people count phases; the key path counts from 0.
        let name = f.name.clone().unwrap_or_else(|| format!("phase {}", phases.len() + 1));
        phases.push(Phase {
            name,
            start,
            end: end.min(duration),
            conditions: f.conditions().check(&t, Some(base))?,
            trigger: f.trigger.unwrap_or(false),
        });
    }
    Ok(phases)
}

/// A policy's backoff: `None` retries at once. `default` is what an absent `backoff` means:
/// none for a naive policy, the proxy's for a budget policy (and then `jitter` alone applies to
/// it).
fn backoff(
    p: &PolicyFile,
    t: &Table,
    default: Option<BackoffConfig>,
) -> Rule<Option<BackoffConfig>> {
    let with_jitter = |mut b: BackoffConfig| {
        if let Some(j) = p.jitter {
            b.jitter = j;
        }
        b
    };
    match (p.backoff.as_deref(), default) {
        (None, Some(default)) => Ok(Some(with_jitter(default))),
        (None | Some("none"), _) => {
            if p.jitter.is_some() && p.backoff.is_none() {
                return Err(t.fail("jitter", InvalidScenario::JitterWithoutBackoff));
            }
            Ok(None)
        }
        (Some(range), _) => BackoffConfig::parse_range(range)
            .map(|b| Some(with_jitter(b)))
            .map_err(|e| t.fail("backoff", InvalidScenario::Core(e))),
    }
}

impl AdaptiveFile {
    /// The proxy's `adaptive` table: `min` and `max` required, the rest core's defaults; core's
    /// rules (`1 <= min <= max <= MAX_CAP`, a window above 0, a tolerance in 100..=400 %)
    /// refuse at the key they are about.
    fn check(&self, t: &Table) -> Rule<AdaptiveConfig> {
        let missing = |key, what| t.fail(key, InvalidScenario::Missing { what });
        let min = t
            .range("min", self.min, 1, MAX_CAP)?
            .ok_or_else(|| missing("min", "the least working cap (e.g. min = 4)"))?;
        let max = t
            .range("max", self.max, 1, MAX_CAP)?
            .ok_or_else(|| missing("max", "the ceiling of the working cap (e.g. max = 40)"))?;
        let mut c = AdaptiveConfig::new(min, max);
        if let Some(a) = self.algorithm {
            c.algorithm = a;
        }
        if let Some(w) = self.window {
            c.window = w;
        }
        if let Some(p) = t.range32("tolerance", self.tolerance, 100, 400)? {
            c.tolerance = p;
        }
        c.validate(MAX_CAP).map_err(|e| {
            // Core names them `adaptive.min`, `adaptive.window`: the key inside this table.
            let key = e.key().rsplit('.').next().unwrap_or("min");
            t.fail(key, InvalidScenario::Core(e))
        })?;
        Ok(c)
    }
}

impl BreakerFile {
    fn check(&self, t: &Table) -> Rule<BreakerConfig> {
        let mut c = BreakerConfig::default();
        if let Some(r) = t.fraction("failure_ratio", self.failure_ratio)? {
            c.failure_ratio = Fraction::from_millionths((r * 1e6).round() as u64);
        }
        if let Some(n) = t.range("min_requests", self.min_requests, 1, u64::MAX)? {
            c.min_requests = n;
        }
        if let Some(w) = self.window {
            c.window = w;
        }
        if let Some(n) = self.consecutive_failures {
            c.consecutive_failures = (n > 0).then_some(n);
        }
        if let Some(d) = self.break_duration {
            c.break_duration = d;
        }
        if let Some(n) = t.range("half_open_probes", self.half_open_probes, 1, 1_000)? {
            c.half_open_probes = n;
        }
        c.validate().map_err(|e| t.fail(e.key(), InvalidScenario::Core(e)))?;
        Ok(c)
    }
}

fn policies(files: Vec<PolicyFile>) -> Rule<Vec<PolicyConfig>> {
    let root = Table::root();
    if files.is_empty() {
        let what = "no [[policy]] to simulate";
        return Err(root.fail("policy", InvalidScenario::Missing { what }));
    }
    if files.len() > 32 {
        return Err(root.fail("policy", InvalidScenario::TooManyPolicies));
    }
    let mut out: Vec<PolicyConfig> = Vec::with_capacity(files.len());
    for (i, f) in files.iter().enumerate() {
        let t = root.item("policy", i);
        let p = policy(f, &t)?;
        if out.iter().any(|q| q.name == p.name) {
            let key = if f.name.is_some() { "name" } else { "retries" };
            return Err(t.fail(key, InvalidScenario::DuplicateName { name: p.name }));
        }
        out.push(p);
    }
    Ok(out)
}

/// A policy's hedging: `hedge_after` (a delay or a percentile, with `hedge_floor`) and
/// `max_hedges` (0..=3, default 1; 0 turns it off).
fn hedge(f: &PolicyFile, t: &Table) -> Rule<Option<HedgeConfig>> {
    let max_hedges = t.range32("max_hedges", f.max_hedges, 0, 3)?;
    let Some(text) = &f.hedge_after else {
        let key = if f.max_hedges.is_some() { "max_hedges" } else { "hedge_floor" };
        if f.max_hedges.is_some() || f.hedge_floor.is_some() {
            return Err(t.fail(key, InvalidScenario::NeedsHedgeAfter));
        }
        return Ok(None);
    };
    if f.hedge_floor.is_some_and(|d| d.is_zero()) {
        return Err(t.fail("hedge_floor", InvalidScenario::ZeroDuration));
    }
    let floor = f.hedge_floor.unwrap_or(DEFAULT_HEDGE_FLOOR);
    let after = HedgeAfter::parse(text, floor)
        .ok_or_else(|| t.fail("hedge_after", InvalidScenario::HedgeAfter { got: text.clone() }))?;
    if matches!(after, HedgeAfter::Fixed(_)) && f.hedge_floor.is_some() {
        return Err(t.fail("hedge_floor", InvalidScenario::FloorWithFixedHedge));
    }
    Ok(match max_hedges.unwrap_or(1) {
        0 => None,
        max_hedges => Some(HedgeConfig { after, max_hedges }),
    })
}

fn policy(f: &PolicyFile, t: &Table) -> Rule<PolicyConfig> {
    let retries = t.range32("retries", f.retries, 0, MAX_RETRIES_LIMIT)?;
    let retry = match &f.budget {
        Some(spec) => {
            let stormguard = RetryConfig::default();
            RetryRule::Budget {
                spec: *spec,
                max_retries: retries.unwrap_or(stormguard.max_retries),
                backoff: backoff(f, t, Some(stormguard.backoff))?,
            }
        }
        None => match retries.unwrap_or(0) {
            0 => {
                backoff(f, t, None)?;
                if f.backoff.is_some() {
                    return Err(t.fail("backoff", InvalidScenario::BackoffWithoutRetries));
                }
                RetryRule::None
            }
            n => RetryRule::Naive { max_retries: n, backoff: backoff(f, t, None)? },
        },
    };
    let budgeted = matches!(retry, RetryRule::Budget { .. });
    // A budget runs under stormguard's cap: without `cap`, the proxy's.
    let cap = match t.range("cap", f.cap, 1, MAX_CAP)?.or(budgeted.then_some(defaults::CAP)) {
        None => {
            let given = [
                ("queue", f.queue.is_some()),
                ("queue_timeout", f.queue_timeout.is_some()),
                ("retry_pool", f.retry_pool.is_some()),
                ("adaptive", f.adaptive.is_some()),
            ];
            if let Some((key, _)) = given.iter().find(|(_, set)| *set) {
                return Err(t.fail(key, InvalidScenario::NeedsCap));
            }
            None
        }
        Some(cap) => {
            let stormguard = LimiterConfig::default();
            Some(CapConfig {
                cap,
                queue_len: t.range("queue", f.queue, 0, MAX_CAP)?.unwrap_or(stormguard.queue_len),
                queue_timeout: f.queue_timeout.unwrap_or(stormguard.queue_timeout),
                retry_pool: t.range("retry_pool", f.retry_pool, 1, MAX_CAP)?,
                adaptive: f.adaptive.as_ref().map(|a| a.check(&t.sub("adaptive"))).transpose()?,
            })
        }
    };
    let scope_retries = t.range("scope_retries", f.scope_retries, 0, 1_000)?;
    if scope_retries.is_some() && !budgeted {
        return Err(t.fail("scope_retries", InvalidScenario::ScopeWithoutBudget));
    }
    // Rate admission is part of stormguard's cap, as in the tower layer and the proxy.
    let rpm = t.range("requests_per_minute", f.requests_per_minute, 1, MAX_PER_MINUTE)?;
    let tpm = t.range("tokens_per_minute", f.tokens_per_minute, 1, MAX_PER_MINUTE)?;
    let rate = (rpm.is_some() || tpm.is_some() || f.learn_rate_limits == Some(true))
        .then_some(RateAdmissionConfig { requests_per_minute: rpm, tokens_per_minute: tpm });
    if rate.is_some() {
        let key = match (rpm, tpm) {
            (Some(_), _) => "requests_per_minute",
            (None, Some(_)) => "tokens_per_minute",
            (None, None) => "learn_rate_limits",
        };
        if cap.is_none() {
            return Err(t.fail(key, InvalidScenario::NeedsCap));
        }
        if f.share == Some(Share::Fleet) {
            return Err(t.fail("share", InvalidScenario::RateWithFleetShare));
        }
    }
    let breaker = match &f.breaker {
        None | Some(ScalarOrTable::Scalar(false)) => None,
        Some(ScalarOrTable::Scalar(true)) => Some(BreakerConfig::default()),
        Some(ScalarOrTable::Table(b)) => Some(b.check(&t.sub("breaker"))?),
    };
    let mut p = PolicyConfig {
        name: String::new(),
        retry,
        cap,
        breaker,
        share: f.share.unwrap_or(Share::Instance),
        scope_retries,
        rate,
        hedge: hedge(f, t)?,
        caller_retries: f.caller_retries != Some(super::file::CallerRetriesFile::Off),
    };
    if f.caller_retries.is_some() && !budgeted {
        return Err(t.fail("caller_retries", InvalidScenario::CallerRetriesWithoutBudget));
    }
    // A percentile is read from the cap's histogram of attempt times, as in the layer.
    if p.cap.is_none() && p.hedge.is_some_and(|h| matches!(h.after, HedgeAfter::Percentile { .. }))
    {
        return Err(t.fail("hedge_after", InvalidScenario::NeedsCap));
    }
    p.name = match &f.name {
        Some(n) if n.trim().is_empty() => return Err(t.fail("name", InvalidScenario::EmptyName)),
        Some(n) => n.clone(),
        None => p.default_name(),
    };
    Ok(p)
}
