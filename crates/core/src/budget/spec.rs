//! Budget SPECs: one line of text that names a policy and its parameters.
//!
//! `KIND:key=value,...`, e.g. `ratio:percent=0.2,min_per_sec=10,ttl=10s`,
//! `concurrency:percent=0.2,min=3`, `concurrency:slots=4`,
//! `token-bucket:max_tokens=10,token_ratio=0.1`,
//! `quota:capacity=500,retry_cost=5,timeout_cost=10,success_reward=1`. A key left out takes its
//! default; `ratio` alone is the default ratio budget. The same text is accepted by
//! `stormguard replay --policy`, the proxy's `--budget` and its config file.

use crate::error::ConfigError;
use std::fmt;
use std::time::Duration;

use super::{
    AnyBudget, ConcurrencyBudget, ConcurrencyConfig, DepositOn, QuotaBudget, QuotaConfig,
    RatioBudget, RatioConfig, TokenBucket, TokenBucketConfig,
};
use crate::decimal::{
    Excess, Fraction, format_duration, format_scaled, parse_duration, parse_scaled,
};

/// Why a SPEC was refused. The message is one plain sentence.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SpecError {
    /// The kind before `:` is not a policy.
    #[error("unknown budget kind `{0}` (expected ratio, concurrency, token-bucket or quota)")]
    UnknownKind(String),
    /// A part is not `key=value`.
    #[error("`{0}` is not key=value")]
    NotKeyValue(String),
    /// The key is not a parameter of this kind.
    #[error("`{key}` is not a parameter of {kind} (expected one of: {expected})")]
    UnknownKey {
        /// The policy kind.
        kind: &'static str,
        /// The key given.
        key: String,
        /// The keys the kind accepts.
        expected: &'static str,
    },
    /// A key was given twice.
    #[error("`{0}` is given more than once")]
    DuplicateKey(String),
    /// A value could not be read.
    #[error("{key}: {reason}")]
    BadValue {
        /// The key.
        key: String,
        /// Why its value was refused.
        reason: String,
    },
    /// `slots` given beside `percent` or `min`.
    #[error("slots is the fixed form: give it alone, without percent or min")]
    SlotsWithOthers,
    /// The parameters break a rule of the policy.
    #[error(transparent)]
    Invalid(#[from] ConfigError),
}

/// A parsed budget SPEC: a policy kind with validated parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BudgetSpec {
    /// `ratio:percent=..,min_per_sec=..,ttl=..,deposit_on=admission|success`
    Ratio(RatioConfig),
    /// `concurrency:percent=..,min=..` or `concurrency:slots=N`
    Concurrency(ConcurrencyConfig),
    /// `token-bucket:max_tokens=..,token_ratio=..`
    TokenBucket(TokenBucketConfig),
    /// `quota:capacity=..,retry_cost=..,timeout_cost=..,throttle_cost=..,success_reward=..`
    Quota(QuotaConfig),
}

impl Default for BudgetSpec {
    fn default() -> Self {
        BudgetSpec::Ratio(RatioConfig::default())
    }
}

fn bad(key: &str, reason: impl fmt::Display) -> SpecError {
    SpecError::BadValue { key: key.to_string(), reason: reason.to_string() }
}

fn fraction(key: &str, v: &str) -> Result<Fraction, SpecError> {
    v.parse().map_err(|e| bad(key, e))
}

fn integer(key: &str, v: &str) -> Result<u64, SpecError> {
    v.trim().parse().map_err(|_| bad(key, format_args!("`{v}` is not a non-negative integer")))
}

fn duration(key: &str, v: &str) -> Result<Duration, SpecError> {
    parse_duration(v).map_err(|e| bad(key, e))
}

