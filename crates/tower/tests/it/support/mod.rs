//! A test upstream the tower tests share (`mod support;`).

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::Full;
use stormguard_tower::ReplayBody;

/// The request every tower test sends.
pub type Req = Request<ReplayBody<Full<Bytes>>>;

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

/// What a test upstream answers with.
pub type Answer = std::pin::Pin<
    Box<dyn std::future::Future<Output = Result<Response<Full<Bytes>>, Infallible>> + Send>,
>;

/// `Service<Req>` for a test upstream with a `serve(&mut self, Req) -> Answer` method: always
/// ready, every call served. (`#[macro_use] mod support;` in main.rs.)
macro_rules! serve_as_service {
    ($t:ty) => {
        impl tower::Service<$crate::support::Req> for $t {
            type Response = http::Response<http_body_util::Full<bytes::Bytes>>;
            type Error = std::convert::Infallible;
            type Future = $crate::support::Answer;

            fn poll_ready(
                &mut self,
                _: &mut std::task::Context<'_>,
            ) -> std::task::Poll<Result<(), std::convert::Infallible>> {
                std::task::Poll::Ready(Ok(()))
            }

            fn call(&mut self, req: $crate::support::Req) -> Self::Future {
                self.serve(req)
            }
        }
    };
}

serve_as_service!(Upstream);

impl Upstream {
    fn serve(&mut self, _: Req) -> Answer {
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
