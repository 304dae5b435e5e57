//! tokio's clock as a stormguard [`Clock`], so paused-time tests drive the limiter, the budget
//! and the breaker exactly as they drive the sleeps.

use stormguard_core::clock::{Clock, MonotonicClock, Timestamp};
use tokio::time::Instant;

/// Time from `tokio::time::Instant`, zero at creation.
///
/// Made while tokio's time is paused (`#[tokio::test(start_paused = true)]`, or after
/// `tokio::time::pause()`), it asks tokio at every read, so it moves only when the runtime
/// advances it. Made while tokio's time runs, it reads the monotonic clock directly
/// ([`MonotonicClock`]: the clock tokio's timers read, without std's `Instant` arithmetic,
/// about 10 ns a read cheaper); a pause that begins after that does not stop it. A test that
/// pauses time after making its dependency makes it on [`TokioClock::reading_tokio`].
#[derive(Debug, Clone, Copy)]
pub struct TokioClock {
    origin: Instant,
    /// The monotonic clock, zero at `origin` (within a read), while tokio's time runs.
    direct: Option<MonotonicClock>,
}

impl TokioClock {
    /// A clock whose zero is now: read directly unless tokio's time is paused now.
    pub fn new() -> TokioClock {
        let origin = Instant::now();
        // Its zero read after tokio's: a timestamp maps to a tokio instant no later than the
        // moment it was read (by a read's time earlier at most), so a deadline is never late.
        let direct = MonotonicClock::new();
        // Paused, tokio's time stands still between two reads; running, it has moved by the
        // read in between. (A clock too coarse to move that fast reads tokio: slower, never
        // wrong.)
        let running = Instant::now() != origin;
        TokioClock { origin, direct: running.then_some(direct) }
    }

    /// A clock whose zero is now that asks tokio at every read, so a pause that begins after
    /// it is made moves it too.
    pub fn reading_tokio() -> TokioClock {
        TokioClock { origin: Instant::now(), direct: None }
    }

    /// The tokio instant of a timestamp of this clock.
    pub fn instant_of(&self, t: Timestamp) -> Instant {
        self.origin + std::time::Duration::from_nanos(t.as_nanos())
    }
}

impl Default for TokioClock {
    fn default() -> Self {
        TokioClock::new()
    }
}

impl Clock for TokioClock {
    fn now(&self) -> Timestamp {
        match &self.direct {
            Some(direct) => direct.now(),
            None => {
                let d = Instant::now().saturating_duration_since(self.origin);
                Timestamp::from_nanos(u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test(start_paused = true)]
    async fn made_while_paused_it_follows_tokio() {
        let clock = TokioClock::new();
        assert!(clock.direct.is_none());
        let t0 = clock.now();
        std::thread::sleep(Duration::from_millis(2));
        assert_eq!(clock.now(), t0, "real time passed, tokio's did not");
        tokio::time::advance(Duration::from_secs(5)).await;
        assert_eq!(clock.now().nanos_since(t0), 5_000_000_000);
    }

    #[tokio::test]
    async fn made_while_running_it_reads_the_clock_itself() {
        let clock = TokioClock::new();
        assert!(clock.direct.is_some());
        let t0 = clock.now();
        let before = Instant::now();
        tokio::time::sleep(Duration::from_millis(20)).await;
        let after = Instant::now();
        let t1 = clock.now();
        // The same clock as tokio's timers: its reads bracket tokio's, so it moved at least as
        // far (a clock of its own could run slow or fast).
        let (moved, slept) = (t1.nanos_since(t0), (after - before).as_nanos() as u64);
        assert!(slept >= 20_000_000 && moved >= slept, "{moved} against {slept}");
        // Its timestamps map back onto tokio's instants, never later than the moment read (its
        // zero is read just after tokio's: it may run behind by that, never ahead).
        for _ in 0..10_000 {
            let t = clock.now();
            let read_after = Instant::now();
            assert!(clock.instant_of(t) <= read_after);
            assert!(clock.instant_of(t) + Duration::from_secs(1) >= read_after);
        }
    }

    #[tokio::test]
    async fn reading_tokio_follows_a_pause_that_begins_later() {
        let clock = TokioClock::reading_tokio();
        let direct = TokioClock::new();
        assert!(clock.direct.is_none() && direct.direct.is_some());
        tokio::time::pause();
        let (t0, d0) = (clock.now(), direct.now());
        std::thread::sleep(Duration::from_millis(2));
        assert_eq!(clock.now(), t0);
        // Made before the pause, the direct one keeps real time (the documented limit).
        assert!(direct.now().nanos_since(d0) >= 2_000_000);
    }
}
