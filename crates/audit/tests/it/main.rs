//! The integration tests of `audit`, one binary with a module per concern: linking
//! is the slow part of a test build, so each crate links its tests once.

mod audit;
mod bounds;
