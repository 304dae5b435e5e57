//! `stormguard proxy`: the sidecar, from quick flags or a config file; and
//! `stormguard check-config FILE`, which validates a config without starting anything.

use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::Args;
use http::Uri;
use stormguard_core::backoff::BackoffConfig;
use stormguard_core::budget::BudgetSpec;
use stormguard_core::conditions::RetryOn;
use stormguard_core::decimal::format_duration;
use stormguard_core::defaults;
use stormguard_proxy::config::{
    AdminToken, DEFAULT_ADMIN, Overrides, ProxyConfig, ProxyDependency, RedisSourceError,
};

use crate::Failure;
use crate::args::{self, Admin};

/// Flags of `stormguard proxy`.
#[derive(Debug, Args)]
#[command(after_help = "\
Examples:
  # One upstream, a cap of 20 and a 25 % retry budget (its dependency is named \"default\"):
  stormguard proxy --listen 127.0.0.1:8080 --upstream http://127.0.0.1:9000 --cap 20 \\
    --budget ratio:percent=0.25,min_per_sec=3 --admin 127.0.0.1:9901

  # Everything from a file (listeners, dependencies, routes), checked first:
  stormguard check-config deploy/examples/stormguard.toml
  stormguard proxy --config deploy/examples/stormguard.toml

