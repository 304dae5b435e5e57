//! The pool against a real PostgreSQL server (a throwaway cluster under target/, on a loopback
//! port), judged where it counts: at the server. Each attempt's transaction calls `work()`,
//! which counts the attempt in a sequence (sequences are not rolled back), reads how many of the
//! test's connections are in flight at the server (`pg_stat_activity`: not idle), sleeps, and
//! fails with SQLSTATE 40001 (a serialization failure) for a share of calls. A second
//! connection samples `pg_stat_activity` beside the load as well. Each guarantee is also run
//! without its protection, to show that it breaks.

use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use stormguard_core::Denied;
use stormguard_postgres::leak::{LeakCheck, check};
use stormguard_postgres::testing::Cluster;
use stormguard_postgres::{Error, Pool, TransactionOptions};
use stormguard_tower::call::CallError;
use stormguard_tower::{Dependency, DependencyConfig};
use tokio::time::Instant;
use tokio_postgres::{Client, NoTls};

const SETUP: &str = "
    CREATE SEQUENCE attempts;
    CREATE FUNCTION work(app text, p float8, ms int) RETURNS int AS $$
    DECLARE n int;
    BEGIN
        PERFORM nextval('attempts');
        SELECT count(*) INTO n FROM pg_stat_activity
            WHERE application_name = app AND state <> 'idle';
        PERFORM pg_sleep(ms / 1000.0);
        IF random() < p THEN
            RAISE EXCEPTION 'in flight %', n USING ERRCODE = '40001';
        END IF;
        RETURN n;
    END $$ LANGUAGE plpgsql;
    CREATE TABLE orders (id int PRIMARY KEY);
";

fn cluster() -> Cluster {
    match Cluster::start(std::path::Path::new(env!("CARGO_TARGET_TMPDIR")), 100, &[]) {
        Ok(c) => c,
        Err(e) => panic!("{e}"),
    }
}

async fn connect(cluster: &Cluster, application: &str) -> Client {
    let (client, connection) =
        tokio_postgres::connect(&cluster.url(application), NoTls).await.unwrap();
    tokio::spawn(connection);
    client
}

/// What the server saw: attempts (from the sequence) and the most of the application's
/// connections in flight at once (the larger of what each attempt read at its start and what
/// the sampler read).
#[derive(Clone, Default)]
struct Seen {
    max_in_flight: Arc<AtomicI64>,
}

impl Seen {
    fn saw(&self, n: i64) {
        self.max_in_flight.fetch_max(n, Ordering::SeqCst);
    }

    /// The in-flight count a `work()` call reports, from its answer or its error's message.
    fn read(&self, result: Result<i32, &tokio_postgres::Error>) {
        match result {
            Ok(n) => self.saw(i64::from(n)),
            Err(e) => {
                let n = e.as_db_error().and_then(|d| d.message().strip_prefix("in flight "));
                if let Some(n) = n.and_then(|n| n.parse().ok()) {
                    self.saw(n);
                }
            }
        }
    }

    /// Samples the application's connections in flight every 2 ms until `stop` is set.
    fn sample(
        &self,
        client: Client,
        application: &str,
        stop: Arc<AtomicI64>,
    ) -> tokio::task::JoinHandle<()> {
        let seen = self.clone();
        let application = application.to_owned();
        tokio::spawn(async move {
            while stop.load(Ordering::SeqCst) == 0 {
                let row = client
                    .query_one(
                        "SELECT count(*) FROM pg_stat_activity \
                         WHERE application_name = $1 AND state <> 'idle'",
                        &[&application],
                    )
                    .await
                    .unwrap();
                seen.saw(row.get(0));
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        })
    }

    fn max(&self) -> i64 {
        self.max_in_flight.load(Ordering::SeqCst)
    }
}

async fn attempts(client: &Client) -> i64 {
    client.query_one("SELECT last_value FROM attempts", &[]).await.unwrap().get(0)
}

/// Open-loop arrivals: one call every `every` for `run`, each on its own task.
async fn open_loop<F, Fut>(every: Duration, run: Duration, call: F) -> u64
where
    F: Fn() -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    let start = Instant::now();
    let mut calls = Vec::new();
    while start.elapsed() < run {
        calls.push(tokio::spawn(call()));
        tokio::time::sleep(every).await;
    }
    let n = calls.len() as u64;
    for c in calls {
        c.await.unwrap();
    }
    n
}

const CAP: u64 = 8;

