//! A circuit breaker for one upstream (or route).
//!
//! A budget bounds how many retries a failing dependency is sent, and the cap bounds how many
//! attempts it holds; neither stops the first tries. When an upstream is down, every attempt
//! still waits out a connect failure or a timeout, holds a slot while it does, and hands the
//! upstream more work just as it tries to come back. A breaker notices the failures, fails fast
//! for a while (no attempts, no retries), then lets a bounded number of probes through to find
//! out whether the upstream is back.
//!
//! Only attempts that reached the upstream and failed count against it ([`AttemptResult`]): a
//! connect failure, a reset, a timeout or a 5xx. A 4xx (429 included: pushback handles it) and a
//! local refusal (budget, cap, queue, deadline) never count, so one tenant's bad requests cannot
//! open the breaker for everyone.
//!
//! ```
//! use std::time::Duration;
//! use stormguard_core::breaker::{AttemptResult, Breaker, BreakerConfig, BreakerState};
//! use stormguard_core::clock::Timestamp;
//!
//! let breaker = Breaker::try_new(BreakerConfig::default())?;
//! let t = Timestamp::from_millis(1_000);
//! for _ in 0..10 {
//!     // The default opens after 10 failures in a row, whatever the ratio.
//!     let permit = breaker.try_acquire(t).expect("closed");
//!     permit.record(t, AttemptResult::UpstreamFailure);
//! }
//! assert_eq!(breaker.state(t), BreakerState::Open { until: Timestamp::from_millis(6_000) });
//! assert!(breaker.try_acquire(t).is_err()); // fail fast
//! assert!(!breaker.allows_retry(t));
//!
//! // After the break duration, one probe is let through; its success closes the breaker.
//! let later = Timestamp::from_millis(6_000);
//! let probe = breaker.try_acquire(later).expect("half-open admits a probe");
//! assert!(probe.is_probe());
//! assert!(breaker.try_acquire(later).is_err()); // the probe's place is taken
//! probe.record(later, AttemptResult::Success);
//! assert_eq!(breaker.state(later), BreakerState::Closed);
//! # Ok::<(), stormguard_core::ConfigError>(())
//! ```
//!
//! ## States
//! - **Closed**: every attempt is admitted. It opens when, over the sliding `window`, failures
//!   are more than `failure_ratio` of at least `min_requests` counted attempts, or after
//!   `consecutive_failures` failures in a row.
//! - **Open** until `break_duration` has passed: nothing is admitted and no retry is allowed.
//! - **Half-open**: at most `half_open_probes` probes at once. A probe success closes the breaker
//!   with an empty window; a probe failure opens it for another `break_duration`. A probe that
//!   ends [`NotCounted`](AttemptResult::NotCounted), or whose permit is dropped unrecorded, frees
//!   its place and decides nothing.
//!
//! Open becomes half-open by time alone: nothing needs to run when the break ends, and the next
//! call with a later `now` sees it.
//!
//! ## Transitions
//! The call that moves the state reports it, once, as a [`BreakerTransition`]:
//! [`BreakerPermit::record`] (and [`Breaker::record`]) return the opening, the closing or the
//! reopening they made, and [`BreakerPermit::transition`] says whether this permit is the first
//! probe of a half-open period (so the half-open state is reported when it first admits a probe,
//! not when the break ends). Of callers racing to move the state, only the one whose
//! compare-exchange won reports it, so a log line or a counter fed from these sees each change
//! exactly once. The breaker itself logs nothing.
//!
//! ## The state in atomics
//! Every attempt asks the breaker first, so admission is lock-free. The whole state machine is
//! one `AtomicU64`: a tripped bit, the probes in flight (16 bits) and the end of the break in
//! whole milliseconds (47 bits, enough for any [`Timestamp`]). The end of the break is rounded up
//! to the millisecond, so a break lasts at least `break_duration` and less than 1 ms more. One
//! compare-exchange moves the state, so two callers can never both take the last probe place,
//! and the end of the break also names the half-open period a probe belongs to: a probe from an
//! earlier period finds a different value and changes nothing. Each new break ends strictly
//! later than the one before (the closed state keeps the last end), so those names never repeat.
//!
//! The window is 10 slices of `window / 10` aligned to the clock's zero, like the ratio budget's:
//! one packed `AtomicU64` (slice number, count) per slice for successes and one for failures, so
//! a count lands in one compare-exchange. A slice counts for 0.9–1.0 × `window`. The counts are
//! statistics, not invariants: an attempt recorded at the very moment the breaker changes state
//! may count in the period on either side of the change. Nothing racing can admit an extra probe.

use crate::error::ConfigError;
use std::fmt;
use std::time::Duration;

use crate::budget::window::{SLICES, Window};
use crate::clock::{Timestamp, duration_nanos};
use crate::decimal::Fraction;
use crate::sync::{Arc, AtomicU64, Ordering};

const NANOS_PER_MS: u64 = 1_000_000;
const MAX_PROBES: u64 = 1_000;

// The state word: | tripped: 1 | probes in flight: 16 | break end, ms: 47 |.
const TRIPPED: u64 = 1 << 63;
const PROBE_SHIFT: u32 = 47;
const PROBE_ONE: u64 = 1 << PROBE_SHIFT;
const PROBE_MASK: u64 = 0xFFFF << PROBE_SHIFT;
const UNTIL_MASK: u64 = PROBE_ONE - 1;

