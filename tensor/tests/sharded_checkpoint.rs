//! Sharded checkpoints: a tiny GPT with AdamW state cut as a (tp=2, pp=2) mesh holds it, written
//! as 4 shards + index, then read back whole bit for bit, loaded into (tp=1, pp=4), (tp=4,
//! pp=1) and single-rank cuts, consolidated into the single-file format, and damaged in every way
//! the format promises to catch (typed errors naming file and tensor, never a panic).
#![allow(clippy::unwrap_used)]

use rtx_tensor::checkpoint::sharded::{
    consolidate, even_stages, write_index, Cut, IndexBuilder, ModelLayout, Part, ShardManifest, ShardWriter, ShardedCheckpoint, ShardedError, Split, INDEX_FILE,
};
use rtx_tensor::checkpoint::{self, CheckpointMeta, OPTIM_PREFIX};
use rtx_tensor::nn::{Gpt, GptConfig, Module};
use rtx_tensor::optim::{AdamW, AdamWConfig, Optimizer};
use rtx_tensor::{Generator, Tensor};
use std::collections::BTreeMap;
use std::path::Path;

fn config() -> GptConfig {
    GptConfig { vocab_size: 16, context: 8, d_model: 8, n_layers: 4, n_heads: 4, dropout: 0.0, ..GptConfig::default() }
}

/// A model after one AdamW step (so the optimizer state is not zero), its optimizer, and the
/// full named tensors a checkpoint holds: parameters, then `optim.`-prefixed state.
fn trained() -> (Gpt, AdamW, Vec<(String, Tensor)>) {
    trained_from(7)
}

fn trained_from(seed: u64) -> (Gpt, AdamW, Vec<(String, Tensor)>) {
    let model = Gpt::new(config(), &mut Generator::new(seed)).unwrap();
    let mut opt = AdamW::new(model.named_parameters(), AdamWConfig { lr: 1e-2, ..AdamWConfig::default() }).unwrap();
    let mut data = Generator::new(8);
    let ids: Vec<u32> = (0..16).map(|_| data.below(16) as u32).collect();
    let x = Tensor::from_vec(ids.clone(), &[2, 8]).unwrap();
    let y = Tensor::from_vec(ids.iter().map(|&t| (t + 5) % 16).collect(), &[2, 8]).unwrap();
    opt.zero_grad().unwrap();
    model.loss(&x, &y, &mut Generator::new(9)).unwrap().backward().unwrap();
    opt.step().unwrap();
    let mut full = model.named_parameters();
    full.extend(opt.state_tensors().unwrap().into_iter().map(|(n, t)| (format!("{OPTIM_PREFIX}{n}"), t)));
    (model, opt, full)
}

fn bits(t: &Tensor) -> Vec<u64> {
    t.to_f64_vec().unwrap().into_iter().map(f64::to_bits).collect()
}

fn named_bits(named: &[(String, Tensor)]) -> Vec<(String, Vec<usize>, Vec<u64>)> {
    named.iter().map(|(n, t)| (n.clone(), t.shape().to_vec(), bits(t))).collect()
}

/// Every cut of a (tp, pp) mesh with its label, stage-major.
fn mesh_cuts(layout: &ModelLayout, tp: usize, pp: usize) -> Vec<(String, Cut<'_>)> {
    let n = config().n_layers;
    let stages = even_stages(n, pp).unwrap();
    let mut cuts = Vec::new();
    for (s, blocks) in stages.into_iter().enumerate() {
        for r in 0..tp {
            cuts.push((format!("pp{s}-tp{r}"), Cut::new(layout, r, tp, blocks.clone(), n)));
        }
    }
    cuts
}

