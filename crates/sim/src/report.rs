//! What a run reports: a side-by-side summary per policy, the same per timeline phase, and a
//! time series per policy (for the HTML report's charts and `--series`).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io::{self, Write};

use serde::Serialize;
use stormguard_core::denied::Denied;
use stormguard_core::format;

use crate::engine::{self, Footprint};
use crate::scenario::{Load, PolicyConfig, ProviderLimit, Scenario, Share};
use crate::stats::RunStats;

/// The results of one scenario: every policy, side by side.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// The scenario's name.
    pub scenario: String,
    /// The seed every draw derived from.
    pub seed: u64,
    /// What the scenario shows.
    pub description: String,
    /// How long arrivals ran, in seconds.
    pub duration_s: f64,
    /// The width of one time-series bucket, in seconds.
    pub bucket_s: f64,
    /// When the last trigger phase ended, if the scenario has one.
    pub trigger_end_s: Option<f64>,
    /// One line on the fleet and the dependency.
    pub setup: String,
    /// The timeline's segments (phases and the baseline between them).
    pub phases: Vec<PhaseInfo>,
    /// One entry per policy, in the scenario's order.
    pub policies: Vec<PolicyReport>,
}

/// A segment of the timeline.
#[derive(Debug, Clone, Serialize)]
pub struct PhaseInfo {
    /// Its name.
    pub name: String,
    /// Start, in seconds.
    pub start_s: f64,
    /// End, in seconds.
    pub end_s: f64,
    /// Whether it is a trigger.
    pub trigger: bool,
    /// Its conditions, in words.
    pub conditions: String,
}

/// Attempts in flight at the dependency (being served or queued there), weighted by time.
#[derive(Debug, Clone, Copy, Serialize, PartialEq)]
pub struct InFlight {
    /// The time-weighted mean.
    pub mean: f64,
    /// The median over time.
    pub p50: u64,
    /// The 99th percentile over time.
    pub p99: u64,
    /// The most at any instant.
    pub max: u64,
    /// The policy's cap over the fleet (per-instance caps added up, a separate retry pool
    /// included; an adaptive cap's ceiling), or `None` without one.
    pub cap: Option<u64>,
}

/// An adaptive cap's working cap over the run, summed over the policy's limiters (one per
/// instance, or one for the fleet), weighted by time.
#[derive(Debug, Clone, Copy, Serialize, PartialEq)]
pub struct WorkingCap {
    /// Where it started (the planned cap, clamped into the range).
    pub initial: u64,
    /// The time-weighted mean.
    pub mean: f64,
    /// The least it was.
    pub min: u64,
    /// The most it was.
    pub max: u64,
    /// Where it was at the end of arrivals.
    #[serde(rename = "final")]
    pub last: u64,
}

/// The dependency's requests and tokens per minute, as one policy met them.
#[derive(Debug, Clone, Copy, Serialize, PartialEq)]
pub struct RateLimitReport {
    /// The provider's limit, requests per minute (`None`: it limits tokens only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub limit_per_min: Option<u64>,
    /// Attempts it counted (and served, whatever their outcome).
    pub accepted: u64,
    /// Attempts it answered 429 because its requests or tokens per minute were used up.
    pub limited: u64,
    /// `limited` over every attempt that reached it.
    pub limited_share: f64,
    /// Attempts counted before the end of arrivals, per minute of the run.
    pub accepted_per_min: f64,
    /// The provider's limit, tokens per minute (`None`: it limits requests only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tokens_limit_per_min: Option<u64>,
    /// The tokens it counted (input, and output when served without error) for the attempts
    /// it accepted before the end of arrivals, per minute of the run (when it limits tokens).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tokens_per_min: Option<f64>,
}

impl RateLimitReport {
    /// The provider's limits in words: `limit of 600 requests/min`, `limits of 600 requests/min
    /// and 450000 tokens/min`.
    pub fn describe(&self) -> String {
        match (self.limit_per_min, self.tokens_limit_per_min) {
            (Some(r), None) => format!("limit of {r} requests/min"),
            (None, Some(t)) => format!("limit of {t} tokens/min"),
            (Some(r), Some(t)) => format!("limits of {r} requests/min and {t} tokens/min"),
            (None, None) => "limits".to_string(),
        }
    }
}

