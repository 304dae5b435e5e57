//! Service-time distributions and the seeded draws behind them.
//!
//! Every draw comes from a [`SplitMix64`] seeded from the scenario seed, so a run replays
//! exactly. Draws that policies must share (an attempt's error and service time, the arrival
//! times) are *keyed*: the generator is seeded from what the draw is about (the request, the
//! attempt number), not from how many draws came before, so two policies compared on the same
//! arrivals see the same arrivals and the same per-attempt luck even when they send different
//! numbers of attempts.

use std::fmt;
use std::time::Duration;

use stormguard_core::decimal::{format_duration, parse_duration};
use stormguard_core::dist::{self, Z_P99};
use stormguard_core::random::{RandomSource, SplitMix64};

/// How long the dependency works on one attempt.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ServiceTime {
    /// Always the same: `fixed 50ms` (or just `50ms`).
    Fixed(Duration),
    /// Exponential with this mean: `exponential 50ms`.
    Exponential(Duration),
    /// Uniform between two durations, both included: `uniform min=80ms max=120ms`.
    Uniform {
        /// The shortest.
        min: Duration,
        /// The longest.
        max: Duration,
    },
    /// Log-normal with this median and shape: `lognormal median=20ms sigma=0.7`.
    LogNormal {
        /// The median (the 50th percentile).
        median: Duration,
        /// The standard deviation of the logarithm; `0` is fixed at the median.
        sigma: f64,
    },
    /// A log-normal body with a slow tail: a fraction `tail` of the draws have the median
    /// `tail_median` instead (same sigma). `lognormal median=20ms sigma=0.25 tail=0.05
    /// tail_median=400ms` is a dependency whose 1 answer in 20 takes 20× the median (a
    /// garbage-collection pause, a cold cache, a slow replica).
    Tailed {
        /// The body's median.
        median: Duration,
        /// The standard deviation of the logarithm, for the body and the tail.
        sigma: f64,
        /// The fraction of draws in the tail, in `(0, 1)`.
        tail: f64,
        /// The tail's median.
        tail_median: Duration,
    },
}

/// The forms a service time is written in, for the messages.
const FORMS: &str = "expected `fixed 50ms`, `exponential 50ms`, `uniform min=80ms max=120ms`, \
     `lognormal median=20ms sigma=0.7` (with `tail=0.05 tail_median=400ms` for a slow tail) or \
     `p50=20ms p99=100ms`";

/// Why a service time was refused. The message is one plain reason, lowercase without a
/// trailing period.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ServiceTimeError {
    /// `p99 < p50` or `p50` zero.
    #[error("p99 ({p99}) must be at least p50 ({p50}), and p50 above zero")]
    Percentiles {
        /// The median given.
        p50: String,
        /// The 99th percentile given.
        p99: String,
    },
    /// A duration that does not parse.
    #[error("{reason} ({FORMS})")]
    Duration {
        /// Why.
        reason: String,
    },
    /// A word that is not `key=value`.
    #[error("`{word}` is not key=value ({FORMS})")]
    NotKeyValue {
        /// The word.
        word: String,
    },
    /// An exponential mean of zero.
    #[error("an exponential mean must be above zero")]
    ZeroMean,
    /// A sigma that is not a number.
    #[error("sigma `{got}` is not a number")]
    SigmaNotANumber {
        /// The text given.
        got: String,
    },
    /// A sigma outside `[0, 10]`.
    #[error("sigma must be in [0, 10], got {got}")]
    SigmaOutOfRange {
        /// The text given.
        got: String,
    },
    /// A key that is not a lognormal parameter.
    #[error("`{key}` is not a lognormal parameter (median, sigma, tail, tail_median)")]
    NotALognormalParameter {
        /// The key given.
        key: String,
    },
    /// A uniform without both ends, with another key, or with `max < min`.
    #[error("uniform needs min=DURATION and max=DURATION, max at least min")]
    Uniform,
    /// A lognormal without both parameters, or with a zero median.
    #[error("lognormal needs median=DURATION (above zero) and sigma=NUMBER")]
    LognormalIncomplete,
    /// A tail fraction outside `(0, 1)`, or one of `tail` and `tail_median` without the other.
    #[error(
        "a slow tail needs tail=FRACTION (above 0, below 1) and tail_median=DURATION (above zero)"
    )]
    Tail,
    /// A key that is not a percentile.
    #[error("`{key}` is not a percentile (p50, p99)")]
    NotAPercentile {
        /// The key given.
        key: String,
    },
    /// Only one of p50 and p99.
    #[error("give both p50 and p99 ({FORMS})")]
    OnePercentile,
    /// Text in none of the forms.
    #[error("`{text}` is not a service time ({FORMS})")]
    NotAServiceTime {
        /// The text given.
        text: String,
    },
}

