//! GPU check: runs every CUDA op of `rtx_kernels::cuda` on fresh random inputs (never zeros)
//! and compares it with the CPU kernels of `rtx-kernels` (computed in f64 where the kernel is
//! generic, so the error measured is the GPU's), forward and backward, then benchmarks GEMM
//! (our wrapper against raw cuBLAS on the same buffers), flash attention and memory bandwidth.
//! Prints one line per check as it goes and a short table last; exits non-zero when a check
//! fails. The seed is printed; set `RTX_SEED` to replay it.
//!
//! Error metric: `max |gpu − ref| / max |ref|` over the output (normwise relative), with the
//! tolerances of issue #6: f32 ≤ 1e-5, TF32 ≤ 5e-4, bf16 ≤ 1e-2.
//!
//! Run: `cargo build --release -p rtx-kernels --features cuda --example gpu_check`, then the
//! binary on a GPU machine (`scripts/gpu-check.sh`). `GPU_CHECK_ONLY=attention,attention_bench`
//! runs only the steps named; `GPU_CHECK_ATTN_SHAPES=1` times only the GPT-2 attention shape
//! (for profiler runs).
#![allow(clippy::unwrap_used)]

use std::error::Error;
use std::ffi::c_void;
use std::time::Instant;

use half::bf16;
use rtx_kernels::attention::{attention_backward, attention_forward, AttentionSpec, Heads};
use rtx_kernels::cross_entropy::{cross_entropy_rows, CrossEntropySpec};
use rtx_kernels::cuda::cudarc::cublas::{result as blas, sys as bsys, CudaBlas};
use rtx_kernels::cuda::{AdamW, BinaryOp, Buffer, Device, FlashSpec, Gemm, GemmMath, HeadLayout, UnaryOp};
use rtx_kernels::matmul::{matmul, Operand};
use rtx_kernels::{convert, elementwise, norm, softmax};

type Res<T> = std::result::Result<T, Box<dyn Error>>;

/// One named step of the check.
type Step = (&'static str, fn(&Device, &mut Rng, &mut Report) -> Res<()>);

const F32_TOL: f64 = 1e-5;
const TF32_TOL: f64 = 5e-4;
const BF16_TOL: f64 = 1e-2;

/// splitmix64: a small seeded generator so every run can be replayed.
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e3779b97f4a7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58476d1ce4e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d049bb133111eb);
        z ^ (z >> 31)
    }
    /// Uniform in [lo, hi).
    fn uniform(&mut self, lo: f64, hi: f64) -> f64 {
        lo + (hi - lo) * ((self.next_u64() >> 11) as f64 / (1u64 << 53) as f64)
    }
    /// `n` values uniform in [-1, 1) scaled by `s`, none exactly zero.
    fn vec(&mut self, n: usize, s: f64) -> Vec<f32> {
        (0..n)
            .map(|_| {
                let v = self.uniform(-1.0, 1.0) * s;
                if v == 0.0 {
                    1e-3
                } else {
                    v as f32
                }
            })
            .collect()
    }
    fn below(&mut self, n: u32) -> u32 {
        (self.next_u64() % n as u64) as u32
    }
}

#[derive(Default)]
struct Report {
    checks: Vec<(String, f64, f64)>,
    benches: Vec<(String, String)>,
}

impl Report {
    /// Records `gpu` against `reference` under `tol`.
    fn check(&mut self, name: &str, gpu: &[f32], reference: &[f64], tol: f64) {
        let err = rel_err(gpu, reference);
        let ok = err <= tol;
        println!("check {name:<44} rel err {err:.2e} (tol {tol:.0e}) {}", if ok { "ok" } else { "FAIL" });
        self.checks.push((name.to_string(), err, tol));
    }
    /// Records an exact (pass/fail) check.
    fn pass(&mut self, name: &str, ok: bool) {
        println!("check {name:<44} {}", if ok { "ok" } else { "FAIL" });
        self.checks.push((name.to_string(), if ok { 0.0 } else { f64::INFINITY }, 0.0));
    }
    fn bench(&mut self, name: &str, value: String) {
        println!("bench {name:<44} {value}");
        self.benches.push((name.to_string(), value));
    }
    fn failures(&self) -> usize {
        // NaN errors count as failures.
        self.checks.iter().filter(|(_, e, t)| e.partial_cmp(t) != Some(std::cmp::Ordering::Less) && e != t).count()
    }
}

fn rel_err(gpu: &[f32], reference: &[f64]) -> f64 {
    assert_eq!(gpu.len(), reference.len(), "length mismatch");
    let scale = reference.iter().fold(0.0f64, |m, v| m.max(v.abs())).max(1e-30);
    let diff = gpu.iter().zip(reference).fold(0.0f64, |m, (&g, &r)| {
        let d = (g as f64 - r).abs();
        if d.is_nan() {
            f64::INFINITY
        } else {
            m.max(d)
        }
    });
    diff / scale
}

fn f64v(x: &[f32]) -> Vec<f64> {
    x.iter().map(|&v| v as f64).collect()
}

fn main() {
    let seed = std::env::var("RTX_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(1));
    println!("gpu_check seed {seed} (RTX_SEED={seed} replays it)");
    let mut rng = Rng(seed);
    let mut report = Report::default();
    let t0 = Instant::now();
    let dev = match Device::new(0) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("no GPU: {e}");
            std::process::exit(2);
        }
    };
    println!("device: {} sm_{:?}", dev.name(), dev.compute_capability().ok());
    let tw = Instant::now();
    if let Err(e) = dev.warm_up() {
        // The steps below report their own errors; keep going so one bad module hides nothing.
        println!("ERROR warm up: {e}");
    }
    report.bench("NVRTC compile + load (3 modules in parallel, once)", format!("{:.0} ms", tw.elapsed().as_secs_f64() * 1e3));
    let tw = Instant::now();
    let d2 = Device::new(0).and_then(|d| d.warm_up().map(|_| d));
    report.bench("second device: load cached PTX", format!("{:.0} ms ({})", tw.elapsed().as_secs_f64() * 1e3, if d2.is_ok() { "ok" } else { "failed" }));
    drop(d2);

    let steps: [Step; 13] = [
        ("memory", check_memory),
        ("gemm", check_gemm),
        ("binary", check_binary),
        ("unary", check_unary),
        ("softmax", check_softmax),
        ("norms", check_norms),
        ("cross_entropy", check_cross_entropy),
        ("embedding", check_embedding),
        ("adamw", check_adamw),
        ("casts", check_casts),
        ("attention", check_attention),
        ("benchmarks", benchmarks),
        ("attention_bench", bench_attention),
    ];
    let mut errors = 0;
    // `GPU_CHECK_ONLY=attention,benchmarks` runs only the steps named (for profiling runs).
    let only = std::env::var("GPU_CHECK_ONLY").ok();
    let steps = steps.into_iter().filter(|(name, _)| only.as_deref().is_none_or(|o| o.split(',').any(|s| s == *name)));
    for (name, step) in steps {
        if let Err(e) = step(&dev, &mut rng, &mut report) {
            println!("ERROR in {name}: {e}");
            errors += 1;
        }
    }
    let stats = dev.memory_stats();
    report.bench(
        "allocator",
        format!(
            "peak allocated {:.1} MiB, peak reserved {:.1} MiB, {} cache hits, {} driver allocs",
            stats.peak_allocated as f64 / 1048576.0,
            stats.peak_reserved as f64 / 1048576.0,
            stats.cache_hits,
            stats.driver_allocs
        ),
    );

    println!("\n## GPU check summary (seed {seed}, {:.1} s)\n", t0.elapsed().as_secs_f64());
    println!("| check | rel err | tol | |\n|---|---|---|---|");
    for (name, err, tol) in &report.checks {
        println!("| {name} | {err:.2e} | {tol:.0e} | {} |", if err <= tol { "ok" } else { "FAIL" });
    }
    println!("\n| benchmark | result |\n|---|---|");
    for (name, value) in &report.benches {
        println!("| {name} | {value} |");
    }
    let failures = report.failures();
    println!("\n{} checks, {failures} failed, {errors} steps errored", report.checks.len());
    if failures > 0 || errors > 0 {
        std::process::exit(1);
    }
}

