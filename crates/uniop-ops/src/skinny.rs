//! GEMM for a few rows (decode: one token per sequence) when both operands are contiguous along
//! K — activations row-major, weights in HF's `[N, K]` layout. Packing would cost more than the
//! products, so each output is a dot product read straight from the operands; all rows are done
//! together, four weight rows at a time, so the weight is streamed once at memory speed however
//! many rows there are (the `gemm` crate and the packed bf16 kernel read it once per row band,
//! and slowly for so few rows).

use crate::matmul::{Dst, Mat};
use crate::packed_gemm::GemmOut;
use uniop::half::{bf16, f16};

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

/// Weight rows (output columns) one [`Dots::dots`] call multiplies at most. A call per group of
/// four rows cost a call, a setup and a reduction of its sums through memory per 3 KiB of a
/// bf16 weight; a run of them amortizes that and keeps the reductions in registers.
pub(crate) const RUN: usize = 64;

/// An element type with SIMD kernels for `R × RUN` dot products.
pub(crate) trait Dots: GemmOut {
    /// The best [`Simd`] level this CPU runs for this type.
    fn best() -> Simd;

    /// `a[i] · b_j` over `k` elements for the `cols` (at most [`RUN`]) rows `b_j` that start at
    /// `b.0` and follow each other every `b.1` elements, f32 sums in `[i][j]`, at level `simd`.
    ///
    /// # Safety
    /// Only at a level the CPU has (`simd` at or below [`Dots::best`]); every pointer valid for
    /// `k` elements.
    unsafe fn dots<const R: usize>(
        simd: Simd,
        a: [*const Self; R],
        b: (*const Self, isize),
        k: usize,
        cols: usize,
    ) -> [[f32; RUN]; R] {
        debug_assert!(cols <= RUN);
        match simd {
            #[cfg(target_arch = "x86_64")]
            Simd::Avx512 if R <= 2 => avx512_groups::<Self, R, 8>(a, b, k, cols),
            #[cfg(target_arch = "x86_64")]
            Simd::Avx512 => avx512_groups::<Self, R, 4>(a, b, k, cols),
            #[cfg(target_arch = "x86_64")]
            Simd::Avx2 => Self::dots_avx2(a, b, k, cols),
            _ => {
                let mut sums = [[0f32; RUN]; R];
                for (row, &ai) in sums.iter_mut().zip(&a) {
                    for (j, sum) in row[..cols].iter_mut().enumerate() {
                        let bj = b.0.offset(j as isize * b.1);
                        *sum = (0..k).map(|p| (*ai.add(p)).to_f32() * (*bj.add(p)).to_f32()).sum();
                    }
                }
                sums
            }
        }
    }

    /// `a[i] · b[j]` for a group of `G` rows `b` (a multiple of four) with AVX-512, their loads
    /// interleaved.
    ///
    /// # Safety
    /// As [`Dots::dots`].
    #[cfg(target_arch = "x86_64")]
    unsafe fn dots_avx512<const R: usize, const G: usize>(
        a: [*const Self; R],
        b: [*const Self; G],
        k: usize,
    ) -> [[f32; G]; R];

    /// [`Dots::dots`] with AVX2 and FMA.
    ///
    /// # Safety
    /// As [`Dots::dots`].
    #[cfg(target_arch = "x86_64")]
    unsafe fn dots_avx2<const R: usize>(
        a: [*const Self; R],
        b: (*const Self, isize),
        k: usize,
        cols: usize,
    ) -> [[f32; RUN]; R];
}

/// Rows `g..g + G` of the `cols` rows at `b` (first row, row stride), the last repeated past `cols`.
#[inline(always)]
unsafe fn group_rows<T, const G: usize>(b: (*const T, isize), g: usize, cols: usize) -> [*const T; G] {
    std::array::from_fn(|j| b.0.offset((g + j).min(cols - 1) as isize * b.1))
}

