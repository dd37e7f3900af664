//! TLS 1.3 record protection for the TLS transport's data path (RFC 8446 §5.2), done here rather
//! than inside rustls so that each direction of a connection is owned by its own thread.
//!
//! rustls runs the handshake and the key schedule; the transport then takes the traffic keys out
//! (`dangerous_into_kernel_connection`, the path kTLS uses) and seals and opens records with
//! aws-lc's AES-GCM itself: a [`Sealer`] used by the sending operations (under the connection's
//! lock, so records leave in sequence order), an [`Opener`] in the connection's reader thread,
//! with no lock between them and no copy at all: a send seals straight from the caller's memory
//! into the record buffer (the cipher's read is the only pass over the plaintext), a receive opens
//! records in place in the buffer the socket read into. The wire is plain TLS 1.3: outer type 23,
//! version 0x0303, the inner content type after the plaintext, the nonce the per-direction
//! sequence number XORed into the IV, the record header as AEAD data.
//!
//! Key updates: AES-GCM may seal only so many records under one key (the suite's
//! confidentiality limit, 2^24 records for AES-128-GCM in rustls). A [`Sealer`] sends a KeyUpdate
//! handshake message and switches to the next traffic secret (rustls's `KernelConnection`
//! derives it) after `update_every` records, and an [`Opener`] follows the peer's KeyUpdate.
//! Peers never ask each other to update (`update_requested` is refused as a protocol error):
//! answering would need the reader to reach into the writer's key, and both ends are this code.

use std::ops::Range;
use std::sync::{Arc, Mutex};

use aws_lc_rs::aead::{Aad, LessSafeKey, Nonce, UnboundKey, AES_128_GCM, AES_256_GCM, CHACHA20_POLY1305, NONCE_LEN};
use rustls::client::ClientConnectionData;
use rustls::kernel::KernelConnection;
use rustls::server::ServerConnectionData;
use rustls::ConnectionTrafficSecrets;

use crate::sync::lock;

/// Bytes of a record header: type, legacy version, length.
pub(crate) const RECORD_HEADER_LEN: usize = 5;
/// Largest plaintext of one record.
pub(crate) const MAX_PLAINTEXT: usize = 1 << 14;
/// The AEAD tag after every record body.
pub(crate) const TAG_LEN: usize = 16;
/// Largest record body a peer may send (plaintext, content type, padding and tag: RFC 8446 §5.2).
pub(crate) const MAX_BODY: usize = MAX_PLAINTEXT + 256;
/// Largest whole record.
pub(crate) const MAX_RECORD: usize = RECORD_HEADER_LEN + MAX_BODY;
/// Bytes a record adds to its plaintext when sealed here (header, content type, tag).
pub(crate) const RECORD_OVERHEAD: usize = RECORD_HEADER_LEN + 1 + TAG_LEN;

const APPLICATION_DATA: u8 = 23;
const HANDSHAKE: u8 = 22;
const ALERT: u8 = 21;
const KEY_UPDATE: u8 = 24;
/// KeyUpdate with `update_not_requested`.
const KEY_UPDATE_MESSAGE: [u8; 5] = [KEY_UPDATE, 0, 0, 1, 0];
const CLOSE_NOTIFY: u8 = 0;

/// What went wrong with a record; the connection ends with it.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub(crate) enum RecordError {
    /// The header names another record type or version, or an impossible length.
    #[error("bad record header {0:02x?}")]
    BadHeader([u8; RECORD_HEADER_LEN]),
    /// The tag does not match: altered bytes, or another key.
    #[error("record {seq} does not authenticate")]
    Unauthentic { seq: u64 },
    /// Authenticated, but not something this transport speaks (an alert, a handshake message
    /// other than KeyUpdate, a requested update, an all-padding record).
    #[error("unsupported record content: {0}")]
    Unsupported(String),
    /// Keys could not be made or updated.
    #[error("record keys: {0}")]
    Keys(String),
}

/// The rustls half that derives the next traffic secrets, shared by a connection's two directions.
pub(crate) enum KeySchedule {
    Client(KernelConnection<ClientConnectionData>),
    Server(KernelConnection<ServerConnectionData>),
}

impl KeySchedule {
    fn next(&mut self, transmit: bool) -> Result<(u64, ConnectionTrafficSecrets), rustls::Error> {
        match (self, transmit) {
            (KeySchedule::Client(k), true) => k.update_tx_secret(),
            (KeySchedule::Client(k), false) => k.update_rx_secret(),
            (KeySchedule::Server(k), true) => k.update_tx_secret(),
            (KeySchedule::Server(k), false) => k.update_rx_secret(),
        }
    }

