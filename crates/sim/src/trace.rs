//! A recorded trace as arrivals (`[fleet] trace = "FILE"`): the first tries of the proxy's
//! record mode (`{"t_ms":..,"op":"request","dependency":"payments",..}`, one JSON object a
//! line, the format `stormguard replay` reads), so a real incident's arrivals can be run through
//! the model and, by `stormguard verify`, live. Every other event is skipped: the model decides
//! what fails and what is retried.

use std::path::Path;
use std::time::Duration;

use serde_json::Value;

/// The instants, in nanoseconds from the dependency's first event, of the recorded first tries
/// of `dependency` (or of the only dependency the trace holds) before `duration`, in order.
/// The reason, when it cannot: the file and the line.
pub(crate) fn first_tries(
    path: &Path,
    dependency: Option<&str>,
    duration: Duration,
) -> Result<Vec<u64>, String> {
    let shown = path.display();
    let text = stormguard_input::read_to_string(path, stormguard_input::MAX_FILE)
        .map_err(|e| format!("{shown}: cannot read the trace: {e}"))?;
    let mut seen: Option<String> = None;
    let mut times = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        let at = |why: &str| format!("{shown}:{}: {why}", i + 1);
        let v: Value = serde_json::from_str(line).map_err(|e| at(&format!("not JSON ({e})")))?;
        let obj = v.as_object().ok_or_else(|| at("not a JSON object"))?;
        let tagged = match obj.get("dependency") {
            None => None,
            Some(Value::String(d)) => Some(d.as_str()),
            Some(_) => return Err(at("`dependency` is not a string")),
        };
        match (dependency, tagged) {
            (Some(wanted), Some(d)) if d != wanted => continue,
            (None, Some(d)) => match &seen {
                Some(s) if s != d => {
                    return Err(at(&format!(
                        "the trace holds more than one dependency ({s}, {d}): choose one with \
                         trace_dependency"
                    )));
                }
                Some(_) => {}
                None => seen = Some(d.to_string()),
            },
            _ => {}
        }
        let t_ms = obj
            .get("t_ms")
            .and_then(Value::as_u64)
            .ok_or_else(|| at("`t_ms` is not a whole number of milliseconds"))?;
        if obj.get("op").and_then(Value::as_str) != Some("request") {
            continue;
        }
        let nanos = t_ms.saturating_mul(1_000_000);
        if u128::from(nanos) < duration.as_nanos() {
            times.push(nanos);
        }
    }
    if times.is_empty() {
        let of = dependency.map_or(String::new(), |d| format!(" of dependency {d}"));
        return Err(format!(
            "{shown}: no first try (\"op\":\"request\"){of} before the scenario's duration"
        ));
    }
    times.sort_unstable();
    Ok(times)
}
