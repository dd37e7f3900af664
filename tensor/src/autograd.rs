//! Reverse-mode automatic differentiation.
//!
//! Every op that reads a tensor requiring grad records a [`Node`]: its name, its inputs and a
//! backward closure mapping the output gradient to one optional gradient per input. The nodes
//! form the tape; [`Tensor::backward`] orders them (inputs before outputs, by a deterministic
//! depth-first walk in input order), walks them in reverse, and accumulates into the `.grad()` of
//! leaves. A leaf's gradient is final once its last consumer has run; `backward_with` reports that
//! moment to a callback, which is where data parallelism starts reducing a full bucket while
//! backward continues. Backward closures run with grad mode off. Grad mode is per thread
//! ([`no_grad`]).

use crate::error::{Error, Result};
use crate::tensor::{Tensor, TensorId};
use std::cell::Cell;
use std::collections::HashMap;

/// A backward function: given the output's gradient and the (detached) output, returns one
/// gradient per input (`None` where the input needs none).
pub trait BackwardFn: Send + Sync {
    /// Computes input gradients.
    fn backward(&self, grad_output: &Tensor, output: &Tensor) -> Result<Vec<Option<Tensor>>>;

    /// Whether [`BackwardFn::backward_accumulating`] folds the gradient the first input already
    /// has into its own (a fused add, such as a layer norm's backward adding the residual
    /// stream's gradient in the same kernel pass). The engine then hands that gradient over
    /// instead of adding the two itself.
    fn accumulates_first_input(&self) -> bool {
        false
    }

    /// [`BackwardFn::backward`] given `prior`, the gradient gathered so far for the first input
    /// (a non-leaf) from its other consumers: the first gradient returned must include it. The
    /// default adds them as the engine would (`prior + gradient`).
    fn backward_accumulating(&self, grad_output: &Tensor, output: &Tensor, prior: Option<Tensor>) -> Result<Vec<Option<Tensor>>> {
        let mut grads = self.backward(grad_output, output)?;
        if let Some(prior) = prior {
            match grads.first_mut() {
                Some(first) => {
                    *first = Some(match first.take() {
                        Some(g) => prior.add(&g)?,
                        None => prior,
                    })
                }
                None => return Err(Error::InvalidArgument { op: "backward", reason: "a gradient for the first input was handed to a node with no inputs".into() }),
            }
        }
        Ok(grads)
    }
}

impl<F> BackwardFn for F
where
    F: Fn(&Tensor, &Tensor) -> Result<Vec<Option<Tensor>>> + Send + Sync,
{
    fn backward(&self, grad_output: &Tensor, output: &Tensor) -> Result<Vec<Option<Tensor>>> {
        self(grad_output, output)
    }
}

/// One recorded operation.
pub(crate) struct Node {
    pub(crate) op: &'static str,
    pub(crate) inputs: Vec<Tensor>,
    pub(crate) backward: Box<dyn BackwardFn>,
}

thread_local! {
    static GRAD_ENABLED: Cell<bool> = const { Cell::new(true) };
}

/// Whether ops on this thread record the graph.
pub fn is_grad_enabled() -> bool {
    GRAD_ENABLED.with(|g| g.get())
}

/// Restores the previous grad mode when dropped.
pub struct GradModeGuard {
    previous: bool,
}

impl Drop for GradModeGuard {
    fn drop(&mut self) {
        GRAD_ENABLED.with(|g| g.set(self.previous));
    }
}

/// Sets grad mode on this thread until the guard drops.
pub fn set_grad_enabled(enabled: bool) -> GradModeGuard {
    let previous = GRAD_ENABLED.with(|g| g.replace(enabled));
    GradModeGuard { previous }
}

/// Runs `f` without recording the graph (evaluation, optimizer updates).
pub fn no_grad<R>(f: impl FnOnce() -> R) -> R {
    let _guard = set_grad_enabled(false);
    f()
}

impl Tensor {
    /// Back-propagates from this scalar, accumulating into the `.grad()` of every leaf that
    /// requires grad.
    pub fn backward(&self) -> Result<()> {
        self.backward_with(|_| {})
    }

