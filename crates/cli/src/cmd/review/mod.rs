//! `stormguard review`: a budget chosen from the retry history users already have — a
//! Prometheus server's (stormguard's metrics, Envoy's, or any through a mapping file) or a trace
//! the proxy recorded. The arithmetic is core's [`review`](stormguard_core::review); this module
//! reads the history and prints what it says.

mod html;
mod source;

use std::collections::BTreeMap;
use std::io::Write;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, ValueEnum};
use serde_json::{Value, json};
use stormguard_core::format::{number, percent};
use stormguard_core::review::{Candidate, History, Review, ReviewConfig, review, review_with};

use crate::Failure;
pub use source::Mapping;

/// Flags of `stormguard review`.
#[derive(Debug, Args)]
#[command(after_help = "\
The normal retry ratio is the quiet steps': a step is an incident's when its ratio is above both
3 x the run's median and the median + 5 points. Each candidate budget (ratio, a percent of
original requests and a floor per second, over a 10 s window) keeps its balance over the steps
— an approximation, said so in the output. The recommendation is the smallest candidate at
least --margin x the quiet p95 that sheds no quiet retry (outside the window after an incident)
and keeps the estimated in-flight under the cap (docs/review.md).

Examples:
  stormguard review --prometheus http://127.0.0.1:9090 --last 6h --step 30s
  stormguard review --prometheus http://prom:9090 --system envoy --dependency payments --last 1d --format envoy
  stormguard review --trace incident.jsonl --step 1s --cap 20")]
pub struct ReviewArgs {
    /// A Prometheus server's base URL (its HTTP API: /api/v1/query_range).
    #[arg(long, value_name = "URL", required_unless_present = "trace", conflicts_with = "trace")]
    pub prometheus: Option<String>,
    /// A trace `stormguard proxy --record` wrote (JSON lines).
    #[arg(long, value_name = "FILE")]
    pub trace: Option<PathBuf>,
    /// With --prometheus: the range is the last DURATION up to now.
    #[arg(long, value_name = "DURATION", value_parser = crate::args::duration, conflicts_with_all = ["start", "end"])]
    pub last: Option<Duration>,
    /// With --prometheus: the range's start, Unix seconds.
    #[arg(long, value_name = "UNIX_SECONDS", requires = "end")]
    pub start: Option<f64>,
    /// With --prometheus: the range's end, Unix seconds.
    #[arg(long, value_name = "UNIX_SECONDS", requires = "start")]
    pub end: Option<f64>,
    /// The step: each step's originals, retries and in-flight are one point.
    #[arg(long, value_name = "DURATION", default_value = "15s", value_parser = crate::args::duration)]
    pub step: Duration,
    /// Whose metric names to read.
    #[arg(long, value_enum, default_value_t = System::Stormguard)]
    pub system: System,
    /// A mapping file instead (TOML: label, originals, retries, and optionally shed, in_flight,
    /// cap — PromQL with $step).
    #[arg(long, value_name = "FILE", conflicts_with = "system")]
    pub mapping: Option<PathBuf>,
    /// Review only this dependency (cluster, route): the mapping's label value.
    #[arg(long, value_name = "NAME")]
    pub dependency: Option<String>,
    /// The dependency's cap, when the history does not say it (or says it wrong).
    #[arg(long, value_name = "N")]
    pub cap: Option<u64>,
    /// A candidate's percent must be at least this many times the quiet steps' p95 ratio.
    #[arg(long, value_name = "X", default_value_t = 2.0)]
    pub margin: f64,
    /// Output format: a report, JSON, the recommended SPEC alone, or the recommendation in a
    /// system's own config (through `plan`'s writers).
    #[arg(long, value_enum, default_value_t = Format::Text)]
    pub format: Format,
    /// Also write the report as one self-contained HTML page: the ratio over time with the
    /// incidents shaded and the candidate budgets drawn over it, in flight against the cap.
    #[arg(long, value_name = "FILE")]
    pub html: Option<PathBuf>,
}

/// Whose metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum System {
    /// stormguard's own (`stormguard_requests_total`, `stormguard_retries_total`, …).
    Stormguard,
    /// Envoy's cluster statistics (`envoy_cluster_upstream_rq_total`, `…_rq_retry`, …).
    Envoy,
    /// Linkerd 2.16's route metrics (`outbound_http_route_retry_requests_total`, …).
    Linkerd,
}

/// How to print the review.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Format {
    /// A report for people.
    Text,
    /// One JSON object per dependency, in one object keyed by name.
    Json,
    /// The recommended SPEC alone (one dependency).
    Spec,
    /// An Envoy bootstrap with the recommended budget (one dependency).
    Envoy,
    /// Istio's DestinationRule and VirtualService.
    Istio,
    /// A Gateway API XBackendTrafficPolicy and HTTPRoute.
    #[value(name = "gateway-api")]
    GatewayApi,
    /// Linkerd 2.16 retry annotations.
    Linkerd,
}