fn check_memory(dev: &Device, rng: &mut Rng, rep: &mut Report) -> Res<()> {
    // Larger than the staging buffer, so the chunked path runs.
    let n = 10_000_003;
    let x = rng.vec(n, 1.0);
    let buf = dev.htod(&x)?;
    let back = dev.dtoh(&buf)?;
    let same = back == x;
    rep.pass("htod/dtoh roundtrip 40 MB (exact)", same);
    let mut pinned = dev.alloc_pinned::<f32>(1 << 20)?;
    pinned.as_mut_slice().copy_from_slice(&x[..1 << 20]);
    let mut d = dev.alloc::<f32>(1 << 20)?;
    dev.copy_pinned_htod(&pinned, &mut d)?;
    let mut pinned2 = dev.alloc_pinned::<f32>(1 << 20)?;
    dev.copy_dtoh_pinned(&d, &mut pinned2)?;
    let same = pinned2.as_slice() == &x[..1 << 20];
    rep.pass("pinned roundtrip 4 MB (exact)", same);
    // The allocator hands the same block back for the same size class.
    let before = dev.memory_stats();
    let ptr = d.device_ptr();
    drop(d);
    let again = dev.alloc::<f32>((1 << 20) - 7)?;
    let after = dev.memory_stats();
    let reused = again.device_ptr() == ptr && after.cache_hits == before.cache_hits + 1 && after.reserved == before.reserved;
    rep.pass("allocator reuses a freed block of the class", reused);
    Ok(())
}

/// CPU reference product in f64 of row-major operands with the given transposes.
#[allow(clippy::too_many_arguments)]
fn cpu_gemm(g: &Gemm, a: &[f64], b: &[f64]) -> Vec<f64> {
    let (m, n, k) = (g.m, g.n, g.k);
    let mut c = vec![0.0; g.batch * m * n];
    for bi in 0..g.batch {
        let lhs = if g.trans_a { Operand { offset: bi * m * k, row_stride: 1, col_stride: m } } else { Operand::row_major(bi * m * k, k) };
        let rhs = if g.trans_b { Operand { offset: bi * k * n, row_stride: 1, col_stride: k } } else { Operand::row_major(bi * k * n, n) };
        matmul(m, n, k, a, lhs, b, rhs, &mut c, bi * m * n, false).unwrap();
    }
    c
}

fn check_gemm(dev: &Device, rng: &mut Rng, rep: &mut Report) -> Res<()> {
    for &(m, n, k, ta, tb, batch) in
        &[(384, 320, 256, false, false, 1), (200, 136, 72, true, false, 1), (129, 257, 64, false, true, 1), (96, 80, 48, true, true, 3)]
    {
        let g = Gemm { trans_a: ta, trans_b: tb, batch, ..Gemm::new(m, n, k) };
        let a = rng.vec(batch * m * k, 1.0);
        let b = rng.vec(batch * k * n, 1.0);
        let reference = cpu_gemm(&g, &f64v(&a), &f64v(&b));
        let (da, db) = (dev.htod(&a)?, dev.htod(&b)?);
        let mut dc = dev.alloc::<f32>(batch * m * n)?;
        let tag = format!(
            "{m}x{n}x{k}{}{}{}",
            if ta { " Aᵀ" } else { "" },
            if tb { " Bᵀ" } else { "" },
            if batch > 1 { format!(" batch {batch}") } else { String::new() }
        );
        dev.gemm(&g, &da, &db, &mut dc)?;
        rep.check(&format!("gemm f32 {tag}"), &dev.dtoh(&dc)?, &reference, F32_TOL);
        dev.gemm(&Gemm { math: GemmMath::Tf32, ..g }, &da, &db, &mut dc)?;
        rep.check(&format!("gemm tf32 {tag}"), &dev.dtoh(&dc)?, &reference, TF32_TOL);
        // bf16: the reference multiplies the same rounded inputs in f64.
        let (ab, bb) = (convert::f32_vec_to_bf16(&a), convert::f32_vec_to_bf16(&b));
        let reference = cpu_gemm(&g, &ab.iter().map(|v| v.to_f64()).collect::<Vec<_>>(), &bb.iter().map(|v| v.to_f64()).collect::<Vec<_>>());
        let (da, db) = (dev.htod(&ab)?, dev.htod(&bb)?);
        let mut dc = dev.alloc::<bf16>(batch * m * n)?;
        dev.gemm(&g, &da, &db, &mut dc)?;
        rep.check(&format!("gemm bf16 {tag}"), &convert::bf16_vec_to_f32(&dev.dtoh(&dc)?), &reference, BF16_TOL);
    }
    // beta accumulates into C.
    let g = Gemm { beta: 1.0, alpha: 0.5, ..Gemm::new(64, 48, 32) };
    let (a, b, c0) = (rng.vec(64 * 32, 1.0), rng.vec(32 * 48, 1.0), rng.vec(64 * 48, 1.0));
    let prod = cpu_gemm(&Gemm::new(64, 48, 32), &f64v(&a), &f64v(&b));
    let reference: Vec<f64> = prod.iter().zip(&c0).map(|(p, &c)| 0.5 * p + c as f64).collect();
    let mut dc = dev.htod(&c0)?;
    dev.gemm(&g, &dev.htod(&a)?, &dev.htod(&b)?, &mut dc)?;
    rep.check("gemm f32 alpha 0.5 beta 1", &dev.dtoh(&dc)?, &reference, F32_TOL);
    Ok(())
}

fn binary_ref(op: BinaryOp, a: f64, b: f64) -> f64 {
    match op {
        BinaryOp::Add => a + b,
        BinaryOp::Sub => a - b,
        BinaryOp::Mul => a * b,
        BinaryOp::Div => a / b,
        BinaryOp::Max => a.max(b),
        BinaryOp::Min => a.min(b),
    }
}

