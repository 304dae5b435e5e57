//! The stack around in-process services, on paused tokio time: admission, permits in bodies,
//! cancellation, timeouts and held slots, backoff, pushback, deadlines, scopes, shadow mode.

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use crate::support;
use bytes::Bytes;
use http::{Method, Request, Response};
use http_body_util::{BodyExt, Full};

use stormguard_core::Denied;
use stormguard_tower::{
    Deadline, Dependency, DependencyConfig, FanOutScope, ReplayBody, StormguardError,
    StormguardLayer,
};
use tokio::time::Instant;
use tower::{Layer, Service, ServiceExt};

type Req = Request<ReplayBody<Full<Bytes>>>;

fn request(method: Method) -> Req {
    Request::builder()
        .method(method)
        .uri("http://dep/x")
        .body(ReplayBody::new(Full::new(Bytes::from_static(b"body")), 1024))
        .unwrap()
}

fn dependency(f: impl FnOnce(&mut DependencyConfig)) -> Dependency {
    let mut c = DependencyConfig::new("dep");
    c.budget = "ratio:percent=10,min_per_sec=100".parse().unwrap();
    f(&mut c);
    Dependency::try_new(c).unwrap()
}

/// A status and the headers to answer with.
type Answer = (u16, Vec<(&'static str, &'static str)>);

/// A service answering with the statuses given, in order (then 200), counting attempts and
/// recording the time of each.
#[derive(Clone)]
struct Scripted {
    statuses: Arc<Vec<Answer>>,
    calls: Arc<AtomicU32>,
    times: Arc<std::sync::Mutex<Vec<Instant>>>,
    attempts_seen: Arc<std::sync::Mutex<Vec<String>>>,
    baggage_seen: Arc<std::sync::Mutex<Vec<String>>>,
}

impl Scripted {
    fn new(statuses: Vec<Answer>) -> Scripted {
        Scripted {
            statuses: Arc::new(statuses),
            calls: Arc::default(),
            times: Arc::default(),
            attempts_seen: Arc::default(),
            baggage_seen: Arc::default(),
        }
    }

    fn calls(&self) -> u32 {
        self.calls.load(Ordering::SeqCst)
    }
}

impl Service<Req> for Scripted {
    type Response = Response<Full<Bytes>>;
    type Error = Infallible;
    type Future = std::future::Ready<Result<Self::Response, Infallible>>;

    fn poll_ready(
        &mut self,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Infallible>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Req) -> Self::Future {
        let n = self.calls.fetch_add(1, Ordering::SeqCst) as usize;
        self.times.lock().unwrap().push(Instant::now());
        let attempt =
            req.headers().get("x-stormguard-attempt").map(|v| v.to_str().unwrap().to_string());
        self.attempts_seen.lock().unwrap().push(attempt.unwrap_or_default());
        let baggage = req.headers().get("baggage").map(|v| v.to_str().unwrap().to_string());
        self.baggage_seen.lock().unwrap().push(baggage.unwrap_or_default());
        let (status, headers) = self.statuses.get(n).cloned().unwrap_or((200, vec![]));
        let mut resp = Response::builder().status(status);
        for (k, v) in headers {
            resp = resp.header(k, v);
        }
        std::future::ready(Ok(resp.body(Full::new(Bytes::from(format!("answer {n}")))).unwrap()))
    }
}

async fn body_text<B>(resp: Response<B>) -> String
where
    B: http_body::Body,
    B::Error: std::fmt::Debug,
{
    String::from_utf8(resp.into_body().collect().await.unwrap().to_bytes().to_vec()).unwrap()
}

#[tokio::test(start_paused = true)]
async fn retries_a_503_after_a_backoff_and_marks_attempts() {
    let dep = dependency(|_| {});
    let svc = Scripted::new(vec![(503, vec![])]);
    let stack = StormguardLayer::new(dep.clone()).layer(svc.clone());
    let resp = stack.oneshot(request(Method::GET)).await.unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(body_text(resp).await, "answer 1");
    assert_eq!(svc.calls(), 2);
    // The first attempt goes unmarked; a retry carries its number.
    assert_eq!(*svc.attempts_seen.lock().unwrap(), ["", "2"]);
    let s = dep.snapshot();
    assert_eq!((s.counters.primaries, s.counters.retries), (1, 1));
    assert_eq!(s.limiter.in_flight, 0, "every slot came back");
    // The backoff is full jitter of 25 ms: at most 25 ms between the attempts.
    let t = svc.times.lock().unwrap().clone();
    assert!(t[1] - t[0] <= Duration::from_millis(25));
}

