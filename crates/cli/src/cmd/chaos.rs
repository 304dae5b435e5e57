//! `stormguard chaos`: a fault-injecting upstream that counts what reaches it.
//!
//! One phase from flags, or phases over time from a TOML script. The server prints its address
//! on stderr (`listening on http://ADDR`, so `--listen 127.0.0.1:0` can be used from scripts),
//! serves `GET /stats`, `POST /stats/reset` and `POST /phase/next` on the same listener, moves to
//! the next phase on SIGUSR1, and on exit (Ctrl-C, SIGTERM or `--duration`) prints its final
//! stats as JSON on stdout. With `--provider` (or a script's `[provider]`) it plays a model
//! API; the provider flags override the script's keys one by one.

use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{ArgGroup, Args, ValueEnum};
use stormguard_chaos::{
    ChaosConfig, ChaosError, Latency, OnDisconnect, Phase, ProviderConfig, ProviderKind, Rate,
    RateLimit, Script, Window,
};
use stormguard_core::decimal::format_duration;

use crate::Failure;
use crate::args::{self, LatencyFlag};

/// Flags of `stormguard chaos`.
#[derive(Debug, Args)]
#[command(group(ArgGroup::new("one_phase").multiple(true)))]
#[command(after_help = "\
Examples:
  # 30 % of requests fail with 503, the rest take 50 ms at the median and 400 ms at p99:
  stormguard chaos --listen 127.0.0.1:9000 --error-rate 0.3 --latency 50ms --latency-p99 400ms

  # The slow dependency that trips no breaker: every request takes 2 s, nothing fails:
  stormguard chaos --latency 2s

  # A server with its own limits: 20 in flight, 100 requests per second:
  stormguard chaos --max-concurrency 20 --rate-limit 100/s

  # A model provider: OpenAI-shaped answers (streamed when the body asks \"stream\": true),
  # 600 requests and 40000 tokens a minute, 429s past them:
  stormguard chaos --provider openai --rpm 600 --tpm 40000

  # Anthropic with input and output tokens metered apart, 10 % of streams cut after their
  # first event, overloaded (529) from 20 s to 30 s, out of credit after 1000 requests:
  stormguard chaos --provider anthropic --rpm 50 --itpm 30000 --otpm 8000 \\
      --stream-break-rate 0.1 --overloaded 20s..30s --quota-exhausted-after 1000

  # Phases over time (healthy, storm, slow, recovery) from a script; --check reads and checks
  # it (exit 2 naming file, line, column and key) and prints the phases without serving:
  stormguard chaos --script deploy/examples/phases.toml
  stormguard chaos --script deploy/examples/phases.toml --check

While it runs:
  curl -s localhost:9000/stats              what it saw: requests, retries, in_flight, status_counts
                                            (as a provider, also its answers by kind: provider.*)
  curl -s -X POST localhost:9000/stats/reset   start a new count
  curl -s -X POST localhost:9000/phase/next    move to the next phase (or: kill -USR1 PID)

