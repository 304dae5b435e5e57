//! The built-in scenarios (`stormguard simulate --builtin NAME`), each a complete scenario
//! file in `crates/sim/scenarios/`: a starting point to copy (`--print-scenario`).
//!
//! | name | shows |
//! | --- | --- |
//! | `worked-example` | the README's table: 16 planned in flight, 5 / 20 / 40 % errors, retry once vs. a 25 % budget under a shared cap of 20 |
//! | `slow-dependency` | latency rises past the per-try timeout, no errors: timeouts alone make the storm |
//! | `metastable` | a short trigger leaves naive retries stuck in overload after it is gone; budgets recover |
//! | `fan-out` | 5 parallel calls per action: tails multiply; per-hop versus per-action budgets |
//! | `fleet` | 50 instances: per-instance caps and floors versus fleet-shared ones; breakers with half-open probes |
//! | `model-provider` | a provider's requests per minute at twice the limit: 429s and their retries without rate admission, almost none with it |
//! | `model-provider-tokens` | the same with its tokens per minute binding (large `max_tokens`, half of it written): rate admission books each call's most and settles at its usage |
//! | `long-tail` | 4 % of answers at 20× the median: hedging cuts p99, paid from the retry budget under the one cap; a naive hedger overloads at 40 % errors |
//! | `demo` | `stormguard demo`'s script: 160/s to an upstream that slows past 22 in flight; errors, then a latency spike past the per-try timeout; retry once against a cap of 20 and a 25 % budget |
//! | `database` | 20 pods' pools against `max_connections = 400 − 20` reserved: pools of 20 with three retries pass what the server allows under 40 % serialization failures; pools of 19 (`pool_size(400, 20, 20)`) with a 20 % budget do not |
//! | `call-tree` | three hops, each with a 20 % budget, over a dependency failing 40 %: per-hop budgets multiply (1.73 attempts per action at the dependency); one tree allowance of 1.2 holds it to 1.2 ([`crate::tree`]; not a [`Scenario`]: read by [`crate::tree::CallTree::parse`]) |
//! | `capacity-drop` | the dependency loses half its servers for 30 s: fixed caps of 10, 20 and 40 against an adaptive cap that follows the capacity down and back up |

use crate::scenario::{Scenario, ScenarioError};

/// Why `--builtin NAME` gave no scenario.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BuiltinError {
    /// No built-in scenario has that name.
    #[error("no built-in scenario `{name}` (expected one of: {})", names().join(", "))]
    Unknown {
        /// The name given.
        name: String,
    },
    /// The built-in scenario does not read (a bug: every one is read by the tests).
    #[error(transparent)]
    Invalid(#[from] ScenarioError),
}

/// Every built-in scenario: name and TOML text.
pub const ALL: [(&str, &str); 11] = [
    ("worked-example", include_str!("../scenarios/worked-example.toml")),
    ("slow-dependency", include_str!("../scenarios/slow-dependency.toml")),
    ("metastable", include_str!("../scenarios/metastable.toml")),
    ("fan-out", include_str!("../scenarios/fan-out.toml")),
    ("fleet", include_str!("../scenarios/fleet.toml")),
    ("model-provider", include_str!("../scenarios/model-provider.toml")),
    ("model-provider-tokens", include_str!("../scenarios/model-provider-tokens.toml")),
    ("long-tail", include_str!("../scenarios/long-tail.toml")),
    ("capacity-drop", include_str!("../scenarios/capacity-drop.toml")),
    ("database", include_str!("../scenarios/database.toml")),
    ("demo", include_str!("../scenarios/demo.toml")),
];

/// The call-tree model's built-in ([`crate::tree`]): its own kind of scenario.
pub const CALL_TREE: (&str, &str) = ("call-tree", include_str!("../scenarios/call-tree.toml"));

/// The names, for `--help` and error messages.
pub fn names() -> Vec<&'static str> {
    ALL.iter().chain([&CALL_TREE]).map(|(n, _)| *n).collect()
}

/// The TOML text of the built-in scenario `name`.
pub fn text(name: &str) -> Option<&'static str> {
    ALL.iter().chain([&CALL_TREE]).find(|(n, _)| *n == name).map(|(_, t)| *t)
}

/// The built-in scenario `name`, parsed.
pub fn scenario(name: &str) -> Result<Scenario, BuiltinError> {
    let text = text(name).ok_or_else(|| BuiltinError::Unknown { name: name.to_string() })?;
    Ok(Scenario::parse(&format!("--builtin {name}"), text)?)
}

#[cfg(test)]
mod tests {
    #[test]
    fn every_builtin_parses() {
        for (name, _) in super::ALL {
            let s = super::scenario(name).unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(s.name, name);
        }
        let e = super::scenario("nope").unwrap_err();
        assert!(matches!(&e, super::BuiltinError::Unknown { name } if name == "nope"), "{e}");
        assert!(e.to_string().contains("worked-example"), "{e}");
    }
}
