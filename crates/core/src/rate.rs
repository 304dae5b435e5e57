//! Rate admission: a provider's requests or tokens per window, metered before sending.
//!
//! A model API's ceiling is not only calls in flight but requests and tokens per minute,
//! announced on every answer (`x-ratelimit-remaining-tokens`, `anthropic-ratelimit-...`) and
//! enforced with a 429. A [`RateLimit`] meters one such quantity the way providers describe
//! theirs: a bucket of `limit` units that refills continuously over `window` (OpenAI's and
//! Anthropic's "replenished continuously up to the maximum"). A first try takes its cost from
//! the bucket before it is sent ([`RateLimit::try_acquire`]) or is told how long to wait; the
//! answer settles the cost ([`RatePermit::settle`]: a token estimate refunded or charged to what
//! the provider counted), and the provider's own word corrects the estimate
//! ([`RateLimit::observe`]): its `remaining` is the truth, so the local level follows it and is
//! never above it. A 429 that arrives anyway holds the limit until the reset it names and lowers
//! the limit learned ([`RateLimit::refused`]).
//!
//! [`Rates`] is one upstream's four limits together (requests, tokens, input and output
//! tokens) with what every placement adds around them — the instances sharing a provider's key,
//! a cool-down after an overloaded answer, a booking per attempt ([`RateReservation`]) — the
//! tower layer's rate admission and the simulator's client alike.
//!
//! The arithmetic is exact: the level is kept in units × window-nanoseconds, so a refill of
//! `elapsed × limit` and a cost of `units × window` compare without rounding. Time is a
//! parameter; nothing here sleeps. A permit that is dropped unsettled (an error, a reset, a
//! timeout, an abandoned caller) keeps its charge, and its units leave the outstanding count, so
//! reservations always balance ([`RateSnapshot::outstanding`] returns to 0).
//!
//! ```
//! use std::time::Duration;
//! use stormguard_core::clock::Timestamp;
//! use stormguard_core::rate::{RateConfig, RateLimit};
//!
//! // 600 requests a minute: 10 a second, 600 at once from a full bucket.
//! let rpm = RateLimit::new(RateConfig { limit: Some(600), window: Duration::from_secs(60) });
//! let t0 = Timestamp::ZERO;
//! for _ in 0..600 {
//!     rpm.try_acquire(t0, 1).unwrap().settle(t0, None);
//! }
//! // The 601st waits 100 ms, for one request's worth of refill.
//! assert_eq!(rpm.try_acquire(t0, 1).unwrap_err().wait, Duration::from_millis(100));
//! assert!(rpm.try_acquire(Timestamp::from_millis(100), 1).is_ok());
//! ```

use std::time::Duration;

use crate::clock::Timestamp;
use crate::sync::{Arc, AtomicU64, Mutex, Ordering};

/// One rate limit: `limit` units per `window`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RateConfig {
    /// Units per window (requests, or tokens). `None`: not known yet; everything is admitted
    /// until a response header states it.
    pub limit: Option<u64>,
    /// The window the limit is counted over. Providers count per minute.
    pub window: Duration,
}

impl Default for RateConfig {
    fn default() -> RateConfig {
        RateConfig { limit: None, window: Duration::from_secs(60) }
    }
}

/// What a response said of one limit (any part may be missing).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Observed {
    /// The limit per window.
    pub limit: Option<u64>,
    /// What is left of it now.
    pub remaining: Option<u64>,
}

/// Why a unit cannot be taken now, and for how long.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RateWait {
    /// How long until the bucket holds the cost (or a 429's hold ends).
    pub wait: Duration,
}

/// One limit's state at an instant, for metrics and the dashboard.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RateSnapshot {
    /// The limit in force (configured or learned).
    pub limit: Option<u64>,
    /// Whole units available now (0 while in debt).
    pub available: u64,
    /// Units reserved by permits not yet settled or dropped.
    pub outstanding: u64,
    /// Until when a 429 holds the limit, if it does.
    pub held_until: Option<Timestamp>,
}

#[derive(Debug)]
struct State {
    limit: Option<u64>,
    window_nanos: u128,
    /// Units × window-nanoseconds available; negative is debt (a cost settled above its
    /// estimate).
    level: i128,
    /// When `level` was last refilled.
    at: Timestamp,
    held_until: Timestamp,
    outstanding: u64,
    /// How many instances share the limit (a fleet's live instances): this one meters
    /// `limit / share`. 1 alone.
    share: u64,
    /// When the limit was last lowered by a 429 (see [`RateLimit::refused_attempt`]).
    lowered_at: Option<Timestamp>,
}

