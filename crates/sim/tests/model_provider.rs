//! The `model-provider` scenario: a provider's requests per minute at twice the limit. Rate
//! admission keeps the provider's 429s near zero and its limit served; without it, most of
//! what reaches the provider is a 429.

use std::time::Duration;

use stormguard_sim::{Options, PolicyReport, RateLimitReport, Report, Scenario, builtin, simulate};

/// The built-in, shortened to 30 s so the test runs quickly in a debug build.
fn report() -> Report {
    let mut s = builtin::scenario("model-provider").unwrap();
    s.duration = Duration::from_secs(30);
    simulate(&s).unwrap()
}

fn at_provider(p: &PolicyReport) -> RateLimitReport {
    p.rate_limit.unwrap_or_else(|| panic!("{}: the dependency has a limit", p.name))
}

#[test]
fn rate_admission_draws_almost_no_429s_and_the_limit_is_still_served() {
    let r = report();
    let p = r.policy("ratio-budget+rate").unwrap();
    let at = at_provider(p);
    let reached = at.accepted + at.limited;
    assert!(at.limited as f64 <= 0.01 * reached as f64, "{at:?}");
    // 600 a minute, the bucket empty at the start: 300 in 30 s.
    assert!(at.accepted_per_min >= 0.9 * 600.0, "{at:?}");
    assert!(at.accepted_per_min <= 600.0 + 1.0, "never past the limit: {at:?}");
    // What does not fit is refused before the provider: first tries after their wait, retries
    // at once.
    assert!(p.primaries_denied_by.get("rate").copied().unwrap_or(0) > 100, "{p:?}");
    assert!(p.retries_denied_by.get("rate").copied().unwrap_or(0) > 0, "{p:?}");
    assert!(p.amplification < 0.6, "{}", p.amplification);
}

#[test]
fn without_rate_admission_most_answers_are_429s_and_retries_amplify() {
    let r = report();
    for name in ["retry-3-backoff", "ratio-budget"] {
        let p = r.policy(name).unwrap();
        let at = at_provider(p);
        assert!(at.limited_share > 0.5, "{name}: {at:?}");
        // The limit is served all the same: what differs is what the provider is sent.
        assert!(at.accepted_per_min >= 0.9 * 600.0, "{name}: {at:?}");
        assert!(p.amplification > 1.2, "{name}: {}", p.amplification);
    }
    let naive = r.policy("retry-3-backoff").unwrap();
    assert!(naive.amplification > 2.5, "{}", naive.amplification);
    // The budget honours the 429's retry-after: the hold refuses the other retries.
    let budget = r.policy("ratio-budget").unwrap();
    assert!(budget.retries_denied_by.get("pushback").copied().unwrap_or(0) > 100, "{budget:?}");
    let admitted = at_provider(r.policy("ratio-budget+rate").unwrap());
    assert!(at_provider(budget).limited > 100 * admitted.limited.max(1), "{admitted:?}");
}

#[test]
fn the_same_seed_gives_the_same_report() {
    let mut s = builtin::scenario("model-provider").unwrap();
    s.duration = Duration::from_secs(20);
    let a = simulate(&s).unwrap().to_json(true);
    let options = Options { jobs: 3, ..Options::default() };
    let b = stormguard_sim::simulate_with(&s, &options).unwrap().to_json(true);
    assert_eq!(a, b);
    assert!(a.contains("\"rate_limit\""), "the JSON has the provider's counts");
    s.seed += 1;
    assert_ne!(a, simulate(&s).unwrap().to_json(true), "the seed matters");
}

/// Before the first answer says the provider's limit, a policy with a configured limit meters
/// to it and one that only learns admits everything. Answers take 5 s here, so the run's 4 s
/// see none: the learner sends all 80 calls, the configured 60 a minute lets through its
/// bucket (60) and its refill, and refuses the rest `rate`.
#[test]
fn a_configured_limit_meters_before_the_first_answer() {
    let s = Scenario::parse(
        "t.toml",
        "duration = \"4s\"\n[fleet]\nrate = 20\narrivals = \"uniform\"\n[client]\n\
         deadline = \"30s\"\n[dependency]\ncapacity = 1000\nservice_time = \"fixed 5s\"\n\
         requests_per_minute = 600\n[[policy]]\nname = \"learns\"\nbudget = \"ratio\"\ncap = 100\n\
         learn_rate_limits = true\n[[policy]]\nname = \"configured\"\nbudget = \"ratio\"\n\
         cap = 100\nrequests_per_minute = 60\n",
    )
    .unwrap();
    let r = simulate(&s).unwrap();
    let learns = r.policy("learns").unwrap();
    let configured = r.policy("configured").unwrap();
    assert_eq!(at_provider(learns).accepted, 80);
    assert_eq!(learns.primaries_denied, 0);
    let sent = at_provider(configured).accepted;
    assert!((60..=66).contains(&sent), "{sent}");
    assert_eq!(configured.primaries_denied_by.get("rate").copied(), Some(80 - sent));
    assert_eq!(at_provider(configured).limited, 0);
}

/// The provider counts exactly: with no admission and no retries, it accepts its bucket and
/// its refill, and answers every other attempt 429.
#[test]
fn the_provider_counts_its_limit_exactly() {
    let s = Scenario::parse(
        "t.toml",
        "duration = \"10s\"\n[fleet]\nrate = 50\narrivals = \"uniform\"\n[dependency]\n\
         capacity = 1000\nservice_time = \"fixed 10ms\"\nrequests_per_minute = 1200\n\
         requests_remaining = 100\n[[policy]]\nretries = 0\n",
    )
    .unwrap();
    let r = simulate(&s).unwrap();
    let p = &r.policies[0];
    let at = at_provider(p);
    // 100 left, then 20 a second for 10 s; uniform arrivals every 20 ms.
    assert_eq!(at.accepted + at.limited, 500);
    assert!((299..=301).contains(&at.accepted), "{at:?}");
    assert_eq!(p.goodput, at.accepted as f64 / 500.0);
}