/// User-visible latency of actions (successful or not), in milliseconds.
#[derive(Debug, Clone, Copy, Serialize, PartialEq)]
pub struct Latency {
    /// The median.
    pub p50: f64,
    /// The 99th percentile.
    pub p99: f64,
}

/// One policy over the whole run.
#[derive(Debug, Clone, Serialize)]
pub struct PolicyReport {
    /// The policy's name (`retry-once`, `ratio-budget`, ...).
    pub name: String,
    /// What it does, in words.
    pub description: String,
    /// User actions started.
    pub actions: u64,
    /// Requests (calls to the dependency) started: actions × fan-out.
    pub requests: u64,
    /// First attempts sent to the dependency.
    pub primaries: u64,
    /// Retries sent to the dependency.
    pub retries_issued: u64,
    /// Hedges sent to the dependency (second attempts beside one still unanswered).
    pub hedges_issued: u64,
    /// Hedges whose answer was the one the caller got.
    pub hedges_won: u64,
    /// Requests the callers sent again on their own after a failure (`client.own_retries`):
    /// retries to a policy that sees them (`caller_retries = "enforce"`), first tries (counted
    /// in `primaries`) to any other. Attempts among them are in `amplification`.
    pub caller_retries: u64,
    /// Hedges refused, all reasons.
    pub hedges_denied: u64,
    /// Hedges refused, by the retry reasons (`budget`, `cap`, `breaker`, `non-idempotent`, ...).
    pub hedges_denied_by: BTreeMap<&'static str, u64>,
    /// Attempts sent to the dependency per second (its offered load), over the run.
    pub offered_per_s: f64,
    /// Attempts sent per request started: 1 means no extra load from retries or hedges.
    pub amplification: f64,
    /// Attempts in flight at the dependency.
    pub in_flight: InFlight,
    /// An adaptive cap's working cap (only for a policy with `adaptive`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub working_cap: Option<WorkingCap>,
    /// The fraction of user actions that succeeded (every call, within the deadline).
    pub goodput: f64,
    /// Successful user actions per second.
    pub goodput_per_s: f64,
    /// The fraction of user actions that failed.
    pub error_rate: f64,
    /// Retries refused, all reasons.
    pub retries_denied: u64,
    /// Retries refused, by reason (`budget`, `cap`, `attempts`, `deadline`, `breaker`, ...).
    pub retries_denied_by: BTreeMap<&'static str, u64>,
    /// First attempts refused before reaching the dependency, all reasons.
    pub primaries_denied: u64,
    /// First attempts refused, by reason (`queue`, `breaker`).
    pub primaries_denied_by: BTreeMap<&'static str, u64>,
    /// Attempts that hit the per-try timeout (the dependency kept working on them).
    pub timeouts: u64,
    /// Attempts the dependency refused at once because its queue was full.
    pub rejected: u64,
    /// The dependency's requests and tokens per minute: what it counted and what it answered
    /// 429 (only when it has `requests_per_minute` or `tokens_per_minute`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rate_limit: Option<RateLimitReport>,
    /// User-visible latency of actions.
    pub latency_ms: Latency,
    /// Seconds from the end of the trigger until every later bucket's goodput is at least
    /// `recovered_at`, judged up to the next phase (or the end of the run); `None` when there
    /// is no trigger or it never recovers.
    pub recovery_s: Option<f64>,
    /// The fraction of actions that succeeded within `client.fast_within`, when set.
    pub fast_actions: Option<f64>,
    /// The same figures per segment of the timeline.
    pub phases: Vec<PhaseReport>,
    /// Per-bucket time series (in JSON only with `--series`).
    #[serde(skip)]
    pub series: Series,
    /// The ratio budget's percent, for the retry-fraction chart.
    #[serde(skip)]
    pub budget_percent: Option<f64>,
    /// The largest in-flight state the run held (memory follows this, not run length).
    #[serde(skip)]
    pub footprint: Footprint,
}

