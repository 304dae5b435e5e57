//! The fault-injecting server: HTTP/1.1 and h2c (prior knowledge) on one listener.
//!
//! Each traffic request, in order:
//! 1. arrives: it takes a sequence number and the in-flight count goes up by one (the value it
//!    sees, itself included, is recorded);
//! 2. as a model provider, has its body read and meets the provider first: its quota, an
//!    overloaded draw and its buckets per minute answer at once (see [`crate::provider`]);
//!    without a provider, an overloaded draw is answered at once here too;
//! 3. meets the phase's limits: an empty rate-limit bucket or a full concurrency limit answers
//!    429 at once;
//! 4. has its request body read (a real server reads what it is sent);
//! 5. gets its draw from the seeded sampler: reset, error, truncated body or a normal answer,
//!    and a latency;
//! 6. waits out the latency — in a task of its own with `on_disconnect = finish`, so a client
//!    that leaves does not stop the work; inside the connection's future with `cancel`, so it
//!    stops with it;
//! 7. answers, and leaves the in-flight count when its body's last byte has been produced (or the
//!    work is abandoned), never later: a client that has the whole response can rely on the
//!    upstream having already counted that request out.
//!
//! `GET /stats`, `POST /stats/reset` and `POST /phase/next` are admin requests on the same
//! listener; they are never counted as traffic.

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::task::{Context, Poll, ready};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::header::{CONTENT_TYPE, HeaderName, HeaderValue, RETRY_AFTER};
use http::{Method, Request, Response, StatusCode, Version};
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use stormguard_http::stacked::StackedHeaders;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{oneshot, watch};
use tokio::task::JoinHandle;
use tokio::time::Sleep;

use crate::provider::{Provider, ProviderConfig, ProviderOptions, Taken};
use crate::sampler::{Action, Draw, Sampler};
use crate::script::{InvalidScript, OnDisconnect, Phase, RateLimit, Script};
use crate::stats::{Counters, Epoch, Event, Stats};

/// `X-Concurrency-Limit-Limit`: the server's concurrency limit, on every traffic response.
pub static LIMIT_HEADER: HeaderName = HeaderName::from_static("x-concurrency-limit-limit");
/// `X-Concurrency-Limit-Remaining`: how many more requests it would admit now.
pub static REMAINING_HEADER: HeaderName = HeaderName::from_static("x-concurrency-limit-remaining");
/// `retry-after-ms`: the rate limit's wait, in milliseconds (`Retry-After` has whole seconds).
pub static RETRY_AFTER_MS_HEADER: HeaderName = HeaderName::from_static("retry-after-ms");
/// `x-chaos-phase`: the name of the phase that answered.
pub static PHASE_HEADER: HeaderName = HeaderName::from_static("x-chaos-phase");

/// Everything the server needs: the script and the run-wide settings.
#[derive(Debug, Clone, PartialEq)]
pub struct ChaosConfig {
    /// The phases.
    pub script: Script,
    /// The sampler's seed: the same seed and the same request sequence give the same draws.
    pub seed: u64,
    /// What to do with a request whose client left. Default [`OnDisconnect::Finish`].
    pub on_disconnect: OnDisconnect,
    /// The in-flight histogram has one bucket per integer up to this (default 4096); above it the
    /// percentiles fall back to the exact maximum.
    pub in_flight_buckets: u64,
    /// Serve as a model provider (OpenAI- or Anthropic-shaped, with requests and tokens per
    /// minute; see [`crate::provider`]). Default: the script's, or none.
    pub provider: Option<ProviderConfig>,
    /// The provider's split token limits, streams and quota; used only with `provider`.
    /// Default: the script's, or [`ProviderOptions::default`].
    pub provider_options: ProviderOptions,
    /// When the timeline begins; until then the first phase plays. Default: when the server
    /// starts. A later start lets a caller line its traffic up with the phases exactly.
    pub start: Option<Instant>,
    /// Serve as a service in the middle of a call tree: a plain answer calls this URL's host
    /// with the request's path first ([`crate::forward`]). Default none.
    pub forward: Option<http::Uri>,
}

impl ChaosConfig {
    /// The script's settings, or the defaults (seed 0, `finish`).
    pub fn new(script: Script) -> ChaosConfig {
        ChaosConfig {
            seed: script.seed.unwrap_or(0),
            on_disconnect: script.on_disconnect.unwrap_or_default(),
            in_flight_buckets: 4096,
            provider: script.provider,
            provider_options: script.provider_options,
            start: None,
            forward: None,
            script,
        }
    }

    /// One phase, forever.
    pub fn single(phase: Phase) -> ChaosConfig {
        ChaosConfig::new(Script::single(phase))
    }

    /// Checks the script's phases and the provider in force.
    pub fn validate(&self) -> Result<(), InvalidScript> {
        let script = Script { provider: None, ..self.script.clone() };
        script.validate()?;
        match &self.provider {
            Some(p) => p.validate(&self.provider_options).map_err(InvalidScript::Provider),
            None => Ok(()),
        }
    }
}

/// Why the server could not start.
#[derive(Debug, thiserror::Error)]
pub enum ChaosError {
    /// The configuration is invalid.
    #[error("invalid chaos config: {0}")]
    Invalid(String),
    /// The address could not be bound.
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        /// The address asked for.
        addr: SocketAddr,
        /// Why.
        source: io::Error,
    },
}

/// The body of an injected reset: returned as the service's error (HTTP/1.1: the connection is
/// closed with a TCP reset; h2: the stream is reset) or as a body error (the truncated body).
#[derive(Debug, thiserror::Error)]
#[error("injected reset")]
pub(crate) struct InjectedReset;

/// Starts a chaos server on `addr` (`127.0.0.1:0` picks a free port) on the current tokio
/// runtime. The server runs until [`ChaosServer::shutdown`] or until the handle is dropped.
pub async fn spawn(config: ChaosConfig, addr: SocketAddr) -> Result<ChaosServer, ChaosError> {
    ChaosServer::spawn(config, addr).await
}

