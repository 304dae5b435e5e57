//! Settings given as flags beside a config file, kept over every reload from it.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use super::{AdminToken, ProxyConfig};

/// Settings given as flags beside a config file (`stormguard proxy --config FILE --record
/// incident.jsonl`), applied over what the file says when the proxy starts **and again at every
/// reload from the file**, so SIGHUP or `POST /reload` reads the file and keeps them. They are
/// the process's own settings, as an Envoy or HAProxy command line sets them; a dependency's
/// settings (cap, budget, retries) live only in the file. `/config` shows them under
/// `overrides`. (The proxy handle's `reload` takes the config it is
/// given as it is.)
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Overrides {
    /// `--admin`: the admin listener's address (`Some(None)`: `--admin off`).
    pub admin: Option<Option<SocketAddr>>,
    /// `--record`: the trace file.
    pub record: Option<PathBuf>,
    /// `--drain-timeout`.
    pub drain_timeout: Option<Duration>,
    /// `--shadow`: every dependency in shadow mode (`enforce = false`), whatever the file says.
    pub shadow: bool,
    /// `--header-read-timeout`: [`ConnectionConfig::header_read_timeout`](super::ConnectionConfig::header_read_timeout).
    pub header_read_timeout: Option<Duration>,
    /// `--idle-timeout`: [`ConnectionConfig::idle_timeout`](super::ConnectionConfig::idle_timeout).
    pub idle_timeout: Option<Duration>,
    /// `--body-timeout`: [`ProxyConfig::body_timeout`].
    pub body_timeout: Option<Duration>,
    /// `--response-idle-timeout`: [`ProxyConfig::response_idle_timeout`].
    pub response_idle_timeout: Option<Duration>,
    /// `--max-connections`: [`ConnectionConfig::max_connections`](super::ConnectionConfig::max_connections).
    pub max_connections: Option<usize>,
    /// `--admin-allow-remote`: [`AdminAccessConfig::allow_remote`](super::AdminAccessConfig::allow_remote).
    pub admin_allow_remote: bool,
    /// `--admin-token env:NAME`: [`AdminAccessConfig::token`](super::AdminAccessConfig::token).
    pub admin_token: Option<AdminToken>,
}

impl Overrides {
    /// Puts these settings over `config`'s, and remembers them in it (for the next reload).
    pub fn apply(&self, config: &mut ProxyConfig) {
        if let Some(a) = self.admin {
            config.admin = a;
        }
        if let Some(r) = &self.record {
            config.record = Some(r.clone());
        }
        if let Some(d) = self.drain_timeout {
            config.drain_timeout = d;
        }
        if self.shadow {
            for d in &mut config.dependencies {
                d.enforce = false;
            }
        }
        if let Some(t) = self.header_read_timeout {
            config.connections.header_read_timeout = t;
        }
        if let Some(t) = self.idle_timeout {
            config.connections.idle_timeout = t;
        }
        if let Some(t) = self.body_timeout {
            config.body_timeout = t;
        }
        if let Some(t) = self.response_idle_timeout {
            config.response_idle_timeout = t;
        }
        if let Some(n) = self.max_connections {
            config.connections.max_connections = Some(n);
        }
        if self.admin_allow_remote {
            config.admin_access.allow_remote = true;
        }
        if let Some(t) = &self.admin_token {
            config.admin_access.token = Some(t.clone());
        }
        config.overrides = self.clone();
    }
}
