//! Peer correctness check, rustytorch side: one pre-norm transformer block (`nn::TransformerBlock`)
//! with weights written by PyTorch, forward and backward of `sum(block(x) * w_fixed)`.
//!
//! ```text
//! scripts/peer-check.sh        # writes the inputs, runs this, compares with torch
//! cargo run --release -p rtx-examples --example peer_block -- DIR
//! ```
//!
//! Reads `DIR/block_inputs.safetensors` (written by `scripts/peer/peer_block.py write DIR`):
//! every block parameter under its PyTorch `state_dict` name (`ln1.weight`, `attn.qkv.weight`
//! `[3C, C]`, …), the input `x [B, T, C]`, the loss weight `w_fixed [B, T, C]`, and metadata
//! `n_heads`, `layer_norm_eps`, `causal`. Writes `DIR/block_rustytorch.safetensors` with `out`,
//! `grad.x` and `grad.<name>` for every parameter, which `peer_block.py compare DIR` checks
//! against torch.

use anyhow::{bail, ensure, Context};
use rustytorch::checkpoint::{load_tensors, save_tensors};
use rustytorch::nn::{BlockConfig, Module, TransformerBlock};
use rustytorch::tensor::GeluApprox;
use rustytorch::{DType, Generator, Tensor};
use std::collections::BTreeMap;
use std::path::PathBuf;

fn main() -> anyhow::Result<()> {
    let dir = PathBuf::from(std::env::args().nth(1).context("usage: peer_block DIR")?);
    let inputs_path = dir.join("block_inputs.safetensors");
    let (tensors, meta) = load_tensors(&inputs_path).with_context(|| format!("reading {}", inputs_path.display()))?;
    let mut inputs: BTreeMap<String, Tensor> = tensors.into_iter().collect();
    let meta_value = |key: &str| meta.get(key).with_context(|| format!("{} lacks metadata {key}", inputs_path.display()));
    let n_heads: usize = meta_value("n_heads")?.parse()?;
    let layer_norm_eps: f64 = meta_value("layer_norm_eps")?.parse()?;
    let causal = meta_value("causal")? == "true";

    let x = inputs.remove("x").context("inputs lack x")?.requires_grad(true);
    let w_fixed = inputs.remove("w_fixed").context("inputs lack w_fixed")?;
    ensure!(x.rank() == 3 && x.shape() == w_fixed.shape(), "x {:?} and w_fixed {:?} must both be [B, T, C]", x.shape(), w_fixed.shape());
    let d_model = x.shape()[2];
    let mlp_hidden = inputs.get("mlp.fc.weight").context("inputs lack mlp.fc.weight")?.shape()[0];

    // Build the block, then swap every parameter for the PyTorch tensor of the same name: this
    // also checks that rustytorch's parameter names and layouts are PyTorch's.
    let config = BlockConfig {
        d_model,
        n_heads,
        mlp_hidden,
        causal,
        bias: true,
        dropout: 0.0,
        layer_norm_eps,
        init_std: 0.02,
        proj_init_std: 0.02,
        dtype: DType::F32,
        // scripts/peer/peer_block.py computes F.gelu(approximate="tanh").
        gelu: GeluApprox::Tanh,
    };
    let mut rng = Generator::new(0);
    let mut block = TransformerBlock::new(&config, &mut rng)?;
    let mut problems = Vec::new();
    block.visit_params_mut("", &mut |name, param| match inputs.remove(name) {
        Some(t) if t.shape() == param.shape() && t.dtype() == param.dtype() => *param = t.requires_grad(true),
        Some(t) => problems.push(format!("{name}: torch {:?} {}, rustytorch {:?} {}", t.shape(), t.dtype(), param.shape(), param.dtype())),
        None => problems.push(format!("{name}: missing from the inputs")),
    });
    problems.extend(inputs.keys().map(|name| format!("{name}: not a parameter of the block")));
    if !problems.is_empty() {
        bail!("parameters do not match:\n  {}", problems.join("\n  "));
    }

    let out = block.forward(&x, None, &mut rng)?;
    let loss = out.mul(&w_fixed)?.sum_all()?;
    loss.backward()?;

    let mut results = vec![("out".to_string(), out.detach()), ("grad.x".to_string(), x.grad().context("x has no gradient")?)];
    for (name, param) in block.named_parameters() {
        let grad = param.grad().with_context(|| format!("{name} has no gradient"))?;
        results.push((format!("grad.{name}"), grad));
    }
    let out_path = dir.join("block_rustytorch.safetensors");
    save_tensors(&out_path, &results, &BTreeMap::new())?;
    println!("loss {:.6e}; wrote {} tensors to {}", loss.item()?, results.len(), out_path.display());
    Ok(())
}
