//! Finite-difference gradient checks of every differentiable tensor op, in f64, over random shapes.
//!
//! Each test runs a few seeded cases (`RTX_GRADCHECK_CASES`, default 24). Case `i` of test `name`
//! uses seed `fnv1a(name) + i`; the seed draws the shapes, the inputs and gradcheck's output
//! weights. A failure (error or panic) reports the seed, the shapes it drew and a replay command:
//! `RTX_TEST_SEED=<seed>` runs exactly that case. Inputs are drawn away from points where an op
//! is not differentiable (relu/abs at 0, clamp bounds, max/min ties, log/sqrt of non-positives).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use rtx_tensor::{gradcheck, CrossEntropyOptions, DType, Generator, Reduction, Result as TResult, Tensor};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::slice::from_ref;

// ------------------------------------------------------------------------------------ harness

/// Finite-difference step.
const EPS: f64 = 1e-6;
/// Default relative tolerance (|analytic − numeric| / max(1, |numeric|)).
const TOL: f64 = 1e-6;
const DEFAULT_CASES: u64 = 24;

type CaseResult = std::result::Result<(), Box<dyn std::error::Error>>;

fn fnv1a(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ b as u64).wrapping_mul(0x0100_0000_01b3))
}

/// The seeds a test runs: the one in `RTX_TEST_SEED`, else `RTX_GRADCHECK_CASES` derived ones.
fn seeds(name: &str) -> Vec<u64> {
    if let Ok(s) = std::env::var("RTX_TEST_SEED") {
        return vec![s.trim().parse().expect("RTX_TEST_SEED must be a u64")];
    }
    let n = std::env::var("RTX_GRADCHECK_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(DEFAULT_CASES);
    let base = fnv1a(name);
    (0..n).map(|i| base.wrapping_add(i)).collect()
}

/// Runs `case` once per seed; the first failure panics with the seed, the case notes and how to
/// replay it.
fn run_cases(name: &str, case: impl Fn(&mut Case) -> CaseResult) {
    for seed in seeds(name) {
        let mut c = Case { rng: Generator::new(seed), seed, notes: Vec::new() };
        let outcome = catch_unwind(AssertUnwindSafe(|| case(&mut c)));
        let failure = match outcome {
            Ok(Ok(())) => None,
            Ok(Err(e)) => Some(e.to_string()),
            Err(p) => Some(p.downcast_ref::<String>().cloned().or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string())).unwrap_or_else(|| "panic".into())),
        };
        if let Some(msg) = failure {
            panic!(
                "{name}: case with seed {seed} failed: {msg}\n  case: {}\n  replay: RTX_TEST_SEED={seed} cargo test -p rtx-tensor --test gradcheck_ops {name}",
                c.notes.join("; ")
            );
        }
    }
}

/// One random case: a seeded generator for shapes and values, and notes for the failure report.
struct Case {
    rng: Generator,
    seed: u64,
    notes: Vec<String>,
}

impl Case {
    fn note(&mut self, s: impl Into<String>) {
        self.notes.push(s.into());
    }

    fn below(&mut self, n: usize) -> usize {
        self.rng.below(n as u64) as usize
    }

    /// Uniform in `lo..=hi`.
    fn range(&mut self, lo: usize, hi: usize) -> usize {
        lo + self.below(hi - lo + 1)
    }

    fn coin(&mut self) -> bool {
        self.below(2) == 1
    }

    fn pick<T: Copy>(&mut self, xs: &[T]) -> T {
        xs[self.below(xs.len())]
    }

    fn shape(&mut self, rank_lo: usize, rank_hi: usize, dim_lo: usize, dim_hi: usize) -> Vec<usize> {
        let rank = self.range(rank_lo, rank_hi);
        (0..rank).map(|_| self.range(dim_lo, dim_hi)).collect()
    }

    /// A shape and a shape that broadcasts to it: a suffix of it with some dims set to 1.
    fn full_and_broadcast(&mut self) -> (Vec<usize>, Vec<usize>) {
        let full = self.shape(1, 3, 1, 4);
        let skip = self.below(full.len() + 1);
        let mut small = full[skip..].to_vec();
        for d in small.iter_mut() {
            if self.coin() {
                *d = 1;
            }
        }
        (full, small)
    }

