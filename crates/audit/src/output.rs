//! The three views of a report: a table for people, JSON for scripts, SARIF for code scanning.

use serde_json::{Value, json};

use crate::graph::{Factor, PathReport};
use crate::model::{Rule, Severity, trim_float};
use crate::{Report, fmt_duration};

fn factor_json(f: Factor) -> Value {
    match f {
        Factor::Finite { .. } => json!(f.as_f64()),
        Factor::Unbounded => Value::Null,
    }
}

fn factor_text(f: Factor) -> String {
    trim_float(f.as_f64())
}

fn path_json(p: &PathReport) -> Value {
    json!({
        "services": p.services,
        "amplification": factor_json(p.amplification),
        "amplification_fraction": match p.amplification {
            Factor::Finite { num, den } => json!([num as u64, den as u64]),
            Factor::Unbounded => Value::Null,
        },
        "with_tree": p.with_tree.map(|(b, a)| json!({
            "amplification": factor_json(b),
            "allowance": factor_json(a),
        })),
        "retrying_layers": p.retrying_layers,
        "worst_time_ms": p.worst_time.map(|d| d.as_millis() as u64),
        "hops": p.hops.iter().map(|h| json!({
            "from": h.from,
            "to": h.to,
            "layers": h.layers.iter().map(|(r, f)| json!({"resource": r, "factor": factor_json(*f)})).collect::<Vec<_>>(),
        })).collect::<Vec<_>>(),
    })
}

/// The report as one JSON object: `findings`, `paths`, `summary`.
pub fn to_json(report: &Report) -> Value {
    json!({
        "findings": report.findings.iter().map(|f| json!({
            "severity": f.severity.as_str(),
            "rule": f.rule.id(),
            "file": f.location.file,
            "line": f.location.line,
            "resource": f.resource,
            "message": f.message,
            "fix": f.fix,
        })).collect::<Vec<_>>(),
        "paths": report.paths.iter().map(path_json).collect::<Vec<_>>(),
        "summary": summary_json(report),
    })
}

fn summary_json(report: &Report) -> Value {
    let count = |s: Severity| report.findings.iter().filter(|f| f.severity == s).count();
    json!({
        "files": report.files,
        "documents": report.documents,
        "layers": report.layers.len(),
        "retrying_layers": report.layers.iter().filter(|l| l.retries()).count(),
        "skipped": report.skipped.values().sum::<usize>(),
        "skipped_kinds": report.skipped,
        "errors": count(Severity::Error),
        "warnings": count(Severity::Warning),
        "infos": count(Severity::Info),
    })
}

/// The report as SARIF 2.1.0, one run, one result per finding.
pub fn to_sarif(report: &Report) -> Value {
    let level = |s: Severity| match s {
        Severity::Info => "note",
        Severity::Warning => "warning",
        Severity::Error => "error",
    };
    let rules: Vec<Value> = Rule::ALL
        .iter()
        .map(|r| json!({"id": r.id(), "shortDescription": {"text": r.description()}}))
        .collect();
    let results: Vec<Value> = report
        .findings
        .iter()
        .map(|f| {
            json!({
                "ruleId": f.rule.id(),
                "ruleIndex": Rule::ALL.iter().position(|r| *r == f.rule),
                "level": level(f.severity),
                "message": {"text": format!("{}: {} Fix: {}", f.resource, f.message, f.fix)},
                "locations": [{
                    "physicalLocation": {
                        "artifactLocation": {"uri": f.location.file.replace('\\', "/")},
                        "region": {"startLine": f.location.line.max(1)},
                    },
                    "logicalLocations": [{"name": f.resource}],
                }],
            })
        })
        .collect();
    json!({
        "$schema": "https://json.schemastore.org/sarif-2.1.0.json",
        "version": "2.1.0",
        "runs": [{
            "tool": {"driver": {
                "name": "stormguard-audit",
                "version": env!("CARGO_PKG_VERSION"),
                "rules": rules,
            }},
            "results": results,
        }],
    })
}

/// The report as a plain-text table.
pub fn to_table(report: &Report) -> String {
    let mut out = String::new();
    if report.findings.is_empty() {
        out.push_str("no findings\n");
    } else {
        let rows: Vec<[String; 4]> = report
            .findings
            .iter()
            .map(|f| {
                [
                    f.severity.as_str().to_string(),
                    format!("{}:{}", f.location.file, f.location.line),
                    f.rule.id().to_string(),
                    f.resource.clone(),
                ]
            })
            .collect();
        let headers = ["SEVERITY", "LOCATION", "RULE", "RESOURCE"];
        let mut all = vec![headers.map(str::to_string).to_vec()];
        all.extend(rows.iter().map(|r| r.to_vec()));
        let lines = stormguard_core::format::table(&all, |_| stormguard_core::format::Align::Left);
        out.push_str(&lines[0]);
        out.push('\n');
        for (line, f) in lines[1..].iter().zip(&report.findings) {
            out.push_str(line);
            out.push('\n');
            out.push_str(&format!("    {}\n    fix: {}\n", f.message, f.fix));
        }
    }
    if !report.paths.is_empty() {
        out.push_str("\npaths (worst-case attempts reaching the last service per request):\n");
        for p in &report.paths {
            let factors: Vec<String> = p
                .hops
                .iter()
                .map(|h| {
                    let fs: Vec<String> = h.layers.iter().map(|(_, f)| factor_text(*f)).collect();
                    if fs.is_empty() { "1".to_string() } else { fs.join("×") }
                })
                .collect();
            let time = p.worst_time.map_or_else(|| "unbounded".to_string(), fmt_duration);
            out.push_str(&format!(
                "  {}: {} = {} attempts, worst-case time {}\n",
                p.services.join(" → "),
                factors.join(" × "),
                factor_text(p.amplification),
                time
            ));
            if let Some((bounded, allowance)) = p.with_tree {
                out.push_str(&format!(
                    "    with the call tree's context (allowance {}): {} attempts, not the per-hop product\n",
                    factor_text(allowance),
                    factor_text(bounded),
                ));
            }
        }
    }
    let count = |s: Severity| report.findings.iter().filter(|f| f.severity == s).count();
    let skipped: usize = report.skipped.values().sum();
    let plural = |n: usize, one: &str| format!("{n} {one}{}", if n == 1 { "" } else { "s" });
    let mut summary = format!(
        "\n{}, {}, {}; {}, {}, {} info",
        plural(report.files, "file"),
        plural(report.documents, "document"),
        plural(report.layers.iter().filter(|l| l.retries()).count(), "retry layer"),
        plural(count(Severity::Error), "error"),
        plural(count(Severity::Warning), "warning"),
        count(Severity::Info)
    );
    if skipped > 0 {
        let kinds: Vec<String> = report.skipped.iter().map(|(k, n)| format!("{k} {n}")).collect();
        summary.push_str(&format!("; skipped {skipped} ({})", kinds.join(", ")));
    }
    out.push_str(&summary);
    out.push('\n');
    out
}
