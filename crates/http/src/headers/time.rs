//! Wall-clock dates — HTTP-dates (`httpdate`) and RFC 3339 date-times (`time`) — as unix
//! nanoseconds. No calendar maths here: the libraries check the fields and count the days.

use std::borrow::Cow;

use ::time::OffsetDateTime;
use ::time::format_description::well_known::Rfc3339;

use super::*;

pub(super) fn http_date_nanos(text: &[u8]) -> Result<i128, Malformed> {
    let text = std::str::from_utf8(text).map_err(|_| Malformed::BadHttpDate)?;
    let date = httpdate::parse_http_date(text).map_err(|_| Malformed::BadHttpDate)?;
    Ok(unix_nanos(date))
}

/// An RFC 3339 date-time as nanoseconds since the unix epoch (negative before it).
///
/// `time`'s `Rfc3339` reads the RFC's grammar (four-digit year, `Z` or `±hh:mm`, a fraction of
/// any length, nanoseconds kept) and checks every field. Two rules are ours: the date and time
/// are separated by `T`, `t` or a space only (`time` takes any byte there), and a leap second
/// (`:60`) counts as the next minute's first second wherever it appears (`time` takes one only
/// at the end of a UTC month, as the nanosecond before). A server sends `:60` for a reset at the
/// turn of a minute; waiting one second more than it meant is harmless.
pub(super) fn rfc3339_unix_nanos(value: &[u8]) -> Result<i128, Malformed> {
    let text = trim_ows(value);
    if text.is_empty() {
        return Err(Malformed::Empty);
    }
    let bad = Malformed::BadRfc3339;
    if !matches!(text.get(10), Some(b'T' | b't' | b' ')) {
        return Err(bad);
    }
    let text = std::str::from_utf8(text).map_err(|_| bad)?;
    let (text, leap): (Cow<'_, str>, i128) = match (text.get(16..17), text.get(17..19)) {
        (Some(":"), Some("60")) => (format!("{}59{}", &text[..17], &text[19..]).into(), 1),
        _ => (text.into(), 0),
    };
    let at = OffsetDateTime::parse(&text, &Rfc3339).map_err(|_| bad)?;
    Ok(at.unix_timestamp_nanos() + leap * i128::from(NANOS_PER_SEC))
}
