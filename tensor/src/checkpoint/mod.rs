//! Training checkpoints as safetensors files that PyTorch reads with
//! `safetensors.torch.load_file`.
//!
//! Layout of a file written by [`save`]:
//! - model parameters, then buffers ([`Module::named_state`]), under their [`Module`] names with
//!   their shapes and dtypes (`blocks.0.attn.qkv.weight` `[3C, C]` ...), as the matching PyTorch
//!   `state_dict()` (which holds buffers too);
//! - optimizer state, when given, under `optim.<param name>.<field>` (`exp_avg`,
//!   `exp_avg_sq`, `momentum_buffer`, and `step` as a 0-d f64), from
//!   [`Optimizer::state_tensors`];
//! - `__metadata__` (string → string): `format` ([`FORMAT`]), `step` (decimal), `rng` (a JSON
//!   object of named [`GeneratorState`]s), `user` (any JSON, e.g. data cursors) and, with an
//!   optimizer, `optimizer` (JSON `{"kind": "adamw", "lr": ...}`).
//!
//! Writes are atomic: the file goes to `<path>.tmp`, is fsynced, then renamed over `path` (and
//! the directory is fsynced), so a crash leaves either the old or the new checkpoint.
//!
//! [`load`] reads and validates everything before touching the model: every expected tensor
//! must be present with the expected shape and dtype, and no unknown parameter may appear;
//! otherwise it returns [`Error::Checkpoint`] naming the tensor and leaves the model and
//! optimizer untouched. Truncated or corrupt files are reported the same way, never by a panic.
//! Parameters are overwritten in place, so bucket views and optimizers stay bound.
//!
//! Models held as shards (pipeline stages, tensor-parallel slices) save into a directory of
//! per-shard files with an index instead: see [`sharded`].
//!
//! Any safetensors file of named tensors (a PyTorch `state_dict` written by
//! `safetensors.torch.save_file`) reads with [`load_tensors`]: every common dtype loads, the ones
//! the tensor storage lacks (F16, I32, I16, I8, U8, BOOL, ...) into an exact wider storage, with
//! the file dtype recorded by [`load_tensors_with_dtypes`] so [`save_tensors_as`] writes it back;
//! see [`FileDType`] for the table and the reasons.

mod dtypes;
pub mod sharded;

pub use dtypes::FileDType;

use crate::error::{Error, Result};
use crate::nn::Module;
use crate::optim::Optimizer;
use crate::rng::GeneratorState;
use crate::storage::CpuData;
use crate::tensor::Tensor;
use rtx_kernels::DType;
use safetensors::{Dtype, SafeTensors, View};
use std::borrow::Cow;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};

/// The `format` metadata value of checkpoints written by this version.
pub const FORMAT: &str = "rustytorch.checkpoint.v1";

/// Prefix of optimizer state tensor names.
pub const OPTIM_PREFIX: &str = "optim.";

/// Tensors with their names, in a fixed order.
pub type NamedTensors = Vec<(String, Tensor)>;

/// Everything in a checkpoint besides tensors.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct CheckpointMeta {
    /// The training step the checkpoint was taken after.
    pub step: u64,
    /// Named random generator positions (`"dropout"`, `"data"`, ...).
    pub rngs: BTreeMap<String, GeneratorState>,
    /// Caller data (data cursors, config), `Null` when unused.
    pub user: serde_json::Value,
}

/// Writes `model`'s parameters, `optimizer`'s state and `meta` to `path` atomically.
pub fn save(path: &Path, model: &dyn Module, optimizer: Option<&dyn Optimizer>, meta: &CheckpointMeta) -> Result<()> {
    let mut tensors = model.named_state();
    if let Some(opt) = optimizer {
        for (name, t) in opt.state_tensors()? {
            tensors.push((format!("{OPTIM_PREFIX}{name}"), t));
        }
    }
    let metadata = file_metadata(meta, optimizer)?;
    save_tensors(path, &tensors, &metadata)
}

