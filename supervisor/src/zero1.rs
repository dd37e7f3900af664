//! ZeRO-1 without re-runs: every rank's segment state is also held by a buddy rank.
//!
//! Under ZeRO-1 rank `r` of `n` owns one segment of every parameter bucket: the parameter values
//! and the optimizer state of those elements ([`rtx_pipelines::ParamShard`]). After step `s`'s
//! update and parameter all-gather, rank `r` encodes its **segment state** ([`Layout::encode`]: the
//! step, the parameter values of its slices, its optimizer's state tensors) and sends it to its
//! buddy `(r + 1) % n` while receiving `(r + n - 1) % n`'s ([`exchange`]). Only then is `s`
//! committed on `r` (its `StepDone` goes out), so a committed step is always held twice.
//!
//! Each rank keeps the copies of its **last two** exchanged steps ([`BuddyCopies`]): its own
//! segment and its buddy's, as of `s` and as of `s - 1`. One step is not enough with three ranks
//! or more: a re-formation aborts the exchange of step `s` wherever it stands, so some ranks
//! commit `s` and others stay at `s - 1` (their buddy's copy of `s` never arrived); with only the
//! newest copies kept, the lost rank's segment would be held at `s - 1` and its neighbours' at `s`
//! only, and no step would be covered. Every rank has committed `s - 1` once any rank finishes
//! the all-gather of `s` (that needs every rank's segment of `s`, sent after its exchange of
//! `s - 1`), so the older of the two copies is dropped then, before the next encoding: a rank
//! holds four segment states (about four times its ZeRO-1 shard), at every moment.
//!
//! A member reports what it holds in `Ready` ([`BuddyCopies::held`]); when every segment of one
//! layout has a holder at one step, the supervisor answers `StateSource::Zero1Segments` and the
//! new generation rebuilds the whole state from them ([`rebuild_from_segments`]: each old segment
//! is broadcast by its holder and placed, not summed, so the result is bit-identical to what the
//! old layout held), then slices it for its own layout as after any other sync.
//!
//! **Decision: per-step buddy copies or snapshots only (`[elastic] zero_copies`).** Constraint:
//! no rank holds a ZeRO-1/2 job's whole optimizer state, so a lost rank's segment must come from
//! somewhere; the buddy exchange above pays for that at every step (an encoding of the segment
//! state, on a GPU its download, and a send of its size: for GPT-2 124M, ~831 MiB per rank per
//! step, which took ZeRO-1 from 282 to ~1690 ms/step on one H100 shared by two workers).
//! `zero_copies = "buddy"` (the default) keeps it: a loss re-runs at most the step in flight.
//! `zero_copies = "snapshot"` skips it (`Engine::secure` does nothing, `Ready` reports no
//! copies): a step commits right after its update, and a loss rolls the job back to the last
//! snapshot (every `snapshot_every` steps and at every checkpoint), the path a rank lost with
//! its buddy already takes ([`crate::recovery::plan_recovery`] picks the member holding the
//! newest snapshot), and re-runs the steps since, bit-identically at the same world size (batches
//! are indexed by step, rank and world). Pros: nothing paid per step and no copy memory; cons:
//! up to `snapshot_every - 1` steps re-run per failure, and the snapshot's own gather every
//! `snapshot_every` steps stays. The supervisor logs such a rollback with its re-run count and
//! does not call it suspect. ZeRO-3 takes no snapshots and keeps the buddy copies (the
//! combination is a config error). Encoding downloads device tensors in batches of at most
//! 64 MiB (one wait each, not one per tensor); the format is unchanged.
//!
//! The wire and memory form of a segment state is one `u32` buffer (the bits of every value in
//! its own dtype, nothing widened), self-describing: parameter runs by parameter index and element
//! range, optimizer state tensors by their index in the full-form template.

use std::collections::BTreeMap;
use std::ops::Range;

use rtx_collectives::Communicator;
use rtx_pipelines::ParamSlice;
use rtx_tensor::{CpuData, DType, FloatSlice, Module, Tensor};

use crate::error::{Result, SupervisorError};
use crate::protocol::Zero1Held;
use crate::state::NamedTensors;

