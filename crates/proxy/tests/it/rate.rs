//! Rate admission, judged at the provider: chaos plays an OpenAI-shaped API with its own
//! requests or tokens per minute (a bucket of the limit, refilled continuously). After a burst
//! that empties its bucket (and teaches the proxy what is left), an open loop at twice the
//! limit runs for 10 s through the proxy: with rate admission the provider answers at most 1 %
//! of what reaches it with a 429 (the proxy follows the `remaining` it states and holds first
//! tries back in FIFO order) and serves at least 90 % of what its limit allows; without it,
//! about half of what reaches the provider is a 429. Three ways the limit binds: requests with
//! the limit configured, requests learned only from the headers, tokens (large `max_tokens`)
//! learned only from the headers. And what the admin listener shows of the limits.

use crate::common;

use common::*;

use std::time::Duration;

use bytes::Bytes;
use http::Request;
use http_body_util::{BodyExt, Full};
use stormguard_chaos::{ChaosConfig, ChaosServer, Phase, ProviderConfig, ProviderKind};
use stormguard_proxy::config::{ListenerConfig, ProxyConfig, ProxyDependency};
use stormguard_proxy::{ProxyHandle, start};

/// How long the open loop runs.
const SECS: u64 = 10;

/// Which limit binds, and what the proxy is told of it.
#[derive(Clone, Copy)]
struct Case {
    /// The provider's requests and tokens per minute.
    rpm: Option<u64>,
    tpm: Option<u64>,
    /// Each request's `max_tokens` (its cost: that plus its body's size in tokens).
    max_tokens: u64,
    /// The proxy is configured with the provider's limits; else it learns them from headers.
    configured: bool,
}

