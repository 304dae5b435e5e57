//! Input the tools are handed is bounded: an alias bomb, `/dev/zero`, a FIFO or a directory
//! given where a file is expected is refused at once with a clear error (exit 2) by every
//! command that reads files; `audit` reports the values it cannot read; `simulate` refuses
//! work past its stated bound; `check-config` checks ports, the fleet's Redis URL and names the
//! right key.
//!
//! Each command runs under `ulimit -v` (4 GiB of address space) and a timeout, so on code
//! without the bounds these tests fail — killed or timed out — instead of taking the machine.

use crate::support;

use std::time::{Duration, Instant};
use support::{dir, write};

use assert_cmd::Command;
use predicates::prelude::*;

/// `stormguard ARGS` under a 4 GiB address-space limit and a 30 s timeout.
fn bounded() -> Command {
    let mut c = Command::new("sh");
    c.args(["-c", "ulimit -v 4194304 && exec \"$0\" \"$@\""])
        .arg(assert_cmd::cargo::cargo_bin("stormguard"))
        .timeout(Duration::from_secs(30));
    c
}

#[test]
fn a_billion_laughs_yaml_is_refused_at_once() {
    let mut text = String::from("a0: &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n");
    for i in 1..=9 {
        text.push_str(&format!("a{i}: &a{i} [{}]\n", vec![format!("*a{}", i - 1); 9].join(", ")));
    }
    let path = write("laughs.yaml", &text);
    let started = Instant::now();
    bounded()
        .arg("audit")
        .arg(&path)
        .assert()
        .code(2)
        .stderr(predicate::str::contains("YAML aliases expand to more than 1000000"));
    let took = started.elapsed();
    eprintln!("a {}-byte billion laughs refused in {took:?} (process start included)", text.len());
    assert!(took < Duration::from_secs(10), "{took:?}");
}

#[cfg(unix)]
#[test]
fn special_files_are_refused_by_every_reader() {
    let d = dir();
    let fifo = d.join("pipe.toml");
    let _ = std::fs::remove_file(&fifo);
    assert!(std::process::Command::new("mkfifo").arg(&fifo).status().unwrap().success());
    let fifo = fifo.to_str().unwrap().to_string();
    let directory = d.to_str().unwrap().to_string();
    let https = "[[listener]]\nlisten = \"127.0.0.1:0\"\ndependency = \"pay\"\n[[dependency]]\n\
                 name = \"pay\"\nupstreams = [\"https://127.0.0.1:9443\"]\n[dependency.tls]\n";
    let ca_zero = write("ca-zero.toml", &format!("{https}ca_file = \"/dev/zero\"\n"));
    let ca_fifo = write("ca-fifo.toml", &format!("{https}ca_file = {fifo:?}\n"));
    for (path, what) in [
        ("/dev/zero", "is a character device, not a regular file"),
        (fifo.as_str(), "is a FIFO, not a regular file"),
        (directory.as_str(), "is a directory, not a file"),
    ] {
        let commands: [Vec<&str>; 5] = [
            vec!["check-config", path],
            vec!["audit", path],
            vec!["simulate", path],
            vec!["chaos", "--script", path],
            vec!["replay", "--policy", "ratio:percent=0.2", path],
        ];
        for args in commands {
            // A FIFO is a stream replay reads (a pipe from zcat, say); it is not a config.
            if args[0] == "replay" && what.contains("FIFO") {
                continue;
            }
            // A directory is what audit walks.
            if args[0] == "audit" && what.contains("directory") {
                continue;
            }
            bounded().args(&args).assert().code(2).stderr(
                predicate::str::contains(format!("{path}: "))
                    .and(predicate::str::contains(format!(": {what}"))),
            );
        }
    }
    for (config, what) in [(&ca_zero, "/dev/zero: is a character device"), (&ca_fifo, "is a FIFO")]
    {
        bounded().arg("check-config").arg(config).assert().code(2).stderr(
            predicate::str::contains(":8:11: dependency[0].tls.ca_file: ")
                .and(predicate::str::contains(what)),
        );
    }
}

#[test]
fn audit_reports_values_it_cannot_read() {
    let path = write(
        "five.yaml",
        "apiVersion: networking.istio.io/v1\nkind: VirtualService\nmetadata:\n  name: reviews\n\
         spec:\n  http:\n  - retries:\n      attempts: \"five\"\n    route:\n    - destination:\n        \
         host: reviews\n",
    );
    // Before, this layer was read as "no retries" and the audit was clean (exit 0).
    bounded().arg("audit").arg(&path).assert().code(1).stdout(
        predicate::str::contains("unreadable-value")
            .and(predicate::str::contains("`attempts: \"five\"` is not a whole number")),
    );
}

