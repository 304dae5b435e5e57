//! The closure API, judged where it counts: at the dependency. The dependency here is a
//! model of a server — each call's work runs on its own task (a caller that gives up does not
//! stop it) and the model counts what is running — on paused tokio time, so every run is the
//! same run. Each guarantee is also run without its protection, to show that it breaks.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use stormguard_core::Denied;
use stormguard_core::hedge::{HedgeAfter, HedgeConfig};
use stormguard_core::random::{RandomSource, SplitMix64};
use stormguard_tower::call::{Attempt, CallError, Failure, Outcome};
use stormguard_tower::{Dependency, DependencyConfig};
use tokio::time::Instant;

/// The model server: work of `latency`, a seeded share of it failing.
#[derive(Clone)]
struct Server {
    latency: Duration,
    error_rate: f64,
    in_flight: Arc<AtomicU64>,
    max: Arc<AtomicU64>,
    /// (arrival since the start, attempt number, hedge) of each attempt that reached it.
    arrivals: Arc<Mutex<Vec<(Duration, u32, bool)>>>,
    rng: Arc<Mutex<SplitMix64>>,
    start: Instant,
}

/// An attempt as the server sees it: its number, and whether it is a hedge.
#[derive(Clone, Copy)]
struct Try(u32, bool);

impl From<Attempt> for Try {
    fn from(a: Attempt) -> Try {
        Try(a.number(), a.is_hedge())
    }
}

#[derive(Debug, PartialEq)]
enum DbError {
    Serialization,
    Unavailable,
    NotFound,
}

impl std::fmt::Display for DbError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{self:?}")
    }
}

impl std::error::Error for DbError {}

impl Server {
    fn new(latency: Duration, error_rate: f64) -> Server {
        Server {
            latency,
            error_rate,
            in_flight: Arc::default(),
            max: Arc::default(),
            arrivals: Arc::default(),
            rng: Arc::new(Mutex::new(SplitMix64::new(42))),
            start: Instant::now(),
        }
    }

    /// One attempt: the work starts now and runs to its end whatever the caller does.
    fn run(
        &self,
        attempt: Try,
        latency: Duration,
        answer: Result<u32, DbError>,
    ) -> impl Future<Output = Result<u32, DbError>> + Send + use<> {
        let n = self.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        self.max.fetch_max(n, Ordering::SeqCst);
        let at = self.start.elapsed();
        self.arrivals.lock().unwrap().push((at, attempt.0, attempt.1));
        let in_flight = self.in_flight.clone();
        let work = tokio::spawn(async move {
            tokio::time::sleep(latency).await;
            in_flight.fetch_sub(1, Ordering::SeqCst);
            answer
        });
        async move { work.await.unwrap() }
    }

    /// An attempt that fails (`Unavailable`) with the server's error rate.
    fn seeded(&self, attempt: Try) -> impl Future<Output = Result<u32, DbError>> + Send + use<> {
        let fail = (self.rng.lock().unwrap().below(1_000_000) as f64) < self.error_rate * 1e6;
        let answer = if fail { Err(DbError::Unavailable) } else { Ok(attempt.0) };
        self.run(attempt, self.latency, answer)
    }

    fn max(&self) -> u64 {
        self.max.load(Ordering::SeqCst)
    }

    fn arrivals(&self) -> Vec<(Duration, u32, bool)> {
        self.arrivals.lock().unwrap().clone()
    }

    /// Attempts after the first, and first tries, that reached the server.
    fn retries_and_originals(&self) -> (usize, usize) {
        let a = self.arrivals();
        let originals = a.iter().filter(|(_, n, _)| *n == 1).count();
        (a.len() - originals, originals)
    }
}

fn config(cap: u64, budget: &str) -> DependencyConfig {
    let mut c = DependencyConfig::new("db");
    c.limiter.cap = cap;
    c.budget = budget.parse().unwrap();
    c
}

/// Open-loop arrivals, one every `every`, for `run`: each call spawned on its own, so callers
/// never slow down when the dependency does.
async fn open_loop<F, Fut>(every: Duration, run: Duration, call: F)
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
    for c in calls {
        c.await.unwrap();
    }
}

