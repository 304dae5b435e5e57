//! What the proxy's listeners, its admin listener, its request handler, the relay and a reload
//! share, in one leaf module that none of them is above: the configuration in force
//! ([`Shared`], swapped whole by a reload), what lives as long as the proxy ([`State`]), and the
//! listeners' and the admin listener's series. Each of those modules imports this one; this one
//! imports none of them, so the modules of the request path form no circle.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError, RwLock};
use std::time::Duration;

use http::{Response, Uri};
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use stormguard_core::budget::RetryBudget;
use stormguard_tower::Dependency;
use tokio::time::Instant;

use crate::config::{ProxyConfig, ProxyDependency, RouteConfig};
use crate::scopes::TraceScopes;
use crate::stack::{ProxyBody, ProxyService};

/// One dependency at run time. Kept whole across a reload that leaves its config unchanged.
pub(crate) struct DepRuntime {
    pub(crate) dependency: Dependency,
    pub(crate) service: ProxyService,
    /// `http://host:port` of each upstream, in order of preference.
    pub(crate) upstreams: Arc<[Uri]>,
    pub(crate) scopes: TraceScopes,
    /// Recent failures, to recognise a caller's own retry (`crate::callers`).
    pub(crate) callers: crate::callers::RecentFailures,
    /// What it was built from (with the proxy's `scope_max`).
    pub(crate) config: (ProxyDependency, usize),
    /// Labels of the per-route series: its name, each upstream's host and port.
    pub(crate) name: Arc<str>,
    pub(crate) upstream_labels: Vec<Arc<str>>,
}

/// One route at run time.
pub(crate) struct RouteRuntime {
    pub(crate) host: Option<String>,
    pub(crate) path_prefix: String,
    pub(crate) dep: usize,
    pub(crate) budget: Option<Arc<dyn RetryBudget>>,
    pub(crate) idempotent: bool,
    pub(crate) label: Arc<str>,
    /// What it was built from (an unchanged route keeps its budget across a reload).
    pub(crate) config: RouteConfig,
}

/// One generation of the configuration: what a request is routed and served by. A reload
/// builds a new one; requests in flight finish on the one they started with.
pub(crate) struct Shared {
    pub(crate) deps: Vec<Arc<DepRuntime>>,
    pub(crate) routes: Vec<Arc<RouteRuntime>>,
    /// Per listener: what its requests are served by.
    pub(crate) listeners: Vec<ListenerRule>,
    /// The header naming the caller (else its IP address).
    pub(crate) client_header: Option<http::HeaderName>,
    /// The effective config.
    pub(crate) config: ProxyConfig,
}

/// What a listener's requests are served by.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ListenerRule {
    /// Its address.
    pub(crate) addr: SocketAddr,
    /// Its default dependency.
    pub(crate) dependency: Option<usize>,
    /// Whether its refusals tell the caller's retry loop to stand down (`downstream_pushback`).
    pub(crate) pushback: bool,
    /// What it does with a call tree's context (`tree`), and the allowance it gives or allows.
    pub(crate) tree: stormguard_proxy_config::TreeMode,
    pub(crate) allowance: stormguard_core::tree::Allowance,
}

/// What lives as long as the proxy, across reloads.
pub(crate) struct State {
    current: RwLock<Arc<Shared>>,
    /// Requests refused before any dependency: absolute-form for other hosts, no route.
    pub(crate) refused_not_routable: AtomicU64,
    pub(crate) refused_no_route: AtomicU64,
    /// Requests refused as malformed HTTP (400): more than one Host header.
    pub(crate) bad_requests: AtomicU64,
    /// Callers whose request body stalled past `body_idle_timeout` (408), or broke (400).
    pub(crate) body_timeouts: AtomicU64,
    pub(crate) body_malformed: AtomicU64,
    /// Answers cut because their caller accepted nothing for `response_idle_timeout`.
    pub(crate) response_stalls: AtomicU64,
    /// The per-route series.
    pub(crate) traffic: crate::traffic::Traffic,
    /// The trace file, in record mode.
    pub(crate) trace: Option<Arc<crate::record::TraceFile>>,
    /// Set when draining starts: `/readyz` fails from then on.
    pub(crate) draining: AtomicBool,
    /// Reloads applied, and refused.
    pub(crate) reloads: AtomicU64,
    pub(crate) reloads_refused: AtomicU64,
    /// The metrics registry, rebuilt by a reload.
    pub(crate) registry: RwLock<prometheus_client::registry::Registry>,
    /// The file the config was read from, for `POST /reload`.
    pub(crate) source: Option<std::path::PathBuf>,
    /// Reloads run one at a time.
    pub(crate) reload_lock: tokio::sync::Mutex<()>,
    /// The fleet layers of `placement = "fleet"` dependencies (fixed for the proxy's life).
    pub(crate) fleets: Vec<stormguard_redis::Fleet>,
    /// The listeners' connections and the admin listener's refusals, for the metrics.
    pub(crate) listening: Listening,
    /// User actions a hop below refused for load (`crate::tree`).
    pub(crate) overloaded: crate::tree::Overloaded,
}

