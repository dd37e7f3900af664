//! The server's side of the protocol as a pure state machine. The caller hands it every client
//! message as it arrives (`receive_*`) and decides when a phase ends (`close_*`, typically at a
//! deadline); each `close_*` returns the messages to send to the clients still in the round. Phases:
//! collect keys -> collect shares -> collect masked inputs -> collect unmask shares -> `finish`.
//!
//! Sets of clients, all ordered (`BTreeSet`/`BTreeMap`), so nothing depends on arrival order:
//! U1 advertised keys; U2 ⊆ U1 sent their sealed shares; U3 ⊆ U2 sent a masked input; U4 ⊆ U3
//! answered the unmask request. The sum covers exactly U3. For each i in U3 the server needs
//! `threshold` self-mask seed shares from i's neighbours in U4; for each d in U2 \ U3 it needs
//! `threshold` mask-key shares, then removes the pairwise masks d's neighbours in U3 added. When any of
//! these is short, `finish` fails with `FedError::SecAggTooFewShares` and returns no sum.
//! The server keeps one running sum (O(vector_len) memory), never every client's masked input.

use std::collections::{BTreeMap, BTreeSet};

use rayon::prelude::*;
use x25519_dalek::{PublicKey, StaticSecret};

use super::graph::neighbour_graph;
use super::messages::{
    AdvertiseKeys, EncryptedShare, ForwardedShares, MaskedInput, NeighbourKeys, Roster, ShareKeys, UnmaskRequest, UnmaskShares, SHARE_CIPHERTEXT_LEN,
};
use super::prg::{apply_mask, derive_key, MaskSign, DOMAIN_PAIR_MASK, DOMAIN_SELF_MASK};
use super::shamir::{self, ShareLimbs, CLIENT_ID_MAX, FIELD_PRIME, SHARE_LIMBS};
use super::SecAggConfig;
use crate::error::{FedError, Result};

/// The unmasked result of a round.
#[derive(Clone, Debug, PartialEq)]
pub struct SecAggOutcome {
    /// The sum of the included clients' quantised updates in Z_{2^32}.
    pub sum_fixed: Vec<u32>,
    /// `sum_fixed` decoded to floats (exact: the quantisation bound rules out overflow).
    pub sum: Vec<f32>,
    /// Clients whose input is in the sum (U3), sorted.
    pub included: Vec<u64>,
    /// Clients that shared keys but whose input did not arrive (U2 \ U3), sorted.
    pub dropped: Vec<u64>,
}

/// The server's protocol state for one round.
pub struct SecAggServer {
    config: SecAggConfig,
    phase: ServerPhase,
    keys: BTreeMap<u64, AdvertiseKeys>,
    graph: BTreeMap<u64, Vec<u64>>,
    sharers: BTreeSet<u64>,
    inbox: BTreeMap<u64, Vec<EncryptedShare>>,
    masked_with: BTreeMap<u64, Vec<u64>>,
    masked_from: BTreeSet<u64>,
    sum: Vec<u32>,
    requests: BTreeMap<u64, UnmaskRequest>,
    responded: BTreeSet<u64>,
    seed_shares: BTreeMap<u64, Vec<(u64, ShareLimbs)>>,
    key_shares: BTreeMap<u64, Vec<(u64, ShareLimbs)>>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ServerPhase {
    CollectKeys,
    CollectShares,
    CollectMasked,
    CollectUnmask,
    Done,
}

impl ServerPhase {
    fn name(self) -> &'static str {
        match self {
            ServerPhase::CollectKeys => "advertise keys",
            ServerPhase::CollectShares => "share keys",
            ServerPhase::CollectMasked => "masked input",
            ServerPhase::CollectUnmask => "unmask",
            ServerPhase::Done => "done",
        }
    }
}

