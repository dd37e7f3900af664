//! Seeded random number generation. Every random tensor and every dropout mask draws from a
//! [`Generator`] the caller hands in, so runs replay from their seed; the generator's position
//! can be saved in a checkpoint and restored exactly.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, StandardNormal};

/// A seeded, checkpointable random stream (ChaCha8).
#[derive(Clone, Debug)]
pub struct Generator {
    seed: u64,
    rng: ChaCha8Rng,
}

/// Where a [`Generator`] stands: enough to resume it bit-exactly.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct GeneratorState {
    /// The seed it was created from.
    pub seed: u64,
    /// The stream id.
    pub stream: u64,
    /// Position in the stream, in 32-bit words.
    pub word_pos: u128,
}

impl Generator {
    /// A generator for `seed`.
    pub fn new(seed: u64) -> Self {
        Generator { seed, rng: ChaCha8Rng::seed_from_u64(seed) }
    }

    /// An independent generator for sub-stream `stream` of `seed` (e.g. one per rank).
    pub fn with_stream(seed: u64, stream: u64) -> Self {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        rng.set_stream(stream);
        Generator { seed, rng }
    }

    /// The seed this generator started from.
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// The current position, for checkpoints.
    pub fn state(&self) -> GeneratorState {
        GeneratorState { seed: self.seed, stream: self.rng.get_stream(), word_pos: self.rng.get_word_pos() }
    }

    /// Rebuilds a generator at a saved position.
    pub fn from_state(state: GeneratorState) -> Self {
        let mut rng = ChaCha8Rng::seed_from_u64(state.seed);
        rng.set_stream(state.stream);
        rng.set_word_pos(state.word_pos);
        Generator { seed: state.seed, rng }
    }

    /// A standard normal sample.
    pub fn normal(&mut self) -> f64 {
        StandardNormal.sample(&mut self.rng)
    }

    /// A uniform sample in [0, 1).
    pub fn uniform(&mut self) -> f64 {
        self.rng.random::<f64>()
    }

    /// A uniform integer in `0..n` (n > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.rng.random_range(0..n.max(1))
    }

    /// A fresh 64-bit value (to seed child generators).
    pub fn next_u64(&mut self) -> u64 {
        self.rng.random::<u64>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn state_round_trip_resumes_exactly() {
        let mut g = Generator::new(7);
        for _ in 0..13 {
            g.normal();
        }
        let saved = g.state();
        let a: Vec<f64> = (0..5).map(|_| g.normal()).collect();
        let mut h = Generator::from_state(saved);
        let b: Vec<f64> = (0..5).map(|_| h.normal()).collect();
        assert_eq!(a, b);
    }
}
