//! The leak check: what `pg_stat_activity` says of a database's connections, sampled over a
//! window.
//!
//! "A high count of connections in `idle in transaction` is a hallmark of holding a connection
//! across a slow external call … a count that climbs steadily and never drops is a leak, not a
//! budget problem." The check samples `pg_stat_activity` every `every` for `window` and
//! reports, per application (`application_name`):
//!
//! - connections by state (`active`, `idle`, `idle in transaction`, …) at the last sample;
//! - **stuck** transactions: `idle in transaction` (or aborted) for longer than the threshold,
//!   with their pid, how long, and their last statement;
//! - **climbing**: the application's `idle in transaction` count never dropped from one sample
//!   to the next and ended at least [`CLIMB`] higher than it began (three samples at least) — a
//!   pool's idle connections warming up are no leak, so only open transactions count;
//! - **hidden** connections: a role without `pg_read_all_stats` (or `pg_monitor`) sees other
//!   roles' sessions without their state, so it cannot tell a leak; their count is reported, and
//!   `db-check` refuses to call such a database clean (grant `pg_monitor` to the checker).
//!
//! A report with either finding is a leak ([`Report::leaks`]); `stormguard db-check` exits 1.

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use tokio_postgres::Client;

/// What to check.
#[derive(Debug, Clone)]
pub struct LeakCheck {
    /// An `idle in transaction` connection older than this is stuck (default 10 s).
    pub idle_in_transaction: Duration,
    /// How long to sample for (default 30 s; zero: one sample).
    pub window: Duration,
    /// How often to sample (default 5 s).
    pub every: Duration,
    /// Only this application's connections (default: all but the checker's own).
    pub application: Option<String>,
}

impl Default for LeakCheck {
    fn default() -> Self {
        LeakCheck {
            idle_in_transaction: Duration::from_secs(10),
            window: Duration::from_secs(30),
            every: Duration::from_secs(5),
            application: None,
        }
    }
}

/// A transaction left open.
#[derive(Debug, Clone, PartialEq)]
pub struct Stuck {
    /// The backend's pid (`pg_terminate_backend` takes it).
    pub pid: i32,
    /// Its `application_name`.
    pub application: String,
    /// How long it has been idle in its transaction.
    pub idle_for: Duration,
    /// Its last statement (cut at 200 characters).
    pub query: String,
}

/// How much an application's open transactions must have risen, never dropping, to be
/// climbing: one more could be a transaction caught between two statements at the last sample.
pub const CLIMB: u64 = 2;

/// One application's connections over the window.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Application {
    /// Connections by state at the last sample.
    pub by_state: BTreeMap<String, u64>,
    /// The `idle in transaction` count at each sample.
    pub idle_in_transaction: Vec<u64>,
    /// How long its longest `idle in transaction` had been idle at the last sample.
    pub longest_idle_in_transaction: Duration,
}

impl Application {
    /// Whether its open transactions climbed and never dropped (see the [module docs](self)).
    pub fn climbing(&self) -> bool {
        let c = &self.idle_in_transaction;
        c.len() >= 3 && c.windows(2).all(|w| w[1] >= w[0]) && c[c.len() - 1] >= c[0] + CLIMB
    }
}

/// What the check found.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Report {
    /// Per application, by name.
    pub applications: BTreeMap<String, Application>,
    /// The transactions stuck at the last sample, longest first.
    pub stuck: Vec<Stuck>,
    /// Samples taken.
    pub samples: u32,
    /// The threshold the stuck ones passed.
    pub threshold: Duration,
    /// Connections at the last sample whose state this role may not see.
    pub hidden: u64,
}

impl Report {
    /// Whether anything leaks: a stuck transaction, or an application whose open transactions
    /// climbed.
    pub fn leaks(&self) -> bool {
        !self.stuck.is_empty() || self.applications.values().any(Application::climbing)
    }
}

/// The name the checker's own connection goes by, so it never counts itself.
pub const CHECKER: &str = "stormguard db-check";

/// Samples `pg_stat_activity` over `check.window` on `client`, and reports.
pub async fn check(client: &Client, check: &LeakCheck) -> Result<Report, tokio_postgres::Error> {
    client.batch_execute(&format!("SET application_name = '{CHECKER}'")).await?;
    let mut report = Report { threshold: check.idle_in_transaction, ..Report::default() };
    let start = tokio::time::Instant::now();
    loop {
        sample(client, check, &mut report).await?;
        if start.elapsed() + check.every > check.window || check.every.is_zero() {
            break;
        }
        tokio::time::sleep(check.every).await;
    }
    Ok(report)
}