impl State {
    pub(crate) fn new(
        shared: Shared,
        trace: Option<Arc<crate::record::TraceFile>>,
        source: Option<std::path::PathBuf>,
        fleets: Vec<stormguard_redis::Fleet>,
    ) -> State {
        State {
            traffic: crate::traffic::Traffic::new(shared.config.client_max),
            current: RwLock::new(Arc::new(shared)),
            refused_not_routable: AtomicU64::new(0),
            refused_no_route: AtomicU64::new(0),
            bad_requests: AtomicU64::new(0),
            body_timeouts: AtomicU64::new(0),
            body_malformed: AtomicU64::new(0),
            response_stalls: AtomicU64::new(0),
            trace,
            draining: AtomicBool::new(false),
            reloads: AtomicU64::new(0),
            reloads_refused: AtomicU64::new(0),
            overloaded: crate::tree::Overloaded::default(),
            registry: RwLock::new(prometheus_client::registry::Registry::default()),
            source,
            reload_lock: tokio::sync::Mutex::new(()),
            fleets,
            listening: Listening::default(),
        }
    }

    /// Counts a caller's body failure.
    pub(crate) fn count_caller_body(&self, timed_out: bool) {
        let c = if timed_out { &self.body_timeouts } else { &self.body_malformed };
        c.fetch_add(1, Ordering::Relaxed);
    }

    /// The answer to a caller whose body failed before its request reached a dependency:
    /// `408` when it stalled, `400` when it broke; counted, and logged at debug.
    pub(crate) fn caller_body_failed(
        &self,
        e: &crate::body::CallerBodyError,
    ) -> Response<ProxyBody> {
        tracing::debug!(error = %e, "the caller's request body failed");
        let resp = crate::stack::caller_body_answer(e);
        self.count_caller_body(e.timed_out());
        resp
    }

    /// The configuration requests are served by now.
    pub(crate) fn current(&self) -> Arc<Shared> {
        self.current.read().unwrap_or_else(PoisonError::into_inner).clone()
    }

    /// Puts a new generation in force; returns the old one.
    pub(crate) fn replace(&self, shared: Shared) -> Arc<Shared> {
        let mut c = self.current.write().unwrap_or_else(PoisonError::into_inner);
        std::mem::replace(&mut *c, Arc::new(shared))
    }
}

/// Why the proxy closed a connection: the `reason` label.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Closed {
    /// No whole request head within `header_read_timeout`.
    HeaderTimeout,
    /// Nothing in flight for `idle_timeout`.
    Idle,
    /// The listener held `max_connections` already.
    Limit,
    /// An HTTP/2 PING went unanswered.
    Http2KeepAlive,
    /// The listener was full and this connection had been idle longest: closed to make room
    /// for a new one.
    Evicted,
    /// An HTTP/1.1 caller accepted nothing of its answer for `response_idle_timeout`.
    ResponseStalled,
}

impl Closed {
    pub(crate) const ALL: [Closed; 6] = [
        Closed::HeaderTimeout,
        Closed::Idle,
        Closed::Limit,
        Closed::Http2KeepAlive,
        Closed::Evicted,
        Closed::ResponseStalled,
    ];

    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Closed::HeaderTimeout => "header-timeout",
            Closed::Idle => "idle",
            Closed::Limit => "limit",
            Closed::Http2KeepAlive => "h2-keepalive",
            Closed::Evicted => "evicted",
            Closed::ResponseStalled => "response-stalled",
        }
    }
}

