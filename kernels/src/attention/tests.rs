//! Tests of the attention kernels against a plain f64 reference and finite differences.
#![allow(clippy::unwrap_used)]
use super::*;

/// Reference attention of one head in f64, straight from the definition.
fn reference(spec: AttentionSpec, q: &[f64], k: &[f64], v: &[f64]) -> (Vec<f64>, Vec<f64>) {
    let AttentionSpec { tq, tk, d, dv, causal, scale } = spec;
    let mut out = vec![0.0; tq * dv];
    let mut probs = vec![0.0; tq * tk];
    for i in 0..tq {
        let seen = if causal { (i + 1).min(tk) } else { tk };
        if seen == 0 {
            continue;
        }
        let s: Vec<f64> = (0..seen).map(|j| scale * (0..d).map(|c| q[i * d + c] * k[j * d + c]).sum::<f64>()).collect();
        let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let z: f64 = s.iter().map(|x| (x - m).exp()).sum();
        for j in 0..seen {
            let p = (s[j] - m).exp() / z;
            probs[i * tk + j] = p;
            for c in 0..dv {
                out[i * dv + c] += p * v[j * dv + c];
            }
        }
    }
    (out, probs)
}

fn rand_vec(n: usize, seed: &mut u64) -> Vec<f64> {
    (0..n)
        .map(|_| {
            *seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((*seed >> 11) as f64 / (1u64 << 53) as f64) * 2.0 - 1.0
        })
        .collect()
}

#[test]
fn forward_matches_reference_and_backward_matches_finite_differences() {
    let mut seed = 7u64;
    // Widths up to SMALL_HEAD take the register tiles, wider ones gemm.
    for &(tq, tk, d, dv, causal) in &[(5, 7, 3, 2, false), (7, 5, 3, 4, true), (37, 37, 8, 5, true), (33, 70, 4, 3, false), (1, 1, 1, 1, true), (9, 11, 40, 36, false), (35, 35, 33, 34, true)] {
        let spec = AttentionSpec { tq, tk, d, dv, causal, scale: 0.7 };
        let n_heads = 2;
        let (q, k, v) = (rand_vec(n_heads * tq * d, &mut seed), rand_vec(n_heads * tk * d, &mut seed), rand_vec(n_heads * tk * dv, &mut seed));
        let (q, k, v) = (q.as_slice(), k.as_slice(), v.as_slice());
        let (oq, ok, ov): (Vec<usize>, Vec<usize>, Vec<usize>) =
            ((0..n_heads).map(|h| h * tq * d).collect(), (0..n_heads).map(|h| h * tk * d).collect(), (0..n_heads).map(|h| h * tk * dv).collect());
        let qv = Heads { data: q, offsets: &oq, row_stride: d };
        let kv = Heads { data: k, offsets: &ok, row_stride: d };
        let vv = Heads { data: v, offsets: &ov, row_stride: dv };
        let mut out = vec![0.0; n_heads * tq * dv];
        let mut probs = vec![0.0; n_heads * tq * tk];
        attention_forward(spec, qv, kv, vv, &mut out, &mut probs).unwrap();
        for h in 0..n_heads {
            let (ro, rp) = reference(spec, &q[h * tq * d..(h + 1) * tq * d], &k[h * tk * d..(h + 1) * tk * d], &v[h * tk * dv..(h + 1) * tk * dv]);
            for (a, b) in out[h * tq * dv..(h + 1) * tq * dv].iter().zip(&ro) {
                assert!((a - b).abs() < 1e-12, "out {a} vs {b} at {spec:?}");
            }
            for (a, b) in probs[h * tq * tk..(h + 1) * tq * tk].iter().zip(&rp) {
                assert!((a - b).abs() < 1e-12, "probs {a} vs {b} at {spec:?}");
            }
        }
        // Backward against central differences of L = Σ out ⊙ w.
        let w = rand_vec(n_heads * tq * dv, &mut seed);
        let (mut dq, mut dk, mut dvv) = (vec![0.0; q.len()], vec![0.0; k.len()], vec![0.0; v.len()]);
        let ow: Vec<usize> = (0..n_heads).map(|h| h * tq * dv).collect();
        let wv = Heads { data: w.as_slice(), offsets: &ow, row_stride: dv };
        attention_backward(spec, qv, kv, vv, &probs, wv, &mut dq, &mut dk, &mut dvv).unwrap();
        let loss = |q: &[f64], k: &[f64], v: &[f64]| -> f64 {
            let mut total = 0.0;
            for h in 0..n_heads {
                let (ro, _) = reference(spec, &q[h * tq * d..(h + 1) * tq * d], &k[h * tk * d..(h + 1) * tk * d], &v[h * tk * dv..(h + 1) * tk * dv]);
                total += ro.iter().zip(&w[h * tq * dv..(h + 1) * tq * dv]).map(|(a, b)| a * b).sum::<f64>();
            }
            total
        };
        let eps = 1e-6;
        for (which, grad) in [(0, &dq), (1, &dk), (2, &dvv)] {
            let base: Vec<f64> = [q, k, v][which].to_vec();
            for idx in (0..base.len()).step_by(3) {
                let mut plus = base.clone();
                let mut minus = base.clone();
                plus[idx] += eps;
                minus[idx] -= eps;
                let pick = |x: &[f64]| -> f64 {
                    match which {
                        0 => loss(x, k, v),
                        1 => loss(q, x, v),
                        _ => loss(q, k, x),
                    }
                };
                let num = (pick(&plus) - pick(&minus)) / (2.0 * eps);
                assert!((num - grad[idx]).abs() < 1e-6, "grad {which}[{idx}]: numeric {num} vs {} at {spec:?}", grad[idx]);
            }
        }
    }
}

