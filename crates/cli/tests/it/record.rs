//! Record mode end to end: the proxy records a storm's traffic, and `stormguard replay` runs
//! the trace through the same budget (it allows what the proxy allowed) and through a stricter
//! one (it allows far fewer); and a concurrency budget's replay reads the `active` snapshots
//! record mode writes, with every `retry_done` closing a retry the proxy sent.

use std::path::{Path, PathBuf};
use std::time::Duration;

use assert_cmd::Command;
use stormguard_chaos::load::{self, Live, LoadConfig, Mode};
use stormguard_chaos::{ChaosConfig, Latency, OnDisconnect, Phase};
use stormguard_proxy::config::{ProxyConfig, ProxyDependency};
use stormguard_tower::DependencySnapshot as Snapshot;

/// What one replay printed: retries allowed and asked (stdout), and its stderr.
struct Replayed {
    allowed: u64,
    asked: u64,
    stderr: String,
}

fn replay(policy: &str, args: &[&str], trace: &Path) -> Replayed {
    let out = Command::cargo_bin("stormguard")
        .unwrap()
        .args(["replay", "--policy", policy])
        .args(args)
        .arg(trace)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "{stderr}");
    let text = String::from_utf8(out.stdout).unwrap();
    let (mut allowed, mut asked) = (0, 0);
    for l in text.lines() {
        let v: serde_json::Value = serde_json::from_str(l).unwrap();
        assert!(v["op"] == "retry" || v["op"] == "balance", "stdout holds only JSON lines: {l}");
        if v["op"] == "retry" {
            asked += 1;
            allowed += u64::from(v["allowed"] == true);
        }
    }
    Replayed { allowed, asked, stderr }
}

