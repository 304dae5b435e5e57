//! An adaptive cap: the limit the dependency can take today, learned from the latency of its
//! answers and from its refusals.
//!
//! The planned cap is where the working cap starts; `max` is its ceiling and `min` its floor.
//! Every released attempt is a sample: its time from admission to release, the attempts in
//! flight when it was admitted, and whether it was *dropped* (answered 429, 503 or 529, or timed
//! out on our side). Samples are gathered in windows of at least [`AdaptiveConfig::window`] and
//! [`MIN_SAMPLES`] answers; at each window's end the algorithm moves the working cap:
//!
//! - **Gradient2** (the default; Netflix concurrency-limits' `Gradient2Limit`, the idea of
//!   Envoy's adaptive concurrency filter): the window's mean latency (*current*) against a
//!   *baseline*, the average of the first [`WARM_UP`] windows (the cap holds still meanwhile,
//!   so the baseline is the planned cap's latency) and then an exponential average
//!   over [`BASELINE_WINDOWS`] windows (cut by 5 % a window while it is more than twice the
//!   current latency: a recovery); `gradient = clamp(tolerance × baseline / current, 0.5, 1)`
//!   and `target = gradient × limit + min(√limit, 4)` (the queue allowance; Netflix's default
//!   is 4). The cap moves [`SMOOTHING`] of the way to the target each window, both ways, so the
//!   noise of one window's mean averages out instead of ratcheting the cap down. At the fixed
//!   point a dependency that slows past `w` in flight sees about `tolerance × w + 4`.
//! - **AIMD** (AWS's adaptive retry mode, TCP): `+1` after a window without drops, `× 0.9`
//!   after one with; latency is not read.
//!
//! Both **fall fast** on drops: a window in which more than [`DROP_SHARE`] of the answers were
//! drops lowers the cap to at most 90 % of it at once (a few percent of 503s from a healthy
//! dependency, or timeouts near its p99, are not overload). A window whose attempts used less
//! than half the cap never raises it (a quiet hour does not leave a cap the dependency never
//! proved it can take). The working cap stays in `[min, max]`, and a change never revokes a
//! permit: a lower cap takes effect as attempts end.
//!
//! The baseline is learned from the first windows' answers, so the start matters: a working cap
//! that starts far above what the dependency can take, under load that keeps it full, learns a
//! baseline that is already slow (Envoy's filter probes at its minimum from time to time for
//! this; this algorithm does not) — start at the planned cap.
//!
//! The per-attempt cost is one atomic add (the window's count and latency packed in one word)
//! and a load; the window's end takes a lock, once.

use std::time::Duration;

use crate::clock::Timestamp;
use crate::error::ConfigError;
use crate::sync::{AtomicU64, Mutex, Ordering};

/// Answers a window needs before the cap moves.
pub const MIN_SAMPLES: u64 = 10;
/// Windows the Gradient2 baseline averages over, after the warm-up.
pub const BASELINE_WINDOWS: f64 = 600.0;
/// Windows whose plain average is the first baseline.
pub const WARM_UP: u64 = 10;
/// Gradient2 moves this share of the way to its target per window.
pub const SMOOTHING: f64 = 0.2;
/// A window with drops lowers the cap to at most this share of it.
pub const BACKOFF: f64 = 0.9;
/// A window is a drop window when more than this share of its answers were drops.
pub const DROP_SHARE: f64 = 0.1;
/// Gradient2's largest queue allowance: how far the cap may grow past what the latency says.
pub const QUEUE_ALLOWANCE: f64 = 4.0;
/// The default least time a window gathers samples.
pub const DEFAULT_WINDOW: Duration = Duration::from_secs(1);

/// How the working cap is learned.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Algorithm {
    /// Latency against a long-window baseline, with a queue allowance (the default).
    #[default]
    Gradient2,
    /// Additive increase, multiplicative decrease on drops.
    Aimd,
}

