//! `deserialize_with` helpers for the values every format has: durations written as text
//! (`"250ms"`), and anything with a `FromStr` (an address, a URL, a header name, a SPEC).
//!
//! A value that does not read is an error at its own key, with the type's own message:
//! `phase[0].latency: `fast` is not a duration (e.g. 250ms, 10s, 2m)`.

use std::fmt;
use std::marker::PhantomData;
use std::str::FromStr;
use std::time::Duration;

use serde::Deserialize;
use serde::de::value::MapAccessDeserializer;
use serde::de::{self, Deserializer, IntoDeserializer, MapAccess, Visitor};

/// A duration: a string such as `"250ms"`, `"1.5s"`, `"2m"`
/// ([`parse_duration`](stormguard_core::decimal::parse_duration)'s grammar).
pub fn duration<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
    d.deserialize_any(Parsed::<Duration>::new("a duration string such as \"250ms\"", |s| {
        stormguard_core::decimal::parse_duration(s).map_err(|e| e.to_string())
    }))
}

/// An optional [`duration`] (for `Option<Duration>` fields with `#[serde(default)]`).
pub fn option_duration<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
    duration(d).map(Some)
}

/// A value read from its text by its `FromStr`, the type's error as the message.
pub fn from_str<'de, D, T>(d: D) -> Result<T, D::Error>
where
    D: Deserializer<'de>,
    T: FromStr,
    T::Err: fmt::Display,
{
    d.deserialize_any(Parsed::<T>::new("a string", |s| s.parse::<T>().map_err(|e| e.to_string())))
}

/// An optional [`from_str`] (for `Option<T>` fields with `#[serde(default)]`).
pub fn option_from_str<'de, D, T>(d: D) -> Result<Option<T>, D::Error>
where
    D: Deserializer<'de>,
    T: FromStr,
    T::Err: fmt::Display,
{
    from_str(d).map(Some)
}

/// A value read by its `FromStr` from a string or from a number as written (`0.6` or
/// `"0.6"`): for exact decimals, which must not pass through `f64` arithmetic.
pub fn from_number_or_str<'de, D, T>(d: D) -> Result<T, D::Error>
where
    D: Deserializer<'de>,
    T: FromStr,
    T::Err: fmt::Display,
{
    struct V<T>(PhantomData<T>);
    impl<T> Visitor<'_> for V<T>
    where
        T: FromStr,
        T::Err: fmt::Display,
    {
        type Value = T;
        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a number or a string")
        }
        fn visit_str<E: de::Error>(self, v: &str) -> Result<T, E> {
            v.parse().map_err(E::custom)
        }
        fn visit_i64<E: de::Error>(self, v: i64) -> Result<T, E> {
            self.visit_str(&v.to_string())
        }
        fn visit_u64<E: de::Error>(self, v: u64) -> Result<T, E> {
            self.visit_str(&v.to_string())
        }
        fn visit_f64<E: de::Error>(self, v: f64) -> Result<T, E> {
            // Rust prints the shortest text that reads back as the same f64: `0.6`, not
            // `0.59999999999999997780`.
            self.visit_str(&v.to_string())
        }
    }
    d.deserialize_any(V(PhantomData))
}

/// A socket address `host:port` (`127.0.0.1:8080`, `[::1]:9901`).
pub fn socket_addr<'de, D: Deserializer<'de>>(d: D) -> Result<std::net::SocketAddr, D::Error> {
    d.deserialize_any(Parsed::new("an address such as \"127.0.0.1:8080\"", |s| {
        s.parse().map_err(|_| format!("expected host:port like 127.0.0.1:8080, got {s:?}"))
    }))
}

/// A key written either as one value or as a table: `latency = "50ms"` or
/// `latency = { dist = "uniform", min = "10ms", max = "30ms" }`; `breaker = true` or a
/// `[policy.breaker]` table; `via = ["grpc/Pay", { name = "sdk", retries = 2 }]`.
///
/// The value (a string, a boolean or a number) is read as `S`, the table as `T` (derive
/// `Deserialize` on it, with `#[serde(deny_unknown_fields)]`); either's errors are at its own
/// keys, with its own messages, which an untagged enum would lose ("data did not match any
/// variant"). For an `S` read by a helper, wrap it: `#[serde(transparent)] struct
/// Latency(#[serde(deserialize_with = "duration")] Duration)`.
#[derive(Debug, Clone, PartialEq)]
pub enum ScalarOrTable<S, T> {
    /// Written as one value.
    Scalar(S),
    /// Written as a table.
    Table(T),
}

impl<'de, S: Deserialize<'de>, T: Deserialize<'de>> Deserialize<'de> for ScalarOrTable<S, T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(OrTable(PhantomData))
    }
}

struct OrTable<S, T>(PhantomData<(S, T)>);

