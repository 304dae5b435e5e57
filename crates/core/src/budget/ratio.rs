//! The ratio budget (Finagle, Linkerd and tower's family; stormguard's default).
//!
//! `balance = floor(min_per_sec × ttl + percent × deposits − withdrawals)` over a sliding window
//! of `ttl`; a retry is allowed while `balance ≥ 1` and withdraws 1. The window is 10 slices of
//! `ttl / 10`, aligned to the clock's zero; it holds the current slice and the 9 before it, so an
//! entry counts for between 0.9 and 1.0 × `ttl`. Withdrawals age out like deposits, so the reserve
//! `min_per_sec × ttl` refills: it is a burst allowed per window, not a lifetime allowance.
//!
//! ## The window in atomics
//! (`budget::window`, the one window the breaker and the call tree's ledger count in too.)
//! Each slice is one `AtomicU64` for deposits and one for withdrawals, packing the slice number
//! (low 32 bits of `now / slice_len`) in the high half and the count in the low half, so a slot
//! is rotated to a new slice and counted in one compare-exchange. A retry withdraws first and
//! then checks the balance including its own withdrawal, undoing it if the balance went below
//! zero. Racing retries can therefore both be refused when one would have fit (conservative), but
//! never both granted when only one fits.
//!
//! ## Exactness
//! `percent` and `min_per_sec` are integer millionths; the balance is computed in `u128`
//! millionths and rounded down once, at the end. Over `n` deposits with no reserve exactly
//! `floor(n × percent)` retries are granted.

use crate::error::ConfigError;
use std::time::Duration;

use super::window::{SLICES, Window};
use super::{
    BudgetExhausted, BudgetSnapshot, FailureKind, Outcome, PermitInner, RetryBudget, RetryPermit,
};
use crate::clock::{Timestamp, duration_nanos};
use crate::decimal::Fraction;

const MICRO: u128 = 1_000_000;

/// When an original request deposits into the ratio budget.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DepositOn {
    /// When the original request is admitted to a slot (the default; a shed request deposits
    /// nothing).
    #[default]
    Admission,
    /// When the original request's final response succeeds: a failing dependency earns no
    /// retries.
    Success,
}

/// Parameters of a [`RatioBudget`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RatioConfig {
    /// Retries allowed per original request, as a fraction in `[0, 1000]` (`0.2` = one retry per
    /// five requests; `2` = two per request). Default `0.2`.
    pub percent: Fraction,
    /// The reserve, in retries per second of `ttl`, `≥ 0`, so a quiet service can still retry.
    /// Default `10`.
    pub min_per_sec: Fraction,
    /// How long a deposit or a withdrawal counts, 1 s to 60 s. Default 10 s.
    pub ttl: Duration,
    /// When an original request deposits. Default [`DepositOn::Admission`].
    pub deposit_on: DepositOn,
}

impl Default for RatioConfig {
    fn default() -> Self {
        RatioConfig {
            percent: crate::defaults::RATIO_PERCENT,
            min_per_sec: crate::defaults::RATIO_MIN_PER_SEC,
            ttl: crate::defaults::RATIO_TTL,
            deposit_on: DepositOn::Admission,
        }
    }
}

impl RatioConfig {
    /// Checks every rule, returning the first broken one.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.percent > Fraction::from_millionths(1_000 * Fraction::ONE_MILLIONTHS) {
            return Err(ConfigError::NotAFraction {
                key: "percent",
                of: "",
                max: "1000".into(),
                got: self.percent.to_string(),
            });
        }
        if self.min_per_sec > Fraction::from_millionths(1_000_000 * Fraction::ONE_MILLIONTHS) {
            return Err(ConfigError::TooLarge {
                key: "min_per_sec",
                max: "1000000".into(),
                got: self.min_per_sec.to_string(),
            });
        }
        if self.ttl < Duration::from_secs(1) || self.ttl > Duration::from_secs(60) {
            return Err(ConfigError::OutOfRange {
                key: "ttl",
                min: "1s".into(),
                max: "60s".into(),
                got: format!("{:?}", self.ttl),
            });
        }
        Ok(())
    }
}

/// The ratio retry budget. See the [module docs](crate::budget).
#[derive(Debug)]
pub struct RatioBudget {
    config: RatioConfig,
    slice_nanos: u64,
    /// `min_per_sec × ttl` in millionths of a retry, rounded down.
    reserve_micro: u128,
    deposits: Window,
    withdrawals: Window,
}

