//! Any call under the cap: a closure's attempts — a database query, a gRPC stub, an SDK call,
//! a Redis command — run under the dependency's cap, retried under its budget, by the same
//! request [`Life`] the tower layer and the reqwest middleware run.
//!
//! ```
//! use stormguard_tower::call::{Failure, Outcome};
//! use stormguard_tower::{Dependency, DependencyConfig};
//!
//! # async fn charge(_: u32) -> Result<u32, std::io::Error> { Ok(7) }
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let payments = Dependency::try_new(DependencyConfig::new("payments"))?;
//! // Every error is a transient failure, retried when the rules allow (backon's default):
//! let receipt = payments.call(|_attempt| charge(42)).await?;
//! // Or say which errors are worth a retry, and whether the call may run twice:
//! let receipt = payments
//!     .call(|_attempt| charge(42))
//!     .classify(|r: &Result<u32, std::io::Error>| match r {
//!         Ok(_) => Outcome::Success,
//!         Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
//!             Outcome::Failure(Failure::connect())
//!         }
//!         Err(e) if e.kind() == std::io::ErrorKind::InvalidInput => Outcome::Final,
//!         Err(_) => Outcome::Failure(Failure::transient()),
//!     })
//!     .idempotent(false)
//!     .await?;
//! # let _ = receipt;
//! # Ok(()) }
//! ```
//!
//! Each attempt — the first try, each retry and hedge — takes its own slot: a first try may
//! wait in the queue ([`admit_first_try`]), a retry or a hedge takes its slot now or is refused.
//! The closure is called once per attempt with its [`Attempt`] (its number, whether it is a
//! hedge, which upstream, the time left), and the [`Classify`]er reads each attempt's result:
//! a success, a [`Failure`] (retried when the rules allow, and counted by the breaker when it is
//! the dependency's), or a final answer that is neither. An attempt that passes the per-try
//! timeout (or the deadline) is dropped, and its slots are held for `timeout_slot_hold`: the
//! dependency may still be working on it. A call dropped by its caller holds its slots for
//! `abandon_hold` the same way.
//!
//! What a call answers: the last attempt's `Ok` as it is (whatever the classifier called it), or
//! a [`CallError`] saying what failed and why it was not retried.
//!
//! The shell every placement on tokio shares is [`drive`]: it runs a request's [`Life`] over
//! attempts that are futures — the first one's answer, the hedges beside it, each failure's
//! decision, the backoff, the admission of the retry — so the order of these steps is written
//! once; the closure API and the reqwest middleware are two uses of it.

use std::future::{Future, IntoFuture};
use std::pin::Pin;
use std::task::Poll;
use std::time::Duration;

use stormguard_core::Denied;
use stormguard_core::backoff::Pushback;
use stormguard_core::breaker::{AttemptResult, BreakerPermit};
use stormguard_core::clock::Timestamp;
use stormguard_core::conditions::AttemptFailure;
use stormguard_core::decision::{FailedAttempt, RequestFacts};
use stormguard_core::life::{Admitted, AttemptId, Extra, Life, Next};
use stormguard_core::limiter::Permit;
use stormguard_core::scope::FanOutScope;
use stormguard_core::tree::TreeContext;
use tracing::{Instrument, Span};

use crate::cap::{
    Admission, FirstTry, Outstanding, admit_first_try, per_try_limit, probe, timed_out,
};
use crate::dependency::{Dependency, DependencyGates};
use crate::extensions::{Deadline, RateCost, RouteBudget};
use crate::rate::RateReservation;
use crate::span::{record_denied, record_failure, span_for};

/// One attempt of a call, as the closure sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Attempt {
    number: u32,
    hedge: bool,
    upstream: usize,
    time_left: Option<Duration>,
    tree: Option<TreeContext>,
}

impl Attempt {
    /// 1 for the first try, 2 for the first retry (or the first hedge), and so on.
    pub fn number(&self) -> u32 {
        self.number
    }

    /// Whether this is a retry or a hedge, not the first try.
    pub fn is_retry(&self) -> bool {
        self.number > 1
    }

