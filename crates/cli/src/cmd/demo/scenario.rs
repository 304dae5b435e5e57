//! What the demo plays: the phases, the chaos script, and the two paths' configs.

use super::*;

/// One phase of the script, placed on the run's timeline.
#[derive(Debug, Clone, Serialize)]
pub struct PhasePlan {
    /// Its name.
    pub name: &'static str,
    /// When it starts, in seconds from the start of the run.
    pub start_s: f64,
    /// When it ends.
    pub end_s: f64,
    /// The share of requests answered 503.
    pub error_rate: f64,
    /// What the upstream does, in words.
    pub conditions: String,
    #[serde(skip)]
    latency: Latency,
}

pub(super) const NORMAL: (u64, u64) = (80, 120);
pub(super) const SPIKE: (u64, u64) = (200, 500);

pub(super) fn uniform((lo, hi): (u64, u64)) -> Latency {
    Latency::Uniform { min: Duration::from_millis(lo), max: Duration::from_millis(hi) }
}

/// The five phases over `duration`: 15 % at 5 % errors, 15 % at 20 %, 25 % at 40 %, 20 % of a
/// latency spike, 25 % of recovery.
pub fn plan(duration: Duration) -> Vec<PhasePlan> {
    let d = duration.as_secs_f64();
    let normal = format!("latency {}–{} ms", NORMAL.0, NORMAL.1);
    let steps: [(&'static str, f64, f64, (u64, u64)); 5] = [
        ("5 % errors", 0.15, 0.05, NORMAL),
        ("20 % errors", 0.15, 0.20, NORMAL),
        ("40 % errors", 0.25, 0.40, NORMAL),
        ("latency spike", 0.20, 0.0, SPIKE),
        ("recovery", 0.25, 0.0, NORMAL),
    ];
    let mut start = 0.0;
    steps
        .iter()
        .map(|&(name, share, error_rate, latency)| {
            let end = start + share * d;
            let conditions = if latency == SPIKE {
                format!(
                    "no errors; latency {}–{} ms against a per-try timeout of {} ms",
                    latency.0,
                    latency.1,
                    PER_TRY_TIMEOUT.as_millis()
                )
            } else if error_rate > 0.0 {
                format!(
                    "{} answered 503; {normal}",
                    stormguard_core::format::percent(error_rate, 0)
                )
            } else {
                format!("healthy; {normal}")
            };
            let p = PhasePlan {
                name,
                start_s: start,
                end_s: end,
                error_rate,
                conditions,
                latency: uniform(latency),
            };
            start = end;
            p
        })
        .collect()
}

pub(super) fn script(plan: &[PhasePlan], seed: u64) -> Script {
    let last = plan.len() - 1;
    Script {
        phases: plan
            .iter()
            .enumerate()
            .map(|(i, p)| Phase {
                name: p.name.to_string(),
                // The last phase lasts until the servers stop.
                duration: (i < last).then(|| Duration::from_secs_f64(p.end_s - p.start_s)),
                error_rate: p.error_rate,
                status: 503,
                latency: p.latency,
                workers: Some(WORKERS),
                ..Phase::default()
            })
            .collect(),
        repeat: false,
        seed: Some(seed),
        // The dependency does not know its client gave up: a timed-out request keeps it busy.
        on_disconnect: Some(OnDisconnect::Finish),
        ..Script::single(Phase::default())
    }
}

pub(super) fn proxy_config(upstream: &str, admin: SocketAddr) -> Result<ProxyConfig, Failure> {
    let bad = |e: String| Failure::runtime(format!("demo proxy config: {e}"));
    let mut d =
        ProxyDependency::new(DEPENDENCY, upstream.parse().map_err(|e| bad(format!("{e}")))?);
    d.cap = CAP;
    d.planned_primary = Some(PLANNED_PRIMARY);
    d.budget = BUDGET.parse().map_err(|e| bad(format!("{e}")))?;
    // Like the naive path, a timed-out attempt is a failure worth one retry: the default
    // `retry_on` already says so.
    d.max_retries = 1;
    d.per_try_timeout = Some(PER_TRY_TIMEOUT);
    // Retries go out (almost) at once, as in the worked example and on the naive path.
    d.backoff = BackoffConfig::parse_range("1ms..5ms").map_err(|e| bad(e.to_string()))?;
    d.queue = 100;
    d.queue_timeout = Duration::from_millis(200);
    let mut config = ProxyConfig::single(SocketAddr::from(([127, 0, 0, 1], 0)), d);
    config.admin = Some(admin);
    Ok(config)
}

pub(super) fn load_config(target: SocketAddr, duration: Duration) -> Result<LoadConfig, Failure> {
    let mut c = LoadConfig::new(&format!("http://{target}/"))
        .map_err(|e| Failure::runtime(format!("demo load: {e}")))?;
    c.mode = Mode::Open {
        rate: Rate { count: RATE_PER_S, per: Duration::from_secs(1) },
        max_outstanding: 5_000,
    };
    c.duration = Some(duration);
    c.timeout = Duration::from_secs(5);
    c.validate().map_err(|e| Failure::runtime(format!("demo load: {e}")))?;
    Ok(c)
}
