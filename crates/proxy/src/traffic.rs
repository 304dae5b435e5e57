//! The per-route series: requests, attempts and refusals by dependency, upstream, route and
//! caller, with a bounded caller label.
//!
//! The dependency's own signals (in flight, slot wait, budget, breaker) are per dependency, as
//! in the library. What a proxy adds is *who* and *where*: which route's callers are being
//! refused, which caller is driving the retries. Label values are bounded: routes come from the
//! config; callers (the `client_header` value, or the peer's IP address) are admitted in
//! arrival order up to `client_max`, and every later caller is counted as `other`, so a scan
//! of random client ids cannot grow the series without end. A client id longer than
//! [`MAX_CLIENT_LABEL`] bytes is `other` too, and every label value is written escaped (a
//! quote or a backslash in a client id cannot break the exposition).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use stormguard_core::Denied;
use stormguard_tower::metrics::LabelValue;

/// The caller label of everyone past the bound.
pub const OTHER: &str = "other";

/// The longest client id that gets a label of its own, in bytes: 128. Longer ones are `other`,
/// so `client_max` labels cannot hold more than 32 × 128 bytes of caller-chosen text by
/// default.
pub const MAX_CLIENT_LABEL: usize = 128;

/// Status classes counted: 1xx..5xx.
const CLASSES: [&str; 5] = ["1xx", "2xx", "3xx", "4xx", "5xx"];

#[derive(Debug, Default, Clone)]
struct Counts {
    by_class: [u64; 5],
    attempts: u64,
    denied: [u64; Denied::ALL.len()],
}

/// Key: dependency, upstream and route labels, caller index (`usize::MAX`: other). Labels,
/// not indices, so the series go on across a reload.
type Key = (Arc<str>, Arc<str>, Arc<str>, usize);

#[derive(Debug, Default)]
struct Inner {
    clients: HashMap<String, usize>,
    names: Vec<String>,
    counts: HashMap<Key, Counts>,
}

/// The per-route counters of one proxy.
#[derive(Debug)]
pub struct Traffic {
    max_clients: usize,
    inner: Mutex<Inner>,
}

/// What one request did, for [`Traffic::count`].
#[derive(Debug, Clone, Copy)]
pub struct Finished<'a> {
    /// The dependency's name.
    pub dependency: &'a Arc<str>,
    /// Its upstream's host and port.
    pub upstream: &'a Arc<str>,
    /// The route's label (`default` when none matched).
    pub route: &'a Arc<str>,
    /// The caller.
    pub client: &'a str,
    /// The status the caller got.
    pub status: u16,
    /// Attempts sent to the upstream.
    pub attempts: u32,
    /// Why stormguard refused the request or its retry, if it did.
    pub denied: Option<Denied>,
}

impl Traffic {
    /// Counters admitting at most `max_clients` distinct callers.
    pub fn new(max_clients: usize) -> Traffic {
        Traffic { max_clients, inner: Mutex::new(Inner::default()) }
    }

    /// Counts one finished request.
    pub fn count(&self, f: Finished<'_>) {
        let mut inner = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        let client = match inner.clients.get(f.client) {
            Some(&i) => i,
            None if f.client.len() > MAX_CLIENT_LABEL => usize::MAX,
            None if inner.names.len() < self.max_clients => {
                let i = inner.names.len();
                inner.names.push(f.client.to_string());
                inner.clients.insert(f.client.to_string(), i);
                i
            }
            None => usize::MAX,
        };
        let key = (f.dependency.clone(), f.upstream.clone(), f.route.clone(), client);
        let c = inner.counts.entry(key).or_default();
        let class = usize::from(f.status / 100).clamp(1, 5) - 1;
        c.by_class[class] += 1;
        c.attempts += u64::from(f.attempts);
        if let Some(d) = f.denied {
            c.denied[d.index()] += 1;
        }
    }

    /// Distinct callers admitted to their own label.
    #[cfg(test)]
    pub fn clients(&self) -> usize {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner).names.len()
    }

    /// Encodes `stormguard_route_requests`, `stormguard_route_attempts` and
    /// `stormguard_route_denied`.
    pub(crate) fn encode(&self, enc: &mut DescriptorEncoder) -> std::fmt::Result {
        let inner = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        let mut keys: Vec<&Key> = inner.counts.keys().collect();
        keys.sort_unstable();
        let labels = |k, more| labels(&inner.names, k, more);
        {
            let mut m = enc.encode_descriptor(
                "stormguard_route_requests",
                "requests answered, by dependency, upstream, route, client and status class",
                None,
                MetricType::Counter,
            )?;
            for k in &keys {
                for (class, n) in CLASSES.iter().zip(inner.counts[*k].by_class) {
                    if n > 0 {
                        let l = labels(k, Some(("class", class)));
                        ConstCounter::new(n).encode(m.encode_family(&l)?)?;
                    }
                }
            }
        }
        {
            let mut m = enc.encode_descriptor(
                "stormguard_route_attempts",
                "attempts sent to the upstream (first tries and retries), by dependency, upstream, route and client",
                None,
                MetricType::Counter,
            )?;
            for k in &keys {
                let l = labels(k, None);
                ConstCounter::new(inner.counts[*k].attempts).encode(m.encode_family(&l)?)?;
            }
        }
        let mut m = enc.encode_descriptor(
            "stormguard_route_denied",
            "requests or retries stormguard refused, by dependency, upstream, route, client and reason",
            None,
            MetricType::Counter,
        )?;
        for k in &keys {
            for (reason, n) in Denied::ALL.iter().zip(inner.counts[*k].denied) {
                if n > 0 {
                    let l = labels(k, Some(("reason", reason.as_str())));
                    ConstCounter::new(n).encode(m.encode_family(&l)?)?;
                }
            }
        }
        Ok(())
    }
}

/// A key's labels, and one more (the status class or the reason) when given.
fn labels<'a>(
    names: &'a [String],
    k: &'a Key,
    more: Option<(&'static str, &'static str)>,
) -> Vec<(&'static str, LabelValue<'a>)> {
    let client = names.get(k.3).map_or(OTHER, String::as_str);
    let mut l = vec![
        ("dependency", LabelValue(&k.0)),
        ("upstream", LabelValue(&k.1)),
        ("route", LabelValue(&k.2)),
        ("client", LabelValue(client)),
    ];
    l.extend(more.map(|(k, v)| (k, LabelValue(v))));
    l
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn callers_past_the_bound_are_other() {
        let t = Traffic::new(2);
        let (dep, up, route): (Arc<str>, Arc<str>, Arc<str>) = ("d".into(), "u".into(), "r".into());
        for (i, client) in ["a", "b", "c", "d", "a"].into_iter().enumerate() {
            t.count(Finished {
                dependency: &dep,
                upstream: &up,
                route: &route,
                client,
                status: if i == 2 { 503 } else { 200 },
                attempts: 1,
                denied: (i == 2).then_some(Denied::Queue),
            });
        }
        assert_eq!(t.clients(), 2);
        let inner = t.inner.lock().unwrap();
        let key = |c| (dep.clone(), up.clone(), route.clone(), c);
        assert_eq!(inner.counts[&key(0)].by_class[1], 2, "a twice");
        let other = &inner.counts[&key(usize::MAX)];
        assert_eq!((other.by_class[1], other.by_class[4]), (1, 1), "c and d are other");
        assert_eq!(other.denied[Denied::Queue.index()], 1);
    }
}
