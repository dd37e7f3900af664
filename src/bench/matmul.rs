//! `rtx bench matmul`: fp32 GFLOP/s of `[m×k]·[k×n]` at 1024³ and 4096×4096×1024.
//!
//! Two figures per shape: `tensor` times [`Tensor::matmul`] as a user calls it (fresh output
//! every call), `kernel` times [`rtx_kernels::matmul::matmul`] into a reused output buffer, so
//! the difference is the cost of allocating and first-touching the output.

use super::timing::measure;
use super::{emit, threads};
use rtx_kernels::matmul::{matmul, Operand};
use rtx_tensor::{DType, Generator, Tensor};

/// Arguments of `rtx bench matmul`.
#[derive(clap::Args, Debug, Clone)]
pub struct MatmulArgs {
    /// Untimed runs before timing.
    #[arg(long, default_value_t = 2)]
    pub warmup: usize,
    /// Timed runs; the median is reported.
    #[arg(long, default_value_t = 7)]
    pub repeats: usize,
    /// Shapes as MxNxK (lhs M×K, rhs K×N), comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1024x1024x1024,4096x4096x1024", value_parser = parse_shapes)]
    pub shapes: Vec<(usize, usize, usize)>,
}

fn parse_shapes(s: &str) -> Result<(usize, usize, usize), String> {
    let dims: Vec<usize> = s.split('x').map(|d| d.trim().parse::<usize>().map_err(|e| format!("bad dimension {d:?} in {s:?}: {e}"))).collect::<Result<_, _>>()?;
    match dims[..] {
        [m, n, k] if m > 0 && n > 0 && k > 0 => Ok((m, n, k)),
        _ => Err(format!("shape {s:?} is not MxNxK with positive dimensions")),
    }
}

pub(crate) fn run(args: &MatmulArgs) -> anyhow::Result<()> {
    let threads = threads();
    let mut rng = Generator::new(0);
    for &(m, n, k) in &args.shapes {
        let a = Tensor::randn(&[m, k], 0.0, 1.0, DType::F32, &mut rng)?;
        let b = Tensor::randn(&[k, n], 0.0, 1.0, DType::F32, &mut rng)?;
        let flop = 2.0 * (m * n * k) as f64;
        let shape = format!("{m}x{n}x{k}");

        let tensor_stats = measure(args.warmup, args.repeats, || {
            let c = a.matmul(&b)?;
            std::hint::black_box(&c);
            Ok(())
        })?;
        let (av, bv) = (a.to_f32_vec()?, b.to_f32_vec()?);
        let mut dst = vec![0f32; m * n];
        let kernel_stats = measure(args.warmup, args.repeats, || {
            matmul(m, n, k, &av, Operand::row_major(0, k), &bv, Operand::row_major(0, n), &mut dst, 0, false)?;
            std::hint::black_box(&dst);
            Ok(())
        })?;
        for (variant, stats) in [("tensor", tensor_stats), ("kernel", kernel_stats)] {
            let mut obj = serde_json::Map::new();
            obj.insert("impl".into(), "rustytorch".into());
            obj.insert("bench".into(), "matmul".into());
            obj.insert("variant".into(), variant.into());
            obj.insert("shape".into(), shape.clone().into());
            obj.insert("threads".into(), threads.into());
            stats.json_fields(&mut obj);
            obj.insert("gflops".into(), super::timing::round3(flop / (stats.median_ms * 1e-3) / 1e9).into());
            emit(obj.into());
        }
    }
    Ok(())
}
