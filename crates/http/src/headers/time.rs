//! Wall-clock dates — HTTP-dates and RFC 3339 date-times — as unix nanoseconds.

use super::*;

pub(super) fn http_date_nanos(text: &[u8]) -> Result<i128, Malformed> {
    let text = std::str::from_utf8(text).map_err(|_| Malformed::BadHttpDate)?;
    let date = httpdate::parse_http_date(text).map_err(|_| Malformed::BadHttpDate)?;
    Ok(unix_nanos(date))
}

/// An RFC 3339 date-time as nanoseconds since the unix epoch (negative before it).
pub(super) fn rfc3339_unix_nanos(value: &[u8]) -> Result<i128, Malformed> {
    let text = trim_ows(value);
    if text.is_empty() {
        return Err(Malformed::Empty);
    }
    let bad = Malformed::BadRfc3339;
    // `YYYY-MM-DDTHH:MM:SS`, then an optional fraction and the offset.
    let Some((fixed, rest)) = text.split_at_checked(19) else { return Err(bad) };
    let field = |range: std::ops::Range<usize>| {
        let digits = &fixed[range];
        if digits.iter().all(u8::is_ascii_digit) {
            Digits { int: digits, frac: None }.value().map(Decimal::int).ok_or(bad)
        } else {
            Err(bad)
        }
    };
    let separators_ok = fixed[4] == b'-'
        && fixed[7] == b'-'
        && matches!(fixed[10], b'T' | b't' | b' ')
        && fixed[13] == b':'
        && fixed[16] == b':';
    if !separators_ok {
        return Err(bad);
    }
    let (year, month, day) = (field(0..4)?, field(5..7)?, field(8..10)?);
    let (hour, minute, second) = (field(11..13)?, field(14..16)?, field(17..19)?);
    let (frac, rest) = match rest.split_first() {
        Some((b'.', after)) => {
            let len = after.iter().take_while(|b| b.is_ascii_digit()).count();
            if len == 0 {
                return Err(bad);
            }
            let (digits, rest) = after.split_at(len);
            let fraction = Digits { int: b"", frac: Some(digits) }.value().ok_or(bad)?;
            (fraction.floor_mul(NANOS_PER_SEC), rest)
        }
        _ => (0, rest),
    };
    let offset_secs: i64 = match rest {
        b"Z" | b"z" => 0,
        [sign @ (b'+' | b'-'), h1, h2, b':', m1, m2] => {
            let two = |a: u8, b: u8| {
                if a.is_ascii_digit() && b.is_ascii_digit() {
                    Ok(i64::from(a - b'0') * 10 + i64::from(b - b'0'))
                } else {
                    Err(bad)
                }
            };
            let (hours, minutes) = (two(*h1, *h2)?, two(*m1, *m2)?);
            if hours > 23 || minutes > 59 {
                return Err(bad);
            }
            let secs = hours * 3_600 + minutes * 60;
            if *sign == b'-' { -secs } else { secs }
        }
        _ => return Err(bad),
    };
    let in_range = (1..=12).contains(&month)
        && day >= 1
        && day <= days_in_month(year, month)
        && hour <= 23
        && minute <= 59
        && second <= 60;
    if !in_range {
        return Err(bad);
    }
    // Every field is now small (year ≤ 9999): no overflow below.
    let days = days_from_civil(year as i64, month as i64, day as i64);
    let secs = days * 86_400 + (hour * 3_600 + minute * 60 + second) as i64 - offset_secs;
    Ok(i128::from(secs) * i128::from(NANOS_PER_SEC) + to_i128(frac))
}

pub(super) fn days_in_month(year: u64, month: u64) -> u64 {
    match month {
        2 if year.is_multiple_of(4) && (!year.is_multiple_of(100) || year.is_multiple_of(400)) => {
            29
        }
        2 => 28,
        4 | 6 | 9 | 11 => 30,
        _ => 31,
    }
}

/// Days from 1970-01-01 to a date of the proleptic Gregorian calendar (Howard Hinnant's
/// `days_from_civil`).
pub(super) fn days_from_civil(year: i64, month: i64, day: i64) -> i64 {
    let year = if month <= 2 { year - 1 } else { year };
    let era = year.div_euclid(400);
    let year_of_era = year - era * 400;
    let day_of_year = (153 * ((month + 9) % 12) + 2) / 5 + day - 1;
    let day_of_era = year_of_era * 365 + year_of_era / 4 - year_of_era / 100 + day_of_year;
    era * 146_097 + day_of_era - 719_468
}