Admin: GET /metrics /healthz /readyz /config /stats.json /dashboard;
  POST /dependencies/NAME/retries {\"enabled\": false}   the kill switch
  POST /dependencies/NAME/shadow {\"enabled\": true}     shadow mode
  A state change takes Content-Type: application/json and a Host that is the admin address
  (or, with --admin-token, Authorization: Bearer TOKEN):
  curl -X POST -H 'content-type: application/json' -d '{\"enabled\": false}' \\
    127.0.0.1:9901/dependencies/default/retries
  Started from flags, the one dependency is named \"default\" (NAME above, and the dependency
  label of its metrics); a config file names its own.

Logs go to stderr: STORMGUARD_LOG filters them (env-filter syntax, default \"info\"; \"debug\"
shows each retry decision), --log-format json writes one JSON object a line, --access-log FILE
writes one line per request apart.
The config format is in docs/proxy.md (limits, timeouts, security and logs included).")]
pub struct ProxyArgs {
    /// A TOML config. Beside it, --admin, --record, --shadow, --drain-timeout, the callers'
    /// --body-timeout and --response-idle-timeout, and the listener and admin access flags
    /// (--header-read-timeout, --idle-timeout, --max-connections, --admin-allow-remote,
    /// --admin-token) apply over the file (shown in /config, kept at every reload), and
    /// --threads and --duration apply as always; the per-dependency flags (--cap, --budget,
    /// --retry-on, --max-retries, --breaker, ...) cannot be combined with it: set them in the
    /// file's [[dependency]].
    #[arg(long, value_name = "FILE", conflicts_with_all = [
        "upstream", "listen", "cap", "budget", "retry_on", "max_retries", "per_try_timeout",
        "deadline", "backoff", "queue", "queue_timeout", "timeout_slot_hold", "abandon_hold",
        "breaker", "caller_retries", "client_retry_window",
    ])]
    pub config: Option<PathBuf>,
    /// Where callers connect.
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:8080")]
    pub listen: SocketAddr,
    /// The dependency's address, http://host:port. The dependency is named "default" (the
    /// `dependency` label of its metrics, /dependencies/default/... on the admin listener).
    #[arg(long, value_name = "URL", required_unless_present = "config", value_parser = args::uri)]
    pub upstream: Option<Uri>,
    /// Attempts in flight at once, first tries and retries.
    #[arg(long, value_name = "N", default_value_t = defaults::CAP)]
    pub cap: u64,
    /// The retry budget SPEC.
    #[arg(long, value_name = "SPEC", default_value_t = BudgetSpec::default(), value_parser = args::budget)]
    pub budget: BudgetSpec,
    /// The admin listener, or "off" [default: 127.0.0.1:9901, or the config's `admin`].
    #[arg(long, value_name = "ADDR", value_parser = args::admin)]
    pub admin: Option<Admin>,
    /// What may be retried (a timeout, a reset or a 5xx only for an idempotent request)
    /// [default: 5xx,reset,connect-failure,refused-stream,timeout; with --provider openai or
    /// anthropic, also 408, 409 and 429, as their SDKs retry].
    #[arg(long, value_name = "LIST", value_parser = args::retry_on)]
    pub retry_on: Option<RetryOn>,
    /// Retries per request, 0 to 10.
    #[arg(long, value_name = "N", default_value_t = defaults::MAX_RETRIES)]
    pub max_retries: u32,
    /// Each attempt's limit up to response headers, connect time included.
    #[arg(long, value_name = "DURATION", value_parser = args::duration)]
    pub per_try_timeout: Option<Duration>,
    /// The whole request's limit.
    #[arg(long, value_name = "DURATION", value_parser = args::duration)]
    pub deadline: Option<Duration>,
    /// Backoff range, e.g. 25ms..250ms.
    #[arg(long, value_name = "RANGE", default_value = backoff_range(&BackoffConfig::default()), value_parser = args::backoff)]
    pub backoff: BackoffConfig,
    /// Primaries that may wait for a slot (0: fail fast).
    #[arg(long, value_name = "N", default_value_t = defaults::QUEUE_LEN)]
    pub queue: u64,
    /// The provider's requests per minute: first tries wait for room in the window (up to
    /// --queue-timeout), retries are refused `rate`; learned from the provider's headers.
    #[arg(long, value_name = "N", conflicts_with = "config")]
    pub rpm: Option<u64>,
    /// The provider's tokens per minute (each request's estimated from its body's
    /// `max_tokens` and size).
    #[arg(long, value_name = "N", conflicts_with = "config")]
    pub tpm: Option<u64>,
    /// The provider whose answers these are, `openai`, `anthropic` or `generic`: its limits are
    /// learned from its headers, a spent quota (`insufficient_quota`) is never retried and holds
    /// the upstream, an overloaded answer (529) cools it down, and a 429 or 529 may be retried
    /// even for a POST (the provider did not run it). See docs/providers.md.
    #[arg(long, value_name = "KIND", conflicts_with = "config", value_parser = args::provider_preset)]
    pub provider: Option<stormguard_tower::Provider>,
    /// A gRPC upstream: HTTP/2 by prior knowledge (h2c on http://), `retry_on` of
    /// 5xx,reset,connect-failure,refused-stream,timeout,unavailable unless --retry-on says
    /// otherwise. Every gRPC call is a POST: a method is retried after it may have run only
    /// when --idempotent names it. See docs/proxy.md, "HTTP/2 and gRPC upstreams".
    #[arg(long, conflicts_with = "config")]
    pub grpc: bool,
    /// A path prefix whose requests may be retried whatever their method (a gRPC method
    /// `/pkg.Service/Method`, or a whole service `/pkg.Service/`); repeat for several.
    #[arg(long, value_name = "PREFIX", conflicts_with = "config")]
    pub idempotent: Vec<String>,
    /// Hedge an idempotent request that has not answered after this long (`100ms`) or after
    /// this percentile of recent attempts (`p95`): a second attempt, paid from the budget, its
    /// slot taken at once or not at all; the first success wins. See docs/rules.md.
    #[arg(long, value_name = "DELAY|pNN", conflicts_with = "config", value_parser = args::hedge_after)]
    pub hedge_after: Option<stormguard_core::hedge::HedgeAfter>,
    /// Hedges per request at most, 1 to 3 (with --hedge-after).
    #[arg(
        long,
        value_name = "N",
        conflicts_with = "config",
        requires = "hedge_after",
        default_value_t = 1
    )]
    pub max_hedges: u32,
    /// An adaptive cap between MIN and MAX (`4..40`): the working cap starts at --cap and
    /// follows what the upstream can take, learned from its latency (Gradient2) and its
    /// refusals (429, 503, 529, timeouts). See docs/rules.md.
    #[arg(long, value_name = "MIN..MAX", conflicts_with = "config")]
    pub adaptive_cap: Option<stormguard_core::adaptive::AdaptiveConfig>,
    /// The longest a primary waits for a slot.
    #[arg(long, value_name = "DURATION", default_value = format_duration(defaults::QUEUE_TIMEOUT), value_parser = args::duration)]
    pub queue_timeout: Duration,
    /// How long an attempt the proxy timed out keeps its slot while the upstream may still be
    /// working on it (it comes back when the upstream answers; 0: at the timeout) [default: 30s].
    #[arg(long, value_name = "DURATION", value_parser = args::duration)]
    pub timeout_slot_hold: Option<Duration>,
    /// How long an attempt whose caller hung up keeps its slot while the upstream may still be
    /// working on it (it comes back when the upstream answers; 0: at once) [default: 30s].
    #[arg(long, value_name = "DURATION", value_parser = args::duration)]
    pub abandon_hold: Option<Duration>,
    /// Shadow mode: count what would be denied, deny nothing (with --config: for every
    /// dependency).
    #[arg(long)]
    pub shadow: bool,
    /// Turn the circuit breaker on, with its defaults: open when half the attempts of the last
    /// 10 s failed (at least 20 of them) or 10 failed in a row; open 5 s (fail fast, no
    /// retries); then one probe. Off by default: the budget and the cap bound a failing
    /// dependency's load without it. A config file sets it, and each key, in
    /// [dependency.breaker].
    #[arg(long)]
    pub breaker: bool,
    /// A caller's own retries — marked by the layer that sent them, or the repeat of an answer
    /// that failed within --client-retry-window — are charged to the budget like stormguard's
    /// (`enforce`), counted only (`count`), or not looked for (`off`). See docs/proxy.md.
    #[arg(long, value_name = "MODE", default_value = "enforce")]
    pub caller_retries: stormguard_proxy::callers::CallerRetries,
    /// How long after a failed or refused answer the caller's identical request is its retry.
    #[arg(long, value_name = "DURATION", default_value = format_duration(defaults::CLIENT_RETRY_WINDOW), value_parser = args::duration)]
    pub client_retry_window: Duration,
    /// Record mode: write every dependency's traffic to FILE as `replay` JSON lines (replay
    /// one with `stormguard replay --dependency NAME --policy SPEC FILE`).
    #[arg(long, value_name = "FILE")]
    pub record: Option<PathBuf>,
    /// On SIGTERM or Ctrl-C: how long requests in flight may take to finish (default 10s, or
    /// the config's `drain_timeout`).
    #[arg(long, value_name = "DURATION", value_parser = args::duration)]
    pub drain_timeout: Option<Duration>,
    /// How long a connection may take to send a whole request head (from its start, or on a
    /// kept-alive connection from the request's first byte) before it is closed [default: 10s].
    /// Every listener, the admin listener included.
    #[arg(long, value_name = "DURATION", value_parser = args::duration)]
    pub header_read_timeout: Option<Duration>,
    /// How long a connection with no request in flight (HTTP/2: no stream open) is kept
    /// [default: 60s]. Every listener, the admin listener included.
    #[arg(long, value_name = "DURATION", value_parser = args::duration)]
    pub idle_timeout: Option<Duration>,
    /// How long the proxy may wait, in all, for a request body's bytes before the request is
    /// answered 408 and any slot it holds comes back [default: 30s; 0s: off].
    #[arg(long, value_name = "DURATION", value_parser = args::duration)]
    pub body_timeout: Option<Duration>,
    /// How long a caller may take nothing of an answer waiting for it (the 1 MiB read-ahead
    /// buffer full, or the answer finished) before the answer is cut and its slot comes back
    /// [default: 30s; 0s: off].
    #[arg(long, value_name = "DURATION", value_parser = args::duration)]
    pub response_idle_timeout: Option<Duration>,
    /// Connections each caller listener holds at once; past it new ones are closed at once
    /// [default: sized from the open-files limit, keeping a reserve for the admin listener and
    /// the upstreams].
    #[arg(long, value_name = "N")]
    pub max_connections: Option<usize>,
    /// Let --admin be an address other than loopback (reachable from other hosts; logged at
    /// warn). Set --admin-token too.
    #[arg(long)]
    pub admin_allow_remote: bool,
    /// Admin state changes need `Authorization: Bearer TOKEN`, the token read from the
    /// environment variable NAME (env:NAME; never on the command line).
    #[arg(long, value_name = "env:NAME", value_parser = args::admin_token)]
    pub admin_token: Option<AdminToken>,
    /// Worker threads (default: the CPUs this process may run on, by affinity and cgroup
    /// quota). With 1, tokio's current-thread scheduler runs everything on one thread: 13 % less
    /// CPU per request than the multi-thread scheduler with one worker (BENCHMARKS.md).
    #[arg(long, value_name = "N")]
    pub threads: Option<usize>,
    /// Stop after this long (default: until Ctrl-C or SIGTERM).
    #[arg(long, value_name = "DURATION", value_parser = args::duration)]
    pub duration: Option<Duration>,
    /// The access log: one line per request (method, path, dependency, route, client, status,
    /// attempts, denial reason, slot wait, upstream and total time), appended to FILE in the
    /// --log-format; /dev/stdout for standard output. Off by default, and never mixed into the
    /// log on stderr.
    #[arg(long, value_name = "FILE", value_parser = crate::log::access_log)]
    pub access_log: Option<crate::log::AccessLog>,
    /// The log's format.
    #[command(flatten)]
    pub log: crate::log::LogArgs,
}

