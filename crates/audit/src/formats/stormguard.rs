//! stormguard's own config (`[[listener]]`, `[[dependency]]`, `[[route]]` TOML).
//!
//! **Attempt semantics.** `max_retries` counts *retries* (default 2, at most 10): up to
//! `max_retries + 1` tries. Every dependency has a budget — `budget` (a SPEC string or a table
//! with `kind`), default `ratio` at 20 % — so it caps the factor; `per_try_timeout` is the
//! per-try timeout and `deadline` the overall one. Keys this reader does not know are ignored,
//! so it keeps working as the proxy grows. The floor check compares the floor with `cap −
//! planned_primary` (`planned_primary` 0 when absent). Absent keys take the proxy's own
//! defaults, read from `stormguard_core::defaults` (cap 20, `max_retries` 2, `retry_on`
//! `5xx,reset,connect-failure,refused-stream,timeout`, the ratio budget at 20 %).

use serde::Deserialize;
use stormguard_core::budget::BudgetSpec;
use stormguard_core::defaults;
use toml::Spanned;

use crate::formats::conditions;
use crate::model::{Budget, Format, Layer, Location, Rule, Severity, pct};
use crate::{AuditError, Collector};

#[derive(Deserialize)]
struct RawFile {
    #[serde(default)]
    dependency: Vec<Spanned<RawDependency>>,
    #[serde(default)]
    route: Vec<Spanned<RawRoute>>,
    #[serde(default)]
    listener: Vec<toml::Value>,
}

#[derive(Deserialize)]
struct RawDependency {
    name: Spanned<String>,
    cap: Option<u64>,
    planned_primary: Option<u64>,
    budget: Option<Spanned<toml::Value>>,
    max_retries: Option<u32>,
    retry_on: Option<String>,
    per_try_timeout: Option<Spanned<String>>,
    deadline: Option<Spanned<String>>,
}

#[derive(Deserialize)]
struct RawRoute {
    dependency: Option<String>,
    budget: Option<Spanned<toml::Value>>,
}

struct Lines(Vec<usize>);

impl Lines {
    fn new(text: &str) -> Lines {
        Lines(text.match_indices('\n').map(|(i, _)| i).collect())
    }
    /// The 1-based line holding byte `offset`.
    fn line(&self, offset: usize) -> u32 {
        (self.0.partition_point(|&nl| nl < offset) + 1) as u32
    }
}

/// Reads a TOML file: stormguard config when it has `[[dependency]]` or `[[listener]]` tables,
/// otherwise skipped as `toml`.
pub(crate) fn read(c: &mut Collector, file: &str, text: &str) -> Result<(), AuditError> {
    // Other TOML may use the same names differently (a simulator scenario's single
    // `[dependency]` table, a chaos script): only arrays of tables make a stormguard config.
    // Text that is not TOML at all falls through to the error below, with its position.
    if let Ok(table) = toml::from_str::<toml::Table>(text)
        && !["dependency", "listener"]
            .iter()
            .any(|k| table.get(*k).is_some_and(toml::Value::is_array))
    {
        c.documents += 1;
        c.skip("toml");
        return Ok(());
    }
    let lines = Lines::new(text);
    let raw: RawFile = toml::from_str(text).map_err(|e| {
        let offset = e.span().map_or(0, |s| s.start);
        let line = lines.line(offset);
        let column =
            text[..offset.min(text.len())].rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
        AuditError::Syntax {
            file: file.to_string(),
            line,
            column: column as u32,
            reason: e.message().to_string(),
        }
    })?;
    c.documents += 1;
    if raw.dependency.is_empty() && raw.listener.is_empty() {
        c.skip("toml");
        return Ok(());
    }
    let loc = |offset: usize| Location { file: file.to_string(), line: lines.line(offset) };
    for dep in &raw.dependency {
        let start = dep.span().start;
        let d = dep.get_ref();
        let name = d.name.get_ref().clone();
        let resource = format!("dependency {name}");
        let spec = match &d.budget {
            None => BudgetSpec::default(),
            Some(b) => spec(b.get_ref()).map_err(|reason| AuditError::Invalid {
                file: file.to_string(),
                line: lines.line(b.span().start),
                reason: format!("dependency {name}: budget: {reason}"),
            })?,
        };
        let budget_loc = d.budget.as_ref().map_or_else(|| loc(start), |b| loc(b.span().start));
        let mut layer = Layer::new(Format::Stormguard, loc(d.name.span().start), resource.clone());
        layer.refs.push(format!("stormguard/{name}"));
        layer.refs.push(format!("dependency/{name}"));
        layer.attempts = Some(d.max_retries.unwrap_or(defaults::MAX_RETRIES).saturating_add(1));
        layer.retry_on = conditions(d.retry_on.as_deref().unwrap_or(defaults::RETRY_ON));
        // A duration that does not parse is a finding (the proxy refuses the file), not None.
        let mut duration = |key: &str, v: &Option<Spanned<String>>| {
            let v = v.as_ref()?;
            let parsed = stormguard_core::decimal::parse_duration(v.get_ref());
            if let Err(e) = &parsed {
                c.finding(
                    Severity::Error,
                    Rule::UnreadableValue,
                    loc(v.span().start),
                    resource.clone(),
                    format!(
                        "`{key} = {:?}` is not a duration ({e}): the proxy refuses this file, and \
                         this audit reads the setting as if it were absent",
                        v.get_ref()
                    ),
                    format!("write a duration, e.g. `{key} = \"300ms\"`"),
                );
            }
            parsed.ok()
        };
        layer.per_try_timeout = duration("per_try_timeout", &d.per_try_timeout);
        layer.timeout = duration("deadline", &d.deadline);
        let (budget, percent, floor) = model_budget(&spec);
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
            let cap = d.cap.unwrap_or(defaults::CAP);
            let primary = d.planned_primary.unwrap_or(0);
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
    for route in &raw.route {
        let r = route.get_ref();
        let Some(b) = &r.budget else { continue };
        let spec = spec(b.get_ref()).map_err(|reason| AuditError::Invalid {
            file: file.to_string(),
            line: lines.line(b.span().start),
            reason: format!("route budget: {reason}"),
        })?;
        if let (_, Some(p), _) = model_budget(&spec)
            && crate::model::budget_too_high(p)
        {
            c.finding(
                Severity::Warning,
                Rule::BudgetTooHigh,
                loc(b.span().start),
                format!("route to {}", r.dependency.as_deref().unwrap_or("?")),
                format!("route budget percent {} is above 50 %", pct(p)),
                "keep percent at or below 0.5",
            );
        }
    }
    Ok(())
}

fn spec(v: &toml::Value) -> Result<BudgetSpec, String> {
    let text = match v {
        toml::Value::String(s) => s.clone(),
        toml::Value::Table(t) => {
            let kind =
                t.get("kind").and_then(toml::Value::as_str).ok_or("a budget table needs kind")?;
            let params: Vec<String> = t
                .iter()
                .filter(|(k, _)| k.as_str() != "kind")
                .map(|(k, val)| match val {
                    toml::Value::String(s) => format!("{k}={s}"),
                    other => format!("{k}={other}"),
                })
                .collect();
            format!("{kind}:{}", params.join(","))
        }
        _ => return Err("expected a SPEC string or a table".into()),
    };
    BudgetSpec::parse(&text).map_err(|e| e.to_string())
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
