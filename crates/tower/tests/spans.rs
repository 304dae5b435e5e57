//! Attempts as `tracing` spans, as a `tracing-opentelemetry` layer would see them: a test layer
//! records every span (name, fields, parent) and every event (with the span it happened in),
//! on paused tokio time.
//!
//! - a retried request is two `stormguard.attempt` spans, siblings, the second with
//!   `http.request.resend_count = 1`, each with its status, and the dependency's calls happen
//!   inside them;
//! - a refused retry puts its reason (`stormguard.denied`) on the attempt it judged, and says so
//!   in a `debug` event there; a retry refused its slot when its backoff ended is a span of its
//!   own with the reason and no status;
//! - each change of a breaker's state is exactly one log line.
//!
//! A test binary of its own (the crate's other tests are one binary, `tests/it`): it installs
//! `tracing` dispatchers, and `tracing`'s callsite interest is process-wide, so tests running
//! beside it in one process could leave a callsite it records disabled.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, Response};
use http_body_util::Full;
use stormguard_core::breaker::BreakerConfig;
use stormguard_tower::{Dependency, DependencyConfig, ReplayBody, StormguardLayer};
use tower::{Layer, Service, ServiceExt};
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::layer::{Context, SubscriberExt};
use tracing_subscriber::registry::LookupSpan;

type Req = Request<ReplayBody<Full<Bytes>>>;

// ---- the recording layer ----

#[derive(Debug, Clone)]
struct SpanRec {
    name: &'static str,
    fields: BTreeMap<String, String>,
    parent: Option<usize>,
}

#[derive(Debug, Clone)]
struct EventRec {
    level: Level,
    fields: BTreeMap<String, String>,
    /// The index of the span it happened in.
    span: Option<usize>,
}

impl EventRec {
    fn message(&self) -> &str {
        self.fields.get("message").map_or("", String::as_str)
    }
}

/// Every span and event, in order. A span is known by its index here (the registry reuses ids).
#[derive(Clone, Default)]
struct Recorded {
    spans: Arc<Mutex<Vec<SpanRec>>>,
    events: Arc<Mutex<Vec<EventRec>>>,
}

struct Index(usize);

struct Fields<'a>(&'a mut BTreeMap<String, String>);

impl Visit for Fields<'_> {
    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.insert(field.name().to_string(), value.to_string());
    }
    fn record_u64(&mut self, field: &Field, value: u64) {
        self.0.insert(field.name().to_string(), value.to_string());
    }
    fn record_i64(&mut self, field: &Field, value: i64) {
        self.0.insert(field.name().to_string(), value.to_string());
    }
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.0.insert(field.name().to_string(), format!("{value:?}"));
    }
}

impl<S: Subscriber + for<'a> LookupSpan<'a>> tracing_subscriber::Layer<S> for Recorded {
    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, ctx: Context<'_, S>) {
        let mut fields = BTreeMap::new();
        attrs.record(&mut Fields(&mut fields));
        let span = ctx.span(id).expect("a new span");
        let parent = span.parent().and_then(|p| p.extensions().get::<Index>().map(|i| i.0));
        let mut spans = self.spans.lock().unwrap();
        spans.push(SpanRec { name: attrs.metadata().name(), fields, parent });
        span.extensions_mut().insert(Index(spans.len() - 1));
    }

    fn on_record(&self, id: &Id, values: &Record<'_>, ctx: Context<'_, S>) {
        let span = ctx.span(id).expect("a live span");
        let Some(i) = span.extensions().get::<Index>().map(|i| i.0) else { return };
        values.record(&mut Fields(&mut self.spans.lock().unwrap()[i].fields));
    }

    fn on_event(&self, event: &Event<'_>, ctx: Context<'_, S>) {
        let mut fields = BTreeMap::new();
        event.record(&mut Fields(&mut fields));
        let span = ctx.event_span(event).and_then(|s| s.extensions().get::<Index>().map(|i| i.0));
        self.events.lock().unwrap().push(EventRec {
            level: *event.metadata().level(),
            fields,
            span,
        });
    }
}

