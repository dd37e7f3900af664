//! Which safetensors dtypes a file may hold and how each lives in a [`Tensor`] once loaded.
//!
//! Decision (constraints: PyTorch writes any of its dtypes into a `state_dict`; a tensor here has
//! five storage dtypes, F32, F64, BF16, U32 and I64, and every new storage dtype costs an arm in
//! every op, transport and optimizer match): a file dtype the storage holds loads as itself, and
//! every other one loads into the narrowest storage that holds all its values exactly, with the
//! file dtype recorded beside the tensor ([`FileDType`], returned by
//! [`super::decode_tensors_with_dtypes`]):
//!
//! | file | storage | exact because |
//! |---|---|---|
//! | F32, F64, BF16, U32, I64 | the same | no conversion |
//! | F16 | F32 | every f16 is an f32 |
//! | I32, I16, I8, U16, U8 | I64 | every value is an i64 |
//! | BOOL | I64 (0 or 1) | a byte other than 0 or 1 is refused |
//! | U64 | I64 | a value above `i64::MAX` is refused, naming the tensor |
//!
//! The 4-, 6- and 8-bit float formats are refused with an error naming the tensor and the dtype.
//! Pros: no precision is lost anywhere, integer tensors become I64 class targets and indices
//! that every op takes, and only one storage dtype was added. Cons: I8/U8/BOOL tensors take 8
//! bytes per element in memory. Saving writes the storage dtype (F16-loaded tensors as F32,
//! I32-loaded ones as I64) unless the caller asks for the recorded file dtype back with
//! [`super::save_tensors_as`], which narrows with a check: a value that does not fit (an I64
//! of 2^40 saved as I32, an F32 that is not exactly an F16) is an error naming the tensor.

use crate::storage::CpuData;
use half::{bf16, f16};
use rtx_kernels::DType;
use safetensors::Dtype;
use std::fmt;

/// A dtype as a safetensors file stores it (the ones this crate reads).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum FileDType {
    /// Booleans, one byte each (0 or 1).
    Bool,
    /// Unsigned bytes.
    U8,
    /// Signed bytes.
    I8,
    /// Signed 16-bit integers.
    I16,
    /// Unsigned 16-bit integers.
    U16,
    /// IEEE half precision.
    F16,
    /// bfloat16.
    BF16,
    /// Signed 32-bit integers.
    I32,
    /// Unsigned 32-bit integers.
    U32,
    /// IEEE single precision.
    F32,
    /// IEEE double precision.
    F64,
    /// Signed 64-bit integers.
    I64,
    /// Unsigned 64-bit integers.
    U64,
}

impl FileDType {
    /// Every dtype, in the order of the table in the module doc.
    pub const ALL: [FileDType; 13] = [
        FileDType::Bool,
        FileDType::U8,
        FileDType::I8,
        FileDType::I16,
        FileDType::U16,
        FileDType::F16,
        FileDType::BF16,
        FileDType::I32,
        FileDType::U32,
        FileDType::F32,
        FileDType::F64,
        FileDType::I64,
        FileDType::U64,
    ];

    /// The storage dtype a tensor of this file dtype loads into.
    pub const fn storage(self) -> DType {
        match self {
            FileDType::F32 | FileDType::F16 => DType::F32,
            FileDType::F64 => DType::F64,
            FileDType::BF16 => DType::BF16,
            FileDType::U32 => DType::U32,
            FileDType::Bool | FileDType::U8 | FileDType::I8 | FileDType::I16 | FileDType::U16 | FileDType::I32 | FileDType::I64 | FileDType::U64 => DType::I64,
        }
    }

    /// The file dtype a storage dtype saves as by default (itself).
    pub const fn of_storage(dtype: DType) -> FileDType {
        match dtype {
            DType::F32 => FileDType::F32,
            DType::F64 => FileDType::F64,
            DType::BF16 => FileDType::BF16,
            DType::U32 => FileDType::U32,
            DType::I64 => FileDType::I64,
        }
    }

