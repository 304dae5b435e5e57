//! A config that cannot work is refused, and the configs stormguard prints or documents work:
//!
//! - the README's fleet example passes `check-config`, and the same example with a fallback
//!   share of 0 (`fleet_cap` left at its default for 50 instances) exits 2 naming the file,
//!   line, column and key;
//! - every budget SPEC `stormguard plan` prints, for a range of `--cap`, `--primary`, `--floor`
//!   and `--error-rate`, passes `stormguard audit`'s checks with no finding, and the config
//!   `plan --format toml` prints passes both `check-config` and `audit`. The raw arithmetic (a
//!   floor above the headroom, a percent past 50 %) is flagged, so the check can fail.

use crate::support;

use clap::Parser;
use predicates::prelude::*;
use serde_json::Value;
use stormguard::Cli;
use stormguard_audit::{AuditOptions, Rule, audit_sources};
use stormguard_proxy::config::ProxyConfig;
use support::{stormguard, write};

/// The README's TOML block under its fleet heading.
fn readme_fleet_example() -> String {
    let readme = include_str!("../../../../README.md");
    let section = &readme[readme.find("## A fleet").expect("the README's fleet section")..];
    let start = section.find("```toml\n").expect("a TOML example") + "```toml\n".len();
    let len = section[start..].find("```").unwrap();
    section[start..start + len].to_string()
}

#[test]
fn the_readmes_fleet_example_passes_check_config() {
    let text = readme_fleet_example();
    assert!(text.contains("placement = \"fleet\""), "{text}");
    let path = write("readme-fleet.toml", &text);
    stormguard()
        .args(["check-config", path.to_str().unwrap()])
        .assert()
        .success()
        .stdout(predicate::str::contains("ok (1 listener(s), 1 dependency, 0 route(s))"));
}

#[test]
fn a_fleet_whose_fallback_share_is_zero_is_refused_with_the_fix() {
    // The README's example as it was: 20 slots for 50 instances, 0 each without Redis.
    let text: String = readme_fleet_example()
        .lines()
        .filter(|l| !l.starts_with("fleet_cap"))
        .map(|l| format!("{l}\n"))
        .collect();
    let line = text.lines().position(|l| l.starts_with("max_instances")).unwrap() + 1;
    let path = write("share-zero.toml", &text);
    let file = path.display().to_string();
    stormguard().args(["check-config", &file]).assert().code(2).stderr(
        predicate::str::contains(format!(
            "{file}:{line}:17: dependency[0].max_instances: the fallback share \
             floor(fleet_cap (default: cap) / max_instances) = floor(20 / 50) is 0"
        ))
        .and(predicate::str::contains("Set fleet_cap to the whole fleet's cap (at least 50)"))
        .and(predicate::str::contains("or set fallback_min")),
    );
    // Saying what happens without Redis is accepted: a floor per instance, or none on purpose.
    for fallback in ["fallback_min = 1", "fallback_min = 0"] {
        let path = write("share-zero-fixed.toml", &format!("{text}{fallback}\n"));
        stormguard().args(["check-config", path.to_str().unwrap()]).assert().success();
    }
}

/// Runs `stormguard plan ARGS` in-process; returns its output.
fn plan(args: &[String]) -> String {
    let cli = Cli::try_parse_from(
        ["stormguard", "plan"].iter().map(|s| s.to_string()).chain(args.iter().cloned()),
    )
    .unwrap();
    let mut out = Vec::new();
    stormguard::run(cli, &mut out).unwrap_or_else(|e| panic!("plan {args:?}: {}", e.message));
    String::from_utf8(out).unwrap()
}

/// A stormguard config with this cap, planned primary and budget, as a user pastes a SPEC.
fn config_with(cap: u64, primary: u64, spec: &str) -> String {
    format!(
        "[[listener]]\nlisten = \"127.0.0.1:8080\"\ndependency = \"d\"\n\n[[dependency]]\n\
         name = \"d\"\nupstreams = [\"http://127.0.0.1:9000\"]\ncap = {cap}\n\
         planned_primary = {primary}\nbudget = \"{spec}\"\n"
    )
}

/// What `audit` finds in a config (rule names), after checking the proxy accepts it; `what`
/// names it in failures.
fn findings(what: &str, text: &str) -> Vec<Rule> {
    let file = "planned.toml";
    ProxyConfig::parse(text, file)
        .unwrap_or_else(|e| panic!("{what}: check-config refuses it: {e}\n{text}"));
    let report =
        audit_sources(&[(file.to_string(), text.to_string())], None, &AuditOptions::default())
            .unwrap_or_else(|e| panic!("{what}: {e}"));
    report.findings.iter().map(|f| f.rule).collect()
}