impl BudgetSpec {
    /// Parses and validates a SPEC.
    pub fn parse(text: &str) -> Result<BudgetSpec, SpecError> {
        let text = text.trim();
        let (kind, params) = match text.split_once(':') {
            Some((k, p)) => (k.trim(), p),
            None => (text, ""),
        };
        let mut seen: Vec<&str> = Vec::new();
        let mut pairs = Vec::new();
        for part in params.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (k, v) = part.split_once('=').ok_or_else(|| SpecError::NotKeyValue(part.into()))?;
            let (k, v) = (k.trim(), v.trim());
            if k.is_empty() {
                return Err(SpecError::NotKeyValue(part.into()));
            }
            if seen.contains(&k) {
                return Err(SpecError::DuplicateKey(k.into()));
            }
            seen.push(k);
            pairs.push((k, v));
        }
        let unknown = |kind: &'static str, expected: &'static str, key: &str| {
            SpecError::UnknownKey { kind, key: key.to_string(), expected }
        };
        let spec = match kind {
            "ratio" => {
                const KEYS: &str = "percent, min_per_sec, ttl, deposit_on";
                let mut c = RatioConfig::default();
                for (k, v) in pairs {
                    match k {
                        "percent" => c.percent = fraction(k, v)?,
                        "min_per_sec" => c.min_per_sec = fraction(k, v)?,
                        "ttl" => c.ttl = duration(k, v)?,
                        "deposit_on" => {
                            c.deposit_on = match v {
                                "admission" => DepositOn::Admission,
                                "success" => DepositOn::Success,
                                _ => return Err(bad(k, "expected admission or success")),
                            }
                        }
                        _ => return Err(unknown("ratio", KEYS, k)),
                    }
                }
                c.validate()?;
                BudgetSpec::Ratio(c)
            }
            "concurrency" => {
                const KEYS: &str = "percent, min (or min_concurrency), slots";
                let mut c = ConcurrencyConfig::default();
                for (k, v) in pairs {
                    match k {
                        "percent" => c.percent = fraction(k, v)?,
                        "min" | "min_concurrency" => c.min = integer(k, v)?,
                        "slots" => c.slots = Some(integer(k, v)?),
                        _ => return Err(unknown("concurrency", KEYS, k)),
                    }
                }
                if c.slots.is_some() && seen.iter().any(|k| *k != "slots") {
                    return Err(SpecError::SlotsWithOthers);
                }
                c.validate()?;
                BudgetSpec::Concurrency(c)
            }
            "token-bucket" | "token_bucket" => {
                const KEYS: &str = "max_tokens, token_ratio";
                let mut c = TokenBucketConfig::default();
                for (k, v) in pairs {
                    // gRPC keeps three decimals of both and drops the rest.
                    let milli = parse_scaled(v, 3, Excess::Truncate).map_err(|e| bad(k, e));
                    match k {
                        "max_tokens" => c.max_milli_tokens = milli?,
                        "token_ratio" => c.token_ratio_milli = milli?,
                        _ => return Err(unknown("token-bucket", KEYS, k)),
                    }
                }
                c.validate()?;
                BudgetSpec::TokenBucket(c)
            }
            "quota" => {
                const KEYS: &str =
                    "capacity, retry_cost, timeout_cost, throttle_cost, success_reward";
                let mut c = QuotaConfig::default();
                let mut throttle = None;
                for (k, v) in pairs {
                    let n = integer(k, v)?;
                    match k {
                        "capacity" => c.capacity = n,
                        "retry_cost" => c.retry_cost = n,
                        "timeout_cost" => c.timeout_cost = n,
                        "throttle_cost" => throttle = Some(n),
                        "success_reward" => c.success_reward = n,
                        _ => return Err(unknown("quota", KEYS, k)),
                    }
                }
                c.throttle_cost = throttle.unwrap_or(c.retry_cost);
                c.validate()?;
                BudgetSpec::Quota(c)
            }
            other => return Err(SpecError::UnknownKind(other.to_string())),
        };
        Ok(spec)
    }

    /// The policy's kind as written in a SPEC.
    pub fn kind(&self) -> &'static str {
        match self {
            BudgetSpec::Ratio(_) => "ratio",
            BudgetSpec::Concurrency(_) => "concurrency",
            BudgetSpec::TokenBucket(_) => "token-bucket",
            BudgetSpec::Quota(_) => "quota",
        }
    }

    /// Builds a fresh policy (full reserve, empty window).
    pub fn build(&self) -> Result<AnyBudget, SpecError> {
        Ok(match *self {
            BudgetSpec::Ratio(c) => AnyBudget::Ratio(RatioBudget::try_new(c)?),
            BudgetSpec::Concurrency(c) => AnyBudget::Concurrency(ConcurrencyBudget::try_new(c)?),
            BudgetSpec::TokenBucket(c) => AnyBudget::TokenBucket(TokenBucket::try_new(c)?),
            BudgetSpec::Quota(c) => AnyBudget::Quota(QuotaBudget::try_new(c)?),
        })
    }
}

