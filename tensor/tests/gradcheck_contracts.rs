//! The contracts around the differentiable ops that finite differences do not cover: typed
//! errors (shape mismatches name the op and both shapes, u32 where a float is needed is
//! `UnsupportedDType`, bad indices are `IndexOutOfRange`), bf16 forward and backward results
//! against f32 on the same (bf16-rounded) inputs, and forward values of the core ops against
//! hand-computed ones. Random inputs come from fixed seeds named in each assertion.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use rtx_tensor::{CrossEntropyOptions, DType, Error, Generator, Reduction, Result as TResult, Tensor};

fn randn(shape: &[usize], dtype: DType, g: &mut Generator) -> Tensor {
    Tensor::randn(shape, 0.0, 1.0, dtype, g).unwrap()
}

fn u32s(v: &[u32], shape: &[usize]) -> Tensor {
    Tensor::from_vec(v.to_vec(), shape).unwrap()
}

fn f32s(v: &[f32], shape: &[usize]) -> Tensor {
    Tensor::from_vec(v.to_vec(), shape).unwrap()
}

// ---------------------------------------------------------------------------------- errors

/// Asserts `result` is a shape error whose message names `op` and both shapes.
fn assert_shape_error(result: TResult<Tensor>, op: &str, lhs: &[usize], rhs: &[usize]) {
    let err = result.expect_err("expected a shape error");
    assert!(matches!(err, Error::ShapeMismatch { .. }), "{op}: expected ShapeMismatch, got {err:?}");
    let msg = err.to_string();
    for needle in [op.to_string(), format!("{lhs:?}"), format!("{rhs:?}")] {
        assert!(msg.contains(&needle), "{op}: message {msg:?} does not mention {needle}");
    }
}

#[test]
fn shape_mismatches_name_the_op_and_both_shapes() {
    // Goal: every op family reports a mismatch with its own name and both operand shapes.
    let mut g = Generator::new(1);
    let a = randn(&[2, 3], DType::F32, &mut g);
    let b = randn(&[4, 3], DType::F32, &mut g);
    assert_shape_error(a.add(&b), "add", &[2, 3], &[4, 3]);
    assert_shape_error(a.mul(&b), "mul", &[2, 3], &[4, 3]);
    assert_shape_error(a.maximum(&b), "maximum", &[2, 3], &[4, 3]);
    assert_shape_error(a.matmul(&randn(&[4, 5], DType::F32, &mut g)), "matmul", &[2, 3], &[4, 5]);
    assert_shape_error(Tensor::cat(&[&a, &randn(&[3, 4], DType::F32, &mut g)], 0), "cat", &[2, 3], &[3, 4]);
    assert_shape_error(a.mse(&b, Reduction::Mean), "mse", &[2, 3], &[4, 3]);
    assert_shape_error(a.layer_norm(Some(&randn(&[4], DType::F32, &mut g)), None, 1e-5), "layer_norm", &[2, 3], &[4]);
    assert_shape_error(a.layer_norm(None, Some(&randn(&[2], DType::F32, &mut g)), 1e-5), "layer_norm", &[2, 3], &[2]);
    assert_shape_error(a.rms_norm(Some(&randn(&[2, 3], DType::F32, &mut g)), 1e-5), "rms_norm", &[2, 3], &[2, 3]);
    assert_shape_error(a.gather(1, &u32s(&[0; 9], &[3, 3])), "gather", &[2, 3], &[3, 3]);
    assert_shape_error(a.gather(0, &u32s(&[0; 3], &[3])), "gather", &[2, 3], &[3]);
    assert_shape_error(a.cross_entropy(&u32s(&[0; 3], &[3]), CrossEntropyOptions::default()), "cross_entropy", &[2, 3], &[3]);
    assert_shape_error(Tensor::where_(&u32s(&[1, 0], &[2]), &a, &a), "where", &[2], &[2, 3]);

    let q = randn(&[2, 4, 8], DType::F32, &mut g);
    let k = randn(&[2, 5, 6], DType::F32, &mut g);
    let v = randn(&[2, 5, 8], DType::F32, &mut g);
    let sdpa = "scaled_dot_product_attention";
    assert_shape_error(Tensor::scaled_dot_product_attention(&q, &k, &v, None, false, None), sdpa, &[2, 4, 8], &[2, 5, 6]);
    let k = randn(&[2, 5, 8], DType::F32, &mut g);
    let v_short = randn(&[2, 3, 8], DType::F32, &mut g);
    assert_shape_error(Tensor::scaled_dot_product_attention(&q, &k, &v_short, None, false, None), sdpa, &[2, 5, 8], &[2, 3, 8]);
    let k_batch = randn(&[3, 5, 8], DType::F32, &mut g);
    assert_shape_error(Tensor::scaled_dot_product_attention(&q, &k_batch, &v, None, false, None), sdpa, &[2, 4, 8], &[3, 5, 8]);
    let bad_mask = u32s(&[1; 12], &[3, 4]);
    assert_shape_error(Tensor::scaled_dot_product_attention(&q, &k, &v, Some(&bad_mask), true, None), sdpa, &[2, 4, 5], &[3, 4]);
    let too_big_mask = u32s(&[1; 60], &[3, 4, 5]);
    assert_shape_error(Tensor::scaled_dot_product_attention(&q, &k, &v, Some(&too_big_mask), false, None), sdpa, &[2, 4, 5], &[3, 4, 5]);
}

