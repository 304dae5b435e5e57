//! One request's life: the order in which a request's rules run, written once.
//!
//! The rules themselves live beside this module — the decision ([`RetryPolicy::decide`]), the
//! budgets, the limiter, the breaker, backoff, hedging, the scopes. *When* each runs in a
//! request's life is decided here, and only here: every placement (the tower layer, the reqwest
//! middleware, the simulator, and through the tower layer the proxy) holds one [`Life`] per
//! request, tells it what happened — an attempt answered, failed, was refused before it was
//! sent; a backoff ended; a hedge is due; the caller retried on its own — each with the time,
//! and does what it answers: wait, send an admitted attempt, or give the caller its answer.
//! Nothing here waits, reads a clock or touches a socket, in the manner of `h2`'s and
//! `quinn-proto`'s sans-I/O state machines.
//!
//! ```text
//!            first try sent (the cap admitted it: breaker, window, total cap, slot)
//!                  │
//!                  ▼
//!   ┌──────── in flight ◄────────────────────────────┐
//!   │  hedge_due ──► decide_hedge → admit ──► a hedge │ beside it (up to max_hedges)
//!   │                                                 │
//!   ├─ succeeded ──► success (budget told; charges    │
//!   │                 of the winner told "succeeded") │
//!   └─ failed ──► decide (retry_on, request, breaker, │
//!                  pushback, deadline, scopes, budget │ charged now)
//!                  ├─ not retryable / refused ──► answer, with the reason
//!                  └─ Retry { wait } ──► the shell keeps the failed answer,
//!                        backs off, then wait_elapsed:
//!                        total cap → provider's window → upstream slot,
//!                        each now or never; a refusal gives the budget back
//!                        ├─ refused ──► answer (the kept failure), with the reason
//!                        └─ admitted ──► send ───────────────┘
//! ```
//!
//! **Admission, in one order, for every extra attempt** (a retry after its backoff, a hedge, a
//! caller's own retry): the rules charge the scopes and the budget first
//! ([`RetryPolicy::decide`], [`decide_hedge`](RetryPolicy::decide_hedge),
//! [`decide_caller_retry`](RetryPolicy::decide_caller_retry)); then, never waiting, a slot under
//! the dependency's total cap, a turn in the provider's window, and a slot under the upstream's
//! cap. A refusal at any step gives back what the earlier ones took — the charges, the total
//! slot, the booking — and is counted once, as a retry's or a hedge's. In shadow mode a refusal
//! by the total cap or the window is counted and the attempt goes without it, as the upstream's
//! cap already does ([`RetryPolicy::admit`]).
//!
//! What a placement lends the life is a [`Gates`]: the policy, the upstreams, the total cap and
//! the provider's window, each read synchronously.

use std::time::Duration;

use crate::budget::FailureKind;
use crate::clock::Timestamp;
use crate::decision::{
    AdmittedRetry, Decision, FailedAttempt, RequestFacts, RetryCharges, RetryPolicy, RetryState,
    RetryTicket, Upstream,
};
use crate::denied::Denied;
use crate::limiter::{AttemptKind, Limiter, Permit};
use crate::random::RandomSource;
use crate::scope::Scope;
use crate::tree::TreeContext;

/// What a placement lends a request's life: one dependency's rules and shared state. Nothing
/// here waits: a slot or a turn is had now, or not.
pub trait Gates {
    /// A turn booked in an upstream's rate window (the provider's requests and tokens per
    /// minute), for the attempt about to be sent.
    type Booking;

    /// The dependency's retry rules, budget and counters.
    fn policy(&self) -> &RetryPolicy;

    /// Upstream `target`'s cap, breaker and pushback hold (0 with a single upstream).
    fn upstream(&self, target: usize) -> &Upstream;

    /// Where another attempt goes after one on `failed` (a retry, or a hedge beside it). With
    /// one upstream, the same.
    fn failover(&self, failed: usize, now: Timestamp) -> usize {
        let _ = now;
        failed
    }