impl std::str::FromStr for BudgetSpec {
    type Err = SpecError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        BudgetSpec::parse(s)
    }
}

/// A budget in a config file: a SPEC string (`"ratio:percent=0.25,min_per_sec=3"`), or a table
/// with `kind` and the SPEC's parameters (`{ kind = "ratio", percent = 0.25, min_per_sec = 3 }`).
/// Either is read by [`BudgetSpec::parse`], so both say the same about a bad value.
#[cfg(feature = "serde")]
impl<'de> serde::Deserialize<'de> for BudgetSpec {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<BudgetSpec, D::Error> {
        use serde::de::{self, MapAccess, Visitor};

        struct Spec;

        /// A parameter's value as the SPEC writes it.
        struct Param(String);

        impl<'de> serde::Deserialize<'de> for Param {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Param, D::Error> {
                struct V;
                impl Visitor<'_> for V {
                    type Value = Param;
                    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                        f.write_str("a number or a string")
                    }
                    fn visit_str<E: de::Error>(self, v: &str) -> Result<Param, E> {
                        Ok(Param(v.to_string()))
                    }
                    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Param, E> {
                        Ok(Param(v.to_string()))
                    }
                    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Param, E> {
                        Ok(Param(v.to_string()))
                    }
                    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Param, E> {
                        Ok(Param(v.to_string()))
                    }
                }
                d.deserialize_any(V)
            }
        }

        impl<'de> Visitor<'de> for Spec {
            type Value = BudgetSpec;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a budget SPEC string or a table with kind")
            }

            fn visit_str<E: de::Error>(self, v: &str) -> Result<BudgetSpec, E> {
                BudgetSpec::parse(v).map_err(E::custom)
            }

            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<BudgetSpec, A::Error> {
                let mut kind = None;
                let mut params = Vec::new();
                while let Some(key) = map.next_key::<String>()? {
                    let Param(value) = map.next_value()?;
                    if key == "kind" {
                        kind = Some(value);
                    } else {
                        params.push(format!("{key}={value}"));
                    }
                }
                let kind = kind.ok_or_else(|| {
                    de::Error::custom(
                        "a budget table needs kind = \"ratio\" (or concurrency, token-bucket, quota)",
                    )
                })?;
                BudgetSpec::parse(&format!("{kind}:{}", params.join(",")))
                    .map_err(de::Error::custom)
            }
        }

        d.deserialize_any(Spec)
    }
}

impl fmt::Display for BudgetSpec {
    /// The canonical SPEC, every parameter spelled out; it parses back to the same value.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BudgetSpec::Ratio(c) => {
                write!(
                    f,
                    "ratio:percent={},min_per_sec={},ttl={}",
                    c.percent,
                    c.min_per_sec,
                    format_duration(c.ttl)
                )?;
                if c.deposit_on == DepositOn::Success {
                    f.write_str(",deposit_on=success")?;
                }
                Ok(())
            }
            BudgetSpec::Concurrency(c) => match c.slots {
                Some(s) => write!(f, "concurrency:slots={s}"),
                None => write!(f, "concurrency:percent={},min={}", c.percent, c.min),
            },
            BudgetSpec::TokenBucket(c) => write!(
                f,
                "token-bucket:max_tokens={},token_ratio={}",
                format_scaled(c.max_milli_tokens, 3),
                format_scaled(c.token_ratio_milli, 3)
            ),
            BudgetSpec::Quota(c) => write!(
                f,
                "quota:capacity={},retry_cost={},timeout_cost={},throttle_cost={},success_reward={}",
                c.capacity, c.retry_cost, c.timeout_cost, c.throttle_cost, c.success_reward
            ),
        }
    }
}