impl State {
    /// One unit's refill at this instance's rate (a second when the limit is unknown): how long
    /// a 429 that named no time holds.
    fn unit_refill(&self) -> Duration {
        match self.rate() {
            Some(l) => Duration::from_nanos(
                u64::try_from(self.window_nanos / u128::from(l.max(1))).unwrap_or(u64::MAX),
            ),
            None => Duration::from_secs(1),
        }
    }

    /// The units per window this instance meters: its share of the limit (at least 1).
    fn rate(&self) -> Option<u64> {
        self.limit.map(|l| (l / self.share.max(1)).max(1))
    }

    fn capacity(&self) -> Option<i128> {
        self.rate().map(|l| i128::from(l) * self.window_nanos as i128)
    }

    fn refill(&mut self, now: Timestamp) {
        if now > self.at {
            if let (Some(l), Some(cap)) = (self.rate(), self.capacity()) {
                let elapsed = i128::try_from(now.saturating_since(self.at).as_nanos())
                    .unwrap_or(i128::MAX / 4);
                self.level =
                    self.level.saturating_add(elapsed.saturating_mul(i128::from(l))).min(cap);
            }
            self.at = now;
        }
    }

    /// The cost as taken (at most the whole limit) and the wait before the bucket holds it:
    /// after the hold, and after the refill covers every unit booked before.
    fn turn(&self, now: Timestamp, cost: u64) -> (u64, Duration) {
        let mut wait = self.held_until.saturating_since(now);
        let Some(l) = self.rate() else { return (cost, wait) };
        let cost = cost.min(l);
        let need = self.units(cost);
        if self.level < need {
            // The refill at `l` units per window brings the level to `need` in this many
            // nanoseconds, rounded up.
            let short = (need - self.level) as u128;
            let nanos = short.div_ceil(u128::from(l.max(1)));
            wait = wait.max(Duration::from_nanos(u64::try_from(nanos).unwrap_or(u64::MAX)));
        }
        (cost, wait)
    }

    fn units(&self, n: u64) -> i128 {
        i128::from(n).saturating_mul(self.window_nanos as i128)
    }
}

/// A provider's limit on one quantity, shared by every request to that upstream. Cheap to
/// clone (one `Arc`).
#[derive(Debug, Clone)]
pub struct RateLimit {
    state: Arc<Mutex<State>>,
}

impl RateLimit {
    /// A full bucket of `config.limit` units (or an unknown limit, admitting everything).
    pub fn new(config: RateConfig) -> RateLimit {
        let window_nanos = config.window.as_nanos().max(1);
        let mut s = State {
            limit: config.limit,
            window_nanos,
            level: 0,
            at: Timestamp::ZERO,
            held_until: Timestamp::ZERO,
            outstanding: 0,
            share: 1,
            lowered_at: None,
        };
        s.level = s.capacity().unwrap_or(0);
        RateLimit { state: Arc::new(Mutex::new(s)) }
    }

    /// Takes `cost` units for a request about to be sent, or says how long until they are
    /// there. A cost above the whole limit is taken as the whole limit (it could never fit
    /// otherwise); while a 429's hold lasts nothing is taken.
    pub fn try_acquire(&self, now: Timestamp, cost: u64) -> Result<RatePermit, RateWait> {
        self.reserve(now, cost, Duration::ZERO).map(|(p, _)| p)
    }

    /// Takes `cost` units now, or books them: when the bucket will hold them within
    /// `max_wait` — after every booking made before this one, and after a 429's hold — they
    /// are taken now (the level goes below zero) and the permit comes with the wait before the
    /// request may be sent. Callers served in the order they booked: a FIFO queue with no
    /// queue, each waiter's turn fixed when it arrived. When the turn is further than
    /// `max_wait`, nothing is taken and the error says how far it is. A booking given up before
    /// its turn is refunded with [`RatePermit::refund`].
    pub fn reserve(
        &self,
        now: Timestamp,
        cost: u64,
        max_wait: Duration,
    ) -> Result<(RatePermit, Duration), RateWait> {
        let mut s = self.state.lock();
        s.refill(now);
        let (cost, wait) = s.turn(now, cost);
        if wait > max_wait {
            return Err(RateWait { wait });
        }
        let metered = s.limit.is_some();
        if metered {
            s.level -= s.units(cost);
        }
        s.outstanding += cost;
        Ok((RatePermit { limit: self.clone(), cost, metered, settled: false }, wait))
    }