    /// The total cap across the upstreams, when there is one.
    fn total(&self) -> Option<&Limiter> {
        None
    }

    /// A turn in `target`'s window now or never: `Ok(None)` without rate admission,
    /// `Err(Denied::Rate)` when there is no room now.
    fn book_now(&self, target: usize, now: Timestamp) -> Result<Option<Self::Booking>, Denied>;

    /// A booking whose attempt will not be sent after all goes back.
    fn refund(&self, booking: Self::Booking, now: Timestamp);
}

/// Which attempt of a request: 0 is its first (or a caller's own retry it arrived as), then
/// each retry and hedge in the order they were admitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct AttemptId(pub u32);

impl AttemptId {
    /// The request's first attempt.
    pub const FIRST: AttemptId = AttemptId(0);
}

/// What kind of extra attempt was admitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Extra {
    /// A retry, after a failure and its wait.
    Retry,
    /// A hedge, beside an attempt still unanswered.
    Hedge,
}

/// An attempt admitted: send it now, holding what it was admitted with until it ends.
#[derive(Debug)]
#[must_use = "send the attempt, or drop it (its slots and booking come back)"]
pub struct Admitted<K> {
    /// The attempt, to name it in what the life is told next.
    pub id: AttemptId,
    /// A retry or a hedge.
    pub extra: Extra,
    /// Its number as the request's headers carry it (`x-stormguard-attempt`): 2 for the first
    /// retry, and for the first hedge (marked `; hedge`).
    pub number: u32,
    /// The upstream it goes to.
    pub target: usize,
    /// Its slot under the upstream's cap (`None`: a shadow-mode attempt the cap refused).
    pub permit: Option<Permit>,
    /// Its slot under the total cap, when there is one (`None` as above in shadow mode).
    pub total: Option<Permit>,
    /// Its turn in the provider's window, under rate admission.
    pub booking: Option<K>,
    /// The call tree's context it carries to the hops below, when the request arrived with one
    /// ([`Life::with_tree`]): one more spent on the path for a retry or a hedge sent here; for a
    /// caller's retry, one more only if it was a tree original (a hop above that sent it as an
    /// extra counted it already).
    pub tree: Option<TreeContext>,
}

/// What to do after a failed attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Next {
    /// Give the caller this failure: `None` when it is not one to retry (not in `retry_on`, or
    /// retries are off), else the reason its retry was refused.
    Answer(Option<Denied>),
    /// Keep the failed answer (the caller gets it if the retry is refused later), wait this
    /// long, then call [`Life::wait_elapsed`]. The retry goes to upstream `target`.
    Retry {
        /// The backoff, or the dependency's own word (`Retry-After`).
        wait: Duration,
        /// The upstream it will go to.
        target: usize,
    },
}

/// A caller's own retry refused: why, and whether it was refused while being admitted (after
/// the rules let it through and the budget was asked) rather than by the rules.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Refused {
    /// The reason.
    pub reason: Denied,
    /// Refused by the total cap, the window or the slot, after the budget was charged.
    pub admitting: bool,
}

/// A retry decided and waiting for its backoff.
#[derive(Debug)]
struct Pending {
    ticket: RetryTicket,
    target: usize,
}

/// An extra attempt in flight.
#[derive(Debug)]
struct Inflight {
    id: AttemptId,
    extra: Extra,
    target: usize,
    charges: RetryCharges,
}

/// One request's life, from its first attempt to its answer. See the [module docs](self).
#[derive(Debug)]
pub struct Life {
    facts: RequestFacts,
    scopes: Vec<Scope>,
    state: RetryState,
    /// Extra attempts admitted so far (the next one's id is this plus one).
    admitted: u32,
    /// The upstream the first attempt went to.
    first_target: usize,
    /// The request arrived as its caller's own retry.
    caller_retry: bool,
    /// The call tree's context the request arrived with.
    tree: Option<TreeContext>,
    /// The extra attempts in flight: where each went, and what it holds of the budget and
    /// the scopes.
    inflight: Vec<Inflight>,
    pending: Option<Pending>,
}

