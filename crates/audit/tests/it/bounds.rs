//! Hostile and broken input: an alias bomb is refused at once, special files are refused
//! without being read, a symlink loop does not make the walk endless, and a retry value that
//! cannot be read is a finding in every format — never silence.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use stormguard_audit::model::{Rule, Severity};
use stormguard_audit::{AuditError, AuditOptions, Report, audit_paths, audit_sources};

fn audit(file: &str, text: &str) -> Result<Report, AuditError> {
    audit_sources(&[(file.to_string(), text.to_string())], None, &AuditOptions::default())
}

/// `(severity, rule, line)` of every finding of one rule.
fn unreadable(r: &Report) -> Vec<(&'static str, u32, String)> {
    r.findings
        .iter()
        .filter(|f| f.rule.id() == "unreadable-value")
        .map(|f| (f.severity.as_str(), f.location.line, f.message.clone()))
        .collect()
}

/// Nine aliases to nine aliases, `levels` deep: 9^levels copies of "lol" from a few hundred
/// bytes.
fn laughs(levels: usize) -> String {
    let mut text = String::from("a0: &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n");
    for i in 1..=levels {
        let refs = vec![format!("*a{}", i - 1); 9].join(", ");
        text.push_str(&format!("a{i}: &a{i} [{refs}]\n"));
    }
    text
}

#[test]
fn an_alias_bomb_is_refused_at_once() {
    // 9^9 = 387 million scalars from 540 bytes: before the bound, this took gigabytes.
    let text = laughs(9);
    assert!(text.len() < 700, "{}", text.len());
    let started = Instant::now();
    let err = audit("laughs.yaml", &text).unwrap_err();
    let took = started.elapsed();
    eprintln!("billion laughs ({} bytes) refused in {took:?}: {err}", text.len());
    assert!(took < Duration::from_secs(10), "refused, but only after {took:?}");
    let AuditError::Syntax { file, line, reason, .. } = err else { panic!("{err:?}") };
    assert_eq!(file, "laughs.yaml");
    assert!(reason.contains("aliases expand to more than 1000000"), "{reason}");
    // The line of the alias that passed the bound: the fifth level already copies 9^5 × 4.
    assert!((5..=7).contains(&line), "{line}");
}

#[test]
fn ordinary_anchors_still_work() {
    // Three levels: 729 copies, far under the bound.
    let r = audit("small.yaml", &laughs(3)).unwrap();
    assert_eq!(r.documents, 1);
    // A merge key reused many times, as templated manifests do.
    let mut text = String::from(
        "x-retries: &retries\n  attempts: 2\n  perTryTimeout: 1s\n  retryOn: 5xx\n---\n",
    );
    for i in 0..200 {
        text.push_str(&format!(
            "apiVersion: networking.istio.io/v1\nkind: VirtualService\nmetadata: {{name: s{i}}}\n\
             spec:\n  http:\n  - retries:\n      <<: *retries\n    route:\n    - destination: {{host: s{i}}}\n---\n"
        ));
    }
    let r = audit("many.yaml", &text).unwrap();
    assert_eq!(r.layers.len(), 200);
    assert!(r.layers.iter().all(|l| l.attempts == Some(3)));
}

#[test]
fn aliases_cannot_nest_values_without_bound() {
    // Each level nests the last one 200 deeper: a tree too deep to drop without blowing the
    // stack if it were built.
    let mut text = format!("a0: &a0 {}x{}\n", "[".repeat(200), "]".repeat(200));
    for i in 1..40 {
        text.push_str(&format!("a{i}: &a{i} {}*a{}{}\n", "[".repeat(200), i - 1, "]".repeat(200)));
    }
    let err = audit("deep.yaml", &text).unwrap_err();
    assert!(err.to_string().contains("nest deeper than 512"), "{err}");
}

