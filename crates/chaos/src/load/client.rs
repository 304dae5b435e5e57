//! One request on the wire: connections, the request template, an exchange with its timeout, and the plain HTTP call the run uses for the upstream's stats.

use super::*;
use crate::ids::{REQUEST_ID, RequestIds};

/// The request every send repeats, each as its own request: with an `x-request-id` of its own
/// (unless the headers set one), as a service's requests carry from its edge, so a sidecar that
/// recognises a caller's retries by their repeats does not take independent sends for them.
#[derive(Debug)]
pub(super) struct Template {
    pub(super) method: Method,
    pub(super) uri: Uri,
    pub(super) headers: HeaderMap,
    pub(super) body: Bytes,
    /// This run's request ids, when the template numbers its requests.
    ids: Option<RequestIds>,
}

impl Template {
    pub(super) fn new(config: &LoadConfig) -> Template {
        let mut headers = config.headers.clone();
        if let Some(a) = config.target.authority()
            && let Ok(v) = HeaderValue::from_str(a.as_str())
        {
            headers.insert(HOST, v);
        }
        // HTTP/1.1 on a direct connection sends the origin form: path and query only.
        let path = config.target.path_and_query().map_or("/", |p| p.as_str());
        Template {
            method: config.method.clone(),
            uri: path.parse().unwrap_or_else(|_| Uri::from_static("/")),
            ids: (!headers.contains_key(&REQUEST_ID)).then(RequestIds::new),
            headers,
            body: config.body.clone(),
        }
    }

    pub(super) fn request(&self) -> Request<Full<Bytes>> {
        let mut req = Request::new(Full::new(self.body.clone()));
        *req.method_mut() = self.method.clone();
        *req.uri_mut() = self.uri.clone();
        *req.headers_mut() = self.headers.clone();
        if let Some(ids) = &self.ids {
            req.headers_mut().insert(REQUEST_ID.clone(), ids.next());
        }
        req
    }
}

/// One HTTP/1.1 connection; dropping it closes the socket at once.
#[derive(Debug)]
pub(super) struct Conn {
    pub(super) sender: http1::SendRequest<Full<Bytes>>,
    pub(super) task: JoinHandle<()>,
}

impl Drop for Conn {
    fn drop(&mut self) {
        self.task.abort();
    }
}

pub(super) async fn connect(addr: SocketAddr) -> std::io::Result<Conn> {
    let stream = TcpStream::connect(addr).await?;
    let _ = stream.set_nodelay(true);
    let (sender, conn) =
        http1::handshake(TokioIo::new(stream)).await.map_err(std::io::Error::other)?;
    let task = tokio::spawn(async move {
        let _ = conn.await;
    });
    Ok(Conn { sender, task })
}

/// Sends one request on `slot`'s connection (opening one when there is none or it closed) and
/// reads the whole body. Returns the outcome and whether the request was sent.
pub(super) async fn exchange(
    slot: &mut Option<Conn>,
    addr: SocketAddr,
    template: &Template,
    sent: &AtomicBool,
) -> Outcome {
    if let Some(c) = slot.as_mut()
        && c.sender.ready().await.is_err()
    {
        *slot = None;
    }
    if slot.is_none() {
        match connect(addr).await {
            Ok(c) => *slot = Some(c),
            Err(_) => return Outcome::ConnectError,
        }
    }
    let Some(conn) = slot.as_mut() else { return Outcome::ConnectError };
    sent.store(true, Ordering::Relaxed);
    let outcome = read_answer(conn.sender.send_request(template.request())).await;
    if !matches!(outcome, Outcome::Status(_)) {
        *slot = None;
    }
    outcome
}

/// One request with its timeout; on a timeout the connection is dropped (it may still carry the
/// late answer).
pub(super) async fn timed_exchange(
    slot: &mut Option<Conn>,
    addr: SocketAddr,
    template: &Template,
    timeout: Duration,
) -> (Outcome, bool) {
    let sent = AtomicBool::new(false);
    let outcome = match tokio::time::timeout(timeout, exchange(slot, addr, template, &sent)).await {
        Ok(o) => o,
        Err(_) => {
            *slot = None;
            Outcome::Timeout
        }
    };
    (outcome, sent.load(Ordering::Relaxed))
}

/// A connection driven inside its worker's own task.
pub(super) type InlineConn =
    (http1::SendRequest<Full<Bytes>>, Pin<Box<http1::Connection<TokioIo<TcpStream>, Full<Bytes>>>>);

