//! Downstream pushback: when stormguard decides a request should not be tried again — a retry
//! refused for load (budget, cap, breaker, attempts, pushback, deadline, scope) or a first try
//! shed (queue, breaker) — its answer tells the caller's own retry loop so, in the conventions
//! callers obey:
//!
//! - `x-should-retry: false`, which the OpenAI and Anthropic SDKs (and every SDK generated like
//!   them) read before their status rules: without it a 503 is retried twice by default, and
//!   each refused call comes back two more times;
//! - `Retry-After` (seconds) when a time is known: the breaker's break, the pushback hold an
//!   upstream's own `Retry-After` set, the provider's window's next room, the time a ratio
//!   budget allows a retry again (its spent retries leave its window); 1 s for a full cap or
//!   queue (a slot comes back when an attempt ends, which nobody can tell) and for a budget
//!   that waits on traffic (successes, retries ending); an upstream's own `Retry-After` passes
//!   through as it is;
//! - for gRPC callers, `grpc-retry-pushback-ms: -1` (gRPC's "do not retry", A6), and stormguard's
//!   own refusal is a trailers-only gRPC answer (`grpc-status` 14 `UNAVAILABLE`, 4
//!   `DEADLINE_EXCEEDED` for the deadline), which a gRPC client reads as a status and its
//!   pushback, where a bare HTTP 503 would be retried.
//!
//! A refusal for what the request is (`non-idempotent`, `body`, `stacked`) says nothing of
//! load: the caller may know better (it holds an idempotency key, or the body), so it gets no
//! advice. Responses stormguard did not refuse pass through untouched, the upstream's own
//! `x-should-retry` and rate-limit headers included. On by default; `downstream_pushback =
//! false` on a listener turns it off.

use std::time::Duration;

use http::{HeaderName, HeaderValue, Response, StatusCode};
use http_body_util::BodyExt;
use stormguard_core::Denied;

use crate::stack::{DENIED_HEADER, LocalAnswer, ProxyBody};

/// The header the OpenAI and Anthropic SDKs read before retrying.
pub(crate) static SHOULD_RETRY: HeaderName = HeaderName::from_static("x-should-retry");
/// gRPC's server pushback (A6): a negative value means "do not retry".
pub(crate) static GRPC_PUSHBACK: HeaderName = HeaderName::from_static("grpc-retry-pushback-ms");
static GRPC_STATUS: HeaderName = HeaderName::from_static("grpc-status");
static GRPC_MESSAGE: HeaderName = HeaderName::from_static("grpc-message");

/// The `Retry-After` of a refusal for a full cap or queue, when nothing longer is known.
const CAP_RETRY_AFTER: Duration = Duration::from_secs(1);

/// The answer with the advice its refusal calls for (see the module doc). `retry_after` is
/// asked only when the advice is given.
pub(crate) fn advise(
    mut resp: Response<ProxyBody>,
    grpc: bool,
    retry_after: impl FnOnce(Denied) -> Option<Duration>,
) -> Response<ProxyBody> {
    let Some(reason) = resp.extensions().get::<Denied>().copied().filter(|r| r.stands_down())
    else {
        return resp;
    };
    let local = resp.extensions().get::<LocalAnswer>().is_some();
    if grpc && local {
        resp = grpc_refusal(reason);
    }
    let headers = resp.headers_mut();
    headers.insert(SHOULD_RETRY.clone(), HeaderValue::from_static("false"));
    // A full cap or queue frees a slot as soon as an attempt ends, and a budget that waits on
    // traffic (a success, a retry ending) allows one again when that comes: times nobody knows.
    // The shortest wait a `Retry-After` can say (1 s), so a caller's loop does not come back at
    // once.
    let short =
        matches!(reason, Denied::Cap | Denied::Queue | Denied::Budget).then_some(CAP_RETRY_AFTER);
    if !headers.contains_key(http::header::RETRY_AFTER)
        && let Some(d) = retry_after(reason).or(short)
    {
        // Whole seconds, rounded up: a caller that waits this long finds the break over.
        let secs = d.as_secs() + u64::from(d.subsec_nanos() > 0);
        headers.insert(http::header::RETRY_AFTER, HeaderValue::from(secs.max(1)));
    }
    if !grpc {
        return resp;
    }
    if resp.headers().contains_key(&GRPC_STATUS) {
        // Trailers-only: the headers are the trailers.
        resp.headers_mut().insert(GRPC_PUSHBACK.clone(), HeaderValue::from_static("-1"));
        return resp;
    }
    // The upstream's status comes in its trailers: the pushback goes there with it.
    resp.map(|body| {
        body.map_frame(|mut frame| {
            if let Some(trailers) = frame.trailers_mut() {
                trailers.insert(GRPC_PUSHBACK.clone(), HeaderValue::from_static("-1"));
            }
            frame
        })
        .boxed_unsync()
    })
}

