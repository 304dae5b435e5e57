//! The chaos server over real sockets on 127.0.0.1:0. Every assertion is on counts the test
//! controls exactly; where time matters, only generous lower bounds or "eventually" are used.

use crate::common;

use std::time::{Duration, Instant};

use common::{call, get, h2, h2_get, post_json, serve, server, wait_for};
use stormguard_chaos::{
    Action, ChaosConfig, Latency, OnDisconnect, Phase, RateLimit, Sampler, Script,
};

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

fn fixed(n: u64) -> Latency {
    Latency::Fixed(ms(n))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn error_draws_are_exactly_the_samplers() {
    let phase = Phase { error_rate: 0.3, status: 502, ..Phase::default() };
    let mut config = ChaosConfig::single(phase.clone());
    config.seed = 42;
    let s = serve(config).await;
    let addr = s.local_addr();
    // 1000 requests over 8 connections at once: arrival order varies, the set of draws doesn't.
    let tasks: Vec<_> = (0..8)
        .map(|_| {
            tokio::spawn(async move {
                let mut n502 = 0;
                for _ in 0..125 {
                    let got = get(addr, "/").await.unwrap();
                    n502 += usize::from(got.status == 502);
                }
                n502
            })
        })
        .collect();
    let mut seen = 0;
    for t in tasks {
        seen += t.await.unwrap();
    }
    let sampler = Sampler::new(42);
    let expected = (0..1000).filter(|&k| sampler.draw(&phase, k).is_error()).count();
    assert_eq!(seen, expected);
    let stats = s.stats();
    assert_eq!(stats.total.requests, 1000);
    assert_eq!(stats.total.status_counts.get(&502).copied().unwrap_or(0), expected as u64);
    assert_eq!(stats.total.status_counts[&200], 1000 - expected as u64);
    // And the sampler honours the script: 30 % within tolerance.
    assert!((250..=350).contains(&expected), "{expected}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exact_max_in_flight_equals_the_controlled_concurrency() {
    let s = server(Phase { latency: fixed(1500), ..Phase::default() }).await;
    let addr = s.local_addr();
    let held: Vec<_> = (0..12).map(|_| tokio::spawn(get(addr, "/"))).collect();
    let during = wait_for(&s, Duration::from_secs(5), |st| st.in_flight_now == 12).await;
    assert_eq!(during.in_flight_now, 12);
    assert_eq!(during.total.in_flight.max, 12);
    assert_eq!(during.total.requests, 12);
    for h in held {
        assert_eq!(h.await.unwrap().unwrap().status, 200);
    }
    let after = s.stats();
    assert_eq!(after.in_flight_now, 0);
    assert_eq!(after.total.in_flight.max, 12);
    // The arrivals saw 1, 2, ..., 12: the histogram's percentiles come from exactly those.
    assert_eq!(after.total.in_flight.p50, 6);
    assert_eq!(after.total.in_flight.p99, 12);
    assert_eq!(after.phases[0].counts.in_flight.max, 12);
    // One more, alone: the max does not move, and it sees 1.
    let mut quick = ChaosConfig::single(Phase::default());
    quick.seed = 1;
    let q = serve(quick).await;
    for _ in 0..5 {
        get(q.local_addr(), "/").await.unwrap();
    }
    assert_eq!(q.stats().total.in_flight.max, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn finish_keeps_working_after_the_client_leaves() {
    let s = server(Phase { latency: fixed(3000), ..Phase::default() }).await;
    let addr = s.local_addr();
    let held: Vec<_> = (0..6).map(|_| tokio::spawn(get(addr, "/"))).collect();
    assert_eq!(
        wait_for(&s, Duration::from_secs(5), |st| st.in_flight_now == 6).await.in_flight_now,
        6
    );
    for h in &held {
        h.abort(); // the clients leave: their sockets close
    }
    tokio::time::sleep(ms(300)).await;
    // With `finish` the server is still working on all six.
    let during = s.stats();
    assert_eq!(during.in_flight_now, 6);
    assert_eq!(during.total.client_gone, 0);
    let after = wait_for(&s, Duration::from_secs(6), |st| st.in_flight_now == 0).await;
    assert_eq!(after.in_flight_now, 0);
    assert_eq!(after.total.client_gone, 6);
    // It answered each (status counted), but nobody was there to take the answers.
    assert_eq!(after.total.status_counts[&200], 6);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_stops_when_the_client_leaves() {
    let mut config = ChaosConfig::single(Phase { latency: fixed(8000), ..Phase::default() });
    config.on_disconnect = OnDisconnect::Cancel;
    let s = serve(config).await;
    let addr = s.local_addr();
    let held: Vec<_> = (0..6).map(|_| tokio::spawn(get(addr, "/"))).collect();
    assert_eq!(
        wait_for(&s, Duration::from_secs(5), |st| st.in_flight_now == 6).await.in_flight_now,
        6
    );
    let left = Instant::now();
    for h in &held {
        h.abort();
    }
    // Long before the 8 s latency, every request has left the count.
    let after = wait_for(&s, Duration::from_secs(5), |st| st.in_flight_now == 0).await;
    assert_eq!(after.in_flight_now, 0);
    assert!(left.elapsed() < ms(8000));
    assert_eq!(after.total.client_gone, 6);
    assert!(after.total.status_counts.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrency_limit_answers_429_with_limit_headers() {
    let s =
        server(Phase { latency: fixed(1500), max_concurrency: Some(2), ..Phase::default() }).await;
    let addr = s.local_addr();
    let held: Vec<_> = (0..2).map(|_| tokio::spawn(get(addr, "/"))).collect();
    assert_eq!(
        wait_for(&s, Duration::from_secs(5), |st| st.in_flight_now == 2).await.in_flight_now,
        2
    );
    let refused = get(addr, "/").await.unwrap();
    assert_eq!(refused.status, 429);
    assert_eq!(refused.headers["x-concurrency-limit-limit"], "2");
    assert_eq!(refused.headers["x-concurrency-limit-remaining"], "0");
    let mut remaining: Vec<String> = Vec::new();
    for h in held {
        let got = h.await.unwrap().unwrap();
        assert_eq!(got.status, 200);
        assert_eq!(got.headers["x-concurrency-limit-limit"], "2");
        remaining.push(got.headers["x-concurrency-limit-remaining"].to_str().unwrap().into());
    }
    remaining.sort();
    assert_eq!(remaining, ["0", "1"]);
    let st = s.stats();
    assert_eq!(st.total.concurrency_limited, 1);
    assert_eq!(st.total.status_counts[&429], 1);
    // The refused request was in flight for an instant: the max saw it.
    assert_eq!(st.total.in_flight.max, 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rate_limit_answers_429_with_retry_after() {
    let limit = RateLimit::new("3/10s".parse().unwrap());
    let s = server(Phase { rate_limit: Some(limit), ..Phase::default() }).await;
    let addr = s.local_addr();
    for _ in 0..3 {
        assert_eq!(get(addr, "/").await.unwrap().status, 200);
    }
    let refused = get(addr, "/").await.unwrap();
    assert_eq!(refused.status, 429);
    // One token per 3.33 s: the wait is at most that, rounded up to whole seconds.
    let secs: u64 = refused.headers["retry-after"].to_str().unwrap().parse().unwrap();
    assert!((3..=4).contains(&secs), "{secs}");
    let ms: u64 = refused.headers["retry-after-ms"].to_str().unwrap().parse().unwrap();
    assert!((2_000..=3_334).contains(&ms), "{ms}");
    let st = s.stats();
    assert_eq!((st.total.rate_limited, st.total.status_counts[&429]), (1, 1));
    assert_eq!(st.total.requests, 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retries_are_counted_from_attempt_headers() {
    let s = server(Phase::default()).await;
    let addr = s.local_addr();
    for h in [
        &[][..],
        &[("x-stormguard-attempt", "1")][..],
        &[("x-stormguard-attempt", "2")][..],
        &[("x-envoy-attempt-count", "3")][..],
        &[("x-envoy-attempt-count", "1")][..],
        &[("x-stormguard-attempt", "junk")][..],
    ] {
        call(addr, "GET", "/", h).await.unwrap();
    }
    let st = s.stats();
    assert_eq!((st.total.requests, st.total.retries), (6, 2));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resets_and_truncated_bodies() {
    let s = server(Phase { reset_rate: 1.0, ..Phase::default() }).await;
    let err = get(s.local_addr(), "/").await.unwrap_err();
    // A TCP reset, not a clean close.
    assert!(err.contains("ConnectionReset"), "{err}");
    assert_eq!(s.stats().total.resets, 1);
    assert!(s.stats().total.status_counts.is_empty());

    let t = server(Phase { truncate_rate: 1.0, body_bytes: 1000, ..Phase::default() }).await;
    let got = get(t.local_addr(), "/").await.unwrap();
    assert_eq!(got.status, 200);
    assert_eq!(got.headers["content-length"], "1000");
    assert!(got.body.is_err(), "the body must fail midway");
    let st = t.stats();
    assert_eq!((st.total.truncated, st.total.status_counts[&200], st.in_flight_now), (1, 1, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_body_arrives_in_chunks_over_time() {
    let s = server(Phase { body_bytes: 100, slow_body: Some(ms(300)), ..Phase::default() }).await;
    let began = Instant::now();
    let got = get(s.local_addr(), "/").await.unwrap();
    assert!(began.elapsed() >= ms(300));
    let body = got.body.unwrap();
    assert_eq!(body.len(), 100);
    assert!(body.starts_with(b"ok\nok\n"));
    assert!(got.frames >= 2, "{} frames", got.frames);
    assert_eq!(s.stats().in_flight_now, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn phases_switch_by_admin_post_and_by_time() {
    let a = Phase { name: "calm".into(), ..Phase::default() };
    let b = Phase { name: "storm".into(), error_rate: 1.0, status: 502, ..Phase::default() };
    let s = serve(ChaosConfig::new(Script {
        phases: vec![a.clone(), b.clone()],
        ..Script::single(a.clone())
    }))
    .await;
    let addr = s.local_addr();
    assert_eq!(get(addr, "/").await.unwrap().status, 200);
    let next = post_json(addr, "/phase/next").await;
    assert_eq!(next["phase"], "storm");
    let got = get(addr, "/").await.unwrap();
    assert_eq!(
        (got.status.as_u16(), got.headers["x-chaos-phase"].to_str().unwrap()),
        (502, "storm")
    );
    let st = s.stats();
    assert_eq!(st.phase, "storm");
    assert_eq!(st.phases[0].counts.status_counts[&200], 1);
    assert_eq!(st.phases[1].counts.status_counts[&502], 1);
    assert_eq!(st.total.requests, 2);

    // By time: calm for 300 ms, then the storm, eventually.
    let timed = Phase { duration: Some(ms(300)), ..a };
    let t = serve(ChaosConfig::new(Script {
        phases: vec![timed, b],
        ..Script::single(Phase::default())
    }))
    .await;
    let deadline = Instant::now() + Duration::from_secs(5);
    while get(t.local_addr(), "/").await.unwrap().status != 502 {
        assert!(Instant::now() < deadline, "the timed phase never ended");
        tokio::time::sleep(ms(20)).await;
    }
    assert_eq!(t.phase(), "storm");
    assert!(t.stats().phases[1].counts.requests >= 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stats_endpoint_and_reset() {
    let s = server(Phase { error_rate: 1.0, ..Phase::default() }).await;
    let addr = s.local_addr();
    call(addr, "GET", "/x", &[("x-stormguard-attempt", "2")]).await.unwrap();
    let got = get(addr, "/stats").await.unwrap();
    assert_eq!(got.headers["content-type"], "application/json");
    let v: serde_json::Value = serde_json::from_slice(&got.body.unwrap()).unwrap();
    assert_eq!(v["requests"], 1);
    assert_eq!(v["retries"], 1);
    assert_eq!(v["status_counts"]["503"], 1);
    assert_eq!(v["in_flight"]["max"], 1);
    for k in ["p50", "p95", "p99"] {
        assert_eq!(v["in_flight"][k], 1, "{k}");
    }
    assert_eq!(v["phases"][0]["requests"], 1);
    // Admin requests are not traffic.
    let closed = post_json(addr, "/stats/reset").await;
    assert_eq!(closed["requests"], 1);
    let v: serde_json::Value =
        serde_json::from_slice(&get(addr, "/stats").await.unwrap().body.unwrap()).unwrap();
    assert_eq!(v["requests"], 0);
    assert_eq!(v["in_flight"]["max"], 0);
    assert_eq!(get(addr, "/stats/reset").await.unwrap().status, 405);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h2c_streams_count_in_flight_and_reset_alone() {
    let s = server(Phase { latency: fixed(800), ..Phase::default() }).await;
    let sender = h2(s.local_addr()).await;
    let streams: Vec<_> = (0..5)
        .map(|_| {
            let mut tx = sender.clone();
            tokio::spawn(async move { h2_get(&mut tx, "/").await })
        })
        .collect();
    assert_eq!(
        wait_for(&s, Duration::from_secs(5), |st| st.in_flight_now == 5).await.in_flight_now,
        5
    );
    for st in streams {
        assert_eq!(st.await.unwrap().unwrap().status, 200);
    }
    assert_eq!(s.stats().total.in_flight.max, 5);

    // A reset on h2 resets the stream only; the connection carries the next request.
    let phases = vec![
        Phase { name: "reset".into(), reset_rate: 1.0, ..Phase::default() },
        Phase { name: "ok".into(), ..Phase::default() },
    ];
    let r = serve(ChaosConfig::new(Script { phases, ..Script::single(Phase::default()) })).await;
    let mut tx = h2(r.local_addr()).await;
    assert!(h2_get(&mut tx, "/").await.is_err());
    r.next_phase();
    assert_eq!(h2_get(&mut tx, "/").await.unwrap().status, 200);
    assert_eq!(r.stats().total.resets, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn truncation_and_resets_match_the_draws() {
    // Every fault at once, seeded: the server's counts are exactly the sampler's.
    let phase = Phase { reset_rate: 0.1, truncate_rate: 0.1, error_rate: 0.2, ..Phase::default() };
    let mut config = ChaosConfig::single(phase.clone());
    config.seed = 5;
    let s = serve(config).await;
    for _ in 0..200 {
        let _ = get(s.local_addr(), "/").await;
    }
    let sampler = Sampler::new(5);
    let count =
        |a: Action| (0..200).filter(|&k| sampler.draw(&phase, k).action == a).count() as u64;
    let st = s.stats();
    assert_eq!(st.total.resets, count(Action::Reset));
    assert_eq!(st.total.truncated, count(Action::Truncate));
    assert_eq!(st.total.status_counts[&503], count(Action::Error));
    assert_eq!(st.total.status_counts[&200], count(Action::Respond) + count(Action::Truncate));
}

/// `servers = 2`: six requests at once are worked on two at a time, first come first served —
/// the last two answer after three service times at the earliest, and all six count as in
/// flight while they wait (the dependency has them). Without servers all six are worked on at
/// once and the slowest answers in about one service time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn servers_work_on_so_many_at_once_and_queue_the_rest() {
    async fn six(phase: Phase) -> (Vec<Duration>, u64) {
        let s = server(phase).await;
        let addr = s.local_addr();
        let tasks: Vec<_> = (0..6)
            .map(|_| {
                tokio::spawn(async move {
                    let t = Instant::now();
                    let got = get(addr, "/").await.unwrap();
                    assert_eq!(got.status, 200);
                    t.elapsed()
                })
            })
            .collect();
        let mut took = Vec::new();
        for t in tasks {
            took.push(t.await.unwrap());
        }
        took.sort();
        (took, s.stats().total.in_flight.max)
    }
    let queued = six(Phase { latency: fixed(100), servers: Some(2), ..Phase::default() }).await;
    assert!(queued.0[4] >= ms(300), "two servers, six requests: {:?}", queued.0);
    assert_eq!(queued.1, 6, "waiting requests are in flight");
    let parallel = six(Phase { latency: fixed(100), ..Phase::default() }).await;
    assert!(parallel.0[5] < ms(290), "no servers: {:?}", parallel.0);

    // Either model, not both.
    let both = Phase { workers: Some(2), servers: Some(2), ..Phase::default() };
    assert_eq!(both.validate().unwrap_err().key(), "servers");
    let none = Phase { servers: Some(0), ..Phase::default() };
    assert_eq!(none.validate().unwrap_err().key(), "servers");
    let lineless = Phase { queue: Some(3), ..Phase::default() };
    assert_eq!(lineless.validate().unwrap_err().key(), "queue");
}

/// The servers are one pool across phases, as the simulator's: two servers for 100 ms, then
/// one. Two requests of 300 ms take both at 0; a third at 150 ms finds the pool shrunk to one
/// with both still busy, so it waits for the first to finish *and* for the retired server not
/// to come back: it is served at 300 ms and answers at about 600 ms (a pool of its own per
/// phase would have served it at once, answering at 450 ms).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_servers_are_one_pool_resized_by_each_phase() {
    let done = two_phases((2, 300), (1, 300), &[0, 0, 150]).await;
    assert!(done[0] < ms(450) && done[1] < ms(450), "the first two at once: {done:?}");
    assert!(done[2] >= ms(580), "the third waited for the one server left: {done:?}");
}

/// Two phases of servers with fixed service times, (servers, ms) each, the first 100 ms long;
/// a GET sent at each offset (ms); when each answered (200), from the start.
async fn two_phases(first: (u64, u64), second: (u64, u64), at: &[u64]) -> Vec<Duration> {
    let phase = |name: &str, (servers, latency): (u64, u64), duration| Phase {
        name: name.into(),
        latency: fixed(latency),
        servers: Some(servers),
        duration,
        ..Phase::default()
    };
    let mut c = ChaosConfig::single(phase("first", first, Some(ms(100))));
    c.script.phases.push(phase("second", second, None));
    let s = stormguard_chaos::spawn(c, "127.0.0.1:0".parse().unwrap()).await.unwrap();
    let addr = s.local_addr();
    let start = Instant::now();
    let calls: Vec<_> = at
        .iter()
        .map(|&after| {
            tokio::spawn(async move {
                tokio::time::sleep(ms(after)).await;
                assert_eq!(get(addr, "/").await.unwrap().status, 200);
                start.elapsed()
            })
        })
        .collect();
    let mut done = Vec::new();
    for c in calls {
        done.push(c.await.unwrap());
    }
    done
}

/// A request that waits for a server into the next phase is served at that phase's service
/// time, as the simulator draws a service time when service starts: one server, 300 ms for the
/// first 100 ms, then 50 ms. A request at 50 ms waits behind the first until 300 ms and answers
/// at about 350 ms (at its arrival phase's 300 ms it would answer at 600 ms).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_request_takes_the_service_time_of_the_phase_that_serves_it() {
    let done = two_phases((1, 300), (1, 50), &[0, 50]).await;
    let (a, b) = (done[0], done[1]);
    assert!(a >= ms(300) && a < ms(450), "the first at the slow phase's 300 ms: {a:?}");
    assert!(b >= ms(340) && b < ms(500), "the second served in the fast phase: {b:?}");
}

/// `servers = 2, queue = 2`: of six requests at once, two are worked on, two wait, and the last
/// two find the line full and are answered 503 at once — as the simulator's bounded queue does.
/// Without the bound (above) all six are served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_line_is_answered_at_once() {
    let s =
        server(Phase { latency: fixed(200), servers: Some(2), queue: Some(2), ..Phase::default() })
            .await;
    let addr = s.local_addr();
    let tasks: Vec<_> = (0..6)
        .map(|i| {
            tokio::spawn(async move {
                // In order, so the line fills in a known order.
                tokio::time::sleep(ms(10 * i)).await;
                let t = Instant::now();
                let got = get(addr, "/").await.unwrap();
                (got.status, t.elapsed())
            })
        })
        .collect();
    let mut seen = Vec::new();
    for t in tasks {
        seen.push(t.await.unwrap());
    }
    let statuses: Vec<u16> = seen.iter().map(|(s, _)| s.as_u16()).collect();
    assert_eq!(statuses, [200, 200, 200, 200, 503, 503], "{seen:?}");
    assert!(seen[4].1 < ms(150) && seen[5].1 < ms(150), "refused at once: {seen:?}");
    assert!(seen[3].1 >= ms(300), "the second in line waited two service times: {seen:?}");
    assert_eq!(s.stats().total.status_counts[&503], 2);
}

/// Chaos's own share (`late`): how much longer than its draw each plain answer was held. Three
/// requests at once on one server of 100 ms wait 0, 100 and 200 ms for it: the wait is the
/// draw's, not chaos's, so the three together are late by far less than the 300 ms they waited
/// (counted from arrival alone, they would be late by at least that). A paced body is late on
/// purpose and is not counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lateness_is_what_chaos_adds_to_the_draw() {
    let s = server(Phase { latency: fixed(100), servers: Some(1), ..Phase::default() }).await;
    let addr = s.local_addr();
    let tasks: Vec<_> = (0..3).map(|_| tokio::spawn(get(addr, "/"))).collect();
    for t in tasks {
        assert_eq!(t.await.unwrap().unwrap().status, 200);
    }
    let late = s.stats().total.late;
    assert_eq!(late.answered, 3);
    assert!(late.total_us < 150_000, "{late:?}");
    assert!(late.max_us <= late.total_us && late.mean().as_micros() as u64 <= late.max_us);

    let paced = server(Phase { body_bytes: 100, slow_body: Some(ms(50)), ..Phase::default() });
    let paced = paced.await;
    get(paced.local_addr(), "/").await.unwrap();
    let stats = paced.stats();
    assert_eq!((stats.total.requests, stats.total.late.answered), (1, 0));
}
