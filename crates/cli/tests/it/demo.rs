//! `stormguard demo`: a short run must show the storm on the naive path and the budget holding
//! on the stormguard path, and write a well-formed HTML report with its charts.
//!
//! Only counts decide: amplification (attempts at the upstream per request sent) and the
//! time-weighted mean in flight, both measured by the upstreams. Maxima and wall-clock times
//! do not (a loaded CI machine may stretch a latency, never a count).

use assert_cmd::Command;
use serde_json::Value;

/// What the budget allows over the run: 25 % of first tries, plus its reserve of 1/s over a
/// 10 s window (10 retries of 1 600 requests) and the credit a 10-second window carries.
const BUDGET_AMPLIFICATION: f64 = 1.25;
const SLACK: f64 = 0.05;

/// Checks that every element that is opened is closed, in order (HTML void elements and
/// self-closed SVG elements excepted), that the document is one `<html>` element, and returns
/// the names of the elements seen, in order.
fn balanced_tags(html: &str) -> Result<Vec<String>, String> {
    const VOID: [&str; 6] = ["meta", "br", "hr", "img", "link", "input"];
    let mut stack: Vec<String> = Vec::new();
    let mut seen = Vec::new();
    let mut rest = html;
    while let Some(open) = rest.find('<') {
        rest = &rest[open..];
        if let Some(r) = rest.strip_prefix("<!--") {
            let end = r.find("-->").ok_or("unterminated comment")?;
            rest = &r[end + 3..];
            continue;
        }
        let end = rest.find('>').ok_or("unterminated tag")?;
        let tag = &rest[1..end];
        rest = &rest[end + 1..];
        if tag.starts_with('!') || tag.starts_with('?') {
            continue;
        }
        if let Some(name) = tag.strip_prefix('/') {
            let name = name.trim().to_ascii_lowercase();
            match stack.pop() {
                Some(top) if top == name => {}
                other => return Err(format!("</{name}> closes {other:?}")),
            }
            if name == "style" || name == "script" {
                continue;
            }
            continue;
        }
        let name: String = tag
            .chars()
            .take_while(|c| !c.is_whitespace() && *c != '/')
            .collect::<String>()
            .to_ascii_lowercase();
        if name.is_empty() {
            return Err(format!("a `<` that opens no tag: <{tag}>"));
        }
        seen.push(name.clone());
        if tag.ends_with('/') || VOID.contains(&name.as_str()) {
            continue;
        }
        if name == "style" || name == "script" {
            // Raw text up to the closing tag.
            let close = format!("</{name}>");
            let end = rest.find(&close).ok_or(format!("unterminated <{name}>"))?;
            rest = &rest[end + close.len()..];
            seen.push(format!("/{name}"));
            continue;
        }
        stack.push(name);
    }
    if !stack.is_empty() {
        return Err(format!("left open: {stack:?}"));
    }
    Ok(seen)
}

#[test]
fn the_checker_catches_unbalanced_html() {
    assert!(balanced_tags("<html><body><p>a<br>b</p></body></html>").is_ok());
    assert!(balanced_tags("<html><body><p>a</body></html>").is_err());
    assert!(balanced_tags("<html><svg><g></svg></html>").is_err());
    assert!(balanced_tags("<html><div>").is_err());
}

#[test]
fn the_budget_holds_where_naive_retries_storm() {
    let report =
        std::env::temp_dir().join(format!("stormguard-demo-test-{}.html", std::process::id()));
    let out = Command::cargo_bin("stormguard")
        .unwrap()
        .args(["demo", "--duration", "10s", "--json", "--report"])
        .arg(&report)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "exit {:?}: {stderr}", out.status);
    assert!(stderr.contains("/dashboard"), "the dashboard URL is printed while it runs: {stderr}");
    let v: Value = serde_json::from_slice(&out.stdout).expect("--json prints one object");
    let num = |path: &[&str]| {
        let mut x = &v;
        for k in path {
            x = &x[*k];
        }
        x.as_f64().unwrap_or_else(|| panic!("{path:?} is a number in {v}"))
    };
    let (naive_amp, guarded_amp) =
        (num(&["naive", "amplification"]), num(&["stormguard", "amplification"]));
    let (naive_mean, guarded_mean) =
        (num(&["naive", "in_flight", "mean"]), num(&["stormguard", "in_flight", "mean"]));
    let summary = format!(
        "amplification naive {naive_amp:.3}, stormguard {guarded_amp:.3}; \
         mean in flight naive {naive_mean:.1}, stormguard {guarded_mean:.1}"
    );
    // Both paths were driven by the same timetable, and the upstreams saw traffic.
    assert_eq!(num(&["naive", "sent"]), num(&["stormguard", "sent"]), "{summary}");
    assert!(num(&["stormguard", "sent"]) >= 1500.0, "{summary}");
    // The budget holds: retries stay within 25 % of what was sent (and a small slack).
    assert!(guarded_amp <= BUDGET_AMPLIFICATION + SLACK, "{summary}");
    // The unprotected path storms: visibly more load at its upstream ...
    assert!(naive_amp >= guarded_amp + 0.1, "{summary}");
    assert!(naive_amp > BUDGET_AMPLIFICATION - 0.1, "{summary}");
    // ... and more in flight there on average, where the cap holds the stormguard path.
    assert!(guarded_mean < naive_mean, "{summary}");
    assert!(guarded_mean <= num(&["cap"]), "{summary}");
    // Every phase of the worked example was played.
    let phases: Vec<&str> =
        v["phases"].as_array().unwrap().iter().map(|p| p["name"].as_str().unwrap()).collect();
    assert_eq!(phases, ["5 % errors", "20 % errors", "40 % errors", "latency spike", "recovery"]);
    // After the spike, the naive path's storm outlives its cause (its dependency, slowed by
    // the abandoned attempts, keeps timing out); the stormguard path recovers.
    let recovery = &v["phases"][4];
    let success = |path: &str| recovery[path]["success_rate"].as_f64().unwrap_or(0.0);
    assert!(
        success("stormguard") >= success("naive") + 0.3,
        "recovery success: naive {:.2}, stormguard {:.2}",
        success("naive"),
        success("stormguard")
    );

    let html = std::fs::read_to_string(&report).expect("the report was written");
    let _ = std::fs::remove_file(&report);
    assert!(html.starts_with("<!DOCTYPE html>"), "{}", &html[..60.min(html.len())]);
    let tags =
        balanced_tags(&html).unwrap_or_else(|e| panic!("the report is not well formed: {e}"));
    assert_eq!(tags.first().map(String::as_str), Some("html"));
    assert!(!tags.iter().any(|t| t == "script" || t == "link"), "self-contained, no scripts");
    let charts = tags.iter().filter(|t| *t == "svg").count();
    assert!(charts >= 5, "{charts} charts");
    // Every chart has drawn lines, not just axes.
    for svg in html.split("<svg").skip(1) {
        let svg = &svg[..svg.find("</svg>").unwrap()];
        assert!(svg.contains("<polyline"), "a chart without a line");
    }
    for needle in ["naive retry-once", "stormguard", "latency spike", "amplification"] {
        assert!(html.contains(needle), "the report mentions {needle}");
    }
}
