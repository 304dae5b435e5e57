//! The retry quota (the AWS SDKs' standard retry mode).
//!
//! A bucket of `capacity` tokens. Granting a retry charges its cost at once, by the kind of
//! failure it retries: `retry_cost` after an error, `timeout_cost` after a timeout,
//! `throttle_cost` after a throttle. A retry is denied when the bucket holds less than its cost.
//! A first-try success adds `success_reward` (up to `capacity`); a successful retry refunds the
//! cost of that retry only, through [`RetryPermit::succeeded`].

use crate::error::ConfigError;
use std::sync::Arc;

use super::{
    BudgetExhausted, BudgetSnapshot, FailureKind, Outcome, PermitInner, RetryBudget, RetryPermit,
};
use crate::clock::Timestamp;
use crate::sync::{AtomicU64, Ordering};

/// Parameters of a [`QuotaBudget`], in whole tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QuotaConfig {
    /// Size and starting level of the bucket, `≥ 0`. Default 500.
    pub capacity: u64,
    /// Cost of a retry after an error. Default 5.
    pub retry_cost: u64,
    /// Cost of a retry after a timeout. Default 10.
    pub timeout_cost: u64,
    /// Cost of a retry after a throttle. Default: `retry_cost`.
    pub throttle_cost: u64,
    /// Added by each first-try success, up to `capacity`. Default 1.
    pub success_reward: u64,
}

impl Default for QuotaConfig {
    fn default() -> Self {
        QuotaConfig {
            capacity: 500,
            retry_cost: 5,
            timeout_cost: 10,
            throttle_cost: 5,
            success_reward: 1,
        }
    }
}

impl QuotaConfig {
    /// The cost of a retry after a failure of `kind`.
    pub fn cost(&self, kind: FailureKind) -> u64 {
        match kind {
            FailureKind::Error => self.retry_cost,
            FailureKind::Timeout => self.timeout_cost,
            FailureKind::Throttle => self.throttle_cost,
        }
    }

    /// Checks every rule, returning the first broken one.
    pub fn validate(&self) -> Result<(), ConfigError> {
        const MAX: u64 = 1 << 40;
        for (name, v) in [
            ("capacity", self.capacity),
            ("retry_cost", self.retry_cost),
            ("timeout_cost", self.timeout_cost),
            ("throttle_cost", self.throttle_cost),
            ("success_reward", self.success_reward),
        ] {
            if v > MAX {
                return Err(ConfigError::TooLarge {
                    key: name,
                    max: MAX.to_string(),
                    got: v.to_string(),
                });
            }
        }
        Ok(())
    }
}

/// The shared bucket; permits hold it to refund.
#[derive(Debug)]
pub(super) struct Bucket {
    capacity: u64,
    tokens: AtomicU64,
}

impl Bucket {
    pub(super) fn add(&self, n: u64) {
        let cap = self.capacity;
        // AcqRel: the bucket is the only shared value; the read-modify-write keeps it exact.
        let _ = self.tokens.fetch_update(Ordering::AcqRel, Ordering::Acquire, |t| {
            Some(t.saturating_add(n).min(cap))
        });
    }

    fn try_take(&self, cost: u64) -> bool {
        self.tokens
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |t| t.checked_sub(cost))
            .is_ok()
    }
}

/// The AWS-style retry quota. See the [module docs](crate::budget).
#[derive(Debug)]
pub struct QuotaBudget {
    config: QuotaConfig,
    bucket: Arc<Bucket>,
}

impl QuotaBudget {
    /// Builds the quota, full, refusing invalid parameters.
    pub fn try_new(config: QuotaConfig) -> Result<QuotaBudget, ConfigError> {
        config.validate()?;
        Ok(QuotaBudget {
            config,
            bucket: Arc::new(Bucket {
                capacity: config.capacity,
                tokens: AtomicU64::new(config.capacity),
            }),
        })
    }

    /// The parameters it was built with.
    pub fn config(&self) -> &QuotaConfig {
        &self.config
    }