/// The `__metadata__` map [`save`] writes for `meta` and `optimizer` (`format`, `step`, `rng`,
/// `user` and, with an optimizer, `optimizer`). A sharded checkpoint that keeps this map as its
/// metadata consolidates into a file [`load`] reads ([`sharded::consolidate`]).
pub fn file_metadata(meta: &CheckpointMeta, optimizer: Option<&dyn Optimizer>) -> Result<BTreeMap<String, String>> {
    let mut metadata = BTreeMap::new();
    if let Some(opt) = optimizer {
        let info = serde_json::json!({ "kind": opt.kind(), "lr": opt.lr() });
        metadata.insert("optimizer".to_string(), info.to_string());
    }
    metadata.insert("format".to_string(), FORMAT.to_string());
    metadata.insert("step".to_string(), meta.step.to_string());
    metadata.insert("rng".to_string(), serde_json::to_string(&meta.rngs).map_err(|e| Error::InvalidArgument { op: "file_metadata", reason: format!("cannot encode rng states: {e}") })?);
    metadata.insert("user".to_string(), meta.user.to_string());
    Ok(metadata)
}

/// Loads a checkpoint written by [`save`] into `model` (and `optimizer`, whose state and
/// learning rate are restored) and returns its metadata. Optimizer tensors in the file are
/// ignored when `optimizer` is `None`.
pub fn load(path: &Path, model: &dyn Module, optimizer: Option<&mut dyn Optimizer>) -> Result<CheckpointMeta> {
    let (tensors, metadata) = load_tensors(path)?;
    let meta = parse_meta(path, &metadata)?;
    let by_name: BTreeMap<&str, &Tensor> = tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();

    // Validate the model part (parameters and buffers alike).
    let params = model.named_state();
    let mut plan = Vec::with_capacity(params.len());
    for (name, p) in &params {
        let t = expect_tensor(path, &by_name, name, p)?;
        plan.push((p.clone(), t));
    }
    let known: BTreeSet<&str> = params.iter().map(|(n, _)| n.as_str()).collect();
    if let Some((extra, _)) = tensors.iter().find(|(n, _)| !n.starts_with(OPTIM_PREFIX) && !known.contains(n.as_str())) {
        return Err(bad(path, format!("tensor {extra} is not a parameter or buffer of the model")));
    }

    // Validate the optimizer part.
    let mut optim_plan = None;
    if let Some(opt) = optimizer {
        let info: serde_json::Value = match metadata.get("optimizer") {
            Some(s) => serde_json::from_str(s).map_err(|e| bad(path, format!("metadata optimizer is not JSON: {e}")))?,
            None => return Err(bad(path, "no optimizer state in the file".into())),
        };
        let kind = info.get("kind").and_then(|k| k.as_str()).unwrap_or("");
        if kind != opt.kind() {
            return Err(bad(path, format!("optimizer state is for {kind:?}, not {:?}", opt.kind())));
        }
        let lr = info.get("lr").and_then(|v| v.as_f64()).ok_or_else(|| bad(path, "metadata optimizer has no lr".into()))?;
        let expected = opt.state_tensors()?;
        let mut state = Vec::with_capacity(expected.len());
        for (name, want) in &expected {
            let full = format!("{OPTIM_PREFIX}{name}");
            state.push((name.clone(), expect_tensor(path, &by_name, &full, want)?.clone()));
        }
        let wanted: BTreeSet<String> = expected.iter().map(|(n, _)| format!("{OPTIM_PREFIX}{n}")).collect();
        if let Some((extra, _)) = tensors.iter().find(|(n, _)| n.starts_with(OPTIM_PREFIX) && !wanted.contains(n)) {
            return Err(bad(path, format!("tensor {extra} is not state of this optimizer")));
        }
        optim_plan = Some((opt, state, lr));
    }

    // Everything checked: apply.
    for (p, t) in plan {
        p.copy_from_(t)?;
    }
    if let Some((opt, state, lr)) = optim_plan {
        opt.load_state(&state).map_err(|e| bad(path, e.to_string()))?;
        opt.set_lr(lr);
    }
    Ok(meta)
}

/// Reads only the metadata of a checkpoint (validating the whole file's structure).
pub fn read_meta(path: &Path) -> Result<CheckpointMeta> {
    let bytes = std::fs::read(path).map_err(|source| Error::Io { path: path.display().to_string(), source })?;
    let (_, header) = SafeTensors::read_metadata(&bytes).map_err(|e| bad(path, format!("not a valid safetensors file: {e}")))?;
    let metadata: BTreeMap<String, String> = header.metadata().clone().unwrap_or_default().into_iter().collect();
    parse_meta(path, &metadata)
}

