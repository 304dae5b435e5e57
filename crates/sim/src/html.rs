//! The HTML report: one self-contained file (no scripts, no external resources) with the
//! summary tables and SVG time-series charts drawn with plotters — offered load, in flight at
//! the dependency against the cap, retries per first try against the budget, and goodput and
//! errors — every policy on the same axes, the timeline's phases shaded.
//!
//! The chart drawing is public ([`svg_chart`], [`PAGE_STYLE`], [`color_hex`], [`escape`]) so that
//! other reports of measured time series (`stormguard demo`) look the same without a second
//! copy of it.

use std::fmt::Write as _;

use plotters::coord::Shift;
use plotters::prelude::*;
use stormguard_core::format;

use crate::report::{PhaseInfo, Report};

const WIDTH: u32 = 1280;
const HEIGHT: u32 = 300;

/// Tableau 10: distinguishable, and readable for most colour vision.
const PALETTE: [RGBColor; 10] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
    RGBColor(188, 189, 34),
    RGBColor(23, 190, 207),
];

fn color(i: usize) -> RGBColor {
    PALETTE[i % PALETTE.len()]
}

fn hex(c: RGBColor) -> String {
    format!("#{:02x}{:02x}{:02x}", c.0, c.1, c.2)
}

/// The CSS colour (`#rrggbb`) of series `i` in every chart: legends use it to match the lines.
pub fn color_hex(i: usize) -> String {
    hex(color(i))
}

/// `s` escaped for HTML text and attribute values.
pub fn escape(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
}

fn esc(s: &str) -> String {
    escape(s)
}

/// The page's style sheet (inside `<style>`): the font, headings, tables, legend swatches
/// (`span.sw`, `.legend span.item`), `.muted` and `.chart`.
pub const PAGE_STYLE: &str = "body{font-family:-apple-system,'Segoe UI',Helvetica,Arial,sans-serif;margin:24px 32px;color:#222;max-width:1320px}\
     h1{font-size:24px;margin:0 0 6px} h2{font-size:17px;margin:26px 0 6px}\
     p{margin:4px 0;line-height:1.4} .muted{color:#666;font-size:13px}\
     table{border-collapse:collapse;font-size:13px;margin:6px 0}\
     th,td{padding:4px 9px;border-bottom:1px solid #e3e3e3;text-align:right;white-space:nowrap}\
     th{background:#f5f5f5} td:first-child,th:first-child{text-align:left}\
     td.policy{white-space:normal;min-width:210px;max-width:340px}\
     .sw{display:inline-block;width:22px;height:4px;margin-right:6px;vertical-align:middle}\
     .legend span.item{margin-right:18px;font-size:13px;white-space:nowrap}\
     .chart{margin:4px 0 0}";

/// One line on a chart: series `series` (its colour), points `(x seconds, y)`; `dashed` for a
/// reference line (a cap, a budget).
#[derive(Debug, Clone, PartialEq)]
pub struct ChartLine {
    /// Which series: picks the colour ([`color_hex`]).
    pub series: usize,
    /// `(seconds, value)`, in time order.
    pub points: Vec<(f64, f64)>,
    /// A thin dashed reference line instead of a solid one.
    pub dashed: bool,
}

/// A shaded stretch of the time axis, labelled at its top left (a phase of the run).
#[derive(Debug, Clone, PartialEq)]
pub struct Band {
    /// The label.
    pub name: String,
    /// Where it starts, in seconds.
    pub start_s: f64,
    /// Where it ends, in seconds.
    pub end_s: f64,
    /// Shade it red (the trigger of a storm) rather than grey.
    pub trigger: bool,
}

/// What one chart shows: time from 0 to `x_end_s` on the x axis.
#[derive(Debug, Clone, PartialEq)]
pub struct ChartSpec<'a> {
    /// The caption.
    pub title: &'a str,
    /// The y axis's label.
    pub y_desc: &'a str,
    /// The end of the time axis, in seconds.
    pub x_end_s: f64,
    /// Shaded stretches of time.
    pub bands: &'a [Band],
    /// The lines.
    pub lines: &'a [ChartLine],
    /// Switch to a log y axis when the values span more than 25×.
    pub log_if_wide: bool,
}

/// Why a chart could not be drawn: the drawing backend's reason.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{reason}")]
pub struct ChartError {
    /// The backend's reason.
    pub reason: String,
}

