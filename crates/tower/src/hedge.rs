//! Hedged requests in the tower layer: the first attempt alone until the hedge is due
//! ([`RetryPolicy::hedge_after`](stormguard_core::decision::RetryPolicy::hedge_after)), then —
//! if the request's life admits one now ([`Life::hedge_due`](stormguard_core::life::Life::hedge_due):
//! the retry rules' checks, then the total cap, the provider's window and a slot, never
//! waiting) — a hedge beside it, marked `x-stormguard-attempt: 2; hedge`, to the next upstream
//! when there are several; while `max_hedges` allows, another goes the same delay after the
//! last, if that one has not answered. The race itself is run by
//! [`RetryFuture`](crate::retry::RetryFuture), with the first attempt in place (a request that
//! never hedges pays no allocation for the possibility). The first successful answer is the
//! caller's; the other attempts are dropped and the cap runs each on in the background,
//! holding its slot until the dependency has finished it (the abandoned-attempt rules: counted
//! as abandoned). When all fail, the decision loop goes on from the last failure, as after any
//! failed attempt. A retry is never hedged.

use http_body::Body;
use stormguard_core::life::AttemptId;

use crate::cap::{BoxFuture, Inner};
use crate::policy::AttemptPolicy;
use crate::request::{Answer, Rest, send_admitted};
use crate::span::attempt_span;

/// A hedge in flight beside the first attempt.
pub(crate) struct SentHedge<RB> {
    /// Its response future (holding its slot).
    pub(crate) fut: BoxFuture<Answer<RB>>,
    /// Its span.
    pub(crate) span: tracing::Span,
    /// The attempt it is in the request's life, and its number in the headers.
    pub(crate) id: AttemptId,
    pub(crate) number: u32,
}

/// Sends a hedge beside attempt `hedged`, if the request's life admits one now
/// ([`Life::hedge_due`](stormguard_core::life::Life::hedge_due): the retry rules, then the total
/// cap, the provider's window and its upstream's slot, never waiting). Its budget and scope
/// charges stay with the life until the hedge has ended.
pub(crate) fn send<S, P, B, RB>(
    rest: &mut Rest<S, P, B>,
    hedged: AttemptId,
) -> Option<SentHedge<RB>>
where
    S: Inner<B, RB> + Clone,
    P: AttemptPolicy<B>,
    B: Send + 'static,
    RB: Body + Send + 'static,
{
    let now = rest.dep.now();
    let body = rest.policy.clone_body(&rest.req.body);
    let replayable = body.is_some();
    let cost = crate::extensions::rate_cost_in(&rest.req.head.extensions);
    let dep = rest.dep.clone();
    let gates = dep.gates(cost);
    let life = rest.life();
    life.set_replayable(replayable);
    let admitted = match life.hedge_due(&gates, now, hedged) {
        Ok(admitted) => admitted,
        Err(reason) => {
            if let Some(reason) = reason {
                tracing::debug!(dependency = dep.name(), %reason, "hedge refused");
            }
            return None;
        }
    };
    // Admitted only with a body to send (the rules refuse `body` otherwise).
    let body = body?;
    let (id, number, target) = (admitted.id, admitted.number, admitted.target);
    let req = &rest.req;
    let mut this = req.copy(body);
    stormguard_http::stacked::mark_hedge(this.headers_mut(), number);
    stormguard_http::tree::mark(this.headers_mut(), admitted.tree.as_ref());
    let span = attempt_span(&dep, &req.head.method, &req.head.uri, target, number - 1);
    let (svc, policy) = (rest.svc.clone(), rest.policy.clone());
    let fut = send_admitted(dep, svc, policy, this, rest.deadline, admitted, span.clone());
    Some(SentHedge { fut: Box::pin(fut), span, id, number })
}
