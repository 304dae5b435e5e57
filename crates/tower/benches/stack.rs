//! Per-call overhead of the stormguard stack around a no-op service, side by side with the bare
//! service and with tower's own stack (`tower::retry::Retry` + `TpsBudget` +
//! `tower::limit::ConcurrencyLimit`), in one run:
//!
//!     cargo bench -p stormguard-tower --bench stack
//!
//! Each operation is one request through `ready()` + `call()` on a current-thread tokio runtime,
//! answered at once with 200 (so no retry is ever sent: this is the cost every request pays),
//! and the response dropped. Timing never decides a test; the ratios go in BENCHMARKS.md.
//!
//! Counted instead of timed (what a call *does* does not move with a noisy machine): with
//! `STACK_CALLS=N`, the binary makes N calls through one stack (`bare`, `tower`, `stormguard`)
//! and exits, so that `perf stat` can count instructions, allocations, `memmove`s and clock
//! reads, less a run of 0 calls, per call:
//!
//!     BIN=$(cargo bench -p stormguard-tower --bench stack --no-run 2>&1 | grep -o 'target/[^)]*')
//!     STACK_CALLS=200000 perf stat -e instructions:u $BIN stormguard
//!
//! Timed in one run: with `STACK_RATIO=ROUNDS`, the three stacks are timed in turn, a batch of
//! 20 000 calls each per round, and the binary prints each one's median and fastest batch and
//! the added time's ratio (stormguard's over tower's). A process's memory layout (address
//! randomisation draws a new one each run) moves every stack's time by up to a tenth and one
//! process's ratio by up to ±0.4, so run many processes and take their median:
//!
//!     for i in $(seq 60); do STACK_RATIO=40 taskset -c 1 $BIN | tail -1; done
//!
//! (With `setarch -R` before `taskset` every process gets the same layout, and one process's
//! ratio stays within ±0.03: good for comparing two builds, but it is one layout's figure.)

use std::convert::Infallible;
use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use criterion::{Criterion, criterion_group};
use http::{Request, Response};
use http_body_util::Full;
use stormguard_tower::{CloneBody, Dependency, DependencyConfig, ReplayBody, StormguardLayer};
use tower::retry::budget::{Budget, TpsBudget};
use tower::{Layer, Service, ServiceBuilder, ServiceExt};

type Resp = Response<Full<Bytes>>;

fn noop<B>() -> impl Service<
    Request<B>,
    Response = Resp,
    Error = Infallible,
    Future = std::future::Ready<Result<Resp, Infallible>>,
> + Clone {
    tower::service_fn(|_req: Request<B>| {
        std::future::ready(Ok(Response::new(Full::new(Bytes::new()))))
    })
}

/// tower's own retry policy over a `TpsBudget`: deposit per request, withdraw per retry,
/// retry 5xx.
#[derive(Clone)]
struct TowerPolicy(Arc<TpsBudget>);

impl<E> tower::retry::Policy<Request<Full<Bytes>>, Resp, E> for TowerPolicy {
    type Future = std::future::Ready<()>;

    fn retry(
        &mut self,
        _req: &mut Request<Full<Bytes>>,
        result: &mut Result<Resp, E>,
    ) -> Option<Self::Future> {
        match result {
            Ok(r) if r.status().is_server_error() => {
                self.0.withdraw().then(|| std::future::ready(()))
            }
            Ok(_) => {
                self.0.deposit();
                None
            }
            Err(_) => self.0.withdraw().then(|| std::future::ready(())),
        }
    }

    fn clone_request(&mut self, req: &Request<Full<Bytes>>) -> Option<Request<Full<Bytes>>> {
        let mut r = Request::new(req.body().clone());
        *r.uri_mut() = req.uri().clone();
        *r.headers_mut() = req.headers().clone();
        Some(r)
    }
}

