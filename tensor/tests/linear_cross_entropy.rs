//! `Tensor::linear_cross_entropy` (the LM head fused with cross-entropy, in chunks of rows)
//! against the unfused `hidden.matmul(weightᵀ).cross_entropy(targets)`: loss and both gradients,
//! for every chunk size from one row to more than all rows, f64 and f32, u32 and i64 targets with
//! ignored rows, label smoothing, sum and mean; finite differences in f64; and bad input.
#![allow(clippy::unwrap_used)]

use rtx_tensor::{gradcheck, CrossEntropyOptions, DType, Error, Generator, Reduction, Tensor};

const SEED: u64 = 18;

fn randn(shape: &[usize], dtype: DType, g: &mut Generator) -> Tensor {
    Tensor::randn(shape, 0.0, 1.0, dtype, g).unwrap()
}

/// Loss, d hidden and d weight of `f(hidden, weight)` after `backward`.
fn loss_and_grads(hidden: &Tensor, weight: &Tensor, f: impl Fn(&Tensor, &Tensor) -> Tensor) -> (f64, Vec<f64>, Vec<f64>) {
    let (h, w) = (hidden.detach().requires_grad(true), weight.detach().requires_grad(true));
    let loss = f(&h, &w);
    loss.backward().unwrap();
    (loss.to_f64_vec().unwrap()[0], h.grad().unwrap().to_f64_vec().unwrap(), w.grad().unwrap().to_f64_vec().unwrap())
}

fn max_rel_diff(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(1e-30f64, |m, x| m.max(x.abs()));
    a.iter().zip(b).fold(0.0, |m, (x, y)| m.max((x - y).abs() / scale))
}

fn check_against_unfused(dtype: DType, targets: &Tensor, options: CrossEntropyOptions, tolerance: f64) {
    println!("seed {SEED}");
    let mut g = Generator::new(SEED);
    let (n, c, v) = (37, 16, 53);
    let hidden = randn(&[n, c], dtype, &mut g);
    let weight = randn(&[v, c], dtype, &mut g).mul_scalar(0.3).unwrap();
    let unfused = loss_and_grads(&hidden, &weight, |h, w| h.matmul(&w.transpose(0, 1).unwrap()).unwrap().cross_entropy(targets, options).unwrap());
    for chunk in [1, 5, 8, 36, 37, 100] {
        let fused = loss_and_grads(&hidden, &weight, |h, w| h.linear_cross_entropy(w, targets, options, chunk).unwrap());
        let loss = ((fused.0 - unfused.0) / unfused.0).abs();
        let (dh, dw) = (max_rel_diff(&fused.1, &unfused.1), max_rel_diff(&fused.2, &unfused.2));
        assert!(loss < tolerance && dh < tolerance && dw < tolerance, "{dtype:?} chunk {chunk} {options:?}: loss {loss:e}, dhidden {dh:e}, dweight {dw:e}");
    }
}

fn targets_u32(n: usize, v: u32) -> Tensor {
    Tensor::from_vec((0..n as u32).map(|i| (i * 7 + 3) % v).collect::<Vec<_>>(), &[n]).unwrap()
}

/// Every fifth row ignored (PyTorch's -100).
fn targets_i64_with_ignored(n: usize, v: i64) -> Tensor {
    Tensor::from_vec((0..n as i64).map(|i| if i % 5 == 2 { -100 } else { (i * 11 + 1) % v }).collect::<Vec<_>>(), &[n]).unwrap()
}

#[test]
fn equals_the_unfused_head_and_loss_for_every_chunk_size() {
    let mean = CrossEntropyOptions::default();
    check_against_unfused(DType::F64, &targets_u32(37, 53), mean, 1e-12);
    check_against_unfused(DType::F64, &targets_i64_with_ignored(37, 53), mean, 1e-12);
    check_against_unfused(DType::F32, &targets_i64_with_ignored(37, 53), mean, 2e-5);
    let smoothed_sum = CrossEntropyOptions { label_smoothing: 0.1, reduction: Reduction::Sum, ..Default::default() };
    check_against_unfused(DType::F64, &targets_i64_with_ignored(37, 53), smoothed_sum, 1e-12);
}

#[test]
fn gradients_match_finite_differences() {
    let mut g = Generator::new(SEED);
    let targets = targets_i64_with_ignored(6, 7);
    let options = CrossEntropyOptions { label_smoothing: 0.05, ..Default::default() };
    let report = gradcheck(move |t| t[0].linear_cross_entropy(&t[1], &targets, options, 4), &[randn(&[6, 3], DType::F64, &mut g), randn(&[7, 3], DType::F64, &mut g)], 1e-6, 1e-6, SEED).unwrap();
    assert_eq!(report.checked, 6 * 3 + 7 * 3);
}

