//! What a run comes to: outcomes, latencies, the upstream's own counts, and the assertions judged on them.

use super::*;
use stormguard_core::histogram::LogHistogram;

/// How the requests ended. Each request has exactly one outcome.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Outcomes {
    /// Complete responses with a 2xx status.
    pub success: u64,
    /// Complete responses by status (2xx included).
    pub status_counts: BTreeMap<u16, u64>,
    /// Responses whose body failed midway: one outcome each.
    pub body_error: u64,
    /// Sent, then the connection or stream closed before any response.
    pub reset: u64,
    /// No complete response within the timeout.
    pub timeout: u64,
    /// Could not connect (not sent).
    pub connect_error: u64,
    /// Open loop: arrivals that found `max_outstanding` requests outstanding (not sent).
    pub dropped: u64,
}

impl Outcomes {
    pub(super) fn merge(&mut self, other: &Outcomes) {
        self.success += other.success;
        for (k, v) in &other.status_counts {
            *self.status_counts.entry(*k).or_default() += v;
        }
        self.body_error += other.body_error;
        self.reset += other.reset;
        self.timeout += other.timeout;
        self.connect_error += other.connect_error;
        self.dropped += other.dropped;
    }

    /// Requests that got a response from the target (complete or cut midway), whatever its
    /// status.
    pub fn answered(&self) -> u64 {
        self.status_counts.values().sum::<u64>() + self.body_error
    }

    /// Every outcome counted.
    pub fn total(&self) -> u64 {
        self.status_counts.values().sum::<u64>()
            + self.body_error
            + self.reset
            + self.timeout
            + self.connect_error
            + self.dropped
    }
}

/// Latency over the requests that got a response (complete or cut) or timed out, in
/// milliseconds; in open loop measured from each request's scheduled time.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct LatencySummary {
    /// How many latencies were recorded.
    pub count: u64,
    /// Mean.
    pub mean: f64,
    /// Median.
    pub p50: f64,
    /// 90th percentile.
    pub p90: f64,
    /// 99th percentile.
    pub p99: f64,
    /// 99.9th percentile.
    pub p999: f64,
    /// Maximum.
    pub max: f64,
}

/// One assertion's verdict.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct AssertionResult {
    /// `max_in_flight`, `retry_fraction`, `success_rate`, or `answered` (always checked: at
    /// least one request got a response).
    pub name: &'static str,
    /// The bound given.
    pub limit: f64,
    /// The value measured, when it could be.
    pub actual: Option<f64>,
    /// Whether it held.
    pub ok: bool,
    /// One line saying what was compared.
    pub message: String,
}

/// What a run did and saw.
#[derive(Debug, Clone, Serialize)]
pub struct LoadReport {
    /// `closed` or `open`.
    pub mode: &'static str,
    /// The target URL.
    pub target: String,
    /// Closed loop: the number of workers.
    pub concurrency: Option<usize>,
    /// Open loop: the arrival rate per second.
    pub rate_per_s: Option<f64>,
    /// From the first request to the last one done, in seconds.
    pub elapsed_s: f64,
    /// Requests the run started (closed) or arrivals on the timetable (open).
    pub scheduled: u64,
    /// Originals actually sent (not dropped, connected).
    pub sent: u64,
    /// How they ended.
    pub outcomes: Outcomes,
    /// `success / scheduled` (0 when nothing was scheduled).
    pub success_rate: f64,
    /// Requests done (not dropped) per second of `elapsed_s`.
    pub throughput_per_s: f64,
    /// Latency summary.
    pub latency_ms: LatencySummary,
    /// The upstream's stats JSON at the end, when a stats URL was in use.
    pub upstream: Option<Value>,
    /// Retries the upstream saw (marked attempts) over the first attempts it saw, when its
    /// stats were read and it saw a first attempt.
    pub retry_fraction: Option<f64>,
    /// The assertions' verdicts, in flag order.
    pub assertions: Vec<AssertionResult>,
}

impl LoadReport {
    /// Every assertion held.
    pub fn passed(&self) -> bool {
        self.assertions.iter().all(|a| a.ok)
    }
}

/// A request's end, before it is tallied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Outcome {
    Status(u16),
    BodyError,
    Reset,
    Timeout,
    ConnectError,
}

/// Outcomes and latencies for a group of requests.
#[derive(Debug)]
pub(super) struct Tally {
    pub(super) outcomes: Outcomes,
    pub(super) sent: u64,
    pub(super) latency_us: LogHistogram,
}

