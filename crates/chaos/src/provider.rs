//! chaos as a model provider: an OpenAI- or Anthropic-shaped API with requests and tokens per
//! minute, metered the way those providers describe theirs, so stormguard's rate admission can
//! be shown against something that behaves like the real thing.
//!
//! Each request's tokens are counted from its body (input by size, output its `max_tokens` /
//! `max_completion_tokens`, as [`stormguard_http::provider::estimate`] reads them). Every answer
//! carries the provider's own headers — OpenAI's `x-ratelimit-{limit,remaining,reset}-{requests,
//! tokens}` (resets as Go durations, `1s`, `6m0s`), Anthropic's
//! `anthropic-ratelimit-{requests,tokens,input-tokens,output-tokens}-{limit,remaining,reset}`
//! (resets as RFC 3339 instants). The buckets are core's [`RateLimit`]: a full bucket of the
//! limit, refilled continuously over a minute. A request, in order:
//!
//! 1. past [`ProviderOptions::quota_exhausted_after`] requests, is refused for want of credit:
//!    OpenAI's 429 `insufficient_quota` (no `retry-after`: waiting does not help), or what
//!    Anthropic sends instead, a 400 `invalid_request_error` saying the credit balance is too
//!    low;
//! 2. drawn overloaded (the phase's `overloaded_rate`), is answered at once: Anthropic's 529
//!    `overloaded_error`; for OpenAI, which has no 529, its 503 "engine is currently
//!    overloaded" `server_error`. Nothing is taken from the buckets;
//! 3. past the requests, tokens, input tokens or output tokens per minute, is answered 429 with
//!    the provider's error body, `retry-after` (seconds) and `retry-after-ms`;
//! 4. otherwise goes through the phase as usual, and a 200 is the provider's JSON with `usage`
//!    — or, when the body asks `"stream": true`, server-sent events, one per body frame,
//!    [`ProviderOptions::stream_event_delay`] apart, with the usage in the events (OpenAI's last
//!    chunk before `data: [DONE]`, as with `stream_options.include_usage`; Anthropic's
//!    `message_start` and `message_delta`). A stream drawn to break
//!    ([`ProviderOptions::stream_break_rate`]) is cut after its first event: what a client must
//!    never retry once a byte reached its caller.

use std::fmt;
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime};

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use stormguard_core::clock::Timestamp;
use stormguard_core::rate::{RateConfig, RateLimit, RatePermit};
use stormguard_http::provider::{Estimator, Tokens, estimate};

/// Which provider's shape to serve.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProviderKind {
    /// OpenAI: `x-ratelimit-*` headers, `{"error": {"type": "requests", "code":
    /// "rate_limit_exceeded"}}`, `usage.prompt_tokens` / `completion_tokens`.
    OpenAi,
    /// Anthropic: `anthropic-ratelimit-*` headers, `{"type": "error", "error": {"type":
    /// "rate_limit_error"}}`, `usage.input_tokens` / `output_tokens`.
    Anthropic,
}

/// A provider kind that is not one.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("`{0}` is not a provider (expected openai or anthropic)")]
pub struct UnknownProvider(pub String);

impl FromStr for ProviderKind {
    type Err = UnknownProvider;

    fn from_str(s: &str) -> Result<ProviderKind, UnknownProvider> {
        match s {
            "openai" => Ok(ProviderKind::OpenAi),
            "anthropic" => Ok(ProviderKind::Anthropic),
            other => Err(UnknownProvider(other.to_string())),
        }
    }
}

impl fmt::Display for ProviderKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ProviderKind::OpenAi => "openai",
            ProviderKind::Anthropic => "anthropic",
        })
    }
}

/// The provider chaos plays: its shape and the limits every provider has, per minute. The
/// rest is in [`ProviderOptions`] (a separate type, so this one can still be written as a
/// literal).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProviderConfig {
    /// The shape.
    pub kind: ProviderKind,
    /// Requests per minute (>= 1); `None`: unlimited.
    pub rpm: Option<u64>,
    /// Tokens per minute, input and output together (>= 1); `None`: unlimited.
    pub tpm: Option<u64>,
}

