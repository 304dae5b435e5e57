//! The layer's service, [`Stormguard`]: one future per request, which puts each attempt under
//! the cap ([`crate::cap`]) and runs the request's [`Life`] — the retry decision (docs/rules.md)
//! on each failed attempt, hedges, a caller's own retries.
//!
//! Every attempt takes its own slot: a first try may wait in the queue; a retry takes its slot
//! with `try_acquire` when its backoff ends, so it can never queue behind first tries or push
//! the dependency past the cap. Each failed attempt goes through
//! [`RetryPolicy::decide`](stormguard_core::decision::RetryPolicy::decide) — `retry_on`,
//! idempotency, replayable body, attempts, stacked retries, breaker, pushback, deadline, scopes,
//! budget — and the first refusal is the reason. The failed response (body up to the body limit)
//! is kept until the retry is sent, so a caller whose retry is refused gets the last response,
//! with the reason in its extensions ([`Denied`]).
//!
//! Each attempt runs in its own `tracing` span ([`span`](crate::span): OpenTelemetry's
//! `http.request.resend_count`, the refusal's reason), and each decision is a `debug` event in
//! the span of the attempt it judged: `retrying`, `retry refused` with its reason, `not retried`.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::SystemTime;

use bytes::{Bytes, BytesMut};
use http::{HeaderMap, Request, Response};
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;
use pin_project_lite::pin_project;
use stormguard_core::Denied;
use stormguard_core::backoff::Pushback;
use stormguard_core::clock::Timestamp;
use stormguard_core::conditions::AttemptFailure;
use stormguard_core::decision::FailedAttempt;
use stormguard_core::life::{Admitted, AttemptId, Life, Next as LifeNext, Refused};
use stormguard_core::signals::CallerRetryOutcome;
use stormguard_core::tree::TreeContext;
use stormguard_http::classify::{classify_response, classify_transport};
use stormguard_http::stacked::mark_attempt;
use tower::Service;
use tracing::Instrument;

use crate::cap::{BoxFuture, CapFuture, Inner, LiveBody, PermitBody};
use crate::dependency::Dependency;
use crate::error::{BoxError, StormguardError, classify_error};
use crate::extensions::{CallerRetry, QuotaExhausted, RateCost};
pub use crate::extensions::{Deadline, Idempotent, RouteBudget};
pub use crate::policy::{AttemptPolicy, CloneBody, Replay};
use crate::record::{TraceOp, reached_budget};
use crate::request::{Answer, Original, Rest, request_facts, send_admitted};
pub use crate::request::{request_start, scope_list, scopes};
use crate::span::{attempt_span, record_denied, record_failure, record_response};

/// What the caller gets.
pub(crate) type Out<RB> = Result<Response<RetryBody<PermitBody<RB>>>, BoxError>;

/// Every attempt to a dependency under its cap, and retries under its rules: the service that
/// [`StormguardLayer`](crate::StormguardLayer) makes. See the [module docs](self).
#[derive(Clone, Debug)]
pub struct Stormguard<S, P = Replay> {
    pub(crate) inner: S,
    pub(crate) dependency: Dependency,
    pub(crate) policy: P,
}

