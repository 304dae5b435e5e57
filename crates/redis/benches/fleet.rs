//! What the fleet layer costs on the request path, and how often it calls Redis, in one run.
//!
//! - `decision/local`: one admission and one retry decision on a plain limiter and a local
//!   ratio budget: `try_acquire_at(Primary, now)` + `record_request(now)` +
//!   `try_retry(now, Error)` + drop of the retry permit + `release_at(now)`, `now` read from the
//!   limiter's monotonic clock once per decision;
//! - `decision/fleet_syncing`: the same on a limiter under a fleet lease and the fleet budget,
//!   while the lease worker renews against a real `redis-server` every 10 ms on another thread
//!   (20 × the default rate, to make any interference visible);
//! - `decision/naive_redis_per_decision`: the design that asks Redis on every decision: one
//!   lease script call (`EVALSHA`) per decision, on one connection.
//!
//! Then script calls per instance per second, with the worker's interval at 100 ms, at three
//! traffic levels (idle, about 1 000 decisions/s, as many as one thread can make), against the
//! naive design, whose calls per second are its decisions per second.
//!
//! `cargo bench -p stormguard-redis --bench fleet` (needs `redis-server`; BENCHMARKS.md).

use std::hint::black_box;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use criterion::Criterion;
use stormguard_core::budget::{BudgetSpec, FailureKind, RetryBudget};
use stormguard_core::clock::MonotonicClock;
use stormguard_core::limiter::{AttemptKind, Limiter, LimiterConfig};
use stormguard_redis::resp::{Connection, Value};
use stormguard_redis::server::RedisProcess;
use stormguard_redis::{Fleet, FleetConfig, FleetMode, LEASE_SCRIPT};

// percent 1: a deposit pays for the retry, so the local part grants every time.
const RATIO: &str = "ratio:percent=1,min_per_sec=3,ttl=10s";

fn limiter() -> Limiter {
    Limiter::try_new(
        LimiterConfig {
            cap: 20,
            queue_len: 0,
            queue_timeout: Duration::from_secs(1),
            adaptive: None,
        },
        Arc::new(MonotonicClock::new()),
    )
    .unwrap()
}

fn decide(l: &Limiter, b: &dyn RetryBudget, refused: &mut u64) {
    let now = l.now();
    match l.try_acquire_at(AttemptKind::Primary, now) {
        Ok(p) => {
            b.record_request(now);
            match b.try_retry(now, FailureKind::Error) {
                Ok(r) => drop(black_box(r)),
                Err(_) => *refused += 1,
            }
            p.release_at(now);
        }
        Err(_) => *refused += 1,
    }
}