#[tokio::test(start_paused = true)]
async fn a_refused_retry_returns_the_last_response_with_the_reason() {
    let dep = dependency(|c| c.budget = "ratio:percent=0,min_per_sec=0".parse().unwrap());
    let svc = Scripted::new(vec![(503, vec![])]);
    let resp = StormguardLayer::new(dep.clone())
        .layer(svc.clone())
        .oneshot(request(Method::GET))
        .await
        .unwrap();
    assert_eq!(resp.status(), 503);
    assert_eq!(resp.extensions().get::<Denied>(), Some(&Denied::Budget));
    assert_eq!(body_text(resp).await, "answer 0");
    assert_eq!(svc.calls(), 1);
    assert_eq!(dep.snapshot().counters.denied(Denied::Budget), 1);
}

#[tokio::test(start_paused = true)]
async fn a_post_is_not_retried_into_a_double_payment() {
    let dep = dependency(|_| {});
    let svc = Scripted::new(vec![(503, vec![])]);
    let resp = StormguardLayer::new(dep.clone())
        .layer(svc.clone())
        .oneshot(request(Method::POST))
        .await
        .unwrap();
    assert_eq!(resp.status(), 503);
    assert_eq!(resp.extensions().get::<Denied>(), Some(&Denied::NonIdempotent));
    assert_eq!(svc.calls(), 1);
    // With an idempotency key it is.
    let svc = Scripted::new(vec![(503, vec![])]);
    let mut req = request(Method::POST);
    req.headers_mut().insert("idempotency-key", "pay-7".parse().unwrap());
    let resp = StormguardLayer::new(dep).layer(svc.clone()).oneshot(req).await.unwrap();
    assert_eq!((resp.status().as_u16(), svc.calls()), (200, 2));
}

#[tokio::test(start_paused = true)]
async fn retry_after_replaces_the_backoff_and_holds_other_retries() {
    let dep = dependency(|c| c.retry.retry_on = "5xx,429".parse().unwrap());
    let svc = Scripted::new(vec![(429, vec![("retry-after", "2")])]);
    let stack = StormguardLayer::new(dep.clone()).layer(svc.clone());
    let start = Instant::now();
    let resp = stack.clone().oneshot(request(Method::GET)).await.unwrap();
    assert_eq!(resp.status(), 200);
    let waited = svc.times.lock().unwrap()[1] - start;
    assert!(
        waited >= Duration::from_secs(2) && waited <= Duration::from_millis(2_400),
        "{waited:?}"
    );
    // During a fresh hold, another request's retry is refused with `pushback`.
    let svc2 = Scripted::new(vec![(429, vec![("retry-after", "5")]), (503, vec![])]);
    let stack2 = StormguardLayer::new(dep.clone()).layer(svc2.clone());
    let first = tokio::spawn(stack2.clone().oneshot(request(Method::GET)));
    tokio::time::sleep(Duration::from_millis(1)).await;
    let resp = stack2.oneshot(request(Method::GET)).await.unwrap();
    assert_eq!(resp.extensions().get::<Denied>(), Some(&Denied::Pushback));
    assert_eq!(first.await.unwrap().unwrap().status(), 200);
}

#[tokio::test(start_paused = true)]
async fn the_deadline_refuses_a_retry_that_cannot_finish() {
    let dep = dependency(|c| c.retry.retry_on = "5xx,429".parse().unwrap());
    let svc = Scripted::new(vec![(429, vec![("retry-after", "3")])]);
    let mut req = request(Method::GET);
    req.extensions_mut().insert(Deadline::after(Duration::from_secs(1)));
    let resp = StormguardLayer::new(dep.clone()).layer(svc.clone()).oneshot(req).await.unwrap();
    assert_eq!(resp.extensions().get::<Denied>(), Some(&Denied::Deadline));
    assert_eq!(svc.calls(), 1);
}

