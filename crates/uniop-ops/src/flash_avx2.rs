//! The attention forward's tiles on AVX2 CPUs, scores held transposed.
//!
//! Why a second tile kernel: on CPUs without AVX-512 the forward ran its two tile products
//! through the `gemm` crate, which packs both operands on every call (K, contiguous along the
//! head dim, is transposed first); with 128-deep products that per-call work, and the gemm's
//! own packing order, left the forward at about half of the FMA peak — below torch's SDPA.
//!
//! Here every operand is laid out once so that both products are the same register tile: 16
//! lanes (two 8-lane vectors, loaded from a contiguous strip) times 6 columns broadcast from
//! memory, 12 accumulators.
//!
//! - Scores, transposed: `Sᵀ[j, r] = Σ_d Qᵀ[d, r] · K[j, d]`. `Qᵀ` is built once per unit (in
//!   strips of 16 rows); K's rows are read in place, 6 keys at a time, one element per step.
//! - Output, transposed too: `Oᵀ[c, r] += Σ_j Pᵀ[j, r] · V[j, c]`, with `Pᵀ` the band's `Sᵀ` strip
//!   after the softmax and V's rows read in place, 6 value dims at a time.
//!
//! With `Sᵀ` the online softmax's per-row max and sum over keys are vertical vector operations.
//! Work goes by bands of 16 tile rows; a band stops at the last key any of its rows sees, so
//! under a causal mask the diagonal tile costs about half, and only keys some rows of the band
//! do not see pay for a mask. Units go head by head, so one head's K and V are reread from L3.
//! A boolean or float `mask` is applied to each band's scores after their product (through a
//! copy of each row's column), and a band it hides a key tile from is skipped, as in the GEMM
//! tiles (see [`crate::attention`]); a `softcap` caps the band's scores before it, the whole strip
//! in one elementwise pass (the cap of a score no row sees is never read). Sinks join each row
//! where it is finished, as on the GEMM tiles.
//!
//! f16 and bf16 K/V tiles are widened to f32 (cheap next to the products: each tile is widened
//! once per unit); every product and the softmax are f32.

use crate::attention::{cap_scores, carve, f32_rows, load_scaled, ForwardArgs, Geometry, MaskRows, QueryTile, Rows4};
use crate::math;
use crate::skinny::{Dots, Simd};
use std::arch::x86_64::*;
use uniop::half::bf16;
use uniop::{BlockCtx, DType, FloatElement, KernelArgs};

/// Tile rows per register tile (two 8-lane vectors).
pub(crate) const BAND: usize = 16;
/// Keys per tile: a K tile and a V tile (64 KiB each at D = 128) stay in a Zen 3 core's 512 KiB
/// L2 beside the Q and O tiles, across the bands that reread them.
pub(crate) const KEYS: usize = 128;
/// Broadcast columns per register tile: 12 accumulators, 2 row vectors and a broadcast fill
/// AVX2's 16 registers.
pub(crate) const COLS: usize = 6;

#[cfg(test)]
thread_local! {
    /// Tests run the attention kernels both ways on one machine: `Some(true)` forces the AVX2
    /// tiles (these and the backward's, `flash_backward_avx2.rs`; only where AVX2 runs),
    /// `Some(false)` the GEMM tiles.
    pub(crate) static FORCED: std::cell::Cell<Option<bool>> = const { std::cell::Cell::new(None) };
}

/// Whether this CPU's best level for `g`'s products (f32's; for bf16, bf16's) is AVX2, where the
/// forward and the backward run their AVX2 tiles — or what a test forced.
pub(crate) fn avx2_best(g: &Geometry) -> bool {
    #[cfg(test)]
    if let Some(forced) = FORCED.with(|f| f.get()) {
        return forced;
    }
    let level = if g.dtype == DType::BF16 { <bf16 as Dots>::best() } else { <f32 as Dots>::best() };
    level == Simd::Avx2
}

