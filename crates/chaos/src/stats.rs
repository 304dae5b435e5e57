//! What the upstream saw, counted where it happened.
//!
//! A client can only guess what reached the dependency: a proxy between them retries, sheds and
//! queues. So the chaos server counts at the dependency itself — requests, the ones marked as
//! retries, every status it sent, and the number of requests in flight, exactly — per phase and
//! in total. `GET /stats` returns a [`Stats`] as JSON; `POST /stats/reset` starts a new count.
//!
//! In-flight is one atomic counter: incremented when a request arrives, decremented when its
//! handler is really done (the body's last byte produced, or the work abandoned). The maximum is
//! kept exactly with `fetch_max`, and the value each arriving request sees (itself included) goes
//! into a histogram with one bucket per integer, from which the p50/p95/p99 are read.
//!
//! As a model provider it also counts its answers by kind ([`ProviderCounts`]): a rate 429 and
//! a quota 429 apart, the overloaded answers, and each stream's fate. A stream is counted when
//! its first event is produced and when it ends, so one whose client left halfway is still
//! there, as abandoned.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use serde::{Deserialize, Serialize};
use stormguard_core::histogram::Histogram;

/// Status codes are counted in a flat array indexed by code; the server only sends 100–599.
const STATUS_SLOTS: usize = 600;

/// In-flight as seen at the upstream.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct InFlightStats {
    /// Median of the in-flight count seen by each arriving request (itself included).
    pub p50: u64,
    /// 95th percentile of the same.
    pub p95: u64,
    /// 99th percentile of the same.
    pub p99: u64,
    /// The exact maximum, over the requests that arrived since the last reset.
    pub max: u64,
}

/// Counts over one phase, or over all of them.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Counts {
    /// Traffic requests that arrived (admin requests are not counted).
    pub requests: u64,
    /// Requests marked as retries: `x-stormguard-attempt` or `x-envoy-attempt-count` above 1,
    /// or `grpc-previous-rpc-attempts` or `x-stainless-retry-count` above 0.
    pub retries: u64,
    /// In-flight at arrival.
    pub in_flight: InFlightStats,
    /// Responses by status code (JSON keys are strings: `"200"`). A truncated response counts
    /// as its status, 200; a reset has none.
    #[serde(deserialize_with = "status_keys")]
    pub status_counts: BTreeMap<u16, u64>,
    /// Requests answered by a reset instead of a response.
    pub resets: u64,
    /// 200 responses cut off halfway through the body.
    pub truncated: u64,
    /// 429s from a rate limit: the phase's, or the provider's per minute.
    pub rate_limited: u64,
    /// 429s from the concurrency limit.
    pub concurrency_limited: u64,
    /// Requests whose client left before the whole response was delivered.
    pub client_gone: u64,
    /// What the model provider answered, by kind: zero unless chaos plays one (an overloaded
    /// draw without a provider still counts in `overloaded`).
    #[serde(default)]
    pub provider: ProviderCounts,
    /// How much longer than drawn chaos held its plain answers.
    #[serde(default)]
    pub late: Lateness,
}

/// How much longer than its draw (the wait for a server and the drawn latency) chaos held each
/// plain answer, from its arrival to its last byte handed over: chaos's own share — its timer
/// (which never fires early and ticks in milliseconds), the scheduling of its tasks, writing the
/// answer; also reading the request's body, which is not server time. A model of the dependency
/// that leaves it out predicts a little less in flight than chaos holds. Resets, paced, cut and
/// streamed bodies, answers given at once (limits, overload, a full queue) and answers whose
/// client left are not counted.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct Lateness {
    /// Answers measured.
    pub answered: u64,
    /// Their time past the draw, summed, in microseconds.
    pub total_us: u64,
    /// The longest, in microseconds.
    pub max_us: u64,
}

impl Lateness {
    /// The mean time past the draw (zero when nothing was measured).
    pub fn mean(&self) -> std::time::Duration {
        std::time::Duration::from_micros(self.total_us / self.answered.max(1))
    }
}

