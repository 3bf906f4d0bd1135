//! GEMM for a few rows (decode: one token per sequence) when both operands are contiguous along
//! K — activations row-major, weights in HF's `[N, K]` layout. Packing would cost more than the
//! products, so each output is a dot product read straight from the operands; all rows are done
//! together, four weight rows at a time, so the weight is streamed once at memory speed however
//! many rows there are (the `gemm` crate and the packed bf16 kernel read it once per row band,
//! and slowly for so few rows).

use crate::matmul::{Dst, Mat};
use crate::packed_gemm::GemmOut;
use uniop::half::bf16;

/// Rows up to which [`skinny`] is used.
pub(crate) const SKINNY_ROWS: usize = 4;

/// Whether [`skinny`] takes a product of `rows` rows with these operands.
pub(crate) fn applies<T>(rows: &std::ops::Range<usize>, lhs: Mat<T>, rhs: Mat<T>) -> bool {
    rows.len() <= SKINNY_ROWS && lhs.cs == 1 && rhs.rs == 1
}

/// The instruction set a kernel runs with, best first. Which one an element type gets depends on
/// the CPU ([`Dots::best`]); tests force each one the CPU has.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Simd {
    /// AVX-512 (for bf16: with AVX512-BF16's pair products).
    Avx512,
    /// AVX2 with FMA: 8 lanes, bf16 widened to f32 by a shift.
    Avx2,
    /// Plain Rust.
    Scalar,
}

impl Simd {
    /// The levels at or below `best`, best first: what a test can run here.
    #[cfg(test)]
    pub(crate) fn up_to(best: Simd) -> impl Iterator<Item = Simd> {
        [Simd::Avx512, Simd::Avx2, Simd::Scalar].into_iter().skip(best as usize)
    }
}

/// An element type with SIMD kernels for `R × 4` dot products.
pub(crate) trait Dots: GemmOut {
    /// The best [`Simd`] level this CPU runs for this type.
    fn best() -> Simd;

    /// `a[i] · b[j]` over `k` elements, f32 sums, at level `simd`. `ahead` is how many bytes
    /// past the `b` rows the next call's rows start (a kernel may prefetch there).
    ///
    /// # Safety
    /// Only at a level the CPU has (`simd` at or below [`Dots::best`]); every pointer valid for
    /// `k` elements.
    unsafe fn dots<const R: usize>(
        simd: Simd,
        a: [*const Self; R],
        b: [*const Self; 4],
        k: usize,
        ahead: usize,
    ) -> [[f32; 4]; R] {
        match simd {
            #[cfg(target_arch = "x86_64")]
            Simd::Avx512 => Self::dots_avx512(a, b, k),
            #[cfg(target_arch = "x86_64")]
            Simd::Avx2 => Self::dots_avx2(a, b, k, ahead),
            _ => std::array::from_fn(|i| {
                std::array::from_fn(|j| (0..k).map(|p| (*a[i].add(p)).to_f32() * (*b[j].add(p)).to_f32()).sum())
            }),
        }
    }

    /// [`Dots::dots`] with AVX-512.
    ///
    /// # Safety
    /// As [`Dots::dots`].
    #[cfg(target_arch = "x86_64")]
    unsafe fn dots_avx512<const R: usize>(a: [*const Self; R], b: [*const Self; 4], k: usize) -> [[f32; 4]; R];

    /// [`Dots::dots`] with AVX2 and FMA.
    ///
    /// # Safety
    /// As [`Dots::dots`].
    #[cfg(target_arch = "x86_64")]
    unsafe fn dots_avx2<const R: usize>(
        a: [*const Self; R],
        b: [*const Self; 4],
        k: usize,
        ahead: usize,
    ) -> [[f32; 4]; R];
}