    /// How long a request of `cost` units would wait for its turn now (zero: it fits), without
    /// taking anything.
    pub fn wait_for(&self, now: Timestamp, cost: u64) -> Duration {
        let mut s = self.state.lock();
        s.refill(now);
        s.turn(now, cost).1
    }

    /// The limit is shared by `share` instances (a fleet's live instances, each metering its
    /// own bucket): from `now` this one refills at `limit / share` and holds at most that. The
    /// provider's `remaining`, which counts the whole key, still caps the level.
    pub fn set_share(&self, now: Timestamp, share: u64) {
        let mut s = self.state.lock();
        s.refill(now);
        s.share = share.max(1);
        if let Some(cap) = s.capacity() {
            s.level = s.level.min(cap);
        }
    }

    /// How long a 429's hold (or a cool-down) lasts from `now`, if one does.
    pub fn held(&self, now: Timestamp) -> Option<Duration> {
        let s = self.state.lock();
        (now < s.held_until).then(|| s.held_until.saturating_since(now))
    }

    /// Holds the limit for `d` from `now` without lowering it: nothing is taken until then (an
    /// overloaded provider cooling down, or a quota spent). A longer hold already in force
    /// stays.
    pub fn hold(&self, now: Timestamp, d: Duration) {
        let mut s = self.state.lock();
        s.held_until = s.held_until.max(now.saturating_add(d));
    }

    /// What a response said: a stated limit replaces the one in force; a stated `remaining`
    /// brings the level down to it (never up: requests already sent may not have reached the
    /// provider's count yet).
    pub fn observe(&self, now: Timestamp, seen: Observed) {
        let mut s = self.state.lock();
        s.refill(now);
        if let Some(l) = seen.limit.filter(|l| *l > 0) {
            if s.limit.is_none() {
                // Learned for the first time: start from what the provider says is left.
                s.level = i128::from(seen.remaining.unwrap_or(l).min(l)) * s.window_nanos as i128;
            }
            s.limit = Some(l);
            let cap = s.capacity().unwrap_or(0);
            s.level = s.level.min(cap);
        }
        if let Some(r) = seen.remaining {
            let stated = s.units(r);
            s.level = s.level.min(stated);
        }
    }

    /// A 429 arrived anyway: nothing more is taken until `retry_after` has passed (or one
    /// unit's refill when the provider named no time), the level is emptied, and a known limit
    /// is lowered by a tenth (at least 1 left): the provider's real limit is below the one in
    /// force. A 429 that arrives while a hold is in force lowers nothing more (it answers an
    /// attempt sent before the first 429 came back); a limit the provider states again restores
    /// it.
    pub fn refused(&self, now: Timestamp, retry_after: Option<Duration>) {
        let mut s = self.state.lock();
        s.refill(now);
        let hold = retry_after.unwrap_or_else(|| s.unit_refill());
        // 429s that arrive together (attempts sent before the first came back) are one
        // refusal: the limit is lowered once per hold.
        if now >= s.held_until
            && let Some(l) = s.limit
        {
            s.limit = Some((l - l / 10).max(1));
        }
        s.held_until = s.held_until.max(now.saturating_add(hold));
        s.level = s.level.min(0);
    }

    /// A 429 for an attempt sent at `sent_at`: as [`refused`](RateLimit::refused), but the
    /// limit is lowered only when the attempt was sent after the last lowering — 429s that
    /// answer attempts already on their way when the first came back say nothing new, however
    /// long they took (a model's answer can take longer than the hold).
    pub fn refused_attempt(
        &self,
        now: Timestamp,
        sent_at: Timestamp,
        retry_after: Option<Duration>,
    ) {
        let mut s = self.state.lock();
        s.refill(now);
        let hold = retry_after.unwrap_or_else(|| s.unit_refill());
        if s.lowered_at.is_none_or(|t| sent_at >= t)
            && let Some(l) = s.limit
        {
            s.limit = Some((l - l / 10).max(1));
            s.lowered_at = Some(now);
        }
        s.held_until = s.held_until.max(now.saturating_add(hold));
        s.level = s.level.min(0);
    }