    /// Two shapes that broadcast together, in random order (either may be the broadcast one).
    fn broadcast_pair(&mut self) -> (Vec<usize>, Vec<usize>) {
        let (full, small) = self.full_and_broadcast();
        if self.coin() {
            (full, small)
        } else {
            (small, full)
        }
    }

    fn randn(&mut self, shape: &[usize]) -> Tensor {
        Tensor::randn(shape, 0.0, 1.0, DType::F64, &mut self.rng).unwrap()
    }

    fn uniform(&mut self, shape: &[usize], lo: f64, hi: f64) -> Tensor {
        Tensor::rand(shape, lo, hi, DType::F64, &mut self.rng).unwrap()
    }

    /// Normal samples pushed at least `margin` away from every point in `avoid`.
    fn avoiding(&mut self, shape: &[usize], avoid: &[f64], margin: f64) -> Tensor {
        let v: Vec<f64> = self
            .randn(shape)
            .to_f64_vec()
            .unwrap()
            .into_iter()
            .map(|mut x| {
                for &p in avoid {
                    if (x - p).abs() < margin {
                        x = if x >= p { p + margin } else { p - margin };
                    }
                }
                x
            })
            .collect();
        Tensor::from_vec(v, shape).unwrap()
    }

    /// Values on the grid `offset + k/2` for small integers `k`: two grids with offsets 0 and
    /// 0.25 never tie, and stay 0.25 apart.
    fn grid(&mut self, shape: &[usize], offset: f64) -> Tensor {
        let n: usize = shape.iter().product();
        let v: Vec<f64> = (0..n).map(|_| (self.below(13) as f64 - 6.0) * 0.5 + offset).collect();
        Tensor::from_vec(v, shape).unwrap()
    }

    /// Pairwise distinct values (at least 0.15 apart), in random order.
    fn distinct(&mut self, shape: &[usize]) -> Tensor {
        let n: usize = shape.iter().product();
        let mut order: Vec<usize> = (0..n).collect();
        for i in (1..n).rev() {
            let j = self.below(i + 1);
            order.swap(i, j);
        }
        let v: Vec<f64> = order.iter().map(|&k| (k as f64 - n as f64 / 2.0) * 0.25 + (self.rng.uniform() - 0.5) * 0.1).collect();
        Tensor::from_vec(v, shape).unwrap()
    }

    fn ids(&mut self, shape: &[usize], bound: usize) -> Tensor {
        let n: usize = shape.iter().product();
        let v: Vec<u32> = (0..n).map(|_| self.below(bound) as u32).collect();
        Tensor::from_vec(v, shape).unwrap()
    }

    /// A random subset of `0..rank` as possibly negative dims (never empty: empty means "all").
    fn dims(&mut self, rank: usize) -> Vec<isize> {
        let mut out = Vec::new();
        for d in 0..rank {
            if self.coin() {
                out.push(if self.coin() { d as isize - rank as isize } else { d as isize });
            }
        }
        if out.is_empty() {
            out.push(self.below(rank) as isize);
        }
        out
    }

    fn check(&mut self, label: &str, f: impl Fn(&[Tensor]) -> TResult<Tensor>, inputs: &[Tensor]) -> CaseResult {
        self.check_tol(label, TOL, f, inputs)
    }

    fn check_tol(&mut self, label: &str, tol: f64, f: impl Fn(&[Tensor]) -> TResult<Tensor>, inputs: &[Tensor]) -> CaseResult {
        let shapes: Vec<&[usize]> = inputs.iter().map(|t| t.shape()).collect();
        self.note(format!("{label} {shapes:?}"));
        gradcheck(f, inputs, EPS, tol, self.seed).map_err(|e| format!("{label} with inputs {shapes:?}: {e}"))?;
        Ok(())
    }
}

// ------------------------------------------------------------------------------ elementwise

