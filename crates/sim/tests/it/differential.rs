//! One request life, two placements: the same script — when each request arrives, and how the
//! dependency answers each of its attempts (a success, a 503, a 429 with `Retry-After`, late
//! enough to be cut by the per-try timeout or the deadline) — runs through the simulator's
//! scripted dependency and through the tower layer on tokio's paused clock, and the two logs —
//! each attempt as the dependency saw it, each caller's answer with the reason stormguard
//! refused it — must be the same, event by event. The rules are one request life
//! (`stormguard_core::life`); what this catches is a placement that feeds it differently: a
//! retry admitted before its wait, a hedge beside a retry, a budget charged in another order.
//!
//! Every instant of request `k` (below 20) is `k + 20 j` modulo 160 ms: arrivals at
//! `160 ms × a + k`; latencies, backoffs and the slot hold whole multiples of 160 ms; the
//! per-try timeout 180 ms (20 modulo 160) and the hedge delay 40 or 120 ms (so a first try, its
//! timeout, its first hedge, that one's timeout, a second hedge and its timeout each keep a
//! class of their own). So two requests' events never fall on one instant, nor, within a
//! request, an answer on its own timeout, a hedge's turn, or another attempt's answer: the order of simultaneous events, which two
//! placements are free to choose differently (the model lets an answer at its timeout count; a
//! layer whose answer comes through another task may see the timer first), never decides
//! anything here. The deadline (10 s) never binds. tokio's timers count whole milliseconds;
//! every duration here is one.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::Full;
use proptest::prelude::*;
use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};
use stormguard_core::Denied;
use stormguard_sim::Scenario;
use stormguard_sim::script::{self, Answer, Event, Line, ScriptedRequest};
use stormguard_tower::{
    BoxError, CloneBody, Dependency, DependencyConfig, Spawner, StormguardError, StormguardLayer,
};
use tower::{Layer, Service, ServiceExt};

/// The lane width: request `k`'s instants are `k + 20 j` modulo this many milliseconds.
const LANE_MS: u64 = 160;

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// A policy of the scenario language, and the scenario around it: no queue (a first try past
/// the cap is refused at once, so no request's slot passes to another's lane), no jitter.
fn scenario(policy: &str) -> Scenario {
    let text = format!(
        "duration = \"1s\"\n[fleet]\nrate = 1\n\
         [client]\nper_try_timeout = \"180ms\"\ndeadline = \"10s\"\ntimeout_slot_hold = \"1920ms\"\n\
         retry_on = \"5xx,429,timeout\"\n\
         [dependency]\ncapacity = 1000\nservice_time = \"fixed 20ms\"\n\
         [[policy]]\nqueue = 0\nbackoff = \"160ms..640ms\"\njitter = \"none\"\n{policy}"
    );
    Scenario::parse("differential.toml", &text).unwrap()
}

/// The same policy as the tower layer's dependency: the scenario's own retry rules, cap,
/// budget and timeouts, and a spawner (a timed-out or abandoned attempt's slot comes back when
/// the dependency answers, as the model's does).
fn dependency(sc: &Scenario) -> Dependency {
    let p = &sc.policies[0];
    let mut c = DependencyConfig::new("differential");
    c.retry = p.retry_config(&sc.client).unwrap();
    c.limiter = p.cap.unwrap().limiter_config();
    c.budget = match &p.retry {
        stormguard_sim::scenario::RetryRule::Budget { spec, .. } => *spec,
        other => panic!("a budget policy, not {other:?}"),
    };
    c.per_try_timeout = sc.client.per_try_timeout;
    c.deadline = Some(sc.client.deadline);
    c.timeout_slot_hold = sc.client.timeout_slot_hold;
    c.background = Some(Spawner::tokio());
    if let Some(r) = &p.rate {
        c.rate.requests_per_minute = r.requests_per_minute;
        c.rate.tokens_per_minute = r.tokens_per_minute;
    }
    Dependency::try_new(c).unwrap()
}

type Req = Request<Full<Bytes>>;

/// The scripted dependency as a service: request `x-request-id: k`'s `n`th attempt is answered
/// as the script says, in a task of its own (it goes on after its client gave up, as a real
/// server does), and logged as it arrives.
#[derive(Clone)]
struct Scripted {
    requests: Arc<[ScriptedRequest]>,
    seen: Arc<Mutex<HashMap<u32, u32>>>,
    log: Arc<Mutex<Vec<Line>>>,
    start: tokio::time::Instant,
}