/// First word of an encoded segment state (format version 1).
const MAGIC: u32 = 0x5a31_5301;
/// Dtype codes of encoded tensors.
const F32: u32 = 0;
const F64: u32 = 1;
const BF16: u32 = 2;
const U32: u32 = 3;

/// Where every parameter and optimizer state tensor lives in the full form: the map between a
/// rank's slices and the whole model. Built once per generation from the model and the full-form
/// template ([`crate::state::full_template`]).
#[derive(Clone, Debug)]
pub struct Layout {
    /// Per parameter (visit order): its name and its range in the flat parameter vector.
    params: Vec<(String, Range<usize>)>,
    by_name: BTreeMap<String, usize>,
    /// Per template tensor: its name, element count and whether it is a scalar `step` field.
    template: Vec<(String, usize, bool)>,
    template_by_name: BTreeMap<String, usize>,
}

impl Layout {
    /// The layout of `model`'s parameters and of the full-form optimizer state `template`.
    pub fn new<M: Module + ?Sized>(model: &M, template: &[(String, Tensor)]) -> Result<Layout> {
        let mut params = Vec::new();
        let mut by_name = BTreeMap::new();
        let mut offset = 0;
        for (name, p) in model.named_parameters() {
            by_name.insert(name.clone(), params.len());
            params.push((name, offset..offset + p.numel()));
            offset += p.numel();
        }
        let mut entries = Vec::with_capacity(template.len());
        let mut template_by_name = BTreeMap::new();
        for (name, t) in template {
            let (_, field) = split_field(name)?;
            template_by_name.insert(name.clone(), entries.len());
            entries.push((name.clone(), t.numel(), field == "step"));
        }
        Ok(Layout { params, by_name, template: entries, template_by_name })
    }

    /// Number of parameter elements in the whole model.
    pub fn param_count(&self) -> usize {
        self.params.last().map_or(0, |(_, r)| r.end)
    }

    /// Encodes one rank's segment state as of `step`: the parameter values of `slices` (what its
    /// optimizer updates) and `local`, its optimizer's `state_tensors()`.
    pub fn encode(&self, step: u64, slices: &[ParamSlice], local: &[(String, Tensor)]) -> Result<Vec<u32>> {
        let mut out = Vec::new();
        self.encode_into(&mut out, step, slices, local)?;
        Ok(out)
    }

    /// [`encode`](Self::encode) into `out` (cleared first; a recycled buffer spares the
    /// allocation and its page faults, most of the cost of a small model's exchange).
    pub fn encode_into(&self, out: &mut Vec<u32>, step: u64, slices: &[ParamSlice], local: &[(String, Tensor)]) -> Result<()> {
        out.clear();
        let values: usize = slices.iter().map(|s| s.elements.len()).sum::<usize>() + local.iter().map(|(_, t)| 2 * t.numel()).sum::<usize>();
        out.reserve(values + 8 * (slices.len() + local.len()) + 8);
        out.push(MAGIC);
        push_u64(out, step);
        push_u64(out, slices.len() as u64);
        let mut owned = BTreeMap::new();
        for slice in slices {
            let index = *self.by_name.get(&slice.name).ok_or_else(|| bad(format!("slice of unknown parameter {}", slice.name)))?;
            let whole = &self.params[index].1;
            if slice.elements.end > whole.len() {
                return Err(bad(format!("slice {:?} of {} beyond its {} elements", slice.elements, slice.name, whole.len())));
            }
            if slice.tensor.numel() != slice.elements.len() {
                return Err(bad(format!("slice of {} holds {} values for elements {:?}", slice.name, slice.tensor.numel(), slice.elements)));
            }
            owned.insert(slice.name.as_str(), slice.elements.clone());
            push_u64(out, index as u64);
            push_u64(out, slice.elements.start as u64);
            push_u64(out, slice.elements.len() as u64);
            // Borrowed, not copied, when contiguous f32 (a parameter segment always is).
            slice.tensor.with_float_slice(|values| match values {
                FloatSlice::F32(v) => out.extend_from_slice(bytemuck::cast_slice(v)),
                FloatSlice::F64(v) => out.extend(v.iter().map(|x| (*x as f32).to_bits())),
            })?;
        }
        push_u64(out, local.len() as u64);
        for (name, t) in local {
            let index = *self.template_by_name.get(name).ok_or_else(|| bad(format!("optimizer state {name} is not in the full form")))?;
            let (param, _) = split_field(name)?;
            let start = if self.template[index].2 {
                0
            } else {
                owned.get(param).ok_or_else(|| bad(format!("optimizer state {name} for a parameter without a slice")))?.start
            };
            push_u64(out, index as u64);
            push_u64(out, start as u64);
            push_u64(out, t.numel() as u64);
            if t.dtype() == DType::F32 {
                out.push(F32);
                t.with_float_slice(|values| match values {
                    FloatSlice::F32(v) => out.extend_from_slice(bytemuck::cast_slice(v)),
                    FloatSlice::F64(v) => out.extend(v.iter().map(|x| (*x as f32).to_bits())),
                })?;
                continue;
            }
            match t.to_data()? {
                CpuData::F32(v) => {
                    out.push(F32);
                    out.extend(v.iter().map(|x| x.to_bits()));
                }
                CpuData::F64(v) => {
                    out.push(F64);
                    for x in v {
                        push_u64(out, x.to_bits());
                    }
                }
                CpuData::BF16(v) => {
                    out.push(BF16);
                    out.extend(v.iter().map(|x| u32::from(x.to_bits())));
                }
                CpuData::U32(v) => {
                    out.push(U32);
                    out.extend(v);
                }
                CpuData::I64(_) => return Err(bad(format!("optimizer state {name} is i64, which segment states do not carry"))),
            }
        }
        Ok(())
    }

