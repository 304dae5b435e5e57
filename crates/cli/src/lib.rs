//! The `stormguard` command line: `plan`, `replay`, `proxy`, `check-config`, `chaos`, `load`,
//! `demo`, `simulate`, `audit`, `review` and `db-check`, one module each under [`cmd`].
//!
//! `main.rs` only calls [`main_with_args`], which installs the log ([`log`]) and runs; tests
//! call [`run`] with their own output buffers.
//! Exit codes: 0 success, 2 bad flags, SPEC, config or input (with one clear sentence on stderr),
//! 1 anything else.

use std::ffi::OsString;
use std::io::Write;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

pub mod args;
pub mod cmd;
pub mod log;

/// stormguard keeps a slow or failing dependency from turning into an outage: every attempt
/// takes a slot under one concurrency cap, and retries spend a bounded budget.
#[derive(Debug, Parser)]
#[command(name = "stormguard", version, propagate_version = true)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Print what a dependency sees at given error rates, and the budget that keeps it under its
    /// cap.
    Plan(cmd::plan::PlanArgs),
    /// Run a trace of events through one budget policy on a virtual clock.
    Replay(cmd::replay::ReplayArgs),
    /// Simulate a retry storm: every policy in a scenario on the same arrivals, running
    /// stormguard-core's own limiter, breaker and retry decision on a virtual clock.
    Simulate(cmd::simulate::SimulateArgs),
    /// The simulator's prediction beside a live loopback run of the same scenario: chaos
    /// serving its timeline, the proxy with each policy, the simulator's own arrivals.
    Verify(cmd::verify::VerifyArgs),
    /// Serve a fault-injecting upstream (errors, latency, limits, resets) that counts what
    /// reaches it, in-flight exactly.
    Chaos(cmd::chaos::ChaosArgs),
    /// Drive a target (closed or open loop) and assert at the upstream that the cap and the
    /// budget held.
    Load(cmd::load::LoadArgs),
    /// The worked example, live on loopback: a retry storm against a naive retry-once client
    /// and against stormguard proxy, side by side, with a live dashboard and an HTML report.
    Demo(cmd::demo::DemoArgs),
    /// The sidecar: an HTTP proxy that holds the cap and the budget for every caller on a host.
    Proxy(Box<cmd::proxy::ProxyArgs>),
    /// Validate a proxy config; an error names file, line, column and key, and exits 2.
    CheckConfig(cmd::proxy::CheckConfigArgs),
    /// Find retry amplification and unsafe retry settings in Istio, Envoy, gRPC, Linkerd and
    /// stormguard configs.
    Audit(cmd::audit::AuditArgs),
    /// Choose a budget from the retry history in Prometheus (stormguard's, Envoy's metrics) or
    /// a recorded trace: the normal ratio, the incidents, and what each candidate would have done.
    Review(cmd::review::ReviewArgs),
    /// A PostgreSQL database's connections by state and application, transactions left idle,
    /// and whether open transactions climb: exit 1 on a leak.
    DbCheck(cmd::db_check::DbCheckArgs),
}

/// A command's failure: an exit code and one sentence for stderr.
#[derive(Debug)]
pub struct Failure {
    /// 2 for bad input or config, 1 otherwise.
    pub code: u8,
    /// What went wrong, and where.
    pub message: String,
}

impl Failure {
    /// Bad flags, SPEC, config or input: exit 2.
    pub fn usage(message: impl Into<String>) -> Failure {
        Failure { code: 2, message: message.into() }
    }

    /// Anything else (an I/O error writing output, say): exit 1.
    pub fn runtime(message: impl Into<String>) -> Failure {
        Failure { code: 1, message: message.into() }
    }
}

impl From<std::io::Error> for Failure {
    fn from(e: std::io::Error) -> Failure {
        Failure::runtime(format!("i/o error: {e}"))
    }
}

/// Runs a parsed command, writing results to `out`.
pub fn run(cli: Cli, out: &mut dyn Write) -> Result<(), Failure> {
    match cli.command {
        Command::Plan(args) => cmd::plan::run(&args, out),
        Command::Replay(args) => cmd::replay::run(&args, out),
        Command::Simulate(args) => cmd::simulate::run(&args, out),
        Command::Verify(args) => cmd::verify::run(&args, out),
        Command::Chaos(args) => cmd::chaos::run(&args, out),
        Command::Load(args) => cmd::load::run(&args, out),
        Command::Demo(args) => cmd::demo::run(&args, out),
        Command::Proxy(args) => cmd::proxy::run(&args, out),
        Command::CheckConfig(args) => cmd::proxy::check(&args, out),
        Command::Audit(args) => cmd::audit::run(&args, out),
        Command::DbCheck(args) => cmd::db_check::run(&args, out),
        Command::Review(args) => cmd::review::run(&args, out),
    }
}

/// The log's format and the access log the command asks for (see [`log`]): the long-running
/// commands have `--log-format`, the proxy `--access-log`; the others log text.
fn logging(cli: &Cli) -> (log::LogFormat, Option<&log::AccessLog>) {
    match &cli.command {
        Command::Proxy(a) => (a.log.log_format, a.access_log.as_ref()),
        Command::Chaos(a) => (a.log.log_format, None),
        Command::Demo(a) => (a.log.log_format, None),
        _ => (log::LogFormat::Text, None),
    }
}

/// Parses `args`, installs the log, runs the command against stdout, and reports a failure on
/// stderr.
pub fn main_with_args<I, T>(args: I) -> ExitCode
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    let cli = match Cli::try_parse_from(args) {
        Ok(cli) => cli,
        Err(e)
            if e.kind() == clap::error::ErrorKind::ArgumentConflict
                && e.to_string().contains("'--config <FILE>'") =>
        {
            // `stormguard proxy --config FILE` beside a flag the file decides: clap names the
            // flags; say where their settings go instead.
            let _ = e.print();
            eprintln!("{}", cmd::proxy::CONFIG_CONFLICT);
            return ExitCode::from(2);
        }
        // clap prints help and version to stdout (exit 0) and errors to stderr (exit 2).
        Err(e) => e.exit(),
    };
    let (format, access) = logging(&cli);
    if let Err(f) = log::install(format, access) {
        eprintln!("stormguard: {}", f.message);
        return ExitCode::from(f.code);
    }
    let stdout = std::io::stdout();
    let mut out = std::io::BufWriter::new(stdout.lock());
    let result = run(cli, &mut out).and_then(|()| out.flush().map_err(Failure::from));
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(f) => {
            let _ = out.flush();
            eprintln!("stormguard: {}", f.message);
            ExitCode::from(f.code)
        }
    }
}
