//! nn modules: parameter names and shapes (snapshot), forward shapes, train/eval dropout,
//! sampling, the ViT encoder's token paths, and an MLP trained to near-zero loss.
#![allow(clippy::unwrap_used)]

use rtx_tensor::nn::{Activation, Gpt, GptConfig, Linear, Mlp, Module, Pooling, Vit, VitConfig};
use rtx_tensor::optim::{AdamW, AdamWConfig, Optimizer};
use rtx_tensor::{CrossEntropyOptions, DType, Generator, Tensor};

fn tiny_gpt_config() -> GptConfig {
    GptConfig { vocab_size: 11, context: 8, d_model: 16, n_layers: 2, n_heads: 2, dropout: 0.0, ..GptConfig::default() }
}

fn names_and_shapes(m: &dyn Module) -> String {
    m.named_parameters().iter().map(|(n, t)| format!("{n} {:?}", t.shape())).collect::<Vec<_>>().join("\n")
}

#[test]
fn gpt_parameter_names_snapshot() {
    // Goal: names and layouts are stable and PyTorch-like. Method: compare against a snapshot.
    let model = Gpt::new(tiny_gpt_config(), &mut Generator::new(0)).unwrap();
    let block = |i: usize| {
        format!(
            "blocks.{i}.ln1.weight [16]\nblocks.{i}.ln1.bias [16]\nblocks.{i}.attn.qkv.weight [48, 16]\nblocks.{i}.attn.qkv.bias [48]\n\
             blocks.{i}.attn.proj.weight [16, 16]\nblocks.{i}.attn.proj.bias [16]\nblocks.{i}.ln2.weight [16]\nblocks.{i}.ln2.bias [16]\n\
             blocks.{i}.mlp.fc.weight [64, 16]\nblocks.{i}.mlp.fc.bias [64]\nblocks.{i}.mlp.proj.weight [16, 64]\nblocks.{i}.mlp.proj.bias [16]"
        )
    };
    let expected = format!("tok_emb.weight [11, 16]\npos_emb.weight [8, 16]\n{}\n{}\nln_f.weight [16]\nln_f.bias [16]", block(0), block(1));
    assert_eq!(names_and_shapes(&model), expected);
    let per_block = 4 * 16 + 48 * 16 + 48 + 16 * 16 + 16 + 64 * 16 + 64 + 16 * 64 + 16;
    assert_eq!(model.num_parameters(), 11 * 16 + 8 * 16 + 2 * per_block + 2 * 16);
    assert!(model.named_parameters().iter().all(|(_, t)| t.is_requires_grad() && t.dtype() == DType::F32));

    let untied = Gpt::new(GptConfig { tie_embeddings: false, ..tiny_gpt_config() }, &mut Generator::new(0)).unwrap();
    let (last, t) = untied.named_parameters().pop().unwrap();
    assert_eq!((last.as_str(), t.shape()), ("lm_head.weight", &[11, 16][..]));
}

#[test]
fn gpt_forward_loss_and_errors() {
    // Goal: forward shapes, a sane initial loss, clear errors. Method: tiny model on fixed ids.
    let mut rng = Generator::new(1);
    let model = Gpt::new(tiny_gpt_config(), &mut rng).unwrap();
    let ids = Tensor::from_vec(vec![1u32, 2, 3, 4, 5, 6, 7, 8, 9, 10], &[2, 5]).unwrap();
    let logits = model.forward(&ids, &mut rng).unwrap();
    assert_eq!(logits.shape(), &[2, 5, 11]);
    let loss = model.loss(&ids, &ids, &mut rng).unwrap().item().unwrap();
    assert!((loss - (11f64).ln()).abs() < 0.3, "initial loss {loss}");
    let long = Tensor::from_vec(vec![0u32; 9], &[1, 9]).unwrap();
    assert!(model.forward(&long, &mut rng).is_err());
    let bad = Tensor::from_vec(vec![11u32], &[1, 1]).unwrap();
    assert!(model.forward(&bad, &mut rng).is_err());
    // Backward reaches every parameter, the tied embedding through both uses.
    model.loss(&ids, &ids, &mut rng).unwrap().backward().unwrap();
    for (name, p) in model.named_parameters() {
        assert!(p.grad().is_some(), "{name} has no gradient");
    }
}

#[test]
fn dropout_follows_training_mode() {
    // Goal: dropout is active only in training and draws only then. Method: compare outputs and
    // generator positions.
    let mut model = Gpt::new(GptConfig { dropout: 0.5, ..tiny_gpt_config() }, &mut Generator::new(2)).unwrap();
    let ids = Tensor::from_vec(vec![1u32, 2, 3, 4], &[1, 4]).unwrap();
    let mut rng = Generator::new(3);
    let a = model.forward(&ids, &mut rng).unwrap().to_f32_vec().unwrap();
    let b = model.forward(&ids, &mut rng).unwrap().to_f32_vec().unwrap();
    assert_ne!(a, b);
    model.set_training(false);
    let before = rng.state();
    let c = model.forward(&ids, &mut rng).unwrap().to_f32_vec().unwrap();
    let d = model.forward(&ids, &mut rng).unwrap().to_f32_vec().unwrap();
    assert_eq!(c, d);
    assert_eq!(rng.state(), before);
}

