//! Every default of a dependency's rules, in one place.
//!
//! The library, the proxy, the simulator, `plan` and `audit` read their defaults from here, so
//! what `simulate` models with no settings is what the proxy does with none. The config types'
//! `Default` impls ([`LimiterConfig`](crate::limiter::LimiterConfig),
//! [`RetryConfig`](crate::decision::RetryConfig), [`RetryOn`](crate::conditions::RetryOn),
//! [`BudgetSpec`](crate::budget::BudgetSpec), [`BackoffConfig`](crate::backoff::BackoffConfig))
//! are built from these constants; use those where a whole config is wanted.
//!
//! ```
//! use stormguard_core::conditions::{AttemptFailure, RetryOn};
//! use stormguard_core::{defaults, BudgetSpec};
//!
//! // A per-try timeout is retried by default (an idempotent request only, like every failure
//! // after the request was written).
//! assert!(RetryOn::default().matches(AttemptFailure::Timeout));
//! assert_eq!(RetryOn::default().to_string(), defaults::RETRY_ON);
//! assert_eq!(BudgetSpec::default().to_string(), "ratio:percent=0.2,min_per_sec=10,ttl=10s");
//! ```

use std::time::Duration;

use crate::decimal::Fraction;

/// Attempts in flight at once, first tries and retries, per upstream.
pub const CAP: u64 = 20;

/// Primaries that may wait for a slot (0 fails fast).
pub const QUEUE_LEN: u64 = 100;

/// The longest a primary waits for a slot.
pub const QUEUE_TIMEOUT: Duration = Duration::from_secs(1);

/// Retries per request (the first try not counted).
pub const MAX_RETRIES: u32 = 2;

/// The conditions retried, as `retry_on` tokens. `timeout` (the per-try timeout) is in it: a
/// slow dependency is the case stormguard exists for, and Envoy's `5xx` covers timeouts too. A
/// timeout, like a reset or a 5xx, is retried only for an idempotent request (a POST that timed
/// out may have run, so it is refused as `non-idempotent`); `connect-failure` and
/// `refused-stream` prove the request was never processed and are retried for any method.
pub const RETRY_ON: &str = "5xx,reset,connect-failure,refused-stream,timeout";

/// What `stormguard proxy --grpc` retries: gRPC's `UNAVAILABLE` (the status gRPC's own retry
/// guidance names; a server answers it before doing the work), besides the default's transport
/// failures and an intermediary's 5xx (which a gRPC client reads as `UNAVAILABLE` too).
pub const GRPC_RETRY_ON: &str = "5xx,reset,connect-failure,refused-stream,timeout,unavailable";

/// The default budget is the ratio policy: retries are at most this share of original requests
/// (a fraction; `0.2` is 20 %).
pub const RATIO_PERCENT: Fraction = Fraction::from_millionths(200_000);

/// The ratio budget's reserve rate, in retries per second (a reserve of `× RATIO_TTL` per window).
pub const RATIO_MIN_PER_SEC: Fraction = Fraction::from_millionths(10 * Fraction::ONE_MILLIONTHS);

/// How long the ratio budget remembers a deposit or a withdrawal.
pub const RATIO_TTL: Duration = Duration::from_secs(10);

/// The concurrency budget's share of everything in flight (Envoy's `budget_percent`).
pub const CONCURRENCY_PERCENT: Fraction = Fraction::from_millionths(200_000);

/// The concurrency budget's floor, in concurrent retries (Envoy's `min_retry_concurrency`); also
/// `stormguard plan`'s default `--floor`.
pub const CONCURRENCY_MIN: u64 = 3;

/// The backoff before the first retry, before jitter.
pub const BACKOFF_BASE: Duration = Duration::from_millis(25);

/// The cap on any backoff, after jitter.
pub const BACKOFF_MAX: Duration = Duration::from_millis(250);

/// The backoff's growth per retry.
pub const BACKOFF_MULTIPLIER: Fraction = Fraction::from_millionths(2 * Fraction::ONE_MILLIONTHS);

/// How the backoff is spread: the token of [`Jitter::Full`](crate::backoff::Jitter::Full),
/// `Jitter`'s own default. (A token, so that this module, every placement's one source of
/// defaults, is a leaf: it imports no rule.)
pub const BACKOFF_JITTER: &str = "full";