impl<S, P, B, RB> Service<Request<B>> for Stormguard<S, P>
where
    S: Service<Request<B>, Response = Response<RB>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Into<BoxError> + 'static,
    P: AttemptPolicy<B>,
    B: Send + 'static,
    RB: Body + Send + Unpin + 'static,
    RB::Data: Send,
    RB::Error: Into<BoxError>,
{
    type Response = Response<RetryBody<PermitBody<RB>>>;
    type Error = BoxError;
    type Future = RetryFuture<S, P, B, RB>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    /// Sends the first attempt at once (the request moves straight into the inner service), and
    /// returns the future that waits for it; the decision loop runs only if it fails. The
    /// future keeps one clone of the readied service for the retries (each readied again
    /// before it is used).
    fn call(&mut self, req: Request<B>) -> Self::Future {
        let (dep, policy, first) = (self.dependency.clone(), self.policy.clone(), &mut self.inner);
        let route = req.extensions().get::<RouteBudget>().cloned();
        // A caller's own retry is no original request: neither budget hears of it as one.
        let caller = req.extensions().get::<CallerRetry>().copied();
        let (start, deadline) = request_start(
            &dep,
            route.as_ref().filter(|_| caller.is_none()),
            req.extensions().get::<Deadline>().copied(),
        );
        // One clock read for the request's start and its first try's admission.
        let now = start.unwrap_or_else(|| dep.now());
        // The call tree's context, read once: it enters the ledger as the first try is admitted.
        let tree = dep.tree_context(req.headers());
        let id = dep.trace_id();
        if id.is_some() && caller.is_none() {
            dep.record(id, now, TraceOp::Request);
        }
        // The request's cost in a provider's window, read once; with several upstreams, the
        // first whose breaker is not open (and whose window has room for it).
        let asked = crate::extensions::rate_cost_in(req.extensions());
        let target = match dep.upstream_count() {
            1 => 0,
            _ => dep.primary_target(now, asked),
        };
        if let Some(caller) = caller {
            // The readied service goes with the request, as below.
            let svc = crate::cap::take_ready(first);
            let req = Original::new(req);
            let rest = Box::new(Rest {
                dep,
                policy,
                svc,
                req,
                deadline,
                route,
                id,
                target,
                tree,
                life: None,
            });
            return RetryFuture::boxed(Box::pin(caller_retry(rest, caller)));
        }
        let span = attempt_span(&dep, req.method(), req.uri(), target, 0);
        let cost = crate::cap::rate_cost(&dep, target, asked);
        // The first attempt sends a copy too: the original keeps the body for the next one.
        let Some(body) = policy.clone_body(req.body()) else {
            // The readied service goes with the request (it may hold what `poll_ready` reserved).
            let svc = crate::cap::take_ready(first);
            let admitted = Err((tree, cost));
            let fut = single(dep, svc, policy, req, (deadline, now, target), id, span, admitted);
            return RetryFuture::boxed(Box::pin(fut));
        };
        // The first attempt goes unmarked (a request without `x-stormguard-attempt` is a first
        // attempt); retries carry their number.
        let spare = first.clone();
        let req = Original::new(req);
        let attempt = {
            let _entered = span.enter();
            let this = (|| req.copy(body), cost);
            crate::cap::first_try(&dep, first, &policy, this, deadline, target, now, tree)
        };
        // With hedging on, a second attempt may follow this one; its timer is made only if the
        // first does not answer at once.
        let hedge = match dep.config().retry.hedge {
            None => Hedge::Off,
            Some(_) => match dep.policy().hedge_after(dep.upstream_at(target), || now) {
                Some(delay) => Hedge::Due { delay, timer: None },
                None => Hedge::Off,
            },
        };
        let rest =
            Rest { dep, policy, svc: spare, req, deadline, route, id, target, tree, life: None };
        let first = First { attempt: Some(attempt), span, rest: Some(rest), hedge, then: None };
        RetryFuture::boxed(Box::pin(first))
    }
}

/// Whether the answer to an attempt that ran alone (or won a hedge) is a success, which is the
/// caller's at once: if so, the budget and the trace are told here. `id` names the attempt
/// (the first, or the hedge that answered).
fn answered_ok<S, P, B, T>(
    rest: &mut Option<Rest<S, P, B>>,
    result: &Result<Response<T>, BoxError>,
    span: &tracing::Span,
    id: AttemptId,
) -> bool
where
    P: AttemptPolicy<B>,
{
    let r = rest.as_mut().expect(FINISHED);
    let Ok(resp) = result else { return false };
    if r.policy.classify(resp.status(), resp.headers()).is_some() {
        return false;
    }
    record_response(span, resp.status(), None);
    let dep = &r.dep;
    match &mut r.life {
        // A request that hedged: its life tells the budget and the winner's charges.
        Some(life) => life.succeeded(dep.policy(), || dep.now(), id),
        None => dep.policy().on_success_with(|| dep.now(), false),
    }
    if r.id.is_some() {
        dep.record(r.id, dep.now(), TraceOp::Success(false));
    }
    true
}

/// The decision loop after a failed attempt that ran alone (or the last of a race), in its own
/// allocation: its state is large, and a request that succeeds should not carry it. `id` and
/// `number` name the attempt.
fn answered_failed<S, P, B, RB>(
    rest: &mut Option<Rest<S, P, B>>,
    result: Answer<RB>,
    span: &tracing::Span,
    (id, number): (AttemptId, u32),
) -> BoxFuture<Out<RB>>
where
    S: Inner<B, RB> + Clone,
    P: AttemptPolicy<B>,
    B: Send + 'static,
    RB: LiveBody,
{
    let rest = rest.take().expect(FINISHED);
    Box::pin(after_failure(rest, result, span.clone(), (id, number)))
}

