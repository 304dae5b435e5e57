//! `stormguard load`: drive a target, then check at the upstream that the cap and the budget
//! held.
//!
//! Closed loop (`--concurrency N`) or open loop (`--rate R/s`, arrivals that do not wait for
//! responses), for `--duration` or `--requests`. Prints an outcome and latency summary (`--json`
//! for one JSON object); each `--assert-*` flag that is violated makes the exit code 1, and so
//! does a run in which no request was answered.

use std::fmt::Write as _;
use std::io::{IsTerminal, Write};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use bytes::Bytes;
use clap::Args;
use http::{HeaderName, HeaderValue, Method, Uri};
use stormguard_chaos::Rate;
use stormguard_chaos::load::{self, Live, LoadConfig, LoadError, LoadReport, Mode};
use stormguard_core::format;

use crate::Failure;
use crate::args;

/// Flags of `stormguard load`.
#[derive(Debug, Args)]
#[command(after_help = "\
Prove a budget (chaos upstream on :9000, the stack under test on :8080 in front of it; open
loop at about 16 first tries in flight, so retries without a cap push the upstream past 20):
  stormguard chaos --listen 127.0.0.1:9000 --error-rate 0.3 --latency 50ms --latency-p99 400ms
  stormguard proxy --listen 127.0.0.1:8080 --upstream http://127.0.0.1:9000 --cap 20 \\
      --budget ratio:percent=0.25,min_per_sec=0 --admin off
  stormguard load --target http://127.0.0.1:8080/ --rate 200/s --duration 30s \\
      --stats http://127.0.0.1:9000/stats \\
      --assert-max-in-flight 20 --assert-retry-fraction 0.25

The retry fraction is the retries the upstream saw over the first attempts it saw. A retry is
an attempt marked as one (x-stormguard-attempt or x-envoy-attempt-count above 1,
grpc-previous-rpc-attempts above 0): Envoy marks its retries only with
include_request_attempt_count. A stack whose unmarked attempts outnumber the originals sent
fails the assertion. The upstream's stats are reset when the run starts. A run in which no
request was answered (the target down, every request reset or timed out) fails whatever was
asserted. Exit codes: 0 every assertion held, 1 one was violated or nothing was answered,
2 bad flags or an unreachable --stats. Targets must be on this machine (127.0.0.0/8, ::1,
localhost).")]
pub struct LoadArgs {
    /// The URL to send requests to (http:// on a loopback address).
    #[arg(long, value_name = "URL")]
    pub target: String,
    /// Closed loop: this many workers, each sending its next request when the last is done
    /// (default 10).
    #[arg(long, value_name = "N", conflicts_with = "rate")]
    pub concurrency: Option<usize>,
    /// Open loop: arrivals at this rate (e.g. 200/s, 5/10ms), whether or not responses come.
    #[arg(long, value_name = "RATE", value_parser = args::rate)]
    pub rate: Option<Rate>,
    /// Send for this long (e.g. 30s; at most 1h). Default 10s when --requests is not given.
    #[arg(long, value_name = "DURATION", value_parser = args::duration)]
    pub duration: Option<Duration>,
    /// Send this many requests (with --duration: whichever ends first).
    #[arg(long, value_name = "N")]
    pub requests: Option<u64>,
    /// Per-request timeout, from connecting to the last body byte.
    #[arg(long, value_name = "DURATION", default_value = "10s", value_parser = args::duration)]
    pub timeout: Duration,
    /// Open loop: at most this many requests outstanding; arrivals beyond it are counted as
    /// dropped.
    #[arg(long, value_name = "N", default_value_t = 1000, requires = "rate")]
    pub max_outstanding: usize,
    /// The request method.
    #[arg(long, value_name = "METHOD", default_value = "GET", value_parser = args::method)]
    pub method: Method,
    /// A request header, "Name: value"; repeat for several.
    #[arg(long = "header", short = 'H', value_name = "HEADER", value_parser = args::header)]
    pub headers: Vec<(HeaderName, HeaderValue)>,
    /// The request body.
    #[arg(long, value_name = "TEXT")]
    pub body: Option<String>,
    /// The upstream's stats URL (stormguard chaos serves /stats). Default: /stats at the
    /// target's origin, read only when an --assert-max-in-flight or --assert-retry-fraction
    /// needs it. It is reset (POST URL/reset) when the run starts.
    #[arg(long, value_name = "URL", value_parser = args::uri)]
    pub stats: Option<Uri>,
    /// Print one JSON object on stdout instead of the summary.
    #[arg(long)]
    pub json: bool,
    /// Fail (exit 1) if the upstream ever had more than N requests in flight.
    #[arg(long, value_name = "N")]
    pub assert_max_in_flight: Option<u64>,
    /// Fail (exit 1) if the retries the upstream saw (attempts marked as retries) over the first
    /// attempts it saw exceed F (0.25 = 25 % of first tries).
    #[arg(long, value_name = "F")]
    pub assert_retry_fraction: Option<f64>,
    /// Fail (exit 1) if fewer than S (0 to 1) of the requests got a complete 2xx.
    #[arg(long, value_name = "S")]
    pub assert_success_rate: Option<f64>,
}

fn usage(e: LoadError) -> Failure {
    Failure::usage(e.to_string())
}

