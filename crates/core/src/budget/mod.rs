//! Retry budgets: how many retries a dependency may be sent.
//!
//! Retrying each failure once looks harmless until the dependency degrades: at a 40 % error rate
//! a service that planned 16 calls in flight sends 22.4, past a cap of 20, exactly when the
//! dependency can least take it. A budget bounds retries to a fraction of original traffic (with
//! a small floor, so a quiet service can still retry), and refuses the rest at once.
//!
//! Four policies share one non-blocking trait, [`RetryBudget`]:
//!
//! | policy | family | allows a retry while |
//! | --- | --- | --- |
//! | [`RatioBudget`] (default) | Finagle, Linkerd, tower | `floor(min_per_sec × ttl + percent × deposits − withdrawals) ≥ 1` over a sliding window |
//! | [`ConcurrencyBudget`] | Envoy | retries in flight `< max(floor(percent × n), min)` |
//! | [`TokenBucket`] | gRPC retry throttling | tokens `> max_tokens / 2` |
//! | [`QuotaBudget`] | AWS SDK standard mode | the bucket holds the retry's cost |
//!
//! Every call takes the current [`Timestamp`]; none blocks or allocates on the hot path.
//!
//! ```
//! use stormguard_core::budget::{BudgetSpec, FailureKind, RetryBudget};
//! use stormguard_core::clock::Timestamp;
//!
//! let budget = BudgetSpec::parse("ratio:percent=0.25,min_per_sec=0,ttl=10s")?.build()?;
//! let now = Timestamp::ZERO;
//! for _ in 0..4 {
//!     budget.record_request(now); // four original requests admitted
//! }
//! let permit = budget.try_retry(now, FailureKind::Error).expect("25 % of 4 is one retry");
//! assert!(budget.try_retry(now, FailureKind::Error).is_err()); // spent
//! drop(permit); // the retry finished
//! # Ok::<(), stormguard_core::budget::SpecError>(())
//! ```

mod concurrency;
mod quota;
mod ratio;
mod spec;
mod token_bucket;
pub(crate) mod window;

use crate::sync::{AtomicU64, Ordering};
use std::fmt;
use std::sync::Arc;

pub use concurrency::{ConcurrencyBudget, ConcurrencyConfig};
pub use quota::{QuotaBudget, QuotaConfig};
pub use ratio::{DepositOn, RatioBudget, RatioConfig};
pub use spec::{BudgetSpec, SpecError};
pub use token_bucket::{TokenBucket, TokenBucketConfig};

use crate::clock::Timestamp;

/// The kind of failure a retry follows. Some policies charge by kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(rename_all = "lowercase"))]
pub enum FailureKind {
    /// An error response or a connection failure.
    #[default]
    Error,
    /// The per-try timeout expired.
    Timeout,
    /// The dependency throttled the request (429, or a rate-limit pushback).
    Throttle,
}

impl FailureKind {
    /// The lowercase name used in traces and metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            FailureKind::Error => "error",
            FailureKind::Timeout => "timeout",
            FailureKind::Throttle => "throttle",
        }
    }
}

/// What happened to an attempt, as a budget needs to know it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// The request ended in success. `retried` is true when the successful attempt was a retry.
    Success {
        /// Whether the attempt that succeeded was a retry.
        retried: bool,
    },
    /// An attempt failed with a condition the retry policy covers (`retry_on`).
    RetryableFailure(FailureKind),
    /// An attempt failed with a condition the retry policy does not cover. Counted by no policy.
    OtherFailure,
    /// The dependency said not to retry (e.g. a negative `grpc-retry-pushback-ms`).
    DontRetryPushback,
}

/// A retry was refused because the budget is spent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("retry budget exhausted")]
pub struct BudgetExhausted;

/// A point-in-time view of a budget.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BudgetSnapshot {
    /// What the policy holds now, in its own unit: whole retries available (ratio; may be negative
    /// when deposits aged out before the withdrawals that spent them), retries that may still start
    /// (concurrency), tokens (token bucket, quota).
    pub balance: f64,
    /// How much of the budget is in use, in `0.0..=1.0`; `1.0` means no retry would be allowed.
    pub utilization: f64,
    /// The configured fraction (ratio and concurrency), for the `stormguard_budget_percent` gauge.
    /// What it is a share of depends on [`policy`](Self::policy): original requests for `ratio`,
    /// everything in flight (first tries and retries) for `concurrency`.
    pub percent: Option<f64>,
    /// The policy's kind as a SPEC names it: `ratio`, `concurrency`, `token-bucket` or `quota`.
    pub policy: &'static str,
}

