//! Record mode: a dependency's traffic as the events `stormguard replay` reads, so an incident
//! can be replayed against candidate budgets.
//!
//! The layer reports, per request: `request` when the first attempt is sent; `failure`
//! (`kind` error, timeout or throttle) or `success` (`retry` when it was a retried attempt) for
//! each attempt's outcome; `retry_done` after a retried attempt's outcome; and `retry` when a
//! retry *reached the budget* — allowed, or refused by the budget, a scope or the cap (the
//! `allowed` field says what this dependency decided; `replay` ignores it and asks its own
//! policy). A retry refused before the budget (not idempotent, no replayable body, attempts
//! used up, already retried upstream, breaker, pushback, deadline) is not an ask: no budget
//! would have been consulted. Each `retry` is preceded by an `active` snapshot for concurrency
//! budgets, taken as of just before the ask: `n`, the requests in flight (primaries holding or
//! waiting for a slot, and retries), and `retries`, the retries in flight — both counted over
//! every upstream's limiter, the asked retry not included.
//!
//! What a replay cannot show: the retries that a refused retry would have led to (the trace
//! holds what happened here, not what a more generous budget would have caused).

use std::fmt;
use std::fmt::Write as _;
use std::sync::Arc;

use stormguard_core::Denied;
use stormguard_core::budget::FailureKind;
use stormguard_core::clock::Timestamp;

/// One event of a request's life, in `replay`'s vocabulary.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TraceOp {
    /// The first attempt is sent.
    Request,
    /// An attempt failed.
    Failure(FailureKind),
    /// An attempt succeeded; `true` when it was a retry.
    Success(bool),
    /// A retry reached the budget: `None` when it was sent, else why it was refused.
    Retry(FailureKind, Option<Denied>),
    /// A retried attempt finished (after its outcome).
    RetryDone,
    /// A snapshot of what is in flight at the dependency just before a retry is asked.
    Active {
        /// Requests in flight: primaries holding or waiting for a slot, plus `retries`.
        n: u64,
        /// Retries in flight (holding a slot).
        retries: u64,
    },
}

/// One recorded event: when (the dependency's clock), which request (a per-dependency number),
/// what.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TraceEvent {
    /// When, on the dependency's clock.
    pub at: Timestamp,
    /// The request it belongs to (numbered per dependency from 1).
    pub id: u64,
    /// What happened.
    pub op: TraceOp,
}

impl TraceEvent {
    /// The event as one `replay` JSON line (with a trailing newline), `t_ms` counted from
    /// `origin`, tagged with the dependency's name.
    pub fn write_json_line(&self, dependency: &str, origin: Timestamp, out: &mut String) {
        let t_ms = self.at.saturating_since(origin).as_millis();
        let _ = write!(out, "{{\"t_ms\":{t_ms},\"dependency\":");
        json_string(dependency, out);
        let _ = write!(out, ",\"id\":{}", self.id);
        let _ = match self.op {
            TraceOp::Request => write!(out, ",\"op\":\"request\""),
            TraceOp::Failure(kind) => {
                write!(out, ",\"op\":\"failure\",\"kind\":\"{}\"", kind.as_str())
            }
            TraceOp::Success(retry) => write!(out, ",\"op\":\"success\",\"retry\":{retry}"),
            TraceOp::Retry(kind, None) => {
                write!(
                    out,
                    ",\"op\":\"retry\",\"kind\":\"{}\",\"allowed_here\":true",
                    kind.as_str()
                )
            }
            TraceOp::Retry(kind, Some(reason)) => write!(
                out,
                ",\"op\":\"retry\",\"kind\":\"{}\",\"allowed_here\":false,\"denied\":\"{}\"",
                kind.as_str(),
                reason.as_str()
            ),
            TraceOp::RetryDone => write!(out, ",\"op\":\"retry_done\""),
            TraceOp::Active { n, retries } => {
                write!(out, ",\"op\":\"active\",\"n\":{n},\"retries\":{retries}")
            }
        };
        out.push_str("}\n");
    }
}

fn json_string(s: &str, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Where a dependency's trace events go (see [`DependencyConfig::recorder`]). Called on the
/// request path: it must not block (buffer, or hand off to a channel).
///
/// [`DependencyConfig::recorder`]: crate::DependencyConfig::recorder
#[derive(Clone)]
pub struct Recorder(Arc<RecordFn>);

type RecordFn = dyn Fn(&str, TraceEvent) + Send + Sync;

impl Recorder {
    /// A recorder from a function given the dependency's name and the event.
    pub fn new(f: impl Fn(&str, TraceEvent) + Send + Sync + 'static) -> Recorder {
        Recorder(Arc::new(f))
    }

    /// Reports one event.
    pub fn record(&self, dependency: &str, event: TraceEvent) {
        (self.0)(dependency, event)
    }
}

impl fmt::Debug for Recorder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Recorder")
    }
}

/// Whether a refused retry had reached the budget (and so is an ask a replay must see).
pub(crate) fn reached_budget(reason: Denied) -> bool {
    matches!(reason, Denied::Scope | Denied::Tree | Denied::Budget | Denied::Cap | Denied::Queue)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line(op: TraceOp) -> String {
        let mut s = String::new();
        TraceEvent { at: Timestamp::from_nanos(1_500_000_000), id: 7, op }.write_json_line(
            "pay\"ments",
            Timestamp::from_nanos(500_000_000),
            &mut s,
        );
        s
    }

    #[test]
    fn lines_are_replay_json() {
        assert_eq!(
            line(TraceOp::Request),
            "{\"t_ms\":1000,\"dependency\":\"pay\\\"ments\",\"id\":7,\"op\":\"request\"}\n"
        );
        for op in [
            TraceOp::Failure(FailureKind::Timeout),
            TraceOp::Success(true),
            TraceOp::Retry(FailureKind::Throttle, Some(Denied::Budget)),
            TraceOp::Retry(FailureKind::Error, None),
            TraceOp::RetryDone,
            TraceOp::Active { n: 3, retries: 1 },
        ] {
            let l = line(op);
            let v: serde_json::Value = serde_json::from_str(&l).unwrap();
            assert_eq!(v["t_ms"], 1000, "{l}");
            assert!(v["op"].is_string(), "{l}");
        }
        let v: serde_json::Value =
            serde_json::from_str(&line(TraceOp::Retry(FailureKind::Throttle, Some(Denied::Cap))))
                .unwrap();
        assert_eq!((v["kind"].as_str(), v["denied"].as_str()), (Some("throttle"), Some("cap")));
    }
}
