//! A scenario file's TOML shapes, as [`stormguard_config`] reads them: every key optional, each
//! value of its TOML type (a duration or a service time read from its text). What the values
//! must be, and what a key left out means, is `validate`'s.

use std::fmt;
use std::path::Path;
use std::time::Duration;

use serde::Deserialize;
use serde::de::{self as serde_de, Deserializer, Unexpected, Visitor};
use stormguard_config::Document;
use stormguard_config::de::{self, ScalarOrTable};
use stormguard_core::adaptive::Algorithm;
use stormguard_core::backoff::Jitter;
use stormguard_core::budget::BudgetSpec;
use stormguard_core::conditions::RetryOn;

use super::{Arrivals, HeldSlotRelease, Scenario, ScenarioError, Share};
use crate::dist::ServiceTime;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename = "scenario")]
pub(super) struct ScenarioFile {
    pub name: Option<String>,
    pub description: Option<String>,
    pub seed: Option<u64>,
    #[serde(default, deserialize_with = "de::option_duration")]
    pub duration: Option<Duration>,
    #[serde(default, deserialize_with = "de::option_duration")]
    pub bucket: Option<Duration>,
    pub recovered_at: Option<f64>,
    #[serde(default)]
    pub fleet: FleetFile,
    #[serde(default)]
    pub client: ClientFile,
    #[serde(default)]
    pub dependency: DependencyFile,
    #[serde(default)]
    pub phase: Vec<PhaseFile>,
    #[serde(default)]
    pub policy: Vec<PolicyFile>,
}

/// `[fleet]`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, rename = "fleet")]
pub(super) struct FleetFile {
    pub instances: Option<u64>,
    pub rate: Option<f64>,
    pub arrivals: Option<Arrivals>,
    pub concurrency: Option<u64>,
    #[serde(default, deserialize_with = "de::option_duration")]
    pub think: Option<Duration>,
    pub fan_out: Option<u64>,
    pub input_tokens: Option<u64>,
    pub max_tokens: Option<u64>,
    pub trace: Option<String>,
    pub trace_dependency: Option<String>,
}

/// `[client]`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, rename = "client")]
pub(super) struct ClientFile {
    #[serde(default, deserialize_with = "de::option_duration")]
    pub per_try_timeout: Option<Duration>,
    #[serde(default, deserialize_with = "de::option_duration")]
    pub deadline: Option<Duration>,
    #[serde(default, deserialize_with = "de::option_duration")]
    pub timeout_slot_hold: Option<Duration>,
    pub held_slot: Option<HeldSlotRelease>,
    #[serde(default, deserialize_with = "de::option_from_str")]
    pub retry_on: Option<RetryOn>,
    #[serde(default, deserialize_with = "de::option_duration")]
    pub fast_within: Option<Duration>,
    pub non_idempotent: Option<f64>,
    pub own_retries: Option<u64>,
    #[serde(default, deserialize_with = "de::option_duration")]
    pub own_backoff: Option<Duration>,
}

/// The keys of the dependency's conditions, in `[dependency]` and in every `[[phase]]`.
#[derive(Debug, Default)]
pub(super) struct ConditionsFile {
    pub capacity: Option<u64>,
    pub workers: Option<u64>,
    pub error_rate: Option<f64>,
    pub service_time: Option<ServiceTime>,
    pub error_time: Option<ServiceTime>,
}

/// `[dependency]`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, rename = "dependency")]
pub(super) struct DependencyFile {
    pub capacity: Option<u64>,
    pub workers: Option<u64>,
    pub error_rate: Option<f64>,
    #[serde(default, deserialize_with = "de::option_from_str")]
    pub service_time: Option<ServiceTime>,
    #[serde(default, deserialize_with = "de::option_from_str")]
    pub error_time: Option<ServiceTime>,
    pub queue: Option<Queue>,
    pub requests_per_minute: Option<u64>,
    pub requests_remaining: Option<u64>,
    pub tokens_per_minute: Option<u64>,
    pub tokens_remaining: Option<u64>,
    pub output_fraction: Option<f64>,
}

