//! The population: which training images each client holds, and the dormant per-client state, as
//! compact arrays (struct of arrays; no per-client heap object). Three partition rules, all
//! deterministic by seed: the issue's reference rule (client `c` gets images
//! `splitmix64(seed + s*c + j) mod n_train`, computed on the fly, so a million clients cost no
//! index storage), a Dirichlet(alpha) label split and a shard split (both stored as one CSR table:
//! `offsets` of N + 1 words and one `u32` index per assigned image).
//!
//! `splitmix64(x)` is the standard SplitMix64 output for state `x`: `z = x + 0x9E3779B97F4A7C15`,
//! then the two xor-shift-multiply rounds and a final xor-shift. With the golden-ratio increment
//! added first this reproduces the issue's Flower accuracies exactly (checked with numpy: without
//! it, round 1 gives 0.3137 instead of 0.3432).

use std::path::Path;

use rand::seq::SliceRandom;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, Gamma};
use rtx_tensor::data::{load_digits_csv, load_fashion_mnist, train_val_split, DataRoot, ImageDataset, Split};

use crate::config::{DatasetKind, PartitionKind, PopulationConfig};
use crate::error::{FedError, Result};

/// The standard SplitMix64 output for state `x` (the increment is added first).
pub fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A uniform `f64` in `[0, 1)` from a hash of the given words (53 high bits of a splitmix chain).
pub fn unit_hash(words: &[u64]) -> f64 {
    let mut h = 0u64;
    for &w in words {
        h = splitmix64(h ^ w);
    }
    (h >> 11) as f64 / (1u64 << 53) as f64
}

/// The train and test images a federation uses.
#[derive(Clone, Debug)]
pub struct FedData {
    /// The images clients train on.
    pub train: ImageDataset,
    /// The images the global model is evaluated on after each round.
    pub test: ImageDataset,
}

impl FedData {
    /// Loads `kind` from the data folder (Fashion-MNIST train/test; digits with a seeded 20 %
    /// hold-out as the test set).
    pub fn load(root: &Path, kind: DatasetKind, seed: u64) -> Result<Self> {
        let root = DataRoot::new(root);
        match kind {
            DatasetKind::FashionMnist => {
                let dir = root.fashion_mnist();
                Ok(FedData { train: load_fashion_mnist(&dir, Split::Train)?, test: load_fashion_mnist(&dir, Split::Test)? })
            }
            DatasetKind::Digits => {
                let all = load_digits_csv(&root.digits_csv())?;
                let (train, test) = train_val_split(all.n, 0.2, seed)?;
                Ok(FedData { train: all.subset(&train), test: all.subset(&test) })
            }
        }
    }

    /// Input features per image.
    pub fn n_features(&self) -> usize {
        self.train.pixels_per_image()
    }

    /// Classes (the larger of the two splits' label ranges).
    pub fn n_classes(&self) -> usize {
        self.train.n_classes.max(self.test.n_classes)
    }
}

/// Which images each client holds.
#[derive(Clone, Debug)]
enum Assignment {
    /// Computed on the fly from the reference rule.
    Reference { seed: u64, per_client: u32, n_train: u64 },
    /// A CSR table: client `c` holds `indices[offsets[c]..offsets[c + 1]]`.
    Table { offsets: Vec<u32>, indices: Vec<u32> },
}

/// N clients: their data assignment and their dormant state.
#[derive(Clone, Debug)]
pub struct Population {
    n_clients: u32,
    assignment: Assignment,
    /// The last round each client took part in (`u32::MAX`: never), one word per client.
    last_round: Vec<u32>,
}

