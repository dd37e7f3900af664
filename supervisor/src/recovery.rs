//! Where a new generation takes its state from: a pure decision over what the members said they
//! hold in `Ready` and what the supervisor knows is durable (the newest good checkpoint).
//!
//! The rule: **never form a generation from less than the newest durable state.** Candidates are
//! a member holding the whole state of step `c` (a replica, or a ZeRO-1 member's last snapshot),
//! the ZeRO-1 segment copies of step `s` when every segment of one layout has a holder among the
//! members (each rank keeps its own and its buddy's), and the newest good checkpoint of step `k`.
//! The newest step wins; on a tie memory beats disk (a replica, then segments, then the
//! checkpoint). With no candidate at all, the members start from what they built at boot
//! ([`StateSource::Initial`]: initial parameters, or the `--resume` checkpoint every worker
//! loaded). The chosen step is below the last committed one only when every holder of the newer
//! state is gone; [`Recovery::regressed_from`] says so, and the supervisor logs it.
//!
//! Ties among members go to the lowest rank, holders of a segment likewise (but segment `i` is
//! served by new rank `i` itself whenever it holds it), so the decision is a
//! function of its inputs alone (the simulator replays it bit for bit).

use crate::protocol::{StateSource, Zero1Held};

/// What one member of the new generation holds (from its `Ready`), in new rank order.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Holding {
    /// The newest step whose whole state this member holds alone.
    pub completed: Option<u64>,
    /// Its ZeRO-1 segment copies, one entry per step held (newest first), if any.
    pub zero1: Vec<Zero1Held>,
}

/// The decision.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Recovery {
    /// Where the state comes from.
    pub source: StateSource,
    /// The first step the new generation trains.
    pub next_step: u64,
    /// The committed step the job falls back from, when the chosen state is older than it (every
    /// holder of the newer state was lost).
    pub regressed_from: Option<u64>,
}

/// Chooses the state of a new generation; see the module doc. `checkpoint` is the newest good
/// checkpoint (step, location), `resume_next_step` the first step of a run with nothing to
/// restore, `committed` the newest committed step. `replay_last_step` is the simulator's planted
/// bug (the step after the newest state is not skipped): it makes the chosen step run again.
pub fn plan_recovery(members: &[Holding], checkpoint: Option<(u64, &str)>, resume_next_step: u64, committed: Option<u64>, replay_last_step: bool) -> Recovery {
    // (step, preference: lower is better, source)
    let mut best: Option<(u64, u8, StateSource)> = None;
    let mut offer = |step: u64, preference: u8, source: StateSource| {
        let better = match &best {
            None => true,
            Some((s, p, _)) => step > *s || (step == *s && preference < *p),
        };
        if better {
            best = Some((step, preference, source));
        }
    };
    // A replica: the newest, ties to the lowest rank (strictly newer replaces).
    let mut replica: Option<(u64, usize)> = None;
    for (rank, m) in members.iter().enumerate() {
        if let Some(c) = m.completed {
            if replica.is_none_or(|(best, _)| c > best) {
                replica = Some((c, rank));
            }
        }
    }
    if let Some((step, rank)) = replica {
        offer(step, 0, StateSource::Member { rank: rank as u32 });
    }
    if let Some((step, world, holders)) = zero1_coverage(members) {
        offer(step, 1, StateSource::Zero1Segments { step, world, holders });
    }
    if let Some((step, location)) = checkpoint {
        offer(step, 2, StateSource::Checkpoint { location: location.to_string(), step });
    }
    match best {
        None => Recovery { source: StateSource::Initial, next_step: resume_next_step, regressed_from: committed.filter(|&c| c >= resume_next_step) },
        Some((step, _, source)) => {
            let next_step = if replay_last_step { step } else { step + 1 };
            Recovery { source, next_step, regressed_from: committed.filter(|&c| c > step) }
        }
    }
}

