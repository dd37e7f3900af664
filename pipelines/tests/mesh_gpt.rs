//! Equivalence of the mesh engine with plain training: the byte-level GPT on the State of the Union
//! corpus, trained for 50 steps at several `(dp, pp, tp)` meshes and pipeline schedules, gives the
//! same losses (within 1e-5 relative, f32) and the same parameters (within 1e-5, gathered over the
//! stages) as one `Gpt` trained with `clip_grad_norm` + AdamW on the whole batch. Ranks are threads
//! with real communicators over the in-process transport; every member builds the full model from
//! the same seed and keeps its part.
//!
//! The optimizer runs at lr 1e-3 with eps 1e-6: with eps 1e-8, Adam turns the roundoff of
//! near-zero gradients into full-size steps of either sign, so runs equal in exact arithmetic part
//! by more than 1e-5 within 50 steps from summation order alone (measured: cutting the batch into
//! two micro-batches on one rank moved `blocks.0.attn.proj.weight` by 2.3e-5 at lr 3e-3).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::ops::Range;
use std::path::Path;
use std::sync::Arc;

use rtx_collectives::{CommConfig, Endpoint, InProcessNetwork, Transport};
use rtx_pipelines::pipeline::{GptStage, MeshEngine, PipelineConfig, StageModule, TokenBatch, TpGptStage};
use rtx_pipelines::tp::{gpt_shard_spec, TpGroup, TpOptions};
use rtx_pipelines::schedule::ScheduleKind;
use rtx_pipelines::{Mesh, MeshGroups, MeshShape};
use rtx_tensor::data::TextCorpus;
use rtx_tensor::nn::{Gpt, GptConfig, Module};
use rtx_tensor::optim::{clip_grad_norm, AdamW, AdamWConfig};
use rtx_tensor::{Generator, Optimizer, Tensor};

const STEPS: u64 = 50;
const ROWS: usize = 8;
const T: usize = 32;
const SEED: u64 = 11;
const CLIP: f64 = 1.0;
const ADAMW: AdamWConfig = AdamWConfig { lr: 1e-3, beta1: 0.9, beta2: 0.95, eps: 1e-6, weight_decay: 0.1 };

fn gpt_config() -> GptConfig {
    GptConfig { vocab_size: 256, context: T, d_model: 32, n_layers: 4, n_heads: 4, ..GptConfig::default() }
}

fn corpus() -> Arc<Vec<u8>> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../data/sotu");
    let corpus = TextCorpus::load_dir(&dir).expect("the SOTU corpus (bash scripts/fetch-data.sh)");
    Arc::new(corpus.bytes().to_vec())
}

/// The global batch of `step`: `ROWS` windows of `T + 1` bytes at seeded offsets.
fn global_batch(text: &[u8], step: u64) -> TokenBatch {
    let mut g = Generator::new(1_000 + step);
    let (mut ids, mut targets) = (Vec::new(), Vec::new());
    for _ in 0..ROWS {
        let at = g.below((text.len() - T - 1) as u64) as usize;
        ids.extend(text[at..at + T].iter().map(|&b| u32::from(b)));
        targets.extend(text[at + 1..at + T + 1].iter().map(|&b| u32::from(b)));
    }
    TokenBatch { ids: Tensor::from_vec(ids, &[ROWS, T]).unwrap(), targets: Tensor::from_vec(targets, &[ROWS, T]).unwrap() }
}

/// Losses and final parameters of plain training.
fn reference(text: &[u8]) -> (Vec<f64>, BTreeMap<String, Tensor>) {
    let model = Gpt::new(gpt_config(), &mut Generator::new(SEED)).unwrap();
    let mut opt = AdamW::new(model.named_parameters(), ADAMW).unwrap();
    let mut losses = Vec::new();
    for step in 0..STEPS {
        let b = global_batch(text, step);
        opt.zero_grad().unwrap();
        let loss = model.loss(&b.ids, &b.targets, &mut Generator::new(0)).unwrap();
        losses.push(loss.item().unwrap());
        loss.backward().unwrap();
        clip_grad_norm(&model.parameters(), CLIP).unwrap();
        opt.step().unwrap();
    }
    (losses, model.named_parameters().into_iter().collect())
}

