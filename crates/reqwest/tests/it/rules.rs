//! Each rule through reqwest, judged at the upstream: what reached it, and when. Where a rule
//! guards against something, the same request without stormguard shows the harm.

use crate::support;

use std::sync::OnceLock;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::Full;
use reqwest_middleware::ClientBuilder;
use reqwest_retry::RetryTransientMiddleware;
use reqwest_retry::policies::ExponentialBackoff;
use stormguard_chaos::{Latency, Phase};
use stormguard_core::breaker::BreakerConfig;
use stormguard_reqwest::{Deadline, Denied, Idempotent, Refusal, StormguardError};
use support::{chaos, dependency, guarded, ms, plain, scripted};

/// A budget that never refuses, so each test sees the one rule it is about.
const RICH: &str = "ratio:percent=10,min_per_sec=100";

fn rich() -> stormguard_reqwest::Dependency {
    dependency(|c| c.budget = RICH.parse().unwrap())
}

fn unavailable() -> (u16, Vec<(&'static str, String)>) {
    (503, Vec::new())
}

/// An upstream that answers 503 with `Retry-After: 2` until two seconds after its first answer,
/// and 200 from then on. Returns it and the instant the 503s stop.
async fn asks_for_two_seconds() -> (support::Scripted, &'static OnceLock<Instant>) {
    asks_for(2).await
}

/// An upstream that answers 503 with `Retry-After: secs` until `secs` seconds after its first
/// answer, and 200 from then on.
async fn asks_for(secs: u64) -> (support::Scripted, &'static OnceLock<Instant>) {
    let until: &'static OnceLock<Instant> = Box::leak(Box::new(OnceLock::new()));
    let server = scripted(move |_, arrived| {
        let until = *until.get_or_init(|| Instant::now() + Duration::from_secs(secs));
        if arrived < until { (503, vec![("retry-after", secs.to_string())]) } else { (200, vec![]) }
    })
    .await;
    (server, until)
}

#[tokio::test]
async fn retry_after_is_honoured_and_reqwest_retry_ignores_it() {
    let (server, until) = asks_for_two_seconds().await;
    let client = guarded(&rich());
    let resp = client.get(server.url("/")).send().await.unwrap();
    assert_eq!(resp.status(), 200, "the retry after the wait succeeded");
    let seen = server.seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 2, "one 503, one retry");
    let until = *until.get().unwrap();
    assert!(seen[1].arrived >= until, "the retry came {:?} early", until - seen[1].arrived);

    // reqwest-retry's backoff does not read Retry-After: its retries (10–100 ms apart) come
    // while the upstream still asks to be left alone — for a minute, so that only a stall of a
    // minute could make this half pass for the wrong reason.
    let (server, until) = asks_for(60).await;
    let policy = ExponentialBackoff::builder()
        .retry_bounds(Duration::from_millis(10), Duration::from_millis(100))
        .build_with_max_retries(2);
    let client =
        ClientBuilder::new(plain()).with(RetryTransientMiddleware::new_with_policy(policy)).build();
    let resp = client.get(server.url("/")).send().await.unwrap();
    let until = *until.get().unwrap();
    let early = server.seen.lock().unwrap().iter().skip(1).filter(|s| s.arrived < until).count();
    assert!(early >= 1, "reqwest-retry waited out Retry-After ({})", resp.status());
}

#[tokio::test]
async fn a_pushback_past_the_deadline_is_not_waited_for() {
    let (server, _) = asks_for_two_seconds().await;
    let client = guarded(&rich());
    let resp = client
        .get(server.url("/"))
        .with_extension(Deadline::after(Duration::from_millis(500)))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 503);
    assert_eq!(resp.denied(), Some(Denied::Deadline));
    assert_eq!(server.count(), 1);
}

