//! # stormguard-proxy
//!
//! The sidecar: an HTTP proxy on hyper 1 that every caller on a host goes through, so the cap
//! and the retry budget hold for services not written in Rust. It runs the very same tower
//! stack as the library (`stack::stack`): every attempt — first try or retry — takes a slot
//! under the dependency's cap, retries spend its budget, and the proxy's own refusals are
//! answered `503` (`queue`, `breaker`) or `504` (`deadline`) with `x-stormguard-denied`.
//!
//! ```no_run
//! use stormguard_proxy::config::{ProxyDependency, ProxyConfig};
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let mut dep = ProxyDependency::new("payments", "http://127.0.0.1:9000".parse()?);
//! dep.cap = 20;
//! dep.budget = "ratio:percent=0.25,min_per_sec=3".parse()?;
//! let proxy = stormguard_proxy::start(ProxyConfig::single("127.0.0.1:8080".parse()?, dep)).await?;
//! println!("listening on {:?}", proxy.listen_addrs());
//! proxy.shutdown().await;
//! # Ok(()) }
//! ```
//!
//! Operating it: [`ProxyHandle::reload`] (SIGHUP, `POST /reload`) puts a new config in force
//! without dropping a connection — unchanged dependencies keep their budget, limiter and
//! breaker; [`ProxyHandle::drain`] (SIGTERM) fails `/readyz` at once, stops accepting, and
//! lets requests in flight finish up to the drain timeout. Every listener, the admin listener
//! included, times out request heads and idle connections and holds a bounded number of
//! connections; the admin listener's state changes are guarded against web pages (docs/proxy.md,
//! "Limits and timeouts" and "Security").
//!
//! The public surface is [`start`], [`ProxyHandle`] and [`config`] (the TOML schema and the
//! quick flags, validated once), with [`grpc`]'s `grpc-timeout` grammar. Inside, one concern a
//! room: `listener` (sockets, connection limits, timeouts), `server` (routing a request to its
//! dependency), `stack` (the middleware, in one function), `attempt` (what happens to each
//! attempt below the cap), `upstream` (the upstream client: TLS, HTTP/2 with the cap held under
//! the peer's streams), `body` (the caller's body), `hop` (hop-by-hop headers), `scopes`
//! (fan-out scopes by trace id), `record` (record mode), `traffic` (the per-route series),
//! `admin` (the admin listener and dashboard), `reload`, `fleet`. The narrative is in
//! docs/proxy.md.

#![warn(missing_docs)]
#![recursion_limit = "256"]

mod admin;
mod attempt;
mod body;
pub mod callers;
pub mod config;
mod fleet;
mod forward;
pub mod grpc;
mod hop;
mod listener;
mod outgoing;
mod path;
mod pool;
mod provider;
mod pushback;
mod record;
mod relay;
mod reload;
mod scopes;
mod server;
mod stack;
mod state;
mod traffic;
mod tree;
mod upstream;

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::{Arc, PoisonError, Weak};
use std::time::Duration;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::Registry;
use stormguard_tower::Dependency;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::config::ProxyConfig;
use crate::listener::{Stop, serve};
use crate::state::{ListenerStats, State};

pub use crate::reload::{ReloadError, ReloadReport};

/// Why the proxy could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// The configuration breaks a rule (`key.path: reason`).
    #[error("{0}")]
    Invalid(Box<config::RuleViolation>),
    /// The trace file (`--record`) could not be created.
    #[error("cannot write the trace {path}: {source}")]
    Record {
        /// The file asked for.
        path: std::path::PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// A listener's address could not be bound (`listener[0] 127.0.0.1:8080: address in use`).
    #[error("{listener} {addr}: {}", bind_reason(source))]
    Bind {
        /// Which listener.
        listener: Listener,
        /// The address asked for.
        addr: SocketAddr,
        /// Why.
        source: std::io::Error,
    },
}

/// Which listener a [`StartError::Bind`] is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Listener {
    /// A caller listener: `[[listener]]` number `index` in the config (the only one, 0, when
    /// started from flags).
    Caller {
        /// Its place in the config's listeners.
        index: usize,
    },
    /// The admin listener (`admin`).
    Admin,
}

