//! The integration tests of `reqwest`, one binary with a module per concern: linking
//! is the slow part of a test build, so each crate links its tests once.

#[allow(dead_code)] // each module uses its own subset
mod support;

mod reqwest_retries;
mod rules;
mod storm;
