//! `stormguard replay`: run a trace of events through one budget policy on a virtual clock.
//!
//! The input is JSON lines, each with `t_ms` (virtual milliseconds, non-decreasing), `op`, and
//! an optional `id` naming the original request the event belongs to (when absent, the most
//! recent `request`). Output is one JSON line per `retry` and per `balance`. The proxy's record
//! mode writes this format, so an incident can be replayed against candidate budgets.
//!
//! Choices the contract leaves open, made the way a budget behaves in production:
//! - a `retry_done` ends the most recent unfinished retry of its request; one that matches no
//!   retry in flight is counted and reported on stderr, never silently dropped;
//! - a `success` with `"retry": true` lets a quota refund the last retry granted for that
//!   request; it does not end the retry's concurrency count (only `retry_done` does);
//! - blank lines are skipped; unknown fields are ignored (newer recorders may add some).

use std::collections::HashMap;
use std::fs::File;
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
  {\"t_ms\":9,\"op\":\"active\",\"n\":10,\"retries\":1} requests and retries in flight now
  {\"t_ms\":9,\"op\":\"balance\"}                    print what the policy holds now
Output: {\"t_ms\":5,\"op\":\"retry\",\"allowed\":true} and {\"t_ms\":9,\"op\":\"balance\",\"value\":3}

Example:
  stormguard replay --policy ratio:percent=0.2,min_per_sec=10,ttl=10s trace.jsonl")]
pub struct ReplayArgs {
    /// The policy: KIND:key=value,... e.g. ratio:percent=0.2,min_per_sec=10,ttl=10s,
    /// concurrency:percent=0.2,min=3, token-bucket:max_tokens=10,token_ratio=0.1,
    /// quota:capacity=500,retry_cost=5,timeout_cost=10,success_reward=1.
    #[arg(long, value_name = "SPEC")]
    pub policy: String,
    /// Replay only this dependency's events (a trace the proxy recorded holds every
    /// dependency's, each line tagged with `"dependency"`). Needed when the trace holds more
    /// than one.
    #[arg(long, value_name = "NAME")]
    pub dependency: Option<String>,
    /// The trace (JSON lines); `-` or nothing reads standard input.
    #[arg(value_name = "FILE")]
    pub file: Option<PathBuf>,
}

#[derive(Debug, Deserialize)]
struct Event {
    t_ms: u64,
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
}

/// What one original request holds: its granted retries, unfinished ones counting in flight.
#[derive(Debug, Default)]
struct Request {
    permits: Vec<RetryPermit>,
}

/// The replay state over one policy.
#[derive(Debug)]
pub struct Replay<B> {
    budget: B,
    requests: HashMap<String, Request>,
    current: Option<String>,
    last_t_ms: u64,
    /// `retry_done` events that matched no retry in flight.
    pub unmatched_done: u64,
    /// Only this dependency's events are replayed (`None`: the trace must hold one).
    only: Option<String>,
    /// The dependency the events replayed so far belong to.
    seen: Option<String>,
}

/// Reads a `kind` field: error (default), timeout or throttle.
fn failure_kind(kind: Option<&str>) -> Result<FailureKind, String> {
    match kind {
        None | Some("error") => Ok(FailureKind::Error),
        Some("timeout") => Ok(FailureKind::Timeout),
        Some("throttle") => Ok(FailureKind::Throttle),
        Some(other) => Err(format!("kind `{other}` is not error, timeout or throttle")),
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
            current: None,
            last_t_ms: 0,
            unmatched_done: 0,
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
    fn request_key(&self, id: &Option<Value>) -> Option<String> {
        match id {
            Some(Value::String(s)) => Some(s.clone()),
            Some(v) => Some(v.to_string()),
            None => self.current.clone(),
        }
    }

    /// Applies one input line; returns the output line, if the event has one.
    pub fn apply(&mut self, line: &str, line_no: u64) -> Result<Option<String>, String> {
        let ev: Event =
            serde_json::from_str(line).map_err(|e| format!("not a valid event: {e}"))?;
        if let Some(d) = &ev.dependency {
            match (&self.only, &self.seen) {
                (Some(only), _) if only != d => return Ok(None),
                (None, Some(seen)) if seen != d => {
                    return Err(format!(
                        "the trace holds more than one dependency ({seen:?}, {d:?}): choose one \
                         with --dependency"
                    ));
                }
                _ => self.seen = Some(d.clone()),
            }
        }
        if ev.t_ms < self.last_t_ms {
            return Err(format!(
                "t_ms {} is earlier than the previous event's {}; t_ms must not decrease",
                ev.t_ms, self.last_t_ms
            ));
        }
        if matches!(ev.id, Some(Value::Array(_) | Value::Object(_) | Value::Null | Value::Bool(_)))
        {
            return Err("id must be a string or a number".into());
        }
        self.last_t_ms = ev.t_ms;
        let now = Timestamp::from_millis(ev.t_ms);
        let kind = failure_kind(ev.kind.as_deref())?;
        let output = match ev.op.as_str() {
            "request" => {
                self.budget.record_request(now);
                // A request without an id is its own request, named by its line.
                let key = self.request_key(&ev.id).filter(|_| ev.id.is_some());
                self.current = Some(key.unwrap_or_else(|| format!("#line{line_no}")));
                None
            }
            "success" => {
                let retried = ev.retry.unwrap_or(false);
                let key = self.request_key(&ev.id);
                if let Some(key) = key {
                    let finished = match self.requests.get_mut(&key) {
                        Some(req) => {
                            if retried && let Some(last) = req.permits.last_mut() {
                                last.succeeded();
                            }
                            req.permits.iter().all(|p| !p.is_in_flight())
                        }
                        None => false,
                    };
                    // The request is over; keep only retries still in flight.
                    if finished {
                        self.requests.remove(&key);
                    }
                }
                self.budget.record_outcome(now, Outcome::Success { retried });
                None
            }
            "failure" => {
                self.budget.record_outcome(now, Outcome::RetryableFailure(kind));
                None
            }
            "retry" => {
                let allowed = match self.budget.try_retry(now, kind) {
                    Ok(permit) => {
                        let key = self.request_key(&ev.id).unwrap_or_default();
                        let req = self.requests.entry(key).or_default();
                        // Finished retries are kept only as the last one, for a quota refund.
                        req.permits.retain(RetryPermit::is_in_flight);
                        req.permits.push(permit);
                        true
                    }
                    Err(_) => false,
                };
                Some(serde_json::json!({"t_ms": ev.t_ms, "op": "retry", "allowed": allowed}))
            }
            "retry_done" => {
                let key = self.request_key(&ev.id).unwrap_or_default();
                let done = self
                    .requests
                    .get_mut(&key)
                    .and_then(|req| req.permits.iter_mut().rev().find(|p| p.is_in_flight()))
                    .map(RetryPermit::finish);
                if done.is_none() {
                    self.unmatched_done += 1;
                }
                None
            }
            "active" => {
                let n = ev.n.ok_or("active needs \"n\" (requests in flight, pending included)")?;
                self.budget.set_active(n, ev.retries.unwrap_or(0));
                None
            }
            "balance" => {
                let value = number(self.budget.snapshot(now).balance);
                Some(serde_json::json!({"t_ms": ev.t_ms, "op": "balance", "value": value}))
            }
            other => {
                return Err(format!(
                    "unknown op `{other}` (expected request, success, failure, retry, retry_done, \
                     active or balance)"
                ));
            }
        };
        Ok(output.map(|v| v.to_string()))
    }
}

/// Runs `stormguard replay`.
pub fn run(args: &ReplayArgs, out: &mut dyn Write) -> Result<(), Failure> {
    let spec = BudgetSpec::parse(&args.policy)
        .map_err(|e| Failure::usage(format!("--policy `{}`: {e}", args.policy)))?;
    let budget = spec.build().map_err(|e| Failure::usage(format!("--policy: {e}")))?;
    let (input, name): (Box<dyn BufRead>, String) = match &args.file {
        None => (Box::new(std::io::stdin().lock()), "<stdin>".into()),
        Some(p) if p.as_os_str() == "-" => (Box::new(std::io::stdin().lock()), "<stdin>".into()),
        Some(p) => {
            let f = File::open(p)
                .map_err(|e| Failure::usage(format!("cannot read {}: {e}", p.display())))?;
            (Box::new(BufReader::new(f)), p.display().to_string())
        }
    };
    let mut replay = Replay::new(budget).only(args.dependency.clone());
    for (i, line) in input.lines().enumerate() {
        let line_no = i as u64 + 1;
        let line = line.map_err(|e| Failure::usage(format!("{name}: line {line_no}: {e}")))?;
        if line.trim().is_empty() {
            continue;
        }
        match replay.apply(&line, line_no) {
            Ok(Some(text)) => writeln!(out, "{text}")?,
            Ok(None) => {}
            Err(reason) => return Err(Failure::usage(format!("{name}: line {line_no}: {reason}"))),
        }
    }
    if let (Some(only), None) = (&replay.only, &replay.seen) {
        return Err(Failure::usage(format!("{name}: no event is tagged with dependency {only:?}")));
    }
    if replay.unmatched_done > 0 {
        eprintln!(
            "stormguard: {name}: {} retry_done event(s) matched no retry in flight and were ignored",
            replay.unmatched_done
        );
    }
    Ok(())
}