#[test]
fn bad_shapes_and_arguments_are_typed_errors() {
    // Goal: malformed operands that are not a two-shape mismatch still name the op.
    let mut g = Generator::new(2);
    let a = randn(&[2, 3], DType::F32, &mut g);
    let bad_shape = |r: TResult<Tensor>, op: &str| match r {
        Err(Error::BadShape { op: o, .. }) => assert_eq!(o, op),
        other => panic!("{op}: expected BadShape, got {other:?}"),
    };
    bad_shape(Tensor::embedding(&randn(&[6], DType::F32, &mut g), &u32s(&[0], &[1])), "embedding");
    bad_shape(a.index_select(0, &u32s(&[0, 1], &[1, 2])), "index_select");
    bad_shape(Tensor::scalar(1.0, DType::F32).layer_norm(None, None, 1e-5), "layer_norm");
    bad_shape(Tensor::scaled_dot_product_attention(&randn(&[4], DType::F32, &mut g), &a, &a, None, false, None), "scaled_dot_product_attention");
    let invalid = |r: TResult<Tensor>, op: &str| match r {
        Err(Error::InvalidArgument { op: o, .. }) => assert_eq!(o, op),
        other => panic!("{op}: expected InvalidArgument, got {other:?}"),
    };
    for p in [-0.1, 1.0, 1.5, f64::NAN] {
        invalid(a.dropout(p, true, &mut g), "dropout");
    }
    invalid(a.layer_norm(None, None, -1.0), "layer_norm");
    invalid(a.rms_norm(None, f64::NAN), "rms_norm");
    invalid(Tensor::scaled_dot_product_attention(&a, &a, &a, None, false, Some(f64::INFINITY)), "scaled_dot_product_attention");
    assert!(matches!(a.index_select(2, &u32s(&[0], &[1])), Err(Error::DimOutOfRange { op: "index_select", dim: 2, rank: 2 })));
    assert!(matches!(a.gather(-3, &u32s(&[0; 6], &[2, 3])), Err(Error::DimOutOfRange { op: "gather", .. })));
}

#[test]
fn out_of_range_indices_are_errors_not_panics() {
    // Goal: each indexing op checks every index before reading.
    let w = Tensor::zeros(&[3, 2], DType::F32);
    assert!(matches!(Tensor::embedding(&w, &u32s(&[0, 3], &[2])), Err(Error::IndexOutOfRange { op: "embedding", index: 3, size: 3 })));
    assert!(matches!(w.index_select(1, &u32s(&[1, 2], &[2])), Err(Error::IndexOutOfRange { op: "index_select", index: 2, size: 2 })));
    assert!(matches!(w.gather(0, &u32s(&[0, 7], &[1, 2])), Err(Error::IndexOutOfRange { op: "gather", index: 7, size: 3 })));
}

