//! Where a model part's tensors live ([`Placement`]: a device and a dtype), and the host → device
//! half of host-staged communication. Collectives and point-to-point transfers of the mesh move
//! f32 host vectors (the host transport: shared memory or QUIC); a part whose parameters live on a
//! CUDA device reads its tensors to the host before a transfer (`Tensor::to_f32_vec`, which waits
//! for the device's queued work) and puts what arrives back with [`Placement::put`]. On the host
//! in f32, `put` is exactly `Tensor::from_vec`, so the CPU path is unchanged.
//!
//! Decision: staging goes through the host because two ranks sharing one GPU cannot form an NCCL
//! communicator, and the host transport is the one every mesh member already has; the cost is two
//! copies per transfer (reported by the GPU mesh check, not hidden).

use rtx_tensor::{DType, Device, Tensor};

use crate::error::Result;

/// A device and the dtype of the activations and gradients that live there.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Placement {
    /// Where the tensors live.
    pub device: Device,
    /// Their dtype (f32 on the host; f32 or bf16 on a CUDA device).
    pub dtype: DType,
}

impl Placement {
    /// Host tensors in f32 (what the CPU path uses).
    pub const HOST_F32: Placement = Placement { device: Device::Cpu, dtype: DType::F32 };

    /// The placement of `t`.
    pub fn of(t: &Tensor) -> Placement {
        Placement { device: t.device(), dtype: t.dtype() }
    }

    /// Whether this is [`Placement::HOST_F32`].
    pub fn is_host_f32(&self) -> bool {
        *self == Placement::HOST_F32
    }

    /// `values` as a fresh tensor of `shape` here: a leaf without a graph (copied to the device,
    /// then rounded to the dtype there).
    pub fn put(&self, values: Vec<f32>, shape: &[usize]) -> Result<Tensor> {
        self.onto(Tensor::from_vec(values, shape)?)
    }

    /// The host tensor `t` moved here (the same tensor when it already is here); not recorded by
    /// autograd.
    pub fn onto(&self, t: Tensor) -> Result<Tensor> {
        if t.device() == self.device && t.dtype() == self.dtype {
            return Ok(t);
        }
        if self.device == Device::Cpu {
            return Ok(t.detach().to_dtype(self.dtype)?);
        }
        // Copied up as it is, then cast on the device (no host pass over the elements); `t` needs
        // no gradient, so the cast records no graph and the result is a leaf.
        Ok(t.detach().to_device(self.device)?.to_dtype(self.dtype)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_f32_is_from_vec_and_other_dtypes_round_on_the_host() {
        // Goal: on the host in f32, `put` is `Tensor::from_vec` (the CPU path keeps its bits); a
        // bf16 placement rounds. Method: put distinct values both ways and compare.
        let values = vec![1.0f32, 1.0 + 1.0 / 1024.0, -3.5, 1e-3];
        let t = Placement::HOST_F32.put(values.clone(), &[2, 2]).unwrap();
        assert_eq!((t.shape(), t.dtype(), t.device()), (&[2usize, 2][..], DType::F32, Device::Cpu));
        assert_eq!(t.to_f32_vec().unwrap(), values);
        let bf = Placement { device: Device::Cpu, dtype: DType::BF16 }.put(values.clone(), &[4]).unwrap();
        assert_eq!(bf.dtype(), DType::BF16);
        assert!(!bf.is_requires_grad() && bf.is_leaf());
        let back = bf.to_f32_vec().unwrap();
        assert_eq!(back[0], 1.0);
        assert_ne!(back[1], values[1], "1 + 2^-10 is not a bf16 value");
        assert!((back[3] - values[3]).abs() < 1e-5);
    }

    #[test]
    fn a_device_placement_without_cuda_is_a_typed_error() {
        // Goal: asking for a device this build or machine lacks fails with the tensor layer's
        // error, not a panic (a CUDA machine puts the tensor there instead).
        let p = Placement { device: Device::Cuda(0), dtype: DType::F32 };
        match p.put(vec![1.0, 2.0], &[2]) {
            Ok(t) => assert_eq!(t.device(), Device::Cuda(0)),
            Err(e) => assert!(e.to_string().to_lowercase().contains("cuda"), "{e}"),
        }
    }
}
