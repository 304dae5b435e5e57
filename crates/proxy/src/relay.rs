//! The answer relayed at the dependency's pace, not the caller's.
//!
//! A slot under the cap measures the dependency's work, and an attempt's permit lives in its
//! response body: a caller that reads slowly — or not at all, as an HTTP/2 caller that sends no
//! `WINDOW_UPDATE` — would hold the slot for as long as it liked, and twenty such callers would
//! hold the whole cap. So the proxy reads each answer ahead of its caller:
//!
//! - an answer that is whole by the time its head is ready (most small answers) is kept and
//!   relayed from memory; the upstream body, and with it the slot, is let go at once;
//! - otherwise a task reads the upstream body into a buffer of `response_buffer` bytes (1 MiB,
//!   Envoy's per-connection buffer) at the upstream's pace: an answer that fits is read whole and
//!   its slot comes back when the upstream has finished, whatever the caller reads;
//! - past the buffer the caller's reading paces the upstream again (a buffer is memory). A caller
//!   that accepts nothing for `response_idle_timeout` (30 s) while the buffer is full, or leaves a
//!   finished answer unread that long, has its answer cut: the upstream attempt ends and its slot
//!   comes back, the buffer is freed, its HTTP/1.1 connection is closed, and the cut is counted
//!   (`stormguard_proxy_client_errors_total{reason="response-stalled"}`) and logged once per
//!   connection. An HTTP/2 stream is reset when its caller next grants it window (hyper polls a
//!   stream's body only then); its connection stays, since one stalled stream is no reason to
//!   fail the caller's others.
//!
//! A caller that goes away drops its answer, and the upstream body with it: the slot comes back
//! at once, as it always did (the closed connection stops the upstream at its next write).

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use bytes::{Buf, Bytes};
use http::Response;
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;
use stormguard_tower::BoxError;

use crate::stack::ProxyBody;
use crate::state::State;

/// How answers are read ahead (`response_buffer`, `response_idle_timeout`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct RelayConfig {
    /// Bytes read ahead of the caller; 0: none (the caller's reading paces the upstream).
    pub(crate) buffer: usize,
    /// How long a caller may hold the upstream back; `None`: without end.
    pub(crate) idle: Option<Duration>,
}

impl RelayConfig {
    pub(crate) fn new(buffer: usize, idle: Duration) -> RelayConfig {
        RelayConfig { buffer, idle: (!idle.is_zero()).then_some(idle) }
    }
}

/// The error a cut answer ends with: hyper closes the HTTP/1.1 connection or resets the stream.
#[derive(Debug, thiserror::Error)]
#[error("the caller accepted nothing of its answer for {0:?}: the answer was cut")]
pub(crate) struct ResponseStalled(Duration);

/// Frames read before an answer's head went out: usually one, kept without an allocation.
#[derive(Default)]
pub(crate) struct Frames {
    first: Option<Frame<Bytes>>,
    rest: VecDeque<Frame<Bytes>>,
}

impl Frames {
    fn push_back(&mut self, f: Frame<Bytes>) {
        if self.first.is_none() && self.rest.is_empty() {
            self.first = Some(f);
        } else {
            self.rest.push_back(f);
        }
    }

    fn pop_front(&mut self) -> Option<Frame<Bytes>> {
        self.first.take().or_else(|| self.rest.pop_front())
    }

    fn is_empty(&self) -> bool {
        self.first.is_none() && self.rest.is_empty()
    }

    fn has_trailers(&self) -> bool {
        self.first.iter().chain(&self.rest).any(Frame::is_trailers)
    }

    fn data_bytes(&self) -> u64 {
        self.first.iter().chain(&self.rest).map(|f| data_len(f) as u64).sum()
    }

    fn into_deque(self) -> VecDeque<Frame<Bytes>> {
        let mut d = self.rest;
        if let Some(f) = self.first {
            d.push_front(f);
        }
        d
    }
}

/// The body a caller gets.
pub(crate) enum Relay {
    /// The whole answer, read before its head went out.
    Read(Frames),
    /// What was read, then the rest straight from the body: reading ahead is off.
    /// `yield_first`: the first poll with nothing read yields once, so the head goes out before
    /// anything the body does later (a body that breaks then cuts the answer short, never
    /// leaving the caller with no answer).
    Direct { frames: Frames, body: ProxyBody, yield_first: bool },
    /// Read ahead by a task of its own.
    Piped(Reader),
}

