//! Resume across mesh shapes: the byte-level GPT on the State of the Union corpus trained at
//! `(dp, pp, tp) = (2, 2, 2)` saves a sharded checkpoint after step 9 and goes on for 20 steps (the
//! reference). Resumed from that checkpoint at `(1, 4, 1)`, at `(1, 1, 1)`, and as plain one-model
//! training from its consolidated single file, the same 20 global batches give the same losses
//! (within 1e-5 relative, f32) and the same parameters and optimizer moments (within 1e-5); resumed
//! at `(2, 2, 2)` itself they are bit for bit the same. Damaged checkpoints are refused with typed
//! errors. Ranks are threads with real communicators over the in-process transport (the
//! `mesh_gpt.rs` harness); resumed members build their model from another seed, so everything
//! they train with comes from the checkpoint.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rtx_collectives::{CommConfig, Endpoint, InProcessNetwork, Transport};
use rtx_pipelines::pipeline::{check_model_names, load_shard, MeshEngine, PipelineConfig, TokenBatch, TpGptStage};
use rtx_pipelines::schedule::ScheduleKind;
use rtx_pipelines::tp::{TpGroup, TpOptions};
use rtx_pipelines::{Error, Mesh, MeshGroups, MeshShape};
use rtx_tensor::checkpoint::sharded::{consolidate, ModelLayout, ShardedCheckpoint, ShardedError, INDEX_FILE};
use rtx_tensor::checkpoint::{self, CheckpointMeta};
use rtx_tensor::data::TextCorpus;
use rtx_tensor::nn::{Gpt, GptConfig, Module};
use rtx_tensor::optim::{clip_grad_norm, AdamW, AdamWConfig, Sgd, SgdConfig};
use rtx_tensor::{Generator, Optimizer, Tensor};

const ROWS: usize = 8;
const T: usize = 32;
const SEED: u64 = 11;
/// Resumed members start from this seed's model, which the checkpoint must overwrite.
const OTHER_SEED: u64 = 99;
const CLIP: f64 = 1.0;
const ADAMW: AdamWConfig = AdamWConfig { lr: 1e-3, beta1: 0.9, beta2: 0.95, eps: 1e-6, weight_decay: 0.1 };
/// The checkpoint is taken after this step (steps `0..=SAVE_AFTER` trained).
const SAVE_AFTER: u64 = 9;
/// Steps trained after the checkpoint.
const MORE: u64 = 20;

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

/// Contiguous, even layer ranges for `stages`.
fn layer_ranges(layers: usize, stages: usize) -> Vec<Range<usize>> {
    (0..stages).map(|s| s * layers / stages..(s + 1) * layers / stages).collect()
}

/// What a mesh run does besides training.
#[derive(Clone, Default)]
struct Run {
    /// Load this checkpoint before the first step (and start from another seed's model).
    resume: Option<PathBuf>,
    /// Save a sharded checkpoint here after step `.1`.
    save: Vec<(PathBuf, u64)>,
}

