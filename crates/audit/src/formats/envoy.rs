//! Envoy route and cluster config, as a bootstrap (`static_resources`), as xDS resources
//! (`RouteConfiguration`, `Cluster`, a discovery response's `resources`), YAML or JSON.
//!
//! **Attempt semantics.** `retry_policy.num_retries` counts *retries* and defaults to **1** when
//! a `retry_policy` is present without it: up to `num_retries + 1` tries. A virtual host's
//! `retry_policy` applies to its routes that have none. `per_try_timeout` is the per-try
//! timeout; the route's `timeout` (default **15 s**) covers all tries. `hedge_policy` with
//! `hedge_on_per_try_timeout: true` sends a new attempt when a try times out without cancelling
//! it.
//!
//! **Budgets.** A cluster's `circuit_breakers.thresholds[].retry_budget` is a concurrency budget:
//! retries in flight at most `budget_percent` (default 20 %) of requests in flight, with a floor
//! of `min_retry_concurrency` (default 3) — so it caps a route's factor at `1 + p/(1 − p)`. A
//! cluster without one is a finding by itself: Envoy then falls back to the fixed `max_retries`
//! breaker (default 3 in flight), which bounds no ratio.
//!
//! `retry_budget.budget_interval` (default `0s`) changes what the share is counted over: at 0 only
//! requests in flight, otherwise every request started within the interval. Retries are counted
//! among the requests either way, so the steady-state cap is the same `1 + p/(1 − p)`; the
//! layer model keeps no window (a stormguard ratio budget's `ttl` is not kept either), so the
//! interval is read and checked, and changes no factor.

use crate::Collector;
use crate::formats::{Settings, conditions};
use crate::model::{Budget, Format, Layer, Location, Methods, Rule, Severity, pct};
use crate::node::{Node, Value};

/// What a route needs to know about its cluster.
#[derive(Debug, Clone, PartialEq)]
pub struct ClusterInfo {
    /// The cluster's retry budget.
    pub budget: Option<Budget>,
}

/// Looks for route configurations and clusters anywhere in the document; `false` when there
/// were none (so the document is not Envoy config).
pub(crate) fn walk(c: &mut Collector, file: &str, doc: &Node) -> bool {
    let mut found = false;
    visit(c, file, doc, None, &mut found, 0);
    found
}

fn visit(c: &mut Collector, file: &str, n: &Node, key: Option<&str>, found: &mut bool, depth: u32) {
    if depth > 64 {
        return;
    }
    match &n.value {
        Value::Map(entries) => {
            let ty = n.get("@type").and_then(Node::as_str).unwrap_or("");
            if n.get("virtual_hosts").is_some() {
                *found = true;
                route_config(c, file, n);
            } else if is_cluster(n, ty, key) {
                *found = true;
                cluster(c, file, n);
            } else {
                for (k, v) in entries {
                    visit(c, file, v, Some(k), found, depth + 1);
                }
            }
        }
        Value::Seq(items) => {
            for item in items {
                visit(c, file, item, key, found, depth + 1);
            }
        }
        Value::Scalar { .. } => {}
    }
}

/// A cluster: typed as one, listed under `clusters`, or a bare resource with a cluster's fields.
fn is_cluster(n: &Node, ty: &str, key: Option<&str>) -> bool {
    if ty.ends_with(".Cluster") {
        return true;
    }
    let named = n.get("name").is_some();
    let shaped = ["connect_timeout", "circuit_breakers", "load_assignment"]
        .iter()
        .any(|k| n.get(k).is_some());
    named && (key == Some("clusters") || shaped)
}

fn route_config(c: &mut Collector, file: &str, rc: &Node) {
    let rc_name = rc.get("name").and_then(Node::as_str).unwrap_or("");
    for (vi, vh) in rc.get("virtual_hosts").map(Node::items).unwrap_or(&[]).iter().enumerate() {
        let vh_name =
            vh.get("name").and_then(Node::as_str).map_or_else(|| format!("[{vi}]"), str::to_string);
        let vh_retry = vh.get("retry_policy");
        let vh_hedge = vh.get("hedge_policy");
        for (ri, route) in vh.get("routes").map(Node::items).unwrap_or(&[]).iter().enumerate() {
            let Some(action) = route.get("route") else { continue }; // redirect / direct_response
            let route_name = route.get("name").and_then(Node::as_str);
            let mut resource = format!("route {vh_name}");
            match route_name {
                Some(r) => resource.push_str(&format!("/{r}")),
                None => resource.push_str(&format!(" routes[{ri}]")),
            }
            if !rc_name.is_empty() {
                resource = format!("{resource} (route_config {rc_name})");
            }
            let policy = action.get("retry_policy").or(vh_retry);
            let line = policy.map_or(route.line, |p| p.line);
            let mut layer = Layer::new(
                Format::Envoy,
                Location { file: file.to_string(), line },
                resource.clone(),
            );
            layer.refs.push(format!("virtualhost/{vh_name}"));
            if let Some(r) = route_name {
                layer.refs.push(format!("route/{r}"));
                layer.refs.push(format!("route/{vh_name}/{r}"));
            }
            let clusters: Vec<String> = match action.get("cluster").and_then(Node::as_str) {
                Some(cl) => vec![cl.to_string()],
                None => action
                    .at(&["weighted_clusters", "clusters"])
                    .map(Node::items)
                    .unwrap_or(&[])
                    .iter()
                    .filter_map(|w| w.get("name").and_then(Node::as_str).map(str::to_string))
                    .collect(),
            };
            for cl in &clusters {
                layer.refs.push(format!("cluster/{cl}"));
            }
            let settings = Settings { file, resource: &resource };
            // Envoy's route timeout defaults to 15 s; `0s` disables it.
            layer.timeout = match settings.duration(c, "timeout", action.get("timeout")) {
                Some(d) if d.is_zero() => None,
                Some(d) => Some(d),
                None => Some(std::time::Duration::from_secs(15)),
            };
            layer.methods = methods(route.get("match").unwrap_or(Node::empty()));
            if let Some(p) = policy {
                let n = settings.u32(c, "num_retries", p.get("num_retries"));
                if crate::formats::absent(p.get("num_retries")) {
                    c.finding(
                        Severity::Info,
                        Rule::DefaultRetries,
                        layer.location.clone(),
                        resource.clone(),
                        "retry_policy without num_retries: Envoy's default of 1 retry is in force",
                        "state num_retries explicitly",
                    );
                }
                let n = n.unwrap_or(1);
                layer.attempts = Some(n.saturating_add(1));
                layer.per_try_timeout =
                    settings.duration(c, "per_try_timeout", p.get("per_try_timeout"));
                layer.retry_on =
                    p.get("retry_on").and_then(Node::as_str).map(conditions).unwrap_or_default();
                layer.defaulted = false;
            }
            let hedge = action.get("hedge_policy").or(vh_hedge);
            let hedge_on_timeout = hedge.and_then(|h| h.get("hedge_on_per_try_timeout"));
            if settings.bool(c, "hedge_on_per_try_timeout", hedge_on_timeout) == Some(true)
                && layer.retries()
            {
                layer.hedging = true;
            }
            let index = c.layers.len();
            // A weighted route takes the first cluster's budget; they are usually alike.
            if let Some(cl) = clusters.first() {
                c.envoy_links.push((index, cl.clone()));
            }
            c.layers.push(layer);
        }
    }
}

