//! The shared limiter: one concurrency cap over every attempt to a dependency.
//!
//! A dependency that slows down is hurt most by the load it sees, not the load it was sent: if
//! primaries use one pool and retries another, or a timed-out attempt frees its slot while the
//! dependency keeps working on it, the dependency sees more than the cap that was planned. So a
//! slot belongs to an *attempt*, first try or retry, from admission until its response body ends
//! or is dropped, and `attempts in flight <= cap` holds at every instant:
//!
//! - **primaries** wait in a bounded FIFO queue ([`Limiter::acquire`]); a freed slot goes to the
//!   oldest waiting primary; a full queue or an expired wait is refused with [`Denied::Queue`];
//! - **retries never wait**: [`Limiter::try_acquire`] is refused with [`Denied::Cap`] when no slot
//!   is free or any primary is waiting;
//! - **a timed-out attempt keeps its slot** ([`Permit::hold`]) until the dependency answers or the
//!   hold passes, because the dependency is still working on it;
//! - **the dependency can lower the cap** ([`Limiter::set_limit_hint`]), never raise it above the
//!   configured one; a lower cap takes effect as permits return;
//! - **a fleet lease can lower it too** ([`Limiter::set_lease`]): the slots this instance holds
//!   of a cap shared by every instance (stormguard-redis), valid until a time, then a fallback
//!   share. Like the hint it never raises the cap and never revokes a permit.
//!
//! ```
//! use std::sync::Arc;
//! use std::time::Duration;
//! use stormguard_core::clock::ManualClock;
//! use stormguard_core::limiter::{AttemptKind, Limiter, LimiterConfig};
//! use stormguard_core::Denied;
//!
//! let clock = ManualClock::new();
//! let limiter = Limiter::try_new(LimiterConfig { cap: 1, ..Default::default() }, Arc::new(clock))?;
//! let first = limiter.try_acquire(AttemptKind::Primary)?;
//! assert_eq!(limiter.try_acquire(AttemptKind::Retry).unwrap_err(), Denied::Cap);
//! drop(first); // the slot comes back when the permit drops
//! assert!(limiter.try_acquire(AttemptKind::Retry).is_ok());
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! ## How it works
//! The fast path is one compare-exchange on a word that packs the attempts in flight (low half)
//! and the primaries queued (high half), so "a slot is free and nobody waits" is checked and
//! taken atomically. The queue, the handoff of a freed slot to the oldest waiter, and the slots
//! held after a timeout live behind a mutex that only the slow path takes. A table of `cap`
//! admission times (one entry per slot in use) gives the age of the oldest permit, so a leak is
//! visible as an age that climbs.
//!
//! Runtime-free: the [`Acquire`] future is woken by releases; it checks its queue timeout when
//! polled, so a runtime wrapper should also poll it at [`Acquire::deadline`] (the tower layer
//! does). [`Limiter::acquire_blocking`] parks the thread for users outside async code.

use crate::error::ConfigError;
use std::collections::VecDeque;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use crate::adaptive::{AdaptiveConfig, AdaptiveLimit, AdaptiveSnapshot};
use crate::clock::{Clock, Timestamp, duration_nanos};
use crate::denied::Denied;
use crate::histogram::{Histogram, HistogramSnapshot, LATENCY_BOUNDS_NANOS};
use crate::sync::{Arc, AtomicU64, Mutex, Ordering};

/// The largest cap and queue length: both are packed into half of a `u64`.
pub const MAX_CAP: u64 = 1 << 24;

/// Who reads the high-water mark. Each reader has its own: a reading returns the most attempts
/// in flight at once since *that* reader's previous reading, so a dashboard polling every 100 ms
/// does not hide the peak of a Prometheus scrape's interval.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Reader {
    /// The Prometheus exposition (`/metrics`, `metrics::register`).
    Metrics,
    /// JSON readers: the proxy's `/stats.json` and the dashboard that polls it.
    Json,
    /// Everything else: [`Limiter::snapshot`], the demo's sampler, tests.
    Local,
}

impl Reader {
    /// Every reader, in index order.
    pub const ALL: [Reader; 3] = [Reader::Metrics, Reader::Json, Reader::Local];

    fn index(self) -> usize {
        self as usize
    }
}

/// Whether an attempt is a first try or a retry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AttemptKind {
    /// The first attempt of a request.
    Primary,
    /// A retry: never waits for a slot.
    Retry,
}

/// Parameters of a [`Limiter`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LimiterConfig {
    /// Attempts in flight allowed at once, `1..=MAX_CAP`. Default 20.
    pub cap: u64,
    /// Primaries that may wait for a slot, `0..=MAX_CAP`; 0 fails fast. Default 100.
    pub queue_len: u64,
    /// The longest a primary waits for a slot. Default 1 s. It counts against the request's
    /// deadline, which the caller may make shorter (see [`Limiter::acquire_until`]).
    pub queue_timeout: Duration,
    /// An adaptive cap (`crate::adaptive`): the working cap starts at `cap` (clamped into
    /// `[min, max]`) and follows what the dependency can take, up to `max`. `None`: `cap` is
    /// fixed.
    pub adaptive: Option<AdaptiveConfig>,
}

impl Default for LimiterConfig {
    fn default() -> Self {
        use crate::defaults::{CAP, QUEUE_LEN, QUEUE_TIMEOUT};
        LimiterConfig {
            cap: CAP,
            queue_len: QUEUE_LEN,
            queue_timeout: QUEUE_TIMEOUT,
            adaptive: None,
        }
    }
}

impl LimiterConfig {
    /// Checks every rule, returning the first broken one.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.cap == 0 || self.cap > MAX_CAP {
            return Err(ConfigError::OutOfRange {
                key: "cap",
                min: "1".into(),
                max: MAX_CAP.to_string(),
                got: self.cap.to_string(),
            });
        }
        if self.queue_len > MAX_CAP {
            return Err(ConfigError::TooLarge {
                key: "queue_len",
                max: MAX_CAP.to_string(),
                got: self.queue_len.to_string(),
            });
        }
        if let Some(a) = &self.adaptive {
            a.validate(MAX_CAP)?;
        }
        Ok(())
    }

    /// The most attempts that may ever be in flight: the adaptive cap's ceiling, or the cap.
    pub fn ceiling(&self) -> u64 {
        self.adaptive.map_or(self.cap, |a| a.max)
    }
}

/// The shared limiter for one upstream. Cheap to clone; clones share the slots.
#[derive(Clone)]
pub struct Limiter {
    inner: Arc<Inner>,
}

impl fmt::Debug for Limiter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (in_flight, queued) = unpack(self.inner.state.load(Ordering::Relaxed));
        f.debug_struct("Limiter")
            .field("cap", &self.inner.config.cap)
            .field("in_flight", &in_flight)
            .field("queued", &queued)
            .finish()
    }
}

