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

mod naive;
mod report;

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
use stormguard_chaos::{
    ChaosConfig, ChaosServer, Latency, OnDisconnect, Phase, Rate, Script, Stats,
};
use stormguard_core::Denied;
use stormguard_core::backoff::BackoffConfig;
use stormguard_core::decimal::parse_duration;
use stormguard_proxy::config::{DependencyConfig, ProxyConfig};

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
    #[arg(long, value_name = "DURATION", default_value = "60s")]
    pub duration: String,
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
}

/// One phase of the script, placed on the run's timeline.
#[derive(Debug, Clone, Serialize)]
pub struct PhasePlan {
    /// Its name.
    pub name: &'static str,
    /// When it starts, in seconds from the start of the run.
    pub start_s: f64,
    /// When it ends.
    pub end_s: f64,
    /// The share of requests answered 503.
    pub error_rate: f64,
    /// What the upstream does, in words.
    pub conditions: String,
    #[serde(skip)]
    latency: Latency,
}

const NORMAL: (u64, u64) = (80, 120);
const SPIKE: (u64, u64) = (200, 500);

fn uniform((lo, hi): (u64, u64)) -> Latency {
    Latency::Uniform { min: Duration::from_millis(lo), max: Duration::from_millis(hi) }
}

/// The five phases over `duration`: 15 % at 5 % errors, 15 % at 20 %, 25 % at 40 %, 20 % of a
/// latency spike, 25 % of recovery.
pub fn plan(duration: Duration) -> Vec<PhasePlan> {
    let d = duration.as_secs_f64();
    let normal = format!("latency {}–{} ms", NORMAL.0, NORMAL.1);
    let steps: [(&'static str, f64, f64, (u64, u64)); 5] = [
        ("5 % errors", 0.15, 0.05, NORMAL),
        ("20 % errors", 0.15, 0.20, NORMAL),
        ("40 % errors", 0.25, 0.40, NORMAL),
        ("latency spike", 0.20, 0.0, SPIKE),
        ("recovery", 0.25, 0.0, NORMAL),
    ];
    let mut start = 0.0;
    steps
        .iter()
        .map(|&(name, share, error_rate, latency)| {
            let end = start + share * d;
            let conditions = if latency == SPIKE {
                format!(
                    "no errors; latency {}–{} ms against a per-try timeout of {} ms",
                    latency.0,
                    latency.1,
                    PER_TRY_TIMEOUT.as_millis()
                )
            } else if error_rate > 0.0 {
                format!("{:.0} % answered 503; {normal}", error_rate * 100.0)
            } else {
                format!("healthy; {normal}")
            };
            let p = PhasePlan {
                name,
                start_s: start,
                end_s: end,
                error_rate,
                conditions,
                latency: uniform(latency),
            };
            start = end;
            p
        })
        .collect()
}

fn script(plan: &[PhasePlan], seed: u64) -> Script {
    let last = plan.len() - 1;
    Script {
        phases: plan
            .iter()
            .enumerate()
            .map(|(i, p)| Phase {
                name: p.name.to_string(),
                // The last phase lasts until the servers stop.
                duration: (i < last).then(|| Duration::from_secs_f64(p.end_s - p.start_s)),
                error_rate: p.error_rate,
                status: 503,
                latency: p.latency,
                workers: Some(WORKERS),
                ..Phase::default()
            })
            .collect(),
        repeat: false,
        seed: Some(seed),
        // The dependency does not know its client gave up: a timed-out request keeps it busy.
        on_disconnect: Some(OnDisconnect::Finish),
    }
}

fn proxy_config(upstream: &str, admin: SocketAddr) -> Result<ProxyConfig, Failure> {
    let bad = |e: String| Failure::runtime(format!("demo proxy config: {e}"));
    let mut d =
        DependencyConfig::new(DEPENDENCY, upstream.parse().map_err(|e| bad(format!("{e}")))?);
    d.cap = CAP;
    d.planned_primary = Some(PLANNED_PRIMARY);
    d.budget = BUDGET.parse().map_err(|e| bad(format!("{e}")))?;
    // Like the naive path, a timed-out attempt is a failure worth one retry: the default
    // `retry_on` already says so.
    d.max_retries = 1;
    d.per_try_timeout = Some(PER_TRY_TIMEOUT);
    // Retries go out (almost) at once, as in the worked example and on the naive path.
    d.backoff = BackoffConfig::parse_range("1ms..5ms").map_err(bad)?;
    d.queue = 100;
    d.queue_timeout = Duration::from_millis(200);
    let mut config = ProxyConfig::single(SocketAddr::from(([127, 0, 0, 1], 0)), d);
    config.admin = Some(admin);
    Ok(config)
}

fn load_config(target: SocketAddr, duration: Duration) -> Result<LoadConfig, Failure> {
    let mut c = LoadConfig::new(&format!("http://{target}/"))
        .map_err(|e| Failure::runtime(format!("demo load: {e}")))?;
    c.mode = Mode::Open {
        rate: Rate { count: RATE_PER_S, per: Duration::from_secs(1) },
        max_outstanding: 5_000,
    };
    c.duration = Some(duration);
    c.timeout = Duration::from_secs(5);
    c.validate().map_err(|e| Failure::runtime(format!("demo load: {e}")))?;
    Ok(c)
}

/// Cumulative counts of one path at the end of a bucket.
#[derive(Debug, Clone, Default)]
struct PathMark {
    in_flight_sum: u64,
    in_flight_samples: u64,
    in_flight_max: u64,
    requests: u64,
    retries: u64,
    done: u64,
    succeeded: u64,
}

#[derive(Debug, Clone, Default)]
struct Mark {
    t_s: f64,
    naive: PathMark,
    guarded: PathMark,
    denied: [u64; Denied::ALL.len()],
}

/// Per-bucket time series of one path (the report's charts).
#[derive(Debug, Clone, Default, Serialize)]
pub struct PathSeries {
    /// Mean attempts in flight at the upstream over the bucket (sampled every 5 ms).
    pub in_flight_mean: Vec<f64>,
    /// The most seen in flight by those samples.
    pub in_flight_max: Vec<u64>,
    /// Attempts per second at the upstream.
    pub attempts_per_s: Vec<f64>,
    /// Retries per first try at the upstream.
    pub retry_fraction: Vec<f64>,
    /// Complete 2xx / requests that ended in the bucket (`None`: none ended).
    pub success_rate: Vec<Option<f64>>,
}

/// What the report's charts draw.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Series {
    /// Each bucket's end, in seconds.
    pub t_s: Vec<f64>,
    /// The naive path.
    pub naive: PathSeries,
    /// The stormguard path.
    pub stormguard: PathSeries,
    /// The proxy's refusals per second, by reason (only reasons that occurred).
    pub denied_per_s: BTreeMap<&'static str, Vec<f64>>,
}

