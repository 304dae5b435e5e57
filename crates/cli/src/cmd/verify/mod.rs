//! `stormguard verify`: the simulator's prediction beside a live run of the same scenario.
//!
//! The scenario is simulated first. Then each policy that can run live runs on loopback, one
//! after another, each against a fresh chaos server that plays the scenario's dependency over
//! its timeline (`chaos --scenario`): a stormguard policy behind `stormguard proxy` configured
//! with the policy's cap, queue, budget, retries, backoff, breaker, hedging and adaptive cap and
//! the scenario's client timeouts; a naive policy behind a forwarder that retries as the model's
//! naive client does. The open-loop arrivals are the simulator's own (the same seed, the same
//! instants), sent by one HTTP client with the scenario's deadline.
//!
//! What is compared is measured at the dependency where the model measures it: attempts in
//! flight at chaos (sampled every millisecond: mean and p99 over time; the exact most from
//! chaos's count), amplification (attempts chaos received per first try), and the callers'
//! success rate and latency (p50, p99) of the actions started in each segment of the timeline.
//! Each policy's prediction is calibrated with chaos's own share of its run (how much longer
//! than drawn chaos held each answer: `verify_scaled`). A stormguard policy agrees when its
//! in-flight p99 and amplification are within the tolerance of the prediction in every segment
//! (a count within one request of it also agrees: in flight is a whole number; with the model
//! as written beside it, a figure agrees within the tolerance of either prediction or between
//! them); the naive policies are shown, not judged (docs/simulator.md says why).
//!
//! - this module: flags, the run, the verdict;
//! - `live`: one policy's live run;
//! - `compare`: predicted beside measured, the table and the JSON;
//! - `scale`: `--scale F`, a scenario too large for the machine at a fraction of its size.

mod compare;
mod live;
mod scale;

use std::io::Write;
use std::path::PathBuf;
use std::time::Duration;

use clap::Args;
use stormguard_sim::scenario::{HeldSlotRelease, Load, PolicyConfig};
use stormguard_sim::{PolicyReport, Scenario};

use crate::Failure;
pub use compare::{Comparison, Figure, LiveRun, PolicyComparison, SegmentComparison};
pub(crate) use live::Plan;
pub use live::{Measured, NotLive};
pub use scale::{NotScalable, scale};

/// First tries a second that a loopback run on this machine is trusted to carry.
pub const MAX_LIVE_RATE: f64 = 2_000.0;

