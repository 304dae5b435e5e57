//! `GET /dashboard`: one self-contained page (no external resources: a sidecar's admin port
//! often has no internet) that polls `/stats.json` every second and draws, per dependency, the
//! four signals over the last two minutes: the retry fraction against the budget, in flight
//! (p99 and max) against the cap, slot wait p99, denials by reason, and the success rate; and
//! among the numbers, the callers' own retries the proxy allowed and refused.
//!
//! A dependency with rate admission also has a panel of its provider's limits: per upstream
//! and quantity, what is available of the limit per minute, what is booked, any hold, and
//! whether it cools down; and a chart of what is available, as a share of each limit.
//!
//! A dependency with an adaptive cap has a panel of it: per upstream, the working cap against
//! its ceiling, its floor, the baseline and last window's latency, and the windows that raised
//! and lowered it; and, beside the in-flight chart, a chart of the working cap and the floor
//! against the ceiling.
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
        // Of them, the callers' own (allowed); and the callers' own refused.
        (
            "caller_retries",
            "callers' retries (allowed, refused)",
            match (d["caller_retries"]["allowed"].as_u64(), d["caller_retries"]["refused"].as_u64())
            {
                (Some(a), Some(r)) => format!("{a}, {r}"),
                _ => "–".to_string(),
            },
        ),
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

/// The quantities rate admission meters, as `/stats.json` names them, and as the panel does.
const QUANTITIES: [(&str, &str); 4] = [
    ("requests", "requests"),
    ("tokens", "tokens"),
    ("input_tokens", "input tokens"),
    ("output_tokens", "output tokens"),
];

/// The headings of the provider-limits panel; [`rate_rows`] fills one row per heading's order.
const RATE_HEADINGS: [&str; 6] =
    ["upstream", "quantity", "available / limit per minute", "reserved", "held", "cooling"];

/// The rows of the provider-limits panel, read from a dependency's `/stats.json` object: one
/// per upstream and quantity whose limit is known, one saying so for an upstream with none
/// known yet. `None` without rate admission. The page's script computes the same rows.
pub(crate) fn rate_rows(d: &Value) -> Option<Vec<[String; 6]>> {
    let upstreams = d["rate"]["upstreams"].as_array()?;
    let n = |v: &Value| v.as_u64().map_or("–".to_string(), |v| v.to_string());
    let mut rows = Vec::new();
    for u in upstreams {
        let name = u["name"].as_str().unwrap_or("").to_string();
        let cooling = if u["cooling"].as_bool() == Some(true) { "yes" } else { "no" };
        let before = rows.len();
        for (field, quantity) in QUANTITIES {
            let q = &u[field];
            let Some(limit) = q["limit_per_minute"].as_u64() else { continue };
            let held = match q["held_seconds"].as_f64() {
                Some(s) if s > 0.0 => format!("{s:.1} s"),
                _ => "–".to_string(),
            };
            rows.push([
                name.clone(),
                quantity.to_string(),
                format!("{} / {limit}", n(&q["available"])),
                n(&q["reserved"]),
                held,
                cooling.to_string(),
            ]);
        }
        if rows.len() == before {
            let none = || "–".to_string();
            rows.push([
                name,
                "no limit known yet".to_string(),
                none(),
                none(),
                none(),
                cooling.to_string(),
            ]);
        }
    }
    Some(rows)
}

/// The provider-limits panel of a dependency with rate admission; empty without it.
fn rate_panel(d: &Value) -> String {
    let Some(rows) = rate_rows(d) else { return String::new() };
    panel(
        "rate",
        "provider limits",
        &RATE_HEADINGS,
        &rows,
        "Rate admission's view of the provider's limits per minute (configured, or learned from \
         its headers): what may be sent now, what attempts not yet answered have booked, how \
         long a 429 or a spent quota still holds first tries, and whether an overloaded answer \
         cools the upstream down (first tries go to another meanwhile). Refusals are counted as \
         <code>rate</code> in denied.",
    )
}

