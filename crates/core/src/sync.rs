//! The atomics the rules use: std's, or loom's under `--cfg stormguard_loom`, so the same code is
//! model-checked. (`--cfg loom` would switch dependencies such as tokio too, so the project uses
//! its own cfg name.)

#[cfg(not(stormguard_loom))]
#[allow(unused_imports)]
pub(crate) use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

#[cfg(stormguard_loom)]
#[allow(unused_imports)]
pub(crate) use loom::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
