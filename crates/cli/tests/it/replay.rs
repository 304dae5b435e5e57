//! `stormguard replay` against traces worked out by hand from the rules in docs/budgets.md
//! (tests/replay/):
//! `NAME.jsonl` is the input, `NAME.spec` the policy, `NAME.expected.jsonl` the exact output;
//! `bad_NAME.jsonl` must exit 2 with `bad_NAME.expected_error` in the message.

use crate::support;

use std::path::{Path, PathBuf};
use support::stormguard;

use predicates::prelude::*;
use serde_json::Value;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/replay")
}

fn traces(bad: bool) -> Vec<PathBuf> {
    let mut v: Vec<_> = std::fs::read_dir(fixtures())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            name.ends_with(".jsonl")
                && !name.ends_with(".expected.jsonl")
                && name.starts_with("bad_") == bad
        })
        .collect();
    v.sort();
    v
}

fn parse_lines(text: &str) -> Vec<Value> {
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

#[test]
fn hand_computed_traces() {
    let all = traces(false);
    assert!(all.len() >= 8, "expected the fixture traces, found {}", all.len());
    for trace in all {
        let spec = std::fs::read_to_string(trace.with_extension("spec")).unwrap();
        let expected = std::fs::read_to_string(trace.with_extension("expected.jsonl")).unwrap();
        let out =
            stormguard().args(["replay", "--policy", spec.trim()]).arg(&trace).output().unwrap();
        assert!(
            out.status.success(),
            "{}: {}",
            trace.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        // Every retry_done of these traces closes a retry: none is reported as unmatched.
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!err.contains("matched no retry"), "{}: {err}", trace.display());
        let got = parse_lines(&String::from_utf8(out.stdout).unwrap());
        let want = parse_lines(&expected);
        assert_eq!(got.len(), want.len(), "{}: number of output lines", trace.display());
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(g, w, "{}: output line {}", trace.display(), i + 1);
        }
    }
}

#[test]
fn malformed_lines_exit_2_naming_the_line() {
    let all = traces(true);
    assert!(all.len() >= 3);
    for trace in all {
        let needle = std::fs::read_to_string(trace.with_extension("expected_error")).unwrap();
        stormguard()
            .args(["replay", "--policy", "ratio"])
            .arg(&trace)
            .assert()
            .code(2)
            .stderr(predicate::str::contains(needle.trim()));
    }
}

#[test]
fn output_keeps_the_contract_field_order() {
    stormguard()
        .args(["replay", "--policy", "ratio:percent=1,min_per_sec=0"])
        .write_stdin("{\"t_ms\":0,\"op\":\"request\"}\n{\"t_ms\":3,\"op\":\"retry\"}\n{\"t_ms\":4,\"op\":\"balance\"}\n")
        .assert()
        .success()
        .stdout("{\"t_ms\":3,\"op\":\"retry\",\"allowed\":true}\n{\"t_ms\":4,\"op\":\"balance\",\"value\":0}\n");
}

#[test]
fn reads_stdin_with_dash() {
    stormguard()
        .args(["replay", "--policy", "token-bucket:max_tokens=3,token_ratio=0.5", "-"])
        .write_stdin("{\"t_ms\":0,\"op\":\"failure\"}\n{\"t_ms\":0,\"op\":\"success\"}\n{\"t_ms\":0,\"op\":\"balance\"}\n")
        .assert()
        .success()
        .stdout("{\"t_ms\":0,\"op\":\"balance\",\"value\":2.5}\n");
}

#[test]
fn bad_specs_exit_2_with_the_reason() {
    for (spec, reason) in [
        ("leaky:rate=1", "unknown budget kind `leaky`"),
        ("ratio:percent=0.1234567", "more than 6 decimal places"),
        ("ratio:ttl=90s", "ttl must be between 1s and 60s"),
        ("concurrency:pct=0.2", "`pct` is not a parameter of concurrency"),
        ("token-bucket:max_tokens=2000", "max_tokens must be above 0 and at most 1000"),
        ("quota:retry_cost=-5", "not a non-negative integer"),
    ] {
        stormguard()
            .args(["replay", "--policy", spec])
            .write_stdin("")
            .assert()
            .code(2)
            .stderr(predicate::str::contains(reason));
    }
}

#[test]
fn missing_file_and_bad_fields_exit_2() {
    stormguard()
        .args(["replay", "--policy", "ratio", "/nonexistent/trace.jsonl"])
        .assert()
        .code(2)
        .stderr(predicate::str::contains("cannot read"));
    for (line, reason) in [
        ("{\"t_ms\":0,\"op\":\"retry\",\"kind\":\"slow\"}", "kind `slow`"),
        ("{\"t_ms\":0,\"op\":\"active\"}", "active needs \"n\""),
        ("{\"t_ms\":-1,\"op\":\"request\"}", "line 2"),
        ("{\"op\":\"request\"}", "t_ms"),
        ("{\"t_ms\":0,\"op\":\"request\",\"id\":[1]}", "id must be a string or a number"),
    ] {
        stormguard()
            .args(["replay", "--policy", "ratio"])
            .write_stdin(format!("{{\"t_ms\":0,\"op\":\"request\"}}\n{line}\n"))
            .assert()
            .code(2)
            .stderr(predicate::str::contains(reason))
            .stderr(predicate::str::contains("line 2"));
    }
}

