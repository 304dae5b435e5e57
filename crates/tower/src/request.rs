//! What a request keeps for the attempts after its first, and how an admitted attempt is sent:
//! the pieces the layer's future ([`crate::retry`]) and its hedges ([`crate::hedge`]) share.
//! How a request body is copied and a response read is the [`AttemptPolicy`].

use http::{HeaderMap, Request, Response};
use http_body::Body;
use stormguard_core::clock::Timestamp;
use stormguard_core::conditions::AttemptFailure;
use stormguard_core::decision::RequestFacts;
use stormguard_core::life::{Admitted, Life};
use stormguard_core::scope::{FanOutScope, Scope};
use stormguard_core::tree::TreeContext;
use stormguard_http::body::ReplayBody;
use stormguard_http::classify::{classify_response, is_idempotent};
use tower::{Service, ServiceExt};
use tracing::Instrument;

use crate::cap::PermitBody;
use crate::dependency::Dependency;
use crate::error::BoxError;
use crate::extensions::{
    CallerRetry, Deadline, Idempotent, RouteBudget, SlotWait, TimeLeft, UpstreamTarget,
};

/// A request's start: its start time (read only when something needs it) and its deadline —
/// the dependency's, or the caller's [`Deadline`] when sooner — with the request counted on its
/// route's budget. For clients that run the retry loop outside tower (stormguard-reqwest) too.
pub fn request_start(
    dep: &Dependency,
    route: Option<&RouteBudget>,
    asked: Option<Deadline>,
) -> (Option<Timestamp>, Option<Timestamp>) {
    let config = dep.config();
    let start =
        (config.deadline.is_some() || asked.is_some() || route.is_some()).then(|| dep.now());
    let deadline = start.and_then(|now| {
        let configured = config.deadline.map(|d| now.saturating_add(d));
        let asked = asked.map(|d| {
            now.saturating_add(d.0.saturating_duration_since(tokio::time::Instant::now()))
        });
        match (configured, asked) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    });
    if let (Some(r), Some(now)) = (route, start) {
        r.0.record_request(now);
    }
    (start, deadline)
}

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
    /// or the caller's [`Deadline`]): its deadline, not the per-try timeout.
    pub time_left: Option<std::time::Duration>,
    /// How long it waited for its slot, when it waited (a first try in the queue, or for its
    /// turn in the provider's window).
    pub slot_wait: Option<std::time::Duration>,
}