impl std::str::FromStr for Algorithm {
    type Err = ConfigError;

    fn from_str(s: &str) -> Result<Algorithm, ConfigError> {
        match s {
            "gradient2" => Ok(Algorithm::Gradient2),
            "aimd" => Ok(Algorithm::Aimd),
            other => Err(ConfigError::BadValue {
                key: "algorithm",
                reason: format!("`{other}` is not \"gradient2\" or \"aimd\""),
            }),
        }
    }
}

impl std::fmt::Display for Algorithm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Algorithm::Gradient2 => "gradient2",
            Algorithm::Aimd => "aimd",
        })
    }
}

/// An adaptive cap's parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AdaptiveConfig {
    /// The least working cap, `1..=max`.
    pub min: u64,
    /// The ceiling.
    pub max: u64,
    /// How it is learned.
    pub algorithm: Algorithm,
    /// The least time a window gathers samples (default 1 s).
    pub window: Duration,
    /// Gradient2's tolerance, in percent: latency up to `tolerance %` of the baseline is not
    /// queueing (default 100; Netflix's 150 lets a dependency that slows past `w` in flight
    /// see about `1.5 w`).
    pub tolerance: u32,
}

impl AdaptiveConfig {
    /// Adapting within `min..=max` by Gradient2, with the default window and tolerance.
    pub fn new(min: u64, max: u64) -> AdaptiveConfig {
        AdaptiveConfig {
            min,
            max,
            algorithm: Algorithm::Gradient2,
            window: DEFAULT_WINDOW,
            tolerance: 100,
        }
    }

    /// Checks the rules: `1 <= min <= max <= max_cap`, a window above zero, a tolerance in
    /// `100..=400` %.
    pub fn validate(&self, max_cap: u64) -> Result<(), ConfigError> {
        if self.min == 0 || self.min > self.max {
            return Err(ConfigError::OutOfRange {
                key: "adaptive.min",
                min: "1".into(),
                max: self.max.to_string(),
                got: self.min.to_string(),
            });
        }
        if self.max > max_cap {
            return Err(ConfigError::TooLarge {
                key: "adaptive.max",
                max: max_cap.to_string(),
                got: self.max.to_string(),
            });
        }
        if self.window.is_zero() {
            return Err(ConfigError::Zero { key: "adaptive.window" });
        }
        if !(100..=400).contains(&self.tolerance) {
            return Err(ConfigError::OutOfRange {
                key: "adaptive.tolerance",
                min: "100".into(),
                max: "400".into(),
                got: self.tolerance.to_string(),
            });
        }
        Ok(())
    }
}

/// A `min..max` range that does not read (`--adaptive-cap 4..40`), and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BadRange {
    /// Not two whole numbers around `..`.
    #[error("`{0}` is not a range of caps such as 4..40")]
    NotRange(String),
    /// A floor of 0: the working cap could fall to nothing.
    #[error("the floor is 0: an adaptive cap's floor is at least 1 (MIN..MAX, such as 4..40)")]
    ZeroFloor,
    /// The floor above the ceiling.
    #[error("the floor {min} is above the ceiling {max} (MIN..MAX, such as 4..40)")]
    FloorAboveCeiling {
        /// The floor given.
        min: u64,
        /// The ceiling given.
        max: u64,
    },
}

impl std::str::FromStr for AdaptiveConfig {
    type Err = BadRange;

    /// `"4..40"`: Gradient2 between 4 and 40.
    fn from_str(s: &str) -> Result<AdaptiveConfig, BadRange> {
        let bad = || BadRange::NotRange(s.to_string());
        let (lo, hi) = s.split_once("..").ok_or_else(bad)?;
        let min: u64 = lo.trim().parse().map_err(|_| bad())?;
        let max: u64 = hi.trim().parse().map_err(|_| bad())?;
        if min == 0 {
            return Err(BadRange::ZeroFloor);
        }
        if min > max {
            return Err(BadRange::FloorAboveCeiling { min, max });
        }
        Ok(AdaptiveConfig::new(min, max))
    }
}

