//! The audit over fixture configs: every known finding, exactly, and clean configs clean.

use std::path::{Path, PathBuf};

use stormguard_audit::graph::{Factor, GraphError};
use stormguard_audit::{AuditError, AuditOptions, Budget, Report, audit_paths, audit_sources};

fn fixture(p: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(p)
}

fn audit(p: &str) -> Report {
    audit_paths(&[fixture(p)], None, &AuditOptions::default()).unwrap()
}

/// `(severity, rule, line)` for every finding, in report order.
fn found(r: &Report) -> Vec<(&'static str, &'static str, u32)> {
    r.findings.iter().map(|f| (f.severity.as_str(), f.rule.id(), f.location.line)).collect()
}

#[test]
fn envoy_findings() {
    let r = audit("envoy/bad.yaml");
    assert_eq!(
        found(&r),
        vec![
            ("error", "amplification", 29),
            ("error", "non-idempotent-retry", 29),
            ("error", "floor-above-headroom", 50),
            ("warning", "timeout-exceeded", 29),
            ("warning", "cluster-without-retry-budget", 39),
            ("warning", "budget-too-high", 50),
            ("info", "default-retries", 37),
        ]
    );
    assert!(r.findings[0].resource.contains("orders-create"));
    assert_eq!(r.findings[4].resource, "cluster orders");
}

#[test]
fn clean_configs_have_no_findings() {
    for f in [
        "envoy/clean.yaml",
        "envoy/clean.json",
        "istio/clean.yaml",
        "grpc/clean.json",
        "linkerd/clean.yaml",
        "stormguard/clean.toml",
        "istio/budget_clean.yaml",
        "gateway/clean.yaml",
        "kuma/clean.yaml",
    ] {
        let r = audit(f);
        assert_eq!(found(&r), vec![], "{f}");
        assert!(r.layers.iter().any(|l| l.retries()), "{f} has a retry layer, so the check ran");
    }
}

#[test]
fn envoy_budget_caps_the_factor() {
    let r = audit("envoy/clean.json");
    let l = &r.layers[0];
    assert_eq!(l.attempts, Some(3));
    // A 25 % concurrency budget: 1 + 0.25/0.75 = 4/3.
    assert_eq!(stormguard_audit::graph::exact_factor(l), Factor::new(4, 3));
    assert_eq!(l.timeout, Some(std::time::Duration::from_secs(3)));
}

#[test]
fn istio_findings_and_skipped_kinds() {
    let r = audit("istio/bad.yaml");
    assert_eq!(
        found(&r),
        vec![
            ("error", "amplification", 27),
            ("error", "non-idempotent-retry", 27),
            ("warning", "unbudgeted-retries", 9),
            ("warning", "default-retries", 9),
            ("warning", "unbudgeted-retries", 27),
            ("warning", "timeout-exceeded", 27),
        ]
    );
    assert_eq!(r.documents, 4);
    assert_eq!(r.skipped.get("Deployment"), Some(&1));
}

/// Envoy's `retry_budget.budget_interval` is read: a value Envoy would refuse is a finding at
/// its line, and a good one changes nothing (clean.yaml states `10s`).
#[test]
fn envoy_budget_interval_is_read() {
    let text = std::fs::read_to_string(fixture("envoy/clean.yaml")).unwrap();
    assert!(text.contains("budget_interval: 10s"), "the clean fixture states an interval");
    let r = audit_sources(&[("clean.yaml".into(), text.clone())], None, &AuditOptions::default())
        .unwrap();
    assert_eq!(found(&r), vec![]);
    let bad = text.replace("budget_interval: 10s", "budget_interval: ten seconds");
    let r = audit_sources(&[("bad.yaml".into(), bad)], None, &AuditOptions::default()).unwrap();
    assert_eq!(found(&r), vec![("error", "unreadable-value", 31)]);
    assert!(r.findings[0].message.starts_with("`budget_interval: ten seconds` is not a duration"));
}

