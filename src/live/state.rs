//! `LiveState`: what the live cluster page shows, folded from the supervisor's `JobEvent`s.
//!
//! A pure state machine: [`LiveState::apply`] takes one event and the seconds since launch that
//! the caller read (no clock inside), so tests drive it with hand-made events. Everything it keeps
//! is bounded: the loss curve halves its resolution when full, the timeline and the lost members
//! drop their oldest entries. Readers ask for an [`Update`] since a [`Cursor`]: the summary, the
//! loss points and timeline entries they have not seen yet (the SSE stream), or for a whole
//! [`Snapshot`] (`/api/state`).

use std::collections::{BTreeMap, VecDeque};

use rtx_supervisor::JobEvent;
use serde::Serialize;

/// Loss points kept; when full, neighbouring points are merged and the stride doubles.
pub const LOSS_POINTS_MAX: usize = 2048;
/// Timeline entries kept (the oldest are dropped).
pub const TIMELINE_MAX: usize = 1024;
/// Lost members still listed (the oldest are dropped).
pub const LOST_MEMBERS_MAX: usize = 64;
/// Generations kept in the history (the oldest are dropped).
pub const GENERATIONS_MAX: usize = 256;
/// Committed steps the throughput is measured over.
pub const THROUGHPUT_WINDOW: usize = 32;

const _: () = assert!(LOSS_POINTS_MAX >= 2 && LOSS_POINTS_MAX.is_multiple_of(2));
const _: () = assert!(THROUGHPUT_WINDOW >= 2);

/// What the page says about the job before any event: from the config and the command line.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct JobInfo {
    /// The config file's name.
    pub config: String,
    /// Steps the job runs to.
    pub total_steps: u64,
    /// `samples` or `tokens`.
    pub unit: String,
    /// Units per step (the global batch).
    pub per_step: u64,
    /// The supervisor's control address.
    pub supervisor: String,
    /// The output folder.
    pub out_dir: String,
}

/// Where the job is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum JobPhase {
    /// Waiting for the first generation.
    Waiting,
    /// A generation is training.
    Training,
    /// A member was lost; waiting for the next generation.
    Recovering,
    /// The job completed.
    Finished,
    /// The job failed.
    Failed,
}

/// What a member is doing.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum MemberState {
    /// In the current generation.
    Training,
    /// Joined, not (yet) in a generation.
    Waiting,
    /// Lost (crashed, hung, preempted, evicted).
    Lost,
}

/// A member's place in the generation's mesh.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Coordinate {
    /// Data-parallel index.
    pub dp: usize,
    /// Pipeline stage.
    pub pp: usize,
    /// Tensor-parallel index.
    pub tp: usize,
}

/// One worker of the job.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Member {
    /// The supervisor's id of the worker.
    pub node: u64,
    /// Its name (`worker-<i>`).
    pub name: String,
    /// Its process id on its host.
    pub pid: u32,
    /// Its machine: host name (the boot id after `/` is left out).
    pub host: String,
    /// Training, waiting or lost.
    pub state: MemberState,
    /// Rank in the current generation.
    pub rank: Option<usize>,
    /// Mesh coordinate in the current generation.
    pub coordinate: Option<Coordinate>,
    /// Seconds since launch it joined.
    pub joined_t: f64,
    /// Why it was lost (failure class) and when.
    pub lost: Option<(String, f64)>,
}

/// One generation of the job.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct GenerationRecord {
    /// Its number.
    pub generation: u64,
    /// Members.
    pub world: usize,
    /// The step it started at.
    pub next_step: u64,
    /// Its mesh shape.
    pub mesh: Coordinate,
    /// Seconds since launch it started.
    pub t: f64,
    /// Whether it replaced a generation that lost a member.
    pub recovery: bool,
}

/// One line of the timeline.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct TimelineEntry {
    /// Position in the job's timeline (from 1, never reused).
    pub seq: u64,
    /// Seconds since launch.
    pub t: f64,
    /// `joined`, `refused`, `lost`, `generation`, `recovery`, `checkpoint`, `checkpoint_failed`,
    /// `suspect`, `finished` or `failed`.
    pub kind: &'static str,
    /// What happened, in words.
    pub text: String,
}

