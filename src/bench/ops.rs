//! `rtx bench ops --model mlp|gpt`: where a training step's time goes, op by op.
//!
//! Each op of the model runs alone at the exact shapes it has inside the step, twice: forward
//! only (graph recorded, as in training), and forward + backward from a fixed output gradient.
//! A line per op gives both medians, the backward share, and how many times a step runs it, so
//! `count × fwd_bwd_ms` summed over ops approximates the step (the `step` line is measured, the
//! `sum` line is that estimate). Linear layers also report `gemm_only_ms`: their three products
//! run bare through the kernel, so `fwd_bwd_ms − gemm_only_ms` is the tensor layer's overhead
//! (bias add and its reduction, allocation, autograd). `scripts/peer/torch_bench.py ops` times the same list in
//! PyTorch, and `scripts/bench-vs-torch.sh` sets them side by side.

use super::step::StepModel;
use super::timing::{measure, round3};
use super::{emit, threads};
use rtx_tensor::nn::{Gpt, GptConfig, Module};
use rtx_tensor::optim::{AdamW, AdamWConfig, Optimizer};
use rtx_kernels::matmul::{matmul, Operand};
use rtx_tensor::{CrossEntropyOptions, DType, Generator, Tensor};

/// Arguments of `rtx bench ops`.
#[derive(clap::Args, Debug, Clone)]
pub struct OpsArgs {
    /// The model whose ops to time.
    #[arg(long, value_enum)]
    pub model: StepModel,
    /// Untimed runs of each op before timing.
    #[arg(long, default_value_t = 3)]
    pub warmup: usize,
    /// Timed runs of each op; medians are reported.
    #[arg(long, default_value_t = 15)]
    pub repeats: usize,
}

type OpFn = Box<dyn Fn(&[Tensor]) -> rtx_tensor::Result<Tensor>>;

/// One op at one shape: its inputs (leaves that need gradients, or constants) and the body.
struct Op {
    name: &'static str,
    count: usize,
    inputs: Vec<Tensor>,
    body: OpFn,
    /// For a Linear `[rows, in] -> [rows, out]`: (rows, in, out), to time its three gemms bare.
    gemm: Option<(usize, usize, usize)>,
}

fn leaf(shape: &[usize], std: f64, rng: &mut Generator) -> anyhow::Result<Tensor> {
    Ok(Tensor::randn(shape, 0.0, std, DType::F32, rng)?.requires_grad(true))
}

fn ids(shape: &[usize], below: usize, rng: &mut Generator) -> anyhow::Result<Tensor> {
    let n: usize = shape.iter().product();
    Ok(Tensor::from_vec((0..n).map(|_| rng.below(below as u64) as u32).collect::<Vec<u32>>(), shape)?)
}

/// `x [.., in] · W[out, in]ᵀ + b`, as nn::Linear computes it.
fn linear_op(name: &'static str, count: usize, rows: &[usize], d_in: usize, d_out: usize, rng: &mut Generator) -> anyhow::Result<Op> {
    let mut xs = rows.to_vec();
    xs.push(d_in);
    Ok(Op {
        name,
        count,
        inputs: vec![leaf(&xs, 1.0, rng)?, leaf(&[d_out, d_in], 0.02, rng)?, leaf(&[d_out], 0.02, rng)?],
        // As `nn::Linear` runs it: one op, bias fused into the gemm.
        body: Box::new(|t| t[0].linear(&t[1], Some(&t[2]))),
        gemm: Some((rows.iter().product(), d_in, d_out)),
    })
}

