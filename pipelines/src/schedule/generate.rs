//! The four schedules' instruction lists, one function each; arguments are already validated.

use std::collections::VecDeque;

use super::{Instr, Op};

fn forward(microbatch: usize, chunk: usize) -> Instr {
    Instr { op: Op::Forward, microbatch, chunk }
}

fn backward(microbatch: usize, chunk: usize) -> Instr {
    Instr { op: Op::Backward, microbatch, chunk }
}

/// GPipe: every forward in micro-batch order, then every backward in micro-batch order (the
/// last stage starts backward with micro-batch 0, whose activations are the oldest).
pub(super) fn gpipe(microbatches: usize) -> Vec<Instr> {
    let forwards = (0..microbatches).map(|mb| forward(mb, 0));
    let backwards = (0..microbatches).map(|mb| backward(mb, 0));
    forwards.chain(backwards).collect()
}

/// 1F1B: `min(p - s - 1, m)` warm-up forwards, then forward `w + i` and backward `i` in
/// alternation, then the remaining backwards.
pub(super) fn one_f_one_b(stages: usize, microbatches: usize, stage: usize) -> Vec<Instr> {
    let warmup = (stages - stage - 1).min(microbatches);
    let mut list = Vec::with_capacity(2 * microbatches);
    list.extend((0..warmup).map(|mb| forward(mb, 0)));
    for i in 0..microbatches - warmup {
        list.push(forward(warmup + i, 0));
        list.push(backward(i, 0));
    }
    list.extend((microbatches - warmup..microbatches).map(|mb| backward(mb, 0)));
    list
}

/// Megatron's interleaved 1F1B. The rank walks `m * chunks` (micro-batch, chunk) units in
/// rounds of `p` micro-batches: forward unit `k` is chunk `(k / p) % chunks` of micro-batch
/// `(k / (p * chunks)) * p + k % p`; backward unit `k` is the same with the chunk order
/// reversed. Warm-up is `2 (p - s - 1) + (chunks - 1) p` forward units (capped at all of
/// them), then one forward and one backward unit in alternation, then the remaining backwards.
pub(super) fn interleaved(stages: usize, microbatches: usize, stage: usize, chunks: usize) -> Vec<Instr> {
    let total = microbatches * chunks;
    let unit = |k: usize, reversed: bool| {
        let in_round = (k / stages) % chunks;
        let chunk = if reversed { chunks - 1 - in_round } else { in_round };
        let microbatch = (k / (stages * chunks)) * stages + k % stages;
        (microbatch, chunk)
    };
    let f = |k: usize| {
        let (mb, chunk) = unit(k, false);
        forward(mb, chunk)
    };
    let b = |k: usize| {
        let (mb, chunk) = unit(k, true);
        backward(mb, chunk)
    };
    let warmup = (2 * (stages - stage - 1) + (chunks - 1) * stages).min(total);
    let mut list = Vec::with_capacity(2 * total);
    list.extend((0..warmup).map(f));
    for k in 0..total - warmup {
        list.push(f(warmup + k));
        list.push(b(k));
    }
    list.extend((total - warmup..total).map(b));
    list
}

/// ZB-H1: 1F1B's order of forwards and input-gradient backwards; each `BackwardInput` queues
/// its `BackwardWeight`, and the oldest queued one runs right after it except for the first `s`
/// backwards of stage `s`, so stage `s` carries `s` deferred weight gradients into the
/// cool-down, where they fill the time 1F1B spends waiting for gradients. The queue drains at
/// the end.
pub(super) fn zb_h1(stages: usize, microbatches: usize, stage: usize) -> Vec<Instr> {
    let warmup = (stages - stage - 1).min(microbatches);
    let mut list = Vec::with_capacity(3 * microbatches);
    let mut pending = VecDeque::with_capacity(stage + 1);
    let mut backward_input = |list: &mut Vec<Instr>, index: usize, mb: usize| {
        list.push(Instr { op: Op::BackwardInput, microbatch: mb, chunk: 0 });
        pending.push_back(mb);
        if index >= stage {
            if let Some(w) = pending.pop_front() {
                list.push(Instr { op: Op::BackwardWeight, microbatch: w, chunk: 0 });
            }
        }
    };
    list.extend((0..warmup).map(|mb| forward(mb, 0)));
    for i in 0..microbatches - warmup {
        list.push(forward(warmup + i, 0));
        backward_input(&mut list, i, i);
    }
    for mb in microbatches - warmup..microbatches {
        backward_input(&mut list, mb, mb);
    }
    list.extend(pending.into_iter().map(|mb| Instr { op: Op::BackwardWeight, microbatch: mb, chunk: 0 }));
    list
}
