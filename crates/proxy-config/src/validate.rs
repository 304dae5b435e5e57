//! The rules a configuration must keep, checked on the model whatever it was read from (a file,
//! the quick-start flags, code). A broken rule is a [`RuleError`] at the [`KeyPath`] of the key
//! that broke it (`dependency[0].cap`); reading a file adds the line and column.
//!
//! The limiter's, budget's, backoff's, breaker's and fleet's own rules are theirs: their typed
//! errors are wrapped here, under the key of the field they name, and never re-checked.

use std::net::SocketAddr;
use std::time::Duration;

use http::Uri;
use stormguard_config::{Invalid, KeyPath};
use stormguard_core::decision::MAX_RETRIES_LIMIT;
use stormguard_core::limiter::{LimiterConfig, MAX_CAP};

use super::{
    AdminTokenError, ConnectionConfig, FleetPlacement, ProxyConfig, ProxyDependency,
    RedisSourceError, upstream_label,
};
use stormguard_tls::TlsError;

/// A rule of the proxy's configuration that a value breaks. Each says what is wrong and, where
/// there is one, the fix.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RuleError {
    /// A rule of the limiter, backoff or breaker (core's own check).
    #[error(transparent)]
    Core(#[from] stormguard_core::ConfigError),
    /// A budget SPEC that does not build.
    #[error(transparent)]
    Budget(#[from] stormguard_core::budget::SpecError),
    /// A rule of the fleet placement (stormguard-redis's own check).
    #[error(transparent)]
    Fleet(#[from] stormguard_redis::FleetError),
    /// A Redis URL that does not read.
    #[error(transparent)]
    Redis(#[from] RedisSourceError),
    /// Limit headers that cannot be read as configured.
    #[error(transparent)]
    LimitHeaders(#[from] stormguard_http::headers::HeaderConfigError),
    /// A TLS file that cannot be used.
    #[error(transparent)]
    Tls(#[from] TlsError),
    /// An admin token that cannot be used.
    #[error(transparent)]
    AdminToken(#[from] AdminTokenError),
    /// The in-process dependency refused what the proxy built from this config (a
    /// `stormguard_tower::DependencyError`).
    #[error(transparent)]
    Dependency(Box<dyn std::error::Error + Send + Sync + 'static>),
    /// A number outside its range.
    #[error("must be between {min} and {max}, got {got}")]
    OutOfRange {
        /// The smallest allowed.
        min: u64,
        /// The largest allowed.
        max: u64,
        /// The value given.
        got: u64,
    },
    /// A number above its largest allowed value.
    #[error("must be at most {max}, got {got}")]
    TooLarge {
        /// The largest allowed, as said (`64 MiB`).
        max: &'static str,
        /// The value given.
        got: u64,
    },
    /// A duration of 0 where it must be more.
    #[error("must be more than 0")]
    Zero,
    /// A section the config needs is missing.
    #[error("a config needs at least one [[{0}]]")]
    Missing(&'static str),
    /// A name with characters outside letters, digits, `-`, `_`, `.`.
    #[error("a name is letters, digits, '-', '_' or '.', got {0:?}")]
    BadName(String),
    /// Two dependencies with one name.
    #[error("{0:?} is named twice")]
    NamedTwice(String),
    /// A listener or route names a dependency that is not there.
    #[error("no dependency is named {0:?}")]
    UnknownDependency(String),
    /// A listener with no dependency and no routes to send its requests.
    #[error("a listener needs a dependency when no [[route]] is configured")]
    ListenerWithoutDependency,
    /// A route path prefix not starting with `/`.
    #[error("must start with '/', got {0:?}")]
    PathPrefix(String),
    /// A dependency with no upstream.
    #[error("a dependency needs an upstream")]
    NoUpstream,
    /// An upstream that is not `http://host:port` or `https://host:port`.
    #[error("{0}: an upstream is http://host:port or https://host:port")]
    UpstreamScheme(String),
    /// An upstream with a path or query.
    #[error("{0}: an upstream has no path")]
    UpstreamPath(String),
    /// An upstream port that cannot be dialled.
    #[error("{upstream}: the port must be between 1 and 65535, got {port:?}")]
    UpstreamPort {
        /// The upstream, credentials redacted.
        upstream: String,
        /// The port as written.
        port: String,
    },
    /// One upstream listed twice.
    #[error("{0} is listed twice")]
    UpstreamTwice(String),
    /// More per-upstream caps than upstreams (code only).
    #[error("more caps than upstreams")]
    MoreCapsThanUpstreams,
    /// `total_cap` with a single upstream.
    #[error("total_cap is for several upstreams: use cap")]
    TotalCapWithOneUpstream,
    /// `placement = "fleet"` with several upstreams.
    #[error("a fleet dependency has one upstream (its lease is that upstream's cap)")]
    FleetWithSeveralUpstreams,
    /// `planned_primary` above the cap.
    #[error("planned_primary ({planned}) is above the cap ({cap}): no headroom for retries")]
    PlannedAboveCap {
        /// The planned primary concurrency.
        planned: u64,
        /// The cap.
        cap: u64,
    },
    /// `max_hedges` without `hedge_after`.
    #[error(
        "max_hedges needs hedge_after (a delay such as \"100ms\", or a percentile such as \"p95\")"
    )]
    HedgesWithoutHedgeAfter,
    /// `[dependency.tls]` with no `https://` upstream.
    #[error("[dependency.tls] applies to https:// upstreams only")]
    TlsWithoutHttps,
    /// An admin address beyond loopback without `admin_allow_remote`.
    #[error(
        "{0} is not a loopback address: the admin listener turns retries off and reloads the config, so serving it beyond this host needs admin_allow_remote = true (--admin-allow-remote), and an admin_token"
    )]
    RemoteAdmin(SocketAddr),
    /// A fleet key on a dependency that is not placed in the fleet.
    #[error("{0} is a fleet key: set placement = \"fleet\" to use it")]
    FleetKeyWithoutFleet(&'static str),
    /// `placement = "fleet"` without `max_instances`.
    #[error(
        "placement = \"fleet\" needs max_instances (the most instances at the fleet's peak), at least 1"
    )]
    NoMaxInstances,
    /// Each instance's share of the fleet cap without Redis rounds to 0.
    #[error(
        "the fallback share floor({} / max_instances) = floor({fleet_cap} / {max_instances}) is 0: \
         without Redis no instance would admit anything. Set fleet_cap to the whole \
         fleet's cap (at least {max_instances}), lower max_instances to at most {fleet_cap}, or set \
         fallback_min (the slots each instance keeps without Redis, overcommitting the \
         fleet cap; fallback_min = 0 admits nothing without Redis on purpose)",
        if *fleet_cap_set { "fleet_cap" } else { "fleet_cap (default: cap)" }
    )]
    FallbackShareZero {
        /// Whether `fleet_cap` was given (else it is the cap).
        fleet_cap_set: bool,
        /// The fleet cap.
        fleet_cap: u64,
        /// `max_instances`.
        max_instances: u64,
    },
}

/// A broken rule and where: what `validate` returns.
pub type RuleViolation = Invalid<RuleError>;

fn at(key: &str, e: impl Into<RuleError>) -> RuleViolation {
    Invalid::new(KeyPath::root().key(key), e.into())
}

fn range(key: &str, min: u64, max: u64, got: u64) -> Result<(), RuleViolation> {
    if (min..=max).contains(&got) {
        Ok(())
    } else {
        Err(at(key, RuleError::OutOfRange { min, max, got }))
    }
}

fn count(n: usize) -> u64 {
    u64::try_from(n).unwrap_or(u64::MAX)
}

impl ConnectionConfig {
    /// Checks every rule; the error names the key.
    pub fn validate(&self) -> Result<(), RuleViolation> {
        for (key, d) in [
            ("header_read_timeout", self.header_read_timeout),
            ("idle_timeout", self.idle_timeout),
            ("http2_keepalive_interval", self.http2_keepalive_interval),
        ] {
            if d.is_zero() {
                return Err(at(key, RuleError::Zero));
            }
        }
        if let Some(m) = self.max_connections {
            range("max_connections", 1, 16 * 1024 * 1024, count(m))?;
        }
        range("admin_max_connections", 1, 65_536, count(self.admin_max_connections))?;
        // hyper's HTTP/1.1 read buffer (which bounds the head) is at least 8 KiB.
        range("max_header_bytes", 8192, 1024 * 1024, count(self.max_header_bytes))?;
        range(
            "http2_max_concurrent_streams",
            1,
            i32::MAX as u64,
            u64::from(self.http2_max_concurrent_streams),
        )?;
        Ok(())
    }
}

impl FleetPlacement {
    /// Checks every rule; the error names the dependency's key.
    fn validate(&self, d: &ProxyDependency) -> Result<(), RuleViolation> {
        if self.max_instances == 0 {
            return Err(at("max_instances", RuleError::NoMaxInstances));
        }
        // The URL, when it is set here, is parsed as the proxy will parse it at start; one that
        // is not set is the proxy's to refuse (check-config notes it).
        if let Err(e @ RedisSourceError::Invalid { .. }) = self.redis.target() {
            return Err(at("redis", e));
        }
        let target = stormguard_redis::RedisTarget::plain("check", 6379);
        let c = self.to_fleet(d, target);
        c.validate().map_err(fleet_error)?;
        if self.fallback_min.is_none() && c.fallback_slots() == 0 {
            return Err(at(
                "max_instances",
                RuleError::FallbackShareZero {
                    fleet_cap_set: self.fleet_cap.is_some(),
                    fleet_cap: c.fleet_cap,
                    max_instances: c.max_instances,
                },
            ));
        }
        let fleet = stormguard_redis::Fleet::try_new(c).map_err(fleet_error)?;
        fleet.budget(&d.budget).map_err(fleet_error)?;
        Ok(())
    }
}

/// A fleet rule under the dependency's key for the field it names; the margin and the call
/// timeout follow from `lease_ttl`.
pub fn fleet_error(e: stormguard_redis::FleetError) -> RuleViolation {
    let key = match e.key() {
        "dependency" => "name",
        "margin" | "call_timeout" => "lease_ttl",
        other => other,
    };
    at(key, e)
}

/// A limiter rule under the dependency's key for the field it names.
fn limiter_error(e: stormguard_core::ConfigError) -> RuleViolation {
    let key = match e.key() {
        "queue_len" => "queue",
        // `adaptive.min` and its kin: a key inside the `adaptive` table.
        other => match other.split_once('.') {
            Some((table, key)) => {
                return Invalid::new(KeyPath::root().key(table).key(key), e.into());
            }
            None => other,
        },
    };
    at(key, e)
}

impl ProxyDependency {
    /// Checks every rule; the error names the key (`cap`, `budget`, `breaker.window`, ...)
    /// relative to the dependency. TLS files are read by [`ProxyDependency::check_files`].
    pub fn validate(&self) -> Result<(), RuleViolation> {
        if self.name.is_empty()
            || !self.name.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
        {
            return Err(at("name", RuleError::BadName(self.name.clone())));
        }
        if self.upstreams.is_empty() {
            return Err(at("upstreams", RuleError::NoUpstream));
        }
        let upstream =
            |i: usize, e: RuleError| Invalid::new(KeyPath::root().key("upstreams").index(i), e);
        for (i, u) in self.upstreams.iter().enumerate() {
            check_upstream(u).map_err(|e| upstream(i, e))?;
            if self.upstreams[..i].iter().any(|o| upstream_label(o) == upstream_label(u)) {
                return Err(upstream(i, RuleError::UpstreamTwice(u.to_string())));
            }
        }
        stormguard_http::headers::LimitHeaders::try_new(self.limit_headers.clone())
            .map_err(|e| at("limit_headers", e))?;
        if self.fleet.is_some() && self.upstreams.len() > 1 {
            return Err(at("placement", RuleError::FleetWithSeveralUpstreams));
        }
        if let Some(t) = self.total_cap {
            if self.upstreams.len() < 2 {
                return Err(at("total_cap", RuleError::TotalCapWithOneUpstream));
            }
            range("total_cap", 1, MAX_CAP, t)?;
        }
        if self.upstream_caps.len() > self.upstreams.len() {
            return Err(at("upstreams", RuleError::MoreCapsThanUpstreams));
        }
        for (i, c) in self.upstream_caps.iter().enumerate() {
            if let Some(c) = *c
                && !(1..=MAX_CAP).contains(&c)
            {
                let e = RuleError::OutOfRange { min: 1, max: MAX_CAP, got: c };
                return Err(Invalid::new(KeyPath::root().key("upstreams").index(i).key("cap"), e));
            }
        }
        for (i, a) in self.upstream_adaptive.iter().enumerate() {
            if let Some(a) = a {
                a.validate(MAX_CAP).map_err(|e| {
                    let path = KeyPath::root().key("upstreams").index(i).key("adaptive");
                    let key = e.key().split_once('.').map_or(e.key(), |(_, k)| k);
                    Invalid::new(path.key(key), e.into())
                })?;
            }
        }
        // The dependency's own cap and queue, by the limiter's rules, under their own keys.
        LimiterConfig {
            cap: self.cap,
            queue_len: self.queue,
            queue_timeout: self.queue_timeout,
            adaptive: self.adaptive,
        }
        .validate()
        .map_err(limiter_error)?;
        if let Some(p) = self.planned_primary
            && p > self.cap
        {
            return Err(at(
                "planned_primary",
                RuleError::PlannedAboveCap { planned: p, cap: self.cap },
            ));
        }
        // Before the limiter's own check: the stream limit bounds each upstream's cap, and a 0
        // here would be reported as a cap of 0.
        if let Some(m) = self.http2.max_concurrent_streams {
            range("max_concurrent_streams", 1, i32::MAX as u64, u64::from(m))?;
        }
        self.limiter_config().validate().map_err(limiter_error)?;
        self.budget.build().map_err(|e| at("budget", e))?;
        if self.max_retries > MAX_RETRIES_LIMIT {
            return Err(at(
                "max_retries",
                RuleError::OutOfRange {
                    min: 0,
                    max: u64::from(MAX_RETRIES_LIMIT),
                    got: u64::from(self.max_retries),
                },
            ));
        }
        self.backoff.validate().map_err(|e| at("backoff", e))?;
        if let Some(h) = &self.hedge {
            h.validate().map_err(|e| at(e.key(), e))?;
        }
        if let Some(b) = &self.breaker {
            b.validate().map_err(|e| {
                Invalid::new(KeyPath::root().key("breaker").key(e.key()), RuleError::Core(e))
            })?;
        }
        for (key, d) in [("per_try_timeout", self.per_try_timeout), ("deadline", self.deadline)] {
            if d == Some(Duration::ZERO) {
                return Err(at(key, RuleError::Zero));
            }
        }
        if self.body_limit > 64 * 1024 * 1024 {
            return Err(at(
                "body_limit",
                RuleError::TooLarge { max: "64 MiB", got: count(self.body_limit) },
            ));
        }
        if let Some(f) = &self.fleet {
            f.validate(self)?;
        }
        for (key, limit) in [
            ("requests_per_minute", self.rate.requests_per_minute),
            ("tokens_per_minute", self.rate.tokens_per_minute),
            ("input_tokens_per_minute", self.rate.input_tokens_per_minute),
            ("output_tokens_per_minute", self.rate.output_tokens_per_minute),
        ] {
            if let Some(n) = limit {
                range(key, 1, 1_000_000_000_000, n)?;
            }
        }
        range("bytes_per_token", 1, 1_000_000, self.bytes_per_token)?;
        // A retry loop's backoff is well inside a minute; a longer window only charges users'
        // identical requests as each other's retries.
        range("client_retry_window", 1, 60, self.client_retry_window.as_secs())?;
        range("usage_max_factor", 1, u64::MAX, self.rate.usage_max_factor)?;
        if self.rate.max_hold.is_zero() {
            return Err(at("max_hold", RuleError::Zero));
        }
        let https = self.upstreams.iter().any(|u| u.scheme_str() == Some("https"));
        if self.tls.is_set() && !https {
            return Err(at("tls", RuleError::TlsWithoutHttps));
        }
        Ok(())
    }

    /// Reads the TLS files of `https://` upstreams: a missing or invalid one is a config
    /// error, not a failed request.
    #[cfg(feature = "files")]
    pub fn check_files(&self) -> Result<(), RuleViolation> {
        if self.upstreams.iter().any(|u| u.scheme_str() == Some("https")) {
            stormguard_tls::client_config(&self.tls, None).map_err(tls_error)?;
        }
        Ok(())
    }
}

/// A TLS error under the dependency's key for the file it names (`tls.ca_file`).
pub fn tls_error(e: TlsError) -> RuleViolation {
    let key = e.key().split('.').fold(KeyPath::root(), KeyPath::key);
    Invalid::new(key, RuleError::Tls(e))
}

/// An upstream must be `http://host:port` or `https://host:port` with no path.
fn check_upstream(u: &Uri) -> Result<(), RuleError> {
    if !matches!(u.scheme_str(), Some("http" | "https")) || u.authority().is_none() {
        return Err(RuleError::UpstreamScheme(u.to_string()));
    }
    if !matches!(u.path(), "" | "/") || u.query().is_some() {
        return Err(RuleError::UpstreamPath(u.to_string()));
    }
    // `http::Uri` accepts a port it cannot use (`:99999`, `:0`) and then reports none, so the
    // upstream would be dialled on the scheme's default port, or not at all.
    let authority = u.authority().map_or("", |a| a.as_str());
    let host_port = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
    if let Some((_, port)) = host_port.rsplit_once(':').filter(|_| !host_port.ends_with(']'))
        && !port.parse::<u16>().is_ok_and(|p| p != 0)
    {
        return Err(RuleError::UpstreamPort {
            upstream: super::model::redact(u),
            port: port.to_string(),
        });
    }
    Ok(())
}

impl ProxyConfig {
    /// Checks every rule; the error names the key (`dependency[0].cap`) and why. TLS files
    /// are read by [`ProxyConfig::check_files`].
    pub fn validate(&self) -> Result<(), RuleViolation> {
        if self.dependencies.is_empty() {
            return Err(at("dependency", RuleError::Missing("dependency")));
        }
        if self.body_idle_timeout.is_zero() {
            return Err(at("body_idle_timeout", RuleError::Zero));
        }
        // Read ahead per answer: memory each stalled caller can hold until the idle timeout.
        range("response_buffer", 0, 64 * 1024 * 1024, count(self.response_buffer))?;
        self.connections.validate()?;
        if let Some(a) = self.admin
            && !a.ip().is_loopback()
            && !self.admin_access.allow_remote
        {
            return Err(at("admin", RuleError::RemoteAdmin(a)));
        }
        for (i, d) in self.dependencies.iter().enumerate() {
            let here = KeyPath::root().key("dependency").index(i);
            d.validate().map_err(|e| e.under(&here))?;
            if self.dependencies[..i].iter().any(|o| o.name == d.name) {
                return Err(Invalid::new(here.key("name"), RuleError::NamedTwice(d.name.clone())));
            }
        }
        if self.listeners.is_empty() {
            return Err(at("listener", RuleError::Missing("listener")));
        }
        let known = |n: &str| self.dependencies.iter().any(|d| d.name == n);
        for (i, l) in self.listeners.iter().enumerate() {
            let key = KeyPath::root().key("listener").index(i).key("dependency");
            if let Some(n) = &l.dependency
                && !known(n)
            {
                return Err(Invalid::new(key, RuleError::UnknownDependency(n.clone())));
            }
            if l.dependency.is_none() && self.routes.is_empty() {
                return Err(Invalid::new(key, RuleError::ListenerWithoutDependency));
            }
        }
        for (i, r) in self.routes.iter().enumerate() {
            let here = KeyPath::root().key("route").index(i);
            if !known(&r.dependency) {
                return Err(Invalid::new(
                    here.key("dependency"),
                    RuleError::UnknownDependency(r.dependency.clone()),
                ));
            }
            if !r.path_prefix.starts_with('/') {
                return Err(Invalid::new(
                    here.key("path_prefix"),
                    RuleError::PathPrefix(r.path_prefix.clone()),
                ));
            }
            if let Some(b) = &r.budget {
                b.build().map_err(|e| Invalid::new(here.key("budget"), e.into()))?;
            }
        }
        range("scope_max", 1, 16 * 1024 * 1024, count(self.scope_max))?;
        range("client_max", 1, 10_000, count(self.client_max))?;
        Ok(())
    }

    /// Reads every dependency's TLS files (see [`ProxyDependency::check_files`]).
    #[cfg(feature = "files")]
    pub fn check_files(&self) -> Result<(), RuleViolation> {
        for (i, d) in self.dependencies.iter().enumerate() {
            d.check_files().map_err(|e| e.under(&KeyPath::root().key("dependency").index(i)))?;
        }
        Ok(())
    }
}
