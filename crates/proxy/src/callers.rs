//! Callers' own retries, seen through the sidecar.
//!
//! A caller that retries by itself (urllib3's `Retry`, a hand-written loop, an SDK) sends each
//! retry as a new request: without this, every one reaches the dependency as a first try, and
//! the budget never hears of it. The proxy recognises a caller's retry in two ways:
//!
//! - **marked**: it arrived marked as a retry by the layer that sent it (`x-stormguard-attempt`
//!   or `x-envoy-attempt-count` above 1, `grpc-previous-rpc-attempts` above 0, as the stacked
//!   rule reads them);
//! - **fingerprinted**: its fingerprint — the caller (client id, else address), method,
//!   authority, path and query, a digest of the body received before the attempt (the whole
//!   body up to `body_limit`), and the request's own identity where it carries one
//!   (`Idempotency-Key`, the trace id of `traceparent`, `x-request-id`) — matches an answer of
//!   the same dependency that failed (a failure in `retry_on`) or was refused, within
//!   `client_retry_window` (10 s).
//!
//! **One charge per failure.** A failure leaves one entry; the first request that matches it
//! takes it (and is the retry); a retry that fails again, or is refused, leaves a new one, up
//! to a loop's [`LOOP_ATTEMPTS`] (4) attempts: the next identical request is a new call. A
//! success leaves nothing, so a caller that repeats a request after a success (polling) is
//! never charged. Two
//! users' identical requests are told apart by their identity when they carry one (a distinct
//! `traceparent` or request id makes a distinct fingerprint). With no identity on the wire and
//! one caller address for both, a user's identical request inside the window after another's
//! failure is the one charged, in place of the retry that follows: the count of retries charged
//! stays the count of failures repeated, never more, but which request pays may be wrong — with
//! the budget spent, up to three identical requests after a failure are refused before the
//! fourth goes as a first try.
//!
//! **Bounded.** At most [`CAPACITY`] fingerprints a dependency, in [`SHARDS`] shards (each a
//! mutex over a map of 32-byte entries: about 3 MiB in all when full). A full shard drops what
//! has expired, then arbitrary entries down to seven eighths: a retry whose failure was dropped
//! passes as a first try (the table errs toward not charging). Per request: one hash of the
//! fingerprint and one lookup in one shard; a failure or a match, one write.

use std::collections::HashMap;
use std::fmt;
use std::hash::{BuildHasher, Hash, Hasher, RandomState};
use std::str::FromStr;
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use http::HeaderMap;
use http::request::Parts;
use stormguard_core::budget::FailureKind;
use stormguard_tower::CallerRetry;

/// The attempts of one caller's loop, at most, as the proxy counts them: the repeats of one
/// failure are that caller's retries up to its 4th attempt (urllib3's `Retry(total=3)`; the
/// OpenAI and Anthropic SDKs, got and the AWS SDKs make 3), and an identical request after
/// that is a new call. Without it, a stream of identical requests with no identity would, once
/// the budget was spent, be refused one after another for good, each refusal the "failure" the
/// next repeats: no first try would reach the dependency to earn the budget back.
pub(crate) const LOOP_ATTEMPTS: u32 = 4;

/// Fingerprints kept per dependency, at most.
pub(crate) const CAPACITY: usize = 65_536;
/// Shards of the table (each its own lock).
pub(crate) const SHARDS: usize = 16;

/// What the proxy does with a caller's own retries (`caller_retries`, per dependency).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CallerRetries {
    /// Charged to the budget and admitted like stormguard's own retries: refused at once when
    /// none is left (the default: a sidecar's point is a budget that holds whatever the
    /// caller's loop does).
    #[default]
    Enforce,
    /// Recognised and counted (`stormguard_caller_retries_total{outcome="counted"}`), sent as
    /// first tries: to measure before enforcing.
    Count,
    /// Not looked for: every request is a first try.
    Off,
}

impl CallerRetries {
    /// The value as the config writes it.
    pub fn as_str(self) -> &'static str {
        match self {
            CallerRetries::Enforce => "enforce",
            CallerRetries::Count => "count",
            CallerRetries::Off => "off",
        }
    }
}

impl fmt::Display for CallerRetries {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A `caller_retries` value that is none of the three.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("expected \"enforce\", \"count\" or \"off\", got {0:?}")]
pub struct BadCallerRetries(String);

