//! Seeded draws: what happens to request number `k`.
//!
//! A chaos run is only evidence if it can be checked. Wall-clock latency on a shared machine says
//! little about whether the script was followed, so every random choice the server makes — does
//! this request fail, reset, or get cut off mid-body, and how long does it take — is a pure
//! function of the server's seed and the request's sequence number. A test draws the same values
//! from a [`Sampler`] directly, over as many requests as it likes, and compares them to the script
//! without ever sleeping; the server makes exactly those draws.
//!
//! ```
//! use std::time::Duration;
//! use stormguard_chaos::{Latency, Phase, Sampler};
//!
//! let phase = Phase {
//!     error_rate: 0.25,
//!     latency: Latency::LogNormal {
//!         p50: Duration::from_millis(50),
//!         p99: Duration::from_millis(400),
//!     },
//!     ..Phase::default()
//! };
//! let sampler = Sampler::new(7);
//! let errors = (0..10_000).filter(|&k| sampler.draw(&phase, k).is_error()).count();
//! assert!((2_350..=2_650).contains(&errors));
//! // Request 42 always gets the same draw from seed 7.
//! assert_eq!(sampler.draw(&phase, 42), Sampler::new(7).draw(&phase, 42));
//! ```

use std::time::Duration;

use stormguard_core::dist::{self, Z_P99, unit};
use stormguard_core::random::{RandomSource, SplitMix64};

use crate::script::Phase;

/// How long a request takes before the server answers it.
///
/// Every distribution is clamped to the phase's `latency_max`. Given as quantiles, a skewed
/// distribution is fitted so that those quantiles are exact: write the p50 and p99 you measured
/// on the real dependency and the draws reproduce them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Latency {
    /// Always this long (zero: answer at once).
    Fixed(Duration),
    /// Uniform between `min` and `max`, both included.
    Uniform {
        /// Shortest draw.
        min: Duration,
        /// Longest draw (at least `min`).
        max: Duration,
    },
    /// Log-normal with this median and 99th percentile (`p99 >= p50 > 0`): the usual shape of a
    /// service's latency, a body and a moderate right tail.
    LogNormal {
        /// Median.
        p50: Duration,
        /// 99th percentile.
        p99: Duration,
    },
    /// Exponential with this mean (> 0): the service time of a memoryless server, the
    /// simulator's `exponential 50ms`.
    Exponential {
        /// The mean.
        mean: Duration,
    },
    /// Pareto (type I) with scale `min` and shape `alpha` (> 0): a heavy tail, where a few
    /// requests take far longer than the rest. `alpha <= 1` has no finite mean; the phase's
    /// `latency_max` keeps draws bounded. [`Latency::pareto_from_quantiles`] fits it to a p50
    /// and p99.
    Pareto {
        /// Scale: the shortest draw.
        min: Duration,
        /// Shape: smaller is heavier.
        alpha: f64,
    },
}

impl Default for Latency {
    fn default() -> Latency {
        Latency::Fixed(Duration::ZERO)
    }
}

/// Why latency parameters were refused. The message is one plain reason, lowercase without a
/// trailing period.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum LatencyError {
    /// `pareto_from_quantiles` without `p99 > p50 > 0`.
    #[error("a Pareto tail needs p99 > p50 > 0")]
    ParetoQuantiles,
    /// A uniform latency with `max < min`.
    #[error("a uniform latency needs max >= min")]
    Uniform,
    /// A log-normal latency without `p99 >= p50 > 0`.
    #[error("a log-normal latency needs p99 >= p50 > 0")]
    LogNormal,
    /// An exponential latency with a zero mean.
    #[error("an exponential latency needs a mean above zero")]
    Exponential,
    /// A Pareto latency without `min > 0` and a finite `alpha > 0`.
    #[error("a Pareto latency needs min > 0 and alpha > 0")]
    Pareto,
}

impl Latency {
    /// The Pareto distribution whose median and 99th percentile are `p50` and `p99`
    /// (`p99 > p50 > 0`): `alpha = ln 50 / ln(p99 / p50)`, `min = p50 / 2^(1/alpha)`.
    pub fn pareto_from_quantiles(p50: Duration, p99: Duration) -> Result<Latency, LatencyError> {
        if p50.is_zero() || p99 <= p50 {
            return Err(LatencyError::ParetoQuantiles);
        }
        let alpha = 50f64.ln() / (p99.as_secs_f64() / p50.as_secs_f64()).ln();
        let min = p50.as_secs_f64() / 2f64.powf(1.0 / alpha);
        Ok(Latency::Pareto { min: Duration::from_secs_f64(min), alpha })
    }

