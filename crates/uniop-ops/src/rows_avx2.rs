//! Row passes on AVX2 CPUs without AVX-512, for f32 and bf16 rows, with every value in
//! registers: softmax's (the maximum, the exps and their sum, the scaled store), RMSNorm's (the
//! sum of squares, the residual add that feeds it, the weighted store), softmax_backward's and
//! log_softmax_backward's rows, rope's rows, and elementwise maps over dense runs ([`map`]).
//!
//! Why a second form: the generic passes work in steps of [`LANES`](crate::elementwise::LANES)
//! (four AVX-512 registers), and were tuned where a step's values fit the register file. Built for
//! AVX2 (16 registers of 8 lanes) the exp pass kept its row pointer on the stack and reloaded its
//! eight constants every 16 elements, rope's steps (six operands of 64 lanes) spilled throughout,
//! and the streaming stores staged each step through two stack arrays (f32 results, then narrowed
//! ones) before copying them out 16 bytes at a time. Here the passes take 16 or 32 elements an
//! iteration (two or four 8-lane chains; two-output maps 64), constants hoisted, and every store
//! narrows 16 lanes in registers and writes them with one 32-byte store (streamed when asked).
//! Softmax, log_softmax, causal_softmax, cross_entropy, embedding_backward's row scaling, rms_norm,
//! add_rms_norm, rope, rope_backward, the softmax backwards and `elementwise::dense_map`'s runs
//! (those of `elementwise::unary` and `binary` too: silu, gelu, mul, silu_mul, swiglu,
//! log_softmax's store, their gradients, …; two-output maps in bf16 only) go through these where
//! they apply ([`applies`]); f16 rows, and AVX-512 CPUs, keep the generic passes.
//!
//! The arithmetic is the generic passes' own: [`exp`](crate::math::exp)'s and
//! [`exp_coarse`](crate::math::exp_coarse)'s formulas (chosen by the element type, as
//! [`exp_for`](crate::math::exp_for)), bf16's round-to-nearest-even with NaNs kept quiet,
//! `x · rstd · w` in that order, rope's rotation lane by lane, and each map's own scalar closure.
//! Sums are taken in a different order (and squares summed with FMA), so they may differ in the
//! last bit. Rows end in 8-lane steps ([`Row::load_part`], [`Row::store_part`]), and softmax rows
//! shorter than a step run in one pass of their own ([`short_rows`]).

use crate::elementwise::Ahead;
use crate::math;
use crate::rope::{self, Mode, Rotation};
use std::arch::x86_64::*;
use uniop::dtype::{bf16x16_avx2, bf16x16_even_odd_avx2};
use uniop::half::bf16;
use uniop::{DType, FloatElement};

/// Elements per iteration: two halves of 16 lanes, one 64-byte line of bf16.
const STEP: usize = 32;

/// Whether the passes here run for rows of `T`: f32 or bf16, on a CPU with AVX2 and FMA but no
/// AVX-512 (whose generic passes are the tuned ones).
#[inline(always)]
pub(crate) fn applies<T: FloatElement>() -> bool {
    matches!(T::DTYPE, DType::F32 | DType::BF16) && can_run() && !std::arch::is_x86_feature_detected!("avx512f")
}

/// Whether this CPU can run the passes here (AVX2, FMA, and F16C for [`map`]): what their safety
/// needs. Tests run them wherever it can, AVX-512 CPUs included, though kernels there take the
/// generic passes.
#[inline(always)]
fn can_run() -> bool {
    use std::arch::is_x86_feature_detected as has;
    has!("avx2") && has!("fma") && has!("f16c")
}

/// An element type whose rows the passes here (and the AVX2 GEMM's output tiles) read and write,
/// 8 lanes at a time.
pub(crate) trait Row: FloatElement {
    /// The 8 elements at `p`, widened to f32.
    unsafe fn load8(p: *const Self) -> __m256;
    /// 16 f32 lanes narrowed to `Self` and stored at `p`; past the cache when `streaming`, where
    /// `p` must be 32-byte aligned.
    unsafe fn store16(p: *mut Self, low: __m256, high: __m256, streaming: bool);
    /// 16 f32 lanes narrowed to `Self` and stored at `p` (ordinary stores), returned as stored:
    /// rounded to `Self`, widened back.
    unsafe fn store16_rounded(p: *mut Self, low: __m256, high: __m256) -> [__m256; 2];
    /// The 16 elements at `p`, widened to f32 in an order of lanes [`Row::store16_in_lanes`]
    /// undoes (bf16: the even elements, by one shift, and the odd ones, by one mask — no
    /// shuffle), for passes where each result lane takes the same lane of every operand.
    unsafe fn load16_in_lanes(p: *const Self) -> [__m256; 2];
    /// Lanes of [`Row::load16_in_lanes`]'s order narrowed and stored at `p` in element order; past
    /// the cache when `streaming`, where `p` must be 32-byte aligned.
    unsafe fn store16_in_lanes(p: *mut Self, low: __m256, high: __m256, streaming: bool);
    /// Whether [`Row::load16_in_lanes`] gives the even elements, then the odd ones: each pair
    /// `(2j, 2j + 1)` is then lane `j` of the two registers.
    const EVEN_ODD: bool;
    /// The `len` (at most 8) elements at `p` widened into lanes `0..len`, `fill` in the others:
    /// a row's last elements as one vector step ([`lanes_below`]).
    unsafe fn load_part(p: *const Self, len: usize, fill: f32) -> __m256;
    /// Lanes `0..len` (at most 8) of `v` narrowed and stored at `p`.
    unsafe fn store_part(p: *mut Self, v: __m256, len: usize);
}

/// The lanes below `len` set (all bits), the others clear.
///
/// Why rows end in vector steps: a short row — a router's softmax over 8 to 31 experts, a few
/// dozen keys a head — is mostly or wholly the tail past the passes' 32-element steps, and element
/// by element (a scalar exp each) f32 softmax over `[8192, 20]` took 4x the time of `[8192, 32]`.
#[inline(always)]
unsafe fn lanes_below(len: usize) -> __m256i {
    _mm256_cmpgt_epi32(_mm256_set1_epi32(len as i32), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7))
}

impl Row for f32 {
    const EVEN_ODD: bool = false;
    #[inline(always)]
    unsafe fn load8(p: *const f32) -> __m256 {
        _mm256_loadu_ps(p)
    }
    #[inline(always)]
    unsafe fn store16(p: *mut f32, low: __m256, high: __m256, streaming: bool) {
        if streaming {
            _mm256_stream_ps(p, low);
            _mm256_stream_ps(p.add(8), high);
        } else {
            _mm256_storeu_ps(p, low);
            _mm256_storeu_ps(p.add(8), high);
        }
    }
    #[inline(always)]
    unsafe fn store16_rounded(p: *mut f32, low: __m256, high: __m256) -> [__m256; 2] {
        Self::store16(p, low, high, false);
        [low, high]
    }
    #[inline(always)]
    unsafe fn load16_in_lanes(p: *const f32) -> [__m256; 2] {
        [_mm256_loadu_ps(p), _mm256_loadu_ps(p.add(8))]
    }
    #[inline(always)]
    unsafe fn store16_in_lanes(p: *mut f32, low: __m256, high: __m256, streaming: bool) {
        Self::store16(p, low, high, streaming)
    }
    #[inline(always)]
    unsafe fn load_part(p: *const f32, len: usize, fill: f32) -> __m256 {
        let mask = lanes_below(len);
        _mm256_blendv_ps(_mm256_set1_ps(fill), _mm256_maskload_ps(p, mask), _mm256_castsi256_ps(mask))
    }
    /// In pieces of 4, 2 and 1 lanes (masked stores are slow on AMD's cores).
    #[inline(always)]
    unsafe fn store_part(p: *mut f32, v: __m256, len: usize) {
        if len == 8 {
            _mm256_storeu_ps(p, v);
            return;
        }
        let (mut part, mut at) = (_mm256_castps256_ps128(v), 0);
        if len >= 4 {
            _mm_storeu_ps(p, part);
            (part, at) = (_mm256_extractf128_ps::<1>(v), 4);
        }
        if len - at >= 2 {
            _mm_storel_epi64(p.add(at) as *mut __m128i, _mm_castps_si128(part));
            (part, at) = (_mm_movehl_ps(part, part), at + 2);
        }
        if len > at {
            _mm_store_ss(p.add(at), part);
        }
    }
}

