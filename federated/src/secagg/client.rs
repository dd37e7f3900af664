//! The client's side of the protocol as a pure state machine. The caller feeds it the server's
//! messages in order and sends back what each call returns; the legal sequence is
//! `advertise` -> `share_keys(Roster)` -> `masked_input(ForwardedShares, update)` (or
//! `masked_input_words` with an input the caller encoded) ->
//! `unmask(UnmaskRequest)`, and any other call is refused with a typed error. All randomness (the two
//! X25519 secrets, the self-mask seed, the Shamir coefficients) comes from the ChaCha20 RNG handed to
//! `SecAggClient::new`, so a client is reproducible from its seed.
//!
//! The one rule that keeps an honest client's input private from an honest-but-curious server: for
//! any neighbour it reveals either the self-mask seed share (neighbour survived) or the mask-key share
//! (neighbour dropped), never both, and it answers one unmask request only.

use std::collections::{BTreeMap, BTreeSet};

use chacha20poly1305::aead::{Aead, KeyInit, Payload};
use chacha20poly1305::{ChaCha20Poly1305, Key, Nonce};
use rand::Rng;
use rand_chacha::ChaCha20Rng;
use x25519_dalek::{PublicKey, StaticSecret};

use super::messages::{
    AdvertiseKeys, EncryptedShare, ForwardedShares, MaskedInput, NeighbourKeys, Roster, ShareKeys, ShareReveal, UnmaskRequest, UnmaskShares,
    SHARE_CIPHERTEXT_LEN, SHARE_PLAINTEXT_LEN,
};
use super::prg::{apply_mask, derive_key, MaskSign, DOMAIN_PAIR_MASK, DOMAIN_SELF_MASK, DOMAIN_SHARE_KEY};
use super::shamir::{self, ShareLimbs, CLIENT_ID_MAX, SHARE_LIMBS};
use super::SecAggConfig;
use crate::error::{FedError, Result};

/// One client's protocol state for one round.
pub struct SecAggClient {
    id: u64,
    config: SecAggConfig,
    rng: ChaCha20Rng,
    phase: ClientPhase,
    mask_secret: StaticSecret,
    share_secret: StaticSecret,
    self_seed: [u8; 32],
    neighbours: BTreeMap<u64, NeighbourKeys>,
    /// The share-encryption key agreed with each neighbour, kept from sealing to opening so each
    /// agreement is computed once.
    share_keys: BTreeMap<u64, [u8; 32]>,
    held: BTreeMap<u64, (ShareLimbs, ShareLimbs)>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ClientPhase {
    Advertise,
    AwaitRoster,
    AwaitShares,
    AwaitUnmask,
    Done,
}

impl ClientPhase {
    fn name(self) -> &'static str {
        match self {
            ClientPhase::Advertise => "advertise keys",
            ClientPhase::AwaitRoster => "share keys",
            ClientPhase::AwaitShares => "masked input",
            ClientPhase::AwaitUnmask => "unmask",
            ClientPhase::Done => "done",
        }
    }
}

impl SecAggClient {
    /// A client with id `id` (at most `CLIENT_ID_MAX`) for the round `config`, drawing its keys and
    /// seeds from `rng`.
    pub fn new(id: u64, config: &SecAggConfig, mut rng: ChaCha20Rng) -> Result<Self> {
        if id > CLIENT_ID_MAX {
            return Err(FedError::Config {
                field: "secagg.client_id".to_string(),
                reason: format!("{id} exceeds the largest id {CLIENT_ID_MAX} the share field admits"),
            });
        }
        let mask_secret = StaticSecret::from(rng.random::<[u8; 32]>());
        let share_secret = StaticSecret::from(rng.random::<[u8; 32]>());
        let self_seed: [u8; 32] = rng.random();
        Ok(SecAggClient {
            id,
            config: config.clone(),
            rng,
            phase: ClientPhase::Advertise,
            mask_secret,
            share_secret,
            self_seed,
            neighbours: BTreeMap::new(),
            share_keys: BTreeMap::new(),
            held: BTreeMap::new(),
        })
    }