struct Inner {
    config: LimiterConfig,
    clock: std::sync::Arc<dyn Clock>,
    /// Attempts in flight (held slots included) in the low 32 bits, primaries queued in the
    /// high 32 bits.
    state: AtomicU64,
    /// The dependency's limit (0: none) and until when it holds, in nanoseconds.
    hint: AtomicU64,
    hint_until: AtomicU64,
    /// The fleet lease: at most `lease_slots` until `lease_until` (nanoseconds), then at most
    /// `lease_after`. `lease_slots == u64::MAX`: no lease.
    lease_slots: AtomicU64,
    lease_until: AtomicU64,
    lease_after: AtomicU64,
    /// The earliest end of a timed-out attempt's hold, or `u64::MAX`.
    earliest_hold: AtomicU64,
    /// Admission time + 1 of the permit using each slot; 0 when free.
    slots: Box<[AtomicU64]>,
    /// The adaptive cap, when configured.
    adaptive: Option<Box<AdaptiveLimit>>,
    slow: Mutex<Slow>,
    stats: Stats,
}

#[derive(Debug, Default)]
struct Slow {
    next_id: u64,
    /// Waiting primaries, oldest first.
    queue: VecDeque<Waiter>,
    /// Waiters handed a slot that have not yet polled to take it: (waiter id, slot index).
    granted: Vec<(u64, usize)>,
    /// Slots of timed-out attempts, held until the dependency answers or the hold passes.
    holds: Vec<Hold>,
}

#[derive(Debug)]
struct Waiter {
    id: u64,
    waker: Option<Waker>,
}

#[derive(Debug)]
struct Hold {
    id: u64,
    until: Timestamp,
    slot: usize,
}

#[derive(Debug)]
struct Stats {
    in_flight: Histogram,
    wait: Histogram,
    execution: Histogram,
    /// One high-water mark per [`Reader`], each reset only by its own reader.
    high_water: [AtomicU64; Reader::ALL.len()],
    /// Holds that passed before the dependency answered (the slot came back by time).
    holds_expired: AtomicU64,
    /// Retries holding a slot now (not held ones): so a concurrency budget can tell primaries
    /// from retries.
    retries: AtomicU64,
    refused_cap: AtomicU64,
    refused_queue_full: AtomicU64,
    refused_queue_timeout: AtomicU64,
}

const LOW: u64 = (1 << 32) - 1;
const QUEUED_ONE: u64 = 1 << 32;

fn pack(in_flight: u64, queued: u64) -> u64 {
    (queued << 32) | in_flight
}

fn unpack(s: u64) -> (u64, u64) {
    (s & LOW, s >> 32)
}

/// What a snapshot of the limiter shows.
#[derive(Debug, Clone, PartialEq)]
pub struct LimiterSnapshot {
    /// The configured cap (an adaptive cap's ceiling).
    pub cap: u64,
    /// The cap in force now (lowered by the dependency's limit hint, if any).
    pub effective_cap: u64,
    /// Attempts in flight now, held slots included.
    pub in_flight: u64,
    /// Primaries waiting for a slot.
    pub queued: u64,
    /// Slots held for timed-out attempts the dependency may still be working on.
    pub held: u64,
    /// The most attempts in flight at once since this reader's previous snapshot (exact; see
    /// [`Reader`]).
    pub high_water: u64,
    /// Holds (of timed-out or abandoned attempts) that passed before the dependency answered:
    /// each one's slot came back while the dependency may still have been working on it.
    pub holds_expired: u64,
    /// How long the oldest permit still in use has been held; `None` when none is.
    pub oldest_permit_age: Option<Duration>,
    /// In flight as seen by each admitted attempt (itself included): one bucket per integer.
    pub in_flight_histogram: HistogramSnapshot,
    /// Time from asking for a slot to getting it, per admitted attempt, in nanoseconds.
    pub wait_histogram: HistogramSnapshot,
    /// Time from admission to release (or to the timeout, for held slots), in nanoseconds.
    pub execution_histogram: HistogramSnapshot,
    /// Retries refused because no slot was free or a primary waited.
    pub refused_cap: u64,
    /// Primaries refused because the queue was full.
    pub refused_queue_full: u64,
    /// The adaptive cap's state, when there is one.
    pub adaptive: Option<AdaptiveSnapshot>,
    /// Primaries that waited past the queue timeout.
    pub refused_queue_timeout: u64,
}

impl Limiter {
    /// Builds a limiter reading time from `clock`, refusing invalid parameters.
    pub fn try_new(
        config: LimiterConfig,
        clock: std::sync::Arc<dyn Clock>,
    ) -> Result<Limiter, ConfigError> {
        config.validate()?;
        let started = clock.now();
        Ok(Limiter {
            inner: Arc::new(Inner {
                config,
                clock,
                state: AtomicU64::new(0),
                hint: AtomicU64::new(0),
                hint_until: AtomicU64::new(0),
                lease_slots: AtomicU64::new(u64::MAX),
                lease_until: AtomicU64::new(0),
                lease_after: AtomicU64::new(u64::MAX),
                earliest_hold: AtomicU64::new(u64::MAX),
                slots: (0..config.ceiling()).map(|_| AtomicU64::new(0)).collect(),
                adaptive: config
                    .adaptive
                    .map(|a| Box::new(AdaptiveLimit::new(a, config.cap, started))),
                slow: Mutex::new(Slow::default()),
                stats: Stats {
                    in_flight: Histogram::linear(config.ceiling()),
                    wait: Histogram::new(LATENCY_BOUNDS_NANOS.to_vec()),
                    execution: Histogram::new(LATENCY_BOUNDS_NANOS.to_vec()),
                    high_water: std::array::from_fn(|_| AtomicU64::new(0)),
                    holds_expired: AtomicU64::new(0),
                    retries: AtomicU64::new(0),
                    refused_cap: AtomicU64::new(0),
                    refused_queue_full: AtomicU64::new(0),
                    refused_queue_timeout: AtomicU64::new(0),
                },
            }),
        })
    }

    /// The parameters it was built with.
    pub fn config(&self) -> &LimiterConfig {
        &self.inner.config
    }

    /// The time on the limiter's clock.
    pub fn now(&self) -> Timestamp {
        self.inner.clock.now()
    }

    /// Takes a slot now or not at all: refused with [`Denied::Cap`] when no slot is free or any
    /// primary is waiting (a retry must not take the slot a waiting primary is owed). Primaries
    /// that must not wait use it too.
    pub fn try_acquire(&self, kind: AttemptKind) -> Result<Permit, Denied> {
        self.try_acquire_at(kind, self.inner.clock.now())
    }

    /// [`try_acquire`](Self::try_acquire) at `now`, for callers that already read the clock
    /// (`now` must come from the limiter's clock).
    #[inline(always)]
    pub fn try_acquire_at(&self, kind: AttemptKind, now: Timestamp) -> Result<Permit, Denied> {
        self.inner.reclaim_holds(now);
        match self.inner.try_take(now) {
            Some(taken) => Ok(Inner::admitted(&self.inner, taken, now, now, kind)),
            None => {
                self.inner.stats.refused_cap.fetch_add(1, Ordering::Relaxed);
                Err(Denied::Cap)
            }
        }
    }

    /// Waits in the FIFO queue for a slot, for at most the queue timeout.
    pub fn acquire(&self) -> Acquire {
        let now = self.inner.clock.now();
        self.acquire_until(now.saturating_add(self.inner.config.queue_timeout))
    }

    /// Waits in the FIFO queue for a slot until `deadline` or the queue timeout, whichever is
    /// first (the wait counts against the request's deadline).
    pub fn acquire_until(&self, deadline: Timestamp) -> Acquire {
        let now = self.inner.clock.now();
        let deadline = deadline.min(now.saturating_add(self.inner.config.queue_timeout));
        Acquire { inner: self.inner.clone(), state: AcquireState::Init, since: now, deadline }
    }

