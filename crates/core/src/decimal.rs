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

/// The digits of a decimal number as written, before any arithmetic: the one lexer behind every
/// number stormguard reads from text (config values, SPECs, durations, and stormguard-http's
/// header values). Each reader then says which shapes it accepts ([`has_digits`] for config
/// values, [`is_strict`] for HTTP's) and how many fraction digits it keeps.
///
/// ```
/// use stormguard_core::decimal::Digits;
///
/// let (digits, rest) = Digits::lex(b"1.25s");
/// assert_eq!((digits.int, digits.frac, rest), (&b"1"[..], Some(&b"25"[..]), &b"s"[..]));
/// assert_eq!(digits.value().unwrap().floor_mul(1_000), 1_250);
/// assert!(Digits::lex(b".5").0.has_digits() && !Digits::lex(b".5").0.is_strict());
/// ```
///
/// [`has_digits`]: Digits::has_digits
/// [`is_strict`]: Digits::is_strict
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Digits<'a> {
    /// The ASCII digits before the point; empty in `.5`.
    pub int: &'a [u8],
    /// The ASCII digits after the point when there is one: `Some(b"")` in `2.`, `None` in `2`.
    pub frac: Option<&'a [u8]>,
}

impl<'a> Digits<'a> {
    /// Splits `text` into its longest prefix of the form `*DIGIT [ "." *DIGIT ]` and the rest.
    /// Never fails: a text that does not start with a number gives no digits and all of `text`.
    pub fn lex(text: &'a [u8]) -> (Digits<'a>, &'a [u8]) {
        let digits_in = |t: &[u8]| t.iter().take_while(|b| b.is_ascii_digit()).count();
        let (int, rest) = text.split_at(digits_in(text));
        match rest.split_first() {
            Some((b'.', after)) => {
                let (frac, rest) = after.split_at(digits_in(after));
                (Digits { int, frac: Some(frac) }, rest)
            }
            _ => (Digits { int, frac: None }, rest),
        }
    }

    /// At least one digit, on either side of the point: `3`, `.5` and `2.` have one, `.` none.
    pub fn has_digits(&self) -> bool {
        !self.int.is_empty() || self.frac.is_some_and(|f| !f.is_empty())
    }

    /// `1*DIGIT [ "." 1*DIGIT ]`: digits before the point, and after it if there is one (HTTP's
    /// numbers: `.5` and `2.` are not).
    pub fn is_strict(&self) -> bool {
        !self.int.is_empty() && self.frac.is_none_or(|f| !f.is_empty())
    }

    /// Whether a non-zero digit of the fraction comes after its first `places` (trailing zeros
    /// are not precision).
    pub fn exceeds(&self, places: usize) -> bool {
        self.frac
            .and_then(|f| f.get(places..))
            .is_some_and(|extra| extra.iter().any(|b| *b != b'0'))
    }

    /// The value, keeping the first [`Decimal::FRACTION_DIGITS`] digits of the fraction (later
    /// ones are dropped, rounding down); `None` when the integer part is above `u64::MAX`.
    pub fn value(&self) -> Option<Decimal> {
        let frac = self.frac.unwrap_or_default();
        let kept = &frac[..frac.len().min(Decimal::FRACTION_DIGITS as usize)];
        Some(Decimal {
            int: digits_to_u64(self.int)?,
            // At most 18 digits: fits in a u64.
            frac: digits_to_u64(kept)?,
            frac_digits: kept.len() as u32,
        })
    }
}

/// ASCII digits (already checked) as a `u64`, `None` if larger; `0` for none.
fn digits_to_u64(digits: &[u8]) -> Option<u64> {
    digits.iter().try_fold(0u64, |n, d| n.checked_mul(10)?.checked_add(u64::from(d - b'0')))
}

/// A non-negative decimal read by [`Digits::value`]: its integer part and the first
/// [`FRACTION_DIGITS`](Decimal::FRACTION_DIGITS) digits of its fraction, for exact integer
/// arithmetic (never `f64`) on a value of any size up to `u64::MAX`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Decimal {
    int: u64,
    /// The fraction's digits as an integer: `frac / 10^frac_digits`.
    frac: u64,
    frac_digits: u32,
}

