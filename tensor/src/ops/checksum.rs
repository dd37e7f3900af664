//! A digest of a tensor's values as stored: [`Tensor::bits_checksum`], what the elastic runtime
//! compares to prove replicas identical. Defined on raw element bits (bf16 as 16-bit, f32 and u32
//! as 32-bit, f64 and i64 as 64-bit integers) in row-major order, in chunks of [`CHECKSUM_CHUNK`]
//! elements: chunk `c` is hashed with 64-bit FNV-1a from the basis xor `c`, and the chunk digests
//! and the element count are folded in order the same way. Chunks make it parallel: a GPU tensor
//! is hashed on its device (one thread per chunk, `rtx_kernels`' `bits_checksum_chunks`) and only
//! the chunk digests come back, so checking a 124M-parameter replica no longer copies it to the
//! host; [`bits_checksums`] hashes a whole model's tensors with one wait for the device. The host
//! interleaves eight chunks to keep its multiplier busy. Both give the same digest for the same
//! bits in the same dtype. Short chunks keep the device's dependent multiply chains short (4,096
//! elements per chunk took 29 ms for GPT-2 124M on an H200, latency-bound).

use crate::error::Result;
use crate::storage::CpuData;
use crate::tensor::Tensor;

/// Elements per independently hashed chunk.
pub const CHECKSUM_CHUNK: usize = 256;

/// The 64-bit FNV-1a offset basis.
pub(crate) const FNV_BASIS: u64 = 0xcbf2_9ce4_8422_2325;
/// The 64-bit FNV-1a prime.
pub(crate) const FNV_PRIME: u64 = 0x100_0000_01b3;

impl Tensor {
    /// A 64-bit digest of the tensor's elements as stored (see the module doc): equal values in
    /// the same dtype give the same digest on every device; reading a device tensor's digest
    /// waits for its queued work.
    pub fn bits_checksum(&self) -> Result<u64> {
        if let Some(device) = crate::backend::of(&[self]) {
            return device.bits_checksum(self);
        }
        Ok(host_bits_checksum(&self.to_data()?))
    }
}

/// [`Tensor::bits_checksum`] of each tensor, in order. Dense tensors on one GPU are hashed there
/// with their digests gathered in one buffer, so the host waits for the device once for all of
/// them (a model's parameters: one wait instead of one per tensor).
pub fn bits_checksums(tensors: &[Tensor]) -> Result<Vec<u64>> {
    if let Some(device) = tensors.first().and_then(|t| crate::backend::of(&[t])) {
        if let Some(digests) = device.bits_checksums(tensors)? {
            return Ok(digests);
        }
    }
    tensors.iter().map(Tensor::bits_checksum).collect()
}

/// [`Tensor::bits_checksum`] of elements already on the host, in row-major order.
pub(crate) fn host_bits_checksum(data: &CpuData) -> u64 {
    let digests = match data {
        CpuData::F32(v) => chunk_digests(v, |x| u64::from(x.to_bits())),
        CpuData::F64(v) => chunk_digests(v, f64::to_bits),
        CpuData::BF16(v) => chunk_digests(v, |x| u64::from(x.to_bits())),
        CpuData::U32(v) => chunk_digests(v, u64::from),
        CpuData::I64(v) => chunk_digests(v, |x| x as u64),
    };
    fold_digests(&digests, data.len())
}

/// FNV-1a of one chunk's element bits, from the basis xor the chunk's index.
fn chunk_digest<T: Copy>(index: usize, chunk: &[T], bits: impl Fn(T) -> u64) -> u64 {
    chunk.iter().fold(FNV_BASIS ^ index as u64, |h, &x| (h ^ bits(x)).wrapping_mul(FNV_PRIME))
}