/// `[[phase]]`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename = "phase")]
pub(super) struct PhaseFile {
    pub name: Option<String>,
    #[serde(default, deserialize_with = "de::option_duration")]
    pub start: Option<Duration>,
    #[serde(default, deserialize_with = "de::option_duration")]
    pub end: Option<Duration>,
    #[serde(default, deserialize_with = "de::option_duration")]
    pub duration: Option<Duration>,
    pub trigger: Option<bool>,
    pub capacity: Option<u64>,
    pub workers: Option<u64>,
    pub error_rate: Option<f64>,
    #[serde(default, deserialize_with = "de::option_from_str")]
    pub service_time: Option<ServiceTime>,
    #[serde(default, deserialize_with = "de::option_from_str")]
    pub error_time: Option<ServiceTime>,
}

impl DependencyFile {
    pub fn conditions(&self) -> ConditionsFile {
        ConditionsFile {
            capacity: self.capacity,
            workers: self.workers,
            error_rate: self.error_rate,
            service_time: self.service_time,
            error_time: self.error_time,
        }
    }
}

impl PhaseFile {
    pub fn conditions(&self) -> ConditionsFile {
        ConditionsFile {
            capacity: self.capacity,
            workers: self.workers,
            error_rate: self.error_rate,
            service_time: self.service_time,
            error_time: self.error_time,
        }
    }
}

/// `[[policy]]`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename = "policy")]
pub(super) struct PolicyFile {
    pub name: Option<String>,
    pub retries: Option<u64>,
    /// `"25ms..250ms"` or `"none"`.
    pub backoff: Option<String>,
    #[serde(default, deserialize_with = "de::option_from_str")]
    pub jitter: Option<Jitter>,
    #[serde(default, deserialize_with = "de::option_from_str")]
    pub budget: Option<BudgetSpec>,
    pub cap: Option<u64>,
    pub queue: Option<u64>,
    #[serde(default, deserialize_with = "de::option_duration")]
    pub queue_timeout: Option<Duration>,
    pub retry_pool: Option<u64>,
    /// `breaker = true` (the defaults), `false`, or a table.
    pub breaker: Option<ScalarOrTable<bool, BreakerFile>>,
    pub share: Option<Share>,
    pub scope_retries: Option<u64>,
    pub requests_per_minute: Option<u64>,
    pub tokens_per_minute: Option<u64>,
    pub learn_rate_limits: Option<bool>,
    /// `"100ms"` or `"p95"`.
    pub hedge_after: Option<String>,
    #[serde(default, deserialize_with = "de::option_duration")]
    pub hedge_floor: Option<Duration>,
    pub max_hedges: Option<u64>,
    /// `adaptive = { min = 4, max = 40 }` or `[policy.adaptive]`.
    pub adaptive: Option<AdaptiveFile>,
    /// `"enforce"` (the default) or `"off"`.
    pub caller_retries: Option<CallerRetriesFile>,
}

/// `caller_retries` of a `[[policy]]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub(super) enum CallerRetriesFile {
    Enforce,
    Off,
}

/// `adaptive = { min, max, algorithm, window, tolerance }`: the proxy's key of the same name.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, rename = "adaptive")]
pub(super) struct AdaptiveFile {
    pub min: Option<u64>,
    pub max: Option<u64>,
    #[serde(default, deserialize_with = "de::option_from_str")]
    pub algorithm: Option<Algorithm>,
    #[serde(default, deserialize_with = "de::option_duration")]
    pub window: Option<Duration>,
    pub tolerance: Option<u64>,
}

/// `breaker = { ... }` or `[policy.breaker]`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, rename = "breaker")]
pub(super) struct BreakerFile {
    pub failure_ratio: Option<f64>,
    pub min_requests: Option<u64>,
    #[serde(default, deserialize_with = "de::option_duration")]
    pub window: Option<Duration>,
    pub consecutive_failures: Option<u64>,
    #[serde(default, deserialize_with = "de::option_duration")]
    pub break_duration: Option<Duration>,
    pub half_open_probes: Option<u64>,
}

/// The dependency's `queue`: a length, or `"unbounded"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Queue {
    Bounded(u64),
    Unbounded,
}