impl SecAggServer {
    /// A server for the round `config`.
    pub fn new(config: &SecAggConfig) -> Self {
        SecAggServer {
            config: config.clone(),
            phase: ServerPhase::CollectKeys,
            keys: BTreeMap::new(),
            graph: BTreeMap::new(),
            sharers: BTreeSet::new(),
            inbox: BTreeMap::new(),
            masked_with: BTreeMap::new(),
            masked_from: BTreeSet::new(),
            sum: vec![0; config.vector_len],
            requests: BTreeMap::new(),
            responded: BTreeSet::new(),
            seed_shares: BTreeMap::new(),
            key_shares: BTreeMap::new(),
        }
    }

    /// The neighbour graph of the round (empty until `close_keys`).
    pub fn graph(&self) -> &BTreeMap<u64, Vec<u64>> {
        &self.graph
    }

    /// Phase 0: records a client's public keys.
    pub fn receive_keys(&mut self, msg: AdvertiseKeys) -> Result<()> {
        const PHASE: &str = "advertise keys";
        self.expect_phase(ServerPhase::CollectKeys, "advertise keys")?;
        if msg.client > CLIENT_ID_MAX {
            return Err(FedError::SecAggUnknownClient { phase: PHASE, client: msg.client, reason: format!("ids above {CLIENT_ID_MAX} are not admitted") });
        }
        if self.keys.contains_key(&msg.client) {
            return Err(FedError::SecAggDuplicate { phase: PHASE, client: msg.client, what: "public keys".to_string() });
        }
        if msg.mask_public == msg.share_public {
            return Err(FedError::SecAggMalformed { phase: PHASE, client: msg.client, reason: "mask and share public keys are equal".to_string() });
        }
        self.keys.insert(msg.client, msg);
        Ok(())
    }

    /// Ends phase 0: builds the neighbour graph over the clients that advertised and returns each
    /// one's roster.
    pub fn close_keys(&mut self) -> Result<Vec<Roster>> {
        self.expect_phase(ServerPhase::CollectKeys, "close keys")?;
        let clients: Vec<u64> = self.keys.keys().copied().collect();
        let need = self.config.threshold + 1;
        if clients.len() < need {
            return Err(FedError::SecAggTooFewClients { phase: "advertise keys", have: clients.len(), need });
        }
        if clients.len() as u64 > self.config.quant.max_clients {
            return Err(FedError::Config {
                field: "secagg.max_clients".to_string(),
                reason: format!("{} clients advertised, the quantisation bound admits {}", clients.len(), self.config.quant.max_clients),
            });
        }
        self.graph = neighbour_graph(&clients, self.config.degree, self.config.graph_seed);
        let rosters = self
            .graph
            .iter()
            .map(|(&client, neighbours)| Roster {
                client,
                neighbours: neighbours
                    .iter()
                    .map(|n| {
                        let k = &self.keys[n];
                        NeighbourKeys { client: *n, mask_public: k.mask_public, share_public: k.share_public }
                    })
                    .collect(),
            })
            .collect();
        self.phase = ServerPhase::CollectShares;
        Ok(rosters)
    }

    /// Phase 1: records a client's sealed shares, which must be exactly one per roster neighbour.
    pub fn receive_shares(&mut self, msg: ShareKeys) -> Result<()> {
        const PHASE: &str = "share keys";
        self.expect_phase(ServerPhase::CollectShares, "share keys")?;
        let Some(neighbours) = self.graph.get(&msg.client) else {
            return Err(FedError::SecAggUnknownClient { phase: PHASE, client: msg.client, reason: "it did not advertise keys this round".to_string() });
        };
        if self.sharers.contains(&msg.client) {
            return Err(FedError::SecAggDuplicate { phase: PHASE, client: msg.client, what: "share set".to_string() });
        }
        let malformed = |reason: String| FedError::SecAggMalformed { phase: PHASE, client: msg.client, reason };
        if msg.shares.len() != neighbours.len() {
            return Err(malformed(format!("{} shares for {} neighbours", msg.shares.len(), neighbours.len())));
        }
        let mut seen = BTreeSet::new();
        for share in &msg.shares {
            if share.from != msg.client {
                return Err(malformed(format!("a share claims to come from {}", share.from)));
            }
            if neighbours.binary_search(&share.to).is_err() {
                return Err(FedError::SecAggUnknownClient { phase: PHASE, client: share.to, reason: format!("not a neighbour of {}", msg.client) });
            }
            if !seen.insert(share.to) {
                return Err(FedError::SecAggDuplicate { phase: PHASE, client: msg.client, what: format!("share for {}", share.to) });
            }
            if share.ciphertext.len() != SHARE_CIPHERTEXT_LEN {
                return Err(malformed(format!("share for {} has {} bytes, expected {SHARE_CIPHERTEXT_LEN}", share.to, share.ciphertext.len())));
            }
        }
        for share in msg.shares {
            self.inbox.entry(share.to).or_default().push(share);
        }
        self.sharers.insert(msg.client);
        Ok(())
    }

