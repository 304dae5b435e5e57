//! Why a configuration was refused: [`ConfigError`], one variant per kind of rule, naming the
//! field that broke it ([`ConfigError::key`]) so a caller reading a file can point at the key.

/// Why a configuration was refused. Returned by every `validate` and `try_new` in this crate.
/// The message is one plain reason, lowercase without a trailing period.
///
/// Values are kept as they are shown (durations as `{:?}`, fractions as decimals), so the
/// message reads the same whatever the field's type.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// A value outside `[min, max]`.
    #[error("{} must be between {min} and {max}, got {got}", label(key))]
    OutOfRange {
        /// The field.
        key: &'static str,
        /// The smallest allowed value.
        min: String,
        /// The largest allowed value.
        max: String,
        /// The value given.
        got: String,
    },
    /// A value outside the closed interval `[min, max]`, said as an interval.
    #[error("{} must be in [{min}, {max}], got {got}", label(key))]
    NotInInterval {
        /// The field.
        key: &'static str,
        /// The smallest allowed value.
        min: String,
        /// The largest allowed value.
        max: String,
        /// The value given.
        got: String,
    },
    /// A value above its largest allowed value.
    #[error("{} must be at most {max}, got {got}", label(key))]
    TooLarge {
        /// The field.
        key: &'static str,
        /// The largest allowed value.
        max: String,
        /// The value given.
        got: String,
    },
    /// A value that must be above 0 and at most `max`.
    #[error("{} must be above 0 and at most {max}, got {got}", label(key))]
    NotPositiveOrTooLarge {
        /// The field.
        key: &'static str,
        /// The largest allowed value.
        max: String,
        /// The value given.
        got: String,
    },
    /// A fraction outside `[0, max]`.
    #[error("{key} must be a fraction in [0, {max}]{of}, got {got}")]
    NotAFraction {
        /// The field.
        key: &'static str,
        /// What it is a fraction of, when the name does not say (` of requests in flight`), or
        /// empty.
        of: &'static str,
        /// The largest allowed fraction.
        max: String,
        /// The value given.
        got: String,
    },
    /// Zero where the field needs more.
    #[error("{} must be {}", label(key), above_zero(key))]
    Zero {
        /// The field.
        key: &'static str,
    },
    /// The backoff's `max` is below its `base`.
    #[error("backoff max ({max}) must be at least base ({base})")]
    MaxBelowBase {
        /// The base given.
        base: String,
        /// The max given.
        max: String,
    },
    /// Text that is not a backoff range `BASE..MAX`.
    #[error("`{text}` is not a backoff range (e.g. 25ms..250ms)")]
    NotARange {
        /// The text given.
        text: String,
    },
    /// A value that could not be read.
    #[error("{}: {reason}", label(key))]
    BadValue {
        /// The field.
        key: &'static str,
        /// Why it could not be read.
        reason: String,
    },
}

impl ConfigError {
    /// The name of the field that broke the rule, as the config types spell it (`cap`,
    /// `queue_len`, `percent`, `ttl`, `base`, `max`, …). A range (`NotARange`) is `backoff`.
    pub fn key(&self) -> &'static str {
        match self {
            ConfigError::OutOfRange { key, .. }
            | ConfigError::NotInInterval { key, .. }
            | ConfigError::TooLarge { key, .. }
            | ConfigError::NotPositiveOrTooLarge { key, .. }
            | ConfigError::NotAFraction { key, .. }
            | ConfigError::Zero { key }
            | ConfigError::BadValue { key, .. } => key,
            ConfigError::MaxBelowBase { .. } => "max",
            ConfigError::NotARange { .. } => "backoff",
        }
    }
}

/// How a field is named in a message: the backoff's fields are said with their section.
fn label(key: &str) -> &str {
    match key {
        "queue_len" => "queue length",
        "base" => "backoff base",
        "max" => "backoff max",
        "multiplier" => "backoff multiplier",
        other => other,
    }
}

/// The rule a field set to zero broke.
fn above_zero(key: &str) -> &'static str {
    match key {
        "min_requests" => "at least 1",
        "consecutive_failures" => "at least 1 (or none)",
        "token_ratio" => "above 0 (3 decimals are kept)",
        _ => "greater than zero",
    }
}
