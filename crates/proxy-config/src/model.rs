//! The configuration model: what the proxy runs, as plain values with their defaults. Read
//! from a file by `file`, checked by [`validate`](super::validate), shown by
//! `view`.

use std::fmt;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use http::{HeaderName, Uri};
use serde::Deserialize;
use stormguard_core::backoff::BackoffConfig;
use stormguard_core::breaker::BreakerConfig;
use stormguard_core::budget::BudgetSpec;
use stormguard_core::conditions::RetryOn;
use stormguard_core::defaults;
use stormguard_core::tree::Allowance;

use super::Overrides;

/// The admin listener's default address: loopback only.
pub const DEFAULT_ADMIN: &str = "127.0.0.1:9901";
/// Trace ids remembered for fan-out scopes, at most. Default 65 536.
pub const DEFAULT_SCOPE_MAX: usize = defaults::SCOPE_MAX;
/// How long a drain waits for requests in flight by default.
pub const DEFAULT_DRAIN_TIMEOUT: Duration = defaults::DRAIN_TIMEOUT;
/// The default `body_idle_timeout`: 10 s.
pub const DEFAULT_BODY_IDLE_TIMEOUT: Duration = defaults::BODY_IDLE_TIMEOUT;
/// Distinct `client` label values by default.
pub const DEFAULT_CLIENT_MAX: usize = defaults::CLIENT_MAX;
/// The default `header_read_timeout`: 10 s.
pub const DEFAULT_HEADER_READ_TIMEOUT: Duration = defaults::HEADER_READ_TIMEOUT;
/// The default `idle_timeout`: 60 s.
pub const DEFAULT_IDLE_TIMEOUT: Duration = defaults::IDLE_TIMEOUT;
/// The default `admin_max_connections`: 64.
pub const DEFAULT_ADMIN_MAX_CONNECTIONS: usize = defaults::ADMIN_MAX_CONNECTIONS;
/// The default `max_header_bytes`: 64 KiB.
pub const DEFAULT_MAX_HEADER_BYTES: usize = defaults::MAX_HEADER_BYTES;
/// The default `http2_max_concurrent_streams`: 200 (hyper's).
pub const DEFAULT_HTTP2_MAX_CONCURRENT_STREAMS: u32 = defaults::HTTP2_MAX_CONCURRENT_STREAMS;
/// The default `http2_keepalive_interval`: 30 s.
pub const DEFAULT_HTTP2_KEEPALIVE_INTERVAL: Duration = defaults::HTTP2_KEEPALIVE_INTERVAL;

