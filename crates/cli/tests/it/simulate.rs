//! `stormguard simulate`: the JSON contract, determinism, the HTML report, and exit 2 with
//! file, line and key for a bad scenario.

use crate::support;

use predicates::prelude::*;
use serde_json::Value;
use support::stormguard;

fn simulate(args: &[&str]) -> std::process::Output {
    stormguard().arg("simulate").args(args).arg("--no-progress").output().unwrap()
}

fn json(args: &[&str]) -> (Value, Vec<u8>) {
    let out = simulate(&[args, &["--json"]].concat());
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    (serde_json::from_slice(&out.stdout).unwrap(), out.stdout)
}

fn policy<'a>(v: &'a Value, name: &str) -> &'a Value {
    v["policies"].as_array().unwrap().iter().find(|p| p["name"] == name).unwrap()
}

#[test]
fn worked_example_json_has_the_contract() {
    let (v, _) = json(&["--builtin", "worked-example"]);
    assert_eq!(v["scenario"], "worked-example");
    assert_eq!(v["seed"], 1);
    let names: Vec<&str> =
        v["policies"].as_array().unwrap().iter().map(|p| p["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["no-retries", "retry-once", "retry-until-success", "ratio-budget"]);
    for p in v["policies"].as_array().unwrap() {
        for key in ["amplification", "goodput", "error_rate", "retries_issued", "retries_denied"] {
            assert!(p[key].is_number(), "{key} in {p}");
        }
        for key in ["mean", "p50", "p99", "max"] {
            assert!(p["in_flight"][key].is_number(), "in_flight.{key}");
        }
        // No trigger in this scenario: recovery is null, but present.
        assert!(p.as_object().unwrap().contains_key("recovery_s"));
        assert!(p["recovery_s"].is_null());
    }
    let budget = policy(&v, "ratio-budget");
    assert!(budget["in_flight"]["max"].as_u64().unwrap() <= 20);
    assert_eq!(budget["in_flight"]["cap"], 20);
    let once = policy(&v, "retry-once");
    assert!(once["in_flight"]["max"].as_u64().unwrap() > 20);
    let at_40 = once["phases"][2]["in_flight_mean"].as_f64().unwrap();
    assert!((at_40 - 22.4).abs() < 0.45, "{at_40}");
}

#[test]
fn same_seed_same_bytes_and_the_seed_flag() {
    let args = ["--builtin", "metastable", "--policy", "retry-once", "--policy", "ratio-budget"];
    let (a, bytes_a) = json(&args);
    let (_, bytes_b) = json(&[&args[..], &["--jobs", "1"]].concat());
    assert_eq!(bytes_a, bytes_b);
    assert_eq!(a["policies"].as_array().unwrap().len(), 2);
    // recovery: null for the stuck naive policy, a number for the budget.
    assert!(policy(&a, "retry-once")["recovery_s"].is_null());
    assert!(policy(&a, "ratio-budget")["recovery_s"].is_number());
    let (c, bytes_c) = json(&[&args[..], &["--seed", "99"]].concat());
    assert_eq!(c["seed"], 99);
    assert_ne!(bytes_a, bytes_c);
}

#[test]
fn html_report_is_one_self_contained_file() {
    let dir = std::env::temp_dir().join(format!("stormguard-sim-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("report.html");
    let out = simulate(&["--builtin", "fan-out", "--html", path.to_str().unwrap()]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let table = String::from_utf8(out.stdout).unwrap();
    assert!(table.contains("per-action-budget") && table.contains("wrote"), "{table}");
    let html = std::fs::read_to_string(&path).unwrap();
    assert!(html.starts_with("<!DOCTYPE html>"));
    assert_eq!(html.matches("<svg").count(), 5, "five charts");
    assert!(!html.contains("<script") && !html.contains("src=\"http"), "self-contained");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn bad_scenarios_exit_2_naming_file_line_and_key() {
    let dir = std::env::temp_dir().join(format!("stormguard-sim-bad-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("storm.toml");
    std::fs::write(
        &path,
        "[fleet]\nrate = 100\n[dependency]\ncapacity = 20\nservice_time = \"50ms\"\n\
         [[policy]]\nbudget = \"ratio:percent=0.2\"\ncap = 20\nretries = 12\n",
    )
    .unwrap();
    stormguard().args(["simulate", path.to_str().unwrap()]).assert().code(2).stderr(
        predicate::str::contains(
            "storm.toml:9:11: policy[0].retries: must be between 0 and 10, got 12",
        ),
    );
    std::fs::write(
        &path,
        "[fleet]\nrate = 100\n[dependency]\ncapacity = 20\nservice_time = \"quick\"\n",
    )
    .unwrap();
    stormguard()
        .args(["simulate", path.to_str().unwrap()])
        .assert()
        .code(2)
        .stderr(predicate::str::contains("storm.toml:5:16: dependency.service_time:"));
    std::fs::write(&path, "[fleet\n").unwrap();
    stormguard()
        .args(["simulate", path.to_str().unwrap()])
        .assert()
        .code(2)
        .stderr(predicate::str::contains("storm.toml:1:"));
    std::fs::remove_dir_all(&dir).unwrap();
    stormguard()
        .args(["simulate", "--builtin", "hurricane"])
        .assert()
        .code(2)
        .stderr(predicate::str::contains("worked-example"));
    stormguard()
        .args(["simulate", "--builtin", "metastable", "--policy", "nope"])
        .assert()
        .code(2)
        .stderr(predicate::str::contains("retry-once"));
    stormguard().args(["simulate"]).assert().code(2);
}

#[test]
fn list_and_print_scenario() {
    stormguard().args(["simulate", "--list"]).assert().success().stdout(
        predicate::str::contains("metastable")
            .and(predicate::str::contains("fleet"))
            .and(predicate::str::contains("model-provider"))
            .and(predicate::str::contains("capacity-drop")),
    );
    // The help lists every built-in scenario.
    let help = stormguard().args(["simulate", "--help"]).output().unwrap();
    assert!(help.status.success());
    let help = String::from_utf8(help.stdout).unwrap();
    for name in stormguard_sim::builtin::names() {
        assert!(help.lines().any(|l| l.trim_start().starts_with(name)), "{name} in\n{help}");
    }
    let out = simulate(&["--builtin", "worked-example", "--print-scenario"]);
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.contains("[[policy]]") && text.contains("cap = 20"));
}

/// The call tree runs its own model from the same command: a table, JSON, a policy picked,
/// and a bad file named with its line, column and key (exit 2).
#[test]
fn a_call_tree_runs_from_simulate() {
    let out = simulate(&["--builtin", "call-tree"]);
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.contains("attempts per action at the dependency (hop 3)"), "{text}");
    assert!(text.contains("the budgets' per-hop product: 1.728"), "{text}");
    let out = simulate(&["--builtin", "call-tree", "--json", "--policy", "tree allowance 1.2"]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let policies = v["policies"].as_array().unwrap();
    assert_eq!(policies.len(), 1);
    assert!(policies[0]["attempts_per_action"][2].as_f64().unwrap() <= 1.2 + 1e-9);
    let path = support::write(
        "tree.toml",
        "[call_tree]\nhops = 3\nerror_rate = 2\n[[policy]]\nname = \"a\"\n",
    );
    let out = stormguard().args(["simulate"]).arg(&path).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8(out.stderr).unwrap();
    assert!(err.contains("tree.toml:3:") && err.contains("call_tree.error_rate"), "{err}");
    let out = stormguard().args(["verify", "--builtin", "call-tree"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2), "verify runs the request model only");
}
