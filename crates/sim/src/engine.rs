//! The discrete-event engine: one policy, one run, on a virtual clock.
//!
//! Events sit in a binary heap keyed by (virtual time, rank, sequence number): the sequence
//! number makes the order of simultaneous events the order they were scheduled in, so a run is
//! deterministic; the rank lets a server's answer win over a per-try timeout at the same
//! nanosecond ("an answer at the deadline counts", as tokio's timeout and the tower layer do).
//!
//! The client side runs stormguard-core's own code: the limiter (its FIFO queue through the
//! [`Acquire`] future, polled with a waker that records which request to poll again), the
//! breaker, and for budgeted policies [`RetryPolicy::decide`] and [`RetryPolicy::admit`] — the
//! same calls, in the same order, as `stormguard-tower`. Only the naive policies (no retries,
//! retry N times) are written here, because they are what stormguard replaces.
//!
//! The dependency knows nothing of clients: `capacity` servers, a FIFO queue (bounded or not),
//! an outcome drawn when an attempt arrives and a service time drawn when it starts, and, for
//! a model provider, requests and tokens per minute counted at its door (the `rate` module,
//! which also keeps the client's rate admission: here only what waits and what is refused,
//! and when a booking is settled or refunded). A client
//! that times out does not take its attempt back: the server still serves it, which is how
//! a storm feeds itself.
//!
//! State is kept only for what is in flight (slabs of actions, requests and attempts, reused as
//! they finish) plus fixed aggregates, so memory follows concurrency, not run length.
//!
//! This file is one engine on purpose (about 1 200 lines of code, above the project's ~800): the
//! event loop, the client's and the dependency's handlers and the aggregates share one state and
//! one clock, and split apart they would pass that state through every call. What is not the
//! loop lives beside it: the scenario (`scenario/`), the distributions (`dist`), the rate
//! limits (`rate`), the report.

use std::cmp::{Ordering, Reverse};
use std::collections::{BinaryHeap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering as AtomicOrdering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Wake, Waker};
use std::time::Duration;

use stormguard_core::backoff::{Backoff, Pushback, PushbackHold};
use stormguard_core::breaker::{AttemptResult, Breaker, BreakerPermit, BreakerState};
use stormguard_core::budget::{BudgetSpec, FailureKind, RetryBudget};
use stormguard_core::clock::{Clock, ManualClock, Timestamp};
use stormguard_core::conditions::{AttemptFailure, RetryOn};
use stormguard_core::decision::{FailedAttempt, RequestFacts, RetryPolicy, Upstream};
use stormguard_core::denied::Denied;
use stormguard_core::hedge::HedgeDelay;
use stormguard_core::life::{AttemptId, Gates, Life, Next as LifeNext};
use stormguard_core::limiter::{Acquire, AttemptKind, HeldSlot, Limiter, LimiterConfig, Permit};
use stormguard_core::random::{RandomSource, SplitMix64};
use stormguard_core::rate::RatePermit;
use stormguard_core::scope::{FanOutScope, Scope};

use crate::dist::{self, ServiceTime, Stream, mix, nanos};
use crate::rate::{self, Booking, CallTokens, Meter, Provider};
use crate::scenario::{
    Arrivals, HedgeConfig, HeldSlotRelease, Load, PolicyConfig, RetryRule, Scenario, Share,
};
use crate::script::{Answer, Event as ScriptEvent, Line, ScriptedRequest};
use crate::stats::{RunStats, Sent};

/// Waits shorter than this are taken at once, in the same event (a `backoff = "none"` budget
/// policy still needs a non-zero backoff to pass `BackoffConfig::validate`).
const IMMEDIATE: Duration = Duration::from_micros(1);

/// A salt that separates an attempt's service-time draws from its outcome draw.
const SERVICE_SALT: u64 = 0x5e41_11ce_7135_0000;

/// A salt that separates a request's idempotency draw from its attempts' draws.
const IDEMPOTENCY_SALT: u64 = 0x1de0_9071_e4c7_0000;

/// A handle to a slab entry; the generation makes a stale event's handle miss.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Ref {
    idx: u32,
    generation: u32,
}

/// A vector of reusable entries: what is in flight, and nothing that has finished.
#[derive(Debug)]
struct Slab<T> {
    slots: Vec<(u32, Option<T>)>,
    free: Vec<u32>,
}

impl<T> Slab<T> {
    fn new() -> Slab<T> {
        Slab { slots: Vec::new(), free: Vec::new() }
    }

    #[inline]
    fn insert(&mut self, v: T) -> Ref {
        match self.free.pop() {
            Some(idx) => {
                let slot = &mut self.slots[idx as usize];
                slot.1 = Some(v);
                Ref { idx, generation: slot.0 }
            }
            None => {
                self.slots.push((0, Some(v)));
                Ref { idx: (self.slots.len() - 1) as u32, generation: 0 }
            }
        }
    }

    #[inline]
    fn get(&self, r: Ref) -> Option<&T> {
        match self.slots.get(r.idx as usize) {
            Some((g, Some(v))) if *g == r.generation => Some(v),
            _ => None,
        }
    }

    #[inline]
    fn get_mut(&mut self, r: Ref) -> Option<&mut T> {
        match self.slots.get_mut(r.idx as usize) {
            Some((g, Some(v))) if *g == r.generation => Some(v),
            _ => None,
        }
    }

    #[inline]
    fn remove(&mut self, r: Ref) -> Option<T> {
        let slot = self.slots.get_mut(r.idx as usize)?;
        if slot.0 != r.generation || slot.1.is_none() {
            return None;
        }
        slot.0 = slot.0.wrapping_add(1);
        self.free.push(r.idx);
        slot.1.take()
    }

    fn capacity(&self) -> usize {
        self.slots.len()
    }
}

#[derive(Debug, Clone, Copy)]
enum Ev {
    /// The next open-loop action of an instance.
    Arrival(u32),
    /// A closed-loop worker of an instance starts its next action.
    Start(u32),
    /// A server finished an attempt.
    Done(Ref),
    /// The dependency's queue was full: a 503 at once.
    Reject(Ref),
    /// The provider's requests or tokens per minute were used up: its 429 reaches the client.
    Limited(Ref),
    /// A first try's wait for its turn under the client's rate admission ended.
    RateDue(Ref),
    /// A first try that queued for its slot has waited out a hold that began meanwhile.
    HoldDue(Ref),
    /// An attempt's per-try timeout.
    Timeout(Ref),
    /// A request's backoff ended.
    RetryDue(Ref),
    /// The caller's own retry of a failed request is due (`client.own_retries`).
    CallerRetry(Ref),
    /// The oldest queued primary of a unit reaches the end of its wait.
    QueueDeadline(u32),
    /// A timed-out attempt's held slot comes back: let a waiting primary have it.
    LimiterWake(u32),
    /// An attempt's hedge delay has passed: hedge it if it is still unanswered.
    HedgeDue(Ref),
    /// The timeline enters a segment.
    Segment(u32),
}

/// A scheduled event. `order` is the rank in its top bit (0 for a server's answer, which wins
/// ties) over the sequence number.
#[derive(Debug)]
struct Entry {
    at: u64,
    order: u64,
    ev: Ev,
}

const RANK_BIT: u64 = 1 << 63;

