//! The atomics the rules use: std's, or loom's under `--cfg stormguard_loom`, so the same code is
//! model-checked. (`--cfg loom` would switch dependencies such as tokio too, so the project uses
//! its own cfg name.)

#[cfg(not(stormguard_loom))]
#[allow(unused_imports)]
pub(crate) use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

#[cfg(stormguard_loom)]
#[allow(unused_imports)]
pub(crate) use loom::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

#[cfg(not(stormguard_loom))]
pub(crate) use std::sync::Arc;

#[cfg(stormguard_loom)]
pub(crate) use loom::sync::Arc;

/// A mutex whose `lock` ignores poisoning: the limiter's slow path keeps its invariants before
/// any call that could panic, so the data behind a poisoned lock is still consistent.
#[derive(Debug, Default)]
pub(crate) struct Mutex<T>(
    #[cfg(not(stormguard_loom))] std::sync::Mutex<T>,
    #[cfg(stormguard_loom)] loom::sync::Mutex<T>,
);

#[cfg(not(stormguard_loom))]
pub(crate) type MutexGuard<'a, T> = std::sync::MutexGuard<'a, T>;
#[cfg(stormguard_loom)]
pub(crate) type MutexGuard<'a, T> = loom::sync::MutexGuard<'a, T>;

impl<T> Mutex<T> {
    pub(crate) fn new(value: T) -> Mutex<T> {
        #[cfg(not(stormguard_loom))]
        return Mutex(std::sync::Mutex::new(value));
        #[cfg(stormguard_loom)]
        return Mutex(loom::sync::Mutex::new(value));
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, T> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The lock if nobody holds it now; `None` otherwise.
    #[allow(dead_code)]
    pub(crate) fn try_lock(&self) -> Option<MutexGuard<'_, T>> {
        #[cfg(not(stormguard_loom))]
        return match self.0.try_lock() {
            Ok(g) => Some(g),
            Err(std::sync::TryLockError::Poisoned(e)) => Some(e.into_inner()),
            Err(std::sync::TryLockError::WouldBlock) => None,
        };
        #[cfg(stormguard_loom)]
        return self.0.try_lock().ok();
    }
}
