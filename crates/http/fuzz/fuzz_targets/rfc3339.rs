#![no_main]
//! `parse_rfc3339`: the bytes are the header value. Must never panic.

use libfuzzer_sys::fuzz_target;
use stormguard_http::headers::parse_rfc3339;

fuzz_target!(|data: &[u8]| {
    let _ = parse_rfc3339(data);
});