/// A running chaos server. Dropping it stops accepting and closes its connections.
#[derive(Debug)]
pub struct ChaosServer {
    addr: SocketAddr,
    shared: Arc<Shared>,
    shutdown: watch::Sender<bool>,
    task: Option<JoinHandle<()>>,
}

impl ChaosServer {
    /// See [`spawn`].
    pub async fn spawn(config: ChaosConfig, addr: SocketAddr) -> Result<ChaosServer, ChaosError> {
        config.validate().map_err(|e| ChaosError::Invalid(e.to_string()))?;
        let listener =
            TcpListener::bind(addr).await.map_err(|source| ChaosError::Bind { addr, source })?;
        let local = listener.local_addr().map_err(|source| ChaosError::Bind { addr, source })?;
        let shared = Arc::new(Shared::new(config));
        let (shutdown, rx) = watch::channel(false);
        let task = tokio::spawn(accept_loop(listener, shared.clone(), rx));
        tracing::debug!(addr = %local, "chaos server listening");
        Ok(ChaosServer { addr: local, shared, shutdown, task: Some(task) })
    }

    /// The address it listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://ADDR` followed by `path` (which should start with `/`).
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr, path)
    }

    /// What the server has seen since the last reset.
    pub fn stats(&self) -> Stats {
        self.shared.stats()
    }

    /// Starts a new count and returns the one it closes. Requests in flight keep their place in
    /// the in-flight count, but count nothing into the new totals.
    pub fn reset(&self) -> Stats {
        self.shared.reset()
    }

    /// Moves to the next phase now (from the last: to the first if the script repeats, else
    /// stays); returns the new phase's name.
    pub fn next_phase(&self) -> String {
        let i = self.shared.clock.next(self.shared.clock.origin.elapsed());
        self.shared.names[i].clone()
    }

    /// When its timeline began (the first phase's start): phases run from here.
    pub fn started(&self) -> Instant {
        self.shared.clock.origin
    }

    /// The current phase's name.
    pub fn phase(&self) -> String {
        self.shared.names[self.shared.clock.current()].clone()
    }

    /// What the model provider answered since the last reset, by kind: the totals' `provider`
    /// counts (per phase they are in [`ChaosServer::stats`]).
    pub fn provider_counts(&self) -> crate::stats::ProviderCounts {
        self.shared.stats().total.provider
    }

    /// Requests in flight now.
    pub fn in_flight(&self) -> u64 {
        self.shared.in_flight.load(Ordering::Acquire)
    }

    /// Stops accepting, closes every connection, and waits for the accept loop to end. Work
    /// already running under `finish` completes on its own.
    pub async fn shutdown(mut self) {
        let _ = self.shutdown.send(true);
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
    }
}

impl Drop for ChaosServer {
    fn drop(&mut self) {
        let _ = self.shutdown.send(true);
    }
}

/// What every connection shares.
#[derive(Debug)]
struct Shared {
    phases: Vec<Phase>,
    names: Vec<String>,
    phase_headers: Vec<HeaderValue>,
    bodies: Vec<Bytes>,
    limiters: Vec<Option<RateLimiter>>,
    /// The servers, one pool across the phases that have a number of them.
    servers: Servers,
    sampler: Sampler,
    on_disconnect: OnDisconnect,
    clock: PhaseClock,
    /// The next request's sequence number: the sampler's `k`.
    seq: AtomicU64,
    /// Traffic requests in flight.
    in_flight: AtomicU64,
    epoch: RwLock<Arc<Epoch>>,
    in_flight_buckets: u64,
    stacked: StackedHeaders,
    provider: Option<Provider>,
    forward: Option<crate::forward::Forwarder>,
}

impl Shared {
    fn new(config: ChaosConfig) -> Shared {
        let phases = config.script.phases;
        let names: Vec<String> = phases.iter().map(|p| p.name.clone()).collect();
        Shared {
            phase_headers: names
                .iter()
                .map(|n| HeaderValue::from_str(n).unwrap_or(HeaderValue::from_static("?")))
                .collect(),
            bodies: phases.iter().map(|p| body_of(p.body_bytes)).collect(),
            limiters: phases.iter().map(|p| p.rate_limit.map(RateLimiter::new)).collect(),
            servers: Servers::new(),
            sampler: Sampler::new(config.seed),
            on_disconnect: config.on_disconnect,
            clock: PhaseClock::starting(
                phases.iter().map(|p| p.duration).collect(),
                config.script.repeat,
                config.start.unwrap_or_else(Instant::now),
            ),
            seq: AtomicU64::new(0),
            in_flight: AtomicU64::new(0),
            epoch: RwLock::new(Arc::new(Epoch::new(phases.len(), config.in_flight_buckets))),
            in_flight_buckets: config.in_flight_buckets,
            stacked: StackedHeaders::default(),
            provider: config.provider.map(|p| Provider::new(p, config.provider_options)),
            forward: config.forward.map(crate::forward::Forwarder::new),
            names,
            phases,
        }
    }