/// Whether the forward runs these tiles: on [`avx2_best`] CPUs, for tiles of at least one band
/// of rows (fewer rows — decode — are dot products).
pub(crate) fn applies(g: &Geometry) -> bool {
    avx2_best(g) && g.group() * g.tile_q() >= BAND
}

/// f32 scratch of one block: `Qᵀ`, one band's `Sᵀ`, `Oᵀ`, running max and sum, a staging row
/// and (f16, bf16) K and V tiles widened to f32.
fn tiles(g: &Geometry) -> [usize; 8] {
    let rp = (g.group() * g.tile_q()).next_multiple_of(BAND);
    let widened = if g.dtype == DType::F32 { 0 } else { KEYS };
    [
        g.head_dim * rp,
        KEYS * BAND,
        g.v_dim * rp,
        rp,
        rp,
        g.head_dim.max(g.v_dim),
        widened * g.head_dim,
        widened * g.v_dim,
    ]
}

/// f32 elements of scratch one block needs.
pub(crate) fn scratch(g: &Geometry) -> usize {
    tiles(g).iter().sum()
}

/// The forward over this block's units (see [`crate::attention`] for the unit order and the mask).
pub(crate) fn forward<T: FloatElement>(args: &KernelArgs, ctx: BlockCtx, g: Geometry) {
    // SAFETY: `applies` chose these tiles only where AVX2 and FMA run.
    unsafe { forward_avx2::<T>(args, ctx, g) }
}

/// [`forward`], compiled for AVX2 so that the loads, packing and softmax around the register
/// tiles vectorize too.
#[target_feature(enable = "avx2,fma")]
unsafe fn forward_avx2<T: FloatElement>(args: &KernelArgs, ctx: BlockCtx, g: Geometry) {
    let fa = ForwardArgs::of(args);
    let [qr, kr, vr, _] = fa.rows;
    let qs = fa.q.storage::<T>().expect("dtype dispatched");
    let (d, dv) = (g.head_dim, g.v_dim);
    let per_block = scratch(&g);
    // SAFETY: block b owns scratch range b.
    let ws = unsafe { args.workspace::<f32>(ctx.block_idx as usize * per_block, per_block) };
    let [qt, st, ot, m, l, row, kt, vt] = carve(ws, tiles(&g));
    for u in ctx.split(g.units()) {
        let t = g.query_tile(g.unit_by_head(u), fa.lens.as_ref(), "attention");
        let (b, hkv, rows) = (t.b, t.hkv, t.rows());
        let rp = rows.next_multiple_of(BAND);
        load_strips(&t, qs, qr, g.scale, &mut row[..d], qt);
        m[..rp].fill(f32::NEG_INFINITY);
        l[..rp].fill(0.0);
        ot[..dv * rp].fill(0.0);
        let kv_end = t.kv_end(&g);
        for j0 in (0..kv_end).step_by(KEYS) {
            let n = KEYS.min(kv_end - j0);
            let (kp, ks) = f32_rows::<T>(&fa.k, kr, (b, hkv, j0), n, d, kt);
            let (vp, vs) = f32_rows::<T>(&fa.v, vr, (b, hkv, j0), n, dv, vt);
            for band in (0..rp).step_by(BAND) {
                let (seen, keys) = band_seen(&g, &t, band, (j0, n));
                if keys == 0 || !band_live(fa.mask.as_ref(), &g, &t, (b, band), (j0, n)) {
                    continue;
                }
                let strip = |tile: &mut [f32], len: usize| tile[strip_at(band, len)..].as_mut_ptr();
                // SAFETY: the AVX2 level was detected (`applies`); the band's strips hold d (Qᵀ),
                // KEYS ≥ `keys` (Sᵀ) and dv (Oᵀ) rows of 16; K and V cover `n` ≥ `keys` rows.
                unsafe { products(st.as_mut_ptr(), strip(qt, d), d, (kp, 1, ks), keys, false) };
                if let Some(cap) = g.softcap {
                    cap_scores(&mut st[..keys * BAND], 1.0, cap as f32); // Q came scaled
                }
                if let Some(mask) = &fa.mask {
                    mask_band(mask, &t, (b, band), (&seen, j0), st);
                }
                // SAFETY: as above.
                unsafe {
                    let (s, o) = (st.as_mut_ptr(), strip(ot, dv));
                    softmax_band(s, keys, &seen, &mut m[band..band + BAND], &mut l[band..band + BAND], o, dv);
                    products(o, s, keys, (vp, vs, 1), dv, true);
                }
            }
        }
        for r in 0..rows {
            get_strip_row(ot, r, &mut row[..dv]);
            let (h, i) = t.head_pos(r);
            // SAFETY: this unit owns rows (b, h, q0..q0+n_pos) of out and lse.
            unsafe { fa.finish_row::<T>(g, (b, h, i), &mut row[..dv], m[r], l[r]) };
        }
    }
}

