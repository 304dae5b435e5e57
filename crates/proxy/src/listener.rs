//! The listeners' own defences: what one caller can hold of the proxy itself.
//!
//! A connection costs a descriptor and memory whatever it sends, and every caller on the host
//! shares the proxy's. So each listener — the admin listener included — bounds how long a
//! connection may take to send its request, how long it may sit idle, and how many it holds:
//!
//! - **header read** (`header_read_timeout`, 10 s): a new connection must send a whole request
//!   head within it; on a kept-alive HTTP/1.1 connection it runs from the first byte of the next
//!   request. A request trickled a byte at a time does not extend it.
//! - **idle** (`idle_timeout`, 60 s): an HTTP/1.1 connection between requests, or an HTTP/2
//!   connection with no stream open (the bare preface included), is closed after it. The close
//!   is graceful (HTTP/2 gets a GOAWAY), bounded by the header read timeout.
//! - **HTTP/2 keep-alive** (`http2_keepalive_interval`, 30 s): a PING that goes unanswered for
//!   an interval means the peer is gone; its connection is closed, streams included.
//! - **connections** (`max_connections` per caller listener, `admin_max_connections`): past the
//!   limit a new connection is closed at once. The default is sized from the open-files limit,
//!   which the proxy raises to its hard limit at start, keeping a reserve so the admin listener
//!   and the upstream connections stay reachable when the callers take all they may.
//!
//! hyper's own `header_read_timeout` is not used. It runs from the end of one response until
//! the next request head is read, so it would close an idle keep-alive connection at the header
//! timeout; and hyper-util's auto builder reads the first bytes (to tell HTTP/1.1 from the
//! HTTP/2 preface) before hyper's connection and its timer exist, so a connection that sends
//! nothing is never timed out by it. Here a [`ConnWatch`] per connection decides, fed by its
//! I/O (bytes read, the HTTP/2 preface) and by its requests (each in flight from the service
//! call until its response body ends or is dropped). Every close is counted in
//! `stormguard_proxy_connections_closed_total{listener, reason}` and logged at debug.

use std::convert::Infallible;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, watch};
use tokio::task::JoinSet;
use tokio::time::Instant;

use crate::config::ConnectionConfig;
use crate::state::{Closed, ListenerStats, Open};

/// How the listeners stop: a drain lets the connections finish what they are serving.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Stop {
    Run,
    Drain,
    Now,
}

/// The timeouts a [`ConnWatch`] applies.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Timeouts {
    header_read: Duration,
    idle: Duration,
}

impl From<&ConnectionConfig> for Timeouts {
    fn from(c: &ConnectionConfig) -> Timeouts {
        Timeouts { header_read: c.header_read_timeout, idle: c.idle_timeout }
    }
}

/// What one connection is doing, as far as its timeouts care.
#[derive(Debug)]
struct Phase {
    /// Requests (HTTP/2: streams) between the service call and the end of their response body.
    in_flight: usize,
    /// Requests begun on this connection.
    requests: u64,
    /// The HTTP/2 preface was read.
    h2: bool,
    /// When `in_flight` last fell to 0 (the connection's start before any request).
    idle_since: Instant,
    /// HTTP/1.1: the first byte read since `idle_since` — the next request has begun.
    first_byte: Option<Instant>,
    /// When an idle close began (graceful shutdown asked).
    closing: Option<Instant>,
}

/// The watch over one connection: decides when it has waited too long.
#[derive(Debug)]
pub(crate) struct ConnWatch {
    accepted: Instant,
    phase: Mutex<Phase>,
    /// Set while an HTTP/1.1 connection is idle and no byte of its next request was read yet,
    /// so a read takes the lock only for that first byte. A hint only: the phase under the
    /// lock is the truth, so `Relaxed` is enough (a missed first byte leaves the idle
    /// deadline, which is later but still bounded, in force until the next read).
    awaiting_byte: AtomicBool,
    changed: Notify,
    /// Set to close the connection now: [`CLOSE_EVICTED`] or [`CLOSE_STALLED`].
    close: AtomicU8,
    /// A cut answer was logged for this connection already.
    stall_logged: AtomicBool,
}