    /// Like [`acquire`](Self::acquire), parking the calling thread: for code outside async
    /// (a database pool, a blocking client).
    #[cfg(not(stormguard_loom))]
    pub fn acquire_blocking(&self) -> Result<Permit, Denied> {
        use std::task::Wake;
        struct Unpark(std::thread::Thread);
        impl Wake for Unpark {
            fn wake(self: std::sync::Arc<Self>) {
                self.0.unpark();
            }
        }
        let waker = Waker::from(std::sync::Arc::new(Unpark(std::thread::current())));
        let mut cx = Context::from_waker(&waker);
        let mut acquire = self.acquire();
        loop {
            if let Poll::Ready(r) = acquire.poll_acquire(&mut cx) {
                return r;
            }
            // Wake at the deadline, or earlier if a held slot or the limit hint expires.
            let now = self.inner.clock.now();
            let until = self.next_wakeup().map_or(acquire.deadline, |t| t.min(acquire.deadline));
            std::thread::park_timeout(until.saturating_since(now).max(Duration::from_micros(50)));
        }
    }

    /// Lowers the effective cap to `limit` (never above the configured cap, never below 1) for
    /// `ttl`: the dependency's own concurrency limit, e.g. from `X-Concurrency-Limit-Limit`.
    /// The last hint wins. A lower cap takes effect as permits return: none is revoked.
    pub fn set_limit_hint(&self, limit: u64, ttl: Duration) {
        let now = self.inner.clock.now();
        let limit = limit.clamp(1, self.inner.config.ceiling());
        // Written until-then-limit, read limit-then-until: a reader that sees the new limit
        // sees an expiry at least as new. A stale pair for an instant is harmless: the cap is a
        // bound the dependency asked for, not a safety invariant of ours.
        self.inner
            .hint_until
            .store(duration_nanos(ttl).saturating_add(now.as_nanos()), Ordering::Release);
        self.inner.hint.store(limit, Ordering::Release);
        // A higher hint may free room for waiters.
        self.inner.fill_from_queue(now);
    }

    /// Lowers the effective cap to `slots` until `until` (on the limiter's clock), and to `then`
    /// after it: the lease of a cap shared by a fleet (`slots` granted by the fleet, `then` the
    /// share to fall back on when no renewal came). Either may be 0 (admit nothing new); neither
    /// raises the cap above the configured one. The last lease wins, and a lower one takes
    /// effect as permits return: none is revoked.
    pub fn set_lease(&self, slots: u64, until: Timestamp, then: u64) {
        // Written after-until-slots, read slots-until-after (`lease_cap`): a reader that sees
        // the new slots sees their expiry. A reader mixing an old and a new lease for an instant
        // admits at most the larger of the two, which the fleet still counts as this
        // instance's (a renewal is recorded before it is applied here).
        self.inner.lease_after.store(then, Ordering::Release);
        self.inner.lease_until.store(until.as_nanos(), Ordering::Release);
        self.inner.lease_slots.store(slots.min(u64::MAX - 1), Ordering::Release);
        // A larger lease may free room for waiters.
        self.inner.fill_from_queue(self.inner.clock.now());
    }

    /// Removes the lease: the configured cap (and any limit hint) applies again.
    pub fn clear_lease(&self) {
        self.inner.lease_slots.store(u64::MAX, Ordering::Release);
        self.inner.fill_from_queue(self.inner.clock.now());
    }

    /// The cap in force now.
    pub fn effective_cap(&self) -> u64 {
        self.inner.effective_cap(self.inner.clock.now())
    }

    /// The adaptive cap's working cap now; `None` for a fixed cap.
    pub fn working_cap(&self) -> Option<u64> {
        self.inner.adaptive.as_ref().map(|a| a.limit())
    }

    /// The execution-time histogram alone (admission to release, nanoseconds): what a
    /// percentile-based hedge delay reads, without a whole snapshot.
    pub fn execution_histogram(&self) -> HistogramSnapshot {
        self.inner.stats.execution.snapshot()
    }

    /// Attempts in flight now (held slots included).
    pub fn in_flight(&self) -> u64 {
        unpack(self.inner.state.load(Ordering::Acquire)).0
    }

    /// Retries holding a slot now (timed-out ones whose slot is held are not counted).
    pub fn retries_in_flight(&self) -> u64 {
        self.inner.stats.retries.load(Ordering::Relaxed)
    }

    /// Primaries holding a slot (or a held slot) or waiting for one: the `n` a concurrency
    /// budget is sized from, before the retries it granted itself.
    pub fn primaries_active(&self) -> u64 {
        let (in_flight, queued) = unpack(self.inner.state.load(Ordering::Acquire));
        in_flight.saturating_sub(self.retries_in_flight()) + queued
    }

    /// Primaries waiting for a slot now.
    pub fn queued(&self) -> u64 {
        unpack(self.inner.state.load(Ordering::Acquire)).1
    }

    /// When something time-driven next changes (a held slot, the limit hint or a lease expires), so a
    /// runtime can wake waiters then.
    pub fn next_wakeup(&self) -> Option<Timestamp> {
        let hold = self.inner.earliest_hold.load(Ordering::Acquire);
        let hint_until = self.inner.hint_until.load(Ordering::Acquire);
        let lease_until = if self.inner.lease_slots.load(Ordering::Acquire) == u64::MAX {
            u64::MAX
        } else {
            self.inner.lease_until.load(Ordering::Acquire)
        };
        let now = self.inner.clock.now().as_nanos();
        [hold, hint_until, lease_until]
            .into_iter()
            .filter(|t| *t != u64::MAX && *t > now)
            .min()
            .map(Timestamp::from_nanos)
    }

    /// The limiter's state and signals, as [`Reader::Local`] reads them; resets that reader's
    /// high-water mark to the current in-flight.
    pub fn snapshot(&self) -> LimiterSnapshot {
        self.snapshot_for(Reader::Local)
    }

    /// The limiter's state and signals; resets `reader`'s high-water mark (only) to the current
    /// in-flight.
    pub fn snapshot_for(&self, reader: Reader) -> LimiterSnapshot {
        let inner = &self.inner;
        let now = inner.clock.now();
        inner.reclaim_holds(now);
        inner.fill_from_queue(now);
        let (in_flight, queued) = unpack(inner.state.load(Ordering::Acquire));
        let held = inner.slow.lock().holds.len() as u64;
        let high_water =
            inner.stats.high_water[reader.index()].swap(in_flight, Ordering::AcqRel).max(in_flight);
        let oldest = inner
            .slots
            .iter()
            .map(|s| s.load(Ordering::Acquire))
            .filter(|t| *t != 0)
            .min()
            .map(|t| now.saturating_since(Timestamp::from_nanos(t - 1)));
        let in_flight_histogram = inner.stats.in_flight.snapshot();
        LimiterSnapshot {
            cap: inner.config.ceiling(),
            adaptive: inner.adaptive.as_ref().map(|a| a.snapshot()),
            effective_cap: inner.effective_cap(now),
            in_flight,
            queued,
            held,
            high_water,
            holds_expired: inner.stats.holds_expired.load(Ordering::Relaxed),
            oldest_permit_age: oldest,
            wait_histogram: {
                let mut wait = inner.stats.wait.snapshot();
                wait.add_zeros(in_flight_histogram.count.saturating_sub(wait.count));
                wait
            },
            in_flight_histogram,
            execution_histogram: inner.stats.execution.snapshot(),
            refused_cap: inner.stats.refused_cap.load(Ordering::Relaxed),
            refused_queue_full: inner.stats.refused_queue_full.load(Ordering::Relaxed),
            refused_queue_timeout: inner.stats.refused_queue_timeout.load(Ordering::Relaxed),
        }
    }
}

