//! `stormguard plan --format envoy | istio | gateway-api | linkerd | grpc`: the planned cap and
//! budget written into another system's own configuration.
//!
//! The plan is one number for the cap and one for the budget; each system counts them its own
//! way. Every number written carries a comment saying where it came from, and what a system
//! cannot express (a cap shared by first tries and retries, a budget counted over in-flight
//! requests) is said twice: in the output, and as a note the caller prints on stderr. JSON has no
//! comments, so the gRPC service config says it in the notes only.

use std::fmt::Write as _;
use std::time::Duration;

use stormguard_core::defaults;
use stormguard_core::plan::Plan;

use super::plan::PlanArgs;

/// A configuration for another system, and what it could not express.
#[derive(Debug, Clone, PartialEq)]
pub struct Rendered {
    /// The configuration, ready to write to a file.
    pub text: String,
    /// One sentence per part of the plan the system cannot express, or expresses differently.
    pub notes: Vec<String>,
}

/// The numbers every format writes, each with its source.
struct Numbers {
    cap: u64,
    primary: u64,
    slots: u64,
    /// The floor held to the headroom, in concurrent retries (or retries per second).
    floor: u64,
    /// Retries as a share of everything in flight, in percent, at most 50.
    concurrency_pct: f64,
    /// Retries per original request, a fraction, at most 0.5.
    ratio: f64,
    held: bool,
    retries: u32,
    per_try: Duration,
    timeout: Duration,
    command: String,
}

impl Numbers {
    fn new(plan: &Plan, args: &PlanArgs, format: &str) -> Numbers {
        let max = defaults::MAX_SUGGESTED_PERCENT;
        Numbers {
            cap: plan.cap,
            primary: plan.primary,
            slots: plan.retry_slots,
            floor: plan.spec_floor(),
            concurrency_pct: plan.concurrency_fraction().min(max).as_f64() * 100.0,
            ratio: plan.ratio_fraction().min(max).as_f64(),
            held: plan.percent_held(),
            retries: args.retries,
            per_try: args.per_try_timeout,
            timeout: args.timeout,
            command: format!(
                "stormguard plan --cap {} --primary {} --floor {} --format {format}",
                plan.cap, plan.primary, plan.floor
            ),
        }
    }

    fn pct(&self) -> String {
        num(self.concurrency_pct)
    }

    /// Where the concurrency percent came from.
    fn pct_source(&self) -> String {
        if self.held {
            format!(
                "(cap - primary) / cap = {} / {} held at 50: past it a failing dependency sees more than half again its load in retries",
                self.slots, self.cap
            )
        } else {
            format!("(cap - primary) / cap = {} / {}", self.slots, self.cap)
        }
    }

    /// Where the floor came from.
    fn floor_source(&self) -> &'static str {
        "--floor, held to cap - primary"
    }
}

fn num(x: f64) -> String {
    stormguard_core::format::number(x, 4)
}

/// `0.3s`: protobuf JSON's duration (Envoy, gRPC).
fn proto_duration(d: Duration) -> String {
    let secs = d.as_secs();
    let nanos = d.subsec_nanos();
    if nanos == 0 {
        format!("{secs}s")
    } else {
        let frac = format!("{nanos:09}");
        format!("{secs}.{}s", frac.trim_end_matches('0'))
    }
}

/// `300ms`, `2s`: the Go-style duration Istio, Gateway API and Linkerd read (whole milliseconds).
fn go_duration(d: Duration) -> String {
    let ms = d.as_millis();
    if ms > 0 && ms.is_multiple_of(1000) { format!("{}s", ms / 1000) } else { format!("{ms}ms") }
}

/// A `HOST:PORT` flag (`[v6]:PORT` too): `--upstream`, `--listen`, `--service`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostPort {
    /// The host, without brackets.
    pub host: String,
    /// The port.
    pub port: u16,
    /// The text as given (what a name made of it shows).
    text: String,
}

/// Why a flag is not `HOST:PORT`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BadHostPort {
    /// No `:PORT`.
    #[error("`{0}` is not HOST:PORT (no port)")]
    NoPort(String),
    /// The port is not a number from 0 to 65535.
    #[error("`{text}`: `{port}` is not a port")]
    Port {
        /// The flag's text.
        text: String,
        /// What stood for the port.
        port: String,
    },
    /// Nothing before the `:`.
    #[error("`{0}` has no host")]
    NoHost(String),
}