/// [`ConnWatch::close`]: evicted for a new connection.
const CLOSE_EVICTED: u8 = 1;
/// [`ConnWatch::close`]: an HTTP/1.1 answer was cut.
const CLOSE_STALLED: u8 = 2;

impl ConnWatch {
    pub(crate) fn new() -> ConnWatch {
        let now = Instant::now();
        ConnWatch {
            accepted: now,
            phase: Mutex::new(Phase {
                in_flight: 0,
                requests: 0,
                h2: false,
                idle_since: now,
                first_byte: None,
                closing: None,
            }),
            awaiting_byte: AtomicBool::new(false),
            changed: Notify::new(),
            close: AtomicU8::new(0),
            stall_logged: AtomicBool::new(false),
        }
    }
}

/// An answer on this connection was cut (`crate::relay`): logged once per connection, and an
/// HTTP/1.1 connection is closed (what is left of its answer cannot be sent). An HTTP/2
/// connection stays: its other streams are not at fault.
impl crate::relay::Stalled for ConnWatch {
    fn response_stalled(&self) {
        let h2 = self.phase().h2;
        if !self.stall_logged.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                http2 = h2,
                "a caller accepted nothing of its answer for response_idle_timeout: the answer was cut and its slot given back (logged once per connection)"
            );
        }
        if !h2 {
            self.close_now(CLOSE_STALLED);
        }
    }
}

impl ConnWatch {
    fn close_now(&self, why: u8) {
        // Relaxed: the notify that follows orders it for the watch that reads it.
        if self.close.compare_exchange(0, why, Ordering::Relaxed, Ordering::Relaxed).is_ok() {
            self.changed.notify_one();
        }
    }

    /// Since when this connection has been idle (nothing in flight), if it has been and is not
    /// closing already: the order in which a full listener evicts.
    fn idle_for_eviction(&self) -> Option<Instant> {
        if self.close.load(Ordering::Relaxed) != 0 {
            return None;
        }
        let p = self.phase();
        (p.in_flight == 0 && p.closing.is_none() && p.first_byte.is_none()).then_some(p.idle_since)
    }

    /// Whether an eviction asked for still holds: nothing began on the connection since it was
    /// chosen (a request, or the first byte of one). Else the flag is cleared and it stays.
    fn evicted(&self) -> bool {
        let p = self.phase();
        let still_idle = p.in_flight == 0 && p.first_byte.is_none();
        // Under the phase lock, so a request beginning now waits for this decision.
        self.close.store(0, Ordering::Relaxed);
        still_idle
    }

    fn phase(&self) -> std::sync::MutexGuard<'_, Phase> {
        self.phase.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Bytes were read from the connection.
    fn read(&self) {
        if self.awaiting_byte.load(Ordering::Relaxed)
            && self.awaiting_byte.swap(false, Ordering::Relaxed)
        {
            let mut p = self.phase();
            if p.in_flight == 0 && !p.h2 && p.first_byte.is_none() {
                // No wake-up: the watch looks again within a header read timeout (`expired`).
                p.first_byte = Some(Instant::now());
            }
        }
    }

    /// The HTTP/2 preface was read: idleness is now "no stream open".
    fn h2_preface(&self) {
        self.phase().h2 = true;
        self.changed.notify_one();
    }

    /// A request (or HTTP/2 stream) reached the service: in flight until the guard drops.
    pub(crate) fn begin(self: &Arc<Self>) -> InFlight {
        let mut p = self.phase();
        p.in_flight += 1;
        p.requests += 1;
        p.first_byte = None;
        self.awaiting_byte.store(false, Ordering::Relaxed);
        InFlight(self.clone())
    }

    fn end(&self) {
        let mut p = self.phase();
        p.in_flight = p.in_flight.saturating_sub(1);
        if p.in_flight == 0 {
            // No wake-up (the watch looks again within the shorter timeout: `expired`), but
            // for a connection closing: its deadline is fixed, and may have passed already.
            p.idle_since = Instant::now();
            p.first_byte = None;
            self.awaiting_byte.store(!p.h2, Ordering::Relaxed);
            let closing = p.closing.is_some();
            drop(p);
            if closing {
                self.changed.notify_one();
            }
        }
    }

