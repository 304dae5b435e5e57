//! Record mode (`--record FILE`, `record = "FILE"`): every dependency's traffic as `replay`
//! JSON lines, each tagged with its dependency, so an incident can be replayed against
//! candidate budgets: `stormguard replay --dependency NAME --policy SPEC FILE`.
//!
//! Lines are formatted on the request path into a buffered writer behind a mutex (a few
//! hundred nanoseconds; no allocation beyond the line), flushed every second and at shutdown.
//! Each dependency's `t_ms` counts from its first event and never decreases (events stamped on
//! different threads can reach the lock out of order by a few microseconds; such a line takes
//! the previous line's time). A write error is logged once and counted
//! (`stormguard_record_errors`); the traffic itself is never held up by the trace.

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use stormguard_core::clock::Timestamp;
use stormguard_tower::{Recorder, TraceEvent};

/// The trace file of one proxy.
#[derive(Debug)]
pub struct TraceFile {
    path: PathBuf,
    state: Mutex<State>,
    lines: AtomicU64,
    errors: AtomicU64,
    error_logged: AtomicBool,
}

#[derive(Debug)]
struct State {
    out: BufWriter<File>,
    /// Per dependency: the first event's time and the last line's `t_ms`.
    clocks: HashMap<String, (Timestamp, u128)>,
    line: String,
}

impl TraceFile {
    /// Creates (or truncates) `path`.
    pub fn create(path: &Path) -> std::io::Result<Arc<TraceFile>> {
        let out = BufWriter::with_capacity(256 * 1024, File::create(path)?);
        Ok(Arc::new(TraceFile {
            path: path.to_path_buf(),
            state: Mutex::new(State { out, clocks: HashMap::new(), line: String::new() }),
            lines: AtomicU64::new(0),
            errors: AtomicU64::new(0),
            error_logged: AtomicBool::new(false),
        }))
    }

    /// The recorder to put in each dependency's config.
    pub fn recorder(self: &Arc<Self>) -> Recorder {
        let me = self.clone();
        Recorder::new(move |dependency, event| me.write(dependency, event))
    }

    fn write(&self, dependency: &str, event: TraceEvent) {
        let mut guard = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let State { out, clocks, line } = &mut *guard;
        let (origin, last) = match clocks.get_mut(dependency) {
            Some(c) => c,
            None => clocks.entry(dependency.to_string()).or_insert((event.at, 0)),
        };
        let mut at = event.at.max(*origin);
        let t_ms = at.saturating_since(*origin).as_millis();
        if t_ms < *last {
            // Out of order by less than a millisecond's rounding or a thread's delay: keep the
            // file's times non-decreasing, as `replay` requires.
            at = origin.saturating_add(std::time::Duration::from_millis(
                u64::try_from(*last).unwrap_or(u64::MAX),
            ));
        }
        *last = (*last).max(t_ms);
        line.clear();
        TraceEvent { at, ..event }.write_json_line(dependency, *origin, line);
        if let Err(e) = out.write_all(line.as_bytes()) {
            self.failed(&e);
        } else {
            self.lines.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Writes what is buffered to the file.
    pub fn flush(&self) {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        if let Err(e) = state.out.flush() {
            self.failed(&e);
        }
    }

    fn failed(&self, e: &std::io::Error) {
        self.errors.fetch_add(1, Ordering::Relaxed);
        if !self.error_logged.swap(true, Ordering::Relaxed) {
            tracing::error!(path = %self.path.display(), error = %e, "cannot write the trace; later errors are only counted");
        }
    }

    /// Lines written so far.
    pub fn lines(&self) -> u64 {
        self.lines.load(Ordering::Relaxed)
    }

    /// Write errors so far.
    pub fn errors(&self) -> u64 {
        self.errors.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use stormguard_tower::TraceOp;

    #[test]
    fn times_count_from_each_dependency_and_never_decrease() {
        let dir = std::env::temp_dir().join(format!("sg-record-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("t.jsonl");
        let f = TraceFile::create(&path).unwrap();
        let r = f.recorder();
        let ev =
            |ms: u64, id| TraceEvent { at: Timestamp::from_millis(ms), id, op: TraceOp::Request };
        r.record("a", ev(1_000, 1));
        r.record("b", ev(5_000, 1));
        r.record("a", ev(1_250, 2));
        r.record("a", ev(1_249, 3));
        f.flush();
        let text = std::fs::read_to_string(&path).unwrap();
        let times: Vec<(String, u64)> = text
            .lines()
            .map(|l| {
                let v: serde_json::Value = serde_json::from_str(l).unwrap();
                (v["dependency"].as_str().unwrap().to_string(), v["t_ms"].as_u64().unwrap())
            })
            .collect();
        let want = [("a", 0), ("b", 0), ("a", 250), ("a", 250)];
        assert_eq!(times, want.map(|(d, t)| (d.to_string(), t)));
        assert_eq!((f.lines(), f.errors()), (4, 0));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
