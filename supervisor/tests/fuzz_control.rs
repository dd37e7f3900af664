//! Fuzzing the decoders of the control protocol (`supervisor/src/protocol.rs`): `ToSupervisor`,
//! `ToWorker`, `JoinReply` and `StatusReport` as `Inbound::decode` (that is, `rtx_actors::decode`,
//! which it calls on the envelope's body) reads them from a peer's bytes.
//!
//! Each input is derived from the valid encoding of a random message of a random one of the four
//! types (every variant, random field values: long and multi-byte strings, NaN floats, boundary
//! integers), mutated structure-aware (`fuzz_support`: bit flips, boundary bytes, truncation,
//! extension, corrupted 32-bit lengths and relative pointers, inserted and deleted ranges,
//! splices with another message, random bytes), and decoded as **all four** types. Every decode
//! must give `Ok` or `ActorError::Codec`, never a panic or a hang, and a value that decodes
//! re-encodes to bytes that decode to the same bytes again. Valid encodings round-trip exactly.
//!
//! `cargo test -p rtx-supervisor --test fuzz_control` runs the full 1,000,000 inputs (four
//! million decodes, about 4 s of CPU in the debug test build); `RTX_FUZZ_INPUTS=N` changes the
//! count and `RTX_FUZZ_SEED` replays a run.
#![allow(clippy::unwrap_used)]

#[path = "../../actors/tests/fuzz_support/mod.rs"]
mod fuzz_support;
#[path = "fuzz_support/messages.rs"]
mod messages;

use fuzz_support::Mutator;
use rand::Rng;
use rtx_actors::ActorError;
use rtx_supervisor::protocol::{JoinReply, StatusReport, ToSupervisor, ToWorker};

/// Decodes `bytes` as `T` like `Inbound::decode`; `Ok(true)` when it decoded (and re-encoding is
/// stable), `Ok(false)` for a typed refusal.
fn decode_as<T>(bytes: &[u8]) -> Result<bool, String>
where
    T: rkyv::Archive + for<'a> rkyv::Serialize<rkyv::api::high::HighSerializer<rkyv::util::AlignedVec, rkyv::ser::allocator::ArenaHandle<'a>, rkyv::rancor::Error>>,
    T::Archived: for<'a> rkyv::bytecheck::CheckBytes<rkyv::api::high::HighValidator<'a, rkyv::rancor::Error>> + rkyv::Deserialize<T, rkyv::api::high::HighDeserializer<rkyv::rancor::Error>>,
{
    match rtx_actors::decode::<T>(bytes) {
        Ok(value) => {
            let again = rtx_actors::encode(&value).map_err(|e| format!("{}: re-encoding failed: {e}", std::any::type_name::<T>()))?;
            let back = rtx_actors::decode::<T>(&again).map_err(|e| format!("{}: re-encoded bytes do not decode: {e}", std::any::type_name::<T>()))?;
            if rtx_actors::encode(&back).map_err(|e| e.to_string())? != again {
                return Err(format!("{}: decode/encode is not stable", std::any::type_name::<T>()));
            }
            Ok(true)
        }
        Err(ActorError::Codec(_)) => Ok(false),
        Err(other) => Err(format!("{}: untyped error {other:?}", std::any::type_name::<T>())),
    }
}

/// Decodes `bytes` as each of the four types; whether any accepted it.
fn decode_all(bytes: &[u8]) -> Result<bool, String> {
    let a = decode_as::<ToSupervisor>(bytes)?;
    let b = decode_as::<ToWorker>(bytes)?;
    let c = decode_as::<JoinReply>(bytes)?;
    let d = decode_as::<StatusReport>(bytes)?;
    Ok(a || b || c || d)
}

// Goal: at least 1M mutated and random inputs (`RTX_FUZZ_INPUTS`), each decoded as all four
// message types, give `Ok` or a typed error, never a panic or a hang.
#[test]
fn hostile_bytes_decode_to_ok_or_a_typed_error() {
    let seed = fuzz_support::seed("fuzz_control");
    let n = fuzz_support::inputs(1_000_000);
    let summary = fuzz_support::run(
        "fuzz_control",
        seed,
        n,
        |rng| {
            let valid = messages::any_encoded(rng);
            if rng.random_ratio(1, 10) {
                return valid;
            }
            let other = messages::any_encoded(rng);
            Mutator::mutate(rng, &valid, &other)
        },
        decode_all,
    );
    eprintln!("fuzz_control: {} decodes ({} per type)", 4 * summary.inputs, summary.inputs);
    assert!(summary.accepted > summary.inputs / 10, "too few inputs decoded at all: {summary:?}");
}

// Goal: every variant's valid encoding round-trips exactly (same bytes after decode and
// re-encode), so the fuzz's "accepted" inputs are checked against a decoder that works.
#[test]
fn valid_messages_round_trip() {
    let seed = fuzz_support::seed("fuzz_control_valid");
    fuzz_support::run(
        "fuzz_control_valid",
        seed,
        fuzz_support::inputs(20_000).min(200_000),
        messages::any_encoded,
        |bytes| {
            if !decode_all(bytes)? {
                return Err("a valid encoding was refused".into());
            }
            Ok(true)
        },
    );
}

// Goal: the systematic neighbourhood of one valid encoding of every variant (every truncation,
// every byte changed to boundary values, every aligned word corrupted).
#[test]
fn every_truncation_and_byte_change_of_each_variant() {
    let seed = fuzz_support::seed("fuzz_control_neighbourhood");
    let mut corpus = Vec::new();
    let mut rng = fuzz_support::input_rng(seed, 0);
    for _ in 0..24 {
        corpus.extend(Mutator::neighbourhood(&messages::any_encoded(&mut rng)));
    }
    let total = corpus.len();
    let mut next = corpus.into_iter();
    fuzz_support::run("fuzz_control_neighbourhood", seed, total, |_| next.next().unwrap_or_default(), decode_all);
}