    /// Bytes per element in the file.
    pub const fn size_in_bytes(self) -> usize {
        match self {
            FileDType::Bool | FileDType::U8 | FileDType::I8 => 1,
            FileDType::I16 | FileDType::U16 | FileDType::F16 | FileDType::BF16 => 2,
            FileDType::I32 | FileDType::U32 | FileDType::F32 => 4,
            FileDType::F64 | FileDType::I64 | FileDType::U64 => 8,
        }
    }

    /// The safetensors name (`BOOL`, `U8`, ... `U64`).
    pub const fn as_str(self) -> &'static str {
        match self {
            FileDType::Bool => "BOOL",
            FileDType::U8 => "U8",
            FileDType::I8 => "I8",
            FileDType::I16 => "I16",
            FileDType::U16 => "U16",
            FileDType::F16 => "F16",
            FileDType::BF16 => "BF16",
            FileDType::I32 => "I32",
            FileDType::U32 => "U32",
            FileDType::F32 => "F32",
            FileDType::F64 => "F64",
            FileDType::I64 => "I64",
            FileDType::U64 => "U64",
        }
    }

    pub(crate) fn from_st(dtype: Dtype) -> Option<FileDType> {
        Some(match dtype {
            Dtype::BOOL => FileDType::Bool,
            Dtype::U8 => FileDType::U8,
            Dtype::I8 => FileDType::I8,
            Dtype::I16 => FileDType::I16,
            Dtype::U16 => FileDType::U16,
            Dtype::F16 => FileDType::F16,
            Dtype::BF16 => FileDType::BF16,
            Dtype::I32 => FileDType::I32,
            Dtype::U32 => FileDType::U32,
            Dtype::F32 => FileDType::F32,
            Dtype::F64 => FileDType::F64,
            Dtype::I64 => FileDType::I64,
            Dtype::U64 => FileDType::U64,
            _ => return None,
        })
    }

    pub(crate) fn to_st(self) -> Dtype {
        match self {
            FileDType::Bool => Dtype::BOOL,
            FileDType::U8 => Dtype::U8,
            FileDType::I8 => Dtype::I8,
            FileDType::I16 => Dtype::I16,
            FileDType::U16 => Dtype::U16,
            FileDType::F16 => Dtype::F16,
            FileDType::BF16 => Dtype::BF16,
            FileDType::I32 => Dtype::I32,
            FileDType::U32 => Dtype::U32,
            FileDType::F32 => Dtype::F32,
            FileDType::F64 => Dtype::F64,
            FileDType::I64 => Dtype::I64,
            FileDType::U64 => Dtype::U64,
        }
    }
}

impl fmt::Display for FileDType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Decodes the little-endian bytes of a tensor stored as `dtype` into its storage dtype
/// ([`FileDType::storage`]). The caller checked `raw.len()` against the shape. An error says
/// which element is refused and why (the caller adds the tensor's name).
pub(crate) fn decode(dtype: FileDType, raw: &[u8]) -> Result<CpuData, String> {
    let ints = |v: Vec<i64>| Ok(CpuData::I64(v.into()));
    match dtype {
        FileDType::F32 => Ok(CpuData::F32(pod_vec(raw).into())),
        FileDType::F64 => Ok(CpuData::F64(pod_vec(raw).into())),
        FileDType::BF16 => Ok(CpuData::BF16(pod_vec::<bf16>(raw).into())),
        FileDType::U32 => Ok(CpuData::U32(pod_vec(raw).into())),
        FileDType::I64 => ints(pod_vec(raw)),
        FileDType::F16 => Ok(CpuData::F32(pod_vec::<f16>(raw).into_iter().map(f32::from).collect())),
        FileDType::I32 => ints(pod_vec::<i32>(raw).into_iter().map(i64::from).collect()),
        FileDType::I16 => ints(pod_vec::<i16>(raw).into_iter().map(i64::from).collect()),
        FileDType::U16 => ints(pod_vec::<u16>(raw).into_iter().map(i64::from).collect()),
        FileDType::I8 => ints(raw.iter().map(|&b| i64::from(b as i8)).collect()),
        FileDType::U8 => ints(raw.iter().map(|&b| i64::from(b)).collect()),
        FileDType::Bool => match raw.iter().position(|&b| b > 1) {
            Some(i) => Err(format!("BOOL element {i} is byte {}, not 0 or 1", raw[i])),
            None => ints(raw.iter().map(|&b| i64::from(b)).collect()),
        },
        FileDType::U64 => pod_vec::<u64>(raw).into_iter().enumerate().map(|(i, v)| i64::try_from(v).map_err(|_| format!("U64 element {i} is {v}, above the I64 range it loads into"))).collect::<Result<Vec<i64>, String>>().map(CpuData::from),
    }
}