    fn epoch(&self) -> Arc<Epoch> {
        self.epoch.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    fn stats(&self) -> Stats {
        self.epoch().snapshot(
            &self.names,
            self.clock.current(),
            self.in_flight.load(Ordering::Acquire),
        )
    }

    fn reset(&self) -> Stats {
        let fresh = Arc::new(Epoch::new(self.phases.len(), self.in_flight_buckets));
        let old =
            std::mem::replace(&mut *self.epoch.write().unwrap_or_else(|e| e.into_inner()), fresh);
        old.snapshot(&self.names, self.clock.current(), self.in_flight.load(Ordering::Acquire))
    }
}

/// `ok\n` repeated to `n` bytes.
fn body_of(n: usize) -> Bytes {
    Bytes::from(b"ok\n".iter().copied().cycle().take(n).collect::<Vec<u8>>())
}

/// Which phase is current. Timed phases switch lazily: the first request (or stats read) after a
/// deadline advances the clock, so no timer task runs behind the caller's back.
#[derive(Debug)]
pub(crate) struct PhaseClock {
    durations: Vec<Option<Duration>>,
    repeat: bool,
    origin: Instant,
    index: AtomicUsize,
    /// When the current phase ends, in nanoseconds since `origin`; `u64::MAX` for never.
    deadline: AtomicU64,
    /// The current phase and when it started (since `origin`); the truth that the two atomics
    /// publish for the fast path.
    inner: Mutex<(usize, Duration)>,
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

impl PhaseClock {
    #[cfg(test)]
    fn new(durations: Vec<Option<Duration>>, repeat: bool) -> PhaseClock {
        PhaseClock::starting(durations, repeat, Instant::now())
    }

    /// A clock whose first phase starts at `origin` (now or later; before it, time stands at
    /// zero).
    pub(crate) fn starting(
        durations: Vec<Option<Duration>>,
        repeat: bool,
        origin: Instant,
    ) -> PhaseClock {
        let clock = PhaseClock {
            durations,
            repeat,
            origin,
            index: AtomicUsize::new(0),
            deadline: AtomicU64::new(u64::MAX),
            inner: Mutex::new((0, Duration::ZERO)),
        };
        clock.publish(0, Duration::ZERO);
        clock
    }

    fn current(&self) -> usize {
        self.at(self.origin.elapsed())
    }

    fn publish(&self, index: usize, start: Duration) {
        let last = index + 1 == self.durations.len();
        let deadline = match self.durations[index] {
            Some(d) if !last || self.repeat => nanos(start + d),
            _ => u64::MAX,
        };
        self.index.store(index, Ordering::Relaxed);
        // Release: a reader that sees this deadline (Acquire) also sees the index stored above.
        self.deadline.store(deadline, Ordering::Release);
    }

    /// The phase at `now` (time since the clock's origin); advances past expired phases.
    pub(crate) fn at(&self, now: Duration) -> usize {
        if nanos(now) < self.deadline.load(Ordering::Acquire) {
            return self.index.load(Ordering::Relaxed);
        }
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let (mut index, mut start) = *inner;
        while let Some(d) = self.durations[index] {
            if now < start + d {
                break;
            }
            if index + 1 < self.durations.len() {
                index += 1;
            } else if self.repeat {
                index = 0;
            } else {
                break;
            }
            start += d;
        }
        *inner = (index, start);
        self.publish(index, start);
        index
    }

    /// Moves to the next phase at `now`.
    pub(crate) fn next(&self, now: Duration) -> usize {
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let index = if inner.0 + 1 < self.durations.len() {
            inner.0 + 1
        } else if self.repeat {
            0
        } else {
            inner.0
        };
        *inner = (index, now);
        self.publish(index, now);
        index
    }
}

/// A token bucket. A lock is fine here: only phases with a rate limit take it, and a rate
/// limit is there to make the server slow anyway.
#[derive(Debug)]
struct RateLimiter {
    limit: RateLimit,
    /// Tokens and when they were counted.
    bucket: Mutex<(f64, Instant)>,
}

impl RateLimiter {
    fn new(limit: RateLimit) -> RateLimiter {
        RateLimiter { limit, bucket: Mutex::new((limit.burst as f64, Instant::now())) }
    }