impl Row for bf16 {
    const EVEN_ODD: bool = true;
    #[inline(always)]
    unsafe fn load8(p: *const bf16) -> __m256 {
        widen8(_mm_loadu_si128(p as *const __m128i))
    }
    #[inline(always)]
    unsafe fn store16(p: *mut bf16, low: __m256, high: __m256, streaming: bool) {
        store_bf16x16(p, bf16x16_avx2(low, high), streaming)
    }
    #[inline(always)]
    unsafe fn load16_in_lanes(p: *const bf16) -> [__m256; 2] {
        let v = _mm256_loadu_si256(p as *const __m256i);
        // A bf16 is the top half of its f32: below it, zeros. Element 2j is the low half of
        // 32-bit lane j, element 2j + 1 its high half.
        let high_half = _mm256_set1_epi32(0xffff_0000_u32 as i32);
        [_mm256_slli_epi32::<16>(v), _mm256_and_si256(v, high_half)].map(|f| _mm256_castsi256_ps(f))
    }
    #[inline(always)]
    unsafe fn store16_in_lanes(p: *mut bf16, low: __m256, high: __m256, streaming: bool) {
        store_bf16x16(p, bf16x16_even_odd_avx2(low, high), streaming)
    }
    #[inline(always)]
    unsafe fn store16_rounded(p: *mut bf16, low: __m256, high: __m256) -> [__m256; 2] {
        let v = bf16x16_avx2(low, high);
        _mm256_storeu_si256(p as *mut __m256i, v);
        [widen8(_mm256_castsi256_si128(v)), widen8(_mm256_extracti128_si256::<1>(v))]
    }
    /// AVX2 has no masked 16-bit loads: the pairs by a masked 32-bit load, an odd last element
    /// blended in.
    #[inline(always)]
    unsafe fn load_part(p: *const bf16, len: usize, fill: f32) -> __m256 {
        let mut v = _mm_maskload_epi32(p as *const i32, _mm256_castsi256_si128(lanes_below(len / 2)));
        if len % 2 == 1 {
            let last = _mm_set1_epi16((*p.add(len - 1)).to_bits() as i16);
            v = _mm_blendv_epi8(
                v,
                last,
                _mm_cmpeq_epi16(_mm_set1_epi16(len as i16 - 1), _mm_setr_epi16(0, 1, 2, 3, 4, 5, 6, 7)),
            );
        }
        _mm256_blendv_ps(_mm256_set1_ps(fill), widen8(v), _mm256_castsi256_ps(lanes_below(len)))
    }
    /// In pieces of 8, 4, 2 and 1 lanes (masked stores are slow on AMD's cores).
    #[inline(always)]
    unsafe fn store_part(p: *mut bf16, v: __m256, len: usize) {
        let (mut part, mut at) = (_mm256_castsi256_si128(bf16x16_avx2(v, v)), 0);
        if len == 8 {
            _mm_storeu_si128(p as *mut __m128i, part);
            return;
        }
        if len >= 4 {
            _mm_storel_epi64(p as *mut __m128i, part);
            (part, at) = (_mm_srli_si128::<8>(part), 4);
        }
        if len - at >= 2 {
            (p.add(at) as *mut i32).write_unaligned(_mm_cvtsi128_si32(part));
            (part, at) = (_mm_srli_si128::<4>(part), at + 2);
        }
        if len > at {
            (p.add(at) as *mut u16).write_unaligned(_mm_cvtsi128_si32(part) as u16);
        }
    }
}

/// 16 bf16 stored at `p`; past the cache when `streaming` (`p` 32-byte aligned).
#[inline(always)]
unsafe fn store_bf16x16(p: *mut bf16, v: __m256i, streaming: bool) {
    if streaming {
        _mm256_stream_si256(p as *mut __m256i, v);
    } else {
        _mm256_storeu_si256(p as *mut __m256i, v);
    }
}

/// 8 bf16 as f32 lanes.
#[inline(always)]
unsafe fn widen8(eight: __m128i) -> __m256 {
    _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(eight)))
}

/// e^x for 8 lanes (NaN kept): [`exp_coarse`](crate::math::exp_coarse)'s formula when `COARSE`,
/// else [`exp`](crate::math::exp)'s, bit for bit. The upper clamp of the scalar forms only when
/// `HIGH`: softmax's callers subtract their row's maximum first (`x ≤ 0`).
#[inline(always)]
unsafe fn exp8<const COARSE: bool, const HIGH: bool>(x: __m256) -> __m256 {
    let c = _mm256_set1_ps;
    let shift = c(math::EXP_SHIFT);
    // max(lo, x) and min(hi, x) return x where x is NaN.
    let x = _mm256_max_ps(c(math::EXP_LOW), x);
    let x = if HIGH { _mm256_min_ps(c(88.0), x) } else { x };
    let shifted = _mm256_fmadd_ps(x, c(std::f32::consts::LOG2_E), shift);
    let k = _mm256_sub_ps(shifted, shift);
    let t = if COARSE {
        let r = _mm256_fnmadd_ps(k, c(std::f32::consts::LN_2), x);
        let r2 = _mm256_mul_ps(r, r);
        let q = _mm256_fmadd_ps(c(4.127_732e-2), r2, _mm256_fmadd_ps(c(1.675_342_8e-1), r, c(0.500_051_1)));
        _mm256_fmadd_ps(q, r2, r)
    } else {
        let r = _mm256_fnmadd_ps(k, c(0.693_359_4), x);
        let r = _mm256_fnmadd_ps(k, c(-2.121_944_4e-4), r);
        let r2 = _mm256_mul_ps(r, r);
        let lo = _mm256_fmadd_ps(c(1.666_666_5e-1), r, c(0.5));
        let mid = _mm256_fmadd_ps(c(8.333_452e-3), r, c(4.166_579_6e-2));
        let hi = _mm256_fmadd_ps(c(1.987_569_1e-4), r, c(1.398_199_9e-3));
        let p = _mm256_fmadd_ps(_mm256_fmadd_ps(hi, r2, mid), r2, lo);
        _mm256_fmadd_ps(p, r2, r)
    };
    // As `math::times_pow2`: (1 + t)·2^k, 2^k from the exponent bits k + 127 (0 at the clamp).
    let bias = _mm256_set1_epi32(math::POW2_BIAS as i32);
    let scale = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_sub_epi32(_mm256_castps_si256(shifted), bias)));
    _mm256_fmadd_ps(t, scale, scale)
}

/// The sum of `v`'s 8 lanes.
#[inline(always)]
pub(crate) unsafe fn sum8(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)))
}

/// `row`'s maximum (NaN elements skipped), as `softmax::row_max`.
#[target_feature(enable = "avx2,fma")]
unsafe fn row_max_in<T: Row>(row: &[T]) -> f32 {
    let p = row.as_ptr();
    let mut mx = [_mm256_set1_ps(f32::NEG_INFINITY); 4];
    let whole = row.len() / STEP * STEP;
    for i in (0..whole).step_by(STEP) {
        for (j, m) in mx.iter_mut().enumerate() {
            // max(a, m) keeps m where a is NaN.
            *m = _mm256_max_ps(T::load8(p.add(i + 8 * j)), *m);
        }
    }
    let mut m = _mm256_max_ps(_mm256_max_ps(mx[0], mx[1]), _mm256_max_ps(mx[2], mx[3]));
    for i in (whole..row.len()).step_by(8) {
        let len = (row.len() - i).min(8);
        let v = if len == 8 { T::load8(p.add(i)) } else { T::load_part(p.add(i), len, f32::NEG_INFINITY) };
        m = _mm256_max_ps(v, m);
    }
    let mut lanes = [0f32; 8];
    _mm256_storeu_ps(lanes.as_mut_ptr(), m);
    lanes.into_iter().fold(f32::NEG_INFINITY, |m, v| if v > m { v } else { m })
}

/// `Σ exp(row − m)`, the exps stored in `out` when `STORE` (lanes past the row too, up to the
/// next multiple of 8, where `out` has room); prefetches `next` as it goes (see
/// `softmax::exp_into`).
#[target_feature(enable = "avx2,fma")]
unsafe fn exp_sum_in<T: Row, const STORE: bool>(row: &[T], out: &mut [f32], m: f32, next: &[T]) -> f32 {
    let coarse = T::DTYPE.size() == 2;
    let (p, o) = (row.as_ptr(), out.as_mut_ptr());
    let whole = row.len() / STEP * STEP;
    let mut ahead = Ahead::new(next, whole / STEP);
    let mb = _mm256_set1_ps(m);
    let mut acc = [_mm256_setzero_ps(); 2];
    for i in (0..whole).step_by(STEP) {
        ahead.step();
        for half in (i..i + STEP).step_by(16) {
            for (j, a) in acc.iter_mut().enumerate() {
                let x = _mm256_sub_ps(T::load8(p.add(half + 8 * j)), mb);
                let e = if coarse { exp8::<true, false>(x) } else { exp8::<false, false>(x) };
                *a = _mm256_add_ps(*a, e);
                if STORE {
                    _mm256_storeu_ps(o.add(half + 8 * j), e);
                }
            }
        }
    }
    for i in (whole..row.len()).step_by(8) {
        let len = (row.len() - i).min(8);
        let x = _mm256_sub_ps(if len == 8 { T::load8(p.add(i)) } else { T::load_part(p.add(i), len, m) }, mb);
        let e = if coarse { exp8::<true, false>(x) } else { exp8::<false, false>(x) };
        // Lanes past the row (filled with m: e^0) are left out of the sum.
        acc[0] = _mm256_add_ps(acc[0], _mm256_and_ps(e, _mm256_castsi256_ps(lanes_below(len))));
        if STORE && i + 8 <= out.len() {
            _mm256_storeu_ps(o.add(i), e);
        } else if STORE {
            f32::store_part(o.add(i), e, len);
        }
    }
    sum8(_mm256_add_ps(acc[0], acc[1]))
}