impl Service<Req> for Scripted {
    type Response = Response<Full<Bytes>>;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, BoxError>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Req) -> Self::Future {
        let k: u32 = req.headers()["x-request-id"].to_str().unwrap().parse().unwrap();
        let hedge = req
            .headers()
            .get("x-stormguard-attempt")
            .is_some_and(|v| v.as_bytes().ends_with(b"hedge"));
        let n = {
            let mut seen = self.seen.lock().unwrap();
            let n = seen.entry(k).or_default();
            *n += 1;
            *n
        };
        let at = self.start.elapsed();
        self.log.lock().unwrap().push(Line { at, request: k, event: Event::Sent { n, hedge } });
        let answer = self.requests[k as usize].answer(n);
        let (tx, rx) = tokio::sync::oneshot::channel();
        tokio::spawn(async move {
            tokio::time::sleep(answer.after()).await;
            let resp = match answer {
                Answer::Ok(_) => Response::builder().status(200),
                Answer::Unavailable(_) => Response::builder().status(503),
                Answer::TooMany(_, s) => {
                    Response::builder().status(429).header("retry-after", s.to_string())
                }
            };
            let _ = tx.send(resp.body(Full::new(Bytes::new())).unwrap());
        });
        Box::pin(async move { rx.await.map_err(Into::into) })
    }
}

/// What a caller got, as the log says it: a success, or a failure with the reason stormguard
/// refused it (its retry, or its first try).
fn ended(result: &Result<Response<impl Sized>, BoxError>) -> Event {
    match result {
        Ok(resp) => Event::Ended {
            ok: resp.status() == 200,
            refused: resp.extensions().get::<Denied>().copied(),
        },
        Err(e) => Event::Ended {
            ok: false,
            refused: match e.downcast_ref::<StormguardError>() {
                Some(StormguardError::Denied(r)) => Some(*r),
                Some(StormguardError::NotRetried { reason, .. }) => Some(*reason),
                _ => None,
            },
        },
    }
}

/// The script through the tower layer, on a paused clock.
fn tower_log(sc: &Scenario, requests: &[ScriptedRequest]) -> Vec<Line> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .unwrap();
    rt.block_on(async {
        let start = tokio::time::Instant::now();
        let up = Scripted {
            requests: requests.to_vec().into(),
            seen: Arc::default(),
            log: Arc::default(),
            start,
        };
        let svc = StormguardLayer::new(dependency(sc)).with_policy(CloneBody).layer(up.clone());
        let callers: Vec<_> = requests
            .iter()
            .enumerate()
            .map(|(k, r)| {
                let (svc, log, at) = (svc.clone(), up.log.clone(), r.at);
                tokio::spawn(async move {
                    tokio::time::sleep_until(start + at).await;
                    let req = Request::get("http://differential/")
                        .header("x-request-id", k.to_string())
                        .body(Full::new(Bytes::new()))
                        .unwrap();
                    // A life that never ends is a failure here, not a hang: paused time runs
                    // straight to this timer when nothing else is left to wake.
                    let result = tokio::time::timeout(Duration::from_secs(60), svc.oneshot(req))
                        .await
                        .expect("every request ends within a minute of virtual time");
                    let line =
                        Line { at: start.elapsed(), request: k as u32, event: ended(&result) };
                    log.lock().unwrap().push(line);
                })
            })
            .collect();
        for c in callers {
            c.await.unwrap();
        }
        // The attempts the callers left run on to their answers.
        tokio::time::sleep(Duration::from_secs(5)).await;
        let mut log = up.log.lock().unwrap().clone();
        log.sort();
        log
    })
}

fn sim_log(sc: &Scenario, requests: &[ScriptedRequest]) -> Vec<Line> {
    let mut log = script::run(sc, 0, requests).unwrap();
    log.sort();
    log
}

/// A script: up to 19 requests, request `k` at `160 ms × a + k + 1`; each of its five possible
/// attempts' answers after a whole number of lanes (160 to 480 ms, past the 180 ms per-try
/// timeout sometimes).
fn scripts() -> impl Strategy<Value = Vec<ScriptedRequest>> {
    let answer = (1..=3u64, 0..10u8).prop_map(|(lanes, kind)| {
        let after = ms(lanes * LANE_MS);
        match kind {
            0..=3 => Answer::Ok(after),
            4..=7 => Answer::Unavailable(after),
            // Retry-After 0 (retry at once), or past max_pushback (refused `pushback`): the
            // pushback's jitter is a random draw, which two placements need not share.
            8 => Answer::TooMany(after, 0),
            _ => Answer::TooMany(after, 3_600),
        }
    });
    let request = (0..4u64, proptest::collection::vec(answer, 5));
    proptest::collection::vec(request, 1..19).prop_map(|rs| {
        let mut lane = 0;
        rs.into_iter()
            .enumerate()
            .map(|(k, (gap, answers))| {
                lane += gap;
                ScriptedRequest { at: ms(lane * LANE_MS + k as u64 + 1), answers }
            })
            .collect()
    })
}

/// The policies the scripts run under: a tight budget and cap, hedging (of first tries that are
/// slow, or of every first try) under a tight budget and a rich one, a token bucket, and two
/// hedges a request (the second beside the first hedge, if it is slow too).
const POLICIES: [&str; 7] = [
    "budget = \"ratio:percent=0.1,min_per_sec=0.2,ttl=10s\"\ncap = 3\nretries = 2\n",
    "budget = \"ratio:percent=0.1,min_per_sec=0.2,ttl=10s\"\ncap = 4\nretries = 2\n\
     hedge_after = \"120ms\"\n",
    "budget = \"ratio:percent=0.5,min_per_sec=10,ttl=10s\"\ncap = 50\nretries = 3\n\
     hedge_after = \"120ms\"\n",
    "budget = \"ratio:percent=0.5,min_per_sec=10,ttl=10s\"\ncap = 50\nretries = 3\n\
     hedge_after = \"40ms\"\n",
    "budget = \"token-bucket:max_tokens=4,token_ratio=0.1\"\ncap = 2\nretries = 3\n",
    "budget = \"ratio:percent=0.5,min_per_sec=10,ttl=10s\"\ncap = 6\nretries = 2\n\
     hedge_after = \"120ms\"\nmax_hedges = 2\n",
    "budget = \"ratio:percent=0.5,min_per_sec=10,ttl=10s\"\ncap = 50\nretries = 2\n\
     requests_per_minute = 12\n",
];

