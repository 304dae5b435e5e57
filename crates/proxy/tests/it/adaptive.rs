//! The adaptive cap, judged at the dependency: chaos works on 20 requests at full speed and
//! stretches every answer by in flight / 20 past that (`workers = 20`), and an open loop offers
//! 1.5 times what it can serve (30 in flight at the unloaded 100 ms). Chaos's own count of
//! requests in flight, sampled every 100 ms, is the measure of the cap; the callers' p99 is
//! read against the bound the issue sets (three times the unloaded latency plus the queue
//! timeout), with room on both sides: the adaptive cap's p99 is about 1.12 s against 1.3 s,
//! the fixed cap's about 1.5 s.
//!
//! - With `--adaptive-cap 4..100` (starting at the planned 20) the dependency's mean in flight
//!   settles within 30 % of 20 and the callers' p99 of successful requests stays within three
//!   times the unloaded latency plus the queue timeout; with a fixed cap of 100 neither holds.
//! - The workers drop from 20 to 10 mid-run, then come back: the adaptive cap follows (lower in
//!   flight within 10 s of the drop, higher again after the recovery), and its success rate is
//!   at least that of the better of the fixed caps 20 and 40 chosen in hindsight, within 5
//!   points.
//!
//! The runs compared in one test go side by side (each its own chaos and proxy), so each sees
//! the same machine; the two tests take their turns. Together about 55 s.

use crate::common;

use common::*;

use std::sync::Arc;
use std::time::Duration;

use stormguard_chaos::{ChaosConfig, ChaosServer, Latency, OnDisconnect, Phase};
use stormguard_core::adaptive::AdaptiveConfig;
use stormguard_proxy::config::{ProxyConfig, ProxyDependency, ToTower};
use stormguard_proxy::start;
use tokio::sync::Mutex;

/// The unloaded latency.
const LATENCY: Duration = Duration::from_millis(100);
/// The open loop's rate: 30 in flight at the unloaded latency.
const PER_SECOND: u64 = 300;
/// The proxy's queue timeout.
const QUEUE_TIMEOUT: Duration = Duration::from_secs(1);

/// One test's runs at a time.
static RUNS: Mutex<()> = Mutex::const_new(());

/// The runs side by side, under the lock.
async fn side_by_side(
    phases: impl Fn() -> Vec<Phase>,
    secs: u64,
    caps: &[(u64, Option<AdaptiveConfig>)],
) -> Vec<Run> {
    let _one = RUNS.lock().await;
    let runs: Vec<_> =
        caps.iter().map(|&(cap, a)| tokio::spawn(run(phases(), secs, cap, a))).collect();
    let mut out = Vec::new();
    for r in runs {
        out.push(r.await.unwrap());
    }
    out
}

fn phase(name: &str, workers: u64, secs: Option<u64>) -> Phase {
    Phase {
        name: name.into(),
        duration: secs.map(Duration::from_secs),
        latency: Latency::Fixed(LATENCY),
        workers: Some(workers),
        ..Phase::default()
    }
}

async fn dependency(phases: Vec<Phase>) -> ChaosServer {
    let mut c = ChaosConfig::single(phases[0].clone());
    c.script.phases = phases;
    c.on_disconnect = OnDisconnect::Finish;
    stormguard_chaos::spawn(c, "127.0.0.1:0".parse().unwrap()).await.unwrap()
}

/// What a run saw: chaos's in flight every 100 ms, and each request's (start in seconds,
/// status, latency).
struct Run {
    in_flight: Vec<u64>,
    answers: Vec<(f64, u16, Duration)>,
}

impl Run {
    /// Mean in flight at the dependency between `from` and `to` seconds.
    fn mean_in_flight(&self, from: f64, to: f64) -> f64 {
        let (a, b) = ((from * 10.0) as usize, ((to * 10.0) as usize).min(self.in_flight.len()));
        let s = &self.in_flight[a..b];
        s.iter().sum::<u64>() as f64 / s.len().max(1) as f64
    }

    /// The share of requests started between `from` and `to` that succeeded.
    fn success(&self, from: f64, to: f64) -> f64 {
        let sent: Vec<_> = self.answers.iter().filter(|(t, ..)| *t >= from && *t < to).collect();
        sent.iter().filter(|(_, s, _)| *s == 200).count() as f64 / sent.len().max(1) as f64
    }

    /// The p99 latency of the successful requests started between `from` and `to`.
    fn p99_ok(&self, from: f64, to: f64) -> Duration {
        let mut l: Vec<_> = self
            .answers
            .iter()
            .filter(|(t, s, _)| *t >= from && *t < to && *s == 200)
            .map(|(_, _, l)| *l)
            .collect();
        l.sort();
        l.get(l.len() * 99 / 100).copied().unwrap_or_default()
    }
}