/// A retry its caller sent itself ([`CallerRetry`]): admitted as a retry of stormguard's own
/// is — the load rules, then its slots now or never — and refused at once otherwise
/// ([`StormguardError::Denied`]); once sent, its answer goes through the decision loop like
/// any attempt's (which, the request being stacked, does not retry it again by default).
async fn caller_retry<S, P, B, RB>(rest: Box<Rest<S, P, B>>, caller: CallerRetry) -> Out<RB>
where
    S: Inner<B, RB> + Clone,
    P: AttemptPolicy<B>,
    B: Send + 'static,
    RB: LiveBody,
{
    let dep = &rest.dep;
    let policy = dep.policy();
    let now = dep.now();
    let head = &rest.req.head;
    let span =
        attempt_span(dep, &head.method, &head.uri, rest.target, caller.attempt.saturating_sub(1));
    let cost = crate::extensions::rate_cost_in(&head.extensions);
    let gates = dep.gates(cost);
    let facts = request_facts(dep, head, rest.deadline, true);
    let tree = rest.tree;
    let scopes = scopes(dep, &head.extensions, rest.route.as_ref(), tree.as_ref());
    let (life, admitted) = Life::caller_retry(
        &gates,
        now,
        facts,
        scopes,
        tree,
        rest.target,
        caller.attempt,
        caller.after,
    );
    // Whether it reached the budget (the trace's rule, as for stormguard's own retries: a
    // refusal by the breaker or a hold is no ask; one by the slots or the window after the
    // budget is).
    if rest.id.is_some()
        && admitted.as_ref().err().is_none_or(|r| r.admitting || reached_budget(r.reason))
    {
        let refused = admitted.as_ref().err().map(|r| r.reason);
        dep.record(rest.id, now, TraceOp::Retry(caller.after, refused));
    }
    let admitted = match admitted {
        Ok(admitted) => admitted,
        Err(Refused { reason, .. }) => {
            policy.counters().caller_retry(CallerRetryOutcome::Refused);
            record_denied(&span, reason);
            tracing::debug!(parent: &span, dependency = dep.name(), attempt = caller.attempt, %reason, "the caller's retry refused");
            return Err(StormguardError::Denied(reason).into());
        }
    };
    policy.counters().caller_retry(CallerRetryOutcome::Allowed);
    let (attempt, below) = ((admitted.id, admitted.number), admitted.tree);
    let mut this = match rest.policy.clone_body(&rest.req.body) {
        Some(body) => rest.req.copy(body),
        // A body that cannot be copied is sent itself, and its answer is final; the life,
        // holding its charges, ends with it.
        None => {
            let Rest { dep, svc, policy, req, deadline, id, .. } = *rest;
            let mut req = req.into_request();
            mark_caller_retry(req.headers_mut(), caller.attempt, below.as_ref());
            let how = (deadline, now, admitted.target);
            let result = single(dep, svc, policy, req, how, id, span, Ok(admitted)).await;
            drop(life);
            return result;
        }
    };
    mark_caller_retry(this.headers_mut(), caller.attempt, below.as_ref());
    let (svc, policy) = (rest.svc.clone(), rest.policy.clone());
    let result =
        send_admitted(dep.clone(), svc, policy, this, rest.deadline, admitted, span.clone()).await;
    let mut rest = rest;
    rest.life = Some(Box::new(life));
    after_failure(*rest, result, span, attempt).await
}

/// Marks a caller's own retry as it is sent: its number as the caller gave it, and the call
/// tree's context its life gave it for the hops below.
fn mark_caller_retry(headers: &mut http::HeaderMap, attempt: u32, tree: Option<&TreeContext>) {
    mark_attempt(headers, attempt);
    stormguard_http::tree::mark(headers, tree);
}

/// The response future of [`Stormguard`]: the first attempt in flight, then (only after a
/// failure) the decision loop. One boxed future, so two words: its caller gets it back in
/// registers (a larger future is written to memory word by word and read back whole, which
/// stalled every call).
pub struct RetryFuture<S, P, B, RB> {
    inner: BoxFuture<Out<RB>>,
    _types: Types<S, P, B>,
}

/// The service, policy and body types a [`RetryFuture`] was made for (the future itself is
/// boxed: it holds none of them in its own type).
type Types<S, P, B> = std::marker::PhantomData<fn() -> (S, P, B)>;

pin_project! {
    /// The first attempt in flight, in its span; `rest` (the service, the policy and the
    /// replayable request) is used only after a failure or for a hedge; `hedge`, with hedging
    /// on, the hedge to come or in flight beside it; `then`, the decision loop once the first
    /// attempt (and its hedges) failed. The first attempt and the hedges go as soon as the
    /// request is answered (`None`, `Hedge::Off`): a loser still in flight runs on in the
    /// background with its slot, not until the caller drops this future.
    #[project = FirstProj]
    struct First<S, P, B, RB>
    where
        S: Service<Request<B>>,
    {
        #[pin]
        attempt: Option<CapFuture<S::Future, RB, S::Error>>,
        span: tracing::Span,
        rest: Option<Rest<S, P, B>>,
        hedge: Hedge<RB>,
        then: Option<BoxFuture<Out<RB>>>,
    }
}

impl<S, P, B, RB> RetryFuture<S, P, B, RB> {
    fn boxed(inner: BoxFuture<Out<RB>>) -> Self {
        RetryFuture { inner, _types: std::marker::PhantomData }
    }
}

impl<S, P, B, RB> std::fmt::Debug for RetryFuture<S, P, B, RB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("RetryFuture")
    }
}

impl<S, P, B, RB> Future for RetryFuture<S, P, B, RB> {
    type Output = Out<RB>;