/// 40 % of transactions fail with a serialization failure, under open-loop load of about six
/// transactions in flight: through the pool, the server never has more than the cap of the
/// test's connections in flight, and the attempts past the first stay within the 20 % budget;
/// a naive retry loop (three retries) over a plain pool of 32 passes both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_database_sees_at_most_the_cap_and_retries_within_the_budget() {
    let cluster = cluster();
    let admin = connect(&cluster, "admin").await;
    admin.batch_execute(SETUP).await.unwrap();
    const EVERY: Duration = Duration::from_millis(4);
    const RUN: Duration = Duration::from_secs(3);

    // Through stormguard.
    let app = "guarded";
    let mut c = DependencyConfig::new("db");
    c.limiter.cap = CAP;
    c.limiter.queue_len = 1_000;
    c.limiter.queue_timeout = Duration::from_secs(5);
    c.budget = "ratio:percent=0.2,min_per_sec=0".parse().unwrap();
    c.retry.max_retries = 3;
    let pool =
        Pool::new(cluster.url(app).parse().unwrap(), Dependency::try_new(c).unwrap()).unwrap();
    let seen = Seen::default();
    let stop = Arc::new(AtomicI64::new(0));
    let sampler = seen.sample(connect(&cluster, "sampler").await, app, stop.clone());
    let outcomes = Arc::new(Mutex::new((0u64, 0u64, 0u64)));
    let (p, s, o) = (pool.clone(), seen.clone(), outcomes.clone());
    let calls = open_loop(EVERY, RUN, move || {
        let (p, s, o) = (p.clone(), s.clone(), o.clone());
        async move {
            let s2 = s.clone();
            let r = p
                .transaction(async move |tx| {
                    let r = tx.query_one("SELECT work($1, 0.4, 20)", &[&"guarded"]).await;
                    s2.read(r.as_ref().map(|row| row.get(0)));
                    r.map(|row| row.get::<_, i32>(0))
                })
                .await;
            let mut o = o.lock().unwrap();
            match r {
                Ok(_) => o.0 += 1,
                Err(CallError::Failed { refused: Some(Denied::Budget), .. }) => o.1 += 1,
                Err(_) => o.2 += 1,
            }
        }
    })
    .await;
    stop.store(1, Ordering::SeqCst);
    sampler.await.unwrap();
    let sent = attempts(&admin).await;
    let retries = sent - calls as i64;
    let (ok, budget, other) = *outcomes.lock().unwrap();
    eprintln!(
        "stormguard: {calls} calls, {sent} attempts at the server ({retries} retries), max {} in flight; ok {ok}, refused by the budget {budget}, other {other}",
        seen.max()
    );
    assert!(
        seen.max() <= CAP as i64,
        "the server had {} in flight, over the cap of {CAP}\n{}",
        seen.max(),
        cluster.log()
    );
    assert!(seen.max() >= 4, "the load reached the server: {}", seen.max());
    assert!(
        (retries as f64) <= 0.2 * calls as f64 + 1.0,
        "{retries} retries for {calls} calls: over the 20 % budget"
    );
    assert!(
        retries > 0 && ok > 0 && budget > 0,
        "retries were sent, and some refused by the budget"
    );

    // A naive loop: three retries on every serialization failure, over a plain pool of 32.
    let app = "naive";
    let naive = Seen::default();
    let mut clients = Vec::new();
    for _ in 0..32 {
        clients.push(connect(&cluster, app).await);
    }
    let plain = Arc::new(tokio::sync::Mutex::new(clients));
    let free = Arc::new(tokio::sync::Semaphore::new(32));
    admin.batch_execute("SELECT setval('attempts', 1, false)").await.unwrap();
    let stop = Arc::new(AtomicI64::new(0));
    let sampler = naive.sample(connect(&cluster, "sampler").await, app, stop.clone());
    let (s, pl, fr) = (naive.clone(), plain.clone(), free.clone());
    let calls = open_loop(EVERY, RUN, move || {
        let (s, pl, fr) = (s.clone(), pl.clone(), fr.clone());
        async move {
            for _ in 0..4 {
                let _slot = fr.acquire().await.unwrap();
                let mut client = pl.lock().await.pop().unwrap();
                let tx = client.transaction().await.unwrap();
                let r = tx.query_one("SELECT work($1, 0.4, 20)", &[&"naive"]).await;
                s.read(r.as_ref().map(|row| row.get(0)));
                let done = r.is_ok();
                if done {
                    tx.commit().await.unwrap();
                } else {
                    tx.rollback().await.unwrap();
                }
                pl.lock().await.push(client);
                if done {
                    break;
                }
            }
        }
    })
    .await;
    stop.store(1, Ordering::SeqCst);
    sampler.await.unwrap();
    let sent = attempts(&admin).await;
    let retries = sent - calls as i64;
    eprintln!(
        "naive: {calls} calls, {sent} attempts ({retries} retries), max {} in flight",
        naive.max()
    );
    assert!(naive.max() > CAP as i64, "the naive loop stayed under the cap: {}", naive.max());
    assert!(
        retries as f64 > 0.4 * calls as f64,
        "the naive loop retried only {retries} of {calls}"
    );
}

