//! Elementwise binary ops with NumPy broadcasting (add, sub, mul, div, pow, maximum, minimum),
//! comparisons producing u32 masks, and `where_`/`masked_fill`. The backward of a broadcast
//! operand sums the gradient back to its shape ([`Tensor::sum_to_shape`]).

use super::{check_float, check_same};
use crate::error::{Error, Result};
use crate::layout::broadcast_shape;
use crate::storage::CpuData;
use crate::tensor::{FloatVec, Tensor};
use rtx_kernels::elementwise::broadcast_zip_map;
use rtx_kernels::{DType, Float};

/// A binary function written once for every compute type.
pub(crate) trait ZipFn: Send + Sync + Copy {
    fn apply<T: Float>(self, a: T, b: T) -> T;
}

/// A comparison written once for every compute type.
pub(crate) trait CmpFn: Send + Sync + Copy {
    fn apply<T: Float>(self, a: T, b: T) -> bool;
}

macro_rules! zip_fn {
    ($name:ident, |$a:ident, $b:ident| $body:expr) => {
        #[derive(Clone, Copy)]
        pub(crate) struct $name;
        impl ZipFn for $name {
            #[inline(always)]
            fn apply<T: Float>(self, $a: T, $b: T) -> T {
                $body
            }
        }
    };
}
zip_fn!(AddFn, |a, b| a + b);
zip_fn!(SubFn, |a, b| a - b);
zip_fn!(MulFn, |a, b| a * b);
zip_fn!(DivFn, |a, b| a / b);
zip_fn!(PowFn, |a, b| a.powf(b));
zip_fn!(MaxFn, |a, b| if a >= b || a.is_nan() { a } else { b });
zip_fn!(MinFn, |a, b| if a <= b || a.is_nan() { a } else { b });

macro_rules! cmp_fn {
    ($name:ident, |$a:ident, $b:ident| $body:expr) => {
        #[derive(Clone, Copy)]
        pub(crate) struct $name;
        impl CmpFn for $name {
            #[inline(always)]
            fn apply<T: Float>(self, $a: T, $b: T) -> bool {
                $body
            }
        }
    };
}
cmp_fn!(EqFn, |a, b| a == b);
cmp_fn!(NeFn, |a, b| a != b);
cmp_fn!(LtFn, |a, b| a < b);
cmp_fn!(LeFn, |a, b| a <= b);
cmp_fn!(GtFn, |a, b| a > b);
cmp_fn!(GeFn, |a, b| a >= b);

/// Widens a bf16 tensor to a detached f32 one (compute type); other dtypes pass through.
pub(crate) fn compute_form(t: &Tensor) -> Result<Tensor> {
    if t.dtype() == DType::BF16 {
        let v = t.to_f32_vec()?;
        return Tensor::from_vec(v, t.shape());
    }
    Ok(t.clone())
}

/// The shape float operands `a` and `b` (same dtype and device) broadcast to.
fn broadcast_checked(op: &'static str, a: &Tensor, b: &Tensor) -> Result<Vec<usize>> {
    check_same(op, a, b)?;
    check_float(op, a)?;
    broadcast_shape(op, a.shape(), b.shape())
}

/// Runs `f` over `a` and `b` broadcast to a common shape; returns the values and the shape.
pub(crate) fn broadcast_apply<F: ZipFn>(op: &'static str, a: &Tensor, b: &Tensor, f: F) -> Result<(FloatVec, Vec<usize>)> {
    let shape = broadcast_checked(op, a, b)?;
    let (a, b) = (compute_form(a)?, compute_form(b)?);
    let la = a.layout().broadcast_to(&shape)?;
    let lb = b.layout().broadcast_to(&shape)?;
    let n: usize = shape.iter().product();
    let (da, db) = (a.storage().read()?, b.storage().read()?);
    let out = match (&*da, &*db) {
        (CpuData::F32(x), CpuData::F32(y)) => {
            let mut o = crate::pool::take::<f32>(n);
            broadcast_zip_map(&shape, x, la.offset(), la.strides(), y, lb.offset(), lb.strides(), &mut o, move |p, q| f.apply(p, q))?;
            FloatVec::F32(o)
        }
        (CpuData::F64(x), CpuData::F64(y)) => {
            let mut o = crate::pool::take::<f64>(n);
            broadcast_zip_map(&shape, x, la.offset(), la.strides(), y, lb.offset(), lb.strides(), &mut o, move |p, q| f.apply(p, q))?;
            FloatVec::F64(o)
        }
        (x, y) => return Err(Error::DTypeMismatch { op, lhs: x.dtype(), rhs: y.dtype() }),
    };
    Ok((out, shape))
}

