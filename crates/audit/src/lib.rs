//! `stormguard audit`: find retry amplification and unsafe retry settings in the configs a team
//! already has, before an incident does.
//!
//! Retries hide in templates and copied manifests. When a client library, a sidecar and a gateway
//! each retry, the attempts multiply: three layers of "retry twice" send 27 attempts to the last
//! dependency. This crate reads Istio, Envoy, gRPC service config, Linkerd, Gateway API, Kuma
//! and stormguard's own config, reduces each retry setting to a [`Layer`] (attempts including the first, a budget,
//! timeouts), checks each layer, and — given a call graph — multiplies the layers along every
//! path.
//!
//! ```
//! use stormguard_audit::{audit_sources, AuditOptions, Rule, Severity};
//!
//! let vs = "apiVersion: networking.istio.io/v1\nkind: VirtualService\nmetadata:\n  name: reviews\n\
//!           spec:\n  http:\n  - route:\n    - destination:\n        host: reviews\n";
//! let report = audit_sources(&[("vs.yaml".into(), vs.into())], None, &AuditOptions::default()).unwrap();
//! // No `retries` field: Istio's default (2 retries) is in force.
//! let f = report.findings.iter().find(|f| f.rule == Rule::DefaultRetries).unwrap();
//! assert_eq!((f.severity, f.location.line), (Severity::Warning, 7));
//! ```
//!
//! Attempt semantics per format are spelled out in each format module and in docs/audit.md.

#![warn(missing_docs)]

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

mod formats;
pub mod graph;
pub mod model;
pub mod node;
pub mod output;

pub use formats::istio::{BadIstioVersion, IstioVersion};
pub use graph::PathReport;
pub use model::{
    Budget, Finding, Format, Layer, Location, Methods, Rule, Severity, UnknownSeverity,
};
use node::Node;

/// What the audit checks against.
#[derive(Debug, Clone, PartialEq)]
pub struct AuditOptions {
    /// Worst-case attempts reaching a dependency above this are an error. Default 3.
    pub max_amplification: f64,
    /// The Istio release whose defaults apply where `retries` is absent. Default: current.
    pub istio_version: IstioVersion,
}

impl Default for AuditOptions {
    fn default() -> Self {
        AuditOptions { max_amplification: 3.0, istio_version: IstioVersion::CURRENT }
    }
}

