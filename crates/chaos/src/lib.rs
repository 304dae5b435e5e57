//! # stormguard-chaos
//!
//! A retry budget is a claim — "the dependency never sees more than 20 requests in flight, and
//! retries stop once the budget is spent" — and a claim needs a test that can fail. This crate is
//! the upstream for that test: a fault-injecting HTTP/1.1 and h2c server that fails, slows down,
//! limits and resets on a seeded script, and counts what actually reached it, including the exact
//! number of requests in flight. It works behind any stack — stormguard's proxy, Envoy, a client
//! library — because it measures at the dependency, not at the caller.
//!
//! - [`script`]: phases of faults over time, from TOML or built in code;
//! - [`sampler`]: the seeded draws (error, reset, truncation, latency) for request `k`;
//! - [`server`]: the server; [`spawn`] starts one in-process;
//! - [`stats`]: what it saw, as served on `GET /stats`;
//! - [`provider`]: chaos as an OpenAI- or Anthropic-shaped model API (limits per minute,
//!   streams, overload bursts, an exhausted quota);
//! - [`load`]: the load generator behind `stormguard load` (closed and open loop), with the
//!   assertions that prove a budget held.
//!
//! ```
//! use std::time::Duration;
//! use stormguard_chaos::{ChaosConfig, Latency, Phase};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! let phase = Phase {
//!     error_rate: 0.3,
//!     latency: Latency::Fixed(Duration::from_millis(5)),
//!     max_concurrency: Some(20),
//!     ..Phase::default()
//! };
//! let server = stormguard_chaos::spawn(ChaosConfig::single(phase), "127.0.0.1:0".parse().unwrap())
//!     .await
//!     .unwrap();
//! // ... drive traffic at server.url("/") through the stack under test ...
//! let stats = server.stats();
//! assert!(stats.total.in_flight.max <= 20);
//! server.shutdown().await;
//! # }
//! ```

#![warn(missing_docs)]

pub mod forward;
mod ids;
pub mod load;
pub mod provider;
pub mod sampler;
pub mod script;
pub mod server;
pub mod stats;

pub use provider::{ProviderConfig, ProviderError, ProviderKind, ProviderOptions, UnknownProvider};
pub use sampler::{Action, Draw, Latency, LatencyError, Sampler};
pub use script::{
    BadRate, BadWindow, InvalidScript, OnDisconnect, Phase, PhaseError, Rate, RateLimit, Script,
    ScriptError, UnknownOnDisconnect, Window,
};
pub use server::{ChaosConfig, ChaosError, ChaosServer, spawn};
pub use stats::{Counts, InFlightStats, Lateness, PhaseStats, ProviderCounts, Stats};
