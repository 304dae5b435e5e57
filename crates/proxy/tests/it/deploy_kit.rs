//! The monitoring kit in `deploy/` against a running proxy: every metric the alert rules (their
//! `expr`) and the Grafana dashboard (its targets' `expr`) query is in a real scrape of the
//! admin listener's `/metrics`, with the type the query assumes (`_bucket` of a histogram,
//! `_total` of a counter, a bare name of a gauge), and every label matcher in them names a
//! label, and a value, that the series carry. On 127.0.0.1 with ephemeral ports.

use crate::common;

use common::*;

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use stormguard_chaos::{ChaosServer, Phase};
use stormguard_core::adaptive::AdaptiveConfig;
use stormguard_core::backoff::BackoffConfig;
use stormguard_core::breaker::BreakerConfig;
use stormguard_proxy::config::{ProxyConfig, ProxyDependency, RouteConfig};
use stormguard_proxy::start;

fn read(rel: &str) -> String {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..").join(rel);
    std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// The `expr` of every rule in a Prometheus rules file: inline, or a `|`/`>` block scalar
/// (every following line indented deeper than the key).
fn rule_exprs(yaml: &str) -> Vec<String> {
    let indent = |l: &str| l.len() - l.trim_start().len();
    let lines: Vec<&str> = yaml.lines().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        let line = lines[i];
        i += 1;
        let Some(value) = line.trim_start().strip_prefix("expr:") else { continue };
        let value = value.trim();
        if value.starts_with('|') || value.starts_with('>') {
            let mut body = Vec::new();
            while i < lines.len() && (lines[i].trim().is_empty() || indent(lines[i]) > indent(line))
            {
                body.push(lines[i].trim());
                i += 1;
            }
            out.push(body.join("\n"));
        } else {
            out.push(value.trim_matches(['"', '\'']).to_string());
        }
    }
    out
}

/// The `expr` of every target of every panel (rows' nested panels included).
fn dashboard_exprs(dashboard: &serde_json::Value) -> Vec<String> {
    let mut out = Vec::new();
    for panel in dashboard["panels"].as_array().into_iter().flatten() {
        for t in panel["targets"].as_array().into_iter().flatten() {
            out.push(t["expr"].as_str().expect("a target with an expr").to_string());
        }
        out.extend(dashboard_exprs(panel));
    }
    out
}

/// One vector selector's metric name and its label matchers `(label, op, value)`.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct Selector {
    name: String,
    matchers: Vec<(String, String, String)>,
}

/// The `stormguard_…` selectors of a PromQL expression. A small lexer: string literals and
/// `#` comments are skipped, so a name inside a label value is not taken for a metric;
/// identifiers are `[a-zA-Z_:][a-zA-Z0-9_:]*`; a `{…}` right after a name is its matchers.
fn selectors(expr: &str) -> Vec<Selector> {
    let chars: Vec<char> = expr.chars().collect();
    let ident = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == ':';
    let string_end = |start: usize| {
        let quote = chars[start];
        let mut j = start + 1;
        while j < chars.len() && chars[j] != quote {
            j += if chars[j] == '\\' { 2 } else { 1 };
        }
        j.min(chars.len())
    };
    let mut out = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        if c == '"' || c == '\'' || c == '`' {
            i = string_end(i) + 1;
        } else if c == '#' {
            while i < chars.len() && chars[i] != '\n' {
                i += 1;
            }
        } else if ident(c) {
            let start = i;
            while i < chars.len() && ident(chars[i]) {
                i += 1;
            }
            let word: String = chars[start..i].iter().collect();
            // Digits start numbers and durations (`5m`), never a metric.
            if !word.starts_with("stormguard_") {
                continue;
            }
            let mut matchers = Vec::new();
            let mut j = i;
            while j < chars.len() && chars[j].is_whitespace() {
                j += 1;
            }
            if j < chars.len() && chars[j] == '{' {
                j += 1;
                loop {
                    while j < chars.len() && (chars[j].is_whitespace() || chars[j] == ',') {
                        j += 1;
                    }
                    if j >= chars.len() || chars[j] == '}' {
                        break;
                    }
                    let l0 = j;
                    while j < chars.len() && ident(chars[j]) {
                        j += 1;
                    }
                    let label: String = chars[l0..j].iter().collect();
                    while j < chars.len() && chars[j].is_whitespace() {
                        j += 1;
                    }
                    let o0 = j;
                    while j < chars.len() && "=!~".contains(chars[j]) {
                        j += 1;
                    }
                    let op: String = chars[o0..j].iter().collect();
                    while j < chars.len() && chars[j].is_whitespace() {
                        j += 1;
                    }
                    assert!(
                        !label.is_empty() && !op.is_empty() && j < chars.len(),
                        "cannot read the matchers of {word} in {expr}"
                    );
                    let end = string_end(j);
                    let value: String = chars[j + 1..end].iter().collect();
                    matchers.push((label, op, value));
                    j = end + 1;
                }
                i = j + 1;
            }
            out.push(Selector { name: word, matchers });
        } else {
            i += 1;
        }
    }
    out
}

