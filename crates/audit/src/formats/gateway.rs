//! Gateway API: `HTTPRoute` retries (`gateway.networking.k8s.io`) and the experimental
//! `XBackendTrafficPolicy` retry budget (GEP-3388, `gateway.networking.x-k8s.io/v1alpha1`;
//! `BackendTrafficPolicy` before Gateway API 1.3 renamed the experimental kinds).
//!
//! **Attempt semantics.** `rules[].retry.attempts` counts *retries* (`2` → 3 tries). A `retry`
//! without `attempts` leaves the count to the implementation, so the audit cannot bound it: it
//! counts no limit and says so (`default-retries`). A rule without `retry` does not retry here.
//! `rules[].timeouts.backendRequest` is the per-try timeout and `rules[].timeouts.request` the
//! overall one; `retry.codes` are the conditions; `retry.backoff` is read and checked only.
//!
//! **Budgets.** A policy's `spec.retryConstraint` bounds retries to the Services named in its
//! `targetRefs`: `budget.percent` (0–100, default 20) of the requests started within
//! `budget.interval` (default 10 s) may be retries, with a floor of `minRetryRate` (`count` per
//! `interval`, default 10 per 1 s). Retries count among the requests, so like Envoy's
//! `retry_budget` (which implementations translate it into) the factor cap is `1 + p/(1 − p)`.
//! The windows are read and checked, and change no factor: the layer model keeps none. A rule
//! takes the budget of the first of its `backendRefs` that a policy targets, in the route's
//! namespace unless the ref names another.

use crate::Collector;
use crate::formats::Settings;
use crate::model::{Budget, Format, Layer, Location, Methods, Rule, Severity, pct, trim_float};
use crate::node::Node;

/// A backend as refs name it: namespace (when known), kind and name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Backend {
    /// The namespace, when the document states it.
    pub namespace: Option<String>,
    /// `Service` unless the ref says otherwise.
    pub kind: String,
    /// The object's name.
    pub name: String,
}

impl Backend {
    /// The same object: kinds and names equal, namespaces equal where both are known.
    pub fn same(&self, other: &Backend) -> bool {
        let ns = match (&self.namespace, &other.namespace) {
            (Some(a), Some(b)) => a == b,
            _ => true,
        };
        ns && self.kind == other.kind && self.name == other.name
    }
}

fn meta(doc: &Node) -> (String, Option<String>) {
    let m = doc.get("metadata").unwrap_or(Node::empty());
    let name = m.get("name").and_then(Node::as_str).unwrap_or("(unnamed)").to_string();
    (name, m.get("namespace").and_then(Node::as_str).map(str::to_string))
}

/// Reads one HTTPRoute: one layer per rule.
pub(crate) fn http_route(c: &mut Collector, file: &str, doc: &Node) {
    let (name, ns) = meta(doc);
    let spec = doc.get("spec").unwrap_or(Node::empty());
    for (i, rule) in spec.get("rules").map(Node::items).unwrap_or(&[]).iter().enumerate() {
        let rule_name = rule.get("name").and_then(Node::as_str);
        let resource = match rule_name {
            Some(r) => format!("HTTPRoute {name} rules[{i}] ({r})"),
            None => format!("HTTPRoute {name} rules[{i}]"),
        };
        let retry = rule.get("retry").filter(|r| !crate::formats::absent(Some(r)));
        let line = retry.map_or(rule.line, |r| r.line);
        let mut layer = Layer::new(
            Format::GatewayApi,
            Location { file: file.to_string(), line },
            resource.clone(),
        );
        layer.refs.push(format!("httproute/{name}"));
        if let Some(r) = rule_name {
            layer.refs.push(format!("httproute/{name}/{r}"));
        }
        let settings = Settings { file, resource: &resource };
        let timeouts = rule.get("timeouts").unwrap_or(Node::empty());
        layer.timeout = settings.duration(c, "timeouts.request", timeouts.get("request"));
        layer.per_try_timeout =
            settings.duration(c, "timeouts.backendRequest", timeouts.get("backendRequest"));
        layer.methods = methods(rule);
        if let Some(r) = retry {
            let attempts = settings.u64(c, "retry.attempts", r.get("attempts"));
            let _ = settings.duration(c, "retry.backoff", r.get("backoff"));
            layer.retry_on = r
                .get("codes")
                .map(Node::items)
                .unwrap_or(&[])
                .iter()
                .filter_map(|n| n.as_str().map(str::to_string))
                .collect();
            layer.attempts = match attempts {
                Some(n) => Some(u32::try_from(n).unwrap_or(u32::MAX).saturating_add(1)),
                None => {
                    if crate::formats::absent(r.get("attempts")) {
                        c.finding(
                            Severity::Warning,
                            Rule::DefaultRetries,
                            layer.location.clone(),
                            resource.clone(),
                            "retry without attempts: the implementation picks how many retries, so this audit counts no limit",
                            "state retry.attempts",
                        );
                    }
                    None
                }
            };
            layer.defaulted = attempts.is_none();
        }
        let index = c.layers.len();
        for b in rule.get("backendRefs").map(Node::items).unwrap_or(&[]) {
            let Some(backend) = backend_ref(b, &ns) else { continue };
            layer.refs.push(format!("backend/{}", backend.name));
            c.gateway_links.push((index, backend));
        }
        c.layers.push(layer);
    }
}

