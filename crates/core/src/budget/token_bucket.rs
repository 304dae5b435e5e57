//! The token bucket (gRPC retry throttling, gRFC A6).
//!
//! Tokens start at `max_tokens`. Each failed attempt whose condition is in `retry_on`, and each
//! don't-retry pushback, costs one token (never below zero); each request that ends in success
//! adds `token_ratio`, up to `max_tokens`. A retry is allowed only while tokens are strictly
//! above `max_tokens / 2`; granting one costs nothing more. Tokens are integer thousandths.

use super::{BudgetExhausted, BudgetSnapshot, FailureKind, Outcome, RetryBudget, RetryPermit};
use crate::clock::Timestamp;
use crate::error::ConfigError;
use crate::sync::{AtomicU64, Ordering};

const MILLI: u64 = 1_000;

/// Parameters of a [`TokenBucket`], in thousandths of a token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TokenBucketConfig {
    /// Capacity and starting level, in milli-tokens: `0 < max_tokens ≤ 1000` tokens.
    pub max_milli_tokens: u64,
    /// Added per successful request, in milli-tokens: `> 0` (gRPC keeps 3 decimals).
    pub token_ratio_milli: u64,
}

impl Default for TokenBucketConfig {
    fn default() -> Self {
        // gRFC A6's example: maxTokens 10, tokenRatio 0.1.
        TokenBucketConfig { max_milli_tokens: 10 * MILLI, token_ratio_milli: 100 }
    }
}

impl TokenBucketConfig {
    /// Checks every rule, returning the first broken one.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.max_milli_tokens == 0 || self.max_milli_tokens > 1_000 * MILLI {
            return Err(ConfigError::NotPositiveOrTooLarge {
                key: "max_tokens",
                max: "1000".into(),
                got: crate::decimal::format_scaled(self.max_milli_tokens, 3).to_string(),
            });
        }
        if self.token_ratio_milli == 0 {
            return Err(ConfigError::Zero { key: "token_ratio" });
        }
        Ok(())
    }
}

/// The gRPC-style token bucket. See the [module docs](crate::budget).
#[derive(Debug)]
pub struct TokenBucket {
    config: TokenBucketConfig,
    milli_tokens: AtomicU64,
}

impl TokenBucket {
    /// Builds the bucket, full, refusing invalid parameters.
    pub fn try_new(config: TokenBucketConfig) -> Result<TokenBucket, ConfigError> {
        config.validate()?;
        Ok(TokenBucket { config, milli_tokens: AtomicU64::new(config.max_milli_tokens) })
    }

    /// The parameters it was built with.
    pub fn config(&self) -> &TokenBucketConfig {
        &self.config
    }

    /// Tokens held now, in thousandths.
    pub fn milli_tokens(&self) -> u64 {
        self.milli_tokens.load(Ordering::Acquire)
    }

    fn update(&self, f: impl Fn(u64) -> u64) {
        // AcqRel: each update is a read-modify-write of the only shared value; no other data
        // depends on it.
        let _ = self.milli_tokens.fetch_update(Ordering::AcqRel, Ordering::Acquire, |t| Some(f(t)));
    }
}

impl RetryBudget for TokenBucket {
    #[inline]
    fn record_request(&self, _now: Timestamp) {}

    #[inline]
    fn record_outcome(&self, _now: Timestamp, outcome: Outcome) {
        match outcome {
            Outcome::RetryableFailure(_) | Outcome::DontRetryPushback => {
                self.update(|t| t.saturating_sub(MILLI))
            }
            Outcome::Success { .. } => {
                let (max, add) = (self.config.max_milli_tokens, self.config.token_ratio_milli);
                self.update(|t| t.saturating_add(add).min(max))
            }
            Outcome::OtherFailure => {}
        }
    }

