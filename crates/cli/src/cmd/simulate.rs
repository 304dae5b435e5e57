//! `stormguard simulate`: a deterministic discrete-event model of a retry storm, running
//! stormguard-core's own limiter, breaker and retry decision on a virtual clock.
//!
//! Every policy in the scenario sees the same arrivals and the same per-attempt luck; the
//! output is a side-by-side table (or `--json`), and `--html FILE` writes a self-contained
//! report with charts. Same seed, byte-identical JSON. The model: docs/simulator.md.

use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use clap::Args;
use stormguard_sim::{Options, Scenario, builtin};

use crate::Failure;

/// Flags of `stormguard simulate`.
#[derive(Debug, Args)]
#[command(after_help = "\
Built-in scenarios (--builtin NAME; --print-scenario shows one as a file to start from):
  worked-example   the README's table: 16 planned in flight, cap 20, 5/20/40 % errors
  slow-dependency  latency rises past the per-try timeout, no errors
  metastable       a short trigger leaves naive retries stuck; budgets recover
  fan-out          5 parallel calls per action: per-hop versus per-action budgets
  fleet            50 instances: per-instance versus fleet-shared caps and floors; breakers
  model-provider   requests per minute at twice the limit: 429s without rate admission, ~0 with it
  model-provider-tokens
                   the same with tokens per minute binding: bookings settled at the usage
  long-tail        4 % of answers at 20x the median: hedging cuts p99 within the retry budget and
                   the cap; a naive hedger overloads at 40 % errors
  capacity-drop    the servers halve for 30 s: fixed caps of 10, 20 and 40 against an adaptive
                   cap that follows the capacity down and back up
  database         20 pods' pools against max_connections 400 less 20 reserved: pools of 20 with
                   three retries reach the server's limit; pools of 19 under a 20 % budget do not
  call-tree        three hops, each with a 20 % budget: 1.73 attempts per action at the
                   dependency; one tree allowance of 1.2 holds it to 1.2
  demo             stormguard demo's script: an upstream that slows past 22 in flight; retry
                   once against a cap of 20 and a 25 % budget (the demo serves this scenario)

Examples:
  stormguard simulate --builtin metastable --html report.html
  stormguard simulate --builtin worked-example --json
  stormguard simulate deploy/examples/storm.toml --policy retry-once --policy ratio-budget")]
pub struct SimulateArgs {
    /// The scenario file (TOML); see docs/simulator.md for every key.
    #[arg(value_name = "FILE", conflicts_with = "builtin")]
    pub file: Option<PathBuf>,
    /// A built-in scenario instead of a file.
    #[arg(long, value_name = "NAME")]
    pub builtin: Option<String>,
    /// List the built-in scenarios and exit.
    #[arg(long)]
    pub list: bool,
    /// Print the scenario's TOML and exit (a built-in's, to start your own from).
    #[arg(long)]
    pub print_scenario: bool,
    /// Use this seed instead of the scenario's.
    #[arg(long, value_name = "N")]
    pub seed: Option<u64>,
    /// Print the results as JSON instead of the table.
    #[arg(long)]
    pub json: bool,
    /// With --json, add each policy's per-bucket time series.
    #[arg(long, requires = "json")]
    pub series: bool,
    /// Also write a self-contained HTML report with charts to FILE.
    #[arg(long, value_name = "FILE")]
    pub html: Option<PathBuf>,
    /// Simulate only this policy (by name; repeat for several).
    #[arg(long = "policy", value_name = "NAME")]
    pub policies: Vec<String>,
    /// Policies simulated at once on separate threads (default: the available CPUs). The
    /// results do not depend on it.
    #[arg(long, value_name = "N")]
    pub jobs: Option<usize>,
    /// Never show the progress bar (it is shown on a terminal for runs longer than a second).
    #[arg(long)]
    pub no_progress: bool,
}

/// Runs `stormguard simulate`.
pub fn run(args: &SimulateArgs, out: &mut dyn Write) -> Result<(), Failure> {
    if args.list {
        for (name, text) in builtin::ALL {
            let description =
                Scenario::parse(name, text).map(|s| s.description).unwrap_or_default();
            writeln!(out, "{name:16} {}", first_sentence(&description))?;
        }
        let (name, text) = builtin::CALL_TREE;
        let description = stormguard_sim::tree::CallTree::parse(name, text)
            .map(|s| s.description)
            .unwrap_or_default();
        writeln!(out, "{name:16} {}", first_sentence(&description))?;
        return Ok(());
    }
    let (origin, text) = source(args.builtin.as_deref(), args.file.as_ref())?;
    if stormguard_sim::tree::is_call_tree(&text, &origin) {
        return run_call_tree(args, &origin, &text, out);
    }
    let mut scenario = scenario(args.builtin.as_deref(), &origin, &text)?;
    if args.print_scenario {
        out.write_all(text.as_bytes())?;
        return Ok(());
    }
    if let Some(seed) = args.seed {
        scenario.seed = seed;
    }
    select(&mut scenario, &args.policies)?;
    let jobs =
        args.jobs.unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    if jobs == 0 {
        return Err(Failure::usage("--jobs must be at least 1"));
    }
    let bar = (!args.no_progress && std::io::stderr().is_terminal()).then(ProgressBar::new);
    let progress = |fraction: f64| {
        if let Some(bar) = &bar {
            bar.update(fraction);
        }
    };
    let options = Options {
        jobs,
        progress: bar.as_ref().map(|_| &progress as &(dyn Fn(f64) + Sync)),
        ..Options::default()
    };
    let report = stormguard_sim::simulate_with(&scenario, &options)
        .map_err(|e| Failure::usage(format!("{}: {e}", scenario.name)))?;
    if let Some(bar) = &bar {
        bar.finish();
    }
    if args.json {
        out.write_all(report.to_json(args.series).as_bytes())?;
    } else {
        report.write_table(out)?;
    }
    if let Some(path) = &args.html {
        std::fs::write(path, stormguard_sim::html::render(&report)).map_err(|e| {
            Failure::runtime(format!("{}: cannot write the report: {e}", path.display()))
        })?;
        if !args.json {
            writeln!(out, "\nwrote {}", path.display())?;
        }
    }
    Ok(())
}

