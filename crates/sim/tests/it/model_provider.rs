//! The `model-provider` scenarios: a provider's requests per minute, or its tokens per minute,
//! at twice the limit. Rate admission keeps the provider's 429s near zero and its limit served;
//! without it, most of what reaches the provider is a 429. With tokens, the answer's usage
//! settles each booking, and what was booked but not used comes back.

use std::time::Duration;

use stormguard_sim::{Options, PolicyReport, RateLimitReport, Report, Scenario, builtin, simulate};

/// The built-in, shortened to 30 s so the test runs quickly in a debug build.
fn report() -> Report {
    let mut s = builtin::scenario("model-provider").unwrap();
    s.duration = Duration::from_secs(30);
    simulate(&s).unwrap()
}

/// The tokens built-in (1 800 000 tokens a minute, calls of 1 000 + up to 4 000 tokens), 30 s.
fn tokens_scenario() -> Scenario {
    let mut s = builtin::scenario("model-provider-tokens").unwrap();
    s.duration = Duration::from_secs(30);
    s
}

const TOKENS_PER_MINUTE: f64 = 1_800_000.0;

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

/// Tokens bind (the 5 000 requests a minute are never reached): with rate admission the provider
/// draws almost no 429s and counts at least 90 % of its token limit, never more.
#[test]
fn when_tokens_bind_rate_admission_draws_almost_no_429s_and_the_limit_is_still_served() {
    let r = simulate(&tokens_scenario()).unwrap();
    let p = r.policy("ratio-budget+rate").unwrap();
    let at = at_provider(p);
    assert_eq!(at.tokens_limit_per_min, Some(1_800_000));
    let tokens = at.tokens_per_min.expect("the provider limits tokens");
    let reached = at.accepted + at.limited;
    assert!(at.limited as f64 <= 0.01 * reached as f64, "{at:?}");
    assert!(tokens >= 0.9 * TOKENS_PER_MINUTE, "{at:?}");
    assert!(tokens <= TOKENS_PER_MINUTE, "never past the limit: {at:?}");
    assert!(at.accepted_per_min < 0.2 * 5_000.0, "the requests limit is not what binds: {at:?}");
    assert!(p.primaries_denied_by.get("rate").copied().unwrap_or(0) > 100, "{p:?}");
}

#[test]
fn when_tokens_bind_without_rate_admission_most_answers_are_429s() {
    let r = simulate(&tokens_scenario()).unwrap();
    for name in ["retry-3-backoff", "ratio-budget"] {
        let p = r.policy(name).unwrap();
        let at = at_provider(p);
        assert!(at.limited_share > 0.5, "{name}: {at:?}");
        let tokens = at.tokens_per_min.unwrap();
        assert!(tokens >= 0.9 * TOKENS_PER_MINUTE, "{name}: {at:?}");
        assert!(tokens <= TOKENS_PER_MINUTE, "{name}: {at:?}");
    }
    let admitted = at_provider(r.policy("ratio-budget+rate").unwrap());
    let budget = at_provider(r.policy("ratio-budget").unwrap());
    assert!(budget.limited > 50 * admitted.limited.max(1), "{budget:?} against {admitted:?}");
}

/// Each call books 5 000 tokens. When the model writes half of `max_tokens`, the answer's usage
/// (3 000) settles the booking and 2 000 come back: the same token limit serves 5/3 as many
/// calls as when it writes all of it. A client that kept its estimates would serve the same
/// number either way.
#[test]
fn settling_at_the_usage_gives_back_what_was_not_written() {
    let served = |output_fraction: f64| {
        let mut s = tokens_scenario();
        s.dependency.output_fraction = output_fraction;
        s.policies.retain(|p| p.name == "ratio-budget+rate");
        let r = simulate(&s).unwrap();
        let at = at_provider(&r.policies[0]);
        let reached = at.accepted + at.limited;
        assert!(at.limited as f64 <= 0.01 * reached as f64, "{output_fraction}: {at:?}");
        assert!(at.tokens_per_min.unwrap() >= 0.9 * TOKENS_PER_MINUTE, "{output_fraction}: {at:?}");
        at.accepted_per_min
    };
    let (half, whole) = (served(0.5), served(1.0));
    // 1 800 000 a minute: 600 calls of 3 000, or 360 of 5 000.
    assert!(half >= 0.9 * 600.0 && whole <= 360.0 + 1.0, "{half} and {whole}");
    assert!(half > 1.4 * whole, "{half} and {whole}");
}

/// A first try books its tokens before it asks for its slot. Refused the slot (a cap of 5 with
/// no queue, 20 calls a second of 1 s each), it was never sent, and its booking comes back:
/// the 60 000 tokens a minute the client meters never run out, and nothing is refused `rate`.
/// Kept, the 150 refused calls would drain 150 000 tokens in 10 s.
#[test]
fn a_first_try_refused_its_slot_gives_its_booking_back() {
    let s = Scenario::parse(
        "t.toml",
        "duration = \"10s\"\n[fleet]\nrate = 20\narrivals = \"uniform\"\ninput_tokens = 200\n\
         max_tokens = 800\n[dependency]\ncapacity = 1000\nservice_time = \"fixed 1s\"\n\
         tokens_per_minute = 60000\n[[policy]]\ncap = 5\nqueue = 0\ntokens_per_minute = 60000\n",
    )
    .unwrap();
    let r = simulate(&s).unwrap();
    let p = &r.policies[0];
    assert_eq!(p.primaries_denied_by.get("rate"), None, "{p:?}");
    assert!(p.primaries_denied_by.get("queue").copied().unwrap_or(0) >= 140, "{p:?}");
    assert_eq!(at_provider(p).accepted, 50);
    assert_eq!(at_provider(p).limited, 0);
}

/// A token key with a bad value is refused like every key: file, line, column, key path.
#[test]
fn a_bad_token_key_names_the_file_line_column_and_key() {
    let parse = |fleet: &str, dep: &str, policy: &str| {
        Scenario::parse(
            "tokens.toml",
            &format!(
                "[fleet]\nrate = 5\n{fleet}\n[dependency]\ncapacity = 10\nservice_time = \"1s\"\n\
                 {dep}\n[[policy]]\nbudget = \"ratio\"\n{policy}\n"
            ),
        )
        .unwrap_err()
        .to_string()
    };
    let calls = "input_tokens = 1000\nmax_tokens = 4000";
    assert_eq!(
        parse(calls, "tokens_per_minute = 450000\noutput_fraction = 1.25", ""),
        "tokens.toml:9:19: dependency.output_fraction: must be above 0 and at most 1, got 1.25"
    );
    assert_eq!(
        parse(calls, "", "tokens_per_minute = 0"),
        "tokens.toml:11:21: policy[0].tokens_per_minute: must be between 1 and 1000000000000, got 0"
    );
    assert_eq!(
        parse("", "tokens_per_minute = 450000", ""),
        "tokens.toml:7:21: dependency.tokens_per_minute: the calls cost no tokens: give [fleet] \
         input_tokens or max_tokens"
    );
    assert_eq!(
        parse("max_tokens = \"4k\"", "", ""),
        "tokens.toml:3:14: fleet.max_tokens: invalid type: string \"4k\", expected u64"
    );
}
