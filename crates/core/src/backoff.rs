//! Backoff and pushback: how long a retry waits, and when the server's word replaces that.
//!
//! Callers that fail together retry together. Retrying at once sends a dependency that is
//! already struggling a second wave the size of the first, at the worst moment. Exponential
//! backoff spaces a request's attempts out; jitter spreads *different* requests' retries so they
//! do not arrive in lockstep. The random source is a parameter ([`RandomSource`]), so the
//! simulator and the tests draw from a seeded generator and every run can be replayed.
//!
//! When the server says how long to wait (`Retry-After`, a rate-limit reset, gRPC pushback), its
//! word replaces the backoff: [`PushbackPolicy::decide`] turns a [`Pushback`] into a wait,
//! jittered *upward* (uniform in `[d, 1.2 d]`) so callers held by one `Retry-After` do not all
//! fire when it ends. A pushback longer than `max_pushback` means no retry, never a shortened
//! wait: coming back early is exactly what the server asked us not to do. A pushback holds every
//! retry to that upstream until it passes, not just the one request's: [`PushbackHold`] is that
//! shared "held until" time.
//!
//! ```
//! use std::time::Duration;
//! use stormguard_core::backoff::{
//!     Backoff, BackoffConfig, Pushback, PushbackHold, PushbackPolicy, PushbackRefusal,
//! };
//! use stormguard_core::clock::Timestamp;
//! use stormguard_core::random::SplitMix64;
//!
//! let mut rng = SplitMix64::new(1);
//! let ms = Duration::from_millis;
//!
//! // 25 ms doubling to at most 250 ms, with full jitter (the default).
//! let backoff = Backoff::try_new(BackoffConfig::parse_range("25ms..250ms").unwrap()).unwrap();
//! assert_eq!(backoff.exponential(1), ms(25));
//! assert_eq!(backoff.exponential(3), ms(100));
//! assert_eq!(backoff.exponential(50), ms(250));
//! assert!(backoff.wait(3, None, &mut rng) <= ms(100));
//!
//! // The server said "Retry-After: 2": wait between 2 s and 2.4 s.
//! let policy = PushbackPolicy::default();
//! let wait = policy.decide(Pushback::RetryAfter(Duration::from_secs(2)), &mut rng).unwrap();
//! assert!(Duration::from_secs(2) <= wait && wait <= ms(2_400));
//! // Ten minutes is more than max_pushback (300 s): no retry at all.
//! assert!(matches!(
//!     policy.decide(Pushback::RetryAfter(Duration::from_secs(600)), &mut rng),
//!     Err(PushbackRefusal::TooLong { .. })
//! ));
//!
//! // And every retry to that upstream is held until the pushback passes.
//! let hold = PushbackHold::new();
//! hold.hold_until(Timestamp::from_millis(2_000));
//! assert_eq!(hold.is_held(Timestamp::from_millis(1_500)), Some(Timestamp::from_millis(2_000)));
//! assert_eq!(hold.is_held(Timestamp::from_millis(2_000)), None);
//! ```

use crate::error::ConfigError;
use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use crate::clock::{Timestamp, duration_nanos};
use crate::decimal::{Fraction, parse_duration};
use crate::random::RandomSource;
use crate::sync::{AtomicU64, Ordering};

/// The longest `max` a backoff may have: a retry sent an hour late answers nobody.
pub const LONGEST_BACKOFF: Duration = Duration::from_secs(3_600);
/// The largest backoff multiplier.
pub const LARGEST_MULTIPLIER: Fraction = Fraction::from_millionths(10 * Fraction::ONE_MILLIONTHS);
/// The longest `max_pushback` a policy may have.
pub const LONGEST_PUSHBACK: Duration = Duration::from_secs(24 * 3_600);

const MICRO: u128 = Fraction::ONE_MILLIONTHS as u128;

/// How the exponential backoff `d` is spread. Tokens: `full`, `equal`, `decorrelated`, `none`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Jitter {
    /// Uniform in `[0, d]`: the widest spread, and the default.
    #[default]
    Full,
    /// `d/2` plus uniform in `[0, d/2]`: never shorter than half the backoff.
    Equal,
    /// AWS's decorrelated jitter: `min(max, uniform[base, 3 × previous wait])`. It ignores the
    /// retry number and the multiplier; each wait grows from the one before.
    Decorrelated,
    /// Exactly `d`. Callers that failed together retry together: for tests and comparisons.
    None,
}