/// Parameters of a [`Breaker`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BreakerConfig {
    /// The share of counted attempts in the window that may fail: the breaker opens when
    /// `failures / total` is strictly more than this. A fraction in `[0, 1]`; `1` turns the ratio
    /// rule off. Default `0.5`.
    pub failure_ratio: Fraction,
    /// Counted attempts (successes plus failures) the window must hold before the ratio rule
    /// applies, so a handful of calls cannot open it. At least 1. Default 20.
    pub min_requests: u64,
    /// How far back the ratio looks: 10 slices of `window / 10`, so an attempt counts for 0.9–1.0
    /// × `window`. 1 s to 300 s. Default 10 s.
    pub window: Duration,
    /// Open after this many failures in a row (in the order they are recorded), whatever the
    /// ratio and the throughput. At least 1, or `None` to rely on the ratio alone. Default
    /// `Some(10)`.
    ///
    /// This is what opens the breaker for a dead upstream at low traffic, where the window never
    /// reaches `min_requests`, and what opens it at once when a busy upstream dies, before the
    /// failures outnumber the successes still in the window. It also opens by chance: at an
    /// error rate `e` a run of `n` starts at about `(1 − e) × e^n` of attempts. At 20 % errors
    /// (well under the default ratio) and 1 000 attempts/s, `n = 5` opens every few seconds;
    /// `n = 10` about once in three hours. Hence 10 rather than the 5 some proxies use.
    pub consecutive_failures: Option<u64>,
    /// How long the breaker stays open before it lets probes through. 1 ms to 1 h, rounded up to
    /// the millisecond. Default 5 s.
    pub break_duration: Duration,
    /// Probes allowed through at once while half-open. 1 to 1 000. Default 1.
    pub half_open_probes: u64,
}

impl Default for BreakerConfig {
    fn default() -> Self {
        BreakerConfig {
            failure_ratio: Fraction::from_millionths(500_000),
            min_requests: 20,
            window: Duration::from_secs(10),
            consecutive_failures: Some(10),
            break_duration: Duration::from_secs(5),
            half_open_probes: 1,
        }
    }
}

impl BreakerConfig {
    /// Checks every rule, returning the first broken one.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.failure_ratio > Fraction::ONE {
            return Err(ConfigError::NotAFraction {
                key: "failure_ratio",
                of: "",
                max: "1".into(),
                got: self.failure_ratio.to_string(),
            });
        }
        if self.min_requests == 0 {
            return Err(ConfigError::Zero { key: "min_requests" });
        }
        if self.window < Duration::from_secs(1) || self.window > Duration::from_secs(300) {
            return Err(ConfigError::OutOfRange {
                key: "window",
                min: "1s".into(),
                max: "300s".into(),
                got: format!("{:?}", self.window),
            });
        }
        if self.consecutive_failures == Some(0) {
            return Err(ConfigError::Zero { key: "consecutive_failures" });
        }
        if self.break_duration < Duration::from_millis(1)
            || self.break_duration > Duration::from_secs(3_600)
        {
            return Err(ConfigError::OutOfRange {
                key: "break_duration",
                min: "1ms".into(),
                max: "1h".into(),
                got: format!("{:?}", self.break_duration),
            });
        }
        if self.half_open_probes == 0 || self.half_open_probes > MAX_PROBES {
            return Err(ConfigError::OutOfRange {
                key: "half_open_probes",
                min: "1".into(),
                max: MAX_PROBES.to_string(),
                got: self.half_open_probes.to_string(),
            });
        }
        Ok(())
    }
}

/// How an attempt ended, as the breaker counts it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(rename_all = "kebab-case"))]
pub enum AttemptResult {
    /// The upstream answered with something other than a server failure (2xx, 3xx).
    Success,
    /// The attempt reached the upstream and failed: connect failure, reset, per-try timeout or
    /// 5xx. Counts against the upstream.
    UpstreamFailure,
    /// Says nothing about the upstream's health: a 4xx (429 included), or a local refusal
    /// (budget, cap, queue, deadline). Never counts.
    NotCounted,
}

impl AttemptResult {
    /// What the breaker counts of an attempt that ended as `failure` (`None`: a success): the
    /// dependency's own failures
    /// ([`AttemptFailure::counts_for_breaker`](crate::conditions::AttemptFailure::counts_for_breaker)),
    /// never a caller's 4xx, a 429 or a refused stream. The one reading every placement's probe
    /// is recorded with.
    pub fn of(failure: Option<crate::conditions::AttemptFailure>) -> AttemptResult {
        match failure {
            None => AttemptResult::Success,
            Some(f) if f.counts_for_breaker() => AttemptResult::UpstreamFailure,
            Some(_) => AttemptResult::NotCounted,
        }
    }
}

/// What the breaker does now.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BreakerState {
    /// Attempts and retries are admitted; failures are counted.
    Closed,
    /// Nothing is admitted and no retry is allowed before `until`.
    Open {
        /// When the break ends and probes may start.
        until: Timestamp,
    },
    /// A bounded number of probes may go through to test the upstream.
    HalfOpen,
}

impl BreakerState {
    /// The lowercase name used in metrics and logs: `closed`, `open` or `half-open`.
    pub fn as_str(self) -> &'static str {
        match self {
            BreakerState::Closed => "closed",
            BreakerState::Open { .. } => "open",
            BreakerState::HalfOpen => "half-open",
        }
    }
}

/// A change of state, reported by the one call that made it (see "Transitions" in the
/// [module docs](self)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BreakerTransition {
    /// Closed → open: the failures passed the threshold. Nothing is admitted before `until`.
    Opened {
        /// When the break ends and probes may start.
        until: Timestamp,
    },
    /// Open → half-open: the break ended and the first probe of the period was admitted.
    HalfOpened,
    /// Half-open → closed: a probe succeeded.
    Closed,
    /// Half-open → open: a probe failed. Nothing is admitted before `until`.
    Reopened {
        /// When the new break ends.
        until: Timestamp,
    },
}

