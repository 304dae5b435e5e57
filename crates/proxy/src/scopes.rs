//! Fan-out scopes keyed by trace id: one user action's calls share `scope_retries` retries.
//!
//! In the proxy the calls of one action arrive as separate requests, so the scope is found by
//! the W3C `traceparent` trace id (or a configured header) in a bounded table: at most
//! `max` entries, least recently used first out, and an entry idle for 10 s is forgotten.
//! A request with no key gets no scope.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use http::{HeaderMap, HeaderName};
use stormguard_core::scope::FanOutScope;

/// How long an unused scope is remembered.
pub const IDLE: Duration = Duration::from_secs(10);

/// The scope table of one dependency.
#[derive(Debug)]
pub struct TraceScopes {
    header: HeaderName,
    retries: u64,
    max: usize,
    inner: Mutex<Table>,
}

#[derive(Debug, Default)]
struct Table {
    /// key → (scope, last use, its tick in `order`).
    entries: HashMap<String, (FanOutScope, Instant, u64)>,
    /// tick → key, oldest use first.
    order: BTreeMap<u64, String>,
    tick: u64,
}

impl TraceScopes {
    /// A table of at most `max` scopes of `retries` retries each, keyed by `header`.
    pub fn new(header: HeaderName, retries: u64, max: usize) -> TraceScopes {
        TraceScopes { header, retries, max: max.max(1), inner: Mutex::new(Table::default()) }
    }

    /// The key of a request: the trace id of `traceparent` (`00-<32 hex>-<16 hex>-<2 hex>`;
    /// a malformed or all-zero one gives none), or any other configured header whole.
    pub fn key(&self, headers: &HeaderMap) -> Option<String> {
        let v = headers.get(&self.header)?.to_str().ok()?.trim();
        if self.header.as_str() != "traceparent" {
            return (!v.is_empty() && v.len() <= 256).then(|| v.to_string());
        }
        let mut parts = v.split('-');
        let (_version, trace) = (parts.next()?, parts.next()?);
        let ok = trace.len() == 32
            && trace.bytes().all(|b| b.is_ascii_hexdigit())
            && trace.bytes().any(|b| b != b'0');
        ok.then(|| trace.to_ascii_lowercase())
    }

    /// The scope for the request's key, made on first use; `None` without a key or when
    /// scopes are off (`scope_retries = 0`).
    pub fn scope_for(&self, headers: &HeaderMap, now: Instant) -> Option<FanOutScope> {
        if self.retries == 0 {
            return None;
        }
        let key = self.key(headers)?;
        let mut t = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        t.expire(now);
        t.tick += 1;
        let tick = t.tick;
        let scope = match t.entries.get_mut(&key) {
            Some((scope, last, old)) => {
                let (scope, old_tick) = (scope.clone(), *old);
                *last = now;
                *old = tick;
                t.order.remove(&old_tick);
                scope
            }
            None => {
                let scope = FanOutScope::new(self.retries);
                t.entries.insert(key.clone(), (scope.clone(), now, tick));
                scope
            }
        };
        t.order.insert(tick, key);
        while t.entries.len() > self.max {
            t.pop_oldest();
        }
        Some(scope)
    }

    /// Scopes remembered now.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.inner.lock().unwrap_or_else(|e| e.into_inner()).entries.len()
    }
}

impl Table {
    fn pop_oldest(&mut self) {
        if let Some((_, key)) = self.order.pop_first() {
            self.entries.remove(&key);
        }
    }

    fn expire(&mut self, now: Instant) {
        while let Some((_, key)) = self.order.first_key_value() {
            let idle =
                self.entries.get(key).is_none_or(|(_, last, _)| now.duration_since(*last) >= IDLE);
            if !idle {
                break;
            }
            self.pop_oldest();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tp(trace: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert("traceparent", format!("00-{trace}-00f067aa0ba902b7-01").parse().unwrap());
        h
    }

    const A: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
    const B: &str = "5bf92f3577b34da6a3ce929d0e0e4736";
    const C: &str = "6bf92f3577b34da6a3ce929d0e0e4736";

    #[test]
    fn one_scope_per_trace_bounded_and_expiring() {
        let s = TraceScopes::new(HeaderName::from_static("traceparent"), 1, 2);
        let t0 = Instant::now();
        let a = s.scope_for(&tp(A), t0).unwrap();
        assert!(a.try_charge().is_some());
        // The same trace shares the spent scope.
        assert!(s.scope_for(&tp(A), t0).unwrap().try_charge().is_none());
        s.scope_for(&tp(B), t0).unwrap();
        // A third trace evicts the least recently used (A).
        s.scope_for(&tp(C), t0).unwrap();
        assert_eq!(s.len(), 2);
        assert!(s.scope_for(&tp(A), t0).unwrap().try_charge().is_some(), "A was forgotten");
        // Idle entries expire.
        s.scope_for(&tp(B), t0 + IDLE + Duration::from_secs(1)).unwrap();
        assert_eq!(s.len(), 1);
        // No key, a malformed key, or the all-zero trace id: no scope.
        assert!(s.scope_for(&HeaderMap::new(), t0).is_none());
        assert!(s.scope_for(&tp("xyz"), t0).is_none());
        assert!(s.scope_for(&tp(&"0".repeat(32)), t0).is_none());
    }
}