/// [`Dots::dots`] at the AVX-512 level, `G` rows of `b` at a time. A weight streamed from memory
/// comes in faster the more of its rows are read at once — up to a point: for the bf16
/// `[1, 4096] x [11008, 4096]` product (out of cache) on two Zen 4 cores, reading one row at a
/// time ran at ~40 GB/s, four at ~40, eight at ~47 (torch's ~46), sixteen at ~46; f16 went from
/// 0.8–0.9x torch to ~1.05x with eight, f32 stayed level. The sums of `R × G` must stay in registers, so eight rows
/// for one or two rows of `a`, four for more.
///
/// # Safety
/// As [`Dots::dots`], on a CPU with the type's AVX-512 level.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn avx512_groups<T: Dots, const R: usize, const G: usize>(
    a: [*const T; R],
    b: (*const T, isize),
    k: usize,
    cols: usize,
) -> [[f32; RUN]; R] {
    let mut sums = [[0f32; RUN]; R];
    // `cols` is at most RUN, a multiple of G: every group fits in a row of sums.
    for g in (0..cols).step_by(G) {
        let group = T::dots_avx512::<R, G>(a, group_rows(b, g, cols), k);
        for (row, group) in sums.iter_mut().zip(&group) {
            row[g..g + G].copy_from_slice(group);
        }
    }
    sums
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
    let mut c = 0;
    while c < n {
        let cols = RUN.min(n - c);
        let b = (rhs.ptr.offset(c as isize * rhs.cs), rhs.cs);
        let out = (dst, (rows.start, c), cols, accumulate);
        match rows.len() {
            1 => store_sums(&I::dots::<1>(simd, [a[0]], b, k, cols), out),
            2 => store_sums(&I::dots::<2>(simd, [a[0], a[1]], b, k, cols), out),
            3 => store_sums(&I::dots::<3>(simd, [a[0], a[1], a[2]], b, k, cols), out),
            _ => store_sums(&I::dots::<4>(simd, a, b, k, cols), out),
        }
        c += cols;
    }
}

/// Writes (`+=` with `accumulate`) the first `cols` of each row of `sums` to `dst` at `(row,
/// column)` onwards.
#[inline(always)]
unsafe fn store_sums<O: GemmOut, R: AsRef<[f32]>>(
    sums: &[R],
    (dst, (r0, c0), cols, accumulate): (Dst<O>, (usize, usize), usize, bool),
) {
    for (r, row) in (r0..).zip(sums) {
        let row = &row.as_ref()[..cols];
        let line = dst.ptr.offset(r as isize * dst.rs + c0 as isize * dst.cs);
        if dst.cs == 1 && O::IS_F32 {
            // Dense f32 output, such as the line path's partial sums:
            // a loop LLVM vectorizes.
            let out = std::slice::from_raw_parts_mut(line as *mut f32, cols);
            for (o, &sum) in out.iter_mut().zip(row) {
                *o = if accumulate { *o + sum } else { sum };
            }
            continue;
        }
        for (j, &sum) in row.iter().enumerate() {
            let o = line.offset(j as isize * dst.cs);
            *o = O::from_f32(if accumulate { (*o).to_f32() + sum } else { sum });
        }
    }
}

/// Whether [`skinny_lines`] takes a product of `rows` rows: few rows of a k-dense A times a B
/// dense along n (row-major `[k, n]`: attention's V in decode, a `[K, N]` weight).
pub(crate) fn applies_to_lines<T>(rows: &std::ops::Range<usize>, lhs: Mat<T>, rhs: Mat<T>) -> bool {
    rows.len() <= SKINNY_ROWS && lhs.cs == 1 && rhs.cs == 1
}

