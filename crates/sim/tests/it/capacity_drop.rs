//! An adaptive cap in the model (the `capacity-drop` built-in): the dependency loses half its
//! servers for 30 s and gets them back. Core's adaptive cap follows the capacity down within
//! seconds and back up after it recovers, doing at least as well as the best fixed cap chosen in
//! hindsight; a fixed cap of 40 overloads the halved dependency. A flat dependency keeps its
//! planned cap whatever the noise in its latency; timeouts and overload answers are drops, as
//! the tower layer marks them; and every adaptive key reads, or is refused where it is written.

use std::time::Duration;

use stormguard_core::adaptive::{AdaptiveConfig, Algorithm};
use stormguard_sim::scenario::InvalidScenario;
use stormguard_sim::{PolicyReport, Report, Scenario, builtin, simulate};

fn report() -> Report {
    simulate(&builtin::scenario("capacity-drop").unwrap()).unwrap()
}

/// The p99 of the actions that started in `phase` and succeeded, in ms.
fn p99_ok(p: &PolicyReport, phase: usize) -> f64 {
    p.phases[phase].latency_ok_ms.expect("some actions succeeded").p99
}

fn working_cap(p: &PolicyReport, phase: usize) -> f64 {
    p.phases[phase].working_cap_mean.expect("an adaptive policy")
}

/// The per-second mean working cap over `[from_s, to_s)`.
fn caps_between(p: &PolicyReport, from_s: f64, to_s: f64) -> Vec<f64> {
    let s = &p.series;
    s.t_s
        .iter()
        .zip(&s.working_cap)
        .filter(|(t, _)| **t >= from_s && **t < to_s)
        .map(|(_, c)| *c)
        .collect()
}

#[test]
fn the_adaptive_cap_follows_the_capacity_down_and_back_up() {
    let r = report();
    let names: Vec<_> = r.phases.iter().map(|p| p.name.as_str()).collect();
    assert_eq!(names, ["20 servers", "10 servers", "20 servers again"]);
    let a = r.policy("adaptive").unwrap();
    let w = a.working_cap.unwrap();
    assert_eq!((w.initial, a.in_flight.cap), (20, Some(40)));
    // What the dependency sees follows what it can take: about w + 4 in flight (the halved
    // phase's mean includes the seconds the cap takes to come down).
    let in_flight: Vec<f64> = a.phases.iter().map(|p| p.in_flight_mean).collect();
    assert!(in_flight[1] < 0.8 * in_flight[0], "{in_flight:?}");
    assert!(in_flight[1] < 20.0 && in_flight[0] > 20.0, "{in_flight:?}");
    // The working cap falls within 10 s of the drop (at 30 s) ...
    let first = working_cap(a, 0);
    let after_drop = caps_between(a, 30.0, 40.0);
    let fell = after_drop.iter().position(|c| *c < 0.75 * first);
    assert!(fell.is_some(), "phase 1 mean {first}, then {after_drop:?}");
    assert!(working_cap(a, 1) < 0.75 * first, "{} vs {first}", working_cap(a, 1));
    // ... and rises again after the servers come back (at 60 s).
    let last = caps_between(a, 80.0, 90.0);
    let end = last.iter().sum::<f64>() / last.len() as f64;
    assert!(end >= 20.0 && end > working_cap(a, 1) + 5.0, "{end} after {}", working_cap(a, 1));
    assert!(w.min < 16 && w.max > 20, "{w:?}");
}

#[test]
fn the_adaptive_cap_does_as_well_as_the_best_fixed_cap_chosen_in_hindsight() {
    let r = report();
    let goodput = |name: &str| r.policy(name).unwrap().goodput;
    let best = ["cap-10", "cap-20", "cap-40"].into_iter().map(goodput).fold(0.0, f64::max);
    let adaptive = goodput("adaptive");
    assert!(adaptive >= best - 0.05, "adaptive {adaptive} vs the best fixed cap {best}");
    // The fixed caps each fail somewhere: 10 wastes half the servers when there are 20.
    let (ten, a) = (r.policy("cap-10").unwrap(), r.policy("adaptive").unwrap());
    assert!(a.phases[0].goodput > ten.phases[0].goodput + 0.2, "{:?}", a.phases[0]);
}

#[test]
fn a_fixed_cap_of_40_overloads_the_halved_dependency() {
    let r = report();
    let (forty, a) = (r.policy("cap-40").unwrap(), r.policy("adaptive").unwrap());
    // Far above its 10 servers: the queue makes every attempt slow, the slow ones time out and
    // hold their slots, and almost nothing succeeds.
    assert!(forty.phases[1].in_flight_mean > 3.0 * 10.0, "{:?}", forty.phases[1]);
    assert!(forty.phases[1].goodput < 0.05, "{:?}", forty.phases[1]);
    assert!(a.phases[1].goodput > 0.25, "{:?}", a.phases[1]);
    assert!(p99_ok(forty, 1) > 2.0 * p99_ok(a, 1), "{} vs {}", p99_ok(forty, 1), p99_ok(a, 1));
    assert!(forty.timeouts > 10 * a.timeouts.max(1), "{} vs {}", forty.timeouts, a.timeouts);
}

