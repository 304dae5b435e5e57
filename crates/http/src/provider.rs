//! What a model provider says of its rate limits and what a call costs, read into core's
//! [`Observed`] and token counts.
//!
//! - [`read_limits`]: the limits and what is left of them, per quantity, from the headers each
//!   provider sends on every answer, under their own names: OpenAI's
//!   `x-ratelimit-{limit,remaining}-{requests,tokens}`, Anthropic's
//!   `anthropic-ratelimit-{requests,tokens,input-tokens,output-tokens}-{limit,remaining}`, and
//!   the generic `RateLimit-Limit` / `RateLimit-Remaining` / `X-RateLimit-*` for requests. (The
//!   resets are read with the other pushback headers, in [`headers`](crate::headers).)
//! - [`estimate`]: a request's token cost before it is sent, from its JSON body: the output
//!   it may produce (`max_tokens`, `max_completion_tokens`, `max_output_tokens`) and its input
//!   by size (bytes per token, configurable), so it can be reserved.
//! - [`usage`]: what the provider counted, from the answer's `usage` (the JSON body, or the
//!   events of a streamed answer), to settle the reservation.
//!
//! A value that does not read is ignored and counted in [`ProviderLimits::malformed`], never
//! trusted: a limit is only ever lowered by what the provider says.

use http::HeaderMap;
use stormguard_core::rate::Observed;

/// The limits one answer stated, per quantity.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ProviderLimits {
    /// Requests per window.
    pub requests: Observed,
    /// Tokens per window (input and output together, as OpenAI and Anthropic's `tokens`
    /// count them).
    pub tokens: Observed,
    /// Input tokens per window (Anthropic).
    pub input_tokens: Observed,
    /// Output tokens per window (Anthropic).
    pub output_tokens: Observed,
    /// Rate-limit headers present whose value was not a count.
    pub malformed: u32,
}

impl ProviderLimits {
    /// What the headers state of the four limits, as rate admission reads it
    /// ([`Rates::observe`](stormguard_core::rate::Rates::observe)).
    pub fn stated(&self) -> stormguard_core::rate::Stated {
        stormguard_core::rate::Stated {
            requests: self.requests,
            tokens: self.tokens,
            input_tokens: self.input_tokens,
            output_tokens: self.output_tokens,
        }
    }
}

/// The headers of one quantity: (limit, remaining), the first present wins.
const REQUESTS: [(&str, &str); 4] = [
    ("x-ratelimit-limit-requests", "x-ratelimit-remaining-requests"),
    ("anthropic-ratelimit-requests-limit", "anthropic-ratelimit-requests-remaining"),
    ("ratelimit-limit", "ratelimit-remaining"),
    ("x-ratelimit-limit", "x-ratelimit-remaining"),
];
const TOKENS: [(&str, &str); 2] = [
    ("x-ratelimit-limit-tokens", "x-ratelimit-remaining-tokens"),
    ("anthropic-ratelimit-tokens-limit", "anthropic-ratelimit-tokens-remaining"),
];
const INPUT: [(&str, &str); 1] =
    [("anthropic-ratelimit-input-tokens-limit", "anthropic-ratelimit-input-tokens-remaining")];
const OUTPUT: [(&str, &str); 1] =
    [("anthropic-ratelimit-output-tokens-limit", "anthropic-ratelimit-output-tokens-remaining")];

/// The limits an answer's headers state.
///
/// ```
/// use http::HeaderMap;
/// use stormguard_http::provider::read_limits;
///
/// let mut h = HeaderMap::new();
/// h.insert("x-ratelimit-limit-requests", "600".parse().unwrap());
/// h.insert("x-ratelimit-remaining-requests", "599".parse().unwrap());
/// h.insert("x-ratelimit-remaining-tokens", "149984".parse().unwrap());
/// let l = read_limits(&h);
/// assert_eq!((l.requests.limit, l.requests.remaining), (Some(600), Some(599)));
/// assert_eq!((l.tokens.limit, l.tokens.remaining), (None, Some(149_984)));
/// ```
pub fn read_limits(headers: &HeaderMap) -> ProviderLimits {
    let mut malformed = 0;
    let mut count = |name: &str| -> Option<u64> {
        let v = headers.get(name)?;
        match crate::headers::parse_count(v.as_bytes()) {
            Ok(n) => Some(n),
            Err(_) => {
                malformed += 1;
                None
            }
        }
    };
    let mut quantity = |pairs: &[(&str, &str)]| -> Observed {
        let mut o = Observed::default();
        for (limit, remaining) in pairs {
            o.limit = o.limit.or_else(|| count(limit));
            o.remaining = o.remaining.or_else(|| count(remaining));
        }
        o
    };
    let requests = quantity(&REQUESTS);
    let tokens = quantity(&TOKENS);
    let input_tokens = quantity(&INPUT);
    let output_tokens = quantity(&OUTPUT);
    ProviderLimits { requests, tokens, input_tokens, output_tokens, malformed }
}