/// 160 calls a second against 100 ms of work (16 in flight when all is well), 40 % of
/// attempts failing: through stormguard, the server never runs more than the cap of 20 at
/// once, and retries stay within the 20 % budget of first tries. A naive loop that retries
/// each error up to three times — what `backon` or `tokio-retry` do with their defaults —
/// puts several times the budget on the same server and passes the cap.
#[tokio::test(start_paused = true)]
async fn a_closures_attempts_stay_under_the_cap_and_its_retries_under_the_budget() {
    const EVERY: Duration = Duration::from_micros(6_250);
    const RUN: Duration = Duration::from_secs(20);
    let server = Server::new(Duration::from_millis(100), 0.4);
    let dep = Dependency::try_new(config(20, "ratio:percent=0.2,min_per_sec=0")).unwrap();
    let (s, d) = (server.clone(), dep.clone());
    open_loop(EVERY, RUN, move || {
        let (s, d) = (s.clone(), d.clone());
        async move {
            let _ = d.call(|a| s.seeded(a.into())).await;
        }
    })
    .await;
    let (retries, originals) = server.retries_and_originals();
    let ratio = retries as f64 / originals as f64;
    eprintln!("stormguard: max {} at the server, retries {retries} / {originals}", server.max());
    assert!(server.max() <= 20, "the server ran {} at once, over the cap of 20", server.max());
    assert!(
        ratio <= 0.21,
        "retries {retries} of {originals} first tries: {ratio:.3} > the 20 % budget"
    );
    assert!(retries > 0, "the budget allows retries, and some were sent");

    // Without stormguard: a retry loop of three retries on every error.
    let naive = Server::new(Duration::from_millis(100), 0.4);
    let n = naive.clone();
    open_loop(EVERY, RUN, move || {
        let n = n.clone();
        async move {
            for number in 1..=4 {
                if n.seeded(Try(number, false)).await.is_ok() {
                    break;
                }
            }
        }
    })
    .await;
    let (retries, originals) = naive.retries_and_originals();
    let naive_ratio = retries as f64 / originals as f64;
    eprintln!("naive: max {} at the server, retries {retries} / {originals}", naive.max());
    assert!(naive.max() > 20, "the naive loop stayed under the cap: {}", naive.max());
    assert!(naive_ratio > 0.5, "the naive loop retried only {naive_ratio:.3}");
}

/// The operation stops answering (work of 1 s, a per-try timeout of 50 ms): each timed-out
/// attempt keeps its slot while the server still runs it, so the server never runs more than
/// the cap. With the hold set to nothing, the slots come back at each timeout and the retries
/// and new calls pile onto work the server is still doing.
#[tokio::test(start_paused = true)]
async fn a_timed_out_attempt_keeps_its_slot_while_the_dependency_still_runs_it() {
    for hold in [Duration::from_secs(2), Duration::ZERO] {
        let server = Server::new(Duration::from_secs(1), 0.0);
        let mut c = config(4, "ratio:percent=0.5,min_per_sec=10");
        c.per_try_timeout = Some(Duration::from_millis(50));
        c.timeout_slot_hold = hold;
        let dep = Dependency::try_new(c).unwrap();
        let (s, d) = (server.clone(), dep.clone());
        open_loop(Duration::from_millis(10), Duration::from_millis(400), move || {
            let (s, d) = (s.clone(), d.clone());
            async move {
                let r = d.call(|a| s.seeded(a.into())).await;
                assert!(r.is_err(), "every attempt times out");
            }
        })
        .await;
        match hold {
            Duration::ZERO => {
                assert!(server.max() > 4, "no hold, yet the cap held: {}", server.max())
            }
            _ => assert!(
                server.max() <= 4,
                "the server ran {} at once, over the cap of 4",
                server.max()
            ),
        }
    }
}