/// A dependency that never slows (200 servers for load that keeps about 15 in flight) with
/// log-normal noise in its latency, for 1 000 s of virtual time.
fn flat(algorithm: &str) -> PolicyReport {
    let text = format!(
        "duration = \"1000s\"\nseed = 3\n[fleet]\nrate = 133\n[client]\nper_try_timeout = \"1s\"\n\
         deadline = \"3s\"\n[dependency]\ncapacity = 200\n\
         service_time = \"lognormal median=100ms sigma=0.5\"\n[[policy]]\nbudget = \"ratio\"\n\
         cap = 20\nqueue = 0\nadaptive = {{ min = 4, max = 40, algorithm = \"{algorithm}\" }}\n"
    );
    let s = Scenario::parse("flat.toml", &text).unwrap();
    simulate(&s).unwrap().policies.remove(0)
}

#[test]
fn a_flat_dependency_never_has_its_cap_lowered_below_the_plan_by_noise() {
    for algorithm in ["gradient2", "aimd"] {
        let p = flat(algorithm);
        let w = p.working_cap.unwrap();
        assert_eq!(w.initial, 20);
        assert!(w.min >= 20, "{algorithm}: {w:?}");
        // It is not stuck either: a dependency that never slows earns the ceiling.
        assert_eq!(w.max, 40, "{algorithm}: {w:?}");
        assert!(p.goodput > 0.99, "{algorithm}: {}", p.goodput);
    }
}

/// A short run whose phase from 10 s to 20 s has `phase` keys, under an AIMD cap (which moves
/// only on drops): its least working cap.
fn aimd_min(dependency: &str, phase: &str) -> u64 {
    let text = format!(
        "duration = \"30s\"\n[fleet]\nrate = 100\n[client]\nper_try_timeout = \"200ms\"\n\
         retry_on = \"5xx,429,timeout\"\n[dependency]\ncapacity = 100\nservice_time = \"50ms\"\n\
         {dependency}\n[[phase]]\nstart = \"10s\"\nend = \"20s\"\n{phase}\n[[policy]]\n\
         budget = \"ratio\"\ncap = 20\nadaptive = {{ min = 4, max = 40, algorithm = \"aimd\" }}\n"
    );
    let s = Scenario::parse("drops.toml", &text).unwrap();
    simulate(&s).unwrap().policies[0].working_cap.unwrap().min
}

#[test]
fn timeouts_and_overload_answers_are_drops() {
    // Nothing dropped: AIMD never lowers the cap.
    assert_eq!(aimd_min("", ""), 20);
    assert_eq!(aimd_min("", "service_time = \"150ms\""), 20);
    // Attempts that pass the per-try timeout (their held slots sampled as drops), 503s (the
    // model's errors, and a full queue's refusals), a provider's 429s: each lowers it.
    for (dependency, phase) in [
        ("", "service_time = \"500ms\""),
        ("", "error_rate = 0.5"),
        ("queue = 0", "capacity = 3"),
        ("requests_per_minute = 3000\nrequests_remaining = 0", ""),
    ] {
        let min = aimd_min(dependency, phase);
        assert!(min <= 12, "{dependency} / {phase}: {min}");
    }
}

#[test]
fn same_seed_same_report() {
    let s = builtin::scenario("capacity-drop").unwrap();
    let a = simulate(&s).unwrap().to_json(true);
    assert!(a.contains("\"working_cap\""), "the series has the working cap");
    assert_eq!(a, simulate(&s).unwrap().to_json(true));
}

