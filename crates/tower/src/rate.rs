//! Rate admission: a model provider's requests and tokens per minute, metered per upstream
//! beside the cap.
//!
//! Each upstream gets its own [`Rates`] — requests, tokens, and (where the provider splits
//! them, as Anthropic does) input and output tokens — each a core
//! [`RateLimit`]. A first try books its request and its
//! estimated tokens ([`RateCost`]) before it queues for its slot:
//! when the window has no room it waits for its turn (first come, first served; within the
//! queue timeout and the deadline, else refused `rate`). A retry never waits: no room now is a
//! refusal `rate`. The booking ([`RateReservation`]) rides with the attempt and is settled
//! when the answer ends, from the `usage` the provider counted ([`UsageTap`]); an attempt that
//! never reached the provider is refunded; one that failed or was abandoned keeps its estimate
//! (the provider may have counted it). Every answer's rate-limit headers correct the estimate
//! (the provider's `remaining` is the truth), a 429 holds the upstream until its reset, and the
//! provider presets ([`Provider`]) add what each provider's answers mean.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use http::{HeaderMap, StatusCode};
use stormguard_core::backoff::Pushback;
use stormguard_core::clock::Timestamp;
use stormguard_core::rate::{RateConfig, RateLimit, RatePermit, RateSnapshot};
use stormguard_http::provider::Tokens;

use crate::Dependency;
use crate::extensions::RateCost;

pub use stormguard_http::rate::{PROVIDER_RETRY_ON, Provider, RateAdmission, UnknownProvider};

/// A provider's limits as one upstream meters them.
#[derive(Debug, Clone)]
pub struct Rates {
    /// Until when (nanoseconds on the dependency's clock) the upstream cools down after an
    /// overloaded answer: first tries and failovers go to another upstream meanwhile.
    cool_until: Arc<AtomicU64>,
    /// How many instances share the provider's limits (see [`Rates::share`]), and the count
    /// the buckets were last told.
    share: Arc<AtomicU64>,
    applied: Arc<AtomicU64>,
    applying: Arc<std::sync::Mutex<()>>,
    /// First tries that waited for their turn, and how long they were told to wait in all
    /// (nanoseconds).
    waits: Arc<AtomicU64>,
    waited_nanos: Arc<AtomicU64>,
    /// Requests per minute.
    pub requests: RateLimit,
    /// Tokens per minute (input and output together).
    pub tokens: RateLimit,
    /// Input tokens per minute.
    pub input_tokens: RateLimit,
    /// Output tokens per minute.
    pub output_tokens: RateLimit,
}

/// One upstream's limits at an instant, for metrics and the dashboard.
#[derive(Debug, Clone, Copy)]
pub struct RatesSnapshot {
    /// Whether the upstream is cooling down after an overloaded answer.
    pub cooling: bool,
    /// First tries that waited for their turn in the window, since the start.
    pub waits: u64,
    /// The waits they booked, in all.
    pub waited: Duration,
    /// Requests per minute.
    pub requests: RateSnapshot,
    /// Tokens per minute.
    pub tokens: RateSnapshot,
    /// Input tokens per minute.
    pub input_tokens: RateSnapshot,
    /// Output tokens per minute.
    pub output_tokens: RateSnapshot,
}

impl RatesSnapshot {
    /// Each quantity by its name (`requests`, `tokens`, `input_tokens`, `output_tokens`, the
    /// `quantity` label of the metrics), in that order.
    pub fn quantities(&self) -> [(&'static str, &RateSnapshot); 4] {
        [
            ("requests", &self.requests),
            ("tokens", &self.tokens),
            ("input_tokens", &self.input_tokens),
            ("output_tokens", &self.output_tokens),
        ]
    }
}

impl Rates {
    /// Full buckets of the configured limits (unknown ones admit everything until learned).
    pub fn new(c: &RateAdmission) -> Rates {
        let limit = |limit| RateLimit::new(RateConfig { limit, window: Duration::from_secs(60) });
        Rates {
            cool_until: Default::default(),
            share: Arc::new(AtomicU64::new(1)),
            applied: Arc::new(AtomicU64::new(1)),
            applying: Default::default(),
            waits: Default::default(),
            waited_nanos: Default::default(),
            requests: limit(c.requests_per_minute),
            tokens: limit(c.tokens_per_minute),
            input_tokens: limit(c.input_tokens_per_minute),
            output_tokens: limit(c.output_tokens_per_minute),
        }
    }

    /// The count of instances that share this upstream's limits (provider limits are per key,
    /// not per instance): each meters `limit / share`. 1 alone; with `placement = "fleet"` the
    /// fleet's lease worker stores its live instances here (`max_instances` while it falls back
    /// or joins).
    pub fn share(&self) -> Arc<AtomicU64> {
        self.share.clone()
    }

