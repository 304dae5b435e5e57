//! gRPC deadlines: `grpc-timeout` read from the caller, and written on each attempt.
//!
//! A gRPC server stops working on a call when its `grpc-timeout` runs out. The proxy knows how
//! long the request has left on each attempt (its deadline minus the queue wait, the earlier
//! attempts and the backoffs), so it sends that, never more than the caller asked for: an
//! upstream does not keep working on a call the caller has already given up on.
//!
//! ```
//! use std::time::Duration;
//! use stormguard_proxy::grpc::{encode_timeout, parse_timeout};
//!
//! assert_eq!(encode_timeout(Duration::from_millis(1500)), "1500000u");
//! assert_eq!(parse_timeout(b"250m"), Some(Duration::from_millis(250)));
//! assert_eq!(parse_timeout(b"3 S"), None);
//! ```

use std::time::Duration;

use http::{HeaderMap, HeaderName, HeaderValue};

/// The header.
pub static GRPC_TIMEOUT: HeaderName = HeaderName::from_static("grpc-timeout");

/// Whether a request is gRPC (`content-type: application/grpc...`).
pub fn is_grpc_request(headers: &HeaderMap) -> bool {
    stormguard_http::classify::is_grpc(headers)
}

/// Reads a `grpc-timeout` value: 1 to 8 ASCII digits and a unit (`H`, `M`, `S`, `m`, `u`,
/// `n`), as the gRPC over HTTP/2 spec writes it. Anything else is `None`.
pub fn parse_timeout(value: &[u8]) -> Option<Duration> {
    let (unit, digits) = value.split_last()?;
    if digits.is_empty() || digits.len() > 8 || !digits.iter().all(u8::is_ascii_digit) {
        return None;
    }
    let n: u64 = std::str::from_utf8(digits).ok()?.parse().ok()?;
    Some(match unit {
        b'H' => Duration::from_secs(n * 3600),
        b'M' => Duration::from_secs(n * 60),
        b'S' => Duration::from_secs(n),
        b'm' => Duration::from_millis(n),
        b'u' => Duration::from_micros(n),
        b'n' => Duration::from_nanos(n),
        _ => return None,
    })
}

/// Writes a duration as `grpc-timeout`: the finest unit whose value fits in 8 digits, rounded
/// down (the upstream gives up a little early rather than late).
pub fn encode_timeout(d: Duration) -> String {
    const MAX: u128 = 99_999_999;
    let units: [(u128, char); 6] = [
        (1, 'n'),
        (1_000, 'u'),
        (1_000_000, 'm'),
        (1_000_000_000, 'S'),
        (60_000_000_000, 'M'),
        (3_600_000_000_000, 'H'),
    ];
    let nanos = d.as_nanos();
    for (per, unit) in units {
        let v = nanos / per;
        if v <= MAX {
            return format!("{v}{unit}");
        }
    }
    format!("{MAX}H")
}

/// Puts `left` in `grpc-timeout`, unless the request already carries a smaller one.
pub fn propagate(headers: &mut HeaderMap, left: Duration) {
    let theirs = headers.get(&GRPC_TIMEOUT).and_then(|v| parse_timeout(v.as_bytes()));
    if theirs.is_some_and(|t| t <= left) {
        return;
    }
    if let Ok(v) = HeaderValue::from_str(&encode_timeout(left)) {
        headers.insert(GRPC_TIMEOUT.clone(), v);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_within_a_unit() {
        for d in [
            Duration::ZERO,
            Duration::from_nanos(999),
            Duration::from_micros(1500),
            Duration::from_millis(99_999),
            Duration::from_secs(100),
            Duration::from_secs(3 * 86_400),
        ] {
            let text = encode_timeout(d);
            let back = parse_timeout(text.as_bytes()).unwrap();
            assert!(back <= d && d - back < Duration::from_secs(60), "{d:?} -> {text}");
            assert!(text.len() <= 9, "{text}");
        }
        assert_eq!(encode_timeout(Duration::from_secs(100)), "100000m");
    }

    #[test]
    fn refuses_malformed() {
        for bad in ["", "S", "123", "123456789m", "1.5S", "-1S", "10x", "1 m"] {
            assert_eq!(parse_timeout(bad.as_bytes()), None, "{bad:?}");
        }
        assert_eq!(parse_timeout(b"2H"), Some(Duration::from_secs(7200)));
    }

    #[test]
    fn never_raises_the_callers_timeout() {
        let mut h = HeaderMap::new();
        propagate(&mut h, Duration::from_millis(800));
        assert_eq!(h[&GRPC_TIMEOUT], "800000u");
        h.insert(&GRPC_TIMEOUT, HeaderValue::from_static("200m"));
        propagate(&mut h, Duration::from_millis(800));
        assert_eq!(h[&GRPC_TIMEOUT], "200m");
        propagate(&mut h, Duration::from_millis(150));
        assert_eq!(h[&GRPC_TIMEOUT], "150000u");
        // A malformed one is replaced.
        h.insert(&GRPC_TIMEOUT, HeaderValue::from_static("soon"));
        propagate(&mut h, Duration::from_millis(5));
        assert_eq!(h[&GRPC_TIMEOUT], "5000000n");
    }
}
