//! One module per config language; each turns documents into [`crate::Layer`]s and the
//! findings only it can see.

use std::time::Duration;

use crate::node::Node;

pub mod envoy;
pub mod grpc;
pub mod istio;
pub mod linkerd;
pub mod stormguard;

/// A duration as configs write it: `"2s"`, `"0.25s"`, `"300ms"`, `"1m"`, or protobuf JSON's
/// `{seconds, nanos}`.
pub(crate) fn duration(node: &Node) -> Option<Duration> {
    if let Some(secs) = node.get("seconds") {
        let s = secs.as_u64().unwrap_or(0);
        let n = node.get("nanos").and_then(Node::as_u64).unwrap_or(0);
        return Some(Duration::from_secs(s) + Duration::from_nanos(n));
    }
    let text = node.as_str()?.trim();
    stormguard_core::decimal::parse_duration(text).ok()
}

/// Comma-separated conditions, trimmed and lower-cased.
pub(crate) fn conditions(text: &str) -> Vec<String> {
    text.split(',').map(|s| s.trim().to_ascii_lowercase()).filter(|s| !s.is_empty()).collect()
}