/// `out = src · scale`, narrowed to `T` (`src` at least as long as `out`: lanes past it are read
/// up to the next multiple of 8, where it has them); past the cache when `streaming` and `out` is
/// 32-byte aligned (as rows of an aligned tensor are; otherwise with ordinary stores).
#[target_feature(enable = "avx2,fma")]
unsafe fn scale_in<T: Row>(src: &[f32], out: &mut [T], scale: f32, streaming: bool) {
    let streaming = streaming && (out.as_ptr() as usize).is_multiple_of(32);
    let (s, o) = (src.as_ptr(), out.as_mut_ptr());
    let whole = out.len() / 16 * 16;
    let sc = _mm256_set1_ps(scale);
    for i in (0..whole).step_by(16) {
        let low = _mm256_mul_ps(_mm256_loadu_ps(s.add(i)), sc);
        let high = _mm256_mul_ps(_mm256_loadu_ps(s.add(i + 8)), sc);
        T::store16(o.add(i), low, high, streaming);
    }
    for i in (whole..out.len()).step_by(8) {
        let len = (out.len() - i).min(8);
        let v = if i + 8 <= src.len() { _mm256_loadu_ps(s.add(i)) } else { f32::load_part(s.add(i), len, 0.0) };
        T::store_part(o.add(i), _mm256_mul_ps(v, sc), len);
    }
}

/// The longest rows [`short_rows`] takes: shorter than one of the row passes' steps, so that
/// they run wholly in the passes' 8-lane tail loops, whose order of sums it keeps.
pub(crate) const SHORT_ROW: usize = STEP - 1;

/// Softmax, or log_softmax when `LOG`, of rows of `n` (at most [`SHORT_ROW`]) elements, up to four
/// vectors a row: what [`row_max`], [`exp_sum`] and the scaled (or shifted) store give row by row,
/// bit for bit, in one loop with no calls or scratch between them. A row that short is a chain of
/// dependent steps (maximum, exps, sum, reciprocal) with little work in each; here the core
/// overlaps consecutive rows' chains, which the three passes' calls per row kept apart.
///
/// log_softmax's rows go in groups of [`LOG_GROUP`]: each row's maximum and sum, then the group's
/// logarithms, then the rows' stores. The logarithm (libm's, as the row passes take) was half of
/// a row's time when taken row by row, between one row's sum and the next row's loads.
#[target_feature(enable = "avx2,fma")]
unsafe fn short_rows_in<T: Row, const LOG: bool>(x: &[T], out: &mut [T], n: usize) {
    let parts = n.div_ceil(8);
    let part_len = |j: usize| if j + 1 < parts { 8 } else { n - 8 * j };
    let load = |p: *const T, j: usize| match part_len(j) {
        8 => T::load8(p.add(8 * j)),
        len => T::load_part(p.add(8 * j), len, f32::NEG_INFINITY),
    };
    if LOG {
        let mut shifts = [0f32; LOG_GROUP];
        for (rows, outs) in x.chunks(LOG_GROUP * n).zip(out.chunks_mut(LOG_GROUP * n)) {
            let mut sums = [0f32; LOG_GROUP];
            for ((row, m), sum) in rows.chunks_exact(n).zip(&mut shifts).zip(&mut sums) {
                (*m, *sum) = short_row_exps(row.as_ptr(), parts, &load, &mut [_mm256_setzero_ps(); 4]);
            }
            for (m, sum) in shifts.iter_mut().zip(sums) {
                *m += sum.ln();
            }
            for ((row, o), shift) in rows.chunks_exact(n).zip(outs.chunks_exact_mut(n)).zip(shifts) {
                let by = _mm256_set1_ps(shift);
                for j in 0..parts {
                    let y = _mm256_sub_ps(load(row.as_ptr(), j), by);
                    T::store_part(o.as_mut_ptr().add(8 * j), y, part_len(j));
                }
            }
        }
        return;
    }
    for (row, o) in x.chunks_exact(n).zip(out.chunks_exact_mut(n)) {
        let mut e = [_mm256_setzero_ps(); 4];
        let (_, sum) = short_row_exps(row.as_ptr(), parts, &load, &mut e);
        let by = _mm256_set1_ps(1.0 / sum);
        for j in 0..parts {
            T::store_part(o.as_mut_ptr().add(8 * j), _mm256_mul_ps(e[j], by), part_len(j));
        }
    }
}

/// How many short log_softmax rows [`short_rows_in`] takes between logarithms.
const LOG_GROUP: usize = 16;

/// One short row's maximum `m` and `Σ exp(x − m)` over its `parts` vectors (by `load`, lanes past
/// the row −∞, so their exps are 0), the exps left in `e`: [`row_max`]'s maximum and
/// [`exp_sum`]'s exps and sum, bit for bit. (A row whose maximum is −∞ holds only −∞ and NaN
/// elements; its sum is NaN either way.)
#[inline(always)]
unsafe fn short_row_exps<T: Row>(
    p: *const T,
    parts: usize,
    load: &impl Fn(*const T, usize) -> __m256,
    e: &mut [__m256; 4],
) -> (f32, f32) {
    let coarse = T::DTYPE.size() == 2;
    let mut v = [_mm256_setzero_ps(); 4];
    let mut mx = _mm256_set1_ps(f32::NEG_INFINITY);
    for (j, v) in v[..parts].iter_mut().enumerate() {
        *v = load(p, j);
        mx = _mm256_max_ps(*v, mx);
    }
    let mut lanes = [0f32; 8];
    _mm256_storeu_ps(lanes.as_mut_ptr(), mx);
    // As `row_max_in`: NaN elements skipped.
    let m = lanes.into_iter().fold(f32::NEG_INFINITY, |m, v| if v > m { v } else { m });
    let mb = _mm256_set1_ps(m);
    let mut acc = _mm256_setzero_ps();
    for j in 0..parts {
        let shifted = _mm256_sub_ps(v[j], mb);
        e[j] = if coarse { exp8::<true, false>(shifted) } else { exp8::<false, false>(shifted) };
        acc = _mm256_add_ps(acc, e[j]);
    }
    (m, sum8(acc))
}

/// The squares of four 8-lane groups added into `acc` (group `j` into `acc[j]`): the one order in
/// which [`sum_squares_in`] and [`add_in`] sum, so add_rms_norm's squares equal rms_norm's of
/// the same stored row.
#[inline(always)]
unsafe fn square_step(acc: &mut [__m256; 4], groups: [__m256; 4]) {
    for (a, v) in acc.iter_mut().zip(groups) {
        *a = _mm256_fmadd_ps(v, v, *a);
    }
}

