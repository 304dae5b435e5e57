//! One budget for the whole call tree, counted where the work is: three services, each with a
//! stormguard sidecar (a listener in front of it, a listener for its calls to the next hop),
//! the last calling chaos. The services are chaos in `forward` mode: they pass `baggage` on
//! (as an OpenTelemetry-instrumented service does), stamp each call with a request id of their
//! own, and answer a failure below with a 502 of their own, relaying none of its headers.
//!
//! ```text
//! client → P1.in → S1 → P1.out → P2.in → S2 → P2.out → P3.in → S3 → P3.out → chaos
//! ```
//!
//! Each `out` listener retries its next hop within a 20 % budget. Without the tree's context
//! the hops multiply: chaos sees about `1.2³ ≈ 1.73` attempts per user action. With it (P1.in
//! starts each action's tree, the other listeners trust it), chaos sees no more than the
//! allowance, and when chaos refuses everything only the hop directly above it retries.

use crate::common;
use common::*;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};
use stormguard_chaos::{ChaosConfig, ChaosServer, Latency, OnDisconnect, Phase};
use stormguard_proxy::config::{ListenerConfig, ProxyConfig, ProxyDependency, TreeMode};
use stormguard_proxy::{ProxyHandle, start};

/// User actions per run, and how many are in flight at once.
const ACTIONS: u64 = 400;
const CONCURRENCY: usize = 8;

struct Hop {
    proxy: ProxyHandle,
    service: ChaosServer,
}

fn budgeted(name: &str, upstream: &str) -> ProxyDependency {
    let mut d = ProxyDependency::new(name, upstream.parse().unwrap());
    // A 20 % budget and no floor: the share of retries is the budget's, whatever the run's
    // length. Short backoffs keep the run short.
    d.budget = "ratio:percent=0.2,min_per_sec=0".parse().unwrap();
    d.backoff = stormguard_core::backoff::BackoffConfig::parse_range("1ms..5ms").unwrap();
    d.cap = 64;
    d
}

/// The chain, built from the bottom: each sidecar starts with its service's address unknown,
/// the service starts calling the sidecar's `out` listener, and a reload gives the sidecar's
/// `in` listener the service's address.
async fn chain(leaf: &ChaosServer, tree: bool, allowance: &str, own_errors: [f64; 3]) -> Vec<Hop> {
    let (placeholder, _keep) = refused_addr();
    let mut next = leaf.url("");
    let mut hops = Vec::new();
    for k in (0..3).rev() {
        let out = budgeted("next", &next);
        // The listener in front of the service forwards; the hop above charged what it sent.
        let mut svc = ProxyDependency::new("svc", format!("http://{placeholder}").parse().unwrap());
        svc.max_retries = 0;
        svc.cap = 64;
        svc.caller_retries = stormguard_proxy::callers::CallerRetries::Off;
        let mut c = ProxyConfig::single("127.0.0.1:0".parse().unwrap(), out);
        c.dependencies.push(svc);
        let mut in_l = ListenerConfig::new("127.0.0.1:0".parse().unwrap(), Some("svc".into()));
        // It retries nothing, so it tells the hop above nothing: its advice would stand down
        // every retry of the service's failures, the service's own included.
        in_l.downstream_pushback = false;
        c.listeners.push(in_l);
        if tree {
            let [out_l, in_l] = &mut c.listeners[..] else { unreachable!() };
            out_l.tree = TreeMode::Trust;
            in_l.tree = if k == 0 { TreeMode::Root } else { TreeMode::Trust };
            for l in [out_l, in_l] {
                l.tree_allowance = allowance.parse().unwrap();
            }
        }
        c.admin = None;
        let proxy = start(c).await.unwrap();
        let mut s = ChaosConfig::single(Phase {
            latency: Latency::Fixed(ms(1)),
            error_rate: own_errors[k],
            ..Phase::default()
        });
        s.on_disconnect = OnDisconnect::Finish;
        s.forward = Some(format!("http://{}", proxy.listen_addrs()[0]).parse().unwrap());
        let service = stormguard_chaos::spawn(s, "127.0.0.1:0".parse().unwrap()).await.unwrap();
        let mut c = proxy.config();
        c.dependencies[1].upstreams = vec![service.url("").parse().unwrap()];
        proxy.reload(c).await.unwrap();
        next = format!("http://{}", proxy.listen_addrs()[1]);
        hops.push(Hop { proxy, service });
    }
    hops.reverse();
    hops
}