impl Life {
    /// A request whose first attempt went to upstream `target`: its facts (idempotent,
    /// replayable, stacked, deadline) and the scopes its retries and hedges are charged to
    /// (its fan-out, then its route).
    pub fn new(facts: RequestFacts, scopes: Vec<Scope>, target: usize) -> Life {
        Life {
            facts,
            scopes,
            state: RetryState::default(),
            admitted: 0,
            first_target: target,
            caller_retry: false,
            tree: None,
            inflight: Vec::new(),
            pending: None,
        }
    }

    /// The life of a request that arrived with a call tree's context (its [`Scope::Tree`] among
    /// the scopes): each extra attempt carries it below with one more spent
    /// ([`Admitted::tree`]).
    pub fn with_tree(mut self, tree: Option<TreeContext>) -> Life {
        self.tree = tree;
        self
    }

    /// A request that is its caller's own retry — the caller's `number`th attempt, repeating a
    /// failure of `kind` — to upstream `target`: the load rules a retry of stormguard's own
    /// meets ([`RetryPolicy::decide_caller_retry`]: breaker, pushback hold, scopes, budget),
    /// then admission as any extra attempt's, never waiting. Its slots, if admitted, are
    /// the request's first; the request is stacked (not retried again while `deny_stacked`).
    ///
    /// `tree` is the call tree's context it arrived with (its [`Scope::Tree`] among `scopes`).
    /// A retry a hop above sent as an extra (`spent > 0`) was charged to the tree there: it is
    /// admitted without the tree's charge and, once admitted, enters the ledger as an extra
    /// from above; the retries of its own here are charged to the tree as any are.
    #[allow(clippy::too_many_arguments)]
    pub fn caller_retry<G: Gates>(
        gates: &G,
        now: Timestamp,
        facts: RequestFacts,
        scopes: Vec<Scope>,
        tree: Option<TreeContext>,
        target: usize,
        number: u32,
        kind: FailureKind,
    ) -> (Life, Result<Admitted<G::Booking>, Refused>) {
        let mut life =
            Life::new(RequestFacts { stacked: true, ..facts }, scopes, target).with_tree(tree);
        life.caller_retry = true;
        let policy = gates.policy();
        let above = tree.filter(|t| !t.is_original());
        let untreed: Vec<Scope>;
        let charged = match above {
            Some(_) => {
                untreed = life.scopes.iter().filter(|s| !s.is_tree()).cloned().collect();
                &untreed[..]
            }
            None => &life.scopes[..],
        };
        let ticket = match policy.decide_caller_retry(now, gates.upstream(target), kind, charged) {
            Ok(ticket) => ticket,
            Err(reason) => return (life, Err(Refused { reason, admitting: false })),
        };
        let admitted = life
            .admit(gates, now, ticket, target, Extra::Retry)
            // Numbered as its caller numbered it; an extra only if it was a tree original.
            .map(|a| Admitted { number, tree: tree.map(|t| t.below(t.is_original())), ..a })
            .map_err(|reason| Refused { reason, admitting: true });
        if let (Some(ctx), Ok(_)) = (above, &admitted) {
            for scope in &life.scopes {
                if let Scope::Tree(ledger) = scope {
                    ledger.arrived(now, &ctx);
                }
            }
        }
        (life, admitted)
    }

    /// The request's facts as the rules read them.
    pub fn facts(&self) -> &RequestFacts {
        &self.facts
    }

    /// Whether the request's body can still be sent again (a body copied while it is sent may
    /// have outgrown what is kept of it).
    pub fn set_replayable(&mut self, replayable: bool) {
        self.facts.replayable = replayable;
    }

    /// Retries sent so far, and hedges.
    pub fn state(&self) -> &RetryState {
        &self.state
    }

    /// The upstream attempt `id` went to.
    pub fn target_of(&self, id: AttemptId) -> usize {
        self.inflight.iter().find(|a| a.id == id).map_or(self.first_target, |a| a.target)
    }