impl PartialEq for Entry {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for Entry {}
impl PartialOrd for Entry {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Entry {
    // Reversed: `BinaryHeap` is a max-heap and the earliest event must come out first.
    fn cmp(&self, other: &Self) -> Ordering {
        (other.at, other.order).cmp(&(self.at, self.order))
    }
}

/// Where the limiter's wakers leave the requests whose queued primary may now have a slot.
#[derive(Debug, Default)]
struct WakeSink {
    pending: AtomicBool,
    calls: Mutex<Vec<Ref>>,
}

#[derive(Debug)]
struct CallWaker {
    sink: Arc<WakeSink>,
    call: Ref,
}

impl Wake for CallWaker {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }
    fn wake_by_ref(self: &Arc<Self>) {
        self.sink.calls.lock().expect("the simulator is single-threaded").push(self.call);
        self.sink.pending.store(true, AtomicOrdering::Relaxed);
    }
}

/// The longest an overloaded dependency's `workers` stretch a service time (virtual ns): 60 s,
/// chaos's default `latency_max`.
const STRETCH_MAX: u64 = 60_000_000_000;

/// The conditions of one timeline segment, ready for drawing.
#[derive(Debug, Clone, Copy)]
struct Seg {
    start: u64,
    capacity: u32,
    workers: Option<u32>,
    error_threshold: u64,
    service: ServiceTime,
    error_time: Option<ServiceTime>,
}

/// What one instance (or the whole fleet, when shared) holds of a policy.
#[derive(Debug)]
struct Unit {
    /// The cap (with the breaker and the pushback hold), if the policy has one.
    upstream: Option<Upstream>,
    /// Rate admission's meter of the provider's requests and tokens per minute, if the policy
    /// has it.
    rate: Option<Meter>,
    /// A separate retry pool, if the policy has one (sharing the breaker and the hold).
    retry_upstream: Option<Upstream>,
    breaker: Option<Breaker>,
    policy: Option<RetryPolicy>,
    /// The concurrency budget needs `set_active`: primaries holding or waiting for a slot.
    counts_active: bool,
    active_primaries: u64,
    /// Requests whose primary waits in the limiter's queue (oldest first; stale ones are
    /// skipped and dropped from the front).
    waiters: VecDeque<Ref>,
    /// A `QueueDeadline` event is pending. Waits end in the order they began (a primary waits
    /// until `min(start + queue_timeout, start + deadline)`), so one timer per unit, at the
    /// oldest waiter's end, is enough.
    queue_timer: bool,
    /// A naive hedger's percentile `hedge_after`, read from the cap's histogram as a budget
    /// policy's is (its `RetryPolicy` keeps its own).
    hedge_delay: HedgeDelay,
}

#[derive(Debug)]
struct Action {
    start: u64,
    remaining: u32,
    failed: bool,
    instance: u32,
    scope: Option<Scope>,
    place: (u32, u32),
}

#[derive(Debug)]
struct Call {
    action: Ref,
    key: u64,
    deadline: u64,
    unit: u32,
    /// Attempts sent.
    tries: u32,
    /// Naive policies: retries sent, and the last wait (decorrelated jitter grows from it).
    retries: u32,
    last_wait: Option<Duration>,
    /// What only retried, queued, rate-admitted or hedged requests need, boxed so the common
    /// request stays small.
    rare: Option<Box<Rare>>,
    /// Counted in its unit's `active_primaries`.
    primary_active: bool,
    /// Attempts sent and not yet answered, timed out or abandoned (more than one only while
    /// hedged).
    live: u8,
    /// Hedges sent.
    hedges: u8,
    /// Not a POST-like request (`client.non_idempotent`).
    idempotent: bool,
    /// The caller's own retries of this request before this one (`client.own_retries`).
    own: u8,
}

#[derive(Debug, Default)]
struct Rare {
    /// A budget policy's request life, from its first failure, hedge or caller's retry on.
    life: Option<Life>,
    acquire: Option<(Acquire, Waker)>,
    /// A first try waiting for its turn under rate admission gives up past this (virtual ns).
    rate_give_up: u64,
    /// Rate admission's booking for the attempt about to be sent. Still here when the request
    /// ends, the attempt never reached the provider, and it is refunded.
    booking: Option<Booking>,
    /// The slot of a first try that queued for it, held while a hold that began meanwhile is
    /// waited out.
    held_slot: Option<Permit>,
    /// The attempts in flight together once a hedge was sent: the first successful answer
    /// abandons the others.
    hedged: Vec<Ref>,
}

impl Call {
    /// What the retry rules need to know of the request: every request in the model is
    /// replayable and arrives unmarked.
    fn facts(&self) -> RequestFacts {
        RequestFacts {
            idempotent: self.idempotent,
            replayable: true,
            stacked: false,
            deadline: Some(Timestamp::from_nanos(self.deadline)),
        }
    }

    fn rare(&mut self) -> &mut Rare {
        self.rare.get_or_insert_with(Box::default)
    }

    fn queued(&self) -> bool {
        self.rare.as_ref().is_some_and(|r| r.acquire.is_some())
    }
}

/// A budget policy's unit as a request's life reads it ([`Gates`]): its policy, the pool its
/// retries and hedges take slots from (a separate retry pool, or the cap), and rate
/// admission's meter, where they book their turn now or never.
struct UnitGates<'u> {
    unit: &'u Unit,
    /// The tokens a call may use at most (what a booking holds).
    most: u64,
}

impl Gates for UnitGates<'_> {
    type Booking = Booking;

    fn policy(&self) -> &RetryPolicy {
        self.unit.policy.as_ref().expect("a budget policy has a RetryPolicy")
    }

    fn upstream(&self, _: usize) -> &Upstream {
        self.unit
            .retry_upstream
            .as_ref()
            .or(self.unit.upstream.as_ref())
            .expect("a budget has a cap")
    }

    fn book_now(&self, _: usize, now: Timestamp) -> Result<Option<Booking>, Denied> {
        match &self.unit.rate {
            None => Ok(None),
            Some(meter) => meter
                .book(now, self.most, Duration::ZERO)
                .map(|(b, _)| Some(b))
                .map_err(|_| Denied::Rate),
        }
    }

    fn refund(&self, booking: Booking, now: Timestamp) {
        booking.refund(now);
    }
}

/// A call's life, made at its first need (a failure, a hedge).
fn life_of<'c>(c: &'c mut Call, actions: &Slab<Action>) -> &'c mut Life {
    let (facts, action) = (c.facts(), c.action);
    c.rare().life.get_or_insert_with(|| Life::new(facts, scopes_of(actions, action).to_vec(), 0))
}

/// The scopes an action's retries and hedges are charged to.
fn scopes_of(actions: &Slab<Action>, action: Ref) -> &[Scope] {
    match actions.get(action).and_then(|a| a.scope.as_ref()) {
        Some(s) => std::slice::from_ref(s),
        None => &[],
    }
}

#[derive(Debug)]
struct Attempt {
    call: Ref,
    key: u64,
    kind: Sent,
    /// When it was sent (virtual ns): a 429 lowers rate admission's limits only for an attempt
    /// sent after the last lowering, as in the layer.
    sent_at: u64,
    /// Which attempt of its request it is, as the request's life names it.
    id: AttemptId,
    error: bool,
    /// The client still waits for the answer (false once it timed out).
    waiting: bool,
    unit: u32,
    /// The slot came from the separate retry pool.
    pooled: bool,
    permit: Option<Permit>,
    probe: Option<BreakerPermit>,
    /// A timed-out attempt's slot, held until the dependency answers or the hold passes.
    held: Option<HeldSlot>,
    /// The provider's retry-after, when it answers this attempt 429.
    limited: Option<Duration>,
    /// Rate admission's booking, settled when the client has the answer.
    booking: Option<Booking>,
    /// The tokens the provider reserved for it (when it limits tokens), settled when it is
    /// served; and whether it arrived before the end of arrivals (for the report's rate).
    reserved: Option<(RatePermit, bool)>,
}

#[derive(Debug)]
struct Dependency {
    busy: u32,
    queue: VecDeque<Ref>,
    bound: Option<u32>,
    in_flight: u32,
}

/// What happens after a failed attempt, decided before anything is changed.
enum Next {
    Fail,
    Deny(Denied),
    Now,
    At(u64),
    /// A budgeted retry with no wait: admitted in the same event.
    Admit,
}

/// The largest slab sizes a run reached: what its memory follows.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Footprint {
    /// Actions in flight at once (slab capacity).
    pub actions: usize,
    /// Requests in flight at once.
    pub requests: usize,
    /// Attempts at the dependency or awaited at once.
    pub attempts: usize,
    /// Events pending at once.
    pub events: usize,
}

pub(crate) struct Run<'s> {
    sc: &'s Scenario,
    policy: &'s PolicyConfig,
    segs: Vec<Seg>,
    seg: usize,
    now: u64,
    horizon: u64,
    heap: BinaryHeap<Entry>,
    arrivals: BinaryHeap<Reverse<(u64, u32)>>,
    seq: u64,
    clock: ManualClock,
    needs_clock: bool,
    max_events: usize,
    units: Vec<Unit>,
    actions: Slab<Action>,
    calls: Slab<Call>,
    attempts: Slab<Attempt>,
    dep: Dependency,
    /// The provider's requests and tokens per minute, if the dependency has them.
    provider: Option<Provider>,
    /// What each call costs in tokens.
    tokens: CallTokens,
    arrival_rngs: Vec<SplitMix64>,
    instance_actions: Vec<u64>,
    attempt_seed: u64,
    jitter: SplitMix64,
    naive_backoff: Option<Backoff>,
    sink: Arc<WakeSink>,
    outstanding: u64,
    per_try: Option<u64>,
    deadline: u64,
    hold: u64,
    retry_on: RetryOn,
    fast_within: Option<u64>,
    release_held_on_answer: bool,
    fan_out: u32,
    stats: RunStats,
    /// Attempts sent so far, and the most this run may send.
    sent: u64,
    max_attempts: u64,
    hedge: Option<HedgeConfig>,
    /// The idempotency draw's threshold (`client.non_idempotent`).
    non_idempotent: u64,
    /// Each unit's working cap when last read (an adaptive cap; empty otherwise), and their sum.
    working_caps: Vec<u64>,
    working_cap: u64,
    /// The caller's own retries of a failed request, and its wait before each (virtual ns).
    own_retries: u32,
    own_backoff: u64,
    /// A scripted dependency ([`crate::script`]), when the run follows one.
    script: Option<Box<Scripted<'s>>>,
}

/// A scripted run's state: the script, each call's place in it (by the call's key), the log,
/// and the reason the call about to end was refused.
#[derive(Debug)]
struct Scripted<'s> {
    requests: &'s [ScriptedRequest],
    index: std::collections::HashMap<u64, u32>,
    log: Vec<Line>,
    refused: Option<Denied>,
}

/// Events handled at one instant of the virtual clock before a run is called stuck: closed-loop
/// workers whose actions end at once (a full queue answering 503 with `think = 0`) would
/// restart at the same nanosecond forever.
const STUCK_EVENTS: u64 = 1_000_000;

