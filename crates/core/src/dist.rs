//! Latency distributions, drawn by their quantile function: one uniform in, one draw out.
//!
//! Chaos's latencies and the simulator's service times both draw through these (a log-normal's
//! rank is its uniform's, and quantiles fitted to a p50 and a p99 come out exact), so a scenario
//! served by chaos and run by the simulator draws from one arithmetic.
//!
//! ```
//! use stormguard_core::dist::{self, Z_P99};
//! use stormguard_core::random::SplitMix64;
//!
//! // A log-normal with median 40 ms and sigma 0.5: its p99 is 40 ms × e^(2.326 × 0.5).
//! let p99 = dist::lognormal(0.040, 0.5, 0.99);
//! assert!((p99 - 0.040 * (Z_P99 * 0.5).exp()).abs() < 1e-9);
//! // An exponential of mean 50 ms: its median is 50 ms × ln 2.
//! assert!((dist::exponential(0.050, 0.5) - 0.050 * 2f64.ln()).abs() < 1e-12);
//! let u = dist::unit(&mut SplitMix64::new(7));
//! assert!(u > 0.0 && u < 1.0);
//! ```

use crate::random::RandomSource;

/// The 99th percentile of the standard normal distribution.
pub const Z_P99: f64 = 2.326_347_874_040_841;

/// A uniform draw in the open interval (0, 1), with 53 bits of precision: never 0 or 1, so a
/// quantile function is finite at every draw.
#[inline]
pub fn unit<R: RandomSource + ?Sized>(rng: &mut R) -> f64 {
    ((rng.next_u64() >> 11) as f64 + 0.5) / (1u64 << 53) as f64
}

/// The log-normal with this median and sigma (the standard deviation of the logarithm) at
/// cumulative probability `u`: `median × e^(sigma × Φ⁻¹(u))`, in the median's unit.
#[inline]
pub fn lognormal(median: f64, sigma: f64, u: f64) -> f64 {
    median * (sigma * inverse_normal_cdf(u)).exp()
}

/// The uniform distribution over `[min, max]` at cumulative probability `u`, in their unit.
#[inline]
pub fn uniform(min: f64, max: f64, u: f64) -> f64 {
    min + (max - min) * u
}

/// The exponential with this mean at cumulative probability `u`: `−mean × ln(1 − u)`, in the
/// mean's unit.
#[inline]
pub fn exponential(mean: f64, u: f64) -> f64 {
    mean * -(1.0 - u).ln()
}

/// The standard normal quantile function, by Acklam's rational approximation (relative error
/// below 1.2e-9 over (0, 1)): one uniform in, one normal out, so a draw's rank is preserved and
/// the fitted quantiles come out exact.
pub fn inverse_normal_cdf(p: f64) -> f64 {
    const A: [f64; 6] = [
        -3.969_683_028_665_376e1,
        2.209_460_984_245_205e2,
        -2.759_285_104_469_687e2,
        1.383_577_518_672_69e2,
        -3.066_479_806_614_716e1,
        2.506_628_277_459_239,
    ];
    const B: [f64; 5] = [
        -5.447_609_879_822_406e1,
        1.615_858_368_580_409e2,
        -1.556_989_798_598_866e2,
        6.680_131_188_771_972e1,
        -1.328_068_155_288_572e1,
    ];
    const C: [f64; 6] = [
        -7.784_894_002_430_293e-3,
        -3.223_964_580_411_365e-1,
        -2.400_758_277_161_838,
        -2.549_732_539_343_734,
        4.374_664_141_464_968,
        2.938_163_982_698_783,
    ];
    const D: [f64; 4] = [
        7.784_695_709_041_462e-3,
        3.224_671_290_700_398e-1,
        2.445_134_137_142_996,
        3.754_408_661_907_416,
    ];
    const LOW: f64 = 0.024_25;
    if p <= 0.0 {
        return f64::NEG_INFINITY;
    }
    if p >= 1.0 {
        return f64::INFINITY;
    }
    let tail = |q: f64| {
        (((((C[0] * q + C[1]) * q + C[2]) * q + C[3]) * q + C[4]) * q + C[5])
            / ((((D[0] * q + D[1]) * q + D[2]) * q + D[3]) * q + 1.0)
    };
    if p < LOW {
        tail((-2.0 * p.ln()).sqrt())
    } else if p <= 1.0 - LOW {
        let q = p - 0.5;
        let r = q * q;
        (((((A[0] * r + A[1]) * r + A[2]) * r + A[3]) * r + A[4]) * r + A[5]) * q
            / (((((B[0] * r + B[1]) * r + B[2]) * r + B[3]) * r + B[4]) * r + 1.0)
    } else {
        -tail((-2.0 * (1.0 - p).ln()).sqrt())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::random::SplitMix64;

    #[test]
    fn inverse_normal_known_values() {
        assert!(inverse_normal_cdf(0.5).abs() < 1e-9);
        assert!((inverse_normal_cdf(0.99) - Z_P99).abs() < 1e-8);
        assert!((inverse_normal_cdf(0.975) - 1.959_963_984_540_054).abs() < 1e-8);
        assert!((inverse_normal_cdf(0.001) + 3.090_232_306_167_813).abs() < 1e-7);
        assert!((inverse_normal_cdf(0.01) + Z_P99).abs() < 1e-8);
        assert_eq!(inverse_normal_cdf(0.0), f64::NEG_INFINITY);
        // Monotone across the region boundaries.
        let ps = [0.02, 0.024_25, 0.025, 0.5, 0.975, 0.975_75, 0.98];
        assert!(ps.windows(2).all(|w| inverse_normal_cdf(w[0]) < inverse_normal_cdf(w[1])));
    }

    /// Drawn through `unit`, the distributions have the quantiles they are written with.
    #[test]
    fn draws_have_their_quantiles() {
        let mut rng = SplitMix64::new(3);
        let mut logn: Vec<f64> =
            (0..100_000).map(|_| lognormal(40.0, 0.5, unit(&mut rng))).collect();
        let mut expo: Vec<f64> = (0..100_000).map(|_| exponential(50.0, unit(&mut rng))).collect();
        logn.sort_by(f64::total_cmp);
        expo.sort_by(f64::total_cmp);
        let q = |v: &[f64], q: f64| v[(v.len() as f64 * q) as usize];
        assert!((q(&logn, 0.5) / 40.0 - 1.0).abs() < 0.02, "{}", q(&logn, 0.5));
        let p99 = 40.0 * (Z_P99 * 0.5).exp();
        assert!((q(&logn, 0.99) / p99 - 1.0).abs() < 0.03, "{}", q(&logn, 0.99));
        let mean = expo.iter().sum::<f64>() / expo.len() as f64;
        assert!((mean / 50.0 - 1.0).abs() < 0.02, "{mean}");
        assert!((q(&expo, 0.99) / (50.0 * 100f64.ln()) - 1.0).abs() < 0.05);
        assert!(logn.iter().chain(&expo).all(|x| x.is_finite() && *x > 0.0));
    }
}
