//! A scripted dependency: each request arrives when a script says and each of its attempts is
//! answered as the script says, and the run returns what happened, event by event — what the
//! dependency saw and what each caller got. The differential test runs the same script through
//! the tower layer on a paused clock and expects the same log: the simulator and the layer run
//! one request life ([`stormguard_core::life`]), and this is where a placement that drifted from
//! it shows.

use std::time::Duration;

use stormguard_core::denied::Denied;

use crate::scenario::{Arrivals, Load, Scenario};
use crate::{RunError, SimError};

/// How the dependency answers one attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Answer {
    /// A success, this long after the attempt was sent.
    Ok(Duration),
    /// A 503, this long after.
    Unavailable(Duration),
    /// A 429, this long after, with `Retry-After` of this many whole seconds.
    TooMany(Duration, u64),
}

impl Answer {
    /// How long after the attempt was sent it comes.
    pub fn after(&self) -> Duration {
        match *self {
            Answer::Ok(d) | Answer::Unavailable(d) | Answer::TooMany(d, _) => d,
        }
    }
}

/// The answer an attempt past the end of its request's script gets: a success after 160 ms.
pub const AFTER_THE_SCRIPT: Answer = Answer::Ok(Duration::from_millis(160));

/// One request of a script: when it arrives (from the start of the run), and its attempts'
/// answers, in the order the attempts reach the dependency.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScriptedRequest {
    /// Its arrival.
    pub at: Duration,
    /// Its attempts' answers.
    pub answers: Vec<Answer>,
}

impl ScriptedRequest {
    /// The answer to the request's `n`th attempt (1: its first).
    pub fn answer(&self, n: u32) -> Answer {
        let i = usize::try_from(n.saturating_sub(1)).unwrap_or(usize::MAX);
        self.answers.get(i).copied().unwrap_or(AFTER_THE_SCRIPT)
    }
}

/// What happened to a scripted request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Event {
    /// Its `n`th attempt reached the dependency (a hedge is marked).
    Sent {
        /// 1 for the first.
        n: u32,
        /// The attempt is a hedge.
        hedge: bool,
    },
    /// Its caller got its answer: a success, or a failure with the reason stormguard refused it
    /// (its retry, or its first try) when it did.
    Ended {
        /// A success.
        ok: bool,
        /// Why it was refused, if it was.
        refused: Option<Denied>,
    },
}

/// One line of the log: when (from the start of the run), which request (its place in the
/// script), and what.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Line {
    /// When.
    pub at: Duration,
    /// The request's index in the script.
    pub request: u32,
    /// What happened.
    pub event: Event,
}

/// Runs `requests` (in arrival order, at distinct instants) through policy `policy` of
/// `scenario`: one instance, a fan-out of 1, no caller's own retries, and a dependency that
/// answers every attempt as the script says, at once (no servers to wait for). The log comes
/// in time order.
pub fn run(
    scenario: &Scenario,
    policy: usize,
    requests: &[ScriptedRequest],
) -> Result<Vec<Line>, SimError> {
    let mut sc = scenario.clone();
    sc.fleet.instances = 1;
    sc.fleet.fan_out = 1;
    sc.client.own_retries = 0;
    sc.fleet.load = Load::Open { rate: 1.0, arrivals: Arrivals::Recorded };
    let times: Vec<u64> = requests.iter().map(|r| crate::dist::nanos(r.at)).collect();
    // Arrivals run until the last one (the run then follows every request to its end).
    let last = times.iter().max().copied().unwrap_or(0);
    sc.duration = sc.duration.max(Duration::from_nanos(last.saturating_add(1_000_000)));
    sc.fleet.recorded = Some(times.into());
    let p = &sc.policies[policy];
    let error = |reason: RunError| SimError { policy: p.name.clone(), reason: Box::new(reason) };
    let run = crate::engine::Run::new(&sc, p).map_err(error)?.with_script(requests);
    let progress = std::sync::atomic::AtomicU64::new(0);
    run.run_logged(&progress).map_err(error)
}