/// The sum of `acc`'s lanes and of the squares of `tail`'s elements.
#[inline(always)]
unsafe fn total<T: Row>(acc: [__m256; 4], tail: &[T]) -> f32 {
    let lanes = sum8(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
    lanes + tail.iter().map(|v| v.to_f32() * v.to_f32()).sum::<f32>()
}

/// `Σ x²` over `row`, as `rms_norm::sum_squares`.
#[target_feature(enable = "avx2,fma")]
unsafe fn sum_squares_in<T: Row>(row: &[T]) -> f32 {
    let p = row.as_ptr();
    let whole = row.len() / STEP * STEP;
    let mut acc = [_mm256_setzero_ps(); 4];
    for i in (0..whole).step_by(STEP) {
        square_step(&mut acc, [0, 1, 2, 3].map(|j| T::load8(p.add(i + 8 * j))));
    }
    total(acc, &row[whole..])
}

/// `out = a + b`, rounded to `T`, and `Σ out²` of the stored values, as add_rms_norm's `add_row`.
#[target_feature(enable = "avx2,fma")]
unsafe fn add_in<T: Row>(a: &[T], b: &[T], out: &mut [T]) -> f32 {
    let (pa, pb, po) = (a.as_ptr(), b.as_ptr(), out.as_mut_ptr());
    let whole = a.len() / STEP * STEP;
    let mut acc = [_mm256_setzero_ps(); 4];
    for i in (0..whole).step_by(STEP) {
        let sum = |k: usize| _mm256_add_ps(T::load8(pa.add(k)), T::load8(pb.add(k)));
        let [s0, s1] = T::store16_rounded(po.add(i), sum(i), sum(i + 8));
        let [s2, s3] = T::store16_rounded(po.add(i + 16), sum(i + 16), sum(i + 24));
        square_step(&mut acc, [s0, s1, s2, s3]);
    }
    for k in whole..a.len() {
        out[k] = T::from_f32(a[k].to_f32() + b[k].to_f32());
    }
    total(acc, &out[whole..])
}

/// `y = x · rstd · w`, narrowed to `T`, prefetching `next`; past the cache when `streaming` and
/// `y` is 32-byte aligned. As `rms_norm::scale_row`, in the same order (bit for bit).
#[target_feature(enable = "avx2,fma")]
unsafe fn scale_weighted_in<T: Row>(x: &[T], next: &[T], w: &[f32], y: &mut [T], rstd: f32, streaming: bool) {
    let streaming = streaming && (y.as_ptr() as usize).is_multiple_of(32);
    let (px, pw, py) = (x.as_ptr(), w.as_ptr(), y.as_mut_ptr());
    let whole = x.len() / 16 * 16;
    let mut ahead = Ahead::new(next, whole / STEP);
    let r = _mm256_set1_ps(rstd);
    for i in (0..whole).step_by(16) {
        if i % STEP == 0 {
            ahead.step();
        }
        let scaled = |k: usize| _mm256_mul_ps(_mm256_mul_ps(T::load8(px.add(k)), r), _mm256_loadu_ps(pw.add(k)));
        T::store16(py.add(i), scaled(i), scaled(i + 8), streaming);
    }
    for k in whole..x.len() {
        y[k] = T::from_f32(x[k].to_f32() * rstd * w[k]);
    }
}

/// One row of rope (`x`, `out`: the head dim; `cos`, `sin`: the tables' width), as
/// `rope::rotate_row`: 16 elements of a rotated span an iteration, in [`rope::rotate`]'s
/// arithmetic lane by lane (bit for bit). Mode `half` rotates 8-lane groups of the two halves
/// against each other, in [`Row::load16_in_lanes`]'s order where `cos`/`sin` are of `x`'s type
/// (bf16 `[1, 32, 2048, 128]`, Zen 3: two threads 1.48–1.52 → 1.22–1.51 ms, one thread
/// 2.91–2.98 → 2.43–2.62; the loop was bound by its widening's and narrowing's shifts and
/// shuffles); with one value per pair both halves read the first half's tables. `interleave` in
/// bf16 with bf16 tables takes the even elements against the odd ones in that order, as mode
/// `half` its halves (in cache, one thread, `[1, 8, 64, 128]`: 0.025 → 0.020 ms, its inverse 0.028
/// → 0.020), a pair's table value in both; otherwise it swaps each 8-lane group's pairs in the
/// register and takes `x·cos ∓ swapped·sin` with one `addsub` (its inverse with an add, a subtract
/// and a blend: a negated product would flip the sign of NaN results), per-pair tables spread to
/// both lanes of their pair by a permute. Past the cache when `streaming` and every 16-element
/// store lands 32-byte aligned (`out` aligned; in mode `half`, the second half too).
#[target_feature(enable = "avx2,fma")]
unsafe fn rotate_in<T: Row, C: Row>(x: &[T], cos: &[C], sin: &[C], out: &mut [T], rot: Rotation, streaming: bool) {
    let (r, inverse) = (rot.rotary_dim(cos.len()), rot.inverse);
    let second_half_aligned = rot.mode == Mode::Interleave || (r / 2 * size_of::<T>()).is_multiple_of(32);
    let streaming = streaming && (out.as_ptr() as usize).is_multiple_of(32) && second_half_aligned;
    let (px, pc, ps, po) = (x.as_ptr(), cos.as_ptr(), sin.as_ptr(), out.as_mut_ptr());
    let mul = |a, b| _mm256_mul_ps(a, b);
    // The pair (j, k) rotated by the scalar rotation with the tables at (tj, tk): the spans' tails
    // past the last whole step. `out` is passed, not captured, so no borrow of it outlives the
    // vector loops' pointer writes.
    let rotate_pair = |out: &mut [T], (j, k): (usize, usize), (tj, tk): (usize, usize)| {
        let [a, b] = [x[j], x[k]].map(|v| v.to_f32());
        let [ca, sa, cb, sb] = [cos[tj], sin[tj], cos[tk], sin[tk]].map(|v| v.to_f32());
        let (o, o2) = rope::rotate(a, b, ca, sa, cb, sb, inverse);
        (out[j], out[k]) = (T::from_f32(o), T::from_f32(o2));
    };
    // Pairs (a, b) of 8 lanes each rotated by their own cos and sin.
    let rotate = |[a, b, ca, sa, cb, sb]: [__m256; 6]| {
        if inverse {
            [_mm256_add_ps(mul(a, ca), mul(b, sb)), _mm256_sub_ps(mul(b, cb), mul(a, sa))]
        } else {
            [_mm256_sub_ps(mul(a, ca), mul(b, sa)), _mm256_add_ps(mul(b, cb), mul(a, sb))]
        }
    };
    match rot.mode {
        Mode::Half => {
            let h = r / 2;
            let whole = h / 16 * 16;
            // The second half's tables: their own, or the first half's (one value per pair).
            let second = if rot.per_pair { 0 } else { h };
            if T::DTYPE == C::DTYPE {
                // Every operand widened in the same order of lanes (for bf16 the cheaper one).
                let (pc, ps) = (pc as *const T, ps as *const T);
                for i in (0..whole).step_by(16) {
                    let (a, b) = (T::load16_in_lanes(px.add(i)), T::load16_in_lanes(px.add(h + i)));
                    let (ca, sa) = (T::load16_in_lanes(pc.add(i)), T::load16_in_lanes(ps.add(i)));
                    let (cb, sb) = (T::load16_in_lanes(pc.add(second + i)), T::load16_in_lanes(ps.add(second + i)));
                    let [low, low2] = rotate([a[0], b[0], ca[0], sa[0], cb[0], sb[0]]);
                    let [high, high2] = rotate([a[1], b[1], ca[1], sa[1], cb[1], sb[1]]);
                    T::store16_in_lanes(po.add(i), low, high, streaming);
                    T::store16_in_lanes(po.add(h + i), low2, high2, streaming);
                }
            } else {
                for i in (0..whole).step_by(16) {
                    let pair = |g: usize| {
                        let (a, b) = (T::load8(px.add(g)), T::load8(px.add(h + g)));
                        let (ca, sa) = (C::load8(pc.add(g)), C::load8(ps.add(g)));
                        let (cb, sb) = (C::load8(pc.add(second + g)), C::load8(ps.add(second + g)));
                        rotate([a, b, ca, sa, cb, sb])
                    };
                    let ([low, low2], [high, high2]) = (pair(i), pair(i + 8));
                    T::store16(po.add(i), low, high, streaming);
                    T::store16(po.add(h + i), low2, high2, streaming);
                }
            }
            for k in whole..h {
                rotate_pair(out, (k, h + k), (k, second + k));
            }
        }
        Mode::Interleave => {
            let whole = r / 16 * 16;
            if T::EVEN_ODD && T::DTYPE == C::DTYPE {
                // The even and odd elements in two registers: each pair is one lane of both,
                // rotated as in mode `half`, with no permute.
                let (pc, ps) = (pc as *const T, ps as *const T);
                for i in (0..whole).step_by(16) {
                    let [a, b] = T::load16_in_lanes(px.add(i));
                    let ([ca, cb], [sa, sb]) = if rot.per_pair {
                        let (c, s) = (T::load8(pc.add(i / 2)), T::load8(ps.add(i / 2)));
                        ([c, c], [s, s])
                    } else {
                        (T::load16_in_lanes(pc.add(i)), T::load16_in_lanes(ps.add(i)))
                    };
                    let [even, odd] = rotate([a, b, ca, sa, cb, sb]);
                    T::store16_in_lanes(po.add(i), even, odd, streaming);
                }
            } else {
                // Swaps each pair of lanes: [a, b, …] → [b, a, …].
                const SWAP: i32 = 0b10_11_00_01;
                // Takes the odd lanes from the second operand.
                const ODD: i32 = 0b1010_1010;
                let group = |v: __m256, c: __m256, s: __m256| {
                    let swapped = _mm256_permute_ps::<SWAP>(v);
                    if inverse {
                        // With each lane's partner's sine: even lanes a·ca + b·sb, odd ones
                        // b·cb − a·sa.
                        let (p, q) = (mul(v, c), mul(swapped, _mm256_permute_ps::<SWAP>(s)));
                        _mm256_blend_ps::<ODD>(_mm256_add_ps(p, q), _mm256_sub_ps(p, q))
                    } else {
                        // `addsub`: even lanes a·ca − b·sa, odd ones b·cb + a·sb.
                        _mm256_addsub_ps(mul(v, c), mul(swapped, s))
                    }
                };
                // Pair values 0-3 and 4-7 each spread to both lanes of their pair.
                let (low_pairs, high_pairs) =
                    (_mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3), _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7));
                for i in (0..whole).step_by(16) {
                    let (v, v2) = (T::load8(px.add(i)), T::load8(px.add(i + 8)));
                    let [low, high] = if rot.per_pair {
                        let (c, s) = (C::load8(pc.add(i / 2)), C::load8(ps.add(i / 2)));
                        let spread = |t, lanes| _mm256_permutevar8x32_ps(t, lanes);
                        [
                            group(v, spread(c, low_pairs), spread(s, low_pairs)),
                            group(v2, spread(c, high_pairs), spread(s, high_pairs)),
                        ]
                    } else {
                        [
                            group(v, C::load8(pc.add(i)), C::load8(ps.add(i))),
                            group(v2, C::load8(pc.add(i + 8)), C::load8(ps.add(i + 8))),
                        ]
                    };
                    T::store16(po.add(i), low, high, streaming);
                }
            }
            for k in (whole..r).step_by(2) {
                let tables = if rot.per_pair { (k / 2, k / 2) } else { (k, k + 1) };
                rotate_pair(out, (k, k + 1), tables);
            }
        }
    }
    out[r..].copy_from_slice(&x[r..]);
}

/// softmax_backward's `Σ dy·y` over a row, or log_softmax_backward's `Σ dy` when `LOG`, 32
/// elements an iteration in [`Row::load16_in_lanes`]'s order (a sum's order is free).
#[target_feature(enable = "avx2,fma")]
unsafe fn grad_dot_in<T: Row, const LOG: bool>(dy: &[T], y: &[T]) -> f32 {
    let (pd, py) = (dy.as_ptr(), y.as_ptr());
    let whole = dy.len() / STEP * STEP;
    let mut acc = [_mm256_setzero_ps(); 4];
    for i in (0..whole).step_by(STEP) {
        for (h, pair) in acc.chunks_exact_mut(2).enumerate() {
            let d = T::load16_in_lanes(pd.add(i + 16 * h));
            let v = if LOG { d } else { T::load16_in_lanes(py.add(i + 16 * h)) };
            for j in 0..2 {
                pair[j] = if LOG { _mm256_add_ps(pair[j], d[j]) } else { _mm256_fmadd_ps(d[j], v[j], pair[j]) };
            }
        }
    }
    for i in (whole..dy.len()).step_by(8) {
        // Lanes past the row read 0: they add nothing.
        let len = (dy.len() - i).min(8);
        let d = T::load_part(pd.add(i), len, 0.0);
        acc[0] =
            if LOG { _mm256_add_ps(acc[0], d) } else { _mm256_fmadd_ps(d, T::load_part(py.add(i), len, 0.0), acc[0]) };
    }
    fold_sums(acc)
}

