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

/// The queries that read one system's metrics, each grouped by `label` (the dependency, cluster
/// or route). `originals`, `retries` and `shed` are **counters** (totals since the process
/// started): the review reads each at every step's end and takes the differences (a counter that
/// went down restarted), so every increment counts once and in its step — `increase()` over
/// short windows would see only the samples inside each window and extrapolate the rest.
/// `in_flight` and `cap` are gauges, read per step, with `$step` for the step's length.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Mapping {
    /// The label that names a dependency.
    pub label: String,
    /// Original requests per step.
    pub originals: String,
    /// Retries sent per step.
    pub retries: String,
    /// Retries a budget refused per step (optional).
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
            originals: "sum by (dependency) (stormguard_requests_total)".into(),
            retries: "sum by (dependency) (stormguard_retries_total)".into(),
            shed: Some("sum by (dependency) (stormguard_denied_total{reason=\"budget\"})".into()),
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
        let by = "sum by (envoy_cluster_name)";
        Mapping {
            label: "envoy_cluster_name".into(),
            originals: format!(
                "{by} (envoy_cluster_upstream_rq_total) - {by} (envoy_cluster_upstream_rq_retry)"
            ),
            retries: format!("{by} (envoy_cluster_upstream_rq_retry)"),
            shed: Some(format!("{by} (envoy_cluster_upstream_rq_retry_overflow)")),
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

    /// A mapping file (TOML: `label`, `originals`, `retries`, and optionally `shed`,
    /// `in_flight`, `cap`).
    pub fn load(path: &Path) -> Result<Mapping, Failure> {
        stormguard_config::load(path, |doc| doc.deserialize())
            .map_err(|e| Failure::usage(e.to_string()))
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
        let originals = differences(query(&mapping.originals, counters).await?);
        let retries = differences(query(&mapping.retries, counters).await?);
        let shed = match &mapping.shed {
            Some(q) => differences(query(q, counters).await?),
            None => Vec::new(),
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
        let label = |m: &Value| m[&mapping.label].as_str().unwrap_or("").to_string();
        for (metric, values) in &originals {
            let name = label(metric);
            let steps = values
                .iter()
                .map(|(t, v)| Step { at: t - secs, originals: v.max(0.0), ..Step::default() })
                .collect();
            out.insert(name, History { step: range.step, steps, cap: None });
        }
        let mut fill = |series: &[(Value, Vec<(f64, f64)>)], f: &dyn Fn(&mut Step, f64)| {
            for (metric, values) in series {
                let Some(h) = out.get_mut(&label(metric)) else { continue };
                for (t, v) in values {
                    let at = t - secs;
                    if let Some(s) = h.steps.iter_mut().find(|s| (s.at - at).abs() < secs / 2.0) {
                        f(s, *v);
                    }
                }
            }
        };
        fill(&retries, &|s, v| s.retries = v.max(0.0));
        fill(&shed, &|s, v| s.shed = v.max(0.0));
        fill(&in_flight, &|s, v| s.in_flight = Some(v.max(0.0)));
        for (metric, values) in &cap {
            if let Some(h) = out.get_mut(&label(metric)) {
                h.cap = values
                    .iter()
                    .map(|(_, v)| *v)
                    .fold(None, |m: Option<f64>, v| Some(m.map_or(v, |m| m.max(v))));
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

/// Every dependency's history from a recorded trace (`stormguard proxy --record`): per step,
/// the `request` events (originals), the `retry` events sent (`allowed_here`) and refused by
/// the budget (`denied: budget`), and the most `active.n` (in flight, as snapshot before each
/// retry's ask). Times count from each dependency's first event.
pub fn trace(path: &Path, step: Duration) -> Result<BTreeMap<String, History>, Failure> {
    let read_error = |e: std::io::Error| Failure::usage(format!("{}: {e}", path.display()));
    let file = stormguard_input::open_stream(path).map_err(read_error)?;
    let mut reader = std::io::BufReader::new(file);
    let secs = step.as_secs_f64();
    let mut out: BTreeMap<String, History> = BTreeMap::new();
    let mut buf = Vec::new();
    for n in 0.. {
        let read = stormguard_input::read_line(&mut reader, &mut buf, stormguard_input::MAX_LINE)
            .map_err(read_error)?;
        if read == 0 {
            break;
        }
        let line = String::from_utf8_lossy(&buf);
        if line.trim().is_empty() {
            continue;
        }
        let v: Value = serde_json::from_str(&line).map_err(|e| {
            Failure::usage(format!("{}:{}: not a JSON line: {e}", path.display(), n + 1))
        })?;
        let (Some(t_ms), Some(op)) = (v["t_ms"].as_u64(), v["op"].as_str()) else {
            return Err(Failure::usage(format!(
                "{}:{}: a trace line needs `t_ms` and `op`",
                path.display(),
                n + 1
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
    }
    Ok(out)
}
