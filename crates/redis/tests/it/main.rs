//! The integration tests of `redis`, one binary with a module per concern: linking
//! is the slow part of a test build, so each crate links its tests once.

mod fleet;
mod managed;