impl Recorded {
    /// Installs the layer for this thread (the tests run on a current-thread runtime).
    fn install() -> (Recorded, tracing::subscriber::DefaultGuard) {
        let r = Recorded::default();
        let guard =
            tracing::subscriber::set_default(tracing_subscriber::registry().with(r.clone()));
        (r, guard)
    }

    fn attempts(&self) -> Vec<SpanRec> {
        self.spans
            .lock()
            .unwrap()
            .iter()
            .filter(|s| s.name == "stormguard.attempt")
            .cloned()
            .collect()
    }

    fn events(&self) -> Vec<EventRec> {
        self.events.lock().unwrap().clone()
    }

    /// The index of the `n`th attempt span among all spans.
    fn attempt_index(&self, n: usize) -> usize {
        let spans = self.spans.lock().unwrap();
        spans
            .iter()
            .enumerate()
            .filter(|(_, s)| s.name == "stormguard.attempt")
            .nth(n)
            .map(|(i, _)| i)
            .expect("that many attempt spans")
    }
}

fn field<'a>(s: &'a SpanRec, name: &str) -> Option<&'a str> {
    s.fields.get(name).map(String::as_str)
}

// ---- the dependency ----

/// Answers by path: `/fail-once` 503 on the first call then 200; `/fail` always 503;
/// `/retry-after` 503 with `retry-after: 1`; `/slow` 200 after 5 s; anything else 200. Each call
/// emits an `info` event, so the test sees which span it ran in.
#[derive(Clone, Default)]
struct Upstream {
    calls: Arc<Mutex<u32>>,
}

impl Service<Req> for Upstream {
    type Response = Response<Full<Bytes>>;
    type Error = std::convert::Infallible;
    type Future = std::pin::Pin<
        Box<dyn std::future::Future<Output = Result<Self::Response, Self::Error>> + Send>,
    >;

    fn poll_ready(
        &mut self,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Req) -> Self::Future {
        let n = {
            let mut calls = self.calls.lock().unwrap();
            *calls += 1;
            *calls
        };
        tracing::info!(path = req.uri().path(), "the dependency was called");
        let path = req.uri().path().to_string();
        Box::pin(async move {
            let (status, retry_after) = match path.as_str() {
                "/fail-once" if n == 1 => (503, false),
                "/fail" => (503, false),
                "/retry-after" => (503, true),
                "/slow" => {
                    tokio::time::sleep(Duration::from_secs(5)).await;
                    (200, false)
                }
                _ => (200, false),
            };
            let mut resp = Response::builder().status(status);
            if retry_after {
                resp = resp.header("retry-after", "1");
            }
            Ok(resp.body(Full::new(Bytes::from_static(b"answer"))).unwrap())
        })
    }
}

fn request(path: &str) -> Req {
    Request::builder()
        .method(Method::GET)
        .uri(format!("http://payments.internal:8443{path}"))
        .body(ReplayBody::new(Full::new(Bytes::new()), 1024))
        .unwrap()
}

fn dependency(f: impl FnOnce(&mut DependencyConfig)) -> Dependency {
    let mut c = DependencyConfig::new("payments");
    c.budget = "ratio:percent=10,min_per_sec=100".parse().unwrap();
    f(&mut c);
    Dependency::try_new(c).unwrap()
}

// ---- the tests ----