/// Flags of `stormguard verify`.
#[derive(Debug, Args)]
#[command(after_help = "\
Runs the simulator, then the same scenario live on 127.0.0.1 (chaos serving the timeline,
stormguard proxy with each stormguard policy, a naive forwarder for the naive ones, the
simulator's own arrivals) and prints, per policy and segment, predicted beside measured: in
flight at the dependency (mean, p99, max), amplification, success rate, latency p50 and p99.
The prediction judged is calibrated: the model given chaos's own measured share of the run
(how much longer than drawn it held each answer); the model as written is shown beside it.

  stormguard verify --builtin worked-example
  stormguard verify deploy/examples/storm.toml --policy ratio-budget --json

Exit codes: 0 every stormguard policy agreed within the tolerance, 1 one did not (or the run
failed), 2 bad flags or a scenario that cannot run live (the reason is printed).")]
pub struct VerifyArgs {
    /// The scenario file (as `stormguard simulate` reads).
    #[arg(value_name = "SCENARIO", conflicts_with = "builtin")]
    pub file: Option<PathBuf>,
    /// A built-in scenario instead of a file (`stormguard simulate --list`).
    #[arg(long, value_name = "NAME")]
    pub builtin: Option<String>,
    /// Only these policies (repeat the flag for several).
    #[arg(long = "policy", value_name = "NAME")]
    pub policies: Vec<String>,
    /// How far measured may be from predicted and still agree, as a fraction.
    #[arg(long, value_name = "FRACTION", default_value_t = 0.10)]
    pub tolerance: f64,
    /// Print one JSON object on stdout instead of the table.
    #[arg(long)]
    pub json: bool,
    /// Write a self-contained HTML report here.
    #[arg(long, value_name = "FILE")]
    pub html: Option<PathBuf>,
    /// Run the scenario at this fraction of its size (0 < F <= 1): the arrival rate, servers,
    /// queues, caps and budgets' absolute amounts scaled; both the model and the live run take
    /// the scaled scenario.
    #[arg(long, value_name = "F")]
    pub scale: Option<f64>,
    /// Judge against the model as written: without chaos's measured share (how much longer
    /// than drawn it held each answer) added to the model's service time.
    #[arg(long)]
    pub uncalibrated: bool,
}

/// Runs `stormguard verify`.
pub fn run(args: &VerifyArgs, out: &mut dyn Write) -> Result<(), Failure> {
    if !(args.tolerance > 0.0 && args.tolerance < 1.0) {
        return Err(Failure::usage(format!(
            "--tolerance: must be a fraction above 0 and below 1, got {}",
            args.tolerance
        )));
    }
    let (mut scenario, _) = super::simulate::load(args.builtin.as_deref(), args.file.as_ref())?;
    super::simulate::select(&mut scenario, &args.policies)?;
    if let Some(f) = args.scale {
        scenario = scale(&scenario, f).map_err(|e| Failure::usage(e.to_string()))?;
    }
    let comparison =
        verify_scaled(&scenario, args.tolerance, args.scale.unwrap_or(1.0), !args.uncalibrated)?;
    if args.json {
        serde_json::to_writer_pretty(&mut *out, &comparison)
            .map_err(|e| Failure::runtime(format!("cannot write the JSON: {e}")))?;
        writeln!(out)?;
    } else {
        out.write_all(comparison.table().as_bytes())?;
    }
    if let Some(path) = &args.html {
        std::fs::write(path, comparison.html()).map_err(|e| {
            Failure::runtime(format!("{}: cannot write the report: {e}", path.display()))
        })?;
    }
    match comparison.disagreements() {
        0 => Ok(()),
        n => Err(Failure::runtime(format!(
            "{n} stormguard {} disagreed with the model beyond ±{:.0} %",
            if n == 1 { "policy" } else { "policies" },
            args.tolerance * 100.0
        ))),
    }
}

/// Simulates `scenario`, then runs each of its policies live (those that can be), one after
/// another, and compares, each policy calibrated (below).
pub fn verify(scenario: &Scenario, tolerance: f64) -> Result<Comparison, Failure> {
    verify_scaled(scenario, tolerance, 1.0, true)
}

/// [`verify`] of a scenario already scaled by `applied` (`--scale`; 1 for none), so that a
/// refusal's suggested factor is one for the file as written.
///
/// Calibrated (`calibrate`), each policy that ran live is simulated again with chaos's own
/// share of that run — how much longer than drawn it held each answer, on average — added to
/// every attempt's service time ([`SimDependency::overhead`]), and judged against that; the
/// model as written is shown beside it. The share is measured at chaos from the draws chaos
/// made, never from what the model predicted, so a wrong model stays wrong.
///
/// [`SimDependency::overhead`]: stormguard_sim::scenario::SimDependency::overhead
fn verify_scaled(
    scenario: &Scenario,
    tolerance: f64,
    applied: f64,
    calibrate: bool,
) -> Result<Comparison, Failure> {
    runnable(scenario, applied)?;
    let predicted = stormguard_sim::simulate(scenario)
        .map_err(|e| Failure::usage(format!("{}: {e}", scenario.name)))?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| Failure::runtime(format!("cannot start the runtime: {e}")))?;
    // Every plan is made and checked before the first live run, so a policy the proxy refuses
    // is reported at once, not after the others have run.
    let plans: Vec<_> = scenario.policies.iter().map(|p| live::Plan::of(scenario, p)).collect();
    for (policy, plan) in scenario.policies.iter().zip(&plans) {
        if let Ok(plan) = plan {
            plan.check().map_err(|e| {
                Failure::usage(format!("{}: policy {}: {}", scenario.name, policy.name, e.message))
            })?;
        }
    }
    let mut policies = Vec::new();
    for ((policy, report), plan) in scenario.policies.iter().zip(&predicted.policies).zip(plans) {
        let run = match plan {
            Ok(plan) => {
                tracing::info!(
                    policy = %policy.name,
                    front = plan.front_name(),
                    seconds = scenario.duration.as_secs_f64(),
                    "running live"
                );
                let (measured, overhead) = runtime.block_on(live::run(scenario, &plan))?;
                let judged = matches!(plan, live::Plan::Proxy(_));
                Ok(LiveRun { front: plan.front_name(), judged, measured, overhead })
            }
            Err(why) => Err(why),
        };
        let calibrated = match &run {
            Ok(r) if calibrate => Some(calibrated(scenario, policy, r.overhead)?),
            _ => None,
        };
        policies.push(PolicyComparison::new(
            &policy.name,
            report,
            calibrated.as_ref(),
            run,
            tolerance,
        ));
    }
    runtime.shutdown_timeout(Duration::from_secs(1));
    Ok(Comparison::new(scenario, tolerance, policies))
}

