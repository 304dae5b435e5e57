//! The listeners: each connection served by hyper-util's auto builder (HTTP/1.1, and h2c by
//! prior knowledge), each request checked, routed, and sent through its dependency's stack.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use http::header::HOST;
use http::{Method, Request, Response, StatusCode, Uri, Version};
use hyper::body::Incoming;
use stormguard_core::budget::FailureKind;
use stormguard_core::signals::CallerRetryOutcome;
use stormguard_tower::{Idempotent, RouteBudget};
use tower::Service;

use crate::callers::{Answered, CallerRetries};
use crate::hop::strip_hop_by_hop;
use crate::outgoing::{AttemptLog, OutgoingBody};
use crate::stack::{LocalError, ProxyBody, local};
use crate::state::{DepRuntime, Shared, State};
use crate::traffic::Caller;

/// The `route` label of requests no route matched (the listener's dependency).
static DEFAULT_ROUTE: std::sync::LazyLock<Arc<str>> =
    std::sync::LazyLock::new(|| Arc::from("default"));

/// The host a request names, lowercased, without its port.
fn request_host(req: &Request<Incoming>) -> Option<String> {
    let authority =
        req.uri().authority().map(|a| a.as_str().to_string()).or_else(|| {
            req.headers().get(HOST).and_then(|h| h.to_str().ok()).map(str::to_string)
        })?;
    let host = authority.rsplit_once('@').map_or(authority.as_str(), |(_, h)| h);
    let host = match host.strip_prefix('[') {
        Some(v6) => v6.split(']').next().unwrap_or(""),
        None => host.split(':').next().unwrap_or(""),
    };
    Some(host.to_ascii_lowercase())
}

/// Whether an absolute-form request (`GET http://host/ HTTP/1.1`) names a host this proxy
/// serves: the listener itself, a configured upstream, or a route's host. Anything else is
/// refused: the proxy is not an open proxy.
fn serves_authority(shared: &Shared, listener: SocketAddr, uri: &Uri) -> bool {
    let Some(authority) = uri.authority() else { return true };
    let port = authority.port_u16().unwrap_or(80);
    let host = authority.host().trim_start_matches('[').trim_end_matches(']').to_ascii_lowercase();
    let is_listener = port == listener.port()
        && (host == "localhost"
            || host.parse::<std::net::IpAddr>().is_ok_and(|ip| {
                ip == listener.ip() || (listener.ip().is_unspecified() && ip.is_loopback())
            }));
    let is_upstream = shared.deps.iter().flat_map(|d| d.upstreams.iter()).any(|u| {
        u.authority().is_some_and(|a| {
            a.host().eq_ignore_ascii_case(&host) && crate::upstream::port_of(u) == port
        })
    });
    let is_route = shared.routes.iter().any(|r| r.host.as_deref() == Some(host.as_str()));
    is_listener || is_upstream || is_route
}

/// The route for a request: the longest matching path prefix, a route naming the host before
/// one that does not; then the listener's dependency.
fn route(shared: &Shared, host: Option<&str>, path: &str) -> Option<usize> {
    shared
        .routes
        .iter()
        .enumerate()
        .filter(|(_, r)| {
            r.host.as_deref().is_none_or(|h| Some(h) == host) && path.starts_with(&r.path_prefix)
        })
        .max_by_key(|(_, r)| (r.path_prefix.len(), r.host.is_some()))
        .map(|(i, _)| i)
}

/// A caller's own retry, and how it was told.
#[derive(Clone, Copy)]
struct Recognised {
    retry: stormguard_tower::CallerRetry,
    /// The layer that sent it marked it (its later retries will be marked too).
    marked: bool,
}

/// The caller's own retry a request is, if it is one: marked as a retry by the layer that
/// sent it, or the repeat of a recent failure (which it takes, marked or not: one charge per
/// failure). With `caller_retries = "enforce"` the retry layer charges it
/// ([`stormguard_tower::CallerRetry`]); with `"count"` it is counted here and sent as a first
/// try.
fn caller_retry(
    dep: &DepRuntime,
    fingerprint: &crate::callers::Fingerprint,
    stated: Option<u64>,
    now: Instant,
) -> Option<Recognised> {
    let repeated = dep.callers.recognise(fingerprint, now);
    let marked = stormguard_http::stacked::retry_attempt(stated).map(|attempt| {
        stormguard_tower::CallerRetry {
            attempt: u32::try_from(attempt).unwrap_or(u32::MAX),
            after: repeated.map_or(FailureKind::Error, |r| r.after),
        }
    });
    let recognised = match (marked, repeated) {
        (Some(retry), _) => Recognised { retry, marked: true },
        (None, Some(retry)) => Recognised { retry, marked: false },
        (None, None) => return None,
    };
    if dep.config.0.caller_retries == CallerRetries::Count {
        dep.dependency.policy().counters().caller_retry(CallerRetryOutcome::Counted);
    }
    Some(recognised)
}