    /// This client's id.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Phase 0: the public keys to send to the server.
    pub fn advertise(&mut self) -> Result<AdvertiseKeys> {
        self.expect_phase(ClientPhase::Advertise, "advertise")?;
        self.phase = ClientPhase::AwaitRoster;
        Ok(AdvertiseKeys {
            client: self.id,
            mask_public: PublicKey::from(&self.mask_secret).to_bytes(),
            share_public: PublicKey::from(&self.share_secret).to_bytes(),
        })
    }

    /// Phase 1: Shamir-shares the self-mask seed and the mask secret key among the roster's
    /// neighbours (threshold `config.threshold`) and seals each share for its holder.
    pub fn share_keys(&mut self, roster: &Roster) -> Result<ShareKeys> {
        const PHASE: &str = "share keys";
        self.expect_phase(ClientPhase::AwaitRoster, "roster")?;
        self.check_addressee(PHASE, roster.client)?;
        let degree_max = self.config.degree;
        if roster.neighbours.len() > degree_max {
            return Err(self.malformed(PHASE, format!("roster has {} neighbours, the degree is {degree_max}", roster.neighbours.len())));
        }
        if roster.neighbours.len() < self.config.threshold {
            return Err(FedError::SecAggTooFewClients { phase: PHASE, have: roster.neighbours.len(), need: self.config.threshold });
        }
        let mut neighbours = BTreeMap::new();
        for keys in &roster.neighbours {
            if keys.client == self.id || keys.client > CLIENT_ID_MAX {
                return Err(self.malformed(PHASE, format!("roster names client {} as a neighbour", keys.client)));
            }
            if neighbours.insert(keys.client, keys.clone()).is_some() {
                return Err(FedError::SecAggDuplicate { phase: PHASE, client: keys.client, what: "roster entry".to_string() });
            }
        }
        let points: Vec<u64> = neighbours.keys().map(|&c| shamir::point_of(c)).collect();
        let seed_shares = shamir::split(&self.self_seed, self.config.threshold, &points, &mut self.rng);
        let key_shares = shamir::split(&self.mask_secret.to_bytes(), self.config.threshold, &points, &mut self.rng);
        let mut shares = Vec::with_capacity(neighbours.len());
        let mut share_keys = BTreeMap::new();
        for ((&to, keys), (seed_share, key_share)) in neighbours.iter().zip(seed_shares.iter().zip(&key_shares)) {
            let key = self.share_key(PHASE, to, &keys.share_public)?;
            share_keys.insert(to, key);
            let cipher = ChaCha20Poly1305::new(Key::from_slice(&key));
            let plaintext = encode_share(self.id, to, seed_share, key_share);
            let aad = share_aad(self.config.round, self.id, to);
            let ciphertext = cipher
                .encrypt(&share_nonce(self.id), Payload { msg: &plaintext, aad: &aad })
                .map_err(|_| self.malformed(PHASE, format!("sealing the share for {to} failed")))?;
            debug_assert_eq!(ciphertext.len(), SHARE_CIPHERTEXT_LEN);
            shares.push(EncryptedShare { from: self.id, to, ciphertext });
        }
        self.neighbours = neighbours;
        self.share_keys = share_keys;
        self.phase = ClientPhase::AwaitShares;
        Ok(ShareKeys { client: self.id, shares })
    }

    /// Phase 2: opens the neighbours' shares, then quantises `update` and masks it with the self mask
    /// and one pairwise mask per neighbour whose share arrived.
    pub fn masked_input(&mut self, forwarded: &ForwardedShares, update: &[f32]) -> Result<MaskedInput> {
        const PHASE: &str = "masked input";
        self.expect_phase(ClientPhase::AwaitShares, "forwarded shares")?;
        self.check_addressee(PHASE, forwarded.client)?;
        if update.len() != self.config.vector_len {
            return Err(self.malformed(PHASE, format!("update has {} values, the round expects {}", update.len(), self.config.vector_len)));
        }
        if let Some(idx) = update.iter().position(|v| !v.is_finite()) {
            return Err(self.malformed(PHASE, format!("update value {idx} is not finite")));
        }
        let quant = self.config.quant;
        self.mask(forwarded, update.iter().map(|&v| quant.quantize(v)).collect())
    }

