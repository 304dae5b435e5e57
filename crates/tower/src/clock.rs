//! tokio's clock as a stormguard [`Clock`], so paused-time tests drive the limiter, the budget
//! and the breaker exactly as they drive the sleeps.

use stormguard_core::clock::{Clock, Timestamp};
use tokio::time::Instant;

/// Time from `tokio::time::Instant`, zero at creation. Under `tokio::time::pause` it moves only
/// when the runtime advances it.
#[derive(Debug, Clone, Copy)]
pub struct TokioClock {
    origin: Instant,
}

impl TokioClock {
    /// A clock whose zero is now.
    pub fn new() -> TokioClock {
        TokioClock { origin: Instant::now() }
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
        let d = Instant::now().saturating_duration_since(self.origin);
        Timestamp::from_nanos(u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
    }
}
