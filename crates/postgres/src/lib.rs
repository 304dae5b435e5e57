//! # stormguard-postgres
//!
//! A PostgreSQL pool under stormguard, over `tokio-postgres`:
//!
//! - **the pool's size is the dependency's cap**: a transaction's attempt takes a slot (waiting
//!   in the dependency's queue — the pool wait, the third signal) before it takes a connection,
//!   so the database never runs more of this instance's transactions than the cap, and the
//!   slot's life is the execution (the fourth signal). Size the cap across the whole fleet with
//!   [`pool_size`]: `max_connections` less the reserve, divided by the peak instance count;
//! - **transient failures are retried under the budget**, each time in a fresh transaction on a
//!   fresh checkout: a serialization failure (`40001`) or a deadlock (`40P01`) took no effect
//!   and is retried even for a transaction that is not idempotent; an administrator's shutdown
//!   (`57P01`), too many connections (`53300`) and lost connections (`08…`) are retried when
//!   nothing can have been committed; anything else (a constraint, a syntax error) is the
//!   caller's answer ([`classify`]);
//! - **a timed-out or abandoned transaction keeps its slot** while the server may still run it
//!   (`timeout_slot_hold`, `abandon_hold`): its connection is closed, and Postgres ends the
//!   backend when it notices;
//! - **the leak check** ([`leak`]) reads `pg_stat_activity`: connections by state and by
//!   application, `idle in transaction` over a threshold and for how long, and whether that
//!   count climbs over a window — `stormguard db-check` runs it.
//!
//! ```no_run
//! use stormguard_postgres::{Pool, TransactionOptions};
//! use stormguard_tower::{Dependency, DependencyConfig};
//!
//! # async fn f() -> Result<(), Box<dyn std::error::Error>> {
//! let mut db = DependencyConfig::new("orders-db");
//! // 400 connections, 20 kept for admin and migrations, up to 20 pods: 19 each.
//! db.limiter.cap = stormguard_postgres::pool_size(400, 20, 20)?;
//! db.budget = "ratio:percent=0.1,min_per_sec=1".parse()?;
//! let pool = Pool::new("host=127.0.0.1 user=app dbname=orders".parse()?, Dependency::try_new(db)?)?;
//! let total: i64 = pool
//!     .transaction(async |tx| {
//!         tx.execute("UPDATE stock SET n = n - 1 WHERE sku = $1", &[&"a-1"]).await?;
//!         let row = tx.query_one("SELECT sum(n) FROM stock", &[]).await?;
//!         Ok(row.get(0))
//!     })
//!     .await?;
//! # let _ = (total, TransactionOptions::default());
//! # Ok(()) }
//! ```

#![warn(missing_docs)]

mod classify;
pub mod leak;
mod pool;
#[cfg(feature = "testing")]
pub mod testing;

pub use classify::{Error, classify};
pub use pool::{Pool, PoolError, TransactionOptions, pool_size};