/// The digest of every chunk of `values`, in order.
pub(crate) fn chunk_digests<T: Copy>(values: &[T], bits: impl Fn(T) -> u64 + Copy) -> Vec<u64> {
    const LANES: usize = 8;
    let full = values.len() / CHECKSUM_CHUNK;
    let mut out = Vec::with_capacity(values.len().div_ceil(CHECKSUM_CHUNK));
    // Eight full chunks at a time, element by element: eight independent multiply chains.
    let mut c = 0;
    while c + LANES <= full {
        let mut h: [u64; LANES] = std::array::from_fn(|l| FNV_BASIS ^ (c + l) as u64);
        let base = c * CHECKSUM_CHUNK;
        for j in 0..CHECKSUM_CHUNK {
            for (l, lane) in h.iter_mut().enumerate() {
                *lane = (*lane ^ bits(values[base + l * CHECKSUM_CHUNK + j])).wrapping_mul(FNV_PRIME);
            }
        }
        out.extend_from_slice(&h);
        c += LANES;
    }
    for (i, chunk) in values[c * CHECKSUM_CHUNK..].chunks(CHECKSUM_CHUNK).enumerate() {
        out.push(chunk_digest(c + i, chunk, bits));
    }
    out
}

/// Folds the chunk digests of a tensor of `numel` elements into its digest.
pub(crate) fn fold_digests(digests: &[u64], numel: usize) -> u64 {
    let d = digests.iter().fold(FNV_BASIS, |d, &h| (d ^ h).wrapping_mul(FNV_PRIME));
    (d ^ numel as u64).wrapping_mul(FNV_PRIME)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interleaved_chunks_match_the_sequential_definition() {
        // Goal: the eight-lane host loop computes exactly the definition (each chunk hashed on
        // its own, in order). Method: lengths around the lane and chunk boundaries, against a
        // plain per-chunk fold.
        for n in [0, 1, CHECKSUM_CHUNK - 1, CHECKSUM_CHUNK, 8 * CHECKSUM_CHUNK, 8 * CHECKSUM_CHUNK + 5, 17 * CHECKSUM_CHUNK + 3] {
            let values: Vec<u32> = (0..n as u32).map(|i| i.wrapping_mul(2_654_435_761)).collect();
            let reference: Vec<u64> = values.chunks(CHECKSUM_CHUNK).enumerate().map(|(c, chunk)| chunk_digest(c, chunk, u64::from)).collect();
            assert_eq!(chunk_digests(&values, u64::from), reference, "n = {n}");
        }
    }

    #[test]
    fn the_digest_sees_every_bit_the_position_and_the_dtype() -> Result<()> {
        // Goal: a digest that proves replicas identical must change with any single flipped bit,
        // with swapped elements, with the shape's element count and with the dtype. Method: a
        // tensor of 3 chunks and variations of it.
        let values: Vec<f32> = (0..3 * CHECKSUM_CHUNK + 7).map(|i| (i as f32 * 0.37).sin()).collect();
        let base = Tensor::from_vec(values.clone(), &[values.len()])?.bits_checksum()?;
        assert_eq!(base, Tensor::from_vec(values.clone(), &[values.len()])?.bits_checksum()?, "deterministic");
        let mut flipped = values.clone();
        flipped[2 * CHECKSUM_CHUNK + 1] = f32::from_bits(flipped[2 * CHECKSUM_CHUNK + 1].to_bits() ^ 1);
        assert_ne!(base, Tensor::from_vec(flipped, &[values.len()])?.bits_checksum()?, "one flipped bit");
        let mut swapped = values.clone();
        swapped.swap(0, CHECKSUM_CHUNK);
        assert_ne!(base, Tensor::from_vec(swapped, &[values.len()])?.bits_checksum()?, "swapped across chunks");
        assert_ne!(base, Tensor::from_vec(values[..values.len() - 1].to_vec(), &[values.len() - 1])?.bits_checksum()?, "one element fewer");
        let t = Tensor::from_vec(values.clone(), &[values.len()])?;
        assert_ne!(base, t.to_dtype(crate::DType::BF16)?.bits_checksum()?, "another dtype");
        // A strided view hashes its elements in row-major order, like a contiguous copy.
        let m = Tensor::from_vec(values[..64].to_vec(), &[8, 8])?;
        assert_eq!(m.transpose(0, 1)?.bits_checksum()?, m.transpose(0, 1)?.contiguous()?.bits_checksum()?);
        Ok(())
    }
}
