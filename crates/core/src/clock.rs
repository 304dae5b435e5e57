//! Time as a parameter.
//!
//! Every rule in stormguard-core that depends on time takes a [`Timestamp`] argument instead of
//! reading a clock itself. That keeps the rules deterministic: the simulator and `stormguard
//! replay` drive them from a virtual clock, tests from a [`ManualClock`], and production code
//! from a [`MonotonicClock`]. A timestamp is a plain `u64` of nanoseconds since the clock's zero,
//! so it fits in an atomic.
//!
//! ```
//! use std::time::Duration;
//! use stormguard_core::clock::{Clock, ManualClock, Timestamp};
//!
//! let clock = ManualClock::new();
//! assert_eq!(clock.now(), Timestamp::ZERO);
//! clock.advance(Duration::from_millis(250));
//! assert_eq!(clock.now(), Timestamp::from_millis(250));
//! ```

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// A point in time: nanoseconds since the zero of the clock that produced it.
///
/// Timestamps from different clocks are not comparable. Arithmetic saturates: a timestamp never
/// wraps, and the time between two timestamps is never negative.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct Timestamp(u64);

impl Timestamp {
    /// The clock's zero.
    pub const ZERO: Timestamp = Timestamp(0);
    /// The latest representable time (about 584 years after zero).
    pub const MAX: Timestamp = Timestamp(u64::MAX);

    /// A timestamp `nanos` nanoseconds after zero.
    pub const fn from_nanos(nanos: u64) -> Timestamp {
        Timestamp(nanos)
    }

    /// A timestamp `millis` milliseconds after zero (saturating).
    pub const fn from_millis(millis: u64) -> Timestamp {
        Timestamp(millis.saturating_mul(1_000_000))
    }

    /// Nanoseconds since zero.
    pub const fn as_nanos(self) -> u64 {
        self.0
    }

    /// Whole milliseconds since zero (rounded down).
    pub const fn as_millis(self) -> u64 {
        self.0 / 1_000_000
    }

    /// The time elapsed since `earlier`, or zero when `earlier` is later than `self`.
    pub fn saturating_since(self, earlier: Timestamp) -> Duration {
        Duration::from_nanos(self.0.saturating_sub(earlier.0))
    }

    /// [`saturating_since`](Self::saturating_since) in nanoseconds, without the round trip
    /// through a `Duration` (a hot path's histograms count nanoseconds).
    #[inline]
    pub fn nanos_since(self, earlier: Timestamp) -> u64 {
        self.0.saturating_sub(earlier.0)
    }

    /// `self + d`, saturating at [`Timestamp::MAX`].
    pub fn saturating_add(self, d: Duration) -> Timestamp {
        Timestamp(self.0.saturating_add(duration_nanos(d)))
    }

    /// `self - d`, saturating at zero.
    pub fn saturating_sub(self, d: Duration) -> Timestamp {
        Timestamp(self.0.saturating_sub(duration_nanos(d)))
    }
}

impl fmt::Debug for Timestamp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Timestamp({:?})", Duration::from_nanos(self.0))
    }
}

/// A duration as whole nanoseconds, saturating at `u64::MAX` (about 584 years).
pub(crate) fn duration_nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// A source of [`Timestamp`]s that never go backwards.
pub trait Clock: Send + Sync + fmt::Debug {
    /// The current time.
    fn now(&self) -> Timestamp;
}

impl<C: Clock + ?Sized> Clock for Arc<C> {
    fn now(&self) -> Timestamp {
        (**self).now()
    }
}

impl<C: Clock + ?Sized> Clock for &C {
    fn now(&self) -> Timestamp {
        (**self).now()
    }
}

/// The real monotonic clock: zero is the moment it was created.
///
/// On Linux a read is `CLOCK_MONOTONIC` (the clock std's [`Instant`] reads there) taken as
/// nanoseconds and less the origin's: one subtraction, where going through `Instant` costs
/// std's checked `Timespec` arithmetic and a `Duration` on every read (about 10 ns a read on
/// the tower stack's bench, which reads twice a request). Elsewhere it reads `Instant`.
#[derive(Debug, Clone, Copy)]
pub struct MonotonicClock {
    origin: Instant,
    /// `origin` as nanoseconds of the clock read directly (Linux; unused elsewhere).
    direct_origin: u64,
}

impl MonotonicClock {
    /// A clock whose zero is now.
    pub fn new() -> MonotonicClock {
        MonotonicClock::with_origin(Instant::now())
    }

    /// A clock whose zero is `origin`. Read directly, the origin's reading is taken between two
    /// reads of `Instant` (the closest of a few tries): the clock may run behind
    /// [`timestamp_of`] by up to that gap (tens of nanoseconds), never ahead of it.
    ///
    /// [`timestamp_of`]: Self::timestamp_of
    pub fn with_origin(origin: Instant) -> MonotonicClock {
        MonotonicClock { origin, direct_origin: direct_origin(origin) }
    }

    /// The `Timestamp` of an `Instant` (zero for instants before the origin).
    pub fn timestamp_of(&self, instant: Instant) -> Timestamp {
        Timestamp(duration_nanos(instant.saturating_duration_since(self.origin)))
    }
}

impl Default for MonotonicClock {
    fn default() -> Self {
        MonotonicClock::new()
    }
}

