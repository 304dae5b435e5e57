//! The load generator behind `stormguard load`: drive a target, then check at the upstream that
//! the cap and the budget held.
//!
//! Two ways to send:
//! - **closed loop** ([`Mode::Closed`]): `concurrency` workers, each sending its next request
//!   when the last one is done — the shape of a fixed pool of callers;
//! - **open loop** ([`Mode::Open`]): arrivals on a fixed timetable (`rate` per second) that do
//!   not wait for responses. When the target stalls, a closed loop politely stops sending and
//!   the stall never shows in its latencies (coordinated omission); an open loop keeps arriving,
//!   and each latency is measured from the request's *scheduled* time. Outstanding requests are
//!   capped (`max_outstanding`); an arrival that finds the cap full is counted as `dropped`,
//!   never silently skipped.
//!
//! Every request ends in exactly one outcome: a complete response (by status), a body that
//! failed midway (`body_error`: one outcome, not a status plus an error), a reset before any
//! response, a timeout, or a connect error. Latencies go into one HDR histogram.
//!
//! The assertions read the upstream's own count (`GET /stats`, reset at the start): the exact
//! maximum in flight, and the retry fraction — the retries the dependency saw (attempts marked
//! as retries: `x-stormguard-attempt` or `x-envoy-attempt-count` above 1,
//! `grpc-previous-rpc-attempts` or `x-stainless-retry-count` above 0) over the first attempts it saw. It is never inferred
//! from `upstream requests − originals sent`: a stack that sheds most first tries and retries
//! the rest makes that difference negative, and a negative fraction passes any bound. A stack
//! that retries without marking is caught when the unmarked attempts outnumber the originals
//! sent. Every run must also be answered: when no request got a response (the target is down,
//! or every request was reset or timed out), the run fails whatever was asserted.
//!
//! Targets must be loopback addresses (`127.0.0.0/8`, `::1` or `localhost`): this is a tool for
//! proving a budget on one machine, not for loading someone else's service. Runs are bounded in
//! count and time (see the `MAX_*` constants).
//!
//! ```
//! use std::time::Duration;
//! use stormguard_chaos::load::{self, LoadConfig, Mode};
//! use stormguard_chaos::{ChaosConfig, Phase};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! let server = stormguard_chaos::spawn(ChaosConfig::single(Phase::default()), "127.0.0.1:0".parse().unwrap())
//!     .await
//!     .unwrap();
//! let mut config = LoadConfig::new(&server.url("/")).unwrap();
//! config.mode = Mode::Closed { concurrency: 4 };
//! config.requests = Some(100);
//! config.assertions.max_in_flight = Some(4);
//! let report = load::run(&config, &load::Live::default()).await.unwrap();
//! assert_eq!(report.outcomes.success, 100);
//! assert!(report.passed());
//! # }
//! ```

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::header::{HOST, HeaderMap, HeaderValue};
use http::{Method, Request, StatusCode, Uri};
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1;
use hyper_util::rt::TokioIo;
use serde::Serialize;
use serde_json::Value;
use tokio::net::TcpStream;
use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use stormguard_http::stacked::StackedHeaders;

use crate::script::Rate;

mod client;
mod report;
mod run;

use client::*;
pub use client::{CallError, http_call};
pub use report::*;
use run::*;

/// At most this many closed-loop workers.
pub const MAX_CONCURRENCY: usize = 10_000;
/// At most this many open-loop requests outstanding at once (each holds a connection).
pub const MAX_OUTSTANDING: usize = 100_000;
/// At most this many arrivals per second.
pub const MAX_RATE_PER_S: f64 = 1_000_000.0;
/// A run sends for at most an hour.
pub const MAX_DURATION: Duration = Duration::from_secs(3600);
/// At most this many requests in one run.
pub const MAX_REQUESTS: u64 = 100_000_000;
/// A request waits at most five minutes.
pub const MAX_TIMEOUT: Duration = Duration::from_secs(300);
/// Latencies are recorded in microseconds up to an hour.
const HISTOGRAM_MAX_US: u64 = 3_600_000_000;