    /// Ends phase 1: forwards to each client that shared the shares addressed to it by other clients
    /// that shared. Clients that did not share are out of the round; nobody masks with them.
    pub fn close_shares(&mut self) -> Result<Vec<ForwardedShares>> {
        self.expect_phase(ServerPhase::CollectShares, "close shares")?;
        if self.sharers.is_empty() {
            return Err(FedError::SecAggTooFewClients { phase: "share keys", have: 0, need: 1 });
        }
        let mut forwarded = Vec::with_capacity(self.sharers.len());
        for &client in &self.sharers {
            let mut shares: Vec<EncryptedShare> =
                self.inbox.remove(&client).unwrap_or_default().into_iter().filter(|s| self.sharers.contains(&s.from)).collect();
            shares.sort_by_key(|s| s.from);
            self.masked_with.insert(client, shares.iter().map(|s| s.from).collect());
            forwarded.push(ForwardedShares { client, shares });
        }
        self.inbox.clear();
        self.phase = ServerPhase::CollectMasked;
        Ok(forwarded)
    }

    /// Phase 2: adds a client's masked input into the running sum.
    pub fn receive_masked(&mut self, msg: MaskedInput) -> Result<()> {
        const PHASE: &str = "masked input";
        self.expect_phase(ServerPhase::CollectMasked, "masked input")?;
        if !self.sharers.contains(&msg.client) {
            return Err(FedError::SecAggUnknownClient { phase: PHASE, client: msg.client, reason: "it did not share keys this round".to_string() });
        }
        if self.masked_from.contains(&msg.client) {
            return Err(FedError::SecAggDuplicate { phase: PHASE, client: msg.client, what: "masked input".to_string() });
        }
        if msg.masked.len() != self.config.vector_len {
            return Err(FedError::SecAggMalformed {
                phase: PHASE,
                client: msg.client,
                reason: format!("masked input has {} words, the round expects {}", msg.masked.len(), self.config.vector_len),
            });
        }
        for (acc, v) in self.sum.iter_mut().zip(&msg.masked) {
            *acc = acc.wrapping_add(*v);
        }
        self.masked_from.insert(msg.client);
        Ok(())
    }

    /// Ends phase 2: asks each client whose input arrived for the shares of its surviving
    /// neighbours' self-mask seeds and of its dropped neighbours' mask keys.
    pub fn close_masked(&mut self) -> Result<Vec<UnmaskRequest>> {
        self.expect_phase(ServerPhase::CollectMasked, "close masked")?;
        if self.masked_from.is_empty() {
            return Err(FedError::SecAggTooFewClients { phase: "masked input", have: 0, need: 1 });
        }
        let mut requests = Vec::with_capacity(self.masked_from.len());
        for &client in &self.masked_from {
            let with = self.masked_with.get(&client).map(Vec::as_slice).unwrap_or_default();
            let (survivors, dropped): (Vec<u64>, Vec<u64>) = with.iter().partition(|c| self.masked_from.contains(c));
            let request = UnmaskRequest { client, survivors, dropped };
            self.requests.insert(client, request.clone());
            requests.push(request);
        }
        self.phase = ServerPhase::CollectUnmask;
        Ok(requests)
    }