impl Jitter {
    /// The token this jitter is configured with.
    pub fn as_str(self) -> &'static str {
        match self {
            Jitter::Full => "full",
            Jitter::Equal => "equal",
            Jitter::Decorrelated => "decorrelated",
            Jitter::None => "none",
        }
    }
}

impl fmt::Display for Jitter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A jitter token that is not `full`, `equal`, `decorrelated` or `none`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("`{0}` is not a jitter (full, equal, decorrelated or none)")]
pub struct UnknownJitter(pub String);

impl FromStr for Jitter {
    type Err = UnknownJitter;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim() {
            "full" => Ok(Jitter::Full),
            "equal" => Ok(Jitter::Equal),
            "decorrelated" => Ok(Jitter::Decorrelated),
            "none" => Ok(Jitter::None),
            _ => Err(UnknownJitter(s.to_string())),
        }
    }
}

/// Parameters of a [`Backoff`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BackoffConfig {
    /// The backoff before the first retry, before jitter; `> 0` and at most `max`. Default 25 ms.
    pub base: Duration,
    /// The cap on any backoff, after jitter; from `base` to 1 h ([`LONGEST_BACKOFF`]). Default
    /// 250 ms: a few retries still fit inside an interactive request's deadline (the deadline
    /// check refuses a retry whose backoff would not).
    pub max: Duration,
    /// The growth per retry, as a fraction in `[1, 10]` (`1` is a constant backoff, `1.5` grows
    /// by half each time). Default `2`.
    pub multiplier: Fraction,
    /// How the backoff is spread. Default [`Jitter::Full`].
    pub jitter: Jitter,
}

impl Default for BackoffConfig {
    fn default() -> Self {
        BackoffConfig {
            base: crate::defaults::BACKOFF_BASE,
            max: crate::defaults::BACKOFF_MAX,
            multiplier: crate::defaults::BACKOFF_MULTIPLIER,
            jitter: Jitter::default(),
        }
    }
}

impl BackoffConfig {
    /// Checks every rule, returning the first broken one.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.base.is_zero() {
            return Err(ConfigError::Zero { key: "base" });
        }
        if self.max < self.base {
            return Err(ConfigError::MaxBelowBase {
                base: format!("{:?}", self.base),
                max: format!("{:?}", self.max),
            });
        }
        if self.max > LONGEST_BACKOFF {
            return Err(ConfigError::TooLarge {
                key: "max",
                max: format!("{LONGEST_BACKOFF:?}"),
                got: format!("{:?}", self.max),
            });
        }
        if self.multiplier < Fraction::ONE || self.multiplier > LARGEST_MULTIPLIER {
            return Err(ConfigError::NotInInterval {
                key: "multiplier",
                min: "1".into(),
                max: LARGEST_MULTIPLIER.to_string(),
                got: self.multiplier.to_string(),
            });
        }
        Ok(())
    }

    /// The default config with `base` and `max` from text such as `25ms..250ms` (each side as
    /// [`parse_duration`] reads it), validated.
    pub fn parse_range(text: &str) -> Result<BackoffConfig, ConfigError> {
        let (base, max) =
            text.split_once("..").ok_or_else(|| ConfigError::NotARange { text: text.into() })?;
        let bad = |key, e: crate::decimal::ParseError| ConfigError::BadValue {
            key,
            reason: e.to_string(),
        };
        let config = BackoffConfig {
            base: parse_duration(base).map_err(|e| bad("base", e))?,
            max: parse_duration(max).map_err(|e| bad("max", e))?,
            ..BackoffConfig::default()
        };
        config.validate()?;
        Ok(config)
    }
}

/// Exponential backoff with jitter. See the [module docs](self).
#[derive(Debug, Clone)]
pub struct Backoff {
    config: BackoffConfig,
    base_nanos: u64,
    max_nanos: u64,
}

impl Backoff {
    /// Builds the backoff, refusing invalid parameters.
    pub fn try_new(config: BackoffConfig) -> Result<Backoff, ConfigError> {
        config.validate()?;
        Ok(Backoff::unchecked(config))
    }

    /// Without validation. The arithmetic still never panics or overflows.
    fn unchecked(config: BackoffConfig) -> Backoff {
        Backoff {
            config,
            base_nanos: duration_nanos(config.base),
            max_nanos: duration_nanos(config.max),
        }
    }

    /// The parameters it was built with.
    pub fn config(&self) -> &BackoffConfig {
        &self.config
    }

