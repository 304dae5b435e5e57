//! Rate admission: a model provider's requests and tokens per minute, metered per upstream
//! beside the cap.
//!
//! Each upstream gets its own [`Rates`] — requests, tokens, and (where the provider splits
//! them, as Anthropic does) input and output tokens — each a core
//! [`RateLimit`](stormguard_core::rate::RateLimit). A first try books its request and its
//! estimated tokens ([`RateCost`]) before it queues for its slot:
//! when the window has no room it waits for its turn (first come, first served; within the
//! queue timeout and the deadline, else refused `rate`). A retry never waits: no room now is a
//! refusal `rate`. The booking ([`RateReservation`]) rides with the attempt and is settled
//! when the answer ends, from the `usage` the provider counted ([`UsageTap`]); an attempt that
//! never reached the provider is refunded; one that failed or was abandoned keeps its estimate
//! (the provider may have counted it). Every answer's rate-limit headers correct the estimate
//! (the provider's `remaining` is the truth), a 429 holds the upstream until its reset, and the
//! provider presets ([`Provider`]) add what each provider's answers mean.

use std::time::Duration;

use http::{HeaderMap, StatusCode};
use stormguard_core::backoff::Pushback;
use stormguard_core::clock::Timestamp;
use stormguard_http::provider::Tokens;

use crate::Dependency;
use crate::extensions::RateCost;

pub use stormguard_core::rate::{RateReservation, Rates, RatesSnapshot};
pub use stormguard_http::rate::{PROVIDER_RETRY_ON, Provider, RateAdmission, UnknownProvider};

/// A first try's booking on upstream `target`, as the cap makes it before queueing for a slot:
/// `Ok(None)` without rate admission; the booking and the wait before its turn (zero: now);
/// or `Err(Denied::Rate)`, counted as a refused first try, when the turn is past the queue
/// timeout or the deadline. One step of [`admit_first_try`](crate::cap::admit_first_try).
#[inline]
pub(crate) fn book_first_try(
    dep: &Dependency,
    target: usize,
    cost: RateCost,
    deadline: Option<Timestamp>,
    now: Timestamp,
) -> Result<Option<(RateReservation, Duration)>, stormguard_core::Denied> {
    match dep.rates_at(target) {
        None => Ok(None),
        Some(r) => book(dep, r, cost, deadline, now),
    }
}

/// [`book_first_try`] on an upstream under rate admission (apart: the check above is all most
/// first tries make, inline).
fn book(
    dep: &Dependency,
    r: &Rates,
    cost: RateCost,
    deadline: Option<Timestamp>,
    now: Timestamp,
) -> Result<Option<(RateReservation, Duration)>, stormguard_core::Denied> {
    let mut max_wait = dep.config().limiter.queue_timeout;
    if let Some(d) = deadline {
        max_wait = max_wait.min(d.saturating_since(now));
    }
    match r.reserve(now, cost, max_wait) {
        Ok((booked, wait)) => {
            if !wait.is_zero() {
                r.note_wait(wait);
            }
            Ok(Some((booked, wait)))
        }
        Err(_) => {
            dep.policy().on_primary_refused(stormguard_core::Denied::Rate);
            Err(stormguard_core::Denied::Rate)
        }
    }
}

