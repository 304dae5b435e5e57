//! `stormguard audit`: lint mesh and client configs for retry amplification and unsafe retry
//! settings (Istio, Envoy, gRPC service config, Linkerd, stormguard's own config).
//!
//! Exit codes: 0 when no finding reaches `--fail-on` (default `error`), 1 when one does, 2 when
//! an input cannot be read or parsed (the message names the file and line).

use std::io::Write;
use std::path::PathBuf;

use clap::{Args, ValueEnum};
use stormguard_audit::{AuditError, AuditOptions, IstioVersion, Severity, audit_paths, output};

use crate::Failure;
use crate::args;

/// How to print the report.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum AuditFormat {
    /// A table for people.
    Table,
    /// One JSON object: findings, paths, summary.
    Json,
    /// SARIF 2.1.0, for code-scanning uploads.
    Sarif,
}

/// Flags of `stormguard audit`.
#[derive(Debug, Args)]
#[command(after_help = "\
Reads Istio VirtualService/DestinationRule, Envoy route and cluster config (YAML/JSON), gRPC \
service config JSON, Linkerd ServiceProfile and retry.linkerd.io/* annotations, and stormguard \
TOML. Directories are walked for .yaml, .yml, .json and .toml files.

Graph (TOML), one table per call:
  [[call]]
  from = \"web\"
  to = \"checkout\"
  via = [\"virtualservice/checkout\", { name = \"sdk\", retries = 2 }]

Exit: 0 clean, 1 a finding at or above --fail-on, 2 unreadable input.

Example:
  stormguard audit deploy/examples --graph deploy/examples/graph.toml --max-amplification 3")]
pub struct AuditArgs {
    /// Config files or directories to audit.
    #[arg(value_name = "PATH", required = true)]
    pub paths: Vec<PathBuf>,
    /// A call graph: which service calls which, through which configs.
    #[arg(long, value_name = "FILE")]
    pub graph: Option<PathBuf>,
    /// Worst-case attempts per request above this are an error.
    #[arg(long, value_name = "N", default_value_t = 3.0)]
    pub max_amplification: f64,
    /// The Istio release whose default retries apply where `retries` is absent
    /// (e.g. 1.0, 1.22; `current` is the newest known).
    #[arg(long, value_name = "VERSION", default_value = "current", value_parser = args::istio_version)]
    pub istio_version: IstioVersion,
    /// Exit 1 when a finding reaches this level: info, warning or error.
    #[arg(long, value_name = "LEVEL", default_value = "error", value_parser = args::severity)]
    pub fail_on: Severity,
    /// Print JSON (same as --format json).
    #[arg(long, conflicts_with = "format")]
    pub json: bool,
    /// Output format.
    #[arg(long, value_enum, default_value_t = AuditFormat::Table)]
    pub format: AuditFormat,
}

/// Runs `stormguard audit`.
pub fn run(args: &AuditArgs, out: &mut dyn Write) -> Result<(), Failure> {
    let (fail_on, istio_version) = (args.fail_on, args.istio_version);
    if !(args.max_amplification >= 1.0 && args.max_amplification.is_finite()) {
        return Err(Failure::usage(format!(
            "--max-amplification must be a number ≥ 1, got {}",
            args.max_amplification
        )));
    }
    let options = AuditOptions { max_amplification: args.max_amplification, istio_version };
    // Unreadable or unparsable input (or a graph ref naming nothing) is bad input: exit 2.
    let report = audit_paths(&args.paths, args.graph.as_deref(), &options)
        .map_err(|e: AuditError| Failure::usage(e.to_string()))?;
    let format = if args.json { AuditFormat::Json } else { args.format };
    match format {
        AuditFormat::Table => out.write_all(output::to_table(&report).as_bytes())?,
        AuditFormat::Json => writeln!(out, "{:#}", output::to_json(&report))?,
        AuditFormat::Sarif => writeln!(out, "{:#}", output::to_sarif(&report))?,
    }
    let failing = report.findings.iter().filter(|f| f.severity >= fail_on).count();
    if failing > 0 {
        return Err(Failure::runtime(format!(
            "{failing} finding{} at or above {fail_on}",
            if failing == 1 { "" } else { "s" }
        )));
    }
    Ok(())
}
