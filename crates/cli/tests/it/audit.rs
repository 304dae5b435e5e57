//! `stormguard audit` end to end: exit codes, the three output formats, bad input.

use crate::support;

use std::path::{Path, PathBuf};
use support::stormguard;

use predicates::prelude::*;
use serde_json::Value;

fn fixture(p: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../audit/tests/fixtures").join(p)
}

#[test]
fn clean_config_exits_0() {
    stormguard()
        .arg("audit")
        .arg(fixture("envoy/clean.yaml"))
        .assert()
        .code(0)
        .stdout(predicate::str::contains("no findings"));
}

#[test]
fn an_error_finding_exits_1_with_a_table() {
    stormguard()
        .arg("audit")
        .arg(fixture("envoy/bad.yaml"))
        .assert()
        .code(1)
        .stdout(predicate::str::contains("non-idempotent-retry"))
        .stdout(predicate::str::contains("bad.yaml:29"))
        .stderr(predicate::str::contains("3 findings at or above error"));
}

#[test]
fn fail_on_sets_the_threshold() {
    let clean = fixture("stormguard/clean.toml");
    stormguard().args(["audit", "--fail-on", "info"]).arg(&clean).assert().code(0);
    stormguard()
        .args(["audit", "--fail-on", "warning"])
        .arg(fixture("envoy/bad.yaml"))
        .assert()
        .code(1);
    stormguard().args(["audit", "--fail-on", "loud"]).arg(&clean).assert().code(2);
}

#[test]
fn warnings_pass_by_default_and_fail_at_warning() {
    // Only a warning: one retry with no retryThrottling.
    let dir = tempfile_dir();
    let f = dir.join("svc.json");
    std::fs::write(
        &f,
        r#"{"methodConfig":[{"name":[{"service":"a.B"}],"retryPolicy":{"maxAttempts":2,"retryableStatusCodes":["UNAVAILABLE"]}}]}"#,
    )
    .unwrap();
    stormguard()
        .arg("audit")
        .arg(&f)
        .assert()
        .code(0)
        .stdout(predicate::str::contains("unbudgeted-retries"));
    stormguard().args(["audit", "--fail-on", "warning"]).arg(&f).assert().code(1);
    std::fs::remove_dir_all(dir).unwrap();
}

fn tempfile_dir() -> PathBuf {
    let d = std::env::temp_dir().join(format!("stormguard-audit-cli-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn json_output() {
    let out = stormguard().args(["audit", "--json"]).arg(fixture("grpc/bad.json")).assert().code(1);
    let v: Value = serde_json::from_slice(&out.get_output().stdout).unwrap();
    let rules: Vec<&str> =
        v["findings"].as_array().unwrap().iter().map(|f| f["rule"].as_str().unwrap()).collect();
    assert_eq!(
        rules,
        ["amplification", "unthrottled-hedging", "unbudgeted-retries", "value-capped"]
    );
    assert_eq!(v["findings"][0]["line"], 6);
    assert!(v["findings"][0]["file"].as_str().unwrap().ends_with("bad.json"));
}

#[test]
fn sarif_output() {
    let out = stormguard()
        .args(["audit", "--format", "sarif"])
        .arg(fixture("linkerd/bad.yaml"))
        .assert()
        .code(1);
    let v: Value = serde_json::from_slice(&out.get_output().stdout).unwrap();
    assert_eq!(v["version"], "2.1.0");
    assert_eq!(v["runs"][0]["results"].as_array().unwrap().len(), 5);
}

#[test]
fn graph_amplification() {
    let g = fixture("graph");
    let out = stormguard()
        .args(["audit", "--json", "--graph"])
        .arg(g.join("graph_budgeted.toml"))
        .arg(g.join("configs"))
        .args(["--max-amplification", "8"])
        .assert()
        .code(0);
    let v: Value = serde_json::from_slice(&out.get_output().stdout).unwrap();
    assert_eq!(v["paths"][0]["amplification"], 7.2);
    assert_eq!(v["paths"][0]["amplification_fraction"], serde_json::json!([36, 5]));
    stormguard()
        .args(["audit", "--graph"])
        .arg(g.join("graph.toml"))
        .arg(g.join("configs"))
        .assert()
        .code(1)
        .stdout(predicate::str::contains("3 × 3 × 2 = 18 attempts"));
}

#[test]
fn malformed_yaml_and_json_exit_2_naming_file_and_line() {
    stormguard()
        .arg("audit")
        .arg(fixture("malformed/bad.json"))
        .assert()
        .code(2)
        .stderr(predicate::str::contains("bad.json:4:"));
    stormguard()
        .arg("audit")
        .arg(fixture("malformed/bad.yaml"))
        .assert()
        .code(2)
        .stderr(predicate::str::is_match(r"bad\.yaml:[56]:").unwrap());
    stormguard().args(["audit", "/nonexistent/stormguard"]).assert().code(2);
}

#[test]
fn istio_version_flag() {
    stormguard()
        .args(["audit", "--istio-version", "1.0"])
        .arg(fixture("istio/bad.yaml"))
        .assert()
        .code(1)
        .stdout(predicate::str::contains("default-retries").not());
    stormguard()
        .args(["audit", "--istio-version", "x"])
        .arg(fixture("istio/bad.yaml"))
        .assert()
        .code(2);
}