Requests marked as retries (x-stormguard-attempt or x-envoy-attempt-count above 1) are counted
as retries. Every draw comes from --seed, so a run can be repeated exactly. The script format
and every key are in docs/chaos-and-load.md.")]
pub struct ChaosArgs {
    /// Address to listen on. Port 0 picks a free port; the address is printed on stderr.
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:9000")]
    pub listen: SocketAddr,
    /// Phases over time, from a TOML file. Cannot be combined with the one-phase flags below.
    #[arg(long, value_name = "FILE", conflicts_with = "one_phase")]
    pub script: Option<PathBuf>,
    /// Serve a simulator scenario's dependency over its timeline (its capacity as servers, its
    /// error rate as 503s, its service time as the latency), for `stormguard simulate` of the
    /// same file to be checked against. Cannot be combined with --script or the one-phase flags.
    #[arg(long, value_name = "FILE", conflicts_with_all = ["one_phase", "script"])]
    pub scenario: Option<PathBuf>,
    /// Fraction of requests answered with --status, 0 to 1.
    #[arg(long, value_name = "FRACTION", group = "one_phase")]
    pub error_rate: Option<f64>,
    /// The injected error status, 400 to 599.
    #[arg(long, value_name = "CODE", group = "one_phase")]
    pub status: Option<u16>,
    /// How long each request takes: fixed ("50ms"), the median when --latency-p99 is given, or
    /// a uniform range ("10ms..30ms").
    #[arg(long, value_name = "DURATION", group = "one_phase", value_parser = args::latency)]
    pub latency: Option<LatencyFlag>,
    /// The 99th percentile latency; with --latency as the median, fits a log-normal (or, with
    /// --latency-dist pareto, a Pareto tail).
    #[arg(
        long,
        value_name = "DURATION",
        requires = "latency",
        group = "one_phase",
        value_parser = args::duration
    )]
    pub latency_p99: Option<Duration>,
    /// The shape fitted to --latency and --latency-p99.
    #[arg(long, value_enum, value_name = "DIST", requires = "latency_p99", group = "one_phase")]
    pub latency_dist: Option<Dist>,
    /// No request waits longer than this.
    #[arg(long, value_name = "DURATION", group = "one_phase", value_parser = args::duration)]
    pub latency_max: Option<Duration>,
    /// Answer 429 (with X-Concurrency-Limit-Limit and -Remaining) above this many in flight.
    #[arg(long, value_name = "N", group = "one_phase")]
    pub max_concurrency: Option<u64>,
    /// Work on this many at full speed; above it, each request's latency is stretched by in
    /// flight / workers (overload slows every caller).
    #[arg(long, value_name = "N", group = "one_phase")]
    pub workers: Option<u64>,
    /// Work on this many at once; the rest wait for one, first come first served (a server's
    /// threads and its queue, as the simulator's `capacity`). Not with --workers.
    #[arg(long, value_name = "N", group = "one_phase", conflicts_with = "workers")]
    pub servers: Option<u64>,
    /// Answer 429 (with Retry-After) above this rate, e.g. 100/s, 5/100ms.
    #[arg(long, value_name = "RATE", group = "one_phase", value_parser = args::rate)]
    pub rate_limit: Option<Rate>,
    /// The rate limit's burst, in requests. Default: the rate's count (100 for 100/s).
    #[arg(long, value_name = "N", requires = "rate_limit", group = "one_phase")]
    pub rate_burst: Option<u64>,
    /// Fraction of requests reset instead of answered (HTTP/1.1: TCP reset; h2: stream reset).
    #[arg(long, value_name = "FRACTION", group = "one_phase")]
    pub reset_rate: Option<f64>,
    /// Fraction of 200 responses whose body stops halfway.
    #[arg(long, value_name = "FRACTION", group = "one_phase")]
    pub truncate_rate: Option<f64>,
    /// Size of the 200 body in bytes.
    #[arg(long, value_name = "N", group = "one_phase")]
    pub body_bytes: Option<usize>,
    /// Spread the 200 body over this long (in up to 10 chunks).
    #[arg(long, value_name = "DURATION", group = "one_phase", value_parser = args::duration)]
    pub slow_body: Option<Duration>,
    /// Fraction of requests answered at once as overloaded: Anthropic's 529 overloaded_error
    /// (OpenAI's 503 "engine is currently overloaded" with --provider openai), before any
    /// limit is met.
    #[arg(long, value_name = "FRACTION", group = "one_phase")]
    pub overloaded_rate: Option<f64>,
    /// An overload burst, FROM..TO since the start (e.g. 2s..4s): every request in it is
    /// answered overloaded. Repeat for several bursts; each is a phase in /stats.
    #[arg(
        long,
        value_name = "FROM..TO",
        group = "one_phase",
        value_parser = args::window
    )]
    pub overloaded: Vec<Window>,
    /// What to do with a request whose client left: keep working and count it in flight
    /// (finish, what real servers do; the default) or stop (cancel).
    #[arg(long, value_enum, value_name = "MODE")]
    pub on_disconnect: Option<Disconnect>,
    /// Serve as a service in the middle of a call tree: a request that draws a plain answer
    /// first calls this URL's host with its own method and path (carrying `traceparent` and
    /// `baggage` on, with an `x-request-id` of its own), then answers 200 for a success below
    /// and 502 for a failure below, relaying none of the answer's headers.
    #[arg(long, value_name = "URL", value_parser = forward_url)]
    pub forward: Option<Box<http::Uri>>,
    /// Serve as a model provider: `openai` or `anthropic` shaped answers (JSON with `usage`,
    /// or server-sent events when the body asks "stream": true), the provider's rate-limit
    /// headers on every answer, and 429s past --rpm / --tpm with its error body and
    /// `retry-after`. Tokens are counted from each request's body. Overrides a script's
    /// [provider] kind.
    #[arg(long, value_name = "KIND", value_parser = args::provider)]
    pub provider: Option<ProviderKind>,
    /// The provider's requests per minute (a bucket of N, refilled continuously).
    #[arg(long, value_name = "N")]
    pub rpm: Option<u64>,
    /// The provider's tokens per minute, input and output together.
    #[arg(long, value_name = "N")]
    pub tpm: Option<u64>,
    /// Input tokens per minute, metered apart (anthropic-ratelimit-input-tokens-*; anthropic
    /// only).
    #[arg(long, value_name = "N")]
    pub itpm: Option<u64>,
    /// Output tokens per minute, metered apart from each request's max_tokens
    /// (anthropic-ratelimit-output-tokens-*; anthropic only).
    #[arg(long, value_name = "N")]
    pub otpm: Option<u64>,
    /// The pause between a streamed answer's events [default: 5ms].
    #[arg(long, value_name = "DURATION", value_parser = args::duration)]
    pub stream_event_delay: Option<Duration>,
    /// Fraction of streamed answers cut after their first event (the connection or h2 stream
    /// is reset mid-body).
    #[arg(long, value_name = "FRACTION")]
    pub stream_break_rate: Option<f64>,
    /// Let N requests through, then refuse every later one for want of credit: OpenAI's 429
    /// insufficient_quota (no retry-after), Anthropic's 400 "credit balance is too low".
    #[arg(long, value_name = "N")]
    pub quota_exhausted_after: Option<u64>,
    /// Seed for every random draw (default: the script's, or 0).
    #[arg(long, value_name = "N")]
    pub seed: Option<u64>,
    /// Stop after this long (default: run until Ctrl-C or SIGTERM).
    #[arg(long, value_name = "DURATION", value_parser = args::duration)]
    pub duration: Option<Duration>,
    /// Check the script (or the flags) and print its phases, without serving: exit 0 when
    /// it is valid, 2 naming the file, line, column and key when not.
    #[arg(long)]
    pub check: bool,
    /// The log's format.
    #[command(flatten)]
    pub log: crate::log::LogArgs,
}