    /// Takes a token, or says how long until one is there.
    fn try_take(&self) -> Result<(), Duration> {
        let rate = self.limit.rate.per_second();
        let mut b = self.bucket.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        let tokens =
            (b.0 + now.duration_since(b.1).as_secs_f64() * rate).min(self.limit.burst as f64);
        *b = (tokens, now);
        if tokens >= 1.0 {
            b.0 -= 1.0;
            Ok(())
        } else {
            Err(Duration::from_secs_f64((1.0 - tokens) / rate))
        }
    }
}

/// One traffic request's place in the in-flight count; leaving it (drop) counts the request out.
#[derive(Debug)]
struct InFlight {
    shared: Arc<Shared>,
    epoch: Arc<Epoch>,
    phase: usize,
    /// The request's sequence number: the sampler's `k`.
    seq: u64,
    /// The handler has really finished (answer delivered, reset or truncation done). Dropped
    /// without it, the client left first.
    done: bool,
    /// When the request arrived.
    arrived: Instant,
    /// How long the drawn work should have held it (the wait for a server and the drawn
    /// latency), for a plain answer; the rest of its time here is chaos's own share.
    drawn: Option<Duration>,
}

impl InFlight {
    fn record(&self, f: impl Fn(&Counters)) {
        self.epoch.both(self.phase, f);
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        if !self.done {
            self.record(|c| c.event(Event::ClientGone));
        } else if let Some(drawn) = self.drawn {
            let late = self.arrived.elapsed().saturating_sub(drawn);
            self.record(|c| c.late(late));
        }
        // AcqRel on both sides of the count: the arrival of a request sent after this one was
        // answered is ordered after this decrement (the answer is produced after it).
        self.shared.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The response body: the phase's bytes, possibly spread over time or cut off, holding the
/// request's in-flight place until the last byte is produced.
#[derive(Debug)]
pub(crate) struct ChaosBody {
    data: Bytes,
    len: u64,
    chunk: usize,
    interval: Option<Duration>,
    sleep: Option<Pin<Box<Sleep>>>,
    /// Truncation: bytes still to send before the cut.
    cut_after: Option<usize>,
    guard: Option<InFlight>,
    /// A streamed answer, sent one event a frame instead of `data`.
    stream: Option<Stream>,
}

/// A streamed answer's events and where it stands.
#[derive(Debug)]
struct Stream {
    events: std::collections::VecDeque<Bytes>,
    /// The pause before each event after the first.
    delay: Duration,
    /// Events still to send before the connection is cut.
    cut_after: Option<usize>,
    started: bool,
    /// Its end (completed or cut) is counted.
    ended: bool,
}

impl ChaosBody {
    fn full(data: Bytes) -> ChaosBody {
        ChaosBody {
            len: data.len() as u64,
            chunk: data.len().max(1),
            data,
            interval: None,
            sleep: None,
            cut_after: None,
            guard: None,
            stream: None,
        }
    }

    /// Sends `events` instead of the body, one a frame, `delay` apart; cut (a body error)
    /// after `cut_after` of them when set.
    fn stream(&mut self, events: Vec<Bytes>, delay: Duration, cut_after: Option<usize>) {
        self.data.clear();
        self.len = 0;
        self.stream =
            Some(Stream { events: events.into(), delay, cut_after, started: false, ended: false });
    }

    fn record(&self, e: Event) {
        if let Some(g) = &self.guard {
            g.record(|c| c.event(e));
        }
    }

    /// The next event of a stream: its frame, the cut, or the end.
    fn poll_event(&mut self) -> Option<Result<Frame<Bytes>, InjectedReset>> {
        let s = self.stream.as_mut()?;
        if s.ended {
            return None;
        }
        if s.cut_after == Some(0) {
            s.ended = true;
            s.events.clear();
            self.record(Event::StreamBroken);
            self.finish();
            return Some(Err(InjectedReset));
        }
        let Some(event) = s.events.pop_front() else {
            s.ended = true;
            self.record(Event::StreamCompleted);
            self.finish();
            return None;
        };
        let first = !s.started;
        s.started = true;
        if let Some(left) = s.cut_after.as_mut() {
            *left -= 1;
        }
        let last = s.events.is_empty();
        let cut_next = s.cut_after == Some(0) && !last;
        let delay = s.delay;
        if last {
            s.ended = true;
        }
        if first {
            self.record(Event::StreamStarted);
        }
        if last {
            // Counted out before the last event is handed over, as a whole body is.
            self.record(Event::StreamCompleted);
            self.finish();
        } else if cut_next {
            // Long enough for the server to flush the event before the cut drops what is
            // unflushed.
            self.sleep = Some(Box::pin(tokio::time::sleep(delay.max(CUT_PAUSE))));
        } else if !delay.is_zero() {
            self.sleep = Some(Box::pin(tokio::time::sleep(delay)));
        }
        Some(Ok(Frame::data(event)))
    }

    fn finish(&mut self) {
        if let Some(mut g) = self.guard.take() {
            g.done = true;
        }
    }

    /// The client is gone before the response was handed over: count it so, once.
    fn client_gone(mut self) {
        if let Some(mut g) = self.guard.take() {
            g.done = false;
        }
    }
}

/// How long a body waits before it is cut, after what it sent of itself (see `poll_frame`).
const CUT_PAUSE: Duration = Duration::from_millis(10);

impl Body for ChaosBody {
    type Data = Bytes;
    type Error = InjectedReset;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, InjectedReset>>> {
        let this = self.get_mut();
        if let Some(sleep) = this.sleep.as_mut() {
            ready!(sleep.as_mut().poll(cx));
            this.sleep = None;
        }
        if this.stream.is_some() {
            return Poll::Ready(this.poll_event());
        }
        if this.cut_after == Some(0) {
            this.cut_after = None;
            this.data.clear();
            this.finish();
            return Poll::Ready(Some(Err(InjectedReset)));
        }
        if this.data.is_empty() {
            this.finish();
            return Poll::Ready(None);
        }
        let mut n = this.chunk.min(this.data.len());
        if let Some(left) = this.cut_after {
            n = n.min(left);
            this.cut_after = Some(left - n);
        }
        let frame = this.data.split_to(n);
        if this.data.is_empty() && this.cut_after.is_none() {
            // Counted out before the last bytes are handed over, so no client can see the whole
            // response while the request still counts in flight.
            this.finish();
        } else if this.cut_after == Some(0) {
            // Pause before the cut, so the server flushes what was sent and the client reads it:
            // the client must see the head and half the body, then the failure (an error drops
            // unflushed bytes, and a client that had not read the head by the close would count
            // a reset). 2 ms was once too short on a loaded 2-core machine.
            this.sleep = Some(Box::pin(tokio::time::sleep(CUT_PAUSE)));
        } else if let Some(interval) = this.interval {
            this.sleep = Some(Box::pin(tokio::time::sleep(interval)));
        }
        Poll::Ready(Some(Ok(Frame::data(frame))))
    }

    fn is_end_stream(&self) -> bool {
        self.data.is_empty()
            && self.cut_after.is_none()
            && self.guard.is_none()
            && self.stream.as_ref().is_none_or(|s| s.ended)
    }

    fn size_hint(&self) -> SizeHint {
        if self.stream.is_some() {
            // Events are sent as they come (chunked on HTTP/1.1).
            return SizeHint::default();
        }
        // Exact even when the body will be cut: the declared length is what makes the cut
        // detectable as a truncation rather than a short answer.
        SizeHint::with_exact(self.len)
    }
}

impl Drop for ChaosBody {
    fn drop(&mut self) {
        if let Some(s) = &self.stream {
            // A stream whose client left: it still ends as one thing, broken if a cut was
            // coming (the client left first), else abandoned. The guard, dropped unfinished,
            // counts the client gone.
            if s.started && !s.ended {
                let cut = s.cut_after.is_some();
                self.record(if cut { Event::StreamBroken } else { Event::StreamAbandoned });
            }
            return;
        }
        // An empty body that was never polled was still delivered in full.
        if self.data.is_empty() && self.cut_after.is_none() {
            self.finish();
        }
    }
}

/// A TCP stream that, when its connection was marked for a reset, closes with RST (SO_LINGER 0)
/// instead of FIN.
#[derive(Debug)]
struct ResetOnDrop {
    stream: TcpStream,
    reset: Arc<AtomicBool>,
}

impl AsyncRead for ResetOnDrop {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for ResetOnDrop {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().stream).poll_write(cx, buf)
    }
    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().stream).poll_write_vectored(cx, bufs)
    }
    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_flush(cx)
    }
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_shutdown(cx)
    }
}

