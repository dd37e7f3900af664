//! Mesh placement for a model-parallel job: which live members form a generation, in which rank
//! order, and where each member takes the state of its shard from. Pure functions of what the
//! supervisor knows, driven by the supervisor and tested alone.
//!
//! A job with `pp · tp = k > 1` trains as a mesh of `dp` replicas of `k` **slots** (slot `i` of a
//! replica holds pipeline stage `i / tp`, tensor rank `i % tp`); rank `r` of a generation sits in
//! replica `r / k`, slot `r % k` (the rank order of `rtx_pipelines::Mesh`). The rules:
//!
//! 1. **Keep what is whole.** The old generation's replicas whose members all survive come first,
//!    members in their old slots: they keep their state and train on at once.
//! 2. **Refill holes.** A replica that lost members takes newcomers into exactly the lost slots (a
//!    replacement after a crash), so its survivors keep their slots too.
//! 3. **Pool the rest.** Survivors of replicas that cannot be refilled, and the remaining
//!    newcomers, form new replicas, each member preferably in the slot it held before.
//! 4. **Whole replicas only.** The generation is truncated to a multiple of `k` (members left out
//!    stand by, paused, until a later generation has room for them): `dp` shrinks while every slot
//!    keeps a holder, and grows back when replacements arrive.
//!
//! Sources ([`shard_sources`]): the generation resumes from the newest step `S` at which every slot
//! has a holder among the members; a member that holds its slot at `S` keeps it (`Local`), the others
//! receive it from a holder (spread over the holders, lowest rank first); when no step is held whole,
//! the newest checkpoint, else the initial state.
//!
//! Re-partitioning is the supervisor's call (`SupervisorCore::mesh_candidates` in [`crate::decide`]): when the live
//! world no longer fills one replica it picks a smaller `(pp, tp)` by rule 2 of [`crate::plan`] and
//! places its members with these same rules at the new `k`. A member's [`MeshHeld`] names the
//! shape it trained in, so a holder of an old shape's slot is never taken for a holder of the new
//! one: [`shard_sources`] falls to the checkpoint.

use crate::protocol::{MeshHeld, ShardSource};

/// The members of a new generation, in rank order (rules 1–4). `previous` is the old generation in
/// rank order (its replicas are consecutive runs of `k`), `live` every live member (any order),
/// `max` the most members allowed.
pub fn place(previous: &[u64], live: &[u64], k: usize, max: usize) -> Vec<u64> {
    let k = k.max(1);
    let alive = |n: &u64| live.contains(n);
    let mut newcomers: Vec<u64> = live.iter().copied().filter(|n| !previous.contains(n)).collect();
    newcomers.sort_unstable();
    let mut newcomers = std::collections::VecDeque::from(newcomers);
    let mut placed: Vec<u64> = Vec::new();
    // Survivors that could not stay in their replica, with the slot they held.
    let mut pool: Vec<(u64, usize)> = Vec::new();
    let mut broken: Vec<Vec<Option<u64>>> = Vec::new();
    for replica in previous.chunks(k) {
        let slots: Vec<Option<u64>> = (0..k).map(|i| replica.get(i).copied().filter(alive)).collect();
        if slots.iter().all(Option::is_some) {
            placed.extend(slots.into_iter().flatten());
        } else {
            broken.push(slots);
        }
    }
    for slots in broken {
        let holes = slots.iter().filter(|s| s.is_none()).count();
        if slots.iter().any(Option::is_some) && holes <= newcomers.len() {
            placed.extend(slots.into_iter().map(|s| s.or_else(|| newcomers.pop_front()).unwrap_or_default()));
        } else {
            pool.extend(slots.into_iter().enumerate().filter_map(|(i, s)| s.map(|n| (n, i))));
        }
    }
    // New replicas from the pool: each slot takes a survivor that held it, else a newcomer, else
    // any pooled survivor.
    let mut rest: Vec<(u64, Option<usize>)> = pool.into_iter().map(|(n, i)| (n, Some(i))).collect();
    rest.extend(newcomers.into_iter().map(|n| (n, None)));
    while rest.len() >= k {
        for slot in 0..k {
            let pick = rest.iter().position(|(_, held)| *held == Some(slot)).or_else(|| rest.iter().position(|(_, held)| held.is_none())).unwrap_or(0);
            placed.push(rest.remove(pick).0);
        }
    }
    let room = max.min(placed.len());
    placed.truncate(room - room % k);
    placed
}

