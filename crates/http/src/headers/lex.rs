//! Lexing shared by the parsers: header names and patterns, optional whitespace, decimals and durations in integer nanoseconds (never `f64`).

use super::*;

/// A configured header name: exact, or with one `*` matching one or more characters.
#[derive(Debug, Clone)]
pub(super) enum NamePattern {
    Exact(HeaderName),
    Glob { prefix: String, suffix: String },
}

impl NamePattern {
    pub(super) fn parse(name: &str) -> Result<NamePattern, HeaderConfigError> {
        let bad = || HeaderConfigError::BadPattern(name.to_string());
        let Some((prefix, suffix)) = name.split_once('*') else {
            return header_name(name).map(NamePattern::Exact);
        };
        if suffix.contains('*') || (prefix.is_empty() && suffix.is_empty()) {
            return Err(bad());
        }
        // Each side must be a run of header-name characters on its own.
        for side in [prefix, suffix] {
            if !side.is_empty() && HeaderName::from_bytes(side.as_bytes()).is_err() {
                return Err(bad());
            }
        }
        Ok(NamePattern::Glob {
            prefix: prefix.to_ascii_lowercase(),
            suffix: suffix.to_ascii_lowercase(),
        })
    }

    pub(super) fn matches(&self, name: &HeaderName) -> bool {
        match self {
            NamePattern::Exact(exact) => exact == name,
            NamePattern::Glob { prefix, suffix } => {
                let name = name.as_str();
                name.len() > prefix.len() + suffix.len()
                    && name.starts_with(prefix.as_str())
                    && name.ends_with(suffix.as_str())
            }
        }
    }
}

pub(super) fn header_name(name: &str) -> Result<HeaderName, HeaderConfigError> {
    // `from_bytes` lowercases, so configured names are case-insensitive.
    HeaderName::from_bytes(name.trim().as_bytes())
        .map_err(|_| HeaderConfigError::BadName(name.to_string()))
}

pub(super) fn header_names(names: &[String]) -> Result<Vec<HeaderName>, HeaderConfigError> {
    names.iter().map(|n| header_name(n)).collect()
}

pub(super) fn reset_patterns(
    resets: &[ResetHeader],
) -> Result<Vec<(NamePattern, ResetFormat)>, HeaderConfigError> {
    resets.iter().map(|r| Ok((NamePattern::parse(r.name.trim())?, r.format))).collect()
}

pub(super) fn check_max_plausible(max: Duration) -> Result<(), HeaderConfigError> {
    if max < Duration::from_secs(1) || max > LONGEST_MAX_PLAUSIBLE {
        return Err(HeaderConfigError::MaxPlausible(max));
    }
    Ok(())
}

/// Each header in `headers` that a reset rule matches, with the format of the first rule that
/// matches it.
pub(super) fn matched_resets<'h>(
    rules: &'h [(NamePattern, ResetFormat)],
    headers: &'h HeaderMap,
) -> impl Iterator<Item = (&'h HeaderName, ResetFormat)> + 'h {
    headers.keys().filter_map(move |name| {
        rules.iter().find(|(pattern, _)| pattern.matches(name)).map(|(_, format)| (name, *format))
    })
}

/// The smallest readable value of the remaining counter paired with the reset header
/// `reset_name`, if any. Unreadable values are left to [`LimitHeaders`] to count.
pub(super) fn remaining_of(headers: &HeaderMap, reset_name: &str) -> Option<u64> {
    let at = reset_name.rfind("reset")?;
    let name = format!("{}remaining{}", &reset_name[..at], &reset_name[at + "reset".len()..]);
    headers.get_all(name.as_str()).iter().filter_map(|v| parse_count(v.as_bytes()).ok()).min()
}

/// Optional whitespace (SP / HTAB, RFC 9110 §5.6.3) removed from both ends.
pub(super) fn trim_ows(value: &[u8]) -> &[u8] {
    let is_ows = |b: &u8| *b == b' ' || *b == b'\t';
    let start = value.iter().position(|b| !is_ows(b)).unwrap_or(value.len());
    let end = value.iter().rposition(|b| !is_ows(b)).map_or(start, |i| i + 1);
    &value[start..end]
}

/// A non-negative decimal: `int` and the first [`FRACTION_DIGITS`] digits of its fraction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Decimal {
    pub(super) int: u64,
    /// The fraction's digits as an integer: `frac / 10^frac_digits`.
    pub(super) frac: u64,
    pub(super) frac_digits: u32,
}