#[test]
fn simulate_refuses_work_past_its_bound() {
    let huge = write(
        "huge.toml",
        "duration = \"24h\"\n[fleet]\ninstances = 100\nrate = 1000\n[dependency]\ncapacity = 100\n\
         service_time = \"fixed 10ms\"\n[[policy]]\nretries = 1\n",
    );
    let started = Instant::now();
    bounded().arg("simulate").arg(&huge).assert().code(2).stderr(
        predicate::str::contains(
            "huge.toml:4:8: fleet.rate: the fleet starts about 8640000000 calls per policy",
        )
        .and(predicate::str::contains(
            "more than the 50000000 attempts the simulator runs per policy",
        )),
    );
    assert!(started.elapsed() < Duration::from_secs(10));
    // A closed loop that restarts at the same instant forever: stopped, not spun.
    let stuck = write(
        "stuck.toml",
        "duration = \"1s\"\n[fleet]\nconcurrency = 10\n[dependency]\ncapacity = 1\nqueue = 0\n\
         service_time = \"fixed 1ms\"\n[[policy]]\nretries = 0\n",
    );
    bounded()
        .args(["simulate", "--no-progress"])
        .arg(&stuck)
        .assert()
        .code(2)
        .stderr(predicate::str::contains("without the virtual clock moving"));
}

const LISTENER: &str = "[[listener]]\nlisten = \"127.0.0.1:8080\"\ndependency = \"pay\"\n\n";

#[test]
fn check_config_checks_ports_and_names_the_right_key() {
    for port in ["99999", "0"] {
        let path = write(
            "port.toml",
            &format!(
                "{LISTENER}[[dependency]]\nname = \"pay\"\nupstreams = [\"http://127.0.0.1:{port}\"]\n"
            ),
        );
        bounded().arg("check-config").arg(&path).assert().code(2).stderr(predicate::str::contains(
            format!(":7:14: dependency[0].upstreams[0]: http://127.0.0.1:{port}/: the port must be between 1 and 65535"),
        ));
    }
    // Was reported as `queue_timeout: cap must be between 1 and 16777216, got 0`.
    for n in ["0", "99999999999"] {
        let path = write(
            "streams.toml",
            &format!(
                "{LISTENER}[[dependency]]\nname = \"pay\"\nupstreams = [\"http://127.0.0.1:9000\"]\n\
                 max_concurrent_streams = {n}\n"
            ),
        );
        bounded().arg("check-config").arg(&path).assert().code(2).stderr(predicate::str::contains(
            format!(":8:26: dependency[0].max_concurrent_streams: must be between 1 and 2147483647, got {n}"),
        ));
    }
}

#[test]
fn check_config_parses_the_fleets_redis_url_as_the_proxy_does() {
    let path = write(
        "fleet.toml",
        &format!(
            "{LISTENER}[[dependency]]\nname = \"pay\"\nupstreams = [\"http://127.0.0.1:9000\"]\n\
             placement = \"fleet\"\nredis = \"env:SG_TEST_REDIS\"\nmax_instances = 2\n"
        ),
    );
    for (url, reason) in [
        ("redis://:hunter2@redis:99999", "the port must be a number from 1 to 65535"),
        ("http://redis:6380", "a Redis URL starts with redis:// or rediss://"),
        (
            "rediss://redis:6380?cafile=x",
            "a rediss:// URL's parameters are ca_file, client_cert and client_key",
        ),
        ("redis://redis:6379/x", "the database after '/' must be a number"),
    ] {
        bounded().arg("check-config").arg(&path).env("SG_TEST_REDIS", url).assert().code(2).stderr(
            predicate::str::contains(format!(
                ":9:9: dependency[0].redis: $SG_TEST_REDIS: {reason}"
            ))
            .and(predicate::str::contains("hunter2").not()),
        );
        // The proxy refuses the same URL when it starts.
        bounded()
            .args(["proxy", "--config"])
            .arg(&path)
            .env("SG_TEST_REDIS", url)
            .assert()
            .code(2)
            .stderr(predicate::str::contains(reason));
    }
    for good in
        ["redis://:hunter2@redis:6380/2", "rediss://:hunter2@redis:6380/0?ca_file=/etc/ca.pem"]
    {
        bounded().arg("check-config").arg(&path).env("SG_TEST_REDIS", good).assert().success();
    }
    bounded().arg("check-config").arg(&path).env_remove("SG_TEST_REDIS").assert().success().stderr(
        predicate::str::contains(
            "dependency[0].redis: $SG_TEST_REDIS is not set here, so the Redis URL was not checked",
        ),
    );
}