/// Trains `steps` at `shape` with `microbatches` per replica; returns rank 0's losses (every rank
/// must report the same) or the first member error.
fn mesh_run(text: &Arc<Vec<u8>>, shape: MeshShape, microbatches: usize, steps: Range<u64>, run: &Run) -> Result<Vec<f64>, Error> {
    let world = shape.dp * shape.pp * shape.tp;
    let mesh = Mesh::new(shape, world).unwrap();
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let (_net, transports) = InProcessNetwork::new(world);
    let layers = layer_ranges(gpt_config().n_layers, shape.pp);
    // A rank keeps its endpoint until every rank is done (dropping it early would fail a slower
    // rank's last collective with PeerLost); a rank that fails drops it at once, so its peers fail
    // fast instead of waiting for the collective timeout.
    let mut endpoints = Vec::new();
    let threads: Vec<_> = transports
        .into_iter()
        .map(|t| {
            let _guard = runtime.enter();
            let endpoint = Endpoint::new(Arc::new(t) as Arc<dyn Transport>, CommConfig::default()).unwrap();
            let groups = MeshGroups::new(&endpoint, mesh, 0).unwrap();
            let endpoint = Arc::new(std::sync::Mutex::new(Some(endpoint)));
            endpoints.push(Arc::clone(&endpoint));
            let (handle, text, layers, run, steps) = (runtime.handle().clone(), Arc::clone(text), layers.clone(), run.clone(), steps.clone());
            std::thread::spawn(move || -> Result<Vec<f64>, Error> {
                let result = (|| -> Result<Vec<f64>, Error> {
                    let coord = groups.coord;
                    let seed = if run.resume.is_some() { OTHER_SEED } else { SEED };
                    let gpt = Gpt::new(gpt_config(), &mut Generator::new(seed))?;
                    let full_names: Vec<String> = gpt.named_parameters().into_iter().map(|(n, _)| n).collect();
                    let tp = TpGroup::new(groups.tp.clone(), handle.clone()).into_handle();
                    let part = TpGptStage::from_full(&gpt, tp, TpOptions::default(), &layers, coord.pp, shape.pp)?;
                    let opt = AdamW::new(part.named_parameters(), ADAMW)?;
                    let config = PipelineConfig { schedule: ScheduleKind::OneFOneB, microbatches, grad_clip: Some(CLIP), seed: 0 };
                    let mut engine = MeshEngine::new(part, opt, &groups, handle, config)?;
                    let layout = ModelLayout::gpt(&gpt_config());
                    if let Some(dir) = &run.resume {
                        let ckpt = ShardedCheckpoint::open(dir)?;
                        check_model_names(&ckpt, &full_names)?;
                        let step = engine.load_sharded(&ckpt, &layout)?;
                        assert_eq!(step + 1, steps.start, "{coord}: the checkpoint's step");
                    }
                    let rows = ROWS / shape.dp;
                    let mut losses = Vec::new();
                    for step in steps {
                        let b = global_batch(&text, step);
                        let mine = TokenBatch {
                            ids: b.ids.narrow(0, coord.dp * rows, rows)?.contiguous()?,
                            targets: b.targets.narrow(0, coord.dp * rows, rows)?.contiguous()?,
                        };
                        let micro = mine.split(microbatches)?;
                        let scales = vec![(rows / microbatches) as f64 / ROWS as f64; microbatches];
                        losses.push(engine.step(step, &micro, &scales)?.loss);
                        for (dir, _) in run.save.iter().filter(|(_, at)| *at == step) {
                            engine.save_sharded(dir, step, &layout, &CheckpointMeta::default())?;
                        }
                    }
                    Ok(losses)
                })();
                if result.is_err() {
                    drop(endpoint.lock().map(|mut e| e.take()));
                }
                result
            })
        })
        .collect();
    let results: Vec<Result<Vec<f64>, Error>> = threads.into_iter().map(|h| h.join().unwrap()).collect();
    let mut out = Vec::new();
    for r in results {
        out.push(r?);
    }
    for (rank, l) in out.iter().enumerate() {
        assert_eq!(l, &out[0], "rank {rank} reports other losses than rank 0");
    }
    Ok(out.swap_remove(0))
}

fn close(a: f64, b: f64, tol: f64) -> bool {
    (a - b).abs() <= tol * a.abs().max(b.abs()).max(1e-3)
}

fn assert_losses(what: &str, reference: &[f64], losses: &[f64]) {
    assert_eq!(reference.len(), losses.len(), "{what}: number of losses");
    let worst = reference.iter().zip(losses).map(|(a, b)| (a - b).abs() / a.abs()).fold(0f64, f64::max);
    eprintln!("{what}: {} losses, worst relative difference {worst:.2e} (last {:.5})", losses.len(), losses.last().unwrap());
    for (i, (a, b)) in reference.iter().zip(losses).enumerate() {
        assert!(close(*a, *b, 1e-5), "{what}: step {} loss {b} vs the uninterrupted run's {a}", SAVE_AFTER + 1 + i as u64);
    }
}

/// Every tensor (parameters and `optim.` state) of two complete checkpoints, within `tol`.
fn assert_same_state(what: &str, reference: &Path, other: &Path, tol: f32) {
    let (a, b) = (ShardedCheckpoint::open(reference).unwrap(), ShardedCheckpoint::open(other).unwrap());
    assert_eq!(a.names(), b.names(), "{what}: tensor names");
    let mut worst = 0f32;
    for name in a.names() {
        let (x, y) = (a.full(name).unwrap(), b.full(name).unwrap());
        assert_eq!(x.shape(), y.shape(), "{what}: {name}");
        let d = x.to_f32_vec().unwrap().iter().zip(y.to_f32_vec().unwrap()).map(|(p, q)| (p - q).abs()).fold(0f32, f32::max);
        assert!(d <= tol, "{what}: {name} differs by {d}");
        worst = worst.max(d);
    }
    eprintln!("{what}: {} tensors (parameters and AdamW state) within {worst:.2e}", a.names().len());
}

