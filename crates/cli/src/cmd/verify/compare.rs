//! Predicted beside measured: per policy and segment, each figure with its ratio, the verdict,
//! and the table, JSON and HTML that show them.

use std::fmt::Write as _;

use serde::Serialize;
use stormguard_core::format::number;
use stormguard_sim::html::escape;
use stormguard_sim::{PolicyReport, Report, Scenario};

use super::live::{Measured, NotLive};

/// The whole comparison.
#[derive(Debug, Clone, Serialize)]
pub struct Comparison {
    /// The scenario's name.
    pub scenario: String,
    /// Its seed.
    pub seed: u64,
    /// How long its arrivals run, in seconds.
    pub duration_s: f64,
    /// The tolerance the judged figures are held to, as a fraction.
    pub tolerance: f64,
    /// Each policy.
    pub policies: Vec<PolicyComparison>,
}

/// One policy: predicted, and measured when it ran live.
#[derive(Debug, Clone, Serialize)]
pub struct PolicyComparison {
    /// Its name.
    pub name: String,
    /// What stood in front of the dependency live (`stormguard proxy`, `naive forwarder`), or
    /// `null` when it could not run live.
    pub live: Option<&'static str>,
    /// Why it did not run live.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub not_live: Option<String>,
    /// Whether it is held to the tolerance: the stormguard policies are.
    pub judged: bool,
    /// For a judged policy: whether every judged figure agreed.
    pub agrees: Option<bool>,
    /// Each segment of the timeline.
    pub segments: Vec<SegmentComparison>,
    /// What was measured, to be judged again against another prediction.
    #[serde(skip)]
    pub run: Result<LiveRun, NotLive>,
}

/// What a policy's live run was and measured.
#[derive(Debug, Clone)]
pub struct LiveRun {
    /// What stood in front of the dependency.
    pub front: &'static str,
    /// Whether the policy is held to the tolerance (a stormguard policy, run by the proxy).
    pub judged: bool,
    /// Each segment's figures.
    pub measured: Vec<Measured>,
}

/// One segment of one policy.
#[derive(Debug, Clone, Serialize)]
pub struct SegmentComparison {
    /// The segment's name (`baseline`, a phase's, `after PHASE`).
    pub name: String,
    /// Each figure.
    pub figures: Vec<Figure>,
}

/// One figure, predicted and measured.
#[derive(Debug, Clone, Serialize)]
pub struct Figure {
    /// What it is: `in_flight_mean`, `in_flight_p99`, `in_flight_max`, `amplification`,
    /// `success`, `latency_p50_ms`, `latency_p99_ms`.
    pub name: &'static str,
    /// The simulator's figure.
    pub predicted: f64,
    /// The live run's.
    pub measured: Option<f64>,
    /// measured / predicted.
    pub ratio: Option<f64>,
    /// For a judged figure of a judged policy: whether it is within the tolerance.
    pub agrees: Option<bool>,
}

/// The figures held to the tolerance.
const JUDGED: [&str; 2] = ["in_flight_p99", "amplification"];