#[test]
fn every_spec_plan_prints_passes_audit() {
    let rates: [&[&str]; 4] = [&[], &["0.05", "0.2", "0.4"], &["0", "1"], &["0.9"]];
    let mut checked = 0;
    for cap in [1u64, 2, 3, 4, 5, 7, 10, 16, 20, 25, 40, 100, 1000] {
        let mut primaries = vec![1, cap / 4, cap / 2, cap * 3 / 4, cap - 1, cap];
        primaries.retain(|p| (1..=cap).contains(p));
        primaries.dedup();
        for primary in primaries {
            for floor in [0u64, 1, 3, 5, 10, 50] {
                for errors in rates {
                    let mut args: Vec<String> = ["--cap", &cap.to_string(), "--primary"]
                        .iter()
                        .map(|s| s.to_string())
                        .collect();
                    args.extend([primary.to_string(), "--floor".into(), floor.to_string()]);
                    for e in errors {
                        args.extend(["--error-rate".to_string(), e.to_string()]);
                    }
                    let name = format!("plan {}", args.join(" "));
                    // The SPECs of the JSON ...
                    let json: Value = serde_json::from_str(&plan(
                        &[args.clone(), vec!["--format".into(), "json".into()]].concat(),
                    ))
                    .unwrap();
                    let mut specs: Vec<String> = json["specs"]
                        .as_object()
                        .unwrap()
                        .values()
                        .map(|v| v.as_str().unwrap().to_string())
                        .collect();
                    // ... are the table's ...
                    let table = plan(&args);
                    let printed: Vec<String> = table
                        .lines()
                        .skip_while(|l| !l.starts_with("ready-made budget SPECs"))
                        .skip(1)
                        .filter_map(|l| l.strip_prefix("  "))
                        .filter_map(|l| l.split_whitespace().next())
                        .filter(|w| w.contains(':'))
                        .map(str::to_string)
                        .collect();
                    let mut sorted = specs.clone();
                    sorted.sort();
                    let mut printed_sorted = printed.clone();
                    printed_sorted.sort();
                    assert_eq!(sorted, printed_sorted, "{name}:\n{table}");
                    // ... and each passes audit with no finding, under the planned cap.
                    for spec in specs.drain(..) {
                        let found = findings(&name, &config_with(cap, primary, &spec));
                        assert!(found.is_empty(), "{name}: {spec}: audit found {found:?}\n{table}");
                        checked += 1;
                    }
                    // The printed config, too.
                    let toml =
                        plan(&[args.clone(), vec!["--format".into(), "toml".into()]].concat());
                    let found = findings(&name, &toml);
                    assert!(
                        found.is_empty(),
                        "{name} --format toml: audit found {found:?}\n{toml}"
                    );
                }
            }
        }
    }
    assert!(checked > 3_000, "{checked}");
}

/// The check above can fail: the plain arithmetic, without plan's holds, is flagged.
#[test]
fn the_raw_arithmetic_is_flagged() {
    // cap 20, 19 planned: a headroom of 1, and a floor of 3 concurrent retries.
    let raw = config_with(20, 19, "concurrency:percent=0.05,min=3");
    assert_eq!(findings("raw.toml", &raw), [Rule::FloorAboveHeadroom]);
    // cap 40, 10 planned: (40 - 10) / 10 = 300 % of primaries fits the cap.
    let raw = config_with(40, 10, "ratio:percent=3,min_per_sec=3,ttl=10s");
    assert_eq!(findings("raw.toml", &raw), [Rule::BudgetTooHigh]);
    // What plan prints for the same numbers.
    let held = |cap: &str, primary: &str| {
        let json: Value = serde_json::from_str(&plan(
            &["--cap", cap, "--primary", primary, "--format", "json"].map(String::from),
        ))
        .unwrap();
        (
            json["specs"]["concurrency"].as_str().unwrap().to_string(),
            json["specs"]["ratio"].as_str().unwrap().to_string(),
        )
    };
    assert_eq!(held("20", "19").0, "concurrency:percent=0.05,min=1");
    assert_eq!(held("40", "10").1, "ratio:percent=0.5,min_per_sec=3,ttl=10s");
}

/// A listener's call tree keys: read as written, and a wrong value named at its place (exit 2).
#[test]
fn a_listeners_tree_keys_are_checked() {
    let config = |tree: &str, allowance: &str| {
        format!(
            "[[listener]]\nlisten = \"127.0.0.1:0\"\ndependency = \"a\"\ntree = \"{tree}\"\n\
             tree_allowance = {allowance}\n\n[[dependency]]\nname = \"a\"\nupstreams = [\"http://127.0.0.1:1\"]\n"
        )
    };
    let ok = write("tree-ok.toml", &config("trust", "1.25"));
    stormguard().arg("check-config").arg(&ok).assert().success();
    let bad = write("tree-allowance.toml", &config("trust", "20"));
    stormguard().arg("check-config").arg(&bad).assert().code(2).stderr(
        predicate::str::contains("tree-allowance.toml:5:18: listener[0].tree_allowance")
            .and(predicate::str::contains("1 to 10")),
    );
    let bad = write("tree-mode.toml", &config("always", "1.2"));
    stormguard().arg("check-config").arg(&bad).assert().code(2).stderr(
        predicate::str::contains("tree-mode.toml:4:8: listener[0].tree")
            .and(predicate::str::contains("`off`, `root`, `trust`")),
    );
}
