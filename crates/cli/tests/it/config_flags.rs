//! `stormguard proxy --config FILE` beside other flags: each flag is applied over the file (and
//! kept at every reload) or refused with exit 2 naming it — never ignored.
//!
//! - the per-dependency flags (`--cap`, `--budget`, ...) are refused, all of them named;
//! - `--admin`, `--shadow`, `--drain-timeout` and `--record` apply over the file, show in
//!   `/config` under `overrides`, and stay in force across SIGHUP and `POST /reload`;
//! - the incident workflow the docs show — `--config FILE --record incident.jsonl`, edit the
//!   file, SIGHUP — reloads (it used to be refused: "the record file cannot change"), the trace
//!   goes on across the reload, and `stormguard replay` reads it.

use crate::support;

use std::sync::mpsc;
use std::time::Duration;
use support::{Client, client, send, stormguard, write};

use predicates::prelude::*;
use serde_json::Value;
use stormguard_chaos::{ChaosConfig, ChaosServer, Phase};

fn config(admin: &str, upstream: &str, cap: u64) -> String {
    format!(
        "admin = \"{admin}\"\n[[listener]]\nlisten = \"127.0.0.1:0\"\ndependency = \"up\"\n\
         [[dependency]]\nname = \"up\"\nupstreams = [\"{upstream}\"]\ncap = {cap}\n"
    )
}

#[test]
fn per_dependency_flags_beside_config_are_refused_naming_them() {
    let path = write("refused.toml", &config("off", "http://127.0.0.1:9", 20));
    let file = path.to_str().unwrap();
    let flags: [(&str, &str); 11] = [
        ("--cap", "5"),
        ("--budget", "ratio:percent=0.1"),
        ("--retry-on", "5xx"),
        ("--max-retries", "1"),
        ("--per-try-timeout", "100ms"),
        ("--deadline", "1s"),
        ("--backoff", "1ms..2ms"),
        ("--queue", "0"),
        ("--queue-timeout", "10ms"),
        ("--timeout-slot-hold", "1s"),
        ("--abandon-hold", "1s"),
    ];
    for (flag, value) in flags {
        // --duration: on the code before, the flag was ignored and the proxy ran (exit 0).
        stormguard()
            .args(["proxy", "--config", file, flag, value, "--duration", "100ms"])
            .timeout(Duration::from_secs(20))
            .assert()
            .code(2)
            .stderr(
                predicate::str::contains(format!("cannot be used with '{flag} "))
                    .and(predicate::str::contains("set them in its [[listener]]")),
            );
    }
    // A switch, too.
    stormguard()
        .args(["proxy", "--config", file, "--breaker", "--duration", "100ms"])
        .timeout(Duration::from_secs(20))
        .assert()
        .code(2)
        .stderr(predicate::str::contains("cannot be used with '--breaker'"));
    // Several at once: every one named.
    stormguard()
        .args(["proxy", "--config", file, "--cap", "5", "--budget", "ratio:percent=0.1"])
        .args(["--max-retries", "1", "--duration", "100ms"])
        .timeout(Duration::from_secs(20))
        .assert()
        .code(2)
        .stderr(
            predicate::str::contains("--cap <N>")
                .and(predicate::str::contains("--budget <SPEC>"))
                .and(predicate::str::contains("--max-retries <N>")),
        );
}

#[test]
fn admin_off_beside_config_turns_the_admin_listener_off() {
    let path = write("admin-on.toml", &config("127.0.0.1:0", "http://127.0.0.1:9", 20));
    let file = path.to_str().unwrap();
    stormguard()
        .args(["proxy", "--config", file, "--duration", "200ms"])
        .timeout(Duration::from_secs(20))
        .assert()
        .success()
        .stderr(predicate::str::contains("admin on http://127.0.0.1:"));
    stormguard()
        .args(["proxy", "--config", file, "--admin", "off", "--duration", "200ms"])
        .timeout(Duration::from_secs(20))
        .assert()
        .success()
        .stderr(predicate::str::contains("admin on").not());
}

/// A proxy process, its addresses, and its stderr lines as they come.
struct Proxy {
    child: std::process::Child,
    lines: mpsc::Receiver<String>,
    seen: Vec<String>,
    listen: String,
    admin: String,
}

impl Proxy {
    fn spawn(args: &[&str]) -> Proxy {
        let mut child = std::process::Command::new(assert_cmd::cargo::cargo_bin("stormguard"))
            .arg("proxy")
            .args(args)
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let lines = support::stderr_lines(&mut child);
        let mut p =
            Proxy { child, lines, seen: Vec::new(), listen: String::new(), admin: String::new() };
        p.listen = p.wait_for("stormguard proxy: listening on ");
        p.admin = p.wait_for("stormguard proxy: admin on ");
        p
    }