    /// An empty assembly of the full state.
    pub fn assembler(&self) -> Assembler<'_> {
        Assembler {
            layout: self,
            params: vec![0.0; self.param_count()],
            params_placed: 0,
            values: self.template.iter().map(|(_, n, is_step)| vec![0.0; if *is_step { 1 } else { *n }]).collect(),
            placed: vec![0; self.template.len()],
            steps: vec![None; self.template.len()],
        }
    }
}

/// The step an encoded segment state is of (a ZeRO-1 segment state or a ZeRO-3 unit state,
/// [`crate::zero3::encode`]: both start with their magic word and the step).
pub fn encoded_step(blob: &[u32]) -> Result<u64> {
    let mut r = Reader::new(blob, "ZeRO-1 segment state");
    if ![MAGIC, crate::zero3::MAGIC].contains(&r.word()?) {
        return Err(bad("not a segment state (bad magic)".into()));
    }
    r.u64()
}

/// The full state being rebuilt from segment states (see [`rebuild_from_segments`]).
pub struct Assembler<'a> {
    layout: &'a Layout,
    params: Vec<f32>,
    params_placed: usize,
    values: Vec<Vec<f64>>,
    placed: Vec<usize>,
    steps: Vec<Option<f64>>,
}

impl Assembler<'_> {
    /// Places one encoded segment state of `step`.
    pub fn place(&mut self, blob: &[u32], step: u64) -> Result<()> {
        let mut r = Reader::new(blob, "ZeRO-1 segment state");
        if r.word()? != MAGIC {
            return Err(bad("not a segment state (bad magic)".into()));
        }
        let got = r.u64()?;
        if got != step {
            return Err(bad(format!("a segment state of step {got} where step {step} was asked for")));
        }
        for _ in 0..r.u64()? {
            let index = r.usize()?;
            let start = r.usize()?;
            let len = r.usize()?;
            let whole = self.layout.params.get(index).ok_or_else(|| bad(format!("parameter {index} does not exist")))?.1.clone();
            if start + len > whole.len() {
                return Err(bad(format!("elements {start}..{} beyond parameter {index}'s {}", start + len, whole.len())));
            }
            let words = r.take(len)?;
            for (dst, w) in self.params[whole.start + start..whole.start + start + len].iter_mut().zip(words) {
                *dst = f32::from_bits(*w);
            }
            self.params_placed += len;
        }
        for _ in 0..r.u64()? {
            let index = r.usize()?;
            let start = r.usize()?;
            let len = r.usize()?;
            let dtype = r.word()?;
            let (name, numel, is_step) = self.layout.template.get(index).ok_or_else(|| bad(format!("optimizer state {index} does not exist")))?.clone();
            let values: Vec<f64> = match dtype {
                F32 => r.take(len)?.iter().map(|w| f64::from(f32::from_bits(*w))).collect(),
                F64 => (0..len).map(|_| r.u64().map(f64::from_bits)).collect::<Result<_>>()?,
                BF16 => r.take(len)?.iter().map(|w| f64::from(f32::from_bits(w << 16))).collect(),
                U32 => r.take(len)?.iter().map(|w| f64::from(*w)).collect(),
                other => return Err(bad(format!("optimizer state {name}: unknown dtype code {other}"))),
            };
            if is_step {
                let value = *values.first().ok_or_else(|| bad(format!("optimizer state {name}: no value")))?;
                let slot = &mut self.steps[index];
                *slot = Some(slot.map_or(value, |v: f64| v.max(value)));
                continue;
            }
            if start + len > numel {
                return Err(bad(format!("optimizer state {name}: elements {start}..{} beyond {numel}", start + len)));
            }
            self.values[index][start..start + len].copy_from_slice(&values);
            self.placed[index] += len;
        }
        if r.at != blob.len() {
            return Err(bad(format!("{} words after the segment state", blob.len() - r.at)));
        }
        Ok(())
    }

    /// The whole state, once every segment is placed: the flat parameters (visit order) and the
    /// full-form optimizer state shaped like `template`. Fails when an element was not placed
    /// exactly once (segments are disjoint; a count that does not match means a hole).
    pub fn finish(self, template: &[(String, Tensor)]) -> Result<(Vec<f32>, NamedTensors)> {
        if self.params_placed != self.params.len() {
            return Err(bad(format!("segments hold {} of {} parameter values", self.params_placed, self.params.len())));
        }
        let mut out = Vec::with_capacity(template.len());
        for (index, (name, t)) in template.iter().enumerate() {
            let (_, numel, is_step) = &self.layout.template[index];
            let data = if *is_step {
                vec![self.steps[index].ok_or_else(|| bad(format!("no segment holds {name}")))?]
            } else {
                if self.placed[index] != *numel {
                    return Err(bad(format!("segments hold {} of {numel} values of {name}", self.placed[index])));
                }
                self.values[index].clone()
            };
            out.push((name.clone(), Tensor::from_vec(data, t.shape())?.to_dtype(t.dtype())?));
        }
        Ok((self.params, out))
    }
}