#[tokio::test]
async fn a_post_is_never_retried_after_a_reset_after_write() {
    // The upstream reads each request, then resets the connection: the request may have been
    // processed.
    let upstream =
        chaos(Phase { reset_rate: 1.0, latency: Latency::Fixed(ms(5)), ..Phase::default() }).await;
    let url = upstream.url("/pay");
    let client = guarded(&rich());
    let err = client.post(&url).body("pay 10").send().await.unwrap_err();
    assert_eq!(err.denied(), Some(Denied::NonIdempotent), "{err:?}");
    let seen = upstream.reset();
    assert_eq!(seen.total.requests, 1, "a POST reached the upstream {} times", seen.total.requests);
    assert_eq!(seen.total.resets, 1);

    // With an idempotency key (or the Idempotent extension) the same POST may be retried.
    let err = client
        .post(&url)
        .header("idempotency-key", "order-7")
        .body("pay 10")
        .send()
        .await
        .unwrap_err();
    assert_eq!(err.denied(), Some(Denied::Attempts), "{err:?}");
    assert_eq!(upstream.reset().total.requests, 3, "the first try and max_retries = 2");
    let err = client.post(&url).with_extension(Idempotent).body("x").send().await.unwrap_err();
    assert_eq!(err.denied(), Some(Denied::Attempts));
    assert_eq!(upstream.reset().total.requests, 3);

    // reqwest-retry does not look at the method: the payment goes out three times.
    let policy = ExponentialBackoff::builder()
        .retry_bounds(Duration::from_millis(1), Duration::from_millis(10))
        .build_with_max_retries(2);
    let naive =
        ClientBuilder::new(plain()).with(RetryTransientMiddleware::new_with_policy(policy)).build();
    let _ = naive.post(&url).body("pay 10").send().await.unwrap_err();
    assert_eq!(upstream.reset().total.requests, 3, "reqwest-retry resent the POST");
    upstream.shutdown().await;
}

#[tokio::test]
async fn a_streaming_body_is_sent_once_and_its_retry_refused_as_body() {
    let server = scripted(|_, _| unavailable()).await;
    let client = guarded(&rich());
    let body = reqwest::Body::wrap(Full::new(Bytes::from_static(b"stream")));
    let resp = client.put(server.url("/")).body(body).send().await.unwrap();
    assert_eq!(resp.status(), 503);
    assert_eq!(resp.denied(), Some(Denied::Body));
    assert_eq!(server.count(), 1);
    // The same bytes as a reusable body are retried.
    let resp = client.put(server.url("/")).body("stream").send().await.unwrap();
    assert_eq!(resp.denied(), Some(Denied::Attempts));
    assert_eq!(server.count(), 4);
}

#[tokio::test]
async fn the_slot_is_held_until_the_response_body_ends_or_is_dropped() {
    let server = scripted(|_, _| (200, vec![])).await;
    let dep = rich();
    let client = guarded(&dep);
    let limiter = &dep.upstream().limiter;
    let resp = client.get(server.url("/?q=1")).send().await.unwrap();
    assert_eq!(limiter.in_flight(), 1, "headers are here, the body is not read yet");
    // The response is reqwest's as it was: its URL, its length, its connection info.
    assert_eq!(resp.url().as_str(), server.url("/?q=1"));
    assert_eq!(resp.content_length(), Some(6));
    assert_eq!(resp.remote_addr(), Some(server.addr));
    drop(resp);
    assert_eq!(limiter.in_flight(), 0, "a dropped body frees its slot");
    let resp = client.get(server.url("/")).send().await.unwrap();
    assert_eq!(limiter.in_flight(), 1);
    assert_eq!(resp.bytes().await.unwrap(), "answer");
    assert_eq!(limiter.in_flight(), 0, "a body read to its end frees its slot");
}

#[tokio::test]
async fn a_first_try_waits_in_the_queue_or_is_refused_when_it_is_full() {
    let server = scripted(|_, _| (200, vec![])).await;
    let dep = dependency(|c| {
        c.limiter.cap = 1;
        c.limiter.queue_len = 0;
    });
    let client = guarded(&dep);
    let held = client.get(server.url("/")).send().await.unwrap();
    let err = client.get(server.url("/")).send().await.unwrap_err();
    assert_eq!(err.denied(), Some(Denied::Queue), "{err:?}");
    assert!(matches!(
        err,
        reqwest_middleware::Error::Middleware(ref e)
            if matches!(e.downcast_ref(), Some(StormguardError::Denied(Denied::Queue)))
    ));
    assert_eq!(server.count(), 1, "a refused first try never reaches the upstream");
    drop(held);
    assert_eq!(client.get(server.url("/")).send().await.unwrap().status(), 200);
    assert_eq!(dep.snapshot().counters.primaries_refused, 1);
}