#[tokio::test(start_paused = true)]
async fn a_fan_out_scope_is_shared_by_its_calls() {
    let dep = dependency(|_| {});
    let svc = Scripted::new(vec![(503, vec![]), (200, vec![]), (503, vec![])]);
    let stack = StormguardLayer::new(dep.clone()).layer(svc.clone());
    let scope = FanOutScope::new(1);
    let mut a = request(Method::GET);
    a.extensions_mut().insert(scope.clone());
    let mut b = request(Method::GET);
    b.extensions_mut().insert(scope.clone());
    assert_eq!(stack.clone().oneshot(a).await.unwrap().status(), 200, "the first call retries");
    let resp = stack.oneshot(b).await.unwrap();
    assert_eq!(resp.status(), 503);
    assert_eq!(resp.extensions().get::<Denied>(), Some(&Denied::Scope), "the second may not");
}

/// The call tree's allowance bounds retries the dependency's own budget would allow, each
/// retry tells the hops below it is an extra, and a refusal names the tree.
#[tokio::test(start_paused = true)]
async fn a_call_trees_allowance_bounds_retries_and_marks_them_below() {
    let run = |tree: Option<&'static str>| async move {
        // The dependency's own budget allows every retry: only the tree can refuse.
        let dep = dependency(|c| c.budget = "ratio:percent=100,min_per_sec=100".parse().unwrap());
        let svc = Scripted::new(vec![(503, vec![]); 100]);
        let stack = StormguardLayer::new(dep.clone()).layer(svc.clone());
        let mut refused = 0;
        for _ in 0..20 {
            let mut req = request(Method::GET);
            if let Some(t) = tree {
                req.headers_mut().insert("baggage", format!("app=1,{t}").parse().unwrap());
            }
            let resp = stack.clone().oneshot(req).await.unwrap();
            refused += usize::from(resp.extensions().get::<Denied>() == Some(&Denied::Tree));
        }
        let seen = svc.baggage_seen.lock().unwrap().clone();
        (svc.calls(), refused, seen, dep.snapshot().tree, dep)
    };
    // 20 actions that may make 1.1 attempts each: 2 retries in all.
    let (calls, refused, seen, counts, tree_dep) = run(Some("stormguard-tree=1.1")).await;
    assert_eq!(calls, 22);
    // 18 refused their first retry, the 2 that retried their second (max_retries 2).
    assert_eq!(refused, 20);
    assert_eq!((counts.originals, counts.extras_above, counts.charged), (20, 0, 2));
    let text = metrics_text(&tree_dep);
    // Nothing charged here was refused after its charge (the cap had room for every retry).
    assert_eq!(counts.refunded, 0);
    for line in [
        r#"stormguard_tree_attempts_total{dependency="dep",kind="original"} 20"#,
        r#"stormguard_tree_attempts_total{dependency="dep",kind="extra_here"} 2"#,
        r#"stormguard_tree_attempts_total{dependency="dep",kind="extra_refunded"} 0"#,
        r#"stormguard_denied_total{dependency="dep",reason="tree"} 20"#,
    ] {
        assert!(text.lines().any(|l| l == line), "{line} in\n{text}");
    }
    let extras: Vec<_> = seen.iter().filter(|b| b.contains("spent=1")).collect();
    assert_eq!(extras.len(), 2, "each retry carries one more spent: {seen:?}");
    assert!(extras.iter().all(|b| b.starts_with("app=1,")), "other members kept: {extras:?}");
    // Without a context (and with a malformed one) the budget alone decides: every retry goes.
    assert_eq!(run(None).await.0, 60, "two retries each");
    let (calls, _, _, counts, _) = run(Some("stormguard-tree=lots")).await;
    assert_eq!((calls, counts.originals), (60, 0), "a context that does not read is ignored");
}

#[tokio::test(start_paused = true)]
async fn shadow_mode_counts_but_retries() {
    let dep = dependency(|c| {
        c.budget = "ratio:percent=0,min_per_sec=0".parse().unwrap();
        c.retry.enforce = false;
    });
    let svc = Scripted::new(vec![(503, vec![])]);
    let resp = StormguardLayer::new(dep.clone())
        .layer(svc.clone())
        .oneshot(request(Method::GET))
        .await
        .unwrap();
    assert_eq!((resp.status().as_u16(), svc.calls()), (200, 2));
    let c = dep.snapshot().counters;
    assert_eq!((c.shadow_denied(Denied::Budget), c.denied(Denied::Budget)), (1, 0));
}