/// `dst[rows] = lhs[rows] · rhs` (`+=` with `accumulate`) for a bf16 B whose k lines are dense
/// along n, at level `simd`: every A element scales a line of B into the row's sums, a chunk of
/// columns at a time. Packing such a B into panels reads and writes all of it to multiply it
/// once — for one decode step's `P · V` that cost as much as the product (bf16 decode against
/// 2000 keys ran at 0.7x torch's SDPA).
///
/// # Safety
/// As [`crate::matmul::gemm_rows`], with [`applies_to_lines`] true.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn skinny_lines<O: GemmOut>(
    rows: std::ops::Range<usize>,
    n: usize,
    k: usize,
    dst: Dst<O>,
    lhs: Mat<bf16>,
    rhs: Mat<bf16>,
    accumulate: bool,
    simd: Simd,
) {
    debug_assert!(applies_to_lines(&rows, lhs, rhs));
    let m = rows.len();
    let a: [*const bf16; SKINNY_ROWS] =
        std::array::from_fn(|i| lhs.ptr.offset((rows.start + i.min(m - 1)) as isize * lhs.rs));
    let dst = Dst { ptr: dst.ptr.offset(rows.start as isize * dst.rs), ..dst };
    if k * n * std::mem::size_of::<bf16>() <= LINES_IN_CACHE {
        return lines_into(simd, (a, m), (rhs.ptr, rhs.rs), k, n, dst, accumulate);
    }
    // A B larger than the cache is walked a block of lines at a time across all its columns, so
    // that it streams from memory line by line (a column chunk's walk down all of k reads 128
    // bytes of each line: 7.5 GB/s for [1, 4096] x [4096, 11008]); the sums wait in f32.
    let mut sums = vec![0f32; m * n];
    let sums_dst = Dst { ptr: sums.as_mut_ptr(), rs: n as isize, cs: 1 };
    for p0 in (0..k).step_by(LINE_BLOCK) {
        let block = (a.map(|ai| ai.add(p0)), m);
        let b = (rhs.ptr.offset(p0 as isize * rhs.rs), rhs.rs);
        lines_into(simd, block, b, LINE_BLOCK.min(k - p0), n, sums_dst, p0 > 0);
    }
    for (i, row) in sums.chunks_exact(n).enumerate() {
        store_sums(&[row], (dst, (i, 0), n, accumulate));
    }
}

/// Bytes of B up to which [`skinny_lines`] walks all of k per column chunk (B then stays in cache
/// between chunks).
const LINES_IN_CACHE: usize = 1 << 20;

/// Lines per block past [`LINES_IN_CACHE`]. A block is walked a column chunk at a time, each chunk
/// reading a piece of every line of the block (128 bytes at the AVX-512 level, 32 with AVX2), so
/// the block's lines are that many streams at once: blocks of 64 lines streamed at 5–10 GB/s on a
/// Zen 3 with AVX2 and blocks of 16 at 13–26 (bf16 `[1, 2880] x [2880, 5760]` and `[1, 4096] x
/// [4096, 11008]`); on a Zen 4 with AVX512-BF16, alternated in one process, medians 1.53 against
/// 2.18 ms, 3.28 against 4.67, four rows 1.26 against 1.50 (blocks of 8 level with 16, 32 between).
const LINE_BLOCK: usize = 16;

/// `dst[..m] = a[..m] · b` (`+=` with `accumulate`) over `k` lines of `n` columns, a column chunk
/// at a time.
unsafe fn lines_into<O: GemmOut>(
    simd: Simd,
    (a, m): ([*const bf16; SKINNY_ROWS], usize),
    b: (*const bf16, isize),
    k: usize,
    n: usize,
    dst: Dst<O>,
    accumulate: bool,
) {
    let chunk = match simd {
        Simd::Avx512 => LINE_CHUNK,
        _ => LINE_CHUNK / 4,
    };
    for c in (0..n).step_by(chunk) {
        let cols = chunk.min(n - c);
        let b = (b.0.add(c), b.1);
        let out = (dst, (0, c), cols, accumulate);
        match m {
            1 => store_sums(&lines::<1>(simd, [a[0]], b, k, cols), out),
            2 => store_sums(&lines::<2>(simd, [a[0], a[1]], b, k, cols), out),
            3 => store_sums(&lines::<3>(simd, [a[0], a[1], a[2]], b, k, cols), out),
            _ => store_sums(&lines::<4>(simd, a, b, k, cols), out),
        }
    }
}

