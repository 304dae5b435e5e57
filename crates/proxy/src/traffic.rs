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

use std::collections::{BTreeMap, HashMap};
use std::hash::{BuildHasherDefault, Hasher};
use std::net::IpAddr;
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

impl Counts {
    fn add(&mut self, other: &Counts) {
        self.by_class.iter_mut().zip(other.by_class).for_each(|(a, b)| *a += b);
        self.attempts += other.attempts;
        self.denied.iter_mut().zip(other.denied).for_each(|(a, b)| *a += b);
    }
}

/// The fast key: the dependency, upstream and route labels *by identity* (the `Arc`s a
/// configuration generation holds), and the caller's index (`usize::MAX`: other). Counting
/// hashes four words and clones nothing.
type Key = (usize, usize, usize, usize);

/// A series' labels by text, and the caller's index: what the export names.
type Labels = (Arc<str>, Arc<str>, Arc<str>, usize);

/// A fast key's target: the series, and the labels it was made from, held so that their
/// addresses are not reused while the key exists.
#[derive(Debug)]
struct Alias {
    series: usize,
    held: [Arc<str>; 3],
}

/// A word hasher for the keys (addresses and indices): one multiply and rotate per word (the
/// Fx hash), where the default SipHash spends tens of nanoseconds on a request's four words.
#[derive(Debug, Default, Clone, Copy)]
struct WordHasher(u64);

impl Hasher for WordHasher {
    fn finish(&self) -> u64 {
        // The product's high bits are the well-mixed ones; the table indexes by the low bits.
        self.0.rotate_left(26)
    }

    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut word = [0u8; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            self.write_u64(u64::from_le_bytes(word));
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0.rotate_left(5) ^ n).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
    }

    fn write_usize(&mut self, n: usize) {
        self.write_u64(n as u64);
    }
}

type Words = BuildHasherDefault<WordHasher>;

#[derive(Debug, Default)]
struct Inner {
    /// Callers named by their address (no `client_header`), and by a header's value: keyed by
    /// what callers choose, so hashed with the default, seeded hasher.
    by_addr: HashMap<IpAddr, usize>,
    by_name: HashMap<String, usize>,
    names: Vec<String>,
    /// The series, one per distinct label text (bounded as the labels are: routes from the
    /// config, callers by `client_max`).
    series: Vec<(Labels, Counts)>,
    by_labels: HashMap<Labels, usize>,
    /// Fast keys of the configuration generations in use. A reload brings new `Arc`s, so new
    /// keys to the same series; keys whose labels only this map still holds (a generation
    /// gone) are dropped whenever a key is added, so the map does not grow with reloads.
    aliases: HashMap<Key, Alias, Words>,
}

/// The per-route counters of one proxy.
#[derive(Debug)]
pub struct Traffic {
    max_clients: usize,
    inner: Mutex<Inner>,
}

/// Who a request came from: its peer's address, or the value of the configured
/// `client_header`.
#[derive(Debug, Clone, Copy)]
pub enum Caller<'a> {
    /// The peer's IP address.
    Addr(IpAddr),
    /// The `client_header`'s value.
    Named(&'a str),
}

impl std::fmt::Display for Caller<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Caller::Addr(ip) => ip.fmt(f),
            Caller::Named(n) => f.write_str(n),
        }
    }
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
    pub client: Caller<'a>,
    /// The status the caller got.
    pub status: u16,
    /// Attempts sent to the upstream.
    pub attempts: u32,
    /// Why stormguard refused the request or its retry, if it did.
    pub denied: Option<Denied>,
}

impl Inner {
    /// The caller's index, admitting it while there is room.
    fn client(&mut self, caller: Caller<'_>, max: usize) -> usize {
        let found = match caller {
            Caller::Addr(ip) => self.by_addr.get(&ip),
            Caller::Named(n) => self.by_name.get(n),
        };
        if let Some(&i) = found {
            return i;
        }
        let room = self.names.len() < max;
        match caller {
            Caller::Named(n) if n.len() > MAX_CLIENT_LABEL => usize::MAX,
            _ if !room => usize::MAX,
            Caller::Addr(ip) => {
                self.names.push(ip.to_string());
                self.by_addr.insert(ip, self.names.len() - 1);
                self.names.len() - 1
            }
            Caller::Named(n) => {
                self.names.push(n.to_string());
                self.by_name.insert(n.to_string(), self.names.len() - 1);
                self.names.len() - 1
            }
        }
    }
}

impl Inner {
    /// A new fast key for `f`'s labels: to their series (made if new), after dropping the keys
    /// of generations no longer in use.
    #[cold]
    fn alias(&mut self, key: Key, f: Finished<'_>, client: usize) -> usize {
        self.aliases.retain(|_, a| a.held.iter().any(|l| Arc::strong_count(l) > 1));
        // The series keep copies of the text, so that only the config and this key hold the
        // generation's own `Arc`s: their count says when the generation is gone.
        let text = |l: &Arc<str>| Arc::<str>::from(&**l);
        let labels = (text(f.dependency), text(f.upstream), text(f.route), client);
        let series = match self.by_labels.get(&labels) {
            Some(&i) => i,
            None => {
                self.series.push((labels.clone(), Counts::default()));
                self.by_labels.insert(labels, self.series.len() - 1);
                self.series.len() - 1
            }
        };
        let held = [f.dependency.clone(), f.upstream.clone(), f.route.clone()];
        self.aliases.insert(key, Alias { series, held });
        series
    }
}