/// Flags of `stormguard check-config`.
#[derive(Debug, Args)]
#[command(after_help = "\
Example:
  stormguard check-config deploy/examples/stormguard.toml

Exit: 0 with a summary when the file is valid; 2 naming file, line, column and key when not.
The config format is in docs/proxy.md; more examples are in deploy/examples/.")]
pub struct CheckConfigArgs {
    /// The config file.
    pub file: PathBuf,
}

/// A backoff's `base..max`, as `--backoff` reads it.
fn backoff_range(b: &BackoffConfig) -> String {
    format!("{}..{}", format_duration(b.base), format_duration(b.max))
}

/// What to do instead, printed under clap's refusal of a per-dependency flag beside `--config`.
pub const CONFIG_CONFLICT: &str = "\
note: with --config, the listeners and every dependency's settings (cap, budget, retry_on,
  max_retries, timeouts, backoff, queue, holds) come from the file: set them in its [[listener]]
  and [[dependency]] tables, then reload (SIGHUP). Beside --config only --admin, --record,
  --shadow, --drain-timeout, --header-read-timeout, --idle-timeout, --max-connections,
  --admin-allow-remote and --admin-token (applied over the file, and kept at each reload),
  --threads and --duration apply.";

/// The flags that apply over a config file: the process's own settings. (clap refuses the
/// per-dependency flags beside `--config`, naming them.)
fn overrides(args: &ProxyArgs) -> Overrides {
    Overrides {
        admin: args.admin.map(Admin::addr),
        record: args.record.clone(),
        drain_timeout: args.drain_timeout,
        shadow: args.shadow,
        header_read_timeout: args.header_read_timeout,
        idle_timeout: args.idle_timeout,
        body_timeout: args.body_timeout,
        response_idle_timeout: args.response_idle_timeout,
        max_connections: args.max_connections,
        admin_allow_remote: args.admin_allow_remote,
        admin_token: args.admin_token.clone(),
    }
}