/// Draws one chart as an inline `<svg>` element (1280 × 300), or says why it could not.
pub fn svg_chart(spec: &ChartSpec<'_>) -> Result<String, ChartError> {
    let ChartSpec { title, y_desc, x_end_s, bands, lines, log_if_wide } = *spec;
    let y_max =
        lines.iter().flat_map(|l| l.points.iter().map(|p| p.1)).fold(0.0f64, f64::max).max(1e-9);
    let y_min_pos = lines
        .iter()
        .flat_map(|l| l.points.iter().map(|p| p.1))
        .filter(|v| *v >= 1.0)
        .fold(f64::INFINITY, f64::min);
    // A storm and a capped policy differ by orders of magnitude: a log axis keeps both
    // readable.
    let log = log_if_wide && y_min_pos.is_finite() && y_max / y_min_pos > 25.0;
    let x_end_s = x_end_s.max(1e-9);
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (WIDTH, HEIGHT)).into_drawing_area();
        if log {
            let y_desc = format!("{y_desc} (log scale)");
            draw(&root, x_end_s, bands, title, &y_desc, lines, (1.0f64..y_max * 1.5).log_scale())
                .map_err(|reason| ChartError { reason })?;
        } else {
            draw(&root, x_end_s, bands, title, y_desc, lines, 0.0f64..y_max * 1.08)
                .map_err(|reason| ChartError { reason })?;
        }
    }
    Ok(svg)
}

type Line = ChartLine;

/// The dashed cap line of policy `i` on the in-flight chart, to `end` seconds: its cap, or an
/// adaptive cap's working cap over time (not its ceiling).
fn cap_line(p: &crate::report::PolicyReport, i: usize, end: f64) -> Option<Line> {
    if p.series.working_cap.is_empty() {
        let cap = p.in_flight.cap? as f64;
        return Some(Line { series: i, points: vec![(0.0, cap), (end, cap)], dashed: true });
    }
    let points = p.series.t_s.iter().copied().zip(p.series.working_cap.iter().copied()).collect();
    Some(Line { series: i, points, dashed: true })
}

/// Renders the whole report as one HTML page.
pub fn render(report: &Report) -> String {
    let mut h = String::new();
    let title = format!("stormguard simulate: {}", report.scenario);
    let _ = write!(
        h,
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>{}</title>\n<style>{PAGE_STYLE}</style></head><body>\n",
        esc(&title)
    );
    let _ = writeln!(h, "<h1>{}</h1>", esc(&title));
    if !report.description.is_empty() {
        let _ = writeln!(h, "<p>{}</p>", esc(report.description.trim()));
    }
    let _ = writeln!(
        h,
        "<p class=\"muted\">seed {} · {} s · {}</p>",
        report.seed,
        report.duration_s,
        esc(&report.setup)
    );
    h.push_str("<p class=\"muted\">");
    for p in &report.phases {
        let _ = write!(
            h,
            "{:.0}–{:.0} s <b>{}</b>{}: {}<br>",
            p.start_s,
            p.end_s,
            esc(&p.name),
            if p.trigger { " (trigger)" } else { "" },
            esc(&p.conditions)
        );
    }
    h.push_str("</p>\n");
    summary_table(&mut h, report);
    rate_table(&mut h, report);
    let by_phase = {
        let mut t = String::new();
        phase_table(&mut t, report);
        t
    };

    h.push_str("<h2>Over time</h2>\n<div class=\"legend\">");
    for (i, p) in report.policies.iter().enumerate() {
        let _ = write!(
            h,
            "<span class=\"item\"><span class=\"sw\" style=\"background:{}\"></span>{}</span>",
            hex(color(i)),
            esc(&p.name)
        );
    }
    h.push_str(
        "<br><span class=\"muted\">Shaded: the timeline's phases (red: the trigger). Dashed: \
         each policy's cap (in flight; an adaptive cap's working cap over time) or budget \
         (retries per first try).</span></div>\n",
    );

    let series = |f: &dyn Fn(&crate::Series) -> Vec<f64>| -> Vec<Line> {
        report
            .policies
            .iter()
            .enumerate()
            .map(|(i, p)| Line {
                series: i,
                points: p.series.t_s.iter().copied().zip(f(&p.series)).collect(),
                dashed: false,
            })
            .collect()
    };
    let end = report.duration_s;
    let reference = |value: Option<f64>, i: usize| {
        value.map(|v| Line { series: i, points: vec![(0.0, v), (end, v)], dashed: true })
    };

    let offered = series(&|s| s.offered_per_s.clone());
    chart(&mut h, report, "Offered load at the dependency", "attempts / s", offered, false);

    let mut in_flight = series(&|s| s.in_flight_mean.clone());
    in_flight.extend(report.policies.iter().enumerate().filter_map(|(i, p)| cap_line(p, i, end)));
    chart(
        &mut h,
        report,
        "Attempts in flight at the dependency (mean per bucket) vs. the cap",
        "in flight",
        in_flight,
        true,
    );

    let mut retry = series(&|s| s.retry_fraction.clone());
    retry.extend(
        report.policies.iter().enumerate().filter_map(|(i, p)| reference(p.budget_percent, i)),
    );
    chart(&mut h, report, "Retries per first try vs. the budget", "retry fraction", retry, false);

    let goodput = series(&|s| s.goodput.iter().map(|g| g.unwrap_or(0.0) * 100.0).collect());
    chart(
        &mut h,
        report,
        "Goodput: user actions that succeeded (by start time)",
        "% of actions",
        goodput,
        false,
    );

    let errors = series(&|s| s.errors_per_s.clone());
    chart(&mut h, report, "User-visible errors", "failed actions / s", errors, false);

    h.push_str(&by_phase);
    let _ = writeln!(
        h,
        "<p class=\"muted\">Generated by <code>stormguard simulate</code>. The simulator runs \
         stormguard-core's limiter, breaker and retry decision on a virtual clock; same seed, same \
         report. See docs/simulator.md for the model.</p>\n</body></html>"
    );
    h
}