/// How requests are sent.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Mode {
    /// `concurrency` workers (1 to [`MAX_CONCURRENCY`]), each waiting for its response before
    /// sending the next.
    Closed {
        /// Number of workers.
        concurrency: usize,
    },
    /// Arrivals at `rate` (above 0, at most [`MAX_RATE_PER_S`]), whatever the responses do;
    /// at most `max_outstanding` (1 to [`MAX_OUTSTANDING`]) at once.
    Open {
        /// Arrival rate.
        rate: Rate,
        /// Cap on requests sent and not yet done; arrivals beyond it are `dropped`.
        max_outstanding: usize,
    },
}

/// The checks that decide a run, read from the upstream's stats (except the success rate).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Assertions {
    /// The upstream's exact maximum in flight must be at most this.
    pub max_in_flight: Option<u64>,
    /// Retries the upstream saw (marked attempts) over the first attempts it saw must be at
    /// most this (a fraction, 0.25 = 25 % of first tries: the ratio budget's `percent`).
    pub retry_fraction: Option<f64>,
    /// Complete 2xx responses over everything scheduled (dropped included) must be at least this.
    pub success_rate: Option<f64>,
}

impl Assertions {
    /// Whether any assertion needs the upstream's stats.
    pub fn need_upstream(&self) -> bool {
        self.max_in_flight.is_some() || self.retry_fraction.is_some()
    }
}

/// One run's settings. Build with [`LoadConfig::new`], then adjust the fields.
#[derive(Debug, Clone)]
pub struct LoadConfig {
    /// `http://` URL on a loopback address.
    pub target: Uri,
    /// Request method. Default GET.
    pub method: Method,
    /// Extra request headers (`Host` is set from the target).
    pub headers: HeaderMap,
    /// Request body. Default empty.
    pub body: Bytes,
    /// Closed or open loop. Default closed, 10 workers.
    pub mode: Mode,
    /// Stop scheduling after this long (at most an hour). With neither `duration` nor
    /// `requests`, 10 s.
    pub duration: Option<Duration>,
    /// Stop after this many requests (at most [`MAX_REQUESTS`]).
    pub requests: Option<u64>,
    /// Per-request timeout, connect to the last body byte (at most 5 min). Default 10 s.
    pub timeout: Duration,
    /// The upstream's stats URL (`GET` it, `POST` its `/reset`). Default: `/stats` at the
    /// target's origin, used only when an assertion needs it.
    pub stats: Option<Uri>,
    /// The checks.
    pub assertions: Assertions,
}

/// Why a run could not start (bad settings) or could not read the upstream.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LoadError {
    /// A setting is out of range or malformed.
    #[error("{0}")]
    Invalid(String),
    /// The target or stats URL is not on this machine.
    #[error("{0} is not a loopback address: stormguard load only drives targets on this machine")]
    NotLoopback(String),
    /// The upstream's stats could not be reset at the start.
    #[error("cannot reset the upstream's stats at {url}: {reason} (is --stats right?)")]
    Stats {
        /// The URL tried.
        url: String,
        /// Why.
        reason: String,
    },
}

impl LoadConfig {
    /// Defaults for `target` (which must be an `http://` URL on a loopback address).
    pub fn new(target: &str) -> Result<LoadConfig, LoadError> {
        let target: Uri = target
            .parse()
            .map_err(|e| LoadError::Invalid(format!("target `{target}` is not a URL: {e}")))?;
        loopback_addr(&target)?;
        Ok(LoadConfig {
            target,
            method: Method::GET,
            headers: HeaderMap::new(),
            body: Bytes::new(),
            mode: Mode::Closed { concurrency: 10 },
            duration: None,
            requests: None,
            timeout: Duration::from_secs(10),
            stats: None,
            assertions: Assertions::default(),
        })
    }