/// What the algorithm shows.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdaptiveSnapshot {
    /// The working cap.
    pub limit: u64,
    /// Its floor and ceiling.
    pub min: u64,
    /// The ceiling.
    pub max: u64,
    /// Windows that raised it, and that lowered it.
    pub raised: u64,
    /// Windows that lowered it.
    pub lowered: u64,
    /// The baseline latency (Gradient2), `None` before the first window.
    pub baseline: Option<Duration>,
    /// The last window's mean latency, `None` before the first window.
    pub current: Option<Duration>,
}

/// Bits of the packed window word that count samples; the rest sums their latency in µs.
const COUNT_BITS: u32 = 20;
const COUNT_MASK: u64 = (1 << COUNT_BITS) - 1;
/// A window this full closes whatever its age, long before the count could overflow.
const FULL: u64 = 1 << (COUNT_BITS - 1);
/// The longest sample, in µs: `FULL` of them sum within the word's high 44 bits.
const MAX_SAMPLE_US: u64 = 1 << 24;

/// A working cap that follows what the dependency can take.
#[derive(Debug)]
pub struct AdaptiveLimit {
    config: AdaptiveConfig,
    /// The working cap.
    limit: AtomicU64,
    /// This window's samples: count (low [`COUNT_BITS`]) and latency sum in µs (high bits).
    window: AtomicU64,
    /// Drops in this window.
    drops: AtomicU64,
    /// The most in flight a sample of this window was admitted with.
    in_flight: AtomicU64,
    /// When this window began (nanoseconds).
    started: AtomicU64,
    raised: AtomicU64,
    lowered: AtomicU64,
    /// Baseline and current latency, nanoseconds (`u64::MAX`: none yet), for the signals.
    baseline_ns: AtomicU64,
    current_ns: AtomicU64,
    state: Mutex<State>,
}

#[derive(Debug)]
struct State {
    /// The working cap, unrounded.
    estimate: f64,
    baseline: Baseline,
}

/// Gradient2's baseline latency.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Baseline {
    /// In µs; 0 before the first window.
    pub us: f64,
    /// Windows read so far.
    pub windows: u64,
}

impl Baseline {
    /// Takes a window's mean latency `current` (µs).
    fn read(&mut self, current: f64) {
        self.windows += 1;
        self.us = if self.windows <= WARM_UP {
            self.us + (current - self.us) / self.windows as f64
        } else {
            self.us + (current - self.us) / BASELINE_WINDOWS
        };
        // Far above what the dependency answers in now: it recovered from a slow spell that
        // the average had taken in.
        if self.us > 2.0 * current {
            self.us *= 0.95;
        }
    }
}

/// One window's samples.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Window {
    /// Answers, drops included.
    pub samples: u64,
    /// The mean latency of the answers that were not drops, µs.
    pub mean_us: f64,
    /// How many were drops (counted in `samples`, not in `mean_us`).
    pub drops: u64,
    /// The most in flight one was admitted with.
    pub in_flight: u64,
}

impl AdaptiveLimit {
    /// Starting at `initial` (clamped into `[min, max]`), the window beginning at `now`.
    pub fn new(config: AdaptiveConfig, initial: u64, now: Timestamp) -> AdaptiveLimit {
        let initial = initial.clamp(config.min, config.max);
        AdaptiveLimit {
            config,
            limit: AtomicU64::new(initial),
            window: AtomicU64::new(0),
            drops: AtomicU64::new(0),
            in_flight: AtomicU64::new(0),
            started: AtomicU64::new(now.as_nanos()),
            raised: AtomicU64::new(0),
            lowered: AtomicU64::new(0),
            baseline_ns: AtomicU64::new(u64::MAX),
            current_ns: AtomicU64::new(u64::MAX),
            state: Mutex::new(State { estimate: initial as f64, baseline: Baseline::default() }),
        }
    }