    #[inline]
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.inner.as_mut().poll(cx)
    }
}

impl<S, P, B, RB> Future for First<S, P, B, RB>
where
    S: Inner<B, RB> + Clone,
    P: AttemptPolicy<B>,
    B: Send + 'static,
    RB: LiveBody,
{
    type Output = Out<RB>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let FirstProj { mut attempt, span, rest, hedge, then: looping } = self.project();
        if let Some(fut) = looping {
            return fut.as_mut().poll(cx);
        }
        let mut then = Then::Stay;
        let first = attempt.as_mut().as_pin_mut().expect(FINISHED);
        let polled = poll_first(cx, first, span, rest, hedge, &mut then);
        match then {
            // Nothing else of the request in place (no hedge), or not answered yet: the answer
            // goes straight out (the finished attempt goes with the future).
            Then::Stay => polled,
            Then::Loop(fut) => looping.insert(fut).as_mut().poll(cx),
            Then::Done => {
                // Hedges or a loser still in place go now (the cap runs each on with its slot),
                // not when the caller drops this future.
                attempt.set(None);
                *hedge = Hedge::Off;
                *rest = None;
                polled
            }
        }
    }
}

/// Polls the first attempt, in its span, and the hedges beside it.
fn poll_first<S, P, B, RB>(
    cx: &mut Context<'_>,
    mut attempt: Pin<&mut CapFuture<S::Future, RB, S::Error>>,
    span: &tracing::Span,
    rest: &mut Option<Rest<S, P, B>>,
    hedge: &mut Hedge<RB>,
    then: &mut Then<RB>,
) -> Poll<Out<RB>>
where
    S: Inner<B, RB> + Clone,
    P: AttemptPolicy<B>,
    B: Send + 'static,
    RB: LiveBody,
{
    loop {
        // The first attempt, unless it already failed beside its hedges.
        let first_failed = matches!(hedge, Hedge::Racing(race) if race.first_failed);
        if !first_failed {
            let polled = {
                let _entered = span.enter();
                let dep = &rest.as_ref().expect(FINISHED).dep;
                attempt.as_mut().poll_answer(cx, dep, RetryBody::live)
            };
            if let Poll::Ready(result) = &polled {
                match hedge {
                    // Failed with hedges in flight: theirs decide.
                    Hedge::Racing(race)
                        if !race.sent.is_empty()
                            && !succeeded(&rest.as_ref().expect(FINISHED).policy, result) =>
                    {
                        rest.as_mut().expect(FINISHED).life().ended(AttemptId::FIRST);
                        race.first_failed = true;
                    }
                    // Hedges still in flight are dropped with this future: the cap runs each
                    // on in the background, holding its slot (the abandoned-attempt rules).
                    _ => {
                        if !matches!(hedge, Hedge::Off) {
                            *then = Then::Done;
                        }
                        // A success goes out as it came (the body is the caller's already).
                        if answered_ok(rest, result, span, AttemptId::FIRST) {
                            return polled;
                        }
                        let Poll::Ready(result) = polled else { unreachable!("answered") };
                        let failed = result.map(|resp| resp.map(RetryBody::into_live));
                        let first = (AttemptId::FIRST, 1);
                        *then = Then::Loop(answered_failed(rest, failed, span, first));
                        return Poll::Pending;
                    }
                }
            }
        }
        match hedge {
            Hedge::Off => return Poll::Pending,
            Hedge::Due { delay, timer } => {
                let t = timer.get_or_insert_with(|| Box::pin(tokio::time::sleep(*delay)));
                if t.as_mut().poll(cx).is_pending() {
                    return Poll::Pending;
                }
                let delay = *delay;
                let r = rest.as_mut().expect(FINISHED);
                *hedge = match crate::hedge::send(r, AttemptId::FIRST) {
                    Some(sent) => Hedge::Racing(Box::new(Race::new(sent, delay, r))),
                    None => Hedge::Off,
                };
            }
            Hedge::Racing(race) => {
                // A hedge's answer: a success wins; a failure decides only when nothing else
                // of the request is in flight.
                let answered = race.sent.iter_mut().enumerate().find_map(|(i, h)| {
                    match h.fut.as_mut().poll(cx) {
                        Poll::Ready(result) => Some((i, result)),
                        Poll::Pending => None,
                    }
                });
                if let Some((i, result)) = answered {
                    let h = race.sent.swap_remove(i);
                    let r = rest.as_mut().expect(FINISHED);
                    let others = race.sent.len() + usize::from(!race.first_failed);
                    if !succeeded(&r.policy, &result) && others > 0 {
                        r.life().ended(h.id);
                        if race.hedged == h.id {
                            // The attempt the next hedge was for has answered.
                            race.next = None;
                        }
                        continue;
                    }
                    *then = Then::Done;
                    if answered_ok(rest, &result, &h.span, h.id) {
                        return Poll::Ready(result.map(|resp| resp.map(RetryBody::live)));
                    }
                    let hedge = (h.id, h.number);
                    *then = Then::Loop(answered_failed(rest, result, &h.span, hedge));
                    return Poll::Pending;
                }
                // The next hedge, beside the last one, while `max_hedges` allows.
                let Some(t) = race.next.as_mut() else { return Poll::Pending };
                if t.as_mut().poll(cx).is_pending() {
                    return Poll::Pending;
                }
                race.next = None;
                let r = rest.as_mut().expect(FINISHED);
                if let Some(sent) = crate::hedge::send(r, race.hedged) {
                    race.hedged = sent.id;
                    race.sent.push(sent);
                    race.arm(r);
                }
            }
        }
    }
}