    /// Checks every bound; one plain reason.
    pub fn validate(&self) -> Result<(), LoadError> {
        let bad = |s: String| Err(LoadError::Invalid(s));
        loopback_addr(&self.target)?;
        if let Some(stats) = &self.stats {
            loopback_addr(stats)?;
        }
        match self.mode {
            Mode::Closed { concurrency } if !(1..=MAX_CONCURRENCY).contains(&concurrency) => {
                return bad(format!(
                    "concurrency must be 1 to {MAX_CONCURRENCY}, got {concurrency}"
                ));
            }
            Mode::Open { rate, max_outstanding } => {
                let r = rate.per_second();
                if !(r > 0.0 && r <= MAX_RATE_PER_S) {
                    return bad(format!(
                        "rate must be above 0 and at most {MAX_RATE_PER_S}/s, got {r}/s"
                    ));
                }
                if !(1..=MAX_OUTSTANDING).contains(&max_outstanding) {
                    return bad(format!(
                        "max outstanding must be 1 to {MAX_OUTSTANDING}, got {max_outstanding}"
                    ));
                }
            }
            Mode::Closed { .. } => {}
        }
        if let Some(d) = self.duration
            && (d.is_zero() || d > MAX_DURATION)
        {
            return bad(format!("duration must be above 0 and at most 1h, got {d:?}"));
        }
        if let Some(n) = self.requests
            && !(1..=MAX_REQUESTS).contains(&n)
        {
            return bad(format!("requests must be 1 to {MAX_REQUESTS}, got {n}"));
        }
        if self.timeout.is_zero() || self.timeout > MAX_TIMEOUT {
            return bad(format!("timeout must be above 0 and at most 5m, got {:?}", self.timeout));
        }
        let a = self.assertions;
        if let Some(f) = a.retry_fraction
            && !(f >= 0.0 && f.is_finite())
        {
            return bad(format!("the retry fraction must be a number at least 0, got {f}"));
        }
        if a.retry_fraction.is_some() && StackedHeaders::default().arrived_as_retry(&self.headers) {
            return bad("the requests themselves carry a retry mark (x-stormguard-attempt, \
                        x-envoy-attempt-count or grpc-previous-rpc-attempts): the upstream could \
                        not tell the stack's retries from them; drop the header or the retry \
                        fraction assertion"
                .to_string());
        }
        if let Some(s) = a.success_rate
            && !(0.0..=1.0).contains(&s)
        {
            return bad(format!("the success rate must be between 0 and 1, got {s}"));
        }
        Ok(())
    }

    /// The duration that applies: the one given, or 10 s when neither a duration nor a request
    /// count bounds the run.
    pub fn effective_duration(&self) -> Option<Duration> {
        match (self.duration, self.requests) {
            (None, None) => Some(Duration::from_secs(10)),
            (d, _) => d,
        }
    }

    /// The stats URL in use: the one given, or `/stats` at the target's origin when an assertion
    /// needs it.
    pub fn stats_url(&self) -> Option<Uri> {
        if let Some(s) = &self.stats {
            return Some(s.clone());
        }
        if !self.assertions.need_upstream() {
            return None;
        }
        let authority = self.target.authority()?.as_str();
        format!("http://{authority}/stats").parse().ok()
    }
}

/// The socket address of an `http://` URL whose host is a loopback IP or `localhost`.
pub fn loopback_addr(uri: &Uri) -> Result<SocketAddr, LoadError> {
    match uri.scheme_str() {
        Some("http") => {}
        Some(other) => {
            return Err(LoadError::Invalid(format!(
                "{uri}: only http:// is supported, not {other}"
            )));
        }
        None => {
            return Err(LoadError::Invalid(format!("{uri}: give a full URL, http://host:port/")));
        }
    }
    let host = uri.host().ok_or_else(|| LoadError::Invalid(format!("{uri}: no host")))?;
    let port = uri.port_u16().unwrap_or(80);
    let ip: IpAddr = if host.eq_ignore_ascii_case("localhost") {
        IpAddr::V4(Ipv4Addr::LOCALHOST)
    } else {
        host.trim_start_matches('[')
            .trim_end_matches(']')
            .parse()
            .map_err(|_| LoadError::NotLoopback(host.to_string()))?
    };
    if !ip.is_loopback() {
        return Err(LoadError::NotLoopback(host.to_string()));
    }
    Ok(SocketAddr::new(ip, port))
}

/// Counters a progress display can read while the run goes on.
#[derive(Debug, Default)]
pub struct Live {
    /// Arrivals scheduled (open loop) or requests started (closed loop).
    pub scheduled: AtomicU64,
    /// Requests that ended, whatever the outcome (dropped included).
    pub done: AtomicU64,
    /// Complete 2xx responses.
    pub succeeded: AtomicU64,
    /// Sent and not yet done.
    pub outstanding: AtomicU64,
}