    /// Whether this is a hedge, sent beside an attempt still unanswered.
    pub fn is_hedge(&self) -> bool {
        self.hedge
    }

    /// Which of the dependency's upstreams it goes to (0 with one upstream): with several, a
    /// retry fails over as the configured order says, and the closure picks the endpoint.
    pub fn upstream(&self) -> usize {
        self.upstream
    }

    /// The time left before the call's deadline, when it has one: pass it on (a gRPC deadline,
    /// a statement timeout).
    pub fn time_left(&self) -> Option<Duration> {
        self.time_left
    }

    /// The call tree's context this attempt carries on to the hops below, when the call has
    /// one ([`Call::tree`]): a retry or a hedge says one more was spent. Put it in the
    /// attempt's request (`stormguard_http::tree::write`, or the RPC's metadata).
    pub fn tree(&self) -> Option<TreeContext> {
        self.tree
    }
}

/// A failed attempt, as the classifier reports it: how it failed, whether it can have taken
/// effect, what the dependency said about retrying, and whether it is the dependency's failure
/// (the breaker counts it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Failure {
    failed: FailedAttempt,
    breaker: bool,
}

impl Failure {
    /// A transient failure of the dependency (an unavailable service, a dropped connection):
    /// it may have run, so only an idempotent call is retried; the breaker counts it.
    pub fn transient() -> Failure {
        Failure::of(AttemptFailure::Transient)
    }

    /// Contention that took no effect — a serialization failure, a deadlock victim, an aborted
    /// transaction: retried even when the call is not idempotent (nothing of it ran), and not
    /// counted by the breaker (the dependency is healthy, its callers collide).
    pub fn contention() -> Failure {
        Failure {
            failed: FailedAttempt {
                failure: AttemptFailure::Transient,
                unsent: true,
                pushback: None,
            },
            breaker: false,
        }
    }

    /// The connection could not be made: nothing was sent, so any call may go again.
    pub fn connect() -> Failure {
        Failure::of(AttemptFailure::ConnectFailure)
    }

    /// The operation's own timeout passed (stormguard's per-try timeout is counted as this
    /// without a classifier).
    pub fn timeout() -> Failure {
        Failure::of(AttemptFailure::Timeout)
    }

    /// A failure with one of the conditions `retry_on` names (a gRPC code, a status), retried
    /// when `retry_on` covers it; the breaker counts what it counts for HTTP.
    pub fn of(failure: AttemptFailure) -> Failure {
        Failure {
            failed: FailedAttempt { failure, unsent: false, pushback: None },
            breaker: failure.counts_for_breaker(),
        }
    }

    /// The dependency asked to wait this long before a retry (its `Retry-After`): honoured
    /// as the HTTP placements honour the header, up to `max_pushback`.
    pub fn retry_after(mut self, wait: Duration) -> Failure {
        self.failed.pushback = Some(Pushback::RetryAfter(wait));
        self
    }

    /// The dependency said not to retry.
    pub fn dont_retry(mut self) -> Failure {
        self.failed.pushback = Some(Pushback::DontRetry);
        self
    }

    /// The call provably took no effect (refused before it ran): retried even when it is not
    /// idempotent.
    pub fn took_no_effect(mut self) -> Failure {
        self.failed.unsent = true;
        self
    }

    /// Whether the breaker counts it (by default: as for HTTP, the dependency's own failures).
    pub fn counted_by_breaker(mut self, counted: bool) -> Failure {
        self.breaker = counted;
        self
    }

    /// What the retry decision reads.
    pub fn failed(&self) -> &FailedAttempt {
        &self.failed
    }
}

/// What an attempt's result is, as the [`Classify`]er reads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// A success: the caller's answer.
    Success,
    /// A failure: retried when the rules allow; otherwise the caller's answer.
    Failure(Failure),
    /// An answer that is neither a success nor the dependency's failure (a not-found, a
    /// constraint violation, bad input): the caller's answer as it is, never retried, and the
    /// breaker counts it as an answer (the dependency is working).
    Final,
}