/// A service that answers after a delay, keeping count of what it is working on, and keeps
/// working when the caller gives up (like a real server).
use support::Upstream as Slow;

#[tokio::test(start_paused = true)]
async fn the_slot_lasts_until_the_body_ends_or_is_dropped() {
    let dep = dependency(|c| {
        c.limiter.cap = 1;
        c.limiter.queue_len = 0;
    });
    let stack = StormguardLayer::new(dep.clone()).layer(Slow::new(Duration::from_millis(5)));
    let resp = stack.clone().oneshot(request(Method::GET)).await.unwrap();
    assert_eq!(dep.upstream().limiter.in_flight(), 1, "headers arrived; the body holds the slot");
    let err = stack.clone().oneshot(request(Method::GET)).await.unwrap_err();
    assert_eq!(
        err.downcast_ref::<StormguardError>().and_then(StormguardError::denied),
        Some(Denied::Queue)
    );
    drop(resp); // dropped early, unread
    assert_eq!(dep.upstream().limiter.in_flight(), 0);
    let resp = stack.clone().oneshot(request(Method::GET)).await.unwrap();
    assert_eq!(body_text(resp).await, "ok");
    assert_eq!(dep.upstream().limiter.in_flight(), 0, "read to the end");
}

#[tokio::test(start_paused = true)]
async fn a_cancelled_request_gives_its_slot_and_queue_place_back() {
    let dep = dependency(|c| {
        c.limiter.cap = 1;
        c.limiter.queue_len = 4;
    });
    let stack = StormguardLayer::new(dep.clone()).layer(Slow::new(Duration::from_secs(10)));
    let first = tokio::spawn(stack.clone().oneshot(request(Method::GET)));
    tokio::time::sleep(Duration::from_millis(1)).await;
    let queued = tokio::spawn(stack.clone().oneshot(request(Method::GET)));
    tokio::time::sleep(Duration::from_millis(1)).await;
    assert_eq!((dep.upstream().limiter.in_flight(), dep.upstream().limiter.queued()), (1, 1));
    queued.abort();
    let _ = queued.await;
    assert_eq!(dep.upstream().limiter.queued(), 0, "the cancelled waiter left the queue");
    first.abort();
    let _ = first.await;
    assert_eq!(dep.upstream().limiter.in_flight(), 0, "the cancelled attempt freed its slot");
}

/// The service under the layer learns how long a first try waited for its slot
/// ([`SlotWait`](stormguard_tower::SlotWait), what the proxy's access log reports): the time it
/// queued behind a slow request, and nothing for one admitted at once.
#[tokio::test(start_paused = true)]
async fn a_first_try_that_queued_tells_the_service_below_how_long() {
    let dep = dependency(|c| {
        c.limiter.cap = 1;
        c.limiter.queue_len = 4;
        c.limiter.queue_timeout = Duration::from_secs(10);
    });
    let waits = Arc::new(std::sync::Mutex::new(Vec::new()));
    let seen = waits.clone();
    let below = tower::service_fn(move |req: Req| {
        let wait = req.extensions().get::<stormguard_tower::SlotWait>().map(|w| w.0);
        seen.lock().unwrap().push(wait);
        async move {
            tokio::time::sleep(Duration::from_millis(300)).await;
            Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"ok"))))
        }
    });
    let stack = StormguardLayer::new(dep.clone()).layer(below);
    let first = tokio::spawn(stack.clone().oneshot(request(Method::GET)));
    tokio::time::sleep(Duration::from_millis(100)).await;
    let queued = tokio::spawn(stack.clone().oneshot(request(Method::GET)));
    // The first answer's body is read to its end: the slot comes back at 300 ms.
    body_text(first.await.unwrap().unwrap()).await;
    body_text(queued.await.unwrap().unwrap()).await;
    let waits = waits.lock().unwrap().clone();
    assert_eq!(waits.len(), 2, "{waits:?}");
    assert_eq!(waits[0], None, "admitted at once");
    assert_eq!(waits[1], Some(Duration::from_millis(200)), "queued from 100 ms to 300 ms");
}