/// Input that cannot be audited: exit 2, naming the file and line.
#[derive(Debug, thiserror::Error)]
pub enum AuditError {
    /// A file or directory could not be read.
    #[error("{path}: {source}")]
    Read {
        /// The path.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// A file is not valid YAML, JSON or TOML.
    #[error("{file}:{line}:{column}: {reason}")]
    Syntax {
        /// The file.
        file: String,
        /// 1-based line.
        line: u32,
        /// 1-based column.
        column: u32,
        /// The parser's reason.
        reason: String,
    },
    /// A file parses but a value in it is unusable (a bad budget SPEC).
    #[error("{file}:{line}: {reason}")]
    Invalid {
        /// The file.
        file: String,
        /// 1-based line.
        line: u32,
        /// Why.
        reason: String,
    },
    /// A TOML file read by stormguard's config reader (the call graph) is not valid:
    /// `file:line:column: key.path: reason`; an unknown graph ref is a
    /// [`GraphError`](graph::GraphError) rule.
    #[error(transparent)]
    Config(#[from] stormguard_config::FileError),
}

/// Everything an audit found.
#[derive(Debug, Clone, PartialEq)]
pub struct Report {
    /// Findings, most severe first, then by file and line.
    pub findings: Vec<Finding>,
    /// Every retry layer read (including those that do not retry).
    pub layers: Vec<Layer>,
    /// Call paths and their amplification, when a graph was given.
    pub paths: Vec<PathReport>,
    /// Files read.
    pub files: usize,
    /// Documents read (a multi-document YAML file counts each).
    pub documents: usize,
    /// Documents skipped, by kind (`Deployment`, `unknown`, ...).
    pub skipped: BTreeMap<String, usize>,
}

impl Report {
    /// The most severe finding's level, if any.
    pub fn worst(&self) -> Option<Severity> {
        self.findings.iter().map(|f| f.severity).max()
    }
}

/// Collects layers, findings and cross-document links while files are read; links are
/// resolved once everything is in (a route and its cluster may live in different files).
#[derive(Debug, Default)]
pub(crate) struct Collector {
    pub layers: Vec<Layer>,
    pub findings: Vec<Finding>,
    pub documents: usize,
    pub skipped: BTreeMap<String, usize>,
    /// Envoy route layer index → the cluster it sends to.
    pub envoy_links: Vec<(usize, String)>,
    pub envoy_clusters: HashMap<String, formats::envoy::ClusterInfo>,
    /// Istio route layer index → destination host.
    pub istio_links: Vec<(usize, String)>,
    /// DestinationRule host → its retry budget or throttle, if any.
    pub istio_rules: Vec<(String, Option<Budget>)>,
    /// Gateway API route layer index → a backend it sends to.
    pub gateway_links: Vec<(usize, formats::gateway::Backend)>,
    /// XBackendTrafficPolicy target → its retry budget.
    pub gateway_policies: Vec<(formats::gateway::Backend, Budget)>,
    /// Kuma MeshRetry layer index → its `to[]` target (`Mesh` or `KIND/NAME`).
    pub kuma_links: Vec<(usize, String)>,
    /// MeshCircuitBreaker target → its `maxRetries`.
    pub kuma_throttles: Vec<(String, u64)>,
    pub istio_version: IstioVersion,
}

impl Collector {
    pub fn finding(
        &mut self,
        severity: Severity,
        rule: Rule,
        location: Location,
        resource: impl Into<String>,
        message: impl Into<String>,
        fix: impl Into<String>,
    ) {
        self.findings.push(Finding {
            severity,
            rule,
            location,
            resource: resource.into(),
            message: message.into(),
            fix: fix.into(),
        });
    }

    pub fn skip(&mut self, kind: &str) {
        *self.skipped.entry(kind.to_string()).or_default() += 1;
    }
}

/// Audits files and directories (directories are walked for `.yaml`, `.yml`, `.json` and
/// `.toml`, in name order), with an optional call graph file.
pub fn audit_paths(
    paths: &[PathBuf],
    graph: Option<&Path>,
    options: &AuditOptions,
) -> Result<Report, AuditError> {
    let mut files = Vec::new();
    for p in paths {
        collect_files(p, true, &mut files)?;
    }
    let mut sources = Vec::with_capacity(files.len());
    let mut total = 0u64;
    for f in files {
        let text = read(&f)?;
        total += text.len() as u64;
        if total > MAX_TOTAL {
            return Err(AuditError::Read {
                path: f.display().to_string(),
                source: std::io::Error::new(
                    std::io::ErrorKind::FileTooLarge,
                    format!(
                        "the inputs together pass {}, the most one audit reads: audit fewer files at once",
                        stormguard_input::size(MAX_TOTAL)
                    ),
                ),
            });
        }
        sources.push((f.display().to_string(), text));
    }
    let graph = match graph {
        Some(g) => Some((g.display().to_string(), read(g)?)),
        None => None,
    };
    audit_sources(&sources, graph.as_ref().map(|(n, t)| (n.as_str(), t.as_str())), options)
}

/// The most all the inputs of one audit may hold together: 256 MiB.
pub const MAX_TOTAL: u64 = 256 * 1024 * 1024;

/// A regular file of at most 16 MiB ([`stormguard_input::MAX_FILE`]): a device such as
/// `/dev/zero`, a FIFO or a directory given where a file is expected is refused, never read
/// forever.
fn read(path: &Path) -> Result<String, AuditError> {
    stormguard_input::read_to_string(path, stormguard_input::MAX_FILE)
        .map_err(|source| AuditError::Read { path: path.display().to_string(), source })
}

fn collect_files(path: &Path, named: bool, out: &mut Vec<PathBuf>) -> Result<(), AuditError> {
    let meta = std::fs::metadata(path)
        .map_err(|source| AuditError::Read { path: path.display().to_string(), source })?;
    // A symlink to a directory found while walking is not followed (as `find` does not), so a
    // link back up the tree cannot make the walk endless; a directory named on the command line
    // is read whatever it is.
    let linked = || std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_symlink());
    if meta.is_dir() && !named && linked() {
        return Ok(());
    }
    if meta.is_dir() {
        let mut entries: Vec<PathBuf> = std::fs::read_dir(path)
            .map_err(|source| AuditError::Read { path: path.display().to_string(), source })?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .collect();
        entries.sort();
        for e in entries {
            let hidden = e.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with('.'));
            if !hidden {
                collect_files(&e, false, out)?;
            }
        }
    } else if named || matches!(extension(path), "yaml" | "yml" | "json" | "toml") {
        out.push(path.to_path_buf());
    }
    Ok(())
}

