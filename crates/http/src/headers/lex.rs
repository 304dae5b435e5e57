//! Lexing shared by the parsers: header names and patterns, optional whitespace, and HTTP's
//! strict decimals (over core's [`Digits`] lexer) in integer nanoseconds (never `f64`).

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

/// `1*DIGIT [ "." 1*DIGIT ]` (the fraction only if `fraction`), after trimming whitespace; a
/// leading `-` on an otherwise valid number is [`Malformed::Negative`]. Lexed by core's
/// [`Digits`]; fraction digits past the 18th are dropped.
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

fn unsigned_decimal(text: &[u8], fraction: bool) -> Result<Decimal, Malformed> {
    let (digits, rest) = Digits::lex(text);
    if !rest.is_empty() || !digits.is_strict() || (!fraction && digits.frac.is_some()) {
        return Err(Malformed::NotANumber);
    }
    digits.value().ok_or(Malformed::Overflow)
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
