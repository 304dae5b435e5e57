//! `stormguard chaos` and `stormguard load` as binaries: flags, exit codes, and every assertion
//! both failing when violated and passing when it holds — through a small retrying proxy, the
//! way they are used against a real stack.

use crate::support;

use std::convert::Infallible;
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Command as StdCommand, Output, Stdio};
use std::time::Duration;
use support::stormguard;

use assert_cmd::cargo::CommandCargoExt;
use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Empty, Full};
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use serde_json::Value;
use stormguard_chaos::{ChaosConfig, ChaosServer, Latency, Phase, Sampler};
use stormguard_proxy::config::{ProxyConfig, ProxyDependency};
use tokio::net::{TcpListener, TcpStream};

/// Runs `stormguard ARGS` off the async runtime (the servers it talks to live on it).
async fn run(args: Vec<String>) -> Output {
    tokio::task::spawn_blocking(move || {
        stormguard().args(args).timeout(Duration::from_secs(30)).output().unwrap()
    })
    .await
    .unwrap()
}

fn args(s: &[&str]) -> Vec<String> {
    s.iter().map(|x| x.to_string()).collect()
}

fn json(out: &Output) -> Value {
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stdout)))
}

async fn chaos(phase: Phase, seed: u64) -> ChaosServer {
    let mut config = ChaosConfig::single(phase);
    config.seed = seed;
    stormguard_chaos::spawn(config, "127.0.0.1:0".parse().unwrap()).await.unwrap()
}

async fn forward(upstream: SocketAddr, attempt: u32) -> Result<(StatusCode, Bytes), String> {
    let stream = TcpStream::connect(upstream).await.map_err(|e| e.to_string())?;
    let (mut tx, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| e.to_string())?;
    tokio::spawn(conn);
    let req = Request::get("/")
        .header("host", "upstream")
        .header("x-stormguard-attempt", attempt)
        .body(Empty::<Bytes>::new())
        .unwrap();
    let resp = tx.send_request(req).await.map_err(|e| e.to_string())?;
    let status = resp.status();
    let body = resp.into_body().collect().await.map_err(|e| e.to_string())?.to_bytes();
    Ok((status, body))
}

/// A stack under test: forwards each request, and retries a 503 once (marked as attempt 2).
async fn retrying_proxy(upstream: SocketAddr) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else { continue };
            let service = service_fn(move |_req: Request<hyper::body::Incoming>| async move {
                let mut answer = forward(upstream, 1).await;
                if matches!(answer, Ok((StatusCode::SERVICE_UNAVAILABLE, _))) {
                    answer = forward(upstream, 2).await;
                }
                let (status, body) = answer.unwrap_or((StatusCode::BAD_GATEWAY, Bytes::new()));
                Ok::<_, Infallible>(
                    Response::builder().status(status).body(Full::new(body)).unwrap(),
                )
            });
            tokio::spawn(
                hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service),
            );
        }
    });
    addr
}

#[test]
fn help_tells_a_newcomer_what_to_do() {
    let out = stormguard().args(["chaos", "--help"]).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    for needle in [
        "--error-rate",
        "--latency-p99",
        "--max-concurrency",
        "--rate-limit",
        "--on-disconnect",
        "--script",
        "/stats/reset",
        "/phase/next",
        "docs/chaos-and-load.md",
        "--provider",
        "--itpm",
        "--otpm",
        "--stream-event-delay",
        "--stream-break-rate",
        "--overloaded",
        "--overloaded-rate",
        "--quota-exhausted-after",
        "insufficient_quota",
    ] {
        assert!(text.contains(needle), "chaos --help lacks {needle}");
    }
    let out = stormguard().args(["load", "--help"]).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    for needle in [
        "--concurrency",
        "--rate",
        "--assert-max-in-flight",
        "--assert-retry-fraction",
        "--assert-success-rate",
        "--stats",
        "Exit codes",
    ] {
        assert!(text.contains(needle), "load --help lacks {needle}");
    }
}