fn summary_table(h: &mut String, report: &Report) {
    h.push_str("<h2>Summary</h2>\n<table><tr><th>policy</th><th>offered/s</th><th>amplification</th>\
        <th>in flight mean</th><th>p50</th><th>p99</th><th>max</th><th>cap</th><th>goodput</th>\
        <th>errors</th><th>retries</th><th>denied</th><th>latency p50</th><th>p99</th><th>recovery</th></tr>\n");
    for (i, p) in report.policies.iter().enumerate() {
        let denied = if p.retries_denied_by.is_empty() {
            "0".to_string()
        } else {
            p.retries_denied_by
                .iter()
                .map(|(k, v)| format!("{k} {v}"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let recovery = match (report.trigger_end_s, p.recovery_s) {
            (None, _) => "–".to_string(),
            (Some(_), None) => "never".to_string(),
            (Some(_), Some(r)) => format!("{r:.0} s"),
        };
        let _ = writeln!(
            h,
            "<tr><td class=\"policy\"><span class=\"sw\" style=\"background:{}\"></span><b>{}</b><br><span class=\"muted\">{}</span></td>\
             <td>{:.1}</td><td>{:.2}</td><td>{:.2}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td>\
             <td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{:.1} ms</td><td>{:.1} ms</td><td>{}</td></tr>",
            hex(color(i)),
            esc(&p.name),
            esc(&p.description),
            p.offered_per_s,
            p.amplification,
            p.in_flight.mean,
            p.in_flight.p50,
            p.in_flight.p99,
            p.in_flight.max,
            p.in_flight.cap.map_or("–".to_string(), |c| c.to_string()),
            format::percent(p.goodput, 1),
            format::percent(p.error_rate, 1),
            p.retries_issued,
            esc(&denied),
            p.latency_ms.p50,
            p.latency_ms.p99,
            recovery
        );
    }
    h.push_str("</table>\n");
}

/// What reached the dependency's requests and tokens per minute, when it has them.
fn rate_table(h: &mut String, report: &Report) {
    let Some(limits) = report.policies.iter().find_map(|p| p.rate_limit) else {
        return;
    };
    let tokens = limits.tokens_limit_per_min.is_some();
    let _ = writeln!(
        h,
        "<h2>At the dependency's {}</h2>\n<table><tr><th>policy</th>\
         <th>reached it</th><th>429s</th><th>429 share</th><th>accepted / min</th>{}</tr>",
        limits.describe(),
        if tokens { "<th>tokens / min</th>" } else { "" }
    );
    for p in &report.policies {
        let Some(r) = p.rate_limit else { continue };
        let _ = writeln!(
            h,
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{:.1}</td>{}</tr>",
            esc(&p.name),
            r.accepted + r.limited,
            r.limited,
            format::percent(r.limited_share, 1),
            r.accepted_per_min,
            r.tokens_per_min.map_or(String::new(), |t| format!("<td>{t:.0}</td>"))
        );
    }
    h.push_str("</table>\n");
}

fn phase_table(h: &mut String, report: &Report) {
    if report.phases.len() > 1 {
        h.push_str("<h2>By phase</h2>\n<table><tr><th>policy</th>");
        for ph in &report.phases {
            let _ = write!(h, "<th colspan=\"3\">{}</th>", esc(&ph.name));
        }
        h.push_str("</tr>\n<tr><th></th>");
        for _ in &report.phases {
            h.push_str("<th>in flight</th><th>retries/try</th><th>goodput</th>");
        }
        h.push_str("</tr>\n");
        for p in &report.policies {
            let _ = write!(h, "<tr><td>{}</td>", esc(&p.name));
            for ph in &p.phases {
                let _ = write!(
                    h,
                    "<td>{:.2}</td><td>{:.3}</td><td>{}</td>",
                    ph.in_flight_mean,
                    ph.retry_fraction,
                    format::percent(ph.goodput, 1)
                );
            }
            h.push_str("</tr>\n");
        }
        h.push_str("</table>\n");
    }
}

fn chart(
    h: &mut String,
    report: &Report,
    title: &str,
    y_desc: &str,
    lines: Vec<Line>,
    log_if_wide: bool,
) {
    let bands: Vec<Band> = report
        .phases
        .iter()
        .filter(|p| p.trigger || !(p.name == "baseline" || p.name.starts_with("after ")))
        .map(|p: &PhaseInfo| Band {
            name: p.name.clone(),
            start_s: p.start_s,
            end_s: p.end_s,
            trigger: p.trigger,
        })
        .collect();
    let spec = ChartSpec {
        title,
        y_desc,
        x_end_s: report.duration_s,
        bands: &bands,
        lines: &lines,
        log_if_wide,
    };
    match svg_chart(&spec) {
        Ok(svg) => {
            let _ = writeln!(h, "<div class=\"chart\">{svg}</div>");
        }
        Err(e) => {
            let _ =
                writeln!(h, "<p>chart `{}` could not be drawn: {}</p>", esc(title), esc(&e.reason));
        }
    }
}

fn draw<Y>(
    root: &DrawingArea<SVGBackend<'_>, Shift>,
    x_end_s: f64,
    bands: &[Band],
    title: &str,
    y_desc: &str,
    lines: &[Line],
    y: Y,
) -> Result<(), String>
where
    Y: plotters::coord::ranged1d::AsRangedCoord<Value = f64>,
    Y::CoordDescType: plotters::coord::ranged1d::ValueFormatter<f64>,
{
    let err = |e: &dyn std::fmt::Display| e.to_string();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let mut chart = ChartBuilder::on(root)
        .caption(title, ("sans-serif", 17))
        .margin(10)
        .x_label_area_size(38)
        .y_label_area_size(64)
        .build_cartesian_2d(0.0f64..x_end_s, y)
        .map_err(|e| err(&e))?;
    chart
        .configure_mesh()
        .x_desc("time (s)")
        .y_desc(y_desc)
        .label_style(("sans-serif", 13))
        .x_label_formatter(&|v| format!("{v:.0}"))
        .y_label_formatter(&|v| {
            let a = v.abs();
            if a >= 10.0 || a == 0.0 {
                format!("{v:.0}")
            } else if a >= 1.0 {
                format!("{v:.1}")
            } else {
                format!("{v:.2}")
            }
        })
        .light_line_style(RGBColor(238, 238, 238))
        .draw()
        .map_err(|e| err(&e))?;
    let (y_lo, y_hi) = {
        let r = chart.y_range();
        (r.start, r.end)
    };
    let shade = bands;
    chart
        .draw_series(shade.iter().map(|p| {
            let c = if p.trigger {
                RGBColor(214, 39, 40).mix(0.09)
            } else {
                RGBColor(120, 120, 120).mix(0.08)
            };
            Rectangle::new([(p.start_s, y_lo), (p.end_s, y_hi)], c.filled())
        }))
        .map_err(|e| err(&e))?;
    chart
        .draw_series(shade.iter().map(|p| {
            Text::new(
                p.name.clone(),
                (p.start_s + x_end_s * 0.004, y_hi),
                ("sans-serif", 12).into_font().color(&RGBColor(90, 90, 90)),
            )
        }))
        .map_err(|e| err(&e))?;
    for l in lines {
        let style = ShapeStyle::from(&color(l.series)).stroke_width(if l.dashed { 1 } else { 2 });
        let points = l.points.iter().map(|&(x, v)| (x, v.clamp(y_lo, y_hi)));
        if l.dashed {
            chart.draw_series(DashedLineSeries::new(points, 7, 5, style)).map_err(|e| err(&e))?;
        } else {
            chart.draw_series(LineSeries::new(points, style)).map_err(|e| err(&e))?;
        }
    }
    root.present().map_err(|e| err(&e))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The capacity-drop built-in: the fixed caps' lines are flat at their cap, the adaptive
    /// cap's follows its working cap down and back up, below its ceiling of 40.
    #[test]
    fn an_adaptive_caps_line_is_its_working_cap() {
        let s = crate::builtin::scenario("capacity-drop").unwrap();
        let r = crate::simulate(&s).unwrap();
        let end = r.duration_s;
        for (i, p) in r.policies.iter().enumerate() {
            let line = cap_line(p, i, end).expect("every policy here has a cap");
            let ys: Vec<f64> = line.points.iter().map(|(_, y)| *y).collect();
            let (lo, hi) = ys.iter().fold((f64::MAX, 0.0_f64), |(l, h), y| (l.min(*y), h.max(*y)));
            if p.name == "adaptive" {
                assert!(hi < 40.0 && lo < 17.0 && ys.len() > 10, "{lo}..{hi}");
            } else {
                assert_eq!(ys, [p.in_flight.cap.unwrap() as f64; 2], "{}", p.name);
            }
        }
    }
}
