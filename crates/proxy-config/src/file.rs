//! The config file's shape: what `serde` reads from TOML before the rules are checked.
//!
//! Sections whose keys are the model's fields (`[[listener]]`, `[[route]]`,
//! `[dependency.tls]`) are read straight into the model. Two sections are laid out flat in the
//! file where the model groups them, so they have a shape of their own here, with every key
//! optional and typed: the top level (the connection keys and the admin access keys sit beside
//! `admin` and `record`) and `[[dependency]]` (the fleet keys, `http2` and
//! `max_concurrent_streams` sit beside `cap`). serde's `flatten` cannot refuse unknown keys, and
//! an unknown key must be an error. A key left out keeps the model's default, which lives in
//! one place: [`ProxyDependency::new`], [`ProxyConfig::single`] and `stormguard_core::defaults`.

use std::fmt;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use http::{HeaderName, Uri};
use serde::Deserialize;
use serde::de::{self, Deserializer, MapAccess, Visitor};
use stormguard_config::de as sde;
use stormguard_config::{Invalid, KeyPath};
use stormguard_core::backoff::BackoffConfig;
use stormguard_core::breaker::BreakerConfig;
use stormguard_core::budget::BudgetSpec;
use stormguard_core::conditions::RetryOn;
use stormguard_core::decimal::Fraction;
use stormguard_http::headers::{ResetFormat, ResetHeader};

use super::validate::{RuleError, RuleViolation};
use super::{
    AdminToken, FleetPlacement, ListenerConfig, ProxyConfig, ProxyDependency, RedisSource,
    RouteConfig, TlsConfig,
};

/// The top level of the file.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct ProxyFile {
    #[serde(default)]
    listener: Vec<ListenerConfig>,
    #[serde(default)]
    dependency: Vec<DependencyFile>,
    #[serde(default)]
    route: Vec<RouteConfig>,
    #[serde(default, deserialize_with = "admin")]
    admin: Option<Option<SocketAddr>>,
    record: Option<PathBuf>,
    scope_max: Option<usize>,
    #[serde(default, deserialize_with = "sde::option_from_str")]
    client_header: Option<HeaderName>,
    client_max: Option<usize>,
    #[serde(default, deserialize_with = "sde::option_duration")]
    drain_timeout: Option<Duration>,
    #[serde(default, deserialize_with = "sde::option_duration")]
    body_idle_timeout: Option<Duration>,
    #[serde(default, deserialize_with = "sde::option_duration")]
    body_timeout: Option<Duration>,
    response_buffer: Option<usize>,
    #[serde(default, deserialize_with = "sde::option_duration")]
    response_idle_timeout: Option<Duration>,
    #[serde(default, deserialize_with = "sde::option_duration")]
    header_read_timeout: Option<Duration>,
    #[serde(default, deserialize_with = "sde::option_duration")]
    idle_timeout: Option<Duration>,
    max_connections: Option<usize>,
    admin_max_connections: Option<usize>,
    max_header_bytes: Option<usize>,
    http2_max_concurrent_streams: Option<u32>,
    #[serde(default, deserialize_with = "sde::option_duration")]
    http2_keepalive_interval: Option<Duration>,
    admin_allow_remote: Option<bool>,
    #[serde(default, deserialize_with = "admin_token")]
    admin_token: Option<AdminToken>,
}

/// Puts each `Some` field of `$from` into `$to`, field for field.
macro_rules! set {
    ($to:expr, $from:expr; $($field:ident),* $(,)?) => {
        $(if let Some(v) = $from.$field { $to.$field = v; })*
    };
}

impl ProxyFile {
    /// The model this file describes, every key it leaves out at its default. A fleet key on a
    /// dependency not placed in the fleet is the one rule that needs the file's own shape.
    pub(super) fn into_model(self) -> Result<ProxyConfig, RuleViolation> {
        let mut c = ProxyConfig::single(
            "127.0.0.1:0".parse().expect("a valid address"),
            ProxyDependency::new("unset", Uri::from_static("http://unset")),
        );
        c.listeners = self.listener;
        c.routes = self.route;
        c.dependencies = self
            .dependency
            .into_iter()
            .enumerate()
            .map(|(i, d)| {
                d.into_model().map_err(|e| e.under(&KeyPath::root().key("dependency").index(i)))
            })
            .collect::<Result<_, _>>()?;
        if let Some(a) = self.admin {
            c.admin = a;
        }
        c.record = self.record;
        c.client_header = self.client_header;
        set!(c, self; scope_max, client_max, drain_timeout, body_idle_timeout, body_timeout,
            response_buffer, response_idle_timeout);
        let n = &mut c.connections;
        set!(n, self; header_read_timeout, idle_timeout, admin_max_connections, max_header_bytes,
            http2_max_concurrent_streams, http2_keepalive_interval);
        n.max_connections = self.max_connections;
        if let Some(v) = self.admin_allow_remote {
            c.admin_access.allow_remote = v;
        }
        c.admin_access.token = self.admin_token;
        Ok(c)
    }
}