    fn try_retry(
        &self,
        _now: Timestamp,
        _kind: FailureKind,
    ) -> Result<RetryPermit, BudgetExhausted> {
        // Strictly above half: tokens > max / 2, compared as 2 × tokens > max to stay integer.
        if self.milli_tokens().saturating_mul(2) > self.config.max_milli_tokens {
            Ok(RetryPermit::plain())
        } else {
            Err(BudgetExhausted)
        }
    }

    fn snapshot(&self, _now: Timestamp) -> BudgetSnapshot {
        let t = self.milli_tokens();
        let max = self.config.max_milli_tokens;
        // 0 when full, 1 at (or below) the half where retries stop.
        let used = max.saturating_sub(t) as f64;
        BudgetSnapshot {
            balance: t as f64 / MILLI as f64,
            utilization: super::utilization(used, max as f64 / 2.0),
            percent: None,
            policy: "token-bucket",
        }
    }
}

#[cfg(all(test, not(stormguard_loom)))]
mod tests {
    use super::*;

    const FAIL: Outcome = Outcome::RetryableFailure(FailureKind::Error);

    fn bucket(max: u64, ratio_milli: u64) -> TokenBucket {
        TokenBucket::try_new(TokenBucketConfig {
            max_milli_tokens: max * MILLI,
            token_ratio_milli: ratio_milli,
        })
        .unwrap()
    }

    fn allowed(b: &TokenBucket) -> bool {
        b.try_retry(Timestamp::ZERO, FailureKind::Error).is_ok()
    }

    #[test]
    fn strict_half_threshold() {
        let b = bucket(10, 100);
        for _ in 0..4 {
            b.record_outcome(Timestamp::ZERO, FAIL);
        }
        assert_eq!(b.milli_tokens(), 6_000);
        assert!(allowed(&b));
        b.record_outcome(Timestamp::ZERO, FAIL);
        assert_eq!(b.milli_tokens(), 5_000);
        assert!(!allowed(&b), "exactly half is not above half");
        b.record_outcome(Timestamp::ZERO, Outcome::Success { retried: false });
        assert_eq!(b.milli_tokens(), 5_100);
        assert!(allowed(&b));
    }

    #[test]
    fn floor_and_cap() {
        let b = bucket(3, 500);
        for _ in 0..10 {
            b.record_outcome(Timestamp::ZERO, Outcome::DontRetryPushback);
        }
        assert_eq!(b.milli_tokens(), 0);
        for _ in 0..10 {
            b.record_outcome(Timestamp::ZERO, Outcome::Success { retried: true });
        }
        assert_eq!(b.milli_tokens(), 3_000);
    }

    #[test]
    fn granting_and_other_failures_cost_nothing() {
        let b = bucket(10, 100);
        for _ in 0..100 {
            assert!(allowed(&b));
            b.record_outcome(Timestamp::ZERO, Outcome::OtherFailure);
        }
        assert_eq!(b.milli_tokens(), 10_000);
        assert_eq!(b.snapshot(Timestamp::ZERO).utilization, 0.0);
    }

    #[test]
    fn odd_max_threshold() {
        // max 3: retries allowed while tokens > 1.5, so at 2 but not at 1.5.
        let b = bucket(3, 500);
        b.record_outcome(Timestamp::ZERO, FAIL);
        assert!(allowed(&b));
        b.record_outcome(Timestamp::ZERO, FAIL);
        b.record_outcome(Timestamp::ZERO, Outcome::Success { retried: false }); // 1.5
        assert!(!allowed(&b));
    }

    #[test]
    fn refuses_bad_parameters() {
        let bad = |max, ratio| {
            TokenBucket::try_new(TokenBucketConfig {
                max_milli_tokens: max,
                token_ratio_milli: ratio,
            })
            .unwrap_err()
        };
        assert_eq!(bad(0, 100).key(), "max_tokens");
        assert_eq!(bad(1_000_001, 100).key(), "max_tokens");
        assert!(matches!(bad(1_000, 0), ConfigError::Zero { key: "token_ratio" }));
        assert_eq!(bad(1_000, 0).to_string(), "token_ratio must be above 0 (3 decimals are kept)");
    }
}
