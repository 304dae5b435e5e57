//! A sliding window of counts in atomics, shared by the ratio budget, the breaker and the call
//! tree's ledger: 10 slices, each one `AtomicU64` packing the slice number (low 32 bits of
//! `now / slice_len`) in the high half and the count in the low half, so a slot is rotated to
//! a new slice and counted in one compare-exchange. The window holds the current slice and the
//! 9 before it; a slice a caller with a slightly later clock already opened counts too.

use crate::clock::Timestamp;
use crate::sync::{AtomicU64, Ordering};

/// Slices in a window.
pub(crate) const SLICES: usize = 10;

fn pack(tag: u32, count: u32) -> u64 {
    (u64::from(tag) << 32) | u64::from(count)
}

fn unpack(v: u64) -> (u32, u32) {
    ((v >> 32) as u32, v as u32)
}

/// Whether slice `tag` is inside the window that ends at slice `current`. Slices a racing caller
/// with a slightly later clock already opened count too.
fn in_window(current: u32, tag: u32) -> bool {
    let age = current.wrapping_sub(tag) as i32;
    age > -(SLICES as i32) && age < SLICES as i32
}

/// The slot of `now` and its slice's number, for slices `slice_nanos` long.
pub(crate) fn slice(now: Timestamp, slice_nanos: u64) -> (usize, u32) {
    let s = now.as_nanos() / slice_nanos;
    ((s % SLICES as u64) as usize, s as u32)
}

/// Counts over the last [`SLICES`] slices.
#[derive(Debug)]
pub(crate) struct Window {
    slots: [AtomicU64; SLICES],
}

impl Window {
    pub(crate) fn new() -> Window {
        Window { slots: std::array::from_fn(|_| AtomicU64::new(0)) }
    }

    /// Adds `n` to slot `idx` for slice `tag`, rotating it if it holds an older slice. Returns
    /// the slice the count went into.
    pub(crate) fn add(&self, idx: usize, tag: u32, n: u32) -> u32 {
        let slot = &self.slots[idx];
        // SeqCst: a withdrawal must be visible to every later balance check, including checks
        // that read other slots first.
        let mut cur = slot.load(Ordering::SeqCst);
        loop {
            let (t, count) = unpack(cur);
            // How far the slot's slice is ahead of ours: a caller with a slightly later clock
            // may already have opened the next one. Anything else is an old slice (or the
            // initial tag 0, however far the clock is from zero) and is replaced.
            let ahead = t.wrapping_sub(tag) as i32;
            let next = if t == tag || (ahead > 0 && ahead < SLICES as i32) {
                pack(t, count.saturating_add(n))
            } else {
                pack(tag, n)
            };
            match slot.compare_exchange_weak(cur, next, Ordering::SeqCst, Ordering::SeqCst) {
                Ok(_) => return unpack(next).0,
                Err(actual) => cur = actual,
            }
        }
    }

    /// Takes back one count from slot `idx`'s slice `tag`, unless the slot has moved on (then
    /// it aged out).
    pub(crate) fn undo(&self, idx: usize, tag: u32) {
        let slot = &self.slots[idx];
        let mut cur = slot.load(Ordering::SeqCst);
        loop {
            let (t, count) = unpack(cur);
            if t != tag || count == 0 {
                return;
            }
            match slot.compare_exchange_weak(
                cur,
                pack(t, count - 1),
                Ordering::SeqCst,
                Ordering::SeqCst,
            ) {
                Ok(_) => return,
                Err(actual) => cur = actual,
            }
        }
    }

    /// Forgets every count (a breaker that closes starts a new window). Relaxed: whoever
    /// resets publishes it by a later release of its own.
    pub(crate) fn reset(&self) {
        for slot in &self.slots {
            slot.store(0, Ordering::Relaxed);
        }
    }

    /// The counts in the window that ends at slice `current`.
    pub(crate) fn sum(&self, current: u32) -> u64 {
        self.slots
            .iter()
            .map(|s| unpack(s.load(Ordering::SeqCst)))
            .filter(|&(tag, _)| in_window(current, tag))
            .map(|(_, count)| u64::from(count))
            .sum()
    }

    /// Counts in the window by age in slices (0: the current one; a slice a racing caller
    /// already opened counts as current).
    pub(crate) fn by_age(&self, current: u32) -> [u64; SLICES] {
        let mut ages = [0; SLICES];
        for (tag, count) in self.slots.iter().map(|s| unpack(s.load(Ordering::SeqCst))) {
            if in_window(current, tag) {
                let age = (current.wrapping_sub(tag) as i32).max(0) as usize;
                ages[age] += u64::from(count);
            }
        }
        ages
    }
}
