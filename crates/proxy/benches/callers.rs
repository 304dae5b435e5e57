//! What recognising a caller's own retry costs a request (docs/proxy.md, "Callers' own
//! retries"), beside a tokio `Semaphore` permit in one run: the fingerprint of a typical
//! request head (method, Host, path and query, six headers, a 200-byte body) and its one lookup
//! in the table, on the paths a request takes.
//!
//! ```sh
//! cargo bench -p stormguard-proxy --bench callers
//! ```

use std::hint::black_box;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use criterion::{Criterion, criterion_group, criterion_main};
use stormguard_core::budget::FailureKind;
use stormguard_proxy::callers::{Answered, RecentFailures};

fn head() -> http::request::Parts {
    http::Request::get("/api/items?id=7&page=2")
        .header("host", "catalog.internal")
        .header("user-agent", "python-requests/2.34.2")
        .header("accept", "application/json")
        .header("accept-encoding", "gzip, deflate")
        .header("connection", "keep-alive")
        .header("content-type", "application/json")
        .body(())
        .unwrap()
        .into_parts()
        .0
}

fn benches(c: &mut Criterion) {
    let mut g = c.benchmark_group("callers");
    let parts = head();
    let body = [b'x'; 200];
    let peer: SocketAddr = "127.0.0.1:40000".parse().unwrap();
    let caller = (None::<&str>, Some(peer.ip()));
    let window = Duration::from_secs(10);
    let start = Instant::now();
    // The baseline: what every request already pays for its slot.
    let semaphore = tokio::sync::Semaphore::new(1000);
    g.bench_function("semaphore", |b| b.iter(|| drop(black_box(semaphore.try_acquire()))));
    // A request that succeeds, with nothing failed before it: fingerprint, one lookup (a miss),
    // and its answer (a success: one more lookup).
    let table = RecentFailures::new();
    g.bench_function("success_no_failures", |b| {
        b.iter(|| {
            let mut f = table.fingerprint(&caller, peer, black_box(&parts));
            f.body(&body);
            // The proxy passes the request's start, already read.
            black_box(table.recognise(&f, start));
            table.answered(&f, Answered::Ended, Instant::now, window);
        })
    });
    // A request that fails, and its retry: two fingerprints, two lookups, one write, one take.
    g.bench_function("failure_then_retry", |b| {
        b.iter(|| {
            let mut f = table.fingerprint(&caller, peer, black_box(&parts));
            f.body(&body);
            black_box(table.recognise(&f, start));
            let failed = Answered::Failed { attempt: 1, kind: FailureKind::Error };
            table.answered(&f, failed, Instant::now, window);
            let mut retry = table.fingerprint(&caller, peer, black_box(&parts));
            retry.body(&body);
            assert!(table.recognise(&retry, start).is_some());
            table.answered(&retry, Answered::Ended, Instant::now, window);
        })
    });
    g.finish();
}

criterion_group! {
    name = callers;
    config = Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3))
        .sample_size(50);
    targets = benches
}
criterion_main!(callers);