#[test]
fn unmatched_retry_done_is_reported_not_dropped() {
    stormguard()
        .args(["replay", "--policy", "concurrency:percent=0.2,min=3"])
        .write_stdin("{\"t_ms\":0,\"op\":\"request\"}\n{\"t_ms\":1,\"op\":\"retry_done\"}\n")
        .assert()
        .success()
        .stderr(predicate::str::contains("1 retry_done event(s) matched no retry in flight"));
}

#[test]
fn ten_thousand_requests_grant_the_exact_floor() {
    // 0.29 × 10 000 = 2 900 retries, no more, no fewer (tower#857 truncates 1/percent).
    let mut input = String::new();
    for _ in 0..10_000 {
        input.push_str("{\"t_ms\":0,\"op\":\"request\"}\n");
    }
    for _ in 0..3_000 {
        input.push_str("{\"t_ms\":0,\"op\":\"retry\"}\n");
    }
    let out = stormguard()
        .args(["replay", "--policy", "ratio:percent=0.29,min_per_sec=0,ttl=10s"])
        .write_stdin(input)
        .output()
        .unwrap();
    let allowed = parse_lines(&String::from_utf8(out.stdout).unwrap())
        .iter()
        .filter(|v| v["allowed"] == true)
        .count();
    assert_eq!(allowed, 2_900);
}

#[test]
fn a_summary_goes_to_stderr_and_stdout_stays_json_lines() {
    // As record mode writes it: the recorded run sent request 1's retry and refused request 2's
    // (budget) and request 3's (cap). The policy replayed allows none of them, yet request 1's
    // retry_done still closes the retry the recorded run sent: no false "unmatched" warning.
    let trace = "\
{\"t_ms\":0,\"id\":1,\"op\":\"request\"}
{\"t_ms\":0,\"id\":2,\"op\":\"request\"}
{\"t_ms\":0,\"id\":3,\"op\":\"request\"}
{\"t_ms\":1,\"id\":1,\"op\":\"failure\",\"kind\":\"error\"}
{\"t_ms\":1,\"id\":1,\"op\":\"active\",\"n\":3,\"retries\":0}
{\"t_ms\":1,\"id\":1,\"op\":\"retry\",\"kind\":\"error\",\"allowed_here\":true}
{\"t_ms\":2,\"id\":2,\"op\":\"failure\",\"kind\":\"error\"}
{\"t_ms\":2,\"id\":2,\"op\":\"active\",\"n\":4,\"retries\":1}
{\"t_ms\":2,\"id\":2,\"op\":\"retry\",\"kind\":\"error\",\"allowed_here\":false,\"denied\":\"budget\"}
{\"t_ms\":3,\"id\":3,\"op\":\"failure\",\"kind\":\"error\"}
{\"t_ms\":3,\"id\":3,\"op\":\"active\",\"n\":4,\"retries\":1}
{\"t_ms\":3,\"id\":3,\"op\":\"retry\",\"kind\":\"error\",\"allowed_here\":false,\"denied\":\"cap\"}
{\"t_ms\":9,\"id\":1,\"op\":\"success\",\"retry\":true}
{\"t_ms\":9,\"id\":1,\"op\":\"retry_done\"}
";
    let out = stormguard()
        .args(["replay", "--policy", "ratio:percent=0,min_per_sec=0"])
        .write_stdin(trace)
        .output()
        .unwrap();
    assert!(out.status.success());
    let stdout = String::from_utf8(out.stdout).unwrap();
    let lines = parse_lines(&stdout);
    assert_eq!(lines.len(), 3);
    assert!(lines.iter().all(|v| v["op"] == "retry" && v["allowed"] == false), "{stdout}");
    let err = String::from_utf8(out.stderr).unwrap();
    assert!(
        err.contains(
            "3 retries asked: 0 allowed, 3 denied (budget 3); as recorded: 1 allowed, 2 denied \
             (budget 1, cap 1)"
        ),
        "{err}"
    );
    assert!(!err.contains("matched no retry"), "{err}");

    // A generous policy allows all three; the summary says so beside the recording.
    stormguard()
        .args(["replay", "--policy", "ratio:percent=1,min_per_sec=0"])
        .write_stdin(trace)
        .assert()
        .success()
        .stderr(predicate::str::contains("3 retries asked: 3 allowed, 0 denied (budget 0)"))
        .stderr(predicate::str::contains("matched no retry").not());
}

#[test]
fn an_active_snapshot_cannot_hold_more_retries_than_requests() {
    stormguard()
        .args(["replay", "--policy", "concurrency"])
        .write_stdin("{\"t_ms\":0,\"op\":\"active\",\"n\":2,\"retries\":3}\n")
        .assert()
        .code(2)
        .stderr(predicate::str::contains("line 1"))
        .stderr(predicate::str::contains("retries (3) cannot exceed n (2)"));
}
