//! The sparse neighbour graph of SecAgg+: a random Harary graph. The clients are shuffled onto a ring
//! by a seeded ChaCha20 permutation and each is joined to its `k / 2` nearest ring positions on each
//! side, so every client has exactly `k` neighbours (all others when `k >= n - 1`) and the relation is
//! symmetric, as pairwise masks need. With `k = O(log n)` the graph stays connected under random
//! dropouts with high probability (Bell et al. 2020), and a client's work is O(k), not O(n).

use std::collections::BTreeMap;

use rand::seq::SliceRandom;
use rand::SeedableRng;
use rand_chacha::ChaCha20Rng;

/// Builds the neighbour lists (each sorted by id) of `clients` for degree `k` from `seed`.
/// `clients` must be sorted and distinct; the result does not depend on anything else.
pub fn neighbour_graph(clients: &[u64], k: usize, seed: u64) -> BTreeMap<u64, Vec<u64>> {
    debug_assert!(clients.windows(2).all(|w| w[0] < w[1]));
    let n = clients.len();
    let mut graph: BTreeMap<u64, Vec<u64>> = BTreeMap::new();
    if n <= 1 || k + 1 >= n {
        for &c in clients {
            graph.insert(c, clients.iter().copied().filter(|&o| o != c).collect());
        }
        return graph;
    }
    let mut ring = clients.to_vec();
    ring.shuffle(&mut ChaCha20Rng::seed_from_u64(seed));
    let half = k.div_ceil(2);
    for (pos, &c) in ring.iter().enumerate() {
        let mut neighbours: Vec<u64> = Vec::with_capacity(2 * half);
        for d in 1..=half {
            neighbours.push(ring[(pos + d) % n]);
            neighbours.push(ring[(pos + n - d) % n]);
        }
        neighbours.sort_unstable();
        neighbours.dedup();
        graph.insert(c, neighbours);
    }
    graph
}

/// A neighbour degree `k = O(log n)` for `n` clients: the even number nearest `3 log2 n`, at least 4,
/// capped at `n - 1`.
pub fn recommended_degree(n: usize) -> usize {
    let log2 = (n.max(2) as f64).log2();
    let k = (3.0 * log2 / 2.0).ceil() as usize * 2;
    k.max(4).min(n.saturating_sub(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn graph_is_symmetric_regular_and_seeded() {
        // Goal: every edge goes both ways, every degree is k, and the seed alone decides the graph.
        let clients: Vec<u64> = (0..200).map(|c| c * 7 + 1).collect();
        let g = neighbour_graph(&clients, 16, 5);
        for (c, ns) in &g {
            assert_eq!(ns.len(), 16, "client {c}");
            for n in ns {
                assert!(g[n].contains(c));
            }
        }
        assert_eq!(g, neighbour_graph(&clients, 16, 5));
        assert_ne!(g, neighbour_graph(&clients, 16, 6));
        assert_eq!(neighbour_graph(&clients[..5], 16, 5)[&1].len(), 4);
        assert_eq!(recommended_degree(10_000), 40);
    }
}