/// A scrape in the OpenMetrics text format: each family's type (`# TYPE`), and each sample
/// name's label sets.
#[derive(Debug, Default)]
struct Scrape {
    types: BTreeMap<String, String>,
    samples: BTreeMap<String, Vec<BTreeMap<String, String>>>,
}

impl Scrape {
    fn parse(text: &str) -> Scrape {
        let mut s = Scrape::default();
        for line in text.lines() {
            if let Some(t) = line.strip_prefix("# TYPE ") {
                let (name, kind) = t.split_once(' ').expect("# TYPE name type");
                s.types.insert(name.to_string(), kind.to_string());
                continue;
            }
            if line.starts_with('#') || line.is_empty() {
                continue;
            }
            let name_end = line.find(['{', ' ']).expect("a sample has a value");
            let mut labels = BTreeMap::new();
            if line[name_end..].starts_with('{') {
                let body = &line[name_end + 1..line.rfind('}').expect("closed labels")];
                // Label values here are names and numbers: no escaped quotes or commas.
                for pair in body.split(',').filter(|p| !p.is_empty()) {
                    let (k, v) = pair.split_once('=').expect("label=\"value\"");
                    labels.insert(k.to_string(), v.trim_matches('"').to_string());
                }
            }
            s.samples.entry(line[..name_end].to_string()).or_default().push(labels);
        }
        s
    }

    /// Whether `name` is a series of this scrape queried as its type allows: a gauge by its
    /// name, a counter by `_total`, a histogram by `_bucket`, `_sum` or `_count`.
    fn check_name(&self, name: &str) -> Result<(), String> {
        let family = match self.types.get(name).map(String::as_str) {
            Some("gauge" | "unknown") => name,
            Some(other) => return Err(format!("{name} is a {other}: query it with a suffix")),
            None => {
                let found = [
                    ("_total", &["counter"][..]),
                    ("_bucket", &["histogram", "gaugehistogram"][..]),
                    ("_sum", &["histogram", "summary"][..]),
                    ("_count", &["histogram", "summary"][..]),
                ]
                .into_iter()
                .find_map(|(suffix, kinds)| {
                    let base = name.strip_suffix(suffix)?;
                    Some((base, kinds, self.types.get(base)?))
                });
                let Some((base, kinds, kind)) = found else {
                    return Err(format!("{name}: no such family in the scrape"));
                };
                if !kinds.contains(&kind.as_str()) {
                    return Err(format!("{name}: {base} is a {kind}, not a {}", kinds.join("/")));
                }
                base
            }
        };
        match self.samples.get(name) {
            Some(series) if !series.is_empty() => Ok(()),
            _ => Err(format!("{name}: the family {family} is declared but has no {name} series")),
        }
    }

    /// Whether each matcher names a label of `sel`'s series, and each alternative of a
    /// `=~"a|b"` (or value of `="a"`) is a value some series has.
    fn check_matchers(&self, sel: &Selector) -> Result<(), String> {
        let series = &self.samples[&sel.name];
        for (label, op, value) in &sel.matchers {
            let values: BTreeSet<&str> =
                series.iter().filter_map(|l| l.get(label).map(String::as_str)).collect();
            if values.is_empty() {
                return Err(format!("{}: no series has the label {label}", sel.name));
            }
            // Grafana variables and real regexes are left to Prometheus.
            let literal =
                |v: &str| v.chars().all(|c| c.is_ascii_alphanumeric() || "_-".contains(c));
            let wanted: Vec<&str> = match op.as_str() {
                "=~" => value.split('|').collect(),
                "=" => vec![value.as_str()],
                _ => Vec::new(),
            };
            for w in wanted.into_iter().filter(|w| literal(w)) {
                if !values.contains(w) {
                    return Err(format!("{}: {label}={w:?} is not among {values:?}", sel.name));
                }
            }
        }
        Ok(())
    }
}

async fn get(c: &Client<HttpConnector, Full<Bytes>>, uri: &str) -> (StatusCode, Bytes) {
    let req = Request::get(uri)
        .header("x-request-id", crate::common::request_id())
        .body(Full::new(Bytes::new()))
        .unwrap();
    let resp = tokio::time::timeout(Duration::from_secs(10), c.request(req))
        .await
        .unwrap_or_else(|_| panic!("GET {uri}: no answer in 10 s"))
        .unwrap();
    let status = resp.status();
    (status, resp.into_body().collect().await.unwrap().to_bytes())
}