impl Traffic {
    /// Counters admitting at most `max_clients` distinct callers.
    pub fn new(max_clients: usize) -> Traffic {
        Traffic { max_clients, inner: Mutex::new(Inner::default()) }
    }

    /// Counts one finished request.
    pub fn count(&self, f: Finished<'_>) {
        let mut inner = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        let client = inner.client(f.client, self.max_clients);
        let addr = |a: &Arc<str>| Arc::as_ptr(a).cast::<u8>() as usize;
        let key = (addr(f.dependency), addr(f.upstream), addr(f.route), client);
        let series = match inner.aliases.get(&key) {
            Some(a) => a.series,
            None => inner.alias(key, f, client),
        };
        let c = &mut inner.series[series].1;
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

    /// The counts by labels (dependency, upstream, route, client), sorted (a caller's label
    /// text can come from both its address and a header, after a reload changed
    /// `client_header`: those are summed).
    fn by_labels(&self) -> BTreeMap<[String; 4], Counts> {
        let inner = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        let mut out: BTreeMap<[String; 4], Counts> = BTreeMap::new();
        for ((dependency, upstream, route, client), counts) in &inner.series {
            let client = inner.names.get(*client).map_or(OTHER, String::as_str);
            let labels = [&**dependency, &**upstream, &**route, client].map(str::to_string);
            out.entry(labels).or_default().add(counts);
        }
        out
    }

    /// Encodes `stormguard_route_requests`, `stormguard_route_attempts` and
    /// `stormguard_route_denied`.
    pub(crate) fn encode(&self, enc: &mut DescriptorEncoder) -> std::fmt::Result {
        let series = self.by_labels();
        {
            let mut m = enc.encode_descriptor(
                "stormguard_route_requests",
                "requests answered, by dependency, upstream, route, client and status class",
                None,
                MetricType::Counter,
            )?;
            for (k, c) in &series {
                for (class, n) in CLASSES.iter().zip(c.by_class) {
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
            for (k, c) in &series {
                let l = labels(k, None);
                ConstCounter::new(c.attempts).encode(m.encode_family(&l)?)?;
            }
        }
        let mut m = enc.encode_descriptor(
            "stormguard_route_denied",
            "requests or retries stormguard refused, by dependency, upstream, route, client and reason",
            None,
            MetricType::Counter,
        )?;
        for (k, c) in &series {
            for (reason, n) in Denied::ALL.iter().zip(c.denied) {
                if n > 0 {
                    let l = labels(k, Some(("reason", reason.as_str())));
                    ConstCounter::new(n).encode(m.encode_family(&l)?)?;
                }
            }
        }
        Ok(())
    }
}

/// A series' labels, and one more (the status class or the reason) when given.
fn labels<'a>(
    k: &'a [String; 4],
    more: Option<(&'static str, &'static str)>,
) -> Vec<(&'static str, LabelValue<'a>)> {
    let mut l = vec![
        ("dependency", LabelValue(&k[0])),
        ("upstream", LabelValue(&k[1])),
        ("route", LabelValue(&k[2])),
        ("client", LabelValue(&k[3])),
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
                client: Caller::Named(client),
                status: if i == 2 { 503 } else { 200 },
                attempts: 1,
                denied: (i == 2).then_some(Denied::Queue),
            });
        }
        assert_eq!(t.clients(), 2);
        let series = t.by_labels();
        let key = |c: &str| ["d", "u", "r", c].map(str::to_string);
        assert_eq!(series[&key("a")].by_class[1], 2, "a twice");
        let other = &series[&key(OTHER)];
        assert_eq!((other.by_class[1], other.by_class[4]), (1, 1), "c and d are other");
        assert_eq!(other.denied[Denied::Queue.index()], 1);
    }

    /// A reload brings new `Arc`s with the same labels: one series goes on counting, the keys
    /// of the generations gone are dropped (memory does not grow with reloads), and a caller by
    /// address is labelled by its address's text.
    #[test]
    fn a_reload_goes_on_counting_in_the_same_series() {
        let t = Traffic::new(8);
        let ip: IpAddr = "127.0.0.1".parse().unwrap();
        for _ in 0..50 {
            let (dep, up, route): (Arc<str>, Arc<str>, Arc<str>) =
                ("d".into(), "u".into(), "r".into());
            t.count(Finished {
                dependency: &dep,
                upstream: &up,
                route: &route,
                client: Caller::Addr(ip),
                status: 200,
                attempts: 2,
                denied: None,
            });
        }
        let series = t.by_labels();
        assert_eq!(series.len(), 1, "{series:?}");
        // Each generation's key went with its labels: one key, one series, after 50 reloads.
        let inner = t.inner.lock().unwrap();
        assert_eq!((inner.aliases.len(), inner.series.len()), (1, 1));
        drop(inner);
        let c = &series[&["d", "u", "r", "127.0.0.1"].map(str::to_string)];
        assert_eq!((c.by_class[1], c.attempts), (50, 100));
        assert_eq!(t.clients(), 1);
    }
}