impl BreakerTransition {
    /// The state the breaker moved to.
    pub fn state(self) -> BreakerState {
        match self {
            BreakerTransition::Opened { until } | BreakerTransition::Reopened { until } => {
                BreakerState::Open { until }
            }
            BreakerTransition::HalfOpened => BreakerState::HalfOpen,
            BreakerTransition::Closed => BreakerState::Closed,
        }
    }

    /// `closed -> open`, `open -> half-open`, `half-open -> closed` or `half-open -> open`.
    pub fn as_str(self) -> &'static str {
        match self {
            BreakerTransition::Opened { .. } => "closed -> open",
            BreakerTransition::HalfOpened => "open -> half-open",
            BreakerTransition::Closed => "half-open -> closed",
            BreakerTransition::Reopened { .. } => "half-open -> open",
        }
    }
}

impl fmt::Display for BreakerTransition {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An attempt was refused by the breaker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, thiserror::Error)]
pub enum BreakerOpen {
    /// The breaker is open: fail fast until `until`.
    #[error("circuit breaker open until {until:?}")]
    Open {
        /// When the break ends and probes may start.
        until: Timestamp,
    },
    /// The breaker is half-open and every probe place is taken.
    #[error("circuit breaker half-open with its probes in use")]
    ProbesInUse,
}

/// The circuit breaker for one key. See the [module docs](self).
///
/// Shared by every caller of the key; clones share one state.
#[derive(Debug, Clone)]
pub struct Breaker {
    shared: Arc<Shared>,
}

#[derive(Debug)]
struct Shared {
    config: BreakerConfig,
    slice_nanos: u64,
    break_nanos: u64,
    /// See "The state in atomics" in the module docs.
    state: AtomicU64,
    /// Failures recorded in a row since the last success.
    run: AtomicU64,
    /// The end of the last break (ms) whose half-open period has admitted a probe: the first
    /// probe of each period reports [`BreakerTransition::HalfOpened`].
    half_opened: AtomicU64,
    successes: Window,
    failures: Window,
}

/// The admission of one attempt. Record how it ended with [`record`](BreakerPermit::record).
///
/// In the half-open state the permit holds one of the probe places until it is recorded or
/// dropped; a dropped probe permit frees its place without counting.
#[must_use = "record the attempt's result; dropping a probe permit frees its place"]
#[derive(Debug)]
pub struct BreakerPermit {
    shared: Arc<Shared>,
    kind: Kind,
    /// The first probe of its half-open period.
    first_probe: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// Admitted while closed: its result counts if the breaker is still closed.
    Closed,
    /// A probe of the half-open period whose break ended at `until` (ms).
    Probe { until: u64 },
    /// Recorded already; nothing left to release.
    Done,
}

fn tripped(word: u64) -> bool {
    word & TRIPPED != 0
}

fn probes(word: u64) -> u64 {
    (word & PROBE_MASK) >> PROBE_SHIFT
}

fn until_ms(word: u64) -> u64 {
    word & UNTIL_MASK
}

impl Breaker {
    /// Builds a closed breaker, refusing invalid parameters.
    pub fn try_new(config: BreakerConfig) -> Result<Breaker, ConfigError> {
        config.validate()?;
        Ok(Breaker {
            shared: Arc::new(Shared {
                config,
                slice_nanos: (duration_nanos(config.window) / SLICES as u64).max(1),
                break_nanos: duration_nanos(config.break_duration),
                state: AtomicU64::new(0),
                run: AtomicU64::new(0),
                half_opened: AtomicU64::new(0),
                successes: Window::new(),
                failures: Window::new(),
            }),
        })
    }

    /// The parameters it was built with.
    pub fn config(&self) -> &BreakerConfig {
        &self.shared.config
    }

    /// Asks to send one attempt now. Closed: always admitted. Open: refused. Half-open: admitted
    /// as a probe while fewer than `half_open_probes` probes are in flight.
    pub fn try_acquire(&self, now: Timestamp) -> Result<BreakerPermit, BreakerOpen> {
        let shared = &self.shared;
        // Acquire pairs with the Release of the compare-exchange that closed the breaker, so an
        // attempt admitted after a close counts into the window the close emptied, never into
        // the counts it cleared.
        let mut word = shared.state.load(Ordering::Acquire);
        loop {
            if !tripped(word) {
                return Ok(self.permit(Kind::Closed));
            }
            shared.refusal(word, now)?;
            // The probe count lives in the same word as the period it belongs to: of two callers
            // racing for the last place, only one moves the word from this value.
            match shared.state.compare_exchange_weak(
                word,
                word + PROBE_ONE,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => {
                    let until = until_ms(word);
                    // Break ends only grow, so each period is reported once. Relaxed: the
                    // value orders nothing else.
                    let first = shared.half_opened.fetch_max(until, Ordering::Relaxed) < until;
                    let mut permit = self.permit(Kind::Probe { until });
                    permit.first_probe = first;
                    return Ok(permit);
                }
                Err(actual) => word = actual,
            }
        }
    }

    fn permit(&self, kind: Kind) -> BreakerPermit {
        BreakerPermit { shared: Arc::clone(&self.shared), kind, first_probe: false }
    }

    /// Records an attempt sent without a permit. Counts only while the breaker is closed; in the
    /// other states the attempt should not have been sent, and it decides nothing. Returns the
    /// opening when this record tripped the breaker.
    pub fn record(&self, now: Timestamp, result: AttemptResult) -> Option<BreakerTransition> {
        self.shared.record_closed(now, result)
    }

