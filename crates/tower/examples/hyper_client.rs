//! A hyper client against a flaky server, through the stormguard stack.
//!
//!     cargo run -p stormguard-tower --example hyper_client
//!
//! Starts a server on 127.0.0.1 (an ephemeral port) that fails 30 % of requests with 503 and
//! answers after 20 ms, sends it 400 requests from 32 concurrent callers through a cap of 8 and
//! a 25 % retry budget, and prints what the server saw and what the stack decided.

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use stormguard_core::Denied;
use stormguard_tower::{Dependency, DependencyConfig, ReplayBody, StormguardLayer};
use tower::{ServiceBuilder, ServiceExt};

#[derive(Default)]
struct Seen {
    requests: AtomicU64,
    retries: AtomicU64,
    in_flight: AtomicU64,
    max: AtomicU64,
}

async fn flaky(
    req: Request<Incoming>,
    seen: Arc<Seen>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let n = seen.requests.fetch_add(1, Ordering::SeqCst);
    if req.headers().get("x-stormguard-attempt").is_some_and(|v| v != "1") {
        seen.retries.fetch_add(1, Ordering::SeqCst);
    }
    let now = seen.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
    seen.max.fetch_max(now, Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(20)).await;
    seen.in_flight.fetch_sub(1, Ordering::SeqCst);
    // A fixed pattern: 3 of every 10 fail.
    let status = if n % 10 < 3 { 503 } else { 200 };
    Ok(Response::builder().status(status).body(Full::new(Bytes::from_static(b"hello"))).unwrap())
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let seen = Arc::new(Seen::default());
    let server_seen = seen.clone();
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else { return };
            let seen = server_seen.clone();
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(move |r| flaky(r, seen.clone()));
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    });

    let mut config = DependencyConfig::new("flaky");
    config.limiter.cap = 8;
    config.budget = "ratio:percent=0.25,min_per_sec=1".parse()?;
    config.per_try_timeout = Some(Duration::from_secs(1));
    let dependency = Dependency::try_new(config)?;
    let client: Client<_, ReplayBody<Full<Bytes>>> =
        Client::builder(TokioExecutor::new()).build_http();
    let stack =
        ServiceBuilder::new().layer(StormguardLayer::new(dependency.clone())).service(client);

    let url = format!("http://{addr}/");
    let mut callers = Vec::new();
    for c in 0..6 {
        let (stack, url) = (stack.clone(), url.clone());
        callers.push(tokio::spawn(async move {
            let mut ok = 0;
            for _ in 0..(400 / 6 + usize::from(c < 400 % 6)) {
                let req = Request::get(&url)
                    .body(ReplayBody::new(Full::new(Bytes::new()), 64 * 1024))
                    .unwrap();
                if let Ok(resp) = stack.clone().oneshot(req).await {
                    let success = resp.status().is_success();
                    let _ = resp.into_body().collect().await;
                    ok += usize::from(success);
                }
            }
            ok
        }));
    }
    let mut ok = 0;
    for c in callers {
        ok += c.await?;
    }
    let s = dependency.snapshot();
    println!("callers got {ok} successes of 400");
    println!(
        "server saw {} requests ({} retries), at most {} at once (cap 8)",
        seen.requests.load(Ordering::SeqCst),
        seen.retries.load(Ordering::SeqCst),
        seen.max.load(Ordering::SeqCst)
    );
    println!("stack: {} primaries, {} retries", s.counters.primaries, s.counters.retries);
    for d in Denied::ALL {
        if s.counters.denied(d) > 0 {
            println!("  denied {d}: {}", s.counters.denied(d));
        }
    }
    Ok(())
}
