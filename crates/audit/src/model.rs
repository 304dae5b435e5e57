//! What every format is reduced to: a retry **layer** (one place that retries a call, with its
//! attempts, budget and timeouts) and a **finding** (something wrong with one, with a fix).
//!
//! Formats disagree on what they count. Every layer here stores `attempts` as the total number of
//! tries including the first, so `1` means no retries; the per-format conversion is in the format
//! module and in docs/audit.md.

use std::fmt;
use std::time::Duration;

use stormguard_core::format;

/// The config language a layer or finding came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Format {
    /// Istio VirtualService / DestinationRule.
    Istio,
    /// Envoy route and cluster config.
    Envoy,
    /// gRPC service config.
    Grpc,
    /// Linkerd ServiceProfile or `retry.linkerd.io/*` annotations.
    Linkerd,
    /// stormguard's own `[[dependency]]` config.
    Stormguard,
    /// Gateway API HTTPRoute retries and XBackendTrafficPolicy retry budgets.
    GatewayApi,
    /// Kuma MeshRetry and MeshCircuitBreaker.
    Kuma,
    /// A layer declared inline in the call graph (a client library, say).
    Graph,
}

impl Format {
    /// The name used in output.
    pub fn as_str(self) -> &'static str {
        match self {
            Format::Istio => "istio",
            Format::Envoy => "envoy",
            Format::Grpc => "grpc",
            Format::Linkerd => "linkerd",
            Format::Stormguard => "stormguard",
            Format::GatewayApi => "gateway-api",
            Format::Kuma => "kuma",
            Format::Graph => "graph",
        }
    }
}

/// A file and a 1-based line.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Location {
    /// The file as given on the command line (or found under a directory given there).
    pub file: String,
    /// 1-based line.
    pub line: u32,
}

/// What bounds a layer's retries across requests.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Budget {
    /// Retries at most `percent` of original requests (Finagle, Linkerd, stormguard `ratio`).
    /// `percent` is a fraction (0.2 = 20 %).
    Ratio {
        /// Fraction of originals.
        percent: f64,
    },
    /// Retries at most `percent` of all requests, retries included: of those in flight (Envoy
    /// `retry_budget`, Istio `retryBudget`, stormguard `concurrency`), or of those started
    /// within a window (the same with `budget_interval`, Gateway API `retryConstraint`), which
    /// bounds the same factor in steady state. `percent` is a fraction.
    Concurrency {
        /// Fraction of all in flight.
        percent: f64,
    },
    /// gRPC retry throttling / stormguard `token-bucket`: each success earns `token_ratio`
    /// tokens, each failure costs one.
    TokenBucket {
        /// Tokens earned per success.
        token_ratio: f64,
    },
    /// AWS-style quota: a retry costs `cost` and a success earns `reward`.
    Quota {
        /// Tokens per successful first try.
        reward: f64,
        /// Tokens per retry.
        cost: f64,
    },
    /// A fixed number of concurrent retries (Envoy `max_retries` circuit breaker, Istio
    /// `connectionPool.http.maxRetries`, Kuma `connectionLimits.maxRetries`, stormguard
    /// `concurrency:slots=N`): a throttle, but it
    /// bounds retries in flight, not retries per request, so it caps no factor.
    Slots(u64),
}

impl Budget {
    /// The most this budget lets a layer multiply the requests it receives, in steady state
    /// and at a traffic level where the floor is negligible; `None` when it bounds no ratio.
    ///
    /// - ratio `p`: `1 + p` (p retries per original);
    /// - concurrency `p`: retries are at most `p` of all in flight, so `r ≤ p (n + r)`, i.e.
    ///   `r/n ≤ p / (1 − p)`, and the factor is `1 + p/(1 − p)` (unbounded at `p ≥ 1`);
    /// - token bucket: retries are paid by successes, at most `token_ratio` per success: `1 + ratio`;
    /// - quota: `1 + reward / cost`.
    pub fn max_factor(&self) -> Option<f64> {
        match *self {
            Budget::Ratio { percent } => Some(1.0 + percent),
            Budget::Concurrency { percent } if percent < 1.0 => {
                Some(1.0 + percent / (1.0 - percent))
            }
            Budget::Concurrency { .. } => None,
            Budget::TokenBucket { token_ratio } => Some(1.0 + token_ratio),
            Budget::Quota { cost, .. } if cost <= 0.0 => None,
            Budget::Quota { reward, cost } => Some(1.0 + reward / cost),
            Budget::Slots(_) => None,
        }
    }

    /// A short description for output.
    pub fn describe(&self) -> String {
        match *self {
            Budget::Ratio { percent } => format!("ratio {}", pct(percent)),
            Budget::Concurrency { percent } => format!("concurrency {}", pct(percent)),
            Budget::TokenBucket { token_ratio } => format!("token-bucket ratio {token_ratio}"),
            Budget::Quota { reward, cost } => format!("quota {reward}/{cost}"),
            Budget::Slots(n) => format!("{n} concurrent retries"),
        }
    }
}

