//! The concurrency budget (Envoy's retry budget), and its fixed `slots` form.
//!
//! A retry may start while retries in flight are below `max(floor(percent × n), min)`, where `n`
//! counts original requests holding or waiting for a slot plus retries granted and not finished
//! (their backoff included). A granted retry counts as one more of each until its
//! [`RetryPermit`] drops. Unlike the ratio budget, `percent` here is a share of *everything in
//! flight*: the worked example's 4 retry slots over a cap of 20 are 20 % in this form, 25 % of
//! primaries in the ratio form.
//!
//! The `slots` form is the worked example's arithmetic made a policy: a fixed `cap −
//! planned_primary` concurrent retries, whatever the traffic.
//!
//! In-process, the caller feeds `n` through [`RetryBudget::set_active`] (the limiter knows how
//! many primaries hold or wait for a slot); `stormguard replay` feeds it from `active` events.

use crate::error::ConfigError;
use std::sync::Arc;

use super::{
    BudgetExhausted, BudgetSnapshot, FailureKind, Outcome, PermitInner, RetryBudget, RetryPermit,
};
use crate::clock::Timestamp;
use crate::decimal::Fraction;
use crate::sync::{AtomicU64, Ordering};

/// Parameters of a [`ConcurrencyBudget`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConcurrencyConfig {
    /// Retries in flight allowed as a fraction of all requests in flight, in `[0, 1]`.
    /// Default `0.2`.
    pub percent: Fraction,
    /// The floor: this many concurrent retries are always allowed. Default 3.
    pub min: u64,
    /// The fixed form: exactly this many concurrent retries, ignoring `percent` and `min`.
    pub slots: Option<u64>,
}

impl Default for ConcurrencyConfig {
    fn default() -> Self {
        ConcurrencyConfig {
            percent: crate::defaults::CONCURRENCY_PERCENT,
            min: crate::defaults::CONCURRENCY_MIN,
            slots: None,
        }
    }
}

impl ConcurrencyConfig {
    /// Checks every rule, returning the first broken one.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.percent > Fraction::ONE {
            return Err(ConfigError::NotAFraction {
                key: "percent",
                of: " of requests in flight",
                max: "1".into(),
                got: self.percent.to_string(),
            });
        }
        Ok(())
    }
}

/// The concurrency retry budget. See the [module docs](crate::budget).
#[derive(Debug)]
pub struct ConcurrencyBudget {
    config: ConcurrencyConfig,
    /// Requests in flight reported by the caller (retries it reports included).
    requests: AtomicU64,
    /// Retries in flight reported by the caller, not granted here.
    retries: AtomicU64,
    /// Retries granted here and not finished; shared with their permits.
    granted: Arc<AtomicU64>,
}

impl ConcurrencyBudget {
    /// Builds the budget, refusing invalid parameters.
    pub fn try_new(config: ConcurrencyConfig) -> Result<ConcurrencyBudget, ConfigError> {
        config.validate()?;
        Ok(ConcurrencyBudget {
            config,
            requests: AtomicU64::new(0),
            retries: AtomicU64::new(0),
            granted: Arc::new(AtomicU64::new(0)),
        })
    }

    /// The parameters it was built with.
    pub fn config(&self) -> &ConcurrencyConfig {
        &self.config
    }

    /// Concurrent retries allowed when `n` requests are in flight.
    pub fn limit(&self, n: u64) -> u64 {
        match self.config.slots {
            Some(slots) => slots,
            None => self.config.percent.floor_mul(n).max(self.config.min),
        }
    }

    /// `(limit, retries in flight)` now.
    fn state(&self) -> (u64, u64) {
        let granted = self.granted.load(Ordering::Acquire);
        let n = self.requests.load(Ordering::Acquire).saturating_add(granted);
        let in_flight = self.retries.load(Ordering::Acquire).saturating_add(granted);
        (self.limit(n), in_flight)
    }

    /// Retries that may start now: `limit − retries in flight`, at least 0.
    pub fn balance(&self) -> u64 {
        let (limit, in_flight) = self.state();
        limit.saturating_sub(in_flight)
    }
}

impl RetryBudget for ConcurrencyBudget {
    #[inline]
    fn record_request(&self, _now: Timestamp) {}

    #[inline]
    fn record_outcome(&self, _now: Timestamp, _outcome: Outcome) {}

    fn counts_successes(&self) -> bool {
        false
    }