/// In flight at one upstream.
#[derive(Debug, Clone, Default, Serialize)]
pub struct InFlight {
    /// Time-weighted mean (sampled every 5 ms).
    pub mean: f64,
    /// 99th percentile of what each arriving attempt saw (chaos's histogram).
    pub p99: u64,
    /// The exact maximum (chaos's counter).
    pub max: u64,
}

/// One path over the whole run.
#[derive(Debug, Clone, Default, Serialize)]
pub struct PathSummary {
    /// Requests the callers sent.
    pub sent: u64,
    /// Attempts that reached the upstream.
    pub upstream_requests: u64,
    /// Of those, retries.
    pub upstream_retries: u64,
    /// `upstream_requests / sent`.
    pub amplification: f64,
    /// In flight at the upstream.
    pub in_flight: InFlight,
    /// Complete 2xx / scheduled.
    pub success_rate: f64,
    /// Callers' latency, p50 and p99, in milliseconds.
    pub latency_p50_ms: f64,
    /// See `latency_p50_ms`.
    pub latency_p99_ms: f64,
    /// Retries refused, by reason (stormguard only).
    pub retries_denied: BTreeMap<&'static str, u64>,
    /// First tries refused before the upstream, by reason (stormguard only).
    pub primaries_shed: BTreeMap<&'static str, u64>,
}

/// One path over one phase.
#[derive(Debug, Clone, Default, Serialize)]
pub struct PhasePath {
    /// Time-weighted mean in flight at the upstream.
    pub in_flight_mean: f64,
    /// Chaos's p99 for the phase.
    pub in_flight_p99: u64,
    /// Chaos's exact maximum for the phase.
    pub in_flight_max: u64,
    /// Attempts at the upstream per arrival.
    pub amplification: f64,
    /// Complete 2xx per request that ended in the phase.
    pub success_rate: Option<f64>,
}

