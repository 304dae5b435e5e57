//! What the tower layer tells an adaptive cap: an answer that says the dependency is overloaded
//! (429, 503, 529) and a per-try timeout are drops, and lower the working cap; a fast success
//! raises it (the dependency had room), and a 500 — a failure, not overload — leaves it where
//! the latency puts it. Virtual time: 20 requests at once every 100 ms for 15 s (the first 10
//! windows of 1 s learn the baseline, the cap holding still) against a
//! service that answers each way, with a planned cap of 20 adapting within 4..40.

use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::Full;
use stormguard_core::adaptive::AdaptiveConfig;
use stormguard_tower::{
    BoxError, Dependency, DependencyConfig, ReplayBody, Spawner, StormguardLayer,
};
use tower::{Layer, ServiceExt};

type Req = Request<ReplayBody<Full<Bytes>>>;

/// The working cap after 15 s of answers of `status`, each after `delay`.
async fn working_cap(status: u16, delay: Duration) -> u64 {
    let mut c = DependencyConfig::new("adaptive");
    c.limiter.cap = 20;
    c.limiter.adaptive = Some(AdaptiveConfig::new(4, 40));
    c.retry.max_retries = 0;
    c.per_try_timeout = Some(Duration::from_millis(100));
    c.background = Some(Spawner::tokio());
    let dep = Dependency::try_new(c).unwrap();
    let svc = tower::service_fn(move |_: Req| async move {
        tokio::time::sleep(delay).await;
        let resp = Response::builder().status(status).body(Full::new(Bytes::new())).unwrap();
        Ok::<_, BoxError>(resp)
    });
    let stack = StormguardLayer::new(dep.clone()).layer(svc);
    for _ in 0..150 {
        let calls: Vec<_> = (0..20)
            .map(|_| {
                let req = Request::get("http://dep/")
                    .body(ReplayBody::new(Full::new(Bytes::new()), 1024))
                    .unwrap();
                tokio::spawn(stack.clone().oneshot(req))
            })
            .collect();
        // The answers are held until all have come, so the attempts overlap (the cap is used,
        // not app-limited).
        let mut answers = Vec::new();
        for c in calls {
            answers.push(c.await.unwrap());
        }
        drop(answers);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    dep.upstream().limiter.effective_cap()
}

#[tokio::test(start_paused = true)]
async fn overload_answers_and_timeouts_lower_the_working_cap() {
    let ms = Duration::from_millis;
    for status in [429, 503, 529] {
        let cap = working_cap(status, ms(10)).await;
        assert!(cap < 20, "{status}: working cap {cap}");
    }
    // Every attempt times out (100 ms per try, the service takes 1 s).
    let cap = working_cap(200, ms(1_000)).await;
    assert!(cap < 20, "timeouts: working cap {cap}");
}

#[tokio::test(start_paused = true)]
async fn a_success_raises_it_and_a_plain_failure_does_not_lower_it() {
    let ms = Duration::from_millis;
    let ok = working_cap(200, ms(10)).await;
    assert!(ok > 20, "successes: working cap {ok}");
    let failed = working_cap(500, ms(10)).await;
    assert!(failed >= 20, "500s: working cap {failed}");
}
