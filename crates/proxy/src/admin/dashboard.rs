//! `GET /dashboard`: one self-contained page (no external resources: a sidecar's admin port
//! often has no internet) that polls `/stats.json` every second and draws, per dependency, the
//! four signals over the last two minutes: the retry fraction against the budget, in flight
//! (p99 and max) against the cap, slot wait p99, denials by reason, and the success rate.
//!
//! The numbers are rendered into the page on every GET from the very JSON `/stats.json`
//! serves, so without JavaScript the page still shows them (and reloads itself every 5 s);
//! the script then keeps them current and draws the charts as inline SVG.

use std::fmt::Write as _;

use serde_json::Value;

/// The page: markup, style and script; `<!--DEPENDENCIES-->` marks where the numbers go.
const TEMPLATE: &str = include_str!("../../assets/dashboard.html");

fn esc(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
}

fn pct(x: f64) -> String {
    stormguard_core::format::percent(x, 1)
}

fn ratio(num: Option<u64>, den: Option<u64>) -> String {
    match (num, den) {
        (Some(n), Some(d)) if d > 0 => pct(n as f64 / d as f64),
        _ => "–".to_string(),
    }
}

fn ms(seconds: Option<f64>) -> String {
    match seconds {
        Some(s) if s * 1e3 < 1.0 => format!("≤ {:.2} ms", s * 1e3),
        Some(s) if s * 1e3 < 10.0 => format!("≤ {:.1} ms", s * 1e3),
        Some(s) => format!("≤ {:.0} ms", s * 1e3),
        None => "–".to_string(),
    }
}

/// The numbers of one dependency as `(field, heading, text)`, read from its `/stats.json`
/// object. The page's script computes the same fields from the same JSON.
pub(crate) fn numbers(d: &Value) -> Vec<(&'static str, &'static str, String)> {
    let u = |k: &str| d[k].as_u64();
    let n = |v: Option<u64>| v.map_or("–".to_string(), |v| v.to_string());
    let denied: Vec<String> = d["denied"]
        .as_object()
        .map(|m| {
            m.iter()
                .filter_map(|(k, v)| v.as_u64().filter(|n| *n > 0).map(|n| format!("{k} {n}")))
                .collect()
        })
        .unwrap_or_default();
    let cap = match (u("effective_cap"), u("cap")) {
        (Some(e), Some(c)) if e != c => format!("{e} of {c}"),
        (_, c) => n(c),
    };
    let attempts_ended = match (u("requests"), u("primaries_refused")) {
        (Some(r), Some(p)) => Some(r + p),
        _ => None,
    };
    vec![
        ("requests", "first tries", n(u("requests"))),
        ("retries", "retries", n(u("retries"))),
        // A concurrency budget's percent is a share of everything in flight: its fraction is
        // retries per attempt; every other policy's, retries per first try.
        (
            "retry_fraction",
            "retry fraction",
            if d["budget"]["policy"] == "concurrency" {
                ratio(u("retries"), u("requests").zip(u("retries")).map(|(r, t)| r + t))
            } else {
                ratio(u("retries"), u("requests"))
            },
        ),
        ("budget", "budget", d["budget"]["percent"].as_f64().map_or("–".to_string(), pct)),
        ("in_flight", "in flight now", n(u("in_flight"))),
        ("in_flight_p99", "in flight p99", n(u("in_flight_p99"))),
        ("in_flight_max", "max since last read", n(u("in_flight_max"))),
        ("cap", "cap", cap),
        ("held", "held for the upstream", n(u("held_slots"))),
        (
            "abandoned",
            "abandoned (finished, cut)",
            match (d["abandoned"]["finished"].as_u64(), d["abandoned"]["cut"].as_u64()) {
                (Some(f), Some(c)) => format!("{f}, {c}"),
                _ => "–".to_string(),
            },
        ),
        ("slot_wait_p99", "slot wait p99", ms(d["slot_wait"]["p99_seconds"].as_f64())),
        ("success", "success", ratio(u("succeeded"), attempts_ended)),
        ("denied", "denied", if denied.is_empty() { "0".to_string() } else { denied.join(", ") }),
    ]
}

