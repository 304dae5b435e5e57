//! The load generator against in-process chaos servers.

use crate::common;

use std::time::Duration;

use common::{serve, server};
use stormguard_chaos::load::{self, Live, LoadConfig, LoadError, Mode};
use stormguard_chaos::{Action, ChaosConfig, Latency, OnDisconnect, Phase, Sampler};

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

fn config(url: &str) -> LoadConfig {
    LoadConfig::new(url).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn closed_loop_never_exceeds_its_concurrency() {
    let s = server(Phase { latency: Latency::Fixed(ms(10)), ..Phase::default() }).await;
    let mut c = config(&s.url("/"));
    c.mode = Mode::Closed { concurrency: 6 };
    c.requests = Some(120);
    c.assertions.max_in_flight = Some(6);
    c.assertions.retry_fraction = Some(0.0);
    c.assertions.success_rate = Some(1.0);
    let r = load::run(&c, &Live::default()).await.unwrap();
    assert_eq!((r.scheduled, r.sent, r.outcomes.success), (120, 120, 120));
    assert_eq!(r.outcomes.total(), 120);
    assert_eq!(r.upstream.as_ref().unwrap()["requests"], 120);
    assert_eq!(r.retry_fraction, Some(0.0));
    assert!(r.passed(), "{:?}", r.assertions);
    assert!(r.latency_ms.p50 >= 10.0);
    // One fewer than the workers fails: six workers do overlap on a 10 ms upstream.
    let mut tight = c.clone();
    tight.assertions = load::Assertions { max_in_flight: Some(1), ..Default::default() };
    let r = load::run(&tight, &Live::default()).await.unwrap();
    assert!(!r.passed(), "{:?}", r.upstream);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn open_loop_keeps_its_arrival_rate_when_the_target_stalls() {
    // The target never answers within the run: every request is held until its timeout.
    let mut stalled = ChaosConfig::single(Phase {
        latency: Latency::Fixed(Duration::from_secs(30)),
        ..Phase::default()
    });
    stalled.on_disconnect = OnDisconnect::Cancel;
    let s = serve(stalled).await;
    let mut c = config(&s.url("/"));
    c.mode = Mode::Open { rate: "200/s".parse().unwrap(), max_outstanding: 1000 };
    c.duration = Some(Duration::from_secs(1));
    c.timeout = Duration::from_secs(1);
    c.stats = Some(s.url("/stats").parse().unwrap());
    let r = load::run(&c, &Live::default()).await.unwrap();
    // The timetable has exactly 200 slots; all were sent although nothing came back.
    assert_eq!(r.scheduled, 200);
    assert_eq!(r.outcomes.dropped, 0);
    let upstream = r.upstream.as_ref().unwrap()["requests"].as_u64().unwrap();
    assert!((150..=200).contains(&upstream), "the upstream saw {upstream}");
    assert_eq!(r.sent, 200);
    assert_eq!(r.outcomes.timeout, 200);
    // Measured from the scheduled time, every latency includes the full stall.
    assert!(r.latency_ms.p50 >= 1000.0);
    // A run in which every request timed out was not answered: it fails.
    assert!(!r.passed(), "{:?}", r.assertions);

    // A closed loop against the same stall sends one request per worker and waits.
    let mut closed = c.clone();
    closed.mode = Mode::Closed { concurrency: 4 };
    let r = load::run(&closed, &Live::default()).await.unwrap();
    assert!(r.scheduled <= 8, "closed loop scheduled {}", r.scheduled);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn arrivals_beyond_the_outstanding_cap_are_counted_as_dropped() {
    let mut stalled = ChaosConfig::single(Phase {
        latency: Latency::Fixed(Duration::from_secs(30)),
        ..Phase::default()
    });
    stalled.on_disconnect = OnDisconnect::Cancel;
    let s = serve(stalled).await;
    let mut c = config(&s.url("/"));
    c.mode = Mode::Open { rate: "100/s".parse().unwrap(), max_outstanding: 5 };
    c.duration = Some(ms(500));
    c.timeout = Duration::from_secs(2);
    let r = load::run(&c, &Live::default()).await.unwrap();
    assert_eq!(r.scheduled, 50);
    assert_eq!((r.sent, r.outcomes.timeout, r.outcomes.dropped), (5, 5, 45));
    assert_eq!(r.outcomes.total(), 50);
    assert_eq!(r.success_rate, 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_request_has_exactly_one_outcome() {
    let phase = Phase {
        reset_rate: 0.15,
        truncate_rate: 0.15,
        error_rate: 0.2,
        body_bytes: 64,
        ..Phase::default()
    };
    let mut cfg = ChaosConfig::single(phase.clone());
    cfg.seed = 3;
    let s = serve(cfg).await;
    let mut c = config(&s.url("/"));
    c.mode = Mode::Closed { concurrency: 4 };
    c.requests = Some(400);
    c.assertions.success_rate = Some(0.3);
    let r = load::run(&c, &Live::default()).await.unwrap();
    let sampler = Sampler::new(3);
    let count =
        |a: Action| (0..400).filter(|&k| sampler.draw(&phase, k).action == a).count() as u64;
    let o = &r.outcomes;
    assert_eq!(o.total(), 400);
    assert_eq!(o.reset, count(Action::Reset));
    // A body that fails midway is one outcome, not also a 200.
    assert_eq!(o.body_error, count(Action::Truncate));
    assert_eq!(o.status_counts.get(&503).copied().unwrap_or(0), count(Action::Error));
    assert_eq!(o.success, count(Action::Respond));
    assert_eq!(o.status_counts[&200], count(Action::Respond));
    assert_eq!(r.sent, 400);
    assert_eq!(r.success_rate, count(Action::Respond) as f64 / 400.0);
    assert!(r.passed());
    let mut strict = c.clone();
    strict.assertions.success_rate = Some(0.6);
    assert!(!load::run(&strict, &Live::default()).await.unwrap().passed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_fraction_counts_what_the_upstream_saw() {
    // No stack in between: the upstream sees exactly the originals, fraction 0 — and extra
    // requests reaching the upstream (as a retrying proxy would send) raise it.
    let s = server(Phase::default()).await;
    let mut c = config(&s.url("/"));
    c.requests = Some(50);
    c.assertions.retry_fraction = Some(0.0);
    let r = load::run(&c, &Live::default()).await.unwrap();
    assert_eq!(r.retry_fraction, Some(0.0));
    assert!(r.passed());
}

#[tokio::test]
async fn refuses_what_is_not_loopback_and_unreachable_stats() {
    assert!(matches!(LoadConfig::new("http://192.0.2.10:9000/"), Err(LoadError::NotLoopback(_))));
    assert!(matches!(LoadConfig::new("not a url"), Err(LoadError::Invalid(_))));
    // Nothing listens on the stats port: the run refuses to start rather than assert blind.
    // Bound but never listening, for the whole test: refused, and no other test's port.
    let refusing = tokio::net::TcpSocket::new_v4().unwrap();
    refusing.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let port = refusing.local_addr().unwrap().port();
    let mut c = config(&format!("http://127.0.0.1:{port}/"));
    c.requests = Some(1);
    c.assertions.max_in_flight = Some(1);
    assert!(matches!(load::run(&c, &Live::default()).await, Err(LoadError::Stats { .. })));
    // Without assertions, a dead target is a run of connect errors, not a crash — and a failed
    // run: nothing was answered.
    c.assertions = load::Assertions::default();
    let r = load::run(&c, &Live::default()).await.unwrap();
    assert_eq!((r.outcomes.connect_error, r.sent), (1, 0));
    assert!(!r.passed());
    assert_eq!(r.assertions.len(), 1);
    assert_eq!(r.assertions[0].name, "answered");
    assert!(r.assertions[0].message.contains("1 connect errors"), "{}", r.assertions[0].message);
}
