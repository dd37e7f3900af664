//! The messages between the coordinator and its client hosts (rkyv, over an [`rtx_actors::Link`]),
//! and the join proof.
//!
//! Join: a host dials the coordinator and `ask`s [`ToCoordinator::Join`] with
//! `HMAC-SHA256(token, "rtx-fed-host" ‖ ekm)` over the TLS exporter of that very connection
//! ([`rtx_actors::auth`]); the coordinator answers with its own proof (role
//! "rtx-fed-coordinator") and the federation's config, which the host checks before trusting
//! anything. A round: the coordinator `tell`s each live host [`ToHost::Round`] (the model and the
//! host's sampled positions); the host `tell`s back one [`ToCoordinator::Piece`] per piece, then
//! [`ToCoordinator::RoundDone`] with their count. Pieces travel one per envelope, so a message is
//! at most about one model (the link caps an envelope at 16 MiB, i.e. models up to ~4M floats).
//!
//! A secure round (`[secagg]`) runs the four SecAgg+ phases over the same links: the coordinator
//! holds the server, each host its sampled clients' state; per phase the coordinator sends each
//! host the messages addressed to its clients (in chunks, the last one flagged), the host answers
//! with its clients' messages and [`ToCoordinator::PhaseDone`]. The coordinator only ever sees
//! masked inputs and the sum.

use crate::round::{ClientOutcome, PartialSum, Piece};
use crate::secagg::{AdvertiseKeys, ForwardedShares, MaskedInput, Roster, ShareKeys, UnmaskRequest, UnmaskShares};

/// Protocol messages per envelope in a secure round's chunks (a chunk stays a few MiB at most for
/// neighbour degrees up to about 100).
pub const SECURE_CHUNK: usize = 256;

/// `items` in chunks of at most [`SECURE_CHUNK`], each with whether it is the last; always at least
/// one chunk (an empty last one for no items), so the receiver always learns the phase's input is
/// complete.
pub(crate) fn secure_chunks<M>(items: Vec<M>) -> impl Iterator<Item = (Vec<M>, bool)> {
    let mut items = items.into_iter().peekable();
    let mut first = true;
    std::iter::from_fn(move || {
        if !first && items.peek().is_none() {
            return None;
        }
        first = false;
        let chunk: Vec<M> = items.by_ref().take(SECURE_CHUNK).collect();
        Some((chunk, items.peek().is_none()))
    })
}

/// Actor name of the coordinator on its links.
pub const COORDINATOR: &str = "fed-coordinator";
/// Actor name of a client host on its link.
pub const HOST: &str = "fed-host";
/// The host's role in the join proof.
pub const HOST_ROLE: &[u8] = b"rtx-fed-host";
/// The coordinator's role in the join proof.
pub const COORDINATOR_ROLE: &[u8] = b"rtx-fed-coordinator";

/// Messages to the coordinator.
#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize, Clone, Debug, PartialEq)]
pub enum ToCoordinator {
    /// Asks to join with the population slice `slice_start..slice_end` (an `ask`, answered by a
    /// [`JoinReply`]).
    Join { name: String, pid: u32, slice_start: u32, slice_end: u32, proof: Vec<u8> },
    /// One piece of `round`'s tree.
    Piece { round: u32, piece: WirePiece },
    /// All `pieces` of `round` are sent; `seconds` is the host's wall time (reporting only).
    RoundDone { round: u32, pieces: u32, seconds: f64 },
    /// Secure round, phase 0: advertised keys of some of the host's clients.
    Adverts { round: u32, adverts: Vec<AdvertiseKeys> },
    /// Secure round, phase 1: sealed shares of some of the host's clients.
    Shares { round: u32, shares: Vec<ShareKeys> },
    /// Secure round, phase 2: one client's masked input.
    Masked { round: u32, masked: MaskedInput },
    /// Secure round, phase 3: unmasking shares of some of the host's clients.
    Unmasks { round: u32, unmasks: Vec<UnmaskShares> },
    /// Secure round: the host sent everything of `phase`. `counts`: after phase 0 its clients
    /// dropped and straggling by fate, after phase 2 those that withheld a malformed update.
    PhaseDone { round: u32, phase: u8, counts: [u64; 2] },
}

/// The coordinator's answer to a join.
#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize, Clone, Debug, PartialEq)]
pub enum JoinReply {
    /// Joined as host `host`; `proof` is the coordinator's, `config_toml` the federation's config.
    Accepted { host: u32, proof: Vec<u8>, config_toml: String },
    /// Refused, and why.
    Refused { reason: String },
}