/// Why a policy's run could not be built, or stopped before its end.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RunError {
    /// A part of the policy (backoff, breaker, limiter, retry rules) refused its settings.
    #[error(transparent)]
    Config(#[from] stormguard_core::error::ConfigError),
    /// The budget SPEC could not be built.
    #[error(transparent)]
    Budget(#[from] stormguard_core::budget::SpecError),
    /// The run sent more than its bound of attempts.
    #[error(
        "sent more than {max_attempts} attempts by {} s of virtual time: the simulator stops a \
         run there (shorten duration, lower the load, or retry less)",
        seconds(*at_nanos)
    )]
    TooMuchWork {
        /// The bound.
        max_attempts: u64,
        /// When it was passed, in virtual nanoseconds.
        at_nanos: u64,
    },
    /// Events kept coming without the virtual clock moving.
    #[error(
        "{events} events at {} s without the virtual clock moving: closed-loop workers whose \
         actions end at once (a full queue answering 503, with think = 0) restart forever; give \
         the fleet a think time or the dependency a queue",
        seconds(*at_nanos)
    )]
    Stuck {
        /// Events at the one instant.
        events: u64,
        /// The instant, in virtual nanoseconds.
        at_nanos: u64,
    },
}

/// Virtual nanoseconds as seconds with three decimals.
fn seconds(nanos: u64) -> String {
    format!("{:.3}", nanos as f64 / 1e9)
}

