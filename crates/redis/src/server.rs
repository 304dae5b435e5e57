//! A throwaway `redis-server` for tests, demos and benchmarks: loopback only, an ephemeral
//! port, no persistence, killed on drop.
//!
//! It runs the real server (the Debian package `redis-server`; `scripts/test` installs it when
//! missing), because what the fleet relies on — Lua, `TIME`, data loss on restart — is the
//! server's behaviour, not a mock's.

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::resp::RedisTarget;

/// A running `redis-server`.
#[derive(Debug)]
pub struct RedisProcess {
    child: Option<Child>,
    port: u16,
    /// Extra arguments it is started with (TLS, cluster mode).
    args: Vec<String>,
}

/// A TLS listener's files, for [`RedisProcess::start_tls`].
#[derive(Debug, Clone)]
pub struct ServerTls {
    /// The server's certificate chain (PEM).
    pub cert: std::path::PathBuf,
    /// Its private key (PEM).
    pub key: std::path::PathBuf,
    /// The CA client certificates are checked against (PEM).
    pub ca: std::path::PathBuf,
    /// Whether a client must present a certificate signed by `ca`.
    pub require_client_cert: bool,
}

impl RedisProcess {
    /// Starts one on a free loopback port and waits (up to 10 s) until it accepts connections.
    ///
    /// # Panics
    /// When `redis-server` is not installed or does not start: the fleet tests need a real one.
    pub fn start() -> RedisProcess {
        RedisProcess::start_with(Vec::new())
    }

    /// Starts one that speaks only TLS (`--port 0 --tls-port PORT`) with `tls`'s files.
    pub fn start_tls(tls: &ServerTls) -> RedisProcess {
        let path = |p: &std::path::Path| p.display().to_string();
        let auth = if tls.require_client_cert { "yes" } else { "no" };
        RedisProcess::start_with(vec![
            "--tls-cert-file".into(),
            path(&tls.cert),
            "--tls-key-file".into(),
            path(&tls.key),
            "--tls-ca-cert-file".into(),
            path(&tls.ca),
            "--tls-auth-clients".into(),
            auth.into(),
            "--tls-port".into(),
            String::new(),
        ])
    }

    /// Starts one in cluster mode (`--cluster-enabled yes`, its node file in the temp dir);
    /// joining nodes into a cluster is the caller's (`redis-cli --cluster create`).
    pub fn start_cluster_node() -> RedisProcess {
        RedisProcess::start_with(vec!["--cluster-enabled".into(), "yes".into()])
    }

    fn start_with(args: Vec<String>) -> RedisProcess {
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("a free loopback port");
        let mut r = RedisProcess { child: None, port, args };
        r.spawn();
        r
    }

    fn spawn(&mut self) {
        let port = self.port.to_string();
        let tls = self.args.iter().any(|a| a == "--tls-port");
        // With TLS the plain port is off and the TLS one is ours (the empty value after
        // `--tls-port` is filled here); a cluster node keeps its node file apart.
        let args: Vec<String> =
            self.args.iter().map(|a| if a.is_empty() { port.clone() } else { a.clone() }).collect();
        let cluster = args.iter().any(|a| a == "--cluster-enabled");
        let node_file = std::env::temp_dir().join(format!(
            "stormguard-redis-nodes-{}-{}.conf",
            std::process::id(),
            self.port
        ));
        let mut cmd = Command::new("redis-server");
        cmd.args(["--port", if tls { "0" } else { &port }, "--bind", "127.0.0.1", "--save", ""])
            .args(["--appendonly", "no", "--protected-mode", "yes", "--loglevel", "warning"])
            .args(&args);
        if cluster {
            let _ = std::fs::remove_file(&node_file);
            cmd.arg("--cluster-config-file").arg(&node_file);
        }
        let child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| {
                panic!(
                    "cannot run redis-server ({e}): the fleet tests need a real Redis. \
                     Install it with `apt-get install redis-server` (scripts/test does this when it is missing)"
                )
            });
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        while TcpStream::connect(self.addr()).is_err() {
            assert!(
                Instant::now() < deadline,
                "redis-server did not listen on {} within 10 s",
                self.addr()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Its address.
    pub fn addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.port))
    }

    /// Its port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `redis://127.0.0.1:PORT/0` as a target.
    pub fn target(&self) -> RedisTarget {
        RedisTarget::plain("127.0.0.1", self.port)
    }

    /// Kills it (SIGKILL): connections drop, its data is gone.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts it again on the same port, empty.
    pub fn restart(&mut self) {
        self.kill();
        self.spawn();
    }
}

impl Drop for RedisProcess {
    fn drop(&mut self) {
        self.kill();
        // A cluster node's file, if it was one.
        let _ = std::fs::remove_file(std::env::temp_dir().join(format!(
            "stormguard-redis-nodes-{}-{}.conf",
            std::process::id(),
            self.port
        )));
    }
}
