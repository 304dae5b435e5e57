//! A short trigger leaves the naive policies stuck in overload after it is gone, while the
//! budgeted ones recover. If the model cannot show this, the model is wrong.

use stormguard_sim::{PolicyReport, Report, builtin, simulate};

fn report() -> Report {
    simulate(&builtin::scenario("metastable").unwrap()).unwrap()
}

/// Per-bucket goodput from `from_s` on.
fn goodput_after(p: &PolicyReport, from_s: f64) -> Vec<f64> {
    p.series
        .t_s
        .iter()
        .zip(&p.series.goodput)
        .filter(|(t, _)| **t >= from_s)
        .map(|(_, g)| g.unwrap_or(0.0))
        .collect()
}

fn goodput_before(p: &PolicyReport, until_s: f64) -> Vec<f64> {
    p.series
        .t_s
        .iter()
        .zip(&p.series.goodput)
        .filter(|(t, _)| **t + 1.0 <= until_s)
        .map(|(_, g)| g.unwrap_or(0.0))
        .collect()
}

#[test]
fn naive_retries_stay_down_and_budgets_recover() {
    let r = report();
    let end = r.trigger_end_s.expect("the scenario has a trigger");
    let start = r.phases.iter().find(|p| p.trigger).unwrap().start_s;
    for name in ["retry-once", "retry-3-backoff"] {
        let p = r.policy(name).unwrap();
        // Healthy before the trigger: this is metastability, not plain overload.
        assert!(goodput_before(p, start).iter().all(|g| *g >= 0.95), "{name} before");
        let after = goodput_after(p, end);
        assert!(after.iter().all(|g| *g < 0.5), "{name} after the trigger: {after:?}");
        assert_eq!(p.recovery_s, None, "{name}");
    }
    for name in ["ratio-budget", "token-bucket", "ratio-budget+breaker"] {
        let p = r.policy(name).unwrap();
        let recovery = p.recovery_s.unwrap_or_else(|| panic!("{name} never recovered"));
        assert!(recovery <= 5.0, "{name} took {recovery} s");
        let after = goodput_after(p, end + recovery);
        assert!(after.iter().all(|g| *g >= 0.95), "{name}: {after:?}");
        assert!(p.in_flight.max <= 30, "{name}: the cap holds ({})", p.in_flight.max);
    }
    // Without retries the backlog drains too (slowly): the retries are what keep it stuck.
    let none = r.policy("no-retries").unwrap();
    assert!(none.recovery_s.is_some_and(|s| s > 2.0), "{:?}", none.recovery_s);
}

#[test]
fn the_feedback_loop_is_in_the_model() {
    let r = report();
    let once = r.policy("retry-once").unwrap();
    let after = once.phases.last().unwrap();
    // Long after the trigger: every attempt times out, every timeout is retried, the
    // dependency's queue stays full of work nobody waits for.
    assert!(after.retry_fraction > 0.9, "{after:?}");
    assert!(after.in_flight_mean > 500.0, "{after:?}");
    assert!(once.timeouts > once.requests / 2);
    // The same dependency, offered the same arrivals without retries, is not full.
    let none = r.policy("no-retries").unwrap();
    assert!(none.phases.last().unwrap().in_flight_mean < after.in_flight_mean / 2.0);
}
