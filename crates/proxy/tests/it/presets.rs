//! The provider presets (`provider = "openai" | "anthropic"`), judged at the upstream: what
//! reached it, counted by the upstream itself. Each guarantee is run beside the path without
//! the preset, which breaks it.
//!
//! - A spent quota (OpenAI's 429 `insufficient_quota`) is never retried, and holds the
//!   upstream: later first tries are refused `rate` by the proxy instead of drawing more 429s.
//! - A rate-limit 429 (or an overloaded 529) was not processed, so a POST is retried.
//! - An overload burst (Anthropic's 529) is retried, within the budget.
//! - With several upstreams, a first try skips one whose window the provider said is empty,
//!   and one cooling down after a 529.
//! - A streamed answer that broke after its first byte reached the caller is never retried;
//!   the same upstream failing before any byte is.

use crate::support;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use stormguard_proxy::config::ProxyDependency;
use stormguard_tower::Provider;
use support::{Counts, Serve, dep, full, proxy, upstream};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const QUOTA: &str = r#"{"error":{"message":"You exceeded your current quota, please check your plan and billing details.","type":"insufficient_quota","param":null,"code":"insufficient_quota"}}"#;
const RATE: &str = r#"{"error":{"message":"Rate limit reached for requests","type":"requests","param":null,"code":"rate_limit_exceeded"}}"#;
const OVERLOADED: &str =
    r#"{"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}"#;
const CHAT: &str = r#"{"model":"m","max_tokens":16,"messages":[{"role":"user","content":"hi"}]}"#;

/// What the caller got: status, headers, and the body (or why it broke).
struct Got {
    status: StatusCode,
    headers: HeaderMap,
    body: Result<Bytes, String>,
}

/// POSTs a chat completion through the proxy at `addr` (with an `Idempotency-Key` of its own
/// when `keyed`, else an `x-request-id`: each post is its own call), reading the answer whole
/// (at most 10 s).
async fn post(addr: SocketAddr, keyed: bool) -> Got {
    let mut req = Request::post(format!("http://{addr}/v1/messages"))
        .header("content-type", "application/json");
    let id = crate::common::request_id();
    req = match keyed {
        true => req.header("idempotency-key", id),
        false => req.header("x-request-id", id),
    };
    let req = req.body(Full::new(Bytes::from_static(CHAT.as_bytes()))).unwrap();
    let client = Client::builder(TokioExecutor::new()).build_http();
    let resp = tokio::time::timeout(Duration::from_secs(10), client.request(req))
        .await
        .expect("an answer within 10 s")
        .expect("the proxy answers");
    let (parts, body) = resp.into_parts();
    let body = match tokio::time::timeout(Duration::from_secs(10), body.collect()).await {
        Ok(Ok(c)) => Ok(c.to_bytes()),
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => Err("no end within 10 s".into()),
    };
    Got { status: parts.status, headers: parts.headers, body }
}

fn json(status: u16, body: &'static str) -> Response<support::Body> {
    Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .body(full(body))
        .unwrap()
}

/// A dependency on `addr` with the preset (or none), retrying what the provider SDKs retry in
/// both cases, and a short queue timeout so held first tries are refused quickly.
fn provider_dep(addr: SocketAddr, preset: Option<Provider>) -> ProxyDependency {
    let mut d = dep(&format!("http://{addr}"));
    d.rate.provider = preset;
    d.retry_on = Provider::OpenAi.retry_on();
    d.queue_timeout = Duration::from_millis(200);
    d
}

fn handled(c: &Counts) -> u64 {
    Counts::get(&c.handled)
}