impl Decimal {
    /// The fraction `.digits` alone (digits already checked to be ASCII digits).
    pub(super) fn fraction(digits: &[u8]) -> Decimal {
        let kept = &digits[..digits.len().min(FRACTION_DIGITS as usize)];
        Decimal {
            int: 0,
            // At most 18 digits: fits in a u64.
            frac: digits_to_u64(kept).unwrap_or(0),
            frac_digits: kept.len() as u32,
        }
    }

    /// The value times `unit`, rounded down. At most `u64::MAX × unit × 2`: fits in a `u128`.
    pub(super) fn nanos(&self, unit: u64) -> u128 {
        let unit = u128::from(unit);
        u128::from(self.int) * unit + u128::from(self.frac) * unit / 10u128.pow(self.frac_digits)
    }
}

/// `1*DIGIT [ "." 1*DIGIT ]` (the fraction only if `fraction`), after trimming whitespace; a
/// leading `-` on an otherwise valid number is [`Malformed::Negative`].
pub(super) fn parse_number(value: &[u8], fraction: bool) -> Result<Decimal, Malformed> {
    let text = trim_ows(value);
    if text.is_empty() {
        return Err(Malformed::Empty);
    }
    if let Some(rest) = text.strip_prefix(b"-") {
        return match unsigned_decimal(rest, fraction) {
            Ok(_) | Err(Malformed::Overflow) => Err(Malformed::Negative),
            Err(_) => Err(Malformed::NotANumber),
        };
    }
    unsigned_decimal(text, fraction)
}

pub(super) fn unsigned_decimal(text: &[u8], fraction: bool) -> Result<Decimal, Malformed> {
    let (int_digits, frac_digits) = match text.iter().position(|b| *b == b'.') {
        Some(point) if fraction => (&text[..point], Some(&text[point + 1..])),
        _ => (text, None),
    };
    let all_digits = |d: &[u8]| !d.is_empty() && d.iter().all(u8::is_ascii_digit);
    if !all_digits(int_digits) || frac_digits.is_some_and(|f| !all_digits(f)) {
        return Err(Malformed::NotANumber);
    }
    Ok(Decimal {
        int: digits_to_u64(int_digits).ok_or(Malformed::Overflow)?,
        ..Decimal::fraction(frac_digits.unwrap_or(&[]))
    })
}

/// ASCII digits (already checked) as a `u64`, `None` if larger.
pub(super) fn digits_to_u64(digits: &[u8]) -> Option<u64> {
    digits.iter().try_fold(0u64, |n, d| n.checked_mul(10)?.checked_add(u64::from(d - b'0')))
}

pub(super) fn nanos_to_duration(nanos: u128) -> Duration {
    let secs = u64::try_from(nanos / u128::from(NANOS_PER_SEC)).unwrap_or(u64::MAX);
    // The remainder is below 10^9: it fits in a u32.
    Duration::new(secs, (nanos % u128::from(NANOS_PER_SEC)) as u32)
}

pub(super) fn to_i128(nanos: u128) -> i128 {
    // Every caller's value is at most about 2 × 10^28: far inside i128.
    i128::try_from(nanos).unwrap_or(i128::MAX)
}

/// A wait of `nanos`, unless it is further away than `max`.
pub(super) fn plausible(nanos: u128, max: Duration) -> Result<Duration, Malformed> {
    if nanos > max.as_nanos() { Err(Malformed::TooFar) } else { Ok(nanos_to_duration(nanos)) }
}

/// The wait from `now_wall` until `target` (nanoseconds since the unix epoch, negative before
/// it): zero if it has passed.
pub(super) fn until(
    target: i128,
    now_wall: SystemTime,
    max: Duration,
) -> Result<Duration, Malformed> {
    let wait = target.saturating_sub(unix_nanos(now_wall));
    plausible(u128::try_from(wait).unwrap_or(0), max)
}

pub(super) fn unix_nanos(t: SystemTime) -> i128 {
    match t.duration_since(UNIX_EPOCH) {
        Ok(after) => to_i128(after.as_nanos()),
        Err(before) => -to_i128(before.duration().as_nanos()),
    }
}
