//! Counters of the retry decision: primaries, retries, and denials by reason.
//!
//! The retry fraction a budget alert needs is `retries / primaries`, computed where it is
//! queried (PromQL), from counters that add across instances. Denials are counted per
//! [`Denied`] reason; shadow mode (`enforce = false`) counts the denials it would have made in a
//! separate set, so a service's natural retry ratio can be measured before a budget is imposed.
//! The limiter's histograms and gauges are in [`LimiterSnapshot`](crate::limiter::LimiterSnapshot).

use crate::denied::Denied;
use crate::sync::{AtomicU64, Ordering};

/// The decision counters of one dependency (or route). Plain atomics; export them at the edge.
#[derive(Debug)]
pub struct Counters {
    primaries: AtomicU64,
    retries: AtomicU64,
    not_retryable: AtomicU64,
    succeeded: AtomicU64,
    primaries_refused: AtomicU64,
    abandoned: [AtomicU64; 2],
    hedges: AtomicU64,
    hedges_won: AtomicU64,
    hedge_denied: [AtomicU64; Denied::ALL.len()],
    denied: [AtomicU64; Denied::ALL.len()],
    shadow_denied: [AtomicU64; Denied::ALL.len()],
    caller_retries: [AtomicU64; CallerRetryOutcome::ALL.len()],
}

impl Default for Counters {
    fn default() -> Self {
        Counters {
            primaries: AtomicU64::new(0),
            retries: AtomicU64::new(0),
            not_retryable: AtomicU64::new(0),
            succeeded: AtomicU64::new(0),
            primaries_refused: AtomicU64::new(0),
            abandoned: std::array::from_fn(|_| AtomicU64::new(0)),
            hedges: AtomicU64::new(0),
            hedges_won: AtomicU64::new(0),
            hedge_denied: std::array::from_fn(|_| AtomicU64::new(0)),
            denied: std::array::from_fn(|_| AtomicU64::new(0)),
            shadow_denied: std::array::from_fn(|_| AtomicU64::new(0)),
            caller_retries: std::array::from_fn(|_| AtomicU64::new(0)),
        }
    }
}

/// A copy of the counters.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct CountersSnapshot {
    /// Original requests admitted (sent as a first attempt).
    pub primaries: u64,
    /// Retries sent.
    pub retries: u64,
    /// Failures whose condition is not in `retry_on` (not denials).
    pub not_retryable: u64,
    /// Original requests that ended in success (on their first try or a retry). With
    /// `primaries` and `primaries_refused` it gives the success rate callers saw.
    pub succeeded: u64,
    /// Original requests refused before reaching a slot (`queue`, `breaker`, `deadline`); they
    /// are also counted in `denied` by reason.
    pub primaries_refused: u64,
    /// Attempts whose caller went away while the dependency worked on them, by how they ended,
    /// indexed by [`Abandoned::index`]: the dependency answered within `abandon_hold`
    /// (`finished`), or the hold passed and the attempt was cut (`cut`).
    pub abandoned: [u64; 2],
    /// Hedges sent (a second attempt beside one not answered yet).
    pub hedges: u64,
    /// Hedges whose answer was the one the caller got.
    pub hedges_won: u64,
    /// Hedges refused by reason (the retry rules' reasons), indexed by [`Denied::index`]. Not
    /// in `denied`: a refused hedge leaves the first attempt running.
    pub hedge_denied: [u64; Denied::ALL.len()],
    /// Denials by reason, indexed by [`Denied::index`].
    pub denied: [u64; Denied::ALL.len()],
    /// Denials shadow mode would have made, indexed by [`Denied::index`].
    pub shadow_denied: [u64; Denied::ALL.len()],
    /// Retries a caller sent itself, seen through the sidecar, by what became of them, indexed
    /// by [`CallerRetryOutcome::index`]. An allowed one is also in `retries`, a refused one in
    /// `denied`.
    pub caller_retries: [u64; CallerRetryOutcome::ALL.len()],
}

/// What became of a retry the caller sent itself (see
/// [`RetryPolicy::decide_caller_retry`](crate::decision::RetryPolicy::decide_caller_retry)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CallerRetryOutcome {
    /// Charged to the budget and sent under the cap, as a retry.
    Allowed,
    /// Refused: no budget, no free slot, an open breaker or a pushback hold.
    Refused,
    /// Recognised and counted only (`caller_retries = "count"`): sent as a first try.
    Counted,
}

impl CallerRetryOutcome {
    /// Every outcome, in index order.
    pub const ALL: [CallerRetryOutcome; 3] =
        [CallerRetryOutcome::Allowed, CallerRetryOutcome::Refused, CallerRetryOutcome::Counted];

    /// Its index in [`CountersSnapshot::caller_retries`].
    pub fn index(self) -> usize {
        self as usize
    }