/// Waits for a first try's booked turn, `wait` from now, and for any hold a 429 or a spent
/// quota put on the upstream meanwhile — never past the queue timeout from now or the
/// deadline: then the booking is refunded and the first try refused `rate` (counted).
///
/// A hold found at the turn does not send every waiter at its end at once: the booking is given
/// back and made again, so the new turn is after the hold and after every booking made before
/// it — the waiters stay spaced by the refill. Dropped before its turn (the caller left), the
/// booking is refunded: nothing was sent.
pub(crate) async fn wait_turn(
    dep: &Dependency,
    target: usize,
    cost: RateCost,
    booked: RateReservation,
    mut wait: Duration,
    deadline: Option<Timestamp>,
) -> Result<RateReservation, stormguard_core::Denied> {
    let mut give_up = dep.now().saturating_add(dep.config().limiter.queue_timeout);
    if let Some(d) = deadline {
        give_up = give_up.min(d);
    }
    let mut booked = Unsent::new(dep, Some(booked));
    loop {
        tokio::time::sleep(wait).await;
        let now = dep.now();
        let Some(rates) = dep.rates_at(target) else { break };
        if rates.held(now).is_none() {
            break;
        }
        if let Some(b) = booked.take() {
            b.refund(now);
        }
        match rates.reserve(now, cost, give_up.saturating_since(now)) {
            Ok((again, w)) => {
                booked = Unsent::new(dep, Some(again));
                wait = w;
            }
            Err(_) => {
                dep.policy().on_primary_refused(stormguard_core::Denied::Rate);
                return Err(stormguard_core::Denied::Rate);
            }
        }
    }
    Ok(booked.sent().expect("a booking"))
}

/// A booking not sent yet: refunded if dropped (the caller went away, or the attempt was
/// refused before it was sent), handed over with [`Unsent::sent`] when the attempt goes out.
#[derive(Debug)]
pub struct Unsent {
    booked: Option<RateReservation>,
    dep: Dependency,
}

impl Unsent {
    /// Guards `booked` (none: nothing to guard).
    pub fn new(dep: &Dependency, booked: Option<RateReservation>) -> Unsent {
        Unsent { booked, dep: dep.clone() }
    }

    fn take(&mut self) -> Option<RateReservation> {
        self.booked.take()
    }

    /// The attempt is sent: the booking is its now.
    pub fn sent(mut self) -> Option<RateReservation> {
        self.booked.take()
    }
}

impl Drop for Unsent {
    fn drop(&mut self) {
        if let Some(b) = self.booked.take() {
            b.refund(self.dep.now());
        }
    }
}

/// A retry's booking on upstream `target`: now or never (no room is `Err(Denied::Rate)`, for
/// the caller to count as a denial, or a shadow denial). `Ok(None)` without rate admission.
/// Made before the retry is admitted, so a refusal charges no budget.
pub fn book_retry(
    dep: &Dependency,
    target: usize,
    cost: RateCost,
    now: Timestamp,
) -> Result<Option<RateReservation>, stormguard_core::Denied> {
    let Some(r) = dep.rates_at(target) else { return Ok(None) };
    match r.reserve(now, cost, Duration::ZERO) {
        Ok((booked, _)) => Ok(Some(booked)),
        Err(_) => Err(stormguard_core::Denied::Rate),
    }
}

/// [`answered`] for a response's head in tower: its status, headers and [`QuotaExhausted`]
/// extension, read only under rate admission.
///
/// [`QuotaExhausted`]: crate::extensions::QuotaExhausted
#[inline]
pub(crate) fn answered_head(
    dep: &Dependency,
    target: usize,
    sent_at: Timestamp,
    head: &http::response::Parts,
) {
    if dep.rates_at(target).is_some() {
        let quota = head.extensions.get::<crate::extensions::QuotaExhausted>().is_some();
        answered(dep, target, sent_at, head.status, &head.headers, quota);
    }
}