#[test]
fn generate_is_seeded_and_restores_mode() {
    // Goal: sampling is reproducible from the seed, greedy decoding ignores it, and the mode is
    // restored. Method: sample twice with equal seeds, once greedily with different seeds.
    let mut model = Gpt::new(GptConfig { dropout: 0.1, ..tiny_gpt_config() }, &mut Generator::new(4)).unwrap();
    let a = model.generate(&[1, 2, 3], 12, 1.0, Some(5), &mut Generator::new(9)).unwrap();
    let b = model.generate(&[1, 2, 3], 12, 1.0, Some(5), &mut Generator::new(9)).unwrap();
    assert_eq!(a, b);
    assert_eq!(a.len(), 12);
    assert!(a.iter().all(|&t| t < 11));
    assert!(model.is_training());
    let g1 = model.generate(&[1, 2, 3], 6, 0.0, None, &mut Generator::new(1)).unwrap();
    let g2 = model.generate(&[1, 2, 3], 6, 0.0, None, &mut Generator::new(2)).unwrap();
    assert_eq!(g1, g2);
    // top_k = 1 is greedy too.
    let k1 = model.generate(&[1, 2, 3], 6, 0.7, Some(1), &mut Generator::new(3)).unwrap();
    assert_eq!(k1, g1);
    assert!(model.generate(&[], 1, 1.0, None, &mut Generator::new(0)).is_err());
    assert!(model.generate(&[99], 1, 1.0, None, &mut Generator::new(0)).is_err());
}

#[test]
fn linear_init_and_bf16() {
    // Goal: PyTorch's Linear init bounds, and bf16 models build and run. Method: check ranges.
    let l = Linear::new(25, 7, true, DType::F32, &mut Generator::new(5)).unwrap();
    let bound = 1.0 / 5.0;
    assert!(l.weight.to_f32_vec().unwrap().iter().chain(&l.bias.as_ref().unwrap().to_f32_vec().unwrap()).all(|v| v.abs() <= bound));
    assert_eq!(l.weight.shape(), &[7, 25]);
    let model = Gpt::new(GptConfig { dtype: DType::BF16, ..tiny_gpt_config() }, &mut Generator::new(6)).unwrap();
    assert!(model.parameters().iter().all(|t| t.dtype() == DType::BF16));
    let ids = Tensor::from_vec(vec![1u32, 2, 3], &[1, 3]).unwrap();
    let logits = model.forward(&ids, &mut Generator::new(0)).unwrap();
    assert_eq!(logits.shape(), &[1, 3, 11]);
}

#[test]
fn vit_names_shapes_and_token_paths() {
    // Goal: ViT names, output shapes, and the subset path a JEPA context encoder uses.
    let cfg = VitConfig { image_size: [8, 8], patch_size: 4, in_channels: 2, d_model: 16, n_layers: 1, n_heads: 2, cls_token: true, pooling: Pooling::Cls, n_classes: Some(3), ..VitConfig::default() };
    let mut rng = Generator::new(7);
    let vit = Vit::new(cfg, &mut rng).unwrap();
    let names: Vec<String> = vit.named_parameters().into_iter().map(|(n, _)| n).collect();
    assert_eq!(&names[..4], &["cls_token", "pos_embed", "patch_embed.proj.weight", "patch_embed.proj.bias"]);
    assert_eq!(&names[names.len() - 4..], &["norm.weight", "norm.bias", "head.weight", "head.bias"]);
    assert_eq!(vit.pos_embed.shape(), &[1, 5, 16]);
    assert_eq!(vit.patch_embed.proj.weight.shape(), &[16, 32]);

    let images = Tensor::randn(&[2, 2, 8, 8], 0.0, 1.0, DType::F32, &mut rng).unwrap();
    assert_eq!(vit.forward(&images, &mut rng).unwrap().shape(), &[2, 3]);
    assert_eq!(vit.forward_features(&images, &mut rng).unwrap().shape(), &[2, 5, 16]);
    let ids = Tensor::from_vec(vec![0u32, 3, 1, 2], &[2, 2]).unwrap();
    let sub = vit.forward_features_subset(&images, &ids, &mut rng).unwrap();
    assert_eq!(sub.shape(), &[2, 3, 16]);
    sub.sum_all().unwrap().backward().unwrap();
    assert!(vit.patch_embed.proj.weight.grad().is_some());
    assert!(vit.forward_features_subset(&images, &Tensor::from_vec(vec![4u32, 0], &[2, 1]).unwrap(), &mut rng).is_err());

    // Patch order: patch (gy, gx) holds pixels [c, 4gy.., 4gx..] flattened (c, i, j).
    let img = Tensor::arange(0.0, 128.0, 1.0, DType::F32).unwrap().reshape(&[1, 2, 8, 8]).unwrap();
    let p = rtx_tensor::nn::patchify(&img, 4).unwrap();
    assert_eq!(p.shape(), &[1, 4, 32]);
    let v = p.to_f32_vec().unwrap();
    assert_eq!(&v[32..36], &[4.0, 5.0, 6.0, 7.0]); // patch 1, channel 0, row 0
    assert_eq!(v[32 + 16], 68.0); // patch 1, channel 1, row 0, col 0
}