    /// Tokens in the bucket now.
    pub fn tokens(&self) -> u64 {
        self.bucket.tokens.load(Ordering::Acquire)
    }
}

impl RetryBudget for QuotaBudget {
    #[inline]
    fn record_request(&self, _now: Timestamp) {}

    #[inline]
    fn record_outcome(&self, _now: Timestamp, outcome: Outcome) {
        if outcome == (Outcome::Success { retried: false }) {
            self.bucket.add(self.config.success_reward);
        }
    }

    fn try_retry(
        &self,
        _now: Timestamp,
        kind: FailureKind,
    ) -> Result<RetryPermit, BudgetExhausted> {
        let cost = self.config.cost(kind);
        if self.bucket.try_take(cost) {
            Ok(RetryPermit {
                inner: PermitInner::Refund { bucket: self.bucket.clone(), cost, refunded: false },
            })
        } else {
            Err(BudgetExhausted)
        }
    }

    fn snapshot(&self, _now: Timestamp) -> BudgetSnapshot {
        let t = self.tokens();
        let cap = self.config.capacity;
        BudgetSnapshot {
            balance: t as f64,
            utilization: super::utilization(cap.saturating_sub(t) as f64, cap as f64),
            percent: None,
            policy: "quota",
        }
    }
}

#[cfg(all(test, not(stormguard_loom)))]
mod tests {
    use super::*;

    fn quota(capacity: u64) -> QuotaBudget {
        QuotaBudget::try_new(QuotaConfig { capacity, ..Default::default() }).unwrap()
    }

    #[test]
    fn costs_by_kind() {
        let q = quota(500);
        let _a = q.try_retry(Timestamp::ZERO, FailureKind::Error).unwrap();
        assert_eq!(q.tokens(), 495);
        let _b = q.try_retry(Timestamp::ZERO, FailureKind::Timeout).unwrap();
        assert_eq!(q.tokens(), 485);
        let _c = q.try_retry(Timestamp::ZERO, FailureKind::Throttle).unwrap();
        assert_eq!(q.tokens(), 480);
    }

    #[test]
    fn denied_below_cost() {
        let q = quota(14);
        let _a = q.try_retry(Timestamp::ZERO, FailureKind::Timeout).unwrap(); // 4 left
        assert!(q.try_retry(Timestamp::ZERO, FailureKind::Error).is_err());
        assert_eq!(q.tokens(), 4, "a denial charges nothing");
        q.record_outcome(Timestamp::ZERO, Outcome::Success { retried: false }); // 5
        assert!(q.try_retry(Timestamp::ZERO, FailureKind::Error).is_ok());
        assert_eq!(q.tokens(), 0);
    }

    #[test]
    fn refund_only_on_success_and_only_once() {
        let q = quota(500);
        let failed = q.try_retry(Timestamp::ZERO, FailureKind::Timeout).unwrap();
        drop(failed);
        assert_eq!(q.tokens(), 490, "a failed retry is not refunded");
        let mut ok = q.try_retry(Timestamp::ZERO, FailureKind::Timeout).unwrap();
        ok.succeeded();
        ok.succeeded();
        assert_eq!(q.tokens(), 490, "the last retry's cost comes back, once");
        // A successful retry earns no reward on top of its refund.
        q.record_outcome(Timestamp::ZERO, Outcome::Success { retried: true });
        assert_eq!(q.tokens(), 490);
    }

    #[test]
    fn refund_returns_the_cost() {
        let q = quota(500);
        let p = q.try_retry(Timestamp::ZERO, FailureKind::Timeout).unwrap();
        q.refund(Timestamp::ZERO, p);
        assert_eq!(q.tokens(), 500);
    }

    #[test]
    fn reward_is_capped_and_zero_capacity_never_retries() {
        let q = quota(500);
        q.record_outcome(Timestamp::ZERO, Outcome::Success { retried: false });
        assert_eq!(q.tokens(), 500);
        let z = quota(0);
        assert!(z.try_retry(Timestamp::ZERO, FailureKind::Error).is_err());
        assert_eq!(z.snapshot(Timestamp::ZERO).utilization, 1.0);
    }
}
