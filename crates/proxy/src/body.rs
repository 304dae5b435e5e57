//! The caller's request body, received before its attempt takes a slot.
//!
//! A slot under the cap is the dependency's capacity: a caller that dawdles over its request
//! body must not hold one. So a body that fits the replay buffer (64 KiB) is received whole
//! before the request goes to its dependency's stack, and a larger one only once its first
//! 64 KiB have arrived; either way a caller that sends nothing for `body_idle_timeout` (10 s by
//! default), or that has kept the proxy waiting for its body for `body_timeout` (30 s) in all,
//! is answered `408` and, once its attempt holds a slot, the slot comes back. The whole-body
//! bound is a time, not a minimum rate (Apache's `MinRate`): what a slot costs the dependency is
//! time, and a rate lets a caller that keeps exactly to it hold a slot for as long as its
//! `Content-Length` allows. Only the time spent waiting for the caller's bytes counts: not the
//! time the request waits for a slot, nor the time the upstream takes to read what it was sent
//! (the body is not asked for then), so a slow upstream is never blamed on the caller. A
//! malformed body (a broken chunk, a connection closed before `Content-Length` bytes) is the
//! caller's failure too: `400`, or nothing when the caller has gone; neither the breaker nor the
//! budget counts it, and it is never retried (see `StormguardError::CallerBody` in the tower
//! crate).

use std::collections::VecDeque;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::HeaderMap;
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use stormguard_tower::BodyReceived;

/// What went wrong with a caller's request body.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CallerBodyError {
    /// The body broke: a malformed chunk, or the connection closed before the body ended.
    #[error("the request body is malformed or ended early: {0}")]
    Malformed(#[source] hyper::Error),
    /// The caller sent no body bytes for this long.
    #[error("the caller sent no request body bytes for {0:?}")]
    Stalled(Duration),
    /// The whole body had not arrived this long after the request head (`body_timeout`).
    #[error("the request body had not arrived whole {0:?} after its head")]
    TooSlow(Duration),
}

impl CallerBodyError {
    /// Whether the caller was too slow (answered `408`), not malformed (`400`).
    pub fn timed_out(&self) -> bool {
        matches!(self, CallerBodyError::Stalled(_) | CallerBodyError::TooSlow(_))
    }
}

/// A body's two time bounds: between bytes, and for the whole.
#[derive(Debug, Clone, Copy)]
pub struct BodyTimes {
    /// `body_idle_timeout`.
    pub idle: Duration,
    /// `body_timeout` (`None`: off).
    pub whole: Option<Duration>,
}

impl BodyTimes {
    /// From the proxy's settings (`body_timeout = "0s"` is off).
    pub fn new(idle: Duration, whole: Duration) -> BodyTimes {
        BodyTimes { idle, whole: (!whole.is_zero()).then_some(whole) }
    }
}

/// How long the proxy has waited for the caller's body, against its bounds.
#[derive(Debug, Clone, Copy)]
struct Due {
    times: BodyTimes,
    /// Time spent waiting for the caller's bytes, before the wait now.
    waited: Duration,
    /// Since when the proxy has been waiting for the caller now, if it is.
    waiting_since: Option<tokio::time::Instant>,
}

impl Due {
    fn new(times: BodyTimes) -> Due {
        Due { times, waited: Duration::ZERO, waiting_since: None }
    }

    /// The proxy asked for bytes the caller has not sent: the instant to give up at — a gap
    /// from when this wait began, or what is left of the whole-body bound.
    fn waiting(&mut self) -> tokio::time::Instant {
        let since = *self.waiting_since.get_or_insert_with(tokio::time::Instant::now);
        let gap = self.times.idle;
        since + self.times.whole.map_or(gap, |w| gap.min(w.saturating_sub(self.waited)))
    }

    /// Bytes (or the end) arrived: the wait is over.
    fn arrived(&mut self) {
        if let Some(since) = self.waiting_since.take() {
            self.waited += since.elapsed();
        }
    }

    /// The error for a wait that ran out now.
    fn expired(&self) -> CallerBodyError {
        let now_waiting = self.waiting_since.map_or(Duration::ZERO, |s| s.elapsed());
        match self.times.whole {
            Some(w) if self.waited + now_waiting >= w => CallerBodyError::TooSlow(w),
            _ => CallerBodyError::Stalled(self.times.idle),
        }
    }
}

/// The caller's body: what was received before the attempt, then (for a body larger than the
/// replay buffer) the rest as it arrives, cut when the caller stalls.
pub struct CallerBody {
    head: VecDeque<Bytes>,
    head_len: u64,
    trailers: Option<HeaderMap>,
    rest: Option<Incoming>,
    due: Due,
    /// Armed while the rest is awaited; reset on each frame.
    timer: Option<Pin<Box<tokio::time::Sleep>>>,
    /// Set once the rest has arrived; only a body that streams past the replay buffer has one
    /// (a whole body needs no flag, and costs no allocation).
    received: Option<BodyReceived>,
}

