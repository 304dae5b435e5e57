//! `stormguard demo`: the worked example, live, on loopback, with nothing to set up.
//!
//! Two paths take the same open-loop arrivals (160 requests/s; at 100 ms a request, the 16
//! planned in flight) to two identical chaos upstreams that play the same seeded script:
//! 5 % errors, 20 %, 40 %, then a latency spike with no errors at all, then recovery.
//!
//! - **naive**: a client that retries each failure once, at once — no cap, no budget;
//! - **stormguard**: `stormguard proxy` with a cap of 20 and a ratio budget of 25 % of first
//!   tries, the numbers of the worked example.
//!
//! Each upstream counts what reaches it (chaos measures in flight exactly, at the dependency),
//! so the two are compared where it matters. While it runs, the proxy's live dashboard is at
//! the printed URL; at the end it prints a side-by-side table and writes an HTML report with
//! the time series.

pub(crate) mod naive;
pub(crate) mod report;
mod sample;
mod scenario;
mod summary;
mod table;

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io::{IsTerminal, Write};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use clap::Args;
use serde::Serialize;
use stormguard_chaos::load::{self, Live, LoadConfig, LoadReport, Mode};
use stormguard_chaos::{ChaosConfig, ChaosServer, OnDisconnect, Rate, Script, Stats};
use stormguard_core::Denied;
use stormguard_core::decimal::format_duration;
use stormguard_proxy::config::ProxyConfig;

use crate::Failure;

/// Arrivals per second on each path: 16 in flight at 100 ms.
pub const RATE_PER_S: f64 = 160.0;
/// The cap of the worked example.
pub const CAP: u64 = 20;
/// The primaries planned in flight.
pub const PLANNED_PRIMARY: u64 = 16;
/// `(cap − planned) / planned`: the budget that keeps retries under the cap.
pub const BUDGET: &str = "ratio:percent=0.25,min_per_sec=1,ttl=10s";
/// The budget's percent, for the reference lines.
pub const BUDGET_PERCENT: f64 = 0.25;
/// Each attempt's limit, on both paths.
pub const PER_TRY_TIMEOUT: Duration = Duration::from_millis(350);
const DEPENDENCY: &str = "demo";
/// How many requests the dependency works on at full speed: past that, every request it holds
/// takes longer (in flight / workers times), as a real server's do when overloaded. The cap of
/// 20 was planned inside it.
pub const WORKERS: u64 = 22;

/// Flags of `stormguard demo`.
#[derive(Debug, Args)]
#[command(after_help = "\
Two paths take the same 160 requests/s to two identical fault-injecting upstreams on
127.0.0.1, which play 5 % errors, 20 %, 40 %, a latency spike without errors, and recovery:
a naive client that retries each failure once, and stormguard proxy with a cap of 20 and a
25 % retry budget. Open the printed dashboard URL while it runs.

  stormguard demo                               about a minute, report in stormguard-demo.html
  stormguard demo --duration 10s --json --report /tmp/demo.html

Exit codes: 0 the run completed (the table says what each path did), 1 it could not run,
2 bad flags.")]
pub struct DemoArgs {
    /// How long the run lasts; the five phases scale with it (5s to 10m).
    #[arg(long, value_name = "DURATION", default_value = "60s", value_parser = crate::args::duration)]
    pub duration: Duration,
    /// Where to write the HTML report, or "off".
    #[arg(long, value_name = "PATH", default_value = "stormguard-demo.html")]
    pub report: String,
    /// Print one JSON object on stdout instead of the table.
    #[arg(long)]
    pub json: bool,
    /// The proxy's admin listener, where the dashboard is (a loopback address; port 0 picks a
    /// free one).
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:0")]
    pub admin: SocketAddr,
    /// The upstreams' seed: the same seed draws the same errors and latencies.
    #[arg(long, value_name = "N", default_value_t = 7)]
    pub seed: u64,
    /// The log's format.
    #[command(flatten)]
    pub log: crate::log::LogArgs,
}

use sample::*;
use scenario::*;
pub use scenario::{PhasePlan, plan};
pub use summary::*;
pub use table::table;
use table::{by_reason, pct, secs};

/// Runs `stormguard demo`.
pub fn run(args: &DemoArgs, out: &mut dyn Write) -> Result<(), Failure> {
    let duration = args.duration;
    if duration < Duration::from_secs(5) || duration > Duration::from_secs(600) {
        return Err(Failure::usage(format!(
            "--duration: must be between 5s and 10m, got {}",
            format_duration(duration)
        )));
    }
    if !args.admin.ip().is_loopback() {
        return Err(Failure::usage(format!(
            "--admin: the demo listens on loopback only, got {}",
            args.admin
        )));
    }
    let report_path = match args.report.as_str() {
        "off" => None,
        p => Some(PathBuf::from(p)),
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| Failure::runtime(format!("cannot start the runtime: {e}")))?;
    let result = runtime.block_on(demo(args, duration));
    // Connections still closing must not hold the exit.
    runtime.shutdown_background();
    let mut summary = result?;
    if let Some(path) = &report_path {
        std::fs::write(path, report::render(&summary)).map_err(|e| {
            Failure::runtime(format!("cannot write the report {}: {e}", path.display()))
        })?;
        summary.report = Some(path.display().to_string());
    }
    if args.json {
        serde_json::to_writer(&mut *out, &summary)
            .map_err(|e| Failure::runtime(format!("cannot write the summary: {e}")))?;
        writeln!(out)?;
    } else {
        out.write_all(table(&summary).as_bytes())?;
    }
    Ok(())
}