/// A latency shape fitted to a p50 and a p99.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Dist {
    /// The usual service latency: a body and a moderate tail.
    Lognormal,
    /// A heavy tail.
    Pareto,
}

/// `--on-disconnect`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Disconnect {
    /// Keep working; the request stays in flight until its latency has passed.
    Finish,
    /// Stop when the client leaves.
    Cancel,
}

/// The flag that sets a phase key, for error messages.
fn flag_of(key: &str) -> &'static str {
    match key {
        "error_rate" => "--error-rate",
        "status" => "--status",
        "reset_rate" => "--reset-rate",
        "truncate_rate" => "--truncate-rate",
        "overloaded_rate" => "--overloaded-rate",
        "latency" => "--latency",
        "max_concurrency" => "--max-concurrency",
        "workers" => "--workers",
        "servers" => "--servers",
        "rate_limit" => "--rate-limit",
        "rate_burst" => "--rate-burst",
        "body_bytes" => "--body-bytes",
        _ => "a flag",
    }
}

/// The one phase the flags describe.
fn phase_from_flags(args: &ChaosArgs) -> Result<Phase, Failure> {
    let mut p = Phase { name: "flags".to_string(), ..Phase::default() };
    if let Some(e) = args.error_rate {
        p.error_rate = e;
    }
    if let Some(s) = args.status {
        p.status = s;
    }
    if let Some(r) = args.reset_rate {
        p.reset_rate = r;
    }
    if let Some(r) = args.truncate_rate {
        p.truncate_rate = r;
    }
    if let Some(r) = args.overloaded_rate {
        p.overloaded_rate = r;
    }
    if let Some(latency) = args.latency {
        p.latency = match (latency, args.latency_p99) {
            (LatencyFlag::Range { .. }, Some(_)) => {
                return Err(Failure::usage(
                    "--latency-p99 needs --latency as a median, not a range",
                ));
            }
            (LatencyFlag::Range { min, max }, None) => Latency::Uniform { min, max },
            (LatencyFlag::Fixed(d), None) => Latency::Fixed(d),
            (LatencyFlag::Fixed(p50), Some(p99)) => {
                match args.latency_dist.unwrap_or(Dist::Lognormal) {
                    Dist::Lognormal => Latency::LogNormal { p50, p99 },
                    Dist::Pareto => Latency::pareto_from_quantiles(p50, p99)
                        .map_err(|e| Failure::usage(format!("--latency-p99: {e}")))?,
                }
            }
        };
    }
    if let Some(m) = args.latency_max {
        p.latency_max = m;
    }
    p.max_concurrency = args.max_concurrency;
    p.workers = args.workers;
    p.servers = args.servers;
    if let Some(rate) = args.rate_limit {
        let mut limit = RateLimit::new(rate);
        if let Some(b) = args.rate_burst {
            limit.burst = b;
        }
        p.rate_limit = Some(limit);
    }
    if let Some(b) = args.body_bytes {
        p.body_bytes = b;
    }
    if let Some(s) = args.slow_body {
        p.slow_body = Some(s);
    }
    p.validate().map_err(|e| Failure::usage(format!("{}: {e}", flag_of(e.key()))))?;
    Ok(p)
}

