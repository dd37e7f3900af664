//! Run-time CPU-feature dispatch for the elementwise, norm and attention kernels.
//!
//! The workspace builds for baseline x86-64 (SSE2), so a loop the compiler vectorizes runs four
//! f32 lanes at a time. A hot kernel body is written once as an `#[inline(always)]` function and
//! also compiled inside a `#[target_feature(enable = "avx2,fma")]` wrapper, which the caller
//! picks when [`avx2_fma`] says the CPU has both (eight lanes, and `mul_add` becomes one
//! instruction). The gemm crate does the same for its microkernels.
//!
//! **Invariant:** both builds give bit-identical results. The bodies use only IEEE operations
//! that are exactly rounded on every ISA (`+ − × ÷ sqrt`, `mul_add` as a true fused
//! multiply-add), the compiler never contracts `a·b + c` by itself, and lane counts of
//! reductions are fixed in the source (8 lanes), not taken from the vector width. So a result
//! depends neither on the machine's features nor on the thread count.

/// Whether the CPU has AVX2 and FMA (std caches the detection; this is an atomic load).
#[inline]
pub fn avx2_fma() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Defines `$name`, which runs the `#[inline(always)]` function `$body` with the same arguments,
/// through a copy compiled for AVX2+FMA when [`avx2_fma`] holds (see the module docs).
///
/// Syntax: `dispatch!(vis fn name[generics](args) -> ret = body where bounds;)`, generics and
/// bounds as in an ordinary signature (bounds are repeated on both copies).
macro_rules! dispatch {
    ($(#[$meta:meta])* $vis:vis fn $name:ident [$($gen:tt)*] ($($arg:ident : $ty:ty),* $(,)?) $(-> $ret:ty)? = $body:ident where [$($bounds:tt)*];) => {
        $(#[$meta])*
        #[inline]
        #[allow(clippy::too_many_arguments)]
        $vis fn $name<$($gen)*>($($arg: $ty),*) $(-> $ret)? where $($bounds)* {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx2,fma")]
                #[allow(clippy::too_many_arguments)]
                unsafe fn avx2<$($gen)*>($($arg: $ty),*) $(-> $ret)? where $($bounds)* {
                    $body($($arg),*)
                }
                if $crate::simd::avx2_fma() {
                    // SAFETY: the CPU has AVX2 and FMA (checked just above), the only requirement
                    // of calling a `target_feature(enable = "avx2,fma")` function; the body is
                    // safe code.
                    return unsafe { avx2($($arg),*) };
                }
            }
            $body($($arg),*)
        }
    };
}

pub(crate) use dispatch;

#[cfg(test)]
mod tests {
    use super::*;

    #[inline(always)]
    fn scaled_sum_body(xs: &[f32], k: f32) -> f32 {
        xs.iter().map(|&x| x * k).sum()
    }

    dispatch! {
        fn scaled_sum[](xs: &[f32], k: f32) -> f32 = scaled_sum_body where [];
    }

    #[inline(always)]
    fn generic_body<T: crate::Float>(xs: &mut [T], f: impl Fn(T) -> T) {
        xs.iter_mut().for_each(|x| *x = f(*x));
    }

    dispatch! {
        fn generic[T, F](xs: &mut [T], f: F) = generic_body where [T: crate::Float, F: Fn(T) -> T];
    }

    #[test]
    fn dispatched_copies_agree_with_the_plain_body() {
        // Goal: the wrapper returns what the plain body returns, for a plain and a generic
        // kernel (whichever copy this CPU runs).
        let xs: Vec<f32> = (0..37).map(|i| i as f32 * 0.37 - 3.0).collect();
        assert_eq!(scaled_sum(&xs, 1.5).to_bits(), scaled_sum_body(&xs, 1.5).to_bits());
        let (mut a, mut b) = (xs.clone(), xs);
        generic(&mut a, |x: f32| x.mul_add(2.0, 1.0));
        generic_body(&mut b, |x: f32| x.mul_add(2.0, 1.0));
        assert_eq!(a, b);
        let _ = avx2_fma();
    }
}