fn extension(path: &Path) -> &str {
    path.extension().and_then(|e| e.to_str()).unwrap_or("")
}

/// Audits in-memory sources: `(file name, text)` pairs, the format chosen by the name's
/// extension (`.json`, `.toml`, anything else is YAML), and an optional graph `(name, text)`.
pub fn audit_sources(
    sources: &[(String, String)],
    graph: Option<(&str, &str)>,
    options: &AuditOptions,
) -> Result<Report, AuditError> {
    let mut c = Collector { istio_version: options.istio_version, ..Collector::default() };
    for (file, text) in sources {
        read_source(&mut c, file, text)?;
    }
    resolve(&mut c);
    check_layers(&mut c, options);
    let paths = match graph {
        Some((name, text)) => graph::evaluate(&mut c, name, text, options)?,
        None => Vec::new(),
    };
    let mut findings = std::mem::take(&mut c.findings);
    findings.sort_by(|a, b| {
        b.severity
            .cmp(&a.severity)
            .then_with(|| a.location.cmp(&b.location))
            .then_with(|| a.rule.cmp(&b.rule))
    });
    Ok(Report {
        findings,
        layers: c.layers,
        paths,
        files: sources.len(),
        documents: c.documents,
        skipped: c.skipped,
    })
}

fn syntax(file: &str, e: node::SyntaxError) -> AuditError {
    AuditError::Syntax { file: file.to_string(), line: e.line, column: e.column, reason: e.reason }
}

fn read_source(c: &mut Collector, file: &str, text: &str) -> Result<(), AuditError> {
    match extension(Path::new(file)) {
        "toml" => formats::stormguard::read(c, file, text),
        "json" => {
            let doc = node::parse_json(text).map_err(|e| syntax(file, e))?;
            document(c, file, &doc);
            Ok(())
        }
        _ => {
            let docs = node::parse_yaml(text).map_err(|e| syntax(file, e))?;
            for doc in &docs {
                document(c, file, doc);
            }
            Ok(())
        }
    }
}

/// Routes one YAML/JSON document to its format.
fn document(c: &mut Collector, file: &str, doc: &Node) {
    if doc.entries().is_empty() {
        // `---` followed by nothing, or a bare scalar: not a document worth counting.
        if doc.items().is_empty() && doc.as_str().is_none() {
            return;
        }
    }
    c.documents += 1;
    let api = doc.get("apiVersion").and_then(Node::as_str);
    let kind = doc.get("kind").and_then(Node::as_str);
    if let (Some(api), Some(kind)) = (api, kind) {
        let istio = api.starts_with("networking.istio.io/");
        match kind {
            "VirtualService" if istio => formats::istio::virtual_service(c, file, doc),
            "DestinationRule" if istio => formats::istio::destination_rule(c, file, doc),
            "ServiceProfile" if api.starts_with("linkerd.io/") => {
                formats::linkerd::service_profile(c, file, doc)
            }
            // Linkerd 2.16 reads its retry annotations on Gateway API routes too.
            "HTTPRoute" if api.starts_with("gateway.networking.k8s.io/") => {
                formats::gateway::http_route(c, file, doc);
                formats::linkerd::annotations(c, file, doc);
            }
            "XBackendTrafficPolicy" | "BackendTrafficPolicy"
                if api.starts_with("gateway.networking.x-k8s.io/") =>
            {
                formats::gateway::backend_traffic_policy(c, file, doc)
            }
            "MeshRetry" if api.starts_with("kuma.io/") => formats::kuma::mesh_retry(c, file, doc),
            "MeshCircuitBreaker" if api.starts_with("kuma.io/") => {
                formats::kuma::mesh_circuit_breaker(c, file, doc)
            }
            "List" => {
                c.documents -= 1;
                for item in doc.get("items").map(Node::items).unwrap_or(&[]) {
                    document(c, file, item);
                }
            }
            _ => {
                if !formats::linkerd::annotations(c, file, doc) {
                    c.skip(kind);
                }
            }
        }
    } else if let Some(ty) = doc.get("type").and_then(Node::as_str)
        && doc.get("mesh").is_some()
        && matches!(ty, "MeshRetry" | "MeshCircuitBreaker")
    {
        // Kuma's Universal form: `type`, `name`, `mesh`, `spec`.
        match ty {
            "MeshRetry" => formats::kuma::mesh_retry(c, file, doc),
            _ => formats::kuma::mesh_circuit_breaker(c, file, doc),
        }
    } else if doc.get("methodConfig").is_some() || doc.get("retryThrottling").is_some() {
        formats::grpc::service_config(c, file, doc);
    } else if !formats::envoy::walk(c, file, doc) {
        c.skip("unknown");
    }
}

