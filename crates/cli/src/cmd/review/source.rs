//! Where a review's history comes from: a Prometheus server's range queries (the metric names of
//! stormguard, Envoy, or a mapping file's), or a trace `stormguard proxy --record` wrote.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde::Deserialize;
use serde_json::Value;
use stormguard_core::review::{History, Step};

use crate::Failure;

/// The queries that read one system's metrics, by `label` (the dependency, cluster or route).
/// `originals` (or `attempts`), `retries` and `shed` select **counters** (totals since each
/// process started), one series per process, unsummed: the review reads each series at every
/// step's end, takes the differences (a series that went down restarted), and only then sums
/// them by the label — so every increment counts once and in its step, and a pod that goes away
/// takes nothing with it (`increase()` over windows as short as a step would see only the
/// samples inside each and extrapolate the rest). `in_flight` and `cap` are gauges, read per
/// step, grouped by the label, with `$step` for the step's length.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Mapping {
    /// The label that names a dependency.
    pub label: String,
    /// Original requests (a counter).
    #[serde(default)]
    pub originals: Option<String>,
    /// Every attempt, retries included (a counter): originals are attempts less retries. One of
    /// `originals` and `attempts` is needed.
    #[serde(default)]
    pub attempts: Option<String>,
    /// Retries sent (a counter).
    pub retries: String,
    /// Retries a budget refused (a counter; optional).
    #[serde(default)]
    pub shed: Option<String>,
    /// The most in flight at the dependency in a step (optional).
    #[serde(default)]
    pub in_flight: Option<String>,
    /// The cap (optional; `--cap` overrides).
    #[serde(default)]
    pub cap: Option<String>,
}

impl Mapping {
    /// stormguard's own metrics (the proxy's, and any in-process placement's
    /// `metrics::register`).
    pub fn stormguard() -> Mapping {
        Mapping {
            label: "dependency".into(),
            originals: Some("stormguard_requests_total".into()),
            attempts: None,
            retries: "stormguard_retries_total".into(),
            shed: Some("stormguard_denied_total{reason=\"budget\"}".into()),
            in_flight: Some(
                "max by (dependency) (max_over_time(stormguard_in_flight_max[$step]))".into(),
            ),
            cap: Some("max by (dependency) (stormguard_cap)".into()),
        }
    }

    /// Envoy's cluster statistics (`/stats/prometheus`): every upstream request counts in
    /// `upstream_rq_total`, retries in `upstream_rq_retry`, retries its budget or circuit
    /// breaker refused in `upstream_rq_retry_overflow`; the cap is the circuit breaker's
    /// `max_requests`, read as `remaining_rq + rq_active` (with `track_remaining: true`).
    pub fn envoy() -> Mapping {
        Mapping {
            label: "envoy_cluster_name".into(),
            originals: None,
            attempts: Some("envoy_cluster_upstream_rq_total".into()),
            retries: "envoy_cluster_upstream_rq_retry".into(),
            shed: Some("envoy_cluster_upstream_rq_retry_overflow".into()),
            in_flight: Some(
                "max by (envoy_cluster_name) (max_over_time(envoy_cluster_upstream_rq_active[$step]))"
                    .into(),
            ),
            cap: Some(
                "max by (envoy_cluster_name) (envoy_cluster_circuit_breakers_default_remaining_rq + envoy_cluster_upstream_rq_active)"
                    .into(),
            ),
        }
    }

    /// Linkerd 2.16's route metrics, by the names its own `linkerd viz` CLI queries:
    /// `outbound_http_route_request_statuses_total` (the route's requests, each counted once
    /// whatever its retries), `outbound_http_route_retry_requests_total`, and
    /// `outbound_http_route_retry_overflow_total` (retries its budget refused), by `route_name`.
    /// Linkerd exports no in-flight or cap for a route: give `--cap`.
    pub fn linkerd() -> Mapping {
        Mapping {
            label: "route_name".into(),
            originals: Some("outbound_http_route_request_statuses_total".into()),
            attempts: None,
            retries: "outbound_http_route_retry_requests_total".into(),
            shed: Some("outbound_http_route_retry_overflow_total".into()),
            in_flight: None,
            cap: None,
        }
    }

