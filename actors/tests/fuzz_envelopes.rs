//! Fuzzing what a [`Link`] decodes from its byte stream: the envelope framing (length prefix,
//! kind, correlation id, actor name) and the rkyv bodies as [`Inbound::decode`] reads them.
//!
//! Every input is a byte stream fed to a real link ([`Link::over_stream`] over an in-memory
//! reader that hands the bytes out in random pieces, sometimes returning `Pending` first) whose
//! peer then goes away. Whatever the bytes, the link must deliver exactly the envelopes a
//! reference parser of the documented format (`actors/src/wire.rs`) finds, in order, and then
//! close with a typed reason (`malformed envelope: ...` or `peer went away...`), never panic or
//! hang; every delivered body decodes to `Ok` or `ActorError::Codec`, and what decodes re-encodes
//! to bytes that decode to the same value. Inputs are valid streams of one to three envelopes
//! (bodies: valid or mutated archives of several message shapes) mutated as a whole or not, the
//! systematic neighbourhood of valid streams, and random bytes (see `fuzz_support`).
//!
//! `cargo test -p rtx-actors --test fuzz_envelopes` runs 20,000 streams (each one is a real link
//! with its tasks: about 150 µs in the debug test build, so the full count would take minutes in
//! CI); the full run is
//! `RTX_FUZZ_INPUTS=1000000 cargo test --release -p rtx-actors --test fuzz_envelopes -- --nocapture`
//! (about 75 s; `RTX_FUZZ_SEED` replays a run).
#![allow(clippy::unwrap_used)]

#[path = "fuzz_support/mod.rs"]
mod fuzz_support;

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use fuzz_support::{Mutator, Values};
use rand::Rng;
use rand_chacha::ChaCha8Rng;
use rtx_actors::{ActorError, Link, StreamConn, MAX_ENVELOPE_BYTES};
use tokio::io::{AsyncRead, ReadBuf};

/// Message shapes that exercise rkyv's validation: enums, strings (inline and out of line),
/// vectors of scalars and of strings, options, boxes, tuples, floats of any bits.
#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize, Clone, Debug, PartialEq)]
enum Msg {
    Hello { name: String, step: u64, losses: Vec<f64> },
    Batch { ids: Vec<u32>, label: Option<String>, weight: f32 },
    Ping,
    Nested(Vec<(String, Option<Vec<u8>>)>),
    Boxed { inner: Option<Box<(u64, String)>>, flags: Vec<bool> },
}

fn msg(rng: &mut ChaCha8Rng) -> Msg {
    match rng.random_range(0..5) {
        0 => Msg::Hello { name: Values::string(rng), step: Values::u64(rng), losses: Values::vec(rng, 6, Values::f64) },
        1 => Msg::Batch { ids: Values::vec(rng, 12, Values::u32), label: Values::option(rng, Values::string), weight: Values::f64(rng) as f32 },
        2 => Msg::Ping,
        3 => Msg::Nested(Values::vec(rng, 4, |r| (Values::string(r), Values::option(r, |r| Values::bytes(r, 20))))),
        _ => Msg::Boxed { inner: Values::option(rng, |r| Box::new((Values::u64(r), Values::string(r)))), flags: Values::vec(rng, 5, |r| r.random()) },
    }
}

/// One envelope in the documented wire format (`actors/src/wire.rs`), written independently of
/// the crate's encoder.
fn envelope(kind: u8, correlation: u64, to: &[u8], body: &[u8]) -> Vec<u8> {
    let rest = 1 + 8 + 2 + to.len() + body.len();
    let mut out = Vec::with_capacity(4 + rest);
    out.extend_from_slice(&(rest as u32).to_le_bytes());
    out.push(kind);
    out.extend_from_slice(&correlation.to_le_bytes());
    out.extend_from_slice(&(to.len() as u16).to_le_bytes());
    out.extend_from_slice(to);
    out.extend_from_slice(body);
    out
}

/// A valid stream of one to three envelopes; bodies are valid archives, sometimes mutated.
fn valid_stream(rng: &mut ChaCha8Rng) -> Vec<u8> {
    let mut out = Vec::new();
    for _ in 0..rng.random_range(1..=3) {
        let mut body = rtx_actors::encode(&msg(rng)).unwrap();
        if rng.random_bool(0.3) {
            let other = rtx_actors::encode(&msg(rng)).unwrap();
            body = Mutator::mutate(rng, &body, &other);
        }
        let to = match rng.random_range(0..4) {
            0 => "supervisor".to_string(),
            1 => "agent".to_string(),
            _ => Values::string(rng),
        };
        out.extend(envelope(rng.random_range(0..4), Values::u64(rng), to.as_bytes(), &body));
    }
    out
}