/// Runs `stormguard review`.
pub fn run(args: &ReviewArgs, out: &mut dyn Write) -> Result<(), Failure> {
    if args.step.is_zero() {
        return Err(Failure::usage("--step must be longer than zero"));
    }
    if !(args.margin.is_finite() && args.margin >= 0.0) {
        return Err(Failure::usage("--margin must be a number of at least 0"));
    }
    let (mut histories, from) = match (&args.prometheus, &args.trace) {
        (Some(url), _) => {
            let mapping = match (&args.mapping, args.system) {
                (Some(path), _) => Mapping::load(path)?,
                (None, System::Stormguard) => Mapping::stormguard(),
                (None, System::Envoy) => Mapping::envoy(),
                (None, System::Linkerd) => Mapping::linkerd(),
            };
            let range = range(args)?;
            (source::prometheus(url, &mapping, range)?, format!("Prometheus at {url}"))
        }
        (None, Some(path)) => (source::trace(path, args.step)?, format!("{}", path.display())),
        (None, None) => return Err(Failure::usage("give --prometheus URL or --trace FILE")),
    };
    if let Some(name) = &args.dependency {
        let names: Vec<String> = histories.keys().cloned().collect();
        histories.retain(|n, _| n == name);
        if histories.is_empty() {
            return Err(Failure::usage(format!(
                "no history of dependency `{name}` in {from} (it has: {})",
                if names.is_empty() { "none".to_string() } else { names.join(", ") }
            )));
        }
    }
    if histories.is_empty() {
        return Err(Failure::usage(format!("no history in {from}: no series matched")));
    }
    let config = ReviewConfig { margin: args.margin, ..ReviewConfig::default() };
    let mut reviews: BTreeMap<String, (History, Review)> = BTreeMap::new();
    for (name, mut h) in histories {
        if let Some(cap) = args.cap {
            h.cap = Some(cap as f64);
        }
        let r = match &args.trace {
            // A trace's candidates run through their policies themselves, event by event.
            Some(path) if args.prometheus.is_none() => {
                // Every candidate the review weighs, replayed in one reading of the trace.
                let candidates: Vec<(f64, f64)> = config
                    .percents
                    .iter()
                    .flat_map(|&p| config.floors.iter().map(move |&f| (p, f)))
                    .collect();
                let specs: Vec<String> = candidates
                    .iter()
                    .map(|&(percent, floor)| {
                        Candidate { percent, floor, ..Candidate::default() }.spec()
                    })
                    .collect();
                let allowed = source::replay(path, &name, args.step, &specs, h.steps.len())?;
                let replayed = |percent: f64, floor: f64| {
                    let i = candidates.iter().position(|&c| c == (percent, floor));
                    i.map_or_else(Vec::new, |i| allowed[i].clone())
                };
                review_with(&h, &config, Some(&replayed))
            }
            _ => review(&h, &config),
        };
        reviews.insert(name, (h, r));
    }
    if let Some(path) = &args.html {
        let pages: Vec<(&str, &History, &Review, String)> = reviews
            .iter()
            .map(|(n, (h, r))| (n.as_str(), h, r, text(n, h, r, &from, args.margin)))
            .collect();
        std::fs::write(path, html::page(&pages))
            .map_err(|e| Failure::runtime(format!("{}: {e}", path.display())))?;
    }
    match args.format {
        Format::Text => {
            for (name, (h, r)) in &reviews {
                write!(out, "{}", text(name, h, r, &from, args.margin))?;
            }
        }
        Format::Json => {
            let all: serde_json::Map<String, Value> =
                reviews.iter().map(|(n, (h, r))| (n.clone(), json_of(h, r))).collect();
            writeln!(out, "{}", serde_json::to_string_pretty(&all).expect("JSON serializes"))?;
        }
        system => {
            let (name, (h, r)) = one(&reviews)?;
            let c = r.recommended.map(|(i, _)| r.candidates[i]).ok_or_else(|| {
                Failure::usage(format!("no candidate budget for `{name}`: no steps with requests"))
            })?;
            if !c.above_jitter {
                eprintln!(
                    "stormguard review: no candidate clears the quiet jitter of `{name}`; {} is the most generous swept",
                    c.spec()
                );
            }
            if system == Format::Spec {
                writeln!(out, "{}", c.spec())?;
                return Ok(());
            }
            let cap = h.cap.ok_or_else(|| {
                Failure::usage(format!("`{name}`'s cap is not in the history: give --cap N"))
            })?;
            write!(out, "{}", in_system(system, cap, c.percent)?)?;
        }
    }
    Ok(())
}