impl ServiceTime {
    /// The log-normal whose 50th and 99th percentiles are `p50` and `p99`: `p50=20ms p99=100ms`.
    pub fn from_percentiles(p50: Duration, p99: Duration) -> Result<ServiceTime, ServiceTimeError> {
        if p50.is_zero() || p99 < p50 {
            return Err(ServiceTimeError::Percentiles {
                p50: format_duration(p50),
                p99: format_duration(p99),
            });
        }
        let sigma = (p99.as_secs_f64() / p50.as_secs_f64()).ln() / Z_P99;
        Ok(ServiceTime::LogNormal { median: p50, sigma })
    }

    /// Parses `50ms`, `fixed 50ms`, `exponential 50ms`, `lognormal median=20ms sigma=0.7` or
    /// `p50=20ms p99=100ms`.
    pub fn parse(text: &str) -> Result<ServiceTime, ServiceTimeError> {
        let words: Vec<&str> = text.split_whitespace().collect();
        let dur = |w: &str| {
            parse_duration(w).map_err(|e| ServiceTimeError::Duration { reason: e.to_string() })
        };
        let pairs = |ws: &[&str]| -> Result<Vec<(String, String)>, ServiceTimeError> {
            ws.iter()
                .map(|w| {
                    w.split_once('=')
                        .map(|(k, v)| (k.to_string(), v.to_string()))
                        .ok_or_else(|| ServiceTimeError::NotKeyValue { word: w.to_string() })
                })
                .collect()
        };
        match words.as_slice() {
            [d] if !d.contains('=') => Ok(ServiceTime::Fixed(dur(d)?)),
            ["fixed", d] => Ok(ServiceTime::Fixed(dur(d)?)),
            ["exponential" | "exp", d] => {
                let mean = dur(d)?;
                if mean.is_zero() {
                    return Err(ServiceTimeError::ZeroMean);
                }
                Ok(ServiceTime::Exponential(mean))
            }
            ["uniform", rest @ ..] => {
                let (mut min, mut max) = (None, None);
                for (k, v) in pairs(rest)? {
                    match k.as_str() {
                        "min" => min = Some(dur(&v)?),
                        "max" => max = Some(dur(&v)?),
                        _ => return Err(ServiceTimeError::Uniform),
                    }
                }
                match (min, max) {
                    (Some(min), Some(max)) if max >= min => Ok(ServiceTime::Uniform { min, max }),
                    _ => Err(ServiceTimeError::Uniform),
                }
            }
            ["lognormal", rest @ ..] => {
                let (mut median, mut sigma) = (None, None);
                let (mut tail, mut tail_median) = (None, None);
                for (k, v) in pairs(rest)? {
                    match k.as_str() {
                        "median" => median = Some(dur(&v)?),
                        "tail" => {
                            tail = Some(v.parse::<f64>().map_err(|_| ServiceTimeError::Tail)?)
                        }
                        "tail_median" => tail_median = Some(dur(&v)?),
                        "sigma" => {
                            let s: f64 = v.parse().map_err(|_| {
                                ServiceTimeError::SigmaNotANumber { got: v.clone() }
                            })?;
                            if !(0.0..=10.0).contains(&s) {
                                return Err(ServiceTimeError::SigmaOutOfRange { got: v });
                            }
                            sigma = Some(s);
                        }
                        other => {
                            return Err(ServiceTimeError::NotALognormalParameter {
                                key: other.to_string(),
                            });
                        }
                    }
                }
                let (median, sigma) = match (median, sigma) {
                    (Some(median), Some(sigma)) if !median.is_zero() => (median, sigma),
                    _ => return Err(ServiceTimeError::LognormalIncomplete),
                };
                match (tail, tail_median) {
                    (None, None) => Ok(ServiceTime::LogNormal { median, sigma }),
                    (Some(tail), Some(tail_median))
                        if tail > 0.0 && tail < 1.0 && !tail_median.is_zero() =>
                    {
                        Ok(ServiceTime::Tailed { median, sigma, tail, tail_median })
                    }
                    _ => Err(ServiceTimeError::Tail),
                }
            }
            ws if !ws.is_empty() && ws.iter().all(|w| w.contains('=')) => {
                let (mut p50, mut p99) = (None, None);
                for (k, v) in pairs(ws)? {
                    match k.as_str() {
                        "p50" => p50 = Some(dur(&v)?),
                        "p99" => p99 = Some(dur(&v)?),
                        other => {
                            return Err(ServiceTimeError::NotAPercentile {
                                key: other.to_string(),
                            });
                        }
                    }
                }
                match (p50, p99) {
                    (Some(a), Some(b)) => ServiceTime::from_percentiles(a, b),
                    _ => Err(ServiceTimeError::OnePercentile),
                }
            }
            _ => Err(ServiceTimeError::NotAServiceTime { text: text.to_string() }),
        }
    }

