//! Histograms: lock-free fixed-bucket ones for the four signals, and one log-linear type for
//! percentiles, shared by the simulator and the live measurements it is checked against.
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
//!
//! A [`LogHistogram`] answers percentiles: the simulator's latencies, `stormguard load`'s and
//! `stormguard verify`'s live ones all go through it, so a predicted p99 and a measured one
//! are read by the same arithmetic (the middle of the bucket the rank falls in).
//!
//! ```
//! use stormguard_core::histogram::LogHistogram;
//!
//! let mut h = LogHistogram::new(6, u64::MAX); // 64 buckets per power of two: within 1.6 %
//! (1..=1000u64).for_each(|ms| h.record(ms * 1_000_000));
//! let p99 = h.quantile(0.99).unwrap() as f64 / 1e6;
//! assert!((p99 - 990.0).abs() < 990.0 / 64.0, "{p99}");
//! assert_eq!((h.len(), h.max()), (1000, Some(1_000_000_000)));
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

/// Up to this many bounds, [`Histogram::record`] counts the bounds below a value rather than
/// searching for it.
const SHORT: usize = 32;

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
        } else if self.bounds.len() <= SHORT {
            // The bounds below the value, counted without branches: the comparisons are
            // independent, where a binary search is a chain of dependent loads (about three
            // times as long for the latency bounds, on a permit's hot path).
            self.bounds.iter().map(|b| usize::from(*b < value)).sum()
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

/// A log-linear histogram of `u64` values for percentiles: exact below `2 × 2^bits`, then
/// `2^bits` buckets per power of two, so a value is kept to within `2^-bits` of itself (6 bits:
/// 1.6 %; 10 bits: 0.1 %, HdrHistogram's three significant digits). Values above `max` count
/// as `max`. Fixed size, no allocation after creation; not shared between threads (merge
/// per-thread ones with [`LogHistogram::merge`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogHistogram {
    bits: u32,
    max_value: u64,
    counts: Vec<u64>,
    total: u64,
    sum: u128,
    min: u64,
    max: u64,
}

impl LogHistogram {
    /// A histogram with `2^bits` buckets per power of two (`bits` clamped to `1..=16`), for
    /// values up to `max`.
    pub fn new(bits: u32, max: u64) -> LogHistogram {
        let bits = bits.clamp(1, 16);
        let len = Self::index_of(bits, max) + 1;
        LogHistogram {
            bits,
            max_value: max,
            counts: vec![0; len],
            total: 0,
            sum: 0,
            min: u64::MAX,
            max: 0,
        }
    }

    #[inline]
    fn index_of(bits: u32, v: u64) -> usize {
        let sub = 1u64 << bits;
        if v < 2 * sub {
            return v as usize;
        }
        let shift = (63 - v.leading_zeros()) - bits;
        (u64::from(shift) * sub + (v >> shift)) as usize
    }

    /// The middle of bucket `i`'s range.
    fn value_of(&self, i: usize) -> u64 {
        let sub = 1usize << self.bits;
        if i < 2 * sub {
            return i as u64;
        }
        let shift = (i / sub - 1) as u32;
        let top = (i - (i / sub - 1) * sub) as u64;
        (top << shift) + (1u64 << shift) / 2
    }

    /// Records one value.
    #[inline]
    pub fn record(&mut self, v: u64) {
        let v = v.min(self.max_value);
        self.counts[Self::index_of(self.bits, v)] += 1;
        self.total += 1;
        self.sum += u128::from(v);
        self.min = self.min.min(v);
        self.max = self.max.max(v);
    }

    /// Adds another histogram's values. Both must have been made with the same `bits` and
    /// `max`; a histogram of another shape is added value by value at its buckets' middles.
    pub fn merge(&mut self, other: &LogHistogram) {
        if other.total == 0 {
            return;
        }
        if (other.bits, other.max_value) == (self.bits, self.max_value) {
            self.counts.iter_mut().zip(&other.counts).for_each(|(a, b)| *a += b);
            self.total += other.total;
            self.sum += other.sum;
            self.min = self.min.min(other.min);
            self.max = self.max.max(other.max);
        } else {
            for (i, c) in other.counts.iter().enumerate().filter(|(_, c)| **c > 0) {
                (0..*c).for_each(|_| self.record(other.value_of(i)));
            }
        }
    }