#[tokio::test(start_paused = true)]
async fn a_timed_out_attempt_holds_its_slot_while_the_dependency_works() {
    let dep = dependency(|c| {
        c.limiter.cap = 2;
        c.limiter.queue_len = 0;
        c.per_try_timeout = Some(Duration::from_millis(100));
        c.timeout_slot_hold = Duration::from_millis(100);
        c.retry.retry_on = "5xx,timeout".parse().unwrap();
        c.retry.max_retries = 1;
    });
    let slow = Slow::new(Duration::from_millis(180));
    let stack = StormguardLayer::new(dep.clone()).layer(slow.clone());
    let err = stack.oneshot(request(Method::GET)).await.unwrap_err();
    // The retry timed out too, and no third attempt is allowed: the caller is told why.
    let Some(StormguardError::NotRetried { reason, source }) = err.downcast_ref() else {
        panic!("{err:?}")
    };
    assert_eq!(*reason, stormguard_tower::Denied::Attempts);
    assert!(matches!(source.downcast_ref::<StormguardError>(), Some(StormguardError::Timeout)));
    // Two attempts timed out; both are still held (100 ms past each timeout).
    assert!(dep.upstream().limiter.in_flight() >= 1);
    assert!(slow.max.load(Ordering::SeqCst) <= 2, "never more than the cap at the dependency");
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(dep.snapshot().limiter.in_flight, 0, "holds pass");
}

#[tokio::test(start_paused = true)]
async fn readiness_is_the_inner_services() {
    let (mock, mut handle) = tower_test::mock::pair::<Req, Response<Full<Bytes>>>();
    let dep = dependency(|_| {});
    let mut stack = tower_test::mock::Spawn::new(StormguardLayer::new(dep).layer(mock));
    handle.allow(0);
    assert!(stack.poll_ready().is_pending());
    handle.allow(1);
    assert!(stack.poll_ready().is_ready());
}

#[tokio::test(start_paused = true)]
async fn a_malformed_retry_after_is_ignored_and_counted() {
    let dep = dependency(|c| c.retry.retry_on = "5xx,429".parse().unwrap());
    let svc = Scripted::new(vec![(429, vec![("retry-after", "soon-ish")])]);
    let start = Instant::now();
    let resp = StormguardLayer::new(dep.clone())
        .layer(svc.clone())
        .oneshot(request(Method::GET))
        .await
        .unwrap();
    assert_eq!(resp.status(), 200, "retried on the normal backoff");
    assert!(svc.times.lock().unwrap()[1] - start <= Duration::from_millis(25));
    assert_eq!(dep.snapshot().malformed_headers.total(), 1);
}

/// With a background spawner, a timed-out attempt's slot comes back when the dependency
/// answers; without one it is held for the whole hold.
#[tokio::test(start_paused = true)]
async fn a_held_slot_comes_back_when_the_dependency_answers() {
    for background in [true, false] {
        let dep = dependency(|c| {
            c.limiter.cap = 1;
            c.limiter.queue_len = 0;
            c.per_try_timeout = Some(Duration::from_millis(100));
            c.timeout_slot_hold = Duration::from_secs(1);
            c.retry.max_retries = 0;
            if background {
                c.background = Some(stormguard_tower::Spawner::new(|f| {
                    tokio::spawn(f);
                }));
            }
        });
        let start = Instant::now();
        let err = StormguardLayer::new(dep.clone())
            .layer(Slow::new(Duration::from_millis(180)))
            .oneshot(request(Method::GET))
            .await
            .unwrap_err();
        // The timeout is retryable by default; with max_retries 0 it is not retried.
        let Some(StormguardError::NotRetried { reason: Denied::Attempts, source }) =
            err.downcast_ref::<StormguardError>()
        else {
            panic!("{err}")
        };
        assert!(matches!(source.downcast_ref::<StormguardError>(), Some(StormguardError::Timeout)));
        tokio::time::sleep_until(start + Duration::from_millis(150)).await;
        assert_eq!(dep.snapshot().limiter.in_flight, 1, "held while the dependency works");
        tokio::time::sleep_until(start + Duration::from_millis(200)).await;
        let expected = if background { 0 } else { 1 };
        assert_eq!(dep.snapshot().limiter.in_flight, expected, "background {background}");
        tokio::time::sleep_until(start + Duration::from_millis(1_200)).await;
        assert_eq!(dep.snapshot().limiter.in_flight, 0, "the hold passed");
    }
}

