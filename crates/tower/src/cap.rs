//! The cap: every attempt takes a slot, and holds it until its response body ends.
//!
//! A first try waits for a slot in the dependency's FIFO queue (bounded in length and time, and
//! by the request's deadline); a retry or a hedge comes with the slot its request's life took
//! for it with `try_acquire`, so it never waits. Admission happens in the service's `call`,
//! where the request is known; `poll_ready` only forwards the inner service's readiness. The
//! permit moves into the response body, so the slot is held until the body ends or is dropped —
//! a caller slowly reading a large body is still load on the dependency.
//!
//! **A slot outlives its caller's interest.** Closing a connection does not stop a server that
//! is still computing its answer, so an attempt that reached the dependency keeps its slot
//! until the dependency has answered, whatever ended the caller's interest:
//! - stormguard's own per-try timeout, or the request's deadline: the slot is *held* until the
//!   dependency answers, at most `timeout_slot_hold` (30 s by default; never shortened to what
//!   was left of the deadline);
//! - the caller went away (the response future was dropped while the attempt was at the
//!   dependency): with a [`Spawner`](crate::Spawner) the call runs on in the background, its
//!   answer read and discarded, and the slot comes back when it ends, or at `abandon_hold`,
//!   when the call is cut; both are counted (`stormguard_abandoned_total{outcome}`).
//!
//! Without a spawner a timed-out attempt holds its slot for the whole `timeout_slot_hold`, and
//! a dropped future frees its slot at once (nothing is left to tell when the dependency
//! finished): give one wherever the cap must hold against callers that give up. A primary
//! still waiting in the queue frees its place at once when dropped: it never reached the
//! dependency. A response body dropped before its end frees the slot at once too: once the
//! dependency is sending, the closed connection stops it at its next write.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use http::{Request, Response};
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;
use stormguard_core::Denied;
use stormguard_core::breaker::{AttemptResult, BreakerPermit, BreakerState, BreakerTransition};
use stormguard_core::clock::Timestamp;
use stormguard_core::limiter::{AttemptKind, Permit};
use stormguard_core::signals::Abandoned;
use stormguard_core::tree::TreeContext;
use stormguard_http::classify::classify_response;
use tower::Service;

use crate::dependency::Dependency;
use crate::error::{BoxError, StormguardError, classify_error};
use crate::extensions::RateCost;
pub use crate::extensions::{BodyReceived, SlotWait, TimeLeft};
use crate::policy::{AttemptPolicy, Sending};
use crate::rate::{RateReservation, UsageTap};

/// A boxed, sendable future.
pub type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send + 'static>>;

/// The service under the layer, as every function that sends an attempt needs it: sendable
/// and `'static` with its calls (a call may run on in the background), its errors boxable.
pub(crate) trait Inner<B, RB>:
    Service<
        Request<B>,
        Response = Response<RB>,
        Future: Send + 'static,
        Error: Into<BoxError> + 'static,
    > + Send
    + 'static
{
}

impl<S, B, RB> Inner<B, RB> for S
where
    S: Service<Request<B>, Response = Response<RB>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Into<BoxError> + 'static,
{
}

/// The body of an answer the decision loop may keep (read to its end) or hand on.
pub(crate) trait LiveBody:
    Body<Data: Send, Error: Into<BoxError>> + Send + Unpin + 'static
{
}

impl<RB> LiveBody for RB
where
    RB: Body + Send + Unpin + 'static,
    RB::Data: Send,
    RB::Error: Into<BoxError>,
{
}

/// A first try's slots (under its upstream's cap, and under the total cap when there is one)
/// and its booking in the provider's window, once admitted.
#[derive(Debug)]
pub struct Admission {
    /// Its slot under its upstream's cap.
    pub permit: Permit,
    /// Its slot under the dependency's total cap, when there is one.
    pub total: Option<Permit>,
    /// Its booking in the provider's window, under rate admission (boxed: the admission of
    /// every first try is moved, and most have none).
    pub rate: Option<Box<RateReservation>>,
    /// When it was admitted.
    pub at: Timestamp,
}

/// How a first try's admission goes: now, after a wait (the future), or refused (counted).
pub enum FirstTry {
    /// Admitted at once: a free slot, nobody waiting, its turn in the window now.
    Now(Admission),
    /// Admitted when the future is ready, or refused then (counted): it waits for its turn in
    /// the provider's window, then in the queue. (Boxed: only a first try that waits makes it.)
    Wait(BoxFuture<Result<Admission, Denied>>),
    /// Refused at once: the breaker is open, or the window has no turn for it in time.
    Refused(Denied),
}

