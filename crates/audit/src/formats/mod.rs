//! One module per config language; each turns documents into [`crate::Layer`]s and the
//! findings only it can see.

use std::time::Duration;

use crate::Collector;
use crate::model::{Location, Rule, Severity};
use crate::node::{Node, Value};

pub mod envoy;
pub mod gateway;
pub mod grpc;
pub mod istio;
pub mod kuma;
pub mod linkerd;
pub mod stormguard;

/// Whether a setting is absent: not there, or `null` / `~`.
pub(crate) fn absent(node: Option<&Node>) -> bool {
    node.is_none_or(|n| matches!(n.value, Value::Scalar { .. }) && n.as_str().is_none())
}

/// A duration as configs write it: `"2s"`, `"0.25s"`, `"300ms"`, `"1m"`, or protobuf JSON's
/// `{seconds, nanos}`; `None` when it is not one (`{seconds: soon}` included).
pub(crate) fn duration(node: &Node) -> Option<Duration> {
    if let Some(secs) = node.get("seconds") {
        let s = secs.as_u64()?;
        let n = match node.get("nanos") {
            Some(n) => n.as_u64()?,
            None => 0,
        };
        return Some(Duration::from_secs(s) + Duration::from_nanos(n));
    }
    let text = node.as_str()?.trim();
    stormguard_core::decimal::parse_duration(text).ok()
}

/// Reads the retry settings of one resource, and makes a finding of each value that is there
/// but cannot be read (`attempts: "five"`, `perTryTimeout: soon`, `isRetryable: maybe`): the
/// mesh would refuse or misread it, and the audit cannot count what the layer does, so it is
/// an error — never a silent default. An absent value, or `null`, is absent.
pub(crate) struct Settings<'a> {
    pub file: &'a str,
    pub resource: &'a str,
}

impl Settings<'_> {
    /// A whole number ≥ 0 (`3`, `"3"`, `3.0`).
    pub fn u64(&self, c: &mut Collector, key: &str, node: Option<&Node>) -> Option<u64> {
        self.read(c, key, node, Node::as_u64, "a whole number", "2")
    }

    /// A whole number that fits 32 bits (protobuf's `uint32`, as Envoy's `num_retries`): a
    /// larger one is refused by the runtime, not read as its maximum.
    pub fn u32(&self, c: &mut Collector, key: &str, node: Option<&Node>) -> Option<u32> {
        let parse = |n: &Node| n.as_u64().and_then(|v| u32::try_from(v).ok());
        self.read(c, key, node, parse, "a whole number from 0 to 4294967295", "2")
    }

    /// A number.
    pub fn f64(&self, c: &mut Collector, key: &str, node: Option<&Node>) -> Option<f64> {
        self.read(c, key, node, Node::as_f64, "a number", "0.2")
    }

    /// `true` or `false`.
    pub fn bool(&self, c: &mut Collector, key: &str, node: Option<&Node>) -> Option<bool> {
        self.read(c, key, node, Node::as_bool, "true or false", "true")
    }

    /// A duration (`2s`, `250ms`, or `{seconds, nanos}`).
    pub fn duration(&self, c: &mut Collector, key: &str, node: Option<&Node>) -> Option<Duration> {
        self.read(c, key, node, duration, "a duration", "2s")
    }

    fn read<T>(
        &self,
        c: &mut Collector,
        key: &str,
        node: Option<&Node>,
        parse: impl Fn(&Node) -> Option<T>,
        what: &str,
        example: &str,
    ) -> Option<T> {
        if absent(node) {
            return None;
        }
        let node = node?;
        let value = parse(node);
        if value.is_none() {
            let shown = match &node.value {
                Value::Scalar { text, quoted: true } => format!("{text:?}"),
                Value::Scalar { text, .. } => text.clone(),
                Value::Seq(_) => "a list".into(),
                Value::Map(_) => "a map".into(),
            };
            c.finding(
                Severity::Error,
                Rule::UnreadableValue,
                Location { file: self.file.to_string(), line: node.line },
                self.resource,
                format!(
                    "`{key}: {shown}` is not {what}: the runtime refuses or misreads it, and this \
                     audit reads the setting as if it were absent"
                ),
                format!("write {what}, e.g. `{key}: {example}`"),
            );
        }
        value
    }
}

/// Comma-separated conditions, trimmed and lower-cased.
pub(crate) fn conditions(text: &str) -> Vec<String> {
    text.split(',').map(|s| s.trim().to_ascii_lowercase()).filter(|s| !s.is_empty()).collect()
}
