//! The fleet layer against a real `redis-server` (each test starts its own on an ephemeral
//! loopback port, no persistence). Each test is named for what it kills or breaks, and runs the
//! unprotected path beside the protected one to show the guarantee is not vacuous.
//!
//! Where the order of renewals matters the tests call [`FleetWorker::tick`] by hand, so the
//! interleaving is chosen, not raced; the load tests run the workers on their interval.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use stormguard_core::budget::{BudgetSpec, FailureKind, RetryBudget};
use stormguard_core::clock::MonotonicClock;
use stormguard_core::limiter::{AttemptKind, Limiter, LimiterConfig, Permit};
use stormguard_redis::resp::{Connection, Value};
use stormguard_redis::server::RedisProcess;
use stormguard_redis::{Fleet, FleetConfig, FleetMode, FleetWorker};

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

fn limiter(cap: u64) -> Limiter {
    Limiter::try_new(
        LimiterConfig {
            cap,
            queue_len: 10_000,
            queue_timeout: Duration::from_secs(20),
            adaptive: None,
        },
        Arc::new(MonotonicClock::new()),
    )
    .unwrap()
}

struct Instance {
    limiter: Limiter,
    fleet: Fleet,
    worker: FleetWorker,
}

fn instance(
    redis: &RedisProcess,
    id: &str,
    fleet_cap: u64,
    max_instances: u64,
    ttl: u64,
    interval: u64,
) -> Instance {
    let config = FleetConfig::new("dep", id, redis.target(), fleet_cap, max_instances)
        .with_timing(ms(ttl), ms(interval));
    let fleet = Fleet::try_new(config).unwrap();
    let limiter = limiter(20);
    let worker = fleet.worker(limiter.clone());
    Instance { limiter, fleet, worker }
}

async fn redis_cmd(redis: &RedisProcess, args: &[&str]) -> Value {
    let mut c = Connection::connect(&redis.target()).await.unwrap();
    let args: Vec<&[u8]> = args.iter().map(|a| a.as_bytes()).collect();
    c.command(&args).await.unwrap()
}

/// An established fleet: the epoch exists and is old, so nothing waits out a quiet period.
async fn established(redis: &RedisProcess) {
    redis_cmd(redis, &["SET", "stormguard:{dep}:epoch", "0"]).await;
}

fn take(l: &Limiter, n: u64) -> Vec<Permit> {
    (0..n).map_while(|_| l.try_acquire(AttemptKind::Primary).ok()).collect()
}

/// Attempts in flight across instances, counted by the callers themselves: each counts after
/// its permit is granted and uncounts before it is returned, so the count never exceeds what
/// the limiters admitted.
#[derive(Default)]
struct Global {
    now: AtomicU64,
    max: AtomicU64,
    ok: AtomicU64,
    failed: AtomicU64,
}