#[test]
fn mlp_fits_a_small_problem() {
    // Goal: modules, autograd and AdamW train end to end. Method: fit 32 random points to 4
    // random labels with a small MLP; the loss must reach near zero.
    let mut rng = Generator::new(11);
    let model = Mlp::new(&[6, 32, 4], Activation::Relu, DType::F32, &mut rng).unwrap();
    let names: Vec<String> = model.named_parameters().into_iter().map(|(n, _)| n).collect();
    assert_eq!(names, ["layers.0.weight", "layers.0.bias", "layers.1.weight", "layers.1.bias"]);
    let x = Tensor::randn(&[32, 6], 0.0, 1.0, DType::F32, &mut rng).unwrap();
    let y = Tensor::from_vec((0..32u32).map(|i| (i * 7 + 3) % 4).collect(), &[32]).unwrap();
    let mut opt = AdamW::new(model.named_parameters(), AdamWConfig { lr: 0.02, weight_decay: 0.0, ..AdamWConfig::default() }).unwrap();
    let mut loss = f64::INFINITY;
    for _ in 0..300 {
        opt.zero_grad().unwrap();
        let l = model.forward(&x).unwrap().cross_entropy(&y, CrossEntropyOptions::default()).unwrap();
        loss = l.item().unwrap();
        l.backward().unwrap();
        opt.step().unwrap();
    }
    assert!(loss < 0.02, "final loss {loss}");
}

#[test]
fn gpt_padded_vocabulary_matches_the_unpadded_model_and_never_predicts_padding() {
    // Goal: padding the token table (llm.c's 50,257 -> 50,304) changes nothing a user sees:
    // logits have V columns, the loss equals the unpadded model's with the same weights, the
    // padding rows get exactly zero gradient, and an id in the padding is refused. Method: V 11
    // padded to 16; the unpadded twin is loaded from the padded model's state minus the padding.
    let config = GptConfig { vocab_pad_multiple: 8, ..tiny_gpt_config() };
    assert_eq!(config.padded_vocab(), 16);
    let padded = Gpt::new(config, &mut Generator::new(4)).unwrap();
    assert_eq!(padded.tok_emb.weight.shape(), &[16, 16]);
    let state: Vec<(String, Tensor)> = padded
        .named_parameters()
        .into_iter()
        .map(|(n, t)| if n == "tok_emb.weight" { (n, t.narrow(0, 0, 11).unwrap().contiguous().unwrap()) } else { (n, t) })
        .collect();
    let plain = Gpt::from_state_dict(tiny_gpt_config(), &state).unwrap();
    let ids = Tensor::from_vec(vec![1u32, 2, 3, 4, 5, 6, 7, 8, 9, 10], &[2, 5]).unwrap();
    let targets = Tensor::from_vec(vec![2u32, 3, 4, 5, 6, 7, 8, 9, 10, 0], &[2, 5]).unwrap();
    let mut rng = Generator::new(5);
    let (a, b) = (padded.forward(&ids, &mut rng).unwrap(), plain.forward(&ids, &mut rng).unwrap());
    assert_eq!(a.shape(), &[2, 5, 11]);
    let diff = a.to_f64_vec().unwrap().iter().zip(b.to_f64_vec().unwrap()).fold(0.0f64, |m, (x, y)| m.max((x - y).abs()));
    assert!(diff < 1e-5, "logits differ by {diff}");
    let (la, lb) = (padded.loss(&ids, &targets, &mut rng).unwrap(), plain.loss(&ids, &targets, &mut rng).unwrap());
    assert!((la.item().unwrap() - lb.item().unwrap()).abs() < 1e-5);
    la.backward().unwrap();
    let grad = padded.tok_emb.weight.grad().unwrap().to_f32_vec().unwrap();
    assert!(grad[11 * 16..].iter().all(|&g| g == 0.0), "the padding rows got a gradient");
    assert!(grad[..11 * 16].iter().any(|&g| g != 0.0));
    let in_padding = Tensor::from_vec(vec![12u32], &[1, 1]).unwrap();
    assert!(padded.forward(&in_padding, &mut rng).is_err());
    // An untied head has V rows: padding it is refused.
    assert!(Gpt::new(GptConfig { tie_embeddings: false, ..config }, &mut Generator::new(0)).is_err());
}