const FINISHED: &str = "a RetryFuture polled after it finished";

/// What becomes of the request's future after its first attempt's state was polled: nothing
/// (not answered, or answered with nothing else of the request in place), done (answered:
/// hedges still in place go now), or the decision loop.
enum Then<RB> {
    Stay,
    Done,
    Loop(BoxFuture<Out<RB>>),
}

/// Whether an attempt's answer is one the caller takes (not a failure to retry).
fn succeeded<B, T>(policy: &impl AttemptPolicy<B>, result: &Result<Response<T>, BoxError>) -> bool {
    result.as_ref().is_ok_and(|resp| policy.classify(resp.status(), resp.headers()).is_none())
}

/// A request's hedges while its first attempt is in flight.
pub(crate) enum Hedge<RB> {
    /// None to come: hedging off, or the hedge refused.
    Off,
    /// Due `delay` after the first attempt was sent; the timer is made at the first attempt's
    /// first pending poll, so an attempt that answers at once pays none.
    Due { delay: std::time::Duration, timer: Option<Pin<Box<tokio::time::Sleep>>> },
    /// Hedges in flight beside the first attempt (or after it failed): the first success wins.
    Racing(Box<Race<RB>>),
}

/// The hedges of a request, once one was sent.
pub(crate) struct Race<RB> {
    /// In flight.
    sent: Vec<crate::hedge::SentHedge<RB>>,
    /// The first attempt failed: only the hedges are left.
    first_failed: bool,
    /// The attempt the next hedge would go beside (the last one sent), and its timer, armed
    /// while the request's life allows another hedge (`max_hedges`).
    hedged: AttemptId,
    next: Option<Pin<Box<tokio::time::Sleep>>>,
    delay: std::time::Duration,
}

impl<RB> Race<RB> {
    /// The race after the first hedge went, `delay` after the first attempt.
    fn new<S, P: AttemptPolicy<B>, B>(
        sent: crate::hedge::SentHedge<RB>,
        delay: std::time::Duration,
        rest: &mut Rest<S, P, B>,
    ) -> Race<RB> {
        let hedged = sent.id;
        let mut race = Race { sent: vec![sent], first_failed: false, hedged, next: None, delay };
        race.arm(rest);
        race
    }

    /// Arms the next hedge's timer, `delay` after the last hedge, if another may go.
    fn arm<S, P: AttemptPolicy<B>, B>(&mut self, rest: &mut Rest<S, P, B>) {
        let dep = rest.dep.clone();
        if rest.life().may_hedge(dep.policy()) {
            self.next = Some(Box::pin(tokio::time::sleep(self.delay)));
        }
    }
}