/// The page with the numbers of `deps` (their `/stats.json` objects) in it.
pub(crate) fn page(deps: &[Value]) -> String {
    let mut sections = String::new();
    for d in deps {
        let name = d["name"].as_str().unwrap_or("");
        let _ = write!(
            sections,
            "<section class=\"dep\" data-dep=\"{}\">\n<h2>{}</h2>\n<table class=\"now\"><tr>",
            esc(name),
            esc(name)
        );
        let numbers = numbers(d);
        for (_, heading, _) in &numbers {
            let _ = write!(sections, "<th>{heading}</th>");
        }
        sections.push_str("</tr>\n<tr>");
        for (field, _, text) in &numbers {
            let _ = write!(sections, "<td data-f=\"{field}\">{}</td>", esc(text));
        }
        sections.push_str(
            "</tr></table>\n<p class=\"muted\">Counts since the proxy started; \
             “max since last read” is the high-water mark since the previous reading of \
             <code>/stats.json</code> (a Prometheus scrape keeps its own); “held for the \
             upstream” are slots of attempts timed out or abandoned by their caller that the \
             upstream is still working on. The charts show each second.</p>\n\
             <div class=\"grid\"></div>\n</section>\n",
        );
    }
    if deps.is_empty() {
        sections.push_str("<p>No dependencies configured.</p>\n");
    }
    TEMPLATE.replace("<!--DEPENDENCIES-->", &sections)
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn dep(name: &str) -> Value {
        json!({
            "name": name, "requests": 90, "retries": 9, "succeeded": 80, "primaries_refused": 10,
            "denied": { "budget": 3, "cap": 0, "queue": 10 },
            "cap": 20, "effective_cap": 20, "in_flight": 4, "in_flight_max": 19, "in_flight_p99": 18,
            "budget": { "percent": 0.25 },
            "slot_wait": { "p99_seconds": 0.0025 },
            "held_slots": 2, "abandoned": { "finished": 7, "cut": 1 },
        })
    }

    #[test]
    fn a_concurrency_budgets_fraction_is_per_attempt() {
        let mut d = dep("x");
        d["budget"] = json!({ "policy": "concurrency", "percent": 0.2 });
        let n = numbers(&d);
        let fraction = n.iter().find(|(f, _, _)| *f == "retry_fraction").unwrap();
        assert_eq!(fraction.2, "9.1 %", "9 retries of 99 attempts");
        d["budget"] = json!({ "policy": "ratio", "percent": 0.2 });
        let n = numbers(&d);
        let fraction = n.iter().find(|(f, _, _)| *f == "retry_fraction").unwrap();
        assert_eq!(fraction.2, "10.0 %", "9 retries per 90 first tries");
    }

    #[test]
    fn the_numbers_are_in_the_page_without_a_script() {
        let html = page(&[dep("pay<ments>")]);
        assert!(html.starts_with("<!DOCTYPE html>"));
        assert!(html.contains("<h2>pay&lt;ments&gt;</h2>"), "names are escaped");
        assert!(!html.contains("<!--DEPENDENCIES-->"));
        for cell in [
            "<td data-f=\"requests\">90</td>",
            "<td data-f=\"retry_fraction\">10.0 %</td>",
            "<td data-f=\"budget\">25.0 %</td>",
            "<td data-f=\"in_flight_max\">19</td>",
            "<td data-f=\"slot_wait_p99\">≤ 2.5 ms</td>",
            "<td data-f=\"success\">80.0 %</td>",
            "<td data-f=\"denied\">budget 3, queue 10</td>",
            "<td data-f=\"held\">2</td>",
            "<td data-f=\"abandoned\">7, 1</td>",
        ] {
            assert!(html.contains(cell), "{cell}");
        }
        // Self-contained: nothing is fetched from elsewhere.
        for external in ["src=\"http", "href=\"http", "//cdn", "@import"] {
            assert!(!html.contains(external), "{external}");
        }
        assert!(html.contains("/stats.json"));
        assert!(html.contains("<noscript>"));
    }

    #[test]
    fn missing_fields_show_a_dash() {
        let n = numbers(&json!({ "name": "x" }));
        assert!(n.iter().filter(|(f, _, _)| *f != "denied").all(|(_, _, t)| t == "–"), "{n:?}");
    }
}