/// Runs the open loop for `secs` through a proxy with `cap` (and `adaptive`) in front of a
/// chaos playing `phases`.
async fn run(phases: Vec<Phase>, secs: u64, cap: u64, adaptive: Option<AdaptiveConfig>) -> Run {
    let upstream = dependency(phases).await;
    let mut d = ProxyDependency::new("dep", upstream.url("").parse().unwrap());
    d.cap = cap;
    d.adaptive = adaptive;
    // Room to wait for the whole queue timeout: the wait, not the queue's length, bounds it.
    d.queue = 1_000;
    d.queue_timeout = QUEUE_TIMEOUT;
    d.max_retries = 0;
    let mut c = ProxyConfig::single("127.0.0.1:0".parse().unwrap(), d);
    c.admin = None;
    let p = start(c).await.unwrap();
    let addr = p.listen_addrs()[0];
    let upstream = Arc::new(upstream);
    let started = tokio::time::Instant::now();
    let sampler = {
        let upstream = upstream.clone();
        tokio::spawn(async move {
            let mut seen = Vec::new();
            let mut tick = tokio::time::interval(Duration::from_millis(100));
            for _ in 0..secs * 10 {
                tick.tick().await;
                seen.push(upstream.stats().in_flight_now);
            }
            seen
        })
    };
    let client = client();
    let every = Duration::from_secs(1) / PER_SECOND as u32;
    let mut tasks = Vec::new();
    for i in 0..secs * PER_SECOND {
        let at = started + every * i as u32;
        tokio::time::sleep_until(at).await;
        let client = client.clone();
        tasks.push(tokio::spawn(async move {
            let t = tokio::time::Instant::now();
            let uri = format!("http://{addr}/").parse().unwrap();
            let status = match tokio::time::timeout(Duration::from_secs(30), client.get(uri)).await
            {
                Ok(Ok(r)) => {
                    let status = r.status().as_u16();
                    let _ = http_body_util::BodyExt::collect(r.into_body()).await;
                    status
                }
                _ => 0,
            };
            (t.duration_since(started).as_secs_f64(), status, t.elapsed())
        }));
    }
    let mut answers = Vec::new();
    for t in tasks {
        answers.push(t.await.unwrap());
    }
    let in_flight = sampler.await.unwrap();
    p.shutdown().await;
    Run { in_flight, answers }
}

/// Settles within 30 % of the 20 workers, and the callers' p99 stays bounded; a fixed cap of
/// 100 lets the overload through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_adaptive_cap_settles_near_what_the_dependency_can_take() {
    const SECS: u64 = 16;
    let bound = LATENCY * 3 + QUEUE_TIMEOUT;
    let phases = || vec![phase("20 workers", 20, None)];
    let mut runs =
        side_by_side(phases, SECS, &[(20, Some("4..100".parse().unwrap())), (100, None)])
            .await
            .into_iter();
    let (adaptive, fixed) = (runs.next().unwrap(), runs.next().unwrap());
    let (mean, p99) = (adaptive.mean_in_flight(8.0, 16.0), adaptive.p99_ok(8.0, 16.0));
    eprintln!(
        "adaptive 4..100: mean in flight {mean:.1} (8-16 s), p99 {p99:?}, success {:.1} %",
        adaptive.success(0.0, 16.0) * 100.0
    );
    let (f_mean, f_p99) = (fixed.mean_in_flight(8.0, 16.0), fixed.p99_ok(8.0, 16.0));
    eprintln!(
        "fixed 100: mean in flight {f_mean:.1} (8-16 s), p99 {f_p99:?}, success {:.1} %",
        fixed.success(0.0, 16.0) * 100.0
    );
    assert!((14.0..=26.0).contains(&mean), "adaptive: mean in flight {mean:.1}");
    assert!(p99 <= bound, "adaptive: p99 {p99:?} above {bound:?}");
    assert!(f_mean > 26.0, "fixed 100: mean in flight {f_mean:.1}");
    assert!(f_p99 > bound, "fixed 100: p99 {f_p99:?} within {bound:?}");
}