#[cfg(all(test, not(stormguard_loom)))]
mod tests {
    use super::*;

    #[test]
    fn parses_the_design_examples() {
        for text in [
            "ratio:percent=0.2,min_per_sec=10,ttl=10s",
            "concurrency:percent=0.2,min=3",
            "token-bucket:max_tokens=10,token_ratio=0.1",
            "quota:capacity=500,retry_cost=5,timeout_cost=10,success_reward=1",
            "concurrency:slots=4",
            "ratio",
        ] {
            let spec = BudgetSpec::parse(text).unwrap();
            assert_eq!(BudgetSpec::parse(&spec.to_string()).unwrap(), spec, "{text}");
            spec.build().unwrap();
        }
    }

    /// A snapshot says which policy it comes from (the metrics label what `percent` is a share
    /// of by it), and only ratio and the percent form of concurrency have a percent.
    #[test]
    fn snapshots_name_their_policy() {
        use crate::budget::RetryBudget;
        use crate::clock::Timestamp;
        for (text, percent) in [
            ("ratio:percent=0.25", Some(0.25)),
            ("concurrency:percent=0.2,min=3", Some(0.2)),
            ("concurrency:slots=4", None),
            ("token-bucket:max_tokens=10,token_ratio=0.1", None),
            ("quota", None),
        ] {
            let spec = BudgetSpec::parse(text).unwrap();
            let snap = spec.build().unwrap().snapshot(Timestamp::ZERO);
            assert_eq!(snap.policy, spec.kind(), "{text}");
            assert_eq!(snap.percent, percent, "{text}");
        }
    }

    #[test]
    fn defaults_and_derived_values() {
        let BudgetSpec::Quota(q) = BudgetSpec::parse("quota:retry_cost=7").unwrap() else {
            panic!()
        };
        assert_eq!((q.capacity, q.throttle_cost, q.timeout_cost), (500, 7, 10));
        let BudgetSpec::TokenBucket(t) =
            BudgetSpec::parse("token-bucket:max_tokens=10,token_ratio=0.12345").unwrap()
        else {
            panic!()
        };
        assert_eq!(t.token_ratio_milli, 123, "gRPC keeps three decimals");
    }

    #[test]
    fn refusals_say_why() {
        let err = |t: &str| BudgetSpec::parse(t).unwrap_err().to_string();
        assert!(err("leaky:rate=1").contains("unknown budget kind `leaky`"));
        assert!(err("ratio:percent").contains("not key=value"));
        assert!(err("ratio:pct=0.2").contains("`pct` is not a parameter of ratio"));
        assert!(err("ratio:percent=0.2,percent=0.3").contains("more than once"));
        assert!(err("ratio:percent=0.1234567").contains("more than 6 decimal places"));
        assert!(err("ratio:percent=-1").contains("percent"));
        assert!(err("ratio:ttl=0.5s").contains("ttl must be between 1s and 60s"));
        assert!(err("ratio:ttl=soon").contains("not a duration"));
        assert!(err("ratio:percent=1001").contains("[0, 1000]"));
        assert!(err("concurrency:min=-3").contains("not a non-negative integer"));
        assert!(err("concurrency:slots=4,min=3").contains("fixed form"));
        assert!(err("token-bucket:max_tokens=0").contains("max_tokens must be above 0"));
        assert!(err("token-bucket:token_ratio=0.0001").contains("token_ratio must be above 0"));
        assert!(err("quota:capacity=big").contains("capacity"));
    }
}
