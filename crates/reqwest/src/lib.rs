//! # stormguard-reqwest
//!
//! Most Rust services call HTTP through reqwest, often with `reqwest-retry` on top: a retry
//! loop with backoff, but no budget, no cap and no `Retry-After`, so when the dependency starts
//! failing every caller multiplies its load. This crate is the same rules as
//! [`stormguard_tower`]'s layer as a [`reqwest_middleware::Middleware`], over the same
//! [`Dependency`]: every attempt — first tries and retries — takes a slot under one cap (held
//! until the response body ends or is dropped), retries spend a budget, back off with jitter,
//! honour `Retry-After` and the breaker, and a refusal says why ([`Denied`]).
//!
//! It replaces `RetryTransientMiddleware` in one line:
//!
//! ```
//! use reqwest_middleware::ClientBuilder;
//! use stormguard_reqwest::{Dependency, DependencyConfig, StormguardMiddleware};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let payments = Dependency::try_new(DependencyConfig {
//!     budget: "ratio:percent=0.25,min_per_sec=3".parse()?,
//!     ..DependencyConfig::new("payments")
//! })?;
//! // reqwest's own retries off: stormguard decides every attempt (see below).
//! let reqwest = reqwest::Client::builder().retry(reqwest::retry::never()).build()?;
//! let client = ClientBuilder::new(reqwest)
//!     .with(StormguardMiddleware::new(payments.clone()))
//!     .build();
//! # let _ = client;
//! # Ok(())
//! # }
//! ```
//!
//! **reqwest's own retries.** Since 0.12.23 a `reqwest::Client` retries HTTP/2 protocol
//! refusals (`REFUSED_STREAM`, a graceful `GOAWAY`) by itself, up to twice per request and with
//! no budget, below every middleware. Left on, each attempt stormguard admits can reach the
//! dependency up to three times, uncounted. Build the client with
//! `.retry(reqwest::retry::never())`: stormguard retries those refusals itself (they are
//! `refused-stream` and `reset` in `retry_on`, and a refused stream is retried even for a POST,
//! since it provably never reached the application).
//!
//! **A caller that gives up, and hedges.** reqwest runs a call only while its caller awaits it,
//! so an attempt cannot run on in the background as the tower layer's do. When a caller drops
//! its request while an attempt is at the dependency, the attempt's slot is held for
//! `abandon_hold` instead (the dependency is still working on it). With
//! [`DependencyConfig::retry`]`.hedge` set (and a [`Spawner`], which the configuration requires
//! for the tower layer's sake), an idempotent request not answered after `hedge_after` gets a
//! hedge by the same rules as the tower layer's; the first success is the caller's, and the
//! loser's slot is held the same way.
//!
//! **What a caller gets back.** A retry that was refused returns the last response (its body
//! kept up to `body_limit`) with the reason in its extensions, or the last error wrapped in
//! [`StormguardError::NotRetried`]; a first try stormguard refused (`queue`, `breaker`,
//! `deadline`) is [`StormguardError::Denied`]; a per-try timeout is
//! [`StormguardError::Timeout`]. [`Refusal::denied`] reads the reason from any of them:
//!
//! ```no_run
//! # async fn f(client: reqwest_middleware::ClientWithMiddleware) {
//! use stormguard_reqwest::Refusal;
//! let result = client.get("http://payments.internal/balance").send().await;
//! if let Some(reason) = result.denied() {
//!     eprintln!("stormguard refused a retry: {reason}");
//! }
//! # }
//! ```
//!
//! **Differences from the tower layer** (docs/in-process.md): a request goes to its own URL, so
//! the middleware uses the dependency's first upstream (and its total cap, if one is set); a
//! call cannot be moved to the background (reqwest-middleware lends the rest of the chain only
//! for the duration of `handle`), so a timed-out attempt holds its slot for the whole
//! `timeout_slot_hold`, as the tower layer does without a spawner; record mode (`recorder`) is
//! not written.

#![warn(missing_docs)]

mod attempt;
mod middleware;
mod response;

pub use middleware::StormguardMiddleware;
pub use stormguard_core::Denied;
pub use stormguard_tower::{
    Deadline, Dependency, DependencyConfig, DependencyError, FanOutScope, Idempotent, RouteBudget,
    Spawner, StormguardError,
};

/// Reads why stormguard refused a request or its retry, from whatever the caller got back.
pub trait Refusal {
    /// The reason stormguard refused the retry of the last attempt (or the request itself), if
    /// it did. `None` when the request succeeded, or failed in a way that is not retried
    /// (a 404, a failure not in `retry_on`).
    fn denied(&self) -> Option<Denied>;
}

impl Refusal for reqwest::Response {
    fn denied(&self) -> Option<Denied> {
        self.extensions().get::<Denied>().copied()
    }
}

impl Refusal for reqwest_middleware::Error {
    fn denied(&self) -> Option<Denied> {
        match self {
            reqwest_middleware::Error::Middleware(e) => {
                e.downcast_ref::<StormguardError>().and_then(StormguardError::denied)
            }
            reqwest_middleware::Error::Reqwest(_) => None,
        }
    }
}

impl<T: Refusal> Refusal for Result<T, reqwest_middleware::Error> {
    fn denied(&self) -> Option<Denied> {
        match self {
            Ok(t) => t.denied(),
            Err(e) => e.denied(),
        }
    }
}

/// The README's examples — reqwest's and tower's — compile (`cargo test --doc`).
#[cfg(doctest)]
#[doc = include_str!("../../../README.md")]
pub struct ReadmeDoctests;
