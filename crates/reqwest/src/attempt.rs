//! One attempt under the cap: the send, under the breaker's probe and the per-try timeout
//! (tower's [`cap`](stormguard_tower::cap) helpers), its slots held by the response's body.

use http::Extensions;
use reqwest::{Request, Response};
use reqwest_middleware::Next;
use stormguard_core::breaker::AttemptResult;
use stormguard_core::clock::Timestamp;
use stormguard_http::classify::{TransportError, classify_response, classify_transport};
use stormguard_tower::call::Sent;
use stormguard_tower::cap::{Outstanding, per_try_limit, probe, timed_out};
use stormguard_tower::error::classify_error;
use stormguard_tower::rate::RateReservation;
use stormguard_tower::{Dependency, StormguardError};

use crate::response;

/// How an attempt ended without a response.
#[derive(Debug)]
pub(crate) enum Failed {
    /// Below HTTP: the error as the chain below returned it, and what it was.
    Transport(reqwest_middleware::Error, TransportError),
    /// stormguard's per-try timeout (or the request's deadline) passed before response headers.
    Timeout,
    /// Final and nothing the dependency did: stormguard refused the attempt (its breaker probe,
    /// an inner stormguard middleware), or reqwest refused the request before sending it (a bad
    /// URL, a redirect loop). Not retried; the breaker does not count it.
    Final(reqwest_middleware::Error),
}

/// Sends an admitted attempt down the rest of the chain and returns its response holding its
/// slots, or how it failed. The breaker's probe is taken here, for first tries and retries
/// alike; the per-try timeout runs to response headers.
pub(crate) async fn send(
    dep: &Dependency,
    next: Next<'_>,
    extensions: &mut Extensions,
    req: Request,
    sent: Sent,
    deadline: Option<Timestamp>,
) -> Result<Response, Failed> {
    let now = sent.at;
    let rate = sent.booking.map(|b| *b);
    // Never sent: the booking comes back.
    let refund = |rate: Option<RateReservation>| {
        if let Some(r) = rate {
            r.refund(dep.now());
        }
    };
    let probe = match probe(dep, 0, now) {
        Ok(p) => p,
        Err(reason) => {
            // Open, or half-open with every probe place taken, since this attempt was admitted.
            refund(rate);
            let refused = StormguardError::Denied(reason);
            return Err(Failed::Final(reqwest_middleware::Error::middleware(refused)));
        }
    };
    let per_try = per_try_limit(dep, now, deadline);
    // While the call is out its slots are the dependency's: dropped here (the caller left, or
    // a hedge won), they are held for abandon_hold — reqwest's call cannot run on without its
    // caller, so the hold stands in for the answer this client will not see.
    let mut out = Outstanding::new(dep, (sent.permit, sent.total));
    let call = next.run(req, extensions);
    let result = match per_try {
        None => call.await,
        Some(limit) => match tokio::time::timeout(limit, call).await {
            Ok(result) => result,
            Err(_) => {
                // The call is dropped, but the dependency is still working on the request:
                // its slot is held for timeout_slot_hold.
                timed_out(dep, 0, out.take(), probe);
                return Err(Failed::Timeout);
            }
        },
    };
    match result {
        Ok(resp) => {
            if let Some(p) = probe {
                let counted = AttemptResult::of(classify_response(resp.status(), resp.headers()));
                stormguard_tower::cap::record_probe(dep, 0, p, counted);
            }
            dep.apply_limits_at(0, resp.headers());
            stormguard_tower::rate::answered(dep, 0, now, resp.status(), resp.headers(), false);
            let mut slots = out.take();
            // The adaptive cap's sample (the upstream's: a total cap never adapts): latency to
            // the answer's head, or a drop.
            if let Some(p) = &mut slots.0 {
                p.answered(stormguard_tower::cap::overload_answer(resp.status()));
            }
            Ok(response::holding(resp, slots, rate, dep))
        }
        Err(e) => match classify(&e) {
            None => {
                if let Some(p) = probe {
                    stormguard_tower::cap::record_probe(dep, 0, p, AttemptResult::NotCounted);
                }
                drop(out.take());
                refund(rate);
                Err(Failed::Final(e))
            }
            // reqwest's own timeout: the dependency is still working on it, as after ours.
            Some(TransportError::Timeout) => {
                timed_out(dep, 0, out.take(), probe);
                Err(Failed::Transport(e, TransportError::Timeout))
            }
            Some(kind) => {
                if let Some(p) = probe {
                    let counted = AttemptResult::of(Some(classify_transport(kind).0));
                    stormguard_tower::cap::record_probe(dep, 0, p, counted);
                }
                drop(out.take());
                // A refused connection sent nothing; anything else may have been counted.
                match classify_transport(kind).1 {
                    true => refund(rate),
                    false => drop(rate),
                }
                Err(Failed::Transport(e, kind))
            }
        },
    }
}

