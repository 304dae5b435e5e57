//! chaos as a model provider, over real sockets on 127.0.0.1: requests and tokens per minute
//! metered from the request bodies, 429s past them with the provider's headers and error body,
//! `usage` in every 200, and the provider's rate-limit headers on every answer, readable by
//! stormguard's own header reader. Then what a client of a model API must survive: streamed
//! answers (one event a frame, cut mid-way on purpose), overload bursts, an exhausted quota,
//! Anthropic's input and output tokens metered apart — each counted at chaos, by kind.

use crate::common;

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use stormguard_chaos::{
    ChaosConfig, ChaosServer, Phase, ProviderConfig, ProviderCounts, ProviderKind, ProviderOptions,
    Script, Window,
};
use stormguard_http::provider::{Tokens, read_limits, usage};
use tokio::net::TcpStream;
use tokio::task::JoinHandle;

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

async fn serve_provider(
    kind: ProviderKind,
    rpm: Option<u64>,
    options: ProviderOptions,
    script: Script,
) -> ChaosServer {
    let mut config = ChaosConfig::new(script);
    config.provider = Some(ProviderConfig { kind, rpm, tpm: None });
    config.provider_options = options;
    common::serve(config).await
}

/// A response whose body is read by the test, frame by frame; `conn` is its connection (abort
/// it to leave).
struct Open {
    status: u16,
    headers: http::HeaderMap,
    body: Incoming,
    conn: JoinHandle<()>,
}

async fn open(addr: std::net::SocketAddr, body: &str) -> Open {
    let stream = TcpStream::connect(addr).await.unwrap();
    let (mut sender, conn) =
        hyper::client::conn::http1::handshake(TokioIo::new(stream)).await.unwrap();
    let conn = tokio::spawn(async move {
        let _ = conn.await;
    });
    let req = http::Request::post("/v1/messages")
        .header("host", "chaos")
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .unwrap();
    let resp = sender.send_request(req).await.unwrap();
    let (parts, body) = resp.into_parts();
    Open { status: parts.status.as_u16(), headers: parts.headers, body, conn }
}

/// The data frames until the end, or until the body fails (`Err` with what was read).
async fn frames(body: &mut Incoming) -> Result<Vec<Bytes>, Vec<Bytes>> {
    let mut out = Vec::new();
    while let Some(frame) = body.frame().await {
        match frame {
            Ok(f) => {
                if let Ok(d) = f.into_data() {
                    out.push(d);
                }
            }
            Err(_) => return Err(out),
        }
    }
    Ok(out)
}

fn text(b: &[Bytes]) -> String {
    String::from_utf8(b.concat()).unwrap()
}

/// Counts once nothing is in flight (a body's end is counted as its last frame is produced).
async fn settled(server: &ChaosServer) -> ProviderCounts {
    common::wait_for(server, Duration::from_secs(5), |s| s.in_flight_now == 0).await;
    server.provider_counts()
}

