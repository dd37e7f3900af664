//! Elementwise unary ops: neg, exp, log, sqrt, rsqrt, tanh, sigmoid, relu, gelu, silu, abs,
//! clamp, powers and scalar arithmetic, each with its derivative.
//!
//! GELU comes in PyTorch's two forms ([`GeluApprox`], as `F.gelu(x, approximate=...)`): the
//! exact `x·Φ(x) = x/2·(1 + erf(x/√2))`, which [`Tensor::gelu`] computes as PyTorch does by
//! default, and the tanh approximation GPT-2, nanoGPT and llm.c were trained with
//! ([`Tensor::gelu_with`]`(GeluApprox::Tanh)`).

use super::check_float;
use crate::error::Result;
use crate::tensor::{FloatSlice, FloatVec, Tensor};
use rtx_kernels::{elementwise, DType, Float};

/// A unary function and its derivative, written once for every compute type. The derivative
/// receives the input `x` and the output `y`.
pub(crate) trait MapFn: Send + Sync + Copy + 'static {
    const NAME: &'static str;
    fn f<T: Float>(self, x: T) -> T;
    fn df<T: Float>(self, x: T, y: T) -> T;
}

fn c<T: Float>(v: f64) -> T {
    T::from_f64_lossy(v)
}

macro_rules! map_fn {
    ($name:ident, $label:literal, |$x:ident| $f:expr, |$dx:ident, $y:ident| $df:expr) => {
        #[derive(Clone, Copy)]
        pub(crate) struct $name;
        impl MapFn for $name {
            const NAME: &'static str = $label;
            #[inline(always)]
            fn f<T: Float>(self, $x: T) -> T {
                $f
            }
            #[inline(always)]
            #[allow(unused_variables)]
            fn df<T: Float>(self, $dx: T, $y: T) -> T {
                $df
            }
        }
    };
}

/// Which GELU to compute (PyTorch's `approximate=` argument of `F.gelu` and `nn.GELU`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum GeluApprox {
    /// The exact form `x·Φ(x)` through erf (`approximate="none"`, PyTorch's default).
    #[default]
    None,
    /// The tanh approximation `x/2·(1 + tanh(√(2/π)·(x + 0.044715·x³)))` (`approximate="tanh"`,
    /// GPT-2's `gelu_new`).
    Tanh,
}

impl GeluApprox {
    /// PyTorch's spelling: `"none"` or `"tanh"`.
    pub fn as_str(self) -> &'static str {
        match self {
            GeluApprox::None => "none",
            GeluApprox::Tanh => "tanh",
        }
    }
}

impl std::str::FromStr for GeluApprox {
    type Err = crate::Error;

    /// Parses PyTorch's spelling (`"none"`, `"tanh"`).
    fn from_str(s: &str) -> Result<GeluApprox> {
        match s {
            "none" => Ok(GeluApprox::None),
            "tanh" => Ok(GeluApprox::Tanh),
            other => Err(crate::Error::InvalidArgument { op: "gelu", reason: format!("approximate must be \"none\" or \"tanh\", got {other:?}") }),
        }
    }
}

const SQRT_2_OVER_PI: f64 = 0.797_884_560_802_865_4;
const GELU_C: f64 = 0.044_715;
const FRAC_1_SQRT_2: f64 = std::f64::consts::FRAC_1_SQRT_2;
/// 1/√(2π), the standard normal density at 0.
const FRAC_1_SQRT_2PI: f64 = 0.398_942_280_401_432_7;

map_fn!(Neg, "neg", |x| -x, |x, y| -T::one());
map_fn!(Exp, "exp", |x| x.exp(), |x, y| y);
map_fn!(Log, "log", |x| x.ln(), |x, y| T::one() / x);
map_fn!(Sqrt, "sqrt", |x| x.sqrt(), |x, y| c::<T>(0.5) / y);
map_fn!(Rsqrt, "rsqrt", |x| T::one() / x.sqrt(), |x, y| c::<T>(-0.5) * y * y * y);
map_fn!(Tanh, "tanh", |x| x.tanh(), |x, y| T::one() - y * y);
map_fn!(Sigmoid, "sigmoid", |x| T::one() / (T::one() + (-x).exp()), |x, y| y * (T::one() - y));
map_fn!(Relu, "relu", |x| if x > T::zero() { x } else { T::zero() }, |x, y| if x > T::zero() { T::one() } else { T::zero() });
map_fn!(Abs, "abs", |x| x.abs(), |x, y| if x > T::zero() { T::one() } else if x < T::zero() { -T::one() } else { T::zero() });
map_fn!(
    Gelu,
    "gelu",
    |x| c::<T>(0.5) * x * (T::one() + (c::<T>(SQRT_2_OVER_PI) * (x + c::<T>(GELU_C) * x * x * x)).fast_tanh()),
    |x, y| {
        let k = c::<T>(SQRT_2_OVER_PI);
        let inner = k * (x + c::<T>(GELU_C) * x * x * x);
        let t = inner.fast_tanh();
        c::<T>(0.5) * (T::one() + t) + c::<T>(0.5) * x * (T::one() - t * t) * k * (T::one() + c::<T>(3.0 * GELU_C) * x * x)
    }
);
map_fn!(
    GeluErf,
    "gelu",
    |x| c::<T>(0.5) * x * (T::one() + (x * c::<T>(FRAC_1_SQRT_2)).erf()),
    |x, y| {
        let cdf = c::<T>(0.5) * (T::one() + (x * c::<T>(FRAC_1_SQRT_2)).erf());
        cdf + x * c::<T>(FRAC_1_SQRT_2PI) * (c::<T>(-0.5) * x * x).exp()
    }
);
map_fn!(
    Silu,
    "silu",
    |x| x / (T::one() + (-x).exp()),
    |x, y| {
        let s = T::one() / (T::one() + (-x).exp());
        s * (T::one() + x * (T::one() - s))
    }
);