/// The rows of query tile `t` from a `[B, Hq, Sq, width]` tensor (width = `row.len()`), widened,
/// scaled and transposed into band strips (`width` rows of 16 per band; padding rows zero).
#[inline(always)]
pub(crate) fn load_strips<T: FloatElement>(
    t: &QueryTile,
    data: &[T],
    rows: Rows4,
    scale: f32,
    row: &mut [f32],
    strips: &mut [f32],
) {
    strips[..row.len() * t.rows().next_multiple_of(BAND)].fill(0.0);
    for r in 0..t.rows() {
        let (h, i) = t.head_pos(r);
        load_scaled(data, rows.at(t.b, h, i), row, scale);
        put_strip_row(strips, r, row);
    }
}

/// Writes `row` as tile row `r` of a transposed tile of `row.len()` rows per band (lane `r % 16`
/// of band `r / 16`'s strip).
#[inline(always)]
pub(crate) fn put_strip_row(strips: &mut [f32], r: usize, row: &[f32]) {
    let at = strip_at(r, row.len());
    for (c, &x) in row.iter().enumerate() {
        strips[at + c * BAND] = x;
    }
}

/// Reads tile row `r` of a transposed tile of `row.len()` rows per band into `row` (the inverse
/// of [`put_strip_row`]).
#[inline(always)]
pub(crate) fn get_strip_row(strips: &[f32], r: usize, row: &mut [f32]) {
    let at = strip_at(r, row.len());
    for (c, x) in row.iter_mut().enumerate() {
        *x = strips[at + c * BAND];
    }
}

/// Keys of the tile `j0..j0 + n` each row of the band starting at tile row `band` sees (padding
/// rows none), and the most any of them sees.
#[inline(always)]
pub(crate) fn band_seen(g: &Geometry, t: &QueryTile, band: usize, (j0, n): (usize, usize)) -> ([u32; BAND], usize) {
    let mut seen = [0u32; BAND];
    for (x, keys) in seen.iter_mut().enumerate() {
        if band + x < t.rows() {
            *keys = (g.visible(t.len, t.head_pos(band + x).1).saturating_sub(j0).min(n)) as u32;
        }
    }
    let most = *seen.iter().max().expect("a band has rows") as usize;
    (seen, most)
}

/// Whether `mask` (when given) shows the band of tile rows from `band` one of keys `j0..j0 + n`: a
/// band it hides the tile from is skipped like one that sees none of it.
#[inline(always)]
pub(crate) fn band_live(
    mask: Option<&MaskRows<'_>>,
    g: &Geometry,
    t: &QueryTile,
    (b, band): (usize, usize),
    (j0, n): (usize, usize),
) -> bool {
    let band_rows = band..(band + BAND).min(t.rows());
    mask.is_none_or(|m| m.tile_live(g, (b, t.len), band_rows.map(|r| t.head_pos(r)), (j0, n)))
}