/// A first try's admission to upstream `target`, in the one order every placement on tokio
/// uses (the tower layer, the reqwest middleware): fail fast while the breaker is open; book a
/// turn in the provider's window under rate admission (`cost`; a later turn is waited for,
/// within the queue timeout and `deadline`); take a free slot now when nobody waits (with a
/// total cap, its slot first), else queue for it; a hold that began while it queued (a 429,
/// a spent quota) is waited out, holding the slot, while the queue timeout allows. Each refusal
/// is counted once.
#[inline]
pub fn admit_first_try(
    dep: &Dependency,
    target: usize,
    cost: RateCost,
    deadline: Option<Timestamp>,
    now: Timestamp,
    tree: Option<TreeContext>,
) -> FirstTry {
    let upstream = dep.upstream_at(target);
    let policy = dep.policy();
    // Fail fast while open, before waiting in the queue; half-open probes are counted once the
    // attempt has its slot.
    if let Some(b) = &upstream.breaker
        && matches!(b.state(now), BreakerState::Open { .. })
    {
        policy.on_primary_refused(Denied::Breaker);
        return FirstTry::Refused(Denied::Breaker);
    }
    // The provider's window before the cap: a first try books its turn, waits for it (within
    // the queue timeout and the deadline), then queues for its slot.
    let (rate, turn) = match crate::rate::book_first_try(dep, target, cost, deadline, now) {
        Ok(None) => (None, None),
        Ok(Some((booked, wait))) if wait.is_zero() => (Some(booked), None),
        Ok(Some((booked, wait))) => (None, Some((booked, wait))),
        Err(reason) => return FirstTry::Refused(reason),
    };
    // A free slot and nobody waiting: taken now, without a queue entry or a timer. With a
    // total cap, its slot first.
    if turn.is_none() {
        let total = match dep.total().map(|t| t.try_acquire_at(AttemptKind::Primary, now)) {
            None => Some(None),
            Some(Ok(p)) => Some(Some(p)),
            Some(Err(_)) => None,
        };
        if let Some(total) = total
            && let Ok(permit) = upstream.limiter.try_acquire_at(AttemptKind::Primary, now)
        {
            policy.on_admitted_in(now, tree.as_ref().map(|t| (dep.tree(), t)));
            return FirstTry::Now(Admission { permit, total, rate: rate.map(Box::new), at: now });
        }
    }
    let dep = dep.clone();
    FirstTry::Wait(Box::pin(async move {
        let rate = match turn {
            Some((booked, wait)) => {
                Some(crate::rate::wait_turn(&dep, target, cost, booked, wait, deadline).await?)
            }
            None => rate,
        };
        queued(&dep, target, deadline, rate, tree).await
    }))
}

impl std::fmt::Debug for FirstTry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FirstTry::Now(a) => f.debug_tuple("Now").field(a).finish(),
            FirstTry::Wait(_) => f.write_str("Wait"),
            FirstTry::Refused(r) => f.debug_tuple("Refused").field(r).finish(),
        }
    }
}

/// A first try that found no free slot: waits in the queue (dropped, or refused, its booking
/// comes back), then for a hold that began meanwhile.
async fn queued(
    dep: &Dependency,
    target: usize,
    deadline: Option<Timestamp>,
    rate: Option<RateReservation>,
    tree: Option<TreeContext>,
) -> Result<Admission, Denied> {
    let rate = crate::rate::Unsent::new(dep, rate);
    let policy = dep.policy();
    // With a total cap, its slot first, then the upstream's (always in this order).
    let slots = async {
        let total = match dep.total() {
            None => None,
            Some(t) => Some(acquire_primary(dep, t, deadline).await?),
        };
        let permit = acquire_primary(dep, &dep.upstream_at(target).limiter, deadline).await?;
        Ok::<_, Denied>((permit, total))
    };
    let (permit, total) = match slots.await {
        Ok(slots) => slots,
        Err(reason) => {
            drop(rate);
            policy.on_primary_refused(reason);
            return Err(reason);
        }
    };
    let now = dep.now();
    // A hold that began while it queued (a 429, a spent quota) is waited out while the queue
    // timeout allows, holding the slot; past it, refused `rate`.
    let at = match dep.rates_at(target).and_then(|r| r.held(now)) {
        None => now,
        Some(held)
            if stormguard_core::rate::waits_out_hold(
                held,
                dep.config().limiter.queue_timeout,
                now,
                deadline,
            ) =>
        {
            tokio::time::sleep(held).await;
            dep.now()
        }
        Some(_) => {
            drop((permit, total, rate));
            policy.on_primary_refused(Denied::Rate);
            return Err(Denied::Rate);
        }
    };
    policy.on_admitted_in(at, tree.as_ref().map(|t| (dep.tree(), t)));
    Ok(Admission { permit, total, rate: rate.sent().map(Box::new), at })
}

/// Puts a first try under the cap of upstream `target` ([`admit_first_try`]), on `inner`, which
/// `poll_ready` readied: sent at once when admitted at once; the returned future waits
/// otherwise, taking the readied service with it (a clone takes its place), and tells the
/// service below how long it waited ([`SlotWait`]).
#[allow(clippy::too_many_arguments)]
#[inline]
pub(crate) fn first_try<S, P, B, RB>(
    dep: &Dependency,
    inner: &mut S,
    policy: &P,
    (req, cost): (impl FnOnce() -> Request<B>, RateCost),
    deadline: Option<Timestamp>,
    target: usize,
    now: Timestamp,
    tree: Option<TreeContext>,
) -> CapFuture<S::Future, RB, S::Error>
where
    S: Inner<B, RB> + Clone,
    P: AttemptPolicy<B>,
    B: Send + 'static,
    RB: Body + Send + 'static,
{
    match admit_first_try(dep, target, cost, deadline, now, tree) {
        FirstTry::Now(a) => send(
            dep,
            inner,
            policy,
            req,
            (Some(a.permit), a.total, a.rate),
            deadline,
            (now, None),
            target,
        ),
        FirstTry::Refused(reason) => CapFuture::boxed(refused(reason)),
        FirstTry::Wait(admission) => {
            let req = req();
            let mut inner = take_ready(inner);
            let (dep, policy) = (dep.clone(), policy.clone());
            CapFuture::boxed(Box::pin(async move {
                let a = admission.await.map_err(|r| BoxError::from(StormguardError::Denied(r)))?;
                let slots = (Some(a.permit), a.total, a.rate);
                let at = (a.at, Some(a.at.saturating_since(now)));
                send(&dep, &mut inner, &policy, || req, slots, deadline, at, target)
                    .answer(&dep)
                    .await
            }))
        }
    }
}