#[test]
fn binary_ops_with_broadcasting() {
    run_cases("binary_ops_with_broadcasting", |c| {
        let (sa, sb) = c.broadcast_pair();
        let (a, b) = (c.randn(&sa), c.randn(&sb));
        c.check("add", |x| x[0].add(&x[1]), &[a.clone(), b.clone()])?;
        c.check("sub", |x| x[0].sub(&x[1]), &[a.clone(), b.clone()])?;
        c.check("mul", |x| x[0].mul(&x[1]), &[a.clone(), b.clone()])?;
        let den = c.avoiding(&sb, &[0.0], 0.5);
        c.check("div", |x| x[0].div(&x[1]), &[a.clone(), den])?;
        let base = c.uniform(&sa, 0.5, 2.0);
        c.check("pow", |x| x[0].pow(&x[1]), &[base, b.clone()])?;
        let (ga, gb) = (c.grid(&sa, 0.0), c.grid(&sb, 0.25));
        c.check("maximum", |x| x[0].maximum(&x[1]), &[ga.clone(), gb.clone()])?;
        c.check("minimum", |x| x[0].minimum(&x[1]), &[ga, gb])?;
        // The same operand on both sides accumulates two gradients.
        c.check("mul self", |x| x[0].mul(&x[0])?.sub(&x[0]), &[a])
    });
}

#[test]
fn unary_ops() {
    run_cases("unary_ops", |c| {
        let s = c.shape(0, 3, 1, 4);
        let x = c.randn(&s);
        let pos = c.uniform(&s, 0.5, 2.5);
        let away = c.avoiding(&s, &[0.0], 0.1);
        c.check("neg", |t| t[0].neg(), from_ref(&x))?;
        c.check("exp", |t| t[0].exp(), from_ref(&x))?;
        c.check("log", |t| t[0].log(), from_ref(&pos))?;
        c.check("sqrt", |t| t[0].sqrt(), from_ref(&pos))?;
        c.check("rsqrt", |t| t[0].rsqrt(), from_ref(&pos))?;
        c.check("tanh", |t| t[0].tanh(), from_ref(&x))?;
        c.check("sigmoid", |t| t[0].sigmoid(), from_ref(&x))?;
        c.check("relu", |t| t[0].relu(), from_ref(&away))?;
        c.check("gelu", |t| t[0].gelu(), from_ref(&x))?;
        c.check("silu", |t| t[0].silu(), from_ref(&x))?;
        c.check("abs", |t| t[0].abs(), from_ref(&away))?;
        c.check("square", |t| t[0].square(), from_ref(&x))?;
        c.check("affine", |t| t[0].affine(-1.5, 0.25), from_ref(&x))?;
        let p = c.pick(&[2.0, 3.0, 0.5, -1.5]);
        c.check(&format!("pow_scalar {p}"), move |t| t[0].pow_scalar(p), &[pos])?;
        c.check("pow_scalar 3 (negative base)", |t| t[0].pow_scalar(3.0), &[x])?;
        let (lo, hi) = (-0.5, 0.7);
        let xc = c.avoiding(&s, &[lo, hi], 0.05);
        c.check("clamp", move |t| t[0].clamp(Some(lo), Some(hi)), from_ref(&xc))?;
        c.check("clamp min", move |t| t[0].clamp(Some(lo), None), from_ref(&xc))?;
        c.check("clamp max", move |t| t[0].clamp(None, Some(hi)), &[xc])
    });
}

#[test]
fn where_and_masked_fill() {
    run_cases("where_and_masked_fill", |c| {
        let (sa, sb) = c.broadcast_pair();
        let sm = if c.coin() { sa.clone() } else { sb.clone() };
        let mask = c.ids(&sm, 2);
        let (a, b) = (c.randn(&sa), c.randn(&sb));
        let m = mask.clone();
        c.check("where", move |x| Tensor::where_(&m, &x[0], &x[1]), &[a.clone(), b])?;
        let m = mask.clone();
        c.check("masked_fill", move |x| x[0].masked_fill(&m, -3.0)?.mul(&x[0]), &[a])
    });
}

// ---------------------------------------------------------------------------------- matmul