    /// Attempt `id` answered with a success: the request's answer. The budget hears it (a
    /// success on any attempt but a plain first try is a retried one), the attempt's charges
    /// are told (a quota budget refunds a successful retry), and a hedge that won is counted.
    pub fn succeeded(
        &mut self,
        policy: &RetryPolicy,
        now: impl FnOnce() -> Timestamp,
        id: AttemptId,
    ) {
        let retried = id != AttemptId::FIRST || self.caller_retry;
        policy.on_success_with(now, retried);
        if let Some(a) = self.inflight.iter_mut().find(|a| a.id == id) {
            a.charges.succeeded();
            if a.extra == Extra::Hedge {
                policy.counters().hedge_won();
            }
        }
    }

    /// Attempt `id` has ended without deciding anything (it lost a race, or failed while
    /// another attempt of the request is still awaited): what it held of the budget and the
    /// scopes ends with it (a concurrency budget counts it no more).
    pub fn ended(&mut self, id: AttemptId) {
        self.inflight.retain(|a| a.id != id);
    }

    /// Attempt `id` was refused after it was admitted, before it reached the dependency (a
    /// breaker's probe taken meanwhile): its budget and scope charges go back.
    pub fn unsent(&mut self, policy: &RetryPolicy, now: Timestamp, id: AttemptId) {
        if let Some(k) = self.inflight.iter().position(|a| a.id == id) {
            let a = self.inflight.swap_remove(k);
            policy.refund(now, a.charges);
        }
    }

    /// Attempt `id` failed, and no other attempt of the request is awaited: the decision
    /// ([`RetryPolicy::decide`]) for a retry to the upstream it fails over to (from the failed
    /// attempt's), charging the scopes and the budget now. The failed attempt's own charges end
    /// first.
    pub fn failed<G: Gates>(
        &mut self,
        gates: &G,
        now: Timestamp,
        id: AttemptId,
        failed: &FailedAttempt,
        rng: &mut (impl RandomSource + ?Sized),
    ) -> Next {
        let from = self.target_of(id);
        self.ended(id);
        self.drop_pending(gates.policy(), now);
        let next = gates.failover(from, now);
        let decision = gates.policy().decide(
            now,
            gates.upstream(next),
            &self.facts,
            &mut self.state,
            failed,
            &self.scopes,
            rng,
        );
        match decision {
            Decision::NotRetryable => Next::Answer(None),
            Decision::Denied(reason) => Next::Answer(Some(reason)),
            Decision::Retry(ticket) => {
                let wait = ticket.wait();
                self.pending = Some(Pending { ticket, target: next });
                Next::Retry { wait, target: next }
            }
        }
    }

    /// The retry decided will not be sent after all — its failed answer could not be kept, or
    /// the body cannot be copied: its charges go back, and nothing is counted as a refusal.
    pub fn give_up(&mut self, policy: &RetryPolicy, now: Timestamp) {
        self.drop_pending(policy, now);
    }

    fn drop_pending(&mut self, policy: &RetryPolicy, now: Timestamp) {
        if let Some(p) = self.pending.take() {
            policy.give_up(now, p.ticket);
        }
    }

    /// The retry's wait has ended: it is admitted now or never (total cap, window, slot).
    /// `Err` with the reason gives the caller the kept failure.
    ///
    /// # Panics
    /// When no retry is waiting (only [`Next::Retry`] asks for this call).
    pub fn wait_elapsed<G: Gates>(
        &mut self,
        gates: &G,
        now: Timestamp,
    ) -> Result<Admitted<G::Booking>, Denied> {
        let Pending { ticket, target } = self.pending.take().expect("a retry waiting");
        self.admit(gates, now, ticket, target, Extra::Retry)
    }