fn check_binary(dev: &Device, rng: &mut Rng, rep: &mut Report) -> Res<()> {
    let n = 100_003;
    let a = rng.vec(n, 2.0);
    // Divisors kept away from zero.
    let b: Vec<f32> = rng.vec(n, 1.0).iter().map(|v| v.signum() * (0.5 + v.abs())).collect();
    let (da, db) = (dev.htod(&a)?, dev.htod(&b)?);
    let mut out = dev.alloc::<f32>(n)?;
    for op in [BinaryOp::Add, BinaryOp::Sub, BinaryOp::Mul, BinaryOp::Div, BinaryOp::Max, BinaryOp::Min] {
        dev.binary(op, &da, &db, &mut out)?;
        let reference: Vec<f64> = a.iter().zip(&b).map(|(&x, &y)| binary_ref(op, x as f64, y as f64)).collect();
        rep.check(&format!("binary {op:?}"), &dev.dtoh(&out)?, &reference, F32_TOL);
    }
    for (sa, sb) in [(vec![4usize, 1, 3], vec![5usize, 1]), (vec![2, 3, 64], vec![64]), (vec![8, 1], vec![1, 8, 16])] {
        let (na, nb) = (sa.iter().product::<usize>(), sb.iter().product::<usize>());
        let a = rng.vec(na, 1.0);
        let b: Vec<f32> = rng.vec(nb, 1.0).iter().map(|v| v.signum() * (0.5 + v.abs())).collect();
        let shape = rtx_kernels::cuda::broadcast_shape(&sa, &sb).unwrap();
        let total: usize = shape.iter().product();
        let strides = |s: &[usize]| -> Vec<usize> {
            let nd = shape.len();
            let mut st = vec![0; nd];
            let mut acc = 1;
            for i in (0..nd).rev() {
                let d = if i + s.len() >= nd { s[i + s.len() - nd] } else { 1 };
                st[i] = if d == 1 { 0 } else { acc };
                acc *= d;
            }
            st
        };
        for op in [BinaryOp::Add, BinaryOp::Div] {
            let mut reference = vec![0.0f64; total];
            elementwise::broadcast_zip_map(&shape, &f64v(&a), 0, &strides(&sa), &f64v(&b), 0, &strides(&sb), &mut reference, |x, y| binary_ref(op, x, y))?;
            let mut out = dev.alloc::<f32>(total)?;
            dev.broadcast_binary(op, &dev.htod(&a)?, &sa, &dev.htod(&b)?, &sb, &mut out)?;
            rep.check(&format!("broadcast {op:?} {sa:?} with {sb:?}"), &dev.dtoh(&out)?, &reference, F32_TOL);
        }
    }
    Ok(())
}

fn unary_ref(op: UnaryOp, x: f64) -> (f64, f64) {
    match op {
        UnaryOp::Exp => (x.exp(), x.exp()),
        UnaryOp::GeluTanh => {
            let k = (2.0 / std::f64::consts::PI).sqrt();
            let u = k * (x + 0.044715 * x * x * x);
            let t = u.tanh();
            (0.5 * x * (1.0 + t), 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * k * (1.0 + 3.0 * 0.044715 * x * x))
        }
        UnaryOp::Silu => {
            let s = 1.0 / (1.0 + (-x).exp());
            (x * s, s * (1.0 + x * (1.0 - s)))
        }
        UnaryOp::Relu => (x.max(0.0), if x > 0.0 { 1.0 } else { 0.0 }),
        UnaryOp::GeluErf => {
            let cdf = 0.5 * (1.0 + libm::erf(x / std::f64::consts::SQRT_2));
            (x * cdf, cdf + x * (-0.5 * x * x).exp() / (2.0 * std::f64::consts::PI).sqrt())
        }
    }
}

fn check_unary(dev: &Device, rng: &mut Rng, rep: &mut Report) -> Res<()> {
    let n = 65_537;
    let x = rng.vec(n, 4.0);
    let dy = rng.vec(n, 1.0);
    let (dx_, ddy) = (dev.htod(&x)?, dev.htod(&dy)?);
    let mut y = dev.alloc::<f32>(n)?;
    let mut dx = dev.alloc::<f32>(n)?;
    for op in [UnaryOp::Exp, UnaryOp::GeluTanh, UnaryOp::Silu, UnaryOp::Relu, UnaryOp::GeluErf] {
        dev.unary(op, &dx_, &mut y)?;
        let mut fwd = vec![0.0f64; n];
        elementwise::map(&f64v(&x), &mut fwd, |v| unary_ref(op, v).0)?;
        rep.check(&format!("unary {op:?} forward"), &dev.dtoh(&y)?, &fwd, F32_TOL);
        dev.unary_backward(op, &dx_, &ddy, &mut dx)?;
        let bwd: Vec<f64> = x.iter().zip(&dy).map(|(&v, &g)| g as f64 * unary_ref(op, v as f64).1).collect();
        rep.check(&format!("unary {op:?} backward"), &dev.dtoh(&dx)?, &bwd, F32_TOL);
    }
    Ok(())
}

fn check_softmax(dev: &Device, rng: &mut Rng, rep: &mut Report) -> Res<()> {
    for &(rows, cols) in &[(64, 1000), (300, 33), (8, 50304)] {
        let x = rng.vec(rows * cols, 5.0);
        let dy = rng.vec(rows * cols, 1.0);
        let mut y64 = vec![0.0f64; rows * cols];
        softmax::softmax_rows(&f64v(&x), cols, &mut y64)?;
        let dx_ = dev.htod(&x)?;
        let mut y = dev.alloc::<f32>(rows * cols)?;
        dev.softmax_rows(&dx_, cols, &mut y)?;
        rep.check(&format!("softmax rows {rows}x{cols}"), &dev.dtoh(&y)?, &y64, F32_TOL);
        let mut dx64 = vec![0.0f64; rows * cols];
        softmax::softmax_backward_rows(&y64, &f64v(&dy), cols, &mut dx64)?;
        let mut dx = dev.alloc::<f32>(rows * cols)?;
        dev.softmax_backward_rows(&y, &dev.htod(&dy)?, cols, &mut dx)?;
        rep.check(&format!("softmax backward {rows}x{cols}"), &dev.dtoh(&dx)?, &dx64, F32_TOL);
    }
    Ok(())
}

