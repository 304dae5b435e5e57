//! Per-call overhead of the closure API (`Dependency::call`) around an operation that answers
//! at once, side by side in one run with the bare operation and with `backon` running the same
//! policy (jittered exponential backoff, retry when the error is transient):
//!
//!     cargo bench -p stormguard-tower --bench call
//!
//! Each item makes calls one after another on a current-thread tokio runtime; each succeeds at
//! once, so no retry is ever sent: this is the cost every call pays. The binary times `ROUNDS`
//! rounds of `CALLS` calls per item, items interleaved round by round (so a noisy stretch of the
//! machine hits every item alike), and prints each item's median time per call, its ratio to
//! `backon`'s. Timing never decides a test; the ratios go in BENCHMARKS.md.
//!
//! Counted instead of timed: with `CALL_COUNT=N` the binary makes N calls through the item named
//! by its first argument (`bare`, `backon`, `stormguard`, `stormguard_run`) and exits, for
//! `perf stat` to count allocations (a uprobe on libc's `malloc`), less a run of 0 calls:
//!
//!     BIN=$(cargo bench -p stormguard-tower --bench call --no-run 2>&1 | grep -o 'target/[^)]*')
//!     CALL_COUNT=100000 perf stat -e probe_libc:malloc $BIN stormguard

use std::hint::black_box;
use std::time::{Duration, Instant};

use backon::{ExponentialBuilder, Retryable};
use stormguard_tower::call::{Failure, Outcome};
use stormguard_tower::{Dependency, DependencyConfig};

const CALLS: u64 = 20_000;
const ROUNDS: usize = 31;

#[derive(Debug)]
struct Transient;

impl std::fmt::Display for Transient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("transient")
    }
}

impl std::error::Error for Transient {}

/// The operation: answers at once.
async fn op(n: u64) -> Result<u64, Transient> {
    Ok(black_box(n))
}

fn classify(r: &Result<u64, Transient>) -> Outcome {
    match r {
        Ok(_) => Outcome::Success,
        Err(_) => Outcome::Failure(Failure::transient()),
    }
}

fn main() {
    let rt = tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap();
    let dep = {
        let _guard = rt.enter();
        let mut c = DependencyConfig::new("bench");
        c.limiter.cap = 1_000;
        c.budget = "ratio:percent=0.2,min_per_sec=10".parse().unwrap();
        Dependency::try_new(c).unwrap()
    };
    let backoff = ExponentialBuilder::default().with_jitter().with_max_times(3);

    type Item<'a> = (&'static str, Box<dyn Fn(u64) -> Duration + 'a>);
    let items: Vec<Item<'_>> = vec![
        (
            "bare",
            Box::new(|n| {
                rt.block_on(async {
                    let t = Instant::now();
                    for i in 0..n {
                        black_box(op(i).await.ok());
                    }
                    t.elapsed()
                })
            }),
        ),
        (
            "backon",
            Box::new(|n| {
                rt.block_on(async {
                    let t = Instant::now();
                    for i in 0..n {
                        let r = (|| op(i))
                            .retry(backoff)
                            .sleep(tokio::time::sleep)
                            .when(|_: &Transient| true)
                            .await;
                        black_box(r.ok());
                    }
                    t.elapsed()
                })
            }),
        ),
        (
            "stormguard",
            Box::new(|n| {
                rt.block_on(async {
                    let t = Instant::now();
                    for i in 0..n {
                        let r = dep.call(|_| op(i)).classify(classify).await;
                        black_box(r.ok());
                    }
                    t.elapsed()
                })
            }),
        ),
        (
            "stormguard_run",
            Box::new(|n| {
                rt.block_on(async {
                    let t = Instant::now();
                    for i in 0..n {
                        let r = dep.call(|_| op(i)).classify(classify).run().await;
                        black_box(r.ok());
                    }
                    t.elapsed()
                })
            }),
        ),
    ];

    // The size of a call's future (what is moved as the call starts): `CALL_SIZES=1`.
    if std::env::var("CALL_SIZES").is_ok() {
        let f = dep.call(|_| op(1)).classify(classify).run();
        println!("run future: {} bytes", std::mem::size_of_val(&f));
        return;
    }
    if let Ok(n) = std::env::var("CALL_COUNT") {
        let n: u64 = n.parse().expect("CALL_COUNT is a number of calls");
        let which = std::env::args().nth(1).unwrap_or_default();
        let Some((_, run)) = items.iter().find(|(name, _)| *name == which) else {
            eprintln!("name an item: bare, backon, stormguard, stormguard_run");
            std::process::exit(2);
        };
        run(n);
        return;
    }
    let mut times: Vec<Vec<f64>> = vec![Vec::new(); items.len()];
    for _ in 0..ROUNDS {
        for (i, (_, run)) in items.iter().enumerate() {
            times[i].push(run(CALLS).as_nanos() as f64 / CALLS as f64);
        }
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let medians: Vec<f64> = times.iter_mut().map(median).collect();
    let (bare, backon) = (medians[0], medians[1]);
    println!("{:<16} {:>10} {:>12} {:>16}", "item", "ns/call", "added ns", "added vs backon");
    for (i, (name, _)) in items.iter().enumerate() {
        let added = medians[i] - bare;
        println!(
            "{name:<16} {:>10.1} {:>12.1} {:>15.2}x",
            medians[i],
            added,
            added / (backon - bare)
        );
    }
}
