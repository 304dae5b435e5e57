//! The retry decision, in one place: every placement (tower, the proxy, the simulator) asks
//! [`RetryPolicy::decide`] and gets the same answer for the same facts.
//!
//! On a failed attempt the checks run in this order (docs/rules.md), and the first refusal wins
//! and is the reason:
//!
//! 1. the failure is not in `retry_on` → no retry ([`Decision::NotRetryable`], not a denial);
//! 2. [`Denied::NonIdempotent`], [`Denied::Body`], [`Denied::Attempts`], [`Denied::Stacked`];
//! 3. [`Denied::Breaker`] (open, or half-open with its probes in use);
//! 4. [`Denied::Pushback`] (the server said not to retry, asked for longer than `max_pushback`,
//!    or a hold set by an earlier response to the upstream is active);
//! 5. [`Denied::Deadline`] (the wait plus the minimum attempt time passes the deadline);
//! 6. [`Denied::Scope`] (a fan-out or route scope is spent) or [`Denied::Tree`] (the call
//!    tree's allowance is, [`crate::tree`]), then [`Denied::Budget`], all charged now;
//! 7. after the wait, [`RetryPolicy::admit`] asks the limiter with `try_acquire`, never waiting:
//!    [`Denied::Cap`] refunds the scope and budget charges, since the retry was never sent.
//!
//! **Shadow mode** (`enforce = false`) runs every check and counts the first refusal it would
//! have made (in [`CountersSnapshot::shadow_denied`](crate::signals::CountersSnapshot)), but
//! lets the retry through — except for the request's own rules (`non-idempotent`, `body`,
//! `attempts`, `stacked`), which hold in every mode: without them a shadow retry could pay
//! twice or retry a failing upstream forever: it measures a service's natural retry ratio before a budget is
//! imposed. A shadow retry the cap would refuse is sent without a slot.
//!
//! **Runtime switches.** [`RetryPolicy::set_enforce`] turns shadow mode on or off while the
//! policy runs, and [`RetryPolicy::set_retries_enabled`] is a kill switch: while retries are
//! off, every failed attempt is answered [`Decision::NotRetryable`] (counted as not retryable;
//! the budget still hears the failure). Both take effect on the next decision.
//!
//! ```
//! use std::sync::Arc;
//! use std::time::Duration;
//! use stormguard_core::budget::BudgetSpec;
//! use stormguard_core::clock::{Clock, ManualClock};
//! use stormguard_core::conditions::AttemptFailure;
//! use stormguard_core::decision::{Decision, FailedAttempt, RequestFacts, RetryConfig, RetryPolicy, RetryState, Upstream};
//! use stormguard_core::limiter::{AttemptKind, LimiterConfig};
//! use stormguard_core::random::SplitMix64;
//!
//! let clock = ManualClock::new();
//! let upstream = Upstream::new(LimiterConfig::default(), None, Arc::new(clock.clone()))?;
//! let budget = BudgetSpec::parse("ratio:percent=0.25,min_per_sec=3")?.build()?;
//! let policy = RetryPolicy::try_new(RetryConfig::default(), Arc::new(budget))?;
//! let mut rng = SplitMix64::new(7);
//!
//! let first = upstream.limiter.try_acquire(AttemptKind::Primary)?;
//! policy.on_admitted(clock.now());
//! drop(first); // the attempt came back with a 503
//! let mut state = RetryState::default();
//! let failed = FailedAttempt::from(AttemptFailure::Status(503));
//! match policy.decide(clock.now(), &upstream, &RequestFacts::idempotent(), &mut state, &failed, &[], &mut rng) {
//!     Decision::Retry(ticket) => {
//!         clock.advance(ticket.wait()); // sleep through the backoff
//!         let retry = policy.admit(&upstream, ticket, &mut state)?; // the retry's own slot
//!         assert!(retry.permit().is_some());
//!     }
//!     other => panic!("{other:?}"),
//! }
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use crate::error::ConfigError;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use crate::backoff::{Backoff, BackoffConfig, Pushback, PushbackHold, PushbackPolicy};
use crate::breaker::{Breaker, BreakerConfig};
use crate::budget::{AnyBudget, Outcome, RetryBudget, RetryPermit};
use crate::clock::{Clock, Timestamp};
use crate::conditions::{AttemptFailure, RetryOn};
use crate::denied::Denied;
use crate::hedge::HedgeAfter;
use crate::limiter::{AttemptKind, Limiter, LimiterConfig, Permit};
use crate::random::RandomSource;
use crate::scope::{Scope, ScopeCharge};
use crate::signals::Counters;
use crate::sync::{AtomicBool, Ordering};
use crate::tree::{TreeContext, TreeLedger};

/// The most retries a policy may allow per request.
pub const MAX_RETRIES_LIMIT: u32 = 10;

/// Parameters of a [`RetryPolicy`].
#[derive(Debug, Clone, PartialEq)]
pub struct RetryConfig {
    /// The failures that may be retried. Default `5xx,reset,connect-failure,refused-stream,timeout`
    /// (a timeout only for an idempotent request, like any failure after the request was written).
    pub retry_on: RetryOn,
    /// Retries per request, `0..=10`. Default 2.
    pub max_retries: u32,
    /// Refuse to retry a request that arrived already marked as a retry by another layer
    /// (`x-stormguard-attempt`, `x-envoy-attempt-count` or `grpc-previous-rpc-attempts` > 1), so
    /// retries do not multiply across layers. Default true.
    pub deny_stacked: bool,
    /// The least time an attempt needs; a retry whose wait plus this passes the deadline is
    /// refused. Default 5 ms.
    pub min_attempt_time: Duration,
    /// Backoff between attempts. Default 25 ms doubling to 250 ms, full jitter.
    pub backoff: BackoffConfig,
    /// How server pushback is honoured. Default `max_pushback` 300 s.
    pub pushback: PushbackPolicy,
    /// `false` is shadow mode: count what would be denied, deny nothing. Default true.
    pub enforce: bool,
    /// Hedged requests (see [`crate::hedge`]), paid from the same budget. Default none.
    pub hedge: Option<crate::hedge::HedgeConfig>,
}

