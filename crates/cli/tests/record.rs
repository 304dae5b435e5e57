//! Record mode end to end: the proxy records a storm's traffic, and `stormguard replay` runs
//! the trace through the same budget (it allows about what the proxy allowed) and through a
//! stricter one (it allows far fewer).

use std::time::Duration;

use assert_cmd::Command;
use stormguard_chaos::load::{self, Live, LoadConfig, Mode};
use stormguard_chaos::{ChaosConfig, Latency, OnDisconnect, Phase};
use stormguard_proxy::config::{DependencyConfig, ProxyConfig};

const POLICY: &str = "ratio:percent=0.2,min_per_sec=1,ttl=10s";

fn replay_allowed(policy: &str, args: &[&str], trace: &std::path::Path) -> (u64, u64) {
    let out = Command::cargo_bin("stormguard")
        .unwrap()
        .args(["replay", "--policy", policy])
        .args(args)
        .arg(trace)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8(out.stdout).unwrap();
    let (mut allowed, mut asked) = (0, 0);
    for l in text.lines() {
        let v: serde_json::Value = serde_json::from_str(l).unwrap();
        if v["op"] == "retry" {
            asked += 1;
            allowed += u64::from(v["allowed"] == true);
        }
    }
    (allowed, asked)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_recorded_storm_replays_against_candidate_budgets() {
    let dir = std::env::temp_dir().join(format!("stormguard-record-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let trace = dir.join("trace.jsonl");

    let mut c = ChaosConfig::single(Phase {
        error_rate: 0.4,
        latency: Latency::Fixed(Duration::from_millis(5)),
        ..Phase::default()
    });
    c.on_disconnect = OnDisconnect::Finish;
    let upstream = stormguard_chaos::spawn(c, "127.0.0.1:0".parse().unwrap()).await.unwrap();
    let mut d = DependencyConfig::new("payments", upstream.url("").parse().unwrap());
    d.cap = 50;
    d.budget = POLICY.parse().unwrap();
    d.backoff = stormguard_core::backoff::BackoffConfig::parse_range("1ms..2ms").unwrap();
    let mut config = ProxyConfig::single("127.0.0.1:0".parse().unwrap(), d);
    config.admin = None;
    config.record = Some(trace.clone());
    let proxy = stormguard_proxy::start(config).await.unwrap();

    let mut l = LoadConfig::new(&format!("http://{}/", proxy.listen_addrs()[0])).unwrap();
    l.mode = Mode::Closed { concurrency: 8 };
    l.requests = Some(1_500);
    l.timeout = Duration::from_secs(10);
    let report = load::run(&l, &Live::default()).await.unwrap();
    assert_eq!(report.outcomes.total(), 1_500);
    let s = proxy.dependency("payments").unwrap().snapshot();
    proxy.shutdown().await;

    // The trace holds every request and every retry the proxy sent.
    let text = std::fs::read_to_string(&trace).unwrap();
    let count = |op: &str| {
        text.lines()
            .filter(|l| {
                let v: serde_json::Value = serde_json::from_str(l).unwrap();
                v["op"] == op && v["dependency"] == "payments"
            })
            .count() as u64
    };
    assert_eq!(count("request"), s.counters.primaries, "one request line per primary");
    let allowed_here = text.matches("\"allowed_here\":true").count() as u64;
    assert_eq!(allowed_here, s.counters.retries, "one allowed retry line per retry sent");
    assert!(s.counters.retries > 100, "a storm: {} retries", s.counters.retries);
    let refused_here = text.matches("\"denied\":\"budget\"").count() as u64;
    assert!(refused_here > 0, "the budget refused retries in the recorded run");

    // The same budget on the trace allows about what the proxy allowed (the proxy's ratio
    // budget runs on nanoseconds, the trace on milliseconds)...
    let (same, asked) = replay_allowed(POLICY, &["--dependency", "payments"], &trace);
    assert_eq!(asked, allowed_here + text.matches("\"allowed_here\":false").count() as u64);
    let slack = s.counters.retries / 10 + 5;
    assert!(
        same.abs_diff(s.counters.retries) <= slack,
        "replay allowed {same}, the proxy {} (± {slack})",
        s.counters.retries
    );
    // ...a stricter one far fewer, and a generous one every retry that was asked.
    let (strict, _) = replay_allowed("ratio:percent=0.05,min_per_sec=1,ttl=10s", &[], &trace);
    assert!(strict * 2 < same, "5 % allows {strict}, 20 % {same}");
    let (generous, asked) = replay_allowed("ratio:percent=1,min_per_sec=1000", &[], &trace);
    eprintln!(
        "proxy: {} requests, {} retries; replay: same budget {same}, 5 % {strict}, generous \
         {generous} of {asked} asked",
        s.counters.primaries, s.counters.retries
    );
    assert_eq!(generous, asked);

    // A name the trace does not hold is an error, not an empty replay.
    Command::cargo_bin("stormguard")
        .unwrap()
        .args(["replay", "--policy", POLICY, "--dependency", "nope"])
        .arg(&trace)
        .assert()
        .code(2);
    std::fs::remove_dir_all(&dir).unwrap();
}
