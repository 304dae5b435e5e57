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
}

impl RedisProcess {
    /// Starts one on a free loopback port and waits (up to 10 s) until it accepts connections.
    ///
    /// # Panics
    /// When `redis-server` is not installed or does not start: the fleet tests need a real one.
    pub fn start() -> RedisProcess {
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("a free loopback port");
        let mut r = RedisProcess { child: None, port };
        r.spawn();
        r
    }

    fn spawn(&mut self) {
        let child = Command::new("redis-server")
            .args(["--port", &self.port.to_string(), "--bind", "127.0.0.1", "--save", ""])
            .args(["--appendonly", "no", "--protected-mode", "yes", "--loglevel", "warning"])
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

    /// `redis://127.0.0.1:PORT/0` as a target.
    pub fn target(&self) -> RedisTarget {
        RedisTarget { host: "127.0.0.1".into(), port: self.port, user: None, password: None, db: 0 }
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
    }
}