    /// The state now.
    pub fn state(&self, now: Timestamp) -> BreakerState {
        // Acquire, as in `try_acquire`; a report needs nothing stronger.
        let word = self.shared.state.load(Ordering::Acquire);
        if !tripped(word) {
            BreakerState::Closed
        } else if now.as_nanos() < break_end_nanos(word) {
            BreakerState::Open { until: Timestamp::from_millis(until_ms(word)) }
        } else {
            BreakerState::HalfOpen
        }
    }

    /// Whether a retry may be sent now as far as the breaker is concerned: not while open, nor
    /// while half-open with every probe place taken (the retry decision's `breaker` step). A
    /// retry that goes ahead still calls [`try_acquire`](Self::try_acquire), which may refuse it.
    pub fn allows_retry(&self, now: Timestamp) -> bool {
        let word = self.shared.state.load(Ordering::Acquire);
        !tripped(word) || self.shared.refusal(word, now).is_ok()
    }
}

/// When the break stored in `word` ends, in nanoseconds.
fn break_end_nanos(word: u64) -> u64 {
    until_ms(word).saturating_mul(NANOS_PER_MS)
}

impl Shared {
    /// Why a tripped breaker refuses an attempt now, if it does.
    fn refusal(&self, word: u64, now: Timestamp) -> Result<(), BreakerOpen> {
        if now.as_nanos() < break_end_nanos(word) {
            Err(BreakerOpen::Open { until: Timestamp::from_millis(until_ms(word)) })
        } else if probes(word) >= self.config.half_open_probes {
            Err(BreakerOpen::ProbesInUse)
        } else {
            Ok(())
        }
    }

    /// The end of a break that starts at `now`, in ms: rounded up, and always after `previous`
    /// (the end of the last break), so each half-open period has its own name.
    fn break_end(&self, now: Timestamp, previous: u64) -> u64 {
        let end = now.as_nanos().saturating_add(self.break_nanos).div_ceil(NANOS_PER_MS);
        end.max(previous.saturating_add(1)).min(UNTIL_MASK)
    }

    fn slice(&self, now: Timestamp) -> (usize, u32) {
        crate::budget::window::slice(now, self.slice_nanos)
    }

    fn record_closed(&self, now: Timestamp, result: AttemptResult) -> Option<BreakerTransition> {
        if result == AttemptResult::NotCounted {
            return None;
        }
        let word = self.state.load(Ordering::Acquire);
        if tripped(word) {
            return None;
        }
        let (idx, tag) = self.slice(now);
        match result {
            AttemptResult::Success => {
                self.successes.add(idx, tag, 1);
                // Relaxed: the run is a heuristic over completion order, which concurrency
                // blurs anyway; nothing else is published through it.
                self.run.store(0, Ordering::Relaxed);
            }
            AttemptResult::UpstreamFailure => {
                self.failures.add(idx, tag, 1);
                let run = self.run.fetch_add(1, Ordering::Relaxed).saturating_add(1);
                if self.should_trip(run, tag) {
                    return self.trip(now, word);
                }
            }
            AttemptResult::NotCounted => {}
        }
        None
    }

    fn should_trip(&self, run: u64, current: u32) -> bool {
        if self.config.consecutive_failures.is_some_and(|n| run >= n) {
            return true;
        }
        let failures = self.failures.sum(current);
        let total = failures.saturating_add(self.successes.sum(current));
        total >= self.config.min_requests
            && u128::from(failures) * u128::from(Fraction::ONE_MILLIONTHS)
                > u128::from(total) * u128::from(self.config.failure_ratio.millionths())
    }

    /// Opens a closed breaker, unless a racing caller already changed its state; the opening
    /// when this call made it.
    fn trip(&self, now: Timestamp, closed: u64) -> Option<BreakerTransition> {
        let until = self.break_end(now, until_ms(closed));
        // One winner: a caller that lost the race finds the breaker tripped already.
        self.state
            .compare_exchange(closed, TRIPPED | until, Ordering::AcqRel, Ordering::Acquire)
            .ok()
            .map(|_| BreakerTransition::Opened { until: Timestamp::from_millis(until) })
    }

    /// Applies a probe's result to the half-open period that ended its break at `until`. A probe
    /// of an earlier period changes nothing. Returns the closing or reopening it made.
    fn finish_probe(
        &self,
        now: Timestamp,
        until: u64,
        result: AttemptResult,
    ) -> Option<BreakerTransition> {
        let mut word = self.state.load(Ordering::Acquire);
        let mut cleared = false;
        loop {
            if !tripped(word) || until_ms(word) != until || probes(word) == 0 {
                return None;
            }
            let next = match result {
                AttemptResult::Success => {
                    if !cleared {
                        // Empty the window before the close is published: the close's Release
                        // makes these stores visible to every caller that sees it closed.
                        self.clear();
                        cleared = true;
                    }
                    // Closed, keeping the last break's end so the next one ends later.
                    until
                }
                AttemptResult::UpstreamFailure => TRIPPED | self.break_end(now, until),
                AttemptResult::NotCounted => word - PROBE_ONE,
            };
            match self.state.compare_exchange_weak(word, next, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => {
                    return match result {
                        AttemptResult::Success => Some(BreakerTransition::Closed),
                        AttemptResult::UpstreamFailure => Some(BreakerTransition::Reopened {
                            until: Timestamp::from_millis(until_ms(next)),
                        }),
                        AttemptResult::NotCounted => None,
                    };
                }
                Err(actual) => word = actual,
            }
        }
    }

