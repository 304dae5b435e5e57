//! clap value parsers: each command-line value goes through the parser of the crate that owns
//! its type, with that crate's typed error, while clap reads the flags. A bad value is then
//! clap's usage error, naming the flag and the value, with exit code 2, before any command
//! runs:
//!
//! ```text
//! error: invalid value 'ratio:percent=x' for '--budget <SPEC>': ...
//! ```
//!
//! Checks that need several flags at once (a `--latency-p99` beside a `--latency` range, a
//! config's own validation) stay with the command.

use std::net::SocketAddr;
use std::time::Duration;

use http::header::{HeaderName, HeaderValue};
use http::{Method, Uri};
use stormguard_audit::{BadIstioVersion, IstioVersion, Severity, UnknownSeverity};
use stormguard_chaos::{BadRate, BadWindow, Rate, Window};
use stormguard_core::ConfigError;
use stormguard_core::backoff::BackoffConfig;
use stormguard_core::budget::{BudgetSpec, SpecError};
use stormguard_core::conditions::{RetryOn, UnknownCondition};
use stormguard_core::decimal::{ParseError, parse_duration};
use stormguard_proxy::config::AdminToken;

/// A duration such as `250ms`, `10s` or `2m` (a bare number is seconds).
pub fn duration(text: &str) -> Result<Duration, ParseError> {
    parse_duration(text)
}

/// A retry budget SPEC such as `ratio:percent=0.2,min_per_sec=10,ttl=10s`.
pub fn budget(text: &str) -> Result<BudgetSpec, SpecError> {
    BudgetSpec::parse(text)
}

/// A `retry_on` list such as `5xx,reset,connect-failure`.
pub fn retry_on(text: &str) -> Result<RetryOn, UnknownCondition> {
    text.parse()
}

/// A backoff range `base..max`, such as `25ms..250ms`.
pub fn backoff(text: &str) -> Result<BackoffConfig, ConfigError> {
    BackoffConfig::parse_range(text)
}

/// A URI such as `http://127.0.0.1:9000`.
pub fn uri(text: &str) -> Result<Uri, http::uri::InvalidUri> {
    text.parse()
}

/// A model provider's shape, `openai` or `anthropic` (`chaos --provider`).
pub fn provider(
    text: &str,
) -> Result<stormguard_chaos::ProviderKind, stormguard_chaos::UnknownProvider> {
    text.parse()
}

/// The proxy's provider preset: `openai`, `anthropic` or `generic`.
pub fn provider_preset(
    text: &str,
) -> Result<stormguard_tower::Provider, stormguard_tower::rate::UnknownProvider> {
    text.parse()
}

/// A hedge delay, `100ms`, or a percentile, `p95`.
pub fn hedge_after(
    text: &str,
) -> Result<stormguard_core::hedge::HedgeAfter, stormguard_core::hedge::BadHedgeAfter> {
    text.parse()
}

/// A span of time since the start, `FROM..TO`, such as `2s..4s` (`chaos --overloaded`).
pub fn window(text: &str) -> Result<Window, BadWindow> {
    text.parse()
}

/// A rate such as `200/s` or `5/100ms`.
pub fn rate(text: &str) -> Result<Rate, BadRate> {
    text.parse()
}

/// An HTTP method token such as `GET` or `PURGE`.
pub fn method(text: &str) -> Result<Method, http::method::InvalidMethod> {
    Method::from_bytes(text.as_bytes())
}

/// A request header that is not `Name: value`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum BadHeader {
    /// No `:` between a name and a value.
    #[error("not \"Name: value\"")]
    NoColon,
    /// The name is not a header name.
    #[error("`{0}` is not a header name")]
    Name(String),
    /// The value holds a byte a header value cannot (a control character).
    #[error("the value is not a header value")]
    Value,
}

/// A request header, `Name: value` (whitespace around each part is dropped).
pub fn header(text: &str) -> Result<(HeaderName, HeaderValue), BadHeader> {
    let (name, value) = text.split_once(':').ok_or(BadHeader::NoColon)?;
    let name = HeaderName::from_bytes(name.trim().as_bytes())
        .map_err(|_| BadHeader::Name(name.trim().to_string()))?;
    let value = HeaderValue::from_str(value.trim()).map_err(|_| BadHeader::Value)?;
    Ok((name, value))
}