/// One phase, both paths.
#[derive(Debug, Clone, Serialize)]
pub struct PhaseSummary {
    /// The phase.
    #[serde(flatten)]
    pub plan: PhasePlan,
    /// The naive path in it.
    pub naive: PhasePath,
    /// The stormguard path in it.
    pub stormguard: PhasePath,
}

/// The whole run, as `--json` prints it.
#[derive(Debug, Clone, Serialize)]
pub struct Summary {
    /// The run's length.
    pub duration_s: f64,
    /// Arrivals per second on each path.
    pub rate_per_s: f64,
    /// The proxy's cap.
    pub cap: u64,
    /// Primaries planned in flight.
    pub planned_primary: u64,
    /// The proxy's budget.
    pub budget: &'static str,
    /// The budget as a fraction of first tries.
    pub budget_percent: f64,
    /// Both paths' per-try timeout.
    pub per_try_timeout_ms: u64,
    /// Where the dashboard was.
    pub dashboard: String,
    /// Where the report was written.
    pub report: Option<String>,
    /// The naive retry-once path.
    pub naive: PathSummary,
    /// The stormguard path.
    pub stormguard: PathSummary,
    /// By phase.
    pub phases: Vec<PhaseSummary>,
    /// The charts' data.
    pub series: Series,
}