/// A DestinationRule's `trafficPolicy.retryBudget` bounds the routes to its host, and is
/// checked as Envoy's `retry_budget` is.
#[test]
fn istio_retry_budget() {
    let r = audit("istio/budget_bad.yaml");
    assert_eq!(
        found(&r),
        vec![("error", "floor-above-headroom", 29), ("warning", "budget-too-high", 29)]
    );
    assert!(r.findings[0].message.contains("minRetryConcurrency 50 is above http2MaxRequests 20"));
    let r = audit("istio/budget_clean.yaml");
    let route = &r.layers[0];
    assert_eq!(route.budget, Some(Budget::Concurrency { percent: 0.2 }));
    // 3 attempts, capped by a 20 % share at 1 + 0.2/0.8 = 5/4.
    assert_eq!(stormguard_audit::graph::exact_factor(route), Factor::new(5, 4));
    // Without the budget the route is unbudgeted: the budget is what keeps the fixture clean.
    let text = std::fs::read_to_string(fixture("istio/budget_clean.yaml")).unwrap();
    let unbudgeted = text.replace("retryBudget:", "notRead:");
    let r =
        audit_sources(&[("dr.yaml".into(), unbudgeted)], None, &AuditOptions::default()).unwrap();
    assert_eq!(found(&r), vec![("warning", "unbudgeted-retries", 11)]);
}

#[test]
fn gateway_api_findings() {
    let r = audit("gateway/bad.yaml");
    assert_eq!(
        found(&r),
        vec![
            ("error", "amplification", 18),
            ("warning", "unbudgeted-retries", 18),
            ("warning", "timeout-exceeded", 18),
            ("warning", "budget-too-high", 46),
        ]
    );
    assert_eq!(r.findings[0].resource, "HTTPRoute shop rules[0] (orders)");
    // attempts counts retries: 4 → 5 tries. The search rule takes its backend's budget.
    assert_eq!(r.layers[0].attempts, Some(5));
    assert_eq!(r.layers[1].budget, Some(Budget::Concurrency { percent: 0.8 }));
}

/// An XBackendTrafficPolicy's budget reaches a rule through the rule's backendRefs, and only
/// for the Service it targets in its namespace.
#[test]
fn gateway_api_budget_follows_the_backend() {
    let r = audit("gateway/clean.yaml");
    let catalog = &r.layers[0];
    assert_eq!(catalog.attempts, Some(3));
    assert_eq!(catalog.budget, Some(Budget::Concurrency { percent: 0.2 }));
    assert_eq!(catalog.per_try_timeout, Some(std::time::Duration::from_secs(1)));
    assert_eq!(catalog.retry_on, ["503"]);
    assert!(!r.layers[1].retries(), "a rule without retry does not retry");
    let text = std::fs::read_to_string(fixture("gateway/clean.yaml")).unwrap();
    for moved in [
        text.replace("    name: catalog\n  retryConstraint", "    name: other\n  retryConstraint"),
        text.replace("  name: catalog\n  namespace: shop", "  name: catalog\n  namespace: other"),
    ] {
        let r =
            audit_sources(&[("gw.yaml".into(), moved)], None, &AuditOptions::default()).unwrap();
        assert_eq!(found(&r), vec![("warning", "unbudgeted-retries", 19)]);
    }
    // The kind's name before Gateway API 1.3 is read too.
    let old = text.replace("kind: XBackendTrafficPolicy", "kind: BackendTrafficPolicy");
    let r = audit_sources(&[("gw.yaml".into(), old)], None, &AuditOptions::default()).unwrap();
    assert_eq!(r.layers[0].budget, Some(Budget::Concurrency { percent: 0.2 }));
}