    /// An idle close began: the connection gets one more header read timeout to finish.
    fn closing(&self) {
        self.phase().closing = Some(Instant::now());
    }

    /// The deadline in force and what passing it means; none while a request is in flight.
    fn deadline(&self, t: Timeouts) -> Option<(Instant, Closed)> {
        let p = self.phase();
        if p.in_flight > 0 {
            return None;
        }
        if let Some(at) = p.closing {
            return Some((at + t.header_read, Closed::Idle));
        }
        if p.h2 {
            // HTTP/2: no stream open, whatever frames (PING, SETTINGS) arrive.
            return Some((p.idle_since + t.idle, Closed::Idle));
        }
        if p.requests == 0 {
            // The first request's head, from the connection's start.
            return Some((self.accepted + t.header_read, Closed::HeaderTimeout));
        }
        match p.first_byte {
            Some(at) => Some((at + t.header_read, Closed::HeaderTimeout)),
            None => Some((p.idle_since + t.idle, Closed::Idle)),
        }
    }

    /// Resolves when the connection has waited past its deadline, with the reason.
    ///
    /// The deadline moves with every request (in flight: none; then idle since its end; then
    /// a header read timeout from the next request's first byte), and the watch does not
    /// chase it: it sleeps until the deadline in force or one header read timeout (or idle
    /// timeout, the shorter) from now, whichever comes first, and reads it again. Outside a
    /// closing connection, a deadline can only appear or come nearer by a request ending or a
    /// first byte arriving, and each of those deadlines is at least that long after the change,
    /// so it is kept to the instant without waking the connection's task or re-arming its timer
    /// on every request (both cost a poll of the whole connection per request). The rarer
    /// changes wake it: the HTTP/2 preface, and a request ending on a closing connection (whose
    /// grace deadline is fixed); an idle close starts a new watch (the serve loop calls this
    /// again). While a request is in flight it wakes once per step to look, and sleeps again.
    pub(crate) async fn expired(&self, t: Timeouts) -> Closed {
        let step = t.header_read.min(t.idle);
        loop {
            match self.close.load(Ordering::Relaxed) {
                CLOSE_EVICTED if self.evicted() => return Closed::Evicted,
                CLOSE_STALLED => return Closed::ResponseStalled,
                _ => {}
            }
            let now = Instant::now();
            let at = match self.deadline(t) {
                Some((at, why)) if now >= at => return why,
                Some((at, _)) => at.min(now + step),
                None => now + step,
            };
            // `notify_one` keeps a permit when nobody waits, so a change between the
            // reading above and the wait is not lost.
            tokio::select! {
                () = tokio::time::sleep_until(at) => {}
                () = self.changed.notified() => {}
            }
        }
    }
}

/// A request in flight on its connection: dropped when its response body ends or is dropped.
#[derive(Debug)]
pub(crate) struct InFlight(Arc<ConnWatch>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.end();
    }
}

pin_project_lite::pin_project! {
    /// A response body that keeps its request in flight until it ends or is dropped.
    #[derive(Debug)]
    pub(crate) struct Tracked<B> {
        #[pin]
        body: B,
        in_flight: InFlight,
    }
}

impl<B: Body> Body for Tracked<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        self.project().body.poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

/// The HTTP/2 connection preface (RFC 9113 §3.4).
const H2_PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// A caller's socket, reporting what it reads to its [`ConnWatch`].
#[derive(Debug)]
struct Watched {
    io: TcpStream,
    seen: Seen,
}

/// What a connection's reads tell its watch.
#[derive(Debug)]
struct Seen {
    watch: Arc<ConnWatch>,
    /// Bytes of the HTTP/2 preface matched so far; `None` once decided.
    preface: Option<usize>,
}

impl Seen {
    fn new(watch: Arc<ConnWatch>) -> Seen {
        Seen { watch, preface: Some(0) }
    }

    fn saw(&mut self, bytes: &[u8]) {
        if let Some(matched) = self.preface {
            let n = bytes.len().min(H2_PREFACE.len() - matched);
            self.preface = if bytes[..n] != H2_PREFACE[matched..matched + n] {
                None
            } else if matched + n == H2_PREFACE.len() {
                self.watch.h2_preface();
                None
            } else {
                Some(matched + n)
            };
        }
        self.watch.read();
    }
}