fn check_norms(dev: &Device, rng: &mut Rng, rep: &mut Report) -> Res<()> {
    let eps = 1e-5;
    for &(rows, n) in &[(256, 768), (37, 100)] {
        let x: Vec<f32> = rng.vec(rows * n, 2.0).iter().map(|v| v + 0.3).collect();
        let w = rng.vec(n, 1.0);
        let b = rng.vec(n, 1.0);
        let dy = rng.vec(rows * n, 1.0);
        let (x64, w64, b64, dy64) = (f64v(&x), f64v(&w), f64v(&b), f64v(&dy));
        // Layer norm.
        let (mut y64, mut mean64, mut rstd64) = (vec![0.0; rows * n], vec![0.0; rows], vec![0.0; rows]);
        norm::layer_norm_forward(&x64, n, Some(&w64), Some(&b64), eps, &mut y64, &mut mean64, &mut rstd64)?;
        let (dx_, dw_, db_, ddy) = (dev.htod(&x)?, dev.htod(&w)?, dev.htod(&b)?, dev.htod(&dy)?);
        let (mut y, mut mean, mut rstd) = (dev.alloc::<f32>(rows * n)?, dev.alloc::<f32>(rows)?, dev.alloc::<f32>(rows)?);
        dev.layer_norm_forward(&dx_, n, Some(&dw_), Some(&db_), eps as f32, &mut y, &mut mean, &mut rstd)?;
        rep.check(&format!("layer norm forward {rows}x{n}"), &dev.dtoh(&y)?, &y64, F32_TOL);
        let (mut dx64, mut dw64, mut db64) = (vec![0.0; rows * n], vec![0.0; n], vec![0.0; n]);
        norm::layer_norm_backward(&x64, n, Some(&w64), &mean64, &rstd64, &dy64, &mut dx64, Some(&mut dw64), Some(&mut db64))?;
        let (mut dx, mut dw, mut db) = (dev.alloc::<f32>(rows * n)?, dev.zeros::<f32>(n)?, dev.zeros::<f32>(n)?);
        dev.layer_norm_backward(&dx_, n, Some(&dw_), &mean, &rstd, &ddy, &mut dx, Some(&mut dw), Some(&mut db))?;
        rep.check(&format!("layer norm backward dx {rows}x{n}"), &dev.dtoh(&dx)?, &dx64, F32_TOL);
        rep.check(&format!("layer norm backward dw {rows}x{n}"), &dev.dtoh(&dw)?, &dw64, F32_TOL);
        rep.check(&format!("layer norm backward db {rows}x{n}"), &dev.dtoh(&db)?, &db64, F32_TOL);
        // RMS norm.
        let (mut y64, mut rstd64) = (vec![0.0; rows * n], vec![0.0; rows]);
        norm::rms_norm_forward(&x64, n, Some(&w64), eps, &mut y64, &mut rstd64)?;
        dev.rms_norm_forward(&dx_, n, Some(&dw_), eps as f32, &mut y, &mut rstd)?;
        rep.check(&format!("rms norm forward {rows}x{n}"), &dev.dtoh(&y)?, &y64, F32_TOL);
        let (mut dx64, mut dw64) = (vec![0.0; rows * n], vec![0.0; n]);
        norm::rms_norm_backward(&x64, n, Some(&w64), &rstd64, &dy64, &mut dx64, Some(&mut dw64))?;
        let mut dw = dev.zeros::<f32>(n)?;
        dev.rms_norm_backward(&dx_, n, Some(&dw_), &rstd, &ddy, &mut dx, Some(&mut dw))?;
        rep.check(&format!("rms norm backward dx {rows}x{n}"), &dev.dtoh(&dx)?, &dx64, F32_TOL);
        rep.check(&format!("rms norm backward dw {rows}x{n}"), &dev.dtoh(&dw)?, &dw64, F32_TOL);
    }
    Ok(())
}

fn check_cross_entropy(dev: &Device, rng: &mut Rng, rep: &mut Report) -> Res<()> {
    for &(rows, c, smoothing) in &[(128, 1000, 0.0), (64, 50304, 0.1)] {
        let logits = rng.vec(rows * c, 4.0);
        let ignore = c as u32 + 7;
        let targets: Vec<u32> = (0..rows).map(|i| if i % 9 == 4 { ignore } else { rng.below(c as u32) }).collect();
        let spec = CrossEntropySpec { n_classes: c, ignore_index: Some(i64::from(ignore)), label_smoothing: smoothing };
        let (mut loss64, mut grad64) = (vec![0.0f64; rows], vec![0.0f64; rows * c]);
        cross_entropy_rows(&f64v(&logits), &targets, spec, &mut loss64, Some(&mut grad64))?;
        let (mut loss, mut grad) = (dev.alloc::<f32>(rows)?, dev.alloc::<f32>(rows * c)?);
        dev.cross_entropy(&dev.htod(&logits)?, &dev.htod(&targets)?, spec, &mut loss, Some(&mut grad))?;
        rep.check(&format!("cross entropy loss {rows}x{c} ls {smoothing}"), &dev.dtoh(&loss)?, &loss64, F32_TOL);
        rep.check(&format!("cross entropy grad {rows}x{c} ls {smoothing}"), &dev.dtoh(&grad)?, &grad64, F32_TOL);
    }
    Ok(())
}

fn check_embedding(dev: &Device, rng: &mut Rng, rep: &mut Report) -> Res<()> {
    let (vocab, dim, n_ids) = (1000, 96, 4096);
    let table = rng.vec(vocab * dim, 1.0);
    // Many repeats, so the atomic backward adds into the same rows.
    let ids: Vec<u32> = (0..n_ids).map(|_| rng.below(vocab as u32 / 4)).collect();
    let dout = rng.vec(n_ids * dim, 1.0);
    let mut fwd = vec![0.0f64; n_ids * dim];
    for (r, &id) in ids.iter().enumerate() {
        for c in 0..dim {
            fwd[r * dim + c] = table[id as usize * dim + c] as f64;
        }
    }
    let did = dev.htod(&ids)?;
    let mut out = dev.alloc::<f32>(n_ids * dim)?;
    dev.embedding_forward(&dev.htod(&table)?, dim, &did, &mut out)?;
    rep.check("embedding forward", &dev.dtoh(&out)?, &fwd, 0.0);
    let mut bwd = vec![0.0f64; vocab * dim];
    for (r, &id) in ids.iter().enumerate() {
        for c in 0..dim {
            bwd[id as usize * dim + c] += dout[r * dim + c] as f64;
        }
    }
    let mut dtable = dev.zeros::<f32>(vocab * dim)?;
    dev.embedding_backward(&dev.htod(&dout)?, &did, dim, &mut dtable)?;
    rep.check("embedding backward (atomic adds)", &dev.dtoh(&dtable)?, &bwd, F32_TOL);
    Ok(())
}