/// A config error after the flags were applied, naming the flag.
fn flag_error(e: stormguard_proxy::config::RuleViolation) -> Failure {
    use stormguard_proxy::config::Segment;
    let keys: Vec<&str> = e
        .key
        .segments()
        .iter()
        .filter_map(|s| match s {
            Segment::Key(k) => Some(k.as_str()),
            Segment::Index(_) => None,
        })
        .collect();
    let flag = match keys.last().copied().unwrap_or_default() {
        // `adaptive.max` and its kin: all from --adaptive-cap.
        _ if keys.contains(&"adaptive") => "adaptive-cap".to_string(),
        "upstreams" => "upstream".to_string(),
        k => k.replace('_', "-"),
    };
    Failure::usage(format!("--{flag}: {}", e.error))
}

/// The proxy's config from the flags, or the file they name with the flags that apply over it.
pub fn config_from_args(args: &ProxyArgs) -> Result<ProxyConfig, Failure> {
    if let Some(path) = &args.config {
        let mut config = ProxyConfig::load(path).map_err(|e| Failure::usage(e.to_string()))?;
        overrides(args).apply(&mut config);
        // The file was checked as read: what fails now, a flag set.
        config.validate().map_err(flag_error)?;
        return Ok(config);
    }
    // clap requires --upstream without --config.
    let uri = args.upstream.clone().unwrap_or_default();
    let mut d = ProxyDependency::new("default", uri);
    d.cap = args.cap;
    d.budget = args.budget;
    d.retry_on = match (&args.retry_on, args.provider) {
        (Some(r), _) => r.clone(),
        (None, Some(p)) => p.retry_on(),
        (None, None) if args.grpc => defaults::GRPC_RETRY_ON.parse().expect("a valid retry_on"),
        (None, None) => RetryOn::default(),
    };
    d.http2.prior_knowledge = args.grpc;
    d.rate.provider = args.provider;
    d.hedge = args
        .hedge_after
        .map(|after| stormguard_core::hedge::HedgeConfig { after, max_hedges: args.max_hedges });
    d.adaptive = args.adaptive_cap;
    d.max_retries = args.max_retries;
    d.per_try_timeout = args.per_try_timeout;
    d.deadline = args.deadline;
    d.backoff = args.backoff;
    d.queue = args.queue;
    d.rate.requests_per_minute = args.rpm;
    d.rate.tokens_per_minute = args.tpm;
    d.queue_timeout = args.queue_timeout;
    if let Some(t) = args.timeout_slot_hold {
        d.timeout_slot_hold = t;
    }
    if let Some(t) = args.abandon_hold {
        d.abandon_hold = t;
    }
    d.enforce = !args.shadow;
    d.breaker = args.breaker.then(stormguard_core::breaker::BreakerConfig::default);
    d.caller_retries = args.caller_retries;
    d.client_retry_window = args.client_retry_window;
    let name = d.name.clone();
    let mut config = ProxyConfig::single(args.listen, d);
    for prefix in &args.idempotent {
        if !prefix.starts_with('/') {
            return Err(Failure::usage(format!(
                "--idempotent: a path prefix starts with '/', got {prefix:?}"
            )));
        }
        config.routes.push(stormguard_proxy::config::RouteConfig {
            host: None,
            path_prefix: prefix.clone(),
            dependency: name.clone(),
            budget: None,
            idempotent: true,
        });
    }
    config.record.clone_from(&args.record);
    if let Some(d) = args.drain_timeout {
        config.drain_timeout = d;
    }
    config.admin = match args.admin {
        Some(a) => a.addr(),
        None => args::admin(DEFAULT_ADMIN)
            .map_err(|e| Failure::runtime(format!("the default admin address: {e}")))?
            .addr(),
    };
    // The listener and admin access flags; here the flags are the config itself, not
    // overrides of a file.
    overrides(args).apply(&mut config);
    config.overrides = Overrides::default();
    config.validate().map_err(flag_error)?;
    Ok(config)
}