    /// A mapping file (TOML: `label`, `originals`, `retries`, and optionally `shed`,
    /// `in_flight`, `cap`).
    pub fn load(path: &Path) -> Result<Mapping, Failure> {
        let m: Mapping = stormguard_config::load(path, |doc| doc.deserialize())
            .map_err(|e| Failure::usage(e.to_string()))?;
        if m.originals.is_none() && m.attempts.is_none() {
            return Err(Failure::usage(format!(
                "{}: originals: give the original requests' counter (or attempts: every attempt's)",
                path.display()
            )));
        }
        Ok(m)
    }
}

/// A range to query: from `start` to `end` (Unix seconds) in steps of `step`.
#[derive(Debug, Clone, Copy)]
pub struct Range {
    /// The first step's end.
    pub start: f64,
    /// The last step's end.
    pub end: f64,
    /// The step.
    pub step: Duration,
}

/// Every dependency's history from a Prometheus server at `base` (`http://host:port`).
pub fn prometheus(
    base: &str,
    mapping: &Mapping,
    range: Range,
) -> Result<BTreeMap<String, History>, Failure> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| Failure::runtime(format!("could not start the runtime: {e}")))?;
    runtime.block_on(async {
        let client = Client::builder(TokioExecutor::new()).build_http::<Empty<Bytes>>();
        let step_text = format!("{}s", range.step.as_secs_f64());
        let secs = range.step.as_secs_f64();
        let query = |q: &str, range: Range| {
            let q = q.replace("$step", &step_text);
            query_range(&client, base, q, range)
        };
        // Counters from one step earlier: the first step's difference needs its start.
        let counters = Range { start: range.start - secs, ..range };
        let label = |m: &Value| m[&mapping.label].as_str().unwrap_or("").to_string();
        let counted = |series| summed(differences(series), &label);
        let retries = counted(query(&mapping.retries, counters).await?);
        let originals = match (&mapping.originals, &mapping.attempts) {
            (Some(q), _) => counted(query(q, counters).await?),
            (None, Some(q)) => {
                let mut attempts = counted(query(q, counters).await?);
                for (name, points) in &mut attempts {
                    for (t, v) in points.iter_mut() {
                        *v -= retries.get(name).and_then(|r| r.get(t)).copied().unwrap_or(0.0);
                    }
                }
                attempts
            }
            (None, None) => {
                return Err(Failure::usage("the mapping names no originals or attempts"));
            }
        };
        let shed = match &mapping.shed {
            Some(q) => counted(query(q, counters).await?),
            None => BTreeMap::new(),
        };
        let query = |q: &str| query(q, range);
        let in_flight = match &mapping.in_flight {
            Some(q) => query(q).await?,
            None => Vec::new(),
        };
        let cap = match &mapping.cap {
            Some(q) => query(q).await?,
            None => Vec::new(),
        };
        let mut out: BTreeMap<String, History> = BTreeMap::new();
        for (name, points) in &originals {
            let steps = points
                .iter()
                .map(|(t, v)| {
                    let at = *t as f64 / 1000.0 - secs;
                    let get = |m: &BTreeMap<String, BTreeMap<i64, f64>>| {
                        m.get(name).and_then(|p| p.get(t)).copied().unwrap_or(0.0).max(0.0)
                    };
                    Step {
                        at,
                        originals: v.max(0.0),
                        retries: get(&retries),
                        shed: get(&shed),
                        in_flight: None,
                    }
                })
                .collect();
            out.insert(name.clone(), History { step: range.step, steps, cap: None });
        }
        for (metric, values) in &in_flight {
            let Some(h) = out.get_mut(&label(metric)) else { continue };
            for (t, v) in values {
                let at = t - secs;
                if let Some(s) = h.steps.iter_mut().find(|s| (s.at - at).abs() < secs / 2.0) {
                    s.in_flight = Some(v.max(0.0));
                }
            }
        }
        // The median of the cap's points: Envoy's two gauges behind it are not read at one
        // instant, and their sum strays by one now and then.
        for (metric, values) in &cap {
            if let Some(h) = out.get_mut(&label(metric)) {
                let mut v: Vec<f64> = values.iter().map(|(_, v)| *v).collect();
                v.sort_by(f64::total_cmp);
                h.cap = v.get(v.len() / 2).copied();
            }
        }
        Ok(out)
    })
}

/// A counter's points as what it counted in each step: `(step's end, increment)`, the step
/// being the span since the point before (a point lower than the one before is a restart: the
/// increment is its whole value).
fn differences(series: Vec<(Value, Vec<(f64, f64)>)>) -> Vec<(Value, Vec<(f64, f64)>)> {
    series
        .into_iter()
        .map(|(metric, points)| {
            let diffs = points
                .windows(2)
                .map(|w| {
                    let (prev, (t, v)) = (w[0].1, w[1]);
                    (t, if v >= prev { v - prev } else { v })
                })
                .collect();
            (metric, diffs)
        })
        .collect()
}

