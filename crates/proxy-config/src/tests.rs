//! The config file read end to end: values, defaults, and each kind of mistake at its line,
//! column and key path.

use std::time::Duration;

use stormguard_core::budget::BudgetSpec;

use super::model::redact;
use stormguard_config::Problem;

use super::*;

fn err(text: &str) -> String {
    ProxyConfig::parse(text, "f.toml").unwrap_err().to_string()
}

const BASE: &str = "[[listener]]\nlisten = \"127.0.0.1:8080\"\ndependency = \"d\"\n\n[[dependency]]\nname = \"d\"\nupstreams = [\"http://127.0.0.1:9000\"]\n";

#[test]
fn full_config() {
    let text = format!(
        "{BASE}cap = 8\nqueue = 0\nqueue_timeout = \"250ms\"\nbudget = {{ kind = \"ratio\", percent = 0.25, min_per_sec = 3 }}\n\
             retry_on = \"5xx,reset\"\nmax_retries = 3\nper_try_timeout = \"300ms\"\ndeadline = \"2s\"\nbackoff = \"10ms..100ms\"\n\
             enforce = false\nscope_retries = 2\n\n[dependency.breaker]\nfailure_ratio = 0.6\nbreak_duration = \"2s\"\n\n\
             [[route]]\nhost = \"API.example\"\npath_prefix = \"/pay\"\ndependency = \"d\"\nbudget = \"ratio:percent=0.1,min_per_sec=1\"\nidempotent = true\n"
    );
    let c = ProxyConfig::parse(&text, "f.toml").unwrap();
    let d = &c.dependencies[0];
    assert_eq!((d.cap, d.queue, d.max_retries, d.enforce, d.scope_retries), (8, 0, 3, false, 2));
    assert_eq!(d.per_try_timeout, Some(Duration::from_millis(300)));
    assert_eq!(d.budget, BudgetSpec::parse("ratio:percent=0.25,min_per_sec=3").unwrap());
    assert_eq!(d.breaker.unwrap().break_duration, Duration::from_secs(2));
    assert_eq!(c.routes[0].host.as_deref(), Some("api.example"));
    assert!(c.routes[0].idempotent);
    assert_eq!(c.admin, Some(DEFAULT_ADMIN.parse().unwrap()));
}

#[test]
fn a_value_past_toml_names_its_key() {
    // Not a shape error but a syntax one (no TOML integer holds it): the key is still named.
    let e = err(&format!("{BASE}cap = 99999999999999999999999999\n"));
    assert!(e.starts_with("f.toml:8:7: dependency[0].cap: "), "{e}");
    let e = err(&format!("{BASE}\n[dependency.breaker]  # the breaker\nwindow = 1e999999\n"));
    assert!(e.starts_with("f.toml:10:10: dependency[0].breaker.window: "), "{e}");
    // A line that is no `key = value` names no key.
    let e = err(&format!("{BASE}[[nope\n"));
    assert!(e.starts_with("f.toml:8:"), "{e}");
    assert!(!e.contains("nope:"), "{e}");
}

#[test]
fn errors_name_file_line_column_and_key() {
    assert_eq!(
        err(&format!("{BASE}cap = \"x\"\n")),
        "f.toml:8:7: dependency[0].cap: invalid type: string \"x\", expected u64"
    );
    assert!(
        err(&format!("{BASE}caps = 3\n"))
            .starts_with("f.toml:8:1: dependency[0].caps: unknown field `caps`")
    );
    assert_eq!(
        err(&format!("{BASE}per_try_timeout = \"3 parsecs\"\n"))
            .split(": ")
            .take(2)
            .collect::<Vec<_>>(),
        ["f.toml:8:19", "dependency[0].per_try_timeout"]
    );
    assert!(
        err(&format!("{BASE}budget = \"ratio:percent=x\"\n"))
            .starts_with("f.toml:8:10: dependency[0].budget: ")
    );
    assert!(
        err(&format!("{BASE}\n[dependency.breaker]\nwindow = \"0s\"\n"))
            .starts_with("f.toml:10:10: dependency[0].breaker.window: window must be between"),
        "{}",
        err(&format!("{BASE}\n[dependency.breaker]\nwindow = \"0s\"\n"))
    );
    assert_eq!(
        err(
            "[[listener]]\nlisten = \"127.0.0.1:8080\"\ndependency = \"nope\"\n\n[[dependency]]\nname = \"d\"\nupstreams = [\"http://127.0.0.1:9000\"]\n"
        ),
        "f.toml:3:14: listener[0].dependency: no dependency is named \"nope\""
    );
    assert!(
        err(&BASE.replace("http://127.0.0.1:9000", "ftp://x"))
            == "f.toml:7:14: dependency[0].upstreams[0]: ftp://x/: an upstream is http://host:port or https://host:port"
    );
    assert!(err("cap = [").starts_with("f.toml:1:"));
}