#[test]
fn every_adaptive_key_changes_the_model_and_a_bad_value_is_located() {
    let base = "duration = \"40s\"\n[fleet]\nrate = 290\n[client]\nper_try_timeout = \"300ms\"\n\
                [dependency]\ncapacity = 10\nservice_time = \"lognormal median=100ms sigma=0.3\"\n\
                [[policy]]\nbudget = \"ratio\"\ncap = 20\nqueue = 0\n";
    let parse = |keys: &str| Scenario::parse("a.toml", &format!("{base}{keys}"));
    let run = |keys: &str| simulate(&parse(keys).unwrap()).unwrap().policies.remove(0);
    let s = parse("adaptive = { min = 4, max = 40 }\n").unwrap();
    let p = &s.policies[0];
    assert_eq!(p.name, "ratio-budget+adaptive4-40");
    assert_eq!(p.cap.unwrap().adaptive, Some(AdaptiveConfig::new(4, 40)));
    assert!(
        p.describe().contains("adaptive cap 4..40 (gradient2), starting at 20"),
        "{}",
        p.describe()
    );
    let full = parse(
        "[policy.adaptive]\nmin = 2\nmax = 30\nalgorithm = \"aimd\"\nwindow = \"2s\"\ntolerance = 150\n",
    )
    .unwrap();
    let want = AdaptiveConfig {
        min: 2,
        max: 30,
        algorithm: Algorithm::Aimd,
        window: Duration::from_secs(2),
        tolerance: 150,
    };
    assert_eq!(full.policies[0].cap.unwrap().adaptive, Some(want));
    // The planned cap is where it starts, clamped into the range.
    assert_eq!(run("adaptive = { min = 4, max = 40 }\n").working_cap.unwrap().initial, 20);
    assert_eq!(run("adaptive = { min = 4, max = 8 }\n").working_cap.unwrap().initial, 8);
    assert_eq!(run("adaptive = { min = 25, max = 40 }\n").working_cap.unwrap().initial, 25);
    // Each key moves the model.
    // (Overloaded from the start, Gradient2 learns an already slow baseline at the planned cap
    // and holds near it: its limitation, docs/rules.md. The per-try timeouts still count.)
    let gradient = run("adaptive = { min = 4, max = 40 }\n").working_cap.unwrap();
    for keys in [
        "adaptive = { min = 4, max = 40, algorithm = \"aimd\" }\n",
        "adaptive = { min = 4, max = 40, window = \"5s\" }\n",
        "adaptive = { min = 4, max = 40, tolerance = 200 }\n",
        "adaptive = { min = 22, max = 40 }\n",
        "adaptive = { min = 4, max = 12 }\n",
    ] {
        let w = run(keys).working_cap.unwrap();
        assert_ne!(w, gradient, "{keys}");
    }
    assert!(run("adaptive = { min = 15, max = 40 }\n").working_cap.unwrap().min >= 15);
    assert!(run("adaptive = { min = 4, max = 12 }\n").working_cap.unwrap().max <= 12);
    // A fixed cap has none.
    assert!(run("").working_cap.is_none());

    let err = |keys: &str| parse(keys).unwrap_err();
    let e = err("adaptive = { min = 0, max = 40 }\n");
    assert_eq!(
        e.to_string(),
        "a.toml:13:20: policy[0].adaptive.min: must be between 1 and 16777216, got 0"
    );
    assert_eq!(
        e.rule::<InvalidScenario>(),
        Some(&InvalidScenario::OutOfRange { min: 1, max: 1 << 24, got: 0 })
    );
    let e = err("adaptive = { min = 50, max = 40 }\n");
    assert!(e.to_string().starts_with("a.toml:13:20: policy[0].adaptive.min: "), "{e}");
    assert!(matches!(e.rule::<InvalidScenario>(), Some(InvalidScenario::Core(_))), "{e}");
    let e = err("adaptive = { min = 4, max = 20000000 }\n");
    assert!(
        e.to_string().starts_with("a.toml:13:29: policy[0].adaptive.max: must be between"),
        "{e}"
    );
    let e = err("adaptive = { min = 4, max = 40, algorithm = \"cubic\" }\n");
    assert!(e.to_string().starts_with("a.toml:13:45: policy[0].adaptive.algorithm: "), "{e}");
    assert!(e.to_string().contains("\"gradient2\" or \"aimd\""), "{e}");
    let e = err("adaptive = { min = 4, max = 40, window = \"0s\" }\n");
    assert!(e.to_string().starts_with("a.toml:13:42: policy[0].adaptive.window: "), "{e}");
    let e = err("adaptive = { min = 4, max = 40, tolerance = 50 }\n");
    assert_eq!(
        e.to_string(),
        "a.toml:13:45: policy[0].adaptive.tolerance: must be between 100 and 400, got 50"
    );
    let e = err("adaptive = { min = 4, max = 40, floor = 2 }\n");
    assert!(
        e.to_string().starts_with("a.toml:13:33: policy[0].adaptive.floor: unknown field `floor`"),
        "{e}"
    );
    let e = err("adaptive = { min = \"4\", max = 40 }\n");
    assert!(e.to_string().starts_with("a.toml:13:20: policy[0].adaptive.min: invalid type"), "{e}");
    let e = err("adaptive = { min = 4 }\n");
    assert_eq!(
        e.to_string(),
        "a.toml:13:12: policy[0].adaptive.max: missing: the ceiling of the working cap (e.g. max = 40)"
    );
    // A naive policy needs a cap for it.
    let naive = base.replace("budget = \"ratio\"\ncap = 20\nqueue = 0\n", "retries = 1\n");
    let e = Scenario::parse("a.toml", &format!("{naive}adaptive = {{ min = 4, max = 40 }}\n"))
        .unwrap_err();
    assert!(e.to_string().starts_with("a.toml:11:12: policy[0].adaptive: needs a cap"), "{e}");
    assert_eq!(e.rule::<InvalidScenario>(), Some(&InvalidScenario::NeedsCap));
}