/// `placement`: where the dependency's cap lives.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
enum Placement {
    /// This instance's own cap.
    #[default]
    Local,
    /// Shared by every instance through Redis.
    Fleet,
}

/// One `[[dependency]]`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct DependencyFile {
    name: String,
    upstreams: Vec<Upstream>,
    cap: Option<u64>,
    queue: Option<u64>,
    #[serde(default, deserialize_with = "sde::option_duration")]
    queue_timeout: Option<Duration>,
    budget: Option<BudgetSpec>,
    #[serde(default, deserialize_with = "sde::option_from_str")]
    retry_on: Option<RetryOn>,
    max_retries: Option<u32>,
    #[serde(default, deserialize_with = "sde::option_duration")]
    per_try_timeout: Option<Duration>,
    #[serde(default, deserialize_with = "sde::option_duration")]
    deadline: Option<Duration>,
    #[serde(default, deserialize_with = "backoff")]
    backoff: Option<BackoffConfig>,
    enforce: Option<bool>,
    breaker: Option<BreakerFile>,
    scope_retries: Option<u64>,
    #[serde(default, deserialize_with = "sde::option_from_str")]
    scope_header: Option<HeaderName>,
    #[serde(default, deserialize_with = "sde::option_duration")]
    timeout_slot_hold: Option<Duration>,
    #[serde(default, deserialize_with = "sde::option_duration")]
    abandon_hold: Option<Duration>,
    body_limit: Option<usize>,
    planned_primary: Option<u64>,
    limit_headers: Option<LimitHeadersFile>,
    remaining_reserve: Option<u64>,
    total_cap: Option<u64>,
    #[serde(default)]
    placement: Placement,
    #[serde(default, deserialize_with = "redis")]
    redis: Option<RedisSource>,
    fleet_cap: Option<u64>,
    max_instances: Option<u64>,
    #[serde(default, deserialize_with = "sde::option_duration")]
    lease_ttl: Option<Duration>,
    #[serde(default, deserialize_with = "sde::option_duration")]
    interval: Option<Duration>,
    fallback_min: Option<u64>,
    instance: Option<String>,
    http2: Option<bool>,
    /// Read wide, so that a value past `u32` gets the range in its message.
    max_concurrent_streams: Option<u64>,
    #[serde(default)]
    tls: TlsConfig,
    requests_per_minute: Option<u64>,
    tokens_per_minute: Option<u64>,
    input_tokens_per_minute: Option<u64>,
    output_tokens_per_minute: Option<u64>,
    learn_rate_limits: Option<bool>,
    #[serde(default, deserialize_with = "sde::option_from_str")]
    provider: Option<stormguard_http::rate::Provider>,
    #[serde(default, deserialize_with = "sde::option_duration")]
    quota_hold: Option<Duration>,
    #[serde(default, deserialize_with = "sde::option_duration")]
    overload_cool_down: Option<Duration>,
    #[serde(default, deserialize_with = "sde::option_duration")]
    max_hold: Option<Duration>,
    usage_max_factor: Option<u64>,
    bytes_per_token: Option<u64>,
    #[serde(default, deserialize_with = "sde::option_from_str")]
    hedge_after: Option<stormguard_core::hedge::HedgeAfter>,
    max_hedges: Option<u32>,
    adaptive: Option<AdaptiveFile>,
    #[serde(default, deserialize_with = "sde::option_from_str")]
    caller_retries: Option<super::CallerRetries>,
    #[serde(default, deserialize_with = "sde::option_duration")]
    client_retry_window: Option<Duration>,
}

/// `adaptive = { min = 4, max = 40 }`: an adaptive cap (`algorithm`, `window` and `tolerance`
/// keep their defaults when left out).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct AdaptiveFile {
    min: u64,
    max: u64,
    #[serde(default, deserialize_with = "sde::option_from_str")]
    algorithm: Option<stormguard_core::adaptive::Algorithm>,
    #[serde(default, deserialize_with = "sde::option_duration")]
    window: Option<Duration>,
    tolerance: Option<u32>,
}

impl AdaptiveFile {
    fn into_model(self) -> stormguard_core::adaptive::AdaptiveConfig {
        let mut a = stormguard_core::adaptive::AdaptiveConfig::new(self.min, self.max);
        set!(a, self; algorithm, window, tolerance);
        a
    }
}

