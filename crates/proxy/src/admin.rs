//! The admin listener (loopback by default): `/metrics` (OpenMetrics text), `/healthz`,
//! `/readyz`, `/config` (the effective config), `/stats.json` (the same signals as JSON),
//! `/dashboard` (a live page over `/stats.json`, see [`dashboard`]), and
//! the run-time switches `POST /dependencies/<name>/retries` and `POST /dependencies/<name>/shadow`
//! with a body `{"enabled": true|false}`, and `POST /reload` (read the config file again).
//! `/readyz` answers 503 from the moment a drain starts.
//!
//! A state change is a request a web page in a browser on the host must not be able to make
//! (CSRF, DNS rebinding): it needs `Content-Type: application/json` (a cross-origin page cannot
//! send one without a CORS preflight, which this listener never grants), and either
//! `Authorization: Bearer <admin_token>` when a token is configured, or else a `Host` that is
//! the admin address (an IP address or `localhost` with the admin port — a rebinding page's Host
//! is its own name) and no `Origin` but the admin's own. Refusals are answered 415, 401 or 403,
//! counted in `stormguard_admin_refused_total{reason}` and logged at warn. Reads are open to
//! whoever reaches the listener.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::Ordering;

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use serde_json::json;
use stormguard_core::Denied;
use stormguard_core::signals::Abandoned;
use stormguard_tower::Dependency;

use crate::state::{Refused, State};

mod dashboard;

/// What the admin endpoints read.
pub(crate) struct Admin {
    state: Arc<State>,
    /// The address the admin listener is bound to.
    addr: SocketAddr,
    /// `admin_token`, resolved.
    token: Option<String>,
}

/// Whether `host` (a `Host` header or an HTTP/2 `:authority`) names the admin listener at
/// `admin`: its port, and its IP address (any, when it listens on all of them), or `localhost`
/// when it listens on loopback. Never a DNS name: a DNS-rebinding page's Host is its own.
fn is_admin_host(host: &str, admin: SocketAddr) -> bool {
    let Ok(authority) = host.parse::<http::uri::Authority>() else { return false };
    if authority.as_str().contains('@') || authority.port_u16().unwrap_or(80) != admin.port() {
        return false;
    }
    let name = authority.host().trim_start_matches('[').trim_end_matches(']');
    let ip = admin.ip();
    if name.eq_ignore_ascii_case("localhost") {
        return ip.is_loopback() || ip.is_unspecified();
    }
    name.parse::<IpAddr>()
        .is_ok_and(|h| h == ip || ip.is_unspecified() || (ip.is_loopback() && h.is_loopback()))
}

