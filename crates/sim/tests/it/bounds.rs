//! The simulator's work is bounded: a scenario too big to run is refused when it is read, with
//! the bound in the message; a run that passes the bound of attempts stops with an error; and
//! a closed loop that restarts forever at one instant is stopped instead of spinning.

use std::time::Duration;

use stormguard_sim::scenario::{InvalidScenario, MAX_ATTEMPTS};
use stormguard_sim::{Options, RunError, Scenario, builtin, simulate_with};

#[test]
fn a_scenario_past_the_bound_is_refused_when_read() {
    // 100 instances × 1000/s for a day: 8.64 billion first tries per policy.
    let text = "duration = \"24h\"\n[fleet]\ninstances = 100\nrate = 1000\n[dependency]\n\
                capacity = 100\nservice_time = \"fixed 10ms\"\n[[policy]]\nretries = 1\n";
    let err = Scenario::parse("huge.toml", text).unwrap_err();
    assert_eq!(err.position(), Some((4, 8)), "{err}");
    assert_eq!(err.key().unwrap().to_string(), "fleet.rate", "{err}");
    let Some(&InvalidScenario::TooMuchWork { calls, max }) = err.rule::<InvalidScenario>() else {
        panic!("{err}")
    };
    assert_eq!((calls, max), (8_640_000_000.0, MAX_ATTEMPTS));
    assert!(err.to_string().contains("about 8640000000 calls per policy"), "{err}");
    assert!(err.to_string().contains(&format!("the {MAX_ATTEMPTS} attempts")), "{err}");
    // Just under the bound is accepted (and not run here).
    let ok = text.replace("24h", "8m");
    assert!(Scenario::parse("big.toml", &ok).is_ok());
    // Every built-in scenario is far under it.
    for (name, _) in builtin::ALL {
        let s = builtin::scenario(name).unwrap();
        if let Some(calls) = s.fleet.expected_calls(s.duration) {
            assert!(calls < MAX_ATTEMPTS as f64 / 10.0, "{name}: {calls}");
        }
    }
}

#[test]
fn a_run_past_its_bound_stops_with_an_error() {
    let s = builtin::scenario("worked-example").unwrap();
    let options = Options { jobs: 1, max_attempts: 10_000, ..Options::default() };
    let err = simulate_with(&s, &options).unwrap_err();
    assert!(matches!(*err.reason, RunError::TooMuchWork { max_attempts: 10_000, .. }), "{err}");
    assert!(err.reason.to_string().starts_with("sent more than 10000 attempts"), "{err}");
    // The same scenario under the default bound runs.
    assert!(simulate_with(&s, &Options::default()).is_ok());
}

#[test]
fn a_closed_loop_stuck_at_one_instant_is_stopped() {
    // Ten workers, one server, no queue, no think time: nine are refused at once and start
    // again at the same nanosecond, forever. Before the bound this never returned.
    let text = "duration = \"1s\"\n[fleet]\nconcurrency = 10\n[dependency]\ncapacity = 1\nqueue = 0\n\
                service_time = \"fixed 1ms\"\n[[policy]]\nretries = 0\n";
    let s = Scenario::parse("stuck.toml", text).unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(simulate_with(&s, &Options::default()).map(|_| ()));
    });
    let result = rx.recv_timeout(Duration::from_secs(120)).expect("the run ended");
    let err = result.unwrap_err();
    assert!(matches!(*err.reason, RunError::Stuck { events: 1_000_000, .. }), "{err}");
    assert!(err.reason.to_string().contains("without the virtual clock moving"), "{err}");
    // With a think time it runs.
    let s = Scenario::parse(
        "thinking.toml",
        &text.replace("concurrency = 10", "concurrency = 10\nthink = \"1ms\""),
    )
    .unwrap();
    assert!(simulate_with(&s, &Options::default()).is_ok());
}