/// What a request costs in upstream `target`'s provider window: the [`RateCost`] it carries
/// (`asked`, read from its extensions once), when that upstream is under rate admission.
#[inline]
pub(crate) fn rate_cost(dep: &Dependency, target: usize, asked: RateCost) -> RateCost {
    match dep.rates_at(target) {
        Some(_) => asked,
        None => RateCost::default(),
    }
}

/// The readied service, for a call made later: a clone takes its place for the next request.
pub(crate) fn take_ready<S: Clone>(inner: &mut S) -> S {
    let clone = inner.clone();
    std::mem::replace(inner, clone)
}

fn refused<T: Send + 'static>(reason: Denied) -> BoxFuture<Result<T, BoxError>> {
    Box::pin(std::future::ready(Err(StormguardError::Denied(reason).into())))
}

/// An admitted attempt: takes its breaker probe, calls the inner service (`poll_ready` readied
/// it) at once, and returns the future that finishes the attempt. A first try's admission is
/// [`first_try`]'s; a retry's or a hedge's, the request's life's.
#[allow(clippy::too_many_arguments)]
#[inline]
pub(crate) fn send<S, P, B, RB>(
    dep: &Dependency,
    inner: &mut S,
    policy: &P,
    req: impl FnOnce() -> Request<B>,
    (permit, total, rate): (Option<Permit>, Option<Permit>, Option<Box<RateReservation>>),
    deadline: Option<Timestamp>,
    (now, slot_wait): (Timestamp, Option<Duration>),
    target: usize,
) -> CapFuture<S::Future, RB, S::Error>
where
    S: Inner<B, RB>,
    P: AttemptPolicy<B>,
    RB: Body + Send + 'static,
{
    // Without a breaker, no probe (and no result made to be read back).
    let probe = match dep.upstream_at(target).breaker {
        None => None,
        Some(_) => match probe(dep, target, now) {
            Ok(p) => p,
            Err(reason) => {
                // Open, or half-open with every probe place taken, since this attempt was
                // admitted.
                drop((permit, total));
                if let Some(r) = rate {
                    r.refund(now);
                }
                return CapFuture::boxed(refused(reason));
            }
        },
    };
    let per_try = per_try_limit(dep, now, deadline);
    let time_left = deadline.map(|d| d.saturating_since(now));
    let mut req = req();
    policy.sending(&mut req, Sending { target, time_left, slot_wait });
    // The per-try timer, apart: most attempts never need one polled.
    let timer = per_try.map(|limit| Box::pin(tokio::time::sleep(limit)));
    // `inner` was made ready by `poll_ready` before this request was accepted.
    let body = timer.as_ref().and_then(|_| req.extensions().get::<BodyReceived>().cloned());
    let call = inner.call(req);
    let movable = dep.config().background.is_some();
    // What most attempts never have, in one allocation that only they make.
    let rare = (probe.is_some() || body.is_some() || rate.is_some())
        .then(|| Box::new(Rare { probe, body, rate: rate.map(|r| *r) }));
    // The attempt is made where it is kept (made apart and moved in, it was written field by
    // field and read back whole: a stall on every call).
    if movable {
        // A call that outlives its caller (a timeout, a dropped future) runs on in the
        // background until the dependency answers: box it so it can be moved there.
        CapFuture::Movable {
            flight: InFlight {
                call: Some(Box::pin(call)),
                attempt: Some(Attempt { permit, total, now, target, rare }),
                dep: dep.clone(),
                run_on: run_on::<S::Future, RB, S::Error>,
            },
            timer,
        }
    } else {
        let attempt = Some(Attempt { permit, total, now, target, rare });
        CapFuture::Sent { call, timer, attempt }
    }
}

/// Why an attempt's call runs on without its caller.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Orphaned {
    /// stormguard's per-try timeout (or the deadline) passed: held for `timeout_slot_hold`.
    TimedOut,
    /// The caller went away: held for `abandon_hold`, and counted.
    Abandoned,
}

/// An attempt in flight whose call can be moved to the background. Dropping it while the call
/// is still at the dependency (the caller went away) moves the call there with its slots.
struct InFlight<F> {
    call: Option<Pin<Box<F>>>,
    attempt: Option<Attempt>,
    /// Its dependency, which the background needs (the caller's is gone with it).
    dep: Dependency,
    /// [`run_on`] for this call's types: a function pointer, so that `Drop` (which cannot
    /// require the bounds spawning needs) can still call it.
    run_on: fn(Pin<Box<F>>, Attempt, &Dependency, Orphaned),
}

