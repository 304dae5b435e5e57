//! The integration tests of `tower`, one binary with a module per concern: linking
//! is the slow part of a test build, so each crate links its tests once.

#[allow(dead_code)] // each module uses its own subset
#[macro_use]
mod support;

mod abandon;
mod adaptive;
mod call;
mod config_errors;
mod deploy_kit;
mod hedge;
mod rate;
mod stack;
mod storm;
mod timeouts;
