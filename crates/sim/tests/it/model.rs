//! Properties of the engine itself: determinism, memory that follows concurrency, caps and
//! pools at the dependency, fleet-wide sharing.

use std::time::Duration;

use stormguard_sim::{Options, Scenario, builtin, simulate, simulate_with};

#[test]
fn same_seed_same_bytes() {
    let s = builtin::scenario("metastable").unwrap();
    let a = simulate(&s).unwrap().to_json(true);
    let b = simulate_with(&s, &Options { jobs: 3, ..Options::default() }).unwrap().to_json(true);
    assert_eq!(a, b, "threads do not change the results");
    let mut other = s.clone();
    other.seed += 1;
    assert_ne!(a, simulate(&other).unwrap().to_json(true), "the seed matters");
}

#[test]
fn policies_see_the_same_arrivals() {
    let r = simulate(&builtin::scenario("metastable").unwrap()).unwrap();
    let actions: Vec<u64> = r.policies.iter().map(|p| p.actions).collect();
    assert!(actions.windows(2).all(|w| w[0] == w[1]), "{actions:?}");
}

#[test]
fn memory_follows_concurrency_not_run_length() {
    let mut s = builtin::scenario("worked-example").unwrap();
    s.policies.retain(|p| p.name == "retry-once" || p.name == "ratio-budget");
    s.phases.clear();
    s.dependency.base.error_rate = 0.2;
    s.duration = Duration::from_secs(10);
    let short = simulate(&s).unwrap();
    s.duration = Duration::from_secs(100);
    let long = simulate(&s).unwrap();
    for (a, b) in short.policies.iter().zip(&long.policies) {
        assert!(b.requests >= 9 * a.requests);
        let (fa, fb) = (a.footprint, b.footprint);
        // A few dozen in flight at once, whatever the run length.
        assert!(fb.requests <= 64 && fb.attempts <= 64 && fb.events <= 128, "{fb:?}");
        assert!(fb.requests <= fa.requests + 8, "{fa:?} vs {fb:?}");
    }
}

#[test]
fn a_separate_retry_pool_adds_to_the_cap_and_the_shared_cap_holds() {
    let r = simulate(&builtin::scenario("slow-dependency").unwrap()).unwrap();
    let shared = r.policy("ratio-budget").unwrap();
    let pooled = r.policy("ratio-budget+retry-pool4").unwrap();
    let naive = r.policy("retry-2-backoff").unwrap();
    assert!(shared.in_flight.max <= 20, "{}", shared.in_flight.max);
    assert!(pooled.in_flight.max > 20 && pooled.in_flight.max <= 24, "{}", pooled.in_flight.max);
    assert!(naive.in_flight.max > 100, "no cap: the dependency's queue fills");
    // The cap keeps goodput where the uncapped client gets almost none.
    let slow = |p: &stormguard_sim::PolicyReport| p.phases[1].goodput;
    assert!(slow(shared) > 0.2 && slow(naive) < 0.1, "{} {}", slow(shared), slow(naive));
}

/// The fleet scenario, shortened to its outage so it runs quickly in debug builds.
fn fleet_outage() -> Scenario {
    let mut s = builtin::scenario("fleet").unwrap();
    s.fleet.load = stormguard_sim::scenario::Load::Open {
        rate: 10.0,
        arrivals: stormguard_sim::scenario::Arrivals::Poisson,
    };
    s.duration = Duration::from_secs(36);
    s.phases.truncate(1);
    s
}

#[test]
fn per_instance_floors_multiply_and_fleet_sharing_keeps_them() {
    let r = simulate(&fleet_outage()).unwrap();
    let outage = |name: &str| {
        let p = r.policy(name).unwrap();
        let ph = p.phases.iter().find(|ph| ph.name == "outage").unwrap().clone();
        (ph.retry_fraction, ph.offered_per_s)
    };
    let (instance, _) = outage("ratio-budget");
    let (fleet, _) = outage("ratio-budget/fleet");
    let (naive, _) = outage("retry-3-backoff");
    // 50 floors of 10 retries/s against one: the per-instance reserve multiplies.
    assert!(instance > 2.0 * fleet, "per instance {instance}, fleet {fleet}");
    assert!(naive > 2.5, "naive retries every failure: {naive}");
    let per_instance = r.policy("ratio-budget").unwrap();
    assert_eq!(per_instance.in_flight.cap, Some(1_000), "50 caps of 20 add up");
    assert_eq!(r.policy("ratio-budget/fleet").unwrap().in_flight.cap, Some(250));
    // Breakers open and fail fast during the outage; they close again after it.
    let breaker = r.policy("ratio-budget+breaker").unwrap();
    assert!(breaker.primaries_denied_by.get("breaker").copied().unwrap_or(0) > 0);
    let recovered = breaker.recovery_s.expect("the breakers close again after the outage");
    assert!(recovered <= 4.0, "{recovered}");
    let with = breaker.phases[1].offered_per_s;
    let (_, without) = outage("ratio-budget");
    assert!(with < without / 2.0, "an open breaker sends less: {with} vs {without}");
}