/// The default pause between a stream's events: 5 ms.
pub const DEFAULT_STREAM_EVENT_DELAY: Duration = Duration::from_millis(5);

/// What the provider does beyond its shape and its requests and tokens per minute. The default
/// adds nothing: no split token limits, streams 5 ms an event and never broken, no quota.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ProviderOptions {
    /// Input tokens per minute (>= 1), metered apart from output, as Anthropic does (its ITPM);
    /// sent as `anthropic-ratelimit-input-tokens-*`. Anthropic only. TOML `itpm`, flag
    /// `--itpm`; default none.
    pub itpm: Option<u64>,
    /// Output tokens per minute (>= 1), Anthropic's OTPM, counted from each request's output
    /// maximum; sent as `anthropic-ratelimit-output-tokens-*`. Anthropic only. TOML `otpm`,
    /// flag `--otpm`; default none.
    pub otpm: Option<u64>,
    /// The pause before each event of a streamed answer after the first (the phase's latency
    /// comes before the first). TOML `stream_event_delay`, flag `--stream-event-delay`;
    /// default 5 ms.
    pub stream_event_delay: Duration,
    /// Fraction of streamed answers cut after their first event, in `[0, 1]` (a seeded draw,
    /// [`Sampler::breaks_stream`](crate::Sampler::breaks_stream)): HTTP/1.1 closes the
    /// connection without the chunked body's end, h2 resets the stream. TOML
    /// `stream_break_rate`, flag `--stream-break-rate`; default 0.
    pub stream_break_rate: f64,
    /// The first N requests (by arrival, whatever their answer) go through; every later one is
    /// refused for want of credit. TOML `quota_exhausted_after`, flag
    /// `--quota-exhausted-after`; default none (an endless quota).
    pub quota_exhausted_after: Option<u64>,
}

impl Default for ProviderOptions {
    fn default() -> ProviderOptions {
        ProviderOptions {
            itpm: None,
            otpm: None,
            stream_event_delay: DEFAULT_STREAM_EVENT_DELAY,
            stream_break_rate: 0.0,
            quota_exhausted_after: None,
        }
    }
}

/// A broken rule of the provider's settings. [`ProviderError::key`] names the key (the CLI
/// maps it to its flag); the message is one plain reason.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum ProviderError {
    /// A limit of zero.
    #[error("must be at least 1 (leave it out for no limit)")]
    ZeroLimit {
        /// `rpm`, `tpm`, `itpm` or `otpm`.
        key: &'static str,
    },
    /// `itpm` or `otpm` for a provider that does not meter them apart.
    #[error("input and output tokens are metered apart by anthropic, not {kind}")]
    SplitLimits {
        /// `itpm` or `otpm`.
        key: &'static str,
        /// The kind given.
        kind: ProviderKind,
    },
    /// `stream_break_rate` outside `[0, 1]`.
    #[error("must be a fraction between 0 and 1, got {got}")]
    NotAFraction {
        /// The value given.
        got: f64,
    },
}

impl ProviderError {
    /// The key the rule is about: `rpm`, `itpm`, `stream_break_rate`.
    pub fn key(&self) -> &'static str {
        match self {
            ProviderError::ZeroLimit { key } | ProviderError::SplitLimits { key, .. } => key,
            ProviderError::NotAFraction { .. } => "stream_break_rate",
        }
    }
}