/// Everything the proxy runs.
#[derive(Debug, Clone, PartialEq)]
pub struct ProxyConfig {
    /// Where callers connect. At least one.
    pub listeners: Vec<ListenerConfig>,
    /// The dependencies behind the proxy. At least one; names are unique.
    pub dependencies: Vec<ProxyDependency>,
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
    /// On SIGTERM (or the proxy handle's `drain`): how long requests in
    /// flight may take to finish before their connections are closed. Default 10 s.
    pub drain_timeout: Duration,
    /// The longest a caller may go without sending request body bytes: past it the request is
    /// answered `408`, and an attempt already holding a slot is cut and its slot comes back.
    /// A body up to the replay buffer is received whole before its attempt asks for a slot.
    /// Default 10 s.
    pub body_idle_timeout: Duration,
    /// `body_timeout`: the longest the proxy waits, in all, for a request body's bytes (the
    /// time the request waits for a slot, or the upstream takes to read, does not count): past
    /// it the request is answered `408` and an attempt already holding a slot is cut, its slot
    /// back. A gap bound alone lets a caller that sends a byte every few seconds hold a slot for
    /// as long as it likes. `0s` turns it off. Default 30 s.
    pub body_timeout: Duration,
    /// `response_buffer`: bytes of an upstream's answer read ahead of the caller. An answer up
    /// to this size is read at the upstream's pace whatever the caller reads, so its slot comes
    /// back when the upstream has finished; a larger one is relayed through a buffer this size.
    /// `0` turns reading ahead off (the caller's reading paces the upstream). Default 1 MiB.
    pub response_buffer: usize,
    /// `response_idle_timeout`: how long a caller may accept nothing of an answer while the
    /// read-ahead buffer is full (or the answer is finished and unread): past it the answer is
    /// cut — the upstream attempt ended and its slot returned, the buffer freed, an HTTP/1.1
    /// connection closed — and counted (`stormguard_proxy_client_errors_total{reason=
    /// "response-stalled"}`). `0s` turns it off. Default 30 s.
    pub response_idle_timeout: Duration,
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

/// One listening socket (`[[listener]]`).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ListenerConfig {
    /// The address (`127.0.0.1:8080`; port 0 picks a free one).
    #[serde(deserialize_with = "stormguard_config::de::socket_addr")]
    pub listen: SocketAddr,
    /// Requests no route matches go to this dependency; without it they get 404.
    #[serde(default)]
    pub dependency: Option<String>,
    /// `downstream_pushback`: a request stormguard will not try again for load (a retry
    /// refused, a first try shed) is answered with `x-should-retry: false`, `Retry-After` when
    /// a time is known, and for gRPC `grpc-retry-pushback-ms: -1` in a gRPC status, so the
    /// caller's own retry loop stands down (docs/proxy.md, "Downstream pushback"). Default true.
    #[serde(default = "yes")]
    pub downstream_pushback: bool,
    /// `tree`: what the listener does with a call tree's context (the `stormguard-tree` member
    /// of W3C `baggage`, docs/rules.md "One budget for the call tree"): `off` (default) takes
    /// the member off every request and starts none — a caller outside the trust boundary
    /// cannot grant itself an allowance; `root` starts a new user action on every request,
    /// whatever it carried; `trust` keeps the caller's (its allowance clamped to
    /// `tree_allowance`), and starts one when none came.
    #[serde(default)]
    pub tree: TreeMode,
    /// `tree_allowance`: attempts per user action any one dependency below may see, for the
    /// trees this listener starts, and the most a trusted caller's may say. Default 1.2.
    #[serde(default, deserialize_with = "stormguard_config::de::from_number_or_str")]
    pub tree_allowance: Allowance,
}

/// What a listener does with a call tree's context ([`ListenerConfig::tree`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TreeMode {
    /// The context is taken off; no tree is started.
    #[default]
    Off,
    /// Every request starts a new tree.
    Root,
    /// The caller's context is kept (clamped); a request without one starts a tree.
    Trust,
}

impl TreeMode {
    /// The name in the config file.
    pub fn as_str(self) -> &'static str {
        match self {
            TreeMode::Off => "off",
            TreeMode::Root => "root",
            TreeMode::Trust => "trust",
        }
    }
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
    pub(super) fn shown(&self) -> String {
        match self {
            AdminToken::Env(name) => format!("env:{name}"),
            AdminToken::Value(_) => "[redacted]".into(),
        }
    }
}

/// One dependency: its upstream, cap, queue, budget and retry rules.
#[derive(Debug, Clone, PartialEq)]
pub struct ProxyDependency {
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
    /// Per upstream, in the order of `upstreams`: its own adaptive cap (`adaptive` in its
    /// table); `None` or missing: the dependency's `adaptive`.
    pub upstream_adaptive: Vec<Option<stormguard_core::adaptive::AdaptiveConfig>>,
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
    /// A model provider's requests and tokens per minute (`requests_per_minute`,
    /// `tokens_per_minute`, `learn_rate_limits`), metered before each attempt: see
    /// [`RateAdmission`](stormguard_http::rate::RateAdmission). The request's tokens are estimated from its body
    /// (its `max_tokens` and its size). Default: off.
    pub rate: stormguard_http::rate::RateAdmission,
    /// Request body bytes per input token, for rate admission's estimate of a request's tokens
    /// (`bytes_per_token`). Default 4.
    pub bytes_per_token: u64,
    /// Hedged requests (`hedge_after`, `max_hedges`): a second attempt when the first has not
    /// answered after a delay or a percentile, paid from the budget, under the cap. Default
    /// none.
    pub hedge: Option<stormguard_core::hedge::HedgeConfig>,
    /// An adaptive cap (`adaptive = { min, max, algorithm }`): each upstream's working cap
    /// starts at its `cap` and follows what it can take, within `[min, max]`. Default none
    /// (`cap` is fixed).
    pub adaptive: Option<stormguard_core::adaptive::AdaptiveConfig>,
    /// What a caller's own retry is to this dependency (`caller_retries`): charged to the
    /// budget (`enforce`, the default), counted only (`count`), or not looked for (`off`). See
    /// [`CallerRetries`].
    pub caller_retries: CallerRetries,
    /// How long after a failed or refused answer the caller's identical request is its retry
    /// (`client_retry_window`). Default 10 s.
    pub client_retry_window: Duration,
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
        dependency: &ProxyDependency,
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
}