/// Progress on stderr: redrawn in place on a terminal, one line per phase otherwise (with
/// `--log-format json`, one log event per phase).
struct Progress {
    tty: bool,
    format: crate::log::LogFormat,
}

impl Progress {
    fn line(&self, text: &str) {
        if self.tty {
            eprint!("\r{:100}\r", "");
        }
        crate::log::status(self.format, text);
    }

    fn status(&self, text: &str) {
        if self.tty {
            eprint!("\r{text:100}");
        }
    }
}

async fn demo(args: &DemoArgs, duration: Duration) -> Result<Summary, Failure> {
    let format = args.log.log_format;
    let progress = Progress {
        tty: std::io::stderr().is_terminal() && format == crate::log::LogFormat::Text,
        format,
    };
    let sc = scenario(duration, args.seed)?;
    let plan = plan(&sc);
    let any = SocketAddr::from(([127, 0, 0, 1], 0));
    let script = script(&sc)?;
    let start = |name: &'static str| {
        let config = ChaosConfig::new(script.clone());
        async move {
            stormguard_chaos::spawn(config, any)
                .await
                .map_err(|e| Failure::runtime(format!("cannot start the {name} upstream: {e}")))
        }
    };
    // Both upstreams start together, so their phases switch together.
    let (guarded_up, naive_up) = tokio::try_join!(start("stormguard"), start("naive"))?;
    let proxy = stormguard_proxy::start(proxy_config(&sc, &guarded_up.url(""), args.admin)?)
        .await
        .map_err(|e| Failure::runtime(format!("cannot start the proxy: {e}")))?;
    let retries = naive_retries(&sc)?;
    let naive = naive::start(
        naive_up.url("").parse().map_err(|e| Failure::runtime(format!("{e}")))?,
        retries,
    )
    .await
    .map_err(|e| Failure::runtime(format!("cannot start the naive client: {e}")))?;
    let admin = proxy.admin_addr().ok_or_else(|| Failure::runtime("the proxy has no admin"))?;
    let dashboard = format!("http://{admin}/dashboard");
    progress.line(&format!(
        "stormguard demo: {RATE_PER_S} requests/s on each path for {:.0} s; cap {CAP}, budget {} of first tries",
        duration.as_secs_f64(),
        stormguard_core::format::percent_trimmed(BUDGET_PERCENT, 2)
    ));
    progress.line(&format!("dashboard (live, the stormguard path): {dashboard}"));

    let guarded_load = load_config(proxy.listen_addrs()[0], duration)?;
    let naive_load = load_config(naive.local_addr(), duration)?;
    let (guarded_live, naive_live) = (Live::default(), Live::default());
    let finished = AtomicBool::new(false);
    let began = Instant::now();
    let loads = async {
        let r = tokio::join!(
            load::run(&guarded_load, &guarded_live),
            load::run(&naive_load, &naive_live)
        );
        finished.store(true, Ordering::Relaxed);
        r
    };
    let dep = proxy.dependency(DEPENDENCY).ok_or_else(|| Failure::runtime("no dependency"))?;
    let sources = Sources {
        naive: (&naive_up, &naive_live),
        guarded: (&guarded_up, &guarded_live),
        dep: &dep,
    };
    let sampler = sample(&sources, &plan, duration, began, &finished, &progress);
    let ((guarded_report, naive_report), marks) = tokio::join!(loads, sampler);
    let guarded_report =
        guarded_report.map_err(|e| Failure::runtime(format!("stormguard path: {e}")))?;
    let naive_report = naive_report.map_err(|e| Failure::runtime(format!("naive path: {e}")))?;
    // Requests the upstreams are still working on (abandoned by a timeout) end within the
    // spike's latency; wait for them so the counts are whole.
    let settle = Instant::now();
    while (guarded_up.in_flight() > 0 || naive_up.in_flight() > 0)
        && settle.elapsed() < Duration::from_secs(2)
    {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let denied = dep.policy().counters().snapshot();
    let (naive_stats, guarded_stats) = (naive_up.stats(), guarded_up.stats());
    proxy.shutdown().await;
    drop(naive);
    naive_up.shutdown().await;
    guarded_up.shutdown().await;
    progress.line(&format!("done in {:.1} s", began.elapsed().as_secs_f64()));

    let mut naive_summary = path_summary(&naive_report, &naive_stats, &marks, |m| &m.naive);
    let mut guarded_summary = path_summary(&guarded_report, &guarded_stats, &marks, |m| &m.guarded);
    naive_summary.retries_denied.clear();
    for d in Denied::ALL {
        let n = denied.denied(d);
        if n > 0 {
            let map = if d == Denied::Queue {
                &mut guarded_summary.primaries_shed
            } else {
                &mut guarded_summary.retries_denied
            };
            map.insert(d.as_str(), n);
        }
    }
    let phases = plan
        .iter()
        .enumerate()
        .map(|(i, p)| PhaseSummary {
            plan: p.clone(),
            naive: phase_path(p, naive_stats.phases.get(i), &marks, |m| &m.naive),
            stormguard: phase_path(p, guarded_stats.phases.get(i), &marks, |m| &m.guarded),
        })
        .collect();
    Ok(Summary {
        duration_s: duration.as_secs_f64(),
        rate_per_s: RATE_PER_S,
        cap: CAP,
        planned_primary: PLANNED_PRIMARY,
        budget: BUDGET,
        budget_percent: BUDGET_PERCENT,
        per_try_timeout_ms: PER_TRY_TIMEOUT.as_millis() as u64,
        dashboard,
        report: None,
        naive: naive_summary,
        stormguard: guarded_summary,
        phases,
        series: series(&marks),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_phases_cover_the_run_in_order() {
        let sc = scenario(Duration::from_secs(60), 7).unwrap();
        let p = plan(&sc);
        assert_eq!(p.len(), 5);
        assert_eq!(p[0].start_s, 0.0);
        assert!((p[4].end_s - 60.0).abs() < 1e-9);
        for w in p.windows(2) {
            assert_eq!(w[0].end_s, w[1].start_s);
        }
        let errors: Vec<f64> = p.iter().map(|p| p.error_rate).collect();
        assert_eq!(errors, [0.05, 0.2, 0.4, 0.0, 0.0]);
        assert_eq!(p[1].conditions, "20 % answered 503; latency 80–120 ms");
        assert_eq!(
            p[3].conditions,
            "no errors; latency 200–500 ms against a per-try timeout of 350 ms"
        );
        assert_eq!(p[4].conditions, "healthy; latency 80–120 ms");
        let s = script(&sc).unwrap();
        assert!(s.validate().is_ok());
        assert_eq!(s.phases[4].duration, None, "recovery lasts until the end");
        assert_eq!(s.phases[2].duration, Some(Duration::from_secs(15)));
        assert!(s.phases.iter().all(|p| p.workers == Some(WORKERS) && p.servers.is_none()));
        // Stretched to another duration, in the same shares.
        let half = plan(&scenario(Duration::from_secs(30), 7).unwrap());
        assert_eq!((half[2].start_s, half[2].end_s), (9.0, 16.5));
    }

    /// The demo's figures in its table and report are the scenario's, which the demo serves.
    #[test]
    fn the_demo_is_its_scenario() {
        let sc = stormguard_sim::builtin::scenario("demo").unwrap();
        // The demo's flags left out.
        let args = {
            use clap::Parser;
            #[derive(Parser)]
            struct Cli {
                #[command(flatten)]
                demo: DemoArgs,
            }
            Cli::parse_from(["demo"]).demo
        };
        assert_eq!(args.seed, sc.seed);
        assert_eq!(args.duration, sc.duration);
        assert!(matches!(
            sc.fleet.load,
            stormguard_sim::scenario::Load::Open { rate, .. } if rate == RATE_PER_S
        ));
        assert_eq!(sc.client.per_try_timeout, Some(PER_TRY_TIMEOUT));
        assert_eq!(sc.dependency.base.workers, Some(WORKERS as u32));
        let c =
            proxy_config(&sc, "http://127.0.0.1:9", SocketAddr::from(([127, 0, 0, 1], 0))).unwrap();
        assert!(c.validate().is_ok());
        let d = &c.dependencies[0];
        assert_eq!((d.cap, d.planned_primary, d.max_retries), (CAP, Some(PLANNED_PRIMARY), 1));
        assert_eq!(d.budget, BUDGET.parse().unwrap());
        assert_eq!((d.queue, d.queue_timeout), (100, Duration::from_millis(200)));
        // Each attempt's 350 ms, retries at once (1-5 ms), and the callers' 5 s patience.
        assert_eq!(d.per_try_timeout, Some(PER_TRY_TIMEOUT));
        assert_eq!(d.deadline, Some(Duration::from_secs(5)));
        assert_eq!(
            d.backoff,
            stormguard_core::backoff::BackoffConfig::parse_range("1ms..5ms").unwrap()
        );
        let naive = naive_retries(&sc).unwrap();
        assert_eq!((naive.max, naive.per_try_timeout), (1, Some(PER_TRY_TIMEOUT)));
        // (cap − planned) / planned
        assert_eq!(BUDGET_PERCENT, (CAP - PLANNED_PRIMARY) as f64 / PLANNED_PRIMARY as f64);
    }

    #[test]
    fn seconds_print_without_a_needless_decimal() {
        assert_eq!(secs(9.0), "9");
        assert_eq!(secs(1.5), "1.5");
    }
}
