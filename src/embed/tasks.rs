//! Ready-made [`EmbeddedTask`]s: [`Regression`], the smallest real task (least squares on rows
//! drawn from a seeded generator), for the API's doc-tests and quick checks of a placement. A
//! program's own task (as in `examples/embed_elastic.rs`) is written the same way.

use rtx_collectives::segment_range;
use rtx_tensor::nn::Linear;
use rtx_tensor::optim::{AdamW, AdamWConfig};
use rtx_tensor::{DType, Generator, Reduction, Tensor};

use super::error::TaskError;
use super::task::EmbeddedTask;

/// Fits `y = x · w` for a fixed random `w` with a linear layer and AdamW. Row `i` of the endless
/// dataset comes from its own generator stream, so batches are a pure function of the step and
/// every world size cuts the same global batch.
#[derive(Clone, Debug)]
pub struct Regression {
    features: usize,
    global_batch: usize,
    data_seed: u64,
    target: Vec<f32>,
}

/// One rank's rows of a [`Regression`] batch.
#[derive(Debug)]
pub struct RegressionBatch {
    x: Tensor,
    y: Tensor,
    rows: usize,
}

impl Regression {
    /// A task of `features` inputs and `global_batch` rows per step.
    pub fn new(features: usize, global_batch: usize) -> Result<Regression, TaskError> {
        if features == 0 || global_batch == 0 {
            return Err(format!("Regression needs at least one feature and one row per batch (got {features} and {global_batch})").into());
        }
        let data_seed = 0x5eed;
        let mut rng = Generator::with_stream(data_seed, u64::MAX);
        let target = (0..features).map(|_| rng.normal() as f32).collect();
        Ok(Regression { features, global_batch, data_seed, target })
    }

    fn rows(&self, first: u64, n: usize) -> Result<(Tensor, Tensor), TaskError> {
        let mut x = Vec::with_capacity(n * self.features);
        let mut y: Vec<f32> = Vec::with_capacity(n);
        for row in first..first + n as u64 {
            let mut rng = Generator::with_stream(self.data_seed, row);
            let features: Vec<f32> = (0..self.features).map(|_| rng.normal() as f32).collect();
            y.push(features.iter().zip(&self.target).map(|(a, b)| a * b).sum());
            x.extend(features);
        }
        Ok((Tensor::from_vec(x, &[n, self.features])?, Tensor::from_vec(y, &[n, 1])?))
    }
}

impl EmbeddedTask for Regression {
    type Model = Linear;
    type Optim = AdamW;
    type Batch = RegressionBatch;

    fn build_model(&self, seed: u64) -> Result<Linear, TaskError> {
        Ok(Linear::new(self.features, 1, true, DType::F32, &mut Generator::new(seed))?)
    }

    fn build_optimizer(&self, parameters: Vec<(String, Tensor)>) -> Result<AdamW, TaskError> {
        Ok(AdamW::new(parameters, AdamWConfig { lr: 0.05, weight_decay: 0.0, ..AdamWConfig::default() })?)
    }

    fn global_batch(&self) -> usize {
        self.global_batch
    }

    fn batch(&self, step: u64, rank: usize, world: usize) -> Result<RegressionBatch, TaskError> {
        let part = segment_range(self.global_batch, world, rank);
        let first = step * self.global_batch as u64 + part.start as u64;
        let (x, y) = self.rows(first, part.len())?;
        Ok(RegressionBatch { x, y, rows: part.len() })
    }

    fn loss(&self, model: &mut Linear, batch: &RegressionBatch) -> Result<(Tensor, usize), TaskError> {
        Ok((model.forward(&batch.x)?.mse(&batch.y, Reduction::Mean)?, batch.rows))
    }

    fn evaluate(&self, model: &mut Linear) -> Result<Vec<(String, f64)>, TaskError> {
        // Held-out rows: far past any step's.
        let (x, y) = self.rows(u64::MAX / 2, 256)?;
        Ok(vec![("mse".into(), model.forward(&x)?.mse(&y, Reduction::Mean)?.item()?)])
    }
}
