#![no_main]
//! `parse_grpc_pushback`: the bytes are the header value. Must never panic.

use libfuzzer_sys::fuzz_target;
use stormguard_core::backoff::Pushback;
use stormguard_http::headers::parse_grpc_pushback;

fuzz_target!(|data: &[u8]| {
    if let Ok(Pushback::RetryAfter(wait)) = parse_grpc_pushback(data) {
        assert!(wait.as_millis() <= i64::MAX as u128);
    }
});