impl Default for RetryConfig {
    fn default() -> Self {
        use crate::defaults;
        RetryConfig {
            retry_on: RetryOn::default(),
            max_retries: defaults::MAX_RETRIES,
            deny_stacked: defaults::DENY_STACKED,
            min_attempt_time: defaults::MIN_ATTEMPT_TIME,
            backoff: BackoffConfig::default(),
            pushback: PushbackPolicy::default(),
            enforce: defaults::ENFORCE,
            hedge: None,
        }
    }
}

impl RetryConfig {
    /// Checks every rule, returning the first broken one.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.max_retries > MAX_RETRIES_LIMIT {
            return Err(ConfigError::TooLarge {
                key: "max_retries",
                max: MAX_RETRIES_LIMIT.to_string(),
                got: self.max_retries.to_string(),
            });
        }
        self.backoff.validate()?;
        if let Some(h) = &self.hedge {
            h.validate()?;
        }
        self.pushback.validate()
    }
}

/// The request's own rules hold in shadow mode too: shadow mode measures the budget, and must
/// not resend a payment (`non-idempotent`), a body it cannot replay, or retry without end
/// (`attempts`, `stacked`).
fn always_enforced(reason: Denied) -> bool {
    matches!(reason, Denied::NonIdempotent | Denied::Body | Denied::Attempts | Denied::Stacked)
}

/// What one upstream shares among its callers: the limiter (its cap), the breaker, and the
/// pushback hold.
#[derive(Debug, Clone)]
pub struct Upstream {
    /// Attempts in flight to this upstream, first tries and retries alike.
    pub limiter: Limiter,
    /// The circuit breaker, if configured.
    pub breaker: Option<Breaker>,
    /// Retries held by the upstream's pushback.
    pub hold: Arc<PushbackHold>,
}

impl Upstream {
    /// An upstream with a limiter and an optional breaker, reading time from `clock`.
    pub fn new(
        limiter: LimiterConfig,
        breaker: Option<BreakerConfig>,
        clock: Arc<dyn Clock>,
    ) -> Result<Upstream, ConfigError> {
        Ok(Upstream {
            limiter: Limiter::try_new(limiter, clock)?,
            breaker: breaker.map(Breaker::try_new).transpose()?,
            hold: Arc::new(PushbackHold::new()),
        })
    }
}

/// What is known about a request, for the checks that depend on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestFacts {
    /// GET, HEAD, OPTIONS, TRACE, PUT, DELETE; a request with an idempotency key; or a route or
    /// method marked idempotent.
    pub idempotent: bool,
    /// The body was fully kept and can be sent again.
    pub replayable: bool,
    /// The request arrived already marked as a retry by another layer.
    pub stacked: bool,
    /// When the caller stops waiting, if it said.
    pub deadline: Option<Timestamp>,
}

impl RequestFacts {
    /// An idempotent, replayable, unmarked request without a deadline.
    pub fn idempotent() -> RequestFacts {
        RequestFacts { idempotent: true, replayable: true, stacked: false, deadline: None }
    }
}

/// How an attempt failed, with what the dependency said about it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FailedAttempt {
    /// The failure.
    pub failure: AttemptFailure,
    /// The request provably never reached the dependency's application beyond what the failure
    /// itself proves (e.g. a GOAWAY whose last-stream-id is below the stream).
    pub unsent: bool,
    /// What the dependency said about retrying, if anything.
    pub pushback: Option<Pushback>,
}

impl From<AttemptFailure> for FailedAttempt {
    fn from(failure: AttemptFailure) -> FailedAttempt {
        FailedAttempt { failure, unsent: false, pushback: None }
    }
}

/// One request's retry history.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RetryState {
    /// Retries sent so far.
    pub retries: u32,
    /// Hedges sent so far.
    pub hedges: u32,
    /// The previous wait (decorrelated jitter grows from it).
    pub last_wait: Option<Duration>,
}

/// The answer to a failed attempt.
#[derive(Debug)]
pub enum Decision {
    /// The failure is not in `retry_on`: return it to the caller (not a denial).
    NotRetryable,
    /// A retry is refused, and why.
    Denied(Denied),
    /// A retry may be sent after [`RetryTicket::wait`]; then call [`RetryPolicy::admit`].
    Retry(RetryTicket),
}

/// A retry that passed the checks and holds its scope and budget charges while it waits.
#[must_use = "admit the ticket after its wait, or drop it to give up the retry"]
#[derive(Debug)]
pub struct RetryTicket {
    wait: Duration,
    charges: RetryCharges,
    shadow_denied: Option<Denied>,
}

impl RetryTicket {
    /// How long to wait before sending the retry (the backoff, or the server's pushback).
    pub fn wait(&self) -> Duration {
        self.wait
    }

    /// In shadow mode, the reason the retry would have been refused.
    pub fn shadow_denied(&self) -> Option<Denied> {
        self.shadow_denied
    }
}

/// The charges a retry holds until it finishes: its budget permit and its scope charges.
#[derive(Debug, Default)]
pub struct RetryCharges {
    budget: Option<RetryPermit>,
    scopes: Vec<ScopeCharge>,
}

impl RetryCharges {
    /// The retry succeeded: quota budgets (the dependency's or a route's) refund its cost.
    pub fn succeeded(&mut self) {
        if let Some(p) = &mut self.budget {
            p.succeeded();
        }
        self.scopes.iter_mut().for_each(ScopeCharge::succeeded);
    }

    fn refund(self, now: Timestamp, budget: &dyn RetryBudget) {
        if let Some(p) = self.budget {
            budget.refund(now, p);
        }
        for c in self.scopes {
            c.refund(now);
        }
    }
}

/// A retry admitted to a slot: hold it for as long as the retry is in flight.
#[derive(Debug)]
pub struct AdmittedRetry {
    permit: Option<Permit>,
    charges: RetryCharges,
}

impl AdmittedRetry {
    /// The retry's slot (`None` only for a shadow-mode retry the cap would have refused).
    pub fn permit(&self) -> Option<&Permit> {
        self.permit.as_ref()
    }

    /// Takes the slot out, to move it into the response body.
    pub fn take_permit(&mut self) -> Option<Permit> {
        self.permit.take()
    }

    /// The charges, to report the retry's success.
    pub fn charges_mut(&mut self) -> &mut RetryCharges {
        &mut self.charges
    }

    /// The charges, to hold until the retry finishes (the slot may have moved elsewhere).
    pub fn into_charges(self) -> RetryCharges {
        self.charges
    }
}

