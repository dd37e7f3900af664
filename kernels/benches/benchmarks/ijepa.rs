//! The CPU kernels at the shapes of one I-JEPA step of `configs/ijepa_fashion.toml` (batch 128,
//! ViT width 64 with 4 heads of 16 over 49 patches; 20 context tokens; predictor width 48), so
//! the step's thread scaling (`rtx bench step --model ijepa` at `RTX_NUM_THREADS` 2-16) can be
//! taken apart kernel by kernel: linear forwards, the backward's input- and weight-gradient
//! products, and packed attention forward and backward (layer norm at the step's 6,272 x 64 is in
//! `norm.rs`).

use super::values;
use criterion::{black_box, criterion_group, BenchmarkId, Criterion, Throughput};
use rtx_kernels::attention::{attention_backward_packed, attention_forward_packed, packed_probs_len, AttentionSpec};
use rtx_kernels::matmul::{linear, matmul, Operand};

const BATCH: usize = 128;
/// Token rows: the target encoder sees all 49 patches of each image, the context encoder 20.
const TARGET_ROWS: usize = BATCH * 49;
const CONTEXT_ROWS: usize = BATCH * 20;

/// (rows, n_in, n_out): qkv, MLP up and MLP down of the target encoder; qkv of the context
/// encoder.
const LINEAR: [(usize, usize, usize); 4] = [(TARGET_ROWS, 64, 192), (TARGET_ROWS, 64, 256), (TARGET_ROWS, 256, 64), (CONTEXT_ROWS, 64, 192)];

fn bench_linear_and_grads(c: &mut Criterion) {
    let mut group = c.benchmark_group("ijepa_matmul_f32");
    group.sample_size(10);
    for &(rows, n_in, n_out) in &LINEAR {
        let x = values(rows * n_in, 1);
        let w = values(n_out * n_in, 2);
        let bias = values(n_out, 3);
        let dy = values(rows * n_out, 4);
        let mut out = vec![0f32; rows * n_out];
        let mut dx = vec![0f32; rows * n_in];
        let mut dw = vec![0f32; n_out * n_in];
        let flops = (2 * rows * n_in * n_out) as u64;
        let shape = format!("{rows}x{n_in}x{n_out}");
        group.throughput(Throughput::Elements(flops));
        group.bench_function(BenchmarkId::new("linear", &shape), |bench| {
            bench.iter(|| {
                linear(rows, n_in, n_out, &x, 0, &w, 0, Some(&bias), &mut out).unwrap();
                black_box(&out);
            })
        });
        // dx[rows × n_in] = dy[rows × n_out] · w[n_out × n_in].
        group.bench_function(BenchmarkId::new("input_grad", &shape), |bench| {
            bench.iter(|| {
                matmul(rows, n_in, n_out, &dy, Operand::row_major(0, n_out), &w, Operand::row_major(0, n_in), &mut dx, 0, false).unwrap();
                black_box(&dx);
            })
        });
        // dw[n_out × n_in] += dyᵀ · x: k = rows, the lhs read transposed.
        group.bench_function(BenchmarkId::new("weight_grad", &shape), |bench| {
            bench.iter(|| {
                let lhs = Operand { offset: 0, row_stride: 1, col_stride: n_out };
                matmul(n_out, n_in, rows, &dy, lhs, &x, Operand::row_major(0, n_in), &mut dw, 0, true).unwrap();
                black_box(&dw);
            })
        });
    }
    group.finish();
}

fn bench_attention(c: &mut Criterion) {
    let mut group = c.benchmark_group("ijepa_attention_f32");
    group.sample_size(10);
    let heads = 4;
    for (name, t) in [("target", 49), ("context", 20)] {
        let d = 16;
        let spec = AttentionSpec { tq: t, tk: t, d, dv: d, causal: false, scale: 1.0 / (d as f64).sqrt() };
        let qkv = values(BATCH * t * 3 * heads * d, 5);
        let dout = values(BATCH * t * heads * d, 6);
        let mut out = vec![0f32; BATCH * t * heads * d];
        let mut probs = vec![0f32; packed_probs_len(&spec, BATCH, heads)];
        let mut dqkv = vec![0f32; qkv.len()];
        group.throughput(Throughput::Elements((BATCH * heads * t * t * d * 4) as u64));
        group.bench_function(BenchmarkId::new("forward", name), |bench| {
            bench.iter(|| {
                attention_forward_packed(spec, &qkv, BATCH, heads, &mut out, &mut probs).unwrap();
                black_box(&out);
            })
        });
        attention_forward_packed(spec, &qkv, BATCH, heads, &mut out, &mut probs).unwrap();
        group.bench_function(BenchmarkId::new("backward", name), |bench| {
            bench.iter(|| {
                attention_backward_packed(spec, &qkv, BATCH, heads, &probs, &dout, &mut dqkv).unwrap();
                black_box(&dqkv);
            })
        });
    }
    group.finish();
}

criterion_group!(benches, bench_linear_and_grads, bench_attention);