/// One policy in one segment of the timeline.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct PhaseReport {
    /// The segment's name.
    pub name: String,
    /// Attempts sent to the dependency per second.
    pub offered_per_s: f64,
    /// Retries per first attempt sent.
    pub retry_fraction: f64,
    /// Hedges per first attempt sent.
    pub hedge_fraction: f64,
    /// Latency of the actions that started in the segment (when the timeline has more than
    /// one).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub latency_ms: Option<Latency>,
    /// Latency of the actions that started in the segment and succeeded (when the timeline
    /// has more than one segment, and some did).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub latency_ok_ms: Option<Latency>,
    /// The time-weighted mean of attempts in flight at the dependency.
    pub in_flight_mean: f64,
    /// The 99th percentile over the segment's time.
    pub in_flight_p99: u64,
    /// The most at any instant.
    pub in_flight_max: u64,
    /// The time-weighted mean of an adaptive cap's working cap (only with `adaptive`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub working_cap_mean: Option<f64>,
    /// The fraction of actions started in the segment that succeeded.
    pub goodput: f64,
    /// The fraction that failed.
    pub error_rate: f64,
    /// The fraction that succeeded within `fast_within`, when set.
    pub fast_actions: Option<f64>,
}

/// Per-bucket time series, one value per bucket.
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct Series {
    /// Each bucket's start, in seconds.
    pub t_s: Vec<f64>,
    /// Attempts sent per second.
    pub offered_per_s: Vec<f64>,
    /// Retries sent per second.
    pub retries_per_s: Vec<f64>,
    /// Time-weighted mean attempts in flight at the dependency.
    pub in_flight_mean: Vec<f64>,
    /// The most in flight at any instant in the bucket.
    pub in_flight_max: Vec<u64>,
    /// Retries per first attempt sent.
    pub retry_fraction: Vec<f64>,
    /// The fraction of actions started in the bucket that succeeded (`None`: none started).
    pub goodput: Vec<Option<f64>>,
    /// The fraction that failed.
    pub error_rate: Vec<Option<f64>>,
    /// Successful actions per second (by the bucket they started in).
    pub goodput_per_s: Vec<f64>,
    /// Failed actions per second (by the bucket they started in).
    pub errors_per_s: Vec<f64>,
    /// An adaptive cap's time-weighted mean working cap (empty without one).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub working_cap: Vec<f64>,
}

/// Rounds to 4 decimals, so reports read well (and stay byte-identical run to run).
fn r4(x: f64) -> f64 {
    if x.is_finite() { (x * 1e4).round() / 1e4 } else { 0.0 }
}

fn ratio(a: u64, b: u64) -> f64 {
    if b == 0 { 0.0 } else { a as f64 / b as f64 }
}

fn by_reason(counts: &[u64; Denied::ALL.len()]) -> BTreeMap<&'static str, u64> {
    Denied::ALL
        .iter()
        .filter(|d| counts[d.index()] > 0)
        .map(|d| (d.as_str(), counts[d.index()]))
        .collect()
}

/// A latency histogram's p50 and p99, in milliseconds.
fn latency(h: &stormguard_core::histogram::LogHistogram) -> Latency {
    let ms = |q: f64| r4(h.quantile(q).unwrap_or(0) as f64 / 1e6);
    Latency { p50: ms(0.5), p99: ms(0.99) }
}

/// The smallest count at which the time spent at or below it reaches `q` of the total.
fn time_quantile(time_at: &[u64], q: f64) -> u64 {
    let total: u128 = time_at.iter().map(|t| u128::from(*t)).sum();
    if total == 0 {
        return 0;
    }
    let target = (q * total as f64).ceil() as u128;
    let mut seen = 0u128;
    for (count, t) in time_at.iter().enumerate() {
        seen += u128::from(*t);
        if seen >= target.max(1) {
            return count as u64;
        }
    }
    time_at.len().saturating_sub(1) as u64
}

