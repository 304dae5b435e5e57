//! The request and response extensions the layers pass each other, in one place: who sets
//! each, who reads it, and what it means. A caller sets the first four; the rest are the
//! layers' own.
//!
//! | extension | set by | read by | meaning |
//! | --- | --- | --- | --- |
//! | [`Deadline`] | the caller | [`Retry`](crate::Retry) | the whole request's deadline (shortens the dependency's) |
//! | [`Idempotent`] | the caller (a route, gRPC) | [`Retry`](crate::Retry) | any method may be retried |
//! | [`RouteBudget`] | the caller (a route) | [`Retry`](crate::Retry) | a second budget, charged with the dependency's |
//! | [`FanOutScope`](crate::FanOutScope) | the caller (a trace) | [`Retry`](crate::Retry) | retries one user action may spend across its calls |
//! | [`BodyReceived`] | whoever reads the caller's body | [`Cap`](crate::Cap) | a per-try timeout before it is the caller's slowness |
//! | [`UpstreamTarget`] | [`Retry`](crate::Retry), every attempt | [`Cap`](crate::Cap), the client | which upstream the attempt goes to |
//! | `AdmittedSlot` | [`Retry`](crate::Retry), on a retry | [`Cap`](crate::Cap) (taken out) | the slot the retry was admitted with: a retry never queues |
//! | `AttemptDeadline` | [`Retry`](crate::Retry) | [`Cap`](crate::Cap) | when this attempt must have its response headers |
//! | [`TimeLeft`] | [`Cap`](crate::Cap) | the client (gRPC's `grpc-timeout`) | the request's time left when the attempt was sent |
//! | [`RateCost`] | the caller (the proxy, from the body) | [`Cap`](crate::Cap) | the tokens a request will use, for rate admission |
//! | [`CallerRetry`] | the caller (the proxy, which recognised it) | [`Retry`](crate::Retry) | the request is the caller's own retry: charged to the budget, never queued |
//! | [`Denied`](crate::Denied) (response) | [`Retry`](crate::Retry) | the caller | why the last failure was not retried |

use std::sync::{Arc, Mutex};

use stormguard_core::budget::RetryBudget;
use stormguard_core::clock::Timestamp;
use stormguard_core::limiter::Permit;

/// A request extension: the caller's deadline for the whole request (queue waits, attempts and
/// backoffs included). Shortens the dependency's configured deadline, never lengthens it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Deadline(pub tokio::time::Instant);

impl Deadline {
    /// A deadline `d` from now.
    pub fn after(d: std::time::Duration) -> Deadline {
        Deadline(tokio::time::Instant::now() + d)
    }
}

/// A request extension: the request is a retry its caller sent itself — the proxy recognised it
/// as the repeat of an attempt that failed, or it arrived marked as one — the caller's
/// `attempt`th (2 for its first retry), after a failure of kind `after`.
///
/// The retry layer treats it as a retry of its own, not as an original request: it deposits
/// nothing in the budget (nor the route's), meets the load rules
/// ([`RetryPolicy::decide_caller_retry`](stormguard_core::decision::RetryPolicy::decide_caller_retry):
/// breaker, pushback hold, scopes, budget) and takes its slot with `try_acquire` — refused at
/// once with [`StormguardError::Denied`](crate::StormguardError::Denied), never queued — and is
/// sent marked `x-stormguard-attempt: attempt`. It is stacked: stormguard does not retry it
/// again while `deny_stacked` holds (the caller's own loop will).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CallerRetry {
    /// The caller's attempt this is, 2 or more.
    pub attempt: u32,
    /// The kind of failure it repeats (what a quota budget charges for it).
    pub after: stormguard_core::budget::FailureKind,
}

/// A request extension: this route or method is idempotent (every gRPC call is a POST).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Idempotent;

/// A request extension: the route's own retry budget, charged on top of the dependency's.
#[derive(Clone)]
pub struct RouteBudget(pub Arc<dyn RetryBudget>);

impl std::fmt::Debug for RouteBudget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("RouteBudget").field(&self.0).finish()
    }
}

/// A request extension: which of the dependency's upstreams an attempt goes to (an index into
/// [`DependencyConfig::upstreams`](crate::DependencyConfig::upstreams); 0 with a single upstream). Set by the retry layer on every
/// attempt; read by the cap and by the service that sends the attempt.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct UpstreamTarget(pub usize);

/// The slot the retry layer took for a retry (`Some(None)`: a shadow-mode retry sent without
/// one), and its booking in the provider's window under rate admission. Cap takes it out of
/// the request's extensions.
#[derive(Clone, Debug)]
pub(crate) struct AdmittedSlot(Arc<Mutex<Option<(Slots, crate::rate::Unsent)>>>);

/// What an attempt holds: its slot under its upstream's cap, and one under the dependency's
/// total cap when there is one (`None`s in shadow mode).
pub(crate) type Slots = (Option<Permit>, Option<Permit>);

impl AdmittedSlot {
    pub(crate) fn new(
        permit: Option<Permit>,
        total: Option<Permit>,
        rate: crate::rate::Unsent,
    ) -> AdmittedSlot {
        AdmittedSlot(Arc::new(Mutex::new(Some(((permit, total), rate)))))
    }

    pub(crate) fn take(&self) -> Option<(Slots, crate::rate::Unsent)> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).take()
    }
}

/// The time by which this attempt must have its response headers (the request's deadline).
#[derive(Clone, Copy, Debug)]
pub(crate) struct AttemptDeadline(pub(crate) Timestamp);

/// A request extension on each attempt the cap sends while a deadline applies (the
/// dependency's, or the caller's [`Deadline`]): the time the request had left
/// when the attempt was sent — its deadline, not the per-try timeout. A client can pass it on
/// to the dependency, as gRPC's `grpc-timeout`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TimeLeft(pub std::time::Duration);

/// A request extension: whether the caller's request body has been received whole (set by
/// whoever reads it, e.g. the proxy). While it has not, a per-try timeout is the caller's
/// slowness, not the dependency's: the attempt is cut with
/// [`StormguardError::CallerBody`](crate::StormguardError::CallerBody), its slot comes back at once (the dependency never had the
/// whole request), and neither the breaker nor the budget counts it.
#[derive(Clone, Debug, Default)]
pub struct BodyReceived(Arc<std::sync::atomic::AtomicBool>);

impl BodyReceived {
    /// Marks the body received whole.
    pub fn set(&self) {
        // Release: pairs with the Acquire in `is_received`; nothing else is published.
        self.0.store(true, std::sync::atomic::Ordering::Release);
    }

    /// Whether the body has been received whole.
    pub fn is_received(&self) -> bool {
        self.0.load(std::sync::atomic::Ordering::Acquire)
    }
}

/// A request extension: the tokens the request will use (its input, and its output maximum),
/// booked in the provider's tokens per minute by rate admission before it is sent. Absent: no
/// tokens (requests only). Core's [`Tokens`](stormguard_core::rate::Tokens), which the meter
/// books (an estimate from a body, [`stormguard_http::provider::estimate`], is one already).
pub type RateCost = stormguard_core::rate::Tokens;

/// A response extension: the provider said the account's quota is spent (OpenAI's
/// `insufficient_quota`), not that a rate was passed. The answer is never retried, and rate
/// admission holds its upstream for the quota hold. Set by whoever reads the answer's body
/// below the cap (the proxy does, for `provider = "openai"`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct QuotaExhausted;