impl Population {
    /// Builds the population of `config` over a training set with these labels.
    pub fn new(config: &PopulationConfig, seed: u64, train_labels: &[u32]) -> Result<Self> {
        let n_clients = u32::try_from(config.n_clients).map_err(|_| FedError::config("population.n_clients", "exceeds 2^32 - 1"))?;
        let n_train = train_labels.len();
        if n_train == 0 || n_train > u32::MAX as usize {
            return Err(FedError::Partition { what: "training set".into(), reason: format!("{n_train} images") });
        }
        let assignment = match config.partition {
            PartitionKind::Reference => Assignment::Reference { seed, per_client: config.samples_per_client, n_train: n_train as u64 },
            PartitionKind::Dirichlet => dirichlet(n_clients, config.alpha, seed, train_labels)?,
            PartitionKind::Shards => shards(n_clients, config.shards_per_client, seed, train_labels)?,
        };
        Ok(Population { n_clients, assignment, last_round: vec![u32::MAX; n_clients as usize] })
    }

    /// N.
    pub fn n_clients(&self) -> u32 {
        self.n_clients
    }

    /// How many images client `c` holds.
    pub fn n_samples(&self, c: u32) -> usize {
        debug_assert!(c < self.n_clients);
        match &self.assignment {
            Assignment::Reference { per_client, .. } => *per_client as usize,
            Assignment::Table { offsets, .. } => (offsets[c as usize + 1] - offsets[c as usize]) as usize,
        }
    }

    /// The most images any client holds (the largest aggregation weight of a sample-count trainer).
    pub fn max_samples(&self) -> usize {
        match &self.assignment {
            Assignment::Reference { per_client, .. } => *per_client as usize,
            Assignment::Table { offsets, .. } => offsets.windows(2).map(|w| (w[1] - w[0]) as usize).max().unwrap_or(0),
        }
    }

    /// Writes client `c`'s image indices into `out` (cleared first; no allocation once `out` has
    /// grown to the largest client).
    pub fn indices_into(&self, c: u32, out: &mut Vec<u32>) {
        assert!(c < self.n_clients, "client {c} out of range for {} clients", self.n_clients);
        out.clear();
        match &self.assignment {
            Assignment::Reference { seed, per_client, n_train } => {
                let base = seed.wrapping_add(u64::from(*per_client).wrapping_mul(u64::from(c)));
                out.extend((0..u64::from(*per_client)).map(|j| (splitmix64(base.wrapping_add(j)) % n_train) as u32));
            }
            Assignment::Table { offsets, indices } => {
                out.extend_from_slice(&indices[offsets[c as usize] as usize..offsets[c as usize + 1] as usize]);
            }
        }
    }

    /// Marks that client `c` took part in `round`.
    pub fn mark_participation(&mut self, c: u32, round: u32) {
        self.last_round[c as usize] = round;
    }

    /// The last round client `c` took part in, if any.
    pub fn last_round(&self, c: u32) -> Option<u32> {
        let r = self.last_round[c as usize];
        (r != u32::MAX).then_some(r)
    }

    /// Bytes the dormant state and assignment occupy (the arrays, not the dataset).
    pub fn state_bytes(&self) -> usize {
        let table = match &self.assignment {
            Assignment::Reference { .. } => 0,
            Assignment::Table { offsets, indices } => 4 * (offsets.capacity() + indices.capacity()),
        };
        table + 4 * self.last_round.capacity()
    }
}

