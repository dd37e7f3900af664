//! A deterministic, structure-aware fuzz harness for the wire decoders (shared by
//! `actors/tests/fuzz_*.rs` and `supervisor/tests/fuzz_*.rs` through `#[path]`).
//!
//! cargo-fuzz (libFuzzer) needs a nightly toolchain and sanitizer runtimes that this project's
//! stable toolchain and CI do not have, so the decoders are fuzzed by this harness instead, inside
//! `cargo test`: every input is generated from a seeded ChaCha stream of its own (`seed`, input
//! index), so any input can be replayed from the two numbers printed on failure; each check runs
//! under `catch_unwind` (a panic is reported with the input in hex and the run goes on to collect
//! up to [`MAX_REPORTED`] failures); a watchdog thread aborts the process with the stuck input in
//! hex when one input takes longer than [`stall_limit`] (a hang); and the run asserts a bound on
//! the slowest single input.
//!
//! Inputs are mostly mutations of valid encodings ([`Mutator`]): bit flips, byte replacements with
//! boundary values, truncation, extension, corruption of aligned 32-bit words (where rkyv keeps
//! its relative pointers and lengths, and where envelopes keep their length prefix), insertion and
//! deletion of ranges, splicing two encodings, stacked mutations, and fully random bytes.
//!
//! Knobs (environment): `RTX_FUZZ_INPUTS` (inputs per target; each test picks a default that
//! keeps `cargo test` cheap), `RTX_FUZZ_SEED` (replay a run), `RTX_FUZZ_STALL_MS` (hang limit).
#![allow(dead_code)]

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use rand::{Rng, RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Failures printed in full before the run stops collecting.
pub(crate) const MAX_REPORTED: usize = 5;

/// The run's seed: `RTX_FUZZ_SEED`, or a fresh one (printed either way).
pub(crate) fn seed(target: &str) -> u64 {
    let seed = std::env::var("RTX_FUZZ_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(|| {
        let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0);
        t ^ (u64::from(std::process::id()) << 32)
    });
    eprintln!("{target}: RTX_FUZZ_SEED={seed}");
    seed
}

/// Inputs to run: `RTX_FUZZ_INPUTS`, or `default`.
pub(crate) fn inputs(default: usize) -> usize {
    std::env::var("RTX_FUZZ_INPUTS").ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// How long one input may take before the watchdog calls it a hang.
pub(crate) fn stall_limit() -> Duration {
    Duration::from_millis(std::env::var("RTX_FUZZ_STALL_MS").ok().and_then(|v| v.parse().ok()).unwrap_or(10_000))
}

/// The RNG of input `index` of a run with `seed`: independent of every other input, so one input
/// replays alone.
pub(crate) fn input_rng(seed: u64, index: u64) -> ChaCha8Rng {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    rng.set_stream(index);
    rng
}

/// Lowercase hex of `bytes`.
pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

thread_local! {
    /// Set while a fuzz check runs on this thread: panics are recorded, not printed.
    static QUIET: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    /// The message of the last panic on this thread while quiet (a panic inside a task that
    /// tokio caught counts too: a current-thread runtime polls it on this thread).
    static PANICKED: std::cell::RefCell<Option<String>> = const { std::cell::RefCell::new(None) };
}

/// Installs (once per process) a panic hook that records panics on quiet threads and passes the
/// others to the previous hook, so the other tests of the binary still print theirs.
fn install_hook() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if QUIET.with(|q| q.get()) {
                let at = info.location().map(|l| format!(" at {}:{}", l.file(), l.line())).unwrap_or_default();
                let msg = info.payload().downcast_ref::<String>().cloned().or_else(|| info.payload().downcast_ref::<&str>().map(|s| s.to_string())).unwrap_or_default();
                PANICKED.with(|p| *p.borrow_mut() = Some(format!("{msg}{at}")));
            } else {
                previous(info);
            }
        }));
    });
}

/// What a run saw.
#[derive(Debug, Default)]
pub(crate) struct Summary {
    /// Inputs run.
    pub(crate) inputs: u64,
    /// Inputs whose check returned `Ok(true)` (the decoder accepted the input).
    pub(crate) accepted: u64,
    /// Wall time of the whole run.
    pub(crate) elapsed: Duration,
    /// The slowest single input.
    pub(crate) slowest: Duration,
}