impl Inner {
    #[inline]
    fn effective_cap(&self, now: Timestamp) -> u64 {
        let ceiling = match &self.adaptive {
            None => self.config.cap,
            Some(a) => a.limit(),
        };
        let hint = self.hint.load(Ordering::Acquire);
        let cap = if hint != 0 && now.as_nanos() < self.hint_until.load(Ordering::Acquire) {
            hint.min(ceiling)
        } else {
            ceiling
        };
        cap.min(self.lease_cap(now))
    }

    /// The dependency answered an attempt (`dropped`: refused it for overload), or it timed
    /// out (`dropped`): a sample for the adaptive cap, if there is one; a higher working cap
    /// may admit waiters.
    #[inline]
    fn adapt(&self, admitted_at: Timestamp, in_flight: u64, dropped: bool, now: Timestamp) {
        if let Some(a) = &self.adaptive
            && let Some(_) = a.sample(now, now.saturating_since(admitted_at), in_flight, dropped)
        {
            self.fill_from_queue(now);
        }
    }

    /// The fleet lease's ceiling now (`u64::MAX` without a lease): one load when there is none.
    #[inline]
    fn lease_cap(&self, now: Timestamp) -> u64 {
        let slots = self.lease_slots.load(Ordering::Acquire);
        if slots == u64::MAX {
            return u64::MAX;
        }
        if now.as_nanos() < self.lease_until.load(Ordering::Acquire) {
            slots
        } else {
            self.lease_after.load(Ordering::Acquire)
        }
    }

    /// The lock-free admission: one more in flight if a slot is free and nobody waits.
    /// Returns the claimed slot index.
    #[inline]
    fn try_take(&self, now: Timestamp) -> Option<(usize, u64)> {
        let cap = self.effective_cap(now);
        let mut s = self.state.load(Ordering::Acquire);
        loop {
            let (in_flight, queued) = unpack(s);
            if queued > 0 || in_flight >= cap {
                return None;
            }
            // AcqRel: the count and the queue length change together in this one word, so a
            // slot can't be taken past the cap, nor past a primary that just queued.
            match self.state.compare_exchange_weak(
                s,
                pack(in_flight + 1, queued),
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => return Some((self.claim_slot(in_flight as usize, now), in_flight + 1)),
                Err(actual) => s = actual,
            }
        }
    }

    /// Marks a free slot-table entry as used since `now`. The caller has already counted the
    /// attempt in `state`, and entries in use never outnumber the count minus one, so a free
    /// entry exists; racing claimers may move the search along.
    #[inline]
    fn claim_slot(&self, start: usize, now: Timestamp) -> usize {
        let n = self.slots.len();
        let stamp = now.as_nanos().saturating_add(1).max(1);
        // `start` is a count: below `n` for an admission (the count before it), `n` itself when
        // a full limiter hands a released slot to a waiter. No division on the common path.
        let mut i = if start < n { start } else { start % n };
        loop {
            // AcqRel pairs with the Release in `free_slot`.
            if self.slots[i].compare_exchange(0, stamp, Ordering::AcqRel, Ordering::Relaxed).is_ok()
            {
                return i;
            }
            i += 1;
            if i == n {
                i = 0;
            }
        }
    }

    #[inline]
    fn free_slot(&self, slot: usize) {
        self.slots[slot].store(0, Ordering::Release);
    }

    /// Records an admission and wraps it in a permit.
    /// `in_flight` is the count this attempt saw, itself included. (Inlined, as its callers
    /// are: made out of line, the permit is written to memory and read back at once.)
    #[inline(always)]
    fn admitted(
        this: &Arc<Self>,
        (slot, in_flight): (usize, u64),
        since: Timestamp,
        now: Timestamp,
        kind: AttemptKind,
    ) -> Permit {
        this.stats.in_flight.record(in_flight);
        // A load first: the read-modify-write only when this is a new high for that reader.
        for mark in &this.stats.high_water {
            if in_flight > mark.load(Ordering::Relaxed) {
                mark.fetch_max(in_flight, Ordering::AcqRel);
            }
        }
        // Waits of zero (every retry, every primary that found a slot free) are not recorded:
        // the snapshot derives them from the admissions, keeping the hot path short.
        let waited = now.nanos_since(since);
        if waited > 0 {
            this.stats.wait.record(waited);
        }
        if kind == AttemptKind::Retry {
            // Relaxed: a count read for a budget's estimate, not a synchronisation point.
            this.stats.retries.fetch_add(1, Ordering::Relaxed);
        }
        let in_flight = u32::try_from(in_flight).unwrap_or(u32::MAX);
        Permit {
            inner: Some(this.clone()),
            slot,
            admitted_at: now,
            kind,
            in_flight,
            dropped: false,
            sampled: false,
        }
    }

    /// Gives a slot back: to the oldest waiting primary if there is one and the cap allows,
    /// otherwise to the pool.
    #[inline]
    fn release(&self, slot: usize, now: Timestamp) {
        // Free the entry first, so entries in use stay below the count.
        self.free_slot(slot);
        let mut s = self.state.load(Ordering::Acquire);
        loop {
            let (in_flight, queued) = unpack(s);
            if queued == 0 || in_flight > self.effective_cap(now) {
                match self.state.compare_exchange_weak(
                    s,
                    pack(in_flight.saturating_sub(1), queued),
                    Ordering::AcqRel,
                    Ordering::Acquire,
                ) {
                    Ok(_) => return,
                    Err(actual) => {
                        s = actual;
                        continue;
                    }
                }
            }
            let mut slow = self.slow.lock();
            // Under the lock the queue can't change; re-check the count, which lock-free
            // releases above the cap may still lower.
            s = self.state.load(Ordering::Acquire);
            let (in_flight, queued) = unpack(s);
            if queued == 0 || in_flight > self.effective_cap(now) {
                continue;
            }
            // Hand the slot to the oldest waiter: the count stays, the queue shrinks by one.
            let waiter = slow.queue.pop_front().expect("queued > 0 means a waiter is in the queue");
            self.state.fetch_sub(QUEUED_ONE, Ordering::AcqRel);
            let slot = self.claim_slot(in_flight as usize, now);
            slow.granted.push((waiter.id, slot));
            drop(slow);
            if let Some(w) = waiter.waker {
                w.wake();
            }
            return;
        }
    }