    /// Forgets every count: the window and the run.
    fn clear(&self) {
        // Relaxed: published by the Release of the compare-exchange that closes the breaker.
        self.successes.reset();
        self.failures.reset();
        self.run.store(0, Ordering::Relaxed);
    }
}

impl BreakerPermit {
    /// Whether this permit holds a half-open probe place.
    pub fn is_probe(&self) -> bool {
        matches!(self.kind, Kind::Probe { .. })
    }

    /// [`BreakerTransition::HalfOpened`] when this permit is the first probe of its half-open
    /// period (its admission is when the breaker was first seen half-open), else `None`.
    pub fn transition(&self) -> Option<BreakerTransition> {
        self.first_probe.then_some(BreakerTransition::HalfOpened)
    }

    /// Records how the attempt ended. Admitted while closed, it counts if the breaker is still
    /// closed. A probe: a success closes the breaker, an upstream failure opens it for another
    /// `break_duration`, and [`NotCounted`](AttemptResult::NotCounted) frees its place and
    /// decides nothing. Returns the change of state this record made, if it made one (of racing
    /// records, only the one that made it reports it).
    pub fn record(mut self, now: Timestamp, result: AttemptResult) -> Option<BreakerTransition> {
        match std::mem::replace(&mut self.kind, Kind::Done) {
            Kind::Closed => self.shared.record_closed(now, result),
            Kind::Probe { until } => self.shared.finish_probe(now, until, result),
            Kind::Done => None,
        }
    }
}

impl Drop for BreakerPermit {
    fn drop(&mut self) {
        if let Kind::Probe { until } = self.kind {
            // The time is only used to start a new break, which NotCounted never does.
            self.shared.finish_probe(Timestamp::ZERO, until, AttemptResult::NotCounted);
        }
    }
}

impl fmt::Display for BreakerState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(all(test, not(stormguard_loom)))]
mod tests {
    use super::*;
    use std::sync::Barrier;
    use std::thread;

    const FAIL: AttemptResult = AttemptResult::UpstreamFailure;
    const OK: AttemptResult = AttemptResult::Success;
    const SKIP: AttemptResult = AttemptResult::NotCounted;

    fn ms(n: u64) -> Timestamp {
        Timestamp::from_millis(n)
    }

    fn breaker(f: impl FnOnce(&mut BreakerConfig)) -> Breaker {
        let mut c = BreakerConfig::default();
        f(&mut c);
        Breaker::try_new(c).unwrap()
    }

    fn attempts(b: &Breaker, now: Timestamp, n: u64, result: AttemptResult) {
        for _ in 0..n {
            b.try_acquire(now).unwrap().record(now, result);
        }
    }

    /// Trips `b` at `now` with consecutive failures (it must have the rule on).
    fn trip(b: &Breaker, now: Timestamp) {
        let n = b.config().consecutive_failures.unwrap();
        attempts(b, now, n, FAIL);
        assert!(matches!(b.state(now), BreakerState::Open { .. }));
    }

    #[test]
    fn is_send_and_sync() {
        fn check<T: Send + Sync + 'static>() {}
        check::<Breaker>();
        check::<BreakerPermit>();
    }

    #[test]
    fn four_xx_and_local_refusals_never_open_it() {
        // Both rules armed and low: five failures in a row, or over half of five attempts.
        let b = breaker(|c| {
            c.min_requests = 5;
            c.consecutive_failures = Some(5);
        });
        for i in 0..10_000 {
            attempts(&b, ms(i), 1, SKIP);
            b.record(ms(i), SKIP);
            assert!(b.allows_retry(ms(i)));
        }
        assert_eq!(b.state(ms(10_000)), BreakerState::Closed);
        // A fraction of that many upstream failures does.
        attempts(&b, ms(10_000), 5, FAIL);
        assert!(matches!(b.state(ms(10_000)), BreakerState::Open { .. }));
    }

    #[test]
    fn not_counted_neither_breaks_nor_extends_a_run() {
        let b = breaker(|c| c.consecutive_failures = Some(3));
        attempts(&b, ms(0), 2, FAIL);
        attempts(&b, ms(0), 100, SKIP);
        assert_eq!(b.state(ms(0)), BreakerState::Closed);
        attempts(&b, ms(0), 1, FAIL); // the 4xx between did not reset the run
        assert!(matches!(b.state(ms(0)), BreakerState::Open { .. }));
    }

    #[test]
    fn ratio_opening_needs_min_requests() {
        let b = breaker(|c| c.consecutive_failures = None);
        // 19 failures: a 100 % failure ratio, but under the minimum throughput.
        attempts(&b, ms(0), 19, FAIL);
        assert_eq!(b.state(ms(0)), BreakerState::Closed);
        attempts(&b, ms(0), 1, FAIL);
        assert_eq!(b.state(ms(0)), BreakerState::Open { until: ms(5_000) });
    }

    #[test]
    fn ratio_must_be_passed_not_reached() {
        let b = breaker(|c| c.consecutive_failures = None);
        // Alternate: exactly half fail, never more.
        for _ in 0..50 {
            attempts(&b, ms(0), 1, OK);
            attempts(&b, ms(0), 1, FAIL);
        }
        assert_eq!(b.state(ms(0)), BreakerState::Closed);
        attempts(&b, ms(0), 1, FAIL); // 51 of 101
        assert!(matches!(b.state(ms(0)), BreakerState::Open { .. }));
    }