/// A server's pushback longer than this means no retry (never a shortened wait).
pub const MAX_PUSHBACK: Duration = Duration::from_secs(300);

/// The least time an attempt needs: a retry whose wait plus this passes the deadline is refused.
pub const MIN_ATTEMPT_TIME: Duration = Duration::from_millis(5);

/// Refuse to retry a request that arrived already marked as a retry by another layer.
pub const DENY_STACKED: bool = true;

/// Budgets are enforced (`false` is shadow mode).
pub const ENFORCE: bool = true;

/// Request bodies are copied while sent, up to this many bytes, so a retry can resend them.
pub const BODY_LIMIT: usize = 64 * 1024;

/// How long a dependency's stated concurrency limit (`X-Concurrency-Limit-Limit`) holds.
pub const LIMIT_TTL: Duration = Duration::from_secs(10);

/// Whole retries one fan-out scope (one user action) may spend across its calls.
pub const SCOPE_RETRIES: u64 = 1;

/// Fan-out scopes remembered at once (LRU, 10 s idle).
pub const SCOPE_MAX: usize = 65_536;

/// How long an attempt stormguard timed out (its per-try timeout, or the request's deadline)
/// keeps its slot while the dependency may still be working on it: the slot comes back when the
/// upstream answers, or when this passes, whichever is first. Long on purpose: a hold costs
/// nothing while the dependency answers, and one shorter than the dependency's slow answers
/// silently lets it see more than the cap. Never shortened to what was left of the deadline.
pub const TIMEOUT_SLOT_HOLD: Duration = Duration::from_secs(30);

/// How long an attempt whose caller went away (closed its connection, dropped the future)
/// keeps its slot while the dependency may still be working on it: as
/// [`TIMEOUT_SLOT_HOLD`], the slot comes back when the upstream answers, or at this bound,
/// when the attempt is cut and counted.
pub const ABANDON_HOLD: Duration = Duration::from_secs(30);

/// How long an upstream's own word — a 429's reset or `Retry-After`, a rate-limit reset header
/// — may hold a dependency's admission (first tries included): a reset of a day is honoured for
/// this long, then traffic resumes and the provider is asked again. The same bound as
/// [`MAX_PUSHBACK`] puts on a retry's wait.
pub const MAX_HOLD: Duration = MAX_PUSHBACK;

/// How long a spent quota (OpenAI's `insufficient_quota`) holds the upstream.
pub const QUOTA_HOLD: Duration = Duration::from_secs(60);

/// How long an overloaded answer (Anthropic's 529, OpenAI's 503) cools the upstream down.
pub const OVERLOAD_COOL_DOWN: Duration = Duration::from_secs(1);

/// How long after an answer failed (or was refused) the caller's identical request is its
/// retry, to the proxy (`client_retry_window`): a retry loop's backoff is well inside it; two
/// users' identical requests seconds apart, by the one-charge-per-failure rule, cost at most
/// the one charge.
pub const CLIENT_RETRY_WINDOW: Duration = Duration::from_secs(10);

/// Distinct `client` label values the proxy keeps; later callers are counted as `other`.
pub const CLIENT_MAX: usize = 32;

/// How far an answer's stated token `usage` may exceed the request's own estimate (× this):
/// above it the count is clamped. A provider's real count is within a small factor of the
/// estimate (the estimate errs high: four bytes a token, the output maximum asked); a count of
/// `1e30` from a broken or hostile upstream is not a count.
pub const USAGE_MAX_FACTOR: u64 = 16;

/// Bytes of an upstream's answer the proxy reads ahead of its caller: an answer up to this size
/// is read at the upstream's pace whatever the caller reads, and its slot comes back when the
/// upstream has finished (Envoy's per-connection buffer is the same size). 0 turns reading
/// ahead off.
pub const RESPONSE_BUFFER: usize = 1024 * 1024;

/// How long a caller may leave an answer's read-ahead buffer full (it accepts nothing while the
/// upstream has more to send), or leave a finished answer unread, before the answer is cut: the
/// upstream attempt ends, its slot comes back, and the buffer is freed. 0 turns it off.
pub const RESPONSE_IDLE_TIMEOUT: Duration = Duration::from_secs(30);