/// The run's config from the flags.
pub fn config_from_args(args: &LoadArgs) -> Result<LoadConfig, Failure> {
    let mut c = LoadConfig::new(&args.target).map_err(usage)?;
    c.mode = match args.rate {
        Some(rate) => Mode::Open { rate, max_outstanding: args.max_outstanding },
        None => Mode::Closed { concurrency: args.concurrency.unwrap_or(10) },
    };
    c.duration = args.duration;
    c.requests = args.requests;
    c.timeout = args.timeout;
    c.method = args.method.clone();
    for (name, value) in &args.headers {
        c.headers.append(name.clone(), value.clone());
    }
    if let Some(b) = &args.body {
        c.body = Bytes::from(b.clone());
    }
    if let Some(s) = &args.stats {
        c.stats = Some(s.clone());
    }
    c.assertions.max_in_flight = args.assert_max_in_flight;
    c.assertions.retry_fraction = args.assert_retry_fraction;
    c.assertions.success_rate = args.assert_success_rate;
    c.validate().map_err(usage)?;
    Ok(c)
}

/// Runs `stormguard load`.
pub fn run(args: &LoadArgs, out: &mut dyn Write) -> Result<(), Failure> {
    let config = config_from_args(args)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| Failure::runtime(format!("cannot start the runtime: {e}")))?;
    let show_progress = std::io::stderr().is_terminal();
    let report = runtime.block_on(async {
        let live = Live::default();
        let progress = async {
            if !show_progress {
                return std::future::pending().await;
            }
            let began = Instant::now();
            loop {
                tokio::time::sleep(Duration::from_millis(200)).await;
                eprint!("\r{}", progress_line(&live, began.elapsed()));
            }
        };
        let result = tokio::select! {
            r = load::run(&config, &live) => r,
            () = progress => unreachable!("progress loops forever"),
        };
        if show_progress {
            eprint!("\r{:79}\r", "");
        }
        result
    });
    // Connections still closing must not hold the exit.
    runtime.shutdown_background();
    let report = report.map_err(usage)?;
    if args.json {
        serde_json::to_writer(&mut *out, &report)
            .map_err(|e| Failure::runtime(format!("cannot write the report: {e}")))?;
        writeln!(out)?;
    } else {
        out.write_all(summary(&report).as_bytes())?;
    }
    let failed: Vec<&str> =
        report.assertions.iter().filter(|a| !a.ok).map(|a| a.message.as_str()).collect();
    if failed.is_empty() {
        Ok(())
    } else {
        Err(Failure::runtime(format!("assertion failed: {}", failed.join("; "))))
    }
}

fn progress_line(live: &Live, elapsed: Duration) -> String {
    let get = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
    let (done, ok) = (get(&live.done), get(&live.succeeded));
    let rate = if done == 0 { 0.0 } else { ok as f64 / done as f64 };
    format!(
        "{:6.1}s  scheduled {}  done {}  ok {}  outstanding {}   ",
        elapsed.as_secs_f64(),
        get(&live.scheduled),
        done,
        format::percent(rate, 1),
        get(&live.outstanding)
    )
}

/// The human summary.
pub fn summary(r: &LoadReport) -> String {
    let mut s = String::new();
    let how = match (r.concurrency, r.rate_per_s) {
        (Some(c), _) => format!("closed loop, {c} workers"),
        (_, Some(rate)) => format!("open loop, {rate}/s; latency from each scheduled send time"),
        _ => r.mode.to_string(),
    };
    let _ = writeln!(s, "target      {} ({how})", r.target);
    let o = &r.outcomes;
    let _ = writeln!(
        s,
        "sent        {} of {} scheduled ({} dropped at the outstanding cap, {} connect errors)",
        r.sent, r.scheduled, o.dropped, o.connect_error
    );
    let statuses: Vec<String> =
        o.status_counts.iter().map(|(code, n)| format!("{n} x {code}")).collect();
    let statuses =
        if statuses.is_empty() { "no response".to_string() } else { statuses.join(", ") };
    let _ = writeln!(
        s,
        "outcomes    {statuses}; {} body errors, {} resets, {} timeouts",
        o.body_error, o.reset, o.timeout
    );
    let _ = writeln!(
        s,
        "success     {} ({} of {})",
        format::percent(r.success_rate, 2),
        o.success,
        r.scheduled
    );
    let _ = writeln!(s, "throughput  {:.1}/s over {:.2} s", r.throughput_per_s, r.elapsed_s);
    let l = &r.latency_ms;
    let _ = writeln!(
        s,
        "latency ms  p50 {:.2}  p90 {:.2}  p99 {:.2}  p99.9 {:.2}  max {:.2}  (mean {:.2}, {} recorded)",
        l.p50, l.p90, l.p99, l.p999, l.max, l.mean, l.count
    );
    if let Some(up) = &r.upstream {
        let n = |v: &serde_json::Value| v.as_u64().map_or("?".to_string(), |x| x.to_string());
        let _ = writeln!(
            s,
            "upstream    {} requests, {} marked as retries, max in flight {} (p50 {}, p99 {})",
            n(&up["requests"]),
            n(&up["retries"]),
            n(&up["in_flight"]["max"]),
            n(&up["in_flight"]["p50"]),
            n(&up["in_flight"]["p99"])
        );
    }
    if let (Some(f), Some(up)) = (r.retry_fraction, &r.upstream) {
        let (requests, retries) =
            (up["requests"].as_u64().unwrap_or(0), up["retries"].as_u64().unwrap_or(0));
        let _ = writeln!(
            s,
            "retry frac  {f:.4} = {retries} retries / {} first attempts at the upstream",
            requests.saturating_sub(retries)
        );
    }
    if !r.assertions.is_empty() {
        let _ = writeln!(s, "assertions");
        for a in &r.assertions {
            let _ = writeln!(s, "  {}  {}", if a.ok { "ok  " } else { "FAIL" }, a.message);
        }
    }
    s
}
