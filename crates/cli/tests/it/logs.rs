//! The binary's log, read from the stderr of a real `stormguard proxy` process:
//!
//! - a refused reload (SIGHUP, `POST /reload`) is one line at `warn` with the reason, an applied
//!   one one line at `info` saying what changed in words, not in Rust debug structures;
//! - `STORMGUARD_LOG=debug` shows each retry decision (and the default, `info`, does not);
//! - with `--log-format json` every stderr line is a JSON object, the proxy's own status lines
//!   included;
//! - the access log goes to `--access-log FILE` only, never to stderr;
//! - a listener that cannot bind names itself and the flag (or key) that moves it, and a
//!   `STORMGUARD_LOG` that cannot be read is refused naming the variable.

use crate::support;

use std::net::TcpListener;
use std::path::Path;
use std::sync::mpsc;
use std::time::Duration;

use serde_json::Value;
use stormguard_chaos::{ChaosConfig, ChaosServer, Phase};
use support::{Client, client, send, stormguard, write};

/// The config the reload tests edit: one listener, one dependency `up` with `cap`.
fn config(admin: &str, cap: &str) -> String {
    format!(
        "admin = \"{admin}\"\n[[listener]]\nlisten = \"127.0.0.1:0\"\ndependency = \"up\"\n\
         [[dependency]]\nname = \"up\"\nupstreams = [\"http://127.0.0.1:9\"]\ncap = {cap}\n"
    )
}

/// A proxy process and its stderr lines as they come.
struct Proxy {
    child: std::process::Child,
    lines: mpsc::Receiver<String>,
    seen: Vec<String>,
    listen: String,
    admin: Option<String>,
}

/// A line's text: the `message` of a JSON line, else the line.
fn text_of(line: &str) -> String {
    match serde_json::from_str::<Value>(line) {
        Ok(v) => v["message"].as_str().unwrap_or_default().to_string(),
        Err(_) => line.to_string(),
    }
}

impl Proxy {
    /// `stormguard proxy ARGS` with `STORMGUARD_LOG` set to `log` (unset when `None`).
    fn spawn(args: &[&str], log: Option<&str>) -> Proxy {
        let mut cmd = std::process::Command::new(assert_cmd::cargo::cargo_bin("stormguard"));
        cmd.arg("proxy").args(args).stderr(std::process::Stdio::piped());
        match log {
            Some(l) => cmd.env("STORMGUARD_LOG", l),
            None => cmd.env_remove("STORMGUARD_LOG"),
        };
        let mut child = cmd.spawn().unwrap();
        let lines = support::stderr_lines(&mut child);
        let mut p = Proxy { child, lines, seen: Vec::new(), listen: String::new(), admin: None };
        p.listen =
            p.wait_for(|t| t.strip_prefix("stormguard proxy: listening on ").map(str::to_string));
        if !args.windows(2).any(|w| w == ["--admin", "off"]) {
            p.admin =
                Some(p.wait_for(|t| {
                    t.strip_prefix("stormguard proxy: admin on ").map(str::to_string)
                }));
        }
        p
    }

    /// The first result of `f` on a line's text, from the lines not yet read (within 20 s).
    fn wait_for(&mut self, f: impl Fn(&str) -> Option<String>) -> String {
        loop {
            let line = self.lines.recv_timeout(Duration::from_secs(20)).unwrap_or_else(|_| {
                panic!("the awaited line did not come within 20 s; stderr so far: {:#?}", self.seen)
            });
            self.seen.push(line.clone());
            if let Some(found) = f(&text_of(&line)) {
                return found;
            }
        }
    }

    fn signal(&self, sig: &str) {
        let pid = self.child.id().to_string();
        assert!(std::process::Command::new("kill").args([sig, &pid]).status().unwrap().success());
    }