/// The three products of a Linear's forward and backward straight through the kernel, into
/// reused buffers, with the operand layouts the tensor ops use: `y = x·Wᵀ` (W read transposed),
/// `dx = dy·W`, `dW = dyᵀ·x` (dy read transposed).
fn linear_gemms_ms(rows: usize, d_in: usize, d_out: usize, warmup: usize, repeats: usize) -> anyhow::Result<f64> {
    let x = vec![0.5f32; rows * d_in];
    let w = vec![0.25f32; d_out * d_in];
    let dy = vec![0.125f32; rows * d_out];
    let (mut y, mut dx, mut dw) = (vec![0f32; rows * d_out], vec![0f32; rows * d_in], vec![0f32; d_out * d_in]);
    let st = measure(warmup, repeats, || {
        let w_t = Operand { offset: 0, row_stride: 1, col_stride: d_in };
        matmul(rows, d_out, d_in, &x, Operand::row_major(0, d_in), &w, w_t, &mut y, 0, false)?;
        matmul(rows, d_in, d_out, &dy, Operand::row_major(0, d_out), &w, Operand::row_major(0, d_in), &mut dx, 0, false)?;
        let dy_t = Operand { offset: 0, row_stride: 1, col_stride: d_out };
        matmul(d_out, d_in, rows, &dy, dy_t, &x, Operand::row_major(0, d_in), &mut dw, 0, false)?;
        Ok(())
    })?;
    Ok(st.median_ms)
}

fn mlp_ops(rng: &mut Generator) -> anyhow::Result<Vec<Op>> {
    let b = 128;
    let targets = ids(&[b], 10, rng)?;
    Ok(vec![
        linear_op("linear 128x784->512", 1, &[b], 784, 512, rng)?,
        linear_op("linear 128x512->512", 1, &[b], 512, 512, rng)?,
        linear_op("linear 128x512->10", 1, &[b], 512, 10, rng)?,
        Op { name: "relu [128,512]", count: 2, inputs: vec![leaf(&[b, 512], 1.0, rng)?], body: Box::new(|t| t[0].relu()), gemm: None },
        Op {
            name: "cross_entropy [128,10]",
            count: 1,
            inputs: vec![leaf(&[b, 10], 1.0, rng)?, targets],
            body: Box::new(|t| t[0].cross_entropy(&t[1], CrossEntropyOptions::default())),
            gemm: None,
        },
    ])
}

fn gpt_ops(rng: &mut Generator) -> anyhow::Result<Vec<Op>> {
    let (b, t, c, h, v, layers) = (16usize, 128usize, 256usize, 4usize, 256usize, 4usize);
    let token_ids = ids(&[b, t], v, rng)?;
    let positions = Tensor::from_vec((0..t as u32).collect::<Vec<u32>>(), &[t])?;
    let targets = ids(&[b * t], v, rng)?;
    Ok(vec![
        Op {
            name: "embedding tok+pos [16,128,256]",
            count: 1,
            inputs: vec![leaf(&[v, c], 0.02, rng)?, leaf(&[t, c], 0.02, rng)?, token_ids, positions],
            body: Box::new(|x| Tensor::embedding(&x[0], &x[2])?.add(&Tensor::embedding(&x[1], &x[3])?)),
            gemm: None,
        },
        Op {
            name: "layer_norm [16,128,256]",
            count: 2 * layers + 1,
            inputs: vec![leaf(&[b, t, c], 1.0, rng)?, leaf(&[c], 1.0, rng)?, leaf(&[c], 0.1, rng)?],
            body: Box::new(|x| x[0].layer_norm(Some(&x[1]), Some(&x[2]), 1e-5)),
            gemm: None,
        },
        linear_op("linear qkv 2048x256->768", layers, &[b, t], c, 3 * c, rng)?,
        Op {
            name: "attention core (split heads, causal sdpa, merge)",
            count: layers,
            inputs: vec![leaf(&[b, t, 3 * c], 1.0, rng)?],
            // As `nn::MultiHeadAttention` runs it without a mask: one fused op from the packed
            // projection to the merged heads (the same math as split views + sdpa + merge).
            body: Box::new(move |x| Tensor::scaled_dot_product_attention_packed(&x[0], h, true, None)),
            gemm: None,
        },
        linear_op("linear attn.proj 2048x256->256", layers, &[b, t], c, c, rng)?,
        linear_op("linear mlp.fc 2048x256->1024", layers, &[b, t], c, 4 * c, rng)?,
        Op { name: "gelu [16,128,1024]", count: layers, inputs: vec![leaf(&[b, t, 4 * c], 1.0, rng)?], body: Box::new(|x| x[0].gelu()), gemm: None },
        linear_op("linear mlp.proj 2048x1024->256", layers, &[b, t], 4 * c, c, rng)?,
        Op {
            name: "residual add [16,128,256]",
            count: 2 * layers,
            inputs: vec![leaf(&[b, t, c], 1.0, rng)?, leaf(&[b, t, c], 1.0, rng)?],
            body: Box::new(|x| x[0].add(&x[1])),
            gemm: None,
        },
        Op {
            name: "tied lm_head 2048x256 @ [256,256]^T",
            count: 1,
            inputs: vec![leaf(&[b, t, c], 1.0, rng)?, leaf(&[v, c], 0.02, rng)?],
            body: Box::new(|x| x[0].matmul(&x[1].t()?)),
            gemm: None,
        },
        Op {
            name: "cross_entropy [2048,256]",
            count: 1,
            inputs: vec![leaf(&[b * t, v], 1.0, rng)?, targets],
            body: Box::new(|x| x[0].cross_entropy(&x[1], CrossEntropyOptions::default())),
            gemm: None,
        },
    ])
}