/// Columns [`lines`] sums at once at the AVX-512 level (a quarter of them with AVX2, whose 16
/// registers hold fewer sums).
const LINE_CHUNK: usize = 64;

/// `Σ_p a[i][p] · b[p][..cols]` over `k` lines of B (`b`: first element, line stride), f32
/// sums, at level `simd`; `cols` at most [`LINE_CHUNK`] (a quarter of it below AVX-512).
///
/// # Safety
/// Only at a level the CPU has for bf16; `a` valid for `k` elements, `b` for `k` lines of `cols`.
unsafe fn lines<const R: usize>(
    simd: Simd,
    a: [*const bf16; R],
    b: (*const bf16, isize),
    k: usize,
    cols: usize,
) -> [[f32; LINE_CHUNK]; R] {
    match simd {
        #[cfg(target_arch = "x86_64")]
        Simd::Avx512 => lines_avx512(a, b, k, cols),
        #[cfg(target_arch = "x86_64")]
        Simd::Avx2 => lines_avx2(a, b, k, cols),
        _ => std::array::from_fn(|i| {
            std::array::from_fn(|j| {
                let line = |p: usize| (*b.0.offset(p as isize * b.1 + j as isize)).to_f32();
                if j < cols {
                    (0..k).map(|p| (*a[i].add(p)).to_f32() * line(p)).sum()
                } else {
                    0.0
                }
            })
        }),
    }
}

/// [`lines`] on AVX512-BF16: two lines at a time, their elements interleaved into the pairs
/// `vdpbf16ps` multiplies with a pair of A elements. `vpunpck{l,h}wd` interleave within 128-bit
/// lanes, so each sum register holds its columns in that order until the end puts them back.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn lines_avx512<const R: usize>(
    a: [*const bf16; R],
    (b, bs): (*const bf16, isize),
    k: usize,
    cols: usize,
) -> [[f32; LINE_CHUNK]; R] {
    use std::arch::x86_64::*;
    let mask = |from: usize| -> __mmask32 {
        let n = cols.saturating_sub(from).min(32);
        if n == 32 {
            u32::MAX
        } else {
            (1u32 << n) - 1
        }
    };
    let masks = [mask(0), mask(32)];
    let line = |p: usize| {
        let at = b.offset(p as isize * bs) as *const i16;
        [_mm512_maskz_loadu_epi16(masks[0], at), _mm512_maskz_loadu_epi16(masks[1], at.add(32))]
    };
    let mut acc = [[_mm512_setzero_ps(); 4]; R];
    let mut step = |l0: [__m512i; 2], l1: [__m512i; 2], pairs: [__m512i; R]| {
        let v = [
            _mm512_unpacklo_epi16(l0[0], l1[0]),
            _mm512_unpackhi_epi16(l0[0], l1[0]),
            _mm512_unpacklo_epi16(l0[1], l1[1]),
            _mm512_unpackhi_epi16(l0[1], l1[1]),
        ];
        for (acc, pair) in acc.iter_mut().zip(pairs) {
            for (acc, v) in acc.iter_mut().zip(v) {
                *acc = _mm512_dpbf16_ps(
                    *acc,
                    std::mem::transmute::<__m512i, __m512bh>(pair),
                    std::mem::transmute::<__m512i, __m512bh>(v),
                );
            }
        }
    };
    let whole = k / 2 * 2;
    for p in (0..whole).step_by(2) {
        step(line(p), line(p + 1), a.map(|ai| _mm512_set1_epi32((ai.add(p) as *const i32).read_unaligned())));
    }
    if whole < k {
        // The last line pairs with zeros.
        let zero = [_mm512_setzero_si512(); 2];
        step(line(whole), zero, a.map(|ai| _mm512_set1_epi32((*ai.add(whole)).to_bits() as i32)));
    }
    // Register `lo` of a half holds columns 8q..8q+4 of each lane q, `hi` columns 8q+4..8q+8.
    let first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    let second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    acc.map(|[lo0, hi0, lo1, hi1]| {
        let mut out = [0f32; LINE_CHUNK];
        for (at, (lo, hi)) in [(0, (lo0, hi0)), (32, (lo1, hi1))] {
            _mm512_storeu_ps(out.as_mut_ptr().add(at), _mm512_permutex2var_ps(lo, first, hi));
            _mm512_storeu_ps(out.as_mut_ptr().add(at + 16), _mm512_permutex2var_ps(lo, second, hi));
        }
        out
    })
}

