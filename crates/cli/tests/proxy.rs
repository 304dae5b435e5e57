//! `stormguard check-config` and `stormguard proxy` flags.

use assert_cmd::Command;
use predicates::prelude::*;

fn stormguard() -> Command {
    Command::cargo_bin("stormguard").unwrap()
}

fn write(name: &str, text: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("stormguard-proxy-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path
}

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
