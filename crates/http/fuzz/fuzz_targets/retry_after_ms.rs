#![no_main]
//! `parse_retry_after_ms`: a wait in milliseconds. The first 8 bytes choose `max_plausible`; the
//! rest is the header value. Must never panic, and a wait is never longer than `max_plausible`.

use std::time::Duration;

use libfuzzer_sys::fuzz_target;
use stormguard_http::headers::parse_retry_after_ms;

fuzz_target!(|data: &[u8]| {
    let mut bytes = [0u8; 8];
    for (b, d) in bytes.iter_mut().zip(data) {
        *b = *d;
    }
    let max = Duration::from_nanos(u64::from_le_bytes(bytes));
    if let Ok(wait) = parse_retry_after_ms(data.get(8..).unwrap_or_default(), max) {
        assert!(wait <= max);
    }
});