/// `--admin`: an address, or `off`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admin {
    /// No admin listener.
    Off,
    /// The admin listener's address.
    At(SocketAddr),
}

impl Admin {
    /// The address, `None` when off.
    pub fn addr(self) -> Option<SocketAddr> {
        match self {
            Admin::Off => None,
            Admin::At(a) => Some(a),
        }
    }
}

/// Neither `host:port` nor `off`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("expected host:port or off")]
pub struct BadAdmin;

/// An admin address (`127.0.0.1:9901`) or `off`.
pub fn admin(text: &str) -> Result<Admin, BadAdmin> {
    match text {
        "off" => Ok(Admin::Off),
        a => a.parse().map(Admin::At).map_err(|_| BadAdmin),
    }
}

/// An admin token given on the command line instead of named.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("the token comes from an environment variable: --admin-token env:NAME")]
pub struct TokenNotInEnv;

/// `env:NAME`: the admin token is read from the environment variable `NAME` (never from the
/// command line, where `ps` shows it).
pub fn admin_token(text: &str) -> Result<AdminToken, TokenNotInEnv> {
    match text.strip_prefix("env:") {
        Some(name) if !name.is_empty() => Ok(AdminToken::Env(name.to_string())),
        _ => Err(TokenNotInEnv),
    }
}

/// `--latency`: fixed, or a uniform range.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LatencyFlag {
    /// Every request takes this long (the median when a p99 is given).
    Fixed(Duration),
    /// Uniform in `min..max`.
    Range {
        /// The shortest.
        min: Duration,
        /// The longest.
        max: Duration,
    },
}

/// A latency: a duration (`50ms`) or a uniform range (`10ms..30ms`).
pub fn latency(text: &str) -> Result<LatencyFlag, ParseError> {
    Ok(match text.split_once("..") {
        Some((min, max)) => LatencyFlag::Range { min: duration(min)?, max: duration(max)? },
        None => LatencyFlag::Fixed(duration(text)?),
    })
}

/// A finding level: `info`, `warning` or `error`.
pub fn severity(text: &str) -> Result<Severity, UnknownSeverity> {
    text.parse()
}

/// An Istio release such as `1.22`, or `current`.
pub fn istio_version(text: &str) -> Result<IstioVersion, BadIstioVersion> {
    text.parse()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_parser_keeps_its_crates_error() {
        assert_eq!(duration("250ms"), Ok(Duration::from_millis(250)));
        assert!(matches!(duration("soon"), Err(ParseError::NotDuration(_))));
        assert!(budget("ratio:percent=x").is_err());
        assert!(retry_on("5xx,sometimes").is_err());
        assert!(backoff("25ms").is_err());
        assert!(uri("http://[::1").is_err());
        assert!(rate("lots").is_err());
        assert!(method("GE T").is_err());
        assert_eq!(header("no-colon"), Err(BadHeader::NoColon));
        assert_eq!(header("x y: 1"), Err(BadHeader::Name("x y".into())));
        assert_eq!(header("x: a\u{7f}b"), Err(BadHeader::Value));
        assert_eq!(
            header(" x-a : 1 ").map(|(n, v)| (n.to_string(), v)),
            Ok(("x-a".into(), HeaderValue::from_static("1")))
        );
        assert_eq!(admin("off"), Ok(Admin::Off));
        assert_eq!(admin("127.0.0.1:9").map(Admin::addr), Ok(Some(([127, 0, 0, 1], 9).into())));
        assert_eq!(admin("localhost"), Err(BadAdmin));
        assert_eq!(admin_token("env:T"), Ok(AdminToken::Env("T".into())));
        assert_eq!(admin_token("hunter2"), Err(TokenNotInEnv));
        assert_eq!(admin_token("env:"), Err(TokenNotInEnv));
        let ms = Duration::from_millis;
        assert_eq!(latency("10ms..30ms"), Ok(LatencyFlag::Range { min: ms(10), max: ms(30) }));
        assert_eq!(latency("50ms"), Ok(LatencyFlag::Fixed(ms(50))));
        assert!(latency("10ms..").is_err());
        assert_eq!(severity("warn"), Ok(Severity::Warning));
        assert_eq!(istio_version("x"), Err(BadIstioVersion("x".into())));
    }
}
