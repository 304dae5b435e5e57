//! Lock-free histograms for the four signals.
//!
//! Percentiles do not add across instances or time, so stormguard exports bucket counts and lets
//! Prometheus compute quantiles. A [`Histogram`] is a fixed list of upper bounds and one atomic
//! counter per bucket (plus one for everything above the last bound) and a running sum.
//! Recording is a binary search and two relaxed atomic adds (the count is the sum of the buckets).
//!
//! ```
//! use stormguard_core::histogram::{Histogram, LATENCY_BOUNDS_NANOS};
//!
//! let h = Histogram::new(LATENCY_BOUNDS_NANOS.to_vec());
//! h.record(700_000); // 0.7 ms: healthy, below 1 ms
//! h.record(12_000_000); // 12 ms: congested, above 10 ms
//! let s = h.snapshot();
//! assert_eq!(s.count, 2);
//! assert_eq!(s.count_at_or_below(1_000_000), 1);
//! ```

use crate::sync::{AtomicU64, Ordering};

/// Upper bounds for wait and execution times, in nanoseconds: log-scale from 50 µs to 30 s,
/// including 1 ms (healthy below) and 10 ms (congested above).
pub const LATENCY_BOUNDS_NANOS: [u64; 18] = [
    50_000,
    100_000,
    250_000,
    500_000,
    1_000_000,
    2_500_000,
    5_000_000,
    10_000_000,
    25_000_000,
    50_000_000,
    100_000_000,
    250_000_000,
    500_000_000,
    1_000_000_000,
    2_500_000_000,
    5_000_000_000,
    10_000_000_000,
    30_000_000_000,
];

/// A histogram with fixed upper bounds. See the [module docs](self).
#[derive(Debug)]
pub struct Histogram {
    bounds: Vec<u64>,
    /// One per bound, then the overflow bucket.
    counts: Box<[AtomicU64]>,
    /// The sum of recorded values; for a [linear](Histogram::linear) histogram only of those
    /// past the last bound (the rest is exact from the buckets).
    sum: AtomicU64,
    linear: bool,
}

/// A copy of a histogram's counts (not cumulative), for export.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct HistogramSnapshot {
    /// The upper bounds (inclusive) of the buckets.
    pub bounds: Vec<u64>,
    /// Count per bucket; one more than `bounds`, the last for values above every bound.
    pub counts: Vec<u64>,
    /// Sum of the recorded values (saturating).
    pub sum: u64,
    /// Number of recorded values.
    pub count: u64,
}

impl HistogramSnapshot {
    /// Values recorded at or below `bound` (exact when `bound` is one of the bounds).
    pub fn count_at_or_below(&self, bound: u64) -> u64 {
        self.bounds.iter().zip(&self.counts).take_while(|(b, _)| **b <= bound).map(|(_, c)| c).sum()
    }

    /// The smallest bound at or below which at least `q` (0..=1) of the values fall, or `None`
    /// when empty or past the last bound. For tests and the dashboard; exports carry buckets.
    pub fn quantile_bound(&self, q: f64) -> Option<u64> {
        if self.count == 0 {
            return None;
        }
        let target = (q * self.count as f64).ceil().max(1.0) as u64;
        let mut seen = 0;
        for (b, c) in self.bounds.iter().zip(&self.counts) {
            seen += c;
            if seen >= target {
                return Some(*b);
            }
        }
        None
    }
}

impl Histogram {
    /// A histogram with these upper bounds (sorted ascending; duplicates are removed).
    pub fn new(mut bounds: Vec<u64>) -> Histogram {
        bounds.sort_unstable();
        bounds.dedup();
        let counts = (0..=bounds.len()).map(|_| AtomicU64::new(0)).collect();
        Histogram { bounds, counts, sum: AtomicU64::new(0), linear: false }
    }

    /// One bucket per integer `0..=max` (for in-flight counts). Recording is one atomic add: the
    /// bucket is the value, so the sum comes from the buckets.
    pub fn linear(max: u64) -> Histogram {
        Histogram { linear: true, ..Histogram::new((0..=max).collect()) }
    }

    /// Records one value. The count is the sum of the buckets, so it is not kept apart.
    #[inline]
    pub fn record(&self, value: u64) {
        let i = if self.linear {
            (value as usize).min(self.bounds.len())
        } else {
            self.bounds.partition_point(|b| *b < value)
        };
        // Relaxed: each counter is independent; a snapshot may see one add before another,
        // which a scrape tolerates.
        self.counts[i].fetch_add(1, Ordering::Relaxed);
        if !self.linear || i == self.bounds.len() {
            self.sum.fetch_add(value, Ordering::Relaxed);
        }
    }

    /// The counts now.
    pub fn snapshot(&self) -> HistogramSnapshot {
        let counts: Vec<u64> = self.counts.iter().map(|c| c.load(Ordering::Relaxed)).collect();
        let mut sum = self.sum.load(Ordering::Relaxed);
        if self.linear {
            let exact: u64 =
                self.bounds.iter().zip(&counts).map(|(b, c)| b.saturating_mul(*c)).sum();
            sum = sum.saturating_add(exact);
        }
        HistogramSnapshot { bounds: self.bounds.clone(), count: counts.iter().sum(), counts, sum }
    }
}

impl HistogramSnapshot {
    /// Adds `n` values of zero (recorded elsewhere as a count, to keep a hot path short).
    pub fn add_zeros(&mut self, n: u64) {
        if let Some(first) = self.counts.first_mut() {
            *first += n;
            self.count += n;
        }
    }
}

#[cfg(all(test, not(stormguard_loom)))]
mod tests {
    use super::*;

    #[test]
    fn bounds_are_inclusive_and_overflow_is_kept() {
        let h = Histogram::new(vec![10, 20]);
        for v in [0, 10, 11, 20, 21, u64::MAX] {
            h.record(v);
        }
        let s = h.snapshot();
        assert_eq!(s.counts, [2, 2, 2]);
        assert_eq!(s.count, 6);
        assert_eq!(s.count_at_or_below(20), 4);
    }

    #[test]
    fn linear_has_a_bucket_per_integer() {
        let h = Histogram::linear(3);
        for v in [0, 1, 1, 3, 4] {
            h.record(v);
        }
        assert_eq!(h.snapshot().counts, [1, 2, 0, 1, 1]);
        assert_eq!(h.snapshot().quantile_bound(0.5), Some(1));
        assert_eq!(h.snapshot().quantile_bound(0.99), None);
    }

    #[test]
    fn latency_bounds_include_the_thresholds() {
        assert!(LATENCY_BOUNDS_NANOS.contains(&1_000_000));
        assert!(LATENCY_BOUNDS_NANOS.contains(&10_000_000));
        assert!(LATENCY_BOUNDS_NANOS.windows(2).all(|w| w[0] < w[1]));
    }
}