impl ProviderConfig {
    /// Checks the limits and `options` against this kind; the first problem found.
    pub fn validate(&self, options: &ProviderOptions) -> Result<(), ProviderError> {
        for (key, limit) in
            [("rpm", self.rpm), ("tpm", self.tpm), ("itpm", options.itpm), ("otpm", options.otpm)]
        {
            if limit == Some(0) {
                return Err(ProviderError::ZeroLimit { key });
            }
        }
        if self.kind != ProviderKind::Anthropic {
            for (key, limit) in [("itpm", options.itpm), ("otpm", options.otpm)] {
                if limit.is_some() {
                    return Err(ProviderError::SplitLimits { key, kind: self.kind });
                }
            }
        }
        if !(0.0..=1.0).contains(&options.stream_break_rate) {
            return Err(ProviderError::NotAFraction { got: options.stream_break_rate });
        }
        Ok(())
    }
}

/// Which limit refused a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Quantity {
    Requests,
    Tokens,
    InputTokens,
    OutputTokens,
}

impl Quantity {
    /// As the providers' headers name it.
    fn header(self) -> &'static str {
        match self {
            Quantity::Requests => "requests",
            Quantity::Tokens => "tokens",
            Quantity::InputTokens => "input-tokens",
            Quantity::OutputTokens => "output-tokens",
        }
    }

    /// As the providers' messages name it.
    fn words(self) -> &'static str {
        match self {
            Quantity::Requests => "requests",
            Quantity::Tokens => "tokens",
            Quantity::InputTokens => "input tokens",
            Quantity::OutputTokens => "output tokens",
        }
    }
}

/// The provider's state while chaos serves.
#[derive(Debug)]
pub(crate) struct Provider {
    config: ProviderConfig,
    pub(crate) options: ProviderOptions,
    /// One bucket per quantity, with its limit; in [`Quantity`] order.
    buckets: [(Quantity, Option<u64>, RateLimit); 4],
    /// Requests that arrived, for the quota.
    arrived: AtomicU64,
    origin: Instant,
}

/// What a request asks of the provider, read from its body.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Asked {
    pub(crate) tokens: Tokens,
    /// `"stream": true`.
    pub(crate) stream: bool,
}

/// A request the provider took: what it asked, and its place in the buckets.
#[derive(Debug)]
pub(crate) struct Taken {
    pub(crate) asked: Asked,
    /// A stream drawn to be cut after its first event.
    pub(crate) break_stream: bool,
    _permits: Vec<RatePermit>,
}

/// A refused request: by which limit, and how long until it would fit.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Refused {
    pub(crate) quantity: Quantity,
    pub(crate) wait: Duration,
}

/// One answer's status and JSON body.
pub(crate) type Shaped = (StatusCode, Bytes);

const MINUTE: Duration = Duration::from_secs(60);

fn json(value: &serde_json::Value) -> Bytes {
    Bytes::from(serde_json::to_vec(value).unwrap_or_default())
}

/// The overloaded answer in `kind`'s shape; without a provider, Anthropic's (the one whose
/// status means overloaded).
pub(crate) fn overloaded(kind: Option<ProviderKind>) -> Shaped {
    match kind {
        Some(ProviderKind::OpenAi) => (
            StatusCode::SERVICE_UNAVAILABLE,
            json(&serde_json::json!({"error": {
                "message": "The engine is currently overloaded, please try again later",
                "type": "server_error", "param": null, "code": null}})),
        ),
        Some(ProviderKind::Anthropic) | None => (
            StatusCode::from_u16(529).unwrap_or(StatusCode::SERVICE_UNAVAILABLE),
            json(&serde_json::json!({"type": "error", "error": {
                "type": "overloaded_error", "message": "Overloaded"}})),
        ),
    }
}

impl Provider {
    pub(crate) fn new(config: ProviderConfig, options: ProviderOptions) -> Provider {
        let bucket = |limit| RateLimit::new(RateConfig { limit, window: MINUTE });
        Provider {
            config,
            options,
            buckets: [
                (Quantity::Requests, config.rpm, bucket(config.rpm)),
                (Quantity::Tokens, config.tpm, bucket(config.tpm)),
                (Quantity::InputTokens, options.itpm, bucket(options.itpm)),
                (Quantity::OutputTokens, options.otpm, bucket(options.otpm)),
            ],
            arrived: AtomicU64::new(0),
            origin: Instant::now(),
        }
    }

