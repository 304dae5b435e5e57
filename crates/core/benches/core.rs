//! The hot paths of stormguard-core against the baselines they must not lose to, in one run.
//!
//! Each item is one operation a request pays for, meant to be measured on the granted path: the
//! budgets are configured so they never run dry, and every refusal is counted and printed after
//! its item (`note: ... refused`), so a refused path can't pass unnoticed for a fast one:
//!
//! - `atomic_fetch_add`: a bare `AtomicU64::fetch_add`, the floor every ratio is taken against;
//! - `tps_budget`: tower's `TpsBudget`, `deposit()` + `withdraw()`;
//! - `semaphore`: tokio's `Semaphore`, `try_acquire()` + drop;
//! - `decision_<policy>`: `record_request(now)` + `try_retry(now, Error)` + drop of the permit,
//!   with `now` a precomputed `Timestamp`, for each of the four policies;
//! - `full_decision_ratio`: `RetryPolicy::on_admitted` + `RetryPolicy::decide` on a 503 + drop
//!   of the ticket, over the default ratio budget;
//! - `limiter_permit`: `Limiter::try_acquire(Retry)` + drop, reading a `MonotonicClock` (the
//!   limiter reads its own clock, twice); `limiter_permit_manual_clock` is the same over a
//!   `ManualClock`, to show what the clock reads cost; `limiter_permit_time_passed_in` is
//!   `try_acquire_at(Retry, now)` + `answered_at(now)` + `release_at(now)`, the way the tower
//!   layer calls it for a retry; `limiter_permit_primary_time_passed_in` is the same for a
//!   first try (which does not count itself among the retries in flight: two read-modify-writes
//!   fewer), the path every request takes; `limiter_permit_adaptive` is the same with an adaptive cap (each answer a
//!   sample; the
//!   time passed in never moves, so a window closes only when full, every 524 288 samples);
//! - `rate_request`: rate admission's decision for one request, `RateLimit::try_acquire(now, 1)`
//!   then `settle`; `rate_request_tokens`: a request and its tokens booked in two buckets and
//!   settled from a stated usage (what a model provider's request pays).
//!
//! Two groups run the same items: `single` (one thread, `iters` operations in a timed loop) and
//! `contended_2t` (two threads sharing one instance). In `contended_2t` each thread runs `iters` operations after a barrier and
//! times itself; the sample is the slower thread's time, so `time / iters` is the wall time of
//! one operation per thread while the other thread does the same (two operations complete in
//! that time).
//!
//! Timing never decides a test: run `cargo bench -p stormguard-core --bench core` and read the
//! ratios (BENCHMARKS.md).

use std::hint::black_box;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Barrier};
use std::thread;
use std::time::{Duration, Instant};

use criterion::measurement::WallTime;
use criterion::{BenchmarkGroup, Criterion, criterion_group, criterion_main};
use stormguard_core::adaptive::AdaptiveConfig;
use stormguard_core::budget::{AnyBudget, BudgetSpec, FailureKind, RetryBudget};
use stormguard_core::clock::{Clock, ManualClock, MonotonicClock, Timestamp};
use stormguard_core::conditions::AttemptFailure;
use stormguard_core::decision::{
    Decision, FailedAttempt, RequestFacts, RetryConfig, RetryPolicy, RetryState, Upstream,
};
use stormguard_core::denied::Denied;
use stormguard_core::limiter::{AttemptKind, Limiter, LimiterConfig};
use stormguard_core::random::SplitMix64;
use stormguard_core::rate::{RateConfig, RateLimit};
use tower::retry::budget::{Budget, TpsBudget};

/// The time passed to every rule: fixed, so the policy is measured and not the clock.
const NOW: Timestamp = Timestamp::from_millis(1_000);

// The budgets are configured so a granted retry never drains them: `record_request` +
// `try_retry` is a net zero for the ratio budget at percent 1 (and for `TpsBudget` at 1.0), the
// concurrency budget is told of many requests in flight, the token bucket charges nothing for a
// grant, and the quota starts at its largest valid capacity (2^40 tokens, 5 a retry: far more
// than a run takes).
const RATIO: &str = "ratio:percent=1,min_per_sec=10,ttl=10s";
const CONCURRENCY: &str = "concurrency:percent=0.2,min=3";
const TOKEN_BUCKET: &str = "token-bucket:max_tokens=10,token_ratio=0.1";
const QUOTA: &str = "quota:capacity=1099511627776,retry_cost=5,timeout_cost=10,success_reward=1";

/// Counts an item's refusals and operations (warm-up included); prints them when the item is
/// done, if any operation was refused.
struct Refusals {
    item: String,
    count: AtomicU64,
    ops: AtomicU64,
}

