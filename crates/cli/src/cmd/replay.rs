//! `stormguard replay`: run a trace of events through one budget policy on a virtual clock.
//!
//! The input is JSON lines, each with `t_ms` (virtual milliseconds, non-decreasing), `op`, and
//! an optional `id` naming the original request the event belongs to (when absent, the most
//! recent `request`, or one implicit request when none came yet). Output is one JSON line per
//! `retry` and per `balance`; a summary (retries asked, allowed, denied by reason) goes to
//! stderr, so stdout stays JSON lines. The proxy's record mode writes this format, so an
//! incident can be replayed against candidate budgets.
//!
//! Choices the contract leaves open, made the way a budget behaves in production:
//! - events before any `request` belong to one implicit original request, which deposits
//!   nothing (the trace did not see it start) but owns its retries, so a successful retry's
//!   quota refund is kept;
//! - `active` is a snapshot: its `n` and `retries` already count the retries in flight then,
//!   so a retry granted before it stops counting on its own; one granted after it counts as one
//!   more of each until its `retry_done` or the next `active`;
//! - a `retry_done` ends the most recent open retry of its request: one the trace says was
//!   sent (`"allowed_here": true`, written by record mode), or, without that field, one this
//!   policy allowed. One that matches no open retry is counted and reported on stderr, never
//!   silently dropped;
//! - a `success` with `"retry": true` lets a quota refund the last retry granted for that
//!   request; it does not end the retry's concurrency count (only `retry_done` does);
//! - blank lines are skipped; unknown fields are ignored (newer recorders may add some).

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;

use clap::Args;
use serde::Deserialize;
use serde_json::Value;
use stormguard_core::budget::{BudgetSpec, FailureKind, Outcome, RetryBudget, RetryPermit};
use stormguard_core::clock::Timestamp;

use crate::Failure;