/// The server's config from the flags (or the script they name).
pub fn config_from_args(args: &ChaosArgs) -> Result<ChaosConfig, Failure> {
    let script = match (&args.script, &args.scenario) {
        (Some(path), _) => Script::load(path).map_err(|e| Failure::usage(e.to_string()))?,
        (None, Some(path)) => {
            let s = stormguard_sim::Scenario::from_file(path)
                .map_err(|e| Failure::usage(e.to_string()))?;
            super::chaos_scenario::script(&s)
                .map_err(|e| Failure::usage(format!("{}: {e}", path.display())))?
        }
        (None, None) if args.overloaded.is_empty() => Script::single(phase_from_flags(args)?),
        (None, None) => Script::overloaded_during(phase_from_flags(args)?, &args.overloaded)
            .map_err(|e| Failure::usage(format!("--overloaded: {e}")))?,
    };
    let mut config = ChaosConfig::new(script);
    if let Some(seed) = args.seed {
        config.seed = seed;
    }
    match args.on_disconnect {
        Some(Disconnect::Finish) => config.on_disconnect = OnDisconnect::Finish,
        Some(Disconnect::Cancel) => config.on_disconnect = OnDisconnect::Cancel,
        None => {}
    }
    config.forward = args.forward.as_deref().cloned();
    provider_from_args(args, &mut config)?;
    Ok(config)
}

/// `--forward`: an `http://host:port` URL (its path is the request's own).
fn forward_url(s: &str) -> Result<Box<http::Uri>, String> {
    let uri: http::Uri = s.parse().map_err(|e| format!("`{s}` is not a URL: {e}"))?;
    match (uri.scheme_str(), uri.authority()) {
        (Some("http"), Some(_)) => Ok(Box::new(uri)),
        _ => Err(format!("`{s}`: expected http://HOST:PORT")),
    }
}

