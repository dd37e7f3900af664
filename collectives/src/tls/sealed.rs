//! Payloads left sealed by a TLS reader thread, opened by the operation where it uses them.
//!
//! A ring reads every received payload once, front to back: an all-gather step copies it into
//! the output, a reduce-scatter step combines it (into its own part, or into the frame it sends
//! on); the sender flags those frames ([`crate::frame::FLAG_COPIED`]). The reader opens each
//! frame's header record as usual, and when the header says so and the payload is large, it does
//! not open the payload's records: it takes their places in the key sequence ([`Opener::skip`])
//! and hands them on as a [`SealedRecords`], which the operation opens into the output
//! ([`crate::SealedPayload::open_into`]) or one record at a time into a scratch record it combines
//! from ([`crate::SealedPayload::cursor`]). Each byte is then decrypted once, where it is wanted or
//! into cache, instead of decrypted in place in the read buffer and read again later (the
//! all-gather copy was the operation threads' largest cost beside the cipher in a profile at
//! 16 MiB, BENCHMARKS.md).
//!
//! Which records the reader may leave sealed: the sender seals a frame's header and payload as
//! separate parts ([`super::record::Sealer::seal_parts`]), so a header ends with its record and the
//! payload's records hold nothing else. The reader follows the plaintext stream record by record
//! ([`StreamPosition`]) to see a copied header end at a record's end. It then leaves sealed every
//! record of the payload but the small ones (at most [`EAGER_BODY_MAX`] bytes of body), which it
//! opens at once: a KeyUpdate or an alert must be followed in order, and a small data record (a
//! payload's tail) joins the sealed pieces as plaintext. A record that would run past the payload
//! breaks the link: the peer is not this code.
//!
//! A record that does not open (altered, or not application data) fails the operation with
//! [`crate::Error::Unauthentic`] and breaks the link it came on, so the peer fails too, as when
//! the reader finds a bad record itself.

use bytes::Bytes;

use super::record::{RecordError, SealedRecord, MAX_BODY};
use super::LinkSockets;
use crate::frame::{decode_header, says_copied, HEADER_LEN};
use crate::quic::CHUNKED_FRAME_MIN_BYTES;
use crate::transport::{PlainCursor, SealedPayload};

/// Records with a body this small are always opened by the reader (KeyUpdate: 22 bytes,
/// close_notify: 19); a payload record sealed by this crate is far larger unless it is a tail.
pub(super) const EAGER_BODY_MAX: usize = 256;

/// Where a connection's plaintext stream stands between frames, followed by the reader as it
/// opens records (before the frame cutter sees them), to find payloads it may leave sealed.
#[derive(Debug)]
pub(super) struct StreamPosition {
    max_payload: usize,
    header: [u8; HEADER_LEN],
    header_have: usize,
    /// Payload bytes of the current frame not seen yet.
    payload_left: usize,
    /// The header just ended at a record's end, flagged copied, with this large a payload.
    copied_payload: Option<usize>,
}

impl StreamPosition {
    pub(super) fn new(max_payload: usize) -> Self {
        StreamPosition { max_payload, header: [0; HEADER_LEN], header_have: 0, payload_left: 0, copied_payload: None }
    }

    /// Follows one record's (or the handshake's) plaintext.
    pub(super) fn advance(&mut self, mut plain: &[u8]) -> Result<(), String> {
        self.copied_payload = None;
        while !plain.is_empty() {
            if self.payload_left > 0 {
                let take = self.payload_left.min(plain.len());
                self.payload_left -= take;
                plain = &plain[take..];
                continue;
            }
            let take = (HEADER_LEN - self.header_have).min(plain.len());
            self.header[self.header_have..self.header_have + take].copy_from_slice(&plain[..take]);
            self.header_have += take;
            plain = &plain[take..];
            if self.header_have == HEADER_LEN {
                self.header_have = 0;
                // Bounded by the cap just checked, so it fits in usize.
                let len = decode_header(&self.header, self.max_payload).map_err(|e| format!("bad frame header: {e}"))?.payload_len as usize;
                self.payload_left = len;
                if plain.is_empty() && len >= CHUNKED_FRAME_MIN_BYTES && says_copied(&self.header) {
                    self.copied_payload = Some(len);
                }
            }
        }
        Ok(())
    }