    /// Admits waiting primaries while slots are free (after the cap rose or a hold expired).
    fn fill_from_queue(&self, now: Timestamp) {
        if unpack(self.state.load(Ordering::Acquire)).1 == 0 {
            return;
        }
        let mut wake = Vec::new();
        {
            let mut slow = self.slow.lock();
            loop {
                let s = self.state.load(Ordering::Acquire);
                let (in_flight, queued) = unpack(s);
                if queued == 0 || in_flight >= self.effective_cap(now) {
                    break;
                }
                if self
                    .state
                    .compare_exchange(
                        s,
                        pack(in_flight + 1, queued - 1),
                        Ordering::AcqRel,
                        Ordering::Acquire,
                    )
                    .is_err()
                {
                    continue;
                }
                let waiter =
                    slow.queue.pop_front().expect("queued > 0 means a waiter is in the queue");
                let slot = self.claim_slot(in_flight as usize, now);
                slow.granted.push((waiter.id, slot));
                wake.extend(waiter.waker);
            }
        }
        wake.into_iter().for_each(Waker::wake);
    }

    /// Releases the slots of timed-out attempts whose hold has passed.
    #[inline]
    fn reclaim_holds(&self, now: Timestamp) {
        // One load on the hot path; the lock only when a hold is due.
        if now.as_nanos() >= self.earliest_hold.load(Ordering::Acquire) {
            self.reclaim_due(now);
        }
    }

    /// [`reclaim_holds`](Self::reclaim_holds) once a hold is due (apart, so the check stays
    /// inline where a slot is taken).
    #[cold]
    #[inline(never)]
    fn reclaim_due(&self, now: Timestamp) {
        let due: Vec<usize> = {
            let mut slow = self.slow.lock();
            let mut due = Vec::new();
            slow.holds.retain(|h| {
                let keep = h.until > now;
                if !keep {
                    due.push(h.slot);
                }
                keep
            });
            let next = slow.holds.iter().map(|h| h.until.as_nanos()).min().unwrap_or(u64::MAX);
            self.earliest_hold.store(next, Ordering::Release);
            due
        };
        self.stats.holds_expired.fetch_add(due.len() as u64, Ordering::Relaxed);
        for slot in due {
            self.release(slot, now);
        }
    }
}

/// A slot, held until dropped. Move it into the response body so the slot lasts until the
/// body ends or is dropped.
#[must_use = "dropping the permit frees the slot at once"]
pub struct Permit {
    /// `None` once the slot moved elsewhere (a hold).
    inner: Option<Arc<Inner>>,
    slot: usize,
    admitted_at: Timestamp,
    kind: AttemptKind,
    /// In flight when it was admitted, itself included (for the adaptive cap).
    in_flight: u32,
    /// It timed out: a drop for the adaptive cap when it is held or released.
    dropped: bool,
    /// The adaptive cap has had its sample (at most one per attempt).
    sampled: bool,
}

impl fmt::Debug for Permit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Permit")
            .field("kind", &self.kind)
            .field("admitted_at", &self.admitted_at)
            .finish()
    }
}

impl Permit {
    /// Whether the attempt is a first try or a retry.
    pub fn kind(&self) -> AttemptKind {
        self.kind
    }

    /// When the slot was granted.
    pub fn admitted_at(&self) -> Timestamp {
        self.admitted_at
    }

    /// The attempt timed out on our side: an adaptive cap counts it as a drop when its slot
    /// is held or comes back (unless the answer was sampled already). No effect on a fixed
    /// cap.
    pub fn mark_dropped(&mut self) {
        self.dropped = true;
    }

    /// The dependency answered (its response's head arrived), now on the limiter's clock;
    /// `overload` when the answer says it is overloaded (429, 503, 529): the adaptive cap's
    /// sample of this attempt, its latency from admission to the answer (not to the body's
    /// end, which measures the body's length as much as the dependency). An attempt never
    /// answered and not timed out (a transport error, a caller that left) is no sample.
    #[inline]
    pub fn answered(&mut self, overload: bool) {
        if let Some(inner) = &self.inner
            && inner.adaptive.is_some()
        {
            let now = inner.clock.now();
            self.answered_at(now, overload);
        }
    }

    /// A timed-out attempt's drop sample, when its slot is held or comes back (unless its
    /// answer was sampled already).
    #[inline]
    fn timed_out_sample(&self, inner: &Inner, now: Timestamp) {
        if self.dropped && !self.sampled {
            inner.adapt(self.admitted_at, u64::from(self.in_flight), true, now);
        }
    }

    /// [`answered`](Self::answered) at `now` (from the limiter's clock).
    #[inline]
    pub fn answered_at(&mut self, now: Timestamp, overload: bool) {
        if self.sampled {
            return;
        }
        if let Some(inner) = &self.inner {
            self.sampled = true;
            inner.adapt(self.admitted_at, u64::from(self.in_flight), overload, now);
        }
    }

    /// The attempt timed out on our side, or its caller went away, but the dependency may still
    /// be working on it: keep its slot for up to `hold` (`timeout_slot_hold` or `abandon_hold`,
    /// 30 s by default: [`crate::defaults`]), or until [`HeldSlot::upstream_answered`].
    /// Dropping the [`HeldSlot`] keeps the hold.
    pub fn hold(mut self, hold: Duration) -> HeldSlot {
        let inner = self.inner.take().expect("a live permit has its limiter");
        retire(&inner, self.kind);
        let now = inner.clock.now();
        inner.stats.execution.record(now.nanos_since(self.admitted_at));
        // A timed-out attempt is a drop; one its caller abandoned says nothing of the
        // dependency (the layer above marks which).
        self.timed_out_sample(&inner, now);
        let until = now.saturating_add(hold);
        let id = {
            let mut slow = inner.slow.lock();
            slow.next_id += 1;
            let id = slow.next_id;
            slow.holds.push(Hold { id, until, slot: self.slot });
            inner.earliest_hold.fetch_min(until.as_nanos(), Ordering::AcqRel);
            id
        };
        HeldSlot { inner, id }
    }
}

impl Permit {
    /// Releases the slot at `now` (from the limiter's clock), recording the execution time:
    /// dropping the permit does the same after reading the clock itself.
    #[inline]
    pub fn release_at(mut self, now: Timestamp) {
        if let Some(inner) = self.inner.take() {
            self.give_back(&inner, now);
        }
    }

    /// The slot back at `now`, its execution time recorded (the limiter already taken out of
    /// the permit, so that dropping it does nothing more).
    #[inline]
    fn give_back(&self, inner: &Inner, now: Timestamp) {
        retire(inner, self.kind);
        inner.stats.execution.record(now.nanos_since(self.admitted_at));
        inner.release(self.slot, now);
        self.timed_out_sample(inner, now);
    }
}

impl Drop for Permit {
    #[inline]
    fn drop(&mut self) {
        if let Some(inner) = self.inner.take() {
            let now = inner.clock.now();
            self.give_back(&inner, now);
        }
    }
}

/// A retry's slot is given back (or moved into a hold): one retry fewer holds a slot.
#[inline]
fn retire(inner: &Inner, kind: AttemptKind) {
    if kind == AttemptKind::Retry {
        inner.stats.retries.fetch_sub(1, Ordering::Relaxed);
    }
}

/// The slot of a timed-out attempt, held until the dependency answers or the hold passes.
#[derive(Debug)]
pub struct HeldSlot {
    inner: Arc<Inner>,
    id: u64,
}

impl fmt::Debug for Inner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Limiter").field("cap", &self.config.cap).finish_non_exhaustive()
    }
}

