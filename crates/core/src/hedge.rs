//! Hedged requests: when an attempt has not answered after a delay, a second one is sent and the
//! first complete answer wins.
//!
//! A hedge is another kind of attempt. It spends the retry budget (the same one retries spend),
//! takes its slot with `try_acquire` (never queues), is sent only for an idempotent request, and
//! never while a pushback hold or an open breaker forbids retries — the retry rules' own checks,
//! in [`RetryPolicy::decide_hedge`](crate::decision::RetryPolicy::decide_hedge). Its refusals
//! are counted by the same reasons, as hedges. The loser keeps its slot until the dependency has
//! finished it (the abandoned-attempt rules of the layers above).
//!
//! When to hedge ([`HedgeAfter`]): after a fixed delay (`"100ms"`), or after a percentile of the
//! attempts' recent execution time (`"p95"`), read from the limiter's execution histogram over
//! the last second or more (at least [`MIN_SAMPLES`] attempts; until then, no hedge), never
//! below a floor. The percentile is a bucket's upper bound, so it errs late, not early.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use crate::clock::Timestamp;
use crate::histogram::HistogramSnapshot;
use crate::limiter::Limiter;
use crate::sync::{AtomicU64, Mutex, Ordering};

/// The most hedges per request.
pub const MAX_HEDGES_LIMIT: u32 = 3;
/// Attempts a percentile window needs before it is trusted.
pub const MIN_SAMPLES: u64 = 20;
/// How often the percentile is read again.
pub const REFRESH: Duration = Duration::from_secs(1);
/// The floor of a percentile's delay when none is given.
pub const DEFAULT_FLOOR: Duration = Duration::from_millis(10);

/// When a hedge is sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HedgeAfter {
    /// After this long without an answer.
    Fixed(Duration),
    /// After this percentile of recent attempt time, in permille (950: p95), at least `floor`.
    Percentile {
        /// The percentile, in permille, `1..=999`.
        permille: u16,
        /// The least delay.
        floor: Duration,
    },
}

/// Hedging's parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HedgeConfig {
    /// When.
    pub after: HedgeAfter,
    /// Hedges per request at most, `1..=3`. Default 1.
    pub max_hedges: u32,
}

impl HedgeConfig {
    /// Hedging after `after`, once.
    pub fn new(after: HedgeAfter) -> HedgeConfig {
        HedgeConfig { after, max_hedges: 1 }
    }

    /// Checks the rules: a delay above zero, a percentile in `p0.1..=p99.9`, `max_hedges` in
    /// `1..=3`.
    pub fn validate(&self) -> Result<(), crate::ConfigError> {
        if !(1..=MAX_HEDGES_LIMIT).contains(&self.max_hedges) {
            return Err(crate::ConfigError::TooLarge {
                key: "max_hedges",
                max: MAX_HEDGES_LIMIT.to_string(),
                got: self.max_hedges.to_string(),
            });
        }
        match self.after {
            HedgeAfter::Fixed(d) if d.is_zero() => {
                Err(crate::ConfigError::Zero { key: "hedge_after" })
            }
            HedgeAfter::Percentile { permille, .. } if !(1..=999).contains(&permille) => {
                Err(crate::ConfigError::TooLarge {
                    key: "hedge_after",
                    max: "p99.9".into(),
                    got: format!("{permille}‰"),
                })
            }
            _ => Ok(()),
        }
    }
}

/// A `hedge_after` that does not read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("`{0}` is not a delay (\"100ms\") or a percentile (\"p95\", \"p99.9\")")]
pub struct BadHedgeAfter(pub String);

impl FromStr for HedgeAfter {
    type Err = BadHedgeAfter;

    /// `"100ms"`, `"1s"` (a fixed delay), or `"p95"`, `"p99.9"` (a percentile, with the
    /// default floor).
    fn from_str(s: &str) -> Result<HedgeAfter, BadHedgeAfter> {
        let bad = || BadHedgeAfter(s.to_string());
        if let Some(p) = s.strip_prefix('p') {
            let (whole, tenth) = match p.split_once('.') {
                Some((w, t)) if t.len() == 1 => (w, t),
                Some(_) => return Err(bad()),
                None => (p, "0"),
            };
            let whole: u16 = whole.parse().map_err(|_| bad())?;
            let tenth: u16 = tenth.parse().map_err(|_| bad())?;
            let permille =
                whole.checked_mul(10).and_then(|w| w.checked_add(tenth)).ok_or_else(bad)?;
            if !(1..=999).contains(&permille) {
                return Err(bad());
            }
            return Ok(HedgeAfter::Percentile { permille, floor: DEFAULT_FLOOR });
        }
        crate::decimal::parse_duration(s).map(HedgeAfter::Fixed).map_err(|_| bad())
    }
}

impl fmt::Display for HedgeAfter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HedgeAfter::Fixed(d) => write!(f, "{}ms", d.as_millis()),
            HedgeAfter::Percentile { permille, .. } if permille % 10 == 0 => {
                write!(f, "p{}", permille / 10)
            }
            HedgeAfter::Percentile { permille, .. } => {
                write!(f, "p{}.{}", permille / 10, permille % 10)
            }
        }
    }
}

/// The delay a policy hedges after, with a percentile's window (shared by every request).
#[derive(Debug)]
pub struct HedgeDelay {
    /// The percentile's delay in nanoseconds; `u64::MAX`: none yet.
    cached: AtomicU64,
    /// When it was last read (nanoseconds on the limiter's clock); `u64::MAX`: never.
    read_at: AtomicU64,
    /// The histogram at the start of the current window.
    since: Mutex<Option<HistogramSnapshot>>,
}

