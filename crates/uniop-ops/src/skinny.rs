//! GEMM for a few rows (decode: one token per sequence) when both operands are contiguous along
//! K — activations row-major, weights in HF's `[N, K]` layout. Packing would cost more than the
//! products, so each output is a dot product read straight from the operands; all rows are done
//! together, four weight rows at a time, so the weight is streamed once at memory speed however
//! many rows there are (the `gemm` crate and the packed bf16 kernel read it once per row band,
//! and slowly for so few rows).

use crate::bf16_gemm::GemmOut;
use crate::matmul::{Dst, Mat};
use uniop::half::bf16;

/// Rows up to which [`skinny`] is used.
pub(crate) const SKINNY_ROWS: usize = 4;

/// Whether [`skinny`] takes a product of `rows` rows with these operands.
pub(crate) fn applies<T>(rows: &std::ops::Range<usize>, lhs: Mat<T>, rhs: Mat<T>) -> bool {
    rows.len() <= SKINNY_ROWS && lhs.cs == 1 && rhs.rs == 1
}

/// An element type with a SIMD kernel for `R × 4` dot products.
pub(crate) trait Dots: GemmOut {
    /// `a[i] · b[j]` over `k` elements, f32 sums.
    ///
    /// # Safety
    /// Only on a CPU with the kernel's features; every pointer valid for `k` elements.
    unsafe fn dots<const R: usize>(a: [*const Self; R], b: [*const Self; 4], k: usize) -> [[f32; 4]; R];
}

/// `dst[rows] = lhs[rows] · rhs` (`+=` with `accumulate`), `simd`: use [`Dots::dots`] (else a
/// scalar loop).
///
/// # Safety
/// As [`crate::matmul::gemm_rows`], with [`applies`] true.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn skinny<I: Dots, O: GemmOut>(
    rows: std::ops::Range<usize>,
    n: usize,
    k: usize,
    dst: Dst<O>,
    lhs: Mat<I>,
    rhs: Mat<I>,
    accumulate: bool,
    simd: bool,
) {
    debug_assert!(applies(&rows, lhs, rhs));
    let a: [*const I; SKINNY_ROWS] =
        std::array::from_fn(|i| lhs.ptr.offset((rows.start + i.min(rows.len() - 1)) as isize * lhs.rs));
    let mut c = 0;
    while c < n {
        let cols = 4.min(n - c);
        let b = std::array::from_fn(|j| rhs.ptr.offset((c + j.min(cols - 1)) as isize * rhs.cs));
        let sums: [[f32; 4]; SKINNY_ROWS] = match (simd, rows.len()) {
            (true, 1) => pad(I::dots::<1>([a[0]], b, k)),
            (true, 2) => pad(I::dots::<2>([a[0], a[1]], b, k)),
            (true, 3) => pad(I::dots::<3>([a[0], a[1], a[2]], b, k)),
            (true, _) => I::dots::<4>(a, b, k),
            (false, _) => std::array::from_fn(|i| {
                std::array::from_fn(|j| (0..k).map(|p| (*a[i].add(p)).to_f32() * (*b[j].add(p)).to_f32()).sum())
            }),
        };
        for (i, r) in rows.clone().enumerate() {
            for (j, &sum) in sums[i].iter().enumerate().take(cols) {
                let o = dst.ptr.offset(r as isize * dst.rs + (c + j) as isize * dst.cs);
                *o = O::from_f32(if accumulate { (*o).to_f32() + sum } else { sum });
            }
        }
        c += cols;
    }
}

/// `R` rows of sums widened to [`SKINNY_ROWS`] (the rest unused).
fn pad<const R: usize>(sums: [[f32; 4]; R]) -> [[f32; 4]; SKINNY_ROWS] {
    std::array::from_fn(|i| sums.get(i).copied().unwrap_or_default())
}

impl Dots for bf16 {
    /// 32 pairs per `vdpbf16ps` (AVX512-BF16).
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    unsafe fn dots<const R: usize>(a: [*const bf16; R], b: [*const bf16; 4], k: usize) -> [[f32; 4]; R] {
        use std::arch::x86_64::*;
        let mut acc = [[_mm512_setzero_ps(); 4]; R];
        let mut p = 0;
        while p < k {
            let mask: __mmask32 = if k - p >= 32 { u32::MAX } else { (1u32 << (k - p)) - 1 };
            let load = |ptr: *const uniop::half::bf16| -> __m512bh {
                std::mem::transmute(_mm512_maskz_loadu_epi16(mask, ptr.add(p) as *const i16))
            };
            let bv = b.map(load);
            for (acc, &ai) in acc.iter_mut().zip(&a) {
                let av = load(ai);
                for (acc, &bv) in acc.iter_mut().zip(&bv) {
                    *acc = _mm512_dpbf16_ps(*acc, av, bv);
                }
            }
            p += 32;
        }
        acc.map(|row| row.map(|v| _mm512_reduce_add_ps(v)))
    }

    #[cfg(not(target_arch = "x86_64"))]
    unsafe fn dots<const R: usize>(_: [*const bf16; R], _: [*const bf16; 4], _: usize) -> [[f32; 4]; R] {
        unreachable!("only selected when the CPU has AVX512-BF16")
    }
}

impl Dots for f32 {
    /// 16 lanes per FMA (AVX-512F).
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f")]
    unsafe fn dots<const R: usize>(a: [*const f32; R], b: [*const f32; 4], k: usize) -> [[f32; 4]; R] {
        use std::arch::x86_64::*;
        let mut acc = [[_mm512_setzero_ps(); 4]; R];
        let mut p = 0;
        while p < k {
            let mask: __mmask16 = if k - p >= 16 { u16::MAX } else { (1u16 << (k - p)) - 1 };
            let load = |ptr: *const f32| _mm512_maskz_loadu_ps(mask, ptr.add(p));
            let bv = b.map(load);
            for (acc, &ai) in acc.iter_mut().zip(&a) {
                let av = load(ai);
                for (acc, &bv) in acc.iter_mut().zip(&bv) {
                    *acc = _mm512_fmadd_ps(av, bv, *acc);
                }
            }
            p += 16;
        }
        acc.map(|row| row.map(|v| _mm512_reduce_add_ps(v)))
    }

    #[cfg(not(target_arch = "x86_64"))]
    unsafe fn dots<const R: usize>(_: [*const f32; R], _: [*const f32; 4], _: usize) -> [[f32; 4]; R] {
        unreachable!("only selected when the CPU has AVX-512F")
    }
}

/// Whether the f32 kernel can run (the `gemm` crate serves f32 otherwise).
pub(crate) fn has_avx512f() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static DETECTED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *DETECTED.get_or_init(|| is_x86_feature_detected!("avx512f"))
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::matmul::WeightCase;

    /// f32 rows × an `[n, k]` weight, against f64 sums: every row count, k under / at / over one
    /// 16-lane step, a column count not a multiple of 4, and accumulation.
    #[test]
    fn f32_dot_products_match_f64() {
        if !has_avx512f() {
            return;
        }
        for (m, k, n, accumulate) in [(1, 5, 7, false), (2, 16, 4, true), (3, 37, 9, false), (4, 300, 13, true)] {
            WeightCase::new(m, k, n).check(0..m, accumulate, |dst, lhs, rhs| {
                // SAFETY: WeightCase's buffers hold the extents it describes.
                unsafe { skinny(0..m, n, k, dst, lhs, rhs, accumulate, true) }
            });
        }
    }
}