#[tokio::test]
async fn a_spent_quota_is_never_retried_and_holds_the_upstream() {
    for preset in [Some(Provider::OpenAi), None] {
        let up = upstream(Serve::default(), |_req| async { json(429, QUOTA) }).await;
        let p = proxy(provider_dep(up.addr, preset)).await;
        let addr = p.listen_addrs()[0];
        // Keyed, so that even an idempotent request is not retried into a spent quota.
        let first = post(addr, true).await;
        assert_eq!(first.status, StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(
            first.body.as_deref().unwrap(),
            QUOTA.as_bytes(),
            "the body reaches the caller whole"
        );
        let mut later = Vec::new();
        for _ in 0..4 {
            later.push(post(addr, true).await);
        }
        let seen = handled(&up.counts);
        p.shutdown().await;
        match preset {
            Some(_) => {
                assert_eq!(seen, 1, "one attempt reached the provider: no retry, then held");
                for g in &later {
                    assert_eq!(g.status, StatusCode::TOO_MANY_REQUESTS);
                    assert_eq!(g.headers["x-stormguard-denied"], "rate");
                }
            }
            // Unprotected: every request and two retries each reach the spent quota.
            None => assert_eq!(seen, 15, "without the preset"),
        }
    }
}

#[tokio::test]
async fn a_rate_limit_429_is_retried_even_for_a_post() {
    for preset in [Some(Provider::OpenAi), None] {
        let calls = Arc::new(AtomicU64::new(0));
        let up = upstream(Serve::default(), {
            let calls = calls.clone();
            move |_req| {
                let n = calls.fetch_add(1, Ordering::SeqCst);
                async move {
                    match n {
                        0 => Response::builder()
                            .status(429)
                            .header("retry-after-ms", "20")
                            .body(full(RATE))
                            .unwrap(),
                        _ => json(200, r#"{"usage":{"prompt_tokens":5,"completion_tokens":3}}"#),
                    }
                }
            }
        })
        .await;
        let p = proxy(provider_dep(up.addr, preset)).await;
        let got = post(p.listen_addrs()[0], false).await;
        let seen = handled(&up.counts);
        p.shutdown().await;
        match preset {
            Some(_) => {
                assert_eq!(got.status, StatusCode::OK);
                assert_eq!(seen, 2, "retried after the provider's retry-after-ms");
            }
            // Without the preset a 429 to a POST is not known to be unprocessed: not retried.
            None => {
                assert_eq!(got.status, StatusCode::TOO_MANY_REQUESTS);
                assert_eq!(seen, 1);
            }
        }
    }
}

/// An overload burst: 529 for the first second, then 200. An open loop of 40 requests a second
/// for 2 s: the 529s are retried, and the retries that reach the upstream stay within the
/// budget (20 % of the requests, no floor); with a budget of 100 % the same burst draws far
/// more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_overload_burst_is_retried_within_the_budget() {
    const REQUESTS: u64 = 80;
    for percent in ["0.2", "1"] {
        let burst = Arc::new(AtomicBool::new(true));
        let up = upstream(Serve::default(), {
            let burst = burst.clone();
            move |_req| {
                let overloaded = burst.load(Ordering::SeqCst);
                async move {
                    if overloaded {
                        json(529, OVERLOADED)
                    } else {
                        json(200, r#"{"usage":{"input_tokens":5,"output_tokens":3}}"#)
                    }
                }
            }
        })
        .await;
        let mut d = provider_dep(up.addr, Some(Provider::Anthropic));
        d.budget = format!("ratio:percent={percent},min_per_sec=0,ttl=10s").parse().unwrap();
        let p = proxy(d).await;
        let addr = p.listen_addrs()[0];
        let ends = {
            let burst = burst.clone();
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_secs(1)).await;
                burst.store(false, Ordering::SeqCst);
            })
        };
        let mut tasks = Vec::new();
        for _ in 0..REQUESTS {
            tasks.push(tokio::spawn(post(addr, false)));
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        let mut ok = 0;
        for t in tasks {
            ok += u64::from(t.await.unwrap().status == StatusCode::OK);
        }
        ends.await.unwrap();
        let retries = handled(&up.counts) - REQUESTS;
        p.shutdown().await;
        eprintln!(
            "budget {percent}: {retries} retries reached the upstream, {ok} of {REQUESTS} succeeded"
        );
        assert!(ok >= REQUESTS / 2 - 5, "the requests after the burst succeed: {ok}");
        if percent == "0.2" {
            assert!(retries > 0, "the burst was retried");
            assert!(
                retries <= REQUESTS / 5 + 1,
                "{retries} retries, the budget allows {}",
                REQUESTS / 5
            );
        } else {
            assert!(retries > REQUESTS / 5 + 1, "unbudgeted: {retries}");
        }
    }
}