impl Case {
    fn body(&self) -> Bytes {
        Bytes::from(format!(r#"{{"max_tokens":{}}}"#, self.max_tokens))
    }

    /// Tokens a request costs, counted as chaos and the proxy count them (4 bytes a token).
    fn tokens(&self) -> u64 {
        (self.body().len() as u64).div_ceil(4) + self.max_tokens
    }

    /// Requests a minute the binding limit allows.
    fn per_minute(&self) -> u64 {
        let by_tokens = self.tpm.map(|t| t / self.tokens());
        match (self.rpm, by_tokens) {
            (Some(r), Some(t)) => r.min(t),
            (r, t) => r.or(t).expect("a limit"),
        }
    }
}

async fn provider(case: Case) -> ChaosServer {
    let mut config = ChaosConfig::single(Phase::default());
    config.provider =
        Some(ProviderConfig { kind: ProviderKind::OpenAi, rpm: case.rpm, tpm: case.tpm });
    stormguard_chaos::spawn(config, "127.0.0.1:0".parse().unwrap()).await.unwrap()
}

async fn proxy(upstream: &ChaosServer, case: Case, admission: bool) -> ProxyHandle {
    let mut d = ProxyDependency::new("llm", upstream.url("").parse().unwrap());
    d.cap = 200;
    d.queue = 1_000;
    d.queue_timeout = Duration::from_secs(5);
    // A 429 is not retried here: the count at the provider is of first tries.
    d.max_retries = 0;
    if admission {
        if case.configured {
            d.rate.requests_per_minute = case.rpm;
            d.rate.tokens_per_minute = case.tpm;
        } else {
            d.rate.learn = true;
        }
    }
    let mut c = ProxyConfig::single("127.0.0.1:0".parse().unwrap(), d);
    c.admin = None;
    start(c).await.unwrap()
}

async fn post(addr: std::net::SocketAddr, body: Bytes) -> u16 {
    let req = Request::post(format!("http://{addr}/v1/chat/completions"))
        .header("content-type", "application/json")
        .body(Full::new(body))
        .unwrap();
    match tokio::time::timeout(Duration::from_secs(30), client().request(req)).await {
        Ok(Ok(r)) => r.status().as_u16(),
        _ => 0,
    }
}

/// (429s at the provider, 200s at the provider) for an open loop at twice the binding limit
/// for [`SECS`] seconds, after a burst that empties the provider's bucket.
async fn run(case: Case, admission: bool) -> (u64, u64) {
    let upstream = provider(case).await;
    let p = proxy(&upstream, case, admission).await;
    let addr = p.listen_addrs()[0];
    for _ in 0..case.per_minute() {
        post(addr, case.body()).await;
    }
    upstream.reset();
    let mut tasks = Vec::new();
    let every = Duration::from_secs(60) / (2 * case.per_minute() as u32);
    for _ in 0..(SECS * 2 * case.per_minute() / 60) {
        let at = tokio::time::Instant::now();
        tasks.push(tokio::spawn(post(addr, case.body())));
        tokio::time::sleep_until(at + every).await;
    }
    for t in tasks {
        t.await.unwrap();
    }
    let seen = upstream.stats().total.status_counts;
    p.shutdown().await;
    (seen.get(&429).copied().unwrap_or(0), seen.get(&200).copied().unwrap_or(0))
}

/// With and without admission side by side (each its own provider and proxy; the load is
/// light, tens of requests a second).
async fn judge(case: Case) {
    let (with, without) = tokio::join!(run(case, true), run(case, false));
    let (limited, served) = with;
    let reached = limited + served;
    eprintln!("with rate admission: {served} served, {limited} 429s at the provider");
    assert!(limited * 100 <= reached.max(1), "{limited} 429s of {reached} at the provider");
    // What the refill allows over the run.
    let refill = SECS * case.per_minute() / 60;
    assert!(served * 10 >= refill * 9, "{served} served, the limit allows {refill}");
    let (limited, served) = without;
    eprintln!("without: {served} served, {limited} 429s at the provider");
    // At twice the limit about 40 % are refused (41-43 % measured alone); the suite's other
    // tests slow this one's own pacing, and 39.5 % was seen then. A third is still the provider
    // refusing a large share, against at most 1 % with admission.
    assert!(limited * 3 >= limited + served, "{limited} 429s of {}", limited + served);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twice_the_request_limit_configured() {
    judge(Case { rpm: Some(600), tpm: None, max_tokens: 1, configured: true }).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twice_the_request_limit_learned_from_headers_only() {
    judge(Case { rpm: Some(600), tpm: None, max_tokens: 1, configured: false }).await;
}

/// 36 000 tokens a minute at 300 tokens a request: 120 requests a minute, far below the
/// requests per minute.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twice_the_token_limit_learned_from_headers_only() {
    judge(Case { rpm: Some(100_000), tpm: Some(36_000), max_tokens: 295, configured: false }).await;
}

/// `GET` on the admin listener: the body as text.
async fn admin_get(p: &ProxyHandle, path: &str) -> String {
    let uri = format!("http://{}{path}", p.admin_addr().unwrap()).parse().unwrap();
    let resp = client().get(uri).await.unwrap();
    assert_eq!(resp.status(), 200, "{path}");
    String::from_utf8(resp.into_body().collect().await.unwrap().to_bytes().to_vec()).unwrap()
}

/// Two dependencies behind one proxy, one with rate admission (600 requests a minute) and one
/// without: after one request, `/stats.json` shows the first one's limit and what is left of
/// it, and the dashboard its provider-limits panel; the other has neither.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_shows_the_limits_of_a_dependency_with_rate_admission_only() {
    let upstream = chaos(Phase::default()).await;
    let mut llm = ProxyDependency::new("llm", upstream.url("").parse().unwrap());
    llm.rate.requests_per_minute = Some(600);
    let plain = ProxyDependency::new("plain", upstream.url("").parse().unwrap());
    let mut c = ProxyConfig::single("127.0.0.1:0".parse().unwrap(), llm);
    c.dependencies.push(plain);
    c.listeners.push(ListenerConfig::new("127.0.0.1:0".parse().unwrap(), Some("plain".into())));
    c.admin = Some("127.0.0.1:0".parse().unwrap());
    let p = start(c).await.unwrap();
    assert_eq!(post(p.listen_addrs()[0], Bytes::from_static(b"{}")).await, 200);
    assert_eq!(post(p.listen_addrs()[1], Bytes::from_static(b"{}")).await, 200);

    let stats: serde_json::Value =
        serde_json::from_str(&admin_get(&p, "/stats.json").await).unwrap();
    let dep = |name: &str| {
        stats["dependencies"]
            .as_array()
            .unwrap()
            .iter()
            .find(|d| d["name"] == name)
            .unwrap()
            .clone()
    };
    let (llm, plain) = (dep("llm"), dep("plain"));
    assert_eq!(llm["requests"], 1);
    let upstreams = llm["rate"]["upstreams"].as_array().expect("a rate object");
    assert_eq!(upstreams.len(), 1, "{llm}");
    let u = &upstreams[0];
    // One unnamed upstream is `0`, as the rate metrics label it.
    assert_eq!((&u["name"], &u["cooling"]), (&"0".into(), &false.into()), "{u}");
    let requests = &u["requests"];
    assert_eq!(requests["limit_per_minute"], 600, "{u}");
    let available = requests["available"].as_u64().unwrap();
    assert!(available <= 600, "{available} available of 600");
    assert_eq!(requests["reserved"], 0, "the one answer has ended: {u}");
    assert_eq!(requests["held_seconds"], 0.0, "{u}");
    // No token limit is configured or learned: no token quantities.
    for unknown in ["tokens", "input_tokens", "output_tokens"] {
        assert!(u.get(unknown).is_none(), "{unknown}: {u}");
    }
    assert_eq!(plain["requests"], 1);
    assert!(plain.get("rate").is_none(), "no rate admission, no rate: {plain}");

    let html = admin_get(&p, "/dashboard").await;
    let section = |name: &str| {
        let start = html.find(&format!("data-dep=\"{name}\"")).unwrap();
        let len = html[start..].find("</section>").unwrap();
        html[start..start + len].to_string()
    };
    let llm = section("llm");
    assert!(llm.contains("<h3>provider limits</h3>"), "{llm}");
    let cell = llm.split("<td>0</td><td>requests</td><td>").nth(1).expect("the requests row");
    let shown: u64 = cell.split(" / 600</td>").next().unwrap().parse().expect("available / 600");
    assert!(shown <= 600, "{llm}");
    assert!(!section("plain").contains("provider limits"));
    p.shutdown().await;
}