impl<'de> Deserialize<'de> for Queue {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Queue, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = Queue;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a whole number or \"unbounded\"")
            }
            fn visit_i64<E: serde_de::Error>(self, v: i64) -> Result<Queue, E> {
                u64::try_from(v)
                    .map(Queue::Bounded)
                    .map_err(|_| E::invalid_value(Unexpected::Signed(v), &self))
            }
            fn visit_u64<E: serde_de::Error>(self, v: u64) -> Result<Queue, E> {
                Ok(Queue::Bounded(v))
            }
            fn visit_str<E: serde_de::Error>(self, v: &str) -> Result<Queue, E> {
                match v {
                    "unbounded" => Ok(Queue::Unbounded),
                    other => Err(E::invalid_value(Unexpected::Str(other), &self)),
                }
            }
        }
        d.deserialize_any(V)
    }
}

impl Scenario {
    /// Reads and validates a scenario; `origin` names it in errors (a path, or
    /// `--builtin NAME`), and gives it its default name (the file name without `.toml`).
    pub fn parse(origin: &str, text: &str) -> Result<Scenario, ScenarioError> {
        Scenario::read(&Document::parse(text, origin)?)
    }

    /// Reads and validates a scenario file (a regular file of at most 16 MiB).
    pub fn from_file(path: &Path) -> Result<Scenario, ScenarioError> {
        stormguard_config::load(path, Scenario::read)
    }

    /// The scenario in a parsed document, validated.
    pub fn read(doc: &Document<'_>) -> Result<Scenario, ScenarioError> {
        let file: ScenarioFile = doc.deserialize()?;
        let origin = doc.file();
        let default_name = origin
            .rsplit('/')
            .next()
            .unwrap_or(origin)
            .trim_end_matches(".toml")
            .trim_start_matches("--builtin ")
            .to_string();
        // A trace named by a file is found beside it.
        let base = std::path::Path::new(origin).parent().map(Path::to_path_buf);
        file.into_scenario(default_name, base.as_deref()).map_err(|e| doc.invalid(e))
    }
}

#[cfg(test)]
mod tests {
    use super::super::{InvalidScenario, ProviderLimit, RateAdmissionConfig};
    use super::*;

    const BASE: &str = "[fleet]\nrate = 10\n[dependency]\ncapacity = 4\nservice_time = \"10ms\"\n\
                        [[policy]]\nname = \"a\"\n[[policy]]\nname = \"b\"\n";

    /// One shape for all three kinds of mistake: a wrong value, an unknown key, a type error.
    #[test]
    fn a_wrong_value_an_unknown_key_and_a_type_error_have_one_shape() {
        let err = |extra: &str| Scenario::parse("s.toml", &format!("{BASE}{extra}")).unwrap_err();
        let e = err("cap = 0\n");
        assert_eq!(
            e.to_string(),
            "s.toml:10:7: policy[1].cap: must be between 1 and 16777216, got 0"
        );
        assert_eq!(e.position(), Some((10, 7)));
        assert_eq!(e.key().unwrap().to_string(), "policy[1].cap");
        assert_eq!(
            e.rule::<InvalidScenario>(),
            Some(&InvalidScenario::OutOfRange { min: 1, max: 1 << 24, got: 0 })
        );
        let e = err("cpa = 1\n");
        assert!(
            e.to_string().starts_with(
                "s.toml:10:1: policy[1].cpa: unknown field `cpa`, expected one of `name`,"
            ),
            "{e}"
        );
        assert_eq!(e.key().unwrap().to_string(), "policy[1].cpa");
        assert!(e.rule::<InvalidScenario>().is_none());
        let e = err("cap = \"20\"\n");
        assert_eq!(
            e.to_string(),
            "s.toml:10:7: policy[1].cap: invalid type: string \"20\", expected u64"
        );
        assert_eq!(e.position(), Some((10, 7)));
    }