    /// The backoff before retry number `retry` (1-based; `0` counts as `1`), before jitter:
    /// `min(max, base × multiplier^(retry − 1))`, rounded down to the nanosecond.
    pub fn exponential(&self, retry: u32) -> Duration {
        Duration::from_nanos(exponential_nanos(
            self.base_nanos,
            self.max_nanos,
            self.config.multiplier.millionths(),
            retry,
        ))
    }

    /// The wait before retry number `retry` (1-based; `0` counts as `1`): the
    /// [exponential](Backoff::exponential) backoff with the configured jitter, never above `max`.
    ///
    /// `previous` is the wait before the previous retry (`None` for the first); only decorrelated
    /// jitter uses it, and counts anything shorter than `base` as `base`.
    pub fn wait<R: RandomSource + ?Sized>(
        &self,
        retry: u32,
        previous: Option<Duration>,
        rng: &mut R,
    ) -> Duration {
        let (base, max) = (self.base_nanos, self.max_nanos);
        let nanos = match self.config.jitter {
            Jitter::Decorrelated => {
                let previous = previous.map_or(base, duration_nanos).max(base);
                rng.u64_in(base..=previous.saturating_mul(3)).min(max)
            }
            jitter => {
                let d = exponential_nanos(base, max, self.config.multiplier.millionths(), retry);
                match jitter {
                    Jitter::Full => rng.u64_in(0..=d),
                    // `d − d/2`, not `d/2`, so an odd `d` can still be reached.
                    Jitter::Equal => d / 2 + rng.u64_in(0..=d - d / 2),
                    Jitter::None | Jitter::Decorrelated => d,
                }
            }
        };
        Duration::from_nanos(nanos)
    }
}

/// `min(max, base × multiplier^(retry − 1))` in nanoseconds, `multiplier` in millionths.
///
/// The power is computed by squaring, in fixed point with 64 fractional bits, rounding down at
/// each step: the result is at most a few parts in 10^10 below the exact value, and still grows
/// with `retry` for every multiplier above one. A power that no longer fits is at least 2^64, so
/// (for a non-zero `base`) the cap wins.
fn exponential_nanos(base: u64, max: u64, multiplier: u64, retry: u32) -> u64 {
    if base == 0 {
        return 0;
    }
    let mut exp = retry.saturating_sub(1);
    let mut square = (u128::from(multiplier) << 64) / MICRO;
    let mut power = FIXED_ONE;
    while exp > 0 {
        if exp & 1 == 1 {
            let Some(p) = mul_fixed(power, square) else {
                return max;
            };
            power = p;
        }
        exp >>= 1;
        if exp > 0 {
            // A square that overflows is a factor of the final power (a higher bit is still
            // set), and it only overflows when the multiplier is above one.
            let Some(s) = mul_fixed(square, square) else {
                return max;
            };
            square = s;
        }
    }
    match mul_fixed(u128::from(base), power) {
        Some(d) => u64::try_from(d).unwrap_or(u64::MAX).min(max),
        None => max,
    }
}

/// One in fixed point with 64 fractional bits.
const FIXED_ONE: u128 = 1 << 64;

/// `floor(a × b / 2^64)`, or `None` when it does not fit in a `u128`.
fn mul_fixed(a: u128, b: u128) -> Option<u128> {
    let (a1, a0) = (a >> 64, a & u128::from(u64::MAX));
    let (b1, b0) = (b >> 64, b & u128::from(u64::MAX));
    // a × b = a1·b1·2^128 + (a1·b0 + a0·b1)·2^64 + a0·b0; each partial product fits in a u128.
    let high = a1 * b1;
    if high > u128::from(u64::MAX) {
        return None;
    }
    (high << 64).checked_add(a1 * b0)?.checked_add(a0 * b1)?.checked_add((a0 * b0) >> 64)
}

/// What the dependency said about retrying. stormguard-http produces it from response headers
/// (`Retry-After`, rate-limit resets, `grpc-retry-pushback-ms`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Pushback {
    /// Retry no sooner than this from now (zero: now).
    RetryAfter(Duration),
    /// Do not retry (for example a negative or unparseable `grpc-retry-pushback-ms`).
    DontRetry,
}

/// Why a pushback means no retry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum PushbackRefusal {
    /// The server said not to retry.
    #[error("the server said not to retry")]
    DontRetry,
    /// The server asked for a longer wait than `max_pushback`.
    #[error("the server asked to wait {asked:?}, longer than max_pushback {max:?}")]
    TooLong {
        /// The wait the server asked for.
        asked: Duration,
        /// The configured `max_pushback`.
        max: Duration,
    },
}

