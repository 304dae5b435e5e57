//! A request body that can be sent again.
//!
//! A retry must send the same body, but buffering a whole body before sending it adds latency
//! and memory to every request, retried or not. [`ReplayBody`] forwards the bytes as the first
//! attempt sends them and keeps a copy, up to a limit (64 KiB by default). A clone made for a
//! retry replays the copy, then goes on reading the original where the first attempt left off.
//! A body larger than the limit stops being copied (the copy is freed), reports
//! [`is_replayable`](ReplayBody::is_replayable) `false` — so the retry decision refuses with
//! `body` — and is still forwarded in full: nothing the caller sent is lost. Trailers are kept
//! and replayed too.
//!
//! ```
//! use bytes::Bytes;
//! use http_body_util::{BodyExt, Full};
//! use stormguard_http::body::ReplayBody;
//!
//! # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
//! let first = ReplayBody::new(Full::new(Bytes::from_static(b"pay 10 EUR")), 64 * 1024);
//! let retry = first.clone();
//! assert_eq!(first.collect().await.unwrap().to_bytes(), "pay 10 EUR"); // sent once
//! assert!(retry.is_replayable());
//! assert_eq!(retry.collect().await.unwrap().to_bytes(), "pay 10 EUR"); // and again
//! # });
//! ```

use std::error::Error as StdError;
use std::fmt;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};

use bytes::{Buf, Bytes};
use http::HeaderMap;
use http_body::{Body, Frame, SizeHint};

/// The size hint of a body made of `held` bytes already in hand followed by a body whose hint is
/// `rest`: both bounds moved up by `held` (saturating; the upper bound set before the lower, so
/// the hint never refuses its own values).
pub fn hint_after(held: u64, rest: &SizeHint) -> SizeHint {
    let mut s = SizeHint::new();
    if let Some(u) = rest.upper() {
        s.set_upper(u.saturating_add(held));
    }
    s.set_lower(rest.lower().saturating_add(held));
    s
}

/// The default copy limit: 64 KiB ([`stormguard_core::defaults::BODY_LIMIT`]).
pub const DEFAULT_LIMIT: usize = stormguard_core::defaults::BODY_LIMIT;

/// The error a [`ReplayBody`] yields.
#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    /// The original body failed.
    #[error("request body failed: {0}")]
    Body(#[source] Box<dyn StdError + Send + Sync>),
    /// Two clones read the original at once (an attempt still sending while its retry started).
    #[error("request body is being sent by another attempt")]
    Busy,
    /// A clone was asked to replay a body that was not kept (past the limit, or failed).
    #[error("request body can not be replayed")]
    NotReplayable,
}

/// A body that forwards bytes as they are sent while keeping a copy for a retry. See the
/// [module docs](self).
pub struct ReplayBody<B> {
    shared: Arc<Mutex<Shared<B>>>,
    /// The original, while this clone is the one reading it.
    original: Option<B>,
    /// Bytes this clone has yielded.
    position: u64,
    /// Chunks of the copy this clone has yielded.
    replayed: usize,
    /// Whether this clone yielded the trailers.
    trailers_sent: bool,
}

struct Shared<B> {
    /// The original body, when no clone holds it; `None` once it ended or failed.
    original: Option<B>,
    /// The bytes read from the original so far, in chunks, while they fit the limit.
    copy: Vec<Bytes>,
    limit: usize,
    /// Bytes read from the original by any clone.
    read: u64,
    /// The copy was given up: the limit was passed. Everything is still forwarded.
    overflowed: bool,
    /// The original failed: no clone can send it again.
    failed: bool,
    /// The original ended; `trailers` holds its trailers, if any.
    ended: bool,
    trailers: Option<HeaderMap>,
    /// The original's size hint before anything was read.
    hint: SizeHint,
}

impl<B> fmt::Debug for ReplayBody<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = lock(&self.shared);
        f.debug_struct("ReplayBody")
            .field("read", &s.read)
            .field("limit", &s.limit)
            .field("overflowed", &s.overflowed)
            .field("ended", &s.ended)
            .field("position", &self.position)
            .finish()
    }
}

