//! Exact decimal parameters.
//!
//! A budget's `percent` must not pass through `f64`: `0.29` is not representable, and a policy
//! that computes `1 / percent` in floating point grants one retry too few or too many over a long
//! run. Parameters are parsed from their decimal text straight into integers of a fixed scale
//! (millionths for fractions, thousandths for tokens), and all budget arithmetic stays integer.
//!
//! ```
//! use stormguard_core::decimal::Fraction;
//!
//! let p: Fraction = "0.29".parse().unwrap();
//! assert_eq!(p.millionths(), 290_000);
//! assert_eq!(p.floor_mul(10_000), 2_900); // exactly floor(10 000 × 0.29)
//! assert!("0.1234567".parse::<Fraction>().is_err()); // more than 6 decimals is refused
//! ```

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

/// Why a decimal or duration could not be parsed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ParseError {
    /// Not a plain non-negative decimal such as `0.25` or `3`.
    #[error("`{0}` is not a non-negative decimal number (e.g. 0.25)")]
    NotDecimal(String),
    /// More fractional digits than the parameter keeps.
    #[error("`{text}` has more than {max} decimal places")]
    TooPrecise {
        /// The text as given.
        text: String,
        /// The number of decimal places kept.
        max: u32,
    },
    /// Too large to represent.
    #[error("`{0}` is too large")]
    TooLarge(String),
    /// Not a duration such as `250ms`, `10s`, `2m` or `1h`.
    #[error("`{0}` is not a duration (e.g. 250ms, 10s, 2m)")]
    NotDuration(String),
}

/// What to do with digits beyond the kept scale.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Excess {
    /// Refuse the value.
    Refuse,
    /// Drop the extra digits (round toward zero).
    Truncate,
}

/// Parses a non-negative decimal (`"3"`, `"0.25"`, `".5"`, `"2."`) into units of `10^-scale`.
pub fn parse_scaled(text: &str, scale: u32, excess: Excess) -> Result<u64, ParseError> {
    let t = text.trim();
    let (int, frac) = match t.split_once('.') {
        Some((i, f)) => (i, f),
        None => (t, ""),
    };
    let digits = |s: &str| s.bytes().all(|b| b.is_ascii_digit());
    if (int.is_empty() && frac.is_empty()) || !digits(int) || !digits(frac) {
        return Err(ParseError::NotDecimal(text.to_string()));
    }
    let kept = if frac.len() as u64 > u64::from(scale) {
        let (kept, extra) = frac.split_at(scale as usize);
        if excess == Excess::Refuse && extra.bytes().any(|b| b != b'0') {
            return Err(ParseError::TooPrecise { text: text.to_string(), max: scale });
        }
        kept
    } else {
        frac
    };
    let too_large = || ParseError::TooLarge(text.to_string());
    let unit = 10u64.checked_pow(scale).ok_or_else(too_large)?;
    let int_part: u64 = if int.is_empty() { 0 } else { int.parse().map_err(|_| too_large())? };
    let mut frac_part: u64 =
        if kept.is_empty() { 0 } else { kept.parse().map_err(|_| too_large())? };
    for _ in kept.len()..scale as usize {
        frac_part *= 10;
    }
    int_part.checked_mul(unit).and_then(|v| v.checked_add(frac_part)).ok_or_else(too_large)
}

/// Formats `value` units of `10^-scale` as the shortest exact decimal text.
pub fn format_scaled(value: u64, scale: u32) -> String {
    let unit = 10u64.pow(scale);
    let (int, frac) = (value / unit, value % unit);
    if frac == 0 {
        return int.to_string();
    }
    let mut f = format!("{frac:0width$}", width = scale as usize);
    while f.ends_with('0') {
        f.pop();
    }
    format!("{int}.{f}")
}

/// A non-negative fraction held exactly as integer millionths (`0.25` is 250 000).
///
/// Parsed from decimal text with at most 6 decimal places; never converted through `f64` for
/// arithmetic. Displayed as its shortest exact decimal.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Fraction(u64);

impl Fraction {
    /// Millionths in one whole.
    pub const ONE_MILLIONTHS: u64 = 1_000_000;
    /// Zero.
    pub const ZERO: Fraction = Fraction(0);
    /// One whole (100 %).
    pub const ONE: Fraction = Fraction(Self::ONE_MILLIONTHS);

    /// The fraction `millionths / 1 000 000`.
    pub const fn from_millionths(millionths: u64) -> Fraction {
        Fraction(millionths)
    }

    /// The fraction in millionths.
    pub const fn millionths(self) -> u64 {
        self.0
    }

    /// `floor(n × self)`, exact, saturating at `u64::MAX`.
    pub fn floor_mul(self, n: u64) -> u64 {
        let v = u128::from(n) * u128::from(self.0) / u128::from(Self::ONE_MILLIONTHS);
        u64::try_from(v).unwrap_or(u64::MAX)
    }