impl std::fmt::Debug for Relay {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Relay::Read { .. } => "Relay::Read",
            Relay::Direct { .. } => "Relay::Direct",
            Relay::Piped(_) => "Relay::Piped",
        })
    }
}

fn data_len(f: &Frame<Bytes>) -> usize {
    f.data_ref().map_or(0, Buf::remaining)
}

impl Body for Relay {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match self.get_mut() {
            Relay::Read(frames) => Poll::Ready(frames.pop_front().map(Ok)),
            Relay::Direct { frames, body, yield_first } => {
                if let Some(f) = frames.pop_front() {
                    *yield_first = false;
                    return Poll::Ready(Some(Ok(f)));
                }
                if std::mem::take(yield_first) {
                    cx.waker().wake_by_ref();
                    return Poll::Pending;
                }
                Pin::new(body).poll_frame(cx)
            }
            Relay::Piped(r) => Pin::new(r).poll_frame(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            Relay::Read(frames) => frames.is_empty(),
            Relay::Direct { frames, body, .. } => frames.is_empty() && body.is_end_stream(),
            Relay::Piped(r) => r.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            // Trailers go out only where the framing leaves room for them (HTTP/1.1 chunked):
            // an exact size would have hyper frame the answer by its length and drop them.
            Relay::Read(frames) if frames.has_trailers() => {
                let mut h = SizeHint::new();
                h.set_lower(frames.data_bytes());
                h
            }
            Relay::Read(frames) => SizeHint::with_exact(frames.data_bytes()),
            Relay::Direct { frames, body, .. } => {
                stormguard_http::body::hint_after(frames.data_bytes(), &body.size_hint())
            }
            Relay::Piped(r) => r.hint,
        }
    }
}

/// What the first reading found.
enum First {
    /// The body ended: everything is read.
    End,
    /// The body broke.
    Failed(BoxError),
    /// More is coming (or the buffer is full).
    More,
}

/// The answer with its body read ahead of the caller (see the module docs). An upstream body
/// that breaks before its head went out makes the answer a `502` (what failed in
/// `x-stormguard-error`). Only an upstream's answers come here: the proxy's own are whole
/// already (`crate::stack::refusal`).
pub(crate) async fn read_ahead<B>(
    resp: Response<B>,
    config: RelayConfig,
    state: &Arc<State>,
) -> Response<ProxyBody>
where
    B: Body<Data = Bytes> + Send + Unpin + 'static,
    B::Error: Into<BoxError>,
{
    let (parts, mut body) = resp.into_parts();
    let hint = body.size_hint();
    let mut frames = Frames::default();
    let mut bytes = 0usize;
    // What is there now, up to the buffer (at least one look, whatever the buffer).
    let first = if body.is_end_stream() {
        First::End
    } else {
        std::future::poll_fn(|cx| {
            loop {
                match Pin::new(&mut body).poll_frame(cx) {
                    Poll::Ready(Some(Ok(f))) => {
                        bytes += data_len(&f);
                        frames.push_back(f);
                        if body.is_end_stream() {
                            return Poll::Ready(First::End);
                        }
                        if bytes >= config.buffer {
                            return Poll::Ready(First::More);
                        }
                    }
                    Poll::Ready(Some(Err(e))) => return Poll::Ready(First::Failed(e.into())),
                    Poll::Ready(None) => return Poll::Ready(First::End),
                    Poll::Pending => return Poll::Ready(First::More),
                }
            }
        })
        .await
    };
    let relay = match first {
        First::End => Relay::Read(frames),
        // Nothing went out yet, whatever was read: the caller gets the failure's own answer
        // (502), not a head whose length the body will not keep.
        First::Failed(e) => {
            tracing::debug!(error = %e, "the upstream's answer broke before it was relayed");
            return crate::stack::failed(&*e);
        }
        First::More if config.buffer == 0 => {
            let yield_first = frames.is_empty();
            Relay::Direct { frames, body: boxed(body), yield_first }
        }
        First::More => {
            let pipe = Arc::new(Pipe {
                buffer: config.buffer,
                state: Mutex::new(PipeState {
                    frames: frames.into_deque(),
                    bytes,
                    end: None,
                    reader: None,
                    pump: None,
                    reader_gone: false,
                    taken: 0,
                    conn: None,
                }),
            });
            tokio::spawn(Pump {
                body: Some(boxed(body)),
                pipe: pipe.clone(),
                idle: config.idle,
                timer: None,
                seen_taken: 0,
                state: state.clone(),
            });
            let reader = Relay::Piped(Reader { pipe: pipe.clone(), hint, started: false });
            let mut resp = Response::from_parts(parts, reader.boxed_unsync());
            resp.extensions_mut().insert(StallHook(pipe));
            return resp;
        }
    };
    Response::from_parts(parts, relay.boxed_unsync())
}

