//! Retries stacked across layers: a request that arrives already marked as a retry.
//!
//! When a client library, a sidecar and a gateway each retry twice, one user request can become
//! 27 attempts. The layer nearest the dependency should retry, and the ones above it should not
//! retry a retry. A request is marked by the layer that retried it: stormguard sets
//! `x-stormguard-attempt` on every attempt it sends (1 for the first), Envoy sets
//! `x-envoy-attempt-count`, gRPC clients set `grpc-previous-rpc-attempts` on retries, and the
//! Stainless-generated SDKs (OpenAI's, Anthropic's) count theirs in `x-stainless-retry-count`. A
//! request that arrives with one of these past its first attempt is *stacked*, and the retry
//! decision refuses it with `stacked` (configurable).
//!
//! ```
//! use http::HeaderMap;
//! use stormguard_http::stacked::{StackedHeaders, mark_attempt};
//!
//! let detect = StackedHeaders::default();
//! let mut headers = HeaderMap::new();
//! assert!(!detect.arrived_as_retry(&headers));
//! mark_attempt(&mut headers, 2);
//! assert!(detect.arrived_as_retry(&headers));
//! ```

use http::HeaderMap;
use http::header::{HeaderName, HeaderValue};

/// The header stormguard sets on each attempt it sends: 1 for the first, 2 for the first retry.
pub static ATTEMPT_HEADER: HeaderName = HeaderName::from_static("x-stormguard-attempt");

/// How a header marks a retry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Marker {
    /// The header counts attempts (1 = first try): a retry when above 1.
    AttemptCount(HeaderName),
    /// The header counts attempts before this one: a retry when above 0.
    PreviousAttempts(HeaderName),
}

/// The headers that mark a request as already retried by another layer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StackedHeaders {
    /// The markers looked for. Default: `x-stormguard-attempt` and `x-envoy-attempt-count`
    /// (attempt counts), `grpc-previous-rpc-attempts` (previous attempts, per gRFC A6) and
    /// `x-stainless-retry-count` (retries before this one, sent by the OpenAI and Anthropic SDKs
    /// and the other Stainless-generated ones).
    pub markers: Vec<Marker>,
}

impl Default for StackedHeaders {
    fn default() -> Self {
        StackedHeaders {
            markers: vec![
                Marker::AttemptCount(ATTEMPT_HEADER.clone()),
                Marker::AttemptCount(HeaderName::from_static("x-envoy-attempt-count")),
                Marker::PreviousAttempts(HeaderName::from_static("grpc-previous-rpc-attempts")),
                Marker::PreviousAttempts(HeaderName::from_static("x-stainless-retry-count")),
            ],
        }
    }
}

/// The count a marker header carries: its leading number (`2`, or `2; hedge`).
fn number(headers: &HeaderMap, name: &HeaderName) -> Option<u64> {
    let v = headers.get(name)?.to_str().ok()?;
    let n = v.split_once(';').map_or(v, |(n, _)| n);
    n.trim().parse().ok()
}

impl StackedHeaders {
    /// Whether the request arrived already marked as a retry. A malformed value marks nothing.
    pub fn arrived_as_retry(&self, headers: &HeaderMap) -> bool {
        self.attempt(headers).is_some()
    }

    /// The attempt a request marked as a retry says it is (2 for a first retry; the highest
    /// when several markers say), or `None` when it is not marked as one.
    pub fn attempt(&self, headers: &HeaderMap) -> Option<u64> {
        retry_attempt(self.stated_attempt(headers))
    }

    /// The attempt the request's markers state, first tries included (`x-stormguard-attempt:
    /// 1`, `x-stainless-retry-count: 0`): `Some` when its sender numbers its attempts. `None`
    /// when no marker is there (a gRPC client marks only its retries).
    pub fn stated_attempt(&self, headers: &HeaderMap) -> Option<u64> {
        self.markers
            .iter()
            .filter_map(|m| match m {
                Marker::AttemptCount(name) => number(headers, name),
                Marker::PreviousAttempts(name) => {
                    number(headers, name).map(|n| n.saturating_add(1))
                }
            })
            .max()
    }
}

/// The attempt a stated attempt ([`StackedHeaders::stated_attempt`]) is as a retry: above the
/// first, or `None`. For a caller that reads the markers once for both questions.
pub fn retry_attempt(stated: Option<u64>) -> Option<u64> {
    stated.filter(|&n| n > 1)
}

/// Sets `x-stormguard-attempt: attempt` (1 for the first try) on an outgoing request.
pub fn mark_attempt(headers: &mut HeaderMap, attempt: u32) {
    // Static values for the usual attempt numbers: no allocation on the hot path.
    const SMALL: [&str; 11] = ["0", "1", "2", "3", "4", "5", "6", "7", "8", "9", "10"];
    let value = match SMALL.get(attempt as usize) {
        Some(s) => HeaderValue::from_static(s),
        None => HeaderValue::from(attempt),
    };
    headers.insert(ATTEMPT_HEADER.clone(), value);
}

/// Sets `x-stormguard-attempt: attempt; hedge` on a hedge (a second attempt sent beside one
/// not answered yet), so an upstream, or chaos, can count hedges apart from retries. It still
/// counts as attempt `attempt` for the stacking rule.
pub fn mark_hedge(headers: &mut HeaderMap, attempt: u32) {
    let value = match attempt {
        2 => HeaderValue::from_static("2; hedge"),
        3 => HeaderValue::from_static("3; hedge"),
        n => HeaderValue::from_str(&format!("{n}; hedge")).unwrap_or(HeaderValue::from(n)),
    };
    headers.insert(ATTEMPT_HEADER.clone(), value);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_first_try_states_its_attempt_and_is_no_retry() {
        let d = StackedHeaders::default();
        let mut h = HeaderMap::new();
        assert_eq!(d.stated_attempt(&h), None, "unnumbered");
        h.insert("x-stainless-retry-count", HeaderValue::from_static("0"));
        assert_eq!((d.stated_attempt(&h), d.attempt(&h)), (Some(1), None));
        h.insert("grpc-previous-rpc-attempts", HeaderValue::from_static("2"));
        assert_eq!((d.stated_attempt(&h), d.attempt(&h)), (Some(3), Some(3)));
    }

    fn with(name: &'static str, value: &'static str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(name, HeaderValue::from_static(value));
        h
    }

    #[test]
    fn markers() {
        let d = StackedHeaders::default();
        assert!(!d.arrived_as_retry(&with("x-stormguard-attempt", "1")));
        assert!(d.arrived_as_retry(&with("x-stormguard-attempt", "2")));
        assert!(!d.arrived_as_retry(&with("x-envoy-attempt-count", "1")));
        assert!(d.arrived_as_retry(&with("x-envoy-attempt-count", "3")));
        assert!(!d.arrived_as_retry(&with("grpc-previous-rpc-attempts", "0")));
        assert!(d.arrived_as_retry(&with("grpc-previous-rpc-attempts", "1")));
        for junk in ["", "two", "-3", "99999999999999999999999"] {
            assert!(!d.arrived_as_retry(&with("x-envoy-attempt-count", junk)), "{junk}");
        }
        let none = StackedHeaders { markers: vec![] };
        assert!(!none.arrived_as_retry(&with("x-envoy-attempt-count", "5")));
    }
}
