//! The demo's HTML report: one self-contained page (no scripts, nothing external) with the
//! side-by-side table and the time series, drawn by the simulator's chart code so both reports
//! read the same way.

use std::fmt::Write as _;

use stormguard_sim::html::{Band, ChartLine, ChartSpec, PAGE_STYLE, color_hex, escape, svg_chart};

use super::{PathSummary, PhasePath, Summary, by_reason, pct};

/// Colours (indices into the charts' palette): stormguard blue, naive orange, references grey.
const GUARDED: usize = 0;
const NAIVE: usize = 1;
const REFERENCE: usize = 7;

fn line(series: usize, t: &[f64], values: impl IntoIterator<Item = f64>) -> ChartLine {
    ChartLine { series, points: t.iter().copied().zip(values).collect(), dashed: false }
}

fn flat(series: usize, end: f64, value: f64) -> ChartLine {
    ChartLine { series, points: vec![(0.0, value), (end, value)], dashed: true }
}

/// Renders the report.
pub fn render(s: &Summary) -> String {
    let mut h = String::new();
    let _ = write!(
        h,
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>stormguard demo</title>\n<style>{PAGE_STYLE}</style></head><body>\n"
    );
    let _ = writeln!(h, "<h1>stormguard demo: a retry storm, with and without a budget</h1>");
    let _ = writeln!(
        h,
        "<p>Two paths take the same open-loop arrivals ({} requests/s) to two identical upstreams \
         that play the same seeded script. The <b>naive</b> path retries each failure once, at \
         once, with no cap and no budget. The <b>stormguard</b> path goes through \
         <code>stormguard proxy</code> with a cap of {} attempts in flight ({} planned for first \
         tries) and a retry budget of {} of first tries (<code>{}</code>). Everything is \
         measured at the upstreams, which count what reaches them.</p>",
        s.rate_per_s,
        s.cap,
        s.planned_primary,
        stormguard_core::format::percent_trimmed(s.budget_percent, 2),
        escape(s.budget)
    );
    h.push_str("<p class=\"muted\">");
    for p in &s.phases {
        let _ = write!(
            h,
            "{}–{} s <b>{}</b>: {}<br>",
            super::secs(p.plan.start_s),
            super::secs(p.plan.end_s),
            escape(&p.plan.name),
            escape(&p.plan.conditions)
        );
    }
    h.push_str("</p>\n");

    summary_table(&mut h, s);
    phase_table(&mut h, s);

    let _ = write!(
        h,
        "<h2>Over time</h2>\n<div class=\"legend\"><span class=\"item\"><span class=\"sw\" style=\"background:{}\"></span>stormguard</span>\
         <span class=\"item\"><span class=\"sw\" style=\"background:{}\"></span>naive retry-once</span>\
         <span class=\"item\"><span class=\"sw\" style=\"background:{}\"></span>reference (dashed: cap, budget; solid: arrivals)</span></div>\n",
        color_hex(GUARDED),
        color_hex(NAIVE),
        color_hex(REFERENCE)
    );
    let bands: Vec<Band> = s
        .phases
        .iter()
        .filter(|p| p.plan.name != "recovery")
        .map(|p| Band {
            name: p.plan.name.to_string(),
            start_s: p.plan.start_s,
            end_s: p.plan.end_s,
            trigger: p.plan.name == "40 % errors" || p.plan.name == "latency spike",
        })
        .collect();
    let t = &s.series.t_s;
    let end = s.duration_s;
    let cap = s.cap as f64;
    let (n, g) = (&s.series.naive, &s.series.stormguard);
    let charts: Vec<(&str, &str, Vec<ChartLine>)> = vec![
        (
            "Attempts in flight at the upstream (mean per bucket) vs. the cap",
            "in flight",
            vec![
                line(NAIVE, t, n.in_flight_mean.iter().copied()),
                line(GUARDED, t, g.in_flight_mean.iter().copied()),
                flat(REFERENCE, end, cap),
            ],
        ),
        (
            "Most attempts in flight at the upstream (per bucket) vs. the cap",
            "in flight",
            vec![
                line(NAIVE, t, n.in_flight_max.iter().map(|v| *v as f64)),
                line(GUARDED, t, g.in_flight_max.iter().map(|v| *v as f64)),
                flat(REFERENCE, end, cap),
            ],
        ),
        (
            "Load at the upstream: attempts per second vs. arrivals",
            "per second",
            vec![
                line(NAIVE, t, n.attempts_per_s.iter().copied()),
                line(GUARDED, t, g.attempts_per_s.iter().copied()),
                ChartLine {
                    series: REFERENCE,
                    points: vec![(0.0, s.rate_per_s), (end, s.rate_per_s)],
                    dashed: false,
                },
            ],
        ),
        (
            "Retries per first try at the upstream vs. the budget",
            "retry fraction",
            vec![
                line(NAIVE, t, n.retry_fraction.iter().copied()),
                line(GUARDED, t, g.retry_fraction.iter().copied()),
                flat(REFERENCE, end, s.budget_percent),
            ],
        ),
        (
            "Success rate (complete 2xx, by the time each request ended)",
            "% of requests",
            vec![
                line(NAIVE, t, n.success_rate.iter().map(|v| v.unwrap_or(0.0) * 100.0)),
                line(GUARDED, t, g.success_rate.iter().map(|v| v.unwrap_or(0.0) * 100.0)),
            ],
        ),
    ];
    for (title, y_desc, lines) in &charts {
        chart(&mut h, title, y_desc, end, &bands, lines, false);
    }
    if !s.series.denied_per_s.is_empty() {
        // One colour per reason, after the two paths' and away from the reference grey.
        let lines: Vec<ChartLine> = s
            .series
            .denied_per_s
            .values()
            .enumerate()
            .map(|(i, v)| line(2 + i % 5, t, v.iter().copied()))
            .collect();
        h.push_str("<div class=\"legend\">");
        for (i, reason) in s.series.denied_per_s.keys().enumerate() {
            let _ = write!(
                h,
                "<span class=\"item\"><span class=\"sw\" style=\"background:{}\"></span>{}</span>",
                color_hex(2 + i % 5),
                escape(reason)
            );
        }
        h.push_str("</div>\n");
        chart(
            &mut h,
            "stormguard's refusals per second, by reason",
            "refused / s",
            end,
            &bands,
            &lines,
            false,
        );
    }
    let _ = writeln!(
        h,
        "<p class=\"muted\">Generated by <code>stormguard demo</code>. The upstreams are \
         <code>stormguard chaos</code> servers that work on {} requests at full speed and slow \
         down for every caller past that, as a real dependency does: the naive path's retries \
         push its upstream there, and the slowdown feeds itself. See docs/demo.md.</p>\n\
         </body></html>",
        super::WORKERS
    );
    h
}