    /// Its parameters.
    pub fn config(&self) -> &AdaptiveConfig {
        &self.config
    }

    /// The working cap now.
    #[inline]
    pub fn limit(&self) -> u64 {
        self.limit.load(Ordering::Relaxed)
    }

    /// The dependency answered an attempt at `now` after `latency`, admitted with `in_flight`
    /// attempts in flight (itself included); `dropped` when it refused it for overload or it
    /// timed out — a drop counts in the window's drop share, and its latency (a fast refusal,
    /// or the timeout) is not averaged. Returns the new working cap when this sample closed a
    /// window that moved it.
    #[inline]
    pub fn sample(
        &self,
        now: Timestamp,
        latency: Duration,
        in_flight: u64,
        dropped: bool,
    ) -> Option<u64> {
        if in_flight > self.in_flight.load(Ordering::Relaxed) {
            self.in_flight.fetch_max(in_flight, Ordering::Relaxed);
        }
        let count = if dropped {
            let drops = self.drops.fetch_add(1, Ordering::Relaxed) + 1;
            drops + (self.window.load(Ordering::Relaxed) & COUNT_MASK)
        } else {
            // At most ~16.8 s a sample, so a full window's sum fits the word's high bits.
            let us = u64::try_from(latency.as_micros()).unwrap_or(u64::MAX).min(MAX_SAMPLE_US);
            let packed = self.window.fetch_add((us << COUNT_BITS) | 1, Ordering::Relaxed) + 1;
            packed & COUNT_MASK
        };
        let window = crate::clock::duration_nanos(self.config.window);
        let full = count >= FULL;
        if !full
            && (count < MIN_SAMPLES
                || now.as_nanos().saturating_sub(self.started.load(Ordering::Relaxed)) < window)
        {
            return None;
        }
        self.close(now, full)
    }

    /// Ends the window (one closer at a time; the others' samples join the next window), or a
    /// window that is `full` before its time.
    #[cold]
    fn close(&self, now: Timestamp, full: bool) -> Option<u64> {
        let mut state = self.state.try_lock()?;
        let started = self.started.load(Ordering::Relaxed);
        let window = crate::clock::duration_nanos(self.config.window);
        // Re-read under the lock: another closer may have ended this window first.
        let seen =
            (self.window.load(Ordering::Relaxed) & COUNT_MASK) + self.drops.load(Ordering::Relaxed);
        let due = seen >= MIN_SAMPLES && now.as_nanos().saturating_sub(started) >= window;
        if !(due || full && seen >= FULL) {
            return None;
        }
        let packed = self.window.swap(0, Ordering::Relaxed);
        let answered = packed & COUNT_MASK;
        let drops = self.drops.swap(0, Ordering::Relaxed);
        self.started.store(now.as_nanos(), Ordering::Relaxed);
        let w = Window {
            samples: answered + drops,
            // A window of drops only: its latency is not known, the baseline's stands in.
            mean_us: match answered {
                0 => state.baseline.us,
                n => (packed >> COUNT_BITS) as f64 / n as f64,
            },
            drops,
            in_flight: self.in_flight.swap(0, Ordering::Relaxed),
        };
        let before = self.limit.load(Ordering::Relaxed);
        let State { estimate, baseline } = &mut *state;
        *estimate = next_limit(&self.config, baseline, *estimate, &w);
        let (estimate, baseline) = (*estimate, baseline.us);
        let after = (estimate.round() as u64).clamp(self.config.min, self.config.max);
        if answered > 0 {
            self.current_ns.store((w.mean_us * 1000.0) as u64, Ordering::Relaxed);
        }
        if baseline > 0.0 {
            self.baseline_ns.store((baseline * 1000.0) as u64, Ordering::Relaxed);
        }
        if after == before {
            return None;
        }
        // Stored under the lock, so a later window's cap is never overwritten by this one's.
        self.limit.store(after, Ordering::Relaxed);
        drop(state);
        if after > before { &self.raised } else { &self.lowered }.fetch_add(1, Ordering::Relaxed);
        Some(after)
    }