/// `dst[rows] = lhs[rows] · rhs` (`+=` with `accumulate`), dot products at level `simd`.
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
    simd: Simd,
) {
    debug_assert!(applies(&rows, lhs, rhs));
    let a: [*const I; SKINNY_ROWS] =
        std::array::from_fn(|i| lhs.ptr.offset((rows.start + i.min(rows.len() - 1)) as isize * lhs.rs));
    // The next group of four weight rows starts this many bytes after the current one.
    let ahead = 4 * rhs.cs as usize * std::mem::size_of::<I>();
    let mut c = 0;
    while c < n {
        let cols = 4.min(n - c);
        let b = std::array::from_fn(|j| rhs.ptr.offset((c + j.min(cols - 1)) as isize * rhs.cs));
        let sums: [[f32; 4]; SKINNY_ROWS] = match rows.len() {
            1 => pad(I::dots::<1>(simd, [a[0]], b, k, ahead)),
            2 => pad(I::dots::<2>(simd, [a[0], a[1]], b, k, ahead)),
            3 => pad(I::dots::<3>(simd, [a[0], a[1], a[2]], b, k, ahead)),
            _ => I::dots::<4>(simd, a, b, k, ahead),
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
    fn best() -> Simd {
        cpu().bf16
    }

    /// 32 pairs per `vdpbf16ps` (AVX512-BF16).
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    unsafe fn dots_avx512<const R: usize>(a: [*const bf16; R], b: [*const bf16; 4], k: usize) -> [[f32; 4]; R] {
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

    /// 8 lanes per FMA, each bf16 widened by a 16-bit shift (exact). The weight rows a call
    /// reads are short in decode-sized products (768 bytes for k = 384), four of them
    /// interleaved: too little of each for the hardware prefetcher to ramp up, so the loop
    /// prefetches the next group of rows (`ahead` bytes on) as it goes.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn dots_avx2<const R: usize>(
        a: [*const bf16; R],
        b: [*const bf16; 4],
        k: usize,
        ahead: usize,
    ) -> [[f32; 4]; R] {
        use std::arch::x86_64::*;
        let load = |ptr: *const uniop::half::bf16, p: usize| {
            let halves = _mm256_cvtepu16_epi32(_mm_loadu_si128(ptr.add(p) as *const __m128i));
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(halves))
        };
        avx2_dots(a, b, k, Some(ahead), load)
    }
}

impl Dots for f32 {
    fn best() -> Simd {
        cpu().f32
    }

    /// 16 lanes per FMA (AVX-512F).
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f")]
    unsafe fn dots_avx512<const R: usize>(a: [*const f32; R], b: [*const f32; 4], k: usize) -> [[f32; 4]; R] {
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

    /// 8 lanes per FMA. No software prefetch: f32 rows are twice as long, and prefetching the
    /// next group of rows measured level or slower.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn dots_avx2<const R: usize>(
        a: [*const f32; R],
        b: [*const f32; 4],
        k: usize,
        _ahead: usize,
    ) -> [[f32; 4]; R] {
        use std::arch::x86_64::*;
        avx2_dots(a, b, k, None, |ptr: *const f32, p: usize| _mm256_loadu_ps(ptr.add(p)))
    }
}

/// The AVX2 dot products for any element `load` widens 8 at a time to f32, prefetching `ahead`
/// bytes past the `b` rows once per 64 bytes read when given; the last `k % 8` products are
/// summed in scalar code (AVX2 has no masked 16-bit loads).
///
/// # Safety
/// As [`Dots::dots`], on a CPU with AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn avx2_dots<T: GemmOut, const R: usize>(
    a: [*const T; R],
    b: [*const T; 4],
    k: usize,
    ahead: Option<usize>,
    load: impl Fn(*const T, usize) -> std::arch::x86_64::__m256,
) -> [[f32; 4]; R] {
    use std::arch::x86_64::*;
    let mut acc = [[_mm256_setzero_ps(); 4]; R];
    let whole = k / 8 * 8;
    for p in (0..whole).step_by(8) {
        if let Some(ahead) = ahead.filter(|_| (p * std::mem::size_of::<T>()).is_multiple_of(64)) {
            for &ptr in &b {
                _mm_prefetch::<_MM_HINT_T0>((ptr.add(p) as *const i8).wrapping_add(ahead));
            }
        }
        let bv = b.map(|ptr| load(ptr, p));
        for (acc, &ai) in acc.iter_mut().zip(&a) {
            let av = load(ai, p);
            for (acc, &bv) in acc.iter_mut().zip(&bv) {
                *acc = _mm256_fmadd_ps(av, bv, *acc);
            }
        }
    }
    let sum = |v: __m256| {
        let half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let pair = _mm_add_ps(half, _mm_movehl_ps(half, half));
        _mm_cvtss_f32(_mm_add_ss(pair, _mm_movehdup_ps(pair)))
    };
    let mut sums = acc.map(|row| row.map(sum));
    for (row, &ai) in sums.iter_mut().zip(&a) {
        for (s, &bj) in row.iter_mut().zip(&b) {
            *s += (whole..k).map(|p| (*ai.add(p)).to_f32() * (*bj.add(p)).to_f32()).sum::<f32>();
        }
    }
    sums
}

/// Whether the CPU has AVX-512 F and BW (the f32 kernels' top level), from the one detection.
pub(crate) fn has_avx512() -> bool {
    matches!(cpu().f32, Simd::Avx512)
}

/// What the CPU runs, detected once.
struct Cpu {
    bf16: Simd,
    f32: Simd,
}

fn cpu() -> &'static Cpu {
    static DETECTED: std::sync::OnceLock<Cpu> = std::sync::OnceLock::new();
    DETECTED.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            let avx2 = is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma");
            let avx512 = is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw");
            let level = |top: bool| match (top, avx2) {
                (true, _) => Simd::Avx512,
                (false, true) => Simd::Avx2,
                (false, false) => Simd::Scalar,
            };
            Cpu { bf16: level(avx512 && is_x86_feature_detected!("avx512bf16")), f32: level(avx512) }
        }
        #[cfg(not(target_arch = "x86_64"))]
        Cpu { bf16: Simd::Scalar, f32: Simd::Scalar }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::matmul::WeightCase;

    /// f32 rows × an `[n, k]` weight, against f64 sums, at every SIMD level this CPU has: every
    /// row count, k under / at / over one 8- and 16-lane step, a column count not a multiple of 4,
    /// and accumulation.
    #[test]
    fn f32_dot_products_match_f64() {
        for simd in Simd::up_to(f32::best()) {
            for (m, k, n, accumulate) in [(1, 5, 7, false), (2, 16, 4, true), (3, 37, 9, false), (4, 300, 13, true)] {
                WeightCase::new(m, k, n).check(0..m, accumulate, |dst, lhs, rhs| {
                    // SAFETY: WeightCase's buffers hold the extents it describes; `simd` runs here.
                    unsafe { skinny(0..m, n, k, dst, lhs, rhs, accumulate, simd) }
                });
            }
        }
    }
}