impl FromStr for CallerRetries {
    type Err = BadCallerRetries;
    fn from_str(s: &str) -> Result<CallerRetries, BadCallerRetries> {
        match s {
            "enforce" => Ok(CallerRetries::Enforce),
            "count" => Ok(CallerRetries::Count),
            "off" => Ok(CallerRetries::Off),
            other => Err(BadCallerRetries(other.to_string())),
        }
    }
}

/// An answer that failed or was refused, waiting for the caller's retry.
#[derive(Debug, Clone, Copy)]
struct Failed {
    /// When it stops counting.
    until: Instant,
    /// The caller's attempt that failed (1: a first try).
    attempt: u32,
    kind: FailureKind,
}

/// One dependency's recent failures, by fingerprint. See the [module docs](self).
pub(crate) struct RecentFailures {
    keys: RandomState,
    shards: [Mutex<HashMap<u64, Failed>>; SHARDS],
}

impl fmt::Debug for RecentFailures {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RecentFailures").finish_non_exhaustive()
    }
}

/// A request's fingerprint, begun from its head; the body is added once received.
pub(crate) struct Fingerprint(std::hash::DefaultHasher);

impl Fingerprint {
    /// Adds the bytes of the body received before the attempt.
    pub(crate) fn body(&mut self, chunk: &[u8]) {
        self.0.write(chunk);
    }

    fn finish(&self) -> u64 {
        self.0.finish()
    }
}

/// The request's own identity: the headers a retry loop resends unchanged and two users'
/// requests do not share.
fn identity(headers: &HeaderMap, h: &mut impl Hasher) {
    for name in ["idempotency-key", "x-request-id"] {
        if let Some(v) = headers.get(name) {
            name.hash(h);
            v.as_bytes().hash(h);
        }
    }
    // W3C trace context: `00-<trace id>-<parent id>-<flags>`; the parent id changes per
    // attempt in an instrumented client, the trace id does not.
    if let Some(trace) = headers.get("traceparent").and_then(|v| v.as_bytes().get(3..35)) {
        "traceparent".hash(h);
        trace.hash(h);
    }
}

impl RecentFailures {
    pub(crate) fn new() -> RecentFailures {
        RecentFailures {
            keys: RandomState::new(),
            shards: std::array::from_fn(|_| Mutex::new(HashMap::new())),
        }
    }

    /// The fingerprint of a request from `caller` (its client id or address, as text or bytes),
    /// begun from its head.
    pub(crate) fn fingerprint(&self, caller: &impl Hash, parts: &Parts) -> Fingerprint {
        let mut h = self.keys.build_hasher();
        caller.hash(&mut h);
        parts.method.as_str().hash(&mut h);
        let authority = parts
            .uri
            .authority()
            .map(|a| a.as_str().as_bytes())
            .or_else(|| parts.headers.get(http::header::HOST).map(|v| v.as_bytes()));
        authority.hash(&mut h);
        parts.uri.path_and_query().map(|p| p.as_str()).hash(&mut h);
        identity(&parts.headers, &mut h);
        Fingerprint(h)
    }