    pub(crate) fn kind(&self) -> ProviderKind {
        self.config.kind
    }

    fn now(&self) -> Timestamp {
        Timestamp::from_nanos(u64::try_from(self.origin.elapsed().as_nanos()).unwrap_or(u64::MAX))
    }

    /// What a request body asks: its tokens, and whether it wants a stream.
    pub(crate) fn read(body: &[u8]) -> Asked {
        let tokens = estimate(body, Estimator { bytes_per_token: 4, default_output: 16 });
        let stream = serde_json::from_slice::<serde_json::Value>(body)
            .ok()
            .and_then(|v| v.get("stream").and_then(serde_json::Value::as_bool))
            .unwrap_or(false);
        Asked { tokens, stream }
    }

    /// Counts an arriving request against the quota; true when it is past it.
    pub(crate) fn quota_exhausted(&self) -> bool {
        // Relaxed: the count is the only thing shared; each arrival gets a distinct number.
        let n = self.arrived.fetch_add(1, Ordering::Relaxed);
        self.options.quota_exhausted_after.is_some_and(|limit| n >= limit)
    }

    /// Takes a request from every bucket, or says which refused it and how long until it
    /// would fit (what was already taken goes back: the request is not served).
    pub(crate) fn take(&self, asked: Asked) -> Result<Taken, Refused> {
        let now = self.now();
        let t = asked.tokens;
        let mut permits = Vec::with_capacity(self.buckets.len());
        for (quantity, _, bucket) in &self.buckets {
            let cost = match quantity {
                Quantity::Requests => 1,
                Quantity::Tokens => t.total(),
                Quantity::InputTokens => t.input,
                Quantity::OutputTokens => t.output,
            };
            match bucket.try_acquire(now, cost) {
                Ok(p) => permits.push(p),
                Err(w) => {
                    for p in permits {
                        p.settle(now, Some(0));
                    }
                    return Err(Refused { quantity: *quantity, wait: w.wait });
                }
            }
        }
        Ok(Taken { asked, break_stream: false, _permits: permits })
    }

    /// The provider's rate-limit headers, on every answer.
    pub(crate) fn headers(&self, h: &mut HeaderMap) {
        let now = self.now();
        for (quantity, limit, bucket) in &self.buckets {
            let Some(limit) = *limit else { continue };
            let what = quantity.header();
            let available = bucket.snapshot(now).available.min(limit);
            // Until the bucket is full again, at `limit` per minute.
            let to_full = MINUTE.mul_f64((limit - available) as f64 / limit.max(1) as f64);
            let mut put = |name: String, value: String| {
                if let (Ok(n), Ok(v)) =
                    (HeaderName::from_bytes(name.as_bytes()), HeaderValue::from_str(&value))
                {
                    h.insert(n, v);
                }
            };
            match self.config.kind {
                ProviderKind::OpenAi => {
                    put(format!("x-ratelimit-limit-{what}"), limit.to_string());
                    put(format!("x-ratelimit-remaining-{what}"), available.to_string());
                    put(format!("x-ratelimit-reset-{what}"), go_duration(to_full));
                }
                ProviderKind::Anthropic => {
                    put(format!("anthropic-ratelimit-{what}-limit"), limit.to_string());
                    put(format!("anthropic-ratelimit-{what}-remaining"), available.to_string());
                    put(format!("anthropic-ratelimit-{what}-reset"), rfc3339(to_full));
                }
            }
        }
    }

    /// A 200's JSON body, with the tokens counted as `usage`.
    pub(crate) fn ok_body(&self, t: Tokens) -> Bytes {
        json(&match self.config.kind {
            ProviderKind::OpenAi => serde_json::json!({
                "id": "chatcmpl-chaos", "object": "chat.completion", "model": "chaos",
                "choices": [{"index": 0, "finish_reason": "stop",
                             "message": {"role": "assistant", "content": "ok"}}],
                "usage": {"prompt_tokens": t.input, "completion_tokens": t.output,
                          "total_tokens": t.total()},
            }),
            ProviderKind::Anthropic => serde_json::json!({
                "id": "msg_chaos", "type": "message", "role": "assistant", "model": "chaos",
                "content": [{"type": "text", "text": "ok"}], "stop_reason": "end_turn",
                "usage": {"input_tokens": t.input, "output_tokens": t.output},
            }),
        })
    }