impl DependencyFile {
    fn into_model(self) -> Result<ProxyDependency, RuleViolation> {
        let mut d = ProxyDependency::new(self.name, Uri::from_static("http://unset"));
        // A provider's preset retries what its own SDKs retry, unless retry_on says otherwise.
        if let Some(p) = self.provider {
            d.retry_on = p.retry_on();
        }
        d.upstreams.clear();
        for u in self.upstreams {
            d.upstreams.push(u.url);
            d.upstream_caps.push(u.cap);
            d.upstream_adaptive.push(u.adaptive.map(AdaptiveFile::into_model));
        }
        set!(d, self; cap, queue, queue_timeout, budget, retry_on, max_retries, backoff, enforce,
            scope_retries, scope_header, timeout_slot_hold, abandon_hold, body_limit,
            remaining_reserve);
        d.per_try_timeout = self.per_try_timeout;
        d.deadline = self.deadline;
        d.planned_primary = self.planned_primary;
        d.total_cap = self.total_cap;
        d.breaker = self.breaker.map(BreakerFile::into_model);
        if let Some(h) = self.limit_headers {
            set!(d.limit_headers, h; limit, remaining);
            if let Some(r) = h.reset {
                d.limit_headers.resets = r.into_iter().map(|r| r.0).collect();
            }
        }
        if let Some(v) = self.http2 {
            d.http2.prior_knowledge = v;
        }
        d.http2.max_concurrent_streams = match self.max_concurrent_streams {
            None => None,
            Some(got) => Some(u32::try_from(got).map_err(|_| {
                let e = RuleError::OutOfRange { min: 1, max: i32::MAX as u64, got };
                Invalid::new(KeyPath::root().key("max_concurrent_streams"), e)
            })?),
        };
        d.tls = self.tls;
        d.rate.requests_per_minute = self.requests_per_minute;
        d.rate.tokens_per_minute = self.tokens_per_minute;
        d.rate.input_tokens_per_minute = self.input_tokens_per_minute;
        d.rate.output_tokens_per_minute = self.output_tokens_per_minute;
        d.rate.learn = self.learn_rate_limits.unwrap_or(false);
        d.rate.provider = self.provider;
        set!(d.rate, self; quota_hold, overload_cool_down, max_hold, usage_max_factor);
        set!(d, self; bytes_per_token, caller_retries, client_retry_window);
        d.adaptive = self.adaptive.map(AdaptiveFile::into_model);
        d.hedge = match (self.hedge_after, self.max_hedges) {
            (Some(after), n) => {
                Some(stormguard_core::hedge::HedgeConfig { after, max_hedges: n.unwrap_or(1) })
            }
            (None, Some(_)) => {
                return Err(Invalid::new(
                    KeyPath::root().key("max_hedges"),
                    RuleError::HedgesWithoutHedgeAfter,
                ));
            }
            (None, None) => None,
        };

        let fleet_keys = [
            ("redis", self.redis.is_some()),
            ("fleet_cap", self.fleet_cap.is_some()),
            ("max_instances", self.max_instances.is_some()),
            ("lease_ttl", self.lease_ttl.is_some()),
            ("interval", self.interval.is_some()),
            ("fallback_min", self.fallback_min.is_some()),
            ("instance", self.instance.is_some()),
        ];
        if self.placement == Placement::Local {
            if let Some((key, _)) = fleet_keys.iter().find(|(_, set)| *set) {
                return Err(Invalid::new(
                    KeyPath::root().key(*key),
                    RuleError::FleetKeyWithoutFleet(key),
                ));
            }
            return Ok(d);
        }
        let Some(max_instances) = self.max_instances else {
            return Err(Invalid::new(KeyPath::root().key("placement"), RuleError::NoMaxInstances));
        };
        let mut f = FleetPlacement::new(max_instances);
        if let Some(r) = self.redis {
            f.redis = r;
        }
        set!(f, self; lease_ttl, interval);
        f.fleet_cap = self.fleet_cap;
        f.fallback_min = self.fallback_min;
        f.instance = self.instance;
        d.fleet = Some(f);
        Ok(d)
    }
}

/// `[dependency.breaker]`: any key left out keeps the breaker's default.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct BreakerFile {
    #[serde(default, deserialize_with = "fraction")]
    failure_ratio: Option<Fraction>,
    min_requests: Option<u64>,
    #[serde(default, deserialize_with = "sde::option_duration")]
    window: Option<Duration>,
    /// 0 turns the consecutive-failure rule off.
    consecutive_failures: Option<u64>,
    #[serde(default, deserialize_with = "sde::option_duration")]
    break_duration: Option<Duration>,
    half_open_probes: Option<u64>,
}