impl Tally {
    pub(super) fn new() -> Tally {
        Tally {
            outcomes: Outcomes::default(),
            sent: 0,
            // 1 024 buckets per power of two: within 0.1 %, HdrHistogram's three digits.
            latency_us: LogHistogram::new(10, HISTOGRAM_MAX_US),
        }
    }

    pub(super) fn record(&mut self, outcome: Outcome, sent: bool, latency: Duration) {
        if sent {
            self.sent += 1;
        }
        let o = &mut self.outcomes;
        match outcome {
            Outcome::Status(s) => {
                *o.status_counts.entry(s).or_default() += 1;
                if (200..300).contains(&s) {
                    o.success += 1;
                }
            }
            Outcome::BodyError => o.body_error += 1,
            Outcome::Reset => o.reset += 1,
            Outcome::Timeout => o.timeout += 1,
            Outcome::ConnectError => o.connect_error += 1,
        }
        if matches!(outcome, Outcome::Status(_) | Outcome::BodyError | Outcome::Timeout) {
            let us = u64::try_from(latency.as_micros()).unwrap_or(u64::MAX).max(1);
            self.latency_us.record(us);
        }
    }
}

/// Tallies sharded so that concurrent requests rarely share a lock.
#[derive(Debug)]
pub(super) struct Tallies {
    pub(super) shards: Vec<Mutex<Tally>>,
}

impl Tallies {
    pub(super) fn new(n: usize) -> Tallies {
        Tallies { shards: (0..n.max(1)).map(|_| Mutex::new(Tally::new())).collect() }
    }

    pub(super) fn record(&self, shard: usize, outcome: Outcome, sent: bool, latency: Duration) {
        let mut t =
            self.shards[shard % self.shards.len()].lock().unwrap_or_else(|e| e.into_inner());
        t.record(outcome, sent, latency);
    }

    /// Everything recorded so far. Called once no request is outstanding: each request records
    /// before it counts itself out, though its task may still be winding down.
    pub(super) fn take(&self) -> Tally {
        let mut all = Tally::new();
        for s in &self.shards {
            let t =
                std::mem::replace(&mut *s.lock().unwrap_or_else(|e| e.into_inner()), Tally::new());
            all.outcomes.merge(&t.outcomes);
            all.sent += t.sent;
            all.latency_us.merge(&t.latency_us);
        }
        all
    }
}

pub(super) fn summarize(
    config: &LoadConfig,
    scheduled: u64,
    elapsed: Duration,
    tally: Tally,
) -> LoadReport {
    let h = &tally.latency_us;
    let ms = |us: u64| us as f64 / 1000.0;
    let latency_ms = if h.is_empty() {
        LatencySummary::default()
    } else {
        LatencySummary {
            count: h.len(),
            mean: h.mean().unwrap_or(0.0) / 1000.0,
            p50: ms(h.quantile(0.5).unwrap_or(0)),
            p90: ms(h.quantile(0.9).unwrap_or(0)),
            p99: ms(h.quantile(0.99).unwrap_or(0)),
            p999: ms(h.quantile(0.999).unwrap_or(0)),
            max: ms(h.max().unwrap_or(0)),
        }
    };
    let o = tally.outcomes;
    let done = o.total() - o.dropped;
    let secs = elapsed.as_secs_f64();
    let (mode, concurrency, rate_per_s) = match config.mode {
        Mode::Closed { concurrency } => ("closed", Some(concurrency), None),
        Mode::Open { rate, .. } => ("open", None, Some(rate.per_second())),
    };
    LoadReport {
        mode,
        target: config.target.to_string(),
        concurrency,
        rate_per_s,
        elapsed_s: secs,
        scheduled,
        sent: tally.sent,
        success_rate: if scheduled == 0 { 0.0 } else { o.success as f64 / scheduled as f64 },
        throughput_per_s: if secs > 0.0 { done as f64 / secs } else { 0.0 },
        outcomes: o,
        latency_ms,
        upstream: None,
        retry_fraction: None,
        assertions: Vec::new(),
    }
}

/// What the upstream's stats say about the attempts it saw.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct UpstreamAttempts {
    /// Every request that arrived.
    pub(super) requests: u64,
    /// Those marked as retries.
    pub(super) retries: u64,
}

