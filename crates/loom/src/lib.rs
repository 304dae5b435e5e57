//! Loom models of stormguard-core's limiter and budgets, run by scripts/test's loom stage:
//! `RUSTFLAGS="--cfg stormguard_loom" CARGO_TARGET_DIR=target/loom cargo test -p stormguard-loom
//! --release`. A package of their own so that build compiles core and loom and nothing else
//! (core's dev-dependencies — tokio, tower, proptest, criterion — stay out of it). The models are
//! in `tests/loom.rs`; this library is empty.