/// The retry rules of one dependency: its budget, backoff, pushback handling and counters.
/// Shared by every caller (wrap it in an `Arc`).
pub struct RetryPolicy {
    config: RetryConfig,
    backoff: Backoff,
    budget: Arc<dyn RetryBudget>,
    /// The budget's [`RetryBudget::counts_successes`], read once: a success asks it beside
    /// the request's other hot data, without a call through the budget.
    counts_successes: bool,
    counters: Counters,
    /// Shadow mode off (`true`) or on, starting from `config.enforce`; flipped at run time.
    enforce: AtomicBool,
    /// The kill switch: `false` turns every retry off.
    retries_enabled: AtomicBool,
    /// When a hedge goes (a percentile's window), with hedging on.
    hedge_delay: crate::hedge::HedgeDelay,
}

impl fmt::Debug for RetryPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RetryPolicy")
            .field("config", &self.config)
            .field("budget", &self.budget)
            .finish_non_exhaustive()
    }
}

impl RetryPolicy {
    /// Builds the policy over `budget`, refusing invalid parameters.
    pub fn try_new(
        config: RetryConfig,
        budget: Arc<dyn RetryBudget>,
    ) -> Result<RetryPolicy, ConfigError> {
        config.validate()?;
        Ok(RetryPolicy {
            backoff: Backoff::try_new(config.backoff)?,
            enforce: AtomicBool::new(config.enforce),
            retries_enabled: AtomicBool::new(true),
            config,
            counts_successes: budget.counts_successes(),
            budget,
            counters: Counters::default(),
            hedge_delay: crate::hedge::HedgeDelay::new(),
        })
    }

    /// A policy over one of the four budgets.
    pub fn with_budget(config: RetryConfig, budget: AnyBudget) -> Result<RetryPolicy, ConfigError> {
        RetryPolicy::try_new(config, Arc::new(budget))
    }

    /// The parameters it was built with.
    pub fn config(&self) -> &RetryConfig {
        &self.config
    }

    /// The dependency's budget.
    pub fn budget(&self) -> &Arc<dyn RetryBudget> {
        &self.budget
    }

    /// The decision counters.
    pub fn counters(&self) -> &Counters {
        &self.counters
    }

    /// Whether refusals are enforced (`false`: shadow mode). Starts from `config.enforce`.
    pub fn enforce(&self) -> bool {
        // Relaxed: a lone flag read per decision; no other memory is published through it.
        self.enforce.load(Ordering::Relaxed)
    }

    /// Turns shadow mode off (`true`) or on (`false`) from the next decision.
    pub fn set_enforce(&self, enforce: bool) {
        self.enforce.store(enforce, Ordering::Relaxed);
    }

    /// Whether retries are on (the kill switch). Default `true`.
    pub fn retries_enabled(&self) -> bool {
        self.retries_enabled.load(Ordering::Relaxed)
    }

    /// The kill switch: `false` makes every later failed attempt final (not retryable).
    pub fn set_retries_enabled(&self, enabled: bool) {
        self.retries_enabled.store(enabled, Ordering::Relaxed);
    }

    /// An original request was admitted to a slot: counted, and deposited in the budget.
    #[inline]
    pub fn on_admitted(&self, now: Timestamp) {
        self.counters.primary();
        self.budget.record_request(now);
    }

    /// [`on_admitted`](Self::on_admitted) for a request of a call tree: the budget's deposit,
    /// then the tree's entry in the dependency's ledger ([`TreeLedger::arrived`]) — both for a
    /// request that reached the dependency, none for one refused before it.
    #[inline]
    pub fn on_admitted_in(&self, now: Timestamp, tree: Option<(&TreeLedger, &TreeContext)>) {
        self.on_admitted(now);
        if let Some((ledger, ctx)) = tree {
            ledger.arrived(now, ctx);
        }
    }

    /// A primary was refused before it reached a slot (`queue`, `breaker`, `deadline`).
    pub fn on_primary_refused(&self, reason: Denied) {
        self.counters.primary_refused(reason);
    }

    /// The request ended in success (`retried`: on a retry).
    pub fn on_success(&self, now: Timestamp, retried: bool) {
        self.counters.succeeded();
        self.budget.record_outcome(now, Outcome::Success { retried });
    }

    /// [`on_success`](Self::on_success), reading the time only if the budget counts successes.
    #[inline]
    pub fn on_success_with(&self, now: impl FnOnce() -> Timestamp, retried: bool) {
        if self.counts_successes {
            self.on_success(now(), retried);
        } else {
            self.counters.succeeded();
        }
    }

