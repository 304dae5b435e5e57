//! Kuma (Kong Mesh): `MeshRetry`, and the `maxRetries` of a `MeshCircuitBreaker`, as Kubernetes
//! resources (`kuma.io/v1alpha1`) or in Universal form (`type: MeshRetry`, `name`, `spec`).
//!
//! **Attempt semantics.** `spec.to[].default.http.numRetries` (and `grpc.numRetries`) counts
//! *retries* and defaults to **1** when the `http` (or `grpc`) block is there without it: up to
//! `numRetries + 1` tries. `perTryTimeout` is the per-try timeout (`0` turns it off); the
//! overall timeout lives in MeshTimeout, which is not read. `retryOn` is a list in Kuma's
//! words (`5xx`, `GatewayError`, `Reset`, a status code, ...), turned into Envoy's
//! (`gateway-error`, `reset`). `backOff` (`baseInterval`, `maxInterval`) and
//! `rateLimitedBackOff.maxInterval` are read and checked only: waiting changes no count.
//! `tcp.maxConnectAttempt` retries connecting, not requests, and is not counted.
//!
//! **Budgets.** MeshRetry has none. A `MeshCircuitBreaker`'s
//! `spec.to[].default.connectionLimits.maxRetries` is Envoy's `max_retries` breaker: a throttle
//! on retries in flight that caps no factor (as Istio's `maxRetries`). It applies to a MeshRetry
//! `to[]` entry with the same `targetRef` (`kind` and `name`, or the `kuma.io/display-name`
//! label), or to every entry when its own `targetRef` is `kind: Mesh`.

use crate::Collector;
use crate::formats::Settings;
use crate::model::{Format, Layer, Location};
use crate::node::Node;

/// A `targetRef` as a key: `Mesh`, or `KIND/NAME`.
fn target(t: Option<&Node>) -> String {
    let Some(t) = t else { return "Mesh".into() };
    let kind = t.get("kind").and_then(Node::as_str).unwrap_or("Mesh");
    if kind == "Mesh" {
        return kind.into();
    }
    let name = t
        .get("name")
        .or_else(|| t.at(&["labels", "kuma.io/display-name"]))
        .and_then(Node::as_str)
        .unwrap_or("*");
    format!("{kind}/{name}")
}

/// The policy's name (Kubernetes `metadata.name` or Universal `name`).
fn name_of(doc: &Node) -> &str {
    doc.at(&["metadata", "name"])
        .or_else(|| doc.get("name"))
        .and_then(Node::as_str)
        .unwrap_or("(unnamed)")
}

/// Kuma's `retryOn` words in Envoy's spelling, so the shared checks can read them.
fn condition(word: &str) -> String {
    let envoy = match word.to_ascii_lowercase().as_str() {
        "gatewayerror" => "gateway-error",
        "retriable4xx" => "retriable-4xx",
        "connectfailure" => "connect-failure",
        "envoyratelimited" => "envoy-ratelimited",
        "refusedstream" => "refused-stream",
        "http3postconnectfailure" => "http3-post-connect-failure",
        "deadlineexceeded" => "deadline-exceeded",
        "resourceexhausted" => "resource-exhausted",
        other => return other.to_string(),
    };
    envoy.to_string()
}

/// Reads one MeshRetry: a layer per `to[]` entry and protocol block (`http`, `grpc`).
pub(crate) fn mesh_retry(c: &mut Collector, file: &str, doc: &Node) {
    let name = name_of(doc).to_string();
    let spec = doc.get("spec").unwrap_or(Node::empty());
    for (i, to) in spec.get("to").map(Node::items).unwrap_or(&[]).iter().enumerate() {
        let dest = target(to.get("targetRef"));
        for proto in ["http", "grpc"] {
            let Some(block) =
                to.at(&["default", proto]).filter(|b| !crate::formats::absent(Some(b)))
            else {
                continue;
            };
            let resource = format!("MeshRetry {name} to[{i}] {proto} ({dest})");
            let mut layer = Layer::new(
                Format::Kuma,
                Location { file: file.to_string(), line: block.line },
                resource.clone(),
            );
            layer.refs.push(format!("meshretry/{name}"));
            layer.refs.push(format!("kuma/{dest}"));
            let settings = Settings { file, resource: &resource };
            let n = settings.u64(c, "numRetries", block.get("numRetries")).unwrap_or(1);
            layer.attempts = Some(u32::try_from(n).unwrap_or(u32::MAX).saturating_add(1));
            layer.per_try_timeout = settings
                .duration(c, "perTryTimeout", block.get("perTryTimeout"))
                .filter(|d| !d.is_zero());
            let backoff = block.get("backOff").unwrap_or(Node::empty());
            let _ = settings.duration(c, "backOff.baseInterval", backoff.get("baseInterval"));
            let _ = settings.duration(c, "backOff.maxInterval", backoff.get("maxInterval"));
            let limited = block.get("rateLimitedBackOff").unwrap_or(Node::empty());
            let _ =
                settings.duration(c, "rateLimitedBackOff.maxInterval", limited.get("maxInterval"));
            layer.retry_on = block
                .get("retryOn")
                .map(Node::items)
                .unwrap_or(&[])
                .iter()
                .filter_map(|n| n.as_str().map(condition))
                .collect();
            c.kuma_links.push((c.layers.len(), dest.clone()));
            c.layers.push(layer);
        }
    }
}

/// Reads one MeshCircuitBreaker's `connectionLimits.maxRetries` per `to[]` entry.
pub(crate) fn mesh_circuit_breaker(c: &mut Collector, file: &str, doc: &Node) {
    let resource = format!("MeshCircuitBreaker {}", name_of(doc));
    let spec = doc.get("spec").unwrap_or(Node::empty());
    for to in spec.get("to").map(Node::items).unwrap_or(&[]) {
        let limits = to.at(&["default", "connectionLimits"]).unwrap_or(Node::empty());
        let max = Settings { file, resource: &resource }.u64(
            c,
            "connectionLimits.maxRetries",
            limits.get("maxRetries"),
        );
        if let Some(max) = max {
            c.kuma_throttles.push((target(to.get("targetRef")), max));
        }
    }
}