/// A panel of a dependency's section: a table of `rows` under `headings`, and a note (HTML).
fn panel<const N: usize>(
    class: &str,
    title: &str,
    headings: &[&str; N],
    rows: &[[String; N]],
    note: &str,
) -> String {
    let mut html = format!(
        "<div class=\"{class}\">\n<h3>{title}</h3>\n<table class=\"now {class}\"><thead><tr>"
    );
    for heading in headings {
        let _ = write!(html, "<th>{heading}</th>");
    }
    html.push_str("</tr></thead>\n<tbody>");
    for row in rows {
        html.push_str("<tr>");
        for cell in row {
            let _ = write!(html, "<td>{}</td>", esc(cell));
        }
        html.push_str("</tr>");
    }
    let _ = write!(html, "</tbody></table>\n<p class=\"muted\">{note}</p>\n</div>\n");
    html
}

/// A mean latency: `50.0 ms`, `1.25 s`; a dash when not read yet.
fn latency(seconds: Option<f64>) -> String {
    match seconds {
        Some(s) if s < 1.0 => format!("{:.1} ms", s * 1e3),
        Some(s) => format!("{s:.2} s"),
        None => "–".to_string(),
    }
}

/// The headings of the adaptive-cap panel; [`adaptive_rows`] fills one row per heading's order.
const ADAPTIVE_HEADINGS: [&str; 7] = [
    "upstream",
    "working cap / ceiling",
    "floor",
    "baseline latency",
    "last window",
    "raised",
    "lowered",
];

/// The rows of the adaptive-cap panel, read from a dependency's `/stats.json` object: one per
/// upstream with several (their names), else one (`–`). `None` without an adaptive cap. The
/// page's script computes the same rows.
pub(crate) fn adaptive_rows(d: &Value) -> Option<Vec<[String; 7]>> {
    if !d["adaptive"].is_object() {
        return None;
    }
    let n = |v: &Value| v.as_u64().map_or("–".to_string(), |v| v.to_string());
    let row = |name: String, a: &Value| {
        [
            name,
            format!("{} / {}", n(&a["working_cap"]), n(&a["max"])),
            n(&a["min"]),
            latency(a["baseline_seconds"].as_f64()),
            latency(a["current_seconds"].as_f64()),
            n(&a["raised"]),
            n(&a["lowered"]),
        ]
    };
    let upstreams: Vec<_> = d["upstreams"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|u| u["adaptive"].is_object())
        .map(|u| row(u["name"].as_str().unwrap_or("").to_string(), &u["adaptive"]))
        .collect();
    Some(if upstreams.is_empty() {
        vec![row("–".to_string(), &d["adaptive"])]
    } else {
        upstreams
    })
}