#[cfg(unix)]
#[test]
fn special_files_are_refused_without_being_read() {
    let started = Instant::now();
    let err =
        audit_paths(&[PathBuf::from("/dev/zero")], None, &AuditOptions::default()).unwrap_err();
    assert_eq!(err.to_string(), "/dev/zero: is a character device, not a regular file");
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("mesh.yaml");
    assert!(std::process::Command::new("mkfifo").arg(&fifo).status().unwrap().success());
    // A FIFO with no writer: reading it would block forever.
    let err = audit_paths(&[dir.path().to_path_buf()], None, &AuditOptions::default()).unwrap_err();
    assert!(err.to_string().ends_with("mesh.yaml: is a FIFO, not a regular file"), "{err}");
    // A directory given as the graph file.
    let graph = dir.path().to_path_buf();
    std::fs::remove_file(&fifo).unwrap();
    let err = audit_paths(std::slice::from_ref(&graph), Some(&graph), &AuditOptions::default())
        .unwrap_err();
    assert!(err.to_string().ends_with("is a directory, not a file"), "{err}");
    assert!(started.elapsed() < Duration::from_secs(10));
}

#[cfg(unix)]
#[test]
fn a_symlink_loop_does_not_make_the_walk_endless() {
    let dir = tempfile::tempdir().unwrap();
    let sub = dir.path().join("sub");
    std::fs::create_dir(&sub).unwrap();
    std::fs::write(sub.join("vs.yaml"), "apiVersion: v1\nkind: ConfigMap\n").unwrap();
    std::os::unix::fs::symlink(dir.path(), sub.join("up")).unwrap();
    let r = audit_paths(&[dir.path().to_path_buf()], None, &AuditOptions::default()).unwrap();
    assert_eq!(r.files, 1, "the file once, the link back up not followed");
}

#[test]
fn unreadable_istio_values_are_findings() {
    let text = r#"apiVersion: networking.istio.io/v1
kind: VirtualService
metadata:
  name: reviews
spec:
  http:
  - timeout: soon
    retries:
      attempts: "five"
      perTryTimeout: [1s]
    route:
    - destination:
        host: reviews
"#;
    let r = audit("vs.yaml", text).unwrap();
    let found = unreadable(&r);
    assert_eq!(
        found.iter().map(|(s, l, _)| (*s, *l)).collect::<Vec<_>>(),
        vec![("error", 7), ("error", 9), ("error", 10)],
        "{found:#?}"
    );
    assert!(found[1].2.starts_with("`attempts: \"five\"` is not a whole number"), "{}", found[1].2);
    assert!(found[2].2.starts_with("`perTryTimeout: a list` is not a duration"), "{}", found[2].2);
    // null is absent, not unreadable.
    let r = audit(
        "vs.yaml",
        &text.replace("\"five\"", "null").replace("[1s]", "~").replace("soon", "~"),
    )
    .unwrap();
    assert_eq!(unreadable(&r), vec![]);
}

#[test]
fn unreadable_envoy_values_are_findings() {
    let text = r#"static_resources:
  clusters:
  - name: orders
    connect_timeout: 1s
    circuit_breakers:
      thresholds:
      - max_requests: lots
        retry_budget:
          budget_percent: {value: twenty}
          min_retry_concurrency: 3
"#;
    let r = audit("envoy.yaml", text).unwrap();
    let lines: Vec<u32> = unreadable(&r).iter().map(|f| f.1).collect();
    assert_eq!(lines, vec![7, 9]);
    let text = r#"virtual_hosts:
- name: api
  routes:
  - match: {prefix: /}
    route:
      cluster: orders
      retry_policy: {num_retries: many, per_try_timeout: {seconds: x}}
"#;
    let r = audit("routes.yaml", text).unwrap();
    let found = unreadable(&r);
    assert_eq!(found.len(), 2, "{found:#?}");
    assert!(found.iter().any(|f| f.2.starts_with("`num_retries: many`")));
    // Not also reported as "without num_retries": it is there, just unreadable.
    assert!(!r.findings.iter().any(|f| f.rule.id() == "default-retries"), "{:#?}", r.findings);
    // `num_retries` is a uint32: past it, and below 0, Envoy refuses the route; neither is read
    // as 4 294 967 295 retries.
    for bad in ["4294967296", "-1"] {
        let text = format!(
            "virtual_hosts:\n- name: api\n  routes:\n  - match: {{prefix: /}}\n    route:\n      cluster: orders\n      retry_policy: {{num_retries: {bad}}}\n"
        );
        let r = audit("routes.yaml", &text).unwrap();
        let found = unreadable(&r);
        assert_eq!(found.len(), 1, "{bad}: {found:#?}");
        assert!(found[0].2.starts_with(&format!("`num_retries: {bad}`")), "{found:#?}");
    }
}

