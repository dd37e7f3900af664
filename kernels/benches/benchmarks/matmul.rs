//! fp32 gemm through `rtx_kernels::matmul` at square and training-shaped sizes, as FLOP
//! throughput (criterion's "elements" are multiply-adds × 2, i.e. FLOPs).

use super::values;
use criterion::{black_box, criterion_group, BenchmarkId, Criterion, Throughput};
use rtx_kernels::matmul::{matmul, Operand};

/// (m, n, k): squares, then the shapes of an MLP 784-512 layer at batch 128 and of a GPT
/// d=256 MLP up-projection over 16×128 tokens.
const SIZES: [(usize, usize, usize); 5] = [(128, 128, 128), (256, 256, 256), (512, 512, 512), (128, 512, 784), (2048, 1024, 256)];

fn bench_matmul(c: &mut Criterion) {
    let mut group = c.benchmark_group("matmul_f32");
    group.sample_size(10);
    for &(m, n, k) in &SIZES {
        let a = values(m * k, 1);
        let b = values(k * n, 2);
        let mut dst = vec![0f32; m * n];
        group.throughput(Throughput::Elements((2 * m * n * k) as u64));
        group.bench_function(BenchmarkId::from_parameter(format!("{m}x{n}x{k}")), |bench| {
            bench.iter(|| {
                matmul(m, n, k, &a, Operand::row_major(0, k), &b, Operand::row_major(0, n), &mut dst, 0, false).unwrap();
                black_box(&dst);
            })
        });
        // The weight-gradient form of backward: lhs read transposed (aᵀ·b), strides swapped.
        let at = values(k * m, 3);
        group.bench_function(BenchmarkId::new("lhs_transposed", format!("{m}x{n}x{k}")), |bench| {
            bench.iter(|| {
                let lhs = Operand { offset: 0, row_stride: 1, col_stride: m };
                matmul(m, n, k, &at, lhs, &b, Operand::row_major(0, n), &mut dst, 0, false).unwrap();
                black_box(&dst);
            })
        });
    }
    group.finish();
}

criterion_group!(benches, bench_matmul);