#[test]
fn u32_where_a_float_is_needed_is_unsupported_dtype() {
    // Goal: integer tensors reaching float math fail with UnsupportedDType naming the op.
    let i = u32s(&[1, 2, 3, 4], &[2, 2]);
    let unsupported = |r: TResult<Tensor>, op: &str| match r {
        Err(Error::UnsupportedDType { op: o, dtype: DType::U32 }) => assert_eq!(o, op),
        other => panic!("{op}: expected UnsupportedDType(U32), got {other:?}"),
    };
    unsupported(i.add(&i), "add");
    unsupported(i.mul(&i), "mul");
    unsupported(i.exp(), "exp");
    unsupported(i.gelu(), "gelu");
    unsupported(i.clamp(Some(0.0), None), "clamp");
    unsupported(i.pow_scalar(2.0), "pow_scalar");
    unsupported(i.matmul(&i), "matmul");
    unsupported(i.sum(&[0], false), "sum");
    unsupported(i.var(&[0], false, 1), "var");
    unsupported(i.softmax(-1), "softmax");
    unsupported(i.log_softmax(-1), "log_softmax");
    unsupported(i.layer_norm(None, None, 1e-5), "layer_norm");
    unsupported(i.rms_norm(None, 1e-5), "rms_norm");
    unsupported(i.dropout(0.1, true, &mut Generator::new(0)), "dropout");
    unsupported(i.cross_entropy(&u32s(&[0, 1], &[2]), CrossEntropyOptions::default()), "cross_entropy");
    unsupported(Tensor::embedding(&i, &u32s(&[0], &[1])), "embedding");
    unsupported(Tensor::scaled_dot_product_attention(&i, &i, &i, None, false, None), "scaled_dot_product_attention");
    unsupported(Tensor::randn(&[2], 0.0, 1.0, DType::U32, &mut Generator::new(0)), "randn");
    // Index operands must be u32: a float index is a dtype mismatch against U32.
    let f = f32s(&[0.0, 1.0], &[2]);
    let w = Tensor::zeros(&[3, 2], DType::F32);
    assert!(matches!(Tensor::embedding(&w, &f), Err(Error::DTypeMismatch { op: "embedding", lhs: DType::F32, rhs: DType::U32 })));
    assert!(matches!(w.index_select(0, &f), Err(Error::DTypeMismatch { op: "index_select", .. })));
    let q = Tensor::zeros(&[2, 2], DType::F32);
    assert!(matches!(Tensor::scaled_dot_product_attention(&q, &q, &q, Some(&q), false, None), Err(Error::DTypeMismatch { op: "scaled_dot_product_attention", .. })));
    // Index ops themselves work on u32 data (bit-exact copies).
    assert_eq!(i.index_select(1, &u32s(&[1, 1], &[2])).unwrap().to_u32_vec().unwrap(), vec![2, 2, 4, 4]);
    assert_eq!(i.gather(0, &u32s(&[1, 0], &[1, 2])).unwrap().to_u32_vec().unwrap(), vec![3, 2]);
}

#[test]
fn mixed_dtypes_are_dtype_mismatch() {
    // Goal: operands of different float dtypes are never silently converted.
    let a = Tensor::zeros(&[2, 2], DType::F32);
    let b = Tensor::zeros(&[2, 2], DType::BF16);
    assert!(matches!(a.add(&b), Err(Error::DTypeMismatch { op: "add", lhs: DType::F32, rhs: DType::BF16 })));
    assert!(matches!(a.matmul(&b), Err(Error::DTypeMismatch { op: "matmul", .. })));
    assert!(matches!(a.layer_norm(Some(&Tensor::ones(&[2], DType::BF16)), None, 1e-5), Err(Error::DTypeMismatch { op: "layer_norm", .. })));
    assert!(matches!(Tensor::scaled_dot_product_attention(&a, &b, &a, None, false, None), Err(Error::DTypeMismatch { op: "scaled_dot_product_attention", .. })));
}

// ------------------------------------------------------------------------------------ bf16