/// What the classifier says decides what is retried: a final answer never, a transient failure
/// of a call that is not idempotent never (it may have run), contention that took no effect
/// always; the error comes back with the reason it was not retried.
#[tokio::test(start_paused = true)]
async fn the_classifier_decides_what_is_retried() {
    let classify = |r: &Result<u32, DbError>| match r {
        Ok(_) => Outcome::Success,
        Err(DbError::NotFound) => Outcome::Final,
        Err(DbError::Serialization) => Outcome::Failure(Failure::contention()),
        Err(DbError::Unavailable) => Outcome::Failure(Failure::transient()),
    };
    let dep = Dependency::try_new(config(4, "ratio:percent=0.5,min_per_sec=10")).unwrap();
    let ms = Duration::from_millis(5);
    // Fails once with `error`, then answers.
    let once = |server: &Server, error: DbError| {
        let first = Mutex::new(Some(error));
        let server = server.clone();
        move |a: Attempt| {
            let answer = match first.lock().unwrap().take() {
                Some(e) => Err(e),
                None => Ok(a.number()),
            };
            server.run(a.into(), ms, answer)
        }
    };

    let s = Server::new(ms, 0.0);
    let r = dep.call(once(&s, DbError::NotFound)).classify(classify).await;
    assert!(
        matches!(r, Err(CallError::Failed { source: DbError::NotFound, refused: None })),
        "{r:?}"
    );
    assert_eq!(s.arrivals().len(), 1, "a final answer is not retried");

    let s = Server::new(ms, 0.0);
    let r = dep.call(once(&s, DbError::Unavailable)).classify(classify).idempotent(false).await;
    assert!(
        matches!(r, Err(CallError::Failed { refused: Some(Denied::NonIdempotent), .. })),
        "{r:?}"
    );
    assert_eq!(s.arrivals().len(), 1, "a call that may have run is not run twice");

    let s = Server::new(ms, 0.0);
    let r = dep.call(once(&s, DbError::Serialization)).classify(classify).idempotent(false).await;
    assert_eq!(r.unwrap(), 2, "contention that took no effect is retried, even not idempotent");
    assert_eq!(s.arrivals().len(), 2);

    let s = Server::new(ms, 0.0);
    let r = dep.call(once(&s, DbError::Unavailable)).classify(classify).await;
    assert_eq!(r.unwrap(), 2, "an idempotent call is retried after a transient failure");
}

/// The dependency's word is honoured: a failure that says "retry after 700 ms" is retried no
/// sooner.
#[tokio::test(start_paused = true)]
async fn a_failures_retry_after_is_waited() {
    let dep = Dependency::try_new(config(4, "ratio:percent=0.5,min_per_sec=10")).unwrap();
    let s = Server::new(Duration::from_millis(5), 0.0);
    let wait = Duration::from_millis(700);
    let r = dep
        .call(|a| {
            s.run(
                a.into(),
                Duration::from_millis(5),
                if a.is_retry() { Ok(2) } else { Err(DbError::Unavailable) },
            )
        })
        .classify(move |r: &Result<u32, DbError>| match r {
            Ok(_) => Outcome::Success,
            Err(_) => Outcome::Failure(Failure::transient().retry_after(wait)),
        })
        .await;
    assert_eq!(r.unwrap(), 2);
    let a = s.arrivals();
    assert_eq!(a.len(), 2);
    assert!(a[1].0 - a[0].0 >= wait, "the retry came {:?} after the first try", a[1].0 - a[0].0);
}

/// A first try that finds the cap full and no queue is refused at once, and the operation never
/// runs; a retry's refusal says why.
#[tokio::test(start_paused = true)]
async fn a_call_refused_by_the_cap_never_runs() {
    let mut c = config(1, "ratio:percent=0.5,min_per_sec=10");
    c.limiter.queue_len = 0;
    let dep = Dependency::try_new(c).unwrap();
    let s = Server::new(Duration::from_millis(100), 0.0);
    let (d, s2) = (dep.clone(), s.clone());
    let first = tokio::spawn(async move { d.call(|a| s2.seeded(a.into())).await });
    tokio::task::yield_now().await;
    let second = dep.call(|a| s.seeded(a.into())).await;
    assert!(matches!(second, Err(CallError::Refused(Denied::Queue))), "{second:?}");
    assert_eq!(first.await.unwrap().unwrap(), 1);
    assert_eq!(s.arrivals().len(), 1, "the refused call never reached the server");
}

