//! Hedged requests in the tower layer: the first attempt alone until the hedge is due
//! ([`RetryPolicy::hedge_after`](stormguard_core::decision::RetryPolicy::hedge_after)), then —
//! if the retry rules allow it ([`decide_hedge`](stormguard_core::decision::RetryPolicy::decide_hedge):
//! idempotent, no pushback hold, breaker closed, budget) and a slot is free now — a second
//! attempt, marked `x-stormguard-attempt: 2; hedge`, to the next upstream when there are
//! several. The first successful answer is the caller's; the other attempt is dropped here and
//! the cap runs it on in the background, holding its slot until the dependency has finished it
//! (the abandoned-attempt rules: counted as abandoned). When both fail, the decision loop goes
//! on from the last failure, as after any failed attempt.

use http::{Request, Response};
use http_body::Body;
use stormguard_core::AttemptKind;
use stormguard_core::clock::Timestamp;
use stormguard_core::decision::{Decision, RequestFacts, RetryCharges, RetryState};
use stormguard_core::limiter::Permit;
use stormguard_core::scope::Scope;
use tower::{Service, ServiceExt};
use tracing::Instrument;
use tracing::instrument::Instrumented;

use crate::dependency::Dependency;
use crate::error::BoxError;
use crate::extensions::{AdmittedSlot, AttemptDeadline, RateCost, UpstreamTarget};
use crate::rate::Unsent;
use crate::retry::{
    AttemptPolicy, Rest, RetryBody, copy_request, first_answered, request_facts, scopes_of,
};
use crate::span::attempt_span;

/// The first attempt, not answered when its hedge was due: hedged if the rules allow.
pub(crate) async fn hedged<S, P, B, RB>(
    rest: Rest<S, P, B>,
    mut first: std::pin::Pin<Box<Instrumented<S::Future>>>,
) -> Result<Response<RetryBody<RB>>, BoxError>
where
    S: Service<Request<B>, Response = Response<RB>, Error = BoxError> + Clone + Send + 'static,
    S::Future: Send + 'static,
    P: AttemptPolicy<B>,
    B: Send + 'static,
    RB: Body + Send + Unpin + 'static,
    RB::Data: Send,
    RB::Error: Into<BoxError>,
{
    let first_span = first.span().clone();
    let Some((mut hedge, hedge_span, target)) = send_hedge(&rest) else {
        let result = first.await;
        return answer(rest, result, &first_span).await;
    };
    // Both in flight: the first success wins; a failure waits for the other.
    let dep = rest.dep.clone();
    let success = |r: &Result<Response<RB>, BoxError>| {
        r.as_ref().is_ok_and(|resp| rest.policy.classify(resp.status(), resp.headers()).is_none())
    };
    let (result, span, hedge_won) = tokio::select! {
        r = &mut first => {
            if success(&r) {
                (r, first_span, false)
            } else {
                ((&mut hedge).await, hedge_span, true)
            }
        }
        r = &mut hedge => {
            if success(&r) {
                (r, hedge_span, true)
            } else {
                ((&mut first).await, first_span, false)
            }
        }
    };
    if hedge_won && success(&result) {
        dep.policy().counters().hedge_won();
    }
    // The loser, if still in flight, is dropped with `first` or `hedge` here: the cap moves it
    // to the background with its slot.
    drop((first, hedge));
    let mut rest = rest;
    rest.target = target;
    answer(rest, result, &span).await
}

/// [`first_answered`], awaited.
async fn answer<S, P, B, RB>(
    rest: Rest<S, P, B>,
    result: Result<Response<RB>, BoxError>,
    span: &tracing::Span,
) -> Result<Response<RetryBody<RB>>, BoxError>
where
    S: Service<Request<B>, Response = Response<RB>, Error = BoxError> + Clone + Send + 'static,
    S::Future: Send + 'static,
    P: AttemptPolicy<B>,
    B: Send + 'static,
    RB: Body + Send + Unpin + 'static,
    RB::Data: Send,
    RB::Error: Into<BoxError>,
{
    match first_answered(rest, result, span) {
        Ok(answer) => answer,
        Err(decision_loop) => decision_loop.await,
    }
}