/// Counts since launch (the `_total` metrics).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Counters {
    /// Workers admitted.
    pub joined: u64,
    /// Join attempts refused.
    pub refused: u64,
    /// Members lost.
    pub lost: u64,
    /// Generations started after a loss.
    pub recoveries: u64,
    /// Checkpoints written.
    pub checkpoints: u64,
    /// Checkpoints that failed.
    pub checkpoint_failures: u64,
}

/// The numbers at the top of the page.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Summary {
    /// Where the job is.
    pub phase: JobPhase,
    /// Steps committed (the last committed step + 1).
    pub step: u64,
    /// Members of the current generation.
    pub world: usize,
    /// The current generation (0: none yet).
    pub generation: u64,
    /// The last committed step's loss.
    pub loss: Option<f64>,
    /// Units per second over the last committed steps of this generation.
    pub throughput: Option<f64>,
    /// Seconds since launch of the newest event.
    pub t: f64,
    /// Counts since launch.
    pub counters: Counters,
    /// The final evaluation, once finished.
    pub eval: BTreeMap<String, f64>,
    /// Why the job failed.
    pub failure: Option<String>,
}

/// What a reader has already seen.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Cursor {
    /// The loss curve's epoch (bumped when points are merged or dropped) and points seen.
    loss: Option<(u64, usize)>,
    /// The newest timeline entry seen.
    timeline_seq: u64,
}

/// New loss points for a reader.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct LossDelta {
    /// The reader must drop its points first (first update, or the curve was resampled).
    pub reset: bool,
    /// Steps per point now.
    pub stride: u64,
    /// `(steps committed, mean loss)` points to append.
    pub points: Vec<(u64, f64)>,
}

/// Everything a reader has not seen: one SSE message.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Update {
    /// Job facts.
    pub info: JobInfo,
    /// The numbers.
    pub summary: Summary,
    /// Every member (training by rank, then waiting, then lost).
    pub members: Vec<Member>,
    /// The generation history.
    pub generations: Vec<GenerationRecord>,
    /// New loss points.
    pub loss: LossDelta,
    /// New timeline entries.
    pub timeline: Vec<TimelineEntry>,
}

/// The whole state (`/api/state`).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Snapshot {
    /// Job facts.
    pub info: JobInfo,
    /// The numbers.
    pub summary: Summary,
    /// Every member.
    pub members: Vec<Member>,
    /// The generation history.
    pub generations: Vec<GenerationRecord>,
    /// Steps per loss point.
    pub loss_stride: u64,
    /// `(steps committed, mean loss)`.
    pub loss: Vec<(u64, f64)>,
    /// The timeline (the newest [`TIMELINE_MAX`] entries).
    pub timeline: Vec<TimelineEntry>,
}

/// The live page's view of one job.
#[derive(Debug)]
pub struct LiveState {
    info: JobInfo,
    summary: Summary,
    members: BTreeMap<u64, Member>,
    generations: VecDeque<GenerationRecord>,
    loss: LossCurve,
    timeline: VecDeque<TimelineEntry>,
    next_seq: u64,
    /// `(seconds, steps committed)` of the newest commits of this generation.
    commits: VecDeque<(f64, u64)>,
    /// A member was lost since the last generation started.
    lost_since_generation: bool,
}

impl LiveState {
    /// The state before the first event.
    pub fn new(info: JobInfo) -> LiveState {
        let summary = Summary { phase: JobPhase::Waiting, step: 0, world: 0, generation: 0, loss: None, throughput: None, t: 0.0, counters: Counters::default(), eval: BTreeMap::new(), failure: None };
        LiveState { info, summary, members: BTreeMap::new(), generations: VecDeque::new(), loss: LossCurve::default(), timeline: VecDeque::new(), next_seq: 1, commits: VecDeque::new(), lost_since_generation: false }
    }