pub use stormguard_core::rate::Tokens;

/// How a request's cost is estimated before it is sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Estimator {
    /// Request body bytes per input token. Default 4 (English text in the providers'
    /// tokenizers is about 4 characters a token; JSON framing makes the estimate high, which
    /// errs toward waiting, not toward a 429).
    pub bytes_per_token: u64,
    /// The output assumed when the body names no maximum. Default 1024.
    pub default_output: u64,
}

impl Default for Estimator {
    fn default() -> Estimator {
        Estimator { bytes_per_token: 4, default_output: 1024 }
    }
}

/// The keys a request body names its output maximum by: OpenAI's chat (`max_tokens`, and
/// `max_completion_tokens` for reasoning models), OpenAI's responses API (`max_output_tokens`),
/// Anthropic's messages (`max_tokens`).
const MAX_OUTPUT_KEYS: [&str; 3] = ["max_completion_tokens", "max_output_tokens", "max_tokens"];

/// The cost of a request before it is sent: its output maximum from the JSON body (or the
/// estimator's default), its input from the body's size.
///
/// ```
/// use stormguard_http::provider::{Estimator, estimate};
///
/// let body = br#"{"model":"m","max_tokens":256,"messages":[{"role":"user","content":"hi"}]}"#;
/// let t = estimate(body, Estimator::default());
/// assert_eq!(t.output, 256);
/// assert_eq!(t.input, body.len() as u64 / 4 + 1);
/// ```
pub fn estimate(body: &[u8], e: Estimator) -> Tokens {
    let input = (body.len() as u64).div_ceil(e.bytes_per_token.max(1)).max(1);
    let output = top_level_numbers(body)
        .into_iter()
        .filter(|(k, _)| MAX_OUTPUT_KEYS.contains(&k.as_str()))
        .filter_map(|(_, v)| v.count())
        .max()
        .unwrap_or(e.default_output);
    Tokens { input, output }
}

/// What the provider counted, from an answer's body: a JSON object's `usage`, or, for a
/// streamed answer (server-sent events), the `usage` its events carry (the largest of each
/// count, since Anthropic sends input tokens first and the output count cumulatively at the
/// end, and OpenAI sends one usage in the last event). `None` when no usage is there.
///
/// ```
/// use stormguard_http::provider::{Tokens, usage};
///
/// let openai = br#"{"id":"x","usage":{"prompt_tokens":12,"completion_tokens":30,"total_tokens":42}}"#;
/// assert_eq!(usage(openai), Some(Tokens { input: 12, output: 30 }));
/// let stream = b"event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":25,\"output_tokens\":1}}}\n\n\
///                event: message_delta\ndata: {\"type\":\"message_delta\",\"usage\":{\"output_tokens\":15}}\n\n";
/// assert_eq!(usage(stream), Some(Tokens { input: 25, output: 15 }));
/// ```
pub fn usage(body: &[u8]) -> Option<Tokens> {
    read_usage(body).tokens
}

/// What an answer's body says the provider counted, and whether a count in it was malformed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    /// The counts read (as [`usage`] returns them).
    pub tokens: Option<Tokens>,
    /// A count was there but negative or not an integer: the whole `usage` is ignored
    /// (`tokens` is `None`, so the estimate stands): a count the provider could not have made
    /// says nothing of the others beside it.
    pub malformed: bool,
}

/// [`usage`], telling a malformed count apart: `"prompt_tokens": -100000000` is ignored (it
/// is not read as 100 000 000), and so is `12.5`; a count past `u64::MAX` (`1e30`) is read as
/// `u64::MAX`, left for the caller to clamp to what the request could have used.
///
/// ```
/// use stormguard_http::provider::{Tokens, read_usage};
///
/// let u = read_usage(br#"{"usage":{"prompt_tokens":-100000000,"completion_tokens":7}}"#);
/// assert_eq!((u.tokens, u.malformed), (None, true));
/// let u = read_usage(br#"{"usage":{"prompt_tokens":1e30,"completion_tokens":7}}"#);
/// assert_eq!(u.tokens, Some(Tokens { input: u64::MAX, output: 7 }));
/// let u = read_usage(br#"{"usage":{"prompt_tokens":1e400,"completion_tokens":7}}"#);
/// assert_eq!(u.tokens, Some(Tokens { input: u64::MAX, output: 7 }));
/// ```
pub fn read_usage(body: &[u8]) -> Usage {
    let mut u = Usage::default();
    let Ok(text) = std::str::from_utf8(body) else { return u };
    let events: Vec<&str> = if text.trim_start().starts_with('{') {
        vec![text]
    } else {
        text.lines().filter_map(|l| l.strip_prefix("data:")).map(str::trim).collect()
    };
    for event in events {
        if let Some(t) = usage_in(event, &mut u.malformed) {
            let f = u.tokens.get_or_insert_with(Tokens::default);
            f.input = f.input.max(t.input);
            f.output = f.output.max(t.output);
        }
    }
    if u.malformed {
        u.tokens = None;
    }
    u
}

