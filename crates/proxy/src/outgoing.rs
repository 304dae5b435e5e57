//! An attempt's request body ([`OutgoingBody`]): the caller's, copied while sent for the
//! attempts after it, with the request's [`AttemptLog`] (what the access log reports), which
//! each copy carries to its attempt — so an attempt needs no extension map to reach it.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use stormguard_http::body::{ReplayBody, ReplayError};

use crate::body::CallerBody;

/// Per request, shared by its attempts (each attempt's body carries it): how many were sent
/// and how long the upstream took, for the access log.
#[derive(Clone, Debug, Default)]
pub struct AttemptLog(Arc<AttemptCounts>);

#[derive(Debug, Default)]
struct AttemptCounts {
    attempts: AtomicU32,
    /// The upstream of the last attempt.
    target: AtomicUsize,
    upstream_us: AtomicU64,
    slot_wait_us: AtomicU64,
}

impl AttemptLog {
    /// An attempt was sent to upstream `target`, after waiting `slot_wait` for its slot.
    pub(crate) fn sent(&self, target: usize, slot_wait: Option<Duration>) {
        self.0.attempts.fetch_add(1, Ordering::Relaxed);
        self.0.target.store(target, Ordering::Relaxed);
        if let Some(waited) = slot_wait {
            let us = u64::try_from(waited.as_micros()).unwrap_or(u64::MAX);
            self.0.slot_wait_us.fetch_add(us, Ordering::Relaxed);
        }
    }

    /// An attempt's response head came `took` after it was sent.
    pub(crate) fn answered(&self, took: Duration) {
        let us = u64::try_from(took.as_micros()).unwrap_or(u64::MAX);
        self.0.upstream_us.fetch_add(us, Ordering::Relaxed);
    }

    /// The upstream the last attempt went to (an index into the dependency's upstreams).
    pub fn target(&self) -> usize {
        self.0.target.load(Ordering::Relaxed)
    }

    /// Attempts sent to the upstream.
    pub fn attempts(&self) -> u32 {
        self.0.attempts.load(Ordering::Relaxed)
    }

    /// Time the attempts spent waiting for their slot (a primary in the queue; a retry never
    /// waits).
    pub fn slot_wait(&self) -> Duration {
        Duration::from_micros(self.0.slot_wait_us.load(Ordering::Relaxed))
    }

    /// Time the attempts spent waiting for response headers from the upstream.
    pub fn upstream_time(&self) -> Duration {
        Duration::from_micros(self.0.upstream_us.load(Ordering::Relaxed))
    }
}

/// An attempt's body: the caller's, copied while sent for the attempts after it
/// ([`ReplayBody`]), with the request's [`AttemptLog`], which each copy carries to its attempt.
pub struct OutgoingBody {
    body: ReplayBody<CallerBody>,
    log: AttemptLog,
}

impl OutgoingBody {
    /// The caller's body, sent with `log`; copied for retries up to `limit` bytes.
    pub(crate) fn new(body: CallerBody, limit: usize, log: AttemptLog) -> OutgoingBody {
        OutgoingBody { body: ReplayBody::new(body, limit), log }
    }

    /// The request's log.
    pub(crate) fn log(&self) -> &AttemptLog {
        &self.log
    }

    /// Whether a copy made now could send the whole body again ([`ReplayBody::is_replayable`]).
    pub(crate) fn is_replayable(&self) -> bool {
        self.body.is_replayable()
    }
}

impl Clone for OutgoingBody {
    /// A copy for another attempt: the body from its start, the same log.
    fn clone(&self) -> OutgoingBody {
        OutgoingBody { body: self.body.clone(), log: self.log.clone() }
    }
}

impl Body for OutgoingBody {
    type Data = Bytes;
    type Error = ReplayError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, ReplayError>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}