    /// The rest of the first stderr line starting with `prefix` (within 20 s).
    fn wait_for(&mut self, prefix: &str) -> String {
        loop {
            let line = self.lines.recv_timeout(Duration::from_secs(20)).unwrap_or_else(|_| {
                panic!("no line starting {prefix:?} within 20 s; stderr so far: {:#?}", self.seen)
            });
            self.seen.push(line.clone());
            if let Some(rest) = line.strip_prefix(prefix) {
                return rest.to_string();
            }
        }
    }

    fn signal(&self, sig: &str) {
        let pid = self.child.id().to_string();
        assert!(std::process::Command::new("kill").args([sig, &pid]).status().unwrap().success());
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

async fn config_json(c: &Client, p: &Proxy) -> Value {
    serde_json::from_str(&send(c, "GET", format!("{}/config", p.admin)).await.1).unwrap()
}

/// Polls `/config` until the dependency's cap is `cap` (a reload is applied between two reads;
/// the bound only says when to give up).
async fn wait_for_cap(c: &Client, p: &Proxy, cap: u64) -> Value {
    for _ in 0..200 {
        let json = config_json(c, p).await;
        if json["dependencies"][0]["cap"] == cap {
            return json;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("the reload to cap {cap} was not applied: {:?}", config_json(c, p).await);
}

/// The reload counters once they read `want` (the new config is published a moment before its
/// reload is counted; the bound only says when to give up).
async fn reloads_reach(c: &Client, p: &Proxy, want: (&str, &str)) -> (String, String) {
    let mut seen = reloads(c, p).await;
    for _ in 0..200 {
        if (seen.0.as_str(), seen.1.as_str()) == want {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
        seen = reloads(c, p).await;
    }
    seen
}

async fn reloads(c: &Client, p: &Proxy) -> (String, String) {
    let m = send(c, "GET", format!("{}/metrics", p.admin)).await.1;
    let count = |result: &str| {
        let prefix = format!("stormguard_reloads_total{{result=\"{result}\"}} ");
        m.lines().find_map(|l| l.strip_prefix(&prefix)).unwrap_or("missing").to_string()
    };
    (count("applied"), count("refused"))
}

async fn upstream() -> ChaosServer {
    stormguard_chaos::spawn(ChaosConfig::single(Phase::default()), "127.0.0.1:0".parse().unwrap())
        .await
        .unwrap()
}

/// The docs' incident workflow: record beside the config file, then reload after an edit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn record_beside_config_survives_sighup_and_post_reload() {
    let up = upstream().await;
    let path = write("incident.toml", &config("127.0.0.1:0", &up.url(""), 20));
    let trace = write("incident.jsonl", "");
    let mut p =
        Proxy::spawn(&["--config", path.to_str().unwrap(), "--record", trace.to_str().unwrap()]);
    let c = client();
    for _ in 0..5 {
        assert_eq!(send(&c, "GET", format!("{}/a", p.listen)).await.0, http::StatusCode::OK);
    }
    std::fs::write(&path, config("127.0.0.1:0", &up.url(""), 7)).unwrap();
    p.signal("-HUP");
    let json = wait_for_cap(&c, &p, 7).await;
    assert_eq!(json["record"], trace.to_str().unwrap());
    assert_eq!(json["overrides"]["record"], trace.to_str().unwrap());
    assert_eq!(reloads_reach(&c, &p, ("1", "0")).await, ("1".into(), "0".into()));
    // POST /reload goes the same way.
    std::fs::write(&path, config("127.0.0.1:0", &up.url(""), 9)).unwrap();
    let (status, body) = send(&c, "POST", format!("{}/reload", p.admin)).await;
    assert_eq!(status, http::StatusCode::OK, "{body}");
    wait_for_cap(&c, &p, 9).await;
    assert_eq!(reloads_reach(&c, &p, ("2", "0")).await, ("2".into(), "0".into()));
    for _ in 0..5 {
        assert_eq!(send(&c, "GET", format!("{}/b", p.listen)).await.0, http::StatusCode::OK);
    }
    p.signal("-TERM");
    let status = p.child.wait().unwrap();
    assert!(status.success(), "{status:?}");
    while let Ok(line) = p.lines.recv_timeout(Duration::from_secs(5)) {
        p.seen.push(line);
    }
    let stderr = p.seen.join("\n");
    assert!(!stderr.contains("reload refused"), "{stderr}");
    // Every request, before and after both reloads, is in the trace; replay reads it.
    let text = std::fs::read_to_string(&trace).unwrap();
    let requests = text.lines().filter(|l| l.contains("\"op\":\"request\"")).count();
    assert_eq!(requests, 10, "{text}");
    stormguard()
        .args(["replay", "--dependency", "up", "--policy", "ratio:percent=0.1"])
        .arg(&trace)
        .timeout(Duration::from_secs(20))
        .assert()
        .success();
}

/// `--admin`, `--shadow` and `--drain-timeout` over a file that says otherwise: in force,
/// shown in /config, and still in force after a reload of the edited file.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn process_flags_apply_over_the_file_and_survive_a_reload() {
    let up = upstream().await;
    let text = |cap| format!("drain_timeout = \"30s\"\n{}", config("off", &up.url(""), cap));
    let path = write("overrides.toml", &text(20));
    let mut p = Proxy::spawn(&[
        "--config",
        path.to_str().unwrap(),
        "--admin",
        "127.0.0.1:0",
        "--shadow",
        "--drain-timeout",
        "3s",
    ]);
    let c = client();
    let check = |json: &Value| {
        assert_eq!(json["dependencies"][0]["enforce"], false, "--shadow: {json}");
        assert_eq!(json["drain_timeout"], "3000ms", "{json}");
        assert_eq!(json["admin"], "127.0.0.1:0", "{json}");
        assert_eq!(
            json["overrides"],
            serde_json::json!({"admin": "127.0.0.1:0", "drain_timeout": "3000ms", "shadow": true}),
        );
    };
    check(&config_json(&c, &p).await);
    std::fs::write(&path, text(7)).unwrap();
    p.signal("-HUP");
    check(&wait_for_cap(&c, &p, 7).await);
    assert_eq!(reloads_reach(&c, &p, ("1", "0")).await, ("1".into(), "0".into()));
    p.signal("-TERM");
    p.wait_for("stormguard proxy: draining (up to 3000 ms)");
    assert!(p.child.wait().unwrap().success());
}

/// The listener and admin access flags over a file that says otherwise: in force, shown in
/// /config, and still in force after a reload of the edited file (which would otherwise be
/// refused: they cannot change while the proxy runs).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn listener_flags_apply_over_the_file_and_survive_a_reload() {
    let up = upstream().await;
    let text = |cap| {
        format!(
            "header_read_timeout = \"30s\"\nmax_connections = 9\n{}",
            config("off", &up.url(""), cap)
        )
    };
    let path = write("listener-overrides.toml", &text(20));
    let mut p = Proxy::spawn(&[
        "--config",
        path.to_str().unwrap(),
        "--admin",
        "127.0.0.1:0",
        "--header-read-timeout",
        "2s",
        "--idle-timeout",
        "5s",
        "--max-connections",
        "100",
        "--body-timeout",
        "7s",
        "--response-idle-timeout",
        "0s",
    ]);
    let c = client();
    let check = |json: &Value| {
        assert_eq!(json["header_read_timeout"], "2000ms", "{json}");
        assert_eq!(json["idle_timeout"], "5000ms", "{json}");
        assert_eq!(json["max_connections"], 100, "{json}");
        assert_eq!(json["body_timeout"], "7000ms", "{json}");
        assert_eq!(json["response_idle_timeout"], "0ms", "{json}");
        assert_eq!(
            json["overrides"],
            serde_json::json!({"admin": "127.0.0.1:0", "header_read_timeout": "2000ms",
                "idle_timeout": "5000ms", "max_connections": 100, "body_timeout": "7000ms",
                "response_idle_timeout": "0ms"}),
        );
    };
    check(&config_json(&c, &p).await);
    std::fs::write(&path, text(7)).unwrap();
    p.signal("-HUP");
    check(&wait_for_cap(&c, &p, 7).await);
    assert_eq!(reloads_reach(&c, &p, ("1", "0")).await, ("1".into(), "0".into()));
    // An admin token that is not an environment variable is refused, naming the flag.
    stormguard()
        .args(["proxy", "--config", path.to_str().unwrap(), "--admin-token", "hunter2"])
        .assert()
        .code(2)
        .stderr(predicate::str::contains(
            "'hunter2' for '--admin-token <env:NAME>': the token comes from an environment variable",
        ));
    p.signal("-TERM");
    assert!(p.child.wait().unwrap().success());
}

/// `--breaker` turns the breaker on with its defaults, as `/config` shows; without it there is
/// none (its default is off).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_breaker_flag_turns_it_on_with_its_defaults() {
    let up = upstream().await;
    let c = client();
    for (flag, on) in [(Some("--breaker"), true), (None, false)] {
        let mut args = vec![
            "--upstream",
            up.url("").leak(),
            "--listen",
            "127.0.0.1:0",
            "--admin",
            "127.0.0.1:0",
        ];
        args.extend(flag);
        let p = Proxy::spawn(&args);
        let json = config_json(&c, &p).await;
        let breaker = &json["dependencies"][0]["breaker"];
        if on {
            assert_eq!(breaker["failure_ratio"], "0.5", "{json}");
            assert_eq!(breaker["consecutive_failures"], 10, "{json}");
        } else {
            assert!(breaker.is_null(), "{json}");
        }
    }
}