fn check_adamw(dev: &Device, rng: &mut Rng, rep: &mut Report) -> Res<()> {
    let n = 200_001;
    let p0 = rng.vec(n, 1.0);
    let (mut p, mut m, mut v) = (f64v(&p0), vec![0.0f64; n], vec![0.0f64; n]);
    let (mut dp, mut dm, mut dv) = (dev.htod(&p0)?, dev.zeros::<f32>(n)?, dev.zeros::<f32>(n)?);
    let hp = AdamW { lr: 1e-3, beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.1, step: 0 };
    for step in 1..=3u32 {
        let g = rng.vec(n, 0.5);
        dev.adamw(&mut dp, &dev.htod(&g)?, &mut dm, &mut dv, AdamW { step, ..hp })?;
        let (b1, b2) = (hp.beta1 as f64, hp.beta2 as f64);
        let (bc1, bc2) = (1.0 - b1.powi(step as i32), 1.0 - b2.powi(step as i32));
        for i in 0..n {
            let gi = g[i] as f64;
            m[i] = b1 * m[i] + (1.0 - b1) * gi;
            v[i] = b2 * v[i] + (1.0 - b2) * gi * gi;
            p[i] = p[i] * (1.0 - hp.lr as f64 * hp.weight_decay as f64) - hp.lr as f64 * (m[i] / bc1) / ((v[i] / bc2).sqrt() + hp.eps as f64);
        }
    }
    // The update is tiny next to the parameter, so compare the change, not the value.
    let gp = dev.dtoh(&dp)?;
    let delta_gpu: Vec<f32> = gp.iter().zip(&p0).map(|(a, b)| a - b).collect();
    let delta_ref: Vec<f64> = p.iter().zip(&p0).map(|(a, &b)| a - b as f64).collect();
    rep.check("adamw 3 steps: parameter change", &delta_gpu, &delta_ref, 1e-4);
    rep.check("adamw 3 steps: m", &dev.dtoh(&dm)?, &m, F32_TOL);
    rep.check("adamw 3 steps: v", &dev.dtoh(&dv)?, &v, F32_TOL);
    Ok(())
}

fn check_casts(dev: &Device, rng: &mut Rng, rep: &mut Report) -> Res<()> {
    let n = 100_000;
    let x = rng.vec(n, 100.0);
    let mut b = dev.alloc::<bf16>(n)?;
    dev.cast_f32_to_bf16(&dev.htod(&x)?, &mut b)?;
    let gpu = dev.dtoh(&b)?;
    let cpu = convert::f32_vec_to_bf16(&x);
    let mismatches = gpu.iter().zip(&cpu).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
    rep.pass(&format!("cast f32->bf16 (bit-exact vs CPU, {mismatches} differ)"), mismatches == 0);
    let mut back = dev.alloc::<f32>(n)?;
    dev.cast_bf16_to_f32(&b, &mut back)?;
    rep.check("cast bf16->f32 (exact)", &dev.dtoh(&back)?, &cpu.iter().map(|v| v.to_f64()).collect::<Vec<_>>(), 0.0);
    Ok(())
}

fn check_attention(dev: &Device, rng: &mut Rng, rep: &mut Report) -> Res<()> {
    let shapes = [
        (64, false, 3, 200, 200),
        (64, true, 3, 200, 200),
        (64, false, 2, 150, 97),
        (64, true, 2, 300, 300),
        (64, false, 2, 300, 300),
        (128, false, 2, 150, 97),
        (128, true, 2, 130, 130),
    ];
    for &(d, causal, heads, tq, tk) in &shapes {
        let scale = 1.0 / (d as f64).sqrt();
        let q = rng.vec(heads * tq * d, 1.5);
        let k = rng.vec(heads * tk * d, 1.5);
        let v = rng.vec(heads * tk * d, 1.0);
        let dout = rng.vec(heads * tq * d, 1.0);
        let (q64, k64, v64, g64) = (f64v(&q), f64v(&k), f64v(&v), f64v(&dout));
        let oq: Vec<usize> = (0..heads).map(|h| h * tq * d).collect();
        let ok: Vec<usize> = (0..heads).map(|h| h * tk * d).collect();
        let spec = AttentionSpec { tq, tk, d, dv: d, causal, scale };
        let (hq, hk, hv) = (
            Heads { data: &q64, offsets: &oq, row_stride: d },
            Heads { data: &k64, offsets: &ok, row_stride: d },
            Heads { data: &v64, offsets: &ok, row_stride: d },
        );
        let (mut out64, mut probs) = (vec![0.0; heads * tq * d], vec![0.0; heads * tq * tk]);
        attention_forward(spec, hq, hk, hv, &mut out64, &mut probs)?;
        let (mut dq64, mut dk64, mut dv64) = (vec![0.0; heads * tq * d], vec![0.0; heads * tk * d], vec![0.0; heads * tk * d]);
        attention_backward(spec, hq, hk, hv, &probs, Heads { data: &g64, offsets: &oq, row_stride: d }, &mut dq64, &mut dk64, &mut dv64)?;

        let fs = FlashSpec { heads, tq, tk, d, causal, scale: scale as f32 };
        let (dq_, dk_, dv_, dg) = (dev.htod(&q)?, dev.htod(&k)?, dev.htod(&v)?, dev.htod(&dout)?);
        let (mut o, mut lse) = (dev.alloc::<f32>(heads * tq * d)?, dev.alloc::<f32>(heads * tq)?);
        dev.flash_attention_forward(fs, &dq_, &dk_, &dv_, &mut o, &mut lse)?;
        let tag = format!("d{d} {} {heads}x{tq}x{tk}", if causal { "causal" } else { "full" });
        rep.check(&format!("flash attention forward {tag}"), &dev.dtoh(&o)?, &out64, F32_TOL);
        let (mut gq, mut gk, mut gv) = (dev.alloc::<f32>(heads * tq * d)?, dev.alloc::<f32>(heads * tk * d)?, dev.alloc::<f32>(heads * tk * d)?);
        dev.flash_attention_backward(fs, &dq_, &dk_, &dv_, &o, &lse, &dg, &mut gq, &mut gk, &mut gv)?;
        rep.check(&format!("flash attention dq {tag}"), &dev.dtoh(&gq)?, &dq64, F32_TOL);
        rep.check(&format!("flash attention dk {tag}"), &dev.dtoh(&gk)?, &dk64, F32_TOL);
        rep.check(&format!("flash attention dv {tag}"), &dev.dtoh(&gv)?, &dv64, F32_TOL);
        // bf16 tensor-core forward against the f64 reference on the same rounded inputs.
        let (qb, kb, vb) = (convert::f32_vec_to_bf16(&q), convert::f32_vec_to_bf16(&k), convert::f32_vec_to_bf16(&v));
        let widen = |x: &[bf16]| x.iter().map(|v| v.to_f64()).collect::<Vec<f64>>();
        let (qr, kr, vr) = (widen(&qb), widen(&kb), widen(&vb));
        let (hq, hk, hv) = (
            Heads { data: &qr, offsets: &oq, row_stride: d },
            Heads { data: &kr, offsets: &ok, row_stride: d },
            Heads { data: &vr, offsets: &ok, row_stride: d },
        );
        attention_forward(spec, hq, hk, hv, &mut out64, &mut probs)?;
        let mut ob = dev.alloc::<bf16>(heads * tq * d)?;
        dev.flash_attention_forward_bf16(fs, &dev.htod(&qb)?, &dev.htod(&kb)?, &dev.htod(&vb)?, &mut ob, &mut lse)?;
        rep.check(&format!("flash attention bf16 forward {tag}"), &convert::bf16_vec_to_f32(&dev.dtoh(&ob)?), &out64, BF16_TOL);
        if d == 64 {
            // The 4- and 16-warp forms give the same bits as the default 8-warp one (rows do not
            // share sums).
            let (wide, wide_lse) = (dev.dtoh(&ob)?, dev.dtoh(&lse)?);
            for rows in [64, 256] {
                dev.set_flash_forward_bf16_rows(rows);
                dev.flash_attention_forward_bf16(fs, &dev.htod(&qb)?, &dev.htod(&kb)?, &dev.htod(&vb)?, &mut ob, &mut lse)?;
                rep.pass(&format!("flash attention bf16 forward {rows} rows = 128 rows {tag}"), dev.dtoh(&ob)? == wide && dev.dtoh(&lse)? == wide_lse);
            }
            dev.set_flash_forward_bf16_rows(0);
        }
        let gb = convert::f32_vec_to_bf16(&dout);
        let gr = widen(&gb);
        attention_backward(spec, hq, hk, hv, &probs, Heads { data: &gr, offsets: &oq, row_stride: d }, &mut dq64, &mut dk64, &mut dv64)?;
        let (dqb, dkb, dvb) = (dev.htod(&qb)?, dev.htod(&kb)?, dev.htod(&vb)?);
        dev.flash_attention_forward_bf16(fs, &dqb, &dkb, &dvb, &mut ob, &mut lse)?;
        let gbd = dev.htod(&gb)?;
        for keys in backward_keys(d) {
            dev.set_flash_backward_bf16_keys(keys);
            let tag = format!("{tag} k{keys}");
            let [gq, gk, gv] = bf16_backward_heads(dev, fs, [&dqb, &dkb, &dvb], &ob, &lse, &gbd)?;
            rep.check(&format!("flash attention bf16 dq {tag}"), &gq, &dq64, BF16_TOL);
            rep.check(&format!("flash attention bf16 dk {tag}"), &gk, &dk64, BF16_TOL);
            rep.check(&format!("flash attention bf16 dv {tag}"), &gv, &dv64, BF16_TOL);
            // The same backward again must give the same bits (ordered dQ accumulation).
            let again = bf16_backward_heads(dev, fs, [&dqb, &dkb, &dvb], &ob, &lse, &gbd)?;
            rep.pass(&format!("flash attention bf16 bwd bit-identical rerun {tag}"), again == [gq, gk, gv]);
        }
        dev.set_flash_backward_bf16_keys(0);
    }
    check_attention_packed(dev, rng, rep)
}

