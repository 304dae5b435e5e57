//! How the layer treats a request type: how a body is copied for another attempt, how a
//! response is read, and how an attempt is readied as it is sent ([`AttemptPolicy`]), with the
//! policies for [`ReplayBody`] and for bodies cheap to clone.

use http::{HeaderMap, Request};
use stormguard_core::conditions::AttemptFailure;
use stormguard_http::body::ReplayBody;
use stormguard_http::classify::classify_response;

use crate::extensions::{SlotWait, TimeLeft, UpstreamTarget};

/// How to send a request body again, and how to read a response. Implement it for request
/// types other than `http::Request<ReplayBody<B>>` (e.g. a tonic client whose bodies are
/// buffered).
pub trait AttemptPolicy<B>: Clone + Send + Sync + 'static {
    /// A copy of the body for another attempt, or `None` when it cannot be sent again.
    fn clone_body(&self, body: &B) -> Option<B>;

    /// Whether everything sent so far can be sent again (checked after an attempt fails).
    fn is_replayable(&self, body: &B) -> bool;

    /// The failure a response is, or `None` for a success. Default: status ≥ 400, or a
    /// trailers-only gRPC response with a non-zero `grpc-status`.
    fn classify(&self, status: http::StatusCode, headers: &HeaderMap) -> Option<AttemptFailure> {
        classify_response(status, headers)
    }

    /// Readies an attempt's request as the layer sends it, with what the layer knows of the
    /// attempt ([`Sending`]). Default: in the request's extensions — [`UpstreamTarget`] (on an
    /// attempt to any upstream but the first), [`TimeLeft`], [`SlotWait`] — where the service
    /// under the layer reads them. A policy whose service takes them otherwise overrides it
    /// (the proxy writes them into the request itself, with no extension map per attempt).
    fn sending(&self, req: &mut Request<B>, attempt: Sending) {
        attempt.insert_into(req.extensions_mut());
    }
}

/// What the layer knows of an attempt as it sends it, for the service under it
/// ([`AttemptPolicy::sending`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Sending {
    /// The upstream it goes to: an index into the dependency's upstreams, 0 with one.
    pub target: usize,
    /// The request's time left when it was sent, while a deadline applies (the dependency's,
    /// or the caller's [`Deadline`](crate::Deadline)): its deadline, not the per-try timeout.
    pub time_left: Option<std::time::Duration>,
    /// How long it waited for its slot, when it waited (a first try in the queue, or for its
    /// turn in the provider's window).
    pub slot_wait: Option<std::time::Duration>,
}

impl Sending {
    /// The extensions [`AttemptPolicy::sending`] writes by default: [`UpstreamTarget`] when
    /// the target is not 0, [`TimeLeft`] and [`SlotWait`] when known.
    #[inline]
    pub fn insert_into(self, extensions: &mut http::Extensions) {
        if self.target != 0 {
            extensions.insert(UpstreamTarget(self.target));
        }
        if let Some(left) = self.time_left {
            extensions.insert(TimeLeft(left));
        }
        if let Some(waited) = self.slot_wait {
            extensions.insert(SlotWait(waited));
        }
    }
}

/// The policy for [`ReplayBody`] requests: the body is copied while sent, up to a limit.
#[derive(Clone, Copy, Debug, Default)]
pub struct Replay;

impl<B: Send + 'static> AttemptPolicy<ReplayBody<B>> for Replay {
    fn clone_body(&self, body: &ReplayBody<B>) -> Option<ReplayBody<B>> {
        Some(body.clone())
    }

    fn is_replayable(&self, body: &ReplayBody<B>) -> bool {
        body.is_replayable()
    }
}

/// The policy for bodies that are cheap to clone whole (`()`, `Empty`, `Full`, `String`).
#[derive(Clone, Copy, Debug, Default)]
pub struct CloneBody;

impl<B: Clone + Send + Sync + 'static> AttemptPolicy<B> for CloneBody {
    fn clone_body(&self, body: &B) -> Option<B> {
        Some(body.clone())
    }

    fn is_replayable(&self, _: &B) -> bool {
        true
    }
}