/// [`lines`] with AVX2 and FMA: each line's 16 columns widened to f32 by a 16-bit shift (exact).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn lines_avx2<const R: usize>(
    a: [*const bf16; R],
    (b, bs): (*const bf16, isize),
    k: usize,
    cols: usize,
) -> [[f32; LINE_CHUNK]; R] {
    use std::arch::x86_64::*;
    let widen = |v: __m128i| _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(v)));
    let mut acc = [[_mm256_setzero_ps(); 2]; R];
    let mut line = [0u16; LINE_CHUNK / 4];
    for p in 0..k {
        let at = b.offset(p as isize * bs);
        let v = if cols == line.len() {
            [_mm_loadu_si128(at as *const __m128i), _mm_loadu_si128(at.add(8) as *const __m128i)]
        } else {
            // AVX2 has no masked 16-bit loads: a ragged chunk goes through a zero-padded copy.
            std::ptr::copy_nonoverlapping(at as *const u16, line.as_mut_ptr(), cols);
            [_mm_loadu_si128(line.as_ptr() as *const __m128i), _mm_loadu_si128(line.as_ptr().add(8) as *const __m128i)]
        };
        let v = v.map(widen);
        for (acc, &ai) in acc.iter_mut().zip(&a) {
            let x = _mm256_set1_ps((*ai.add(p)).to_f32());
            for (acc, v) in acc.iter_mut().zip(v) {
                *acc = _mm256_fmadd_ps(x, v, *acc);
            }
        }
    }
    acc.map(|[lo, hi]| {
        let mut out = [0f32; LINE_CHUNK];
        _mm256_storeu_ps(out.as_mut_ptr(), lo);
        _mm256_storeu_ps(out.as_mut_ptr().add(8), hi);
        out
    })
}

impl Dots for bf16 {
    fn best() -> Simd {
        cpu().bf16
    }

    /// 32 pairs per `vdpbf16ps` (AVX512-BF16).
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    unsafe fn dots_avx512<const R: usize, const G: usize>(
        a: [*const bf16; R],
        b: [*const bf16; G],
        k: usize,
    ) -> [[f32; G]; R] {
        use std::arch::x86_64::*;
        let mut acc = [[_mm512_setzero_ps(); G]; R];
        let mut p = 0;
        while p < k {
            let mask: __mmask32 = if k - p >= 32 { u32::MAX } else { (1u32 << (k - p)) - 1 };
            let mut bv = [_mm512_setzero_si512(); G];
            for (v, &ptr) in bv.iter_mut().zip(&b) {
                *v = _mm512_maskz_loadu_epi16(mask, ptr.add(p) as *const i16);
            }
            for (acc, &ai) in acc.iter_mut().zip(&a) {
                let av: __m512bh = std::mem::transmute(_mm512_maskz_loadu_epi16(mask, ai.add(p) as *const i16));
                for (acc, &bv) in acc.iter_mut().zip(&bv) {
                    *acc = _mm512_dpbf16_ps(*acc, av, std::mem::transmute::<__m512i, __m512bh>(bv));
                }
            }
            p += 32;
        }
        lane_sums(&acc)
    }

