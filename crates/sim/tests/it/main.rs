//! The integration tests of `sim`, one binary with a module per concern: linking
//! is the slow part of a test build, so each crate links its tests once.

mod bounds;
mod call_tree;
mod callers;
mod capacity_drop;
mod differential;
mod fan_out;
mod long_tail;
mod metastable;
mod model;
mod model_provider;
mod overhead;
mod worked_example;
mod workers;