/// How server pushback is honoured. See the [module docs](self).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PushbackPolicy {
    /// The longest pushback still worth waiting for; a longer one means no retry. From zero
    /// (any non-zero pushback refuses the retry) to 24 h ([`LONGEST_PUSHBACK`]). Default 300 s.
    pub max_pushback: Duration,
}

impl Default for PushbackPolicy {
    fn default() -> Self {
        PushbackPolicy { max_pushback: crate::defaults::MAX_PUSHBACK }
    }
}

impl PushbackPolicy {
    /// Checks every rule, returning the first broken one.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.max_pushback > LONGEST_PUSHBACK {
            return Err(ConfigError::TooLarge {
                key: "max_pushback",
                max: format!("{LONGEST_PUSHBACK:?}"),
                got: format!("{:?}", self.max_pushback),
            });
        }
        Ok(())
    }

    /// Builds the policy, refusing invalid parameters.
    pub fn try_new(max_pushback: Duration) -> Result<PushbackPolicy, ConfigError> {
        let policy = PushbackPolicy { max_pushback };
        policy.validate()?;
        Ok(policy)
    }

    /// The wait that replaces the backoff, uniform in `[d, 1.2 d]` (rounded down to the
    /// nanosecond) for a `RetryAfter(d)` with `d ≤ max_pushback`; otherwise why there is no
    /// retry. The wait may end past `max_pushback`: the limit is on what the server asked.
    pub fn decide<R: RandomSource + ?Sized>(
        &self,
        pushback: Pushback,
        rng: &mut R,
    ) -> Result<Duration, PushbackRefusal> {
        match pushback {
            Pushback::DontRetry => Err(PushbackRefusal::DontRetry),
            Pushback::RetryAfter(asked) if asked > self.max_pushback => {
                Err(PushbackRefusal::TooLong { asked, max: self.max_pushback })
            }
            Pushback::RetryAfter(asked) => {
                let d = duration_nanos(asked);
                Ok(Duration::from_nanos(d.saturating_add(rng.u64_in(0..=d / 5))).max(asked))
            }
        }
    }
}

/// "Retries to this upstream are held until `T`", shared by every request to it.
///
/// A pushback is about the upstream, not one request: while it lasts, every retry to that
/// upstream is refused with reason `pushback`. Holds only ever extend (the later time wins), so
/// racing responses cannot shorten one another.
#[derive(Debug)]
pub struct PushbackHold {
    // Nanoseconds of the clock, 0 for no hold (a hold until the clock's zero holds nothing).
    // Relaxed is enough: the value carries no other data, and `fetch_max` makes concurrent holds
    // agree on the latest whatever the interleaving.
    until: AtomicU64,
}

impl PushbackHold {
    /// No hold.
    pub fn new() -> PushbackHold {
        PushbackHold { until: AtomicU64::new(0) }
    }

    /// Holds retries until `until`, unless they are already held until later.
    pub fn hold_until(&self, until: Timestamp) {
        self.until.fetch_max(until.as_nanos(), Ordering::Relaxed);
    }

    /// `Some(until)` while retries are held at `now` (`now < until`), else `None`.
    pub fn is_held(&self, now: Timestamp) -> Option<Timestamp> {
        let until = Timestamp::from_nanos(self.until.load(Ordering::Relaxed));
        (now < until).then_some(until)
    }

    /// Lifts any hold at once (including one a racing response set a moment ago).
    pub fn clear(&self) {
        self.until.store(0, Ordering::Relaxed);
    }
}

impl Default for PushbackHold {
    fn default() -> Self {
        PushbackHold::new()
    }
}

#[cfg(all(test, not(stormguard_loom)))]
mod tests {
    use super::*;
    use crate::random::SplitMix64;
    use proptest::prelude::*;

    const DRAWS: usize = 1_000;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    fn backoff(jitter: Jitter) -> Backoff {
        Backoff::try_new(BackoffConfig { jitter, ..BackoffConfig::default() }).unwrap()
    }

    fn draws(b: &Backoff, retry: u32, previous: Option<Duration>, seed: u64) -> Vec<Duration> {
        let mut rng = SplitMix64::new(seed);
        (0..DRAWS).map(|_| b.wait(retry, previous, &mut rng)).collect()
    }

