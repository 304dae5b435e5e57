//! The middleware: the retry decision (docs/rules.md) on each failed attempt, every attempt
//! under the cap — the tower [`Retry`](stormguard_tower::Retry) layer's order of calls, over
//! reqwest's types.
//!
//! The decision itself is [`RetryPolicy::decide`](stormguard_core::decision::RetryPolicy::decide)
//! and [`admit`](stormguard_core::decision::RetryPolicy::admit), the same code the tower layer,
//! the proxy and the simulator run; this module only carries reqwest's requests and responses
//! through it.

use std::time::SystemTime;

use http::Extensions;
use reqwest::{Request, Response};
use reqwest_middleware::{Next, Result};
use stormguard_core::Denied;
use stormguard_core::clock::Timestamp;
use stormguard_core::conditions::AttemptFailure;
use stormguard_core::decision::{FailedAttempt, RequestFacts};
use stormguard_core::life::{AttemptId, Life, Next as LifeNext};
use stormguard_core::scope::Scope;
use stormguard_http::classify::{classify_response, classify_transport, is_idempotent};
use stormguard_http::stacked::mark_attempt;
use stormguard_tower::dependency::DependencyGates;
use stormguard_tower::extensions::RateCost;
use stormguard_tower::{
    Deadline, Dependency, FanOutScope, Idempotent, RouteBudget, StormguardError,
};
use tracing::Span;

use crate::attempt::{self, Failed};
use crate::response;

/// A [`reqwest_middleware::Middleware`] that puts every attempt to a dependency under its cap
/// and its retries under its budget. See the [crate docs](crate).
///
/// Clones share the [`Dependency`]; so does a tower [`StormguardLayer`](stormguard_tower::StormguardLayer)
/// built over the same one: a service that calls one dependency through both still has one cap
/// and one budget.
///
/// Request extensions (`RequestBuilder::with_extension`) it reads: [`Idempotent`] (any method
/// may be retried), [`Deadline`] (the whole request's, shortening the dependency's),
/// [`RouteBudget`] and [`FanOutScope`].
#[derive(Clone, Debug)]
pub struct StormguardMiddleware {
    dependency: Dependency,
}

impl StormguardMiddleware {
    /// The middleware for `dependency`.
    pub fn new(dependency: Dependency) -> StormguardMiddleware {
        StormguardMiddleware { dependency }
    }

    /// The dependency: its counters, limiter and budget (`snapshot`), and the metrics export.
    pub fn dependency(&self) -> &Dependency {
        &self.dependency
    }
}

#[async_trait::async_trait]
impl reqwest_middleware::Middleware for StormguardMiddleware {
    async fn handle(
        &self,
        req: Request,
        extensions: &mut Extensions,
        next: Next<'_>,
    ) -> Result<Response> {
        run(&self.dependency, req, extensions, next).await
    }
}

/// The whole request: the first attempt, then (only after a failure) the decision loop.
async fn run(
    dep: &Dependency,
    req: Request,
    extensions: &mut Extensions,
    next: Next<'_>,
) -> Result<Response> {
    let config = dep.config();
    let route = extensions.get::<RouteBudget>().cloned();
    let (_, deadline) = stormguard_tower::retry::request_start(
        dep,
        route.as_ref(),
        extensions.get::<Deadline>().copied(),
    );
    // The copy a retry sends: reqwest's own `try_clone`, which has none for a streaming body.
    // Such a request is sent once, and its retry refused as `body`.
    let spare = req.try_clone();
    let facts = RequestFacts {
        idempotent: is_idempotent(
            req.method(),
            req.headers(),
            &config.idempotency_key,
            extensions.get::<Idempotent>().is_some(),
        ),
        replayable: spare.is_some(),
        stacked: config.stacked.arrived_as_retry(req.headers()),
        deadline,
    };
    let cost = rate_cost(dep, &req, extensions);
    let slots = match attempt::admit_primary(dep, deadline, cost).await {
        Ok(slots) => slots,
        Err(reason) => {
            tracing::trace!(dependency = dep.name(), %reason, "first try refused");
            return Err(refused(StormguardError::Denied(reason)));
        }
    };
    let mut scopes = Vec::new();
    if let Some(s) = extensions.get::<FanOutScope>() {
        scopes.push(Scope::FanOut(s.clone()));
    }
    if let Some(r) = route {
        scopes.push(Scope::Route(r.0));
    }
    let mut life = Life::new(facts, scopes, 0);
    let gates = dep.gates(cost);
    let hedge_after = match (&spare, config.retry.hedge) {
        (Some(_), Some(_)) => dep.policy().hedge_after(dep.upstream(), || dep.now()),
        _ => None,
    };
    let (id, span, result) = match hedge_after {
        Some(delay) => {
            let first = First { req, slots, deadline };
            hedged(dep, next.clone(), extensions, first, (&mut life, &gates), delay).await
        }
        None => {
            let (span, result) =
                traced_send(dep, next.clone(), extensions, req, slots, deadline, 0).await;
            (AttemptId::FIRST, span, result)
        }
    };
    let answered = Answered { id, number: 1, span, result };
    retry_loop(dep, spare, extensions, next, Loop { life, gates, deadline }, answered).await
}

