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
//! **One charge per failure.** A failure leaves one entry (ten identical calls failing at once,
//! ten); the first request that matches it takes the oldest (and is the retry); a retry that fails again, or is refused, leaves a new one, up
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
//! **Bounded.** At most [`CAPACITY`] failures a dependency (32 768), [`PER_REQUEST`] (64) of one
//! fingerprint, in [`SHARDS`] shards, each a mutex over a map from fingerprint to its failures
//! in arrival order (about 5 MiB in all when full). A full shard drops what has expired, then
//! arbitrary fingerprints down to seven eighths: a retry whose failure was dropped passes as a
//! first try (the table errs toward not charging). Per request: one hash of the fingerprint and
//! one lookup in one shard; a failure or a match, one write.

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::hash::{BuildHasher, BuildHasherDefault, Hash, Hasher};
use std::net::SocketAddr;
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use http::request::Parts;
use http::{HeaderMap, HeaderName};
use stormguard_core::budget::FailureKind;
use stormguard_tower::CallerRetry;

/// The attempts of one caller's loop, at most, as the proxy counts them: the repeats of one
/// failure are that caller's retries up to its 4th attempt (urllib3's `Retry(total=3)`; the
/// OpenAI and Anthropic SDKs, got and the AWS SDKs make 3), and an identical request after
/// that is a new call. Without it, a stream of identical requests with no identity would, once
/// the budget was spent, be refused one after another for good, each refusal the "failure" the
/// next repeats: no first try would reach the dependency to earn the budget back.
pub const LOOP_ATTEMPTS: u32 = 4;

/// Failures kept per dependency, at most.
pub const CAPACITY: usize = 32_768;
/// Failures of one fingerprint kept at most (the oldest goes first).
pub const PER_REQUEST: usize = 64;
/// Shards of the table (each its own lock).
pub const SHARDS: usize = 16;

pub use stormguard_proxy_config::{BadCallerRetries, CallerRetries};

/// How an answer left its caller.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Answered {
    /// The caller's `attempt`th attempt (1: a first try) failed with `kind`, or was refused:
    /// its retry is to come.
    Failed {
        /// The caller's attempt that failed (1: a first try).
        attempt: u32,
        /// How it failed.
        kind: FailureKind,
    },
    /// The call ended: a success, an answer nobody retries.
    Ended,
}

/// What waits in the table: a failure for its retry (`retry`: the attempt that failed and how),
/// or, beside others' failures, the end of the last call on a connection (`None`).
#[derive(Debug, Clone, Copy)]
struct Waiting {
    /// When it stops counting.
    until: Instant,
    retry: Option<(u32, FailureKind)>,
    /// The connection it came on, for a request with no identity.
    connection: Option<SocketAddr>,
}

/// One shard: the failures waiting for a retry, oldest first, by fingerprint, and how many.
#[derive(Default)]
struct Shard {
    /// Keyed by the fingerprint itself, already a hash.
    waiting: HashMap<u64, VecDeque<Waiting>, BuildHasherDefault<Prehashed>>,
    len: usize,
}

/// The hasher of a map whose keys are hashes already: the key as it is.
#[derive(Default)]
struct Prehashed(u64);

impl Hasher for Prehashed {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        // Only u64 keys come here (`write_u64`); anything else is folded in.
        for b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(*b);
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

/// One dependency's recent failures, by fingerprint. See the [module docs](self).
pub struct RecentFailures {
    keys: foldhash::quality::RandomState,
    shards: [Mutex<Shard>; SHARDS],
}

impl fmt::Debug for RecentFailures {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RecentFailures").finish_non_exhaustive()
    }
}

/// A request's fingerprint, begun from its head; the body is added once received. With no
/// identity of its own, the connection it came on.
#[derive(Clone)]
pub struct Fingerprint {
    hash: foldhash::quality::FoldHasher<'static>,
    connection: Option<SocketAddr>,
}

impl fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Fingerprint").field("connection", &self.connection).finish_non_exhaustive()
    }
}

impl Fingerprint {
    /// Adds the bytes of the body received before the attempt.
    pub fn body(&mut self, chunk: &[u8]) {
        self.hash.write(chunk);
    }

    fn finish(&self) -> u64 {
        self.hash.finish()
    }
}

/// The request's own identity, hashed into `h`: the headers a retry loop resends unchanged and
/// two users' requests do not share. Whether it has one.
fn identity(headers: &HeaderMap, h: &mut impl Hasher) -> bool {
    // Names, not text: a lookup by text parses the name first.
    static IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");
    static REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");
    static TRACEPARENT: HeaderName = HeaderName::from_static("traceparent");
    let mut found = false;
    for name in [&IDEMPOTENCY_KEY, &REQUEST_ID] {
        if let Some(v) = headers.get(name) {
            name.as_str().hash(h);
            v.as_bytes().hash(h);
            found = true;
        }
    }
    // W3C trace context: `00-<trace id>-<parent id>-<flags>`; the parent id changes per
    // attempt in an instrumented client, the trace id does not.
    if let Some(trace) = headers.get(&TRACEPARENT).and_then(|v| v.as_bytes().get(3..35)) {
        "traceparent".hash(h);
        trace.hash(h);
        found = true;
    }
    found
}