/// Runs the load, reads the upstream (when a stats URL is in use) and evaluates the assertions.
/// `live` is updated as the run goes, for a progress display.
pub async fn run(config: &LoadConfig, live: &Live) -> Result<LoadReport, LoadError> {
    config.validate()?;
    let addr = loopback_addr(&config.target)?;
    let stats_url = config.stats_url();
    if let Some(url) = &stats_url {
        let reset = format!("{}/reset", url.to_string().trim_end_matches('/'));
        let reset: Uri = reset.parse().map_err(|e| LoadError::Invalid(format!("{reset}: {e}")))?;
        match http_call(Method::POST, &reset).await {
            Ok((s, _)) if s.is_success() => {}
            Ok((s, _)) => {
                return Err(LoadError::Stats {
                    url: reset.to_string(),
                    reason: format!("status {s}"),
                });
            }
            Err(e) => {
                return Err(LoadError::Stats { url: reset.to_string(), reason: e.to_string() });
            }
        }
    }

    let shards = std::thread::available_parallelism().map_or(4, |n| n.get() * 4);
    let run = Arc::new(Run {
        addr,
        template: Template::new(config),
        timeout: config.timeout,
        live: Arc::new(LiveRef::default()),
        tallies: Tallies::new(shards),
    });
    let duration = config.effective_duration();
    let start = Instant::now();
    let mirror = {
        // Copy the tasks' counters to the caller's `live` every 50 ms.
        let src = run.live.clone();
        async move {
            loop {
                tokio::time::sleep(Duration::from_millis(50)).await;
                copy_live(&src.inner, live);
            }
        }
    };
    let work = async {
        match config.mode {
            Mode::Closed { concurrency } => {
                closed_loop(run.clone(), concurrency, config.requests, duration.map(|d| start + d))
                    .await
            }
            Mode::Open { rate, max_outstanding } => {
                open_loop(run.clone(), rate, max_outstanding, config.requests, duration, start)
                    .await
            }
        }
    };
    let scheduled = tokio::select! {
        n = work => n,
        () = mirror => unreachable!("the mirror loops forever"),
    };
    copy_live(&run.live.inner, live);
    let elapsed = start.elapsed();
    let tally = run.tallies.take();

    let mut report = summarize(config, scheduled, elapsed, tally);
    if let Some(url) = &stats_url {
        match http_call(Method::GET, url).await {
            Ok((s, body)) if s.is_success() => match serde_json::from_slice::<Value>(&body) {
                Ok(v) => report.upstream = Some(v),
                Err(e) => tracing::warn!(error = %e, "upstream stats are not JSON"),
            },
            Ok((s, _)) => tracing::warn!(status = %s, "upstream stats unavailable"),
            Err(e) => tracing::warn!(error = %e, "upstream stats unavailable"),
        }
        report.retry_fraction = UpstreamAttempts::of(&report).and_then(|a| a.fraction());
    }
    report.assertions = evaluate(&config.assertions, &report);
    Ok(report)
}

