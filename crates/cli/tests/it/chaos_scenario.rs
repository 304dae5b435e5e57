//! One scenario, simulated and served: `stormguard chaos --scenario FILE` plays the scenario's
//! dependency over its timeline, and what a client measures at it — the phase boundaries
//! (chaos's own phase counts), the error rate and the latency percentiles of each phase —
//! agrees with what `stormguard simulate` of the same file reports, within sampling error.
//! Two phases of 3 s: healthy, then 30 % of answers 503; log-normal service times around
//! 40 ms; 8 callers in a closed loop. The tolerances: error rates within 0.06 (about three
//! standard errors at 300 answers), latency percentiles within 20 % (sampling, plus loopback's
//! millisecond or two on 40 ms). A model of a dependency twice as slow fails the same
//! comparison.

use std::time::{Duration, Instant};

use http_body_util::{BodyExt, Empty};
use hyper::body::Bytes;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use stormguard::cmd::chaos_scenario::{NotServed, script};
use stormguard_chaos::{ChaosConfig, Latency, OnDisconnect};
use stormguard_sim::Scenario;

const SCENARIO: &str = r#"
name = "served"
seed = 5
duration = "6s"

[fleet]
instances = 1
concurrency = 8

[client]
deadline = "5s"

[dependency]
capacity = 100
service_time = "lognormal median=40ms sigma=0.3"

[[phase]]
name = "healthy"
start = "0s"
end = "3s"

[[phase]]
name = "failing"
start = "3s"
end = "6s"
error_rate = 0.3

[[policy]]
retries = 0
"#;

