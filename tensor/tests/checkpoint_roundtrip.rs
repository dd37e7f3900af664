//! Checkpoints: bit-exact round trips (parameters, optimizer state, step, RNG, user data) that
//! resume training identically, the safetensors layout PyTorch reads, and typed errors (never
//! panics) for truncated, corrupt or mismatched files.
#![allow(clippy::unwrap_used)]

use rtx_tensor::checkpoint::{self, CheckpointMeta};
use rtx_tensor::nn::{Gpt, GptConfig, Module};
use rtx_tensor::optim::{AdamW, AdamWConfig, Optimizer, ParamBuckets, Sgd, SgdConfig};
use rtx_tensor::{Error, Generator, Tensor};
use std::collections::BTreeMap;
use std::path::Path;

fn config() -> GptConfig {
    GptConfig { vocab_size: 10, context: 4, d_model: 8, n_layers: 1, n_heads: 2, dropout: 0.1, ..GptConfig::default() }
}

fn train_step(model: &Gpt, opt: &mut dyn Optimizer, data: &mut Generator, drop: &mut Generator) {
    let ids: Vec<u32> = (0..8).map(|_| data.below(10) as u32).collect();
    let x = Tensor::from_vec(ids.clone(), &[2, 4]).unwrap();
    let y = Tensor::from_vec(ids.iter().map(|&t| (t + 3) % 10).collect(), &[2, 4]).unwrap();
    opt.zero_grad().unwrap();
    model.loss(&x, &y, drop).unwrap().backward().unwrap();
    opt.step().unwrap();
}

fn bits(named: &[(String, Tensor)]) -> Vec<(String, Vec<u64>)> {
    named.iter().map(|(n, t)| (n.clone(), t.to_f64_vec().unwrap().into_iter().map(f64::to_bits).collect())).collect()
}

fn assert_checkpoint_error(result: Result<CheckpointMeta, Error>, needle: &str) {
    match result {
        Err(Error::Checkpoint { reason, .. }) => assert!(reason.contains(needle), "reason {reason:?} lacks {needle:?}"),
        other => panic!("expected a checkpoint error mentioning {needle:?}, got {other:?}"),
    }
}

#[test]
fn round_trip_is_bit_exact_and_resumes_identically() {
    // Goal: everything a resume needs survives a save/load exactly. Method: train 2 steps, save,
    // load into a differently seeded model and optimizer, compare bits, then take one more
    // step on both and compare again.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ckpt.safetensors");
    let model = Gpt::new(config(), &mut Generator::new(1)).unwrap();
    let mut opt = AdamW::with_decay_filter(model.named_parameters(), AdamWConfig { lr: 1e-2, ..AdamWConfig::default() }, AdamW::decay_matrices).unwrap();
    let (mut data, mut drop) = (Generator::new(2), Generator::new(3));
    for _ in 0..2 {
        train_step(&model, &mut opt, &mut data, &mut drop);
    }
    opt.set_lr(0.0075);
    let meta = CheckpointMeta {
        step: 2,
        rngs: BTreeMap::from([("data".to_string(), data.state()), ("dropout".to_string(), drop.state())]),
        user: serde_json::json!({ "cursor": { "epoch": 1, "index": 17 }, "note": "hello" }),
    };
    checkpoint::save(&path, &model, Some(&opt), &meta).unwrap();
    assert!(!dir.path().join("ckpt.safetensors.tmp").exists());

    let mut restored = Gpt::new(config(), &mut Generator::new(99)).unwrap();
    // The restored model is bucketed: loading writes through the views in place.
    let buckets = ParamBuckets::new(&mut restored, 1 << 12).unwrap();
    let mut opt2 = AdamW::with_decay_filter(restored.named_parameters(), AdamWConfig::default(), AdamW::decay_matrices).unwrap();
    let got = checkpoint::load(&path, &restored, Some(&mut opt2)).unwrap();
    assert_eq!(got, meta);
    assert_eq!(checkpoint::read_meta(&path).unwrap(), meta);
    assert_eq!(bits(&model.named_parameters()), bits(&restored.named_parameters()));
    assert_eq!(bits(&opt.state_tensors().unwrap()), bits(&opt2.state_tensors().unwrap()));
    assert_eq!(opt2.lr(), 0.0075);
    assert!(restored.named_parameters()[0].1.storage().same(buckets.buckets()[buckets.entries()[0].bucket].param_storage()));

    let mut data2 = Generator::from_state(got.rngs["data"]);
    let mut drop2 = Generator::from_state(got.rngs["dropout"]);
    train_step(&model, &mut opt, &mut data, &mut drop);
    buckets.zero_grad().unwrap();
    train_step(&restored, &mut opt2, &mut data2, &mut drop2);
    assert_eq!(bits(&model.named_parameters()), bits(&restored.named_parameters()));
}

