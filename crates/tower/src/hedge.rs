//! Hedged requests in the tower layer: the first attempt alone until the hedge is due
//! ([`RetryPolicy::hedge_after`](stormguard_core::decision::RetryPolicy::hedge_after)), then —
//! if the retry rules allow it ([`decide_hedge`](stormguard_core::decision::RetryPolicy::decide_hedge):
//! idempotent, no pushback hold, breaker closed, budget) and a slot is free now — a second
//! attempt, marked `x-stormguard-attempt: 2; hedge`, to the next upstream when there are
//! several. The race itself is run by [`RetryFuture`](crate::retry::RetryFuture), with the
//! first attempt in place (a request that never hedges pays no allocation for the
//! possibility). The first successful answer is the caller's; the other attempt is dropped and
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

use crate::cap::BoxFuture;
use crate::dependency::Dependency;
use crate::error::BoxError;
use crate::extensions::{AdmittedSlot, RateCost};
use crate::rate::Unsent;
use crate::retry::{AttemptPolicy, Rest, copy_request, request_facts, scopes_of};
use crate::span::attempt_span;

/// A hedge in flight beside the first attempt.
pub(crate) struct SentHedge<RB> {
    /// Its response future (holding its slot, and its budget charges until it ends).
    pub(crate) fut: BoxFuture<Result<Response<RB>, BoxError>>,
    /// Its span.
    pub(crate) span: tracing::Span,
    /// The upstream it went to.
    pub(crate) target: usize,
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

/// Decides and sends the hedge, if the rules allow one now.
pub(crate) fn send<S, P, B, RB>(rest: &Rest<S, P, B>) -> Option<SentHedge<RB>>
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
    crate::retry::admitted_attempt(&mut this, rest.deadline, slot, next);
    let span = attempt_span(dep, req, next, 1);
    let svc = rest.svc.clone();
    let fut_span = span.clone();
    let call = async move {
        let result = svc.oneshot(this).instrument(fut_span).await;
        drop(charges);
        result
    };
    Some(SentHedge { fut: Box::pin(call), span, target: next })
}
