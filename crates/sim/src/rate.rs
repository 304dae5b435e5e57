//! A model provider's requests and tokens per minute, and stormguard's rate admission against
//! them.
//!
//! A model API (OpenAI, Anthropic) limits requests and tokens per minute as well as calls in
//! flight: a bucket per limit, refilled continuously, and a 429 with a retry-after for a request
//! that finds one without room. Both sides here run stormguard-core's [`RateLimit`] on the
//! virtual clock:
//!
//! - the **provider** ([`Provider`]) counts every attempt that reaches the dependency, exactly:
//!   one request, and the tokens it may use (its input and its `max_tokens`, as OpenAI and
//!   Anthropic estimate a request's cost when it arrives). An attempt that finds no room in
//!   either bucket is answered 429 with the time until both have room. A served attempt's
//!   tokens are settled when it is answered, at what it used (its input and the output the
//!   model wrote), so the unused part of `max_tokens` comes back. Every answer states each
//!   limit and what remains of it, as the provider's headers do;
//! - the **client** (a policy with rate admission) meters with core's [`Rates`], the tower
//!   layer's own meter ([`Meter`] adapts it to the model's one token count): it books a request
//!   and `input + max_tokens` before sending ([`Meter::book`]), settles the booking at the usage
//!   the answer states or refunds it when the attempt is never sent ([`Booking`]), and hears
//!   every answer ([`Meter::heard`]): a stated limit replaces its own, a stated remaining is the
//!   truth it never rises above, and a 429 holds admission for its retry-after and lowers the
//!   limits once per wave.
//!
//! The engine decides what waits and what is refused; this module only keeps the buckets.

use std::time::Duration;

use stormguard_core::clock::Timestamp;
use stormguard_core::rate::{
    Observed, PerMinute, RateConfig, RateLimit, RatePermit, RateReservation, Rates,
    Stated as CoreStated, Tokens,
};

use crate::scenario::{ProviderLimit, ProviderRate, RateAdmissionConfig, Scenario};

/// Providers count per minute.
const MINUTE: Duration = Duration::from_secs(60);

/// How long the provider takes to answer a 429: it refuses at its door, before any server
/// or queue, so the refusal is cheap.
pub(crate) const LIMITED_ANSWER: Duration = Duration::from_millis(1);

/// What an answer states of the provider's limits (its rate-limit headers).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Stated {
    pub(crate) requests: Observed,
    pub(crate) tokens: Observed,
}

/// One of the provider's buckets, and the limit it states.
#[derive(Debug)]
struct Bucket {
    limit: u64,
    bucket: RateLimit,
}

impl Bucket {
    /// A bucket of `c.per_minute`, holding `c.remaining` when the run starts.
    fn new(c: &ProviderLimit) -> Bucket {
        let bucket = RateLimit::new(RateConfig { limit: Some(c.per_minute), window: MINUTE });
        // What other callers have used already: the level comes down to what is left.
        bucket.observe(Timestamp::ZERO, Observed { limit: None, remaining: Some(c.remaining) });
        Bucket { limit: c.per_minute, bucket }
    }

    fn stated(&self, now: Timestamp) -> Observed {
        let left = self.bucket.snapshot(now).available.min(self.limit);
        Observed { limit: Some(self.limit), remaining: Some(left) }
    }
}

/// The provider's side: its buckets of requests and tokens per minute (either may be absent).
#[derive(Debug)]
pub(crate) struct Provider {
    requests: Option<Bucket>,
    tokens: Option<Bucket>,
}

impl Provider {
    pub(crate) fn new(c: &ProviderRate) -> Provider {
        Provider {
            requests: c.requests.as_ref().map(Bucket::new),
            tokens: c.tokens.as_ref().map(Bucket::new),
        }
    }

    /// An attempt that may use `tokens` (its input and its `max_tokens`) arrives: counted —
    /// its request at once, its tokens reserved until it is answered (the permit, when the
    /// provider limits tokens) — or refused, with nothing taken, and the retry-after the
    /// provider states: the time until both buckets have room, rounded up to the millisecond
    /// (as `retry-after-ms` carries it).
    pub(crate) fn arrive(
        &self,
        now: Timestamp,
        tokens: u64,
    ) -> Result<Option<RatePermit>, Duration> {
        let request = match &self.requests {
            None => None,
            Some(b) => match b.bucket.try_acquire(now, 1) {
                Ok(p) => Some(p),
                Err(w) => {
                    let t = self
                        .tokens
                        .as_ref()
                        .map_or(Duration::ZERO, |t| t.bucket.wait_for(now, tokens));
                    return Err(retry_after(w.wait.max(t)));
                }
            },
        };
        let reserved = match &self.tokens {
            None => None,
            Some(b) => match b.bucket.try_acquire(now, tokens) {
                Ok(p) => Some(p),
                Err(w) => {
                    if let Some(p) = request {
                        p.refund(now);
                    }
                    return Err(retry_after(w.wait));
                }
            },
        };
        if let Some(p) = request {
            p.settle(now, None);
        }
        Ok(reserved)
    }