/// Rounds f32 inputs to bf16, runs `f` on the bf16 inputs and on the same values in f32, and
/// checks the bf16 result is bf16 and within `abs + rel·|f32|` of the f32 one.
fn check_bf16(label: &str, inputs: &[Tensor], rel: f64, abs: f64, f: impl Fn(&[Tensor]) -> TResult<Tensor>) {
    let low: Vec<Tensor> = inputs.iter().map(|t| if t.dtype() == DType::F32 { t.to_dtype(DType::BF16).unwrap() } else { t.clone() }).collect();
    let wide: Vec<Tensor> = low.iter().map(|t| if t.dtype() == DType::BF16 { t.to_dtype(DType::F32).unwrap() } else { t.clone() }).collect();
    let got = f(&low).unwrap_or_else(|e| panic!("{label} (bf16): {e}"));
    let want = f(&wide).unwrap_or_else(|e| panic!("{label} (f32): {e}"));
    assert_eq!(got.dtype(), DType::BF16, "{label}: bf16 inputs give a bf16 result");
    assert_close(label, &got, &want, rel, abs);
}

fn assert_close(label: &str, got: &Tensor, want: &Tensor, rel: f64, abs: f64) {
    assert_eq!(got.shape(), want.shape(), "{label}: shapes");
    let (g, w) = (got.to_f64_vec().unwrap(), want.to_f64_vec().unwrap());
    for (i, (a, b)) in g.iter().zip(&w).enumerate() {
        assert!((a - b).abs() <= abs + rel * b.abs(), "{label}: element {i}: bf16 {a} vs f32 {b}");
    }
}

/// One bf16 rounding of the output (2⁻⁸ relative), with a little room.
const BF16_REL: f64 = 8e-3;