/// Times `iters` requests through `svc`, one after another, each response dropped.
fn calls<S>(
    rt: &tokio::runtime::Runtime,
    iters: u64,
    svc: &mut S,
    req: impl Fn() -> Request<Full<Bytes>>,
) -> Duration
where
    S: Service<Request<Full<Bytes>>>,
    S::Error: std::fmt::Debug,
{
    rt.block_on(async {
        let t = Instant::now();
        for _ in 0..iters {
            let r = svc.ready().await.unwrap().call(req()).await;
            drop(black_box(r));
        }
        t.elapsed()
    })
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap()
}

fn bench(c: &mut Criterion) {
    let rt = runtime();
    let mut g = c.benchmark_group("per_call");
    g.warm_up_time(Duration::from_secs(1)).measurement_time(Duration::from_secs(3)).sample_size(50);

    let body = || Full::new(Bytes::from_static(b"{}"));
    let req = || Request::get("http://dep/x").body(body()).unwrap();

    g.bench_function("bare", |b| {
        let mut svc = noop::<Full<Bytes>>();
        b.iter_custom(|iters| calls(&rt, iters, &mut svc, req))
    });

    g.bench_function("tower_retry_tps_concurrency_limit", |b| {
        let policy = TowerPolicy(Arc::new(TpsBudget::new(Duration::from_secs(10), 10, 0.2)));
        let mut svc = ServiceBuilder::new()
            .retry(policy)
            .concurrency_limit(1_000)
            .service(noop::<Full<Bytes>>());
        b.iter_custom(|iters| calls(&rt, iters, &mut svc, req))
    });

    let dependency_with = |f: &dyn Fn(&mut DependencyConfig)| {
        let _guard = rt.enter();
        let mut c = DependencyConfig::new("bench");
        c.limiter.cap = 1_000;
        f(&mut c);
        Dependency::try_new(c).unwrap()
    };
    let dependency = || dependency_with(&|_| {});

    g.bench_function("stormguard_clone_body", |b| {
        let mut svc =
            StormguardLayer::new(dependency()).with_policy(CloneBody).layer(noop::<Full<Bytes>>());
        b.iter_custom(|iters| calls(&rt, iters, &mut svc, req))
    });

    // A background spawner (as the proxy always has: a timed-out or abandoned attempt runs on),
    // no hedging: the baseline of the next item.
    g.bench_function("stormguard_clone_body_background", |b| {
        let dep = dependency_with(&|c| c.background = Some(stormguard_tower::Spawner::tokio()));
        let mut svc = StormguardLayer::new(dep).with_policy(CloneBody).layer(noop::<Full<Bytes>>());
        b.iter_custom(|iters| calls(&rt, iters, &mut svc, req))
    });

    // Hedging on (after 100 ms, a background spawner) for a service that answers at once: what
    // a request pays for a hedge being possible when none is sent.
    g.bench_function("stormguard_clone_body_hedging_possible", |b| {
        let dep = dependency_with(&|c| {
            c.background = Some(stormguard_tower::Spawner::tokio());
            c.retry.hedge = Some(stormguard_core::hedge::HedgeConfig::new(
                stormguard_core::hedge::HedgeAfter::Fixed(std::time::Duration::from_millis(100)),
            ));
        });
        let mut svc = StormguardLayer::new(dep).with_policy(CloneBody).layer(noop::<Full<Bytes>>());
        b.iter_custom(|iters| calls(&rt, iters, &mut svc, req))
    });

    g.bench_function("stormguard_replay_body", |b| {
        let mut svc = StormguardLayer::new(dependency()).layer(noop::<ReplayBody<Full<Bytes>>>());
        b.iter_custom(|iters| {
            rt.block_on(async {
                let t = Instant::now();
                for _ in 0..iters {
                    let r = Request::get("http://dep/x")
                        .body(ReplayBody::new(body(), 64 * 1024))
                        .unwrap();
                    let r = svc.ready().await.unwrap().call(r).await;
                    drop(black_box(r));
                }
                t.elapsed()
            })
        })
    });
    g.finish();
}