/// Where each member of a generation takes its shard's state from, and the step that state is of
/// (`None`: the initial state) in a mesh of `(pp, tp)`. `held[r]` is what rank `r` holds (only a
/// slot of the same shape counts); `checkpoint` the newest complete sharded checkpoint
/// `(step, location)`.
pub fn shard_sources(held: &[Option<MeshHeld>], (pp, tp): (usize, usize), checkpoint: Option<(u64, &str)>) -> (Vec<ShardSource>, Option<u64>) {
    let (k, tp) = ((pp * tp).max(1), tp.max(1));
    let same_shape = |h: &MeshHeld| h.slots as usize == k && h.tp as usize == tp;
    let holds = |h: &Option<MeshHeld>, slot: usize, step: u64| h.as_ref().is_some_and(|h| same_shape(h) && h.slot as usize == slot && h.step == step);
    // Candidate steps, newest first: the newest at which every slot has a holder.
    let mut steps: Vec<u64> = held.iter().flatten().filter(|h| same_shape(h)).map(|h| h.step).collect();
    steps.sort_unstable_by(|a, b| b.cmp(a));
    steps.dedup();
    let whole = steps.into_iter().find(|&s| (0..k).all(|slot| held.iter().any(|h| holds(h, slot, s))));
    let newer_checkpoint = checkpoint.filter(|(c, _)| whole.is_none_or(|s| *c > s));
    if let Some((step, location)) = newer_checkpoint {
        return (vec![ShardSource::Checkpoint { location: location.to_string(), step }; held.len()], Some(step));
    }
    let Some(step) = whole else {
        return (vec![ShardSource::Initial; held.len()], None);
    };
    // Each slot's holders at `step`, served in turn.
    let mut served = vec![0usize; k];
    let sources = (0..held.len())
        .map(|rank| {
            let slot = rank % k;
            if holds(&held[rank], slot, step) {
                return ShardSource::Local;
            }
            let holders: Vec<usize> = (0..held.len()).filter(|&r| holds(&held[r], slot, step)).collect();
            let pick = holders[served[slot] % holders.len()];
            served[slot] += 1;
            ShardSource::Member { rank: pick as u32 }
        })
        .collect();
    (sources, Some(step))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn held(slot: u32, step: u64) -> Option<MeshHeld> {
        Some(MeshHeld { slots: 4, tp: 2, slot, step })
    }

    #[test]
    fn a_whole_replica_keeps_its_slots_and_the_broken_one_stands_by() {
        // (2, 2, 2): replica 0 = nodes 1..4, replica 1 = nodes 5..8; node 6 dies.
        let previous = [1, 2, 3, 4, 5, 6, 7, 8];
        let live = [1, 2, 3, 4, 5, 7, 8];
        assert_eq!(place(&previous, &live, 4, 64), vec![1, 2, 3, 4]);
        // A loss in replica 0: replica 1 comes first and keeps its slots.
        let live = [1, 3, 4, 5, 6, 7, 8];
        assert_eq!(place(&previous, &live, 4, 64), vec![5, 6, 7, 8]);
    }

    #[test]
    fn a_replacement_fills_the_hole_it_replaces() {
        let previous = [1, 2, 3, 4, 5, 6, 7, 8];
        let live = [1, 2, 3, 4, 5, 7, 8, 9];
        assert_eq!(place(&previous, &live, 4, 64), vec![1, 2, 3, 4, 5, 9, 7, 8]);
    }

    #[test]
    fn standbys_rejoin_with_a_newcomer_in_their_old_slots() {
        // Generation after the loss of 6 was [1, 2, 3, 4]; 5, 7, 8 stood by; 9 arrives.
        let previous = [1, 2, 3, 4];
        let live = [1, 2, 3, 4, 5, 7, 8, 9];
        let placed = place(&previous, &live, 4, 64);
        assert_eq!(&placed[..4], &[1, 2, 3, 4]);
        let mut rest = placed[4..].to_vec();
        rest.sort_unstable();
        assert_eq!(rest, vec![5, 7, 8, 9]);
    }

    #[test]
    fn too_few_for_a_replica_forms_nothing_and_plain_dp_keeps_everyone() {
        assert!(place(&[1, 2, 3, 4], &[1, 2, 3], 4, 64).is_empty());
        assert_eq!(place(&[1, 2, 3], &[1, 3, 4], 1, 64), vec![1, 3, 4]);
        assert_eq!(place(&[], &[7, 5, 6, 8, 9], 2, 64), vec![5, 6, 7, 8]);
    }

    #[test]
    fn sources_pick_the_newest_step_every_slot_holds() {
        // Ranks 0..4 hold slots 0..4 at step 9; rank 4..8 are newcomers.
        let mut h = vec![held(0, 9), held(1, 9), held(2, 9), held(3, 9)];
        h.extend([None, None, None, None]);
        let (sources, step) = shard_sources(&h, (2, 2), Some((5, "ckpt-5")));
        assert_eq!(step, Some(9));
        assert_eq!(&sources[..4], &[ShardSource::Local, ShardSource::Local, ShardSource::Local, ShardSource::Local]);
        assert_eq!(sources[5], ShardSource::Member { rank: 1 });
        // One slot one step behind: the older step everyone can serve, newer holders fetch it.
        let h = vec![held(0, 10), held(1, 10), held(2, 9), held(3, 10), held(0, 9), held(1, 9), held(2, 9), held(3, 9)];
        let (sources, step) = shard_sources(&h, (2, 2), None);
        assert_eq!(step, Some(9));
        assert_eq!(sources[0], ShardSource::Member { rank: 4 });
        assert_eq!(sources[2], ShardSource::Local);
        // A slot nobody holds: the checkpoint, else the start.
        let h = vec![held(0, 9), held(1, 9), held(2, 9), None];
        assert_eq!(shard_sources(&h, (2, 2), Some((5, "c"))), (vec![ShardSource::Checkpoint { location: "c".into(), step: 5 }; 4], Some(5)));
        assert_eq!(shard_sources(&h, (2, 2), None), (vec![ShardSource::Initial; 4], None));
    }

    #[test]
    fn a_slot_of_another_shape_is_no_source_after_a_re_partition() {
        // Every slot of (pp, tp) = (2, 2) is held at step 9; the new mesh is (4, 1), also four
        // slots: nobody holds its state, so every member loads the checkpoint.
        let h = vec![held(0, 9), held(1, 9), held(2, 9), held(3, 9)];
        assert_eq!(shard_sources(&h, (4, 1), Some((7, "c"))), (vec![ShardSource::Checkpoint { location: "c".into(), step: 7 }; 4], Some(7)));
        assert_eq!(shard_sources(&h, (4, 1), None), (vec![ShardSource::Initial; 4], None));
        assert_eq!(shard_sources(&h, (2, 2), Some((7, "c"))).1, Some(9));
    }
}