/// A transaction that outlives its per-try timeout keeps its slot while the server still runs
/// it: with the hold, the server never has more than the cap in flight; with the hold at zero,
/// the slots come back at each timeout while the server still sleeps, and it passes the cap.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timed_out_transaction_keeps_its_slot_while_the_server_still_runs_it() {
    let cluster = cluster();
    let admin = connect(&cluster, "admin").await;
    admin.batch_execute(SETUP).await.unwrap();
    for hold in [Duration::from_secs(2), Duration::ZERO] {
        let app = if hold.is_zero() { "unheld" } else { "held" };
        let mut c = DependencyConfig::new("db");
        c.limiter.cap = 4;
        c.limiter.queue_len = 1_000;
        c.limiter.queue_timeout = Duration::from_secs(5);
        c.per_try_timeout = Some(Duration::from_millis(50));
        c.timeout_slot_hold = hold;
        let pool =
            Pool::new(cluster.url(app).parse().unwrap(), Dependency::try_new(c).unwrap()).unwrap();
        let seen = Seen::default();
        let stop = Arc::new(AtomicI64::new(0));
        let sampler = seen.sample(connect(&cluster, "sampler").await, app, stop.clone());
        let p = pool.clone();
        let app2 = app.to_owned();
        open_loop(Duration::from_millis(20), Duration::from_millis(600), move || {
            let (p, app) = (p.clone(), app2.clone());
            async move {
                let r = p
                    .transaction(async move |tx| {
                        tx.query_one("SELECT work($1, 0, 400)", &[&app])
                            .await
                            .map(|r| r.get::<_, i32>(0))
                    })
                    .await;
                assert!(
                    matches!(r, Err(CallError::TimedOut { .. } | CallError::Refused(_))),
                    "{r:?}"
                );
            }
        })
        .await;
        // The last ones still run at the server.
        tokio::time::sleep(Duration::from_millis(100)).await;
        stop.store(1, Ordering::SeqCst);
        sampler.await.unwrap();
        eprintln!("hold {hold:?}: max {} in flight at the server", seen.max());
        match hold.is_zero() {
            true => assert!(seen.max() > 4, "no hold, yet the cap held: {}", seen.max()),
            false => assert!(
                seen.max() <= 4,
                "the server had {} in flight, over the cap of 4",
                seen.max()
            ),
        }
    }
}

