//! What a run comes to, per path and per phase: the JSON summary.

use super::*;

/// Per-bucket time series of one path (the report's charts).
#[derive(Debug, Clone, Default, Serialize)]
pub struct PathSeries {
    /// Mean attempts in flight at the upstream over the bucket (sampled every 5 ms).
    pub in_flight_mean: Vec<f64>,
    /// The most seen in flight by those samples.
    pub in_flight_max: Vec<u64>,
    /// Attempts per second at the upstream.
    pub attempts_per_s: Vec<f64>,
    /// Retries per first try at the upstream.
    pub retry_fraction: Vec<f64>,
    /// Complete 2xx / requests that ended in the bucket (`None`: none ended).
    pub success_rate: Vec<Option<f64>>,
}

/// What the report's charts draw.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Series {
    /// Each bucket's end, in seconds.
    pub t_s: Vec<f64>,
    /// The naive path.
    pub naive: PathSeries,
    /// The stormguard path.
    pub stormguard: PathSeries,
    /// The proxy's refusals per second, by reason (only reasons that occurred).
    pub denied_per_s: BTreeMap<&'static str, Vec<f64>>,
}

/// In flight at one upstream.
#[derive(Debug, Clone, Default, Serialize)]
pub struct InFlight {
    /// Time-weighted mean (sampled every 5 ms).
    pub mean: f64,
    /// 99th percentile of what each arriving attempt saw (chaos's histogram).
    pub p99: u64,
    /// The exact maximum (chaos's counter).
    pub max: u64,
}

/// One path over the whole run.
#[derive(Debug, Clone, Default, Serialize)]
pub struct PathSummary {
    /// Requests the callers sent.
    pub sent: u64,
    /// Attempts that reached the upstream.
    pub upstream_requests: u64,
    /// Of those, retries.
    pub upstream_retries: u64,
    /// `upstream_requests / sent`.
    pub amplification: f64,
    /// In flight at the upstream.
    pub in_flight: InFlight,
    /// Complete 2xx / scheduled.
    pub success_rate: f64,
    /// Callers' latency, p50 and p99, in milliseconds.
    pub latency_p50_ms: f64,
    /// See `latency_p50_ms`.
    pub latency_p99_ms: f64,
    /// Retries refused, by reason (stormguard only).
    pub retries_denied: BTreeMap<&'static str, u64>,
    /// First tries refused before the upstream, by reason (stormguard only).
    pub primaries_shed: BTreeMap<&'static str, u64>,
}

/// One path over one phase.
#[derive(Debug, Clone, Default, Serialize)]
pub struct PhasePath {
    /// Time-weighted mean in flight at the upstream.
    pub in_flight_mean: f64,
    /// Chaos's p99 for the phase.
    pub in_flight_p99: u64,
    /// Chaos's exact maximum for the phase.
    pub in_flight_max: u64,
    /// Attempts at the upstream per arrival.
    pub amplification: f64,
    /// Complete 2xx per request that ended in the phase.
    pub success_rate: Option<f64>,
}

/// One phase, both paths.
#[derive(Debug, Clone, Serialize)]
pub struct PhaseSummary {
    /// The phase.
    #[serde(flatten)]
    pub plan: PhasePlan,
    /// The naive path in it.
    pub naive: PhasePath,
    /// The stormguard path in it.
    pub stormguard: PhasePath,
}

/// The whole run, as `--json` prints it.
#[derive(Debug, Clone, Serialize)]
pub struct Summary {
    /// The run's length.
    pub duration_s: f64,
    /// Arrivals per second on each path.
    pub rate_per_s: f64,
    /// The proxy's cap.
    pub cap: u64,
    /// Primaries planned in flight.
    pub planned_primary: u64,
    /// The proxy's budget.
    pub budget: &'static str,
    /// The budget as a fraction of first tries.
    pub budget_percent: f64,
    /// Both paths' per-try timeout.
    pub per_try_timeout_ms: u64,
    /// Where the dashboard was.
    pub dashboard: String,
    /// Where the report was written.
    pub report: Option<String>,
    /// The naive retry-once path.
    pub naive: PathSummary,
    /// The stormguard path.
    pub stormguard: PathSummary,
    /// By phase.
    pub phases: Vec<PhaseSummary>,
    /// The charts' data.
    pub series: Series,
}

pub(super) fn path_summary(
    report: &LoadReport,
    stats: &Stats,
    marks: &[Mark],
    pick: impl Fn(&Mark) -> &PathMark,
) -> PathSummary {
    let (sum, samples) = marks
        .iter()
        .map(&pick)
        .fold((0, 0), |(s, n), m| (s + m.in_flight_sum, n + m.in_flight_samples));
    PathSummary {
        sent: report.sent,
        upstream_requests: stats.total.requests,
        upstream_retries: stats.total.retries,
        amplification: stats.total.requests as f64 / report.sent.max(1) as f64,
        in_flight: InFlight {
            mean: sum as f64 / samples.max(1) as f64,
            p99: stats.total.in_flight.p99,
            max: stats.total.in_flight.max,
        },
        success_rate: report.success_rate,
        latency_p50_ms: report.latency_ms.p50,
        latency_p99_ms: report.latency_ms.p99,
        retries_denied: BTreeMap::new(),
        primaries_shed: BTreeMap::new(),
    }
}

pub(super) fn phase_path(
    plan: &PhasePlan,
    stats: Option<&stormguard_chaos::PhaseStats>,
    marks: &[Mark],
    pick: impl Fn(&Mark) -> &PathMark,
) -> PhasePath {
    // The buckets that end inside the phase.
    let inside = |t: f64| t > plan.start_s + 1e-6 && t <= plan.end_s + 1e-6;
    let (mut sum, mut samples, mut done, mut ok) = (0, 0, 0.0, 0.0);
    for w in marks.windows(2) {
        if !inside(w[1].t_s) {
            continue;
        }
        let (a, b) = (pick(&w[0]), pick(&w[1]));
        sum += b.in_flight_sum;
        samples += b.in_flight_samples;
        done += delta(a.done, b.done);
        ok += delta(a.succeeded, b.succeeded);
    }
    // Open-loop arrivals keep a fixed timetable: arrival i at i / rate.
    let arrivals = (plan.end_s * RATE_PER_S).floor() - (plan.start_s * RATE_PER_S).floor();
    let requests = stats.map_or(0, |s| s.counts.requests) as f64;
    PhasePath {
        in_flight_mean: sum as f64 / samples.max(1) as f64,
        in_flight_p99: stats.map_or(0, |s| s.counts.in_flight.p99),
        in_flight_max: stats.map_or(0, |s| s.counts.in_flight.max),
        amplification: if arrivals > 0.0 { requests / arrivals } else { 0.0 },
        success_rate: (done > 0.0).then(|| ok / done),
    }
}