impl<'de, S: Deserialize<'de>, T: Deserialize<'de>> Visitor<'de> for OrTable<S, T> {
    type Value = ScalarOrTable<S, T>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a value or a table")
    }

    fn visit_bool<E: de::Error>(self, v: bool) -> Result<Self::Value, E> {
        S::deserialize(v.into_deserializer()).map(ScalarOrTable::Scalar)
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Self::Value, E> {
        S::deserialize(v.into_deserializer()).map(ScalarOrTable::Scalar)
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Self::Value, E> {
        S::deserialize(v.into_deserializer()).map(ScalarOrTable::Scalar)
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Self::Value, E> {
        S::deserialize(v.into_deserializer()).map(ScalarOrTable::Scalar)
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
        S::deserialize(v.into_deserializer()).map(ScalarOrTable::Scalar)
    }

    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
        T::deserialize(MapAccessDeserializer::new(map)).map(ScalarOrTable::Table)
    }
}

/// A string read by a function; any other TOML type is refused as "expected {what}".
struct Parsed<T> {
    what: &'static str,
    read: fn(&str) -> Result<T, String>,
    _t: PhantomData<T>,
}

impl<T> Parsed<T> {
    fn new(what: &'static str, read: fn(&str) -> Result<T, String>) -> Parsed<T> {
        Parsed { what, read, _t: PhantomData }
    }
}

impl<T> Visitor<'_> for Parsed<T> {
    type Value = T;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.what)
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<T, E> {
        (self.read)(v).map_err(E::custom)
    }
}

#[cfg(test)]
mod tests {
    use serde::Deserialize;

    use crate::Document;

