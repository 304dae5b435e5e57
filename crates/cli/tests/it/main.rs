//! The integration tests of `cli`, one binary with a module per concern: linking
//! is the slow part of a test build, so each crate links its tests once.

#[allow(dead_code)] // each module uses its own subset
mod support;

mod audit;
mod chaos_load;
mod chaos_scenario;
mod config_checks;
mod config_flags;
mod db_check;
mod defaults;
mod demo;
mod examples;
mod input_bounds;
mod logs;
mod plan;
mod plan_formats;
mod proxy;
mod record;
mod replay;
mod review;
mod simulate;
mod verify;