    /// What an answer sent now states: each limit, and the whole units left of it.
    pub(crate) fn headers(&self, now: Timestamp) -> Stated {
        Stated {
            requests: self.requests.as_ref().map(|b| b.stated(now)).unwrap_or_default(),
            tokens: self.tokens.as_ref().map(|b| b.stated(now)).unwrap_or_default(),
        }
    }
}

/// What one call costs in tokens, from the scenario: every call the same.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct CallTokens {
    /// Its prompt.
    pub(crate) input: u64,
    /// The most it may use: its prompt and its `max_tokens`. The provider reserves this when
    /// the call arrives, and the client books it before sending.
    pub(crate) most: u64,
    /// What it uses when it is served: its prompt and the output the model writes.
    pub(crate) used: u64,
}

impl CallTokens {
    pub(crate) fn new(sc: &Scenario) -> CallTokens {
        let (input, max) = (sc.fleet.input_tokens, sc.fleet.max_tokens);
        CallTokens {
            input,
            most: input.saturating_add(max),
            used: input.saturating_add(sc.dependency.output_tokens(max)),
        }
    }
}

/// A wait as the provider states it: whole milliseconds, rounded up.
fn retry_after(wait: Duration) -> Duration {
    let ms = wait.as_nanos().div_ceil(1_000_000);
    Duration::from_millis(u64::try_from(ms).unwrap_or(u64::MAX))
}

/// The client's limits for one instance: core's [`Rates`], the very meter the tower layer's
/// rate admission runs, with the configured requests and tokens per minute (the simulated
/// provider has no split input and output limits, so a call's tokens are booked as one count).
#[derive(Debug)]
pub(crate) struct Meter(Rates);

/// One attempt's booking in the client's limits (core's [`RateReservation`]): settled when the
/// answer arrives, refunded when the attempt is never sent; dropped (a timeout) it keeps its
/// estimate.
#[derive(Debug)]
pub(crate) struct Booking(RateReservation);

impl Booking {
    /// The answer arrived: the request stays counted, the tokens are settled at `used`, what
    /// the provider counted (`None`: the answer states no usage, and the estimate stays).
    pub(crate) fn settle(self, now: Timestamp, used: Option<u64>) {
        let used = used.map(|input| Tokens { input, output: 0 });
        self.0.settle(now, used, stormguard_core::defaults::USAGE_MAX_FACTOR);
    }

    /// The attempt never reached the provider: everything comes back.
    pub(crate) fn refund(self, now: Timestamp) {
        self.0.refund(now);
    }
}

impl Meter {
    pub(crate) fn new(c: &RateAdmissionConfig) -> Meter {
        Meter(Rates::new(PerMinute {
            requests: c.requests_per_minute,
            tokens: c.tokens_per_minute,
            ..PerMinute::default()
        }))
    }

    /// Books one request and `tokens` (input and `max_tokens`), to be sent after the returned
    /// wait (zero: now), or says how long the turn would be when it is past `max_wait` (nothing
    /// is then taken): [`Rates::reserve`]. A first try passes its queue timeout (or what is
    /// left of its deadline); a retry, which never waits, zero.
    pub(crate) fn book(
        &self,
        now: Timestamp,
        tokens: u64,
        max_wait: Duration,
    ) -> Result<(Booking, Duration), Duration> {
        let cost = Tokens { input: tokens, output: 0 };
        self.0.reserve(now, cost, max_wait).map(|(b, wait)| (Booking(b), wait))
    }

    /// How long a 429's hold lasts from `now`, if one does.
    pub(crate) fn held(&self, now: Timestamp) -> Option<Duration> {
        self.0.held(now)
    }