/// Runs `stormguard proxy` until `--duration` passes (then stops at once), or SIGTERM / Ctrl-C
/// (then drains: `/readyz` fails, requests in flight finish up to the drain timeout, exit 0).
/// SIGHUP reads the config file again and puts it in force (a bad one is refused and logged;
/// the running config stays).
pub fn run(args: &ProxyArgs, _out: &mut dyn Write) -> Result<(), Failure> {
    let config = config_from_args(args)?;
    let stop_after = args.duration;
    let runtime = match args.threads {
        Some(0) => return Err(Failure::usage("--threads: must be at least 1")),
        Some(1) => tokio::runtime::Builder::new_current_thread().enable_all().build(),
        Some(n) => {
            tokio::runtime::Builder::new_multi_thread().worker_threads(n).enable_all().build()
        }
        None if std::thread::available_parallelism().is_ok_and(|n| n.get() == 1) => {
            tokio::runtime::Builder::new_current_thread().enable_all().build()
        }
        None => tokio::runtime::Builder::new_multi_thread().enable_all().build(),
    }
    .map_err(|e| Failure::runtime(format!("cannot start the runtime: {e}")))?;
    runtime.block_on(async {
        let signals = Signals::register();
        let proxy = stormguard_proxy::start(config).await.map_err(|e| start_failure(args, e))?;
        let say = |text: String| crate::log::status(args.log.log_format, &text);
        for a in proxy.listen_addrs() {
            say(format!("stormguard proxy: listening on http://{a}"));
        }
        if let Some(a) = proxy.admin_addr() {
            say(format!("stormguard proxy: admin on http://{a}"));
        }
        match wait_for_stop(&proxy, stop_after, signals).await {
            Ending::Elapsed => proxy.shutdown().await,
            Ending::Signal => {
                // The config in force now: a reload may have changed drain_timeout.
                let drain_timeout = proxy.config().drain_timeout;
                say(format!("stormguard proxy: draining (up to {} ms)", drain_timeout.as_millis()));
                let report = proxy.drain(drain_timeout).await;
                say(format!(
                    "stormguard proxy: drained in {} ms; {} connection(s) cut at the timeout",
                    report.took.as_millis(),
                    report.cut
                ));
            }
        }
        Ok::<_, Failure>(())
    })?;
    runtime.shutdown_background();
    Ok(())
}

