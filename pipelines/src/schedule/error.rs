//! Errors of schedule construction and simulation: each variant names the numbers that were wrong.

use super::Instr;

/// Why a schedule could not be computed or simulated.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum ScheduleError {
    /// A pipeline needs at least one stage.
    #[error("a pipeline needs at least one stage, got 0")]
    ZeroStages,
    /// A step needs at least one micro-batch.
    #[error("a step needs at least one micro-batch, got 0")]
    ZeroMicrobatches,
    /// The stage index is not below the stage count.
    #[error("stage {stage} is out of range for {stages} stages")]
    StageOutOfRange {
        /// The requested stage.
        stage: usize,
        /// The pipeline's stage count.
        stages: usize,
    },
    /// Interleaved 1F1B needs the micro-batches to fill whole rounds of `stages`.
    #[error("interleaved 1F1B needs micro-batches divisible by stages: {microbatches} % {stages} = {}", microbatches % stages)]
    InterleavedIndivisible {
        /// Micro-batches per step.
        microbatches: usize,
        /// Pipeline stages.
        stages: usize,
    },
    /// Interleaving needs at least two model chunks per rank.
    #[error("interleaved 1F1B needs at least 2 chunks per rank, got {chunks}")]
    TooFewChunks {
        /// The requested chunks per rank.
        chunks: usize,
    },
    /// The cost table does not have one entry per virtual stage, or holds a negative or
    /// non-finite time.
    #[error("costs: {what} (expected {virtual_stages} virtual stages of finite, non-negative seconds)")]
    BadCosts {
        /// What is wrong.
        what: String,
        /// Virtual stages of the simulated pipeline.
        virtual_stages: usize,
    },
    /// The instruction lists handed to the simulator are not one per stage.
    #[error("{lists} instruction lists for {stages} stages")]
    ListCount {
        /// Lists given.
        lists: usize,
        /// Stages of the pipeline.
        stages: usize,
    },
    /// An instruction names a micro-batch or chunk outside the step, or runs twice, or a
    /// `(microbatch, chunk)` lacks its forward or backward, or mixes `Backward` with the split ops.
    #[error("stage {stage}: {problem}")]
    Coverage {
        /// The rank whose list is wrong.
        stage: usize,
        /// What is wrong, with the instruction.
        problem: String,
    },
    /// No rank can start its next instruction while some have instructions left.
    #[error("deadlock after {done} of {total} instructions: {}", describe_stuck(.stuck))]
    Deadlock {
        /// Each stuck rank, its next instruction, and how many of its instructions it ran.
        stuck: Vec<(usize, Instr, usize)>,
        /// Instructions completed over all ranks.
        done: usize,
        /// Instructions over all ranks.
        total: usize,
    },
}

fn describe_stuck(stuck: &[(usize, Instr, usize)]) -> String {
    let parts: Vec<String> = stuck
        .iter()
        .map(|(stage, instr, ran)| format!("stage {stage} waits at {:?}(mb {}, chunk {}) after {ran} instructions", instr.op, instr.microbatch, instr.chunk))
        .collect();
    parts.join("; ")
}
