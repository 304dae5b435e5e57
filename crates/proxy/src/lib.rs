//! # stormguard-proxy
//!
//! The sidecar: an HTTP proxy on hyper 1 that every caller on a host goes through, so the cap
//! and the retry budget hold for services not written in Rust. It runs the very same tower
//! stack as the library ([`stack::stack`]): every attempt — first try or retry — takes a slot
//! under the dependency's cap, retries spend its budget, and the proxy's own refusals are
//! answered `503` (`queue`, `breaker`) or `504` (`deadline`) with `x-stormguard-denied`.
//!
//! ```no_run
//! use stormguard_proxy::config::{DependencyConfig, ProxyConfig};
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let mut dep = DependencyConfig::new("payments", "http://127.0.0.1:9000".parse()?);
//! dep.cap = 20;
//! dep.budget = "ratio:percent=0.25,min_per_sec=3".parse()?;
//! let proxy = stormguard_proxy::start(ProxyConfig::single("127.0.0.1:8080".parse()?, dep)).await?;
//! println!("listening on {:?}", proxy.listen_addrs());
//! proxy.shutdown().await;
//! # Ok(()) }
//! ```
//!
//! Modules: [`config`] (the TOML schema and the quick flags, validated once), [`stack`] (the
//! middleware, in one function), [`hop`] (hop-by-hop headers), [`scopes`] (fan-out scopes by
//! trace id). The narrative is in docs/proxy.md.

pub mod admin;
pub mod config;
mod fleet;
pub mod hop;
pub mod scopes;
mod server;
pub mod stack;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::Registry;
use stormguard_tower::Dependency;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::{JoinHandle, JoinSet};

use crate::config::ProxyConfig;
use crate::scopes::TraceScopes;
use crate::server::{DepRuntime, RouteRuntime, Shared};

/// Why the proxy could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// The configuration is invalid (`key: reason`).
    #[error("{0}: {1}")]
    Invalid(String, String),
    /// An address could not be bound.
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        /// The address asked for.
        addr: SocketAddr,
        /// Why.
        source: std::io::Error,
    },
}

/// A running proxy. Dropping it stops it too (without waiting).
#[derive(Debug)]
pub struct ProxyHandle {
    listen: Vec<SocketAddr>,
    admin: Option<SocketAddr>,
    dependencies: Vec<Dependency>,
    fleets: Vec<stormguard_redis::Fleet>,
    shutdown: watch::Sender<bool>,
    tasks: Vec<JoinHandle<()>>,
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

    /// The dependency named `name`: its snapshot, its switches.
    pub fn dependency(&self, name: &str) -> Option<&Dependency> {
        self.dependencies.iter().find(|d| d.name() == name)
    }

    /// The fleet layer of the dependency named `name`, when its placement is `fleet`.
    pub fn fleet(&self, name: &str) -> Option<&stormguard_redis::Fleet> {
        self.fleets.iter().find(|f| f.config().dependency == name)
    }

    /// A future that resolves when [`shutdown`](Self::shutdown) is called or the handle dropped.
    pub fn stopped(&self) -> impl Future<Output = ()> + Send + 'static {
        let mut rx = self.shutdown.subscribe();
        async move {
            let _ = rx.wait_for(|stop| *stop).await;
        }
    }

    /// Stops accepting, closes every connection, and waits for the listeners to end.
    pub async fn shutdown(mut self) {
        let _ = self.shutdown.send(true);
        for t in self.tasks.drain(..) {
            let _ = t.await;
        }
    }
}

impl Drop for ProxyHandle {
    fn drop(&mut self) {
        let _ = self.shutdown.send(true);
    }
}

