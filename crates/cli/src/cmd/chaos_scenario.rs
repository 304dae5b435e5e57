//! `stormguard chaos --scenario FILE`: a simulator scenario's dependency served live.
//!
//! The scenario's timeline becomes chaos's phases, one per segment of the simulator's report
//! (`Scenario::segments`: the dependency's baseline conditions where no phase applies, each
//! phase's where it does), with the same names. Each chaos phase has the scenario's `capacity`
//! as its servers and its `queue` as their line (the rest wait, first come first served, as in
//! the model; past a full line, 503 at once), its `error_rate` answered 503, and its service time
//! as chaos's latency; a dependency with `workers` and no `capacity` is chaos's `workers`. What
//! chaos cannot yet play as the model does is refused by name rather than approximated: an
//! `error_time` of its own, a provider's limits, a slow tail, servers with workers.

use std::time::Duration;

use stormguard_chaos::{Latency, Phase, Script};
use stormguard_core::dist::Z_P99;
use stormguard_sim::ServiceTime;
use stormguard_sim::scenario::{Conditions, Scenario};

/// Why a scenario's dependency cannot be served by chaos (yet).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum NotServed {
    /// `error_time`: chaos's errors take the drawn latency.
    #[error("{at}: error_time: chaos's errors take the service time; leave error_time out")]
    ErrorTime {
        /// Where: `[dependency]` or the phase's name.
        at: String,
    },
    /// A provider's limits.
    #[error("[dependency] requests/tokens per minute: serve a provider with chaos --provider")]
    ProviderRate,
    /// Servers and workers in one phase: chaos's `servers` and `workers` do not combine.
    #[error("{at}: capacity and workers: chaos serves one or the other; give only one")]
    ServersAndWorkers {
        /// Where: `[dependency]` or the phase's name.
        at: String,
    },
    /// A service time chaos does not draw.
    #[error(
        "{at}: service_time {got}: chaos serves fixed, exponential, uniform and log-normal service times"
    )]
    ServiceTime {
        /// Where: `[dependency]` or the phase's name.
        at: String,
        /// The service time given.
        got: String,
    },
}

/// The chaos script that plays `scenario`'s dependency over its timeline.
pub fn script(scenario: &Scenario) -> Result<Script, NotServed> {
    let dep = &scenario.dependency;
    if dep.rate.is_some() {
        return Err(NotServed::ProviderRate);
    }
    let phases = scenario
        .segments()
        .iter()
        .map(|seg| {
            let at = if seg.conditions == dep.base { "[dependency]" } else { seg.name.as_str() };
            phase(&seg.name, &seg.conditions, seg.end - seg.start, dep.queue, at)
        })
        .collect::<Result<Vec<_>, _>>()?;
    let mut script = Script::single(phases[0].clone());
    script.phases = phases;
    script.seed = Some(scenario.seed);
    Ok(script)
}

/// One chaos phase of `duration` playing `c`; `at` names it in errors.
fn phase(
    name: &str,
    c: &Conditions,
    duration: Duration,
    queue: Option<u32>,
    at: &str,
) -> Result<Phase, NotServed> {
    if c.error_time.is_some() {
        return Err(NotServed::ErrorTime { at: at.to_string() });
    }
    if c.servers().is_some() && c.workers.is_some() {
        return Err(NotServed::ServersAndWorkers { at: at.to_string() });
    }
    Ok(Phase {
        name: name.to_string(),
        duration: Some(duration),
        error_rate: c.error_rate,
        status: 503,
        latency: latency(c.service_time, at)?,
        servers: c.servers().map(u64::from),
        workers: c.workers.map(u64::from),
        // A line is for servers; a dependency served at once (workers) has none.
        queue: c.servers().and(queue).map(u64::from),
        ..Phase::default()
    })
}

/// Chaos's latency for a service time.
fn latency(t: ServiceTime, at: &str) -> Result<Latency, NotServed> {
    match t {
        ServiceTime::Fixed(d) => Ok(Latency::Fixed(d)),
        ServiceTime::Exponential(mean) => Ok(Latency::Exponential { mean }),
        ServiceTime::Uniform { min, max } => Ok(Latency::Uniform { min, max }),
        ServiceTime::LogNormal { median, sigma: 0.0 } => Ok(Latency::Fixed(median)),
        ServiceTime::LogNormal { median, sigma } => {
            Ok(Latency::LogNormal { p50: median, p99: median.mul_f64((Z_P99 * sigma).exp()) })
        }
        other => Err(NotServed::ServiceTime { at: at.to_string(), got: other.to_string() }),
    }
}
