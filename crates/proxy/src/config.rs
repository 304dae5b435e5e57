//! The proxy's configuration: listeners, dependencies and routes, from a TOML file or from the
//! quick-start flags, validated once into the same types.
//!
//! A mistake in a file is reported as `file:line:column: key: reason` (the key as
//! `dependency[0].cap`), so `stormguard check-config` can point at it before anything starts.
//!
//! ```
//! use stormguard_proxy::config::ProxyConfig;
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
//! ```

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::time::Duration;

use http::{HeaderName, Uri};
use serde::Deserialize;
use stormguard_core::backoff::BackoffConfig;
use stormguard_core::breaker::BreakerConfig;
use stormguard_core::budget::BudgetSpec;
use stormguard_core::conditions::RetryOn;
use stormguard_core::decimal::parse_duration;
use stormguard_core::decision::MAX_RETRIES_LIMIT;
use stormguard_core::defaults;
use stormguard_core::limiter::{LimiterConfig, MAX_CAP};
use toml::Spanned;

/// The admin listener's default address: loopback only.
pub const DEFAULT_ADMIN: &str = "127.0.0.1:9901";
/// Trace ids remembered for fan-out scopes, at most. Default 65 536.
pub const DEFAULT_SCOPE_MAX: usize = defaults::SCOPE_MAX;
/// How long a drain waits for requests in flight by default.
pub const DEFAULT_DRAIN_TIMEOUT: Duration = Duration::from_secs(10);
/// The default `body_idle_timeout`: 10 s.
pub const DEFAULT_BODY_IDLE_TIMEOUT: Duration = Duration::from_secs(10);
/// Distinct `client` label values by default.
pub const DEFAULT_CLIENT_MAX: usize = 32;
/// The default `header_read_timeout`: 10 s.
pub const DEFAULT_HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);
/// The default `idle_timeout`: 60 s.
pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(60);
/// The default `admin_max_connections`: 64.
pub const DEFAULT_ADMIN_MAX_CONNECTIONS: usize = 64;
/// The default `max_header_bytes`: 64 KiB.
pub const DEFAULT_MAX_HEADER_BYTES: usize = 64 * 1024;
/// The default `http2_max_concurrent_streams`: 200 (hyper's).
pub const DEFAULT_HTTP2_MAX_CONCURRENT_STREAMS: u32 = 200;
/// The default `http2_keepalive_interval`: 30 s.
pub const DEFAULT_HTTP2_KEEPALIVE_INTERVAL: Duration = Duration::from_secs(30);

/// Everything the proxy runs.
#[derive(Debug, Clone, PartialEq)]
pub struct ProxyConfig {
    /// Where callers connect. At least one.
    pub listeners: Vec<ListenerConfig>,
    /// The dependencies behind the proxy. At least one; names are unique.
    pub dependencies: Vec<DependencyConfig>,
    /// Host and path prefix → dependency, checked before a listener's default dependency.
    pub routes: Vec<RouteConfig>,
    /// The admin listener (`/metrics`, `/healthz`, ...). Default `127.0.0.1:9901`; `None`
    /// turns it off.
    pub admin: Option<SocketAddr>,
    /// Write each dependency's traffic as `replay` JSON lines to this file.
    pub record: Option<PathBuf>,
    /// Trace ids remembered for fan-out scopes (LRU, 10 s idle). Default 65 536.
    pub scope_max: usize,
    /// The request header that names the caller for the `client` label of the per-route
    /// series (e.g. `x-client-id`). Default none: the caller's IP address.
    pub client_header: Option<HeaderName>,
    /// Distinct `client` label values, at most; later callers are counted as `other`.
    /// Default 32.
    pub client_max: usize,
    /// On SIGTERM (or [`ProxyHandle::drain`](crate::ProxyHandle::drain)): how long requests in
    /// flight may take to finish before their connections are closed. Default 10 s.
    pub drain_timeout: Duration,
    /// The longest a caller may go without sending request body bytes: past it the request is
    /// answered `408`, and an attempt already holding a slot is cut and its slot comes back.
    /// A body up to the replay buffer is received whole before its attempt asks for a slot.
    /// Default 10 s.
    pub body_idle_timeout: Duration,
    /// How every listener, the admin listener included, treats its connections: header read
    /// and idle timeouts, connection limits, header size, HTTP/2 streams. Fixed for the
    /// proxy's life (a reload that changes it is refused).
    pub connections: ConnectionConfig,
    /// Who may change state through the admin listener (`admin_allow_remote`,
    /// `admin_token`). Fixed for the proxy's life.
    pub admin_access: AdminAccessConfig,
    /// The file this config was read from (set by [`ProxyConfig::load`]): `POST /reload` and
    /// SIGHUP read it again.
    pub source: Option<PathBuf>,
    /// What the command line set over the file (see [`Overrides`]); a reload from the file
    /// applies them again.
    pub overrides: Overrides,
}

/// Settings given as flags beside a config file (`stormguard proxy --config FILE --record
/// incident.jsonl`), applied over what the file says when the proxy starts **and again at every
/// reload from the file**, so SIGHUP or `POST /reload` reads the file and keeps them. They are
/// the process's own settings, as an Envoy or HAProxy command line sets them; a dependency's
/// settings (cap, budget, retries) live only in the file. `/config` shows them under
/// `overrides`. ([`ProxyHandle::reload`](crate::ProxyHandle::reload) takes the config it is
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
    /// `--header-read-timeout`: [`ConnectionConfig::header_read_timeout`].
    pub header_read_timeout: Option<Duration>,
    /// `--idle-timeout`: [`ConnectionConfig::idle_timeout`].
    pub idle_timeout: Option<Duration>,
    /// `--max-connections`: [`ConnectionConfig::max_connections`].
    pub max_connections: Option<usize>,
    /// `--admin-allow-remote`: [`AdminAccessConfig::allow_remote`].
    pub admin_allow_remote: bool,
    /// `--admin-token env:NAME`: [`AdminAccessConfig::token`].
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

    /// As `/config` shows them: only what was set, in the flags' terms.
    pub fn to_json(&self) -> serde_json::Value {
        let mut m = serde_json::Map::new();
        if let Some(a) = self.admin {
            m.insert("admin".into(), a.map_or_else(|| "off".into(), |a| a.to_string()).into());
        }
        if let Some(r) = &self.record {
            m.insert("record".into(), r.display().to_string().into());
        }
        if let Some(d) = self.drain_timeout {
            m.insert("drain_timeout".into(), format!("{}ms", d.as_millis()).into());
        }
        if self.shadow {
            m.insert("shadow".into(), true.into());
        }
        for (key, t) in
            [("header_read_timeout", self.header_read_timeout), ("idle_timeout", self.idle_timeout)]
        {
            if let Some(t) = t {
                m.insert(key.into(), format!("{}ms", t.as_millis()).into());
            }
        }
        if let Some(n) = self.max_connections {
            m.insert("max_connections".into(), n.into());
        }
        if self.admin_allow_remote {
            m.insert("admin_allow_remote".into(), true.into());
        }
        if let Some(t) = &self.admin_token {
            m.insert("admin_token".into(), t.shown().into());
        }
        serde_json::Value::Object(m)
    }
}

/// One listening socket.
#[derive(Debug, Clone, PartialEq)]
pub struct ListenerConfig {
    /// The address (`127.0.0.1:8080`; port 0 picks a free one).
    pub listen: SocketAddr,
    /// Requests no route matches go to this dependency; without it they get 404.
    pub dependency: Option<String>,
}

/// How the listeners treat connections (see docs/proxy.md, "Limits and timeouts"). Every
/// caller listener and the admin listener apply it; what a connection costs the proxy is a
/// descriptor and memory whatever it sends, so nothing here waits on a caller without end.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConnectionConfig {
    /// `header_read_timeout`: a new connection must send a whole request head within it, and
    /// on a kept-alive HTTP/1.1 connection it runs from the first byte of the next request;
    /// a request trickled a byte at a time does not extend it. Past it the connection is
    /// closed. More than 0. Default 10 s.
    pub header_read_timeout: Duration,
    /// `idle_timeout`: an HTTP/1.1 connection between requests, or an HTTP/2 connection with
    /// no stream open (the preface alone included), is closed after this long (HTTP/2 gets a
    /// GOAWAY first). More than 0. Default 60 s.
    pub idle_timeout: Duration,
    /// `max_connections`: connections each caller listener holds at once; past it a new one
    /// is closed at once and counted. `None` (the default): sized at start from the
    /// open-files limit, keeping a reserve for the admin listener, the upstream connections
    /// and files. At least 1.
    pub max_connections: Option<usize>,
    /// `admin_max_connections`: connections the admin listener holds at once, `1..=65536`.
    /// Default 64.
    pub admin_max_connections: usize,
    /// `max_header_bytes`: a request head (HTTP/1.1: request line and headers, answered 431
    /// past it) or header list (HTTP/2: `SETTINGS_MAX_HEADER_LIST_SIZE`), at most,
    /// `8192..=1048576`. Default 64 KiB.
    pub max_header_bytes: usize,
    /// `http2_max_concurrent_streams`: streams one HTTP/2 caller connection may have open,
    /// `1..=2147483647`. Default 200.
    pub http2_max_concurrent_streams: u32,
    /// `http2_keepalive_interval`: an HTTP/2 caller connection is sent a PING this often; one
    /// not answered within another interval means the peer is gone, and the connection is
    /// closed with its streams. More than 0. Default 30 s.
    pub http2_keepalive_interval: Duration,
}

impl Default for ConnectionConfig {
    fn default() -> ConnectionConfig {
        ConnectionConfig {
            header_read_timeout: DEFAULT_HEADER_READ_TIMEOUT,
            idle_timeout: DEFAULT_IDLE_TIMEOUT,
            max_connections: None,
            admin_max_connections: DEFAULT_ADMIN_MAX_CONNECTIONS,
            max_header_bytes: DEFAULT_MAX_HEADER_BYTES,
            http2_max_concurrent_streams: DEFAULT_HTTP2_MAX_CONCURRENT_STREAMS,
            http2_keepalive_interval: DEFAULT_HTTP2_KEEPALIVE_INTERVAL,
        }
    }
}