#[test]
fn a_bad_cap_and_a_bad_queue_are_named_by_their_own_keys() {
    let invalid = |text: &str| match ProxyConfig::parse(text, "f.toml").unwrap_err() {
        ConfigError::Invalid { line, column, key, problem, .. } => {
            // The limiter's own typed error, not a message.
            let Problem::Rule(e) = &problem else { panic!("{problem}") };
            let Some(RuleError::Core(core)) = e.downcast_ref::<RuleError>() else { panic!("{e}") };
            assert!(matches!(
                core,
                stormguard_core::ConfigError::OutOfRange { .. }
                    | stormguard_core::ConfigError::TooLarge { .. }
            ));
            (line, column, key.to_string(), problem.to_string())
        }
        other => panic!("{other}"),
    };
    assert_eq!(
        invalid(&format!(
            "{BASE}cap = 0
"
        )),
        (8, 7, "dependency[0].cap".into(), "cap must be between 1 and 16777216, got 0".into())
    );
    assert_eq!(
        invalid(&format!(
            "{BASE}queue = 99999999
"
        )),
        (
            8,
            9,
            "dependency[0].queue".into(),
            "queue length must be at most 16777216, got 99999999".into()
        )
    );
}

#[test]
fn fleet_placement() {
    let text = format!(
        "{BASE}cap = 20\nplacement = \"fleet\"\nredis = \"env:REDIS_FOR_PAYMENTS\"\nmax_instances = 50\n\
             lease_ttl = \"3s\"\ninterval = \"250ms\"\nfallback_min = 1\nfleet_cap = 100\n"
    );
    let c = ProxyConfig::parse(&text, "f.toml").unwrap();
    let f = c.dependencies[0].fleet.as_ref().unwrap();
    assert_eq!(f.redis, RedisSource::Env("REDIS_FOR_PAYMENTS".into()));
    assert_eq!((f.max_instances, f.fleet_cap, f.fallback_min), (50, Some(100), Some(1)));
    assert_eq!((f.lease_ttl, f.interval), (Duration::from_secs(3), Duration::from_millis(250)));
    let json = c.to_json().to_string();
    assert!(json.contains("\"redis\":\"env:REDIS_FOR_PAYMENTS\""), "{json}");
    assert!(json.contains("\"placement\":\"fleet\""), "{json}");
    // Defaults: the URL from $STORMGUARD_REDIS_URL, the fleet cap from cap.
    let c =
        ProxyConfig::parse(&format!("{BASE}placement = \"fleet\"\nmax_instances = 3\n"), "f.toml")
            .unwrap();
    let f = c.dependencies[0].fleet.as_ref().unwrap();
    assert_eq!(f.redis, RedisSource::Env("STORMGUARD_REDIS_URL".into()));
    assert_eq!(f.fleet_cap, None);
    assert!(ProxyConfig::parse(BASE, "f.toml").unwrap().dependencies[0].fleet.is_none());
}

#[test]
fn fleet_errors_name_the_key() {
    assert_eq!(
        err(&format!(
            "{BASE}placement = \"fleet\"\nredis = \"redis://:hunter2@h:6379\"\nmax_instances = 3\n"
        )),
        "f.toml:9:9: dependency[0].redis: the Redis URL and its password come from an environment variable: redis = \"env:STORMGUARD_REDIS_URL\""
    );
    assert_eq!(
        err(&format!("{BASE}placement = \"fleet\"\n")),
        "f.toml:8:13: dependency[0].placement: placement = \"fleet\" needs max_instances (the most instances at the fleet's peak), at least 1"
    );
    assert_eq!(
        err(&format!("{BASE}max_instances = 3\n")),
        "f.toml:8:17: dependency[0].max_instances: max_instances is a fleet key: set placement = \"fleet\" to use it"
    );
    assert!(err(&format!("{BASE}placement = \"global\"\n")).starts_with(
            "f.toml:8:13: dependency[0].placement: unknown variant `global`, expected `local` or `fleet`"
        ));
    assert!(
            err(&format!("{BASE}placement = \"fleet\"\nmax_instances = 3\ninterval = \"1s\"\n"))
                .starts_with("f.toml:10:12: dependency[0].interval: interval must be at least 10ms and at most lease_ttl / 3"),
        );
    assert!(
        err(&format!("{BASE}placement = \"fleet\"\nmax_instances = 0\n"))
            .starts_with("f.toml:9:17: dependency[0].max_instances: "),
    );
    assert!(
        err(&format!(
            "{BASE}budget = \"ratio:ttl=1s\"\nplacement = \"fleet\"\nmax_instances = 3\n"
        ))
        .starts_with("f.toml:5:1: dependency[0].lease_ttl: lease_ttl (2s) must be at most 0.9"),
        "{}",
        err(&format!(
            "{BASE}budget = \"ratio:ttl=1s\"\nplacement = \"fleet\"\nmax_instances = 3\n"
        ))
    );
}

