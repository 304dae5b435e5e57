//! `stormguard db-check` against a real PostgreSQL server (a throwaway cluster under target/):
//! exit 1 with the stuck transaction named while one is left open, 0 once it is closed, 2 for a
//! database it cannot reach.

use crate::support;

use std::time::Duration;

use predicates::prelude::*;
use stormguard_postgres::testing::Cluster;
use support::stormguard;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transaction_left_open_exits_1_and_a_clean_database_0() {
    let cluster = Cluster::start(std::path::Path::new(env!("CARGO_TARGET_TMPDIR")), 20, &[])
        .unwrap_or_else(|e| panic!("{e}"));
    let (client, conn) =
        tokio_postgres::connect(&cluster.url("billing-worker"), tokio_postgres::NoTls)
            .await
            .unwrap();
    tokio::spawn(conn);
    client.batch_execute("BEGIN; SELECT 1").await.unwrap();
    tokio::time::sleep(Duration::from_millis(400)).await;
    let url = cluster.url("ci");
    let check = move || {
        let mut c = stormguard();
        c.args(["db-check", &url, "--idle-in-transaction", "200ms", "--window", "0s"]);
        c
    };
    let c = check.clone();
    tokio::task::spawn_blocking(move || {
        c().assert()
            .code(1)
            .stdout(predicate::str::contains("LEAK: 1 idle in transaction"))
            .stdout(predicate::str::contains("billing-worker"));
    })
    .await
    .unwrap();
    client.batch_execute("COMMIT").await.unwrap();
    tokio::task::spawn_blocking(move || {
        check().assert().code(0).stdout(predicate::str::contains("no transaction idle"));
    })
    .await
    .unwrap();
}

#[test]
fn a_database_it_cannot_reach_exits_2() {
    let free = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    stormguard()
        .args([
            "db-check",
            &format!("host=127.0.0.1 port={free} user=x dbname=x connect_timeout=2"),
        ])
        .assert()
        .code(2)
        .stderr(predicate::str::contains("could not connect"));
}