impl PolicyReport {
    pub(crate) fn build(
        sc: &Scenario,
        p: &PolicyConfig,
        s: &RunStats,
        footprint: Footprint,
    ) -> PolicyReport {
        let duration_s = sc.duration.as_secs_f64();
        let bucket_s = sc.bucket.as_secs_f64();
        let horizon = s.horizon as f64;
        let attempts = s.primaries + s.retries + s.hedges;
        let area: u128 = s.buckets.iter().map(|b| b.in_flight_area).sum();
        let units = match p.share {
            Share::Fleet => 1,
            Share::Instance => u64::from(sc.fleet.instances),
        };
        let cap = p.cap.map(|c| (c.ceiling() + c.retry_pool.unwrap_or(0)) * units);
        let adaptive = s.cap.is_some();
        let mut series = Series::default();
        for (i, b) in s.buckets.iter().enumerate() {
            let start = i as f64 * bucket_s;
            let width = ((s.horizon - (i as u64 * s.bucket_nanos)).min(s.bucket_nanos)) as f64;
            series.t_s.push(r4(start));
            series
                .offered_per_s
                .push(r4((b.primaries + b.retries + b.hedges) as f64 * 1e9 / width));
            series.retries_per_s.push(r4(b.retries as f64 * 1e9 / width));
            series.in_flight_mean.push(r4(b.in_flight_area as f64 / width));
            series.in_flight_max.push(u64::from(b.in_flight_max));
            series.retry_fraction.push(r4(ratio(b.retries, b.primaries)));
            series.goodput.push((b.actions > 0).then(|| r4(ratio(b.actions_ok, b.actions))));
            series
                .error_rate
                .push((b.actions > 0).then(|| r4(ratio(b.actions - b.actions_ok, b.actions))));
            series.goodput_per_s.push(r4(b.actions_ok as f64 * 1e9 / width));
            series.errors_per_s.push(r4((b.actions - b.actions_ok) as f64 * 1e9 / width));
            if adaptive {
                series.working_cap.push(r4(b.cap_area as f64 / width));
            }
        }
        // Recovery is judged from the end of the trigger up to the next phase (a later
        // disturbance is not the trigger's doing) or the end of the run.
        let recovery_s = sc.trigger_end().and_then(|end| {
            let end_s = end.as_secs_f64();
            let window = sc.phases.iter().map(|p| p.start).filter(|s| *s >= end).min();
            let window_s = window.unwrap_or(sc.duration).as_secs_f64();
            let first = series.t_s.iter().position(|t| *t >= end_s - 1e-9)?;
            let last = series.t_s.iter().rposition(|t| *t < window_s - 1e-9)?;
            if last < first {
                return None;
            }
            let bad = (first..=last)
                .rev()
                .find(|&i| series.goodput[i].is_none_or(|g| g < sc.recovered_at));
            match bad {
                None => Some(r4(series.t_s[first] - end_s)),
                Some(i) if i < last => Some(r4(series.t_s[i + 1] - end_s)),
                Some(_) => None,
            }
        });
        let phases = sc
            .segments()
            .iter()
            .zip(&s.segments)
            .map(|(seg, st)| {
                let width = (seg.end.saturating_sub(seg.start)).as_secs_f64().max(1e-9);
                PhaseReport {
                    name: seg.name.clone(),
                    offered_per_s: r4((st.primaries + st.retries + st.hedges) as f64 / width),
                    retry_fraction: r4(ratio(st.retries, st.primaries)),
                    hedge_fraction: r4(ratio(st.hedges, st.primaries)),
                    latency_ms: st.latency.as_ref().map(latency),
                    latency_ok_ms: st
                        .latency_ok
                        .as_ref()
                        .filter(|h| h.quantile(0.5).is_some())
                        .map(latency),
                    in_flight_mean: r4(st.in_flight_area as f64 / (width * 1e9)),
                    in_flight_p99: time_quantile(&st.time_at, 0.99),
                    in_flight_max: u64::from(st.in_flight_max),
                    working_cap_mean: adaptive.then(|| r4(st.cap_area as f64 / (width * 1e9))),
                    goodput: r4(ratio(st.actions_ok, st.actions)),
                    error_rate: r4(ratio(st.actions - st.actions_ok, st.actions)),
                    fast_actions: sc
                        .client
                        .fast_within
                        .map(|_| r4(ratio(st.actions_fast, st.actions))),
                }
            })
            .collect();
        let ms = |q: f64| r4(s.latency.quantile(q).unwrap_or(0) as f64 / 1e6);
        PolicyReport {
            name: p.name.clone(),
            description: p.describe(),
            actions: s.actions,
            requests: s.requests,
            primaries: s.primaries,
            retries_issued: s.retries,
            hedges_issued: s.hedges,
            hedges_won: s.hedges_won,
            caller_retries: s.caller_retries,
            hedges_denied: s.hedges_denied.iter().sum(),
            hedges_denied_by: by_reason(&s.hedges_denied),
            offered_per_s: r4(attempts as f64 / duration_s),
            amplification: r4(ratio(attempts, s.requests)),
            in_flight: InFlight {
                mean: r4(area as f64 / horizon),
                p50: time_quantile(&s.time_at, 0.5),
                p99: time_quantile(&s.time_at, 0.99),
                max: u64::from(s.in_flight_max),
                cap,
            },
            working_cap: s.cap.map(|c| WorkingCap {
                initial: p.cap.map_or(0, |c| c.initial()) * units,
                mean: r4(s.buckets.iter().map(|b| b.cap_area).sum::<u128>() as f64 / horizon),
                min: c.min,
                max: c.max,
                last: c.now,
            }),
            goodput: r4(ratio(s.actions_ok, s.actions)),
            goodput_per_s: r4(s.actions_ok as f64 / duration_s),
            error_rate: r4(ratio(s.actions - s.actions_ok, s.actions)),
            retries_denied: s.retries_denied.iter().sum(),
            retries_denied_by: by_reason(&s.retries_denied),
            primaries_denied: s.primaries_denied.iter().sum(),
            primaries_denied_by: by_reason(&s.primaries_denied),
            timeouts: s.timeouts,
            rejected: s.rejected,
            rate_limit: sc.dependency.rate.map(|r| RateLimitReport {
                limit_per_min: r.requests.map(|l| l.per_minute),
                accepted: s.rate_accepted,
                limited: s.rate_limited,
                limited_share: r4(ratio(s.rate_limited, s.rate_accepted + s.rate_limited)),
                accepted_per_min: r4(s.rate_accepted_in_run as f64 * 60.0 / duration_s),
                tokens_limit_per_min: r.tokens.map(|l| l.per_minute),
                tokens_per_min: r.tokens.map(|_| r4(s.tokens_in_run as f64 * 60.0 / duration_s)),
            }),
            latency_ms: Latency { p50: ms(0.5), p99: ms(0.99) },
            recovery_s,
            fast_actions: sc.client.fast_within.map(|_| r4(ratio(s.actions_fast, s.actions))),
            phases,
            series,
            budget_percent: engine::budget_percent(p),
            footprint,
        }
    }
}