fn lock<B>(shared: &Mutex<Shared<B>>) -> MutexGuard<'_, Shared<B>> {
    // Every update below leaves `Shared` consistent before anything that could panic, so a
    // poisoned lock still guards good data.
    shared.lock().unwrap_or_else(|e| e.into_inner())
}

impl<B: Body> ReplayBody<B> {
    /// Wraps `body`, keeping a copy of up to `limit` bytes (see [`DEFAULT_LIMIT`]).
    pub fn new(body: B, limit: usize) -> ReplayBody<B> {
        let hint = body.size_hint();
        // A body known to be larger than the limit is never copied.
        let overflowed = hint.lower() > limit as u64;
        ReplayBody {
            shared: Arc::new(Mutex::new(Shared {
                original: Some(body),
                copy: Vec::new(),
                limit,
                read: 0,
                overflowed,
                failed: false,
                ended: false,
                trailers: None,
                hint,
            })),
            original: None,
            position: 0,
            replayed: 0,
            trailers_sent: false,
        }
    }
}

impl<B> ReplayBody<B> {
    /// Whether a clone made now could send the whole body again: everything read so far was
    /// kept (the limit was not passed) and the original did not fail.
    pub fn is_replayable(&self) -> bool {
        let s = lock(&self.shared);
        !s.overflowed && !s.failed
    }

    /// Bytes read from the original so far (by any clone).
    pub fn bytes_read(&self) -> u64 {
        lock(&self.shared).read
    }
}

impl<B> Clone for ReplayBody<B> {
    /// A new reader of the same body, starting from the beginning.
    fn clone(&self) -> Self {
        ReplayBody {
            shared: self.shared.clone(),
            original: None,
            position: 0,
            replayed: 0,
            trailers_sent: false,
        }
    }
}

impl<B> Drop for ReplayBody<B> {
    fn drop(&mut self) {
        // Give the original back, so a retry can go on reading where this attempt stopped.
        if let Some(original) = self.original.take() {
            lock(&self.shared).original = Some(original);
        }
    }
}