#[test]
fn a_bad_script_names_file_line_and_key_and_exits_2() {
    let dir = std::env::temp_dir().join(format!("stormguard-chaos-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("phases.toml");
    std::fs::write(
        &path,
        "[[phase]]\nname = \"calm\"\n\n[[phase]]\nname = \"storm\"\nlatency_p99 = \"2s\"\n",
    )
    .unwrap();
    let out = stormguard().arg("chaos").arg("--script").arg(&path).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("phases.toml:6:15: phase[1].latency_p99: latency_p99 needs latency_p50"),
        "{err}"
    );
    let out =
        stormguard().args(["chaos", "--script", "/nonexistent/phases.toml"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
}

#[test]
fn bad_flags_exit_2_naming_the_flag() {
    for (flags, needle) in [
        (&["chaos", "--error-rate", "1.5"][..], "--error-rate"),
        (&["chaos", "--status", "200"][..], "--status"),
        (&["chaos", "--latency", "soon"][..], "--latency"),
        (&["chaos", "--rate-limit", "lots"][..], "--rate-limit"),
        (&["chaos", "--provider", "acme"][..], "--provider"),
        (&["chaos", "--rpm", "10"][..], "--provider"),
        (&["chaos", "--stream-break-rate", "0.5"][..], "--stream-break-rate needs --provider"),
        (&["chaos", "--provider", "openai", "--otpm", "10"][..], "--otpm: input and output"),
        (&["chaos", "--provider", "openai", "--rpm", "0"][..], "--rpm: must be at least 1"),
        (&["chaos", "--provider", "openai", "--stream-break-rate", "2"][..], "--stream-break-rate"),
        (&["chaos", "--overloaded-rate", "1.5"][..], "--overloaded-rate"),
        (&["chaos", "--overloaded", "4s..2s"][..], "--overloaded"),
        (&["chaos", "--overloaded", "1s..3s", "--overloaded", "2s..4s"][..], "overlaps"),
        (&["load", "--target", "http://192.0.2.7:80/"][..], "not a loopback address"),
        (&["load", "--target", "http://127.0.0.1:1/", "--rate", "0/s"][..], "--rate"),
        (&["load", "--target", "http://127.0.0.1:1/", "--duration", "2h"][..], "duration"),
        (&["load", "--target", "http://127.0.0.1:1/", "--header", "no-colon"][..], "--header"),
        (
            &["load", "--target", "http://127.0.0.1:1/", "--assert-success-rate", "2"][..],
            "success rate",
        ),
    ] {
        let out = stormguard().args(flags).output().unwrap();
        assert_eq!(out.status.code(), Some(2), "{flags:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(needle), "{flags:?}: {err}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_stats_exit_2() {
    let s = chaos(Phase::default(), 0).await;
    let (dead, _refusing) = crate::support::refused_addr();
    let out = run(args(&[
        "load",
        "--target",
        &s.url("/"),
        "--requests",
        "5",
        "--stats",
        &format!("http://{dead}/stats"),
        "--assert-max-in-flight",
        "5",
    ]))
    .await;
    assert_eq!(out.status.code(), Some(2), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot reset the upstream's stats"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn assertions_fail_when_violated_and_pass_when_they_hold() {
    // Upstream: half the requests fail with 503; the stack under test retries each 503 once.
    let phase = Phase {
        error_rate: 0.5,
        latency: Latency::Fixed(Duration::from_millis(20)),
        ..Phase::default()
    };
    let upstream = chaos(phase, 9).await;
    let proxy = retrying_proxy(upstream.local_addr()).await;
    let target = format!("http://{proxy}/");
    let stats = upstream.url("/stats");
    let load = |extra: &[&str]| {
        let mut a = args(&[
            "load",
            "--target",
            &target,
            "--concurrency",
            "4",
            "--requests",
            "200",
            "--stats",
            &stats,
            "--json",
        ]);
        a.extend(extra.iter().map(|s| s.to_string()));
        a
    };

    let held = run(load(&[
        "--assert-max-in-flight",
        "4",
        "--assert-retry-fraction",
        "0.75",
        "--assert-success-rate",
        "0.6",
    ]))
    .await;
    assert_eq!(held.status.code(), Some(0), "{}", String::from_utf8_lossy(&held.stderr));
    let report = json(&held);
    let sent = report["sent"].as_u64().unwrap();
    let up_requests = report["upstream"]["requests"].as_u64().unwrap();
    assert_eq!(sent, 200);
    // Measured at the upstream without reading any header, and confirmed by the marked retries.
    assert_eq!(up_requests - sent, report["upstream"]["retries"].as_u64().unwrap());
    let fraction = report["retry_fraction"].as_f64().unwrap();
    assert!((0.35..=0.65).contains(&fraction), "{fraction}");
    assert!(report["upstream"]["in_flight"]["max"].as_u64().unwrap() <= 4);
    assert!(report["assertions"].as_array().unwrap().iter().all(|a| a["ok"] == true));

    for (flag, value, name) in [
        ("--assert-retry-fraction", "0.3", "retry fraction"),
        ("--assert-success-rate", "0.95", "success rate"),
    ] {
        let out = run(load(&[flag, value])).await;
        assert_eq!(out.status.code(), Some(1), "{flag} {value}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("assertion failed") && err.contains(name), "{err}");
        let report = json(&out);
        assert_eq!(report["assertions"][0]["ok"], false);
    }
    // Eight callers at once on a 20 ms upstream: more than two are in flight together.
    let mut a = load(&["--assert-max-in-flight", "2"]);
    a[4] = "8".into();
    let out = run(a).await;
    assert_eq!(out.status.code(), Some(1), "{}", String::from_utf8_lossy(&out.stdout));
    assert!(String::from_utf8_lossy(&out.stderr).contains("max in flight at the upstream"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn success_rate_is_exactly_the_seeded_draws() {
    let phase = Phase { error_rate: 0.25, ..Phase::default() };
    let s = chaos(phase.clone(), 77).await;
    let sampler = Sampler::new(77);
    let ok = (0..400).filter(|&k| !sampler.draw(&phase, k).is_error()).count() as f64 / 400.0;
    let out = run(args(&[
        "load",
        "--target",
        &s.url("/"),
        "--rate",
        "2000/s",
        "--requests",
        "400",
        "--json",
        "--assert-success-rate",
        &format!("{ok}"),
    ]))
    .await;
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let report = json(&out);
    assert_eq!(report["mode"], "open");
    assert_eq!(report["scheduled"], 400);
    assert_eq!(report["success_rate"].as_f64().unwrap(), ok);
    // One success more than the draws give fails (a fresh server replays the same draws).
    let again = chaos(phase, 77).await;
    let above = format!("{}", ok + 0.0025);
    let out = run(args(&[
        "load",
        "--target",
        &again.url("/"),
        "--requests",
        "400",
        "--assert-success-rate",
        &above,
    ]))
    .await;
    assert_eq!(out.status.code(), Some(1));
    // The human summary names every outcome and the verdict.
    let text = String::from_utf8_lossy(&out.stdout);
    for needle in ["target", "outcomes", "latency ms", "success", "FAIL"] {
        assert!(text.contains(needle), "{text}");
    }
}

/// Reads the address from the `listening on http://ADDR` line on stderr.
fn start_chaos(flags: &[&str]) -> (Child, SocketAddr) {
    let mut child = StdCommand::cargo_bin("stormguard")
        .unwrap()
        .args(["chaos", "--listen", "127.0.0.1:0", "--duration", "30s"])
        .args(flags)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    let mut stderr = BufReader::new(child.stderr.take().unwrap());
    stderr.read_line(&mut line).unwrap();
    // Keep reading, so the server's later lines never meet a closed pipe.
    std::thread::spawn(move || std::io::copy(&mut stderr, &mut std::io::sink()));
    let addr = line
        .split("http://")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .unwrap_or_else(|| panic!("no address in {line:?}"))
        .parse()
        .unwrap();
    (child, addr)
}

fn stop(child: Child) -> Value {
    let pid = child.id().to_string();
    assert!(StdCommand::new("kill").args(["-TERM", &pid]).status().unwrap().success());
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "{:?}: {}", out.status, String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

/// `stormguard chaos --provider openai --rpm 2`: OpenAI-shaped answers with `usage`, its
/// rate-limit headers, and a 429 past two requests a minute, counted in the printed stats.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_chaos_binary_plays_a_model_provider() {
    let (child, addr) = start_chaos(&["--provider", "openai", "--rpm", "2", "--tpm", "100000"]);
    let client = reqwest_free_post(addr).await;
    assert_eq!(client.iter().map(|(s, _)| *s).collect::<Vec<_>>(), [200, 200, 429]);
    let (_, first) = &client[0];
    assert!(first.contains("\"completion_tokens\":7"), "{first}");
    let stats = stop(child);
    assert_eq!(stats["status_counts"]["429"], 1);
}

/// The provider flags on top of a script's `[provider]`, and overload windows as phases, in
/// `--check`'s summary.
#[test]
fn provider_flags_override_the_script_and_bursts_are_phases() {
    let out = stormguard()
        .args(["chaos", "--provider", "anthropic", "--otpm", "800", "--overloaded", "2s..4s"])
        .args(["--quota-exhausted-after", "9", "--check"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(
        lines,
        [
            "the flags: ok (3 phases, seed 0, on_disconnect finish)",
            "  phase[0] flags: 2s, no injected errors",
            "  phase[1] overloaded: 2s, no injected errors, overloaded_rate 1",
            "  phase[2] flags: until advanced, no injected errors",
            "  provider anthropic: streams 5ms an event, otpm 800, quota_exhausted_after 9",
        ]
    );
    let dir = std::env::temp_dir().join(format!("stormguard-provider-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("provider.toml");
    std::fs::write(&path, "[[phase]]\n\n[provider]\nkind = \"anthropic\"\nrpm = 50\nitpm = 100\n")
        .unwrap();
    let out = stormguard()
        .arg("chaos")
        .arg("--script")
        .arg(&path)
        .args(["--rpm", "60", "--stream-break-rate", "0.5", "--check"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains(
            "provider anthropic: streams 5ms an event, rpm 60, itpm 100, stream_break_rate 0.5"
        ),
        "{text}"
    );
    // A bad provider key in the script: file, line, column and key, exit 2.
    std::fs::write(&path, "[[phase]]\n\n[provider]\nkind = \"openai\"\nitpm = 100\n").unwrap();
    let out = stormguard().arg("chaos").arg("--script").arg(&path).output().unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("provider.toml:5:8: provider.itpm: input and output tokens"), "{err}");
}

/// `stormguard chaos --provider openai --quota-exhausted-after 1 --stream-break-rate 1`: the
/// stream is cut after its first event, the next request is refused for want of quota, and the
/// printed stats count both by kind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_chaos_binary_breaks_streams_and_runs_out_of_quota() {
    let (child, addr) = start_chaos(&[
        "--provider",
        "openai",
        "--quota-exhausted-after",
        "1",
        "--stream-break-rate",
        "1",
    ]);
    let mut got = Vec::new();
    for _ in 0..2 {
        let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        let (mut sender, conn) =
            hyper::client::conn::http1::handshake(TokioIo::new(stream)).await.unwrap();
        tokio::spawn(conn);
        let req = Request::post("/v1/chat/completions")
            .header("host", "chaos")
            .body(Full::new(Bytes::from_static(br#"{"stream":true,"max_tokens":7}"#)))
            .unwrap();
        let resp = sender.send_request(req).await.unwrap();
        let status = resp.status().as_u16();
        let body = resp.into_body().collect().await.map(|b| b.to_bytes());
        got.push((status, body));
    }
    assert_eq!(got[0].0, 200);
    assert!(got[0].1.is_err(), "the stream is cut: {:?}", got[0].1);
    assert_eq!(got[1].0, 429);
    let refused = got[1].1.as_ref().unwrap();
    assert!(String::from_utf8_lossy(refused).contains("insufficient_quota"));
    let stats = stop(child);
    assert_eq!(stats["provider"]["streams_started"], 1);
    assert_eq!(stats["provider"]["streams_broken"], 1);
    assert_eq!(stats["provider"]["quota_exhausted"], 1);
}

/// Three POSTs with `max_tokens = 7`, each on its own connection: (status, body).
async fn reqwest_free_post(addr: SocketAddr) -> Vec<(u16, String)> {
    let mut out = Vec::new();
    for _ in 0..3 {
        let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        let (mut sender, conn) =
            hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
                .await
                .unwrap();
        tokio::spawn(conn);
        let req = http::Request::post("/v1/chat/completions")
            .header("host", "chaos")
            .body(http_body_util::Full::new(Bytes::from_static(br#"{"max_tokens":7}"#)))
            .unwrap();
        let resp = sender.send_request(req).await.unwrap();
        let status = resp.status().as_u16();
        assert!(resp.headers().contains_key("x-ratelimit-remaining-requests"));
        let body = http_body_util::BodyExt::collect(resp.into_body()).await.unwrap().to_bytes();
        out.push((status, String::from_utf8_lossy(&body).into_owned()));
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_chaos_binary_serves_counts_switches_phase_and_prints_stats() {
    let dir = std::env::temp_dir().join(format!("stormguard-chaos-bin-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let script = dir.join("two.toml");
    std::fs::write(&script, "seed = 1\n[[phase]]\nname = \"calm\"\n\n[[phase]]\nname = \"storm\"\nerror_rate = 1.0\nstatus = 502\n").unwrap();
    let (child, addr) = start_chaos(&["--script", script.to_str().unwrap()]);
    let target = format!("http://{addr}/");
    let out = run(args(&[
        "load",
        "--target",
        &target,
        "--requests",
        "20",
        "--json",
        "--assert-max-in-flight",
        "10",
    ]))
    .await;
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(json(&out)["outcomes"]["status_counts"]["200"], 20);

    // SIGUSR1 moves to the storm.
    assert!(
        StdCommand::new("kill")
            .args(["-USR1", &child.id().to_string()])
            .status()
            .unwrap()
            .success()
    );
    let stats_url: http::Uri = format!("http://{addr}/stats").parse().unwrap();
    let mut phase = Value::Null;
    for _ in 0..200 {
        let (_, body) = stormguard_chaos::load::http_call(Method::GET, &stats_url).await.unwrap();
        phase = serde_json::from_slice::<Value>(&body).unwrap()["phase"].clone();
        if phase == "storm" {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(phase, "storm");
    let out = run(args(&["load", "--target", &target, "--requests", "10", "--json"])).await;
    assert_eq!(json(&out)["outcomes"]["status_counts"]["502"], 10);

    let stats = stop(child);
    assert_eq!(stats["phase"], "storm");
    assert_eq!(stats["phases"][1]["status_counts"]["502"], 10);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn method_headers_and_body_reach_the_upstream() {
    let s = chaos(Phase::default(), 0).await;
    let flags = |extra: &[&str]| {
        let mut a = args(&[
            "load",
            "--target",
            &s.url("/pay?x=1"),
            "--requests",
            "12",
            "--method",
            "POST",
            "-H",
            "x-stormguard-attempt: 2",
            "--body",
            "{\"amount\": 1}",
            "--stats",
            &s.url("/stats"),
            "--json",
        ]);
        a.extend(extra.iter().map(|x| x.to_string()));
        a
    };
    let out = run(flags(&["--assert-max-in-flight", "12"])).await;
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let report = json(&out);
    // Every request carried the attempt header: the upstream counts each as a retry.
    assert_eq!(report["upstream"]["retries"], 12);
    assert_eq!(report["upstream"]["requests"], 12);
    assert_eq!(report["outcomes"]["success"], 12);
    // So the upstream could not tell a stack's retries from them: asserting the retry fraction
    // with such a header is refused up front, not measured wrong.
    let out = run(flags(&["--assert-retry-fraction", "0.25"])).await;
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("carry a retry mark"));
}

/// `stormguard proxy` in process: a cap of 20 and a 25 % budget with no reserve.
async fn stormguard_proxy(upstream: &ChaosServer) -> stormguard_proxy::ProxyHandle {
    let mut d = ProxyDependency::new("default", upstream.url("").parse().unwrap());
    d.cap = 20;
    d.budget = "ratio:percent=0.25,min_per_sec=0".parse().unwrap();
    let mut config = ProxyConfig::single("127.0.0.1:0".parse().unwrap(), d);
    config.admin = None;
    stormguard_proxy::start(config).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_proof_fails_without_stormguard_and_holds_through_it() {
    // The worked example at 40 % errors: 320 arrivals/s at 50 ms keep the planned 16 first
    // tries in flight. A naive client that retries each failure once sends the dependency 1.4
    // times that (22.4 on average, more at peaks) and retries 40 % of first tries; stormguard
    // with a cap of 20 and a 25 % budget holds both.
    let phase = Phase {
        error_rate: 0.4,
        latency: Latency::Fixed(Duration::from_millis(50)),
        ..Phase::default()
    };
    let asserting = |target: &str, up: &ChaosServer| {
        args(&[
            "load",
            "--target",
            target,
            "--rate",
            "320/s",
            "--requests",
            "480",
            "--stats",
            &up.url("/stats"),
            "--json",
            "--assert-max-in-flight",
            "20",
            "--assert-retry-fraction",
            "0.25",
        ])
    };

    let naive_up = chaos(phase.clone(), 11).await;
    let naive = retrying_proxy(naive_up.local_addr()).await;
    let out = run(asserting(&format!("http://{naive}/"), &naive_up)).await;
    assert_eq!(out.status.code(), Some(1), "{}", String::from_utf8_lossy(&out.stderr));
    let report = json(&out);
    let (max, fraction) = (
        report["upstream"]["in_flight"]["max"].as_u64().unwrap(),
        report["retry_fraction"].as_f64().unwrap(),
    );
    let verdicts = report["assertions"].as_array().unwrap();
    assert!(verdicts.iter().filter(|a| a["ok"] == false).count() == 2, "{verdicts:?}");
    assert!(max > 20 && fraction > 0.3, "naive: max {max}, retry fraction {fraction}");

    let guarded_up = chaos(phase, 11).await;
    let proxy = stormguard_proxy(&guarded_up).await;
    let out = run(asserting(&format!("http://{}/", proxy.listen_addrs()[0]), &guarded_up)).await;
    let report = json(&out);
    assert_eq!(out.status.code(), Some(0), "{}", report["assertions"]);
    let (g_max, g_fraction) = (
        report["upstream"]["in_flight"]["max"].as_u64().unwrap(),
        report["retry_fraction"].as_f64().unwrap(),
    );
    // The budget was spent, not idle: retries reached the dependency.
    assert!(report["upstream"]["retries"].as_u64().unwrap() > 0);
    eprintln!(
        "naive: max in flight {max}, retry fraction {fraction:.3}; stormguard: max {g_max}, \
         retry fraction {g_fraction:.3}"
    );
    proxy.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_nobody_answered_fails() {
    // The target is down: every request is a connect error. No assertion was asked for, and
    // still the run fails.
    let (dead, _refusing) = crate::support::refused_addr();
    let out = run(args(&["load", "--target", &format!("http://{dead}/"), "--requests", "5"])).await;
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("no request was answered") && err.contains("5 connect errors"), "{err}");

    // Every request is reset: sent, never answered.
    let resets = chaos(Phase { reset_rate: 1.0, ..Phase::default() }, 0).await;
    let out = run(args(&["load", "--target", &resets.url("/"), "--requests", "5"])).await;
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("5 resets"));

    // The stack answers (502: its dependency is down) but never reaches the upstream whose
    // stats are read: a cap that held over nothing proves nothing.
    let upstream = chaos(Phase::default(), 0).await;
    let stack = retrying_proxy(dead).await;
    let out = run(args(&[
        "load",
        "--target",
        &format!("http://{stack}/"),
        "--requests",
        "5",
        "--stats",
        &upstream.url("/stats"),
        "--assert-max-in-flight",
        "20",
    ]))
    .await;
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stdout).contains("5 x 502"));
    assert!(String::from_utf8_lossy(&out.stderr).contains("the upstream saw no request"));
}

/// `--forward` takes an `http://HOST:PORT`; anything else is a usage error naming the flag.
#[test]
fn chaos_forward_wants_an_http_url() {
    let out = crate::support::stormguard()
        .args(["chaos", "--listen", "127.0.0.1:0", "--forward", "ftp://127.0.0.1:1"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8(out.stderr).unwrap();
    assert!(err.contains("--forward") && err.contains("expected http://HOST:PORT"), "{err}");
}