    #[test]
    fn each_form_of_a_key_reads() {
        let read = |extra: &str| Scenario::parse("s.toml", &format!("{BASE}{extra}"));
        let s = read("breaker = { window = \"20s\", half_open_probes = 3 }\nshare = \"fleet\"\n")
            .unwrap();
        let b = s.policies[1].breaker.unwrap();
        assert_eq!((b.window, b.half_open_probes), (Duration::from_secs(20), 3));
        assert_eq!(s.policies[1].share, Share::Fleet);
        let s = read("breaker = true\n[policy.breaker]\n").unwrap_err();
        assert!(s.to_string().contains("duplicate key"), "{s}");
        let s = read("[policy.breaker]\nmin_requests = 7\n").unwrap();
        assert_eq!(s.policies[1].breaker.unwrap().min_requests, 7);
        let s = read("breaker = false\n").unwrap();
        assert_eq!(s.policies[1].breaker, None);
        let with = |dep: &str| {
            Scenario::parse(
                "s.toml",
                &BASE.replace("capacity = 4\n", &format!("capacity = 4\n{dep}\n")),
            )
        };
        assert_eq!(with("queue = \"unbounded\"").unwrap().dependency.queue, None);
        assert_eq!(with("queue = 7").unwrap().dependency.queue, Some(7));
        let e = with("queue = \"deep\"").unwrap_err();
        assert_eq!(
            e.to_string(),
            "s.toml:5:9: dependency.queue: invalid value: string \"deep\", expected a whole number or \"unbounded\""
        );
        let e = with("queue = 20000000").unwrap_err();
        assert_eq!(
            e.to_string(),
            "s.toml:5:9: dependency.queue: must be between 0 and 10000000, got 20000000"
        );
        let e = with("error_time = \"soon\"").unwrap_err();
        assert!(
            e.to_string().starts_with("s.toml:5:14: dependency.error_time: `soon` is not"),
            "{e}"
        );
    }

    /// The provider's limit and rate admission read like every key, and refuse in the same
    /// shape: a wrong value, a wrong type, a key that needs another.
    #[test]
    fn rate_keys_read_and_refuse_in_the_same_shape() {
        let with = |dep: &str, policy: &str| {
            Scenario::parse(
                "s.toml",
                &format!(
                    "{}{policy}",
                    BASE.replace("capacity = 4\n", &format!("capacity = 4\n{dep}\n"))
                ),
            )
        };
        let s = with("requests_per_minute = 600", "budget = \"ratio\"\nlearn_rate_limits = true\n")
            .unwrap();
        let rate = s.dependency.rate.unwrap();
        assert_eq!(rate.requests, Some(ProviderLimit { per_minute: 600, remaining: 600 }));
        assert_eq!(rate.tokens, None);
        assert_eq!(
            s.policies[1].rate,
            Some(RateAdmissionConfig { requests_per_minute: None, tokens_per_minute: None })
        );
        assert_eq!(s.policies[1].name, "b");
        let s = with(
            "requests_per_minute = 600\nrequests_remaining = 0",
            "cap = 5\nrequests_per_minute = 300\n",
        )
        .unwrap();
        assert_eq!(s.dependency.rate.unwrap().requests.unwrap().remaining, 0);
        assert_eq!(s.policies[1].rate.unwrap().requests_per_minute, Some(300));
        // `learn_rate_limits = false` alone leaves admission off, as in the proxy.
        let s = with("", "cap = 5\nlearn_rate_limits = false\n").unwrap();
        assert_eq!(s.policies[1].rate, None);

        let e = with("requests_per_minute = 0", "").unwrap_err();
        assert_eq!(
            e.to_string(),
            "s.toml:5:23: dependency.requests_per_minute: must be between 1 and 1000000000000, got 0"
        );
        let e = with("requests_per_minute = 600\nrequests_remaining = 601", "").unwrap_err();
        assert_eq!(
            e.to_string(),
            "s.toml:6:22: dependency.requests_remaining: must be between 0 and 600, got 601"
        );
        let e = with("requests_remaining = 5", "").unwrap_err();
        assert_eq!(
            e.to_string(),
            "s.toml:5:22: dependency.requests_remaining: needs requests_per_minute (the provider's limit)"
        );
        assert_eq!(
            e.rule::<InvalidScenario>(),
            Some(&InvalidScenario::NeedsProviderLimit { limit: "requests_per_minute" })
        );
        let e = with("requests_per_minute = \"600/min\"", "").unwrap_err();
        assert_eq!(
            e.to_string(),
            "s.toml:5:23: dependency.requests_per_minute: invalid type: string \"600/min\", expected u64"
        );
        let e = with("", "learn_rate_limits = \"yes\"\n").unwrap_err();
        assert_eq!(
            e.to_string(),
            "s.toml:11:21: policy[1].learn_rate_limits: invalid type: string \"yes\", expected a boolean"
        );
        let e = with("", "requests_per_minute = 600\n").unwrap_err();
        assert_eq!(e.to_string(), "s.toml:11:23: policy[1].requests_per_minute: needs a cap");
        let e = with("", "cap = 5\nrequests_per_minute = 0\n").unwrap_err();
        assert_eq!(
            e.to_string(),
            "s.toml:12:23: policy[1].requests_per_minute: must be between 1 and 1000000000000, got 0"
        );
        let e = with("", "budget = \"ratio\"\nlearn_rate_limits = true\nshare = \"fleet\"\n")
            .unwrap_err();
        assert!(
            e.to_string().starts_with("s.toml:13:9: policy[1].share: rate admission meters each"),
            "{e}"
        );
        assert_eq!(e.rule::<InvalidScenario>(), Some(&InvalidScenario::RateWithFleetShare));
    }