/// Encodes storage elements as `dtype`'s little-endian bytes, refusing (with the element and
/// value) anything that `dtype` cannot hold exactly: integers out of range, non-integral or
/// float-only values, floats that do not round-trip (an f32 that is not an f16).
pub(crate) fn encode(data: &CpuData, dtype: FileDType) -> Result<Vec<u8>, String> {
    if FileDType::of_storage(data.dtype()) == dtype {
        return Ok(data.as_bytes().to_vec());
    }
    match (data, dtype) {
        (CpuData::F32(v), FileDType::F16) => {
            let mut out = Vec::with_capacity(v.len() * 2);
            for (i, &x) in v.iter().enumerate() {
                let h = f16::from_f32(x);
                if f32::from(h) != x && !(x.is_nan() && h.is_nan()) {
                    return Err(format!("element {i} is {x}, which F16 cannot hold exactly"));
                }
                out.extend_from_slice(&h.to_le_bytes());
            }
            Ok(out)
        }
        (CpuData::I64(v), _) => encode_ints(v.iter().copied(), dtype),
        (CpuData::U32(v), _) => encode_ints(v.iter().map(|&x| i64::from(x)), dtype),
        (data, dtype) => Err(format!("storage dtype {} is not saved as {dtype}", data.dtype())),
    }
}

fn encode_ints(values: impl Iterator<Item = i64>, dtype: FileDType) -> Result<Vec<u8>, String> {
    let mut out = Vec::new();
    for (i, x) in values.enumerate() {
        let misfit = || format!("element {i} is {x}, outside the range of {dtype}");
        match dtype {
            FileDType::Bool if x == 0 || x == 1 => out.push(x as u8),
            FileDType::U8 => out.push(u8::try_from(x).map_err(|_| misfit())?),
            FileDType::I8 => out.extend_from_slice(&i8::try_from(x).map_err(|_| misfit())?.to_le_bytes()),
            FileDType::I16 => out.extend_from_slice(&i16::try_from(x).map_err(|_| misfit())?.to_le_bytes()),
            FileDType::U16 => out.extend_from_slice(&u16::try_from(x).map_err(|_| misfit())?.to_le_bytes()),
            FileDType::I32 => out.extend_from_slice(&i32::try_from(x).map_err(|_| misfit())?.to_le_bytes()),
            FileDType::U32 => out.extend_from_slice(&u32::try_from(x).map_err(|_| misfit())?.to_le_bytes()),
            FileDType::I64 => out.extend_from_slice(&x.to_le_bytes()),
            FileDType::U64 => out.extend_from_slice(&u64::try_from(x).map_err(|_| misfit())?.to_le_bytes()),
            FileDType::Bool => return Err(misfit()),
            FileDType::F16 | FileDType::BF16 | FileDType::F32 | FileDType::F64 => return Err(format!("integers are not saved as {dtype}")),
        }
    }
    Ok(out)
}

