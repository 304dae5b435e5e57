//! chaos as a model provider: an OpenAI- or Anthropic-shaped API with requests and tokens per
//! minute, metered the way those providers describe theirs, so stormguard's rate admission can
//! be shown against something that behaves like the real thing.
//!
//! Each request's tokens are counted from its body (input by size, output its `max_tokens` /
//! `max_completion_tokens`, as [`stormguard_http::provider::estimate`] reads them); a request
//! that would pass a limit is answered 429 with the provider's error body, `retry-after`
//! (seconds) and `retry-after-ms`. Every answer carries the provider's own headers — OpenAI's
//! `x-ratelimit-{limit,remaining,reset}-{requests,tokens}` (resets as Go durations, `1s`,
//! `6m0s`), Anthropic's `anthropic-ratelimit-{requests,tokens}-{limit,remaining,reset}` (resets as
//! RFC 3339 instants) — and a 200 carries `usage` in its JSON body. The buckets are core's
//! [`RateLimit`]: a full bucket of the limit, refilled continuously over a minute.

use std::fmt;
use std::str::FromStr;
use std::time::{Duration, Instant, SystemTime};

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue};
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

/// The provider chaos plays: its shape and its limits per minute.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProviderConfig {
    /// The shape.
    pub kind: ProviderKind,
    /// Requests per minute; `None`: unlimited.
    pub rpm: Option<u64>,
    /// Tokens per minute (input and output together); `None`: unlimited.
    pub tpm: Option<u64>,
}

/// The provider's state while chaos serves.
#[derive(Debug)]
pub(crate) struct Provider {
    config: ProviderConfig,
    requests: RateLimit,
    tokens: RateLimit,
    origin: Instant,
}

/// A request the provider took: its tokens, and their place in the buckets.
#[derive(Debug)]
pub(crate) struct Taken {
    pub(crate) tokens: Tokens,
    _request: RatePermit,
    _tokens: RatePermit,
}

const MINUTE: Duration = Duration::from_secs(60);

impl Provider {
    pub(crate) fn new(config: ProviderConfig) -> Provider {
        Provider {
            config,
            requests: RateLimit::new(RateConfig { limit: config.rpm, window: MINUTE }),
            tokens: RateLimit::new(RateConfig { limit: config.tpm, window: MINUTE }),
            origin: Instant::now(),
        }
    }

    fn now(&self) -> Timestamp {
        Timestamp::from_nanos(u64::try_from(self.origin.elapsed().as_nanos()).unwrap_or(u64::MAX))
    }

    /// Takes a request with `body` from both buckets, or says how long until it would fit.
    pub(crate) fn take(&self, body: &[u8]) -> Result<Taken, Duration> {
        let now = self.now();
        let tokens = estimate(body, Estimator { bytes_per_token: 4, default_output: 16 });
        let request = self.requests.try_acquire(now, 1).map_err(|w| w.wait)?;
        match self.tokens.try_acquire(now, tokens.total()) {
            Ok(t) => Ok(Taken { tokens, _request: request, _tokens: t }),
            Err(w) => {
                // Not sent: the request's unit goes back.
                request.settle(now, Some(0));
                Err(w.wait)
            }
        }
    }

    /// The provider's rate-limit headers, on every answer.
    pub(crate) fn headers(&self, h: &mut HeaderMap) {
        let now = self.now();
        for (what, limit, bucket) in [
            ("requests", self.config.rpm, &self.requests),
            ("tokens", self.config.tpm, &self.tokens),
        ] {
            let Some(limit) = limit else { continue };
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
        let body = match self.config.kind {
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
        };
        Bytes::from(serde_json::to_vec(&body).unwrap_or_default())
    }

    /// A 429's JSON body, as the provider writes it.
    pub(crate) fn limited_body(&self) -> Bytes {
        let body = match self.config.kind {
            ProviderKind::OpenAi => serde_json::json!({"error": {
                "message": "Rate limit reached (chaos)", "type": "requests",
                "param": null, "code": "rate_limit_exceeded"}}),
            ProviderKind::Anthropic => serde_json::json!({"type": "error", "error": {
                "type": "rate_limit_error", "message": "Rate limit reached (chaos)"}}),
        };
        Bytes::from(serde_json::to_vec(&body).unwrap_or_default())
    }
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
        let p = Provider::new(ProviderConfig {
            kind: ProviderKind::OpenAi,
            rpm: Some(600),
            tpm: Some(1_000),
        });
        let body = br#"{"max_tokens":400,"messages":[]}"#;
        let a = p.take(body).unwrap();
        assert_eq!(a.tokens.output, 400);
        let _b = p.take(body).unwrap();
        // The third would pass 1000 tokens: a wait, and its request unit is not spent.
        assert!(p.take(body).is_err());
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
        let p = Provider::new(ProviderConfig {
            kind: ProviderKind::Anthropic,
            rpm: Some(50),
            tpm: None,
        });
        let t = p.take(br#"{"max_tokens":8}"#).unwrap();
        let mut h = HeaderMap::new();
        p.headers(&mut h);
        assert_eq!(h["anthropic-ratelimit-requests-remaining"], "49");
        let reset = h["anthropic-ratelimit-requests-reset"].as_bytes();
        assert!(stormguard_http::headers::parse_rfc3339(reset).is_ok());
        let body = p.ok_body(t.tokens);
        assert_eq!(stormguard_http::provider::usage(&body), Some(t.tokens));
        assert!(String::from_utf8_lossy(&p.limited_body()).contains("rate_limit_error"));
    }
}