impl Drop for ResetOnDrop {
    fn drop(&mut self) {
        if self.reset.load(Ordering::Acquire) {
            let _ = self.stream.set_zero_linger();
        }
    }
}

async fn accept_loop(
    listener: TcpListener,
    shared: Arc<Shared>,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder.http1().timer(TokioTimer::new());
    builder.http2().timer(TokioTimer::new()).max_concurrent_streams(10_000);
    let builder = Arc::new(builder);
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => {
                    let _ = stream.set_nodelay(true);
                    tokio::spawn(serve_connection(
                        builder.clone(),
                        shared.clone(),
                        stream,
                        shutdown.clone(),
                    ));
                }
                Err(e) => {
                    // Out of file descriptors, most likely: back off instead of spinning.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            },
            _ = shutdown.changed() => break,
        }
    }
}

async fn serve_connection(
    builder: Arc<auto::Builder<TokioExecutor>>,
    shared: Arc<Shared>,
    stream: TcpStream,
    mut shutdown: watch::Receiver<bool>,
) {
    let reset = Arc::new(AtomicBool::new(false));
    let io = TokioIo::new(ResetOnDrop { stream, reset: reset.clone() });
    let service = service_fn(move |req| handle(shared.clone(), reset.clone(), req));
    let conn = builder.serve_connection(io, service);
    tokio::select! {
        result = conn => {
            if let Err(e) = result {
                tracing::trace!(error = %e, "connection ended");
            }
        }
        _ = shutdown.changed() => {}
    }
}

fn json_response(status: StatusCode, value: &impl serde::Serialize) -> Response<ChaosBody> {
    let body = serde_json::to_vec(value).unwrap_or_default();
    let mut resp = Response::new(ChaosBody::full(Bytes::from(body)));
    *resp.status_mut() = status;
    resp.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    resp
}

/// The admin endpoints, or `None` for traffic.
fn admin(shared: &Shared, req: &Request<Incoming>) -> Option<Response<ChaosBody>> {
    let path = req.uri().path();
    let allowed = match path {
        "/stats" => Method::GET,
        "/stats/reset" | "/phase/next" => Method::POST,
        _ => return None,
    };
    if req.method() != allowed {
        let msg = serde_json::json!({ "error": format!("{path} takes {allowed}") });
        return Some(json_response(StatusCode::METHOD_NOT_ALLOWED, &msg));
    }
    Some(match path {
        "/stats" => json_response(StatusCode::OK, &shared.stats()),
        "/stats/reset" => json_response(StatusCode::OK, &shared.reset()),
        _ => {
            let i = shared.clock.next(shared.clock.origin.elapsed());
            let body = serde_json::json!({ "phase": shared.names[i], "phase_index": i });
            json_response(StatusCode::OK, &body)
        }
    })
}

type Answer = Result<Response<ChaosBody>, InjectedReset>;

async fn handle(
    shared: Arc<Shared>,
    conn_reset: Arc<AtomicBool>,
    req: Request<Incoming>,
) -> Answer {
    if let Some(resp) = admin(&shared, &req) {
        return Ok(resp);
    }
    let retry = shared.stacked.arrived_as_retry(req.headers());
    let h2 = req.version() == Version::HTTP_2;
    let outbound = shared.forward.as_ref().map(|_| crate::forward::Outbound::of(&req));
    let phase_index = shared.clock.current();
    let epoch = shared.epoch();
    let seq = shared.seq.fetch_add(1, Ordering::Relaxed);
    let n = shared.in_flight.fetch_add(1, Ordering::AcqRel) + 1;
    let guard = InFlight {
        shared: shared.clone(),
        epoch,
        phase: phase_index,
        seq,
        done: false,
        arrived: Instant::now(),
        drawn: None,
    };
    guard.record(|c| c.arrive(n, retry));
    let phase = &shared.phases[phase_index];
    // The draw is a pure function of the sequence number: made now, so an overloaded provider
    // can shed at the door; its action and latency are used after the limits.
    let mut draw = shared.sampler.draw(phase, seq);

    // As a model provider: the request's tokens are read from its body, then the quota, an
    // overloaded draw and the buckets per minute answer at once, the provider's way.
    let mut req = Some(req);
    let mut taken = None;
    if let Some(provider) = &shared.provider {
        let body = read_body(req.take().expect("the request").into_body()).await;
        let asked = Provider::read(&body);
        if provider.quota_exhausted() {
            guard.record(|c| c.event(Event::QuotaExhausted));
            return Ok(shaped(guard, Some(provider), provider.quota_answer()));
        }
        if draw.action == Action::Overloaded {
            return Ok(overloaded(guard, Some(provider)));
        }
        match provider.take(asked) {
            Ok(mut t) => {
                t.break_stream = asked.stream
                    && shared.sampler.breaks_stream(seq, provider.options.stream_break_rate);
                taken = Some(t);
            }
            Err(refused) => {
                guard.record(|c| c.event(Event::RateLimited));
                guard.record(|c| c.event(Event::ProviderRateLimited));
                let body = provider.limited_body(refused.quantity);
                let mut resp = shaped(guard, Some(provider), (StatusCode::TOO_MANY_REQUESTS, body));
                retry_after(resp.headers_mut(), refused.wait);
                return Ok(resp);
            }
        }
    } else if draw.action == Action::Overloaded {
        return Ok(overloaded(guard, None));
    }

    if let Some(limiter) = &shared.limiters[phase_index]
        && let Err(wait) = limiter.try_take()
    {
        guard.record(|c| c.event(Event::RateLimited));
        let mut resp = respond(guard, StatusCode::TOO_MANY_REQUESTS, rate_limited_body());
        retry_after(resp.headers_mut(), wait);
        concurrency_headers(&mut resp, phase, n);
        return Ok(resp);
    }
    if let Some(max) = phase.max_concurrency
        && n > max
    {
        guard.record(|c| c.event(Event::ConcurrencyLimited));
        let mut resp = respond(guard, StatusCode::TOO_MANY_REQUESTS, concurrency_limited_body());
        concurrency_headers(&mut resp, phase, n);
        return Ok(resp);
    }

    // Read what the client sends, as a real server would; a client that leaves before its
    // request is complete simply drops this future.
    if let Some(req) = req {
        let mut body = req.into_body();
        if !body.is_end_stream() {
            while let Some(frame) = body.frame().await {
                if frame.is_err() {
                    break;
                }
            }
        }
    }

    draw.latency = stretched(draw.latency, n, phase);
    match shared.on_disconnect {
        OnDisconnect::Finish if !draw.latency.is_zero() || phase.servers.is_some() => {
            // The work is its own task, so the connection going away cannot cancel it.
            let (tx, rx) = oneshot::channel();
            tokio::spawn(async move {
                let answer = work(guard, draw, h2, conn_reset, n, taken, outbound).await;
                if let Err(Ok(resp)) = tx.send(answer) {
                    resp.into_body().client_gone();
                }
            });
            rx.await.unwrap_or(Err(InjectedReset))
        }
        _ => work(guard, draw, h2, conn_reset, n, taken, outbound).await,
    }
}