/// What an error from the rest of the chain was, read by type, never by message; `None` for an
/// error that is final and not the dependency's doing.
///
/// reqwest says itself whether it was connecting (nothing was sent: a connect failure, even
/// when the connect timed out) or timed out (its own `timeout`); the rest is read from the
/// error's source chain as the tower layer reads hyper's (`h2`'s `REFUSED_STREAM`, hyper's
/// parse errors, I/O errors), and anything unknown is a reset: it may have reached the
/// dependency.
pub(crate) fn classify(error: &reqwest_middleware::Error) -> Option<TransportError> {
    match error {
        reqwest_middleware::Error::Reqwest(e) if e.is_builder() || e.is_redirect() => None,
        reqwest_middleware::Error::Reqwest(e) if e.is_connect() => Some(TransportError::Connect),
        reqwest_middleware::Error::Reqwest(e) if e.is_timeout() => Some(TransportError::Timeout),
        reqwest_middleware::Error::Reqwest(e) => Some(classify_error(e)),
        reqwest_middleware::Error::Middleware(e) => {
            match e.downcast_ref::<StormguardError>() {
                // Another stormguard layer below refused it: final.
                Some(StormguardError::Denied(_) | StormguardError::CallerBody { .. }) => None,
                _ => Some(classify_error(&**e)),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use stormguard_core::Denied;

    use super::*;

    /// A loopback port nobody listens on.
    fn closed_port() -> String {
        let free = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
        format!("http://{free}/")
    }

    async fn error_of(req: reqwest::RequestBuilder) -> reqwest_middleware::Error {
        reqwest_middleware::Error::Reqwest(req.send().await.unwrap_err())
    }

    #[tokio::test]
    async fn reads_reqwest_errors_by_what_reqwest_says() {
        let client = reqwest::Client::new();
        // Refused while connecting: nothing was sent, so even a POST may go again.
        let refused = error_of(client.post(closed_port())).await;
        assert_eq!(classify(&refused), Some(TransportError::Connect));
        // A request reqwest could not build never left: final, not the dependency's doing.
        let bad = error_of(client.get("http://[::1")).await;
        assert_eq!(classify(&bad), None);
    }

    #[tokio::test]
    async fn reads_reqwest_timeouts_as_timeouts() {
        // A server that accepts and never answers.
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let _keep = tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((s, _)) = listener.accept().await {
                held.push(s);
            }
        });
        let client = reqwest::Client::builder()
            .timeout(Duration::from_millis(50))
            .retry(reqwest::retry::never())
            .build()
            .unwrap();
        let err = error_of(client.get(format!("http://{addr}/"))).await;
        assert_eq!(classify(&err), Some(TransportError::Timeout), "{err:?}");
    }

    #[test]
    fn a_refusal_from_a_stormguard_layer_below_is_final() {
        let below = reqwest_middleware::Error::middleware(StormguardError::Denied(Denied::Queue));
        assert_eq!(classify(&below), None);
        // Anything else from a middleware below may have reached the dependency.
        let other = reqwest_middleware::Error::middleware(std::fmt::Error);
        assert_eq!(classify(&other), Some(TransportError::Reset));
    }
}
