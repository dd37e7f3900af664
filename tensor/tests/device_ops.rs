//! Device-generic op tests: every test body runs once per device through
//! [`rtx_tensor::device_test!`] (`NAME::cpu` always, `NAME::cuda` in `--features cuda` builds,
//! skipped without a GPU) and compares the op computed on that device against an independent
//! reference: naive f64 loops over the same inputs, closed forms, or known values, never the same
//! op on the CPU. Forward values and, for differentiable ops, the gradients of `backward_from`
//! with a random upstream gradient (or `backward` of a scalar loss) are checked.
//!
//! Inputs are f32 on every device and are moved with `to_device(device)`; results come back with
//! `to_device(Device::Cpu)` after checking they stayed on `device`. The comparison is
//! `max |got − want| / max |want| ≤ 1e-4` (f32 rounding over sums of at most a few hundred
//! terms stays orders of magnitude below that; GPU f32 GEMMs are plain f32, not TF32).
//! Every op here runs on every device: the ops that came to the GPU after the GPT step's (batched
//! `matmul`, broadcast `mul`, `softmax`, `log_softmax`, `sum`, `mean`, `contiguous` of a strided
//! view) go through [`on_device`], which fails the test when the op refuses the device or its
//! result lands on another one (an op a backend lacks would use
//! [`rtx_tensor::testing::supported_on`], which lets a typed `UnsupportedDevice` refusal through
//! for the test table). The GPU sums in another order than the CPU (f32 either way), far inside
//! the tolerance. Randomized tests print their seed. No GPU and no data files are needed.

use anyhow::{ensure, Context, Result};
use rtx_tensor::{CrossEntropyOptions, DType, Device, Error, GeluApprox, Generator, Reduction, Tensor};

/// The result of an op run on `device`: an error when the op failed (a refusal included) or
/// its result is not on `device`.
fn on_device(device: Device, result: rtx_tensor::Result<Tensor>) -> Result<Tensor> {
    let t = result.with_context(|| format!("op on {device}"))?;
    ensure!(t.device() == device, "result on {} instead of {device}", t.device());
    Ok(t)
}

/// Largest error allowed, relative to the reference's largest magnitude (f32 on every device).
const TOL: f64 = 1e-4;

/// A generator seeded with `seed`, printing the seed (randomized tests print their seed).
fn seeded(seed: u64) -> Generator {
    println!("seed: {seed}");
    Generator::new(seed)
}

/// `n` uniform values in `[-scale, scale)`.
fn uniform(rng: &mut Generator, n: usize, scale: f64) -> Vec<f32> {
    (0..n).map(|_| ((rng.uniform() * 2.0 - 1.0) * scale) as f32).collect()
}

/// Host values as a tensor on `device` (not tracked by autograd).
fn on(device: Device, values: &[f32], shape: &[usize]) -> Result<Tensor> {
    Ok(Tensor::from_vec(values.to_vec(), shape)?.to_device(device)?)
}

/// Host values as a leaf on `device` that requires grad.
fn leaf(device: Device, values: &[f32], shape: &[usize]) -> Result<Tensor> {
    Ok(on(device, values, shape)?.requires_grad(true))
}

/// The elements of `t` as f32 on the host, after checking that `t` stayed on `device`.
fn fetch(device: Device, t: &Tensor) -> Result<Vec<f32>> {
    ensure!(t.device() == device, "result on {}, expected on {device}", t.device());
    Ok(t.to_device(Device::Cpu)?.to_f32_vec()?)
}

/// The gradient of the leaf `t`, fetched from `device`.
fn grad(device: Device, t: &Tensor) -> Result<Vec<f32>> {
    fetch(device, &t.grad().context("leaf has no gradient")?)
}

/// Checks `max |got − want| / max |want| ≤ tol`, naming `what` and the worst element.
fn close(what: &str, got: &[f32], want: &[f64], tol: f64) -> Result<()> {
    ensure!(got.len() == want.len(), "{what}: {} values, expected {}", got.len(), want.len());
    let scale = want.iter().fold(0.0f64, |m, w| m.max(w.abs())).max(1e-30);
    let (worst, err) =
        got.iter().zip(want).map(|(&g, &w)| (f64::from(g) - w).abs()).enumerate().fold((0, 0.0f64), |m, (i, e)| if e > m.1 || e.is_nan() { (i, e) } else { m });
    ensure!(err / scale <= tol, "{what}: relative error {:.3e} > {tol:.0e} at [{worst}]: got {}, want {}", err / scale, got[worst], want[worst]);
    Ok(())
}

/// Runs backward from the upstream gradient `g` (host values in `y`'s shape) on `device`.
fn backward_from(device: Device, y: &Tensor, g: &[f32]) -> Result<()> {
    y.backward_from(on(device, g, y.shape())?, |_| {})?;
    Ok(())
}

/// `x [rows, n_in] · wᵀ (+ b)` with `w [n_out, n_in]`, naive loops in f64.
fn linear_ref(x: &[f32], w: &[f32], b: Option<&[f32]>, rows: usize, n_in: usize, n_out: usize) -> Vec<f64> {
    let mut y = vec![0.0f64; rows * n_out];
    for i in 0..rows {
        for o in 0..n_out {
            let mut acc = b.map_or(0.0, |b| f64::from(b[o]));
            for k in 0..n_in {
                acc += f64::from(x[i * n_in + k]) * f64::from(w[o * n_in + k]);
            }
            y[i * n_out + o] = acc;
        }
    }
    y
}

/// The gradients of `linear` for the upstream gradient `g [rows, n_out]`: `(dx, dw, db)`.
fn linear_grads_ref(x: &[f32], w: &[f32], g: &[f32], rows: usize, n_in: usize, n_out: usize) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let (mut dx, mut dw, mut db) = (vec![0.0f64; rows * n_in], vec![0.0f64; n_out * n_in], vec![0.0f64; n_out]);
    for i in 0..rows {
        for o in 0..n_out {
            let go = f64::from(g[i * n_out + o]);
            db[o] += go;
            for k in 0..n_in {
                dx[i * n_in + k] += go * f64::from(w[o * n_in + k]);
                dw[o * n_in + k] += go * f64::from(x[i * n_in + k]);
            }
        }
    }
    (dx, dw, db)
}