#[test]
fn file_layout_is_plain_safetensors() {
    // Goal: PyTorch's safetensors reader sees state_dict names, dtypes and shapes. Method: parse
    // the header by hand (8-byte little-endian length, then JSON).
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("c.safetensors");
    let model = Gpt::new(config(), &mut Generator::new(1)).unwrap();
    let opt = Sgd::new(model.named_parameters(), SgdConfig { momentum: 0.9, ..SgdConfig::default() }).unwrap();
    checkpoint::save(&path, &model, Some(&opt), &CheckpointMeta::default()).unwrap();
    let bytes = std::fs::read(&path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let qkv = &header["blocks.0.attn.qkv.weight"];
    assert_eq!(qkv["dtype"], "F32");
    assert_eq!(qkv["shape"], serde_json::json!([24, 8]));
    assert_eq!(header["optim.blocks.0.attn.qkv.weight.momentum_buffer"]["shape"], serde_json::json!([24, 8]));
    assert_eq!(header["optim.tok_emb.weight.step"]["shape"], serde_json::json!([]));
    assert_eq!(header["__metadata__"]["format"], checkpoint::FORMAT);
    assert_eq!(header["__metadata__"]["step"], "0");
    let optim: serde_json::Value = serde_json::from_str(header["__metadata__"]["optimizer"].as_str().unwrap()).unwrap();
    assert_eq!(optim["kind"], "sgd");
    let (tensors, _) = checkpoint::load_tensors(&path).unwrap();
    assert_eq!(tensors.len(), 2 * model.named_parameters().len() + model.named_parameters().len());
}

#[test]
fn truncated_and_corrupt_files_are_errors() {
    // Goal: no panic and no partial load on damaged files. Method: cut the file at many
    // lengths and flip header bytes; the model must be untouched after each failure.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("good.safetensors");
    let model = Gpt::new(config(), &mut Generator::new(1)).unwrap();
    checkpoint::save(&path, &model, None, &CheckpointMeta::default()).unwrap();
    let bytes = std::fs::read(&path).unwrap();
    let target = Gpt::new(config(), &mut Generator::new(2)).unwrap();
    let before = bits(&target.named_parameters());
    let bad = dir.path().join("bad.safetensors");
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    for cut in [0, 3, 8, 20, n + 8, n + 9, bytes.len() / 2, bytes.len() - 1] {
        std::fs::write(&bad, &bytes[..cut]).unwrap();
        assert_checkpoint_error(checkpoint::load(&bad, &target, None), "safetensors");
    }
    let mut longer = bytes.clone();
    longer.push(0);
    std::fs::write(&bad, &longer).unwrap();
    assert_checkpoint_error(checkpoint::load(&bad, &target, None), "safetensors");
    for pos in [8, 9, 8 + n / 2, 8 + n - 2] {
        let mut corrupt = bytes.clone();
        corrupt[pos] ^= 0x5a;
        std::fs::write(&bad, &corrupt).unwrap();
        assert!(matches!(checkpoint::load(&bad, &target, None), Err(Error::Checkpoint { .. })), "corruption at {pos} not detected");
    }
    let mut huge = bytes.clone();
    huge[..8].copy_from_slice(&u64::MAX.to_le_bytes());
    std::fs::write(&bad, &huge).unwrap();
    assert_checkpoint_error(checkpoint::load(&bad, &target, None), "safetensors");
    assert!(matches!(checkpoint::load(Path::new("/nonexistent/x.safetensors"), &target, None), Err(Error::Io { .. })));
    assert_eq!(bits(&target.named_parameters()), before);
}

#[test]
fn mismatches_name_the_tensor() {
    // Goal: a file that does not fit the model or optimizer says which tensor is wrong.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("c.safetensors");
    let model = Gpt::new(config(), &mut Generator::new(1)).unwrap();
    let opt = AdamW::new(model.named_parameters(), AdamWConfig::default()).unwrap();
    checkpoint::save(&path, &model, Some(&opt), &CheckpointMeta::default()).unwrap();

    let wider = Gpt::new(GptConfig { d_model: 12, ..config() }, &mut Generator::new(1)).unwrap();
    assert_checkpoint_error(checkpoint::load(&path, &wider, None), "tok_emb.weight has shape [10, 8], expected [10, 12]");
    let deeper = Gpt::new(GptConfig { n_layers: 2, ..config() }, &mut Generator::new(1)).unwrap();
    assert_checkpoint_error(checkpoint::load(&path, &deeper, None), "blocks.1.ln1.weight is missing");
    let untied = Gpt::new(GptConfig { tie_embeddings: false, ..config() }, &mut Generator::new(1)).unwrap();
    assert_checkpoint_error(checkpoint::load(&path, &untied, None), "lm_head.weight is missing");
    let bf16 = Gpt::new(GptConfig { dtype: rtx_tensor::DType::BF16, ..config() }, &mut Generator::new(1)).unwrap();
    assert_checkpoint_error(checkpoint::load(&path, &bf16, None), "dtype F32, expected BF16");
    let mut sgd = Sgd::new(model.named_parameters(), SgdConfig { momentum: 0.9, ..SgdConfig::default() }).unwrap();
    assert_checkpoint_error(checkpoint::load(&path, &model, Some(&mut sgd)), "not \"sgd\"");

    // A file without optimizer state cannot restore one; one with a missing tensor names it.
    let (tensors, meta) = checkpoint::load_tensors(&path).unwrap();
    let model_only: Vec<(String, Tensor)> = tensors.iter().filter(|(n, _)| !n.starts_with("optim.")).cloned().collect();
    let p2 = dir.path().join("m.safetensors");
    checkpoint::save_tensors(&p2, &model_only, &meta).unwrap();
    let mut adamw = AdamW::new(model.named_parameters(), AdamWConfig::default()).unwrap();
    assert_checkpoint_error(checkpoint::load(&p2, &model, Some(&mut adamw)), "optim.tok_emb.weight.exp_avg is missing");
    let without_ln: Vec<(String, Tensor)> = tensors.iter().filter(|(n, _)| n != "ln_f.bias").cloned().collect();
    checkpoint::save_tensors(&p2, &without_ln, &meta).unwrap();
    assert_checkpoint_error(checkpoint::load(&p2, &model, Some(&mut adamw)), "ln_f.bias is missing");
    let mut extra = tensors.clone();
    extra.push(("head.weight".into(), Tensor::zeros(&[2], rtx_tensor::DType::F32)));
    checkpoint::save_tensors(&p2, &extra, &meta).unwrap();
    assert_checkpoint_error(checkpoint::load(&p2, &model, None), "head.weight is not a parameter");
    checkpoint::save_tensors(&p2, &model_only, &BTreeMap::new()).unwrap();
    assert_checkpoint_error(checkpoint::load(&p2, &model, None), "not a rustytorch checkpoint");
    // Loading without an optimizer ignores optimizer tensors.
    checkpoint::load(&path, &model, None).unwrap();
}

#[test]
fn in_memory_encoding_matches_the_file_and_rejects_torn_bytes() {
    // Goal: `encode_tensors` gives the bytes `save_tensors` writes (one format for files and
    // in-memory stores), the same bytes every time, `decode_tensors` reads them back bit-exactly,
    // and a torn prefix of them is a typed error, never a panic or a partial result.
    let tensors = vec![("a".to_string(), Tensor::from_vec(vec![1.5f32, -2.25, 3.0], &[3]).unwrap()), ("b".to_string(), Tensor::from_vec(vec![7u32, 9], &[2]).unwrap())];
    // Several metadata keys: safetensors writes them from a HashMap, whose order changes from one
    // map to the next; the encoding must not.
    let meta: BTreeMap<String, String> = ["step", "format", "rng", "user", "optimizer", "a", "b", "c"].iter().map(|k| (k.to_string(), if *k == "step" { "12".into() } else { format!("v-{k}") })).collect();
    let bytes = checkpoint::encode_tensors(&tensors, &meta).unwrap();
    for _ in 0..8 {
        assert_eq!(checkpoint::encode_tensors(&tensors, &meta).unwrap(), bytes, "the same checkpoint encoded to other bytes");
    }
    let dir = std::env::temp_dir().join(format!("rtx-ckpt-mem-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("x.safetensors");
    checkpoint::save_tensors(&path, &tensors, &meta).unwrap();
    assert_eq!(std::fs::read(&path).unwrap(), bytes, "file and memory encodings differ");
    let (back, back_meta) = checkpoint::decode_tensors(&bytes, Path::new("<memory>")).unwrap();
    assert_eq!(bits(&back), bits(&tensors));
    assert_eq!(back_meta.get("step").map(String::as_str), Some("12"));
    for cut in [0, 7, bytes.len() / 2, bytes.len() - 1] {
        let err = checkpoint::decode_tensors(&bytes[..cut], Path::new("<memory>")).unwrap_err();
        assert!(matches!(err, Error::Checkpoint { .. }), "torn at {cut}: {err}");
    }
    let duplicate = vec![tensors[0].clone(), tensors[0].clone()];
    assert!(checkpoint::encode_tensors(&duplicate, &meta).is_err(), "duplicate names must be refused");
    std::fs::remove_dir_all(&dir).unwrap();
}