/// The model provider's answers by kind, counted at chaos. Every streamed answer that started
/// ends as exactly one of completed, broken or abandoned (or is still going): `streams_started
/// = streams_completed + streams_broken + streams_abandoned` once nothing is in flight.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct ProviderCounts {
    /// 200s: the JSON answer, or a stream's head.
    pub ok: u64,
    /// 429s past the requests, tokens, input or output tokens per minute (also counted in
    /// [`Counts::rate_limited`]).
    pub rate_limited: u64,
    /// Refused past the quota: OpenAI's 429 `insufficient_quota`, Anthropic's 400 credit
    /// balance.
    pub quota_exhausted: u64,
    /// Overloaded answers: Anthropic's 529 (also without a provider), OpenAI's 503.
    pub overloaded: u64,
    /// Streamed answers whose first event was produced.
    pub streams_started: u64,
    /// Streams whose last event was produced.
    pub streams_completed: u64,
    /// Streams cut on purpose (`stream_break_rate`, or a truncation): counted when cut, or
    /// when their client left before the cut came.
    pub streams_broken: u64,
    /// Streams whose client left before the last event.
    pub streams_abandoned: u64,
}

/// Reads `{"200": n}` into numeric keys, also behind `#[serde(flatten)]` (where serde_json
/// hands over the keys as strings).
fn status_keys<'de, D: serde::Deserializer<'de>>(d: D) -> Result<BTreeMap<u16, u64>, D::Error> {
    let raw = BTreeMap::<String, u64>::deserialize(d)?;
    raw.into_iter()
        .map(|(k, v)| {
            k.parse()
                .map(|k| (k, v))
                .map_err(|_| serde::de::Error::custom(format!("status `{k}` is not a number")))
        })
        .collect()
}

/// One phase's counts.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PhaseStats {
    /// The phase's name.
    pub name: String,
    /// Its position in the script, from 0.
    pub index: usize,
    /// Its counts.
    #[serde(flatten)]
    pub counts: Counts,
}

/// The whole picture: totals since the last reset, the current phase, and each phase's counts.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Stats {
    /// The current phase's name.
    pub phase: String,
    /// The current phase's index.
    pub phase_index: usize,
    /// Seconds since the last reset (or the start).
    pub seconds: f64,
    /// Requests in flight right now (not reset: they are real).
    pub in_flight_now: u64,
    /// Totals.
    #[serde(flatten)]
    pub total: Counts,
    /// Per phase, in script order.
    pub phases: Vec<PhaseStats>,
}

/// Lock-free counters for one phase (or the total).
#[derive(Debug)]
pub(crate) struct Counters {
    requests: AtomicU64,
    retries: AtomicU64,
    status: Box<[AtomicU64]>,
    resets: AtomicU64,
    truncated: AtomicU64,
    rate_limited: AtomicU64,
    concurrency_limited: AtomicU64,
    client_gone: AtomicU64,
    in_flight_max: AtomicU64,
    in_flight: Histogram,
    /// [`ProviderCounts`], in its field order.
    provider: [AtomicU64; 8],
    /// [`Lateness`], in its field order.
    late: [AtomicU64; 3],
}

/// Which extra counter an event bumps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Event {
    Reset,
    Truncated,
    RateLimited,
    ConcurrencyLimited,
    ClientGone,
    /// The provider events, each its [`ProviderCounts`] field.
    ProviderOk,
    ProviderRateLimited,
    QuotaExhausted,
    Overloaded,
    StreamStarted,
    StreamCompleted,
    StreamBroken,
    StreamAbandoned,
}