    /// Attempt `id` has not answered after the hedge delay: a hedge beside it (to the upstream
    /// after `id`'s), if the rules allow
    /// one now ([`RetryPolicy::decide_hedge`]: idempotent, replayable, `max_hedges`, not
    /// stacked, breaker, hold, deadline, scopes and budget) and admission has room for it now.
    /// `None`: no hedge (not one to hedge, or refused — counted as a hedge's refusal).
    pub fn hedge_due<G: Gates>(
        &mut self,
        gates: &G,
        now: Timestamp,
        id: AttemptId,
    ) -> Result<Admitted<G::Booking>, Option<Denied>> {
        let target = gates.failover(self.target_of(id), now);
        let policy = gates.policy();
        match policy.decide_hedge(
            now,
            gates.upstream(target),
            &self.facts,
            &self.state,
            &self.scopes,
        ) {
            Decision::NotRetryable => Err(None),
            Decision::Denied(reason) => Err(Some(reason)),
            Decision::Retry(ticket) => {
                self.admit(gates, now, ticket, target, Extra::Hedge).map_err(Some)
            }
        }
    }

    /// Whether another hedge may still be sent (`max_hedges` not reached).
    pub fn may_hedge(&self, policy: &RetryPolicy) -> bool {
        policy.config().hedge.is_some_and(|h| self.state.hedges < h.max_hedges)
    }

    /// Admission, now or never, in its one order: the total cap, the provider's window, the
    /// upstream's slot. A refusal gives back what was taken and is counted (as a hedge's
    /// refusal for a hedge).
    fn admit<G: Gates>(
        &mut self,
        gates: &G,
        now: Timestamp,
        ticket: RetryTicket,
        target: usize,
        extra: Extra,
    ) -> Result<Admitted<G::Booking>, Denied> {
        let policy = gates.policy();
        let refused = |ticket: RetryTicket, reason: Denied| {
            policy.give_up(now, ticket);
            match extra {
                Extra::Retry => policy.counters().denied(reason),
                Extra::Hedge => policy.counters().hedge_denied(reason),
            }
            reason
        };
        // 1. The total cap across the upstreams.
        let total = match gates.total().map(|t| t.try_acquire_at(AttemptKind::Retry, now)) {
            None => None,
            Some(Ok(p)) => Some(p),
            Some(Err(reason)) if policy.enforce() => return Err(refused(ticket, reason)),
            Some(Err(reason)) => {
                policy.counters().shadow_denied(reason);
                None
            }
        };
        // 2. The provider's window: room now, or no attempt (it never waits for a turn).
        let booking = match gates.book_now(target, now) {
            Ok(b) => b,
            Err(reason) if policy.enforce() => {
                drop(total);
                return Err(refused(ticket, reason));
            }
            Err(reason) => {
                policy.counters().shadow_denied(reason);
                None
            }
        };
        // 3. The upstream's slot, with `try_acquire` (it refunds the charges and counts a
        // refusal itself).
        let upstream = gates.upstream(target);
        let admitted: Result<AdmittedRetry, Denied> = match extra {
            Extra::Retry => policy.admit(upstream, ticket, &mut self.state),
            Extra::Hedge => policy.admit_hedge(upstream, ticket, &mut self.state),
        };
        let mut admitted = match admitted {
            Ok(a) => a,
            Err(reason) => {
                if let Some(b) = booking {
                    gates.refund(b, now);
                }
                return Err(reason);
            }
        };
        self.admitted += 1;
        let id = AttemptId(self.admitted);
        let number = match extra {
            Extra::Retry => self.state.retries + 1,
            Extra::Hedge => self.state.hedges + 1,
        };
        let permit = admitted.take_permit();
        self.inflight.push(Inflight { id, extra, target, charges: admitted.into_charges() });
        let tree = self.tree.map(|t| t.below(true));
        Ok(Admitted { id, extra, number, target, permit, total, booking, tree })
    }
}

#[cfg(all(test, not(stormguard_loom)))]
mod tests {
    use std::cell::Cell;
    use std::sync::Arc;

    use super::*;
    use crate::budget::BudgetSpec;
    use crate::clock::{Clock, ManualClock};
    use crate::conditions::AttemptFailure;
    use crate::decision::RetryConfig;
    use crate::hedge::{HedgeAfter, HedgeConfig};
    use crate::limiter::LimiterConfig;
    use crate::random::SplitMix64;