/// The provider flags over the script's `[provider]`, key by key.
fn provider_from_args(args: &ChaosArgs, config: &mut ChaosConfig) -> Result<(), Failure> {
    let Some(kind) = args.provider.or(config.provider.map(|p| p.kind)) else {
        let given = [
            ("--rpm", args.rpm.is_some()),
            ("--tpm", args.tpm.is_some()),
            ("--itpm", args.itpm.is_some()),
            ("--otpm", args.otpm.is_some()),
            ("--stream-event-delay", args.stream_event_delay.is_some()),
            ("--stream-break-rate", args.stream_break_rate.is_some()),
            ("--quota-exhausted-after", args.quota_exhausted_after.is_some()),
        ];
        if let Some((flag, _)) = given.iter().find(|(_, set)| *set) {
            return Err(Failure::usage(format!(
                "{flag} needs --provider (or a script with a [provider] table)"
            )));
        }
        return Ok(());
    };
    let script = config.provider.unwrap_or(ProviderConfig { kind, rpm: None, tpm: None });
    let provider =
        ProviderConfig { kind, rpm: args.rpm.or(script.rpm), tpm: args.tpm.or(script.tpm) };
    let o = &mut config.provider_options;
    o.itpm = args.itpm.or(o.itpm);
    o.otpm = args.otpm.or(o.otpm);
    o.stream_event_delay = args.stream_event_delay.unwrap_or(o.stream_event_delay);
    o.stream_break_rate = args.stream_break_rate.unwrap_or(o.stream_break_rate);
    o.quota_exhausted_after = args.quota_exhausted_after.or(o.quota_exhausted_after);
    provider.validate(o).map_err(|e| {
        let flag = match e.key() {
            "stream_break_rate" => "--stream-break-rate".to_string(),
            key => format!("--{key}"),
        };
        Failure::usage(format!("{flag}: {e}"))
    })?;
    config.provider = Some(provider);
    Ok(())
}

/// Runs `stormguard chaos` until Ctrl-C, SIGTERM or `--duration` (or, with `--check`, only
/// checks and summarizes what it would serve).
pub fn run(args: &ChaosArgs, out: &mut dyn Write) -> Result<(), Failure> {
    let config = config_from_args(args)?;
    let stop_after = args.duration;
    if args.check {
        // What the server would refuse at start (an empty script) is refused here too.
        config.validate().map_err(|e| Failure::usage(e.to_string()))?;
        return summarize(args, &config, out);
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| Failure::runtime(format!("cannot start the runtime: {e}")))?;
    let stats = runtime.block_on(async {
        let server = stormguard_chaos::spawn(config, args.listen).await.map_err(|e| match e {
            ChaosError::Invalid(m) => Failure::usage(m),
            e @ ChaosError::Bind { .. } => Failure::runtime(e.to_string()),
        })?;
        // The signals are taken before the address is printed: a script that reads the line and
        // stops the server at once must find SIGTERM handled (stats printed, exit 0), not fatal.
        let signals = Signals::new();
        crate::log::status(
            args.log.log_format,
            &format!(
                "stormguard chaos: listening on http://{} (phase {}); GET /stats, POST \
                 /stats/reset, POST /phase/next",
                server.local_addr(),
                server.phase()
            ),
        );
        wait_for_stop(&server, signals, stop_after, args.log.log_format).await;
        let stats = server.stats();
        server.shutdown().await;
        Ok::<_, Failure>(stats)
    })?;
    // Work still sleeping under `finish` must not hold the exit.
    runtime.shutdown_background();
    serde_json::to_writer_pretty(&mut *out, &stats)
        .map_err(|e| Failure::runtime(format!("cannot write the stats: {e}")))?;
    writeln!(out)?;
    Ok(())
}

