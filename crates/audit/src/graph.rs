//! The call graph: which service calls which, through which retry layers, and what that does to
//! the last dependency.
//!
//! Attempts multiply along a path: if the edge into a service retries 3 times in total and that
//! service's own client retries 3 times too, one user request can become 9 attempts at the next
//! hop. For every path from a caller nobody calls to a service that calls nobody, the
//! **amplification** is the product of each layer's factor: its attempts, or, on a budgeted
//! layer, the budget's cap (ratio `1 + p`, Envoy-style concurrency `1 + p/(1 − p)`), whichever is
//! lower. Factors are exact fractions, so `3 × 1.2 × 2` is exactly `36/5`.
//!
//! ```toml
//! [[call]]
//! from = "web"
//! to = "checkout"
//! via = ["virtualservice/checkout"]          # a layer read from the audited configs
//!
//! [[call]]
//! from = "checkout"
//! to = "payments"
//! via = ["grpc/payments.Payments", { name = "sdk", retries = 2 }]   # or one declared here
//! ```
//!
//! A ref names layers by `kind/name` (see docs/audit.md for each format's names); when several
//! layers match, the worst counts. Layers listed on one call are stacked on that hop.
//!
//! The graph is read by [`stormguard_config`], like every stormguard file: a mistake is an
//! [`AuditError::Config`] that names the file, line, column and key
//! (`graph.toml:4:8: call[0].via[0]: ...`), and a ref that names no layer is a
//! [`GraphError::UnknownRef`] at its position.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use serde::Deserialize;
use stormguard_config::de::{self, ScalarOrTable};
use stormguard_config::{Document, Invalid, KeyPath};
use stormguard_core::text::line_col;

use crate::model::{Budget, Finding, Format, Layer, Location, Rule, Severity, trim_float};
use crate::{AuditError, AuditOptions, Collector};

/// Paths evaluated at most; a graph with more is cut here (and says so).
pub const MAX_PATHS: usize = 10_000;

/// An exact non-negative fraction, or unbounded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Factor {
    /// `num / den`, reduced.
    Finite {
        /// Numerator.
        num: u128,
        /// Denominator, never 0.
        den: u128,
    },
    /// No bound.
    Unbounded,
}

fn gcd(mut a: u128, mut b: u128) -> u128 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

impl Factor {
    /// `num / den`, reduced.
    pub fn new(num: u128, den: u128) -> Factor {
        let g = gcd(num, den).max(1);
        Factor::Finite { num: num / g, den: den / g }
    }

    /// One (no amplification).
    pub const ONE: Factor = Factor::Finite { num: 1, den: 1 };

    /// The product; unbounded if either is or if it overflows.
    pub fn times(self, other: Factor) -> Factor {
        match (self, other) {
            (Factor::Finite { num: a, den: b }, Factor::Finite { num: c, den: d }) => {
                let (g1, g2) = (gcd(a, d).max(1), gcd(c, b).max(1));
                match ((a / g1).checked_mul(c / g2), (b / g2).checked_mul(d / g1)) {
                    (Some(n), Some(d)) => Factor::new(n, d),
                    _ => Factor::Unbounded,
                }
            }
            _ => Factor::Unbounded,
        }
    }

    /// The smaller.
    pub fn min(self, other: Factor) -> Factor {
        if self.as_f64() <= other.as_f64() { self } else { other }
    }

    /// The nearest `f64` (infinite when unbounded).
    pub fn as_f64(self) -> f64 {
        match self {
            Factor::Finite { num, den } => num as f64 / den as f64,
            Factor::Unbounded => f64::INFINITY,
        }
    }
}

fn millionths(f: f64) -> u128 {
    (f.max(0.0) * 1e6).round() as u128
}

