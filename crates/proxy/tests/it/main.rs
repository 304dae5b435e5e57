//! The integration tests of `proxy`, one binary with a module per concern: linking
//! is the slow part of a test build, so each crate links its tests once.

#[allow(dead_code)] // each module uses its own subset
mod common;
#[allow(dead_code)] // each module uses its own subset
mod support;

mod adaptive;
mod callers;
mod deploy_kit;
mod e2e;
mod failover;
mod fleet;
mod grpc;
mod h2;
mod hedge;
mod hostile;
mod inputs;
mod listeners;
mod operate;
mod presets;
mod pushback;
mod rate;
mod signals;
mod strict;
mod timeouts;
mod tls;
mod tree;
