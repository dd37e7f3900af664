//! The communicator traits that higher layers are generic over: [`CollectiveGroup`] (who am I, how
//! many, which generation, barrier) and [`Collective<T>`] (the data-moving operations on buffers of
//! element type `T`). The host [`Communicator`](crate::Communicator) implements them over slices
//! (`[T]`); `NcclCommunicator` (feature `nccl`) over device buffers (`rtx_kernels::cuda::Buffer<T>`).
//!
//! Decisions. The element type is a parameter of the trait rather than of each method, so that each
//! implementation names its own buffer type for exactly the element types it supports (`type Buf`):
//! a generic associated type `Buf<T>` would force every implementation to accept every host
//! element type, and device buffers exist only for device element types. A caller that reduces f32
//! and bf16 buckets asks for `C: Collective<f32> + Collective<bf16>`; the non-generic part lives in
//! the supertrait, so `rank()` is never ambiguous. Methods return `impl Future + Send`, so an
//! engine can run them on a multi-threaded runtime or a communication thread.
//!
//! The portable contract is the intersection of the implementations: every rank calls the same
//! operations in the same order with the same lengths; `reduce_scatter` input and `all_gather`
//! output lengths are divisible by the group size (the host communicator also accepts uneven
//! segments, NCCL does not); `send`/`recv` pairs have equal lengths. When an operation returns
//! `Ok`, its output buffer holds the result (for device buffers: in stream order, so later work on
//! the device's stream sees it). After [`CollectiveGroup::set_generation`], operations of the old
//! generation fail with [`Error::StaleGeneration`](crate::Error::StaleGeneration).

use std::future::Future;

use crate::error::Result;
use crate::ReduceOp;

/// The part of a communicator that does not depend on the element type.
pub trait CollectiveGroup: Send + Sync {
    /// This rank's index in the group.
    fn rank(&self) -> usize;

    /// Number of ranks in the group.
    fn size(&self) -> usize;

    /// The group's current generation.
    fn generation(&self) -> u64;

    /// Moves the group to `generation` (which must be higher): in-flight and later operations of
    /// the old generation fail with [`Error::StaleGeneration`](crate::Error::StaleGeneration).
    fn set_generation(&self, generation: u64) -> Result<()>;

    /// Returns once every rank of the group has entered the barrier.
    fn barrier(&self) -> impl Future<Output = Result<()>> + Send;
}

/// Collective operations on buffers of element type `T`.
pub trait Collective<T>: CollectiveGroup {
    /// The buffer type the operations read and write: `[T]` on the host, a device buffer on a GPU.
    type Buf: ?Sized;

    /// Reduces `buf` element-wise across the group, in place; every rank ends with the result.
    fn all_reduce(&self, buf: &mut Self::Buf, op: ReduceOp) -> impl Future<Output = Result<()>> + Send;

    /// Reduces `input` across the group and leaves this rank's segment of the result in `output`
    /// (`output` has `input.len() / size` elements; segment `r` starts at `r * output.len()`).
    fn reduce_scatter(&self, input: &Self::Buf, output: &mut Self::Buf, op: ReduceOp) -> impl Future<Output = Result<()>> + Send;

    /// Concatenates every rank's `input` into `output`, in rank order (`output` has
    /// `input.len() * size` elements).
    fn all_gather(&self, input: &Self::Buf, output: &mut Self::Buf) -> impl Future<Output = Result<()>> + Send;

    /// Copies `buf` from group rank `root` to every rank.
    fn broadcast(&self, buf: &mut Self::Buf, root: usize) -> impl Future<Output = Result<()>> + Send;

    /// Reduces `buf` across the group into `buf` on group rank `root`; other ranks' buffers are
    /// left unchanged.
    fn reduce(&self, buf: &mut Self::Buf, root: usize, op: ReduceOp) -> impl Future<Output = Result<()>> + Send;

    /// Sends `buf` to group rank `dst`, matched by a [`recv`](Self::recv) of the same length there.
    fn send(&self, buf: &Self::Buf, dst: usize) -> impl Future<Output = Result<()>> + Send;

    /// Receives into `buf` what group rank `src` sent with [`send`](Self::send).
    fn recv(&self, buf: &mut Self::Buf, src: usize) -> impl Future<Output = Result<()>> + Send;
}