/// A layer's factor, exactly: its attempts, capped by its budget.
pub fn exact_factor(layer: &Layer) -> Factor {
    let attempts = layer.attempts.map_or(Factor::Unbounded, |a| Factor::new(u128::from(a), 1));
    let cap = match layer.budget {
        Some(Budget::Ratio { percent }) => Factor::new(1_000_000 + millionths(percent), 1_000_000),
        Some(Budget::Concurrency { percent }) if percent < 1.0 => {
            Factor::new(1_000_000, 1_000_000 - millionths(percent))
        }
        Some(Budget::TokenBucket { token_ratio }) => {
            Factor::new(1_000_000 + millionths(token_ratio), 1_000_000)
        }
        Some(Budget::Quota { reward, cost }) if cost > 0.0 => {
            let c = millionths(cost);
            Factor::new(c + millionths(reward), c)
        }
        _ => Factor::Unbounded,
    };
    attempts.min(cap)
}

/// A path's amplification with its call trees: the layers outside a tree multiply as ever;
/// each tree's layers multiply up to its allowance.
#[derive(Debug, Default)]
struct TreeBound {
    /// The product of the layers outside a tree and of the trees closed so far.
    closed: Option<Factor>,
    /// The open tree: its layers' product and its smallest allowance.
    open: Option<(Factor, u32)>,
    /// The smallest allowance met (what the report names).
    smallest: Option<u32>,
}

impl TreeBound {
    fn times(acc: Option<Factor>, f: Factor) -> Option<Factor> {
        Some(acc.unwrap_or(Factor::ONE).times(f))
    }

    fn close(&mut self) {
        if let Some((product, a)) = self.open.take() {
            let bounded = product.min(Factor::new(u128::from(a), 1000));
            self.closed = Self::times(self.closed, bounded);
        }
    }

    fn layer(&mut self, tree: Option<crate::model::TreeLayer>, f: Factor) {
        match tree {
            None => self.closed = Self::times(self.closed, f),
            Some(t) => {
                if t.root {
                    self.close();
                }
                let (product, a) = self.open.unwrap_or((Factor::ONE, t.allowance));
                self.open = Some((product.times(f), a.min(t.allowance)));
                self.smallest = Some(self.smallest.map_or(t.allowance, |s| s.min(t.allowance)));
            }
        }
    }

    /// The path's bound and the smallest allowance, when a tree is on it.
    fn bound(mut self) -> Option<(Factor, Factor)> {
        let smallest = self.smallest?;
        self.close();
        Some((self.closed.unwrap_or(Factor::ONE), Factor::new(u128::from(smallest), 1000)))
    }
}

/// One hop of a path and the layers on it.
#[derive(Debug, Clone, PartialEq)]
pub struct HopReport {
    /// The caller.
    pub from: String,
    /// The callee.
    pub to: String,
    /// `(resource, factor)` per layer, outermost first.
    pub layers: Vec<(String, Factor)>,
}

/// A path from a caller nobody calls to a service that calls nobody.
#[derive(Debug, Clone, PartialEq)]
pub struct PathReport {
    /// Services in order.
    pub services: Vec<String>,
    /// The hops.
    pub hops: Vec<HopReport>,
    /// Worst-case attempts reaching the last service per request entering the first.
    pub amplification: Factor,
    /// Layers on the path that retry.
    pub retrying_layers: usize,
    /// The longest a caller can wait when the last service hangs: per-try timeouts × attempts,
    /// cut off by each layer's route timeout, nested outward. `None` = unbounded.
    pub worst_time: Option<Duration>,
    /// When stormguard layers on the path carry a call tree's context and their allowance is
    /// below their product: the path's amplification with it — the other layers' product
    /// times each tree's bound (a `root` layer starts a new tree) — and the smallest allowance.
    pub with_tree: Option<(Factor, Factor)>,
}

/// A rule of the graph that the file breaks (its key and position are the [`AuditError`]'s).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum GraphError {
    /// A ref in `via` that names no layer read from the audited configs.
    #[error("`{name}` names no retry layer in the audited configs")]
    UnknownRef {
        /// The ref, `kind/name`.
        name: String,
    },
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename = "graph")]
struct GraphFile {
    #[serde(default)]
    call: Vec<CallFile>,
}

