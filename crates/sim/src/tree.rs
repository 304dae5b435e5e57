//! A call tree: a chain of hops, each a placement with its own budget, the last calling a
//! dependency that fails. `stormguard simulate --builtin call-tree` (or a scenario file with a
//! `[call_tree]` table) runs it.
//!
//! Each hop runs core's request life ([`Life`]) with its own [`RetryPolicy`] — the decision,
//! the budget, admission — and, for a policy with an `allowance`, a [`TreeLedger`] and the
//! context ([`stormguard_core::tree`]) carried down: a retry tells the hops below, and each
//! hop charges its retries to the tree as well as to its budget. With `stand_down` (the
//! default with an allowance), an answer a hop refused for load goes up as "do not retry"
//! (what a sidecar that is both a service's way in and its way out does, `x-stormguard-tree:
//! overloaded`); without it, each service answers its caller in its own words and the hop above
//! sees a plain failure. Without an allowance, the hops multiply: three 20 % budgets give
//! `1.2³ ≈ 1.73` attempts per user action at the dependency.
//!
//! The model has no latency: each user action's attempts run at its arrival time (backoff and
//! service times do not change who is charged what), and the budgets' and the ledger's windows
//! turn on that clock. Same seed, same result.

use std::collections::BTreeMap;
use std::io::{self, Write};
use std::sync::Arc;
use std::time::Duration;

use serde::Deserialize;
use stormguard_config::{Document, KeyPath};
use stormguard_core::budget::BudgetSpec;
use stormguard_core::clock::{ManualClock, Timestamp};
use stormguard_core::conditions::AttemptFailure;
use stormguard_core::decision::{FailedAttempt, RequestFacts, RetryConfig, RetryPolicy, Upstream};
use stormguard_core::dist::unit;
use stormguard_core::life::{AttemptId, Gates, Life, Next};
use stormguard_core::limiter::LimiterConfig;
use stormguard_core::random::SplitMix64;
use stormguard_core::scope::Scope;
use stormguard_core::tree::{Allowance, TreeContext, TreeLedger};
use stormguard_core::{Denied, backoff::Pushback};

use crate::ScenarioError;

/// A call-tree scenario, as its file says.
#[derive(Debug, Clone, PartialEq)]
pub struct CallTree {
    /// Its name.
    pub name: String,
    /// What it shows.
    pub description: String,
    /// The draws' seed.
    pub seed: u64,
    /// How long user actions arrive.
    pub duration: Duration,
    /// User actions per second at the edge.
    pub rate: f64,
    /// Hops that retry; each calls the next, the last calls the dependency.
    pub hops: usize,
    /// The fraction of the dependency's answers that fail.
    pub error_rate: f64,
    /// Each service's own failures, by hop (the service hop `k` calls; missing: none).
    pub service_error_rate: Vec<f64>,
    /// The policies compared, each run on the same draws.
    pub policies: Vec<TreePolicy>,
}

