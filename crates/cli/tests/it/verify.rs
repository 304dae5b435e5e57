//! `stormguard verify`: the simulator's prediction against a live loopback run of the same
//! 10-second scenario. Chaos serves the timeline (fixed 50 ms, 10 % errors, then 40 %), the
//! simulator's own arrivals (Poisson, 200 a second) go to `stormguard proxy` with a 25 %
//! budget under a cap of 30 — not reached, so what the dependency sees depends on the model's
//! every part — and to a naive retry-once forwarder beside it.
//!
//! - The stormguard policy's in-flight p99 and amplification agree with the prediction
//!   (calibrated with chaos's own share, measured at chaos) within the documented ±10 % in both
//!   segments.
//! - The same measurements against a model whose dependency is twice as slow (in the model
//!   only, given the same share) disagree: the comparison can fail.
//! - A scenario that cannot run live is refused, exit 2, with the reason (one too large for
//!   the machine names the `--scale` that fits it; a factor outside (0, 1] is refused).

use stormguard::cmd::verify::verify;
use stormguard_sim::Scenario;

const SCENARIO: &str = r#"
name = "verify-ci"
seed = 11
duration = "10s"

[fleet]
rate = 200

[client]
deadline = "2s"

[dependency]
capacity = 1000
service_time = "fixed 50ms"

[[phase]]
name = "10% errors"
start = "0s"
end = "5s"
error_rate = 0.1

[[phase]]
name = "40% errors"
start = "5s"
end = "10s"
error_rate = 0.4

[[policy]]
retries = 1

[[policy]]
name = "budget"
budget = "ratio:percent=0.25,min_per_sec=0"
retries = 1
cap = 30
backoff = "none"
"#;

#[test]
fn the_live_run_agrees_with_the_model_and_a_wrong_model_does_not() {
    let scenario = Scenario::parse("verify-ci.toml", SCENARIO).unwrap();
    let comparison = verify(&scenario, 0.10).unwrap();
    eprintln!("{}", comparison.table());
    let budget = comparison.policies.iter().find(|p| p.name == "budget").unwrap();
    assert_eq!(budget.live, Some("stormguard proxy"));
    assert_eq!(budget.agrees, Some(true), "{}", comparison.table());
    assert_eq!(budget.segments.len(), 2);
    // Calibrated with chaos's own share of the run, measured at chaos.
    let overhead = budget.run.as_ref().unwrap().overhead;
    assert_eq!(budget.calibrated_ms, Some(overhead.as_secs_f64() * 1e3));
    let naive = comparison.policies.iter().find(|p| p.name == "retry-once").unwrap();
    assert_eq!((naive.live, naive.judged), (Some("naive forwarder"), false));
    // The naive path's amplification is measured too: 1.4 at 40 % errors.
    let amp = naive.segments[1].figures.iter().find(|f| f.name == "amplification").unwrap();
    let measured = amp.measured.unwrap();
    assert!((measured - 1.4).abs() < 0.05, "naive amplification {measured}");

    let doubled = SCENARIO.replace("fixed 50ms", "fixed 100ms");
    let doubled = Scenario::parse("doubled.toml", &doubled).unwrap();
    // Judged as verify judges, the band between the model as written and the calibrated one:
    // the share measured live does not rescue a wrong model.
    let mut calibrated = doubled.clone();
    calibrated.dependency.overhead = overhead;
    let wrong = comparison.against(
        &stormguard_sim::simulate(&doubled).unwrap(),
        Some(&stormguard_sim::simulate(&calibrated).unwrap()),
    );
    eprintln!("{}", wrong.table());
    let budget = wrong.policies.iter().find(|p| p.name == "budget").unwrap();
    assert_eq!(budget.agrees, Some(false), "a model twice as slow agrees:\n{}", wrong.table());
    assert_eq!(wrong.disagreements(), 1);
}

#[test]
fn a_scenario_that_cannot_run_live_is_refused_with_the_reason() {
    let dir = std::env::temp_dir().join(format!("sg-verify-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for (name, from, to, reason) in [
        ("closed.toml", "rate = 200", "concurrency = 10", "closed loop"),
        ("fleet.toml", "rate = 200", "instances = 3\nrate = 200", "fleet.instances = 3"),
        ("fast.toml", "rate = 200", "rate = 50000", "--scale 0.04 runs it at that fraction"),
        (
            "tail.toml",
            "fixed 50ms",
            "lognormal median=50ms sigma=0.2 tail=0.1 tail_median=1s",
            "tail",
        ),
    ] {
        let path = dir.join(name);
        std::fs::write(&path, SCENARIO.replace(from, to)).unwrap();
        let out = assert_cmd::Command::cargo_bin("stormguard")
            .unwrap()
            .args(["verify", path.to_str().unwrap()])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{name}: {err}");
        assert!(err.contains("cannot run live") && err.contains(reason), "{name}: {err}");
    }
    // Scaled only when asked, by a factor that makes sense.
    let path = dir.join("fast.toml");
    for (scale, reason) in [("0", "--scale: must be above 0 and at most 1, got 0"), ("2", "got 2")]
    {
        let out = assert_cmd::Command::cargo_bin("stormguard")
            .unwrap()
            .args(["verify", path.to_str().unwrap(), "--scale", scale])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{err}");
        assert!(err.contains(reason), "{err}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