    /// How many values were recorded.
    pub fn len(&self) -> u64 {
        self.total
    }

    /// Whether nothing was recorded.
    pub fn is_empty(&self) -> bool {
        self.total == 0
    }

    /// The mean of the values recorded (exact), or `None` when empty.
    pub fn mean(&self) -> Option<f64> {
        (self.total > 0).then(|| self.sum as f64 / self.total as f64)
    }

    /// The smallest value recorded (exact), or `None` when empty.
    pub fn min(&self) -> Option<u64> {
        (self.total > 0).then_some(self.min)
    }

    /// The largest value recorded (exact), or `None` when empty.
    pub fn max(&self) -> Option<u64> {
        (self.total > 0).then_some(self.max)
    }

    /// The value at quantile `q` (`0..=1`): the middle of the bucket holding the
    /// `ceil(q × len)`-th smallest value, or `None` when empty.
    pub fn quantile(&self, q: f64) -> Option<u64> {
        if self.total == 0 {
            return None;
        }
        let rank = ((q * self.total as f64).ceil() as u64).clamp(1, self.total);
        let mut seen = 0;
        for (i, c) in self.counts.iter().enumerate() {
            seen += c;
            if seen >= rank {
                return Some(self.value_of(i));
            }
        }
        None
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

    /// Short bound lists count the bounds below a value, long ones search: both put every value
    /// in the bucket of the first bound at or above it.
    #[test]
    fn counting_and_searching_agree_at_every_edge() {
        let long: Vec<u64> = (1..=40).map(|i| i * 100).collect();
        for bounds in [LATENCY_BOUNDS_NANOS.to_vec(), long] {
            let h = Histogram::new(bounds.clone());
            let mut values = vec![0, u64::MAX];
            for b in &bounds {
                values.extend([b - 1, *b, b + 1]);
            }
            let mut expected = vec![0; bounds.len() + 1];
            for v in &values {
                h.record(*v);
                expected[bounds.iter().position(|b| b >= v).unwrap_or(bounds.len())] += 1;
            }
            assert_eq!(h.snapshot().counts, expected, "{} bounds", bounds.len());
        }
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

    #[test]
    fn log_histogram_keeps_values_within_its_precision() {
        for bits in [6, 10] {
            let tolerance = 1.0 / f64::from(1u32 << bits);
            for v in [0u64, 1, 127, 128, 129, 1_000, 65_535, 1_000_000, 123_456_789, u64::MAX / 3] {
                let mut h = LogHistogram::new(bits, u64::MAX);
                h.record(v);
                let got = h.quantile(0.5).unwrap();
                let err = (got as f64 - v as f64).abs() / (v as f64).max(1.0);
                assert!(err <= tolerance, "{bits} bits: {v} -> {got}");
                assert_eq!((h.min(), h.max()), (Some(v), Some(v)));
            }
        }
        let mut h = LogHistogram::new(6, u64::MAX);
        assert_eq!((h.quantile(0.5), h.mean(), h.max()), (None, None, None));
        (1..=1000u64).for_each(|v| h.record(v * 1000));
        let p99 = h.quantile(0.99).unwrap() as f64;
        assert!((p99 - 990_000.0).abs() / 990_000.0 < 0.02, "{p99}");
        assert_eq!(h.mean(), Some(500_500.0));
    }

    #[test]
    fn log_histogram_clamps_at_its_max_and_merges() {
        let mut a = LogHistogram::new(10, 1_000_000);
        a.record(5);
        a.record(u64::MAX);
        assert_eq!(a.max(), Some(1_000_000));
        let mut b = LogHistogram::new(10, 1_000_000);
        b.record(7);
        a.merge(&b);
        assert_eq!((a.len(), a.min(), a.quantile(0.5)), (3, Some(5), Some(7)));
        // Another shape is added at its buckets' middles.
        let mut c = LogHistogram::new(6, u64::MAX);
        c.record(3);
        a.merge(&c);
        assert_eq!((a.len(), a.min()), (4, Some(3)));
    }
}