#[test]
fn a_frozen_weight_gets_no_gradient_and_every_row_ignored_is_nan_with_zero_gradient() {
    let mut g = Generator::new(SEED);
    let hidden = randn(&[4, 3], DType::F64, &mut g).requires_grad(true);
    let weight = randn(&[5, 3], DType::F64, &mut g);
    let loss = hidden.linear_cross_entropy(&weight, &targets_u32(4, 5), CrossEntropyOptions::default(), 3).unwrap();
    loss.backward().unwrap();
    assert!(hidden.grad().is_some() && weight.grad().is_none());
    let all_ignored = Tensor::from_vec(vec![-100i64; 4], &[4]).unwrap();
    let hidden = hidden.detach().requires_grad(true);
    let loss = hidden.linear_cross_entropy(&weight, &all_ignored, CrossEntropyOptions::default(), 3).unwrap();
    assert!(loss.to_f64_vec().unwrap()[0].is_nan());
    loss.backward().unwrap();
    assert!(hidden.grad().unwrap().to_f64_vec().unwrap().iter().all(|&x| x == 0.0));
}

#[test]
fn bad_input_is_a_typed_error_naming_the_op() {
    let mut g = Generator::new(SEED);
    let hidden = randn(&[4, 3], DType::F32, &mut g);
    let weight = randn(&[5, 3], DType::F32, &mut g);
    let targets = targets_u32(4, 5);
    let opts = CrossEntropyOptions::default();
    let cases: Vec<(Result<Tensor, Error>, &str)> = vec![
        (hidden.linear_cross_entropy(&randn(&[5, 2], DType::F32, &mut g), &targets, opts, 2), "[4, 3]"),
        (hidden.linear_cross_entropy(&weight, &targets_u32(3, 5), opts, 2), "[3]"),
        (hidden.linear_cross_entropy(&weight.to_dtype(DType::F64).unwrap(), &targets, opts, 2), "F64"),
        (hidden.linear_cross_entropy(&weight, &targets, opts, 0), "chunk_rows"),
        (hidden.linear_cross_entropy(&weight, &targets, CrossEntropyOptions { reduction: Reduction::None, ..opts }, 2), "per-row"),
        (hidden.linear_cross_entropy(&weight, &targets, CrossEntropyOptions { label_smoothing: 1.0, ..opts }, 2), "label_smoothing"),
        (hidden.linear_cross_entropy(&weight, &Tensor::from_vec(vec![7u32, 0, 0, 0], &[4]).unwrap(), opts, 2), "7"),
    ];
    for (result, names) in cases {
        let message = result.expect_err("bad input must be refused").to_string();
        assert!(message.contains("linear_cross_entropy") || message.contains("cross_entropy"), "{message}");
        assert!(message.contains(names), "{message} should name {names}");
    }
}

#[test]
fn padded_weight_rows_are_never_predicted_and_get_zero_gradient() {
    // Goal: `linear_cross_entropy_valid` over a padded weight equals the unpadded op over its
    // first `classes` rows, and the padding rows' gradient is exactly zero. Method: 53 classes
    // in a 64-row weight, chunks of 8 rows, f64.
    println!("seed {SEED}");
    let mut g = Generator::new(SEED);
    let (n, c, classes, padded) = (29, 12, 53, 64);
    let hidden = randn(&[n, c], DType::F64, &mut g);
    let weight = randn(&[padded, c], DType::F64, &mut g);
    let targets = targets_u32(n, classes as u32);
    let options = CrossEntropyOptions::default();
    let fused = loss_and_grads(&hidden, &weight, |h, w| h.linear_cross_entropy_valid(w, &targets, classes, options, 8).unwrap());
    let plain = loss_and_grads(&hidden, &weight.narrow(0, 0, classes).unwrap().contiguous().unwrap(), |h, w| h.linear_cross_entropy(w, &targets, options, 8).unwrap());
    assert!((fused.0 - plain.0).abs() < 1e-12, "loss {} vs {}", fused.0, plain.0);
    assert!(max_rel_diff(&fused.1, &plain.1) < 1e-12);
    assert!(max_rel_diff(&fused.2[..classes * c], &plain.2) < 1e-12);
    assert!(fused.2[classes * c..].iter().all(|&x| x == 0.0), "padding rows got a gradient");
    // A target in the padding is refused, as is a class count outside the weight.
    let bad = Tensor::from_vec(vec![0u32, 60], &[2]).unwrap();
    let h2 = hidden.narrow(0, 0, 2).unwrap();
    assert!(h2.linear_cross_entropy_valid(&weight, &bad, classes, options, 8).is_err());
    assert!(matches!(hidden.linear_cross_entropy_valid(&weight, &targets, padded + 1, options, 8), Err(Error::InvalidArgument { .. })));
    assert!(matches!(hidden.linear_cross_entropy_valid(&weight, &targets, 0, options, 8), Err(Error::InvalidArgument { .. })));
}