impl PolicyComparison {
    /// `name`'s prediction beside its live run (or the reason it had none).
    pub fn new(
        name: &str,
        predicted: &PolicyReport,
        run: Result<LiveRun, NotLive>,
        tolerance: f64,
    ) -> PolicyComparison {
        let (live, not_live, judged, measured) = match &run {
            Ok(r) => (Some(r.front), None, r.judged, Some(&r.measured)),
            Err(why) => (None, Some(why.to_string()), false, None),
        };
        let segments: Vec<SegmentComparison> = predicted
            .phases
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let m = measured.and_then(|m| m.get(i));
                let latency = p.latency_ms.unwrap_or(predicted.latency_ms);
                let rows: [(&'static str, f64, Option<f64>); 7] = [
                    ("in_flight_mean", p.in_flight_mean, m.map(|m| m.in_flight_mean)),
                    ("in_flight_p99", p.in_flight_p99 as f64, m.map(|m| m.in_flight_p99 as f64)),
                    ("in_flight_max", p.in_flight_max as f64, m.map(|m| m.in_flight_max as f64)),
                    (
                        "amplification",
                        1.0 + p.retry_fraction + p.hedge_fraction,
                        m.map(|m| m.amplification),
                    ),
                    ("success", p.goodput, m.map(|m| m.success)),
                    ("latency_p50_ms", latency.p50, m.map(|m| m.latency_p50_ms)),
                    ("latency_p99_ms", latency.p99, m.map(|m| m.latency_p99_ms)),
                ];
                let figures = rows
                    .into_iter()
                    .map(|(name, predicted, measured)| Figure {
                        name,
                        predicted,
                        measured,
                        ratio: measured.filter(|_| predicted > 0.0).map(|m| m / predicted),
                        agrees: (judged && JUDGED.contains(&name)).then(|| {
                            measured.is_some_and(|m| agree(name, predicted, m, tolerance))
                        }),
                    })
                    .collect();
                SegmentComparison { name: p.name.clone(), figures }
            })
            .collect();
        let agrees = judged
            .then(|| segments.iter().flat_map(|s| &s.figures).all(|f| f.agrees.unwrap_or(true)));
        PolicyComparison { name: name.to_string(), live, not_live, judged, agrees, segments, run }
    }
}

/// One line of a policy's table, as text: the segment's name on its first figure only.
struct Row<'a> {
    segment: &'a str,
    figure: &'static str,
    predicted: String,
    measured: String,
    ratio: String,
    agrees: Option<bool>,
}

impl PolicyComparison {
    /// The table's lines, for the text and the HTML alike.
    fn rows(&self) -> impl Iterator<Item = Row<'_>> {
        self.segments.iter().flat_map(|s| {
            s.figures.iter().enumerate().map(move |(i, f)| Row {
                segment: if i == 0 { s.name.as_str() } else { "" },
                figure: f.name,
                predicted: value(f.name, f.predicted),
                measured: f.measured.map_or("—".to_string(), |m| value(f.name, m)),
                ratio: f.ratio.map_or("—".to_string(), |r| format!("{r:.2}")),
                agrees: f.agrees,
            })
        })
    }

    /// What ran and what it came to, with the words for agreeing and not.
    fn verdict(&self, agrees: &str, disagrees: &str) -> String {
        match (self.live, self.agrees) {
            (None, _) => format!("predicted only: {}", self.not_live.as_deref().unwrap_or("")),
            (Some(front), Some(true)) => format!("{front}: {agrees}"),
            (Some(front), Some(false)) => format!("{front}: {disagrees}"),
            (Some(front), None) => format!("{front}: shown, not judged"),
        }
    }
}

/// Whether `measured` is within `tolerance` of `predicted`; a count of attempts in flight also
/// agrees within one (a whole number of requests cannot come closer to a fractional bound).
fn agree(name: &str, predicted: f64, measured: f64, tolerance: f64) -> bool {
    let slack = if name.starts_with("in_flight") { 1.0 } else { 0.0 };
    (measured - predicted).abs() <= (tolerance * predicted).max(slack)
}

impl Comparison {
    /// The comparison of `policies` under `sc`.
    pub fn new(sc: &Scenario, tolerance: f64, policies: Vec<PolicyComparison>) -> Comparison {
        Comparison {
            scenario: sc.name.clone(),
            seed: sc.seed,
            duration_s: sc.duration.as_secs_f64(),
            tolerance,
            policies,
        }
    }

    /// The same measurements judged against another prediction of the same policies (a model
    /// with a parameter changed, say).
    pub fn against(&self, predicted: &Report) -> Comparison {
        let policies = self
            .policies
            .iter()
            .map(|p| {
                let report = predicted.policies.iter().find(|r| r.name == p.name);
                match report {
                    Some(r) => PolicyComparison::new(&p.name, r, p.run.clone(), self.tolerance),
                    None => p.clone(),
                }
            })
            .collect();
        Comparison { policies, ..self.clone() }
    }

