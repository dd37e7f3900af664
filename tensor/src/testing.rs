//! One device switch point for op tests: [`device_test!`](crate::device_test) writes a test body
//! once, taking a `device: Device`, and runs it as `NAME::cpu` on the CPU and, in builds with the
//! `cuda` feature, as `NAME::cuda` on [`gpu()`] (printing `skipped: no CUDA device` where there
//! is none). [`devices()`] lists the same devices for hand-written loops, and [`supported_on`]
//! lets a body accept that an op the GPU does not have yet refuses with a typed
//! [`Error::UnsupportedDevice`] (printing `unsupported on DEVICE: OP`) rather than failing, while
//! still checking every value where the op exists. `scripts/gpu-device-tests.sh` reads those
//! printed markers to tabulate a compiled test binary's results per device.

use crate::error::{Error, Result};
use crate::tensor::Tensor;
use rtx_kernels::Device;

/// The GPU the `cuda` variants of [`device_test!`](crate::device_test) run on: `Some(Device::Cuda(0))`
/// when this build has the `cuda` feature and the CUDA driver reports at least one device, else
/// `None` (always `None` without the feature). The probe runs once per process.
pub fn gpu() -> Option<Device> {
    #[cfg(feature = "cuda")]
    {
        static GPU: std::sync::OnceLock<Option<Device>> = std::sync::OnceLock::new();
        *GPU.get_or_init(|| rtx_kernels::cuda::Device::count().is_ok_and(|n| n > 0).then_some(Device::Cuda(0)))
    }
    #[cfg(not(feature = "cuda"))]
    {
        None
    }
}

/// The devices an op test should cover here: the CPU, then [`gpu()`] if there is one.
pub fn devices() -> Vec<Device> {
    std::iter::once(Device::Cpu).chain(gpu()).collect()
}

/// The result of an op run on `device`, for an op that may not exist there yet: `Ok(Some(t))`
/// when it ran and `t` lives on `device` (check its values); `Ok(None)` when `device` is not the
/// CPU and the op refused with [`Error::UnsupportedDevice`] (a typed refusal is the contract for
/// ops a backend lacks; this prints `unsupported on DEVICE: OP` for the test tables). Any other
/// error is returned, as is a result that silently landed on another device
/// ([`Error::DeviceMismatch`]). On the CPU every op must run, so a refusal there is an error.
pub fn supported_on(device: Device, result: Result<Tensor>) -> Result<Option<Tensor>> {
    match result {
        Ok(t) if t.device() == device => Ok(Some(t)),
        Ok(t) => Err(Error::DeviceMismatch { op: "op result (expected on the operands' device)", lhs: device, rhs: t.device() }),
        Err(Error::UnsupportedDevice { op, device: refused }) if device != Device::Cpu && refused == device => {
            println!("unsupported on {device}: {op}");
            Ok(None)
        }
        Err(e) => Err(e),
    }
}

/// Writes device-generic tests: each `fn NAME(device) -> RESULT { BODY }` becomes a module
/// `NAME` holding `#[test] fn cpu()`, which runs `BODY` with `device = Device::Cpu`, and, when
/// the crate *invoking the macro* is built with its `cuda` feature, `#[test] fn cuda()`, which
/// runs `BODY` on [`testing::gpu()`](crate::testing::gpu) or prints `skipped: no CUDA device`
/// and passes where there is none. Test names read `NAME::cpu` and `NAME::cuda`.
///
/// `RESULT` is written out by the caller and must be a `Result<(), E>` with `E: Debug` (the
/// rtx-tensor tests use `anyhow::Result<()>`; [`crate::Result<()>`] works too). Doc comments
/// and attributes before `fn` go on the module. The module body imports the caller's scope
/// (`use super::*`), so helpers and imports there are visible. Several fns may follow one another
/// in one invocation. A crate using the macro without declaring a `cuda` feature gets only the
/// `cpu` tests (and an `unexpected_cfgs` lint to silence).
///
/// ```ignore
/// rtx_tensor::device_test! {
///     /// Goal: rows of a softmax sum to one.
///     fn softmax_rows_sum_to_one(device) -> anyhow::Result<()> {
///         let x = rtx_tensor::Tensor::from_vec(vec![1.0f32, 2.0, 3.0], &[1, 3])?.to_device(device)?;
///         let y = x.softmax(-1)?.to_f32_vec()?;
///         anyhow::ensure!((y.iter().sum::<f32>() - 1.0).abs() < 1e-6);
///         Ok(())
///     }
/// }
/// ```
#[macro_export]
macro_rules! device_test {
    ($( $(#[$meta:meta])* fn $name:ident($device:ident) -> $ret:ty $body:block )+) => {
        $(
            $(#[$meta])*
            mod $name {
                #[allow(unused_imports)]
                use super::*;

                fn run($device: $crate::Device) -> $ret $body

                #[test]
                fn cpu() -> $ret {
                    run($crate::Device::Cpu)
                }

                #[cfg(feature = "cuda")]
                #[test]
                fn cuda() -> $ret {
                    match $crate::testing::gpu() {
                        Some(device) => run(device),
                        None => {
                            println!("skipped: no CUDA device");
                            Ok(())
                        }
                    }
                }
            }
        )+
    };
}