    fn min_max(v: &[Duration]) -> (Duration, Duration) {
        (*v.iter().min().unwrap(), *v.iter().max().unwrap())
    }

    #[test]
    fn exponential_growth_and_cap() {
        let b = backoff(Jitter::None);
        let expected = [25, 50, 100, 200, 250, 250];
        for (retry, want) in (1..).zip(expected) {
            assert_eq!(b.exponential(retry), ms(want), "retry {retry}");
            assert_eq!(b.wait(retry, None, &mut SplitMix64::new(0)), ms(want));
        }
        assert_eq!(b.exponential(0), ms(25));
        for retry in [64, 65, 128, 1_000, u32::MAX] {
            assert_eq!(b.exponential(retry), ms(250), "retry {retry}");
        }
    }

    #[test]
    fn fractional_and_unit_multipliers() {
        let mut c = BackoffConfig {
            max: Duration::from_secs(1),
            multiplier: "1.5".parse().unwrap(),
            ..BackoffConfig::default()
        };
        let b = Backoff::try_new(c).unwrap();
        assert_eq!(b.exponential(2), Duration::from_micros(37_500));
        assert_eq!(b.exponential(3), Duration::from_micros(56_250));
        c.multiplier = Fraction::ONE;
        let b = Backoff::try_new(c).unwrap();
        assert_eq!(b.exponential(u32::MAX), ms(25));
        // The smallest step above one still grows, and reaches the cap.
        c.multiplier = Fraction::from_millionths(1_000_001);
        let b = Backoff::try_new(c).unwrap();
        assert!(b.exponential(1_000_000) > ms(25));
        assert_eq!(b.exponential(u32::MAX), Duration::from_secs(1));
    }

    #[test]
    fn full_jitter_spans_zero_to_d() {
        for retry in 1..=6 {
            let b = backoff(Jitter::Full);
            let d = b.exponential(retry);
            let v = draws(&b, retry, None, u64::from(retry));
            let (lo, hi) = min_max(&v);
            assert!(hi <= d, "retry {retry}: {hi:?} > {d:?}");
            assert!(lo < d / 4 && hi > d * 3 / 4, "retry {retry}: {lo:?}..{hi:?}");
        }
    }

    #[test]
    fn equal_jitter_stays_in_upper_half() {
        let b = backoff(Jitter::Equal);
        for retry in 1..=6 {
            let d = b.exponential(retry);
            let (lo, hi) = min_max(&draws(&b, retry, None, 7));
            assert!(lo >= d / 2 && hi <= d, "retry {retry}: {lo:?}..{hi:?}");
            assert!(lo < d * 6 / 10 && hi > d * 9 / 10, "retry {retry}: {lo:?}..{hi:?}");
        }
        // An odd number of nanoseconds can still reach d.
        let b = Backoff::try_new(BackoffConfig {
            base: Duration::from_nanos(3),
            max: Duration::from_nanos(3),
            jitter: Jitter::Equal,
            ..BackoffConfig::default()
        })
        .unwrap();
        let v = draws(&b, 1, None, 1);
        assert_eq!(min_max(&v), (Duration::from_nanos(1), Duration::from_nanos(3)));
    }

    #[test]
    fn decorrelated_grows_from_the_previous_wait() {
        let b = backoff(Jitter::Decorrelated);
        // First retry: uniform in [base, 3 × base].
        let (lo, hi) = min_max(&draws(&b, 1, None, 3));
        assert!(lo >= ms(25) && hi <= ms(75), "{lo:?}..{hi:?}");
        assert!(lo < ms(30) && hi > ms(70), "{lo:?}..{hi:?}");
        // After a 40 ms wait: [25, 120] ms.
        let (lo, hi) = min_max(&draws(&b, 2, Some(ms(40)), 4));
        assert!(lo >= ms(25) && hi <= ms(120), "{lo:?}..{hi:?}");
        assert!(lo < ms(35) && hi > ms(110), "{lo:?}..{hi:?}");
        // A previous wait below base counts as base; a long one is capped at max.
        let (lo, hi) = min_max(&draws(&b, 2, Some(Duration::ZERO), 5));
        assert!(lo >= ms(25) && hi <= ms(75));
        let v = draws(&b, 2, Some(Duration::from_secs(10)), 6);
        let (lo, hi) = min_max(&v);
        assert!(lo >= ms(25) && hi == ms(250), "{lo:?}..{hi:?}");
        // A chain of waits stays in [base, max] and does not settle on one value.
        let mut rng = SplitMix64::new(8);
        let mut previous = None;
        let mut chain = Vec::new();
        for retry in 1..=DRAWS as u32 {
            let w = b.wait(retry, previous, &mut rng);
            assert!(w >= ms(25) && w <= ms(250));
            chain.push(w);
            previous = Some(w);
        }
        let (lo, hi) = min_max(&chain);
        assert!(lo < ms(50) && hi > ms(200), "{lo:?}..{hi:?}");
    }

