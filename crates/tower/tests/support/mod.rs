//! A test upstream the tower tests share (`mod support;`).
#![allow(dead_code)] // each test file uses its own subset

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::Full;
use stormguard_tower::ReplayBody;
use tower::Service;

type Req = Request<ReplayBody<Full<Bytes>>>;

/// A dependency that takes `latency` for every request it is sent and keeps working on it
/// after its client has gone, as a real server does: the work runs in its own task, and the
/// count in flight is taken there, exactly.
#[derive(Clone)]
pub struct Upstream {
    latency: Duration,
    /// Requests it is working on now.
    pub in_flight: Arc<AtomicU64>,
    /// The most it worked on at once.
    pub max: Arc<AtomicU64>,
    /// Requests it received.
    pub received: Arc<AtomicU64>,
}

impl Upstream {
    pub fn new(latency: Duration) -> Upstream {
        Upstream {
            latency,
            in_flight: Arc::default(),
            max: Arc::default(),
            received: Arc::default(),
        }
    }

    pub fn max(&self) -> u64 {
        self.max.load(Ordering::SeqCst)
    }
}

impl Service<Req> for Upstream {
    type Response = Response<Full<Bytes>>;
    type Error = Infallible;
    type Future = std::pin::Pin<
        Box<dyn std::future::Future<Output = Result<Self::Response, Infallible>> + Send>,
    >;

    fn poll_ready(
        &mut self,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Infallible>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, _: Req) -> Self::Future {
        self.received.fetch_add(1, Ordering::SeqCst);
        let n = self.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        self.max.fetch_max(n, Ordering::SeqCst);
        let (latency, in_flight) = (self.latency, self.in_flight.clone());
        let work = tokio::spawn(async move {
            tokio::time::sleep(latency).await;
            in_flight.fetch_sub(1, Ordering::SeqCst);
        });
        Box::pin(async move {
            let _ = work.await;
            Ok(Response::new(Full::new(Bytes::from_static(b"ok"))))
        })
    }
}