impl<F> Drop for InFlight<F> {
    fn drop(&mut self) {
        if let (Some(call), Some(attempt)) = (self.call.take(), self.attempt.take()) {
            (self.run_on)(call, attempt, &self.dep, Orphaned::Abandoned);
        }
    }
}

/// Moves an orphaned call to the dependency's spawner: its slots are held until the dependency
/// has answered (the whole body read and discarded: until then it is still sending, and still
/// counts the request as in flight), or until the hold passes, when the call is cut. Runs
/// only with a spawner (the `Movable` state).
fn run_on<F, RB, E>(call: Pin<Box<F>>, a: Attempt, dep: &Dependency, why: Orphaned)
where
    F: Future<Output = Result<Response<RB>, E>> + Send + 'static,
    RB: Body + Send + 'static,
    E: 'static,
{
    let Some(spawner) = dep.config().background.clone() else { return };
    let hold = match why {
        Orphaned::TimedOut => dep.config().timeout_slot_hold,
        Orphaned::Abandoned => dep.config().abandon_hold,
    };
    let target = a.target;
    let sent_at = a.now;
    let (held, total) = hold_slots(a, dep, hold, why);
    let dep = dep.clone();
    let on_answer = dep.clone();
    spawner.spawn(Box::pin(async move {
        let answered = tokio::time::timeout(hold, async move {
            // The error (a transport failure: nothing more comes) is dropped at once.
            let resp = call.await.ok();
            if let Some(resp) = resp {
                // Its headers still tell rate admission what the provider said (a 429 among
                // them holds the upstream).
                let (head, body) = resp.into_parts();
                crate::rate::answered_head(&on_answer, target, sent_at, &head);
                let mut body = std::pin::pin!(body);
                // Each frame dropped where it is read, so no frame is held across an await.
                while std::future::poll_fn(|cx| {
                    body.as_mut().poll_frame(cx).map(|f| matches!(f, Some(Ok(_))))
                })
                .await
                {}
            }
        })
        .await
        .is_ok();
        // Cut (the call dropped above) or answered: the slots come back now, if the
        // limiter's own clock has not given them back already.
        if let Some(h) = held {
            h.upstream_answered();
        }
        if let Some(t) = total {
            t.upstream_answered();
        }
        if why == Orphaned::Abandoned {
            let outcome = if answered { Abandoned::Finished } else { Abandoned::Cut };
            dep.policy().counters().abandoned(outcome);
            if !answered {
                tracing::debug!(
                    dependency = dep.name(),
                    upstream = target,
                    hold_ms = hold.as_millis() as u64,
                    "an abandoned attempt was cut: the dependency had not answered within abandon_hold"
                );
            }
        } else if !answered {
            tracing::debug!(
                dependency = dep.name(),
                upstream = target,
                hold_ms = hold.as_millis() as u64,
                "a timed-out attempt was cut: the dependency had not answered within timeout_slot_hold"
            );
        }
    }));
}

/// What an attempt in flight holds besides its call. Small, because the response future that
/// holds it is moved as a whole: what only some attempts have is boxed apart ([`Rare`]).
struct Attempt {
    permit: Option<Permit>,
    /// Its slot under the dependency's total cap, if there is one.
    total: Option<Permit>,
    now: Timestamp,
    /// Which upstream.
    target: usize,
    rare: Option<Box<Rare>>,
}

/// What only some attempts hold: a breaker probe, a caller's body still being received, a
/// booking in the provider's window.
struct Rare {
    probe: Option<BreakerPermit>,
    /// Whether the caller's body has been received, when someone tracks it (and a per-try
    /// timer runs).
    body: Option<BodyReceived>,
    /// Its booking in the provider's window, under rate admission. Dropped with the attempt
    /// (a timeout, an abandoned caller), the estimate stays charged.
    rate: Option<RateReservation>,
}

impl Attempt {
    /// Whether the caller is still sending the request body.
    fn caller_still_sending(&self) -> bool {
        self.rare.as_ref().and_then(|r| r.body.as_ref()).is_some_and(|b| !b.is_received())
    }

    /// The probe, the body flag and the booking, taken apart (inlined, as [`take`] is).
    #[inline(always)]
    fn rare(
        rare: Option<Box<Rare>>,
    ) -> (Option<BreakerPermit>, Option<BodyReceived>, Option<RateReservation>) {
        match rare {
            Some(r) => {
                let Rare { probe, body, rate } = *r;
                (probe, body, rate)
            }
            None => (None, None, None),
        }
    }
}

pin_project! {
    /// The future of one attempt under the cap: the inner call with its slot and per-try timer,
    /// or (for a first try that waits in the queue, and for refusals) a boxed future.
    // pin-project-lite takes no attributes on fields, so the variants' fields (internal state,
    // never built outside this module) are described in the variants' docs.
    #[allow(missing_docs)]
    #[project = CapProj]
    pub enum CapFuture<F, RB, E> {
        /// Sent: waiting for the inner service (`call`), under the per-try `timer`, holding the
        /// `attempt`'s slot.
        Sent {
            #[pin]
            call: F,
            timer: Option<Pin<Box<tokio::time::Sleep>>>,
            attempt: Option<Attempt>,
        },
        /// Sent with a background spawner (`flight`): on a timeout, or when the caller drops
        /// this future, the call moves to the background and releases its held slot when the
        /// dependency answers.
        Movable {
            flight: InFlight<F>,
            timer: Option<Pin<Box<tokio::time::Sleep>>>,
        },
        /// Waiting in the queue, or refused.
        Boxed { fut: BoxFuture<Result<Response<PermitBody<RB>>, BoxError>>, _error: std::marker::PhantomData<fn() -> E> },
    }
}