    /// Like [`Tensor::backward`], calling `on_leaf_ready(leaf)` as soon as a leaf's gradient is
    /// complete (all its uses have been differentiated).
    pub fn backward_with(&self, on_leaf_ready: impl FnMut(&Tensor)) -> Result<()> {
        if self.numel() != 1 {
            return Err(Error::NonScalarBackward { shape: self.shape().to_vec() });
        }
        let seed = match self.device() {
            rtx_kernels::Device::Cpu => Tensor::ones(self.shape(), self.dtype()),
            device @ rtx_kernels::Device::Cuda(i) => crate::backend::required("backward", device)?.full(i, self.shape(), 1.0, self.dtype())?,
        };
        self.backward_from(seed, on_leaf_ready)
    }

    /// Back-propagates an explicit output gradient of this tensor's shape.
    pub fn backward_from(&self, grad: Tensor, mut on_leaf_ready: impl FnMut(&Tensor)) -> Result<()> {
        if !self.is_requires_grad() {
            return Err(Error::NoGradient);
        }
        if grad.shape() != self.shape() {
            return Err(Error::ShapeMismatch { op: "backward", lhs: self.shape().to_vec(), rhs: grad.shape().to_vec() });
        }
        let _guard = set_grad_enabled(false);
        let order = topological_order(self);
        // How many recorded uses each leaf has; when it drops to zero the leaf is ready.
        let mut pending_uses: HashMap<TensorId, usize> = HashMap::new();
        for t in &order {
            if let Some(node) = &t.0.node {
                for input in &node.inputs {
                    if input.is_leaf() && input.is_requires_grad() {
                        *pending_uses.entry(input.id()).or_insert(0) += 1;
                    }
                }
            }
        }
        if self.is_leaf() {
            self.accumulate_grad(&grad)?;
            on_leaf_ready(self);
            return Ok(());
        }
        let mut grads: HashMap<TensorId, Tensor> = HashMap::new();
        grads.insert(self.id(), grad);
        for t in order.iter().rev() {
            let Some(node) = &t.0.node else { continue };
            let Some(g) = grads.remove(&t.id()) else { continue };
            let input_grads = match node.inputs.first() {
                // The node adds the first input's gathered gradient itself (fused).
                Some(first) if node.backward.accumulates_first_input() && !first.is_leaf() && first.is_requires_grad() => {
                    let prior = grads.remove(&first.id());
                    node.backward.backward_accumulating(&g, &t.detach(), prior)?
                }
                _ => node.backward.backward(&g, &t.detach())?,
            };
            debug_assert_eq!(input_grads.len(), node.inputs.len(), "{}: backward returned the wrong number of gradients", node.op);
            for (input, gi) in node.inputs.iter().zip(input_grads) {
                if !input.is_requires_grad() {
                    continue;
                }
                let Some(gi) = gi else {
                    if input.is_leaf() {
                        release_use(input, &mut pending_uses, &mut on_leaf_ready);
                    }
                    continue;
                };
                if gi.shape() != input.shape() {
                    return Err(Error::ShapeMismatch { op: node.op, lhs: input.shape().to_vec(), rhs: gi.shape().to_vec() });
                }
                if input.is_leaf() {
                    input.accumulate_grad(&gi)?;
                    release_use(input, &mut pending_uses, &mut on_leaf_ready);
                } else {
                    match grads.remove(&input.id()) {
                        Some(prev) => {
                            grads.insert(input.id(), prev.add(&gi)?);
                        }
                        None => {
                            grads.insert(input.id(), gi);
                        }
                    }
                }
            }
        }
        Ok(())
    }
}

fn release_use(leaf: &Tensor, pending: &mut HashMap<TensorId, usize>, on_ready: &mut impl FnMut(&Tensor)) {
    if let Some(n) = pending.get_mut(&leaf.id()) {
        *n -= 1;
        if *n == 0 {
            on_ready(leaf);
        }
    }
}

/// Tensors reachable from `root` through recorded nodes, inputs before the tensors made from
/// them. Iterative (deep graphs do not overflow the stack) and deterministic.
fn topological_order(root: &Tensor) -> Vec<Tensor> {
    let mut order = Vec::new();
    let mut visited: HashMap<TensorId, ()> = HashMap::new();
    let mut stack: Vec<(Tensor, usize)> = vec![(root.clone(), 0)];
    visited.insert(root.id(), ());
    while let Some((t, next_input)) = stack.pop() {
        let inputs = t.0.node.as_ref().map(|n| n.inputs.as_slice()).unwrap_or(&[]);
        if next_input < inputs.len() {
            let child = inputs[next_input].clone();
            stack.push((t, next_input + 1));
            if child.is_requires_grad() && visited.insert(child.id(), ()).is_none() {
                stack.push((child, 0));
            }
        } else {
            order.push(t);
        }
    }
    order
}