/// `callers` closed-loop callers on `limiter`, each holding a slot for `hold`, until `stop`.
fn load(
    limiter: &Limiter,
    global: &Arc<Global>,
    stop: &Arc<AtomicBool>,
    callers: usize,
    hold: Duration,
) -> Vec<tokio::task::JoinHandle<()>> {
    (0..callers)
        .map(|_| {
            let (l, g, stop) = (limiter.clone(), global.clone(), stop.clone());
            tokio::spawn(async move {
                while !stop.load(Ordering::Relaxed) {
                    match tokio::time::timeout(Duration::from_secs(20), l.acquire()).await {
                        Ok(Ok(p)) => {
                            let n = g.now.fetch_add(1, Ordering::SeqCst) + 1;
                            g.max.fetch_max(n, Ordering::SeqCst);
                            tokio::time::sleep(hold).await;
                            g.now.fetch_sub(1, Ordering::SeqCst);
                            drop(p);
                            g.ok.fetch_add(1, Ordering::Relaxed);
                        }
                        _ => {
                            g.failed.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
            })
        })
        .collect()
}

async fn sum_of_records(redis: &RedisProcess) -> u64 {
    let Value::Array(flat) = redis_cmd(redis, &["HGETALL", "stormguard:{dep}:slots"]).await else {
        return 0;
    };
    flat.chunks(2)
        .filter_map(|kv| match &kv[1] {
            Value::Bulk(b) => String::from_utf8_lossy(b).split(':').next()?.parse::<u64>().ok(),
            _ => None,
        })
        .sum()
}

/// Ten instances renewing every 10 ms, 80 callers between them, one fleet cap of 20: the Lua
/// script serialises every grant, so the attempts in flight across the fleet never pass 20 and
/// the records Redis holds never add up to more. The same callers on ten local caps of 20 pass
/// 20 by far.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lua_concurrency_many_workers_never_over_grant() {
    let redis = RedisProcess::start();
    established(&redis).await;
    for fleet in [true, false] {
        let global = Arc::new(Global::default());
        let stop = Arc::new(AtomicBool::new(false));
        let mut tasks = Vec::new();
        let mut workers = Vec::new();
        for i in 0..10 {
            let inst = instance(&redis, &format!("w{i}"), 20, 10, 1_000, 10);
            if fleet {
                workers.push(tokio::spawn(inst.worker.run()));
            } else {
                inst.limiter.clear_lease();
            }
            tasks.extend(load(&inst.limiter, &global, &stop, 8, ms(2)));
        }
        let mut max_records = 0;
        for _ in 0..30 {
            tokio::time::sleep(ms(50)).await;
            max_records = max_records.max(sum_of_records(&redis).await);
        }
        stop.store(true, Ordering::Relaxed);
        for t in tasks {
            t.await.unwrap();
        }
        workers.iter().for_each(|w| w.abort());
        let max = global.max.load(Ordering::SeqCst);
        let ok = global.ok.load(Ordering::Relaxed);
        eprintln!(
            "fleet={fleet}: max in flight {max}, max sum of records {max_records}, {ok} calls"
        );
        assert!(ok > 100, "the load ran: {ok} calls");
        if fleet {
            assert!(max <= 20, "fleet cap 20, {max} were in flight at once");
            assert!(max_records <= 20, "Redis granted {max_records} slots of 20");
            assert!(max >= 10, "the fleet used its cap: max {max}");
        } else {
            assert!(max > 20, "ten local caps of 20 should pass 20; max {max}");
        }
        redis_cmd(&redis, &["DEL", "stormguard:{dep}:slots"]).await;
    }
}

/// One instance holds the whole cap with 20 in flight; Redis loses everything (FLUSHALL) and a
/// new instance asks first. The epoch rule grants it nothing until the survivor has
/// re-asserted its 20, so the dependency never sees more than 20. Without it (the epoch put back
/// at once, as a script without the rule would behave) the newcomer is granted the whole cap
/// again: 40 in flight.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flushall_mid_run_the_epoch_rule_prevents_over_granting() {
    let redis = RedisProcess::start();
    for epoch_rule in [true, false] {
        redis_cmd(&redis, &["FLUSHALL"]).await;
        established(&redis).await;
        let mut a = instance(&redis, "a", 20, 4, 600, 100);
        let mut b = instance(&redis, "b", 20, 4, 600, 100);
        a.worker.tick().await;
        assert_eq!(a.fleet.snapshot().slots, 20, "alone, a is granted the whole cap");
        let held_a = take(&a.limiter, 20);
        assert_eq!(held_a.len(), 20);
        redis_cmd(&redis, &["FLUSHALL"]).await;
        if !epoch_rule {
            established(&redis).await;
        }
        b.worker.tick().await; // the newcomer asks first
        let held_b = take(&b.limiter, 20);
        a.worker.tick().await; // the survivor re-asserts
        b.worker.tick().await;
        let more_b = take(&b.limiter, 20);
        let total = held_a.len() + held_b.len() + more_b.len();
        eprintln!("epoch rule {epoch_rule}: {total} in flight, b's mode {:?}", b.fleet.mode());
        if epoch_rule {
            assert_eq!(total, 20, "the survivor's 20 and nothing more");
            assert_eq!(b.fleet.mode(), FleetMode::Quiet);
            assert_eq!(a.fleet.snapshot().data_loss, 1, "a saw the new epoch");
            // After one lease ttl, what a does not hold is granted again: b's demand is seen at
            // its next renewal, a's share shrinks at a's, and b is granted at the one after.
            drop(held_a);
            tokio::time::sleep(ms(700)).await;
            for _ in 0..3 {
                a.worker.tick().await;
                b.worker.tick().await;
            }
            let (sa, sb) = (a.fleet.snapshot(), b.fleet.snapshot());
            assert_eq!((sa.mode, sb.mode), (FleetMode::Fleet, FleetMode::Fleet));
            assert_eq!(sa.slots + sb.slots, 20, "idle, the cap is shared out: {sa:?} {sb:?}");
            assert!(sb.slots >= 9, "b has its share after the quiet period: {sb:?}");
        } else {
            assert_eq!(total, 40, "without the epoch rule the cap is granted twice");
        }
    }
}

/// Instance a holds the whole cap and is killed (no more renewals, as a crashed pod). Its record
/// in Redis carries an expiry of the grant time + TTL on Redis's clock; when it passes, b is
/// granted the slots. Before that, b gets nothing: the lease is what held them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn instance_killed_its_leases_return_within_the_ttl() {
    let redis = RedisProcess::start();
    established(&redis).await;
    let ttl = 600;
    let mut a = instance(&redis, "a", 20, 4, ttl, 100);
    let mut b = instance(&redis, "b", 20, 4, ttl, 100);
    a.worker.tick().await;
    let held = take(&a.limiter, 20);
    assert_eq!(held.len(), 20);
    a.worker.tick().await; // a's last renewal
    let Value::Array(t) = redis_cmd(&redis, &["TIME"]).await else { panic!("TIME") };
    let secs = |v: &Value| match v {
        Value::Bulk(b) => String::from_utf8_lossy(b).parse::<u64>().unwrap(),
        _ => panic!(),
    };
    let killed_at_ms = secs(&t[0]) * 1000 + secs(&t[1]) / 1000;
    drop(a.worker); // killed: it renews no more
    std::mem::forget(held); // and its attempts vanish with it
    let Value::Bulk(rec) = redis_cmd(&redis, &["HGET", "stormguard:{dep}:slots", "a"]).await else {
        panic!("no record")
    };
    let rec = String::from_utf8(rec).unwrap();
    let expires: u64 = rec.rsplit(':').next().unwrap().parse().unwrap();
    assert!(rec.starts_with("20:"), "{rec}");
    assert!(
        expires <= killed_at_ms + ttl,
        "a's record expires by the kill + ttl: {expires} vs {killed_at_ms}"
    );
    b.worker.tick().await;
    assert_eq!(b.fleet.snapshot().slots, 0, "while a's lease lives, b gets nothing");
    // Renew b every interval until it has the cap (bounded: 10 ttls).
    let mut waited = 0;
    while b.fleet.snapshot().slots < 20 {
        assert!(waited < 10 * ttl, "b never got a's slots back");
        tokio::time::sleep(ms(100)).await;
        waited += 100;
        b.worker.tick().await;
    }
    eprintln!("b had the cap back after {waited} ms of renewals (ttl {ttl} ms)");
    assert_eq!(take(&b.limiter, 20).len(), 20);
}