impl<F, RB, E> std::fmt::Debug for CapFuture<F, RB, E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CapFuture::Sent { .. } => f.write_str("CapFuture::Sent"),
            CapFuture::Movable { .. } => f.write_str("CapFuture::Movable"),
            CapFuture::Boxed { .. } => f.write_str("CapFuture::Boxed"),
        }
    }
}

impl<F, RB, E> CapFuture<F, RB, E> {
    fn boxed(fut: BoxFuture<Result<Response<PermitBody<RB>>, BoxError>>) -> Self {
        CapFuture::Boxed { fut, _error: std::marker::PhantomData }
    }
}

impl<F, RB, E> CapFuture<F, RB, E>
where
    F: Future<Output = Result<Response<RB>, E>> + Send + 'static,
    RB: Body + Send + 'static,
    E: Into<BoxError>,
{
    /// The attempt's answer, its body holding the slot, for a caller that holds the attempt's
    /// dependency (the attempt borrows it rather than keeping a clone of its own).
    pub(crate) async fn answer(
        self,
        dep: &Dependency,
    ) -> Result<Response<PermitBody<RB>>, BoxError> {
        let mut this = std::pin::pin!(self);
        std::future::poll_fn(|cx| this.as_mut().poll_answer(cx, dep, std::convert::identity)).await
    }

    /// Polls the attempt, its answer's body (holding the slot) wrapped by `wrap` as the
    /// response is made: the layer's first try gives its caller that response as it is,
    /// without making it twice.
    #[inline]
    pub(crate) fn poll_answer<W>(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        dep: &Dependency,
        wrap: impl FnOnce(PermitBody<RB>) -> W,
    ) -> Poll<Result<Response<W>, BoxError>> {
        match self.project() {
            CapProj::Boxed { fut, .. } => fut.as_mut().poll(cx).map_ok(|resp| resp.map(wrap)),
            CapProj::Sent { call, timer, attempt } => match ready!(poll_attempt(cx, call, timer)) {
                Step::Answered(result) => Poll::Ready(finish(attempt, dep, result, wrap)),
                Step::TimedOut => {
                    let a = take(attempt);
                    if a.caller_still_sending() {
                        return Poll::Ready(Err(caller_too_slow(a, dep)));
                    }
                    // No spawner: the call is dropped, and its slots held for the whole hold.
                    let hold = dep.config().timeout_slot_hold;
                    drop(hold_slots(a, dep, hold, Orphaned::TimedOut));
                    Poll::Ready(Err(StormguardError::Timeout.into()))
                }
            },
            CapProj::Movable { flight, timer } => {
                let call = flight.call.as_mut().expect("a CapFuture polled after it finished");
                let step = ready!(poll_attempt(cx, call.as_mut(), timer));
                let call = flight.call.take();
                let a = match step {
                    Step::Answered(result) => {
                        return Poll::Ready(finish(&mut flight.attempt, dep, result, wrap));
                    }
                    Step::TimedOut => take(&mut flight.attempt),
                };
                // The caller still sends: the call is cut (dropped here).
                if a.caller_still_sending() {
                    return Poll::Ready(Err(caller_too_slow(a, dep)));
                }
                // The dependency is still working on it: the call runs on to its answer, then
                // gives the slot back (the hold gives it back first if it passes).
                if let Some(call) = call {
                    (flight.run_on)(call, a, dep, Orphaned::TimedOut);
                }
                Poll::Ready(Err(StormguardError::Timeout.into()))
            }
        }
    }
}

/// What a sent attempt's poll came to.
enum Step<T> {
    /// The inner service answered (or failed).
    Answered(T),
    /// The per-try timer fired first.
    TimedOut,
}

/// Polls a sent attempt: the call first, as tokio's timeout does (an answer at the deadline
/// counts), then its per-try timer. Shared by both states of a sent attempt, whose calls differ
/// only in where they live (in place, or boxed so that they can move to the background).
fn poll_attempt<F: Future>(
    cx: &mut Context<'_>,
    call: Pin<&mut F>,
    timer: &mut Option<Pin<Box<tokio::time::Sleep>>>,
) -> Poll<Step<F::Output>> {
    if let Poll::Ready(result) = call.poll(cx) {
        return Poll::Ready(Step::Answered(result));
    }
    match timer {
        Some(sleep) => sleep.as_mut().poll(cx).map(|()| Step::TimedOut),
        None => Poll::Pending,
    }
}

/// The attempt of a sent future, taken once it ends (inlined: made out of line, the attempt is
/// written to its return place and read back at once, a stall on every answer).
#[inline(always)]
fn take(attempt: &mut Option<Attempt>) -> Attempt {
    attempt.take().expect("a CapFuture polled after it finished")
}