#[test]
fn matmul_shapes_and_layouts() {
    run_cases("matmul_shapes_and_layouts", |c| {
        let (m, k, n) = (c.range(1, 4), c.range(1, 4), c.range(1, 4));
        let (b1, b2) = (c.range(1, 3), c.range(1, 3));
        let mm = |x: &[Tensor]| x[0].matmul(&x[1]);
        let (a, b) = (c.randn(&[m, k]), c.randn(&[k, n]));
        c.check("matmul 2-d", mm, &[a, b])?;
        let (a, b) = (c.randn(&[b1, m, k]), c.randn(&[b1, k, n]));
        c.check("matmul batched", mm, &[a, b])?;
        let (a, b) = (c.randn(&[b1, 1, m, k]), c.randn(&[b2, k, n]));
        c.check("matmul broadcast batch", mm, &[a, b])?;
        let (a, b) = (c.randn(&[k, m]), c.randn(&[n, k]));
        c.check("matmul transposed operands", |x| x[0].t()?.matmul(&x[1].t()?), &[a, b])?;
        let (a, b) = (c.randn(&[b1, k, m]), c.randn(&[b1, k, n]));
        c.check("matmul batched transposed lhs", |x| x[0].transpose(-2, -1)?.matmul(&x[1]), &[a, b])?;
        let (a, b) = (c.randn(&[b1, m, k]), c.randn(&[k, n]));
        c.check("matmul batched @ matrix (folded)", mm, &[a, b])?;
        let (a, b) = (c.randn(&[m, b1, k]), c.randn(&[k, n]));
        c.check("matmul strided batch @ matrix", |x| x[0].transpose(0, 1)?.matmul(&x[1]), &[a, b])?;
        let (a, b) = (c.randn(&[m, k]), c.randn(&[b1, k, n]));
        c.check("matmul matrix @ batched", mm, &[a, b])
    });
}

#[test]
fn linear_with_and_without_bias() {
    run_cases("linear_with_and_without_bias", |c| {
        let (rows, n_in, n_out, b1) = (c.range(1, 4), c.range(1, 4), c.range(1, 4), c.range(1, 3));
        let (x, w, b) = (c.randn(&[b1, rows, n_in]), c.randn(&[n_out, n_in]), c.randn(&[n_out]));
        c.check("linear with bias", |t| t[0].linear(&t[1], Some(&t[2])), &[x.clone(), w.clone(), b.clone()])?;
        c.check("linear without bias", |t| t[0].linear(&t[1], None), &[x.clone(), w.clone()])?;
        let v = c.randn(&[n_in]);
        c.check("linear on a vector", |t| t[0].linear(&t[1], Some(&t[2])), &[v, w.clone(), b.clone()])?;
        // A transposed input and weight take the composed path; same answer.
        let (xt, wt) = (c.randn(&[n_in, rows]), c.randn(&[n_in, n_out]));
        c.check("linear strided operands", |t| t[0].transpose(0, 1)?.linear(&t[1].t()?, Some(&t[2])), &[xt, wt, b])
    });
}

// ------------------------------------------------------------------------------ reductions

#[test]
fn reductions_over_dims() {
    run_cases("reductions_over_dims", |c| {
        let s = c.shape(1, 3, 1, 4);
        let dims = c.dims(s.len());
        c.note(format!("dims {dims:?}"));
        let x = c.randn(&s);
        let xd = c.distinct(&s);
        let count: usize = dims.iter().map(|&d| s[d.rem_euclid(s.len() as isize) as usize]).product();
        let correction = if count >= 2 { c.pick(&[0, 1]) } else { 0 };
        for keepdim in [false, true] {
            let d = dims.clone();
            c.check(&format!("sum keepdim {keepdim}"), move |t| t[0].sum(&d, keepdim), from_ref(&x))?;
            let d = dims.clone();
            c.check(&format!("mean keepdim {keepdim}"), move |t| t[0].mean(&d, keepdim), from_ref(&x))?;
            let d = dims.clone();
            c.check(&format!("var correction {correction} keepdim {keepdim}"), move |t| t[0].var(&d, keepdim, correction), from_ref(&x))?;
            let d = dims.clone();
            c.check(&format!("max keepdim {keepdim}"), move |t| t[0].max(&d, keepdim), from_ref(&xd))?;
            let d = dims.clone();
            c.check(&format!("min keepdim {keepdim}"), move |t| t[0].min(&d, keepdim), from_ref(&xd))?;
        }
        c.check("sum_all", |t| t[0].sum_all(), from_ref(&x))?;
        c.check("mean_all", |t| t[0].mean_all(), &[x])?;
        c.check("max all", |t| t[0].max(&[], false), &[xd])?;
        let (big, target) = c.full_and_broadcast();
        let xs = c.randn(&big);
        c.check("sum_to_shape", move |t| t[0].sum_to_shape(&target), &[xs])
    });
}