/// The counts of every `"usage": { ... }` object in one JSON text; `malformed` is set when a
/// count is there but cannot be one.
fn usage_in(json: &str, malformed: &mut bool) -> Option<Tokens> {
    let mut found = None;
    let mut rest = json;
    while let Some(i) = rest.find("\"usage\"") {
        rest = &rest[i + 7..];
        let Some(open) = rest.trim_start().strip_prefix(':').map(str::trim_start) else {
            continue;
        };
        if !open.starts_with('{') {
            continue;
        }
        let obj = &open[..object_end(open).unwrap_or(open.len())];
        let counts = top_level_numbers(obj.as_bytes());
        let mut get = |keys: &[&str]| {
            let n = counts.iter().find(|(k, _)| keys.contains(&k.as_str()))?.1;
            *malformed |= n.count().is_none();
            n.count()
        };
        let input = get(&["prompt_tokens", "input_tokens"]);
        let output = get(&["completion_tokens", "output_tokens"]);
        if input.is_some() || output.is_some() {
            let f: &mut Tokens = found.get_or_insert_with(Tokens::default);
            f.input = f.input.max(input.unwrap_or(0));
            f.output = f.output.max(output.unwrap_or(0));
        }
    }
    found
}

/// The byte length of the JSON object `text` starts with (through its closing brace), strings
/// and escapes respected; `None` if it does not close.
fn object_end(text: &str) -> Option<usize> {
    let (mut depth, mut in_string, mut escaped) = (0u32, false, false);
    for (i, b) in text.bytes().enumerate() {
        if in_string {
            match (escaped, b) {
                (true, _) => escaped = false,
                (false, b'\\') => escaped = true,
                (false, b'"') => in_string = false,
                _ => {}
            }
            continue;
        }
        match b {
            b'"' => in_string = true,
            b'{' | b'[' => depth += 1,
            b'}' | b']' => {
                depth = depth.checked_sub(1)?;
                if depth == 0 {
                    return Some(i + 1);
                }
            }
            _ => {}
        }
    }
    None
}

/// A number a JSON text states.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Number {
    /// A non-negative integer (one past `u64::MAX`, `1e30` included, saturates).
    Count(u64),
    /// Negative, or not an integer: never a count.
    Other,
}

impl Number {
    fn count(self) -> Option<u64> {
        match self {
            Number::Count(n) => Some(n),
            Number::Other => None,
        }
    }

    /// One JSON number token (`-`, digits, fraction, exponent).
    fn read(token: &[u8]) -> Number {
        let text = std::str::from_utf8(token).unwrap_or("");
        if text.bytes().all(|b| b.is_ascii_digit()) {
            return Number::Count(text.parse().unwrap_or(u64::MAX));
        }
        match text.parse::<f64>() {
            // `1e30` (and `1e400`, infinite as an f64) is past every count: it saturates.
            Ok(v) if v >= u64::MAX as f64 => Number::Count(u64::MAX),
            // `1e3` is an integer.
            Ok(v) if v >= 0.0 && v.fract() == 0.0 => Number::Count(v as u64),
            _ => Number::Other,
        }
    }
}

