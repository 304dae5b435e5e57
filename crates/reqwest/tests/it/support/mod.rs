//! What the tests share: a chaos upstream, clients with and without stormguard, and a tiny
//! scripted upstream for the cases chaos has no phase for.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use reqwest_middleware::{ClientBuilder, ClientWithMiddleware};
use stormguard_chaos::{ChaosConfig, ChaosServer, Phase};
use stormguard_reqwest::{Dependency, DependencyConfig, StormguardMiddleware};

/// A chaos upstream with one phase.
pub async fn chaos(phase: Phase) -> ChaosServer {
    stormguard_chaos::spawn(ChaosConfig::single(phase), "127.0.0.1:0".parse().unwrap())
        .await
        .expect("chaos server")
}

/// reqwest as the README says to build it under stormguard: its own retries off.
pub fn plain() -> reqwest::Client {
    reqwest::Client::builder().retry(reqwest::retry::never()).build().unwrap()
}

/// A dependency with `f` applied to the defaults.
pub fn dependency(f: impl FnOnce(&mut DependencyConfig)) -> Dependency {
    let mut c = DependencyConfig::new("reqwest-test");
    f(&mut c);
    Dependency::try_new(c).unwrap()
}

/// The client under test: reqwest (own retries off) with the stormguard middleware.
pub fn guarded(dep: &Dependency) -> ClientWithMiddleware {
    ClientBuilder::new(plain()).with(StormguardMiddleware::new(dep.clone())).build()
}

/// One request the scripted upstream saw: when it arrived, and when its answer was sent.
#[derive(Debug, Clone, Copy)]
pub struct Seen {
    pub arrived: Instant,
    pub answered: Instant,
}

/// A scripted HTTP/1.1 upstream: `answer(n)` gives the status and headers of the `n`-th request
/// (from 0); it records each arrival.
pub struct Scripted {
    pub addr: SocketAddr,
    pub seen: Arc<Mutex<Vec<Seen>>>,
}

impl Scripted {
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr, path)
    }

    pub fn count(&self) -> usize {
        self.seen.lock().unwrap().len()
    }
}

type Answer = (u16, Vec<(&'static str, String)>);

pub async fn scripted(
    answer: impl Fn(usize, Instant) -> Answer + Send + Sync + 'static,
) -> Scripted {
    scripted_after(|_| Duration::ZERO, answer).await
}

/// [`scripted`], with the `n`-th request's answer sent `delay(n)` after it arrived.
pub async fn scripted_after(
    delay: impl Fn(usize) -> Duration + Send + Sync + 'static,
    answer: impl Fn(usize, Instant) -> Answer + Send + Sync + 'static,
) -> Scripted {
    let delay = Arc::new(delay);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let seen: Arc<Mutex<Vec<Seen>>> = Arc::default();
    let answer = Arc::new(answer);
    let shared = seen.clone();
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else { return };
            let (seen, answer, delay) = (shared.clone(), answer.clone(), delay.clone());
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(move |_req: http::Request<Incoming>| {
                    let (seen, answer, delay) = (seen.clone(), answer.clone(), delay.clone());
                    async move {
                        let arrived = Instant::now();
                        let n = {
                            let mut seen = seen.lock().unwrap();
                            seen.push(Seen { arrived, answered: arrived });
                            seen.len() - 1
                        };
                        tokio::time::sleep(delay(n)).await;
                        let (status, headers) = answer(n, arrived);
                        let mut resp = http::Response::builder().status(status);
                        for (k, v) in headers {
                            resp = resp.header(k, v);
                        }
                        let resp = resp.body(Full::new(Bytes::from_static(b"answer"))).unwrap();
                        seen.lock().unwrap()[n].answered = Instant::now();
                        Ok::<_, Infallible>(resp)
                    }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
    Scripted { addr, seen }
}

/// An h2c upstream that refuses every stream with `REFUSED_STREAM` (the server did not process
/// it: any request may be sent again), counting the streams it refused.
pub async fn refusing_h2() -> (SocketAddr, Arc<std::sync::atomic::AtomicU64>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let streams = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let counted = streams.clone();
    tokio::spawn(async move {
        loop {
            let Ok((socket, _)) = listener.accept().await else { return };
            let counted = counted.clone();
            tokio::spawn(async move {
                let Ok(mut conn) = h2::server::handshake(socket).await else { return };
                while let Some(Ok((_req, mut respond))) = conn.accept().await {
                    counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    respond.send_reset(h2::Reason::REFUSED_STREAM);
                }
            });
        }
    });
    (addr, streams)
}

/// Seconds as a `Duration`, for short test literals.
pub fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}