/// `ACTIONS` user actions, each its own path, `CONCURRENCY` at a time, into P1's `in`
/// listener; the statuses the client got.
async fn run(hops: &[Hop]) -> Vec<StatusCode> {
    let entry = hops[0].proxy.listen_addrs()[1];
    let next = Arc::new(AtomicU64::new(0));
    let client = client();
    let workers: Vec<_> = (0..CONCURRENCY)
        .map(|_| {
            let (next, client) = (next.clone(), client.clone());
            tokio::spawn(async move {
                let mut got = Vec::new();
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= ACTIONS {
                        return got;
                    }
                    let req = Request::get(format!("http://{entry}/action/{i}"))
                        .body(Full::new(Bytes::new()))
                        .unwrap();
                    let resp = tokio::time::timeout(Duration::from_secs(20), client.request(req))
                        .await
                        .expect("an answer within 20 s")
                        .unwrap();
                    let status = resp.status();
                    resp.into_body().collect().await.unwrap();
                    got.push(status);
                }
            })
        })
        .collect();
    let mut all = Vec::new();
    for w in workers {
        all.extend(w.await.unwrap());
    }
    all
}

/// Attempts that reached each service and chaos, per user action.
fn per_action(hops: &[Hop], leaf: &ChaosServer) -> [f64; 4] {
    let a = |s: &ChaosServer| s.stats().total.requests as f64 / ACTIONS as f64;
    [a(&hops[0].service), a(&hops[1].service), a(&hops[2].service), a(leaf)]
}

/// 40 % of chaos's answers fail. Per hop a 20 % budget; with the tree, an allowance of 1.1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attempts_at_the_last_dependency_stay_within_the_trees_allowance() {
    let failing =
        || chaos(Phase { error_rate: 0.4, latency: Latency::Fixed(ms(1)), ..Phase::default() });

    let leaf = failing().await;
    let hops = chain(&leaf, false, "1.2", [0.0; 3]).await;
    run(&hops).await;
    let without = per_action(&hops, &leaf);

    let leaf = failing().await;
    let hops = chain(&leaf, true, "1.1", [0.0; 3]).await;
    run(&hops).await;
    let with = per_action(&hops, &leaf);
    let tree = hops[2].proxy.dependency("next").unwrap().snapshot();

    eprintln!("attempts per action at S1, S2, S3, chaos: without {without:?}, with {with:?}");
    // Without: every hop spends its 20 %, and the hops multiply (1.2³ ≈ 1.73).
    assert!(without[3] > 1.6, "the per-hop product: {without:?}");
    assert!(without[2] > 1.3 && without[1] > 1.1, "each hop adds its share: {without:?}");
    // With: at most the allowance at chaos, and the hops above it retry nothing chaos refused.
    assert!(with[3] <= 1.1 + 3.0 / ACTIONS as f64, "within the allowance: {with:?}");
    assert!(with[3] > 1.05, "the last hop did retry: {with:?}");
    assert_eq!((with[0], with[1], with[2]), (1.0, 1.0, 1.0), "no hop above retried: {with:?}");
    assert!(tree.counters.denied[stormguard_core::Denied::Tree.index()] > 0, "refused as tree");
    assert_eq!(tree.tree.originals, ACTIONS);
}

/// A service in the middle fails on its own too (S2, 10 %): the hop above it retries those —
/// it is the hop directly above a failure — and what it spends comes out of the same
/// allowance the last hop spends from.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_hops_share_one_allowance() {
    let leaf =
        chaos(Phase { error_rate: 0.4, latency: Latency::Fixed(ms(1)), ..Phase::default() }).await;
    let hops = chain(&leaf, true, "1.2", [0.0, 0.1, 0.0]).await;
    run(&hops).await;
    let with = per_action(&hops, &leaf);
    let p1 = hops[0].proxy.dependency("next").unwrap().snapshot();
    let p3 = hops[2].proxy.dependency("next").unwrap().snapshot();
    eprintln!(
        "attempts per action at S1, S2, S3, chaos: {with:?}; P1 {:?}, P3 {:?}",
        p1.tree, p3.tree
    );
    assert!(p1.counters.retries > 0 && with[1] > 1.0, "P1 retried S2's own failures: {with:?}");
    // Those retries reached P3 as extras from above, and P3 had that much less to spend.
    assert!(p3.tree.extras_above > 0, "{:?}", p3.tree);
    let reached = (p3.tree.originals + p3.tree.extras_above + p3.tree.charged) as f64;
    assert!(reached <= 1.2 * p3.tree.originals as f64 + 3.0, "{:?}", p3.tree);
    assert!(with[3] <= 1.2 + 3.0 / ACTIONS as f64, "within the allowance: {with:?}");
}