    /// A 200's server-sent events, one `Bytes` per event, with the tokens counted as usage.
    pub(crate) fn stream_events(&self, t: Tokens) -> Vec<Bytes> {
        use serde_json::{Value, json};
        match self.config.kind {
            ProviderKind::OpenAi => {
                let chunk = |choices: Value| {
                    json!({"id": "chatcmpl-chaos", "object": "chat.completion.chunk",
                           "created": 0, "model": "chaos", "choices": choices})
                };
                let delta = |delta: Value, finish: Option<&str>| {
                    let c = chunk(json!([{"index": 0, "delta": delta, "finish_reason": finish}]));
                    sse(None, &c.to_string())
                };
                // The usage chunk, as with `stream_options: {"include_usage": true}`: no
                // choices, the counts.
                let mut usage = chunk(json!([]));
                usage["usage"] = json!({"prompt_tokens": t.input,
                    "completion_tokens": t.output, "total_tokens": t.total()});
                vec![
                    delta(json!({"role": "assistant", "content": ""}), None),
                    delta(json!({"content": "ok"}), None),
                    delta(json!({}), Some("stop")),
                    sse(None, &usage.to_string()),
                    sse(None, "[DONE]"),
                ]
            }
            ProviderKind::Anthropic => {
                let event = |data: Value| {
                    let name = data["type"].as_str().unwrap_or_default().to_string();
                    sse(Some(&name), &data.to_string())
                };
                let message = json!({"id": "msg_chaos", "type": "message", "role": "assistant",
                    "model": "chaos", "content": [], "stop_reason": null, "stop_sequence": null,
                    "usage": {"input_tokens": t.input, "output_tokens": 1}});
                vec![
                    event(json!({"type": "message_start", "message": message})),
                    event(json!({"type": "content_block_start", "index": 0,
                                 "content_block": {"type": "text", "text": ""}})),
                    event(json!({"type": "content_block_delta", "index": 0,
                                 "delta": {"type": "text_delta", "text": "ok"}})),
                    event(json!({"type": "content_block_stop", "index": 0})),
                    event(json!({"type": "message_delta",
                                 "delta": {"stop_reason": "end_turn", "stop_sequence": null},
                                 "usage": {"output_tokens": t.output}})),
                    event(json!({"type": "message_stop"})),
                ]
            }
        }
    }

    /// A 429's JSON body, as the provider writes it, naming the limit that refused.
    pub(crate) fn limited_body(&self, refused: Quantity) -> Bytes {
        let limit = self
            .buckets
            .iter()
            .find(|(q, _, _)| *q == refused)
            .and_then(|(_, l, _)| *l)
            .unwrap_or(0);
        let words = refused.words();
        json(&match self.config.kind {
            ProviderKind::OpenAi => serde_json::json!({"error": {
                "message": format!("Rate limit reached on {words} per min: Limit {limit}"),
                // OpenAI's type is the quantity: `requests` or `tokens`.
                "type": if refused == Quantity::Requests { "requests" } else { "tokens" },
                "param": null, "code": "rate_limit_exceeded"}}),
            ProviderKind::Anthropic => serde_json::json!({"type": "error", "error": {
            "type": "rate_limit_error",
            "message": format!(
                "This request would exceed the rate limit of {limit} {words} per minute"
            )}}),
        })
    }