/// A first attempt, admitted.
struct First {
    req: Request,
    slots: (attempt::Slots, Option<stormguard_tower::rate::RateReservation>),
    deadline: Option<Timestamp>,
}

/// The first attempt alone until `delay`, then — if the request's life admits a hedge now
/// ([`Life::hedge_due`], the tower layer's rules and admission) — a hedge beside it, marked
/// `x-stormguard-attempt: 2; hedge`, and while `max_hedges` allows, another the same delay after
/// the last, beside it, if that one has not answered (as the tower layer does). The first
/// success is the caller's; the other attempts are dropped, each slot held for `abandon_hold`
/// (reqwest cannot run a call on without its caller). When all fail, the last failure goes to
/// the decision loop.
async fn hedged(
    dep: &Dependency,
    next: Next<'_>,
    extensions: &mut Extensions,
    first: First,
    (life, gates): (&mut Life, &DependencyGates<'_>),
    delay: std::time::Duration,
) -> (AttemptId, Span, std::result::Result<Response, Failed>) {
    type Answer = (AttemptId, Span, std::result::Result<Response, Failed>);
    let First { req, slots, deadline } = first;
    let spare = req.try_clone();
    let max_hedges = dep.config().retry.hedge.map_or(0, |h| h.max_hedges) as usize;
    // Each hedge sends with extensions of its own (the chain below takes them by `&mut`).
    let mut own: Vec<Extensions> = (0..max_hedges).map(|_| extensions.clone()).collect();
    let mut own = own.iter_mut();
    let first = traced_send(dep, next.clone(), extensions, req, slots, deadline, 0);
    let mut inflight: Vec<
        std::pin::Pin<Box<dyn std::future::Future<Output = Answer> + Send + '_>>,
    > = vec![Box::pin(async move {
        let (span, result) = first.await;
        (AttemptId::FIRST, span, result)
    })];
    let mut hedged = AttemptId::FIRST;
    let mut timer = Some(Box::pin(tokio::time::sleep(delay)));
    enum Event {
        Answered(usize, Answer),
        Due,
    }
    loop {
        let event = std::future::poll_fn(|cx| {
            for (i, f) in inflight.iter_mut().enumerate() {
                if let std::task::Poll::Ready(answer) = f.as_mut().poll(cx) {
                    return std::task::Poll::Ready(Event::Answered(i, answer));
                }
            }
            match timer.as_mut().map(|t| t.as_mut().poll(cx)) {
                Some(std::task::Poll::Ready(())) => std::task::Poll::Ready(Event::Due),
                _ => std::task::Poll::Pending,
            }
        })
        .await;
        match event {
            Event::Answered(i, (id, span, result)) => {
                drop(inflight.swap_remove(i));
                let won = matches!(&result, Ok(resp) if classify_response(resp.status(), resp.headers()).is_none());
                if won || inflight.is_empty() {
                    return (id, span, result);
                }
                life.ended(id);
                if id == hedged {
                    // The attempt the next hedge was for has answered.
                    timer = None;
                }
            }
            Event::Due => {
                timer = None;
                let (Some(mut hedge_req), Some(ext)) =
                    (spare.as_ref().and_then(Request::try_clone), own.next())
                else {
                    continue;
                };
                let Ok(admitted) = life.hedge_due(gates, dep.now(), hedged) else { continue };
                let id = admitted.id;
                let slots = ((admitted.permit, admitted.total), admitted.booking);
                stormguard_http::stacked::mark_hedge(hedge_req.headers_mut(), admitted.number);
                let resend = admitted.number - 1;
                let send = traced_send(dep, next.clone(), ext, hedge_req, slots, deadline, resend);
                inflight.push(Box::pin(async move {
                    let (span, result) = send.await;
                    (id, span, result)
                }));
                hedged = id;
                if life.may_hedge(dep.policy()) {
                    timer = Some(Box::pin(tokio::time::sleep(delay)));
                }
            }
        }
    }
}

/// A request's token cost for rate admission: the caller's [`RateCost`] extension, or, when
/// tokens are metered (or may be learned), the estimate from its body (`max_tokens`, its size:
/// [`stormguard_http::provider::estimate`]) when the body is in memory. None otherwise.
fn rate_cost(dep: &Dependency, req: &Request, extensions: &Extensions) -> RateCost {
    if let Some(c) = extensions.get::<RateCost>() {
        return *c;
    }
    match req.body().and_then(reqwest::Body::as_bytes) {
        Some(body) if dep.config().rate.meters_tokens() => {
            let t = stormguard_http::provider::estimate(
                body,
                stormguard_http::provider::Estimator::default(),
            );
            RateCost::from(t)
        }
        _ => RateCost::default(),
    }
}

/// What the decision loop needs besides the request.
struct Loop<'d> {
    life: Life,
    gates: DependencyGates<'d>,
    deadline: Option<Timestamp>,
}

