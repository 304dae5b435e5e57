//! Linkerd: ServiceProfile retries and the `retry.linkerd.io/*` annotations.
//!
//! **Attempt semantics.** A ServiceProfile route with `isRetryable: true` is retried (on 5xx)
//! with **no count limit**: only the profile's `retryBudget` (default `retryRatio: 0.2`,
//! `minRetriesPerSecond: 10`, `ttl: 10s`) and the route `timeout` (default 10 s) stop it, so the
//! factor is `1 + retryRatio`. The annotations (`retry.linkerd.io/http`, `retry.linkerd.io/grpc`
//! on a Service, HTTPRoute or GRPCRoute) retry up to `retry.linkerd.io/limit` times (default
//! **1**), each try bounded by `retry.linkerd.io/timeout`, and have **no budget** (Linkerd 2.16's
//! annotation model has none), so every annotation layer that retries is an
//! `unbudgeted-retries` warning. A ServiceProfile for the same Service replaces the annotations
//! in Linkerd; the audit does not pair the two.

use crate::Collector;
use crate::formats::{Settings, conditions};
use crate::model::{Budget, Format, Layer, Location, Methods, Rule, Severity, pct};
use crate::node::Node;

/// ServiceProfile's default retry ratio.
pub const DEFAULT_RETRY_RATIO: f64 = 0.2;

pub(crate) fn service_profile(c: &mut Collector, file: &str, doc: &Node) {
    let name =
        doc.at(&["metadata", "name"]).and_then(Node::as_str).unwrap_or("(unnamed)").to_string();
    let short = name.split('.').next().unwrap_or(&name).to_string();
    let spec = doc.get("spec").unwrap_or(Node::empty());
    let budget_node = spec.get("retryBudget");
    let profile = format!("ServiceProfile {name}");
    let ratio = Settings { file, resource: &profile }
        .f64(c, "retryRatio", budget_node.and_then(|b| b.get("retryRatio")))
        .unwrap_or(DEFAULT_RETRY_RATIO);
    if crate::model::budget_too_high(ratio) {
        let line = budget_node.map_or(doc.line, |b| b.line);
        c.finding(
            Severity::Warning,
            Rule::BudgetTooHigh,
            Location { file: file.to_string(), line },
            format!("ServiceProfile {name}"),
            format!(
                "retryRatio {} lets retries add {} to the load on a failing service",
                ratio,
                pct(ratio)
            ),
            "keep retryRatio at or below 0.5 (0.2 is Linkerd's default)",
        );
    }
    for (i, route) in spec.get("routes").map(Node::items).unwrap_or(&[]).iter().enumerate() {
        let route_name = route
            .get("name")
            .and_then(Node::as_str)
            .map_or_else(|| format!("routes[{i}]"), str::to_string);
        let resource = format!("ServiceProfile {name} route {route_name}");
        let retryable = route.get("isRetryable");
        let line = retryable.map_or(route.line, |r| r.line);
        let settings = Settings { file, resource: &resource };
        let timeout = settings.duration(c, "timeout", route.get("timeout"));
        let retryable = settings.bool(c, "isRetryable", retryable);
        let mut layer =
            Layer::new(Format::Linkerd, Location { file: file.to_string(), line }, resource);
        layer.refs.push(format!("serviceprofile/{name}"));
        layer.refs.push(format!("serviceprofile/{short}"));
        layer.refs.push(format!("serviceprofile/{short}/{route_name}"));
        layer.timeout = Some(timeout.unwrap_or(std::time::Duration::from_secs(10)));
        if let Some(m) = route.at(&["condition", "method"]).and_then(Node::as_str) {
            layer.methods = Methods::Only(vec![m.to_ascii_uppercase()]);
        }
        if retryable == Some(true) {
            layer.attempts = None;
            layer.budget = Some(Budget::Ratio { percent: ratio });
            layer.retry_on = vec!["5xx".into()];
        }
        c.layers.push(layer);
    }
}

/// Reads `retry.linkerd.io/*` annotations on any object; `false` when it has none.
pub(crate) fn annotations(c: &mut Collector, file: &str, doc: &Node) -> bool {
    let Some(ann) = doc.at(&["metadata", "annotations"]) else { return false };
    let http = ann.get("retry.linkerd.io/http");
    let grpc = ann.get("retry.linkerd.io/grpc");
    let limit = ann.get("retry.linkerd.io/limit");
    if http.is_none() && grpc.is_none() && limit.is_none() {
        return false;
    }
    let kind = doc.get("kind").and_then(Node::as_str).unwrap_or("object");
    let name = doc.at(&["metadata", "name"]).and_then(Node::as_str).unwrap_or("(unnamed)");
    let line = http.or(grpc).or(limit).map_or(ann.line, |n| n.line);
    let resource = format!("{kind} {name} (retry.linkerd.io)");
    let settings = Settings { file, resource: &resource };
    let n = settings.u64(c, "retry.linkerd.io/limit", limit).unwrap_or(1);
    let per_try_timeout =
        settings.duration(c, "retry.linkerd.io/timeout", ann.get("retry.linkerd.io/timeout"));
    let timeout =
        settings.duration(c, "timeout.linkerd.io/request", ann.get("timeout.linkerd.io/request"));
    let mut layer =
        Layer::new(Format::Linkerd, Location { file: file.to_string(), line }, resource);
    layer.refs.push(format!("linkerd/{name}"));
    layer.refs.push(format!("{}/{name}", kind.to_ascii_lowercase()));
    layer.attempts = Some(u32::try_from(n).unwrap_or(u32::MAX).saturating_add(1));
    layer.per_try_timeout = per_try_timeout;
    layer.timeout = timeout;
    for cond in [http, grpc].into_iter().flatten() {
        layer.retry_on.extend(cond.as_str().map(conditions).unwrap_or_default());
    }
    c.layers.push(layer);
    true
}