/// One exchanged step's copies: this rank's own segment state and its buddy's.
#[derive(Clone, Debug)]
pub struct HeldCopies {
    /// The generation the layout was trained in.
    pub generation: u64,
    /// The layout's world size.
    pub world: u32,
    /// This member's rank in it.
    pub rank: u32,
    /// The step both copies are of.
    pub step: u64,
    /// Segment `rank`'s state.
    pub own: Vec<u32>,
    /// Segment `(rank + world - 1) % world`'s state (empty in a world of one, where it is `own`).
    pub buddy: Vec<u32>,
}

impl HeldCopies {
    fn bytes(&self) -> usize {
        4 * (self.own.len() + self.buddy.len())
    }
}

/// The copies of the last two exchanged steps (see the module doc).
#[derive(Clone, Debug, Default)]
pub struct BuddyCopies {
    latest: Option<HeldCopies>,
    previous: Option<HeldCopies>,
    /// The buffers of dropped copies, for the next encoding and the next received copy.
    spare: Vec<Vec<u32>>,
}

impl BuddyCopies {
    /// What this member holds, newest first, for `Ready`.
    pub fn held(&self) -> Vec<Zero1Held> {
        [&self.latest, &self.previous]
            .into_iter()
            .flatten()
            .map(|c| Zero1Held { generation: c.generation, world: c.world, rank: c.rank, step: c.step })
            .collect()
    }

    /// The newest exchanged step.
    pub fn latest_step(&self) -> Option<u64> {
        self.latest.as_ref().map(|c| c.step)
    }

    /// The state of old segment `segment` of the layout of `world` ranks as of `step`, if held
    /// (the newest generation's copy when several match: one world size has one layout).
    pub fn segment(&self, world: u32, step: u64, segment: u32) -> Option<&[u32]> {
        [&self.latest, &self.previous].into_iter().flatten().filter(|c| c.world == world && c.step == step && world > 0).find_map(|c| {
            if segment == c.rank {
                Some(c.own.as_slice())
            } else if segment == (c.rank + world - 1) % world {
                Some(c.buddy.as_slice())
            } else {
                None
            }
        })
    }

