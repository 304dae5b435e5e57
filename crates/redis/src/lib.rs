//! # stormguard-redis
//!
//! Fleet-wide placement: one cap and one retry reserve for every instance of a service, shared
//! through Redis, with no network round trip on the request path.
//!
//! Fifty instances with a cap of 20 each give a dependency a cap of 1 000, and fifty reserves of
//! 30 retries give it 1 500 it never approved. A ratio budget's `percent` is scale-invariant and
//! stays local; what multiplies with the instance count is the cap and the reserve. So the
//! fleet shares only those, as **leases** granted by one Lua script on Redis's own clock
//! (`TIME`):
//!
//! - **cap slots**: each instance asks for what it uses (in flight + queued + 1); the script
//!   grants max-min fair shares of the fleet cap out of what the other live instances do not
//!   hold. The grant becomes the limiter's lease ([`Limiter::set_lease`]): at most that many
//!   attempts in flight until send time + TTL − a margin on the local monotonic clock. A lower
//!   grant takes effect as permits return; Redis keeps counting what the instance may still hold
//!   until it reports less, so the fleet's sum never passes the cap.
//! - **reserve tokens**: the ratio budget's reserve (`min_per_sec × ttl`) becomes the fleet's,
//!   counted in Redis over the same sliding window; each instance holds a small allowance and
//!   spends it locally, one token per retry beyond its own `percent`.
//!
//! The background [`FleetWorker`] renews once per interval; it is handed back to the caller to
//! run (the library spawns nothing). When Redis is unreachable or slow an instance keeps its
//! lease until it expires, then uses `floor(fleet_cap / max_instances)` slots (and that share of
//! the reserve); it rejoins when Redis answers. A missing epoch key (a Redis that lost its data)
//! makes the script grant nothing new for one TTL while surviving instances re-assert their
//! leases. Keys share a hash tag per dependency, so they live in one Redis Cluster slot.
//!
//! ```no_run
//! use std::sync::Arc;
//! use stormguard_redis::{Fleet, FleetConfig};
//! use stormguard_tower::{Dependency, DependencyConfig};
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let redis = std::env::var("STORMGUARD_REDIS_URL")?.parse()?; // redis://:password@host:6379
//! let fleet = Fleet::try_new(FleetConfig::new("payments", "pod-a", redis, 20, 50))?;
//! let mut config = DependencyConfig::new("payments");
//! config.budget = "ratio:percent=0.25,min_per_sec=3".parse()?;
//! let budget = fleet.budget(&config.budget)?; // the reserve is the fleet's
//! let payments = Dependency::try_new_with_budget(config, Arc::new(budget))?;
//! tokio::spawn(fleet.worker(payments.upstream().limiter.clone()).run()); // yours to run
//! # Ok(()) }
//! ```
//!
//! **Why a small RESP client of our own** ([`resp`]) rather than the `redis` crate: the worker
//! sends one script call per interval on one connection it owns, and must bound every wait and
//! every reply (a slow Redis is a fallback, a malformed reply an error, never a hang or a
//! panic). That is ~200 lines over tokio's `TcpStream`, with no pool, no topology, and nothing
//! to configure away; it speaks RESP2 to any Redis 6+ (AUTH with or without an ACL user,
//! SELECT). TLS (`rediss://`) and following Cluster redirects are not supported yet: the keys
//! are Cluster-ready, the client is not. docs/fleet.md has the choices made where the design
//! was silent.
//!
//! Without the default feature `client` (tokio, rustls) the crate is the fleet's settings and
//! their checks only ([`FleetConfig`], [`Fleet::try_new`], [`Fleet::budget`], [`RedisTarget`]):
//! what a crate that reads a configuration needs.
//!
//! [`Limiter::set_lease`]: stormguard_core::limiter::Limiter::set_lease

#![warn(missing_docs)]

mod fleet;
#[cfg(feature = "metrics")]
pub mod metrics;
#[cfg(feature = "client")]
pub mod resp;
#[cfg(feature = "client")]
pub mod server;
mod target;

#[cfg(feature = "client")]
pub use fleet::FleetWorker;
pub use fleet::{
    Fleet, FleetBudget, FleetConfig, FleetError, FleetMode, FleetSnapshot, LEASE_SCRIPT,
    default_instance_id,
};
pub use target::{BadRedisUrl, RedisTarget};