    #[test]
    fn consecutive_failures_open_it_and_a_success_resets_the_run() {
        let b = breaker(|c| c.consecutive_failures = Some(5));
        // Under min_requests, so only the run can open it.
        attempts(&b, ms(0), 4, FAIL);
        attempts(&b, ms(0), 1, OK);
        attempts(&b, ms(0), 4, FAIL);
        assert_eq!(b.state(ms(0)), BreakerState::Closed);
        attempts(&b, ms(0), 1, FAIL);
        assert!(matches!(b.state(ms(0)), BreakerState::Open { .. }));
        // Without the rule, the same run leaves it closed.
        let b = breaker(|c| c.consecutive_failures = None);
        attempts(&b, ms(0), 10, FAIL);
        assert_eq!(b.state(ms(0)), BreakerState::Closed);
    }

    #[test]
    fn open_refuses_until_the_break_has_passed() {
        let b = breaker(|_| {});
        trip(&b, ms(1_000));
        let open = BreakerOpen::Open { until: ms(6_000) };
        for t in [1_000, 3_000, 5_999] {
            assert_eq!(b.try_acquire(ms(t)).unwrap_err(), open);
            assert!(!b.allows_retry(ms(t)));
            assert_eq!(b.state(ms(t)), BreakerState::Open { until: ms(6_000) });
        }
        // Plain records while open change nothing.
        b.record(ms(5_999), OK);
        assert_eq!(b.try_acquire(Timestamp::from_nanos(5_999_999_999)).unwrap_err(), open);
        assert_eq!(b.state(ms(6_000)), BreakerState::HalfOpen);
        assert!(b.allows_retry(ms(6_000)));
        assert!(b.try_acquire(ms(6_000)).unwrap().is_probe());
    }

    #[test]
    fn break_end_is_rounded_up_to_the_millisecond() {
        let b = breaker(|c| c.break_duration = Duration::from_millis(10));
        trip(&b, Timestamp::from_nanos(1_000_001));
        // 1.000001 ms + 10 ms ends at 12 ms, not at 11 ms.
        assert_eq!(b.state(ms(11)), BreakerState::Open { until: ms(12) });
        assert_eq!(b.state(ms(12)), BreakerState::HalfOpen);
    }

    #[test]
    fn half_open_admits_exactly_the_probe_count() {
        let b = breaker(|c| c.half_open_probes = 3);
        trip(&b, ms(0));
        let t = ms(5_000);
        let probes: Vec<_> = (0..3).map(|_| b.try_acquire(t).unwrap()).collect();
        assert!(probes.iter().all(BreakerPermit::is_probe));
        assert_eq!(b.try_acquire(t).unwrap_err(), BreakerOpen::ProbesInUse);
        assert!(!b.allows_retry(t));
        assert_eq!(b.state(t), BreakerState::HalfOpen);
        // A dropped probe frees its place without deciding anything.
        let mut probes = probes;
        drop(probes.pop());
        assert_eq!(b.state(t), BreakerState::HalfOpen);
        assert!(b.allows_retry(t));
        let again = b.try_acquire(t).unwrap();
        assert_eq!(b.try_acquire(t).unwrap_err(), BreakerOpen::ProbesInUse);
        // So does a probe that ends not counted (a 4xx says nothing of the upstream).
        again.record(t, SKIP);
        assert_eq!(b.state(t), BreakerState::HalfOpen);
        assert!(b.try_acquire(t).is_ok());
    }

    #[test]
    fn a_probe_success_closes_it_with_an_empty_window() {
        let b = breaker(|c| c.consecutive_failures = None);
        attempts(&b, ms(0), 20, FAIL);
        let probe = b.try_acquire(ms(5_000)).unwrap();
        let other = b.try_acquire(ms(5_000));
        assert!(other.is_err(), "one probe by default");
        probe.record(ms(5_000), OK);
        assert_eq!(b.state(ms(5_000)), BreakerState::Closed);
        // The 20 failures of the last window are forgotten: one more failure, with the ratio
        // at 100 % again, does not reach min_requests.
        attempts(&b, ms(5_001), 1, FAIL);
        assert_eq!(b.state(ms(5_001)), BreakerState::Closed);
        let p = b.try_acquire(ms(5_001)).unwrap();
        assert!(!p.is_probe());
        p.record(ms(5_001), OK);
    }

    #[test]
    fn a_probe_failure_reopens_it_for_another_break() {
        let b = breaker(|c| c.half_open_probes = 2);
        trip(&b, ms(0));
        let first = b.try_acquire(ms(5_000)).unwrap();
        let second = b.try_acquire(ms(5_000)).unwrap();
        first.record(ms(5_500), FAIL);
        assert_eq!(b.state(ms(5_500)), BreakerState::Open { until: ms(10_500) });
        assert!(b.try_acquire(ms(10_499)).is_err());
        // The other probe of that period is stale: its success does not close the new break.
        second.record(ms(5_600), OK);
        assert_eq!(b.state(ms(5_600)), BreakerState::Open { until: ms(10_500) });
        // Then half-open again, with both places free.
        let a = b.try_acquire(ms(10_500)).unwrap();
        let c = b.try_acquire(ms(10_500)).unwrap();
        assert!(b.try_acquire(ms(10_500)).is_err());
        c.record(ms(10_600), OK);
        assert_eq!(b.state(ms(10_600)), BreakerState::Closed);
        // A stale probe's failure does not reopen a closed breaker either.
        a.record(ms(10_700), FAIL);
        assert_eq!(b.state(ms(10_700)), BreakerState::Closed);
    }

