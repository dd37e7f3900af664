//! A stage's mailbox of activations and gradients. Messages between two stages travel in the
//! sender's order on one point-to-point channel, but a schedule may need them in another order (with
//! interleaving and two stages, one channel carries both activations and gradients), so every
//! message starts with a small header naming what it is — `(kind, micro-batch, virtual stage)` — and
//! the mailbox files what arrives early until the schedule asks for it. A message is never matched
//! by position alone, so a mismatch between two ranks' schedules is a typed error, not silently
//! mixed-up tensors.

use std::collections::BTreeMap;

use crate::error::{Error, Result};
use crate::pipeline::blocking::BlockingGroup;
use crate::pipeline::sender::SendQueue;

/// What a pipeline message carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Kind {
    /// The output of virtual stage `v - 1`, the input of `v`.
    Activation,
    /// The gradient of virtual stage `v + 1`'s input, the output gradient of `v`.
    Gradient,
}

impl Kind {
    fn code(self) -> f32 {
        match self {
            Kind::Activation => 1.0,
            Kind::Gradient => 2.0,
        }
    }

    fn from_code(code: f32) -> Option<Kind> {
        if code == 1.0 {
            Some(Kind::Activation)
        } else if code == 2.0 {
            Some(Kind::Gradient)
        } else {
            None
        }
    }
}

/// A message's identity: what, for which micro-batch, addressed to which virtual stage.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Key {
    /// Activation or gradient.
    pub kind: Kind,
    /// Micro-batch index.
    pub microbatch: usize,
    /// The virtual stage that consumes it.
    pub stage: usize,
}

const HEADER: usize = 4;

/// The message that carries `payload` under `key`: the header, then the payload.
pub(crate) fn frame(key: Key, payload: &[f32]) -> Vec<f32> {
    let mut message = Vec::with_capacity(HEADER + payload.len());
    // Small integers are exact in f32 up to 2^24; the header checks them on arrival.
    message.extend_from_slice(&[key.kind.code(), key.microbatch as f32, key.stage as f32, payload.len() as f32]);
    message.extend_from_slice(payload);
    debug_assert_eq!(message.len(), HEADER + payload.len());
    message
}

/// The pending messages of one stage.
#[derive(Default, Debug)]
pub struct Mailbox {
    pending: BTreeMap<Key, Vec<f32>>,
    /// Messages taken from the wire: `(kind, micro-batch, stage)` in arrival order, for tests.
    received: usize,
}

impl Mailbox {
    /// Sends `payload` to group rank `dst` under `key` (a message to oneself is filed at once).
    pub fn send(&mut self, group: &BlockingGroup, dst: usize, key: Key, payload: &[f32]) -> Result<()> {
        if dst == group.rank() {
            self.pending.insert(key, payload.to_vec());
            return Ok(());
        }
        group.send(&frame(key, payload), dst)
    }

    /// Posts `payload` (owned, not copied) to `queue`'s thread for group rank `dst` under `key`;
    /// a message to oneself is filed at once. The frame is the one [`Mailbox::send`] sends.
    pub fn post(&mut self, queue: &SendQueue, dst: usize, key: Key, payload: Vec<f32>) -> Result<()> {
        if dst == queue.rank() {
            self.pending.insert(key, payload);
            return Ok(());
        }
        queue.post(dst, key, payload)
    }

    /// The payload under `key` from group rank `src`, of `len` elements: from the pending messages, or
    /// received from `src` (filing the others) until it arrives.
    pub fn take(&mut self, group: &BlockingGroup, src: usize, key: Key, len: usize) -> Result<Vec<f32>> {
        loop {
            if let Some(payload) = self.pending.remove(&key) {
                if payload.len() != len {
                    return Err(Error::Pipeline { reason: format!("{key:?}: {} values arrived, {len} expected", payload.len()) });
                }
                return Ok(payload);
            }
            if src == group.rank() {
                return Err(Error::Pipeline { reason: format!("{key:?}: waited for a message to itself that was never sent (the schedule is inconsistent)") });
            }
            // Every message on this schedule's channel has the same length (activations and their
            // gradients share a shape), so the receive buffer is sized by the one asked for.
            let mut message = vec![0f32; HEADER + len];
            group.recv(&mut message, src)?;
            self.received += 1;
            let kind = Kind::from_code(message[0]).ok_or_else(|| Error::Pipeline { reason: format!("a message from pipeline rank {src} has the unknown kind {}", message[0]) })?;
            let header_len = message[3];
            if header_len != len as f32 {
                return Err(Error::Pipeline { reason: format!("a message from pipeline rank {src} carries {header_len} values, {len} expected") });
            }
            let arrived = Key { kind, microbatch: message[1] as usize, stage: message[2] as usize };
            message.drain(..HEADER);
            if self.pending.insert(arrived, message).is_some() {
                return Err(Error::Pipeline { reason: format!("{arrived:?} arrived twice from pipeline rank {src}") });
            }
        }
    }

    /// Messages still filed (a completed step leaves none).
    pub fn pending(&self) -> usize {
        self.pending.len()
    }
}
