//! # stormguard-core
//!
//! The rules that keep a slow dependency from becoming an outage, in one place: retry budgets,
//! and the arithmetic of a cap. The in-process middleware, the sidecar proxy, the fleet-wide
//! budget and the simulator all call this same code, so what the simulator predicts is what the
//! proxy does.
//!
//! This crate knows nothing of runtimes or networks: std only, no I/O, no global state. Time is
//! a parameter ([`clock::Timestamp`]), so every rule is deterministic under a manual clock.
//!
//! - [`budget`]: the four retry budget policies behind one non-blocking trait, and their SPECs;
//! - [`plan`]: what a dependency sees at a given error rate, and the budget that fits a cap;
//! - [`decimal`]: exact decimal parameters (no `f64` in budget arithmetic);
//! - [`clock`]: timestamps, a monotonic clock and a manual one;
//! - [`format`](mod@format): numbers and percents as every report prints them.

#![warn(missing_docs)]

pub mod adaptive;
pub mod backoff;
pub mod breaker;
pub mod budget;
pub mod clock;
pub mod conditions;
pub mod decimal;
pub mod decision;
pub mod defaults;
pub mod denied;
pub mod dist;
pub mod error;
pub mod format;
pub mod hedge;
pub mod histogram;
pub mod life;
pub mod limiter;
pub mod plan;
pub mod random;
pub mod rate;
pub mod review;
pub mod scope;
pub mod signals;
mod sync;
pub mod text;
pub mod tree;

pub use budget::{AnyBudget, BudgetSpec, FailureKind, Outcome, RetryBudget, RetryPermit};
pub use clock::{Clock, ManualClock, MonotonicClock, Timestamp};
pub use denied::Denied;
pub use error::ConfigError;
pub use limiter::{AttemptKind, Limiter, LimiterConfig, Permit, Reader};
