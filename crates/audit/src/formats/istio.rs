//! Istio VirtualService and DestinationRule.
//!
//! **Attempt semantics.** `http[].retries.attempts` counts *retries*: `attempts: 2` means up to
//! 3 tries. `attempts: 0` turns retries off, and so does a `retries` block without `attempts`
//! (the field defaults to 0, which Istio reads as disabled). When `retries` is **absent**, Istio
//! applies its default policy, which depends on the release ([`IstioVersion`],
//! [`ISTIO_DEFAULT_RETRIES`]). `retries.perTryTimeout` is the per-try timeout and
//! `http[].timeout` the route timeout (none by default).
//!
//! A DestinationRule's `trafficPolicy.connectionPool.http.maxRetries` is Envoy's `max_retries`
//! circuit breaker: a cap on retries in flight to the host. It is a throttle (it stops the
//! "no budget" finding) but not a ratio, so it caps no amplification factor.
//!
//! `trafficPolicy.retryBudget` (Istio 1.27 and later; `budgetInterval` from 1.31) is Envoy's
//! `retry_budget`, and replaces the `maxRetries` breaker as Envoy does: retries at most `percent`
//! (0–100, default 20) of requests, with a floor of `minRetryConcurrency` (default 3) concurrent
//! retries. `budgetInterval` (default none: only requests in flight count) widens what is
//! counted to the requests started within it; the steady-state cap stays `1 + p/(1 − p)`, so it
//! is read and checked but changes no factor (see the Envoy module). A floor above
//! `connectionPool.http.http2MaxRequests` (Envoy's `max_requests`) can fill the cap by itself.
//! Subset and port-level traffic policies are not read.

use std::fmt;

use crate::Collector;
use crate::formats::{Settings, conditions};
use crate::model::{Budget, Format, Layer, Location, Methods, Rule, Severity, pct, trim_float};
use crate::node::Node;

/// An Istio release, `major.minor`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct IstioVersion {
    /// Major.
    pub major: u32,
    /// Minor.
    pub minor: u32,
}

impl IstioVersion {
    /// What `--istio-version` defaults to: the newest release the default table knows.
    pub const CURRENT: IstioVersion = IstioVersion { major: 1, minor: 28 };
}

impl Default for IstioVersion {
    fn default() -> Self {
        IstioVersion::CURRENT
    }
}

impl fmt::Display for IstioVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}", self.major, self.minor)
    }
}

/// Text that is not an [`IstioVersion`]; carries the text as given.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("`{0}` is not an Istio version like 1.22")]
pub struct BadIstioVersion(pub String);

impl std::str::FromStr for IstioVersion {
    type Err = BadIstioVersion;
    /// `1.22`, `1.22.3`, `v1.22` or `current`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let t = s.trim().trim_start_matches('v');
        if t == "current" {
            return Ok(IstioVersion::CURRENT);
        }
        let mut parts = t.split('.');
        let bad = || BadIstioVersion(s.to_string());
        let major = parts.next().and_then(|p| p.parse().ok()).ok_or_else(bad)?;
        let minor = parts.next().map_or(Some(0), |p| p.parse().ok()).ok_or_else(bad)?;
        Ok(IstioVersion { major, minor })
    }
}

/// The retry policy Istio applies to an HTTP route that has no `retries` field:
/// `(first release, retries, retryOn)`, newest last; the last row at or below the version wins.
///
/// Source: the Istio documentation as we know it (the VirtualService `HTTPRetry` reference and
/// the traffic-management concepts page): since 1.1, a route without `retries` gets 2 retries on
/// `connect-failure,refused-stream,unavailable,cancelled,retriable-status-codes` (503); 1.0
/// applied none. Pick older behaviour with `--istio-version`.
pub const ISTIO_DEFAULT_RETRIES: &[(IstioVersion, u32, &str)] = &[
    (IstioVersion { major: 1, minor: 0 }, 0, ""),
    (
        IstioVersion { major: 1, minor: 1 },
        2,
        "connect-failure,refused-stream,unavailable,cancelled,retriable-status-codes",
    ),
];