/// The sum of four accumulators' lanes, in [`grad_dot_in`]'s order.
#[inline(always)]
unsafe fn fold_sums(acc: [__m256; 4]) -> f32 {
    sum8(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])))
}

/// One 8-lane step of the backward's store, given the row's sum `dot` in every lane:
/// `y · (dy − dot)`, or `dy − exp(y) · dot` when `LOG` (exp as [`exp_for`](crate::math::exp_for)).
#[inline(always)]
unsafe fn grad8<T: Row, const LOG: bool>(d: __m256, v: __m256, dot: __m256) -> __m256 {
    if !LOG {
        _mm256_mul_ps(v, _mm256_sub_ps(d, dot))
    } else {
        let e = if T::DTYPE.size() == 2 { exp8::<true, true>(v) } else { exp8::<false, true>(v) };
        _mm256_sub_ps(d, _mm256_mul_ps(e, dot))
    }
}

/// One row of the backward: `dot` by [`grad_dot_in`], then `dx = y · (dy − dot)`, or
/// `dx = dy − exp(y) · dot` when `LOG` (exp as [`exp_for`](crate::math::exp_for)), narrowed to
/// `T`, 16 elements an iteration in [`Row::load16_in_lanes`]'s order; given the dot, bit for bit
/// the generic map's.
/// Past the cache when `streaming` and `dx` is 32-byte aligned.
#[target_feature(enable = "avx2,fma")]
unsafe fn softmax_grad_in<T: Row, const LOG: bool>(dy: &[T], y: &[T], dx: &mut [T], streaming: bool) {
    let dot = grad_dot_in::<T, LOG>(dy, y);
    let streaming = streaming && (dx.as_ptr() as usize).is_multiple_of(32);
    let (pd, py, po) = (dy.as_ptr(), y.as_ptr(), dx.as_mut_ptr());
    let whole = dy.len() / 16 * 16;
    let s = _mm256_set1_ps(dot);
    let grad = |d, v| grad8::<T, LOG>(d, v, s);
    for i in (0..whole).step_by(16) {
        let ([d0, d1], [v0, v1]) = (T::load16_in_lanes(pd.add(i)), T::load16_in_lanes(py.add(i)));
        T::store16_in_lanes(po.add(i), grad(d0, v0), grad(d1, v1), streaming);
    }
    for i in (whole..dy.len()).step_by(8) {
        let len = (dy.len() - i).min(8);
        let (d, v) = (T::load_part(pd.add(i), len, 0.0), T::load_part(py.add(i), len, 0.0));
        T::store_part(po.add(i), grad(d, v), len);
    }
}

/// softmax_backward, or log_softmax_backward when `LOG`, of rows of `n` (at most [`SHORT_ROW`])
/// elements, up to four vectors a row: what [`softmax_grad_in`] gives row by row, bit for bit (for
/// rows this short its sum and store run wholly in their 8-lane tails), in one loop with no call
/// between a row's sum and its store, so that the core overlaps consecutive rows (as
/// [`short_rows_in`] does for the forward).
#[target_feature(enable = "avx2,fma")]
unsafe fn short_grad_rows_in<T: Row, const LOG: bool>(dy: &[T], y: &[T], dx: &mut [T], n: usize) {
    let parts = n.div_ceil(8);
    let part_len = |j: usize| if j + 1 < parts { 8 } else { n - 8 * j };
    let zero = _mm256_setzero_ps();
    for ((dr, yr), o) in dy.chunks_exact(n).zip(y.chunks_exact(n)).zip(dx.chunks_exact_mut(n)) {
        let (pd, py) = (dr.as_ptr(), yr.as_ptr());
        let (mut d, mut v) = ([zero; 4], [zero; 4]);
        let mut acc = zero;
        for j in 0..parts {
            // Lanes past the row read 0: they add nothing.
            (d[j], v[j]) = match part_len(j) {
                8 => (T::load8(pd.add(8 * j)), T::load8(py.add(8 * j))),
                len => (T::load_part(pd.add(8 * j), len, 0.0), T::load_part(py.add(8 * j), len, 0.0)),
            };
            acc = if LOG { _mm256_add_ps(acc, d[j]) } else { _mm256_fmadd_ps(d[j], v[j], acc) };
        }
        // grad_dot_in's fold, its zero accumulators too (−0 + 0 is +0: a zero sum's sign matches).
        let dot = _mm256_set1_ps(fold_sums([acc, zero, zero, zero]));
        for j in 0..parts {
            T::store_part(o.as_mut_ptr().add(8 * j), grad8::<T, LOG>(d[j], v[j], dot), part_len(j));
        }
    }
}

/// `f` elementwise over dense runs (`I` inputs, `O` outputs, all as long), narrowed to `T`, `W`
/// elements an iteration (a multiple of 16) in [`Row::load16_in_lanes`]'s order: `f` runs on each
/// lane's values, and LLVM vectorizes that loop to 8-lane chains. Bit for bit the generic map's.
/// Past the cache when `streaming`, from the first element where every output is 32-byte aligned
/// (a block's share of a tensor starts anywhere, and with ordinary stores each output line is read
/// before it is written).
/// `f16c` is enabled because the kernels that pass `f` in are built with it: a closure built for
/// features its caller lacks is not inlined.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn map_in<T: Row, const I: usize, const O: usize, const W: usize>(
    ins: [&[T]; I],
    mut outs: [&mut [T]; O],
    streaming: bool,
    f: &impl Fn([f32; I]) -> [f32; O],
) {
    const { assert!(W.is_multiple_of(16), "W is whole 16-lane loads and stores") };
    let n = outs[0].len();
    let one = |outs: &mut [&mut [T]; O], k: usize| {
        let mut x = [0f32; I];
        for (x, run) in x.iter_mut().zip(&ins) {
            *x = run[k].to_f32();
        }
        for (out, r) in outs.iter_mut().zip(f(x)) {
            out[k] = T::from_f32(r);
        }
    };
    let aligned_from = |out: &[T]| (out.as_ptr() as usize).wrapping_neg() % 32 / size_of::<T>();
    let head = aligned_from(outs[0]).min(n);
    let streaming =
        streaming && outs.iter().all(|out| (out.as_ptr() as usize + head * size_of::<T>()).is_multiple_of(32));
    let head = if streaming { head } else { 0 };
    (0..head).for_each(|k| one(&mut outs, k));
    let whole = head + (n - head) / W * W;
    for i in (head..whole).step_by(W) {
        let mut wide = [[0f32; W]; I];
        for (wide, run) in wide.iter_mut().zip(&ins) {
            for h in (0..W).step_by(16) {
                let [low, high] = T::load16_in_lanes(run.as_ptr().add(i + h));
                _mm256_storeu_ps(wide.as_mut_ptr().add(h), low);
                _mm256_storeu_ps(wide.as_mut_ptr().add(h + 8), high);
            }
        }
        let mut results = [[0f32; W]; O];
        for j in 0..W {
            let mut x = [0f32; I];
            for (x, wide) in x.iter_mut().zip(&wide) {
                *x = wide[j];
            }
            for (result, r) in results.iter_mut().zip(f(x)) {
                result[j] = r;
            }
        }
        for (out, r) in outs.iter_mut().zip(&results) {
            for h in (0..W).step_by(16) {
                let (low, high) = (_mm256_loadu_ps(r.as_ptr().add(h)), _mm256_loadu_ps(r.as_ptr().add(h + 8)));
                T::store16_in_lanes(out.as_mut_ptr().add(i + h), low, high, streaming);
            }
        }
    }
    (whole..n).for_each(|k| one(&mut outs, k));
}

/// `slice` as a slice of `U`, which is `T` (checked by dtype).
#[inline(always)]
fn same<T: FloatElement, U: FloatElement>(slice: &[T]) -> &[U] {
    assert!(T::DTYPE == U::DTYPE);
    // SAFETY: T and U are the same type (one FloatElement per dtype).
    unsafe { std::slice::from_raw_parts(slice.as_ptr() as *const U, slice.len()) }
}

/// [`same`] for a mutable slice.
#[inline(always)]
fn same_mut<T: FloatElement, U: FloatElement>(slice: &mut [T]) -> &mut [U] {
    assert!(T::DTYPE == U::DTYPE);
    // SAFETY: as in `same`.
    unsafe { std::slice::from_raw_parts_mut(slice.as_mut_ptr() as *mut U, slice.len()) }
}