    /// Tells the buckets a changed share before they are read.
    fn apply_share(&self, now: Timestamp) {
        if self.share.load(Ordering::Relaxed).max(1) == self.applied.load(Ordering::Acquire) {
            return;
        }
        // Under the lock, with the share read again: a change stored meanwhile is the one
        // applied, and the last to take the lock applies the latest.
        let _one = self.applying.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let n = self.share.load(Ordering::Relaxed).max(1);
        if self.applied.load(Ordering::Acquire) != n {
            for (l, _) in self.each(RateCost::default()) {
                l.set_share(now, n);
            }
            self.applied.store(n, Ordering::Release);
        }
    }

    fn each(&self, cost: RateCost) -> [(&RateLimit, u64); 4] {
        [
            (&self.requests, 1),
            (&self.tokens, cost.input.saturating_add(cost.output)),
            (&self.input_tokens, cost.input),
            (&self.output_tokens, cost.output),
        ]
    }

    /// Books one request and its tokens in every limit, to be sent after the returned wait
    /// (zero: now), or says how long the turn would be when it is past `max_wait` (nothing is
    /// then taken).
    pub fn reserve(
        &self,
        now: Timestamp,
        cost: RateCost,
        max_wait: Duration,
    ) -> Result<(RateReservation, Duration), Duration> {
        self.apply_share(now);
        let mut taken: Vec<RatePermit> = Vec::with_capacity(4);
        let mut wait = Duration::ZERO;
        for (limit, units) in self.each(cost) {
            match limit.reserve(now, units, max_wait) {
                Ok((p, w)) => {
                    taken.push(p);
                    wait = wait.max(w);
                }
                Err(w) => {
                    for p in taken {
                        p.refund(now);
                    }
                    return Err(w.wait);
                }
            }
        }
        let mut it = taken.into_iter();
        let mut next = || it.next().expect("four limits");
        let r = RateReservation {
            requests: next(),
            tokens: next(),
            input_tokens: next(),
            output_tokens: next(),
            estimate: cost,
        };
        Ok((r, wait))
    }

    /// A first try booked a turn `wait` from now and waits for it.
    pub(crate) fn note_wait(&self, wait: Duration) {
        self.waits.fetch_add(1, Ordering::Relaxed);
        let nanos = u64::try_from(wait.as_nanos()).unwrap_or(u64::MAX);
        self.waited_nanos.fetch_add(nanos, Ordering::Relaxed);
    }

    /// How long a request of `cost` would wait for its turn now, without booking anything.
    pub fn wait_for(&self, now: Timestamp, cost: RateCost) -> Duration {
        self.apply_share(now);
        self.each(cost)
            .into_iter()
            .map(|(l, units)| l.wait_for(now, units))
            .max()
            .unwrap_or_default()
    }

    /// How long the upstream is held (a 429's reset, a spent quota, a cool-down), if it is.
    pub fn held(&self, now: Timestamp) -> Option<Duration> {
        self.each(RateCost::default()).into_iter().filter_map(|(l, _)| l.held(now)).max()
    }

    /// The upstream cools down for `d` from `now`: another upstream is preferred meanwhile
    /// (an overloaded provider gets a rest; with one upstream nothing changes, and its
    /// retries stay under the budget and the backoff).
    pub fn cool_down(&self, now: Timestamp, d: Duration) {
        let until = now.saturating_add(d).as_nanos();
        self.cool_until.fetch_max(until, std::sync::atomic::Ordering::Relaxed);
    }