    /// The mean, for the report.
    pub fn mean(&self) -> Duration {
        match *self {
            ServiceTime::Fixed(d) | ServiceTime::Exponential(d) => d,
            ServiceTime::Uniform { min, max } => (min + max) / 2,
            ServiceTime::LogNormal { median, sigma } => {
                median.mul_f64((sigma * sigma / 2.0).exp().min(1e9))
            }
            ServiceTime::Tailed { median, sigma, tail, tail_median } => {
                let spread = (sigma * sigma / 2.0).exp().min(1e9);
                median.mul_f64(spread * (1.0 - tail)) + tail_median.mul_f64(spread * tail)
            }
        }
    }

    /// One draw, in nanoseconds (at least 1): the distribution's quantile function at one
    /// uniform draw ([`stormguard_core::dist`], the sampler chaos serves by), so a draw's rank
    /// is its uniform's and the percentiles given come out exact.
    #[inline]
    pub(crate) fn sample(&self, rng: &mut SplitMix64) -> u64 {
        let nanos = match *self {
            ServiceTime::Fixed(d) => return nanos(d).max(1),
            ServiceTime::Exponential(mean) => {
                dist::exponential(nanos(mean) as f64, dist::unit(rng))
            }
            ServiceTime::Uniform { min, max } => {
                dist::uniform(nanos(min) as f64, nanos(max) as f64, dist::unit(rng))
            }
            ServiceTime::LogNormal { median, sigma } => {
                dist::lognormal(nanos(median) as f64, sigma, dist::unit(rng))
            }
            ServiceTime::Tailed { median, sigma, tail, tail_median } => {
                let m = if dist::unit(rng) < tail { tail_median } else { median };
                dist::lognormal(nanos(m) as f64, sigma, dist::unit(rng))
            }
        };
        // Saturating float-to-int conversion; a day is longer than any scenario cares about.
        (nanos as u64).clamp(1, 86_400_000_000_000)
    }
}

impl std::str::FromStr for ServiceTime {
    type Err = ServiceTimeError;

    /// [`ServiceTime::parse`].
    fn from_str(text: &str) -> Result<ServiceTime, ServiceTimeError> {
        ServiceTime::parse(text)
    }
}

impl fmt::Display for ServiceTime {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            ServiceTime::Fixed(d) => write!(f, "fixed {}", format_duration(d)),
            ServiceTime::Exponential(d) => write!(f, "exponential {}", format_duration(d)),
            ServiceTime::Uniform { min, max } => {
                write!(f, "uniform min={} max={}", format_duration(min), format_duration(max))
            }
            ServiceTime::LogNormal { median, sigma } => {
                write!(f, "lognormal median={} sigma={sigma:.3}", format_duration(median))
            }
            ServiceTime::Tailed { median, sigma, tail, tail_median } => write!(
                f,
                "lognormal median={} sigma={sigma:.3} tail={tail} tail_median={}",
                format_duration(median),
                format_duration(tail_median)
            ),
        }
    }
}

/// A duration as whole nanoseconds, saturating.
#[inline]
pub(crate) fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// An exponential draw with mean `mean_nanos`.
#[inline]
pub(crate) fn exponential(rng: &mut SplitMix64, mean_nanos: f64) -> f64 {
    dist::exponential(mean_nanos, dist::unit(rng))
}

/// Mixes two words into a seed (one SplitMix64 step over their combination), so streams
/// derived from one scenario seed for different purposes or keys do not overlap.
#[inline]
pub(crate) fn mix(a: u64, b: u64) -> u64 {
    SplitMix64::new(a ^ b.wrapping_mul(0xd1b5_4a32_d192_ed03)).next_u64()
}

/// What a derived stream is for: each purpose gets its own, so adding a draw to one purpose
/// never shifts another's.
#[derive(Debug, Clone, Copy)]
#[repr(u64)]
pub(crate) enum Stream {
    Arrivals = 1,
    Attempts = 2,
    Jitter = 3,
}

/// The seed of a purpose's stream.
pub(crate) fn stream_seed(seed: u64, stream: Stream) -> u64 {
    mix(seed, stream as u64)
}