/// Writes `full` cut as a (tp, pp) mesh holds it: every member's shard in parallel (one thread
/// each), then the index. Returns the manifests.
fn write_mesh(dir: &Path, full: &[(String, Tensor)], tp: usize, pp: usize, metadata: &BTreeMap<String, String>) -> Vec<ShardManifest> {
    let layout = ModelLayout::gpt(&config());
    let cuts = mesh_cuts(&layout, tp, pp);
    let manifests: Vec<ShardManifest> = std::thread::scope(|scope| {
        let handles: Vec<_> = cuts
            .iter()
            .map(|(label, cut)| {
                scope.spawn(move || {
                    let local = cut.cut(full).unwrap();
                    let refs: Vec<(&str, &Tensor, Part)> = local.iter().map(|(n, t, p)| (n.as_str(), t, *p)).collect();
                    // A member that holds only its local tensors derives the same parts.
                    let held: Vec<(String, Tensor)> = local.iter().map(|(n, t, _)| (n.clone(), t.clone())).collect();
                    let derived: Vec<(&str, Part)> = cut.local_parts(&held).unwrap().into_iter().map(|(n, _, p)| (n, p)).collect();
                    assert_eq!(derived, refs.iter().map(|(n, _, p)| (*n, *p)).collect::<Vec<_>>());
                    ShardWriter::write(dir, label, &refs).unwrap()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    write_index(dir, 3, &[("pp", pp), ("tp", tp)], &manifests, metadata).unwrap();
    manifests
}

fn saved_2x2() -> (tempfile::TempDir, Vec<(String, Tensor)>) {
    let dir = tempfile::tempdir().unwrap();
    let (_, _, full) = trained();
    write_mesh(dir.path(), &full, 2, 2, &BTreeMap::from([("config".to_string(), "abc".to_string())]));
    (dir, full)
}

fn shard(dir: &Path, label: &str) -> std::path::PathBuf {
    dir.join(format!("shard-{label}.safetensors"))
}

/// The error of `result`, whose message must name `file` and `tensor`.
fn error_naming<T: std::fmt::Debug>(result: Result<T, ShardedError>, file: &str, tensor: &str) -> ShardedError {
    let e = result.unwrap_err();
    let msg = e.to_string();
    assert!(msg.contains(file), "{msg:?} does not name {file:?}");
    assert!(msg.contains(tensor), "{msg:?} does not name {tensor:?}");
    e
}

#[test]
fn tp2_pp2_shards_read_back_whole_bit_for_bit() {
    // Goal: `.full()` of every name equals the original exactly, replicas appear once, the index
    // records what was saved. Method: write the (2, 2) mesh, open, compare every tensor.
    let (dir, full) = saved_2x2();
    let ckpt = ShardedCheckpoint::open(dir.path()).unwrap();
    let mut names: Vec<&str> = full.iter().map(|(n, _)| n.as_str()).collect();
    names.sort();
    assert_eq!(ckpt.names(), names);
    for (name, t) in &full {
        let got = ckpt.full(name).unwrap();
        assert_eq!((got.shape(), bits(&got)), (t.shape(), bits(t)), "{name}");
    }
    assert_eq!(ckpt.step(), 3);
    assert_eq!(ckpt.mesh(), &[("pp".to_string(), 2), ("tp".to_string(), 2)]);
    assert_eq!(ckpt.metadata()["config"], "abc");
    let index = ckpt.index();
    assert_eq!(index.files.len(), 4);
    // LayerNorm: replicated over tp, kept once from the lowest label.
    let ln = &index.tensors["ln_f.weight"].pieces;
    assert_eq!((ln.len(), ln[0].file.as_str(), ln[0].part), (1, "shard-pp1-tp0.safetensors", Part::Whole));
    // Tied embedding: on both stages, split over tp; the first stage's pieces are kept.
    let emb: Vec<(&str, Part)> = index.tensors["tok_emb.weight"].pieces.iter().map(|p| (p.file.as_str(), p.part)).collect();
    assert_eq!(
        emb,
        vec![("shard-pp0-tp0.safetensors", Part::Split(Split::range(0, 0, 8, 16))), ("shard-pp0-tp1.safetensors", Part::Split(Split::range(0, 8, 8, 16)))]
    );
    // qkv: heads split, so each rank holds the same rows of q, k and v.
    let qkv = &index.tensors["blocks.2.attn.qkv.weight"].pieces;
    assert_eq!(qkv[1].part, Part::Split(Split { dim: 0, start: 4, len: 4, full_len: 24, groups: 3 }));
    assert_eq!(qkv[1].file, "shard-pp1-tp1.safetensors");
    // Optimizer state follows its parameter; 0-d step counts are whole.
    assert_eq!(index.tensors["optim.blocks.0.attn.proj.weight.exp_avg"].pieces[0].part, Part::Split(Split::range(1, 0, 4, 8)));
    assert_eq!(index.tensors["optim.blocks.0.attn.proj.weight.step"].pieces[0].part, Part::Whole);
    ckpt.verify().unwrap();
}

#[test]
fn shard_files_are_plain_safetensors_with_full_names_and_local_shapes() {
    // Goal: PyTorch's safetensors loader reads every shard (Python's `safetensors` is not
    // installed here, so the Rust crate it binds checks the format). Method: deserialize each
    // file with `SafeTensors::deserialize` and with the single-file reader.
    let (dir, _) = saved_2x2();
    let bytes = std::fs::read(shard(dir.path(), "pp1-tp1")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let qkv = st.tensor("blocks.3.attn.qkv.weight").unwrap();
    assert_eq!((qkv.dtype(), qkv.shape()), (safetensors::Dtype::F32, &[12usize, 8][..]));
    assert_eq!(st.tensor("blocks.3.attn.proj.weight").unwrap().shape(), &[8, 4]);
    assert_eq!(st.tensor("tok_emb.weight").unwrap().shape(), &[8, 8]);
    assert!(st.tensor("blocks.0.ln1.weight").is_err() && st.tensor("pos_emb.weight").is_err());
    let (tensors, metadata) = checkpoint::load_tensors(&shard(dir.path(), "pp0-tp0")).unwrap();
    assert_eq!(metadata["label"], "pp0-tp0");
    assert!(tensors.iter().any(|(n, t)| n == "optim.blocks.1.mlp.fc.weight.exp_avg_sq" && t.shape() == [16, 8]));
}

#[test]
fn manifests_rebuilt_from_the_files_equal_the_writers() {
    // Goal: an index writer that only shares the directory gets the same manifests the writers
    // returned, and a file of another label or format is refused. Method: write the (2, 2) mesh,
    // rebuild every manifest with `ShardManifest::read` and compare; then ask for a label under a
    // renamed file.
    let dir = tempfile::tempdir().unwrap();
    let (_, _, full) = trained();
    let mut written = write_mesh(dir.path(), &full, 2, 2, &BTreeMap::new());
    written.sort_by(|a, b| a.label.cmp(&b.label));
    for m in &mut written {
        m.tensors.sort_by(|a, b| a.name.cmp(&b.name));
        assert_eq!(&ShardManifest::read(dir.path(), &m.label).unwrap(), m, "{}", m.label);
    }
    std::fs::copy(shard(dir.path(), "pp0-tp0"), shard(dir.path(), "pp9-tp9")).unwrap();
    assert!(matches!(ShardManifest::read(dir.path(), "pp9-tp9"), Err(ShardedError::BadShard { .. })));
    assert!(matches!(ShardManifest::read(dir.path(), "pp7-tp7"), Err(ShardedError::MissingShard { .. })));
}

#[test]
fn loads_into_other_mesh_shapes_and_one_rank() {
    // Goal: any target mesh takes its part. Method: for (tp, pp) = (1, 4), (4, 1), (1, 1) and
    // (2, 2), every member's expected part is the cut of the original tensors (tensor ops, not
    // the reader's byte copies); fill zero tensors of those shapes through `load_into`.
    let (dir, full) = saved_2x2();
    let ckpt = ShardedCheckpoint::open(dir.path()).unwrap();
    let layout = ModelLayout::gpt(&config());
    for (tp, pp) in [(1, 4), (4, 1), (1, 1), (2, 2)] {
        for (label, cut) in mesh_cuts(&layout, tp, pp) {
            let expected: Vec<(String, Tensor)> = cut.cut(&full).unwrap().into_iter().map(|(n, t, _)| (n, t)).collect();
            let locals: Vec<(String, Tensor)> = expected.iter().map(|(n, t)| (n.clone(), Tensor::zeros(t.shape(), t.dtype()))).collect();
            ckpt.load_into(&locals, &cut).unwrap();
            assert_eq!(named_bits(&locals), named_bits(&expected), "tp={tp} pp={pp} {label}");
        }
    }
    // A model and optimizer on one rank resume from it like from the single-file format.
    let (model, opt, _) = trained();
    let fresh = Gpt::new(config(), &mut Generator::new(99)).unwrap();
    let mut fresh_opt = AdamW::new(fresh.named_parameters(), AdamWConfig { lr: 1e-2, ..AdamWConfig::default() }).unwrap();
    let whole = Cut::whole(&layout, config().n_layers);
    ckpt.load_into(&fresh.named_parameters(), &whole).unwrap();
    let like: Vec<(String, Tensor)> = fresh_opt.state_tensors().unwrap().into_iter().map(|(n, t)| (format!("{OPTIM_PREFIX}{n}"), t)).collect();
    let state = ckpt.read_like(&like, &|_: &str, _: &[usize]| Ok::<Part, String>(Part::Whole)).unwrap();
    let state: Vec<(String, Tensor)> = state.into_iter().map(|(n, t)| (n[OPTIM_PREFIX.len()..].to_string(), t)).collect();
    fresh_opt.load_state(&state).unwrap();
    assert_eq!(named_bits(&fresh.named_parameters()), named_bits(&model.named_parameters()));
    assert_eq!(named_bits(&fresh_opt.state_tensors().unwrap()), named_bits(&opt.state_tensors().unwrap()));
}

#[test]
fn slices_read_across_pieces_and_along_other_dims() {
    // Goal: `.slice` returns exactly the rows asked for, wherever the pieces' boundaries are.
    // Method: rows 10..20 of fc (pieces 0..16, 16..32), rows 5..19 of qkv (grouped pieces), and
    // columns 2..7 of tok_emb (split along rows), against `narrow` of the original.
    let (dir, full) = saved_2x2();
    let ckpt = ShardedCheckpoint::open(dir.path()).unwrap();
    let get = |name: &str| full.iter().find(|(n, _)| n == name).unwrap().1.clone();
    for (name, dim, start, len) in [
        ("blocks.1.mlp.fc.weight", 0, 10, 10),
        ("blocks.3.attn.qkv.weight", 0, 5, 14),
        ("tok_emb.weight", 1, 2, 5),
        ("blocks.0.attn.proj.weight", 1, 3, 2),
        ("ln_f.bias", 0, 1, 6),
    ] {
        let got = ckpt.slice(name, dim, start, len).unwrap();
        let want = get(name).narrow(dim as isize, start, len).unwrap();
        assert_eq!((got.shape(), bits(&got)), (want.shape(), bits(&want)), "{name}");
    }
    let e = error_naming(ckpt.slice("ln_f.bias", 0, 4, 5), INDEX_FILE, "ln_f.bias");
    assert!(matches!(e, ShardedError::BadPart { .. }), "{e}");
    assert!(matches!(ckpt.full("no.such"), Err(ShardedError::UnknownTensor { .. })));
}

#[test]
fn consolidated_file_equals_the_single_file_checkpoint() {
    // Goal: `consolidate` writes what `checkpoint::save` writes, so PyTorch and `checkpoint::load`
    // read it. Method: save the same model, optimizer and meta both ways; compare the bytes, then
    // load the consolidated file into a fresh model.
    let (model, opt, full) = trained();
    let dir = tempfile::tempdir().unwrap();
    let meta = CheckpointMeta { step: 3, rngs: BTreeMap::from([("data".to_string(), Generator::new(5).state())]), user: serde_json::json!({ "cursor": 3 }) };
    let single = dir.path().join("single.safetensors");
    checkpoint::save(&single, &model, Some(&opt), &meta).unwrap();
    let sharded = dir.path().join("sharded");
    write_mesh(&sharded, &full, 2, 2, &checkpoint::file_metadata(&meta, Some(&opt)).unwrap());
    let out = dir.path().join("consolidated.safetensors");
    consolidate(&sharded, &out).unwrap();
    assert_eq!(std::fs::read(&out).unwrap(), std::fs::read(&single).unwrap());
    let fresh = Gpt::new(config(), &mut Generator::new(99)).unwrap();
    assert_eq!(checkpoint::load(&out, &fresh, None).unwrap(), meta);
    assert_eq!(named_bits(&fresh.named_parameters()), named_bits(&model.named_parameters()));
}

#[test]
fn incomplete_corrupt_and_torn_checkpoints_are_refused() {
    // Goal: every damage the format promises to catch is a typed error naming file and tensor.
    // Method: damage copies of one good checkpoint: no index, a garbage / truncated / future
    // index, a deleted, a truncated and a bit-flipped shard, two swapped shards, and a shard from
    // another checkpoint.
    let (good, _) = saved_2x2();
    let copy = || {
        let d = tempfile::tempdir().unwrap();
        for entry in std::fs::read_dir(good.path()).unwrap() {
            let entry = entry.unwrap();
            std::fs::copy(entry.path(), d.path().join(entry.file_name())).unwrap();
        }
        d
    };
    let index_text = std::fs::read_to_string(good.path().join(INDEX_FILE)).unwrap();

    let d = copy();
    std::fs::remove_file(d.path().join(INDEX_FILE)).unwrap();
    assert!(matches!(ShardedCheckpoint::open(d.path()), Err(ShardedError::MissingIndex { .. })));

    for bad in ["", "{", "not json", &index_text[..index_text.len() / 2], "[1, 2]", "{\"format\": \"rustytorch.sharded-checkpoint\", \"version\": 1}"] {
        std::fs::write(d.path().join(INDEX_FILE), bad).unwrap();
        let e = ShardedCheckpoint::open(d.path()).unwrap_err();
        assert!(matches!(e, ShardedError::BadIndex { .. } | ShardedError::UnknownVersion { .. }), "{bad:?}: {e}");
    }
    std::fs::write(d.path().join(INDEX_FILE), index_text.replace("\"version\": 1", "\"version\": 2")).unwrap();
    let e = ShardedCheckpoint::open(d.path()).unwrap_err();
    assert!(matches!(e, ShardedError::UnknownVersion { .. }) && e.to_string().contains("v2"), "{e}");
    std::fs::write(d.path().join(INDEX_FILE), index_text.replace("shard-pp0-tp0.safetensors", "../pp0.safetensors")).unwrap();
    assert!(matches!(ShardedCheckpoint::open(d.path()), Err(ShardedError::BadIndex { .. })));

    let d = copy();
    std::fs::remove_file(shard(d.path(), "pp1-tp0")).unwrap();
    let e = error_naming(ShardedCheckpoint::open(d.path()), "shard-pp1-tp0.safetensors", "blocks.");
    assert!(matches!(e, ShardedError::MissingShard { .. }), "{e}");

    let d = copy();
    let path = shard(d.path(), "pp0-tp1");
    let bytes = std::fs::read(&path).unwrap();
    for cut in [0, 7, 100, bytes.len() - 1] {
        std::fs::write(&path, &bytes[..cut]).unwrap();
        let e = error_naming(ShardedCheckpoint::open(d.path()), "shard-pp0-tp1.safetensors", "blocks.");
        assert!(matches!(e, ShardedError::SizeMismatch { .. }), "{e}");
    }

    // A flipped byte in the data: found when the file is first read from; other files still read.
    let d = copy();
    let path = shard(d.path(), "pp0-tp1");
    let mut flipped = bytes.clone();
    let last = flipped.len() - 3;
    flipped[last] ^= 0x10;
    std::fs::write(&path, &flipped).unwrap();
    let ckpt = ShardedCheckpoint::open(d.path()).unwrap();
    let e = error_naming(ckpt.full("blocks.0.mlp.fc.weight"), "shard-pp0-tp1.safetensors", "blocks.0.mlp.fc.weight");
    assert!(matches!(e, ShardedError::ChecksumMismatch { .. }), "{e}");
    ckpt.full("blocks.3.mlp.fc.weight").unwrap();
    assert!(matches!(ckpt.verify(), Err(ShardedError::ChecksumMismatch { .. })));

    // Two shards of one checkpoint swapped: their headers record different rows, so their
    // lengths differ and open refuses them.
    let d = copy();
    let (a, b) = (shard(d.path(), "pp1-tp0"), shard(d.path(), "pp1-tp1"));
    let tmp = d.path().join("tmp");
    std::fs::rename(&a, &tmp).unwrap();
    std::fs::rename(&b, &a).unwrap();
    std::fs::rename(&tmp, &b).unwrap();
    let e = error_naming(ShardedCheckpoint::open(d.path()), "shard-pp1-tp0.safetensors", "blocks.");
    assert!(matches!(e, ShardedError::SizeMismatch { .. }), "{e}");

    // The same shard of another checkpoint (other weights, same layout and length): the headers
    // agree, the checksum does not.
    let d = copy();
    let other = tempfile::tempdir().unwrap();
    write_mesh(other.path(), &trained_from(8).2, 2, 2, &BTreeMap::from([("config".to_string(), "abc".to_string())]));
    std::fs::copy(shard(other.path(), "pp1-tp0"), shard(d.path(), "pp1-tp0")).unwrap();
    let ckpt = ShardedCheckpoint::open(d.path()).unwrap();
    let e = error_naming(ckpt.full("blocks.2.attn.qkv.weight"), "shard-pp1-tp0.safetensors", "blocks.2.attn.qkv.weight");
    assert!(matches!(e, ShardedError::ChecksumMismatch { .. }), "{e}");
}

#[test]
fn indexes_with_gaps_overlaps_or_disagreeing_shapes_are_refused() {
    // Goal: pieces must tile each tensor exactly and agree with the shard files, both when the
    // index is written and when it is read. Method: write overlapping, gapped and divergent
    // shards by hand; edit a good index to drop a piece and to change a shape.
    let dir = tempfile::tempdir().unwrap();
    let t = Tensor::from_vec((0..80).map(|i| i as f32).collect::<Vec<_>>(), &[10, 8]).unwrap();
    let write = |label: &str, start: usize, value: &Tensor| {
        ShardWriter::write(dir.path(), label, &[("w", value, Part::Split(Split::range(0, start, 10, 16)))]).unwrap()
    };
    let (a, b) = (write("a", 0, &t), write("b", 4, &t));
    let e = error_naming(write_index(dir.path(), 1, &[("tp", 2)], &[a.clone(), b], &BTreeMap::new()), "shard-b.safetensors", "w");
    assert!(matches!(e, ShardedError::Overlap { start: 4, end: 10, .. }), "{e}");
    let c = write("c", 6, &t.narrow(0, 0, 10).unwrap());
    let small = ShardWriter::write(dir.path(), "c", &[("w", &t.narrow(0, 0, 4).unwrap(), Part::Split(Split::range(0, 12, 4, 16)))]).unwrap();
    let e = error_naming(write_index(dir.path(), 1, &[("tp", 2)], &[a.clone(), small], &BTreeMap::new()), INDEX_FILE, "w");
    assert!(matches!(e, ShardedError::Gap { start: 10, end: 12, .. }), "{e}");
    assert!(matches!(write_index(dir.path(), 1, &[], &[a.clone(), c.clone(), c], &BTreeMap::new()), Err(ShardedError::BadLabel { .. })));
    // Replicas that differ.
    let zeros = Tensor::zeros(&[10, 8], t.dtype());
    let r1 = ShardWriter::write(dir.path(), "r1", &[("w", &t, Part::Whole)]).unwrap();
    let r2 = ShardWriter::write(dir.path(), "r2", &[("w", &zeros, Part::Whole)]).unwrap();
    let e = error_naming(IndexBuilder::new().add(r1.clone()).add(r2).build(1, &[], &BTreeMap::new()), "shard-r2.safetensors", "w");
    assert!(matches!(e, ShardedError::ReplicasDiffer { .. }), "{e}");
    let r3 = ShardWriter::write(dir.path(), "r3", &[("w", &t, Part::Whole)]).unwrap();
    let index = IndexBuilder::new().add(r3).add(r1).build(1, &[], &BTreeMap::new()).unwrap();
    assert_eq!(index.tensors["w"].pieces.len(), 1);
    assert_eq!(index.tensors["w"].pieces[0].file, "shard-r1.safetensors");
    assert!(matches!(ShardWriter::write(dir.path(), "../x", &[]), Err(ShardedError::BadLabel { .. })));
    let e = ShardWriter::write(dir.path(), "bad", &[("w", &t, Part::Split(Split::range(0, 0, 9, 16)))]).unwrap_err();
    assert!(matches!(e, ShardedError::BadPart { .. }) && e.to_string().contains("shard-bad.safetensors"), "{e}");

    // Hand-edited indexes of a good checkpoint.
    let (good, _) = saved_2x2();
    let index_path = good.path().join(INDEX_FILE);
    let original: serde_json::Value = serde_json::from_slice(&std::fs::read(&index_path).unwrap()).unwrap();
    let mut gapped = original.clone();
    gapped["tensors"]["blocks.1.mlp.fc.weight"]["pieces"].as_array_mut().unwrap().remove(0);
    std::fs::write(&index_path, serde_json::to_vec(&gapped).unwrap()).unwrap();
    let e = error_naming(ShardedCheckpoint::open(good.path()), INDEX_FILE, "blocks.1.mlp.fc.weight");
    assert!(matches!(e, ShardedError::Gap { start: 0, end: 16, .. }), "{e}");
    let mut overlapping = original.clone();
    overlapping["tensors"]["blocks.1.mlp.fc.weight"]["pieces"][1]["part"]["split"]["start"] = serde_json::json!(12);
    std::fs::write(&index_path, serde_json::to_vec(&overlapping).unwrap()).unwrap();
    let e = error_naming(ShardedCheckpoint::open(good.path()), INDEX_FILE, "blocks.1.mlp.fc.weight");
    assert!(matches!(e, ShardedError::Overlap { start: 12, end: 16, .. }), "{e}");
    let mut reshaped = original.clone();
    reshaped["tensors"]["blocks.1.mlp.fc.weight"]["shape"] = serde_json::json!([32, 9]);
    std::fs::write(&index_path, serde_json::to_vec(&reshaped).unwrap()).unwrap();
    let e = error_naming(ShardedCheckpoint::open(good.path()), "shard-pp0-tp0.safetensors", "blocks.1.mlp.fc.weight");
    assert!(matches!(e, ShardedError::ShapeMismatch { .. }), "{e}");
    let mut retyped = original.clone();
    retyped["tensors"]["ln_f.weight"]["dtype"] = serde_json::json!("F64");
    std::fs::write(&index_path, serde_json::to_vec(&retyped).unwrap()).unwrap();
    let e = error_naming(ShardedCheckpoint::open(good.path()), "shard-pp1-tp0.safetensors", "ln_f.weight");
    assert!(matches!(e, ShardedError::DTypeMismatch { .. }), "{e}");
}

#[test]
fn a_load_that_does_not_fit_changes_nothing() {
    // Goal: `load_into` checks every tensor before writing any. Method: a target whose last
    // tensor has the wrong shape; the first tensor must keep its value.
    let (dir, _) = saved_2x2();
    let ckpt = ShardedCheckpoint::open(dir.path()).unwrap();
    let named =
        vec![("ln_f.weight".to_string(), Tensor::zeros(&[8], rtx_tensor::DType::F32)), ("ln_f.bias".to_string(), Tensor::zeros(&[7], rtx_tensor::DType::F32))];
    let whole = |_: &str, _: &[usize]| Ok::<Part, String>(Part::Whole);
    let e = error_naming(ckpt.load_into(&named, &whole), INDEX_FILE, "ln_f.bias");
    assert!(matches!(e, ShardedError::ShapeMismatch { .. }), "{e}");
    assert_eq!(bits(&named[0].1), vec![0; 8]);
    let f64s = vec![("ln_f.weight".to_string(), Tensor::zeros(&[8], rtx_tensor::DType::F64))];
    assert!(matches!(ckpt.load_into(&f64s, &whole), Err(ShardedError::DTypeMismatch { .. })));
    let layout = ModelLayout::gpt(&config());
    let odd = Cut::new(&layout, 0, 3, 0..4, 4);
    let fc = vec![("blocks.0.mlp.fc.weight".to_string(), Tensor::zeros(&[11, 8], rtx_tensor::DType::F32))];
    assert!(matches!(ckpt.load_into(&fc, &odd), Err(ShardedError::BadPart { .. })));
}