/// erf by its Taylor series, accurate to ~1e-13 for |x| ≤ 2.5 (the tests keep |x| ≤ 3/√2).
fn erf(x: f64) -> f64 {
    let (mut term, mut sum, mut n) = (x, x, 0.0f64);
    while term.abs() > 1e-17 * sum.abs().max(1e-300) {
        n += 1.0;
        term *= -x * x / n;
        sum += term / (2.0 * n + 1.0);
        if n > 200.0 {
            break;
        }
    }
    sum * 2.0 / std::f64::consts::PI.sqrt()
}

/// Round-to-nearest-even of an f32 to bf16 (the top 16 bits), by bit arithmetic.
fn bf16_round(x: f32) -> f32 {
    let bits = x.to_bits();
    let lsb = (bits >> 16) & 1;
    f32::from_bits(bits.wrapping_add(0x7fff + lsb) & 0xffff_0000)
}

/// Per-row softmax of `x [rows, cols]` in f64 (over the first `valid` columns of each row).
fn softmax_rows(x: &[f32], rows: usize, cols: usize, valid: usize) -> Vec<f64> {
    let mut p = vec![0.0f64; rows * valid];
    for r in 0..rows {
        let row = &x[r * cols..r * cols + valid];
        let max = row.iter().fold(f64::NEG_INFINITY, |m, &v| m.max(f64::from(v)));
        let z: f64 = row.iter().map(|&v| (f64::from(v) - max).exp()).sum();
        for c in 0..valid {
            p[r * valid + c] = (f64::from(row[c]) - max).exp() / z;
        }
    }
    p
}

