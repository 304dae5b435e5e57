//! A script file: the TOML shapes, read by [`stormguard_config`], then turned into a [`Script`]
//! and checked, every broken rule located at its key.

use std::path::Path;
use std::str::FromStr;
use std::time::Duration;

use serde::Deserialize;
use stormguard_config::de::{self, ScalarOrTable};
use stormguard_config::{Document, Invalid, KeyPath};

use super::{
    DEFAULT_STATUS, InvalidScript, OnDisconnect, Phase, PhaseError, Rate, RateLimit, Script,
    ScriptError,
};
use crate::provider::{ProviderConfig, ProviderKind, ProviderOptions};
use crate::sampler::Latency;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ScriptFile {
    seed: Option<u64>,
    #[serde(default)]
    repeat: bool,
    #[serde(default, deserialize_with = "de::option_from_str")]
    on_disconnect: Option<OnDisconnect>,
    #[serde(default)]
    phase: Vec<PhaseFile>,
    provider: Option<ProviderFile>,
}

/// `[provider]`: `kind` and any of the rest (see [`ProviderOptions`] for each one's meaning).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ProviderFile {
    #[serde(deserialize_with = "de::from_str")]
    kind: ProviderKind,
    rpm: Option<u64>,
    tpm: Option<u64>,
    itpm: Option<u64>,
    otpm: Option<u64>,
    #[serde(default, deserialize_with = "de::option_duration")]
    stream_event_delay: Option<Duration>,
    stream_break_rate: Option<f64>,
    quota_exhausted_after: Option<u64>,
}

impl ProviderFile {
    fn into_provider(self) -> (ProviderConfig, ProviderOptions) {
        let defaults = ProviderOptions::default();
        (
            ProviderConfig { kind: self.kind, rpm: self.rpm, tpm: self.tpm },
            ProviderOptions {
                itpm: self.itpm,
                otpm: self.otpm,
                stream_event_delay: self.stream_event_delay.unwrap_or(defaults.stream_event_delay),
                stream_break_rate: self.stream_break_rate.unwrap_or(defaults.stream_break_rate),
                quota_exhausted_after: self.quota_exhausted_after,
            },
        )
    }
}

/// A `[[phase]]`: every key optional (see [`Phase`] for each one's meaning and default).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct PhaseFile {
    name: Option<String>,
    #[serde(default, deserialize_with = "de::option_duration")]
    duration: Option<Duration>,
    error_rate: Option<f64>,
    status: Option<u64>,
    reset_rate: Option<f64>,
    truncate_rate: Option<f64>,
    overloaded_rate: Option<f64>,
    latency: Option<ScalarOrTable<FixedLatency, LatencyTable>>,
    #[serde(default, deserialize_with = "de::option_duration")]
    latency_p50: Option<Duration>,
    #[serde(default, deserialize_with = "de::option_duration")]
    latency_p99: Option<Duration>,
    #[serde(default, deserialize_with = "de::option_from_str")]
    latency_dist: Option<QuantileDist>,
    #[serde(default, deserialize_with = "de::option_duration")]
    latency_max: Option<Duration>,
    max_concurrency: Option<u64>,
    workers: Option<u64>,
    servers: Option<u64>,
    queue: Option<u64>,
    #[serde(default, deserialize_with = "de::option_from_str")]
    rate_limit: Option<Rate>,
    rate_burst: Option<u64>,
    body_bytes: Option<u64>,
    #[serde(default, deserialize_with = "de::option_duration")]
    slow_body: Option<Duration>,
}

/// `latency = "50ms"`.
#[derive(Debug, Deserialize)]
#[serde(transparent)]
struct FixedLatency(#[serde(deserialize_with = "de::duration")] Duration);

/// `latency = { dist = "...", ... }`: which keys a `dist` takes is a rule, checked after.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct LatencyTable {
    #[serde(default, deserialize_with = "de::option_from_str")]
    dist: Option<Dist>,
    #[serde(default, deserialize_with = "de::option_duration")]
    value: Option<Duration>,
    #[serde(default, deserialize_with = "de::option_duration")]
    min: Option<Duration>,
    #[serde(default, deserialize_with = "de::option_duration")]
    max: Option<Duration>,
    #[serde(default, deserialize_with = "de::option_duration")]
    p50: Option<Duration>,
    #[serde(default, deserialize_with = "de::option_duration")]
    p99: Option<Duration>,
    alpha: Option<f64>,
}