#[test]
fn a_fallback_share_of_zero_is_refused_with_the_fix() {
    // 20 slots over 50 instances: each would fall back to 0 and admit nothing.
    let text = format!("{BASE}cap = 20\nplacement = \"fleet\"\nmax_instances = 50\n");
    assert_eq!(
        err(&text),
        "f.toml:10:17: dependency[0].max_instances: the fallback share floor(fleet_cap \
             (default: cap) / max_instances) = floor(20 / 50) is 0: without Redis no instance \
             would admit anything. Set fleet_cap to the whole fleet's cap (at least 50), lower \
             max_instances to at most 20, or set fallback_min (the slots each instance keeps \
             without Redis, overcommitting the fleet cap; fallback_min = 0 admits nothing \
             without Redis on purpose)"
    );
    assert!(
            err(&format!("{BASE}placement = \"fleet\"\nfleet_cap = 10\nmax_instances = 11\n"))
                .starts_with("f.toml:10:17: dependency[0].max_instances: the fallback share floor(fleet_cap / max_instances) = floor(10 / 11) is 0")
        );
    // Each fix is accepted.
    for fix in ["fleet_cap = 250", "max_instances = 20", "fallback_min = 1", "fallback_min = 0"] {
        let (key, _) = fix.split_once(" = ").unwrap();
        let rest = if key == "max_instances" {
            fix.to_string()
        } else {
            format!("max_instances = 50\n{fix}")
        };
        let text = format!("{BASE}cap = 20\nplacement = \"fleet\"\n{rest}\n");
        let c = ProxyConfig::parse(&text, "f.toml").unwrap_or_else(|e| panic!("{fix}: {e}"));
        let f = c.dependencies[0].fleet.as_ref().unwrap();
        let fleet = f.to_fleet(&c.dependencies[0], stormguard_redis::RedisTarget::plain("h", 6379));
        let expected = match fix {
            "fleet_cap = 250" => 5,
            "max_instances = 20" | "fallback_min = 1" => 1,
            _ => 0,
        };
        assert_eq!(fleet.fallback_slots(), expected, "{fix}");
    }
}

#[test]
fn connection_keys() {
    let text = format!(
        "header_read_timeout = \"2s\"\nidle_timeout = \"30s\"\nmax_connections = 500\n\
             admin_max_connections = 8\nmax_header_bytes = 16384\nhttp2_max_concurrent_streams = 50\n\
             http2_keepalive_interval = \"10s\"\nadmin_token = \"env:SG_TOKEN\"\n{BASE}"
    );
    let c = ProxyConfig::parse(&text, "f.toml").unwrap();
    let n = &c.connections;
    assert_eq!(
        (n.header_read_timeout, n.idle_timeout, n.http2_keepalive_interval),
        (Duration::from_secs(2), Duration::from_secs(30), Duration::from_secs(10))
    );
    assert_eq!(
        (
            n.max_connections,
            n.admin_max_connections,
            n.max_header_bytes,
            n.http2_max_concurrent_streams
        ),
        (Some(500), 8, 16384, 50)
    );
    assert_eq!(c.admin_access.token, Some(AdminToken::Env("SG_TOKEN".into())));
    let json = c.to_json();
    assert_eq!(json["admin_token"], "env:SG_TOKEN");
    assert_eq!(json["header_read_timeout"], "2000ms");
    // Defaults.
    let c = ProxyConfig::parse(BASE, "f.toml").unwrap();
    assert_eq!(c.connections, ConnectionConfig::default());
    assert_eq!(c.connections.header_read_timeout, Duration::from_secs(10));
    assert_eq!(c.connections.idle_timeout, Duration::from_secs(60));
    assert_eq!(c.connections.max_connections, None);
    assert!(!c.admin_access.allow_remote);
    // A token in code is never shown.
    let mut c = c;
    c.admin_access.token = Some(AdminToken::Value("s3cret-s3cret-s3cret".into()));
    assert!(!c.to_json().to_string().contains("s3cret"));
    assert!(!format!("{c:?}").contains("s3cret"));
}