#[tokio::test(start_paused = true)]
async fn a_retried_request_is_two_attempt_spans_the_second_with_resend_count_1() {
    let (rec, _guard) = Recorded::install();
    let stack = StormguardLayer::new(dependency(|_| {})).layer(Upstream::default());
    let resp = stack.oneshot(request("/fail-once")).await.unwrap();
    assert_eq!(resp.status(), 200);
    let spans = rec.attempts();
    assert_eq!(spans.len(), 2, "{spans:#?}");
    let (first, retry) = (&spans[0], &spans[1]);
    // OpenTelemetry: resend_count only on a resend, 1 on the first.
    assert_eq!(field(first, "http.request.resend_count"), None);
    assert_eq!(field(retry, "http.request.resend_count"), Some("1"));
    assert_eq!(field(first, "http.response.status_code"), Some("503"));
    assert_eq!(field(first, "error.type"), Some("503"));
    assert_eq!(field(retry, "http.response.status_code"), Some("200"));
    assert_eq!(field(retry, "error.type"), None);
    for s in [first, retry] {
        assert_eq!(field(s, "otel.name"), Some("GET"));
        assert_eq!(field(s, "otel.kind"), Some("client"));
        assert_eq!(field(s, "http.request.method"), Some("GET"));
        assert_eq!(field(s, "stormguard.dependency"), Some("payments"));
        assert_eq!(field(s, "server.address"), Some("payments.internal"));
        assert_eq!(field(s, "server.port"), Some("8443"));
        assert_eq!(field(s, "stormguard.denied"), None);
        // Siblings under the caller's span (none here), not nested in each other.
        assert_eq!(s.parent, None);
    }
    // The dependency was called inside each attempt's span.
    let (i0, i1) = (rec.attempt_index(0), rec.attempt_index(1));
    let calls: Vec<_> = rec
        .events()
        .into_iter()
        .filter(|e| e.message() == "the dependency was called")
        .map(|e| e.span)
        .collect();
    assert_eq!(calls, [Some(i0), Some(i1)]);
    // The decision is a debug event in the span of the attempt it judged.
    let retrying: Vec<_> = rec.events().into_iter().filter(|e| e.message() == "retrying").collect();
    assert_eq!(retrying.len(), 1, "{retrying:#?}");
    assert_eq!(retrying[0].level, Level::DEBUG);
    assert_eq!(retrying[0].span, Some(i0));
    assert_eq!(retrying[0].fields.get("failure").map(String::as_str), Some("503"));
}

#[tokio::test(start_paused = true)]
async fn a_refused_retry_records_its_reason_on_the_attempt_it_judged() {
    let (rec, _guard) = Recorded::install();
    let dep = dependency(|c| c.budget = "ratio:percent=0,min_per_sec=0".parse().unwrap());
    let resp = StormguardLayer::new(dep).layer(Upstream::default()).oneshot(request("/fail")).await;
    assert_eq!(resp.unwrap().status(), 503);
    let spans = rec.attempts();
    assert_eq!(spans.len(), 1, "{spans:#?}");
    assert_eq!(field(&spans[0], "stormguard.denied"), Some("budget"));
    assert_eq!(field(&spans[0], "http.response.status_code"), Some("503"));
    let refused: Vec<_> =
        rec.events().into_iter().filter(|e| e.message() == "retry refused").collect();
    assert_eq!(refused.len(), 1, "{refused:#?}");
    assert_eq!(refused[0].fields.get("reason").map(String::as_str), Some("budget"));
    assert_eq!(refused[0].span, Some(rec.attempt_index(0)));

    // Attempts used up: the third attempt's span carries `attempts`, and the resend counts run
    // 1, 2.
    let (rec, _guard) = Recorded::install();
    let dep = dependency(|c| c.retry.max_retries = 2);
    let resp = StormguardLayer::new(dep).layer(Upstream::default()).oneshot(request("/fail")).await;
    assert_eq!(resp.unwrap().status(), 503);
    let spans = rec.attempts();
    let counts: Vec<_> = spans.iter().map(|s| field(s, "http.request.resend_count")).collect();
    assert_eq!(counts, [None, Some("1"), Some("2")]);
    let denied: Vec<_> = spans.iter().map(|s| field(s, "stormguard.denied")).collect();
    assert_eq!(denied, [None, None, Some("attempts")]);
}