#[test]
fn softmax_and_log_softmax() {
    run_cases("softmax_and_log_softmax", |c| {
        let s = c.shape(1, 3, 1, 5);
        let dim = c.below(s.len()) as isize - if c.coin() { s.len() as isize } else { 0 };
        c.note(format!("dim {dim}"));
        let x = c.randn(&s).mul_scalar(2.0)?;
        c.check("softmax", move |t| t[0].softmax(dim), from_ref(&x))?;
        c.check("log_softmax", move |t| t[0].log_softmax(dim), &[x])
    });
}

// --------------------------------------------------------------------------- normalization

#[test]
fn layer_norm_and_rms_norm() {
    run_cases("layer_norm_and_rms_norm", |c| {
        let mut s = c.shape(1, 3, 1, 3);
        let n = c.range(2, 6);
        let last = s.len() - 1;
        s[last] = n;
        let (has_w, has_b, transposed) = (c.coin(), c.coin(), s.len() >= 2 && c.coin());
        c.note(format!("weight {has_w} bias {has_b} transposed input {transposed}"));
        // A transposed leaf makes the op read a strided input.
        let leaf_shape = if transposed {
            let mut t = s.clone();
            t.swap(last - 1, last);
            t
        } else {
            s.clone()
        };
        let x = c.randn(&leaf_shape).mul_scalar(1.5)?.add_scalar(0.3)?;
        let mut inputs = vec![x];
        if has_w {
            inputs.push(c.randn(&[n]));
        }
        if has_b {
            inputs.push(c.randn(&[n]));
        }
        let input = move |t: &[Tensor]| if transposed { t[0].transpose(-2, -1) } else { Ok(t[0].clone()) };
        c.check(
            "layer_norm",
            move |t| {
                let w = has_w.then(|| &t[1]);
                let b = has_b.then(|| &t[1 + has_w as usize]);
                input(t)?.layer_norm(w, b, 1e-5)
            },
            &inputs,
        )?;
        let rms_inputs: Vec<Tensor> = inputs.iter().take(1 + has_w as usize).cloned().collect();
        c.check(
            "rms_norm",
            move |t| {
                let w = has_w.then(|| &t[1]);
                input(t)?.rms_norm(w, 1e-5)
            },
            &rms_inputs,
        )
    });
}

// ----------------------------------------------------------------------------------- index

#[test]
fn embedding_index_select_gather() {
    run_cases("embedding_index_select_gather", |c| {
        let (v, d) = (c.range(1, 5), c.range(1, 4));
        let ids_shape = c.shape(0, 2, 1, 4);
        let ids = c.ids(&ids_shape, v);
        let transposed = c.coin();
        c.note(format!("ids {:?} transposed table {transposed}", ids.to_u32_vec()?));
        let table = if transposed { c.randn(&[d, v]) } else { c.randn(&[v, d]) };
        let i = ids.clone();
        c.check("embedding", move |t| Tensor::embedding(&if transposed { t[0].t()? } else { t[0].clone() }, &i)?.tanh(), &[table])?;

        let s = c.shape(1, 3, 1, 4);
        let dim = c.below(s.len());
        let len = c.range(1, 5);
        let index = c.ids(&[len], s[dim]);
        c.note(format!("index_select dim {dim} index {:?}", index.to_u32_vec()?));
        // Odd dims are passed counting from the end.
        let dim_arg = if dim % 2 == 1 { dim as isize - s.len() as isize } else { dim as isize };
        let x = c.randn(&s);
        c.check("index_select", move |t| t[0].index_select(dim_arg, &index), &[x])?;

        let s = c.shape(1, 3, 1, 4);
        let dim = c.below(s.len());
        let index_shape: Vec<usize> = s.iter().enumerate().map(|(i, &n)| if i == dim { c.range(1, 4) } else { c.range(1, n) }).collect();
        let index = c.ids(&index_shape, s[dim]);
        c.note(format!("gather dim {dim} index {index_shape:?}"));
        let x = c.randn(&s);
        c.check("gather", move |t| t[0].gather(dim as isize, &index), &[x])
    });
}

// ---------------------------------------------------------------------------- shape / view

