//! What a request keeps for the attempts after its first, and how an admitted attempt is sent:
//! the pieces the layer's future ([`crate::retry`]) and its hedges ([`crate::hedge`]) share.
//! How a request body is copied and a response read is the [`AttemptPolicy`] (`crate::policy`).

use http::{Request, Response};
use http_body::Body;
use stormguard_core::clock::Timestamp;
use stormguard_core::decision::RequestFacts;
use stormguard_core::life::{Admitted, Life};
use stormguard_core::scope::{FanOutScope, Scope};
use stormguard_core::tree::TreeContext;
use stormguard_http::classify::is_idempotent;
use tower::ServiceExt;
use tracing::Instrument;

use crate::cap::{Inner, PermitBody};
use crate::dependency::Dependency;
use crate::error::BoxError;
use crate::extensions::{CallerRetry, Deadline, Idempotent, RouteBudget};
use crate::policy::AttemptPolicy;

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

/// What an attempt came to: the answer with its slot (held by the body), or how it failed.
pub(crate) type Answer<RB> = Result<Response<PermitBody<RB>>, BoxError>;

/// A request kept for the attempts after its first: its head and its body apart, so that each
/// attempt's copy is the head cloned field by field with a new body (a copy made through
/// `Request::new` builds a default head first, to be dropped field by field as it is
/// overwritten).
pub(crate) struct Original<B> {
    pub(crate) head: http::request::Parts,
    pub(crate) body: B,
}

impl<B> Original<B> {
    pub(crate) fn new(req: Request<B>) -> Original<B> {
        let (head, body) = req.into_parts();
        Original { head, body }
    }

    /// A copy of the request for another attempt, with `body`.
    #[inline]
    pub(crate) fn copy(&self, body: B) -> Request<B> {
        Request::from_parts(self.head.clone(), body)
    }

    /// The request itself, for its one attempt (a body that cannot be copied).
    pub(crate) fn into_request(self) -> Request<B> {
        Request::from_parts(self.head, self.body)
    }
}

/// What the retry rules need to know of a request, by its head (see [`RequestFacts`]).
pub(crate) fn request_facts(
    dep: &Dependency,
    head: &http::request::Parts,
    deadline: Option<Timestamp>,
    replayable: bool,
) -> RequestFacts {
    let config = dep.config();
    RequestFacts {
        idempotent: is_idempotent(
            &head.method,
            &head.headers,
            &config.idempotency_key,
            head.extensions.get::<Idempotent>().is_some(),
        ),
        replayable,
        // A caller's own retry is one, marked or not.
        stacked: config.stacked.arrived_as_retry(&head.headers)
            || head.extensions.get::<CallerRetry>().is_some(),
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
    pub(crate) req: Original<B>,
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
            let replayable = policy.is_replayable(&req.body);
            Box::new(
                Life::new(
                    request_facts(dep, &req.head, *deadline, replayable),
                    scopes(dep, &req.head.extensions, route.as_ref(), tree.as_ref()),
                    *target,
                )
                .with_tree(*tree),
            )
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
    policy: P,
    this: Request<B>,
    deadline: Option<Timestamp>,
    admitted: Admitted<crate::rate::RateReservation>,
    span: tracing::Span,
) -> Answer<RB>
where
    S: Inner<B, RB>,
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
    let sent = (slots.0, slots.1, booked.sent().map(Box::new));
    let call = span.in_scope(|| {
        crate::cap::send(&dep, &mut svc, &policy, || this, sent, deadline, (now, None), target)
    });
    call.answer(&dep).instrument(span).await
}