#[test]
fn the_simulator_and_the_tower_layer_live_one_request_life() {
    let scenarios: Vec<Scenario> = POLICIES.iter().map(|p| scenario(p)).collect();
    let mut runner = TestRunner::new_with_rng(
        Config { cases: 64, failure_persistence: None, ..Config::default() },
        TestRng::deterministic_rng(RngAlgorithm::ChaCha),
    );
    let strategy = (scripts(), 0..POLICIES.len());
    let retried = std::cell::Cell::new(0);
    runner
        .run(&strategy, |(requests, p)| {
            let sc = &scenarios[p];
            let sim = sim_log(sc, &requests);
            let tower = tower_log(sc, &requests);
            retried.set(
                retried.get()
                    + sim.iter().filter(|l| matches!(l.event, Event::Sent { n: 2.., .. })).count(),
            );
            prop_assert_eq!(&sim, &tower, "policy {}:\n{}", p, POLICIES[p]);
            Ok(())
        })
        .unwrap();
    assert!(retried.get() > 0, "the scripts retried nothing");
}

/// The log can tell two placements apart: the same script, one side with a budget of one
/// retry more, gives another log.
#[test]
fn a_placement_that_differs_is_caught() {
    let requests: Vec<ScriptedRequest> = (0..6)
        .map(|k| ScriptedRequest {
            at: ms(k * LANE_MS + k + 1),
            answers: vec![Answer::Unavailable(ms(LANE_MS)); 3],
        })
        .collect();
    let tight = scenario(POLICIES[4]);
    let looser =
        scenario("budget = \"token-bucket:max_tokens=10,token_ratio=0.1\"\ncap = 2\nretries = 3\n");
    assert_eq!(sim_log(&tight, &requests), tower_log(&tight, &requests));
    assert_ne!(sim_log(&looser, &requests), tower_log(&tight, &requests));
}

/// A first try that waits in the queue while a 429 puts a hold on the provider's window: when
/// its slot comes, it waits the hold out (holding the slot), within its queue timeout, and is
/// sent after it — in the layer and in the model alike. Request 0 takes the only slot and is
/// answered `429, Retry-After: 1` at 321 ms; request 1, queued behind it since 2 ms, gets the
/// slot then and reaches the dependency at 1 321 ms, not at 321 ms (the model sent it at once
/// until it learnt this step). With no room in its queue timeout for the hold, it is refused
/// `rate` instead.
#[test]
fn a_queued_first_try_waits_out_a_hold_that_began_while_it_queued() {
    let with = |queue_timeout: &str| {
        let text = format!(
            "duration = \"1s\"\n[fleet]\nrate = 1\n\
             [client]\nper_try_timeout = \"2s\"\ndeadline = \"10s\"\ntimeout_slot_hold = \"1920ms\"\n\
             retry_on = \"5xx,timeout\"\n\
             [dependency]\ncapacity = 1000\nservice_time = \"fixed 20ms\"\n\
             [[policy]]\nqueue = 4\nqueue_timeout = \"{queue_timeout}\"\nbackoff = \"160ms..640ms\"\n\
             jitter = \"none\"\nbudget = \"ratio:percent=0.5,min_per_sec=10,ttl=10s\"\ncap = 1\n\
             retries = 0\nrequests_per_minute = 600\n"
        );
        Scenario::parse("differential-hold.toml", &text).unwrap()
    };
    let requests = vec![
        ScriptedRequest { at: ms(1), answers: vec![Answer::TooMany(ms(320), 1)] },
        ScriptedRequest { at: ms(2), answers: vec![Answer::Ok(ms(160))] },
    ];
    let waits = with("5s");
    let sim = sim_log(&waits, &requests);
    assert_eq!(sim, tower_log(&waits, &requests));
    let sent = |log: &[Line]| {
        log.iter().find(|l| l.request == 1 && matches!(l.event, Event::Sent { .. })).map(|l| l.at)
    };
    assert_eq!(sent(&sim), Some(ms(1_321)), "{sim:#?}");
    let refused = with("500ms");
    let sim = sim_log(&refused, &requests);
    assert_eq!(sim, tower_log(&refused, &requests));
    assert_eq!(sent(&sim), None, "{sim:#?}");
    assert!(
        sim.iter().any(|l| l.request == 1
            && l.event == Event::Ended { ok: false, refused: Some(Denied::Rate) }),
        "{sim:#?}"
    );
}