impl std::fmt::Display for Listener {
    /// `listener[0]` (the config's key) or `admin listener`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Listener::Caller { index } => write!(f, "listener[{index}]"),
            Listener::Admin => f.write_str("admin listener"),
        }
    }
}

/// Why an address could not be bound, in words: `in use` for the common case.
fn bind_reason(e: &std::io::Error) -> String {
    match e.kind() {
        std::io::ErrorKind::AddrInUse => "address in use (another process listens there)".into(),
        std::io::ErrorKind::AddrNotAvailable => "address not available on this host".into(),
        std::io::ErrorKind::PermissionDenied => "permission denied (a port below 1024?)".into(),
        _ => format!("cannot listen: {e}"),
    }
}

/// A running proxy. Dropping it stops it too (without waiting).
#[derive(Debug)]
pub struct ProxyHandle {
    listen: Vec<SocketAddr>,
    admin: Option<SocketAddr>,
    state: Arc<State>,
    /// The caller listeners: run, drain, stop.
    listeners_stop: watch::Sender<Stop>,
    /// Everything else (admin, flusher, fleet workers): stop.
    shutdown: watch::Sender<bool>,
    listener_tasks: Vec<JoinHandle<usize>>,
    tasks: Vec<JoinHandle<()>>,
}

/// What a drain did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DrainReport {
    /// Connections still open when the drain timeout passed (closed then).
    pub cut: usize,
    /// How long the drain took.
    pub took: Duration,
}

impl ProxyHandle {
    /// The addresses of the listeners, in config order (the real ports when 0 was asked).
    pub fn listen_addrs(&self) -> &[SocketAddr] {
        &self.listen
    }

    /// The admin listener's address, if it runs.
    pub fn admin_addr(&self) -> Option<SocketAddr> {
        self.admin
    }

    /// The dependency named `name` in the config in force: its snapshot, its switches.
    pub fn dependency(&self, name: &str) -> Option<Dependency> {
        self.state
            .current()
            .deps
            .iter()
            .find(|d| d.dependency.name() == name)
            .map(|d| d.dependency.clone())
    }

    /// The config in force: the one the proxy started with, or the last a reload put in force.
    pub fn config(&self) -> ProxyConfig {
        self.state.current().config.clone()
    }

    /// The fleet layer of the dependency named `name`, when its placement is `fleet`.
    pub fn fleet(&self, name: &str) -> Option<&stormguard_redis::Fleet> {
        self.state.fleets.iter().find(|f| f.config().dependency == name)
    }

    /// Puts `config` in force (see docs/proxy.md, "Reload"). A config that is invalid, or that changes
    /// what cannot change while running (listeners, admin address, record file), is refused
    /// and the running one stays.
    pub async fn reload(&self, config: ProxyConfig) -> Result<ReloadReport, ReloadError> {
        reload::reload(&self.state, config).await
    }

    /// Reads the file the config came from again and puts it in force (SIGHUP).
    pub async fn reload_from_source(&self) -> Result<ReloadReport, ReloadError> {
        reload::reload_from_source(&self.state).await
    }

