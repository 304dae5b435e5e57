#![no_main]
//! `parse_retry_after`: delta-seconds or an HTTP-date. The first 8 bytes choose the wall clock
//! (either side of the epoch) and the next 8 `max_plausible`; the rest is the header value.
//! Must never panic, and a wait is never longer than `max_plausible`.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use libfuzzer_sys::fuzz_target;
use stormguard_http::headers::parse_retry_after;

fuzz_target!(|data: &[u8]| {
    let (now, max, value) = split(data);
    if let Ok(wait) = parse_retry_after(value, now, max) {
        assert!(wait <= max);
    }
});

fn split(data: &[u8]) -> (SystemTime, Duration, &[u8]) {
    let word = |i: usize| {
        let mut bytes = [0u8; 8];
        for (b, d) in bytes.iter_mut().zip(data.iter().skip(i * 8)) {
            *b = *d;
        }
        i64::from_le_bytes(bytes)
    };
    // Up to about 4 000 years either side of the epoch.
    let bits = word(0).unsigned_abs();
    let offset = Duration::new(bits >> 26, (bits % 1_000_000_000) as u32);
    let now = if word(0) < 0 { UNIX_EPOCH - offset } else { UNIX_EPOCH + offset };
    let max = Duration::from_nanos(word(1).unsigned_abs());
    (now, max, data.get(16..).unwrap_or_default())
}