    /// The answer past the quota: OpenAI's 429 `insufficient_quota`; Anthropic has no such
    /// 429 and refuses a request it cannot bill with a 400 `invalid_request_error`.
    pub(crate) fn quota_answer(&self) -> Shaped {
        match self.config.kind {
            ProviderKind::OpenAi => (
                StatusCode::TOO_MANY_REQUESTS,
                json(&serde_json::json!({"error": {
                    "message": "You exceeded your current quota, please check your plan and \
                                billing details.",
                    "type": "insufficient_quota", "param": null,
                    "code": "insufficient_quota"}})),
            ),
            ProviderKind::Anthropic => (
                StatusCode::BAD_REQUEST,
                json(&serde_json::json!({"type": "error", "error": {
                    "type": "invalid_request_error",
                    "message": "Your credit balance is too low to access the Anthropic API. \
                                Please go to Plans & Billing to upgrade or purchase credits."}})),
            ),
        }
    }
}

/// One server-sent event: `event: NAME` (when named), `data: DATA`, a blank line.
fn sse(name: Option<&str>, data: &str) -> Bytes {
    let mut e = String::new();
    if let Some(name) = name {
        e.push_str("event: ");
        e.push_str(name);
        e.push('\n');
    }
    e.push_str("data: ");
    e.push_str(data);
    e.push_str("\n\n");
    Bytes::from(e)
}

/// A duration as Go's `time.Duration.String()` writes it, as OpenAI's reset headers do: `20ms`,
/// `1s`, `7.66s`, `6m0s`.
fn go_duration(d: Duration) -> String {
    let ms = d.as_millis();
    if ms < 1_000 {
        return format!("{ms}ms");
    }
    let minutes = ms / 60_000;
    let rest = ms % 60_000;
    let secs = if rest.is_multiple_of(1_000) {
        format!("{}s", rest / 1_000)
    } else {
        let s = format!("{}.{:03}", rest / 1_000, rest % 1_000);
        format!("{}s", s.trim_end_matches('0'))
    };
    if minutes == 0 { secs } else { format!("{minutes}m{secs}") }
}