    /// A future that resolves when [`shutdown`](Self::shutdown) is called or the handle dropped.
    pub fn stopped(&self) -> impl Future<Output = ()> + Send + 'static {
        let mut rx = self.shutdown.subscribe();
        async move {
            let _ = rx.wait_for(|stop| *stop).await;
        }
    }

    /// The drain (SIGTERM): `/readyz` fails at once, the listeners stop accepting, open
    /// connections finish the requests they are serving (HTTP/1.1 closes after the response,
    /// HTTP/2 gets a GOAWAY) for up to `timeout`; then everything stops.
    pub async fn drain(mut self, timeout: Duration) -> DrainReport {
        let started = std::time::Instant::now();
        self.state.draining.store(true, Ordering::SeqCst);
        tracing::debug!(timeout_ms = timeout.as_millis() as u64, "draining");
        let _ = self.listeners_stop.send(Stop::Drain);
        let mut tasks = std::mem::take(&mut self.listener_tasks);
        let drained = tokio::time::timeout(timeout, async {
            for t in &mut tasks {
                let _ = t.await;
            }
        })
        .await
        .is_ok();
        let _ = self.listeners_stop.send(Stop::Now);
        let mut cut = 0;
        if !drained {
            for t in tasks {
                cut += t.await.unwrap_or(0);
            }
        }
        self.stop_rest().await;
        let took = started.elapsed();
        tracing::debug!(cut, took_ms = took.as_millis() as u64, "drained");
        DrainReport { cut, took }
    }

    /// Stops accepting, closes every connection, and waits for the listeners to end.
    pub async fn shutdown(mut self) {
        let _ = self.listeners_stop.send(Stop::Now);
        for t in self.listener_tasks.drain(..) {
            let _ = t.await;
        }
        self.stop_rest().await;
    }

    async fn stop_rest(&mut self) {
        let _ = self.shutdown.send(true);
        for t in self.tasks.drain(..) {
            let _ = t.await;
        }
    }
}

impl Drop for ProxyHandle {
    fn drop(&mut self) {
        let _ = self.listeners_stop.send(Stop::Now);
        let _ = self.shutdown.send(true);
    }
}

/// Starts the proxy on the current tokio runtime: binds every listener (and the admin
/// listener), then serves until [`ProxyHandle::shutdown`] or [`ProxyHandle::drain`].
pub async fn start(config: ProxyConfig) -> Result<ProxyHandle, StartError> {
    config.validate().map_err(|e| StartError::Invalid(Box::new(e)))?;
    let admin_token = match &config.admin_access.token {
        Some(t) if config.admin.is_some() => Some(t.resolve().map_err(|e| {
            StartError::Invalid(Box::new(config::Invalid::new(
                config::KeyPath::root().key("admin_token"),
                e.into(),
            )))
        })?),
        _ => None,
    };
    let trace = match &config.record {
        Some(path) => Some(
            record::TraceFile::create(path)
                .map_err(|source| StartError::Record { path: path.clone(), source })?,
        ),
        None => None,
    };
    let mut bound = Vec::new();
    for (index, l) in config.listeners.iter().enumerate() {
        let bind_error = |source| StartError::Bind {
            listener: Listener::Caller { index },
            addr: l.listen,
            source,
        };
        let listener = TcpListener::bind(l.listen).await.map_err(bind_error)?;
        let addr = listener.local_addr().map_err(bind_error)?;
        bound.push((listener, addr));
    }
    // Every address is bound before anything starts: a start that fails leaves nothing running.
    let admin_listener = match config.admin {
        Some(a) => {
            let bind_error =
                |source| StartError::Bind { listener: Listener::Admin, addr: a, source };
            let listener = TcpListener::bind(a).await.map_err(bind_error)?;
            let bound_at = listener.local_addr().map_err(bind_error)?;
            Some((a, listener, bound_at))
        }
        None => None,
    };
    let addrs: Vec<SocketAddr> = bound.iter().map(|(_, a)| *a).collect();
    let max_connections = max_connections(&config);
    let built = reload::build(&config, None, &addrs, trace.as_ref())?;
    let source = config.source.clone();
    let (fleets, workers): (Vec<_>, Vec<_>) = built.fleets.into_iter().unzip();
    let state = Arc::new(State::new(built.shared, trace.clone(), source, fleets));
    rebuild_registry(&state);
    let (listeners_stop, _) = watch::channel(Stop::Run);
    let (shutdown, _) = watch::channel(false);
    let mut listener_tasks = Vec::new();
    let mut tasks = Vec::new();
    // The proxy owns each fleet's lease worker: it renews until shutdown.
    for worker in workers {
        let mut stop = shutdown.subscribe();
        tasks.push(tokio::spawn(worker.run_until(async move {
            let _ = stop.wait_for(|s| *s).await;
        })));
    }
    let mut listening = Vec::new();
    for (i, (listener, addr)) in bound.into_iter().enumerate() {
        let state = state.clone();
        let svc = move |peer, req| {
            let state = state.clone();
            async move { Ok::<_, std::convert::Infallible>(server::handle(state, i, peer, req).await) }
        };
        let stats = Arc::new(ListenerStats::new(addr.to_string(), max_connections));
        listening.push(stats.clone());
        let connections = config.connections.clone();
        let stop = listeners_stop.subscribe();
        listener_tasks.push(tokio::spawn(async move {
            serve(listener, stats, &connections, svc, stop).await
        }));
        tracing::info!(addr = %addr, max_connections, "stormguard proxy listening");
    }
    if let Some(trace) = trace {
        let mut stop = shutdown.subscribe();
        tasks.push(tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(1));
            loop {
                tokio::select! {
                    _ = stop.changed() => break,
                    _ = tick.tick() => trace.flush(),
                }
            }
            trace.flush();
        }));
    }
    let mut admin_addr = None;
    if let Some((a, listener, bound_at)) = admin_listener {
        admin_addr = Some(bound_at);
        if !a.ip().is_loopback() {
            tracing::warn!(
                admin = %bound_at,
                admin_token = admin_token.is_some(),
                "the admin listener is reachable from other hosts (admin_allow_remote): whoever reaches it reads the config and the signals, and without admin_token may change state from an address that is the admin's"
            );
        }
        let admin = Arc::new(admin::Admin::new(state.clone(), bound_at, admin_token));
        let svc = move |_peer, req| {
            let admin = admin.clone();
            async move { Ok::<_, std::convert::Infallible>(admin.handle(req).await) }
        };
        let stats = Arc::new(ListenerStats::new("admin", config.connections.admin_max_connections));
        listening.push(stats.clone());
        let connections = config.connections.clone();
        // The admin listener answers through a drain (`/readyz` says 503) and stops last.
        let (admin_stop, rx) = watch::channel(Stop::Run);
        let mut stop = shutdown.subscribe();
        tasks.push(tokio::spawn(async move {
            let serving =
                tokio::spawn(async move { serve(listener, stats, &connections, svc, rx).await });
            let _ = stop.wait_for(|s| *s).await;
            let _ = admin_stop.send(Stop::Now);
            let _ = serving.await;
        }));
    }
    state.listening.set(listening);
    Ok(ProxyHandle {
        listen: addrs,
        admin: admin_addr,
        state,
        listeners_stop,
        shutdown,
        listener_tasks,
        tasks,
    })
}