    /// A dependency with one upstream (cap 2), an optional total cap, and a window of `room`
    /// turns (`None`: no rate admission).
    struct World {
        clock: ManualClock,
        policy: RetryPolicy,
        upstream: Upstream,
        total: Option<Limiter>,
        room: Option<Cell<u32>>,
    }

    /// Exactly one retry in the budget.
    const ONE: &str = "ratio:percent=0,min_per_sec=0.1,ttl=10s";

    fn world(config: RetryConfig, total: Option<u64>, room: Option<u32>) -> World {
        let clock = ManualClock::new();
        let cap = |cap| LimiterConfig { cap, queue_len: 0, ..Default::default() };
        let upstream = Upstream::new(cap(2), None, Arc::new(clock.clone())).unwrap();
        let total = total.map(|n| Limiter::try_new(cap(n), Arc::new(clock.clone())).unwrap());
        let budget = BudgetSpec::parse(ONE).unwrap().build().unwrap();
        let policy = RetryPolicy::with_budget(config, budget).unwrap();
        World { clock, policy, upstream, total, room: room.map(Cell::new) }
    }

    impl Gates for World {
        type Booking = u32;
        fn policy(&self) -> &RetryPolicy {
            &self.policy
        }
        fn upstream(&self, _: usize) -> &Upstream {
            &self.upstream
        }
        fn total(&self) -> Option<&Limiter> {
            self.total.as_ref()
        }
        fn book_now(&self, _: usize, _: Timestamp) -> Result<Option<u32>, Denied> {
            match &self.room {
                None => Ok(None),
                Some(r) if r.get() == 0 => Err(Denied::Rate),
                Some(r) => {
                    r.set(r.get() - 1);
                    Ok(Some(1))
                }
            }
        }
        fn refund(&self, booking: u32, _: Timestamp) {
            if let Some(r) = &self.room {
                r.set(r.get() + booking);
            }
        }
    }

    impl World {
        fn now(&self) -> Timestamp {
            self.clock.now()
        }

        /// A request whose first attempt just failed with a 503: its life and what it said.
        fn failed(&self) -> (Life, Next) {
            let mut life = Life::new(RequestFacts::idempotent(), Vec::new(), 0);
            let failed = FailedAttempt::from(AttemptFailure::Status(503));
            let next =
                life.failed(self, self.now(), AttemptId::FIRST, &failed, &mut SplitMix64::new(1));
            (life, next)
        }

        /// A caller's own retry (its `number`th attempt, after a 503) of an idempotent request
        /// to upstream 0, with `scopes` and the call tree's context `tree`: its life and its
        /// admission.
        fn caller_retry(
            &self,
            scopes: Vec<Scope>,
            tree: Option<TreeContext>,
            number: u32,
        ) -> (Life, Result<Admitted<u32>, Refused>) {
            let (facts, kind) = (RequestFacts::idempotent(), AttemptFailure::Status(503).kind());
            Life::caller_retry(self, self.now(), facts, scopes, tree, 0, number, kind)
        }

        /// Whether the budget has a retry left (asked and given back).
        fn budget_left(&self) -> bool {
            match self.policy.budget().try_retry(self.now(), AttemptFailure::Timeout.kind()) {
                Ok(p) => {
                    self.policy.budget().refund(self.now(), p);
                    true
                }
                Err(_) => false,
            }
        }
    }

