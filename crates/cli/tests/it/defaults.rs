//! Every default in one place: the simulator, the proxy (from a file and from its flags), `plan`
//! and `audit` all read `stormguard_core::defaults`, so what `simulate` models with nothing set
//! is what the proxy does with nothing set. Each side is built from an empty config, as a user
//! would write it, and compared field by field.

use clap::Parser;
use stormguard::Cli;
use stormguard::cmd::proxy::config_from_args;
use stormguard_audit::{AuditOptions, Budget, Rule, audit_sources};
use stormguard_core::budget::BudgetSpec;
use stormguard_core::conditions::RetryOn;
use stormguard_core::defaults;
use stormguard_proxy::config::{ProxyConfig, ToTower};
use stormguard_sim::Scenario;

/// A proxy config that names an upstream and nothing else.
const EMPTY_CONFIG: &str = r#"
[[listener]]
listen = "127.0.0.1:8080"
dependency = "d"

[[dependency]]
name = "d"
upstreams = ["http://127.0.0.1:9000"]
"#;

/// A scenario with only what the model requires (a load and a dependency) and one stormguard
/// policy that names the budget's kind and nothing else.
const EMPTY_SCENARIO: &str = r#"
[fleet]
rate = 10
[dependency]
capacity = 10
service_time = "10ms"
[[policy]]
budget = "ratio"
"#;

#[test]
fn the_simulators_defaults_are_the_proxys() {
    let proxy = ProxyConfig::parse(EMPTY_CONFIG, "empty.toml").unwrap();
    let dep = &proxy.dependencies[0];
    let tower = dep.to_tower();
    let sim = Scenario::parse("empty.toml", EMPTY_SCENARIO).unwrap();
    let policy = &sim.policies[0];

    // retry_on, max_retries, backoff, pushback, min attempt time, stacked, enforce: the whole
    // RetryConfig the simulator hands to core's RetryPolicy is the proxy's.
    assert_eq!(policy.retry_config(&sim.client).as_ref(), Some(&tower.retry));
    // The cap, its queue and queue timeout.
    assert_eq!(policy.cap.unwrap().limiter_config(), tower.limiter);
    // The budget.
    let stormguard_sim::scenario::RetryRule::Budget { spec, .. } = &policy.retry else {
        panic!("a budget policy: {:?}", policy.retry)
    };
    assert_eq!(spec, &dep.budget);
    // No per-try timeout on either side, and the same hold for a timed-out attempt.
    assert_eq!((sim.client.per_try_timeout, tower.per_try_timeout), (None, None));
    assert_eq!(sim.client.timeout_slot_hold, tower.timeout_slot_hold);
    assert_eq!(tower.timeout_slot_hold, defaults::TIMEOUT_SLOT_HOLD);
    assert_eq!(tower.abandon_hold, defaults::ABANDON_HOLD);

    // And they are core's defaults, with timeouts retried.
    assert_eq!(tower.retry.retry_on, RetryOn::default());
    assert_eq!(tower.retry.retry_on.to_string(), defaults::RETRY_ON);
    assert_eq!(
        (tower.limiter.cap, tower.limiter.queue_len, tower.limiter.queue_timeout),
        (defaults::CAP, defaults::QUEUE_LEN, defaults::QUEUE_TIMEOUT)
    );
    assert_eq!(tower.retry.max_retries, defaults::MAX_RETRIES);
    assert_eq!(dep.budget, BudgetSpec::default());
    assert_eq!((tower.body_limit, tower.limit_ttl), (defaults::BODY_LIMIT, defaults::LIMIT_TTL));
    assert_eq!(dep.scope_retries, defaults::SCOPE_RETRIES);
    assert_eq!(proxy.scope_max, defaults::SCOPE_MAX);
}

#[test]
fn the_proxys_flags_default_to_its_config_file() {
    let file = ProxyConfig::parse(EMPTY_CONFIG, "empty.toml").unwrap();
    let cli = Cli::try_parse_from(["stormguard", "proxy", "--upstream", "http://127.0.0.1:9000"])
        .unwrap();
    let stormguard::Command::Proxy(args) = cli.command else { panic!("proxy") };
    let flags = config_from_args(&args).unwrap();
    let (mut from_flags, from_file) = (flags.dependencies[0].clone(), &file.dependencies[0]);
    from_flags.name = from_file.name.clone();
    // A file lists each upstream's own cap (none here), the flags none at all: the same caps.
    assert_eq!(from_flags.upstream_cap(0), from_file.upstream_cap(0));
    assert_eq!(from_file.upstream_caps, [None]);
    from_flags.upstream_caps = vec![None];
    // The same for each upstream's own adaptive cap.
    assert_eq!(from_flags.upstream_adaptive(0), from_file.upstream_adaptive(0));
    assert_eq!(from_file.upstream_adaptive, [None]);
    from_flags.upstream_adaptive = vec![None];
    assert_eq!(&from_flags, from_file);
}