    /// What it shows now.
    pub fn snapshot(&self) -> AdaptiveSnapshot {
        let ns = |a: &AtomicU64| match a.load(Ordering::Relaxed) {
            u64::MAX => None,
            n => Some(Duration::from_nanos(n)),
        };
        AdaptiveSnapshot {
            limit: self.limit(),
            min: self.config.min,
            max: self.config.max,
            raised: self.raised.load(Ordering::Relaxed),
            lowered: self.lowered.load(Ordering::Relaxed),
            baseline: ns(&self.baseline_ns),
            current: ns(&self.current_ns),
        }
    }
}

/// The working cap after window `w` (unrounded, within `[min, max]`), from `limit`;
/// `baseline` is Gradient2's, updated here. Pure: the simulator and the tests call it.
pub fn next_limit(config: &AdaptiveConfig, baseline: &mut Baseline, limit: f64, w: &Window) -> f64 {
    let (min, max) = (config.min as f64, config.max as f64);
    let dropped = w.drops as f64 > DROP_SHARE * w.samples as f64;
    let app_limited = (w.in_flight as f64) < limit / 2.0;
    let next = match config.algorithm {
        // Only drops: no latency was read, so neither the baseline nor the gradient moves.
        Algorithm::Gradient2 if w.drops >= w.samples => limit,
        Algorithm::Gradient2 => {
            let current = w.mean_us.max(1.0);
            baseline.read(current);
            if baseline.windows <= WARM_UP && !dropped {
                // Learning the baseline at the planned cap: the cap holds still.
                return limit.clamp(min, max);
            }
            let tolerance = f64::from(config.tolerance) / 100.0;
            let gradient = (tolerance * baseline.us / current).clamp(0.5, 1.0);
            let target = gradient * limit + limit.sqrt().min(QUEUE_ALLOWANCE);
            limit + (target - limit) * SMOOTHING
        }
        Algorithm::Aimd if dropped => limit * BACKOFF,
        Algorithm::Aimd => limit + 1.0,
    };
    let next = if dropped {
        // Falls fast: at once, whatever the latency says.
        next.min(limit * BACKOFF)
    } else if app_limited {
        next.min(limit)
    } else {
        next
    };
    next.clamp(min, max)
}

#[cfg(all(test, not(stormguard_loom)))]
mod tests {
    use super::*;

    fn window(mean_ms: f64, in_flight: u64, dropped: bool) -> Window {
        Window {
            samples: 100,
            mean_us: mean_ms * 1000.0,
            drops: if dropped { 11 } else { 0 },
            in_flight,
        }
    }

    /// A dependency that works on `workers` at full speed and stretches every answer by
    /// in flight / workers past that, driven at `offered` in flight: the working cap settles
    /// near `workers + 4`.
    fn settle(config: &AdaptiveConfig, start: f64, workers: f64, windows: usize) -> f64 {
        let mut baseline = Baseline::default();
        let mut limit = start;
        for _ in 0..windows {
            let in_flight = limit.floor();
            let latency = 50.0 * (in_flight / workers).max(1.0);
            limit =
                next_limit(config, &mut baseline, limit, &window(latency, in_flight as u64, false));
        }
        limit
    }

