//! The middleware: every attempt under the cap, and the request's life (docs/rules.md) over
//! reqwest's types.
//!
//! The order of a request's steps is core's [`Life`], run by tower's
//! [`drive`](stormguard_tower::call::drive) — the shell the closure API runs too; this module
//! only carries reqwest's requests and responses through it.

use std::time::SystemTime;

use http::Extensions;
use reqwest::{Request, Response};
use reqwest_middleware::{Next, Result};
use stormguard_core::Denied;
use stormguard_core::clock::Timestamp;
use stormguard_core::conditions::AttemptFailure;
use stormguard_core::decision::{FailedAttempt, RequestFacts};
use stormguard_core::life::Life;
use stormguard_http::classify::{classify_response, classify_transport, is_idempotent};
use stormguard_http::stacked::mark_attempt;
use stormguard_tower::call::{Judged, Sent, drive};
use stormguard_tower::cap::{FirstTry, admit_first_try};
use stormguard_tower::extensions::RateCost;
use stormguard_tower::{Deadline, Dependency, Idempotent, RouteBudget, StormguardError};
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
/// [`RouteBudget`] and [`FanOutScope`](stormguard_tower::FanOutScope).
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

/// The whole request: its first try's admission (the tower layer's own, [`admit_first_try`]),
/// then its life over reqwest's requests and responses ([`drive`], the shell the closure API
/// runs too).
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
    // The call tree's context, read once: it enters the ledger as the first try is admitted.
    let tree = dep.tree_context(req.headers());
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
    let admitted = match admit_first_try(dep, 0, cost, deadline, dep.now(), tree) {
        FirstTry::Now(a) => Ok(a),
        FirstTry::Wait(w) => w.await,
        FirstTry::Refused(reason) => Err(reason),
    };
    let admission = match admitted {
        Ok(a) => a,
        Err(reason) => {
            tracing::trace!(dependency = dep.name(), %reason, "first try refused");
            return Err(refused(StormguardError::Denied(reason)));
        }
    };
    let scopes = stormguard_tower::retry::scopes(dep, extensions, route.as_ref(), tree.as_ref());
    let mut life = Life::new(facts, scopes, 0).with_tree(tree);
    let gates = dep.gates(cost);
    let hedge_after = match (&spare, config.retry.hedge) {
        (Some(_), Some(_)) => dep.policy().hedge_after(dep.upstream(), || dep.now()),
        _ => None,
    };
    // Every attempt but a hedge sends with the caller's own extensions, one after the other (the
    // chain below takes them by `&mut`: what it writes on the first attempt, a retry sees, and
    // the caller sees the last one's); a hedge runs beside another, with a copy of its own.
    let template = hedge_after.map(|_| extensions.clone());
    let caller = std::sync::Mutex::new(Some(extensions));
    let mut first = Some(req);
    let send = |sent: Sent| {
        let req = match first.take() {
            Some(req) => Some(req),
            None => {
                let mut req = spare.as_ref().and_then(Request::try_clone);
                if let Some(r) = &mut req {
                    match sent.hedge {
                        true => stormguard_http::stacked::mark_hedge(r.headers_mut(), sent.number),
                        false => mark_attempt(r.headers_mut(), sent.number),
                    }
                    stormguard_http::tree::mark(r.headers_mut(), sent.tree.as_ref());
                }
                req
            }
        };
        let own = match sent.hedge {
            true => None,
            false => caller.lock().unwrap_or_else(|e| e.into_inner()).take(),
        };
        let ext = match own {
            Some(e) => Own::Caller(e, &caller),
            None => Own::Copy(template.clone().unwrap_or_default()),
        };
        traced_send(dep, next.clone(), ext, req, sent, deadline)
    };
    let judge = |(_, result): &(Span, std::result::Result<Response, Failed>)| {
        match failed_attempt(dep, result) {
            Some(failed) => Judged::Failed(failed),
            None if result.is_ok() => Judged::Answer,
            // A local refusal of this attempt (final, and nothing the budget counts); a retry
            // refused at its breaker probe never reached the dependency.
            None => Judged::Unsent(match result {
                Err(Failed::Final(reqwest_middleware::Error::Middleware(e))) => {
                    e.downcast_ref::<StormguardError>().and_then(StormguardError::denied)
                }
                _ => None,
            }),
        }
    };
    let body_limit = config.body_limit;
    // Keep the failed response until the retry is sent; reading it to the end also frees its
    // slot. Too large to keep: the caller gets this response, not a retry.
    let keep = |(span, result): (Span, std::result::Result<Response, Failed>)| async move {
        match result {
            Ok(resp) => match response::keep(resp, body_limit).await {
                Ok(kept) => Ok((span, Ok(kept))),
                Err(partial) => Err((span, Ok(partial))),
            },
            Err(e) => Ok((span, Err(e))),
        }
    };
    let first = Sent::first(admission, 0, tree);
    let driven = drive(dep, &gates, &mut life, first, hedge_after, send, judge, keep).await;
    let ((span, result), reason) = (driven.out, driven.refused);
    finish_at(&span, result, reason)
}

/// The extensions an attempt sends with: the caller's own, given back to their slot when the
/// attempt is done (for the next attempt, and the caller), or a hedge's copy.
enum Own<'a, 'e> {
    Caller(&'e mut Extensions, &'a std::sync::Mutex<Option<&'e mut Extensions>>),
    Copy(Extensions),
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

/// One attempt in its `tracing` span (tower's, named as OpenTelemetry names resends): the span
/// records where it went, the status or failure, and is returned so a refusal of its retry can
/// be recorded on it. `req` is `None` when a request that could be copied once could not be
/// copied again: the attempt is refused as `body`, unsent.
async fn traced_send(
    dep: &Dependency,
    next: Next<'_>,
    mut ext: Own<'_, '_>,
    req: Option<Request>,
    sent: Sent,
    deadline: Option<Timestamp>,
) -> (Span, std::result::Result<Response, Failed>) {
    use tracing::Instrument;
    let Some(req) = req else {
        let body = reqwest_middleware::Error::middleware(StormguardError::Denied(Denied::Body));
        return (Span::none(), Err(Failed::Final(body)));
    };
    let span = stormguard_tower::span::span_for(dep, req.method().as_str(), 0, sent.number - 1);
    if !span.is_disabled() {
        let url = req.url();
        stormguard_tower::span::record_server(&span, url.host_str(), url.port_or_known_default());
    }
    let extensions = match &mut ext {
        Own::Caller(e, _) => &mut **e,
        Own::Copy(e) => e,
    };
    let result =
        attempt::send(dep, next, extensions, req, sent, deadline).instrument(span.clone()).await;
    if let Own::Caller(e, slot) = ext {
        *slot.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
    }
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