/// How a stream ends, as the reference parser sees it.
#[derive(Debug, PartialEq)]
enum End {
    /// The bytes ran out (between or inside envelopes).
    Eof,
    /// An envelope broke the format.
    Malformed,
}

/// A delivered message: (to, body, wants a reply).
type Delivered = (String, Vec<u8>, bool);

/// The reference parser: what a link must deliver from `bytes`, and how it must end.
fn reference(bytes: &[u8]) -> (Vec<Delivered>, End) {
    let mut out = Vec::new();
    let mut at = 0usize;
    loop {
        let Some(prefix) = bytes.get(at..at + 4) else { return (out, End::Eof) };
        let len = u32::from_le_bytes(prefix.try_into().unwrap()) as usize;
        if !(11..=MAX_ENVELOPE_BYTES).contains(&len) {
            return (out, End::Malformed);
        }
        let Some(rest) = bytes.get(at + 4..at + 4 + len) else { return (out, End::Eof) };
        at += 4 + len;
        let kind = rest[0];
        if kind > 3 {
            return (out, End::Malformed);
        }
        let name_len = u16::from_le_bytes([rest[9], rest[10]]) as usize;
        let Some(name) = rest.get(11..11 + name_len) else { return (out, End::Malformed) };
        let Ok(name) = std::str::from_utf8(name) else { return (out, End::Malformed) };
        if kind <= 1 {
            out.push((name.to_string(), rest[11 + name_len..].to_vec(), kind == 1));
        }
    }
}

/// Hands out its bytes in random pieces, sometimes answering `Pending` (and waking) first.
struct Trickle {
    bytes: Vec<u8>,
    at: usize,
    pieces: Vec<usize>,
    next: usize,
    pended: bool,
}

impl AsyncRead for Trickle {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        let piece = if self.pieces.is_empty() { usize::MAX } else { self.pieces[self.next % self.pieces.len()] };
        if piece == 0 && !self.pended {
            // Pending once (woken at once), then one byte: never two in a row.
            self.pended = true;
            cx.waker().wake_by_ref();
            return Poll::Pending;
        }
        self.pended = false;
        self.next += 1;
        let n = piece.max(1).min(self.bytes.len() - self.at).min(buf.remaining());
        let at = self.at;
        buf.put_slice(&self.bytes[at..at + n]);
        self.at += n;
        Poll::Ready(Ok(()))
    }
}

/// The peer's side of the connection, as far as the link asks.
struct Conn;

impl StreamConn for Conn {
    fn close(&self, _reason: &str) {}

    fn export_keying_material(&self, _label: &[u8]) -> [u8; 32] {
        [7; 32]
    }

    fn remote_address(&self) -> SocketAddr {
        SocketAddr::from(([10, 0, 0, 2], 4000))
    }
}

/// Feeds `bytes` to a real link and checks it against the reference parser. Returns whether
/// every envelope was delivered and the stream ended cleanly (no malformed envelope).
async fn check_stream(bytes: &[u8], pieces: Vec<usize>, decoded: &mut u64) -> Result<bool, String> {
    let (want, end) = reference(bytes);
    let reader = Trickle { bytes: bytes.to_vec(), at: 0, pieces, next: 0, pended: false };
    let (link, mut inbound) = Link::over_stream("fuzz peer".into(), Arc::new(Conn), reader, tokio::io::sink());
    let mut got = Vec::new();
    let drained = tokio::time::timeout(Duration::from_secs(5), async {
        while let Some(msg) = inbound.recv().await {
            // Inbound::decode, as every actor calls it.
            match msg.decode::<Msg>() {
                Ok(value) => {
                    let again = rtx_actors::encode(&value).map_err(|e| format!("re-encoding a decoded body failed: {e}"))?;
                    let back = rtx_actors::decode::<Msg>(&again).map_err(|e| format!("a re-encoded body does not decode: {e}"))?;
                    if rtx_actors::encode(&back).map_err(|e| e.to_string())? != again {
                        return Err("decode(encode(decoded)) differs from decoded".to_string());
                    }
                }
                Err(ActorError::Codec(_)) => {}
                Err(other) => return Err(format!("decode failed with an untyped error: {other:?}")),
            }
            *decoded += 1;
            got.push((msg.to().to_string(), msg.wants_reply()));
        }
        Ok(())
    })
    .await;
    match drained {
        Err(_) => return Err("the link neither delivered nor closed within 5 s (hang)".into()),
        Ok(Err(wrong)) => return Err(wrong),
        Ok(Ok(())) => {}
    }
    let want_meta: Vec<(String, bool)> = want.iter().map(|(to, _, ask)| (to.clone(), *ask)).collect();
    if got != want_meta {
        return Err(format!("delivered {got:?}, the reference parser expects {want_meta:?}"));
    }
    let reason = link.closed_reason().ok_or("inbound ended but the link is not closed")?;
    let ok = match end {
        End::Malformed => reason.starts_with("malformed envelope: "),
        End::Eof => reason.starts_with("peer went away"),
    };
    if !ok {
        return Err(format!("link closed with {reason:?}; the reference parser expects {end:?}"));
    }
    Ok(end == End::Eof && !want.is_empty())
}