    /// Phase 2 for a caller that encodes its own input: `words` are already fixed point in
    /// Z_{2^32} (e.g. a weighted update followed by its weight, as a federation round sends them).
    /// The caller is responsible for the overflow bound of its encoding over the round's clients.
    pub fn masked_input_words(&mut self, forwarded: &ForwardedShares, words: Vec<u32>) -> Result<MaskedInput> {
        const PHASE: &str = "masked input";
        self.expect_phase(ClientPhase::AwaitShares, "forwarded shares")?;
        self.check_addressee(PHASE, forwarded.client)?;
        if words.len() != self.config.vector_len {
            return Err(self.malformed(PHASE, format!("input has {} words, the round expects {}", words.len(), self.config.vector_len)));
        }
        self.mask(forwarded, words)
    }

    /// Opens the forwarded shares and masks `masked` (the quantised input) in place.
    fn mask(&mut self, forwarded: &ForwardedShares, mut masked: Vec<u32>) -> Result<MaskedInput> {
        const PHASE: &str = "masked input";
        let mut held = BTreeMap::new();
        for share in &forwarded.shares {
            let Some(key) = self.share_keys.get(&share.from) else {
                return Err(FedError::SecAggUnknownClient { phase: PHASE, client: share.from, reason: format!("not a neighbour of {}", self.id) });
            };
            if share.to != self.id {
                return Err(FedError::SecAggMalformed {
                    phase: PHASE,
                    client: share.from,
                    reason: format!("share addressed to {} reached {}", share.to, self.id),
                });
            }
            if held.contains_key(&share.from) {
                return Err(FedError::SecAggDuplicate { phase: PHASE, client: share.from, what: "share".to_string() });
            }
            let cipher = ChaCha20Poly1305::new(Key::from_slice(key));
            let aad = share_aad(self.config.round, share.from, self.id);
            let plaintext = cipher.decrypt(&share_nonce(share.from), Payload { msg: &share.ciphertext, aad: &aad }).map_err(|_| FedError::SecAggMalformed {
                phase: PHASE,
                client: share.from,
                reason: "share does not open (wrong length, key or tampered)".to_string(),
            })?;
            let (from, to, seed_share, key_share) = decode_share(&plaintext).ok_or_else(|| FedError::SecAggMalformed {
                phase: PHASE,
                client: share.from,
                reason: "share plaintext is malformed".to_string(),
            })?;
            if from != share.from || to != self.id {
                return Err(FedError::SecAggMalformed { phase: PHASE, client: share.from, reason: format!("sealed header says {from} -> {to}") });
            }
            held.insert(share.from, (seed_share, key_share));
        }
        if held.len() < self.config.threshold {
            return Err(FedError::SecAggTooFewClients { phase: PHASE, have: held.len(), need: self.config.threshold });
        }
        apply_mask(&mut masked, derive_key(DOMAIN_SELF_MASK, self.config.round, &self.self_seed), MaskSign::Add);
        for &other in held.keys() {
            let keys = &self.neighbours[&other];
            let shared = self.mask_secret.diffie_hellman(&PublicKey::from(keys.mask_public));
            if !shared.was_contributory() {
                return Err(FedError::SecAggMalformed { phase: PHASE, client: other, reason: "mask public key is a low-order point".to_string() });
            }
            let sign = if other > self.id { MaskSign::Add } else { MaskSign::Subtract };
            apply_mask(&mut masked, derive_key(DOMAIN_PAIR_MASK, self.config.round, shared.as_bytes()), sign);
        }
        self.held = held;
        self.phase = ClientPhase::AwaitUnmask;
        Ok(MaskedInput { client: self.id, masked })
    }

