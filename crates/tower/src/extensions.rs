//! The request and response extensions between the caller, the layer's service
//! ([`Stormguard`](crate::Stormguard)) and the service under it, in one place: who sets each,
//! who reads it, and what it means. The layer passes nothing to itself through them: a
//! request's deadline, its slots and its booking travel with its attempts inside the one future.
//!
//! | extension | set by | read by | meaning |
//! | --- | --- | --- | --- |
//! | [`Deadline`] | the caller | the layer | the whole request's deadline (shortens the dependency's) |
//! | [`Idempotent`] | the caller (a route, gRPC) | the layer | any method may be retried |
//! | [`RouteBudget`] | the caller (a route) | the layer | a second budget, charged with the dependency's |
//! | [`FanOutScope`](crate::FanOutScope) | the caller (a trace) | the layer | retries one user action may spend across its calls |
//! | [`RateCost`] | the caller (the proxy, from the body) | the layer | the tokens a request will use, for rate admission |
//! | [`CallerRetry`] | the caller (the proxy, which recognised it) | the layer | the request is the caller's own retry: charged to the budget, never queued |
//! | [`BodyReceived`] | whoever reads the caller's body | the layer | a per-try timeout before it is the caller's slowness |
//! | [`UpstreamTarget`] | the layer, on an attempt to any upstream but the first | the service under it | which upstream the attempt goes to |
//! | [`TimeLeft`] | the layer, while a deadline applies | the service under it (gRPC's `grpc-timeout`) | the request's time left when the attempt was sent |
//! | [`SlotWait`] | the layer, on an attempt that waited for its slot | the service under it | how long it waited in the queue or for its turn in the provider's window |
//! | [`QuotaExhausted`] (response) | the service under it (the proxy, for OpenAI) | the layer | the account's quota is spent: never retried |
//! | [`Denied`](crate::Denied) (response) | the layer | the caller | why the last failure was not retried |
//!
//! The three the layer sets on an attempt are what [`AttemptPolicy::sending`](crate::AttemptPolicy::sending)
//! writes by default, from one typed [`Sending`](crate::Sending); a policy whose service takes
//! them otherwise overrides it (the proxy writes them into the attempt's request itself, so its
//! attempts carry no extension map).

use std::sync::Arc;

use stormguard_core::budget::RetryBudget;

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
/// The layer treats it as a retry of its own, not as an original request: it deposits
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
/// [`DependencyConfig::upstreams`](crate::DependencyConfig::upstreams); 0 with a single
/// upstream). Set by the layer on an attempt to any upstream but the first (absent: 0); read by
/// the service under the layer, which sends the attempt there.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct UpstreamTarget(pub usize);

/// A request extension on each attempt the layer sends while a deadline applies (the
/// dependency's, or the caller's [`Deadline`]): the time the request had left
/// when the attempt was sent — its deadline, not the per-try timeout. A client can pass it on
/// to the dependency, as gRPC's `grpc-timeout`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TimeLeft(pub std::time::Duration);

/// A request extension on an attempt that waited for its slot (a first try in the queue, or for
/// its turn in the provider's window): how long, from the request's arrival at the layer to its
/// admission. For the service under the layer (the proxy's access log reads it); an attempt
/// admitted at once carries none.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlotWait(pub std::time::Duration);

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

/// A request's [`RateCost`] from its extensions: none is zero tokens.
#[inline]
pub(crate) fn rate_cost_in(extensions: &http::Extensions) -> RateCost {
    extensions.get::<RateCost>().copied().unwrap_or_default()
}

/// A response extension: the provider said the account's quota is spent (OpenAI's
/// `insufficient_quota`), not that a rate was passed. The answer is never retried, and rate
/// admission holds its upstream for the quota hold. Set by whoever reads the answer's body
/// below the cap (the proxy does, for `provider = "openai"`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct QuotaExhausted;
