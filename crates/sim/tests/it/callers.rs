//! Callers that retry on their own (`client.own_retries`): a budget that sees their retries
//! (`caller_retries = "enforce"`, the proxy's default) holds the dependency's load near its
//! own terms; one that takes them for first tries (`"off"`) lets the caller's loop multiply it.

use stormguard_sim::{Scenario, simulate};

#[test]
fn a_callers_own_loop_is_held_only_when_its_retries_are_seen() {
    let s = Scenario::parse(
        "callers.toml",
        r#"
        duration = "20s"
        [fleet]
        instances = 1
        rate = 320
        arrivals = "uniform"
        [client]
        deadline = "2s"
        own_retries = 3
        own_backoff = "10ms"
        [dependency]
        capacity = 100
        service_time = "50ms"
        error_rate = 0.4
        [[policy]]
        name = "no-stormguard"
        retries = 0
        [[policy]]
        name = "seen"
        budget = "ratio:percent=0.25,min_per_sec=0"
        retries = 0
        cap = 100
        [[policy]]
        name = "unseen"
        budget = "ratio:percent=0.25,min_per_sec=0"
        retries = 0
        cap = 100
        caller_retries = "off"
        "#,
    )
    .unwrap();
    let r = simulate(&s).unwrap();
    let (none, seen, unseen) = (
        r.policy("no-stormguard").unwrap(),
        r.policy("seen").unwrap(),
        r.policy("unseen").unwrap(),
    );
    // The caller's loop alone: 1 + 0.4 + 0.16 + 0.064 attempts a call.
    assert!((none.amplification - 1.624).abs() < 0.03, "{}", none.amplification);
    assert!(none.caller_retries > 0 && none.retries_issued == 0);
    // Seen, its retries spend the budget: at most 25 % of first tries.
    assert!(seen.amplification <= 1.26, "{}", seen.amplification);
    assert!(seen.retries_issued as f64 <= 0.25 * seen.primaries as f64 + 1.0, "{seen:?}");
    assert!(seen.retries_denied_by.get("budget").copied().unwrap_or(0) > 0);
    // Unseen, they are first tries: they deposit, and the load is the loop's.
    assert_eq!(unseen.retries_issued, 0);
    assert!((unseen.amplification - none.amplification).abs() < 0.03, "{}", unseen.amplification);
}