/// TLS to a dependency's `https://` upstreams (`[dependency.tls]`). The files are PEM, read
/// when the config is checked (a missing or invalid one is a config error); relative paths are
/// from the current directory.
pub type TlsConfig = stormguard_tls::TlsFiles;

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

impl ProxyDependency {
    /// A dependency named `name` in front of `upstream`, with every default.
    pub fn new(name: impl Into<String>, upstream: Uri) -> ProxyDependency {
        ProxyDependency {
            name: name.into(),
            upstreams: vec![upstream],
            upstream_caps: Vec::new(),
            upstream_adaptive: Vec::new(),
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
            rate: stormguard_http::rate::RateAdmission::default(),
            bytes_per_token: stormguard_http::provider::Estimator::default().bytes_per_token,
            hedge: None,
            adaptive: None,
            caller_retries: CallerRetries::default(),
            client_retry_window: defaults::CLIENT_RETRY_WINDOW,
        }
    }

    /// The cap upstream `i`'s limiter is built with: its own cap (or the dependency's), at
    /// most `max_concurrent_streams` (one HTTP/2 connection per upstream).
    pub fn upstream_cap(&self, i: usize) -> u64 {
        let cap = self.upstream_caps.get(i).copied().flatten().unwrap_or(self.cap);
        self.http2.max_concurrent_streams.map_or(cap, |m| cap.min(u64::from(m)))
    }

    /// The adaptive cap upstream `i`'s limiter is built with: its own, or the dependency's,
    /// its ceiling at most `max_concurrent_streams` (as the cap is).
    pub fn upstream_adaptive(&self, i: usize) -> Option<stormguard_core::adaptive::AdaptiveConfig> {
        let a = self.upstream_adaptive.get(i).copied().flatten().or(self.adaptive)?;
        Some(self.clamp_adaptive(a))
    }

    /// The limiter the dependency's (first) upstream is built with: its cap, the dependency's
    /// queue and queue timeout, and with one upstream its own adaptive cap (or the
    /// dependency's); with several, the dependency's (each upstream's own is resolved beside
    /// it, [`upstream_adaptive`](Self::upstream_adaptive)).
    pub fn limiter_config(&self) -> stormguard_core::limiter::LimiterConfig {
        stormguard_core::limiter::LimiterConfig {
            cap: self.upstream_cap(0),
            queue_len: self.queue,
            queue_timeout: self.queue_timeout,
            adaptive: match self.upstreams.len() {
                1 => self.upstream_adaptive(0),
                _ => self.adaptive.map(|a| self.clamp_adaptive(a)),
            },
        }
    }

    /// An adaptive cap whose ceiling (and floor) are at most `max_concurrent_streams`.
    fn clamp_adaptive(
        &self,
        mut a: stormguard_core::adaptive::AdaptiveConfig,
    ) -> stormguard_core::adaptive::AdaptiveConfig {
        if let Some(m) = self.http2.max_concurrent_streams {
            a.max = a.max.min(u64::from(m)).max(1);
            a.min = a.min.min(a.max);
        }
        a
    }

    /// The most attempts upstream `i` may ever have in flight: its adaptive cap's ceiling, or
    /// its cap.
    pub fn upstream_ceiling(&self, i: usize) -> u64 {
        self.upstream_adaptive(i).map_or(self.upstream_cap(i), |a| a.max)
    }

    /// The largest of the upstreams' ceilings: the connection pool's size.
    pub fn largest_upstream_cap(&self) -> u64 {
        (0..self.upstreams.len()).map(|i| self.upstream_ceiling(i)).max().unwrap_or(self.cap)
    }
}

/// An upstream's `host:port` (never credentials): its `upstream` label.
pub fn upstream_label(u: &Uri) -> String {
    let default_port = if u.scheme_str() == Some("https") { 443 } else { 80 };
    u.authority().map_or_else(String::new, |a| {
        format!("{}:{}", a.host(), a.port_u16().unwrap_or(default_port))
    })
}