/// `--check`: one line for the script, one per phase.
fn summarize(args: &ChaosArgs, config: &ChaosConfig, out: &mut dyn Write) -> Result<(), Failure> {
    let source = match (&args.script, &args.scenario) {
        (Some(p), _) => p.display().to_string(),
        (None, Some(p)) => format!("the scenario {}", p.display()),
        (None, None) => "the flags".to_string(),
    };
    let s = &config.script;
    let n = s.phases.len();
    writeln!(
        out,
        "{source}: ok ({n} phase{}, seed {}, on_disconnect {}{})",
        if n == 1 { "" } else { "s" },
        config.seed,
        config.on_disconnect,
        if s.repeat { ", repeats" } else { "" },
    )?;
    for (i, p) in s.phases.iter().enumerate() {
        let lasts = p.duration.map_or("until advanced".to_string(), format_duration);
        let errors = if p.error_rate > 0.0 {
            format!("error_rate {} ({})", p.error_rate, p.status)
        } else {
            "no injected errors".to_string()
        };
        let overloaded = if p.overloaded_rate > 0.0 {
            format!(", overloaded_rate {}", p.overloaded_rate)
        } else {
            String::new()
        };
        let load = match (p.servers, p.workers) {
            (Some(n), _) => format!(", {n} servers"),
            (None, Some(n)) => format!(", {n} workers"),
            (None, None) => String::new(),
        };
        writeln!(out, "  phase[{i}] {}: {lasts}, {errors}{overloaded}{load}", p.name)?;
    }
    if let Some(p) = &config.provider {
        let o = &config.provider_options;
        let per_minute = |name: &str, n: Option<u64>| n.map(|n| format!(", {name} {n}"));
        let mut line = format!(
            "  provider {}: streams {} an event",
            p.kind,
            format_duration(o.stream_event_delay)
        );
        for part in [
            per_minute("rpm", p.rpm),
            per_minute("tpm", p.tpm),
            per_minute("itpm", o.itpm),
            per_minute("otpm", o.otpm),
            (o.stream_break_rate > 0.0)
                .then(|| format!(", stream_break_rate {}", o.stream_break_rate)),
            o.quota_exhausted_after.map(|n| format!(", quota_exhausted_after {n}")),
        ]
        .into_iter()
        .flatten()
        {
            line.push_str(&part);
        }
        writeln!(out, "{line}")?;
    }
    Ok(())
}

/// SIGTERM and SIGUSR1, handled from the moment this is made.
#[cfg(unix)]
struct Signals(Option<(tokio::signal::unix::Signal, tokio::signal::unix::Signal)>);

#[cfg(unix)]
impl Signals {
    fn new() -> Signals {
        use tokio::signal::unix::{SignalKind, signal};
        match (signal(SignalKind::terminate()), signal(SignalKind::user_defined1())) {
            (Ok(term), Ok(usr1)) => Signals(Some((term, usr1))),
            _ => Signals(None),
        }
    }
}

#[cfg(not(unix))]
struct Signals;

#[cfg(not(unix))]
impl Signals {
    fn new() -> Signals {
        Signals
    }
}

#[cfg(unix)]
async fn wait_for_stop(
    server: &stormguard_chaos::ChaosServer,
    signals: Signals,
    stop_after: Option<Duration>,
    format: crate::log::LogFormat,
) {
    let Some((mut term, mut usr1)) = signals.0 else {
        return wait_plain(stop_after).await;
    };
    let deadline = sleep_or_forever(stop_after);
    tokio::pin!(deadline);
    loop {
        tokio::select! {
            _ = tokio::signal::ctrl_c() => break,
            _ = term.recv() => break,
            () = &mut deadline => break,
            _ = usr1.recv() => {
                crate::log::status(format, &format!("stormguard chaos: phase {}", server.next_phase()));
            }
        }
    }
}

#[cfg(not(unix))]
async fn wait_for_stop(
    _server: &stormguard_chaos::ChaosServer,
    _signals: Signals,
    stop_after: Option<Duration>,
    _format: crate::log::LogFormat,
) {
    wait_plain(stop_after).await
}

async fn wait_plain(stop_after: Option<Duration>) {
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        () = sleep_or_forever(stop_after) => {}
    }
}

async fn sleep_or_forever(d: Option<Duration>) {
    match d {
        Some(d) => tokio::time::sleep(d).await,
        None => std::future::pending().await,
    }
}
