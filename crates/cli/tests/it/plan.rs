//! `stormguard plan` against the README's worked example.

use crate::support;

use predicates::prelude::*;
use serde_json::Value;
use support::stormguard;

fn plan_json(args: &[&str]) -> Value {
    let out = stormguard().arg("plan").args(args).args(["--format", "json"]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

fn close(v: &Value, expected: f64) -> bool {
    v.as_f64().is_some_and(|x| (x - expected).abs() < 1e-6)
}

#[test]
fn worked_example_json() {
    let v = plan_json(&[
        "--cap",
        "20",
        "--primary",
        "16",
        "--error-rate",
        "0.05",
        "--error-rate",
        "0.2",
        "--error-rate",
        "0.4",
        "--fan-out",
        "5",
        "--quantile",
        "0.99",
        "--server-limit",
        "400",
        "--reserve",
        "10",
        "--instances",
        "20",
    ]);
    assert_eq!(v["cap"], 20);
    assert_eq!(v["primary"], 16);
    assert_eq!(v["retry_slots"], 4);
    assert!(close(&v["max_retry_fraction"], 0.25));
    assert!(close(&v["ratio_percent"], 0.25));
    assert!(close(&v["concurrency_percent"], 0.2));
    assert_eq!(v["floor"], 3);
    assert_eq!(v["separate_pools_in_flight"], 24);
    let rows = v["rows"].as_array().unwrap();
    let expect = [
        (0.05, 16.8, 16.842105, 16.8, 0.0, "fits"),
        (0.2, 19.2, 20.0, 19.2, 0.0, "at-edge"),
        (0.4, 22.4, 26.666667, 20.0, 2.4, "over-cap"),
    ];
    assert_eq!(rows.len(), 3);
    for (row, (e, once, unbounded, budgeted, shed, verdict)) in rows.iter().zip(expect) {
        assert!(close(&row["error_rate"], e), "{row}");
        assert!(close(&row["in_flight_retry_once"], once), "{row}");
        assert!(close(&row["in_flight_unbounded"], unbounded), "{row}");
        assert!(close(&row["in_flight_budgeted"], budgeted), "{row}");
        assert!(close(&row["retries_shed"], shed), "{row}");
        assert_eq!(row["verdict"], verdict, "{row}");
    }
    assert_eq!(v["fan_out"]["calls"], 5);
    assert!(close(&v["fan_out"]["p_all_fast"], 0.95099));
    assert_eq!(v["pool"]["per_instance"], 19);
    assert_eq!(v["pool"]["demanded"], 400);
    assert_eq!(v["specs"]["ratio"], "ratio:percent=0.25,min_per_sec=3,ttl=10s");
}

#[test]
fn total_failure_is_null_and_optional_sections_absent() {
    let v = plan_json(&["--cap", "20", "--primary", "16", "--error-rate", "1"]);
    assert!(v["rows"][0]["in_flight_unbounded"].is_null());
    assert!(v.get("fan_out").is_none());
    assert!(v.get("pool").is_none());
}

#[test]
fn default_error_rates_are_the_worked_example() {
    let v = plan_json(&["--cap", "20", "--primary", "16"]);
    let rates: Vec<f64> =
        v["rows"].as_array().unwrap().iter().map(|r| r["error_rate"].as_f64().unwrap()).collect();
    assert_eq!(rates, [0.05, 0.2, 0.4]);
}

#[test]
fn table_shows_the_numbers_and_the_specs() {
    stormguard()
        .args(["plan", "--cap", "20", "--primary", "16", "--fan-out", "5"])
        .assert()
        .success()
        .stdout(predicate::str::contains("25 %"))
        .stdout(predicate::str::contains("20 %"))
        .stdout(predicate::str::contains("19.2"))
        .stdout(predicate::str::contains("22.4"))
        .stdout(predicate::str::contains("sees 24"))
        .stdout(predicate::str::contains("95.1 %"))
        .stdout(predicate::str::contains("over-cap"))
        .stdout(predicate::str::contains("at-edge"))
        .stdout(predicate::str::contains("ratio:percent=0.25,min_per_sec=3,ttl=10s"))
        .stdout(predicate::str::contains("concurrency:percent=0.2,min=3"));
}

#[test]
fn toml_carries_the_planned_budget() {
    stormguard()
        .args(["plan", "--cap", "20", "--primary", "16", "--format", "toml"])
        .assert()
        .success()
        .stdout(predicate::str::contains("cap = 20"))
        .stdout(predicate::str::contains("budget = \"ratio:percent=0.25,min_per_sec=3,ttl=10s\""));
}

#[test]
fn refusals_exit_2_with_the_reason() {
    stormguard()
        .args(["plan", "--cap", "20", "--primary", "21"])
        .assert()
        .code(2)
        .stderr(predicate::str::contains("primary concurrency (21) is above the cap (20)"));
    stormguard()
        .args(["plan", "--cap", "20", "--primary", "16", "--error-rate", "1.5"])
        .assert()
        .code(2)
        .stderr(predicate::str::contains("error rate 1.5 is outside [0, 1]"));
    stormguard().args(["plan", "--cap", "twenty", "--primary", "16"]).assert().code(2);
    stormguard().args(["plan", "--primary", "16"]).assert().code(2);
    stormguard()
        .args(["plan", "--cap", "20", "--primary", "16", "--format", "yaml"])
        .assert()
        .code(2);
}

#[test]
fn help_is_actionable() {
    stormguard()
        .args(["plan", "--help"])
        .assert()
        .success()
        .stdout(predicate::str::contains("--error-rate"))
        .stdout(predicate::str::contains("Example"));
    stormguard().arg("--help").assert().success().stdout(predicate::str::contains("replay"));
}