/// A drawn latency under load: with more in flight than `workers`, each request shares them
/// and takes `in flight / workers` times longer (never past `latency_max`, nor below the draw).
fn stretched(latency: Duration, in_flight: u64, phase: &Phase) -> Duration {
    match phase.workers {
        Some(workers) if in_flight > workers => {
            latency.mul_f64(in_flight as f64 / workers as f64).min(phase.latency_max).max(latency)
        }
        _ => latency,
    }
}

/// `Retry-After` in whole seconds (rounded up, at least 1) and `retry-after-ms`.
fn retry_after(h: &mut http::HeaderMap, wait: Duration) {
    let secs = wait.as_secs() + u64::from(wait.subsec_nanos() > 0);
    h.insert(RETRY_AFTER, HeaderValue::from(secs.max(1)));
    let ms = wait.as_millis() + u128::from(!wait.subsec_nanos().is_multiple_of(1_000_000));
    h.insert(
        RETRY_AFTER_MS_HEADER.clone(),
        HeaderValue::from(u64::try_from(ms).unwrap_or(u64::MAX)),
    );
}

/// A provider's JSON answer (or, without a provider, one in Anthropic's shape), with the
/// provider's rate-limit headers.
fn shaped(
    guard: InFlight,
    provider: Option<&Provider>,
    (status, body): crate::provider::Shaped,
) -> Response<ChaosBody> {
    let mut resp = respond(guard, status, body);
    resp.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    if let Some(p) = provider {
        p.headers(resp.headers_mut());
    }
    resp
}

/// The overloaded answer: 529 (or 503 for OpenAI), counted.
fn overloaded(guard: InFlight, provider: Option<&Provider>) -> Response<ChaosBody> {
    guard.record(|c| c.event(Event::Overloaded));
    shaped(guard, provider, crate::provider::overloaded(provider.map(Provider::kind)))
}

fn rate_limited_body() -> Bytes {
    Bytes::from_static(b"rate limited\n")
}

fn concurrency_limited_body() -> Bytes {
    Bytes::from_static(b"concurrency limit reached\n")
}

/// A response carrying `guard` in its body; records its status.
fn respond(guard: InFlight, status: StatusCode, body: Bytes) -> Response<ChaosBody> {
    guard.record(|c| c.status(status.as_u16()));
    let phase = guard.shared.phase_headers[guard.phase].clone();
    let mut b = ChaosBody::full(body);
    b.guard = Some(guard);
    let mut resp = Response::new(b);
    *resp.status_mut() = status;
    resp.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static("text/plain"));
    resp.headers_mut().insert(PHASE_HEADER.clone(), phase);
    resp
}

fn concurrency_headers(resp: &mut Response<ChaosBody>, phase: &Phase, in_flight: u64) {
    if let Some(max) = phase.max_concurrency {
        resp.headers_mut().insert(LIMIT_HEADER.clone(), HeaderValue::from(max));
        let remaining = max.saturating_sub(in_flight);
        resp.headers_mut().insert(REMAINING_HEADER.clone(), HeaderValue::from(remaining));
    }
}

/// The dependency's servers: one pool, FIFO (tokio's semaphore is fair), resized to each
/// phase's `servers` when the phase's first request comes — as the simulator's dependency keeps
/// one set of servers and one queue whose capacity a phase changes. Growing adds servers at
/// once; shrinking retires idle ones at once and busy ones as they finish (no work is cut
/// short). A request still waiting from an earlier phase keeps its place in line.
#[derive(Debug)]
struct Servers {
    free: Arc<tokio::sync::Semaphore>,
    /// Servers still to retire as they finish their work.
    debt: Arc<AtomicU64>,
    /// Requests waiting for a server now.
    waiting: AtomicU64,
    /// The phase whose size is in force (`usize::MAX`: none yet), and that size.
    sized: Mutex<(usize, u64)>,
    sized_phase: AtomicUsize,
}

/// A server held while a request is worked on; retired on release if the pool shrank.
struct Server {
    permit: Option<tokio::sync::OwnedSemaphorePermit>,
    debt: Arc<AtomicU64>,
}

impl Drop for Server {
    fn drop(&mut self) {
        let retire =
            self.debt.fetch_update(Ordering::AcqRel, Ordering::Acquire, |d| d.checked_sub(1));
        if let (Ok(_), Some(p)) = (retire, self.permit.take()) {
            p.forget();
        }
    }
}