/// What an answer from upstream `target` tells rate admission: the limits its headers state; a
/// 429 holds the upstream until the reset it names (read as the retry layer reads pushback:
/// `retry-after`, `retry-after-ms`, an exhausted window's reset) and lowers the limits; a spent
/// quota ([`QuotaExhausted`](crate::extensions::QuotaExhausted)) holds it for the quota hold; an overloaded answer cools it down.
pub fn answered(
    dep: &Dependency,
    target: usize,
    sent_at: Timestamp,
    status: StatusCode,
    headers: &HeaderMap,
    quota_exhausted: bool,
) {
    let Some(rates) = dep.rates_at(target) else { return };
    let now = dep.now();
    let config = &dep.config().rate;
    let too_many = (status == StatusCode::TOO_MANY_REQUESTS).then(|| {
        // Malformed values are counted once, by the retry layer's reading.
        let uncounted = stormguard_http::headers::HeaderStats::new();
        let said = dep.config().pushback_headers.read_pushback(
            headers,
            status,
            std::time::SystemTime::now(),
            &uncounted,
        );
        match said {
            // However long the upstream asks, admission is held at most `max_hold`.
            Some(Pushback::RetryAfter(d)) => Some(d.min(config.max_hold)),
            _ => None,
        }
    });
    rates.observe(now, &stormguard_http::provider::read_limits(headers).stated());
    // A spent quota says nothing of the rate: held, not lowered.
    if let (Some(retry_after), false) = (too_many, quota_exhausted) {
        rates.refused(now, sent_at, retry_after);
    }
    if quota_exhausted {
        let hold = config.quota_hold.min(config.max_hold);
        rates.hold(now, hold);
        tracing::warn!(
            dependency = dep.name(),
            upstream = target,
            hold_s = hold.as_secs(),
            "the provider says the quota is spent: no retry, and no attempt to this upstream until the hold ends"
        );
    } else if config.provider.is_some_and(|p| p.overloaded(status)) {
        rates.cool_down(now, config.overload_cool_down);
        tracing::debug!(
            dependency = dep.name(),
            upstream = target,
            cool_down_ms = config.overload_cool_down.as_millis() as u64,
            "the provider is overloaded: the upstream cools down"
        );
    }
}

/// What an answer's body says the provider counted: its first and last few KiB are kept as
/// they stream past (a JSON answer's `usage` is near its end; a streamed answer's input count
/// is in its first event and its output count in its last), and read when it ends.
#[derive(Debug, Default)]
pub struct UsageTap {
    head: Vec<u8>,
    tail: Vec<u8>,
}

/// How much of each end of an answer is kept.
const TAP_KEEP: usize = 4096;

impl UsageTap {
    /// Notes one chunk of the body.
    pub fn feed(&mut self, chunk: &[u8]) {
        if self.head.len() < TAP_KEEP {
            let n = (TAP_KEEP - self.head.len()).min(chunk.len());
            self.head.extend_from_slice(&chunk[..n]);
        }
        self.tail.extend_from_slice(chunk);
        if self.tail.len() > 2 * TAP_KEEP {
            self.tail.drain(..self.tail.len() - TAP_KEEP);
        }
    }

    /// The usage the body stated, if it stated one: the larger count of each kind from either
    /// end.
    pub fn usage(&self) -> Option<Tokens> {
        self.read().tokens
    }

    /// [`usage`](Self::usage), and whether a count was malformed (the usage is then ignored).
    pub fn read(&self) -> stormguard_http::provider::Usage {
        use stormguard_http::provider::read_usage;
        let (a, b) = (read_usage(&self.head), read_usage(&self.tail));
        let malformed = a.malformed || b.malformed;
        let tokens = match (a.tokens, b.tokens) {
            _ if malformed => None,
            (Some(a), Some(b)) => {
                Some(Tokens { input: a.input.max(b.input), output: a.output.max(b.output) })
            }
            (a, b) => a.or(b),
        };
        stormguard_http::provider::Usage { tokens, malformed }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tap_reads_usage_from_either_end_of_a_long_stream() {
        let mut tap = UsageTap::default();
        tap.feed(b"event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":25,\"output_tokens\":1}}}\n\n");
        for _ in 0..1_000 {
            tap.feed(b"event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"delta\":{\"text\":\"hello\"}}\n\n");
        }
        tap.feed(b"event: message_delta\ndata: {\"type\":\"message_delta\",\"usage\":{\"output_tokens\":1000}}\n\n");
        assert_eq!(tap.usage(), Some(Tokens { input: 25, output: 1_000 }));
        assert!(tap.head.len() <= TAP_KEEP && tap.tail.len() <= 2 * TAP_KEEP);
    }
}