/// The default retries and conditions for a release.
pub fn default_retries(version: IstioVersion) -> (u32, &'static str) {
    ISTIO_DEFAULT_RETRIES
        .iter()
        .rev()
        .find(|(from, _, _)| *from <= version)
        .map_or((0, ""), |(_, n, on)| (*n, *on))
}

/// Whether two Istio hosts name the same service (`reviews`, `reviews.default`,
/// `reviews.default.svc.cluster.local`).
pub fn same_host(a: &str, b: &str) -> bool {
    if a == b {
        return true;
    }
    let same_name = a.split('.').next() == b.split('.').next();
    same_name && (a.contains('.') != b.contains('.') || a.starts_with(b) || b.starts_with(a))
}

fn name_of(doc: &Node) -> (String, Option<String>) {
    let meta = doc.get("metadata").unwrap_or(Node::empty());
    let name = meta.get("name").and_then(Node::as_str).unwrap_or("(unnamed)").to_string();
    let ns = meta.get("namespace").and_then(Node::as_str).map(str::to_string);
    (name, ns)
}

/// Reads one VirtualService: one layer per `http` route.
pub(crate) fn virtual_service(c: &mut Collector, file: &str, doc: &Node) {
    let (name, ns) = name_of(doc);
    let full = match &ns {
        Some(ns) => format!("{name}.{ns}"),
        None => name.clone(),
    };
    let spec = doc.get("spec").unwrap_or(Node::empty());
    for (i, route) in spec.get("http").map(Node::items).unwrap_or(&[]).iter().enumerate() {
        let route_name = route.get("name").and_then(Node::as_str);
        let resource = match route_name {
            Some(r) => format!("VirtualService {full} http[{i}] ({r})"),
            None => format!("VirtualService {full} http[{i}]"),
        };
        let retries = route.get("retries");
        let line = retries.map_or(route.line, |r| r.line);
        let mut layer =
            Layer::new(Format::Istio, Location { file: file.to_string(), line }, resource.clone());
        layer.refs.push(format!("virtualservice/{name}"));
        layer.refs.push(format!("virtualservice/{full}"));
        if let Some(r) = route_name {
            layer.refs.push(format!("virtualservice/{name}/{r}"));
        }
        let settings = Settings { file, resource: &resource };
        layer.timeout = settings.duration(c, "timeout", route.get("timeout"));
        layer.methods = methods(route);
        match retries {
            Some(r) => {
                let n = settings.u64(c, "attempts", r.get("attempts")).unwrap_or(0);
                layer.attempts = Some(u32::try_from(n).unwrap_or(u32::MAX).saturating_add(1));
                layer.per_try_timeout =
                    settings.duration(c, "perTryTimeout", r.get("perTryTimeout"));
                let on = r.get("retryOn").and_then(Node::as_str);
                let (_, default_on) = default_retries(c.istio_version);
                layer.retry_on = conditions(on.unwrap_or(default_on));
            }
            None => {
                let (n, on) = default_retries(c.istio_version);
                layer.attempts = Some(n + 1);
                layer.retry_on = conditions(on);
                layer.defaulted = n > 0;
                if n > 0 {
                    c.finding(
                        Severity::Warning,
                        Rule::DefaultRetries,
                        layer.location.clone(),
                        resource.clone(),
                        format!(
                            "no `retries`: Istio {} retries {n} times on {on} by default",
                            c.istio_version
                        ),
                        "state the policy: `retries: {attempts: 0}` to turn them off, or set attempts, perTryTimeout and retryOn",
                    );
                }
            }
        }
        let before = c.layers.len();
        for dest in route.get("route").map(Node::items).unwrap_or(&[]) {
            if let Some(host) = dest.at(&["destination", "host"]).and_then(Node::as_str) {
                c.istio_links.push((before, host.to_string()));
                layer.refs.push(format!("host/{host}"));
            }
        }
        c.layers.push(layer);
    }
}