#[test]
fn packed_calls_equal_per_head_calls_bit_for_bit() {
    // Goal: the packed entry points, which write [B, T, H, D] and [B, T, 3, H, D] in place, give
    // exactly the per-head results of the dense ones, for tiled and gemm widths, causal or not.
    let mut seed = 5u64;
    for &(b, h, t, d, causal) in &[(3usize, 2usize, 37usize, 12usize, false), (2, 3, 20, 16, true), (2, 2, 9, 40, true)] {
        let c = h * d;
        let spec = AttentionSpec { tq: t, tk: t, d, dv: d, causal, scale: 0.3 };
        let qkv: Vec<f32> = rand_vec(b * t * 3 * c, &mut seed).into_iter().map(|x| x as f32).collect();
        let dout: Vec<f32> = rand_vec(b * t * c, &mut seed).into_iter().map(|x| x as f32).collect();
        let (mut out, mut probs, mut dqkv) = (vec![0f32; b * t * c], vec![0f32; packed_probs_len(&spec, b, h)], vec![1f32; b * t * 3 * c]);
        attention_forward_packed(spec, &qkv, b, h, &mut out, &mut probs).unwrap();
        attention_backward_packed(spec, &qkv, b, h, &probs, &dout, &mut dqkv).unwrap();
        // The same heads through the dense calls.
        let offs = |s: usize| (0..b * h).map(|i| (i / h) * t * 3 * c + s * c + (i % h) * d).collect::<Vec<_>>();
        let (oq, ok, ov) = (offs(0), offs(1), offs(2));
        let og: Vec<usize> = (0..b * h).map(|i| (i / h) * t * c + (i % h) * d).collect();
        let heads = |o| Heads { data: &qkv, offsets: o, row_stride: 3 * c };
        let (mut out_d, mut probs_d) = (vec![0f32; b * h * t * d], vec![0f32; b * h * t * t]);
        attention_forward(spec, heads(&oq), heads(&ok), heads(&ov), &mut out_d, &mut probs_d).unwrap();
        let (mut dq, mut dk, mut dv) = (vec![0f32; b * h * t * d], vec![0f32; b * h * t * d], vec![0f32; b * h * t * d]);
        attention_backward(spec, heads(&oq), heads(&ok), heads(&ov), &probs_d, Heads { data: &dout, offsets: &og, row_stride: c }, &mut dq, &mut dk, &mut dv).unwrap();
        let p_rs = probs_row_stride(&spec);
        for row in 0..b * h * t {
            assert_eq!(probs[row * p_rs..row * p_rs + t], probs_d[row * t..(row + 1) * t], "weights row {row}");
        }
        for i in 0..b * h {
            let (bi, hi) = (i / h, i % h);
            for r in 0..t {
                let dense = |x: &[f32]| x[(i * t + r) * d..(i * t + r + 1) * d].to_vec();
                let at = |base: usize, stride: usize, x: &[f32]| x[base + r * stride..base + r * stride + d].to_vec();
                assert_eq!(at(bi * t * c + hi * d, c, &out), dense(&out_d), "out ({b},{h},{t},{d}) head {i} row {r}");
                for (s, g) in [(0, &dq), (1, &dk), (2, &dv)] {
                    assert_eq!(at(bi * t * 3 * c + s * c + hi * d, 3 * c, &dqkv), dense(g), "part {s} head {i} row {r}");
                }
            }
        }
    }
}