// Relaxed everywhere: each counter is independent, and a snapshot that sees one increment before
// another is still a valid scrape. The in-flight *count* itself lives in the server, not here.
impl Counters {
    fn new(in_flight_buckets: u64) -> Counters {
        Counters {
            requests: AtomicU64::new(0),
            retries: AtomicU64::new(0),
            status: (0..STATUS_SLOTS).map(|_| AtomicU64::new(0)).collect(),
            resets: AtomicU64::new(0),
            truncated: AtomicU64::new(0),
            rate_limited: AtomicU64::new(0),
            concurrency_limited: AtomicU64::new(0),
            client_gone: AtomicU64::new(0),
            in_flight_max: AtomicU64::new(0),
            in_flight: Histogram::linear(in_flight_buckets),
            provider: Default::default(),
            late: Default::default(),
        }
    }

    /// A plain answer held `late` past its draw.
    pub(crate) fn late(&self, late: std::time::Duration) {
        let us = u64::try_from(late.as_micros()).unwrap_or(u64::MAX);
        self.late[0].fetch_add(1, Ordering::Relaxed);
        self.late[1].fetch_add(us, Ordering::Relaxed);
        self.late[2].fetch_max(us, Ordering::Relaxed);
    }

    pub(crate) fn arrive(&self, in_flight: u64, retry: bool) {
        self.requests.fetch_add(1, Ordering::Relaxed);
        if retry {
            self.retries.fetch_add(1, Ordering::Relaxed);
        }
        self.in_flight_max.fetch_max(in_flight, Ordering::Relaxed);
        self.in_flight.record(in_flight);
    }

    pub(crate) fn status(&self, code: u16) {
        if let Some(c) = self.status.get(usize::from(code)) {
            c.fetch_add(1, Ordering::Relaxed);
        }
    }

    pub(crate) fn event(&self, e: Event) {
        let c = match e {
            Event::Reset => &self.resets,
            Event::Truncated => &self.truncated,
            Event::RateLimited => &self.rate_limited,
            Event::ConcurrencyLimited => &self.concurrency_limited,
            Event::ClientGone => &self.client_gone,
            Event::ProviderOk => &self.provider[0],
            Event::ProviderRateLimited => &self.provider[1],
            Event::QuotaExhausted => &self.provider[2],
            Event::Overloaded => &self.provider[3],
            Event::StreamStarted => &self.provider[4],
            Event::StreamCompleted => &self.provider[5],
            Event::StreamBroken => &self.provider[6],
            Event::StreamAbandoned => &self.provider[7],
        };
        c.fetch_add(1, Ordering::Relaxed);
    }

    fn snapshot(&self) -> Counts {
        let h = self.in_flight.snapshot();
        let max = self.in_flight_max.load(Ordering::Relaxed);
        // Past the last linear bucket the histogram cannot say; the exact max bounds it.
        let q = |q: f64| if h.count == 0 { 0 } else { h.quantile_bound(q).unwrap_or(max).min(max) };
        Counts {
            requests: self.requests.load(Ordering::Relaxed),
            retries: self.retries.load(Ordering::Relaxed),
            in_flight: InFlightStats { p50: q(0.5), p95: q(0.95), p99: q(0.99), max },
            status_counts: self
                .status
                .iter()
                .enumerate()
                .filter_map(|(code, c)| {
                    let n = c.load(Ordering::Relaxed);
                    (n > 0).then_some((code as u16, n))
                })
                .collect(),
            resets: self.resets.load(Ordering::Relaxed),
            truncated: self.truncated.load(Ordering::Relaxed),
            rate_limited: self.rate_limited.load(Ordering::Relaxed),
            concurrency_limited: self.concurrency_limited.load(Ordering::Relaxed),
            client_gone: self.client_gone.load(Ordering::Relaxed),
            provider: {
                let [
                    ok,
                    rate_limited,
                    quota_exhausted,
                    overloaded,
                    started,
                    completed,
                    broken,
                    abandoned,
                ] = self.provider.each_ref().map(|c| c.load(Ordering::Relaxed));
                ProviderCounts {
                    ok,
                    rate_limited,
                    quota_exhausted,
                    overloaded,
                    streams_started: started,
                    streams_completed: completed,
                    streams_broken: broken,
                    streams_abandoned: abandoned,
                }
            },
            late: {
                let [answered, total_us, max_us] =
                    self.late.each_ref().map(|c| c.load(Ordering::Relaxed));
                Lateness { answered, total_us, max_us }
            },
        }
    }
}