/// Reads an attempt's result. Closures `Fn(&Result<T, E>) -> Outcome` are classifiers.
pub trait Classify<T, E> {
    /// What `result` is.
    fn classify(&self, result: &Result<T, E>) -> Outcome;
}

impl<T, E, F: Fn(&Result<T, E>) -> Outcome> Classify<T, E> for F {
    fn classify(&self, result: &Result<T, E>) -> Outcome {
        self(result)
    }
}

/// The default classifier: every `Ok` a success, every `Err` a transient failure — what
/// `backon` and `tokio-retry` retry without a condition.
#[derive(Debug, Clone, Copy, Default)]
pub struct AnyError;

impl<T, E> Classify<T, E> for AnyError {
    fn classify(&self, result: &Result<T, E>) -> Outcome {
        match result {
            Ok(_) => Outcome::Success,
            Err(_) => Outcome::Failure(Failure::transient()),
        }
    }
}

/// How a call failed: the last attempt's error, or stormguard's refusal.
#[derive(Debug)]
pub enum CallError<E> {
    /// stormguard refused the first attempt: the queue, the breaker, the deadline, the
    /// provider's window. The operation never ran.
    Refused(Denied),
    /// The last attempt failed with this error; `refused` says why no retry followed (`None`:
    /// the classifier or `retry_on` did not call it retryable).
    Failed {
        /// The operation's error.
        source: E,
        /// Why it was not retried.
        refused: Option<Denied>,
    },
    /// The last attempt passed the per-try timeout or the call's deadline.
    TimedOut {
        /// Why it was not retried.
        refused: Option<Denied>,
    },
}

impl<E> CallError<E> {
    /// The reason stormguard refused: the call, or the retry of its last attempt.
    pub fn denied(&self) -> Option<Denied> {
        match self {
            CallError::Refused(d) => Some(*d),
            CallError::Failed { refused, .. } | CallError::TimedOut { refused } => *refused,
        }
    }

    /// The operation's own error, when the last attempt ended with one.
    pub fn into_source(self) -> Option<E> {
        match self {
            CallError::Failed { source, .. } => Some(source),
            _ => None,
        }
    }
}

impl<E: std::fmt::Display> std::fmt::Display for CallError<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CallError::Refused(d) => write!(f, "refused by stormguard: {d}"),
            CallError::Failed { source, refused: None } => write!(f, "{source}"),
            CallError::Failed { source, refused: Some(d) } => {
                write!(f, "not retried ({d}): {source}")
            }
            CallError::TimedOut { refused: None } => f.write_str("the attempt timed out"),
            CallError::TimedOut { refused: Some(d) } => {
                write!(f, "not retried ({d}): the attempt timed out")
            }
        }
    }
}

impl<E: std::error::Error + 'static> std::error::Error for CallError<E> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            CallError::Failed { source, .. } => Some(source),
            _ => None,
        }
    }
}

/// A call to a dependency, ready to run: made by [`Dependency::call`], run by `.await`
/// ([`IntoFuture`]; the operation's future must be `Send`) or by [`Call::run`] (any future).
#[must_use = "a call does nothing until it is awaited"]
pub struct Call<'d, F, C = AnyError> {
    dep: &'d Dependency,
    op: F,
    classify: C,
    idempotent: bool,
    deadline: Option<Duration>,
    cost: RateCost,
    fan_out: Option<FanOutScope>,
    route: Option<RouteBudget>,
    tree: Option<TreeContext>,
    name: &'static str,
}

impl<F, C> std::fmt::Debug for Call<'_, F, C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Call")
            .field("dependency", &self.dep.name())
            .field("idempotent", &self.idempotent)
            .field("deadline", &self.deadline)
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

impl Dependency {
    /// Runs `op` under the dependency's cap and rules: once for the first try, again for each
    /// retry and hedge the rules admit. See the [`call`](crate::call) module.
    pub fn call<F, Fut>(&self, op: F) -> Call<'_, F>
    where
        F: FnMut(Attempt) -> Fut,
        Fut: Future,
    {
        Call {
            dep: self,
            op,
            classify: AnyError,
            idempotent: true,
            deadline: None,
            cost: RateCost::default(),
            fan_out: None,
            tree: None,
            route: None,
            name: "call",
        }
    }
}