#[test]
fn a_2x2x2_checkpoint_resumes_at_pp4_and_on_one_rank_like_the_uninterrupted_run() {
    let text = corpus();
    let dir = tempfile::tempdir().unwrap();
    let (ckpt, end) = (dir.path().join("step-9"), dir.path().join("reference-end"));
    let last = SAVE_AFTER + MORE;
    let dp2 = MeshShape { dp: 2, pp: 2, tp: 2 };
    let reference = mesh_run(&text, dp2, 2, 0..last + 1, &Run { resume: None, save: vec![(ckpt.clone(), SAVE_AFTER), (end.clone(), last)] }).unwrap();
    assert!(reference[last as usize] < reference[0] - 0.3, "the reference run learns: {reference:?}");
    let after = &reference[SAVE_AFTER as usize + 1..];
    let index = ShardedCheckpoint::open(&ckpt).unwrap();
    assert_eq!((index.step(), index.index().files.len()), (SAVE_AFTER, 4), "one shard per (pp, tp) slot, written by dp rank 0");

    // The same shape resumes bit for bit: everything the optimizer needs is in the checkpoint.
    let resumed = |shape: MeshShape, m: usize, name: &str| {
        let out = dir.path().join(name);
        let losses = mesh_run(&text, shape, m, SAVE_AFTER + 1..last + 1, &Run { resume: Some(ckpt.clone()), save: vec![(out.clone(), last)] }).unwrap();
        (losses, out)
    };
    let (same, same_end) = resumed(dp2, 2, "same-end");
    assert_eq!(same, after, "(2,2,2) resumed at (2,2,2) is the uninterrupted run bit for bit");
    assert_same_state("(2,2,2) -> (2,2,2)", &end, &same_end, 0.0);

    for (shape, m) in [(MeshShape { dp: 1, pp: 4, tp: 1 }, 4), (MeshShape { dp: 1, pp: 1, tp: 1 }, 1)] {
        let (losses, out) = resumed(shape, m, &format!("end-{}-{}-{}", shape.dp, shape.pp, shape.tp));
        assert_losses(&format!("(2,2,2) -> {shape}"), after, &losses);
        assert_same_state(&format!("(2,2,2) -> {shape}"), &end, &out, 1e-5);
    }

    // One model, no mesh: the consolidated checkpoint is the single-file format.
    let single = dir.path().join("step-9.safetensors");
    consolidate(&ckpt, &single).unwrap();
    let model = Gpt::new(gpt_config(), &mut Generator::new(OTHER_SEED)).unwrap();
    let mut opt = AdamW::new(model.named_parameters(), ADAMW).unwrap();
    let meta = checkpoint::load(&single, &model, Some(&mut opt)).unwrap();
    assert_eq!(meta.step, SAVE_AFTER);
    let mut losses = Vec::new();
    for step in SAVE_AFTER + 1..last + 1 {
        let b = global_batch(&text, step);
        opt.zero_grad().unwrap();
        let loss = model.loss(&b.ids, &b.targets, &mut Generator::new(0)).unwrap();
        losses.push(loss.item().unwrap());
        loss.backward().unwrap();
        clip_grad_norm(&model.parameters(), CLIP).unwrap();
        opt.step().unwrap();
    }
    assert_losses("(2,2,2) -> plain Gpt from the consolidated file", after, &losses);

    // A shard is a plain safetensors file: full names, this slot's local shapes, the same numbers.
    let bytes = std::fs::read(ckpt.join("shard-pp1-tp1.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let qkv = st.tensor("blocks.3.attn.qkv.weight").unwrap();
    assert_eq!((qkv.dtype(), qkv.shape()), (safetensors::Dtype::F32, &[48usize, 32][..]));
    assert_eq!(st.tensor("optim.blocks.2.mlp.proj.weight.exp_avg").unwrap().shape(), &[32, 64]);
    assert!(st.tensor("blocks.0.ln1.weight").is_err() && st.tensor("pos_emb.weight").is_err());
    let stored: Vec<f32> = st.tensor("blocks.2.mlp.fc.weight").unwrap().data().chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
    let full = index.full("blocks.2.mlp.fc.weight").unwrap();
    assert_eq!(stored, full.narrow(0, 64, 64).unwrap().contiguous().unwrap().to_f32_vec().unwrap(), "tp rank 1 holds rows 64..128 of mlp.fc");
}

#[test]
fn damaged_or_foreign_checkpoints_are_refused_at_resume() {
    // Goal: a resume never trains on a checkpoint that is incomplete, corrupt, torn or of another
    // model or optimizer, and says what and why with a typed error. Method: save a (2,2,2) mesh
    // after one step, damage copies, and load each at (1,1,1) (one member, solo group).
    let text = corpus();
    let dir = tempfile::tempdir().unwrap();
    let good = dir.path().join("good");
    mesh_run(&text, MeshShape { dp: 2, pp: 2, tp: 2 }, 2, 0..1, &Run { resume: None, save: vec![(good.clone(), 0)] }).unwrap();
    let gpt = Gpt::new(gpt_config(), &mut Generator::new(OTHER_SEED)).unwrap();
    let part = TpGptStage::from_full(&gpt, TpGroup::solo().into_handle(), TpOptions::default(), std::slice::from_ref(&(0..4)), 0, 1).unwrap();
    let mut opt = AdamW::new(part.named_parameters(), ADAMW).unwrap();
    let layout = ModelLayout::gpt(&gpt_config());
    let before: Vec<Vec<f32>> = part.parameters().iter().map(|p| p.to_f32_vec().unwrap()).collect();
    let copy = |name: &str| {
        let to = dir.path().join(name);
        std::fs::create_dir_all(&to).unwrap();
        for entry in std::fs::read_dir(&good).unwrap() {
            let entry = entry.unwrap();
            std::fs::copy(entry.path(), to.join(entry.file_name())).unwrap();
        }
        to
    };
    let open = |d: &Path| ShardedCheckpoint::open(d).map_err(Error::from);

    // No index: the writers did not all finish.
    let no_index = copy("no-index");
    std::fs::remove_file(no_index.join(INDEX_FILE)).unwrap();
    let e = open(&no_index).unwrap_err();
    assert!(matches!(&e, Error::Checkpoint(s) if matches!(**s, ShardedError::MissingIndex { .. })), "{e}");
    eprintln!("no index: {e}");

    // One flipped byte in a shard: opens (lengths agree), refused on first read of that file.
    let corrupt = copy("corrupt");
    let shard = corrupt.join("shard-pp1-tp1.safetensors");
    let mut bytes = std::fs::read(&shard).unwrap();
    let at = bytes.len() - 9;
    bytes[at] ^= 0x40;
    std::fs::write(&shard, &bytes).unwrap();
    let ckpt = open(&corrupt).unwrap();
    let e = load_shard(&ckpt, &layout, 0, 1, &part, &mut opt).unwrap_err();
    assert!(
        matches!(&e, Error::Checkpoint(s) if matches!(&**s, ShardedError::ChecksumMismatch { file, .. } if file.ends_with("shard-pp1-tp1.safetensors"))),
        "{e}"
    );
    eprintln!("corrupt shard: {e}");

    // A torn (truncated) shard: refused at open.
    let torn = copy("torn");
    let shard = torn.join("shard-pp0-tp1.safetensors");
    let bytes = std::fs::read(&shard).unwrap();
    std::fs::write(&shard, &bytes[..bytes.len() / 2]).unwrap();
    let e = open(&torn).unwrap_err();
    assert!(matches!(&e, Error::Checkpoint(s) if matches!(**s, ShardedError::SizeMismatch { .. })), "{e}");

    // Another optimizer, another model.
    let ckpt = open(&good).unwrap();
    let mut sgd = Sgd::new(part.named_parameters(), SgdConfig { lr: 0.1, ..SgdConfig::default() }).unwrap();
    let e = load_shard(&ckpt, &layout, 0, 1, &part, &mut sgd).unwrap_err();
    assert!(matches!(e, Error::CheckpointMismatch { .. }), "{e}");
    let deeper: Vec<String> =
        Gpt::new(GptConfig { n_layers: 5, ..gpt_config() }, &mut Generator::new(1)).unwrap().named_parameters().into_iter().map(|(n, _)| n).collect();
    let e = check_model_names(&ckpt, &deeper).unwrap_err();
    assert!(e.to_string().contains("blocks.4."), "{e}");
    let wider = Gpt::new(GptConfig { d_model: 64, ..gpt_config() }, &mut Generator::new(1)).unwrap();
    let wide = TpGptStage::from_full(&wider, TpGroup::solo().into_handle(), TpOptions::default(), std::slice::from_ref(&(0..4)), 0, 1).unwrap();
    let mut wide_opt = AdamW::new(wide.named_parameters(), ADAMW).unwrap();
    let e = load_shard(&ckpt, &layout, 0, 1, &wide, &mut wide_opt).unwrap_err();
    assert!(matches!(&e, Error::Checkpoint(s) if matches!(**s, ShardedError::ShapeMismatch { .. })), "{e}");

    // Nothing above changed the member's parameters.
    let after: Vec<Vec<f32>> = part.parameters().iter().map(|p| p.to_f32_vec().unwrap()).collect();
    assert!(before == after, "a refused load left the parameters alone");
    // The good one loads.
    assert_eq!(load_shard(&ckpt, &layout, 0, 1, &part, &mut opt).unwrap(), 0);

    // A save that cannot write: every member gets an error, no index appears.
    let blocked = dir.path().join("a-file");
    std::fs::write(&blocked, b"not a directory").unwrap();
    let e = mesh_run(&text, MeshShape { dp: 2, pp: 1, tp: 1 }, 1, 0..1, &Run { resume: None, save: vec![(blocked.join("ckpt"), 0)] }).unwrap_err();
    assert!(matches!(&e, Error::CheckpointIncomplete { .. }) || matches!(&e, Error::Checkpoint(s) if matches!(**s, ShardedError::Io { .. })), "{e}");
}
