//! [`ParamBuckets`]: a module's parameters and gradients moved into a few large flat buffers.
//!
//! Layout (as PyTorch DDP): parameters are taken in **reverse** visit order, the order in which
//! backward finishes them, and packed back to back into buckets of one dtype holding at most
//! `bucket_bytes_max` bytes (a larger parameter gets a bucket of its own). Bucket 0 therefore
//! holds the last parameters of the model, and its first element is the last parameter's.
//!
//! Each bucket has a parameter storage and a gradient storage of the same size. Every module
//! parameter is replaced by a contiguous view into its bucket's parameter storage (writing the
//! bucket changes the parameter and the reverse), and its gradient slot is bound to the matching
//! view of the gradient storage, so `backward` accumulates straight into the bucket and a
//! data-parallel layer can all-reduce [`Bucket::grads`] in place. Zeroing keeps the binding;
//! `set_grad(None)` on a parameter breaks it ([`ParamBuckets::bind_grads`] restores it).
//!
//! Build optimizers after bucketing: they must hold the views, not the replaced tensors.

use super::super::nn::Module;
use crate::error::{Error, Result};
use crate::layout::{contiguous_strides, Layout};
use crate::storage::{CpuData, Storage};
use crate::tensor::{Tensor, TensorId};
use rtx_kernels::DType;
use std::collections::BTreeMap;

/// Where one parameter lives.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BucketEntry {
    /// Parameter name.
    pub name: String,
    /// Bucket index.
    pub bucket: usize,
    /// First element in the bucket.
    pub offset: usize,
    /// Number of elements.
    pub numel: usize,
    /// Parameter shape.
    pub shape: Vec<usize>,
}

/// One flat parameter buffer and its gradient buffer.
#[derive(Clone, Debug)]
pub struct Bucket {
    dtype: DType,
    numel: usize,
    params: Storage,
    grads: Storage,
    entries: Vec<usize>,
}

/// A module's parameters laid out in flat buckets (see the module docs).
#[derive(Clone, Debug)]
pub struct ParamBuckets {
    buckets: Vec<Bucket>,
    entries: Vec<BucketEntry>,
    views: Vec<Tensor>,
    grad_views: Vec<Tensor>,
    by_view: BTreeMap<TensorId, usize>,
}

impl ParamBuckets {
    /// Moves `module`'s parameters (and any existing gradients) into buckets of at most
    /// `bucket_bytes_max` bytes and rebinds the module to views of them.
    pub fn new(module: &mut dyn Module, bucket_bytes_max: usize) -> Result<ParamBuckets> {
        let named = module.named_parameters();
        // Assign buckets in reverse visit order.
        let mut entries: Vec<Option<BucketEntry>> = vec![None; named.len()];
        let mut buckets: Vec<(DType, usize, Vec<usize>)> = Vec::new();
        for (idx, (name, t)) in named.iter().enumerate().rev() {
            let dtype = t.dtype();
            let bytes = t.numel() * dtype.size_in_bytes();
            let fits = match buckets.last() {
                Some((d, numel, _)) => *d == dtype && numel * dtype.size_in_bytes() + bytes <= bucket_bytes_max,
                None => false,
            };
            if !fits {
                buckets.push((dtype, 0, Vec::new()));
            }
            let bucket_idx = buckets.len() - 1;
            let (_, numel, members) = buckets.last_mut().ok_or_else(|| Error::InvalidArgument { op: "ParamBuckets", reason: "no bucket".into() })?;
            entries[idx] = Some(BucketEntry { name: name.clone(), bucket: bucket_idx, offset: *numel, numel: t.numel(), shape: t.shape().to_vec() });
            *numel += t.numel();
            members.push(idx);
        }
        let entries: Vec<BucketEntry> = entries.into_iter().map(|e| e.ok_or_else(|| Error::InvalidArgument { op: "ParamBuckets", reason: "unassigned parameter".into() })).collect::<Result<_>>()?;
        Self::build(module, &named, entries, buckets)
    }