/// Every hop's rules under one policy.
#[derive(Debug, Clone, PartialEq)]
pub struct TreePolicy {
    /// Its name.
    pub name: String,
    /// Each hop's retry budget.
    pub budget: BudgetSpec,
    /// Each hop's retries per request.
    pub retries: u32,
    /// The tree's allowance (attempts per user action at any dependency), or none: no context.
    pub allowance: Option<Allowance>,
    /// Whether an answer a hop refused for load goes up as "do not retry".
    pub stand_down: bool,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    name: Option<String>,
    description: Option<String>,
    seed: Option<u64>,
    #[serde(default, deserialize_with = "stormguard_config::de::option_duration")]
    duration: Option<Duration>,
    rate: Option<f64>,
    call_tree: TreeFile,
    #[serde(default)]
    policy: Vec<PolicyFile>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct TreeFile {
    hops: Option<usize>,
    error_rate: Option<f64>,
    #[serde(default)]
    service_error_rate: Vec<f64>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct PolicyFile {
    name: String,
    #[serde(default, deserialize_with = "stormguard_config::de::option_from_str")]
    budget: Option<BudgetSpec>,
    retries: Option<u32>,
    #[serde(default, deserialize_with = "option_allowance")]
    allowance: Option<Allowance>,
    stand_down: Option<bool>,
}

fn option_allowance<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<Allowance>, D::Error> {
    stormguard_config::de::from_number_or_str(d).map(Some)
}

/// Whether a scenario file's text is a call tree (it has a `[call_tree]` table).
pub fn is_call_tree(text: &str, origin: &str) -> bool {
    Document::parse(text, origin).is_ok_and(|d| d.has(&KeyPath::root().key("call_tree")))
}

impl CallTree {
    /// Reads a call-tree scenario; an error names the file, line, column and key.
    pub fn parse(origin: &str, text: &str) -> Result<CallTree, ScenarioError> {
        let doc = Document::parse(text, origin)?;
        let f: File = doc.deserialize()?;
        let at = |k: &str| KeyPath::root().key("call_tree").key(k);
        let hops = f.call_tree.hops.unwrap_or(3);
        if !(1..=10).contains(&hops) {
            return Err(doc.error(at("hops"), "must be 1 to 10"));
        }
        let rate_ok = |r: f64| (0.0..=1.0).contains(&r);
        let error_rate = f.call_tree.error_rate.unwrap_or(0.4);
        if !rate_ok(error_rate) {
            return Err(doc.error(at("error_rate"), "must be 0 to 1"));
        }
        if f.call_tree.service_error_rate.len() > hops
            || !f.call_tree.service_error_rate.iter().all(|r| rate_ok(*r))
        {
            return Err(doc.error(at("service_error_rate"), "one rate (0 to 1) per hop at most"));
        }
        let rate = f.rate.unwrap_or(100.0);
        if !(rate > 0.0 && rate <= 100_000.0) {
            return Err(doc.error(KeyPath::root().key("rate"), "must be above 0, at most 100000"));
        }
        let duration = f.duration.unwrap_or(Duration::from_secs(60));
        if duration.is_zero() || duration > Duration::from_secs(3600) {
            return Err(doc.error(KeyPath::root().key("duration"), "must be above 0, at most 1h"));
        }
        if f.policy.is_empty() {
            return Err(doc.error(KeyPath::root().key("policy"), "at least one [[policy]]"));
        }
        let policies = f
            .policy
            .into_iter()
            .map(|p| TreePolicy {
                budget: p.budget.unwrap_or_default(),
                retries: p.retries.unwrap_or(2),
                stand_down: p.stand_down.unwrap_or(p.allowance.is_some()),
                allowance: p.allowance,
                name: p.name,
            })
            .collect();
        Ok(CallTree {
            name: f.name.unwrap_or_else(|| "call-tree".into()),
            description: f.description.unwrap_or_default(),
            seed: f.seed.unwrap_or(0),
            duration,
            rate,
            hops,
            error_rate,
            service_error_rate: f.call_tree.service_error_rate,
            policies,
        })
    }
}

/// What one policy came to.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct TreeResult {
    /// The policy's name.
    pub name: String,
    /// User actions.
    pub actions: u64,
    /// Attempts per user action each hop sent to what it calls (the next hop's service; the
    /// last hop's: the dependency).
    pub attempts_per_action: Vec<f64>,
    /// Retries each hop sent.
    pub retries: Vec<u64>,
    /// Retries refused, by reason, all hops together.
    pub refused: BTreeMap<&'static str, u64>,
    /// The fraction of user actions that succeeded.
    pub succeeded: f64,
}

/// The results, policy by policy.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct TreeReport {
    /// The scenario's name.
    pub scenario: String,
    /// Hops.
    pub hops: usize,
    /// What the budgets allow at the dependency per user action, multiplied over the hops:
    /// `∏ (1 + share)` for the first policy's ratio budget (the audit's per-hop product).
    pub per_hop_product: Option<f64>,
    /// One result per policy.
    pub policies: Vec<TreeResult>,
}

/// One hop's rules and state.
struct Hop {
    policy: RetryPolicy,
    upstream: Upstream,
    ledger: TreeLedger,
    attempts: u64,
}

