//! Row softmax forward and backward over attention-score-shaped and vocabulary-shaped rows.

use super::values;
use criterion::{black_box, criterion_group, BenchmarkId, Criterion, Throughput};
use rtx_kernels::softmax::{softmax_backward_rows, softmax_rows};

/// (rows, cols): GPT attention scores (16 batch × 4 heads × 128 queries, 128 keys), byte-vocab
/// logits (16×128 tokens, 256 classes), and a few long rows.
const SHAPES: [(usize, usize); 3] = [(8192, 128), (2048, 256), (64, 8192)];

fn bench_softmax(c: &mut Criterion) {
    let mut group = c.benchmark_group("softmax_rows_f32");
    group.sample_size(20);
    for &(rows, cols) in &SHAPES {
        let x = values(rows * cols, 4);
        let dy = values(rows * cols, 5);
        let mut y = vec![0f32; rows * cols];
        let mut dx = vec![0f32; rows * cols];
        group.throughput(Throughput::Elements((rows * cols) as u64));
        group.bench_function(BenchmarkId::new("forward", format!("{rows}x{cols}")), |bench| {
            bench.iter(|| {
                softmax_rows(&x, cols, &mut y).unwrap();
                black_box(&y);
            })
        });
        softmax_rows(&x, cols, &mut y).unwrap();
        group.bench_function(BenchmarkId::new("backward", format!("{rows}x{cols}")), |bench| {
            bench.iter(|| {
                softmax_backward_rows(&y, &dy, cols, &mut dx).unwrap();
                black_box(&dx);
            })
        });
    }
    group.finish();
}

criterion_group!(benches, bench_softmax);