impl<'d, F, C> Call<'d, F, C> {
    /// How each attempt's result reads: a closure `Fn(&Result<T, E>) -> Outcome` or a
    /// [`Classify`] type. Default [`AnyError`].
    pub fn classify<D>(self, classify: D) -> Call<'d, F, D> {
        let Call { dep, op, idempotent, deadline, cost, fan_out, route, tree, name, .. } = self;
        Call { dep, op, classify, idempotent, deadline, cost, fan_out, route, tree, name }
    }

    /// Whether running the operation twice is harmless (default `true`, as in `backon` and
    /// `tokio-retry`, which retry any closure). A call that is not — a payment without an
    /// idempotency key — is retried only after a failure that provably took no effect
    /// ([`Failure::connect`], [`Failure::contention`], [`Failure::took_no_effect`]).
    pub fn idempotent(mut self, idempotent: bool) -> Self {
        self.idempotent = idempotent;
        self
    }

    /// The whole call's deadline from now, shortening the dependency's `deadline`: no retry
    /// is sent past it, and each attempt's per-try timeout ends at it.
    pub fn deadline(mut self, deadline: Duration) -> Self {
        self.deadline = Some(deadline);
        self
    }

    /// The call's cost in the provider's window (tokens), under rate admission.
    pub fn cost(mut self, cost: RateCost) -> Self {
        self.cost = cost;
        self
    }

    /// The user action this call is one of: its retries are charged to the action's scope.
    pub fn fan_out(mut self, scope: FanOutScope) -> Self {
        self.fan_out = Some(scope);
        self
    }

    /// The route's own budget: the call is counted on it, and its retries charged to it.
    pub fn route(mut self, route: RouteBudget) -> Self {
        self.route = Some(route);
        self
    }

    /// The call tree this call is part of (the context the request being served arrived with,
    /// `stormguard_http::tree::read`): it enters the dependency's tree ledger, its retries and
    /// hedges are charged to the tree's allowance too, and each attempt's [`Attempt::tree`]
    /// is the context to pass on.
    pub fn tree(mut self, ctx: TreeContext) -> Self {
        self.tree = Some(ctx);
        self
    }

    /// The name of each attempt's span (`otel.name`; default `call`), e.g. `SELECT`.
    pub fn name(mut self, name: &'static str) -> Self {
        self.name = name;
        self
    }
}