impl Decimal {
    /// Fraction digits kept; later ones are dropped (rounding down).
    pub const FRACTION_DIGITS: u32 = 18;

    /// The integer part.
    pub fn int(self) -> u64 {
        self.int
    }

    /// `floor(self × unit)`, exact: at most `u64::MAX × unit + unit`, which fits in a `u128` for
    /// any `unit`.
    pub fn floor_mul(self, unit: u64) -> u128 {
        let unit = u128::from(unit);
        u128::from(self.int) * unit + u128::from(self.frac) * unit / 10u128.pow(self.frac_digits)
    }
}

/// Parses a non-negative decimal (`"3"`, `"0.25"`, `".5"`, `"2."`) into units of `10^-scale`.
pub fn parse_scaled(text: &str, scale: u32, excess: Excess) -> Result<u64, ParseError> {
    let (digits, rest) = Digits::lex(text.trim().as_bytes());
    if !rest.is_empty() || !digits.has_digits() {
        return Err(ParseError::NotDecimal(text.to_string()));
    }
    if excess == Excess::Refuse && digits.exceeds(scale as usize) {
        return Err(ParseError::TooPrecise { text: text.to_string(), max: scale });
    }
    let frac = digits.frac.unwrap_or_default();
    let kept = &frac[..frac.len().min(scale as usize)];
    let too_large = || ParseError::TooLarge(text.to_string());
    let unit = 10u64.checked_pow(scale).ok_or_else(too_large)?;
    let int_part = digits_to_u64(digits.int).ok_or_else(too_large)?;
    // Fewer than `scale` digits, and 10^scale fits: so does this.
    let frac_part =
        digits_to_u64(kept).ok_or_else(too_large)? * 10u64.pow(scale - kept.len() as u32);
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

/// Which duration grammar [`read_duration`] reads. Both share the number lexer ([`Digits`]) and
/// the units `ns`, `us` (or `µs`), `ms`, `s`, `m`, `h`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum DurationSyntax {
    /// stormguard's own, in configs, SPECs and flags ([`parse_duration`]): one non-negative
    /// number (`250`, `1.5`, `.5`, `2.`) and an optional unit, seconds when there is none;
    /// whitespace may separate them (`10 s`). At most 9 decimal places of the unit (more is
    /// [`DurationError::TooPrecise`]); the result is rounded down to whole nanoseconds.
    Stormguard,
    /// Go's `time.ParseDuration`, what servers written in Go send (`6m0s`, `1h2m3.5s`): an
    /// optional sign, then one or more number-unit pairs with no space, a unit required in each
    /// (`0` alone is the exception); `μs` (U+03BC) is accepted beside `µs` (U+00B5). A fraction
    /// may have any number of digits: past the 18th they are dropped. A negative non-zero value
    /// is [`DurationError::Negative`]; `-0` is zero.
    Go,
}

/// Why [`read_duration`] refused a text. Allocation-free and `Copy`, so a parser of network input
/// can count it; [`parse_duration`] turns it into a [`ParseError`] that quotes the text.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, thiserror::Error)]
#[non_exhaustive]
pub enum DurationError {
    /// Nothing to read.
    #[error("empty duration")]
    Empty,
    /// A negative duration (Go syntax only; stormguard's has no sign).
    #[error("negative duration")]
    Negative,
    /// More than 9 decimal places of the unit (stormguard syntax).
    #[error("more than 9 decimal places")]
    TooPrecise,
    /// More than `u64::MAX` nanoseconds (about 584 years).
    #[error("duration too large")]
    TooLarge,
    /// Not a duration in the syntax asked for.
    #[error("not a duration")]
    Malformed,
}

/// Nanoseconds per unit, as both syntaxes spell the units.
fn unit_nanos(unit: &[u8], syntax: DurationSyntax) -> Option<u64> {
    Some(match unit {
        b"ns" => 1,
        // `µs` as U+00B5 (what Go prints), in UTF-8.
        b"us" | b"\xc2\xb5s" => 1_000,
        // U+03BC, which Go also reads.
        b"\xce\xbcs" if syntax == DurationSyntax::Go => 1_000,
        b"ms" => 1_000_000,
        b"s" => 1_000_000_000,
        b"m" => 60_000_000_000,
        b"h" => 3_600_000_000_000,
        _ => return None,
    })
}