    fn try_retry(
        &self,
        _now: Timestamp,
        _kind: FailureKind,
    ) -> Result<RetryPermit, BudgetExhausted> {
        let requests = self.requests.load(Ordering::Acquire);
        let retries = self.retries.load(Ordering::Acquire);
        let mut granted = self.granted.load(Ordering::Acquire);
        loop {
            let limit = self.limit(requests.saturating_add(granted));
            if retries.saturating_add(granted) >= limit {
                return Err(BudgetExhausted);
            }
            // The compare-exchange on `granted` is the whole admission: two racing retries can't
            // both take the last place, because only one moves `granted` from this value.
            match self.granted.compare_exchange_weak(
                granted,
                granted + 1,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => {
                    return Ok(RetryPermit {
                        inner: PermitInner::InFlight(Some(self.granted.clone())),
                    });
                }
                Err(actual) => granted = actual,
            }
        }
    }

    fn set_active(&self, requests: u64, retries: u64) {
        self.requests.store(requests, Ordering::Release);
        self.retries.store(retries, Ordering::Release);
    }

    fn snapshot(&self, _now: Timestamp) -> BudgetSnapshot {
        let (limit, in_flight) = self.state();
        BudgetSnapshot {
            balance: limit.saturating_sub(in_flight) as f64,
            utilization: super::utilization(in_flight as f64, limit as f64),
            percent: self.config.slots.is_none().then(|| self.config.percent.as_f64()),
            policy: "concurrency",
        }
    }
}

#[cfg(all(test, not(stormguard_loom)))]
mod tests {
    use super::*;

    fn budget(percent: &str, min: u64) -> ConcurrencyBudget {
        ConcurrencyBudget::try_new(ConcurrencyConfig {
            percent: percent.parse().unwrap(),
            min,
            slots: None,
        })
        .unwrap()
    }

    fn take(b: &ConcurrencyBudget) -> Option<RetryPermit> {
        b.try_retry(Timestamp::ZERO, FailureKind::Error).ok()
    }

    #[test]
    fn floor_applies_to_quiet_traffic() {
        let b = budget("0.2", 3);
        b.set_active(5, 0); // 20 % of 5 is 1, the floor is 3
        let held: Vec<_> = std::iter::from_fn(|| take(&b)).take(10).collect();
        assert_eq!(held.len(), 3);
        drop(held);
        assert_eq!(b.balance(), 3, "finished retries free their places");
    }

    #[test]
    fn granted_retries_count_in_n_and_in_flight() {
        let b = budget("0.2", 0);
        b.set_active(20, 0);
        // 0 < floor(0.2 × 20) = 4; then n grows with each grant: 1 < floor(4.2), 2 < floor(4.4),
        // 3 < floor(4.6), 4 < floor(4.8) = 4 fails.
        let held: Vec<_> = std::iter::from_fn(|| take(&b)).take(10).collect();
        assert_eq!(held.len(), 4);
        // At n = 25 (29 with the 4 granted), 4 < floor(0.2 × 29) = 5 lets one more in.
        b.set_active(25, 0);
        assert!(take(&b).is_some());
    }

    #[test]
    fn reported_retries_take_places() {
        let b = budget("0.5", 0);
        b.set_active(10, 4);
        assert_eq!(b.balance(), 1);
        let p = take(&b).unwrap();
        assert_eq!(b.balance(), 0, "n 11 allows 5, 5 in flight");
        drop(p);
        assert_eq!(b.balance(), 1);
    }

    #[test]
    fn finish_ends_the_count_but_keeps_the_permit() {
        let b = budget("0", 1);
        let mut p = take(&b).unwrap();
        assert!(take(&b).is_none());
        p.finish();
        assert!(!p.is_in_flight());
        let q = take(&b).unwrap();
        drop(p); // already finished: does not free q's place
        assert!(take(&b).is_none());
        drop(q);
    }

    #[test]
    fn slots_form_is_fixed() {
        let b =
            ConcurrencyBudget::try_new(ConcurrencyConfig { slots: Some(4), ..Default::default() })
                .unwrap();
        b.set_active(1_000, 0);
        let held: Vec<_> = std::iter::from_fn(|| take(&b)).take(10).collect();
        assert_eq!(held.len(), 4);
        assert_eq!(b.snapshot(Timestamp::ZERO).utilization, 1.0);
        assert_eq!(b.snapshot(Timestamp::ZERO).percent, None);
    }

    #[test]
    fn percent_above_one_is_refused() {
        let c = ConcurrencyConfig { percent: "1.5".parse().unwrap(), ..Default::default() };
        let err = ConcurrencyBudget::try_new(c).unwrap_err();
        assert!(matches!(err, ConfigError::NotAFraction { key: "percent", .. }), "{err}");
        assert_eq!(
            err.to_string(),
            "percent must be a fraction in [0, 1] of requests in flight, got 1.5"
        );
    }
}