/// A request of a call tree (its `stormguard-tree` baggage member): its retries come out of
/// the tree's allowance, here 1.1 attempts per request, though the budget would allow all.
#[tokio::test]
async fn retries_are_charged_to_the_call_tree() {
    let server = scripted(|_, _| unavailable()).await;
    let dep = rich();
    let client = guarded(&dep);
    let mut tree = 0;
    for _ in 0..20 {
        let resp = client
            .get(server.url("/"))
            .header("baggage", "stormguard-tree=1.1")
            .send()
            .await
            .unwrap();
        tree += usize::from(resp.denied() == Some(Denied::Tree));
    }
    assert_eq!(server.count(), 22, "two extra attempts for twenty requests");
    assert_eq!(tree, 20, "every request ends refused by the tree");
    assert_eq!(dep.snapshot().tree.charged, 2);
    // Without the context, the budget alone: two retries each.
    let plain = scripted(|_, _| unavailable()).await;
    for _ in 0..20 {
        guarded(&rich()).get(plain.url("/")).send().await.unwrap();
    }
    assert_eq!(plain.count(), 60);
}

#[tokio::test]
async fn shadow_mode_counts_what_it_would_refuse_and_sends_it() {
    let spent = "ratio:percent=0,min_per_sec=0";
    let server = scripted(|_, _| unavailable()).await;
    let enforced = dependency(|c| c.budget = spent.parse().unwrap());
    let resp = guarded(&enforced).get(server.url("/")).send().await.unwrap();
    assert_eq!(resp.denied(), Some(Denied::Budget));
    assert_eq!(server.count(), 1);

    let shadow = dependency(|c| {
        c.budget = spent.parse().unwrap();
        c.retry.enforce = false;
    });
    let resp = guarded(&shadow).get(server.url("/")).send().await.unwrap();
    // The request's own rules hold in shadow mode: two retries, then `attempts`.
    assert_eq!(resp.denied(), Some(Denied::Attempts));
    assert_eq!(server.count(), 1 + 3);
    let c = shadow.snapshot().counters;
    assert_eq!((c.shadow_denied(Denied::Budget), c.denied(Denied::Budget), c.retries), (2, 0, 2));
}

#[tokio::test]
async fn an_open_breaker_refuses_retries_and_first_tries_without_reaching_the_upstream() {
    let server = scripted(|_, _| unavailable()).await;
    let dep = dependency(|c| {
        c.budget = RICH.parse().unwrap();
        c.breaker = Some(BreakerConfig {
            consecutive_failures: Some(1),
            break_duration: Duration::from_secs(60),
            ..BreakerConfig::default()
        });
    });
    let client = guarded(&dep);
    let resp = client.get(server.url("/")).send().await.unwrap();
    assert_eq!(resp.denied(), Some(Denied::Breaker), "the first 503 opened it");
    let err = client.get(server.url("/")).send().await.unwrap_err();
    assert_eq!(err.denied(), Some(Denied::Breaker));
    assert_eq!(server.count(), 1);
}

#[tokio::test]
async fn a_timed_out_attempt_is_retried_and_keeps_its_slot_while_the_upstream_works() {
    // The upstream takes a minute and keeps working when the client gives up.
    let minute = Latency::Fixed(Duration::from_secs(60));
    let upstream = chaos(Phase { latency: minute, ..Phase::default() }).await;
    let dep = dependency(|c| {
        c.budget = RICH.parse().unwrap();
        c.retry.max_retries = 1;
        c.per_try_timeout = Some(ms(100));
    });
    let client = guarded(&dep);
    let err = client.get(upstream.url("/")).send().await.unwrap_err();
    assert_eq!(err.denied(), Some(Denied::Attempts), "{err:?}");
    let Some(StormguardError::NotRetried { source, .. }) = (match &err {
        reqwest_middleware::Error::Middleware(e) => e.downcast_ref::<StormguardError>(),
        _ => None,
    }) else {
        panic!("{err:?}")
    };
    assert!(matches!(source.downcast_ref(), Some(StormguardError::Timeout)), "{source:?}");
    assert_eq!(upstream.stats().total.requests, 2);
    // Both attempts are still at the upstream, and still hold their slots.
    assert_eq!(upstream.in_flight(), 2);
    assert_eq!(dep.upstream().limiter.in_flight(), 2, "timed-out attempts keep their slots");
    upstream.shutdown().await;
}