    #[test]
    fn a_stale_probe_from_an_earlier_period_cannot_free_a_place() {
        let b = breaker(|c| c.half_open_probes = 2);
        trip(&b, ms(0));
        let stale = b.try_acquire(ms(5_000)).unwrap();
        b.try_acquire(ms(5_000)).unwrap().record(ms(5_000), OK); // closes
        trip(&b, ms(5_000)); // a new break, ending at 10 s
        let held: Vec<_> = (0..2).map(|_| b.try_acquire(ms(10_000)).unwrap()).collect();
        drop(stale);
        assert_eq!(b.try_acquire(ms(10_000)).unwrap_err(), BreakerOpen::ProbesInUse);
        drop(held);
    }

    #[test]
    fn permits_admitted_while_closed_do_not_decide_a_half_open_breaker() {
        let b = breaker(|_| {});
        let late = b.try_acquire(ms(0)).unwrap();
        trip(&b, ms(0));
        late.record(ms(5_000), OK);
        assert_eq!(b.state(ms(5_000)), BreakerState::HalfOpen);
        b.record(ms(5_000), OK);
        assert_eq!(b.state(ms(5_000)), BreakerState::HalfOpen);
    }

    #[test]
    fn the_window_forgets_old_failures() {
        let b = breaker(|c| c.consecutive_failures = None);
        attempts(&b, ms(0), 19, FAIL);
        // 11 s later the 19 failures are out of the 10 s window: 19 more stay under 20.
        attempts(&b, ms(11_000), 19, FAIL);
        assert_eq!(b.state(ms(11_000)), BreakerState::Closed);
        // Inside the window they add up.
        let b = breaker(|c| c.consecutive_failures = None);
        attempts(&b, ms(0), 19, FAIL);
        attempts(&b, ms(9_000), 1, FAIL);
        assert!(matches!(b.state(ms(9_000)), BreakerState::Open { .. }));
    }

    #[test]
    fn old_successes_stop_diluting_new_failures() {
        let b = breaker(|c| c.consecutive_failures = None);
        attempts(&b, ms(0), 100, OK);
        attempts(&b, ms(5_000), 30, FAIL);
        assert_eq!(b.state(ms(5_000)), BreakerState::Closed); // 30 of 130
        attempts(&b, ms(10_500), 1, FAIL); // the successes aged out: 31 of 31
        assert!(matches!(b.state(ms(10_500)), BreakerState::Open { .. }));
    }

    #[test]
    fn refuses_bad_parameters() {
        let bad = |f: fn(&mut BreakerConfig), word: &str| {
            let mut c = BreakerConfig::default();
            f(&mut c);
            let err = Breaker::try_new(c).unwrap_err();
            assert_eq!(err.key(), word, "{err}");
        };
        bad(|c| c.failure_ratio = Fraction::from_millionths(1_000_001), "failure_ratio");
        bad(|c| c.min_requests = 0, "min_requests");
        bad(|c| c.window = Duration::from_millis(999), "window");
        bad(|c| c.window = Duration::from_secs(301), "window");
        bad(|c| c.consecutive_failures = Some(0), "consecutive_failures");
        bad(|c| c.break_duration = Duration::ZERO, "break_duration");
        bad(|c| c.break_duration = Duration::from_secs(3_601), "break_duration");
        bad(|c| c.half_open_probes = 0, "half_open_probes");
        bad(|c| c.half_open_probes = 1_001, "half_open_probes");
        assert!(BreakerConfig::default().validate().is_ok());
        let message = |f: fn(&mut BreakerConfig)| {
            let mut c = BreakerConfig::default();
            f(&mut c);
            c.validate().unwrap_err().to_string()
        };
        assert_eq!(message(|c| c.min_requests = 0), "min_requests must be at least 1");
        assert_eq!(
            message(|c| c.consecutive_failures = Some(0)),
            "consecutive_failures must be at least 1 (or none)"
        );
        assert_eq!(
            message(|c| c.window = Duration::from_secs(301)),
            "window must be between 1s and 300s, got 301s"
        );
    }