impl Clock for MonotonicClock {
    #[inline]
    fn now(&self) -> Timestamp {
        if direct::READS {
            Timestamp(direct::nanos().saturating_sub(self.direct_origin))
        } else {
            self.timestamp_of(Instant::now())
        }
    }
}

/// The direct clock's reading at `origin`, or a little after it: `Instant` is read, then the
/// clock, then `Instant` again, and the reading less the time from `origin` to the first read
/// is kept — never before the origin's own reading, later by at most the gap between the two
/// reads of `Instant`. A try whose gap is wide (the thread was preempted between the reads) is
/// made again, a few times at most, keeping the closest.
fn direct_origin(origin: Instant) -> u64 {
    if !direct::READS {
        return 0;
    }
    let mut closest = (u64::MAX, 0);
    for _ in 0..8 {
        let before = Instant::now();
        let reading = direct::nanos();
        let gap = duration_nanos(Instant::now().saturating_duration_since(before));
        if gap < closest.0 {
            let at_origin = match origin.checked_duration_since(before) {
                // An origin still to come: its reading is later than this one.
                Some(ahead) => reading.saturating_add(duration_nanos(ahead)),
                None => reading.saturating_sub(duration_nanos(before.duration_since(origin))),
            };
            closest = (gap, at_origin);
        }
        if gap < 1_000 {
            break;
        }
    }
    closest.1
}

/// The monotonic clock without `Instant`.
#[cfg(all(any(target_os = "linux", target_os = "android"), not(stormguard_loom)))]
mod direct {
    /// Whether [`nanos`] reads the clock.
    pub(super) const READS: bool = true;

    /// `CLOCK_MONOTONIC` in nanoseconds (through the vDSO: no system call).
    #[inline]
    pub(super) fn nanos() -> u64 {
        let t = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
        // Never negative (the clock starts at boot); 584 years of nanoseconds fit.
        let secs = u64::try_from(t.tv_sec).unwrap_or(0);
        let nanos = u64::try_from(t.tv_nsec).unwrap_or(0);
        secs.saturating_mul(1_000_000_000).saturating_add(nanos)
    }
}

/// Elsewhere `MonotonicClock` reads `Instant` (whose clock differs by platform), as it does in
/// the loom models' build.
#[cfg(not(all(any(target_os = "linux", target_os = "android"), not(stormguard_loom))))]
mod direct {
    pub(super) const READS: bool = false;

    pub(super) fn nanos() -> u64 {
        0
    }
}

/// A clock that moves only when told to: for tests, replay and the simulator.
///
/// Clones share the same time.
#[derive(Debug, Clone, Default)]
pub struct ManualClock {
    // Relaxed is enough: the clock carries no other data, and callers that need ordering with
    // other state get it from that state's own synchronisation.
    nanos: Arc<AtomicU64>,
}

impl ManualClock {
    /// A clock at zero.
    pub fn new() -> ManualClock {
        ManualClock::default()
    }

    /// Moves the clock forward by `d` (saturating).
    pub fn advance(&self, d: Duration) {
        let d = duration_nanos(d);
        let _ = self
            .nanos
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| Some(n.saturating_add(d)));
    }

    /// Sets the clock to `t`. A clock never goes backwards: an earlier `t` is ignored.
    pub fn set(&self, t: Timestamp) {
        self.nanos.fetch_max(t.0, Ordering::Relaxed);
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Timestamp {
        Timestamp(self.nanos.load(Ordering::Relaxed))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn manual_clock_never_goes_back() {
        let c = ManualClock::new();
        c.set(Timestamp::from_millis(10));
        c.set(Timestamp::from_millis(5));
        assert_eq!(c.now(), Timestamp::from_millis(10));
        c.advance(Duration::from_millis(1));
        assert_eq!(c.now().as_millis(), 11);
    }

    #[test]
    fn the_monotonic_clock_never_runs_ahead_of_instant() {
        // Read directly (Linux), a timestamp is never later than the same clock's reading of
        // an `Instant` taken after it, and moves with it.
        let c = MonotonicClock::new();
        let past = MonotonicClock::with_origin(Instant::now() - Duration::from_millis(50));
        let future = MonotonicClock::with_origin(Instant::now() + Duration::from_secs(60));
        for _ in 0..10_000 {
            let (t, p, f) = (c.now(), past.now(), future.now());
            let i = Instant::now();
            assert!(t <= c.timestamp_of(i), "{t:?} against {:?}", c.timestamp_of(i));
            assert!(p <= past.timestamp_of(i) && p >= Timestamp::from_millis(50));
            // Before its origin, zero either way.
            assert_eq!((f, future.timestamp_of(i)), (Timestamp::ZERO, Timestamp::ZERO));
        }
        let (t0, i0) = (c.now(), Instant::now());
        std::thread::sleep(Duration::from_millis(2));
        let (i1, t1) = (Instant::now(), c.now());
        assert!(t1.nanos_since(t0) >= duration_nanos(i1 - i0));
    }

    #[test]
    fn arithmetic_saturates() {
        assert_eq!(Timestamp::MAX.saturating_add(Duration::from_secs(1)), Timestamp::MAX);
        assert_eq!(Timestamp::ZERO.saturating_sub(Duration::from_secs(1)), Timestamp::ZERO);
        assert_eq!(Timestamp::ZERO.saturating_since(Timestamp::from_millis(3)), Duration::ZERO);
    }
}
