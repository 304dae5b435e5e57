//! A dependency that slows down under load (`workers`, chaos's model, the demo's upstream):
//! past `workers` attempts in flight each takes `in flight / workers` times its draw, so load
//! above the workers feeds on itself; below them the service time is the draw. A uniform service
//! time stays between its ends. The demo's scenario reads as the demo plays it.

use std::time::Duration;

use stormguard_sim::scenario::Load;
use stormguard_sim::{Scenario, ServiceTime, builtin, simulate};

fn scenario(rate: u32, workers: &str) -> Scenario {
    let text = format!(
        "name = \"w\"\nseed = 3\nduration = \"20s\"\n[fleet]\nrate = {rate}\narrivals = \"uniform\"\n\
         [client]\ndeadline = \"30s\"\n[dependency]\n{workers}\n\
         service_time = \"uniform min=90ms max=110ms\"\n[[policy]]\nretries = 0\n"
    );
    Scenario::parse("w.toml", &text).unwrap()
}

#[test]
fn past_the_workers_every_attempt_slows_and_the_slowdown_feeds_itself() {
    // 50/s × 100 ms = 5 in flight, under 10 workers: the draw, between 90 and 110 ms.
    let calm = simulate(&scenario(50, "workers = 10")).unwrap();
    let p = &calm.policies[0];
    let lat = p.latency_ms;
    assert!(lat.p99 <= 110.0 * 1.016 && lat.p50 >= 90.0, "{lat:?}");
    assert!(p.in_flight.max <= 10, "{:?}", p.in_flight);
    // 150/s × 100 ms = 15 in flight, past 10 workers: slower, so more in flight, so slower.
    let over = simulate(&scenario(150, "workers = 10")).unwrap();
    let p = &over.policies[0];
    let lat = p.latency_ms;
    assert!(lat.p50 > 500.0, "{lat:?}");
    assert!(p.in_flight.max > 100, "{:?}", p.in_flight);
    // The unprotected comparison: the same load on as many servers as it needs takes the draw.
    let servers = simulate(&scenario(150, "capacity = 1000")).unwrap();
    let lat = servers.policies[0].latency_ms;
    assert!(lat.p99 <= 110.0 * 1.016, "{lat:?}");
}

#[test]
fn the_demo_scenario_is_the_demo() {
    let sc = builtin::scenario("demo").unwrap();
    assert_eq!(sc.dependency.base.workers, Some(22));
    assert_eq!(sc.dependency.base.servers(), None, "every request served at once");
    let ms = Duration::from_millis;
    assert_eq!(sc.dependency.base.service_time, ServiceTime::Uniform { min: ms(80), max: ms(120) });
    assert!(matches!(sc.fleet.load, Load::Open { rate, .. } if rate == 160.0));
    let names: Vec<_> = sc.segments().iter().map(|s| s.name.clone()).collect();
    assert_eq!(names, ["5 % errors", "20 % errors", "40 % errors", "latency spike", "recovery"]);
    // The model's prediction: the cap holds, and the naive path is buried after the spike.
    let r = simulate(&sc).unwrap();
    let guarded = r.policy("stormguard").unwrap();
    assert!(guarded.in_flight.max <= 20, "{:?}", guarded.in_flight);
    let naive = r.policy("naive").unwrap();
    assert!(naive.phases[4].in_flight_mean > 1000.0 && naive.phases[4].goodput < 0.01);
    assert!(guarded.phases[4].goodput > 0.95, "{:?}", guarded.phases[4]);
}

#[test]
fn workers_are_read_where_they_are_written() {
    let err = Scenario::parse(
        "w.toml",
        "[fleet]\nrate = 1\n[dependency]\nworkers = 0\nservice_time = \"1ms\"\n",
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("w.toml:4:11: dependency.workers: must be between 1 and 1000000"),
        "{err}"
    );
    let err =
        Scenario::parse("w.toml", "[fleet]\nrate = 1\n[dependency]\nservice_time = \"1ms\"\n")
            .unwrap_err()
            .to_string();
    assert!(err.contains("capacity") && err.contains("(or workers)"), "{err}");
}