impl<'d, F, Fut, T, E, C> Call<'d, F, C>
where
    F: FnMut(Attempt) -> Fut,
    Fut: Future<Output = Result<T, E>>,
    C: Classify<T, E>,
{
    /// Runs the call: its first try under the cap, then what its life admits.
    pub async fn run(self) -> Result<T, CallError<E>> {
        let Call { dep, mut op, classify, idempotent, deadline, cost, fan_out, route, tree, name } =
            self;
        let (_, deadline) =
            crate::request::request_start(dep, route.as_ref(), deadline.map(Deadline::after));
        let now = dep.now();
        let target = match dep.upstream_count() {
            1 => 0,
            _ => dep.primary_target(now, cost),
        };
        let admission = match admit_first_try(dep, target, cost, deadline, now, tree) {
            FirstTry::Now(a) => a,
            FirstTry::Wait(w) => w.await.map_err(CallError::Refused)?,
            FirstTry::Refused(reason) => return Err(CallError::Refused(reason)),
        };
        let scopes =
            crate::request::scope_list(dep, fan_out.as_ref(), route.as_ref(), tree.as_ref());
        let facts = RequestFacts { idempotent, replayable: true, stacked: false, deadline };
        let mut life = Life::new(facts, scopes, target).with_tree(tree);
        let gates = dep.gates(cost);
        let classify = &classify;
        let send = |sent: Sent| {
            let attempt = Attempt {
                number: sent.number,
                hedge: sent.hedge,
                upstream: sent.target,
                time_left: deadline.map(|d| d.saturating_since(dep.now())),
                tree: sent.tree,
            };
            let span = span_for(dep, name, sent.target, sent.number - 1);
            // The breaker's probe first: the operation is called only for an attempt that goes
            // (a closure may start its work when called, before its future is polled).
            let call = probe(dep, sent.target, sent.at).map(|p| (p, op(attempt)));
            let classify = |r: &Result<T, E>| classify.classify(r);
            let tried = guard(dep, sent, deadline, call, classify);
            async move { (tried.instrument(span.clone()).await, span) }
        };
        let judge = |(tried, _): &(Tried<T, E>, Span)| tried.judged();
        let keep = |out| std::future::ready(Ok(out));
        let first = Sent::first(admission, target, tree);
        let hedge_after = dep
            .config()
            .retry
            .hedge
            .and_then(|_| dep.policy().hedge_after(dep.upstream_at(target), || dep.now()));
        let driven = drive(dep, &gates, &mut life, first, hedge_after, send, judge, keep).await;
        let ((tried, span), refused) = (driven.out, driven.refused);
        if let Some(r) = refused {
            record_denied(&span, r);
        }
        match tried {
            Tried::Done(result, _) => {
                result.map_err(|source| CallError::Failed { source, refused })
            }
            Tried::TimedOut => Err(CallError::TimedOut { refused }),
            Tried::Refused(reason) => Err(CallError::Refused(reason)),
        }
    }
}

impl<'d, F, Fut, T, E, C> IntoFuture for Call<'d, F, C>
where
    F: FnMut(Attempt) -> Fut + Send + 'd,
    Fut: Future<Output = Result<T, E>> + Send + 'd,
    C: Classify<T, E> + Send + Sync + 'd,
    T: Send + 'd,
    E: Send + 'd,
{
    type Output = Result<T, CallError<E>>;
    type IntoFuture = Pin<Box<dyn Future<Output = Self::Output> + Send + 'd>>;

    fn into_future(self) -> Self::IntoFuture {
        Box::pin(self.run())
    }
}

/// What one attempt of a call came to.
enum Tried<T, E> {
    /// The operation returned, and the classifier read it.
    Done(Result<T, E>, Outcome),
    /// The per-try timeout (or the deadline) passed first.
    TimedOut,
    /// The breaker refused it after it was admitted (it opened meanwhile): never run.
    Refused(Denied),
}

impl<T, E> Tried<T, E> {
    fn judged(&self) -> Judged {
        match self {
            Tried::Done(_, Outcome::Success | Outcome::Final) => Judged::Answer,
            Tried::Done(_, Outcome::Failure(f)) => Judged::Failed(f.failed),
            Tried::TimedOut => Judged::Failed(AttemptFailure::Timeout.into()),
            Tried::Refused(reason) => Judged::Unsent(Some(*reason)),
        }
    }
}