#[tokio::test]
async fn a_post_refused_by_http2_before_processing_is_retried() {
    // REFUSED_STREAM proves the server did not process the stream: even a POST may go again.
    let (addr, streams) = support::refusing_h2().await;
    let reqwest = reqwest::Client::builder()
        .http2_prior_knowledge()
        .retry(reqwest::retry::never())
        .build()
        .unwrap();
    let dep = rich();
    let client = ClientBuilder::new(reqwest)
        .with(stormguard_reqwest::StormguardMiddleware::new(dep.clone()))
        .build();
    let err = client.post(format!("http://{addr}/")).body("pay").send().await.unwrap_err();
    assert_eq!(err.denied(), Some(Denied::Attempts), "{err:?}");
    assert_eq!(streams.load(std::sync::atomic::Ordering::SeqCst), 3);
}

#[tokio::test]
async fn a_pushback_holds_every_retry_even_one_from_a_request_sent_once() {
    let (server, _) = asks_for_two_seconds().await;
    let client = guarded(&rich());
    // A streaming body is not retried, but its 503's Retry-After still holds the upstream...
    let body = reqwest::Body::wrap(Full::new(Bytes::from_static(b"stream")));
    let resp = client.put(server.url("/")).body(body).send().await.unwrap();
    assert_eq!(resp.denied(), Some(Denied::Body));
    // ...so another request's retry is refused while the hold lasts, not sent early.
    let resp = client.get(server.url("/")).send().await.unwrap();
    assert_eq!(resp.denied(), Some(Denied::Pushback));
    assert_eq!(server.count(), 2);
}

#[tokio::test]
async fn reqwest_and_tower_over_one_dependency_share_one_cap() {
    use stormguard_tower::{ReplayBody, StormguardLayer};
    use tower::{Layer, ServiceExt};

    let server = scripted(|_, _| (200, vec![])).await;
    let dep = dependency(|c| {
        c.limiter.cap = 1;
        c.limiter.queue_len = 0;
    });
    let held = guarded(&dep).get(server.url("/")).send().await.unwrap();
    let reached = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let r = reached.clone();
    let tower_client = StormguardLayer::new(dep.clone()).layer(tower::service_fn(
        move |_req: http::Request<ReplayBody<Full<Bytes>>>| {
            r.store(true, std::sync::atomic::Ordering::SeqCst);
            async {
                Ok::<_, stormguard_tower::BoxError>(http::Response::new(Full::new(Bytes::new())))
            }
        },
    ));
    let req = http::Request::new(ReplayBody::new(Full::new(Bytes::new()), 1024));
    let err = tower_client.clone().oneshot(req).await.unwrap_err();
    assert!(
        matches!(err.downcast_ref(), Some(StormguardError::Denied(Denied::Queue))),
        "the reqwest response holds the one slot: {err}"
    );
    assert!(!reached.load(std::sync::atomic::Ordering::SeqCst));
    drop(held);
    let req = http::Request::new(ReplayBody::new(Full::new(Bytes::new()), 1024));
    assert!(tower_client.oneshot(req).await.is_ok());
}

/// Rate admission through reqwest, judged at the upstream: a provider that says a minute's 60
/// requests are spent (and states its token limit). The next first try would wait a second for
/// its turn, past a 100 ms queue timeout: refused `rate` without reaching the upstream; a 503's
/// retry finds no room either. Tokens are estimated from the JSON body (`max_tokens`) and
/// settled from the answer. Without rate admission both reach the upstream.
#[tokio::test]
async fn a_provider_window_that_is_spent_holds_first_tries_and_retries_back() {
    for rated in [true, false] {
        let server = scripted(|n, _| {
            let status = if n == 1 { 503 } else { 200 };
            let headers = vec![
                ("x-ratelimit-limit-requests", "60".to_string()),
                ("x-ratelimit-remaining-requests", if n == 0 { "1" } else { "0" }.to_string()),
                ("x-ratelimit-limit-tokens", "100000".to_string()),
            ];
            (status, headers)
        })
        .await;
        let dep = dependency(|c| {
            c.budget = RICH.parse().unwrap();
            c.limiter.queue_timeout = ms(100);
            c.rate.learn = rated;
        });
        let client = guarded(&dep);
        let body = r#"{"model":"m","max_tokens":50,"messages":[]}"#;
        let post = || client.post(server.url("/v1/chat/completions")).body(body).send();
        // The first: one request left, and the provider says so.
        assert_eq!(post().await.unwrap().status(), 200);
        if rated {
            // Learned: the window holds one request, booked now.
            let s = dep.rates().unwrap().snapshot(dep.now());
            assert_eq!(s.requests.limit, Some(60));
            assert_eq!(s.tokens.outstanding, 0, "the answer's body ended: settled");
        }
        // The second (a 503 whose retry would follow), keyed so that it may be retried.
        let second = client
            .post(server.url("/v1/chat/completions"))
            .header("idempotency-key", "k")
            .body(body)
            .send()
            .await;
        if rated {
            assert_eq!(second.unwrap().status(), 503, "its retry found no room: not sent");
            let third = post().await.unwrap_err();
            assert_eq!(third.denied(), Some(Denied::Rate), "{third:?}");
            assert_eq!(server.count(), 2, "the refused retry and first try never reached it");
        } else {
            assert_eq!(second.unwrap().status(), 200, "retried");
            assert_eq!(post().await.unwrap().status(), 200);
            assert_eq!(server.count(), 4);
        }
    }
}