impl AsyncRead for Watched {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let r = Pin::new(&mut this.io).poll_read(cx, buf);
        if matches!(r, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            this.seen.saw(&buf.filled()[before..]);
        }
        r
    }
}

impl AsyncWrite for Watched {
    crate::forward::forward_writes!(io);
}

/// hyper-util's auto builder (HTTP/1.1, or h2c when the client opens with the HTTP/2 preface)
/// with the listeners' limits.
fn builder(c: &ConnectionConfig) -> auto::Builder<TokioExecutor> {
    let mut b = auto::Builder::new(TokioExecutor::new());
    b.http1()
        // The connection's watch times header reads (see the module docs).
        .header_read_timeout(None)
        // The read buffer bounds a request head: past it hyper answers 431.
        .max_buf_size(c.max_header_bytes);
    b.http2()
        .timer(TokioTimer::new())
        .max_concurrent_streams(c.http2_max_concurrent_streams)
        .max_header_list_size(u32::try_from(c.max_header_bytes).unwrap_or(u32::MAX))
        .keep_alive_interval(c.http2_keepalive_interval)
        .keep_alive_timeout(c.http2_keepalive_interval);
    b
}

/// Whether a connection ended because an HTTP/2 PING went unanswered: hyper says so only in
/// its error's text.
fn is_keepalive_timeout(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut cause = Some(e);
    while let Some(c) = cause {
        if c.to_string() == "keep-alive timed out" {
            return true;
        }
        cause = c.source();
    }
    false
}