/// `policy` simulated again under `scenario` with `overhead` added to every attempt's service
/// time.
fn calibrated(
    scenario: &Scenario,
    policy: &PolicyConfig,
    overhead: Duration,
) -> Result<PolicyReport, Failure> {
    let mut sc = scenario.clone();
    sc.policies = vec![policy.clone()];
    sc.dependency.overhead = overhead;
    let mut report = stormguard_sim::simulate(&sc)
        .map_err(|e| Failure::usage(format!("{}: {e}", scenario.name)))?;
    Ok(report.policies.remove(0))
}

/// A factor that fits, written short: rounded down to two significant digits (0.04, 0.0016).
fn fits(f: f64) -> String {
    let digits = (-f.log10().floor()).max(0.0) as i32 + 1;
    let step = 10f64.powi(digits);
    let down = (f * step).floor() / step;
    format!("{}", if down > 0.0 { down } else { f })
}

/// Refuses, by name, a scenario that cannot be run live on this machine as the model runs it;
/// `applied` is the `--scale` already applied to it (1 when none), so a suggested factor is
/// one for the file as written.
fn runnable(sc: &Scenario, applied: f64) -> Result<(), Failure> {
    let refuse = |why: String| Err(Failure::usage(format!("{}: cannot run live: {why}", sc.name)));
    let Load::Open { rate, .. } = sc.fleet.load else {
        return refuse("a closed loop (fleet.concurrency); verify sends open-loop arrivals".into());
    };
    if sc.fleet.instances != 1 {
        return refuse(format!(
            "fleet.instances = {}; verify runs one instance (one proxy) live",
            sc.fleet.instances
        ));
    }
    if sc.fleet.fan_out != 1 {
        return refuse(format!(
            "fleet.fan_out = {}; verify sends one call per action",
            sc.fleet.fan_out
        ));
    }
    if sc.client.own_retries > 0 {
        return refuse(
            "client.own_retries; verify's load generator retries nothing of its own (the \
             callers stage of scripts/test drives real retrying callers through the proxy)"
                .into(),
        );
    }
    if sc.client.non_idempotent > 0.0 {
        return refuse("client.non_idempotent; verify sends GETs only".into());
    }
    if sc.client.held_slot == HeldSlotRelease::FullHold {
        return refuse(
            "client.held_slot = \"full-hold\"; the proxy gives a held slot back at the answer"
                .into(),
        );
    }
    super::chaos_scenario::script(sc).map_err(|e| {
        Failure::usage(format!("{}: cannot run live: chaos cannot serve it: {e}", sc.name))
    })?;
    if rate > MAX_LIVE_RATE {
        return refuse(format!(
            "{rate} first tries a second is more than a loopback run on this machine carries \
             (about {MAX_LIVE_RATE:.0} a second, with the proxy, chaos and the callers sharing the \
             cores); --scale {} runs it at that fraction of its size (rate, servers, caps and \
             budgets scaled alike)",
            fits(applied * MAX_LIVE_RATE / rate)
        ));
    }
    Ok(())
}