/// `row`'s maximum. Only for f32 and bf16 rows (see [`applies`]).
#[inline(always)]
pub(crate) fn row_max<T: FloatElement>(row: &[T]) -> f32 {
    assert!(can_run());
    // SAFETY (each arm): the CPU has AVX2 and FMA (asserted just above).
    match T::DTYPE {
        DType::BF16 => unsafe { row_max_in::<bf16>(same(row)) },
        _ => unsafe { row_max_in::<f32>(same(row)) },
    }
}

/// `Σ exp(row − m)`, the exps stored in `out` (at least as long as `row`) when `STORE`. Only for
/// f32 and bf16 rows (see [`applies`]).
#[inline(always)]
pub(crate) fn exp_sum<T: FloatElement, const STORE: bool>(row: &[T], out: &mut [f32], m: f32, next: &[T]) -> f32 {
    assert!(can_run());
    if STORE {
        assert!(out.len() >= row.len());
    }
    // SAFETY (each arm): as in `row_max`; `out` is at least as long as `row` where it is written.
    match T::DTYPE {
        DType::BF16 => unsafe { exp_sum_in::<bf16, STORE>(same(row), out, m, same(next)) },
        _ => unsafe { exp_sum_in::<f32, STORE>(same(row), out, m, same(next)) },
    }
}

/// `out = src · scale`, narrowed to `T` (`src` at least as long as `out`). Only for f32 and bf16
/// rows (see [`applies`]).
#[inline(always)]
pub(crate) fn scale_into<T: FloatElement>(src: &[f32], out: &mut [T], scale: f32, streaming: bool) {
    assert!(can_run());
    assert!(src.len() >= out.len());
    // SAFETY (each arm): as in `row_max`; `src` holds every element read.
    match T::DTYPE {
        DType::BF16 => unsafe { scale_in::<bf16>(src, same_mut(out), scale, streaming) },
        _ => unsafe { scale_in::<f32>(src, same_mut(out), scale, streaming) },
    }
}

/// `Σ x²` over `row`. Only for f32 and bf16 rows (see [`applies`]).
#[inline(always)]
pub(crate) fn sum_squares<T: FloatElement>(row: &[T]) -> f32 {
    assert!(can_run());
    // SAFETY (each arm): as in `row_max`.
    match T::DTYPE {
        DType::BF16 => unsafe { sum_squares_in::<bf16>(same(row)) },
        _ => unsafe { sum_squares_in::<f32>(same(row)) },
    }
}

/// `out = a + b` rounded to `T`, returning `Σ out²` (all three as long). Only for f32 and bf16
/// rows (see [`applies`]).
#[inline(always)]
pub(crate) fn add_squares<T: FloatElement>(a: &[T], b: &[T], out: &mut [T]) -> f32 {
    assert!(can_run());
    assert!(a.len() == b.len() && a.len() == out.len());
    // SAFETY (each arm): as in `row_max`; the lengths are equal.
    match T::DTYPE {
        DType::BF16 => unsafe { add_in::<bf16>(same(a), same(b), same_mut(out)) },
        _ => unsafe { add_in::<f32>(same(a), same(b), same_mut(out)) },
    }
}

/// `y = x · rstd · w` narrowed to `T` (`x`, `w` and `y` as long), prefetching `next`. Only for
/// f32 and bf16 rows (see [`applies`]).
#[inline(always)]
pub(crate) fn scale_weighted<T: FloatElement>(x: &[T], next: &[T], w: &[f32], y: &mut [T], rstd: f32, streaming: bool) {
    assert!(can_run());
    assert!(x.len() == w.len() && x.len() == y.len());
    // SAFETY (each arm): as in `row_max`; the lengths are equal.
    match T::DTYPE {
        DType::BF16 => unsafe { scale_weighted_in::<bf16>(same(x), same(next), w, same_mut(y), rstd, streaming) },
        _ => unsafe { scale_weighted_in::<f32>(same(x), same(next), w, same_mut(y), rstd, streaming) },
    }
}

/// One row of rope, as `rope::rotate_row` (`x` and `out` as long, `cos` and `sin` as long and no
/// longer), past the cache when `streaming` (where the stores align). Only for f32 and bf16 rows
/// (see [`applies`]), with `cos`/`sin` in `T` or f32.
#[inline(always)]
pub(crate) fn rotate<T: FloatElement, C: FloatElement>(
    x: &[T],
    cos: &[C],
    sin: &[C],
    out: &mut [T],
    rot: Rotation,
    streaming: bool,
) {
    assert!(can_run());
    let r = rot.rotary_dim(cos.len());
    assert!(x.len() == out.len() && cos.len() == sin.len() && r <= x.len() && r.is_multiple_of(2));
    // SAFETY (each arm): as in `row_max`; the lengths are as `rotate_in` reads and writes them.
    match (T::DTYPE, C::DTYPE) {
        (DType::BF16, DType::BF16) => unsafe {
            rotate_in::<bf16, bf16>(same(x), same(cos), same(sin), same_mut(out), rot, streaming)
        },
        (DType::BF16, _) => unsafe {
            rotate_in::<bf16, f32>(same(x), same(cos), same(sin), same_mut(out), rot, streaming)
        },
        _ => unsafe { rotate_in::<f32, f32>(same(x), same(cos), same(sin), same_mut(out), rot, streaming) },
    }
}

/// Softmax (`log` false) or log_softmax of the rows of `x` (`n` elements each, at most
/// [`SHORT_ROW`]) into `out`, as long. Only for f32 and bf16 rows (see [`applies`]).
#[inline(always)]
pub(crate) fn short_rows<T: FloatElement>(x: &[T], out: &mut [T], n: usize, log: bool) {
    assert!(can_run());
    assert!((1..=SHORT_ROW).contains(&n) && x.len() == out.len() && x.len().is_multiple_of(n));
    // SAFETY (each arm): as in `row_max`; rows of n ≤ SHORT_ROW elements, as many in `out` as in `x`.
    match (T::DTYPE, log) {
        (DType::BF16, false) => unsafe { short_rows_in::<bf16, false>(same(x), same_mut(out), n) },
        (DType::BF16, true) => unsafe { short_rows_in::<bf16, true>(same(x), same_mut(out), n) },
        (_, false) => unsafe { short_rows_in::<f32, false>(same(x), same_mut(out), n) },
        (_, true) => unsafe { short_rows_in::<f32, true>(same(x), same_mut(out), n) },
    }
}

/// One row of softmax_backward (`log` false) or log_softmax_backward (`log` true): the sum, then
/// `dx` narrowed to `T` (`dy`, `y` and `dx` as long), past the cache when `streaming`. Only for f32
/// and bf16 rows (see [`applies`]).
#[inline(always)]
pub(crate) fn softmax_grad<T: FloatElement>(dy: &[T], y: &[T], dx: &mut [T], log: bool, streaming: bool) {
    assert!(can_run());
    assert!(dy.len() == y.len() && dy.len() == dx.len());
    // SAFETY (each arm): as in `row_max`; the lengths are equal.
    match (T::DTYPE, log) {
        (DType::BF16, false) => unsafe { softmax_grad_in::<bf16, false>(same(dy), same(y), same_mut(dx), streaming) },
        (DType::BF16, true) => unsafe { softmax_grad_in::<bf16, true>(same(dy), same(y), same_mut(dx), streaming) },
        (_, false) => unsafe { softmax_grad_in::<f32, false>(same(dy), same(y), same_mut(dx), streaming) },
        (_, true) => unsafe { softmax_grad_in::<f32, true>(same(dy), same(y), same_mut(dx), streaming) },
    }
}

/// softmax_backward (`log` false) or log_softmax_backward of the rows of `dy` and `y` (`n` elements
/// each, at most [`SHORT_ROW`]) into `dx`, all as long. Only for f32 and bf16 rows (see
/// [`applies`]).
#[inline(always)]
pub(crate) fn short_grad_rows<T: FloatElement>(dy: &[T], y: &[T], dx: &mut [T], n: usize, log: bool) {
    assert!(can_run());
    assert!((1..=SHORT_ROW).contains(&n) && dy.len() == y.len() && dy.len() == dx.len());
    assert!(dy.len().is_multiple_of(n));
    // SAFETY (each arm): as in `row_max`; rows of n ≤ SHORT_ROW elements, as many in each slice.
    match (T::DTYPE, log) {
        (DType::BF16, false) => unsafe { short_grad_rows_in::<bf16, false>(same(dy), same(y), same_mut(dx), n) },
        (DType::BF16, true) => unsafe { short_grad_rows_in::<bf16, true>(same(dy), same(y), same_mut(dx), n) },
        (_, false) => unsafe { short_grad_rows_in::<f32, false>(same(dy), same(y), same_mut(dx), n) },
        (_, true) => unsafe { short_grad_rows_in::<f32, true>(same(dy), same(y), same_mut(dx), n) },
    }
}

