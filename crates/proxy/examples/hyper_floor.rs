//! The floor under `stormguard proxy`'s cost: a bare hyper forwarder with nothing of
//! stormguard's — no cap, no budget, no retries, no metrics, no log — for BENCHMARKS.md's
//! issue-27 section, run by `bench/proxy.sh` beside the proxies (`PROXIES="... hyper-floor"`).
//!
//! ```text
//! cargo run --release -p stormguard-proxy --example hyper_floor -- LISTEN UPSTREAM [legacy|conn] [auto|http1]
//! ```
//!
//! `legacy` sends through hyper-util's pooled client, as the proxy did before its own pool (and
//! still does for TLS and HTTP/2 upstreams); `conn` through a pool of its own over
//! `hyper::client::conn::http1` (a stack of idle senders; unlike the proxy's pool, a sender goes
//! back when the answer's body has ended, and a checkout waits for it to be ready). `auto` serves the callers with hyper-util's protocol-sniffing
//! server, as the proxy does; `http1` with hyper's HTTP/1.1 server alone. One current-thread
//! runtime, as the proxy runs on one core.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{Request, Response, Uri};
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;
use http_body_util::combinators::UnsyncBoxBody;
use hyper::body::Incoming;
use hyper::client::conn::http1::SendRequest;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::{TcpListener, TcpStream};

type BoxError = Box<dyn std::error::Error + Send + Sync>;
type Out = UnsyncBoxBody<Bytes, BoxError>;

fn main() -> Result<(), BoxError> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [listen, upstream, rest @ ..] = args.as_slice() else {
        return Err("usage: hyper_floor LISTEN UPSTREAM [legacy|conn] [auto|http1]".into());
    };
    let listen: SocketAddr = listen.parse()?;
    let upstream: SocketAddr = upstream.parse()?;
    let conn_pool = rest.first().is_some_and(|m| m == "conn");
    let http1_only = rest.get(1).is_some_and(|m| m == "http1");
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    rt.block_on(serve(listen, upstream, conn_pool, http1_only))
}

#[derive(Clone)]
enum Upstream {
    Legacy(Arc<Client<HttpConnector, Incoming>>, Uri),
    Conn(Arc<Pool>),
}

async fn serve(
    listen: SocketAddr,
    upstream: SocketAddr,
    conn_pool: bool,
    http1_only: bool,
) -> Result<(), BoxError> {
    let up = if conn_pool {
        Upstream::Conn(Arc::new(Pool { addr: upstream, idle: Mutex::new(Vec::new()) }))
    } else {
        let mut http = HttpConnector::new();
        http.set_nodelay(true);
        let client = Client::builder(TokioExecutor::new()).pool_max_idle_per_host(64).build(http);
        Upstream::Legacy(Arc::new(client), format!("http://{upstream}").parse()?)
    };
    let listener = TcpListener::bind(listen).await?;
    loop {
        let (stream, _) = listener.accept().await?;
        stream.set_nodelay(true)?;
        let up = up.clone();
        tokio::spawn(async move {
            let svc = hyper::service::service_fn(move |req: Request<Incoming>| {
                let up = up.clone();
                async move { Ok::<_, Infallible>(forward(&up, req).await) }
            });
            let io = TokioIo::new(stream);
            let _ = if http1_only {
                hyper::server::conn::http1::Builder::new().serve_connection(io, svc).await
            } else {
                hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                    .serve_connection(io, svc)
                    .await
                    .map_err(|_| ())
                    .or(Ok(()))
            };
        });
    }
}

async fn forward(up: &Upstream, req: Request<Incoming>) -> Response<Out> {
    let answer = match up {
        Upstream::Legacy(client, base) => {
            let (mut parts, body) = req.into_parts();
            let mut uri = base.clone().into_parts();
            uri.path_and_query = parts.uri.path_and_query().cloned();
            parts.uri = Uri::from_parts(uri).expect("a valid uri");
            client
                .request(Request::from_parts(parts, body))
                .await
                .map(|r| r.map(|b| b.map_err(BoxError::from).boxed_unsync()))
                .map_err(BoxError::from)
        }
        Upstream::Conn(pool) => pool.send(req).await,
    };
    answer.unwrap_or_else(|_| {
        let mut r =
            Response::new(http_body_util::Empty::new().map_err(|e| match e {}).boxed_unsync());
        *r.status_mut() = http::StatusCode::BAD_GATEWAY;
        r
    })
}

/// Idle HTTP/1.1 senders to one upstream.
struct Pool {
    addr: SocketAddr,
    idle: Mutex<Vec<SendRequest<Incoming>>>,
}

impl Pool {
    async fn send(self: &Arc<Self>, req: Request<Incoming>) -> Result<Response<Out>, BoxError> {
        let mut sender = loop {
            let next = self.idle.lock().unwrap_or_else(|e| e.into_inner()).pop();
            match next {
                // Back in the stack once its answer ended: ready now, or in a moment.
                Some(mut s) => match s.ready().await {
                    Ok(()) => break s,
                    Err(_) => continue,
                },
                None => {
                    let tcp = TcpStream::connect(self.addr).await?;
                    tcp.set_nodelay(true)?;
                    let (s, conn) =
                        hyper::client::conn::http1::handshake(TokioIo::new(tcp)).await?;
                    tokio::spawn(conn);
                    break s;
                }
            }
        };
        let resp = sender.send_request(req).await?;
        let pool = self.clone();
        Ok(resp.map(|body| Returning { body, sender: Some(sender), pool }.boxed_unsync()))
    }
}

/// The answer's body; its sender goes back to the pool when the body ends.
struct Returning {
    body: Incoming,
    sender: Option<SendRequest<Incoming>>,
    pool: Arc<Pool>,
}

impl Body for Returning {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let polled = Pin::new(&mut self.body).poll_frame(cx);
        if (matches!(polled, Poll::Ready(None)) || self.body.is_end_stream())
            && let Some(s) = self.sender.take()
        {
            self.pool.idle.lock().unwrap_or_else(|e| e.into_inner()).push(s);
        }
        polled.map(|f| f.map(|f| f.map_err(BoxError::from)))
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}