/// An upstream body as the caller's (an answer not read whole before its head went out).
fn boxed<B>(body: B) -> ProxyBody
where
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    body.map_err(Into::into).boxed_unsync()
}

/// What the relay tells of the caller's connection: an answer on it was cut. The listener's
/// connection watch is one; the relay knows it only by this, so it sits below the listener.
pub(crate) trait Stalled: Send + Sync {
    /// An answer on this connection was cut: its caller accepted nothing of it for
    /// `response_idle_timeout`.
    fn response_stalled(&self);
}

/// Left on a piped answer for the listener, which gives it the connection to close when the
/// answer is cut ([`StallHook::attach`]).
#[derive(Clone)]
pub(crate) struct StallHook(Arc<Pipe>);

impl StallHook {
    /// The answer goes out on `conn`.
    pub(crate) fn attach(self, conn: Arc<dyn Stalled>) {
        let mut s = self.0.lock();
        if matches!(s.end, Some(End::Cut(_))) {
            drop(s);
            conn.response_stalled();
        } else {
            s.conn = Some(Arc::downgrade(&conn));
        }
    }
}

/// The buffer between the task reading the upstream and the caller's body.
struct Pipe {
    buffer: usize,
    state: Mutex<PipeState>,
}

impl Pipe {
    fn lock(&self) -> MutexGuard<'_, PipeState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

struct PipeState {
    frames: VecDeque<Frame<Bytes>>,
    /// Data bytes in `frames`.
    bytes: usize,
    /// How the upstream body ended, once it has.
    end: Option<End>,
    reader: Option<Waker>,
    pump: Option<Waker>,
    reader_gone: bool,
    /// Frames the caller took: the progress that resets the idle timer.
    taken: u64,
    /// The caller's connection, to close when the answer is cut (weak: the pipe must not keep
    /// a closed connection's watch alive).
    conn: Option<std::sync::Weak<dyn Stalled>>,
}

enum End {
    Done,
    Failed(BoxError),
    Cut(Duration),
}

fn wake(w: &mut Option<Waker>) {
    if let Some(w) = w.take() {
        w.wake();
    }
}

/// The caller's side of a piped answer.
pub(crate) struct Reader {
    pipe: Arc<Pipe>,
    /// The upstream body's size hint, before anything was read (hyper reads it once, for the
    /// framing).
    hint: SizeHint,
    started: bool,
}

impl Body for Reader {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let buffer = self.pipe.buffer;
        let pipe = self.pipe.clone();
        let mut s = pipe.lock();
        if let Some(f) = s.frames.pop_front() {
            let was_full = s.bytes >= buffer;
            s.bytes -= data_len(&f);
            s.taken += 1;
            // The task waits on the caller only when the buffer is full or the answer is
            // finished: wake it then alone.
            if was_full || s.end.is_some() {
                wake(&mut s.pump);
            }
            self.started = true;
            return Poll::Ready(Some(Ok(f)));
        }
        match &mut s.end {
            None => {
                s.reader = Some(cx.waker().clone());
                Poll::Pending
            }
            Some(End::Done) => Poll::Ready(None),
            Some(End::Failed(_)) if !self.started => {
                // Nothing went out yet: let the head go first (see `Relay::Direct`).
                self.started = true;
                cx.waker().wake_by_ref();
                Poll::Pending
            }
            Some(End::Failed(_)) => match s.end.replace(End::Done) {
                Some(End::Failed(e)) => Poll::Ready(Some(Err(e))),
                _ => Poll::Ready(None),
            },
            Some(End::Cut(idle)) => Poll::Ready(Some(Err(Box::new(ResponseStalled(*idle))))),
        }
    }