async fn sample(
    client: &Client,
    check: &LeakCheck,
    report: &mut Report,
) -> Result<(), tokio_postgres::Error> {
    // Client backends of this database only (not the server's own workers), never the checker.
    let rows = client
        .query(
            "SELECT pid, coalesce(application_name, ''), state, \
                    coalesce(extract(epoch FROM now() - state_change), 0)::float8, \
                    left(coalesce(query, ''), 200) \
             FROM pg_stat_activity \
             WHERE backend_type = 'client backend' AND datname = current_database() \
               AND pid <> pg_backend_pid() AND application_name <> $1 \
               AND ($2::text IS NULL OR application_name = $2)",
            &[&CHECKER, &check.application],
        )
        .await?;
    report.samples += 1;
    for app in report.applications.values_mut() {
        app.by_state.clear();
        app.idle_in_transaction.push(0);
        app.longest_idle_in_transaction = Duration::ZERO;
    }
    report.stuck.clear();
    report.hidden = 0;
    let seen = report.samples as usize;
    for row in rows {
        let (pid, application): (i32, String) = (row.get(0), row.get(1));
        let Some(state) = row.get::<_, Option<String>>(2) else {
            // Another role's session, its state withheld from this one.
            report.hidden += 1;
            continue;
        };
        let idle_for = Duration::from_secs_f64(row.get::<_, f64>(3).max(0.0));
        let app = report.applications.entry(application.clone()).or_default();
        // An application first seen now had none open at the samples before.
        app.idle_in_transaction.resize(seen, 0);
        *app.by_state.entry(state.clone()).or_default() += 1;
        if state.starts_with("idle in transaction") {
            *app.idle_in_transaction.last_mut().expect("one per sample") += 1;
            app.longest_idle_in_transaction = app.longest_idle_in_transaction.max(idle_for);
            if idle_for > check.idle_in_transaction {
                report.stuck.push(Stuck { pid, application, idle_for, query: row.get(4) });
            }
        }
    }
    report.stuck.sort_by_key(|s| std::cmp::Reverse(s.idle_for));
    Ok(())
}

/// The leak check beside a pool: a task samples `pg_stat_activity` every `check.every`, for as
/// long as the watch lives, and keeps the report of the last `check.window` (the climbing
/// trend over its samples); [`Watch::register`] exports it as metrics:
///
/// | metric | labels | value |
/// | --- | --- | --- |
/// | `stormguard_db_connections` | `application`, `state` | connections at the last sample |
/// | `stormguard_db_idle_in_transaction_longest_seconds` | `application` | how long its longest open, idle transaction has waited |
/// | `stormguard_db_stuck_transactions` | `application` | open transactions idle past the threshold |
/// | `stormguard_db_leak` | `application` | 1 when it has a stuck transaction or its open transactions climbed over the window |
///
/// A sample that fails is a log line (`warn`), and the last report stands.
#[derive(Debug)]
pub struct Watch {
    latest: std::sync::Arc<std::sync::Mutex<Report>>,
    task: tokio::task::JoinHandle<()>,
}

impl Watch {
    /// Starts sampling on `client` (a connection of its own: the checker's name is set on it).
    pub fn spawn(client: Client, check: LeakCheck) -> Watch {
        let latest = std::sync::Arc::new(std::sync::Mutex::new(Report {
            threshold: check.idle_in_transaction,
            ..Report::default()
        }));
        let keep = latest.clone();
        let task = tokio::spawn(async move {
            let named = client.batch_execute(&format!("SET application_name = '{CHECKER}'")).await;
            if let Err(e) = named {
                tracing::warn!(error = %e, "the leak check could not name its connection");
            }
            // The samples the window holds: the trend is read over the last ones.
            let every = check.every.max(Duration::from_millis(10));
            let kept = (check.window.as_nanos() / every.as_nanos()).max(3) as usize;
            let mut report = keep.lock().unwrap_or_else(|e| e.into_inner()).clone();
            loop {
                match sample(&client, &check, &mut report).await {
                    Ok(()) => {
                        report.applications.retain(|_, app| {
                            let n = app.idle_in_transaction.len();
                            app.idle_in_transaction.drain(..n.saturating_sub(kept));
                            !app.by_state.is_empty()
                                || app.idle_in_transaction.iter().any(|c| *c > 0)
                        });
                        report.samples = report.samples.min(kept as u32);
                        *keep.lock().unwrap_or_else(|e| e.into_inner()) = report.clone();
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "the leak check could not read pg_stat_activity")
                    }
                }
                tokio::time::sleep(every).await;
            }
        });
        Watch { latest, task }
    }

    /// The report as of the last sample.
    pub fn report(&self) -> Report {
        self.latest.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Exports the report on `registry` at each scrape (see the [type docs](Watch)).
    pub fn register(&self, registry: &mut prometheus_client::registry::Registry) {
        registry.register_collector(Box::new(Collector { latest: self.latest.clone() }));
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        self.task.abort();
    }
}