const STREAM: &str = r#"{"model":"m","stream":true,"max_tokens":9,"messages":[]}"#;
const PLAIN: &str = r#"{"model":"m","max_tokens":9,"messages":[]}"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_is_openai_chunks_one_frame_each_with_usage_last_then_done() {
    let options =
        ProviderOptions { stream_event_delay: Duration::from_millis(150), ..Default::default() };
    let server =
        serve_provider(ProviderKind::OpenAi, Some(10), options, Script::single(Phase::default()))
            .await;
    let mut s = open(server.local_addr(), STREAM).await;
    assert_eq!(s.status, 200);
    assert_eq!(s.headers["content-type"], "text/event-stream");
    assert!(s.headers.contains_key("x-ratelimit-remaining-requests"));
    // The first event is here while the rest are still to come: the stream is in flight.
    let first = s.body.frame().await.unwrap().unwrap().into_data().unwrap();
    assert!(first.starts_with(b"data: {"), "{first:?}");
    assert!(String::from_utf8_lossy(&first).contains("chat.completion.chunk"));
    let during = server.provider_counts();
    assert_eq!((during.streams_started, during.streams_completed), (1, 0));
    assert_eq!(server.in_flight(), 1);
    let rest = frames(&mut s.body).await.unwrap();
    // One body frame per event: the role, the content, the stop, the usage, [DONE].
    assert_eq!(rest.len() + 1, 5);
    assert!(rest.iter().all(|e| e.starts_with(b"data: ") && e.ends_with(b"\n\n")));
    assert_eq!(&rest[3][..], b"data: [DONE]\n\n");
    let last_chunk: serde_json::Value =
        serde_json::from_slice(&rest[2][b"data: ".len()..]).unwrap();
    assert_eq!(last_chunk["usage"]["completion_tokens"], 9);
    assert_eq!(last_chunk["choices"], serde_json::json!([]));
    let all = [vec![first], rest].concat();
    assert_eq!(usage(&all.concat()).map(|t: Tokens| t.output), Some(9));

    // The same request without `"stream": true`: one JSON frame.
    let mut p = open(server.local_addr(), PLAIN).await;
    assert_eq!(p.headers["content-type"], "application/json");
    assert_eq!(frames(&mut p.body).await.unwrap().len(), 1);
    let c = settled(&server).await;
    assert_eq!((c.ok, c.streams_started, c.streams_completed, c.streams_broken), (2, 1, 1, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_is_anthropic_events_with_input_first_and_output_in_message_delta() {
    let server = serve_provider(
        ProviderKind::Anthropic,
        None,
        ProviderOptions::default(),
        Script::single(Phase::default()),
    )
    .await;
    let mut s = open(server.local_addr(), STREAM).await;
    assert_eq!(s.headers["content-type"], "text/event-stream");
    let events = frames(&mut s.body).await.unwrap();
    let names: Vec<String> = events
        .iter()
        .map(|e| {
            let t = String::from_utf8(e.to_vec()).unwrap();
            t.lines().next().unwrap().strip_prefix("event: ").unwrap().to_string()
        })
        .collect();
    assert_eq!(
        names,
        [
            "message_start",
            "content_block_start",
            "content_block_delta",
            "content_block_stop",
            "message_delta",
            "message_stop"
        ]
    );
    let data = |i: usize| -> serde_json::Value {
        let t = String::from_utf8(events[i].to_vec()).unwrap();
        serde_json::from_str(t.lines().nth(1).unwrap().strip_prefix("data: ").unwrap()).unwrap()
    };
    let input = data(0)["message"]["usage"]["input_tokens"].as_u64().unwrap();
    assert!(input > 0);
    assert_eq!(data(4)["usage"]["output_tokens"], 9);
    assert_eq!(usage(&text(&events).into_bytes()), Some(Tokens { input, output: 9 }));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broken_stream_is_cut_after_its_first_event_and_counted() {
    let options = ProviderOptions { stream_break_rate: 1.0, ..Default::default() };
    for kind in [ProviderKind::OpenAi, ProviderKind::Anthropic] {
        let server = serve_provider(kind, None, options, Script::single(Phase::default())).await;
        let mut s = open(server.local_addr(), STREAM).await;
        assert_eq!(s.status, 200, "{kind}");
        // One event reached the client, then the body failed.
        let got = frames(&mut s.body).await.unwrap_err();
        assert_eq!(got.len(), 1, "{kind}: {got:?}");
        // A request that does not stream is not broken.
        let mut p = open(server.local_addr(), PLAIN).await;
        assert!(frames(&mut p.body).await.is_ok());
        let c = settled(&server).await;
        assert_eq!((c.streams_started, c.streams_broken, c.streams_completed), (1, 1, 0));
        assert_eq!(server.stats().total.requests, 2);
    }
    // Without the break the same stream ends whole.
    let whole = serve_provider(
        ProviderKind::OpenAi,
        None,
        ProviderOptions::default(),
        Script::single(Phase::default()),
    )
    .await;
    let mut s = open(whole.local_addr(), STREAM).await;
    assert_eq!(frames(&mut s.body).await.unwrap().len(), 5);
    assert_eq!(settled(&whole).await.streams_broken, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_leaves_mid_stream_is_still_counted() {
    let options =
        ProviderOptions { stream_event_delay: Duration::from_millis(200), ..Default::default() };
    let server =
        serve_provider(ProviderKind::Anthropic, None, options, Script::single(Phase::default()))
            .await;
    let mut s = open(server.local_addr(), STREAM).await;
    s.body.frame().await.unwrap().unwrap();
    s.conn.abort();
    drop(s);
    let stats = common::wait_for(&server, Duration::from_secs(5), |st| {
        st.in_flight_now == 0 && st.total.provider.streams_abandoned == 1
    })
    .await;
    let c = stats.total.provider;
    assert_eq!((c.ok, c.streams_started, c.streams_abandoned, c.streams_completed), (1, 1, 1, 0));
    assert_eq!(stats.total.client_gone, 1);
}

/// A burst: chaos serves, is overloaded for a phase, then serves again; an overloaded answer
/// takes nothing from the requests per minute.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_overload_burst_is_529_for_anthropic_and_503_for_openai() {
    let calm = Phase { name: "calm".into(), ..Phase::default() };
    let burst = Phase { name: "overloaded".into(), overloaded_rate: 1.0, ..Phase::default() };
    let script =
        Script { phases: vec![calm.clone(), burst, calm], ..Script::single(Phase::default()) };
    for (kind, status, needle) in [
        (ProviderKind::Anthropic, 529, r#""type":"overloaded_error""#),
        (ProviderKind::OpenAi, 503, "currently overloaded"),
    ] {
        let server =
            serve_provider(kind, Some(3), ProviderOptions::default(), script.clone()).await;
        let addr = server.local_addr();
        let statuses = |n| async move {
            let mut out = Vec::new();
            for _ in 0..n {
                let mut a = open(addr, PLAIN).await;
                let body = text(&frames(&mut a.body).await.unwrap());
                out.push((a.status, body));
            }
            out
        };
        assert!(statuses(1).await.iter().all(|(s, _)| *s == 200));
        assert_eq!(server.next_phase(), "overloaded");
        let burst = statuses(4).await;
        assert!(burst.iter().all(|(s, b)| *s == status && b.contains(needle)), "{kind}: {burst:?}");
        server.next_phase();
        // Two more of the 3 a minute are left: the burst spent none.
        let after: Vec<u16> = statuses(3).await.into_iter().map(|(s, _)| s).collect();
        assert_eq!(after, [200, 200, 429], "{kind}");
        let stats = server.stats();
        assert_eq!(stats.total.provider.overloaded, 4);
        assert_eq!(stats.total.status_counts[&status], 4);
        assert_eq!(stats.phases[1].counts.provider.overloaded, 4);
        assert_eq!((stats.total.provider.ok, stats.total.provider.rate_limited), (3, 1));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overload_windows_from_the_start_are_phases() {
    let windows: [Window; 1] = ["0s..1s".parse().unwrap()];
    let script = Script::overloaded_during(Phase::default(), &windows).unwrap();
    let server =
        serve_provider(ProviderKind::Anthropic, None, ProviderOptions::default(), script).await;
    let during = open(server.local_addr(), PLAIN).await;
    assert_eq!(during.status, 529);
    assert_eq!(server.phase(), "overloaded");
    tokio::time::sleep(Duration::from_millis(1_100)).await;
    let after = open(server.local_addr(), PLAIN).await;
    assert_eq!(after.status, 200);
    let stats = server.stats();
    assert_eq!(stats.phase, "phase-1");
    assert_eq!((stats.total.provider.overloaded, stats.total.provider.ok), (1, 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_the_quota_openai_answers_insufficient_quota_and_anthropic_a_billing_400() {
    let options = ProviderOptions { quota_exhausted_after: Some(3), ..Default::default() };
    // One request a minute as well: the quota and the rate limit are told apart.
    let server =
        serve_provider(ProviderKind::OpenAi, Some(1), options, Script::single(Phase::default()))
            .await;
    let mut got = Vec::new();
    for _ in 0..5 {
        let mut a = open(server.local_addr(), PLAIN).await;
        let body = text(&frames(&mut a.body).await.unwrap());
        got.push((a.status, a.headers, body));
    }
    let statuses: Vec<u16> = got.iter().map(|(s, _, _)| *s).collect();
    assert_eq!(statuses, [200, 429, 429, 429, 429]);
    assert!(got[1].2.contains("rate_limit_exceeded") && got[1].1.contains_key("retry-after"));
    for (_, headers, body) in &got[3..] {
        let v: serde_json::Value = serde_json::from_str(body).unwrap();
        assert_eq!(v["error"]["type"], "insufficient_quota");
        assert_eq!(v["error"]["code"], "insufficient_quota");
        assert!(
            v["error"]["message"].as_str().unwrap().starts_with("You exceeded your current quota")
        );
        // Waiting does not bring a quota back: no retry-after.
        assert!(!headers.contains_key("retry-after") && !headers.contains_key("retry-after-ms"));
    }
    let c = server.provider_counts();
    assert_eq!((c.ok, c.rate_limited, c.quota_exhausted), (1, 2, 2));
    assert_eq!(server.stats().total.rate_limited, 2);

    let server = serve_provider(
        ProviderKind::Anthropic,
        None,
        ProviderOptions { quota_exhausted_after: Some(0), ..Default::default() },
        Script::single(Phase::default()),
    )
    .await;
    let mut a = open(server.local_addr(), PLAIN).await;
    assert_eq!(a.status, 400);
    let v: serde_json::Value =
        serde_json::from_str(&text(&frames(&mut a.body).await.unwrap())).unwrap();
    assert_eq!(v["error"]["type"], "invalid_request_error");
    assert!(v["error"]["message"].as_str().unwrap().contains("credit balance is too low"));
    assert_eq!(server.provider_counts().quota_exhausted, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn anthropic_meters_input_and_output_tokens_apart() {
    let body = r#"{"model":"m","max_tokens":600,"messages":[]}"#;
    let split = ProviderOptions { itpm: Some(100_000), otpm: Some(1_000), ..Default::default() };
    let server =
        serve_provider(ProviderKind::Anthropic, None, split, Script::single(Phase::default()))
            .await;
    let mut first = open(server.local_addr(), body).await;
    frames(&mut first.body).await.unwrap();
    let mut second = open(server.local_addr(), body).await;
    let refusal = text(&frames(&mut second.body).await.unwrap());
    assert_eq!((first.status, second.status), (200, 429));
    assert!(refusal.contains("1000 output tokens per minute"), "{refusal}");
    assert!(second.headers.contains_key("retry-after-ms"));
    let seen = read_limits(&first.headers);
    assert_eq!((seen.output_tokens.limit, seen.output_tokens.remaining), (Some(1_000), Some(400)));
    assert_eq!(seen.input_tokens.limit, Some(100_000));
    assert!(seen.input_tokens.remaining.unwrap() < 100_000);
    for h in ["anthropic-ratelimit-input-tokens-reset", "anthropic-ratelimit-output-tokens-reset"] {
        let reset = first.headers[h].as_bytes();
        assert!(stormguard_http::headers::parse_rfc3339(reset).is_ok(), "{h}");
    }
    assert_eq!(server.provider_counts().rate_limited, 1);
    // The input limit refuses on its own, with a small output.
    let tight = ProviderOptions { itpm: Some(20), ..Default::default() };
    let server =
        serve_provider(ProviderKind::Anthropic, None, tight, Script::single(Phase::default()))
            .await;
    let mut a = open(server.local_addr(), PLAIN).await;
    let mut b = open(server.local_addr(), PLAIN).await;
    let said = text(&frames(&mut b.body).await.unwrap());
    frames(&mut a.body).await.unwrap();
    assert_eq!((a.status, b.status), (200, 429), "{said}");
    assert!(said.contains("20 input tokens per minute"), "{said}");
    // Without the split limits the same requests all pass.
    let open_limits = serve_provider(
        ProviderKind::Anthropic,
        None,
        ProviderOptions::default(),
        Script::single(Phase::default()),
    )
    .await;
    for _ in 0..3 {
        assert_eq!(open(open_limits.local_addr(), body).await.status, 200);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_script_sets_every_provider_key_and_a_bad_value_names_file_line_and_key() {
    let script = Script::parse(
        r#"
[[phase]]
name = "calm"

[provider]
kind = "anthropic"
rpm = 2
otpm = 5000
stream_event_delay = "1ms"
stream_break_rate = 1.0
quota_exhausted_after = 3
"#,
        "provider.toml",
    )
    .unwrap();
    let server = common::serve(ChaosConfig::new(script)).await;
    let mut a = open(server.local_addr(), STREAM).await;
    assert!(a.headers.contains_key("anthropic-ratelimit-output-tokens-limit"));
    assert_eq!(frames(&mut a.body).await.unwrap_err().len(), 1, "broken after one event");
    let b = open(server.local_addr(), PLAIN).await;
    let c = open(server.local_addr(), PLAIN).await;
    let d = open(server.local_addr(), PLAIN).await;
    assert_eq!((b.status, c.status, d.status), (200, 429, 400));
    drop((b, c, d));
    let counts = settled(&server).await;
    assert_eq!(
        counts,
        ProviderCounts {
            ok: 2,
            rate_limited: 1,
            quota_exhausted: 1,
            streams_started: 1,
            streams_broken: 1,
            ..ProviderCounts::default()
        }
    );
    // The same counts over HTTP, where a harness in another process reads them.
    let stats = common::get(server.local_addr(), "/stats").await.unwrap();
    let v: serde_json::Value = serde_json::from_slice(&stats.body.unwrap()).unwrap();
    assert_eq!(v["provider"]["quota_exhausted"], 1);
    assert_eq!(v["provider"]["streams_broken"], 1);
    assert_eq!(v["phases"][0]["provider"]["ok"], 2);

    let e = Script::parse("[[phase]]\n\n[provider]\nkind = \"anthropic\"\notpm = 0\n", "p.toml")
        .unwrap_err();
    assert_eq!(
        e.to_string(),
        "p.toml:5:8: provider.otpm: must be at least 1 (leave it out for no limit)"
    );
    let e = Script::parse(
        "[[phase]]\n[provider]\nkind = \"openai\"\nstream_break_rate = \"often\"\n",
        "p.toml",
    )
    .unwrap_err();
    assert!(
        e.to_string().starts_with("p.toml:4:21: provider.stream_break_rate: invalid type"),
        "{e}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_provider_setting_that_breaks_a_rule_stops_the_server_from_starting() {
    let mut config = ChaosConfig::single(Phase::default());
    config.provider = Some(ProviderConfig { kind: ProviderKind::OpenAi, rpm: None, tpm: None });
    config.provider_options.otpm = Some(10);
    let e = stormguard_chaos::spawn(config, "127.0.0.1:0".parse().unwrap()).await.unwrap_err();
    assert_eq!(
        e.to_string(),
        "invalid chaos config: provider.otpm: input and output tokens are metered apart by \
         anthropic, not openai"
    );
}

/// Over h2 a broken stream is a reset of that stream only: the connection carries the next.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_h2_a_broken_stream_resets_that_stream_and_the_connection_goes_on() {
    let options = ProviderOptions { stream_break_rate: 1.0, ..Default::default() };
    let server =
        serve_provider(ProviderKind::OpenAi, None, options, Script::single(Phase::default())).await;
    let tcp = TcpStream::connect(server.local_addr()).await.unwrap();
    let (mut sender, conn) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        TokioIo::new(tcp),
    )
    .await
    .unwrap();
    tokio::spawn(conn);
    for body in [STREAM, PLAIN] {
        let req = http::Request::post("http://chaos/v1/chat/completions")
            .body(Full::new(Bytes::from_static(body.as_bytes())))
            .unwrap();
        let mut resp = sender.send_request(req).await.unwrap().into_body();
        let got = frames(&mut resp).await;
        if body == STREAM {
            assert_eq!(got.unwrap_err().len(), 1, "one event, then the stream's reset");
        } else {
            assert!(String::from_utf8_lossy(&got.unwrap().concat()).contains("\"usage\""));
        }
    }
    let c = settled(&server).await;
    assert_eq!((c.ok, c.streams_started, c.streams_broken), (2, 1, 1));
}
