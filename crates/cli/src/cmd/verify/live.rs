//! One policy's live run: chaos serving the scenario's timeline, the policy in front of it
//! (`stormguard proxy` or the naive forwarder), the simulator's arrivals sent at their instants,
//! and what the dependency and the callers saw, per segment.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde::Serialize;
use stormguard_chaos::{ChaosConfig, ChaosServer, OnDisconnect};
use stormguard_proxy::config::{ProxyConfig, ProxyDependency};
use stormguard_sim::Scenario;
use stormguard_sim::scenario::{PolicyConfig, RetryRule};

use crate::Failure;
use crate::cmd::demo::naive;

/// Why a policy is predicted only, not run live.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NotLive {
    /// Retries taken from a pool of their own: the proxy has one cap for every attempt.
    #[error("retries from a separate pool: the proxy has one cap for every attempt")]
    RetryPool,
    /// Naive retries under a cap: the proxy budgets every retry it sends.
    #[error("naive retries under a cap: the proxy budgets every retry it sends")]
    NaiveUnderCap,
    /// A whole-action retry scope: verify sends one call per action.
    #[error("scope_retries: verify sends one call per action")]
    Scope,
    /// Rate admission: chaos serves no provider limits from a scenario yet.
    #[error("rate admission: chaos serves no provider limits from a scenario")]
    Rate,
}

/// What stands in front of chaos for one policy.
#[derive(Debug, Clone)]
pub enum Plan {
    /// `stormguard proxy` with this dependency (its upstream filled in at the run).
    Proxy(Box<ProxyDependency>),
    /// The naive forwarder.
    Naive(naive::Retries),
}

impl Plan {
    /// How `policy` runs live under `sc`'s client, or why it cannot.
    pub fn of(sc: &Scenario, policy: &PolicyConfig) -> Result<Plan, NotLive> {
        if policy.scope_retries.is_some() {
            return Err(NotLive::Scope);
        }
        if policy.rate.is_some() {
            return Err(NotLive::Rate);
        }
        let client = &sc.client;
        // A budget policy always has a cap (the proxy's 20 when the file gives none).
        let Some(cap) = policy.cap else {
            return Ok(Plan::Naive(naive::Retries {
                per_try_timeout: client.per_try_timeout,
                max: match &policy.retry {
                    RetryRule::Naive { max_retries, .. } => *max_retries,
                    _ => 0,
                },
                backoff: match &policy.retry {
                    RetryRule::Naive { backoff, .. } => *backoff,
                    _ => None,
                },
            }));
        };
        if cap.retry_pool.is_some() {
            return Err(NotLive::RetryPool);
        }
        if matches!(policy.retry, RetryRule::Naive { .. }) {
            return Err(NotLive::NaiveUnderCap);
        }
        // The upstream is chaos's, known once it listens.
        let mut d = ProxyDependency::new("verify", http::Uri::from_static("http://127.0.0.1:9"));
        d.cap = cap.cap;
        d.queue = cap.queue_len;
        d.queue_timeout = cap.queue_timeout;
        d.adaptive = cap.adaptive;
        d.retry_on = client.retry_on.clone();
        d.per_try_timeout = client.per_try_timeout;
        d.deadline = Some(client.deadline);
        d.timeout_slot_hold = client.timeout_slot_hold;
        d.abandon_hold = client.timeout_slot_hold;
        d.breaker = policy.breaker;
        d.scope_retries = 0;
        match policy.retry_config(client) {
            Some(rules) => {
                if let RetryRule::Budget { spec, .. } = &policy.retry {
                    d.budget = *spec;
                }
                d.max_retries = rules.max_retries;
                d.backoff = rules.backoff;
                d.hedge = rules.hedge;
            }
            None => d.max_retries = 0,
        }
        Ok(Plan::Proxy(Box::new(d)))
    }

    /// Checks what the plan will run, before anything runs: the proxy's config as the proxy
    /// would check it.
    pub fn check(&self) -> Result<(), Failure> {
        match self {
            Plan::Proxy(d) => {
                ProxyConfig::single(SocketAddr::from(([127, 0, 0, 1], 0)), (**d).clone())
                    .validate()
                    .map_err(|e| Failure::usage(format!("the proxy's config: {e}")))
            }
            Plan::Naive(_) => Ok(()),
        }
    }

    /// What stands in front of chaos, in words.
    pub fn front_name(&self) -> &'static str {
        match self {
            Plan::Proxy(_) => "stormguard proxy",
            Plan::Naive(_) => "naive forwarder",
        }
    }
}