    /// The negotiated suite's confidentiality limit (records per key).
    pub(crate) fn confidentiality_limit(&self) -> u64 {
        let suite = match self {
            KeySchedule::Client(k) => k.negotiated_cipher_suite(),
            KeySchedule::Server(k) => k.negotiated_cipher_suite(),
        };
        match suite {
            rustls::SupportedCipherSuite::Tls13(s) => s.common.confidentiality_limit,
            #[allow(unreachable_patterns)]
            _ => 1 << 23,
        }
    }
}

/// One direction's key, IV and sequence number. The key is shared with the records left sealed
/// under it ([`SealedRecord`]), which may be opened after a key update replaced it here.
struct DirectionKey {
    key: Arc<LessSafeKey>,
    iv: [u8; NONCE_LEN],
    seq: u64,
}

impl DirectionKey {
    fn new(seq: u64, secrets: ConnectionTrafficSecrets) -> Result<Self, RecordError> {
        let (algorithm, key, iv) = match &secrets {
            ConnectionTrafficSecrets::Aes128Gcm { key, iv } => (&AES_128_GCM, key, iv),
            ConnectionTrafficSecrets::Aes256Gcm { key, iv } => (&AES_256_GCM, key, iv),
            ConnectionTrafficSecrets::Chacha20Poly1305 { key, iv } => (&CHACHA20_POLY1305, key, iv),
            _ => return Err(RecordError::Keys("a cipher this transport does not seal with".into())),
        };
        let key = UnboundKey::new(algorithm, key.as_ref()).map_err(|_| RecordError::Keys("bad key length".into()))?;
        let iv: [u8; NONCE_LEN] = iv.as_ref().try_into().map_err(|_| RecordError::Keys("bad IV length".into()))?;
        Ok(DirectionKey { key: Arc::new(LessSafeKey::new(key)), iv, seq })
    }

    /// The next record's nonce (the sequence number XORed into the IV's low bytes); advances it.
    fn next_nonce(&mut self) -> Nonce {
        Nonce::assume_unique_for_key(self.next_nonce_bytes())
    }

    fn next_nonce_bytes(&mut self) -> [u8; NONCE_LEN] {
        let mut nonce = self.iv;
        for (n, s) in nonce[NONCE_LEN - 8..].iter_mut().zip(self.seq.to_be_bytes()) {
            *n ^= s;
        }
        self.seq += 1;
        nonce
    }
}

/// Seals this end's records (the writer thread's half).
pub(crate) struct Sealer {
    key: DirectionKey,
    schedule: Arc<Mutex<KeySchedule>>,
    update_every: u64,
    /// Key updates made so far (a [`SealMark`] is only rewound to under the same key).
    updates: u64,
}

/// Where a [`Sealer`] stood before a frame, to take back records sealed but never sent
/// ([`Sealer::rewind`]).
#[derive(Clone, Copy, Debug)]
pub(crate) struct SealMark {
    seq: u64,
    updates: u64,
}

/// Why [`Sealer::seal_filled`] sealed no frame.
#[derive(Debug)]
pub(crate) enum FillFailed<E> {
    /// The payload's producer failed; the caller rewinds (or, past a key update, drops the link).
    Fill(E),
    /// The sealer itself failed (keys).
    Record(RecordError),
}

impl Sealer {
    pub(crate) fn new(seq: u64, secrets: ConnectionTrafficSecrets, schedule: Arc<Mutex<KeySchedule>>, update_every: u64) -> Result<Self, RecordError> {
        Ok(Sealer { key: DirectionKey::new(seq, secrets)?, schedule, update_every: update_every.max(2), updates: 0 })
    }

    /// Where the sealer stands now.
    pub(crate) fn mark(&self) -> SealMark {
        SealMark { seq: self.key.seq, updates: self.updates }
    }

    /// Takes back the records sealed since `mark` (the caller drops their bytes unsent), so the
    /// next record reuses their sequence numbers. Not possible past a key update (the old key is
    /// gone, and the peer would follow the update): `false`, and the connection's sequence is
    /// broken.
    pub(crate) fn rewind(&mut self, mark: SealMark) -> bool {
        if mark.updates != self.updates {
            return false;
        }
        self.key.seq = mark.seq;
        true
    }

