//! # stormguard-sim
//!
//! Choosing a retry budget "without guesswork" means seeing, before an incident, what each
//! retry policy does to a dependency that slows down or fails. This crate is a deterministic
//! discrete-event model of a client fleet, a dependency and the storm between them, and it runs
//! stormguard-core's own limiter, breaker and retry decision ([`RetryPolicy::decide`] and
//! [`admit`](stormguard_core::decision::RetryPolicy::admit)) on a virtual clock, so what it
//! predicts is about the code that runs in production.
//!
//! The storm's feedback loop is not scripted: requests queue when the offered load passes the
//! dependency's capacity, queued requests take longer, longer requests hit the client's per-try
//! timeout, timeouts are failures that trigger retries, and a timed-out request keeps its
//! server busy until it is done, because the dependency does not know the client gave up.
//!
//! ```
//! use stormguard_sim::{builtin, simulate};
//!
//! let mut scenario = builtin::scenario("worked-example")?;
//! scenario.duration = std::time::Duration::from_secs(3); // a quick look
//! let report = simulate(&scenario)?;
//! let budgeted = report.policy("ratio-budget").unwrap();
//! assert!(budgeted.in_flight.max <= 20, "the shared cap holds");
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! Every random draw comes from a `SplitMix64` seeded from the scenario's seed, with a separate
//! stream per purpose (arrivals, per-attempt outcomes and service times, jitter), and the draws
//! policies must share are keyed by request and attempt number: every policy sees the same
//! arrivals and the same luck per attempt. Same seed, byte-identical report. The model is
//! described in full in `docs/simulator.md`.
//!
//! [`RetryPolicy::decide`]: stormguard_core::decision::RetryPolicy::decide

#![warn(missing_docs)]

pub mod builtin;
mod dist;
mod engine;
pub mod html;
mod rate;
mod report;
pub mod scenario;
pub mod script;
mod stats;
mod trace;
pub mod tree;

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::time::Duration;

pub use dist::{ServiceTime, ServiceTimeError};
pub use engine::{Footprint, RunError, arrivals};
pub use report::{
    InFlight, Latency, PhaseInfo, PhaseReport, PolicyReport, RateLimitReport, Report, Series,
    WorkingCap,
};
pub use scenario::{InvalidScenario, Scenario, ScenarioError};
pub use stats::latency_histogram;

/// A scenario that could not be run: its policies could not be built (scenarios read with
/// [`Scenario::parse`] are already validated; this is for ones built in code), or a run passed
/// its bound of work ([`Options::max_attempts`], or a closed loop stuck at one instant).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("policy `{policy}`: {reason}")]
pub struct SimError {
    /// The policy.
    pub policy: String,
    /// Why it could not be built, or stopped.
    pub reason: Box<engine::RunError>,
}

/// How to run a scenario.
pub struct Options<'a> {
    /// Policies simulated at once on separate threads; 0 or 1 runs them one after another on
    /// the calling thread. The results do not depend on it.
    pub jobs: usize,
    /// Called about ten times a second with the fraction done (0..=1).
    pub progress: Option<&'a (dyn Fn(f64) + Sync)>,
    /// The most attempts one policy's run may send before it stops with an error. Default
    /// [`scenario::MAX_ATTEMPTS`].
    pub max_attempts: u64,
}

impl Default for Options<'_> {
    fn default() -> Self {
        Options { jobs: 0, progress: None, max_attempts: scenario::MAX_ATTEMPTS }
    }
}

impl std::fmt::Debug for Options<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Options").field("jobs", &self.jobs).finish_non_exhaustive()
    }
}

/// Runs every policy of `scenario` on the same arrivals, one after another on this thread.
pub fn simulate(scenario: &Scenario) -> Result<Report, SimError> {
    simulate_with(scenario, &Options::default())
}

/// Runs every policy of `scenario` with `options` (threads, progress).
pub fn simulate_with(scenario: &Scenario, options: &Options<'_>) -> Result<Report, SimError> {
    let n = scenario.policies.len();
    let progress: Vec<AtomicU64> = (0..n).map(|_| AtomicU64::new(0)).collect();
    let run_one = |i: usize| -> Result<PolicyReport, SimError> {
        let p = &scenario.policies[i];
        let error =
            |reason: RunError| SimError { policy: p.name.clone(), reason: Box::new(reason) };
        let run = engine::Run::new(scenario, p).map_err(error)?;
        let (stats, footprint) =
            run.with_max_attempts(options.max_attempts).run(&progress[i]).map_err(error)?;
        Ok(PolicyReport::build(scenario, p, &stats, footprint))
    };
    let jobs = options.jobs.clamp(1, n.max(1));
    let results: Vec<Result<PolicyReport, SimError>> = if jobs == 1 && options.progress.is_none() {
        (0..n).map(run_one).collect()
    } else {
        let next = AtomicUsize::new(0);
        let mut slots: Vec<Option<Result<PolicyReport, SimError>>> = (0..n).map(|_| None).collect();
        std::thread::scope(|s| {
            let (tx, rx) = mpsc::channel();
            for _ in 0..jobs {
                let tx = tx.clone();
                let (next, run_one) = (&next, &run_one);
                s.spawn(move || {
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        if i >= n {
                            break;
                        }
                        let r = run_one(i);
                        if tx.send((i, r)).is_err() {
                            break;
                        }
                    }
                });
            }
            drop(tx);
            let horizon = scenario.duration.as_nanos() as f64 * n as f64;
            let report = |progress: &[AtomicU64]| {
                if let Some(f) = options.progress {
                    let done: f64 = progress.iter().map(|p| p.load(Ordering::Relaxed) as f64).sum();
                    f((done / horizon).clamp(0.0, 1.0));
                }
            };
            loop {
                match rx.recv_timeout(Duration::from_millis(100)) {
                    Ok((i, r)) => {
                        slots[i] = Some(r);
                        report(&progress);
                    }
                    Err(mpsc::RecvTimeoutError::Timeout) => report(&progress),
                    Err(mpsc::RecvTimeoutError::Disconnected) => break,
                }
            }
        });
        slots.into_iter().map(|r| r.expect("every policy ran")).collect()
    };
    let policies = results.into_iter().collect::<Result<Vec<_>, _>>()?;
    Ok(Report::new(scenario, policies))
}