impl Default for RecentFailures {
    fn default() -> RecentFailures {
        RecentFailures::new()
    }
}

impl RecentFailures {
    /// An empty table.
    pub fn new() -> RecentFailures {
        RecentFailures {
            keys: foldhash::quality::RandomState::default(),
            shards: std::array::from_fn(|_| Mutex::default()),
        }
    }

    /// The fingerprint of a request from `caller` (its client id or address) on `connection`
    /// (its peer address and port), begun from its head. The connection counts only for a
    /// request with no identity of its own.
    pub fn fingerprint(
        &self,
        caller: &impl Hash,
        connection: SocketAddr,
        parts: &Parts,
    ) -> Fingerprint {
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
        let identified = identity(&parts.headers, &mut h);
        Fingerprint { hash: h, connection: (!identified).then_some(connection) }
    }

    fn shard(&self, key: u64) -> std::sync::MutexGuard<'_, Shard> {
        self.shards[(key as usize) % SHARDS].lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The retry a request is, when it repeats a failure within the window: the failure is
    /// taken (one charge per failure) — the oldest that came on the request's own connection;
    /// else, unless the last call on this connection ended there, the oldest of any (a pooled
    /// client may retry on another connection).
    pub fn recognise(&self, f: &Fingerprint, now: Instant) -> Option<CallerRetry> {
        let key = f.finish();
        let mut shard = self.shard(key);
        let Shard { waiting, len } = &mut *shard;
        let queue = waiting.get_mut(&key)?;
        let before = queue.len();
        queue.retain(|w| w.until > now);
        let own = |w: &Waiting| w.connection == f.connection;
        let taken = match queue.iter().position(|w| own(w) && w.retry.is_some()) {
            Some(i) => queue.remove(i),
            // A new call on a connection whose last call ended: no one else's retry.
            None => match queue.iter().position(|w| own(w) && f.connection.is_some()) {
                Some(ended) => {
                    queue.remove(ended);
                    None
                }
                None => queue.iter().position(|w| w.retry.is_some()).and_then(|i| queue.remove(i)),
            },
        };
        *len -= before - queue.len();
        if queue.is_empty() {
            waiting.remove(&key);
        }
        let (attempt, after) = taken?.retry?;
        Some(CallerRetry { attempt: attempt.saturating_add(1), after })
    }

    /// How a request's answer left its caller (see [`Answered`]); `window` is how long a
    /// failure waits for its retry. The clock is read only when something is written.
    pub fn answered(
        &self,
        f: &Fingerprint,
        answered: Answered,
        now: impl FnOnce() -> Instant,
        window: Duration,
    ) {
        const FULL: usize = CAPACITY / SHARDS;
        let retry = match answered {
            Answered::Failed { attempt, kind } if attempt < LOOP_ATTEMPTS => Some((attempt, kind)),
            _ => None,
        };
        let key = f.finish();
        let mut shard = self.shard(key);
        let Shard { waiting, len } = &mut *shard;
        // What this connection's last call ended with: replaced by what it does now.
        let ended_here = |w: &Waiting| {
            f.connection.is_some() && w.connection == f.connection && w.retry.is_none()
        };
        if retry.is_none() {
            // An ended call matters only without an identity (a request with one is its own
            // call), and only where this request's failures are kept: beside them, the next
            // request on this connection is a new call, not another's retry.
            let Some(queue) = waiting.get_mut(&key).filter(|_| f.connection.is_some()) else {
                return;
            };
            let now = now();
            let before = queue.len();
            queue.retain(|w| w.until > now && !ended_here(w));
            if queue.len() >= PER_REQUEST {
                queue.pop_front();
            }
            queue.push_back(Waiting { until: now + window, retry, connection: f.connection });
            *len = *len - before + queue.len();
            return;
        }
        let now = now();
        if *len >= FULL {
            // Swept to 7/8 at most, so the next eighth of failures do not sweep again.
            waiting.retain(|_, q| {
                q.retain(|w| w.until > now);
                !q.is_empty()
            });
            *len = waiting.values().map(VecDeque::len).sum();
            let mut over = len.saturating_sub(FULL - FULL / 8);
            let arbitrary: Vec<u64> = waiting.keys().copied().collect();
            for k in arbitrary {
                if over == 0 {
                    break;
                }
                let q = waiting.remove(&k).expect("a key just listed");
                over = over.saturating_sub(q.len());
                *len -= q.len();
            }
        }
        let queue = waiting.entry(key).or_default();
        let before = queue.len();
        // A call goes on on this connection: its ending no longer stands.
        queue.retain(|w| !ended_here(w));
        if queue.len() >= PER_REQUEST {
            queue.pop_front();
        }
        queue.push_back(Waiting { until: now + window, retry, connection: f.connection });
        *len = *len - before + queue.len();
    }