    /// Token limits and costs read beside the request keys, and refuse in the same shape.
    #[test]
    fn token_keys_read_and_refuse_in_the_same_shape() {
        let with = |fleet: &str, dep: &str, policy: &str| {
            Scenario::parse(
                "s.toml",
                &format!(
                    "{}{policy}",
                    BASE.replace("rate = 10\n", &format!("rate = 10\n{fleet}\n"))
                        .replace("capacity = 4\n", &format!("capacity = 4\n{dep}\n"))
                ),
            )
        };
        let tokens = "input_tokens = 1000\nmax_tokens = 3001";
        let s = with(
            tokens,
            "tokens_per_minute = 90000\ntokens_remaining = 0\noutput_fraction = 0.5",
            "cap = 5\ntokens_per_minute = 45000\n",
        )
        .unwrap();
        assert_eq!((s.fleet.input_tokens, s.fleet.max_tokens), (1_000, 3_001));
        let rate = s.dependency.rate.unwrap();
        assert_eq!(rate.requests, None, "tokens alone are a provider's limit");
        assert_eq!(rate.tokens, Some(ProviderLimit { per_minute: 90_000, remaining: 0 }));
        assert_eq!(s.dependency.output_tokens(3_001), 1_501, "rounded up");
        assert_eq!(s.policies[1].rate.unwrap().tokens_per_minute, Some(45_000));
        assert_eq!(s.policies[1].name, "b");
        let s = with(tokens, "tokens_per_minute = 90000", "").unwrap();
        assert_eq!(s.dependency.rate.unwrap().tokens.unwrap().remaining, 90_000);
        assert_eq!(s.dependency.output_fraction, 1.0);
        assert_eq!(s.dependency.output_tokens(3_001), 3_001);

        let e = |fleet: &str, dep: &str, policy: &str| {
            with(fleet, dep, policy).unwrap_err().to_string()
        };
        assert_eq!(
            e("", "tokens_per_minute = 90000", ""),
            "s.toml:6:21: dependency.tokens_per_minute: the calls cost no tokens: give [fleet] \
             input_tokens or max_tokens"
        );
        assert_eq!(
            e(tokens, "tokens_remaining = 5", ""),
            "s.toml:7:20: dependency.tokens_remaining: needs tokens_per_minute (the provider's limit)"
        );
        assert_eq!(
            e(tokens, "tokens_per_minute = 90000\ntokens_remaining = 90001", ""),
            "s.toml:8:20: dependency.tokens_remaining: must be between 0 and 90000, got 90001"
        );
        assert_eq!(
            e(tokens, "output_fraction = 0", ""),
            "s.toml:7:19: dependency.output_fraction: must be above 0 and at most 1, got 0"
        );
        assert_eq!(
            e(tokens, "output_fraction = 1.5", ""),
            "s.toml:7:19: dependency.output_fraction: must be above 0 and at most 1, got 1.5"
        );
        assert_eq!(
            e("max_tokens = 200000000", "", ""),
            "s.toml:3:14: fleet.max_tokens: must be between 0 and 100000000, got 200000000"
        );
        assert_eq!(
            e("input_tokens = -1", "", ""),
            "s.toml:3:16: fleet.input_tokens: invalid value: integer `-1`, expected u64"
        );
        assert_eq!(
            e(tokens, "", "tokens_per_minute = 600\n"),
            "s.toml:13:21: policy[1].tokens_per_minute: needs a cap"
        );
        assert_eq!(
            e(tokens, "", "cap = 5\ntokens_per_minute = 0\n"),
            "s.toml:14:21: policy[1].tokens_per_minute: must be between 1 and 1000000000000, got 0"
        );
    }
}