impl std::str::FromStr for HostPort {
    type Err = BadHostPort;

    fn from_str(text: &str) -> Result<HostPort, BadHostPort> {
        let (host, port) = text.rsplit_once(':').ok_or_else(|| BadHostPort::NoPort(text.into()))?;
        let port: u16 =
            port.parse().map_err(|_| BadHostPort::Port { text: text.into(), port: port.into() })?;
        let host = host.trim_start_matches('[').trim_end_matches(']');
        if host.is_empty() {
            return Err(BadHostPort::NoHost(text.into()));
        }
        Ok(HostPort { host: host.to_string(), port, text: text.to_string() })
    }
}

impl std::fmt::Display for HostPort {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.text)
    }
}

const BACKOFF_BASE: Duration = defaults::BACKOFF_BASE;
const BACKOFF_MAX: Duration = defaults::BACKOFF_MAX;

/// An Envoy bootstrap: a listener on `--listen` whose route retries into a cluster for
/// `--upstream`, the cap and the budget on the cluster's circuit breaker.
pub fn envoy(plan: &Plan, args: &PlanArgs) -> Rendered {
    let n = Numbers::new(plan, args, "envoy");
    let (listen_host, listen_port) = (&args.listen.host, args.listen.port);
    let (up_host, up_port) = (&args.upstream.host, args.upstream.port);
    let kind = if up_host.parse::<std::net::IpAddr>().is_ok() { "STATIC" } else { "STRICT_DNS" };
    let name = &args.service;
    let mut s = String::new();
    let _ = writeln!(
        s,
        "# Envoy bootstrap planned by `{}`.\n\
         # Check it with `envoy --mode validate -c FILE` and `stormguard audit FILE`.\n\
         # Every attempt, first try or retry, counts against max_requests, so the cap is shared as\n\
         # in stormguard; the retry budget keeps retries to a share of what is in flight.",
        n.command
    );
    let _ = writeln!(
        s,
        "static_resources:
  listeners:
  - name: ingress
    address:
      socket_address:
        address: {listen_host}   # --listen
        port_value: {listen_port}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          \"@type\": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: ingress
          route_config:
            name: {name}
            virtual_hosts:
            - name: {name}
              domains: [\"*\"]
              routes:
              - name: all
                match:
                  prefix: \"/\"
                route:
                  cluster: {name}
                  timeout: {timeout}   # --timeout: the first try and every retry together
                  # Envoy retries any method on these conditions; stormguard retries a POST only
                  # after connect-failure or refused-stream. Add a route for POST with those two
                  # if the dependency is not idempotent.
                  retry_policy:
                    retry_on: 5xx,reset,connect-failure,refused-stream   # stormguard's default retry_on (Envoy's 5xx includes the per-try timeout)
                    num_retries: {retries}   # --retries: retries after the first try
                    per_try_timeout: {per_try}   # --per-try-timeout
                    retry_back_off:
                      base_interval: {base}   # stormguard's default backoff, jittered
                      max_interval: {max}
          http_filters:
          - name: envoy.filters.http.router
            typed_config:
              \"@type\": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
  clusters:
  - name: {name}
    connect_timeout: 1s
    type: {kind}
    load_assignment:
      cluster_name: {name}
      endpoints:
      - lb_endpoints:
        - endpoint:
            address:
              socket_address:
                address: {up_host}   # --upstream
                port_value: {up_port}
    circuit_breakers:
      thresholds:
      - priority: DEFAULT
        max_connections: {cap}   # --cap: an HTTP/1 connection carries one attempt
        max_requests: {cap}   # --cap: attempts in flight, first tries and retries
        retry_budget:
          budget_percent:
            value: {pct}   # {pct_source}
          min_retry_concurrency: {floor}   # {floor_source}
          # Envoy 1.39 and later: the percent counts the requests of the last 10 s (the ratio
          # budget's ttl) rather than those in flight; older Envoy refuses the field, delete it there.
          budget_interval: 10s",
        timeout = proto_duration(n.timeout),
        retries = n.retries,
        per_try = proto_duration(n.per_try),
        base = proto_duration(BACKOFF_BASE),
        max = proto_duration(BACKOFF_MAX),
        cap = n.cap,
        pct = n.pct(),
        pct_source = n.pct_source(),
        floor = n.floor,
        floor_source = n.floor_source(),
    );
    let notes = vec![
        "envoy: budget_interval needs Envoy 1.39 or later; delete it for an older Envoy (the \
         percent then counts retries among the requests in flight)"
            .to_string(),
    ];
    Rendered { text: s, notes }
}

/// An Istio DestinationRule (the cap and the budget) and VirtualService (the retries).
pub fn istio(plan: &Plan, args: &PlanArgs) -> Rendered {
    let n = Numbers::new(plan, args, "istio");
    let (name, port) = (&args.service.host, args.service.port);
    let mut s = String::new();
    let _ = writeln!(
        s,
        "# Istio config planned by `{}`.\n\
         # Replace the host with the service's full name (name.namespace.svc.cluster.local).",
        n.command
    );
    let _ = writeln!(
        s,
        "apiVersion: networking.istio.io/v1
kind: DestinationRule
metadata:
  name: {name}
spec:
  host: {name}
  trafficPolicy:
    connectionPool:
      http:
        http2MaxRequests: {cap}   # --cap: active requests, first tries and retries, HTTP/1.1 and HTTP/2
        maxRetries: {slots}   # cap - primary: retries in flight; all an Istio before 1.27 has (the budget overrides it)
    # Istio 1.27 and later. budgetInterval (Istio 1.31) is left out: the percent counts retries
    # among the requests in flight, as the plan does.
    retryBudget:
      percent: {pct}   # {pct_source}
      minRetryConcurrency: {floor}   # {floor_source}
---
apiVersion: networking.istio.io/v1
kind: VirtualService
metadata:
  name: {name}
spec:
  hosts:
  - {name}
  http:
  - route:
    - destination:
        host: {name}
        port:
          number: {port}
    timeout: {timeout}   # --timeout: the first try and every retry together
    # Istio has no backoff setting: Envoy's default applies (25 ms doubling to 250 ms, jittered),
    # which is stormguard's default too.
    retries:
      attempts: {retries}   # --retries: retries after the first try
      perTryTimeout: {per_try}   # --per-try-timeout
      retryOn: 5xx,reset,connect-failure,refused-stream   # stormguard's default retry_on",
        cap = n.cap,
        slots = n.slots,
        pct = n.pct(),
        pct_source = n.pct_source(),
        floor = n.floor,
        floor_source = n.floor_source(),
        timeout = go_duration(n.timeout),
        retries = n.retries,
        per_try = go_duration(n.per_try),
    );
    let notes = vec![
        "istio: retryBudget needs Istio 1.27 or later; an older Istio keeps only maxRetries (a \
         fixed cap - primary retries in flight). Istio has no backoff setting: Envoy's default \
         applies"
            .to_string(),
    ];
    Rendered { text: s, notes }
}

/// Gateway API: an XBackendTrafficPolicy (GEP-3388's retry budget) on the Service, and an
/// HTTPRoute rule that retries.
pub fn gateway_api(plan: &Plan, args: &PlanArgs) -> Rendered {
    let n = Numbers::new(plan, args, "gateway-api");
    let (name, port) = (&args.service.host, args.service.port);
    // The API's percent is a whole number: round down, never more generous than the cap.
    let pct = n.concurrency_pct.floor() as u64;
    // minRetryRate.count is at least 1, and left out it defaults to 10: a floor of 0 (no
    // headroom) is written as the least the API takes.
    let rate = n.floor.max(1);
    let mut s = String::new();
    let _ = writeln!(
        s,
        "# Gateway API config planned by `{}`.\n\
         # The budget is in the experimental channel (GEP-3388), so is HTTPRoute's retry; the\n\
         # parentRef names a Gateway to replace with yours.\n\
         # Gateway API has no concurrency cap: nothing here holds first tries and retries to {cap}\n\
         # in flight. Cap the dependency in the implementation's own policy, or in stormguard.",
        n.command,
        cap = n.cap
    );
    let _ = writeln!(
        s,
        "apiVersion: gateway.networking.x-k8s.io/v1alpha1
kind: XBackendTrafficPolicy
metadata:
  name: {name}-retry-budget
spec:
  targetRefs:
  - group: \"\"
    kind: Service
    name: {name}
  retryConstraint:
    # A share of the requests of the last interval, not of those in flight.
    budget:
      percent: {pct}   # {pct_source}, a whole number
      interval: 10s   # the ratio budget's ttl
    minRetryRate:
      count: {rate}   # {floor_source}, read as retries per second (the ratio budget's min_per_sec)
      interval: 1s
---
apiVersion: gateway.networking.k8s.io/v1
kind: HTTPRoute
metadata:
  name: {name}
spec:
  parentRefs:
  - name: gateway
  rules:
  - backendRefs:
    - name: {name}
      port: {port}
    timeouts:
      request: {timeout}   # --timeout: the first try and every retry together
      backendRequest: {per_try}   # --per-try-timeout: each try
    retry:
      codes: [500, 502, 503, 504]   # the codes every implementation must retry
      attempts: {retries}   # --retries: retries after the first try
      backoff: {base}   # stormguard's default first backoff; implementations may grow it",
        pct_source = n.pct_source(),
        floor_source = n.floor_source(),
        timeout = go_duration(n.timeout),
        per_try = go_duration(n.per_try),
        retries = n.retries,
        base = go_duration(BACKOFF_BASE),
    );
    let mut notes = vec![
        format!(
            "gateway-api: no concurrency cap: nothing holds first tries and retries to {} in \
             flight (cap the dependency in the implementation's own policy)",
            n.cap
        ),
        "gateway-api: the budget counts retries among the requests of the last interval, not \
         those in flight, and its floor is a rate (retries per second), not a concurrency; the \
         percent is a whole number, rounded down"
            .to_string(),
    ];
    if n.floor == 0 {
        notes.push(
            "gateway-api: the floor is 0, but minRetryRate.count is at least 1: written as 1 retry \
             a second"
                .to_string(),
        );
    }
    Rendered { text: s, notes }
}

/// Linkerd 2.16's retry annotations on the Service, and what Linkerd offers instead of a cap
/// and a budget.
pub fn linkerd(plan: &Plan, args: &PlanArgs) -> Rendered {
    let n = Numbers::new(plan, args, "linkerd");
    let (name, port) = (&args.service.host, args.service.port);
    let mut s = String::new();
    let _ = writeln!(
        s,
        "# Linkerd 2.16 retry annotations planned by `{}`.\n\
         # Put the annotations on the existing Service (the selector here is a placeholder).\n\
         #\n\
         # What Linkerd cannot express:\n\
         # - no concurrency cap: Linkerd limits no requests in flight to a service, so nothing holds\n\
         #   first tries and retries to {cap}; cap the dependency in the caller, or in stormguard;\n\
         # - no budget in the annotation model: retry.linkerd.io/limit bounds the retries of one\n\
         #   request, not the share of retries across requests. Linkerd's older ServiceProfile\n\
         #   model has one, for routes marked isRetryable, in place of these annotations:\n\
         #     retryBudget:\n\
         #       retryRatio: {ratio}   # (cap - primary) / primary = {slots} / {primary}, at most 0.5\n\
         #       minRetriesPerSecond: {floor}   # --floor\n\
         #       ttl: 10s",
        n.command,
        cap = n.cap,
        ratio = num(n.ratio),
        slots = n.slots,
        primary = n.primary,
        floor = n.floor,
    );
    let _ = writeln!(
        s,
        "apiVersion: v1
kind: Service
metadata:
  name: {name}
  annotations:
    retry.linkerd.io/http: 5xx   # stormguard retries 5xx; Linkerd retries connection failures by itself
    retry.linkerd.io/limit: \"{retries}\"   # --retries: retries after the first try
    retry.linkerd.io/timeout: {per_try}   # --per-try-timeout
    timeout.linkerd.io/request: {timeout}   # --timeout: the first try and every retry together
spec:
  selector:
    app: {name}
  ports:
  - port: {port}",
        retries = n.retries,
        per_try = go_duration(n.per_try),
        timeout = go_duration(n.timeout),
    );
    let notes = vec![
        format!(
            "linkerd: no concurrency cap: nothing holds first tries and retries to {} in flight",
            n.cap
        ),
        format!(
            "linkerd: the retry annotations have no budget; a ServiceProfile's retryBudget \
             (retryRatio {}, minRetriesPerSecond {}, ttl 10s) is the only one Linkerd offers, \
             for isRetryable routes instead of the annotations",
            num(n.ratio),
            n.floor
        ),
    ];
    Rendered { text: s, notes }
}

/// A gRPC service config: a retry policy for every method, and retryThrottling from the budget.
pub fn grpc(plan: &Plan, args: &PlanArgs) -> Rendered {
    let n = Numbers::new(plan, args, "grpc");
    // gRPC clients lower maxAttempts above 5 to 5.
    let attempts = (u64::from(n.retries) + 1).min(5);
    // A failure costs a token, a success earns tokenRatio, and retries stop below half of
    // maxTokens: over time retries are at most about tokenRatio per original call (the ratio
    // form), and the half above the line is the reserve of the ratio budget's floor
    // (min_per_sec × ttl retries). gRPC reads tokenRatio to three decimals; it must be above 0.
    let token_ratio = ((n.ratio * 1000.0).floor() / 1000.0).max(0.001);
    let reserve = n.floor.saturating_mul(defaults::RATIO_TTL.as_secs());
    let max_tokens = reserve.saturating_mul(2).clamp(1, 1000);
    let doc = serde_json::json!({
        "methodConfig": [{
            "name": [{}],
            "timeout": proto_duration(n.timeout),
            "retryPolicy": {
                "maxAttempts": attempts,
                "initialBackoff": proto_duration(BACKOFF_BASE),
                "maxBackoff": proto_duration(BACKOFF_MAX),
                "backoffMultiplier": defaults::BACKOFF_MULTIPLIER.as_f64(),
                "retryableStatusCodes": ["UNAVAILABLE"],
            },
        }],
        "retryThrottling": {
            "maxTokens": max_tokens,
            "tokenRatio": token_ratio,
        },
    });
    let text = serde_json::to_string_pretty(&doc).expect("a Value serializes") + "\n";
    let mut notes = vec![
        format!(
            "grpc: maxAttempts {attempts} = --retries {} + the first try{}; timeout = --timeout; \
             gRPC has no per-try timeout",
            n.retries,
            if u64::from(n.retries) + 1 > 5 { ", lowered to gRPC's most of 5" } else { "" }
        ),
        format!(
            "grpc: retryThrottling is a token bucket over calls, not a share of those in flight: \
             tokenRatio {} = (cap - primary) / primary = {} / {}{} (each success earns it, each \
             failure costs 1, so retries stay near that share of calls); maxTokens {max_tokens} = \
             2 x --floor {} x 10 s (retries stop below half, so the floor's 10 s reserve is the \
             half above the line)",
            num(token_ratio),
            n.slots,
            n.primary,
            if n.held { ", held at 0.5" } else { "" },
            n.floor
        ),
        format!(
            "grpc: no concurrency cap: a channel limits no calls in flight, so nothing holds first \
             tries and retries to {}",
            n.cap
        ),
    ];
    if n.ratio < 0.001 {
        notes.push("grpc: tokenRatio must be above 0; written as 0.001".to_string());
    }
    Rendered { text, notes }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(proto_duration(Duration::from_millis(300)), "0.3s");
        assert_eq!(proto_duration(Duration::from_millis(25)), "0.025s");
        assert_eq!(proto_duration(Duration::from_secs(2)), "2s");
        assert_eq!(go_duration(Duration::from_millis(300)), "300ms");
        assert_eq!(go_duration(Duration::from_secs(2)), "2s");
    }

    #[test]
    fn host_ports() {
        let hp = |t: &str| t.parse::<HostPort>().map(|h| (h.host, h.port));
        assert_eq!(hp("127.0.0.1:9000"), Ok(("127.0.0.1".into(), 9000)));
        assert_eq!(hp("[::1]:80"), Ok(("::1".into(), 80)));
        assert_eq!(hp("dependency"), Err(BadHostPort::NoPort("dependency".into())));
        assert_eq!(hp(":80"), Err(BadHostPort::NoHost(":80".into())));
        assert!(matches!(hp("a:http"), Err(BadHostPort::Port { .. })));
        assert_eq!("dependency:80".parse::<HostPort>().unwrap().to_string(), "dependency:80");
    }
}