/// One listener's connections, for the metrics: open now, the limit, accepted, closed.
#[derive(Debug)]
pub(crate) struct ListenerStats {
    /// The `listener` label: the address callers connect to, or `admin`.
    pub(crate) label: String,
    pub(crate) max: usize,
    pub(crate) open: AtomicUsize,
    pub(crate) accepted: AtomicU64,
    closed: [AtomicU64; Closed::ALL.len()],
    /// When the limit was last logged at warn (at most every 10 s).
    limit_warned: Throttled,
    /// Failed accepts, logged at warn at most every 10 s.
    accept_failed: Throttled,
    /// HTTP/2 connections closed for resetting streams too fast, the same.
    calmed: Throttled,
}

/// A warning given at most every 10 s, with the count of what it warns of since the last one:
/// one client cannot fill the log with one line per connection.
#[derive(Debug, Default)]
struct Throttled {
    last: Mutex<Option<Instant>>,
    since: AtomicU64,
}

impl Throttled {
    /// One more; the count since the last warning when one is due now.
    fn tick(&self) -> Option<u64> {
        let n = self.since.fetch_add(1, Ordering::Relaxed) + 1;
        let now = Instant::now();
        let mut last = self.last.lock().unwrap_or_else(PoisonError::into_inner);
        if last.is_some_and(|t| now < t + Duration::from_secs(10)) {
            return None;
        }
        *last = Some(now);
        self.since.store(0, Ordering::Relaxed);
        Some(n)
    }
}

impl ListenerStats {
    pub(crate) fn new(label: impl Into<String>, max: usize) -> ListenerStats {
        ListenerStats {
            label: label.into(),
            max,
            open: AtomicUsize::new(0),
            accepted: AtomicU64::new(0),
            closed: Default::default(),
            limit_warned: Throttled::default(),
            accept_failed: Throttled::default(),
            calmed: Throttled::default(),
        }
    }

    pub(crate) fn count(&self, why: Closed) {
        self.closed[why as usize].fetch_add(1, Ordering::Relaxed);
    }

    /// An accept failed: logged at debug each time, at warn at most every 10 s (with the count
    /// since), so a flood of connections reset before they are accepted is one line, not one a
    /// connection.
    pub(crate) fn accept_failed(&self, e: &std::io::Error) {
        tracing::debug!(listener = %self.label, error = %e, "accept failed");
        if let Some(n) = self.accept_failed.tick() {
            tracing::warn!(listener = %self.label, error = %e, failures = n, "accept failed (logged at most every 10 s)");
        }
    }

    /// A connection ended with an error: logged at debug with its whole chain. A caller that
    /// resets HTTP/2 streams faster than allowed (the "rapid reset" attack: h2 answers with a
    /// GOAWAY of `ENHANCE_YOUR_CALM`) is logged at warn at most every 10 s, with the count since:
    /// one line, not one a connection (h2's own warning is off in the binary's default filter).
    pub(crate) fn connection_failed(&self, e: &(dyn std::error::Error + 'static)) {
        let mut chain = e.to_string();
        let mut cause = e.source();
        while let Some(c) = cause {
            chain.push_str(": ");
            chain.push_str(&c.to_string());
            cause = c.source();
        }
        tracing::debug!(listener = %self.label, error = %chain, "connection ended with an error");
        if (chain.contains("excessive load") || chain.contains("ENHANCE_YOUR_CALM"))
            && let Some(n) = self.calmed.tick()
        {
            tracing::warn!(
                listener = %self.label,
                connections = n,
                "HTTP/2 callers reset streams faster than allowed: their connections were closed (ENHANCE_YOUR_CALM; logged at most every 10 s)"
            );
        }
    }

    pub(crate) fn refuse(&self, peer: SocketAddr) {
        self.count(Closed::Limit);
        tracing::debug!(listener = %self.label, %peer, reason = "limit", "connection closed");
        if self.limit_warned.tick().is_some() {
            tracing::warn!(
                listener = %self.label,
                max_connections = self.max,
                "connection limit reached with every connection busy: new connections are closed at once"
            );
        }
    }
}

/// Decrements a listener's open count when its connection's task ends (or is aborted).
pub(crate) struct Open(pub(crate) Arc<ListenerStats>);

impl Drop for Open {
    fn drop(&mut self) {
        self.0.open.fetch_sub(1, Ordering::Relaxed);
    }
}

/// The listeners' series and the admin listener's refusals, registered with the proxy's own.
#[derive(Debug, Default)]
pub(crate) struct Listening {
    listeners: OnceLock<Vec<Arc<ListenerStats>>>,
    /// State changes the admin listener refused, by [`Refused`].
    pub(crate) admin_refused: [AtomicU64; Refused::ALL.len()],
}

impl Listening {
    /// Sets the listeners (once, at start).
    pub(crate) fn set(&self, listeners: Vec<Arc<ListenerStats>>) {
        let _ = self.listeners.set(listeners);
    }