    #[test]
    fn no_jitter_fires_together_and_full_jitter_does_not() {
        // The unprotected path: 100 callers failing at once all retry at the same instant.
        let same = draws(&backoff(Jitter::None), 2, None, 1);
        assert!(same.iter().all(|&w| w == ms(50)));
        let spread = draws(&backoff(Jitter::Full), 2, None, 1);
        let mut distinct = spread.clone();
        distinct.sort();
        distinct.dedup();
        assert!(distinct.len() > DRAWS * 9 / 10);
    }

    #[test]
    fn refuses_bad_config() {
        let ok = BackoffConfig::default();
        assert_eq!(ok.validate(), Ok(()));
        let cases = [
            (BackoffConfig { base: Duration::ZERO, ..ok }, "base"),
            (BackoffConfig { base: ms(300), ..ok }, "max"),
            (BackoffConfig { max: Duration::from_secs(3_601), ..ok }, "max"),
            (BackoffConfig { multiplier: "0.5".parse().unwrap(), ..ok }, "multiplier"),
            (BackoffConfig { multiplier: "10.000001".parse().unwrap(), ..ok }, "multiplier"),
        ];
        for (config, key) in cases {
            let err = Backoff::try_new(config).unwrap_err();
            assert_eq!(err.key(), key, "{err}");
        }
        // The messages users read.
        let err = |config| Backoff::try_new(config).unwrap_err().to_string();
        assert_eq!(
            err(BackoffConfig { base: Duration::ZERO, ..ok }),
            "backoff base must be greater than zero"
        );
        assert_eq!(
            err(BackoffConfig { base: ms(300), ..ok }),
            "backoff max (250ms) must be at least base (300ms)"
        );
        assert_eq!(
            err(BackoffConfig { max: Duration::from_secs(3_601), ..ok }),
            "backoff max must be at most 3600s, got 3601s"
        );
        assert_eq!(
            err(BackoffConfig { multiplier: "0.5".parse().unwrap(), ..ok }),
            "backoff multiplier must be in [1, 10], got 0.5"
        );
        // The edges are allowed.
        for config in [
            BackoffConfig { base: ms(250), ..ok },
            BackoffConfig { max: LONGEST_BACKOFF, multiplier: LARGEST_MULTIPLIER, ..ok },
            BackoffConfig { multiplier: Fraction::ONE, ..ok },
        ] {
            assert!(Backoff::try_new(config).is_ok(), "{config:?}");
        }
    }

    #[test]
    fn parses_ranges() {
        let c = BackoffConfig::parse_range("25ms..250ms").unwrap();
        assert_eq!((c.base, c.max), (ms(25), ms(250)));
        assert_eq!(c.jitter, Jitter::Full);
        let c = BackoffConfig::parse_range(" 1.5s .. 3s ").unwrap();
        assert_eq!((c.base, c.max), (ms(1_500), ms(3_000)));
        for (bad, key) in [
            ("25ms", "backoff"),
            ("25ms-250ms", "backoff"),
            ("..250ms", "base"),
            ("25ms..", "max"),
            ("fast..slow", "base"),
            ("250ms..25ms", "max"),
            ("0s..1s", "base"),
            ("1s..2h", "max"),
        ] {
            let err = BackoffConfig::parse_range(bad).unwrap_err();
            assert_eq!(err.key(), key, "{bad}: {err}");
        }
        assert!(matches!(
            BackoffConfig::parse_range("25ms"),
            Err(ConfigError::NotARange { text }) if text == "25ms"
        ));
        assert!(matches!(
            BackoffConfig::parse_range("fast..slow"),
            Err(ConfigError::BadValue { key: "base", .. })
        ));
        let err = BackoffConfig::parse_range("25ms").unwrap_err().to_string();
        assert_eq!(err, "`25ms` is not a backoff range (e.g. 25ms..250ms)");
        let err = BackoffConfig::parse_range("fast..slow").unwrap_err().to_string();
        assert!(err.starts_with("backoff base: "), "{err}");
    }