impl ConnectionConfig {
    /// Checks every rule; the error names the key.
    pub fn validate(&self) -> Result<(), (&'static str, String)> {
        for (key, d) in [
            ("header_read_timeout", self.header_read_timeout),
            ("idle_timeout", self.idle_timeout),
            ("http2_keepalive_interval", self.http2_keepalive_interval),
        ] {
            if d.is_zero() {
                return Err((key, "must be more than 0".into()));
            }
        }
        if let Some(m) = self.max_connections
            && !(1..=16 * 1024 * 1024).contains(&m)
        {
            return Err(("max_connections", format!("must be between 1 and 16777216, got {m}")));
        }
        if !(1..=65_536).contains(&self.admin_max_connections) {
            return Err((
                "admin_max_connections",
                format!("must be between 1 and 65536, got {}", self.admin_max_connections),
            ));
        }
        // hyper's HTTP/1.1 read buffer (which bounds the head) is at least 8 KiB.
        if !(8192..=1024 * 1024).contains(&self.max_header_bytes) {
            return Err((
                "max_header_bytes",
                format!("must be between 8192 and 1048576, got {}", self.max_header_bytes),
            ));
        }
        if !(1..=i32::MAX as u32).contains(&self.http2_max_concurrent_streams) {
            return Err((
                "http2_max_concurrent_streams",
                format!(
                    "must be between 1 and 2147483647, got {}",
                    self.http2_max_concurrent_streams
                ),
            ));
        }
        Ok(())
    }
}

/// Who may change state (the kill switch, shadow mode, reload) through the admin listener.
/// Reading (`/metrics`, `/stats.json`, `/config`, the dashboard) is open to whoever reaches
/// it. See docs/proxy.md, "Security".
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AdminAccessConfig {
    /// `admin_allow_remote`: the admin address may be other than loopback (it is then
    /// reachable from other hosts, and logged at warn). Without it such an address is a
    /// config error. Default false.
    pub allow_remote: bool,
    /// `admin_token`: state changes need `Authorization: Bearer <token>` (compared in constant
    /// time), and then any `Host` and `Origin` will do. Without it they need a `Host` that is
    /// the admin address and no foreign `Origin`. Default none.
    pub token: Option<AdminToken>,
}

/// Where the admin token is. A config file can only name an environment variable, so the token
/// is never in the file, in `/config` or in the logs.
#[derive(Clone, PartialEq, Eq)]
pub enum AdminToken {
    /// `admin_token = "env:NAME"`: read from the environment variable `NAME` at start.
    Env(String),
    /// A token given in code (tests, embedding).
    Value(String),
}

impl std::fmt::Debug for AdminToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            AdminToken::Env(name) => write!(f, "Env({name:?})"),
            AdminToken::Value(_) => f.write_str("Value([redacted])"),
        }
    }
}

/// Why the admin token cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum AdminTokenError {
    /// The environment variable that should hold it is not set.
    #[error("the environment variable {0} is not set: it holds the admin token")]
    Unset(String),
    /// Shorter than [`AdminToken::MIN_LEN`].
    #[error("the admin token must be at least 16 bytes (e.g. `openssl rand -hex 16`)")]
    TooShort,
}

impl AdminToken {
    /// The shortest token accepted, in bytes.
    pub const MIN_LEN: usize = 16;

    /// The token itself; an unset variable or a token shorter than 16 bytes is refused.
    pub fn resolve(&self) -> Result<String, AdminTokenError> {
        let token = match self {
            AdminToken::Value(t) => t.clone(),
            AdminToken::Env(name) => {
                std::env::var(name).map_err(|_| AdminTokenError::Unset(name.clone()))?
            }
        };
        if token.len() < AdminToken::MIN_LEN {
            return Err(AdminTokenError::TooShort);
        }
        Ok(token)
    }

    /// How `/config` shows it: the variable's name, never the token.
    fn shown(&self) -> String {
        match self {
            AdminToken::Env(name) => format!("env:{name}"),
            AdminToken::Value(_) => "[redacted]".into(),
        }
    }
}

/// One dependency: its upstream, cap, queue, budget and retry rules.
#[derive(Debug, Clone, PartialEq)]
pub struct DependencyConfig {
    /// The name, unique: the `dependency` label of every metric.
    pub name: String,
    /// The upstreams, `http://host:port` or `https://host:port`. Exactly one for now (several
    /// come with load balancing).
    pub upstreams: Vec<Uri>,
    /// Attempts in flight at once, first tries and retries, `1..=16777216`. Default 20.
    pub cap: u64,
    /// Primaries that may wait for a slot; 0 fails fast. Default 100.
    pub queue: u64,
    /// The longest a primary waits for a slot. Default 1 s.
    pub queue_timeout: Duration,
    /// The retry budget. Default `ratio:percent=0.2,min_per_sec=10,ttl=10s`.
    pub budget: BudgetSpec,
    /// What may be retried. Default `5xx,reset,connect-failure,refused-stream,timeout`: a
    /// timeout, a reset or a 5xx only for an idempotent request (a POST is refused as
    /// `non-idempotent`), a connect failure or refused stream for any.
    pub retry_on: RetryOn,
    /// Retries per request, 0 to 10. Default 2.
    pub max_retries: u32,
    /// Each attempt's limit up to response headers, connect time included. Default none.
    pub per_try_timeout: Option<Duration>,
    /// The whole request's limit (queue wait, attempts, backoffs). Default none.
    pub deadline: Option<Duration>,
    /// Backoff between attempts. Default `25ms..250ms`, full jitter.
    pub backoff: BackoffConfig,
    /// `false` is shadow mode: count what would be denied, deny nothing. Default true.
    pub enforce: bool,
    /// The circuit breaker, if any. Default none.
    pub breaker: Option<BreakerConfig>,
    /// Whole retries one trace (one user action's fan-out) may spend across all its calls.
    /// Default 1; 0 turns fan-out scopes off.
    pub scope_retries: u64,
    /// The header that keys the fan-out scope: `traceparent` (its trace id) by default; any
    /// other header is used whole.
    pub scope_header: HeaderName,
    /// How long an attempt the proxy timed out (per-try timeout or deadline) keeps its slot
    /// while the upstream may still be working on it: the call runs on and the slot comes back
    /// when the upstream answers, or at this bound, when the call is cut. Never shortened to
    /// what was left of the deadline. 0 turns the hold off (the slot comes back at the timeout,
    /// and the upstream may see more than the cap). Default 30 s.
    pub timeout_slot_hold: Duration,
    /// How long an attempt whose caller went away (closed its connection while the attempt was
    /// at the upstream) keeps its slot: the proxy reads the upstream's answer and discards it,
    /// and the slot comes back then, or at this bound, when the call is cut. 0 turns the hold
    /// off. Default 30 s.
    pub abandon_hold: Duration,
    /// Request bodies are copied for retries up to this many bytes. Default 64 KiB.
    pub body_limit: usize,
    /// The headers that state the upstream's own limits (concurrency limit, remaining,
    /// reset), read per upstream. Default: `x-concurrency-limit-limit`; `x-concurrency-limit-
    /// remaining`, `ratelimit-remaining`, `x-ratelimit-remaining`; `x-ratelimit-reset`,
    /// `ratelimit-reset`.
    pub limit_headers: stormguard_http::headers::LimitHeadersConfig,
    /// A stated `remaining` at or below this holds retries to that upstream until its reset,
    /// before any 429 arrives. Default 0.
    pub remaining_reserve: u64,
    /// Per upstream, in the order of `upstreams`: its own cap (its provider's limit); `None`
    /// or missing: the dependency's `cap`. Only with several upstreams.
    pub upstream_caps: Vec<Option<u64>>,
    /// With several upstreams: attempts in flight across all of them, at most (`total_cap`).
    /// Default none: the sum of the upstreams' caps.
    pub total_cap: Option<u64>,
    /// The primary (first-try) concurrency the cap was planned for, at most the cap: not used
    /// by the proxy, read by `stormguard audit` (a floor above `cap − planned_primary` is a
    /// finding) and written by `stormguard plan --format toml`. Default none.
    pub planned_primary: Option<u64>,
    /// `placement = "fleet"`: the cap and the budget's reserve are shared by every instance
    /// through Redis (see [`FleetPlacement`]). Default none: `placement = "local"`.
    pub fleet: Option<FleetPlacement>,
    /// TLS to its `https://` upstreams (`[dependency.tls]`).
    pub tls: TlsConfig,
    /// HTTP/2 to its upstreams (`http2`, `max_concurrent_streams`).
    pub http2: Http2Config,
}

/// Where the fleet's Redis is. A config file can only name an environment variable, so the URL
/// and its password are never in the file, in `/config` or in the logs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RedisSource {
    /// `redis = "env:NAME"`: the URL (`redis://[[user]:password@]host[:port][/db]`) is read
    /// from the environment variable `NAME` when the proxy starts.
    Env(String),
    /// A target given in code (tests, embedding).
    Target(stormguard_redis::RedisTarget),
}

impl RedisSource {
    /// The Redis target, as the proxy reads it when it starts: the environment variable's URL
    /// parsed (the error never repeats the URL: it may hold the password).
    pub fn target(&self) -> Result<stormguard_redis::RedisTarget, RedisSourceError> {
        match self {
            RedisSource::Target(t) => Ok(t.clone()),
            RedisSource::Env(name) => {
                let url = std::env::var(name)
                    .map_err(|_| RedisSourceError::NotSet { name: name.clone() })?;
                url.parse()
                    .map_err(|reason| RedisSourceError::Invalid { name: name.clone(), reason })
            }
        }
    }
}

/// Why a fleet dependency's Redis URL cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RedisSourceError {
    /// The environment variable is not set (or not Unicode).
    #[error(
        "the environment variable {name} is not set: it holds the Redis URL, redis://[[user]:password@]host[:port][/db]"
    )]
    NotSet {
        /// The variable.
        name: String,
    },
    /// Its value is not a Redis URL.
    #[error("${name}: {reason}")]
    Invalid {
        /// The variable.
        name: String,
        /// Why (never the URL itself).
        reason: stormguard_redis::BadRedisUrl,
    },
}

/// The fleet placement of a dependency: `placement = "fleet"` and these keys.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FleetPlacement {
    /// `redis`: where Redis is. Default `env:STORMGUARD_REDIS_URL`.
    pub redis: RedisSource,
    /// `fleet_cap`: attempts in flight across every instance. Default: `cap`.
    pub fleet_cap: Option<u64>,
    /// `max_instances`: the most instances at the fleet's peak (required, `≥ 1`); the fallback
    /// share is `floor(fleet_cap / max_instances)`.
    pub max_instances: u64,
    /// `lease_ttl`: how long a grant is valid, 300 ms to 60 s. Default 2 s.
    pub lease_ttl: Duration,
    /// `interval`: how often the lease is renewed, at most `lease_ttl / 3`. Default 200 ms.
    pub interval: Duration,
    /// `fallback_min`: slots an instance uses without Redis when the share rounds below it.
    /// Default none: 0, and a share `floor(fleet_cap / max_instances)` of 0 is refused (without
    /// Redis no instance would admit anything). `Some(0)` accepts that on purpose (the cap wins);
    /// `Some(n)` keeps n slots per instance, overcommitting the fleet cap by up to
    /// `n × max_instances − fleet_cap` (exported).
    pub fallback_min: Option<u64>,
    /// `instance`: this instance's id in the fleet. Default: `$HOSTNAME`, the pid, a nonce.
    pub instance: Option<String>,
}