rtx_tensor::device_test! {
    /// Goal: `linear` with a bias is `x·wᵀ + b` with the textbook gradients. Method: random
    /// x [6, 16], w [12, 16], b [12], a random upstream gradient; naive f64 loops for y, dx, dw, db.
    fn linear_with_bias(device) -> Result<()> {
        let mut rng = seeded(0x11);
        let (rows, n_in, n_out) = (6, 16, 12);
        let (x, w, b) = (uniform(&mut rng, rows * n_in, 1.0), uniform(&mut rng, n_out * n_in, 1.0), uniform(&mut rng, n_out, 1.0));
        let g = uniform(&mut rng, rows * n_out, 1.0);
        let (xt, wt, bt) = (leaf(device, &x, &[rows, n_in])?, leaf(device, &w, &[n_out, n_in])?, leaf(device, &b, &[n_out])?);
        let y = xt.linear(&wt, Some(&bt))?;
        ensure!(y.shape() == [rows, n_out], "shape {:?}", y.shape());
        close("y", &fetch(device, &y)?, &linear_ref(&x, &w, Some(&b), rows, n_in, n_out), TOL)?;
        backward_from(device, &y, &g)?;
        let (dx, dw, db) = linear_grads_ref(&x, &w, &g, rows, n_in, n_out);
        close("dx", &grad(device, &xt)?, &dx, TOL)?;
        close("dw", &grad(device, &wt)?, &dw, TOL)?;
        close("db", &grad(device, &bt)?, &db, TOL)
    }

    /// Goal: `linear` on a batched input `[B, T, in]` (the batched matmul of a shared weight)
    /// multiplies every row. Method: x [2, 5, 16], w [8, 16], no bias; the naive reference on
    /// the 10 flattened rows, forward and both gradients.
    fn linear_batched_over_leading_dims(device) -> Result<()> {
        let mut rng = seeded(0x12);
        let (b, t, n_in, n_out) = (2, 5, 16, 8);
        let rows = b * t;
        let (x, w, g) = (uniform(&mut rng, rows * n_in, 1.0), uniform(&mut rng, n_out * n_in, 1.0), uniform(&mut rng, rows * n_out, 1.0));
        let (xt, wt) = (leaf(device, &x, &[b, t, n_in])?, leaf(device, &w, &[n_out, n_in])?);
        let y = xt.linear(&wt, None)?;
        ensure!(y.shape() == [b, t, n_out], "shape {:?}", y.shape());
        close("y", &fetch(device, &y)?, &linear_ref(&x, &w, None, rows, n_in, n_out), TOL)?;
        backward_from(device, &y, &g)?;
        let (dx, dw, _) = linear_grads_ref(&x, &w, &g, rows, n_in, n_out);
        close("dx", &grad(device, &xt)?, &dx, TOL)?;
        close("dw", &grad(device, &wt)?, &dw, TOL)
    }

    /// Goal: `matmul` of two batches `[B, M, K] @ [B, K, N]` and its gradients. Method: naive
    /// triple loops per batch for y, `da = g·bᵀ`, `db = aᵀ·g`. On a GPU: one strided-batched
    /// GEMM, the gradients GEMMs of transposed views read in place.
    fn matmul_batched(device) -> Result<()> {
        let mut rng = seeded(0x13);
        let (nb, m, k, n) = (2, 3, 4, 5);
        let (a, b, g) = (uniform(&mut rng, nb * m * k, 1.0), uniform(&mut rng, nb * k * n, 1.0), uniform(&mut rng, nb * m * n, 1.0));
        let (at, bt) = (leaf(device, &a, &[nb, m, k])?, leaf(device, &b, &[nb, k, n])?);
        let y = on_device(device, at.matmul(&bt))?;
        let (mut want, mut da, mut db) = (vec![0.0f64; nb * m * n], vec![0.0f64; nb * m * k], vec![0.0f64; nb * k * n]);
        for p in 0..nb {
            for i in 0..m {
                for j in 0..n {
                    let gij = f64::from(g[(p * m + i) * n + j]);
                    for q in 0..k {
                        let (aiq, bqj) = (f64::from(a[(p * m + i) * k + q]), f64::from(b[(p * k + q) * n + j]));
                        want[(p * m + i) * n + j] += aiq * bqj;
                        da[(p * m + i) * k + q] += gij * bqj;
                        db[(p * k + q) * n + j] += aiq * gij;
                    }
                }
            }
        }
        close("y", &fetch(device, &y)?, &want, TOL)?;
        backward_from(device, &y, &g)?;
        close("da", &grad(device, &at)?, &da, TOL)?;
        close("db", &grad(device, &bt)?, &db, TOL)
    }

    /// Goal: `add` of equal shapes and of a suffix shape broadcast over the leading dim (a
    /// position embedding), with the broadcast operand's gradient summed over the batch.
    /// Method: a [3, 4, 5] + c [3, 4, 5] and a + b [4, 5]; element-wise f64 sums as reference.
    fn add_same_shape_and_broadcast(device) -> Result<()> {
        let mut rng = seeded(0x14);
        let (nb, inner) = (3, 20);
        let (a, b, c, g) = (uniform(&mut rng, nb * inner, 1.0), uniform(&mut rng, inner, 1.0), uniform(&mut rng, nb * inner, 1.0), uniform(&mut rng, nb * inner, 1.0));
        let (at, bt, ct) = (leaf(device, &a, &[nb, 4, 5])?, leaf(device, &b, &[4, 5])?, leaf(device, &c, &[nb, 4, 5])?);
        let same = at.add(&ct)?;
        close("a + c", &fetch(device, &same)?, &a.iter().zip(&c).map(|(&x, &y)| f64::from(x) + f64::from(y)).collect::<Vec<_>>(), TOL)?;
        let y = at.add(&bt)?;
        ensure!(y.shape() == [nb, 4, 5], "shape {:?}", y.shape());
        let want: Vec<f64> = (0..nb * inner).map(|i| f64::from(a[i]) + f64::from(b[i % inner])).collect();
        close("a + b", &fetch(device, &y)?, &want, TOL)?;
        backward_from(device, &y, &g)?;
        let db: Vec<f64> = (0..inner).map(|j| (0..nb).map(|p| f64::from(g[p * inner + j])).sum()).collect();
        close("da", &grad(device, &at)?, &g.iter().map(|&v| f64::from(v)).collect::<Vec<_>>(), TOL)?;
        close("db", &grad(device, &bt)?, &db, TOL)
    }

    /// Goal: `mul` with a row vector broadcast over rows, and its gradients (the broadcast one
    /// summed). Method: a [3, 4] ⊙ b [4]; `da = g⊙b`, `db = Σ_rows g⊙a` by loops. On a GPU the
    /// backward is the same tensor ops (`mul`, then `sum` over the broadcast dim).
    fn mul_broadcast(device) -> Result<()> {
        let mut rng = seeded(0x15);
        let (rows, cols) = (3, 4);
        let (a, b, g) = (uniform(&mut rng, rows * cols, 1.0), uniform(&mut rng, cols, 1.0), uniform(&mut rng, rows * cols, 1.0));
        let (at, bt) = (leaf(device, &a, &[rows, cols])?, leaf(device, &b, &[cols])?);
        let y = on_device(device, at.mul(&bt))?;
        let want: Vec<f64> = (0..rows * cols).map(|i| f64::from(a[i]) * f64::from(b[i % cols])).collect();
        close("y", &fetch(device, &y)?, &want, TOL)?;
        backward_from(device, &y, &g)?;
        let da: Vec<f64> = (0..rows * cols).map(|i| f64::from(g[i]) * f64::from(b[i % cols])).collect();
        let db: Vec<f64> = (0..cols).map(|j| (0..rows).map(|r| f64::from(g[r * cols + j]) * f64::from(a[r * cols + j])).sum()).collect();
        close("da", &grad(device, &at)?, &da, TOL)?;
        close("db", &grad(device, &bt)?, &db, TOL)
    }

    /// Goal: `mul_scalar` scales values and gradients by the constant. Method: x [3, 7] times
    /// −0.25 (a power of two, so every product is exact in f32 and compared exactly).
    fn mul_scalar(device) -> Result<()> {
        let mut rng = seeded(0x16);
        let k = -0.25f64;
        let (x, g) = (uniform(&mut rng, 21, 2.0), uniform(&mut rng, 21, 1.0));
        let xt = leaf(device, &x, &[3, 7])?;
        let y = xt.mul_scalar(k)?;
        close("y", &fetch(device, &y)?, &x.iter().map(|&v| f64::from(v) * k).collect::<Vec<_>>(), 0.0)?;
        backward_from(device, &y, &g)?;
        close("dx", &grad(device, &xt)?, &g.iter().map(|&v| f64::from(v) * k).collect::<Vec<_>>(), 0.0)
    }

    /// Goal: exact GELU `x·Φ(x)` (`GeluApprox::None`, erf form) and its derivative
    /// `Φ(x) + x·φ(x)`. Method: x [4, 33] in [−3, 3]; Φ from a Taylor-series erf in f64.
    fn gelu_exact(device) -> Result<()> {
        let mut rng = seeded(0x17);
        let (x, g) = (uniform(&mut rng, 132, 3.0), uniform(&mut rng, 132, 1.0));
        let xt = leaf(device, &x, &[4, 33])?;
        let y = xt.gelu_with(GeluApprox::None)?;
        let cdf = |v: f64| 0.5 * (1.0 + erf(v / std::f64::consts::SQRT_2));
        let pdf = |v: f64| (-0.5 * v * v).exp() / (2.0 * std::f64::consts::PI).sqrt();
        close("y", &fetch(device, &y)?, &x.iter().map(|&v| f64::from(v) * cdf(f64::from(v))).collect::<Vec<_>>(), TOL)?;
        backward_from(device, &y, &g)?;
        let dx: Vec<f64> = x.iter().zip(&g).map(|(&v, &gv)| { let v = f64::from(v); f64::from(gv) * (cdf(v) + v * pdf(v)) }).collect();
        close("dx", &grad(device, &xt)?, &dx, TOL)
    }

    /// Goal: tanh-approximate GELU (GPT-2's `gelu_new`) and its derivative. Method: the closed
    /// form `x/2·(1 + tanh(u))`, `u = √(2/π)·(x + 0.044715·x³)`, differentiated by hand.
    fn gelu_tanh(device) -> Result<()> {
        let mut rng = seeded(0x18);
        let (x, g) = (uniform(&mut rng, 132, 3.0), uniform(&mut rng, 132, 1.0));
        let xt = leaf(device, &x, &[4, 33])?;
        let y = xt.gelu_with(GeluApprox::Tanh)?;
        let c = (2.0 / std::f64::consts::PI).sqrt();
        let f = |v: f64| 0.5 * v * (1.0 + (c * (v + 0.044715 * v * v * v)).tanh());
        let df = |v: f64| {
            let t = (c * (v + 0.044715 * v * v * v)).tanh();
            0.5 * (1.0 + t) + 0.5 * v * (1.0 - t * t) * c * (1.0 + 3.0 * 0.044715 * v * v)
        };
        close("y", &fetch(device, &y)?, &x.iter().map(|&v| f(f64::from(v))).collect::<Vec<_>>(), TOL)?;
        backward_from(device, &y, &g)?;
        close("dx", &grad(device, &xt)?, &x.iter().zip(&g).map(|(&v, &gv)| f64::from(gv) * df(f64::from(v))).collect::<Vec<_>>(), TOL)
    }

    /// Goal: `softmax` over the last dim: known values, rows summing to one, and the gradient
    /// `dx = p ⊙ (g − Σ g⊙p)`. Method: x [4, 9] in [−3, 3], f64 reference.
    fn softmax_rows_sum_to_one(device) -> Result<()> {
        let mut rng = seeded(0x19);
        let (rows, cols) = (4, 9);
        let (x, g) = (uniform(&mut rng, rows * cols, 3.0), uniform(&mut rng, rows * cols, 1.0));
        let xt = leaf(device, &x, &[rows, cols])?;
        let y = on_device(device, xt.softmax(-1))?;
        let p = softmax_rows(&x, rows, cols, cols);
        let got = fetch(device, &y)?;
        close("y", &got, &p, TOL)?;
        for r in 0..rows {
            let s: f64 = got[r * cols..(r + 1) * cols].iter().map(|&v| f64::from(v)).sum();
            ensure!((s - 1.0).abs() < 1e-5, "row {r} sums to {s}");
        }
        backward_from(device, &y, &g)?;
        let mut dx = vec![0.0f64; rows * cols];
        for r in 0..rows {
            let dot: f64 = (0..cols).map(|c| f64::from(g[r * cols + c]) * p[r * cols + c]).sum();
            for c in 0..cols {
                dx[r * cols + c] = p[r * cols + c] * (f64::from(g[r * cols + c]) - dot);
            }
        }
        close("dx", &grad(device, &xt)?, &dx, TOL)
    }

    /// Goal: `log_softmax` is `x − logsumexp(x)` per row, with gradient `g − p·Σg`. Method:
    /// x [3, 7] in [−4, 4], f64 reference.
    fn log_softmax_rows(device) -> Result<()> {
        let mut rng = seeded(0x1a);
        let (rows, cols) = (3, 7);
        let (x, g) = (uniform(&mut rng, rows * cols, 4.0), uniform(&mut rng, rows * cols, 1.0));
        let xt = leaf(device, &x, &[rows, cols])?;
        let y = on_device(device, xt.log_softmax(-1))?;
        let p = softmax_rows(&x, rows, cols, cols);
        close("y", &fetch(device, &y)?, &p.iter().map(|v| v.ln()).collect::<Vec<_>>(), TOL)?;
        backward_from(device, &y, &g)?;
        let mut dx = vec![0.0f64; rows * cols];
        for r in 0..rows {
            let sum_g: f64 = (0..cols).map(|c| f64::from(g[r * cols + c])).sum();
            for c in 0..cols {
                dx[r * cols + c] = f64::from(g[r * cols + c]) - p[r * cols + c] * sum_g;
            }
        }
        close("dx", &grad(device, &xt)?, &dx, TOL)
    }

    /// Goal: `cross_entropy` with the default options (mean over rows) on `[N, V]` logits and
    /// u32 targets, and its gradient `(softmax − onehot)/N`. Method: logits [6, 10] in [−3, 3],
    /// host targets; f64 log-sum-exp reference; `backward()` of the scalar loss.
    fn cross_entropy_mean(device) -> Result<()> {
        let mut rng = seeded(0x1b);
        let (n, v) = (6, 10);
        let x = uniform(&mut rng, n * v, 3.0);
        let targets: Vec<u32> = (0..n).map(|_| rng.below(v as u64) as u32).collect();
        let xt = leaf(device, &x, &[n, v])?;
        let loss = xt.cross_entropy(&Tensor::from_vec(targets.clone(), &[n])?, CrossEntropyOptions::default())?;
        ensure!(loss.numel() == 1, "loss shape {:?}", loss.shape());
        let p = softmax_rows(&x, n, v, v);
        let want: f64 = (0..n).map(|r| -p[r * v + targets[r] as usize].ln()).sum::<f64>() / n as f64;
        close("loss", &fetch(device, &loss)?, &[want], TOL)?;
        loss.backward()?;
        let dx: Vec<f64> = (0..n * v).map(|i| (p[i] - f64::from(u8::from(i % v == targets[i / v] as usize))) / n as f64).collect();
        close("dlogits", &grad(device, &xt)?, &dx, TOL)
    }

    /// Goal: the fused head + loss `linear_cross_entropy_valid` equals the naive `logits =
    /// h·wᵀ`, softmax over the first `classes` logits, cross-entropy (mean and sum), with zero
    /// gradient in the padding rows. Method: h [7, 16], w [12, 16] of which 10 are classes,
    /// chunks of 3 rows (the last partial); f64 reference of the loss, dh and dw.
    fn linear_cross_entropy_matches_naive_loss(device) -> Result<()> {
        let mut rng = seeded(0x1c);
        let (n, c, rows, classes) = (7, 16, 12, 10);
        let (h, w) = (uniform(&mut rng, n * c, 1.0), uniform(&mut rng, rows * c, 0.5));
        let targets: Vec<u32> = (0..n).map(|_| rng.below(classes as u64) as u32).collect();
        let logits: Vec<f32> = linear_ref(&h, &w, None, n, c, rows).into_iter().map(|v| v as f32).collect();
        let p = softmax_rows(&logits, n, rows, classes);
        for reduction in [Reduction::Mean, Reduction::Sum] {
            let factor = if reduction == Reduction::Mean { 1.0 / n as f64 } else { 1.0 };
            let (ht, wt) = (leaf(device, &h, &[n, c])?, leaf(device, &w, &[rows, c])?);
            let options = CrossEntropyOptions { reduction, ..CrossEntropyOptions::default() };
            let loss = ht.linear_cross_entropy_valid(&wt, &Tensor::from_vec(targets.clone(), &[n])?, classes, options, 3)?;
            let want = factor * (0..n).map(|r| -p[r * classes + targets[r] as usize].ln()).sum::<f64>();
            close(&format!("loss ({reduction:?})"), &fetch(device, &loss)?, &[want], TOL)?;
            loss.backward()?;
            let (mut dh, mut dw) = (vec![0.0f64; n * c], vec![0.0f64; rows * c]);
            for r in 0..n {
                for k in 0..classes {
                    let dl = factor * (p[r * classes + k] - f64::from(u8::from(k == targets[r] as usize)));
                    for j in 0..c {
                        dh[r * c + j] += dl * f64::from(w[k * c + j]);
                        dw[k * c + j] += dl * f64::from(h[r * c + j]);
                    }
                }
            }
            close(&format!("dh ({reduction:?})"), &grad(device, &ht)?, &dh, TOL)?;
            let dw_got = grad(device, &wt)?;
            close(&format!("dw ({reduction:?})"), &dw_got, &dw, TOL)?;
            ensure!(dw_got[classes * c..].iter().all(|&v| v == 0.0), "padding rows of dw are not zero");
        }
        Ok(())
    }

    /// Goal: `layer_norm` with weight and bias over the last dim (biased variance, eps 1e-5)
    /// and its three gradients. Method: x [5, 24] in [−2, 2]; f64 reference with the closed-form
    /// backward `dx = (dx̂ − mean(dx̂) − x̂·mean(dx̂⊙x̂))/σ`, `dx̂ = g⊙w`.
    fn layer_norm_weight_bias(device) -> Result<()> {
        let mut rng = seeded(0x1d);
        let (rows, c, eps) = (5, 24, 1e-5);
        let (x, w, b, g) = (uniform(&mut rng, rows * c, 2.0), uniform(&mut rng, c, 1.0), uniform(&mut rng, c, 1.0), uniform(&mut rng, rows * c, 1.0));
        let (xt, wt, bt) = (leaf(device, &x, &[rows, c])?, leaf(device, &w, &[c])?, leaf(device, &b, &[c])?);
        let y = xt.layer_norm(Some(&wt), Some(&bt), eps)?;
        let (mut want, mut dx, mut dw, mut db) = (vec![0.0f64; rows * c], vec![0.0f64; rows * c], vec![0.0f64; c], vec![0.0f64; c]);
        for r in 0..rows {
            let row: Vec<f64> = x[r * c..(r + 1) * c].iter().map(|&v| f64::from(v)).collect();
            let mean = row.iter().sum::<f64>() / c as f64;
            let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / c as f64;
            let sigma = (var + eps).sqrt();
            let xhat: Vec<f64> = row.iter().map(|v| (v - mean) / sigma).collect();
            let dxhat: Vec<f64> = (0..c).map(|j| f64::from(g[r * c + j]) * f64::from(w[j])).collect();
            let mean_d = dxhat.iter().sum::<f64>() / c as f64;
            let mean_dx = dxhat.iter().zip(&xhat).map(|(d, xh)| d * xh).sum::<f64>() / c as f64;
            for j in 0..c {
                want[r * c + j] = xhat[j] * f64::from(w[j]) + f64::from(b[j]);
                dx[r * c + j] = (dxhat[j] - mean_d - xhat[j] * mean_dx) / sigma;
                dw[j] += f64::from(g[r * c + j]) * xhat[j];
                db[j] += f64::from(g[r * c + j]);
            }
        }
        close("y", &fetch(device, &y)?, &want, TOL)?;
        backward_from(device, &y, &g)?;
        close("dx", &grad(device, &xt)?, &dx, TOL)?;
        close("dw", &grad(device, &wt)?, &dw, TOL)?;
        close("db", &grad(device, &bt)?, &db, TOL)
    }

    /// Goal: `add_layer_norm` (the residual add fused with the norm after it) gives the sum and
    /// its layer norm, and when the sum has another consumer (`out = y + s`, as the next residual
    /// add) its gradient adds both paths (the norm's backward takes the sum's other gradient).
    /// Method: a [3, 4, 24] + b [4, 24] (broadcast over the batch) in [−2, 2]; f64 reference:
    /// `ds = g + layer-norm backward of g`, `da = ds`, `db = Σ_batch ds`.
    fn add_layer_norm_with_residual_use(device) -> Result<()> {
        let mut rng = seeded(0x2a);
        let (batch, t, c, eps) = (3, 4, 24, 1e-5);
        let rows = batch * t;
        let (a, b) = (uniform(&mut rng, rows * c, 2.0), uniform(&mut rng, t * c, 2.0));
        let (w, bias, g) = (uniform(&mut rng, c, 1.0), uniform(&mut rng, c, 1.0), uniform(&mut rng, rows * c, 1.0));
        let (at, bt) = (leaf(device, &a, &[batch, t, c])?, leaf(device, &b, &[t, c])?);
        let (wt, biast) = (leaf(device, &w, &[c])?, leaf(device, &bias, &[c])?);
        let (s, y) = at.add_layer_norm(&bt, Some(&wt), Some(&biast), eps)?;
        let out = y.add(&s)?;
        let (mut want_s, mut want_out) = (vec![0.0f64; rows * c], vec![0.0f64; rows * c]);
        let (mut da, mut db, mut dw, mut dbias) = (vec![0.0f64; rows * c], vec![0.0f64; t * c], vec![0.0f64; c], vec![0.0f64; c]);
        for r in 0..rows {
            let row: Vec<f64> = (0..c).map(|j| f64::from(a[r * c + j]) + f64::from(b[(r % t) * c + j])).collect();
            let mean = row.iter().sum::<f64>() / c as f64;
            let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / c as f64;
            let sigma = (var + eps).sqrt();
            let xhat: Vec<f64> = row.iter().map(|v| (v - mean) / sigma).collect();
            let dxhat: Vec<f64> = (0..c).map(|j| f64::from(g[r * c + j]) * f64::from(w[j])).collect();
            let mean_d = dxhat.iter().sum::<f64>() / c as f64;
            let mean_dx = dxhat.iter().zip(&xhat).map(|(d, xh)| d * xh).sum::<f64>() / c as f64;
            for j in 0..c {
                want_s[r * c + j] = row[j];
                want_out[r * c + j] = xhat[j] * f64::from(w[j]) + f64::from(bias[j]) + row[j];
                let ds = f64::from(g[r * c + j]) + (dxhat[j] - mean_d - xhat[j] * mean_dx) / sigma;
                da[r * c + j] = ds;
                db[(r % t) * c + j] += ds;
                dw[j] += f64::from(g[r * c + j]) * xhat[j];
                dbias[j] += f64::from(g[r * c + j]);
            }
        }
        close("s", &fetch(device, &s)?, &want_s, TOL)?;
        close("out", &fetch(device, &out)?, &want_out, TOL)?;
        backward_from(device, &out, &g)?;
        close("da", &grad(device, &at)?, &da, TOL)?;
        close("db", &grad(device, &bt)?, &db, TOL)?;
        close("dw", &grad(device, &wt)?, &dw, TOL)?;
        close("dbias", &grad(device, &biast)?, &dbias, TOL)
    }

    /// Goal: `linear_gelu_linear` (the GPT feed-forward as one op) equals
    /// `linear(gelu_tanh(linear(x)))` with its five gradients. Method: x [6, 16], hidden 32, out
    /// 8; f64 reference from `linear_ref`/`linear_grads_ref` and the tanh GELU's derivative.
    fn linear_gelu_linear_feed_forward(device) -> Result<()> {
        let mut rng = seeded(0x2b);
        let (rows, c_in, hidden, c_out) = (6, 16, 32, 8);
        let (x, w1, b1) = (uniform(&mut rng, rows * c_in, 1.0), uniform(&mut rng, hidden * c_in, 0.5), uniform(&mut rng, hidden, 0.5));
        let (w2, b2, g) = (uniform(&mut rng, c_out * hidden, 0.5), uniform(&mut rng, c_out, 0.5), uniform(&mut rng, rows * c_out, 1.0));
        let (xt, w1t, b1t, w2t, b2t) = (leaf(device, &x, &[rows, c_in])?, leaf(device, &w1, &[hidden, c_in])?, leaf(device, &b1, &[hidden])?, leaf(device, &w2, &[c_out, hidden])?, leaf(device, &b2, &[c_out])?);
        let y = xt.linear_gelu_linear(&w1t, &b1t, &w2t, &b2t)?;
        let k = (2.0 / std::f64::consts::PI).sqrt();
        let pre = linear_ref(&x, &w1, Some(&b1), rows, c_in, hidden);
        let gelu = |v: f64| 0.5 * v * (1.0 + (k * (v + 0.044715 * v * v * v)).tanh());
        let gelu_grad = |v: f64| {
            let t = (k * (v + 0.044715 * v * v * v)).tanh();
            0.5 * (1.0 + t) + 0.5 * v * (1.0 - t * t) * k * (1.0 + 3.0 * 0.044715 * v * v)
        };
        let h: Vec<f32> = pre.iter().map(|&v| gelu(v) as f32).collect();
        close("y", &fetch(device, &y)?, &linear_ref(&h, &w2, Some(&b2), rows, hidden, c_out), TOL)?;
        backward_from(device, &y, &g)?;
        let (dh, dw2, db2) = linear_grads_ref(&h, &w2, &g, rows, hidden, c_out);
        let dpre: Vec<f32> = dh.iter().zip(&pre).map(|(d, &p)| (d * gelu_grad(p)) as f32).collect();
        let (dx, dw1, db1) = linear_grads_ref(&x, &w1, &dpre, rows, c_in, hidden);
        close("dx", &grad(device, &xt)?, &dx, TOL)?;
        close("dw1", &grad(device, &w1t)?, &dw1, TOL)?;
        close("db1", &grad(device, &b1t)?, &db1, TOL)?;
        close("dw2", &grad(device, &w2t)?, &dw2, TOL)?;
        close("db2", &grad(device, &b2t)?, &db2, TOL)
    }

    /// Goal: `Tensor::embedding` gathers table rows (ids on the host or on the device) and its
    /// gradient scatter-adds, repeated ids accumulating. Method: table [10, 8], ids [2, 3] with id
    /// 3 three times; the reference copies and sums rows by index.
    fn embedding_gather_and_scatter(device) -> Result<()> {
        let mut rng = seeded(0x1e);
        let (v, c) = (10, 8);
        let ids = [3u32, 7, 3, 0, 9, 3];
        let (table, g) = (uniform(&mut rng, v * c, 1.0), uniform(&mut rng, ids.len() * c, 1.0));
        let tt = leaf(device, &table, &[v, c])?;
        let host_ids = Tensor::from_vec(ids.to_vec(), &[2, 3])?;
        let want: Vec<f64> = ids.iter().flat_map(|&i| table[i as usize * c..(i as usize + 1) * c].iter().map(|&x| f64::from(x))).collect();
        let from_device_ids = Tensor::embedding(&tt, &host_ids.to_device(device)?)?;
        close("y (ids on device)", &fetch(device, &from_device_ids)?, &want, 0.0)?;
        let y = Tensor::embedding(&tt, &host_ids)?;
        ensure!(y.shape() == [2, 3, c], "shape {:?}", y.shape());
        close("y", &fetch(device, &y)?, &want, 0.0)?;
        backward_from(device, &y, &g)?;
        let mut dt = vec![0.0f64; v * c];
        for (pos, &i) in ids.iter().enumerate() {
            for j in 0..c {
                dt[i as usize * c + j] += f64::from(g[pos * c + j]);
            }
        }
        close("dtable", &grad(device, &tt)?, &dt, TOL)
    }

    /// Goal: causal multi-head attention on packed `qkv [B, T, 3·C]` (the GPU's flash attention;
    /// head dim 64, which it supports) and its gradient. Method: B 2, T 5, 2 heads of 64; per
    /// batch and head the naive f64 scores `q·kᵀ/√D` masked to keys ≤ query, softmax, `P·V`,
    /// and the textbook backward (`dV = Pᵀ·dO`, `dS = P⊙(dP − Σ P⊙dP)`, `dQ = s·dS·K`,
    /// `dK = s·dSᵀ·Q`), written into the packed gradient.
    fn attention_packed_causal(device) -> Result<()> {
        let mut rng = seeded(0x1f);
        let (nb, t, heads, d) = (2, 5, 2, 64);
        let c = heads * d;
        let (qkv, g) = (uniform(&mut rng, nb * t * 3 * c, 0.5), uniform(&mut rng, nb * t * c, 1.0));
        let xt = leaf(device, &qkv, &[nb, t, 3 * c])?;
        let y = Tensor::scaled_dot_product_attention_packed(&xt, heads, true, None)?;
        ensure!(y.shape() == [nb, t, c], "shape {:?}", y.shape());
        let scale = 1.0 / (d as f64).sqrt();
        let (mut want, mut dqkv) = (vec![0.0f64; nb * t * c], vec![0.0f64; nb * t * 3 * c]);
        // Index of element `j` of part `part` (0 q, 1 k, 2 v) of head `h` at position `pos`.
        let at = |b: usize, pos: usize, part: usize, h: usize, j: usize| (b * t + pos) * 3 * c + part * c + h * d + j;
        let val = |i: usize| f64::from(qkv[i]);
        for b in 0..nb {
            for h in 0..heads {
                let mut p = vec![vec![0.0f64; t]; t];
                for i in 0..t {
                    let s: Vec<f64> = (0..=i).map(|j| scale * (0..d).map(|e| val(at(b, i, 0, h, e)) * val(at(b, j, 1, h, e))).sum::<f64>()).collect();
                    let max = s.iter().fold(f64::NEG_INFINITY, |m, &v| m.max(v));
                    let z: f64 = s.iter().map(|v| (v - max).exp()).sum();
                    for j in 0..=i {
                        p[i][j] = (s[j] - max).exp() / z;
                    }
                    for e in 0..d {
                        want[(b * t + i) * c + h * d + e] = (0..=i).map(|j| p[i][j] * val(at(b, j, 2, h, e))).sum();
                    }
                }
                let dout = |i: usize, e: usize| f64::from(g[(b * t + i) * c + h * d + e]);
                for i in 0..t {
                    let dp: Vec<f64> = (0..=i).map(|j| (0..d).map(|e| dout(i, e) * val(at(b, j, 2, h, e))).sum()).collect();
                    let dot: f64 = (0..=i).map(|j| p[i][j] * dp[j]).sum();
                    for j in 0..=i {
                        let ds = p[i][j] * (dp[j] - dot);
                        for e in 0..d {
                            dqkv[at(b, j, 2, h, e)] += p[i][j] * dout(i, e);
                            dqkv[at(b, i, 0, h, e)] += scale * ds * val(at(b, j, 1, h, e));
                            dqkv[at(b, j, 1, h, e)] += scale * ds * val(at(b, i, 0, h, e));
                        }
                    }
                }
            }
        }
        close("y", &fetch(device, &y)?, &want, TOL)?;
        backward_from(device, &y, &g)?;
        close("dqkv", &grad(device, &xt)?, &dqkv, TOL)
    }

    /// Goal: `sum` over a dim and `mean` of everything, with their (broadcast) gradients.
    /// Method: x [3, 5]; column sums by loops; `backward()` of `mean_all` gives 1/15 everywhere.
    fn sum_and_mean_reductions(device) -> Result<()> {
        let mut rng = seeded(0x20);
        let (rows, cols) = (3, 5);
        let (x, g) = (uniform(&mut rng, rows * cols, 1.0), uniform(&mut rng, cols, 1.0));
        let xt = leaf(device, &x, &[rows, cols])?;
        let s = on_device(device, xt.sum(&[0], false))?;
        let want: Vec<f64> = (0..cols).map(|j| (0..rows).map(|r| f64::from(x[r * cols + j])).sum()).collect();
        close("sum", &fetch(device, &s)?, &want, TOL)?;
        backward_from(device, &s, &g)?;
        close("dx (sum)", &grad(device, &xt)?, &(0..rows * cols).map(|i| f64::from(g[i % cols])).collect::<Vec<_>>(), TOL)?;
        let xt = leaf(device, &x, &[rows, cols])?;
        let m = on_device(device, xt.mean_all())?;
        close("mean", &fetch(device, &m)?, &[x.iter().map(|&v| f64::from(v)).sum::<f64>() / 15.0], TOL)?;
        m.backward()?;
        close("dx (mean)", &grad(device, &xt)?, &[1.0 / 15.0; 15], TOL)
    }

    /// Goal: `reshape` of a contiguous tensor is a view on the same device whose gradient maps
    /// back. Method: x [2, 3, 4] as [6, 4], scaled by 2 (exact); values equal x·2 in order, and
    /// dx = 2·g in x's shape.
    fn reshape_view(device) -> Result<()> {
        let mut rng = seeded(0x21);
        let (x, g) = (uniform(&mut rng, 24, 1.0), uniform(&mut rng, 24, 1.0));
        let xt = leaf(device, &x, &[2, 3, 4])?;
        let v = xt.reshape(&[6, 4])?;
        ensure!(v.shape() == [6, 4] && v.storage().same(xt.storage()), "reshape of a contiguous tensor is not a view");
        let y = v.mul_scalar(2.0)?;
        close("y", &fetch(device, &y)?, &x.iter().map(|&e| 2.0 * f64::from(e)).collect::<Vec<_>>(), 0.0)?;
        backward_from(device, &y, &g)?;
        close("dx", &grad(device, &xt)?, &g.iter().map(|&e| 2.0 * f64::from(e)).collect::<Vec<_>>(), 0.0)
    }

    /// Goal: `transpose` then `contiguous` materialises the transposed matrix on the same
    /// device. Method: x [3, 5] gives [5, 3] with `y[j][i] = x[i][j]` (exact copies).
    /// GPU: the op must stay on the device or refuse with a typed error.
    fn transpose_then_contiguous(device) -> Result<()> {
        let mut rng = seeded(0x22);
        let (rows, cols) = (3, 5);
        let x = uniform(&mut rng, rows * cols, 1.0);
        let xt = on(device, &x, &[rows, cols])?;
        let tr = xt.transpose(0, 1)?;
        ensure!(tr.shape() == [cols, rows] && !tr.is_contiguous(), "transpose is not a strided view: {:?}", tr.shape());
        let y = on_device(device, tr.contiguous())?;
        ensure!(y.is_contiguous(), "contiguous() result is strided");
        let want: Vec<f64> = (0..cols * rows).map(|k| f64::from(x[(k % rows) * cols + k / rows])).collect();
        close("y", &fetch(device, &y)?, &want, 0.0)
    }

    /// Goal: casts f32 → bf16 → f32 are exact on bf16-representable values, round to nearest
    /// even otherwise, and the cast's gradient is the upstream gradient rounded to bf16.
    /// Method: hand-picked representable values and ties; the reference rounds by bit arithmetic.
    fn bf16_cast_round_trip(device) -> Result<()> {
        let exact = [1.0f32, -0.5, 1.5, 3.140625, 65280.0, 1.0 / 1024.0, -7.75, 0.0, 240.0, -0.0009765625];
        for v in exact {
            ensure!(bf16_round(v) == v, "reference: {v} is not representable in bf16");
        }
        // 1 + 2⁻⁸ ties to 1 (even), 1 + 3·2⁻⁹ rounds up to 1 + 2⁻⁷, 1 + 2⁻⁷ + 2⁻⁸ ties up to 1 + 2⁻⁶.
        let ties = [1.0 + 2f32.powi(-8), 1.0 + 3.0 * 2f32.powi(-9), 1.0 + 2f32.powi(-7) + 2f32.powi(-8)];
        ensure!(ties.map(bf16_round) == [1.0, 1.0 + 2f32.powi(-7), 1.0 + 2f32.powi(-6)], "reference rounding is off");
        let x: Vec<f32> = exact.iter().chain(&ties).copied().collect();
        let xt = leaf(device, &x, &[x.len()])?;
        let half = xt.to_dtype(DType::BF16)?;
        ensure!(half.dtype() == DType::BF16, "dtype {:?}", half.dtype());
        let back = half.to_dtype(DType::F32)?;
        let got = fetch(device, &back)?;
        let want: Vec<f32> = x.iter().map(|&v| bf16_round(v)).collect();
        ensure!(got.iter().map(|v| v.to_bits()).eq(want.iter().map(|v| v.to_bits())), "round trip: got {got:?}, want {want:?}");
        let g: Vec<f32> = ties.iter().chain(&exact).copied().collect();
        backward_from(device, &back, &g)?;
        let dx = grad(device, &xt)?;
        ensure!(dx.iter().map(|v| v.to_bits()).eq(g.iter().map(|&v| bf16_round(v).to_bits())), "gradient: got {dx:?}");
        Ok(())
    }

    /// Goal: an out-of-range embedding id is a typed `IndexOutOfRange` on every device, never
    /// a device fault or a silent read. Method: id 10 of a 10-row table (host ids).
    fn embedding_out_of_range_id_is_an_error(device) -> Result<()> {
        let table = on(device, &[0.5f32; 80], &[10, 8])?;
        let r = Tensor::embedding(&table, &Tensor::from_vec(vec![3u32, 10], &[2])?);
        ensure!(matches!(r, Err(Error::IndexOutOfRange { index: 10, size: 10, .. })), "got {r:?}");
        Ok(())
    }

    /// Goal: mismatched inner dims are a typed `ShapeMismatch` for `linear` and `matmul` on every
    /// device (shapes are checked before anything runs). Method: [4, 8] against [5, 7] / [7, 5].
    fn mismatched_matmul_shapes_are_an_error(device) -> Result<()> {
        let x = on(device, &[1.0f32; 32], &[4, 8])?;
        let w = on(device, &[1.0f32; 35], &[5, 7])?;
        let r = x.linear(&w, None);
        ensure!(matches!(r, Err(Error::ShapeMismatch { op: "linear", .. })), "linear: got {r:?}");
        let r = x.matmul(&w.reshape(&[7, 5])?);
        ensure!(matches!(r, Err(Error::ShapeMismatch { op: "matmul", .. })), "matmul: got {r:?}");
        Ok(())
    }

    /// Goal: a target at or past `classes` (in the vocabulary padding) is a typed error naming
    /// the target for the fused head + loss on every device. Method: target 12 with 12
    /// classes of a 16-row weight.
    fn linear_cross_entropy_target_in_padding_is_an_error(device) -> Result<()> {
        let h = on(device, &[0.25f32; 32], &[4, 8])?;
        let w = on(device, &[0.5f32; 128], &[16, 8])?;
        let r = h.linear_cross_entropy_valid(&w, &Tensor::from_vec(vec![1u32, 2, 12, 3], &[4])?, 12, CrossEntropyOptions::default(), 2);
        // The two backends type this differently (the GPU checks host targets up front, the CPU
        // in its cross-entropy kernel, naming the row within the chunk): either names target 12.
        let named = matches!(r, Err(Error::IndexOutOfRange { index: 12, size: 12, .. }))
            || matches!(r, Err(Error::Kernel(rtx_kernels::Error::TargetOutOfRange { target: 12, n_classes: 12, .. })));
        ensure!(named, "got {r:?}");
        Ok(())
    }

    /// Goal: the replica checksum (`bits_checksum`) is the documented digest of the raw element
    /// bits wherever the tensor lives (a GPU hashes it on the device). Method: a naive sequential
    /// FNV-1a per chunk of `CHECKSUM_CHUNK` elements, folded with the element count, written here
    /// from the definition; f32 and bf16, a length that ends in a partial chunk.
    fn bits_checksum_matches_the_definition(device) -> Result<()> {
        const BASIS: u64 = 0xcbf2_9ce4_8422_2325;
        const PRIME: u64 = 0x100_0000_01b3;
        let chunk = rtx_tensor::CHECKSUM_CHUNK;
        let digest = |bits: &[u64]| {
            let folded = bits.chunks(chunk).enumerate().fold(BASIS, |d, (c, part)| {
                let h = part.iter().fold(BASIS ^ c as u64, |h, &b| (h ^ b).wrapping_mul(PRIME));
                (d ^ h).wrapping_mul(PRIME)
            });
            (folded ^ bits.len() as u64).wrapping_mul(PRIME)
        };
        let mut rng = seeded(0x23);
        let n = 9 * chunk + 77;
        let x = uniform(&mut rng, n, 3.0);
        let t = on(device, &x, &[n])?;
        let want = digest(&x.iter().map(|v| u64::from(v.to_bits())).collect::<Vec<u64>>());
        ensure!(t.bits_checksum()? == want, "f32 digest differs from the definition");
        let half = t.to_dtype(DType::BF16)?;
        let halves: Vec<u64> = x.iter().map(|&v| u64::from(bf16_round(v).to_bits() >> 16)).collect();
        ensure!(half.bits_checksum()? == digest(&halves), "bf16 digest differs from the definition");
        Ok(())
    }
}
