//! The binary's log: one `tracing-subscriber` for every command, writing to stderr.
//!
//! - **What**: `STORMGUARD_LOG`, in `tracing-subscriber`'s env-filter syntax (`warn`,
//!   `info,stormguard_tower=debug`, …); unset or empty means `info`. A filter that cannot be
//!   read is a usage error (exit 2) naming the variable.
//! - **How**: `--log-format text` (the default: one line per event, coloured only on a
//!   terminal) or `--log-format json` (one JSON object per line, the event's fields at the top
//!   level beside `timestamp`, `level`, `target` and `message`), on the long-running commands
//!   (`proxy`, `chaos`, `demo`).
//! - **The access log** (target `stormguard::access`, one event per proxied request) never goes
//!   to this log: `stormguard proxy --access-log FILE` appends it to a file of its own, in the
//!   same format (`/dev/stdout` puts it on standard output); without the flag it is off.
//! - **The per-attempt spans** (target `stormguard::attempt`, for tracing exporters in-process)
//!   are off here, so the proxy builds none, unless `STORMGUARD_LOG` names that target itself.

use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::sync::Mutex;

use clap::{Args, ValueEnum};
use tracing::{Metadata, Subscriber};
use tracing_subscriber::filter::{EnvFilter, FilterExt, Targets, filter_fn};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::{Layer, Registry};

use crate::Failure;

/// The environment variable that filters the log.
pub const ENV: &str = "STORMGUARD_LOG";
/// The filter when [`ENV`] is unset or empty.
pub const DEFAULT_FILTER: &str = "info";
/// The proxy's access log's target.
pub const ACCESS_TARGET: &str = "stormguard::access";

/// How log lines are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, ValueEnum)]
pub enum LogFormat {
    /// One human-readable line per event.
    #[default]
    Text,
    /// One JSON object per line.
    Json,
}

/// `--access-log FILE`.
pub fn access_log(text: &str) -> Result<AccessLog, std::convert::Infallible> {
    Ok(AccessLog(PathBuf::from(text)))
}

/// `--log-format`, on the long-running commands.
#[derive(Debug, Clone, Args)]
pub struct LogArgs {
    /// How log lines on stderr are written: text, or one JSON object per line. What is logged
    /// is set by STORMGUARD_LOG (env-filter syntax, default "info").
    #[arg(long, value_enum, value_name = "FORMAT", default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
}

/// Where the proxy's access log goes: a file it is appended to. (Not the process's own stdout
/// handle: the command holds it locked while it runs.)
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AccessLog(pub PathBuf);

/// A command's own status line on stderr (`stormguard proxy: listening on http://…`): written
/// as it is beside text logs; beside JSON logs it is an `info` event of target `stormguard`, so
/// that stderr stays one JSON object per line.
pub fn status(format: LogFormat, text: &str) {
    match format {
        LogFormat::Text => {
            // A closed stderr must not stop a server: these lines are for people.
            let _ = writeln!(std::io::stderr(), "{text}");
        }
        LogFormat::Json => tracing::info!(target: "stormguard", "{text}"),
    }
}

/// The log's filter from [`ENV`]'s value: env-filter syntax, [`DEFAULT_FILTER`] when unset or
/// empty; the per-attempt spans off unless the value names their target.
pub fn filter(value: Option<&str>) -> Result<EnvFilter, Failure> {
    let spec = value.map(str::trim).filter(|s| !s.is_empty()).unwrap_or(DEFAULT_FILTER);
    let bad = |e: &dyn std::fmt::Display| Failure::usage(format!("{ENV}={spec:?}: {e}"));
    let filter = EnvFilter::builder().parse(spec).map_err(|e| bad(&e))?;
    let mut filter = filter;
    // h2 warns once per connection that resets streams too fast; the proxy says it itself, at
    // most every 10 s (a caller must not be able to fill the log). Named in the value, it is
    // as the value says.
    if !spec.split([',', '=', ':']).any(|t| t.trim() == "h2") {
        filter = filter.add_directive("h2=error".parse().map_err(|e| bad(&e))?);
    }
    if spec.contains(stormguard_tower::span::TARGET) {
        return Ok(filter);
    }
    let off = format!("{}=off", stormguard_tower::span::TARGET);
    Ok(filter.add_directive(off.parse().map_err(|e| bad(&e))?))
}

/// Installs the process's subscriber: the log on stderr, and the access log where asked.
/// Called once, by `main`; tests that call [`crate::run`] install nothing.
pub fn install(format: LogFormat, access: Option<&AccessLog>) -> Result<(), Failure> {
    let filter = filter(std::env::var(ENV).ok().as_deref())?;
    let access = match access {
        None => None,
        Some(AccessLog(path)) => Some(Writer::File(Mutex::new(
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)
                .map_err(|e| Failure::usage(format!("--access-log {}: {e}", path.display())))?,
        ))),
    };
    // Only `main` installs one; a second call (never made) would keep the first.
    let _ =
        tracing::subscriber::set_global_default(subscriber(format, filter, Writer::Stderr, access));
    Ok(())
}