    #[test]
    fn half_open_never_admits_more_than_its_probes_across_threads() {
        const THREADS: usize = 8;
        const PROBES: u64 = 2;
        let b = breaker(|c| c.half_open_probes = PROBES);
        trip(&b, ms(0));
        let t = ms(5_000);
        let in_flight = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let peak = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let admitted = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let barrier = Arc::new(Barrier::new(THREADS));
        let handles: Vec<_> = (0..THREADS)
            .map(|_| {
                let (b, in_flight, peak, admitted, barrier) =
                    (b.clone(), in_flight.clone(), peak.clone(), admitted.clone(), barrier.clone());
                thread::spawn(move || {
                    use std::sync::atomic::Ordering::SeqCst;
                    barrier.wait();
                    for i in 0..20_000 {
                        let Ok(permit) = b.try_acquire(t) else {
                            continue;
                        };
                        let now = in_flight.fetch_add(1, SeqCst) + 1;
                        peak.fetch_max(now, SeqCst);
                        admitted.fetch_add(1, SeqCst);
                        thread::yield_now();
                        in_flight.fetch_sub(1, SeqCst);
                        if i % 2 == 0 {
                            drop(permit);
                        } else {
                            permit.record(t, SKIP);
                        }
                    }
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
        use std::sync::atomic::Ordering::SeqCst;
        let peak = peak.load(SeqCst);
        assert!(peak <= PROBES, "{peak} probes in flight at once");
        assert!(admitted.load(SeqCst) > 0);
        // Every place came back.
        let all: Vec<_> = (0..PROBES).map(|_| b.try_acquire(t).unwrap()).collect();
        assert_eq!(b.try_acquire(t).unwrap_err(), BreakerOpen::ProbesInUse);
        drop(all);
    }

    #[test]
    fn concurrent_probe_results_decide_once() {
        // Many probes of one period finish at once, half failing: the breaker ends closed or
        // open, never with places leaked or a probe counted twice.
        for _ in 0..200 {
            let b = breaker(|c| c.half_open_probes = 8);
            trip(&b, ms(0));
            let t = ms(5_000);
            let permits: Vec<_> = (0..8).map(|_| b.try_acquire(t).unwrap()).collect();
            let barrier = Arc::new(Barrier::new(8));
            let handles: Vec<_> = permits
                .into_iter()
                .enumerate()
                .map(|(i, p)| {
                    let barrier = barrier.clone();
                    thread::spawn(move || {
                        barrier.wait();
                        p.record(t, if i % 2 == 0 { OK } else { FAIL });
                    })
                })
                .collect();
            for h in handles {
                h.join().unwrap();
            }
            match b.state(t) {
                BreakerState::Closed => assert!(b.try_acquire(t).is_ok_and(|p| !p.is_probe())),
                BreakerState::Open { until } => {
                    assert_eq!(until, ms(10_000));
                    let p: Vec<_> = (0..8).map(|_| b.try_acquire(until).unwrap()).collect();
                    assert!(b.try_acquire(until).is_err());
                    drop(p);
                }
                BreakerState::HalfOpen => panic!("a probe result was lost"),
            }
        }
    }

    /// Each change of state is reported once, by the call that made it: the trip, the first
    /// probe of a half-open period (not the second), a probe's failure and a probe's success.
    #[test]
    fn each_transition_is_reported_once_by_the_call_that_made_it() {
        let b = breaker(|c| {
            c.consecutive_failures = Some(3);
            c.half_open_probes = 2;
        });
        let t = ms(1_000);
        let reports: Vec<_> =
            (0..5).map(|_| b.try_acquire(t).map_or(None, |p| p.record(t, FAIL))).collect();
        // The third failure trips it; the last two were refused (open), reporting nothing.
        assert_eq!(
            reports,
            [None, None, Some(BreakerTransition::Opened { until: ms(6_000) }), None, None]
        );
        // The break ends: the first probe reports half-open, the second does not.
        let first = b.try_acquire(ms(6_000)).unwrap();
        let second = b.try_acquire(ms(6_000)).unwrap();
        assert_eq!(first.transition(), Some(BreakerTransition::HalfOpened));
        assert_eq!(second.transition(), None);
        assert_eq!(
            first.record(ms(6_001), FAIL),
            Some(BreakerTransition::Reopened { until: ms(11_001) })
        );
        // A probe of the period that just ended reports nothing.
        assert_eq!(second.record(ms(6_002), FAIL), None);
        let probe = b.try_acquire(ms(11_001)).unwrap();
        assert_eq!(probe.transition(), Some(BreakerTransition::HalfOpened));
        // Given back unjudged, the place is free, and the next probe of the same period is no
        // longer the first.
        assert_eq!(probe.record(ms(11_001), SKIP), None);
        let probe = b.try_acquire(ms(11_002)).unwrap();
        assert_eq!(probe.transition(), None);
        assert_eq!(probe.record(ms(11_003), OK), Some(BreakerTransition::Closed));
        assert_eq!(b.state(ms(11_003)), BreakerState::Closed);
        assert_eq!(BreakerTransition::Closed.to_string(), "half-open -> closed");
        assert_eq!(BreakerTransition::Opened { until: ms(1) }.state().as_str(), "open");
    }

    /// Of many callers failing at once, exactly one reports the trip.
    #[test]
    fn a_racing_trip_is_reported_by_one_caller() {
        let b = breaker(|c| c.consecutive_failures = Some(1));
        let start = Arc::new(Barrier::new(8));
        let permits: Vec<_> = (0..8).map(|_| b.try_acquire(ms(0)).unwrap()).collect();
        let handles: Vec<_> = permits
            .into_iter()
            .map(|p| {
                let start = start.clone();
                thread::spawn(move || {
                    start.wait();
                    p.record(ms(0), FAIL)
                })
            })
            .collect();
        let reports: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        assert_eq!(reports.iter().flatten().count(), 1, "{reports:?}");
    }
}

#[cfg(all(test, stormguard_loom))]
mod loom_tests {
    use super::*;

    /// Two callers race for one probe place while a third frees its own: never more than the
    /// configured probes hold places.
    #[test]
    fn probes_never_exceed_the_limit() {
        let mut model = loom::model::Builder::new();
        if model.preemption_bound.is_none() {
            model.preemption_bound = Some(3);
        }
        model.check(|| {
            let b = Breaker::try_new(BreakerConfig {
                consecutive_failures: Some(1),
                half_open_probes: 2,
                ..BreakerConfig::default()
            })
            .unwrap();
            b.record(Timestamp::ZERO, AttemptResult::UpstreamFailure);
            let t = Timestamp::from_millis(5_000);
            let held = b.try_acquire(t).unwrap();
            let in_flight = Arc::new(AtomicU64::new(1));
            let handles: Vec<_> = (0..2)
                .map(|_| {
                    let (b, in_flight) = (b.clone(), in_flight.clone());
                    loom::thread::spawn(move || {
                        if let Ok(p) = b.try_acquire(t) {
                            let n = in_flight.fetch_add(1, Ordering::SeqCst) + 1;
                            assert!(n <= 2);
                            in_flight.fetch_sub(1, Ordering::SeqCst);
                            drop(p);
                        }
                    })
                })
                .collect();
            in_flight.fetch_sub(1, Ordering::SeqCst);
            drop(held);
            for h in handles {
                h.join().unwrap();
            }
            assert!(b.try_acquire(t).is_ok());
        });
    }
}