/// Flags of `stormguard replay`.
#[derive(Debug, Args)]
#[command(after_help = "\
Input (JSON lines):
  {\"t_ms\":0,\"op\":\"request\",\"id\":\"a\"}          an original request is sent
  {\"t_ms\":5,\"op\":\"failure\",\"kind\":\"timeout\"}   an attempt failed (error|timeout|throttle)
  {\"t_ms\":5,\"op\":\"retry\",\"kind\":\"timeout\"}     ask for a retry now; taken if allowed
  {\"t_ms\":9,\"op\":\"retry_done\"}                 a retry in flight finished
  {\"t_ms\":9,\"op\":\"success\",\"retry\":true}       the request succeeded (on a retry)
  {\"t_ms\":9,\"op\":\"active\",\"n\":10,\"retries\":1} a snapshot: requests and retries in flight
                                                now, granted retries included
  {\"t_ms\":9,\"op\":\"balance\"}                    print what the policy holds now
Events without an id belong to the last request (before any: one implicit request).
Output (stdout): {\"t_ms\":5,\"op\":\"retry\",\"allowed\":true} and
  {\"t_ms\":9,\"op\":\"balance\",\"value\":3}
Summary (stderr): retries asked, allowed and denied by reason, and what the recorded run
  decided when the trace says it (record mode's allowed_here and denied).

Example (eight requests, three of which ask for a retry; this policy allows one of them):
  stormguard replay --policy ratio:percent=0.2,min_per_sec=0,ttl=10s deploy/examples/trace.jsonl
A trace the proxy recorded (stormguard proxy --record incident.jsonl):
  stormguard replay --policy ratio:percent=0.2,min_per_sec=10,ttl=10s incident.jsonl")]
pub struct ReplayArgs {
    /// The policy: KIND:key=value,... e.g. ratio:percent=0.2,min_per_sec=10,ttl=10s,
    /// concurrency:percent=0.2,min=3, token-bucket:max_tokens=10,token_ratio=0.1,
    /// quota:capacity=500,retry_cost=5,timeout_cost=10,success_reward=1.
    #[arg(long, value_name = "SPEC", value_parser = crate::args::budget)]
    pub policy: BudgetSpec,
    /// Replay only this dependency's events (a trace the proxy recorded holds every
    /// dependency's, each line tagged with `"dependency"`). Needed when the trace holds more
    /// than one.
    #[arg(long, value_name = "NAME")]
    pub dependency: Option<String>,
    /// The trace (JSON lines); `-` or nothing reads standard input.
    #[arg(value_name = "FILE")]
    pub file: Option<PathBuf>,
}

/// One trace line, read.
#[derive(Debug, Deserialize)]
pub(crate) struct Event {
    pub(crate) t_ms: u64,
    op: String,
    #[serde(default)]
    dependency: Option<String>,
    #[serde(default)]
    id: Option<Value>,
    #[serde(default)]
    kind: Option<String>,
    #[serde(default)]
    retry: Option<bool>,
    #[serde(default)]
    n: Option<u64>,
    #[serde(default)]
    retries: Option<u64>,
    /// What the recorded run decided for a `retry` (record mode writes it).
    #[serde(default)]
    allowed_here: Option<bool>,
    /// Why the recorded run refused a `retry`.
    #[serde(default)]
    denied: Option<String>,
}

/// The original request an event belongs to.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum Key {
    /// Named by `id` (a number and its text are the same request).
    Id(String),
    /// A `request` without an id, named by its line.
    Line(u64),
    /// Events before any `request`.
    Implicit,
}

/// One retry asked for a request.
#[derive(Debug)]
struct Ask {
    /// The replayed policy's permit, when it allowed the retry.
    permit: Option<RetryPermit>,
    /// A `retry_done` is still expected for it: the trace sent it (`allowed_here`), or, in a
    /// trace that does not say, this policy allowed it.
    open: bool,
}

/// What one original request holds: its open retries, and the last one granted (for a quota
/// refund).
#[derive(Debug, Default)]
struct Request {
    asks: Vec<Ask>,
    /// The request has succeeded: once no retry is open, it is forgotten.
    ended: bool,
}

impl Request {
    fn open(&self) -> bool {
        self.asks.iter().any(|a| a.open)
    }

    /// Keeps the open retries and the last granted one; the rest can no longer matter.
    fn prune(&mut self) {
        let last = self.asks.iter().rposition(|a| a.permit.is_some());
        let mut i = 0;
        self.asks.retain(|a| {
            let keep = a.open || Some(i) == last;
            i += 1;
            keep
        });
    }
}

/// Retries asked, and what the replayed policy and the recorded run decided.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Summary {
    /// `retry` events replayed.
    pub asked: u64,
    /// Allowed by the replayed policy.
    pub allowed: u64,
    /// Denied by the replayed policy (its only reason is the budget).
    pub denied_budget: u64,
    /// Retries the trace says the recorded run sent (`"allowed_here": true`).
    pub recorded_allowed: u64,
    /// Retries the trace says the recorded run refused, by reason (`"denied"`; `unknown`
    /// when a refusal names none).
    pub recorded_denied: BTreeMap<String, u64>,
    /// `retry_done` events that matched no open retry.
    pub unmatched_done: u64,
}

impl fmt::Display for Summary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} retries asked: {} allowed, {} denied (budget {})",
            self.asked,
            self.allowed,
            self.asked - self.allowed,
            self.denied_budget
        )?;
        let denied: u64 = self.recorded_denied.values().sum();
        if self.recorded_allowed + denied > 0 {
            let reasons: Vec<String> =
                self.recorded_denied.iter().map(|(r, n)| format!("{r} {n}")).collect();
            write!(f, "; as recorded: {} allowed, {denied} denied", self.recorded_allowed)?;
            if !reasons.is_empty() {
                write!(f, " ({})", reasons.join(", "))?;
            }
        }
        Ok(())
    }
}

/// The replay state over one policy.
#[derive(Debug)]
pub struct Replay<B> {
    budget: B,
    requests: HashMap<Key, Request>,
    current: Key,
    /// Requests granted a retry since the last `active` (whose permits that snapshot absorbs).
    since_active: Vec<Key>,
    last_t_ms: u64,
    /// What was asked and decided so far.
    pub summary: Summary,
    /// Only this dependency's events are replayed (`None`: the trace must hold one).
    only: Option<String>,
    /// The dependency the events replayed so far belong to.
    seen: Option<String>,
}

/// Why a trace line cannot be replayed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BadEvent {
    /// Not a JSON event.
    #[error("not a valid event: {0}")]
    NotJson(#[from] serde_json::Error),
    /// Events of two dependencies, and no `--dependency` to choose one.
    #[error(
        "the trace holds more than one dependency ({seen:?}, {other:?}): choose one with --dependency"
    )]
    SeveralDependencies {
        /// The dependency of the events so far.
        seen: String,
        /// Another one.
        other: String,
    },
    /// Time went backwards.
    #[error("t_ms {t_ms} is earlier than the previous event's {previous}; t_ms must not decrease")]
    TimeBackwards {
        /// This event's time.
        t_ms: u64,
        /// The previous event's.
        previous: u64,
    },
    /// An `id` that is neither a string nor a number.
    #[error("id must be a string or a number")]
    BadId,
    /// A `kind` that is not a failure kind.
    #[error("kind `{0}` is not error, timeout or throttle")]
    BadKind(String),
    /// An `active` without `n`.
    #[error("active needs \"n\" (requests in flight, pending included)")]
    ActiveWithoutN,
    /// An `active` whose retries exceed its requests.
    #[error("active: retries ({retries}) cannot exceed n ({n}), which includes them")]
    ActiveRetriesAboveN {
        /// Retries in flight.
        retries: u64,
        /// Requests in flight, retries included.
        n: u64,
    },
    /// An `op` replay does not know.
    #[error(
        "unknown op `{0}` (expected request, success, failure, retry, retry_done, active or balance)"
    )]
    UnknownOp(String),
}