    #[test]
    fn gradient2_settles_near_what_the_dependency_can_take() {
        let c = AdaptiveConfig::new(4, 100);
        let settled = settle(&c, 20.0, 20.0, 60);
        assert!((22.0..=25.0).contains(&settled), "{settled}");
        // A dependency that never slows: up to the ceiling, slowly.
        // (The first 10 windows learn the baseline, the cap holding still.)
        let flat = settle(&c, 20.0, 1000.0, 20);
        assert!(flat > 25.0 && flat < 45.0, "{flat}");
        assert_eq!(settle(&c, 20.0, 1000.0, 200), 100.0);
        let mut baseline = Baseline::default();
        let mut limit: f64 = 20.0;
        for _ in 0..30 {
            let l = 50.0 * (limit.floor() / 20.0).max(1.0);
            limit = next_limit(&c, &mut baseline, limit, &window(l, limit as u64, false));
        }
        // Half the workers: within 10 windows it is near 10 + 4.
        for _ in 0..10 {
            let l = 50.0 * (limit.floor() / 10.0).max(1.0);
            limit = next_limit(&c, &mut baseline, limit, &window(l, limit as u64, false));
        }
        assert!(limit < 16.0, "{limit}");
    }

    #[test]
    fn a_drop_lowers_at_once_and_a_rise_is_slow() {
        let c = AdaptiveConfig::new(4, 100);
        let mut b = Baseline { us: 50_000.0, windows: 20 };
        let dropped = next_limit(&c, &mut b, 40.0, &window(50.0, 40, true));
        assert!(dropped <= 36.0, "{dropped}");
        let mut b = Baseline { us: 50_000.0, windows: 20 };
        let raised = next_limit(&c, &mut b, 40.0, &window(50.0, 40, false));
        assert!(raised > 40.0 && raised < 42.0, "{raised}");
        // App-limited: never raised.
        let mut b = Baseline { us: 50_000.0, windows: 20 };
        assert_eq!(next_limit(&c, &mut b, 40.0, &window(50.0, 10, false)), 40.0);
        // Bounds.
        let mut b = Baseline { us: 50_000.0, windows: 20 };
        assert_eq!(next_limit(&c, &mut b, 4.0, &window(500.0, 4, true)), 4.0);
        let aimd = AdaptiveConfig { algorithm: Algorithm::Aimd, ..c };
        let mut b = Baseline::default();
        assert_eq!(next_limit(&aimd, &mut b, 100.0, &window(50.0, 100, false)), 100.0);
        assert_eq!(next_limit(&aimd, &mut b, 20.0, &window(50.0, 20, true)), 18.0);
    }

    #[test]
    fn windows_close_by_time_and_count() {
        let c = AdaptiveConfig::new(4, 100);
        let a = AdaptiveLimit::new(c, 50, Timestamp::from_nanos(0));
        let ms = Duration::from_millis;
        // Nine answers over two seconds: too few.
        for i in 0..9 {
            assert_eq!(a.sample(Timestamp::from_nanos(i * 200_000_000), ms(50), 50, false), None);
        }
        // The tenth closes the first window: the baseline is read, the cap does not fall.
        a.sample(Timestamp::from_nanos(2_000_000_000), ms(50), 50, false);
        assert!(a.limit() >= 50);
        assert_eq!(a.snapshot().baseline, Some(ms(50)));
        // Ten dropped answers a second later: lowered.
        for _ in 0..10 {
            a.sample(Timestamp::from_nanos(3_000_000_000), ms(50), 50, true);
        }
        assert!(a.limit() <= 46, "{}", a.limit());
        assert_eq!(a.snapshot().lowered, 1);
    }