/// Runs a storm (40 % errors, 1 500 requests from 8 callers) through a proxy recording with
/// `policy`; returns the trace's path and the proxy's counts.
async fn record_storm(name: &str, policy: &str) -> (PathBuf, Snapshot) {
    let dir = std::env::temp_dir().join(format!("stormguard-record-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let trace = dir.join("trace.jsonl");
    let mut c = ChaosConfig::single(Phase {
        error_rate: 0.4,
        latency: Latency::Fixed(Duration::from_millis(5)),
        ..Phase::default()
    });
    c.on_disconnect = OnDisconnect::Finish;
    let upstream = stormguard_chaos::spawn(c, "127.0.0.1:0".parse().unwrap()).await.unwrap();
    let mut d = ProxyDependency::new("payments", upstream.url("").parse().unwrap());
    d.cap = 50;
    d.budget = policy.parse().unwrap();
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
    (trace, s)
}

fn count(text: &str, op: &str) -> u64 {
    text.lines()
        .filter(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            v["op"] == op && v["dependency"] == "payments"
        })
        .count() as u64
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_recorded_storm_replays_against_candidate_budgets() {
    const POLICY: &str = "ratio:percent=0.2,min_per_sec=1,ttl=10s";
    let (trace, s) = record_storm("ratio", POLICY).await;

    // The trace holds every request and every retry the proxy sent.
    let text = std::fs::read_to_string(&trace).unwrap();
    assert_eq!(count(&text, "request"), s.counters.primaries, "one request line per primary");
    let allowed_here = text.matches("\"allowed_here\":true").count() as u64;
    assert_eq!(allowed_here, s.counters.retries, "one allowed retry line per retry sent");
    assert_eq!(count(&text, "retry_done"), s.counters.retries, "each retry sent is closed");
    assert!(s.counters.retries > 100, "a storm: {} retries", s.counters.retries);
    let refused_here = text.matches("\"denied\":\"budget\"").count() as u64;
    assert!(refused_here > 0, "the budget refused retries in the recorded run");

    // The same budget on the trace allows what the proxy allowed (the proxy's ratio budget runs
    // on nanoseconds, the trace on milliseconds: a retry at a slice's edge may fall either way)...
    let same = replay(POLICY, &["--dependency", "payments"], &trace);
    assert_eq!(same.asked, allowed_here + text.matches("\"allowed_here\":false").count() as u64);
    let slack = s.counters.retries / 50 + 2;
    assert!(
        same.allowed.abs_diff(s.counters.retries) <= slack,
        "replay allowed {}, the proxy {} (± {slack})",
        same.allowed,
        s.counters.retries
    );
    // ...and says so on stderr, beside what the recording decided, with no false warning: every
    // retry_done closes a retry the proxy sent, whether or not the replayed policy allowed it.
    assert!(
        same.stderr.contains(&format!(
            "{} retries asked: {} allowed, {} denied (budget {}); as recorded: {allowed_here} \
             allowed",
            same.asked,
            same.allowed,
            same.asked - same.allowed,
            same.asked - same.allowed
        )),
        "{}",
        same.stderr
    );
    // ...a stricter one far fewer, and a generous one every retry that was asked.
    let strict = replay("ratio:percent=0.05,min_per_sec=1,ttl=10s", &[], &trace);
    assert!(
        strict.allowed * 2 < same.allowed,
        "5 % allows {}, 20 % {}",
        strict.allowed,
        same.allowed
    );
    let generous = replay("ratio:percent=1,min_per_sec=1000", &[], &trace);
    eprintln!(
        "proxy: {} requests, {} retries; replay: same budget {}, 5 % {}, generous {} of {} asked",
        s.counters.primaries,
        s.counters.retries,
        same.allowed,
        strict.allowed,
        generous.allowed,
        generous.asked
    );
    eprint!("{}", same.stderr);
    assert_eq!(generous.allowed, generous.asked);
    for r in [&same, &strict, &generous] {
        assert!(!r.stderr.contains("matched no retry"), "{}", r.stderr);
    }

    // A name the trace does not hold is an error, not an empty replay.
    Command::cargo_bin("stormguard")
        .unwrap()
        .args(["replay", "--policy", POLICY, "--dependency", "nope"])
        .arg(&trace)
        .assert()
        .code(2);
    std::fs::remove_dir_all(trace.parent().unwrap()).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_concurrency_budget_replays_from_the_recorded_snapshots() {
    const POLICY: &str = "concurrency:percent=0.2,min=2";
    let (trace, s) = record_storm("concurrency", POLICY).await;
    let text = std::fs::read_to_string(&trace).unwrap();
    let allowed_here = text.matches("\"allowed_here\":true").count() as u64;
    assert_eq!(allowed_here, s.counters.retries);
    let refused_here = text.matches("\"denied\":\"budget\"").count() as u64;
    assert!(
        s.counters.retries > 100 && refused_here > 0,
        "{} sent, {refused_here} refused",
        s.counters.retries
    );
    // Every snapshot counts the retries in its n: n >= retries.
    for l in text.lines().filter(|l| l.contains("\"op\":\"active\"")) {
        let v: serde_json::Value = serde_json::from_str(l).unwrap();
        assert!(v["n"].as_u64() >= v["retries"].as_u64(), "{l}");
    }

    let same = replay(POLICY, &[], &trace);
    let strict = replay("concurrency:percent=0,min=1", &[], &trace);
    let generous = replay("concurrency:percent=1,min=100", &[], &trace);
    eprintln!(
        "proxy: {} retries sent, {refused_here} refused by the budget; replay: same budget {} of \
         {} asked, min=1 {}, generous {}",
        s.counters.retries, same.allowed, same.asked, strict.allowed, generous.allowed
    );
    // The summary puts the recording's own decisions beside the replay's.
    assert!(
        same.stderr.contains(&format!(
            "as recorded: {} allowed, {refused_here} denied",
            s.counters.retries
        )),
        "{}",
        same.stderr
    );
    assert!(strict.allowed < same.allowed);
    assert_eq!(generous.allowed, generous.asked);
    for r in [&same, &strict, &generous] {
        assert!(!r.stderr.contains("matched no retry"), "{}", r.stderr);
    }
    std::fs::remove_dir_all(trace.parent().unwrap()).unwrap();
}