/// Reads a `kind` field: error (default), timeout or throttle.
fn failure_kind(kind: Option<&str>) -> Result<FailureKind, BadEvent> {
    match kind {
        None | Some("error") => Ok(FailureKind::Error),
        Some("timeout") => Ok(FailureKind::Timeout),
        Some("throttle") => Ok(FailureKind::Throttle),
        Some(other) => Err(BadEvent::BadKind(other.to_string())),
    }
}

fn number(x: f64) -> Value {
    if x.fract() == 0.0 && x.abs() < 9.0e15 { Value::from(x as i64) } else { Value::from(x) }
}

impl<B: RetryBudget> Replay<B> {
    /// A replay over `budget`, at virtual time zero.
    pub fn new(budget: B) -> Replay<B> {
        Replay {
            budget,
            requests: HashMap::new(),
            current: Key::Implicit,
            since_active: Vec::new(),
            last_t_ms: 0,
            summary: Summary::default(),
            only: None,
            seen: None,
        }
    }

    /// Replays only the events tagged with this dependency (untagged events are replayed too).
    pub fn only(mut self, dependency: Option<String>) -> Replay<B> {
        self.only = dependency;
        self
    }

    /// The request an event belongs to: its `id`, or the most recent `request`.
    fn request_key(&self, id: &Option<Value>) -> Key {
        match id {
            Some(Value::String(s)) => Key::Id(s.clone()),
            Some(v) => Key::Id(v.to_string()),
            None => self.current.clone(),
        }
    }

    /// Forgets a request that has ended and has no retry open.
    fn forget_if_done(&mut self, key: &Key) {
        if self.requests.get(key).is_some_and(|r| r.ended && !r.open()) {
            self.requests.remove(key);
        }
    }

    /// Applies one input line; returns the output line, if the event has one.
    pub(crate) fn apply(&mut self, line: &str, line_no: u64) -> Result<Option<String>, BadEvent> {
        let ev: Event = serde_json::from_str(line)?;
        Ok(self.apply_event(&ev, line_no)?.map(|v| v.to_string()))
    }