    fn is_end_stream(&self) -> bool {
        let s = self.pipe.lock();
        s.frames.is_empty() && matches!(s.end, Some(End::Done))
    }

    fn size_hint(&self) -> SizeHint {
        self.hint
    }
}

impl Drop for Reader {
    fn drop(&mut self) {
        let mut s = self.pipe.lock();
        s.reader_gone = true;
        s.frames.clear();
        s.bytes = 0;
        s.conn = None;
        wake(&mut s.pump);
    }
}

/// The task that reads the upstream body into the pipe at the upstream's pace.
struct Pump {
    /// The upstream body (with the attempt's permit); `None` once it ended.
    body: Option<ProxyBody>,
    pipe: Arc<Pipe>,
    idle: Option<Duration>,
    /// Armed while the caller holds the upstream back.
    timer: Option<Pin<Box<tokio::time::Sleep>>>,
    /// `taken` when the timer was armed or last reset.
    seen_taken: u64,
    state: Arc<State>,
}

impl Pump {
    /// The caller held the answer back too long: the upstream attempt ends (its slot comes
    /// back), the buffer is freed, the caller's body ends in an error.
    fn cut(&mut self, idle: Duration) {
        self.body = None;
        let mut s = self.pipe.lock();
        s.frames.clear();
        s.bytes = 0;
        s.end = Some(End::Cut(idle));
        let conn = s.conn.take().and_then(|w| w.upgrade());
        wake(&mut s.reader);
        drop(s);
        self.state.response_stalls.fetch_add(1, Ordering::Relaxed);
        match conn {
            Some(c) => c.response_stalled(),
            None => tracing::debug!("an answer was cut before its connection was known"),
        }
    }
}

impl Future for Pump {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let this = &mut *self;
        loop {
            let mut s = this.pipe.lock();
            if s.reader_gone {
                drop(s);
                this.body = None;
                return Poll::Ready(());
            }
            // Whatever the task waits on next (the upstream or the caller), a caller that goes
            // away wakes it: the upstream body, and the slot, are let go at once.
            if !s.pump.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
                s.pump = Some(cx.waker().clone());
            }
            // The caller holds the upstream back: the buffer is full while the upstream has
            // more, or the answer is finished and not yet taken.
            let held = match this.body {
                Some(_) => s.bytes >= this.pipe.buffer,
                None if s.frames.is_empty() => return Poll::Ready(()),
                None => true,
            };
            if held {
                let progressed = s.taken != this.seen_taken;
                this.seen_taken = s.taken;
                drop(s);
                let Some(idle) = this.idle else { return Poll::Pending };
                let at = tokio::time::Instant::now() + idle;
                match &mut this.timer {
                    Some(t) if progressed => t.as_mut().reset(at),
                    Some(_) => {}
                    None => this.timer = Some(Box::pin(tokio::time::sleep_until(at))),
                }
                if let Some(t) = &mut this.timer
                    && t.as_mut().poll(cx).is_ready()
                {
                    this.cut(idle);
                    return Poll::Ready(());
                }
                return Poll::Pending;
            }
            drop(s);
            this.timer = None;
            let Some(body) = this.body.as_mut() else { return Poll::Ready(()) };
            let next = Pin::new(body).poll_frame(cx);
            let mut s = this.pipe.lock();
            let ended = match next {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Some(Ok(f))) => {
                    s.bytes += data_len(&f);
                    s.frames.push_back(f);
                    // Its last frame: the upstream has finished, whatever the buffer holds.
                    let done = this.body.as_ref().is_some_and(Body::is_end_stream);
                    if done {
                        s.end = Some(End::Done);
                    }
                    done
                }
                Poll::Ready(Some(Err(e))) => {
                    s.end = Some(End::Failed(e));
                    true
                }
                Poll::Ready(None) => {
                    s.end = Some(End::Done);
                    true
                }
            };
            wake(&mut s.reader);
            drop(s);
            if ended {
                // The upstream has finished: its permit, and the slot, go back now.
                this.body = None;
            }
        }
    }
}