/// Dirichlet(alpha) label split (Hsu et al. 2019): for each class, proportions over the N clients
/// are drawn from Dir(alpha) and the class's (shuffled) images are cut accordingly; every image
/// goes to exactly one client, and clients may hold none.
fn dirichlet(n_clients: u32, alpha: f64, seed: u64, labels: &[u32]) -> Result<Assignment> {
    let gamma = Gamma::new(alpha, 1.0).map_err(|e| FedError::config("population.alpha", e.to_string()))?;
    let mut rng = ChaCha8Rng::seed_from_u64(splitmix64(seed ^ 0xD1D1_D1D1));
    let n_classes = labels.iter().max().map_or(0, |&m| m as usize + 1);
    let mut by_class: Vec<Vec<u32>> = vec![Vec::new(); n_classes];
    for (i, &label) in labels.iter().enumerate() {
        by_class[label as usize].push(i as u32);
    }
    let n = n_clients as usize;
    let mut owner = vec![0u32; labels.len()];
    let mut weights = vec![0f64; n];
    for members in &mut by_class {
        members.shuffle(&mut rng);
        let mut total = 0.0;
        for w in &mut weights {
            *w = gamma.sample(&mut rng);
            total += *w;
        }
        if !(total > 0.0 && total.is_finite()) {
            // Every draw underflowed (tiny alpha): the whole class goes to one client.
            let lucky = (splitmix64(seed ^ members.len() as u64) % u64::from(n_clients)) as usize;
            weights.iter_mut().for_each(|w| *w = 0.0);
            weights[lucky] = 1.0;
            total = 1.0;
        }
        let n_members = members.len() as f64;
        let mut cumulative = 0.0;
        let mut start = 0usize;
        for (client, &w) in weights.iter().enumerate() {
            cumulative += w;
            let end = if client + 1 == n { members.len() } else { ((cumulative / total) * n_members).round() as usize };
            let end = end.clamp(start, members.len());
            for &img in &members[start..end] {
                owner[img as usize] = client as u32;
            }
            start = end;
        }
    }
    Ok(table_from_owners(n, &owner))
}

/// Shard split (McMahan et al. 2017): images sorted by label are cut into `n * s` equal shards,
/// the shards are shuffled by seed, and client `c` gets shards `c*s .. (c+1)*s`.
fn shards(n_clients: u32, per_client: u32, seed: u64, labels: &[u32]) -> Result<Assignment> {
    let n_shards = u64::from(n_clients) * u64::from(per_client);
    if n_shards > labels.len() as u64 {
        return Err(FedError::Partition {
            what: "shards".into(),
            reason: format!(
                "{n_clients} clients x {per_client} shards = {n_shards} shards need at least as many images, the training set has {}",
                labels.len()
            ),
        });
    }
    let mut sorted: Vec<u32> = (0..labels.len() as u32).collect();
    sorted.sort_by_key(|&i| (labels[i as usize], i));
    let mut order: Vec<u64> = (0..n_shards).collect();
    order.shuffle(&mut ChaCha8Rng::seed_from_u64(splitmix64(seed ^ 0x5AA5_5AA5)));
    let n_img = labels.len() as u64;
    let mut offsets = Vec::with_capacity(n_clients as usize + 1);
    let mut indices = Vec::with_capacity(labels.len());
    offsets.push(0u32);
    for client_shards in order.chunks(per_client as usize) {
        for &shard in client_shards {
            let (a, b) = (shard * n_img / n_shards, (shard + 1) * n_img / n_shards);
            indices.extend_from_slice(&sorted[a as usize..b as usize]);
        }
        offsets.push(indices.len() as u32);
    }
    Ok(Assignment::Table { offsets, indices })
}