/// The workers drop from 20 to 10 at 10 s and come back at 25 s: the adaptive cap follows, and
/// succeeds as often as the better of the fixed caps 20 (the plan) and 40. (A fixed cap of 10
/// cannot be the best here: it serves at most 100 of the 300 offered a second — 33.4 % when it
/// was run beside them; it is left out to keep the test's time down.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_adaptive_cap_follows_a_capacity_drop_and_the_recovery() {
    const SECS: u64 = 37;
    let phases = || {
        vec![
            phase("20 workers", 20, Some(10)),
            phase("10 workers", 10, Some(15)),
            phase("20 again", 20, None),
        ]
    };
    let mut runs =
        side_by_side(phases, SECS, &[(20, Some("4..40".parse().unwrap())), (20, None), (40, None)])
            .await
            .into_iter();
    let adaptive = runs.next().unwrap();
    let before = adaptive.mean_in_flight(5.0, 10.0);
    let dropped = adaptive.mean_in_flight(20.0, 25.0);
    let recovered = adaptive.mean_in_flight(33.0, 37.0);
    let success = adaptive.success(0.0, SECS as f64);
    eprintln!(
        "adaptive 4..40: in flight {before:.1} before, {dropped:.1} 10-15 s after the drop, \
         {recovered:.1} 8-12 s after the recovery; success {:.1} %",
        success * 100.0
    );
    let mut best = (0.0, 0);
    for (cap, fixed) in [20, 40].into_iter().zip(runs) {
        let s = fixed.success(0.0, SECS as f64);
        eprintln!(
            "fixed {cap}: in flight {:.1} / {:.1} / {:.1}, success {:.1} %",
            fixed.mean_in_flight(5.0, 10.0),
            fixed.mean_in_flight(20.0, 25.0),
            fixed.mean_in_flight(33.0, 37.0),
            s * 100.0
        );
        if s > best.0 {
            best = (s, cap);
        }
    }
    assert!(dropped < before * 0.8, "in flight {before:.1} before the drop, {dropped:.1} after");
    assert!(dropped <= 10.0 * 1.6, "{dropped:.1} in flight on 10 workers");
    assert!(
        recovered > dropped * 1.2,
        "{dropped:.1} in flight at 10 workers, {recovered:.1} after"
    );
    assert!(
        success >= best.0 - 0.05,
        "adaptive {:.1} % against the fixed cap {}'s {:.1} %",
        success * 100.0,
        best.1,
        best.0 * 100.0
    );
}

/// An adaptive cap on the dependency applies to each of its upstreams, each adapting on its
/// own; an upstream's own `adaptive` replaces it; a bad one names its key.
#[test]
fn an_upstream_may_have_its_own_adaptive_cap() {
    let text = r#"
admin = "off"

[[listener]]
listen = "127.0.0.1:0"
dependency = "llm"

[[dependency]]
name = "llm"
cap = 20
adaptive = { min = 4, max = 40 }
upstreams = [
  "http://127.0.0.1:1",
  { url = "http://127.0.0.1:2", cap = 10, adaptive = { min = 2, max = 16, algorithm = "aimd" } },
]
"#;
    let c = ProxyConfig::parse(text, "proxy.toml").unwrap();
    let d = &c.dependencies[0];
    let (first, second) = (d.upstream_adaptive(0).unwrap(), d.upstream_adaptive(1).unwrap());
    assert_eq!((first.min, first.max, first.algorithm.to_string()), (4, 40, "gradient2".into()));
    assert_eq!((second.min, second.max, second.algorithm.to_string()), (2, 16, "aimd".into()));
    let dep = stormguard_tower::Dependency::try_new(d.to_tower()).unwrap();
    let caps: Vec<_> = (0..2)
        .map(|i| {
            let s = dep.upstream_at(i).limiter.snapshot();
            (s.effective_cap, s.cap)
        })
        .collect();
    // Each starts at its planned cap, under its own ceiling.
    assert_eq!(caps, [(20, 40), (10, 16)]);

    // Without one on the dependency, only the upstream that has its own adapts: the other
    // keeps its fixed cap (it does not take the first upstream's).
    let own_only = text
        .replace("adaptive = { min = 4, max = 40 }\n", "")
        .replace(
            "\"http://127.0.0.1:1\",",
            "{ url = \"http://127.0.0.1:1\", adaptive = { min = 4, max = 40 } },",
        )
        .replace(", adaptive = { min = 2, max = 16, algorithm = \"aimd\" }", "");
    let c = ProxyConfig::parse(&own_only, "proxy.toml").unwrap();
    let dep = stormguard_tower::Dependency::try_new(c.dependencies[0].to_tower()).unwrap();
    let snaps: Vec<_> = (0..2).map(|i| dep.upstream_at(i).limiter.snapshot()).collect();
    assert!(snaps[0].adaptive.is_some(), "{own_only}");
    assert_eq!((snaps[1].adaptive, snaps[1].cap), (None, 10), "{own_only}");

    let bad = text.replace("min = 2, max = 16", "min = 20, max = 16");
    let e = ProxyConfig::parse(&bad, "proxy.toml").unwrap_err().to_string();
    assert!(e.contains("proxy.toml") && e.contains("upstreams[1].adaptive.min"), "{e}");
}