impl FleetPlacement {
    /// A placement on the Redis named by `$STORMGUARD_REDIS_URL`, for `max_instances`.
    pub fn new(max_instances: u64) -> FleetPlacement {
        FleetPlacement {
            redis: RedisSource::Env("STORMGUARD_REDIS_URL".into()),
            fleet_cap: None,
            max_instances,
            lease_ttl: Duration::from_secs(2),
            interval: Duration::from_millis(200),
            fallback_min: None,
            instance: None,
        }
    }

    /// The fleet layer's config for `dependency` on `redis`.
    pub fn to_fleet(
        &self,
        dependency: &DependencyConfig,
        redis: stormguard_redis::RedisTarget,
    ) -> stormguard_redis::FleetConfig {
        let mut c = stormguard_redis::FleetConfig::new(
            dependency.name.clone(),
            self.instance.clone().unwrap_or_else(stormguard_redis::default_instance_id),
            redis,
            self.fleet_cap.unwrap_or(dependency.cap),
            self.max_instances,
        )
        .with_timing(self.lease_ttl, self.interval);
        c.fallback_min = self.fallback_min.unwrap_or(0);
        c
    }

    /// Checks every rule; the error names the key.
    fn validate(&self, d: &DependencyConfig) -> Result<(), (&'static str, String)> {
        if self.max_instances == 0 {
            return Err(("max_instances", "placement = \"fleet\" needs max_instances (the most instances at the fleet's peak), at least 1".into()));
        }
        // The URL, when it is set here, is parsed as the proxy will parse it at start; one that
        // is not set is the proxy's to refuse (check-config notes it).
        if let Err(e @ RedisSourceError::Invalid { .. }) = self.redis.target() {
            return Err(("redis", e.to_string()));
        }
        let target = stormguard_redis::RedisTarget {
            host: "check".into(),
            port: 6379,
            user: None,
            password: None,
            db: 0,
        };
        let c = self.to_fleet(d, target);
        // The dependency's key for the field the fleet names; the margin and the call timeout
        // follow from lease_ttl.
        let key = |e: &stormguard_redis::FleetError| match e.key() {
            "dependency" => "name",
            "margin" | "call_timeout" => "lease_ttl",
            other => other,
        };
        c.validate().map_err(|e| (key(&e), e.to_string()))?;
        if self.fallback_min.is_none() && c.fallback_slots() == 0 {
            let (cap, n) = (c.fleet_cap, c.max_instances);
            let fleet_cap =
                if self.fleet_cap.is_some() { "fleet_cap" } else { "fleet_cap (default: cap)" };
            return Err((
                "max_instances",
                format!(
                    "the fallback share floor({fleet_cap} / max_instances) = floor({cap} / {n}) is 0: \
                     without Redis no instance would admit anything. Set fleet_cap to the whole \
                     fleet's cap (at least {n}), lower max_instances to at most {cap}, or set \
                     fallback_min (the slots each instance keeps without Redis, overcommitting the \
                     fleet cap; fallback_min = 0 admits nothing without Redis on purpose)"
                ),
            ));
        }
        let fleet =
            stormguard_redis::Fleet::try_new(c).map_err(|r| ("placement", r.to_string()))?;
        fleet.budget(&d.budget).map_err(|e| (key(&e), e.to_string()))?;
        Ok(())
    }
}

/// TLS to a dependency's `https://` upstreams. The files are PEM, read when the config is
/// checked (a missing or invalid one is a config error); relative paths are from the current
/// directory.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TlsConfig {
    /// The CA certificates the upstream's chain must lead to, instead of the operating
    /// system's roots. Default none: the system roots.
    pub ca_file: Option<PathBuf>,
    /// A client certificate chain to present (with `client_key`). Default none.
    pub client_cert: Option<PathBuf>,
    /// The client certificate's private key (PKCS#8, PKCS#1 or SEC1). Default none.
    pub client_key: Option<PathBuf>,
}

impl TlsConfig {
    /// Whether anything is configured.
    pub fn is_set(&self) -> bool {
        self.ca_file.is_some() || self.client_cert.is_some() || self.client_key.is_some()
    }
}

/// HTTP/2 to a dependency's upstreams. `https://` upstreams negotiate HTTP/2 by ALPN whatever
/// this says.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Http2Config {
    /// HTTP/2 only, by prior knowledge (`http2 = true`): h2c for plaintext gRPC upstreams; on
    /// `https://`, ALPN offers only `h2`. Default false.
    pub prior_knowledge: bool,
    /// The upstream's `SETTINGS_MAX_CONCURRENT_STREAMS`, when known in advance,
    /// `1..=2147483647`: the cap in force is at most this (× 1 connection) from the first
    /// request, before any SETTINGS arrive. Without it, the value the upstream sends lowers
    /// the cap from the first connection on. It bounds the cap whatever protocol the
    /// connection turns out to speak: set it for HTTP/2 upstreams only. Default none.
    pub max_concurrent_streams: Option<u32>,
}

impl DependencyConfig {
    /// A dependency named `name` in front of `upstream`, with every default.
    pub fn new(name: impl Into<String>, upstream: Uri) -> DependencyConfig {
        DependencyConfig {
            name: name.into(),
            upstreams: vec![upstream],
            upstream_caps: Vec::new(),
            total_cap: None,
            limit_headers: stormguard_http::headers::LimitHeadersConfig::default(),
            remaining_reserve: 0,
            cap: defaults::CAP,
            queue: defaults::QUEUE_LEN,
            queue_timeout: defaults::QUEUE_TIMEOUT,
            budget: BudgetSpec::default(),
            retry_on: RetryOn::default(),
            max_retries: defaults::MAX_RETRIES,
            per_try_timeout: None,
            deadline: None,
            backoff: BackoffConfig::default(),
            enforce: defaults::ENFORCE,
            breaker: None,
            scope_retries: defaults::SCOPE_RETRIES,
            scope_header: HeaderName::from_static("traceparent"),
            timeout_slot_hold: defaults::TIMEOUT_SLOT_HOLD,
            abandon_hold: defaults::ABANDON_HOLD,
            body_limit: defaults::BODY_LIMIT,
            planned_primary: None,
            fleet: None,
            tls: TlsConfig::default(),
            http2: Http2Config::default(),
        }
    }

    /// The tower dependency this describes.
    pub fn to_tower(&self) -> stormguard_tower::DependencyConfig {
        let mut c = stormguard_tower::DependencyConfig::new(self.name.clone());
        c.limiter = LimiterConfig {
            cap: self.upstream_cap(0),
            queue_len: self.queue,
            queue_timeout: self.queue_timeout,
        };
        c.budget = self.budget;
        c.retry.retry_on = self.retry_on.clone();
        c.retry.max_retries = self.max_retries;
        c.retry.backoff = self.backoff;
        c.retry.enforce = self.enforce;
        c.breaker = self.breaker;
        c.per_try_timeout = self.per_try_timeout;
        c.deadline = self.deadline;
        c.timeout_slot_hold = self.timeout_slot_hold;
        c.abandon_hold = self.abandon_hold;
        c.body_limit = self.body_limit;
        // The proxy owns its runtime: a timed-out or abandoned attempt runs on to its answer in
        // a task, so its held slot comes back when the upstream really finishes.
        c.background = Some(stormguard_tower::Spawner::tokio());
        if let Ok(h) = stormguard_http::headers::LimitHeaders::try_new(self.limit_headers.clone()) {
            c.limit_headers = h;
        }
        c.remaining_reserve = self.remaining_reserve;
        c.total_cap = self.total_cap;
        if self.upstreams.len() > 1 {
            c.upstreams = self
                .upstreams
                .iter()
                .enumerate()
                .map(|(i, u)| stormguard_tower::UpstreamSpec {
                    name: upstream_label(u),
                    cap: self.upstream_cap(i),
                })
                .collect();
        }
        c
    }

    /// The cap upstream `i`'s limiter is built with: its own cap (or the dependency's), at
    /// most `max_concurrent_streams` (one HTTP/2 connection per upstream).
    pub fn upstream_cap(&self, i: usize) -> u64 {
        let cap = self.upstream_caps.get(i).copied().flatten().unwrap_or(self.cap);
        self.http2.max_concurrent_streams.map_or(cap, |m| cap.min(u64::from(m)))
    }

    /// The largest of the upstreams' caps: the connection pool's size.
    pub fn largest_upstream_cap(&self) -> u64 {
        (0..self.upstreams.len()).map(|i| self.upstream_cap(i)).max().unwrap_or(self.cap)
    }

    /// Checks every rule; the error names the key (`cap`, `budget`, ...) and why.
    pub fn validate(&self) -> Result<(), (&'static str, String)> {
        if self.name.is_empty()
            || !self.name.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
        {
            return Err((
                "name",
                format!("a name is letters, digits, '-', '_' or '.', got {:?}", self.name),
            ));
        }
        if self.upstreams.is_empty() {
            return Err(("upstreams", "a dependency needs an upstream".into()));
        }
        for (i, u) in self.upstreams.iter().enumerate() {
            check_upstream(u).map_err(|r| ("upstreams", r))?;
            if self.upstreams[..i].iter().any(|o| upstream_label(o) == upstream_label(u)) {
                return Err(("upstreams", format!("{u} is listed twice")));
            }
        }
        stormguard_http::headers::LimitHeaders::try_new(self.limit_headers.clone())
            .map_err(|e| ("limit_headers", e.to_string()))?;
        if self.fleet.is_some() && self.upstreams.len() > 1 {
            return Err((
                "placement",
                "a fleet dependency has one upstream (its lease is that upstream's cap)".into(),
            ));
        }
        if let Some(t) = self.total_cap {
            if self.upstreams.len() < 2 {
                return Err(("total_cap", "total_cap is for several upstreams: use cap".into()));
            }
            if !(1..=MAX_CAP).contains(&t) {
                return Err(("total_cap", format!("must be between 1 and {MAX_CAP}, got {t}")));
            }
        }
        if self.upstream_caps.len() > self.upstreams.len() {
            return Err(("upstreams", "more caps than upstreams".into()));
        }
        for c in self.upstream_caps.iter().flatten() {
            if !(1..=MAX_CAP).contains(c) {
                return Err((
                    "upstreams",
                    format!("an upstream's cap must be between 1 and {MAX_CAP}, got {c}"),
                ));
            }
        }
        // The dependency's own cap and queue, by the limiter's rules, under their own keys.
        LimiterConfig { cap: self.cap, queue_len: self.queue, queue_timeout: self.queue_timeout }
            .validate()
            .map_err(limiter_error)?;
        if let Some(p) = self.planned_primary
            && p > self.cap
        {
            return Err((
                "planned_primary",
                format!(
                    "planned_primary ({p}) is above the cap ({}): no headroom for retries",
                    self.cap
                ),
            ));
        }
        // Before the limiter's own check: the stream limit bounds each upstream's cap, and a 0
        // here would be reported as a cap of 0.
        if let Some(m) = self.http2.max_concurrent_streams
            && !(1..=i32::MAX as u32).contains(&m)
        {
            return Err((
                "max_concurrent_streams",
                format!("must be between 1 and 2147483647, got {m}"),
            ));
        }
        self.to_tower().limiter.validate().map_err(limiter_error)?;
        self.budget.build().map_err(|e| ("budget", e.to_string()))?;
        if self.max_retries > MAX_RETRIES_LIMIT {
            return Err((
                "max_retries",
                format!("must be at most {MAX_RETRIES_LIMIT}, got {}", self.max_retries),
            ));
        }
        self.backoff.validate().map_err(|r| ("backoff", r.to_string()))?;
        if let Some(b) = &self.breaker {
            b.validate().map_err(|r| ("breaker", r.to_string()))?;
        }
        for (key, d) in [("per_try_timeout", self.per_try_timeout), ("deadline", self.deadline)] {
            if d == Some(Duration::ZERO) {
                return Err((key, "must be more than 0".into()));
            }
        }
        if self.body_limit > 64 * 1024 * 1024 {
            return Err(("body_limit", format!("must be at most 64 MiB, got {}", self.body_limit)));
        }
        if let Some(f) = &self.fleet {
            f.validate(self)?;
        }
        let https = self.upstreams.iter().any(|u| u.scheme_str() == Some("https"));
        if self.tls.is_set() && !https {
            return Err(("tls", "[dependency.tls] applies to https:// upstreams only".into()));
        }
        if https {
            // Read the certificates and keys now: a bad file is a config error, not a failed
            // request.
            crate::upstream::tls_config(&self.tls)?;
        }
        Ok(())
    }
}