    /// The client hears an answer: what it states of the limits, then, for a 429 to an attempt
    /// sent at `sent_at`, its retry-after — held, and the limits lowered once per wave of 429s
    /// ([`Rates::observe`], [`Rates::refused`]).
    pub(crate) fn heard(
        &self,
        now: Timestamp,
        seen: Stated,
        too_many: Option<(Duration, Timestamp)>,
    ) {
        let seen =
            CoreStated { requests: seen.requests, tokens: seen.tokens, ..CoreStated::default() };
        self.0.observe(now, &seen);
        if let Some((retry_after, sent_at)) = too_many {
            self.0.refused(now, sent_at, Some(retry_after));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(ms: u64) -> Timestamp {
        Timestamp::from_millis(ms)
    }

    fn limit(per_minute: u64, remaining: u64) -> Option<ProviderLimit> {
        Some(ProviderLimit { per_minute, remaining })
    }

    #[test]
    fn the_provider_counts_exactly_and_states_the_wait() {
        let p = Provider::new(&ProviderRate { requests: limit(600, 2), tokens: None });
        assert_eq!(p.headers(at(0)).requests, Observed { limit: Some(600), remaining: Some(2) });
        assert_eq!(p.headers(at(0)).tokens, Observed::default());
        assert!(p.arrive(at(0), 0).unwrap().is_none());
        assert!(p.arrive(at(0), 0).is_ok());
        // Empty: one request refills in 100 ms at 10 a second.
        assert_eq!(p.arrive(at(0), 0).unwrap_err(), Duration::from_millis(100));
        assert_eq!(p.arrive(at(40), 0).unwrap_err(), Duration::from_millis(60));
        assert!(p.arrive(at(100), 0).is_ok());
        assert_eq!(p.headers(at(150)).requests.remaining, Some(0));
        assert_eq!(p.headers(at(200)).requests.remaining, Some(1));
        // A wait that is not whole milliseconds is rounded up.
        let p = Provider::new(&ProviderRate { requests: limit(7, 0), tokens: None });
        assert_eq!(p.arrive(at(0), 0).unwrap_err(), Duration::from_millis(8_572));
    }

    /// 6 000 tokens a minute (100 a second) and 600 requests: the tokens bind. A refused
    /// attempt takes nothing from either bucket, and its retry-after is until both have room; a
    /// served one gives back what it did not use.
    #[test]
    fn the_provider_reserves_the_most_a_call_may_use_and_settles_at_what_it_used() {
        let p =
            Provider::new(&ProviderRate { requests: limit(600, 600), tokens: limit(6_000, 500) });
        let reserved = p.arrive(at(0), 400).unwrap().expect("tokens are limited");
        assert_eq!(p.headers(at(0)).tokens.remaining, Some(100));
        assert_eq!(p.arrive(at(0), 400).unwrap_err(), Duration::from_secs(3));
        assert_eq!(
            p.headers(at(0)).requests.remaining,
            Some(599),
            "the refused request is not counted"
        );
        // It used 150 of the 400: 250 come back.
        reserved.settle(at(0), Some(150));
        assert_eq!(p.headers(at(0)).tokens.remaining, Some(350));
        assert!(p.arrive(at(500), 400).is_ok());
        // With both short, the wait is the longer of the two.
        let p = Provider::new(&ProviderRate { requests: limit(60, 0), tokens: limit(6_000, 0) });
        assert_eq!(p.arrive(at(0), 300).unwrap_err(), Duration::from_secs(3));
        assert_eq!(p.arrive(at(0), 50).unwrap_err(), Duration::from_secs(1));
    }

    #[test]
    fn the_client_learns_the_limits_and_holds_after_a_429() {
        let meter =
            Meter::new(&RateAdmissionConfig { requests_per_minute: None, tokens_per_minute: None });
        for _ in 0..1_000 {
            let (b, wait) = meter.book(at(0), 5_000, Duration::ZERO).expect("no limit known yet");
            assert_eq!(wait, Duration::ZERO);
            b.settle(at(0), None);
        }
        let seen = |requests, tokens| Stated {
            requests: Observed { limit: Some(600), remaining: Some(requests) },
            tokens: Observed { limit: Some(60_000), remaining: Some(tokens) },
        };
        // Room for the request but not for its tokens: 1 000 a second, 500 short. Nothing is
        // taken: the request's unit comes back.
        meter.heard(at(1), seen(600, 0), None);
        assert_eq!(meter.book(at(1), 500, Duration::ZERO).unwrap_err(), Duration::from_millis(500));
        assert_eq!(meter.0.requests.snapshot(at(1)).available, 600);
        meter.heard(at(1), seen(0, 0), None);
        assert_eq!(meter.book(at(1), 0, Duration::ZERO).unwrap_err(), Duration::from_millis(100));
        meter.heard(at(1), seen(0, 0), Some((Duration::from_millis(300), at(0))));
        assert_eq!(meter.held(at(101)), Some(Duration::from_millis(200)));
        assert!(meter.book(at(301), 0, Duration::ZERO).is_ok());
    }

    /// Bookings wait their turn first come, first served, and a refund or a settlement below
    /// the estimate gives tokens back for the next one.
    #[test]
    fn bookings_queue_for_their_turn_and_settling_gives_back_what_was_unused() {
        let meter = Meter::new(&RateAdmissionConfig {
            requests_per_minute: None,
            tokens_per_minute: Some(6_000),
        });
        let (first, wait) = meter.book(at(0), 6_000, Duration::from_secs(1)).unwrap();
        assert_eq!(wait, Duration::ZERO);
        let (second, wait) = meter.book(at(0), 100, Duration::from_secs(1)).unwrap();
        assert_eq!(wait, Duration::from_secs(1), "after the first's tokens have refilled");
        assert_eq!(
            meter.book(at(0), 100, Duration::from_secs(1)).unwrap_err(),
            Duration::from_secs(2)
        );
        second.refund(at(0));
        // The first used 1 000 of its 6 000: the next booking fits at once.
        first.settle(at(0), Some(1_000));
        assert_eq!(meter.book(at(0), 4_000, Duration::ZERO).unwrap().1, Duration::ZERO);
    }
}
