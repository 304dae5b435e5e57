//! The proxy's configuration: listeners, dependencies and routes, from a TOML file or from the
//! quick-start flags, validated once into the same types.
//!
//! Rooms: [`model`] (the values and their defaults), `file` (the file's shape, read by
//! `stormguard-config`, the reader every stormguard TOML format shares), [`validate`] (the
//! rules, as typed [`RuleError`]s at a key path), `view` (`/config`'s JSON), `tower` (the
//! in-process dependency each is built into) and `overrides` (flags kept over reloads).
//!
//! A mistake in a file is reported as `file:line:column: key.path: reason` (the key as
//! `dependency[0].cap`, indices from 0), so `stormguard check-config` can point at it before
//! anything starts.
//!
//! ```
//! use stormguard_proxy::config::{ProxyConfig, RuleError};
//!
//! let config = ProxyConfig::parse(r#"
//! [[listener]]
//! listen = "127.0.0.1:8080"
//! dependency = "payments"
//!
//! [[dependency]]
//! name = "payments"
//! upstreams = ["http://127.0.0.1:9000"]
//! cap = 20
//! budget = "ratio:percent=0.25,min_per_sec=3"
//! per_try_timeout = "300ms"
//! "#, "stormguard.toml").unwrap();
//! assert_eq!(config.dependencies[0].cap, 20);
//!
//! let err = ProxyConfig::parse("[[dependency]]\nname = \"x\"\nupstreams = [\"http://127.0.0.1:1\"]\ncap = 0\n", "s.toml")
//!     .unwrap_err();
//! assert_eq!(err.to_string(), "s.toml:4:7: dependency[0].cap: cap must be between 1 and 16777216, got 0");
//! assert!(matches!(err.rule::<RuleError>(), Some(RuleError::Core(_))));
//! ```

// A broken rule is found once per load or reload, never on a request's path: its error is
// returned by value, whatever its size.
#![allow(clippy::result_large_err)]

mod file;
pub mod model;
mod overrides;
mod tower;
pub mod validate;
mod view;

use std::path::Path;

pub use crate::upstream::{PemProblem, TlsError};
pub use model::*;
pub use overrides::Overrides;
pub use stormguard_config::{Document, FileError as ConfigError, Invalid, KeyPath, Segment};
pub use validate::{RuleError, RuleViolation};

impl ProxyConfig {
    /// Reads and checks a config file (a regular file of at most 16 MiB), TLS files read.
    pub fn load(path: &Path) -> Result<ProxyConfig, ConfigError> {
        let mut config = stormguard_config::load(path, |doc| ProxyConfig::read(doc, true))?;
        config.source = Some(path.to_path_buf());
        Ok(config)
    }

    /// Parses and checks a config, TLS files read; `file` names it in errors.
    pub fn parse(text: &str, file: &str) -> Result<ProxyConfig, ConfigError> {
        ProxyConfig::read(&Document::parse(text, file)?, true)
    }

    /// The config a parsed document describes, every rule checked; the TLS files it names are
    /// read only with `files` (`stormguard audit` reads a config on a machine that need not
    /// have them).
    pub fn read(doc: &Document<'_>, files: bool) -> Result<ProxyConfig, ConfigError> {
        let config =
            doc.deserialize::<file::ProxyFile>()?.into_model().map_err(|e| doc.invalid(e))?;
        config.validate().map_err(|e| doc.invalid(e))?;
        if files {
            config.check_files().map_err(|e| doc.invalid(e))?;
        }
        Ok(config)
    }
}

#[cfg(test)]
mod tests;