    /// The quantile function: the latency at cumulative probability `u` in (0, 1), unclamped.
    pub fn quantile(&self, u: f64) -> Duration {
        match *self {
            Latency::Fixed(d) => d,
            Latency::Uniform { min, max } => Duration::from_secs_f64(dist::uniform(
                min.as_secs_f64(),
                max.as_secs_f64().max(min.as_secs_f64()),
                u,
            )),
            Latency::LogNormal { p50, p99 } => {
                if p99 <= p50 {
                    return p50;
                }
                let sigma = (p99.as_secs_f64() / p50.as_secs_f64()).ln() / Z_P99;
                seconds(dist::lognormal(p50.as_secs_f64(), sigma, u))
            }
            Latency::Exponential { mean } => seconds(dist::exponential(mean.as_secs_f64(), u)),
            Latency::Pareto { min, alpha } => {
                // P(X > x) = (min / x)^alpha, so x = min / (1 - u)^(1 / alpha).
                seconds(min.as_secs_f64() / (1.0 - u).powf(1.0 / alpha))
            }
        }
    }

    /// Checks the parameters; the reason names what is wrong.
    pub fn validate(&self) -> Result<(), LatencyError> {
        match *self {
            Latency::Fixed(_) => Ok(()),
            Latency::Uniform { min, max } if max < min => Err(LatencyError::Uniform),
            Latency::Uniform { .. } => Ok(()),
            Latency::LogNormal { p50, p99 } if p50.is_zero() || p99 < p50 => {
                Err(LatencyError::LogNormal)
            }
            Latency::LogNormal { .. } => Ok(()),
            Latency::Exponential { mean } if mean.is_zero() => Err(LatencyError::Exponential),
            Latency::Exponential { .. } => Ok(()),
            Latency::Pareto { min, alpha }
                if min.is_zero() || !(alpha > 0.0 && alpha.is_finite()) =>
            {
                Err(LatencyError::Pareto)
            }
            Latency::Pareto { .. } => Ok(()),
        }
    }
}

/// A duration from seconds, saturating instead of panicking on huge or non-finite values.
fn seconds(s: f64) -> Duration {
    Duration::try_from_secs_f64(s).unwrap_or(if s > 0.0 { Duration::MAX } else { Duration::ZERO })
}

/// What the server does with one request, apart from the limits (which depend on the traffic, not
/// on a draw).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Answer 200 with the phase's body.
    Respond,
    /// Answer the phase's error status.
    Error,
    /// Reset instead of answering: the connection (HTTP/1.1) or the stream (h2).
    Reset,
    /// Answer 200, send half the body, then cut it: the HTTP/1.1 connection closes short of its
    /// `Content-Length`, the h2 stream is reset. A streamed provider answer is cut after half
    /// its events.
    Truncate,
    /// Answer at once that the provider is overloaded: Anthropic's 529 `overloaded_error`, or
    /// OpenAI's 503 when chaos plays OpenAI (see [`crate::provider`]).
    Overloaded,
}

/// One request's draw: what happens to it and how long the server waits first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Draw {
    /// What the answer is.
    pub action: Action,
    /// How long the server works before answering (already clamped to `latency_max`).
    pub latency: Duration,
}

impl Draw {
    /// The answer is the injected error status.
    pub fn is_error(&self) -> bool {
        self.action == Action::Error
    }
}

/// Makes the server's random choices from a seed and a request's sequence number.
///
/// Each request gets its own generator, derived from `(seed, k)` by a SplitMix64 finaliser, so the
/// draw for request `k` does not depend on the order in which requests arrive or on how many
/// threads serve them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sampler {
    seed: u64,
}

impl Sampler {
    /// A sampler for this seed (any value).
    pub const fn new(seed: u64) -> Sampler {
        Sampler { seed }
    }

    /// The seed.
    pub const fn seed(&self) -> u64 {
        self.seed
    }