impl<B> Body for ReplayBody<B>
where
    B: Body + Unpin,
    B::Error: Into<Box<dyn StdError + Send + Sync>>,
{
    type Data = Bytes;
    type Error = ReplayError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, ReplayError>>> {
        let this = self.get_mut();
        loop {
            {
                let mut shared = lock(&this.shared);
                if this.position < shared.read {
                    // Behind what was read: replay the copy, if it was kept.
                    if shared.overflowed || shared.failed || this.replayed >= shared.copy.len() {
                        return Poll::Ready(Some(Err(ReplayError::NotReplayable)));
                    }
                    let chunk = shared.copy[this.replayed].clone();
                    this.replayed += 1;
                    this.position += chunk.len() as u64;
                    return Poll::Ready(Some(Ok(Frame::data(chunk))));
                }
                if shared.ended {
                    if !this.trailers_sent
                        && let Some(t) = shared.trailers.clone()
                    {
                        this.trailers_sent = true;
                        return Poll::Ready(Some(Ok(Frame::trailers(t))));
                    }
                    return Poll::Ready(None);
                }
                if shared.failed {
                    return Poll::Ready(Some(Err(ReplayError::NotReplayable)));
                }
                if this.original.is_none() {
                    match shared.original.take() {
                        Some(original) => this.original = Some(original),
                        None => return Poll::Ready(Some(Err(ReplayError::Busy))),
                    }
                }
            }
            let original = this.original.as_mut().expect("taken above");
            let frame = match Pin::new(original).poll_frame(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(f) => f,
            };
            let mut shared = lock(&this.shared);
            return match frame {
                None => {
                    shared.ended = true;
                    // The original is done: drop it rather than give it back.
                    this.original = None;
                    Poll::Ready(None)
                }
                Some(Err(e)) => {
                    shared.failed = true;
                    shared.copy = Vec::new();
                    this.original = None;
                    Poll::Ready(Some(Err(ReplayError::Body(e.into()))))
                }
                Some(Ok(frame)) => match frame.into_data() {
                    Ok(mut data) => {
                        let bytes = data.copy_to_bytes(data.remaining());
                        shared.read = shared.read.saturating_add(bytes.len() as u64);
                        this.position = shared.read;
                        if !shared.overflowed {
                            if shared.read <= shared.limit as u64 {
                                shared.copy.push(bytes.clone());
                                this.replayed = shared.copy.len();
                            } else {
                                // Past the limit: stop copying, free the copy, keep forwarding.
                                shared.overflowed = true;
                                shared.copy = Vec::new();
                                this.replayed = 0;
                            }
                        }
                        Poll::Ready(Some(Ok(Frame::data(bytes))))
                    }
                    Err(frame) => match frame.into_trailers() {
                        Ok(trailers) => {
                            shared.trailers = Some(trailers.clone());
                            shared.ended = true;
                            this.trailers_sent = true;
                            this.original = None;
                            Poll::Ready(Some(Ok(Frame::trailers(trailers))))
                        }
                        // A frame that is neither data nor trailers: skip it.
                        Err(_) => {
                            drop(shared);
                            continue;
                        }
                    },
                },
            };
        }
    }

    fn is_end_stream(&self) -> bool {
        let shared = lock(&self.shared);
        shared.ended
            && self.position >= shared.read
            && (self.trailers_sent || shared.trailers.is_none())
    }

    fn size_hint(&self) -> SizeHint {
        let shared = lock(&self.shared);
        let behind = shared.read.saturating_sub(self.position);
        if shared.ended {
            return SizeHint::with_exact(behind);
        }
        // What is left of the original, plus what this clone has still to replay.
        let rest = match &self.original {
            Some(o) => o.size_hint(),
            None if shared.read == 0 => shared.hint,
            None => shared.original.as_ref().map(|o| o.size_hint()).unwrap_or_default(),
        };
        hint_after(behind, &rest)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;
    use proptest::prelude::*;
    use std::collections::VecDeque;

    /// A body of given frames that answers `Pending` before every other frame.
    struct Frames {
        frames: VecDeque<Result<Frame<Bytes>, std::io::Error>>,
        stall: bool,
    }

    impl Body for Frames {
        type Data = Bytes;
        type Error = std::io::Error;
        fn poll_frame(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, std::io::Error>>> {
            self.stall = !self.stall;
            if self.stall {
                cx.waker().wake_by_ref();
                return Poll::Pending;
            }
            Poll::Ready(self.frames.pop_front())
        }
    }

    fn body(chunks: &[Vec<u8>], trailers: bool) -> Frames {
        let mut frames: VecDeque<_> =
            chunks.iter().map(|c| Ok(Frame::data(Bytes::from(c.clone())))).collect();
        if trailers {
            let mut t = HeaderMap::new();
            t.insert("grpc-status", "0".parse().unwrap());
            frames.push_back(Ok(Frame::trailers(t)));
        }
        Frames { frames, stall: false }
    }

    fn block_on<F: std::future::Future>(f: F) -> F::Output {
        tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(f)
    }

    /// Reads everything: the bytes, the trailers, or the error.
    fn read_all<B>(b: B) -> Result<(Vec<u8>, Option<HeaderMap>), ReplayError>
    where
        B: Body<Data = Bytes, Error = ReplayError>,
    {
        block_on(async move {
            let c = b.collect().await?;
            let trailers = c.trailers().cloned();
            Ok((c.to_bytes().to_vec(), trailers))
        })
    }

    /// Reads `n` data frames, then stops (drops the body, as an attempt that timed out does).
    fn read_some<B: Body<Data = Bytes> + Unpin>(mut b: B, n: usize) -> Vec<u8> {
        block_on(async move {
            let mut out = Vec::new();
            for _ in 0..n {
                match b.frame().await {
                    Some(Ok(f)) => {
                        if let Ok(d) = f.into_data() {
                            out.extend_from_slice(&d);
                        }
                    }
                    _ => break,
                }
            }
            out
        })
    }

    #[test]
    fn a_retry_after_a_connect_failure_reads_the_original() {
        let first = ReplayBody::new(body(&[b"ab".to_vec(), b"cd".to_vec()], false), 1024);
        let retry = first.clone();
        drop(first); // never polled
        assert_eq!(read_all(retry).unwrap().0, b"abcd");
    }

    #[test]
    fn beyond_the_limit_nothing_is_lost_but_nothing_replays() {
        let first = ReplayBody::new(body(&[b"abc".to_vec(), b"def".to_vec()], true), 4);
        let retry = first.clone();
        let (bytes, trailers) = read_all(first).unwrap();
        assert_eq!(bytes, b"abcdef");
        assert!(trailers.is_some());
        assert!(!retry.is_replayable());
        assert!(matches!(read_all(retry), Err(ReplayError::NotReplayable)));
    }

    #[test]
    fn a_known_large_body_is_never_copied() {
        let big = http_body_util::Full::new(Bytes::from(vec![7u8; 100]));
        let first = ReplayBody::new(big, 10);
        assert!(!first.is_replayable());
        assert_eq!(read_all(first).unwrap().0.len(), 100);
    }

    #[test]
    fn two_readers_at_once_are_refused() {
        let first = ReplayBody::new(body(&[b"a".to_vec(), b"b".to_vec()], false), 1024);
        let mut first = first;
        let mut retry = first.clone();
        let got = read_some(&mut first, 1);
        assert_eq!(got, b"a");
        // `first` still holds the original: the retry replays "a", then finds it busy.
        let r = block_on(async {
            let a = retry.frame().await.unwrap().unwrap().into_data().unwrap();
            (a, retry.frame().await.unwrap())
        });
        assert_eq!(r.0, "a");
        assert!(matches!(r.1, Err(ReplayError::Busy)));
    }

    #[test]
    fn an_original_that_fails_is_not_replayed() {
        let frames = Frames {
            frames: VecDeque::from([
                Ok(Frame::data(Bytes::from_static(b"x"))),
                Err(std::io::Error::other("client went away")),
            ]),
            stall: false,
        };
        let first = ReplayBody::new(frames, 1024);
        let retry = first.clone();
        assert!(matches!(read_all(first), Err(ReplayError::Body(_))));
        assert!(!retry.is_replayable());
        assert!(matches!(read_all(retry), Err(ReplayError::NotReplayable)));
    }

    proptest! {
        /// Under any chunking, any limit and any point where the first attempt stops, the first
        /// attempt forwards a prefix of the body unchanged, and a retry (when replayable) sends
        /// exactly the original, trailers included. Past the limit the first reader still
        /// gets every byte.
        #[test]
        fn replay_equals_the_original(
            chunks in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..40), 0..12),
            limit in 0usize..300,
            stop in 0usize..14,
            trailers in any::<bool>(),
        ) {
            let original: Vec<u8> = chunks.concat();
            let first = ReplayBody::new(body(&chunks, trailers), limit);
            let retry = first.clone();
            let mut first = first;
            let prefix = read_some(&mut first, stop);
            prop_assert!(original.starts_with(&prefix));
            drop(first);
            if retry.is_replayable() {
                let (bytes, t) = read_all(retry).unwrap();
                prop_assert_eq!(bytes, original);
                prop_assert_eq!(t.is_some(), trailers);
            } else {
                prop_assert!(prefix.len() > limit);
                prop_assert!(matches!(read_all(retry), Err(ReplayError::NotReplayable)));
            }
        }

        #[test]
        fn one_reader_past_the_limit_loses_no_byte(
            chunks in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..64), 0..12),
            limit in 0usize..128,
        ) {
            let original: Vec<u8> = chunks.concat();
            let only = ReplayBody::new(body(&chunks, true), limit);
            let (bytes, t) = read_all(only).unwrap();
            prop_assert_eq!(bytes, original);
            prop_assert!(t.is_some());
        }
    }
}