/// Reads a duration in the given [`DurationSyntax`]; the text is taken as it is (callers trim
/// it). The one duration grammar of the project: [`parse_duration`] reads stormguard's syntax
/// with it, and stormguard-http reads Go-style reset headers with it.
///
/// ```
/// use std::time::Duration;
/// use stormguard_core::decimal::{DurationError, DurationSyntax, read_duration};
///
/// let go = |t: &str| read_duration(t.as_bytes(), DurationSyntax::Go);
/// let ours = |t: &str| read_duration(t.as_bytes(), DurationSyntax::Stormguard);
/// assert_eq!(go("1h2m3.5s"), Ok(Duration::from_millis(3_723_500)));
/// assert_eq!(ours("1.5"), Ok(Duration::from_millis(1_500))); // seconds
/// assert_eq!(go("1.5"), Err(DurationError::Malformed)); // Go needs a unit
/// assert_eq!(ours("1h2m"), Err(DurationError::Malformed)); // one number and unit
/// assert_eq!(go("-1s"), Err(DurationError::Negative));
/// ```
pub fn read_duration(text: &[u8], syntax: DurationSyntax) -> Result<Duration, DurationError> {
    if text.is_empty() {
        return Err(DurationError::Empty);
    }
    let nanos = match syntax {
        DurationSyntax::Stormguard => {
            let (digits, rest) = Digits::lex(text);
            let unit = std::str::from_utf8(rest).map_err(|_| DurationError::Malformed)?.trim();
            let per_unit = if unit.is_empty() {
                1_000_000_000
            } else {
                unit_nanos(unit.as_bytes(), syntax).ok_or(DurationError::Malformed)?
            };
            if !digits.has_digits() {
                return Err(DurationError::Malformed);
            }
            if digits.exceeds(9) {
                return Err(DurationError::TooPrecise);
            }
            digits.value().ok_or(DurationError::TooLarge)?.floor_mul(per_unit)
        }
        DurationSyntax::Go => {
            let (negative, mut rest) = match text.split_first() {
                Some((b'-', rest)) => (true, rest),
                Some((b'+', rest)) => (false, rest),
                _ => (false, text),
            };
            if rest == b"0" {
                return Ok(Duration::ZERO);
            }
            if rest.is_empty() {
                return Err(DurationError::Malformed);
            }
            let mut total: u128 = 0;
            while !rest.is_empty() {
                let (digits, after) = Digits::lex(rest);
                if !digits.has_digits() {
                    return Err(DurationError::Malformed);
                }
                let unit_len =
                    after.iter().take_while(|b| !(b.is_ascii_digit() || **b == b'.')).count();
                let (unit, after) = after.split_at(unit_len);
                rest = after;
                let per_unit = unit_nanos(unit, syntax).ok_or(DurationError::Malformed)?;
                let value = digits.value().ok_or(DurationError::TooLarge)?;
                total = total.saturating_add(value.floor_mul(per_unit));
                if total > u128::from(u64::MAX) {
                    return Err(DurationError::TooLarge);
                }
            }
            if negative && total > 0 {
                return Err(DurationError::Negative);
            }
            total
        }
    };
    u64::try_from(nanos).map(Duration::from_nanos).map_err(|_| DurationError::TooLarge)
}