impl<'s> Run<'s> {
    pub(crate) fn new(sc: &'s Scenario, policy: &'s PolicyConfig) -> Result<Run<'s>, RunError> {
        let clock = ManualClock::new();
        let horizon = nanos(sc.duration);
        let segs: Vec<Seg> = sc
            .segments()
            .iter()
            .map(|p| Seg {
                start: nanos(p.start),
                capacity: p.conditions.capacity,
                workers: p.conditions.workers,
                error_threshold: dist::threshold(p.conditions.error_rate),
                service: p.conditions.service_time,
                error_time: p.conditions.error_time,
            })
            .collect();
        let units = build_units(sc, policy, &clock)?;
        let arrival_seed = dist::stream_seed(sc.seed, Stream::Arrivals);
        let instances = sc.fleet.instances as usize;
        let naive_backoff = match &policy.retry {
            RetryRule::Naive { backoff: Some(b), .. } => Some(Backoff::try_new(*b)?),
            _ => None,
        };
        let mut stats =
            RunStats::new(horizon, nanos(sc.bucket), segs.iter().map(|s| s.start).collect());
        // An adaptive cap's working cap is followed over time, as the in-flight count is.
        let working_caps = match policy.cap.filter(|c| c.adaptive.is_some()) {
            Some(c) => vec![c.initial(); units.len()],
            None => Vec::new(),
        };
        let working_cap = working_caps.iter().sum();
        if !working_caps.is_empty() {
            stats.follow_cap(working_cap);
        }
        Ok(Run {
            sc,
            policy,
            segs,
            seg: 0,
            now: 0,
            horizon,
            heap: BinaryHeap::new(),
            arrivals: BinaryHeap::new(),
            seq: 0,
            clock,
            needs_clock: policy.cap.is_some(),
            max_events: 0,
            units,
            actions: Slab::new(),
            calls: Slab::new(),
            attempts: Slab::new(),
            dep: Dependency {
                busy: 0,
                queue: VecDeque::new(),
                bound: sc.dependency.queue,
                in_flight: 0,
            },
            provider: sc.dependency.rate.as_ref().map(Provider::new),
            tokens: CallTokens::new(sc),
            arrival_rngs: (0..instances)
                .map(|i| SplitMix64::new(mix(arrival_seed, i as u64)))
                .collect(),
            instance_actions: vec![0; instances],
            attempt_seed: dist::stream_seed(sc.seed, Stream::Attempts),
            jitter: SplitMix64::new(dist::stream_seed(sc.seed, Stream::Jitter)),
            naive_backoff,
            sink: Arc::new(WakeSink::default()),
            outstanding: 0,
            per_try: sc.client.per_try_timeout.map(nanos),
            deadline: nanos(sc.client.deadline),
            hold: nanos(sc.client.timeout_slot_hold),
            retry_on: sc.client.retry_on.clone(),
            fast_within: sc.client.fast_within.map(nanos),
            release_held_on_answer: sc.client.held_slot == HeldSlotRelease::OnAnswer,
            fan_out: sc.fleet.fan_out,
            stats,
            sent: 0,
            max_attempts: crate::scenario::MAX_ATTEMPTS,
            hedge: policy.hedge,
            non_idempotent: dist::threshold(sc.client.non_idempotent),
            working_caps,
            working_cap,
            own_retries: sc.client.own_retries,
            own_backoff: nanos(sc.client.own_backoff),
            script: None,
        })
    }

    /// Answers every attempt as `requests` say, at once (see [`crate::script`]).
    pub(crate) fn with_script(mut self, requests: &'s [ScriptedRequest]) -> Self {
        self.script = Some(Box::new(Scripted {
            requests,
            index: std::collections::HashMap::new(),
            log: Vec::new(),
            refused: None,
        }));
        self
    }

    /// Runs a scripted run to its end and returns its log.
    pub(crate) fn run_logged(mut self, progress: &AtomicU64) -> Result<Vec<Line>, RunError> {
        self.drive(progress)?;
        Ok(self.script.map(|s| s.log).unwrap_or_default())
    }

    /// Stops the run with an error once it has sent more than `n` attempts (default
    /// [`MAX_ATTEMPTS`](crate::scenario::MAX_ATTEMPTS)).
    pub(crate) fn with_max_attempts(mut self, n: u64) -> Self {
        self.max_attempts = n;
        self
    }

    /// Runs to the end: arrivals stop at the scenario's duration, and every action that
    /// started is followed to its end. A run that sends more than its bound of attempts, or
    /// handles [`STUCK_EVENTS`] events without the clock moving, stops with an error.
    pub(crate) fn run(mut self, progress: &AtomicU64) -> Result<(RunStats, Footprint), RunError> {
        self.drive(progress)?;
        let footprint = Footprint {
            actions: self.actions.capacity(),
            requests: self.calls.capacity(),
            attempts: self.attempts.capacity(),
            events: self.max_events,
        };
        Ok((self.stats, footprint))
    }

    /// The event loop, to the end of the run.
    fn drive(&mut self, progress: &AtomicU64) -> Result<(), RunError> {
        self.schedule_start();
        let mut events: u32 = 0;
        let mut at_this_instant: u64 = 0;
        loop {
            // Open-loop arrivals wait in their own small queue (one entry per instance), so
            // the main heap holds only what is in flight. At equal times the main heap goes
            // first.
            let next_event = self.heap.peek().map(|e| e.at);
            let (at, ev) = match (next_event, self.arrivals.peek()) {
                (None, None) => break,
                (e, Some(&Reverse((a, i)))) if e.is_none_or(|e| a < e) => {
                    self.arrivals.pop();
                    (a, Ev::Arrival(i))
                }
                _ => {
                    let e = self.heap.pop().expect("peeked");
                    (e.at, e.ev)
                }
            };
            if at > self.now {
                at_this_instant = 0;
                self.stats.advance(at);
                self.now = at;
                // Only the limiter reads the clock (everything else is passed the time).
                if self.needs_clock {
                    self.clock.set(Timestamp::from_nanos(at));
                }
            }
            self.dispatch(ev);
            if self.sink.pending.load(AtomicOrdering::Relaxed) {
                self.pump();
            }
            if self.now >= self.horizon && self.outstanding == 0 {
                break;
            }
            if self.sent > self.max_attempts {
                return Err(RunError::TooMuchWork {
                    max_attempts: self.max_attempts,
                    at_nanos: self.now,
                });
            }
            at_this_instant += 1;
            if at_this_instant > STUCK_EVENTS {
                return Err(RunError::Stuck { events: STUCK_EVENTS, at_nanos: self.now });
            }
            events = events.wrapping_add(1);
            if events & 0xFFF == 0 {
                progress.store(self.now.min(self.horizon), AtomicOrdering::Relaxed);
            }
        }
        self.stats.advance(self.horizon);
        progress.store(self.horizon, AtomicOrdering::Relaxed);
        Ok(())
    }

    #[inline]
    fn ts(&self) -> Timestamp {
        Timestamp::from_nanos(self.now)
    }

    #[inline]
    fn push(&mut self, at: u64, ev: Ev) {
        self.seq += 1;
        let rank = if matches!(ev, Ev::Done(_) | Ev::Limited(_)) { 0 } else { RANK_BIT };
        self.heap.push(Entry { at, order: rank | self.seq, ev });
        self.max_events = self.max_events.max(self.heap.len());
    }

    fn schedule_start(&mut self) {
        for (i, s) in
            self.segs.iter().enumerate().skip(1).map(|(i, s)| (i, s.start)).collect::<Vec<_>>()
        {
            self.push(s, Ev::Segment(i as u32));
        }
        for i in 0..self.sc.fleet.instances {
            match self.sc.fleet.load {
                Load::Open { .. } => {
                    if let Some(at) = self.arrival_after(i, 0) {
                        self.arrivals.push(Reverse((at, i)));
                    }
                }
                Load::Closed { concurrency, .. } => {
                    // Workers start spread over the first 100 ms (or tenth of the run), so the
                    // run does not open with every worker in the same nanosecond.
                    let spread = (self.horizon / 10).clamp(1, 100_000_000);
                    for _ in 0..concurrency {
                        let at = self.arrival_rngs[i as usize].next_u64() % spread;
                        self.push(at, Ev::Start(i));
                    }
                }
            }
        }
    }

    /// The time of instance `i`'s arrival number `k` (0-based), given the previous one's time
    /// `now`, or `None` past the horizon.
    fn arrival_after(&mut self, i: u32, k: u64) -> Option<u64> {
        let sc = self.sc;
        let Load::Open { rate, arrivals } = sc.fleet.load else { return None };
        next_arrival(
            &mut self.arrival_rngs[i as usize],
            (rate, arrivals, sc.fleet.recorded.as_deref()),
            (i, sc.fleet.instances),
            k,
            self.now,
        )
        .filter(|at| *at < self.horizon)
    }

    fn dispatch(&mut self, ev: Ev) {
        match ev {
            Ev::Arrival(i) => {
                self.start_action(i);
                let k = self.instance_actions[i as usize];
                if let Some(at) = self.arrival_after(i, k) {
                    self.arrivals.push(Reverse((at, i)));
                }
            }
            Ev::Start(i) => {
                if self.now < self.horizon {
                    self.start_action(i);
                }
            }
            Ev::Done(a) => self.server_done(a),
            Ev::Reject(a) => {
                if let Some(mut a) = self.attempts.remove(a) {
                    // The provider's queue refused it: nothing was used.
                    if let Some((p, _)) = a.reserved.take() {
                        p.refund(self.ts());
                    }
                    if a.waiting {
                        self.answered(a, false);
                    } else if let Some(held) = a.held.take() {
                        held.upstream_answered();
                    }
                }
            }
            Ev::Limited(a) => self.limited(a),
            Ev::RateDue(c) => self.rate_due(c),
            Ev::HoldDue(c) => self.hold_due(c),
            Ev::Timeout(a) => self.timed_out(a),
            Ev::RetryDue(c) => self.retry_due(c),
            Ev::CallerRetry(c) => self.caller_retry(c),
            Ev::QueueDeadline(u) => self.queue_deadline(u),
            Ev::LimiterWake(u) => self.limiter_wake(u),
            Ev::HedgeDue(a) => self.hedge_due(a),
            Ev::Segment(s) => {
                self.seg = s as usize;
                self.fill_servers();
            }
        }
    }

    // ---- the client ----

    fn start_action(&mut self, instance: u32) {
        let k = self.instance_actions[instance as usize];
        self.instance_actions[instance as usize] += 1;
        let key = mix(mix(self.attempt_seed, u64::from(instance)), k);
        if let Some(s) = &mut self.script {
            s.index.insert(mix(key, 0), k as u32);
        }
        let scope = self.policy.scope_retries.map(|n| Scope::FanOut(FanOutScope::new(n)));
        let place = self.stats.place();
        let action = self.actions.insert(Action {
            start: self.now,
            remaining: self.fan_out,
            failed: false,
            instance,
            scope,
            place,
        });
        self.outstanding += 1;
        let unit = match self.policy.share {
            Share::Instance if self.units.len() > 1 => instance,
            _ => 0,
        };
        for j in 0..self.fan_out {
            self.start_call(action, mix(key, u64::from(j)), unit);
        }
    }

    fn start_call(&mut self, action: Ref, key: u64, unit: u32) {
        let idempotent =
            !SplitMix64::new(key ^ IDEMPOTENCY_SALT).next_u64_below(self.non_idempotent);
        let call = self.new_call(action, key, unit, self.now + self.deadline, idempotent, 0);
        self.stats.requests += 1;
        self.first_try(call);
    }

    fn new_call(
        &mut self,
        action: Ref,
        key: u64,
        unit: u32,
        deadline: u64,
        idempotent: bool,
        own: u8,
    ) -> Ref {
        self.calls.insert(Call {
            action,
            key,
            deadline,
            unit,
            tries: 0,
            retries: 0,
            last_wait: None,
            rare: None,
            primary_active: false,
            live: 0,
            hedges: 0,
            idempotent,
            own,
        })
    }

    /// The caller's own retry of a failed request. A policy that sees it (a budget with
    /// `caller_retries = "enforce"`) admits it as the request's life admits one
    /// ([`Life::caller_retry`]: breaker, hold, scope, budget, then the window and a slot with
    /// `try_acquire`) or refuses it; to any other it is a first try.
    fn caller_retry(&mut self, call: Ref) {
        let ts = self.ts();
        let Some(c) = self.calls.get_mut(call) else { return };
        self.stats.caller_retries += 1;
        let u = &self.units[c.unit as usize];
        if u.policy.is_none() || !self.policy.caller_retries {
            self.first_try(call);
            return;
        }
        let g = UnitGates { unit: u, most: self.tokens.most };
        if u.counts_active {
            g.policy().budget().set_active(u.active_primaries, 0);
        }
        let scopes = scopes_of(&self.actions, c.action).to_vec();
        let number = u32::from(c.own) + 1;
        let (life, admitted) =
            Life::caller_retry(&g, ts, c.facts(), scopes, None, 0, number, FailureKind::Error);
        let pooled = u.retry_upstream.is_some();
        c.rare().life = Some(life);
        match admitted {
            Ok(a) => {
                c.rare().booking = a.booking;
                self.send(call, a.permit, Sent::Retry, pooled, a.id);
            }
            Err(refused) => self.deny(call, refused.reason),
        }
    }

    /// A first try: the breaker, the provider's window, then the cap.
    fn first_try(&mut self, call: Ref) {
        let now = self.now;
        let Some(unit) = self.calls.get(call).map(|c| c.unit) else { return };
        let ts = self.ts();
        let max_wait = self.deadline.min(self.queue_timeout(unit));
        let u = &mut self.units[unit as usize];
        // Fail fast while the breaker is open, before waiting in the queue.
        if let Some(b) = &u.breaker
            && matches!(b.state(ts), BreakerState::Open { .. })
        {
            self.primary_refused(call, Denied::Breaker);
            return;
        }
        // The provider's window before the cap: a first try books its turn (within the queue
        // timeout and the deadline, else it is refused `rate`), waits for it, then queues for
        // its slot.
        if let Some(meter) = &u.rate {
            match meter.book(ts, self.tokens.most, Duration::from_nanos(max_wait)) {
                Ok((booking, wait)) => {
                    let c = self.calls.get_mut(call).expect("just inserted");
                    c.rare().booking = Some(booking);
                    if !wait.is_zero() {
                        c.rare().rate_give_up = now + max_wait;
                        self.push(now + nanos(wait), Ev::RateDue(call));
                        return;
                    }
                }
                Err(_) => {
                    self.primary_refused(call, Denied::Rate);
                    return;
                }
            }
        }
        self.enter_cap(call);
    }

    /// The cap's timeout for a primary's wait (in the limiter's queue, or for rate admission's
    /// turn), in virtual nanoseconds.
    fn queue_timeout(&self, unit: u32) -> u64 {
        self.units[unit as usize]
            .upstream
            .as_ref()
            .map_or(0, |up| nanos(up.limiter.config().queue_timeout))
    }

    /// A first try's turn has come: it queues for its slot, unless a 429 that arrived while it
    /// waited holds admission. It waits that out within its queue timeout and deadline, else it
    /// is refused `rate` (and its booking refunded): the tower layer's `rate_waited`.
    fn rate_due(&mut self, call: Ref) {
        let ts = self.ts();
        let Some(c) = self.calls.get(call) else { return };
        let give_up = c.rare.as_ref().map_or(0, |r| r.rate_give_up);
        let meter = self.units[c.unit as usize].rate.as_ref().expect("a rate wait has a meter");
        match meter.held(ts) {
            None => self.enter_cap(call),
            Some(held) if self.now.saturating_add(nanos(held)) <= give_up => {
                self.push(self.now + nanos(held), Ev::RateDue(call));
            }
            Some(_) => self.primary_refused(call, Denied::Rate),
        }
    }

    /// A first try asks the cap for its slot: now if one is free, else in the queue.
    fn enter_cap(&mut self, call: Ref) {
        let ts = self.ts();
        let Some(unit) = self.calls.get(call).map(|c| c.unit) else { return };
        let u = &mut self.units[unit as usize];
        let Some(up) = &u.upstream else {
            self.send(call, None, Sent::Primary, false, AttemptId::FIRST);
            return;
        };
        u.active_primaries += 1;
        let admitted = up.limiter.try_acquire_at(AttemptKind::Primary, ts).ok();
        if let Some(c) = self.calls.get_mut(call) {
            c.primary_active = true;
        }
        match admitted {
            Some(p) => self.admitted(call, p),
            None => self.queue_primary(call),
        }
    }

    /// A first try that queued has its slot: a hold that began while it waited (a 429, a spent
    /// quota) is waited out, holding the slot, while the queue timeout and the deadline allow;
    /// past them it is refused `rate` (the tower layer's `admit_first_try`).
    fn queued_admitted(&mut self, call: Ref, permit: Permit) {
        let ts = self.ts();
        let Some(c) = self.calls.get(call) else { return };
        let (unit, deadline) = (c.unit, c.deadline);
        let held = self.units[unit as usize].rate.as_ref().and_then(|m| m.held(ts));
        match held {
            None => self.admitted(call, permit),
            Some(h)
                if stormguard_core::rate::waits_out_hold(
                    h,
                    Duration::from_nanos(self.queue_timeout(unit)),
                    ts,
                    Some(Timestamp::from_nanos(deadline)),
                ) =>
            {
                if let Some(c) = self.calls.get_mut(call) {
                    c.rare().held_slot = Some(permit);
                }
                self.push(self.now + nanos(h), Ev::HoldDue(call));
            }
            Some(_) => {
                drop(permit);
                self.primary_refused(call, Denied::Rate);
            }
        }
    }

    /// A queued first try's hold is over: it is sent with the slot it held.
    fn hold_due(&mut self, call: Ref) {
        let Some(permit) = self.calls.get_mut(call).and_then(|c| c.rare().held_slot.take()) else {
            return;
        };
        self.admitted(call, permit);
    }

    fn admitted(&mut self, call: Ref, permit: Permit) {
        let ts = self.ts();
        if let Some(c) = self.calls.get(call)
            && let Some(p) = &self.units[c.unit as usize].policy
        {
            p.on_admitted(ts);
        }
        self.send(call, Some(permit), Sent::Primary, false, AttemptId::FIRST);
    }

    /// No free slot: wait in the limiter's FIFO queue, until the queue timeout or the deadline.
    fn queue_primary(&mut self, call: Ref) {
        let Some(c) = self.calls.get(call) else { return };
        let (unit, deadline) = (c.unit as usize, c.deadline);
        let limiter: &Limiter =
            &self.units[unit].upstream.as_ref().expect("a queued primary has a cap").limiter;
        let mut acquire = limiter.acquire_until(Timestamp::from_nanos(deadline));
        let waker = Waker::from(Arc::new(CallWaker { sink: self.sink.clone(), call }));
        match acquire.poll_acquire(&mut Context::from_waker(&waker)) {
            Poll::Ready(Ok(p)) => self.queued_admitted(call, p),
            Poll::Ready(Err(reason)) => self.primary_refused(call, reason),
            Poll::Pending => {
                let at = acquire.deadline().as_nanos();
                if let Some(c) = self.calls.get_mut(call) {
                    c.rare().acquire = Some((acquire, waker));
                }
                let calls = &self.calls;
                let waiters = &mut self.units[unit].waiters;
                while waiters.front().is_some_and(|w| calls.get(*w).is_none_or(|c| !c.queued())) {
                    waiters.pop_front();
                }
                waiters.push_back(call);
                if !self.units[unit].queue_timer {
                    self.units[unit].queue_timer = true;
                    self.push(at, Ev::QueueDeadline(unit as u32));
                }
            }
        }
    }

    /// Polls a queued primary's `Acquire` (woken by a release, or at its deadline).
    fn poll_queued(&mut self, call: Ref) {
        let Some(c) = self.calls.get_mut(call) else { return };
        let Some((mut acquire, waker)) = c.rare.as_mut().and_then(|r| r.acquire.take()) else {
            return;
        };
        match acquire.poll_acquire(&mut Context::from_waker(&waker)) {
            Poll::Ready(Ok(p)) => self.queued_admitted(call, p),
            Poll::Ready(Err(reason)) => self.primary_refused(call, reason),
            Poll::Pending => {
                if let Some(c) = self.calls.get_mut(call) {
                    c.rare().acquire = Some((acquire, waker));
                }
            }
        }
    }

    /// The oldest waits end: poll each expired waiter (the limiter refuses it `queue`), then
    /// set the timer for the next one.
    fn queue_deadline(&mut self, unit: u32) {
        self.units[unit as usize].queue_timer = false;
        loop {
            let calls = &self.calls;
            let u = &mut self.units[unit as usize];
            while u.waiters.front().is_some_and(|w| calls.get(*w).is_none_or(|c| !c.queued())) {
                u.waiters.pop_front();
            }
            let Some(&front) = u.waiters.front() else { return };
            let ends = calls
                .get(front)
                .and_then(|c| c.rare.as_ref())
                .and_then(|r| r.acquire.as_ref())
                .map_or(0, |(a, _)| a.deadline().as_nanos());
            if ends > self.now {
                u.queue_timer = true;
                self.push(ends, Ev::QueueDeadline(unit));
                return;
            }
            self.poll_queued(front);
            if self.calls.get(front).is_some_and(|c| c.queued()) {
                // Still waiting past its end: the limiter decides; do not spin.
                self.units[unit as usize].waiters.pop_front();
            }
        }
    }

    /// Polls every request the limiter woke.
    fn pump(&mut self) {
        loop {
            self.sink.pending.store(false, AtomicOrdering::Relaxed);
            let woken = std::mem::take(&mut *self.sink.calls.lock().expect("single-threaded"));
            if woken.is_empty() {
                return;
            }
            for call in woken {
                self.poll_queued(call);
            }
        }
    }

    /// A held slot has come back: polling the oldest waiter lets the limiter reclaim it and
    /// hand it to whoever is first in its queue.
    fn limiter_wake(&mut self, unit: u32) {
        let calls = &self.calls;
        let waiters = &mut self.units[unit as usize].waiters;
        while waiters.front().is_some_and(|w| calls.get(*w).is_none_or(|c| !c.queued())) {
            waiters.pop_front();
        }
        if let Some(&front) = waiters.front() {
            self.poll_queued(front);
        }
    }

    /// Sends an attempt that has its slot (if the policy has a cap): the breaker's permit
    /// first, then the dependency. Returns the attempt, or `None` when the breaker refused it
    /// (a hedge's refusal leaves its request waiting on the attempts it has).
    fn send(
        &mut self,
        call: Ref,
        permit: Option<Permit>,
        kind: Sent,
        pooled: bool,
        id: AttemptId,
    ) -> Option<Ref> {
        let ts = self.ts();
        let c = self.calls.get_mut(call)?;
        let unit = c.unit;
        let probe = match &self.units[unit as usize].breaker {
            None => None,
            Some(b) => match b.try_acquire(ts) {
                Ok(p) => Some(p),
                Err(_) => {
                    if let Some(p) = permit {
                        p.release_at(ts);
                        self.note_cap(unit);
                    }
                    // Never sent: what it was charged goes back.
                    if let Some(policy) = &self.units[unit as usize].policy
                        && let Some(life) = self
                            .calls
                            .get_mut(call)
                            .and_then(|c| c.rare.as_mut())
                            .and_then(|r| r.life.as_mut())
                    {
                        life.unsent(policy, ts, id);
                    }
                    match kind {
                        Sent::Primary => self.primary_refused(call, Denied::Breaker),
                        Sent::Retry => self.deny(call, Denied::Breaker),
                        Sent::Hedge => self.stats.hedge_denied(Denied::Breaker),
                    }
                    return None;
                }
            },
        };
        c.tries += 1;
        c.live += 1;
        // A first try (or a hedge of it) may be hedged; a retry goes alone, as in the layer.
        let may_hedge =
            kind != Sent::Retry && self.hedge.is_some_and(|h| u32::from(c.hedges) < h.max_hedges);
        let booking = c.rare.as_mut().and_then(|r| r.booking.take());
        let key = mix(c.key, u64::from(c.tries));
        let limit = {
            let left = c.deadline.saturating_sub(self.now).max(1);
            self.per_try.map_or(left, |t| t.min(left))
        };
        let (threshold, capacity) = {
            let seg = &self.segs[self.seg];
            (seg.error_threshold, seg.capacity)
        };
        let scripted = self.script.as_mut().map(|s| {
            let i = s.index[&c.key];
            let at = Duration::from_nanos(self.now);
            let event = ScriptEvent::Sent { n: c.tries, hedge: kind == Sent::Hedge };
            s.log.push(Line { at, request: i, event });
            s.requests[i as usize].answer(c.tries)
        });
        let error = match scripted {
            Some(answer) => matches!(answer, Answer::Unavailable(_)),
            None => SplitMix64::new(key).next_u64_below(threshold),
        };
        let att = self.attempts.insert(Attempt {
            call,
            key,
            kind,
            sent_at: self.now,
            id,
            error,
            waiting: true,
            unit,
            pooled,
            permit,
            probe,
            held: None,
            limited: None,
            booking,
            reserved: None,
        });
        self.stats.sent(kind);
        self.sent += 1;
        let now = self.now;
        if may_hedge && let Some(delay) = self.hedge_delay(unit) {
            // A hedge due at or after the per-try timeout would be a retry.
            if delay < limit {
                self.push(now + delay, Ev::HedgeDue(att));
            }
        }
        // A scripted dependency answers when the script says, with no servers to wait for.
        if let Some(answer) = scripted {
            let after = nanos(answer.after()).max(1);
            match answer {
                Answer::TooMany(_, secs) => {
                    if let Some(a) = self.attempts.get_mut(att) {
                        a.limited = Some(Duration::from_secs(secs));
                    }
                    self.push(now + after, Ev::Limited(att));
                }
                Answer::Ok(_) | Answer::Unavailable(_) => {
                    self.dep.busy += 1;
                    self.dep_in_flight(1);
                    self.push(now + after, Ev::Done(att));
                }
            }
            if after > limit {
                self.push(now + limit, Ev::Timeout(att));
            }
            return Some(att);
        }
        // The provider counts every attempt at its door, before its queue and servers.
        if let Some(provider) = &self.provider {
            let counted = provider.arrive(ts, self.tokens.most);
            let in_run = self.stats.at_provider(counted.is_ok());
            match counted {
                Ok(reserved) => {
                    if let Some(a) = self.attempts.get_mut(att) {
                        a.reserved = reserved.map(|p| (p, in_run));
                    }
                }
                Err(retry_after) => {
                    if let Some(a) = self.attempts.get_mut(att) {
                        a.limited = Some(retry_after);
                    }
                    let answer = nanos(rate::LIMITED_ANSWER);
                    self.push(now + answer, Ev::Limited(att));
                    if answer > limit {
                        self.push(now + limit, Ev::Timeout(att));
                    }
                    return Some(att);
                }
            }
        }
        if self.dep.busy < capacity {
            let done = self.start_service(att, u64::from(self.dep.in_flight) + 1);
            self.dep_in_flight(1);
            if done > now + limit {
                self.push(now + limit, Ev::Timeout(att));
            }
        } else if self.dep.bound.is_none_or(|b| self.dep.queue.len() < b as usize) {
            self.dep.queue.push_back(att);
            self.dep_in_flight(1);
            self.push(now + limit, Ev::Timeout(att));
        } else {
            self.stats.rejected += 1;
            self.push(now, Ev::Reject(att));
        }
        Some(att)
    }

    fn timed_out(&mut self, att: Ref) {
        let Some(id) = self.attempts.get(att).map(|a| a.id) else { return };
        let Some(call) = self.give_up(att, AttemptResult::UpstreamFailure, true) else { return };
        self.stats.timeouts += 1;
        let others = self.one_fewer(call);
        self.failed(call, id, others, AttemptFailure::Timeout, None);
    }

    /// The client stops waiting for an attempt (its per-try timeout, or another attempt of
    /// its request won) while the dependency may still be working on it. Returns its request.
    /// `timed_out`: an adaptive cap counts it as a drop, as the tower layer marks a per-try
    /// timeout's permit (`hold_slots`); an attempt abandoned for another's answer says nothing
    /// of the dependency.
    fn give_up(&mut self, att: Ref, result: AttemptResult, timed_out: bool) -> Option<Ref> {
        let a = self.attempts.get_mut(att)?;
        if !a.waiting {
            return None;
        }
        a.waiting = false;
        let (call, unit, pooled) = (a.call, a.unit, a.pooled);
        let (permit, probe) = (a.permit.take(), a.probe.take());
        // The provider may have counted it: the booking keeps its estimate.
        drop(a.booking.take());
        let ts = self.ts();
        if let Some(p) = probe {
            p.record(ts, result);
        }
        if let Some(mut p) = permit {
            if timed_out {
                p.mark_dropped();
            }
            // The dependency is still working on it: the slot is held, as the tower layer
            // holds it, for `timeout_slot_hold` (default 30 s, the proxy's), never shortened to
            // the attempt's own limit.
            let hold = self.hold.max(1);
            let held = p.hold(Duration::from_nanos(hold));
            if !pooled {
                self.note_cap(unit);
            }
            if self.release_held_on_answer
                && let Some(a) = self.attempts.get_mut(att)
            {
                a.held = Some(held);
            }
            if !pooled {
                self.push(self.now + hold, Ev::LimiterWake(unit));
            }
        }
        Some(call)
    }

    /// One attempt of `call` fewer is awaited: returns how many still are.
    fn one_fewer(&mut self, call: Ref) -> u8 {
        self.calls.get_mut(call).map_or(0, |c| {
            c.live = c.live.saturating_sub(1);
            c.live
        })
    }

    /// The hedge delay for an attempt sent now by `unit`, as the layer reads it (core's
    /// [`HedgeDelay`] over the cap's histogram): `None` while a percentile has too few attempts
    /// to read.
    fn hedge_delay(&mut self, unit: u32) -> Option<u64> {
        let after = self.hedge?.to_core().after;
        let ts = self.ts();
        let u = &self.units[unit as usize];
        let delay = match (&u.policy, &u.upstream) {
            (Some(policy), Some(up)) => policy.hedge_after(up, || ts),
            (None, Some(up)) => u.hedge_delay.delay(after, &up.limiter, ts),
            // A percentile needs a cap (the scenario says so).
            (_, None) => match after {
                stormguard_core::hedge::HedgeAfter::Fixed(d) => Some(d),
                stormguard_core::hedge::HedgeAfter::Percentile { .. } => None,
            },
        };
        delay.map(nanos)
    }

    /// An attempt is still unanswered after the hedge delay: send a hedge beside it. A budget
    /// policy decides and admits it as the tower layer does —
    /// [`RetryPolicy::decide_hedge`] (the retry rules' checks in their order, the budget
    /// charged as for a retry after a timeout), then [`RetryPolicy::admit_hedge`] (a slot with
    /// `try_acquire`); a naive hedger checks idempotency, the breaker and its cap.
    fn hedge_due(&mut self, att: Ref) {
        let ts = self.ts();
        let Some(a) = self.attempts.get(att) else { return };
        if !a.waiting {
            return;
        }
        let call = a.call;
        let Some(c) = self.calls.get_mut(call) else { return };
        let unit = c.unit;
        let u = &self.units[unit as usize];
        let upstream = u.retry_upstream.as_ref().or(u.upstream.as_ref());
        let pooled = u.retry_upstream.is_some();
        // Under rate admission a hedge, like a retry, never waits for the provider's window.
        let most = self.tokens.most;
        let book = |u: &Unit| -> Result<Option<Booking>, ()> {
            match &u.rate {
                None => Ok(None),
                Some(meter) => {
                    meter.book(ts, most, Duration::ZERO).map(|(b, _)| Some(b)).map_err(|_| ())
                }
            }
        };
        let hedged = a.id;
        let (permit, id, booking) = match &u.policy {
            Some(_) => {
                let g = UnitGates { unit: u, most };
                if u.counts_active {
                    g.policy().budget().set_active(u.active_primaries, 0);
                }
                match life_of(c, &self.actions).hedge_due(&g, ts, hedged) {
                    Ok(admitted) => (admitted.permit, admitted.id, admitted.booking),
                    Err(reason) => {
                        if let Some(reason) = reason {
                            self.stats.hedge_denied(reason);
                        }
                        return;
                    }
                }
            }
            None => {
                let refused = if !c.idempotent {
                    Some(Denied::NonIdempotent)
                } else if u.breaker.as_ref().is_some_and(|b| !b.allows_retry(ts)) {
                    Some(Denied::Breaker)
                } else {
                    None
                };
                if let Some(reason) = refused {
                    self.stats.hedge_denied(reason);
                    return;
                }
                let Ok(booking) = book(u) else {
                    self.stats.hedge_denied(Denied::Rate);
                    return;
                };
                // Its own slot under the same cap, never queued.
                match upstream.map(|up| up.limiter.try_acquire_at(AttemptKind::Retry, ts)) {
                    None => (None, AttemptId::FIRST, booking),
                    Some(Ok(p)) => (Some(p), AttemptId::FIRST, booking),
                    Some(Err(reason)) => {
                        if let Some(b) = booking {
                            b.refund(ts);
                        }
                        self.stats.hedge_denied(reason);
                        return;
                    }
                }
            }
        };
        if let Some(b) = booking {
            c.rare().booking = Some(b);
        }
        c.hedges += 1;
        let Some(hedge) = self.send(call, permit, Sent::Hedge, pooled, id) else { return };
        if let Some(c) = self.calls.get_mut(call) {
            let together = &mut c.rare().hedged;
            together.retain(|r| *r != att);
            together.extend([att, hedge]);
        }
    }

    /// The client has the attempt's answer (or the dependency's refusal). The model's errors
    /// are 503s (an `error_rate` answer, a full queue's refusal): an adaptive cap counts them
    /// as drops, as the tower layer marks every 429, 503 and 529 (`overload_answer`), not
    /// knowing why the dependency said it.
    fn answered(&mut self, a: Attempt, ok: bool) {
        let ts = self.ts();
        if let Some(mut p) = a.permit {
            p.answered_at(ts, !ok);
            p.release_at(ts);
            if !a.pooled {
                self.note_cap(a.unit);
            }
        }
        if let Some(p) = a.probe {
            p.record(ts, if ok { AttemptResult::Success } else { AttemptResult::UpstreamFailure });
        }
        // A success states the tokens the provider counted (its `usage`); an error answer
        // states none, and the estimate stays, as in the tower layer. Settled before the
        // answer's limits are heard: the remaining it states already counts this usage.
        if let Some(b) = a.booking {
            b.settle(ts, ok.then_some(self.tokens.used));
        }
        self.hear_limits(a.unit, None, a.sent_at);
        let others = self.one_fewer(a.call);
        if ok {
            if a.kind == Sent::Hedge {
                self.stats.hedges_won += 1;
            }
            if others > 0 {
                self.abandon_others(a.call);
            }
            self.succeeded(a.call, a.id);
        } else {
            self.stats.errors += 1;
            self.failed(a.call, a.id, others, AttemptFailure::Status(503), None);
        }
    }

    /// Rate admission hears what an answer states of the provider's limits (every answer
    /// carries them, as the provider's headers do), and a 429's retry-after.
    fn hear_limits(&mut self, unit: u32, too_many: Option<Duration>, sent_at: u64) {
        let ts = self.ts();
        if let Some(meter) = &self.units[unit as usize].rate {
            let seen = self.provider.as_ref().map(|p| p.headers(ts)).unwrap_or_default();
            meter.heard(ts, seen, too_many.map(|d| (d, Timestamp::from_nanos(sent_at))));
        }
    }

    /// The provider's 429 reaches the client: a failure the retry decision may retry, after
    /// the retry-after it states (a budget policy's pushback; naive policies do not read it).
    /// It says nothing of the dependency's health, so the breaker does not count it.
    fn limited(&mut self, att: Ref) {
        let Some(mut a) = self.attempts.remove(att) else { return };
        if !a.waiting {
            // Nobody waits for it, but rate admission still hears the provider's 429 (the
            // layer reads a timed-out attempt's answer in the background), then the slot
            // comes back.
            self.hear_limits(a.unit, a.limited, a.sent_at);
            if let Some(held) = a.held.take() {
                held.upstream_answered();
            }
            return;
        }
        let ts = self.ts();
        if let Some(mut p) = a.permit {
            // A 429 is an overload answer: a drop for an adaptive cap.
            p.answered_at(ts, true);
            p.release_at(ts);
            if !a.pooled {
                self.note_cap(a.unit);
            }
        }
        if let Some(p) = a.probe {
            p.record(ts, AttemptResult::NotCounted);
        }
        // A 429 states no usage: the estimate stays (the hold empties the meter anyway).
        if let Some(b) = a.booking {
            b.settle(ts, None);
        }
        self.hear_limits(a.unit, a.limited, a.sent_at);
        let others = self.one_fewer(a.call);
        self.failed(a.call, a.id, others, AttemptFailure::Status(429), a.limited);
    }

    /// The first successful answer of a hedged request is the caller's: the client stops
    /// waiting for the others, which keep their slots until the dependency finishes them.
    fn abandon_others(&mut self, call: Ref) {
        let together = match self.calls.get_mut(call).and_then(|c| c.rare.as_mut()) {
            Some(r) => std::mem::take(&mut r.hedged),
            None => return,
        };
        for att in together {
            if self.attempts.get(att).is_some_and(|a| a.call == call) {
                // The breaker learns nothing from an answer nobody read.
                self.give_up(att, AttemptResult::NotCounted, false);
            }
        }
    }

    /// Attempt `id` of `call` failed. While `others` of its attempts are still awaited, their
    /// answer decides (the failed one's charges end); otherwise the failure goes to the retry
    /// decision. `retry_after` is the dependency's word on when to retry (a 429's).
    fn failed(
        &mut self,
        call: Ref,
        id: AttemptId,
        others: u8,
        failure: AttemptFailure,
        retry_after: Option<Duration>,
    ) {
        let ts = self.ts();
        let now = self.now;
        let Some(c) = self.calls.get_mut(call) else { return };
        if others > 0 {
            if let Some(life) = c.rare.as_mut().and_then(|r| r.life.as_mut()) {
                life.ended(id);
            }
            return;
        }
        let u = &mut self.units[c.unit as usize];
        if c.primary_active {
            c.primary_active = false;
            u.active_primaries -= 1;
        }
        let next = match &self.policy.retry {
            RetryRule::None => Next::Fail,
            RetryRule::Naive { max_retries, .. } => {
                if !self.retry_on.matches(failure) {
                    Next::Fail
                } else if c.retries >= *max_retries {
                    Next::Deny(Denied::Attempts)
                } else if u.breaker.as_ref().is_some_and(|b| !b.allows_retry(ts)) {
                    Next::Deny(Denied::Breaker)
                } else {
                    let wait = match &self.naive_backoff {
                        None => Duration::ZERO,
                        Some(b) => b.wait(c.retries + 1, c.last_wait, &mut self.jitter),
                    };
                    if now + nanos(wait) >= c.deadline {
                        Next::Deny(Denied::Deadline)
                    } else {
                        c.last_wait = Some(wait);
                        if wait < IMMEDIATE { Next::Now } else { Next::At(now + nanos(wait)) }
                    }
                }
            }
            RetryRule::Budget { .. } => {
                let g = UnitGates { unit: u, most: self.tokens.most };
                if u.counts_active {
                    g.policy().budget().set_active(u.active_primaries, 0);
                }
                let failed = FailedAttempt {
                    failure,
                    unsent: false,
                    pushback: retry_after.map(Pushback::RetryAfter),
                };
                match life_of(c, &self.actions).failed(&g, ts, id, &failed, &mut self.jitter) {
                    LifeNext::Answer(None) => Next::Fail,
                    LifeNext::Answer(Some(reason)) => Next::Deny(reason),
                    LifeNext::Retry { wait, .. } if wait < IMMEDIATE => Next::Admit,
                    LifeNext::Retry { wait, .. } => Next::At(now + nanos(wait)),
                }
            }
        };
        match next {
            Next::Fail => self.finish_call(call, false),
            Next::Deny(reason) => self.deny(call, reason),
            Next::Now => self.naive_retry(call),
            Next::At(at) => self.push(at, Ev::RetryDue(call)),
            Next::Admit => self.admit(call),
        }
    }

    fn retry_due(&mut self, call: Ref) {
        match self.policy.retry {
            RetryRule::Budget { .. } => self.admit(call),
            _ => self.naive_retry(call),
        }
    }

    /// A budgeted retry after its wait: the request's life admits it now or never
    /// ([`Life::wait_elapsed`]: the provider's window, then a slot with `try_acquire`; a
    /// refusal gives the budget charge and the booking back).
    fn admit(&mut self, call: Ref) {
        let ts = self.ts();
        let Some(c) = self.calls.get_mut(call) else { return };
        let u = &self.units[c.unit as usize];
        let pooled = u.retry_upstream.is_some();
        let g = UnitGates { unit: u, most: self.tokens.most };
        let Some(life) = c.rare.as_mut().and_then(|r| r.life.as_mut()) else { return };
        match life.wait_elapsed(&g, ts) {
            Ok(a) => {
                c.rare().booking = a.booking;
                self.send(call, a.permit, Sent::Retry, pooled, a.id);
            }
            Err(reason) => self.deny(call, reason),
        }
    }

    /// A naive retry: sent now, taking a slot with `try_acquire` if the policy has a cap.
    fn naive_retry(&mut self, call: Ref) {
        let ts = self.ts();
        let Some(c) = self.calls.get_mut(call) else { return };
        c.retries += 1;
        let u = &self.units[c.unit as usize];
        let pooled = u.retry_upstream.is_some();
        let permit = match u.retry_upstream.as_ref().or(u.upstream.as_ref()) {
            None => None,
            Some(up) => match up.limiter.try_acquire_at(AttemptKind::Retry, ts) {
                Ok(p) => Some(p),
                Err(reason) => {
                    self.deny(call, reason);
                    return;
                }
            },
        };
        // Under rate admission a retry never waits for the provider's window.
        if let Some(meter) = &u.rate {
            match meter.book(ts, self.tokens.most, Duration::ZERO) {
                Ok((booking, _)) => c.rare().booking = Some(booking),
                Err(_) => {
                    if let Some(p) = permit {
                        p.release_at(ts);
                    }
                    let unit = c.unit;
                    self.note_cap(unit);
                    self.deny(call, Denied::Rate);
                    return;
                }
            }
        }
        self.send(call, permit, Sent::Retry, pooled, AttemptId::FIRST);
    }

    /// Attempt `id` of `call` succeeded: the request's life tells the budget (and the
    /// attempt's charges), or, for a request that never needed one, the policy hears a first
    /// try's success.
    fn succeeded(&mut self, call: Ref, id: AttemptId) {
        let ts = self.ts();
        let Some(c) = self.calls.get_mut(call) else { return };
        if let Some(p) = &self.units[c.unit as usize].policy {
            match c.rare.as_mut().and_then(|r| r.life.as_mut()) {
                Some(life) => life.succeeded(p, || ts, id),
                None => p.on_success_with(|| ts, false),
            }
        }
        self.finish_call(call, true);
    }

    fn deny(&mut self, call: Ref, reason: Denied) {
        self.stats.retry_denied(reason);
        if let Some(s) = &mut self.script {
            s.refused = Some(reason);
        }
        self.finish_call(call, false);
    }

    fn primary_refused(&mut self, call: Ref, reason: Denied) {
        self.stats.primaries_denied[reason.index()] += 1;
        if let Some(s) = &mut self.script {
            s.refused = Some(reason);
        }
        if let Some(c) = self.calls.get(call)
            && let Some(p) = &self.units[c.unit as usize].policy
        {
            p.on_primary_refused(reason);
        }
        self.finish_call(call, false);
    }

    /// The request's final answer reaches its user action — or, when it failed and the caller
    /// retries on its own, the caller's next try.
    fn finish_call(&mut self, call: Ref, ok: bool) {
        let Some(c) = self.calls.remove(call) else { return };
        if let Some(s) = &mut self.script {
            let refused = s.refused.take();
            let at = Duration::from_nanos(self.now);
            let request = s.index[&c.key];
            s.log.push(Line { at, request, event: ScriptEvent::Ended { ok, refused } });
        }
        // Booked but never sent (refused its slot, its breaker, or a hold past its wait): given
        // back.
        if let Some(b) = c.rare.and_then(|r| r.booking) {
            b.refund(Timestamp::from_nanos(self.now));
        }
        if c.primary_active {
            self.units[c.unit as usize].active_primaries -= 1;
        }
        let at = self.now + self.own_backoff;
        if !ok && u32::from(c.own) < self.own_retries && at < c.deadline {
            let own = c.own + 1;
            let again = self.new_call(
                c.action,
                mix(c.key, u64::from(own)),
                c.unit,
                c.deadline,
                c.idempotent,
                own,
            );
            self.push(at, Ev::CallerRetry(again));
            return;
        }
        self.stats.requests_ok += u64::from(ok);
        let Some(a) = self.actions.get_mut(c.action) else { return };
        a.remaining -= 1;
        a.failed |= !ok;
        if a.remaining > 0 {
            return;
        }
        let a = self.actions.remove(c.action).expect("present");
        self.outstanding -= 1;
        let ok = !a.failed;
        let latency = self.now - a.start;
        let fast = ok && self.fast_within.is_some_and(|f| latency <= f);
        self.stats.action_done(a.place, ok, fast, self.fan_out, latency);
        if let Load::Closed { think, .. } = self.sc.fleet.load {
            let at = self.now + nanos(think);
            if at < self.horizon {
                self.push(at, Ev::Start(a.instance));
            }
        }
    }

    /// A permit of `unit`'s shared cap came back (a sample for an adaptive cap, which may
    /// have closed a window and moved the working cap): the run's working cap follows.
    #[inline]
    fn note_cap(&mut self, unit: u32) {
        let Some(seen) = self.working_caps.get_mut(unit as usize) else { return };
        let Some(up) = &self.units[unit as usize].upstream else { return };
        let now = up.limiter.effective_cap();
        if now != *seen {
            self.working_cap = self.working_cap + now - *seen;
            *seen = now;
            self.stats.set_cap(self.working_cap);
        }
    }

    // ---- the dependency ----

    #[inline]
    fn dep_in_flight(&mut self, delta: i32) {
        self.dep.in_flight = self.dep.in_flight.wrapping_add_signed(delta);
        self.stats.set_in_flight(self.dep.in_flight);
    }

    /// A server starts on an attempt: its service time is drawn now, under the conditions in
    /// force now, and stretched by `in_flight` (counting this attempt) past the segment's
    /// `workers`. Returns when it will be done.
    #[inline]
    fn start_service(&mut self, att: Ref, in_flight: u64) -> u64 {
        let a = self.attempts.get(att).expect("an attempt at the dependency is in the slab");
        let seg = &self.segs[self.seg];
        let mut rng = SplitMix64::new(a.key ^ SERVICE_SALT);
        let service = match (a.error, seg.error_time) {
            (true, Some(t)) => t.sample(&mut rng),
            _ => seg.service.sample(&mut rng),
        };
        let service = match seg.workers {
            Some(w) if in_flight > u64::from(w) => {
                let stretched = service as f64 * in_flight as f64 / f64::from(w);
                (stretched as u64).clamp(service, STRETCH_MAX.max(service))
            }
            _ => service,
        } + nanos(self.sc.dependency.overhead);
        self.dep.busy += 1;
        let done = self.now + service;
        self.push(done, Ev::Done(att));
        done
    }

    fn fill_servers(&mut self) {
        while self.dep.busy < self.segs[self.seg].capacity {
            let Some(next) = self.dep.queue.pop_front() else { break };
            self.start_service(next, u64::from(self.dep.in_flight));
        }
    }

    fn server_done(&mut self, att: Ref) {
        self.dep.busy -= 1;
        self.dep_in_flight(-1);
        self.fill_servers();
        let Some(mut a) = self.attempts.remove(att) else { return };
        // The provider counts what it served: the prompt, and the output unless it failed.
        if let Some((p, in_run)) = a.reserved.take() {
            let used = if a.error { self.tokens.input } else { self.tokens.used };
            p.settle(self.ts(), Some(used));
            self.stats.tokens_counted(used, in_run);
        }
        if a.waiting {
            let ok = !a.error;
            self.answered(a, ok);
        } else {
            // The client gave up on it: rate admission still hears what the late answer states
            // (as the layer reads it in the background), and it frees the slot it still held.
            self.hear_limits(a.unit, None, a.sent_at);
            if let Some(held) = a.held.take() {
                held.upstream_answered();
            }
        }
    }
}

