//! Where a worker trains: the host, or one CUDA device chosen by the worker's local index.
//!
//! [`resolve_device`] turns `[train] device` into a [`Placement`] when a job or worker starts.
//! `device = "cuda"` needs a binary built with the `cuda` feature and a usable GPU; otherwise it
//! is a [`DeviceError`] saying which is missing, before any data is read or worker started. Worker
//! `local_rank` takes `cuda:(local_rank mod visible devices)`: with fewer GPUs than workers,
//! workers share GPUs round-robin (each with its own model, optimizer and CUDA context), and their
//! gradients meet in the host communicator. The index is the process's, not its elastic rank, so
//! a worker keeps its GPU across generations.

use rtx_tensor::DType;

use crate::config::{DeviceKind, Precision, TrainConfig};

/// Why `device = "cuda"` cannot run here.
#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    /// The binary has no CUDA backend.
    #[error("train.device = \"cuda\", but this rtx was built without CUDA support: rebuild with `cargo build --release --features cuda`, or set train.device = \"cpu\"")]
    NotCompiled,
    /// CUDA is compiled in, but no device can be used (no driver, no library, no GPU).
    #[error("train.device = \"cuda\", but no CUDA device is usable: {reason}; set train.device = \"cpu\" or run on a machine with a GPU")]
    NoDevice {
        /// What the probe reported.
        reason: String,
    },
}

/// Where one worker's replica lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Placement {
    /// Host tensors, f32.
    Cpu,
    /// CUDA device `ordinal`, parameters in `dtype` (f32 or bf16).
    Cuda {
        /// The device ordinal (as CUDA numbers the visible devices).
        ordinal: usize,
        /// Parameter, activation and gradient dtype.
        dtype: DType,
    },
}

/// The placement of worker `local_rank` under `config`; checks that CUDA is there when asked
/// for (counts devices without opening one).
pub fn resolve_device(config: &TrainConfig, local_rank: usize) -> Result<Placement, DeviceError> {
    match config.train.device {
        DeviceKind::Cpu => Ok(Placement::Cpu),
        DeviceKind::Cuda => {
            let visible = visible_devices()?;
            if visible == 0 {
                return Err(DeviceError::NoDevice { reason: "the driver reports no devices".into() });
            }
            let dtype = match config.precision() {
                Precision::F32 => DType::F32,
                Precision::Bf16 => DType::BF16,
            };
            Ok(Placement::Cuda { ordinal: local_rank % visible, dtype })
        }
    }
}

#[cfg(feature = "cuda")]
fn visible_devices() -> Result<usize, DeviceError> {
    rtx_kernels::cuda::Device::count().map_err(|e| DeviceError::NoDevice { reason: e.to_string() })
}

#[cfg(not(feature = "cuda"))]
fn visible_devices() -> Result<usize, DeviceError> {
    Err(DeviceError::NotCompiled)
}

#[cfg(test)]
mod tests {
    use super::*;

    const GPT: &str = r#"
[model]
kind = "gpt"
n_layers = 1
d_model = 64
n_heads = 1
context = 8
[data]
dataset = "sotu"
batch_size = 2
[optim]
kind = "adamw"
lr = 1e-3
[train]
steps = 1
"#;

    #[test]
    fn cpu_needs_nothing() {
        // Goal: the default device resolves on any machine, whatever the local index.
        let config = TrainConfig::from_toml_str(GPT).expect("valid");
        assert_eq!(resolve_device(&config, 7).expect("cpu"), Placement::Cpu);
    }

    /// An I-JEPA the GPU can train (one head of 64 in the encoder and the predictor).
    const IJEPA: &str = r#"
[model]
kind = "ijepa"
patch_size = 2
d_model = 64
n_layers = 1
n_heads = 1
[jepa]
predictor_width = 64
predictor_heads = 1
[data]
dataset = "digits"
batch_size = 4
[optim]
kind = "adamw"
lr = 1e-3
[train]
steps = 1
"#;

    #[test]
    fn cuda_without_a_gpu_is_a_typed_error_saying_why() {
        // Goal: `device = "cuda"` on a machine (or build) without CUDA fails with the reason, not a
        // panic, for every model the GPU trains. Method: resolve a GPT and an I-JEPA on this
        // machine; a build without the feature must say so, a CUDA build without a usable device
        // must say that (a GPU machine checks the placement).
        for text in [GPT, IJEPA] {
            let config = TrainConfig::from_toml_str(&text.replace("steps = 1", "steps = 1\ndevice = \"cuda\"")).expect("valid");
            let cuda_build = cfg!(feature = "cuda");
            match resolve_device(&config, 3) {
                Err(e @ DeviceError::NotCompiled) => {
                    assert!(!cuda_build, "a CUDA build said it has no CUDA");
                    assert!(e.to_string().contains("--features cuda"), "{e}");
                }
                Err(e @ DeviceError::NoDevice { .. }) => {
                    assert!(cuda_build, "a build without CUDA probed for devices");
                    assert!(e.to_string().contains("no CUDA device is usable"), "{e}");
                }
                Ok(Placement::Cuda { ordinal, dtype }) => {
                    let visible = visible_devices().expect("a GPU was found");
                    assert_eq!((ordinal, dtype), (3 % visible, DType::BF16));
                }
                Ok(Placement::Cpu) => panic!("device = \"cuda\" resolved to the CPU"),
            }
        }
    }
}