#[test]
fn unreadable_grpc_and_linkerd_values_are_findings() {
    let grpc = r#"{"methodConfig": [{"name": [{"service": "shop.Ledger"}], "timeout": "later",
        "retryPolicy": {"maxAttempts": "five", "retryableStatusCodes": ["UNAVAILABLE"]}}],
        "retryThrottling": {"maxTokens": 10, "tokenRatio": "half"}}"#;
    let r = audit("service-config.json", grpc).unwrap();
    assert_eq!(unreadable(&r).len(), 3, "{:#?}", unreadable(&r));
    let linkerd = r#"apiVersion: linkerd.io/v1alpha2
kind: ServiceProfile
metadata:
  name: web
spec:
  retryBudget:
    retryRatio: lots
  routes:
  - name: get
    isRetryable: maybe
---
apiVersion: v1
kind: Service
metadata:
  name: api
  annotations:
    retry.linkerd.io/http: 5xx
    retry.linkerd.io/limit: "five"
"#;
    let r = audit("linkerd.yaml", linkerd).unwrap();
    let lines: Vec<u32> = unreadable(&r).iter().map(|f| f.1).collect();
    assert_eq!(lines, vec![7, 10, 18]);
}

/// A stormguard config is read by the proxy's own reader: a value the proxy refuses (here a
/// duration that is not one) is an error finding at its line and key, with the proxy's reason,
/// and the rest of the audit goes on.
#[test]
fn stormguard_configs_the_proxy_refuses_are_findings() {
    let text = "[[listener]]\nlisten = \"127.0.0.1:8080\"\ndependency = \"payments\"\n\
                [[dependency]]\nname = \"payments\"\nupstreams = [\"http://127.0.0.1:9000\"]\n\
                per_try_timeout = \"fast\"\ndeadline = \"2s\"\n";
    let r = audit("stormguard.toml", text).unwrap();
    let refused: Vec<_> = r.findings.iter().filter(|f| f.rule == Rule::RefusedConfig).collect();
    assert_eq!(refused.len(), 1, "{:#?}", r.findings);
    assert_eq!(refused[0].location.line, 7);
    assert_eq!(refused[0].severity, Severity::Error);
    assert_eq!(
        refused[0].message,
        "the proxy refuses this file: dependency[0].per_try_timeout: `fast` is not a duration (e.g. 250ms, 10s, 2m)"
    );
    // A rule broken, not a value unreadable: the same finding, at the key.
    let zero = text.replace("deadline = \"2s\"", "cap = 0").replace("\"fast\"", "\"1s\"");
    let r = audit("stormguard.toml", &zero).unwrap();
    let refused: Vec<_> = r.findings.iter().filter(|f| f.rule == Rule::RefusedConfig).collect();
    assert_eq!(refused.len(), 1, "{:#?}", r.findings);
    assert_eq!(refused[0].location.line, 8);
    assert!(
        refused[0]
            .message
            .ends_with("dependency[0].cap: cap must be between 1 and 16777216, got 0")
    );
    // Without the mistake the file is read as the proxy runs it.
    let fine = text.replace("\"fast\"", "\"300ms\"");
    let r = audit("stormguard.toml", &fine).unwrap();
    assert!(r.findings.iter().all(|f| f.rule != Rule::RefusedConfig), "{:#?}", r.findings);
    assert_eq!(r.layers[0].per_try_timeout, Some(Duration::from_millis(300)));
}
