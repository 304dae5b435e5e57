//! Fan-out multiplies tails: five parallel calls each 99 % fast are all fast 0.99^5 of the
//! time. And per-action scopes bound the retries of a fan-out.

use stormguard_sim::{builtin, simulate};

#[test]
fn all_five_fast_is_the_fifth_power() {
    let r = simulate(&builtin::scenario("fan-out").unwrap()).unwrap();
    let want = 0.99f64.powi(5);
    for p in &r.policies {
        let healthy = &p.phases[0];
        assert_eq!(healthy.name, "healthy");
        let fast = healthy.fast_actions.unwrap();
        assert!((fast - want).abs() <= 0.01, "{}: {fast} vs {want}", p.name);
        // One call alone is 99 % fast; five are measurably worse.
        assert!(fast < 0.97, "{}", p.name);
    }
}

#[test]
fn a_per_action_scope_bounds_the_retries_of_a_fan_out() {
    let r = simulate(&builtin::scenario("fan-out").unwrap()).unwrap();
    let hop = r.policy("per-hop-budget").unwrap();
    let action = r.policy("per-action-budget").unwrap();
    assert!(action.retries_denied_by.get("scope").copied().unwrap_or(0) > 0);
    assert_eq!(hop.retries_denied_by.get("scope"), None);
    // At most one retry per action.
    assert!(action.retries_issued <= action.actions);
    assert!(action.retries_issued < hop.retries_issued);
}