/// Links layers to budgets defined elsewhere (Envoy clusters, Istio DestinationRules, Gateway
/// API XBackendTrafficPolicies, Kuma MeshCircuitBreakers).
fn resolve(c: &mut Collector) {
    for (i, cluster) in std::mem::take(&mut c.envoy_links) {
        if let Some(info) = c.envoy_clusters.get(cluster.as_str()) {
            c.layers[i].budget = info.budget;
        }
    }
    for (i, host) in std::mem::take(&mut c.istio_links) {
        let budget = c
            .istio_rules
            .iter()
            .filter(|(h, _)| formats::istio::same_host(h, &host))
            .find_map(|(_, budget)| *budget);
        if budget.is_some() {
            c.layers[i].budget = budget;
        }
    }
    // A rule takes the budget of the first of its backends that a policy targets.
    for (i, backend) in std::mem::take(&mut c.gateway_links) {
        if c.layers[i].budget.is_some() {
            continue;
        }
        let budget = c.gateway_policies.iter().find(|(t, _)| t.same(&backend)).map(|(_, b)| *b);
        c.layers[i].budget = budget;
    }
    for (i, dest) in std::mem::take(&mut c.kuma_links) {
        let throttle = c
            .kuma_throttles
            .iter()
            .find(|(t, _)| *t == dest)
            .or_else(|| c.kuma_throttles.iter().find(|(t, _)| t == "Mesh"))
            .map(|(_, n)| *n);
        if let Some(n) = throttle {
            c.layers[i].budget = Some(Budget::Slots(n));
        }
    }
}

/// Retry conditions after which a request may already have been executed.
const AFTER_EXECUTION: &[&str] = &[
    "5xx",
    "gateway-error",
    "reset",
    "retriable-status-codes",
    "retriable-4xx",
    "internal",
    "deadline-exceeded",
    "unknown",
    "timeout",
];
const NON_IDEMPOTENT: &[&str] = &["POST", "PATCH", "CONNECT"];