    /// Like [`ParamBuckets::new`], with the bucket of each parameter chosen by the caller:
    /// `bucket_of(name)` for every parameter, the buckets numbered `0..n` with none empty, each of
    /// one dtype. Within a bucket parameters are packed in reverse visit order, as `new` packs
    /// them. Sharded data parallelism uses it to make one bucket per unit of the model (a
    /// transformer block, the embeddings), which it gathers and frees as a whole.
    pub fn grouped(module: &mut dyn Module, bucket_of: &dyn Fn(&str) -> usize) -> Result<ParamBuckets> {
        let named = module.named_parameters();
        let n_buckets = named.iter().map(|(name, _)| bucket_of(name) + 1).max().unwrap_or(0);
        let mut buckets: Vec<(DType, usize, Vec<usize>)> = Vec::with_capacity(n_buckets);
        let mut dtypes: Vec<Option<DType>> = vec![None; n_buckets];
        for (name, t) in &named {
            let b = bucket_of(name);
            match dtypes[b] {
                Some(d) if d != t.dtype() => return Err(Error::InvalidArgument { op: "ParamBuckets::grouped", reason: format!("{name}: dtype {} in bucket {b} of {d}", t.dtype()) }),
                _ => dtypes[b] = Some(t.dtype()),
            }
        }
        for (b, dtype) in dtypes.iter().enumerate() {
            let Some(dtype) = dtype else { return Err(Error::InvalidArgument { op: "ParamBuckets::grouped", reason: format!("bucket {b} of 0..{n_buckets} holds no parameter") }) };
            buckets.push((*dtype, 0, Vec::new()));
        }
        let mut entries: Vec<Option<BucketEntry>> = vec![None; named.len()];
        for (idx, (name, t)) in named.iter().enumerate().rev() {
            let b = bucket_of(name);
            let (_, numel, members) = &mut buckets[b];
            entries[idx] = Some(BucketEntry { name: name.clone(), bucket: b, offset: *numel, numel: t.numel(), shape: t.shape().to_vec() });
            *numel += t.numel();
            members.push(idx);
        }
        let entries: Vec<BucketEntry> = entries.into_iter().map(|e| e.ok_or_else(|| Error::InvalidArgument { op: "ParamBuckets", reason: "unassigned parameter".into() })).collect::<Result<_>>()?;
        Self::build(module, &named, entries, buckets)
    }

    /// Fills the flat storages of `buckets` (dtype, elements, member parameter indices) and swaps
    /// the module's parameters for views of them.
    fn build(module: &mut dyn Module, named: &[(String, Tensor)], entries: Vec<BucketEntry>, buckets: Vec<(DType, usize, Vec<usize>)>) -> Result<ParamBuckets> {
        // Fill the flat storages.
        let mut built = Vec::with_capacity(buckets.len());
        for (dtype, numel, members) in buckets {
            let mut params = CpuData::zeros(dtype, numel);
            let mut grads = CpuData::zeros(dtype, numel);
            for &idx in &members {
                let (name, t) = &named[idx];
                let e = &entries[idx];
                write_at(&mut params, e.offset, &t.to_data()?, name)?;
                if let Some(g) = t.grad() {
                    write_at(&mut grads, e.offset, &g.to_dtype(dtype)?.to_data()?, name)?;
                }
            }
            built.push(Bucket { dtype, numel, params: Storage::new(params), grads: Storage::new(grads), entries: members });
        }

        // Views, and the gradient binding.
        let mut views = Vec::with_capacity(entries.len());
        let mut grad_views = Vec::with_capacity(entries.len());
        let mut by_original: BTreeMap<TensorId, usize> = BTreeMap::new();
        let mut by_view = BTreeMap::new();
        for (idx, ((_, t), e)) in named.iter().zip(&entries).enumerate() {
            let b = &built[e.bucket];
            let layout = Layout::new(e.shape.clone(), contiguous_strides(&e.shape), e.offset);
            let view = Tensor::from_parts(b.params.clone(), layout.clone(), b.dtype, t.is_requires_grad(), None);
            let grad_view = Tensor::from_parts(b.grads.clone(), layout, b.dtype, false, None);
            view.set_grad(Some(grad_view.clone()))?;
            by_original.insert(t.id(), idx);
            by_view.insert(view.id(), idx);
            views.push(view);
            grad_views.push(grad_view);
        }

        // Swap the module's tensors for the views (a tensor visited twice gets the same view).
        let mut missing = None;
        module.visit_params_mut("", &mut |name, t| match by_original.get(&t.id()) {
            Some(&idx) => *t = views[idx].clone(),
            None => missing = Some(name.to_string()),
        });
        if let Some(name) = missing {
            return Err(Error::InvalidArgument { op: "ParamBuckets", reason: format!("parameter {name} changed while bucketing") });
        }
        Ok(ParamBuckets { buckets: built, entries, views, grad_views, by_view })
    }

