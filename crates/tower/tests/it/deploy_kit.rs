//! The monitoring kit in `deploy/` names only metrics a scrape of the library's registry exports
//! (the proxy's own series are checked against a running proxy in
//! `crates/proxy/tests/it/deploy_kit.rs`), the dashboard is valid JSON, and every alert's
//! `runbook_url` lands on a heading of `docs/runbook.md`.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::Arc;

use prometheus_client::registry::Registry;
use stormguard_core::adaptive::AdaptiveConfig;
use stormguard_core::breaker::BreakerConfig;
use stormguard_core::clock::ManualClock;
use stormguard_tower::{Dependency, DependencyConfig};

/// Series only the proxy exports (its own collector): skipped here, and checked with every other
/// name against a running proxy's scrape by `crates/proxy/tests/it/deploy_kit.rs`.
const PROXY_ONLY: [&str; 2] = ["stormguard_retries_enabled", "stormguard_proxy_refused_total"];

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn read(rel: &str) -> String {
    let p = root().join(rel);
    std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// Metric families and their type, from the `# TYPE` lines of a real scrape of the library.
fn scraped_families() -> (BTreeMap<String, String>, String) {
    let mut config = DependencyConfig::new("payments");
    config.breaker = Some(BreakerConfig::default()); // stormguard_breaker_state needs one
    let dep = Dependency::try_new(config).unwrap();
    // Several upstreams under a total cap: the per-upstream and total series.
    let mut models = DependencyConfig::new("models");
    models.upstreams = ["a.example:443", "b.example:443"]
        .map(|name| stormguard_tower::UpstreamSpec { name: name.into(), cap: 4, adaptive: None })
        .to_vec();
    models.total_cap = Some(6);
    models.limiter.adaptive = Some(AdaptiveConfig::new(2, 8));
    let models = Dependency::try_new(models).unwrap();
    // An adaptive cap on a manual clock, one window of answers closed: its latencies are known.
    let clock = ManualClock::new();
    let mut llm = DependencyConfig::new("llm");
    llm.limiter.adaptive = Some(AdaptiveConfig::new(4, 40));
    let llm = Dependency::with_clock(llm, Arc::new(clock.clone())).unwrap();
    let permits: Vec<_> = (0..10)
        .map(|_| llm.upstream().limiter.try_acquire(stormguard_core::AttemptKind::Primary).unwrap())
        .collect();
    clock.advance(std::time::Duration::from_secs(1));
    for mut p in permits {
        p.answered(false);
    }
    let mut registry = Registry::default();
    stormguard_tower::metrics::register(&mut registry, &dep);
    stormguard_tower::metrics::register(&mut registry, &models);
    stormguard_tower::metrics::register(&mut registry, &llm);
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
    let families = text
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .map(|l| {
            let mut it = l.split_whitespace();
            (it.next().unwrap().to_string(), it.next().unwrap().to_string())
        })
        .collect();
    (families, text)
}

/// Every token `stormguard_[a-z_]+` in `text`.
fn metric_tokens(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut rest = text;
    while let Some(i) = rest.find("stormguard_") {
        let tail = &rest[i..];
        let end = tail
            .char_indices()
            .find(|(_, c)| !(c.is_ascii_lowercase() || *c == '_'))
            .map_or(tail.len(), |(j, _)| j);
        // A token that continues an identifier (e.g. `xstormguard_`) is not a metric name.
        let starts_word =
            rest[..i].chars().last().is_none_or(|c| !(c.is_alphanumeric() || c == '_'));
        if starts_word {
            out.insert(tail[..end].trim_end_matches('_').to_string());
        }
        rest = &tail[end..];
    }
    out
}

/// Whether `token` is a name PromQL can query (or prose can name) given the families: a gauge
/// by its name, a counter only with `_total`, a histogram by `_bucket`/`_sum`/`_count` (or its
/// family name, as prose names it).
fn resolves(token: &str, families: &BTreeMap<String, String>) -> Result<(), String> {
    if let Some(t) = families.get(token) {
        return match t.as_str() {
            "gauge" | "histogram" => Ok(()),
            other => Err(format!("{token} is a {other}: query it as {token}_total")),
        };
    }
    for (suffix, kind) in [
        ("_total", "counter"),
        ("_bucket", "histogram"),
        ("_sum", "histogram"),
        ("_count", "histogram"),
    ] {
        if let Some(base) = token.strip_suffix(suffix) {
            match families.get(base) {
                Some(t) if t == kind => return Ok(()),
                Some(t) => return Err(format!("{token}: {base} is a {t}, not a {kind}")),
                None => {}
            }
        }
    }
    Err(format!("{token} is not exported"))
}

/// The values of `reason=~"…"` matchers (in YAML or JSON-escaped form).
fn reason_matchers(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for part in text.split("reason=~").skip(1) {
        let part = part.trim_start_matches('\\').trim_start_matches('"');
        let end = part.find(['"', '\\']).expect("a closed matcher");
        out.extend(part[..end].split('|').map(str::to_string));
    }
    out
}

/// GitHub-style heading anchors of a markdown file.
fn anchors(markdown: &str) -> BTreeSet<String> {
    markdown
        .lines()
        .filter(|l| l.starts_with('#'))
        .map(|l| {
            l.trim_start_matches('#')
                .trim()
                .to_lowercase()
                .chars()
                .filter_map(|c| match c {
                    ' ' => Some('-'),
                    c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
                    _ => None,
                })
                .collect()
        })
        .collect()
}

#[tokio::test]
async fn deploy_kit_names_only_real_metrics() {
    let (families, text) = scraped_families();
    assert!(families.len() > 20, "scrape too small:\n{text}");
    for name in PROXY_ONLY {
        assert!(resolves(name, &families).is_err(), "the library exports {name}: not proxy-only");
    }
    let reasons: BTreeSet<String> =
        stormguard_tower::Denied::ALL.iter().map(|d| d.as_str().to_string()).collect();
    for file in ["deploy/prometheus/stormguard-alerts.yaml", "deploy/grafana/stormguard.json"] {
        let body = read(file);
        let tokens = metric_tokens(&body);
        assert!(tokens.len() >= 8, "{file}: only {tokens:?}");
        let bad: Vec<String> = tokens
            .iter()
            .filter(|t| !PROXY_ONLY.contains(&t.as_str()))
            .filter_map(|t| resolves(t, &families).err())
            .collect();
        assert!(bad.is_empty(), "{file}:\n  {}\nexported: {families:?}", bad.join("\n  "));
        for r in reason_matchers(&body) {
            assert!(reasons.contains(&r), "{file}: reason {r:?} is not one of {reasons:?}");
        }
    }
}

#[test]
fn dashboard_is_json_with_the_panels() {
    let json: serde_json::Value =
        serde_json::from_str(&read("deploy/grafana/stormguard.json")).unwrap();
    let vars = json["templating"]["list"].as_array().unwrap();
    assert!(vars.iter().any(|v| v["name"] == "dependency"), "no dependency variable");
    let panels = json["panels"].as_array().unwrap();
    let exprs: Vec<&str> = panels
        .iter()
        .flat_map(|p| p["targets"].as_array().unwrap())
        .map(|t| t["expr"].as_str().unwrap())
        .collect();
    for e in &exprs {
        assert!(e.contains("dependency=~\"$dependency\""), "not filtered by $dependency: {e}");
    }
    for needed in [
        "stormguard_retries_total",
        "stormguard_budget_percent",
        "stormguard_budget_utilization",
        "stormguard_in_flight_bucket",
        "stormguard_in_flight_max",
        "stormguard_cap",
        "stormguard_slot_wait_seconds_bucket",
        "stormguard_execution_seconds_bucket",
        "stormguard_denied_total",
        "stormguard_breaker_state",
        "stormguard_pushback_hold_seconds",
        "stormguard_oldest_permit_seconds",
        "stormguard_cap_configured",
        "stormguard_cap_floor",
        "stormguard_cap_adjustments_total",
        "stormguard_cap_latency_seconds",
    ] {
        assert!(exprs.iter().any(|e| e.contains(needed)), "no panel queries {needed}");
    }
}

#[test]
fn every_alert_has_a_runbook_section() {
    let rules = read("deploy/prometheus/stormguard-alerts.yaml");
    let headings = anchors(&read("docs/runbook.md"));
    let mut alerts = Vec::new();
    let mut urls = Vec::new();
    for line in rules.lines().map(str::trim) {
        if let Some(a) = line.strip_prefix("- alert:") {
            alerts.push(a.trim().to_string());
        } else if let Some(u) = line.strip_prefix("runbook_url:") {
            urls.push(u.trim().trim_matches('"').to_string());
        }
    }
    assert_eq!(alerts.len(), 11, "{alerts:?}");
    assert_eq!(urls.len(), alerts.len(), "every alert needs one runbook_url: {urls:?}");
    assert_eq!(rules.matches("severity:").count(), alerts.len());
    for (alert, url) in alerts.iter().zip(&urls) {
        let (page, anchor) =
            url.split_once('#').unwrap_or_else(|| panic!("{alert}: {url} has no #anchor"));
        assert!(page.ends_with("docs/runbook.md"), "{alert}: {url}");
        assert!(
            headings.contains(anchor),
            "{alert}: #{anchor} is not a heading of docs/runbook.md"
        );
        assert_eq!(anchor, alert.to_lowercase(), "{alert}: the anchor should be its own section");
    }
}
