//! TLS upstreams: a CA and certificates generated at test time (rcgen), an HTTPS upstream on
//! 127.0.0.1. Trusted through `tls.ca_file` it is served (HTTP/2 by ALPN); with only the system
//! roots its certificate is refused before anything is sent, and the caller is told why;
//! an upstream that requires a client certificate takes the proxy's.

use crate::support;

use std::sync::atomic::Ordering;

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::Full;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use stormguard_proxy::config::ProxyConfig;
use support::{Counts, Serve, answer, dep, full, pki, proxy, upstream};

type Caller = Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>>;

async fn send(c: &Caller, method: &str, url: String) -> support::Answer {
    let req = Request::builder().method(method).uri(url).body(Full::new(Bytes::new())).unwrap();
    answer(c.request(req).await.unwrap()).await
}

/// Answers with the protocol the request came in on.
async fn version_upstream(serve: Serve) -> support::Upstream {
    upstream(serve, |req| async move { http::Response::new(full(format!("{:?}", req.version()))) })
        .await
}

#[tokio::test]
async fn https_upstream_trusted_by_the_configured_ca_and_refused_by_the_system_roots() {
    let pki = pki();
    let up =
        version_upstream(Serve { tls: Some(pki.server_config(false)), ..Serve::default() }).await;
    let port = up.addr.port();
    let caller: Caller = Client::builder(TokioExecutor::new()).build_http();

    // Trusted: SNI and the name check from the upstream's host (a DNS name and an IP address).
    for host in ["localhost", "127.0.0.1"] {
        let mut d = dep(&format!("https://{host}:{port}"));
        d.tls.ca_file = Some(pki.ca_pem.clone());
        let p = proxy(d).await;
        for _ in 0..10 {
            let a = send(&caller, "GET", format!("http://{}/pay", p.listen_addrs()[0])).await;
            assert_eq!(a.status, StatusCode::OK, "{host}");
            // The proxy offered h2 and http/1.1 by ALPN; the upstream chose h2.
            assert_eq!(a.body, "HTTP/2.0", "{host}");
        }
        p.shutdown().await;
    }
    assert_eq!(Counts::get(&up.counts.handled), 20);
    assert_eq!(Counts::get(&up.counts.tls_failures), 0);

    // The same upstream with the system roots only: its certificate is not trusted. The
    // handshake fails before a byte of the request is sent — a connect failure, so even a POST
    // is retried (max_retries 2: three handshakes) — and the caller gets 502 with the reason.
    let p = proxy(dep(&format!("https://localhost:{port}"))).await;
    let a = send(&caller, "POST", format!("http://{}/pay", p.listen_addrs()[0])).await;
    assert_eq!(a.status, StatusCode::BAD_GATEWAY);
    assert_eq!(a.headers["x-stormguard-error"], "tls");
    assert_eq!(Counts::get(&up.counts.handled), 20, "nothing reached the handler");
    assert_eq!(Counts::get(&up.counts.tls_failures), 3, "the first try and two retries");
    let stats = p.dependency("upstream").unwrap().snapshot();
    assert_eq!(stats.counters.retries, 2);
    p.shutdown().await;
    println!(
        "tls: 20/20 served over h2 with the test CA; untrusted: 502 tls, 3 handshakes refused, 0 requests handled"
    );
}

#[tokio::test]
async fn an_upstream_that_requires_a_client_certificate_takes_the_proxys() {
    let pki = pki();
    let up =
        version_upstream(Serve { tls: Some(pki.server_config(true)), ..Serve::default() }).await;
    let caller: Caller = Client::builder(TokioExecutor::new()).build_http();
    let url = format!("https://localhost:{}", up.addr.port());

    let mut d = dep(&url);
    d.tls.ca_file = Some(pki.ca_pem.clone());
    d.tls.client_cert = Some(pki.client_cert.clone());
    d.tls.client_key = Some(pki.client_key.clone());
    let p = proxy(d.clone()).await;
    let a = send(&caller, "GET", format!("http://{}/", p.listen_addrs()[0])).await;
    assert_eq!(a.status, StatusCode::OK);
    assert_eq!(Counts::get(&up.counts.handled), 1);
    p.shutdown().await;

    // Without it the upstream refuses the connection: nothing is handled.
    d.tls.client_cert = None;
    d.tls.client_key = None;
    let p = proxy(d).await;
    let a = send(&caller, "GET", format!("http://{}/", p.listen_addrs()[0])).await;
    assert_eq!(a.status, StatusCode::BAD_GATEWAY);
    assert_eq!(Counts::get(&up.counts.handled), 1);
    assert!(Counts::get(&up.counts.tls_failures) >= 1);
    assert!(up.counts.in_flight.load(Ordering::SeqCst) == 0);
    p.shutdown().await;
}