/// Applies `mask` to the band of tile rows from `band` held down the columns of its `Sᵀ` strip
/// `s` (scores already scaled: Q is): row `x` over the first `seen[x]` keys from `j0`, through a
/// contiguous copy of its column — only in rows where the mask changes a score. The copies cost
/// more than the products (causal f32 `4x8x1024x64` with an all-true mask: 53 ms against 31.5
/// with none), and most rows of a padding mask's or a window's tiles are wholly visible.
#[inline(always)]
pub(crate) fn mask_band(
    mask: &MaskRows<'_>,
    t: &QueryTile,
    (b, band): (usize, usize),
    (seen, j0): (&[u32; BAND], usize),
    s: &mut [f32],
) {
    let mut column = [0f32; KEYS];
    for (x, &keys) in seen.iter().enumerate().take(t.rows().saturating_sub(band)) {
        let (h, i) = t.head_pos(band + x);
        if mask.leaves((b, h, i), j0, keys as usize) {
            continue;
        }
        let column = &mut column[..keys as usize];
        for (j, v) in column.iter_mut().enumerate() {
            *v = s[j * BAND + x];
        }
        mask.apply(column, (b, h, i), j0, 1.0);
        for (j, &v) in column.iter().enumerate() {
            s[j * BAND + x] = v;
        }
    }
}

/// Where tile row `r`'s strip starts in a transposed tile of `len` rows per band: each band of
/// 16 tile rows is one contiguous `len × 16` strip, so a register tile walks its operands at
/// unit stride (a plain `[len × rows]` layout would put a strip's lines 512 bytes apart, all in
/// 8 of L1's 64 sets).
#[inline(always)]
pub(crate) fn strip_at(r: usize, len: usize) -> usize {
    r / BAND * BAND * len + r % BAND
}

/// `dst[c, 0..16] (+)= Σ_t a[t, 0..16] · b[t, c]` for columns `c < cols`: `dst` and `a` are
/// band strips (rows of 16); `b` is `(ptr, step stride, column stride)`, broadcast one element
/// at a time.
///
/// # Safety
/// AVX2 and FMA must be present; `dst` valid for `cols` rows of 16, `a` for `steps` rows of 16,
/// `b` for every `(t, c)` addressed.
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn products(
    dst: *mut f32,
    a: *const f32,
    steps: usize,
    (b, b_step, b_col): (*const f32, usize, usize),
    cols: usize,
    accumulate: bool,
) {
    let mut c0 = 0;
    while c0 + COLS <= cols {
        register_tile::<COLS>(dst.add(c0 * BAND), a, steps, (b.add(c0 * b_col), b_step, b_col), accumulate);
        c0 += COLS;
    }
    let tail = (dst.add(c0 * BAND), a, steps, (b.add(c0 * b_col), b_step, b_col), accumulate);
    match cols - c0 {
        0 => {}
        1 => call_tile::<1>(tail),
        2 => call_tile::<2>(tail),
        3 => call_tile::<3>(tail),
        4 => call_tile::<4>(tail),
        _ => call_tile::<5>(tail),
    }
}

type TileArgs = (*mut f32, *const f32, usize, (*const f32, usize, usize), bool);

#[target_feature(enable = "avx2,fma")]
unsafe fn call_tile<const C: usize>((dst, a, steps, b, accumulate): TileArgs) {
    register_tile::<C>(dst, a, steps, b, accumulate)
}