/// What one segment of the timeline measured live.
#[derive(Debug, Clone, Copy, Default, Serialize, PartialEq)]
pub struct Measured {
    /// Attempts in flight at chaos, the mean over the segment's time (sampled every ms).
    pub in_flight_mean: f64,
    /// Their 99th percentile over time.
    pub in_flight_p99: u64,
    /// The most, exactly (chaos's count at each arrival).
    pub in_flight_max: u64,
    /// Attempts chaos received per first try.
    pub amplification: f64,
    /// Attempts chaos received.
    pub attempts: u64,
    /// User actions started in the segment.
    pub actions: u64,
    /// The fraction of them that succeeded.
    pub success: f64,
    /// Their latency's median, in ms (failed ones included, as the model's).
    pub latency_p50_ms: f64,
    /// Their latency's 99th percentile, in ms.
    pub latency_p99_ms: f64,
}

/// One action's outcome: when it was due, whether it succeeded, how long it took.
type Outcome = (Duration, bool, Duration);

/// Runs `plan` live against the scenario's dependency: one [`Measured`] per segment, and how
/// much longer than drawn chaos held its answers on average (its own share, [`Lateness`]).
///
/// [`Lateness`]: stormguard_chaos::Lateness
pub async fn run(sc: &Scenario, plan: &Plan) -> Result<(Vec<Measured>, Duration), Failure> {
    let script = crate::cmd::chaos_scenario::script(sc)
        .map_err(|e| Failure::usage(format!("{}: {e}", sc.name)))?;
    let mut config = ChaosConfig::new(script);
    // The dependency does not know its caller gave up: it finishes what it started.
    config.on_disconnect = OnDisconnect::Finish;
    // The timeline starts once everything listens, so the first arrivals are on time.
    config.start = Some(Instant::now() + Duration::from_millis(300));
    let loopback = SocketAddr::from(([127, 0, 0, 1], 0));
    let chaos = Arc::new(
        stormguard_chaos::spawn(config, loopback)
            .await
            .map_err(|e| Failure::runtime(format!("cannot start chaos: {e}")))?,
    );
    let upstream: http::Uri =
        chaos.url("").parse().map_err(|e| Failure::runtime(format!("chaos's url: {e}")))?;
    let (target, front) = match plan {
        Plan::Proxy(d) => {
            let mut d = (**d).clone();
            d.upstreams = vec![upstream];
            let mut c = ProxyConfig::single(loopback, d);
            c.admin = None;
            c.validate()
                .map_err(|e| Failure::usage(format!("{}: the proxy's config: {e}", sc.name)))?;
            let p = stormguard_proxy::start(c)
                .await
                .map_err(|e| Failure::runtime(format!("cannot start the proxy: {e}")))?;
            (p.listen_addrs()[0], Front::Proxy(p))
        }
        Plan::Naive(retries) => {
            let n = naive::start(upstream, *retries)
                .await
                .map_err(|e| Failure::runtime(format!("cannot start the forwarder: {e}")))?;
            (n.local_addr(), Front::Naive(n))
        }
    };
    let t0 = chaos.started();
    let samples = sample_in_flight(chaos.clone(), t0, sc.duration);
    let outcomes = send(sc, target, t0).await?;
    // The sampler stops at the end of arrivals; joined off the runtime's threads.
    let samples = tokio::task::spawn_blocking(move || samples.join())
        .await
        .ok()
        .and_then(Result::ok)
        .ok_or_else(|| Failure::runtime("the in-flight sampler failed"))?;
    let stats = chaos.stats();
    if let Front::Proxy(p) = front {
        p.shutdown().await;
    }
    if let Ok(chaos) = Arc::try_unwrap(chaos) {
        chaos.shutdown().await;
    }
    let segments = sc
        .segments()
        .iter()
        .enumerate()
        .map(|(i, seg)| {
            let in_segment = |t: Duration| t >= seg.start && t < seg.end;
            let mut counts: Vec<u64> =
                samples.iter().filter(|(t, _)| in_segment(*t)).map(|(_, n)| *n).collect();
            counts.sort_unstable();
            let phase = stats.phases.iter().find(|p| p.index == i).map(|p| &p.counts);
            let (requests, retries) = phase.map_or((0, 0), |c| (c.requests, c.retries));
            let actions: Vec<&Outcome> =
                outcomes.iter().filter(|(at, ..)| in_segment(*at)).collect();
            let ok = actions.iter().filter(|(_, ok, _)| *ok).count();
            // The simulator's histogram, read the simulator's way.
            let mut took = stormguard_sim::latency_histogram();
            actions
                .iter()
                .for_each(|(_, _, t)| took.record(u64::try_from(t.as_nanos()).unwrap_or(u64::MAX)));
            let ms = |q: f64| took.quantile(q).map_or(0.0, |n| n as f64 / 1e6);
            Measured {
                in_flight_mean: counts.iter().sum::<u64>() as f64 / counts.len().max(1) as f64,
                in_flight_p99: quantile(&counts, 0.99).copied().unwrap_or(0),
                in_flight_max: phase.map_or(0, |c| c.in_flight.max),
                amplification: requests as f64 / requests.saturating_sub(retries).max(1) as f64,
                attempts: requests,
                actions: actions.len() as u64,
                success: ok as f64 / actions.len().max(1) as f64,
                latency_p50_ms: ms(0.5),
                latency_p99_ms: ms(0.99),
            }
        })
        .collect();
    Ok((segments, stats.total.late.mean()))
}