/// Watches a run: aborts the process when the current input stalls.
struct Watchdog {
    done: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Watchdog {
    fn start(target: String, seed: u64, progress: Arc<AtomicU64>, current: Arc<Mutex<Vec<u8>>>) -> Watchdog {
        let done = Arc::new(AtomicBool::new(false));
        let limit = stall_limit();
        let stop = Arc::clone(&done);
        let thread = std::thread::spawn(move || {
            let mut last = (progress.load(Ordering::Acquire), Instant::now());
            while !stop.load(Ordering::Acquire) {
                std::thread::sleep(Duration::from_millis(50));
                let now = progress.load(Ordering::Acquire);
                if now != last.0 {
                    last = (now, Instant::now());
                } else if last.1.elapsed() > limit {
                    let input = current.lock().unwrap_or_else(PoisonError::into_inner).clone();
                    eprintln!("{target}: HANG: input {} (RTX_FUZZ_SEED={seed}) made no progress for {limit:?}; input ({} bytes): {}", now, input.len(), hex(&input));
                    std::process::abort();
                }
            }
        });
        Watchdog { done, thread: Some(thread) }
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.done.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Runs `n` inputs: input `i` is `generate(rng_i)`, checked with `check`, which returns whether
/// the decoder accepted it or a description of a wrong answer. A panic in `check` and a wrong
/// answer are failures: reported with the seed, index and input in hex; the run then panics.
/// A hang aborts the process (see [`Watchdog`]).
pub(crate) fn run(target: &str, seed: u64, n: usize, mut generate: impl FnMut(&mut ChaCha8Rng) -> Vec<u8>, mut check: impl FnMut(&[u8]) -> Result<bool, String>) -> Summary {
    let progress = Arc::new(AtomicU64::new(0));
    let current = Arc::new(Mutex::new(Vec::new()));
    let _watchdog = Watchdog::start(target.to_string(), seed, Arc::clone(&progress), Arc::clone(&current));
    install_hook();
    QUIET.with(|q| q.set(true));
    let start = Instant::now();
    let mut summary = Summary::default();
    let mut failures = Vec::new();
    for i in 0..n as u64 {
        let mut rng = input_rng(seed, i);
        let input = generate(&mut rng);
        current.lock().unwrap_or_else(PoisonError::into_inner).clone_from(&input);
        let t0 = Instant::now();
        let outcome = catch_unwind(AssertUnwindSafe(|| check(&input)));
        summary.slowest = summary.slowest.max(t0.elapsed());
        let panicked = PANICKED.with(|p| p.borrow_mut().take());
        let failure = match (outcome, panicked) {
            (_, Some(panic)) => Some(format!("PANIC: {panic}")),
            (Ok(Ok(accepted)), None) => {
                summary.accepted += u64::from(accepted);
                None
            }
            (Ok(Err(wrong)), None) => Some(format!("wrong answer: {wrong}")),
            (Err(_), None) => Some("PANIC (no message)".to_string()),
        };
        if let Some(failure) = failure {
            if failures.len() < MAX_REPORTED {
                eprintln!("{target}: input {i} (RTX_FUZZ_SEED={seed}): {failure}; input ({} bytes): {}", input.len(), hex(&input));
            }
            failures.push(i);
        }
        summary.inputs += 1;
        progress.store(i + 1, Ordering::Release);
    }
    QUIET.with(|q| q.set(false));
    summary.elapsed = start.elapsed();
    eprintln!(
        "{target}: {} inputs in {:.2?} ({:.2} µs/input, slowest {:.2?}), {} accepted, {} failed (seed {seed})",
        summary.inputs,
        summary.elapsed,
        summary.elapsed.as_secs_f64() * 1e6 / summary.inputs.max(1) as f64,
        summary.slowest,
        summary.accepted,
        failures.len()
    );
    assert!(failures.is_empty(), "{target}: {} of {} inputs failed (first: {:?}); replay with RTX_FUZZ_SEED={seed}", failures.len(), summary.inputs, &failures[..failures.len().min(10)]);
    // A decode is microseconds; a slow input is a near-hang (a quadratic path, a huge allocation).
    assert!(summary.slowest < stall_limit() / 10, "{target}: the slowest input took {:?}", summary.slowest);
    summary
}

/// Boundary values for replaced bytes.
const BYTES: [u8; 9] = [0x00, 0x01, 0x02, 0x7f, 0x80, 0xfe, 0xff, 0x10, 0x40];

/// Boundary values for corrupted 32-bit words (lengths, relative pointers, length prefixes).
fn word_value(rng: &mut ChaCha8Rng, old: u32, len: usize) -> u32 {
    let len = len as u32;
    match rng.random_range(0..12) {
        0 => 0,
        1 => 1,
        2 => u32::MAX,
        3 => i32::MAX as u32,
        4 => i32::MIN as u32,
        5 => len,
        6 => len.wrapping_neg(),
        7 => old.wrapping_add(rng.random_range(1..=16)),
        8 => old.wrapping_sub(rng.random_range(1..=16)),
        9 => old ^ (1 << rng.random_range(0..32)),
        10 => 16 << 20,
        _ => rng.random(),
    }
}

/// Mutates valid encodings into hostile ones.
pub(crate) struct Mutator;

impl Mutator {
    /// One input derived from `valid` (and sometimes `other`, another valid encoding): a stack
    /// of one to three mutations, or fully random bytes.
    pub(crate) fn mutate(rng: &mut ChaCha8Rng, valid: &[u8], other: &[u8]) -> Vec<u8> {
        if rng.random_ratio(1, 16) {
            return Self::random_bytes(rng, 600);
        }
        let mut bytes = valid.to_vec();
        let rounds = [1, 1, 1, 2, 2, 3][rng.random_range(0..6)];
        for _ in 0..rounds {
            Self::mutate_once(rng, &mut bytes, other);
        }
        bytes
    }

    /// Random bytes of a random length below `max`.
    pub(crate) fn random_bytes(rng: &mut ChaCha8Rng, max: usize) -> Vec<u8> {
        let len = if rng.random_bool(0.5) { rng.random_range(0..32) } else { rng.random_range(0..max) };
        let mut bytes = vec![0u8; len];
        rng.fill_bytes(&mut bytes);
        bytes
    }

    /// One mutation in place.
    pub(crate) fn mutate_once(rng: &mut ChaCha8Rng, bytes: &mut Vec<u8>, other: &[u8]) {
        let len = bytes.len();
        match rng.random_range(0..10) {
            // Bit flips.
            0 | 1 if len > 0 => {
                for _ in 0..rng.random_range(1..=4) {
                    let i = rng.random_range(0..len);
                    bytes[i] ^= 1 << rng.random_range(0..8);
                }
            }
            // Byte replacements with boundary or random values.
            2 if len > 0 => {
                for _ in 0..rng.random_range(1..=3) {
                    let i = rng.random_range(0..len);
                    bytes[i] = if rng.random_bool(0.5) { BYTES[rng.random_range(0..BYTES.len())] } else { rng.random() };
                }
            }
            // Truncation at any length.
            3 => bytes.truncate(rng.random_range(0..=len)),
            // Extension: random bytes, zeros, or a copy of its own tail.
            4 => {
                let extra = rng.random_range(1..=64);
                match rng.random_range(0..3) {
                    0 => bytes.extend((0..extra).map(|_| rng.random::<u8>())),
                    1 => bytes.extend(std::iter::repeat_n(0, extra)),
                    _ => {
                        let tail = bytes[len.saturating_sub(extra)..].to_vec();
                        bytes.extend(tail);
                    }
                }
            }
            // A length field or relative pointer: an aligned (or, rarely, unaligned) 32-bit word.
            5 | 6 if len >= 4 => {
                let i = if rng.random_ratio(7, 8) { rng.random_range(0..len / 4) * 4 } else { rng.random_range(0..=len - 4) };
                let old = u32::from_le_bytes([bytes[i], bytes[i + 1], bytes[i + 2], bytes[i + 3]]);
                bytes[i..i + 4].copy_from_slice(&word_value(rng, old, len).to_le_bytes());
            }
            // Insert or delete a range.
            7 if len > 0 => {
                let at = rng.random_range(0..len);
                if rng.random_bool(0.5) {
                    let n = rng.random_range(1..=(len - at).min(16));
                    bytes.drain(at..at + n);
                } else {
                    let n = rng.random_range(1..=16);
                    let fill: Vec<u8> = (0..n).map(|_| rng.random()).collect();
                    bytes.splice(at..at, fill);
                }
            }
            // Splice: a prefix of this one and a suffix of the other (or the reverse).
            8 => {
                let a = rng.random_range(0..=len);
                let b = rng.random_range(0..=other.len());
                if rng.random_bool(0.5) {
                    bytes.truncate(a);
                    bytes.extend_from_slice(&other[b..]);
                } else {
                    let mut spliced = other[..b].to_vec();
                    spliced.extend_from_slice(&bytes[a..]);
                    *bytes = spliced;
                }
            }
            // Overwrite a range with a range of the other encoding.
            _ if len > 0 && !other.is_empty() => {
                let at = rng.random_range(0..len);
                let from = rng.random_range(0..other.len());
                let n = rng.random_range(1..=(len - at).min(other.len() - from).max(1));
                let n = n.min(len - at).min(other.len() - from);
                bytes[at..at + n].copy_from_slice(&other[from..from + n]);
            }
            _ => bytes.push(rng.random()),
        }
    }

    /// The systematic neighbourhood of `valid`: every truncation, every single byte XORed with
    /// 0xff and set to each boundary value, and every aligned word set to boundary values.
    pub(crate) fn neighbourhood(valid: &[u8]) -> Vec<Vec<u8>> {
        let mut out = Vec::new();
        for cut in 0..valid.len() {
            out.push(valid[..cut].to_vec());
        }
        for i in 0..valid.len() {
            let mut b = valid.to_vec();
            b[i] ^= 0xff;
            out.push(b);
            for v in [0x00, 0x80, 0xff] {
                if valid[i] != v {
                    let mut b = valid.to_vec();
                    b[i] = v;
                    out.push(b);
                }
            }
        }
        for i in (0..valid.len().saturating_sub(3)).step_by(4) {
            for v in [0u32, 1, u32::MAX, i32::MIN as u32, valid.len() as u32, (valid.len() as u32).wrapping_neg()] {
                let mut b = valid.to_vec();
                b[i..i + 4].copy_from_slice(&v.to_le_bytes());
                out.push(b);
            }
        }
        out
    }
}

/// Random field values for generating valid messages.
pub(crate) struct Values;

impl Values {
    /// A string: empty, ASCII, multi-byte UTF-8, or long (crosses rkyv's inline limit).
    pub(crate) fn string(rng: &mut ChaCha8Rng) -> String {
        match rng.random_range(0..6) {
            0 => String::new(),
            1 => (0..rng.random_range(1..8)).map(|_| rng.random_range(b'a'..=b'z') as char).collect(),
            2 => (0..rng.random_range(1..12)).map(|_| ['é', '字', '🦀', 'ß', 'x', '\0'][rng.random_range(0..6)]).collect(),
            3 => (0..rng.random_range(8..200)).map(|_| rng.random_range(b' '..=b'~') as char).collect(),
            4 => format!("worker-{}", rng.random::<u16>()),
            _ => format!("10.0.{}.{}:{}", rng.random::<u8>(), rng.random::<u8>(), rng.random::<u16>()),
        }
    }

    /// A u64: small, boundary, or random.
    pub(crate) fn u64(rng: &mut ChaCha8Rng) -> u64 {
        match rng.random_range(0..4) {
            0 => rng.random_range(0..16),
            1 => [0, 1, u64::MAX, u64::MAX / 2, 1 << 32][rng.random_range(0..5)],
            _ => rng.random(),
        }
    }

    /// A u32 likewise.
    pub(crate) fn u32(rng: &mut ChaCha8Rng) -> u32 {
        match rng.random_range(0..4) {
            0 => rng.random_range(0..16),
            1 => [0, 1, u32::MAX][rng.random_range(0..3)],
            _ => rng.random(),
        }
    }

    /// An f64 of any bit pattern (NaNs and infinities included).
    pub(crate) fn f64(rng: &mut ChaCha8Rng) -> f64 {
        match rng.random_range(0..4) {
            0 => f64::from_bits(rng.random()),
            1 => [0.0, -0.0, f64::NAN, f64::INFINITY, f64::MIN_POSITIVE][rng.random_range(0..5)],
            _ => rng.random_range(-1e6..1e6),
        }
    }

    /// Bytes of a random length up to `max`.
    pub(crate) fn bytes(rng: &mut ChaCha8Rng, max: usize) -> Vec<u8> {
        let mut b = vec![0u8; rng.random_range(0..=max)];
        rng.fill_bytes(&mut b);
        b
    }

    /// Some or none.
    pub(crate) fn option<T>(rng: &mut ChaCha8Rng, f: impl FnOnce(&mut ChaCha8Rng) -> T) -> Option<T> {
        if rng.random_bool(0.5) {
            Some(f(rng))
        } else {
            None
        }
    }

    /// A vector of up to `max` values.
    pub(crate) fn vec<T>(rng: &mut ChaCha8Rng, max: usize, mut f: impl FnMut(&mut ChaCha8Rng) -> T) -> Vec<T> {
        let n = rng.random_range(0..=max);
        (0..n).map(|_| f(rng)).collect()
    }
}