/// One 16 × `C` register tile of [`products`].
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn register_tile<const C: usize>(
    dst: *mut f32,
    mut a: *const f32,
    steps: usize,
    (b, b_step, b_col): (*const f32, usize, usize),
    accumulate: bool,
) {
    let mut acc = [[_mm256_setzero_ps(); 2]; C];
    let cols: [*const f32; C] = std::array::from_fn(|c| b.add(c * b_col));
    for t in 0..steps {
        let (lo, hi) = (_mm256_loadu_ps(a), _mm256_loadu_ps(a.add(8)));
        for (pair, col) in acc.iter_mut().zip(&cols) {
            let x = _mm256_broadcast_ss(&*col.add(t * b_step));
            *pair = [_mm256_fmadd_ps(lo, x, pair[0]), _mm256_fmadd_ps(hi, x, pair[1])];
        }
        a = a.add(BAND);
    }
    // This call's `steps` terms are summed on their own, then added to what `dst` holds: sums
    // over many calls (dK and dV over thousands of query rows) round like blocked sums rather
    // than like one long chain.
    for (c, pair) in acc.iter_mut().enumerate() {
        let at = dst.add(c * BAND);
        if accumulate {
            *pair = [_mm256_add_ps(pair[0], _mm256_loadu_ps(at)), _mm256_add_ps(pair[1], _mm256_loadu_ps(at.add(8)))];
        }
        _mm256_storeu_ps(at, pair[0]);
        _mm256_storeu_ps(at.add(8), pair[1]);
    }
}

/// One online-softmax step for a band of 16 rows held down the columns of its `Sᵀ` strip
/// (`keys` rows of 16); row `x` sees the first `seen[x]` keys. Updates the running max `m` and
/// sum `l`, rescales the band's `Oᵀ` strip (`dv` rows of 16), and leaves `Sᵀ` holding the
/// probabilities (0 where masked).
///
/// # Safety
/// AVX2 and FMA must be present; `s` valid for `keys` rows of 16 and `o` for `dv`.
#[target_feature(enable = "avx2,fma")]
unsafe fn softmax_band(
    s: *mut f32,
    keys: usize,
    seen: &[u32; BAND],
    m: &mut [f32],
    l: &mut [f32],
    o: *mut f32,
    dv: usize,
) {
    let s = std::slice::from_raw_parts_mut(s, keys * BAND);
    // Keys every row of the band sees need no mask: under a causal mask only the diagonal tile
    // has keys past that.
    let unmasked = (*seen.iter().min().expect("a band") as usize).min(keys) * BAND;
    let (all_see, some_see) = s.split_at_mut(unmasked);
    let mut new_m: [f32; BAND] = (&*m).try_into().expect("a band of running maxima");
    for strip in all_see.chunks_exact(BAND) {
        for (nm, &x) in new_m.iter_mut().zip(strip) {
            *nm = if x > *nm { x } else { *nm };
        }
    }
    let first_masked = unmasked / BAND;
    for (j, strip) in (first_masked..).zip(some_see.chunks_exact(BAND)) {
        for ((nm, &x), &seen) in new_m.iter_mut().zip(strip).zip(seen) {
            *nm = if (j as u32) < seen && x > *nm { x } else { *nm };
        }
    }
    let mut sums = [0f32; BAND];
    // A row that has seen no key yet keeps max -inf; its entries are all masked: e^(−∞ − 0) = 0.
    let base: [f32; BAND] = new_m.map(|x| if x == f32::NEG_INFINITY { 0.0 } else { x });
    for strip in all_see.chunks_exact_mut(BAND) {
        for ((p, &mx), sum) in strip.iter_mut().zip(&base).zip(&mut sums) {
            *p = math::exp(*p - mx);
            *sum += *p;
        }
    }
    for (j, strip) in (first_masked..).zip(some_see.chunks_exact_mut(BAND)) {
        for (((p, &mx), &seen), sum) in strip.iter_mut().zip(&base).zip(seen).zip(&mut sums) {
            *p = if (j as u32) < seen { math::exp(*p - mx) } else { 0.0 };
            *sum += *p;
        }
    }
    let alpha: [f32; BAND] =
        std::array::from_fn(|x| if new_m[x] == f32::NEG_INFINITY { 1.0 } else { math::exp(m[x] - new_m[x]) });
    for x in 0..BAND {
        l[x] = l[x] * alpha[x] + sums[x];
        m[x] = new_m[x];
    }
    for row in std::slice::from_raw_parts_mut(o, dv * BAND).chunks_exact_mut(BAND) {
        row.iter_mut().zip(&alpha).for_each(|(y, a)| *y *= a);
    }
}