    pub(crate) fn encode(&self, enc: &mut DescriptorEncoder) -> std::fmt::Result {
        let listeners = self.listeners.get().map_or(&[][..], Vec::as_slice);
        let mut m = enc.encode_descriptor(
            "stormguard_proxy_connections",
            "connections each listener holds now",
            None,
            MetricType::Gauge,
        )?;
        for l in listeners {
            let open = i64::try_from(l.open.load(Ordering::Relaxed)).unwrap_or(i64::MAX);
            ConstGauge::new(open).encode(m.encode_family(&[("listener", l.label.as_str())])?)?;
        }
        let mut m = enc.encode_descriptor(
            "stormguard_proxy_connections_max",
            "connections each listener holds at most (max_connections, admin_max_connections)",
            None,
            MetricType::Gauge,
        )?;
        for l in listeners {
            let max = i64::try_from(l.max).unwrap_or(i64::MAX);
            ConstGauge::new(max).encode(m.encode_family(&[("listener", l.label.as_str())])?)?;
        }
        let mut m = enc.encode_descriptor(
            "stormguard_proxy_connections_accepted",
            "connections each listener accepted (under its limit)",
            None,
            MetricType::Counter,
        )?;
        for l in listeners {
            ConstCounter::new(l.accepted.load(Ordering::Relaxed))
                .encode(m.encode_family(&[("listener", l.label.as_str())])?)?;
        }
        let mut m = enc.encode_descriptor(
            "stormguard_proxy_connections_closed",
            "connections the proxy closed: header-timeout (no whole request head within header_read_timeout), idle (nothing in flight for idle_timeout), limit (refused at accept: the listener full and every connection busy), h2-keepalive (an HTTP/2 PING unanswered), evicted (idle longest when the listener was full: closed for a new connection), response-stalled (an HTTP/1.1 answer cut at response_idle_timeout)",
            None,
            MetricType::Counter,
        )?;
        for l in listeners {
            for why in Closed::ALL {
                ConstCounter::new(l.closed[why as usize].load(Ordering::Relaxed)).encode(
                    m.encode_family(&[("listener", l.label.as_str()), ("reason", why.as_str())])?,
                )?;
            }
        }
        let mut m = enc.encode_descriptor(
            "stormguard_admin_refused",
            "state changes the admin listener refused: content-type (not application/json), host (not the admin address), origin (a foreign Origin), token (admin_token missing or wrong)",
            None,
            MetricType::Counter,
        )?;
        for why in Refused::ALL {
            ConstCounter::new(self.admin_refused[why as usize].load(Ordering::Relaxed))
                .encode(m.encode_family(&[("reason", why.as_str())])?)?;
        }
        Ok(())
    }
}

/// Why a state change was refused: the `reason` label of `stormguard_admin_refused_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refused {
    /// Not `Content-Type: application/json`.
    ContentType,
    /// A `Host` that is not the admin address.
    Host,
    /// An `Origin` other than the admin's own.
    Origin,
    /// `admin_token` is configured and the bearer token is missing or wrong.
    Token,
}

impl Refused {
    pub(crate) const ALL: [Refused; 4] =
        [Refused::ContentType, Refused::Host, Refused::Origin, Refused::Token];

    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Refused::ContentType => "content-type",
            Refused::Host => "host",
            Refused::Origin => "origin",
            Refused::Token => "token",
        }
    }
}