impl HeldSlot {
    /// The dependency finished the attempt: release its slot now. Returns whether the slot was
    /// still held (`false`: the hold had passed and the slot had come back already).
    pub fn upstream_answered(self) -> bool {
        let now = self.inner.clock.now();
        let slot = {
            let mut slow = self.inner.slow.lock();
            let pos = slow.holds.iter().position(|h| h.id == self.id);
            pos.map(|p| slow.holds.swap_remove(p).slot)
        };
        // `None`: the hold already passed and the slot went back.
        match slot {
            Some(slot) => {
                self.inner.release(slot, now);
                true
            }
            None => false,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum AcquireState {
    Init,
    Queued(u64),
    Done,
}

/// Waiting for a slot in the FIFO queue. Resolves to a [`Permit`], or [`Denied::Queue`] when the
/// queue is full or the wait passed its deadline. Dropping it leaves the queue (and gives back a
/// slot it was handed but had not taken).
#[must_use = "a future does nothing unless polled"]
pub struct Acquire {
    inner: Arc<Inner>,
    state: AcquireState,
    since: Timestamp,
    deadline: Timestamp,
}

impl fmt::Debug for Acquire {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Acquire")
            .field("state", &self.state)
            .field("deadline", &self.deadline)
            .finish()
    }
}

impl Acquire {
    /// When the wait gives up. Poll again at this time (a runtime wrapper sets a timer).
    pub fn deadline(&self) -> Timestamp {
        self.deadline
    }

    /// The waker-based poll API: `Pending` registers `cx`'s waker to be woken when a slot is
    /// handed over.
    pub fn poll_acquire(&mut self, cx: &mut Context<'_>) -> Poll<Result<Permit, Denied>> {
        let inner = self.inner.clone();
        let now = inner.clock.now();
        inner.reclaim_holds(now);
        match self.state {
            AcquireState::Done => panic!("Acquire polled after it resolved"),
            AcquireState::Init => {
                if let Some(taken) = inner.try_take(now) {
                    self.state = AcquireState::Done;
                    return Poll::Ready(Ok(Inner::admitted(
                        &inner,
                        taken,
                        self.since,
                        now,
                        AttemptKind::Primary,
                    )));
                }
                inner.fill_from_queue(now);
                let mut slow = inner.slow.lock();
                loop {
                    let s = inner.state.load(Ordering::Acquire);
                    let (in_flight, queued) = unpack(s);
                    if queued == 0 && in_flight < inner.effective_cap(now) {
                        // A slot came free while we took the lock.
                        if inner
                            .state
                            .compare_exchange(
                                s,
                                pack(in_flight + 1, 0),
                                Ordering::AcqRel,
                                Ordering::Acquire,
                            )
                            .is_err()
                        {
                            continue;
                        }
                        drop(slow);
                        self.state = AcquireState::Done;
                        let slot = inner.claim_slot(in_flight as usize, now);
                        let taken = (slot, in_flight + 1);
                        return Poll::Ready(Ok(Inner::admitted(
                            &inner,
                            taken,
                            self.since,
                            now,
                            AttemptKind::Primary,
                        )));
                    }
                    if queued >= inner.config.queue_len || now >= self.deadline {
                        drop(slow);
                        self.state = AcquireState::Done;
                        let counter = if now >= self.deadline {
                            &inner.stats.refused_queue_timeout
                        } else {
                            &inner.stats.refused_queue_full
                        };
                        counter.fetch_add(1, Ordering::Relaxed);
                        return Poll::Ready(Err(Denied::Queue));
                    }
                    // The compare-exchange against the state we judged makes "no slot free" and
                    // "now queued" one step: a release after it sees the waiter and hands over.
                    if inner
                        .state
                        .compare_exchange(s, s + QUEUED_ONE, Ordering::AcqRel, Ordering::Acquire)
                        .is_err()
                    {
                        continue;
                    }
                    slow.next_id += 1;
                    let id = slow.next_id;
                    slow.queue.push_back(Waiter { id, waker: Some(cx.waker().clone()) });
                    self.state = AcquireState::Queued(id);
                    return Poll::Pending;
                }
            }
            AcquireState::Queued(id) => {
                inner.fill_from_queue(now);
                let mut slow = inner.slow.lock();
                if let Some(pos) = slow.granted.iter().position(|(g, _)| *g == id) {
                    let (_, slot) = slow.granted.swap_remove(pos);
                    drop(slow);
                    self.state = AcquireState::Done;
                    // Handed over: the count includes this attempt already.
                    let taken = (slot, unpack(inner.state.load(Ordering::Acquire)).0.max(1));
                    return Poll::Ready(Ok(Inner::admitted(
                        &inner,
                        taken,
                        self.since,
                        now,
                        AttemptKind::Primary,
                    )));
                }
                let pos = slow
                    .queue
                    .iter()
                    .position(|w| w.id == id)
                    .expect("a queued waiter is in the queue");
                if now >= self.deadline {
                    slow.queue.remove(pos);
                    inner.state.fetch_sub(QUEUED_ONE, Ordering::AcqRel);
                    drop(slow);
                    self.state = AcquireState::Done;
                    inner.stats.refused_queue_timeout.fetch_add(1, Ordering::Relaxed);
                    return Poll::Ready(Err(Denied::Queue));
                }
                let waiter = &mut slow.queue[pos];
                if !waiter.waker.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
                    waiter.waker = Some(cx.waker().clone());
                }
                Poll::Pending
            }
        }
    }
}

impl Future for Acquire {
    type Output = Result<Permit, Denied>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.get_mut().poll_acquire(cx)
    }
}

impl Drop for Acquire {
    fn drop(&mut self) {
        let AcquireState::Queued(id) = self.state else { return };
        let now = self.inner.clock.now();
        let mut slow = self.inner.slow.lock();
        if let Some(pos) = slow.queue.iter().position(|w| w.id == id) {
            slow.queue.remove(pos);
            self.inner.state.fetch_sub(QUEUED_ONE, Ordering::AcqRel);
            return;
        }
        // Handed a slot we will never use: pass it on.
        if let Some(pos) = slow.granted.iter().position(|(g, _)| *g == id) {
            let (_, slot) = slow.granted.swap_remove(pos);
            drop(slow);
            self.inner.release(slot, now);
        }
    }
}

#[cfg(all(test, not(stormguard_loom)))]
mod tests {
    use super::*;
    use crate::clock::ManualClock;
    use std::task::Wake;

    struct Flag(std::sync::atomic::AtomicBool);
    impl Wake for Flag {
        fn wake(self: std::sync::Arc<Self>) {
            self.0.store(true, std::sync::atomic::Ordering::SeqCst);
        }
    }

    fn flag() -> (std::sync::Arc<Flag>, Waker) {
        let f = std::sync::Arc::new(Flag(false.into()));
        (f.clone(), Waker::from(f))
    }

    fn limiter(cap: u64, queue_len: u64) -> (Limiter, ManualClock) {
        let clock = ManualClock::new();
        let l = Limiter::try_new(
            LimiterConfig {
                cap,
                queue_len,
                queue_timeout: Duration::from_millis(100),
                adaptive: None,
            },
            std::sync::Arc::new(clock.clone()),
        )
        .unwrap();
        (l, clock)
    }

    fn poll(a: &mut Acquire, w: &Waker) -> Poll<Result<Permit, Denied>> {
        a.poll_acquire(&mut Context::from_waker(w))
    }

