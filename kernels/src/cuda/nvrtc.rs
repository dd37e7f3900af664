//! The built-in kernel modules and their process-wide NVRTC cache.
//!
//! Each module's CUDA C source (`core.cu`, `attention.cu`, `attention_bf16.cu`, `mixed.cu`,
//! `tensor_ops.cu` beside this file; `core`, `mixed` and `tensor_ops` start with the shared prelude
//! `common.cu`) is compiled by NVRTC
//! straight to a CUBIN for the device's real architecture (`sm_90` on the H100/H200) the first
//! time any device of that architecture asks for it, once per process, and the CUBIN is kept
//! here; each [`super::Device`] then loads it once (no driver JIT, since it is already machine
//! code) and caches the module and its functions. Compiling takes tens to hundreds of
//! milliseconds per module, so nothing is compiled per call.

use std::collections::HashMap;
use std::ffi::{c_char, CString};
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::nvrtc::result::{self as rtc, NvrtcError};
use cudarc::nvrtc::{sys as rsys, Ptx};

use super::error::{CudaError, Result};

/// A built-in kernel module.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Module {
    /// Elementwise, unary, softmax, norms, cross-entropy, embedding, AdamW, casts.
    Core,
    /// Flash attention forward and backward in f32.
    Attention,
    /// Flash attention forward and backward on bf16 tensor cores.
    AttentionBf16,
    /// Mixed-precision training kernels, f32 and bf16 storage.
    Mixed,
    /// General tensor ops (strided broadcast binary, row softmax, axis sums), f32 and bf16 storage.
    TensorOps,
}

impl Module {
    /// Every module, in load order.
    pub(crate) const ALL: [Module; 5] = [Module::Core, Module::Attention, Module::AttentionBf16, Module::Mixed, Module::TensorOps];

    /// The module's name in errors.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Module::Core => "core",
            Module::Attention => "attention",
            Module::AttentionBf16 => "attention_bf16",
            Module::Mixed => "mixed",
            Module::TensorOps => "tensor_ops",
        }
    }

    fn source(self) -> &'static str {
        match self {
            Module::Core => concat!(include_str!("common.cu"), include_str!("core.cu")),
            Module::Attention => include_str!("attention.cu"),
            Module::AttentionBf16 => include_str!("attention_bf16.cu"),
            Module::Mixed => concat!(include_str!("common.cu"), include_str!("mixed.cu")),
            Module::TensorOps => concat!(include_str!("common.cu"), include_str!("tensor_ops.cu")),
        }
    }
}

/// One slot per (module, compute capability); its mutex is held while that module compiles, so
/// different modules compile in parallel and the same one compiles once.
type Slot = Arc<Mutex<Option<Ptx>>>;

/// Slots by module and compute capability.
type Slots = Mutex<HashMap<(Module, i32, i32), Slot>>;

static CACHE: OnceLock<Slots> = OnceLock::new();

/// The CUBIN of `module` for compute capability `cc` (`(9, 0)` → `sm_90`), compiled on first
/// use in this process.
pub(crate) fn cubin(module: Module, cc: (i32, i32)) -> Result<Ptx> {
    let slot = {
        let cache = CACHE.get_or_init(|| Mutex::new(HashMap::new()));
        let mut map = cache.lock().unwrap_or_else(|e| e.into_inner());
        map.entry((module, cc.0, cc.1)).or_default().clone()
    };
    let mut entry = slot.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(p) = entry.as_ref() {
        return Ok(p.clone());
    }
    let arch = format!("--gpu-architecture=sm_{}{}", cc.0, cc.1);
    let ptx = Ptx::from_binary(compile(module, &[arch.as_str(), "--std=c++17"])?);
    *entry = Some(ptx.clone());
    Ok(ptx)
}

/// Compiles every built-in module for compute capability `cc` without a GPU (NVRTC alone is
/// enough: no driver, no device); returns each module's name and CUBIN size. This is how a kernel
/// change is checked for compile errors on a machine without a GPU (`scripts/nvrtc-check.sh`).
pub fn compile_all(cc: (i32, i32)) -> Result<Vec<(&'static str, usize)>> {
    // SAFETY: this only tries to dlopen the library and drops the handle.
    if !unsafe { rsys::is_culib_present() } {
        return Err(super::error::CudaError::LibraryNotFound { name: "nvrtc" });
    }
    let arch = format!("--gpu-architecture=sm_{}{}", cc.0, cc.1);
    Module::ALL.iter().map(|&m| Ok((m.name(), compile(m, &[arch.as_str(), "--std=c++17"])?.len()))).collect()
}

/// Owns an NVRTC program and destroys it on drop.
struct Program(rsys::nvrtcProgram);

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: the program came from `create_program` and is destroyed once.
        let _ = unsafe { rtc::destroy_program(self.0) };
    }
}

fn compile(module: Module, options: &[&str]) -> Result<Vec<u8>> {
    let fail = |source: NvrtcError, log: String| CudaError::Compile { module: module.name(), log, source };
    let src = CString::new(module.source()).map_err(|_| fail(NvrtcError(rsys::nvrtcResult::NVRTC_ERROR_INVALID_INPUT), "NUL in source".into()))?;
    let name =
        CString::new(format!("rtx_{}.cu", module.name())).map_err(|_| fail(NvrtcError(rsys::nvrtcResult::NVRTC_ERROR_INVALID_INPUT), "NUL in name".into()))?;
    let prog = Program(rtc::create_program(&src, Some(&name)).map_err(|e| fail(e, String::new()))?);
    // SAFETY: `prog` is a live program; `src` and `name` outlive it.
    if let Err(e) = unsafe { rtc::compile_program(prog.0, options) } {
        // SAFETY: as above; the log is a NUL-terminated string NVRTC wrote.
        let log = unsafe { rtc::get_program_log(prog.0) }.map(|raw| c_chars_to_string(&raw)).unwrap_or_default();
        return Err(fail(e, log));
    }
    let mut size = 0usize;
    // SAFETY: `prog` compiled successfully; `size` receives the CUBIN's length.
    unsafe { rsys::nvrtcGetCUBINSize(prog.0, &mut size) }.result().map_err(|e| fail(e, "no CUBIN".into()))?;
    let mut image = vec![0u8; size];
    // SAFETY: `image` holds `size` bytes, as NVRTC asked for.
    unsafe { rsys::nvrtcGetCUBIN(prog.0, image.as_mut_ptr() as *mut c_char) }.result().map_err(|e| fail(e, "no CUBIN".into()))?;
    Ok(image)
}

fn c_chars_to_string(raw: &[c_char]) -> String {
    let bytes: Vec<u8> = raw.iter().take_while(|&&c| c != 0).map(|&c| c as u8).collect();
    String::from_utf8_lossy(&bytes).into_owned()
}