    /// 8 lanes per FMA, each bf16 widened by a 16-bit shift (exact). The weight rows a group
    /// reads are short in decode-sized products (768 bytes for k = 384), four of them
    /// interleaved: too little of each for the hardware prefetcher to ramp up, so the loop
    /// prefetches the next group of rows as it goes.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn dots_avx2<const R: usize>(
        a: [*const bf16; R],
        b: (*const bf16, isize),
        k: usize,
        cols: usize,
    ) -> [[f32; RUN]; R] {
        use std::arch::x86_64::*;
        let load = |ptr: *const uniop::half::bf16, p: usize| {
            let halves = _mm256_cvtepu16_epi32(_mm_loadu_si128(ptr.add(p) as *const __m128i));
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(halves))
        };
        avx2_dots(a, b, k, cols, true, load)
    }
}

impl Dots for f16 {
    fn best() -> Simd {
        cpu().f16
    }

    /// 16 lanes per FMA, each f16 widened by `vcvtph2ps` (exact).
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn dots_avx512<const R: usize, const G: usize>(
        a: [*const f16; R],
        b: [*const f16; G],
        k: usize,
    ) -> [[f32; G]; R] {
        use std::arch::x86_64::*;
        avx512_dots(a, b, k, |ptr: *const f16, p: usize, mask: __mmask16| {
            _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, ptr.add(p) as *const i16))
        })
    }

    /// 8 lanes per FMA, each f16 widened by F16C's `vcvtph2ps`.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn dots_avx2<const R: usize>(
        a: [*const f16; R],
        b: (*const f16, isize),
        k: usize,
        cols: usize,
    ) -> [[f32; RUN]; R] {
        use std::arch::x86_64::*;
        let load = |ptr: *const f16, p: usize| _mm256_cvtph_ps(_mm_loadu_si128(ptr.add(p) as *const __m128i));
        avx2_dots(a, b, k, cols, true, load)
    }
}

impl Dots for f32 {
    fn best() -> Simd {
        cpu().f32
    }

    /// 16 lanes per FMA (AVX-512F).
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f")]
    unsafe fn dots_avx512<const R: usize, const G: usize>(
        a: [*const f32; R],
        b: [*const f32; G],
        k: usize,
    ) -> [[f32; G]; R] {
        use std::arch::x86_64::*;
        avx512_dots(a, b, k, |ptr: *const f32, p: usize, mask: __mmask16| _mm512_maskz_loadu_ps(mask, ptr.add(p)))
    }

    /// 8 lanes per FMA. No software prefetch: f32 rows are twice as long, and prefetching the
    /// next group of rows measured level or slower.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn dots_avx2<const R: usize>(
        a: [*const f32; R],
        b: (*const f32, isize),
        k: usize,
        cols: usize,
    ) -> [[f32; RUN]; R] {
        use std::arch::x86_64::*;
        avx2_dots(a, b, k, cols, false, |ptr: *const f32, p: usize| _mm256_loadu_ps(ptr.add(p)))
    }
}

/// The AVX-512 dot products of elements `load` widens 16 at a time to f32 (the lanes `mask` keeps,
/// zeros in the others): `a[i] · b[j]` for a group of `G` rows `b`, the last step masked.
///
/// # Safety
/// As [`Dots::dots`], inlined into a caller compiled with AVX-512F.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn avx512_dots<T, const R: usize, const G: usize>(
    a: [*const T; R],
    b: [*const T; G],
    k: usize,
    load: impl Fn(*const T, usize, std::arch::x86_64::__mmask16) -> std::arch::x86_64::__m512,
) -> [[f32; G]; R] {
    use std::arch::x86_64::*;
    let mut acc = [[_mm512_setzero_ps(); G]; R];
    let mut p = 0;
    while p < k {
        let mask: __mmask16 = if k - p >= 16 { u16::MAX } else { (1u16 << (k - p)) - 1 };
        let mut bv = [_mm512_setzero_ps(); G];
        for (v, &ptr) in bv.iter_mut().zip(&b) {
            *v = load(ptr, p, mask);
        }
        for (acc, &ai) in acc.iter_mut().zip(&a) {
            let av = load(ai, p, mask);
            for (acc, &bv) in acc.iter_mut().zip(&bv) {
                *acc = _mm512_fmadd_ps(av, bv, *acc);
            }
        }
        p += 16;
    }
    lane_sums(&acc)
}

