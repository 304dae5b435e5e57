//! What rate admission is told of a model provider: which provider's answers these are
//! ([`Provider`]: what its statuses mean) and its requests and tokens per minute
//! ([`RateAdmission`]). Plain settings, runtime-free: the tower layer meters them
//! (`stormguard_tower::rate`), the proxy's config reads them, the simulator models them.

use std::time::Duration;

/// Which provider's answers the dependency speaks to, for what its statuses and bodies mean.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Provider {
    /// Only the generic rules: rate-limit headers read, 429 held until its reset.
    #[default]
    Generic,
    /// OpenAI: a 429 whose error is `insufficient_quota` (the account's quota or billing, not a
    /// rate) is never retried and holds the upstream for [`RateAdmission::quota_hold`].
    OpenAi,
    /// Anthropic: a 529 (`overloaded_error`) is retried under the budget and cools the
    /// upstream down for [`RateAdmission::overload_cool_down`] (another upstream is preferred
    /// meanwhile).
    Anthropic,
}

impl Provider {
    /// Its name in configuration: `generic`, `openai`, `anthropic`.
    pub fn as_str(self) -> &'static str {
        match self {
            Provider::Generic => "generic",
            Provider::OpenAi => "openai",
            Provider::Anthropic => "anthropic",
        }
    }

    /// Whether a status from this provider means the request was refused before it was
    /// processed — a rate limit (429), or an overloaded provider (529, and 503 from OpenAI) —
    /// so that even a request that is not idempotent (a `POST` of a completion) can be retried
    /// without being run twice, as the providers' own SDKs do.
    pub fn refused_unprocessed(self, status: http::StatusCode) -> bool {
        match self {
            Provider::Generic => false,
            Provider::OpenAi => matches!(status.as_u16(), 429 | 503),
            Provider::Anthropic => matches!(status.as_u16(), 429 | 529),
        }
    }

    /// What the preset retries when `retry_on` is not set: what the providers' own SDKs
    /// retry — 408, 409, 429, every 5xx (529 included), a reset, a refused connection or
    /// stream, a timeout. Generic: the usual default.
    pub fn retry_on(self) -> stormguard_core::conditions::RetryOn {
        match self {
            Provider::Generic => stormguard_core::conditions::RetryOn::default(),
            Provider::OpenAi | Provider::Anthropic => {
                PROVIDER_RETRY_ON.parse().expect("PROVIDER_RETRY_ON is a valid retry_on")
            }
        }
    }

    /// Whether a status means the provider is overloaded (not this caller's rate): the upstream
    /// cools down.
    pub fn overloaded(self, status: http::StatusCode) -> bool {
        match self {
            Provider::Generic => false,
            Provider::OpenAi => status.as_u16() == 503,
            Provider::Anthropic => status.as_u16() == 529,
        }
    }
}

/// The `retry_on` of the OpenAI and Anthropic presets.
pub const PROVIDER_RETRY_ON: &str = "5xx,reset,connect-failure,refused-stream,timeout,408,409,429";

/// A provider name that is not one.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("`{0}` is not a provider (expected openai, anthropic or generic)")]
pub struct UnknownProvider(pub String);

impl std::str::FromStr for Provider {
    type Err = UnknownProvider;

    fn from_str(s: &str) -> Result<Provider, UnknownProvider> {
        match s {
            "generic" => Ok(Provider::Generic),
            "openai" => Ok(Provider::OpenAi),
            "anthropic" => Ok(Provider::Anthropic),
            other => Err(UnknownProvider(other.to_string())),
        }
    }
}

impl std::fmt::Display for Provider {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Rate admission: the provider's requests and tokens per minute, beside the cap. A first try
/// that would pass a limit waits for its turn (within the queue timeout, then it is refused
/// `rate`); a retry never waits (refused `rate`). Limits start from here and are learned from
/// the provider's own headers (OpenAI's `x-ratelimit-*-requests|tokens`, Anthropic's
/// `anthropic-ratelimit-*`): its `remaining` is the truth, a stated limit replaces the
/// configured one, and a 429 holds admission until its reset and lowers the limit. Each
/// upstream is metered apart (providers limit per key). A request's token cost is its
/// `RateCost` extension in the tower layer (none: requests only).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RateAdmission {
    /// Requests per minute. `None`: not limited until a provider's header states a limit
    /// (when `learn`).
    pub requests_per_minute: Option<u64>,
    /// Tokens per minute (input and output together). `None`: as for requests.
    pub tokens_per_minute: Option<u64>,
    /// Input tokens per minute (Anthropic counts them apart). `None`: as for requests.
    pub input_tokens_per_minute: Option<u64>,
    /// Output tokens per minute (Anthropic counts them apart). `None`: as for requests.
    pub output_tokens_per_minute: Option<u64>,
    /// Meter even with no configured limit, from what the provider's headers state.
    pub learn: bool,
    /// Whose answers these are; `None`: rate admission's generic rules only.
    pub provider: Option<Provider>,
    /// How long a spent quota (OpenAI's `insufficient_quota`) holds the upstream. Default 60 s.
    pub quota_hold: Duration,
    /// How long an overloaded answer (Anthropic's 529, OpenAI's 503) cools the upstream down:
    /// first tries and failovers go to another upstream meanwhile, when there is one. Default
    /// 1 s.
    pub overload_cool_down: Duration,
    /// The longest an upstream's own word (a 429's `Retry-After` or reset header) holds
    /// admission, first tries included: a reset of a day is honoured for this long, then the
    /// provider is asked again. Default 300 s
    /// ([`MAX_HOLD`](stormguard_core::defaults::MAX_HOLD)).
    pub max_hold: Duration,
    /// How far an answer's stated token `usage` may exceed the request's estimate (× this)
    /// before it is clamped. Default 16
    /// ([`USAGE_MAX_FACTOR`](stormguard_core::defaults::USAGE_MAX_FACTOR)).
    pub usage_max_factor: u64,
}

impl Default for RateAdmission {
    fn default() -> RateAdmission {
        RateAdmission {
            requests_per_minute: None,
            tokens_per_minute: None,
            input_tokens_per_minute: None,
            output_tokens_per_minute: None,
            learn: false,
            provider: None,
            quota_hold: stormguard_core::defaults::QUOTA_HOLD,
            overload_cool_down: stormguard_core::defaults::OVERLOAD_COOL_DOWN,
            max_hold: stormguard_core::defaults::MAX_HOLD,
            usage_max_factor: stormguard_core::defaults::USAGE_MAX_FACTOR,
        }
    }
}

impl RateAdmission {
    /// The configured limits, as rate admission's meter is built with them
    /// ([`Rates::new`](stormguard_core::rate::Rates::new)).
    pub fn per_minute(&self) -> stormguard_core::rate::PerMinute {
        stormguard_core::rate::PerMinute {
            requests: self.requests_per_minute,
            tokens: self.tokens_per_minute,
            input_tokens: self.input_tokens_per_minute,
            output_tokens: self.output_tokens_per_minute,
        }
    }

    /// Whether anything is metered: a limit configured, learning on, or a provider named (a
    /// provider preset learns).
    pub fn is_on(&self) -> bool {
        self.requests_per_minute.is_some() || self.meters_tokens()
    }

    /// Whether tokens are metered, or may be once a provider's header states a limit: a
    /// request's token cost is then worth estimating.
    pub fn meters_tokens(&self) -> bool {
        self.learn
            || self.provider.is_some()
            || self.tokens_per_minute.is_some()
            || self.input_tokens_per_minute.is_some()
            || self.output_tokens_per_minute.is_some()
    }
}