/// An attempt's answer: which attempt it was, its number in the headers (1: the first try),
/// its span (a refusal of its retry is recorded there), and what came back.
struct Answered {
    id: AttemptId,
    number: u32,
    span: Span,
    result: std::result::Result<Response, Failed>,
}

/// The failure an attempt's outcome is, as the decision reads it, with what the dependency said
/// about retrying (`Retry-After` and the other pushback headers): `None` for a success or a final
/// refusal.
fn failed_attempt(
    dep: &Dependency,
    result: &std::result::Result<Response, Failed>,
) -> Option<FailedAttempt> {
    match result {
        Ok(resp) => {
            let failure = classify_response(resp.status(), resp.headers())?;
            let pushback = dep.config().pushback_headers.read_pushback(
                resp.headers(),
                resp.status(),
                SystemTime::now(),
                dep.header_stats(),
            );
            dep.log_malformed_once();
            // A provider that refused the request before running it (a rate limit, an
            // overload): a POST may be sent again.
            let unsent =
                dep.config().rate.provider.is_some_and(|p| p.refused_unprocessed(resp.status()));
            Some(FailedAttempt { failure, unsent, pushback })
        }
        // A local refusal of this attempt: final, and nothing the budget counts.
        Err(Failed::Final(_)) => None,
        Err(Failed::Timeout) => Some(AttemptFailure::Timeout.into()),
        Err(Failed::Transport(_, kind)) => {
            let (failure, unsent) = classify_transport(*kind);
            Some(FailedAttempt { failure, unsent, pushback: None })
        }
    }
}