    /// Appends `plaintext` to `out` as application-data records of at most 16 KiB each.
    pub(crate) fn seal(&mut self, plaintext: &[u8], out: &mut RecordBuf) -> Result<(), RecordError> {
        self.seal_parts([plaintext], out)
    }

    /// Appends the concatenation of `parts` to `out` as application-data records, each part in
    /// records of its own (at most 16 KiB each; the receiver cuts frames from the plaintext stream,
    /// so where records end does not matter). Each record is sealed straight from the part's
    /// memory into `out` (out of place: the cipher's read is the only pass over the plaintext, no
    /// copy before it), the inner content type sealed after it as extra plaintext. A key update due
    /// between two records is appended between them.
    pub(crate) fn seal_parts<'a>(&mut self, parts: impl IntoIterator<Item = &'a [u8]>, out: &mut RecordBuf) -> Result<(), RecordError> {
        for part in parts {
            out.reserve(sealed_len(part.len()));
            for piece in part.chunks(MAX_PLAINTEXT) {
                self.seal_record(APPLICATION_DATA, piece, out)?;
                if self.key.seq + 1 >= self.update_every {
                    self.update(out)?;
                }
            }
        }
        Ok(())
    }

    /// Appends a payload of `len` bytes to `out` as application-data records of at most 16 KiB,
    /// each record's plaintext written by `fill(range, plaintext)` (payload bytes `range`, in
    /// order, every range starting at a multiple of 16 KiB) straight into the record and sealed
    /// there: what `fill` computes is written once and sealed while in cache. On a failure of
    /// `fill`, records already appended stay in `out`: the caller truncates them and
    /// [`rewind`](Self::rewind)s.
    pub(crate) fn seal_filled<E>(&mut self, len: usize, out: &mut RecordBuf, mut fill: impl FnMut(Range<usize>, &mut [u8]) -> Result<(), E>) -> Result<(), FillFailed<E>> {
        out.reserve(sealed_len(len));
        let mut at = 0;
        while at < len {
            let n = MAX_PLAINTEXT.min(len - at);
            let body = n + 1 + TAG_LEN;
            let header = [APPLICATION_DATA, 3, 3, (body >> 8) as u8, body as u8];
            let record = out.append(RECORD_HEADER_LEN + body);
            let (header_out, body_out) = record.split_at_mut(RECORD_HEADER_LEN);
            header_out.copy_from_slice(&header);
            let (plain, tag_out) = body_out.split_at_mut(n + 1);
            fill(at..at + n, &mut plain[..n]).map_err(FillFailed::Fill)?;
            plain[n] = APPLICATION_DATA;
            let nonce = self.key.next_nonce();
            let tag = self.key.key.seal_in_place_separate_tag(nonce, Aad::from(header), plain).map_err(|_| FillFailed::Record(RecordError::Keys("seal failed".into())))?;
            tag_out.copy_from_slice(tag.as_ref());
            at += n;
            if self.key.seq + 1 >= self.update_every {
                self.update(out).map_err(FillFailed::Record)?;
            }
        }
        Ok(())
    }

    /// Appends one record of at most 16 KiB with inner content type `content_type`, sealed
    /// straight from `piece` into `out`.
    fn seal_record(&mut self, content_type: u8, piece: &[u8], out: &mut RecordBuf) -> Result<(), RecordError> {
        let body = piece.len() + 1 + TAG_LEN;
        // At most 16 KiB + 17: fits the u16 length.
        let header = [APPLICATION_DATA, 3, 3, (body >> 8) as u8, body as u8];
        let record = out.append(RECORD_HEADER_LEN + body);
        let (header_out, body_out) = record.split_at_mut(RECORD_HEADER_LEN);
        header_out.copy_from_slice(&header);
        let (ciphertext, type_and_tag) = body_out.split_at_mut(piece.len());
        let nonce = self.key.next_nonce();
        self.key
            .key
            .seal_out_of_place_scatter(nonce, Aad::from(header), piece, ciphertext, &[content_type], type_and_tag)
            .map_err(|_| RecordError::Keys("seal failed".into()))
    }

    /// Sends a KeyUpdate under the old key, then switches to the next one.
    fn update(&mut self, out: &mut RecordBuf) -> Result<(), RecordError> {
        self.seal_record(HANDSHAKE, &KEY_UPDATE_MESSAGE, out)?;
        let (seq, secrets) = lock(&self.schedule).next(true).map_err(|e| RecordError::Keys(e.to_string()))?;
        self.key = DirectionKey::new(seq, secrets)?;
        self.updates += 1;
        tracing::debug!("tls record key updated (transmit)");
        Ok(())
    }
}