/// Messages to a client host.
#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize, Clone, Debug, PartialEq)]
pub enum ToHost {
    /// Train `round`: the host's clients are `clients`, at positions `lo..lo + clients.len()` of
    /// the round's `k` sampled clients; `model` is the global model.
    Round { round: u32, k: u32, lo: u32, clients: Vec<u32>, model: Vec<f32> },
    /// Secure round `round` (`[secagg]`), phase 0: the host's sampled `clients` (ascending) and the
    /// global model they will train at phase 2; the host answers with their keys.
    SecureRound { round: u32, clients: Vec<u32>, model: Vec<f32> },
    /// Phase 1 input, in chunks; on the `last` chunk the host's clients share their keys.
    Rosters { round: u32, rosters: Vec<Roster>, last: bool },
    /// Phase 2 input, in chunks; on the `last` chunk the host's clients train and mask.
    Forwarded { round: u32, forwarded: Vec<ForwardedShares>, last: bool },
    /// Phase 3 input, in chunks; on the `last` chunk the host's clients reveal the shares asked.
    UnmaskRequests { round: u32, requests: Vec<UnmaskRequest>, last: bool },
    /// The federation is over: exit.
    Finish,
}

/// A [`Piece`] on the wire.
#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize, Clone, Debug, PartialEq)]
pub enum WirePiece {
    /// A whole node (`counts`: done, dropped, stragglers, rejected, empty).
    Node { lo: u32, hi: u32, sum: Vec<f32>, weight: f64, counts: [u64; 5], contributors: Vec<u32> },
    /// A trained client of a shared leaf.
    Trained { pos: u32, update: Vec<f32>, weight: f32 },
    /// A client of a shared leaf that did not train: 0 dropped, 1 straggler, 2 rejected, 3 empty.
    Untrained { pos: u32, why: u8 },
}

impl From<Piece> for WirePiece {
    fn from(piece: Piece) -> Self {
        match piece {
            Piece::Node { lo, hi, partial } => WirePiece::Node {
                lo,
                hi,
                sum: partial.sum,
                weight: partial.weight,
                counts: [partial.done, partial.dropped, partial.stragglers, partial.rejected, partial.empty],
                contributors: partial.contributors,
            },
            Piece::Client { pos, outcome } => match outcome {
                ClientOutcome::Trained { update, weight } => WirePiece::Trained { pos, update, weight },
                ClientOutcome::Dropped => WirePiece::Untrained { pos, why: 0 },
                ClientOutcome::Straggler => WirePiece::Untrained { pos, why: 1 },
                ClientOutcome::Rejected => WirePiece::Untrained { pos, why: 2 },
                ClientOutcome::Empty => WirePiece::Untrained { pos, why: 3 },
            },
        }
    }
}

impl TryFrom<WirePiece> for Piece {
    type Error = String;

    fn try_from(piece: WirePiece) -> Result<Self, String> {
        Ok(match piece {
            WirePiece::Node { lo, hi, sum, weight, counts, contributors } => {
                let [done, dropped, stragglers, rejected, empty] = counts;
                Piece::Node { lo, hi, partial: PartialSum { sum, weight, done, dropped, stragglers, rejected, empty, contributors } }
            }
            WirePiece::Trained { pos, update, weight } => Piece::Client { pos, outcome: ClientOutcome::Trained { update, weight } },
            WirePiece::Untrained { pos, why } => {
                let outcome = match why {
                    0 => ClientOutcome::Dropped,
                    1 => ClientOutcome::Straggler,
                    2 => ClientOutcome::Rejected,
                    3 => ClientOutcome::Empty,
                    other => return Err(format!("unknown client outcome {other} at position {pos}")),
                };
                Piece::Client { pos, outcome }
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_survive_the_wire_and_unknown_outcomes_are_refused() {
        let node = Piece::Node {
            lo: 0,
            hi: 2,
            partial: PartialSum { sum: vec![1.0, -2.0], weight: 16.0, done: 1, dropped: 1, stragglers: 0, rejected: 0, empty: 0, contributors: vec![7] },
        };
        let client = Piece::Client { pos: 3, outcome: ClientOutcome::Straggler };
        for piece in [node, client] {
            let bytes = rtx_actors::encode(&ToCoordinator::Piece { round: 1, piece: WirePiece::from(piece.clone()) }).expect("encode");
            let ToCoordinator::Piece { piece: wire, .. } = rtx_actors::decode::<ToCoordinator>(&bytes).expect("decode") else { panic!("not a piece") };
            assert_eq!(Piece::try_from(wire), Ok(piece));
        }
        assert!(Piece::try_from(WirePiece::Untrained { pos: 0, why: 9 }).is_err());
    }

    #[test]
    fn secure_chunks_always_end_with_one_flagged_last_chunk() {
        let shape = |n: usize| secure_chunks((0..n).collect::<Vec<_>>()).map(|(c, last)| (c.len(), last)).collect::<Vec<_>>();
        assert_eq!(shape(0), vec![(0, true)]);
        assert_eq!(shape(SECURE_CHUNK), vec![(SECURE_CHUNK, true)]);
        assert_eq!(shape(2 * SECURE_CHUNK + 1), vec![(SECURE_CHUNK, false), (SECURE_CHUNK, false), (1, true)]);
    }
}