/// What the classifier says of real failures: a unique violation is the caller's answer, never
/// retried; a transaction that is not idempotent is retried after a serialization failure (it
/// took no effect) and commits once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_constraint_is_final_and_a_serialization_failure_is_retried_once_committed() {
    let cluster = cluster();
    let admin = connect(&cluster, "admin").await;
    admin.batch_execute(SETUP).await.unwrap();
    let mut c = DependencyConfig::new("db");
    c.limiter.cap = 2;
    c.budget = "ratio:percent=0.5,min_per_sec=10".parse().unwrap();
    let pool = Pool::new(cluster.url("classify").parse().unwrap(), Dependency::try_new(c).unwrap())
        .unwrap();
    admin.batch_execute("INSERT INTO orders VALUES (1)").await.unwrap();
    let tries = AtomicI64::new(0);
    let r = pool
        .transaction(async |tx| {
            tries.fetch_add(1, Ordering::SeqCst);
            tx.execute("INSERT INTO orders VALUES (1)", &[]).await
        })
        .await;
    match r {
        Err(CallError::Failed { source: Error::Query(e), refused: None }) => {
            assert_eq!(e.code(), Some(&tokio_postgres::error::SqlState::UNIQUE_VIOLATION))
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(tries.load(Ordering::SeqCst), 1, "a constraint is not retried");

    // A row the caller expected and did not get: no SQLSTATE, and the caller's, not a lost
    // session — answered once, the connection kept.
    let tries = AtomicI64::new(0);
    let r = pool
        .transaction(async |tx| {
            tries.fetch_add(1, Ordering::SeqCst);
            tx.query_one("SELECT 1 WHERE false", &[]).await.map(|_| ())
        })
        .await;
    assert!(matches!(r, Err(CallError::Failed { refused: None, .. })), "{r:?}");
    assert_eq!(tries.load(Ordering::SeqCst), 1, "a missing row is not retried");

    // Fails with 40001 the first time, then inserts: committed once.
    let tries = AtomicI64::new(0);
    let r = pool
        .transaction_with(
            TransactionOptions { idempotent: false, ..Default::default() },
            async |tx| {
                let n = tries.fetch_add(1, Ordering::SeqCst);
                tx.execute("INSERT INTO orders VALUES (2)", &[]).await?;
                let p: f64 = if n == 0 { 1.0 } else { 0.0 };
                tx.query_one("SELECT work('classify', $1, 0)", &[&p]).await?;
                Ok(())
            },
        )
        .await;
    assert!(r.is_ok(), "{r:?}");
    assert_eq!(tries.load(Ordering::SeqCst), 2);
    let n: i64 =
        admin.query_one("SELECT count(*) FROM orders WHERE id = 2", &[]).await.unwrap().get(0);
    assert_eq!(n, 1, "the first attempt's insert was rolled back, the retry's committed");
}

/// The leak check finds a transaction left open past the threshold, and open transactions that
/// climb and never drop; the same database with every transaction closed is clean.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_leak_check_finds_a_transaction_left_open_and_a_clean_run_is_clean() {
    let cluster = cluster();
    let checker = connect(&cluster, "checker").await;
    let quick = LeakCheck {
        idle_in_transaction: Duration::from_millis(300),
        window: Duration::ZERO,
        every: Duration::ZERO,
        application: None,
    };
    // A pool's connections, idle: clean.
    let idle = connect(&cluster, "worker").await;
    idle.batch_execute("SELECT 1").await.unwrap();
    let report = check(&checker, &quick).await.unwrap();
    assert!(!report.leaks(), "{report}");

    // A transaction begun and left open across a slow "external call".
    let leaky = connect(&cluster, "worker").await;
    leaky.batch_execute("BEGIN; SELECT 1").await.unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let report = check(&checker, &quick).await.unwrap();
    assert!(report.leaks(), "{report}");
    assert_eq!(report.stuck.len(), 1, "{report}");
    assert_eq!(report.stuck[0].application, "worker");
    assert!(report.stuck[0].idle_for >= Duration::from_millis(300));
    leaky.batch_execute("COMMIT").await.unwrap();
    let report = check(&checker, &quick).await.unwrap();
    assert!(!report.leaks(), "closed again: {report}");

    // Open transactions that climb (one more every 150 ms) and never drop, none yet past the
    // threshold: a leak by the trend alone.
    let slow = LeakCheck {
        idle_in_transaction: Duration::from_secs(60),
        window: Duration::from_millis(700),
        every: Duration::from_millis(150),
        application: Some("climber".into()),
    };
    let mut held = Vec::new();
    let opener = {
        let url = cluster.url("climber");
        tokio::spawn(async move {
            for _ in 0..6 {
                let (c, conn) = tokio_postgres::connect(&url, NoTls).await.unwrap();
                tokio::spawn(conn);
                c.batch_execute("BEGIN; SELECT 1").await.unwrap();
                held.push(c);
                tokio::time::sleep(Duration::from_millis(150)).await;
            }
            held
        })
    };
    let report = check(&checker, &slow).await.unwrap();
    let held = opener.await.unwrap();
    assert!(report.stuck.is_empty());
    assert!(report.applications["climber"].climbing(), "{report}");
    assert!(report.leaks());
    drop(held);
}

/// The leak check beside a pool, as metrics: a transaction left open shows as stuck and a leak
/// for its application on the next scrape after the threshold, and as neither once it commits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_watch_exports_a_stuck_transaction_as_metrics() {
    use stormguard_postgres::leak::Watch;
    let cluster = cluster();
    let watch = Watch::spawn(
        connect(&cluster, "watch").await,
        LeakCheck {
            idle_in_transaction: Duration::from_millis(200),
            window: Duration::from_millis(500),
            every: Duration::from_millis(50),
            application: None,
        },
    );
    let mut registry = prometheus_client::registry::Registry::default();
    watch.register(&mut registry);
    let scrape = |registry: &prometheus_client::registry::Registry| {
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, registry).unwrap();
        text
    };
    let leaky = connect(&cluster, "worker").await;
    leaky.batch_execute("BEGIN; SELECT 1").await.unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let text = scrape(&registry);
    assert!(text.contains("stormguard_db_stuck_transactions{application=\"worker\"} 1"), "{text}");
    assert!(text.contains("stormguard_db_leak{application=\"worker\"} 1"), "{text}");
    assert!(
        text.contains(
            "stormguard_db_connections{application=\"worker\",state=\"idle in transaction\"} 1"
        ),
        "{text}"
    );
    leaky.batch_execute("COMMIT").await.unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let text = scrape(&registry);
    assert!(text.contains("stormguard_db_leak{application=\"worker\"} 0"), "{text}");
    assert!(watch.report().stuck.is_empty());
}