/// Series summed by their `label`: per name, per step's end (milliseconds), the total.
fn summed(
    series: Vec<(Value, Vec<(f64, f64)>)>,
    label: &dyn Fn(&Value) -> String,
) -> BTreeMap<String, BTreeMap<i64, f64>> {
    let mut out: BTreeMap<String, BTreeMap<i64, f64>> = BTreeMap::new();
    for (metric, points) in series {
        let by_time = out.entry(label(&metric)).or_default();
        for (t, v) in points {
            *by_time.entry((t * 1000.0).round() as i64).or_default() += v;
        }
    }
    out
}

/// One range query's series: each one's labels and its `(time, value)` points.
async fn query_range(
    client: &Client<hyper_util::client::legacy::connect::HttpConnector, Empty<Bytes>>,
    base: &str,
    query: String,
    range: Range,
) -> Result<Vec<(Value, Vec<(f64, f64)>)>, Failure> {
    let uri = format!(
        "{}/api/v1/query_range?query={}&start={}&end={}&step={}",
        base.trim_end_matches('/'),
        encode(&query),
        range.start,
        range.end,
        range.step.as_secs_f64()
    );
    let uri: http::Uri =
        uri.parse().map_err(|e| Failure::usage(format!("--prometheus {base}: {e}")))?;
    let resp = client
        .get(uri)
        .await
        .map_err(|e| Failure::usage(format!("could not reach Prometheus at {base}: {e}")))?;
    let status = resp.status();
    let body = resp
        .into_body()
        .collect()
        .await
        .map_err(|e| Failure::runtime(format!("reading Prometheus's answer: {e}")))?
        .to_bytes();
    let v: Value = serde_json::from_slice(&body).map_err(|e| {
        Failure::runtime(format!("Prometheus answered {status} with no JSON ({e}) to `{query}`"))
    })?;
    if v["status"] != "success" {
        return Err(Failure::usage(format!(
            "Prometheus refused `{query}`: {}",
            v["error"].as_str().unwrap_or("no reason given")
        )));
    }
    let mut series = Vec::new();
    for s in v["data"]["result"].as_array().into_iter().flatten() {
        let points = s["values"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|p| {
                let t = p[0].as_f64()?;
                let v: f64 = p[1].as_str()?.parse().ok()?;
                v.is_finite().then_some((t, v))
            })
            .collect();
        series.push((s["metric"].clone(), points));
    }
    Ok(series)
}

/// Percent-encodes a query parameter (everything but RFC 3986's unreserved characters).
fn encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len() * 3);
    for b in s.bytes() {
        match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => {
                out.push(b as char)
            }
            _ => out.push_str(&format!("%{b:02X}")),
        }
    }
    out
}

/// Calls `each` with every non-blank line of the trace at `path` and its number (from 1), the
/// line without its end; stops at the first error either gives.
fn each_line(
    path: &Path,
    mut each: impl FnMut(&str, u64) -> Result<(), Failure>,
) -> Result<(), Failure> {
    let read_error = |e: std::io::Error| Failure::usage(format!("{}: {e}", path.display()));
    let file = stormguard_input::open_stream(path).map_err(read_error)?;
    let mut reader = std::io::BufReader::new(file);
    let mut buf = Vec::new();
    for n in 1.. {
        let read = stormguard_input::read_line(&mut reader, &mut buf, stormguard_input::MAX_LINE)
            .map_err(read_error)?;
        if read == 0 {
            return Ok(());
        }
        let line = String::from_utf8_lossy(&buf);
        let line = line.trim_end_matches(['\n', '\r']);
        if !line.trim().is_empty() {
            each(line, n)?;
        }
    }
    Ok(())
}