impl Gates for Hop {
    type Booking = ();
    fn policy(&self) -> &RetryPolicy {
        &self.policy
    }
    fn upstream(&self, _: usize) -> &Upstream {
        &self.upstream
    }
    fn book_now(&self, _: usize, _: Timestamp) -> Result<Option<()>, Denied> {
        Ok(None)
    }
    fn refund(&self, _: (), _: Timestamp) {}
}

/// How an attempt at a hop's dependency ended, as the hop sees it.
#[derive(Clone, Copy)]
enum Answer {
    Ok,
    /// A failure; `stand_down`: it says "do not retry".
    Failed {
        stand_down: bool,
    },
}

struct Chain<'a> {
    sc: &'a CallTree,
    p: &'a TreePolicy,
    hops: Vec<Hop>,
    refused: BTreeMap<&'static str, u64>,
    rng: SplitMix64,
}

impl Chain<'_> {
    /// A request of `ctx` at hop `h` (the service above it called): its life to its answer.
    fn call(&mut self, h: usize, ctx: Option<TreeContext>, now: Timestamp) -> Answer {
        if h == self.hops.len() {
            return match unit(&mut self.rng) < self.sc.error_rate {
                true => Answer::Failed { stand_down: false },
                false => Answer::Ok,
            };
        }
        let hop = &self.hops[h];
        hop.policy.on_admitted_in(now, ctx.as_ref().map(|c| (&hop.ledger, c)));
        let scopes: Vec<Scope> = ctx.iter().map(|_| Scope::Tree(hop.ledger.clone())).collect();
        let mut life = Life::new(RequestFacts::idempotent(), scopes, 0).with_tree(ctx);
        // The first try carries the context as it came; each extra, what its life gave it.
        let (mut id, mut below) = (AttemptId::FIRST, ctx);
        loop {
            self.hops[h].attempts += 1;
            let answer = match self.sc.service_error_rate.get(h).copied().unwrap_or(0.0) {
                own if own > 0.0 && unit(&mut self.rng) < own => {
                    Answer::Failed { stand_down: false }
                }
                // The service calls the next hop and answers in its own words: a stand-down
                // below reaches this hop only when the sidecar passes it up.
                _ => match self.call(h + 1, below, now) {
                    Answer::Ok => Answer::Ok,
                    Answer::Failed { stand_down } => {
                        Answer::Failed { stand_down: stand_down && self.p.stand_down }
                    }
                },
            };
            let hop = &self.hops[h];
            let failed = match answer {
                Answer::Ok => {
                    life.succeeded(&hop.policy, || now, id);
                    return Answer::Ok;
                }
                Answer::Failed { stand_down } => FailedAttempt {
                    failure: AttemptFailure::Status(502),
                    unsent: false,
                    pushback: stand_down.then_some(Pushback::DontRetry),
                },
            };
            let reason = match life.failed(hop, now, id, &failed, &mut self.rng) {
                Next::Answer(reason) => reason,
                Next::Retry { .. } => match life.wait_elapsed(hop, now) {
                    Ok(admitted) => {
                        (id, below) = (admitted.id, admitted.tree);
                        continue;
                    }
                    Err(reason) => Some(reason),
                },
            };
            if let Some(r) = reason {
                *self.refused.entry(r.as_str()).or_default() += 1;
            }
            return Answer::Failed { stand_down: reason.is_some_and(Denied::stands_down) };
        }
    }
}