/// The instant `d` from now, RFC 3339 in UTC, as Anthropic's reset headers write it.
fn rfc3339(d: Duration) -> String {
    let at = time::OffsetDateTime::from(SystemTime::now() + d);
    let at = at.replace_nanosecond(0).unwrap_or(at);
    at.format(&time::format_description::well_known::Rfc3339).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn go_durations_as_openai_writes_them() {
        let ms = Duration::from_millis;
        assert_eq!(go_duration(ms(20)), "20ms");
        assert_eq!(go_duration(ms(1_000)), "1s");
        assert_eq!(go_duration(ms(7_660)), "7.66s");
        assert_eq!(go_duration(ms(360_000)), "6m0s");
        // And stormguard reads them back.
        for d in [ms(20), ms(1_000), ms(7_660), ms(360_000)] {
            let text = go_duration(d);
            assert_eq!(stormguard_http::headers::parse_go_duration(text.as_bytes()).unwrap(), d);
        }
    }

    #[test]
    fn the_buckets_meter_requests_and_tokens() {
        let p = Provider::new(
            ProviderConfig { kind: ProviderKind::OpenAi, rpm: Some(600), tpm: Some(1_000) },
            ProviderOptions::default(),
        );
        let body = Provider::read(br#"{"max_tokens":400,"messages":[]}"#);
        let a = p.take(body).unwrap();
        assert_eq!(a.asked.tokens.output, 400);
        assert!(!a.asked.stream);
        let _b = p.take(body).unwrap();
        // The third would pass 1000 tokens: a wait, and its request unit is not spent.
        assert_eq!(p.take(body).unwrap_err().quantity, Quantity::Tokens);
        let mut h = HeaderMap::new();
        p.headers(&mut h);
        assert_eq!(h["x-ratelimit-limit-requests"], "600");
        assert_eq!(h["x-ratelimit-remaining-requests"], "598");
        assert_eq!(h["x-ratelimit-limit-tokens"], "1000");
        let read = stormguard_http::provider::read_limits(&h);
        assert_eq!(read.tokens.limit, Some(1_000));
        assert!(read.tokens.remaining.unwrap() < 200);
    }

    #[test]
    fn anthropic_headers_and_bodies() {
        let p = Provider::new(
            ProviderConfig { kind: ProviderKind::Anthropic, rpm: Some(50), tpm: None },
            ProviderOptions::default(),
        );
        let t = p.take(Provider::read(br#"{"max_tokens":8}"#)).unwrap();
        let mut h = HeaderMap::new();
        p.headers(&mut h);
        assert_eq!(h["anthropic-ratelimit-requests-remaining"], "49");
        let reset = h["anthropic-ratelimit-requests-reset"].as_bytes();
        assert!(stormguard_http::headers::parse_rfc3339(reset).is_ok());
        let body = p.ok_body(t.asked.tokens);
        assert_eq!(stormguard_http::provider::usage(&body), Some(t.asked.tokens));
        let limited = p.limited_body(Quantity::Requests);
        assert!(String::from_utf8_lossy(&limited).contains("rate_limit_error"));
        assert!(String::from_utf8_lossy(&limited).contains("50 requests per minute"));
    }

    #[test]
    fn streams_carry_usage_the_providers_way() {
        let t = Tokens { input: 12, output: 30 };
        for kind in [ProviderKind::OpenAi, ProviderKind::Anthropic] {
            let p = Provider::new(
                ProviderConfig { kind, rpm: None, tpm: None },
                ProviderOptions::default(),
            );
            let events = p.stream_events(t);
            assert!(events.len() >= 5);
            assert!(events.iter().all(|e| e.ends_with(b"\n\n")));
            let whole: Vec<u8> = events.concat();
            assert_eq!(stormguard_http::provider::usage(&whole), Some(t), "{kind}");
        }
        assert!(Provider::read(br#"{"stream":true,"max_tokens":3}"#).stream);
        assert!(!Provider::read(br#"{"stream":"yes"}"#).stream);
    }

    #[test]
    fn split_token_limits_meter_input_and_output_apart() {
        let p = Provider::new(
            ProviderConfig { kind: ProviderKind::Anthropic, rpm: None, tpm: None },
            ProviderOptions { itpm: Some(1_000), otpm: Some(100), ..ProviderOptions::default() },
        );
        let asked = Provider::read(br#"{"max_tokens":60}"#);
        assert!(p.take(asked).is_ok());
        // 120 output tokens would pass 100: output refuses, input is given back.
        assert_eq!(p.take(asked).unwrap_err().quantity, Quantity::OutputTokens);
        let mut h = HeaderMap::new();
        p.headers(&mut h);
        let read = stormguard_http::provider::read_limits(&h);
        assert_eq!(read.output_tokens.limit, Some(100));
        assert_eq!(read.output_tokens.remaining, Some(40));
        assert_eq!(read.input_tokens.remaining, Some(1_000 - asked.tokens.input));
        assert!(!h.contains_key("anthropic-ratelimit-requests-limit"));
    }

    #[test]
    fn settings_are_checked() {
        let anthropic = ProviderConfig { kind: ProviderKind::Anthropic, rpm: None, tpm: None };
        let openai = ProviderConfig { kind: ProviderKind::OpenAi, ..anthropic };
        let split = ProviderOptions { itpm: Some(10), ..ProviderOptions::default() };
        assert!(anthropic.validate(&split).is_ok());
        let e = openai.validate(&split).unwrap_err();
        assert_eq!(e.key(), "itpm");
        assert_eq!(
            e.to_string(),
            "input and output tokens are metered apart by anthropic, not openai"
        );
        let zero = ProviderConfig { rpm: Some(0), ..openai };
        assert_eq!(zero.validate(&ProviderOptions::default()).unwrap_err().key(), "rpm");
        let rate = ProviderOptions { stream_break_rate: 1.5, ..ProviderOptions::default() };
        assert_eq!(openai.validate(&rate).unwrap_err(), ProviderError::NotAFraction { got: 1.5 });
    }
}
