//! A bare hyper client for the tests: one connection per call, so a test controls exactly how
//! many requests are in flight.

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Request, StatusCode};
use http_body_util::{BodyExt, Empty};
use hyper_util::rt::{TokioExecutor, TokioIo};
use stormguard_chaos::{ChaosConfig, ChaosServer, Phase, Stats};
use tokio::net::TcpStream;

/// What one request got.
#[derive(Debug)]
pub struct Got {
    pub status: StatusCode,
    pub headers: HeaderMap,
    /// The body, or the error that cut it.
    pub body: Result<Bytes, String>,
    /// Data frames received.
    pub frames: usize,
}

pub async fn server(phase: Phase) -> ChaosServer {
    serve(ChaosConfig::single(phase)).await
}

pub async fn serve(config: ChaosConfig) -> ChaosServer {
    stormguard_chaos::spawn(config, "127.0.0.1:0".parse().unwrap()).await.unwrap()
}

fn request(method: &str, path: &str, headers: &[(&str, &str)]) -> Request<Empty<Bytes>> {
    let mut b = Request::builder().method(method).uri(path).header("host", "chaos");
    for (k, v) in headers {
        b = b.header(*k, *v);
    }
    b.body(Empty::new()).unwrap()
}

async fn read(resp: http::Response<hyper::body::Incoming>) -> Got {
    let status = resp.status();
    let headers = resp.headers().clone();
    let mut body = resp.into_body();
    let mut data = Vec::new();
    let mut frames = 0;
    let body = loop {
        match body.frame().await {
            None => break Ok(Bytes::from(data)),
            Some(Ok(f)) => {
                if let Ok(d) = f.into_data() {
                    frames += 1;
                    data.extend_from_slice(&d);
                }
            }
            Some(Err(e)) => break Err(e.to_string()),
        }
    };
    Got { status, headers, body, frames }
}

/// One HTTP/1.1 request on a fresh connection; `Err` when no response came (a reset).
/// The connection is driven in the same task, so dropping the future closes the socket.
pub async fn call(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
) -> Result<Got, String> {
    let stream = TcpStream::connect(addr).await.map_err(|e| e.to_string())?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| e.to_string())?;
    let exchange = async {
        let resp = sender
            .send_request(request(method, path, headers))
            .await
            .map_err(|e| format!("{e:?}"))?;
        Ok(read(resp).await)
    };
    tokio::pin!(conn);
    tokio::pin!(exchange);
    tokio::select! {
        r = &mut exchange => r,
        // The connection ended first: the exchange now resolves with what it got.
        _ = &mut conn => exchange.await,
    }
}

pub async fn get(addr: SocketAddr, path: &str) -> Result<Got, String> {
    call(addr, "GET", path, &[]).await
}

pub async fn post_json(addr: SocketAddr, path: &str) -> serde_json::Value {
    let got = call(addr, "POST", path, &[]).await.unwrap();
    serde_json::from_slice(&got.body.unwrap()).unwrap()
}

/// HTTP/2 with prior knowledge: one connection, many streams.
pub async fn h2(addr: SocketAddr) -> hyper::client::conn::http2::SendRequest<Empty<Bytes>> {
    let stream = TcpStream::connect(addr).await.unwrap();
    let (sender, conn) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(stream))
            .await
            .unwrap();
    tokio::spawn(conn);
    sender
}

pub async fn h2_get(
    sender: &mut hyper::client::conn::http2::SendRequest<Empty<Bytes>>,
    path: &str,
) -> Result<Got, String> {
    let req = Request::builder().uri(format!("http://chaos{path}")).body(Empty::new()).unwrap();
    let resp = sender.send_request(req).await.map_err(|e| format!("{e:?}"))?;
    Ok(read(resp).await)
}

/// Polls the server's stats until `done` holds (at most `limit`), and returns the last.
pub async fn wait_for(
    server: &ChaosServer,
    limit: Duration,
    done: impl Fn(&Stats) -> bool,
) -> Stats {
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        let s = server.stats();
        if done(&s) || tokio::time::Instant::now() >= deadline {
            return s;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}