/// stormguard's own refusal to a gRPC caller: a trailers-only answer with the status a gRPC
/// client reads (14 `UNAVAILABLE`; 4 `DEADLINE_EXCEEDED` when the deadline was the reason).
fn grpc_refusal(reason: Denied) -> Response<ProxyBody> {
    let mut resp =
        Response::new(http_body_util::Empty::new().map_err(|never| match never {}).boxed_unsync());
    *resp.status_mut() = StatusCode::OK;
    let h = resp.headers_mut();
    h.insert(http::header::CONTENT_TYPE, HeaderValue::from_static("application/grpc"));
    let status = if reason == Denied::Deadline { "4" } else { "14" };
    h.insert(GRPC_STATUS.clone(), HeaderValue::from_static(status));
    // grpc-message is percent-encoded; this one is plain ASCII without `%`.
    let message = format!("stormguard refused ({reason})");
    h.insert(GRPC_MESSAGE.clone(), HeaderValue::from_str(&message).expect("ASCII"));
    h.insert(DENIED_HEADER.clone(), HeaderValue::from_static(reason.as_str()));
    h.insert(GRPC_PUSHBACK.clone(), HeaderValue::from_static("-1"));
    resp.extensions_mut().insert(LocalAnswer);
    resp.extensions_mut().insert(reason);
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refused(reason: &'static str, local: bool) -> Response<ProxyBody> {
        let reason: Denied = reason.parse().expect("a reason");
        let mut r = crate::stack::local(
            StatusCode::SERVICE_UNAVAILABLE,
            Some(crate::stack::Why::Denied(reason)),
            "stormguard: refused\n",
        );
        if !local {
            r.extensions_mut().remove::<LocalAnswer>();
        }
        r
    }

    #[test]
    fn load_refusals_tell_the_caller_to_stand_down() {
        for reason in ["budget", "cap", "breaker", "attempts", "pushback", "deadline", "queue"] {
            let r = advise(refused(reason, true), false, |_| None);
            assert_eq!(r.headers()[&SHOULD_RETRY], "false", "{reason}");
            // A full cap or queue, or a budget, says a short wait; the others only a known one.
            let short = matches!(reason, "cap" | "queue" | "budget");
            let said = r.headers().get(http::header::RETRY_AFTER).map(|v| v.to_str().unwrap());
            assert_eq!(said, short.then_some("1"), "{reason}");
        }
        // A known wait wins over the short one.
        let r = advise(refused("queue", true), false, |_| Some(Duration::from_millis(2_500)));
        assert_eq!(r.headers()[http::header::RETRY_AFTER], "3");
        // What the request is says nothing of load.
        for reason in ["non-idempotent", "body", "stacked"] {
            let r = advise(refused(reason, true), false, |_| Some(Duration::from_secs(5)));
            assert!(!r.headers().contains_key(&SHOULD_RETRY), "{reason}");
        }
        // Not refused: untouched.
        let ok = crate::stack::local(StatusCode::SERVICE_UNAVAILABLE, None, "upstream 503\n");
        assert!(!advise(ok, false, |_| None).headers().contains_key(&SHOULD_RETRY));
    }

    #[test]
    fn a_known_time_is_retry_after_rounded_up_and_the_upstreams_own_wins() {
        let r = advise(refused("breaker", true), false, |_| Some(Duration::from_millis(2_100)));
        assert_eq!(r.headers()[http::header::RETRY_AFTER], "3");
        let mut own = refused("pushback", false);
        own.headers_mut().insert(http::header::RETRY_AFTER, HeaderValue::from_static("30"));
        let r = advise(own, false, |_| Some(Duration::from_secs(2)));
        assert_eq!(r.headers()[http::header::RETRY_AFTER], "30");
    }

    #[test]
    fn a_grpc_caller_gets_a_status_and_pushback() {
        let r = advise(refused("budget", true), true, |_| None);
        assert_eq!(r.status(), StatusCode::OK);
        assert_eq!(r.headers()["grpc-status"], "14");
        assert_eq!(r.headers()[&GRPC_PUSHBACK], "-1");
        assert_eq!(r.headers()[&DENIED_HEADER], "budget");
        let r = advise(refused("deadline", true), true, |_| None);
        assert_eq!(r.headers()["grpc-status"], "4");
    }
}