/// The scenario named by `--builtin NAME` or a FILE, and its text.
pub(crate) fn load(
    builtin: Option<&str>,
    file: Option<&PathBuf>,
) -> Result<(Scenario, String), Failure> {
    let (origin, text) = source(builtin, file)?;
    if stormguard_sim::tree::is_call_tree(&text, &origin) {
        return Err(Failure::usage(format!(
            "{origin}: a call tree ([call_tree]) is run by `stormguard simulate` alone"
        )));
    }
    Ok((scenario(builtin, &origin, &text)?, text))
}

/// The scenario of `text`, read from `origin` (a built-in's own, when `builtin` names one).
fn scenario(builtin: Option<&str>, origin: &str, text: &str) -> Result<Scenario, Failure> {
    match builtin {
        Some(name) => builtin::scenario(name).map_err(|e| Failure::usage(e.to_string())),
        None => Scenario::parse(origin, text).map_err(|e| Failure::usage(e.to_string())),
    }
}

/// Where the scenario comes from (for its errors), and its text.
fn source(builtin: Option<&str>, file: Option<&PathBuf>) -> Result<(String, String), Failure> {
    match (builtin, file) {
        (Some(name), _) => match builtin::text(name) {
            Some(text) => Ok((format!("--builtin {name}"), text.to_string())),
            None => Err(Failure::usage(format!(
                "no built-in scenario `{name}` (expected one of: {})",
                builtin::names().join(", ")
            ))),
        },
        (None, Some(path)) => {
            let text = stormguard_input::read_to_string(path, stormguard_input::MAX_FILE).map_err(
                |e| Failure::usage(format!("{}: cannot read the scenario: {e}", path.display())),
            )?;
            Ok((path.display().to_string(), text))
        }
        (None, None) => Err(Failure::usage(format!(
            "give a scenario FILE or --builtin NAME (one of: {})",
            builtin::names().join(", ")
        ))),
    }
}

/// A call tree (`[call_tree]`, docs/simulator.md): its own model and table.
fn run_call_tree(
    args: &SimulateArgs,
    origin: &str,
    text: &str,
    out: &mut dyn Write,
) -> Result<(), Failure> {
    if args.print_scenario {
        out.write_all(text.as_bytes())?;
        return Ok(());
    }
    if args.html.is_some() || args.series {
        return Err(Failure::usage("a call tree has no --html report or --series"));
    }
    let mut sc = stormguard_sim::tree::CallTree::parse(origin, text)
        .map_err(|e| Failure::usage(e.to_string()))?;
    if let Some(seed) = args.seed {
        sc.seed = seed;
    }
    keep_policies(&mut sc.policies, |p| &p.name, &sc.name, &args.policies)?;
    let report = stormguard_sim::tree::run(&sc);
    match args.json {
        true => out.write_all(report.to_json().as_bytes())?,
        false => report.write_table(out)?,
    }
    Ok(())
}

/// Keeps only the `--policy` names given (all when none), refusing a name the scenario lacks.
pub(crate) fn select(scenario: &mut Scenario, wanted: &[String]) -> Result<(), Failure> {
    keep_policies(&mut scenario.policies, |p| &p.name, &scenario.name, wanted)
}

/// Keeps only the policies `wanted` names (all when none), refusing a name `scenario` lacks:
/// a scenario's policies and a call tree's alike.
fn keep_policies<P>(
    policies: &mut Vec<P>,
    name_of: impl Fn(&P) -> &String,
    scenario: &str,
    wanted: &[String],
) -> Result<(), Failure> {
    if wanted.is_empty() {
        return Ok(());
    }
    for name in wanted {
        if !policies.iter().any(|p| name_of(p) == name) {
            let names: Vec<&str> = policies.iter().map(|p| name_of(p).as_str()).collect();
            return Err(Failure::usage(format!(
                "no policy `{name}` in scenario {scenario} (it has: {})",
                names.join(", ")
            )));
        }
    }
    policies.retain(|p| wanted.contains(name_of(p)));
    Ok(())
}

fn first_sentence(text: &str) -> &str {
    let text = text.trim();
    match text.find(". ") {
        Some(i) => &text[..=i],
        None => text,
    }
}

/// A one-line progress bar on stderr, drawn only once a run has taken more than a second.
#[derive(Debug)]
struct ProgressBar {
    start: Instant,
    drawn: Mutex<bool>,
}

impl ProgressBar {
    fn new() -> ProgressBar {
        ProgressBar { start: Instant::now(), drawn: Mutex::new(false) }
    }

    fn update(&self, fraction: f64) {
        if self.start.elapsed() < Duration::from_secs(1) {
            return;
        }
        let width = 40;
        let filled = ((fraction * width as f64) as usize).min(width);
        eprint!(
            "\rsimulating [{}{}] {:>3.0}%",
            "#".repeat(filled),
            "-".repeat(width - filled),
            fraction * 100.0
        );
        if let Ok(mut d) = self.drawn.lock() {
            *d = true;
        }
    }

    fn finish(&self) {
        if self.drawn.lock().map(|d| *d).unwrap_or(false) {
            eprint!("\r{}\r", " ".repeat(60));
        }
    }
}