/// The kind of failure an answer is to a caller that may retry it: a refusal of stormguard's
/// (any reason), or a failure the dependency's `retry_on` names. `None`: the caller has no
/// reason to resend it.
fn failure_kind(dep: &DepRuntime, resp: &Response<ProxyBody>) -> Option<FailureKind> {
    if resp.extensions().get::<stormguard_core::Denied>().is_some() {
        return Some(FailureKind::Error);
    }
    let failure = stormguard_http::classify::classify_response(resp.status(), resp.headers())?;
    dep.dependency.config().retry.retry_on.matches(failure).then(|| failure.kind())
}

/// Serves one request.
pub(crate) async fn handle(
    state: Arc<State>,
    listener: usize,
    peer: SocketAddr,
    req: Request<Incoming>,
) -> Response<ProxyBody> {
    let started = Instant::now();
    let shared = state.current();
    let shared = &*shared;
    let rule = shared.listeners[listener];
    let (addr, default_dep, downstream_pushback) = (rule.addr, rule.dependency, rule.pushback);
    let method = req.method().clone();
    // The caller's target, for the route and the access log: a clone of the parsed URI shares
    // its bytes.
    let target = req.uri().clone();
    // The path the route is chosen by: dot segments resolved, slashes merged (`crate::path`).
    // The upstream gets the path as the caller sent it.
    let path = crate::path::normalize(target.path());
    let path = path.as_ref();
    if method == Method::CONNECT {
        state.refused_not_routable.fetch_add(1, Ordering::Relaxed);
        return local(
            StatusCode::FORBIDDEN,
            None,
            "stormguard: CONNECT is not served (not an open proxy)\n",
        );
    }
    // In HTTP/1.1 a URI with a scheme is absolute-form: the caller asks the proxy to go
    // somewhere. Only the hosts it is configured for are reachable.
    if req.version() < Version::HTTP_2
        && req.uri().scheme().is_some()
        && !serves_authority(shared, addr, req.uri())
    {
        state.refused_not_routable.fetch_add(1, Ordering::Relaxed);
        tracing::debug!(uri = %req.uri(), "absolute-form request for another host refused");
        return local(
            StatusCode::FORBIDDEN,
            None,
            "stormguard: this proxy only reaches its configured upstreams\n",
        );
    }
    // One Host (RFC 9112 §3.2): with two, the route and the host the upstream acts on could
    // differ.
    if req.headers().get_all(HOST).iter().nth(1).is_some() {
        state.bad_requests.fetch_add(1, Ordering::Relaxed);
        let mut resp =
            local(StatusCode::BAD_REQUEST, None, "stormguard: more than one Host header\n");
        resp.headers_mut()
            .insert(http::header::CONNECTION, http::HeaderValue::from_static("close"));
        return resp;
    }
    // The host matters only to a route that names one.
    let host = shared.routes.iter().any(|r| r.host.is_some()).then(|| request_host(&req)).flatten();
    let route_index = route(shared, host.as_deref(), path);
    let (dep_index, route) = match route_index.map(|i| &shared.routes[i]) {
        Some(r) => (r.dep, Some(r)),
        None => match default_dep {
            Some(d) => (d, None),
            None => {
                state.refused_no_route.fetch_add(1, Ordering::Relaxed);
                return local(
                    StatusCode::NOT_FOUND,
                    None,
                    "stormguard: no route for this host and path\n",
                );
            }
        },
    };
    let dep = &shared.deps[dep_index];
    // The caller: the configured header's value, or the peer's address (formatted only if
    // the access log or a new label needs its text).
    let named = match &shared.client_header {
        Some(h) => req.headers().get(h).and_then(|v| v.to_str().ok()).map(str::to_string),
        None => None,
    };
    let client = named.as_deref().map_or(Caller::Addr(peer.ip()), Caller::Named);
    let (mut parts, body) = req.into_parts();
    // A caller's own retry is told by its fingerprint, begun here from the head as the caller
    // sent it (`crate::callers`).
    let caller_retries = dep.config.0.caller_retries;
    // A sender that numbers its attempts is taken at its word: its first try (`1`) is never
    // another's retry, and leaves nothing for one.
    // The markers are read once: what they state decides both this and, below, whether the
    // request is a retry by its own word.
    let stated = dep.dependency.config().stacked.stated_attempt(&parts.headers);
    let first_by_its_word = stated == Some(1);
    let mut fingerprint = (caller_retries != CallerRetries::Off && !first_by_its_word).then(|| {
        let who = (named.as_deref(), named.is_none().then_some(peer.ip()));
        dep.callers.fingerprint(&who, peer, &parts)
    });
    // The host the route was chosen by is the host the upstream acts on: an absolute-form
    // target's authority replaces any Host (RFC 9112 §3.2.2), and an HTTP/2 caller's
    // `:authority` becomes the Host.
    if let Some(authority) = parts.uri.authority()
        && (parts.uri.scheme().is_some() || parts.version >= Version::HTTP_2)
        && let Ok(v) = http::HeaderValue::from_str(authority.as_str())
    {
        let absolute = parts.version < Version::HTTP_2;
        if absolute || !parts.headers.contains_key(HOST) {
            parts.headers.insert(HOST, v);
        }
    }
    // The upstream's address, the caller's path and query, HTTP/1.1 to the upstream.
    let mut uri = dep.upstreams[0].clone().into_parts();
    uri.path_and_query =
        parts.uri.path_and_query().cloned().or_else(|| Some("/".parse().expect("a valid path")));
    parts.uri = match Uri::from_parts(uri) {
        Ok(u) => u,
        Err(_) => {
            return local(StatusCode::BAD_REQUEST, None, "stormguard: malformed request target\n");
        }
    };
    parts.version = Version::HTTP_11;
    strip_hop_by_hop(&mut parts.headers);
    // The call tree's context, as this listener trusts it (`crate::tree`).
    let tree = crate::tree::at_listener(rule.tree, rule.allowance, &mut parts.headers, || {
        dep.dependency.header_stats().record(stormguard_http::headers::HeaderKind::Tree);
    });
    if dep.upstreams.len() > 1 {
        // Each provider is its own host: the client names the one each attempt goes to.
        parts.headers.remove(HOST);
    }
    // The Host the caller used is kept (virtual hosts behind the upstream); without one (an
    // h2 caller), the client sets the upstream's.
    let grpc = crate::grpc::is_grpc_request(&parts.headers);
    let log = AttemptLog::default();
    parts.extensions = http::Extensions::new();
    if let Some(scope) = dep.scopes.scope_for(&parts.headers, started) {
        parts.extensions.insert(scope);
    }
    // A gRPC caller's own timeout is the request's deadline: no attempt or retry after it,
    // and each attempt's `grpc-timeout` is what is left of it.
    if grpc
        && let Some(t) = parts
            .headers
            .get(&crate::grpc::GRPC_TIMEOUT)
            .and_then(|v| crate::grpc::parse_timeout(v.as_bytes()))
    {
        parts.extensions.insert(stormguard_tower::Deadline::after(t));
    }
    let mut route_label: &Arc<str> = &DEFAULT_ROUTE;
    if let Some(r) = route {
        route_label = &r.label;
        if r.idempotent {
            parts.extensions.insert(Idempotent);
        }
        if let Some(b) = &r.budget {
            parts.extensions.insert(RouteBudget(b.clone()));
        }
    }
    let limit = dep.dependency.config().body_limit;
    // The body first, before any slot: up to the replay buffer whole, a larger one its first
    // bytes. A caller that stalls or sends a broken body is answered here, and the dependency,
    // its breaker and its budget never see it.
    let times =
        crate::body::BodyTimes::new(shared.config.body_idle_timeout, shared.config.body_timeout);
    let body = match crate::body::receive(body, limit, times).await {
        Ok(b) => b,
        Err(e) => return state.caller_body_failed(&e),
    };
    if let Some(received) = body.received() {
        parts.extensions.insert(received);
    }
    let caller_retry = fingerprint.as_mut().and_then(|f| {
        body.head_chunks().for_each(|chunk| f.body(chunk));
        caller_retry(dep, f, stated, started)
    });
    if let Some(r) = caller_retry
        && caller_retries == CallerRetries::Enforce
    {
        parts.extensions.insert(r.retry);
    }
    // Rate admission's token cost: the request's output maximum and its size, when tokens
    // are metered (or may be learned).
    let rate = &dep.dependency.config().rate;
    if rate.meters_tokens() {
        let estimator = stormguard_http::provider::Estimator {
            bytes_per_token: dep.config.0.bytes_per_token,
            ..Default::default()
        };
        let tokens = stormguard_http::provider::estimate(&body.head_bytes(), estimator);
        parts.extensions.insert(stormguard_tower::extensions::RateCost::from(tokens));
    }
    // hyper's client sends no body on a GET or HEAD whose length it does not know unless told
    // to frame it: a body past the replay buffer, with no Content-Length, goes chunked.
    if !body.is_whole()
        && !parts.headers.contains_key(http::header::CONTENT_LENGTH)
        && (parts.method == Method::GET || parts.method == Method::HEAD)
    {
        parts
            .headers
            .insert(http::header::TRANSFER_ENCODING, http::HeaderValue::from_static("chunked"));
    }
    let req = Request::from_parts(parts, OutgoingBody::new(body, limit, log.clone()));
    // The answer read ahead of the caller (`crate::relay`), before it is counted: a body that
    // broke before anything went out is a 502 here, and counted as one.
    let c = &shared.config;
    let relay = crate::relay::RelayConfig::new(c.response_buffer, c.response_idle_timeout);
    // The stack readied, then called: the request moves once, into the call.
    let mut svc = dep.service.clone();
    let answer = match std::future::poll_fn(|cx| svc.poll_ready(cx)).await {
        Ok(()) => svc.call(req).await,
        Err(e) => Err(e),
    };
    let resp = match answer {
        Ok(resp) => crate::relay::read_ahead(crate::stack::relayed(resp), relay, &state).await,
        Err(e) => crate::stack::refusal(&*e, dep.dependency.config().rate.provider),
    };
    match resp.extensions().get::<LocalError>() {
        Some(LocalError::BodyTimeout) => state.count_caller_body(true),
        Some(LocalError::BodyMalformed) => state.count_caller_body(false),
        _ => {}
    }
    // A request its sender marked as a retry leaves nothing for the table (it still took the
    // failure it repeats, above): that sender marks its next retry too. A failure left for it
    // would be taken by the next identical request instead — another call's first try,
    // refused in its place.
    if let Some(f) = &fingerprint
        && !caller_retry.is_some_and(|r| r.marked)
    {
        let answered = match failure_kind(dep, &resp) {
            Some(kind) => {
                Answered::Failed { attempt: caller_retry.map_or(1, |r| r.retry.attempt), kind }
            }
            None => Answered::Ended,
        };
        dep.callers.answered(f, answered, Instant::now, dep.config.0.client_retry_window);
    }
    let denied = resp.extensions().get::<stormguard_core::Denied>().copied();
    state.traffic.count(crate::traffic::Finished {
        dependency: &dep.name,
        upstream: &dep.upstream_labels[log.target().min(dep.upstream_labels.len() - 1)],
        route: route_label,
        client,
        status: resp.status().as_u16(),
        attempts: log.attempts(),
        denied,
    });
    tracing::info!(
        target: "stormguard::access",
        method = %method,
        path = %path,
        dependency = dep.dependency.name(),
        route = &**route_label,
        client = %client,
        status = resp.status().as_u16(),
        attempts = log.attempts(),
        denied = denied.map_or("", stormguard_core::Denied::as_str),
        slot_wait_ms = log.slot_wait().as_secs_f64() * 1e3,
        upstream_ms = log.upstream_time().as_secs_f64() * 1e3,
        total_ms = started.elapsed().as_secs_f64() * 1e3,
    );
    let mut resp = match downstream_pushback {
        true => crate::pushback::advise(resp, grpc, |reason| {
            dep.dependency.retry_after(log.target(), reason)
        }),
        false => resp,
    };
    if let Some(id) = tree {
        state.overloaded.answered(id, listener, &mut resp, Instant::now());
    }
    resp
}