/// A latency table's `dist`.
#[derive(Debug, Clone, Copy)]
enum Dist {
    Fixed,
    Uniform,
    LogNormal,
    Pareto,
}

/// A word that is not a [`Dist`] (or not a [`QuantileDist`]).
#[derive(Debug, thiserror::Error)]
#[error("`{word}` is not {expected}")]
struct UnknownDist {
    word: String,
    expected: &'static str,
}

impl FromStr for Dist {
    type Err = UnknownDist;
    fn from_str(s: &str) -> Result<Dist, UnknownDist> {
        match s {
            "fixed" => Ok(Dist::Fixed),
            "uniform" => Ok(Dist::Uniform),
            "lognormal" => Ok(Dist::LogNormal),
            "pareto" => Ok(Dist::Pareto),
            other => Err(UnknownDist {
                word: other.to_string(),
                expected: "fixed, uniform, lognormal or pareto",
            }),
        }
    }
}

/// `latency_dist`: the shape fitted to `latency_p50` and `latency_p99`.
#[derive(Debug, Clone, Copy)]
enum QuantileDist {
    LogNormal,
    Pareto,
}

impl FromStr for QuantileDist {
    type Err = UnknownDist;
    fn from_str(s: &str) -> Result<QuantileDist, UnknownDist> {
        match s {
            "lognormal" => Ok(QuantileDist::LogNormal),
            "pareto" => Ok(QuantileDist::Pareto),
            other => Err(UnknownDist { word: other.to_string(), expected: "lognormal or pareto" }),
        }
    }
}

impl Script {
    /// Reads and checks a script file.
    pub fn load(path: &Path) -> Result<Script, ScriptError> {
        stormguard_config::load(path, Script::read)
    }

    /// Parses and checks a script; `file` names it in errors.
    pub fn parse(text: &str, file: &str) -> Result<Script, ScriptError> {
        Script::read(&Document::parse(text, file)?)
    }

    /// The script in a parsed document, checked.
    pub fn read(doc: &Document<'_>) -> Result<Script, ScriptError> {
        let file: ScriptFile = doc.deserialize()?;
        let mut phases = Vec::with_capacity(file.phase.len());
        for (i, p) in file.phase.into_iter().enumerate() {
            let phase = p.into_phase(i).and_then(|p| p.validate().map(|()| p)).map_err(|e| {
                let at = KeyPath::root().key("phase").index(i);
                let key = e.key().split('.').fold(at, KeyPath::key);
                doc.invalid(Invalid::new(key, e))
            })?;
            phases.push(phase);
        }
        if phases.is_empty() {
            let key = KeyPath::root().key("phase");
            return Err(doc.invalid(Invalid::new(key, InvalidScript::NoPhases)));
        }
        let (provider, provider_options) = match file.provider.map(ProviderFile::into_provider) {
            Some((config, options)) => {
                config.validate(&options).map_err(|e| {
                    doc.invalid(Invalid::new(KeyPath::root().key("provider").key(e.key()), e))
                })?;
                (Some(config), options)
            }
            None => (None, ProviderOptions::default()),
        };
        Ok(Script {
            phases,
            repeat: file.repeat,
            seed: file.seed,
            on_disconnect: file.on_disconnect,
            provider,
            provider_options,
        })
    }
}