    /// The buckets, bucket 0 holding the parameters backward finishes first.
    pub fn buckets(&self) -> &[Bucket] {
        &self.buckets
    }

    /// One entry per parameter, in the module's visit order.
    pub fn entries(&self) -> &[BucketEntry] {
        &self.entries
    }

    /// The entry of the parameter called `name`.
    pub fn entry(&self, name: &str) -> Option<&BucketEntry> {
        self.entries.iter().find(|e| e.name == name)
    }

    /// The `(name, view)` pairs now held by the module, in visit order.
    pub fn named_parameters(&self) -> Vec<(String, Tensor)> {
        self.entries.iter().zip(&self.views).map(|(e, v)| (e.name.clone(), v.clone())).collect()
    }

    /// Index into [`ParamBuckets::entries`] of a parameter view (e.g. a leaf reported by
    /// `backward_with`), or `None` for a tensor that is not one of the views.
    pub fn entry_of(&self, param: &Tensor) -> Option<usize> {
        self.by_view.get(&param.id()).copied()
    }

    /// Bucket index of a parameter view.
    pub fn bucket_of(&self, param: &Tensor) -> Option<usize> {
        self.entry_of(param).map(|i| self.entries[i].bucket)
    }

    /// Zeros every gradient bucket in place.
    pub fn zero_grad(&self) -> Result<()> {
        self.buckets.iter().try_for_each(|b| b.grads().zero_())
    }

    /// Rebinds every parameter view's gradient slot to its bucket view (after a caller
    /// replaced or cleared one).
    pub fn bind_grads(&self) -> Result<()> {
        self.views.iter().zip(&self.grad_views).try_for_each(|(v, g)| v.set_grad(Some(g.clone())))
    }

    /// Total parameter elements.
    pub fn numel(&self) -> usize {
        self.buckets.iter().map(|b| b.numel).sum()
    }
}

impl Bucket {
    /// Element type of both buffers.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.numel
    }

    /// Size in bytes of one buffer.
    pub fn size_bytes(&self) -> usize {
        self.numel * self.dtype.size_in_bytes()
    }

    /// Indices into [`ParamBuckets::entries`] of the parameters in this bucket, by offset.
    pub fn entries(&self) -> &[usize] {
        &self.entries
    }

    /// The flat parameter buffer as a 1-d tensor (not tracked by autograd); writes through it
    /// change the parameters.
    pub fn params(&self) -> Tensor {
        Tensor::from_parts(self.params.clone(), Layout::contiguous(&[self.numel]), self.dtype, false, None)
    }

    /// The flat gradient buffer as a 1-d tensor; all-reduce it in place.
    pub fn grads(&self) -> Tensor {
        Tensor::from_parts(self.grads.clone(), Layout::contiguous(&[self.numel]), self.dtype, false, None)
    }

    /// The parameter storage.
    pub fn param_storage(&self) -> &Storage {
        &self.params
    }

    /// The gradient storage.
    pub fn grad_storage(&self) -> &Storage {
        &self.grads
    }
}

/// Copies `src` into `dst[offset..]`; both of one dtype.
fn write_at(dst: &mut CpuData, offset: usize, src: &CpuData, name: &str) -> Result<()> {
    dst.write_at(offset, src).map_err(|e| Error::InvalidArgument { op: "ParamBuckets", reason: format!("{name}: {e}") })
}
