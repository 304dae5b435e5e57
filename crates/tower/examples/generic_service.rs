//! The stack around any tower service whose requests are `http::Request`s — here a plain
//! `service_fn` with `String` bodies, cloned whole for each attempt ([`CloneBody`]). A tonic
//! client is wired the same way, with an `AttemptPolicy` that copies its (buffered) bodies.
//!
//!     cargo run -p stormguard-tower --example generic_service
//!
//! The service fails every other call; the stack retries under the budget and shows the
//! reason when it refuses.

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::Full;
use stormguard_core::Denied;
use stormguard_tower::{CloneBody, Dependency, DependencyConfig, StormguardLayer};
use tower::{Layer, ServiceExt, service_fn};

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let calls = Arc::new(AtomicU64::new(0));
    let c = calls.clone();
    let inner = service_fn(move |req: Request<String>| {
        let n = c.fetch_add(1, Ordering::SeqCst);
        async move {
            let status = if n.is_multiple_of(2) { 503 } else { 200 };
            let body = format!("{} -> {status}", req.body());
            Ok::<_, Infallible>(
                Response::builder().status(status).body(Full::new(Bytes::from(body))).unwrap(),
            )
        }
    });
    let mut config = DependencyConfig::new("inventory");
    // A small budget: one retry per two requests, no reserve.
    config.budget = "ratio:percent=0.5,min_per_sec=0".parse()?;
    let dependency = Dependency::try_new(config)?;
    let stack = StormguardLayer::new(dependency.clone()).with_policy(CloneBody).layer(inner);
    for i in 0..6 {
        let resp = stack.clone().oneshot(Request::new(format!("lookup {i}"))).await?;
        let why = resp.extensions().get::<Denied>().map(|d| format!(" (retry refused: {d})"));
        println!("request {i}: {}{}", resp.status(), why.unwrap_or_default());
    }
    let s = dependency.snapshot();
    println!(
        "{} calls for 6 requests; {} retries",
        calls.load(Ordering::SeqCst),
        s.counters.retries
    );
    Ok(())
}