/// `f` elementwise over dense runs (all as long), narrowed to `T`, past the cache when
/// `streaming`: [`elementwise::dense_map`](crate::elementwise::dense_map)'s pass on AVX2. Only for
/// f32 and bf16 (see [`applies`]).
///
/// One-output maps take 16 elements an iteration, two chains (the width that keeps a three-input
/// map's operands in registers). Two-output maps take 64. Against the staged form, bf16
/// silu_mul_backward (4096x11008, Zen 3, two threads, alternated) ran slower at 16 (40.6-52.1 ->
/// 46.0-56.7 ms), level at 32, faster at 64 (33.8-41.2 -> 28.2-32.0 ms; in cache, one thread,
/// 64x4096: 0.316 -> 0.216), and bf16 swiglu_backward 43.1-50.3 -> 30.6-31.8 at 64 (64x8192 in
/// cache: 0.330-0.337 -> 0.217-0.220). The likely cause, not proven: at 64 each output gets two
/// whole lines in a row, where at 16 it got half a line between the other output's.
#[inline(always)]
pub(crate) fn map<T: FloatElement, const I: usize, const O: usize>(
    ins: [&[T]; I],
    outs: [&mut [T]; O],
    streaming: bool,
    f: &impl Fn([f32; I]) -> [f32; O],
) {
    assert!(can_run());
    let n = outs[0].len();
    assert!(ins.iter().all(|run| run.len() == n) && outs.iter().all(|out| out.len() == n));
    // SAFETY (each arm): as in `row_max` (`can_run` checks F16C too); the lengths are equal.
    match T::DTYPE {
        DType::BF16 if O > 1 => unsafe { map_in::<bf16, I, O, 64>(ins.map(same), outs.map(same_mut), streaming, f) },
        DType::BF16 => unsafe { map_in::<bf16, I, O, 16>(ins.map(same), outs.map(same_mut), streaming, f) },
        _ if O > 1 => unsafe { map_in::<f32, I, O, 64>(ins.map(same), outs.map(same_mut), streaming, f) },
        _ => unsafe { map_in::<f32, I, O, 16>(ins.map(same), outs.map(same_mut), streaming, f) },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::elementwise::Aligned;
    use crate::math;

    /// Row lengths around the step sizes (16-lane stores, 32-element exp steps), every length of a
    /// last part vector (1 to 7 lanes, alone and after whole steps) and a long one.
    const LENGTHS: &[usize] = &[0, 1, 2, 3, 5, 6, 7, 8, 13, 15, 16, 17, 20, 31, 32, 33, 42, 63, 64, 100, 4101];

    /// Values spread over ±`spread` (deterministic), as `T`.
    fn row<T: FloatElement>(n: usize, spread: f32, seed: u32) -> Vec<T> {
        let mut state = seed.wrapping_mul(2_654_435_761) | 1;
        (0..n)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 17;
                state ^= state << 5;
                T::from_f32((state as f32 / u32::MAX as f32 * 2.0 - 1.0) * spread)
            })
            .collect()
    }

    /// `values` with NaN, ±∞, −0 and values past both exp clamps at every third element from the
    /// start, in rows long enough to keep most values ordinary.
    fn with_specials<T: FloatElement>(mut values: Vec<T>) -> Vec<T> {
        if values.len() > 20 {
            for (k, v) in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, -0.0, 89.0, -89.0].into_iter().enumerate() {
                values[3 * k] = T::from_f32(v);
            }
        }
        values
    }

    fn check_passes<T: FloatElement>(exp_tolerance: f64) {
        for &n in LENGTHS {
            for spread in [1.0, 30.0, 200.0] {
                let x: Vec<T> = row(n, spread, n as u32 + spread as u32);
                let wide: Vec<f64> = x.iter().map(|v| v.to_f32() as f64).collect();
                let m = row_max(&x);
                assert_eq!(m as f64, wide.iter().cloned().fold(f64::NEG_INFINITY, f64::max), "max, n {n}");
                let mut exps = vec![0f32; n];
                let next: Vec<T> = row(n, 1.0, 7);
                let sum = exp_sum::<T, true>(&x, &mut exps, m, &next);
                // A padded scratch row takes the same exps (and anything past the row).
                let mut padded = vec![0f32; n.next_multiple_of(8)];
                assert_eq!(exp_sum::<T, true>(&x, &mut padded, m, &next).to_bits(), sum.to_bits());
                assert_eq!(bits(padded[..n].iter().copied()), bits(exps.iter().copied()), "padded exps, n {n}");
                // The kernels subtract in f32, as here; the exps are then compared with f64's.
                let want: Vec<f64> = x.iter().map(|v| ((v.to_f32() - m) as f64).exp()).collect();
                for (k, (&e, &w)) in exps.iter().zip(&want).enumerate() {
                    // Relative, except where e^x falls below f32's normal range (the clamp).
                    assert!((e as f64 - w).abs() <= exp_tolerance * w + 1e-37, "exp {k} of {n}: {e} vs {w}");
                }
                let want_sum: f64 = want.iter().sum();
                assert!((sum as f64 - want_sum).abs() <= 1e-5 * want_sum, "sum, n {n}: {sum} vs {want_sum}");
                assert_eq!(exp_sum::<T, false>(&x, &mut [], m, &[]).to_bits(), sum.to_bits());
            }
        }
    }

    #[test]
    fn max_exps_and_sums_match_f64() {
        if !can_run() {
            return; // no AVX2 and FMA: the generic passes are all there is
        }
        check_passes::<f32>(4e-7);
        check_passes::<bf16>(1.2e-5);
    }

    /// `scale_into` stores exactly what the scalar narrowing gives, streamed or not, at an
    /// aligned and a misaligned destination (the latter with ordinary stores). The scale is exact
    /// (0.5), so chosen inputs land on bf16 rounding ties.
    fn check_scale<T: FloatElement>() {
        for &n in LENGTHS {
            let mut src: Vec<f32> = row::<f32>(n, 3.0, n as u32);
            if n > 20 {
                src[3] = f32::NAN;
                src[17] = f32::from_bits(0x7f80_0001); // a signalling NaN, quieted
                src[18] = f32::INFINITY;
                // Halved, bf16 rounding ties: to even downwards (1), and upwards (1 + 2⁻⁶).
                src[19] = 2.0 * (1.0 + 2f32.powi(-8));
                src[20] = 2.0 * (1.0 + 3.0 * 2f32.powi(-8));
            }
            let want = bits(src.iter().map(|&v| T::from_f32(v * 0.5)));
            each_destination::<T>(n, want.clone(), |out, streaming| scale_into(&src, out, 0.5, streaming));
            // From a longer (padded) source, its first n.
            let mut padded = src.clone();
            padded.resize(n.next_multiple_of(8), f32::NAN);
            each_destination::<T>(n, want, |out, streaming| scale_into(&padded, out, 0.5, streaming));
        }
    }

    /// Runs `store` into a zeroed destination of `n` elements, streamed and not, 32-byte aligned
    /// and one element past that (where the stores are ordinary ones), and checks that it holds
    /// `want` (the values' f32 bits) each time, and that the 16 elements past it are still zero.
    fn each_destination<T: FloatElement>(n: usize, want: Vec<u32>, mut store: impl FnMut(&mut [T], bool)) {
        for streaming in [false, true] {
            for misalign in [0, 1] {
                let mut backing = vec![Aligned([0u8; 64]); (n + 64) * T::DTYPE.size() / 64 + 1];
                let bytes = backing.as_mut_ptr() as *mut T;
                // SAFETY: the backing holds n + 1 + slack elements of T, zeroed (a valid T).
                let out = unsafe { std::slice::from_raw_parts_mut(bytes.add(misalign), n) };
                store(out, streaming);
                crate::elementwise::fence();
                let got: Vec<u32> = out.iter().map(|v| v.to_f32().to_bits()).collect();
                assert_eq!(got, want, "n {n}, streaming {streaming}, misalign {misalign}");
                // SAFETY: as above; the backing holds at least 64 elements past the destination.
                let past = unsafe { std::slice::from_raw_parts(bytes.add(misalign + n), 16) };
                assert!(past.iter().all(|v| v.to_f32().to_bits() == 0), "written past n {n}");
            }
        }
    }

    fn bits<T: FloatElement>(values: impl IntoIterator<Item = T>) -> Vec<u32> {
        values.into_iter().map(|v| v.to_f32().to_bits()).collect()
    }

    /// RMSNorm's passes: the sum of squares against f64's; the residual add stores the scalar
    /// rounding of each sum and returns exactly `sum_squares` of what it stored; the weighted
    /// store equals the scalar `T::from_f32(x · rstd · w)` bit for bit (NaN and ∞ weights too).
    fn check_norm_passes<T: FloatElement>() {
        for &n in LENGTHS {
            let (a, b): (Vec<T>, Vec<T>) = (row(n, 3.0, n as u32), row(n, 3.0, n as u32 + 1));
            let want: f64 = a.iter().map(|v| (v.to_f32() as f64).powi(2)).sum();
            let squares = sum_squares(&a);
            assert!((squares as f64 - want).abs() <= 1e-5 * want, "squares, n {n}: {squares} vs {want}");

            let mut sum = vec![T::default(); n];
            let sum_squares_returned = add_squares(&a, &b, &mut sum);
            assert_eq!(
                bits(sum.iter().copied()),
                bits(a.iter().zip(&b).map(|(x, y)| T::from_f32(x.to_f32() + y.to_f32())))
            );
            assert_eq!(sum_squares_returned.to_bits(), sum_squares(&sum).to_bits(), "add's squares, n {n}");

            let mut w: Vec<f32> = row(n, 2.0, 99);
            if n > 20 {
                w[5] = f32::NAN;
                w[17] = f32::INFINITY;
            }
            let rstd = 0.37;
            let want = bits(a.iter().zip(&w).map(|(x, w)| T::from_f32(x.to_f32() * rstd * w)));
            each_destination::<T>(n, want, |out, streaming| scale_weighted(&a, &b, &w, out, rstd, streaming));
        }
    }

    /// Rope's pass gives the generic row's bits, for both modes, both directions, tables per
    /// element and per pair, cos/sin in `T` and in f32, rotary dims around the 16-lane steps,
    /// partial rotary (pass-through) included, streamed and not, aligned and not.
    fn check_rotate<T: FloatElement, C: FloatElement>() {
        for r in [0, 2, 14, 16, 18, 30, 32, 34, 64, 96, 128, 130] {
            for d in [r, r + 6] {
                let x: Vec<T> = row(d, 4.0, (r + d) as u32);
                for per_pair in [false, true] {
                    let w = if per_pair { r / 2 } else { r };
                    let (cos, sin): (Vec<C>, Vec<C>) = (row(w, 1.0, 3), row(w, 1.0, 5));
                    for (mode, inverse) in
                        [Mode::Half, Mode::Interleave].into_iter().flat_map(|m| [(m, false), (m, true)])
                    {
                        let rot = Rotation { mode, per_pair, inverse };
                        let mut want = vec![T::default(); d];
                        rope::rotate_row::<T, C, { crate::elementwise::LANES }, false>(&x, &cos, &sin, &mut want, rot);
                        let store = |out: &mut [T], streaming| rotate(&x, &cos, &sin, out, rot, streaming);
                        each_destination::<T>(d, bits(want), store);
                    }
                }
            }
        }
    }

    #[test]
    fn rope_rows_match_the_generic_ones() {
        if !can_run() {
            return;
        }
        check_rotate::<f32, f32>();
        check_rotate::<bf16, bf16>();
        check_rotate::<bf16, f32>();
    }

    /// Rows of up to SHORT_ROW elements in one pass give what the row passes give row by row, bit for bit
    /// (softmax: exps, their sum, the scaled store; log_softmax: `x − (m + ln Σ)`), specials too.
    fn check_short_rows<T: FloatElement>() {
        for n in 1..=SHORT_ROW {
            let mut x: Vec<T> = row(n * 37, 20.0, n as u32);
            for (k, v) in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, -0.0, 89.0, -89.0].into_iter().enumerate() {
                x[5 * n + k % n] = T::from_f32(v);
            }
            x[30 * n..31 * n].fill(T::from_f32(f32::NEG_INFINITY));
            for log in [false, true] {
                let mut want = vec![T::default(); x.len()];
                for (r, o) in x.chunks_exact(n).zip(want.chunks_exact_mut(n)) {
                    let m = row_max(r);
                    if log {
                        let shift = m + exp_sum::<T, false>(r, &mut [], m, &[]).ln();
                        for (o, v) in o.iter_mut().zip(r) {
                            *o = T::from_f32(v.to_f32() - shift);
                        }
                    } else {
                        let mut exps = vec![0f32; n];
                        let sum = exp_sum::<T, true>(r, &mut exps, m, &[]);
                        scale_into(&exps, o, 1.0 / sum, false);
                    }
                }
                let mut got = vec![T::default(); x.len()];
                short_rows(&x, &mut got, n, log);
                assert_eq!(canonical(got), canonical(want), "n {n}, log {log}");
            }
        }
    }

    /// Values' bits with every NaN as the one positive quiet NaN. A NaN's sign is not kept: LLVM
    /// may swap a product's operands, and x86 passes on the first one's NaN.
    fn canonical<T: FloatElement>(values: Vec<T>) -> Vec<u32> {
        bits(values.into_iter().map(|v| if v.to_f32().is_nan() { T::from_f32(f32::NAN) } else { v }))
    }

    /// The backwards' rows of up to SHORT_ROW elements in one pass give what `softmax_grad` gives
    /// row by row, bit for bit: NaN, ±∞, −0 and values past exp's clamps in `y` and `dy`.
    fn check_short_grad_rows<T: FloatElement>() {
        for n in 1..=SHORT_ROW {
            let dy: Vec<T> = with_specials(row(n * 37, 2.0, n as u32));
            let mut y: Vec<T> = row(n * 37, 100.0, n as u32 + 3);
            for (k, v) in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, -0.0, 89.0, -89.0].into_iter().enumerate() {
                y[7 * n + k % n] = T::from_f32(v);
            }
            for log in [false, true] {
                let mut want = vec![T::default(); dy.len()];
                for ((d, v), o) in dy.chunks_exact(n).zip(y.chunks_exact(n)).zip(want.chunks_exact_mut(n)) {
                    softmax_grad(d, v, o, log, false);
                }
                let mut got = vec![T::default(); dy.len()];
                short_grad_rows(&dy, &y, &mut got, n, log);
                assert_eq!(canonical(got), canonical(want), "n {n}, log {log}");
            }
        }
    }

    #[test]
    fn short_grad_rows_match_the_row_passes() {
        if !can_run() {
            return;
        }
        check_short_grad_rows::<f32>();
        check_short_grad_rows::<bf16>();
    }

    #[test]
    fn short_rows_match_the_row_passes() {
        if !can_run() {
            return;
        }
        check_short_rows::<f32>();
        check_short_rows::<bf16>();
    }

    /// The backwards' rows: the sum (`Σ dy·y`, or `Σ dy`) matches f64's, and the store gives the
    /// generic map's bits for that sum. `y` spans log_softmax outputs and values past exp's clamps,
    /// NaN and ±∞ included (where the sum is then not compared); streamed and not, aligned and not.
    fn check_softmax_grad<T: Row>() {
        for &n in LENGTHS {
            let dy: Vec<T> = row(n, 2.0, n as u32);
            let y: Vec<T> = with_specials(row(n, 100.0, n as u32 + 3));
            for log in [false, true] {
                let wide = |v: &T| v.to_f32() as f64;
                let want: f64 = dy.iter().zip(&y).map(|(d, v)| wide(d) * if log { 1.0 } else { wide(v) }).sum();
                let magnitude: f64 =
                    dy.iter().zip(&y).map(|(d, v)| (wide(d) * if log { 1.0 } else { wide(v) }).abs()).sum();
                // SAFETY: the tests run these only where the CPU has AVX2 and FMA.
                let dot = unsafe {
                    if log {
                        grad_dot_in::<T, true>(&dy, &y)
                    } else {
                        grad_dot_in::<T, false>(&dy, &y)
                    }
                };
                if want.is_finite() {
                    assert!((dot as f64 - want).abs() <= 1e-6 * magnitude, "sum, n {n}, log {log}: {dot} vs {want}");
                }
                let grad = |d: &T, v: &T| {
                    let (d, v) = (d.to_f32(), v.to_f32());
                    T::from_f32(if log { d - math::exp_for::<T>(v) * dot } else { v * (d - dot) })
                };
                let want = bits(dy.iter().zip(&y).map(|(d, v)| grad(d, v)));
                each_destination::<T>(n, want, |out, streaming| softmax_grad(&dy, &y, out, log, streaming));
            }
        }
    }

    #[test]
    fn softmax_backward_rows_match_f64_and_the_scalar_map() {
        if !can_run() {
            return;
        }
        check_softmax_grad::<f32>();
        check_softmax_grad::<bf16>();
    }

    /// The dense map gives the scalar map's bits (`T::from_f32(f(x))`) for one, two and three
    /// inputs and one and two outputs (each result depending on every input, so a mixed-up lane
    /// shows), NaN and ±∞ included; streamed and not, aligned and not.
    fn check_maps<T: Row>() {
        let silu = |[x]: [f32; 1]| [math::silu::<T>(x)];
        let scaled_exp = |[a, b]: [f32; 2]| [a * math::exp_for::<T>(b) - b];
        let two = |[d, g, u]: [f32; 3]| [d * math::silu::<T>(g) - u, u * g + d];
        for &n in LENGTHS {
            let x: Vec<T> = with_specials(row(n, 100.0, n as u32));
            let (b, c): (Vec<T>, Vec<T>) = (row(n, 3.0, n as u32 + 5), row(n, 2.0, n as u32 + 7));
            let each = |k: usize| [x[k], b[k], c[k]].map(|v| v.to_f32());
            let want = bits((0..n).map(|k| T::from_f32(silu([each(k)[0]])[0])));
            each_destination::<T>(n, want, |out, streaming| map([&x], [out], streaming, &silu));
            let want = bits((0..n).map(|k| T::from_f32(scaled_exp([each(k)[0], each(k)[1]])[0])));
            each_destination::<T>(n, want, |out, streaming| map([&x, &b], [out], streaming, &scaled_exp));
            for o in 0..2 {
                let want = bits((0..n).map(|k| T::from_f32(two(each(k))[o])));
                each_destination::<T>(n, want, |out, streaming| {
                    let mut other = vec![T::default(); n];
                    let outs = if o == 0 { [out, &mut other[..]] } else { [&mut other[..], out] };
                    map([&x, &b, &c], outs, streaming, &two)
                });
            }
        }
    }

    #[test]
    fn dense_maps_match_the_scalar_map() {
        if !can_run() {
            return;
        }
        check_maps::<f32>();
        check_maps::<bf16>();
    }

    #[test]
    fn norm_passes_match_f64_and_the_scalar_forms() {
        if !can_run() {
            return;
        }
        check_norm_passes::<f32>();
        check_norm_passes::<bf16>();
    }

    #[test]
    fn scaled_stores_equal_the_scalar_narrowing() {
        if !can_run() {
            return;
        }
        check_scale::<f32>();
        check_scale::<bf16>();
    }
}