/// The range to query: `--last`, or `--start`/`--end`, or the last hour.
fn range(args: &ReviewArgs) -> Result<source::Range, Failure> {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_err(|e| Failure::runtime(format!("the clock is before 1970: {e}")))?
        .as_secs_f64();
    let (start, end) = match (args.start, args.end, args.last) {
        (Some(s), Some(e), _) => (s, e),
        (_, _, Some(last)) => (now - last.as_secs_f64(), now),
        _ => (now - 3600.0, now),
    };
    if !(start.is_finite() && end.is_finite() && start < end) {
        return Err(Failure::usage("the range's --start must come before its --end"));
    }
    if (end - start) / args.step.as_secs_f64() > 11_000.0 {
        return Err(Failure::usage(
            "more than 11 000 steps in the range (Prometheus's own limit): give a longer --step",
        ));
    }
    Ok(source::Range { start, end, step: args.step })
}

fn one(
    reviews: &BTreeMap<String, (History, Review)>,
) -> Result<(&String, &(History, Review)), Failure> {
    match reviews.len() {
        1 => Ok(reviews.iter().next().expect("one")),
        n => Err(Failure::usage(format!(
            "{n} dependencies in the history ({}): name one with --dependency",
            reviews.keys().cloned().collect::<Vec<_>>().join(", ")
        ))),
    }
}

/// The recommendation in a system's own config: `plan`'s writers, with the primary that gives
/// the recommended percent under the cap (`cap / (1 + percent)`, rounded down).
fn in_system(format: Format, cap: f64, percent: f64) -> Result<String, Failure> {
    use clap::Parser;
    let cap = cap.round().max(1.0) as u64;
    let primary = ((cap as f64) / (1.0 + percent)).floor().max(1.0) as u64;
    let system = match format {
        Format::Envoy => "envoy",
        Format::Istio => "istio",
        Format::GatewayApi => "gateway-api",
        _ => "linkerd",
    };
    let argv = [
        "stormguard",
        "plan",
        "--cap",
        &cap.to_string(),
        "--primary",
        &primary.to_string(),
        "--format",
        system,
    ];
    let cli = crate::Cli::try_parse_from(argv).map_err(|e| Failure::runtime(e.to_string()))?;
    let mut buf = Vec::new();
    writeln!(
        buf,
        "# stormguard review: the recommended ratio {} under a cap of {cap}, as `stormguard plan --cap {cap} --primary {primary}`",
        number(percent, 4)
    )?;
    crate::run(cli, &mut buf)?;
    Ok(String::from_utf8_lossy(&buf).into_owned())
}

fn pct(x: f64) -> String {
    percent(x, 1)
}