#[test]
fn bf16_forward_matches_f32() {
    // Goal: ops compute bf16 in f32 and round once, so they agree with f32 to bf16 precision.
    let seed = 3;
    let mut g = Generator::new(seed);
    let label = |op: &str| format!("{op} (seed {seed})");
    let x = randn(&[3, 4, 8], DType::F32, &mut g);
    let y = randn(&[3, 4, 8], DType::F32, &mut g);
    let w = randn(&[8, 5], DType::F32, &mut g);
    let ln_w = randn(&[8], DType::F32, &mut g);
    let ln_b = randn(&[8], DType::F32, &mut g);
    let xy = [x.clone(), y.clone()];
    check_bf16(&label("add"), &xy, BF16_REL, 1e-6, |t| t[0].add(&t[1]));
    check_bf16(&label("mul"), &xy, BF16_REL, 1e-6, |t| t[0].mul(&t[1]));
    check_bf16(&label("div"), &xy, BF16_REL, 1e-6, |t| t[0].div(&t[1].abs()?.add_scalar(1.0)?));
    check_bf16(&label("exp"), &xy, BF16_REL, 1e-6, |t| t[0].exp());
    check_bf16(&label("gelu"), &xy, BF16_REL, 1e-6, |t| t[0].gelu());
    check_bf16(&label("silu"), &xy, BF16_REL, 1e-6, |t| t[0].silu());
    check_bf16(&label("sigmoid"), &xy, BF16_REL, 1e-6, |t| t[0].sigmoid());
    check_bf16(&label("clamp"), &xy, BF16_REL, 1e-6, |t| t[0].clamp(Some(-0.5), Some(0.5)));
    check_bf16(&label("sum"), &xy, BF16_REL, 1e-6, |t| t[0].sum(&[0, 2], true));
    check_bf16(&label("mean"), &xy, BF16_REL, 1e-6, |t| t[0].mean(&[-1], false));
    check_bf16(&label("var"), &xy, BF16_REL, 1e-6, |t| t[0].var(&[1], false, 1));
    check_bf16(&label("max"), &xy, 0.0, 0.0, |t| t[0].max(&[2], false));
    check_bf16(&label("softmax"), &xy, BF16_REL, 1e-6, |t| t[0].softmax(1));
    check_bf16(&label("log_softmax"), &xy, BF16_REL, 1e-6, |t| t[0].log_softmax(-1));
    check_bf16(&label("matmul"), &[x.clone(), w.clone()], BF16_REL, 1e-6, |t| t[0].matmul(&t[1]));
    check_bf16(&label("matmul transposed"), &xy, BF16_REL, 1e-6, |t| t[0].matmul(&t[1].transpose(1, 2)?));
    check_bf16(&label("layer_norm"), &[x.clone(), ln_w.clone(), ln_b], BF16_REL, 1e-6, |t| t[0].layer_norm(Some(&t[1]), Some(&t[2]), 1e-5));
    check_bf16(&label("rms_norm"), &[x.clone(), ln_w], BF16_REL, 1e-6, |t| t[0].rms_norm(Some(&t[1]), 1e-6));
    check_bf16(&label("cat"), &xy, 0.0, 0.0, |t| Tensor::cat(&[&t[0], &t[1]], 1));
    let mask = u32s(&(0..96).map(|i| (i % 3 == 0) as u32).collect::<Vec<_>>(), &[3, 4, 8]);
    check_bf16(&label("masked_fill"), &xy, 0.0, 0.0, |t| t[0].masked_fill(&mask, -1.0));
    let ids = u32s(&[4, 0, 3, 3], &[2, 2]);
    check_bf16(&label("embedding"), &[w.t().unwrap().contiguous().unwrap()], 0.0, 0.0, |t| Tensor::embedding(&t[0], &ids));
    check_bf16(&label("index_select"), &xy, 0.0, 0.0, |t| t[0].index_select(2, &u32s(&[1, 1, 5], &[3])));
    check_bf16(&label("gather"), &xy, 0.0, 0.0, |t| t[0].gather(2, &u32s(&[2; 24], &[3, 4, 2])));
    check_bf16(&label("dropout"), &xy, BF16_REL, 0.0, |t| t[0].dropout(0.3, true, &mut Generator::new(9)));
    let targets = u32s(&[0, 1, 7, 2, 3, 3, 4, 5, 6, 7, 1, 0], &[3, 4]);
    let opts = CrossEntropyOptions { ignore_index: Some(7), label_smoothing: 0.1, reduction: Reduction::Mean };
    check_bf16(&label("cross_entropy"), &xy, BF16_REL, 1e-6, |t| t[0].cross_entropy(&targets, opts));
    // Attention chains several roundings (scaled q, scores, probabilities, output).
    let mask = u32s(&[1, 1, 1, 0], &[4]);
    check_bf16(&label("scaled_dot_product_attention"), &[x, y.clone(), y], 4e-2, 2e-2, |t| Tensor::scaled_dot_product_attention(&t[0], &t[1], &t[2], Some(&mask), true, None));
}

#[test]
fn bf16_backward_matches_f32() {
    // Goal: a bf16 graph back-propagates bf16 gradients close to the f32 ones.
    let seed = 4;
    let mut g = Generator::new(seed);
    let inputs = [randn(&[4, 6], DType::F32, &mut g), randn(&[6, 6], DType::F32, &mut g), randn(&[6], DType::F32, &mut g)];
    let grads = |dtype: DType| -> Vec<Tensor> {
        let leaves: Vec<Tensor> = inputs.iter().map(|t| t.to_dtype(DType::BF16).unwrap().to_dtype(dtype).unwrap().requires_grad(true)).collect();
        let h = leaves[0].matmul(&leaves[1]).unwrap().layer_norm(Some(&leaves[2]), None, 1e-5).unwrap().gelu().unwrap();
        h.mean_all().unwrap().backward().unwrap();
        leaves.iter().map(|l| l.grad().unwrap()).collect()
    };
    let (low, wide) = (grads(DType::BF16), grads(DType::F32));
    for (i, (a, b)) in low.iter().zip(&wide).enumerate() {
        assert_eq!(a.dtype(), DType::BF16, "grad {i} dtype (seed {seed})");
        let scale = b.abs().unwrap().max(&[], false).unwrap().item().unwrap();
        assert_close(&format!("grad {i} (seed {seed})"), a, b, 0.0, 3e-2 * scale);
    }
}

// ------------------------------------------------------------------------- forward values