impl std::fmt::Debug for CallerBody {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CallerBody")
            .field("head_len", &self.head_len)
            .field("streaming", &self.rest.is_some())
            .finish()
    }
}

impl CallerBody {
    /// Whether the whole body was received before the attempt.
    pub fn is_whole(&self) -> bool {
        self.rest.is_none()
    }

    /// The bytes received before the attempt (the whole body when [`is_whole`](Self::is_whole)):
    /// what a request's token cost is estimated from.
    pub fn head_bytes(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(usize::try_from(self.head_len).unwrap_or(0));
        for b in &self.head {
            v.extend_from_slice(b);
        }
        v
    }

    /// The bytes received before the attempt, chunk by chunk, uncopied.
    pub fn head_chunks(&self) -> impl Iterator<Item = &[u8]> {
        self.head.iter().map(|b| &b[..])
    }

    /// The flag the cap reads, for a body still arriving: set once it has been received whole.
    /// `None` when it was received whole before the attempt.
    pub fn received(&self) -> Option<BodyReceived> {
        self.received.clone()
    }
}

/// Receives `body` until it ends or more than `limit` bytes have arrived, waiting at most
/// `times.idle` for each frame and until `times.whole` after now for all of it.
pub async fn receive(
    mut body: Incoming,
    limit: usize,
    times: BodyTimes,
) -> Result<CallerBody, CallerBodyError> {
    let mut due = Due::new(times);
    let mut head = VecDeque::new();
    let mut head_len = 0u64;
    let mut trailers = None;
    let rest = loop {
        if body.is_end_stream() {
            break None;
        }
        let at = due.waiting();
        let next = tokio::time::timeout_at(at, body.frame()).await;
        if next.is_ok() {
            due.arrived();
        }
        match next {
            Err(_) => return Err(due.expired()),
            Ok(None) => break None,
            Ok(Some(Err(e))) => return Err(CallerBodyError::Malformed(e)),
            Ok(Some(Ok(frame))) => match frame.into_data() {
                Ok(data) => {
                    head_len += data.len() as u64;
                    if !data.is_empty() {
                        head.push_back(data);
                    }
                    if head_len > limit as u64 {
                        break Some(body);
                    }
                }
                Err(frame) => {
                    if let Ok(t) = frame.into_trailers() {
                        trailers = Some(t);
                    }
                }
            },
        }
    };
    let received = rest.as_ref().map(|_| BodyReceived::default());
    Ok(CallerBody { head, head_len, trailers, rest, due, timer: None, received })
}

impl Body for CallerBody {
    type Data = Bytes;
    type Error = CallerBodyError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, CallerBodyError>>> {
        let this = &mut *self;
        if let Some(data) = this.head.pop_front() {
            return Poll::Ready(Some(Ok(Frame::data(data))));
        }
        let Some(rest) = this.rest.as_mut() else {
            return Poll::Ready(this.trailers.take().map(|t| Ok(Frame::trailers(t))));
        };
        match Pin::new(rest).poll_frame(cx) {
            Poll::Ready(r) => {
                this.due.arrived();
                match r {
                    None => {
                        this.rest = None;
                        this.timer = None;
                        if let Some(r) = &this.received {
                            r.set();
                        }
                        Poll::Ready(None)
                    }
                    Some(Err(e)) => {
                        this.rest = None;
                        Poll::Ready(Some(Err(CallerBodyError::Malformed(e))))
                    }
                    Some(Ok(frame)) => {
                        if frame.is_trailers()
                            && let Some(r) = &this.received
                        {
                            r.set();
                        }
                        Poll::Ready(Some(Ok(frame)))
                    }
                }
            }
            Poll::Pending => {
                // A new wait for the caller arms the timer; a wake-up within the same wait keeps
                // its deadline.
                let new_wait = this.due.waiting_since.is_none();
                let at = this.due.waiting();
                let timer =
                    this.timer.get_or_insert_with(|| Box::pin(tokio::time::sleep_until(at)));
                if new_wait {
                    timer.as_mut().reset(at);
                }
                match timer.as_mut().poll(cx) {
                    Poll::Ready(()) => {
                        this.rest = None;
                        Poll::Ready(Some(Err(this.due.expired())))
                    }
                    Poll::Pending => Poll::Pending,
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.head.is_empty()
            && self.trailers.is_none()
            && self.rest.as_ref().is_none_or(Body::is_end_stream)
    }

    fn size_hint(&self) -> SizeHint {
        let head: u64 = self.head.iter().map(|b| b.len() as u64).sum();
        match &self.rest {
            None => SizeHint::with_exact(head),
            Some(r) => stormguard_http::body::hint_after(head, &r.size_hint()),
        }
    }
}

/// The caller's body failure in `error`'s source chain, if that is what it is.
pub fn caller_body_error<'a>(
    error: &'a (dyn std::error::Error + 'static),
) -> Option<&'a CallerBodyError> {
    let mut cur = Some(error);
    while let Some(e) = cur {
        if let Some(c) = e.downcast_ref::<CallerBodyError>() {
            return Some(c);
        }
        cur = e.source();
    }
    None
}