/// Accepts connections until told to stop, up to the listener's limit (past it a connection is
/// closed at once); each is served by hyper-util's auto builder under its [`ConnWatch`]. On
/// [`Stop::Drain`] the listener closes and each connection finishes what it serves (HTTP/1.1
/// closes after its response, HTTP/2 sends GOAWAY); on [`Stop::Now`] every connection is
/// aborted. Returns the connections aborted.
pub(crate) async fn serve<F, Fut, B>(
    listener: TcpListener,
    stats: Arc<ListenerStats>,
    config: &ConnectionConfig,
    svc: F,
    mut stop: watch::Receiver<Stop>,
) -> usize
where
    F: Fn(SocketAddr, Request<Incoming>) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = Result<Response<B>, Infallible>> + Send + 'static,
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let builder = builder(config);
    let timeouts = Timeouts::from(config);
    let mut conns = JoinSet::new();
    // Every connection's watch, for eviction (pruned of closed ones as it grows).
    let mut evictable = Evictable::default();
    loop {
        let (stream, peer) = tokio::select! {
            _ = stop.changed() => break,
            r = listener.accept() => match r {
                Ok(c) => c,
                Err(e) => {
                    stats.accept_failed(&e);
                    // Out of descriptors (EMFILE) or memory: the reserve is for the admin
                    // listener and the upstreams, so wait for connections to close. A
                    // connection reset before it was accepted is that connection's alone.
                    if e.kind() != io::ErrorKind::ConnectionAborted
                        && e.kind() != io::ErrorKind::ConnectionReset
                    {
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    }
                    continue;
                }
            },
            Some(_) = conns.join_next(), if !conns.is_empty() => continue,
        };
        // Only this loop adds, so the count cannot pass the limit between the check and the add
        // (but for connections evicted and not yet gone, each closing at once).
        if stats.open.load(Ordering::Relaxed) >= stats.max && !evictable.evict_idlest() {
            drop(stream);
            stats.refuse(peer);
            continue;
        }
        stats.open.fetch_add(1, Ordering::Relaxed);
        stats.accepted.fetch_add(1, Ordering::Relaxed);
        let open = Open(stats.clone());
        let _ = stream.set_nodelay(true);
        let watch = Arc::new(ConnWatch::new());
        evictable.push(&watch, stats.max);
        let io = Watched { io: stream, seen: Seen::new(watch.clone()) };
        let service = {
            let (watch, svc) = (watch.clone(), svc.clone());
            hyper::service::service_fn(move |req: Request<Incoming>| {
                let in_flight = watch.begin();
                let answer = svc(peer, req);
                async move {
                    let mut resp = answer.await?;
                    // A piped answer is told its connection, to close it if the answer is cut.
                    if let Some(hook) = resp.extensions_mut().remove::<crate::relay::StallHook>() {
                        hook.attach(in_flight.0.clone() as Arc<dyn crate::relay::Stalled>);
                    }
                    Ok::<_, Infallible>(resp.map(|body| Tracked { body, in_flight }))
                }
            })
        };
        let conn = builder.serve_connection(TokioIo::new(io), service).into_owned();
        let (stats, mut stop) = (stats.clone(), stop.clone());
        conns.spawn(async move {
            let _open = open;
            tokio::pin!(conn);
            // Whether graceful shutdown was asked (drain or idle), and the watch fired.
            let (mut shut, mut expired) = (false, false);
            loop {
                tokio::select! {
                    r = conn.as_mut() => {
                        if let Err(e) = r {
                            if is_keepalive_timeout(&*e) {
                                stats.count(Closed::Http2KeepAlive);
                                tracing::debug!(listener = %stats.label, %peer, reason = "h2-keepalive", "connection closed");
                            } else {
                                stats.connection_failed(&*e);
                            }
                        }
                        break;
                    }
                    why = watch.expired(timeouts) => {
                        if !expired {
                            expired = true;
                            stats.count(why);
                            tracing::debug!(listener = %stats.label, %peer, reason = why.as_str(), "connection closed");
                        }
                        if matches!(why, Closed::Idle | Closed::Evicted) && !shut {
                            // Idle (or pushed out for a new connection): a GOAWAY (HTTP/2) or
                            // a close (HTTP/1.1), bounded.
                            shut = true;
                            watch.closing();
                            conn.as_mut().graceful_shutdown();
                            continue;
                        }
                        break;
                    }
                    _ = stop.wait_for(|s| *s != Stop::Run), if !shut => {
                        shut = true;
                        conn.as_mut().graceful_shutdown();
                    }
                }
            }
        });
    }
    drop(listener);
    if *stop.borrow() == Stop::Drain {
        tokio::select! {
            () = async { while conns.join_next().await.is_some() {} } => return 0,
            _ = stop.wait_for(|s| *s == Stop::Now) => {}
        }
    }
    let cut = conns.len();
    conns.shutdown().await;
    cut
}

/// Connections a full listener looks at to choose one to push out.
const EVICTION_SAMPLE: usize = 64;

/// The connections a listener may push out, sampled rather than scanned (Redis's approximate
/// LRU): a full listener with many connections looks at [`EVICTION_SAMPLE`] of them per new
/// connection, from where the last look ended, so a flood costs a bounded look per accept.
#[derive(Default)]
struct Evictable {
    watches: Vec<std::sync::Weak<ConnWatch>>,
    cursor: usize,
}

impl Evictable {
    fn push(&mut self, watch: &Arc<ConnWatch>, max: usize) {
        if self.watches.len() >= max.saturating_mul(2).max(EVICTION_SAMPLE) {
            self.watches.retain(|w| w.strong_count() > 0);
        }
        self.watches.push(Arc::downgrade(watch));
    }

    /// A full listener makes room for a new connection by closing the one idle longest (nothing
    /// in flight, no request begun) among those it looks at: a flood of idle connections cannot
    /// keep out a probe or a caller that sends its request at once, since each new connection
    /// pushes an old idle one out. `false` when none it looked at is idle (the new one is then
    /// refused).
    fn evict_idlest(&mut self) -> bool {
        let mut idlest: Option<(Instant, Arc<ConnWatch>)> = None;
        let mut looked = 0;
        while looked < EVICTION_SAMPLE && !self.watches.is_empty() {
            if self.cursor >= self.watches.len() {
                self.cursor = 0;
            }
            let Some(w) = self.watches[self.cursor].upgrade() else {
                // Closed: forgotten here, and the next one moves into its place.
                self.watches.swap_remove(self.cursor);
                continue;
            };
            looked += 1;
            self.cursor += 1;
            if let Some(since) = w.idle_for_eviction()
                && idlest.as_ref().is_none_or(|(t, _)| since < *t)
            {
                idlest = Some((since, w));
            }
        }
        match idlest {
            Some((_, w)) => {
                w.close_now(CLOSE_EVICTED);
                true
            }
            None => false,
        }
    }
}