/// Hedging through reqwest, counted at the upstream: a first try answered after 300 ms, a hedge
/// (`x-stormguard-attempt: 2; hedge`) at once. With `hedge_after = 50ms` each GET is hedged and
/// answered by its hedge, while the slow first try's slot stays held (the cap of 4 is never
/// passed at the upstream); a POST is never hedged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_get_is_hedged_and_a_post_is_not() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU64, Ordering};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (hedges, in_flight, max) =
        (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    {
        let (hedges, in_flight, max) = (hedges.clone(), in_flight.clone(), max.clone());
        tokio::spawn(async move {
            loop {
                let Ok((tcp, _)) = listener.accept().await else { return };
                let (hedges, in_flight, max) = (hedges.clone(), in_flight.clone(), max.clone());
                tokio::spawn(async move {
                    let svc = hyper::service::service_fn(
                        move |req: http::Request<hyper::body::Incoming>| {
                            let hedge = req
                                .headers()
                                .get("x-stormguard-attempt")
                                .is_some_and(|v| v.as_bytes() == b"2; hedge");
                            if hedge {
                                hedges.fetch_add(1, Ordering::SeqCst);
                            }
                            let now = in_flight.fetch_add(1, Ordering::SeqCst) + 1;
                            max.fetch_max(now, Ordering::SeqCst);
                            let in_flight = in_flight.clone();
                            async move {
                                if !hedge {
                                    tokio::time::sleep(ms(300)).await;
                                }
                                in_flight.fetch_sub(1, Ordering::SeqCst);
                                let body = if hedge { "hedge" } else { "first" };
                                Ok::<_, std::convert::Infallible>(http::Response::new(Full::new(
                                    Bytes::from(body),
                                )))
                            }
                        },
                    );
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(hyper_util::rt::TokioIo::new(tcp), svc)
                        .await;
                });
            }
        });
    }
    let dep = dependency(|c| {
        c.budget = RICH.parse().unwrap();
        c.limiter.cap = 4;
        c.background = Some(stormguard_reqwest::Spawner::tokio());
        c.retry.hedge = Some(stormguard_core::hedge::HedgeConfig::new(
            stormguard_core::hedge::HedgeAfter::Fixed(ms(50)),
        ));
    });
    let client = guarded(&dep);
    let url = format!("http://{addr}/x");
    for _ in 0..3 {
        let resp = client.get(&url).send().await.unwrap();
        assert_eq!(resp.text().await.unwrap(), "hedge");
    }
    assert_eq!(hedges.load(Ordering::SeqCst), 3);
    let posted = client.post(&url).body("{}").send().await.unwrap();
    assert_eq!(posted.text().await.unwrap(), "first", "a POST is never hedged");
    assert_eq!(hedges.load(Ordering::SeqCst), 3);
    assert!(max.load(Ordering::SeqCst) <= 4, "the cap holds: {}", max.load(Ordering::SeqCst));
    let c = dep.snapshot().counters;
    assert_eq!((c.hedges, c.hedges_won), (3, 3));
}

