//! Layer norm forward and backward over rows of transformer widths.

use super::values;
use criterion::{black_box, criterion_group, BenchmarkId, Criterion, Throughput};
use rtx_kernels::norm::{layer_norm_backward, layer_norm_forward};

/// (rows, width): GPT d=256 over 16×128 tokens, a wider model over fewer tokens, and the I-JEPA
/// target encoder's 128×49 tokens of width 64 (`ijepa.rs`).
const SHAPES: [(usize, usize); 3] = [(2048, 256), (512, 1024), (6272, 64)];

fn bench_layer_norm(c: &mut Criterion) {
    let mut group = c.benchmark_group("layer_norm_f32");
    group.sample_size(20);
    for &(rows, n) in &SHAPES {
        let x = values(rows * n, 6);
        let dy = values(rows * n, 7);
        let w = vec![1.0f32; n];
        let b = vec![0.0f32; n];
        let (mut y, mut dx) = (vec![0f32; rows * n], vec![0f32; rows * n]);
        let (mut mean, mut rstd) = (vec![0f32; rows], vec![0f32; rows]);
        let (mut dw, mut db) = (vec![0f32; n], vec![0f32; n]);
        group.throughput(Throughput::Elements((rows * n) as u64));
        group.bench_function(BenchmarkId::new("forward", format!("{rows}x{n}")), |bench| {
            bench.iter(|| {
                layer_norm_forward(&x, n, Some(&w), Some(&b), 1e-5, &mut y, &mut mean, &mut rstd).unwrap();
                black_box(&y);
            })
        });
        group.bench_function(BenchmarkId::new("backward", format!("{rows}x{n}")), |bench| {
            bench.iter(|| {
                layer_norm_backward(&x, n, Some(&w), &mean, &rstd, &dy, &mut dx, Some(&mut dw), Some(&mut db)).unwrap();
                black_box(&dx);
            })
        });
    }
    group.finish();
}

criterion_group!(benches, bench_layer_norm);