#[test]
fn core_ops_forward_values() {
    // Goal: the ops the nn modules lean on give torch's values on small hand-checked inputs.
    let x = f32s(&[1.0, -2.0, 3.0, 3.0, 0.5, -4.0], &[2, 3]);
    assert_eq!(x.argmax(1, false).unwrap().to_u32_vec().unwrap(), vec![2, 0]);
    assert_eq!(f32s(&[1.0, 3.0, 3.0], &[3]).argmax(0, false).unwrap().to_u32_vec().unwrap(), vec![1], "argmax takes the first of ties");
    assert_eq!(x.argmax(0, true).unwrap().shape(), &[1, 3]);
    assert_eq!(x.max(&[1], false).unwrap().to_f32_vec().unwrap(), vec![3.0, 3.0]);
    assert_eq!(x.min(&[0], true).unwrap().to_f32_vec().unwrap(), vec![1.0, -2.0, -4.0]);
    assert_eq!(x.abs().unwrap().to_f32_vec().unwrap(), vec![1.0, 2.0, 3.0, 3.0, 0.5, 4.0]);
    assert_eq!(x.clamp(Some(-1.0), Some(2.0)).unwrap().to_f32_vec().unwrap(), vec![1.0, -1.0, 2.0, 2.0, 0.5, -1.0]);
    let v = x.var(&[1], false, 1).unwrap().to_f32_vec().unwrap();
    let unbiased = |r: [f32; 3]| {
        let m = r.iter().sum::<f32>() / 3.0;
        r.iter().map(|x| (x - m) * (x - m)).sum::<f32>() / 2.0
    };
    assert!((v[0] - unbiased([1.0, -2.0, 3.0])).abs() < 1e-5 && (v[1] - unbiased([3.0, 0.5, -4.0])).abs() < 1e-5, "unbiased var {v:?}");
    assert_eq!(f32s(&[2.0, 3.0], &[2]).pow(&f32s(&[3.0, 0.5], &[2])).unwrap().to_f32_vec().unwrap(), vec![8.0, 3f32.powf(0.5)]);
    let picked = Tensor::where_(&u32s(&[1, 0, 1], &[3]), &x, &Tensor::zeros(&[2, 1], DType::F32)).unwrap();
    assert_eq!(picked.to_f32_vec().unwrap(), vec![1.0, 0.0, 3.0, 3.0, 0.0, -4.0]);
    assert_eq!(x.masked_fill(&u32s(&[0, 1], &[2, 1]), 9.0).unwrap().to_f32_vec().unwrap(), vec![1.0, -2.0, 3.0, 9.0, 9.0, 9.0]);

    // Splits follow torch: chunk(3) of 5 → 2,2,1; chunk(4) of 6 → 2,2,2; split(2) of 5 → 2,2,1.
    let r = Tensor::arange(0.0, 5.0, 1.0, DType::F32).unwrap();
    let sizes = |ts: Vec<Tensor>| ts.iter().map(|t| t.shape()[0]).collect::<Vec<_>>();
    assert_eq!(sizes(r.chunk(3, 0).unwrap()), vec![2, 2, 1]);
    assert_eq!(sizes(Tensor::arange(0.0, 6.0, 1.0, DType::F32).unwrap().chunk(4, 0).unwrap()), vec![2, 2, 2]);
    assert_eq!(sizes(r.split(2, 0).unwrap()), vec![2, 2, 1]);
    assert_eq!(r.narrow(0, 1, 3).unwrap().to_f32_vec().unwrap(), vec![1.0, 2.0, 3.0]);
    let s = Tensor::stack(&[&x, &x], 1).unwrap();
    assert_eq!(s.shape(), &[2, 2, 3]);
    assert_eq!(s.to_f32_vec().unwrap()[3..6], [1.0, -2.0, 3.0]);
    let p = x.reshape(&[1, 2, 3]).unwrap().permute(&[2, 0, 1]).unwrap();
    assert_eq!(p.shape(), &[3, 1, 2]);
    assert_eq!(p.to_f32_vec().unwrap(), vec![1.0, 3.0, -2.0, 0.5, 3.0, -4.0]);
    assert_eq!(p.squeeze(1).unwrap().unsqueeze(0).unwrap().shape(), &[1, 3, 2]);
    assert!(matches!(p.squeeze(0), Err(Error::BadShape { op: "squeeze", .. })));
    assert_eq!(f32s(&[1.0, 2.0], &[2, 1]).expand(&[2, 2, 3]).unwrap().to_f32_vec().unwrap(), vec![1., 1., 1., 2., 2., 2., 1., 1., 1., 2., 2., 2.]);
}

