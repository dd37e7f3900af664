//! Compiles every built-in CUDA kernel module with NVRTC for `sm_90` (or `RTX_NVRTC_ARCH`, e.g.
//! `80`) on a machine without a GPU: NVRTC is the only library needed. Prints each module's CUBIN
//! size, or the compiler's log and a non-zero exit. `scripts/nvrtc-check.sh` installs NVRTC from
//! PyPI into a cache folder and runs this, so a kernel edit is compile-checked before a GPU call.

use std::process::ExitCode;

fn main() -> ExitCode {
    let arch = std::env::var("RTX_NVRTC_ARCH").unwrap_or_else(|_| "90".into());
    let cc = match arch.parse::<i32>() {
        Ok(v) if v >= 50 => (v / 10, v % 10),
        _ => {
            eprintln!("RTX_NVRTC_ARCH must be a compute capability like 90, got {arch:?}");
            return ExitCode::FAILURE;
        }
    };
    match rtx_kernels::cuda::compile_all(cc) {
        Ok(modules) => {
            for (name, bytes) in modules {
                println!("nvrtc sm_{arch} {name}: {bytes} bytes of CUBIN");
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("nvrtc sm_{arch}: {e}");
            ExitCode::FAILURE
        }
    }
}
