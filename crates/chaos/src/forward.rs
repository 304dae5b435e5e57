//! Chaos as a service in the middle of a call tree (`--forward URL`): a request that draws a
//! plain answer calls the next hop — the same method and path, no body — and answers with what
//! came of it, as a service that calls a dependency does:
//!
//! - the request it makes carries on the caller's trace context (`traceparent`, `baggage`: what
//!   an OpenTelemetry-instrumented service propagates) and an `x-request-id` of its own, as a
//!   service's HTTP client stamps each call;
//! - its answer is its own: 200 for a success below, 502 for a failure below (a 5xx, a 429, no
//!   answer), the status itself for any other 4xx — and none of the answer's headers (a service
//!   does not relay `x-should-retry` or `Retry-After` of a call it made).
//!
//! The service's own failures (the phase's `error_rate`, resets, latency) are drawn before the
//! call, as before; what it sees is counted as for any chaos server.

use crate::ids::{REQUEST_ID, RequestIds};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Method, Request, StatusCode, Uri};
use http_body_util::Empty;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

/// How long the call below may take before the service gives up on it (and answers 502).
pub const CALL_TIMEOUT: Duration = Duration::from_secs(30);

/// What of the caller's request the call below carries.
#[derive(Debug)]
pub(crate) struct Outbound {
    method: Method,
    path: String,
    carried: HeaderMap,
}

impl Outbound {
    /// The parts of `req` the call below is made from.
    pub(crate) fn of<B>(req: &Request<B>) -> Outbound {
        let mut carried = HeaderMap::new();
        for name in ["traceparent", "tracestate", "baggage"] {
            for v in req.headers().get_all(name) {
                carried.append(name, v.clone());
            }
        }
        Outbound {
            method: req.method().clone(),
            path: req.uri().path_and_query().map_or("/", |p| p.as_str()).to_string(),
            carried,
        }
    }
}

/// The next hop, and the client that calls it.
#[derive(Debug)]
pub(crate) struct Forwarder {
    base: Uri,
    client: Client<HttpConnector, Empty<Bytes>>,
    ids: RequestIds,
}

impl Forwarder {
    pub(crate) fn new(base: Uri) -> Forwarder {
        let client = Client::builder(TokioExecutor::new()).build_http();
        Forwarder { base, client, ids: RequestIds::new() }
    }

    /// Calls the next hop and returns the service's own answer's status.
    pub(crate) async fn call(&self, out: Outbound) -> StatusCode {
        let uri = format!(
            "{}://{}{}",
            self.base.scheme_str().unwrap_or("http"),
            self.base.authority().map_or("", |a| a.as_str()),
            out.path
        );
        let Ok(mut req) = Request::builder().method(out.method).uri(uri).body(Empty::new()) else {
            return StatusCode::BAD_GATEWAY;
        };
        *req.headers_mut() = out.carried;
        req.headers_mut().insert(REQUEST_ID.clone(), self.ids.next());
        match tokio::time::timeout(CALL_TIMEOUT, self.client.request(req)).await {
            Ok(Ok(resp)) => {
                let status = resp.status();
                // The answer is read whole (and dropped) before the service answers, as a
                // service reads what it called.
                let _ = http_body_util::BodyExt::collect(resp.into_body()).await;
                answer_for(status)
            }
            _ => StatusCode::BAD_GATEWAY,
        }
    }
}

/// The service's answer for what the call below answered.
fn answer_for(below: StatusCode) -> StatusCode {
    if below.is_success() {
        StatusCode::OK
    } else if below.is_server_error() || below == StatusCode::TOO_MANY_REQUESTS {
        StatusCode::BAD_GATEWAY
    } else {
        below
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_service_answers_in_its_own_words() {
        assert_eq!(answer_for(StatusCode::CREATED), StatusCode::OK);
        assert_eq!(answer_for(StatusCode::SERVICE_UNAVAILABLE), StatusCode::BAD_GATEWAY);
        assert_eq!(answer_for(StatusCode::TOO_MANY_REQUESTS), StatusCode::BAD_GATEWAY);
        assert_eq!(answer_for(StatusCode::NOT_FOUND), StatusCode::NOT_FOUND);
    }
}