impl BreakerFile {
    fn into_model(self) -> BreakerConfig {
        let mut c = BreakerConfig::default();
        set!(c, self; failure_ratio, min_requests, window, break_duration, half_open_probes);
        if let Some(n) = self.consecutive_failures {
            c.consecutive_failures = Some(n).filter(|n| *n > 0);
        }
        c
    }
}

/// `limit_headers = { limit = [...], remaining = [...], reset = ["name:format", ...] }`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct LimitHeadersFile {
    limit: Option<Vec<String>>,
    remaining: Option<Vec<String>>,
    reset: Option<Vec<Reset>>,
}

/// A reset header: `"name"` (unix-or-delta) or `"name:format"` (unix, unix-ms, delta,
/// rfc3339).
#[derive(Debug)]
struct Reset(ResetHeader);

impl<'de> Deserialize<'de> for Reset {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Reset, D::Error> {
        let text = String::deserialize(d)?;
        let (name, format) = match text.split_once(':') {
            Some((n, f)) => (n, f.parse::<ResetFormat>().map_err(de::Error::custom)?),
            None => (text.as_str(), ResetFormat::UnixOrDelta),
        };
        Ok(Reset(ResetHeader { name: name.to_string(), format }))
    }
}

/// An upstream: a URL, or a table `{ url = "...", cap = N }` with its own cap.
#[derive(Debug)]
struct Upstream {
    url: Uri,
    cap: Option<u64>,
    adaptive: Option<AdaptiveFile>,
}

impl<'de> Deserialize<'de> for Upstream {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Upstream, D::Error> {
        struct V;
        fn url<E: de::Error>(text: &str) -> Result<Uri, E> {
            text.parse::<Uri>().map_err(|e| E::custom(format!("{text:?}: {e}")))
        }
        impl<'de> Visitor<'de> for V {
            type Value = Upstream;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a URL or a table { url = \"http://host:port\", cap = N, adaptive = { min, max } }")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Upstream, E> {
                Ok(Upstream { url: url(v)?, cap: None, adaptive: None })
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Upstream, A::Error> {
                let (mut u, mut cap, mut adaptive) = (None, None, None);
                while let Some(key) = map.next_key::<String>()? {
                    match key.as_str() {
                        "url" => u = Some(url(&map.next_value::<String>()?)?),
                        "cap" => cap = Some(map.next_value::<u64>()?),
                        "adaptive" => adaptive = Some(map.next_value::<AdaptiveFile>()?),
                        other => {
                            return Err(de::Error::unknown_field(
                                other,
                                &["url", "cap", "adaptive"],
                            ));
                        }
                    }
                }
                let url = u.ok_or_else(|| {
                    de::Error::custom("an upstream table needs url = \"http://host:port\"")
                })?;
                Ok(Upstream { url, cap, adaptive })
            }
        }
        d.deserialize_any(V)
    }
}

/// `admin = "host:port"` or `"off"`.
fn admin<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Option<SocketAddr>>, D::Error> {
    let text = String::deserialize(d)?;
    if text == "off" {
        return Ok(Some(None));
    }
    text.parse()
        .map(|a| Some(Some(a)))
        .map_err(|_| de::Error::custom(format!("expected host:port or \"off\", got {text:?}")))
}

/// `"env:NAME"`, and nothing else: a secret is never in the file.
fn env_name<'de, D: Deserializer<'de>>(d: D, refusal: &'static str) -> Result<String, D::Error> {
    let text = String::deserialize(d)?;
    match text.strip_prefix("env:") {
        Some(name) if !name.is_empty() => Ok(name.to_string()),
        // The value is not repeated: it may be the secret itself.
        _ => Err(de::Error::custom(refusal)),
    }
}

fn admin_token<'de, D: Deserializer<'de>>(d: D) -> Result<Option<AdminToken>, D::Error> {
    env_name(
        d,
        "the admin token comes from an environment variable: admin_token = \"env:STORMGUARD_ADMIN_TOKEN\"",
    )
    .map(|n| Some(AdminToken::Env(n)))
}

fn redis<'de, D: Deserializer<'de>>(d: D) -> Result<Option<RedisSource>, D::Error> {
    env_name(
        d,
        "the Redis URL and its password come from an environment variable: redis = \"env:STORMGUARD_REDIS_URL\"",
    )
    .map(|n| Some(RedisSource::Env(n)))
}

/// A backoff range `BASE..MAX`.
fn backoff<'de, D: Deserializer<'de>>(d: D) -> Result<Option<BackoffConfig>, D::Error> {
    let text = String::deserialize(d)?;
    BackoffConfig::parse_range(&text).map(Some).map_err(de::Error::custom)
}

fn fraction<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Fraction>, D::Error> {
    sde::from_number_or_str(d).map(Some)
}