/// Contiguous layer ranges for `virtual_stages` (the first ones one layer longer when uneven).
fn layer_ranges(layers: usize, virtual_stages: usize) -> Vec<Range<usize>> {
    let (each, extra) = (layers / virtual_stages, layers % virtual_stages);
    let mut start = 0;
    (0..virtual_stages)
        .map(|v| {
            let len = each + usize::from(v < extra);
            start += len;
            start - len..start
        })
        .collect()
}

/// A member's tensor rank, tensor-parallel size and final parameters.
type Member = (usize, usize, BTreeMap<String, Vec<f32>>);

/// Losses (from rank 0) and every member's final parameters for a mesh run.
fn mesh_run(text: Arc<Vec<u8>>, shape: MeshShape, schedule: ScheduleKind, microbatches: usize, tensor_parallel_stage: bool) -> (Vec<f64>, Vec<Member>) {
    let world = shape.dp * shape.pp * shape.tp;
    let mesh = Mesh::new(shape, world).unwrap();
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let (_net, transports) = InProcessNetwork::new(world);
    let chunks = match schedule {
        ScheduleKind::Interleaved { chunks } => chunks,
        _ => 1,
    };
    let layers = layer_ranges(gpt_config().n_layers, shape.pp * chunks);
    // Every endpoint outlives every rank's last collective: a rank that dropped its endpoint as
    // soon as it finished would make a slower rank's next collective fail with PeerLost.
    let mut endpoints = Vec::new();
    let threads: Vec<_> = transports
        .into_iter()
        .map(|t| {
            let _guard = runtime.enter();
            let endpoint = Endpoint::new(Arc::new(t) as Arc<dyn Transport>, CommConfig::default()).unwrap();
            let groups = MeshGroups::new(&endpoint, mesh, 0).unwrap();
            endpoints.push(endpoint);
            let (handle, text, layers) = (runtime.handle().clone(), Arc::clone(&text), layers.clone());
            std::thread::spawn(move || {
                let coord = groups.coord;
                let gpt = Gpt::new(gpt_config(), &mut Generator::new(SEED)).unwrap();
                let config = PipelineConfig { schedule, microbatches, grad_clip: Some(CLIP), seed: 0 };
                if tensor_parallel_stage {
                    let tp = TpGroup::new(groups.tp.clone(), handle.clone()).into_handle();
                    let part = TpGptStage::from_full(&gpt, tp, TpOptions::default(), &layers, coord.pp, shape.pp).unwrap();
                    let (losses, params) = train(part, &groups, handle, config, &text, shape, coord.dp, microbatches);
                    (losses, (coord.tp, shape.tp, params))
                } else {
                    assert_eq!(shape.tp, 1);
                    let part = GptStage::from_full(gpt, &layers, coord.pp, shape.pp).unwrap();
                    let (losses, params) = train(part, &groups, handle, config, &text, shape, coord.dp, microbatches);
                    (losses, (coord.tp, shape.tp, params))
                }
            })
        })
        .collect();
    let results: Vec<_> = threads.into_iter().map(|h| h.join().unwrap()).collect();
    let losses = results[0].0.clone();
    for (rank, (l, _)) in results.iter().enumerate() {
        assert_eq!(l, &losses, "rank {rank} reports other losses than rank 0");
    }
    (losses, results.into_iter().map(|(_, p)| p).collect())
}

/// One member's run: its losses and final parameters (its tensor-parallel slices gathered by the
/// caller's comparison, which checks each slice against the reference's matching part).
#[allow(clippy::too_many_arguments)]
fn train<S: StageModule<MicroBatch = TokenBatch>>(part: S, groups: &MeshGroups, handle: tokio::runtime::Handle, config: PipelineConfig, text: &[u8], shape: MeshShape, dp: usize, microbatches: usize) -> (Vec<f64>, BTreeMap<String, Vec<f32>>) {
                let opt = AdamW::new(part.named_parameters(), ADAMW).unwrap();
                let mut engine = MeshEngine::new(part, opt, groups, handle, config).unwrap();
                let rows = ROWS / shape.dp;
                let mut losses = Vec::new();
                for step in 0..STEPS {
                    let b = global_batch(text, step);
                    let mine = TokenBatch { ids: b.ids.narrow(0, dp * rows, rows).unwrap().contiguous().unwrap(), targets: b.targets.narrow(0, dp * rows, rows).unwrap().contiguous().unwrap() };
                    let micro = mine.split(microbatches).unwrap();
                    let scales = vec![(rows / microbatches) as f64 / ROWS as f64; microbatches];
                    losses.push(engine.step(step, &micro, &scales).unwrap().loss);
                }
                let params: BTreeMap<String, Vec<f32>> = engine.part().named_parameters().into_iter().map(|(n, p)| (n, p.to_f32_vec().unwrap())).collect();
                (losses, params)
}