/// A proxy with three dependencies, each with a breaker (one with a ratio budget, one with a
/// concurrency budget), two behind a route, one failing, two with an adaptive cap (one of them
/// with two upstreams): after a few requests (successes, and a failure that is retried) every
/// family is in the scrape — the adaptive cap's latencies once a window has closed.
async fn scrape_of_a_busy_proxy() -> Scrape {
    let healthy = chaos(Phase::default()).await;
    let failing = chaos(Phase { error_rate: 1.0, status: 503, ..Phase::default() }).await;
    let dep = |name: &str, upstream: &ChaosServer| {
        let mut d = ProxyDependency::new(name, upstream.url("").parse().unwrap());
        d.breaker = Some(BreakerConfig::default());
        d.backoff = BackoffConfig::parse_range("1ms..2ms").unwrap();
        d
    };
    // An adaptive cap whose window closes at its tenth answer (a window's least time, 1 ns, has
    // passed by then): its latency series are in the scrape after ten requests.
    let adaptive =
        Some(AdaptiveConfig { window: Duration::from_nanos(1), ..AdaptiveConfig::new(2, 40) });
    let mut payments = dep("payments", &healthy);
    payments.adaptive = adaptive;
    let mut config = ProxyConfig::single("127.0.0.1:0".parse().unwrap(), payments);
    // ledger's budget is a concurrency one: the rules and the dashboard read each policy's
    // percent by the `policy` label, so both values must be in the scrape.
    let mut ledger = dep("ledger", &failing);
    ledger.budget = "concurrency:percent=0.2,min=3".parse().unwrap();
    config.dependencies.push(ledger);
    // models has two upstreams under a total cap: the per-upstream and total series.
    let mut models = dep("models", &healthy);
    models.upstreams.push(failing.url("").parse().unwrap());
    models.total_cap = Some(30);
    models.adaptive = adaptive;
    config.dependencies.push(models);
    config.routes.push(RouteConfig {
        host: None,
        path_prefix: "/models".into(),
        dependency: "models".into(),
        budget: None,
        idempotent: false,
    });
    config.routes.push(RouteConfig {
        host: None,
        path_prefix: "/ledger".into(),
        dependency: "ledger".into(),
        budget: None,
        idempotent: false,
    });
    config.admin = Some("127.0.0.1:0".parse().unwrap());
    let p = start(config).await.unwrap();
    let c = Client::builder(TokioExecutor::new()).build_http();
    let proxy = format!("http://{}", p.listen_addrs()[0]);
    for _ in 0..10 {
        assert_eq!(get(&c, &format!("{proxy}/")).await.0, StatusCode::OK);
    }
    assert_eq!(get(&c, &format!("{proxy}/models/x")).await.0, StatusCode::OK);
    for _ in 0..2 {
        assert_eq!(get(&c, &format!("{proxy}/ledger/x")).await.0, StatusCode::SERVICE_UNAVAILABLE);
    }
    // The tenth answer's slot comes back as its body ends, which the client may see first: wait
    // (10 s at most) for the window it closes.
    let admin = format!("http://{}", p.admin_addr().unwrap());
    let closed = async {
        loop {
            let (_, body) = get(&c, &format!("{admin}/stats.json")).await;
            let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
            if v["dependencies"][0]["adaptive"]["current_seconds"].is_number() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(10), closed)
        .await
        .expect("payments' adaptive cap closed no window after ten answers in 10 s");
    let (status, body) = get(&c, &format!("{admin}/metrics")).await;
    assert_eq!(status, StatusCode::OK);
    p.shutdown().await;
    let text = String::from_utf8(body.to_vec()).unwrap();
    assert!(text.ends_with("# EOF\n"), "{text}");
    let scrape = Scrape::parse(&text);
    // The traffic reached the series the kit reads.
    let value = |name: &str, dep: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(&format!("{name}{{dependency=\"{dep}\"}} ")))
            .unwrap_or_else(|| panic!("no {name} for {dep}:\n{text}"))
            .parse::<f64>()
            .unwrap()
    };
    assert_eq!(value("stormguard_requests_total", "payments"), 10.0, "{text}");
    assert_eq!(value("stormguard_requests_total", "ledger"), 2.0, "{text}");
    assert!(value("stormguard_retries_total", "ledger") >= 1.0, "the failures were not retried");
    scrape
}