/// The decision loop after an attempt failed: `result` is the answer to attempt `id` (its
/// header number `number`: 1 for the first try), `span` its span. The order of what happens is
/// the request's [`Life`]'s; this loop only carries the request and the answers through it.
async fn after_failure<S, P, B, RB>(
    mut rest: Rest<S, P, B>,
    mut result: Answer<RB>,
    mut span: tracing::Span,
    (mut id, mut number): (AttemptId, u32),
) -> Out<RB>
where
    S: Inner<B, RB> + Clone,
    P: AttemptPolicy<B>,
    B: Send + 'static,
    RB: LiveBody,
{
    rest.life();
    let Rest { dep, policy, svc, req, deadline, id: trace, life, .. } = rest;
    let mut life = life.expect("made above");
    let config = dep.config();
    let gates = dep.gates(crate::extensions::rate_cost_in(&req.head.extensions));
    let mut rng = dep.request_rng();
    loop {
        let now = dep.now();
        let failed = match &result {
            Ok(resp) => match policy.classify(resp.status(), resp.headers()) {
                None => {
                    record_response(&span, resp.status(), None);
                    life.succeeded(dep.policy(), || now, id);
                    if trace.is_some() {
                        dep.record(trace, now, TraceOp::Success(number > 1));
                        if number > 1 {
                            dep.record(trace, now, TraceOp::RetryDone);
                        }
                    }
                    return Ok(result?.map(RetryBody::live));
                }
                Some(failure) => {
                    record_response(&span, resp.status(), Some(failure));
                    let mut pushback = config.pushback_headers.read_pushback(
                        resp.headers(),
                        resp.status(),
                        SystemTime::now(),
                        dep.header_stats(),
                    );
                    dep.log_malformed_once();
                    // A spent quota is not a rate: no retry helps.
                    if resp.extensions().get::<QuotaExhausted>().is_some() {
                        pushback = Some(Pushback::DontRetry);
                    }
                    // A provider that refused the request before processing it (a rate limit,
                    // an overload): it was not run, so retrying it cannot run it twice.
                    let unsent =
                        config.rate.provider.is_some_and(|p| p.refused_unprocessed(resp.status()));
                    FailedAttempt { failure, unsent, pushback }
                }
            },
            Err(e) => {
                match e.downcast_ref::<StormguardError>() {
                    // A local refusal of this attempt (queue, breaker), or the caller's own body
                    // failing: final, and nothing the budget or the breaker counts. A retry
                    // refused at the cap never reached the dependency: its charges go back.
                    Some(StormguardError::Denied(reason)) => {
                        record_denied(&span, *reason);
                        life.unsent(dep.policy(), now, id);
                        return Err(result.expect_err("an error"));
                    }
                    Some(StormguardError::CallerBody { .. }) => {
                        return Err(result.expect_err("an error"));
                    }
                    _ => {}
                }
                let (failure, unsent) = classify_transport(classify_error(&**e));
                record_failure(&span, failure);
                FailedAttempt { failure, unsent, pushback: None }
            }
        };
        let failure = failed.failure;
        let kind = failure.kind();
        if trace.is_some() {
            dep.record(trace, now, TraceOp::Failure(kind));
            if number > 1 {
                dep.record(trace, now, TraceOp::RetryDone);
            }
        }
        life.set_replayable(policy.is_replayable(&req.body));
        let (wait, target) = match life.failed(&gates, now, id, &failed, &mut rng) {
            LifeNext::Answer(None) => {
                tracing::debug!(parent: &span, dependency = dep.name(), attempt = number, %failure, "not retried: the failure is not in retry_on");
                return finish(result, None);
            }
            LifeNext::Answer(Some(reason)) => {
                refused(&span, &dep, number, failure, reason);
                if trace.is_some() && reached_budget(reason) {
                    dep.record(trace, now, TraceOp::Retry(kind, Some(reason)));
                }
                return finish(result, Some(reason));
            }
            LifeNext::Retry { wait, target } => (wait, target),
        };
        let Some(next_body) = policy.clone_body(&req.body) else {
            life.give_up(dep.policy(), now);
            refused(&span, &dep, number, failure, Denied::Body);
            return finish(result, Some(Denied::Body));
        };
        // Keep the failed response until the retry is sent; reading it to the end also frees
        // its slot.
        let kept = match result {
            Ok(resp) => match keep(resp, config.body_limit).await {
                Ok(kept) => Ok(kept),
                Err(partial) => {
                    // Too large to keep: give the caller this response, not a retry.
                    life.give_up(dep.policy(), dep.now());
                    tracing::debug!(parent: &span, dependency = dep.name(), attempt = number, %failure, body_limit = config.body_limit, "not retried: the failed response is larger than body_limit, so it goes to the caller as it is");
                    return Ok(partial);
                }
            },
            Err(e) => Err(e),
        };
        tracing::debug!(parent: &span, dependency = dep.name(), attempt = number, %failure, backoff_ms = wait.as_millis() as u64, "retrying");
        // The failed attempt's span ends here: the backoff belongs to no attempt.
        drop(std::mem::replace(&mut span, tracing::Span::none()));
        if !wait.is_zero() {
            tokio::time::sleep(wait).await;
        }
        // The retry's own span, open from the end of its backoff: a retry refused its slot now
        // is an attempt that never reached the dependency, with the reason.
        span = attempt_span(&dep, &req.head.method, &req.head.uri, target, number);
        match life.wait_elapsed(&gates, dep.now()) {
            Ok(admitted) => {
                if trace.is_some() {
                    dep.record(trace, now, TraceOp::Retry(kind, None));
                }
                (id, number) = (admitted.id, admitted.number);
                let mut this = req.copy(next_body);
                mark_attempt(this.headers_mut(), number);
                stormguard_http::tree::mark(this.headers_mut(), admitted.tree.as_ref());
                let sent = send_admitted(
                    dep.clone(),
                    svc.clone(),
                    policy.clone(),
                    this,
                    deadline,
                    admitted,
                    span.clone(),
                );
                result = sent.await;
            }
            Err(reason) => {
                refused(&span, &dep, number + 1, failure, reason);
                if trace.is_some() {
                    dep.record(trace, now, TraceOp::Retry(kind, Some(reason)));
                }
                return finish_kept(kept, reason);
            }
        }
    }
}

