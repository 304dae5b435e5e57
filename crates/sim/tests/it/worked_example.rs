//! The README's worked example, reproduced by the model: 16 calls planned in flight behind a
//! cap of 20, at 5, 20 and 40 % errors.

use stormguard_sim::{PolicyReport, Report, builtin, simulate};

fn report() -> Report {
    simulate(&builtin::scenario("worked-example").unwrap()).unwrap()
}

fn phase_means(p: &PolicyReport) -> Vec<f64> {
    p.phases.iter().map(|ph| ph.in_flight_mean).collect()
}

fn within(got: f64, want: f64, tolerance: f64) -> bool {
    (got - want).abs() <= want * tolerance
}

#[test]
fn the_table_comes_out_of_the_model() {
    let r = report();
    let names: Vec<_> = r.policies[0].phases.iter().map(|p| p.name.as_str()).collect();
    assert_eq!(names, ["5% errors", "20% errors", "40% errors"]);

    // Retry each failure once: primary × (1 + e), no cap, fixed latency.
    let once = phase_means(r.policy("retry-once").unwrap());
    for (got, want) in once.iter().zip([16.8, 19.2, 22.4]) {
        assert!(within(*got, want, 0.02), "retry-once: {once:?} vs 16.8 / 19.2 / 22.4");
    }
    // Retry until success: primary / (1 − e).
    let until = phase_means(r.policy("retry-until-success").unwrap());
    for (got, want) in until.iter().zip([16.84, 20.0, 26.67]) {
        assert!(within(*got, want, 0.02), "retry-until-success: {until:?}");
    }
    // Without retries the dependency sees exactly the plan: the extra load is the retries'.
    let none = phase_means(r.policy("no-retries").unwrap());
    assert!(none.iter().all(|m| within(*m, 16.0, 0.01)), "{none:?}");
}

#[test]
fn the_budget_under_the_shared_cap_never_passes_20() {
    let r = report();
    let budget = r.policy("ratio-budget").unwrap();
    assert_eq!(budget.in_flight.cap, Some(20));
    assert!(budget.in_flight.max <= 20, "max {}", budget.in_flight.max);
    assert!(budget.phases.iter().all(|p| p.in_flight_max <= 20));
    // At 40 % errors the budget holds retries to 25 % of primaries: about 20 in flight.
    let at_40 = &budget.phases[2];
    assert!(at_40.in_flight_mean > 19.0 && at_40.in_flight_mean <= 20.0, "{at_40:?}");
    assert!(at_40.retry_fraction <= 0.25 + 0.005, "{at_40:?}");
    // What is shed is refused, by the budget or the cap, and surfaces as errors.
    assert!(budget.retries_denied_by.contains_key("cap"), "{:?}", budget.retries_denied_by);
    // The unprotected path breaks the same cap: retry once passes 20 at 40 %.
    let once = r.policy("retry-once").unwrap();
    assert!(once.phases[2].in_flight_max > 20 && once.in_flight.max > 20);
    assert_eq!(once.in_flight.cap, None);
}