/// An upstream's `host:port` (never credentials): its `upstream` label.
pub fn upstream_label(u: &Uri) -> String {
    let default_port = if u.scheme_str() == Some("https") { 443 } else { 80 };
    u.authority().map_or_else(String::new, |a| {
        format!("{}:{}", a.host(), a.port_u16().unwrap_or(default_port))
    })
}

/// An upstream must be `http://host:port` with no path: TLS upstreams come later.
/// An upstream must be `http://host:port` or `https://host:port` with no path.
fn check_upstream(u: &Uri) -> Result<(), String> {
    if !matches!(u.scheme_str(), Some("http" | "https")) || u.authority().is_none() {
        return Err(format!("{u}: an upstream is http://host:port or https://host:port"));
    }
    if !matches!(u.path(), "" | "/") || u.query().is_some() {
        return Err(format!("{u}: an upstream has no path"));
    }
    // `http::Uri` accepts a port it cannot use (`:99999`, `:0`) and then reports none, so the
    // upstream would be dialled on the scheme's default port, or not at all.
    let authority = u.authority().map_or("", |a| a.as_str());
    let host_port = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
    if let Some((_, port)) = host_port.rsplit_once(':').filter(|_| !host_port.ends_with(']'))
        && !port.parse::<u16>().is_ok_and(|p| p != 0)
    {
        return Err(format!("{}: the port must be between 1 and 65535, got {port:?}", redact(u)));
    }
    Ok(())
}

/// A route: requests for `host` (any host when absent) whose path starts with `path_prefix` go
/// to `dependency`. The longest matching prefix wins; a route with a host beats one without.
#[derive(Debug, Clone, PartialEq)]
pub struct RouteConfig {
    /// The `Host` (without port), matched case-insensitively; `None` matches any.
    pub host: Option<String>,
    /// The path prefix, starting with `/`. Default `/`.
    pub path_prefix: String,
    /// The dependency's name.
    pub dependency: String,
    /// The route's own budget, charged on top of the dependency's.
    pub budget: Option<BudgetSpec>,
    /// Every method on this route may be retried (gRPC: every call is a POST).
    pub idempotent: bool,
}

impl ProxyConfig {
    /// One listener in front of one dependency (the quick-start flags).
    pub fn single(listen: SocketAddr, dependency: DependencyConfig) -> ProxyConfig {
        ProxyConfig {
            listeners: vec![ListenerConfig { listen, dependency: Some(dependency.name.clone()) }],
            dependencies: vec![dependency],
            routes: Vec::new(),
            admin: Some(DEFAULT_ADMIN.parse().expect("a valid address")),
            record: None,
            scope_max: DEFAULT_SCOPE_MAX,
            client_header: None,
            client_max: DEFAULT_CLIENT_MAX,
            drain_timeout: DEFAULT_DRAIN_TIMEOUT,
            body_idle_timeout: DEFAULT_BODY_IDLE_TIMEOUT,
            connections: ConnectionConfig::default(),
            admin_access: AdminAccessConfig::default(),
            source: None,
            overrides: Overrides::default(),
        }
    }

    /// Checks every rule; the error names the key (`dependency[0].cap`) and why.
    pub fn validate(&self) -> Result<(), (String, String)> {
        if self.dependencies.is_empty() {
            return Err(("dependency".into(), "a config needs at least one [[dependency]]".into()));
        }
        if self.body_idle_timeout.is_zero() {
            return Err(("body_idle_timeout".into(), "must be more than 0".into()));
        }
        self.connections.validate().map_err(|(k, r)| (k.to_string(), r))?;
        if let Some(a) = self.admin
            && !a.ip().is_loopback()
            && !self.admin_access.allow_remote
        {
            return Err((
                "admin".into(),
                format!(
                    "{a} is not a loopback address: the admin listener turns retries off and reloads the config, so serving it beyond this host needs admin_allow_remote = true (--admin-allow-remote), and an admin_token"
                ),
            ));
        }
        for (i, d) in self.dependencies.iter().enumerate() {
            d.validate().map_err(|(k, r)| (format!("dependency[{i}].{k}"), r))?;
            if self.dependencies[..i].iter().any(|o| o.name == d.name) {
                return Err((
                    format!("dependency[{i}].name"),
                    format!("{:?} is named twice", d.name),
                ));
            }
        }
        if self.listeners.is_empty() {
            return Err(("listener".into(), "a config needs at least one [[listener]]".into()));
        }
        let known = |n: &str| self.dependencies.iter().any(|d| d.name == n);
        for (i, l) in self.listeners.iter().enumerate() {
            if let Some(n) = &l.dependency
                && !known(n)
            {
                return Err((
                    format!("listener[{i}].dependency"),
                    format!("no dependency is named {n:?}"),
                ));
            }
            if l.dependency.is_none() && self.routes.is_empty() {
                return Err((
                    format!("listener[{i}].dependency"),
                    "a listener needs a dependency when no [[route]] is configured".into(),
                ));
            }
        }
        for (i, r) in self.routes.iter().enumerate() {
            if !known(&r.dependency) {
                return Err((
                    format!("route[{i}].dependency"),
                    format!("no dependency is named {:?}", r.dependency),
                ));
            }
            if !r.path_prefix.starts_with('/') {
                return Err((
                    format!("route[{i}].path_prefix"),
                    format!("must start with '/', got {:?}", r.path_prefix),
                ));
            }
            if let Some(b) = &r.budget {
                b.build().map_err(|e| (format!("route[{i}].budget"), e.to_string()))?;
            }
        }
        if self.scope_max == 0 || self.scope_max > 16 * 1024 * 1024 {
            return Err((
                "scope_max".into(),
                format!("must be between 1 and 16777216, got {}", self.scope_max),
            ));
        }
        if !(1..=10_000).contains(&self.client_max) {
            return Err((
                "client_max".into(),
                format!("must be between 1 and 10000, got {}", self.client_max),
            ));
        }
        Ok(())
    }

    /// Reads and checks a config file.
    pub fn load(path: &Path) -> Result<ProxyConfig, ConfigError> {
        // A regular file of at most 16 MiB: `/dev/zero`, a FIFO or a directory is refused.
        let text = stormguard_input::read_to_string(path, stormguard_input::MAX_FILE)
            .map_err(|source| ConfigError::Read { path: path.display().to_string(), source })?;
        let mut config = ProxyConfig::parse(&text, &path.display().to_string())?;
        config.source = Some(path.to_path_buf());
        Ok(config)
    }

    /// Parses and checks a config; `file` names it in errors.
    pub fn parse(text: &str, file: &str) -> Result<ProxyConfig, ConfigError> {
        let at = |span: Range<usize>, key: String, reason: String| {
            let (line, column) = line_col(text, span.start);
            ConfigError::Invalid { file: file.to_string(), line, column, key, reason }
        };
        let raw: RawConfig = toml::from_str(text).map_err(|e| {
            let span = e.span().unwrap_or(0..0);
            let reason = e.message().trim().to_string();
            at(span.clone(), stormguard_core::text::toml_key_at(text, span.start, &reason), reason)
        })?;
        let mut spans = Spans::default();
        let config = raw.build(&mut spans).map_err(|(span, key, reason)| at(span, key, reason))?;
        config.validate().map_err(|(key, reason)| at(spans.of(&key), key, reason))?;
        Ok(config)
    }