/// A hedge admitted: its slots, its booking in the provider's window, and the budget and scope
/// charges, held until the hedge has ended (as a retry's are).
#[derive(Debug)]
pub struct AdmittedHedge {
    /// Its slot under its upstream's cap (`None`: shadow mode, sent without one).
    pub permit: Option<Permit>,
    /// Its slot under the dependency's total cap, when there is one.
    pub total: Option<Permit>,
    /// Its booking in the provider's window, under rate admission (refunded if never sent).
    pub booked: Unsent,
    /// What the budget and the scopes were charged.
    pub charges: RetryCharges,
}

/// Admits a hedge to upstream `target` now, by the retry rules
/// ([`RetryPolicy::decide_hedge`](stormguard_core::decision::RetryPolicy::decide_hedge)), the
/// provider's window (room now or none), the total cap and its upstream's cap (`try_acquire`);
/// `None` when any refuses it (counted as a hedge's refusal). Public for clients that hedge
/// outside tower (stormguard-reqwest).
pub fn admit(
    dep: &Dependency,
    target: usize,
    facts: &RequestFacts,
    scopes: &[Scope],
    cost: RateCost,
    now: Timestamp,
) -> Option<AdmittedHedge> {
    let mut state = RetryState::default();
    let upstream = dep.upstream_at(target);
    let ticket = match dep.policy().decide_hedge(now, upstream, facts, &state, scopes) {
        Decision::Retry(ticket) => ticket,
        Decision::Denied(reason) => {
            tracing::debug!(dependency = dep.name(), %reason, "hedge refused");
            return None;
        }
        Decision::NotRetryable => return None,
    };
    let refuse = |ticket, reason| {
        dep.policy().give_up(now, ticket);
        dep.policy().counters().hedge_denied(reason);
        tracing::debug!(dependency = dep.name(), %reason, "hedge refused");
    };
    let booked = match crate::rate::book_retry(dep, target, cost, now) {
        Ok(b) => Unsent::new(dep, b),
        Err(reason) => {
            refuse(ticket, reason);
            return None;
        }
    };
    let total = match dep.total().map(|t| t.try_acquire(AttemptKind::Retry)) {
        None => None,
        Some(Ok(p)) => Some(p),
        Some(Err(reason)) => {
            refuse(ticket, reason);
            return None;
        }
    };
    let mut admitted = dep.policy().admit_hedge(upstream, ticket, &mut state).ok()?;
    Some(AdmittedHedge {
        permit: admitted.take_permit(),
        total,
        booked,
        charges: admitted.into_charges(),
    })
}

/// Decides and sends the hedge, if the rules allow one now: its response future, its span, and
/// the upstream it went to.
#[allow(clippy::type_complexity)]
fn send_hedge<S, P, B, RB>(
    rest: &Rest<S, P, B>,
) -> Option<(
    std::pin::Pin<Box<dyn std::future::Future<Output = Result<Response<RB>, BoxError>> + Send>>,
    tracing::Span,
    usize,
)>
where
    S: Service<Request<B>, Response = Response<RB>, Error = BoxError> + Clone + Send + 'static,
    S::Future: Send + 'static,
    P: AttemptPolicy<B>,
    B: Send + 'static,
    RB: Body + Send + 'static,
{
    let dep = &rest.dep;
    let req = &rest.req;
    let now = dep.now();
    let body = rest.policy.clone_body(req.body());
    let facts = request_facts(dep, req, rest.deadline, body.is_some());
    let cost = req.extensions().get::<RateCost>().copied().unwrap_or_default();
    let next = match dep.upstream_count() {
        1 => 0,
        _ => dep.failover_target(rest.target, now, cost),
    };
    let scopes = scopes_of(req, rest.route.as_ref());
    let AdmittedHedge { permit, total, booked, charges } =
        admit(dep, next, &facts, &scopes, cost, now)?;
    let slot = AdmittedSlot::new(permit, total, booked);
    let mut this = copy_request(req, body?);
    stormguard_http::stacked::mark_hedge(this.headers_mut(), 2);
    if let Some(d) = rest.deadline {
        this.extensions_mut().insert(AttemptDeadline(d));
    }
    this.extensions_mut().insert(slot);
    if next != 0 {
        this.extensions_mut().insert(UpstreamTarget(next));
    }
    let span = attempt_span(dep, req, next, 1);
    let svc = rest.svc.clone();
    let fut_span = span.clone();
    let call = async move {
        let result = svc.oneshot(this).instrument(fut_span).await;
        drop(charges);
        result
    };
    Some((Box::pin(call), span, next))
}