impl RatioBudget {
    /// Builds the budget, refusing invalid parameters.
    pub fn try_new(config: RatioConfig) -> Result<RatioBudget, ConfigError> {
        config.validate()?;
        let ttl_nanos = duration_nanos(config.ttl);
        let reserve_micro =
            u128::from(config.min_per_sec.millionths()) * u128::from(ttl_nanos) / 1_000_000_000;
        Ok(RatioBudget {
            config,
            slice_nanos: (ttl_nanos / SLICES as u64).max(1),
            reserve_micro,
            deposits: Window::new(),
            withdrawals: Window::new(),
        })
    }

    /// The parameters it was built with.
    pub fn config(&self) -> &RatioConfig {
        &self.config
    }

    fn slice(&self, now: Timestamp) -> (usize, u32) {
        crate::budget::window::slice(now, self.slice_nanos)
    }

    /// `(credit, withdrawals)` in millionths of a retry.
    fn totals(&self, now: Timestamp) -> (u128, u128) {
        let (_, current) = self.slice(now);
        let deposits = u128::from(self.deposits.sum(current));
        let withdrawals = u128::from(self.withdrawals.sum(current));
        let credit = self.reserve_micro + u128::from(self.config.percent.millionths()) * deposits;
        (credit, withdrawals * MICRO)
    }

    fn deposit(&self, now: Timestamp) {
        let (idx, tag) = self.slice(now);
        self.deposits.add(idx, tag, 1);
    }

    /// Whole retries available now: `floor(credit − withdrawals)`, negative when deposits aged
    /// out before the withdrawals that spent them.
    pub fn balance(&self, now: Timestamp) -> i64 {
        let (credit, spent) = self.totals(now);
        let diff = credit as i128 - spent as i128;
        i64::try_from(diff.div_euclid(MICRO as i128)).unwrap_or(i64::MAX)
    }
}

impl RetryBudget for RatioBudget {
    #[inline]
    fn record_request(&self, now: Timestamp) {
        if self.config.deposit_on == DepositOn::Admission {
            self.deposit(now);
        }
    }

    #[inline]
    fn record_outcome(&self, now: Timestamp, outcome: Outcome) {
        if self.config.deposit_on == DepositOn::Success
            && matches!(outcome, Outcome::Success { .. })
        {
            self.deposit(now);
        }
    }

    fn try_retry(
        &self,
        now: Timestamp,
        _kind: FailureKind,
    ) -> Result<RetryPermit, BudgetExhausted> {
        let (idx, tag) = self.slice(now);
        // Withdraw first, then check the balance with the withdrawal in it: of two racing
        // retries the later compare-exchange sees both, so they cannot both spend one credit.
        let written = self.withdrawals.add(idx, tag, 1);
        let (credit, spent) = self.totals(now);
        // `balance ≥ 1` before the withdrawal is `credit − spent ≥ 0` after it.
        if credit >= spent {
            Ok(RetryPermit { inner: PermitInner::Withdrawal { idx, tag: written } })
        } else {
            self.withdrawals.undo(idx, written);
            Err(BudgetExhausted)
        }
    }

    fn counts_successes(&self) -> bool {
        self.config.deposit_on == DepositOn::Success
    }

    /// As slices leave the window their withdrawals stop counting (and their deposits): the
    /// first slice boundary at which what stays leaves a whole retry, with no new traffic (new
    /// deposits only bring it sooner). `None` when even an empty window allows none (no
    /// reserve).
    fn retry_after(&self, now: Timestamp) -> Option<Duration> {
        let (_, current) = self.slice(now);
        let deposits = self.deposits.by_age(current);
        let withdrawals = self.withdrawals.by_age(current);
        let percent = u128::from(self.config.percent.millionths());
        // After k more slice boundaries, the slices aged SLICES − k and older have left.
        (0..=SLICES).find_map(|k| {
            let kept = SLICES - k;
            let credit = self.reserve_micro
                + percent * deposits[..kept].iter().map(|&d| u128::from(d)).sum::<u128>();
            let spent = MICRO * withdrawals[..kept].iter().map(|&w| u128::from(w)).sum::<u128>();
            (credit >= spent + MICRO).then(|| {
                let boundary = (now.as_nanos() / self.slice_nanos + k as u64) * self.slice_nanos;
                Duration::from_nanos(if k == 0 { 0 } else { boundary - now.as_nanos() })
            })
        })
    }

    fn refund(&self, _now: Timestamp, permit: RetryPermit) {
        if let PermitInner::Withdrawal { idx, tag } = permit.inner
            && idx < SLICES
        {
            self.withdrawals.undo(idx, tag);
        }
    }