/// One closed-loop worker: claims a ticket, sends, reads the whole answer, repeats. Its
/// connection is polled inside this task rather than spawned, so a request wakes no other task
/// (with a spawned connection each request paid two cross-task wake-ups).
pub(super) async fn closed_worker(
    run: Arc<Run>,
    w: usize,
    tickets: Arc<AtomicU64>,
    limit: u64,
    deadline: Option<Instant>,
) {
    let live = &run.live.inner;
    let mut conn: Option<InlineConn> = None;
    loop {
        if deadline.is_some_and(|d| Instant::now() >= d)
            || tickets.fetch_add(1, Ordering::Relaxed) >= limit
        {
            return;
        }
        live.scheduled.fetch_add(1, Ordering::Relaxed);
        live.outstanding.fetch_add(1, Ordering::Relaxed);
        let began = Instant::now();
        let sent = AtomicBool::new(false);
        let attempt = inline_exchange(&mut conn, run.addr, &run.template, &sent);
        let outcome = match tokio::time::timeout_at(began + run.timeout, attempt).await {
            Ok(o) => o,
            Err(_) => {
                conn = None;
                Outcome::Timeout
            }
        };
        run.tallies.record(w, outcome, sent.load(Ordering::Relaxed), began.elapsed());
        live.outstanding.fetch_sub(1, Ordering::Relaxed);
        live.done.fetch_add(1, Ordering::Relaxed);
        match outcome {
            Outcome::Status(200..=299) => {
                live.succeeded.fetch_add(1, Ordering::Relaxed);
            }
            // Nothing listens: do not spin; the next ticket tries again.
            Outcome::ConnectError => tokio::time::sleep(Duration::from_millis(1)).await,
            _ => {}
        }
    }
}

/// The exchange over an inline connection: reuses it when it is still open, opens one otherwise,
/// and drives it while the request is out.
pub(super) async fn inline_exchange(
    slot: &mut Option<InlineConn>,
    addr: SocketAddr,
    template: &Template,
    sent: &AtomicBool,
) -> Outcome {
    if let Some((tx, conn)) = slot.as_mut() {
        // A connection the server closed is noticed here, before a request is spent on it.
        let ready = tokio::select! {
            r = tx.ready() => r.is_ok(),
            _ = conn.as_mut() => false,
        };
        if !ready {
            *slot = None;
        }
    }
    if slot.is_none() {
        let Ok(stream) = TcpStream::connect(addr).await else { return Outcome::ConnectError };
        let _ = stream.set_nodelay(true);
        match http1::handshake(TokioIo::new(stream)).await {
            Ok((tx, conn)) => *slot = Some((tx, Box::pin(conn))),
            Err(_) => return Outcome::ConnectError,
        }
    }
    let Some((tx, conn)) = slot.as_mut() else { return Outcome::ConnectError };
    sent.store(true, Ordering::Relaxed);
    let exchange = read_answer(tx.send_request(template.request()));
    tokio::pin!(exchange);
    let (outcome, conn_ended) = tokio::select! {
        biased;
        o = &mut exchange => (o, false),
        // The connection ended: the exchange now resolves with what it got.
        _ = conn.as_mut() => (exchange.await, true),
    };
    if conn_ended || !matches!(outcome, Outcome::Status(_)) {
        *slot = None;
    }
    outcome
}

/// Awaits the response and reads its whole body.
pub(super) async fn read_answer(
    response: impl std::future::Future<Output = hyper::Result<http::Response<hyper::body::Incoming>>>,
) -> Outcome {
    let Ok(resp) = response.await else { return Outcome::Reset };
    let status = resp.status().as_u16();
    let mut body = resp.into_body();
    while let Some(frame) = body.frame().await {
        if frame.is_err() {
            return Outcome::BodyError;
        }
    }
    Outcome::Status(status)
}

/// Why a [`http_call`] failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CallError {
    /// The URL is not one the load generator may call.
    #[error(transparent)]
    Target(#[from] LoadError),
    /// The URL's path is not a request target.
    #[error("{0}")]
    Path(String),
    /// The connection failed.
    #[error("{0}")]
    Connect(String),
    /// The request failed.
    #[error("{0}")]
    Request(String),
    /// The body could not be read.
    #[error("{0}")]
    Body(String),
    /// No answer within 5 seconds.
    #[error("no answer within 5s")]
    Timeout,
}

/// One request on its own connection, for the stats endpoint: status and body.
pub async fn http_call(method: Method, uri: &Uri) -> Result<(StatusCode, Bytes), CallError> {
    let addr = loopback_addr(uri)?;
    let template = Template {
        method,
        uri: uri
            .path_and_query()
            .map_or("/", |p| p.as_str())
            .parse()
            .map_err(|e: http::uri::InvalidUri| CallError::Path(e.to_string()))?,
        ids: None,
        headers: {
            let mut h = HeaderMap::new();
            if let Some(a) = uri.authority()
                && let Ok(v) = HeaderValue::from_str(a.as_str())
            {
                h.insert(HOST, v);
            }
            h
        },
        body: Bytes::new(),
    };
    let call = async {
        let mut conn = connect(addr).await.map_err(|e| CallError::Connect(e.to_string()))?;
        let resp = conn
            .sender
            .send_request(template.request())
            .await
            .map_err(|e| CallError::Request(e.to_string()))?;
        let status = resp.status();
        let body = resp
            .into_body()
            .collect()
            .await
            .map_err(|e| CallError::Body(e.to_string()))?
            .to_bytes();
        Ok((status, body))
    };
    tokio::time::timeout(Duration::from_secs(5), call).await.unwrap_or(Err(CallError::Timeout))
}