/// Parses a duration in stormguard's syntax ([`DurationSyntax::Stormguard`]): an integer or
/// decimal followed by `ns`, `us`, `ms`, `s`, `m` or `h` (`250ms`, `1.5s`, `2m`). A bare number
/// is seconds. Whitespace around the text is ignored.
///
/// ```
/// use std::time::Duration;
/// use stormguard_core::decimal::parse_duration;
/// assert_eq!(parse_duration("250ms").unwrap(), Duration::from_millis(250));
/// assert_eq!(parse_duration("1.5s").unwrap(), Duration::from_millis(1500));
/// assert!(parse_duration("fast").is_err());
/// ```
pub fn parse_duration(text: &str) -> Result<Duration, ParseError> {
    read_duration(text.trim().as_bytes(), DurationSyntax::Stormguard).map_err(|e| match e {
        DurationError::TooLarge => ParseError::TooLarge(text.to_string()),
        DurationError::TooPrecise => ParseError::TooPrecise { text: text.to_string(), max: 9 },
        _ => ParseError::NotDuration(text.to_string()),
    })
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

    #[test]
    fn stormguard_duration_syntax() {
        let p = |t: &str| parse_duration(t);
        assert_eq!(p(" 10 s "), Ok(Duration::from_secs(10)));
        assert_eq!(p(".5s"), Ok(Duration::from_millis(500)));
        assert_eq!(p("2.m"), Ok(Duration::from_secs(120)));
        assert_eq!(p("1.5ns"), Ok(Duration::from_nanos(1))); // rounded down
        assert_eq!(p("1µs"), Ok(Duration::from_micros(1)));
        assert_eq!(p("0.1000000000s"), Ok(Duration::from_millis(100))); // zeros are not precision
        // The limit is the total, not the number: 2 × 10^10 ns is 20 s.
        assert_eq!(p("20000000000ns"), Ok(Duration::from_secs(20)));
        assert_eq!(p("18446744073709551615ns"), Ok(Duration::from_nanos(u64::MAX)));
        assert!(matches!(p("18446744073709551616ns"), Err(ParseError::TooLarge(_))));
        assert!(matches!(p("20000000000s"), Err(ParseError::TooLarge(_))));
        assert!(matches!(p("0.0000000001s"), Err(ParseError::TooPrecise { max: 9, .. })));
        for bad in ["", "s", ".", ".s", "1h2m", "1μs", "+1s", "1.2.3s", "1e3", "1 h m", "1S"] {
            assert!(matches!(p(bad), Err(ParseError::NotDuration(_))), "{bad:?}");
        }
    }

    #[test]
    fn go_duration_syntax() {
        let go = |t: &str| read_duration(t.as_bytes(), DurationSyntax::Go);
        assert_eq!(go("6m0s"), Ok(Duration::from_secs(360)));
        assert_eq!(go("1μs1µs1us"), Ok(Duration::from_micros(3)));
        assert_eq!(go("-0"), Ok(Duration::ZERO));
        assert_eq!(go("1.0000000009s"), Ok(Duration::from_secs(1))); // digits past 9 kept, floored
        assert_eq!(go(""), Err(DurationError::Empty));
        assert_eq!(go("-1s"), Err(DurationError::Negative));
        assert_eq!(go("18446744073709551615ns1ns"), Err(DurationError::TooLarge));
        for bad in ["6", "1 s", "s", ".s", "+", "1h-1m", "0s0"] {
            assert_eq!(go(bad), Err(DurationError::Malformed), "{bad:?}");
        }
    }

    #[test]
    fn one_lexer_two_shapes() {
        let lex = |t: &'static str| Digits::lex(t.as_bytes());
        assert_eq!(lex("12.5x").1, b"x");
        assert_eq!(lex("1.2.3").1, b".3");
        assert!(lex("2.").0.has_digits() && !lex("2.").0.is_strict());
        assert!(!lex(".").0.has_digits());
        assert!(lex("7").0.is_strict() && lex("7.25").0.is_strict());
        assert!(lex("0.1000").0.exceeds(0) && !lex("0.1000").0.exceeds(1));
        assert_eq!(lex("18446744073709551616").0.value(), None);
        let many = lex("0.1234567890123456789").0.value().unwrap();
        // 18 digits kept: 10^18 × 0.123456789012345678.
        assert_eq!(many.floor_mul(1_000_000_000_000_000_000), 123_456_789_012_345_678);
        let max = lex("18446744073709551615.999").0.value().unwrap();
        assert_eq!(
            max.floor_mul(u64::MAX),
            u128::from(u64::MAX) * u128::from(u64::MAX) + u128::from(u64::MAX) * 999 / 1000
        );
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
            let _ = read_duration(s.as_bytes(), DurationSyntax::Go);
        }
    }
}
