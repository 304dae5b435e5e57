//! Hedging through the proxy, counted at the upstream: an upstream that answers a first try
//! slowly (300 ms) and a hedge at once. With `hedge_after = "50ms"`, every GET is hedged — the
//! upstream sees `x-stormguard-attempt: 2; hedge` once per request, the callers get the
//! hedge's answer, and the upstream never works on more than the cap, the slow first tries
//! that run on included. A POST is never hedged: the upstream sees one attempt per request.

use crate::support;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, Response};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use stormguard_core::hedge::{HedgeAfter, HedgeConfig};
use support::{Counts, Serve, dep, full, proxy, upstream};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gets_are_hedged_and_posts_are_not() {
    for method in [Method::GET, Method::POST] {
        let hedges = Arc::new(AtomicU64::new(0));
        let up = upstream(Serve::default(), {
            let hedges = hedges.clone();
            move |req: Request<hyper::body::Incoming>| {
                let hedge = req
                    .headers()
                    .get("x-stormguard-attempt")
                    .is_some_and(|v| v.as_bytes() == b"2; hedge");
                if hedge {
                    hedges.fetch_add(1, Ordering::SeqCst);
                }
                async move {
                    let body = if hedge { "hedge" } else { "first" };
                    if !hedge {
                        tokio::time::sleep(Duration::from_millis(300)).await;
                    }
                    Response::new(full(body))
                }
            }
        })
        .await;
        let mut d = dep(&format!("http://{}", up.addr));
        d.cap = 8;
        d.hedge = Some(HedgeConfig::new(HedgeAfter::Fixed(Duration::from_millis(50))));
        d.budget = "ratio:percent=1,min_per_sec=100".parse().unwrap();
        let p = proxy(d).await;
        let addr = p.listen_addrs()[0];
        let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
        let mut calls = Vec::new();
        for _ in 0..12 {
            let req = Request::builder()
                .method(method.clone())
                .uri(format!("http://{addr}/x"))
                .body(Full::new(Bytes::new()))
                .unwrap();
            let client = client.clone();
            calls.push(tokio::spawn(async move {
                let resp = client.request(req).await.unwrap();
                let status = resp.status();
                let body = resp.into_body().collect().await.unwrap().to_bytes();
                (status, body)
            }));
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let mut hedge_answers = 0;
        for c in calls {
            let (status, body) = c.await.unwrap();
            assert_eq!(status, 200);
            hedge_answers += u64::from(body == "hedge");
        }
        // The slow first tries finish before the count is read.
        tokio::time::sleep(Duration::from_millis(400)).await;
        let (received, hedged) = (Counts::get(&up.counts.handled), hedges.load(Ordering::SeqCst));
        let max = Counts::get(&up.counts.max_in_flight);
        p.shutdown().await;
        eprintln!(
            "{method}: {received} attempts, {hedged} hedges, {hedge_answers} answered by a hedge, max in flight {max}"
        );
        assert!(max <= 8, "the cap holds: {max}");
        if method == Method::GET {
            assert!(hedged > 0 && hedge_answers == hedged, "{hedged} hedges, {hedge_answers} won");
            assert_eq!(received, 12 + hedged);
        } else {
            assert_eq!((received, hedged), (12, 0), "a POST is never hedged");
        }
    }
}