    /// The effective config as JSON, for the admin `/config` endpoint. Credentials in upstream
    /// URLs are redacted.
    pub fn to_json(&self) -> serde_json::Value {
        use serde_json::json;
        let dur = |d: Option<Duration>| d.map(|d| format!("{}ms", d.as_millis()));
        json!({
            "listeners": self.listeners.iter().map(|l| json!({
                "listen": l.listen.to_string(), "dependency": l.dependency,
            })).collect::<Vec<_>>(),
            "dependencies": self.dependencies.iter().map(|d| json!({
                "name": d.name,
                "upstreams": d.upstreams.iter().map(redact).collect::<Vec<_>>(),
                "upstream_caps": (0..d.upstreams.len()).map(|i| d.upstream_cap(i)).collect::<Vec<_>>(),
                "remaining_reserve": d.remaining_reserve,
                "total_cap": d.total_cap,
                "limit_headers": {
                    "limit": d.limit_headers.limit,
                    "remaining": d.limit_headers.remaining,
                    "reset": d.limit_headers.resets.iter().map(|r| r.name.clone()).collect::<Vec<_>>(),
                },
                "cap": d.cap,
                "queue": d.queue,
                "queue_timeout": dur(Some(d.queue_timeout)),
                "budget": d.budget.to_string(),
                "retry_on": d.retry_on.to_string(),
                "max_retries": d.max_retries,
                "per_try_timeout": dur(d.per_try_timeout),
                "deadline": dur(d.deadline),
                "backoff": format!("{}ms..{}ms", d.backoff.base.as_millis(), d.backoff.max.as_millis()),
                "enforce": d.enforce,
                "breaker": d.breaker.map(|b| json!({
                    "failure_ratio": b.failure_ratio.to_string(),
                    "min_requests": b.min_requests,
                    "window": dur(Some(b.window)),
                    "consecutive_failures": b.consecutive_failures,
                    "break_duration": dur(Some(b.break_duration)),
                    "half_open_probes": b.half_open_probes,
                })),
                "scope_retries": d.scope_retries,
                "scope_header": d.scope_header.as_str(),
                "timeout_slot_hold": dur(Some(d.timeout_slot_hold)),
                "abandon_hold": dur(Some(d.abandon_hold)),
                "body_limit": d.body_limit,
                "planned_primary": d.planned_primary,
                "placement": if d.fleet.is_some() { "fleet" } else { "local" },
                // The Redis URL and its password are never shown: only where they come from.
                "fleet": d.fleet.as_ref().map(|f| json!({
                    "redis": match &f.redis {
                        RedisSource::Env(name) => format!("env:{name}"),
                        RedisSource::Target(t) => t.to_string(),
                    },
                    "fleet_cap": f.fleet_cap.unwrap_or(d.cap),
                    "max_instances": f.max_instances,
                    "lease_ttl": dur(Some(f.lease_ttl)),
                    "interval": dur(Some(f.interval)),
                    "fallback_min": f.fallback_min.unwrap_or(0),
                    "instance": f.instance,
                })),
                "http2": d.http2.prior_knowledge,
                "max_concurrent_streams": d.http2.max_concurrent_streams,
                "tls": d.tls.is_set().then(|| json!({
                    "ca_file": d.tls.ca_file.as_ref().map(|p| p.display().to_string()),
                    "client_cert": d.tls.client_cert.as_ref().map(|p| p.display().to_string()),
                    "client_key": d.tls.client_key.as_ref().map(|p| p.display().to_string()),
                })),
            })).collect::<Vec<_>>(),
            "routes": self.routes.iter().map(|r| json!({
                "host": r.host, "path_prefix": r.path_prefix, "dependency": r.dependency,
                "budget": r.budget.as_ref().map(ToString::to_string), "idempotent": r.idempotent,
            })).collect::<Vec<_>>(),
            "admin": self.admin.map(|a| a.to_string()),
            "record": self.record.as_ref().map(|p| p.display().to_string()),
            "scope_max": self.scope_max,
            "client_header": self.client_header.as_ref().map(HeaderName::as_str),
            "client_max": self.client_max,
            "drain_timeout": dur(Some(self.drain_timeout)),
            "body_idle_timeout": dur(Some(self.body_idle_timeout)),
            "header_read_timeout": dur(Some(self.connections.header_read_timeout)),
            "idle_timeout": dur(Some(self.connections.idle_timeout)),
            "max_connections": self.connections.max_connections,
            "admin_max_connections": self.connections.admin_max_connections,
            "max_header_bytes": self.connections.max_header_bytes,
            "http2_max_concurrent_streams": self.connections.http2_max_concurrent_streams,
            "http2_keepalive_interval": dur(Some(self.connections.http2_keepalive_interval)),
            "admin_allow_remote": self.admin_access.allow_remote,
            // Where the token comes from, never the token.
            "admin_token": self.admin_access.token.as_ref().map(AdminToken::shown),
            // Set by flags beside --config, over the file (and again at each reload).
            "overrides": self.overrides.to_json(),
        })
    }
}

/// An upstream URL without its credentials.
fn redact(u: &Uri) -> String {
    match u.authority() {
        Some(a) if a.as_str().contains('@') => {
            let host = a.as_str().rsplit_once('@').map_or("", |(_, h)| h);
            format!("{}://[redacted]@{host}{}", u.scheme_str().unwrap_or("http"), u.path())
        }
        _ => u.to_string(),
    }
}

/// A config that could not be read or is wrong.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("{path}: {source}")]
    Read {
        /// The path given.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// The file is not a valid config.
    #[error("{file}:{line}:{column}: {}{reason}", if key.is_empty() { String::new() } else { format!("{key}: ") })]
    Invalid {
        /// The file name.
        file: String,
        /// 1-based line.
        line: usize,
        /// 1-based column, in characters.
        column: usize,
        /// The key at fault (`dependency[0].cap`), or empty for a syntax error.
        key: String,
        /// What is wrong.
        reason: String,
    },
}

/// The 1-based line and column (in characters) of byte `offset` in `text`.
pub use stormguard_core::text::line_col;

/// Where each validated key was in the file.
#[derive(Default)]
struct Spans(BTreeMap<String, Range<usize>>);

impl Spans {
    fn put(&mut self, key: String, span: Range<usize>) {
        self.0.insert(key, span);
    }

    /// The key's span, or its nearest enclosing table's (`dependency[0].cap` falls back to
    /// `dependency[0]`).
    fn of(&self, key: &str) -> Range<usize> {
        let mut k = key;
        loop {
            if let Some(s) = self.0.get(k) {
                return s.clone();
            }
            match k.rfind(['.', '[']) {
                Some(i) => k = &k[..i],
                None => return 0..0,
            }
        }
    }
}

/// A limiter rule's error under the dependency's key for the field it names.
fn limiter_error(e: stormguard_core::ConfigError) -> (&'static str, String) {
    let key = match e.key() {
        "queue_len" => "queue",
        other => other,
    };
    (key, e.to_string())
}