    #[derive(Debug, Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Phase {
        #[serde(deserialize_with = "super::duration")]
        duration: std::time::Duration,
        #[serde(default, deserialize_with = "super::option_from_str")]
        listen: Option<std::net::SocketAddr>,
        #[serde(default)]
        count: u64,
        #[serde(default)]
        limits: Option<Limits>,
    }

    #[derive(Debug, Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Limits {
        cap: u64,
    }

    #[derive(Debug, Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Script {
        #[serde(default)]
        seed: u64,
        phase: Vec<Phase>,
    }

    fn err(text: &str) -> String {
        let doc = match Document::parse(text, "s.toml") {
            Ok(doc) => doc,
            Err(e) => return e.to_string(),
        };
        match doc.deserialize::<Script>() {
            Ok(s) => {
                let p = &s.phase[0];
                let cap = p.limits.as_ref().map(|l| l.cap);
                format!(
                    "read seed={} duration={:?} listen={:?} count={} cap={cap:?}",
                    s.seed, p.duration, p.listen, p.count
                )
            }
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn every_problem_has_one_shape() {
        // A value that does not read, at its own key and column.
        assert_eq!(
            err("[[phase]]\nduration = \"fast\"\n"),
            "s.toml:2:12: phase[0].duration: `fast` is not a duration (e.g. 250ms, 10s, 2m)"
        );
        // The wrong TOML type.
        assert_eq!(
            err("[[phase]]\nduration = 5\n"),
            "s.toml:2:12: phase[0].duration: invalid type: integer `5`, expected a duration string such as \"250ms\""
        );
        assert_eq!(
            err("seed = \"x\"\n[[phase]]\nduration = \"1s\"\n"),
            "s.toml:1:8: seed: invalid type: string \"x\", expected u64"
        );
        // An unknown key: its own path, at the key.
        let e = err("[[phase]]\nduration = \"1s\"\n[[phase]]\nduration = \"1s\"\ncuont = 3\n");
        assert!(
            e.starts_with("s.toml:5:1: phase[1].cuont: unknown field `cuont`, expected one of"),
            "{e}"
        );
        // In an inline table, and in a sub-table.
        let e = err("[[phase]]\nduration = \"1s\"\nlimits = { cap = 1, cep = 2 }\n");
        assert!(e.starts_with("s.toml:3:21: phase[0].limits.cep: unknown field `cep`"), "{e}");
        let e = err("[[phase]]\nduration = \"1s\"\n[phase.limits]\ncap = -1\n");
        assert!(
            e.starts_with("s.toml:4:7: phase[0].limits.cap: invalid value: integer `-1`"),
            "{e}"
        );
        // A missing key: at the table that lacks it.
        let e = err("[[phase]]\ncount = 1\n");
        assert!(e.starts_with("s.toml:1:1: phase[0]: missing field `duration`"), "{e}");
        // A syntax error: no key.
        let e = err("[[phase]\n");
        assert!(e.starts_with("s.toml:1:"), "{e}");
        assert!(!e.contains("\n"), "{e}");
        // A value through FromStr.
        let e = err("[[phase]]\nduration = \"1s\"\nlisten = \"nowhere\"\n");
        assert!(e.starts_with("s.toml:3:10: phase[0].listen: invalid socket address"), "{e}");
        assert_eq!(
            err(
                "seed = 7\n[[phase]]\nduration = \"1.5s\"\nlisten = \"127.0.0.1:1\"\nlimits = { cap = 3 }\n"
            ),
            "read seed=7 duration=1.5s listen=Some(127.0.0.1:1) count=0 cap=Some(3)"
        );
    }

    #[derive(Debug, PartialEq, Deserialize)]
    #[serde(transparent)]
    struct Fixed(#[serde(deserialize_with = "super::duration")] std::time::Duration);

    #[derive(Debug, PartialEq, Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Range {
        #[serde(deserialize_with = "super::duration")]
        min: std::time::Duration,
        #[serde(deserialize_with = "super::duration")]
        max: std::time::Duration,
    }

    #[derive(Debug, Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Step {
        latency: super::ScalarOrTable<Fixed, Range>,
        #[serde(default)]
        breaker: Option<super::ScalarOrTable<bool, Limits>>,
    }

    #[derive(Debug, Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Steps {
        step: Vec<Step>,
    }

    #[test]
    fn a_value_or_a_table_is_read_as_either_with_errors_at_their_keys() {
        use super::ScalarOrTable::{Scalar, Table};
        use std::time::Duration;
        let read = |text: &str| Document::parse(text, "s.toml").unwrap().deserialize::<Steps>();
        let err = |text: &str| read(text).unwrap_err().to_string();
        let ms = Duration::from_millis;
        let s = read(
            "[[step]]\nlatency = \"5ms\"\nbreaker = true\n\
             [[step]]\nlatency = { min = \"1ms\", max = \"2ms\" }\n\
             [[step]]\n[step.latency]\nmin = \"3ms\"\nmax = \"4ms\"\n[step.breaker]\ncap = 2\n",
        )
        .unwrap();
        assert_eq!(s.step[0].latency, Scalar(Fixed(ms(5))));
        assert_eq!(s.step[1].latency, Table(Range { min: ms(1), max: ms(2) }));
        assert_eq!(s.step[2].latency, Table(Range { min: ms(3), max: ms(4) }));
        assert!(matches!(s.step[0].breaker, Some(Scalar(true))));
        assert!(matches!(s.step[2].breaker, Some(Table(Limits { cap: 2 }))));
        // The value's own errors, at the value.
        assert_eq!(
            err("[[step]]\nlatency = \"soon\"\n"),
            "s.toml:2:11: step[0].latency: `soon` is not a duration (e.g. 250ms, 10s, 2m)"
        );
        assert_eq!(
            err("[[step]]\nlatency = 5\n"),
            "s.toml:2:11: step[0].latency: invalid type: integer `5`, expected a duration string such as \"250ms\""
        );
        assert_eq!(
            err("[[step]]\nlatency = \"1ms\"\nbreaker = \"yes\"\n"),
            "s.toml:3:11: step[0].breaker: invalid type: string \"yes\", expected a boolean"
        );
        // The table's, at their keys.
        assert_eq!(
            err("[[step]]\nlatency = { min = \"1ms\", max = \"x\" }\n"),
            "s.toml:2:32: step[0].latency.max: `x` is not a duration (e.g. 250ms, 10s, 2m)"
        );
        let e = err("[[step]]\nlatency = { min = \"1ms\", mux = \"2ms\" }\n");
        assert!(e.starts_with("s.toml:2:26: step[0].latency.mux: unknown field `mux`"), "{e}");
        let e = err("[[step]]\n[step.latency]\nmin = \"1ms\"\n");
        assert!(e.starts_with("s.toml:2:1: step[0].latency: missing field `max`"), "{e}");
        // Neither.
        assert_eq!(
            err("[[step]]\nlatency = [1]\n"),
            "s.toml:2:11: step[0].latency: invalid type: sequence, expected a value or a table"
        );
    }

    #[test]
    fn keys_are_found_or_their_table_is() {
        let text = "seed = 1\n[[phase]]\nduration = \"1s\"\n[[phase]]\nduration = \"2s\"\nlimits = { cap = 3 }\n";
        let doc = Document::parse(text, "s.toml").unwrap();
        let k = |s: &str| {
            s.split('.').fold(crate::KeyPath::root(), |k, part| match part.split_once('[') {
                Some((name, i)) => k.key(name).index(i.trim_end_matches(']').parse().unwrap()),
                None => k.key(part),
            })
        };
        let at = |s: &str| stormguard_core::text::line_col(text, doc.span(&k(s)).start);
        assert_eq!(at("seed"), (1, 8));
        assert_eq!(at("phase[1].duration"), (5, 12));
        assert_eq!(at("phase[1].limits.cap"), (6, 18));
        // Not set: the nearest table that is.
        assert_eq!(at("phase[0].limits.cap"), (2, 1));
        assert_eq!(at("phase[7].duration").0, 2); // the array of tables: its first header
        assert!(doc.has(&k("phase[1].limits.cap")));
        assert!(!doc.has(&k("phase[0].limits")));
        assert_eq!(k("phase[1].limits.cap").to_string(), "phase[1].limits.cap");
    }
}