    /// Phase 3: records a client's revealed shares; each must answer what that client was asked.
    pub fn receive_unmask(&mut self, msg: UnmaskShares) -> Result<()> {
        const PHASE: &str = "unmask";
        self.expect_phase(ServerPhase::CollectUnmask, "unmask shares")?;
        let Some(request) = self.requests.get(&msg.client) else {
            return Err(FedError::SecAggUnknownClient { phase: PHASE, client: msg.client, reason: "it was not asked to unmask".to_string() });
        };
        if self.responded.contains(&msg.client) {
            return Err(FedError::SecAggDuplicate { phase: PHASE, client: msg.client, what: "unmask shares".to_string() });
        }
        let malformed = |reason: String| FedError::SecAggMalformed { phase: PHASE, client: msg.client, reason };
        let mut seen = BTreeSet::new();
        let lists = [(&msg.self_mask_shares, &request.survivors, "self-mask seed"), (&msg.mask_key_shares, &request.dropped, "mask key")];
        for (reveals, asked, what) in lists {
            for reveal in reveals.iter() {
                if asked.binary_search(&reveal.owner).is_err() {
                    return Err(FedError::SecAggUnknownClient {
                        phase: PHASE,
                        client: reveal.owner,
                        reason: format!("{} was not asked for its {what} share", msg.client),
                    });
                }
                if !seen.insert(reveal.owner) {
                    return Err(FedError::SecAggDuplicate { phase: PHASE, client: msg.client, what: format!("share of {}", reveal.owner) });
                }
                if reveal.share.len() != SHARE_LIMBS || reveal.share.iter().any(|&v| v >= FIELD_PRIME) {
                    return Err(malformed(format!("share of {} is not {SHARE_LIMBS} field elements", reveal.owner)));
                }
            }
        }
        let point = shamir::point_of(msg.client);
        for (reveals, store) in [(msg.self_mask_shares, &mut self.seed_shares), (msg.mask_key_shares, &mut self.key_shares)] {
            for reveal in reveals {
                let mut limbs = [0u64; SHARE_LIMBS];
                limbs.copy_from_slice(&reveal.share);
                store.entry(reveal.owner).or_default().push((point, limbs));
            }
        }
        self.responded.insert(msg.client);
        Ok(())
    }

    /// Ends the round: removes every self mask of U3 and every pairwise mask with U2 \ U3, and
    /// returns the sum, or `SecAggTooFewShares` when some secret cannot be reconstructed.
    pub fn finish(&mut self) -> Result<SecAggOutcome> {
        self.expect_phase(ServerPhase::CollectUnmask, "finish")?;
        let threshold = self.config.threshold;
        let round = self.config.round;
        let dropped: Vec<u64> = self.sharers.difference(&self.masked_from).copied().collect();
        // Check every secret first (dropped clients' keys, then survivors' seeds, each in id order), so a
        // short round fails before any work.
        for (owners, store, secret) in
            [(dropped.clone(), &self.key_shares, "mask key"), (self.masked_from.iter().copied().collect::<Vec<_>>(), &self.seed_shares, "self-mask seed")]
        {
            for owner in owners {
                let have = store.get(&owner).map_or(0, Vec::len);
                if have < threshold {
                    return Err(FedError::SecAggTooFewShares { client: owner, secret, have, threshold });
                }
            }
        }
        // Every mask to remove becomes a (key, sign) task; secrets are rebuilt and agreements computed
        // in parallel. Addition mod 2^32 is associative and commutative, so the parallel sum of the
        // masks is bit-identical whatever the thread count or order.
        let owners: Vec<u64> = self.masked_from.iter().copied().collect();
        let self_tasks: Vec<([u8; 32], MaskSign)> = owners
            .par_iter()
            .map(|&owner| {
                let seed = reconstruct(&self.seed_shares, owner, threshold, "self-mask seed")?;
                Ok((derive_key(DOMAIN_SELF_MASK, round, &seed), MaskSign::Subtract))
            })
            .collect::<Result<_>>()?;
        let pair_tasks: Vec<Vec<([u8; 32], MaskSign)>> = dropped.par_iter().map(|&gone| self.pair_mask_tasks(gone, threshold)).collect::<Result<_>>()?;
        let len = self.config.vector_len;
        let correction = self_tasks
            .par_iter()
            .chain(pair_tasks.par_iter().flatten())
            .fold(
                || vec![0u32; len],
                |mut acc, &(key, sign)| {
                    apply_mask(&mut acc, key, sign);
                    acc
                },
            )
            .reduce(|| vec![0u32; len], add_words);
        let sum = add_words(std::mem::take(&mut self.sum), correction);
        let quant = self.config.quant;
        self.phase = ServerPhase::Done;
        Ok(SecAggOutcome { sum: sum.iter().map(|&w| quant.decode(w)).collect(), sum_fixed: sum, included: self.masked_from.iter().copied().collect(), dropped })
    }

