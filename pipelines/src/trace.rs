//! Per-step timeline export: what one data-parallel rank did in each of its first N steps
//! (forward, backward, each bucket's collective on the communication thread, the wait for the
//! last bucket, the optimizer), as Chrome trace events (`chrome://tracing`, Perfetto), so overlap
//! of communication with backward, and stalls, can be seen rather than read.
//!
//! Decision: like [`crate::pipeline::StageTimeline`], this is a measurement, not a protocol decision,
//! so it reads the wall clock (`std::time::Instant`) and nothing depends on it. Offsets are from
//! the moment recording started; each rank writes its own file, put on one axis by a viewer.
//! The compute thread is `tid` 0 and the communication thread `tid` 1.

use std::time::{Duration, Instant};

use serde_json::json;

/// Most events kept (a bound on memory whatever N is).
pub const TRACE_EVENTS_MAX: usize = 1 << 16;

/// Thread id of the compute thread in the trace.
pub const COMPUTE_TID: u32 = 0;
/// Thread id of the communication thread in the trace.
pub const COMM_TID: u32 = 1;

/// One span of a step.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TraceEvent {
    /// `forward`, `backward`, `gradient wait`, `optimizer`, or the collective's name
    /// (`all_reduce`, `reduce_scatter`) for a bucket.
    pub name: &'static str,
    /// [`COMPUTE_TID`] or [`COMM_TID`].
    pub tid: u32,
    /// The step.
    pub step: u64,
    /// The bucket of a collective.
    pub bucket: Option<usize>,
    /// When it began, from the start of recording.
    pub start: Duration,
    /// How long it ran.
    pub duration: Duration,
}

/// The recorder of the first steps of an engine.
#[derive(Clone, Debug)]
pub struct StepTrace {
    origin: Instant,
    steps_left: u64,
    events: Vec<TraceEvent>,
}

impl StepTrace {
    /// Records the next `steps` steps.
    pub fn new(steps: u64) -> StepTrace {
        StepTrace { origin: Instant::now(), steps_left: steps, events: Vec::new() }
    }

    /// Whether the current step is recorded.
    pub fn recording(&self) -> bool {
        self.steps_left > 0
    }

    /// The recorded spans, in the order they were recorded.
    pub fn events(&self) -> &[TraceEvent] {
        &self.events
    }

    /// Adds a span (ignored when not recording, or beyond [`TRACE_EVENTS_MAX`]).
    pub fn record(&mut self, name: &'static str, tid: u32, step: u64, bucket: Option<usize>, began: Instant, ended: Instant) {
        if !self.recording() || self.events.len() >= TRACE_EVENTS_MAX {
            return;
        }
        debug_assert!(ended >= began, "a span ends after it begins");
        let start = began.saturating_duration_since(self.origin);
        self.events.push(TraceEvent { name, tid, step, bucket, start, duration: ended.saturating_duration_since(began) });
    }

    /// The recorded step is over.
    pub fn step_done(&mut self) {
        self.steps_left = self.steps_left.saturating_sub(1);
    }

    /// The trace as a Chrome trace document (`{"traceEvents": [...]}`), process `rank`.
    pub fn to_chrome_json(&self, rank: usize) -> serde_json::Value {
        let micros = |d: Duration| d.as_secs_f64() * 1e6;
        let mut events = vec![
            json!({ "name": "process_name", "ph": "M", "pid": rank, "tid": COMPUTE_TID, "args": { "name": format!("rank {rank}") } }),
            json!({ "name": "process_sort_index", "ph": "M", "pid": rank, "tid": COMPUTE_TID, "args": { "sort_index": rank } }),
            json!({ "name": "thread_name", "ph": "M", "pid": rank, "tid": COMPUTE_TID, "args": { "name": "compute" } }),
            json!({ "name": "thread_name", "ph": "M", "pid": rank, "tid": COMM_TID, "args": { "name": "communication" } }),
        ];
        events.extend(self.events.iter().map(|e| {
            let name = match e.bucket {
                Some(b) => format!("{} bucket {b}", e.name),
                None => e.name.to_string(),
            };
            let cat = if e.tid == COMM_TID { "collective" } else { "compute" };
            json!({ "name": name, "cat": cat, "ph": "X", "pid": rank, "tid": e.tid, "ts": micros(e.start), "dur": micros(e.duration), "args": { "step": e.step, "bucket": e.bucket } })
        }));
        json!({ "traceEvents": events, "displayTimeUnit": "ms" })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_only_the_asked_steps_as_complete_events() {
        // Goal: spans of the first N steps become Chrome "X" events with microsecond offsets,
        // named by bucket; later steps are not recorded.
        let mut trace = StepTrace::new(1);
        let t0 = trace.origin + Duration::from_millis(2);
        trace.record("forward", COMPUTE_TID, 0, None, t0, t0 + Duration::from_millis(3));
        trace.record("all_reduce", COMM_TID, 0, Some(1), t0 + Duration::from_millis(4), t0 + Duration::from_millis(5));
        trace.step_done();
        trace.record("forward", COMPUTE_TID, 1, None, t0, t0);
        assert_eq!(trace.events().len(), 2);
        let doc = trace.to_chrome_json(3);
        let events = doc["traceEvents"].as_array().expect("events");
        let spans: Vec<&serde_json::Value> = events.iter().filter(|e| e["ph"] == "X").collect();
        assert_eq!(spans.len(), 2);
        assert_eq!(spans[0]["ts"], 2000.0);
        assert_eq!(spans[0]["dur"], 3000.0);
        assert_eq!(spans[1]["name"], "all_reduce bucket 1");
        assert_eq!((spans[1]["pid"].as_u64(), spans[1]["tid"].as_u64()), (Some(3), Some(u64::from(COMM_TID))));
        assert!(events.iter().any(|e| e["ph"] == "M" && e["args"]["name"] == "communication"));
    }
}
