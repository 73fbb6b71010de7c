//! Timelines in Chrome's trace-event format (`--trace`), viewable in Perfetto or
//! chrome://tracing: one file per process, one complete event (`"ph":"X"`) per span.
//!
//! A [`Trace`] is a cheap handle passed to whoever records spans; a disabled one records
//! nothing and costs a branch. Spans may be recorded from any thread (`tid` names the lane:
//! compute, comm, a bucket...).

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use serde::Serialize;

use crate::error::{Error, Result};

/// One complete event.
#[derive(Debug, Clone, Serialize)]
struct Event {
    name: String,
    cat: &'static str,
    ph: &'static str,
    /// Microseconds since the trace started.
    ts: f64,
    dur: f64,
    pid: usize,
    tid: String,
    #[serde(skip_serializing_if = "serde_json::Map::is_empty")]
    args: serde_json::Map<String, serde_json::Value>,
}

#[derive(Debug)]
struct Inner {
    pid: usize,
    t0: Instant,
    events: Mutex<Vec<Event>>,
}

/// A per-process trace recorder (cloning shares it).
#[derive(Debug, Clone, Default)]
pub struct Trace {
    inner: Option<Arc<Inner>>,
}

impl Trace {
    /// A trace that records nothing.
    pub fn disabled() -> Self {
        Trace { inner: None }
    }

    /// A recording trace for process `pid` (the rank; servers use 1000 + shard).
    pub fn new(pid: usize) -> Self {
        Trace { inner: Some(Arc::new(Inner { pid, t0: Instant::now(), events: Mutex::new(Vec::new()) })) }
    }

    /// Whether spans are recorded.
    pub fn enabled(&self) -> bool {
        self.inner.is_some()
    }

    /// Record a span from `start` to now on lane `tid`.
    pub fn span(&self, name: impl Into<String>, cat: &'static str, tid: impl Into<String>, start: Instant) {
        self.span_with(name, cat, tid, start, Instant::now(), serde_json::Map::new());
    }

    /// Record a span with explicit end and arguments (bytes, bucket index...).
    pub fn span_with(
        &self,
        name: impl Into<String>,
        cat: &'static str,
        tid: impl Into<String>,
        start: Instant,
        end: Instant,
        args: serde_json::Map<String, serde_json::Value>,
    ) {
        let Some(inner) = &self.inner else { return };
        let us = |t: Instant| t.saturating_duration_since(inner.t0).as_secs_f64() * 1e6;
        let ev = Event {
            name: name.into(),
            cat,
            ph: "X",
            ts: us(start),
            dur: (us(end) - us(start)).max(0.0),
            pid: inner.pid,
            tid: tid.into(),
            args,
        };
        if let Ok(mut events) = inner.events.lock() {
            events.push(ev);
        }
    }

    /// Write the events recorded so far as `{"traceEvents": [...]}`.
    pub fn write(&self, path: &Path) -> Result<()> {
        let Some(inner) = &self.inner else { return Ok(()) };
        let events = inner.events.lock().map(|e| e.clone()).unwrap_or_default();
        let json = serde_json::json!({ "traceEvents": events, "displayTimeUnit": "ms" });
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
        }
        std::fs::write(path, json.to_string()).map_err(|e| Error::io(path, e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_and_writes_chrome_events() {
        let t = Trace::new(3);
        let s = Instant::now();
        t.span("forward", "compute", "compute", s);
        Trace::disabled().span("ignored", "compute", "x", s);
        let dir = gradsync_testkit::Scratch::new("trace");
        let path = dir.join("trace.json");
        t.write(&path).unwrap();
        let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        let ev = &v["traceEvents"][0];
        assert_eq!(ev["name"], "forward");
        assert_eq!(ev["ph"], "X");
        assert_eq!(ev["pid"], 3);
        assert_eq!(v["traceEvents"].as_array().unwrap().len(), 1);
    }
}
