//! Core autograd checks: broadcasting binary ops, unary ops, reductions, matmul, softmax and
//! cross-entropy against finite differences in f64.
#![allow(clippy::unwrap_used)]

use rtx_tensor::{gradcheck, CrossEntropyOptions, DType, Generator, Tensor};

fn randn(shape: &[usize], g: &mut Generator) -> Tensor {
    Tensor::randn(shape, 0.0, 1.0, DType::F64, g).unwrap()
}

#[test]
fn binary_broadcast_and_unary_grads() {
    let mut g = Generator::new(1);
    let a = randn(&[3, 4], &mut g);
    let b = randn(&[4], &mut g);
    let r = gradcheck(|x| x[0].mul(&x[1])?.add(&x[0])?.tanh()?.div(&x[1].abs()?.add_scalar(1.0)?), &[a, b], 1e-6, 1e-6, 7).unwrap();
    assert!(r.checked == 16);
}

#[test]
fn matmul_reduce_softmax_ce_grads() {
    let mut g = Generator::new(2);
    let x = randn(&[2, 3, 5], &mut g);
    let w = randn(&[5, 4], &mut g);
    gradcheck(|t| t[0].matmul(&t[1])?.softmax(-1)?.sum(&[1], false), &[x.clone(), w.clone()], 1e-6, 1e-6, 3).unwrap();
    let targets = Tensor::from_vec(vec![0u32, 3, 1, 2, 2, 1], &[2, 3]).unwrap();
    let opts = CrossEntropyOptions { ignore_index: Some(1), label_smoothing: 0.1, ..Default::default() };
    gradcheck(move |t| t[0].matmul(&t[1])?.cross_entropy(&targets, opts), &[x.clone(), w.clone()], 1e-6, 1e-6, 4).unwrap();
    gradcheck(|t| t[0].transpose(1, 2)?.matmul(&t[0].narrow(2, 0, 2)?)?.mean(&[0, 2], true), &[randn(&[3, 4, 3], &mut g)], 1e-6, 1e-6, 5).unwrap();
}

#[test]
fn backward_accumulates_and_reports_leaves() {
    let w = Tensor::from_vec(vec![1.0f32, 2.0, 3.0], &[3]).unwrap().requires_grad(true);
    let mut ready = Vec::new();
    let loss = w.mul(&w).unwrap().sum_all().unwrap();
    loss.backward_with(|t| ready.push(t.id())).unwrap();
    assert_eq!(ready, vec![w.id()]);
    loss.backward().unwrap();
    assert_eq!(w.grad().unwrap().to_f32_vec().unwrap(), vec![4.0, 8.0, 12.0]);
}