/// An error-rate fraction as a threshold on a uniform `u64` draw: an attempt fails when its
/// draw is below it.
pub(crate) fn threshold(rate: f64) -> u64 {
    if rate <= 0.0 {
        0
    } else if rate >= 1.0 {
        u64::MAX
    } else {
        (rate * 18_446_744_073_709_551_616.0) as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_form() {
        let ms = Duration::from_millis;
        assert_eq!(ServiceTime::parse("50ms").unwrap(), ServiceTime::Fixed(ms(50)));
        assert_eq!(ServiceTime::parse("fixed 50ms").unwrap(), ServiceTime::Fixed(ms(50)));
        assert_eq!(
            ServiceTime::parse("exponential 20ms").unwrap(),
            ServiceTime::Exponential(ms(20))
        );
        assert_eq!(
            ServiceTime::parse("lognormal median=20ms sigma=0.5").unwrap(),
            ServiceTime::LogNormal { median: ms(20), sigma: 0.5 }
        );
        let ServiceTime::LogNormal { median, sigma } =
            ServiceTime::parse("p50=20ms p99=100ms").unwrap()
        else {
            panic!()
        };
        assert_eq!(median, ms(20));
        assert!((sigma - 5f64.ln() / Z_P99).abs() < 1e-12);
        let uniform = ServiceTime::parse("uniform min=80ms max=120ms").unwrap();
        assert_eq!(uniform, ServiceTime::Uniform { min: ms(80), max: ms(120) });
        assert_eq!(ServiceTime::parse(&uniform.to_string()).unwrap(), uniform);
        assert_eq!(uniform.mean(), ms(100));
        for bad in ["uniform min=80ms", "uniform min=2ms max=1ms", "uniform min=1ms mid=2ms"] {
            assert_eq!(ServiceTime::parse(bad), Err(ServiceTimeError::Uniform), "{bad}");
        }
        let mut rng = SplitMix64::new(5);
        let draws: Vec<u64> = (0..10_000).map(|_| uniform.sample(&mut rng)).collect();
        assert!(draws.iter().all(|d| (80_000_000..=120_000_000).contains(d)));
        let mean = draws.iter().sum::<u64>() as f64 / 1e4 / 1e6;
        assert!((mean - 100.0).abs() < 0.5, "{mean}");
        for bad in ["", "fast", "exponential", "exponential 0ms", "p50=20ms", "p50=1s p99=1ms"] {
            assert!(ServiceTime::parse(bad).is_err(), "{bad}");
        }
        assert_eq!(ServiceTime::parse("exponential 0ms"), Err(ServiceTimeError::ZeroMean));
        assert_eq!(ServiceTime::parse("p50=20ms"), Err(ServiceTimeError::OnePercentile));
        assert!(matches!(
            ServiceTime::parse("p50=1s p99=1ms"),
            Err(ServiceTimeError::Percentiles { .. })
        ));
        assert_eq!(
            ServiceTime::parse("p50=1s p99=1ms").unwrap_err().to_string(),
            "p99 (1ms) must be at least p50 (1s), and p50 above zero"
        );
    }

    #[test]
    fn percentiles_come_out_of_the_draws() {
        let st = ServiceTime::parse("p50=20ms p99=100ms").unwrap();
        let mut rng = SplitMix64::new(9);
        let mut v: Vec<u64> = (0..200_000).map(|_| st.sample(&mut rng)).collect();
        v.sort_unstable();
        let p = |q: f64| v[(q * v.len() as f64) as usize] as f64 / 1e6;
        assert!((p(0.5) - 20.0).abs() < 0.4, "{}", p(0.5));
        assert!((p(0.99) - 100.0).abs() < 3.0, "{}", p(0.99));
        let exp = ServiceTime::Exponential(Duration::from_millis(10));
        let mean = (0..100_000).map(|_| exp.sample(&mut rng)).sum::<u64>() as f64 / 1e11;
        assert!((mean - 10.0).abs() < 0.2, "{mean}");
    }

    #[test]
    fn a_slow_tail_takes_its_share_of_the_draws() {
        let st = ServiceTime::parse("lognormal median=20ms sigma=0.2 tail=0.05 tail_median=400ms")
            .unwrap();
        let ms = Duration::from_millis;
        assert_eq!(
            st,
            ServiceTime::Tailed { median: ms(20), sigma: 0.2, tail: 0.05, tail_median: ms(400) }
        );
        assert_eq!(ServiceTime::parse(&st.to_string()).unwrap(), st, "{st}");
        let mut rng = SplitMix64::new(3);
        let n = 100_000;
        let slow = (0..n).filter(|_| st.sample(&mut rng) > 150_000_000).count();
        assert!((slow as f64 / n as f64 - 0.05).abs() < 0.003, "{slow}");
        for bad in [
            "lognormal median=20ms sigma=0.2 tail=0.05",
            "lognormal median=20ms sigma=0.2 tail=1 tail_median=1s",
            "lognormal median=20ms sigma=0.2 tail=x tail_median=1s",
        ] {
            assert_eq!(ServiceTime::parse(bad), Err(ServiceTimeError::Tail), "{bad}");
        }
    }

    #[test]
    fn thresholds() {
        assert_eq!(threshold(0.0), 0);
        assert_eq!(threshold(1.0), u64::MAX);
        assert_eq!(threshold(0.5), 1 << 63);
    }
}