/// Starts the proxy on the current tokio runtime: binds every listener (and the admin
/// listener), then serves until [`ProxyHandle::shutdown`].
pub async fn start(config: ProxyConfig) -> Result<ProxyHandle, StartError> {
    config.validate().map_err(|(k, r)| StartError::Invalid(k, r))?;
    let mut deps = Vec::new();
    let mut registry = Registry::default();
    let mut fleets = Vec::new();
    for d in &config.dependencies {
        let (dependency, fleet) = fleet::build(d)?;
        stormguard_tower::metrics::register(&mut registry, &dependency);
        if let Some((fleet, worker)) = fleet {
            stormguard_redis::metrics::register(&mut registry, &fleet);
            fleets.push((fleet, worker));
        }
        let service = stack::stack(&dependency, stack::client(d.cap));
        deps.push(DepRuntime {
            service,
            upstream: d.upstreams[0].clone(),
            scopes: TraceScopes::new(d.scope_header.clone(), d.scope_retries, config.scope_max),
            dependency,
        });
    }
    let index = |name: &str| config.dependencies.iter().position(|d| d.name == name);
    let mut routes = Vec::new();
    for r in &config.routes {
        let budget = match &r.budget {
            Some(spec) => Some(Arc::new(
                spec.build()
                    .map_err(|e| StartError::Invalid("route budget".into(), e.to_string()))?,
            ) as Arc<dyn stormguard_core::budget::RetryBudget>),
            None => None,
        };
        routes.push(RouteRuntime {
            host: r.host.clone(),
            path_prefix: r.path_prefix.clone(),
            dep: index(&r.dependency).expect("validated"),
            budget,
            idempotent: r.idempotent,
            label: format!("{}{}", r.host.as_deref().unwrap_or(""), r.path_prefix),
        });
    }
    let mut bound = Vec::new();
    for l in &config.listeners {
        let listener = TcpListener::bind(l.listen)
            .await
            .map_err(|source| StartError::Bind { addr: l.listen, source })?;
        let addr =
            listener.local_addr().map_err(|source| StartError::Bind { addr: l.listen, source })?;
        bound.push((listener, addr, l.dependency.as_deref().and_then(index)));
    }
    let shared = Arc::new(Shared {
        deps,
        routes,
        listeners: bound.iter().map(|(_, a, d)| (*a, *d)).collect(),
        refused_not_routable: Default::default(),
        refused_no_route: Default::default(),
    });
    registry.register_collector(Box::new(ProxyCollector { shared: shared.clone() }));
    let (shutdown, _) = watch::channel(false);
    let mut tasks = Vec::new();
    // The proxy owns each fleet's lease worker: it renews until shutdown.
    let mut fleet_handles = Vec::new();
    for (fleet, worker) in fleets {
        let mut stop = shutdown.subscribe();
        tasks.push(tokio::spawn(worker.run_until(async move {
            let _ = stop.wait_for(|s| *s).await;
        })));
        fleet_handles.push(fleet);
    }
    let mut listen = Vec::new();
    for (i, (listener, addr, _)) in bound.into_iter().enumerate() {
        listen.push(addr);
        let shared = shared.clone();
        let svc = move |req| {
            let shared = shared.clone();
            async move { Ok::<_, std::convert::Infallible>(server::handle(shared, i, req).await) }
        };
        tasks.push(tokio::spawn(serve(listener, svc, shutdown.subscribe())));
        tracing::info!(addr = %addr, "stormguard proxy listening");
    }
    let mut admin_addr = None;
    if let Some(a) = config.admin {
        let listener =
            TcpListener::bind(a).await.map_err(|source| StartError::Bind { addr: a, source })?;
        admin_addr =
            Some(listener.local_addr().map_err(|source| StartError::Bind { addr: a, source })?);
        let admin =
            Arc::new(admin::Admin { shared: shared.clone(), registry, config: config.to_json() });
        let svc = move |req| {
            let admin = admin.clone();
            async move { Ok::<_, std::convert::Infallible>(admin.handle(req).await) }
        };
        tasks.push(tokio::spawn(serve(listener, svc, shutdown.subscribe())));
    }
    Ok(ProxyHandle {
        listen,
        admin: admin_addr,
        dependencies: shared.deps.iter().map(|d| d.dependency.clone()).collect(),
        fleets: fleet_handles,
        shutdown,
        tasks,
    })
}

/// Accepts connections until shutdown; each is served by hyper-util's auto builder (HTTP/1.1,
/// or h2c when the client opens with the HTTP/2 preface). Ending the loop aborts every
/// connection task.
async fn serve<F, Fut, B>(listener: TcpListener, svc: F, mut stop: watch::Receiver<bool>)
where
    F: Fn(http::Request<hyper::body::Incoming>) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = Result<http::Response<B>, std::convert::Infallible>> + Send + 'static,
    B: http_body::Body<Data = bytes::Bytes> + Send + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let mut conns = JoinSet::new();
    loop {
        let (stream, _) = tokio::select! {
            _ = stop.changed() => break,
            r = listener.accept() => match r {
                Ok(c) => c,
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                    continue;
                }
            },
            Some(_) = conns.join_next(), if !conns.is_empty() => continue,
        };
        let _ = stream.set_nodelay(true);
        let svc = svc.clone();
        conns.spawn(async move {
            let service = hyper::service::service_fn(svc);
            let builder = auto::Builder::new(TokioExecutor::new());
            if let Err(e) = builder.serve_connection(TokioIo::new(stream), service).await {
                tracing::debug!(error = %e, "connection ended with an error");
            }
        });
    }
}

/// The proxy's own series: the switches and what it refused before any dependency.
#[derive(Debug)]
struct ProxyCollector {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared").field("dependencies", &self.deps.len()).finish_non_exhaustive()
    }
}

impl Collector for ProxyCollector {
    fn encode(&self, mut enc: DescriptorEncoder) -> std::fmt::Result {
        let mut m = enc.encode_descriptor(
            "stormguard_retries_enabled",
            "1 while retries are on, 0 after the kill switch",
            None,
            MetricType::Gauge,
        )?;
        for d in &self.shared.deps {
            let on = i64::from(d.dependency.policy().retries_enabled());
            ConstGauge::new(on).encode(m.encode_family(&[("dependency", d.dependency.name())])?)?;
        }
        let mut m = enc.encode_descriptor(
            "stormguard_proxy_refused",
            "requests refused before any dependency: not_routable (absolute-form for another host, CONNECT), no_route",
            None,
            MetricType::Counter,
        )?;
        for (reason, n) in [
            ("not_routable", &self.shared.refused_not_routable),
            ("no_route", &self.shared.refused_no_route),
        ] {
            ConstCounter::new(n.load(Ordering::Relaxed))
                .encode(m.encode_family(&[("reason", reason)])?)?;
        }
        Ok(())
    }
}
