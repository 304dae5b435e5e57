//! stormguard's own config (`[[listener]]`, `[[dependency]]`, `[[route]]` TOML), read by the
//! proxy's own reader ([`ProxyConfig::read`]): the same keys, defaults and rules, so a file the
//! proxy refuses is an error finding here (`refused-config`, with the proxy's line, column, key
//! path and reason), and a file it accepts is audited as the proxy would run it. The TLS files
//! a config names are not read: the audit need not run where they are.
//!
//! **Attempt semantics.** `max_retries` counts *retries* (default 2, at most 10): up to
//! `max_retries + 1` tries. Every dependency has a budget — `budget` (a SPEC string or a table
//! with `kind`), default `ratio` at 20 % — so it caps the factor; `per_try_timeout` is the
//! per-try timeout and `deadline` the overall one. The floor check compares the floor with
//! `cap − planned_primary` (`planned_primary` 0 when absent). Absent keys take the proxy's own
//! defaults (`stormguard_core::defaults`).

use stormguard_config::{Document, FileError, KeyPath, Problem};
use stormguard_core::budget::BudgetSpec;
use stormguard_proxy_config::ProxyConfig;

use crate::formats::conditions;
use crate::model::{Budget, Format, Layer, Location, Rule, Severity, pct};
use crate::{AuditError, Collector};

/// Reads a TOML file: stormguard config when it has `[[dependency]]` or `[[listener]]` tables,
/// otherwise skipped as `toml`.
pub(crate) fn read(c: &mut Collector, file: &str, text: &str) -> Result<(), AuditError> {
    // Text that is not TOML at all is an input error, with its position.
    let doc = Document::parse(text, file).map_err(|e| syntax(file, e))?;
    c.documents += 1;
    // Other TOML may use the same names differently (a simulator scenario's single
    // `[dependency]` table, a chaos script): only arrays of tables make a stormguard config.
    let array = |key: &str| doc.has(&KeyPath::root().key(key).index(0));
    if !array("dependency") && !array("listener") {
        c.skip("toml");
        return Ok(());
    }
    let line = |key: &KeyPath| {
        stormguard_core::text::line_col(text, doc.span(key).start).0.try_into().unwrap_or(u32::MAX)
    };
    let loc = |key: &KeyPath| Location { file: file.to_string(), line: line(key) };
    let config = match ProxyConfig::read(&doc) {
        Ok(config) => config,
        Err(e) => {
            let (at, key, problem) = match &e {
                FileError::Invalid { line, key, problem, .. } => {
                    (*line, key.to_string(), problem.to_string())
                }
                other => (1, String::new(), other.to_string()),
            };
            c.finding(
                Severity::Error,
                Rule::RefusedConfig,
                Location { file: file.to_string(), line: at.try_into().unwrap_or(u32::MAX) },
                if key.is_empty() { "stormguard config".to_string() } else { key.clone() },
                format!("the proxy refuses this file: {key}: {problem}"),
                format!("fix the value; `stormguard check-config {file}` says the same"),
            );
            return Ok(());
        }
    };
    for (i, d) in config.dependencies.iter().enumerate() {
        let here = KeyPath::root().key("dependency").index(i);
        let resource = format!("dependency {}", d.name);
        let budget_loc = loc(&here.clone().key("budget"));
        let mut layer =
            Layer::new(Format::Stormguard, loc(&here.clone().key("name")), resource.clone());
        layer.refs.push(format!("stormguard/{}", d.name));
        layer.refs.push(format!("dependency/{}", d.name));
        layer.attempts = Some(d.max_retries.saturating_add(1));
        layer.tree = tree_layer(&config, &d.name);
        layer.retry_on = conditions(&d.retry_on.to_string());
        layer.per_try_timeout = d.per_try_timeout;
        layer.timeout = d.deadline;
        let (budget, percent, floor) = model_budget(&d.budget);
        layer.budget = Some(budget);
        if let Some(p) = percent
            && crate::model::budget_too_high(p)
        {
            c.finding(
                Severity::Warning,
                Rule::BudgetTooHigh,
                budget_loc.clone(),
                resource.clone(),
                format!("budget percent {} is above 50 % (factor up to {})", pct(p), crate::model::trim_float(budget.max_factor().unwrap_or(f64::INFINITY))),
                "keep percent at or below 0.5 (0.2 is the default; 0.25 is the worked example's headroom)",
            );
        }
        if let Some(floor) = floor {
            let (cap, primary) = (d.cap, d.planned_primary.unwrap_or(0));
            let headroom = cap.saturating_sub(primary);
            if floor > headroom {
                c.finding(
                    Severity::Error,
                    Rule::FloorAboveHeadroom,
                    budget_loc.clone(),
                    resource.clone(),
                    format!("budget floor {floor} concurrent retries is above cap − planned primary = {cap} − {primary} = {headroom}"),
                    format!("lower the floor (min or slots) to at most {headroom}"),
                );
            }
        }
        c.layers.push(layer);
    }
    for (i, r) in config.routes.iter().enumerate() {
        let Some(spec) = &r.budget else { continue };
        if let (_, Some(p), _) = model_budget(spec)
            && crate::model::budget_too_high(p)
        {
            c.finding(
                Severity::Warning,
                Rule::BudgetTooHigh,
                loc(&KeyPath::root().key("route").index(i).key("budget")),
                format!("route to {}", r.dependency),
                format!("route budget percent {} is above 50 %", pct(p)),
                "keep percent at or below 0.5",
            );
        }
    }
    Ok(())
}