    /// The one order: rules (budget charged), then total cap, window, slot — and every refusal
    /// gives back what the steps before it took.
    #[test]
    fn a_retry_is_admitted_in_one_order_and_a_refusal_gives_back_what_it_took() {
        // Admitted: a slot under each cap and a turn in the window.
        let w = world(RetryConfig::default(), Some(4), Some(1));
        let (mut life, next) = w.failed();
        let Next::Retry { wait, target: 0 } = next else { panic!("{next:?}") };
        assert!(!w.budget_left(), "the budget is charged when the retry is decided");
        w.clock.advance(wait);
        let a = life.wait_elapsed(&w, w.now()).unwrap();
        assert_eq!((a.id, a.extra, a.number), (AttemptId(1), Extra::Retry, 2));
        assert!(a.permit.is_some() && a.total.is_some() && a.booking == Some(1));
        assert_eq!(w.room.as_ref().unwrap().get(), 0);

        // The window has no room: the budget is given back, no slot is held.
        let w = world(RetryConfig::default(), Some(4), Some(0));
        let (mut life, _) = w.failed();
        assert_eq!(life.wait_elapsed(&w, w.now()).unwrap_err(), Denied::Rate);
        assert!(w.budget_left(), "a retry the window refused charges nothing");
        assert_eq!(w.total.as_ref().unwrap().in_flight(), 0, "the total slot came back");
        assert_eq!(w.policy.counters().snapshot().denied[Denied::Rate.index()], 1);

        // The upstream's cap is full: the booking and the budget are given back.
        let w = world(RetryConfig::default(), None, Some(1));
        let held: Vec<_> =
            (0..2).map(|_| w.upstream.limiter.try_acquire(AttemptKind::Primary).unwrap()).collect();
        let (mut life, _) = w.failed();
        assert_eq!(life.wait_elapsed(&w, w.now()).unwrap_err(), Denied::Cap);
        assert_eq!(w.room.as_ref().unwrap().get(), 1, "the booking was refunded");
        assert!(w.budget_left());
        drop(held);

        // The total cap is full: refused before the window is asked.
        let w = world(RetryConfig::default(), Some(1), Some(1));
        let _other = w.total.as_ref().unwrap().try_acquire(AttemptKind::Primary).unwrap();
        let (mut life, _) = w.failed();
        assert_eq!(life.wait_elapsed(&w, w.now()).unwrap_err(), Denied::Cap);
        assert_eq!(w.room.as_ref().unwrap().get(), 1, "the window was never asked");
        assert!(w.budget_left());
    }

    /// Shadow mode lets through what the total cap and the window would refuse, counted.
    #[test]
    fn shadow_mode_counts_the_window_and_lets_the_retry_go() {
        let w = world(RetryConfig { enforce: false, ..RetryConfig::default() }, None, Some(0));
        let (mut life, _) = w.failed();
        let a = life.wait_elapsed(&w, w.now()).unwrap();
        assert!(a.booking.is_none() && a.permit.is_some());
        assert_eq!(w.policy.counters().snapshot().shadow_denied[Denied::Rate.index()], 1);
    }

    /// A retry given up (its answer too large to keep) and one refused late (a breaker's probe)
    /// both give the budget back; a failure while another attempt is awaited decides nothing.
    #[test]
    fn what_is_not_sent_is_not_paid_for() {
        let w = world(RetryConfig::default(), None, None);
        let (mut life, _) = w.failed();
        life.give_up(&w.policy, w.now());
        assert!(w.budget_left());

        let (mut life, _) = w.failed();
        let a = life.wait_elapsed(&w, w.now()).unwrap();
        assert!(!w.budget_left());
        life.unsent(&w.policy, w.now(), a.id);
        assert!(w.budget_left(), "refused before it reached the dependency: given back");
    }

    /// Hedges: up to `max_hedges`, numbered from 2, admitted like retries, and a won hedge is
    /// counted and its success is a retried one.
    #[test]
    fn hedges_are_admitted_up_to_max_hedges_and_counted_when_they_win() {
        let mut config = RetryConfig::default();
        config.hedge = Some(HedgeConfig {
            after: HedgeAfter::Fixed(Duration::from_millis(10)),
            max_hedges: 1,
        });
        let w = world(config, None, None);
        let mut life = Life::new(RequestFacts::idempotent(), Vec::new(), 0);
        assert!(life.may_hedge(&w.policy));
        let h = life.hedge_due(&w, w.now(), AttemptId::FIRST).unwrap();
        assert_eq!((h.id, h.extra, h.number), (AttemptId(1), Extra::Hedge, 2));
        assert!(!life.may_hedge(&w.policy));
        assert_eq!(
            life.hedge_due(&w, w.now(), AttemptId::FIRST).unwrap_err(),
            Some(Denied::Attempts)
        );
        life.succeeded(&w.policy, || w.now(), h.id);
        let c = w.policy.counters().snapshot();
        assert_eq!((c.hedges, c.hedges_won), (1, 1));
    }