/// Counting sort of image -> owner into the CSR table (images in increasing index per client).
fn table_from_owners(n_clients: usize, owner: &[u32]) -> Assignment {
    let mut offsets = vec![0u32; n_clients + 1];
    for &o in owner {
        offsets[o as usize + 1] += 1;
    }
    for c in 0..n_clients {
        offsets[c + 1] += offsets[c];
    }
    let mut cursor = offsets.clone();
    let mut indices = vec![0u32; owner.len()];
    for (img, &o) in owner.iter().enumerate() {
        indices[cursor[o as usize] as usize] = img as u32;
        cursor[o as usize] += 1;
    }
    Assignment::Table { offsets, indices }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(n: u64, partition: PartitionKind) -> PopulationConfig {
        PopulationConfig { n_clients: n, dataset: DatasetKind::FashionMnist, partition, samples_per_client: 8, alpha: 0.5, shards_per_client: 2 }
    }

    /// 600 images, 60 of each of 10 labels, interleaved.
    fn labels() -> Vec<u32> {
        (0..600).map(|i| i % 10).collect()
    }

    #[test]
    fn splitmix64_matches_the_reference_values() {
        // SplitMix64 seeded with 0 yields these first outputs (Vigna's reference implementation).
        assert_eq!(splitmix64(0), 0xE220_A839_7B1D_CDAF);
        assert_eq!(splitmix64(0x9E37_79B9_7F4A_7C15), 0x6E78_9E6A_A1B9_65F4);
    }

    #[test]
    fn the_reference_rule_gives_client_c_the_issue_formula() {
        let pop = Population::new(&config(1000, PartitionKind::Reference), 42, &vec![0; 60000]).unwrap();
        let mut idx = Vec::new();
        pop.indices_into(3, &mut idx);
        let expected: Vec<u32> = (0..8).map(|j| (splitmix64(42 + 8 * 3 + j) % 60000) as u32).collect();
        assert_eq!(idx, expected);
        assert_eq!(pop.n_samples(999), 8);
        assert_eq!(pop.state_bytes(), 4 * 1000, "the reference rule stores no indices");
    }

    #[test]
    fn dirichlet_assigns_every_image_once_and_is_seeded() {
        let labels = labels();
        let a = Population::new(&config(20, PartitionKind::Dirichlet), 7, &labels).unwrap();
        let b = Population::new(&config(20, PartitionKind::Dirichlet), 7, &labels).unwrap();
        let c = Population::new(&config(20, PartitionKind::Dirichlet), 8, &labels).unwrap();
        let (mut all, mut idx, mut other) = (Vec::new(), Vec::new(), Vec::new());
        let mut differs = false;
        for client in 0..20 {
            a.indices_into(client, &mut idx);
            b.indices_into(client, &mut other);
            assert_eq!(idx, other, "same seed, same split");
            c.indices_into(client, &mut other);
            differs |= idx != other;
            all.extend_from_slice(&idx);
        }
        assert!(differs, "another seed gives another split");
        all.sort_unstable();
        assert_eq!(all, (0..600).collect::<Vec<u32>>());
    }

    #[test]
    fn small_alpha_skews_labels_more_than_large_alpha() {
        let labels = labels();
        let mean_distinct = |alpha: f64| {
            let mut cfg = config(20, PartitionKind::Dirichlet);
            cfg.alpha = alpha;
            let pop = Population::new(&cfg, 1, &labels).unwrap();
            let mut idx = Vec::new();
            let mut total = 0usize;
            for c in 0..20 {
                pop.indices_into(c, &mut idx);
                let mut seen = [false; 10];
                idx.iter().for_each(|&i| seen[labels[i as usize] as usize] = true);
                total += seen.iter().filter(|&&s| s).count();
            }
            total as f64 / 20.0
        };
        let (skewed, even) = (mean_distinct(0.05), mean_distinct(100.0));
        assert!(skewed + 3.0 < even, "alpha 0.05: {skewed} labels per client, alpha 100: {even}");
    }

    #[test]
    fn shards_give_each_client_few_labels_and_refuse_too_many_shards() {
        let labels = labels();
        let pop = Population::new(&config(30, PartitionKind::Shards), 3, &labels).unwrap();
        let mut idx = Vec::new();
        for c in 0..30 {
            pop.indices_into(c, &mut idx);
            assert_eq!(idx.len(), 20);
            let mut seen = [false; 10];
            idx.iter().for_each(|&i| seen[labels[i as usize] as usize] = true);
            assert!(seen.iter().filter(|&&s| s).count() <= 2, "client {c}: two shards, at most two labels");
        }
        let mut cfg = config(400, PartitionKind::Shards);
        cfg.shards_per_client = 2;
        let err = Population::new(&cfg, 3, &labels).unwrap_err();
        assert!(matches!(err, FedError::Partition { .. }), "{err}");
    }
}
