//! PyTorch parity, rustytorch side: load a PyTorch `state_dict` (saved with
//! `safetensors.torch.save_file`) into `nn::Gpt` and `nn::Vit` with `load_state_dict(strict)`,
//! run forward and backward of the cross-entropy on PyTorch's inputs, and write the results for
//! the script to compare.
//!
//! ```text
//! python3 scripts/peer/torch_parity.py run DIR     # writes, runs this, compares
//! cargo run -p rtx-examples --example torch_parity -- DIR
//! ```
//!
//! For each model `M` in `gpt`, `vit` it reads `DIR/M_state.safetensors` (the `state_dict`; the
//! ViT one is stored as F16 to exercise the dtype path) and `DIR/M_io.safetensors` (inputs as
//! PyTorch keeps them: GPT `ids` and `targets` as I64 with some targets at `ignore_index = -100`,
//! ViT `images` F32 and `labels` I64; string metadata with the sizes shapes cannot tell). It
//! writes `DIR/M_rustytorch.safetensors` with `logits`, `loss` and `grad.<name>` for every
//! parameter.

use anyhow::{ensure, Context};
use rustytorch::checkpoint::{load_tensors, load_tensors_with_dtypes, save_tensors, NamedTensors};
use rustytorch::nn::{Gpt, GptConfig, Module, Pooling, Vit, VitConfig};
use rustytorch::tensor::{CrossEntropyOptions, GeluApprox};
use rustytorch::{Generator, Tensor};
use std::collections::BTreeMap;
use std::path::Path;

fn main() -> anyhow::Result<()> {
    let dir = std::env::args().nth(1).context("usage: torch_parity DIR")?;
    let dir = Path::new(&dir);
    gpt(dir)?;
    vit(dir)?;
    Ok(())
}

/// The GPT: sizes from the state's shapes and the metadata, strict load, loss on I64 targets.
fn gpt(dir: &Path) -> anyhow::Result<()> {
    let (state, io, meta) = read(dir, "gpt")?;
    let shape = |name: &str| -> anyhow::Result<Vec<usize>> { Ok(find(&state, name)?.shape().to_vec()) };
    let (tok, pos) = (shape("tok_emb.weight")?, shape("pos_emb.weight")?);
    let config = GptConfig {
        vocab_size: tok[0],
        d_model: tok[1],
        context: pos[0],
        n_layers: count_blocks(&state),
        n_heads: meta_usize(&meta, "n_heads")?,
        layer_norm_eps: meta_f64(&meta, "layer_norm_eps")?,
        gelu: meta_gelu(&meta)?,
        ..GptConfig::default()
    };
    let model = Gpt::from_state_dict(config, &state).context("building the GPT from the state_dict")?;
    let (ids, targets) = (find(&io, "ids")?, find(&io, "targets")?);
    let logits = model.forward(ids, &mut Generator::new(0))?;
    let (b, t, v) = (logits.shape()[0], logits.shape()[1], logits.shape()[2]);
    let loss = logits.reshape(&[b * t, v])?.cross_entropy(&targets.reshape(&[b * t])?, CrossEntropyOptions::default())?;
    finish(dir, "gpt", &model, logits, loss)
}

/// The ViT classifier with a class token, state stored as F16.
fn vit(dir: &Path) -> anyhow::Result<()> {
    let (state, io, meta) = read(dir, "vit")?;
    let patch = find(&state, "patch_embed.proj.weight")?.shape().to_vec();
    let head = find(&state, "head.weight")?.shape().to_vec();
    let images = find(&io, "images")?;
    let patch_size = meta_usize(&meta, "patch_size")?;
    let in_channels = images.shape()[1];
    ensure!(patch[1] == in_channels * patch_size * patch_size, "patch_embed.proj.weight {patch:?} does not fit {in_channels} channels of {patch_size}x{patch_size} patches");
    let config = VitConfig {
        image_size: [images.shape()[2], images.shape()[3]],
        patch_size,
        in_channels,
        d_model: patch[0],
        n_layers: count_blocks(&state),
        n_heads: meta_usize(&meta, "n_heads")?,
        cls_token: true,
        pooling: Pooling::Cls,
        n_classes: Some(head[0]),
        layer_norm_eps: meta_f64(&meta, "layer_norm_eps")?,
        gelu: meta_gelu(&meta)?,
        ..VitConfig::default()
    };
    let model = Vit::from_state_dict(config, &state).context("building the ViT from the state_dict")?;
    let logits = model.forward(images, &mut Generator::new(0))?;
    let loss = logits.cross_entropy(find(&io, "labels")?, CrossEntropyOptions::default())?;
    finish(dir, "vit", &model, logits, loss)
}