/// Each register summed across its lanes, four registers of a row together: two interleaving
/// steps leave every 128-bit lane holding partial sums of all four, then the lanes are added
/// (about a third of the instructions of four separate reductions, which dominated 64-deep
/// products such as decode's `Q · Kᵀ` at head dim 64).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn lane_sums<const R: usize, const G: usize>(acc: &[[std::arch::x86_64::__m512; G]; R]) -> [[f32; G]; R] {
    use std::arch::x86_64::*;
    const { assert!(G.is_multiple_of(4), "registers are reduced four at a time") };
    let mut sums = [[0f32; G]; R];
    for (row, registers) in sums.iter_mut().zip(acc) {
        for (out, &[v0, v1, v2, v3]) in row.chunks_exact_mut(4).zip(registers.as_chunks::<4>().0) {
            // Per lane: [v0₀+v0₂, v1₀+v1₂, v0₁+v0₃, v1₁+v1₃], and likewise for v2, v3.
            let s01 = _mm512_castps_pd(_mm512_add_ps(_mm512_unpacklo_ps(v0, v1), _mm512_unpackhi_ps(v0, v1)));
            let s23 = _mm512_castps_pd(_mm512_add_ps(_mm512_unpacklo_ps(v2, v3), _mm512_unpackhi_ps(v2, v3)));
            // Per lane: the four registers' partial sums, in order.
            let lanes = _mm512_add_ps(
                _mm512_castpd_ps(_mm512_unpacklo_pd(s01, s23)),
                _mm512_castpd_ps(_mm512_unpackhi_pd(s01, s23)),
            );
            let half = _mm256_add_ps(
                _mm512_castps512_ps256(lanes),
                _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(lanes))),
            );
            let quarter = _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps::<1>(half));
            _mm_storeu_ps(out.as_mut_ptr(), quarter);
        }
    }
    sums
}