#[test]
fn joins_and_splits() {
    run_cases("joins_and_splits", |c| {
        let s = c.shape(1, 3, 1, 4);
        let dim = c.below(s.len());
        let n_parts = c.range(1, 3);
        let parts: Vec<Tensor> = (0..n_parts)
            .map(|_| {
                let mut p = s.clone();
                p[dim] = c.range(1, 3);
                c.randn(&p)
            })
            .collect();
        c.check("cat", move |t| Tensor::cat(&t.iter().collect::<Vec<_>>(), dim as isize), &parts)?;
        let same: Vec<Tensor> = (0..n_parts).map(|_| c.randn(&s)).collect();
        let new_dim = c.below(s.len() + 1) as isize;
        c.check("stack", move |t| Tensor::stack(&t.iter().collect::<Vec<_>>(), new_dim), &same)?;
        // Each piece gets its own scale so a misrouted gradient shows.
        let x = c.randn(&s);
        let size = c.range(1, 3);
        let weigh = |pieces: Vec<Tensor>, d: usize| -> TResult<Tensor> {
            let scaled = pieces.iter().enumerate().map(|(i, p)| p.mul_scalar(i as f64 + 1.0)?.tanh()).collect::<TResult<Vec<_>>>()?;
            Tensor::cat(&scaled.iter().collect::<Vec<_>>(), d as isize)
        };
        c.check(&format!("split {size} dim {dim}"), move |t| weigh(t[0].split(size, dim as isize)?, dim), from_ref(&x))?;
        let chunks = c.range(1, 4);
        c.check(&format!("chunk {chunks} dim {dim}"), move |t| weigh(t[0].chunk(chunks, dim as isize)?, dim), &[x])
    });
}

#[test]
fn views() {
    run_cases("views", |c| {
        let s = c.shape(1, 4, 1, 3);
        let rank = s.len();
        let x = c.randn(&s);
        let y = c.randn(&s);
        // Every view is followed by an op that reads it through its strides.
        let mut perm: Vec<usize> = (0..rank).collect();
        for i in (1..rank).rev() {
            let j = c.below(i + 1);
            perm.swap(i, j);
        }
        c.note(format!("perm {perm:?}"));
        let p = perm.clone();
        c.check("permute", move |t| t[0].permute(&p)?.tanh(), from_ref(&x))?;
        let (d0, d1) = (c.below(rank) as isize, c.below(rank) as isize - rank as isize);
        c.check("transpose", move |t| t[0].transpose(d0, d1)?.exp(), from_ref(&x))?;
        let p = perm.clone();
        c.check("contiguous", move |t| t[0].permute(&p)?.contiguous()?.square(), from_ref(&x))?;
        let reversed: Vec<usize> = s.iter().rev().cloned().collect();
        c.check("reshape of a permuted view", move |t| t[0].permute(&perm)?.reshape(&reversed)?.tanh(), from_ref(&x))?;
        c.check("reshape infer", |t| t[0].reshape(&[usize::MAX])?.tanh(), from_ref(&x))?;
        let d = c.below(rank);
        let start = c.below(s[d]);
        let len = c.range(1, s[d] - start);
        c.check(&format!("narrow dim {d} {start}+{len}"), move |t| t[0].narrow(d as isize, start, len)?.exp(), from_ref(&x))?;
        let u = c.below(rank + 1) as isize;
        c.check(&format!("unsqueeze {u} then squeeze"), move |t| t[0].unsqueeze(u)?.tanh()?.squeeze(u), from_ref(&x))?;
        let (f0, f1) = (0isize, c.below(rank) as isize);
        c.check("flatten", move |t| t[0].flatten(f0, f1)?.tanh(), from_ref(&x))?;
        // expand: a size-1 dim and a new leading dim.
        let mut one = s.clone();
        let e = c.below(rank);
        one[e] = 1;
        let small = c.randn(&one);
        let mut target = vec![2];
        target.extend_from_slice(&s);
        c.check("expand", move |t| t[0].expand(&target)?.tanh(), &[small])?;
        let m = c.randn(&[s[0], s[rank - 1]]);
        c.check("t", |t| t[0].t()?.matmul(&t[0]), &[m])?;
        c.check("view then mul", |t| t[0].view(&[usize::MAX])?.mul(&t[1].view(&[usize::MAX])?), &[x, y])
    });
}