/// `[[call]]`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename = "call")]
struct CallFile {
    from: String,
    to: String,
    /// A ref (`"grpc/payments.Payments"`) or a layer declared here.
    #[serde(default)]
    via: Vec<ScalarOrTable<String, InlineLayer>>,
}

/// `{ name = "sdk", retries = 2 }` in a call's `via`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename = "layer")]
struct InlineLayer {
    name: String,
    retries: Option<u32>,
    attempts: Option<u32>,
    #[serde(default, deserialize_with = "de::option_from_str")]
    budget: Option<stormguard_core::BudgetSpec>,
    #[serde(default, deserialize_with = "de::option_duration")]
    per_try_timeout: Option<Duration>,
    #[serde(default, deserialize_with = "de::option_duration")]
    timeout: Option<Duration>,
}

struct Call {
    from: String,
    to: String,
    line: u32,
    /// Indices into the collector's layers.
    layers: Vec<usize>,
}

pub(crate) fn evaluate(
    c: &mut Collector,
    file: &str,
    text: &str,
    options: &AuditOptions,
) -> Result<Vec<PathReport>, AuditError> {
    let doc = Document::parse(text, file)?;
    let graph: GraphFile = doc.deserialize()?;
    let line_of = |key: &KeyPath| line_col(text, doc.span(key).start).0 as u32;
    let mut calls = Vec::new();
    for (i, call) in graph.call.into_iter().enumerate() {
        let at = KeyPath::root().key("call").index(i);
        let mut layers = Vec::new();
        for (j, via) in call.via.into_iter().enumerate() {
            let at = at.clone().key("via").index(j);
            match via {
                ScalarOrTable::Scalar(r) => {
                    let worst = c
                        .layers
                        .iter()
                        .enumerate()
                        .filter(|(_, l)| l.refs.contains(&r))
                        .max_by(|a, b| {
                            exact_factor(a.1).as_f64().total_cmp(&exact_factor(b.1).as_f64())
                        })
                        .map(|(i, _)| i);
                    match worst {
                        Some(i) => layers.push(i),
                        None => {
                            let error = GraphError::UnknownRef { name: r };
                            return Err(doc.invalid(Invalid::new(at, error)).into());
                        }
                    }
                }
                ScalarOrTable::Table(il) => {
                    let mut layer = Layer::new(
                        Format::Graph,
                        Location { file: file.to_string(), line: line_of(&at) },
                        format!("{} (graph)", il.name),
                    );
                    layer.refs.push(format!("graph/{}", il.name));
                    layer.attempts = Some(match (il.attempts, il.retries) {
                        (Some(a), _) => a.max(1),
                        (None, Some(r)) => r.saturating_add(1),
                        (None, None) => 1,
                    });
                    layer.budget =
                        il.budget.map(|spec| crate::formats::stormguard::model_budget(&spec).0);
                    layer.per_try_timeout = il.per_try_timeout;
                    layer.timeout = il.timeout;
                    c.layers.push(layer);
                    layers.push(c.layers.len() - 1);
                }
            }
        }
        calls.push(Call { from: call.from, to: call.to, line: line_of(&at), layers });
    }

    let mut out_edges: BTreeMap<&str, Vec<usize>> = BTreeMap::new();
    let mut called: BTreeSet<&str> = BTreeSet::new();
    let mut services: BTreeSet<&str> = BTreeSet::new();
    for (i, call) in calls.iter().enumerate() {
        out_edges.entry(call.from.as_str()).or_default().push(i);
        called.insert(call.to.as_str());
        services.insert(call.from.as_str());
        services.insert(call.to.as_str());
    }
    let mut roots: Vec<&str> = services.iter().copied().filter(|s| !called.contains(s)).collect();
    if roots.is_empty() {
        // Every service is called by another (a cycle): start everywhere.
        roots = services.iter().copied().collect();
    }
    let mut paths: Vec<Vec<usize>> = Vec::new();
    for root in roots {
        let mut stack = Vec::new();
        walk(root, root, &out_edges, &calls, &mut stack, &mut paths);
    }

    let mut reports = Vec::new();
    for path in &paths {
        reports.push(report(c, &calls, path, file, options));
    }
    Ok(reports)
}