    #[test]
    fn jitter_tokens_round_trip() {
        for j in [Jitter::Full, Jitter::Equal, Jitter::Decorrelated, Jitter::None] {
            assert_eq!(j.to_string().parse::<Jitter>(), Ok(j));
        }
        assert_eq!(Jitter::default(), Jitter::Full);
        let err = "random".parse::<Jitter>().unwrap_err();
        assert_eq!(err.to_string(), "`random` is not a jitter (full, equal, decorrelated or none)");
    }

    #[test]
    fn pushback_is_jittered_upward() {
        let policy = PushbackPolicy::default();
        for (seed, d) in [(1, ms(10)), (2, Duration::from_secs(2)), (3, Duration::from_secs(300))] {
            let mut rng = SplitMix64::new(seed);
            let waits: Vec<_> = (0..DRAWS)
                .map(|_| policy.decide(Pushback::RetryAfter(d), &mut rng).unwrap())
                .collect();
            let (lo, hi) = min_max(&waits);
            assert!(lo >= d && hi <= d * 6 / 5, "{d:?}: {lo:?}..{hi:?}");
            // Spread over the band, not bunched at its start.
            assert!(lo < d * 101 / 100 && hi > d * 119 / 100, "{d:?}: {lo:?}..{hi:?}");
        }
    }

    #[test]
    fn callers_held_by_one_retry_after_do_not_fire_together() {
        let policy = PushbackPolicy::default();
        let mut rng = SplitMix64::new(9);
        let mut waits: Vec<_> = (0..100)
            .map(|_| policy.decide(Pushback::RetryAfter(Duration::from_secs(1)), &mut rng).unwrap())
            .collect();
        waits.sort();
        waits.dedup();
        assert!(waits.len() > 95);
    }

    #[test]
    fn pushback_longer_than_max_is_refused_not_shortened() {
        let policy = PushbackPolicy::default();
        let mut rng = SplitMix64::new(1);
        let at_max =
            policy.decide(Pushback::RetryAfter(Duration::from_secs(300)), &mut rng).unwrap();
        assert!(at_max >= Duration::from_secs(300));
        let asked = Duration::from_secs(300) + Duration::from_nanos(1);
        assert_eq!(
            policy.decide(Pushback::RetryAfter(asked), &mut rng),
            Err(PushbackRefusal::TooLong { asked, max: Duration::from_secs(300) })
        );
        assert_eq!(policy.decide(Pushback::DontRetry, &mut rng), Err(PushbackRefusal::DontRetry));
        // max_pushback 0: only "retry now" is honoured.
        let strict = PushbackPolicy::try_new(Duration::ZERO).unwrap();
        assert_eq!(
            strict.decide(Pushback::RetryAfter(Duration::ZERO), &mut rng),
            Ok(Duration::ZERO)
        );
        assert!(strict.decide(Pushback::RetryAfter(Duration::from_nanos(1)), &mut rng).is_err());
        assert_eq!(
            PushbackRefusal::TooLong {
                asked: Duration::from_secs(600),
                max: Duration::from_secs(300)
            }
            .to_string(),
            "the server asked to wait 600s, longer than max_pushback 300s"
        );
    }

    #[test]
    fn zero_pushback_means_now() {
        let mut rng = SplitMix64::new(1);
        for _ in 0..10 {
            assert_eq!(
                PushbackPolicy::default().decide(Pushback::RetryAfter(Duration::ZERO), &mut rng),
                Ok(Duration::ZERO)
            );
        }
    }

    #[test]
    fn refuses_bad_pushback_policy() {
        assert!(PushbackPolicy::try_new(LONGEST_PUSHBACK).is_ok());
        let err = PushbackPolicy::try_new(LONGEST_PUSHBACK + Duration::from_secs(1)).unwrap_err();
        assert!(matches!(err, ConfigError::TooLarge { key: "max_pushback", .. }), "{err}");
    }

    #[test]
    fn hold_keeps_the_later_time() {
        let t = Timestamp::from_millis;
        let hold = PushbackHold::default();
        assert_eq!(hold.is_held(Timestamp::ZERO), None);
        hold.hold_until(t(10));
        hold.hold_until(t(5));
        assert_eq!(hold.is_held(t(0)), Some(t(10)));
        assert_eq!(hold.is_held(t(9)), Some(t(10)));
        assert_eq!(hold.is_held(t(10)), None);
        hold.hold_until(t(20));
        assert_eq!(hold.is_held(t(15)), Some(t(20)));
        hold.clear();
        assert_eq!(hold.is_held(t(15)), None);
        hold.hold_until(Timestamp::ZERO);
        assert_eq!(hold.is_held(Timestamp::ZERO), None);
        hold.hold_until(Timestamp::MAX);
        assert_eq!(hold.is_held(Timestamp::from_nanos(u64::MAX - 1)), Some(Timestamp::MAX));
        assert_eq!(hold.is_held(Timestamp::MAX), None);
    }