fn text(name: &str, h: &History, r: &Review, from: &str, margin: f64) -> String {
    use std::fmt::Write as _;
    let mut s = String::new();
    let secs = h.step.as_secs_f64();
    let origin = h.steps.first().map_or(0.0, |s| s.at);
    let t = |at: f64| format!("+{}s", number(at - origin, 0));
    let name = if name.is_empty() { "(unnamed)" } else { name };
    let _ =
        writeln!(s, "dependency {name} ({from}, {} steps of {}s)", h.steps.len(), number(secs, 3));
    let n = &r.normal;
    let _ = writeln!(
        s,
        "  normal retry ratio {} (per step: p50 {}, p95 {}, max {}) over {} quiet steps; a step above {} is an incident's",
        pct(n.ratio),
        pct(n.p50),
        pct(n.p95),
        pct(n.max),
        n.steps,
        pct(n.threshold)
    );
    if r.incidents.is_empty() {
        let _ = writeln!(s, "  no incident");
    }
    for i in &r.incidents {
        let _ = writeln!(
            s,
            "  incident {} to {} ({}s): peak {} at {}, {} across it",
            t(i.start),
            t(i.end),
            number(i.end - i.start, 0),
            pct(i.peak_ratio),
            t(i.peak_at),
            pct(i.ratio)
        );
    }
    match (r.in_flight, r.cap) {
        (Some(f), cap) => {
            let cap = cap.map_or(String::from(" (cap unknown: --cap N)"), |c| {
                format!(" of a cap of {}", number(c, 0))
            });
            let _ = writeln!(
                s,
                "  in flight at the dependency: p95 {}, p99 {}, max {}{cap}",
                number(f.p95, 1),
                number(f.p99, 1),
                number(f.max, 1)
            );
        }
        (None, _) => {
            let _ = writeln!(s, "  in flight at the dependency: not in the history");
        }
    }
    match r.exhausted {
        Some(e) => {
            let _ = writeln!(
                s,
                "  the configured budget first shed a retry at {}; {} shed in all, {} of them in quiet steps",
                t(e.first_at),
                number(e.shed, 0),
                number(e.shed_quiet, 0)
            );
        }
        None => {
            let _ = writeln!(s, "  the configured budget (if any) shed no retry");
        }
    }
    let _ = writeln!(
        s,
        "  candidates, {} (\"shed after\": in the window after an incident, still spent):",
        if r.replayed {
            "each ratio budget run over the recorded events themselves"
        } else {
            "each a ratio budget's balance over the measured steps (an approximation)"
        }
    );
    let mut rows = vec![vec![
        "SPEC".to_string(),
        "allowed/s at peak".into(),
        "in flight (est.)".into(),
        "shed quiet".into(),
        "shed incident".into(),
        "shed after".into(),
        String::new(),
    ]];
    for (i, c) in r.candidates.iter().enumerate() {
        let mark = match r.recommended {
            Some((k, _)) if k == i => "<- recommended",
            _ if !c.above_jitter => "under the quiet jitter",
            _ if !c.under_cap => "past the cap",
            _ => "",
        };
        rows.push(vec![
            c.spec(),
            number(c.allowed_at_peak, 1),
            c.in_flight.map_or("-".into(), |f| number(f, 1)),
            number(c.shed_quiet, 0),
            number(c.shed_incident, 0),
            number(c.shed_after, 0),
            mark.into(),
        ]);
    }
    for line in stormguard_core::format::table(&rows, |c| {
        if (1..6).contains(&c) {
            stormguard_core::format::Align::Right
        } else {
            stormguard_core::format::Align::Left
        }
    }) {
        let _ = writeln!(s, "    {line}");
    }
    match r.recommended {
        Some((i, _)) if !r.candidates[i].above_jitter => {
            let _ = writeln!(
                s,
                "  no candidate clears the quiet jitter ({} x the quiet p95 {} is past the largest percent, or every one sheds quiet retries): {} is the most generous swept; widen the sweep or look at why the quiet ratio is so high",
                number(margin, 2),
                pct(n.p95),
                r.candidates[i].spec()
            );
        }
        Some((i, under)) => {
            let c = r.candidates[i];
            let why = if under {
                "the smallest that clears the quiet jitter and keeps the estimated in-flight within the cap"
            } else {
                "the smallest that clears the quiet jitter; none keeps the estimated in-flight within the cap, so the cap is what bounds it"
            };
            let _ = writeln!(
                s,
                "  recommended: {} — {why} (percent at least {} x the quiet p95 {}, no quiet retry shed)",
                c.spec(),
                number(margin, 2),
                pct(n.p95)
            );
        }
        None => {
            let _ = writeln!(s, "  no recommendation: no step had requests");
        }
    }
    s
}

fn json_of(h: &History, r: &Review) -> Value {
    let n = &r.normal;
    json!({
        "step_s": h.step.as_secs_f64(),
        "steps": h.steps.len(),
        "history": h.steps.iter().map(|s| json!({
            "at": s.at, "originals": s.originals, "retries": s.retries, "shed": s.shed,
            "in_flight": s.in_flight,
        })).collect::<Vec<_>>(),
        "normal": {
            "ratio": n.ratio, "p50": n.p50, "p95": n.p95, "max": n.max,
            "quiet_steps": n.steps, "incident_threshold": n.threshold,
        },
        "incidents": r.incidents.iter().map(|i| json!({
            "start": i.start, "end": i.end, "peak_ratio": i.peak_ratio, "peak_at": i.peak_at,
            "ratio": i.ratio,
        })).collect::<Vec<_>>(),
        "in_flight": r.in_flight.map(|f| json!({"p95": f.p95, "p99": f.p99, "max": f.max})),
        "cap": r.cap,
        "exhausted": r.exhausted.map(|e| json!({
            "first_at": e.first_at, "shed": e.shed, "shed_quiet": e.shed_quiet,
        })),
        "sweep": if r.replayed {
            "each policy run over the recorded events"
        } else {
            "an approximation: a ratio budget's balance kept over the measured steps"
        },
        "candidates": r.candidates.iter().map(|c| json!({
            "spec": c.spec(), "percent": c.percent, "floor": c.floor,
            "allowed_at_peak_per_s": c.allowed_at_peak, "in_flight": c.in_flight,
            "shed_quiet": c.shed_quiet, "shed_incident": c.shed_incident,
            "shed_after_incident": c.shed_after,
            "above_jitter": c.above_jitter, "under_cap": c.under_cap,
        })).collect::<Vec<_>>(),
        "recommended": r.recommended.map(|(i, under)| json!({
            "spec": r.candidates[i].spec(), "under_cap": under,
            "clears_jitter": r.candidates[i].above_jitter,
        })),
    })
}