fn walk(
    root: &str,
    at: &str,
    out_edges: &BTreeMap<&str, Vec<usize>>,
    calls: &[Call],
    stack: &mut Vec<usize>,
    paths: &mut Vec<Vec<usize>>,
) {
    if paths.len() >= MAX_PATHS {
        return;
    }
    let next: Vec<usize> = out_edges
        .get(at)
        .map(|edges| {
            edges
                .iter()
                .copied()
                // A service already on the path ends it: a cycle is reported once, not forever.
                .filter(|&e| {
                    let to = calls[e].to.as_str();
                    to != root && !stack.iter().any(|&s| calls[s].to == to)
                })
                .collect()
        })
        .unwrap_or_default();
    if next.is_empty() {
        if !stack.is_empty() {
            paths.push(stack.clone());
        }
        return;
    }
    for e in next {
        stack.push(e);
        walk(root, &calls[e].to, out_edges, calls, stack, paths);
        stack.pop();
    }
}

fn report(
    c: &mut Collector,
    calls: &[Call],
    path: &[usize],
    file: &str,
    options: &AuditOptions,
) -> PathReport {
    let mut services = vec![calls[path[0]].from.clone()];
    let mut hops = Vec::new();
    let mut amplification = Factor::ONE;
    // The layers that carry a call tree's context, apart: a tree's layers' product is bounded
    // by the smallest allowance among them (`stormguard_core::tree`); a `root` layer starts a
    // new tree, whose bound multiplies the ones before it.
    let mut tree = TreeBound::default();
    let mut retrying = Vec::new();
    for &i in path {
        let call = &calls[i];
        services.push(call.to.clone());
        let mut layers = Vec::new();
        for &l in &call.layers {
            let layer = &c.layers[l];
            let f = exact_factor(layer);
            amplification = amplification.times(f);
            tree.layer(layer.tree, f);
            layers.push((layer.resource.clone(), f));
            if layer.retries() {
                retrying.push(l);
            }
        }
        hops.push(HopReport { from: call.from.clone(), to: call.to.clone(), layers });
    }
    // Innermost first: each layer's single try lasts as long as everything inside it.
    let mut inner: Option<Duration> = None;
    for &i in path.iter().rev() {
        for &l in calls[i].layers.iter().rev() {
            let layer = &c.layers[l];
            let one_try = match (layer.per_try_timeout, inner) {
                (Some(p), Some(t)) => Some(p.min(t)),
                (Some(p), None) => Some(p),
                (None, t) => t,
            };
            let all = match (one_try, layer.attempts) {
                (Some(t), Some(a)) => Some(t.saturating_mul(a)),
                _ => None,
            };
            inner = match (all, layer.timeout) {
                (Some(a), Some(r)) => Some(a.min(r)),
                (a, r) => a.or(r),
            };
        }
    }
    let name = services.join(" → ");
    let last_line = calls[*path.last().unwrap_or(&0)].line;
    // Layers that all carry one call tree's context (none below the first starts a new one)
    // share one allowance and pass an overload up: their stacking is what the tree is for.
    let one_tree = retrying
        .iter()
        .enumerate()
        .all(|(i, &l)| c.layers[l].tree.is_some_and(|t| i == 0 || !t.root));
    if retrying.len() > 1 && !one_tree {
        let second = &c.layers[retrying[1]];
        let names: Vec<&str> = retrying.iter().map(|&l| c.layers[l].resource.as_str()).collect();
        c.findings.push(Finding {
            severity: Severity::Warning,
            rule: Rule::StackedRetries,
            location: second.location.clone(),
            resource: format!("path {name}"),
            message: format!("{} layers retry on this path: {}", retrying.len(), names.join("; ")),
            fix: "retry at one layer only (the one with a budget) and set the others to 0 retries"
                .into(),
        });
    }
    let with_tree = tree.bound().filter(|(b, _)| b.as_f64() < amplification.as_f64());
    // The sustained bound judges the path: a ratio budget's factor is one too.
    let amp = with_tree.map_or(amplification, |(b, _)| b).as_f64();
    if amp > options.max_amplification {
        let mut factors = hops
            .iter()
            .flat_map(|h| h.layers.iter().map(|(_, f)| trim_float(f.as_f64())))
            .collect::<Vec<String>>()
            .join(" × ");
        if let Some((_, allowance)) = with_tree {
            factors.push_str(&format!(
                ", the stormguard layers' held to the call tree's allowance {}",
                trim_float(allowance.as_f64())
            ));
        }
        c.findings.push(Finding {
            severity: Severity::Error,
            rule: Rule::Amplification,
            location: Location { file: file.to_string(), line: last_line },
            resource: format!("path {name}"),
            message: format!(
                "up to {} attempts reach {} per request ({}), above the allowed {}",
                trim_float(amp),
                services.last().map_or("", String::as_str),
                factors,
                trim_float(options.max_amplification)
            ),
            fix: "retry at one layer, or budget the inner hops (a 20 % ratio budget caps a hop at 1.2)".into(),
        });
    }
    PathReport {
        services,
        hops,
        amplification,
        retrying_layers: retrying.len(),
        worst_time: inner,
        with_tree,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn graph(text: &str) -> Result<crate::Report, AuditError> {
        crate::audit_sources(&[], Some(("g.toml", text)), &AuditOptions::default())
    }

    fn config_error(text: &str) -> stormguard_config::FileError {
        match graph(text) {
            Err(AuditError::Config(e)) => e,
            other => panic!("{other:?}"),
        }
    }

    const CALL: &str = "[[call]]\nfrom = \"web\"\nto = \"api\"\n";

    /// Three stormguard sidecars on a path, each with a 20 % budget: the per-hop product is
    /// 1.728; with their listeners carrying the call tree (allowance 1.2), the path says 1.2.
    #[test]
    fn a_call_trees_allowance_bounds_the_stormguard_layers_on_a_path() {
        let sidecar = |name: &str, tree: &str| {
            format!(
                "[[listener]]\nlisten = \"127.0.0.1:0\"\ndependency = \"{name}\"\n{tree}\n\
                 [[dependency]]\nname = \"{name}\"\nupstreams = [\"http://127.0.0.1:1\"]\n\
                 budget = \"ratio:percent=0.2,min_per_sec=0\"\n"
            )
        };
        let graph = "[[call]]\nfrom = \"web\"\nto = \"a\"\nvia = [\"stormguard/a\"]\n\
                     [[call]]\nfrom = \"a\"\nto = \"b\"\nvia = [\"stormguard/b\"]\n\
                     [[call]]\nfrom = \"b\"\nto = \"c\"\nvia = [\"stormguard/c\", { name = \"sdk\", retries = 1 }]\n";
        let run = |tree: &str| {
            let files: Vec<(String, String)> =
                ["a", "b", "c"].iter().map(|n| (format!("{n}.toml"), sidecar(n, tree))).collect();
            crate::audit_sources(&files, Some(("g.toml", graph)), &AuditOptions::default())
                .unwrap()
                .paths
                .remove(0)
        };
        let plain = run("");
        assert_eq!(plain.amplification, Factor::new(1728 * 2, 1000));
        assert_eq!(plain.with_tree, None);
        let tree = run("tree = \"trust\"\ntree_allowance = 1.2");
        // The SDK's own retry is outside the tree: it multiplies the allowance.
        assert_eq!(tree.with_tree, Some((Factor::new(24, 10), Factor::new(12, 10))));
        assert_eq!(tree.amplification, plain.amplification, "the per-hop product is still said");
        // Each sidecar starting its own tree: the allowances multiply (1.2 × 1.2 × 1.2 × 2:
        // no bound below the product, so none is said).
        assert_eq!(run("tree = \"root\"\ntree_allowance = 1.2").with_tree, None);
    }

    /// One shape for all three kinds of mistake: a wrong value, an unknown key, a type error.
    #[test]
    fn a_wrong_value_an_unknown_key_and_a_type_error_have_one_shape() {
        let e = config_error(&format!(
            "{CALL}via = [{{ name = \"sdk\", budget = \"ratio:percent=9999\" }}]\n"
        ));
        assert_eq!(
            e.to_string(),
            "g.toml:4:33: call[0].via[0].budget: percent must be a fraction in [0, 1000], got 9999"
        );
        assert_eq!(e.key().unwrap().to_string(), "call[0].via[0].budget");
        let e = config_error(&format!("{CALL}{CALL}vai = []\n"));
        assert!(
            e.to_string().starts_with(
                "g.toml:7:1: call[1].vai: unknown field `vai`, expected one of `from`, `to`, `via`"
            ),
            "{e}"
        );
        let e = config_error(&format!("{CALL}via = [{{ name = \"sdk\", retries = \"2\" }}]\n"));
        assert_eq!(
            e.to_string(),
            "g.toml:4:34: call[0].via[0].retries: invalid type: string \"2\", expected u32"
        );
        assert_eq!(e.position(), Some((4, 34)));
        // A ref that names nothing is the graph's own rule, at the ref.
        let e = config_error(&format!("{CALL}via = [{{ name = \"sdk\" }}, \"grpc/Nope\"]\n"));
        assert_eq!(
            e.to_string(),
            "g.toml:4:26: call[0].via[1]: `grpc/Nope` names no retry layer in the audited configs"
        );
        assert_eq!(
            e.rule::<GraphError>(),
            Some(&GraphError::UnknownRef { name: "grpc/Nope".into() })
        );
        // And a missing key, at the table that lacks it.
        let e = config_error("[[call]]\nfrom = \"web\"\n");
        assert_eq!(e.to_string(), "g.toml:1:1: call[0]: missing field `to`");
    }

    #[test]
    fn inline_layers_are_read_with_their_lines() {
        let text = format!(
            "{CALL}via = [\n  {{ name = \"sdk\", retries = 2, per_try_timeout = \"1s\", timeout = \"5s\" }},\n  \
             {{ name = \"gw\", attempts = 3, budget = \"ratio:percent=0.2\" }},\n]\n"
        );
        let r = graph(&text).unwrap();
        let sdk = &r.layers[0];
        assert_eq!((sdk.attempts, sdk.location.line), (Some(3), 5));
        assert_eq!(
            (sdk.per_try_timeout, sdk.timeout),
            (Some(Duration::from_secs(1)), Some(Duration::from_secs(5)))
        );
        let gw = &r.layers[1];
        assert_eq!((gw.attempts, gw.location.line, gw.refs[0].as_str()), (Some(3), 6, "graph/gw"));
        assert_eq!(gw.budget, Some(Budget::Ratio { percent: 0.2 }));
        // 3 attempts × min(3, 1.2).
        assert_eq!(r.paths[0].amplification, Factor::new(18, 5));
        // The outer layer: 3 tries of at most 1 s, within its 5 s timeout.
        assert_eq!(r.paths[0].worst_time, Some(Duration::from_secs(3)));
    }

    #[test]
    fn factors_are_exact() {
        let f = Factor::new(3, 1).times(Factor::new(6, 5)).times(Factor::new(2, 1));
        assert_eq!(f, Factor::Finite { num: 36, den: 5 });
        assert_eq!(trim_float(f.as_f64()), "7.2");
        assert_eq!(Factor::new(3, 1).times(Factor::Unbounded), Factor::Unbounded);
    }

    #[test]
    fn concurrency_budget_factor() {
        let mut l = Layer::new(Format::Envoy, Location { file: "f".into(), line: 1 }, "r".into());
        l.attempts = Some(5);
        l.budget = Some(Budget::Concurrency { percent: 0.2 });
        // 1 + 0.2/0.8 = 1.25
        assert_eq!(exact_factor(&l), Factor::new(5, 4));
        l.budget = Some(Budget::Ratio { percent: 0.2 });
        assert_eq!(exact_factor(&l), Factor::new(6, 5));
        l.attempts = Some(1);
        assert_eq!(exact_factor(&l), Factor::ONE);
    }
}