/// Every selector of every expression checked against the scrape; returns the names seen.
fn check_exprs(file: &str, exprs: &[String], scrape: &Scrape) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let mut bad = Vec::new();
    for expr in exprs {
        let sels = selectors(expr);
        if sels.is_empty() {
            bad.push(format!("names no stormguard_ metric: {expr}"));
        }
        for sel in sels {
            names.insert(sel.name.clone());
            if let Err(e) = scrape.check_name(&sel.name).and_then(|()| scrape.check_matchers(&sel))
            {
                bad.push(e);
            }
        }
    }
    assert!(
        bad.is_empty(),
        "{file} queries what the proxy does not export:\n  {}\nthe scrape's families: {:?}",
        bad.join("\n  "),
        scrape.types
    );
    names
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_metric_the_rules_and_the_dashboard_query_is_in_the_proxys_scrape() {
    let scrape = scrape_of_a_busy_proxy().await;

    let rules = read("deploy/prometheus/stormguard-alerts.yaml");
    let exprs = rule_exprs(&rules);
    assert_eq!(exprs.len(), rules.matches("- alert:").count(), "one expr per alert: {exprs:?}");
    let rule_names = check_exprs("stormguard-alerts.yaml", &exprs, &scrape);

    let dashboard: serde_json::Value =
        serde_json::from_str(&read("deploy/grafana/stormguard.json")).unwrap();
    let exprs = dashboard_exprs(&dashboard);
    assert!(exprs.len() >= 10, "only {} dashboard targets", exprs.len());
    let dashboard_names = check_exprs("stormguard.json", &exprs, &scrape);

    // The four signals and the proxy's own switch are all read somewhere.
    let all: BTreeSet<&str> =
        rule_names.iter().chain(&dashboard_names).map(|s| s.as_str()).collect();
    for needed in [
        "stormguard_requests_total",
        "stormguard_retries_total",
        "stormguard_budget_percent",
        "stormguard_budget_utilization",
        "stormguard_denied_total",
        "stormguard_in_flight_bucket",
        "stormguard_cap",
        "stormguard_slot_wait_seconds_bucket",
        "stormguard_execution_seconds_bucket",
        "stormguard_oldest_permit_seconds",
        "stormguard_retries_enabled",
        "stormguard_cap_floor",
        "stormguard_cap_adjustments_total",
        "stormguard_cap_latency_seconds",
        "stormguard_upstream_cap_floor",
    ] {
        assert!(all.contains(needed), "nothing in deploy/ queries {needed}: {all:?}");
    }
}

/// The lexer takes names from selectors and function arguments, not from strings or comments,
/// and reads matchers; the scrape check refuses a name used against its type.
#[test]
fn selectors_and_type_checks() {
    let sels = selectors(
        "sum by (dependency) (rate(stormguard_denied_total{reason=~\"budget|cap\", dependency!=\"stormguard_x\"}[5m]))\n\
         # stormguard_commented_out\n\
         / on (dependency) stormguard_cap - 1 > bool stormguard_in_flight_bucket {le=\"+Inf\"}",
    );
    let names: Vec<&str> = sels.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(names, ["stormguard_denied_total", "stormguard_cap", "stormguard_in_flight_bucket"]);
    assert_eq!(
        sels[0].matchers,
        [
            ("reason".into(), "=~".into(), "budget|cap".into()),
            ("dependency".into(), "!=".into(), "stormguard_x".into())
        ]
    );
    assert_eq!(sels[2].matchers, [("le".into(), "=".into(), "+Inf".into())]);

    let scrape = Scrape::parse(
        "# TYPE stormguard_requests counter\n\
         stormguard_requests_total{dependency=\"a\"} 1\n\
         # TYPE stormguard_cap gauge\n\
         stormguard_cap{dependency=\"a\"} 4\n\
         # TYPE stormguard_in_flight histogram\n\
         stormguard_in_flight_bucket{le=\"1.0\",dependency=\"a\"} 1\n\
         stormguard_in_flight_sum{dependency=\"a\"} 1\n\
         stormguard_in_flight_count{dependency=\"a\"} 1\n\
         # TYPE stormguard_denied counter\n\
         # EOF\n",
    );
    for ok in ["stormguard_requests_total", "stormguard_cap", "stormguard_in_flight_bucket"] {
        assert_eq!(scrape.check_name(ok), Ok(()), "{ok}");
    }
    for bad in [
        "stormguard_requests",        // a counter queried bare
        "stormguard_cap_total",       // a gauge as a counter
        "stormguard_requests_bucket", // a counter as a histogram
        "stormguard_in_flight",       // a histogram queried bare
        "stormguard_in_flight_total",
        "stormguard_denied_total", // declared, but no series
        "stormguard_bogus",
    ] {
        assert!(scrape.check_name(bad).is_err(), "{bad} should be refused");
    }
    let sel = |m: &str| selectors(m).remove(0);
    assert!(scrape.check_matchers(&sel("stormguard_cap{dependency=~\"a|$dependency\"}")).is_ok());
    assert!(scrape.check_matchers(&sel("stormguard_cap{dependency=\"b\"}")).is_err());
    assert!(scrape.check_matchers(&sel("stormguard_cap{reason=\"budget\"}")).is_err());
}
