//! `stormguard check-config` and `stormguard proxy` flags.

use crate::support;

use predicates::prelude::*;
use support::{stormguard, write};

#[test]
fn plan_output_is_a_valid_config() {
    let plan = stormguard()
        .args(["plan", "--cap", "20", "--primary", "16", "--format", "toml"])
        .output()
        .unwrap();
    assert!(plan.status.success());
    let path = write("planned.toml", &String::from_utf8(plan.stdout).unwrap());
    stormguard()
        .args(["check-config", path.to_str().unwrap()])
        .assert()
        .success()
        .stdout(predicate::str::contains("ok (1 listener(s), 1 dependency, 0 route(s))"));
}

#[test]
fn config_errors_exit_2_naming_file_line_column_and_key() {
    let path = write(
        "bad.toml",
        "[[listener]]\nlisten = \"127.0.0.1:8080\"\ndependency = \"d\"\n\n[[dependency]]\nname = \"d\"\nupstreams = [\"http://127.0.0.1:9000\"]\ncap = 0\n",
    );
    let file = path.display().to_string();
    stormguard().args(["check-config", &file]).assert().code(2).stderr(predicate::str::contains(
        format!("{file}:8:7: dependency[0].cap: cap must be between 1"),
    ));
    // The proxy refuses to start on the same file.
    stormguard()
        .args(["proxy", "--config", &file])
        .assert()
        .code(2)
        .stderr(predicate::str::contains(":8:7:"));
}

#[test]
fn bad_flags_exit_2_naming_the_flag() {
    stormguard()
        .args([
            "proxy",
            "--upstream",
            "http://127.0.0.1:9000",
            "--budget",
            "ratio:percent=x",
            "--admin",
            "off",
        ])
        .assert()
        .code(2)
        .stderr(predicate::str::contains("--budget"));
    stormguard()
        .args(["proxy", "--upstream", "http://127.0.0.1:9000", "--cap", "0", "--admin", "off"])
        .assert()
        .code(2)
        .stderr(predicate::str::contains("--cap"));
}

/// `--adaptive-cap MIN..MAX`: a range that does not read, or a floor above the ceiling, is
/// refused naming the flag and saying why; a ceiling past the largest cap names the flag too.
#[test]
fn a_bad_adaptive_cap_exits_2_saying_why() {
    let proxy = |range: &str| {
        let mut cmd = stormguard();
        cmd.args(["proxy", "--upstream", "http://127.0.0.1:9000", "--admin", "off"]).args([
            "--adaptive-cap",
            range,
            "--duration",
            "100ms",
        ]);
        cmd
    };
    proxy("40..4").assert().code(2).stderr(predicate::str::contains(
        "invalid value '40..4' for '--adaptive-cap <MIN..MAX>': the floor 40 is above the ceiling 4 (MIN..MAX, such as 4..40)",
    ));
    proxy("0..4")
        .assert()
        .code(2)
        .stderr(predicate::str::contains("'--adaptive-cap <MIN..MAX>': the floor is 0"));
    proxy("4-40").assert().code(2).stderr(predicate::str::contains(
        "'--adaptive-cap <MIN..MAX>': `4-40` is not a range of caps such as 4..40",
    ));
    proxy("4..99999999").assert().code(2).stderr(predicate::str::contains(
        "--adaptive-cap: adaptive.max must be at most 16777216, got 99999999",
    ));
}

/// A non-loopback admin address is refused by check-config and by the proxy (exit 2, naming
/// the key and the flag), unless `admin_allow_remote` says so.
#[test]
fn a_remote_admin_address_needs_admin_allow_remote() {
    let base = "[[listener]]\nlisten = \"127.0.0.1:8080\"\ndependency = \"d\"\n\n[[dependency]]\nname = \"d\"\nupstreams = [\"http://127.0.0.1:9000\"]\n";
    let path = write("remote-admin.toml", &format!("admin = \"0.0.0.0:9901\"\n{base}"));
    let file = path.display().to_string();
    for args in [vec!["check-config", &file], vec!["proxy", "--config", &file]] {
        stormguard()
            .args(&args)
            .assert()
            .code(2)
            .stderr(predicate::str::contains(format!(
                "{file}:1:9: admin: 0.0.0.0:9901 is not a loopback address"
            )))
            .stderr(predicate::str::contains("admin_allow_remote = true"));
    }
    let path = write(
        "remote-admin-allowed.toml",
        &format!("admin = \"0.0.0.0:9901\"\nadmin_allow_remote = true\n{base}"),
    );
    stormguard().args(["check-config", path.to_str().unwrap()]).assert().success();
    stormguard()
        .args(["proxy", "--upstream", "http://127.0.0.1:9", "--listen", "127.0.0.1:0"])
        .args(["--admin", "0.0.0.0:0", "--duration", "200ms"])
        .assert()
        .code(2)
        .stderr(predicate::str::contains("--admin: 0.0.0.0:0 is not a loopback address"))
        .stderr(predicate::str::contains("--admin-allow-remote"));
    stormguard()
        .args(["proxy", "--upstream", "http://127.0.0.1:9", "--admin", "off"])
        .args(["--admin-token", "hunter2"])
        .assert()
        .code(2)
        .stderr(predicate::str::contains(
            "'hunter2' for '--admin-token <env:NAME>': the token comes from an environment variable",
        ));
    stormguard()
        .args(["proxy", "--upstream", "http://127.0.0.1:9", "--admin", "off"])
        .args(["--header-read-timeout", "0s"])
        .assert()
        .code(2)
        .stderr(predicate::str::contains("--header-read-timeout: must be more than 0"));
}