/// The bf16 backward's keys per block to check at head dim `d`: both forms at 64, the one
/// form otherwise.
fn backward_keys(d: usize) -> Vec<usize> {
    if d == 64 {
        vec![64, 128, 256]
    } else {
        vec![64]
    }
}

/// The bf16 backward on contiguous `[heads, t, d]` operands; returns dQ, dK, dV widened to f32.
/// The gradients share one `[heads, max(tq, tk), 3·d]` buffer (dQ, dK, dV side by side in each
/// row), which also exercises the strided gradient layouts.
fn bf16_backward_heads(dev: &Device, fs: FlashSpec, qkv: [&Buffer<bf16>; 3], out: &Buffer<bf16>, lse: &Buffer<f32>, dout: &Buffer<bf16>) -> Res<[Vec<f32>; 3]> {
    let FlashSpec { heads, tq, tk, d, .. } = fs;
    let (lq, lk) = (fs.heads_layout(tq), fs.heads_layout(tk));
    let side = |t: usize, s: usize| HeadLayout { row_stride: 3 * d, col_offset: s * d, ..fs.heads_layout(t) };
    let mut grads = dev.alloc::<bf16>(heads * tq.max(tk) * 3 * d)?;
    dev.flash_attention_backward_bf16(
        fs,
        (qkv[0], lq),
        (qkv[1], lk),
        (qkv[2], lk),
        (out, lq),
        lse,
        (dout, lq),
        &mut grads,
        [side(tq, 0), side(tk, 1), side(tk, 2)],
    )?;
    let all = convert::bf16_vec_to_f32(&dev.dtoh(&grads)?);
    let pick = |t: usize, s: usize| -> Vec<f32> { (0..heads * t).flat_map(|r| all[r * 3 * d + s * d..r * 3 * d + (s + 1) * d].iter().copied()).collect() };
    Ok([pick(tq, 0), pick(tk, 1), pick(tk, 2)])
}

/// The bf16 forward and backward reading Q, K, V in place from packed `[B, T, 3·C]` rows and
/// writing O into `[B, T, C]` and the gradients into packed `[B, T, 3·C]` must give exactly the
/// bits of the contiguous head-major path.
fn check_attention_packed(dev: &Device, rng: &mut Rng, rep: &mut Report) -> Res<()> {
    for &(d, causal, b, h, t) in &[(64, true, 2, 3, 200), (64, false, 2, 2, 130), (128, true, 1, 2, 96)] {
        let c = h * d;
        let fs = FlashSpec { heads: b * h, tq: t, tk: t, d, causal, scale: 1.0 / (d as f32).sqrt() };
        let packed = convert::f32_vec_to_bf16(&rng.vec(b * t * 3 * c, 1.5));
        let gmerged = convert::f32_vec_to_bf16(&rng.vec(b * t * c, 1.0));
        let part = |s: usize| HeadLayout { batch: b, seq: t, heads: h, head_dim: d, row_stride: 3 * c, col_offset: s * c };
        let merged = HeadLayout { batch: b, seq: t, heads: h, head_dim: d, row_stride: c, col_offset: 0 };
        // Strided: in place.
        let (pd, gd) = (dev.htod(&packed)?, dev.htod(&gmerged)?);
        let (mut y, mut lse) = (dev.alloc::<bf16>(b * t * c)?, dev.alloc::<f32>(b * h * t)?);
        dev.flash_attention_forward_bf16_strided(fs, (&pd, part(0)), (&pd, part(1)), (&pd, part(2)), (&mut y, merged), &mut lse)?;
        for keys in backward_keys(d) {
            dev.set_flash_backward_bf16_keys(keys);
            let mut dqkv = dev.alloc::<bf16>(b * t * 3 * c)?;
            dev.flash_attention_backward_bf16(
                fs,
                (&pd, part(0)),
                (&pd, part(1)),
                (&pd, part(2)),
                (&y, merged),
                &lse,
                (&gd, merged),
                &mut dqkv,
                [part(0), part(1), part(2)],
            )?;
            let (y_rows, g_rows) = (dev.dtoh(&y)?, dev.dtoh(&dqkv)?);
            // Head-major: copies on the host.
            let to_heads = |src: &[bf16], stride: usize, off: usize| -> Vec<bf16> {
                let mut out = Vec::with_capacity(b * h * t * d);
                for bi in 0..b {
                    for hi in 0..h {
                        for ti in 0..t {
                            let row = (bi * t + ti) * stride + off + hi * d;
                            out.extend_from_slice(&src[row..row + d]);
                        }
                    }
                }
                out
            };
            let (q, k, v) = (dev.htod(&to_heads(&packed, 3 * c, 0))?, dev.htod(&to_heads(&packed, 3 * c, c))?, dev.htod(&to_heads(&packed, 3 * c, 2 * c))?);
            let mut o = dev.alloc::<bf16>(b * h * t * d)?;
            dev.flash_attention_forward_bf16(fs, &q, &k, &v, &mut o, &mut lse)?;
            let go = dev.htod(&to_heads(&gmerged, c, 0))?;
            let grads = bf16_backward_heads(dev, fs, [&q, &k, &v], &o, &lse, &go)?;
            let tag = format!("d{d} {} {b}x{h}x{t} k{keys}", if causal { "causal" } else { "full" });
            let same = |x: &[bf16], y: &[bf16]| x.iter().zip(y).all(|(a, b)| a.to_bits() == b.to_bits());
            rep.pass(&format!("flash attention bf16 packed fwd = heads {tag}"), same(&to_heads(&y_rows, c, 0), &dev.dtoh(&o)?));
            let ok = (0..3).all(|s| convert::bf16_vec_to_f32(&to_heads(&g_rows, 3 * c, s * c)) == grads[s]);
            rep.pass(&format!("flash attention bf16 packed bwd = heads {tag}"), ok);
        }
    }
    dev.set_flash_backward_bf16_keys(0);
    Ok(())
}