/// The newest step at which the members' ZeRO-1 copies cover every segment of one layout, with
/// that layout's size and each segment's holder: new rank `i` for segment `i` when it holds it
/// (at the same world size a rank then imports its own copy and nothing travels), else the
/// lowest new rank that does.
fn zero1_coverage(members: &[Holding]) -> Option<(u64, u32, Vec<u32>)> {
    // Layouts are told apart by (generation, world); steps are tried newest first.
    let mut layouts: Vec<(u64, u32, u64)> = members.iter().flat_map(|m| m.zero1.iter()).filter(|h| h.world > 0 && h.rank < h.world).map(|h| (h.generation, h.world, h.step)).collect();
    layouts.sort_by(|a, b| b.2.cmp(&a.2).then(b.0.cmp(&a.0)).then(a.1.cmp(&b.1)));
    layouts.dedup();
    for (generation, world, step) in layouts {
        let mut holders: Vec<Option<u32>> = vec![None; world as usize];
        for (rank, m) in members.iter().enumerate() {
            let Some(h) = m.zero1.iter().find(|h| h.generation == generation && h.world == world && h.step == step && h.rank < world) else { continue };
            for segment in [h.rank, (h.rank + world - 1) % world] {
                let slot = &mut holders[segment as usize];
                if slot.is_none() || segment == rank as u32 {
                    *slot = Some(rank as u32);
                }
            }
        }
        if let Some(holders) = holders.into_iter().collect::<Option<Vec<u32>>>() {
            return Some((step, world, holders));
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn replica(c: Option<u64>) -> Holding {
        Holding { completed: c, zero1: Vec::new() }
    }

    fn zero1(snapshot: Option<u64>, generation: u64, world: u32, rank: u32, step: u64) -> Holding {
        Holding { completed: snapshot, zero1: vec![Zero1Held { generation, world, rank, step }] }
    }

    #[test]
    fn the_newest_replica_wins_and_ties_go_to_the_lowest_rank() {
        let r = plan_recovery(&[replica(Some(7)), replica(Some(9)), replica(Some(9)), replica(None)], None, 0, Some(9), false);
        assert_eq!(r, Recovery { source: StateSource::Member { rank: 1 }, next_step: 10, regressed_from: None });
    }

    #[test]
    fn a_lone_newcomer_resumes_from_the_newest_checkpoint_not_from_scratch() {
        // The lost run of the issue: every holder of step 1803 evicted, a fresh replacement alone,
        // a checkpoint of step 1499 on disk.
        let r = plan_recovery(&[replica(None)], Some((1499, "ckpt/step-1499")), 0, Some(1803), false);
        assert_eq!(r.source, StateSource::Checkpoint { location: "ckpt/step-1499".into(), step: 1499 });
        assert_eq!(r.next_step, 1500);
        assert_eq!(r.regressed_from, Some(1803));
    }

    #[test]
    fn a_checkpoint_newer_than_every_member_wins_and_memory_wins_a_tie() {
        let r = plan_recovery(&[replica(Some(100)), replica(None)], Some((199, "c")), 0, Some(250), false);
        assert_eq!(r.next_step, 200);
        assert!(matches!(r.source, StateSource::Checkpoint { .. }));
        let tie = plan_recovery(&[replica(Some(199))], Some((199, "c")), 0, Some(199), false);
        assert_eq!(tie.source, StateSource::Member { rank: 0 });
        assert_eq!(tie.regressed_from, None);
    }

    #[test]
    fn nothing_anywhere_starts_from_boot_state() {
        let r = plan_recovery(&[replica(None), replica(None)], None, 40, None, false);
        assert_eq!(r, Recovery { source: StateSource::Initial, next_step: 40, regressed_from: None });
        let lost = plan_recovery(&[replica(None)], None, 0, Some(12), false);
        assert_eq!(lost.regressed_from, Some(12), "falling back to boot state after commits is a regression, and said so");
    }

    #[test]
    fn zero1_segments_cover_a_layout_when_every_segment_has_a_holder() {
        // World 4 of generation 3, rank 2 lost: its segment 2 survives at its buddy (rank 3), and
        // segment 1 (held by 1 and 2) at rank 1. New ranks: old 0, 1, 3.
        let members = [zero1(Some(90), 3, 4, 0, 117), zero1(Some(90), 3, 4, 1, 117), zero1(Some(90), 3, 4, 3, 117)];
        let r = plan_recovery(&members, Some((99, "c")), 0, Some(117), false);
        assert_eq!(r.source, StateSource::Zero1Segments { step: 117, world: 4, holders: vec![0, 1, 2, 0] });
        assert_eq!(r.next_step, 118);
        assert_eq!(r.source.sending_rank(), 0);
    }

    #[test]
    fn a_segment_is_served_by_the_rank_of_its_index_when_that_rank_holds_it() {
        // World 3, old rank 1 lost and replaced at new rank 1 (it holds nothing): old 0 and 2
        // keep ranks 0 and 2 and serve their own segments; segment 1 comes from its buddy, 2.
        let members = [zero1(Some(90), 3, 3, 0, 117), Holding::default(), zero1(Some(90), 3, 3, 2, 117)];
        let r = plan_recovery(&members, None, 0, Some(117), false);
        assert_eq!(r.source, StateSource::Zero1Segments { step: 117, world: 3, holders: vec![0, 2, 2] });
    }

    #[test]
    fn zero1_segments_with_a_hole_fall_back_to_the_snapshot_or_checkpoint() {
        // Ranks 1 and 2 lost together: segment 1 has no holder (1 itself, and its buddy 2).
        let members = [zero1(Some(90), 3, 4, 0, 117), zero1(Some(90), 3, 4, 3, 117)];
        let r = plan_recovery(&members, Some((99, "c")), 0, Some(117), false);
        assert_eq!(r.source, StateSource::Checkpoint { location: "c".into(), step: 99 });
        let r = plan_recovery(&members, None, 0, Some(117), false);
        assert_eq!(r.source, StateSource::Member { rank: 0 });
        assert_eq!(r.next_step, 91);
        assert_eq!(r.regressed_from, Some(117));
    }

    #[test]
    fn zero1_copies_at_different_steps_cover_only_where_they_agree() {
        // Rank 0's copies are of step 117, rank 1's of 116 (it died in the exchange of 117's).
        let members = [zero1(None, 2, 2, 0, 117), zero1(None, 2, 2, 1, 116)];
        // Step 117: rank 0 holds segments 0 and 1 (its buddy's): covered alone.
        assert_eq!(plan_recovery(&members, None, 0, None, false).source, StateSource::Zero1Segments { step: 117, world: 2, holders: vec![0, 0] });
    }

    #[test]
    fn zero1_copies_of_the_previous_step_cover_an_exchange_cut_halfway() {
        // World 4, rank 2 lost in the exchange of step 118: ranks 0 and 1 committed 118 (and keep
        // 117), rank 3 never got rank 2's copy of 118 and holds 117 (and 116). Step 118 lacks
        // segment 2; step 117 is covered.
        let held = |rank: u32, steps: &[u64]| Holding { completed: Some(100), zero1: steps.iter().map(|&step| Zero1Held { generation: 3, world: 4, rank, step }).collect() };
        let members = [held(0, &[118, 117]), held(1, &[118, 117]), held(3, &[117, 116])];
        let r = plan_recovery(&members, None, 0, Some(117), false);
        assert_eq!(r.source, StateSource::Zero1Segments { step: 117, world: 4, holders: vec![0, 1, 2, 0] });
        assert_eq!(r.next_step, 118);
    }

    #[test]
    fn the_planted_replay_bug_runs_the_chosen_step_again() {
        assert_eq!(plan_recovery(&[replica(Some(5))], None, 0, Some(5), true).next_step, 5);
    }
}