fn methods(route: &Node) -> Methods {
    let mut out = Vec::new();
    for m in route.get("match").map(Node::items).unwrap_or(&[]) {
        match m.get("method") {
            Some(method) => match method.get("exact").and_then(Node::as_str) {
                Some(exact) => out.push(exact.to_ascii_uppercase()),
                // prefix/regex: could be anything.
                None => return Methods::Any,
            },
            // One match block without a method makes the route serve every method.
            None => return Methods::Any,
        }
    }
    if out.is_empty() { Methods::Any } else { Methods::Only(out) }
}

/// Reads one DestinationRule's retry budget, or else its retry throttle.
pub(crate) fn destination_rule(c: &mut Collector, file: &str, doc: &Node) {
    let spec = doc.get("spec").unwrap_or(Node::empty());
    let Some(host) = spec.get("host").and_then(Node::as_str) else { return };
    let (name, _) = name_of(doc);
    let resource = format!("DestinationRule {name}");
    let settings = Settings { file, resource: &resource };
    let policy = spec.get("trafficPolicy").unwrap_or(Node::empty());
    let http = policy.at(&["connectionPool", "http"]).unwrap_or(Node::empty());
    let max_retries = settings.u64(c, "maxRetries", http.get("maxRetries"));
    let max_requests = settings.u64(c, "http2MaxRequests", http.get("http2MaxRequests"));
    let budget = match policy.get("retryBudget") {
        Some(b) if !crate::formats::absent(Some(b)) => {
            let percent =
                settings.f64(c, "retryBudget.percent", b.get("percent")).unwrap_or(20.0) / 100.0;
            let floor = settings
                .u64(c, "retryBudget.minRetryConcurrency", b.get("minRetryConcurrency"))
                .unwrap_or(3);
            // Read so that a value Istio would refuse is a finding; see the module note.
            let _ = settings.duration(c, "retryBudget.budgetInterval", b.get("budgetInterval"));
            let loc = Location { file: file.to_string(), line: b.line };
            if crate::model::budget_too_high(percent) {
                let factor = Budget::Concurrency { percent }.max_factor().unwrap_or(f64::INFINITY);
                c.finding(
                    Severity::Warning,
                    Rule::BudgetTooHigh,
                    loc.clone(),
                    resource.clone(),
                    format!(
                        "retryBudget percent {} lets retries be up to {} of requests (a factor of {})",
                        pct(percent),
                        pct(percent),
                        trim_float(factor)
                    ),
                    "keep retryBudget.percent at or below 50 (20 is the default)",
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
                    format!(
                        "retryBudget.minRetryConcurrency {floor} is above http2MaxRequests {cap}: the floor alone can fill the cap"
                    ),
                    format!(
                        "set minRetryConcurrency at most http2MaxRequests − planned primaries (≤ {cap})"
                    ),
                );
            }
            Some(Budget::Concurrency { percent })
        }
        _ => max_retries.map(Budget::Slots),
    };
    c.istio_rules.push((host.to_string(), budget));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_table() {
        assert_eq!(default_retries(IstioVersion::CURRENT).0, 2);
        assert_eq!(default_retries("1.0".parse().unwrap()).0, 0);
        assert_eq!(default_retries("1.1.3".parse().unwrap()).0, 2);
        assert_eq!("one".parse::<IstioVersion>(), Err(BadIstioVersion("one".into())));
        assert_eq!(
            "1.x".parse::<IstioVersion>().unwrap_err().to_string(),
            "`1.x` is not an Istio version like 1.22"
        );
    }

    #[test]
    fn hosts() {
        assert!(same_host("reviews", "reviews.default.svc.cluster.local"));
        assert!(same_host("reviews.default", "reviews.default.svc.cluster.local"));
        assert!(!same_host("reviews", "ratings"));
        assert!(!same_host("reviews.a", "reviews.b"));
    }
}