/// Applies a [`MapFn`] and records its backward `g ⊙ f'(x, y)`.
pub(crate) fn unary<F: MapFn>(x: &Tensor, f: F) -> Result<Tensor> {
    check_float(F::NAME, x)?;
    let values = crate::try_float_map!(x, |s: T| {
        let mut out = crate::pool::take::<T>(s.len());
        elementwise::map(s, &mut out, move |v| f.f(v)).map(|()| out)
    })?;
    let input = x.detach();
    Tensor::from_op(values, x.shape(), x.dtype(), F::NAME, &[x], move |g: &Tensor, out: &Tensor| {
        if let Some(gx) = fused_backward(&input, out, g, f)? {
            return Ok(vec![Some(gx)]);
        }
        let d = derivative(&input, out, f)?;
        Ok(vec![Some(g.mul(&d)?)])
    })
}

/// `g ⊙ f'(x, y)` in one pass when `x`, `y` and `g` share an f32/f64 dtype and a shape (no
/// derivative tensor in between); `None` otherwise.
fn fused_backward<F: MapFn>(x: &Tensor, y: &Tensor, g: &Tensor, f: F) -> Result<Option<Tensor>> {
    let dtype = x.dtype();
    if !matches!(dtype, DType::F32 | DType::F64) || y.dtype() != dtype || g.dtype() != dtype || x.shape() != g.shape() || y.shape() != g.shape() {
        return Ok(None);
    }
    let values = x.with_float_slice(|xs| {
        y.with_float_slice(|ys| {
            g.with_float_slice(|gs| match (xs, ys, gs) {
                (FloatSlice::F32(a), FloatSlice::F32(b), FloatSlice::F32(c)) => grad_map(a, b, c, f).map(|v| Some(FloatVec::F32(v))),
                (FloatSlice::F64(a), FloatSlice::F64(b), FloatSlice::F64(c)) => grad_map(a, b, c, f).map(|v| Some(FloatVec::F64(v))),
                _ => Ok(None),
            })
        })
    })????;
    let Some(values) = values else { return Ok(None) };
    Ok(Some(Tensor::from_data(values.into_data(dtype), x.shape())?))
}

/// `out[i] = g[i] · f'(x[i], y[i])` ([`elementwise::zip3_map`]: split over the pool in fixed
/// chunks when large, vectorized).
fn grad_map<T: Float + crate::pool::Pooled, F: MapFn>(x: &[T], y: &[T], g: &[T], f: F) -> Result<Vec<T>> {
    let mut out = crate::pool::take::<T>(x.len());
    elementwise::zip3_map(x, y, g, &mut out, move |a, b, c| c * f.df(a, b))?;
    Ok(out)
}

fn derivative<F: MapFn>(x: &Tensor, y: &Tensor, f: F) -> Result<Tensor> {
    let xs = crate::ops::binary::compute_form(x)?;
    let ys = crate::ops::binary::compute_form(y)?;
    let values = xs.with_float_slice(|xv| {
        ys.with_float_slice(|yv| match (xv, yv) {
            (FloatSlice::F32(a), FloatSlice::F32(b)) => {
                let mut o = crate::pool::take::<f32>(a.len());
                elementwise::zip_map(a, b, &mut o, move |p, q| f.df(p, q)).map(|()| FloatVec::F32(o))
            }
            (FloatSlice::F64(a), FloatSlice::F64(b)) => Ok(FloatVec::F64(a.iter().zip(b).map(|(&p, &q)| f.df(p, q)).collect())),
            (FloatSlice::F32(a), FloatSlice::F64(b)) => Ok(FloatVec::F64(a.iter().zip(b).map(|(&p, &q)| f.df(p as f64, q)).collect())),
            (FloatSlice::F64(a), FloatSlice::F32(b)) => Ok(FloatVec::F64(a.iter().zip(b).map(|(&p, &q)| f.df(p, q as f64)).collect())),
        })
    })???;
    Tensor::from_data(values.into_data(x.dtype()), x.shape())
}

