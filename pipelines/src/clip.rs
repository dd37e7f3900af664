//! Gradient clipping by the global norm when each rank holds only a segment of the averaged
//! gradient (ZeRO-1, ZeRO-2 and ZeRO-3): the same clipping as the replicated engine's, over the
//! whole model.
//!
//! Each rank's [`ParamShard`] sums the squares of its gradient segments in f64
//! ([`ParamShard::grad_sum_squares`]; a shard on a device sums its host landing segments, so the
//! arithmetic is the host shard's, and scales them there before uploading). The segments of a group's ranks tile every bucket exactly
//! once and buckets hold no padding, so these shares add up to the squared norm of the whole
//! averaged gradient, every element counted once (a tied embedding and head is one parameter, in
//! one segment). One small collective per step all-gathers the `n` shares (one f64 each); every
//! rank adds them in rank order from 0, so every rank gets the same norm, bit for bit, whatever
//! the communicator's reduction order. Then each rank scales its own segments by
//! [`rtx_tensor::optim::clip_coefficient`], the factor (and `1e-6`) of
//! [`rtx_tensor::optim::clip_grad_norm`], before its optimizer steps.
//!
//! **Decision:** gather the shares and add them locally, rather than all-reduce one sum: the
//! order of the sum is fixed by rank (deterministic for a given world size), and the cost is `n`
//! f64s per rank instead of one. Against the replicated engine the only difference is the order
//! of the f64 sum of squares (segment by segment instead of parameter by parameter), so the norm
//! agrees to f64 roundoff and the clipped gradients to f32 roundoff of the factor.

use rtx_tensor::{CpuData, Optimizer, Storage};

use crate::data_parallel::run_jobs;
use crate::error::{Error, Result};
use crate::param_shard::ParamShard;
use crate::reducer::{BucketOp, Job, Reducer};

/// Refuses a clipping bound that is not positive and finite.
pub(crate) fn validate(grad_clip: Option<f64>) -> Result<()> {
    match grad_clip {
        Some(max) if max.is_nan() || max <= 0.0 || max.is_infinite() => Err(Error::InvalidConfig { reason: "grad_clip must be positive and finite" }),
        _ => Ok(()),
    }
}

/// Scales `shard`'s averaged gradient segments so the gradient's norm over the whole model (all
/// ranks' segments) is at most `max_norm`; returns that norm before scaling. Collective: every
/// rank of the group calls it at the same point of step `step`, after its reduce-scatters.
/// `job_index` numbers the collective's job (one past the engine's last bucket), for reports
/// and errors. (The shard is borrowed mutably, so the future is `Send` for any `Send` optimizer.)
pub(crate) async fn clip_segments<O: Optimizer>(reducer: &Reducer, step: u64, job_index: usize, shard: &mut ParamShard<O>, max_norm: f64) -> Result<f64> {
    let share = shard.grad_sum_squares()?;
    let total_sq = sum_shares(reducer, step, job_index, share).await?;
    let norm = total_sq.sqrt();
    let coef = rtx_tensor::optim::clip_coefficient(norm, max_norm);
    tracing::debug!(step, share, norm, max_norm, clipped = coef.is_some(), "global gradient norm");
    if let Some(coef) = coef {
        shard.scale_grads(coef)?;
    }
    Ok(norm)
}

/// Every rank's `share`, added in rank order from 0: the same bits on every rank.
async fn sum_shares(reducer: &Reducer, step: u64, job_index: usize, share: f64) -> Result<f64> {
    let (rank, n) = (reducer.rank(), reducer.size());
    if n == 1 {
        return Ok(share);
    }
    let mut values = vec![0.0f64; n];
    values[rank] = share;
    let values = Storage::new(CpuData::F64(values.into()));
    run_jobs(reducer, step, std::iter::once(Job { step, bucket: job_index, op: BucketOp::NormShares { values: values.clone() } })).await?;
    let gathered = values.read()?;
    let CpuData::F64(shares) = &*gathered else {
        return Err(Error::UnsupportedDType { bucket: job_index, dtype: gathered.dtype() });
    };
    if shares.len() != n {
        return Err(Error::InvalidConfig { reason: "grad norm: the gathered shares are not one per rank" });
    }
    Ok(shares.iter().fold(0.0f64, |sum, &s| sum + s))
}

#[cfg(test)]
mod tests {
    use super::*;

    // Goal: a bound that clip_grad_norm would refuse is refused at configuration time.
    #[test]
    fn bounds_must_be_positive_and_finite() {
        assert!(validate(None).is_ok());
        assert!(validate(Some(1.0)).is_ok());
        for bad in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            assert!(validate(Some(bad)).is_err(), "{bad}");
        }
    }
}