/// One chart into the page `h`, or a line saying why it could not be drawn (shared with
/// `review`'s report).
pub(crate) fn chart(
    h: &mut String,
    title: &str,
    y_desc: &str,
    end: f64,
    bands: &[Band],
    lines: &[ChartLine],
    log_if_wide: bool,
) {
    let spec = ChartSpec { title, y_desc, x_end_s: end, bands, lines, log_if_wide };
    match svg_chart(&spec) {
        Ok(svg) => {
            let _ = writeln!(h, "<div class=\"chart\">{svg}</div>");
        }
        Err(e) => {
            let _ = writeln!(
                h,
                "<p>chart `{}` could not be drawn: {}</p>",
                escape(title),
                escape(&e.reason)
            );
        }
    }
}

fn summary_table(h: &mut String, s: &Summary) {
    h.push_str(
        "<h2>Summary</h2>\n<table><tr><th>path</th><th>in flight mean</th><th>p99</th><th>max</th>\
         <th>cap</th><th>amplification</th><th>sent</th><th>attempts</th><th>retries</th>\
         <th>success</th><th>latency p50</th><th>p99</th><th>retries denied</th><th>first tries shed</th></tr>\n",
    );
    let row = |h: &mut String, name: &str, color: usize, p: &PathSummary, cap: String| {
        // The naive path has no cap and no budget: nothing to deny.
        let refusals = |m| if cap == "none" { "–".to_string() } else { by_reason(m) };
        let _ = writeln!(
            h,
            "<tr><td><span class=\"sw\" style=\"background:{}\"></span><b>{}</b></td><td>{:.1}</td>\
             <td>{}</td><td>{}</td><td>{}</td><td>{:.3}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td>\
             <td>{:.0} ms</td><td>{:.0} ms</td><td>{}</td><td>{}</td></tr>",
            color_hex(color),
            escape(name),
            p.in_flight.mean,
            p.in_flight.p99,
            p.in_flight.max,
            cap,
            p.amplification,
            p.sent,
            p.upstream_requests,
            p.upstream_retries,
            pct(p.success_rate),
            p.latency_p50_ms,
            p.latency_p99_ms,
            escape(&refusals(&p.retries_denied)),
            escape(&refusals(&p.primaries_shed)),
        );
    };
    row(h, "naive retry-once", NAIVE, &s.naive, "none".to_string());
    row(h, "stormguard", GUARDED, &s.stormguard, s.cap.to_string());
    h.push_str("</table>\n");
}

fn phase_table(h: &mut String, s: &Summary) {
    h.push_str("<h2>By phase</h2>\n<table><tr><th>path</th>");
    for p in &s.phases {
        let _ = write!(h, "<th colspan=\"4\">{}</th>", escape(&p.plan.name));
    }
    h.push_str("</tr>\n<tr><th></th>");
    for _ in &s.phases {
        h.push_str("<th>in flight</th><th>max</th><th>ampl.</th><th>success</th>");
    }
    h.push_str("</tr>\n");
    let cells = |h: &mut String, p: &PhasePath| {
        let _ = write!(
            h,
            "<td>{:.1}</td><td>{}</td><td>{:.2}</td><td>{}</td>",
            p.in_flight_mean,
            p.in_flight_max,
            p.amplification,
            p.success_rate.map_or("–".to_string(), pct)
        );
    };
    h.push_str("<tr><td>naive retry-once</td>");
    for p in &s.phases {
        cells(h, &p.naive);
    }
    h.push_str("</tr>\n<tr><td>stormguard</td>");
    for p in &s.phases {
        cells(h, &p.stormguard);
    }
    h.push_str("</tr>\n</table>\n");
}