fn backend_ref(b: &Node, route_ns: &Option<String>) -> Option<Backend> {
    let name = b.get("name").and_then(Node::as_str)?.to_string();
    let kind = b.get("kind").and_then(Node::as_str).unwrap_or("Service").to_string();
    let namespace = b.get("namespace").and_then(Node::as_str).map(str::to_string);
    Some(Backend { namespace: namespace.or_else(|| route_ns.clone()), kind, name })
}

/// `Only` when every match names a method; one match without one serves them all.
fn methods(rule: &Node) -> Methods {
    let mut out = Vec::new();
    for m in rule.get("matches").map(Node::items).unwrap_or(&[]) {
        match m.get("method").and_then(Node::as_str) {
            Some(method) => out.push(method.to_ascii_uppercase()),
            None => return Methods::Any,
        }
    }
    if out.is_empty() { Methods::Any } else { Methods::Only(out) }
}

/// Reads one XBackendTrafficPolicy's retry budget.
pub(crate) fn backend_traffic_policy(c: &mut Collector, file: &str, doc: &Node) {
    let (name, ns) = meta(doc);
    let kind = doc.get("kind").and_then(Node::as_str).unwrap_or("XBackendTrafficPolicy");
    let resource = format!("{kind} {name}");
    let spec = doc.get("spec").unwrap_or(Node::empty());
    let Some(rc) = spec.get("retryConstraint").filter(|n| !crate::formats::absent(Some(n))) else {
        return;
    };
    let settings = Settings { file, resource: &resource };
    let budget = rc.get("budget").unwrap_or(Node::empty());
    let percent = settings.f64(c, "budget.percent", budget.get("percent")).unwrap_or(20.0) / 100.0;
    // Windows and floor: read so a value the API server would refuse is a finding (see above).
    let _ = settings.duration(c, "budget.interval", budget.get("interval"));
    let rate = rc.get("minRetryRate").unwrap_or(Node::empty());
    let _ = settings.u64(c, "minRetryRate.count", rate.get("count"));
    let _ = settings.duration(c, "minRetryRate.interval", rate.get("interval"));
    if crate::model::budget_too_high(percent) {
        let line = budget.get("percent").map_or(rc.line, |n| n.line);
        let factor = Budget::Concurrency { percent }.max_factor().unwrap_or(f64::INFINITY);
        c.finding(
            Severity::Warning,
            Rule::BudgetTooHigh,
            Location { file: file.to_string(), line },
            resource.clone(),
            format!(
                "retryConstraint budget.percent {} lets retries be up to {} of requests (a factor of {})",
                pct(percent),
                pct(percent),
                trim_float(factor)
            ),
            "keep budget.percent at or below 50 (20 is the default)",
        );
    }
    for t in spec.get("targetRefs").map(Node::items).unwrap_or(&[]) {
        let Some(target) = t.get("name").and_then(Node::as_str) else { continue };
        let kind = t.get("kind").and_then(Node::as_str).unwrap_or("Service").to_string();
        // A local reference: the target is in the policy's namespace.
        let backend = Backend { namespace: ns.clone(), kind, name: target.to_string() };
        c.gateway_policies.push((backend, Budget::Concurrency { percent }));
    }
}