    #[test]
    fn cap_holds_and_permits_return() {
        let (l, _) = limiter(3, 0);
        let held: Vec<_> = (0..3).map(|_| l.try_acquire(AttemptKind::Primary).unwrap()).collect();
        assert_eq!(l.try_acquire(AttemptKind::Retry).unwrap_err(), Denied::Cap);
        assert_eq!(l.in_flight(), 3);
        drop(held);
        assert_eq!(l.in_flight(), 0);
        assert_eq!(l.snapshot().refused_cap, 1);
    }

    #[test]
    fn freed_slot_goes_to_the_oldest_waiter_not_a_retry() {
        let (l, _) = limiter(1, 10);
        let p = l.try_acquire(AttemptKind::Primary).unwrap();
        let (f1, w1) = flag();
        let (_f2, w2) = flag();
        let mut a1 = l.acquire();
        let mut a2 = l.acquire();
        assert!(poll(&mut a1, &w1).is_pending());
        assert!(poll(&mut a2, &w2).is_pending());
        assert_eq!(l.queued(), 2);
        // A retry may not jump a waiting primary.
        assert_eq!(l.try_acquire(AttemptKind::Retry).unwrap_err(), Denied::Cap);
        drop(p);
        assert!(f1.0.load(std::sync::atomic::Ordering::SeqCst), "the oldest waiter is woken");
        assert_eq!(l.in_flight(), 1, "the slot was handed over, not freed");
        assert!(poll(&mut a2, &w2).is_pending(), "the younger waiter still waits");
        let p1 = match poll(&mut a1, &w1) {
            Poll::Ready(Ok(p)) => p,
            other => panic!("{other:?}"),
        };
        assert_eq!(l.queued(), 1);
        drop(p1);
        assert!(matches!(poll(&mut a2, &w2), Poll::Ready(Ok(_))));
        assert_eq!(l.in_flight(), 0);
    }

    #[test]
    fn full_queue_and_timeout_refuse_with_queue() {
        let (l, clock) = limiter(1, 1);
        let _p = l.try_acquire(AttemptKind::Primary).unwrap();
        let (_f, w) = flag();
        let mut a1 = l.acquire();
        assert!(poll(&mut a1, &w).is_pending());
        let mut a2 = l.acquire();
        assert_eq!(poll(&mut a2, &w).map(|r| r.unwrap_err()), Poll::Ready(Denied::Queue));
        clock.advance(Duration::from_millis(100));
        assert_eq!(poll(&mut a1, &w).map(|r| r.unwrap_err()), Poll::Ready(Denied::Queue));
        assert_eq!(l.queued(), 0);
        let s = l.snapshot();
        assert_eq!((s.refused_queue_full, s.refused_queue_timeout), (1, 1));
    }

    #[test]
    fn fail_fast_with_no_queue() {
        let (l, _) = limiter(1, 0);
        let _p = l.try_acquire(AttemptKind::Primary).unwrap();
        let (_f, w) = flag();
        assert!(matches!(poll(&mut l.acquire(), &w), Poll::Ready(Err(Denied::Queue))));
    }

    #[test]
    fn dropped_waiter_leaves_and_a_granted_slot_passes_on() {
        let (l, _) = limiter(1, 10);
        let p = l.try_acquire(AttemptKind::Primary).unwrap();
        let (_f, w) = flag();
        let mut a1 = l.acquire();
        let mut a2 = l.acquire();
        assert!(poll(&mut a1, &w).is_pending());
        assert!(poll(&mut a2, &w).is_pending());
        drop(p); // handed to a1
        drop(a1); // a1 never takes it: it goes to a2
        assert!(matches!(poll(&mut a2, &w), Poll::Ready(Ok(_))));
        let mut a3 = l.acquire();
        assert!(poll(&mut a3, &w).is_ready());
        drop(a3);
        assert_eq!((l.in_flight(), l.queued()), (0, 0));
    }

    #[test]
    fn timed_out_attempt_keeps_its_slot_until_the_hold_passes() {
        let (l, clock) = limiter(2, 0);
        let a = l.try_acquire(AttemptKind::Primary).unwrap();
        let _b = l.try_acquire(AttemptKind::Primary).unwrap();
        let held = a.hold(Duration::from_millis(300));
        assert_eq!(l.try_acquire(AttemptKind::Retry).unwrap_err(), Denied::Cap);
        assert_eq!(l.next_wakeup(), Some(Timestamp::from_millis(300)));
        clock.advance(Duration::from_millis(299));
        assert_eq!(l.try_acquire(AttemptKind::Retry).unwrap_err(), Denied::Cap);
        assert_eq!(l.snapshot().held, 1);
        clock.advance(Duration::from_millis(1));
        let r = l.try_acquire(AttemptKind::Retry).unwrap();
        assert_eq!(l.snapshot().holds_expired, 1, "the hold passed before the answer");
        assert!(!held.upstream_answered(), "an answer after the hold passed frees nothing");
        drop(r);
        assert_eq!(l.in_flight(), 1);
    }

    #[test]
    fn the_unprotected_path_overshoots() {
        // Freeing a timed-out attempt's slot at once (what a proxy that forgets the dependency
        // is still working does) lets a new attempt in while the old one still runs.
        let (l, _) = limiter(1, 0);
        let mut at_dependency = 0u32;
        let a = l.try_acquire(AttemptKind::Primary).unwrap();
        at_dependency += 1;
        drop(a); // timed out and forgotten; the dependency still works on it
        if l.try_acquire(AttemptKind::Retry).is_ok() {
            at_dependency += 1;
        }
        assert_eq!(at_dependency, 2, "without the hold the dependency sees twice the cap");
        // With the hold it does not.
        let (l, _) = limiter(1, 0);
        let _held = l.try_acquire(AttemptKind::Primary).unwrap().hold(Duration::from_secs(1));
        assert!(l.try_acquire(AttemptKind::Retry).is_err());
    }

    #[test]
    fn upstream_answer_releases_a_hold_early() {
        let (l, _) = limiter(1, 0);
        let held = l.try_acquire(AttemptKind::Primary).unwrap().hold(Duration::from_secs(10));
        assert!(held.upstream_answered());
        assert!(l.try_acquire(AttemptKind::Retry).is_ok());
        assert_eq!(l.snapshot().holds_expired, 0);
    }

    #[test]
    fn a_hold_that_passes_wakes_a_waiter_on_the_next_poll() {
        let (l, clock) = limiter(1, 10);
        let _held = l.try_acquire(AttemptKind::Primary).unwrap().hold(Duration::from_millis(50));
        let (_f, w) = flag();
        let mut a = l.acquire();
        assert!(poll(&mut a, &w).is_pending());
        clock.advance(Duration::from_millis(50));
        assert!(matches!(poll(&mut a, &w), Poll::Ready(Ok(_))));
    }

