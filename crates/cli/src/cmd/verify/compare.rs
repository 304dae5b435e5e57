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
    /// Chaos's own share of the live run, in ms: how much longer than drawn it held each
    /// answer, on average (`null` when it did not run live).
    pub late_ms: Option<f64>,
    /// The share added to the model's service time for this policy's prediction (`null`: the
    /// model as written).
    pub calibrated_ms: Option<f64>,
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
    /// How much longer than drawn chaos held its answers, on average: its own share.
    pub overhead: std::time::Duration,
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
    /// The simulator's figure (calibrated, when the policy is).
    pub predicted: f64,
    /// The model's figure as written, without chaos's share, when the prediction is
    /// calibrated.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub uncalibrated: Option<f64>,
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
    /// `name`'s prediction beside its live run (or the reason it had none). `calibrated` is a
    /// second prediction, the model given chaos's measured share ([`LiveRun::overhead`]): when
    /// present it is what is judged, and `predicted` is shown beside it.
    pub fn new(
        name: &str,
        predicted: &PolicyReport,
        calibrated: Option<&PolicyReport>,
        run: Result<LiveRun, NotLive>,
        tolerance: f64,
    ) -> PolicyComparison {
        let (raw, predicted) = match calibrated {
            Some(c) => (Some(predicted), c),
            None => (None, predicted),
        };
        let late_ms = run.as_ref().ok().map(|r| r.overhead.as_secs_f64() * 1e3);
        let calibrated_ms = late_ms.filter(|_| raw.is_some());
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
                let model = figures(predicted, p);
                let uncalibrated = raw.and_then(|r| r.phases.get(i).map(|q| figures(r, q)));
                let measured = m.map(|m| {
                    [
                        m.in_flight_mean,
                        m.in_flight_p99 as f64,
                        m.in_flight_max as f64,
                        m.amplification,
                        m.success,
                        m.latency_p50_ms,
                        m.latency_p99_ms,
                    ]
                });
                let figures = FIGURES
                    .iter()
                    .enumerate()
                    .map(|(k, &name)| {
                        (name, model[k], uncalibrated.map(|u| u[k]), measured.map(|m| m[k]))
                    })
                    .map(|(name, predicted, uncalibrated, measured)| Figure {
                        name,
                        predicted,
                        uncalibrated,
                        measured,
                        ratio: measured.filter(|_| predicted > 0.0).map(|m| m / predicted),
                        agrees: (judged && JUDGED.contains(&name)).then(|| {
                            measured
                                .is_some_and(|m| agree(name, predicted, uncalibrated, m, tolerance))
                        }),
                    })
                    .collect();
                SegmentComparison { name: p.name.clone(), figures }
            })
            .collect();
        let agrees = judged
            .then(|| segments.iter().flat_map(|s| &s.figures).all(|f| f.agrees.unwrap_or(true)));
        PolicyComparison {
            name: name.to_string(),
            live,
            not_live,
            judged,
            late_ms,
            calibrated_ms,
            agrees,
            segments,
            run,
        }
    }
}

/// The figures compared, in the table's order.
const FIGURES: [&str; 7] = [
    "in_flight_mean",
    "in_flight_p99",
    "in_flight_max",
    "amplification",
    "success",
    "latency_p50_ms",
    "latency_p99_ms",
];

/// A segment's predicted figures, in [`FIGURES`]' order.
fn figures(policy: &PolicyReport, p: &stormguard_sim::PhaseReport) -> [f64; 7] {
    let latency = p.latency_ms.unwrap_or(policy.latency_ms);
    [
        p.in_flight_mean,
        p.in_flight_p99 as f64,
        p.in_flight_max as f64,
        1.0 + p.retry_fraction + p.hedge_fraction,
        p.goodput,
        latency.p50,
        latency.p99,
    ]
}

/// One line of a policy's table, as text: the segment's name on its first figure only.
struct Row<'a> {
    segment: &'a str,
    figure: &'static str,
    uncalibrated: String,
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
                uncalibrated: f.uncalibrated.map_or("—".to_string(), |u| value(f.name, u)),
                predicted: value(f.name, f.predicted),
                measured: f.measured.map_or("—".to_string(), |m| value(f.name, m)),
                ratio: f.ratio.map_or("—".to_string(), |r| format!("{r:.2}")),
                agrees: f.agrees,
            })
        })
    }

    /// What ran and what it came to, with the words for agreeing and not.
    fn verdict(&self, agrees: &str, disagrees: &str) -> String {
        let verdict = match (self.live, self.agrees) {
            (None, _) => {
                return format!("predicted only: {}", self.not_live.as_deref().unwrap_or(""));
            }
            (Some(front), Some(true)) => format!("{front}: {agrees}"),
            (Some(front), Some(false)) => format!("{front}: {disagrees}"),
            (Some(front), None) => format!("{front}: shown, not judged"),
        };
        match self.calibrated_ms {
            Some(ms) => format!(
                "{verdict} (calibrated: chaos held each answer {ms:.2} ms past its draw; the \
                 model adds it to every attempt)"
            ),
            None => verdict,
        }
    }
}