/// A start that failed, said for the command line: a listener that cannot bind names the flag
/// (or the config key) that moves it.
fn start_failure(args: &ProxyArgs, e: stormguard_proxy::StartError) -> Failure {
    use stormguard_proxy::{Listener, StartError};
    match e {
        e @ StartError::Invalid(..) => Failure::usage(e.to_string()),
        StartError::Bind { listener, addr, source } => {
            let file = args.config.as_ref().map(|p| p.display().to_string());
            let what = match listener {
                Listener::Admin => format!("admin listener {addr}"),
                Listener::Caller { index } if file.is_some() => format!("listener[{index}] {addr}"),
                Listener::Caller { .. } => format!("listener {addr}"),
            };
            let fix = match (listener, &file) {
                (Listener::Admin, None) => "pass --admin ADDR or --admin off".to_string(),
                (Listener::Admin, Some(f)) => {
                    format!("pass --admin ADDR or --admin off, or change `admin` in {f}")
                }
                (Listener::Caller { .. }, None) => "pass --listen ADDR".to_string(),
                (Listener::Caller { index }, Some(f)) => {
                    format!("change listener[{index}].listen in {f}")
                }
            };
            let problem = match source.kind() {
                std::io::ErrorKind::AddrInUse => "in use".to_string(),
                _ => format!("cannot listen ({source})"),
            };
            Failure::runtime(format!("{what} {problem}: {fix}"))
        }
        e => Failure::runtime(e.to_string()),
    }
}

/// Why the proxy stops.
enum Ending {
    /// `--duration` passed: stop at once.
    Elapsed,
    /// SIGTERM or Ctrl-C: drain.
    Signal,
}

/// SIGTERM and SIGHUP, registered before the proxy says where it listens: until tokio registers
/// a handler both keep their default action, ending the process, so a reload sent as soon as the
/// addresses appear would kill it.
struct Signals {
    #[cfg(unix)]
    term_hup: Option<(tokio::signal::unix::Signal, tokio::signal::unix::Signal)>,
}

impl Signals {
    fn register() -> Signals {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{SignalKind, signal};
            let term_hup = match (signal(SignalKind::terminate()), signal(SignalKind::hangup())) {
                (Ok(term), Ok(hup)) => Some((term, hup)),
                _ => None,
            };
            Signals { term_hup }
        }
        #[cfg(not(unix))]
        Signals {}
    }
}

async fn wait_for_stop(
    proxy: &stormguard_proxy::ProxyHandle,
    stop_after: Option<Duration>,
    signals: Signals,
) -> Ending {
    let deadline = async {
        match stop_after {
            Some(d) => tokio::time::sleep(d).await,
            None => std::future::pending().await,
        }
    };
    tokio::pin!(deadline);
    #[cfg(unix)]
    {
        if let Some((mut term, mut hup)) = signals.term_hup {
            loop {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => return Ending::Signal,
                    _ = term.recv() => return Ending::Signal,
                    // The proxy logs the reload's one line: `config reloaded`, or `reload
                    // refused` at warn with the reason.
                    _ = hup.recv() => {
                        let _ = proxy.reload_from_source().await;
                    }
                    () = &mut deadline => return Ending::Elapsed,
                }
            }
        }
    }
    let _ = (proxy, signals);
    tokio::select! {
        _ = tokio::signal::ctrl_c() => Ending::Signal,
        () = deadline => Ending::Elapsed,
    }
}

/// Runs `stormguard check-config FILE`: exit 0 with a summary, or 2 naming the location. A
/// fleet dependency's Redis URL is checked when its environment variable is set here (as the
/// proxy will read it); when it is not, a note says the proxy needs it where it runs.
pub fn check(args: &CheckConfigArgs, out: &mut dyn Write) -> Result<(), Failure> {
    let c = ProxyConfig::load(&args.file).map_err(|e| Failure::usage(e.to_string()))?;
    for (i, d) in c.dependencies.iter().enumerate() {
        if let Some(Err(RedisSourceError::NotSet { name })) =
            d.fleet.as_ref().map(|f| f.redis.target())
        {
            eprintln!(
                "stormguard: note: {}: dependency[{i}].redis: ${name} is not set here, so the \
                 Redis URL was not checked; the proxy refuses to start where it is not set",
                args.file.display()
            );
        }
    }
    writeln!(
        out,
        "{}: ok ({} listener(s), {} dependenc{}, {} route(s))",
        args.file.display(),
        c.listeners.len(),
        c.dependencies.len(),
        if c.dependencies.len() == 1 { "y" } else { "ies" },
        c.routes.len()
    )?;
    Ok(())
}