    /// The generator for request `k`: the same `(seed, k)` always gives the same stream, and
    /// neighbouring `k` give unrelated streams (SplitMix64's own streams overlap when seeds
    /// differ by its increment, so the seed is mixed first).
    pub fn rng_for(&self, k: u64) -> SplitMix64 {
        let mut mix = SplitMix64::new(self.seed ^ k.wrapping_mul(0xd1b5_4a32_d192_ed03));
        SplitMix64::new(mix.next_u64())
    }

    /// Request `k`'s draw under `phase`: one uniform for the action, one for the latency.
    /// `overloaded_rate` is the last band, so a script without it draws what it always drew.
    pub fn draw(&self, phase: &Phase, k: u64) -> Draw {
        let mut rng = self.rng_for(k);
        let u = unit(&mut rng);
        // The faults are disjoint bands of one uniform, so each fires at exactly its rate.
        let action = if u < phase.reset_rate {
            Action::Reset
        } else if u < phase.reset_rate + phase.error_rate {
            Action::Error
        } else if u < phase.reset_rate + phase.error_rate + phase.truncate_rate {
            Action::Truncate
        } else if u < phase.reset_rate
            + phase.error_rate
            + phase.truncate_rate
            + phase.overloaded_rate
        {
            Action::Overloaded
        } else {
            Action::Respond
        };
        let latency = phase.latency.quantile(unit(&mut rng)).min(phase.latency_max);
        Draw { action, latency }
    }

    /// Request `k`'s latency under `phase`: the latency of [`Sampler::draw`], from the same
    /// uniform, so a request keeps its rank under another phase's distribution.
    pub fn latency(&self, phase: &Phase, k: u64) -> Duration {
        let mut rng = self.rng_for(k);
        rng.next_u64();
        phase.latency.quantile(unit(&mut rng)).min(phase.latency_max)
    }