impl PhaseFile {
    /// The phase this table describes (`i` from 0, for its default name); the rules that
    /// span keys of the file are checked here, the rest by [`Phase::validate`].
    fn into_phase(self, i: usize) -> Result<Phase, PhaseError> {
        let defaults = Phase::default();
        let latency_given = self.latency.is_some();
        let mut phase = Phase {
            name: self.name.unwrap_or_else(|| format!("phase-{}", i + 1)),
            duration: self.duration,
            error_rate: self.error_rate.unwrap_or(defaults.error_rate),
            status: match self.status {
                None => DEFAULT_STATUS,
                Some(s) => u16::try_from(s).map_err(|_| PhaseError::Status { got: s })?,
            },
            reset_rate: self.reset_rate.unwrap_or(defaults.reset_rate),
            truncate_rate: self.truncate_rate.unwrap_or(defaults.truncate_rate),
            overloaded_rate: self.overloaded_rate.unwrap_or(defaults.overloaded_rate),
            latency: match self.latency {
                None => defaults.latency,
                Some(ScalarOrTable::Scalar(FixedLatency(d))) => Latency::Fixed(d),
                Some(ScalarOrTable::Table(t)) => t.latency()?,
            },
            latency_max: self.latency_max.unwrap_or(defaults.latency_max),
            max_concurrency: self.max_concurrency,
            workers: self.workers,
            servers: self.servers,
            queue: self.queue,
            rate_limit: None,
            body_bytes: match self.body_bytes {
                None => defaults.body_bytes,
                Some(b) => usize::try_from(b).unwrap_or(usize::MAX),
            },
            slow_body: self.slow_body,
        };
        match (self.latency_p50, self.latency_p99) {
            (None, None) if self.latency_dist.is_some() => {
                return Err(PhaseError::DistWithoutQuantiles);
            }
            (None, None) => {}
            (Some(p50), Some(p99)) => {
                if latency_given {
                    return Err(PhaseError::LatencyTwice);
                }
                phase.latency = match self.latency_dist.unwrap_or(QuantileDist::LogNormal) {
                    // Checked here, so the error points at a key the file has.
                    QuantileDist::LogNormal => {
                        let latency = Latency::LogNormal { p50, p99 };
                        latency
                            .validate()
                            .map_err(|error| PhaseError::Latency { key: "latency_p99", error })?;
                        latency
                    }
                    QuantileDist::Pareto => Latency::pareto_from_quantiles(p50, p99)
                        .map_err(|error| PhaseError::Latency { key: "latency_p99", error })?,
                };
            }
            (Some(_), None) => return Err(PhaseError::P50WithoutP99),
            (None, Some(_)) => return Err(PhaseError::P99WithoutP50),
        }
        phase.rate_limit = match (self.rate_limit, self.rate_burst) {
            (Some(rate), burst) => {
                let mut limit = RateLimit::new(rate);
                if let Some(b) = burst {
                    limit.burst = b;
                }
                Some(limit)
            }
            (None, Some(_)) => return Err(PhaseError::BurstWithoutRate),
            (None, None) => None,
        };
        Ok(phase)
    }
}