/// A retry budget policy. Shared by every caller of a dependency; every method is non-blocking.
///
/// The protocol, per original request:
/// 1. [`record_request`](RetryBudget::record_request) when it is admitted to a slot (a request
///    shed before admission records nothing);
/// 2. [`record_outcome`](RetryBudget::record_outcome) for each attempt's result;
/// 3. [`try_retry`](RetryBudget::try_retry) before each retry; hold the [`RetryPermit`] until the
///    retry finishes, and call [`RetryPermit::succeeded`] if it succeeded.
pub trait RetryBudget: Send + Sync + fmt::Debug {
    /// An original request was admitted.
    fn record_request(&self, now: Timestamp);

    /// An attempt finished with `outcome`.
    fn record_outcome(&self, now: Timestamp, outcome: Outcome);

    /// Asks for one retry after a failure of `kind`. A granted retry is charged now.
    fn try_retry(&self, now: Timestamp, kind: FailureKind) -> Result<RetryPermit, BudgetExhausted>;

    /// Tells a policy that counts concurrency how many original requests are in flight (holding
    /// or waiting for a slot) and how many retries not granted by this budget are in flight.
    /// Policies that do not count concurrency ignore it.
    fn set_active(&self, _requests: u64, _retries: u64) {}

    /// The balance, utilization and configured percent now.
    fn snapshot(&self, now: Timestamp) -> BudgetSnapshot;

    /// Whether [`record_outcome`](RetryBudget::record_outcome) does anything with a success
    /// (so a caller can skip reading the clock when it does not). Default true. Fixed for the
    /// budget's life: a [`RetryPolicy`](crate::decision::RetryPolicy) reads it once, when it is
    /// built over the budget.
    fn counts_successes(&self) -> bool {
        true
    }

    /// The granted retry was never sent (the cap refused it after its backoff): undo its charge.
    /// A permit from another budget is only dropped.
    fn refund(&self, now: Timestamp, permit: RetryPermit) {
        let _ = now;
        permit.undo_charge();
    }

    /// How long until a retry would be granted, when time alone decides it (zero: one would be
    /// now); `None` when it waits on traffic nobody can foresee — successes (token bucket,
    /// quota), retries ending (concurrency). What a budget refusal tells its caller as
    /// `Retry-After`.
    fn retry_after(&self, now: Timestamp) -> Option<std::time::Duration> {
        let _ = now;
        None
    }
}

impl<B: RetryBudget + ?Sized> RetryBudget for Arc<B> {
    fn record_request(&self, now: Timestamp) {
        (**self).record_request(now)
    }
    fn record_outcome(&self, now: Timestamp, outcome: Outcome) {
        (**self).record_outcome(now, outcome)
    }
    fn try_retry(&self, now: Timestamp, kind: FailureKind) -> Result<RetryPermit, BudgetExhausted> {
        (**self).try_retry(now, kind)
    }
    fn set_active(&self, requests: u64, retries: u64) {
        (**self).set_active(requests, retries)
    }
    fn snapshot(&self, now: Timestamp) -> BudgetSnapshot {
        (**self).snapshot(now)
    }
    fn refund(&self, now: Timestamp, permit: RetryPermit) {
        (**self).refund(now, permit)
    }
    fn counts_successes(&self) -> bool {
        (**self).counts_successes()
    }
    fn retry_after(&self, now: Timestamp) -> Option<std::time::Duration> {
        (**self).retry_after(now)
    }
}

/// A granted retry. Dropping it means the retry finished (successfully or not).
///
/// Hold it for as long as the retry is pending or in flight: the concurrency policy counts the
/// retry until the permit drops. Call [`succeeded`](RetryPermit::succeeded) when the retry
/// succeeded, so a quota policy can refund its cost.
#[must_use = "dropping the permit ends the retry"]
#[derive(Debug)]
pub struct RetryPermit {
    inner: PermitInner,
}