    /// A caller's own retry: the load rules, then admission; numbered as the caller numbered
    /// it, stacked, and refused at once when the budget is spent.
    #[test]
    fn a_callers_retry_is_admitted_or_refused_at_once() {
        let w = world(RetryConfig::default(), None, Some(1));
        let (life, a) = w.caller_retry(Vec::new(), None, 3);
        let a = a.unwrap();
        assert_eq!(a.number, 3);
        assert!(life.facts().stacked);
        let (_, refused) = w.caller_retry(Vec::new(), None, 2);
        assert_eq!(refused.unwrap_err(), Refused { reason: Denied::Budget, admitting: false });
        drop(a);
    }

    /// The context each attempt carries below: a retry here one more spent than the request
    /// came with; a caller's retry one more only when it came as a tree original; a request
    /// without a context, none.
    #[test]
    fn an_extra_carries_the_tree_below_with_one_more_spent() {
        use crate::tree::TreeContext;
        let w = world(RetryConfig::default(), None, None);
        let came: TreeContext = "1.5;spent=1;id=ab".parse().unwrap();
        let failed = FailedAttempt::from(AttemptFailure::Status(503));
        let mut life = Life::new(RequestFacts::idempotent(), Vec::new(), 0).with_tree(Some(came));
        let next = life.failed(&w, w.now(), AttemptId::FIRST, &failed, &mut SplitMix64::new(1));
        let Next::Retry { wait, .. } = next else { panic!("{next:?}") };
        w.clock.advance(wait);
        let a = life.wait_elapsed(&w, w.now()).unwrap();
        assert_eq!(a.tree, Some(came.below(true)));
        assert_eq!(a.tree.map(|t| (t.spent, t.id)), Some((2, came.id)));
        let fresh = world(RetryConfig::default(), None, None);
        let (mut none, next) = fresh.failed();
        let Next::Retry { wait, .. } = next else { panic!("{next:?}") };
        fresh.clock.advance(wait);
        assert_eq!(none.wait_elapsed(&fresh, fresh.now()).unwrap().tree, None);
        let original: TreeContext = "1.5".parse().unwrap();
        for (ctx, carried) in [(came, came), (original, original.below(true))] {
            let w = world(RetryConfig::default(), None, None);
            let (_, a) = w.caller_retry(Vec::new(), Some(ctx), 2);
            assert_eq!(a.unwrap().tree, Some(carried), "{ctx}");
        }
    }

    /// A caller's retry a hop above sent as an extra is not charged to the tree again: it is
    /// admitted on an empty ledger and enters it as an extra from above; this hop's callers'
    /// own retry (`spent = 0`) is charged, and refused `tree` when the ledger has no room.
    #[test]
    fn a_callers_retry_charged_above_is_not_charged_to_the_tree_again() {
        use crate::tree::{TreeContext, TreeLedger};
        let w = world(RetryConfig::default(), None, None);
        let ledger = TreeLedger::default();
        let scopes = vec![Scope::Tree(ledger.clone())];
        let above: TreeContext = "1.2;spent=1".parse().unwrap();
        let (_, a) = w.caller_retry(scopes.clone(), Some(above), 2);
        assert!(a.is_ok(), "{a:?}");
        assert_eq!((ledger.counts().extras_above, ledger.counts().charged), (1, 0));
        let own: TreeContext = "1.2".parse().unwrap();
        let (_, refused) = w.caller_retry(scopes, Some(own), 2);
        assert_eq!(refused.unwrap_err(), Refused { reason: Denied::Tree, admitting: false });
    }
}