/// Raw cuBLAS `cublasGemmEx` on a handle of its own, for the wrapper-overhead ratio.
fn raw_gemm(handle: bsys::cublasHandle_t, n: usize, a: u64, b: u64, c: u64, ty: bsys::cudaDataType, compute: bsys::cublasComputeType_t) -> Res<()> {
    let (alpha, beta) = (1.0f32, 0.0f32);
    let n = n as i32;
    // SAFETY: a, b, c are n×n buffers of type `ty` on the same device and stream.
    unsafe {
        blas::gemm_ex(
            handle,
            bsys::cublasOperation_t::CUBLAS_OP_N,
            bsys::cublasOperation_t::CUBLAS_OP_N,
            n,
            n,
            n,
            &alpha as *const f32 as *const c_void,
            a as *const c_void,
            ty,
            n,
            b as *const c_void,
            ty,
            n,
            &beta as *const f32 as *const c_void,
            c as *mut c_void,
            ty,
            n,
            compute,
            bsys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )?;
    }
    Ok(())
}

fn benchmarks(dev: &Device, rng: &mut Rng, rep: &mut Report) -> Res<()> {
    let n = 4096;
    let iters = 50;
    let g = Gemm::new(n, n, n);
    let raw = CudaBlas::new(dev.stream().clone())?;
    let x = rng.vec(n * n, 1.0);
    let y = rng.vec(n * n, 1.0);
    {
        let (a, b) = (dev.htod(&convert::f32_vec_to_bf16(&x))?, dev.htod(&convert::f32_vec_to_bf16(&y))?);
        let mut c = dev.alloc::<bf16>(n * n)?;
        let ours = dev.time_ms(iters, || dev.gemm(&g, &a, &b, &mut c))?;
        let (ap, bp, cp) = (a.device_ptr(), b.device_ptr(), c.device_ptr());
        let rawt = dev.time_ms(iters, || {
            raw_gemm(*raw.handle(), n, bp, ap, cp, bsys::cudaDataType::CUDA_R_16BF, bsys::cublasComputeType_t::CUBLAS_COMPUTE_32F)
                .map_err(|e| rtx_kernels::cuda::CudaError::Unsupported { op: "raw", what: e.to_string() })
        })?;
        let tf = |ms: f64| g.flops() / ms / 1e9;
        rep.bench("gemm bf16 4096³ (ours)", format!("{:.0} TFLOP/s ({ours:.3} ms)", tf(ours)));
        rep.bench("gemm bf16 4096³ (raw cublasGemmEx)", format!("{:.0} TFLOP/s ({rawt:.3} ms); ours/raw = {:.3}", tf(rawt), rawt / ours));
    }
    {
        let (a, b) = (dev.htod(&x)?, dev.htod(&y)?);
        let mut c = dev.alloc::<f32>(n * n)?;
        let tf = |ms: f64| g.flops() / ms / 1e9;
        let gt = Gemm { math: GemmMath::Tf32, ..g };
        let ours = dev.time_ms(iters, || dev.gemm(&gt, &a, &b, &mut c))?;
        let (ap, bp, cp) = (a.device_ptr(), b.device_ptr(), c.device_ptr());
        let rawt = dev.time_ms(iters, || {
            raw_gemm(*raw.handle(), n, bp, ap, cp, bsys::cudaDataType::CUDA_R_32F, bsys::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32)
                .map_err(|e| rtx_kernels::cuda::CudaError::Unsupported { op: "raw", what: e.to_string() })
        })?;
        rep.bench("gemm tf32 4096³ (ours)", format!("{:.0} TFLOP/s ({ours:.3} ms)", tf(ours)));
        rep.bench("gemm tf32 4096³ (raw cublasGemmEx)", format!("{:.0} TFLOP/s ({rawt:.3} ms); ours/raw = {:.3}", tf(rawt), rawt / ours));
        let f32t = dev.time_ms(10, || dev.gemm(&g, &a, &b, &mut c))?;
        rep.bench("gemm f32 4096³ (ours)", format!("{:.1} TFLOP/s ({f32t:.3} ms)", tf(f32t)));
        // Batched: 48 heads of 1024×1024×64 (attention-shaped).
        let gb = Gemm { batch: 48, math: GemmMath::F32, ..Gemm::new(1024, 1024, 64) };
        let (ab, bb) = (dev.htod(&convert::f32_vec_to_bf16(&x[..48 * 1024 * 64]))?, dev.htod(&convert::f32_vec_to_bf16(&y[..48 * 64 * 1024]))?);
        let mut cb = dev.alloc::<bf16>(48 * 1024 * 1024)?;
        let t = dev.time_ms(iters, || dev.gemm(&gb, &ab, &bb, &mut cb))?;
        rep.bench("gemm bf16 batched 48×1024×1024×64", format!("{:.0} TFLOP/s ({t:.3} ms)", gb.flops() / t / 1e9));
    }
    // Memory bandwidth: device-to-device copy and an elementwise add, 1 GiB each way.
    {
        let len = 256 << 20;
        let a = dev.alloc::<f32>(len)?;
        let b = dev.alloc::<f32>(len)?;
        let mut c = dev.alloc::<f32>(len)?;
        dev.memset_zero(&a)?;
        dev.memset_zero(&b)?;
        let t = dev.time_ms(10, || dev.copy_dtod(&a, &mut c))?;
        rep.bench("copy d2d 1 GiB (read+write)", format!("{:.2} TB/s", 2.0 * (len * 4) as f64 / t / 1e9));
        let t = dev.time_ms(10, || dev.binary(BinaryOp::Add, &a, &b, &mut c))?;
        rep.bench("binary add 3×1 GiB", format!("{:.2} TB/s", 3.0 * (len * 4) as f64 / t / 1e9));
        let t = dev.time_ms(10, || dev.unary(UnaryOp::GeluTanh, &a, &mut c))?;
        rep.bench("gelu 2×1 GiB", format!("{:.2} TB/s", 2.0 * (len * 4) as f64 / t / 1e9));
    }
    // Host copies.
    {
        let len = 64 << 20;
        let host = rng.vec(len, 1.0);
        let mut d = dev.alloc::<f32>(len)?;
        let t = Instant::now();
        dev.copy_htod(&host, &mut d)?;
        let s = t.elapsed().as_secs_f64();
        rep.bench("htod 256 MiB pageable (via pinned staging)", format!("{:.1} GB/s", (len * 4) as f64 / s / 1e9));
        let mut pinned = dev.alloc_pinned::<f32>(len)?;
        pinned.as_mut_slice().copy_from_slice(&host);
        let t = Instant::now();
        dev.copy_pinned_htod(&pinned, &mut d)?;
        let s = t.elapsed().as_secs_f64();
        rep.bench("htod 256 MiB from pinned", format!("{:.1} GB/s", (len * 4) as f64 / s / 1e9));
        let t = Instant::now();
        dev.copy_dtoh_pinned(&d, &mut pinned)?;
        let s = t.elapsed().as_secs_f64();
        rep.bench("dtoh 256 MiB into pinned", format!("{:.1} GB/s", (len * 4) as f64 / s / 1e9));
    }
    Ok(())
}