/// Whether a budget's share is above what `stormguard plan` would suggest
/// ([`stormguard_core::defaults::MAX_SUGGESTED_PERCENT`], 50 %): a `budget-too-high` finding.
pub fn budget_too_high(percent: f64) -> bool {
    percent > stormguard_core::defaults::MAX_SUGGESTED_PERCENT.as_f64()
}

/// A fraction as a percentage in a finding's sentence, as `stormguard plan` prints a budget:
/// at most 2 decimals, no trailing zeros (`0.2` → `20 %`, `1/3` → `33.33 %`).
pub fn pct(f: f64) -> String {
    format::percent_trimmed(f, 2)
}

/// A factor or a number of seconds: at most 3 decimals, no trailing zeros (`7.2`, `18`,
/// `1.667`); an infinite factor is `unbounded`.
pub fn trim_float(f: f64) -> String {
    if f.is_infinite() {
        return "unbounded".into();
    }
    format::number(f, 3)
}

/// Which request methods a route serves.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum Methods {
    /// Not constrained by the config (or not known).
    #[default]
    Any,
    /// Only these (upper-case).
    Only(Vec<String>),
}

/// One place that retries a call.
#[derive(Debug, Clone, PartialEq)]
pub struct Layer {
    /// The format it came from.
    pub format: Format,
    /// Where it is configured (the retry policy, or the route when the policy is a default).
    pub location: Location,
    /// What it concerns, for people: `VirtualService reviews.default http[0]`.
    pub resource: String,
    /// Names a call graph can use for it: `virtualservice/reviews`, `cluster/payments`, ...
    pub refs: Vec<String>,
    /// Total tries including the first (1 = no retries); `None` = no count limit (Linkerd
    /// ServiceProfile retries stop only at the budget or the timeout).
    pub attempts: Option<u32>,
    /// What bounds retries across requests.
    pub budget: Option<Budget>,
    /// The per-try timeout.
    pub per_try_timeout: Option<Duration>,
    /// The overall (route) timeout covering all tries.
    pub timeout: Option<Duration>,
    /// Retry conditions, in the format's own words, lower-cased.
    pub retry_on: Vec<String>,
    /// Methods the route serves.
    pub methods: Methods,
    /// Sends extra attempts without waiting for a failure.
    pub hedging: bool,
    /// The retries come from a default because the field is absent.
    pub defaulted: bool,
    /// A stormguard layer every listener reaching it carries a call tree's context on
    /// (`tree = "root"` or `"trust"`): its retries and those of the tree layers below it on a
    /// path come out of one allowance.
    pub tree: Option<TreeLayer>,
}

/// How a stormguard layer carries a call tree ([`Layer::tree`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TreeLayer {
    /// The smallest `tree_allowance` of the listeners reaching it, in thousandths.
    pub allowance: u32,
    /// A listener reaching it starts a new tree (`root`): the allowance starts over here.
    pub root: bool,
}

impl Layer {
    /// A layer with no retries, to fill in.
    pub fn new(format: Format, location: Location, resource: String) -> Layer {
        Layer {
            format,
            location,
            resource,
            refs: Vec::new(),
            attempts: Some(1),
            budget: None,
            per_try_timeout: None,
            timeout: None,
            retry_on: Vec::new(),
            methods: Methods::Any,
            hedging: false,
            defaulted: false,
            tree: None,
        }
    }

    /// Whether this layer can send more than one attempt.
    pub fn retries(&self) -> bool {
        self.attempts != Some(1)
    }

    /// The worst-case factor this layer multiplies attempts by: its attempts, capped by its
    /// budget's factor. Infinite when neither bounds it.
    pub fn factor(&self) -> f64 {
        let attempts = self.attempts.map_or(f64::INFINITY, f64::from);
        match self.budget.and_then(|b| b.max_factor()) {
            Some(cap) => attempts.min(cap),
            None => attempts,
        }
    }

    /// Worst-case time of one call through this layer: `per_try_timeout × attempts`, cut off by
    /// the overall timeout; `None` when neither is known.
    pub fn worst_time(&self) -> Option<Duration> {
        let tries = match (self.per_try_timeout, self.attempts) {
            (Some(p), Some(a)) => Some(p.saturating_mul(a)),
            _ => None,
        };
        match (tries, self.timeout) {
            (Some(t), Some(r)) => Some(t.min(r)),
            (t, r) => t.or(r),
        }
    }
}

/// How bad a finding is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Severity {
    /// Worth knowing.
    Info,
    /// Likely to hurt under failure.
    Warning,
    /// Multiplies load or repeats side effects: fix before the next incident.
    Error,
}

impl Severity {
    /// `info`, `warning` or `error`.
    pub fn as_str(self) -> &'static str {
        match self {
            Severity::Info => "info",
            Severity::Warning => "warning",
            Severity::Error => "error",
        }
    }
}

impl fmt::Display for Severity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A word that is not a [`Severity`]; carries the word, trimmed and lowercased.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown level `{0}` (expected info, warning or error)")]
pub struct UnknownSeverity(pub String);