impl Servers {
    fn new() -> Servers {
        Servers {
            free: Arc::new(tokio::sync::Semaphore::new(0)),
            debt: Arc::new(AtomicU64::new(0)),
            waiting: AtomicU64::new(0),
            sized: Mutex::new((usize::MAX, 0)),
            sized_phase: AtomicUsize::new(usize::MAX),
        }
    }

    /// Makes the pool `n` servers for `phase` (once per phase change).
    fn resize(&self, phase: usize, n: u64) {
        if self.sized_phase.load(Ordering::Acquire) == phase {
            return;
        }
        let mut sized = self.sized.lock().unwrap_or_else(|e| e.into_inner());
        if sized.0 == phase {
            return;
        }
        let n = n.min(tokio::sync::Semaphore::MAX_PERMITS as u64);
        let old = sized.1;
        if n > old {
            // Retirements still owed are cancelled first; the rest are new servers.
            let more = n - old;
            let owed = self
                .debt
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |d| Some(d - d.min(more)))
                .unwrap_or(0);
            self.free.add_permits((more - owed.min(more)) as usize);
        } else if n < old {
            let cut = old - n;
            let idle = self.free.forget_permits(cut as usize) as u64;
            self.debt.fetch_add(cut - idle, Ordering::AcqRel);
        }
        *sized = (phase, n);
        self.sized_phase.store(phase, Ordering::Release);
    }

    /// A server, at once or after waiting in line; `None` when every server is busy and
    /// `queue` (if any) are already waiting.
    async fn take(&self, queue: Option<u64>) -> Option<Server> {
        let debt = self.debt.clone();
        if let Ok(permit) = self.free.clone().try_acquire_owned() {
            return Some(Server { permit: Some(permit), debt });
        }
        let waiting = self.waiting.fetch_add(1, Ordering::AcqRel);
        // Leaves the line however the wait ends (served, or the request cancelled).
        let _in_line = scopeguard(&self.waiting);
        if queue.is_some_and(|q| waiting >= q) {
            return None;
        }
        let permit = self.free.clone().acquire_owned().await.expect("never closed");
        Some(Server { permit: Some(permit), debt })
    }
}

/// Takes one off `count` when dropped.
fn scopeguard(count: &AtomicU64) -> impl Drop + '_ {
    struct Leave<'a>(&'a AtomicU64);
    impl Drop for Leave<'_> {
        fn drop(&mut self) {
            self.0.fetch_sub(1, Ordering::AcqRel);
        }
    }
    Leave(count)
}

/// The drawn work: wait, then answer (or reset).
async fn work(
    mut guard: InFlight,
    mut draw: Draw,
    h2: bool,
    conn_reset: Arc<AtomicBool>,
    n: u64,
    taken: Option<Taken>,
    outbound: Option<crate::forward::Outbound>,
) -> Answer {
    let shared = guard.shared.clone();
    // With a number of servers, the request waits for one (first come, first served), and
    // holds it while it is worked on; past a bounded queue it is answered at once.
    let phase = &shared.phases[guard.phase];
    // Held until the answer: the server is busy while the request is worked on.
    let waiting = Instant::now();
    let server = match phase.servers {
        Some(n) => {
            shared.servers.resize(guard.phase, n);
            match shared.servers.take(phase.queue).await {
                Some(server) => Some(server),
                None => {
                    let status = StatusCode::from_u16(phase.status)
                        .unwrap_or(StatusCode::SERVICE_UNAVAILABLE);
                    return Ok(respond(guard, status, Bytes::from_static(b"queue full\n")));
                }
            }
        }
        None => None,
    };
    let waited = waiting.elapsed();
    // A request that waited into a later phase takes that phase's service time (its own
    // uniform, so its rank): the simulator draws a service time when service starts.
    if server.is_some() {
        let now = shared.clock.current();
        if now != guard.phase && shared.phases[now].servers.is_some() {
            draw.latency = shared.sampler.latency(&shared.phases[now], guard.seq);
        }
    }
    if !draw.latency.is_zero() {
        tokio::time::sleep(draw.latency).await;
    }
    // A plain answer's time here is its wait, its draw and chaos's own share; a reset, and a
    // paced, cut or streamed body, are not counted.
    let plain = phase.slow_body.is_none()
        && !matches!(draw.action, Action::Truncate | Action::Reset)
        && !taken.as_ref().is_some_and(|t| t.asked.stream);
    guard.drawn = plain.then_some(waited + draw.latency);
    let phase = &shared.phases[guard.phase];
    // A service in the middle of a call tree: its answer is what came of its call below.
    if let (Action::Respond, Some(f), Some(out)) = (draw.action, &shared.forward, outbound) {
        let status = f.call(out).await;
        let body = match status {
            StatusCode::OK => shared.bodies[guard.phase].clone(),
            _ => Bytes::from_static(b"the call below failed\n"),
        };
        let mut resp = respond(guard, status, body);
        concurrency_headers(&mut resp, phase, n);
        return Ok(resp);
    }
    let mut resp = match draw.action {
        Action::Reset => {
            guard.record(|c| c.event(Event::Reset));
            guard.done = true;
            if !h2 {
                // HTTP/1.1 has no stream to reset: the whole connection goes, with a TCP RST.
                conn_reset.store(true, Ordering::Release);
            }
            return Err(InjectedReset);
        }
        Action::Error => {
            let status =
                StatusCode::from_u16(phase.status).unwrap_or(StatusCode::SERVICE_UNAVAILABLE);
            respond(guard, status, Bytes::from_static(b"injected error\n"))
        }
        // Never here in practice: `handle` answers an overloaded draw at the door.
        Action::Overloaded => overloaded(guard, shared.provider.as_ref()),
        Action::Respond | Action::Truncate => {
            let truncate = draw.action == Action::Truncate;
            if truncate {
                guard.record(|c| c.event(Event::Truncated));
            }
            if let (Some(p), Some(t)) = (&shared.provider, &taken)
                && t.asked.stream
            {
                let mut resp = streamed(guard, p, t, truncate);
                concurrency_headers(&mut resp, phase, n);
                p.headers(resp.headers_mut());
                return Ok(resp);
            }
            let body = match (&shared.provider, &taken) {
                (Some(p), Some(t)) => {
                    guard.record(|c| c.event(Event::ProviderOk));
                    p.ok_body(t.asked.tokens)
                }
                _ => shared.bodies[guard.phase].clone(),
            };
            let len = body.len();
            let mut resp = respond(guard, StatusCode::OK, body);
            if taken.is_some() {
                resp.headers_mut()
                    .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
            }
            let b = resp.body_mut();
            if let Some(total) = phase.slow_body {
                let chunks = len.clamp(1, 10);
                b.chunk = len.div_ceil(chunks).max(1);
                b.interval = Some(total / chunks as u32);
                b.sleep = Some(Box::pin(tokio::time::sleep(total / chunks as u32)));
            }
            if truncate {
                // HTTP/1.1: the connection closes short of the declared length; h2: the stream
                // is reset.
                b.cut_after = Some(len / 2);
                if len / 2 == 0 && b.sleep.is_none() {
                    b.sleep = Some(Box::pin(tokio::time::sleep(Duration::from_millis(2))));
                }
            }
            resp
        }
    };
    concurrency_headers(&mut resp, phase, n);
    if let Some(p) = &shared.provider {
        p.headers(resp.headers_mut());
    }
    Ok(resp)
}

