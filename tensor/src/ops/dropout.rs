//! Inverted dropout: in training, each element is zeroed with probability `p` and the survivors
//! are scaled by `1/(1−p)`, so evaluation needs no rescaling.
//!
//! The mask comes from the caller's seeded [`Generator`] (one uniform draw per element, in
//! row-major order), so a run replays from its seed and the generator's position can be
//! checkpointed. The backward applies the same mask and scale to the gradient. The scale is
//! applied in the compute type (f32 for bf16), never rounded to bf16 first.

use super::check_float;
use crate::error::{Error, Result};
use crate::rng::Generator;
use crate::tensor::{FloatVec, Tensor};

impl Tensor {
    /// Inverted dropout with drop probability `p` in `[0, 1)`. The identity (the same tensor,
    /// no randomness drawn) when `!training` or `p == 0`.
    pub fn dropout(&self, p: f64, training: bool, rng: &mut Generator) -> Result<Tensor> {
        const OP: &str = "dropout";
        check_float(OP, self)?;
        if !(0.0..1.0).contains(&p) {
            return Err(Error::InvalidArgument { op: OP, reason: format!("drop probability {p} outside [0, 1)") });
        }
        if !training || p == 0.0 {
            return Ok(self.clone());
        }
        let keep: Vec<bool> = (0..self.numel()).map(|_| rng.uniform() >= p).collect();
        let scale = 1.0 / (1.0 - p);
        let values = masked_scale(self, &keep, scale)?;
        let dtype = self.dtype();
        Tensor::from_op(values, self.shape(), dtype, OP, &[self], move |g: &Tensor, _: &Tensor| {
            let dx = masked_scale(g, &keep, scale)?;
            Ok(vec![Some(Tensor::from_data(dx.into_data(dtype), g.shape())?)])
        })
    }
}

/// `t ⊙ keep · scale` in the compute type.
fn masked_scale(t: &Tensor, keep: &[bool], scale: f64) -> Result<FloatVec> {
    assert_eq!(t.numel(), keep.len(), "dropout mask length");
    crate::float_map!(t, |x: T| {
        let s = <T as rtx_kernels::Float>::from_f64_lossy(scale);
        x.iter().zip(keep).map(|(&v, &k)| if k { v * s } else { T::default() }).collect::<Vec<T>>()
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use rtx_kernels::DType;

    #[test]
    fn dropout_keeps_about_one_minus_p_and_rescales() {
        let x = Tensor::ones(&[10_000], DType::F32);
        let y = x.dropout(0.25, true, &mut Generator::new(3)).unwrap().to_f32_vec().unwrap();
        let kept = y.iter().filter(|&&v| v != 0.0).count();
        assert!((7_200..7_800).contains(&kept), "kept {kept}");
        assert!(y.iter().all(|&v| v == 0.0 || (v - 4.0 / 3.0).abs() < 1e-6));
        let mean: f32 = y.iter().sum::<f32>() / y.len() as f32;
        assert!((mean - 1.0).abs() < 0.03, "mean {mean}");
    }

    #[test]
    fn eval_mode_and_zero_p_are_identity_and_bad_p_is_an_error() {
        let x = Tensor::ones(&[4], DType::F32);
        let mut g = Generator::new(1);
        assert_eq!(x.dropout(0.5, false, &mut g).unwrap().id(), x.id());
        assert_eq!(x.dropout(0.0, true, &mut g).unwrap().id(), x.id());
        assert_eq!(g.state(), Generator::new(1).state(), "identity draws nothing");
        assert!(matches!(x.dropout(1.0, true, &mut g), Err(Error::InvalidArgument { op: "dropout", .. })));
        assert!(matches!(x.dropout(f64::NAN, false, &mut g), Err(Error::InvalidArgument { .. })));
    }
}