    /// Whether request `k`'s streamed answer is cut after its first event, at `rate` (a
    /// fraction in `[0, 1]`): the third uniform of `k`'s generator, after the two of
    /// [`Sampler::draw`], so it never changes the action or the latency.
    pub fn breaks_stream(&self, k: u64, rate: f64) -> bool {
        let mut rng = self.rng_for(k);
        rng.next_u64();
        rng.next_u64();
        unit(&mut rng) < rate
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const N: u64 = 20_000;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    /// The `q` quantile of the draws' latencies (nearest rank).
    fn quantile(draws: &[Draw], q: f64) -> Duration {
        let mut l: Vec<Duration> = draws.iter().map(|d| d.latency).collect();
        l.sort_unstable();
        l[((q * l.len() as f64).ceil() as usize).clamp(1, l.len()) - 1]
    }

    fn draws(phase: &Phase, seed: u64) -> Vec<Draw> {
        let s = Sampler::new(seed);
        (0..N).map(|k| s.draw(phase, k)).collect()
    }

    fn within(actual: Duration, expected: Duration, tolerance: f64) -> bool {
        let (a, e) = (actual.as_secs_f64(), expected.as_secs_f64());
        (a - e).abs() <= tolerance * e
    }

    #[test]
    fn a_latency_alone_is_the_draws() {
        let phase =
            Phase { latency: Latency::LogNormal { p50: ms(20), p99: ms(90) }, ..Phase::default() };
        for k in 0..100 {
            assert_eq!(Sampler::new(5).latency(&phase, k), Sampler::new(5).draw(&phase, k).latency);
        }
    }

    #[test]
    fn error_and_fault_fractions_match_the_script() {
        let phase =
            Phase { error_rate: 0.3, reset_rate: 0.05, truncate_rate: 0.1, ..Phase::default() };
        let d = draws(&phase, 1);
        let frac = |a: Action| d.iter().filter(|x| x.action == a).count() as f64 / N as f64;
        // Binomial standard deviation at n = 20 000 is at most 0.0036; 0.015 is four of them.
        assert!((frac(Action::Error) - 0.3).abs() < 0.015, "{}", frac(Action::Error));
        assert!((frac(Action::Reset) - 0.05).abs() < 0.015, "{}", frac(Action::Reset));
        assert!((frac(Action::Truncate) - 0.1).abs() < 0.015, "{}", frac(Action::Truncate));
        assert!((frac(Action::Respond) - 0.55).abs() < 0.015, "{}", frac(Action::Respond));
        assert_eq!(frac(Action::Overloaded), 0.0);
    }

    #[test]
    fn overloaded_is_a_band_of_its_own_and_leaves_other_draws_alone() {
        let base = Phase { error_rate: 0.3, ..Phase::default() };
        let over = Phase { overloaded_rate: 0.2, ..base.clone() };
        let (a, b) = (draws(&base, 3), draws(&over, 3));
        let frac =
            |d: &[Draw], x: Action| d.iter().filter(|y| y.action == x).count() as f64 / N as f64;
        assert!((frac(&b, Action::Overloaded) - 0.2).abs() < 0.015);
        // Every error stays an error; only answers become overloaded.
        for (x, y) in a.iter().zip(&b) {
            assert_eq!(x.latency, y.latency);
            if x.action != Action::Respond {
                assert_eq!(x.action, y.action);
            }
        }
        let s = Sampler::new(3);
        let broken = (0..N).filter(|&k| s.breaks_stream(k, 0.1)).count() as f64 / N as f64;
        assert!((broken - 0.1).abs() < 0.015, "{broken}");
        assert!((0..N).all(|k| !s.breaks_stream(k, 0.0) && s.breaks_stream(k, 1.0)));
    }

    #[test]
    fn error_fraction_check_can_fail() {
        // The same check against a different script's rate fails: the tolerance discriminates.
        let d = draws(&Phase { error_rate: 0.3, ..Phase::default() }, 1);
        let frac = d.iter().filter(|x| x.is_error()).count() as f64 / N as f64;
        assert!((frac - 0.25).abs() >= 0.015);
        assert_eq!(draws(&Phase::default(), 1).iter().filter(|x| x.is_error()).count(), 0);
        let all = Phase { error_rate: 1.0, ..Phase::default() };
        assert!(draws(&all, 1).iter().all(Draw::is_error));
    }

    #[test]
    fn lognormal_quantiles_match_the_script() {
        let latency = Latency::LogNormal { p50: ms(50), p99: ms(400) };
        for seed in [1, 2, 3] {
            let d = draws(&Phase { latency, ..Phase::default() }, seed);
            assert!(within(quantile(&d, 0.5), ms(50), 0.05), "p50 {:?}", quantile(&d, 0.5));
            assert!(within(quantile(&d, 0.99), ms(400), 0.10), "p99 {:?}", quantile(&d, 0.99));
            // A wrong script's p99 is far outside the tolerance.
            assert!(!within(quantile(&d, 0.99), ms(200), 0.10));
        }
    }

    #[test]
    fn pareto_quantiles_match_the_script() {
        let latency = Latency::pareto_from_quantiles(ms(20), ms(500)).unwrap();
        let d = draws(&Phase { latency, ..Phase::default() }, 9);
        assert!(within(quantile(&d, 0.5), ms(20), 0.05), "p50 {:?}", quantile(&d, 0.5));
        assert!(within(quantile(&d, 0.99), ms(500), 0.15), "p99 {:?}", quantile(&d, 0.99));
        let Latency::Pareto { min, .. } = latency else { unreachable!() };
        assert!(d.iter().all(|x| x.latency >= min));
        assert!(!within(quantile(&d, 0.99), ms(250), 0.15));
    }

    #[test]
    fn pareto_tail_is_clamped_by_latency_max() {
        let latency = Latency::Pareto { min: ms(10), alpha: 0.5 };
        let d = draws(&Phase { latency, latency_max: ms(2_000), ..Phase::default() }, 4);
        assert!(d.iter().all(|x| x.latency <= ms(2_000)));
        // alpha 0.5: P(X > 2 s) = (10 ms / 2 s)^0.5 ≈ 7 %; those are clamped, not lost.
        let clamped = d.iter().filter(|x| x.latency == ms(2_000)).count() as f64 / N as f64;
        assert!((clamped - 0.0707).abs() < 0.01, "{clamped}");
    }

    #[test]
    fn uniform_and_fixed() {
        let latency = Latency::Uniform { min: ms(10), max: ms(30) };
        let d = draws(&Phase { latency, ..Phase::default() }, 5);
        assert!(d.iter().all(|x| ms(10) <= x.latency && x.latency <= ms(30)));
        let mean = d.iter().map(|x| x.latency.as_secs_f64()).sum::<f64>() / N as f64;
        assert!((mean - 0.020).abs() < 0.0005, "{mean}");
        assert!(within(quantile(&d, 0.25), ms(15), 0.05));
        let fixed = Phase { latency: Latency::Fixed(ms(7)), ..Phase::default() };
        assert!(draws(&fixed, 5).iter().all(|x| x.latency == ms(7)));
    }

    #[test]
    fn draws_are_reproducible_from_seed_and_sequence() {
        let phase = Phase {
            error_rate: 0.5,
            latency: Latency::LogNormal { p50: ms(5), p99: ms(50) },
            ..Phase::default()
        };
        let a = Sampler::new(11);
        // Order of asking does not matter: k alone decides.
        let forward: Vec<Draw> = (0..100).map(|k| a.draw(&phase, k)).collect();
        let backward: Vec<Draw> = (0..100).rev().map(|k| a.draw(&phase, k)).collect();
        assert!(forward.iter().eq(backward.iter().rev()));
        let b = Sampler::new(12);
        assert!((0..100).any(|k| a.draw(&phase, k) != b.draw(&phase, k)));
    }

    #[test]
    fn neighbouring_requests_are_not_correlated() {
        // Adjacent k must not share a shifted stream: compare consecutive errors' joint rate.
        let phase = Phase { error_rate: 0.5, ..Phase::default() };
        let s = Sampler::new(0);
        let e: Vec<bool> = (0..N).map(|k| s.draw(&phase, k).is_error()).collect();
        let both = e.windows(2).filter(|w| w[0] && w[1]).count() as f64 / (N - 1) as f64;
        assert!((both - 0.25).abs() < 0.015, "{both}");
    }

    proptest::proptest! {
        #[test]
        fn draws_stay_in_range(seed: u64, k: u64, min_ms in 0u64..1_000, span_ms in 0u64..1_000, cap_ms in 1u64..3_000) {
            let latency = Latency::Uniform { min: ms(min_ms), max: ms(min_ms + span_ms) };
            let phase = Phase { latency, latency_max: ms(cap_ms), ..Phase::default() };
            let d = Sampler::new(seed).draw(&phase, k);
            proptest::prop_assert!(d.latency <= ms(cap_ms));
            proptest::prop_assert!(d.latency >= ms(min_ms).min(ms(cap_ms)));
            proptest::prop_assert_eq!(d.action, Action::Respond);
        }

        #[test]
        fn skewed_draws_are_finite_and_clamped(seed: u64, k: u64, p50 in 1u64..1_000, ratio in 1u64..100) {
            for latency in [
                Latency::LogNormal { p50: ms(p50), p99: ms(p50 * ratio) },
                Latency::Pareto { min: ms(p50), alpha: 1.0 / ratio as f64 },
            ] {
                let phase = Phase { latency, ..Phase::default() };
                let d = Sampler::new(seed).draw(&phase, k);
                proptest::prop_assert!(d.latency <= DEFAULT_LATENCY_MAX_FOR_TESTS);
            }
        }
    }

    const DEFAULT_LATENCY_MAX_FOR_TESTS: Duration = crate::script::DEFAULT_LATENCY_MAX;

    #[test]
    fn validation_reasons() {
        assert_eq!(
            Latency::Uniform { min: ms(2), max: ms(1) }.validate(),
            Err(LatencyError::Uniform)
        );
        assert_eq!(
            Latency::LogNormal { p50: ms(0), p99: ms(1) }.validate(),
            Err(LatencyError::LogNormal)
        );
        assert_eq!(
            Latency::LogNormal { p50: ms(5), p99: ms(1) }.validate(),
            Err(LatencyError::LogNormal)
        );
        assert_eq!(
            Latency::Pareto { min: ms(5), alpha: 0.0 }.validate(),
            Err(LatencyError::Pareto)
        );
        assert_eq!(
            Latency::pareto_from_quantiles(ms(5), ms(5)),
            Err(LatencyError::ParetoQuantiles)
        );
        assert!(Latency::LogNormal { p50: ms(5), p99: ms(5) }.validate().is_ok());
    }
}