/// Descriptors kept for everything but connections (files, Redis, the listeners): a tenth of
/// the limit, at least this many.
const RESERVE_MIN: u64 = 64;
/// A caller listener's default limit is never below this.
const MAX_CONNECTIONS_FLOOR: u64 = 16;

/// The default `max_connections` of each of `listeners` caller listeners, from the open-files
/// limit. Kept out first: a tenth of the limit (at least 64) for files and the like, and the
/// admin listener's limit; then the upstream connections take two descriptors per slot of
/// the caps (one in use, one pooled), at most half of what is left; the rest is shared
/// equally by the caller listeners.
pub(crate) fn default_max_connections(
    open_files: u64,
    listeners: usize,
    admin_max: usize,
    upstream_slots: u64,
) -> usize {
    let left = open_files
        .saturating_sub((open_files / 10).max(RESERVE_MIN))
        .saturating_sub(admin_max as u64);
    let upstream = upstream_slots.saturating_mul(2).min(left / 2);
    let share = (left - upstream) / (listeners.max(1) as u64);
    usize::try_from(share.max(MAX_CONNECTIONS_FLOOR)).unwrap_or(usize::MAX)
}

/// The process's open-files limit after start: the soft limit raised to the hard limit, once
/// per process, logged at info with both numbers. `None` where there is no such limit.
pub(crate) fn open_files_limit() -> Option<u64> {
    static LIMIT: OnceLock<Option<u64>> = OnceLock::new();
    *LIMIT.get_or_init(raise_open_files_limit)
}

#[cfg(unix)]
fn raise_open_files_limit() -> Option<u64> {
    use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};
    // `None` is "unlimited"; a process still stops at the kernel's own bound.
    let show = |v: Option<u64>| v.map_or_else(|| "unlimited".to_string(), |v| v.to_string());
    let before = getrlimit(Resource::Nofile);
    if before.current != before.maximum {
        let raised = Rlimit { current: before.maximum, maximum: before.maximum };
        match setrlimit(Resource::Nofile, raised) {
            Ok(()) => tracing::info!(
                soft = %show(before.current),
                hard = %show(before.maximum),
                "open-files limit: the soft limit raised to the hard limit"
            ),
            Err(e) => tracing::warn!(
                soft = %show(before.current),
                hard = %show(before.maximum),
                error = %e,
                "open-files limit: cannot raise the soft limit to the hard limit"
            ),
        }
    } else {
        tracing::info!(
            soft = %show(before.current),
            hard = %show(before.maximum),
            "open-files limit: the soft limit is the hard limit"
        );
    }
    Some(getrlimit(Resource::Nofile).current.unwrap_or(u64::MAX))
}