/// Three instances under load (60 callers) share a cap of 20; Redis is killed mid-load. Each
/// keeps its lease until it expires, then falls back to floor(20 / 3) = 6 slots: the cap still
/// holds (18 at most), no caller is refused (they wait in the queue), and when Redis comes back
/// (empty) they rejoin after one quiet ttl. The naive fallback — every instance on its local cap
/// of 20 (fallback_min = 20) — passes the fleet cap, and says so in its overcommit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_killed_mid_load_the_fallback_share_holds_the_cap_and_the_fleet_rejoins() {
    for naive in [false, true] {
        let mut redis = RedisProcess::start();
        established(&redis).await;
        let global = Arc::new(Global::default());
        let stop = Arc::new(AtomicBool::new(false));
        let mut tasks = Vec::new();
        let mut fleets = Vec::new();
        let mut workers = Vec::new();
        for i in 0..3 {
            let mut config = FleetConfig::new("dep", format!("i{i}"), redis.target(), 20, 3)
                .with_timing(ms(600), ms(100));
            if naive {
                config.fallback_min = 20;
            }
            let fleet = Fleet::try_new(config).unwrap();
            let l = limiter(20);
            workers.push(tokio::spawn(fleet.worker(l.clone()).run()));
            tasks.extend(load(&l, &global, &stop, 20, ms(5)));
            fleets.push(fleet);
        }
        tokio::time::sleep(ms(500)).await;
        let before = global.max.swap(0, Ordering::SeqCst);
        assert!(fleets.iter().all(|f| f.mode() == FleetMode::Fleet));
        redis.kill();
        // Until every lease has expired and beyond: 1.2 s (two ttls).
        tokio::time::sleep(ms(1200)).await;
        let during = global.max.swap(0, Ordering::SeqCst);
        let modes: Vec<_> = fleets.iter().map(Fleet::mode).collect();
        let overcommit = fleets[0].snapshot().overcommit;
        redis.restart();
        let mut waited = 0;
        while !naive && !fleets.iter().all(|f| f.mode() == FleetMode::Fleet) {
            assert!(
                waited < 5_000,
                "the fleet did not rejoin: {:?}",
                fleets.iter().map(Fleet::mode).collect::<Vec<_>>()
            );
            tokio::time::sleep(ms(50)).await;
            waited += 50;
        }
        global.max.swap(global.now.load(Ordering::SeqCst), Ordering::SeqCst);
        tokio::time::sleep(ms(300)).await;
        let after = global.max.load(Ordering::SeqCst);
        stop.store(true, Ordering::Relaxed);
        for t in tasks {
            t.await.unwrap();
        }
        workers.iter().for_each(|w| w.abort());
        let (ok, failed) =
            (global.ok.load(Ordering::Relaxed), global.failed.load(Ordering::Relaxed));
        eprintln!(
            "naive={naive}: max in flight before {before}, during the outage {during}, after {after}; modes {modes:?}; overcommit {overcommit}; rejoined after {waited} ms; {ok} ok, {failed} refused"
        );
        assert!(modes.iter().all(|m| *m == FleetMode::Fallback), "{modes:?}");
        assert!(before <= 20, "{before}");
        if naive {
            assert!(
                during > 20,
                "three instances on their local caps pass the fleet's 20: {during}"
            );
            assert_eq!(overcommit, 40, "and the overcommit says so");
        } else {
            assert_eq!(failed, 0, "no caller was refused because of the fleet layer");
            assert!(during <= 18, "the fallback share is 6 each: {during}");
            assert!(during >= 10, "the fallback share was used: {during}");
            assert_eq!(overcommit, 0);
            assert!(after <= 20, "after the rejoin: {after}");
            assert!(
                fleets.iter().all(|f| f.snapshot().data_loss == 1),
                "each saw Redis come back empty"
            );
        }
    }
}

