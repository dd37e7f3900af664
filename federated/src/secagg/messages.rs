//! The protocol's messages, one type per arrow. Client-to-server messages carry the sender's id; a
//! server-to-client message carries its addressee. All are plain serde data so the round can carry
//! them over any transport (in-process calls, QUIC streams, the simulator's network).

use serde::{Deserialize, Serialize};

use super::shamir::ShareLimbs;

/// Bytes of the plaintext of one encrypted share: `from`, `to`, the self-mask seed share and the
/// mask-key share.
pub(crate) const SHARE_PLAINTEXT_LEN: usize = 16 + 2 * 8 * super::shamir::SHARE_LIMBS;
/// Bytes of one encrypted share: the plaintext plus the 16-byte Poly1305 tag.
pub const SHARE_CIPHERTEXT_LEN: usize = SHARE_PLAINTEXT_LEN + 16;

/// Phase 0, client to server: the client's two X25519 public keys.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct AdvertiseKeys {
    /// The sender.
    pub client: u64,
    /// Public key of the pairwise-mask agreement.
    pub mask_public: [u8; 32],
    /// Public key of the share-encryption agreement.
    pub share_public: [u8; 32],
}

/// One neighbour's public keys, as the server relays them.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct NeighbourKeys {
    /// The neighbour.
    pub client: u64,
    /// Its pairwise-mask public key.
    pub mask_public: [u8; 32],
    /// Its share-encryption public key.
    pub share_public: [u8; 32],
}

/// Phase 1, server to client: the addressee's neighbours in the round's graph, with their keys.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct Roster {
    /// The addressee.
    pub client: u64,
    /// Its neighbours, sorted by id.
    pub neighbours: Vec<NeighbourKeys>,
}

/// A Shamir share sealed (ChaCha20-Poly1305) for one neighbour; the server relays it unread.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct EncryptedShare {
    /// The client whose secrets are shared.
    pub from: u64,
    /// The neighbour that may open it.
    pub to: u64,
    /// `SHARE_CIPHERTEXT_LEN` bytes.
    pub ciphertext: Vec<u8>,
}

/// Phase 1, client to server: the sender's shares, one per neighbour.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct ShareKeys {
    /// The sender.
    pub client: u64,
    /// One sealed share per roster neighbour.
    pub shares: Vec<EncryptedShare>,
}

/// Phase 2, server to client: the shares addressed to the client by neighbours that sent theirs.
/// The client masks pairwise with exactly these neighbours.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct ForwardedShares {
    /// The addressee.
    pub client: u64,
    /// Sealed shares addressed to it, sorted by sender.
    pub shares: Vec<EncryptedShare>,
}

/// Phase 2, client to server: the masked, quantised update.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct MaskedInput {
    /// The sender.
    pub client: u64,
    /// `vector_len` words of Z_{2^32}.
    pub masked: Vec<u32>,
}

/// Phase 3, server to client: which of the addressee's neighbours survived (reveal their self-mask
/// seed shares) and which dropped after sharing (reveal their mask-key shares). Disjoint.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct UnmaskRequest {
    /// The addressee.
    pub client: u64,
    /// Neighbours whose masked input arrived, sorted.
    pub survivors: Vec<u64>,
    /// Neighbours that shared keys but whose masked input did not arrive, sorted.
    pub dropped: Vec<u64>,
}

/// One revealed share of `owner`'s secret.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct ShareReveal {
    /// The client whose secret this is a share of.
    pub owner: u64,
    /// The share's field elements (`SHARE_LIMBS` of them).
    pub share: Vec<u64>,
}

/// Phase 3, client to server: the requested shares.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct UnmaskShares {
    /// The sender.
    pub client: u64,
    /// Shares of surviving neighbours' self-mask seeds.
    pub self_mask_shares: Vec<ShareReveal>,
    /// Shares of dropped neighbours' mask keys.
    pub mask_key_shares: Vec<ShareReveal>,
}

impl ShareReveal {
    pub(crate) fn new(owner: u64, share: &ShareLimbs) -> Self {
        ShareReveal { owner, share: share.to_vec() }
    }
}