/// Kept alive for the run.
enum Front {
    Proxy(stormguard_proxy::ProxyHandle),
    #[allow(dead_code)] // held, so the forwarder runs until the end
    Naive(naive::Naive),
}

/// The smallest item at or below which `q` of the sorted `items` lie.
fn quantile<T>(sorted: &[T], q: f64) -> Option<&T> {
    let i = ((sorted.len() as f64 * q).ceil() as usize).clamp(1, sorted.len().max(1)) - 1;
    sorted.get(i)
}

/// Chaos's in-flight count every millisecond on a thread of its own (the runtime's two are
/// busy with the traffic), from `t0` for `duration`.
fn sample_in_flight(
    chaos: Arc<ChaosServer>,
    t0: Instant,
    duration: Duration,
) -> std::thread::JoinHandle<Vec<(Duration, u64)>> {
    std::thread::spawn(move || {
        let mut seen = Vec::with_capacity(duration.as_millis() as usize + 1);
        loop {
            let t = t0.elapsed();
            if t >= duration {
                return seen;
            }
            seen.push((t, chaos.in_flight()));
            std::thread::sleep(Duration::from_millis(1));
        }
    })
}

/// Sends the simulator's arrivals to `target`, each at `t0` plus its instant, and waits for
/// every answer (each within the scenario's deadline, plus a moment for the proxy's own answer
/// at the deadline to arrive).
async fn send(sc: &Scenario, target: SocketAddr, t0: Instant) -> Result<Vec<Outcome>, Failure> {
    let arrivals = stormguard_sim::arrivals(sc)
        .ok_or_else(|| Failure::usage(format!("{}: not an open loop", sc.name)))?;
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    let client: Client<HttpConnector, Empty<Bytes>> =
        Client::builder(TokioExecutor::new()).build(connector);
    let uri: http::Uri = format!("http://{target}/")
        .parse()
        .map_err(|e| Failure::runtime(format!("the target's url: {e}")))?;
    let deadline = sc.client.deadline;
    let wait = deadline + Duration::from_millis(250);
    let mut tasks = Vec::with_capacity(arrivals.len());
    for (i, (at, _)) in arrivals.into_iter().enumerate() {
        let due = t0 + at;
        tokio::time::sleep_until(due.into()).await;
        // Each arrival is its own request, as the model's callers are (none retries on its
        // own): its own `x-request-id`, so the proxy never takes it for a caller's retry of
        // the identical request before it.
        let req = http::Request::get(uri.clone())
            .header("x-request-id", i)
            .body(Empty::new())
            .map_err(|e| Failure::runtime(format!("a request: {e}")))?;
        let client = client.clone();
        tasks.push(tokio::spawn(async move {
            let answer = async {
                let resp = client.request(req).await.ok()?;
                let ok = resp.status().is_success();
                resp.into_body().collect().await.ok()?;
                Some(ok)
            };
            let ok = tokio::time::timeout(wait, answer).await.ok().flatten().unwrap_or(false);
            (at, ok, due.elapsed().min(deadline))
        }));
    }
    let mut outcomes = Vec::with_capacity(tasks.len());
    for t in tasks {
        outcomes.push(t.await.map_err(|e| Failure::runtime(format!("a caller failed: {e}")))?);
    }
    Ok(outcomes)
}