/// A retry whose backoff ends when no slot is free is refused `cap` there: a span of its own,
/// with the reason and no status, since it never reached the dependency.
#[tokio::test(start_paused = true)]
async fn a_retry_refused_its_slot_is_an_attempt_span_with_the_reason_and_no_status() {
    let (rec, _guard) = Recorded::install();
    let dep = dependency(|c| c.limiter.cap = 1);
    let stack = StormguardLayer::new(dep).layer(Upstream::default());
    // Its 503 says retry after 1 s; while it waits, a slow call takes the only slot.
    let first = tokio::spawn(stack.clone().oneshot(request("/retry-after")));
    tokio::time::sleep(Duration::from_millis(100)).await;
    let slow = tokio::spawn(stack.clone().oneshot(request("/slow")));
    let resp = first.await.unwrap().unwrap();
    assert_eq!(resp.status(), 503);
    assert_eq!(
        resp.extensions().get::<stormguard_tower::Denied>(),
        Some(&stormguard_tower::Denied::Cap)
    );
    let spans = rec.attempts();
    // The first try, the slow call, the refused retry.
    assert_eq!(spans.len(), 3, "{spans:#?}");
    let retry = &spans[2];
    assert_eq!(field(retry, "http.request.resend_count"), Some("1"));
    assert_eq!(field(retry, "stormguard.denied"), Some("cap"));
    assert_eq!(field(retry, "http.response.status_code"), None);
    assert_eq!(field(&spans[0], "stormguard.denied"), None);
    assert_eq!(slow.await.unwrap().unwrap().status(), 200);
}

/// Without a subscriber that wants them, no span is built (the stack runs as before).
#[tokio::test(start_paused = true)]
async fn no_span_is_built_when_nothing_wants_it() {
    let r = Recorded::default();
    let filtered = tracing_subscriber::registry().with(tracing_subscriber::Layer::with_filter(
        r.clone(),
        tracing_subscriber::filter::Targets::new().with_target("stormguard::attempt", Level::WARN),
    ));
    let _guard = tracing::subscriber::set_default(filtered);
    let resp = StormguardLayer::new(dependency(|_| {}))
        .layer(Upstream::default())
        .oneshot(request("/fail-once"))
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert!(r.spans.lock().unwrap().is_empty());
}

/// The breaker's changes of state: one line each, opening at `warn`.
#[tokio::test(start_paused = true)]
async fn each_breaker_change_is_one_log_line() {
    let (rec, _guard) = Recorded::install();
    let dep = dependency(|c| {
        c.retry.max_retries = 0;
        c.breaker = Some(BreakerConfig {
            consecutive_failures: Some(3),
            break_duration: Duration::from_secs(5),
            ..BreakerConfig::default()
        });
    });
    let stack = StormguardLayer::new(dep).layer(Upstream::default());
    // Three failures open it; the requests after fail fast (refused, not sent).
    for _ in 0..6 {
        let _ = stack.clone().oneshot(request("/fail")).await;
    }
    tokio::time::sleep(Duration::from_secs(6)).await;
    // The probe succeeds: half-open, then closed.
    assert_eq!(stack.clone().oneshot(request("/ok")).await.unwrap().status(), 200);
    let lines: Vec<_> = rec
        .events()
        .into_iter()
        .filter(|e| e.message().starts_with("circuit breaker"))
        .map(|e| (e.level, e.fields.get("transition").cloned().unwrap_or_default()))
        .collect();
    assert_eq!(
        lines,
        [
            (Level::WARN, "closed -> open".to_string()),
            (Level::INFO, "open -> half-open".to_string()),
            (Level::INFO, "half-open -> closed".to_string()),
        ]
    );
    // The refused primaries carry the reason on their spans.
    let denied =
        rec.attempts().iter().filter(|s| field(s, "stormguard.denied") == Some("breaker")).count();
    assert_eq!(denied, 3);
}