    /// Judged policies that did not agree.
    pub fn disagreements(&self) -> usize {
        self.policies.iter().filter(|p| p.agrees == Some(false)).count()
    }

    /// The plain-text table.
    pub fn table(&self) -> String {
        let mut t = String::new();
        let _ = writeln!(
            t,
            "verify {} (seed {}, {} s): predicted by the simulator, measured live on loopback",
            self.scenario,
            self.seed,
            number(self.duration_s, 3)
        );
        let _ = writeln!(
            t,
            "judged: in flight p99 and amplification of the stormguard policies, within ±{} % \
             (in flight also within 1)",
            number(self.tolerance * 100.0, 3)
        );
        for p in &self.policies {
            let verdict = p.verdict("agrees", "DISAGREES");
            let _ = writeln!(t, "\n{} — {verdict}", p.name);
            let _ = writeln!(
                t,
                "  {:<20} {:<16} {:>10} {:>10} {:>7}",
                "segment", "figure", "predicted", "measured", "ratio"
            );
            for r in p.rows() {
                let mark = match r.agrees {
                    Some(true) => "  ok",
                    Some(false) => "  DIFFERS",
                    None => "",
                };
                let _ = writeln!(
                    t,
                    "  {:<20} {:<16} {:>10} {:>10} {:>7}{mark}",
                    r.segment, r.figure, r.predicted, r.measured, r.ratio
                );
            }
        }
        t
    }

    /// A self-contained HTML page with the same tables.
    pub fn html(&self) -> String {
        let mut h = String::new();
        let _ = write!(
            h,
            "<!doctype html><html><head><meta charset=\"utf-8\"><title>stormguard verify {name}</title>\
             <style>body{{font:14px system-ui,sans-serif;margin:2em;color:#222}}\
             table{{border-collapse:collapse;margin:0.5em 0 1.5em}}\
             td,th{{padding:2px 10px;border-bottom:1px solid #ddd;text-align:right}}\
             td:first-child,td:nth-child(2),th:first-child,th:nth-child(2){{text-align:left}}\
             .ok{{color:#1a7f37}}.bad{{color:#c62828;font-weight:bold}}</style></head><body>\
             <h1>stormguard verify: {name}</h1><p>Seed {seed}, {dur} s. Predicted by the \
             simulator, measured live on loopback. Judged: in-flight p99 and amplification of \
             the stormguard policies, within ±{tol} % (in flight also within 1).</p>",
            name = escape(&self.scenario),
            seed = self.seed,
            dur = number(self.duration_s, 3),
            tol = number(self.tolerance * 100.0, 3)
        );
        for p in &self.policies {
            let verdict =
                p.verdict("<span class=ok>agrees</span>", "<span class=bad>disagrees</span>");
            let _ = write!(
                h,
                "<h2>{}</h2><p>{verdict}</p><table><tr><th>segment</th><th>figure</th>\
                 <th>predicted</th><th>measured</th><th>ratio</th></tr>",
                escape(&p.name)
            );
            for r in p.rows() {
                let class = match r.agrees {
                    Some(true) => " class=ok",
                    Some(false) => " class=bad",
                    None => "",
                };
                let _ = write!(
                    h,
                    "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td{class}>{}</td></tr>",
                    escape(r.segment),
                    r.figure,
                    r.predicted,
                    r.measured,
                    r.ratio
                );
            }
            h.push_str("</table>");
        }
        h.push_str("</body></html>\n");
        h
    }
}

/// A figure as the table shows it.
fn value(name: &str, v: f64) -> String {
    match name {
        "in_flight_p99" | "in_flight_max" => format!("{v:.0}"),
        "success" => format!("{:.1} %", v * 100.0),
        "amplification" => format!("{v:.3}"),
        _ => format!("{v:.1}"),
    }
}