impl Report {
    pub(crate) fn new(sc: &Scenario, policies: Vec<PolicyReport>) -> Report {
        let load = match sc.fleet.load {
            Load::Open { rate, arrivals } => {
                let a = match arrivals {
                    crate::scenario::Arrivals::Poisson => "poisson",
                    crate::scenario::Arrivals::Uniform => "uniform",
                    crate::scenario::Arrivals::Recorded => "recorded",
                };
                format!("{rate}/s open loop ({a})")
            }
            Load::Closed { concurrency, think } => format!(
                "{concurrency} workers closed loop (think {})",
                stormguard_core::decimal::format_duration(think)
            ),
        };
        let d = &sc.dependency;
        let fmt_d = stormguard_core::decimal::format_duration;
        let limit = |l: Option<ProviderLimit>, unit: &str| match l {
            None => String::new(),
            Some(l) if l.remaining == l.per_minute => format!(", {} {unit}/min", l.per_minute),
            Some(l) => format!(", {} {unit}/min ({} left at the start)", l.per_minute, l.remaining),
        };
        let mut rate = match d.rate {
            None => String::new(),
            Some(r) => limit(r.requests, "requests") + &limit(r.tokens, "tokens"),
        };
        if sc.fleet.input_tokens > 0 || sc.fleet.max_tokens > 0 {
            rate.push_str(&format!(
                ", calls of {} input tokens and up to {} output ({} written)",
                sc.fleet.input_tokens,
                sc.fleet.max_tokens,
                d.output_tokens(sc.fleet.max_tokens)
            ));
        }
        let setup = format!(
            "{} instance(s) × {load}, fan-out {}; dependency: {}, queue {}, {}{rate}; client: per-try timeout {}, deadline {}",
            sc.fleet.instances,
            sc.fleet.fan_out,
            d.base.describe_servers(),
            d.queue.map_or("unbounded".to_string(), |q| q.to_string()),
            d.base.service_time,
            sc.client.per_try_timeout.map_or("none".to_string(), fmt_d),
            fmt_d(sc.client.deadline),
        );
        let phases = sc
            .segments()
            .iter()
            .map(|p| {
                let c = &p.conditions;
                let mut words = format!(
                    "{}, {} errors, {}",
                    c.describe_servers(),
                    pct(c.error_rate),
                    c.service_time
                );
                if let Some(t) = c.error_time {
                    let _ = write!(words, ", errors take {t}");
                }
                PhaseInfo {
                    name: p.name.clone(),
                    start_s: p.start.as_secs_f64(),
                    end_s: p.end.as_secs_f64(),
                    trigger: p.trigger,
                    conditions: words,
                }
            })
            .collect();
        Report {
            scenario: sc.name.clone(),
            seed: sc.seed,
            description: sc.description.clone(),
            duration_s: sc.duration.as_secs_f64(),
            bucket_s: sc.bucket.as_secs_f64(),
            trigger_end_s: sc.trigger_end().map(|d| d.as_secs_f64()),
            setup,
            phases,
            policies,
        }
    }

