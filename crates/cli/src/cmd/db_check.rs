//! `stormguard db-check`: the leak check of a PostgreSQL database (stormguard-postgres's
//! [`leak`](stormguard_postgres::leak)): connections by state and application from
//! `pg_stat_activity`, transactions left `idle in transaction` past a threshold, and open
//! transactions that climb over a window. Exit 0 when clean, 1 when something leaks (for CI),
//! 2 for bad flags or a database that cannot be read.

use std::io::Write;
use std::time::Duration;

use clap::Args;
use stormguard_postgres::leak::{LeakCheck, check};

use crate::Failure;

/// Flags of `stormguard db-check`.
#[derive(Debug, Args)]
#[command(after_help = "\
Exit status: 0 clean, 1 a leak (a transaction idle past the threshold, or open transactions
that climbed and never dropped over the window), 2 bad flags, a database that could not be read,
or one whose other roles' sessions this role may not see (grant it pg_monitor).

Example (sample for a minute, every 5 s; a transaction open and idle for 30 s is a leak):
  stormguard db-check 'host=db.internal user=monitor dbname=orders' --window 60s --idle-in-transaction 30s")]
pub struct DbCheckArgs {
    /// The database: a libpq connection string (`host=… user=… dbname=…`) or URL
    /// (`postgres://user@host/db`). The checker's own connection is not counted.
    #[arg(value_name = "CONNECTION")]
    pub connection: String,
    /// A transaction idle this long inside `BEGIN` is stuck.
    #[arg(long, value_name = "DURATION", default_value = "10s", value_parser = crate::args::duration)]
    pub idle_in_transaction: Duration,
    /// How long to sample for (0s: one sample, no trend).
    #[arg(long, value_name = "DURATION", default_value = "30s", value_parser = crate::args::duration)]
    pub window: Duration,
    /// How often to sample within the window.
    #[arg(long, value_name = "DURATION", default_value = "5s", value_parser = crate::args::duration)]
    pub every: Duration,
    /// Only this `application_name`'s connections.
    #[arg(long, value_name = "NAME")]
    pub application: Option<String>,
}

/// Runs the check and prints the report.
pub fn run(args: &DbCheckArgs, out: &mut dyn Write) -> Result<(), Failure> {
    let config: tokio_postgres::Config = args
        .connection
        .parse()
        .map_err(|e| Failure::usage(format!("the connection string does not parse: {e}")))?;
    let leak = LeakCheck {
        idle_in_transaction: args.idle_in_transaction,
        window: args.window,
        every: args.every,
        application: args.application.clone(),
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| Failure::runtime(format!("could not start the runtime: {e}")))?;
    let report = runtime.block_on(async {
        let (client, connection) = config
            .connect(tokio_postgres::NoTls)
            .await
            .map_err(|e| Failure::usage(format!("could not connect to the database: {e}")))?;
        let conn = tokio::spawn(connection);
        let report = check(&client, &leak)
            .await
            .map_err(|e| Failure::usage(format!("could not read pg_stat_activity: {e}")));
        drop(client);
        let _ = conn.await;
        report
    })?;
    write!(out, "{report}")?;
    if report.leaks() {
        return Err(Failure::runtime("a leak: see the report above"));
    }
    if report.hidden > 0 {
        return Err(Failure::usage(format!(
            "{} connections of other roles are hidden from this role: grant it pg_monitor to check them",
            report.hidden
        )));
    }
    Ok(())
}