/// One counting period, from a reset to the next. A request records everything into the epoch
/// it arrived in, so a reset never mixes halves of a request into two counts.
#[derive(Debug)]
pub(crate) struct Epoch {
    started: Instant,
    total: Counters,
    phases: Vec<Counters>,
}

impl Epoch {
    pub(crate) fn new(phases: usize, in_flight_buckets: u64) -> Epoch {
        Epoch {
            started: Instant::now(),
            total: Counters::new(in_flight_buckets),
            phases: (0..phases).map(|_| Counters::new(in_flight_buckets)).collect(),
        }
    }

    /// Runs `f` on the phase's counters and the total's.
    pub(crate) fn both(&self, phase: usize, f: impl Fn(&Counters)) {
        f(&self.total);
        if let Some(p) = self.phases.get(phase) {
            f(p);
        }
    }

    pub(crate) fn snapshot(
        &self,
        names: &[String],
        phase_index: usize,
        in_flight_now: u64,
    ) -> Stats {
        Stats {
            phase: names.get(phase_index).cloned().unwrap_or_default(),
            phase_index,
            seconds: self.started.elapsed().as_secs_f64(),
            in_flight_now,
            total: self.total.snapshot(),
            phases: self
                .phases
                .iter()
                .zip(names)
                .enumerate()
                .map(|(index, (c, name))| PhaseStats {
                    name: name.clone(),
                    index,
                    counts: c.snapshot(),
                })
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_and_exact_max() {
        let e = Epoch::new(2, 8);
        for n in [1, 2, 3, 4, 4, 4, 4, 4, 4, 12] {
            e.both(1, |c| c.arrive(n, n == 2));
        }
        e.both(0, |c| c.status(200));
        e.both(1, |c| c.status(503));
        e.both(1, |c| c.event(Event::Reset));
        let s = e.snapshot(&["a".into(), "b".into()], 1, 5);
        assert_eq!(s.total.requests, 10);
        assert_eq!(s.total.retries, 1);
        // 12 is past the last bucket (8): p99 falls back to the exact max.
        assert_eq!(s.total.in_flight, InFlightStats { p50: 4, p95: 12, p99: 12, max: 12 });
        assert_eq!(s.total.status_counts, BTreeMap::from([(200, 1), (503, 1)]));
        assert_eq!(s.phases[0].counts.requests, 0);
        assert_eq!(s.phases[1].counts.resets, 1);
        assert_eq!((s.phase.as_str(), s.in_flight_now), ("b", 5));
    }

    #[test]
    fn json_shape() {
        let e = Epoch::new(1, 8);
        e.both(0, |c| c.arrive(1, false));
        e.both(0, |c| c.status(200));
        let v = serde_json::to_value(e.snapshot(&["only".into()], 0, 0)).unwrap();
        assert_eq!(v["requests"], 1);
        assert_eq!(v["retries"], 0);
        assert_eq!(v["in_flight"]["max"], 1);
        assert_eq!(v["in_flight"]["p99"], 1);
        assert_eq!(v["status_counts"]["200"], 1);
        assert_eq!(v["phases"][0]["name"], "only");
        assert_eq!(v["phases"][0]["status_counts"]["200"], 1);
        assert_eq!(v["provider"]["streams_started"], 0);
        let back: Stats = serde_json::from_value(v).unwrap();
        assert_eq!(back.total.status_counts[&200], 1);
        // Stats written before the provider counts existed still read.
        let mut old = serde_json::to_value(e.snapshot(&["only".into()], 0, 0)).unwrap();
        old.as_object_mut().unwrap().remove("provider");
        assert_eq!(serde_json::from_value::<Stats>(old).unwrap().total.provider.ok, 0);
    }
}