impl LatencyTable {
    fn latency(&self) -> Result<Latency, PhaseError> {
        let Some(dist) = self.dist else { return Err(PhaseError::LatencyDistMissing) };
        let (name, expected, allowed): (_, _, &[&str]) = match dist {
            Dist::Fixed => ("fixed", "value", &["value"]),
            Dist::Uniform => ("uniform", "min, max", &["min", "max"]),
            Dist::LogNormal => ("lognormal", "p50, p99", &["p50", "p99"]),
            Dist::Pareto => ("pareto", "p50, p99 or min, alpha", &["p50", "p99", "min", "alpha"]),
        };
        let given = [
            ("latency.value", self.value.is_some()),
            ("latency.min", self.min.is_some()),
            ("latency.max", self.max.is_some()),
            ("latency.p50", self.p50.is_some()),
            ("latency.p99", self.p99.is_some()),
            ("latency.alpha", self.alpha.is_some()),
        ];
        let not_allowed = |key: &str| !allowed.contains(&&key["latency.".len()..]);
        if let Some((key, _)) = given.iter().find(|(key, set)| *set && not_allowed(key)) {
            return Err(PhaseError::NotALatencyKey { key, dist: name, expected });
        }
        let need = |key, v: Option<Duration>| {
            v.ok_or(PhaseError::LatencyKeyMissing { key, dist: name, expected })
        };
        Ok(match dist {
            Dist::Fixed => Latency::Fixed(need("latency.value", self.value)?),
            Dist::Uniform => Latency::Uniform {
                min: need("latency.min", self.min)?,
                max: need("latency.max", self.max)?,
            },
            Dist::LogNormal => Latency::LogNormal {
                p50: need("latency.p50", self.p50)?,
                p99: need("latency.p99", self.p99)?,
            },
            Dist::Pareto if self.min.is_some() || self.alpha.is_some() => {
                if self.p50.is_some() || self.p99.is_some() {
                    return Err(PhaseError::ParetoTwoWays);
                }
                let alpha = self.alpha.ok_or(PhaseError::ParetoNeedsAlpha)?;
                Latency::Pareto { min: need("latency.min", self.min)?, alpha }
            }
            Dist::Pareto => Latency::pareto_from_quantiles(
                need("latency.p50", self.p50)?,
                need("latency.p99", self.p99)?,
            )
            .map_err(|error| PhaseError::Latency { key: "latency.p99", error })?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FULL: &str = r#"
seed = 7
repeat = true
on_disconnect = "cancel"

[[phase]]
name = "healthy"
duration = "2s"
latency_p50 = "20ms"
latency_p99 = "80ms"

[[phase]]
name = "storm"
error_rate = 0.3
status = 502
reset_rate = 0.01
truncate_rate = 0.02
latency = { dist = "pareto", p50 = "50ms", p99 = "2s" }
latency_max = "5s"
max_concurrency = 20
rate_limit = "100/s"
rate_burst = 10
body_bytes = 1024
slow_body = "1s"

[[phase]]
latency = { dist = "uniform", min = "1ms", max = "3ms" }

[[phase]]
latency = "5ms"
"#;

    fn err(text: &str) -> String {
        Script::parse(text, "s.toml").unwrap_err().to_string()
    }

    #[test]
    fn a_full_script_parses() {
        let s = Script::parse(FULL, "s.toml").unwrap();
        assert_eq!(s.seed, Some(7));
        assert!(s.repeat);
        assert_eq!(s.on_disconnect, Some(OnDisconnect::Cancel));
        assert_eq!(s.phases.len(), 4);
        let healthy = &s.phases[0];
        assert_eq!(healthy.duration, Some(Duration::from_secs(2)));
        assert_eq!(
            healthy.latency,
            Latency::LogNormal { p50: Duration::from_millis(20), p99: Duration::from_millis(80) }
        );
        let storm = &s.phases[1];
        assert_eq!((storm.error_rate, storm.status, storm.max_concurrency), (0.3, 502, Some(20)));
        assert_eq!((storm.reset_rate, storm.truncate_rate), (0.01, 0.02));
        assert_eq!(storm.rate_limit.unwrap().burst, 10);
        assert_eq!(storm.rate_limit.unwrap().rate.per_second(), 100.0);
        assert_eq!(storm.latency_max, Duration::from_secs(5));
        assert!(matches!(storm.latency, Latency::Pareto { .. }));
        assert_eq!(
            storm.latency,
            Latency::pareto_from_quantiles(Duration::from_millis(50), Duration::from_secs(2))
                .unwrap()
        );
        assert_eq!(storm.slow_body, Some(Duration::from_secs(1)));
        assert_eq!(storm.body_bytes, 1024);
        assert_eq!(s.phases[2].name, "phase-3");
        assert_eq!(s.phases[2].duration, None);
        let ms = Duration::from_millis;
        assert_eq!(s.phases[2].latency, Latency::Uniform { min: ms(1), max: ms(3) });
        assert_eq!(s.phases[3].latency, Latency::Fixed(ms(5)));
        // Every key left out is the default.
        assert_eq!(
            s.phases[3],
            Phase { name: "phase-4".into(), latency: Latency::Fixed(ms(5)), ..Phase::default() }
        );
        // Both forms of a Pareto tail, and a rate limit's default burst.
        let s = Script::parse(
            "[[phase]]\nlatency = { dist = \"pareto\", min = \"10ms\", alpha = 1.5 }\n\
             rate_limit = \"50/s\"\n",
            "s.toml",
        )
        .unwrap();
        assert_eq!(s.phases[0].latency, Latency::Pareto { min: ms(10), alpha: 1.5 });
        assert_eq!(s.phases[0].rate_limit, Some(RateLimit::new("50/s".parse().unwrap())));
        assert_eq!((s.seed, s.repeat, s.on_disconnect), (None, false, None));
    }

    /// One shape for all three kinds of mistake: a wrong value, an unknown key, a type error.
    #[test]
    fn a_wrong_value_an_unknown_key_and_a_type_error_have_one_shape() {
        let e = Script::parse("[[phase]]\nname = \"a\"\n[[phase]]\nreset_rate = 2\n", "s.toml")
            .unwrap_err();
        assert_eq!(
            e.to_string(),
            "s.toml:4:14: phase[1].reset_rate: must be a fraction between 0 and 1, got 2"
        );
        assert_eq!(
            (e.position(), e.key().unwrap().to_string()),
            (Some((4, 14)), "phase[1].reset_rate".into())
        );
        assert_eq!(
            e.rule::<PhaseError>(),
            Some(&PhaseError::NotAFraction { key: "reset_rate", got: 2.0 })
        );
        let e = Script::parse("[[phase]]\nname = \"a\"\n[[phase]]\nreset_rat = 0.2\n", "s.toml")
            .unwrap_err();
        assert!(
            e.to_string().starts_with(
                "s.toml:4:1: phase[1].reset_rat: unknown field `reset_rat`, expected one of"
            ),
            "{e}"
        );
        assert_eq!(e.rule::<PhaseError>(), None);
        let e =
            Script::parse("[[phase]]\nname = \"a\"\n[[phase]]\nreset_rate = \"2%\"\n", "s.toml")
                .unwrap_err();
        assert_eq!(
            e.to_string(),
            "s.toml:4:14: phase[1].reset_rate: invalid type: string \"2%\", expected f64"
        );
        assert_eq!(e.key().unwrap().to_string(), "phase[1].reset_rate");
    }

    #[test]
    fn errors_name_file_line_column_and_key() {
        assert_eq!(
            err("[[phase]]\nerror_rate = 1.5\n"),
            "s.toml:2:14: phase[0].error_rate: must be a fraction between 0 and 1, got 1.5"
        );
        assert_eq!(
            err("[[phase]]\nname = \"a\"\n\n[[phase]]\n  latency = \"fast\"\n"),
            "s.toml:5:13: phase[1].latency: `fast` is not a duration (e.g. 250ms, 10s, 2m)"
        );
        let e = err("[[phase]]\neror_rate = 0.1\n");
        assert!(
            e.starts_with(
                "s.toml:2:1: phase[0].eror_rate: unknown field `eror_rate`, expected one of `name`,"
            ),
            "{e}"
        );
        let e = err("sed = 1\n[[phase]]\n");
        assert!(e.starts_with("s.toml:1:1: sed: unknown field `sed`"), "{e}");
        let e = err("seed = -1\n[[phase]]\n");
        assert!(e.starts_with("s.toml:1:8: seed: invalid value"), "{e}");
        let e = err("[[phase]]\nstatus = 200\n");
        assert_eq!(
            e,
            "s.toml:2:10: phase[0].status: an injected error status is 400 to 599, got 200"
        );
        let e = err("[[phase]]\nstatus = 70000\n");
        assert_eq!(
            e,
            "s.toml:2:10: phase[0].status: an injected error status is 400 to 599, got 70000"
        );
        let e = err("[[phase]]\nerror_rate = 0.6\nreset_rate = 0.6\n");
        assert!(e.starts_with("s.toml:2:14: phase[0].error_rate: error_rate + reset_rate"), "{e}");
        // A rule broken by a default together with a key that is set: at the phase.
        let e = err("[[phase]]\nreset_rate = 0.6\ntruncate_rate = 0.6\n");
        assert!(e.starts_with("s.toml:1:1: phase[0].error_rate: error_rate + reset_rate"), "{e}");
        let e = err("[[phase]]\nlatency_p50 = \"50ms\"\nlatency_p99 = \"10ms\"\n");
        assert_eq!(
            e,
            "s.toml:3:15: phase[0].latency_p99: a log-normal latency needs p99 >= p50 > 0"
        );
        let e = err("[[phase]]\nlatency_p99 = \"10ms\"\n");
        assert_eq!(e, "s.toml:2:15: phase[0].latency_p99: latency_p99 needs latency_p50");
        let e = err("[[phase]]\nlatency_dist = \"pareto\"\n");
        assert_eq!(
            e,
            "s.toml:2:16: phase[0].latency_dist: latency_dist needs latency_p50 and latency_p99"
        );
        let e = err(
            "[[phase]]\nlatency_p50 = \"1ms\"\nlatency_p99 = \"9ms\"\nlatency_dist = \"gamma\"\n",
        );
        assert_eq!(e, "s.toml:4:16: phase[0].latency_dist: `gamma` is not lognormal or pareto");
        let e = err("[[phase]]\nlatency = \"1ms\"\nlatency_p50 = \"1ms\"\nlatency_p99 = \"9ms\"\n");
        assert!(e.starts_with("s.toml:3:15: phase[0].latency_p50: give either latency"), "{e}");
        let e = err("[[phase]]\nlatency = { dist = \"uniform\", min = \"1ms\" }\n");
        assert_eq!(
            e,
            "s.toml:2:11: phase[0].latency.max: missing (a uniform latency has min, max)"
        );
        let e = err("[[phase]]\nlatency = { dist = \"uniform\", min = \"1ms\", p99 = \"1s\" }\n");
        assert_eq!(
            e,
            "s.toml:2:50: phase[0].latency.p99: not a key of a uniform latency (expected min, max)"
        );
        let e = err("[[phase]]\nlatency = { dist = \"uniform\", min = \"9ms\", max = \"1ms\" }\n");
        assert_eq!(e, "s.toml:2:11: phase[0].latency: a uniform latency needs max >= min");
        let e = err("[[phase]]\nlatency = { min = \"1ms\" }\n");
        assert_eq!(
            e,
            "s.toml:2:11: phase[0].latency.dist: missing: fixed, uniform, lognormal or pareto"
        );
        let e = err("[[phase]]\nlatency = { dist = \"gamma\" }\n");
        assert!(e.contains("phase[0].latency.dist: `gamma` is not fixed"), "{e}");
        let e = err("[[phase]]\nlatency = { dist = \"pareto\", min = \"1ms\" }\n");
        assert_eq!(
            e,
            "s.toml:2:11: phase[0].latency.alpha: a Pareto tail by min needs alpha, a number"
        );
        let e = err("[[phase]]\nlatency = { dist = \"pareto\", p50 = \"5ms\", p99 = \"5ms\" }\n");
        assert_eq!(e, "s.toml:2:49: phase[0].latency.p99: a Pareto tail needs p99 > p50 > 0");
        let e = err("[[phase]]\nlatency = { dist = \"fixed\", value = 5 }\n");
        assert!(
            e.starts_with("s.toml:2:37: phase[0].latency.value: invalid type: integer `5`"),
            "{e}"
        );
        let e = err("[[phase]]\nrate_limit = \"fast\"\n");
        assert!(e.starts_with("s.toml:2:14: phase[0].rate_limit: `fast` is not a rate"), "{e}");
        let e = err("[[phase]]\nrate_burst = 5\n");
        assert_eq!(e, "s.toml:2:14: phase[0].rate_burst: rate_burst needs rate_limit");
        let e = err("[[phase]]\nrate_limit = \"5/s\"\nrate_burst = 0\n");
        assert_eq!(e, "s.toml:3:14: phase[0].rate_burst: must be at least 1");
        let e = err("[[phase]]\nbody_bytes = 100000000\n");
        assert_eq!(e, "s.toml:2:14: phase[0].body_bytes: at most 67108864 (64 MiB), got 100000000");
        let e = err("[[phase]]\nduration = 5\n");
        assert_eq!(
            e,
            "s.toml:2:12: phase[0].duration: invalid type: integer `5`, expected a duration string such as \"250ms\""
        );
        let e = err("[[phase]]\nduration = \"0s\"\n");
        assert_eq!(e, "s.toml:2:12: phase[0].duration: must be above zero");
        let e = err("on_disconnect = \"later\"\n[[phase]]\n");
        assert_eq!(e, "s.toml:1:17: on_disconnect: `later` is not finish or cancel");
        let e = Script::parse("seed = 1\n", "s.toml").unwrap_err();
        assert_eq!(e.to_string(), "s.toml:1:1: phase: a script needs at least one phase");
        assert_eq!(e.rule::<InvalidScript>(), Some(&InvalidScript::NoPhases));
        // A syntax error in a value names the key it is the value of; one outside any value
        // names none.
        let e = err("[[phase]]\nerror_rate = \n");
        assert!(e.starts_with("s.toml:2:14: phase[0].error_rate: "), "{e}");
        let e = err("[[phase]\n");
        assert!(e.starts_with("s.toml:1:"), "{e}");
    }

    #[test]
    fn provider_keys_and_their_mistakes() {
        let s = Script::parse(
            "[[phase]]\nduration = \"1s\"\n[[phase]]\noverloaded_rate = 1.0\n\n\
             [provider]\nkind = \"anthropic\"\nrpm = 50\ntpm = 9000\nitpm = 3000\n\
             otpm = 800\nstream_event_delay = \"20ms\"\nstream_break_rate = 0.25\n\
             quota_exhausted_after = 7\n",
            "s.toml",
        )
        .unwrap();
        assert_eq!(s.phases[1].overloaded_rate, 1.0);
        assert_eq!(
            s.provider,
            Some(ProviderConfig { kind: ProviderKind::Anthropic, rpm: Some(50), tpm: Some(9000) })
        );
        assert_eq!(
            s.provider_options,
            ProviderOptions {
                itpm: Some(3000),
                otpm: Some(800),
                stream_event_delay: Duration::from_millis(20),
                stream_break_rate: 0.25,
                quota_exhausted_after: Some(7),
            }
        );
        let s = Script::parse("[[phase]]\n[provider]\nkind = \"openai\"\n", "s.toml").unwrap();
        assert_eq!(s.provider_options, ProviderOptions::default());
        assert_eq!(Script::parse("[[phase]]\n", "s.toml").unwrap().provider, None);

        let e = err("[[phase]]\n[provider]\nkind = \"acme\"\n");
        assert_eq!(
            e,
            "s.toml:3:8: provider.kind: `acme` is not a provider (expected openai or anthropic)"
        );
        let e = err("[[phase]]\n[provider]\nrpm = 5\n");
        assert!(e.starts_with("s.toml:2:1: provider: missing field `kind`"), "{e}");
        let e = err("[[phase]]\n[provider]\nkind = \"openai\"\nitpm = 100\n");
        assert_eq!(
            e,
            "s.toml:4:8: provider.itpm: input and output tokens are metered apart by anthropic, \
             not openai"
        );
        let e = err("[[phase]]\n[provider]\nkind = \"openai\"\nrpm = 0\n");
        assert_eq!(e, "s.toml:4:7: provider.rpm: must be at least 1 (leave it out for no limit)");
        let e = err("[[phase]]\n[provider]\nkind = \"openai\"\nstream_break_rate = 2\n");
        assert_eq!(
            e,
            "s.toml:4:21: provider.stream_break_rate: must be a fraction between 0 and 1, got 2"
        );
        let e = err("[[phase]]\n[provider]\nkind = \"openai\"\nstream_event_delay = 5\n");
        assert!(e.starts_with("s.toml:4:22: provider.stream_event_delay: invalid type"), "{e}");
        let e = err("[[phase]]\n[provider]\nkind = \"openai\"\nrpn = 5\n");
        assert!(e.starts_with("s.toml:4:1: provider.rpn: unknown field `rpn`"), "{e}");
        let e = err("[[phase]]\noverloaded_rate = 1.5\n");
        assert_eq!(
            e,
            "s.toml:2:19: phase[0].overloaded_rate: must be a fraction between 0 and 1, got 1.5"
        );
        let e = err("[[phase]]\nerror_rate = 0.5\noverloaded_rate = 0.6\n");
        assert!(e.contains("+ overloaded_rate must be at most 1, got 1.1"), "{e}");
    }

    #[test]
    fn a_file_is_read_or_named() {
        let dir = std::env::temp_dir().join(format!("stormguard-script-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("s.toml");
        std::fs::write(&path, "[[phase]]\nerror_rate = 0.5\n").unwrap();
        assert_eq!(Script::load(&path).unwrap().phases[0].error_rate, 0.5);
        std::fs::write(&path, "[[phase]]\nerror_rate = 5\n").unwrap();
        let e = Script::load(&path).unwrap_err();
        assert!(
            e.to_string().starts_with(&format!("{}:2:14: phase[0].error_rate:", path.display())),
            "{e}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
        let e = Script::load(&dir.join("s.toml")).unwrap_err();
        assert!(matches!(e, ScriptError::Read { .. }), "{e}");
    }

    proptest::proptest! {
        #[test]
        fn parse_never_panics(text in "[\\[\\]a-z_=\"0-9. \n{}]{0,80}") {
            let _ = Script::parse(&text, "p.toml");
        }
    }
}