#[derive(Debug)]
struct Collector {
    latest: std::sync::Arc<std::sync::Mutex<Report>>,
}

impl prometheus_client::collector::Collector for Collector {
    fn encode(&self, mut enc: prometheus_client::encoding::DescriptorEncoder) -> std::fmt::Result {
        use stormguard_tower::metrics::{LabelValue, gauge};
        let report = self.latest.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let app = |name: &str| if name.is_empty() { "(none)".to_owned() } else { name.to_owned() };
        let names: Vec<(String, &Application)> =
            report.applications.iter().map(|(n, a)| (app(n), a)).collect();
        let mut connections = Vec::new();
        for (name, a) in &names {
            for (state, n) in &a.by_state {
                let labels = vec![("application", LabelValue(name)), ("state", LabelValue(state))];
                connections.push((labels, *n as f64));
            }
        }
        gauge(
            &mut enc,
            "stormguard_db_connections",
            "Connections by application and state (pg_stat_activity).",
            &connections,
        )?;
        let per_app = |f: &dyn Fn(&str, &Application) -> f64| -> Vec<_> {
            report
                .applications
                .iter()
                .zip(&names)
                .map(|((raw, a), (name, _))| (vec![("application", LabelValue(name))], f(raw, a)))
                .collect()
        };
        let stuck = |raw: &str| report.stuck.iter().filter(|s| s.application == raw).count();
        gauge(
            &mut enc,
            "stormguard_db_idle_in_transaction_longest_seconds",
            "How long the application's longest open, idle transaction has waited.",
            &per_app(&|_, a| a.longest_idle_in_transaction.as_secs_f64()),
        )?;
        gauge(
            &mut enc,
            "stormguard_db_stuck_transactions",
            "Open transactions idle past the leak check's threshold.",
            &per_app(&|raw, _| stuck(raw) as f64),
        )?;
        gauge(
            &mut enc,
            "stormguard_db_leak",
            "1 when the application has a stuck transaction, or its open transactions climbed over the window.",
            &per_app(&|raw, a| f64::from(u8::from(stuck(raw) > 0 || a.climbing()))),
        )
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "connections by application and state ({} samples):", self.samples)?;
        if self.applications.is_empty() {
            writeln!(f, "  none")?;
        }
        for (name, app) in &self.applications {
            let name = if name.is_empty() { "(no application_name)" } else { name };
            let states: Vec<String> =
                app.by_state.iter().map(|(s, n)| format!("{s} {n}")).collect();
            let states = if states.is_empty() { "none now".into() } else { states.join(", ") };
            writeln!(f, "  {name}: {states}")?;
            if app.climbing() {
                let counts: Vec<String> =
                    app.idle_in_transaction.iter().map(u64::to_string).collect();
                writeln!(
                    f,
                    "    LEAK: open transactions climbed and never dropped: {}",
                    counts.join(" → ")
                )?;
            }
        }
        if self.hidden > 0 {
            writeln!(
                f,
                "WARNING: {} connections of other roles hidden (no pg_read_all_stats): grant pg_monitor to this role, or nothing can be said of them",
                self.hidden
            )?;
        }
        if self.stuck.is_empty() {
            writeln!(f, "no transaction idle for more than {:?}", self.threshold)?;
        } else {
            writeln!(
                f,
                "LEAK: {} idle in transaction for more than {:?}:",
                self.stuck.len(),
                self.threshold
            )?;
            for s in &self.stuck {
                writeln!(
                    f,
                    "  pid {} ({}): {:.1} s, last: {}",
                    s.pid,
                    s.application,
                    s.idle_for.as_secs_f64(),
                    s.query.replace('\n', " ")
                )?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_count_that_climbs_and_never_drops_is_a_leak_and_one_that_drops_is_not() {
        let app = |c: &[u64]| Application { idle_in_transaction: c.to_vec(), ..Default::default() };
        assert!(app(&[0, 1, 1, 2]).climbing());
        assert!(!app(&[0, 0, 0, 1]).climbing(), "one more: a transaction between statements");
        assert!(!app(&[0, 2, 1, 2]).climbing(), "it dropped");
        assert!(!app(&[2, 2, 2]).climbing(), "flat");
        assert!(!app(&[0, 1]).climbing(), "too few samples");
    }
}