#[test]
fn plan_and_audit_read_the_same_defaults() {
    // plan's floor is the concurrency budget's default floor.
    let cli =
        Cli::try_parse_from(["stormguard", "plan", "--cap", "20", "--primary", "16"]).unwrap();
    let stormguard::Command::Plan(args) = cli.command else { panic!("plan") };
    let BudgetSpec::Concurrency(c) = BudgetSpec::parse("concurrency").unwrap() else { panic!() };
    assert_eq!(args.floor, c.min);

    // audit reads a dependency with nothing set as the proxy runs it.
    let tower = ProxyConfig::parse(EMPTY_CONFIG, "empty.toml").unwrap().dependencies[0].to_tower();
    let report = audit_sources(
        &[("empty.toml".into(), EMPTY_CONFIG.into())],
        None,
        &AuditOptions::default(),
    )
    .unwrap();
    let layer = &report.layers[0];
    assert_eq!(layer.attempts, Some(tower.retry.max_retries + 1));
    let retry_on: Vec<String> =
        tower.retry.retry_on.to_string().split(',').map(str::to_string).collect();
    assert_eq!(layer.retry_on, retry_on);
    let BudgetSpec::Ratio(r) = tower.budget else { panic!("ratio") };
    assert_eq!(layer.budget, Some(Budget::Ratio { percent: r.percent.as_f64() }));
    // ... and the proxy's cap: a floor of 21 concurrent retries is above a cap of 20 with
    // nothing planned, a floor of 20 is not.
    let floor = |min: u64| {
        let text = format!("{EMPTY_CONFIG}budget = \"concurrency:percent=0.2,min={min}\"\n");
        audit_sources(&[("f.toml".into(), text)], None, &AuditOptions::default())
            .unwrap()
            .findings
            .iter()
            .any(|f| f.rule == Rule::FloorAboveHeadroom)
    };
    assert_eq!((floor(defaults::CAP), floor(defaults::CAP + 1)), (false, true));
}

/// `--provider` on the flags is the file's `provider`: the same preset `retry_on` and rate
/// admission; `--retry-on` still wins over the preset.
#[test]
fn the_provider_flag_is_the_files_provider_key() {
    let parse = |args: &[&str]| {
        let mut all = vec!["stormguard", "proxy", "--upstream", "http://127.0.0.1:9000"];
        all.extend_from_slice(args);
        let cli = Cli::try_parse_from(all).unwrap();
        let stormguard::Command::Proxy(args) = cli.command else { panic!("proxy") };
        config_from_args(&args).unwrap().dependencies[0].clone()
    };
    let file =
        ProxyConfig::parse(&format!("{EMPTY_CONFIG}provider = \"openai\"\n"), "p.toml").unwrap();
    let (flags, file) = (parse(&["--provider", "openai"]), &file.dependencies[0]);
    assert_eq!((&flags.retry_on, flags.rate), (&file.retry_on, file.rate));
    assert_eq!(parse(&["--provider", "openai", "--retry-on", "5xx"]).retry_on.to_string(), "5xx");
    let bad = Cli::try_parse_from([
        "stormguard",
        "proxy",
        "--upstream",
        "http://127.0.0.1:9000",
        "--provider",
        "azure",
    ]);
    assert!(bad.unwrap_err().to_string().contains("`azure` is not a provider"));
}

/// `--hedge-after` and `--max-hedges` are the file's `hedge_after` and `max_hedges`; a bad
/// value is refused naming the flag, and `max_hedges` without `hedge_after` is refused in a file.
#[test]
fn the_hedge_flags_are_the_files_hedge_keys() {
    let cli = Cli::try_parse_from([
        "stormguard",
        "proxy",
        "--upstream",
        "http://127.0.0.1:9000",
        "--hedge-after",
        "p95",
        "--max-hedges",
        "2",
    ])
    .unwrap();
    let stormguard::Command::Proxy(args) = cli.command else { panic!("proxy") };
    let flags = config_from_args(&args).unwrap().dependencies[0].clone();
    let file = ProxyConfig::parse(
        &format!("{EMPTY_CONFIG}hedge_after = \"p95\"\nmax_hedges = 2\n"),
        "h.toml",
    )
    .unwrap();
    assert_eq!(flags.hedge, file.dependencies[0].hedge);
    assert!(flags.hedge.is_some());
    let bad = Cli::try_parse_from([
        "stormguard",
        "proxy",
        "--upstream",
        "http://127.0.0.1:9000",
        "--hedge-after",
        "soon",
    ]);
    assert!(bad.unwrap_err().to_string().contains("--hedge-after"));
    let e = ProxyConfig::parse(&format!("{EMPTY_CONFIG}max_hedges = 2\n"), "h.toml").unwrap_err();
    assert!(
        e.to_string().contains("dependency[0].max_hedges: max_hedges needs hedge_after"),
        "{e}"
    );
}