    /// The state now.
    pub fn snapshot(&self, now: Timestamp) -> RateSnapshot {
        let mut s = self.state.lock();
        s.refill(now);
        let available = if s.level <= 0 { 0 } else { (s.level / s.window_nanos as i128) as u64 };
        RateSnapshot {
            limit: s.limit,
            available: if s.limit.is_some() { available } else { u64::MAX },
            outstanding: s.outstanding,
            held_until: (now < s.held_until).then_some(s.held_until),
        }
    }

    fn settle(&self, now: Timestamp, cost: u64, metered: bool, actual: Option<u64>) {
        let mut s = self.state.lock();
        s.refill(now);
        s.outstanding = s.outstanding.saturating_sub(cost);
        if let (Some(actual), Some(cap)) = (actual, s.capacity()) {
            // A refund of what was reserved but not used, or a charge for what was used
            // beyond it (debt, paid back by the refill). Booked while the limit was unknown,
            // nothing was taken: only what was used is charged.
            // The debt is never deeper than one window: whatever a count says, the limit is
            // admitting again within a window.
            // (A level already below that, from bookings queued for their turns, stays where
            // they put it: a settlement never lowers it further, and never erases them.)
            let taken = if metered { s.units(cost) } else { 0 };
            let diff = taken.saturating_sub(s.units(actual));
            let floor = s.level.min(-cap);
            s.level = s.level.saturating_add(diff).min(cap).max(floor);
        }
    }
}

/// Whether a first try that got its slot after waiting in the queue waits out a hold that began
/// meanwhile (a 429, a spent quota), keeping the slot: only while the hold fits within its queue
/// timeout and ends by its deadline; otherwise it is refused `rate`. One rule for every
/// placement (the tower layer's first try, the simulator's).
pub fn waits_out_hold(
    held: Duration,
    queue_timeout: Duration,
    now: Timestamp,
    deadline: Option<Timestamp>,
) -> bool {
    held <= queue_timeout && deadline.is_none_or(|d| now.saturating_add(held) <= d)
}

/// A provider's count for a request, clamped to `max_factor` × what the request was estimated
/// to cost: a count far above anything the request could have used (`1e30` tokens from a broken
/// or hostile upstream) is not a count. Returns the count to settle with, and whether it was
/// clamped. A factor of `u64::MAX` clamps nothing.
///
/// ```
/// use stormguard_core::rate::clamp_usage;
///
/// assert_eq!(clamp_usage(1_500, 1_100, 16), (1_500, false));
/// assert_eq!(clamp_usage(u64::MAX, 1_100, 16), (17_600, true));
/// ```
pub fn clamp_usage(counted: u64, estimate: u64, max_factor: u64) -> (u64, bool) {
    let bound = estimate.max(1).saturating_mul(max_factor);
    if counted > bound { (bound, true) } else { (counted, false) }
}

/// Units taken for one request. Settle it with what the provider counted; dropped unsettled, its
/// charge stands (the request may have been counted) and it leaves the outstanding count.
#[derive(Debug)]
pub struct RatePermit {
    limit: RateLimit,
    cost: u64,
    /// Whether the cost was taken from the level (the limit was known when it was booked).
    metered: bool,
    settled: bool,
}

impl RatePermit {
    /// The units taken.
    pub fn cost(&self) -> u64 {
        self.cost
    }

    /// Settles the permit: `actual` is what the provider counted (the answer's `usage`), or
    /// `None` to keep the charge as estimated.
    pub fn settle(mut self, now: Timestamp, actual: Option<u64>) {
        self.settled = true;
        self.limit.settle(now, self.cost, self.metered, actual);
    }
}

impl RatePermit {
    /// Gives every unit back: the request was never sent (refused, or given up before its
    /// turn).
    pub fn refund(self, now: Timestamp) {
        self.settle(now, Some(0));
    }
}

impl Drop for RatePermit {
    fn drop(&mut self) {
        if !self.settled {
            let mut s = self.limit.state.lock();
            s.outstanding = s.outstanding.saturating_sub(self.cost);
        }
    }
}

/// A request's tokens: its cost before it is sent (its input, estimated, and its output at
/// most), or what the provider counted after.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct Tokens {
    /// Input (prompt) tokens.
    pub input: u64,
    /// Output (completion) tokens.
    pub output: u64,
}