impl Refusals {
    fn new(item: &str) -> Refusals {
        Refusals { item: item.to_string(), count: AtomicU64::new(0), ops: AtomicU64::new(0) }
    }

    fn ran(&self, ops: u64) {
        self.ops.fetch_add(ops, Ordering::Relaxed);
    }

    #[cold]
    #[inline(never)]
    fn refused(&self) {
        self.count.fetch_add(1, Ordering::Relaxed);
    }
}

impl Drop for Refusals {
    fn drop(&mut self) {
        let (n, ops) = (self.count.load(Ordering::Relaxed), self.ops.load(Ordering::Relaxed));
        if n > 0 {
            eprintln!("note: {}: {n} of {ops} operations refused", self.item);
        }
    }
}

fn budget(spec: &str) -> AnyBudget {
    let budget = BudgetSpec::parse(spec).and_then(|s| s.build()).expect("valid spec");
    // Only the concurrency policy listens: a million requests in flight allow 200 000 retries.
    budget.set_active(1_000_000, 0);
    budget
}

fn bare_atomic() -> impl Fn(&Refusals) + Sync {
    let counter = AtomicU64::new(0);
    move |_| {
        black_box(counter.fetch_add(1, Ordering::Relaxed));
    }
}

fn tps_budget() -> impl Fn(&Refusals) + Sync {
    let tps = TpsBudget::new(Duration::from_secs(10), 10, 1.0);
    move |refusals| {
        tps.deposit();
        if !black_box(tps.withdraw()) {
            refusals.refused();
        }
    }
}

fn semaphore() -> impl Fn(&Refusals) + Sync {
    let sem = tokio::sync::Semaphore::new(1_000);
    move |refusals| match sem.try_acquire() {
        Ok(permit) => drop(black_box(permit)),
        Err(_) => refusals.refused(),
    }
}

fn decision(spec: &str) -> impl Fn(&Refusals) + Sync {
    let budget = budget(spec);
    move |refusals| {
        let now = black_box(NOW);
        budget.record_request(now);
        match budget.try_retry(now, FailureKind::Error) {
            Ok(permit) => drop(black_box(permit)),
            Err(_) => refusals.refused(),
        }
    }
}

fn full_decision() -> impl Fn(&Refusals) + Sync {
    let upstream = Upstream::new(
        LimiterConfig { cap: 1_000, ..Default::default() },
        None,
        Arc::new(MonotonicClock::new()),
    )
    .expect("valid limiter");
    let policy = RetryPolicy::with_budget(RetryConfig::default(), budget(RATIO)).expect("valid");
    let facts = RequestFacts::idempotent();
    let failed = FailedAttempt::from(AttemptFailure::Status(503));
    move |refusals| {
        let now = black_box(NOW);
        let mut rng = SplitMix64::new(7);
        let mut state = RetryState::default();
        policy.on_admitted(now);
        match policy.decide(now, &upstream, &facts, &mut state, &failed, &[], &mut rng) {
            Decision::Retry(ticket) => drop(black_box(ticket)),
            Decision::Denied(Denied::Budget) => refusals.refused(),
            other => panic!("expected a retry, got {other:?}"),
        }
    }
}

fn limiter(clock: Arc<dyn Clock>) -> impl Fn(&Refusals) + Sync {
    let limiter = Limiter::try_new(LimiterConfig { cap: 1_000, ..Default::default() }, clock)
        .expect("valid limiter");
    move |refusals| match limiter.try_acquire(AttemptKind::Retry) {
        Ok(permit) => drop(black_box(permit)),
        Err(_) => refusals.refused(),
    }
}

/// The permit with time passed in, as the tower layer calls it: `try_acquire_at(now)` +
/// `release_at(now)`, no clock read inside the limiter.
fn limiter_time_passed_in(adaptive: Option<AdaptiveConfig>) -> impl Fn(&Refusals) + Sync {
    limiter_kind_time_passed_in(AttemptKind::Retry, adaptive)
}

fn limiter_kind_time_passed_in(
    kind: AttemptKind,
    adaptive: Option<AdaptiveConfig>,
) -> impl Fn(&Refusals) + Sync {
    let limiter = Limiter::try_new(
        LimiterConfig { cap: 1_000, adaptive, ..Default::default() },
        Arc::new(MonotonicClock::new()),
    )
    .expect("valid limiter");
    move |refusals| match limiter.try_acquire_at(kind, NOW) {
        Ok(permit) => {
            let mut permit = black_box(permit);
            // What the tower layer tells every permit of its answer (a sample only when the
            // cap adapts).
            permit.answered_at(NOW, false);
            permit.release_at(NOW)
        }
        Err(_) => refusals.refused(),
    }
}