impl UpstreamAttempts {
    pub(super) fn of(report: &LoadReport) -> Option<UpstreamAttempts> {
        let up = report.upstream.as_ref()?;
        Some(UpstreamAttempts {
            requests: up["requests"].as_u64()?,
            retries: up["retries"].as_u64()?,
        })
    }

    /// First attempts: the requests not marked as retries.
    pub(super) fn first(&self) -> u64 {
        self.requests.saturating_sub(self.retries)
    }

    /// Retries over first attempts (`None` without a first attempt).
    pub(super) fn fraction(&self) -> Option<f64> {
        let first = self.first();
        (first > 0).then(|| self.retries as f64 / first as f64)
    }
}

/// The verdicts, in the order max in flight, retry fraction, success rate, answered.
pub fn evaluate(a: &Assertions, report: &LoadReport) -> Vec<AssertionResult> {
    let mut out = Vec::new();
    let upstream_requests = report.upstream.as_ref().and_then(|v| v["requests"].as_u64());
    if let Some(limit) = a.max_in_flight {
        let actual = report.upstream.as_ref().and_then(|v| v["in_flight"]["max"].as_u64());
        let (ok, message) = match (actual, upstream_requests) {
            // Nothing reached the dependency: the cap held vacuously, which proves nothing.
            (_, Some(0)) => (
                false,
                "max in flight: the upstream saw no request (is the stack in front of it, and \
                 --stats the upstream's?)"
                    .into(),
            ),
            (Some(m), _) if m <= limit => {
                (true, format!("max in flight at the upstream {m} <= {limit}"))
            }
            (Some(m), _) => (false, format!("max in flight at the upstream {m} > {limit}")),
            (None, _) => {
                (false, "max in flight: the upstream's stats have no in_flight.max".into())
            }
        };
        out.push(AssertionResult {
            name: "max_in_flight",
            limit: limit as f64,
            actual: actual.map(|m| m as f64),
            ok,
            message,
        });
    }
    if let Some(limit) = a.retry_fraction {
        let (ok, message) = match UpstreamAttempts::of(report) {
            None => (
                false,
                "retry fraction: the upstream's stats have no requests and retries counts".into(),
            ),
            Some(u) if u.requests == 0 => (
                false,
                "retry fraction: the upstream saw no request (is the stack in front of it, and \
                 --stats the upstream's?)"
                    .into(),
            ),
            Some(u) if u.first() > report.sent => (
                false,
                format!(
                    "retry fraction: the upstream saw {} unmarked attempts for {} originals \
                     sent: the stack retries without marking its retries (x-stormguard-attempt, \
                     or Envoy's x-envoy-attempt-count with include_request_attempt_count), \
                     so they cannot be told from first tries",
                    u.first(),
                    report.sent
                ),
            ),
            Some(u) => {
                let f = u.fraction().unwrap_or(f64::INFINITY);
                let ok = f <= limit;
                let cmp = if ok { "<=" } else { ">" };
                (
                    ok,
                    format!(
                        "retry fraction {} retries / {} first attempts at the upstream = {f:.4} \
                         {cmp} {limit}",
                        u.retries,
                        u.first()
                    ),
                )
            }
        };
        out.push(AssertionResult {
            name: "retry_fraction",
            limit,
            actual: report.retry_fraction,
            ok,
            message,
        });
    }
    if let Some(limit) = a.success_rate {
        let s = report.success_rate;
        let ok = s >= limit && report.scheduled > 0;
        let cmp = if ok { ">=" } else { "<" };
        let message = format!(
            "success rate {} / {} = {s:.4} {cmp} {limit}",
            report.outcomes.success, report.scheduled
        );
        out.push(AssertionResult { name: "success_rate", limit, actual: Some(s), ok, message });
    }
    // Always: a run nobody answered (the target down, every request reset or timed out) proves
    // nothing about a cap or a budget.
    let o = &report.outcomes;
    let answered = o.answered();
    let message = if answered > 0 {
        format!("answered {answered} of {} scheduled", report.scheduled)
    } else {
        format!(
            "no request was answered ({} scheduled: {} connect errors, {} resets, {} timeouts, {} \
             dropped): is the target up?",
            report.scheduled, o.connect_error, o.reset, o.timeout, o.dropped
        )
    };
    out.push(AssertionResult {
        name: "answered",
        limit: 1.0,
        actual: Some(answered as f64),
        ok: answered > 0,
        message,
    });
    out
}