    fn snapshot(&self, now: Timestamp) -> BudgetSnapshot {
        let (credit, spent) = self.totals(now);
        BudgetSnapshot {
            balance: self.balance(now) as f64,
            utilization: super::utilization(spent as f64, credit as f64),
            percent: Some(self.config.percent.as_f64()),
            policy: "ratio",
        }
    }
}

#[cfg(all(test, not(stormguard_loom)))]
mod tests {
    use super::*;

    fn budget(percent: &str, min_per_sec: &str, ttl_secs: u64) -> RatioBudget {
        RatioBudget::try_new(RatioConfig {
            percent: percent.parse().unwrap(),
            min_per_sec: min_per_sec.parse().unwrap(),
            ttl: Duration::from_secs(ttl_secs),
            deposit_on: DepositOn::Admission,
        })
        .unwrap()
    }

    fn grants(b: &RatioBudget, now: Timestamp, max: usize) -> usize {
        (0..max).filter(|_| b.try_retry(now, FailureKind::Error).map(drop).is_ok()).count()
    }

    #[test]
    fn exact_floor_over_ten_thousand_deposits() {
        for (p, expected) in [("0.29", 2_900), ("0.75", 7_500), ("0.9999", 9_999), ("0.2", 2_000)] {
            let b = budget(p, "0", 10);
            for _ in 0..10_000 {
                b.record_request(Timestamp::ZERO);
            }
            assert_eq!(b.balance(Timestamp::ZERO), expected, "percent {p}");
            assert_eq!(grants(&b, Timestamp::ZERO, 20_000) as i64, expected, "percent {p}");
            assert_eq!(b.balance(Timestamp::ZERO), 0);
        }
    }

    #[test]
    fn fractional_credit_is_not_rounded_up() {
        let b = budget("0.29", "0", 10);
        for _ in 0..3 {
            b.record_request(Timestamp::ZERO);
        }
        // 0.87 of a retry is not a retry.
        assert_eq!(grants(&b, Timestamp::ZERO, 5), 0);
        b.record_request(Timestamp::ZERO); // 1.16
        assert_eq!(grants(&b, Timestamp::ZERO, 5), 1);
    }

    #[test]
    fn deposits_expire_after_the_window() {
        let b = budget("1", "0", 10);
        b.record_request(Timestamp::from_millis(0)); // slice 0
        b.record_request(Timestamp::from_millis(2_500)); // slice 2
        assert_eq!(b.balance(Timestamp::from_millis(9_999)), 2);
        // At 10 s slice 10 opens; slice 0 leaves the window (it counted for exactly 10 s).
        assert_eq!(b.balance(Timestamp::from_millis(10_000)), 1);
        // A deposit at 2.5 s leaves when slice 12 opens at 12 s: it counted for 9.5 s.
        assert_eq!(b.balance(Timestamp::from_millis(11_999)), 1);
        assert_eq!(b.balance(Timestamp::from_millis(12_000)), 0);
    }

    #[test]
    fn reserve_refills_as_withdrawals_age_out() {
        let b = budget("0", "1", 10); // reserve: 1/s × 10 s = 10 retries per window
        assert_eq!(grants(&b, Timestamp::from_millis(500), 50), 10);
        assert_eq!(grants(&b, Timestamp::from_millis(9_000), 50), 0);
        // The withdrawals were made in slice 0; at 10 s they age out and the reserve is back.
        assert_eq!(b.balance(Timestamp::from_millis(10_000)), 10);
        assert_eq!(grants(&b, Timestamp::from_millis(10_000), 50), 10);
    }

    #[test]
    fn balance_goes_negative_when_deposits_age_out_first() {
        let b = budget("1", "0", 10);
        b.record_request(Timestamp::ZERO);
        assert_eq!(grants(&b, Timestamp::from_millis(5_000), 2), 1);
        assert_eq!(b.balance(Timestamp::from_millis(10_000)), -1);
        assert_eq!(grants(&b, Timestamp::from_millis(10_000), 1), 0);
        assert_eq!(b.balance(Timestamp::from_millis(15_000)), 0);
    }

