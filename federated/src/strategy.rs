//! Server strategies: how the round's mean update moves the global model. FedAvg and FedProx add
//! the sample-weighted mean update (FedProx differs only in local training); FedAdam, FedYogi and
//! FedAdagrad (Reddi et al., "Adaptive Federated Optimization", 2021) treat the mean update as a
//! pseudo-gradient and keep first and second moments, with Flower's update rules and defaults
//! (FedAdam with Flower's bias-corrected step size).
//!
//! Also here: [`UpdateTransform`], the hook where client-level DP plugs in (on the client before the
//! update leaves it, and on the round's sum before the server step); [`Plain`] is the identity.
//! Secure aggregation (`[secagg]`) is not a transform: it runs its phases inside the round
//! (`round::secure`), between `on_client` and `on_sum`.

use crate::config::{StrategyConfig, StrategyKind};

/// What happens to updates between local training and the server step: client-level DP clips on
/// the client and adds noise to the sum. The aggregator only ever adds what `on_client` produced,
/// in the fixed tree order (or, under `[secagg]`, the secure round encodes and masks it and
/// `on_sum` sees the unmasked sum, `contributors` being the clients whose masked input is in it).
pub trait UpdateTransform: Sync {
    /// On the client, after training, before the update leaves it (e.g. clip, mask).
    fn on_client(&self, _round: u32, _client: u32, _update: &mut [f32], _weight: &mut f32) {}
    /// At the coordinator, on the weighted sum of the round's accepted updates (e.g. unmask, add
    /// noise); `contributors` are the clients whose update is in the sum, in ascending id order.
    fn on_sum(&self, _round: u32, _sum: &mut [f32], _total_weight: &mut f64, _contributors: &[u32]) {}
}

impl<T: UpdateTransform + ?Sized> UpdateTransform for Box<T> {
    fn on_client(&self, round: u32, client: u32, update: &mut [f32], weight: &mut f32) {
        (**self).on_client(round, client, update, weight);
    }

    fn on_sum(&self, round: u32, sum: &mut [f32], total_weight: &mut f64, contributors: &[u32]) {
        (**self).on_sum(round, sum, total_weight, contributors);
    }
}

/// No transform: updates are summed as trained.
#[derive(Clone, Copy, Debug, Default)]
pub struct Plain;

impl UpdateTransform for Plain {}

/// The server optimizer and its state.
#[derive(Clone, Debug)]
pub struct ServerOptimizer {
    config: StrategyConfig,
    m: Vec<f32>,
    v: Vec<f32>,
    step: u32,
}

impl ServerOptimizer {
    /// A fresh optimizer for a model of `n_params`.
    pub fn new(config: &StrategyConfig, n_params: usize) -> Self {
        let adaptive = matches!(config.kind, StrategyKind::Fedadam | StrategyKind::Fedyogi | StrategyKind::Fedadagrad);
        let state = if adaptive { n_params } else { 0 };
        // Flower initialises v to tau^2 for Yogi/Adam/Adagrad.
        let tau2 = config.tau * config.tau;
        ServerOptimizer { config: config.clone(), m: vec![0.0; state], v: vec![tau2; state], step: 0 }
    }

    /// Moves `model` by the round's mean update `delta` (`sum / total_weight`).
    pub fn apply(&mut self, model: &mut [f32], delta: &[f32]) {
        assert_eq!(model.len(), delta.len(), "model and update lengths");
        let c = &self.config;
        match c.kind {
            StrategyKind::Fedavg | StrategyKind::Fedprox => {
                for (w, d) in model.iter_mut().zip(delta) {
                    *w += d;
                }
            }
            StrategyKind::Fedadam | StrategyKind::Fedyogi | StrategyKind::Fedadagrad => {
                let t = self.step as i32 + 1;
                let eta = if c.kind == StrategyKind::Fedadam { c.eta * (1.0 - c.beta2.powi(t)).sqrt() / (1.0 - c.beta1.powi(t)) } else { c.eta };
                for (((w, &d), m), v) in model.iter_mut().zip(delta).zip(&mut self.m).zip(&mut self.v) {
                    *m = c.beta1 * *m + (1.0 - c.beta1) * d;
                    let d2 = d * d;
                    *v = match c.kind {
                        StrategyKind::Fedadam => c.beta2 * *v + (1.0 - c.beta2) * d2,
                        StrategyKind::Fedyogi => *v - (1.0 - c.beta2) * d2 * (*v - d2).signum(),
                        _ => *v + d2,
                    };
                    *w += eta * *m / (v.sqrt() + c.tau);
                }
            }
        }
        self.step += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(kind: StrategyKind) -> StrategyConfig {
        StrategyConfig { kind, ..StrategyConfig::default() }
    }

    #[test]
    fn fedavg_adds_the_mean_update() {
        let mut opt = ServerOptimizer::new(&config(StrategyKind::Fedavg), 3);
        let mut model = vec![1.0, 2.0, 3.0];
        opt.apply(&mut model, &[0.5, -1.0, 0.0]);
        assert_eq!(model, vec![1.5, 1.0, 3.0]);
    }

    #[test]
    fn adaptive_optimizers_step_about_eta_in_the_update_direction() {
        for kind in [StrategyKind::Fedadam, StrategyKind::Fedyogi, StrategyKind::Fedadagrad] {
            let mut opt = ServerOptimizer::new(&config(kind), 2);
            let mut model = vec![0.0, 0.0];
            opt.apply(&mut model, &[0.01, -0.02]);
            assert!(model[0] > 0.0 && model[1] < 0.0, "{kind:?}: {model:?}");
            // The first step of an adaptive method is sign(delta) times a size set by eta, not
            // by the update's magnitude.
            let ratio = model[0].abs() / model[1].abs();
            assert!((0.4..=1.01).contains(&ratio), "{kind:?}: {model:?}");
            assert!(model[1].abs() <= 0.1 * 1.01 && model[1].abs() > 1e-3, "{kind:?}: {model:?}");
        }
    }
}
