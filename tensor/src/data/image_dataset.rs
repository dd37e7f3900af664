//! In-memory labelled image sets: Fashion-MNIST / MNIST from IDX pairs, digits from gzip CSV.
//!
//! Pixels stay as the bytes the files hold (`0..=pixel_max`); [`ImageDataset::batch`] turns a
//! batch of indices into normalized `f32` pixels, so the set costs one byte per pixel in memory.

use std::io::Read;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::idx::{read_idx_expect, IDX_MAGIC_U8_1D, IDX_MAGIC_U8_3D};
use super::{bad_argument, bad_format, fetch_command, io_error, DataError, Result, FETCH_SCRIPT};

/// Which half of a dataset with a fixed train/test split to load.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Split {
    /// The training files (`train-*`): 60 000 samples for (Fashion-)MNIST.
    Train,
    /// The test files (`t10k-*`): 10 000 samples for (Fashion-)MNIST.
    Test,
}

/// Labelled greyscale images, row-major, one byte per pixel.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ImageDataset {
    /// `n * height * width` pixel values in `0..=pixel_max`, image after image.
    pub images: Vec<u8>,
    /// `n` class labels in `0..n_classes`.
    pub labels: Vec<u32>,
    /// Number of images.
    pub n: usize,
    /// Rows per image.
    pub height: usize,
    /// Columns per image.
    pub width: usize,
    /// One more than the largest label.
    pub n_classes: usize,
    /// The value of a full-intensity pixel: 255 for IDX files, 16 for the digits CSV.
    pub pixel_max: u8,
}

/// A batch of images as normalized `f32` pixels plus labels, ready to become tensors.
#[derive(Clone, Debug, PartialEq)]
pub struct ImageBatch {
    /// `[batch_size, height, width]` row-major: `(x / pixel_max - mean) / std`.
    pub pixels: Vec<f32>,
    /// `[batch_size]` class labels.
    pub labels: Vec<u32>,
    /// Number of images in the batch.
    pub batch_size: usize,
    /// Rows per image.
    pub height: usize,
    /// Columns per image.
    pub width: usize,
}

/// Loads one split of Fashion-MNIST from `dir`, the folder `scripts/fetch-data.sh` fills
/// (`$DATA/fashion-mnist`, see [`super::DataRoot::fashion_mnist`]). Each file may be gzipped
/// (`*-ubyte.gz`, as fetched) or raw (`*-ubyte`).
pub fn load_fashion_mnist(dir: &Path, split: Split) -> Result<ImageDataset> {
    let _span = tracing::info_span!("load_fashion_mnist", ?split).entered();
    load_idx_dir(dir, split, "fashion-mnist")
}

/// Loads one split of MNIST from `dir` (`$DATA/mnist`, fetched with `--only mnist`); same file
/// names and formats as [`load_fashion_mnist`].
pub fn load_mnist(dir: &Path, split: Split) -> Result<ImageDataset> {
    let _span = tracing::info_span!("load_mnist", ?split).entered();
    load_idx_dir(dir, split, "mnist")
}

/// Loads an image IDX file (magic `0x803`) and its label IDX file (magic `0x801`), each gzipped
/// or raw, and checks that they hold the same number of samples.
pub fn load_idx_pair(images_path: &Path, labels_path: &Path) -> Result<ImageDataset> {
    let generic = || format!("bash {FETCH_SCRIPT}");
    load_idx_pair_with(images_path, labels_path, &generic)
}