/// `max_hedges = 2` through reqwest, as in the tower layer: a first try and a first hedge that
/// take 300 ms, and a second hedge (`x-stormguard-attempt: 3; hedge`, sent the hedge delay after
/// the first hedge) answered at once — the caller's answer is the second hedge's. With
/// `max_hedges = 1` no third attempt is sent and the first try answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_hedge_goes_beside_a_slow_first_hedge() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((tcp, _)) = listener.accept().await else { return };
            tokio::spawn(async move {
                let svc =
                    hyper::service::service_fn(move |req: http::Request<hyper::body::Incoming>| {
                        let mark = req
                            .headers()
                            .get("x-stormguard-attempt")
                            .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
                            .unwrap_or_default();
                        async move {
                            if mark != "3; hedge" {
                                tokio::time::sleep(ms(300)).await;
                            }
                            let body = if mark.is_empty() { "first".to_string() } else { mark };
                            Ok::<_, std::convert::Infallible>(http::Response::new(Full::new(
                                Bytes::from(body),
                            )))
                        }
                    });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(tcp), svc)
                    .await;
            });
        }
    });
    let url = format!("http://{addr}/x");
    for (max_hedges, answer) in [(2, "3; hedge"), (1, "first")] {
        let dep = dependency(|c| {
            c.budget = RICH.parse().unwrap();
            c.limiter.cap = 8;
            c.background = Some(stormguard_reqwest::Spawner::tokio());
            c.retry.hedge = Some(stormguard_core::hedge::HedgeConfig {
                after: stormguard_core::hedge::HedgeAfter::Fixed(ms(50)),
                max_hedges,
            });
        });
        let resp = guarded(&dep).get(&url).send().await.unwrap();
        assert_eq!(resp.text().await.unwrap(), answer, "max_hedges = {max_hedges}");
        let c = dep.snapshot().counters;
        assert_eq!(c.hedges, u64::from(max_hedges), "max_hedges = {max_hedges}");
    }
}

/// A caller that gives up while its attempt is at the dependency leaves the slot held (for
/// `abandon_hold`): the dependency is still working on the request, so the next first try
/// finds the cap of 1 full and is refused `queue` — the dependency never sees two at once.
#[tokio::test]
async fn a_caller_that_gives_up_leaves_its_slot_held() {
    let server = chaos(Phase { latency: Latency::Fixed(ms(300)), ..Phase::default() }).await;
    let dep = dependency(|c| {
        c.limiter.cap = 1;
        c.limiter.queue_len = 0;
    });
    let client = guarded(&dep);
    let url = server.url("/");
    let gave_up = tokio::time::timeout(ms(50), client.get(&url).send()).await;
    assert!(gave_up.is_err(), "the caller gave up");
    let err = client.get(&url).send().await.unwrap_err();
    assert_eq!(err.denied(), Some(Denied::Queue), "{err:?}");
    tokio::time::sleep(ms(400)).await;
    assert_eq!(server.stats().total.requests, 1, "one attempt at the dependency");
    assert_eq!(dep.upstream().limiter.in_flight(), 1, "held until abandon_hold passes");
}

/// A first try queued behind the only slot while a 429 puts a hold on the provider's window:
/// when the slot comes it waits the hold out (holding the slot) before it is sent, as the tower
/// layer does — one admission function for both. The first request is answered `429,
/// Retry-After: 1` after 300 ms; the second, queued since 50 ms, reaches the upstream a second
/// after that 429, not at once (until issue 40 the middleware sent it at once, into the hold).
#[tokio::test]
async fn a_queued_first_try_waits_out_a_hold_that_began_while_it_queued() {
    let server = support::scripted_after(
        |n| if n == 0 { ms(300) } else { Duration::ZERO },
        |n, _| match n {
            0 => (429, vec![("retry-after", "1".to_string())]),
            _ => (200, vec![]),
        },
    )
    .await;
    let dep = dependency(|c| {
        c.budget = RICH.parse().unwrap();
        c.limiter.cap = 1;
        c.limiter.queue_len = 4;
        c.limiter.queue_timeout = Duration::from_secs(5);
        c.rate.requests_per_minute = Some(6_000);
    });
    let client = guarded(&dep);
    let first = {
        let (client, url) = (client.clone(), server.url("/a"));
        tokio::spawn(async move {
            let resp = client.get(url).send().await.unwrap();
            let status = resp.status();
            // Read to its end: the slot comes back.
            resp.bytes().await.unwrap();
            status
        })
    };
    tokio::time::sleep(ms(50)).await;
    let second = client.get(server.url("/b")).send().await.unwrap();
    assert_eq!(second.status(), 200);
    assert_eq!(first.await.unwrap(), 429);
    let seen = server.seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 2);
    let after = seen[1].arrived.saturating_duration_since(seen[0].answered);
    assert!(after >= ms(900), "the second went {after:?} after the 429, inside its hold");
}