    /// Rebuilds dropped client `gone`'s mask key and lists the pairwise masks its surviving
    /// neighbours added with it, each with the sign that removes it.
    fn pair_mask_tasks(&self, gone: u64, threshold: usize) -> Result<Vec<([u8; 32], MaskSign)>> {
        let secret = StaticSecret::from(reconstruct(&self.key_shares, gone, threshold, "mask key")?);
        if self.keys.get(&gone).is_none_or(|k| PublicKey::from(&secret).to_bytes() != k.mask_public) {
            return Err(FedError::SecAggMalformed {
                phase: "unmask",
                client: gone,
                reason: "revealed shares rebuild a mask key that does not match its advertised public key".to_string(),
            });
        }
        let mut tasks = Vec::new();
        for &survivor in self.graph.get(&gone).map(Vec::as_slice).unwrap_or_default() {
            let masked_with_gone = self.masked_with.get(&survivor).is_some_and(|with| with.binary_search(&gone).is_ok());
            let Some(keys) = self.keys.get(&survivor).filter(|_| self.masked_from.contains(&survivor) && masked_with_gone) else {
                continue;
            };
            let shared = secret.diffie_hellman(&PublicKey::from(keys.mask_public));
            // The survivor added the mask when the dropped id is larger, subtracted it otherwise.
            let sign = if gone > survivor { MaskSign::Subtract } else { MaskSign::Add };
            tasks.push((derive_key(DOMAIN_PAIR_MASK, self.config.round, shared.as_bytes()), sign));
        }
        Ok(tasks)
    }

    fn expect_phase(&self, expected: ServerPhase, message: &'static str) -> Result<()> {
        if self.phase == expected {
            Ok(())
        } else {
            Err(FedError::SecAggPhase { phase: self.phase.name(), message })
        }
    }
}

/// Word-wise sum mod 2^32.
fn add_words(mut a: Vec<u32>, b: Vec<u32>) -> Vec<u32> {
    debug_assert_eq!(a.len(), b.len());
    for (x, y) in a.iter_mut().zip(&b) {
        *x = x.wrapping_add(*y);
    }
    a
}

/// Rebuilds `owner`'s secret from the first `threshold` shares (by holder point, so the result does
/// not depend on arrival order).
fn reconstruct(store: &BTreeMap<u64, Vec<(u64, ShareLimbs)>>, owner: u64, threshold: usize, secret: &'static str) -> Result<[u8; 32]> {
    let mut shares = store.get(&owner).cloned().unwrap_or_default();
    shares.sort_by_key(|(point, _)| *point);
    shares.truncate(threshold);
    shamir::reconstruct(&shares).ok_or_else(|| FedError::SecAggMalformed {
        phase: "unmask",
        client: owner,
        reason: format!("revealed shares of its {secret} do not interpolate to a 32-byte secret"),
    })
}