    /// Applies one event, read from line `line_no` (several replays of one trace read each line
    /// once); returns the output, if the event has one.
    pub(crate) fn apply_event(
        &mut self,
        ev: &Event,
        line_no: u64,
    ) -> Result<Option<Value>, BadEvent> {
        if let Some(d) = &ev.dependency {
            match (&self.only, &self.seen) {
                (Some(only), _) if only != d => return Ok(None),
                (None, Some(seen)) if seen != d => {
                    return Err(BadEvent::SeveralDependencies {
                        seen: seen.clone(),
                        other: d.clone(),
                    });
                }
                _ => self.seen = Some(d.clone()),
            }
        }
        if ev.t_ms < self.last_t_ms {
            return Err(BadEvent::TimeBackwards { t_ms: ev.t_ms, previous: self.last_t_ms });
        }
        if matches!(ev.id, Some(Value::Array(_) | Value::Object(_) | Value::Null | Value::Bool(_)))
        {
            return Err(BadEvent::BadId);
        }
        self.last_t_ms = ev.t_ms;
        let now = Timestamp::from_millis(ev.t_ms);
        let kind = failure_kind(ev.kind.as_deref())?;
        let output = match ev.op.as_str() {
            "request" => {
                self.budget.record_request(now);
                // A request without an id is its own request, named by its line.
                self.current = match &ev.id {
                    Some(_) => self.request_key(&ev.id),
                    None => Key::Line(line_no),
                };
                None
            }
            "success" => {
                let retried = ev.retry.unwrap_or(false);
                let key = self.request_key(&ev.id);
                if let Some(req) = self.requests.get_mut(&key) {
                    if retried
                        && let Some(last) =
                            req.asks.iter_mut().rev().find_map(|a| a.permit.as_mut())
                    {
                        last.succeeded();
                    }
                    req.ended = true;
                }
                self.forget_if_done(&key);
                self.budget.record_outcome(now, Outcome::Success { retried });
                None
            }
            "failure" => {
                self.budget.record_outcome(now, Outcome::RetryableFailure(kind));
                None
            }
            "retry" => {
                let key = self.request_key(&ev.id);
                let permit = self.budget.try_retry(now, kind).ok();
                let allowed = permit.is_some();
                let s = &mut self.summary;
                s.asked += 1;
                if allowed {
                    s.allowed += 1;
                } else {
                    s.denied_budget += 1;
                }
                match (ev.allowed_here, &ev.denied) {
                    (Some(true), _) => s.recorded_allowed += 1,
                    (Some(false), reason) | (None, reason @ Some(_)) => {
                        let reason = reason.as_deref().unwrap_or("unknown");
                        *s.recorded_denied.entry(reason.to_string()).or_default() += 1;
                    }
                    (None, None) => {}
                }
                let open = ev.allowed_here.unwrap_or(allowed);
                if allowed || open {
                    // Only a concurrency permit counts in flight; the next snapshot absorbs it.
                    if permit.as_ref().is_some_and(RetryPermit::is_in_flight) {
                        self.since_active.push(key.clone());
                    }
                    let req = self.requests.entry(key).or_default();
                    req.asks.push(Ask { permit, open });
                    req.ended = false;
                    req.prune();
                }
                Some(serde_json::json!({"t_ms": ev.t_ms, "op": "retry", "allowed": allowed}))
            }
            "retry_done" => {
                let key = self.request_key(&ev.id);
                let ask = self
                    .requests
                    .get_mut(&key)
                    .and_then(|req| req.asks.iter_mut().rev().find(|a| a.open));
                match ask {
                    Some(ask) => {
                        ask.open = false;
                        if let Some(p) = ask.permit.as_mut() {
                            p.finish();
                        }
                        if let Some(req) = self.requests.get_mut(&key) {
                            req.prune();
                        }
                        self.forget_if_done(&key);
                    }
                    None => self.summary.unmatched_done += 1,
                }
                None
            }
            "active" => {
                let n = ev.n.ok_or(BadEvent::ActiveWithoutN)?;
                let retries = ev.retries.unwrap_or(0);
                if retries > n {
                    return Err(BadEvent::ActiveRetriesAboveN { retries, n });
                }
                // The snapshot already counts the retries granted before it: they stop
                // counting on their own (their `retry_done` still closes them).
                for key in self.since_active.drain(..) {
                    if let Some(req) = self.requests.get_mut(&key) {
                        for p in req.asks.iter_mut().filter_map(|a| a.permit.as_mut()) {
                            p.finish();
                        }
                    }
                }
                self.budget.set_active(n, retries);
                None
            }
            "balance" => {
                let value = number(self.budget.snapshot(now).balance);
                Some(serde_json::json!({"t_ms": ev.t_ms, "op": "balance", "value": value}))
            }
            other => {
                return Err(BadEvent::UnknownOp(other.to_string()));
            }
        };
        Ok(output)
    }
}

/// Runs `stormguard replay`.
pub fn run(args: &ReplayArgs, out: &mut dyn Write) -> Result<(), Failure> {
    let budget = args.policy.build().map_err(|e| Failure::usage(format!("--policy: {e}")))?;
    // A trace is a stream: a regular file or a pipe, read a line at a time, each line at most
    // 1 MiB (a directory or a device such as /dev/zero is refused).
    let (mut input, name): (Box<dyn BufRead>, String) = match &args.file {
        None => (Box::new(std::io::stdin().lock()), "<stdin>".into()),
        Some(p) if p.as_os_str() == "-" => (Box::new(std::io::stdin().lock()), "<stdin>".into()),
        Some(p) => {
            let f = stormguard_input::open_stream(p)
                .map_err(|e| Failure::usage(format!("cannot read {}: {e}", p.display())))?;
            (Box::new(BufReader::new(f)), p.display().to_string())
        }
    };
    let mut replay = Replay::new(budget).only(args.dependency.clone());
    let mut bytes = Vec::new();
    for line_no in 1.. {
        let read = stormguard_input::read_line(&mut input, &mut bytes, stormguard_input::MAX_LINE)
            .map_err(|e| Failure::usage(format!("{name}: line {line_no}: {e}")))?;
        if read == 0 {
            break;
        }
        let line = std::str::from_utf8(&bytes)
            .map_err(|e| Failure::usage(format!("{name}: line {line_no}: not UTF-8 text ({e})")))?
            .trim_end_matches(['\n', '\r']);
        if line.trim().is_empty() {
            continue;
        }
        match replay.apply(line, line_no) {
            Ok(Some(text)) => writeln!(out, "{text}")?,
            Ok(None) => {}
            Err(reason) => return Err(Failure::usage(format!("{name}: line {line_no}: {reason}"))),
        }
    }
    if let (Some(only), None) = (&replay.only, &replay.seen) {
        return Err(Failure::usage(format!("{name}: no event is tagged with dependency {only:?}")));
    }
    eprintln!("stormguard replay: {name}: {}", replay.summary);
    if replay.summary.unmatched_done > 0 {
        eprintln!(
            "stormguard: {name}: {} retry_done event(s) matched no retry in flight and were ignored",
            replay.summary.unmatched_done
        );
    }
    Ok(())
}