    /// Decides whether a failed attempt is retried. See the [module docs](self) for the order.
    #[allow(clippy::too_many_arguments)]
    pub fn decide<R: RandomSource + ?Sized>(
        &self,
        now: Timestamp,
        upstream: &Upstream,
        request: &RequestFacts,
        state: &mut RetryState,
        failed: &FailedAttempt,
        scopes: &[Scope],
        rng: &mut R,
    ) -> Decision {
        let failure = failed.failure;
        let retryable = self.config.retry_on.matches(failure);
        // The budget hears of every failure (the token bucket charges retryable ones and
        // don't-retry pushbacks), whatever the decision.
        let outcome = match (failed.pushback, retryable) {
            (Some(Pushback::DontRetry), _) => Outcome::DontRetryPushback,
            (_, true) => Outcome::RetryableFailure(failure.kind()),
            (_, false) => Outcome::OtherFailure,
        };
        self.budget.record_outcome(now, outcome);
        // A hold set by an earlier response counts; this response's own pushback sets the
        // wait of this retry, and holds the others.
        let held_before = upstream.hold.is_held(now).is_some();
        if let Some(Pushback::RetryAfter(d)) = failed.pushback
            && d <= self.config.pushback.max_pushback
        {
            upstream.hold.hold_until(now.saturating_add(d));
        }
        if !retryable || !self.retries_enabled() {
            self.counters.not_retryable();
            return Decision::NotRetryable;
        }
        match self.checks(now, upstream, request, state, failed, scopes, held_before, rng) {
            Ok(ticket) => Decision::Retry(ticket),
            Err(reason) if self.enforce() || always_enforced(reason) => {
                self.counters.denied(reason);
                Decision::Denied(reason)
            }
            Err(reason) => {
                self.counters.shadow_denied(reason);
                let wait = self.backoff.wait(state.retries + 1, state.last_wait, rng);
                Decision::Retry(RetryTicket {
                    wait,
                    charges: RetryCharges::default(),
                    shadow_denied: Some(reason),
                })
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn checks<R: RandomSource + ?Sized>(
        &self,
        now: Timestamp,
        upstream: &Upstream,
        request: &RequestFacts,
        state: &RetryState,
        failed: &FailedAttempt,
        scopes: &[Scope],
        held_before: bool,
        rng: &mut R,
    ) -> Result<RetryTicket, Denied> {
        let failure = failed.failure;
        // 2. What the request itself allows.
        if !(request.idempotent || failed.unsent || failure.provably_unsent()) {
            return Err(Denied::NonIdempotent);
        }
        if !request.replayable {
            return Err(Denied::Body);
        }
        if state.retries >= self.config.max_retries {
            return Err(Denied::Attempts);
        }
        if request.stacked && self.config.deny_stacked {
            return Err(Denied::Stacked);
        }
        // 3. The breaker.
        if let Some(b) = &upstream.breaker
            && !b.allows_retry(now)
        {
            return Err(Denied::Breaker);
        }
        // 4. Pushback: the server's word replaces the backoff.
        if held_before {
            return Err(Denied::Pushback);
        }
        let wait = match failed.pushback {
            Some(p) => self.config.pushback.decide(p, rng).map_err(|_| Denied::Pushback)?,
            None => self.backoff.wait(state.retries + 1, state.last_wait, rng),
        };
        // 5. The deadline.
        if let Some(deadline) = request.deadline
            && now.saturating_add(wait).saturating_add(self.config.min_attempt_time) > deadline
        {
            return Err(Denied::Deadline);
        }
        // 6. Scopes, then the budget, charged now.
        let charges = self.charge(now, upstream, failure.kind(), scopes)?;
        Ok(RetryTicket { wait, charges, shadow_denied: None })
    }

    /// Step 6: the scopes, then the budget, charged now for an attempt of `kind` (refunded
    /// whole when one refuses).
    fn charge(
        &self,
        now: Timestamp,
        upstream: &Upstream,
        kind: crate::budget::FailureKind,
        scopes: &[Scope],
    ) -> Result<RetryCharges, Denied> {
        let mut charges = RetryCharges::default();
        for scope in scopes {
            match scope.try_charge(now, kind) {
                Some(c) => charges.scopes.push(c),
                None => {
                    charges.refund(now, &*self.budget);
                    return Err(scope.denied());
                }
            }
        }
        // A concurrency budget is sized from the requests in flight: tell it how many
        // primaries hold or wait for a slot (the retries it granted it counts itself).
        self.budget.set_active(upstream.limiter.primaries_active(), 0);
        match self.budget.try_retry(now, kind) {
            Ok(p) => charges.budget = Some(p),
            Err(_) => {
                charges.refund(now, &*self.budget);
                return Err(Denied::Budget);
            }
        }
        Ok(charges)
    }

    /// Step 7, after the wait: takes a slot with `try_acquire` (a retry never waits). A refusal
    /// is [`Denied::Cap`] and refunds the scope and budget charges.
    pub fn admit(
        &self,
        upstream: &Upstream,
        ticket: RetryTicket,
        state: &mut RetryState,
    ) -> Result<AdmittedRetry, Denied> {
        let now = upstream.limiter.now();
        match upstream.limiter.try_acquire(AttemptKind::Retry) {
            Ok(permit) => {
                self.sent(state, ticket.wait);
                Ok(AdmittedRetry { permit: Some(permit), charges: ticket.charges })
            }
            Err(reason) if self.enforce() => {
                ticket.charges.refund(now, &*self.budget);
                self.counters.denied(reason);
                Err(reason)
            }
            Err(reason) => {
                self.counters.shadow_denied(reason);
                self.sent(state, ticket.wait);
                Ok(AdmittedRetry { permit: None, charges: ticket.charges })
            }
        }
    }

    /// The retry will not be sent after all (its failed response could not be kept, or the
    /// body can not be copied): the scope and budget charges are refunded, and the reason is
    /// not counted as a denial.
    pub fn give_up(&self, now: Timestamp, ticket: RetryTicket) {
        ticket.charges.refund(now, &*self.budget);
    }

    /// An admitted retry or hedge that will not be sent after all (refused further on, by the
    /// provider's window or a breaker's probe): its budget and scope charges are refunded.
    pub fn refund(&self, now: Timestamp, charges: RetryCharges) {
        charges.refund(now, &*self.budget);
    }

    /// How long after an attempt to `upstream` is sent its hedge goes, with hedging on (and,
    /// for a percentile, once enough recent attempts say); `None`: no hedge. The time is read
    /// only for a percentile (a fixed delay needs no clock).
    pub fn hedge_after(
        &self,
        upstream: &Upstream,
        now: impl FnOnce() -> Timestamp,
    ) -> Option<Duration> {
        match self.config.hedge?.after {
            HedgeAfter::Fixed(d) => Some(d),
            after => self.hedge_delay.delay(after, &upstream.limiter, now()),
        }
    }

    /// Decides whether a hedge goes now to `upstream`, beside an attempt that has not answered
    /// after [`hedge_after`](Self::hedge_after): the retry rules' checks in their order (the
    /// kill switch; the request: idempotent, replayable, `max_hedges`, not stacked; the breaker;
    /// a pushback hold; the deadline; scopes and the budget, charged now as for a retry), with
    /// no wait. A refusal is counted as a hedge's ([`Counters::hedge_denied`]); the slot is
    /// taken by [`admit_hedge`](Self::admit_hedge).
    pub fn decide_hedge(
        &self,
        now: Timestamp,
        upstream: &Upstream,
        request: &RequestFacts,
        state: &RetryState,
        scopes: &[Scope],
    ) -> Decision {
        let Some(h) = self.config.hedge else { return Decision::NotRetryable };
        if !self.retries_enabled() {
            return Decision::NotRetryable;
        }
        match self.hedge_checks(now, upstream, request, state, scopes, h.max_hedges) {
            Ok(charges) => {
                Decision::Retry(RetryTicket { wait: Duration::ZERO, charges, shadow_denied: None })
            }
            Err(reason) if self.enforce() || always_enforced(reason) => {
                self.counters.hedge_denied(reason);
                Decision::Denied(reason)
            }
            Err(reason) => {
                self.counters.shadow_denied(reason);
                Decision::Retry(RetryTicket {
                    wait: Duration::ZERO,
                    charges: RetryCharges::default(),
                    shadow_denied: Some(reason),
                })
            }
        }
    }

    /// Decides whether a retry the caller sent itself goes on — one a sidecar recognised as
    /// the repeat of a failed attempt, or that arrived marked as a retry — under the load rules
    /// a retry of stormguard's own meets, in their order: the breaker, a pushback hold, the
    /// scopes and the budget (charged now, as for a failure of `kind`). No wait (the caller
    /// waited already), and none of the request's own rules: the caller chose to resend, and
    /// its method, body and count are its own business. The kill switch turns off stormguard's
    /// retries, not the budget's hold on the caller's. A refusal is counted as a denial; the
    /// slot is taken by [`admit`](Self::admit), so a caller's retry never queues either.
    pub fn decide_caller_retry(
        &self,
        now: Timestamp,
        upstream: &Upstream,
        kind: crate::budget::FailureKind,
        scopes: &[Scope],
    ) -> Result<RetryTicket, Denied> {
        let checks = || {
            if let Some(b) = &upstream.breaker
                && !b.allows_retry(now)
            {
                return Err(Denied::Breaker);
            }
            if upstream.hold.is_held(now).is_some() {
                return Err(Denied::Pushback);
            }
            self.charge(now, upstream, kind, scopes)
        };
        let (charges, shadow_denied) = match checks() {
            Ok(charges) => (charges, None),
            Err(reason) if self.enforce() => {
                self.counters.denied(reason);
                return Err(reason);
            }
            Err(reason) => {
                self.counters.shadow_denied(reason);
                (RetryCharges::default(), Some(reason))
            }
        };
        Ok(RetryTicket { wait: Duration::ZERO, charges, shadow_denied })
    }

    fn hedge_checks(
        &self,
        now: Timestamp,
        upstream: &Upstream,
        request: &RequestFacts,
        state: &RetryState,
        scopes: &[Scope],
        max_hedges: u32,
    ) -> Result<RetryCharges, Denied> {
        if !request.idempotent {
            return Err(Denied::NonIdempotent);
        }
        if !request.replayable {
            return Err(Denied::Body);
        }
        if state.hedges >= max_hedges {
            return Err(Denied::Attempts);
        }
        if request.stacked && self.config.deny_stacked {
            return Err(Denied::Stacked);
        }
        if let Some(b) = &upstream.breaker
            && !b.allows_retry(now)
        {
            return Err(Denied::Breaker);
        }
        if upstream.hold.is_held(now).is_some() {
            return Err(Denied::Pushback);
        }
        if let Some(deadline) = request.deadline
            && now.saturating_add(self.config.min_attempt_time) > deadline
        {
            return Err(Denied::Deadline);
        }
        // The attempt it hedges is slow: charged as a timeout would be.
        self.charge(now, upstream, AttemptFailure::Timeout.kind(), scopes)
    }

    /// A hedge's slot, with `try_acquire` (a hedge never waits): as [`admit`](Self::admit),
    /// counted as a hedge.
    pub fn admit_hedge(
        &self,
        upstream: &Upstream,
        ticket: RetryTicket,
        state: &mut RetryState,
    ) -> Result<AdmittedRetry, Denied> {
        let now = upstream.limiter.now();
        match upstream.limiter.try_acquire(AttemptKind::Retry) {
            Ok(permit) => {
                state.hedges += 1;
                self.counters.hedge();
                Ok(AdmittedRetry { permit: Some(permit), charges: ticket.charges })
            }
            Err(reason) if self.enforce() => {
                ticket.charges.refund(now, &*self.budget);
                self.counters.hedge_denied(reason);
                Err(reason)
            }
            Err(reason) => {
                self.counters.shadow_denied(reason);
                state.hedges += 1;
                self.counters.hedge();
                Ok(AdmittedRetry { permit: None, charges: ticket.charges })
            }
        }
    }

    fn sent(&self, state: &mut RetryState, wait: Duration) {
        state.retries += 1;
        state.last_wait = Some(wait);
        self.counters.retry();
    }
}

#[cfg(all(test, not(stormguard_loom)))]
mod tests {
    use super::*;
    use crate::breaker::AttemptResult;
    use crate::budget::BudgetSpec;
    use crate::clock::ManualClock;
    use crate::random::SplitMix64;
    use crate::scope::FanOutScope;

    struct World {
        clock: ManualClock,
        upstream: Upstream,
        policy: RetryPolicy,
        rng: SplitMix64,
    }

    fn world(config: RetryConfig, budget: &str, breaker: Option<BreakerConfig>) -> World {
        let clock = ManualClock::new();
        let upstream = Upstream::new(
            LimiterConfig { cap: 2, queue_len: 0, ..Default::default() },
            breaker,
            Arc::new(clock.clone()),
        )
        .unwrap();
        let budget = BudgetSpec::parse(budget).unwrap().build().unwrap();
        let policy = RetryPolicy::with_budget(config, budget).unwrap();
        policy.on_admitted(clock.now());
        World { clock, upstream, policy, rng: SplitMix64::new(1) }
    }

    const RICH: &str = "ratio:percent=10,min_per_sec=100";

    impl World {
        fn decide(
            &mut self,
            facts: RequestFacts,
            state: &mut RetryState,
            failed: FailedAttempt,
            scopes: &[Scope],
        ) -> Decision {
            self.policy.decide(
                self.clock.now(),
                &self.upstream,
                &facts,
                state,
                &failed,
                scopes,
                &mut self.rng,
            )
        }

        fn denied(
            &mut self,
            facts: RequestFacts,
            state: &mut RetryState,
            failed: FailedAttempt,
            scopes: &[Scope],
        ) -> Option<Denied> {
            match self.decide(facts, state, failed, scopes) {
                Decision::Denied(d) => Some(d),
                Decision::Retry(_) => None,
                Decision::NotRetryable => panic!("not retryable"),
            }
        }
    }

    fn e503() -> FailedAttempt {
        AttemptFailure::Status(503).into()
    }

    /// A hedge follows the retry rules: never for a POST, never during a pushback hold, at most
    /// `max_hedges`, and paid from the one budget — a hedge that takes its last token leaves
    /// none for a retry. Its refusals are counted as a hedge's.
    #[test]
    fn a_hedge_is_decided_by_the_retry_rules_and_shares_the_budget() {
        let hedging = RetryConfig {
            hedge: Some(crate::hedge::HedgeConfig::new(crate::hedge::HedgeAfter::Fixed(
                Duration::from_millis(100),
            ))),
            ..RetryConfig::default()
        };
        // One retry's worth: a floor of one token.
        let mut w = world(hedging, "ratio:percent=0,min_per_sec=0.1,ttl=10s", None);
        let facts =
            RequestFacts { idempotent: true, replayable: true, stacked: false, deadline: None };
        let now = w.clock.now();
        let post = RequestFacts { idempotent: false, ..facts };
        let mut state = RetryState::default();
        assert!(matches!(
            w.policy.decide_hedge(now, &w.upstream, &post, &state, &[]),
            Decision::Denied(Denied::NonIdempotent)
        ));
        let Decision::Retry(ticket) = w.policy.decide_hedge(now, &w.upstream, &facts, &state, &[])
        else {
            panic!("the hedge")
        };
        let admitted = w.policy.admit_hedge(&w.upstream, ticket, &mut state).unwrap();
        assert_eq!(state.hedges, 1);
        assert!(matches!(
            w.policy.decide_hedge(now, &w.upstream, &facts, &state, &[]),
            Decision::Denied(Denied::Attempts)
        ));
        // The budget the hedge spent is not there for a retry.
        assert_eq!(w.denied(facts, &mut RetryState::default(), e503(), &[]), Some(Denied::Budget));
        drop(admitted);
        // A pushback hold: no hedge either.
        w.upstream.hold.hold_until(now.saturating_add(Duration::from_secs(1)));
        assert!(matches!(
            w.policy.decide_hedge(now, &w.upstream, &facts, &RetryState::default(), &[]),
            Decision::Denied(Denied::Pushback)
        ));
        let c = w.policy.counters().snapshot();
        assert_eq!((c.hedges, c.hedge_denied(Denied::NonIdempotent)), (1, 1));
        assert_eq!((c.hedge_denied(Denied::Pushback), c.denied(Denied::Pushback)), (1, 0));
    }

    /// Every check that fails, for a request that fails all of them at once: the first in the
    /// order must be the reason, and removing it must expose the next.
    #[test]
    fn each_reason_wins_over_the_later_ones() {
        let breaker = BreakerConfig { consecutive_failures: Some(1), ..Default::default() };
        let mut w = world(RetryConfig::default(), "ratio:percent=0,min_per_sec=0", Some(breaker));
        // Open the breaker, hold the upstream, spend the scope; budget is empty by construction.
        let b = w.upstream.breaker.clone().unwrap();
        b.record(w.clock.now(), AttemptResult::UpstreamFailure);
        w.upstream.hold.hold_until(Timestamp::from_millis(1_000));
        let spent = FanOutScope::new(0);
        let scopes = [Scope::FanOut(spent)];
        let mut facts = RequestFacts {
            idempotent: false,
            replayable: false,
            stacked: true,
            deadline: Some(Timestamp::from_millis(1)),
        };
        let mut state = RetryState { retries: 2, hedges: 0, last_wait: None };
        let mut order = Vec::new();
        let mut step =
            |w: &mut World, facts: &RequestFacts, state: &mut RetryState, scopes: &[Scope]| {
                let d = w.denied(*facts, state, e503(), scopes);
                order.push(d);
                d
            };
        assert_eq!(step(&mut w, &facts, &mut state, &scopes), Some(Denied::NonIdempotent));
        facts.idempotent = true;
        assert_eq!(step(&mut w, &facts, &mut state, &scopes), Some(Denied::Body));
        facts.replayable = true;
        assert_eq!(step(&mut w, &facts, &mut state, &scopes), Some(Denied::Attempts));
        state.retries = 0;
        assert_eq!(step(&mut w, &facts, &mut state, &scopes), Some(Denied::Stacked));
        facts.stacked = false;
        assert_eq!(step(&mut w, &facts, &mut state, &scopes), Some(Denied::Breaker));
        w.upstream.breaker = None;
        assert_eq!(step(&mut w, &facts, &mut state, &scopes), Some(Denied::Pushback));
        w.upstream.hold.clear();
        assert_eq!(step(&mut w, &facts, &mut state, &scopes), Some(Denied::Deadline));
        facts.deadline = None;
        assert_eq!(step(&mut w, &facts, &mut state, &scopes), Some(Denied::Scope));
        assert_eq!(step(&mut w, &facts, &mut state, &[]), Some(Denied::Budget));
        let c = w.policy.counters().snapshot();
        for reason in [Denied::NonIdempotent, Denied::Body, Denied::Budget] {
            assert_eq!(c.denied(reason), 1, "{reason}");
        }
    }

    #[test]
    fn successes_and_refused_primaries_are_counted_for_the_success_rate() {
        // A budget that does not count successes takes the clock-free path; one that does, the
        // other: both count.
        for budget in [RICH, "ratio:percent=0.2,deposit_on=success"] {
            let w = world(RetryConfig::default(), budget, None);
            w.policy.on_success_with(|| w.clock.now(), false);
            w.policy.on_success(w.clock.now(), true);
            w.policy.on_primary_refused(Denied::Queue);
            let c = w.policy.counters().snapshot();
            assert_eq!((c.primaries, c.succeeded, c.primaries_refused), (1, 2, 1), "{budget}");
            assert_eq!(c.denied(Denied::Queue), 1, "a refused primary is a denial too");
        }
    }

    #[test]
    fn not_in_retry_on_is_not_a_denial() {
        let mut w = world(RetryConfig::default(), RICH, None);
        let mut s = RetryState::default();
        assert!(matches!(
            w.decide(RequestFacts::idempotent(), &mut s, AttemptFailure::Status(404).into(), &[]),
            Decision::NotRetryable
        ));
        assert_eq!(w.policy.counters().snapshot().not_retryable, 1);
        assert_eq!(w.policy.counters().snapshot().denied, [0; Denied::ALL.len()]);
    }

    #[test]
    fn provably_unsent_failures_retry_non_idempotent_requests() {
        let mut w = world(RetryConfig::default(), RICH, None);
        let post = RequestFacts { idempotent: false, ..RequestFacts::idempotent() };
        let mut s = RetryState::default();
        assert!(matches!(
            w.decide(post, &mut s, AttemptFailure::ConnectFailure.into(), &[]),
            Decision::Retry(_)
        ));
        assert!(matches!(
            w.decide(post, &mut s, AttemptFailure::RefusedStream.into(), &[]),
            Decision::Retry(_)
        ));
        let goaway = FailedAttempt { unsent: true, ..AttemptFailure::Reset.into() };
        assert!(matches!(w.decide(post, &mut s, goaway, &[]), Decision::Retry(_)));
        // A reset after the request was written is not proof: no double payment.
        assert_eq!(
            w.denied(post, &mut s, AttemptFailure::Reset.into(), &[]),
            Some(Denied::NonIdempotent)
        );
    }

    #[test]
    fn cap_refusal_refunds_scope_and_budget() {
        let mut w = world(RetryConfig::default(), "ratio:percent=1,min_per_sec=0", None);
        // One deposit (from `world`): one retry in the budget; one retry in the scope.
        let scope = FanOutScope::new(1);
        let scopes = [Scope::FanOut(scope.clone())];
        let mut s = RetryState::default();
        let Decision::Retry(ticket) = w.decide(RequestFacts::idempotent(), &mut s, e503(), &scopes)
        else {
            panic!()
        };
        assert_eq!(scope.remaining(), 0);
        assert_eq!(w.policy.budget().snapshot(w.clock.now()).balance, 0.0);
        // Both slots are taken when the backoff ends.
        let _a = w.upstream.limiter.try_acquire(AttemptKind::Primary).unwrap();
        let _b = w.upstream.limiter.try_acquire(AttemptKind::Primary).unwrap();
        assert_eq!(w.policy.admit(&w.upstream, ticket, &mut s).unwrap_err(), Denied::Cap);
        assert_eq!(scope.remaining(), 1, "scope refunded");
        assert_eq!(w.policy.budget().snapshot(w.clock.now()).balance, 1.0, "budget refunded");
        assert_eq!(s.retries, 0, "nothing was sent");
        assert_eq!(w.policy.counters().snapshot().denied(Denied::Cap), 1);
    }

    #[test]
    fn a_spent_budget_refunds_the_scope_it_charged() {
        let mut w = world(RetryConfig::default(), "ratio:percent=0,min_per_sec=0", None);
        let scope = FanOutScope::new(1);
        let mut s = RetryState::default();
        assert_eq!(
            w.denied(RequestFacts::idempotent(), &mut s, e503(), &[Scope::FanOut(scope.clone())]),
            Some(Denied::Budget)
        );
        assert_eq!(scope.remaining(), 1);
    }

    #[test]
    fn pushback_replaces_backoff_holds_others_and_refuses_too_long() {
        let mut w = world(RetryConfig::default(), RICH, None);
        let mut s = RetryState::default();
        let asked = FailedAttempt {
            pushback: Some(Pushback::RetryAfter(Duration::from_secs(2))),
            ..AttemptFailure::Status(503).into()
        };
        let Decision::Retry(t) = w.decide(RequestFacts::idempotent(), &mut s, asked, &[]) else {
            panic!()
        };
        assert!(t.wait() >= Duration::from_secs(2) && t.wait() <= Duration::from_millis(2_400));
        // Another request's retry to the same upstream is held.
        let mut other = RetryState::default();
        assert_eq!(
            w.denied(RequestFacts::idempotent(), &mut other, e503(), &[]),
            Some(Denied::Pushback)
        );
        w.clock.advance(Duration::from_secs(2));
        assert!(w.denied(RequestFacts::idempotent(), &mut other, e503(), &[]).is_none());
        let too_long = FailedAttempt {
            pushback: Some(Pushback::RetryAfter(Duration::from_secs(301))),
            ..AttemptFailure::Status(503).into()
        };
        assert_eq!(
            w.denied(RequestFacts::idempotent(), &mut other, too_long, &[]),
            Some(Denied::Pushback)
        );
        let stop = FailedAttempt {
            pushback: Some(Pushback::DontRetry),
            ..AttemptFailure::Grpc(14).into()
        };
        let mut w = world(
            RetryConfig { retry_on: "unavailable".parse().unwrap(), ..Default::default() },
            RICH,
            None,
        );
        assert_eq!(
            w.denied(RequestFacts::idempotent(), &mut other, stop, &[]),
            Some(Denied::Pushback)
        );
    }

    #[test]
    fn runtime_switches_take_effect_on_the_next_decision() {
        let mut w = world(RetryConfig::default(), "ratio:percent=0,min_per_sec=0", None);
        let mut s = RetryState::default();
        // Enforced: the empty budget refuses.
        let d = w.decide(RequestFacts::idempotent(), &mut s, e503(), &[]);
        assert!(matches!(d, Decision::Denied(Denied::Budget)));
        // Shadow mode at run time: the same refusal is counted, the retry allowed.
        w.policy.set_enforce(false);
        assert!(!w.policy.enforce());
        let Decision::Retry(t) = w.decide(RequestFacts::idempotent(), &mut s, e503(), &[]) else {
            panic!("shadow mode lets the retry through")
        };
        assert_eq!(t.shadow_denied(), Some(Denied::Budget));
        // The request's own rules hold in shadow mode: no retry without end.
        let mut spent = RetryState { retries: 2, ..RetryState::default() };
        let d = w.decide(RequestFacts::idempotent(), &mut spent, e503(), &[]);
        assert!(matches!(d, Decision::Denied(Denied::Attempts)));
        // The kill switch: not retryable, whatever the budget or the mode.
        w.policy.set_retries_enabled(false);
        let d = w.decide(RequestFacts::idempotent(), &mut s, e503(), &[]);
        assert!(matches!(d, Decision::NotRetryable));
        w.policy.set_retries_enabled(true);
        assert!(matches!(
            w.decide(RequestFacts::idempotent(), &mut s, e503(), &[]),
            Decision::Retry(_)
        ));
        assert_eq!(w.policy.counters().snapshot().not_retryable, 1);
    }

    #[test]
    fn shadow_mode_counts_and_allows() {
        let config = RetryConfig { enforce: false, ..Default::default() };
        let mut w = world(config, "ratio:percent=0,min_per_sec=0", None);
        let mut s = RetryState::default();
        let Decision::Retry(t) = w.decide(RequestFacts::idempotent(), &mut s, e503(), &[]) else {
            panic!()
        };
        assert_eq!(t.shadow_denied(), Some(Denied::Budget));
        let _a = w.upstream.limiter.try_acquire(AttemptKind::Primary).unwrap();
        let _b = w.upstream.limiter.try_acquire(AttemptKind::Primary).unwrap();
        let admitted = w.policy.admit(&w.upstream, t, &mut s).unwrap();
        assert!(admitted.permit().is_none(), "sent without a slot");
        let c = w.policy.counters().snapshot();
        assert_eq!(
            (c.shadow_denied(Denied::Budget), c.shadow_denied(Denied::Cap), c.retries),
            (1, 1, 1)
        );
        assert_eq!(c.denied, [0; Denied::ALL.len()]);
        // The same facts enforced are denied.
        let mut w = world(RetryConfig::default(), "ratio:percent=0,min_per_sec=0", None);
        assert_eq!(
            w.denied(RequestFacts::idempotent(), &mut RetryState::default(), e503(), &[]),
            Some(Denied::Budget)
        );
    }

    #[test]
    fn attempts_count_only_sent_retries() {
        let config = RetryConfig { max_retries: 1, ..Default::default() };
        let mut w = world(config, RICH, None);
        let mut s = RetryState::default();
        let Decision::Retry(t) = w.decide(RequestFacts::idempotent(), &mut s, e503(), &[]) else {
            panic!()
        };
        let _r = w.policy.admit(&w.upstream, t, &mut s).unwrap();
        assert_eq!(
            w.denied(RequestFacts::idempotent(), &mut s, e503(), &[]),
            Some(Denied::Attempts)
        );
    }

    #[test]
    fn token_bucket_hears_failures_through_decide() {
        let mut w =
            world(RetryConfig::default(), "token-bucket:max_tokens=4,token_ratio=0.1", None);
        let mut s = RetryState { retries: 0, hedges: 0, last_wait: None };
        // 4 → 3 (allowed, > 2) → 2 (refused: not above half).
        assert!(w.denied(RequestFacts::idempotent(), &mut s, e503(), &[]).is_none());
        assert_eq!(w.denied(RequestFacts::idempotent(), &mut s, e503(), &[]), Some(Denied::Budget));
        // A 404 is not in retry_on: it costs nothing.
        let _ =
            w.decide(RequestFacts::idempotent(), &mut s, AttemptFailure::Status(404).into(), &[]);
        assert_eq!(w.policy.budget().snapshot(w.clock.now()).balance, 2.0);
    }

    #[test]
    fn a_concurrency_budget_is_sized_from_the_primaries_in_flight() {
        let config = RetryConfig { max_retries: 10, ..Default::default() };
        let mut w = world(config, "concurrency:percent=0.5,min=0", None);
        // Two primaries hold slots (cap 2): half of 2 is 1 concurrent retry.
        let _a = w.upstream.limiter.try_acquire(AttemptKind::Primary).unwrap();
        let _b = w.upstream.limiter.try_acquire(AttemptKind::Primary).unwrap();
        assert_eq!(w.upstream.limiter.primaries_active(), 2);
        let mut s = RetryState::default();
        let Decision::Retry(first) = w.decide(RequestFacts::idempotent(), &mut s, e503(), &[])
        else {
            panic!("one retry fits")
        };
        // With the first retry granted (n = 3, 1 in flight), floor(0.5 × 3) = 1: no second.
        assert_eq!(w.denied(RequestFacts::idempotent(), &mut s, e503(), &[]), Some(Denied::Budget));
        drop(first);
        // Unaware of the primaries, the same budget would have allowed nothing at all.
        let alone = BudgetSpec::parse("concurrency:percent=0.5,min=0").unwrap().build().unwrap();
        assert!(alone.try_retry(Timestamp::ZERO, crate::budget::FailureKind::Error).is_err());
    }

    /// A caller's own retry meets the load rules only: the breaker, then a hold, then the
    /// budget; it never waits; a refusal is counted as a denial, shadow mode lets it through.
    #[test]
    fn a_callers_retry_meets_the_load_rules_and_no_others() {
        use crate::budget::FailureKind;
        let breaker = BreakerConfig { consecutive_failures: Some(1), ..Default::default() };
        // A reserve of one retry a window, no share of traffic.
        let w = world(RetryConfig::default(), "ratio:percent=0,min_per_sec=0.1", Some(breaker));
        let now = w.clock.now();
        let t = w.policy.decide_caller_retry(now, &w.upstream, FailureKind::Error, &[]).unwrap();
        assert_eq!(t.wait(), Duration::ZERO);
        let mut state = RetryState::default();
        let admitted = w.policy.admit(&w.upstream, t, &mut state).unwrap();
        assert!(admitted.permit().is_some());
        let denied = |w: &World| {
            w.policy.decide_caller_retry(now, &w.upstream, FailureKind::Error, &[]).err()
        };
        assert_eq!(denied(&w), Some(Denied::Budget));
        w.upstream.hold.hold_until(Timestamp::from_millis(1_000));
        assert_eq!(denied(&w), Some(Denied::Pushback));
        w.upstream.breaker.clone().unwrap().record(now, AttemptResult::UpstreamFailure);
        assert_eq!(denied(&w), Some(Denied::Breaker));
        let c = w.policy.counters().snapshot();
        assert_eq!((c.denied(Denied::Budget), c.denied(Denied::Pushback), c.retries), (1, 1, 1));
        // The kill switch stops stormguard's own retries, not the budget's hold on the caller's.
        w.policy.set_retries_enabled(false);
        assert_eq!(denied(&w), Some(Denied::Breaker));
        // Shadow mode: counted, let through.
        w.policy.set_enforce(false);
        let t = w.policy.decide_caller_retry(now, &w.upstream, FailureKind::Error, &[]).unwrap();
        assert_eq!(t.shadow_denied(), Some(Denied::Breaker));
    }

    #[test]
    fn refuses_too_many_retries() {
        let c = RetryConfig { max_retries: 11, ..Default::default() };
        let b = BudgetSpec::default().build().unwrap();
        let err = RetryPolicy::with_budget(c, b).unwrap_err();
        assert!(matches!(err, ConfigError::TooLarge { key: "max_retries", .. }), "{err}");
        assert_eq!(err.to_string(), "max_retries must be at most 10, got 11");
    }
}