/// Bytes that [`Sealer::seal_parts`] appends for a part of `plaintext` bytes (key updates aside).
fn sealed_len(plaintext: usize) -> usize {
    plaintext + plaintext.div_ceil(MAX_PLAINTEXT) * RECORD_OVERHEAD
}

/// Sealed records waiting to be written: a buffer that stays initialized across uses (the bytes
/// past `len` are stale, never zeroed again), so that sealing a frame writes each byte once. A
/// connection's writer hands its buffers back for the next frames ([`RecordBuf::clear`]).
#[derive(Default)]
pub(crate) struct RecordBuf {
    bytes: Vec<u8>,
    len: usize,
    /// Sealed bytes already written (from the front), no longer in [`Self::as_slice`].
    written: usize,
}

impl RecordBuf {
    /// The sealed bytes not written yet.
    pub(crate) fn as_slice(&self) -> &[u8] {
        &self.bytes[self.written..self.len]
    }

    /// Takes the first `n` bytes of [`Self::as_slice`] as written.
    pub(crate) fn mark_written(&mut self, n: usize) {
        self.written = (self.written + n).min(self.len);
    }

    /// Whether some of the sealed bytes were written already.
    pub(crate) fn begun(&self) -> bool {
        self.written > 0
    }

    /// Forgets the sealed bytes, keeping the memory.
    pub(crate) fn clear(&mut self) {
        self.len = 0;
        self.written = 0;
    }

    /// Forgets the sealed bytes past the first `len`.
    pub(crate) fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }

    /// Sealed bytes held.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Bytes held, used or not.
    pub(crate) fn capacity(&self) -> usize {
        self.bytes.len()
    }

    /// Makes room for `additional` more bytes at once (zeroing only memory new to the buffer).
    fn reserve(&mut self, additional: usize) {
        let end = self.len + additional;
        if self.bytes.len() < end {
            self.bytes.resize(end, 0);
        }
    }

    /// Extends the used part by `n` bytes and returns them, to be overwritten whole.
    fn append(&mut self, n: usize) -> &mut [u8] {
        self.reserve(n);
        let start = self.len;
        self.len += n;
        &mut self.bytes[start..self.len]
    }
}

/// What an opened record held.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Opened {
    /// Application data at this range of the record's bytes (maybe empty).
    Data(Range<usize>),
    /// The peer's KeyUpdate, already followed.
    KeyUpdated,
    /// The peer's close_notify: nothing more comes.
    Closed,
}

/// Opens the peer's records (the reader thread's half).
pub(crate) struct Opener {
    key: DirectionKey,
    schedule: Arc<Mutex<KeySchedule>>,
}

impl Opener {
    pub(crate) fn new(seq: u64, secrets: ConnectionTrafficSecrets, schedule: Arc<Mutex<KeySchedule>>) -> Result<Self, RecordError> {
        Ok(Opener { key: DirectionKey::new(seq, secrets)?, schedule })
    }

    /// Opens the whole record `record` (header included, as [`record_len`] measured it) in place.
    pub(crate) fn open(&mut self, record: &mut [u8]) -> Result<Opened, RecordError> {
        let header: [u8; RECORD_HEADER_LEN] = match record.get(..RECORD_HEADER_LEN).and_then(|h| h.try_into().ok()) {
            Some(h) => h,
            None => return Err(RecordError::BadHeader([0; RECORD_HEADER_LEN])),
        };
        if record_len(&header)? != Some(record.len()) {
            return Err(RecordError::BadHeader(header));
        }
        let seq = self.key.seq;
        let nonce = self.key.next_nonce();
        // Tag apart and the plaintext left where the ciphertext was: `open_in_place` would also
        // move the plaintext onto itself (a memmove of every record, measured at nearly the
        // cost of the cipher in the reader threads).
        let body = &mut record[RECORD_HEADER_LEN..];
        let sealed_len = body.len().checked_sub(TAG_LEN).ok_or(RecordError::BadHeader(header))?;
        let (ciphertext, tag) = body.split_at_mut(sealed_len);
        let plain = self.key.key.open_in_place_separate_tag(nonce, Aad::from(header), tag, ciphertext).map_err(|_| RecordError::Unauthentic { seq })?;
        // The content type is the last non-zero byte; zeros after it are padding.
        let Some(type_at) = plain.iter().rposition(|&b| b != 0) else {
            return Err(RecordError::Unsupported("a record of padding only".into()));
        };
        let data = RECORD_HEADER_LEN..RECORD_HEADER_LEN + type_at;
        match plain[type_at] {
            APPLICATION_DATA => Ok(Opened::Data(data)),
            HANDSHAKE if plain[..type_at] == KEY_UPDATE_MESSAGE => {
                let (seq, secrets) = lock(&self.schedule).next(false).map_err(|e| RecordError::Keys(e.to_string()))?;
                self.key = DirectionKey::new(seq, secrets)?;
                tracing::debug!("tls record key updated (receive)");
                Ok(Opened::KeyUpdated)
            }
            ALERT if type_at == 2 && plain[1] == CLOSE_NOTIFY => Ok(Opened::Closed),
            ALERT if type_at == 2 => Err(RecordError::Unsupported(format!("alert {}", plain[1]))),
            other => Err(RecordError::Unsupported(format!("content type {other} ({type_at} bytes)"))),
        }
    }
}