    /// The nearest `f64`, for display and metrics only.
    pub fn as_f64(self) -> f64 {
        self.0 as f64 / Self::ONE_MILLIONTHS as f64
    }
}

impl FromStr for Fraction {
    type Err = ParseError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        parse_scaled(s, 6, Excess::Refuse).map(Fraction)
    }
}

impl fmt::Display for Fraction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&format_scaled(self.0, 6))
    }
}

impl fmt::Debug for Fraction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Fraction({self})")
    }
}

/// Parses a duration: an integer or decimal followed by `ns`, `us`, `ms`, `s`, `m` or `h`
/// (`250ms`, `1.5s`, `2m`). A bare number is seconds.
///
/// ```
/// use std::time::Duration;
/// use stormguard_core::decimal::parse_duration;
/// assert_eq!(parse_duration("250ms").unwrap(), Duration::from_millis(250));
/// assert_eq!(parse_duration("1.5s").unwrap(), Duration::from_millis(1500));
/// assert!(parse_duration("fast").is_err());
/// ```
pub fn parse_duration(text: &str) -> Result<Duration, ParseError> {
    let t = text.trim();
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let nanos_per_unit: u64 = match unit.trim() {
        "ns" => 1,
        "us" | "µs" => 1_000,
        "ms" => 1_000_000,
        "" | "s" => 1_000_000_000,
        "m" => 60_000_000_000,
        "h" => 3_600_000_000_000,
        _ => return Err(ParseError::NotDuration(text.to_string())),
    };
    // Nanosecond precision: nine decimals of a second are kept, more are refused.
    let scaled = parse_scaled(num, 9, Excess::Refuse)
        .map_err(|_| ParseError::NotDuration(text.to_string()))?;
    let nanos = u128::from(scaled) * u128::from(nanos_per_unit) / 1_000_000_000;
    u64::try_from(nanos)
        .map(Duration::from_nanos)
        .map_err(|_| ParseError::TooLarge(text.to_string()))
}

/// Formats a duration the way [`parse_duration`] reads it (`250ms`, `10s`, `1500us`).
pub fn format_duration(d: Duration) -> String {
    let n = d.as_nanos();
    if n == 0 {
        "0s".to_string()
    } else if n.is_multiple_of(1_000_000_000) {
        format!("{}s", n / 1_000_000_000)
    } else if n.is_multiple_of(1_000_000) {
        format!("{}ms", n / 1_000_000)
    } else if n.is_multiple_of(1_000) {
        format!("{}us", n / 1_000)
    } else {
        format!("{n}ns")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn fractions() {
        let p = |s: &str| s.parse::<Fraction>().map(Fraction::millionths);
        assert_eq!(p("0.2"), Ok(200_000));
        assert_eq!(p("0.29"), Ok(290_000));
        assert_eq!(p("0.9999"), Ok(999_900));
        assert_eq!(p("2"), Ok(2_000_000));
        assert_eq!(p(".5"), Ok(500_000));
        assert_eq!(p("0.1000000"), Ok(100_000)); // trailing zeros are not precision
        assert!(matches!(p("0.1234567"), Err(ParseError::TooPrecise { .. })));
        for bad in ["", ".", "-0.1", "1e-3", "0,2", "abc", "1.2.3", "+1"] {
            assert!(matches!(p(bad), Err(ParseError::NotDecimal(_))), "{bad}");
        }
        assert!(matches!(p("99999999999999999999"), Err(ParseError::TooLarge(_))));
    }

    #[test]
    fn truncation_keeps_scale() {
        assert_eq!(parse_scaled("0.12345", 3, Excess::Truncate), Ok(123));
        assert!(parse_scaled("0.12345", 3, Excess::Refuse).is_err());
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("10s"), Ok(Duration::from_secs(10)));
        assert_eq!(parse_duration("10"), Ok(Duration::from_secs(10)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_duration("25us"), Ok(Duration::from_micros(25)));
        assert!(parse_duration("10 parsecs").is_err());
        assert!(parse_duration("ms").is_err());
        assert!(parse_duration("-1s").is_err());
        assert_eq!(format_duration(Duration::from_millis(250)), "250ms");
        assert_eq!(format_duration(Duration::from_secs(10)), "10s");
    }

    proptest! {
        #[test]
        fn fraction_text_round_trips(m in 0u64..=1_000_000_000) {
            let f = Fraction::from_millionths(m);
            prop_assert_eq!(f.to_string().parse::<Fraction>(), Ok(f));
        }

        #[test]
        fn floor_mul_is_exact(m in 0u64..=1_000_000_000, n in 0u64..1_000_000) {
            let f = Fraction::from_millionths(m);
            // floor(n × m / 10^6) without u128: n × m fits in u64 for these ranges
            prop_assert_eq!(f.floor_mul(n), n * m / 1_000_000);
        }

        #[test]
        fn arbitrary_text_never_panics(s in ".{0,24}") {
            let _ = s.parse::<Fraction>();
            let _ = parse_duration(&s);
        }
    }
}