impl std::str::FromStr for Severity {
    type Err = UnknownSeverity;
    /// `info`, `warning` (or `warn`) or `error`, in any case.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "info" => Ok(Severity::Info),
            "warning" | "warn" => Ok(Severity::Warning),
            "error" => Ok(Severity::Error),
            other => Err(UnknownSeverity(other.to_string())),
        }
    }
}

/// The checks, each with a stable id (used in JSON and as the SARIF rule id).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Rule {
    /// Retries with no budget or throttle bounding them across requests.
    UnbudgetedRetries,
    /// An Envoy cluster without `retry_budget`.
    ClusterWithoutRetryBudget,
    /// Retries on more than one layer of one call path.
    StackedRetries,
    /// Worst-case attempts above `--max-amplification`.
    Amplification,
    /// `per_try_timeout × attempts` exceeds the route timeout.
    TimeoutExceeded,
    /// A non-idempotent method retried after it may have run.
    NonIdempotentRetry,
    /// Retries in force only because a field is absent.
    DefaultRetries,
    /// Hedged requests without a throttle.
    UnthrottledHedging,
    /// A budget above 50 %.
    BudgetTooHigh,
    /// A budget floor larger than the headroom `cap − planned primary`.
    FloorAboveHeadroom,
    /// A value the runtime silently changes (gRPC caps `maxAttempts` at 5).
    ValueCapped,
    /// A retry setting whose value cannot be read (`attempts: "five"`).
    UnreadableValue,
    /// A stormguard config the proxy refuses to start with.
    RefusedConfig,
}

impl Rule {
    /// Every rule, for SARIF's rule table.
    pub const ALL: [Rule; 13] = [
        Rule::UnbudgetedRetries,
        Rule::ClusterWithoutRetryBudget,
        Rule::StackedRetries,
        Rule::Amplification,
        Rule::TimeoutExceeded,
        Rule::NonIdempotentRetry,
        Rule::DefaultRetries,
        Rule::UnthrottledHedging,
        Rule::BudgetTooHigh,
        Rule::FloorAboveHeadroom,
        Rule::ValueCapped,
        Rule::UnreadableValue,
        Rule::RefusedConfig,
    ];

    /// The stable id.
    pub fn id(self) -> &'static str {
        match self {
            Rule::UnbudgetedRetries => "unbudgeted-retries",
            Rule::ClusterWithoutRetryBudget => "cluster-without-retry-budget",
            Rule::StackedRetries => "stacked-retries",
            Rule::Amplification => "amplification",
            Rule::TimeoutExceeded => "timeout-exceeded",
            Rule::NonIdempotentRetry => "non-idempotent-retry",
            Rule::DefaultRetries => "default-retries",
            Rule::UnthrottledHedging => "unthrottled-hedging",
            Rule::BudgetTooHigh => "budget-too-high",
            Rule::FloorAboveHeadroom => "floor-above-headroom",
            Rule::ValueCapped => "value-capped",
            Rule::UnreadableValue => "unreadable-value",
            Rule::RefusedConfig => "refused-config",
        }
    }

    /// One sentence on what the rule checks.
    pub fn description(self) -> &'static str {
        match self {
            Rule::UnbudgetedRetries => {
                "retries with no budget or throttle bounding them across requests"
            }
            Rule::ClusterWithoutRetryBudget => "an Envoy cluster without a retry_budget",
            Rule::StackedRetries => "retries configured on more than one layer of one call path",
            Rule::Amplification => {
                "worst-case attempts reaching a dependency above the allowed amplification"
            }
            Rule::TimeoutExceeded => "per-try timeout times attempts exceeds the route timeout",
            Rule::NonIdempotentRetry => {
                "a non-idempotent method retried after it may have been executed"
            }
            Rule::DefaultRetries => "retries in force only because a field is absent",
            Rule::UnthrottledHedging => "hedged requests without a retry throttle or budget",
            Rule::BudgetTooHigh => "a retry budget above 50 %",
            Rule::FloorAboveHeadroom => "a budget floor larger than cap minus planned primary",
            Rule::ValueCapped => "a value the runtime silently caps",
            Rule::UnreadableValue => {
                "a retry setting whose value cannot be read (not a number, duration or boolean)"
            }
            Rule::RefusedConfig => "a stormguard config the proxy refuses to start with",
        }
    }
}

/// Something wrong with a config, where it is, and what to do.
#[derive(Debug, Clone, PartialEq)]
pub struct Finding {
    /// How bad.
    pub severity: Severity,
    /// Which check.
    pub rule: Rule,
    /// Where.
    pub location: Location,
    /// What it concerns: a cluster, route, VirtualService, method or call path.
    pub resource: String,
    /// What is wrong, one sentence.
    pub message: String,
    /// What to change, one line.
    pub fix: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn severity_words() {
        assert_eq!(" WARN ".parse::<Severity>(), Ok(Severity::Warning));
        assert_eq!("Error".parse::<Severity>(), Ok(Severity::Error));
        assert_eq!("fatal".parse::<Severity>(), Err(UnknownSeverity("fatal".into())));
        assert_eq!(
            "Fatal".parse::<Severity>().unwrap_err().to_string(),
            "unknown level `fatal` (expected info, warning or error)"
        );
    }
}