/// Loads the scikit-learn digits CSV (gzipped or plain, no header; each line 64 pixel values
/// in `0..=16` then the label): 1797 images of 8×8 with `pixel_max` 16. Values may be written
/// as integers or as floats with an integral value (`3` or `3.0`).
pub fn load_digits_csv(path: &Path) -> Result<ImageDataset> {
    const SIDE: usize = 8;
    const PIXEL_MAX: u8 = 16;
    let _span = tracing::info_span!("load_digits_csv", path = %path.display()).entered();
    let bytes = std::fs::read(path).map_err(|err| {
        let dir = path.parent().unwrap_or(Path::new(""));
        io_error(path, err, || fetch_command("digits", dir, "digits"))
    })?;
    let text = if bytes.starts_with(&[0x1f, 0x8b]) {
        let mut text = String::new();
        flate2::read::MultiGzDecoder::new(bytes.as_slice())
            .read_to_string(&mut text)
            .map_err(|err| bad_format(path, format!("corrupt gzip stream or not UTF-8: {err}")))?;
        text
    } else {
        String::from_utf8(bytes).map_err(|err| bad_format(path, format!("not UTF-8: {err}")))?
    };

    let mut images = Vec::new();
    let mut labels = Vec::new();
    for (line_idx, line) in text.lines().enumerate() {
        let line_no = line_idx + 1;
        if line.trim().is_empty() {
            continue;
        }
        let fields: Vec<&str> = line.split(',').collect();
        if fields.len() != SIDE * SIDE + 1 {
            return Err(bad_format(
                path,
                format!(
                    "line {line_no}: {} fields, expected {}",
                    fields.len(),
                    SIDE * SIDE + 1
                ),
            ));
        }
        for field in &fields[..SIDE * SIDE] {
            let value = parse_small_int(field, u32::from(PIXEL_MAX)).ok_or_else(|| {
                bad_format(
                    path,
                    format!("line {line_no}: pixel {field:?} is not an integer in 0..=16"),
                )
            })?;
            images.push(value as u8);
        }
        let label_field = fields[SIDE * SIDE];
        let label = parse_small_int(label_field, u32::from(u8::MAX)).ok_or_else(|| {
            bad_format(
                path,
                format!("line {line_no}: label {label_field:?} is not an integer in 0..=255"),
            )
        })?;
        labels.push(label);
    }
    ImageDataset::new(images, labels, SIDE, SIDE, PIXEL_MAX).map_err(|err| match err {
        DataError::Empty { .. } => DataError::Empty {
            what: format!("digits CSV {}", path.display()),
        },
        other => other,
    })
}

impl ImageDataset {
    /// Builds a set from raw parts, checking that `images` holds `labels.len()` images of
    /// `height * width` pixels, each at most `pixel_max`. `n_classes` is the largest label + 1.
    pub fn new(
        images: Vec<u8>,
        labels: Vec<u32>,
        height: usize,
        width: usize,
        pixel_max: u8,
    ) -> Result<Self> {
        let n = labels.len();
        if n == 0 {
            return Err(DataError::Empty {
                what: "image dataset with no labels".into(),
            });
        }
        if height == 0 || width == 0 || pixel_max == 0 {
            return Err(bad_argument(format!(
                "image size {height}x{width} and pixel_max {pixel_max} must be non-zero"
            )));
        }
        let pixels = n.checked_mul(height * width);
        if pixels != Some(images.len()) {
            return Err(bad_argument(format!(
                "{n} labels of {height}x{width} images need {} pixels, got {}",
                n.saturating_mul(height * width),
                images.len()
            )));
        }
        if let Some(&over) = images.iter().find(|&&p| p > pixel_max) {
            return Err(bad_argument(format!(
                "pixel value {over} exceeds pixel_max {pixel_max}"
            )));
        }
        let n_classes = labels.iter().max().map_or(0, |&max| max as usize + 1);
        Ok(Self {
            images,
            labels,
            n,
            height,
            width,
            n_classes,
            pixel_max,
        })
    }

    /// Pixels per image, `height * width`.
    pub fn pixels_per_image(&self) -> usize {
        self.height * self.width
    }

    /// The pixels of image `idx`. Panics when `idx >= n`.
    pub fn image(&self, idx: usize) -> &[u8] {
        assert!(
            idx < self.n,
            "image index {idx} out of range for {} images",
            self.n
        );
        let size = self.pixels_per_image();
        &self.images[idx * size..(idx + 1) * size]
    }

    /// How many images each class has, indexed by label.
    pub fn class_counts(&self) -> Vec<usize> {
        let mut counts = vec![0; self.n_classes];
        for &label in &self.labels {
            counts[label as usize] += 1;
        }
        counts
    }

    /// Mean and standard deviation of all pixels on the `[0, 1]` scale (`x / pixel_max`): the
    /// `mean` and `std` to pass to [`ImageDataset::batch`], computed on the training split.
    pub fn pixel_mean_std(&self) -> (f32, f32) {
        let mut histogram = [0u64; 256];
        for &p in &self.images {
            histogram[usize::from(p)] += 1;
        }
        let total = self.images.len() as f64;
        let scale = f64::from(self.pixel_max);
        let mean = histogram
            .iter()
            .enumerate()
            .map(|(v, &c)| v as f64 / scale * c as f64)
            .sum::<f64>()
            / total;
        let var = histogram
            .iter()
            .enumerate()
            .map(|(v, &c)| (v as f64 / scale - mean).powi(2) * c as f64)
            .sum::<f64>()
            / total;
        (mean as f32, var.sqrt() as f32)
    }