/// The subscriber: the log through `filter` to `log`, the access log to `access` when given.
/// The layers are a list, not an optional layer: an absent `Option` layer says it wants every
/// callsite, which would turn on every span and event the filter turns off, and the proxy
/// would build a span per attempt and an event per `debug!` only to drop them.
fn subscriber(
    format: LogFormat,
    filter: EnvFilter,
    log: Writer,
    access: Option<Writer>,
) -> impl Subscriber + Send + Sync {
    let not_access = filter_fn(|m: &Metadata<'_>| m.target() != ACCESS_TARGET);
    let mut layers: Vec<Box<dyn Layer<Registry> + Send + Sync>> =
        vec![layer(format, log).with_filter(filter.and(not_access)).boxed()];
    if let Some(w) = access {
        layers.push(
            layer(format, w)
                .with_filter(Targets::new().with_target(ACCESS_TARGET, tracing::Level::INFO))
                .boxed(),
        );
    }
    Registry::default().with(layers)
}

/// Where one layer writes.
enum Writer {
    Stderr,
    File(Mutex<std::fs::File>),
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Writer {
    type Writer = Box<dyn std::io::Write + 'a>;

    fn make_writer(&'a self) -> Self::Writer {
        match self {
            Writer::Stderr => Box::new(std::io::stderr()),
            // The fmt layer formats each event whole and writes it once, so lines never mix.
            Writer::File(f) => Box::new(f.make_writer()),
        }
    }
}

impl Writer {
    fn is_terminal(&self) -> bool {
        match self {
            Writer::Stderr => std::io::stderr().is_terminal(),
            Writer::File(_) => false,
        }
    }
}

/// A fmt layer in `format`, writing to `writer`.
fn layer<S>(format: LogFormat, writer: Writer) -> Box<dyn Layer<S> + Send + Sync>
where
    S: Subscriber + for<'a> LookupSpan<'a>,
{
    let ansi = writer.is_terminal();
    match format {
        LogFormat::Text => {
            Box::new(tracing_subscriber::fmt::layer().with_ansi(ansi).with_writer(writer))
        }
        LogFormat::Json => Box::new(
            tracing_subscriber::fmt::layer().json().flatten_event(true).with_writer(writer),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What the filter turns off is not built: no attempt span, no debug event, with or
    /// without an access log beside the log.
    #[test]
    fn what_the_filter_turns_off_is_never_built() {
        for access in [false, true] {
            let w = || Writer::File(Mutex::new(scratch_file()));
            let s = subscriber(LogFormat::Text, filter(None).unwrap(), w(), access.then(w));
            tracing::subscriber::with_default(s, || {
                let span = tracing::info_span!(target: "stormguard::attempt", "stormguard.attempt");
                assert!(span.is_disabled(), "access log {access}: the attempt span is built");
                assert!(!tracing::enabled!(tracing::Level::DEBUG), "access log {access}");
                assert!(tracing::enabled!(tracing::Level::INFO));
                assert_eq!(
                    tracing::enabled!(target: "stormguard::access", tracing::Level::INFO),
                    access
                );
            });
        }
    }

    fn scratch_file() -> std::fs::File {
        // Created, opened and removed at once: the handle writes on, nothing is left behind.
        let path = std::env::temp_dir().join(format!("sg-log-{}", std::process::id()));
        let f = std::fs::File::create(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        f
    }

    #[test]
    fn the_filter_reads_env_filter_syntax_and_refuses_what_it_cannot_read() {
        assert_eq!(filter(None).unwrap().to_string(), "stormguard::attempt=off,h2=error,info");
        assert_eq!(
            filter(Some("  ")).unwrap().to_string(),
            "stormguard::attempt=off,h2=error,info"
        );
        assert!(!filter(Some("info,h2=warn")).unwrap().to_string().contains("h2=error"));
        let f = filter(Some("warn,stormguard_tower=debug")).unwrap().to_string();
        assert!(f.contains("stormguard_tower=debug") && f.contains("warn"), "{f}");
        // Naming the spans' target turns them on.
        let f = filter(Some("info,stormguard::attempt=info")).unwrap().to_string();
        assert!(!f.contains("=off"), "{f}");
        let e = filter(Some("info,stormguard=loud")).unwrap_err();
        assert_eq!(e.code, 2);
        assert!(
            e.message.starts_with("STORMGUARD_LOG=\"info,stormguard=loud\": "),
            "{}",
            e.message
        );
    }
}