type Bad = (Range<usize>, String, String);

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    #[serde(default)]
    listener: Vec<Spanned<RawListener>>,
    #[serde(default)]
    dependency: Vec<Spanned<RawDependency>>,
    #[serde(default)]
    route: Vec<Spanned<RawRoute>>,
    admin: Option<Spanned<String>>,
    record: Option<Spanned<String>>,
    scope_max: Option<Spanned<u64>>,
    client_header: Option<Spanned<String>>,
    client_max: Option<Spanned<u64>>,
    drain_timeout: Option<Spanned<String>>,
    body_idle_timeout: Option<Spanned<String>>,
    header_read_timeout: Option<Spanned<String>>,
    idle_timeout: Option<Spanned<String>>,
    max_connections: Option<Spanned<u64>>,
    admin_max_connections: Option<Spanned<u64>>,
    max_header_bytes: Option<Spanned<u64>>,
    http2_max_concurrent_streams: Option<Spanned<u64>>,
    http2_keepalive_interval: Option<Spanned<String>>,
    admin_allow_remote: Option<Spanned<bool>>,
    admin_token: Option<Spanned<String>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawListener {
    listen: Spanned<String>,
    dependency: Option<Spanned<String>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawDependency {
    name: Spanned<String>,
    upstreams: Spanned<Vec<Spanned<toml::Value>>>,
    cap: Option<Spanned<u64>>,
    queue: Option<Spanned<u64>>,
    queue_timeout: Option<Spanned<String>>,
    budget: Option<Spanned<toml::Value>>,
    retry_on: Option<Spanned<String>>,
    max_retries: Option<Spanned<u32>>,
    per_try_timeout: Option<Spanned<String>>,
    deadline: Option<Spanned<String>>,
    backoff: Option<Spanned<String>>,
    enforce: Option<Spanned<bool>>,
    breaker: Option<Spanned<RawBreaker>>,
    scope_retries: Option<Spanned<u64>>,
    scope_header: Option<Spanned<String>>,
    timeout_slot_hold: Option<Spanned<String>>,
    abandon_hold: Option<Spanned<String>>,
    body_limit: Option<Spanned<u64>>,
    planned_primary: Option<Spanned<u64>>,
    limit_headers: Option<Spanned<RawLimitHeaders>>,
    remaining_reserve: Option<Spanned<u64>>,
    total_cap: Option<Spanned<u64>>,
    placement: Option<Spanned<String>>,
    redis: Option<Spanned<String>>,
    fleet_cap: Option<Spanned<u64>>,
    max_instances: Option<Spanned<u64>>,
    lease_ttl: Option<Spanned<String>>,
    interval: Option<Spanned<String>>,
    fallback_min: Option<Spanned<u64>>,
    instance: Option<Spanned<String>>,
    http2: Option<Spanned<bool>>,
    max_concurrent_streams: Option<Spanned<u64>>,
    tls: Option<Spanned<RawTls>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawLimitHeaders {
    limit: Option<Vec<String>>,
    remaining: Option<Vec<String>>,
    /// `"name"` (unix-or-delta) or `"name:format"` (unix, unix-ms, delta, rfc3339).
    reset: Option<Vec<String>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTls {
    ca_file: Option<Spanned<String>>,
    client_cert: Option<Spanned<String>>,
    client_key: Option<Spanned<String>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawBreaker {
    failure_ratio: Option<Spanned<toml::Value>>,
    min_requests: Option<Spanned<u64>>,
    window: Option<Spanned<String>>,
    consecutive_failures: Option<Spanned<u64>>,
    break_duration: Option<Spanned<String>>,
    half_open_probes: Option<Spanned<u64>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRoute {
    host: Option<Spanned<String>>,
    path_prefix: Option<Spanned<String>>,
    dependency: Spanned<String>,
    budget: Option<Spanned<toml::Value>>,
    idempotent: Option<Spanned<bool>>,
}

fn bad<T>(v: &Spanned<T>, key: &str, reason: impl Into<String>) -> Bad {
    (v.span(), key.to_string(), reason.into())
}

fn duration(v: &Spanned<String>, key: &str) -> Result<Duration, Bad> {
    parse_duration(v.get_ref()).map_err(|e| bad(v, key, e.to_string()))
}

/// A budget is a SPEC string, or a table with `kind` and the SPEC's parameters.
fn budget(v: &Spanned<toml::Value>, key: &str) -> Result<BudgetSpec, Bad> {
    let text = match v.get_ref() {
        toml::Value::String(s) => s.clone(),
        toml::Value::Table(t) => {
            let kind = t.get("kind").and_then(toml::Value::as_str).ok_or_else(|| {
                bad(
                    v,
                    key,
                    "a budget table needs kind = \"ratio\" (or concurrency, token-bucket, quota)",
                )
            })?;
            let params: Vec<String> = t
                .iter()
                .filter(|(k, _)| k.as_str() != "kind")
                .map(|(k, val)| match val {
                    toml::Value::String(s) => format!("{k}={s}"),
                    other => format!("{k}={other}"),
                })
                .collect();
            format!("{kind}:{}", params.join(","))
        }
        other => {
            return Err(bad(
                v,
                key,
                format!("a budget is a SPEC string or a table, got {}", other.type_str()),
            ));
        }
    };
    BudgetSpec::parse(&text).map_err(|e| bad(v, key, e.to_string()))
}

impl RawConfig {
    /// The listeners' connection settings and the admin access keys.
    fn connections(
        &mut self,
        spans: &mut Spans,
    ) -> Result<(ConnectionConfig, AdminAccessConfig), Bad> {
        let mut c = ConnectionConfig::default();
        for (key, src, dst) in [
            ("header_read_timeout", self.header_read_timeout.take(), &mut c.header_read_timeout),
            ("idle_timeout", self.idle_timeout.take(), &mut c.idle_timeout),
            (
                "http2_keepalive_interval",
                self.http2_keepalive_interval.take(),
                &mut c.http2_keepalive_interval,
            ),
        ] {
            if let Some(v) = src {
                spans.put(key.into(), v.span());
                *dst = duration(&v, key)?;
            }
        }
        let count = |v: Spanned<u64>, key: &str, spans: &mut Spans| {
            spans.put(key.into(), v.span());
            usize::try_from(v.into_inner()).unwrap_or(usize::MAX)
        };
        if let Some(v) = self.max_connections.take() {
            c.max_connections = Some(count(v, "max_connections", spans));
        }
        if let Some(v) = self.admin_max_connections.take() {
            c.admin_max_connections = count(v, "admin_max_connections", spans);
        }
        if let Some(v) = self.max_header_bytes.take() {
            c.max_header_bytes = count(v, "max_header_bytes", spans);
        }
        if let Some(v) = self.http2_max_concurrent_streams.take() {
            spans.put("http2_max_concurrent_streams".into(), v.span());
            c.http2_max_concurrent_streams = u32::try_from(v.into_inner()).unwrap_or(u32::MAX);
        }
        let mut a = AdminAccessConfig::default();
        if let Some(v) = self.admin_allow_remote.take() {
            spans.put("admin_allow_remote".into(), v.span());
            a.allow_remote = v.into_inner();
        }
        if let Some(v) = self.admin_token.take() {
            spans.put("admin_token".into(), v.span());
            match v.get_ref().strip_prefix("env:") {
                Some(name) if !name.is_empty() => a.token = Some(AdminToken::Env(name.into())),
                _ => {
                    return Err(bad(
                        &v,
                        "admin_token",
                        "the admin token comes from an environment variable: admin_token = \"env:STORMGUARD_ADMIN_TOKEN\"",
                    ));
                }
            }
        }
        Ok((c, a))
    }

    fn build(mut self, spans: &mut Spans) -> Result<ProxyConfig, Bad> {
        let (connections, admin_access) = self.connections(spans)?;
        let mut listeners = Vec::new();
        for (i, l) in self.listener.into_iter().enumerate() {
            let p = format!("listener[{i}]");
            spans.put(p.clone(), l.span());
            let l = l.into_inner();
            spans.put(format!("{p}.listen"), l.listen.span());
            let listen = l.listen.get_ref().parse().map_err(|_| {
                bad(
                    &l.listen,
                    &format!("{p}.listen"),
                    format!("expected host:port like 127.0.0.1:8080, got {:?}", l.listen.get_ref()),
                )
            })?;
            if let Some(d) = &l.dependency {
                spans.put(format!("{p}.dependency"), d.span());
            }
            listeners
                .push(ListenerConfig { listen, dependency: l.dependency.map(Spanned::into_inner) });
        }
        let mut dependencies = Vec::new();
        for (i, d) in self.dependency.into_iter().enumerate() {
            let p = format!("dependency[{i}]");
            spans.put(p.clone(), d.span());
            dependencies.push(d.into_inner().build(&p, spans)?);
        }
        let mut routes = Vec::new();
        for (i, r) in self.route.into_iter().enumerate() {
            let p = format!("route[{i}]");
            spans.put(p.clone(), r.span());
            let r = r.into_inner();
            spans.put(format!("{p}.dependency"), r.dependency.span());
            if let Some(pp) = &r.path_prefix {
                spans.put(format!("{p}.path_prefix"), pp.span());
            }
            routes.push(RouteConfig {
                host: r.host.map(|h| h.into_inner().to_ascii_lowercase()),
                path_prefix: r.path_prefix.map_or_else(|| "/".to_string(), Spanned::into_inner),
                dependency: r.dependency.into_inner(),
                budget: r.budget.as_ref().map(|b| budget(b, &format!("{p}.budget"))).transpose()?,
                idempotent: r.idempotent.is_some_and(Spanned::into_inner),
            });
        }
        if let Some(a) = &self.admin {
            spans.put("admin".into(), a.span());
        }
        let admin = match self.admin {
            None => Some(DEFAULT_ADMIN.parse().expect("a valid address")),
            Some(a) if a.get_ref() == "off" => None,
            Some(a) => Some(a.get_ref().parse().map_err(|_| {
                bad(&a, "admin", format!("expected host:port or \"off\", got {:?}", a.get_ref()))
            })?),
        };
        let scope_max = match self.scope_max {
            None => DEFAULT_SCOPE_MAX,
            Some(s) => {
                spans.put("scope_max".into(), s.span());
                usize::try_from(s.into_inner()).unwrap_or(usize::MAX)
            }
        };
        let client_header = match self.client_header {
            None => None,
            Some(h) => Some(HeaderName::from_bytes(h.get_ref().as_bytes()).map_err(|_| {
                bad(&h, "client_header", format!("not a header name: {:?}", h.get_ref()))
            })?),
        };
        let client_max = match self.client_max {
            None => DEFAULT_CLIENT_MAX,
            Some(c) => {
                spans.put("client_max".into(), c.span());
                usize::try_from(c.into_inner()).unwrap_or(usize::MAX)
            }
        };
        let drain_timeout = match &self.drain_timeout {
            None => DEFAULT_DRAIN_TIMEOUT,
            Some(d) => duration(d, "drain_timeout")?,
        };
        let body_idle_timeout = match &self.body_idle_timeout {
            None => DEFAULT_BODY_IDLE_TIMEOUT,
            Some(d) => {
                spans.put("body_idle_timeout".into(), d.span());
                duration(d, "body_idle_timeout")?
            }
        };
        Ok(ProxyConfig {
            listeners,
            dependencies,
            routes,
            admin,
            record: self.record.map(|r| PathBuf::from(r.into_inner())),
            scope_max,
            client_header,
            client_max,
            drain_timeout,
            body_idle_timeout,
            connections,
            admin_access,
            source: None,
            overrides: Overrides::default(),
        })
    }
}

/// The fleet keys of a `[[dependency]]`, read apart so they can be checked together.
struct RawFleet {
    placement: Option<Spanned<String>>,
    redis: Option<Spanned<String>>,
    fleet_cap: Option<Spanned<u64>>,
    max_instances: Option<Spanned<u64>>,
    lease_ttl: Option<Spanned<String>>,
    interval: Option<Spanned<String>>,
    fallback_min: Option<Spanned<u64>>,
    instance: Option<Spanned<String>>,
}

impl RawFleet {
    fn build(self, p: &str, spans: &mut Spans) -> Result<Option<FleetPlacement>, Bad> {
        let k = |key: &str| format!("{p}.{key}");
        let fleet = match &self.placement {
            None => false,
            Some(v) => {
                spans.put(k("placement"), v.span());
                match v.get_ref().as_str() {
                    "local" => false,
                    "fleet" => true,
                    other => {
                        return Err(bad(
                            v,
                            &k("placement"),
                            format!("placement is \"local\" or \"fleet\", got {other:?}"),
                        ));
                    }
                }
            }
        };
        let spans_of: [(&str, Option<Range<usize>>); 7] = [
            ("redis", self.redis.as_ref().map(Spanned::span)),
            ("fleet_cap", self.fleet_cap.as_ref().map(Spanned::span)),
            ("max_instances", self.max_instances.as_ref().map(Spanned::span)),
            ("lease_ttl", self.lease_ttl.as_ref().map(Spanned::span)),
            ("interval", self.interval.as_ref().map(Spanned::span)),
            ("fallback_min", self.fallback_min.as_ref().map(Spanned::span)),
            ("instance", self.instance.as_ref().map(Spanned::span)),
        ];
        for (key, span) in spans_of {
            if let Some(span) = span {
                if !fleet {
                    return Err((
                        span,
                        k(key),
                        format!("{key} is a fleet key: set placement = \"fleet\" to use it"),
                    ));
                }
                spans.put(k(key), span);
            }
        }
        if !fleet {
            return Ok(None);
        }
        let mut f = FleetPlacement::new(0);
        if let Some(v) = &self.redis {
            match v.get_ref().strip_prefix("env:") {
                Some(name) if !name.is_empty() => f.redis = RedisSource::Env(name.to_string()),
                _ => {
                    return Err(bad(
                        v,
                        &k("redis"),
                        "the Redis URL and its password come from an environment variable: redis = \"env:STORMGUARD_REDIS_URL\"",
                    ));
                }
            }
        }
        f.fleet_cap = self.fleet_cap.map(Spanned::into_inner);
        match self.max_instances {
            Some(v) => f.max_instances = v.into_inner(),
            None => {
                let span = self.placement.as_ref().map_or(0..0, Spanned::span);
                return Err((
                    span,
                    k("max_instances"),
                    "placement = \"fleet\" needs max_instances (the most instances at the fleet's peak)".into(),
                ));
            }
        }
        if let Some(v) = &self.lease_ttl {
            f.lease_ttl = duration(v, &k("lease_ttl"))?;
        }
        if let Some(v) = &self.interval {
            f.interval = duration(v, &k("interval"))?;
        }
        f.fallback_min = self.fallback_min.map(Spanned::into_inner);
        f.instance = self.instance.map(Spanned::into_inner);
        Ok(Some(f))
    }
}

impl RawDependency {
    fn build(mut self, p: &str, spans: &mut Spans) -> Result<DependencyConfig, Bad> {
        let fleet = RawFleet {
            placement: self.placement.take(),
            redis: self.redis.take(),
            fleet_cap: self.fleet_cap.take(),
            max_instances: self.max_instances.take(),
            lease_ttl: self.lease_ttl.take(),
            interval: self.interval.take(),
            fallback_min: self.fallback_min.take(),
            instance: self.instance.take(),
        };
        let mut d = self.build_local(p, spans)?;
        d.fleet = fleet.build(p, spans)?;
        Ok(d)
    }

    fn build_local(self, p: &str, spans: &mut Spans) -> Result<DependencyConfig, Bad> {
        let k = |key: &str| format!("{p}.{key}");
        let mut upstreams = Vec::new();
        spans.put(k("upstreams"), self.upstreams.span());
        let mut upstream_caps = Vec::new();
        for (i, u) in self.upstreams.get_ref().iter().enumerate() {
            // A URL, or a table { url = "...", cap = N }.
            let key = k(&format!("upstreams[{i}]"));
            spans.put(key.clone(), u.span());
            let (url, cap) = match u.get_ref() {
                toml::Value::String(url) => (url.clone(), None),
                toml::Value::Table(t) => {
                    if let Some(extra) = t.keys().find(|k| !["url", "cap"].contains(&k.as_str())) {
                        return Err(bad(
                            u,
                            &key,
                            format!("unknown key `{extra}` (expected url, cap)"),
                        ));
                    }
                    let url = t.get("url").and_then(toml::Value::as_str).ok_or_else(|| {
                        bad(u, &key, "an upstream table needs url = \"http://host:port\"")
                    })?;
                    let cap = match t.get("cap") {
                        None => None,
                        Some(c) => {
                            Some(c.as_integer().and_then(|c| u64::try_from(c).ok()).ok_or_else(
                                || bad(u, &key, format!("cap must be a whole number, got {c}")),
                            )?)
                        }
                    };
                    (url.to_string(), cap)
                }
                other => {
                    return Err(bad(
                        u,
                        &key,
                        format!("an upstream is a URL or a table, got {}", other.type_str()),
                    ));
                }
            };
            upstreams.push(url.parse::<Uri>().map_err(|e| bad(u, &key, format!("{url:?}: {e}")))?);
            upstream_caps.push(cap);
        }
        let mut d =
            DependencyConfig::new(self.name.get_ref().clone(), Uri::from_static("http://unset"));
        d.upstreams = upstreams;
        d.upstream_caps = upstream_caps;
        spans.put(k("name"), self.name.span());
        macro_rules! num {
            ($field:ident) => {
                if let Some(v) = self.$field {
                    spans.put(k(stringify!($field)), v.span());
                    d.$field = v.into_inner().try_into().unwrap_or(u32::MAX.into());
                }
            };
        }
        num!(cap);
        num!(queue);
        num!(remaining_reserve);
        if let Some(t) = self.total_cap {
            spans.put(k("total_cap"), t.span());
            d.total_cap = Some(t.into_inner());
        }
        if let Some(h) = self.limit_headers {
            let key = k("limit_headers");
            spans.put(key.clone(), h.span());
            let span = h.span();
            let h = h.into_inner();
            if let Some(v) = h.limit {
                d.limit_headers.limit = v;
            }
            if let Some(v) = h.remaining {
                d.limit_headers.remaining = v;
            }
            if let Some(v) = h.reset {
                let mut resets = Vec::new();
                for r in v {
                    let (name, format) = match r.split_once(':') {
                        Some((n, f)) => (
                            n.to_string(),
                            f.parse().map_err(|e| {
                                (span.clone(), key.clone(), format!("reset {r:?}: {e}"))
                            })?,
                        ),
                        None => (r.clone(), stormguard_http::headers::ResetFormat::UnixOrDelta),
                    };
                    resets.push(stormguard_http::headers::ResetHeader { name, format });
                }
                d.limit_headers.resets = resets;
            }
        }
        num!(scope_retries);
        if let Some(v) = self.max_retries {
            spans.put(k("max_retries"), v.span());
            d.max_retries = v.into_inner();
        }
        if let Some(v) = &self.planned_primary {
            spans.put(k("planned_primary"), v.span());
            d.planned_primary = Some(*v.get_ref());
        }
        if let Some(v) = self.body_limit {
            spans.put(k("body_limit"), v.span());
            d.body_limit = usize::try_from(v.into_inner()).unwrap_or(usize::MAX);
        }
        for (key, src, dst) in [
            ("queue_timeout", &self.queue_timeout, &mut d.queue_timeout),
            ("timeout_slot_hold", &self.timeout_slot_hold, &mut d.timeout_slot_hold),
            ("abandon_hold", &self.abandon_hold, &mut d.abandon_hold),
        ] {
            if let Some(v) = src {
                spans.put(k(key), v.span());
                *dst = duration(v, &k(key))?;
            }
        }
        for (key, src, dst) in [
            ("per_try_timeout", &self.per_try_timeout, &mut d.per_try_timeout),
            ("deadline", &self.deadline, &mut d.deadline),
        ] {
            if let Some(v) = src {
                spans.put(k(key), v.span());
                *dst = Some(duration(v, &k(key))?);
            }
        }
        if let Some(v) = &self.budget {
            spans.put(k("budget"), v.span());
            d.budget = budget(v, &k("budget"))?;
        }
        if let Some(v) = &self.retry_on {
            spans.put(k("retry_on"), v.span());
            d.retry_on = v.get_ref().parse().map_err(
                |e: stormguard_core::conditions::UnknownCondition| {
                    bad(v, &k("retry_on"), e.to_string())
                },
            )?;
        }
        if let Some(v) = &self.backoff {
            spans.put(k("backoff"), v.span());
            d.backoff = BackoffConfig::parse_range(v.get_ref())
                .map_err(|e| bad(v, &k("backoff"), e.to_string()))?;
        }
        if let Some(v) = self.enforce {
            d.enforce = v.into_inner();
        }
        if let Some(v) = &self.scope_header {
            spans.put(k("scope_header"), v.span());
            d.scope_header = HeaderName::try_from(v.get_ref().as_str())
                .map_err(|e| bad(v, &k("scope_header"), format!("{:?}: {e}", v.get_ref())))?;
        }
        if let Some(b) = self.breaker {
            spans.put(k("breaker"), b.span());
            let raw = b.into_inner();
            let mut c = BreakerConfig::default();
            let bk = |key: &str| format!("{p}.breaker.{key}");
            if let Some(v) = &raw.failure_ratio {
                let text = match v.get_ref() {
                    toml::Value::String(s) => s.clone(),
                    other => other.to_string(),
                };
                c.failure_ratio =
                    text.parse().map_err(|e| bad(v, &bk("failure_ratio"), format!("{e}")))?;
            }
            if let Some(v) = raw.min_requests {
                c.min_requests = v.into_inner();
            }
            if let Some(v) = &raw.window {
                c.window = duration(v, &bk("window"))?;
            }
            if let Some(v) = raw.consecutive_failures {
                c.consecutive_failures = Some(v.into_inner()).filter(|n| *n > 0);
            }
            if let Some(v) = &raw.break_duration {
                c.break_duration = duration(v, &bk("break_duration"))?;
            }
            if let Some(v) = raw.half_open_probes {
                c.half_open_probes = v.into_inner();
            }
            d.breaker = Some(c);
        }
        if let Some(v) = self.http2 {
            spans.put(k("http2"), v.span());
            d.http2.prior_knowledge = v.into_inner();
        }
        if let Some(v) = self.max_concurrent_streams {
            spans.put(k("max_concurrent_streams"), v.span());
            let n = u32::try_from(*v.get_ref()).map_err(|_| {
                bad(
                    &v,
                    &k("max_concurrent_streams"),
                    format!("must be between 1 and 2147483647, got {}", v.get_ref()),
                )
            })?;
            d.http2.max_concurrent_streams = Some(n);
        }
        if let Some(t) = self.tls {
            spans.put(k("tls"), t.span());
            let t = t.into_inner();
            for (key, src, dst) in [
                ("ca_file", t.ca_file, &mut d.tls.ca_file),
                ("client_cert", t.client_cert, &mut d.tls.client_cert),
                ("client_key", t.client_key, &mut d.tls.client_key),
            ] {
                if let Some(v) = src {
                    spans.put(k(&format!("tls.{key}")), v.span());
                    *dst = Some(PathBuf::from(v.into_inner()));
                }
            }
        }
        Ok(d)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(text: &str) -> String {
        ProxyConfig::parse(text, "f.toml").unwrap_err().to_string()
    }

    const BASE: &str = "[[listener]]\nlisten = \"127.0.0.1:8080\"\ndependency = \"d\"\n\n[[dependency]]\nname = \"d\"\nupstreams = [\"http://127.0.0.1:9000\"]\n";

    #[test]
    fn full_config() {
        let text = format!(
            "{BASE}cap = 8\nqueue = 0\nqueue_timeout = \"250ms\"\nbudget = {{ kind = \"ratio\", percent = 0.25, min_per_sec = 3 }}\n\
             retry_on = \"5xx,reset\"\nmax_retries = 3\nper_try_timeout = \"300ms\"\ndeadline = \"2s\"\nbackoff = \"10ms..100ms\"\n\
             enforce = false\nscope_retries = 2\n\n[dependency.breaker]\nfailure_ratio = 0.6\nbreak_duration = \"2s\"\n\n\
             [[route]]\nhost = \"API.example\"\npath_prefix = \"/pay\"\ndependency = \"d\"\nbudget = \"ratio:percent=0.1,min_per_sec=1\"\nidempotent = true\n"
        );
        let c = ProxyConfig::parse(&text, "f.toml").unwrap();
        let d = &c.dependencies[0];
        assert_eq!(
            (d.cap, d.queue, d.max_retries, d.enforce, d.scope_retries),
            (8, 0, 3, false, 2)
        );
        assert_eq!(d.per_try_timeout, Some(Duration::from_millis(300)));
        assert_eq!(d.budget, BudgetSpec::parse("ratio:percent=0.25,min_per_sec=3").unwrap());
        assert_eq!(d.breaker.unwrap().break_duration, Duration::from_secs(2));
        assert_eq!(c.routes[0].host.as_deref(), Some("api.example"));
        assert!(c.routes[0].idempotent);
        assert_eq!(c.admin, Some(DEFAULT_ADMIN.parse().unwrap()));
    }

    #[test]
    fn errors_name_file_line_column_and_key() {
        assert_eq!(
            err(&format!("{BASE}cap = \"x\"\n")),
            "f.toml:8:7: dependency[0].cap: invalid type: string \"x\", expected u64"
        );
        assert!(
            err(&format!("{BASE}caps = 3\n"))
                .starts_with("f.toml:8:1: dependency[0].caps: unknown field `caps`")
        );
        assert_eq!(
            err(&format!("{BASE}per_try_timeout = \"3 parsecs\"\n"))
                .split(": ")
                .take(2)
                .collect::<Vec<_>>(),
            ["f.toml:8:19", "dependency[0].per_try_timeout"]
        );
        assert!(
            err(&format!("{BASE}budget = \"ratio:percent=x\"\n"))
                .starts_with("f.toml:8:10: dependency[0].budget: ")
        );
        assert!(
            err(&format!("{BASE}\n[dependency.breaker]\nwindow = \"0s\"\n"))
                .starts_with("f.toml:9:1: dependency[0].breaker: "),
            "{}",
            err(&format!("{BASE}\n[dependency.breaker]\nwindow = \"0s\"\n"))
        );
        assert_eq!(
            err(
                "[[listener]]\nlisten = \"127.0.0.1:8080\"\ndependency = \"nope\"\n\n[[dependency]]\nname = \"d\"\nupstreams = [\"http://127.0.0.1:9000\"]\n"
            ),
            "f.toml:3:14: listener[0].dependency: no dependency is named \"nope\""
        );
        assert!(
            err(&format!("{BASE}upstreams = [\"ftp://x\"]\n")).contains("dependency[0].upstreams")
        );
        assert!(err("cap = [").starts_with("f.toml:1:"));
    }

    #[test]
    fn a_bad_cap_and_a_bad_queue_are_named_by_their_own_keys() {
        let invalid = |text: &str| match ProxyConfig::parse(text, "f.toml").unwrap_err() {
            ConfigError::Invalid { line, column, key, reason, .. } => (line, column, key, reason),
            other => panic!("{other}"),
        };
        assert_eq!(
            invalid(&format!(
                "{BASE}cap = 0
"
            )),
            (8, 7, "dependency[0].cap".into(), "cap must be between 1 and 16777216, got 0".into())
        );
        assert_eq!(
            invalid(&format!(
                "{BASE}queue = 99999999
"
            )),
            (
                8,
                9,
                "dependency[0].queue".into(),
                "queue length must be at most 16777216, got 99999999".into()
            )
        );
    }

    #[test]
    fn fleet_placement() {
        let text = format!(
            "{BASE}cap = 20\nplacement = \"fleet\"\nredis = \"env:REDIS_FOR_PAYMENTS\"\nmax_instances = 50\n\
             lease_ttl = \"3s\"\ninterval = \"250ms\"\nfallback_min = 1\nfleet_cap = 100\n"
        );
        let c = ProxyConfig::parse(&text, "f.toml").unwrap();
        let f = c.dependencies[0].fleet.as_ref().unwrap();
        assert_eq!(f.redis, RedisSource::Env("REDIS_FOR_PAYMENTS".into()));
        assert_eq!((f.max_instances, f.fleet_cap, f.fallback_min), (50, Some(100), Some(1)));
        assert_eq!((f.lease_ttl, f.interval), (Duration::from_secs(3), Duration::from_millis(250)));
        let json = c.to_json().to_string();
        assert!(json.contains("\"redis\":\"env:REDIS_FOR_PAYMENTS\""), "{json}");
        assert!(json.contains("\"placement\":\"fleet\""), "{json}");
        // Defaults: the URL from $STORMGUARD_REDIS_URL, the fleet cap from cap.
        let c = ProxyConfig::parse(
            &format!("{BASE}placement = \"fleet\"\nmax_instances = 3\n"),
            "f.toml",
        )
        .unwrap();
        let f = c.dependencies[0].fleet.as_ref().unwrap();
        assert_eq!(f.redis, RedisSource::Env("STORMGUARD_REDIS_URL".into()));
        assert_eq!(f.fleet_cap, None);
        assert!(ProxyConfig::parse(BASE, "f.toml").unwrap().dependencies[0].fleet.is_none());
    }

    #[test]
    fn fleet_errors_name_the_key() {
        assert_eq!(
            err(&format!(
                "{BASE}placement = \"fleet\"\nredis = \"redis://:hunter2@h:6379\"\nmax_instances = 3\n"
            )),
            "f.toml:9:9: dependency[0].redis: the Redis URL and its password come from an environment variable: redis = \"env:STORMGUARD_REDIS_URL\""
        );
        assert_eq!(
            err(&format!("{BASE}placement = \"fleet\"\n")),
            "f.toml:8:13: dependency[0].max_instances: placement = \"fleet\" needs max_instances (the most instances at the fleet's peak)"
        );
        assert_eq!(
            err(&format!("{BASE}max_instances = 3\n")),
            "f.toml:8:17: dependency[0].max_instances: max_instances is a fleet key: set placement = \"fleet\" to use it"
        );
        assert!(err(&format!("{BASE}placement = \"global\"\n")).starts_with(
            "f.toml:8:13: dependency[0].placement: placement is \"local\" or \"fleet\""
        ));
        assert!(
            err(&format!("{BASE}placement = \"fleet\"\nmax_instances = 3\ninterval = \"1s\"\n"))
                .starts_with("f.toml:10:12: dependency[0].interval: interval must be at least 10ms and at most lease_ttl / 3"),
        );
        assert!(
            err(&format!("{BASE}placement = \"fleet\"\nmax_instances = 0\n"))
                .starts_with("f.toml:9:17: dependency[0].max_instances: "),
        );
        assert!(
            err(&format!(
                "{BASE}budget = \"ratio:ttl=1s\"\nplacement = \"fleet\"\nmax_instances = 3\n"
            ))
            .starts_with("f.toml:5:1: dependency[0].lease_ttl: lease_ttl (2s) must be at most 0.9"),
            "{}",
            err(&format!(
                "{BASE}budget = \"ratio:ttl=1s\"\nplacement = \"fleet\"\nmax_instances = 3\n"
            ))
        );
    }

    #[test]
    fn a_fallback_share_of_zero_is_refused_with_the_fix() {
        // 20 slots over 50 instances: each would fall back to 0 and admit nothing.
        let text = format!("{BASE}cap = 20\nplacement = \"fleet\"\nmax_instances = 50\n");
        assert_eq!(
            err(&text),
            "f.toml:10:17: dependency[0].max_instances: the fallback share floor(fleet_cap \
             (default: cap) / max_instances) = floor(20 / 50) is 0: without Redis no instance \
             would admit anything. Set fleet_cap to the whole fleet's cap (at least 50), lower \
             max_instances to at most 20, or set fallback_min (the slots each instance keeps \
             without Redis, overcommitting the fleet cap; fallback_min = 0 admits nothing \
             without Redis on purpose)"
        );
        assert!(
            err(&format!("{BASE}placement = \"fleet\"\nfleet_cap = 10\nmax_instances = 11\n"))
                .starts_with("f.toml:10:17: dependency[0].max_instances: the fallback share floor(fleet_cap / max_instances) = floor(10 / 11) is 0")
        );
        // Each fix is accepted.
        for fix in ["fleet_cap = 250", "max_instances = 20", "fallback_min = 1", "fallback_min = 0"]
        {
            let (key, _) = fix.split_once(" = ").unwrap();
            let rest = if key == "max_instances" {
                fix.to_string()
            } else {
                format!("max_instances = 50\n{fix}")
            };
            let text = format!("{BASE}cap = 20\nplacement = \"fleet\"\n{rest}\n");
            let c = ProxyConfig::parse(&text, "f.toml").unwrap_or_else(|e| panic!("{fix}: {e}"));
            let f = c.dependencies[0].fleet.as_ref().unwrap();
            let fleet = f.to_fleet(
                &c.dependencies[0],
                stormguard_redis::RedisTarget {
                    host: "h".into(),
                    port: 6379,
                    user: None,
                    password: None,
                    db: 0,
                },
            );
            let expected = match fix {
                "fleet_cap = 250" => 5,
                "max_instances = 20" | "fallback_min = 1" => 1,
                _ => 0,
            };
            assert_eq!(fleet.fallback_slots(), expected, "{fix}");
        }
    }

    #[test]
    fn connection_keys() {
        let text = format!(
            "header_read_timeout = \"2s\"\nidle_timeout = \"30s\"\nmax_connections = 500\n\
             admin_max_connections = 8\nmax_header_bytes = 16384\nhttp2_max_concurrent_streams = 50\n\
             http2_keepalive_interval = \"10s\"\nadmin_token = \"env:SG_TOKEN\"\n{BASE}"
        );
        let c = ProxyConfig::parse(&text, "f.toml").unwrap();
        let n = &c.connections;
        assert_eq!(
            (n.header_read_timeout, n.idle_timeout, n.http2_keepalive_interval),
            (Duration::from_secs(2), Duration::from_secs(30), Duration::from_secs(10))
        );
        assert_eq!(
            (
                n.max_connections,
                n.admin_max_connections,
                n.max_header_bytes,
                n.http2_max_concurrent_streams
            ),
            (Some(500), 8, 16384, 50)
        );
        assert_eq!(c.admin_access.token, Some(AdminToken::Env("SG_TOKEN".into())));
        let json = c.to_json();
        assert_eq!(json["admin_token"], "env:SG_TOKEN");
        assert_eq!(json["header_read_timeout"], "2000ms");
        // Defaults.
        let c = ProxyConfig::parse(BASE, "f.toml").unwrap();
        assert_eq!(c.connections, ConnectionConfig::default());
        assert_eq!(c.connections.header_read_timeout, Duration::from_secs(10));
        assert_eq!(c.connections.idle_timeout, Duration::from_secs(60));
        assert_eq!(c.connections.max_connections, None);
        assert!(!c.admin_access.allow_remote);
        // A token in code is never shown.
        let mut c = c;
        c.admin_access.token = Some(AdminToken::Value("s3cret-s3cret-s3cret".into()));
        assert!(!c.to_json().to_string().contains("s3cret"));
        assert!(!format!("{c:?}").contains("s3cret"));
    }

    #[test]
    fn connection_key_errors_name_the_key() {
        assert_eq!(
            err(&format!("header_read_timeout = \"0s\"\n{BASE}")),
            "f.toml:1:23: header_read_timeout: must be more than 0"
        );
        assert_eq!(
            err(&format!("max_connections = 0\n{BASE}")),
            "f.toml:1:19: max_connections: must be between 1 and 16777216, got 0"
        );
        assert_eq!(
            err(&format!("max_header_bytes = 100\n{BASE}")),
            "f.toml:1:20: max_header_bytes: must be between 8192 and 1048576, got 100"
        );
        assert_eq!(
            err(&format!("admin_token = \"hunter2hunter2hunter2\"\n{BASE}")),
            "f.toml:1:15: admin_token: the admin token comes from an environment variable: admin_token = \"env:STORMGUARD_ADMIN_TOKEN\""
        );
    }

    #[test]
    fn a_remote_admin_address_needs_admin_allow_remote() {
        let e = err(&format!("admin = \"0.0.0.0:9901\"\n{BASE}"));
        assert!(
            e.starts_with("f.toml:1:9: admin: 0.0.0.0:9901 is not a loopback address: "),
            "{e}"
        );
        assert!(e.contains("admin_allow_remote = true"), "{e}");
        let c = ProxyConfig::parse(
            &format!("admin = \"0.0.0.0:9901\"\nadmin_allow_remote = true\n{BASE}"),
            "f.toml",
        )
        .unwrap();
        assert!(c.admin_access.allow_remote);
        for ok in ["127.0.0.1:9901", "[::1]:9901", "off"] {
            ProxyConfig::parse(&format!("admin = \"{ok}\"\n{BASE}"), "f.toml").unwrap();
        }
        assert!(err(&format!("admin = \"[::]:9901\"\n{BASE}")).contains("admin_allow_remote"));
    }

    #[test]
    fn admin_tokens_are_long_enough() {
        assert_eq!(
            AdminToken::Value("short".into()).resolve().unwrap_err(),
            AdminTokenError::TooShort
        );
        assert_eq!(
            AdminToken::Value("0123456789abcdef".into()).resolve().unwrap(),
            "0123456789abcdef"
        );
        let e = AdminToken::Env("STORMGUARD_TEST_UNSET_TOKEN_VARIABLE".into()).resolve();
        let e = e.unwrap_err();
        assert_eq!(e, AdminTokenError::Unset("STORMGUARD_TEST_UNSET_TOKEN_VARIABLE".into()));
        assert!(e.to_string().contains("STORMGUARD_TEST_UNSET_TOKEN_VARIABLE is not set"));
    }

    #[test]
    fn redacts_credentials() {
        assert_eq!(redact(&"http://user:pw@h:1/".parse().unwrap()), "http://[redacted]@h:1/");
    }
}