impl Tokens {
    /// Input and output together.
    pub fn total(self) -> u64 {
        self.input.saturating_add(self.output)
    }
}

/// What an answer states of a provider's four limits (any part may be missing).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stated {
    /// Requests per window.
    pub requests: Observed,
    /// Tokens per window (input and output together).
    pub tokens: Observed,
    /// Input tokens per window (Anthropic).
    pub input_tokens: Observed,
    /// Output tokens per window (Anthropic).
    pub output_tokens: Observed,
}

/// Configured limits per minute; `None`: not limited until an answer states one.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PerMinute {
    /// Requests per minute.
    pub requests: Option<u64>,
    /// Tokens per minute (input and output together).
    pub tokens: Option<u64>,
    /// Input tokens per minute.
    pub input_tokens: Option<u64>,
    /// Output tokens per minute.
    pub output_tokens: Option<u64>,
}

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
    applying: Arc<Mutex<()>>,
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
    /// Full buckets of the configured limits per minute (unknown ones admit everything until
    /// learned).
    pub fn new(limits: PerMinute) -> Rates {
        let limit = |limit| RateLimit::new(RateConfig { limit, window: Duration::from_secs(60) });
        Rates {
            cool_until: Arc::new(AtomicU64::new(0)),
            share: Arc::new(AtomicU64::new(1)),
            applied: Arc::new(AtomicU64::new(1)),
            applying: Arc::new(Mutex::new(())),
            waits: Arc::new(AtomicU64::new(0)),
            waited_nanos: Arc::new(AtomicU64::new(0)),
            requests: limit(limits.requests),
            tokens: limit(limits.tokens),
            input_tokens: limit(limits.input_tokens),
            output_tokens: limit(limits.output_tokens),
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
        let _one = self.applying.lock();
        let n = self.share.load(Ordering::Relaxed).max(1);
        if self.applied.load(Ordering::Acquire) != n {
            for (l, _) in self.each(Tokens::default()) {
                l.set_share(now, n);
            }
            self.applied.store(n, Ordering::Release);
        }
    }

    fn each(&self, cost: Tokens) -> [(&RateLimit, u64); 4] {
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
        cost: Tokens,
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

    /// A first try booked a turn `wait` from now and waits for it (counted for the metrics).
    pub fn note_wait(&self, wait: Duration) {
        self.waits.fetch_add(1, Ordering::Relaxed);
        let nanos = u64::try_from(wait.as_nanos()).unwrap_or(u64::MAX);
        self.waited_nanos.fetch_add(nanos, Ordering::Relaxed);
    }

    /// How long a request of `cost` would wait for its turn now, without booking anything.
    pub fn wait_for(&self, now: Timestamp, cost: Tokens) -> Duration {
        self.apply_share(now);
        self.each(cost)
            .into_iter()
            .map(|(l, units)| l.wait_for(now, units))
            .max()
            .unwrap_or_default()
    }

    /// How long the upstream is held (a 429's reset, a spent quota, a cool-down), if it is.
    pub fn held(&self, now: Timestamp) -> Option<Duration> {
        self.each(Tokens::default()).into_iter().filter_map(|(l, _)| l.held(now)).max()
    }

    /// The upstream cools down for `d` from `now`: another upstream is preferred meanwhile
    /// (an overloaded provider gets a rest; with one upstream nothing changes, and its
    /// retries stay under the budget and the backoff).
    pub fn cool_down(&self, now: Timestamp, d: Duration) {
        let until = now.saturating_add(d).as_nanos();
        self.cool_until.fetch_max(until, Ordering::Relaxed);
    }

    /// Whether the upstream is cooling down at `now`.
    pub fn cooling(&self, now: Timestamp) -> bool {
        now.as_nanos() < self.cool_until.load(Ordering::Relaxed)
    }

    /// Holds every limit for `d` without lowering it.
    pub fn hold(&self, now: Timestamp, d: Duration) {
        for (l, _) in self.each(Tokens::default()) {
            l.hold(now, d);
        }
    }

    /// What an answer states of the limits (its headers, read by the placement; a 429's hold
    /// is [`refused`](Self::refused)).
    pub fn observe(&self, now: Timestamp, seen: &Stated) {
        self.requests.observe(now, seen.requests);
        self.tokens.observe(now, seen.tokens);
        self.input_tokens.observe(now, seen.input_tokens);
        self.output_tokens.observe(now, seen.output_tokens);
    }

    /// A 429 answered an attempt sent at `sent_at`: every limit is held until `retry_after` (one
    /// unit's refill when it names none) and lowered by a tenth, once per wave of 429s (see
    /// [`RateLimit::refused_attempt`]).
    pub fn refused(&self, now: Timestamp, sent_at: Timestamp, retry_after: Option<Duration>) {
        for (l, _) in self.each(Tokens::default()) {
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
    estimate: Tokens,
}

impl RateReservation {
    /// Settles the booking with what the provider counted (`None`: keep the estimate), each
    /// count clamped to `max_factor` × its estimate
    /// ([`clamp_usage`]). The request itself stays counted.
    /// Returns whether a count was clamped.
    pub fn settle(self, now: Timestamp, used: Option<Tokens>, max_factor: u64) -> bool {
        let mut clamped = false;
        let mut settle = |p: RatePermit, n: Option<u64>, estimate: u64| {
            let n = n.map(|n| {
                let (n, c) = clamp_usage(n, estimate, max_factor);
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

#[cfg(all(test, not(stormguard_loom)))]
mod tests {
    use super::*;

    fn rates(rpm: u64, tpm: u64) -> Rates {
        Rates::new(PerMinute { requests: Some(rpm), tokens: Some(tpm), ..PerMinute::default() })
    }

    #[test]
    fn a_booking_takes_from_every_limit_or_from_none() {
        let r = rates(600, 1_000);
        let cost = Tokens { input: 100, output: 500 };
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

    use crate::random::{RandomSource, SplitMix64};

    fn per_minute(limit: u64) -> RateLimit {
        RateLimit::new(RateConfig { limit: Some(limit), window: Duration::from_secs(60) })
    }

    fn at(ms: u64) -> Timestamp {
        Timestamp::from_millis(ms)
    }

    /// Arrivals at twice the limit for 20 s (virtual time) on a bucket the provider said is
    /// empty, each first try waiting for its turn in FIFO order: the provider receives at most
    /// the refill's worth, and at least 90 % of it. Unmetered, it receives twice that.
    #[test]
    fn twice_the_limit_is_held_to_the_limit() {
        for metered in [true, false] {
            let rpm = per_minute(600); // 10/s
            rpm.observe(Timestamp::ZERO, Observed { limit: None, remaining: Some(0) });
            let mut rng = SplitMix64::new(7);
            // 20 /s for 20 s, Poisson.
            let mut t = 0.0f64;
            let mut next_free = Timestamp::ZERO;
            let mut sent = 0u64;
            let mut offered = 0u64;
            while t < 20.0 {
                let u = (rng.below(1 << 53) as f64 + 1.0) / (1u64 << 53) as f64;
                t += -u.ln() / 20.0;
                offered += 1;
                if !metered {
                    sent += 1;
                    continue;
                }
                // The caller waits (FIFO) until its unit is there; a wait past the end of the
                // run is a request never sent.
                let mut now = Timestamp::from_nanos((t * 1e9) as u64).max(next_free);
                loop {
                    match rpm.try_acquire(now, 1) {
                        Ok(p) => {
                            p.settle(now, None);
                            break;
                        }
                        Err(w) => now = now.saturating_add(w.wait),
                    }
                }
                next_free = now;
                if now <= at(20_000) {
                    sent += 1;
                }
            }
            // 20 s of refill at 10/s.
            let most = 200;
            if metered {
                assert!(sent <= most, "{sent}");
                assert!(sent as f64 >= 0.9 * most.min(offered) as f64, "{sent} of {offered}");
            } else {
                assert!(sent > most, "unmetered, the provider would see {sent}");
            }
        }
    }

    /// Bookings are served in the order they were made: each waiter's turn is one refill
    /// after the one before, a booking past `max_wait` takes nothing, and a refunded booking
    /// gives its turn back.
    #[test]
    fn bookings_are_first_come_first_served() {
        let rpm = per_minute(60); // one a second
        rpm.observe(at(0), Observed { limit: None, remaining: Some(0) });
        let mut turns = Vec::new();
        let mut permits = Vec::new();
        for _ in 0..3 {
            let (p, wait) = rpm.reserve(at(0), 1, Duration::from_secs(5)).unwrap();
            turns.push(wait);
            permits.push(p);
        }
        assert_eq!(turns, [1, 2, 3].map(Duration::from_secs));
        // The fourth, fifth… would wait 4 s, 5 s: past a 3.5 s bound, refused, nothing taken.
        assert_eq!(
            rpm.reserve(at(0), 1, Duration::from_millis(3_500)).unwrap_err().wait,
            Duration::from_secs(4)
        );
        assert_eq!(rpm.snapshot(at(0)).outstanding, 3);
        // The last booking gives up: the next one takes its turn.
        permits.pop().unwrap().refund(at(0));
        let (_p, wait) = rpm.reserve(at(0), 1, Duration::from_secs(5)).unwrap();
        assert_eq!(wait, Duration::from_secs(3));
    }

    #[test]
    fn a_hold_delays_every_booking_without_lowering_the_limit() {
        let rpm = per_minute(600);
        rpm.hold(at(0), Duration::from_secs(2));
        assert_eq!(rpm.held(at(500)), Some(Duration::from_millis(1_500)));
        assert!(rpm.try_acquire(at(500), 1).is_err());
        let (_p, wait) = rpm.reserve(at(500), 1, Duration::from_secs(2)).unwrap();
        assert_eq!(wait, Duration::from_millis(1_500));
        assert_eq!(rpm.snapshot(at(0)).limit, Some(600));
        assert_eq!(rpm.held(at(2_000)), None);
        // A shorter hold does not cut a longer one.
        rpm.hold(at(0), Duration::from_secs(10));
        rpm.hold(at(1_000), Duration::from_secs(1));
        assert_eq!(rpm.held(at(5_000)), Some(Duration::from_secs(5)));
    }

    /// Two instances share a key's 600 a minute: each holds and refills at 300 a minute.
    #[test]
    fn a_shared_limit_is_metered_by_its_share() {
        let rpm = per_minute(600);
        rpm.set_share(at(0), 2);
        assert_eq!(rpm.snapshot(at(0)).available, 300);
        assert_eq!(rpm.snapshot(at(0)).limit, Some(600), "the key's limit is still shown");
        for _ in 0..300 {
            rpm.try_acquire(at(0), 1).unwrap().settle(at(0), None);
        }
        // One unit at 300 a minute: 200 ms.
        assert_eq!(rpm.try_acquire(at(0), 1).unwrap_err().wait, Duration::from_millis(200));
        // Alone again: the refill is at the whole limit, the bucket as large.
        rpm.set_share(at(0), 1);
        assert_eq!(rpm.try_acquire(at(0), 1).unwrap_err().wait, Duration::from_millis(100));
        assert_eq!(rpm.snapshot(at(60_000)).available, 600);
    }

    /// 429s for attempts sent before the limit was last lowered lower it no further, however
    /// late they arrive; one for an attempt sent after does.
    #[test]
    fn a_limit_is_lowered_once_per_wave_of_429s() {
        let rpm = per_minute(600);
        rpm.refused_attempt(at(5_000), at(0), Some(Duration::from_millis(5)));
        // Sent at 1 s, answered at 9 s: long after the 5 ms hold, still the same wave.
        rpm.refused_attempt(at(9_000), at(1_000), Some(Duration::from_millis(5)));
        assert_eq!(rpm.snapshot(at(9_000)).limit, Some(540));
        rpm.refused_attempt(at(12_000), at(10_000), None);
        assert_eq!(rpm.snapshot(at(12_000)).limit, Some(486));
    }

    /// A booking made while the limit was unknown took nothing: settled after the limit is
    /// learned, only what was used is charged.
    #[test]
    fn a_booking_made_before_the_limit_was_known_refunds_nothing() {
        let tpm = RateLimit::new(RateConfig::default());
        let p = tpm.try_acquire(at(0), 800).unwrap();
        tpm.observe(at(0), Observed { limit: Some(1_000), remaining: Some(1_000) });
        p.settle(at(0), Some(300));
        assert_eq!(tpm.snapshot(at(0)).available, 700);
    }

    #[test]
    fn the_providers_remaining_is_the_truth_and_never_raised() {
        let tpm = per_minute(10_000);
        tpm.observe(at(0), Observed { limit: None, remaining: Some(1_000) });
        assert_eq!(tpm.snapshot(at(0)).available, 1_000);
        // A remaining above the local level does not raise it.
        tpm.observe(at(0), Observed { limit: None, remaining: Some(9_000) });
        assert_eq!(tpm.snapshot(at(0)).available, 1_000);
        // A lower stated limit caps the level; the refill is at the new rate.
        tpm.observe(at(0), Observed { limit: Some(600), remaining: None });
        assert_eq!(tpm.snapshot(at(0)).available, 600);
        assert_eq!(tpm.snapshot(at(0)).limit, Some(600));
    }

    #[test]
    fn an_unknown_limit_admits_until_learned() {
        let r = RateLimit::new(RateConfig::default());
        for _ in 0..10_000 {
            r.try_acquire(at(0), 1_000).unwrap().settle(at(0), None);
        }
        r.observe(at(0), Observed { limit: Some(60), remaining: Some(0) });
        assert_eq!(r.try_acquire(at(0), 1).unwrap_err().wait, Duration::from_secs(1));
        assert!(r.try_acquire(at(1_000), 1).is_ok());
    }

    #[test]
    fn a_429_holds_and_lowers_the_limit() {
        let r = per_minute(600);
        r.refused(at(0), Some(Duration::from_secs(2)));
        assert_eq!(r.try_acquire(at(1_000), 1).unwrap_err().wait, Duration::from_secs(1));
        let s = r.snapshot(at(0));
        assert_eq!(s.limit, Some(540));
        assert_eq!(s.held_until, Some(at(2_000)));
        // After the hold, the refill (at the lowered rate, 9/s) has made room.
        assert!(r.try_acquire(at(2_000), 1).is_ok());
    }

    #[test]
    fn a_debt_is_never_deeper_than_one_window() {
        let tpm = per_minute(1_000);
        tpm.try_acquire(at(0), 100).unwrap().settle(at(0), Some(u64::MAX));
        // Without the bound the level would be 2^64 tokens in debt: admission for ever.
        // With it, one window's refill pays it back.
        let wait = tpm.try_acquire(at(0), 1).unwrap_err().wait;
        assert!(wait <= Duration::from_secs(61), "{wait:?}");
        assert!(tpm.try_acquire(at(60_100), 1).is_ok());
    }

    #[test]
    fn settling_refunds_and_charges_to_what_was_counted() {
        let tpm = per_minute(1_000);
        let p = tpm.try_acquire(at(0), 800).unwrap();
        assert_eq!(tpm.snapshot(at(0)).available, 200);
        p.settle(at(0), Some(300)); // 500 back
        assert_eq!(tpm.snapshot(at(0)).available, 700);
        let p = tpm.try_acquire(at(0), 700).unwrap();
        p.settle(at(0), Some(1_000)); // 300 over: debt
        assert_eq!(tpm.snapshot(at(0)).available, 0);
        // The debt is paid by the refill before anything else is admitted: 300 units at
        // 1000/min is 18 s, and one more unit 60 ms.
        assert_eq!(tpm.try_acquire(at(0), 1).unwrap_err().wait, Duration::from_millis(18_060));
    }

    /// 10 000 requests, settled, dropped unsettled (an error, a timeout, an abandoned caller),
    /// or refused: every reservation is accounted for, and the level never exceeds the limit.
    #[test]
    fn reservations_balance_to_zero() {
        let tpm = per_minute(50_000);
        let mut rng = SplitMix64::new(3);
        let mut held = Vec::new();
        let mut now = Timestamp::ZERO;
        for _ in 0..10_000 {
            now = now.saturating_add(Duration::from_millis(rng.below(20)));
            let cost = 1 + rng.below(2_000);
            if let Ok(p) = tpm.try_acquire(now, cost) {
                held.push(p);
            }
            if rng.below(100) < 5 {
                tpm.refused(now, Some(Duration::from_millis(rng.below(500))));
            }
            while held.len() > 8 {
                let p = held.swap_remove(rng.below(held.len() as u64) as usize);
                match rng.below(3) {
                    0 => p.settle(now, Some(rng.below(3_000))),
                    1 => p.settle(now, None),
                    _ => drop(p),
                }
            }
            let s = tpm.snapshot(now);
            assert!(s.available <= s.limit.unwrap());
        }
        drop(held);
        assert_eq!(tpm.snapshot(now).outstanding, 0);
    }
}
