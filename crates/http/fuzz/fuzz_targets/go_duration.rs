#![no_main]
//! `parse_go_duration`: the bytes are the header value. Must never panic.

use libfuzzer_sys::fuzz_target;
use stormguard_http::headers::parse_go_duration;

fuzz_target!(|data: &[u8]| {
    if let Ok(d) = parse_go_duration(data) {
        assert!(d.as_nanos() <= u128::from(u64::MAX));
    }
});