#[test]
fn kuma_findings() {
    let r = audit("kuma/bad.yaml");
    assert_eq!(
        found(&r),
        vec![("error", "amplification", 18), ("warning", "unbudgeted-retries", 18)]
    );
    let l = &r.layers[0];
    assert_eq!(l.attempts, Some(6));
    assert_eq!(l.retry_on, ["5xx", "reset"]);
    let r = audit("kuma/clean.yaml");
    assert_eq!(r.layers[0].budget, Some(Budget::Slots(5)));
    assert_eq!(r.layers[0].retry_on, ["connect-failure", "refused-stream"]);
    // The same policy in Kuma's Universal form.
    let universal = "type: MeshRetry\nname: r\nmesh: default\nspec:\n  targetRef:\n    kind: Mesh\n  \
                     to:\n  - targetRef:\n      kind: Mesh\n    default:\n      http: {}\n";
    let r = audit_sources(&[("u.yaml".into(), universal.into())], None, &AuditOptions::default())
        .unwrap();
    // numRetries defaults to 1.
    assert_eq!(r.layers[0].attempts, Some(2));
    assert_eq!(found(&r), vec![("warning", "unbudgeted-retries", 11)]);
}

/// Linkerd 2.16's `retry.linkerd.io/*` annotations on an HTTPRoute are a Linkerd layer beside
/// the route's own (which does not retry here); they have no budget, so they are unbudgeted.
#[test]
fn linkerd_route_annotations() {
    let r = audit("linkerd/route_annotations.yaml");
    assert_eq!(found(&r), vec![("warning", "unbudgeted-retries", 8)]);
    let l = r.layers.iter().find(|l| l.format == stormguard_audit::Format::Linkerd).unwrap();
    assert_eq!(l.resource, "HTTPRoute books (retry.linkerd.io)");
    assert_eq!(l.attempts, Some(3));
    assert_eq!(l.per_try_timeout, Some(std::time::Duration::from_millis(300)));
    assert_eq!(l.timeout, Some(std::time::Duration::from_secs(1)));
}

/// A value in a new format that cannot be read is an error finding at its file and line, as
/// in every YAML format; text that is not YAML is the input error with line and column.
#[test]
fn new_formats_name_the_line_of_a_bad_value() {
    let bad = [
        ("gateway/clean.yaml", "attempts: 2", "attempts: two", 20, "retry.attempts"),
        ("gateway/clean.yaml", "percent: 20", "percent: most", 42, "budget.percent"),
        ("istio/budget_clean.yaml", "percent: 20", "percent: [20]", 29, "retryBudget.percent"),
        ("kuma/clean.yaml", "numRetries: 2", "numRetries: two", 18, "numRetries"),
    ];
    for (file, from, to, line, key) in bad {
        let text = std::fs::read_to_string(fixture(file)).unwrap().replace(from, to);
        let r = audit_sources(&[(file.into(), text)], None, &AuditOptions::default()).unwrap();
        let f = r.findings.iter().find(|f| f.rule.id() == "unreadable-value").unwrap();
        assert_eq!((f.location.file.as_str(), f.location.line), (file, line), "{file}");
        assert!(f.message.starts_with(&format!("`{key}: ")), "{}", f.message);
    }
    let text = std::fs::read_to_string(fixture("kuma/clean.yaml")).unwrap();
    let broken = text.replace("numRetries: 2", "numRetries: [2");
    let e =
        audit_sources(&[("kuma.yaml".into(), broken)], None, &AuditOptions::default()).unwrap_err();
    assert!(matches!(&e, AuditError::Syntax { line: 18 | 19, .. }), "{e}");
    assert!(e.to_string().starts_with("kuma.yaml:"), "{e}");
}

#[test]
fn istio_default_depends_on_version() {
    let text = std::fs::read_to_string(fixture("istio/bad.yaml")).unwrap();
    let src = [("bad.yaml".to_string(), text)];
    let old = AuditOptions { istio_version: "1.0".parse().unwrap(), ..AuditOptions::default() };
    let r = audit_sources(&src, None, &old).unwrap();
    assert!(!r.findings.iter().any(|f| f.rule.id() == "default-retries"));
    let reviews = r.layers.iter().find(|l| l.resource.contains("reviews")).unwrap();
    assert_eq!(reviews.attempts, Some(1));
    let r = audit_sources(&src, None, &AuditOptions::default()).unwrap();
    let reviews = r.layers.iter().find(|l| l.resource.contains("reviews")).unwrap();
    assert_eq!(reviews.attempts, Some(3));
}