/// The longest a caller may go without sending request body bytes (`408` past it).
pub const BODY_IDLE_TIMEOUT: Duration = Duration::from_secs(10);

/// The longest the proxy waits, in all, for a request body's bytes (`408` past it): a bound on
/// the time a dribbling caller holds a slot, which a gap bound alone is not. 0 turns it off.
pub const BODY_TIMEOUT: Duration = Duration::from_secs(30);

/// A new connection must send a whole request head within this; a kept-alive one, from the
/// first byte of its next request.
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);

/// A connection with nothing in flight is closed after this.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(60);

/// Connections the admin listener holds at once.
pub const ADMIN_MAX_CONNECTIONS: usize = 64;

/// A request head's size (HTTP/1.1) or header list (HTTP/2), at most.
pub const MAX_HEADER_BYTES: usize = 64 * 1024;

/// Streams one HTTP/2 caller connection may have open (hyper's default).
pub const HTTP2_MAX_CONCURRENT_STREAMS: u32 = 200;

/// An HTTP/2 caller connection is sent a PING this often, and has as long to answer it.
pub const HTTP2_KEEPALIVE_INTERVAL: Duration = Duration::from_secs(30);

/// How long a drain waits for requests in flight.
pub const DRAIN_TIMEOUT: Duration = Duration::from_secs(10);

/// The largest budget share `stormguard plan` suggests and `stormguard audit` accepts without a
/// `budget-too-high` warning (a fraction; `0.5` is 50 %): past it, a failing dependency sees
/// half again its normal load in retries whatever headroom the cap leaves.
pub const MAX_SUGGESTED_PERCENT: Fraction = Fraction::from_millionths(500_000);

#[cfg(all(test, not(stormguard_loom)))]
mod tests {
    use super::*;
    use crate::backoff::BackoffConfig;
    use crate::budget::BudgetSpec;
    use crate::conditions::{AttemptFailure, RetryOn};
    use crate::decision::RetryConfig;
    use crate::limiter::LimiterConfig;

    #[test]
    fn the_config_types_default_to_these() {
        let l = LimiterConfig::default();
        assert_eq!((l.cap, l.queue_len, l.queue_timeout), (CAP, QUEUE_LEN, QUEUE_TIMEOUT));
        let r = RetryConfig::default();
        assert_eq!(r.retry_on.to_string(), RETRY_ON);
        assert_eq!(r.max_retries, MAX_RETRIES);
        assert_eq!((r.deny_stacked, r.enforce), (DENY_STACKED, ENFORCE));
        assert_eq!(r.min_attempt_time, MIN_ATTEMPT_TIME);
        assert_eq!(r.pushback.max_pushback, MAX_PUSHBACK);
        assert_eq!(r.backoff, BackoffConfig::default());
        let b = BackoffConfig::default();
        assert_eq!(
            (b.base, b.max, b.multiplier, b.jitter.as_str()),
            (BACKOFF_BASE, BACKOFF_MAX, BACKOFF_MULTIPLIER, BACKOFF_JITTER)
        );
        assert_eq!(BudgetSpec::default().to_string(), "ratio:percent=0.2,min_per_sec=10,ttl=10s");
        assert_eq!(BudgetSpec::parse("ratio").unwrap(), BudgetSpec::default());
        assert_eq!(
            BudgetSpec::parse("concurrency").unwrap().to_string(),
            "concurrency:percent=0.2,min=3"
        );
    }

    #[test]
    fn timeouts_are_retried_by_default() {
        let grpc: RetryOn = GRPC_RETRY_ON.parse().unwrap();
        assert_eq!(grpc.to_string(), GRPC_RETRY_ON);
        let r: RetryOn = RETRY_ON.parse().unwrap();
        assert_eq!(r, RetryOn::default());
        for f in [
            AttemptFailure::Timeout,
            AttemptFailure::Reset,
            AttemptFailure::ConnectFailure,
            AttemptFailure::RefusedStream,
            AttemptFailure::Status(500),
            AttemptFailure::Status(503),
        ] {
            assert!(r.matches(f), "{f}");
        }
        assert!(!r.matches(AttemptFailure::Status(429)));
        assert!(!r.matches(AttemptFailure::Status(404)));
    }
}