/// The adaptive-cap panel of a dependency with one; empty without it.
fn adaptive_panel(d: &Value) -> String {
    let Some(rows) = adaptive_rows(d) else { return String::new() };
    panel(
        "adaptive",
        "adaptive cap",
        &ADAPTIVE_HEADINGS,
        &rows,
        "The working cap follows what the upstream can take, between its floor and its ceiling: \
         lowered at once when more than a tenth of a window's answers were overload refusals \
         (429, 503, 529) or timeouts, and, by Gradient2, a fifth of the way each window when its \
         answers were slower than the baseline; raised slowly when not and the cap was in use. \
         The cap in force is the working cap, unless the upstream's limit header holds it lower.",
    )
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
             upstream is still working on. The charts show each second.</p>\n",
        );
        sections.push_str(&adaptive_panel(d));
        sections.push_str(&rate_panel(d));
        sections.push_str("<div class=\"grid\"></div>\n</section>\n");
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

    /// The section of the dependency named `name` in `html`.
    fn section<'a>(html: &'a str, name: &str) -> &'a str {
        let start = html.find(&format!("data-dep=\"{name}\"")).expect("the section");
        let len = html[start..].find("</section>").expect("its end");
        &html[start..start + len]
    }

    #[test]
    fn the_provider_limits_panel_is_there_with_rate_admission_only() {
        let mut llm = dep("llm");
        llm["rate"] = json!({ "upstreams": [
            { "name": "openai", "cooling": false,
              "requests": { "limit_per_minute": 600, "available": 599, "reserved": 1, "held_seconds": 0.0 },
              "tokens": { "limit_per_minute": 40000, "available": 0, "reserved": 300, "held_seconds": 12.5 } },
            { "name": "azure", "cooling": true },
        ] });
        let html = page(&[llm, dep("plain")]);
        let with = section(&html, "llm");
        assert!(with.contains("<h3>provider limits</h3>"), "{with}");
        for row in [
            "<tr><td>openai</td><td>requests</td><td>599 / 600</td><td>1</td><td>–</td><td>no</td></tr>",
            "<tr><td>openai</td><td>tokens</td><td>0 / 40000</td><td>300</td><td>12.5 s</td><td>no</td></tr>",
            "<tr><td>azure</td><td>no limit known yet</td><td>–</td><td>–</td><td>–</td><td>yes</td></tr>",
        ] {
            assert!(with.contains(row), "{row}\n{with}");
        }
        // A quantity whose limit is not known is left out.
        assert!(!with.contains("input tokens"), "{with}");
        let without = section(&html, "plain");
        assert!(
            !without.contains("provider limits") && !without.contains("class=\"rate"),
            "{without}"
        );
        assert_eq!(rate_rows(&dep("plain")), None);
        // Rate admission on, nothing learned yet: the panel says so.
        let mut learning = dep("learning");
        learning["rate"] = json!({ "upstreams": [{ "name": "0", "cooling": false }] });
        let rows = rate_rows(&learning).unwrap();
        assert_eq!(rows.len(), 1);
        assert_eq!(rows[0][1], "no limit known yet");
    }

    #[test]
    fn the_adaptive_cap_panel_is_there_with_an_adaptive_cap_only() {
        let mut one = dep("one");
        one["cap"] = json!(40);
        one["effective_cap"] = json!(12);
        one["adaptive"] = json!({ "working_cap": 12, "min": 4, "max": 40, "raised": 3,
            "lowered": 5, "baseline_seconds": 0.0504, "current_seconds": 1.5 });
        let mut two = dep("two");
        two["adaptive"] = json!({ "working_cap": 20, "min": 4, "max": 40, "raised": 0,
            "lowered": 0, "baseline_seconds": null, "current_seconds": null });
        two["upstreams"] = json!([
            { "name": "a", "adaptive": two["adaptive"].clone() },
            { "name": "b", "adaptive": { "working_cap": 6, "min": 4, "max": 40, "raised": 1,
              "lowered": 2, "baseline_seconds": 0.02, "current_seconds": 0.04 } },
        ]);
        let html = page(&[one, two, dep("plain")]);
        let one = section(&html, "one");
        assert!(one.contains("<h3>adaptive cap</h3>"), "{one}");
        assert!(
            one.contains(
                "<tr><td>–</td><td>12 / 40</td><td>4</td><td>50.4 ms</td><td>1.50 s</td><td>3</td><td>5</td></tr>"
            ),
            "{one}"
        );
        // The numbers' cap is the cap in force of the ceiling.
        assert!(one.contains("<td data-f=\"cap\">12 of 40</td>"), "{one}");
        let two = section(&html, "two");
        for row in [
            "<tr><td>a</td><td>20 / 40</td><td>4</td><td>–</td><td>–</td><td>0</td><td>0</td></tr>",
            "<tr><td>b</td><td>6 / 40</td><td>4</td><td>20.0 ms</td><td>40.0 ms</td><td>1</td><td>2</td></tr>",
        ] {
            assert!(two.contains(row), "{row}\n{two}");
        }
        let plain = section(&html, "plain");
        assert!(!plain.contains("adaptive"), "{plain}");
        assert_eq!(adaptive_rows(&dep("plain")), None);
    }

    #[test]
    fn missing_fields_show_a_dash() {
        let n = numbers(&json!({ "name": "x" }));
        assert!(n.iter().filter(|(f, _, _)| *f != "denied").all(|(_, _, t)| t == "–"), "{n:?}");
    }
}
