//! chaos as a model provider, over real sockets on 127.0.0.1: requests and tokens per minute
//! metered from the request bodies, 429s past them with the provider's headers and error body,
//! `usage` in every 200, and the provider's rate-limit headers on every answer, readable by
//! stormguard's own header reader.

mod common;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use stormguard_chaos::{ChaosConfig, Phase, ProviderConfig, ProviderKind};
use stormguard_http::provider::{Tokens, read_limits, usage};
use tokio::net::TcpStream;

struct Answer {
    status: u16,
    headers: http::HeaderMap,
    body: Bytes,
}

async fn post(addr: std::net::SocketAddr, body: &'static str) -> Answer {
    let stream = TcpStream::connect(addr).await.unwrap();
    let (mut sender, conn) =
        hyper::client::conn::http1::handshake(TokioIo::new(stream)).await.unwrap();
    tokio::spawn(conn);
    let req = http::Request::post("/v1/chat/completions")
        .header("host", "chaos")
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from_static(body.as_bytes())))
        .unwrap();
    let resp = sender.send_request(req).await.unwrap();
    let (parts, body) = resp.into_parts();
    let body = body.collect().await.unwrap().to_bytes();
    Answer { status: parts.status.as_u16(), headers: parts.headers, body }
}

async fn provider(
    kind: ProviderKind,
    rpm: Option<u64>,
    tpm: Option<u64>,
) -> stormguard_chaos::ChaosServer {
    let mut config = ChaosConfig::single(Phase::default());
    config.provider = Some(ProviderConfig { kind, rpm, tpm });
    common::serve(config).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_per_minute_past_the_limit_are_429s_the_providers_way() {
    let server = provider(ProviderKind::OpenAi, Some(5), None).await;
    let addr = server.local_addr();
    let mut statuses = Vec::new();
    for _ in 0..7 {
        statuses.push(post(addr, r#"{"max_tokens":10,"messages":[]}"#).await);
    }
    let ok = statuses.iter().filter(|a| a.status == 200).count();
    assert_eq!(ok, 5, "a full bucket of 5, then 429s");
    let limited = statuses.last().unwrap();
    assert_eq!(limited.status, 429);
    // One request's refill at 5 a minute: 12 s.
    assert_eq!(limited.headers["retry-after"], "12");
    assert!(String::from_utf8_lossy(&limited.body).contains("rate_limit_exceeded"));
    let seen = read_limits(&limited.headers);
    assert_eq!((seen.requests.limit, seen.requests.remaining), (Some(5), Some(0)));
    // A 200 carries usage: the output its max_tokens, the input by size.
    let first = &statuses[0];
    let used = usage(&first.body).unwrap();
    assert_eq!(used.output, 10);
    assert!(used.input > 0);
    assert_eq!(server.stats().total.status_counts.get(&429).copied(), Some(2));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_per_minute_bind_on_large_max_tokens_anthropic_shaped() {
    let server = provider(ProviderKind::Anthropic, Some(1_000), Some(10_000)).await;
    let addr = server.local_addr();
    let big = r#"{"model":"m","max_tokens":4000,"messages":[{"role":"user","content":"hi"}]}"#;
    let a = post(addr, big).await;
    let b = post(addr, big).await;
    let c = post(addr, big).await;
    assert_eq!((a.status, b.status, c.status), (200, 200, 429));
    assert!(String::from_utf8_lossy(&c.body).contains("rate_limit_error"));
    let seen = read_limits(&b.headers);
    assert_eq!(seen.tokens.limit, Some(10_000));
    assert!(seen.tokens.remaining.unwrap() < 2_000, "{seen:?}");
    assert_eq!(seen.requests.remaining, Some(998));
    assert!(b.headers.contains_key("anthropic-ratelimit-tokens-reset"));
    assert_eq!(usage(&a.body).map(|t: Tokens| t.output), Some(4_000));
}
