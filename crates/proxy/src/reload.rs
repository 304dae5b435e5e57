//! Reload: a new config put in force while the proxy runs (SIGHUP, `POST /reload`,
//! [`ProxyHandle::reload`](crate::ProxyHandle::reload)).
//!
//! The new config is validated first; a bad one is refused, and the running one stays. Every
//! reload is one log line: `config reloaded` at `info` with what changed, or `reload refused`
//! at `warn` with the reason (the file, line, column and key of a bad file). Connections are not touched: each request is served by the generation of the config
//! that was in force when it arrived, and finishes there. Per dependency:
//!
//! - **unchanged** (same settings): kept whole — budget balance, limiter (in flight, queue,
//!   held slots), breaker, pushback hold, fan-out scopes, counters;
//! - **changed, same upstream**: built anew, keeping each part whose own settings did not
//!   change (the budget when its SPEC is the same, the limiter when cap, queue and queue
//!   timeout are, the breaker when its parameters are; the kill switch always). When the
//!   limiter itself changes, the new one starts lowered by what the old one still has in
//!   flight and rises as those permits return (refreshed every 5 ms), so the upstream never
//!   sees the two caps added up — the switch-over happens as permits return;
//! - **changed upstream, added, removed**: fresh state; a removed dependency's requests in
//!   flight finish on it.
//!
//! What cannot change while running: the listeners' addresses, timeouts and connection
//! limits, the admin address and its access keys (`admin_allow_remote`, `admin_token`), and
//! the record file (they need a restart; a config changing them is refused). A reload from the
//! file applies the command line's [`Overrides`](crate::config::Overrides) again first, so
//! `--record` or `--admin` given beside `--config` stay what they were.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use stormguard_tower::Dependency;

use crate::config::ProxyConfig;
use crate::record::TraceFile;
use crate::scopes::TraceScopes;
use crate::state::{DepRuntime, RouteRuntime, Shared, State};

/// What a reload changed, by dependency name. Shown as `changed: a; added: none; removed: none;
/// unchanged: b, c`.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct ReloadReport {
    /// Kept whole.
    pub unchanged: Vec<String>,
    /// Rebuilt, keeping what their changes allowed.
    pub changed: Vec<String>,
    /// New.
    pub added: Vec<String>,
    /// Gone (requests in flight finish on them).
    pub removed: Vec<String>,
}

impl std::fmt::Display for ReloadReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "changed: {}; added: {}; removed: {}; unchanged: {}",
            Names(&self.changed),
            Names(&self.added),
            Names(&self.removed),
            Names(&self.unchanged)
        )
    }
}

/// Dependency names for a log line: `a, b`, or `none`.
struct Names<'a>(&'a [String]);

impl std::fmt::Display for Names<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.0.is_empty() {
            return f.write_str("none");
        }
        f.write_str(&self.0.join(", "))
    }
}