impl Opener {
    /// Takes the next record's place in the sequence without opening it: the key and nonce it
    /// is sealed under, to open it later ([`SealedRecord::open_into`]). Only application data may
    /// be left sealed (a KeyUpdate or an alert must be opened at once to be followed): the
    /// reader leaves only records too large to be anything else, and opening checks the type.
    pub(crate) fn skip(&mut self) -> SealedRecord {
        let seq = self.key.seq;
        SealedRecord { key: Arc::clone(&self.key.key), nonce: self.key.next_nonce_bytes(), seq }
    }
}

/// How to open one record left sealed by the reader ([`Opener::skip`]).
#[derive(Clone)]
pub(crate) struct SealedRecord {
    key: Arc<LessSafeKey>,
    nonce: [u8; NONCE_LEN],
    seq: u64,
}

impl SealedRecord {
    /// The application data that `record` (header included, sealed by this crate's [`Sealer`]:
    /// no padding) carries: its body less the inner content type and the tag.
    pub(crate) fn data_len(record: &[u8]) -> usize {
        record.len().saturating_sub(RECORD_HEADER_LEN + 1 + TAG_LEN)
    }

    /// Authenticates `record` and decrypts its application data into `dst`, which must have
    /// room for one byte more than [`data_len`](Self::data_len): the sealed content type lands
    /// there (and is checked), to be overwritten by whatever follows.
    pub(crate) fn open_into(&self, record: &[u8], dst: &mut [u8]) -> Result<(), RecordError> {
        let header: [u8; RECORD_HEADER_LEN] = match record.get(..RECORD_HEADER_LEN).and_then(|h| h.try_into().ok()) {
            Some(h) => h,
            None => return Err(RecordError::BadHeader([0; RECORD_HEADER_LEN])),
        };
        let body = &record[RECORD_HEADER_LEN..];
        let sealed_len = body.len().checked_sub(TAG_LEN).filter(|&n| n >= 1).ok_or(RecordError::BadHeader(header))?;
        let (ciphertext, tag) = body.split_at(sealed_len);
        let out = dst.get_mut(..sealed_len).ok_or_else(|| RecordError::Unsupported("no room to open a sealed record".into()))?;
        let nonce = Nonce::assume_unique_for_key(self.nonce);
        self.key.open_separate_gather(nonce, Aad::from(header), ciphertext, tag, out).map_err(|_| RecordError::Unauthentic { seq: self.seq })?;
        match out[sealed_len - 1] {
            APPLICATION_DATA => Ok(()),
            other => Err(RecordError::Unsupported(format!("content type {other} in a record left sealed (padding, or not application data)"))),
        }
    }
}

/// The length of the record `bytes` starts with, header included, once its header is there
/// (`None` before); a header that cannot start a TLS 1.3 record is an error.
pub(crate) fn record_len(bytes: &[u8]) -> Result<Option<usize>, RecordError> {
    let Some(header) = bytes.get(..RECORD_HEADER_LEN) else {
        return Ok(None);
    };
    let body = usize::from(u16::from_be_bytes([header[3], header[4]]));
    if header[0] != APPLICATION_DATA || header[1..3] != [3, 3] || !(TAG_LEN + 1..=MAX_BODY).contains(&body) {
        let mut h = [0; RECORD_HEADER_LEN];
        h.copy_from_slice(header);
        return Err(RecordError::BadHeader(h));
    }
    Ok(Some(RECORD_HEADER_LEN + body))
}
