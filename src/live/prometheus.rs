//! `/metrics`: the live state in Prometheus' text exposition format (version 0.0.4).
//!
//! A handful of gauges and counters rendered from a [`LiveState`] on each scrape; nothing is
//! registered or kept between scrapes, so the format is written directly (`# HELP`, `# TYPE`,
//! then `name{labels} value` lines) rather than through a metrics registry.

use std::fmt::Write as _;

use super::state::{JobPhase, LiveState, MemberState};

/// The `Content-Type` of the text exposition format.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// The state as Prometheus text.
pub fn render(state: &LiveState) -> String {
    let summary = state.summary();
    let counters = summary.counters;
    let count = |s: MemberState| state.members().filter(|m| m.state == s).count() as f64;
    let mut out = String::new();
    let mut metric = |name: &str, kind: &str, help: &str, samples: &[(&str, f64)]| {
        let _ = writeln!(out, "# HELP {name} {help}");
        let _ = writeln!(out, "# TYPE {name} {kind}");
        for (labels, value) in samples {
            let _ = writeln!(out, "{name}{labels} {}", number(*value));
        }
    };
    metric("rtx_step", "gauge", "Steps committed (the last committed step + 1).", &[("", summary.step as f64)]);
    metric("rtx_total_steps", "gauge", "Steps the job runs to.", &[("", state.info().total_steps as f64)]);
    metric("rtx_world", "gauge", "Members of the current generation.", &[("", summary.world as f64)]);
    metric("rtx_generation", "gauge", "The current membership generation (0 before the first).", &[("", summary.generation as f64)]);
    if let Some(loss) = summary.loss {
        metric("rtx_loss", "gauge", "Training loss of the last committed step.", &[("", loss)]);
    }
    let unit_label = format!("{{unit=\"{}\"}}", escape(&state.info().unit));
    metric("rtx_throughput", "gauge", "Units (samples or tokens) per second over the last committed steps.", &[(&unit_label, summary.throughput.unwrap_or(0.0))]);
    metric(
        "rtx_members",
        "gauge",
        "Workers by state.",
        &[("{state=\"training\"}", count(MemberState::Training)), ("{state=\"waiting\"}", count(MemberState::Waiting)), ("{state=\"lost\"}", count(MemberState::Lost))],
    );
    let phase = |p: JobPhase| f64::from(u8::from(summary.phase == p));
    metric(
        "rtx_phase",
        "gauge",
        "1 for the phase the job is in.",
        &[
            ("{phase=\"waiting\"}", phase(JobPhase::Waiting)),
            ("{phase=\"training\"}", phase(JobPhase::Training)),
            ("{phase=\"recovering\"}", phase(JobPhase::Recovering)),
            ("{phase=\"finished\"}", phase(JobPhase::Finished)),
            ("{phase=\"failed\"}", phase(JobPhase::Failed)),
        ],
    );
    metric("rtx_joined_total", "counter", "Workers admitted since launch.", &[("", counters.joined as f64)]);
    metric("rtx_refused_total", "counter", "Join attempts refused since launch.", &[("", counters.refused as f64)]);
    metric("rtx_lost_total", "counter", "Members lost since launch.", &[("", counters.lost as f64)]);
    metric("rtx_recoveries_total", "counter", "Generations formed after a loss.", &[("", counters.recoveries as f64)]);
    metric("rtx_checkpoints_total", "counter", "Checkpoints written.", &[("", counters.checkpoints as f64)]);
    metric("rtx_checkpoint_failures_total", "counter", "Checkpoints that failed.", &[("", counters.checkpoint_failures as f64)]);
    out
}

/// A sample value as the format spells it.
fn number(value: f64) -> String {
    if value.is_nan() {
        "NaN".into()
    } else if value.is_infinite() {
        if value > 0.0 { "+Inf" } else { "-Inf" }.into()
    } else {
        format!("{value}")
    }
}

/// A label value with `\`, `"` and newlines escaped.
fn escape(value: &str) -> String {
    value.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::live::state::JobInfo;
    use rtx_supervisor::{FailureClass, JobEvent};

    #[test]
    fn every_sample_line_parses_and_counts_follow_events() {
        // Goal: the text is valid exposition format and its values follow the events. Method:
        // parse each non-comment line as `name{labels} value` and look values up.
        let info = JobInfo { config: "t".into(), total_steps: 10, unit: "sam\"ples".into(), per_step: 8, supervisor: "a".into(), out_dir: "b".into() };
        let mut state = LiveState::new(info);
        state.apply(&JobEvent::Joined { node: 1, name: "w1".into(), pid: 1, host: "h".into() }, 0.0);
        state.apply(&JobEvent::Joined { node: 2, name: "w2".into(), pid: 2, host: "h".into() }, 0.0);
        state.apply(&JobEvent::Generation { generation: 1, world: 2, next_step: 0, source_node: 1, nodes: vec![1, 2], pids: vec![1, 2], mesh: (2, 1, 1), transport: "shm" }, 0.0);
        state.apply(&JobEvent::Committed { step: 4, loss: f64::NAN, samples: 8, world: 2, generation: 1, checksum: None }, 1.0);
        state.apply(&JobEvent::Lost { node: 2, pid: 2, class: FailureClass::Crash, reason: "x".into() }, 2.0);
        state.apply(&JobEvent::Checkpointed { step: 4, path: "p".into() }, 2.0);
        let text = render(&state);
        let mut values = std::collections::BTreeMap::new();
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let (series, value) = line.rsplit_once(' ').unwrap_or_else(|| panic!("no value in {line:?}"));
            assert!(series.starts_with("rtx_"), "{line}");
            let value: f64 = value.parse().unwrap_or_else(|_| panic!("bad value in {line:?}"));
            values.insert(series.to_string(), value);
        }
        assert_eq!(values["rtx_step"], 5.0);
        assert!(values["rtx_loss"].is_nan());
        assert_eq!(values["rtx_lost_total"], 1.0);
        assert_eq!(values["rtx_checkpoints_total"], 1.0);
        assert_eq!(values["rtx_members{state=\"lost\"}"], 1.0);
        assert_eq!(values["rtx_phase{phase=\"recovering\"}"], 1.0);
        assert!(values.contains_key("rtx_throughput{unit=\"sam\\\"ples\"}"), "{text}");
        assert_eq!(text.matches("# TYPE rtx_lost_total counter").count(), 1);
    }
}