/// Whether `measured` is within `tolerance` of `predicted`; a count of attempts in flight also
/// agrees within one (a whole number of requests cannot come closer to a fractional bound).
///
/// With a calibrated prediction, the model as written (`uncalibrated`) and the calibrated one
/// bound what the model says: a figure agrees within the tolerance of either or anywhere between
/// them. Where the two are close this is the calibrated prediction's tolerance; where a
/// millisecond of overhead moves a figure far (where a breaker's cycle lands when a slowdown
/// ends, say), the model cannot pin it down closer than that.
fn agree(
    name: &str,
    predicted: f64,
    uncalibrated: Option<f64>,
    measured: f64,
    tolerance: f64,
) -> bool {
    let slack = if name.starts_with("in_flight") { 1.0 } else { 0.0 };
    let other = uncalibrated.unwrap_or(predicted);
    let (lo, hi) = (predicted.min(other), predicted.max(other));
    measured >= lo - (tolerance * lo).max(slack) && measured <= hi + (tolerance * hi).max(slack)
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
    /// with a parameter changed, say): `calibrated` when given is the one judged, with
    /// `predicted` as the model as written beside it (the band between them, as `verify`
    /// judges); otherwise `predicted` alone.
    pub fn against(&self, predicted: &Report, calibrated: Option<&Report>) -> Comparison {
        let find = |r: &'_ Report, name: &str| r.policies.iter().find(|p| p.name == name).cloned();
        let policies = self
            .policies
            .iter()
            .map(|p| {
                let raw = find(predicted, &p.name);
                let cal = calibrated.and_then(|c| find(c, &p.name));
                match raw {
                    Some(r) => PolicyComparison::new(
                        &p.name,
                        &r,
                        cal.as_ref(),
                        p.run.clone(),
                        self.tolerance,
                    ),
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
                "  {:<20} {:<16} {:>12} {:>10} {:>10} {:>7}",
                "segment", "figure", "uncalibrated", "predicted", "measured", "ratio"
            );
            for r in p.rows() {
                let mark = match r.agrees {
                    Some(true) => "  ok",
                    Some(false) => "  DIFFERS",
                    None => "",
                };
                let _ = writeln!(
                    t,
                    "  {:<20} {:<16} {:>12} {:>10} {:>10} {:>7}{mark}",
                    r.segment, r.figure, r.uncalibrated, r.predicted, r.measured, r.ratio
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
                 <th>uncalibrated</th><th>predicted</th><th>measured</th><th>ratio</th></tr>",
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
                    "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td{class}>{}</td></tr>",
                    escape(r.segment),
                    r.figure,
                    r.uncalibrated,
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

#[cfg(test)]
mod tests {
    use super::agree;

    #[test]
    fn a_figure_agrees_within_the_tolerance_of_the_prediction() {
        // Uncalibrated: ±10 % of the prediction, or within one for a count in flight.
        assert!(agree("amplification", 1.20, None, 1.31, 0.10));
        assert!(!agree("amplification", 1.20, None, 1.33, 0.10));
        assert!(agree("in_flight_p99", 5.0, None, 6.0, 0.10));
        assert!(!agree("in_flight_p99", 26.0, None, 29.0, 0.10));
    }

    #[test]
    fn a_calibrated_figure_agrees_between_the_two_predictions_and_no_further() {
        // The breaker's cycle: 25 as written, 30 calibrated; 26 measured lies between.
        assert!(agree("in_flight_p99", 30.0, Some(25.0), 26.0, 0.10));
        // Widened by the tolerance on either side, and no more.
        assert!(agree("in_flight_p99", 30.0, Some(25.0), 33.0, 0.10));
        assert!(!agree("in_flight_p99", 30.0, Some(25.0), 34.0, 0.10));
        assert!(agree("in_flight_p99", 30.0, Some(25.0), 22.5, 0.10));
        assert!(!agree("in_flight_p99", 30.0, Some(25.0), 22.0, 0.10));
        // The order of the two does not matter.
        assert!(agree("amplification", 1.0, Some(1.5), 1.4, 0.05));
        assert!(!agree("amplification", 1.5, Some(1.0), 1.6, 0.05));
    }
}
