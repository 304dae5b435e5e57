//! The pool: connections checked out under the dependency's cap, transactions run through its
//! closure API.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use stormguard_core::plan::PlanError;
use stormguard_tower::Dependency;
use stormguard_tower::call::CallError;
use tokio_postgres::{Client, IsolationLevel, NoTls, Transaction};

use crate::classify::{Error, classify};

/// The pool size of each instance of a fleet: `floor((max_connections − reserve) / instances)`,
/// the mission's sizing across the whole deployment (core's [`per_instance`]); give it to the
/// dependency as its cap. `plan --server-limit --reserve --instances` prints the same.
///
/// [`per_instance`]: stormguard_core::plan::per_instance
pub fn pool_size(max_connections: u64, reserve: u64, instances: u64) -> Result<u64, PlanError> {
    stormguard_core::plan::per_instance(max_connections, reserve, instances)
}

/// A pool that cannot be made.
#[derive(Debug, thiserror::Error)]
pub enum PoolError {
    /// A transaction is never hedged: a second copy of a write beside the first is a double
    /// write, and a read-only one holds a second connection for nothing a pool can use.
    #[error("dependency `{0}` hedges: a database pool's transactions are never hedged")]
    Hedge(String),
}

/// How one transaction runs.
#[derive(Debug, Clone, Copy, Default)]
pub struct TransactionOptions {
    /// Running it twice is harmless (default `false`). A transaction that is not idempotent is
    /// retried only after a failure that provably committed nothing (contention, a lost
    /// connection before `COMMIT`); one whose `COMMIT` was lost is not.
    pub idempotent: bool,
    /// The whole transaction's deadline, retries included; each attempt's timeout ends at it.
    pub deadline: Option<Duration>,
    /// The isolation level (default: the server's).
    pub isolation: Option<IsolationLevel>,
}

/// A PostgreSQL pool under a stormguard dependency. Cheap to clone; clones share the
/// connections and the dependency. See the [crate docs](crate).
#[derive(Clone)]
pub struct Pool {
    inner: Arc<Inner>,
}

struct Inner {
    dep: Dependency,
    config: tokio_postgres::Config,
    /// Connections not in use. With every checkout under a slot of the cap, there are never
    /// more connections than the cap in use; the idle ones are kept up to the cap.
    idle: Mutex<Vec<Client>>,
}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pool")
            .field("dependency", &self.inner.dep.name())
            .field("size", &self.size())
            .finish_non_exhaustive()
    }
}

impl Pool {
    /// A pool of `config`'s database under `dependency`: its cap is the pool's size. Connections
    /// are opened as transactions need them, under the cap.
    pub fn new(config: tokio_postgres::Config, dependency: Dependency) -> Result<Pool, PoolError> {
        if dependency.config().retry.hedge.is_some() {
            return Err(PoolError::Hedge(dependency.name().to_owned()));
        }
        let idle = Mutex::new(Vec::new());
        Ok(Pool { inner: Arc::new(Inner { dep: dependency, config, idle }) })
    }

    /// The dependency: its counters, histograms (the pool wait and the execution) and metrics.
    pub fn dependency(&self) -> &Dependency {
        &self.inner.dep
    }

    /// The pool's size: the dependency's cap.
    pub fn size(&self) -> u64 {
        self.inner.dep.config().limiter.cap
    }

    /// Runs `f` in a transaction, with the default options (not idempotent).
    pub async fn transaction<T, F>(&self, f: F) -> Result<T, CallError<Error>>
    where
        F: AsyncFnMut(&Transaction<'_>) -> Result<T, tokio_postgres::Error>,
    {
        self.transaction_with(TransactionOptions::default(), f).await
    }

    /// Runs `f` in a transaction: each attempt waits for a slot of the cap (the pool wait),
    /// checks out a connection, begins, runs `f`, and commits; a transient failure is retried
    /// under the budget in a fresh transaction ([`classify`]).
    pub async fn transaction_with<T, F>(
        &self,
        options: TransactionOptions,
        f: F,
    ) -> Result<T, CallError<Error>>
    where
        F: AsyncFnMut(&Transaction<'_>) -> Result<T, tokio_postgres::Error>,
    {
        // One attempt at a time uses the closure (a pool never hedges, so none waits here).
        let f = tokio::sync::Mutex::new(f);
        let mut call = self
            .inner
            .dep
            .call(|_| self.attempt(&f, options.isolation))
            .classify(classify)
            .idempotent(options.idempotent)
            .name("transaction");
        if let Some(d) = options.deadline {
            call = call.deadline(d);
        }
        call.run().await
    }

    /// One attempt, under its slot: a connection, `BEGIN`, the caller's statements, `COMMIT`.
    async fn attempt<T, F>(
        &self,
        f: &tokio::sync::Mutex<F>,
        isolation: Option<IsolationLevel>,
    ) -> Result<T, Error>
    where
        F: AsyncFnMut(&Transaction<'_>) -> Result<T, tokio_postgres::Error>,
    {
        let mut client = self.checkout().await?;
        let mut f = f.lock().await;
        let result: Result<T, Error> = async {
            let mut begin = client.build_transaction();
            if let Some(i) = isolation {
                begin = begin.isolation_level(i);
            }
            let tx = begin.start().await.map_err(Error::Query)?;
            let value = (*f)(&tx).await.map_err(Error::Query)?;
            tx.commit().await.map_err(Error::Commit)?;
            Ok(value)
        }
        .await;
        // A connection whose session is intact goes back (a failed transaction was rolled back
        // as it was dropped: the ROLLBACK is queued before anything the next user sends); one
        // PostgreSQL ended, or that failed below SQL, does not.
        let intact = match &result {
            Ok(_) => true,
            Err(e) => !e.session_lost(),
        };
        if intact && !client.is_closed() {
            self.give_back(client);
        }
        result
    }

    /// An idle connection, or a new one.
    async fn checkout(&self) -> Result<Client, Error> {
        loop {
            let idle = self.inner.idle.lock().unwrap_or_else(|e| e.into_inner()).pop();
            match idle {
                Some(c) if c.is_closed() => continue,
                Some(c) => return Ok(c),
                None => break,
            }
        }
        let (client, connection) =
            self.inner.config.connect(NoTls).await.map_err(Error::Connect)?;
        let name = self.inner.dep.name().to_owned();
        // The connection's task ends when its client is dropped (or the server ends it).
        tokio::spawn(async move {
            if let Err(e) = connection.await {
                tracing::debug!(dependency = name, error = %e, "a PostgreSQL connection ended");
            }
        });
        Ok(client)
    }

    fn give_back(&self, client: Client) {
        let mut idle = self.inner.idle.lock().unwrap_or_else(|e| e.into_inner());
        if (idle.len() as u64) < self.size() {
            idle.push(client);
        }
    }
}