/// Runs every policy of `sc` on the same draws.
pub fn run(sc: &CallTree) -> TreeReport {
    let actions = (sc.duration.as_secs_f64() * sc.rate).round() as u64;
    let policies = sc
        .policies
        .iter()
        .map(|p| {
            let clock = ManualClock::new();
            let hops = (0..sc.hops)
                .map(|_| {
                    let config = RetryConfig { max_retries: p.retries, ..RetryConfig::default() };
                    let budget = p.budget.build().expect("a validated budget");
                    let cap = LimiterConfig { cap: 1024, queue_len: 0, ..Default::default() };
                    Hop {
                        policy: RetryPolicy::with_budget(config, budget).expect("valid rules"),
                        upstream: Upstream::new(cap, None, Arc::new(clock.clone()))
                            .expect("a valid cap"),
                        ledger: TreeLedger::default(),
                        attempts: 0,
                    }
                })
                .collect();
            let mut chain =
                Chain { sc, p, hops, refused: BTreeMap::new(), rng: SplitMix64::new(sc.seed) };
            let mut ok = 0;
            for i in 0..actions {
                let now = Timestamp::from_nanos((i as f64 * 1e9 / sc.rate) as u64);
                clock.set(now);
                let ctx = p.allowance.map(|a| TreeContext::root(a, i));
                ok += u64::from(matches!(chain.call(0, ctx, now), Answer::Ok));
            }
            let per = |n: u64| n as f64 / actions.max(1) as f64;
            let attempts: Vec<f64> = chain.hops.iter().map(|h| per(h.attempts)).collect();
            TreeResult {
                name: p.name.clone(),
                actions,
                attempts_per_action: attempts,
                retries: chain
                    .hops
                    .iter()
                    .map(|h| h.policy.counters().snapshot().retries)
                    .collect(),
                refused: chain.refused,
                succeeded: per(ok),
            }
        })
        .collect();
    let per_hop_product = sc.policies.first().and_then(|p| match &p.budget {
        BudgetSpec::Ratio(r) => Some((1.0 + r.percent.as_f64()).powi(sc.hops as i32)),
        _ => None,
    });
    TreeReport { scenario: sc.name.clone(), hops: sc.hops, per_hop_product, policies }
}

impl TreeReport {
    /// The side-by-side table.
    pub fn write_table(&self, out: &mut dyn Write) -> io::Result<()> {
        let w = self.policies.iter().map(|p| p.name.len()).max().unwrap_or(0).max(10);
        write!(out, "{:44}", self.scenario)?;
        for p in &self.policies {
            write!(out, "  {:>w$}", p.name)?;
        }
        writeln!(out)?;
        let row = |out: &mut dyn Write, label: &str, cell: &dyn Fn(&TreeResult) -> String| {
            write!(out, "{label:44}")?;
            for p in &self.policies {
                write!(out, "  {:>w$}", cell(p))?;
            }
            writeln!(out)
        };
        for k in 0..self.hops {
            let label = match k + 1 == self.hops {
                true => format!("attempts per action at the dependency (hop {})", k + 1),
                false => format!("attempts per action sent by hop {}", k + 1),
            };
            row(out, &label, &|p| format!("{:.3}", p.attempts_per_action[k]))?;
        }
        for k in 0..self.hops {
            row(out, &format!("retries sent by hop {}", k + 1), &|p| p.retries[k].to_string())?;
        }
        let mut reasons: Vec<&str> =
            self.policies.iter().flat_map(|p| p.refused.keys().copied()).collect();
        reasons.sort_unstable();
        reasons.dedup();
        for r in reasons {
            row(out, &format!("retries refused: {r}"), &|p| {
                p.refused.get(r).copied().unwrap_or(0).to_string()
            })?;
        }
        row(out, "user actions that succeeded", &|p| format!("{:.1} %", p.succeeded * 100.0))?;
        if let Some(x) = self.per_hop_product {
            writeln!(
                out,
                "\nthe budgets' per-hop product: {x:.3} attempts per action at the dependency"
            )?;
        }
        Ok(())
    }

    /// The report as JSON.
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("plain data serializes") + "\n"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_builtin_reads_and_a_bad_key_is_named() {
        let sc = CallTree::parse("call-tree", crate::builtin::text("call-tree").unwrap()).unwrap();
        assert_eq!(sc.hops, 3);
        let e = CallTree::parse("x.toml", "[call_tree]\nhops = 40\n[[policy]]\nname = \"a\"\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("x.toml") && e.contains("call_tree.hops"), "{e}");
        assert!(is_call_tree("[call_tree]\n", "x") && !is_call_tree("[fleet]\n", "x"));
    }
}