/// Runs `stormguard demo`.
pub fn run(args: &DemoArgs, out: &mut dyn Write) -> Result<(), Failure> {
    let duration =
        parse_duration(&args.duration).map_err(|e| Failure::usage(format!("--duration: {e}")))?;
    if duration < Duration::from_secs(5) || duration > Duration::from_secs(600) {
        return Err(Failure::usage(format!(
            "--duration: must be between 5s and 10m, got {}",
            args.duration
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

/// Progress on stderr: redrawn in place on a terminal, one line per phase otherwise.
struct Progress {
    tty: bool,
}

impl Progress {
    fn line(&self, text: &str) {
        if self.tty {
            eprint!("\r{:100}\r", "");
        }
        eprintln!("{text}");
    }

    fn status(&self, text: &str) {
        if self.tty {
            eprint!("\r{text:100}");
        }
    }
}

async fn demo(args: &DemoArgs, duration: Duration) -> Result<Summary, Failure> {
    let progress = Progress { tty: std::io::stderr().is_terminal() };
    let plan = plan(duration);
    let any = SocketAddr::from(([127, 0, 0, 1], 0));
    let start = |name: &'static str| {
        let config = ChaosConfig::new(script(&plan, args.seed));
        async move {
            stormguard_chaos::spawn(config, any)
                .await
                .map_err(|e| Failure::runtime(format!("cannot start the {name} upstream: {e}")))
        }
    };
    // Both upstreams start together, so their phases switch together.
    let (guarded_up, naive_up) = tokio::try_join!(start("stormguard"), start("naive"))?;
    let proxy = stormguard_proxy::start(proxy_config(&guarded_up.url(""), args.admin)?)
        .await
        .map_err(|e| Failure::runtime(format!("cannot start the proxy: {e}")))?;
    let naive = naive::start(
        naive_up.url("").parse().map_err(|e| Failure::runtime(format!("{e}")))?,
        PER_TRY_TIMEOUT,
    )
    .await
    .map_err(|e| Failure::runtime(format!("cannot start the naive client: {e}")))?;
    let admin = proxy.admin_addr().ok_or_else(|| Failure::runtime("the proxy has no admin"))?;
    let dashboard = format!("http://{admin}/dashboard");
    progress.line(&format!(
        "stormguard demo: {RATE_PER_S} requests/s on each path for {:.0} s; cap {CAP}, budget {:.0} % of first tries",
        duration.as_secs_f64(),
        BUDGET_PERCENT * 100.0
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

struct Sources<'a> {
    naive: (&'a ChaosServer, &'a Live),
    guarded: (&'a ChaosServer, &'a Live),
    dep: &'a stormguard_tower::Dependency,
}

/// Samples both upstreams' in-flight count every 5 ms, and closes a bucket of cumulative counts
/// every `duration / 60` (100 ms to 1 s), until the run's end.
async fn sample(
    src: &Sources<'_>,
    plan: &[PhasePlan],
    duration: Duration,
    began: Instant,
    finished: &AtomicBool,
    progress: &Progress,
) -> Vec<Mark> {
    let bucket = (duration / 60).clamp(Duration::from_millis(100), Duration::from_secs(1));
    let mut marks = vec![Mark::default()];
    let mut current = Mark::default();
    let mut tick = tokio::time::interval(Duration::from_millis(5));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    let mut next_close = bucket;
    let mut phase_shown = usize::MAX;
    loop {
        tick.tick().await;
        let elapsed = began.elapsed();
        if elapsed > duration {
            break;
        }
        for (m, up) in [(&mut current.naive, src.naive.0), (&mut current.guarded, src.guarded.0)] {
            let n = up.in_flight();
            m.in_flight_sum += n;
            m.in_flight_samples += 1;
            m.in_flight_max = m.in_flight_max.max(n);
        }
        if elapsed >= next_close {
            next_close += bucket;
            current.t_s = elapsed.as_secs_f64();
            for (m, (up, live)) in
                [(&mut current.naive, src.naive), (&mut current.guarded, src.guarded)]
            {
                let s = up.stats();
                m.requests = s.total.requests;
                m.retries = s.total.retries;
                m.done = live.done.load(Ordering::Relaxed);
                m.succeeded = live.succeeded.load(Ordering::Relaxed);
            }
            current.denied = src.dep.policy().counters().snapshot().denied;
            let phase = plan.iter().rposition(|p| p.start_s <= current.t_s).unwrap_or(0);
            let mean = |m: &PathMark| m.in_flight_sum as f64 / m.in_flight_samples.max(1) as f64;
            let status = format!(
                "{:5.1} s  {:<14} upstream in flight: naive {:5.1}, stormguard {:5.1} (cap {CAP})",
                current.t_s,
                plan[phase].name,
                mean(&current.naive),
                mean(&current.guarded),
            );
            if phase != phase_shown {
                phase_shown = phase;
                progress.line(&format!(
                    "{:5.1} s  phase {}/{}: {} ({})",
                    current.t_s,
                    phase + 1,
                    plan.len(),
                    plan[phase].name,
                    plan[phase].conditions
                ));
            }
            progress.status(&status);
            marks.push(current.clone());
            // The sums and maxima are per bucket; the counts stay cumulative.
            for m in [&mut current.naive, &mut current.guarded] {
                m.in_flight_sum = 0;
                m.in_flight_samples = 0;
                m.in_flight_max = 0;
            }
        }
    }
    while !finished.load(Ordering::Relaxed) {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    progress.status("");
    marks
}

fn delta(a: u64, b: u64) -> f64 {
    b.saturating_sub(a) as f64
}

fn series(marks: &[Mark]) -> Series {
    let mut s = Series::default();
    let mut denied: BTreeMap<&'static str, Vec<f64>> = BTreeMap::new();
    for w in marks.windows(2) {
        let (a, b) = (&w[0], &w[1]);
        let dt = (b.t_s - a.t_s).max(1e-9);
        s.t_s.push(b.t_s);
        for (path, pa, pb) in
            [(&mut s.naive, &a.naive, &b.naive), (&mut s.stormguard, &a.guarded, &b.guarded)]
        {
            path.in_flight_mean.push(pb.in_flight_sum as f64 / pb.in_flight_samples.max(1) as f64);
            path.in_flight_max.push(pb.in_flight_max);
            path.attempts_per_s.push(delta(pa.requests, pb.requests) / dt);
            let retries = delta(pa.retries, pb.retries);
            let firsts = delta(pa.requests, pb.requests) - retries;
            path.retry_fraction.push(if firsts > 0.0 { retries / firsts } else { 0.0 });
            let done = delta(pa.done, pb.done);
            path.success_rate.push((done > 0.0).then(|| delta(pa.succeeded, pb.succeeded) / done));
        }
        for d in Denied::ALL {
            let n = delta(a.denied[d.index()], b.denied[d.index()]) / dt;
            denied.entry(d.as_str()).or_default().push(n);
        }
    }
    denied.retain(|_, v| v.iter().any(|x| *x > 0.0));
    s.denied_per_s = denied;
    s
}

fn path_summary(
    report: &LoadReport,
    stats: &Stats,
    marks: &[Mark],
    pick: impl Fn(&Mark) -> &PathMark,
) -> PathSummary {
    let (sum, samples) = marks
        .iter()
        .map(&pick)
        .fold((0, 0), |(s, n), m| (s + m.in_flight_sum, n + m.in_flight_samples));
    PathSummary {
        sent: report.sent,
        upstream_requests: stats.total.requests,
        upstream_retries: stats.total.retries,
        amplification: stats.total.requests as f64 / report.sent.max(1) as f64,
        in_flight: InFlight {
            mean: sum as f64 / samples.max(1) as f64,
            p99: stats.total.in_flight.p99,
            max: stats.total.in_flight.max,
        },
        success_rate: report.success_rate,
        latency_p50_ms: report.latency_ms.p50,
        latency_p99_ms: report.latency_ms.p99,
        retries_denied: BTreeMap::new(),
        primaries_shed: BTreeMap::new(),
    }
}

fn phase_path(
    plan: &PhasePlan,
    stats: Option<&stormguard_chaos::PhaseStats>,
    marks: &[Mark],
    pick: impl Fn(&Mark) -> &PathMark,
) -> PhasePath {
    // The buckets that end inside the phase.
    let inside = |t: f64| t > plan.start_s + 1e-6 && t <= plan.end_s + 1e-6;
    let (mut sum, mut samples, mut done, mut ok) = (0, 0, 0.0, 0.0);
    for w in marks.windows(2) {
        if !inside(w[1].t_s) {
            continue;
        }
        let (a, b) = (pick(&w[0]), pick(&w[1]));
        sum += b.in_flight_sum;
        samples += b.in_flight_samples;
        done += delta(a.done, b.done);
        ok += delta(a.succeeded, b.succeeded);
    }
    // Open-loop arrivals keep a fixed timetable: arrival i at i / rate.
    let arrivals = (plan.end_s * RATE_PER_S).floor() - (plan.start_s * RATE_PER_S).floor();
    let requests = stats.map_or(0, |s| s.counts.requests) as f64;
    PhasePath {
        in_flight_mean: sum as f64 / samples.max(1) as f64,
        in_flight_p99: stats.map_or(0, |s| s.counts.in_flight.p99),
        in_flight_max: stats.map_or(0, |s| s.counts.in_flight.max),
        amplification: if arrivals > 0.0 { requests / arrivals } else { 0.0 },
        success_rate: (done > 0.0).then(|| ok / done),
    }
}

fn by_reason(m: &BTreeMap<&'static str, u64>) -> String {
    if m.is_empty() {
        return "0".to_string();
    }
    m.iter().map(|(k, v)| format!("{k} {v}")).collect::<Vec<_>>().join(", ")
}

/// Seconds with a decimal only when they need one.
fn secs(x: f64) -> String {
    if (x - x.round()).abs() < 0.05 { format!("{x:.0}") } else { format!("{x:.1}") }
}

fn pct(x: f64) -> String {
    format!("{:.1} %", x * 100.0)
}

/// The side-by-side table.
pub fn table(s: &Summary) -> String {
    let mut t = String::new();
    let _ = writeln!(
        t,
        "stormguard demo: {} requests/s for {:.0} s on each path; cap {} ({} planned in flight), budget {} % of first tries",
        s.rate_per_s,
        s.duration_s,
        s.cap,
        s.planned_primary,
        s.budget_percent * 100.0
    );
    for p in &s.phases {
        let span = format!("{}–{} s", secs(p.plan.start_s), secs(p.plan.end_s));
        let _ = writeln!(t, "  {span:>12}  {:<14} {}", p.plan.name, p.plan.conditions);
    }
    let _ = writeln!(t);
    let (n, g) = (&s.naive, &s.stormguard);
    let rows: Vec<(&str, String, String, String)> = vec![
        (
            "upstream in flight, mean",
            format!("{:.1}", n.in_flight.mean),
            format!("{:.1}", g.in_flight.mean),
            format!("cap {}", s.cap),
        ),
        (
            "upstream in flight, p99",
            n.in_flight.p99.to_string(),
            g.in_flight.p99.to_string(),
            format!("cap {}", s.cap),
        ),
        (
            "upstream in flight, max",
            n.in_flight.max.to_string(),
            g.in_flight.max.to_string(),
            format!("cap {}", s.cap),
        ),
        (
            "load amplification",
            format!("{:.3}", n.amplification),
            format!("{:.3}", g.amplification),
            format!("budget {:.2}", 1.0 + s.budget_percent),
        ),
        ("requests sent", n.sent.to_string(), g.sent.to_string(), String::new()),
        (
            "attempts at the upstream",
            n.upstream_requests.to_string(),
            g.upstream_requests.to_string(),
            String::new(),
        ),
        (
            "  of which retries",
            n.upstream_retries.to_string(),
            g.upstream_retries.to_string(),
            String::new(),
        ),
        ("success rate", pct(n.success_rate), pct(g.success_rate), String::new()),
        (
            "latency p50 / p99 ms",
            format!("{:.0} / {:.0}", n.latency_p50_ms, n.latency_p99_ms),
            format!("{:.0} / {:.0}", g.latency_p50_ms, g.latency_p99_ms),
            String::new(),
        ),
        ("retries denied", "–".to_string(), by_reason(&g.retries_denied), String::new()),
        ("first tries shed", "–".to_string(), by_reason(&g.primaries_shed), String::new()),
    ];
    let _ = writeln!(t, "{:<26} {:>18} {:>26}", "", "naive retry-once", "stormguard");
    for (label, a, b, note) in rows {
        let _ = writeln!(t, "{label:<26} {a:>18} {b:>26}   {note}");
    }
    let _ = writeln!(t);
    let _ = writeln!(t, "by phase: upstream in flight mean / max, amplification, success");
    let _ = writeln!(t, "{:<15} {:>34} {:>34}", "", "naive retry-once", "stormguard");
    let cell = |p: &PhasePath| {
        format!(
            "{:5.1} / {:<4} {:5.2}  {:>8}",
            p.in_flight_mean,
            p.in_flight_max,
            p.amplification,
            p.success_rate.map_or("–".to_string(), pct)
        )
    };
    for p in &s.phases {
        let _ =
            writeln!(t, "{:<15} {:>34} {:>34}", p.plan.name, cell(&p.naive), cell(&p.stormguard));
    }
    let _ = writeln!(
        t,
        "\nEach upstream works on {WORKERS} requests at full speed and slows down for every caller past\n\
         that, as a real dependency does. The naive path's retries push it there; the slowdown\n\
         turns into more timeouts and more retries, and the storm outlives its cause. The cap and\n\
         the budget keep what the dependency sees to what was planned, and shed the rest at once."
    );
    if let Some(r) = &s.report {
        let _ = writeln!(t, "\nreport: {r}");
    }
    t
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_phases_cover_the_run_in_order() {
        let p = plan(Duration::from_secs(60));
        assert_eq!(p.len(), 5);
        assert_eq!(p[0].start_s, 0.0);
        assert!((p[4].end_s - 60.0).abs() < 1e-9);
        for w in p.windows(2) {
            assert_eq!(w[0].end_s, w[1].start_s);
        }
        let errors: Vec<f64> = p.iter().map(|p| p.error_rate).collect();
        assert_eq!(errors, [0.05, 0.2, 0.4, 0.0, 0.0]);
        let s = script(&p, 7);
        assert!(s.validate().is_ok());
        assert_eq!(s.phases[4].duration, None, "recovery lasts until the end");
        assert_eq!(s.phases[2].duration, Some(Duration::from_secs(15)));
    }

    #[test]
    fn the_proxy_config_is_the_worked_example() {
        let c = proxy_config("http://127.0.0.1:9", SocketAddr::from(([127, 0, 0, 1], 0))).unwrap();
        assert!(c.validate().is_ok());
        let d = &c.dependencies[0];
        assert_eq!((d.cap, d.planned_primary, d.max_retries), (20, Some(16), 1));
        // (cap − planned) / planned
        assert_eq!(BUDGET_PERCENT, (CAP - PLANNED_PRIMARY) as f64 / PLANNED_PRIMARY as f64);
    }

    #[test]
    fn seconds_print_without_a_needless_decimal() {
        assert_eq!(secs(9.0), "9");
        assert_eq!(secs(1.5), "1.5");
    }
}