    /// A new set holding the images at `indices`, in that order (e.g. one side of
    /// [`super::train_val_split`]). `n_classes` is kept from `self`. Panics on an index `>= n`.
    pub fn subset(&self, indices: &[usize]) -> ImageDataset {
        let size = self.pixels_per_image();
        let mut images = Vec::with_capacity(indices.len() * size);
        let mut labels = Vec::with_capacity(indices.len());
        for &idx in indices {
            images.extend_from_slice(self.image(idx));
            labels.push(self.labels[idx]);
        }
        ImageDataset {
            images,
            labels,
            n: indices.len(),
            n_classes: self.n_classes,
            ..*self
        }
    }

    /// Gathers the images at `indices` as `f32` pixels `(x / pixel_max - mean) / std` and their
    /// labels. Panics on an index `>= n` or a non-positive `std` (caller bugs).
    pub fn batch(&self, indices: &[usize], mean: f32, std: f32) -> ImageBatch {
        assert!(std > 0.0, "normalization std must be positive, got {std}");
        let size = self.pixels_per_image();
        let scale = 1.0 / (f32::from(self.pixel_max) * std);
        let shift = mean / std;
        // One lookup table per batch: every pixel is one of 256 byte values.
        let table: Vec<f32> = (0..=255u8).map(|v| f32::from(v) * scale - shift).collect();
        let mut pixels = Vec::with_capacity(indices.len() * size);
        let mut labels = Vec::with_capacity(indices.len());
        for &idx in indices {
            pixels.extend(self.image(idx).iter().map(|&p| table[usize::from(p)]));
            labels.push(self.labels[idx]);
        }
        debug_assert_eq!(pixels.len(), indices.len() * size);
        ImageBatch {
            pixels,
            labels,
            batch_size: indices.len(),
            height: self.height,
            width: self.width,
        }
    }
}

fn load_idx_dir(dir: &Path, split: Split, set_name: &str) -> Result<ImageDataset> {
    let prefix = match split {
        Split::Train => "train",
        Split::Test => "t10k",
    };
    let fetch = || fetch_command(set_name, dir, set_name);
    let images_path = existing_variant(dir, &format!("{prefix}-images-idx3-ubyte"));
    let labels_path = existing_variant(dir, &format!("{prefix}-labels-idx1-ubyte"));
    load_idx_pair_with(&images_path, &labels_path, &fetch)
}

/// `dir/name.gz` if it exists, else `dir/name` if it exists, else `dir/name.gz` (to report).
fn existing_variant(dir: &Path, name: &str) -> PathBuf {
    let gz = dir.join(format!("{name}.gz"));
    let raw = dir.join(name);
    if !gz.exists() && raw.exists() {
        raw
    } else {
        gz
    }
}

fn load_idx_pair_with(
    images_path: &Path,
    labels_path: &Path,
    fetch: &dyn Fn() -> String,
) -> Result<ImageDataset> {
    let images = read_idx_expect(images_path, IDX_MAGIC_U8_3D, fetch)?;
    let labels = read_idx_expect(labels_path, IDX_MAGIC_U8_1D, fetch)?;
    let (n, height, width) = (images.dims[0], images.dims[1], images.dims[2]);
    if labels.dims[0] != n {
        return Err(bad_format(
            labels_path,
            format!(
                "{} labels but {} has {n} images",
                labels.dims[0],
                images_path.display()
            ),
        ));
    }
    if n == 0 {
        return Err(DataError::Empty {
            what: format!("IDX images {}", images_path.display()),
        });
    }
    if height == 0 || width == 0 {
        return Err(bad_format(
            images_path,
            format!("image size {height}x{width} has no pixels"),
        ));
    }
    let labels: Vec<u32> = labels.data.iter().map(|&l| u32::from(l)).collect();
    let n_classes = labels.iter().max().map_or(0, |&max| max as usize + 1);
    let dataset = ImageDataset {
        images: images.data,
        labels,
        n,
        height,
        width,
        n_classes,
        pixel_max: u8::MAX,
    };
    debug_assert_eq!(dataset.images.len(), n * height * width);
    tracing::debug!(n, height, width, n_classes, "loaded idx pair");
    Ok(dataset)
}