#[test]
fn to_dtype_round_trips() {
    run_cases("to_dtype_round_trips", |c| {
        let s = c.shape(1, 2, 1, 4);
        let n: usize = s.iter().product();
        // Values on a coarse grid, and a step that keeps x ± step exact in the narrow type, so
        // the round trip is exact and the difference quotient of x² is exact too.
        c.note(format!("shape {s:?}"));
        let f32_grid: Vec<f64> = (0..n).map(|_| (c.below(256) as f64 - 128.0) / 64.0).collect();
        let x = Tensor::from_vec(f32_grid, &s)?;
        gradcheck(|t| t[0].to_dtype(DType::F32)?.to_dtype(DType::F64)?.mul(&t[0]), from_ref(&x), 1.0 / 1024.0, TOL, c.seed).map_err(|e| format!("to_dtype f32: {e}"))?;
        gradcheck(|t| t[0].to_dtype(DType::F64)?.tanh(), &[x], EPS, TOL, c.seed).map_err(|e| format!("to_dtype f64: {e}"))?;
        // bf16 keeps 8 significant bits: |x| ≤ 2 on a 1/8 grid, ± 1/64, fits.
        let bf16_grid: Vec<f64> = (0..n).map(|_| (c.below(32) as f64 - 16.0) / 8.0).collect();
        let x = Tensor::from_vec(bf16_grid, &s)?;
        // The gradient of a bf16 tensor is bf16, so the check can only be as exact as bf16.
        gradcheck(|t| t[0].to_dtype(DType::BF16)?.to_dtype(DType::F64)?.mul(&t[0]), &[x], 1.0 / 64.0, 1e-2, c.seed).map_err(|e| format!("to_dtype bf16: {e}"))?;
        Ok(())
    });
}

// ------------------------------------------------------------------------- losses, dropout

#[test]
fn cross_entropy_and_mse() {
    run_cases("cross_entropy_and_mse", |c| {
        let rows = c.shape(1, 2, 1, 4);
        let n_classes = c.range(2, 5);
        let mut s = rows.clone();
        s.push(n_classes);
        let targets = c.ids(&rows, n_classes);
        let ignore = if c.coin() { Some(c.below(n_classes) as i64) } else { None };
        let label_smoothing = c.pick(&[0.0, 0.1, 0.3]);
        let reduction = c.pick(&[Reduction::Mean, Reduction::Sum, Reduction::None]);
        let opts = CrossEntropyOptions { ignore_index: ignore, label_smoothing, reduction };
        c.note(format!("targets {:?} {opts:?}", targets.to_u32_vec()?));
        let logits = c.randn(&s).mul_scalar(2.0)?;
        let all_ignored = targets.to_u32_vec()?.iter().all(|&t| Some(i64::from(t)) == ignore);
        if all_ignored && reduction == Reduction::Mean {
            // Nothing counts: PyTorch's 0/0 = NaN with a zero gradient, no derivative to check.
            let x = logits.requires_grad(true);
            let loss = x.cross_entropy(&targets, opts)?;
            assert!(loss.item()?.is_nan(), "mean over no counted row: {loss:?}");
            loss.backward()?;
            assert!(x.grad().ok_or("no gradient")?.to_f64_vec()?.iter().all(|&g| g == 0.0));
        } else {
            c.check("cross_entropy", move |t| t[0].cross_entropy(&targets, opts), &[logits])?;
        }
        let (a, b) = (c.randn(&s), c.randn(&s));
        c.check(&format!("mse {reduction:?}"), move |t| t[0].mse(&t[1], reduction), &[a, b])
    });
}

#[test]
fn dropout_with_a_fixed_mask() {
    run_cases("dropout_with_a_fixed_mask", |c| {
        let s = c.shape(1, 3, 1, 5);
        let p = c.pick(&[0.2, 0.5, 0.8]);
        let mask_seed = c.rng.next_u64();
        c.note(format!("p {p} mask seed {mask_seed}"));
        let (x, y) = (c.randn(&s), c.randn(&s));
        // A fresh generator per evaluation: every evaluation draws the same mask.
        c.check("dropout", move |t| t[0].dropout(p, true, &mut Generator::new(mask_seed))?.mul(&t[1]), &[x.clone(), y])?;
        c.check("dropout eval", |t| t[0].dropout(0.5, false, &mut Generator::new(0))?.tanh(), &[x])
    });
}

// ------------------------------------------------------------------------------- attention