/// Runs one admitted attempt of a call: its breaker probe, the operation under the per-try
/// timeout, its slots held while it runs (and for the hold after a timeout or an abandoned
/// caller), the breaker told what the classifier read.
async fn guard<T, E, Fut>(
    dep: &Dependency,
    sent: Sent,
    deadline: Option<Timestamp>,
    call: Result<(Option<BreakerPermit>, Fut), Denied>,
    classify: impl Fn(&Result<T, E>) -> Outcome,
) -> Tried<T, E>
where
    Fut: Future<Output = Result<T, E>>,
{
    let now = sent.at;
    let target = sent.target;
    let (probe, call) = match call {
        Ok(called) => called,
        // Refused by the breaker as it was sent: never called, its booking back.
        Err(reason) => {
            if let Some(b) = sent.booking {
                b.refund(now);
            }
            return Tried::Refused(reason);
        }
    };
    let mut out = Outstanding::new(dep, (sent.permit, sent.total));
    let result = match per_try_limit(dep, now, deadline) {
        None => call.await,
        Some(limit) => match tokio::time::timeout(limit, call).await {
            Ok(result) => result,
            Err(_) => {
                record_failure(&Span::current(), AttemptFailure::Timeout);
                timed_out(dep, target, out.take(), probe);
                return Tried::TimedOut;
            }
        },
    };
    let outcome = classify(&result);
    if let Outcome::Failure(f) = &outcome {
        record_failure(&Span::current(), f.failed.failure);
        // The operation's own timeout: the dependency may still be working on it, as after
        // stormguard's.
        if f.failed.failure == AttemptFailure::Timeout {
            timed_out(dep, target, out.take(), probe);
            return Tried::Done(result, outcome);
        }
    }
    let (mut permit, total) = out.take();
    let (counted, overload) = match &outcome {
        Outcome::Success | Outcome::Final => (AttemptResult::Success, false),
        Outcome::Failure(f) => {
            let counted =
                if f.breaker { AttemptResult::UpstreamFailure } else { AttemptResult::NotCounted };
            (counted, f.failed.failure.kind() == stormguard_core::budget::FailureKind::Throttle)
        }
    };
    if let Some(p) = probe {
        crate::cap::record_probe(dep, target, p, counted);
    }
    if let Some(p) = &mut permit {
        p.answered(overload);
    }
    // The provider counted it, unless it provably took no effect.
    if let Some(b) = sent.booking {
        match &outcome {
            Outcome::Failure(f) if f.failed.unsent || f.failed.failure.provably_unsent() => {
                b.refund(dep.now())
            }
            _ => drop(b),
        }
    }
    drop((permit, total));
    Tried::Done(result, outcome)
}

/// An attempt admitted and about to be sent, with what it holds.
#[derive(Debug)]
pub struct Sent {
    /// Which attempt, to the life.
    pub id: AttemptId,
    /// Its number in the request's headers (`x-stormguard-attempt`): 1 for the first try.
    pub number: u32,
    /// A hedge, beside an attempt still unanswered.
    pub hedge: bool,
    /// The upstream it goes to.
    pub target: usize,
    /// Its slot under the upstream's cap (`None`: a shadow-mode attempt the cap refused).
    pub permit: Option<Permit>,
    /// Its slot under the total cap, when there is one.
    pub total: Option<Permit>,
    /// Its turn in the provider's window, under rate admission (boxed: most attempts have
    /// none, and the attempt is moved into its future).
    pub booking: Option<Box<RateReservation>>,
    /// When it was admitted: the time it is sent at (an attempt goes out as soon as it is
    /// admitted), so its send reads no clock of its own.
    pub at: Timestamp,
    /// The call tree's context it carries below ([`Admitted::tree`]; a first try, the
    /// request's own).
    pub tree: Option<TreeContext>,
}

impl Sent {
    /// The first try, admitted by [`admit_first_try`] to upstream `target`, carrying the call
    /// tree's context the request arrived with.
    pub fn first(admission: Admission, target: usize, tree: Option<TreeContext>) -> Sent {
        Sent {
            id: AttemptId::FIRST,
            number: 1,
            hedge: false,
            target,
            permit: Some(admission.permit),
            total: admission.total,
            booking: admission.rate,
            at: admission.at,
            tree,
        }
    }

    /// An extra attempt the request's life admitted at `at`.
    pub fn admitted(a: Admitted<RateReservation>, at: Timestamp) -> Sent {
        Sent {
            id: a.id,
            number: a.number,
            hedge: a.extra == Extra::Hedge,
            target: a.target,
            permit: a.permit,
            total: a.total,
            booking: a.booking.map(Box::new),
            at,
            tree: a.tree,
        }
    }
}

/// How an attempt's outcome reads to the request's life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Judged {
    /// The caller's answer (a success, or an answer that is no failure of the dependency): it
    /// ends the call, and wins a hedge race.
    Answer,
    /// A failure: the rules decide whether it is retried.
    Failed(FailedAttempt),
    /// Refused locally before it reached the dependency (its breaker probe, a stormguard layer
    /// below), for this reason when stormguard's: final, and its charges go back. A retry
    /// refused so leaves the caller the failure it was retrying, with the reason.
    Unsent(Option<Denied>),
}

