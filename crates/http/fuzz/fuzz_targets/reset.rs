#![no_main]
//! `parse_reset` in every `ResetFormat`: the first byte chooses the format, the next 8 the wall
//! clock (either side of the epoch) and the next 8 `max_plausible`; the rest is the header value.
//! Must never panic, and a wait is never longer than `max_plausible`.

use std::time::{Duration, UNIX_EPOCH};

use libfuzzer_sys::fuzz_target;
use stormguard_http::headers::{ResetFormat, parse_reset};

fuzz_target!(|data: &[u8]| {
    let Some((&choice, rest)) = data.split_first() else { return };
    let format = ResetFormat::ALL[usize::from(choice) % ResetFormat::ALL.len()];
    let word = |i: usize| {
        let mut bytes = [0u8; 8];
        for (b, d) in bytes.iter_mut().zip(rest.iter().skip(i * 8)) {
            *b = *d;
        }
        i64::from_le_bytes(bytes)
    };
    // Up to about 4 000 years either side of the epoch.
    let bits = word(0).unsigned_abs();
    let offset = Duration::new(bits >> 26, (bits % 1_000_000_000) as u32);
    let now = if word(0) < 0 { UNIX_EPOCH - offset } else { UNIX_EPOCH + offset };
    let max = Duration::from_nanos(word(1).unsigned_abs());
    if let Ok(wait) = parse_reset(rest.get(16..).unwrap_or_default(), format, now, max) {
        assert!(wait <= max);
    }
});