/// Registers the metrics of the config in force: each dependency's, and the proxy's own.
pub(crate) fn rebuild_registry(state: &Arc<State>) {
    let mut registry = Registry::default();
    for d in &state.current().deps {
        stormguard_tower::metrics::register(&mut registry, &d.dependency);
    }
    for f in &state.fleets {
        stormguard_redis::metrics::register(&mut registry, f);
    }
    registry.register_collector(Box::new(ProxyCollector { state: Arc::downgrade(state) }));
    *state.registry.write().unwrap_or_else(PoisonError::into_inner) = registry;
}

/// Each caller listener's connection limit: `max_connections`, or a share of the open-files
/// limit (raised to the hard limit first) that keeps a reserve for the admin listener, the
/// upstream connections and files.
fn max_connections(config: &ProxyConfig) -> usize {
    // Raised whatever the limit: the admin listener and the upstreams need descriptors too.
    let open_files = listener::open_files_limit();
    if let Some(m) = config.connections.max_connections {
        return m;
    }
    let Some(open_files) = open_files else { return usize::MAX };
    let upstream_slots: u64 = config
        .dependencies
        .iter()
        .map(|d| (0..d.upstreams.len()).map(|i| d.upstream_ceiling(i)).sum::<u64>())
        .sum();
    let admin = if config.admin.is_some() { config.connections.admin_max_connections } else { 0 };
    let max = listener::default_max_connections(
        open_files,
        config.listeners.len(),
        admin,
        upstream_slots,
    );
    if max < 256 {
        tracing::warn!(
            open_files,
            max_connections = max,
            "the open-files limit leaves few connections per listener: raise the hard limit (ulimit -Hn, LimitNOFILE=) or set max_connections"
        );
    }
    max
}