impl Tensor {
    /// −x.
    pub fn neg(&self) -> Result<Tensor> {
        unary(self, Neg)
    }
    /// eˣ.
    pub fn exp(&self) -> Result<Tensor> {
        unary(self, Exp)
    }
    /// ln x.
    pub fn log(&self) -> Result<Tensor> {
        unary(self, Log)
    }
    /// √x.
    pub fn sqrt(&self) -> Result<Tensor> {
        unary(self, Sqrt)
    }
    /// 1/√x.
    pub fn rsqrt(&self) -> Result<Tensor> {
        unary(self, Rsqrt)
    }
    /// tanh x.
    pub fn tanh(&self) -> Result<Tensor> {
        unary(self, Tanh)
    }
    /// 1/(1+e⁻ˣ).
    pub fn sigmoid(&self) -> Result<Tensor> {
        unary(self, Sigmoid)
    }
    /// max(x, 0).
    pub fn relu(&self) -> Result<Tensor> {
        unary(self, Relu)
    }
    /// GELU in its exact form `x·Φ(x)` (erf), as PyTorch's `F.gelu(x)`.
    pub fn gelu(&self) -> Result<Tensor> {
        self.gelu_with(GeluApprox::None)
    }

    /// GELU in the form `approx` names (`GeluApprox::Tanh` for GPT-2's approximation).
    pub fn gelu_with(&self, approx: GeluApprox) -> Result<Tensor> {
        if let Some(device) = crate::backend::of(&[self]) {
            return device.gelu(self, approx);
        }
        match approx {
            GeluApprox::None => unary(self, GeluErf),
            GeluApprox::Tanh => unary(self, Gelu),
        }
    }
    /// x·σ(x).
    pub fn silu(&self) -> Result<Tensor> {
        unary(self, Silu)
    }
    /// |x|.
    pub fn abs(&self) -> Result<Tensor> {
        unary(self, Abs)
    }

    /// x + c.
    pub fn add_scalar(&self, c: f64) -> Result<Tensor> {
        self.add(&self.scalar_like(c))
    }

    /// x · c.
    pub fn mul_scalar(&self, c: f64) -> Result<Tensor> {
        if let Some(device) = crate::backend::of(&[self]) {
            return device.mul_scalar(self, c);
        }
        self.mul(&self.scalar_like(c))
    }

    /// a·x + b in one op.
    pub fn affine(&self, a: f64, b: f64) -> Result<Tensor> {
        self.mul_scalar(a)?.add_scalar(b)
    }

    /// xᵖ for a constant exponent.
    pub fn pow_scalar(&self, p: f64) -> Result<Tensor> {
        check_float("pow_scalar", self)?;
        let values = crate::float_map!(self, |s: T| {
            let e = T::from_f64_lossy(p);
            s.iter().map(|&v| v.powf(e)).collect::<Vec<T>>()
        })?;
        let input = self.detach();
        Tensor::from_op(values, self.shape(), self.dtype(), "pow_scalar", &[self], move |g: &Tensor, _: &Tensor| Ok(vec![Some(g.mul(&input.pow_scalar(p - 1.0)?.mul_scalar(p)?)?)]))
    }

    /// x²
    pub fn square(&self) -> Result<Tensor> {
        self.mul(self)
    }

    /// Clamps into `[min, max]` (either bound optional); the gradient is zero where clamped.
    pub fn clamp(&self, min: Option<f64>, max: Option<f64>) -> Result<Tensor> {
        check_float("clamp", self)?;
        let (lo, hi): (f64, f64) = (min.unwrap_or(f64::NEG_INFINITY), max.unwrap_or(f64::INFINITY));
        let values = crate::float_map!(self, |s: T| {
            let (l, h) = (T::from_f64_lossy(lo), T::from_f64_lossy(hi));
            s.iter().map(|&v| if v < l { l } else if v > h { h } else { v }).collect::<Vec<T>>()
        })?;
        let input = self.detach();
        Tensor::from_op(values, self.shape(), self.dtype(), "clamp", &[self], move |g: &Tensor, _: &Tensor| {
            let lo_t = input.scalar_like(lo);
            let hi_t = input.scalar_like(hi);
            let inside = input.ge(&lo_t)?.to_f32_vec()?.iter().zip(input.le(&hi_t)?.to_u32_vec()?).map(|(&a, b)| (a as u32) & b).collect::<Vec<u32>>();
            let mask = Tensor::from_vec(inside, input.shape())?;
            Ok(vec![Some(Tensor::where_(&mask, g, &Tensor::zeros(&[], g.dtype()))?)])
        })
    }
}