    #[test]
    fn limit_hint_lowers_the_cap_as_permits_return() {
        let (l, clock) = limiter(4, 0);
        let held: Vec<_> = (0..4).map(|_| l.try_acquire(AttemptKind::Primary).unwrap()).collect();
        l.set_limit_hint(2, Duration::from_secs(5));
        assert_eq!(l.effective_cap(), 2);
        assert_eq!(l.in_flight(), 4, "no permit is revoked");
        let mut held = held.into_iter();
        drop(held.next());
        drop(held.next());
        assert_eq!(l.try_acquire(AttemptKind::Retry).unwrap_err(), Denied::Cap);
        drop(held.next());
        let _p = l.try_acquire(AttemptKind::Retry).unwrap();
        l.set_limit_hint(100, Duration::from_secs(5));
        assert_eq!(l.effective_cap(), 4, "never above the configured cap");
        l.set_limit_hint(0, Duration::from_secs(5));
        assert_eq!(l.effective_cap(), 1, "never below 1");
        clock.advance(Duration::from_secs(5));
        assert_eq!(l.effective_cap(), 4, "the hint expires");
    }

    #[test]
    fn lease_lowers_the_cap_until_it_expires_then_falls_back() {
        let (l, clock) = limiter(10, 0);
        let held: Vec<_> = (0..5).map(|_| l.try_acquire(AttemptKind::Primary).unwrap()).collect();
        l.set_lease(2, Timestamp::from_millis(1_000), 4);
        assert_eq!(l.effective_cap(), 2);
        assert_eq!(l.in_flight(), 5, "no permit is revoked");
        assert_eq!(l.next_wakeup(), Some(Timestamp::from_millis(1_000)));
        let mut held = held.into_iter();
        for _ in 0..3 {
            drop(held.next());
        }
        assert_eq!(l.try_acquire(AttemptKind::Retry).unwrap_err(), Denied::Cap, "2 of 2 in use");
        // The lease passes without a renewal: the fallback share applies.
        clock.advance(Duration::from_millis(1_000));
        assert_eq!(l.effective_cap(), 4);
        let a = l.try_acquire(AttemptKind::Retry).unwrap();
        let b = l.try_acquire(AttemptKind::Retry).unwrap();
        assert_eq!(l.try_acquire(AttemptKind::Retry).unwrap_err(), Denied::Cap);
        // A lease of 0 admits nothing new; one above the cap never raises it.
        l.set_lease(0, Timestamp::from_millis(2_000), 0);
        drop((a, b));
        assert_eq!(l.try_acquire(AttemptKind::Primary).unwrap_err(), Denied::Cap);
        l.set_lease(1_000, Timestamp::from_millis(2_000), 0);
        assert_eq!(l.effective_cap(), 10);
        l.clear_lease();
        assert_eq!(l.effective_cap(), 10);
        assert_eq!(l.next_wakeup(), None);
        drop(held);
    }

    #[test]
    fn a_larger_lease_admits_waiting_primaries() {
        let (l, clock) = limiter(4, 10);
        l.set_lease(0, Timestamp::from_millis(500), 0);
        let (f, w) = flag();
        let mut a = l.acquire();
        assert!(poll(&mut a, &w).is_pending(), "no slot leased: the primary waits");
        l.set_lease(1, Timestamp::from_millis(500), 0);
        assert!(f.0.load(std::sync::atomic::Ordering::SeqCst), "the waiter is woken");
        let p = match poll(&mut a, &w) {
            Poll::Ready(Ok(p)) => p,
            other => panic!("{other:?}"),
        };
        // With the limit hint too, the lower of the two holds.
        l.set_limit_hint(3, Duration::from_secs(5));
        l.set_lease(4, Timestamp::from_millis(500), 0);
        assert_eq!(l.effective_cap(), 3);
        clock.advance(Duration::from_millis(500));
        assert_eq!(l.effective_cap(), 0, "expired lease, fallback share 0");
        drop(p);
    }

    #[test]
    fn signals() {
        let (l, clock) = limiter(3, 10);
        let a = l.try_acquire(AttemptKind::Primary).unwrap();
        let b = l.try_acquire(AttemptKind::Primary).unwrap();
        clock.advance(Duration::from_millis(20));
        drop(b);
        let s = l.snapshot();
        assert_eq!(s.high_water, 2);
        assert_eq!(s.in_flight_histogram.counts[..4], [0, 1, 1, 0]);
        assert_eq!(s.oldest_permit_age, Some(Duration::from_millis(20)));
        assert_eq!(s.execution_histogram.count, 1);
        assert_eq!(s.execution_histogram.count_at_or_below(10_000_000), 0);
        assert_eq!(s.wait_histogram.count_at_or_below(1_000_000), 2);
        assert_eq!(l.snapshot().high_water, 1, "the high-water mark resets to the current count");
        drop(a);
        assert_eq!(l.snapshot().oldest_permit_age, None);
    }

    #[test]
    fn each_reader_keeps_its_own_high_water_mark() {
        let (l, _) = limiter(5, 10);
        let peak: Vec<_> = (0..4).map(|_| l.try_acquire(AttemptKind::Primary).unwrap()).collect();
        drop(peak);
        let _one = l.try_acquire(AttemptKind::Primary).unwrap();
        // A JSON reader polling often resets only its own mark...
        for _ in 0..10 {
            assert!(l.snapshot_for(Reader::Json).high_water <= 4);
        }
        assert_eq!(l.snapshot_for(Reader::Json).high_water, 1);
        // ...so the scrape still sees the interval's peak, then its own reset.
        assert_eq!(l.snapshot_for(Reader::Metrics).high_water, 4);
        assert_eq!(l.snapshot_for(Reader::Metrics).high_water, 1);
        assert_eq!(l.snapshot().high_water, 4, "the local reader had not read yet");
    }

    #[test]
    fn blocking_acquire_waits_for_a_release() {
        let l = Limiter::try_new(
            LimiterConfig {
                cap: 1,
                queue_len: 4,
                queue_timeout: Duration::from_secs(10),
                adaptive: None,
            },
            std::sync::Arc::new(crate::clock::MonotonicClock::new()),
        )
        .unwrap();
        let p = l.try_acquire(AttemptKind::Primary).unwrap();
        let l2 = l.clone();
        let t = std::thread::spawn(move || l2.acquire_blocking().map(|p| p.kind()));
        while l.queued() == 0 {
            std::thread::yield_now();
        }
        drop(p);
        assert_eq!(t.join().unwrap(), Ok(AttemptKind::Primary));
    }

    #[test]
    fn retries_and_primaries_are_told_apart() {
        let (l, _) = limiter(4, 4);
        let p = l.try_acquire(AttemptKind::Primary).unwrap();
        let r1 = l.try_acquire(AttemptKind::Retry).unwrap();
        let r2 = l.try_acquire(AttemptKind::Retry).unwrap();
        assert_eq!((l.retries_in_flight(), l.primaries_active()), (2, 1));
        drop(r1);
        let held = r2.hold(Duration::from_secs(1));
        assert_eq!((l.retries_in_flight(), l.primaries_active()), (0, 2), "a held slot is busy");
        held.upstream_answered();
        p.release_at(l.now());
        assert_eq!((l.retries_in_flight(), l.primaries_active()), (0, 0));
    }

    #[test]
    fn refuses_bad_parameters() {
        let c = std::sync::Arc::new(ManualClock::new());
        assert!(
            Limiter::try_new(LimiterConfig { cap: 0, ..Default::default() }, c.clone()).is_err()
        );
        assert!(
            Limiter::try_new(LimiterConfig { queue_len: MAX_CAP + 1, ..Default::default() }, c)
                .is_err()
        );
    }
}