fn copy_live(src: &Live, dst: &Live) {
    for (s, d) in [
        (&src.scheduled, &dst.scheduled),
        (&src.done, &dst.done),
        (&src.succeeded, &dst.succeeded),
        (&src.outstanding, &dst.outstanding),
    ] {
        d.store(s.load(Ordering::Relaxed), Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_loopback_targets() {
        for ok in [
            "http://127.0.0.1:9000/",
            "http://localhost:80/x",
            "http://[::1]:8080/",
            "http://127.9.9.9/",
        ] {
            assert!(loopback_addr(&ok.parse().unwrap()).is_ok(), "{ok}");
        }
        for bad in [
            "http://10.0.0.1/",
            "http://192.0.2.1:9000/",
            "http://example.com/",
            "http://[2001:db8::1]/",
        ] {
            assert!(
                matches!(loopback_addr(&bad.parse().unwrap()), Err(LoadError::NotLoopback(_))),
                "{bad}"
            );
        }
        assert!(matches!(
            loopback_addr(&"https://127.0.0.1/".parse().unwrap()),
            Err(LoadError::Invalid(_))
        ));
        assert!(matches!(
            loopback_addr(&"/just/a/path".parse().unwrap()),
            Err(LoadError::Invalid(_))
        ));
        assert_eq!(loopback_addr(&"http://localhost/".parse().unwrap()).unwrap().port(), 80);
    }

    #[test]
    fn bounds_are_checked() {
        let base = LoadConfig::new("http://127.0.0.1:1/").unwrap();
        assert!(base.validate().is_ok());
        assert_eq!(base.effective_duration(), Some(Duration::from_secs(10)));
        let mut c = base.clone();
        c.mode = Mode::Closed { concurrency: 0 };
        assert!(c.validate().is_err());
        c.mode = Mode::Closed { concurrency: MAX_CONCURRENCY + 1 };
        assert!(c.validate().is_err());
        let mut c = base.clone();
        c.mode = Mode::Open { rate: "2000000/s".parse().unwrap(), max_outstanding: 10 };
        assert!(c.validate().is_err());
        let mut c = base.clone();
        c.duration = Some(Duration::from_secs(7200));
        assert!(c.validate().is_err());
        let mut c = base.clone();
        c.requests = Some(0);
        assert!(c.validate().is_err());
        let mut c = base.clone();
        c.assertions.success_rate = Some(1.5);
        assert!(c.validate().is_err());
        let mut c = base.clone();
        c.stats = Some("http://10.1.1.1/stats".parse().unwrap());
        assert!(matches!(c.validate(), Err(LoadError::NotLoopback(_))));
        let mut c = base;
        c.requests = Some(5);
        assert_eq!(c.effective_duration(), None);
    }

    #[test]
    fn default_stats_url_only_when_needed() {
        let mut c = LoadConfig::new("http://127.0.0.1:9000/api?x=1").unwrap();
        assert_eq!(c.stats_url(), None);
        c.assertions.max_in_flight = Some(20);
        assert_eq!(c.stats_url().unwrap().to_string(), "http://127.0.0.1:9000/stats");
        c.stats = Some("http://127.0.0.1:9001/stats".parse().unwrap());
        assert_eq!(c.stats_url().unwrap().to_string(), "http://127.0.0.1:9001/stats");
    }

    /// A finished run: `success` 200s and the rest 503s, with the upstream's stats.
    fn report(sent: u64, upstream: Option<Value>, success: u64, scheduled: u64) -> LoadReport {
        let mut outcomes = Outcomes { success, ..Outcomes::default() };
        outcomes.status_counts.insert(200, success);
        outcomes.status_counts.insert(503, scheduled - success);
        let mut r = LoadReport {
            mode: "closed",
            target: String::new(),
            concurrency: None,
            rate_per_s: None,
            elapsed_s: 1.0,
            scheduled,
            sent,
            outcomes,
            success_rate: success as f64 / scheduled as f64,
            throughput_per_s: 0.0,
            latency_ms: LatencySummary::default(),
            retry_fraction: None,
            upstream,
            assertions: vec![],
        };
        r.retry_fraction = UpstreamAttempts::of(&r).and_then(|a| a.fraction());
        r
    }

    fn verdict(a: Assertions, r: &LoadReport, name: &str) -> AssertionResult {
        evaluate(&a, r).into_iter().find(|x| x.name == name).unwrap()
    }

    #[test]
    fn each_assertion_passes_and_fails() {
        let up = serde_json::json!({ "requests": 125, "retries": 25, "in_flight": { "max": 20 } });
        let r = report(100, Some(up), 90, 100);
        assert_eq!(r.retry_fraction, Some(0.25));
        let check = |a: Assertions| evaluate(&a, &r).iter().all(|x| x.ok);
        assert!(check(Assertions::default()), "an answered run with nothing asserted passes");
        assert!(check(Assertions { max_in_flight: Some(20), ..Default::default() }));
        assert!(!check(Assertions { max_in_flight: Some(19), ..Default::default() }));
        assert!(check(Assertions { retry_fraction: Some(0.25), ..Default::default() }));
        assert!(!check(Assertions { retry_fraction: Some(0.24), ..Default::default() }));
        assert!(check(Assertions { success_rate: Some(0.9), ..Default::default() }));
        assert!(!check(Assertions { success_rate: Some(0.91), ..Default::default() }));
        // No upstream stats: the upstream assertions fail rather than pass by default.
        let r = report(100, None, 90, 100);
        let a = Assertions {
            max_in_flight: Some(1000),
            retry_fraction: Some(10.0),
            ..Default::default()
        };
        assert!(!verdict(a, &r, "max_in_flight").ok);
        assert!(!verdict(a, &r, "retry_fraction").ok);
        let up = serde_json::json!({"requests": 125, "retries": 25});
        let msg = verdict(
            Assertions { retry_fraction: Some(0.2), ..Default::default() },
            &report(100, Some(up), 0, 100),
            "retry_fraction",
        )
        .message;
        assert_eq!(
            msg,
            "retry fraction 25 retries / 100 first attempts at the upstream = 0.2500 > 0.2"
        );
    }

    #[test]
    fn a_stack_that_sheds_first_tries_and_retries_the_rest_fails() {
        // 100 originals sent; the stack shed 94 of them, and retried each of the other 6 once.
        // Counting from `upstream − sent` gives (12 − 100) / 100 = −0.88, which "passed" any
        // bound; the marked retries give 6 / 6 = 1.0.
        let up = serde_json::json!({"requests": 12, "retries": 6, "in_flight": {"max": 2}});
        let r = report(100, Some(up), 6, 100);
        let old_way = (12.0 - r.sent as f64) / r.sent as f64;
        assert!(old_way < 0.25);
        assert_eq!(r.retry_fraction, Some(1.0));
        let v = verdict(
            Assertions { retry_fraction: Some(0.25), ..Default::default() },
            &r,
            "retry_fraction",
        );
        assert!(!v.ok, "{}", v.message);
    }

    #[test]
    fn unmarked_retries_cannot_pass() {
        // 130 attempts, none marked, for 100 originals: 30 are retries nobody marked.
        let up = serde_json::json!({"requests": 130, "retries": 0, "in_flight": {"max": 5}});
        let r = report(100, Some(up), 100, 100);
        let v = verdict(
            Assertions { retry_fraction: Some(0.5), ..Default::default() },
            &r,
            "retry_fraction",
        );
        assert!(!v.ok);
        assert!(v.message.contains("130 unmarked attempts for 100 originals"), "{}", v.message);
        // Only retries, no first attempt: no fraction, and the bound fails.
        let up = serde_json::json!({"requests": 4, "retries": 4});
        let r = report(4, Some(up), 4, 4);
        assert_eq!(r.retry_fraction, None);
        assert!(
            !verdict(
                Assertions { retry_fraction: Some(100.0), ..Default::default() },
                &r,
                "retry_fraction"
            )
            .ok
        );
    }

    #[test]
    fn a_run_nobody_answered_fails() {
        let mut r = report(
            0,
            Some(serde_json::json!({"requests": 0, "retries": 0, "in_flight": {"max": 0}})),
            0,
            10,
        );
        r.outcomes = Outcomes { connect_error: 10, ..Outcomes::default() };
        let a = Assertions {
            max_in_flight: Some(20),
            retry_fraction: Some(0.25),
            ..Default::default()
        };
        let all = evaluate(&a, &r);
        assert_eq!(all.len(), 3);
        assert!(all.iter().all(|x| !x.ok), "{all:?}");
        let answered = verdict(Assertions::default(), &r, "answered");
        assert!(answered.message.contains("no request was answered"), "{}", answered.message);
        assert!(all[0].message.contains("the upstream saw no request"), "{}", all[0].message);
        // Answered, but the stack never reached the upstream: the cap held vacuously.
        let r = report(
            10,
            Some(serde_json::json!({"requests": 0, "retries": 0, "in_flight": {"max": 0}})),
            0,
            10,
        );
        assert!(verdict(Assertions::default(), &r, "answered").ok);
        assert!(
            !verdict(
                Assertions { max_in_flight: Some(20), ..Default::default() },
                &r,
                "max_in_flight"
            )
            .ok
        );
    }

    #[test]
    fn requests_marked_as_retries_cannot_assert_the_fraction() {
        let mut c = LoadConfig::new("http://127.0.0.1:9000/").unwrap();
        c.headers.insert("x-envoy-attempt-count", HeaderValue::from_static("3"));
        assert!(c.validate().is_ok(), "without the assertion the header is only sent");
        c.assertions.retry_fraction = Some(0.25);
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("carry a retry mark"), "{e}");
    }
}