    /// Folds one event in; `t` is the seconds since launch when it arrived.
    pub fn apply(&mut self, event: &JobEvent, t: f64) {
        self.summary.t = t;
        match event {
            JobEvent::Joined { node, name, pid, host } => {
                self.summary.counters.joined += 1;
                let host = host.split('/').next().unwrap_or(host).to_string();
                self.note(t, "joined", format!("{name} (pid {pid}) joined from {host}"));
                self.members.insert(*node, Member { node: *node, name: name.clone(), pid: *pid, host, state: MemberState::Waiting, rank: None, coordinate: None, joined_t: t, lost: None });
            }
            JobEvent::Refused { peer, reason } => {
                self.summary.counters.refused += 1;
                self.note(t, "refused", format!("refused {peer}: {reason}"));
            }
            JobEvent::Lost { node, pid, class, reason } => self.on_lost(*node, *pid, &format!("{class:?}"), reason, t),
            JobEvent::Generation { generation, world, next_step, nodes, mesh, .. } => self.on_generation(*generation, *world, *next_step, nodes, *mesh, t),
            JobEvent::Committed { step, loss, world, generation, .. } => {
                let done = step + 1;
                (self.summary.step, self.summary.loss, self.summary.world, self.summary.generation) = (done, Some(*loss), *world, *generation);
                self.loss.push(done, *loss);
                if self.commits.len() == THROUGHPUT_WINDOW {
                    self.commits.pop_front();
                }
                self.commits.push_back((t, done));
                self.summary.throughput = self.throughput();
            }
            JobEvent::Checkpointed { step, path } => {
                self.summary.counters.checkpoints += 1;
                self.note(t, "checkpoint", format!("checkpoint after step {}: {path}", step + 1));
            }
            JobEvent::CheckpointFailed { step, reason } => {
                self.summary.counters.checkpoint_failures += 1;
                self.note(t, "checkpoint_failed", format!("checkpoint after step {} failed: {reason}", step + 1));
            }
            JobEvent::Finished { eval, .. } => {
                self.summary.phase = JobPhase::Finished;
                self.summary.eval = eval.iter().cloned().collect();
                let text: Vec<String> = eval.iter().map(|(k, v)| format!("{k} {v:.4}")).collect();
                self.note(t, "finished", format!("finished at step {}: {}", self.summary.step, text.join(", ")));
            }
            JobEvent::Failed { reason } => {
                self.summary.phase = JobPhase::Failed;
                self.summary.failure = Some(reason.clone());
                self.note(t, "failed", format!("job failed: {reason}"));
            }
            JobEvent::Suspect { reason } => self.note(t, "suspect", reason.clone()),
        }
    }

    /// The numbers at the top of the page.
    pub fn summary(&self) -> &Summary {
        &self.summary
    }

    /// Job facts.
    pub fn info(&self) -> &JobInfo {
        &self.info
    }

    /// Everything a reader at `cursor` has not seen, and the cursor after it.
    pub fn update_since(&self, cursor: Cursor) -> (Update, Cursor) {
        let (epoch, len) = (self.loss.epoch, self.loss.points.len());
        let (reset, from) = match cursor.loss {
            Some((e, seen)) if e == epoch && seen <= len => (false, seen),
            _ => (true, 0),
        };
        let timeline: Vec<TimelineEntry> = self.timeline.iter().filter(|e| e.seq > cursor.timeline_seq).cloned().collect();
        let next = Cursor { loss: Some((epoch, len)), timeline_seq: self.timeline.back().map_or(cursor.timeline_seq, |e| e.seq) };
        let update = Update {
            info: self.info.clone(),
            summary: self.summary.clone(),
            members: self.members_sorted(),
            generations: self.generations.iter().cloned().collect(),
            loss: LossDelta { reset, stride: self.loss.stride, points: self.loss.points[from..].to_vec() },
            timeline,
        };
        (update, next)
    }

