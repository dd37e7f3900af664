//! IDX files (the MNIST family's format), gzipped or raw, with unsigned-byte data.
//!
//! Layout: a big-endian `u32` magic `0x0000_08NN` (two zero bytes, type `0x08` = `u8`, `NN`
//! dimensions), then `NN` big-endian `u32` dimension sizes, then exactly the product of the
//! dimensions in data bytes. Anything else (other type codes, trailing or missing bytes) is a
//! [`super::DataError::BadFormat`], never a panic.

use std::io::Read;
use std::path::Path;

use super::{bad_format, io_error, Result};

/// Magic of an IDX file of `u8` with three dimensions (images: n, rows, cols).
pub const IDX_MAGIC_U8_3D: u32 = 0x0000_0803;
/// Magic of an IDX file of `u8` with one dimension (labels: n).
pub const IDX_MAGIC_U8_1D: u32 = 0x0000_0801;

/// Bound on the decoded data size (4 GiB): larger headers are treated as corrupt.
const IDX_DATA_BYTES_MAX: usize = 1 << 32;
const GZIP_MAGIC: [u8; 2] = [0x1f, 0x8b];
const IDX_TYPE_U8: u8 = 0x08;

/// A decoded IDX file: its dimensions and its row-major `u8` data.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IdxArray {
    /// Dimension sizes, outermost first.
    pub dims: Vec<usize>,
    /// Row-major data; `data.len()` is the product of `dims`.
    pub data: Vec<u8>,
}

impl IdxArray {
    /// Decodes IDX `bytes` (gzipped when they start with `1f 8b`, raw otherwise). `path` only
    /// names the source in errors.
    pub fn from_bytes(bytes: &[u8], path: &Path) -> Result<Self> {
        if bytes.starts_with(&GZIP_MAGIC) {
            let mut raw = Vec::with_capacity(bytes.len().saturating_mul(2));
            flate2::read::MultiGzDecoder::new(bytes)
                .read_to_end(&mut raw)
                .map_err(|err| bad_format(path, format!("corrupt gzip stream: {err}")))?;
            parse_raw(&raw, path)
        } else {
            parse_raw(bytes, path)
        }
    }

    /// The magic number this array would be written with.
    pub fn magic(&self) -> u32 {
        (u32::from(IDX_TYPE_U8) << 8) | self.dims.len() as u32
    }
}

/// Reads an IDX file of `u8` data, gzipped or raw (detected from its first two bytes).
/// A file that does not exist gives [`super::DataError::Missing`] with the generic fetch command.
pub fn read_idx(path: &Path) -> Result<IdxArray> {
    let _span = tracing::debug_span!("read_idx", path = %path.display()).entered();
    let bytes = std::fs::read(path)
        .map_err(|err| io_error(path, err, || format!("bash {}", super::FETCH_SCRIPT)))?;
    IdxArray::from_bytes(&bytes, path)
}

/// Reads an IDX file and checks that its magic is `expected_magic`.
pub(crate) fn read_idx_expect(
    path: &Path,
    expected_magic: u32,
    fetch: impl FnOnce() -> String,
) -> Result<IdxArray> {
    let bytes = std::fs::read(path).map_err(|err| io_error(path, err, fetch))?;
    let array = IdxArray::from_bytes(&bytes, path)?;
    if array.magic() != expected_magic {
        return Err(bad_format(
            path,
            format!(
                "magic 0x{:08x}, expected 0x{expected_magic:08x}",
                array.magic()
            ),
        ));
    }
    Ok(array)
}