/// Two upstreams: `a` states an empty request window on every answer, `b` a full one. After the
/// first answer from `a`, first tries go to `b`; without rate admission every first try goes to
/// `a`.
#[tokio::test]
async fn a_first_try_skips_a_provider_whose_window_is_empty() {
    for preset in [Some(Provider::OpenAi), None] {
        let window = |remaining: &'static str| {
            move |_req| async move {
                Response::builder()
                    .header("content-type", "application/json")
                    .header("x-ratelimit-limit-requests", "60")
                    .header("x-ratelimit-remaining-requests", remaining)
                    .header("x-ratelimit-reset-requests", "1s")
                    .body(full(r#"{"usage":{"prompt_tokens":5,"completion_tokens":3}}"#))
                    .unwrap()
            }
        };
        let a = upstream(Serve::default(), window("0")).await;
        let b = upstream(Serve::default(), window("59")).await;
        let mut d = provider_dep(a.addr, preset);
        d.upstreams.push(format!("http://{}", b.addr).parse().unwrap());
        d.upstream_caps.push(None);
        let p = proxy(d).await;
        for _ in 0..10 {
            assert_eq!(post(p.listen_addrs()[0], false).await.status, StatusCode::OK);
        }
        let (at_a, at_b) = (handled(&a.counts), handled(&b.counts));
        p.shutdown().await;
        match preset {
            Some(_) => assert_eq!((at_a, at_b), (1, 9)),
            None => assert_eq!((at_a, at_b), (10, 0)),
        }
    }
}

/// Two upstreams: `a` is overloaded (529), `b` is fine. The first request's 529 is retried on
/// `b`, and `a` cools down: the next first tries go straight to `b`. Without the preset every
/// request tries `a` first.
#[tokio::test]
async fn an_overloaded_provider_cools_down_and_first_tries_go_elsewhere() {
    for preset in [Some(Provider::Anthropic), None] {
        let a = upstream(Serve::default(), |_req| async { json(529, OVERLOADED) }).await;
        let b = upstream(Serve::default(), |_req| async {
            json(200, r#"{"usage":{"input_tokens":5,"output_tokens":3}}"#)
        })
        .await;
        let mut d = provider_dep(a.addr, preset);
        d.upstreams.push(format!("http://{}", b.addr).parse().unwrap());
        d.upstream_caps.push(None);
        let p = proxy(d).await;
        for _ in 0..10 {
            // Keyed: without the preset, the 529 of a POST is retried only when idempotent.
            assert_eq!(post(p.listen_addrs()[0], true).await.status, StatusCode::OK);
        }
        let (at_a, at_b) = (handled(&a.counts), handled(&b.counts));
        p.shutdown().await;
        match preset {
            Some(_) => assert_eq!((at_a, at_b), (1, 10), "a cooled down after its 529"),
            None => assert_eq!((at_a, at_b), (10, 10)),
        }
    }
}

/// A raw HTTP/1.1 upstream that answers every request with a stream (`text/event-stream`,
/// chunked) and breaks it: after its first event when `after_first_byte`, else before sending
/// anything. Counts the requests it read.
async fn breaking_stream(after_first_byte: bool) -> (SocketAddr, Arc<AtomicU64>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let count = Arc::new(AtomicU64::new(0));
    let c = count.clone();
    tokio::spawn(async move {
        loop {
            let Ok((mut tcp, _)) = listener.accept().await else { continue };
            let c = c.clone();
            tokio::spawn(async move {
                // The request head and its (small) body.
                let mut buf = vec![0u8; 8192];
                let mut got = 0;
                while let Ok(n) = tcp.read(&mut buf[got..]).await {
                    if n == 0 {
                        return;
                    }
                    got += n;
                    if let Some(end) = buf[..got].windows(4).position(|w| w == b"\r\n\r\n")
                        && got >= end + 4 + CHAT.len()
                    {
                        break;
                    }
                }
                c.fetch_add(1, Ordering::SeqCst);
                if after_first_byte {
                    let event = "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":5,\"output_tokens\":1}}}\n\n";
                    let head = format!(
                        "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n{:x}\r\n{event}\r\n",
                        event.len()
                    );
                    let _ = tcp.write_all(head.as_bytes()).await;
                    let _ = tcp.flush().await;
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                // The connection closes mid-stream (or before any answer).
                drop(tcp);
            });
        }
    });
    (addr, count)
}

#[tokio::test]
async fn a_stream_that_sent_a_byte_is_never_retried() {
    for after_first_byte in [true, false] {
        let (addr, count) = breaking_stream(after_first_byte).await;
        let p = proxy(provider_dep(addr, Some(Provider::Anthropic))).await;
        for _ in 0..5 {
            // Keyed: idempotent, the strongest case for a retry.
            let got = post(p.listen_addrs()[0], true).await;
            if after_first_byte {
                assert_eq!(got.status, StatusCode::OK);
                assert!(got.body.is_err(), "the caller sees the stream break");
            } else {
                assert_eq!(got.status, StatusCode::BAD_GATEWAY);
            }
        }
        let seen = count.load(Ordering::SeqCst);
        p.shutdown().await;
        match after_first_byte {
            true => assert_eq!(seen, 5, "a stream that reached the caller is never retried"),
            // Broken before any byte: each request and its two retries.
            false => assert_eq!(seen, 15),
        }
    }
}