/// A concurrency budget counts a retry until it finishes: a failed retry no longer counts
/// when the next one is decided. With room for one retry in flight, a request may retry twice
/// in a row (each retry alone in flight); counting the first until the second is admitted
/// would refuse the second with `budget`.
#[tokio::test(start_paused = true)]
async fn a_failed_retry_stops_counting_before_the_next_is_decided() {
    let dep = dependency(|c| {
        c.budget = "concurrency:percent=0,min=1".parse().unwrap();
        c.retry.max_retries = 2;
    });
    let svc = Scripted::new(vec![(503, vec![]), (503, vec![])]);
    let resp =
        StormguardLayer::new(dep.clone()).layer(svc.clone()).oneshot(request(Method::GET)).await;
    assert_eq!(resp.unwrap().status(), 200, "the second retry was allowed and answered");
    assert_eq!(svc.calls(), 3);
    assert_eq!(dep.snapshot().counters.denied(Denied::Budget), 0);
}

/// Rate admission: with one request a minute left, a retry is refused `rate` at once (it never
/// waits for the window, and the budget is not charged), and the dependency saw one attempt; without rate admission the same
/// retry is sent.
#[tokio::test(start_paused = true)]
async fn a_retry_finds_no_room_in_the_window_and_is_refused_rate() {
    for rated in [true, false] {
        let dep = dependency(|c| {
            if rated {
                c.rate.requests_per_minute = Some(1);
            }
        });
        let svc = Scripted::new(vec![(503, vec![])]);
        let result = StormguardLayer::new(dep.clone())
            .layer(svc.clone())
            .oneshot(request(Method::GET))
            .await;
        if rated {
            // The caller gets the failed attempt's answer, marked with why it was not retried
            // (as for a spent budget), and the budget was not charged for it.
            let resp = result.unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(resp.status(), 503);
            assert_eq!(resp.extensions().get::<Denied>(), Some(&Denied::Rate));
            assert_eq!(svc.calls(), 1, "the dependency saw the first try only");
            assert_eq!(dep.snapshot().counters.retries, 0, "no retry counted as sent");
            // A first try now waits for the window (a minute), past the queue timeout (1 s):
            // refused `rate` too, without reaching the dependency.
            let svc2 = Scripted::new(vec![]);
            let second = StormguardLayer::new(dep.clone())
                .layer(svc2.clone())
                .oneshot(request(Method::GET))
                .await;
            assert!(matches!(
                second.err().and_then(|e| e
                    .downcast_ref::<StormguardError>()
                    .map(|e| matches!(e, StormguardError::Denied(Denied::Rate)))),
                Some(true)
            ));
            assert_eq!(svc2.calls(), 0);
            assert_eq!(dep.snapshot().limiter.in_flight, 0);
        } else {
            assert_eq!(result.unwrap().status(), 200);
            assert_eq!(svc.calls(), 2);
        }
    }
}

/// The upstream's own `x-should-retry: false` (a model provider's "this will not get better")
/// is obeyed: the 503 is returned with `pushback`, and the dependency saw one attempt; the same
/// 503 without it is retried.
#[tokio::test(start_paused = true)]
async fn the_upstreams_x_should_retry_false_is_obeyed() {
    for said in [true, false] {
        let dep = dependency(|_| {});
        let headers = if said { vec![("x-should-retry", "false")] } else { vec![] };
        let svc = Scripted::new(vec![(503, headers)]);
        let resp = StormguardLayer::new(dep.clone())
            .layer(svc.clone())
            .oneshot(request(Method::GET))
            .await;
        let resp = resp.unwrap_or_else(|e| panic!("{e}"));
        if said {
            assert_eq!(resp.status(), 503);
            assert_eq!(resp.extensions().get::<Denied>(), Some(&Denied::Pushback));
            assert_eq!(svc.calls(), 1);
        } else {
            assert_eq!(resp.status(), 200);
            assert_eq!(svc.calls(), 2);
        }
    }
}