#[test]
fn scaled_dot_product_attention() {
    run_cases("scaled_dot_product_attention", |c| {
        let batch = c.shape(0, 2, 1, 2);
        let (tq, tk, d, dv) = (c.range(1, 4), c.range(1, 4), c.range(1, 3), c.range(1, 3));
        let scale = if c.coin() { Some(0.7) } else { None };
        let with = |b: &[usize], x: usize, y: usize| -> Vec<usize> { b.iter().cloned().chain([x, y]).collect() };
        // k and v may broadcast over the first batch dim (as grouped-query attention does).
        let kv_batch: Vec<usize> = if !batch.is_empty() && c.coin() { std::iter::once(1).chain(batch[1..].iter().cloned()).collect() } else { batch.clone() };
        let mask = match c.below(3) {
            0 => None,
            1 => Some(c.ids(&[tk], 2)),
            _ => Some(c.ids(&with(&batch, tq, tk), 2)),
        };
        c.note(format!("batch {batch:?} kv {kv_batch:?} tq {tq} tk {tk} scale {scale:?} mask {:?}", mask.as_ref().map(|m| m.to_u32_vec().unwrap())));
        let qkv = [c.randn(&with(&batch, tq, d)), c.randn(&with(&kv_batch, tk, d)), c.randn(&with(&kv_batch, tk, dv))];
        // Fully masked rows are allowed here: they must give zeros and a zero gradient.
        for causal in [false, true] {
            let m = mask.clone();
            c.check(&format!("scaled_dot_product_attention causal {causal}"), move |t| Tensor::scaled_dot_product_attention(&t[0], &t[1], &t[2], m.as_ref(), causal, scale), &qkv)?;
        }
        // q, k and v as strided views of one packed projection, as multi-head attention makes
        // them: [B, T, 3·H·D] -> [B, T, 3, H, D] -> [3, B, H, T, D].
        let (b, t, h, hd) = (c.range(1, 2), c.range(1, 3), c.range(1, 2), c.range(1, 2));
        let packed = c.randn(&[b, t, 3 * h * hd]);
        c.check(
            "scaled_dot_product_attention packed views",
            move |x| {
                let qkv = x[0].reshape(&[b, t, 3, h, hd])?.permute(&[2, 0, 3, 1, 4])?;
                let part = |i: usize| qkv.narrow(0, i, 1)?.squeeze(0);
                Tensor::scaled_dot_product_attention(&part(0)?, &part(1)?, &part(2)?, None, true, None)?.transpose(1, 2)?.reshape(&[b, t, h * hd])
            },
            std::slice::from_ref(&packed),
        )?;
        for causal in [false, true] {
            c.check(&format!("scaled_dot_product_attention_packed causal {causal}"), move |x| Tensor::scaled_dot_product_attention_packed(&x[0], h, causal, None), std::slice::from_ref(&packed))?;
        }
        Ok(())
    });
}

// ------------------------------------------------------------------------------- composite

#[test]
fn transformer_block_composite() {
    run_cases("transformer_block_composite", |c| {
        // pre-norm block: x + attn(ln(x)) then rms_norm → gelu MLP → cross-entropy.
        let (b, t, e) = (c.range(1, 2), c.range(1, 3), c.range(2, 3));
        let classes = c.range(2, 3);
        let targets = c.ids(&[b, t], classes);
        let inputs = vec![c.randn(&[b, t, e]), c.randn(&[e]), c.randn(&[e]), c.randn(&[e, 3 * e]), c.randn(&[e, classes])];
        let dropout_seed = c.rng.next_u64();
        // Layer norm over 2-3 features amplifies rounding when two features nearly tie.
        c.check_tol(
            "transformer block",
            1e-5,
            move |p| {
                let h = p[0].layer_norm(Some(&p[1]), Some(&p[2]), 1e-5)?;
                let qkv = h.matmul(&p[3])?.chunk(3, -1)?;
                let a = Tensor::scaled_dot_product_attention(&qkv[0], &qkv[1], &qkv[2], None, true, None)?;
                let x = p[0].add(&a.dropout(0.25, true, &mut Generator::new(dropout_seed))?)?;
                let logits = x.rms_norm(None, 1e-6)?.gelu()?.matmul(&p[4])?;
                logits.cross_entropy(&targets, CrossEntropyOptions::default())
            },
            &inputs,
        )
    });
}