    /// The whole state.
    pub fn snapshot(&self) -> Snapshot {
        Snapshot {
            info: self.info.clone(),
            summary: self.summary.clone(),
            members: self.members_sorted(),
            generations: self.generations.iter().cloned().collect(),
            loss_stride: self.loss.stride,
            loss: self.loss.points.clone(),
            timeline: self.timeline.iter().cloned().collect(),
        }
    }

    /// Timeline entries after `seq` (all with 0).
    pub fn timeline_after(&self, seq: u64) -> Vec<TimelineEntry> {
        self.timeline.iter().filter(|e| e.seq > seq).cloned().collect()
    }

    /// Every member still listed, by node id.
    pub fn members(&self) -> impl Iterator<Item = &Member> + '_ {
        self.members.values()
    }

    fn on_lost(&mut self, node: u64, pid: u32, class: &str, reason: &str, t: f64) {
        self.summary.counters.lost += 1;
        self.lost_since_generation = true;
        if matches!(self.summary.phase, JobPhase::Training | JobPhase::Waiting) {
            self.summary.phase = JobPhase::Recovering;
        }
        let name = match self.members.get_mut(&node) {
            Some(member) => {
                (member.state, member.rank, member.coordinate, member.lost) = (MemberState::Lost, None, None, Some((class.to_string(), t)));
                member.name.clone()
            }
            None => format!("node {node}"),
        };
        self.note(t, "lost", format!("{name} (pid {pid}) lost ({class}): {reason}"));
        let lost: Vec<u64> = self.members.values().filter(|m| m.state == MemberState::Lost).map(|m| m.node).collect();
        for node in lost.iter().take(lost.len().saturating_sub(LOST_MEMBERS_MAX)) {
            self.members.remove(node);
        }
    }

    fn on_generation(&mut self, generation: u64, world: usize, next_step: u64, nodes: &[u64], (dp, pp, tp): (usize, usize, usize), t: f64) {
        debug_assert_eq!(nodes.len(), world, "a generation lists one node per member");
        let recovery = self.lost_since_generation && !self.generations.is_empty();
        self.lost_since_generation = false;
        (self.summary.generation, self.summary.world, self.summary.phase) = (generation, world, JobPhase::Training);
        self.summary.counters.recoveries += u64::from(recovery);
        for member in self.members.values_mut().filter(|m| m.state == MemberState::Training) {
            (member.state, member.rank, member.coordinate) = (MemberState::Waiting, None, None);
        }
        let (pp, tp) = (pp.max(1), tp.max(1));
        for (rank, node) in nodes.iter().enumerate() {
            if let Some(member) = self.members.get_mut(node) {
                member.state = MemberState::Training;
                member.rank = Some(rank);
                member.coordinate = Some(Coordinate { dp: rank / (tp * pp), pp: rank / tp % pp, tp: rank % tp });
            }
        }
        // Steps past `next_step` are trained again: their old points leave the curve.
        self.loss.truncate(next_step);
        self.summary.step = self.summary.step.min(next_step);
        self.commits.clear();
        self.summary.throughput = None;
        if self.generations.len() == GENERATIONS_MAX {
            self.generations.pop_front();
        }
        self.generations.push_back(GenerationRecord { generation, world, next_step, mesh: Coordinate { dp, pp, tp }, t, recovery });
        let (kind, what) = if recovery { ("recovery", "recovered: generation") } else { ("generation", "generation") };
        self.note(t, kind, format!("{what} {generation} with {world} worker(s) (mesh dp {dp} x pp {pp} x tp {tp}), continuing at step {next_step}"));
    }

    fn members_sorted(&self) -> Vec<Member> {
        let mut members: Vec<Member> = self.members.values().cloned().collect();
        members.sort_by_key(|m| (m.state, m.rank, m.node));
        members
    }

    fn throughput(&self) -> Option<f64> {
        let (first, last) = (self.commits.front()?, self.commits.back()?);
        let seconds = last.0 - first.0;
        (last.1 > first.1 && seconds > 0.0).then(|| (last.1 - first.1) as f64 * self.info.per_step as f64 / seconds)
    }

    fn note(&mut self, t: f64, kind: &'static str, text: String) {
        if self.timeline.len() == TIMELINE_MAX {
            self.timeline.pop_front();
        }
        self.timeline.push_back(TimelineEntry { seq: self.next_seq, t, kind, text });
        self.next_seq += 1;
    }
}