    /// Phase 3: reveals the self-mask seed shares of surviving neighbours and the mask-key shares of
    /// dropped ones. Refuses a request that lists a neighbour as both, names a client whose share it
    /// does not hold, or comes a second time.
    pub fn unmask(&mut self, request: &UnmaskRequest) -> Result<UnmaskShares> {
        const PHASE: &str = "unmask";
        self.expect_phase(ClientPhase::AwaitUnmask, "unmask request")?;
        self.check_addressee(PHASE, request.client)?;
        let mut seen = BTreeSet::new();
        for &c in request.survivors.iter().chain(&request.dropped) {
            if !self.held.contains_key(&c) {
                return Err(FedError::SecAggUnknownClient { phase: PHASE, client: c, reason: format!("{} holds no share of it", self.id) });
            }
            if !seen.insert(c) {
                return Err(FedError::SecAggMalformed {
                    phase: PHASE,
                    client: c,
                    reason: "listed twice (or as both survivor and dropped): revealing both shares would unmask its input".to_string(),
                });
            }
        }
        let self_mask_shares = request.survivors.iter().map(|c| ShareReveal::new(*c, &self.held[c].0)).collect();
        let mask_key_shares = request.dropped.iter().map(|c| ShareReveal::new(*c, &self.held[c].1)).collect();
        self.phase = ClientPhase::Done;
        Ok(UnmaskShares { client: self.id, self_mask_shares, mask_key_shares })
    }

    fn expect_phase(&self, expected: ClientPhase, message: &'static str) -> Result<()> {
        if self.phase == expected {
            Ok(())
        } else {
            Err(FedError::SecAggPhase { phase: self.phase.name(), message })
        }
    }

    fn check_addressee(&self, phase: &'static str, client: u64) -> Result<()> {
        if client == self.id {
            Ok(())
        } else {
            Err(FedError::SecAggUnknownClient { phase, client, reason: format!("message for {client} reached client {}", self.id) })
        }
    }

    fn malformed(&self, phase: &'static str, reason: String) -> FedError {
        FedError::SecAggMalformed { phase, client: self.id, reason }
    }

    fn share_key(&self, phase: &'static str, other: u64, public: &[u8; 32]) -> Result<[u8; 32]> {
        let shared = self.share_secret.diffie_hellman(&PublicKey::from(*public));
        if !shared.was_contributory() {
            return Err(FedError::SecAggMalformed { phase, client: other, reason: "share public key is a low-order point".to_string() });
        }
        Ok(derive_key(DOMAIN_SHARE_KEY, self.config.round, shared.as_bytes()))
    }
}

/// The nonce of a share sealed by `from`: the two directions of a pair share one key, so the sender
/// id keeps nonces distinct; each key is fresh per round and seals one share per direction.
fn share_nonce(from: u64) -> Nonce {
    let mut nonce = [0u8; 12];
    nonce[..8].copy_from_slice(&from.to_le_bytes());
    *Nonce::from_slice(&nonce)
}

fn share_aad(round: u64, from: u64, to: u64) -> [u8; 24] {
    let mut aad = [0u8; 24];
    aad[..8].copy_from_slice(&round.to_le_bytes());
    aad[8..16].copy_from_slice(&from.to_le_bytes());
    aad[16..].copy_from_slice(&to.to_le_bytes());
    aad
}

fn encode_share(from: u64, to: u64, seed_share: &ShareLimbs, key_share: &ShareLimbs) -> Vec<u8> {
    let mut out = Vec::with_capacity(SHARE_PLAINTEXT_LEN);
    out.extend_from_slice(&from.to_le_bytes());
    out.extend_from_slice(&to.to_le_bytes());
    for limb in seed_share.iter().chain(key_share) {
        out.extend_from_slice(&limb.to_le_bytes());
    }
    out
}

fn decode_share(bytes: &[u8]) -> Option<(u64, u64, ShareLimbs, ShareLimbs)> {
    if bytes.len() != SHARE_PLAINTEXT_LEN {
        return None;
    }
    let word = |i: usize| -> Option<u64> { Some(u64::from_le_bytes(bytes.get(8 * i..8 * i + 8)?.try_into().ok()?)) };
    let mut seed_share = [0u64; SHARE_LIMBS];
    let mut key_share = [0u64; SHARE_LIMBS];
    for limb in 0..SHARE_LIMBS {
        seed_share[limb] = word(2 + limb)?;
        key_share[limb] = word(2 + SHARE_LIMBS + limb)?;
    }
    if seed_share.iter().chain(&key_share).any(|&v| v >= shamir::FIELD_PRIME) {
        return None;
    }
    Some((word(0)?, word(1)?, seed_share, key_share))
}