    /// Drops the older copies. Call it once this rank finished the parameter all-gather of the
    /// step after the newest copies' (before encoding its own segment state of that step): every
    /// rank has committed the newest copies by then (see the module doc).
    pub fn drop_previous(&mut self) {
        if let Some(old) = self.previous.take() {
            self.spare = vec![old.own, old.buddy];
        }
    }

    /// A buffer for the next encoding: one of the dropped copies', or a new one.
    pub fn spare(&mut self) -> Vec<u32> {
        self.spare.pop().unwrap_or_default()
    }

    /// Exchanges this rank's segment state after `step` (`own`, from [`Layout::encode`]) with the
    /// buddies ([`exchange`]) and commits the copies; `comm` is the group of `generation`. On an
    /// error nothing new is committed.
    pub async fn exchange_step(&mut self, comm: &Communicator, generation: u64, step: u64, own: Vec<u32>) -> Result<()> {
        // In a group of one the own copy is the buddy's too: nothing to send or keep twice.
        let buddy = if comm.size() == 1 {
            Vec::new()
        } else {
            let into = self.spare();
            let buddy = exchange(comm, &own, into).await?;
            let got = encoded_step(&buddy)?;
            if got != step {
                return Err(bad(format!("the buddy sent its state of step {got} in the exchange of step {step}")));
            }
            buddy
        };
        let copies = HeldCopies { generation, world: comm.size() as u32, rank: comm.rank() as u32, step, own, buddy };
        self.previous = self.latest.replace(copies);
        Ok(())
    }

    /// Forgets everything (a new generation synced the whole state).
    pub fn clear(&mut self) {
        *self = BuddyCopies::default();
    }

    /// Bytes held now.
    pub fn bytes(&self) -> usize {
        [&self.latest, &self.previous].into_iter().flatten().map(HeldCopies::bytes).sum()
    }
}

/// Sends `own` (this rank's encoded segment state) to the buddy `(rank + 1) % n` and returns the
/// segment state of `(rank + n - 1) % n`, received at the same time into `into` (a recycled
/// buffer, or an empty one). In a group of one, a copy of `own`.
pub async fn exchange(comm: &Communicator, own: &[u32], mut into: Vec<u32>) -> Result<Vec<u32>> {
    let (rank, n) = (comm.rank(), comm.size());
    into.clear();
    if n == 1 {
        into.extend_from_slice(own);
        return Ok(into);
    }
    let len = own.len() as u64;
    let send = async {
        comm.send(&[len as u32, (len >> 32) as u32], (rank + 1) % n).await?;
        comm.send(own, (rank + 1) % n).await
    };
    let recv = async {
        let from = (rank + n - 1) % n;
        let mut len = [0u32; 2];
        comm.recv(&mut len, from).await?;
        into.resize(to_usize(u64::from(len[0]) | (u64::from(len[1]) << 32))?, 0);
        comm.recv(&mut into, from).await?;
        Ok::<_, SupervisorError>(into)
    };
    let (sent, received) = tokio::join!(send, recv);
    sent?;
    received
}

/// Rebuilds the state of `step` from the segments of the layout of `world` ranks: old segment
/// `i` is broadcast by the member of rank `holders[i]` (which must hold it in `copies`) and placed
/// by everyone. Returns the flat parameters and the full-form optimizer state on every rank.
pub async fn rebuild_from_segments(
    comm: &Communicator,
    copies: &BuddyCopies,
    layout: &Layout,
    template: &[(String, Tensor)],
    step: u64,
    world: u32,
    holders: &[u32],
) -> Result<(Vec<f32>, NamedTensors)> {
    if holders.len() != world as usize {
        return Err(bad(format!("{} holders for a layout of {world} segments", holders.len())));
    }
    let mut assembler = layout.assembler();
    for (segment, &holder) in holders.iter().enumerate() {
        let holder = holder as usize;
        let mine = holder == comm.rank();
        let mut buf = if mine {
            copies
                .segment(world, step, segment as u32)
                .ok_or_else(|| bad(format!("asked to send segment {segment} of {world} as of step {step}, which this member does not hold")))?
                .to_vec()
        } else {
            Vec::new()
        };
        if comm.size() > 1 {
            let mut len = [buf.len() as u32, (buf.len() as u64 >> 32) as u32];
            comm.broadcast(&mut len, holder).await?;
            if !mine {
                buf = vec![0u32; to_usize(u64::from(len[0]) | (u64::from(len[1]) << 32))?];
            }
            comm.broadcast(&mut buf, holder).await?;
        }
        assembler.place(&buf, step)?;
    }
    assembler.finish(template)
}