/// A retry the caller sent itself (the proxy marks it [`CallerRetry`]) is a retry here too: it
/// deposits nothing, spends the budget, is sent marked as the caller's attempt and not retried
/// again; with no budget left it is refused at once, and the upstream never sees it.
#[tokio::test(start_paused = true)]
async fn a_callers_own_retry_spends_the_budget() {
    use stormguard_core::budget::FailureKind;
    use stormguard_tower::CallerRetry;
    // A reserve of one retry a window (0.1/s × 10 s), no share of traffic.
    let dep = dependency(|c| c.budget = "ratio:percent=0,min_per_sec=0.1".parse().unwrap());
    let svc = Scripted::new(vec![(503, vec![]), (503, vec![])]);
    let stack = StormguardLayer::new(dep.clone()).layer(svc.clone());
    let retry = || {
        let mut req = request(Method::GET);
        req.extensions_mut().insert(CallerRetry { attempt: 2, after: FailureKind::Error });
        req
    };
    let resp = stack.clone().oneshot(retry()).await.unwrap();
    assert_eq!(resp.status(), 503);
    // Sent once, as the caller's second attempt; stormguard does not retry it on top.
    assert_eq!(resp.extensions().get::<Denied>(), Some(&Denied::Stacked));
    assert_eq!(*svc.attempts_seen.lock().unwrap(), ["2"]);
    let e = stack.clone().oneshot(retry()).await.unwrap_err();
    assert!(matches!(e.downcast_ref(), Some(StormguardError::Denied(Denied::Budget))), "{e}");
    assert_eq!(svc.calls(), 1, "the refused one never reached the upstream");
    let c = dep.snapshot().counters;
    assert_eq!((c.primaries, c.retries, c.denied(Denied::Budget)), (0, 1, 1));
    assert_eq!(c.caller_retries, [1, 1, 0]);
    // Unmarked, the same request is a first try: it is sent (and deposits).
    assert_eq!(stack.oneshot(request(Method::GET)).await.unwrap().status(), 503);
    assert_eq!(svc.calls(), 2);
}

/// A caller's retry takes its slot at once or not at all: with the cap full it is refused
/// `cap` at once, where a first try waits in the queue.
#[tokio::test(start_paused = true)]
async fn a_callers_own_retry_never_queues() {
    use stormguard_core::AttemptKind;
    use stormguard_core::budget::FailureKind;
    use stormguard_tower::CallerRetry;
    let dep = dependency(|c| {
        c.limiter.cap = 1;
        c.limiter.queue_len = 10;
    });
    let held = dep.upstream_at(0).limiter.try_acquire(AttemptKind::Primary).unwrap();
    let svc = Scripted::new(vec![]);
    let stack = StormguardLayer::new(dep.clone()).layer(svc.clone());
    let balance = || dep.policy().budget().snapshot(dep.now()).balance;
    let before = balance();
    let mut req = request(Method::GET);
    req.extensions_mut().insert(CallerRetry { attempt: 3, after: FailureKind::Error });
    let e = tokio::time::timeout(Duration::from_millis(1), stack.clone().oneshot(req))
        .await
        .expect("refused at once")
        .unwrap_err();
    assert!(matches!(e.downcast_ref(), Some(StormguardError::Denied(Denied::Cap))), "{e}");
    // The budget's charge came back with the refusal.
    assert_eq!(balance(), before);
    assert_eq!(dep.snapshot().counters.caller_retries, [0, 1, 0]);
    let first = tokio::spawn(stack.oneshot(request(Method::GET)));
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(!first.is_finished(), "a first try waits for the slot");
    drop(held);
    assert_eq!(first.await.unwrap().unwrap().status(), 200);
    assert_eq!(*svc.attempts_seen.lock().unwrap(), [""]);
}

/// The dependency's series as Prometheus text.
fn metrics_text(dep: &Dependency) -> String {
    let mut registry = prometheus_client::registry::Registry::default();
    stormguard_tower::metrics::register(&mut registry, dep);
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
    text
}