/// Parses `"12"` or `"12.0"` as an integer `<= max`.
fn parse_small_int(field: &str, max: u32) -> Option<u32> {
    let field = field.trim();
    let value = match field.parse::<u32>() {
        Ok(value) => value,
        Err(_) => {
            let float = field.parse::<f64>().ok()?;
            if float.fract() != 0.0 || !(0.0..=f64::from(max)).contains(&float) {
                return None;
            }
            float as u32
        }
    };
    (value <= max).then_some(value)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::DataRoot;
    use flate2::write::GzEncoder;
    use std::io::Write;

    fn fixture_path() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/digits.csv.gz")
    }

    fn write_idx(path: &Path, magic: u32, dims: &[u32], data: &[u8], gz: bool) {
        let mut bytes = magic.to_be_bytes().to_vec();
        for d in dims {
            bytes.extend_from_slice(&d.to_be_bytes());
        }
        bytes.extend_from_slice(data);
        if gz {
            let mut encoder = GzEncoder::new(Vec::new(), flate2::Compression::fast());
            encoder.write_all(&bytes).expect("write to Vec");
            bytes = encoder.finish().expect("finish gzip");
        }
        std::fs::write(path, bytes).expect("write idx file");
    }

    #[test]
    fn digits_fixture_loads_1797_samples_of_ten_classes() {
        let digits = load_digits_csv(&fixture_path()).expect("fixture present in tests/fixtures");
        assert_eq!(digits.n, 1797);
        assert_eq!((digits.height, digits.width, digits.pixel_max), (8, 8, 16));
        assert_eq!(digits.images.len(), 1797 * 64);
        assert_eq!(digits.n_classes, 10);
        let counts = digits.class_counts();
        assert!(
            counts.iter().all(|&c| (170..=185).contains(&c)),
            "class counts {counts:?}"
        );
        assert_eq!(counts.iter().sum::<usize>(), 1797);
        assert_eq!(digits.labels[..4], [0, 1, 2, 3]);
        assert!(digits.images.iter().all(|&p| p <= 16));
        // First row of the first image, as in the file.
        assert_eq!(digits.image(0)[..8], [0, 0, 5, 13, 9, 1, 0, 0]);
    }

    #[test]
    fn digits_csv_accepts_float_values_and_rejects_bad_lines() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("d.csv");
        let mut line: Vec<String> = (0..64).map(|i| format!("{}.0", i % 17)).collect();
        line.push("3".into());
        std::fs::write(&path, line.join(",") + "\n").expect("write");
        let set = load_digits_csv(&path).expect("plain csv with floats");
        assert_eq!((set.n, set.labels[0], set.image(0)[16]), (1, 3, 16));

        std::fs::write(&path, "1,2,3\n").expect("write");
        assert!(matches!(
            load_digits_csv(&path),
            Err(DataError::BadFormat { .. })
        ));
        line[5] = "17".into();
        std::fs::write(&path, line.join(",")).expect("write");
        assert!(matches!(
            load_digits_csv(&path),
            Err(DataError::BadFormat { .. })
        ));
        std::fs::write(&path, "\n").expect("write");
        assert!(matches!(
            load_digits_csv(&path),
            Err(DataError::Empty { .. })
        ));
    }

    #[test]
    fn idx_pair_loads_gz_and_raw_and_checks_counts() {
        let dir = tempfile::tempdir().expect("tempdir");
        let pixels: Vec<u8> = (0..3 * 2 * 2).map(|i| i * 20).collect();
        write_idx(
            &dir.path().join("train-images-idx3-ubyte.gz"),
            IDX_MAGIC_U8_3D,
            &[3, 2, 2],
            &pixels,
            true,
        );
        write_idx(
            &dir.path().join("train-labels-idx1-ubyte"),
            IDX_MAGIC_U8_1D,
            &[3],
            &[4, 0, 9],
            false,
        );
        let set = load_fashion_mnist(dir.path(), Split::Train).expect("mixed gz/raw pair");
        assert_eq!((set.n, set.height, set.width, set.n_classes), (3, 2, 2, 10));
        assert_eq!(set.images, pixels);
        assert_eq!(set.labels, vec![4, 0, 9]);

        // Label count disagreeing with image count.
        write_idx(
            &dir.path().join("t10k-images-idx3-ubyte"),
            IDX_MAGIC_U8_3D,
            &[3, 2, 2],
            &pixels,
            false,
        );
        write_idx(
            &dir.path().join("t10k-labels-idx1-ubyte"),
            IDX_MAGIC_U8_1D,
            &[2],
            &[1, 2],
            false,
        );
        match load_fashion_mnist(dir.path(), Split::Test) {
            Err(DataError::BadFormat { reason, .. }) => {
                assert!(reason.contains("2 labels but"), "{reason}")
            }
            other => panic!("expected BadFormat, got {other:?}"),
        }
        // Images and labels swapped: wrong magic.
        let swapped = load_idx_pair(
            &dir.path().join("train-labels-idx1-ubyte"),
            &dir.path().join("train-images-idx3-ubyte.gz"),
        );
        assert!(
            matches!(swapped, Err(DataError::BadFormat { .. })),
            "{swapped:?}"
        );
    }

    #[test]
    fn missing_dataset_names_the_fetch_command() {
        let dir = tempfile::tempdir().expect("tempdir");
        let root = DataRoot::new(dir.path());
        let err =
            load_fashion_mnist(&root.fashion_mnist(), Split::Train).expect_err("nothing fetched");
        match &err {
            DataError::Missing {
                path,
                fetch_command,
            } => {
                assert_eq!(
                    path,
                    &root.fashion_mnist().join("train-images-idx3-ubyte.gz")
                );
                assert_eq!(
                    fetch_command,
                    &format!(
                        "bash scripts/fetch-data.sh {} --only fashion-mnist",
                        dir.path().display()
                    )
                );
            }
            other => panic!("expected Missing, got {other:?}"),
        }
        assert!(
            err.to_string().contains("bash scripts/fetch-data.sh"),
            "{err}"
        );
        let err = load_digits_csv(&root.digits_csv()).expect_err("nothing fetched");
        assert!(err.to_string().contains("--only digits"), "{err}");
    }

    #[test]
    fn batch_normalizes_and_subset_keeps_order() {
        let set = ImageDataset::new(vec![0, 255, 51, 102, 204, 255], vec![1, 0, 2], 1, 2, 255)
            .expect("valid");
        let batch = set.batch(&[2, 0], 0.5, 0.25);
        assert_eq!((batch.batch_size, batch.height, batch.width), (2, 1, 2));
        assert_eq!(batch.labels, vec![2, 1]);
        let expected = [
            (0.8 - 0.5) / 0.25,
            (1.0 - 0.5) / 0.25,
            (0.0 - 0.5) / 0.25,
            (1.0 - 0.5) / 0.25,
        ];
        for (got, want) in batch.pixels.iter().zip(expected) {
            assert!((got - want).abs() < 1e-5, "{got} vs {want}");
        }
        let sub = set.subset(&[2, 1]);
        assert_eq!((sub.n, sub.n_classes), (2, 3));
        assert_eq!(sub.images, vec![204, 255, 51, 102]);
        assert_eq!(sub.labels, vec![2, 0]);
        let (mean, std) = ImageDataset::new(vec![0, 255], vec![0, 0], 1, 1, 255)
            .expect("valid")
            .pixel_mean_std();
        assert!((mean - 0.5).abs() < 1e-6 && (std - 0.5).abs() < 1e-6);
    }

    /// Runs on the real Fashion-MNIST when `scripts/fetch-data.sh` has filled `./data` (or
    /// `$RTX_DATA_DIR`); otherwise checks that the error names the fetch command.
    #[test]
    fn fashion_mnist_loads_when_fetched() {
        let flag = Path::new(env!("CARGO_MANIFEST_DIR")).join("../data");
        let env = std::env::var_os(crate::data::DATA_DIR_ENV);
        let root = match env.as_deref() {
            Some(value) if !value.is_empty() => DataRoot::resolve(None, Some(value)),
            _ => DataRoot::new(flag),
        };
        match load_fashion_mnist(&root.fashion_mnist(), Split::Test) {
            Ok(test) => {
                assert_eq!(
                    (test.n, test.height, test.width, test.n_classes),
                    (10_000, 28, 28, 10)
                );
                assert!(test.class_counts().iter().all(|&c| c == 1000));
                let train = load_fashion_mnist(&root.fashion_mnist(), Split::Train)
                    .expect("train next to test");
                assert_eq!(train.n, 60_000);
                assert!(train.class_counts().iter().all(|&c| c == 6000));
                let (mean, std) = train.pixel_mean_std();
                assert!(
                    (mean - 0.2860).abs() < 1e-3 && (std - 0.3530).abs() < 1e-3,
                    "{mean} {std}"
                );
            }
            Err(DataError::Missing { fetch_command, .. }) => {
                assert!(
                    fetch_command.starts_with("bash scripts/fetch-data.sh"),
                    "{fetch_command}"
                );
            }
            Err(other) => panic!("fetched Fashion-MNIST failed to load: {other}"),
        }
    }
}