fn parse_raw(bytes: &[u8], path: &Path) -> Result<IdxArray> {
    let header = bytes.get(..4).ok_or_else(|| {
        bad_format(
            path,
            format!("{} bytes, shorter than the 4-byte IDX magic", bytes.len()),
        )
    })?;
    let magic = u32::from_be_bytes([header[0], header[1], header[2], header[3]]);
    if header[0] != 0 || header[1] != 0 || header[2] != IDX_TYPE_U8 || header[3] == 0 {
        return Err(bad_format(
            path,
            format!("magic 0x{magic:08x} is not an IDX file of u8 (expected 0x000008NN, NN >= 1)"),
        ));
    }
    let n_dims = usize::from(header[3]);
    let data_offset = 4 + 4 * n_dims;
    let dims_bytes = bytes.get(4..data_offset).ok_or_else(|| {
        bad_format(
            path,
            format!(
                "header truncated: {n_dims} dimensions need {data_offset} bytes, file has {}",
                bytes.len()
            ),
        )
    })?;
    let dims: Vec<usize> = dims_bytes
        .chunks_exact(4)
        .map(|c| u32::from_be_bytes([c[0], c[1], c[2], c[3]]) as usize)
        .collect();
    let expected_len = dims
        .iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .filter(|&len| len <= IDX_DATA_BYTES_MAX)
        .ok_or_else(|| {
            bad_format(
                path,
                format!("dimensions {dims:?} exceed {IDX_DATA_BYTES_MAX} bytes"),
            )
        })?;
    let data = &bytes[data_offset..];
    if data.len() != expected_len {
        return Err(bad_format(
            path,
            format!(
                "dimensions {dims:?} need {expected_len} data bytes, file has {}",
                data.len()
            ),
        ));
    }
    let array = IdxArray {
        dims,
        data: data.to_vec(),
    };
    debug_assert_eq!(array.magic(), magic);
    Ok(array)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::DataError;
    use flate2::write::GzEncoder;
    use std::io::Write;

    fn idx_bytes(magic: u32, dims: &[u32], data: &[u8]) -> Vec<u8> {
        let mut bytes = magic.to_be_bytes().to_vec();
        for d in dims {
            bytes.extend_from_slice(&d.to_be_bytes());
        }
        bytes.extend_from_slice(data);
        bytes
    }

    fn gzip(bytes: &[u8]) -> Vec<u8> {
        let mut encoder = GzEncoder::new(Vec::new(), flate2::Compression::default());
        encoder.write_all(bytes).expect("write to Vec");
        encoder.finish().expect("finish gzip into Vec")
    }

    fn parse(bytes: &[u8]) -> Result<IdxArray> {
        IdxArray::from_bytes(bytes, Path::new("test.idx"))
    }

    fn assert_bad_format(result: Result<IdxArray>, needle: &str) {
        match result {
            Err(DataError::BadFormat { reason, .. }) => {
                assert!(
                    reason.contains(needle),
                    "reason {reason:?} lacks {needle:?}"
                )
            }
            other => panic!("expected BadFormat containing {needle:?}, got {other:?}"),
        }
    }

    #[test]
    fn parses_images_and_labels() {
        let data: Vec<u8> = (0..12).collect();
        let images = parse(&idx_bytes(IDX_MAGIC_U8_3D, &[3, 2, 2], &data)).expect("valid images");
        assert_eq!(images.dims, vec![3, 2, 2]);
        assert_eq!(images.data, data);
        assert_eq!(images.magic(), IDX_MAGIC_U8_3D);

        let labels = parse(&idx_bytes(IDX_MAGIC_U8_1D, &[3], &[7, 8, 9])).expect("valid labels");
        assert_eq!(labels.dims, vec![3]);
        assert_eq!(labels.data, vec![7, 8, 9]);
        assert_eq!(labels.magic(), IDX_MAGIC_U8_1D);
    }

    #[test]
    fn gz_and_raw_decode_equal() {
        let raw = idx_bytes(IDX_MAGIC_U8_3D, &[2, 3, 4], &(0..24).collect::<Vec<u8>>());
        let compressed = gzip(&raw);
        assert_eq!(&compressed[..2], &GZIP_MAGIC);
        assert_eq!(parse(&raw).expect("raw"), parse(&compressed).expect("gz"));
    }

    #[test]
    fn bad_magic_is_typed_error() {
        // Type code 0x0D (float) is not supported.
        assert_bad_format(
            parse(&idx_bytes(0x0000_0D01, &[1], &[0, 0, 0, 0])),
            "magic 0x00000d01",
        );
        // Non-zero leading bytes: not IDX at all.
        assert_bad_format(parse(b"PK\x03\x04rest"), "not an IDX file");
        // Zero dimensions.
        assert_bad_format(parse(&idx_bytes(0x0000_0800, &[], &[])), "not an IDX file");
    }

    #[test]
    fn truncated_files_are_typed_errors() {
        assert_bad_format(parse(&[0, 0, 8]), "shorter than the 4-byte IDX magic");
        assert_bad_format(parse(&[]), "shorter than the 4-byte IDX magic");
        let full = idx_bytes(IDX_MAGIC_U8_3D, &[2, 2, 2], &[1; 8]);
        assert_bad_format(parse(&full[..10]), "header truncated");
        assert_bad_format(
            parse(&full[..full.len() - 1]),
            "need 8 data bytes, file has 7",
        );
        let mut long = full.clone();
        long.push(0);
        assert_bad_format(parse(&long), "need 8 data bytes, file has 9");
        // A truncated gzip stream is reported as such.
        let compressed = gzip(&full);
        assert_bad_format(
            parse(&compressed[..compressed.len() / 2]),
            "corrupt gzip stream",
        );
    }

    #[test]
    fn huge_dimensions_do_not_allocate_or_overflow() {
        let bytes = idx_bytes(IDX_MAGIC_U8_3D, &[u32::MAX, u32::MAX, u32::MAX], &[]);
        assert_bad_format(parse(&bytes), "exceed");
    }

    #[test]
    fn read_idx_checks_magic_and_missing_file() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("labels-idx1-ubyte.gz");
        std::fs::write(&path, gzip(&idx_bytes(IDX_MAGIC_U8_1D, &[2], &[1, 2]))).expect("write");
        assert_eq!(read_idx(&path).expect("read").data, vec![1, 2]);
        assert_bad_format(
            read_idx_expect(&path, IDX_MAGIC_U8_3D, String::new),
            "expected 0x00000803",
        );

        match read_idx(&dir.path().join("absent")) {
            Err(DataError::Missing { fetch_command, .. }) => {
                assert_eq!(fetch_command, "bash scripts/fetch-data.sh")
            }
            other => panic!("expected Missing, got {other:?}"),
        }
    }
}