/// `next_u64() < threshold` as a method, so the outcome draw reads as what it is.
trait BelowThreshold {
    fn next_u64_below(&mut self, threshold: u64) -> bool;
}

impl BelowThreshold for SplitMix64 {
    #[inline]
    fn next_u64_below(&mut self, threshold: u64) -> bool {
        threshold == u64::MAX || self.next_u64() < threshold
    }
}

fn build_units(
    sc: &Scenario,
    p: &PolicyConfig,
    clock: &ManualClock,
) -> Result<Vec<Unit>, RunError> {
    let count = match p.share {
        Share::Fleet => 1,
        Share::Instance => sc.fleet.instances,
    };
    let clock: Arc<dyn Clock> = Arc::new(clock.clone());
    (0..count)
        .map(|_| {
            let breaker = p.breaker.map(Breaker::try_new).transpose()?;
            let hold = Arc::new(PushbackHold::new());
            let upstream = match p.cap {
                None => None,
                Some(c) => Some(Upstream {
                    limiter: Limiter::try_new(c.limiter_config(), clock.clone())?,
                    breaker: breaker.clone(),
                    hold: hold.clone(),
                }),
            };
            let retry_upstream = match p.cap.and_then(|c| c.retry_pool) {
                None => None,
                Some(n) => Some(Upstream {
                    limiter: Limiter::try_new(
                        LimiterConfig { cap: n, queue_len: 0, ..LimiterConfig::default() },
                        clock.clone(),
                    )?,
                    breaker: breaker.clone(),
                    hold: hold.clone(),
                }),
            };
            let (policy, counts_active) = match (&p.retry, p.retry_config(&sc.client)) {
                (RetryRule::Budget { spec, .. }, Some(config)) => {
                    let budget = spec.build()?;
                    (
                        Some(RetryPolicy::with_budget(config, budget)?),
                        matches!(spec, BudgetSpec::Concurrency(_)),
                    )
                }
                _ => (None, false),
            };
            Ok(Unit {
                upstream,
                rate: p.rate.as_ref().map(Meter::new),
                retry_upstream,
                breaker,
                policy,
                counts_active,
                active_primaries: 0,
                waiters: VecDeque::new(),
                queue_timer: false,
                hedge_delay: HedgeDelay::new(),
            })
        })
        .collect()
}