/// A refused retry: the reason on the attempt's span, and the `debug` line. `attempt` is the
/// attempt the span belongs to (the failed one, or the retry refused its slot).
fn refused(
    span: &tracing::Span,
    dep: &Dependency,
    attempt: u32,
    failure: AttemptFailure,
    reason: Denied,
) {
    record_denied(span, reason);
    tracing::debug!(parent: span, dependency = dep.name(), attempt, %failure, %reason, "retry refused");
}

/// Returns the kept response of the last failed attempt (or its error), marked with the
/// reason its retry was refused.
fn finish_kept<RB>(kept: Out<RB>, reason: Denied) -> Out<RB> {
    let mut resp = kept.map_err(|e| not_retried(e, reason))?;
    resp.extensions_mut().insert(reason);
    Ok(resp)
}

/// The last attempt's error, with the reason its retry was refused.
fn not_retried(source: BoxError, reason: Denied) -> BoxError {
    StormguardError::NotRetried { reason, source }.into()
}

/// Sends a request whose body can't be copied, once, with no retry, in `span`: a first try
/// (`Err`, with its call tree's context and its cost in the provider's window) or an attempt
/// already admitted.
#[allow(clippy::too_many_arguments)]
async fn single<S, P, B, RB>(
    dep: Dependency,
    mut svc: S,
    policy: P,
    req: Request<B>,
    (deadline, now, target): (Option<Timestamp>, Timestamp, usize),
    id: Option<u64>,
    span: tracing::Span,
    admitted: Result<Admitted<crate::rate::RateReservation>, (Option<TreeContext>, RateCost)>,
) -> Out<RB>
where
    S: Inner<B, RB> + Clone,
    P: AttemptPolicy<B>,
    B: Send + 'static,
    RB: Body + Send + 'static,
{
    let answer = match admitted {
        // A first try (with its call tree's context): `svc` is the service `poll_ready` readied.
        Err((tree, cost)) => {
            let first = span.in_scope(|| {
                crate::cap::first_try(
                    &dep,
                    &mut svc,
                    &policy,
                    (|| req, cost),
                    deadline,
                    target,
                    now,
                    tree,
                )
            });
            first.answer(&dep).instrument(span.clone()).await
        }
        Ok(admitted) => {
            send_admitted(dep.clone(), svc, policy, req, deadline, admitted, span.clone()).await
        }
    };
    let resp = match answer {
        Ok(resp) => resp,
        Err(e) => {
            let refused = match e.downcast_ref() {
                Some(StormguardError::Denied(reason)) => {
                    record_denied(&span, *reason);
                    true
                }
                Some(StormguardError::CallerBody { .. }) => true,
                _ => false,
            };
            if !refused {
                let (failure, _) = classify_transport(classify_error(&*e));
                record_failure(&span, failure);
                if id.is_some() {
                    dep.record(id, dep.now(), TraceOp::Failure(failure.kind()));
                }
            }
            return Err(e);
        }
    };
    let failure = classify_response(resp.status(), resp.headers());
    record_response(&span, resp.status(), failure);
    if failure.is_none() {
        dep.policy().on_success_with(|| dep.now(), false);
    }
    if id.is_some() {
        let op = failure.map_or(TraceOp::Success(false), |f| TraceOp::Failure(f.kind()));
        dep.record(id, dep.now(), op);
    }
    Ok(resp.map(RetryBody::live))
}

/// Returns the last outcome, marking a refusal on the response.
fn finish<RB>(result: Answer<RB>, reason: Option<Denied>) -> Out<RB> {
    let mut resp = match (result, reason) {
        (Ok(resp), _) => resp.map(RetryBody::live),
        (Err(e), Some(r)) => return Err(not_retried(e, r)),
        (Err(e), None) => return Err(e),
    };
    if let Some(r) = reason {
        resp.extensions_mut().insert(r);
    }
    Ok(resp)
}

/// Reads a failed response's body to the end if it fits `limit`, releasing its slot; past the
/// limit, returns what was read followed by the rest, untouched. Public for clients that retry
/// outside tower (stormguard-reqwest).
pub async fn keep<RB>(
    resp: Response<RB>,
    limit: usize,
) -> Result<Response<RetryBody<RB>>, Response<RetryBody<RB>>>
where
    RB: Body + Unpin,
    RB::Error: Into<BoxError>,
{
    let (parts, mut body) = resp.into_parts();
    let mut data = BytesMut::new();
    let mut trailers = None;
    loop {
        match body.frame().await {
            None => break,
            Some(Err(e)) => {
                // The failed response is lost; the retry goes ahead, and if it is refused the
                // caller gets this error.
                let e: BoxError = e.into();
                let err_body = RetryBody::failed(e);
                return Ok(Response::from_parts(parts, err_body));
            }
            Some(Ok(frame)) => match frame.into_data() {
                Ok(mut d) => {
                    use bytes::Buf;
                    let chunk = d.copy_to_bytes(d.remaining());
                    data.extend_from_slice(&chunk);
                    if data.len() > limit {
                        let head = Some(data.freeze());
                        return Err(Response::from_parts(
                            parts,
                            RetryBody::kept(Kept { head, trailers: None, error: None }, Some(body)),
                        ));
                    }
                }
                Err(frame) => {
                    if let Ok(t) = frame.into_trailers() {
                        trailers = Some(t);
                    }
                }
            },
        }
    }
    drop(body);
    Ok(Response::from_parts(
        parts,
        RetryBody::kept(Kept { head: Some(data.freeze()), trailers, error: None }, None),
    ))
}