/// Rate admission's decision for one request, time passed in: `RateLimit::try_acquire(now, 1)`
/// then `settle(now, None)` on a requests-per-minute bucket that never runs dry.
fn rate_request() -> impl Fn(&Refusals) + Sync {
    let rpm = RateLimit::new(RateConfig { limit: Some(1 << 50), window: Duration::from_secs(60) });
    move |refusals| match rpm.try_acquire(black_box(NOW), 1) {
        Ok(p) => p.settle(NOW, None),
        Err(_) => refusals.refused(),
    }
}

/// The same with tokens, as a model provider's request pays it: `reserve` in the requests and
/// the tokens buckets, then both settled (the tokens from a stated usage).
fn rate_request_tokens() -> impl Fn(&Refusals) + Sync {
    let minute = Duration::from_secs(60);
    let rpm = RateLimit::new(RateConfig { limit: Some(1 << 50), window: minute });
    let tpm = RateLimit::new(RateConfig { limit: Some(1 << 50), window: minute });
    move |refusals| {
        let now = black_box(NOW);
        match (rpm.reserve(now, 1, Duration::ZERO), tpm.reserve(now, 300, Duration::ZERO)) {
            (Ok((r, _)), Ok((t, _))) => {
                r.settle(now, None);
                t.settle(now, Some(black_box(250)));
            }
            _ => refusals.refused(),
        }
    }
}

/// Every item, built fresh for each group (so the groups share no state).
macro_rules! each_item {
    ($group:expr, $run:ident) => {
        $run($group, "atomic_fetch_add", bare_atomic());
        $run($group, "tps_budget", tps_budget());
        $run($group, "semaphore", semaphore());
        $run($group, "decision_ratio", decision(RATIO));
        $run($group, "decision_concurrency", decision(CONCURRENCY));
        $run($group, "decision_token_bucket", decision(TOKEN_BUCKET));
        $run($group, "decision_quota", decision(QUOTA));
        $run($group, "full_decision_ratio", full_decision());
        $run($group, "limiter_permit", limiter(Arc::new(MonotonicClock::new())));
        $run($group, "limiter_permit_manual_clock", limiter(Arc::new(ManualClock::new())));
        $run($group, "limiter_permit_time_passed_in", limiter_time_passed_in(None));
        $run(
            $group,
            "limiter_permit_primary_time_passed_in",
            limiter_kind_time_passed_in(AttemptKind::Primary, None),
        );
        $run(
            $group,
            "limiter_permit_adaptive",
            limiter_time_passed_in(Some(AdaptiveConfig::new(4, 1_000))),
        );
        $run($group, "rate_request", rate_request());
        $run($group, "rate_request_tokens", rate_request_tokens());
    };
}

fn single(group: &mut BenchmarkGroup<'_, WallTime>, name: &str, op: impl Fn(&Refusals)) {
    let refusals = Refusals::new(name);
    group.bench_function(name, |b| {
        b.iter_custom(|iters| {
            let t = Instant::now();
            for _ in 0..iters {
                op(&refusals);
            }
            let elapsed = t.elapsed();
            refusals.ran(iters);
            elapsed
        })
    });
}

fn contended(group: &mut BenchmarkGroup<'_, WallTime>, name: &str, op: impl Fn(&Refusals) + Sync) {
    let refusals = Refusals::new(name);
    group.bench_function(name, |b| b.iter_custom(|iters| two_threads(&op, &refusals, iters)));
}

/// Runs `iters` operations on each of two threads started together; returns the slower
/// thread's time (thread start-up is not in it).
fn two_threads(op: &(impl Fn(&Refusals) + Sync), refusals: &Refusals, iters: u64) -> Duration {
    let start = Barrier::new(2);
    thread::scope(|s| {
        let run = || {
            start.wait();
            let t = Instant::now();
            for _ in 0..iters {
                op(refusals);
            }
            t.elapsed()
        };
        let threads = [s.spawn(run), s.spawn(run)];
        let slower = threads.map(|t| t.join().expect("bench thread panicked")).into_iter().max();
        refusals.ran(2 * iters);
        slower.expect("two threads")
    })
}

fn benches(c: &mut Criterion) {
    let mut group = c.benchmark_group("single");
    each_item!(&mut group, single);
    group.finish();

    let mut group = c.benchmark_group("contended_2t");
    each_item!(&mut group, contended);
    group.finish();
}

criterion_group! {
    name = core;
    // 24 items at about 1 s warm-up + 3 s measuring each: the run stays near 2 minutes.
    config = Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3))
        .sample_size(50);
    targets = benches
}
criterion_main!(core);