/// An attempt that ends without its answer (a per-try timeout, an abandoned caller): a timeout
/// counts for the breaker, and the slots are held for `hold`, because the dependency is still
/// working on the request its client gave up on. An abandoned attempt's probe is given back
/// unjudged: its caller leaving says nothing of the dependency.
fn hold_slots(
    a: Attempt,
    dep: &Dependency,
    hold: Duration,
    why: Orphaned,
) -> (Option<stormguard_core::limiter::HeldSlot>, Option<stormguard_core::limiter::HeldSlot>) {
    let (probe, _, _) = Attempt::rare(a.rare);
    if let Some(p) = probe
        && why == Orphaned::TimedOut
    {
        judge(dep, a.target, p, dep.now(), AttemptResult::UpstreamFailure);
    }
    let mut permit = a.permit;
    if let Some(p) = &mut permit
        && why == Orphaned::TimedOut
    {
        // A timeout is a drop for an adaptive cap (the upstream's: the total cap never
        // adapts); an abandoned caller says nothing.
        p.mark_dropped();
    }
    (permit.map(|p| p.hold(hold)), a.total.map(|p| p.hold(hold)))
}

/// An answer that says the dependency is overloaded (429, 503, 529): a drop for an adaptive
/// cap. Public for clients that admit attempts outside tower (stormguard-reqwest).
pub fn overload_answer(status: http::StatusCode) -> bool {
    matches!(status.as_u16(), 429 | 503 | 529)
}

/// The per-try timeout passed while the caller was still sending its body: the caller's
/// failure. The call is cut (the dependency never had the whole request), the slots come back
/// at once, and the breaker does not count it.
fn caller_too_slow(a: Attempt, dep: &Dependency) -> BoxError {
    let (probe, _, rate) = Attempt::rare(a.rare);
    if let Some(p) = probe {
        p.record(dep.now(), AttemptResult::NotCounted);
    }
    drop((a.permit, a.total));
    if let Some(r) = rate {
        // The provider never had the whole request.
        r.refund(dep.now());
    }
    StormguardError::CallerBody { source: Box::new(crate::error::CallerTooSlow) }.into()
}

/// Records the attempt's result and moves the slot into the response body (wrapped by `wrap`).
#[inline]
fn finish<RB, E: Into<BoxError>, W>(
    attempt: &mut Option<Attempt>,
    dep: &Dependency,
    result: Result<Response<RB>, E>,
    wrap: impl FnOnce(PermitBody<RB>) -> W,
) -> Result<Response<W>, BoxError> {
    let Attempt { mut permit, total, now, target, rare } = take(attempt);
    let (probe, _, rate) = Attempt::rare(rare);
    let sent_at = now;
    // The clock only for the breaker: the permit reads it when the body ends.
    let now = if probe.is_some() { dep.now() } else { now };
    match result {
        Ok(resp) => {
            // Taken apart at once: the head is read in place, and the answer made around it.
            let (head, body) = resp.into_parts();
            if let Some(p) = probe {
                let counted = AttemptResult::of(classify_response(head.status, &head.headers));
                judge(dep, target, p, now, counted);
            }
            dep.apply_limits_at(target, &head.headers);
            crate::rate::answered_head(dep, target, sent_at, &head);
            // The adaptive cap's sample (the upstream's: the total cap never adapts): latency
            // to the answer's head, or a drop.
            if let Some(p) = &mut permit {
                p.answered(overload_answer(head.status));
            }
            let body = wrap(PermitBody::holding(body, (permit, total), dep, rate));
            Ok(Response::from_parts(head, body))
        }
        Err(e) => {
            let e: BoxError = e.into();
            if crate::error::is_caller_body_error(&*e) {
                // The caller's body failed: not the dependency's failure, never retried.
                if let Some(p) = probe {
                    p.record(now, AttemptResult::NotCounted);
                }
                drop((permit, total));
                if let Some(r) = rate {
                    // The provider never had the whole request.
                    r.refund(dep.now());
                }
                return Err(StormguardError::CallerBody { source: e }.into());
            }
            let kind = classify_error(&*e);
            if let Some(p) = probe {
                let (failure, _) = stormguard_http::classify::classify_transport(kind);
                judge(dep, target, p, now, AttemptResult::of(Some(failure)));
            }
            drop((permit, total));
            if let Some(r) = rate {
                // Never sent (a refused connection): given back. Sent and failed: the
                // provider may have counted it, so the estimate stays.
                match stormguard_http::classify::classify_transport(kind).1 {
                    true => r.refund(dep.now()),
                    false => drop(r),
                }
            }
            Err(StormguardError::Transport { kind, source: e }.into())
        }
    }
}

/// Records an attempt's result on its breaker permit, and logs the change of state that made.
fn judge(
    dep: &Dependency,
    target: usize,
    probe: BreakerPermit,
    now: Timestamp,
    result: AttemptResult,
) {
    if let Some(t) = probe.record(now, result) {
        log_transition(dep, target, t, now);
    }
}

/// Records an attempt's result on its breaker probe and logs the change of state it made: for
/// clients that send attempts outside tower (stormguard-reqwest), so their breaker says the
/// same lines.
pub fn record_probe(dep: &Dependency, target: usize, probe: BreakerPermit, result: AttemptResult) {
    judge(dep, target, probe, dep.now(), result);
}

/// Logs the change a breaker probe's admission made (the first probe of a half-open period),
/// for clients that take probes outside tower.
pub fn admitted_probe(dep: &Dependency, target: usize, probe: &BreakerPermit, now: Timestamp) {
    if let Some(t) = probe.transition() {
        log_transition(dep, target, t, now);
    }
}

