//! A dependency's own share (`SimDependency::overhead`, what `verify` measures at chaos and
//! calibrates with): every attempt holds its server that much past its drawn service time, so
//! in flight grows by Little's law (rate × overhead) and latency by the overhead; none is the
//! model as written. A policy simulated alone is the same as beside the others (calibration
//! simulates one policy at a time).

use std::time::Duration;

use stormguard_sim::{Scenario, builtin, simulate};

fn scenario() -> Scenario {
    let text = "name = \"o\"\nseed = 5\nduration = \"20s\"\n[fleet]\nrate = 200\n\
                arrivals = \"uniform\"\n[client]\ndeadline = \"5s\"\n[dependency]\n\
                capacity = 1000\nservice_time = \"fixed 50ms\"\n[[policy]]\nretries = 0\n";
    Scenario::parse("o.toml", text).unwrap()
}

#[test]
fn an_overhead_holds_every_attempt_longer() {
    let plain = simulate(&scenario()).unwrap();
    let p = &plain.policies[0];
    // 200/s × 50 ms = 10 in flight, each call 50 ms.
    assert!((p.in_flight.mean - 10.0).abs() < 0.2, "{:?}", p.in_flight);
    assert!((p.latency_ms.p99 - 50.0).abs() < 1.0, "{:?}", p.latency_ms);
    let mut slower = scenario();
    slower.dependency.overhead = Duration::from_millis(10);
    let s = simulate(&slower).unwrap();
    let p = &s.policies[0];
    // 200/s × 60 ms = 12 in flight, each call 60 ms.
    assert!((p.in_flight.mean - 12.0).abs() < 0.2, "{:?}", p.in_flight);
    assert!((p.latency_ms.p50 - 60.0).abs() < 1.0, "{:?}", p.latency_ms);
}

#[test]
fn a_policy_simulated_alone_is_the_policy_beside_the_others() {
    let all = builtin::scenario("metastable").unwrap();
    let everything = simulate(&all).unwrap();
    for (policy, report) in all.policies.iter().zip(&everything.policies) {
        let mut alone = all.clone();
        alone.policies = vec![policy.clone()];
        let r = simulate(&alone).unwrap();
        assert_eq!(r.policies[0].phases, report.phases, "{}", policy.name);
    }
}