#[test]
fn attention_mask_conventions() {
    // Goal: non-zero mask entries attend; causal equals an explicit lower-triangular mask; the
    // default scale is 1/sqrt(D).
    let seed = 5;
    let mut g = Generator::new(seed);
    let (q, k, v) = (randn(&[2, 3, 4], DType::F64, &mut g), randn(&[2, 3, 4], DType::F64, &mut g), randn(&[2, 3, 2], DType::F64, &mut g));
    let run = |mask: Option<&Tensor>, causal: bool, scale: Option<f64>| Tensor::scaled_dot_product_attention(&q, &k, &v, mask, causal, scale).unwrap();
    let same = |a: &Tensor, b: &Tensor, what: &str| assert_close(&format!("{what} (seed {seed})"), a, b, 0.0, 1e-12);
    same(&run(None, false, None), &run(Some(&u32s(&[1; 9], &[3, 3])), false, None), "all-ones mask is no mask");
    same(&run(None, true, None), &run(Some(&u32s(&[1, 0, 0, 1, 1, 0, 1, 1, 1], &[3, 3])), false, None), "causal is tril");
    same(&run(None, false, None), &run(None, false, Some(0.5)), "default scale 1/sqrt(4)");
    // A mask that keeps a single key per row returns that key's value row.
    let only_last = run(Some(&u32s(&[0, 0, 1], &[3])), false, None).to_f64_vec().unwrap();
    let v_last = v.narrow(1, 2, 1).unwrap().to_f64_vec().unwrap();
    for b in 0..2 {
        for i in 0..3 {
            assert!((0..2).all(|c| (only_last[b * 6 + i * 2 + c] - v_last[b * 2 + c]).abs() < 1e-12));
        }
    }
}

#[test]
fn dropout_masks_replay_from_the_seed() {
    // Goal: the mask is a function of the generator's position only (not of dtype or values).
    let x = Tensor::ones(&[64], DType::F32);
    let a = x.dropout(0.5, true, &mut Generator::new(21)).unwrap().to_f32_vec().unwrap();
    let b = x.to_dtype(DType::BF16).unwrap().dropout(0.5, true, &mut Generator::new(21)).unwrap().to_f32_vec().unwrap();
    assert_eq!(a, b);
    let mut g = Generator::new(21);
    let first = x.dropout(0.5, true, &mut g).unwrap().to_f32_vec().unwrap();
    let second = x.dropout(0.5, true, &mut g).unwrap().to_f32_vec().unwrap();
    assert_eq!(first, a);
    assert_ne!(first, second, "the generator advances between calls");
    // Gradient: the same mask and scale.
    let leaf = x.clone().requires_grad(true);
    leaf.dropout(0.5, true, &mut Generator::new(21)).unwrap().sum_all().unwrap().backward().unwrap();
    assert_eq!(leaf.grad().unwrap().to_f32_vec().unwrap(), a);
}

#[test]
fn embedding_gradient_accumulates_repeated_ids() {
    // Goal: a repeated id receives the sum of its rows' gradients; unused rows get zero.
    let w = Tensor::zeros(&[4, 2], DType::F32).requires_grad(true);
    let ids = u32s(&[1, 3, 1, 1], &[2, 2]);
    let out = Tensor::embedding(&w, &ids).unwrap();
    assert_eq!(out.shape(), &[2, 2, 2]);
    let upstream = f32s(&[1., 2., 3., 4., 5., 6., 7., 8.], &[2, 2, 2]);
    out.mul(&upstream).unwrap().sum_all().unwrap().backward().unwrap();
    assert_eq!(w.grad().unwrap().to_f32_vec().unwrap(), vec![0., 0., 13., 16., 0., 0., 3., 4.]);
}
