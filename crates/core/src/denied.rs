//! Why an attempt was refused: one small enum everywhere — metrics labels, logs, and the
//! proxy's `x-stormguard-denied` header.
//!
//! The order of the variants is the order of the retry decision (docs/rules.md): on a failed
//! attempt the first refusal wins and is the reason. `Queue` refuses primaries only.
//!
//! ```
//! use stormguard_core::Denied;
//! assert_eq!(Denied::Budget.as_str(), "budget");
//! assert_eq!("non-idempotent".parse::<Denied>(), Ok(Denied::NonIdempotent));
//! ```

use std::fmt;
use std::str::FromStr;

/// Why an attempt was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(rename_all = "kebab-case"))]
pub enum Denied {
    /// The request is not idempotent and not provably unsent: a retry could double its effect.
    NonIdempotent,
    /// The request body could not be replayed (larger than the buffer limit).
    Body,
    /// `max_retries` is used up.
    Attempts,
    /// The request arrived already marked as a retry by another layer.
    Stacked,
    /// The circuit breaker is open, or half-open with its probes in use.
    Breaker,
    /// The dependency said not to retry, asked for longer than `max_pushback`, or a hold is
    /// active.
    Pushback,
    /// The backoff plus the minimum attempt time exceeds the time left.
    Deadline,
    /// The fan-out or route scope is spent.
    Scope,
    /// The call tree's amplification allowance is spent: the hops above, and this one, have
    /// sent the extra attempts the user action's context allows (see [`crate::tree`]).
    Tree,
    /// The dependency's retry budget is spent.
    Budget,
    /// No slot was free (or a primary was waiting) when the retry's backoff ended.
    Cap,
    /// The provider's requests or tokens per minute had no room: a retry never waits for it,
    /// and a primary waited past the queue timeout.
    Rate,
    /// A primary found the queue full, or waited past the queue timeout.
    Queue,
}

impl Denied {
    /// Every reason, in decision order.
    pub const ALL: [Denied; 13] = [
        Denied::NonIdempotent,
        Denied::Body,
        Denied::Attempts,
        Denied::Stacked,
        Denied::Breaker,
        Denied::Pushback,
        Denied::Deadline,
        Denied::Scope,
        Denied::Tree,
        Denied::Budget,
        Denied::Cap,
        Denied::Rate,
        Denied::Queue,
    ];

    /// The label used in metrics, logs and headers.
    pub const fn as_str(self) -> &'static str {
        match self {
            Denied::NonIdempotent => "non-idempotent",
            Denied::Body => "body",
            Denied::Attempts => "attempts",
            Denied::Stacked => "stacked",
            Denied::Breaker => "breaker",
            Denied::Pushback => "pushback",
            Denied::Deadline => "deadline",
            Denied::Scope => "scope",
            Denied::Tree => "tree",
            Denied::Budget => "budget",
            Denied::Cap => "cap",
            Denied::Rate => "rate",
            Denied::Queue => "queue",
        }
    }

    /// Whether a refusal for this reason says "do not try this again now" — the dependency's
    /// load — rather than something of the request itself (`non-idempotent`, `body`,
    /// `stacked`, where the caller may know better): what downstream pushback advises on, and
    /// what a call tree passes up.
    pub const fn stands_down(self) -> bool {
        !matches!(self, Denied::NonIdempotent | Denied::Body | Denied::Stacked)
    }

    /// A dense index, `0..Denied::ALL.len()`, for per-reason counters.
    pub const fn index(self) -> usize {
        self as usize
    }
}

impl fmt::Display for Denied {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The text was not one of the reasons.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("`{0}` is not a denial reason")]
pub struct UnknownReason(pub String);

impl FromStr for Denied {
    type Err = UnknownReason;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Denied::ALL.into_iter().find(|d| d.as_str() == s).ok_or_else(|| UnknownReason(s.into()))
    }
}

impl std::error::Error for Denied {}

#[cfg(all(test, not(stormguard_loom)))]
mod tests {
    use super::*;

    #[test]
    fn labels_round_trip_and_index_densely() {
        for (i, d) in Denied::ALL.into_iter().enumerate() {
            assert_eq!(d.index(), i);
            assert_eq!(d.as_str().parse::<Denied>(), Ok(d));
        }
        assert!("nope".parse::<Denied>().is_err());
    }
}