/// The proxy's own series: the switches, what it refused before any dependency, the
/// per-route series, reloads, the trace file.
#[derive(Debug)]
struct ProxyCollector {
    state: Weak<State>,
}

impl std::fmt::Debug for State {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("State")
            .field("dependencies", &self.current().deps.len())
            .finish_non_exhaustive()
    }
}

impl Collector for ProxyCollector {
    fn encode(&self, mut enc: DescriptorEncoder) -> std::fmt::Result {
        let Some(state) = self.state.upgrade() else { return Ok(()) };
        let shared = state.current();
        let mut m = enc.encode_descriptor(
            "stormguard_retries_enabled",
            "1 while retries are on, 0 after the kill switch",
            None,
            MetricType::Gauge,
        )?;
        for d in &shared.deps {
            let on = i64::from(d.dependency.policy().retries_enabled());
            let name = stormguard_tower::metrics::LabelValue(d.dependency.name());
            ConstGauge::new(on).encode(m.encode_family(&[("dependency", name)])?)?;
        }
        let mut m = enc.encode_descriptor(
            "stormguard_proxy_refused",
            "requests refused before any dependency: not_routable (absolute-form for another host, CONNECT), no_route",
            None,
            MetricType::Counter,
        )?;
        for (reason, n) in
            [("not_routable", &state.refused_not_routable), ("no_route", &state.refused_no_route)]
        {
            ConstCounter::new(n.load(Ordering::Relaxed))
                .encode(m.encode_family(&[("reason", reason)])?)?;
        }
        let mut m = enc.encode_descriptor(
            "stormguard_proxy_client_errors",
            "requests the caller got wrong, answered by the proxy and counted by neither the breaker nor the budget: body-timeout (408: a body stalled past body_idle_timeout or not whole within body_timeout), body-malformed (400), bad-request (400: more than one Host), response-stalled (an answer the caller accepted nothing of for response_idle_timeout, cut)",
            None,
            MetricType::Counter,
        )?;
        for (reason, n) in [
            ("body-timeout", &state.body_timeouts),
            ("body-malformed", &state.body_malformed),
            ("bad-request", &state.bad_requests),
            ("response-stalled", &state.response_stalls),
        ] {
            ConstCounter::new(n.load(Ordering::Relaxed))
                .encode(m.encode_family(&[("reason", reason)])?)?;
        }
        let mut m = enc.encode_descriptor(
            "stormguard_reloads",
            "config reloads: applied, or refused (the running config stayed)",
            None,
            MetricType::Counter,
        )?;
        for (result, n) in [("applied", &state.reloads), ("refused", &state.reloads_refused)] {
            ConstCounter::new(n.load(Ordering::Relaxed))
                .encode(m.encode_family(&[("result", result)])?)?;
        }
        let m = enc.encode_descriptor(
            "stormguard_tree_overloaded_stamped",
            "failures a service answered for a user action a hop below had refused for load, sent up with x-should-retry: false and x-stormguard-tree: overloaded (listener tree = root or trust)",
            None,
            MetricType::Counter,
        )?;
        ConstCounter::new(state.overloaded.stamped.load(Ordering::Relaxed)).encode(m)?;
        let m = enc.encode_descriptor(
            "stormguard_draining",
            "1 once the proxy is draining (SIGTERM): /readyz fails",
            None,
            MetricType::Gauge,
        )?;
        ConstGauge::new(i64::from(state.draining.load(Ordering::Relaxed))).encode(m)?;
        state.listening.encode(&mut enc)?;
        state.traffic.encode(&mut enc)?;
        if let Some(trace) = &state.trace {
            let m = enc.encode_descriptor(
                "stormguard_record_lines",
                "lines written to the trace file (--record)",
                None,
                MetricType::Counter,
            )?;
            ConstCounter::new(trace.lines()).encode(m)?;
            let m = enc.encode_descriptor(
                "stormguard_record_errors",
                "writes to the trace file that failed",
                None,
                MetricType::Counter,
            )?;
            ConstCounter::new(trace.errors()).encode(m)?;
        }
        Ok(())
    }
}
