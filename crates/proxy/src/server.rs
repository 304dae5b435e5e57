//! The listeners: each connection served by hyper-util's auto builder (HTTP/1.1, and h2c by
//! prior knowledge), each request checked, routed, and sent through its dependency's stack.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use http::header::HOST;
use http::{Method, Request, Response, StatusCode, Uri, Version};
use hyper::body::Incoming;
use stormguard_core::budget::RetryBudget;
use stormguard_tower::{Dependency, Idempotent, ReplayBody, RouteBudget};
use tower::ServiceExt;

use crate::hop::strip_hop_by_hop;
use crate::scopes::TraceScopes;
use crate::stack::{AttemptLog, DENIED_HEADER, ProxyBody, ProxyService, local};

/// One dependency at run time.
pub(crate) struct DepRuntime {
    pub(crate) dependency: Dependency,
    pub(crate) service: ProxyService,
    /// `http://host:port` of its upstream.
    pub(crate) upstream: Uri,
    pub(crate) scopes: TraceScopes,
}

/// One route at run time.
pub(crate) struct RouteRuntime {
    pub(crate) host: Option<String>,
    pub(crate) path_prefix: String,
    pub(crate) dep: usize,
    pub(crate) budget: Option<Arc<dyn RetryBudget>>,
    pub(crate) idempotent: bool,
    pub(crate) label: String,
}

/// What every request handler shares.
pub(crate) struct Shared {
    pub(crate) deps: Vec<DepRuntime>,
    pub(crate) routes: Vec<RouteRuntime>,
    /// Per listener: its address and its default dependency.
    pub(crate) listeners: Vec<(SocketAddr, Option<usize>)>,
    /// Requests refused before any dependency: absolute-form for other hosts, no route.
    pub(crate) refused_not_routable: std::sync::atomic::AtomicU64,
    pub(crate) refused_no_route: std::sync::atomic::AtomicU64,
    /// The per-route series.
    pub(crate) traffic: crate::traffic::Traffic,
    /// The header naming the caller (else its IP address).
    pub(crate) client_header: Option<http::HeaderName>,
    /// The trace file, in record mode.
    pub(crate) trace: Option<Arc<crate::record::TraceFile>>,
}

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
    let is_upstream = shared.deps.iter().any(|d| {
        d.upstream.authority().is_some_and(|a| {
            a.host().eq_ignore_ascii_case(&host) && a.port_u16().unwrap_or(80) == port
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

/// Serves one request.
pub(crate) async fn handle(
    shared: Arc<Shared>,
    listener: usize,
    peer: SocketAddr,
    req: Request<Incoming>,
) -> Response<ProxyBody> {
    let started = Instant::now();
    let (addr, default_dep) = shared.listeners[listener];
    let method = req.method().clone();
    let path = req.uri().path().to_string();
    if method == Method::CONNECT {
        shared.refused_not_routable.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
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
        && !serves_authority(&shared, addr, req.uri())
    {
        shared.refused_not_routable.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        tracing::debug!(uri = %req.uri(), "absolute-form request for another host refused");
        return local(
            StatusCode::FORBIDDEN,
            None,
            "stormguard: this proxy only reaches its configured upstreams\n",
        );
    }
    let host = request_host(&req);
    let route_index = route(&shared, host.as_deref(), &path);
    let (dep_index, route) = match route_index.map(|i| &shared.routes[i]) {
        Some(r) => (r.dep, Some(r)),
        None => match default_dep {
            Some(d) => (d, None),
            None => {
                shared.refused_no_route.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                return local(
                    StatusCode::NOT_FOUND,
                    None,
                    "stormguard: no route for this host and path\n",
                );
            }
        },
    };
    let dep = &shared.deps[dep_index];
    let client = match &shared.client_header {
        Some(h) => req.headers().get(h).and_then(|v| v.to_str().ok()).map(str::to_string),
        None => None,
    }
    .unwrap_or_else(|| peer.ip().to_string());
    let (mut parts, body) = req.into_parts();
    // The upstream's address, the caller's path and query, HTTP/1.1 to the upstream.
    let mut uri = dep.upstream.clone().into_parts();
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
    // The Host the caller used is kept (virtual hosts behind the upstream); without one (an
    // h2 caller), the client sets the upstream's.
    let log = AttemptLog::default();
    parts.extensions = http::Extensions::new();
    parts.extensions.insert(log.clone());
    if let Some(scope) = dep.scopes.scope_for(&parts.headers, started) {
        parts.extensions.insert(scope);
    }
    let mut route_label = "";
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
    let req = Request::from_parts(parts, ReplayBody::new(body, limit));
    let resp = match dep.service.clone().oneshot(req).await {
        Ok(r) => r,
        Err(e) => {
            tracing::warn!(error = %e, "the upstream client failed");
            local(StatusCode::BAD_GATEWAY, None, "stormguard: the upstream client failed\n")
        }
    };
    let denied = resp.headers().get(&DENIED_HEADER).and_then(|v| v.to_str().ok()).unwrap_or("");
    shared.traffic.count(crate::traffic::Finished {
        dependency: dep_index,
        route: route_index,
        client: &client,
        status: resp.status().as_u16(),
        attempts: log.attempts(),
        denied: denied.parse().ok(),
    });
    tracing::info!(
        target: "stormguard::access",
        method = %method,
        path = %path,
        dependency = dep.dependency.name(),
        route = route_label,
        client = %client,
        status = resp.status().as_u16(),
        attempts = log.attempts(),
        denied,
        slot_wait_ms = log.slot_wait().as_secs_f64() * 1e3,
        upstream_ms = log.upstream_time().as_secs_f64() * 1e3,
        total_ms = started.elapsed().as_secs_f64() * 1e3,
    );
    resp
}