#[test]
fn closed_loop_self_limits_and_capacity_phases_bound_throughput() {
    let s = Scenario::parse(
        "closed.toml",
        r#"
        duration = "30s"
        [fleet]
        instances = 2
        concurrency = 10
        [client]
        deadline = "10s"
        [dependency]
        capacity = 40
        service_time = "fixed 10ms"
        [[phase]]
        name = "squeezed"
        start = "10s"
        end = "20s"
        capacity = 5
        [[policy]]
        "#,
    )
    .unwrap();
    let r = simulate(&s).unwrap();
    let p = &r.policies[0];
    // 20 workers never have more than 20 requests in flight, whatever the dependency does.
    assert!(p.in_flight.max <= 20, "{}", p.in_flight.max);
    let [before, squeezed, after] = &p.phases[..] else { panic!("{:?}", p.phases) };
    // 20 workers × 1 / 10 ms = 2 000 actions/s; 5 servers × 1 / 10 ms = 500/s.
    assert!((before.offered_per_s - 2_000.0).abs() < 50.0, "{before:?}");
    assert!((squeezed.offered_per_s - 500.0).abs() < 20.0, "{squeezed:?}");
    assert!((after.offered_per_s - 2_000.0).abs() < 50.0, "{after:?}");
    assert!(squeezed.in_flight_mean > 19.0, "the workers wait in the dependency's queue");
    assert_eq!(p.error_rate, 0.0);
}

/// `arrivals` gives the very actions the model starts: as many, and in the same places, for
/// Poisson and uniform spacing and several instances; a closed loop has none to give.
#[test]
fn the_arrivals_given_out_are_the_ones_the_model_runs() {
    for spacing in ["poisson", "uniform"] {
        let text = format!(
            "duration = \"7s\"\nseed = 4\n[fleet]\ninstances = 3\nrate = 40\narrivals = \"{spacing}\"\n\
             [dependency]\ncapacity = 50\nservice_time = \"fixed 20ms\"\n[[phase]]\nname = \"late\"\n\
             start = \"5s\"\nend = \"7s\"\n[[policy]]\nretries = 0\n"
        );
        let sc = stormguard_sim::Scenario::parse("a.toml", &text).unwrap();
        let arrivals = stormguard_sim::arrivals(&sc).unwrap();
        let report = stormguard_sim::simulate(&sc).unwrap();
        assert_eq!(arrivals.len() as u64, report.policies[0].actions, "{spacing}");
        assert!(arrivals.windows(2).all(|w| w[0] <= w[1]), "{spacing}: in time order");
        assert!(arrivals.iter().all(|(t, i)| *t < sc.duration && *i < 3));
        // Each instance's share, and the late segment's: what the model counted there.
        let late = arrivals.iter().filter(|(t, _)| t.as_secs_f64() >= 5.0).count() as f64;
        let primaries_late = report.policies[0].phases[1].offered_per_s * 2.0;
        assert!((late - primaries_late).abs() <= 1.0, "{spacing}: {late} vs {primaries_late}");
    }
    let closed = "[fleet]\nconcurrency = 4\n[dependency]\ncapacity = 5\nservice_time = \"5ms\"\n[[policy]]\nretries = 0\n";
    assert!(
        stormguard_sim::arrivals(&stormguard_sim::Scenario::parse("c.toml", closed).unwrap())
            .is_none()
    );
}

/// A trace the proxy recorded runs as the fleet's arrivals: its first tries of the chosen
/// dependency, at their instants, and nothing else (other dependencies, other events and what
/// comes after `duration` are left out). A trace that cannot be used is refused at its key,
/// naming the file and the line.
#[test]
fn a_recorded_trace_is_the_arrivals() {
    let dir = std::env::temp_dir().join(format!("sg-sim-trace-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut trace = String::new();
    for ms in (0..3_000).step_by(7) {
        trace.push_str(&format!("{{\"t_ms\":{ms},\"op\":\"request\",\"dependency\":\"pay\"}}\n"));
        trace.push_str(&format!("{{\"t_ms\":{ms},\"op\":\"success\",\"dependency\":\"pay\"}}\n"));
        trace.push_str(&format!("{{\"t_ms\":{ms},\"op\":\"request\",\"dependency\":\"ship\"}}\n"));
    }
    std::fs::write(dir.join("incident.jsonl"), &trace).unwrap();
    let scenario = |fleet: &str| {
        let text = format!(
            "duration = \"2s\"\n[fleet]\n{fleet}\n[dependency]\ncapacity = 50\n\
             service_time = \"fixed 20ms\"\n[[policy]]\nretries = 0\n"
        );
        let path = dir.join("s.toml");
        std::fs::write(&path, text).unwrap();
        stormguard_sim::Scenario::from_file(&path)
    };
    let sc = scenario("trace = \"incident.jsonl\"\ntrace_dependency = \"pay\"").unwrap();
    let arrivals = stormguard_sim::arrivals(&sc).unwrap();
    let expected: Vec<_> = (0..2_000u64).step_by(7).map(std::time::Duration::from_millis).collect();
    assert_eq!(arrivals.iter().map(|(t, _)| *t).collect::<Vec<_>>(), expected);
    let report = stormguard_sim::simulate(&sc).unwrap();
    assert_eq!(report.policies[0].actions, expected.len() as u64);

    let err = |fleet: &str| scenario(fleet).unwrap_err().to_string();
    let e = err("trace = \"incident.jsonl\"");
    assert!(e.contains("fleet.trace") && e.contains("more than one dependency (pay, ship)"), "{e}");
    let e = err("trace = \"incident.jsonl\"\nrate = 10");
    assert!(e.contains("fleet.rate") && e.contains("either trace or rate"), "{e}");
    std::fs::write(dir.join("broken.jsonl"), "{\"t_ms\":1,\"op\":\"request\"}\nnot json\n")
        .unwrap();
    let e = err("trace = \"broken.jsonl\"");
    assert!(e.contains("broken.jsonl:2: not JSON"), "{e}");
    let e = err("trace = \"missing.jsonl\"");
    assert!(e.contains("cannot read the trace"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}