/// tower's own stack over the no-op service: `Retry` with a `TpsBudget`, over
/// `ConcurrencyLimit`.
fn tower_stack() -> impl Service<Request<Full<Bytes>>, Response = Resp, Error = Infallible> {
    let policy = TowerPolicy(Arc::new(TpsBudget::new(Duration::from_secs(10), 10, 0.2)));
    ServiceBuilder::new().retry(policy).concurrency_limit(1_000).service(noop::<Full<Bytes>>())
}

/// The dependency the counted and interleaved modes put the no-op service under (on tokio's
/// clock, as `Dependency::try_new` is: time runs, so it reads the monotonic clock directly).
fn counted_dependency(rt: &tokio::runtime::Runtime) -> Dependency {
    let _guard = rt.enter();
    let mut c = DependencyConfig::new("bench");
    c.limiter.cap = 1_000;
    Dependency::try_new(c).unwrap()
}

/// `STACK_CALLS=N`: N calls through the stack named by the first argument, not timed.
fn count(item: &str, n: u64) {
    let rt = runtime();
    let req = || Request::get("http://dep/x").body(Full::new(Bytes::from_static(b"{}"))).unwrap();
    match item {
        "bare" => {
            let mut svc = noop::<Full<Bytes>>();
            calls(&rt, n, &mut svc, req);
        }
        "tower" => {
            calls(&rt, n, &mut tower_stack(), req);
        }
        "stormguard" => {
            let layer = StormguardLayer::new(counted_dependency(&rt)).with_policy(CloneBody);
            calls(&rt, n, &mut layer.layer(noop()), req);
        }
        other => panic!("STACK_CALLS: no stack {other:?} (bare, tower, stormguard)"),
    }
}

/// `STACK_RATIO=ROUNDS`: the three stacks (`bare`, `tower`, `stormguard`) timed in turn, a batch
/// of calls each per round, in one process; prints each stack's median and fastest batch, and
/// the added time's ratio (stormguard's over tower's) per round's median and from the fastest
/// batches. Interleaving by batch keeps a noisy machine's drift out of the ratio.
fn ratio(rounds: usize) {
    const BATCH: u64 = 20_000;
    let rt = runtime();
    let req = || Request::get("http://dep/x").body(Full::new(Bytes::from_static(b"{}"))).unwrap();
    let mut bare = noop::<Full<Bytes>>();
    let mut tower = tower_stack();
    let mut sg = StormguardLayer::new(counted_dependency(&rt)).with_policy(CloneBody).layer(noop());
    let ns = |d: Duration| d.as_nanos() as f64 / BATCH as f64;
    let (mut b, mut t, mut s, mut r) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for _ in 0..rounds {
        let x = ns(calls(&rt, BATCH, &mut bare, req));
        let y = ns(calls(&rt, BATCH, &mut tower, req));
        let z = ns(calls(&rt, BATCH, &mut sg, req));
        r.push((z - x) / (y - x));
        b.push(x);
        t.push(y);
        s.push(z);
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let fastest = |v: &[f64]| v.iter().copied().fold(f64::INFINITY, f64::min);
    let (fb, ft, fs) = (fastest(&b), fastest(&t), fastest(&s));
    println!(
        "ns per call, median of {rounds} rounds: bare {:.0}, tower {:.0}, stormguard {:.0}; \
         fastest: {fb:.0}, {ft:.0}, {fs:.0}",
        median(&mut b),
        median(&mut t),
        median(&mut s)
    );
    println!(
        "stormguard's added time over tower's: median of rounds {:.2}, of the fastest {:.2}",
        median(&mut r),
        (fs - fb) / (ft - fb)
    );
}

criterion_group!(benches, bench);

fn main() {
    if let Ok(n) = std::env::var("STACK_RATIO") {
        ratio(n.parse().expect("STACK_RATIO: a number of rounds"));
        return;
    }
    if let Ok(n) = std::env::var("STACK_CALLS") {
        let n = n.parse().expect("STACK_CALLS: a number of calls");
        let item = std::env::args().nth(1).expect("STACK_CALLS: name the stack");
        count(&item, n);
        return;
    }
    benches();
    Criterion::default().configure_from_args().final_summary();
}
