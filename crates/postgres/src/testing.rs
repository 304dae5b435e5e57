//! A throwaway PostgreSQL cluster for tests: `initdb` into a fresh directory, a server on a free
//! loopback port (no Unix socket), stopped and removed when dropped. Debian's `postgresql`
//! package provides the binaries (`scripts/test` installs it when missing); set
//! `STORMGUARD_PG_BIN` to use others. Run as root, the server runs as the `postgres` user (it
//! refuses root), through `runuser`.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};

/// A running cluster. Dropping it stops the server (`pg_ctl stop -m immediate`) and removes its
/// directory.
#[derive(Debug)]
pub struct Cluster {
    dir: PathBuf,
    bin: PathBuf,
    port: u16,
}

/// Why a cluster could not start.
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    /// No PostgreSQL server binaries.
    #[error(
        "no PostgreSQL server binaries (initdb, pg_ctl): install Debian's postgresql package \
         (scripts/test does) or set STORMGUARD_PG_BIN"
    )]
    NoBinaries,
    /// A step failed.
    #[error("{step} failed: {detail}")]
    Step {
        /// Which.
        step: &'static str,
        /// What it said.
        detail: String,
    },
}

fn step(step: &'static str, detail: impl ToString) -> ClusterError {
    ClusterError::Step { step, detail: detail.to_string() }
}

/// The directory with `initdb` and `pg_ctl`.
fn binaries() -> Result<PathBuf, ClusterError> {
    if let Some(dir) = std::env::var_os("STORMGUARD_PG_BIN") {
        return Ok(PathBuf::from(dir));
    }
    // Debian's layout: the newest version under /usr/lib/postgresql.
    let mut versions: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .map_err(|_| ClusterError::NoBinaries)?
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let v = e.file_name().to_str()?.parse().ok()?;
            let bin = e.path().join("bin");
            bin.join("initdb").exists().then_some((v, bin))
        })
        .collect();
    versions.sort();
    versions.pop().map(|(_, bin)| bin).ok_or(ClusterError::NoBinaries)
}

/// Whether this process runs as root (`id -u`).
fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
}

/// `program` with `args`, as the `postgres` user when this process is root.
fn as_server_user(program: &Path) -> Command {
    if is_root() {
        let mut c = Command::new("runuser");
        c.args(["-u", "postgres", "--"]).arg(program);
        c
    } else {
        Command::new(program)
    }
}

fn run(step_name: &'static str, mut c: Command) -> Result<(), ClusterError> {
    let out = c.stdin(Stdio::null()).output().map_err(|e| step(step_name, e))?;
    if !out.status.success() {
        let detail = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        return Err(step(step_name, detail));
    }
    Ok(())
}

impl Cluster {
    /// Starts a cluster in a new directory under `base` (a test's `CARGO_TARGET_TMPDIR`), with
    /// `max_connections` and the settings `extra` (`name=value`).
    pub fn start(
        base: &Path,
        max_connections: u32,
        extra: &[&str],
    ) -> Result<Cluster, ClusterError> {
        static N: AtomicU32 = AtomicU32::new(0);
        let bin = binaries()?;
        let dir =
            base.join(format!("pg-{}-{}", std::process::id(), N.fetch_add(1, Ordering::Relaxed)));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).map_err(|e| step("mkdir", e))?;
        if is_root() {
            // The server's user owns its directory, and can reach it.
            run("chown", {
                let mut c = Command::new("chown");
                c.args(["-R", "postgres:postgres"]).arg(&dir);
                c
            })?;
            let mut up = dir.parent();
            while let Some(p) = up {
                let _ = Command::new("chmod").arg("o+x").arg(p).status();
                up = p.parent();
            }
        }
        let data = dir.join("data");
        run("initdb", {
            let mut c = as_server_user(&bin.join("initdb"));
            c.args(["-A", "trust", "-U", "postgres", "--no-sync", "-E", "UTF8", "-D"]).arg(&data);
            c
        })?;
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map_err(|e| step("a free port", e))?
            .port();
        let mut options = format!(
            "-c listen_addresses=127.0.0.1 -p {port} -c unix_socket_directories='' \
             -c max_connections={max_connections} -c fsync=off -c synchronous_commit=off \
             -c full_page_writes=off"
        );
        for e in extra {
            options.push_str(" -c ");
            options.push_str(e);
        }
        run("pg_ctl start", {
            let mut c = as_server_user(&bin.join("pg_ctl"));
            c.args(["start", "-w", "-t", "30", "-l"]).arg(dir.join("log")).arg("-D").arg(&data);
            c.args(["-o", &options]);
            c
        })?;
        Ok(Cluster { dir, bin, port })
    }

    /// Its port on 127.0.0.1.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// A connection string for `application` as the `postgres` superuser.
    pub fn url(&self, application: &str) -> String {
        format!(
            "host=127.0.0.1 port={} user=postgres dbname=postgres application_name='{application}'",
            self.port
        )
    }

    /// The server's log so far (for a failing test's message).
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("log")).unwrap_or_default()
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let mut c = as_server_user(&self.bin.join("pg_ctl"));
        c.args(["stop", "-m", "immediate", "-D"]).arg(self.dir.join("data"));
        let _ = c.stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::null()).status();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