#[test]
fn strided_heads_and_threads_do_not_change_results() {
    // Q, K, V interleaved as in a packed [T, 3, H, D] projection.
    let (t, h, d) = (40usize, 3usize, 4usize);
    let mut seed = 3u64;
    let packed: Vec<f32> = rand_vec(t * 3 * h * d, &mut seed).into_iter().map(|x| x as f32).collect();
    let rs = 3 * h * d;
    let offs = |which: usize| (0..h).map(|hh| which * h * d + hh * d).collect::<Vec<_>>();
    let (oq, ok, ov) = (offs(0), offs(1), offs(2));
    let spec = AttentionSpec { tq: t, tk: t, d, dv: d, causal: true, scale: 0.5 };
    let mk = |o: &[usize]| -> Vec<f32> {
        (0..h).flat_map(|hh| (0..t).flat_map(move |r| (0..d).map(move |c| (hh, r, c)))).map(|(hh, r, c)| packed[o[hh] + r * rs + c]).collect()
    };
    let (cq, ck, cv) = (mk(&oq), mk(&ok), mk(&ov));
    let dense: Vec<usize> = (0..h).map(|hh| hh * t * d).collect();
    let run = |qd: &[f32], qo: &[usize], kd: &[f32], ko: &[usize], vd: &[f32], vo: &[usize], stride: usize| {
        let mut out = vec![0f32; h * t * d];
        let mut probs = vec![0f32; h * t * t];
        attention_forward(
            spec,
            Heads { data: qd, offsets: qo, row_stride: stride },
            Heads { data: kd, offsets: ko, row_stride: stride },
            Heads { data: vd, offsets: vo, row_stride: stride },
            &mut out,
            &mut probs,
        )
        .unwrap();
        out
    };
    let a = run(&packed, &oq, &packed, &ok, &packed, &ov, rs);
    let b = run(&cq, &dense, &ck, &dense, &cv, &dense, d);
    assert_eq!(a, b);
}

#[test]
fn wrong_lengths_are_typed_errors() {
    // Two heads of 3 rows × 2 columns, dense.
    let (tq, tk, d, n) = (3usize, 3usize, 2usize, 2usize);
    let spec = AttentionSpec { tq, tk, d, dv: d, causal: false, scale: 1.0 };
    let data = &vec![0.5f64; n * tq * d][..];
    let offs = &[0, tq * d][..];
    fn heads<'a>(data: &'a [f64], offsets: &'a [usize]) -> Heads<'a, f64> {
        Heads { data, offsets, row_stride: 2 }
    }
    let short = |op, buffer, needed, actual| Err(Error::BufferTooSmall { op, buffer, needed, actual });
    let (mut out, mut probs) = (vec![0.0; n * tq * d], vec![0.0; n * tq * tk]);
    let op = "attention_forward";
    assert_eq!(attention_forward(spec, heads(data, offs), heads(data, offs), heads(data, offs), &mut out[..11], &mut probs), short(op, "out", 12, 11));
    assert_eq!(attention_forward(spec, heads(data, offs), heads(data, offs), heads(data, offs), &mut out, &mut probs[..17]), short(op, "probs", 18, 17));
    assert_eq!(attention_forward(spec, heads(&data[..11], offs), heads(data, offs), heads(data, offs), &mut out, &mut probs), short(op, "q", 12, 11));
    assert_eq!(attention_forward(spec, heads(data, offs), heads(data, &offs[..1]), heads(data, offs), &mut out, &mut probs), short(op, "k offsets", 2, 1));
    assert_eq!(attention_forward(spec, heads(data, offs), heads(data, offs), heads(data, &[0, 7]), &mut out, &mut probs), short(op, "v", 13, 12));
    let huge = Heads { data, offsets: offs, row_stride: usize::MAX };
    assert_eq!(attention_forward(spec, heads(data, offs), huge, heads(data, offs), &mut out, &mut probs), short(op, "k", usize::MAX, 12));
    attention_forward(spec, heads(data, offs), heads(data, offs), heads(data, offs), &mut out, &mut probs).unwrap();
    let op = "attention_backward";
    let (mut dq, mut dk, mut dv) = (vec![0.0; 12], vec![0.0; 12], vec![0.0; 12]);
    let back = |probs: &[f64], dout: Heads<'_, f64>, dq: &mut [f64], dk: &mut [f64], dv: &mut [f64]| attention_backward(spec, heads(data, offs), heads(data, offs), heads(data, offs), probs, dout, dq, dk, dv);
    assert_eq!(back(&probs[..5], heads(data, offs), &mut dq, &mut dk, &mut dv), short(op, "probs", 18, 5));
    assert_eq!(back(&probs, heads(data, &offs[..1]), &mut dq, &mut dk, &mut dv), short(op, "dout offsets", 2, 1));
    assert_eq!(back(&probs, heads(&data[..10], offs), &mut dq, &mut dk, &mut dv), short(op, "dout", 12, 10));
    assert_eq!(back(&probs, heads(data, offs), &mut dq[..1], &mut dk, &mut dv), short(op, "dq", 12, 1));
    assert_eq!(back(&probs, heads(data, offs), &mut dq, &mut dk[..2], &mut dv), short(op, "dk", 12, 2));
    assert_eq!(back(&probs, heads(data, offs), &mut dq, &mut dk, &mut dv[..3]), short(op, "dv", 12, 3));
    assert_eq!(back(&probs, heads(data, offs), &mut dq, &mut dk, &mut dv), Ok(()));
}