    /// The policy named `name`.
    pub fn policy(&self, name: &str) -> Option<&PolicyReport> {
        self.policies.iter().find(|p| p.name == name)
    }

    /// The JSON document (`series` adds each policy's time series). Same scenario and seed,
    /// same bytes.
    pub fn to_json(&self, series: bool) -> String {
        let mut v = serde_json::to_value(self).expect("a report serializes");
        if series && let Some(ps) = v.get_mut("policies").and_then(|p| p.as_array_mut()) {
            for (p, report) in ps.iter_mut().zip(&self.policies) {
                if let Some(obj) = p.as_object_mut() {
                    obj.insert(
                        "series".into(),
                        serde_json::to_value(&report.series).expect("a series serializes"),
                    );
                }
            }
        }
        let mut s = serde_json::to_string_pretty(&v).expect("a report serializes");
        s.push('\n');
        s
    }

    /// The side-by-side tables.
    pub fn write_table(&self, out: &mut dyn Write) -> io::Result<()> {
        writeln!(out, "scenario {} (seed {}, {}s)", self.scenario, self.seed, self.duration_s)?;
        if !self.description.is_empty() {
            writeln!(out, "  {}", self.description.trim())?;
        }
        writeln!(out, "  {}", self.setup)?;
        for p in &self.phases {
            writeln!(
                out,
                "  {:>7}–{:<7} {}{}: {}",
                format!("{:.1}s", p.start_s),
                format!("{:.1}s", p.end_s),
                p.name,
                if p.trigger { " (trigger)" } else { "" },
                p.conditions
            )?;
        }
        writeln!(out)?;
        let mut rows = vec![vec![
            "policy".to_string(),
            "offered/s".into(),
            "ampl".into(),
            "in-flight mean".into(),
            "p50".into(),
            "p99".into(),
            "max".into(),
            "cap".into(),
            "goodput".into(),
            "errors".into(),
            "retries".into(),
            "denied".into(),
            "lat p50".into(),
            "lat p99".into(),
            "recovery".into(),
        ]];
        for p in &self.policies {
            let denied = if p.retries_denied_by.is_empty() {
                "0".to_string()
            } else {
                p.retries_denied_by
                    .iter()
                    .map(|(k, v)| format!("{k} {v}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            };
            rows.push(vec![
                p.name.clone(),
                format!("{:.1}", p.offered_per_s),
                format!("{:.2}", p.amplification),
                format!("{:.2}", p.in_flight.mean),
                p.in_flight.p50.to_string(),
                p.in_flight.p99.to_string(),
                p.in_flight.max.to_string(),
                p.in_flight.cap.map_or("-".into(), |c| c.to_string()),
                pct(p.goodput),
                pct(p.error_rate),
                p.retries_issued.to_string(),
                denied,
                format!("{:.1}ms", p.latency_ms.p50),
                format!("{:.1}ms", p.latency_ms.p99),
                match (self.trigger_end_s, p.recovery_s) {
                    (None, _) => "-".into(),
                    (Some(_), None) => "never".into(),
                    (Some(_), Some(r)) => format!("{r:.0}s"),
                },
            ]);
        }
        table(out, &rows)?;
        let primaries_refused: Vec<String> = self
            .policies
            .iter()
            .filter(|p| p.primaries_denied > 0)
            .map(|p| {
                let why: Vec<String> =
                    p.primaries_denied_by.iter().map(|(k, v)| format!("{k} {v}")).collect();
                format!("{} ({})", p.name, why.join(", "))
            })
            .collect();
        if !primaries_refused.is_empty() {
            writeln!(
                out,
                "first tries refused before the dependency: {}",
                primaries_refused.join("; ")
            )?;
        }
        let callers: Vec<String> = self
            .policies
            .iter()
            .filter(|p| p.caller_retries > 0)
            .map(|p| format!("{} {}", p.name, p.caller_retries))
            .collect();
        if !callers.is_empty() {
            writeln!(
                out,
                "the callers' own retries (client.own_retries; retries to a budget that sees them, \
                 first tries to the rest): {}",
                callers.join(", ")
            )?;
        }
        let hedging: Vec<&PolicyReport> =
            self.policies.iter().filter(|p| p.hedges_issued + p.hedges_denied > 0).collect();
        if !hedging.is_empty() {
            writeln!(out, "\nhedges")?;
            let mut rows = vec![vec![
                "policy".to_string(),
                "sent".into(),
                "won".into(),
                "per first try".into(),
                "retries + hedges per first try".into(),
                "refused".into(),
            ]];
            for p in hedging {
                let refused = if p.hedges_denied_by.is_empty() {
                    "0".to_string()
                } else {
                    p.hedges_denied_by
                        .iter()
                        .map(|(k, v)| format!("{k} {v}"))
                        .collect::<Vec<_>>()
                        .join(", ")
                };
                rows.push(vec![
                    p.name.clone(),
                    p.hedges_issued.to_string(),
                    p.hedges_won.to_string(),
                    format!("{:.3}", ratio(p.hedges_issued, p.primaries)),
                    format!("{:.3}", ratio(p.hedges_issued + p.retries_issued, p.primaries)),
                    refused,
                ]);
            }
            table(out, &rows)?;
        }
        if let Some(limits) = self.policies.iter().find_map(|p| p.rate_limit) {
            writeln!(out, "\nat the dependency's {}", limits.describe())?;
            let tokens = limits.tokens_limit_per_min.is_some();
            let mut rows = vec![vec![
                "policy".to_string(),
                "reached it".into(),
                "429s".into(),
                "429 share".into(),
                "accepted/min".into(),
            ]];
            if tokens {
                rows[0].push("tokens/min".into());
            }
            for p in &self.policies {
                let Some(r) = p.rate_limit else { continue };
                let mut row = vec![
                    p.name.clone(),
                    (r.accepted + r.limited).to_string(),
                    r.limited.to_string(),
                    pct(r.limited_share),
                    format!("{:.1}", r.accepted_per_min),
                ];
                if let Some(t) = r.tokens_per_min {
                    row.push(format!("{t:.0}"));
                }
                rows.push(row);
            }
            table(out, &rows)?;
        }
        let adaptive = self.policies.iter().any(|p| p.working_cap.is_some());
        if self.phases.len() > 1 {
            let hedged = self.policies.iter().any(|p| p.hedges_issued > 0);
            let mut tables = vec![
                ("in flight at the dependency (mean) by phase", PhaseCell::InFlight),
                ("goodput by phase", PhaseCell::Goodput),
                ("retries per first try by phase", PhaseCell::RetryFraction),
            ];
            if hedged {
                tables.push(("hedges per first try by phase", PhaseCell::HedgeFraction));
                tables
                    .push(("in flight at the dependency (most) by phase", PhaseCell::InFlightMax));
                tables.push(("latency p99 by phase", PhaseCell::LatencyP99));
            }
            if adaptive {
                tables.push((
                    "latency p50 / p99 of the actions that succeeded by phase",
                    PhaseCell::LatencyOk,
                ));
            }
            for (title, cell) in tables {
                writeln!(out, "\n{title}")?;
                let mut rows = vec![
                    std::iter::once("policy".to_string())
                        .chain(self.phases.iter().map(|p| p.name.clone()))
                        .collect(),
                ];
                for p in &self.policies {
                    let mut row = vec![p.name.clone()];
                    row.extend(p.phases.iter().map(|ph| {
                        match cell {
                            PhaseCell::InFlight => format!("{:.2}", ph.in_flight_mean),
                            PhaseCell::Goodput => pct(ph.goodput),
                            PhaseCell::RetryFraction => format!("{:.3}", ph.retry_fraction),
                            PhaseCell::HedgeFraction => format!("{:.3}", ph.hedge_fraction),
                            PhaseCell::InFlightMax => ph.in_flight_max.to_string(),
                            PhaseCell::LatencyP99 => {
                                ph.latency_ms.map_or("-".into(), |l| format!("{:.1}ms", l.p99))
                            }
                            PhaseCell::LatencyOk => ph
                                .latency_ok_ms
                                .map_or("-".into(), |l| format!("{:.1} / {:.1}ms", l.p50, l.p99)),
                        }
                    }));
                    rows.push(row);
                }
                table(out, &rows)?;
            }
        }
        if adaptive {
            self.write_working_caps(out)?;
        }
        if self.policies.iter().any(|p| p.fast_actions.is_some()) {
            writeln!(out, "\nactions that succeeded within fast_within")?;
            let mut rows = vec![
                std::iter::once("policy".to_string())
                    .chain(std::iter::once("all".to_string()))
                    .chain(self.phases.iter().map(|p| p.name.clone()))
                    .collect::<Vec<_>>(),
            ];
            for p in &self.policies {
                let mut row = vec![p.name.clone(), p.fast_actions.map_or("-".into(), pct3)];
                row.extend(p.phases.iter().map(|ph| ph.fast_actions.map_or("-".into(), pct3)));
                rows.push(row);
            }
            table(out, &rows)?;
        }
        Ok(())
    }
}

impl Report {
    /// The working cap of each adaptive policy (mean by phase, the least and the most it was,
    /// where it ended), beside the fixed caps of the others for comparison.
    fn write_working_caps(&self, out: &mut dyn Write) -> io::Result<()> {
        writeln!(out, "\nworking cap (mean) by phase; fixed caps as set")?;
        let phases = if self.phases.len() > 1 { self.phases.as_slice() } else { &[] };
        let mut rows = vec![
            std::iter::once("policy".to_string())
                .chain(phases.iter().map(|p| p.name.clone()))
                .chain(["mean", "min", "max", "final"].map(String::from))
                .collect::<Vec<_>>(),
        ];
        for p in &self.policies {
            let mut row = vec![p.name.clone()];
            match (&p.working_cap, p.in_flight.cap) {
                (Some(w), _) => {
                    row.extend(
                        p.phases.iter().take(phases.len()).map(|ph| {
                            ph.working_cap_mean.map_or("-".into(), |m| format!("{m:.1}"))
                        }),
                    );
                    row.push(format!("{:.1}", w.mean));
                    row.extend([w.min, w.max, w.last].map(|n| n.to_string()));
                }
                (None, Some(cap)) => {
                    row.extend(std::iter::repeat_n(cap.to_string(), phases.len() + 4));
                }
                (None, None) => continue,
            }
            rows.push(row);
        }
        table(out, &rows)
    }
}

#[derive(Clone, Copy)]
enum PhaseCell {
    InFlight,
    Goodput,
    RetryFraction,
    HedgeFraction,
    InFlightMax,
    LatencyP99,
    LatencyOk,
}

/// Rates and shares in the tables: one decimal, fixed, so the columns line up.
fn pct(x: f64) -> String {
    format::percent(x, 1)
}

/// The share of fast actions, whose interesting digits are past the first decimal (99.01 %).
fn pct3(x: f64) -> String {
    format::percent(x, 2)
}

/// Columns padded to their widest cell: the first left-aligned, the rest right-aligned.
fn table(out: &mut dyn Write, rows: &[Vec<String>]) -> io::Result<()> {
    use format::Align;
    for line in format::table(rows, |c| if c == 0 { Align::Left } else { Align::Right }) {
        writeln!(out, "{line}")?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn time_quantiles() {
        // 10 ns at 0, 80 at 3, 10 at 7.
        let mut t = vec![0u64; 8];
        t[0] = 10;
        t[3] = 80;
        t[7] = 10;
        assert_eq!(time_quantile(&t, 0.05), 0);
        assert_eq!(time_quantile(&t, 0.5), 3);
        assert_eq!(time_quantile(&t, 0.9), 3);
        assert_eq!(time_quantile(&t, 0.99), 7);
        assert_eq!(time_quantile(&[], 0.5), 0);
    }
}
