//! The integration tests of `chaos`, one binary with a module per concern: linking
//! is the slow part of a test build, so each crate links its tests once.

#[allow(dead_code)] // each module uses its own subset
mod common;

mod load;
mod provider;
mod server;