struct Running {
    fleet: Fleet,
    limiter: Limiter,
    budget: Arc<dyn RetryBudget>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Drop for Running {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// An instance whose worker renews every `interval` on its own thread.
fn fleet_instance(redis: &RedisProcess, id: &str, interval: Duration) -> Running {
    let config = FleetConfig::new("bench", id, redis.target(), 20, 4)
        .with_timing(Duration::from_secs(1).max(interval * 3), interval);
    let fleet = Fleet::try_new(config).unwrap();
    let limiter = limiter();
    let budget: Arc<dyn RetryBudget> = Arc::new(fleet.budget(&RATIO.parse().unwrap()).unwrap());
    let worker = fleet.worker(limiter.clone());
    let stop = Arc::new(AtomicBool::new(false));
    let s = stop.clone();
    let thread = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(worker.run_until(async move {
            while !s.load(Ordering::Relaxed) {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }));
    });
    let deadline = Instant::now() + Duration::from_secs(5);
    while fleet.mode() != FleetMode::Fleet {
        assert!(Instant::now() < deadline, "the worker never got a lease: {:?}", fleet.snapshot());
        std::thread::sleep(Duration::from_millis(5));
    }
    Running { fleet, limiter, budget, stop, thread: Some(thread) }
}

fn set_epoch(rt: &tokio::runtime::Runtime, redis: &RedisProcess) {
    rt.block_on(async {
        let mut c = Connection::connect(&redis.target()).await.unwrap();
        c.command(&[b"SET", b"stormguard:{bench}:epoch", b"0"]).await.unwrap();
    });
}

fn naive_args(id: &str, sha: Vec<u8>) -> Vec<Vec<u8>> {
    let mut a: Vec<Vec<u8>> = vec![b"EVALSHA".to_vec(), sha, b"3".to_vec()];
    for k in ["stormguard:{naive}:slots", "stormguard:{naive}:tokens", "stormguard:{naive}:epoch"] {
        a.push(k.as_bytes().to_vec());
    }
    a.push(id.as_bytes().to_vec());
    for n in ["0", "1", "20", "1000", "0", "0", "1", "30", "10000"] {
        a.push(n.as_bytes().to_vec());
    }
    a
}

fn main() {
    let redis = RedisProcess::start();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    set_epoch(&rt, &redis);
    let mut c = Criterion::default()
        .sample_size(30)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3))
        .configure_from_args();
    let mut g = c.benchmark_group("decision");

    let local_limiter = limiter();
    let local_budget = RATIO.parse::<BudgetSpec>().unwrap().build().unwrap();
    let mut refused = 0;
    g.bench_function("local", |b| b.iter(|| decide(&local_limiter, &local_budget, &mut refused)));
    println!("note: local refused {refused}");

    let inst = fleet_instance(&redis, "syncing", Duration::from_millis(10));
    let calls_before = inst.fleet.snapshot().script_calls;
    let started = Instant::now();
    let mut refused = 0;
    g.bench_function("fleet_syncing", |b| {
        b.iter(|| decide(&inst.limiter, &*inst.budget, &mut refused))
    });
    let s = inst.fleet.snapshot();
    println!(
        "note: fleet_syncing refused {refused}; the worker made {} script calls in {:.1} s, mode {:?}, {} slots",
        s.script_calls - calls_before,
        started.elapsed().as_secs_f64(),
        s.mode,
        s.slots
    );
    drop(inst);

    // The naive design: every decision is a round trip to Redis.
    let mut conn = rt.block_on(Connection::connect(&redis.target())).unwrap();
    let Value::Bulk(sha) =
        rt.block_on(conn.command(&[b"SCRIPT", b"LOAD", LEASE_SCRIPT.as_bytes()])).unwrap()
    else {
        panic!("SCRIPT LOAD")
    };
    let args = naive_args("naive", sha);
    let argv: Vec<&[u8]> = args.iter().map(Vec::as_slice).collect();
    g.bench_function("naive_redis_per_decision", |b| {
        b.iter(|| {
            let v = rt.block_on(conn.command(&argv)).unwrap();
            black_box(matches!(v, Value::Array(_)));
        })
    });
    g.finish();

    // Script calls per instance per second, worker at 100 ms, by traffic.
    println!("\nscript calls per instance per second (worker interval 100 ms; 2 s per level):");
    println!("| design | traffic | decisions/s | script calls/s |");
    println!("| --- | --- | --- | --- |");
    for (name, pace) in [
        ("idle", None),
        ("~1 000/s", Some(Duration::from_millis(1))),
        ("one thread flat out", Some(Duration::ZERO)),
    ] {
        let inst = fleet_instance(&redis, &format!("rate-{name}"), Duration::from_millis(100));
        let before = inst.fleet.snapshot().script_calls;
        let start = Instant::now();
        let mut decisions = 0u64;
        let mut refused = 0;
        while start.elapsed() < Duration::from_secs(2) {
            match pace {
                None => std::thread::sleep(Duration::from_millis(10)),
                Some(p) => {
                    decide(&inst.limiter, &*inst.budget, &mut refused);
                    decisions += 1;
                    if !p.is_zero() {
                        std::thread::sleep(p);
                    }
                }
            }
        }
        let secs = start.elapsed().as_secs_f64();
        let calls = inst.fleet.snapshot().script_calls - before;
        println!(
            "| fleet lease | {name} | {:.0} | {:.1} |",
            decisions as f64 / secs,
            calls as f64 / secs
        );
    }
    let start = Instant::now();
    let mut calls = 0u64;
    while start.elapsed() < Duration::from_secs(2) {
        rt.block_on(conn.command(&argv)).unwrap();
        calls += 1;
    }
    let secs = start.elapsed().as_secs_f64();
    println!(
        "| naive: Redis per decision | one thread flat out | {:.0} | {:.0} |",
        calls as f64 / secs,
        calls as f64 / secs
    );
    c.final_summary();
}