    /// The payload length, when the last record ended a copied frame's header and the payload
    /// that follows may be left sealed; the position then skips that payload.
    pub(super) fn take_copied_payload(&mut self) -> Option<usize> {
        let len = self.copied_payload.take()?;
        self.payload_left = 0;
        Some(len)
    }
}

/// One piece of a payload left sealed.
pub(super) enum SealedPiece {
    /// A whole record (header included) and how to open it.
    Record(Bytes, SealedRecord),
    /// A small record the reader opened (a payload's tail): its plaintext.
    Plain(Bytes),
}

impl SealedPiece {
    /// Plaintext bytes it stands for.
    pub(super) fn len(&self) -> usize {
        match self {
            SealedPiece::Record(record, _) => SealedRecord::data_len(record),
            SealedPiece::Plain(plain) => plain.len(),
        }
    }
}

/// A frame payload left sealed: its records in order, and the link they came on, broken if one
/// does not open.
pub(super) struct SealedRecords {
    pieces: Vec<SealedPiece>,
    len: usize,
    link: LinkSockets,
}

impl SealedRecords {
    pub(super) fn new(link: LinkSockets) -> Self {
        SealedRecords { pieces: Vec::new(), len: 0, link }
    }

    pub(super) fn push(&mut self, piece: SealedPiece) {
        self.len += piece.len();
        self.pieces.push(piece);
    }

    fn open_all(&self, dst: &mut [u8]) -> Result<(), RecordError> {
        let mut at = 0;
        // Room for the largest record body a peer may send (MAX_BODY), so the last record opens
        // on the stack: no allocation per frame.
        let mut last = [0u8; MAX_BODY];
        for piece in &self.pieces {
            match piece {
                SealedPiece::Plain(plain) => dst[at..at + plain.len()].copy_from_slice(plain),
                SealedPiece::Record(record, how) => {
                    // The content type lands one byte past the data: in `dst` where the next
                    // piece overwrites it, or in a scratch copy for a record that ends the payload.
                    let len = SealedRecord::data_len(record);
                    if at + len < dst.len() {
                        how.open_into(record, &mut dst[at..])?;
                    } else {
                        how.open_into(record, &mut last)?;
                        dst[at..at + len].copy_from_slice(&last[..len]);
                    }
                }
            }
            at += piece.len();
        }
        Ok(())
    }
}

impl SealedRecords {
    /// A record that did not open: the stream can no longer be trusted, so the link goes down
    /// and the peer fails too.
    fn failed(&self, e: RecordError) -> String {
        tracing::warn!(error = %e, "tls payload left sealed does not open, closing the link");
        self.link.shutdown();
        e.to_string()
    }
}

impl SealedPayload for SealedRecords {
    fn len(&self) -> usize {
        self.len
    }

    fn open_into(&self, dst: &mut [u8]) -> Result<(), String> {
        if dst.len() != self.len {
            return Err(format!("{} bytes of room for a payload of {}", dst.len(), self.len));
        }
        self.open_all(dst).map_err(|e| self.failed(e))
    }

    fn cursor(&self) -> Box<dyn PlainCursor + '_> {
        Box::new(RecordCursor { records: self, next: 0, current: Current::Nothing, scratch: Box::new([0; MAX_BODY]) })
    }
}

/// Opens a payload left sealed one record at a time into its own scratch record
/// ([`SealedPayload::cursor`]), for an operation that uses each piece once (combines it into
/// something else) and needs it nowhere whole.
struct RecordCursor<'a> {
    records: &'a SealedRecords,
    next: usize,
    current: Current,
    /// Room for the largest record body a peer may send.
    scratch: Box<[u8; MAX_BODY]>,
}

/// What [`RecordCursor::piece`] shows.
enum Current {
    Nothing,
    /// A piece the reader opened already (by index).
    Plain(usize),
    /// This many bytes opened into the scratch record.
    Opened(usize),
}