fn compare<F: CmpFn>(op: &'static str, a: &Tensor, b: &Tensor, f: F) -> Result<Tensor> {
    check_same(op, a, b)?;
    check_float(op, a)?;
    let shape = broadcast_shape(op, a.shape(), b.shape())?;
    let (a, b) = (compute_form(a)?, compute_form(b)?);
    let la = a.layout().broadcast_to(&shape)?;
    let lb = b.layout().broadcast_to(&shape)?;
    let n: usize = shape.iter().product();
    let mut o = crate::pool::take::<u32>(n);
    let (da, db) = (a.storage().read()?, b.storage().read()?);
    match (&*da, &*db) {
        (CpuData::F32(x), CpuData::F32(y)) => broadcast_zip_map(&shape, x, la.offset(), la.strides(), y, lb.offset(), lb.strides(), &mut o, move |p, q| f.apply(p, q) as u32)?,
        (CpuData::F64(x), CpuData::F64(y)) => broadcast_zip_map(&shape, x, la.offset(), la.strides(), y, lb.offset(), lb.strides(), &mut o, move |p, q| f.apply(p, q) as u32)?,
        (x, y) => return Err(Error::DTypeMismatch { op, lhs: x.dtype(), rhs: y.dtype() }),
    }
    Tensor::from_vec(o, &shape)
}

impl Tensor {
    /// `self + other` (broadcasting).
    pub fn add(&self, other: &Tensor) -> Result<Tensor> {
        if let Some(device) = crate::backend::of(&[self, other]) {
            return device.add(self, other);
        }
        let (v, shape) = broadcast_apply("add", self, other, AddFn)?;
        let (sa, sb) = (self.shape().to_vec(), other.shape().to_vec());
        Tensor::from_op(v, &shape, self.dtype(), "add", &[self, other], move |g: &Tensor, _: &Tensor| Ok(vec![Some(g.sum_to_shape(&sa)?), Some(g.sum_to_shape(&sb)?)]))
    }

    /// `self − other` (broadcasting).
    pub fn sub(&self, other: &Tensor) -> Result<Tensor> {
        let (v, shape) = broadcast_apply("sub", self, other, SubFn)?;
        let (sa, sb) = (self.shape().to_vec(), other.shape().to_vec());
        Tensor::from_op(v, &shape, self.dtype(), "sub", &[self, other], move |g: &Tensor, _: &Tensor| Ok(vec![Some(g.sum_to_shape(&sa)?), Some(g.neg()?.sum_to_shape(&sb)?)]))
    }

    /// `self ⊙ other` (broadcasting).
    pub fn mul(&self, other: &Tensor) -> Result<Tensor> {
        // The backward, in tensor ops, for every device.
        let (a, b) = (self.detach(), other.detach());
        let (ra, rb) = (self.is_requires_grad(), other.is_requires_grad());
        let backward = move |g: &Tensor, _: &Tensor| {
            let ga = if ra { Some(g.mul(&b)?.sum_to_shape(a.shape())?) } else { None };
            let gb = if rb { Some(g.mul(&a)?.sum_to_shape(b.shape())?) } else { None };
            Ok(vec![ga, gb])
        };
        if let Some(device) = crate::backend::of(&[self, other]) {
            let y = device.mul(self, other, &broadcast_checked("mul", self, other)?)?;
            return Ok(Tensor::with_node(y.storage().clone(), y.layout().clone(), y.dtype(), "mul", &[self, other], backward));
        }
        let (v, shape) = broadcast_apply("mul", self, other, MulFn)?;
        Tensor::from_op(v, &shape, self.dtype(), "mul", &[self, other], backward)
    }

    /// `self / other` (broadcasting).
    pub fn div(&self, other: &Tensor) -> Result<Tensor> {
        let (v, shape) = broadcast_apply("div", self, other, DivFn)?;
        let (a, b) = (self.detach(), other.detach());
        let (ra, rb) = (self.is_requires_grad(), other.is_requires_grad());
        Tensor::from_op(v, &shape, self.dtype(), "div", &[self, other], move |g: &Tensor, out: &Tensor| {
            let ga = if ra { Some(g.div(&b)?.sum_to_shape(a.shape())?) } else { None };
            let gb = if rb { Some(g.mul(out)?.div(&b)?.neg()?.sum_to_shape(b.shape())?) } else { None };
            Ok(vec![ga, gb])
        })
    }

    /// `self ^ other` elementwise (broadcasting).
    pub fn pow(&self, other: &Tensor) -> Result<Tensor> {
        let (v, shape) = broadcast_apply("pow", self, other, PowFn)?;
        let (a, b) = (self.detach(), other.detach());
        let (ra, rb) = (self.is_requires_grad(), other.is_requires_grad());
        Tensor::from_op(v, &shape, self.dtype(), "pow", &[self, other], move |g: &Tensor, out: &Tensor| {
            let ga = if ra { Some(g.mul(&b)?.mul(&a.pow(&b.add_scalar(-1.0)?)?)?.sum_to_shape(a.shape())?) } else { None };
            let gb = if rb { Some(g.mul(out)?.mul(&a.log()?)?.sum_to_shape(b.shape())?) } else { None };
            Ok(vec![ga, gb])
        })
    }