/// One line per change of a breaker's state: the breaker reports each change once, to the call
/// that made it. Opening is a `warn` (attempts fail fast from now on); half-open and closed
/// are `info`.
fn log_transition(dep: &Dependency, target: usize, t: BreakerTransition, now: Timestamp) {
    let upstream = dep.config().upstreams.get(target).map(|u| u.name.as_str());
    match t {
        BreakerTransition::Opened { until } | BreakerTransition::Reopened { until } => {
            tracing::warn!(
                dependency = dep.name(),
                upstream,
                transition = %t,
                open_ms = until.saturating_since(now).as_millis() as u64,
                "circuit breaker opened: attempts fail fast until the break ends"
            );
        }
        BreakerTransition::HalfOpened => tracing::info!(
            dependency = dep.name(),
            upstream,
            transition = %t,
            "circuit breaker half-open: probes test the upstream"
        ),
        BreakerTransition::Closed => tracing::info!(
            dependency = dep.name(),
            upstream,
            transition = %t,
            "circuit breaker closed: a probe succeeded"
        ),
    }
}

/// Waits for a primary's slot, racing the queue against its deadline and the limiter's own
/// timed events (a held slot or a limit hint expiring): a refusal is [`Denied::Queue`] (the
/// queue is full, or the wait passed its deadline).
async fn acquire_primary(
    dep: &Dependency,
    limiter: &stormguard_core::limiter::Limiter,
    deadline: Option<Timestamp>,
) -> Result<Permit, Denied> {
    let mut acquire = match deadline {
        Some(d) => limiter.acquire_until(d),
        None => limiter.acquire(),
    };
    loop {
        let wake = limiter.next_wakeup().map_or(acquire.deadline(), |t| t.min(acquire.deadline()));
        let sleep = match dep.instant_of(wake) {
            Some(at) => tokio::time::sleep_until(at),
            None => tokio::time::sleep(wake.saturating_since(dep.now())),
        };
        tokio::select! {
            biased;
            r = &mut acquire => return r,
            _ = sleep => {
                // Poll once more: the deadline may have passed, or a slot come free by time.
                if let Poll::Ready(r) = futures_poll(&mut acquire) {
                    return r;
                }
            }
        }
    }
}

/// Polls a future once with a no-op waker (it is polled properly again by the loop).
fn futures_poll<F: Future + Unpin>(f: &mut F) -> Poll<F::Output> {
    let mut cx = Context::from_waker(std::task::Waker::noop());
    Pin::new(f).poll(&mut cx)
}

pin_project! {
    /// A response body that holds its attempt's slot until it ends, fails or is dropped.
    pub struct PermitBody<B> {
        #[pin]
        inner: B,
        permit: Option<Permit>,
        total: Option<Permit>,
        dependency: Option<Dependency>,
        // Rate admission's booking, settled from the usage the body states when it ends.
        rate: Option<Box<(RateReservation, UsageTap)>>,
    }
}

impl<B> std::fmt::Debug for PermitBody<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PermitBody").field("holds_slot", &self.permit.is_some()).finish()
    }
}

impl<B> PermitBody<B> {
    /// A body that holds its attempt's slots (under its upstream's cap, and under the total cap
    /// when there is one) until it ends, fails or is dropped; an end releases them at the time
    /// on `dependency`'s clock. Public for clients that admit attempts outside tower
    /// (stormguard-reqwest).
    pub fn new(
        inner: B,
        permit: Option<Permit>,
        total: Option<Permit>,
        dependency: Dependency,
    ) -> PermitBody<B> {
        PermitBody { inner, permit, total, dependency: Some(dependency), rate: None }
    }

    /// [`new`](Self::new) and [`with_rate`](Self::with_rate) at once (the body made in place).
    #[inline]
    fn holding(
        inner: B,
        (permit, total): (Option<Permit>, Option<Permit>),
        dep: &Dependency,
        rate: Option<RateReservation>,
    ) -> PermitBody<B> {
        // The dependency only where the body's end needs it: one clock read for both slots, or
        // the booking's settlement (a lone slot reads its limiter's clock, the same, itself).
        let dependency = (total.is_some() || rate.is_some()).then(|| dep.clone());
        PermitBody { inner, permit, total, dependency, rate: settled_from_usage(rate) }
    }

    /// The body also carries the attempt's booking in the provider's window (see
    /// [`crate::rate`]): settled from the `usage` the body states when it ends, kept at its
    /// estimate when it fails or is dropped.
    pub fn with_rate(mut self, rate: Option<RateReservation>) -> PermitBody<B> {
        self.rate = settled_from_usage(rate);
        self
    }

    /// A body that holds no slot.
    pub fn without_permit(inner: B) -> PermitBody<B> {
        PermitBody { inner, permit: None, total: None, dependency: None, rate: None }
    }

    /// Whether the body still holds its attempt's slot.
    pub fn holds_slot(&self) -> bool {
        self.permit.is_some()
    }
}

/// A booking, with the tap that reads the usage its answer states (see [`PermitBody::with_rate`]).
#[allow(clippy::type_complexity)]
#[inline]
fn settled_from_usage(rate: Option<RateReservation>) -> Option<Box<(RateReservation, UsageTap)>> {
    rate.map(|r| Box::new((r, UsageTap::default())))
}