#[cfg(not(unix))]
fn raise_open_files_limit() -> Option<u64> {
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    const T: Timeouts =
        Timeouts { header_read: Duration::from_secs(10), idle: Duration::from_secs(60) };

    fn at(w: &ConnWatch) -> Option<(Duration, Closed)> {
        w.deadline(T).map(|(at, why)| (at - w.accepted, why))
    }

    #[tokio::test(start_paused = true)]
    async fn a_new_connection_has_the_header_timeout_from_its_start() {
        let w = Arc::new(ConnWatch::new());
        assert_eq!(at(&w), Some((Duration::from_secs(10), Closed::HeaderTimeout)));
        // Bytes trickling in do not move it.
        tokio::time::advance(Duration::from_secs(4)).await;
        w.read();
        assert_eq!(at(&w), Some((Duration::from_secs(10), Closed::HeaderTimeout)));
        let started = Instant::now();
        assert_eq!(w.expired(T).await, Closed::HeaderTimeout);
        assert_eq!(Instant::now() - started, Duration::from_secs(6));
    }

    #[tokio::test(start_paused = true)]
    async fn keep_alive_is_idle_until_the_next_requests_first_byte() {
        let w = Arc::new(ConnWatch::new());
        let req = w.begin();
        assert_eq!(at(&w), None, "nothing expires while a request is in flight");
        tokio::time::advance(Duration::from_secs(100)).await;
        drop(req);
        assert_eq!(at(&w), Some((Duration::from_secs(160), Closed::Idle)));
        tokio::time::advance(Duration::from_secs(55)).await;
        w.read();
        assert_eq!(
            at(&w),
            Some((Duration::from_secs(165), Closed::HeaderTimeout)),
            "the next request's head has the header timeout from its first byte"
        );
        w.read();
        assert_eq!(at(&w), Some((Duration::from_secs(165), Closed::HeaderTimeout)));
        let started = Instant::now();
        assert_eq!(w.expired(T).await, Closed::HeaderTimeout);
        assert_eq!(Instant::now() - started, Duration::from_secs(10));
    }

    #[tokio::test(start_paused = true)]
    async fn the_header_deadline_is_kept_by_a_watch_sleeping_on_the_idle_one() {
        let w = Arc::new(ConnWatch::new());
        drop(w.begin());
        let watch = w.clone();
        let expiry = tokio::spawn(async move { (watch.expired(T).await, Instant::now()) });
        tokio::time::advance(Duration::from_secs(30)).await;
        w.read();
        let (why, when) = expiry.await.unwrap();
        assert_eq!((why, when - w.accepted), (Closed::HeaderTimeout, Duration::from_secs(40)));
    }

    #[tokio::test(start_paused = true)]
    async fn http2_is_idle_with_no_stream_open_whatever_it_sends() {
        let w = Arc::new(ConnWatch::new());
        w.h2_preface();
        assert_eq!(at(&w), Some((Duration::from_secs(60), Closed::Idle)));
        let a = w.begin();
        let b = w.begin();
        drop(a);
        assert_eq!(at(&w), None, "a stream is still open");
        tokio::time::advance(Duration::from_secs(5)).await;
        drop(b);
        w.read();
        assert_eq!(at(&w), Some((Duration::from_secs(65), Closed::Idle)));
    }

    #[tokio::test(start_paused = true)]
    async fn a_closing_connection_gets_one_header_timeout_to_finish() {
        let w = Arc::new(ConnWatch::new());
        drop(w.begin());
        tokio::time::advance(Duration::from_secs(60)).await;
        assert_eq!(w.expired(T).await, Closed::Idle);
        w.closing();
        assert_eq!(at(&w), Some((Duration::from_secs(70), Closed::Idle)));
        let late = w.begin();
        assert_eq!(at(&w), None, "a request that squeezed in is served");
        drop(late);
    }

    #[test]
    fn the_preface_is_recognised_across_reads() {
        let w = Arc::new(ConnWatch::new());
        let mut seen = Seen::new(w.clone());
        seen.saw(&H2_PREFACE[..5]);
        seen.saw(&H2_PREFACE[5..]);
        assert!(w.phase().h2);
        let w = Arc::new(ConnWatch::new());
        let mut seen = Seen::new(w.clone());
        seen.saw(b"PRI * HTTP/1.1\r\n");
        seen.saw(&H2_PREFACE[16..]);
        assert!(!w.phase().h2);
    }

    #[test]
    fn the_default_limit_keeps_a_reserve() {
        // 1024 descriptors, one listener, the admin's 64, a cap of 20: 1024 − (102 + 64 + 40).
        assert_eq!(default_max_connections(1024, 1, 64, 20), 818);
        assert_eq!(default_max_connections(1024, 2, 64, 20), 409);
        // 2^20: a tenth is kept.
        assert_eq!(default_max_connections(1 << 20, 1, 64, 20), 943_615);
        // Caps far above the descriptors: the upstreams take half of what is left, not all.
        assert_eq!(default_max_connections(20_000, 1, 64, 10_000), 8968);
        // Too few descriptors for the reserve: the floor, never 0.
        assert_eq!(default_max_connections(100, 1, 64, 200), 16);
        assert_eq!(default_max_connections(0, 1, 0, 0), 16);
    }
}