    /// SIGTERM, then every stderr line of the whole run once the process has exited.
    fn stop(mut self) -> Vec<String> {
        self.signal("-TERM");
        let status = self.child.wait().unwrap();
        assert!(status.success(), "{status:?}");
        while let Ok(line) = self.lines.recv_timeout(Duration::from_secs(5)) {
            self.seen.push(line);
        }
        std::mem::take(&mut self.seen)
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A bad file by SIGHUP, a change that needs a restart by `POST /reload`, then a good file:
/// returns the whole stderr.
async fn reload_three_times(path: &Path, log: Option<&str>, extra: &[&str]) -> Vec<String> {
    std::fs::write(path, config("127.0.0.1:0", "20")).unwrap();
    let mut args = vec!["--config", path.to_str().unwrap()];
    args.extend_from_slice(extra);
    let p = Proxy::spawn(&args, log);
    let admin = p.admin.clone().unwrap();
    let c = client();
    // A value of the wrong type: refused when the file is read.
    std::fs::write(path, config("127.0.0.1:0", "\"lots\"")).unwrap();
    p.signal("-HUP");
    // Wait on the counter, not on a line: the line is what is checked.
    for _ in 0..400 {
        if refused(&c, &admin).await == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    // The admin address cannot change while running: refused by `POST /reload`.
    std::fs::write(path, config("127.0.0.1:1", "20")).unwrap();
    let (status, body) = send(&c, "POST", format!("{admin}/reload")).await;
    assert_ne!(status, http::StatusCode::OK, "{body}");
    // A good one.
    std::fs::write(path, config("127.0.0.1:0", "7")).unwrap();
    let (status, body) = send(&c, "POST", format!("{admin}/reload")).await;
    assert_eq!(status, http::StatusCode::OK, "{body}");
    assert_eq!(refused(&c, &admin).await, 2);
    p.stop()
}

/// `stormguard_reloads_total{result="refused"}`.
async fn refused(c: &Client, admin: &str) -> u64 {
    let m = send(c, "GET", format!("{admin}/metrics")).await.1;
    let prefix = "stormguard_reloads_total{result=\"refused\"} ";
    m.lines().find_map(|l| l.strip_prefix(prefix)).and_then(|n| n.parse().ok()).unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_reload_is_one_warn_line_with_the_reason() {
    let path = write("reload.toml", "");
    let file = path.to_str().unwrap().to_string();
    let stderr = reload_three_times(&path, None, &[]).await;
    let refused: Vec<_> = stderr.iter().filter(|l| l.contains("reload refused")).collect();
    assert_eq!(refused.len(), 2, "one line per refused reload: {stderr:#?}");
    for line in &refused {
        assert!(line.contains(" WARN "), "at warn: {line}");
    }
    // The reason, with the file, line, column and key of a bad file.
    assert!(refused[0].contains(&format!("{file}:8:7: dependency[0].cap")), "{}", refused[0]);
    assert!(refused[1].contains("the admin address cannot change on reload"), "{}", refused[1]);
    // The applied reload: one line, in words.
    let reloaded: Vec<_> = stderr.iter().filter(|l| l.contains("config reloaded")).collect();
    assert_eq!(reloaded.len(), 1, "{stderr:#?}");
    assert!(reloaded[0].contains(" INFO "), "{}", reloaded[0]);
    assert!(
        reloaded[0].contains("changed=up added=none removed=none unchanged=none"),
        "{}",
        reloaded[0]
    );
    // No Rust debug structure anywhere in the log.
    for line in &stderr {
        assert!(!line.contains("[\"") && !line.contains("Some(") && !line.contains("{ "), "{line}");
    }

    // The filter is honoured: at `error`, the same run logs none of it.
    let quiet = reload_three_times(&path, Some("error"), &[]).await;
    assert!(
        !quiet.iter().any(|l| l.contains("reload refused") || l.contains("config reloaded")),
        "{quiet:#?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn log_format_json_makes_every_stderr_line_a_json_object() {
    let path = write("json.toml", "");
    let stderr = reload_three_times(&path, Some("debug"), &["--log-format", "json"]).await;
    assert!(stderr.len() > 5, "{stderr:#?}");
    let objects: Vec<Value> = stderr
        .iter()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect();
    for o in &objects {
        for key in ["timestamp", "level", "target", "message"] {
            assert!(o.get(key).is_some(), "no {key}: {o}");
        }
    }
    let refused: Vec<_> = objects
        .iter()
        .filter(|o| o["message"] == "reload refused; the running config stays")
        .collect();
    assert_eq!(refused.len(), 2, "{stderr:#?}");
    assert_eq!(refused[1]["level"], "WARN");
    assert!(refused[1]["reason"].as_str().unwrap().contains("the admin address"), "{}", refused[1]);
    // The proxy's own status lines are log events too.
    assert!(
        objects
            .iter()
            .any(|o| o["message"].as_str().unwrap().starts_with("stormguard proxy: listening on"))
    );

    // Text, the default, is not JSON.
    let text = reload_three_times(&path, None, &[]).await;
    assert!(text.iter().any(|l| serde_json::from_str::<Value>(l).is_err()), "{text:#?}");
}

async fn failing_upstream() -> ChaosServer {
    let phase = Phase { error_rate: 1.0, ..Phase::default() };
    stormguard_chaos::spawn(ChaosConfig::single(phase), "127.0.0.1:0".parse().unwrap())
        .await
        .unwrap()
}

/// One GET through a proxy in front of an upstream that always answers 503: two retries, then
/// the third failure's retry is refused (`attempts`). Returns the stderr and the access log.
async fn one_failing_request(log: Option<&str>) -> (Vec<String>, String) {
    let up = failing_upstream().await;
    let access = write(&format!("access-{}.log", log.unwrap_or("default")), "");
    let p = Proxy::spawn(
        &[
            "--listen",
            "127.0.0.1:0",
            "--upstream",
            &up.url(""),
            "--admin",
            "off",
            "--backoff",
            "1ms..2ms",
            "--access-log",
            access.to_str().unwrap(),
        ],
        log,
    );
    let (status, _) = send(&client(), "GET", format!("{}/pay", p.listen)).await;
    assert_eq!(status, http::StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(up.stats().total.requests, 3, "the first try and two retries");
    let stderr = p.stop();
    (stderr, std::fs::read_to_string(access).unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn debug_shows_each_retry_decision_and_the_access_log_goes_to_its_file() {
    let (stderr, access) = one_failing_request(Some("debug")).await;
    let decisions: Vec<_> = stderr
        .iter()
        .filter(|l| l.contains("stormguard_tower::retry"))
        .map(|l| l.split_once("stormguard_tower::retry: ").map_or(l.as_str(), |(_, rest)| rest))
        .collect();
    assert_eq!(decisions.len(), 3, "{stderr:#?}");
    assert!(
        decisions[0]
            .starts_with("retrying dependency=\"default\" attempt=1 failure=503 backoff_ms="),
        "{}",
        decisions[0]
    );
    assert!(
        decisions[1].starts_with("retrying dependency=\"default\" attempt=2 failure=503"),
        "{}",
        decisions[1]
    );
    assert_eq!(
        decisions[2],
        "retry refused dependency=\"default\" attempt=3 failure=503 reason=attempts"
    );
    assert!(
        stderr.iter().filter(|l| l.contains("retry")).all(|l| l.contains(" DEBUG ")),
        "{stderr:#?}"
    );
    // The access log: one line, in its file only.
    let lines: Vec<_> = access.lines().collect();
    assert_eq!(lines.len(), 1, "{access}");
    assert!(
        lines[0].contains("stormguard::access")
            && lines[0].contains("status=503 attempts=3 denied=\"attempts\""),
        "{access}"
    );
    assert!(!stderr.iter().any(|l| l.contains("stormguard::access")), "{stderr:#?}");

    // At the default level (info) the decisions are not logged; the access log still is.
    let (stderr, access) = one_failing_request(None).await;
    assert!(
        !stderr.iter().any(|l| l.contains("retrying") || l.contains("retry refused")),
        "{stderr:#?}"
    );
    assert_eq!(access.lines().count(), 1, "{access}");
}

/// Runs `stormguard proxy ARGS --duration 100ms`; its exit code and stderr.
fn run_proxy(args: &[&str]) -> (Option<i32>, String) {
    let out = stormguard()
        .arg("proxy")
        .args(args)
        .args(["--duration", "100ms"])
        .env_remove("STORMGUARD_LOG")
        .timeout(Duration::from_secs(20))
        .output()
        .unwrap();
    (out.status.code(), String::from_utf8_lossy(&out.stderr).into_owned())
}

#[test]
fn a_listener_that_cannot_bind_names_itself_and_the_flag_that_moves_it() {
    let taken = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let up = ["--upstream", "http://127.0.0.1:9"];
    let (code, err) =
        run_proxy(&[&up[..], &["--listen", "127.0.0.1:0", "--admin", &addr]].concat());
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains(&format!("admin listener {addr} in use: pass --admin ADDR or --admin off")),
        "{err}"
    );
    let (code, err) = run_proxy(&[&up[..], &["--listen", &addr, "--admin", "off"]].concat());
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains(&format!("listener {addr} in use: pass --listen ADDR")), "{err}");
    // From a file: the key, and the file.
    let path = write(
        "taken.toml",
        &format!(
            "admin = \"off\"\n[[listener]]\nlisten = \"{addr}\"\ndependency = \"up\"\n\
             [[dependency]]\nname = \"up\"\nupstreams = [\"http://127.0.0.1:9\"]\n"
        ),
    );
    let (code, err) = run_proxy(&["--config", path.to_str().unwrap()]);
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains(&format!(
            "listener[0] {addr} in use: change listener[0].listen in {}",
            path.display()
        )),
        "{err}"
    );
    // The same flags on a free port start (and stop after --duration).
    drop(taken);
    let (code, err) = run_proxy(&[&up[..], &["--listen", &addr, "--admin", "off"]].concat());
    assert_eq!(code, Some(0), "{err}");
}

#[test]
fn a_log_filter_that_cannot_be_read_is_refused_naming_the_variable() {
    stormguard()
        .args([
            "proxy",
            "--upstream",
            "http://127.0.0.1:9",
            "--admin",
            "off",
            "--duration",
            "100ms",
        ])
        .env("STORMGUARD_LOG", "info,stormguard=loud")
        .timeout(Duration::from_secs(20))
        .assert()
        .code(2)
        .stderr(predicates::str::starts_with(
            "stormguard: STORMGUARD_LOG=\"info,stormguard=loud\": ",
        ));
}

/// Opens `n` HTTP/2 connections that each send 200 streams, every one reset at once (the "rapid
/// reset" attack), reading what the proxy answers until it closes the connection.
async fn rapid_resets(addr: &str, n: usize) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
        let mut f = (payload.len() as u32).to_be_bytes()[1..].to_vec();
        f.extend([kind, flags]);
        f.extend(stream.to_be_bytes());
        f.extend(payload);
        f
    }
    // HEADERS (END_STREAM | END_HEADERS): GET http://x/ in HPACK; then RST_STREAM CANCEL.
    let block = [0x82, 0x86, 0x84, 0x41, 0x01, b'x'];
    let mut data = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    data.extend(frame(4, 0, 0, &[]));
    for stream in (1..400).step_by(2) {
        data.extend(frame(1, 0x5, stream, &block));
        data.extend(frame(3, 0, stream, &8u32.to_be_bytes()));
    }
    let addr = addr.trim_start_matches("http://").to_string();
    for _ in 0..n {
        let mut s = tokio::net::TcpStream::connect(&addr).await.unwrap();
        let _ = s.write_all(&data).await;
        let mut sink = vec![0u8; 65536];
        let _ = tokio::time::timeout(Duration::from_secs(2), async {
            while matches!(s.read(&mut sink).await, Ok(n) if n > 0) {}
        })
        .await;
    }
}

/// 100 connections that reset HTTP/2 streams faster than allowed are one `warn` line, not one
/// a connection (the proxy's own, rate-limited; h2's per-connection warning is off by
/// default). Named in `STORMGUARD_LOG`, h2's warnings come back, one a connection: the
/// unprotected log.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rapid_reset_connections_are_one_warn_line_not_one_each() {
    let up = failing_upstream().await;
    for (log, most, least) in [(None, 1, 1), (Some("info,h2=warn"), usize::MAX, 100)] {
        let p = Proxy::spawn(
            &["--listen", "127.0.0.1:0", "--upstream", &up.url(""), "--admin", "off"],
            log,
        );
        rapid_resets(&p.listen, 100).await;
        let warns = p.stop().iter().filter(|l| l.contains("WARN")).count();
        assert!((least..=most).contains(&warns), "{log:?}: {warns} warn lines");
    }
}
