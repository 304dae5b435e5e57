//! gRPC service config (JSON, gRFC A6).
//!
//! **Attempt semantics.** `retryPolicy.maxAttempts` *includes the first attempt* (`2` = one
//! retry), and gRPC clients cap it at **5**: larger values are silently lowered, so we count 5
//! and say so. A value below 2 makes the policy invalid, and we count 1. `hedgingPolicy.maxAttempts`
//! is the same count, capped the same way, but hedged attempts are sent without waiting for a
//! failure. A method config's `timeout` covers all attempts; gRPC has no per-try timeout.
//! `retryThrottling { maxTokens, tokenRatio }` is a token bucket shared by the channel: each
//! failure costs a token, each success earns `tokenRatio`, retries stop below half — so it
//! bounds the factor at about `1 + tokenRatio`.

use crate::Collector;
use crate::formats::Settings;
use crate::model::{Budget, Format, Layer, Location, Rule, Severity};
use crate::node::Node;

/// gRPC clients lower any `maxAttempts` above this to it.
pub const MAX_ATTEMPTS_CAP: u64 = 5;

pub(crate) fn service_config(c: &mut Collector, file: &str, doc: &Node) {
    let throttle = doc.get("retryThrottling").map(|t| Budget::TokenBucket {
        token_ratio: Settings { file, resource: "retryThrottling" }
            .f64(c, "tokenRatio", t.get("tokenRatio"))
            .unwrap_or(0.0),
    });
    for mc in doc.get("methodConfig").map(Node::items).unwrap_or(&[]) {
        let names: Vec<(String, String)> = mc
            .get("name")
            .map(Node::items)
            .unwrap_or(&[])
            .iter()
            .map(|n| {
                let s = n.get("service").and_then(Node::as_str).unwrap_or("").to_string();
                let m = n.get("method").and_then(Node::as_str).unwrap_or("").to_string();
                (s, m)
            })
            .collect();
        let shown: Vec<String> = names
            .iter()
            .map(|(s, m)| match (s.is_empty(), m.is_empty()) {
                (true, _) => "*".to_string(),
                (false, true) => format!("{s}/*"),
                (false, false) => format!("{s}/{m}"),
            })
            .collect();
        let resource =
            format!("method {}", if shown.is_empty() { "*".into() } else { shown.join(", ") });
        let (policy, hedging) = match (mc.get("retryPolicy"), mc.get("hedgingPolicy")) {
            (Some(p), _) => (Some(p), false),
            (None, Some(h)) => (Some(h), true),
            (None, None) => (None, false),
        };
        let line = policy.map_or(mc.line, |p| p.line);
        let mut layer =
            Layer::new(Format::Grpc, Location { file: file.to_string(), line }, resource.clone());
        for (s, m) in &names {
            let s = if s.is_empty() { "*" } else { s };
            layer.refs.push(format!("grpc/{s}"));
            if !m.is_empty() {
                layer.refs.push(format!("grpc/{s}/{m}"));
            }
        }
        let settings = Settings { file, resource: &resource };
        layer.timeout = settings.duration(c, "timeout", mc.get("timeout"));
        // Every gRPC call is a POST; whether it is idempotent is not in the config.
        if let Some(p) = policy {
            let max = settings.u64(c, "maxAttempts", p.get("maxAttempts")).unwrap_or(0);
            let attempts = if max < 2 { 1 } else { max.min(MAX_ATTEMPTS_CAP) };
            if max > MAX_ATTEMPTS_CAP {
                c.finding(
                    Severity::Info,
                    Rule::ValueCapped,
                    Location { file: file.to_string(), line: p.get("maxAttempts").map_or(p.line, |n| n.line) },
                    resource.clone(),
                    format!("maxAttempts {max} is lowered to {MAX_ATTEMPTS_CAP} by gRPC clients"),
                    format!("write maxAttempts: {MAX_ATTEMPTS_CAP} (or less) so the config says what runs"),
                );
            }
            layer.attempts = Some(attempts as u32);
            layer.hedging = hedging && attempts > 1;
            let codes = if hedging { "nonFatalStatusCodes" } else { "retryableStatusCodes" };
            layer.retry_on = p
                .get(codes)
                .map(Node::items)
                .unwrap_or(&[])
                .iter()
                .filter_map(|n| n.as_str().map(|s| s.to_ascii_lowercase().replace('_', "-")))
                .collect();
            layer.budget = throttle;
        }
        c.layers.push(layer);
    }
}