/// The decision loop, from the first attempt's answer: the order of what happens is the
/// request's [`Life`]'s; this loop only carries reqwest's requests and responses through it.
/// `req` is the copy a retry sends (`None`: the body cannot be sent again, and a retry the
/// rules would allow is refused `body`).
async fn retry_loop(
    dep: &Dependency,
    req: Option<Request>,
    extensions: &mut Extensions,
    next: Next<'_>,
    Loop { mut life, gates, deadline }: Loop<'_>,
    answered: Answered,
) -> Result<Response> {
    let body_limit = dep.config().body_limit;
    // The jitter's source, drawn at the first failure: a request that succeeds at once takes
    // no number from the dependency's counter.
    let mut rng = None;
    let Answered { mut id, mut number, mut span, mut result } = answered;
    life.set_replayable(req.is_some());
    loop {
        let now = dep.now();
        let Some(failed) = failed_attempt(dep, &result) else {
            match &result {
                Ok(_) => life.succeeded(dep.policy(), || now, id),
                // A local refusal of this attempt (final, and nothing the budget counts); a
                // retry refused at its breaker probe never reached the dependency.
                Err(_) => life.unsent(dep.policy(), now, id),
            }
            return finish_at(&span, result, None);
        };
        let rng = rng.get_or_insert_with(|| dep.request_rng());
        let wait = match life.failed(&gates, now, id, &failed, rng) {
            LifeNext::Answer(reason) => {
                if let Some(reason) = reason {
                    tracing::trace!(dependency = dep.name(), attempt = number, %reason, "retry refused");
                }
                return finish_at(&span, result, reason);
            }
            LifeNext::Retry { wait, .. } => wait,
        };
        let Some(mut this) = req.as_ref().and_then(Request::try_clone) else {
            life.give_up(dep.policy(), now);
            return finish_at(&span, result, Some(Denied::Body));
        };
        // Keep the failed response until the retry is sent; reading it to the end also frees
        // its slot.
        let kept = match result {
            Ok(resp) => match response::keep(resp, body_limit).await {
                Ok(kept) => Ok(kept),
                Err(partial) => {
                    // Too large to keep: give the caller this response, not a retry.
                    life.give_up(dep.policy(), dep.now());
                    return Ok(partial);
                }
            },
            Err(e) => Err(e),
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
        match life.wait_elapsed(&gates, dep.now()) {
            Ok(admitted) => {
                (id, number) = (admitted.id, admitted.number);
                let slots = ((admitted.permit, admitted.total), admitted.booking);
                mark_attempt(this.headers_mut(), number);
                (span, result) =
                    traced_send(dep, next.clone(), extensions, this, slots, deadline, number - 1)
                        .await;
            }
            Err(reason) => {
                tracing::trace!(dependency = dep.name(), attempt = number, %reason, "retry refused");
                return finish_at(&span, kept, Some(reason));
            }
        }
    }
}

/// One attempt in its `tracing` span (tower's, named as OpenTelemetry names resends): the span
/// records where it went, the status or failure, and is returned so a refusal of its retry can
/// be recorded on it.
async fn traced_send(
    dep: &Dependency,
    next: Next<'_>,
    extensions: &mut Extensions,
    req: Request,
    slots: (attempt::Slots, Option<stormguard_tower::rate::RateReservation>),
    deadline: Option<Timestamp>,
    resend_count: u32,
) -> (Span, std::result::Result<Response, Failed>) {
    use tracing::Instrument;
    let span = stormguard_tower::span::span_for(dep, req.method().as_str(), 0, resend_count);
    if !span.is_disabled() {
        let url = req.url();
        stormguard_tower::span::record_server(&span, url.host_str(), url.port_or_known_default());
    }
    let result =
        attempt::send(dep, next, extensions, req, slots, deadline).instrument(span.clone()).await;
    match &result {
        Ok(resp) => stormguard_tower::span::record_response(
            &span,
            resp.status(),
            classify_response(resp.status(), resp.headers()),
        ),
        Err(Failed::Timeout) => {
            stormguard_tower::span::record_failure(&span, AttemptFailure::Timeout)
        }
        Err(Failed::Transport(_, kind)) => {
            stormguard_tower::span::record_failure(&span, classify_transport(*kind).0)
        }
        Err(Failed::Final(_)) => {}
    }
    (span, result)
}

/// [`finish`], the refusal (if any) recorded on the attempt's span.
fn finish_at(
    span: &Span,
    result: std::result::Result<Response, Failed>,
    reason: Option<Denied>,
) -> Result<Response> {
    if let Some(r) = reason {
        stormguard_tower::span::record_denied(span, r);
    }
    finish(result, reason)
}

/// Returns the last outcome to the caller, with the reason its retry was refused: in the
/// response's extensions, or around the error ([`StormguardError::NotRetried`]). An error whose
/// failure was not retryable goes back as the chain below returned it.
fn finish(
    result: std::result::Result<Response, Failed>,
    reason: Option<Denied>,
) -> Result<Response> {
    let (source, reason): (stormguard_tower::BoxError, Denied) = match (result, reason) {
        (Ok(mut resp), reason) => {
            if let Some(r) = reason {
                resp.extensions_mut().insert(r);
            }
            return Ok(resp);
        }
        (Err(Failed::Final(e)), _) | (Err(Failed::Transport(e, _)), None) => return Err(e),
        (Err(Failed::Timeout), None) => return Err(refused(StormguardError::Timeout)),
        (Err(Failed::Transport(e, _)), Some(reason)) => (Box::new(e), reason),
        (Err(Failed::Timeout), Some(reason)) => (Box::new(StormguardError::Timeout), reason),
    };
    Err(refused(StormguardError::NotRetried { reason, source }))
}

/// stormguard's own error, as reqwest-middleware carries it.
fn refused(e: StormguardError) -> reqwest_middleware::Error {
    reqwest_middleware::Error::middleware(e)
}
