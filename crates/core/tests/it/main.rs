//! The integration tests of `core`, one binary with a module per concern: linking
//! is the slow part of a test build, so each crate links its tests once.

mod budget_reference;
mod limiter_model;
