#![no_main]
//! The readers, `PushbackHeaders::read_pushback` and `LimitHeaders::read_limits`, over a header
//! map built from the input: two bytes of status, eight of wall clock, then field lines
//! `name-index value` split on `\n` (the name from the list below, so values reach the parsers).
//! Must never panic; waits stay within `max_plausible` except gRPC pushback, which has none.

use std::time::{Duration, UNIX_EPOCH};

use http::{HeaderMap, HeaderValue, StatusCode};
use libfuzzer_sys::fuzz_target;
use stormguard_core::backoff::Pushback;
use stormguard_http::headers::{HeaderStats, LimitHeaders, PushbackHeaders};

const NAMES: [&str; 16] = [
    "retry-after",
    "retry-after-ms",
    "x-ms-retry-after-ms",
    "grpc-retry-pushback-ms",
    "x-ratelimit-reset",
    "ratelimit-reset",
    "x-ratelimit-remaining",
    "ratelimit-remaining",
    "anthropic-ratelimit-requests-reset",
    "anthropic-ratelimit-requests-remaining",
    "x-ratelimit-reset-tokens",
    "x-ratelimit-remaining-tokens",
    "x-concurrency-limit-limit",
    "x-concurrency-limit-remaining",
    "x-other",
    "anthropic-ratelimit-tokens-reset",
];

fuzz_target!(|data: &[u8]| {
    if data.len() < 10 {
        return;
    }
    let (head, lines) = data.split_at(10);
    let status = StatusCode::from_u16(100 + u16::from_le_bytes([head[0], head[1]]) % 500)
        .expect("100..600 are status codes");
    let mut clock = [0u8; 8];
    clock.copy_from_slice(&head[2..10]);
    let now = UNIX_EPOCH + Duration::from_secs(u64::from_le_bytes(clock) >> 24);
    let mut headers = HeaderMap::new();
    for line in lines.split(|b| *b == b'\n') {
        let Some((&index, value)) = line.split_first() else { continue };
        if let Ok(value) = HeaderValue::from_bytes(value) {
            headers.append(NAMES[usize::from(index) % NAMES.len()], value);
        }
    }
    let stats = HeaderStats::new();
    let pushback = PushbackHeaders::default();
    let said = pushback.read_pushback(&headers, status, now, &stats);
    if let Some(Pushback::RetryAfter(wait)) = said
        && !headers.contains_key("grpc-retry-pushback-ms")
    {
        assert!(wait <= pushback.config().max_plausible);
    }
    let limits = LimitHeaders::default();
    let info = limits.read_limits(&headers, now, &stats);
    assert!(info.reset.is_none_or(|wait| wait <= limits.config().max_plausible));
});