fn methods(m: &Node) -> Methods {
    for h in m.get("headers").map(Node::items).unwrap_or(&[]) {
        if h.get("name").and_then(Node::as_str) != Some(":method") {
            continue;
        }
        let exact = h
            .get("exact_match")
            .or_else(|| h.at(&["string_match", "exact"]))
            .and_then(Node::as_str);
        if let Some(e) = exact {
            return Methods::Only(vec![e.to_ascii_uppercase()]);
        }
    }
    Methods::Any
}

fn cluster(c: &mut Collector, file: &str, cl: &Node) {
    let name = cl.get("name").and_then(Node::as_str).unwrap_or("(unnamed)").to_string();
    let resource = format!("cluster {name}");
    let thresholds = cl.at(&["circuit_breakers", "thresholds"]).map(Node::items).unwrap_or(&[]);
    // The DEFAULT priority's thresholds are the ones ordinary traffic meets.
    let default = thresholds.iter().find(|t| {
        t.get("priority").and_then(Node::as_str).is_none_or(|p| p.eq_ignore_ascii_case("default"))
    });
    let budget_node = default.and_then(|t| t.get("retry_budget"));
    let settings = Settings { file, resource: &resource };
    let max_retries = settings.u64(c, "max_retries", default.and_then(|t| t.get("max_retries")));
    let max_requests = settings.u64(c, "max_requests", default.and_then(|t| t.get("max_requests")));
    let budget = match budget_node {
        Some(b) => {
            let percent = settings
                .f64(c, "budget_percent.value", b.at(&["budget_percent", "value"]))
                .unwrap_or(20.0)
                / 100.0;
            let floor = settings
                .u64(c, "min_retry_concurrency", b.get("min_retry_concurrency"))
                .unwrap_or(3);
            // Read so that a value Envoy would refuse is a finding; see the module note.
            let _ = settings.duration(c, "budget_interval", b.get("budget_interval"));
            let loc = Location { file: file.to_string(), line: b.line };
            if crate::model::budget_too_high(percent) {
                c.finding(
                    Severity::Warning,
                    Rule::BudgetTooHigh,
                    loc.clone(),
                    resource.clone(),
                    format!(
                        "retry_budget budget_percent {} lets retries be up to {} of requests in flight (a factor of {})",
                        pct(percent),
                        pct(percent),
                        crate::model::trim_float(Budget::Concurrency { percent }.max_factor().unwrap_or(f64::INFINITY))
                    ),
                    "keep budget_percent at or below 50 (20 is Envoy's default)",
                );
            }
            if let Some(cap) = max_requests
                && floor > cap
            {
                c.finding(
                    Severity::Error,
                    Rule::FloorAboveHeadroom,
                    loc,
                    resource.clone(),
                    format!("min_retry_concurrency {floor} is above max_requests {cap}: the floor alone can fill the cap"),
                    format!("set min_retry_concurrency at most max_requests − planned primaries (≤ {cap})"),
                );
            }
            Some(Budget::Concurrency { percent })
        }
        None => {
            let fixed =
                max_retries.map_or(String::new(), |m| format!(" (only the fixed max_retries {m})"));
            c.finding(
                Severity::Warning,
                Rule::ClusterWithoutRetryBudget,
                Location { file: file.to_string(), line: cl.get("name").map_or(cl.line, |n| n.line) },
                resource,
                format!("cluster has no retry_budget{fixed}: retries to it are bounded by no ratio"),
                "add circuit_breakers.thresholds[].retry_budget { budget_percent: { value: 20 }, min_retry_concurrency: 3 }",
            );
            max_retries.map(Budget::Slots)
        }
    };
    c.envoy_clusters.insert(name, ClusterInfo { budget });
}