    fn shard(&self, key: u64) -> std::sync::MutexGuard<'_, HashMap<u64, Failed>> {
        self.shards[(key as usize) % SHARDS].lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The retry a request is, when it repeats a failure within the window (the failure is
    /// taken: one charge per failure).
    pub(crate) fn recognise(&self, f: &Fingerprint, now: Instant) -> Option<CallerRetry> {
        let key = f.finish();
        let mut shard = self.shard(key);
        let failed = shard.remove(&key)?;
        (failed.until > now)
            .then(|| CallerRetry { attempt: failed.attempt.saturating_add(1), after: failed.kind })
    }

    /// The caller's `attempt`th attempt failed (or was refused) with `kind`: its retry within
    /// `window` is recognised.
    pub(crate) fn failed(
        &self,
        f: &Fingerprint,
        attempt: u32,
        kind: FailureKind,
        now: Instant,
        window: Duration,
    ) {
        const FULL: usize = CAPACITY / SHARDS;
        let key = f.finish();
        let mut shard = self.shard(key);
        if attempt >= LOOP_ATTEMPTS {
            // The loop's last attempt: what repeats it is a new call.
            shard.remove(&key);
            return;
        }
        if shard.len() >= FULL && !shard.contains_key(&key) {
            // Swept to 7/8 at most, so the next eighth of inserts do not sweep again.
            shard.retain(|_, f| f.until > now);
            let over = shard.len().saturating_sub(FULL - FULL / 8);
            let arbitrary: Vec<u64> = shard.keys().take(over).copied().collect();
            for k in arbitrary {
                shard.remove(&k);
            }
        }
        shard.insert(key, Failed { until: now + window, attempt, kind });
    }

    /// Fingerprints held now (expired ones included until swept).
    #[cfg(test)]
    fn len(&self) -> usize {
        self.shards.iter().map(|s| s.lock().unwrap().len()).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parts(uri: &str, headers: &[(&str, &str)]) -> Parts {
        let mut b = http::Request::builder().uri(uri);
        for (k, v) in headers {
            b = b.header(*k, *v);
        }
        b.body(()).unwrap().into_parts().0
    }

    const W: Duration = Duration::from_secs(10);

    #[test]
    fn a_repeat_of_a_failure_is_one_retry_and_a_success_leaves_nothing() {
        let t = RecentFailures::new();
        let now = Instant::now();
        let f = t.fingerprint(&"10.0.0.1", &parts("http://a/x?q=1", &[]));
        assert_eq!(t.recognise(&f, now), None, "nothing failed yet");
        t.failed(&f, 1, FailureKind::Error, now, W);
        let r = t.recognise(&f, now + Duration::from_secs(1)).unwrap();
        assert_eq!((r.attempt, r.after), (2, FailureKind::Error));
        // Taken: the next identical request is a first try, unless this one fails too.
        assert_eq!(t.recognise(&f, now), None);
        t.failed(&f, 2, FailureKind::Timeout, now, W);
        assert_eq!(t.recognise(&f, now).unwrap().attempt, 3);
        // After a loop's last attempt, the same request is a new call.
        t.failed(&f, 3, FailureKind::Error, now, W);
        assert_eq!(t.recognise(&f, now).unwrap().attempt, LOOP_ATTEMPTS);
        t.failed(&f, LOOP_ATTEMPTS, FailureKind::Error, now, W);
        assert_eq!(t.recognise(&f, now), None);
        // Past the window it is no retry.
        t.failed(&f, 1, FailureKind::Error, now, W);
        assert_eq!(t.recognise(&f, now + W), None);
    }

    #[test]
    fn what_tells_requests_apart() {
        let t = RecentFailures::new();
        let now = Instant::now();
        let base = t.fingerprint(&"10.0.0.1", &parts("http://a/x", &[]));
        t.failed(&base, 1, FailureKind::Error, now, W);
        let differ = [
            t.fingerprint(&"10.0.0.2", &parts("http://a/x", &[])),
            t.fingerprint(&"10.0.0.1", &parts("http://b/x", &[])),
            t.fingerprint(&"10.0.0.1", &parts("http://a/y", &[])),
            t.fingerprint(&"10.0.0.1", &parts("http://a/x?p", &[])),
            t.fingerprint(&"10.0.0.1", &parts("http://a/x", &[("x-request-id", "r1")])),
            t.fingerprint(&"10.0.0.1", &parts("http://a/x", &[("idempotency-key", "k")])),
        ];
        for f in &differ {
            assert_eq!(t.recognise(f, now), None);
        }
        let mut body = t.fingerprint(&"10.0.0.1", &parts("http://a/x", &[]));
        body.body(b"{}");
        assert_eq!(t.recognise(&body, now), None);
        // A trace's parent id changes per attempt, its trace id does not.
        let tp = |parent: &str| {
            let v = format!("00-4bf92f3577b34da6a3ce929d0e0e4736-{parent}-01");
            t.fingerprint(&"10.0.0.1", &parts("http://a/x", &[("traceparent", &v)]))
        };
        t.failed(&tp("00f067aa0ba902b7"), 1, FailureKind::Error, now, W);
        assert!(t.recognise(&tp("b7ad6b7169203331"), now).is_some());
        assert!(t.recognise(&base, now).is_some(), "the first one is still there");
    }

    #[test]
    fn the_table_is_bounded() {
        let t = RecentFailures::new();
        let now = Instant::now();
        for i in 0..CAPACITY * 2 {
            let f = t.fingerprint(&i, &parts("http://a/x", &[]));
            t.failed(&f, 1, FailureKind::Error, now, W);
        }
        assert!(t.len() <= CAPACITY, "{}", t.len());
        // Expired entries go first: after the window, new failures push out only old ones.
        let later = now + W;
        let new: Vec<_> = (0..CAPACITY / 2)
            .map(|i| t.fingerprint(&("new", i), &parts("http://a/x", &[])))
            .collect();
        for f in &new {
            t.failed(f, 1, FailureKind::Error, later, W);
        }
        assert!(t.len() <= CAPACITY, "{}", t.len());
        assert!(new.iter().all(|f| t.recognise(f, later).is_some()));
    }
}
