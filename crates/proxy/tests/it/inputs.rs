//! Input the proxy did not make: client ids in metric labels, and the files its config names.
//!
//! - a client id with a quote, a backslash or a byte outside UTF-8 leaves `/metrics` valid
//!   for every later scrape (checked by `promtool check metrics`, the parser Prometheus runs);
//! - a config that names `/dev/zero` or a FIFO as a certificate, or is one, is refused at once
//!   with the key, never read forever.

use crate::common;

use common::*;

use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use stormguard_chaos::Phase;
use stormguard_proxy::config::{ProxyConfig, ProxyDependency};
use stormguard_proxy::start;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// promtool: `$PROMTOOL`, the `PATH`, or `target/tools/promtool` (where `scripts/test` puts
/// it). Missing is a failure, as redis-server is for the fleet tests: the check must run.
fn promtool() -> PathBuf {
    if let Some(p) = std::env::var_os("PROMTOOL") {
        return p.into();
    }
    if Command::new("promtool").arg("--version").output().is_ok_and(|o| o.status.success()) {
        return "promtool".into();
    }
    let workspace = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target");
    let targets = std::env::var_os("CARGO_TARGET_DIR").map(PathBuf::from).into_iter();
    targets.chain([workspace]).map(|t| t.join("tools/promtool")).find(|p| p.exists()).expect(
        "promtool is needed: set PROMTOOL, put it on the PATH, or run scripts/test once (it \
         fetches it into target/tools/)",
    )
}

/// `promtool check metrics` on `text`: its exit status and what it printed.
fn promtool_check(text: &str) -> (bool, String) {
    let mut child = Command::new(promtool())
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("promtool runs");
    child.stdin.take().unwrap().write_all(text.as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    let said =
        format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    // Exit 3 is lint advice only (names, help text); 1 is a parse error.
    (out.status.success() || out.status.code() == Some(3), said)
}

/// Raw GET /metrics on the admin listener.
async fn scrape(admin: std::net::SocketAddr) -> String {
    let mut s = tokio::net::TcpStream::connect(admin).await.unwrap();
    s.write_all(b"GET /metrics HTTP/1.1\r\nhost: a\r\nconnection: close\r\n\r\n").await.unwrap();
    let mut out = Vec::new();
    s.read_to_end(&mut out).await.unwrap();
    let text = String::from_utf8(out).unwrap();
    text.split_once("\r\n\r\n").map(|(_, b)| b.to_string()).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quoted_client_id_leaves_metrics_parseable() {
    let upstream = chaos(Phase::default()).await;
    let mut config = ProxyConfig::single(
        "127.0.0.1:0".parse().unwrap(),
        ProxyDependency::new("pay", upstream.url("").parse().unwrap()),
    );
    config.admin = Some("127.0.0.1:0".parse().unwrap());
    config.client_header = Some(http::HeaderName::from_static("x-client-id"));
    let p = start(config).await.unwrap();
    let admin = p.admin_addr().unwrap();
    let (ok, said) = promtool_check(&scrape(admin).await);
    assert!(ok, "the exposition before any request: {said}");

    let c = client();
    let long = "x".repeat(200);
    let ids: [&[u8]; 5] =
        [b"web\"} 1\nfake_metric 1", br"back\slash", b"caf\xc3\xa9", long.as_bytes(), b"ok-1"];
    for id in ids {
        let req = Request::get(format!("http://{}/x", p.listen_addrs()[0]))
            .header(
                "x-client-id",
                HeaderValue::from_bytes(id).unwrap_or(HeaderValue::from_static("bad")),
            )
            .body(Full::new(Bytes::new()))
            .unwrap();
        let resp = c.request(req).await.unwrap();
        assert_eq!(resp.status(), StatusCode::OK);
        resp.into_body().collect().await.unwrap();
    }
    // A quote that hyper's client would not send: straight onto the socket.
    let mut s = tokio::net::TcpStream::connect(p.listen_addrs()[0]).await.unwrap();
    s.write_all(b"GET /x HTTP/1.1\r\nhost: a\r\nx-client-id: a\"b\\c\r\nconnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut out = Vec::new();
    s.read_to_end(&mut out).await.unwrap();
    assert!(out.starts_with(b"HTTP/1.1 200"), "{}", String::from_utf8_lossy(&out));

    let text = scrape(admin).await;
    let (ok, said) = promtool_check(&text);
    assert!(ok, "promtool refused the exposition after quoted client ids:\n{said}\n{text}");
    assert!(text.contains(r#"client="a\"b\\c""#), "{text}");
    assert!(text.contains(r#"client="back\\slash""#), "{text}");
    assert!(!text.contains("\nfake_metric"), "{text}");
    assert!(!text.contains(&long), "a 200-byte client id is counted as other");
    assert!(text.contains(r#"client="other""#), "{text}");
    // Later scrapes stay valid too.
    let (ok, said) = promtool_check(&scrape(admin).await);
    assert!(ok, "{said}");
    p.shutdown().await;
}

fn dir() -> PathBuf {
    let d = std::env::temp_dir().join(format!("stormguard-proxy-inputs-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

const HTTPS: &str = "[[listener]]\nlisten = \"127.0.0.1:0\"\ndependency = \"pay\"\n\n\
                     [[dependency]]\nname = \"pay\"\nupstreams = [\"https://127.0.0.1:9443\"]\n";

/// Loads `path` on a thread of its own, so a load that never returns fails the test (after 10 s)
/// instead of hanging it.
fn load_within_10s(path: PathBuf) -> Result<ProxyConfig, String> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(ProxyConfig::load(&path).map_err(|e| e.to_string()));
    });
    rx.recv_timeout(Duration::from_secs(10)).expect("the config load returned within 10 s")
}

#[cfg(unix)]
#[test]
fn special_files_in_a_config_are_refused_at_once() {
    let d = dir();
    let started = std::time::Instant::now();
    for key in
        ["ca_file = \"/dev/zero\"", "client_cert = \"/dev/zero\"\nclient_key = \"/dev/zero\""]
    {
        let path = d.join("zero.toml");
        std::fs::write(&path, format!("{HTTPS}[dependency.tls]\n{key}\n")).unwrap();
        let err = load_within_10s(path.clone()).unwrap_err();
        assert!(err.contains("/dev/zero: is a character device, not a regular file"), "{err}");
        assert!(
            err.contains(":9:") && err.contains("dependency[0].tls."),
            "file, line, key: {err}"
        );
    }
    let fifo = d.join("ca.pem");
    let _ = std::fs::remove_file(&fifo);
    assert!(Command::new("mkfifo").arg(&fifo).status().unwrap().success());
    let path = d.join("fifo.toml");
    std::fs::write(&path, format!("{HTTPS}[dependency.tls]\nca_file = {:?}\n", fifo.display()))
        .unwrap();
    let err = load_within_10s(path).unwrap_err();
    assert!(err.contains("is a FIFO, not a regular file"), "{err}");
    // The config file itself.
    for (path, what) in [
        (PathBuf::from("/dev/zero"), "is a character device"),
        (fifo.clone(), "is a FIFO"),
        (d.clone(), "is a directory"),
    ] {
        let err = load_within_10s(path).unwrap_err();
        assert!(err.contains(what), "{err}");
    }
    eprintln!("special files refused in {:?}", started.elapsed());
}