#[test]
fn grpc_findings() {
    let r = audit("grpc/bad.json");
    assert_eq!(
        found(&r),
        vec![
            ("error", "amplification", 6),
            ("error", "unthrottled-hedging", 16),
            ("warning", "unbudgeted-retries", 6),
            ("info", "value-capped", 7),
        ]
    );
    // maxAttempts counts the first attempt and is capped at 5.
    assert_eq!(r.layers[0].attempts, Some(5));
}

#[test]
fn linkerd_findings() {
    let r = audit("linkerd/bad.yaml");
    assert_eq!(
        found(&r),
        vec![
            ("error", "non-idempotent-retry", 16),
            ("error", "amplification", 23),
            ("warning", "budget-too-high", 8),
            ("warning", "unbudgeted-retries", 23),
            ("warning", "timeout-exceeded", 23),
        ]
    );
    // ServiceProfile retries have no count limit: only the budget bounds them.
    assert_eq!(r.layers[0].attempts, None);
    assert_eq!(r.layers[1].attempts, Some(4));
}

#[test]
fn stormguard_findings() {
    let r = audit("stormguard/bad.toml");
    assert_eq!(
        found(&r),
        vec![
            ("error", "floor-above-headroom", 19),
            ("warning", "timeout-exceeded", 6),
            ("warning", "budget-too-high", 9),
        ]
    );
}

/// TOML that is not a stormguard config is skipped, even when it uses the same names: a
/// simulator scenario has a single `[dependency]` table, not `[[dependency]]` entries.
#[test]
fn other_toml_is_skipped() {
    let scenario = "[fleet]\nrate = 10\n\n[dependency]\ncapacity = 10\nservice_time = \"50ms\"\n\n\
                    [[policy]]\nretries = 1\n";
    let script = "[[phase]]\nerror_rate = 0.3\n";
    let r = audit_sources(
        &[("storm.toml".into(), scenario.into()), ("phases.toml".into(), script.into())],
        None,
        &AuditOptions::default(),
    )
    .unwrap();
    assert_eq!(r.skipped.get("toml"), Some(&2), "{:?}", r.skipped);
    assert!(r.findings.is_empty() && r.layers.is_empty());
    // A stormguard config beside them is still read, and broken TOML is still an input error.
    let config = "[[listener]]\nlisten = \"127.0.0.1:8080\"\ndependency = \"payments\"\n\
                  [[dependency]]\nname = \"payments\"\nupstreams = [\"http://127.0.0.1:9000\"]\n";
    let r = audit_sources(
        &[("storm.toml".into(), scenario.into()), ("sg.toml".into(), config.into())],
        None,
        &AuditOptions::default(),
    )
    .unwrap();
    assert_eq!(r.layers.len(), 1);
    let err = audit_sources(
        &[("bad.toml".into(), "[[dependency]\n".into())],
        None,
        &AuditOptions::default(),
    )
    .unwrap_err();
    assert!(matches!(err, AuditError::Syntax { line: 1, .. }), "{err:?}");
}

#[test]
fn three_hops_multiply_exactly() {
    let g = fixture("graph");
    let r =
        audit_paths(&[g.join("configs")], Some(&g.join("graph.toml")), &AuditOptions::default())
            .unwrap();
    assert_eq!(r.paths.len(), 1);
    let p = &r.paths[0];
    assert_eq!(p.services, ["web", "checkout", "payments", "ledger"]);
    let factors: Vec<Factor> = p.hops.iter().map(|h| h.layers[0].1).collect();
    assert_eq!(factors, [Factor::new(3, 1), Factor::new(3, 1), Factor::new(2, 1)]);
    assert_eq!(p.amplification, Factor::new(18, 1));
    assert_eq!(p.retrying_layers, 3);
    assert_eq!(p.worst_time, Some(std::time::Duration::from_secs(6)));
    let rules: Vec<&str> = r.findings.iter().map(|f| f.rule.id()).collect();
    assert!(rules.contains(&"stacked-retries"), "{rules:?}");
    let amp = r.findings.iter().find(|f| f.rule.id() == "amplification").unwrap();
    assert!(amp.message.starts_with("up to 18 attempts reach ledger"), "{}", amp.message);
}

