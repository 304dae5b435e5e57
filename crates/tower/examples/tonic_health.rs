//! A tonic (gRPC) client through the stormguard stack: every attempt under the dependency's cap,
//! retries under its budget.
//!
//!     cargo run -p stormguard-tower --example tonic_health [-- http://127.0.0.1:50051]
//!
//! The client is `tonic-health`'s generated `HealthClient` (its code ships in the crate: no
//! protoc, no build script) over a tonic `Channel`. Two things make gRPC fit the stack:
//! - every gRPC call is a POST, so the route is marked [`Idempotent`] (a health check is), or
//!   stormguard would retry it only when it provably never reached the server;
//! - tonic's request body is a stream, so it is wrapped in a [`ReplayBody`] (copied while it is
//!   sent, up to 64 KiB) on the way in, and handed back to the channel as a tonic body.
//!
//! gRPC failures come as `grpc-status` in a trailers-only response: `retry_on` names the codes to
//! retry (`unavailable` here). Without an address it calls a loopback port nobody listens on: the
//! connection is refused, the refusal is retried within the budget, and the call fails cleanly
//! with the reason.

use std::time::Duration;

use stormguard_tower::{Dependency, DependencyConfig, Idempotent, ReplayBody, StormguardLayer};
use tonic::transport::Channel;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_client::HealthClient;
use tower::ServiceBuilder;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let address = match std::env::args().nth(1) {
        Some(a) => a,
        None => {
            // A port that was free a moment ago: nothing answers there.
            let free = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?;
            format!("http://{free}")
        }
    };

    let mut config = DependencyConfig::new("health");
    config.limiter.cap = 8;
    config.budget = "ratio:percent=0.25,min_per_sec=3".parse()?;
    config.retry.retry_on =
        "5xx,reset,connect-failure,refused-stream,timeout,unavailable".parse()?;
    config.per_try_timeout = Some(Duration::from_millis(500));
    let dependency = Dependency::try_new(config)?;

    let channel = Channel::from_shared(address.clone())?.connect_lazy();
    let stack = ServiceBuilder::new()
        // In: the call is idempotent, and its body can be sent again.
        .map_request(|req: http::Request<tonic::body::Body>| {
            let (mut parts, body) = req.into_parts();
            parts.extensions.insert(Idempotent);
            http::Request::from_parts(parts, ReplayBody::new(body, 64 * 1024))
        })
        .layer(StormguardLayer::new(dependency.clone()))
        // Out: the channel takes tonic's own body type.
        .map_request(|req: http::Request<ReplayBody<tonic::body::Body>>| {
            req.map(tonic::body::Body::new)
        })
        .service(channel);
    let mut client = HealthClient::new(stack);

    let answer = client.check(HealthCheckRequest { service: String::new() }).await;
    match &answer {
        Ok(resp) => println!("{address}: serving status {:?}", resp.get_ref().status()),
        Err(status) => println!("{address}: {:?}: {}", status.code(), status.message()),
    }
    let c = dependency.snapshot().counters;
    println!(
        "stormguard: {} first tries, {} retries, refused: attempts {}, budget {}, cap {}",
        c.primaries,
        c.retries,
        c.denied(stormguard_tower::Denied::Attempts),
        c.denied(stormguard_tower::Denied::Budget),
        c.denied(stormguard_tower::Denied::Cap),
    );
    Ok(())
}