pub(crate) fn run(args: &OpsArgs) -> anyhow::Result<()> {
    let threads = threads();
    let mut rng = Generator::new(0);
    let model_name = format!("{:?}", args.model).to_lowercase();
    let ops = match args.model {
        StepModel::Mlp => mlp_ops(&mut rng)?,
        StepModel::Gpt => gpt_ops(&mut rng)?,
        StepModel::Ijepa => anyhow::bail!("`rtx bench ops` breaks down the MLP and GPT steps; time the I-JEPA step with `rtx bench step --model ijepa`"),
    };
    let mut sum_ms = 0.0;
    for op in &ops {
        let probe = (op.body)(&op.inputs)?;
        let grad_out = Tensor::randn(probe.shape(), 0.0, 1.0, DType::F32, &mut rng)?;
        drop(probe);
        let fwd = measure(args.warmup, args.repeats, || {
            std::hint::black_box((op.body)(&op.inputs)?);
            Ok(())
        })?;
        let fwd_bwd = measure(args.warmup, args.repeats, || {
            let y = (op.body)(&op.inputs)?;
            y.backward_from(grad_out.clone(), |_| {})?;
            for x in &op.inputs {
                x.set_grad(None)?;
            }
            Ok(())
        })?;
        sum_ms += op.count as f64 * fwd_bwd.median_ms;
        let mut line = serde_json::json!({
            "impl": "rustytorch", "bench": "ops", "model": model_name, "op": op.name, "count": op.count, "threads": threads,
            "fwd_ms": round3(fwd.median_ms), "fwd_bwd_ms": round3(fwd_bwd.median_ms), "repeats": args.repeats,
        });
        if let Some((rows, d_in, d_out)) = op.gemm {
            line["gemm_only_ms"] = round3(linear_gemms_ms(rows, d_in, d_out, args.warmup, args.repeats)?).into();
        }
        emit(line);
    }
    if args.model == StepModel::Gpt {
        // The optimizer over the real model's parameters, gradients present.
        let config = GptConfig { vocab_size: 256, context: 128, d_model: 256, n_layers: 4, n_heads: 4, ..GptConfig::default() };
        let model = Gpt::new(config, &mut rng)?;
        for (_, p) in model.named_parameters() {
            p.set_grad(Some(Tensor::randn(p.shape(), 0.0, 1e-3, DType::F32, &mut rng)?))?;
        }
        let mut opt = AdamW::new(model.named_parameters(), AdamWConfig::default())?;
        let st = measure(args.warmup, args.repeats, || Ok(opt.step()?))?;
        sum_ms += st.median_ms;
        emit(serde_json::json!({
            "impl": "rustytorch", "bench": "ops", "model": model_name, "op": "adamw step (3.26M params)", "count": 1, "threads": threads,
            "fwd_ms": round3(st.median_ms), "fwd_bwd_ms": round3(st.median_ms), "repeats": args.repeats,
        }));
    }
    emit(serde_json::json!({ "impl": "rustytorch", "bench": "ops", "model": model_name, "op": "sum (count x fwd_bwd)", "count": 1, "threads": threads, "fwd_ms": null, "fwd_bwd_ms": round3(sum_ms) }));
    Ok(())
}