/// Flash attention at GPT-2 shapes: f32, and bf16 on tensor cores (with the backward's timing
/// probes, and a full-size bit-identical rerun check).
fn bench_attention(dev: &Device, rng: &mut Rng, rep: &mut Report) -> Res<()> {
    // `GPU_CHECK_ATTN_SHAPES=1` times only the first (GPT-2) shape, for profiler runs.
    let shapes: &[(usize, usize, usize)] = if std::env::var("GPU_CHECK_ATTN_SHAPES").is_ok_and(|v| v == "1") {
        &[(16 * 12, 1024, 64)]
    } else {
        &[(16 * 12, 1024, 64), (4 * 12, 4096, 64), (16 * 6, 1024, 128)]
    };
    for &(batch_heads, t, d) in shapes {
        for causal in [true, false] {
            let fs = FlashSpec { heads: batch_heads, tq: t, tk: t, d, causal, scale: 1.0 / (d as f32).sqrt() };
            let len = batch_heads * t * d;
            let q = dev.htod(&rng.vec(len, 1.0))?;
            let k = dev.htod(&rng.vec(len, 1.0))?;
            let v = dev.htod(&rng.vec(len, 1.0))?;
            let go = dev.htod(&rng.vec(len, 1.0))?;
            let (mut o, mut lse) = (dev.alloc::<f32>(len)?, dev.alloc::<f32>(batch_heads * t)?);
            let (mut dq, mut dk, mut dv) = (dev.alloc::<f32>(len)?, dev.alloc::<f32>(len)?, dev.alloc::<f32>(len)?);
            let fwd = dev.time_ms(5, || dev.flash_attention_forward(fs, &q, &k, &v, &mut o, &mut lse))?;
            let bwd = dev.time_ms(5, || dev.flash_attention_backward(fs, &q, &k, &v, &o, &lse, &go, &mut dq, &mut dk, &mut dv))?;
            let ff = fs.forward_flops();
            let (mut qb, mut kb, mut vb, mut ob) = (dev.alloc::<bf16>(len)?, dev.alloc::<bf16>(len)?, dev.alloc::<bf16>(len)?, dev.alloc::<bf16>(len)?);
            dev.cast_f32_to_bf16(&q, &mut qb)?;
            dev.cast_f32_to_bf16(&k, &mut kb)?;
            dev.cast_f32_to_bf16(&v, &mut vb)?;
            let fb = dev.time_ms(10, || dev.flash_attention_forward_bf16(fs, &qb, &kb, &vb, &mut ob, &mut lse))?;
            let mut probes = String::new();
            if d == 64 {
                // The 4- and 16-warp forms beside the default 8-warp one.
                for rows in [64, 256] {
                    dev.set_flash_forward_bf16_rows(rows);
                    let ms = dev.time_ms(10, || dev.flash_attention_forward_bf16(fs, &qb, &kb, &vb, &mut ob, &mut lse));
                    dev.set_flash_forward_bf16_rows(0);
                    probes += &format!("; fwd {rows}-row blocks {:.3} ms", ms?);
                }
            }
            let mut gob = dev.alloc::<bf16>(len)?;
            dev.cast_f32_to_bf16(&go, &mut gob)?;
            let lh = fs.heads_layout(t);
            let side = |s: usize| HeadLayout { row_stride: 3 * d, col_offset: s * d, ..lh };
            let mut grads = dev.alloc::<bf16>(3 * len)?;
            let bwd_bf16 = |grads: &mut Buffer<bf16>| {
                dev.flash_attention_backward_bf16(fs, (&qb, lh), (&kb, lh), (&vb, lh), (&ob, lh), &lse, (&gob, lh), grads, [side(0), side(1), side(2)])
            };
            let bb = dev.time_ms(10, || bwd_bf16(&mut grads))?;
            if d == 64 {
                // The 4- and 16-warp forms beside the default 8-warp one.
                for keys in [64, 256] {
                    dev.set_flash_backward_bf16_keys(keys);
                    let ms = dev.time_ms(10, || bwd_bf16(&mut grads));
                    dev.set_flash_backward_bf16_keys(0);
                    probes += &format!("; bwd {keys}-key blocks {:.3} ms", ms?);
                }
            }
            for (probe, what) in [(1, "dQ unordered"), (2, "no dQ"), (4, "dQ not added"), (8, "dQ added, no products")] {
                dev.set_flash_backward_bf16_probe(probe);
                let ms = dev.time_ms(10, || bwd_bf16(&mut grads));
                dev.set_flash_backward_bf16_probe(0);
                probes += &format!("; probe {what} {:.3} ms", ms?);
            }
            // Bit-identical across runs at full size (the dQ order is fixed).
            bwd_bf16(&mut grads)?;
            let first = dev.dtoh(&grads)?;
            bwd_bf16(&mut grads)?;
            let second = dev.dtoh(&grads)?;
            let tag = format!("{}×T{t}×d{d} {}", batch_heads, if causal { "causal" } else { "full" });
            rep.pass(&format!("flash attn bf16 bwd bit-identical rerun {tag}"), first.iter().zip(&second).all(|(a, b)| a.to_bits() == b.to_bits()));
            rep.bench(
                &format!("flash attn bf16 {tag}"),
                format!("fwd {fb:.3} ms ({:.0} TFLOP/s), bwd {bb:.3} ms ({:.0} TFLOP/s at 2.5× fwd flops){probes}", ff / fb / 1e9, 2.5 * ff / bb / 1e9),
            );
            rep.bench(
                &format!("flash attn f32 {}×T{t}×d{d} {}", batch_heads, if causal { "causal" } else { "full" }),
                format!("fwd {fwd:.2} ms ({:.1} TFLOP/s), bwd {bwd:.2} ms ({:.1} TFLOP/s, 2.5× fwd flops)", ff / fwd / 1e9, 2.5 * ff / bwd / 1e9),
            );
        }
    }
    Ok(())
}
