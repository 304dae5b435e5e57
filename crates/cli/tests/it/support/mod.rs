//! What the cli tests share (`mod support;`): the binary, and files written for it.

use std::path::PathBuf;

use assert_cmd::Command;

/// `stormguard` as built for these tests.
pub fn stormguard() -> Command {
    Command::cargo_bin("stormguard").unwrap()
}

/// This test binary's own scratch directory (`stormguard-<test>-<pid>` under the temp dir).
pub fn dir() -> PathBuf {
    let d = std::env::temp_dir().join(format!(
        "stormguard-{}-{}",
        env!("CARGO_CRATE_NAME"),
        std::process::id()
    ));
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// `text` written to `name` in [`dir`].
pub fn write(name: &str, text: &str) -> PathBuf {
    let path = dir().join(name);
    std::fs::write(&path, text).unwrap();
    path
}

/// A plain HTTP client for the proxies the tests start.
pub type Client = hyper_util::client::legacy::Client<
    hyper_util::client::legacy::connect::HttpConnector,
    http_body_util::Full<bytes::Bytes>,
>;

/// A new [`Client`].
pub fn client() -> Client {
    hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new()).build_http()
}

/// One request with an empty body (a POST as JSON, as the admin endpoints require); its status
/// and body, within 10 s.
pub async fn send(c: &Client, method: &str, uri: String) -> (http::StatusCode, String) {
    use http_body_util::BodyExt;
    let mut req = http::Request::builder().method(method).uri(&uri);
    if method == "POST" {
        req = req.header("content-type", "application/json");
    }
    let resp = c.request(req.body(http_body_util::Full::new(bytes::Bytes::new())).unwrap());
    let resp =
        tokio::time::timeout(std::time::Duration::from_secs(10), resp).await.unwrap().unwrap();
    let status = resp.status();
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    (status, String::from_utf8(body.to_vec()).unwrap())
}

/// A child's stderr, line by line, read on a thread of its own (so the child never blocks on a
/// full pipe).
pub fn stderr_lines(child: &mut std::process::Child) -> std::sync::mpsc::Receiver<String> {
    use std::io::BufRead;
    let (tx, lines) = std::sync::mpsc::channel();
    let stderr = std::io::BufReader::new(child.stderr.take().unwrap());
    std::thread::spawn(move || {
        for line in stderr.lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    lines
}

/// An address on loopback where nothing listens, kept so while the returned socket lives: bound
/// but never listening, so a connect is refused and no other test can be given the port (a
/// listener bound and dropped frees its port for whoever binds next).
pub fn refused_addr() -> (std::net::SocketAddr, tokio::net::TcpSocket) {
    let s = tokio::net::TcpSocket::new_v4().unwrap();
    s.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    (s.local_addr().unwrap(), s)
}