/// Writes named tensors and string metadata to a safetensors file atomically (`<path>.tmp`,
/// fsync, rename, fsync of the directory), each in its storage dtype. Names must be unique.
pub fn save_tensors(path: &Path, tensors: &[(String, Tensor)], metadata: &BTreeMap<String, String>) -> Result<()> {
    save_tensors_as(path, tensors, &BTreeMap::new(), metadata)
}

/// [`save_tensors`] with some tensors written as another file dtype (the one
/// [`load_tensors_with_dtypes`] recorded, so a PyTorch file saves back with its own dtypes).
/// A tensor whose values that dtype cannot hold exactly (an I64 value outside I32, an F32 value
/// that is no F16) is an error naming it, and nothing is written. Names not in `dtypes` keep
/// their storage dtype; a name in `dtypes` that no tensor has is an error.
pub fn save_tensors_as(path: &Path, tensors: &[(String, Tensor)], dtypes: &BTreeMap<String, FileDType>, metadata: &BTreeMap<String, String>) -> Result<()> {
    let entries = typed_entries(path, tensors, dtypes)?;
    let tmp = tmp_path(path);
    let io = |p: &Path| {
        let p = p.display().to_string();
        move |source: std::io::Error| Error::Io { path: p, source }
    };
    let result = (|| {
        let info: HashMap<String, String> = metadata.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
        safetensors::serialize_to_file(entries, Some(info), &tmp).map_err(|e| bad(path, format!("cannot write {}: {e}", tmp.display())))?;
        let file = std::fs::OpenOptions::new().read(true).write(true).open(&tmp).map_err(io(&tmp))?;
        canonicalize_file_header(&file).map_err(io(&tmp))?;
        file.sync_all().map_err(io(&tmp))?;
        std::fs::rename(&tmp, path).map_err(io(path))?;
        sync_parent_dir(path);
        Ok(())
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

/// Reads every tensor (in name order) and the string metadata of a safetensors file. Every
/// dtype in [`FileDType`] loads (into the storage dtype its table names); other dtypes, such as
/// 8-bit floats, are an error naming the tensor.
pub fn load_tensors(path: &Path) -> Result<(NamedTensors, BTreeMap<String, String>)> {
    let typed = load_tensors_with_dtypes(path)?;
    Ok((typed.tensors, typed.metadata))
}

/// The tensors of a safetensors file with the dtype each had in the file.
#[derive(Clone, Debug)]
pub struct TypedTensors {
    /// The tensors, in name order.
    pub tensors: NamedTensors,
    /// Each tensor's dtype in the file (its storage dtype may be wider, see [`FileDType`]).
    pub file_dtypes: BTreeMap<String, FileDType>,
    /// The file's string metadata.
    pub metadata: BTreeMap<String, String>,
}

/// [`load_tensors`], also returning each tensor's file dtype.
pub fn load_tensors_with_dtypes(path: &Path) -> Result<TypedTensors> {
    let bytes = std::fs::read(path).map_err(|source| Error::Io { path: path.display().to_string(), source })?;
    decode_tensors_with_dtypes(&bytes, path)
}

/// [`save_tensors`] into memory: the bytes of the safetensors file it would write.
pub fn encode_tensors(tensors: &[(String, Tensor)], metadata: &BTreeMap<String, String>) -> Result<Vec<u8>> {
    let origin = Path::new("<memory>");
    let entries = entries(origin, tensors)?;
    let info: HashMap<String, String> = metadata.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
    let mut bytes = safetensors::serialize(entries, Some(info)).map_err(|e| bad(origin, format!("cannot serialize: {e}")))?;
    if let Some(header) = header_len(&bytes).and_then(|n| bytes.get_mut(8..8 + n)) {
        if let Some(canonical) = canonical_header(header) {
            header.copy_from_slice(&canonical);
        }
    }
    Ok(bytes)
}

/// The header length a safetensors buffer starts with.
fn header_len(bytes: &[u8]) -> Option<usize> {
    let n = u64::from_le_bytes(bytes.get(..8)?.try_into().ok()?);
    usize::try_from(n).ok().filter(|n| bytes.len() >= 8 + n)
}

/// The header JSON with every object's keys in sorted order, padded to the same length, or `None`
/// when it does not parse or would not fit. safetensors writes `__metadata__` from a `HashMap`,
/// whose order changes from one map to the next, so the same checkpoint gave different bytes;
/// sorting keeps the length and every offset (they are relative to the data section).
fn canonical_header(header: &[u8]) -> Option<Vec<u8>> {
    let value: serde_json::Value = serde_json::from_slice(header.trim_ascii_end()).ok()?;
    let mut out = serde_json::to_vec(&value).ok()?;
    if out.len() > header.len() {
        return None;
    }
    out.resize(header.len(), b' ');
    Some(out)
}

/// Rewrites the header of the safetensors file `file` in canonical order (see
/// [`canonical_header`]); leaves the file alone when its header does not parse.
fn canonicalize_file_header(file: &File) -> std::io::Result<()> {
    use std::io::{Read, Seek, SeekFrom, Write};
    let mut f = file;
    f.seek(SeekFrom::Start(0))?;
    let mut len = [0u8; 8];
    f.read_exact(&mut len)?;
    let Ok(n) = usize::try_from(u64::from_le_bytes(len)) else { return Ok(()) };
    let mut header = vec![0u8; n];
    f.read_exact(&mut header)?;
    if let Some(canonical) = canonical_header(&header) {
        f.seek(SeekFrom::Start(8))?;
        f.write_all(&canonical)?;
    }
    Ok(())
}

/// [`load_tensors`] from the bytes of a safetensors file; `origin` names them in errors.
pub fn decode_tensors(bytes: &[u8], origin: &Path) -> Result<(NamedTensors, BTreeMap<String, String>)> {
    let typed = decode_tensors_with_dtypes(bytes, origin)?;
    Ok((typed.tensors, typed.metadata))
}

/// [`load_tensors_with_dtypes`] from the bytes of a safetensors file.
pub fn decode_tensors_with_dtypes(bytes: &[u8], origin: &Path) -> Result<TypedTensors> {
    let path = origin;
    let (_, header) = SafeTensors::read_metadata(bytes).map_err(|e| bad(path, format!("not a valid safetensors file: {e}")))?;
    let metadata: BTreeMap<String, String> = header.metadata().clone().unwrap_or_default().into_iter().collect();
    let st = SafeTensors::deserialize(bytes).map_err(|e| bad(path, format!("not a valid safetensors file: {e}")))?;
    let mut views = st.tensors();
    views.sort_by(|a, b| a.0.cmp(&b.0));
    let mut out = Vec::with_capacity(views.len());
    let mut file_dtypes = BTreeMap::new();
    for (name, view) in views {
        let shape = view.shape().to_vec();
        let raw = view.data();
        let dtype = FileDType::from_st(view.dtype()).ok_or_else(|| bad(path, format!("tensor {name}: unsupported dtype {:?} (readable: {})", view.dtype(), FileDType::ALL.map(FileDType::as_str).join(", "))))?;
        let numel: usize = shape.iter().product();
        if raw.len() != numel * dtype.size_in_bytes() {
            return Err(bad(path, format!("tensor {name}: {} bytes for shape {shape:?} of {dtype}", raw.len())));
        }
        let data = dtypes::decode(dtype, raw).map_err(|reason| bad(path, format!("tensor {name}: {reason}")))?;
        file_dtypes.insert(name.clone(), dtype);
        out.push((name, Tensor::from_data(data, &shape)?));
    }
    Ok(TypedTensors { tensors: out, file_dtypes, metadata })
}

/// The serializable entries of `tensors`, refusing duplicate names.
fn entries(path: &Path, tensors: &[(String, Tensor)]) -> Result<Vec<(String, Entry)>> {
    typed_entries(path, tensors, &BTreeMap::new())
}

/// [`entries`] with the tensors named in `dtypes` encoded as those file dtypes.
fn typed_entries(path: &Path, tensors: &[(String, Tensor)], dtypes: &BTreeMap<String, FileDType>) -> Result<Vec<(String, Entry)>> {
    let mut seen = BTreeSet::new();
    let mut entries = Vec::with_capacity(tensors.len());
    for (name, t) in tensors {
        if !seen.insert(name.as_str()) {
            return Err(bad(path, format!("tensor name {name} appears twice")));
        }
        let data = t.to_data()?;
        let (dtype, data) = match dtypes.get(name) {
            Some(&want) if want != FileDType::of_storage(t.dtype()) => {
                let bytes = dtypes::encode(&data, want).map_err(|reason| bad(path, format!("tensor {name} cannot be saved as {want}: {reason}")))?;
                crate::pool::give_data(data);
                (want.to_st(), EntryData::Encoded(bytes))
            }
            _ => (to_st_dtype(t.dtype()), EntryData::Native(data)),
        };
        entries.push((name.clone(), Entry { dtype, shape: t.shape().to_vec(), data }));
    }
    if let Some(extra) = dtypes.keys().find(|n| !seen.contains(n.as_str())) {
        return Err(bad(path, format!("a dtype is given for tensor {extra}, which is not saved")));
    }
    Ok(entries)
}

/// A tensor ready to serialize.
struct Entry {
    dtype: Dtype,
    shape: Vec<usize>,
    data: EntryData,
}

/// The bytes of an [`Entry`]: the storage as is, or converted to another file dtype.
enum EntryData {
    Native(CpuData),
    Encoded(Vec<u8>),
}

impl EntryData {
    fn bytes(&self) -> &[u8] {
        match self {
            EntryData::Native(data) => data.as_bytes(),
            EntryData::Encoded(bytes) => bytes,
        }
    }
}

impl View for Entry {
    fn dtype(&self) -> Dtype {
        self.dtype
    }

    fn shape(&self) -> &[usize] {
        &self.shape
    }

    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(self.data.bytes())
    }

    fn data_len(&self) -> usize {
        self.data.bytes().len()
    }
}

fn bad(path: &Path, reason: String) -> Error {
    Error::Checkpoint { path: path.display().to_string(), reason }
}

fn tmp_path(path: &Path) -> PathBuf {
    let mut s = path.as_os_str().to_owned();
    s.push(".tmp");
    PathBuf::from(s)
}

fn to_st_dtype(dtype: DType) -> Dtype {
    match dtype {
        DType::F32 => Dtype::F32,
        DType::F64 => Dtype::F64,
        DType::BF16 => Dtype::BF16,
        DType::U32 => Dtype::U32,
        DType::I64 => Dtype::I64,
    }
}

fn from_st_dtype(dtype: Dtype) -> Option<DType> {
    match dtype {
        Dtype::F32 => Some(DType::F32),
        Dtype::F64 => Some(DType::F64),
        Dtype::BF16 => Some(DType::BF16),
        Dtype::U32 => Some(DType::U32),
        Dtype::I64 => Some(DType::I64),
        _ => None,
    }
}

/// Looks up `name` and checks it has `like`'s shape and dtype.
fn expect_tensor<'a>(path: &Path, by_name: &BTreeMap<&str, &'a Tensor>, name: &str, like: &Tensor) -> Result<&'a Tensor> {
    let t = by_name.get(name).ok_or_else(|| bad(path, format!("tensor {name} is missing")))?;
    if t.shape() != like.shape() {
        return Err(bad(path, format!("tensor {name} has shape {:?}, expected {:?}", t.shape(), like.shape())));
    }
    if t.dtype() != like.dtype() {
        return Err(bad(path, format!("tensor {name} has dtype {}, expected {}", t.dtype(), like.dtype())));
    }
    Ok(t)
}