    /// The `outcome` label: `allowed`, `refused` or `counted`.
    pub fn as_str(self) -> &'static str {
        match self {
            CallerRetryOutcome::Allowed => "allowed",
            CallerRetryOutcome::Refused => "refused",
            CallerRetryOutcome::Counted => "counted",
        }
    }
}

/// How an abandoned attempt ended (its caller had gone away; the dependency was still working).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Abandoned {
    /// The dependency answered within the hold; its slot came back then.
    Finished,
    /// The hold passed first: the attempt was cut and its slot came back.
    Cut,
}

impl Abandoned {
    /// Both outcomes, in index order.
    pub const ALL: [Abandoned; 2] = [Abandoned::Finished, Abandoned::Cut];

    /// Its index in [`CountersSnapshot::abandoned`].
    pub fn index(self) -> usize {
        self as usize
    }

    /// The `outcome` label: `finished` or `cut`.
    pub fn as_str(self) -> &'static str {
        match self {
            Abandoned::Finished => "finished",
            Abandoned::Cut => "cut",
        }
    }
}

impl CountersSnapshot {
    /// Abandoned attempts that ended so.
    pub fn abandoned(&self, outcome: Abandoned) -> u64 {
        self.abandoned[outcome.index()]
    }

    /// Denials for one reason.
    pub fn denied(&self, reason: Denied) -> u64 {
        self.denied[reason.index()]
    }

    /// Would-be denials for one reason (shadow mode).
    pub fn shadow_denied(&self, reason: Denied) -> u64 {
        self.shadow_denied[reason.index()]
    }

    /// Hedges refused for one reason.
    pub fn hedge_denied(&self, reason: Denied) -> u64 {
        self.hedge_denied[reason.index()]
    }
}

impl Counters {
    // Relaxed throughout: counters are independent and only ever summed at a scrape.

    /// An original request was sent.
    pub fn primary(&self) {
        self.primaries.fetch_add(1, Ordering::Relaxed);
    }

    /// A retry was sent.
    pub fn retry(&self) {
        self.retries.fetch_add(1, Ordering::Relaxed);
    }

    /// An original request ended in success.
    pub fn succeeded(&self) {
        self.succeeded.fetch_add(1, Ordering::Relaxed);
    }

    /// An original request was refused before it reached a slot, for `reason`.
    pub fn primary_refused(&self, reason: Denied) {
        self.primaries_refused.fetch_add(1, Ordering::Relaxed);
        self.denied(reason);
    }

    /// A failure was not retryable by `retry_on`.
    pub fn not_retryable(&self) {
        self.not_retryable.fetch_add(1, Ordering::Relaxed);
    }

    /// An attempt was refused for `reason`.
    pub fn denied(&self, reason: Denied) {
        self.denied[reason.index()].fetch_add(1, Ordering::Relaxed);
    }

    /// An attempt whose caller went away ended so.
    pub fn abandoned(&self, outcome: Abandoned) {
        self.abandoned[outcome.index()].fetch_add(1, Ordering::Relaxed);
    }

    /// A hedge was sent.
    pub fn hedge(&self) {
        self.hedges.fetch_add(1, Ordering::Relaxed);
    }

    /// A hedge's answer was the one the caller got.
    pub fn hedge_won(&self) {
        self.hedges_won.fetch_add(1, Ordering::Relaxed);
    }

    /// A hedge was refused for `reason`.
    pub fn hedge_denied(&self, reason: Denied) {
        self.hedge_denied[reason.index()].fetch_add(1, Ordering::Relaxed);
    }

    /// A retry the caller sent itself came to `outcome`.
    pub fn caller_retry(&self, outcome: CallerRetryOutcome) {
        self.caller_retries[outcome.index()].fetch_add(1, Ordering::Relaxed);
    }

    /// Shadow mode would have refused an attempt for `reason`.
    pub fn shadow_denied(&self, reason: Denied) {
        self.shadow_denied[reason.index()].fetch_add(1, Ordering::Relaxed);
    }

    /// The counts now.
    pub fn snapshot(&self) -> CountersSnapshot {
        let load = |a: &[AtomicU64; Denied::ALL.len()]| {
            std::array::from_fn(|i| a[i].load(Ordering::Relaxed))
        };
        CountersSnapshot {
            primaries: self.primaries.load(Ordering::Relaxed),
            retries: self.retries.load(Ordering::Relaxed),
            not_retryable: self.not_retryable.load(Ordering::Relaxed),
            succeeded: self.succeeded.load(Ordering::Relaxed),
            primaries_refused: self.primaries_refused.load(Ordering::Relaxed),
            abandoned: std::array::from_fn(|i| self.abandoned[i].load(Ordering::Relaxed)),
            hedges: self.hedges.load(Ordering::Relaxed),
            hedges_won: self.hedges_won.load(Ordering::Relaxed),
            hedge_denied: load(&self.hedge_denied),
            denied: load(&self.denied),
            shadow_denied: load(&self.shadow_denied),
            caller_retries: std::array::from_fn(|i| self.caller_retries[i].load(Ordering::Relaxed)),
        }
    }
}