/// Copies little-endian bytes into a vector of `T` (the source may be unaligned).
pub(crate) fn pod_vec<T: bytemuck::Pod>(raw: &[u8]) -> Vec<T> {
    let mut v = vec![T::zeroed(); raw.len() / std::mem::size_of::<T>()];
    bytemuck::cast_slice_mut::<T, u8>(&mut v).copy_from_slice(raw);
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_file_dtype_round_trips_through_its_storage() {
        // Goal: for each file dtype, bytes decode into the documented storage and encode back to
        // the same bytes (extreme values included), so saving with the recorded dtype is exact.
        let samples: Vec<(FileDType, Vec<u8>)> = vec![
            (FileDType::Bool, vec![0, 1, 1]),
            (FileDType::U8, vec![0, 7, 255]),
            (FileDType::I8, vec![0x80, 0xff, 0x7f]),
            (FileDType::I16, [i16::MIN, -1, i16::MAX].iter().flat_map(|x| x.to_le_bytes()).collect()),
            (FileDType::U16, [0u16, 1, u16::MAX].iter().flat_map(|x| x.to_le_bytes()).collect()),
            (FileDType::F16, [f16::MIN_POSITIVE_SUBNORMAL, f16::from_f32(-2.5), f16::MAX].iter().flat_map(|x| x.to_le_bytes()).collect()),
            (FileDType::BF16, [bf16::from_f32(1.5), bf16::MIN].iter().flat_map(|x| x.to_le_bytes()).collect()),
            (FileDType::I32, [i32::MIN, 0, i32::MAX].iter().flat_map(|x| x.to_le_bytes()).collect()),
            (FileDType::U32, [0u32, u32::MAX].iter().flat_map(|x| x.to_le_bytes()).collect()),
            (FileDType::F32, [f32::MIN_POSITIVE, -0.1].iter().flat_map(|x| x.to_le_bytes()).collect()),
            (FileDType::F64, [f64::MAX, 1e-300].iter().flat_map(|x| x.to_le_bytes()).collect()),
            (FileDType::I64, [i64::MIN, i64::MAX].iter().flat_map(|x| x.to_le_bytes()).collect()),
            (FileDType::U64, [0u64, i64::MAX as u64].iter().flat_map(|x| x.to_le_bytes()).collect()),
        ];
        assert_eq!(samples.len(), FileDType::ALL.len());
        for (dtype, bytes) in samples {
            let data = decode(dtype, &bytes).unwrap_or_else(|e| panic!("{dtype}: {e}"));
            assert_eq!(data.dtype(), dtype.storage(), "{dtype}");
            assert_eq!(data.len(), bytes.len() / dtype.size_in_bytes(), "{dtype}");
            assert_eq!(encode(&data, dtype).unwrap(), bytes, "{dtype}");
            assert_eq!(FileDType::from_st(dtype.to_st()), Some(dtype));
        }
    }

    #[test]
    fn values_a_dtype_cannot_hold_are_refused() {
        // Goal: every lossy step is an error that names the element: a BOOL byte of 2, a U64 past
        // i64::MAX, an i64 saved as I32 out of range, an f32 that is not an f16.
        assert!(decode(FileDType::Bool, &[0, 2]).unwrap_err().contains("element 1"));
        assert!(decode(FileDType::U64, &u64::MAX.to_le_bytes()).unwrap_err().contains("above the I64 range"));
        let big = CpuData::I64(vec![1, 1 << 40].into());
        assert_eq!(encode(&big, FileDType::I32).unwrap_err(), "element 1 is 1099511627776, outside the range of I32");
        assert!(encode(&CpuData::I64(vec![-1].into()), FileDType::U8).is_err());
        assert!(encode(&CpuData::I64(vec![2].into()), FileDType::Bool).is_err());
        assert!(encode(&CpuData::F32(vec![0.1].into()), FileDType::F16).unwrap_err().contains("F16 cannot hold"));
        assert!(encode(&CpuData::F32(vec![1.0].into()), FileDType::I32).is_err());
    }
}
