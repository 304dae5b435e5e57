//! Randomness as a parameter.
//!
//! Jitter needs random numbers, but a rule that reads a global or thread-local generator cannot
//! be replayed: the simulator would predict one storm and the proxy run another, and a test of
//! "full jitter spreads the retries" would pass or fail by luck. So every rule that draws takes a
//! [`RandomSource`] argument, exactly as it takes a [`Timestamp`](crate::clock::Timestamp). Tests
//! and the simulator pass a seeded [`SplitMix64`]; production code passes one seeded from
//! whatever entropy it has (for example a `std::collections::hash_map::RandomState` hash), one per
//! worker, so no draw ever takes a lock.
//!
//! ```
//! use std::time::Duration;
//! use stormguard_core::random::{RandomSource, SplitMix64};
//!
//! let mut rng = SplitMix64::new(7);
//! let d = rng.duration_in(Duration::from_millis(10)..=Duration::from_millis(20));
//! assert!(Duration::from_millis(10) <= d && d <= Duration::from_millis(20));
//! assert!(rng.below(6) < 6);
//!
//! // The same seed gives the same draws: a run can be replayed exactly.
//! let (mut a, mut b) = (SplitMix64::new(42), SplitMix64::new(42));
//! assert_eq!(a.next_u64(), b.next_u64());
//! ```

use std::ops::RangeInclusive;
use std::time::Duration;

use crate::clock::duration_nanos;

/// A source of uniformly distributed 64-bit values.
///
/// Only [`next_u64`](RandomSource::next_u64) is required; the provided methods turn it into
/// unbiased draws from a range. Not cryptographic: jitter needs spread, not secrecy.
pub trait RandomSource {
    /// The next value, uniform over all of `u64`.
    fn next_u64(&mut self) -> u64;

    /// A value uniform in `[0, bound)`, without modulo bias; `0` when `bound` is `0`.
    ///
    /// Lemire's multiply-and-shift: the high half of `x × bound` is the draw, and the rare `x`
    /// whose low half falls in the biased band is drawn again (on average fewer than two draws
    /// for any bound).
    fn below(&mut self, bound: u64) -> u64 {
        if bound == 0 {
            return 0;
        }
        let mut m = u128::from(self.next_u64()) * u128::from(bound);
        if (m as u64) < bound {
            // `2^64 mod bound`: the low halves below this are the excess that would bias the draw.
            let threshold = bound.wrapping_neg() % bound;
            while (m as u64) < threshold {
                m = u128::from(self.next_u64()) * u128::from(bound);
            }
        }
        (m >> 64) as u64
    }

    /// A value uniform in `range`, both ends included. An empty range (start above end) gives
    /// its start.
    fn u64_in(&mut self, range: RangeInclusive<u64>) -> u64 {
        let (low, high) = (*range.start(), *range.end());
        if low >= high {
            return low;
        }
        match (high - low).checked_add(1) {
            Some(span) => low + self.below(span),
            // The whole of u64.
            None => self.next_u64(),
        }
    }

    /// A duration uniform in `range` at nanosecond resolution, both ends included. Ends beyond
    /// `u64::MAX` nanoseconds (about 584 years) count as that; an empty range gives its start.
    fn duration_in(&mut self, range: RangeInclusive<Duration>) -> Duration {
        let (low, high) = (duration_nanos(*range.start()), duration_nanos(*range.end()));
        Duration::from_nanos(self.u64_in(low..=high))
    }
}

impl<R: RandomSource + ?Sized> RandomSource for &mut R {
    fn next_u64(&mut self) -> u64 {
        (**self).next_u64()
    }
}

impl<R: RandomSource + ?Sized> RandomSource for Box<R> {
    fn next_u64(&mut self) -> u64 {
        (**self).next_u64()
    }
}

/// SplitMix64 (Steele, Lea and Flood, 2014): a tiny, fast, seedable generator that passes
/// BigCrush; every seed, `0` included, gives a full-period stream.
///
/// Cloning forks the stream: the clone repeats the original's future draws.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SplitMix64 {
    state: u64,
}

impl SplitMix64 {
    /// A generator seeded with `seed` (any value).
    pub const fn new(seed: u64) -> SplitMix64 {
        SplitMix64 { state: seed }
    }
}