fn pieces(rng: &mut ChaCha8Rng) -> Vec<usize> {
    match rng.random_range(0..4) {
        0 => Vec::new(),
        1 => vec![1],
        _ => (0..rng.random_range(1..6)).map(|_| if rng.random_ratio(1, 5) { 0 } else { rng.random_range(1..40) }).collect(),
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap()
}

// Goal: at least 1M hostile streams (`RTX_FUZZ_INPUTS`; the default keeps `cargo test` cheap)
// give the reference parser's deliveries and a typed close, never a panic or a hang.
#[test]
fn hostile_streams_are_delivered_exactly_or_refused() {
    let seed = fuzz_support::seed("fuzz_envelopes");
    let n = fuzz_support::inputs(20_000);
    let rt = runtime();
    let mut decoded = 0u64;
    let pieces_of = std::cell::RefCell::new(Vec::new());
    let summary = fuzz_support::run(
        "fuzz_envelopes",
        seed,
        n,
        |rng| {
            *pieces_of.borrow_mut() = pieces(rng);
            let valid = valid_stream(rng);
            match rng.random_range(0..8) {
                0 => valid,
                7 => Mutator::random_bytes(rng, 300),
                _ => {
                    let other = valid_stream(rng);
                    Mutator::mutate(rng, &valid, &other)
                }
            }
        },
        |bytes| rt.block_on(check_stream(bytes, pieces_of.borrow().clone(), &mut decoded)),
    );
    eprintln!("fuzz_envelopes: {decoded} bodies decoded through Inbound::decode");
    assert!(summary.accepted > summary.inputs / 20, "too few inputs reached delivery: {summary:?}");
    assert!(decoded > summary.inputs / 4, "too few bodies reached the decoder: {decoded}");
}

// Goal: the systematic neighbourhood of valid streams (every truncation, every byte changed to
// boundary values, every aligned word corrupted) behaves as the reference parser says.
#[test]
fn every_truncation_and_byte_change_of_valid_streams() {
    let seed = fuzz_support::seed("fuzz_envelopes_neighbourhood");
    let rt = runtime();
    let mut corpus = Vec::new();
    for i in 0..8 {
        corpus.extend(Mutator::neighbourhood(&valid_stream(&mut fuzz_support::input_rng(seed, i))));
    }
    let mut decoded = 0u64;
    let total = corpus.len();
    let mut next = corpus.into_iter();
    fuzz_support::run("fuzz_envelopes_neighbourhood", seed, total, |_| next.next().unwrap_or_default(), |bytes| rt.block_on(check_stream(bytes, Vec::new(), &mut decoded)));
}

// Goal: the regressions and edge cases by hand: a length prefix at the cap and past it, a name
// running past the envelope, a name that is not UTF-8, an unknown kind, an empty body.
#[test]
fn framing_edge_cases() {
    let rt = runtime();
    let mut decoded = 0;
    let body = rtx_actors::encode(&Msg::Ping).unwrap();
    let good = envelope(0, 0, b"agent", &body);
    let cases: Vec<(Vec<u8>, End, usize)> = vec![
        (good.clone(), End::Eof, 1),
        ([good.clone(), good.clone()].concat(), End::Eof, 2),
        ((MAX_ENVELOPE_BYTES as u32 + 1).to_le_bytes().to_vec(), End::Malformed, 0),
        ((MAX_ENVELOPE_BYTES as u32).to_le_bytes().to_vec(), End::Eof, 0),
        (10u32.to_le_bytes().to_vec(), End::Malformed, 0),
        (envelope(4, 0, b"agent", &body), End::Malformed, 0),
        (envelope(1, 9, &[0xff, 0xfe], &body), End::Malformed, 0),
        ({
            let mut e = envelope(0, 0, b"agent", &body);
            e[13..15].copy_from_slice(&u16::MAX.to_le_bytes());
            e
        }, End::Malformed, 0),
        (envelope(1, 3, b"", &[]), End::Eof, 1),
        (envelope(2, 3, b"x", &[1, 2]), End::Eof, 0),
        (envelope(3, 3, b"x", &[0xff]), End::Eof, 0),
    ];
    for (bytes, end, delivered) in cases {
        assert_eq!(reference(&bytes).1, end);
        assert_eq!(reference(&bytes).0.len(), delivered);
        rt.block_on(check_stream(&bytes, Vec::new(), &mut decoded)).unwrap();
    }
}