/// Chaos refuses everything (overloaded): only the hop directly above it retries.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_hop_above_an_overloaded_dependency_retries() {
    let overloaded =
        || chaos(Phase { error_rate: 1.0, latency: Latency::Fixed(ms(1)), ..Phase::default() });

    let leaf = overloaded().await;
    let hops = chain(&leaf, false, "1.2", [0.0; 3]).await;
    run(&hops).await;
    let without = per_action(&hops, &leaf);

    let leaf = overloaded().await;
    let hops = chain(&leaf, true, "1.2", [0.0; 3]).await;
    let statuses = run(&hops).await;
    let with = per_action(&hops, &leaf);
    eprintln!("attempts per action at S1, S2, S3, chaos: without {without:?}, with {with:?}");

    assert!(without[1] > 1.1 && without[2] > 1.3, "every hop retried: {without:?}");
    assert_eq!((with[0], with[1], with[2]), (1.0, 1.0, 1.0), "only the last hop retried: {with:?}");
    assert!(with[3] > 1.1, "the hop above chaos retried: {with:?}");
    // The stand-down went up through every service to the client.
    assert!(statuses.iter().all(|s| *s == StatusCode::BAD_GATEWAY), "{statuses:?}");
    for hop in &hops[..2] {
        let next = hop.proxy.dependency("next").unwrap().snapshot();
        assert_eq!(next.counters.retries, 0, "the hops above sent no retry");
        assert!(next.counters.denied[stormguard_core::Denied::Pushback.index()] > 0);
    }
}

/// The trust rule, at the upstream: a listener with `tree = "off"` takes a caller's context
/// off (the caller cannot grant itself an allowance), `trust` clamps it to `tree_allowance`,
/// `root` starts a new one whatever came; the other baggage members pass untouched.
#[tokio::test]
async fn a_listener_trusts_a_callers_context_only_as_configured() {
    use crate::support::{Serve, full, upstream};
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let s = seen.clone();
    let up = upstream(Serve::default(), move |req: Request<hyper::body::Incoming>| {
        let s = s.clone();
        async move {
            let b = req.headers().get("baggage").map(|v| v.to_str().unwrap().to_string());
            s.lock().unwrap().push(b.unwrap_or_default());
            http::Response::new(full("ok"))
        }
    })
    .await;
    let mut c = ProxyConfig::single(
        "127.0.0.1:0".parse().unwrap(),
        ProxyDependency::new("dep", format!("http://{}", up.addr).parse().unwrap()),
    );
    c.admin = None;
    for mode in [TreeMode::Trust, TreeMode::Root] {
        let mut l = ListenerConfig::new("127.0.0.1:0".parse().unwrap(), Some("dep".into()));
        (l.tree, l.tree_allowance) = (mode, "1.5".parse().unwrap());
        c.listeners.push(l);
    }
    let proxy = start(c).await.unwrap();
    let client = client();
    for addr in proxy.listen_addrs() {
        let req = Request::get(format!("http://{addr}/x"))
            .header("baggage", "user=alice,stormguard-tree=9;id=ff")
            .body(Full::new(Bytes::new()))
            .unwrap();
        let resp = client.request(req).await.unwrap();
        assert_eq!(resp.status(), StatusCode::OK);
    }
    let seen = seen.lock().unwrap().clone();
    assert_eq!(seen[0], "user=alice", "off: the caller's context is taken off");
    assert_eq!(seen[1], "user=alice,stormguard-tree=1.5;id=00000000000000ff", "trust: clamped");
    assert!(seen[2].starts_with("user=alice,stormguard-tree=1.5;id="), "root: {}", seen[2]);
    assert!(!seen[2].ends_with("00000000000000ff"), "root: a new user action");
}
