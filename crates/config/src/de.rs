//! `deserialize_with` helpers for the values every format has: durations written as text
//! (`"250ms"`), and anything with a `FromStr` (an address, a URL, a header name, a SPEC).
//!
//! A value that does not read is an error at its own key, with the type's own message:
//! `phase[0].latency: `fast` is not a duration (e.g. 250ms, 10s, 2m)`.

use std::fmt;
use std::marker::PhantomData;
use std::str::FromStr;
use std::time::Duration;

use serde::de::{self, Deserializer, Visitor};

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
