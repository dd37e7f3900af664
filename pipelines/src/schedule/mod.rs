//! PLACEHOLDER (lead, uncommitted): replaced by the schedules helper's module.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScheduleKind { GPipe, OneFOneB, Interleaved { chunks: usize }, ZeroBubbleH1 }
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op { Forward, Backward, BackwardInput, BackwardWeight }
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Instr { pub op: Op, pub microbatch: usize, pub chunk: usize }
#[derive(Debug, thiserror::Error)]
#[error("bad schedule")]
pub struct ScheduleError;
pub fn instructions(_kind: ScheduleKind, _stages: usize, microbatches: usize, _stage: usize) -> Result<Vec<Instr>, ScheduleError> {
    let mut v: Vec<Instr> = (0..microbatches).map(|m| Instr { op: Op::Forward, microbatch: m, chunk: 0 }).collect();
    v.extend((0..microbatches).map(|m| Instr { op: Op::Backward, microbatch: m, chunk: 0 }));
    Ok(v)
}