/// Reads `M_state` (reporting each tensor's file dtype) and `M_io` with its metadata.
fn read(dir: &Path, model: &str) -> anyhow::Result<(NamedTensors, NamedTensors, BTreeMap<String, String>)> {
    let state_path = dir.join(format!("{model}_state.safetensors"));
    let typed = load_tensors_with_dtypes(&state_path).with_context(|| format!("reading {}", state_path.display()))?;
    let mut dtypes: Vec<String> = typed.file_dtypes.values().map(|d| d.to_string()).collect();
    dtypes.dedup();
    let io_path = dir.join(format!("{model}_io.safetensors"));
    let (io, meta) = load_tensors(&io_path).with_context(|| format!("reading {}", io_path.display()))?;
    let io_dtypes: Vec<String> = io.iter().filter(|(n, _)| !n.starts_with("ref.")).map(|(n, t)| format!("{n}:{}", t.dtype())).collect();
    println!("{model}: {} state tensors (file dtypes {}), inputs {}", typed.tensors.len(), dtypes.join(","), io_dtypes.join(" "));
    Ok((typed.tensors, io, meta))
}

/// Backward, then writes logits, loss and every parameter's gradient.
fn finish(dir: &Path, model: &str, module: &dyn Module, logits: Tensor, loss: Tensor) -> anyhow::Result<()> {
    loss.backward()?;
    let mut out = vec![("logits".to_string(), logits.detach()), ("loss".to_string(), loss.detach().reshape(&[1])?)];
    for (name, param) in module.named_parameters() {
        let grad = param.grad().with_context(|| format!("{model}: {name} has no gradient"))?;
        out.push((format!("grad.{name}"), grad));
    }
    let path = dir.join(format!("{model}_rustytorch.safetensors"));
    save_tensors(&path, &out, &BTreeMap::new())?;
    println!("{model}: loss {:.6}; wrote {} tensors to {}", loss.item()?, out.len(), path.display());
    Ok(())
}

fn find<'a>(tensors: &'a NamedTensors, name: &str) -> anyhow::Result<&'a Tensor> {
    tensors.iter().find(|(n, _)| n == name).map(|(_, t)| t).with_context(|| format!("no tensor {name}"))
}

/// Number of blocks: the distinct `blocks.<i>.` prefixes.
fn count_blocks(state: &NamedTensors) -> usize {
    let mut ids: Vec<&str> = state.iter().filter_map(|(n, _)| n.strip_prefix("blocks.")?.split('.').next()).collect();
    ids.sort_unstable();
    ids.dedup();
    ids.len()
}

fn meta_str<'a>(meta: &'a BTreeMap<String, String>, key: &str) -> anyhow::Result<&'a str> {
    meta.get(key).map(String::as_str).with_context(|| format!("metadata lacks {key}"))
}

fn meta_usize(meta: &BTreeMap<String, String>, key: &str) -> anyhow::Result<usize> {
    meta_str(meta, key)?.parse().with_context(|| format!("metadata {key}"))
}

fn meta_f64(meta: &BTreeMap<String, String>, key: &str) -> anyhow::Result<f64> {
    meta_str(meta, key)?.parse().with_context(|| format!("metadata {key}"))
}

fn meta_gelu(meta: &BTreeMap<String, String>) -> anyhow::Result<GeluApprox> {
    Ok(meta_str(meta, "gelu")?.parse()?)
}