    #[cfg(test)]
    fn failed(&self, f: &Fingerprint, attempt: u32, kind: FailureKind, now: Instant, w: Duration) {
        self.answered(f, Answered::Failed { attempt, kind }, || now, w);
    }

    /// Failures held now (expired ones included until swept).
    #[cfg(test)]
    fn len(&self) -> usize {
        self.shards.iter().map(|s| s.lock().unwrap().len).sum()
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
    const CONN: SocketAddr =
        SocketAddr::new(std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST), 40_000);

    #[test]
    fn a_repeat_of_a_failure_is_one_retry_and_a_success_leaves_nothing() {
        let t = RecentFailures::new();
        let now = Instant::now();
        let f = t.fingerprint(&"10.0.0.1", CONN, &parts("http://a/x?q=1", &[]));
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
        // Ten calls failing at once leave ten retries, one each, whatever order they come in.
        for _ in 0..10 {
            t.failed(&f, 1, FailureKind::Error, now, W);
        }
        assert_eq!((0..12).filter(|_| t.recognise(&f, now).is_some()).count(), 10);
        // Past the window it is no retry.
        t.failed(&f, 1, FailureKind::Error, now, W);
        assert_eq!(t.recognise(&f, now + W), None);
    }

    #[test]
    fn what_tells_requests_apart() {
        let t = RecentFailures::new();
        let now = Instant::now();
        let base = t.fingerprint(&"10.0.0.1", CONN, &parts("http://a/x", &[]));
        t.failed(&base, 1, FailureKind::Error, now, W);
        let differ = [
            t.fingerprint(&"10.0.0.2", CONN, &parts("http://a/x", &[])),
            t.fingerprint(&"10.0.0.1", CONN, &parts("http://b/x", &[])),
            t.fingerprint(&"10.0.0.1", CONN, &parts("http://a/y", &[])),
            t.fingerprint(&"10.0.0.1", CONN, &parts("http://a/x?p", &[])),
            t.fingerprint(&"10.0.0.1", CONN, &parts("http://a/x", &[("x-request-id", "r1")])),
            t.fingerprint(&"10.0.0.1", CONN, &parts("http://a/x", &[("idempotency-key", "k")])),
        ];
        for f in &differ {
            assert_eq!(t.recognise(f, now), None);
        }
        let mut body = t.fingerprint(&"10.0.0.1", CONN, &parts("http://a/x", &[]));
        body.body(b"{}");
        assert_eq!(t.recognise(&body, now), None);
        // With no identity, a failure on the request's own connection is taken first, then
        // another's (a pooled client may retry on another connection).
        let fresh = RecentFailures::new();
        let other = SocketAddr::new(CONN.ip(), 40_001);
        let on = |conn| fresh.fingerprint(&"10.0.0.1", conn, &parts("http://a/x", &[]));
        fresh.failed(&on(other), 2, FailureKind::Error, now, W);
        fresh.failed(&on(CONN), 3, FailureKind::Error, now, W);
        assert_eq!(fresh.recognise(&on(other), now).unwrap().attempt, 3);
        assert_eq!(fresh.recognise(&on(other), now).unwrap().attempt, 4);
        assert_eq!(fresh.recognise(&on(other), now), None);
        // A call that ended on a connection: the next request there is a new call, not another
        // connection's retry.
        fresh.failed(&on(other), 1, FailureKind::Error, now, W);
        fresh.answered(&on(CONN), Answered::Ended, || now, W);
        assert_eq!(fresh.recognise(&on(CONN), now), None);
        assert_eq!(fresh.recognise(&on(other), now).unwrap().attempt, 2);
        // A loop's last attempt ends its call too.
        fresh.failed(&on(other), 1, FailureKind::Error, now, W);
        fresh.failed(&on(CONN), LOOP_ATTEMPTS, FailureKind::Error, now, W);
        assert_eq!(fresh.recognise(&on(CONN), now), None);
        // Without the end, it takes the other's.
        assert_eq!(fresh.recognise(&on(CONN), now).unwrap().attempt, 2);
        // A trace's parent id changes per attempt, its trace id does not.
        let tp = |parent: &str| {
            let v = format!("00-4bf92f3577b34da6a3ce929d0e0e4736-{parent}-01");
            t.fingerprint(&"10.0.0.1", CONN, &parts("http://a/x", &[("traceparent", &v)]))
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
            let f = t.fingerprint(&i, CONN, &parts("http://a/x", &[]));
            t.failed(&f, 1, FailureKind::Error, now, W);
        }
        assert!(t.len() <= CAPACITY, "{}", t.len());
        // Expired entries go first: after the window, new failures push out only old ones.
        let later = now + W;
        let new: Vec<_> = (0..CAPACITY / 2)
            .map(|i| t.fingerprint(&("new", i), CONN, &parts("http://a/x", &[])))
            .collect();
        for f in &new {
            t.failed(f, 1, FailureKind::Error, later, W);
        }
        assert!(t.len() <= CAPACITY, "{}", t.len());
        assert!(new.iter().all(|f| t.recognise(f, later).is_some()));
    }
}