    #[test]
    fn retry_after_is_the_slice_boundary_where_a_retry_fits_again() {
        let b = budget("0", "1", 10); // a reserve of 10 a window, slices of 1 s
        assert_eq!(b.retry_after(Timestamp::from_millis(500)), Some(Duration::ZERO));
        // Six spent in slice 0, four in slice 3: none left until slice 0's leave at 10 s.
        assert_eq!(grants(&b, Timestamp::from_millis(500), 6), 6);
        assert_eq!(grants(&b, Timestamp::from_millis(3_200), 50), 4);
        assert_eq!(
            b.retry_after(Timestamp::from_millis(3_200)),
            Some(Duration::from_millis(6_800))
        );
        // Checked against the budget itself: refused just before, granted at the boundary.
        assert_eq!(grants(&b, Timestamp::from_millis(9_999), 1), 0);
        assert_eq!(grants(&b, Timestamp::from_millis(10_000), 1), 1);
        // Deposits that leave with the withdrawals count: 2 spent of 1 deposit's credit at
        // percent 2 and no reserve never come back without new traffic.
        let b = budget("2", "0", 10);
        b.record_request(Timestamp::ZERO);
        assert_eq!(grants(&b, Timestamp::ZERO, 5), 2);
        assert_eq!(b.retry_after(Timestamp::from_millis(4_000)), None);
        // Without a reserve an empty budget cannot say.
        assert_eq!(budget("0.25", "0", 10).retry_after(Timestamp::ZERO), None);
    }

    #[test]
    fn refund_gives_the_withdrawal_back() {
        let b = budget("1", "0", 10);
        b.record_request(Timestamp::ZERO);
        let p = b.try_retry(Timestamp::ZERO, FailureKind::Error).unwrap();
        assert_eq!(b.balance(Timestamp::ZERO), 0);
        b.refund(Timestamp::ZERO, p);
        assert_eq!(b.balance(Timestamp::ZERO), 1);
        // A permit that is merely dropped keeps its charge.
        drop(b.try_retry(Timestamp::ZERO, FailureKind::Error).unwrap());
        assert_eq!(b.balance(Timestamp::ZERO), 0);
    }

    #[test]
    fn zero_percent_zero_reserve_never_retries() {
        let b = budget("0", "0", 10);
        for _ in 0..1_000 {
            b.record_request(Timestamp::ZERO);
        }
        assert_eq!(grants(&b, Timestamp::ZERO, 100), 0);
        assert_eq!(b.snapshot(Timestamp::ZERO).utilization, 1.0);
    }

    #[test]
    fn deposit_on_success_ignores_admission() {
        let b = RatioBudget::try_new(RatioConfig {
            percent: Fraction::ONE,
            min_per_sec: Fraction::ZERO,
            ttl: Duration::from_secs(10),
            deposit_on: DepositOn::Success,
        })
        .unwrap();
        b.record_request(Timestamp::ZERO);
        b.record_outcome(Timestamp::ZERO, Outcome::RetryableFailure(FailureKind::Error));
        assert_eq!(b.balance(Timestamp::ZERO), 0);
        b.record_outcome(Timestamp::ZERO, Outcome::Success { retried: false });
        assert_eq!(b.balance(Timestamp::ZERO), 1);
    }

    #[test]
    fn percent_above_one_allows_several_retries_per_request() {
        let b = budget("2", "0", 10);
        b.record_request(Timestamp::ZERO);
        assert_eq!(grants(&b, Timestamp::ZERO, 5), 2);
    }

    #[test]
    fn fractional_reserve() {
        // 0.25/s over 10 s is 2.5: two whole retries.
        let b = budget("0", "0.25", 10);
        assert_eq!(b.balance(Timestamp::ZERO), 2);
    }

    #[test]
    fn refuses_bad_parameters() {
        let mut c = RatioConfig::default();
        c.ttl = Duration::from_millis(999);
        let err = RatioBudget::try_new(c).unwrap_err();
        assert!(matches!(err, ConfigError::OutOfRange { key: "ttl", .. }), "{err}");
        assert_eq!(err.to_string(), "ttl must be between 1s and 60s, got 999ms");
        c.ttl = Duration::from_secs(61);
        assert!(RatioBudget::try_new(c).is_err());
        let mut c = RatioConfig::default();
        c.percent = Fraction::from_millionths(1_000_000_001);
        let err = RatioBudget::try_new(c).unwrap_err();
        assert!(matches!(err, ConfigError::NotAFraction { key: "percent", .. }), "{err}");
    }

    #[test]
    fn utilization_tracks_spending() {
        let b = budget("0.5", "0", 10);
        for _ in 0..4 {
            b.record_request(Timestamp::ZERO);
        }
        assert_eq!(b.snapshot(Timestamp::ZERO).utilization, 0.0);
        let _ = b.try_retry(Timestamp::ZERO, FailureKind::Error).unwrap();
        assert_eq!(b.snapshot(Timestamp::ZERO).utilization, 0.5);
    }
}