/// The retries each of `specs` allows in each step of a trace's `dependency` (`steps` of them),
/// its policy run over the recorded events by `stormguard replay`'s machinery: one reading of
/// the trace, each line read once and applied to every candidate's policy.
pub fn replay(
    path: &Path,
    dependency: &str,
    step: Duration,
    specs: &[String],
    steps: usize,
) -> Result<Vec<Vec<f64>>, Failure> {
    let mut replays = specs
        .iter()
        .map(|spec| {
            let budget: stormguard_core::budget::BudgetSpec =
                spec.parse().map_err(|e| Failure::runtime(format!("candidate {spec}: {e}")))?;
            let budget =
                budget.build().map_err(|e| Failure::runtime(format!("candidate {spec}: {e}")))?;
            Ok(crate::cmd::replay::Replay::new(budget).only(Some(dependency.to_string())))
        })
        .collect::<Result<Vec<_>, Failure>>()?;
    let mut allowed = vec![vec![0.0; steps]; specs.len()];
    let secs = step.as_secs_f64();
    let bad =
        |n: u64, e: &dyn std::fmt::Display| Failure::usage(format!("{}:{n}: {e}", path.display()));
    each_line(path, |line, n| {
        let ev: crate::cmd::replay::Event = serde_json::from_str(line)
            .map_err(|e| bad(n, &crate::cmd::replay::BadEvent::from(e)))?;
        let k = ((ev.t_ms as f64 / 1000.0) / secs) as usize;
        for (replay, allowed) in replays.iter_mut().zip(&mut allowed) {
            let before = replay.summary.allowed;
            replay.apply_event(&ev, n).map_err(|e| bad(n, &e))?;
            if replay.summary.allowed > before
                && let Some(a) = allowed.get_mut(k)
            {
                *a += 1.0;
            }
        }
        Ok(())
    })?;
    Ok(allowed)
}

/// Every dependency's history from a recorded trace (`stormguard proxy --record`): per step,
/// the `request` events (originals), the `retry` events sent (`allowed_here`) and refused by
/// the budget (`denied: budget`), and the most `active.n` (in flight, as snapshot before each
/// retry's ask). Times count from each dependency's first event.
pub fn trace(path: &Path, step: Duration) -> Result<BTreeMap<String, History>, Failure> {
    let secs = step.as_secs_f64();
    let mut out: BTreeMap<String, History> = BTreeMap::new();
    each_line(path, |line, n| {
        let v: Value = serde_json::from_str(line)
            .map_err(|e| Failure::usage(format!("{}:{n}: not a JSON line: {e}", path.display())))?;
        let (Some(t_ms), Some(op)) = (v["t_ms"].as_u64(), v["op"].as_str()) else {
            return Err(Failure::usage(format!(
                "{}:{n}: a trace line needs `t_ms` and `op`",
                path.display()
            )));
        };
        let dependency = v["dependency"].as_str().unwrap_or("").to_string();
        let h =
            out.entry(dependency).or_insert_with(|| History { step, steps: Vec::new(), cap: None });
        let k = ((t_ms as f64 / 1000.0) / secs) as usize;
        while h.steps.len() <= k {
            let at = h.steps.len() as f64 * secs;
            h.steps.push(Step { at, ..Step::default() });
        }
        let s = &mut h.steps[k];
        match op {
            "request" => s.originals += 1.0,
            "retry" if v["allowed_here"].as_bool() == Some(true) => s.retries += 1.0,
            "retry" if v["denied"].as_str() == Some("budget") => s.shed += 1.0,
            "active" => {
                let n = v["n"].as_f64().unwrap_or(0.0);
                s.in_flight = Some(s.in_flight.map_or(n, |m| m.max(n)));
            }
            _ => {}
        }
        Ok(())
    })?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two pods' counters; the second goes away after its third point, and the first restarts.
    /// Differenced per series before the sum, neither shows as a step of thousands.
    #[test]
    fn a_pod_that_goes_away_or_restarts_adds_nothing_it_did_not_count() {
        let pod = |name: &str| serde_json::json!({"dependency": "payments", "pod": name});
        let series = vec![
            (pod("a"), vec![(10.0, 1000.0), (12.0, 1010.0), (14.0, 3.0), (16.0, 13.0)]),
            (pod("b"), vec![(10.0, 5000.0), (12.0, 5010.0), (14.0, 5020.0)]),
        ];
        let label = |m: &Value| m["dependency"].as_str().unwrap().to_string();
        let steps = &summed(differences(series), &label)["payments"];
        let got: Vec<(i64, f64)> = steps.iter().map(|(t, v)| (*t, *v)).collect();
        // 12 s: 10 + 10; 14 s: a restarted (3) + b's 10; 16 s: a's 10, b gone.
        assert_eq!(got, vec![(12_000, 20.0), (14_000, 13.0), (16_000, 10.0)]);
    }
}
