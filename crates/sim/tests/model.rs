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