#[cfg(test)]
mod tests {
    use super::FORCED;
    use crate::attention::run_checked_forcing;
    use uniop::half::{bf16, f16};
    use uniop::verify::Rng;
    use uniop::{AttrValue, Element, TensorRef};

    /// `attention` on the forward kernel `transposed` chooses, checked against the reference.
    fn run_forced(transposed: bool, inputs: &[Option<TensorRef>], causal: bool) -> Vec<Vec<f64>> {
        run_forced_with(transposed, inputs, &[("causal", AttrValue::Bool(causal))])
    }

    /// [`run_forced`] under `attrs`.
    fn run_forced_with(transposed: bool, inputs: &[Option<TensorRef>], attrs: &[(&str, AttrValue)]) -> Vec<Vec<f64>> {
        run_checked_forcing("attention", inputs, attrs, || FORCED.with(|f| f.set(Some(transposed))))
    }

    /// The kernels this CPU runs: the GEMM tiles always, these where AVX2 and FMA are present.
    fn kernels() -> Vec<bool> {
        let avx2 = is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma");
        [false].into_iter().chain(avx2.then_some(true)).collect()
    }

    fn random<T: Element>(shape: &[usize], seed: u64, scale: f64) -> Vec<T> {
        let mut rng = Rng::new(seed);
        (0..shape.iter().product()).map(|_| T::from_f64(scale * rng.uniform())).collect()
    }