impl Sending {
    /// The extensions [`AttemptPolicy::sending`] writes by default: [`UpstreamTarget`] when
    /// the target is not 0, [`TimeLeft`] and [`SlotWait`] when known.
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

/// What an attempt came to: the answer with its slot (held by the body), or how it failed.
pub(crate) type Answer<RB> = Result<Response<PermitBody<RB>>, BoxError>;

/// Copies a request's head for another attempt, with a new body.
pub(crate) fn copy_request<B>(req: &Request<B>, body: B) -> Request<B> {
    let mut r = Request::new(body);
    *r.method_mut() = req.method().clone();
    *r.uri_mut() = req.uri().clone();
    *r.version_mut() = req.version();
    *r.headers_mut() = req.headers().clone();
    *r.extensions_mut() = req.extensions().clone();
    r
}

/// What the retry rules need to know of a request (see [`RequestFacts`]).
pub(crate) fn request_facts<B>(
    dep: &Dependency,
    req: &Request<B>,
    deadline: Option<Timestamp>,
    replayable: bool,
) -> RequestFacts {
    let config = dep.config();
    RequestFacts {
        idempotent: is_idempotent(
            req.method(),
            req.headers(),
            &config.idempotency_key,
            req.extensions().get::<Idempotent>().is_some(),
        ),
        replayable,
        // A caller's own retry is one, marked or not.
        stacked: config.stacked.arrived_as_retry(req.headers())
            || req.extensions().get::<CallerRetry>().is_some(),
        deadline,
    }
}

/// The scopes a request's retries (and hedges) are charged to: its fan-out, then its route,
/// then its call tree's allowance (when it carries a tree's context) — the one list every
/// placement builds.
pub fn scope_list(
    dep: &Dependency,
    fan_out: Option<&FanOutScope>,
    route: Option<&RouteBudget>,
    tree: Option<&TreeContext>,
) -> Vec<Scope> {
    let mut scopes = Vec::new();
    if let Some(s) = fan_out {
        scopes.push(Scope::FanOut(s.clone()));
    }
    if let Some(r) = route {
        scopes.push(Scope::Route(r.0.clone()));
    }
    if tree.is_some() {
        scopes.push(Scope::Tree(dep.tree().clone()));
    }
    scopes
}

/// [`scope_list`] of a request's extensions (its [`FanOutScope`]) and its route and tree.
pub fn scopes(
    dep: &Dependency,
    extensions: &http::Extensions,
    route: Option<&RouteBudget>,
    tree: Option<&TreeContext>,
) -> Vec<Scope> {
    scope_list(dep, extensions.get::<FanOutScope>(), route, tree)
}

/// What a request keeps while its first attempt is in flight, for the retries (and the hedge)
/// it may need.
pub(crate) struct Rest<S, P, B> {
    pub(crate) dep: Dependency,
    pub(crate) policy: P,
    pub(crate) svc: S,
    pub(crate) req: Request<B>,
    pub(crate) deadline: Option<Timestamp>,
    pub(crate) route: Option<RouteBudget>,
    /// The request's number in the recorded trace, when recording.
    pub(crate) id: Option<u64>,
    /// The upstream the first attempt went to.
    pub(crate) target: usize,
    /// The call tree's context it arrived with (read once, [`Dependency::tree_context`]).
    pub(crate) tree: Option<TreeContext>,
    /// The request's life, once it needs one (a hedge, a failure, a caller's retry).
    /// (Boxed: a request that succeeds at once moves `Rest` into its box without it.)
    pub(crate) life: Option<Box<Life>>,
}

impl<S, P: AttemptPolicy<B>, B> Rest<S, P, B> {
    /// The request's life, made at its first need.
    pub(crate) fn life(&mut self) -> &mut Life {
        let Rest { dep, policy, req, deadline, route, target, tree, life, .. } = self;
        life.get_or_insert_with(|| {
            let replayable = policy.is_replayable(req.body());
            Box::new(Life::new(
                request_facts(dep, req, *deadline, replayable),
                scopes(dep, req.extensions(), route.as_ref(), tree.as_ref()),
                *target,
            ))
        })
    }
}

/// Sends an attempt its request's life admitted (a retry, a hedge, a caller's own retry) with
/// the slots and the booking it was admitted with, on `svc` (a clone of the layer's service)
/// once it is ready, in `span`. Dropped before it is sent, its booking comes back (its slots
/// with it).
pub(crate) async fn send_admitted<S, P, B, RB>(
    dep: Dependency,
    mut svc: S,
    policy: &P,
    this: Request<B>,
    deadline: Option<Timestamp>,
    admitted: Admitted<crate::rate::RateReservation>,
    span: tracing::Span,
) -> Answer<RB>
where
    S: Service<Request<B>, Response = Response<RB>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Into<BoxError> + 'static,
    P: AttemptPolicy<B>,
    RB: Body + Send + 'static,
{
    let target = admitted.target;
    let booked = crate::rate::Unsent::new(&dep, admitted.booking);
    let slots = (admitted.permit, admitted.total);
    if let Err(e) = svc.ready().await {
        return Err(e.into());
    }
    let now = dep.now();
    let sent = (slots.0, slots.1, booked.sent());
    let call = span.in_scope(|| {
        crate::cap::send(&dep, &mut svc, policy, this, sent, deadline, (now, None), target)
    });
    call.instrument(span).await
}