#[test]
fn connection_key_errors_name_the_key() {
    assert_eq!(
        err(&format!("header_read_timeout = \"0s\"\n{BASE}")),
        "f.toml:1:23: header_read_timeout: must be more than 0"
    );
    assert_eq!(
        err(&format!("max_connections = 0\n{BASE}")),
        "f.toml:1:19: max_connections: must be between 1 and 16777216, got 0"
    );
    assert_eq!(
        err(&format!("max_header_bytes = 100\n{BASE}")),
        "f.toml:1:20: max_header_bytes: must be between 8192 and 1048576, got 100"
    );
    assert_eq!(
        err(&format!("admin_token = \"hunter2hunter2hunter2\"\n{BASE}")),
        "f.toml:1:15: admin_token: the admin token comes from an environment variable: admin_token = \"env:STORMGUARD_ADMIN_TOKEN\""
    );
}

#[test]
fn a_remote_admin_address_needs_admin_allow_remote() {
    let e = err(&format!("admin = \"0.0.0.0:9901\"\n{BASE}"));
    assert!(e.starts_with("f.toml:1:9: admin: 0.0.0.0:9901 is not a loopback address: "), "{e}");
    assert!(e.contains("admin_allow_remote = true"), "{e}");
    let c = ProxyConfig::parse(
        &format!("admin = \"0.0.0.0:9901\"\nadmin_allow_remote = true\n{BASE}"),
        "f.toml",
    )
    .unwrap();
    assert!(c.admin_access.allow_remote);
    for ok in ["127.0.0.1:9901", "[::1]:9901", "off"] {
        ProxyConfig::parse(&format!("admin = \"{ok}\"\n{BASE}"), "f.toml").unwrap();
    }
    assert!(err(&format!("admin = \"[::]:9901\"\n{BASE}")).contains("admin_allow_remote"));
}

#[test]
fn admin_tokens_are_long_enough() {
    assert_eq!(AdminToken::Value("short".into()).resolve().unwrap_err(), AdminTokenError::TooShort);
    assert_eq!(AdminToken::Value("0123456789abcdef".into()).resolve().unwrap(), "0123456789abcdef");
    let e = AdminToken::Env("STORMGUARD_TEST_UNSET_TOKEN_VARIABLE".into()).resolve();
    let e = e.unwrap_err();
    assert_eq!(e, AdminTokenError::Unset("STORMGUARD_TEST_UNSET_TOKEN_VARIABLE".into()));
    assert!(e.to_string().contains("STORMGUARD_TEST_UNSET_TOKEN_VARIABLE is not set"));
}

#[test]
fn redacts_credentials() {
    assert_eq!(redact(&"http://user:pw@h:1/".parse().unwrap()), "http://[redacted]@h:1/");
}

/// The provider keys: read into rate admission with the preset's `retry_on` (unless set), and
/// each mistake at its line, column and key.
#[test]
fn provider_keys_read_and_their_mistakes_are_located() {
    let text = format!(
        "{BASE}provider = \"anthropic\"\ninput_tokens_per_minute = 40000\noutput_tokens_per_minute = 8000\n\
             quota_hold = \"2m\"\noverload_cool_down = \"500ms\"\nbytes_per_token = 3\n"
    );
    let c = ProxyConfig::parse(&text, "f.toml").unwrap();
    let d = &c.dependencies[0];
    assert_eq!(d.rate.provider, Some(stormguard_http::rate::Provider::Anthropic));
    assert!(d.rate.is_on(), "a provider learns its limits");
    assert_eq!(
        (d.rate.input_tokens_per_minute, d.rate.output_tokens_per_minute),
        (Some(40_000), Some(8_000))
    );
    assert_eq!(
        (d.rate.quota_hold, d.rate.overload_cool_down),
        (Duration::from_secs(120), Duration::from_millis(500))
    );
    assert_eq!(d.bytes_per_token, 3);
    assert_eq!(d.retry_on.to_string(), stormguard_http::rate::PROVIDER_RETRY_ON);
    // retry_on set: it wins over the preset.
    let c =
        ProxyConfig::parse(&format!("{BASE}provider = \"openai\"\nretry_on = \"5xx\"\n"), "f.toml")
            .unwrap();
    assert_eq!(c.dependencies[0].retry_on.to_string(), "5xx");
    assert!(
        err(&format!("{BASE}provider = \"azure\"\n"))
            .starts_with("f.toml:8:12: dependency[0].provider: `azure` is not a provider"),
        "{}",
        err(&format!("{BASE}provider = \"azure\"\n"))
    );
    assert!(
        err(&format!("{BASE}bytes_per_token = 0\n"))
            .starts_with("f.toml:8:19: dependency[0].bytes_per_token: "),
        "{}",
        err(&format!("{BASE}bytes_per_token = 0\n"))
    );
    assert!(
        err(&format!("{BASE}output_tokens_per_minute = 0\n"))
            .starts_with("f.toml:8:28: dependency[0].output_tokens_per_minute: "),
        "{}",
        err(&format!("{BASE}output_tokens_per_minute = 0\n"))
    );
}