#[derive(Debug)]
enum PermitInner {
    /// Nothing to do when the retry ends.
    Plain,
    /// One retry in flight, counted in this atomic until it finishes.
    InFlight(Option<Arc<AtomicU64>>),
    /// A quota charge that a success refunds.
    Refund { bucket: Arc<quota::Bucket>, cost: u64, refunded: bool },
    /// A ratio withdrawal, in slot `idx` of slice `tag`, that a refund takes back.
    Withdrawal { idx: usize, tag: u32 },
}

impl RetryPermit {
    pub(crate) fn plain() -> RetryPermit {
        RetryPermit { inner: PermitInner::Plain }
    }

    /// A permit that records the retry was granted without any budget (shadow mode, tests).
    pub fn unbudgeted() -> RetryPermit {
        RetryPermit::plain()
    }

    /// The retry finished, but its permit is kept (to call [`succeeded`](Self::succeeded) once the
    /// outcome is known): a concurrency policy stops counting it now. Dropping the permit
    /// finishes it too; finishing twice counts once.
    #[inline]
    pub fn finish(&mut self) {
        if let PermitInner::InFlight(count) = &mut self.inner
            && let Some(count) = count.take()
        {
            // Release pairs with the Acquire in the grant's compare-exchange, so a caller that
            // sees the lower count also sees everything this retry did before it ended.
            count.fetch_sub(1, Ordering::Release);
        }
    }

    /// Undoes what the grant charged, where the permit alone can (quota, concurrency).
    pub(crate) fn undo_charge(mut self) {
        self.succeeded();
        self.finish();
    }

    /// Whether the retry still counts as in flight for a concurrency policy.
    pub fn is_in_flight(&self) -> bool {
        matches!(self.inner, PermitInner::InFlight(Some(_)))
    }

    /// The retry succeeded: a quota policy refunds the cost it charged for this retry. Calling it
    /// more than once refunds once.
    pub fn succeeded(&mut self) {
        if let PermitInner::Refund { bucket, cost, refunded } = &mut self.inner
            && !*refunded
        {
            *refunded = true;
            bucket.add(*cost);
        }
    }
}

impl Drop for RetryPermit {
    #[inline]
    fn drop(&mut self) {
        self.finish();
    }
}

/// One of the four policies, chosen at run time (from a [`BudgetSpec`]).
#[derive(Debug)]
pub enum AnyBudget {
    /// See [`RatioBudget`].
    Ratio(RatioBudget),
    /// See [`ConcurrencyBudget`].
    Concurrency(ConcurrencyBudget),
    /// See [`TokenBucket`].
    TokenBucket(TokenBucket),
    /// See [`QuotaBudget`].
    Quota(QuotaBudget),
}

macro_rules! each {
    ($self:ident, $b:ident => $e:expr) => {
        match $self {
            AnyBudget::Ratio($b) => $e,
            AnyBudget::Concurrency($b) => $e,
            AnyBudget::TokenBucket($b) => $e,
            AnyBudget::Quota($b) => $e,
        }
    };
}

impl RetryBudget for AnyBudget {
    #[inline]
    fn record_request(&self, now: Timestamp) {
        each!(self, b => b.record_request(now))
    }
    #[inline]
    fn record_outcome(&self, now: Timestamp, outcome: Outcome) {
        each!(self, b => b.record_outcome(now, outcome))
    }
    #[inline]
    fn try_retry(&self, now: Timestamp, kind: FailureKind) -> Result<RetryPermit, BudgetExhausted> {
        each!(self, b => b.try_retry(now, kind))
    }
    fn set_active(&self, requests: u64, retries: u64) {
        each!(self, b => b.set_active(requests, retries))
    }
    fn snapshot(&self, now: Timestamp) -> BudgetSnapshot {
        each!(self, b => b.snapshot(now))
    }
    fn refund(&self, now: Timestamp, permit: RetryPermit) {
        each!(self, b => b.refund(now, permit))
    }
    #[inline]
    fn counts_successes(&self) -> bool {
        each!(self, b => b.counts_successes())
    }
    fn retry_after(&self, now: Timestamp) -> Option<std::time::Duration> {
        each!(self, b => b.retry_after(now))
    }
}

/// `used / total` clamped to `0..=1`, with an empty total counting as fully used.
pub(crate) fn utilization(used: f64, total: f64) -> f64 {
    if total <= 0.0 { 1.0 } else { (used / total).clamp(0.0, 1.0) }
}
