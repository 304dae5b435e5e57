#![no_main]
//! `parse_count` (limit and remaining headers): the bytes are the header value. Must never
//! panic, and whatever it reads is what the digits say.

use libfuzzer_sys::fuzz_target;
use stormguard_http::headers::parse_count;

fuzz_target!(|data: &[u8]| {
    if let Ok(n) = parse_count(data) {
        let text = std::str::from_utf8(data).expect("a count is ASCII");
        assert_eq!(text.trim_matches([' ', '\t']).parse::<u64>(), Ok(n));
    }
});