impl PlainCursor for RecordCursor<'_> {
    fn advance(&mut self) -> Result<bool, String> {
        let Some(piece) = self.records.pieces.get(self.next) else {
            self.current = Current::Nothing;
            return Ok(false);
        };
        self.current = match piece {
            SealedPiece::Plain(_) => Current::Plain(self.next),
            SealedPiece::Record(record, how) => {
                how.open_into(record, &mut self.scratch[..]).map_err(|e| self.records.failed(e))?;
                Current::Opened(SealedRecord::data_len(record))
            }
        };
        self.next += 1;
        Ok(true)
    }

    fn next_len(&self) -> Option<usize> {
        match self.records.pieces.get(self.next)? {
            SealedPiece::Record(record, _) => Some(SealedRecord::data_len(record)),
            SealedPiece::Plain(_) => None,
        }
    }

    fn advance_into(&mut self, dst: &mut [u8]) -> Result<(), String> {
        let Some(SealedPiece::Record(record, how)) = self.records.pieces.get(self.next) else {
            return Err("no sealed record to open next".into());
        };
        if dst.len() <= SealedRecord::data_len(record) {
            return Err(format!("{} bytes of room for a record of {} (one more needed)", dst.len(), SealedRecord::data_len(record)));
        }
        how.open_into(record, dst).map_err(|e| self.records.failed(e))?;
        self.current = Current::Nothing;
        self.next += 1;
        Ok(())
    }

    fn piece(&self) -> &[u8] {
        match self.current {
            Current::Nothing => &[],
            Current::Plain(i) => match self.records.pieces.get(i) {
                Some(SealedPiece::Plain(plain)) => plain,
                _ => &[],
            },
            Current::Opened(n) => &self.scratch[..n],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::frame::{encode_header_copied, encode_header_only_checksum, FrameHeader, OpKind};

    fn header(len: usize, copied: bool) -> [u8; HEADER_LEN] {
        let h = FrameHeader { group: 0, generation: 1, seq: 2, op: OpKind::AllReduce, chunk: 3, src: 1, dtype: None, payload_len: len as u64, channels: 0 };
        if copied {
            encode_header_copied(&h, len)
        } else {
            encode_header_only_checksum(&h, len)
        }
    }

    #[test]
    fn a_copied_header_ending_with_its_record_offers_its_payload() {
        let mut p = StreamPosition::new(1 << 24);
        p.advance(&header(1 << 20, true)).unwrap();
        assert_eq!(p.take_copied_payload(), Some(1 << 20));
        assert_eq!(p.take_copied_payload(), None, "offered once");
        // The payload was skipped: the next bytes are a header again.
        p.advance(&header(100, false)).unwrap();
        p.advance(&[0; 100]).unwrap();
        assert_eq!(p.take_copied_payload(), None);
    }

    #[test]
    fn only_copied_large_payloads_after_a_whole_header_are_offered() {
        // Not flagged.
        let mut p = StreamPosition::new(1 << 24);
        p.advance(&header(1 << 20, false)).unwrap();
        assert_eq!(p.take_copied_payload(), None);
        // Flagged, but small.
        let mut p = StreamPosition::new(1 << 24);
        p.advance(&header(CHUNKED_FRAME_MIN_BYTES - 1, true)).unwrap();
        assert_eq!(p.take_copied_payload(), None);
        // Flagged, but the payload starts in the header's record.
        let mut p = StreamPosition::new(1 << 24);
        let mut both = header(1 << 20, true).to_vec();
        both.extend_from_slice(&[7; 10]);
        p.advance(&both).unwrap();
        assert_eq!(p.take_copied_payload(), None);
        // Flagged, the header split over two records: offered after the second.
        let mut p = StreamPosition::new(1 << 24);
        let h = header(1 << 20, true);
        p.advance(&h[..10]).unwrap();
        assert_eq!(p.take_copied_payload(), None);
        p.advance(&h[10..]).unwrap();
        assert_eq!(p.take_copied_payload(), Some(1 << 20));
    }

    #[test]
    fn a_bad_header_is_an_error() {
        let mut p = StreamPosition::new(1 << 24);
        assert!(p.advance(&[0xAB; HEADER_LEN]).unwrap_err().contains("bad frame header"));
    }
}