/// With hedging on, a slow first attempt gets a hedge beside it after the delay; the first
/// answer is the caller's.
#[tokio::test(start_paused = true)]
async fn a_slow_attempt_is_hedged_and_the_first_answer_wins() {
    let mut c = config(4, "ratio:percent=0.5,min_per_sec=10");
    c.retry.hedge = Some(HedgeConfig::new(HedgeAfter::Fixed(Duration::from_millis(50))));
    // Hedging asks for a spawner (the tower layer runs its losers on there); a call's loser
    // is dropped, its slot held for abandon_hold.
    c.background = Some(stormguard_tower::Spawner::tokio());
    let dep = Dependency::try_new(c).unwrap();
    let s = Server::new(Duration::from_millis(5), 0.0);
    let start = Instant::now();
    let r = dep
        .call(|a| {
            let latency =
                if a.is_hedge() { Duration::from_millis(10) } else { Duration::from_secs(1) };
            s.run(a.into(), latency, Ok(a.number()))
        })
        .await;
    assert_eq!(r.unwrap(), 2, "the hedge answered first");
    assert!(start.elapsed() < Duration::from_millis(100), "{:?}", start.elapsed());
    let a = s.arrivals();
    assert_eq!(a.iter().map(|(_, n, h)| (*n, *h)).collect::<Vec<_>>(), [(1, false), (2, true)]);
}

/// A retry admitted while the breaker was half-open, but refused as it is sent (another call
/// holds the one probe place): the caller gets the failure it was retrying, with the reason —
/// not a refusal that would say the operation never ran.
#[tokio::test(start_paused = true)]
async fn a_retry_the_breaker_refuses_returns_the_failure_it_retried() {
    let mut c = config(4, "ratio:percent=0.5,min_per_sec=10");
    c.breaker = Some(stormguard_core::breaker::BreakerConfig {
        consecutive_failures: Some(2),
        break_duration: Duration::from_millis(50),
        ..Default::default()
    });
    c.retry.backoff = stormguard_core::backoff::BackoffConfig::parse_range("100ms..150ms").unwrap();
    let dep = Dependency::try_new(c).unwrap();
    let s = Server::new(Duration::from_millis(5), 0.0);
    let ms = Duration::from_millis;
    // Y fails at once (one failure in a row); its retry waits 100–150 ms.
    let (d, s1) = (dep.clone(), s.clone());
    let y = tokio::spawn(async move {
        d.call(|a| {
            let answer = if a.is_retry() { Ok(2) } else { Err(DbError::Unavailable) };
            s1.run(a.into(), ms(1), answer)
        })
        .await
    });
    tokio::time::sleep(ms(10)).await;
    // Z fails too: two in a row, the breaker opens for 50 ms.
    let z = dep.call(|a| s.run(a.into(), ms(1), Err(DbError::Unavailable))).await;
    assert!(z.is_err());
    // Half-open at 60 ms: X takes the one probe place, and holds it for a second.
    tokio::time::sleep(ms(60)).await;
    let (d, s2) = (dep.clone(), s.clone());
    let x = tokio::spawn(async move { d.call(|a| s2.run(a.into(), ms(1000), Ok(1))).await });
    let y = y.await.unwrap();
    match y {
        Err(CallError::Failed { source: DbError::Unavailable, refused: Some(Denied::Breaker) }) => {
        }
        other => panic!("the retried failure with the breaker's refusal, not {other:?}"),
    }
    assert_eq!(x.await.unwrap().unwrap(), 1);
    // Y's retry was never called: the server (which starts its work when called) saw first
    // tries only.
    assert!(s.arrivals().iter().all(|(_, n, _)| *n == 1), "{:?}", s.arrivals());
}

/// A call of a call tree (`.tree(ctx)`): its retries come out of the tree's allowance as well
/// as the budget, and each attempt is handed the context to pass on — one more spent on a
/// retry.
#[tokio::test(start_paused = true)]
async fn a_calls_retries_are_charged_to_its_call_tree() {
    let dep = Dependency::try_new(config(4, "ratio:percent=10,min_per_sec=100")).unwrap();
    let ctx: stormguard_core::tree::TreeContext = "1.1".parse().unwrap();
    let passed = Mutex::new(Vec::new());
    let mut refused = 0;
    for _ in 0..20 {
        let r = dep
            .call(|a: Attempt| {
                passed.lock().unwrap().push(a.tree().map(|t| t.spent));
                async { Err::<(), _>(std::io::Error::other("unavailable")) }
            })
            .tree(ctx)
            .await;
        refused +=
            usize::from(matches!(r, Err(CallError::Failed { refused: Some(Denied::Tree), .. })));
    }
    let passed = passed.into_inner().unwrap();
    assert_eq!(passed.len(), 22, "twenty calls and the two extras an allowance of 1.1 gives");
    assert_eq!(passed.iter().filter(|s| **s == Some(1)).count(), 2, "{passed:?}");
    assert_eq!(refused, 20);
    assert_eq!(dep.snapshot().tree.charged, 2);
}