fn parse_meta(path: &Path, metadata: &BTreeMap<String, String>) -> Result<CheckpointMeta> {
    match metadata.get("format") {
        Some(f) if f == FORMAT => {}
        Some(f) => return Err(bad(path, format!("format {f:?} is not {FORMAT:?}"))),
        None => return Err(bad(path, "no format in metadata: not a rustytorch checkpoint".into())),
    }
    let step = metadata.get("step").ok_or_else(|| bad(path, "metadata has no step".into()))?;
    let step = step.parse::<u64>().map_err(|e| bad(path, format!("metadata step {step:?}: {e}")))?;
    let rngs = match metadata.get("rng") {
        Some(s) => serde_json::from_str(s).map_err(|e| bad(path, format!("metadata rng: {e}")))?,
        None => BTreeMap::new(),
    };
    let user = match metadata.get("user") {
        Some(s) => serde_json::from_str(s).map_err(|e| bad(path, format!("metadata user: {e}")))?,
        None => serde_json::Value::Null,
    };
    Ok(CheckpointMeta { step, rngs, user })
}

/// Persists a rename into `path`'s directory (fsync of the directory); some filesystems refuse to
/// fsync a directory, which is harmless. Shared by the single-file and the sharded writers.
pub(crate) fn sync_parent_dir(path: &Path) {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    if let Ok(d) = File::open(&dir) {
        let _ = d.sync_all();
    }
}