    /// Whether the upstream is cooling down at `now`.
    pub fn cooling(&self, now: Timestamp) -> bool {
        now.as_nanos() < self.cool_until.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Holds every limit for `d` without lowering it.
    pub fn hold(&self, now: Timestamp, d: Duration) {
        for (l, _) in self.each(RateCost::default()) {
            l.hold(now, d);
        }
    }

    /// What an answer's headers say of the limits (a 429's hold is [`refused`](Self::refused)).
    pub fn observe(&self, now: Timestamp, headers: &HeaderMap) {
        let seen = stormguard_http::provider::read_limits(headers);
        self.requests.observe(now, seen.requests);
        self.tokens.observe(now, seen.tokens);
        self.input_tokens.observe(now, seen.input_tokens);
        self.output_tokens.observe(now, seen.output_tokens);
    }

    /// A 429 answered an attempt sent at `sent_at`: every limit is held until `retry_after` (one
    /// unit's refill when it names none) and lowered by a tenth, once per wave of 429s (see
    /// [`RateLimit::refused_attempt`]).
    pub fn refused(&self, now: Timestamp, sent_at: Timestamp, retry_after: Option<Duration>) {
        for (l, _) in self.each(RateCost::default()) {
            l.refused_attempt(now, sent_at, retry_after);
        }
    }

    /// The limits now.
    pub fn snapshot(&self, now: Timestamp) -> RatesSnapshot {
        self.apply_share(now);
        RatesSnapshot {
            cooling: self.cooling(now),
            waits: self.waits.load(Ordering::Relaxed),
            waited: Duration::from_nanos(self.waited_nanos.load(Ordering::Relaxed)),
            requests: self.requests.snapshot(now),
            tokens: self.tokens.snapshot(now),
            input_tokens: self.input_tokens.snapshot(now),
            output_tokens: self.output_tokens.snapshot(now),
        }
    }
}

/// A first try's booking on upstream `target`, as the cap makes it before queueing for a slot:
/// `Ok(None)` without rate admission; the booking and the wait before its turn (zero: now);
/// or `Err(Denied::Rate)`, counted as a refused first try, when the turn is past the queue
/// timeout or the deadline. Public for clients that admit attempts outside tower
/// (stormguard-reqwest).
pub fn book_first_try(
    dep: &Dependency,
    target: usize,
    cost: RateCost,
    deadline: Option<Timestamp>,
    now: Timestamp,
) -> Result<Option<(RateReservation, Duration)>, stormguard_core::Denied> {
    let Some(r) = dep.rates_at(target) else { return Ok(None) };
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
pub async fn wait_turn(
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

/// [`answered`] for a response in tower: its status, headers and [`QuotaExhausted`] extension,
/// read only under rate admission.
///
/// [`QuotaExhausted`]: crate::extensions::QuotaExhausted
pub(crate) fn answered_response<B>(
    dep: &Dependency,
    target: usize,
    sent_at: Timestamp,
    resp: &http::Response<B>,
) {
    if dep.rates_at(target).is_some() {
        let quota = resp.extensions().get::<crate::extensions::QuotaExhausted>().is_some();
        answered(dep, target, sent_at, resp.status(), resp.headers(), quota);
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
    rates.observe(now, headers);
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

/// One attempt's booking in its upstream's limits. Settled from what the provider counted when
/// the answer ends ([`settle`](RateReservation::settle)), refunded when the attempt was never
/// sent ([`refund`](RateReservation::refund)); dropped otherwise (a failed or abandoned
/// attempt), its estimate stays charged and its units leave the outstanding count.
#[derive(Debug)]
pub struct RateReservation {
    requests: RatePermit,
    tokens: RatePermit,
    input_tokens: RatePermit,
    output_tokens: RatePermit,
    /// What the request was estimated to cost (before any limit capped what was taken): what a
    /// stated usage is clamped against.
    estimate: RateCost,
}

impl RateReservation {
    /// Settles the booking with what the provider counted (`None`: keep the estimate), each
    /// count clamped to `max_factor` × its estimate
    /// ([`clamp_usage`](stormguard_core::rate::clamp_usage)). The request itself stays counted.
    /// Returns whether a count was clamped.
    pub fn settle(self, now: Timestamp, used: Option<Tokens>, max_factor: u64) -> bool {
        let mut clamped = false;
        let mut settle = |p: RatePermit, n: Option<u64>, estimate: u64| {
            let n = n.map(|n| {
                let (n, c) = stormguard_core::rate::clamp_usage(n, estimate, max_factor);
                clamped |= c;
                n
            });
            p.settle(now, n);
        };
        let e = self.estimate;
        settle(self.requests, None, 1);
        settle(self.tokens, used.map(Tokens::total), e.input.saturating_add(e.output));
        settle(self.input_tokens, used.map(|u| u.input), e.input);
        settle(self.output_tokens, used.map(|u| u.output), e.output);
        clamped
    }

    /// Gives everything back: the attempt never reached the provider.
    pub fn refund(self, now: Timestamp) {
        self.requests.refund(now);
        self.tokens.refund(now);
        self.input_tokens.refund(now);
        self.output_tokens.refund(now);
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

    fn rates(rpm: u64, tpm: u64) -> Rates {
        Rates::new(&RateAdmission {
            requests_per_minute: Some(rpm),
            tokens_per_minute: Some(tpm),
            ..RateAdmission::default()
        })
    }

    #[test]
    fn a_booking_takes_from_every_limit_or_from_none() {
        let r = rates(600, 1_000);
        let cost = RateCost { input: 100, output: 500 };
        let (b, wait) = r.reserve(Timestamp::ZERO, cost, Duration::ZERO).unwrap();
        assert_eq!(wait, Duration::ZERO);
        let s = r.snapshot(Timestamp::ZERO);
        assert_eq!((s.requests.available, s.tokens.available), (599, 400));
        // The tokens do not fit now: the request's unit is not taken either.
        assert!(r.reserve(Timestamp::ZERO, cost, Duration::ZERO).is_err());
        assert_eq!(r.snapshot(Timestamp::ZERO).requests.available, 599);
        // Settled at what was used: 600 reserved, 250 counted.
        b.settle(Timestamp::ZERO, Some(Tokens { input: 50, output: 200 }), 16);
        let s = r.snapshot(Timestamp::ZERO);
        assert_eq!((s.requests.available, s.tokens.available, s.tokens.outstanding), (599, 750, 0));
    }

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