#[test]
fn the_proxy_starts_and_stops_by_itself() {
    stormguard()
        .args([
            "proxy",
            "--listen",
            "127.0.0.1:0",
            "--upstream",
            "http://127.0.0.1:9",
            "--admin",
            "127.0.0.1:0",
            "--duration",
            "200ms",
        ])
        .assert()
        .success()
        .stderr(predicate::str::contains("listening on http://127.0.0.1:"));
}

/// The real process: SIGHUP reads the config file again (a bad one is refused and the running
/// config stays), SIGTERM drains — the request in flight finishes — and the exit code is 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_reloads_and_sigterm_drains() {
    use std::io::BufRead;
    use stormguard_chaos::{ChaosConfig, Latency, Phase};

    let upstream = stormguard_chaos::spawn(
        ChaosConfig::single(Phase {
            latency: Latency::Fixed(std::time::Duration::from_millis(800)),
            ..Phase::default()
        }),
        "127.0.0.1:0".parse().unwrap(),
    )
    .await
    .unwrap();
    let config = |cap: u64| {
        format!(
            "admin = \"127.0.0.1:0\"\n[[listener]]\nlisten = \"127.0.0.1:0\"\ndependency = \"up\"\n\
             [[dependency]]\nname = \"up\"\nupstreams = [\"{}\"]\ncap = {cap}\n",
            upstream.url("")
        )
    };
    let path = write("signals.toml", &config(20));
    let mut child = std::process::Command::new(assert_cmd::cargo::cargo_bin("stormguard"))
        .args(["proxy", "--config"])
        .arg(&path)
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id().to_string();
    let signal = |sig: &str| {
        assert!(std::process::Command::new("kill").args([sig, &pid]).status().unwrap().success());
    };
    // The addresses, from what the proxy prints.
    let mut lines = std::io::BufReader::new(child.stderr.take().unwrap()).lines();
    let (mut listen, mut admin) = (None, None);
    while listen.is_none() || admin.is_none() {
        let line = lines.next().expect("the proxy printed its addresses").unwrap();
        if let Some(a) = line.strip_prefix("stormguard proxy: listening on ") {
            listen = Some(a.to_string());
        }
        if let Some(a) = line.strip_prefix("stormguard proxy: admin on ") {
            admin = Some(a.to_string());
        }
    }
    let (listen, admin) = (listen.unwrap(), admin.unwrap());
    let stderr = std::thread::spawn(move || lines.map_while(Result::ok).collect::<Vec<_>>());
    let c = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<http_body_util::Empty<bytes::Bytes>>();
    let get = |uri: String| {
        let c = c.clone();
        async move {
            use http_body_util::BodyExt;
            let resp = c.get(uri.parse().unwrap()).await.unwrap();
            let status = resp.status();
            (status, String::from_utf8(resp.collect().await.unwrap().to_bytes().to_vec()).unwrap())
        }
    };
    let cap = |text: String| {
        serde_json::from_str::<serde_json::Value>(&text).unwrap()["dependencies"][0]["cap"].as_u64()
    };
    assert_eq!(cap(get(format!("{admin}/config")).await.1), Some(20));

    std::fs::write(&path, config(7)).unwrap();
    signal("-HUP");
    let mut now = None;
    for _ in 0..100 {
        now = cap(get(format!("{admin}/config")).await.1);
        if now == Some(7) {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert_eq!(now, Some(7), "SIGHUP put the new cap in force");

    std::fs::write(&path, config(0)).unwrap();
    signal("-HUP");
    let mut refused = false;
    for _ in 0..100 {
        let metrics = get(format!("{admin}/metrics")).await.1;
        if metrics.contains("stormguard_reloads_total{result=\"refused\"} 1") {
            refused = true;
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert!(refused, "the bad config was refused");
    assert_eq!(cap(get(format!("{admin}/config")).await.1), Some(7), "the running config stayed");

    let in_flight = tokio::spawn(get(format!("{listen}/slow")));
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    signal("-TERM");
    assert_eq!(in_flight.await.unwrap().0, http::StatusCode::OK, "the request in flight finished");
    let status = tokio::task::spawn_blocking(move || child.wait().unwrap()).await.unwrap();
    assert!(status.success(), "exit 0 after the drain: {status:?}");
    let stderr = stderr.join().unwrap().join("\n");
    assert!(stderr.contains("reload refused"), "{stderr}");
    assert!(stderr.contains("0 connection(s) cut"), "{stderr}");
}