impl Default for HedgeDelay {
    fn default() -> HedgeDelay {
        HedgeDelay::new()
    }
}

impl HedgeDelay {
    /// A delay with no percentile read yet.
    pub fn new() -> HedgeDelay {
        HedgeDelay {
            cached: AtomicU64::new(u64::MAX),
            read_at: AtomicU64::new(u64::MAX),
            since: Mutex::new(None),
        }
    }

    /// How long after an attempt is sent its hedge goes, at `now`; `None` when no hedge is due
    /// (a percentile with too few recent attempts, or past the histogram's last bound).
    pub fn delay(&self, after: HedgeAfter, limiter: &Limiter, now: Timestamp) -> Option<Duration> {
        let (permille, floor) = match after {
            HedgeAfter::Fixed(d) => return Some(d),
            HedgeAfter::Percentile { permille, floor } => (permille, floor),
        };
        let read_at = self.read_at.load(Ordering::Relaxed);
        let refresh = u64::try_from(REFRESH.as_nanos()).unwrap_or(u64::MAX);
        if read_at == u64::MAX || now.as_nanos().saturating_sub(read_at) >= refresh {
            self.read(permille, floor, limiter, now);
        }
        match self.cached.load(Ordering::Relaxed) {
            u64::MAX => None,
            n => Some(Duration::from_nanos(n)),
        }
    }

    /// Reads the percentile of the attempts since the window began, when there are enough.
    fn read(&self, permille: u16, floor: Duration, limiter: &Limiter, now: Timestamp) {
        // One reader at a time; the others keep the cached value.
        let Some(mut since) = self.since.try_lock() else { return };
        self.read_at.store(now.as_nanos(), Ordering::Relaxed);
        let all = limiter.execution_histogram();
        let window = match since.as_ref() {
            Some(before) => difference(&all, before),
            None => all.clone(),
        };
        if window.count < MIN_SAMPLES {
            return;
        }
        let q = f64::from(permille) / 1000.0;
        let nanos = match window.quantile_bound(q) {
            Some(b) => b.max(u64::try_from(floor.as_nanos()).unwrap_or(u64::MAX)),
            None => u64::MAX,
        };
        self.cached.store(nanos, Ordering::Relaxed);
        *since = Some(all);
    }
}

/// `now − before`, bucket by bucket (same bounds).
fn difference(now: &HistogramSnapshot, before: &HistogramSnapshot) -> HistogramSnapshot {
    let counts: Vec<u64> = now
        .counts
        .iter()
        .zip(before.counts.iter().chain(std::iter::repeat(&0)))
        .map(|(a, b)| a.saturating_sub(*b))
        .collect();
    HistogramSnapshot {
        bounds: now.bounds.clone(),
        count: counts.iter().sum(),
        counts,
        sum: now.sum.saturating_sub(before.sum),
    }
}

#[cfg(all(test, not(stormguard_loom)))]
mod tests {
    use super::*;
    use crate::clock::{Clock, ManualClock};
    use crate::limiter::{AttemptKind, LimiterConfig};
    use std::sync::Arc;

    #[test]
    fn hedge_after_reads_delays_and_percentiles() {
        assert_eq!("100ms".parse(), Ok(HedgeAfter::Fixed(Duration::from_millis(100))));
        assert_eq!(
            "p95".parse(),
            Ok(HedgeAfter::Percentile { permille: 950, floor: DEFAULT_FLOOR })
        );
        assert_eq!(
            "p99.9".parse::<HedgeAfter>().unwrap(),
            HedgeAfter::Percentile { permille: 999, floor: DEFAULT_FLOOR }
        );
        for bad in ["p100", "p0", "p99.95", "pxx", "fast", ""] {
            assert!(bad.parse::<HedgeAfter>().is_err(), "{bad}");
        }
        assert_eq!("p99.9".parse::<HedgeAfter>().unwrap().to_string(), "p99.9");
    }

    /// The percentile follows the last window's attempts, never below the floor, and waits for
    /// enough of them.
    #[test]
    fn a_percentile_follows_recent_attempts() {
        let clock = Arc::new(ManualClock::new());
        let limiter =
            Limiter::try_new(LimiterConfig { cap: 100, ..Default::default() }, clock.clone())
                .unwrap();
        let after = HedgeAfter::Percentile { permille: 950, floor: Duration::from_millis(1) };
        let d = HedgeDelay::new();
        let run = |ms: u64, n: usize| {
            for _ in 0..n {
                let p = limiter.try_acquire(AttemptKind::Primary).unwrap();
                let start = clock.now();
                p.release_at(start.saturating_add(Duration::from_millis(ms)));
            }
        };
        run(20, 10);
        assert_eq!(d.delay(after, &limiter, clock.now()), None, "too few attempts");
        clock.advance(REFRESH);
        run(20, 100);
        let first = d.delay(after, &limiter, clock.now()).unwrap();
        assert!(
            first >= Duration::from_millis(20) && first <= Duration::from_millis(50),
            "{first:?}"
        );
        // A slower second: the window is only the new attempts.
        clock.advance(REFRESH);
        run(400, 100);
        let second = d.delay(after, &limiter, clock.now()).unwrap();
        assert!(second >= Duration::from_millis(400), "{second:?}");
        assert_eq!(
            d.delay(HedgeAfter::Fixed(Duration::from_millis(7)), &limiter, clock.now()),
            Some(Duration::from_millis(7))
        );
    }
}