/// The budget's configured share of primaries, for the chart's reference line (ratio budgets
/// only: the concurrency budget's percent is of everything in flight).
pub(crate) fn budget_percent(p: &PolicyConfig) -> Option<f64> {
    match &p.retry {
        RetryRule::Budget { spec: BudgetSpec::Ratio(c), .. } => Some(c.percent.as_f64()),
        _ => None,
    }
}

/// Instance `i` (of `instances`)'s arrival number `k` (0-based), the previous one having come
/// at `now`: an exponential gap drawn from the instance's own stream, the uniform timetable
/// (each instance offset by its share of the period), or the `k`-th recorded instant.
fn next_arrival(
    rng: &mut SplitMix64,
    (rate, arrivals, recorded): (f64, Arrivals, Option<&[u64]>),
    (i, instances): (u32, u32),
    k: u64,
    now: u64,
) -> Option<u64> {
    let period = 1e9 / rate;
    Some(match arrivals {
        Arrivals::Poisson => now + (dist::exponential(rng, period) as u64).max(1),
        Arrivals::Uniform => {
            (period * f64::from(i) / f64::from(instances) + period * k as f64) as u64
        }
        Arrivals::Recorded => *recorded?.get(usize::try_from(k).ok()?)?,
    })
}

/// The user actions an open-loop scenario starts, in time order: when, and from which
/// instance — the very arrivals [`simulate`](crate::simulate) runs every policy on, so a live
/// run can be sent the same ones. `None` for a closed loop, whose arrivals depend on answers.
pub fn arrivals(sc: &Scenario) -> Option<Vec<(Duration, u32)>> {
    let Load::Open { rate, arrivals } = sc.fleet.load else { return None };
    let horizon = dist::nanos(sc.duration);
    let seed = dist::stream_seed(sc.seed, Stream::Arrivals);
    let recorded = sc.fleet.recorded.as_deref();
    let mut out = Vec::new();
    for i in 0..sc.fleet.instances {
        let mut rng = SplitMix64::new(mix(seed, u64::from(i)));
        let (mut now, mut k) = (0, 0);
        while let Some(at) =
            next_arrival(&mut rng, (rate, arrivals, recorded), (i, sc.fleet.instances), k, now)
                .filter(|at| *at < horizon)
        {
            out.push((Duration::from_nanos(at), i));
            (now, k) = (at, k + 1);
        }
    }
    out.sort_unstable();
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slab_reuses_and_misses_stale_handles() {
        let mut s = Slab::new();
        let a = s.insert(1);
        assert_eq!(s.remove(a), Some(1));
        let b = s.insert(2);
        assert_eq!(b.idx, a.idx);
        assert_eq!(s.get(a), None, "a stale handle misses");
        assert_eq!(s.get(b), Some(&2));
        assert_eq!(s.remove(a), None);
        assert_eq!(s.capacity(), 1);
    }

    #[test]
    fn events_come_out_in_time_then_rank_then_order() {
        let mut h = BinaryHeap::new();
        let r = Ref { idx: 0, generation: 0 };
        h.push(Entry { at: 5, order: RANK_BIT | 1, ev: Ev::Timeout(r) });
        h.push(Entry { at: 5, order: 2, ev: Ev::Done(r) });
        h.push(Entry { at: 3, order: RANK_BIT | 3, ev: Ev::Arrival(0) });
        h.push(Entry { at: 5, order: RANK_BIT, ev: Ev::Arrival(1) });
        let order: Vec<_> =
            std::iter::from_fn(|| h.pop()).map(|e| (e.at, e.order & !RANK_BIT)).collect();
        assert_eq!(order, [(3, 3), (5, 2), (5, 0), (5, 1)]);
    }
}
