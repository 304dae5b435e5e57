//! A model provider's requests per minute, and stormguard's rate admission against it.
//!
//! A model API (OpenAI, Anthropic) limits requests per minute as well as calls in flight: a
//! bucket of the limit, refilled continuously, and a 429 with a retry-after for a request that
//! finds it empty. Both sides here run stormguard-core's [`RateLimit`] on the virtual clock:
//!
//! - the **provider** ([`Provider`]) counts every attempt that reaches the dependency, exactly,
//!   and answers one that finds no room with a 429 carrying the time until one request has
//!   refilled; every answer states its limit and what remains, as the provider's headers do;
//! - the **client** (a policy with rate admission) meters with its own `RateLimit`, as the tower
//!   layer does: it takes a request before sending, and hears every answer ([`heard`]): the
//!   stated limit replaces its own, the stated remaining is the truth it never rises above, and
//!   a 429 holds admission for its retry-after and lowers the limit.
//!
//! The engine decides what waits and what is refused; this module only keeps the two buckets.

use std::time::Duration;

use stormguard_core::clock::Timestamp;
use stormguard_core::rate::{Observed, RateConfig, RateLimit};

use crate::scenario::{ProviderRate, RateAdmissionConfig};

/// Providers count per minute.
const MINUTE: Duration = Duration::from_secs(60);

/// How long the provider takes to answer a 429: it refuses at its door, before any server
/// or queue, so the refusal is cheap.
pub(crate) const LIMITED_ANSWER: Duration = Duration::from_millis(1);

/// The provider's side: its bucket of requests per minute.
#[derive(Debug)]
pub(crate) struct Provider {
    limit: u64,
    bucket: RateLimit,
}

impl Provider {
    /// A bucket of `requests_per_minute`, holding `requests_remaining` when the run starts.
    pub(crate) fn new(c: &ProviderRate) -> Provider {
        let bucket =
            RateLimit::new(RateConfig { limit: Some(c.requests_per_minute), window: MINUTE });
        // What other callers have used already: the level comes down to what is left.
        bucket.observe(
            Timestamp::ZERO,
            Observed { limit: None, remaining: Some(c.requests_remaining) },
        );
        Provider { limit: c.requests_per_minute, bucket }
    }

    /// An attempt arrives: counted, or refused with the retry-after the provider states — the
    /// time until one request has refilled, rounded up to the millisecond (as `retry-after-ms`
    /// carries it).
    pub(crate) fn arrive(&self, now: Timestamp) -> Result<(), Duration> {
        match self.bucket.try_acquire(now, 1) {
            Ok(p) => {
                p.settle(now, None);
                Ok(())
            }
            Err(w) => {
                let ms = w.wait.as_nanos().div_ceil(1_000_000);
                Err(Duration::from_millis(u64::try_from(ms).unwrap_or(u64::MAX)))
            }
        }
    }

    /// What an answer sent now states: the limit, and the whole requests left.
    pub(crate) fn headers(&self, now: Timestamp) -> Observed {
        let left = self.bucket.snapshot(now).available.min(self.limit);
        Observed { limit: Some(self.limit), remaining: Some(left) }
    }
}

/// The client's meter for one instance: the configured starting limit, or none until an
/// answer states one.
pub(crate) fn client_limit(c: &RateAdmissionConfig) -> RateLimit {
    RateLimit::new(RateConfig { limit: c.requests_per_minute, window: MINUTE })
}

/// Takes one request for an attempt about to be sent, or says how long until there is room
/// (the tower layer's `Rates::take`, requests only: the cost is settled as taken).
pub(crate) fn take(meter: &RateLimit, now: Timestamp) -> Result<(), Duration> {
    match meter.try_acquire(now, 1) {
        Ok(p) => {
            p.settle(now, None);
            Ok(())
        }
        Err(w) => Err(w.wait),
    }
}

/// The client hears an answer: what it states of the limit, then, for a 429, its retry-after
/// (the tower layer's `Rates::observe`).
pub(crate) fn heard(meter: &RateLimit, now: Timestamp, seen: Observed, too_many: Option<Duration>) {
    meter.observe(now, seen);
    if let Some(retry_after) = too_many {
        meter.refused(now, Some(retry_after));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(ms: u64) -> Timestamp {
        Timestamp::from_millis(ms)
    }

    #[test]
    fn the_provider_counts_exactly_and_states_the_wait() {
        let p = Provider::new(&ProviderRate { requests_per_minute: 600, requests_remaining: 2 });
        assert_eq!(p.headers(at(0)), Observed { limit: Some(600), remaining: Some(2) });
        assert_eq!(p.arrive(at(0)), Ok(()));
        assert_eq!(p.arrive(at(0)), Ok(()));
        // Empty: one request refills in 100 ms at 10 a second.
        assert_eq!(p.arrive(at(0)), Err(Duration::from_millis(100)));
        assert_eq!(p.arrive(at(40)), Err(Duration::from_millis(60)));
        assert_eq!(p.arrive(at(100)), Ok(()));
        assert_eq!(p.headers(at(150)).remaining, Some(0));
        assert_eq!(p.headers(at(200)).remaining, Some(1));
        // A wait that is not whole milliseconds is rounded up.
        let p = Provider::new(&ProviderRate { requests_per_minute: 7, requests_remaining: 0 });
        assert_eq!(p.arrive(at(0)), Err(Duration::from_millis(8_572)));
    }

    #[test]
    fn the_client_learns_the_limit_and_holds_after_a_429() {
        let meter = client_limit(&RateAdmissionConfig { requests_per_minute: None });
        for _ in 0..1_000 {
            assert_eq!(take(&meter, at(0)), Ok(()), "no limit known yet");
        }
        heard(&meter, at(1), Observed { limit: Some(600), remaining: Some(0) }, None);
        assert_eq!(take(&meter, at(1)), Err(Duration::from_millis(100)));
        heard(
            &meter,
            at(1),
            Observed { limit: Some(600), remaining: Some(0) },
            Some(Duration::from_millis(300)),
        );
        assert_eq!(take(&meter, at(101)), Err(Duration::from_millis(200)), "held");
        assert_eq!(take(&meter, at(301)), Ok(()));
    }
}