fn close(a: f64, b: f64, tol: f64) -> bool {
    (a - b).abs() <= tol * a.abs().max(b.abs()).max(1e-3)
}

fn assert_equivalent(what: &str, reference: &(Vec<f64>, BTreeMap<String, Tensor>), run: &(Vec<f64>, Vec<Member>)) {
    let (ref_losses, ref_params) = reference;
    let (losses, members) = run;
    let worst = ref_losses.iter().zip(losses).map(|(a, b)| (a - b).abs() / a.abs()).fold(0f64, f64::max);
    eprintln!("{what}: worst relative loss difference {worst:.2e}");
    for (step, (a, b)) in ref_losses.iter().zip(losses).enumerate() {
        assert!(close(*a, *b, 1e-5), "{what}: step {step} loss {b} vs plain training's {a}");
    }
    let mut covered = BTreeMap::new();
    for (tp_rank, tp, params) in members {
        for (name, values) in params {
            let full = ref_params.get(name).unwrap_or_else(|| panic!("{what}: unknown parameter {name}"));
            // A tensor-parallel member holds its slice of the reference tensor.
            let want = match gpt_shard_spec(name, *tp) {
                Some(spec) if *tp > 1 => spec.slice(full, *tp_rank).unwrap().to_f32_vec().unwrap(),
                _ => full.to_f32_vec().unwrap(),
            };
            assert_eq!(want.len(), values.len(), "{what}: {name} length");
            let worst = want.iter().zip(values).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            assert!(worst <= 1e-5, "{what}: {name} differs by {worst}");
            *covered.entry(name.clone()).or_insert(0usize) += values.len();
        }
    }
    for (name, full) in ref_params {
        assert!(covered.get(name).is_some_and(|&n| n >= full.numel()), "{what}: the members together hold all of {name}");
    }
    eprintln!("{what}: 50 losses and every parameter match plain training (last loss {:.5})", losses.last().unwrap());
}

#[test]
fn meshes_and_schedules_train_like_one_model() {
    let text = corpus();
    let reference = reference(&text);
    assert!(reference.0[STEPS as usize - 1] < reference.0[0] - 0.5, "the reference run learns: {:?}", reference.0);
    // (dp, pp, tp), schedule, micro-batches, whether the stage is the tensor-parallel one.
    let cases = [
        (MeshShape { dp: 1, pp: 1, tp: 1 }, ScheduleKind::OneFOneB, 1, false),
        (MeshShape { dp: 1, pp: 1, tp: 1 }, ScheduleKind::OneFOneB, 2, true),
        (MeshShape { dp: 2, pp: 1, tp: 1 }, ScheduleKind::OneFOneB, 2, false),
        (MeshShape { dp: 1, pp: 1, tp: 2 }, ScheduleKind::OneFOneB, 2, true),
        (MeshShape { dp: 1, pp: 2, tp: 1 }, ScheduleKind::GPipe, 4, false),
        (MeshShape { dp: 1, pp: 2, tp: 1 }, ScheduleKind::OneFOneB, 4, false),
        (MeshShape { dp: 1, pp: 2, tp: 1 }, ScheduleKind::Interleaved { chunks: 2 }, 4, false),
        (MeshShape { dp: 1, pp: 2, tp: 1 }, ScheduleKind::ZeroBubbleH1, 4, false),
        (MeshShape { dp: 1, pp: 2, tp: 2 }, ScheduleKind::OneFOneB, 4, true),
        (MeshShape { dp: 1, pp: 2, tp: 2 }, ScheduleKind::Interleaved { chunks: 2 }, 4, true),
        (MeshShape { dp: 2, pp: 2, tp: 2 }, ScheduleKind::OneFOneB, 2, true),
        (MeshShape { dp: 2, pp: 2, tp: 1 }, ScheduleKind::ZeroBubbleH1, 2, false),
        (MeshShape { dp: 1, pp: 4, tp: 1 }, ScheduleKind::OneFOneB, 8, false),
    ];
    for (shape, schedule, m, tp_stage) in cases {
        let run = mesh_run(Arc::clone(&text), shape, schedule, m, tp_stage);
        assert_equivalent(&format!("{shape} {schedule:?} m={m} tp-stage={tp_stage}"), &reference, &run);
    }
}