    #[test]
    fn concurrent_holds_agree_on_the_latest() {
        let hold = PushbackHold::new();
        std::thread::scope(|s| {
            for i in 1..=8u64 {
                let hold = &hold;
                s.spawn(move || {
                    for j in 0..1_000 {
                        hold.hold_until(Timestamp::from_nanos(i * 1_000 + j));
                    }
                });
            }
        });
        assert_eq!(hold.is_held(Timestamp::ZERO), Some(Timestamp::from_nanos(8_999)));
    }

    fn any_jitter() -> impl Strategy<Value = Jitter> {
        prop_oneof![
            Just(Jitter::Full),
            Just(Jitter::Equal),
            Just(Jitter::Decorrelated),
            Just(Jitter::None),
        ]
    }

    proptest! {
        #[test]
        fn no_input_panics_or_overflows(
            base: u64,
            max: u64,
            multiplier: u64,
            retry: u32,
            previous in proptest::option::of(any::<u64>()),
            jitter in any_jitter(),
            seed: u64,
        ) {
            // Unvalidated on purpose: the arithmetic itself must hold for every input.
            let b = Backoff::unchecked(BackoffConfig {
                base: Duration::from_nanos(base),
                max: Duration::from_nanos(max),
                multiplier: Fraction::from_millionths(multiplier),
                jitter,
            });
            let mut rng = SplitMix64::new(seed);
            let w = b.wait(retry, previous.map(Duration::from_nanos), &mut rng);
            prop_assert!(w <= Duration::from_nanos(max));
            prop_assert!(b.exponential(retry) <= Duration::from_nanos(max));
            let _ = b.wait(retry, Some(Duration::MAX), &mut rng);
        }

        #[test]
        fn valid_configs_stay_in_range(
            base in 1u64..=3_600_000_000_000,
            extra in 0u64..=3_600_000_000_000,
            multiplier in 1_000_000u64..=10_000_000,
            retry: u32,
            jitter in any_jitter(),
            seed: u64,
        ) {
            let max = base.saturating_add(extra).min(3_600_000_000_000);
            let b = Backoff::try_new(BackoffConfig {
                base: Duration::from_nanos(base),
                max: Duration::from_nanos(max),
                multiplier: Fraction::from_millionths(multiplier),
                jitter,
            }).unwrap();
            let d = b.exponential(retry);
            prop_assert!(Duration::from_nanos(base) <= d && d <= Duration::from_nanos(max));
            // Growth never goes backwards.
            prop_assert!(b.exponential(retry.saturating_add(1)) >= d);
            let mut rng = SplitMix64::new(seed);
            let w = b.wait(retry, None, &mut rng);
            match jitter {
                Jitter::Full => prop_assert!(w <= d),
                Jitter::Equal => prop_assert!(d / 2 <= w && w <= d),
                Jitter::None => prop_assert_eq!(w, d),
                Jitter::Decorrelated => prop_assert!(
                    Duration::from_nanos(base) <= w && w <= Duration::from_nanos(max)
                ),
            }
        }

        #[test]
        fn pushback_never_panics(asked: u64, max: u64, seed: u64) {
            let policy = PushbackPolicy { max_pushback: Duration::from_nanos(max) };
            let mut rng = SplitMix64::new(seed);
            let asked = Duration::from_nanos(asked);
            match policy.decide(Pushback::RetryAfter(asked), &mut rng) {
                Ok(w) => {
                    prop_assert!(asked <= policy.max_pushback);
                    prop_assert!(asked <= w);
                    prop_assert!(w.as_nanos() <= asked.as_nanos() * 6 / 5);
                }
                Err(refusal) => prop_assert_eq!(
                    refusal,
                    PushbackRefusal::TooLong { asked, max: policy.max_pushback }
                ),
            }
            let huge = PushbackPolicy { max_pushback: Duration::MAX };
            prop_assert!(huge.decide(Pushback::RetryAfter(Duration::MAX), &mut rng).is_ok());
        }
    }
}