/// The `"key": <number>` pairs at the top level of a JSON object (nested objects and arrays
/// skipped, strings respected). Enough to read a few counts without a JSON parser on the
/// request path; anything it does not understand is skipped, never trusted.
fn top_level_numbers(json: &[u8]) -> Vec<(String, Number)> {
    let mut out = Vec::new();
    let (mut depth, mut i) = (0i32, 0usize);
    let mut key: Option<String> = None;
    while i < json.len() {
        match json[i] {
            b'"' => {
                let start = i + 1;
                let mut j = start;
                while j < json.len() && json[j] != b'"' {
                    j += if json[j] == b'\\' { 2 } else { 1 };
                }
                let s = String::from_utf8_lossy(&json[start..j.min(json.len())]).into_owned();
                i = j + 1;
                // A string followed by `:` at depth 1 is a key.
                let mut k = i;
                while k < json.len() && json[k].is_ascii_whitespace() {
                    k += 1;
                }
                if depth == 1 && k < json.len() && json[k] == b':' {
                    key = Some(s);
                    i = k + 1;
                } else {
                    key = None;
                }
                continue;
            }
            b'{' | b'[' => depth += 1,
            b'}' | b']' => depth -= 1,
            b'-' | b'0'..=b'9' if depth == 1 => {
                // The whole token: a sign is part of the number, not skipped over.
                let start = i;
                i += 1;
                while i < json.len()
                    && matches!(json[i], b'0'..=b'9' | b'.' | b'e' | b'E' | b'+' | b'-')
                {
                    i += 1;
                }
                if let Some(k) = key.take() {
                    out.push((k, Number::read(&json[start..i])));
                }
                continue;
            }
            b',' => key = None,
            _ => {}
        }
        i += 1;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(http::HeaderName::from_bytes(k.as_bytes()).unwrap(), v.parse().unwrap());
        }
        h
    }

    #[test]
    fn each_providers_own_names() {
        let anthropic = headers(&[
            ("anthropic-ratelimit-requests-limit", "50"),
            ("anthropic-ratelimit-requests-remaining", "49"),
            ("anthropic-ratelimit-input-tokens-limit", "40000"),
            ("anthropic-ratelimit-input-tokens-remaining", "39000"),
            ("anthropic-ratelimit-output-tokens-limit", "8000"),
            ("anthropic-ratelimit-output-tokens-remaining", "7990"),
            ("anthropic-ratelimit-tokens-limit", "48000"),
            ("anthropic-ratelimit-tokens-remaining", "46990"),
        ]);
        let l = read_limits(&anthropic);
        assert_eq!(l.requests, Observed { limit: Some(50), remaining: Some(49) });
        assert_eq!(l.input_tokens, Observed { limit: Some(40_000), remaining: Some(39_000) });
        assert_eq!(l.output_tokens, Observed { limit: Some(8_000), remaining: Some(7_990) });
        assert_eq!(l.tokens, Observed { limit: Some(48_000), remaining: Some(46_990) });
        let generic = headers(&[("ratelimit-limit", "100"), ("ratelimit-remaining", "7")]);
        assert_eq!(
            read_limits(&generic).requests,
            Observed { limit: Some(100), remaining: Some(7) }
        );
        // A value that is not a count is not trusted, and is counted.
        let bad =
            headers(&[("x-ratelimit-remaining-requests", "lots"), ("x-ratelimit-limit", "-1")]);
        let l = read_limits(&bad);
        assert_eq!(l.requests, Observed::default());
        assert_eq!(l.malformed, 2);
        assert_eq!(read_limits(&HeaderMap::new()), ProviderLimits::default());
    }

    #[test]
    fn the_output_maximum_is_read_at_the_top_level_only() {
        let e = Estimator::default();
        let b = br#"{"messages":[{"content":"max_tokens: 99","max_tokens":5}],"max_completion_tokens":2048}"#;
        assert_eq!(estimate(b, e).output, 2048);
        // Named nowhere (or only nested): the default.
        let b = br#"{"messages":[{"max_tokens":5}],"stream":true}"#;
        assert_eq!(estimate(b, e).output, 1024);
        // Not a whole number: ignored.
        assert_eq!(estimate(br#"{"max_tokens":1.5}"#, e).output, 1024);
        // Input by size, at least one token.
        assert_eq!(estimate(b"", e), Tokens { input: 1, output: 1024 });
        let big = vec![b'x'; 4_000];
        assert_eq!(
            estimate(&big, Estimator { bytes_per_token: 3, default_output: 0 }).input,
            1_334
        );
    }

    #[test]
    fn usage_from_bodies_and_streams() {
        let anthropic = br#"{"type":"message","content":[{"type":"text","text":"\"usage\": {\"input_tokens\": 999}"}],"usage":{"input_tokens":10,"output_tokens":3}}"#;
        assert_eq!(usage(anthropic), Some(Tokens { input: 10, output: 3 }));
        let responses = br#"{"usage":{"input_tokens":7,"output_tokens":9,"total_tokens":16}}"#;
        assert_eq!(usage(responses), Some(Tokens { input: 7, output: 9 }));
        let openai_stream = b"data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}],\"usage\":null}\n\n\
            data: {\"choices\":[],\"usage\":{\"prompt_tokens\":5,\"completion_tokens\":2}}\n\ndata: [DONE]\n\n";
        assert_eq!(usage(openai_stream), Some(Tokens { input: 5, output: 2 }));
        assert_eq!(usage(br#"{"id":"x"}"#), None);
        assert_eq!(usage(b"\xff\xfe"), None);
        assert_eq!(usage(br#"{"usage":{"prompt_tokens":"#), None);
    }

    proptest::proptest! {
        #[test]
        fn never_panics_on_any_body(body in proptest::collection::vec(proptest::num::u8::ANY, 0..200)) {
            let _ = estimate(&body, Estimator::default());
            let _ = usage(&body);
        }

        #[test]
        fn never_panics_on_json_like_text(text in "[{}\\[\\]\":,0-9a-z_ \\\\.]{0,120}") {
            let _ = estimate(text.as_bytes(), Estimator::default());
            let _ = usage(text.as_bytes());
        }
    }
}