/// An upstream URL without its credentials.
pub(super) fn redact(u: &Uri) -> String {
    match u.authority() {
        Some(a) if a.as_str().contains('@') => {
            let host = a.as_str().rsplit_once('@').map_or("", |(_, h)| h);
            format!("{}://[redacted]@{host}{}", u.scheme_str().unwrap_or("http"), u.path())
        }
        _ => u.to_string(),
    }
}

/// A route (`[[route]]`): requests for `host` (any host when absent) whose path starts with
/// `path_prefix` go to `dependency`. The longest matching prefix wins; a route with a host beats
/// one without.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouteConfig {
    /// The `Host` (without port), matched case-insensitively (kept lowercase); `None` matches
    /// any.
    #[serde(default, deserialize_with = "lowercase")]
    pub host: Option<String>,
    /// The path prefix, starting with `/`. Default `/`.
    #[serde(default = "root_path")]
    pub path_prefix: String,
    /// The dependency's name.
    pub dependency: String,
    /// The route's own budget, charged on top of the dependency's.
    #[serde(default)]
    pub budget: Option<BudgetSpec>,
    /// Every method on this route may be retried (gRPC: every call is a POST).
    #[serde(default)]
    pub idempotent: bool,
}

fn yes() -> bool {
    true
}

impl ListenerConfig {
    /// A listener on `listen` whose unrouted requests go to `dependency`, with every default.
    pub fn new(listen: SocketAddr, dependency: Option<String>) -> ListenerConfig {
        ListenerConfig {
            listen,
            dependency,
            downstream_pushback: true,
            tree: TreeMode::Off,
            tree_allowance: Allowance::default(),
        }
    }
}

fn root_path() -> String {
    "/".to_string()
}

fn lowercase<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    String::deserialize(d).map(|h| Some(h.to_ascii_lowercase()))
}

impl ProxyConfig {
    /// One listener in front of one dependency (the quick-start flags).
    pub fn single(listen: SocketAddr, dependency: ProxyDependency) -> ProxyConfig {
        ProxyConfig {
            listeners: vec![ListenerConfig::new(listen, Some(dependency.name.clone()))],
            dependencies: vec![dependency],
            routes: Vec::new(),
            admin: Some(DEFAULT_ADMIN.parse().expect("a valid address")),
            record: None,
            scope_max: DEFAULT_SCOPE_MAX,
            client_header: None,
            client_max: DEFAULT_CLIENT_MAX,
            drain_timeout: DEFAULT_DRAIN_TIMEOUT,
            body_idle_timeout: DEFAULT_BODY_IDLE_TIMEOUT,
            body_timeout: defaults::BODY_TIMEOUT,
            response_buffer: defaults::RESPONSE_BUFFER,
            response_idle_timeout: defaults::RESPONSE_IDLE_TIMEOUT,
            connections: ConnectionConfig::default(),
            admin_access: AdminAccessConfig::default(),
            source: None,
            overrides: Overrides::default(),
        }
    }
}

/// What the proxy does with a caller's own retries (`caller_retries`, per dependency).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CallerRetries {
    /// Charged to the budget and admitted like stormguard's own retries: refused at once when
    /// none is left (the default: a sidecar's point is a budget that holds whatever the
    /// caller's loop does).
    #[default]
    Enforce,
    /// Recognised and counted (`stormguard_caller_retries_total{outcome="counted"}`), sent as
    /// first tries: to measure before enforcing.
    Count,
    /// Not looked for: every request is a first try.
    Off,
}

impl CallerRetries {
    /// The value as the config writes it.
    pub fn as_str(self) -> &'static str {
        match self {
            CallerRetries::Enforce => "enforce",
            CallerRetries::Count => "count",
            CallerRetries::Off => "off",
        }
    }
}

impl fmt::Display for CallerRetries {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A `caller_retries` value that is none of the three.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("expected \"enforce\", \"count\" or \"off\", got {0:?}")]
pub struct BadCallerRetries(String);

impl FromStr for CallerRetries {
    type Err = BadCallerRetries;
    fn from_str(s: &str) -> Result<CallerRetries, BadCallerRetries> {
        match s {
            "enforce" => Ok(CallerRetries::Enforce),
            "count" => Ok(CallerRetries::Count),
            "off" => Ok(CallerRetries::Off),
            other => Err(BadCallerRetries(other.to_string())),
        }
    }
}