/// The response body of the layer: the live body of the attempt that answered, or a failed
/// response kept in memory while its retry was tried.
pub struct RetryBody<B> {
    // In its own allocation, made once for the answer: the response is moved by every future
    // above (the caller's, a proxy's relay), and one whose body is a pointer is small enough to
    // be copied in place rather than by a call to `memmove` at each.
    inner: Pin<Box<BodyState<B>>>,
}

pin_project! {
    // The kept failure apart, in its own allocation: a live answer's state is then small enough
    // to be written into its box in place (with the kept failure inline it was copied there by
    // a call to `memmove`).
    struct BodyState<B> {
        #[pin]
        rest: Option<B>,
        kept: Option<Box<Kept>>,
    }
}

/// What a kept (failed) response holds besides its live rest: the body read so far, its
/// trailers, or the error that ended it.
struct Kept {
    head: Option<Bytes>,
    trailers: Option<HeaderMap>,
    error: Option<BoxError>,
}

impl<B> std::fmt::Debug for RetryBody<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RetryBody")
            .field("kept", &self.inner.kept.as_ref().and_then(|k| k.head.as_ref().map(Bytes::len)))
            .field("live", &self.inner.rest.is_some())
            .finish()
    }
}

impl<B> RetryBody<B> {
    #[inline]
    fn live(body: B) -> RetryBody<B> {
        RetryBody { inner: Box::pin(BodyState { rest: Some(body), kept: None }) }
    }

    fn kept(kept: Kept, rest: Option<B>) -> RetryBody<B> {
        RetryBody { inner: Box::pin(BodyState { rest, kept: Some(Box::new(kept)) }) }
    }

    fn failed(e: BoxError) -> RetryBody<B> {
        RetryBody::kept(Kept { head: None, trailers: None, error: Some(e) }, None)
    }

    /// Whether this is a kept copy of a failed response (its attempt's slot already free).
    pub fn is_kept(&self) -> bool {
        self.inner.rest.is_none()
    }
}

impl<B: Unpin> RetryBody<B> {
    /// The live body back, from a body made [`live`](Self::live).
    fn into_live(self) -> B {
        let BodyState { rest, .. } = *Pin::into_inner(self.inner);
        rest.expect("a live body")
    }
}

impl<B> Body for RetryBody<B>
where
    B: Body,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let mut this = self.get_mut().inner.as_mut().project();
        if let Some(kept) = this.kept.as_mut() {
            if let Some(e) = kept.error.take() {
                return Poll::Ready(Some(Err(e)));
            }
            if let Some(h) = kept.head.take()
                && !h.is_empty()
            {
                return Poll::Ready(Some(Ok(Frame::data(h))));
            }
        }
        if let Some(rest) = this.rest.as_mut().as_pin_mut() {
            return match rest.poll_frame(cx) {
                Poll::Pending => Poll::Pending,
                Poll::Ready(None) => Poll::Ready(None),
                Poll::Ready(Some(Err(e))) => Poll::Ready(Some(Err(e.into()))),
                Poll::Ready(Some(Ok(frame))) => Poll::Ready(Some(Ok(frame.map_data(|mut d| {
                    use bytes::Buf;
                    d.copy_to_bytes(d.remaining())
                })))),
            };
        }
        Poll::Ready(
            this.kept.as_mut().and_then(|k| k.trailers.take()).map(|t| Ok(Frame::trailers(t))),
        )
    }

    fn is_end_stream(&self) -> bool {
        let s = &self.inner;
        s.kept.as_ref().is_none_or(|k| {
            k.error.is_none() && k.head.as_ref().is_none_or(Bytes::is_empty) && k.trailers.is_none()
        }) && s.rest.as_ref().is_none_or(Body::is_end_stream)
    }

    fn size_hint(&self) -> SizeHint {
        let s = &self.inner;
        let head = s.kept.as_ref().and_then(|k| k.head.as_ref()).map_or(0, |h| h.len() as u64);
        match &s.rest {
            None => SizeHint::with_exact(head),
            Some(r) => stormguard_http::body::hint_after(head, &r.size_hint()),
        }
    }
}
