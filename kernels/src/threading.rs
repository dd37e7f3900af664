//! The CPU thread pool every kernel shares: rayon's global pool, sized once per process.
//!
//! The size comes from `RTX_NUM_THREADS`, else `RAYON_NUM_THREADS`, else the number of cores, so the
//! 2 cores of a CI machine and the dozens of a training node are both used. Kernels split work into
//! chunks only above [`PARALLEL_MIN_ELEMS`]; below it the hand-off costs more than it saves.

use std::sync::OnceLock;

/// Below this many elements an elementwise kernel runs on the calling thread.
pub const PARALLEL_MIN_ELEMS: usize = 1 << 15;

static THREADS: OnceLock<usize> = OnceLock::new();

/// The number of threads kernels use (at least 1).
pub fn num_threads() -> usize {
    *THREADS.get_or_init(|| {
        let from_env = |name: &str| std::env::var(name).ok().and_then(|v| v.parse::<usize>().ok()).filter(|&n| n > 0);
        let n = from_env("RTX_NUM_THREADS")
            .or_else(|| from_env("RAYON_NUM_THREADS"))
            .unwrap_or_else(|| std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1));
        // Building the global pool fails only if someone built it first; then we use theirs.
        let _ = rayon::ThreadPoolBuilder::new().num_threads(n).build_global();
        rayon::current_num_threads().max(1)
    })
}

/// Chunk length that splits `len` elements into about one chunk per thread, never below
/// [`PARALLEL_MIN_ELEMS`] / 4 elements.
pub fn chunk_len(len: usize) -> usize {
    let threads = num_threads();
    len.div_ceil(threads).max(PARALLEL_MIN_ELEMS / 4).max(1)
}

/// Whether a kernel over `len` elements should fan out to the pool.
pub fn should_parallelize(len: usize) -> bool {
    len >= PARALLEL_MIN_ELEMS && num_threads() > 1
}