/// Why a reload was refused. The running config stays in force.
#[derive(Debug, thiserror::Error)]
pub enum ReloadError {
    /// The file could not be read, or is not a valid config (the message names the file,
    /// line, column and key).
    #[error(transparent)]
    File(#[from] crate::config::ConfigError),
    /// The new config breaks a rule (the message names the key).
    #[error(transparent)]
    Invalid(Box<crate::config::RuleViolation>),
    /// What the new config describes could not be built.
    #[error(transparent)]
    Build(Box<crate::StartError>),
    /// The new config changes what needs a restart.
    #[error("{0} cannot change on reload: restart the proxy to change it")]
    Fixed(&'static str),
    /// The proxy was not started from a file, so there is nothing to read again.
    #[error("the proxy was not started from a config file: nothing to reload")]
    NoSource,
}

/// A generation built from a config, and what to do when it goes in force.
pub(crate) struct Built {
    pub(crate) shared: Shared,
    pub(crate) report: ReloadReport,
    /// The fleet layers built, with the workers to run (at start only: a reload refuses to
    /// change a fleet dependency).
    pub(crate) fleets: Vec<(stormguard_redis::Fleet, stormguard_redis::FleetWorker)>,
    /// Changed limiters of the same upstream: (old, new).
    bridges: Vec<(Dependency, Dependency)>,
}

/// Builds the runtime of `config`, reusing what `previous` has for unchanged parts.
pub(crate) fn build(
    config: &ProxyConfig,
    previous: Option<&Shared>,
    addrs: &[SocketAddr],
    trace: Option<&Arc<TraceFile>>,
) -> Result<Built, crate::StartError> {
    use crate::config::{Invalid, KeyPath, RuleError, ToTower};
    let invalid =
        |key: KeyPath, e: RuleError| crate::StartError::Invalid(Box::new(Invalid::new(key, e)));
    let mut report = ReloadReport::default();
    let mut fleets = Vec::new();
    let mut bridges = Vec::new();
    let mut deps = Vec::new();
    for (i, d) in config.dependencies.iter().enumerate() {
        let here = KeyPath::root().key("dependency").index(i);
        let key = (d.clone(), config.scope_max);
        let old = previous.and_then(|p| p.deps.iter().find(|o| o.config.0.name == d.name));
        if let Some(o) = old.filter(|o| o.config == key) {
            deps.push(o.clone());
            report.unchanged.push(d.name.clone());
            continue;
        }
        let mut tower = d.to_tower();
        tower.recorder = trace.map(TraceFile::recorder);
        let upstreams: Arc<[http::Uri]> = d.upstreams.clone().into();
        let same_upstream = old.filter(|o| o.upstreams == upstreams);
        let dependency = match same_upstream {
            Some(o) if d.fleet.is_none() => o.dependency.successor(tower).map_err(|e| {
                invalid(here.clone().key(e.key()), RuleError::Dependency(Box::new(e)))
            })?,
            _ => {
                let (dependency, fleet) = crate::fleet::build(d, &here, tower)?;
                fleets.extend(fleet);
                dependency
            }
        };
        if same_upstream.is_some() {
            // Each upstream whose limiter was rebuilt switches over from the old one.
            let o = old.expect("same upstream implies an old one");
            bridges.push((o.dependency.clone(), dependency.clone()));
        }
        match old {
            Some(_) => report.changed.push(d.name.clone()),
            None => report.added.push(d.name.clone()),
        }
        deps.push(Arc::new(DepRuntime {
            service: crate::stack::stack(
                &dependency,
                crate::stack::client(d).map_err(|e| {
                    crate::StartError::Invalid(Box::new(
                        crate::config::validate::tls_error(e).under(&here),
                    ))
                })?,
                upstreams.clone(),
            ),
            upstream_labels: upstreams
                .iter()
                .map(|u| Arc::from(crate::config::upstream_label(u)))
                .collect(),
            upstreams,
            scopes: TraceScopes::new(d.scope_header.clone(), d.scope_retries, config.scope_max),
            callers: crate::callers::RecentFailures::new(),
            name: Arc::from(d.name.as_str()),
            config: key,
            dependency,
        }));
    }
    if let Some(p) = previous {
        for o in &p.deps {
            if !config.dependencies.iter().any(|d| d.name == o.config.0.name) {
                report.removed.push(o.config.0.name.clone());
            }
        }
    }
    let index = |name: &str| config.dependencies.iter().position(|d| d.name == name);
    let mut routes = Vec::new();
    for (i, r) in config.routes.iter().enumerate() {
        let dep = index(&r.dependency).expect("validated");
        // An unchanged route keeps its budget's balance.
        let old = previous.and_then(|p| {
            p.routes.iter().find(|o| o.config == *r && p.deps[o.dep].config.0.name == r.dependency)
        });
        let budget = match (old, &r.budget) {
            (Some(o), _) => o.budget.clone(),
            (None, Some(spec)) => Some(Arc::new(spec.build().map_err(|e| {
                invalid(KeyPath::root().key("route").index(i).key("budget"), e.into())
            })?)
                as Arc<dyn stormguard_core::budget::RetryBudget>),
            (None, None) => None,
        };
        routes.push(Arc::new(RouteRuntime {
            host: r.host.clone(),
            path_prefix: r.path_prefix.clone(),
            dep,
            budget,
            idempotent: r.idempotent,
            label: Arc::from(format!("{}{}", r.host.as_deref().unwrap_or(""), r.path_prefix)),
            config: r.clone(),
        }));
    }
    let listeners = addrs
        .iter()
        .zip(&config.listeners)
        .map(|(a, l)| crate::state::ListenerRule {
            addr: *a,
            dependency: l.dependency.as_deref().and_then(index),
            pushback: l.downstream_pushback,
            tree: l.tree,
            allowance: l.tree_allowance,
        })
        .collect();
    let shared = Shared {
        deps,
        routes,
        listeners,
        client_header: config.client_header.clone(),
        config: config.clone(),
    };
    Ok(Built { shared, report, bridges, fleets })
}

/// How long one step of a limiter's switch-over holds if it is not renewed.
const BRIDGE_TTL: Duration = Duration::from_millis(50);

/// For each upstream whose limiter was rebuilt: lowers the new limiter's cap by what the old
/// one has in flight until the old one is empty, so the upstream sees at most the new cap
/// across both (at least one slot stays open so the new config can start). A limiter that was
/// kept needs nothing.
fn bridge(old: Dependency, new: Dependency) {
    let step = move || {
        let mut busy_anywhere = false;
        for i in 0..new.upstream_count().min(old.upstream_count()) {
            let (o, n) = (&old.upstream_at(i).limiter, &new.upstream_at(i).limiter);
            if o.config() == n.config() {
                continue;
            }
            let busy = o.in_flight();
            if busy > 0 {
                busy_anywhere = true;
                n.set_limit_hint(n.config().cap.saturating_sub(busy).max(1), BRIDGE_TTL);
            }
        }
        busy_anywhere
    };
    if step() {
        tokio::spawn(async move {
            while step() {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        });
    }
}

/// Puts `config` in force, or refuses it and keeps the running one.
pub(crate) async fn reload(
    state: &Arc<State>,
    config: ProxyConfig,
) -> Result<ReloadReport, ReloadError> {
    let _one_at_a_time = state.reload_lock.lock().await;
    let result = apply(state, config);
    account(state, &result);
    result
}

/// Writes a reload's one log line, then counts it: whoever sees the count (a test, a script
/// polling `/metrics`) finds the line already written, before any later reload's.
fn account(state: &State, result: &Result<ReloadReport, ReloadError>) {
    match result {
        Ok(r) => {
            tracing::info!(
                changed = %Names(&r.changed),
                added = %Names(&r.added),
                removed = %Names(&r.removed),
                unchanged = %Names(&r.unchanged),
                "config reloaded"
            );
            state.reloads.fetch_add(1, Ordering::Relaxed);
        }
        Err(e) => {
            tracing::warn!(reason = %e, "reload refused; the running config stays");
            state.reloads_refused.fetch_add(1, Ordering::Relaxed);
        }
    }
}

fn apply(state: &Arc<State>, config: ProxyConfig) -> Result<ReloadReport, ReloadError> {
    config.validate().map_err(|e| ReloadError::Invalid(Box::new(e)))?;
    let old = state.current();
    let listen = |c: &ProxyConfig| c.listeners.iter().map(|l| l.listen).collect::<Vec<_>>();
    if listen(&old.config) != listen(&config) {
        return Err(ReloadError::Fixed("the listeners' addresses"));
    }
    if old.config.admin != config.admin {
        return Err(ReloadError::Fixed("the admin address"));
    }
    if old.config.record != config.record {
        return Err(ReloadError::Fixed("the record file"));
    }
    if old.config.connections != config.connections {
        return Err(ReloadError::Fixed("the listeners' timeouts and connection limits"));
    }
    if old.config.admin_access != config.admin_access {
        return Err(ReloadError::Fixed("admin_allow_remote and admin_token"));
    }
    // A fleet dependency's lease worker runs for the proxy's life: it cannot be swapped.
    let fleet_deps = |c: &ProxyConfig| {
        c.dependencies.iter().filter(|d| d.fleet.is_some()).cloned().collect::<Vec<_>>()
    };
    if fleet_deps(&old.config) != fleet_deps(&config) {
        return Err(ReloadError::Fixed("a dependency with placement = \"fleet\""));
    }
    let addrs: Vec<SocketAddr> = old.listeners.iter().map(|l| l.addr).collect();
    let built = build(&config, Some(&old), &addrs, state.trace.as_ref())
        .map_err(|e| ReloadError::Build(Box::new(e)))?;
    for (o, n) in built.bridges {
        bridge(o, n);
    }
    state.replace(built.shared);
    crate::rebuild_registry(state);
    Ok(built.report)
}

/// Reads the config file again and puts it in force.
pub(crate) async fn reload_from_source(state: &Arc<State>) -> Result<ReloadReport, ReloadError> {
    let read = match state.source.clone() {
        None => Err(ReloadError::NoSource),
        Some(path) => ProxyConfig::load(&path).map_err(ReloadError::File),
    };
    match read {
        Ok(mut config) => {
            // What the command line set over the file when the proxy started holds over the
            // file as it is now, too.
            state.current().config.overrides.apply(&mut config);
            reload(state, config).await
        }
        Err(e) => {
            let refused = Err(e);
            account(state, &refused);
            refused
        }
    }
}