/// The AVX2 dot products for any element `load` widens 8 at a time to f32, a group of four `b`
/// rows at a time, prefetching the next group once per 64 bytes read when `prefetch`; the last
/// `k % 8` products are summed in scalar code (AVX2 has no masked 16-bit loads). Plain loops
/// build the register arrays: `map` and its closures, compiled without AVX2, stay out of line.
///
/// # Safety
/// As [`Dots::dots`], on a CPU with AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn avx2_dots<T: GemmOut, const R: usize>(
    a: [*const T; R],
    b: (*const T, isize),
    k: usize,
    cols: usize,
    prefetch: bool,
    load: impl Fn(*const T, usize) -> std::arch::x86_64::__m256,
) -> [[f32; RUN]; R] {
    use std::arch::x86_64::*;
    let mut sums = [[0f32; RUN]; R];
    // The next group of four rows starts this many bytes on.
    let ahead = 4 * b.1 * std::mem::size_of::<T>() as isize;
    let whole = k / 8 * 8;
    for g in (0..cols).step_by(4) {
        let rows: [_; 4] = group_rows(b, g, cols);
        let mut acc = [[_mm256_setzero_ps(); 4]; R];
        for p in (0..whole).step_by(8) {
            if prefetch && (p * std::mem::size_of::<T>()).is_multiple_of(64) {
                for &ptr in &rows {
                    _mm_prefetch::<_MM_HINT_T0>((ptr.add(p) as *const i8).wrapping_offset(ahead));
                }
            }
            let mut bv = [_mm256_setzero_ps(); 4];
            for (v, &ptr) in bv.iter_mut().zip(&rows) {
                *v = load(ptr, p);
            }
            for (acc, &ai) in acc.iter_mut().zip(&a) {
                let av = load(ai, p);
                for (acc, &bv) in acc.iter_mut().zip(&bv) {
                    *acc = _mm256_fmadd_ps(av, bv, *acc);
                }
            }
        }
        for ((sums, acc), &ai) in sums.iter_mut().zip(&acc).zip(&a) {
            // Two rounds of pairwise adds leave each 128-bit lane holding partial sums of all
            // four registers, in order; the lanes are then added.
            let s = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]), _mm256_hadd_ps(acc[2], acc[3]));
            let four = &mut sums[g..g + 4];
            _mm_storeu_ps(four.as_mut_ptr(), _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps::<1>(s)));
            for (s, &bj) in four.iter_mut().zip(&rows) {
                *s += (whole..k).map(|p| (*ai.add(p)).to_f32() * (*bj.add(p)).to_f32()).sum::<f32>();
            }
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
    f16: Simd,
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
            let f16 = match (avx512 && is_x86_feature_detected!("avx512vl"), avx2 && is_x86_feature_detected!("f16c")) {
                (true, _) => Simd::Avx512,
                (false, true) => Simd::Avx2,
                (false, false) => Simd::Scalar,
            };
            Cpu { bf16: level(avx512 && is_x86_feature_detected!("avx512bf16")), f16, f32: level(avx512) }
        }
        #[cfg(not(target_arch = "x86_64"))]
        Cpu { bf16: Simd::Scalar, f16: Simd::Scalar, f32: Simd::Scalar }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::matmul::WeightCase;

    /// f32 rows × an `[n, k]` weight, against f64 sums, at every SIMD level this CPU has: every
    /// row count, k under / at / over one 8- and 16-lane step, column counts filling part of a group,
    /// several runs of [`RUN`] columns (the last ragged), and accumulation.
    #[test]
    fn f32_dot_products_match_f64() {
        for simd in Simd::up_to(f32::best()) {
            for (m, k, n, accumulate) in [
                (1, 5, 7, false),
                (2, 16, 4, true),
                (3, 37, 9, false),
                (4, 300, 13, true),
                (1, 384, 2 * RUN + 7, false),
            ] {
                WeightCase::<f32>::new(m, k, n).check(0..m, accumulate, |dst, lhs, rhs| {
                    // SAFETY: WeightCase's buffers hold the extents it describes; `simd` runs here.
                    unsafe { skinny(0..m, n, k, dst, lhs, rhs, accumulate, simd) }
                });
            }
        }
    }

    /// f16 rows × an f16 weight, sums in f32 rounded once, at every SIMD level this CPU has for
    /// f16: k under / at / over one 8- and 16-lane step, a ragged run of columns, accumulation.
    #[test]
    fn f16_dot_products_round_their_f32_sums_once() {
        for simd in Simd::up_to(f16::best()) {
            for (m, k, n, accumulate) in
                [(1, 5, 7, true), (2, 16, 4, false), (3, 37, 9, true), (4, 1000, RUN + 5, false)]
            {
                WeightCase::<f16>::new(m, k, n).check(0..m, accumulate, |dst, lhs, rhs| {
                    // SAFETY: WeightCase's buffers hold the extents it describes; `simd` runs here.
                    unsafe { skinny(0..m, n, k, dst, lhs, rhs, accumulate, simd) }
                });
            }
        }
    }

    /// bf16 rows × a bf16 weight, sums in f32 rounded once, at every SIMD level this CPU has for
    /// bf16: k under / at / over one 32-pair step, groups of 8 and 4 rows filled in part, a ragged
    /// run of columns, accumulation.
    #[test]
    fn bf16_dot_products_round_their_f32_sums_once() {
        for simd in Simd::up_to(bf16::best()) {
            for (m, k, n, accumulate) in
                [(1, 5, 7, false), (2, 32, 3, true), (1, 77, 2 * RUN + 9, true), (3, 37, 9, false), (4, 1000, 13, true)]
            {
                WeightCase::<bf16>::new(m, k, n).check(0..m, accumulate, |dst, lhs, rhs| {
                    // SAFETY: WeightCase's buffers hold the extents it describes; `simd` runs here.
                    unsafe { skinny(0..m, n, k, dst, lhs, rhs, accumulate, simd) }
                });
            }
        }
    }
}