/// Three instances whose dependency fails every retry ask their budgets for retries at a low
/// rate: with the reserve shared, the fleet is granted one reserve (3/s × 10 s = 30) in total;
/// three local budgets grant three reserves (90).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reserve_tokens_fleet_grants_one_reserve_not_three() {
    let redis = RedisProcess::start();
    established(&redis).await;
    let spec: BudgetSpec = "ratio:percent=0,min_per_sec=3,ttl=10s".parse().unwrap();
    let mut fleet_budgets = Vec::new();
    let mut workers = Vec::new();
    for i in 0..3 {
        let inst = instance(&redis, &format!("r{i}"), 20, 3, 600, 50);
        fleet_budgets.push((inst.limiter.clone(), inst.fleet.budget(&spec).unwrap()));
        workers.push(inst.worker);
    }
    let local: Vec<_> = (0..3).map(|_| spec.build().unwrap()).collect();
    let (mut fleet_granted, mut local_granted) = (0, 0);
    // 2 s of asking: 20 rounds, every instance asks 5 times per round, renewals in between.
    for _ in 0..20 {
        for w in &mut workers {
            w.tick().await;
        }
        for (l, b) in &fleet_budgets {
            for _ in 0..5 {
                if b.try_retry(l.now(), FailureKind::Error).is_ok() {
                    fleet_granted += 1;
                }
            }
        }
        for b in &local {
            let now = stormguard_core::clock::Timestamp::from_millis(0);
            for _ in 0..5 {
                if b.try_retry(now, FailureKind::Error).is_ok() {
                    local_granted += 1;
                }
            }
        }
        tokio::time::sleep(ms(100)).await;
    }
    eprintln!("retries granted: fleet {fleet_granted}, three local budgets {local_granted}");
    assert!(fleet_granted <= 30, "one reserve is 30, the fleet granted {fleet_granted}");
    assert!(fleet_granted >= 20, "the fleet's reserve was usable: {fleet_granted}");
    assert_eq!(local_granted, 90, "three local reserves");
}

/// A provider's rate limits are divided among the fleet's live instances: each worker stores
/// the count of live instances in the share it was given (`max_instances` before its first
/// renewal), and `max_instances` again when Redis stops answering — never fewer instances than
/// may really be metering the key. A second instance joining is counted at the next renewal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_rate_share_follows_the_live_instances_and_falls_back_to_max_instances() {
    let mut redis = RedisProcess::start();
    established(&redis).await;
    let share = |i: &mut Instance| {
        let s = Arc::new(std::sync::atomic::AtomicU64::new(1));
        i.worker.share_rates(vec![s.clone()]);
        s
    };
    let mut a = instance(&redis, "a", 20, 4, 600, 100);
    let share_a = share(&mut a);
    assert_eq!(share_a.load(Ordering::SeqCst), 4, "before its first renewal: max_instances");
    a.worker.tick().await;
    assert_eq!(share_a.load(Ordering::SeqCst), 1, "alone in the fleet");
    let mut b = instance(&redis, "b", 20, 4, 600, 100);
    let share_b = share(&mut b);
    b.worker.tick().await;
    a.worker.tick().await;
    assert_eq!((share_a.load(Ordering::SeqCst), share_b.load(Ordering::SeqCst)), (2, 2));
    redis.kill();
    // The lease runs out (600 ms) with no renewal answered.
    tokio::time::sleep(ms(700)).await;
    a.worker.tick().await;
    assert_eq!(a.fleet.mode(), FleetMode::Fallback);
    assert_eq!(share_a.load(Ordering::SeqCst), 4, "without Redis: max_instances");
}