#[test]
fn tls_files_are_checked_when_the_config_is_loaded() {
    let pki = pki();
    let config = |tls: &str| {
        format!(
            "[[listener]]\nlisten = \"127.0.0.1:0\"\ndependency = \"pay\"\n\n[[dependency]]\nname = \"pay\"\n\
             upstreams = [\"https://localhost:8443\"]\n\n[dependency.tls]\n{tls}"
        )
    };
    let err = |tls: &str| ProxyConfig::parse(&config(tls), "s.toml").unwrap_err().to_string();
    let path = |p: &std::path::Path| p.display().to_string();
    let ok = format!(
        "ca_file = {:?}\nclient_cert = {:?}\nclient_key = {:?}\n",
        path(&pki.ca_pem),
        path(&pki.client_cert),
        path(&pki.client_key)
    );
    let c = ProxyConfig::parse(&config(&ok), "s.toml").unwrap();
    assert_eq!(c.dependencies[0].tls.ca_file.as_deref(), Some(pki.ca_pem.as_path()));

    let missing = err("ca_file = \"/nonexistent/ca.pem\"\n");
    assert!(
        missing.starts_with("s.toml:10:11: dependency[0].tls.ca_file: /nonexistent/ca.pem: "),
        "{missing}"
    );
    let not_pem = pki.dir.join("garbage.pem");
    std::fs::write(&not_pem, "not a certificate\n").unwrap();
    let garbage = err(&format!("ca_file = {:?}\n", path(&not_pem)));
    assert!(garbage.starts_with("s.toml:10:11: dependency[0].tls.ca_file: "), "{garbage}");
    assert!(garbage.contains("no certificate"), "{garbage}");
    let half = err(&format!("client_cert = {:?}\n", path(&pki.client_cert)));
    assert_eq!(half, "s.toml:10:15: dependency[0].tls.client_cert: client_cert needs client_key");
    // A key that is not the certificate's.
    let wrong = err(&format!(
        "client_cert = {:?}\nclient_key = {:?}\n",
        path(&pki.client_cert),
        path(&pki.ca_pem)
    ));
    assert!(wrong.starts_with("s.toml:11:14: dependency[0].tls.client_key: "), "{wrong}");
    // TLS settings on a plaintext dependency are a mistake, not silently ignored.
    let plain = config(&format!("ca_file = {:?}\n", path(&pki.ca_pem)))
        .replace("https://localhost:8443", "http://localhost:8080");
    let e = ProxyConfig::parse(&plain, "s.toml").unwrap_err().to_string();
    assert!(
        e.contains("dependency[0].tls: [dependency.tls] applies to https:// upstreams only"),
        "{e}"
    );
}

/// `deploy/examples/payments-https.toml` is a valid config (`stormguard check-config` reads it
/// with `ProxyConfig::load`); its CA file is swapped for the test CA so the check does not
/// depend on this machine's certificate store.
#[test]
fn the_https_example_config_is_valid() {
    let pki = pki();
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../deploy/examples/payments-https.toml");
    let text = std::fs::read_to_string(path).unwrap();
    assert!(text.contains("\"/etc/ssl/certs/ca-certificates.crt\""));
    let text =
        text.replace("/etc/ssl/certs/ca-certificates.crt", &pki.ca_pem.display().to_string());
    let c = ProxyConfig::parse(&text, "payments-https.toml").unwrap();
    let d = &c.dependencies[0];
    assert_eq!(d.upstreams[0].scheme_str(), Some("https"));
    assert_eq!(d.tls.ca_file.as_deref(), Some(pki.ca_pem.as_path()));
}