/// The `q` quantile of sorted latencies, in ms.
fn quantile(sorted: &[Duration], q: f64) -> f64 {
    let i = ((sorted.len() as f64 * q).ceil() as usize).clamp(1, sorted.len()) - 1;
    sorted[i].as_secs_f64() * 1000.0
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scenario_served_by_chaos_measures_what_the_simulator_predicts() {
    let scenario = Scenario::parse("served.toml", SCENARIO).unwrap();
    let predicted = stormguard_sim::simulate(&scenario).unwrap();
    let predicted = &predicted.policies[0];

    let s = script(&scenario).unwrap();
    let names: Vec<_> = s.phases.iter().map(|p| p.name.as_str()).collect();
    assert_eq!(names, ["healthy", "failing"]);
    assert_eq!(s.phases[0].servers, Some(100));
    assert!(matches!(s.phases[1].latency, Latency::LogNormal { .. }));
    let mut config = ChaosConfig::new(s);
    config.on_disconnect = OnDisconnect::Finish;
    let chaos = stormguard_chaos::spawn(config, "127.0.0.1:0".parse().unwrap()).await.unwrap();
    let url: hyper::Uri = chaos.url("/").parse().unwrap();

    // Eight callers for the scenario's 6 s, each answer kept with its phase's name.
    let client = Client::builder(TokioExecutor::new()).build_http::<Empty<Bytes>>();
    let start = Instant::now();
    let callers: Vec<_> = (0..8)
        .map(|_| {
            let (client, url) = (client.clone(), url.clone());
            tokio::spawn(async move {
                let mut seen = Vec::new();
                while start.elapsed() < Duration::from_millis(5_900) {
                    let t = Instant::now();
                    let resp = client.get(url.clone()).await.unwrap();
                    let phase = resp.headers()["x-chaos-phase"].to_str().unwrap().to_string();
                    let status = resp.status().as_u16();
                    resp.into_body().collect().await.unwrap();
                    seen.push((phase, status, t.elapsed()));
                }
                seen
            })
        })
        .collect();
    let mut seen = Vec::new();
    for c in callers {
        seen.extend(c.await.unwrap());
    }
    let stats = chaos.stats();
    // Chaos moved to the second phase at 3 s, as the timeline says.
    let phases: Vec<_> = stats.phases.iter().map(|p| p.name.as_str()).collect();
    assert_eq!(phases, ["healthy", "failing"], "{stats:?}");

    // A model whose dependency is twice as slow as the one served: the same comparison fails.
    let wrong = SCENARIO.replace("median=40ms", "median=80ms");
    let wrong = stormguard_sim::simulate(&Scenario::parse("wrong.toml", &wrong).unwrap()).unwrap();
    let wrong_p50 = wrong.policies[0].phases[0].latency_ok_ms.unwrap().p50;

    for (i, name) in ["healthy", "failing"].into_iter().enumerate() {
        let answers: Vec<_> = seen.iter().filter(|(p, ..)| p == name).collect();
        assert!(answers.len() > 200, "{name}: {} answers", answers.len());
        let errors = answers.iter().filter(|(_, s, _)| *s == 503).count() as f64;
        let measured_errors = errors / answers.len() as f64;
        let mut ok: Vec<Duration> =
            answers.iter().filter(|(_, s, _)| *s == 200).map(|(.., l)| *l).collect();
        ok.sort();
        let p = &predicted.phases[i];
        let lat = p.latency_ok_ms.expect("the model served some");
        let (p50, p90) = (quantile(&ok, 0.5), quantile(&ok, 0.9));
        eprintln!(
            "{name}: errors {measured_errors:.3} measured / {:.3} predicted; p50 {p50:.1} / \
             {:.1} ms; p99 {:.1} / {:.1} ms ({} answers)",
            p.error_rate,
            lat.p50,
            quantile(&ok, 0.99),
            lat.p99,
            answers.len()
        );
        assert!((measured_errors - p.error_rate).abs() <= 0.06, "{name}: errors");
        assert!((p50 / lat.p50 - 1.0).abs() <= 0.2, "{name}: p50 {p50} vs {}", lat.p50);
        if i == 0 {
            assert!((p50 / wrong_p50 - 1.0).abs() > 0.2, "a doubled model agrees: {wrong_p50}");
        }
        // The model reports p50 and p99; the log-normal's p90 lies between at exp(1.2816 σ).
        let model_p90 = lat.p50 * (1.281_551_6 * 0.3_f64).exp();
        assert!((p90 / model_p90 - 1.0).abs() <= 0.2, "{name}: p90 {p90} vs {model_p90}");
    }
}

/// A bounded queue and exponential service times are served as the model has them.
#[test]
fn a_queue_and_an_exponential_service_time_are_served() {
    let text = SCENARIO
        .replace("capacity = 100", "capacity = 100\nqueue = 10")
        .replace("lognormal median=40ms sigma=0.3", "exponential 40ms");
    let s = script(&Scenario::parse("served.toml", &text).unwrap()).unwrap();
    assert_eq!((s.phases[0].servers, s.phases[0].queue), (Some(100), Some(10)));
    assert_eq!(s.phases[1].latency, Latency::Exponential { mean: Duration::from_millis(40) });
}

/// What chaos cannot play as the model does is refused by name.
#[test]
fn what_chaos_cannot_serve_is_named() {
    let with = |from: &str, to: &str| {
        let text = SCENARIO.replace(from, to);
        script(&Scenario::parse("served.toml", &text).unwrap()).unwrap_err()
    };
    let e = with("error_rate = 0.3", "error_rate = 0.3\nerror_time = \"fixed 1ms\"");
    assert_eq!(e, NotServed::ErrorTime { at: "failing".to_string() });
    let e = with(
        "lognormal median=40ms sigma=0.3",
        "lognormal median=40ms sigma=0.3 tail=0.1 tail_median=1s",
    );
    assert!(matches!(e, NotServed::ServiceTime { .. }), "{e}");
    assert!(e.to_string().contains("tail_median=1s"), "{e}");
    let e = with("capacity = 100", "capacity = 100\nworkers = 22");
    assert_eq!(e, NotServed::ServersAndWorkers { at: "[dependency]".to_string() });
}

/// A dependency with workers and no capacity is chaos's `workers`; a uniform service time is
/// chaos's uniform latency.
#[test]
fn workers_and_a_uniform_service_time_are_served() {
    let text = SCENARIO
        .replace("capacity = 100", "workers = 22")
        .replace("lognormal median=40ms sigma=0.3", "uniform min=80ms max=120ms");
    let s = script(&Scenario::parse("served.toml", &text).unwrap()).unwrap();
    assert_eq!((s.phases[0].servers, s.phases[0].workers), (None, Some(22)));
    let ms = Duration::from_millis;
    assert_eq!(s.phases[1].latency, Latency::Uniform { min: ms(80), max: ms(120) });
}

/// `stormguard chaos --scenario FILE --check` prints the phases it would serve; a scenario it
/// cannot serve exits 2 saying why.
#[test]
fn the_flag_reads_a_scenario_file() {
    let dir = std::env::temp_dir().join(format!("sg-chaos-scenario-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let good = dir.join("served.toml");
    std::fs::write(&good, SCENARIO).unwrap();
    let out = assert_cmd::Command::cargo_bin("stormguard")
        .unwrap()
        .args(["chaos", "--scenario", good.to_str().unwrap(), "--check"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}{}", String::from_utf8_lossy(&out.stderr));
    assert!(text.contains("healthy") && text.contains("failing"), "{text}");
    let bad = dir.join("tailed.toml");
    let tailed = SCENARIO.replace("sigma=0.3", "sigma=0.3 tail=0.1 tail_median=1s");
    std::fs::write(&bad, tailed).unwrap();
    let out = assert_cmd::Command::cargo_bin("stormguard")
        .unwrap()
        .args(["chaos", "--scenario", bad.to_str().unwrap(), "--check"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("tailed.toml") && err.contains("tail"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}