impl RandomSource for SplitMix64 {
    fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
}

#[cfg(all(test, not(stormguard_loom)))]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn splitmix64_reference_outputs() {
        let mut rng = SplitMix64::new(0);
        assert_eq!(rng.next_u64(), 0xe220_a839_7b1d_cdaf);
        assert_eq!(rng.next_u64(), 0x6e78_9e6a_a1b9_65f4);
        assert_eq!(rng.next_u64(), 0x06c4_5d18_8009_454f);
    }

    #[test]
    fn same_seed_same_stream_and_clone_forks() {
        let mut a = SplitMix64::new(99);
        let _ = a.next_u64();
        let mut b = a.clone();
        for _ in 0..100 {
            assert_eq!(a.next_u64(), b.next_u64());
        }
        assert_ne!(SplitMix64::new(1).next_u64(), SplitMix64::new(2).next_u64());
    }

    #[test]
    fn works_through_mut_ref_and_dyn() {
        fn draw(mut rng: impl RandomSource) -> u64 {
            rng.below(10)
        }
        let mut rng = SplitMix64::new(3);
        let dynamic: &mut dyn RandomSource = &mut rng;
        assert!(draw(dynamic) < 10);
        assert!(draw(&mut rng) < 10);
        let mut boxed: Box<dyn RandomSource> = Box::new(SplitMix64::new(3));
        assert!(boxed.below(10) < 10);
    }

    #[test]
    fn degenerate_ranges() {
        let mut rng = SplitMix64::new(5);
        assert_eq!(rng.below(0), 0);
        assert_eq!(rng.below(1), 0);
        assert_eq!(rng.u64_in(7..=7), 7);
        #[allow(clippy::reversed_empty_ranges)]
        let reversed = rng.u64_in(9..=3);
        assert_eq!(reversed, 9);
        let _ = rng.u64_in(0..=u64::MAX);
        assert_eq!(
            rng.duration_in(Duration::from_secs(1)..=Duration::from_secs(1)),
            Duration::from_secs(1)
        );
        // Beyond u64 nanoseconds the range saturates instead of overflowing.
        let d = rng.duration_in(Duration::from_secs(1)..=Duration::MAX);
        assert!(d >= Duration::from_secs(1) && d <= Duration::from_nanos(u64::MAX));
        assert_eq!(rng.duration_in(Duration::MAX..=Duration::MAX), Duration::from_nanos(u64::MAX));
    }

    #[test]
    fn below_is_roughly_uniform() {
        // Not a statistical test suite: a sanity check that every bucket is hit about equally.
        let mut rng = SplitMix64::new(11);
        let mut counts = [0u32; 6];
        for _ in 0..60_000 {
            counts[rng.below(6) as usize] += 1;
        }
        for c in counts {
            assert!((9_000..=11_000).contains(&c), "{counts:?}");
        }
    }

    #[test]
    fn below_rejects_the_biased_band() {
        // A bound just over 2^63 leaves almost half of all values in the biased band; the draw
        // must still land below the bound every time.
        let bound = (1u64 << 63) + 1;
        let mut rng = SplitMix64::new(17);
        for _ in 0..10_000 {
            assert!(rng.below(bound) < bound);
        }
    }

    proptest! {
        #[test]
        fn below_respects_bound(seed: u64, bound in 1u64..) {
            let mut rng = SplitMix64::new(seed);
            for _ in 0..16 {
                prop_assert!(rng.below(bound) < bound);
            }
        }

        #[test]
        fn u64_in_respects_range(seed: u64, a: u64, b: u64) {
            let (low, high) = (a.min(b), a.max(b));
            let mut rng = SplitMix64::new(seed);
            for _ in 0..16 {
                let v = rng.u64_in(low..=high);
                prop_assert!(low <= v && v <= high);
            }
        }

        #[test]
        fn duration_in_respects_range(seed: u64, a: u64, b: u64) {
            let (low, high) = (Duration::from_nanos(a.min(b)), Duration::from_nanos(a.max(b)));
            let mut rng = SplitMix64::new(seed);
            for _ in 0..16 {
                let d = rng.duration_in(low..=high);
                prop_assert!(low <= d && d <= high);
            }
        }
    }
}