/// The checks that look at one layer at a time.
fn check_layers(c: &mut Collector, options: &AuditOptions) {
    let mut out = Vec::new();
    for layer in &c.layers {
        if !layer.retries() {
            continue;
        }
        let loc = layer.location.clone();
        let res = layer.resource.clone();
        let envoy_known = layer.format == Format::Envoy
            && c.envoy_links_resolved_cluster(layer).is_some_and(|known| known);
        if layer.budget.is_none() && !layer.hedging && !envoy_known {
            out.push(Finding {
                severity: Severity::Warning,
                rule: Rule::UnbudgetedRetries,
                location: loc.clone(),
                resource: res.clone(),
                message: format!(
                    "retries (up to {} attempts) with no budget or throttle across requests",
                    attempts_text(layer.attempts)
                ),
                fix: budget_fix(layer.format).into(),
            });
        }
        if layer.hedging && layer.budget.is_none() {
            out.push(Finding {
                severity: Severity::Error,
                rule: Rule::UnthrottledHedging,
                location: loc.clone(),
                resource: res.clone(),
                message: format!(
                    "hedging sends up to {} attempts per request, even when nothing fails, with no throttle",
                    attempts_text(layer.attempts)
                ),
                fix: budget_fix(layer.format).into(),
            });
        }
        let factor = layer.factor();
        if factor > options.max_amplification {
            out.push(Finding {
                severity: Severity::Error,
                rule: Rule::Amplification,
                location: loc.clone(),
                resource: res.clone(),
                message: format!(
                    "up to {} attempts per request on this layer alone, above the allowed {}",
                    model::trim_float(factor),
                    model::trim_float(options.max_amplification)
                ),
                fix: "lower the retry count, or add a budget (a 20 % ratio budget caps the factor at 1.2)"
                    .into(),
            });
        }
        if let (Some(per_try), Some(attempts), Some(timeout)) =
            (layer.per_try_timeout, layer.attempts, layer.timeout)
        {
            let total = per_try.saturating_mul(attempts);
            if total > timeout {
                out.push(Finding {
                    severity: Severity::Warning,
                    rule: Rule::TimeoutExceeded,
                    location: loc.clone(),
                    resource: res.clone(),
                    message: format!(
                        "per-try timeout {} × {attempts} attempts = {} exceeds the route timeout {}: the last attempts are cut off",
                        fmt_duration(per_try),
                        fmt_duration(total),
                        fmt_duration(timeout)
                    ),
                    fix: format!(
                        "make per-try timeout × attempts fit the route timeout (per-try at most {})",
                        fmt_duration(timeout / attempts)
                    ),
                });
            }
        }
        if let Methods::Only(methods) = &layer.methods {
            let unsafe_methods: Vec<&str> =
                methods.iter().map(String::as_str).filter(|m| NON_IDEMPOTENT.contains(m)).collect();
            let unsafe_conditions: Vec<&str> = layer
                .retry_on
                .iter()
                .map(String::as_str)
                .filter(|r| AFTER_EXECUTION.contains(r))
                .collect();
            if !unsafe_methods.is_empty() && !unsafe_conditions.is_empty() {
                out.push(Finding {
                    severity: Severity::Error,
                    rule: Rule::NonIdempotentRetry,
                    location: loc.clone(),
                    resource: res.clone(),
                    message: format!(
                        "{} is retried on {}, after the upstream may have executed it",
                        unsafe_methods.join("/"),
                        unsafe_conditions.join(",")
                    ),
                    fix: "retry non-idempotent methods only on connect-failure,refused-stream (or send an idempotency key)".into(),
                });
            }
        }
    }
    c.findings.extend(out);
}

impl Collector {
    /// For an Envoy route layer: `Some(true)` when its cluster was read (its own finding covers
    /// a missing budget), `Some(false)` when not, `None` for other layers.
    fn envoy_links_resolved_cluster(&self, layer: &Layer) -> Option<bool> {
        let cluster = layer.refs.iter().find_map(|r| r.strip_prefix("cluster/"))?;
        Some(self.envoy_clusters.contains_key(cluster))
    }
}

fn attempts_text(a: Option<u32>) -> String {
    a.map_or_else(|| "unbounded".to_string(), |a| a.to_string())
}

fn budget_fix(format: Format) -> &'static str {
    match format {
        Format::Istio => {
            "give the DestinationRule a trafficPolicy.retryBudget (percent 20), or at least connectionPool.http.maxRetries"
        }
        Format::Envoy => {
            "add circuit_breakers.thresholds[].retry_budget (budget_percent 20, min_retry_concurrency 3) to the cluster"
        }
        Format::Grpc => {
            "add retryThrottling { maxTokens: 10, tokenRatio: 0.1 } to the service config"
        }
        Format::Linkerd => {
            "retry.linkerd.io annotations have no budget: keep retry.linkerd.io/limit low, or bound the Service with a ServiceProfile retryBudget (retryRatio 0.2), which then replaces the annotations"
        }
        Format::GatewayApi => {
            "attach an XBackendTrafficPolicy with retryConstraint (budget.percent 20) to the backend Service"
        }
        Format::Kuma => {
            "MeshRetry has no budget: keep numRetries low, and cap concurrent retries with a MeshCircuitBreaker connectionLimits.maxRetries"
        }
        Format::Stormguard | Format::Graph => "give the layer a budget = \"ratio:percent=0.2\"",
    }
}

/// A duration the way configs write it (`250ms`, `2s`, `1.5s`).
pub(crate) fn fmt_duration(d: std::time::Duration) -> String {
    let ms = d.as_millis();
    if ms > 0 && ms.is_multiple_of(1000) {
        format!("{}s", ms / 1000)
    } else if ms >= 1000 {
        format!("{}s", model::trim_float(d.as_secs_f64()))
    } else if d.subsec_nanos().is_multiple_of(1_000_000) {
        format!("{ms}ms")
    } else {
        format!("{}ms", model::trim_float(d.as_secs_f64() * 1000.0))
    }
}
