//! What the demo plays: the simulator's `demo` built-in, served by chaos, with the two paths its
//! two policies describe — the scenario `stormguard verify --builtin demo` predicts and checks.

use stormguard_sim::Scenario;
use stormguard_sim::ServiceTime;

use super::*;
use crate::cmd::verify::Plan;

/// One phase of the script, placed on the run's timeline.
#[derive(Debug, Clone, Serialize)]
pub struct PhasePlan {
    /// Its name.
    pub name: String,
    /// When it starts, in seconds from the start of the run.
    pub start_s: f64,
    /// When it ends.
    pub end_s: f64,
    /// The share of requests answered 503.
    pub error_rate: f64,
    /// What the upstream does, in words.
    pub conditions: String,
}

/// The `demo` built-in with its timeline stretched or shrunk to `duration`, drawn from `seed`.
pub fn scenario(duration: Duration, seed: u64) -> Result<Scenario, Failure> {
    let mut sc = stormguard_sim::builtin::scenario("demo")
        .map_err(|e| Failure::runtime(format!("the demo's scenario: {e}")))?;
    let k = duration.as_secs_f64() / sc.duration.as_secs_f64();
    for p in &mut sc.phases {
        p.start = p.start.mul_f64(k);
        p.end = p.end.mul_f64(k);
    }
    sc.duration = duration;
    sc.seed = seed;
    Ok(sc)
}

/// The scenario's timeline, in words, for the table and the report.
pub fn plan(sc: &Scenario) -> Vec<PhasePlan> {
    let per_try = sc.client.per_try_timeout;
    sc.segments()
        .iter()
        .map(|seg| {
            let c = &seg.conditions;
            let latency = match c.service_time {
                ServiceTime::Uniform { min, max } => {
                    format!("latency {}–{} ms", min.as_millis(), max.as_millis())
                }
                other => format!("latency {other}"),
            };
            // A phase whose service times reach the per-try timeout (a mean above half of it:
            // the spike's 200-500 ms against 350 ms) is described against it.
            let past_timeout = per_try.is_some_and(|t| c.service_time.mean() * 2 > t);
            let conditions = match (c.error_rate > 0.0, past_timeout, per_try) {
                (true, ..) => format!(
                    "{} answered 503; {latency}",
                    stormguard_core::format::percent(c.error_rate, 0)
                ),
                (false, true, Some(t)) => format!(
                    "no errors; {latency} against a per-try timeout of {} ms",
                    t.as_millis()
                ),
                _ => format!("healthy; {latency}"),
            };
            PhasePlan {
                name: seg.name.clone(),
                start_s: seg.start.as_secs_f64(),
                end_s: seg.end.as_secs_f64(),
                error_rate: c.error_rate,
                conditions,
            }
        })
        .collect()
}

/// The chaos script that serves the scenario (`stormguard chaos --scenario`'s), with the last
/// phase lasting until the servers stop and the work of an abandoned request finished.
pub(super) fn script(sc: &Scenario) -> Result<Script, Failure> {
    let mut s = crate::cmd::chaos_scenario::script(sc)
        .map_err(|e| Failure::runtime(format!("the demo's scenario: {e}")))?;
    if let Some(last) = s.phases.last_mut() {
        last.duration = None;
    }
    // The dependency does not know its client gave up: a timed-out request keeps it busy.
    s.on_disconnect = Some(OnDisconnect::Finish);
    Ok(s)
}

/// The policy named `name`, as `stormguard verify` runs it.
fn policy(sc: &Scenario, name: &str) -> Result<Plan, Failure> {
    let p =
        sc.policies.iter().find(|p| p.name == name).ok_or_else(|| {
            Failure::runtime(format!("the demo's scenario has no policy `{name}`"))
        })?;
    Plan::of(sc, p).map_err(|e| Failure::runtime(format!("the demo's `{name}` policy: {e}")))
}

/// The naive path: the scenario's `naive` policy.
pub(super) fn naive_retries(sc: &Scenario) -> Result<naive::Retries, Failure> {
    match policy(sc, "naive")? {
        Plan::Naive(r) => Ok(r),
        Plan::Proxy(_) => Err(Failure::runtime("the demo's `naive` policy has a cap")),
    }
}

/// The stormguard path: the scenario's `stormguard` policy as the proxy's one dependency.
pub(super) fn proxy_config(
    sc: &Scenario,
    upstream: &str,
    admin: SocketAddr,
) -> Result<ProxyConfig, Failure> {
    let Plan::Proxy(d) = policy(sc, "stormguard")? else {
        return Err(Failure::runtime("the demo's `stormguard` policy has no cap"));
    };
    let mut d = *d;
    d.name = DEPENDENCY.into();
    d.upstreams =
        vec![upstream.parse().map_err(|e| Failure::runtime(format!("demo upstream: {e}")))?];
    d.planned_primary = Some(PLANNED_PRIMARY);
    let mut config = ProxyConfig::single(SocketAddr::from(([127, 0, 0, 1], 0)), d);
    config.admin = Some(admin);
    Ok(config)
}

pub(super) fn load_config(target: SocketAddr, duration: Duration) -> Result<LoadConfig, Failure> {
    let mut c = LoadConfig::new(&format!("http://{target}/"))
        .map_err(|e| Failure::runtime(format!("demo load: {e}")))?;
    // Evenly spaced, as the scenario's `arrivals = "uniform"`.
    c.mode = Mode::Open {
        rate: Rate { count: RATE_PER_S, per: Duration::from_secs(1) },
        max_outstanding: 5_000,
    };
    c.duration = Some(duration);
    c.timeout = Duration::from_secs(5);
    c.validate().map_err(|e| Failure::runtime(format!("demo load: {e}")))?;
    Ok(c)
}