/// A file that is not TOML: the input error every reader gives.
fn syntax(file: &str, e: FileError) -> AuditError {
    match e {
        FileError::Invalid { line, column, problem: Problem::Syntax(reason), .. } => {
            AuditError::Syntax {
                file: file.to_string(),
                line: line.try_into().unwrap_or(u32::MAX),
                column: column.try_into().unwrap_or(u32::MAX),
                reason,
            }
        }
        other => AuditError::Invalid { file: file.to_string(), line: 1, reason: other.to_string() },
    }
}

/// The model budget, its percent (when it has one) and its floor in concurrent retries (when it
/// has one).
pub(crate) fn model_budget(spec: &BudgetSpec) -> (Budget, Option<f64>, Option<u64>) {
    match spec {
        BudgetSpec::Ratio(r) => {
            let p = r.percent.as_f64();
            (Budget::Ratio { percent: p }, Some(p), None)
        }
        BudgetSpec::Concurrency(cc) => match cc.slots {
            Some(n) => (Budget::Slots(n), None, Some(n)),
            None => {
                let p = cc.percent.as_f64();
                (Budget::Concurrency { percent: p }, Some(p), Some(cc.min))
            }
        },
        BudgetSpec::TokenBucket(t) => {
            (Budget::TokenBucket { token_ratio: t.token_ratio_milli as f64 / 1000.0 }, None, None)
        }
        BudgetSpec::Quota(q) => (
            Budget::Quota { reward: q.success_reward as f64, cost: q.retry_cost as f64 },
            None,
            None,
        ),
    }
}

/// How dependency `name` carries a call tree: only when every listener that reaches it (its
/// default dependency, or every listener when a route names it) starts or trusts one; with the
/// smallest allowance among them, and `root` when one of them starts a new tree.
fn tree_layer(config: &ProxyConfig, name: &str) -> Option<crate::model::TreeLayer> {
    use stormguard_proxy_config::TreeMode;
    let routed = config.routes.iter().any(|r| r.dependency == name);
    let reaching: Vec<_> = config
        .listeners
        .iter()
        .filter(|l| routed || l.dependency.as_deref() == Some(name))
        .collect();
    if reaching.is_empty() || reaching.iter().any(|l| l.tree == TreeMode::Off) {
        return None;
    }
    Some(crate::model::TreeLayer {
        allowance: reaching.iter().map(|l| l.tree_allowance.0).min()?,
        root: reaching.iter().any(|l| l.tree == TreeMode::Root),
    })
}