/// Bytes of what one rank owns under ZeRO-1 (its parameter segments and optimizer state), and of
/// a replica's whole parameters and full optimizer state (plain data parallelism), for the memory
/// report. `template` is the full-form state.
pub fn shard_and_replica_bytes(slices: &[ParamSlice], local: &[(String, Tensor)], param_count: usize, template: &[(String, Tensor)]) -> (usize, usize) {
    let bytes = |t: &Tensor| t.numel() * t.dtype().size_in_bytes();
    let shard = slices.iter().map(|s| s.elements.len() * s.tensor.dtype().size_in_bytes()).sum::<usize>() + local.iter().map(|(_, t)| bytes(t)).sum::<usize>();
    let replica = param_count * 4 + template.iter().map(|(_, t)| bytes(t)).sum::<usize>();
    (shard, replica)
}

fn split_field(name: &str) -> Result<(&str, &str)> {
    name.rsplit_once('.').ok_or_else(|| bad(format!("optimizer state name {name:?} has no field")))
}

/// Appends `v` as two little-endian words (the encoding of ZeRO-1 and ZeRO-3 segment states).
pub(crate) fn push_u64(out: &mut Vec<u32>, v: u64) {
    out.push(v as u32);
    out.push((v >> 32) as u32);
}

/// Appends `s` as its length then one word per byte.
pub(crate) fn push_str(out: &mut Vec<u32>, s: &str) {
    push_u64(out, s.len() as u64);
    out.extend(s.bytes().map(u32::from));
}

fn to_usize(v: u64) -> Result<usize> {
    usize::try_from(v).map_err(|_| bad(format!("length {v} does not fit this machine")))
}

fn bad(reason: String) -> SupervisorError {
    SupervisorError::Job(format!("ZeRO-1 segment state: {reason}"))
}

/// Reads the words of an encoded segment state; every error names `what` is being read.
pub(crate) struct Reader<'a> {
    blob: &'a [u32],
    at: usize,
    what: &'static str,
}

impl<'a> Reader<'a> {
    /// A reader of `blob`, a `what` ("ZeRO-1 segment state").
    pub(crate) fn new(blob: &'a [u32], what: &'static str) -> Self {
        Reader { blob, at: 0, what }
    }

    fn bad(&self, reason: &str) -> SupervisorError {
        SupervisorError::Job(format!("{}: {reason}", self.what))
    }

    /// Words not read yet.
    pub(crate) fn remaining(&self) -> usize {
        self.blob.len() - self.at
    }

    pub(crate) fn word(&mut self) -> Result<u32> {
        let w = *self.blob.get(self.at).ok_or_else(|| self.bad("truncated"))?;
        self.at += 1;
        Ok(w)
    }

    pub(crate) fn u64(&mut self) -> Result<u64> {
        Ok(u64::from(self.word()?) | (u64::from(self.word()?) << 32))
    }

    pub(crate) fn usize(&mut self) -> Result<usize> {
        let v = self.u64()?;
        usize::try_from(v).map_err(|_| self.bad(&format!("length {v} does not fit this machine")))
    }

    pub(crate) fn take(&mut self, n: usize) -> Result<&'a [u32]> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.blob.len()).ok_or_else(|| self.bad("truncated"))?;
        let words = &self.blob[self.at..end];
        self.at = end;
        Ok(words)
    }

    pub(crate) fn string(&mut self) -> Result<String> {
        let n = self.usize()?;
        let bytes = self.take(n)?.iter().map(|w| u8::try_from(*w).map_err(|_| self.bad("a name byte out of range"))).collect::<Result<Vec<u8>>>()?;
        String::from_utf8(bytes).map_err(|_| self.bad("a name that is not UTF-8"))
    }
}