/// Whether the request's media type is `application/json` (parameters allowed).
fn is_json(req: &Request<Incoming>) -> bool {
    req.headers()
        .get(http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .is_some_and(|t| t.trim().eq_ignore_ascii_case("application/json"))
}

type AdminBody = Full<Bytes>;

fn reply(
    status: StatusCode,
    content_type: &'static str,
    body: impl Into<Bytes>,
) -> Response<AdminBody> {
    let mut r = Response::new(Full::new(body.into()));
    *r.status_mut() = status;
    r.headers_mut()
        .insert(http::header::CONTENT_TYPE, http::HeaderValue::from_static(content_type));
    r
}

fn json_reply(status: StatusCode, v: &serde_json::Value) -> Response<AdminBody> {
    reply(status, "application/json", format!("{v:#}\n"))
}

/// The signals of one dependency as JSON: counters, in flight, budget, breaker, switches.
pub fn stats_json(dep: &Dependency) -> serde_json::Value {
    // Its own high-water marks: polling here never resets a Prometheus scrape's.
    let s = dep.snapshot_for(stormguard_tower::Reader::Json);
    let denied: serde_json::Map<String, serde_json::Value> = Denied::ALL
        .iter()
        .map(|d| (d.as_str().to_string(), json!(s.counters.denied(*d))))
        .collect();
    let shadow: serde_json::Map<String, serde_json::Value> = Denied::ALL
        .iter()
        .map(|d| (d.as_str().to_string(), json!(s.counters.shadow_denied(*d))))
        .collect();
    let l = &s.limiter;
    // In flight seen by each admitted attempt, one bucket per count (the last: above the cap),
    // cumulative; trailing empty buckets are left out. Rates and windowed quantiles are
    // differences of two readings.
    let in_flight_counts = &l.in_flight_histogram.counts;
    let used = in_flight_counts.iter().rposition(|c| *c > 0).map_or(0, |i| i + 1);
    let wait = &l.wait_histogram;
    let seconds = |nanos: u64| nanos as f64 / 1e9;
    let upstreams: Vec<serde_json::Value> = if s.others.is_empty() {
        Vec::new()
    } else {
        std::iter::once((s.upstream_name.as_deref().unwrap_or(""), &s.limiter))
            .chain(s.others.iter().map(|u| (u.name.as_str(), &u.limiter)))
            .map(|(name, l)| {
                let mut u = json!({
                    "name": name,
                    "cap": l.cap,
                    "effective_cap": l.effective_cap,
                    "in_flight": l.in_flight,
                    "in_flight_max": l.high_water,
                    "held_slots": l.held,
                });
                if let Some(a) = &l.adaptive {
                    u["adaptive"] = adaptive_json(a);
                }
                u
            })
            .collect()
    };
    let mut v = json!({
        "name": s.name,
        "requests": s.counters.primaries,
        "succeeded": s.counters.succeeded,
        "primaries_refused": s.counters.primaries_refused,
        "retries": s.counters.retries,
        "not_retryable": s.counters.not_retryable,
        "denied": denied,
        "shadow_denied": shadow,
        "cap": s.limiter.cap,
        "effective_cap": s.limiter.effective_cap,
        "in_flight": s.limiter.in_flight,
        "in_flight_max": s.limiter.high_water,
        "in_flight_p99": l.in_flight_histogram.quantile_bound(0.99),
        "in_flight_histogram": &in_flight_counts[..used],
        "slot_wait": {
            "bounds_seconds": wait.bounds.iter().map(|b| seconds(*b)).collect::<Vec<_>>(),
            "counts": &wait.counts,
            "p99_seconds": wait.quantile_bound(0.99).map(seconds),
        },
        "queued": s.limiter.queued,
        "held_slots": s.limiter.held,
        "slot_holds_expired": s.limiter.holds_expired,
        "abandoned": {
            "finished": s.counters.abandoned(Abandoned::Finished),
            "cut": s.counters.abandoned(Abandoned::Cut),
        },
        // Retries callers sent themselves (docs/proxy.md, "Callers' own retries").
        "caller_retries": stormguard_core::signals::CallerRetryOutcome::ALL
            .iter()
            .map(|o| (o.as_str().to_string(), json!(s.counters.caller_retries[o.index()])))
            .collect::<serde_json::Map<String, serde_json::Value>>(),
        // With several upstreams, each one's slots (the fields above describe the first).
        "upstreams": upstreams,
        "total": s.total.as_ref().map(|t| json!({
            "cap": t.cap,
            "in_flight": t.in_flight,
            "in_flight_max": t.high_water,
            "queued": t.queued,
        })),
        "oldest_permit_seconds": s.limiter.oldest_permit_age.map(|d| d.as_secs_f64()),
        "budget": { "policy": s.budget.policy, "balance": s.budget.balance, "utilization": s.budget.utilization, "percent": s.budget.percent },
        "breaker": s.breaker.map(|b| format!("{b:?}")),
        "pushback_hold": s.hold_until.is_some(),
        "enforce": s.enforce,
        "retries_enabled": dep.policy().retries_enabled(),
    });
    // Only with rate admission: every other dependency's JSON is as it was before it existed.
    if let Some(rate) = rate_json(&s) {
        v["rate"] = rate;
    }
    // Only with an adaptive cap, likewise (of the first upstream; each one's in `upstreams`).
    if let Some(a) = &s.limiter.adaptive {
        v["adaptive"] = adaptive_json(a);
    }
    v
}

/// An adaptive cap's state: the working cap (the cap in force unless a limit header or a fleet
/// lease holds it lower: `effective_cap`), its floor and ceiling, the windows that raised and
/// lowered it, and the latencies it compares (`null` before the first window).
fn adaptive_json(a: &stormguard_core::adaptive::AdaptiveSnapshot) -> serde_json::Value {
    json!({
        "working_cap": a.limit,
        "min": a.min,
        "max": a.max,
        "raised": a.raised,
        "lowered": a.lowered,
        "baseline_seconds": a.baseline.map(|d| d.as_secs_f64()),
        "current_seconds": a.current.map(|d| d.as_secs_f64()),
    })
}

/// Rate admission's limits, per upstream (labelled as the rate metrics are: its name, or `0`
/// with one unnamed upstream): each quantity whose limit is known (configured or learned) —
/// the limit per minute, the units available now, those booked by attempts not yet answered,
/// and the seconds left of a hold — and whether the upstream cools down after an overloaded
/// answer. `None` when rate admission is off.
fn rate_json(s: &stormguard_tower::DependencySnapshot) -> Option<serde_json::Value> {
    if s.rates.is_empty() {
        return None;
    }
    let upstreams: Vec<serde_json::Value> = s
        .rates_by_upstream()
        .map(|(name, r)| {
            let mut u = json!({ "name": name, "cooling": r.cooling });
            for (quantity, q) in r.quantities() {
                let Some(limit) = q.limit else { continue };
                u[quantity] = json!({
                    "limit_per_minute": limit,
                    "available": q.available,
                    "reserved": q.outstanding,
                    "held_seconds": q.held_until.map_or(0.0, |t| t.saturating_since(s.at).as_secs_f64()),
                });
            }
            u
        })
        .collect();
    Some(json!({ "upstreams": upstreams }))
}

impl Admin {
    pub(crate) fn new(state: Arc<State>, addr: SocketAddr, token: Option<String>) -> Admin {
        Admin { state, addr, token }
    }

    /// The answer refusing `req` when it may not change state; `None` when it may.
    fn refusal(&self, req: &Request<Incoming>) -> Option<Response<AdminBody>> {
        let refuse = |why: Refused, status: StatusCode, text: &str| {
            self.state.listening.admin_refused[why as usize].fetch_add(1, Ordering::Relaxed);
            tracing::warn!(
                path = req.uri().path(),
                reason = why.as_str(),
                host = req.headers().get(http::header::HOST).and_then(|v| v.to_str().ok()),
                origin = req.headers().get(http::header::ORIGIN).and_then(|v| v.to_str().ok()),
                "admin state change refused"
            );
            let mut r = reply(status, "text/plain", format!("{text}\n"));
            if why == Refused::Token {
                r.headers_mut().insert(
                    http::header::WWW_AUTHENTICATE,
                    http::HeaderValue::from_static("Bearer realm=\"stormguard admin\""),
                );
            }
            Some(r)
        };
        if !is_json(req) {
            return refuse(
                Refused::ContentType,
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "a state change takes Content-Type: application/json",
            );
        }
        if let Some(token) = &self.token {
            use subtle::ConstantTimeEq;
            let given = req
                .headers()
                .get(http::header::AUTHORIZATION)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.strip_prefix("Bearer "))
                .map(str::trim);
            // Constant time over the bytes: only the length can be told apart.
            let ok = given.is_some_and(|g| bool::from(g.as_bytes().ct_eq(token.as_bytes())));
            if !ok {
                return refuse(
                    Refused::Token,
                    StatusCode::UNAUTHORIZED,
                    "a state change takes Authorization: Bearer <admin_token>",
                );
            }
            // A caller that holds the token is not a page tricked into the request.
            return None;
        }
        let host = req
            .uri()
            .authority()
            .map(|a| a.as_str())
            .or_else(|| req.headers().get(http::header::HOST).and_then(|v| v.to_str().ok()));
        let Some(host) = host.filter(|h| is_admin_host(h, self.addr)) else {
            return refuse(
                Refused::Host,
                StatusCode::FORBIDDEN,
                &format!("a state change takes a Host that is the admin address ({})", self.addr),
            );
        };
        if let Some(origin) = req.headers().get(http::header::ORIGIN) {
            let same = origin.to_str().is_ok_and(|o| {
                o.strip_prefix("http://").is_some_and(|o| o.eq_ignore_ascii_case(host))
            });
            if !same {
                return refuse(
                    Refused::Origin,
                    StatusCode::FORBIDDEN,
                    "a state change from another origin is refused",
                );
            }
        }
        None
    }

    pub(crate) async fn handle(self: Arc<Self>, req: Request<Incoming>) -> Response<AdminBody> {
        let path = req.uri().path().to_string();
        let changes_state = req.method() == Method::POST
            && (path == "/reload" || path.starts_with("/dependencies/"));
        if changes_state && let Some(refused) = self.refusal(&req) {
            return refused;
        }
        match (req.method(), path.as_str()) {
            (&Method::GET, "/healthz") => reply(StatusCode::OK, "text/plain", "ok\n"),
            (&Method::GET, "/readyz") => {
                if self.state.draining.load(std::sync::atomic::Ordering::SeqCst) {
                    reply(StatusCode::SERVICE_UNAVAILABLE, "text/plain", "draining\n")
                } else {
                    reply(StatusCode::OK, "text/plain", "ready\n")
                }
            }
            (&Method::GET, "/metrics") => {
                let mut text = String::new();
                let registry =
                    self.state.registry.read().unwrap_or_else(std::sync::PoisonError::into_inner);
                match prometheus_client::encoding::text::encode(&mut text, &registry) {
                    Ok(()) => reply(
                        StatusCode::OK,
                        "application/openmetrics-text; version=1.0.0; charset=utf-8",
                        text,
                    ),
                    Err(_) => reply(
                        StatusCode::INTERNAL_SERVER_ERROR,
                        "text/plain",
                        "cannot encode metrics\n",
                    ),
                }
            }
            (&Method::GET, "/config") => {
                json_reply(StatusCode::OK, &self.state.current().config.to_json())
            }
            (&Method::GET, "/stats.json") => {
                let deps: Vec<_> =
                    self.state.current().deps.iter().map(|d| stats_json(&d.dependency)).collect();
                json_reply(StatusCode::OK, &json!({ "dependencies": deps }))
            }
            (&Method::GET, "/dashboard" | "/dashboard/") => {
                let deps: Vec<_> =
                    self.state.current().deps.iter().map(|d| stats_json(&d.dependency)).collect();
                reply(StatusCode::OK, "text/html; charset=utf-8", dashboard::page(&deps))
            }
            (&Method::POST, "/reload") => {
                match crate::reload::reload_from_source(&self.state).await {
                    Ok(report) => json_reply(StatusCode::OK, &json!({ "reloaded": report })),
                    Err(e @ crate::ReloadError::NoSource) => {
                        reply(StatusCode::CONFLICT, "text/plain", format!("{e}\n"))
                    }
                    Err(e) => reply(StatusCode::BAD_REQUEST, "text/plain", format!("{e}\n")),
                }
            }
            (&Method::POST, p) if p.starts_with("/dependencies/") => {
                self.switch(req, p.to_string()).await
            }
            _ => reply(
                StatusCode::NOT_FOUND,
                "text/plain",
                "not found: GET /metrics /healthz /readyz /config /stats.json /dashboard; POST /reload, /dependencies/NAME/retries|shadow\n",
            ),
        }
    }

    /// `POST /dependencies/<name>/retries {"enabled": false}` (the kill switch) and
    /// `POST /dependencies/<name>/shadow {"enabled": true}`: effective from the next request.
    async fn switch(&self, req: Request<Incoming>, path: String) -> Response<AdminBody> {
        let rest = &path["/dependencies/".len()..];
        let Some((name, what)) = rest.split_once('/') else {
            return reply(
                StatusCode::NOT_FOUND,
                "text/plain",
                "expected /dependencies/NAME/retries or /shadow\n",
            );
        };
        let shared = self.state.current();
        let Some(dep) = shared.deps.iter().find(|d| d.dependency.name() == name) else {
            return reply(
                StatusCode::NOT_FOUND,
                "text/plain",
                format!("no dependency named {name:?}\n"),
            );
        };
        let body = match Limited::new(req.into_body(), 4096).collect().await {
            Ok(b) => b.to_bytes(),
            Err(_) => {
                return reply(
                    StatusCode::BAD_REQUEST,
                    "text/plain",
                    "body too large or unreadable\n",
                );
            }
        };
        let enabled = serde_json::from_slice::<serde_json::Value>(&body)
            .ok()
            .and_then(|v| v.get("enabled").and_then(serde_json::Value::as_bool));
        let Some(enabled) = enabled else {
            return reply(
                StatusCode::BAD_REQUEST,
                "text/plain",
                "expected {\"enabled\": true|false}\n",
            );
        };
        let policy = dep.dependency.policy();
        match what {
            "retries" => policy.set_retries_enabled(enabled),
            "shadow" => policy.set_enforce(!enabled),
            _ => {
                return reply(
                    StatusCode::NOT_FOUND,
                    "text/plain",
                    "expected /retries or /shadow\n",
                );
            }
        }
        tracing::warn!(
            dependency = name,
            switch = what,
            enabled,
            "switch changed from the admin listener"
        );
        json_reply(
            StatusCode::OK,
            &json!({ "dependency": name, "retries_enabled": policy.retries_enabled(), "shadow": !policy.enforce() }),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `/stats.json` carries an adaptive cap's state, moved by a window of refused attempts on
    /// a manual clock; a fixed cap's JSON has no `adaptive`.
    #[tokio::test]
    async fn stats_carry_the_adaptive_caps_state() {
        use std::time::Duration;
        use stormguard_core::AttemptKind;
        use stormguard_core::adaptive::AdaptiveConfig;
        use stormguard_core::clock::ManualClock;
        use stormguard_tower::DependencyConfig;

        let clock = ManualClock::new();
        let mut config = DependencyConfig::new("llm");
        config.limiter.cap = 20;
        config.limiter.adaptive = Some(AdaptiveConfig::new(4, 40));
        let dep = Dependency::with_clock(config, Arc::new(clock.clone())).unwrap();
        let v = stats_json(&dep);
        assert_eq!(
            v["adaptive"],
            json!({ "working_cap": 20, "min": 4, "max": 40, "raised": 0, "lowered": 0,
                    "baseline_seconds": null, "current_seconds": null })
        );
        assert_eq!((v["cap"].as_u64(), v["effective_cap"].as_u64()), (Some(40), Some(20)));
        // A window of ten answers after 1.25 s: the latencies are read, the cap holds (the
        // baseline is being learned); then ten refused for overload: lowered by 10 %.
        let window = |overload: bool| {
            let permits: Vec<_> = (0..10)
                .map(|_| dep.upstream().limiter.try_acquire(AttemptKind::Primary).unwrap())
                .collect();
            clock.advance(Duration::from_millis(1_250));
            for mut p in permits {
                p.answered(overload);
            }
        };
        window(false);
        window(true);
        let v = stats_json(&dep);
        assert_eq!(
            v["adaptive"],
            json!({ "working_cap": 18, "min": 4, "max": 40, "raised": 0, "lowered": 1,
                    "baseline_seconds": 1.25, "current_seconds": 1.25 })
        );
        assert_eq!(v["effective_cap"], 18);
        let fixed = Dependency::try_new(DependencyConfig::new("fixed")).unwrap();
        assert!(stats_json(&fixed).get("adaptive").is_none());
    }

    #[test]
    fn the_admin_host_is_an_address_never_a_name() {
        let lo: SocketAddr = "127.0.0.1:9901".parse().unwrap();
        for ok in ["127.0.0.1:9901", "localhost:9901", "LocalHost:9901", "[::1]:9901"] {
            assert!(is_admin_host(ok, lo), "{ok}");
        }
        for bad in [
            "evil.example:9901",
            "127.0.0.1.nip.io:9901",
            "127.0.0.1:9902",
            "127.0.0.1",
            "localhost",
            "10.0.0.1:9901",
            "user@127.0.0.1:9901",
            "",
        ] {
            assert!(!is_admin_host(bad, lo), "{bad}");
        }
        // Listening on every address: any IP address, never a name.
        let any: SocketAddr = "0.0.0.0:9901".parse().unwrap();
        for ok in ["10.0.0.1:9901", "127.0.0.1:9901", "localhost:9901"] {
            assert!(is_admin_host(ok, any), "{ok}");
        }
        assert!(!is_admin_host("sidecar.internal:9901", any));
        // A specific remote address: that address only.
        let one: SocketAddr = "10.0.0.1:9901".parse().unwrap();
        assert!(is_admin_host("10.0.0.1:9901", one));
        assert!(!is_admin_host("10.0.0.2:9901", one));
        assert!(!is_admin_host("localhost:9901", one));
        // Port 80 may be left out.
        let web: SocketAddr = "[::1]:80".parse().unwrap();
        assert!(is_admin_host("[::1]", web) && is_admin_host("localhost", web));
    }
}