/// The loss curve: means over `stride` consecutive committed steps.
#[derive(Debug)]
struct LossCurve {
    points: Vec<(u64, f64)>,
    stride: u64,
    /// The step sum and count of the point being filled.
    pending: (f64, u64),
    /// Bumped whenever points change other than by appending.
    epoch: u64,
}

impl Default for LossCurve {
    fn default() -> LossCurve {
        LossCurve { points: Vec::new(), stride: 1, pending: (0.0, 0), epoch: 0 }
    }
}

impl LossCurve {
    fn push(&mut self, done: u64, loss: f64) {
        self.pending = (self.pending.0 + loss, self.pending.1 + 1);
        if self.pending.1 < self.stride {
            return;
        }
        self.points.push((done, self.pending.0 / self.pending.1 as f64));
        self.pending = (0.0, 0);
        if self.points.len() == LOSS_POINTS_MAX {
            self.points = self.points.chunks(2).map(|pair| (pair[pair.len() - 1].0, pair.iter().map(|p| p.1).sum::<f64>() / pair.len() as f64)).collect();
            self.stride *= 2;
            self.epoch += 1;
        }
        debug_assert!(self.points.len() < LOSS_POINTS_MAX);
    }

    /// Drops the points of steps after `next_step` (they will be trained again).
    fn truncate(&mut self, next_step: u64) {
        let keep = self.points.partition_point(|p| p.0 <= next_step);
        if keep < self.points.len() {
            self.points.truncate(keep);
            self.epoch += 1;
        }
        self.pending = (0.0, 0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rtx_supervisor::FailureClass;

    fn info() -> JobInfo {
        JobInfo { config: "t.toml".into(), total_steps: 100, unit: "samples".into(), per_step: 64, supervisor: "127.0.0.1:1".into(), out_dir: "/tmp/x".into() }
    }

    fn joined(node: u64) -> JobEvent {
        JobEvent::Joined { node, name: format!("worker-{node}"), pid: 100 + node as u32, host: "box/boot-1".into() }
    }

    fn generation(generation: u64, nodes: &[u64], next_step: u64, mesh: (usize, usize, usize)) -> JobEvent {
        JobEvent::Generation { generation, world: nodes.len(), next_step, source_node: nodes[0], nodes: nodes.to_vec(), pids: nodes.iter().map(|n| 100 + *n as u32).collect(), mesh, transport: "shm" }
    }

    fn committed(step: u64, loss: f64) -> JobEvent {
        JobEvent::Committed { step, loss, samples: 64, world: 2, generation: 1, checksum: None }
    }

    #[test]
    fn a_loss_then_a_generation_is_a_recovery_with_coordinates() {
        // Goal: members, coordinates, phases and the timeline follow a kill and a re-formation.
        let mut state = LiveState::new(info());
        for node in [1, 2, 3, 4] {
            state.apply(&joined(node), 0.1);
        }
        state.apply(&generation(1, &[1, 2, 3, 4], 0, (1, 2, 2)), 0.2);
        let members = state.snapshot().members;
        let coordinate = |node: u64| members.iter().find(|m| m.node == node).and_then(|m| m.coordinate);
        assert_eq!(coordinate(4), Some(Coordinate { dp: 0, pp: 1, tp: 1 }));
        assert_eq!(coordinate(2), Some(Coordinate { dp: 0, pp: 0, tp: 1 }));
        assert_eq!(members[0].host, "box", "the boot id is left out");
        assert_eq!(state.summary().phase, JobPhase::Training);
        state.apply(&JobEvent::Lost { node: 3, pid: 103, class: FailureClass::Crash, reason: "exit".into() }, 1.0);
        assert_eq!(state.summary().phase, JobPhase::Recovering);
        state.apply(&generation(2, &[1, 2], 0, (2, 1, 1)), 1.5);
        let snapshot = state.snapshot();
        assert_eq!(snapshot.summary.phase, JobPhase::Training);
        assert_eq!(snapshot.summary.counters.recoveries, 1);
        let states: Vec<(u64, MemberState)> = snapshot.members.iter().map(|m| (m.node, m.state)).collect();
        assert_eq!(states, vec![(1, MemberState::Training), (2, MemberState::Training), (4, MemberState::Waiting), (3, MemberState::Lost)]);
        assert_eq!(snapshot.members[1].coordinate, Some(Coordinate { dp: 1, pp: 0, tp: 0 }));
        let kinds: Vec<&str> = snapshot.timeline.iter().map(|e| e.kind).collect();
        assert_eq!(kinds, vec!["joined", "joined", "joined", "joined", "generation", "lost", "recovery"]);
        assert!(snapshot.generations[1].recovery && !snapshot.generations[0].recovery);
    }

    #[test]
    fn updates_carry_only_what_the_reader_has_not_seen() {
        // Goal: an SSE reader gets each loss point and timeline entry once, and a reset when the
        // curve is cut back by a re-formation that retrains steps.
        let mut state = LiveState::new(info());
        state.apply(&joined(1), 0.0);
        state.apply(&generation(1, &[1], 0, (1, 1, 1)), 0.0);
        let (first, cursor) = state.update_since(Cursor::default());
        assert!(first.loss.reset && first.loss.points.is_empty());
        assert_eq!(first.timeline.len(), 2);
        for step in 0..5 {
            state.apply(&committed(step, 2.0 - step as f64 * 0.1), 1.0 + step as f64);
        }
        let (second, cursor) = state.update_since(cursor);
        assert!(!second.loss.reset);
        assert_eq!(second.loss.points.iter().map(|p| p.0).collect::<Vec<_>>(), vec![1, 2, 3, 4, 5]);
        assert!(second.timeline.is_empty());
        // 4 steps over 4 s at 64 samples a step.
        assert_eq!(second.summary.throughput, Some(64.0));
        state.apply(&generation(2, &[1], 3, (1, 1, 1)), 7.0);
        let (third, _) = state.update_since(cursor);
        assert!(third.loss.reset, "steps 4 and 5 are retrained: the reader starts over");
        assert_eq!(third.loss.points.iter().map(|p| p.0).collect::<Vec<_>>(), vec![1, 2, 3]);
        assert_eq!(third.summary.step, 3);
        assert_eq!(third.timeline.len(), 1);
        assert_eq!(third.timeline[0].kind, "generation", "no loss: a regrouping, not a recovery");
    }

    #[test]
    fn the_loss_curve_and_timeline_stay_bounded() {
        // Goal: a long job keeps at most LOSS_POINTS_MAX points (merged, stride doubled) and
        // TIMELINE_MAX entries.
        let mut state = LiveState::new(info());
        for step in 0..(LOSS_POINTS_MAX as u64 * 3) {
            state.apply(&committed(step, 1.0), step as f64);
        }
        let snapshot = state.snapshot();
        assert!(snapshot.loss.len() < LOSS_POINTS_MAX && snapshot.loss_stride == 4, "{} points, stride {}", snapshot.loss.len(), snapshot.loss_stride);
        assert!(snapshot.loss.windows(2).all(|w| w[1].0 - w[0].0 == 4));
        for i in 0..(TIMELINE_MAX + 10) {
            state.apply(&JobEvent::Suspect { reason: format!("r{i}") }, 0.0);
        }
        let timeline = state.snapshot().timeline;
        assert_eq!(timeline.len(), TIMELINE_MAX);
        assert_eq!(timeline[0].seq, 11);
        assert_eq!(state.timeline_after(timeline[TIMELINE_MAX - 2].seq).len(), 1);
    }
}