/// What [`drive`] ends with: the outcome the caller gets, and why no retry followed it.
#[derive(Debug)]
pub struct Driven<O> {
    /// The last attempt's outcome (or the kept failure whose retry was refused).
    pub out: O,
    /// Why its retry was refused, when one was decided against.
    pub refused: Option<Denied>,
}

/// A request's life over attempts that are futures, from its admitted first try to the
/// caller's answer: the order of [`Life`]'s steps, run on tokio's clock, written once for the
/// placements that hold a request in one future (the closure API, the reqwest middleware).
///
/// - `send` sends an admitted attempt ([`Sent`]) and resolves to its outcome;
/// - `judge` reads an outcome;
/// - `keep` keeps a failed outcome while its retry waits (reading a response's body up to the
///   body limit frees its slot): `Err` gives it to the caller at once, with no retry.
///
/// With `hedge_after`, a hedge follows an unanswered attempt after that delay when the life
/// admits one, and again while `max_hedges` allows: the first answer wins, and the other
/// attempts are dropped (each holding its slots as the placement's send says). When all fail,
/// the last failure is decided on.
#[allow(clippy::too_many_arguments)]
pub async fn drive<O, S, SF, J, K, KF>(
    dep: &Dependency,
    gates: &DependencyGates<'_>,
    life: &mut Life,
    first: Sent,
    hedge_after: Option<Duration>,
    mut send: S,
    judge: J,
    keep: K,
) -> Driven<O>
where
    S: FnMut(Sent) -> SF,
    SF: Future<Output = O>,
    J: Fn(&O) -> Judged,
    K: FnMut(O) -> KF,
    KF: Future<Output = Result<O, O>>,
{
    let (id, number, out) = match hedge_after {
        None => (AttemptId::FIRST, 1, send(first).await),
        // Boxed: a request that never hedges should not carry the race's state.
        Some(delay) => Box::pin(hedged(dep, gates, life, first, delay, &mut send, &judge)).await,
    };
    if judge(&out) == Judged::Answer {
        life.succeeded(dep.policy(), || dep.now(), id);
        return Driven { out, refused: None };
    }
    // Boxed, as the hedge race is: most requests end above, and should not carry the retry
    // loop's state (its backoff timer, the kept answer, a second send).
    Box::pin(decide(dep, gates, life, (id, number, out), send, judge, keep)).await
}

/// The decision loop, from an attempt's answer that ended no race: the failure is decided on,
/// the retry waits, is admitted, and sent, until an answer or a refusal ends the request.
async fn decide<O, S, SF, J, K, KF>(
    dep: &Dependency,
    gates: &DependencyGates<'_>,
    life: &mut Life,
    (mut id, mut number, mut out): (AttemptId, u32, O),
    mut send: S,
    judge: J,
    mut keep: K,
) -> Driven<O>
where
    S: FnMut(Sent) -> SF,
    SF: Future<Output = O>,
    J: Fn(&O) -> Judged,
    K: FnMut(O) -> KF,
    KF: Future<Output = Result<O, O>>,
{
    let policy = dep.policy();
    // The jitter's source, drawn at the first failure: a request that succeeds at once takes
    // no number from the dependency's counter.
    let mut rng = None;
    loop {
        let now = dep.now();
        let failed = match judge(&out) {
            Judged::Answer => {
                life.succeeded(policy, || now, id);
                return Driven { out, refused: None };
            }
            Judged::Unsent(_) => {
                life.unsent(policy, now, id);
                return Driven { out, refused: None };
            }
            Judged::Failed(failed) => failed,
        };
        let rng = rng.get_or_insert_with(|| dep.request_rng());
        let wait = match life.failed(gates, now, id, &failed, rng) {
            Next::Answer(refused) => {
                if let Some(reason) = refused {
                    tracing::trace!(dependency = dep.name(), attempt = number, %reason, "retry refused");
                }
                return Driven { out, refused };
            }
            Next::Retry { wait, .. } => wait,
        };
        let kept = match keep(out).await {
            Ok(kept) => kept,
            Err(answer) => {
                // Too large to keep: the caller gets it, not a retry.
                life.give_up(policy, dep.now());
                return Driven { out: answer, refused: None };
            }
        };
        tracing::trace!(
            dependency = dep.name(),
            attempt = number,
            wait_ms = wait.as_millis() as u64,
            "retrying"
        );
        if !wait.is_zero() {
            tokio::time::sleep(wait).await;
        }
        let now = dep.now();
        match life.wait_elapsed(gates, now) {
            Ok(admitted) => {
                (id, number) = (admitted.id, admitted.number);
                out = send(Sent::admitted(admitted, now)).await;
                // Refused as it was sent (its breaker opened meanwhile): the caller gets the
                // failure it was retrying, with the reason — not a refusal that says nothing ran.
                if let Judged::Unsent(reason) = judge(&out) {
                    life.unsent(policy, dep.now(), id);
                    let refused = reason.or(Some(Denied::Breaker));
                    return Driven { out: kept, refused };
                }
            }
            Err(reason) => {
                tracing::trace!(dependency = dep.name(), attempt = number, %reason, "retry refused");
                return Driven { out: kept, refused: Some(reason) };
            }
        }
    }
}