    /// A flat dependency whose window means scatter by 12 % (a long tail, or a heavy-tailed
    /// latency) for 1 000 windows: the cap is never lowered below the planned 20. A rule whose
    /// baseline follows any lower reading at once and which takes each lower target whole (an
    /// earlier version of this one) ratchets down on the same noise.
    #[test]
    fn noise_does_not_ratchet_the_cap_down() {
        use crate::random::{RandomSource, SplitMix64};
        let c = AdaptiveConfig::new(4, 40);
        let earlier = |b: &mut f64, limit: f64, current: f64| {
            *b = if *b <= 0.0 || current < *b { current } else { *b + (current - *b) / 600.0 };
            let target = (*b / current).clamp(0.5, 1.0) * limit + limit.sqrt().min(4.0);
            if target < limit { target } else { limit + (target - limit) * SMOOTHING }
        };
        let run = |use_earlier: bool| {
            let mut rng = SplitMix64::new(7);
            let (mut baseline, mut b) = (Baseline::default(), 0.0);
            let (mut limit, mut lowest) = (20.0_f64, 20.0_f64);
            for _ in 0..1_000 {
                // A normal draw from the sum of 12 uniforms (Irwin-Hall), scaled to 12 %.
                let z: f64 = (0..12)
                    .map(|_| (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64)
                    .sum::<f64>()
                    - 6.0;
                let current = 100.0 * (1.0 + 0.12 * z);
                limit = match use_earlier {
                    false => next_limit(&c, &mut baseline, limit, &window(current, 40, false)),
                    true => earlier(&mut b, limit, current * 1000.0).clamp(4.0, 40.0),
                };
                lowest = lowest.min(limit);
            }
            lowest
        };
        assert!(run(false) >= 20.0, "lowest {}", run(false));
        assert!(run(true) < 15.0, "the earlier rule: lowest {}", run(true));
    }

    /// A few percent of drops (a healthy dependency's 503s, timeouts near its p99) are not
    /// overload; more than 10 % are.
    #[test]
    fn a_drop_window_is_more_than_a_tenth_of_drops() {
        let c = AdaptiveConfig { algorithm: Algorithm::Aimd, ..AdaptiveConfig::new(4, 100) };
        let mut b = Baseline::default();
        let w = |drops| Window { samples: 100, mean_us: 50_000.0, drops, in_flight: 40 };
        assert_eq!(next_limit(&c, &mut b, 40.0, &w(5)), 41.0);
        assert_eq!(next_limit(&c, &mut b, 40.0, &w(10)), 41.0);
        assert_eq!(next_limit(&c, &mut b, 40.0, &w(11)), 36.0);
    }

    /// A window that fills before its time closes anyway: the packed count never overflows
    /// into the latency sum.
    #[test]
    fn a_full_window_closes_before_its_time() {
        let a = AdaptiveLimit::new(AdaptiveConfig::new(4, 100), 50, Timestamp::from_nanos(0));
        let now = Timestamp::from_nanos(1);
        for _ in 0..(FULL + 10) {
            a.sample(now, Duration::from_secs(3600), 50, false);
        }
        let s = a.snapshot();
        assert_eq!(s.current, Some(Duration::from_micros(MAX_SAMPLE_US)), "{s:?}");
        assert!(a.window.load(Ordering::Relaxed) & COUNT_MASK < 20);
    }

    #[test]
    fn ranges_read() {
        let c: AdaptiveConfig = "4..40".parse().unwrap();
        assert_eq!((c.min, c.max), (4, 40));
        for bad in ["4", "0..4", "40..4", "a..b", ""] {
            assert!(bad.parse::<AdaptiveConfig>().is_err(), "{bad}");
        }
        assert_eq!(
            "40..4".parse::<AdaptiveConfig>(),
            Err(BadRange::FloorAboveCeiling { min: 40, max: 4 })
        );
        assert_eq!("0..4".parse::<AdaptiveConfig>(), Err(BadRange::ZeroFloor));
        assert_eq!("4-40".parse::<AdaptiveConfig>(), Err(BadRange::NotRange("4-40".into())));
        assert!(AdaptiveConfig::new(4, 40).validate(1 << 24).is_ok());
        assert!(
            AdaptiveConfig { tolerance: 50, ..AdaptiveConfig::new(4, 40) }.validate(64).is_err()
        );
        assert!(AdaptiveConfig::new(4, 400).validate(64).is_err());
    }
}