/// A provider's 200 as server-sent events, one body frame per event.
fn streamed(guard: InFlight, p: &Provider, t: &Taken, truncate: bool) -> Response<ChaosBody> {
    guard.record(|c| c.event(Event::ProviderOk));
    let events = p.stream_events(t.asked.tokens);
    // A truncation cuts after half the events; a drawn break, after the first.
    let cut_after =
        if truncate { Some((events.len() / 2).max(1)) } else { t.break_stream.then_some(1) };
    let mut resp = respond(guard, StatusCode::OK, Bytes::new());
    let h = resp.headers_mut();
    h.insert(CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
    h.insert(http::header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    resp.body_mut().stream(events, p.options.stream_event_delay, cut_after);
    resp
}

/// A request body, read whole up to 1 MiB (the rest read and dropped): what a provider counts
/// tokens from.
async fn read_body(mut body: Incoming) -> Bytes {
    const MAX: usize = 1 << 20;
    let mut out = bytes::BytesMut::new();
    while let Some(frame) = body.frame().await {
        match frame {
            Ok(f) => {
                if let Ok(data) = f.into_data()
                    && out.len() < MAX
                {
                    out.extend_from_slice(&data[..data.len().min(MAX - out.len())]);
                }
            }
            Err(_) => break,
        }
    }
    out.freeze()
}

#[cfg(test)]
mod tests {

    #[test]
    fn overload_stretches_latency_by_in_flight_over_workers() {
        let p = Phase { workers: Some(4), latency_max: Duration::from_secs(1), ..Phase::default() };
        let ms = Duration::from_millis;
        assert_eq!(stretched(ms(100), 4, &p), ms(100), "at the workers: full speed");
        assert_eq!(stretched(ms(100), 6, &p), ms(150));
        assert_eq!(stretched(ms(100), 80, &p), ms(1000), "never past latency_max");
        let no_workers = Phase::default();
        assert_eq!(stretched(ms(100), 80, &no_workers), ms(100), "load does not matter");
    }

    use super::*;

    fn s(n: u64) -> Duration {
        Duration::from_secs(n)
    }

    #[test]
    fn timed_phases_switch_and_stay_in_the_last() {
        let c = PhaseClock::new(vec![Some(s(2)), Some(s(3)), Some(s(1))], false);
        assert_eq!(c.at(s(0)), 0);
        assert_eq!(c.at(Duration::from_millis(1999)), 0);
        assert_eq!(c.at(s(2)), 1);
        assert_eq!(c.at(s(4)), 1);
        assert_eq!(c.at(s(5)), 2);
        // The last phase's duration passes: it stays.
        assert_eq!(c.at(s(100)), 2);
        assert_eq!(c.deadline.load(Ordering::Relaxed), u64::MAX);
    }

    #[test]
    fn repeat_wraps_and_skips_whole_cycles() {
        let c = PhaseClock::new(vec![Some(s(2)), Some(s(3))], true);
        assert_eq!(c.at(s(1)), 0);
        assert_eq!(c.at(s(6)), 0); // 0..2 a, 2..5 b, 5..7 a
        assert_eq!(c.at(s(5 * 10 + 3)), 1); // 50..52 a, 52..55 b
    }

    #[test]
    fn untimed_phase_waits_for_next() {
        let c = PhaseClock::new(vec![None, Some(s(1)), None], false);
        assert_eq!(c.at(s(1000)), 0);
        assert_eq!(c.next(s(1000)), 1);
        assert_eq!(c.at(Duration::from_millis(1_000_500)), 1);
        assert_eq!(c.at(s(1001)), 2);
        assert_eq!(c.next(s(1002)), 2); // the last stays without repeat
        let r = PhaseClock::new(vec![None, None], true);
        assert_eq!(r.next(s(1)), 1);
        assert_eq!(r.next(s(2)), 0);
    }

    #[test]
    fn rate_limiter_bucket() {
        let l = RateLimiter::new(RateLimit::new("2/10s".parse().unwrap()));
        assert!(l.try_take().is_ok());
        assert!(l.try_take().is_ok());
        let wait = l.try_take().unwrap_err();
        assert!(wait > s(4) && wait <= s(5), "{wait:?}");
    }

    #[test]
    fn bodies() {
        assert_eq!(&body_of(7)[..], b"ok\nok\no");
        assert!(body_of(0).is_empty());
    }
}