/// The first attempt alone until `delay`, then — if the request's life admits a hedge now
/// ([`Life::hedge_due`]) — a hedge beside it, and while `max_hedges` allows, another the same
/// delay after the last if that one has not answered. The first answer is the caller's; the
/// other attempts are dropped. When all fail, the last failure goes on to the decision.
async fn hedged<O, S, SF, J>(
    dep: &Dependency,
    gates: &DependencyGates<'_>,
    life: &mut Life,
    first: Sent,
    delay: Duration,
    send: &mut S,
    judge: &J,
) -> (AttemptId, u32, O)
where
    S: FnMut(Sent) -> SF,
    SF: Future<Output = O>,
    J: Fn(&O) -> Judged,
{
    let mut inflight: Vec<(AttemptId, u32, Pin<Box<SF>>)> =
        vec![(AttemptId::FIRST, 1, Box::pin(send(first)))];
    let mut hedged = AttemptId::FIRST;
    let mut timer = Some(Box::pin(tokio::time::sleep(delay)));
    enum Event<O> {
        Answered(usize, O),
        Due,
    }
    loop {
        let event = std::future::poll_fn(|cx| {
            for (i, (_, _, f)) in inflight.iter_mut().enumerate() {
                if let Poll::Ready(out) = f.as_mut().poll(cx) {
                    return Poll::Ready(Event::Answered(i, out));
                }
            }
            match timer.as_mut().map(|t| t.as_mut().poll(cx)) {
                Some(Poll::Ready(())) => Poll::Ready(Event::Due),
                _ => Poll::Pending,
            }
        })
        .await;
        match event {
            Event::Answered(i, out) => {
                let (id, number, _) = inflight.swap_remove(i);
                let judged = judge(&out);
                // A hedge refused as it was sent leaves the others to answer.
                if let (Judged::Unsent(_), false) =
                    (judged, id == AttemptId::FIRST || inflight.is_empty())
                {
                    life.unsent(dep.policy(), dep.now(), id);
                    continue;
                }
                if judged == Judged::Answer || inflight.is_empty() {
                    return (id, number, out);
                }
                life.ended(id);
                if id == hedged {
                    // The attempt the next hedge was for has answered.
                    timer = None;
                }
            }
            Event::Due => {
                timer = None;
                let now = dep.now();
                let Ok(admitted) = life.hedge_due(gates, now, hedged) else { continue };
                let (id, number) = (admitted.id, admitted.number);
                inflight.push((id, number, Box::pin(send(Sent::admitted(admitted, now)))));
                hedged = id;
                if life.may_hedge(dep.policy()) {
                    timer = Some(Box::pin(tokio::time::sleep(delay)));
                }
            }
        }
    }
}