    /// Elementwise maximum (gradient flows to the larger operand; ties to `self`).
    pub fn maximum(&self, other: &Tensor) -> Result<Tensor> {
        let (v, shape) = broadcast_apply("maximum", self, other, MaxFn)?;
        let (a, b) = (self.detach(), other.detach());
        Tensor::from_op(v, &shape, self.dtype(), "maximum", &[self, other], move |g: &Tensor, _: &Tensor| {
            let mask = a.ge(&b)?;
            let zero = Tensor::zeros(&[], g.dtype());
            Ok(vec![Some(Tensor::where_(&mask, g, &zero)?.sum_to_shape(a.shape())?), Some(Tensor::where_(&mask, &zero, g)?.sum_to_shape(b.shape())?)])
        })
    }

    /// Elementwise minimum (gradient flows to the smaller operand; ties to `self`).
    pub fn minimum(&self, other: &Tensor) -> Result<Tensor> {
        let (v, shape) = broadcast_apply("minimum", self, other, MinFn)?;
        let (a, b) = (self.detach(), other.detach());
        Tensor::from_op(v, &shape, self.dtype(), "minimum", &[self, other], move |g: &Tensor, _: &Tensor| {
            let mask = a.le(&b)?;
            let zero = Tensor::zeros(&[], g.dtype());
            Ok(vec![Some(Tensor::where_(&mask, g, &zero)?.sum_to_shape(a.shape())?), Some(Tensor::where_(&mask, &zero, g)?.sum_to_shape(b.shape())?)])
        })
    }

    /// `self == other` as a u32 mask.
    pub fn eq(&self, other: &Tensor) -> Result<Tensor> {
        compare("eq", self, other, EqFn)
    }
    /// `self != other` as a u32 mask.
    pub fn ne(&self, other: &Tensor) -> Result<Tensor> {
        compare("ne", self, other, NeFn)
    }
    /// `self < other` as a u32 mask.
    pub fn lt(&self, other: &Tensor) -> Result<Tensor> {
        compare("lt", self, other, LtFn)
    }
    /// `self <= other` as a u32 mask.
    pub fn le(&self, other: &Tensor) -> Result<Tensor> {
        compare("le", self, other, LeFn)
    }
    /// `self > other` as a u32 mask.
    pub fn gt(&self, other: &Tensor) -> Result<Tensor> {
        compare("gt", self, other, GtFn)
    }
    /// `self >= other` as a u32 mask.
    pub fn ge(&self, other: &Tensor) -> Result<Tensor> {
        compare("ge", self, other, GeFn)
    }

    /// Picks `a` where `cond` (a u32 mask) is non-zero, else `b`; all three broadcast.
    pub fn where_(cond: &Tensor, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        if cond.dtype() != DType::U32 {
            return Err(Error::DTypeMismatch { op: "where", lhs: cond.dtype(), rhs: DType::U32 });
        }
        check_same("where", a, b)?;
        check_float("where", a)?;
        let shape = broadcast_shape("where", &broadcast_shape("where", cond.shape(), a.shape())?, b.shape())?;
        let c = cond.broadcast_to(&shape)?.to_u32_vec()?;
        let (ab, bb) = (a.detach().broadcast_to(&shape)?, b.detach().broadcast_to(&shape)?);
        let values = match (crate::float_map!(ab, |x: T| x.to_vec())?, crate::float_map!(bb, |y: T| y.to_vec())?) {
            (FloatVec::F32(mut x), FloatVec::F32(y)) => {
                x.iter_mut().zip(&y).zip(&c).for_each(|((o, &yv), &m)| if m == 0 { *o = yv });
                FloatVec::F32(x)
            }
            (FloatVec::F64(mut x), FloatVec::F64(y)) => {
                x.iter_mut().zip(&y).zip(&c).for_each(|((o, &yv), &m)| if m == 0 { *o = yv });
                FloatVec::F64(x)
            }
            _ => return Err(Error::DTypeMismatch { op: "where", lhs: a.dtype(), rhs: b.dtype() }),
        };
        let mask = Tensor::from_vec(c, &shape)?;
        let (sa, sb) = (a.shape().to_vec(), b.shape().to_vec());
        let (ra, rb) = (a.is_requires_grad(), b.is_requires_grad());
        Tensor::from_op(values, &shape, a.dtype(), "where", &[a, b], move |g: &Tensor, _: &Tensor| {
            // Only the operands that need a gradient get one: `masked_fill` passes a constant.
            let zero = Tensor::zeros(&[], g.dtype());
            let ga = if ra { Some(Tensor::where_(&mask, g, &zero)?.sum_to_shape(&sa)?) } else { None };
            let gb = if rb { Some(Tensor::where_(&mask, &zero, g)?.sum_to_shape(&sb)?) } else { None };
            Ok(vec![ga, gb])
        })
    }

    /// Replaces elements where `mask` (u32, broadcast) is non-zero with `value`.
    pub fn masked_fill(&self, mask: &Tensor, value: f64) -> Result<Tensor> {
        let fill = Tensor::scalar(value, self.dtype());
        Tensor::where_(mask, &fill, self)
    }

    /// A scalar tensor of this tensor's dtype.
    pub(crate) fn scalar_like(&self, value: f64) -> Tensor {
        Tensor::scalar(value, self.dtype())
    }
}