    fn view<'a, T: Element>(x: &'a [T], shape: &[usize]) -> Option<TensorRef<'a>> {
        Some(TensorRef::new(x, shape).unwrap())
    }

    /// q, k, v of type `T` (k and v with `kv` heads, v with `dv` dims) on both kernels.
    fn dense<T: Element>(q_shape: [usize; 4], kv_heads: usize, dv: usize, causal: bool) -> Vec<Vec<Vec<f64>>> {
        let [b, _, s, d] = q_shape;
        let (k_shape, v_shape) = ([b, kv_heads, s, d], [b, kv_heads, s, dv]);
        let (q, k, v) = (random::<T>(&q_shape, 1, 2.0), random::<T>(&k_shape, 2, 2.0), random::<T>(&v_shape, 3, 4.0));
        kernels()
            .into_iter()
            .map(|transposed| {
                run_forced(transposed, &[view(&q, &q_shape), view(&k, &k_shape), view(&v, &v_shape), None], causal)
            })
            .collect()
    }

    /// Three key tiles (300 keys), GQA with three q heads per kv head (tile rows wrap from one
    /// head to the next inside a band; the last band is padded), a head dim that is no multiple
    /// of the 6 broadcast columns, a value dim that is no multiple of them either (40),
    /// causal and not, in f32, f16 and bf16; in f32 the kernels also agree with each other.
    #[test]
    fn both_kernels_match_the_reference_across_tiles_and_bands() {
        for causal in [false, true] {
            let f32_runs = dense::<f32>([1, 6, 300, 20], 2, 40, causal);
            if let [gemm, transposed] = &f32_runs[..] {
                for (a, b) in gemm.iter().flatten().zip(transposed.iter().flatten()) {
                    assert!((a - b).abs() <= 1e-5 * (1.0 + a.abs()), "causal {causal}: kernels disagree, {a} vs {b}");
                }
            }
            dense::<f16>([1, 6, 300, 20], 2, 40, causal);
            dense::<bf16>([1, 6, 300, 20], 2, 40, causal);
        }
    }

    /// Masks on both kernels against the reference: a sliding window of 40 keys over 300
    /// positions (causal; bands see one or two of the three key tiles), boolean and as a float mask
    /// with an ALiBi-like bias; a left-padded batch (260 padding keys in batch row 1) whose first
    /// 256 keys — one key tile of the GEMM kernel, two of these — hold NaN K/V rows, which must be
    /// skipped, never read, as a boolean mask and as a float one of ±0 and −∞; GQA groups of three
    /// (bands wrap across heads); f32 and bf16. In f32 the kernels agree.
    #[test]
    fn both_kernels_apply_masks_and_skip_the_tiles_they_hide() {
        let (q_shape, kv_shape) = ([2, 6, 300, 20], [2, 2, 300, 20]);
        let window: Vec<bool> = (0..300 * 300).map(|x| x % 300 + 40 > x / 300 && x % 300 <= x / 300).collect();
        let alibi: Vec<f32> = window
            .iter()
            .enumerate()
            .map(|(x, &keep)| if keep { -0.1 * (x / 300 - x % 300) as f32 } else { f32::NEG_INFINITY })
            .collect();
        let padding: Vec<bool> = (0..2 * 300).map(|x| x < 300 || x % 300 >= 260).collect();
        // The same padding as a float mask: ±0 where seen (rows the kernels leave unmasked), −∞
        // where hidden.
        let padding_bias: Vec<f32> = padding
            .iter()
            .enumerate()
            .map(|(x, &keep)| {
                if !keep {
                    f32::NEG_INFINITY
                } else if x % 2 == 0 {
                    0.0
                } else {
                    -0.0
                }
            })
            .collect();
        // transformers 4.x's kind: 0 where seen, the dtype's lowest value where hidden, which hides
        // (the NaN keys below are never read) as −∞ does; f32 and bf16.
        let padding_lowest: Vec<f32> = padding.iter().map(|&keep| if keep { 0.0 } else { f32::MIN }).collect();
        let padding_lowest_bf16: Vec<bf16> =
            padding.iter().map(|&keep| if keep { bf16::ZERO } else { bf16::MIN }).collect();
        let poison = |mut x: Vec<f32>| {
            x[2 * 300 * 20..][..256 * 20].fill(f32::NAN); // batch row 1, kv head 0
            x[3 * 300 * 20..][..256 * 20].fill(f32::NAN); // and kv head 1
            x
        };
        let (q, k, v) =
            (random::<f32>(&q_shape, 8, 2.0), random::<f32>(&kv_shape, 9, 2.0), random::<f32>(&kv_shape, 10, 2.0));
        let (k_nan, v_nan) = (poison(k.clone()), poison(v.clone()));
        let masks = [
            (TensorRef::new(&window, &[300, 300]).unwrap(), &k, &v),
            (TensorRef::new(&alibi, &[1, 1, 300, 300]).unwrap(), &k, &v),
            (TensorRef::new(&padding, &[2, 1, 1, 300]).unwrap(), &k_nan, &v_nan),
            (TensorRef::new(&padding_bias, &[2, 1, 1, 300]).unwrap(), &k_nan, &v_nan),
            (TensorRef::new(&padding_lowest, &[2, 1, 1, 300]).unwrap(), &k_nan, &v_nan),
            (TensorRef::new(&padding_lowest_bf16, &[2, 1, 1, 300]).unwrap(), &k_nan, &v_nan),
        ];
        for (mask, k, v) in masks {
            let runs: Vec<_> = kernels()
                .into_iter()
                .map(|transposed| {
                    let inputs = [view(&q, &q_shape), view(k, &kv_shape), view(v, &kv_shape), None, Some(mask.clone())];
                    run_forced(transposed, &inputs, true)
                })
                .collect();
            if let [gemm, transposed] = &runs[..] {
                for (a, b) in gemm.iter().flatten().zip(transposed.iter().flatten()) {
                    // lse −∞ (a query the mask leaves without keys) on both.
                    assert!(a == b || (a - b).abs() <= 1e-5 * (1.0 + a.abs()), "kernels disagree, {a} vs {b}");
                }
            }
            let narrow = |x: &[f32]| x.iter().map(|&v| bf16::from_f32(v)).collect::<Vec<_>>();
            let (qb, kb, vb) = (narrow(&q), narrow(k), narrow(v));
            for transposed in kernels() {
                let inputs =
                    [view(&qb, &q_shape), view(&kb, &kv_shape), view(&vb, &kv_shape), None, Some(mask.clone())];
                run_forced(transposed, &inputs, true);
            }
        }
    }

    /// A softcap that bends the scores (2: scaled scores reach ~4 here), with and without a float
    /// mask, and sinks (which both kernels leave to the rows' finish), causal: both kernels against
    /// the reference, and each other in f32; bf16 too.
    #[test]
    fn both_kernels_soft_cap_the_scores_and_take_sinks() {
        let (q_shape, kv_shape) = ([1, 6, 300, 20], [1, 2, 300, 20]);
        let (q, k, v) =
            (random::<f32>(&q_shape, 11, 4.0), random::<f32>(&kv_shape, 12, 2.0), random::<f32>(&kv_shape, 13, 2.0));
        let alibi: Vec<f32> = (0..300 * 300usize).map(|x| -0.05 * (x / 300).abs_diff(x % 300) as f32).collect();
        let sinks = [-1.0f32, 0.5, 2.0, -3.0, 0.0, 1.0];
        let attrs = [("causal", AttrValue::Bool(true)), ("softcap", AttrValue::Float(2.0))];
        let mask = || Some(TensorRef::new(&alibi, &[300, 300]).unwrap());
        for (mask, sinks) in [(None, None), (mask(), None), (mask(), view(&sinks, &[6]))] {
            let inputs = [view(&q, &q_shape), view(&k, &kv_shape), view(&v, &kv_shape), None, mask, sinks];
            let runs: Vec<_> =
                kernels().into_iter().map(|transposed| run_forced_with(transposed, &inputs, &attrs)).collect();
            if let [gemm, transposed] = &runs[..] {
                for (a, b) in gemm.iter().flatten().zip(transposed.iter().flatten()) {
                    assert!((a - b).abs() <= 1e-5 * (1.0 + a.abs()), "kernels disagree, {a} vs {b}");
                }
            }
            let narrow = |x: &[f32]| x.iter().map(|&v| bf16::from_f32(v)).collect::<Vec<_>>();
            let (qb, kb, vb) = (narrow(&q), narrow(&k), narrow(&v));
            let [_, _, _, lens, mask, sinks] = inputs;
            let inputs = [view(&qb, &q_shape), view(&kb, &kv_shape), view(&vb, &kv_shape), lens, mask, sinks];
            for transposed in kernels() {
                run_forced_with(transposed, &inputs, &attrs);
            }
        }
    }

    /// Decode-style cache lengths under the bottom-right causal mask, one so short that most
    /// queries see no key (output 0, lse -inf), and HF's `[B, S, H, D]` layout read in place.
    #[test]
    fn both_kernels_read_kv_lens_and_strided_views() {
        let (q, k, v) = (
            random::<f32>(&[2, 2, 40, 16], 4, 2.0),
            random::<f32>(&[2, 1, 50, 16], 5, 2.0),
            random::<f32>(&[2, 1, 50, 16], 6, 2.0),
        );
        let lens = [50i64, 10];
        let (b, s, h, d) = (2, 33, 2, 16);
        let bshd = random::<f32>(&[b, s, h, d], 7, 2.0);
        let hf = || Some(TensorRef::strided(&bshd, &[b, h, s, d], &[s * h * d, d, h * d, 1], 0).unwrap());
        for transposed in kernels() {
            let inputs =
                [view(&q, &[2, 2, 40, 16]), view(&k, &[2, 1, 50, 16]), view(&v, &[2, 1, 50, 16]), view(&lens, &[2])];
            let out = run_forced(transposed, &inputs, true);
            // Row b = 1 has 10 keys for 40 queries: query i sees keys j <= i - 30.
            assert!(
                out[1][2 * 40..2 * 40 + 30].iter().all(|&l| l == f64::NEG_INFINITY),
                "unseen queries keep lse -inf"
            );
            run_forced(transposed, &[hf(), hf(), hf(), None], true);
        }
    }
}
