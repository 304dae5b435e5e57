//! # stormguard-tower
//!
//! stormguard as tower middleware: one `ServiceBuilder` line puts every attempt to a dependency
//! — first tries and retries — under one concurrency cap, and retries under a budget.
//!
//! ```
//! use stormguard_tower::{Dependency, DependencyConfig, StormguardLayer};
//! use tower::ServiceBuilder;
//!
//! # fn client<S>(s: S) -> S { s }
//! let payments = Dependency::try_new(DependencyConfig {
//!     budget: "ratio:percent=0.25,min_per_sec=3".parse().unwrap(),
//!     ..DependencyConfig::new("payments")
//! })?;
//! let stack = ServiceBuilder::new().layer(StormguardLayer::new(payments.clone()));
//! # let _ = stack;
//! # Ok::<(), stormguard_tower::DependencyError>(())
//! ```
//!
//! The layer makes one service, [`Stormguard`], and one future per request: every attempt —
//! the first try, each retry and hedge — takes its own slot under the cap; a first try may wait
//! in the queue, a retry takes its slot with `try_acquire` when its backoff ends, so it never
//! queues. The order of a request's steps is core's [`Life`](stormguard_core::life::Life); the
//! layer runs it. The [`Dependency`] owns the limiter, the budget, the breaker and the
//! counters, and is shared by every clone of the stack; `metrics::register` exports its signals
//! on a `prometheus-client` registry (the default feature `metrics`; without it the snapshot
//! still holds every count and histogram).

#![warn(missing_docs)]

pub mod call;
pub mod cap;
pub mod clock;
pub mod dependency;
pub mod error;
pub mod extensions;
pub mod hedge;
#[cfg(feature = "metrics")]
pub mod metrics;
pub mod policy;
pub mod rate;
pub mod record;
pub mod request;
pub mod retry;
pub mod span;

pub use call::{Attempt, CallError, Classify, Failure, Outcome};
pub use cap::{BodyReceived, PermitBody, SlotWait, TimeLeft};
pub use dependency::{
    Dependency, DependencyConfig, DependencyError, DependencySnapshot, RateAdmission, Rates,
    Spawner, UpstreamSnapshot, UpstreamSpec,
};
pub use error::{BoxError, StormguardError};
pub use extensions::{CallerRetry, UpstreamTarget};
pub use policy::{AttemptPolicy, CloneBody, Replay, Sending};
pub use rate::Provider;
pub use record::{Recorder, TraceEvent, TraceOp};
pub use retry::{Deadline, Idempotent, RetryBody, RouteBudget, Stormguard};
pub use stormguard_core::Denied;
pub use stormguard_core::limiter::Reader;
pub use stormguard_core::scope::FanOutScope;
pub use stormguard_http::body::ReplayBody;

use tower::Layer;

/// The whole stack: one [`Stormguard`] service over one [`Dependency`].
#[derive(Clone, Debug)]
pub struct StormguardLayer<P = Replay> {
    dependency: Dependency,
    policy: P,
}

impl StormguardLayer<Replay> {
    /// The stack for `dependency`, for `http::Request<ReplayBody<B>>` services.
    pub fn new(dependency: Dependency) -> StormguardLayer<Replay> {
        StormguardLayer { dependency, policy: Replay }
    }
}

impl<P> StormguardLayer<P> {
    /// The same stack with another way to copy request bodies and read responses.
    pub fn with_policy<Q>(self, policy: Q) -> StormguardLayer<Q> {
        StormguardLayer { dependency: self.dependency, policy }
    }
}

impl<S, P: Clone> Layer<S> for StormguardLayer<P> {
    type Service = Stormguard<S, P>;

    fn layer(&self, inner: S) -> Self::Service {
        Stormguard { inner, dependency: self.dependency.clone(), policy: self.policy.clone() }
    }
}

// The README's examples compile as stormguard-reqwest's doctests: that crate depends on this
// one, so it can build the reqwest example and the tower one.