impl<B: Body> Body for PermitBody<B>
where
    B::Error: Into<BoxError>,
{
    type Data = B::Data;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<B::Data>, BoxError>>> {
        let mut this = self.project();
        let r = match this.inner.as_mut().poll_frame(cx) {
            Poll::Pending => return Poll::Pending,
            Poll::Ready(r) => r,
        };
        let done = match &r {
            None | Some(Err(_)) => true,
            Some(Ok(_)) => this.inner.is_end_stream(),
        };
        if let Some(rate) = this.rate.as_mut() {
            if let Some(Ok(frame)) = &r
                && let Some(data) = frame.data_ref()
            {
                rate.1.feed(bytes::Buf::chunk(data));
            }
            if done && let Some(rate) = this.rate.take() {
                let (booked, tap) = *rate;
                match (&r, this.dependency.as_ref()) {
                    (Some(Err(_)), _) | (_, None) => drop(booked),
                    (_, Some(d)) => {
                        let usage = tap.read();
                        let factor = d.config().rate.usage_max_factor;
                        let clamped = booked.settle(d.now(), usage.tokens, factor);
                        if usage.malformed || clamped {
                            // A count the request could not have used: ignored or clamped,
                            // counted, and logged once.
                            let stats = d.header_stats();
                            stats.record(stormguard_http::headers::HeaderKind::Usage);
                            d.log_malformed_once();
                        }
                    }
                }
            }
        }
        if done && let Some(p) = this.permit.take() {
            let total = this.total.take();
            match this.dependency {
                Some(d) => {
                    let now = d.now();
                    p.release_at(now);
                    if let Some(t) = total {
                        t.release_at(now);
                    }
                }
                None => drop((p, total)),
            }
        }
        Poll::Ready(r.map(|r| r.map_err(Into::into)))
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// An attempt's breaker probe, taken as it is sent: `Err(Denied::Breaker)` (counted) when the
/// breaker opened, or has every probe place taken, since the attempt was admitted.
pub fn probe(
    dep: &Dependency,
    target: usize,
    now: Timestamp,
) -> Result<Option<BreakerPermit>, Denied> {
    match dep.upstream_at(target).breaker.as_ref().map(|b| b.try_acquire(now)) {
        None => Ok(None),
        Some(Ok(p)) => {
            admitted_probe(dep, target, &p, now);
            Ok(Some(p))
        }
        Some(Err(_)) => {
            dep.policy().counters().denied(Denied::Breaker);
            Err(Denied::Breaker)
        }
    }
}

/// How long an attempt sent at `now` may run: the per-try timeout, cut short by the deadline.
#[inline]
pub fn per_try_limit(
    dep: &Dependency,
    now: Timestamp,
    deadline: Option<Timestamp>,
) -> Option<Duration> {
    match (dep.config().per_try_timeout, deadline) {
        (Some(t), Some(d)) => Some(t.min(d.saturating_since(now))),
        (Some(t), None) => Some(t),
        (None, Some(d)) => Some(d.saturating_since(now)),
        (None, None) => None,
    }
}

/// What an attempt holds: its slot under the upstream's cap, and one under the dependency's
/// total cap when there is one (`None`s for a shadow-mode retry sent without a slot).
pub type Slots = (Option<Permit>, Option<Permit>);

/// An attempt's slots while its call is out. Dropped with them (the caller left, or a hedge
/// won), they are held for `abandon_hold`: a call that cannot run on without its caller (a
/// closure's future, reqwest's) leaves the hold to stand in for the answer nobody will see.
pub struct Outstanding<'a> {
    slots: Option<Slots>,
    dep: &'a Dependency,
}

impl std::fmt::Debug for Outstanding<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Outstanding").field("slots", &self.slots).finish_non_exhaustive()
    }
}

impl<'a> Outstanding<'a> {
    /// The slots of an attempt whose call is about to go out.
    pub fn new(dep: &'a Dependency, slots: Slots) -> Outstanding<'a> {
        Outstanding { slots: Some(slots), dep }
    }

    /// The call ended: the slots go where its end says.
    pub fn take(&mut self) -> Slots {
        self.slots.take().unwrap_or((None, None))
    }
}

impl Drop for Outstanding<'_> {
    fn drop(&mut self) {
        if let Some((permit, total)) = self.slots.take() {
            let hold = self.dep.config().abandon_hold;
            // Dropping a held slot keeps the hold; the limiter gives it back when it passes.
            drop((permit.map(|p| p.hold(hold)), total.map(|p| p.hold(hold))));
        }
    }
}

/// A timed-out attempt whose call is dropped: the breaker counts it, and its slots are held
/// for `timeout_slot_hold`, since the dependency keeps working on what its client gave up on.
pub fn timed_out(
    dep: &Dependency,
    target: usize,
    (mut permit, total): Slots,
    probe: Option<BreakerPermit>,
) {
    if let Some(p) = probe {
        record_probe(dep, target, p, AttemptResult::UpstreamFailure);
    }
    // A drop for an adaptive cap (the upstream's: a total cap never adapts).
    if let Some(p) = &mut permit {
        p.mark_dropped();
    }
    let hold = dep.config().timeout_slot_hold;
    // Dropping a held slot keeps the hold; the limiter gives the slot back when it passes.
    drop((permit.map(|p| p.hold(hold)), total.map(|p| p.hold(hold))));
}
