//! The proxy's configuration: listeners, dependencies and routes, from a TOML file or from the
//! quick-start flags, validated once into the same types.
//!
//! Rooms: [`model`] (the values and their defaults), `file` (the file's shape, read by
//! `stormguard-config`, the reader every stormguard TOML format shares), [`validate`] (the
//! rules, as typed [`RuleError`]s at a key path), `view` (`/config`'s JSON) and `overrides`
//! (flags kept over reloads). The in-process dependency each is built into is the proxy's
//! (`stormguard_proxy::config::ToTower`).
//!
//! No runtime, no network, no TLS library: the proxy, `stormguard check-config` and
//! `stormguard audit` read a file with the same code. The default feature `files` reads the
//! TLS files a config names (rustls), as loading it for the proxy does ([`ProxyConfig::load`],
//! [`ProxyConfig::parse`]); without it (audit) only the text's own rules are checked
//! ([`ProxyConfig::read`]).
//!
//! A mistake in a file is reported as `file:line:column: key.path: reason` (the key as
//! `dependency[0].cap`, indices from 0), so `stormguard check-config` can point at it before
//! anything starts.
//!
//! ```
//! use stormguard_proxy_config::{ProxyConfig, RuleError};
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
// `/config`'s JSON is one `json!` of every key.
#![recursion_limit = "256"]
#![warn(missing_docs)]

mod file;
pub mod model;
mod overrides;
pub mod validate;
mod view;

pub use model::*;
pub use overrides::Overrides;
pub use stormguard_config::{Document, FileError as ConfigError, Invalid, KeyPath, Segment};
pub use stormguard_tls::{PemProblem, TlsError};
pub use validate::{RuleError, RuleViolation};

impl ProxyConfig {
    /// Reads and checks a config file (a regular file of at most 16 MiB), TLS files read.
    #[cfg(feature = "files")]
    pub fn load(path: &std::path::Path) -> Result<ProxyConfig, ConfigError> {
        let mut config = stormguard_config::load(path, ProxyConfig::read_with_files)?;
        config.source = Some(path.to_path_buf());
        Ok(config)
    }

    /// Parses and checks a config, TLS files read; `file` names it in errors.
    #[cfg(feature = "files")]
    pub fn parse(text: &str, file: &str) -> Result<ProxyConfig, ConfigError> {
        ProxyConfig::read_with_files(&Document::parse(text, file)?)
    }

    /// The config a parsed document describes, every rule of its text checked; the TLS files
    /// it names are not read (`stormguard audit` reads a config on a machine that need not
    /// have them).
    pub fn read(doc: &Document<'_>) -> Result<ProxyConfig, ConfigError> {
        let config =
            doc.deserialize::<file::ProxyFile>()?.into_model().map_err(|e| doc.invalid(e))?;
        config.validate().map_err(|e| doc.invalid(e))?;
        Ok(config)
    }

    /// [`read`](Self::read), then the TLS files read.
    #[cfg(feature = "files")]
    fn read_with_files(doc: &Document<'_>) -> Result<ProxyConfig, ConfigError> {
        let config = ProxyConfig::read(doc)?;
        config.check_files().map_err(|e| doc.invalid(e))?;
        Ok(config)
    }
}

#[cfg(all(test, feature = "files"))]
mod tests;