#[test]
fn a_ratio_budget_caps_the_middle_hop() {
    let g = fixture("graph");
    let r = audit_paths(
        &[g.join("configs")],
        Some(&g.join("graph_budgeted.toml")),
        &AuditOptions::default(),
    )
    .unwrap();
    let p = &r.paths[0];
    // 3 × 1.2 × 2 = 7.2, exactly 36/5.
    assert_eq!(p.amplification, Factor::new(36, 5));
    assert_eq!(p.hops[1].layers[0].1, Factor::new(6, 5));
    // Still above 3: the unbudgeted hops dominate; with a higher limit it passes.
    assert!(r.findings.iter().any(|f| f.rule.id() == "amplification"));
    let lenient = AuditOptions { max_amplification: 7.2, ..AuditOptions::default() };
    let r =
        audit_paths(&[g.join("configs")], Some(&g.join("graph_budgeted.toml")), &lenient).unwrap();
    assert!(!r.findings.iter().any(|f| f.rule.id() == "amplification"));
}

#[test]
fn unknown_graph_ref_names_the_line() {
    let g = fixture("graph");
    let e = audit_paths(
        &[g.join("configs")],
        Some(&g.join("graph_unknown_ref.toml")),
        &AuditOptions::default(),
    )
    .unwrap_err();
    let AuditError::Config(e) = &e else { panic!("{e:?}") };
    assert_eq!(e.position(), Some((4, 8)), "{e}");
    assert_eq!(e.key().unwrap().to_string(), "call[0].via[0]");
    let name = "virtualservice/nope".to_string();
    assert_eq!(e.rule::<GraphError>(), Some(&GraphError::UnknownRef { name }));
    assert!(e.to_string().ends_with("graph_unknown_ref.toml:4:8: call[0].via[0]: `virtualservice/nope` names no retry layer in the audited configs"), "{e}");
}

#[test]
fn malformed_inputs_name_file_and_line() {
    let e =
        audit_paths(&[fixture("malformed/bad.json")], None, &AuditOptions::default()).unwrap_err();
    assert!(matches!(&e, AuditError::Syntax { line: 4, .. }), "{e}");
    assert!(e.to_string().contains("bad.json:4:"), "{e}");
    let e =
        audit_paths(&[fixture("malformed/bad.yaml")], None, &AuditOptions::default()).unwrap_err();
    assert!(matches!(&e, AuditError::Syntax { line: 5 | 6, .. }), "{e}");
    assert!(e.to_string().contains("bad.yaml:"), "{e}");
}

#[test]
fn directories_are_walked() {
    let r = audit_paths(&[fixture("envoy")], None, &AuditOptions::default()).unwrap();
    assert_eq!(r.files, 3);
    assert_eq!(r.findings.len(), 7);
}

#[test]
fn sarif_and_json_carry_every_finding() {
    let r = audit("envoy/bad.yaml");
    let sarif = stormguard_audit::output::to_sarif(&r);
    assert_eq!(sarif["version"], "2.1.0");
    let results = sarif["runs"][0]["results"].as_array().unwrap();
    assert_eq!(results.len(), 7);
    assert_eq!(results[0]["level"], "error");
    assert_eq!(results[0]["locations"][0]["physicalLocation"]["region"]["startLine"], 29);
    let json = stormguard_audit::output::to_json(&r);
    assert_eq!(json["findings"].as_array().unwrap().len(), 7);
    assert_eq!(json["findings"][0]["rule"], "amplification");
    assert_eq!(json["summary"]["errors"], 3);
}