/// `adaptive = { … }`: each mistake at its line, column and key inside the table, and a valid
/// one read into the model and shown in `/config`'s view, defaults filled in.
#[test]
fn adaptive_cap_keys_read_and_their_mistakes_are_located() {
    let adaptive = |table: &str| err(&format!("{BASE}adaptive = {table}\n"));
    assert_eq!(
        adaptive("{ min = 0, max = 40 }"),
        "f.toml:8:20: dependency[0].adaptive.min: adaptive.min must be between 1 and 40, got 0"
    );
    assert_eq!(
        adaptive("{ min = 50, max = 40 }"),
        "f.toml:8:20: dependency[0].adaptive.min: adaptive.min must be between 1 and 40, got 50"
    );
    assert_eq!(
        adaptive("{ min = 4, max = 40, algorithm = \"vegas\" }"),
        "f.toml:8:45: dependency[0].adaptive.algorithm: algorithm: `vegas` is not \"gradient2\" or \"aimd\""
    );
    assert!(
        adaptive("{ min = 4, max = 40, bogus = 1 }")
            .starts_with("f.toml:8:33: dependency[0].adaptive.bogus: unknown field `bogus`"),
        "{}",
        adaptive("{ min = 4, max = 40, bogus = 1 }")
    );
    assert_eq!(
        adaptive("{ min = 4, max = 99999999 }"),
        "f.toml:8:29: dependency[0].adaptive.max: adaptive.max must be at most 16777216, got 99999999"
    );
    assert_eq!(
        adaptive("{ min = 4, max = 40, tolerance = 50 }"),
        "f.toml:8:45: dependency[0].adaptive.tolerance: adaptive.tolerance must be between 100 and 400, got 50"
    );
    // As a table of its own, the key is located on its line.
    assert_eq!(
        err(&format!("{BASE}\n[dependency.adaptive]\nmin = 0\nmax = 40\n")),
        "f.toml:10:7: dependency[0].adaptive.min: adaptive.min must be between 1 and 40, got 0"
    );

    let view = |table: &str| {
        let c =
            ProxyConfig::parse(&format!("{BASE}cap = 12\nadaptive = {table}\n"), "f.toml").unwrap();
        (c.dependencies[0].adaptive, c.to_json()["dependencies"][0].clone())
    };
    let (model, json) =
        view("{ min = 4, max = 40, algorithm = \"aimd\", window = \"500ms\", tolerance = 150 }");
    let a = model.unwrap();
    assert_eq!(
        (a.min, a.max, a.algorithm, a.window, a.tolerance),
        (4, 40, stormguard_core::adaptive::Algorithm::Aimd, Duration::from_millis(500), 150)
    );
    assert_eq!(json["cap"], 12);
    assert_eq!(
        json["adaptive"],
        serde_json::json!({ "min": 4, "max": 40, "algorithm": "aimd", "window": "500ms", "tolerance": 150 })
    );
    // The view's values read back as the same config.
    let back = format!(
        "{{ min = {}, max = {}, algorithm = {}, window = {}, tolerance = {} }}",
        json["adaptive"]["min"],
        json["adaptive"]["max"],
        json["adaptive"]["algorithm"],
        json["adaptive"]["window"],
        json["adaptive"]["tolerance"]
    );
    assert_eq!(view(&back).0, Some(a));
    // Defaults: Gradient2, a 1 s window, a tolerance of 100 %; no adaptive cap without the key.
    let (_, json) = view("{ min = 4, max = 40 }");
    assert_eq!(
        json["adaptive"],
        serde_json::json!({ "min": 4, "max": 40, "algorithm": "gradient2", "window": "1000ms", "tolerance": 100 })
    );
    let c = ProxyConfig::parse(BASE, "f.toml").unwrap();
    assert_eq!(c.dependencies[0].adaptive, None);
    assert!(c.to_json()["dependencies"][0]["adaptive"].is_null());
}
