//! The attention backward's dK/dV launch on AVX2 CPUs, keys in the vector lanes.
//!
//! Why a second kernel: off AVX-512 the backward ran its five tile products per (query tile,
//! key tile) through the `gemm` crate, which packs both operands on every call, and its 128 × 256
//! tiles computed whole products on the causal diagonal — about an eighth more work than the
//! mask leaves. Profiled at S = 2048, the products ran at about 80% of the FMA peak and the
//! whole launch at 63%.
//!
//! The launch owns a tile of keys and sums over every query that sees them, so here the 16 lanes
//! of [`flash_avx2`](crate::flash_avx2)'s register tile (two 8-lane vectors times 6 broadcast
//! columns) run over 16 consecutive keys, a *strip*:
//!
//! - Once per key tile, `scale·K` and `V` are packed transposed into strips (`[d × 16]` each,
//!   zero lanes past the tile's end) and, when this launch also sums `dQ`, K into panels of 16
//!   head dims (`[keys × 16]`). Q and dout rows are read in place (f32) or widened once per
//!   block of queries, and broadcast.
//! - Per strip: `S[r, lanes] = Σ_c Q[r, c] · sKᵀ[c, lanes]` and `dP` from dout and Vᵀ; then
//!   `P = exp(S − lse)` and `dS = P ∘ (dP − δ)` lane-wise, each row's `lse` and `δ` broadcast;
//!   then `dVᵀ[c, lanes] += Σ_r dout[r, c] · P[r, lanes]` and `dKᵀ += Σ_r Q[r, c] · dS[r, lanes]`
//!   — the reduction over query rows is the register tile's step loop.
//! - With `dQ`: dS is also kept as rows, and `dQ[r, panel] += Σ_j dS[r, j] · K[j, panel]`
//!   (lanes over head dims, 6 query rows broadcast) into f32 sums held as panels.
//!
//! Under a causal mask a query's keys are a prefix, growing with its position: each strip starts
//! at the first query row that sees one of its keys, and each `dQ` register tile stops at the
//! last key its rows see, so a diagonal tile costs about half a full one.
//!
//! A `softcap` bends the scores as the forward's tiles did (`cap · tanh(S / cap)`, S scaled
//! already), before the mask, and its derivative `1 − t²` folds into dP as on the GEMM tiles
//! (`attention_backward::cap_for_grads`), so that `dS` comes out as the uncapped scores' gradient.
//!
//! A `mask` applies as in the forward's tiles, to the scores a product left (scaled already: K
//! or Q is packed times the scale), before `P = exp(S − lse)`: here a strip row's 16 keys lie in
//! the mask's row, so it applies in place (`MaskRows::apply_strip`). A block of queries (or, in
//! the `dQ` launch, a band) that the mask hides a key tile from skips it whole, as the forward
//! does — a padding's or a document mask's backward costs the keys it shows too. A query the
//! mask hides from every key has `lse = -inf` and no gradient.
//!
//! A learned bias that asks for its gradient (`needs_dmask`) with an element of its own per
//! (head, query, key), shared by the batch or one per batch row (T5's relative position bias),
//! gets it here: `dmask` is `dS` itself, which this launch holds strip by strip, so each strip
//! row adds it into the key tile's sums (`[group × Sq × KEYS]`, per block), written out once the
//! tile's batch rows are done. A unit then walks every batch row whose scores sum into one of
//! `dmask`'s rows, so that no two units write one element. This saves the separate `dmask` step
//! of [`attention_mask_grad`](crate::attention_mask_grad) its two recomputed products per score.
//!
//! The `dQ` launch of the finer split (few (batch, kv head) pairs, where the dK/dV launch goes
//! per key tile) is the forward's layout instead: it owns a tile of queries and sums over keys,
//! so its lanes run over query rows (see [`dq`]).

use crate::attention::{carve, f32_rows, row_len, Geometry, MaskRows, Rows4};
use crate::attention_backward::{cap_score_and_grad, narrow_into, row_index, store_row, BackwardArgs};
use crate::attention_mask_grad::MaskGrad;
use crate::flash_avx2::{
    band_live, band_seen, get_strip_row, load_strips, mask_band, products, put_strip_row, strip_at, BAND, COLS,
};
use crate::math;
use uniop::{BlockCtx, DType, FloatElement, KernelArgs};

/// Keys per tile: the packed K/V strips and panels and the dK/dV sums (32 KiB each at D = 128)
/// stay in a Zen 3 core's 512 KiB L2 beside a block's Q and dout rows.
pub(crate) const KEYS: usize = 64;
/// Query positions per block (one q head at a time).
const ROWS: usize = 128;
/// Head dims per panel of K and of the fused launch's dQ sums: one register tile's two vectors.
const PANEL: usize = 16;

/// Whether the backward runs these tiles: on CPUs whose best level is AVX2 (see
/// [`avx2_best`](crate::flash_avx2::avx2_best)).
pub(crate) fn applies(g: &Geometry) -> bool {
    crate::flash_avx2::avx2_best(g)
}

/// f32 elements of a block's `dmask` sums at most (4 MiB): beyond, the separate step sums it.
const MAX_DMASK_SUMS: usize = 1 << 20;

/// `dmask` summed by this launch (see the module doc): each unit walks `batch_rows` consecutive
/// batch rows, whose scores sum into one of `dmask`'s rows.
#[derive(Clone, Copy, Debug)]
pub(crate) struct DmaskSums {
    batch_rows: usize,
}

/// Whether this launch sums the gradient `m` of a mask (see [`DmaskSums`]): a mask with an element
/// of its own per score, whose sums for a key tile fit in [`MAX_DMASK_SUMS`], without a `softcap`
/// (dS carries the cap's derivative by then; the mask's gradient is the capped scores').
pub(crate) fn sums_dmask(g: &Geometry, m: &MaskGrad) -> Option<DmaskSums> {
    let batch_rows = m.rows_per_dmask_row(g)?;
    let fits = g.group() * g.q_len * KEYS <= MAX_DMASK_SUMS;
    (fits && g.softcap.is_none()).then_some(DmaskSums { batch_rows })
}

/// (Batch rows, kv head) groups of this launch's units: one of `dmask`'s rows each when it sums
/// it, else one batch row each.
pub(crate) fn row_groups(g: &Geometry, dmask: Option<DmaskSums>) -> usize {
    g.batch / dmask.map_or(1, |m| m.batch_rows) * g.kv_heads
}

/// Head dims of a `dQ` panel row: `d` rounded up to whole panels.
pub(crate) fn dq_width(g: &Geometry) -> usize {
    g.head_dim.next_multiple_of(PANEL)
}

/// f32 scratch of one block: K (scaled) and V strips, K panels (with dQ), dK and dV sums
/// (strips), one strip of S/P and of dP/dS, dS as rows (with dQ), Q and dout rows widened
/// (f16, bf16), a staging row and the key tile's dmask sums (when it sums them).
fn tiles(g: &Geometry, with_dq: bool, dmask: Option<DmaskSums>) -> [usize; 11] {
    let (d, dv) = (g.head_dim, g.v_dim);
    let widened = if g.dtype == DType::F32 { 0 } else { ROWS * (d + dv) };
    let with = |n: usize| if with_dq { n } else { 0 };
    let dmask_sums = if dmask.is_some() { g.group() * g.q_len * KEYS } else { 0 };
    [
        KEYS * d,
        KEYS * dv,
        with(KEYS * dq_width(g)),
        KEYS * d,
        KEYS * dv,
        ROWS * BAND,
        ROWS * BAND,
        with(ROWS * KEYS),
        widened,
        d.max(dv),
        dmask_sums,
    ]
}

/// f32 elements of scratch one block needs.
pub(crate) fn scratch(g: &Geometry, with_dq: bool, dmask: Option<DmaskSums>) -> usize {
    tiles(g, with_dq, dmask).iter().sum()
}

/// `dK`, `dV` for one key tile of one kv head per unit; with `dq_sums` (the offset of an f32
/// workspace region of `dq_width` columns per query row, held as panels per (batch, kv head)),
/// all key tiles of one kv head per unit, and `dQ` of its q heads too. With `dmask`, a unit walks
/// the batch rows of one of its rows (see [`DmaskSums`]) and sums it too.
pub(crate) fn dkv<T: FloatElement>(
    args: &KernelArgs,
    ctx: BlockCtx,
    g: Geometry,
    per_block: usize,
    (dq_sums, dmask): (Option<usize>, Option<DmaskSums>),
) {
    // SAFETY: `applies` chose these tiles only where AVX2 and FMA run.
    unsafe { dkv_avx2::<T>(args, ctx, g, per_block, (dq_sums, dmask)) }
}

/// One key tile's packed operands and sums.
struct KeyTile<'a> {
    j0: usize,
    n: usize,
    /// `scale·K` and V as strips of 16 keys (`[d × 16]`, `[dv × 16]`).
    k_strips: &'a mut [f32],
    v_strips: &'a mut [f32],
    /// K as panels of 16 head dims (`[KEYS × 16]` each); empty without dQ.
    k_panels: &'a mut [f32],
    /// dK and dV sums, as strips like K's and V's.
    dk: &'a mut [f32],
    dv: &'a mut [f32],
    /// dS summed over the unit's batch rows for `dmask`, `[group × Sq × KEYS]`; empty without.
    dmask: &'a mut [f32],
}

/// A block of queries: positions `i0..i0 + rows` of q head `h` of batch row `b`, its Q and dout
/// rows (pointer, row stride) and where its rows start in the pair's `dQ` sums.
struct QueryBlock {
    b: usize,
    h: usize,
    i0: usize,
    rows: usize,
    q: (*const f32, usize),
    dout: (*const f32, usize),
    pair_row: usize,
}

/// [`dkv`], compiled for AVX2 so that the packing and the lane-wise softmax vectorize too.
#[target_feature(enable = "avx2,fma")]
unsafe fn dkv_avx2<T: FloatElement>(
    args: &KernelArgs,
    ctx: BlockCtx,
    g: Geometry,
    per_block: usize,
    (dq_sums, dmask): (Option<usize>, Option<DmaskSums>),
) {
    let a = BackwardArgs::of(args);
    let (d, dv, group) = (g.head_dim, g.v_dim, g.group());
    let n_rows = g.q_len * g.q_heads * g.batch;
    // SAFETY: δ was written by step 1 and is only read now; block b owns scratch range b.
    let delta = unsafe { &*(args.workspace::<f32>(0, n_rows) as *const [f32]) };
    let ws = unsafe { args.workspace::<f32>(n_rows + ctx.block_idx as usize * per_block, per_block) };
    let with_dq = dq_sums.is_some();
    let [k_strips, v_strips, k_panels, dk, dv_sums, s, dp, ds_rows, widened, row, dmask_sums] =
        carve(ws, tiles(&g, with_dq, dmask));
    let (q_rows, dout_rows) = widened.split_at_mut(if widened.is_empty() { 0 } else { ROWS * d });
    let k_tiles = g.kv_len.div_ceil(KEYS);
    let groups = row_groups(&g, dmask);
    let (units, tiles_per_unit) = if with_dq { (groups, k_tiles) } else { (groups * k_tiles, 1) };
    let pair_rows = group * g.q_len;
    let unit_rows = dmask.map_or(1, |m| m.batch_rows);
    // The dQ sums of batch row b's group of q heads (consecutive rows of the [B, Hq, Sq] arrays).
    let dq_of = |b: usize, hkv: usize| -> &mut [f32] {
        match dq_sums {
            // SAFETY: the unit walking batch row b of kv head hkv alone owns its group's dQ sums.
            Some(base) => unsafe {
                args.workspace::<f32>(base + row_index(&g, b, hkv * group, 0) * dq_width(&g), pair_rows * dq_width(&g))
            },
            None => &mut [],
        }
    };
    for u in ctx.split(units) {
        let (rows_group, first_tile) = if with_dq { (u, 0) } else { (u / k_tiles, u % k_tiles) };
        // dmask's row when this launch sums it; else the one batch row the unit walks.
        let (dmask_row, hkv) = (rows_group / g.kv_heads, rows_group % g.kv_heads);
        let batch_rows = dmask_row * unit_rows..(dmask_row + 1) * unit_rows;
        batch_rows.clone().for_each(|b| dq_of(b, hkv).fill(0.0));
        for tile in first_tile..first_tile + tiles_per_unit {
            let j0 = tile * KEYS;
            let mut kt = KeyTile {
                j0,
                n: KEYS.min(g.kv_len - j0),
                k_strips: &mut k_strips[..],
                v_strips: &mut v_strips[..],
                k_panels: &mut k_panels[..],
                dk: &mut dk[..],
                dv: &mut dv_sums[..],
                dmask: &mut dmask_sums[..],
            };
            kt.dmask.fill(0.0);
            for b in batch_rows.clone() {
                let len = row_len(a.lens.as_ref(), b, g.kv_len, "attention_backward");
                pack_key_tile::<T>(&a, &g, (b, hkv), &mut kt, row);
                let dq = dq_of(b, hkv);
                for h in hkv * group..(hkv + 1) * group {
                    for i0 in (0..g.q_len).step_by(ROWS) {
                        let rows = ROWS.min(g.q_len - i0);
                        if g.visible(len, i0 + rows - 1) <= j0 {
                            continue;
                        }
                        let queries = (i0..i0 + rows).map(|i| (h, i));
                        if a.mask.as_ref().is_some_and(|m| !m.tile_live(&g, (b, len), queries, (j0, kt.n))) {
                            continue; // the mask hides this tile from the block's every query
                        }
                        let block = QueryBlock {
                            b,
                            h,
                            i0,
                            rows,
                            q: f32_rows::<T>(&a.q, a.q_rows, (b, h, i0), rows, d, q_rows),
                            dout: f32_rows::<T>(&a.dout, a.dout_rows, (b, h, i0), rows, dv, dout_rows),
                            pair_row: (h - hkv * group) * g.q_len + i0,
                        };
                        let rows_of = |i| row_index(&g, b, h, i);
                        let stats = (&a.lse[rows_of(i0)..][..rows], &delta[rows_of(i0)..][..rows]);
                        // SAFETY: AVX2 and FMA run (`applies`); the block's rows and the tile's keys
                        // lie inside the checked views and this block's scratch.
                        unsafe {
                            block_products(
                                &g,
                                (len, a.mask.as_ref()),
                                &mut kt,
                                &block,
                                stats,
                                s,
                                dp,
                                ds_rows,
                                (&mut *dq, pair_rows),
                            )
                        };
                    }
                }
                store_key_tile::<T>(&a, &g, (b, hkv), &mut kt, row);
            }
            if dmask.is_some() {
                // SAFETY: this unit alone walks the batch rows of `dmask_row` for kv head hkv.
                unsafe { store_dmask_tile(args, &g, (dmask_row, hkv), &kt) };
            }
        }
        if with_dq {
            for b in batch_rows {
                let dq = dq_of(b, hkv);
                for h in hkv * group..(hkv + 1) * group {
                    for i in 0..g.q_len {
                        let pair_row = (h - hkv * group) * g.q_len + i;
                        for (c, x) in row[..d].iter_mut().enumerate() {
                            *x = dq[(c / PANEL * pair_rows + pair_row) * PANEL + c % PANEL];
                        }
                        // SAFETY: this unit owns rows (b, group heads) of dq.
                        unsafe { store_row::<T>(&a.dq, a.dq_rows.at(b, h, i), &mut row[..d], g.scale) };
                    }
                }
            }
        }
    }
}

/// Writes the key tile's dmask sums: keys `j0..j0 + n` of every query of kv head `hkv`'s q heads
/// in `dmask`'s row `dmask_row`.
///
/// # Safety
/// The caller must own those elements of `dmask` (output 3).
unsafe fn store_dmask_tile(args: &KernelArgs, g: &Geometry, (dmask_row, hkv): (usize, usize), kt: &KeyTile) {
    let dmask = args.output(3);
    let group = g.group();
    for hh in 0..group {
        let h = hkv * group + hh;
        for i in 0..g.q_len {
            let at = ((dmask_row * g.q_heads + h) * g.q_len + i) * g.kv_len + kt.j0 + dmask.layout().offset();
            // SAFETY: the caller's promise.
            unsafe { narrow_into(&dmask, at, &kt.dmask[(hh * g.q_len + i) * KEYS..][..kt.n]) };
        }
    }
}

/// Packs keys `j0..j0 + n` of kv head `(b, hkv)` into the tile's strips (zero lanes past `n`)
/// and, with dQ, panels (zero dims past `d`); clears its sums.
#[inline(always)]
fn pack_key_tile<T: FloatElement>(
    a: &BackwardArgs,
    g: &Geometry,
    (b, hkv): (usize, usize),
    kt: &mut KeyTile,
    row: &mut [f32],
) {
    let (d, dv, n) = (g.head_dim, g.v_dim, kt.n);
    let (ks, vs) = (a.k.storage::<T>().expect("dtype dispatched"), a.v.storage::<T>().expect("dtype dispatched"));
    for j in 0..n.next_multiple_of(BAND) {
        // Key j0 + j of `data` widened into `dst`, zeros past the tile's end.
        let load = |data: &[T], rows: Rows4, dst: &mut [f32]| match j < n {
            true => T::widen(&data[rows.at(b, hkv, kt.j0 + j)..][..dst.len()], dst),
            false => dst.fill(0.0),
        };
        let key = &mut row[..d];
        load(ks, a.k_rows, key);
        if !kt.k_panels.is_empty() && j < n {
            for c in 0..dq_width(g) {
                kt.k_panels[(c / PANEL * KEYS + j) * PANEL + c % PANEL] = if c < d { key[c] } else { 0.0 };
            }
        }
        key.iter_mut().for_each(|x| *x *= g.scale);
        put_strip_row(kt.k_strips, j, key);
        let value = &mut row[..dv];
        load(vs, a.v_rows, value);
        put_strip_row(kt.v_strips, j, value);
    }
    kt.dk.fill(0.0);
    kt.dv.fill(0.0);
}

/// Writes the tile's dK (times the scale) and dV rows.
#[inline(always)]
fn store_key_tile<T: FloatElement>(
    a: &BackwardArgs,
    g: &Geometry,
    (b, hkv): (usize, usize),
    kt: &mut KeyTile,
    row: &mut [f32],
) {
    let (d, dv) = (g.head_dim, g.v_dim);
    for j in 0..kt.n {
        get_strip_row(kt.dk, j, &mut row[..d]);
        // SAFETY: this unit owns keys j0..j0+n of (b, hkv) in dk and dv.
        unsafe { store_row::<T>(&a.dk, a.dk_rows.at(b, hkv, kt.j0 + j), &mut row[..d], g.scale) };
        get_strip_row(kt.dv, j, &mut row[..dv]);
        unsafe { store_row::<T>(&a.dv, a.dv_rows.at(b, hkv, kt.j0 + j), &mut row[..dv], 1.0) };
    }
}

/// The products of one query block against one key tile (its queries seeing the first `len` keys,
/// under `mask` when given): per strip S, dP, P, dS and the dV, dK sums; then, given the pair's
/// dQ sums (panels of `pair_rows` rows), dQ.
///
/// # Safety
/// AVX2 and FMA must be present; the block's Q and dout pointers valid for its rows of `d` and
/// `dv` elements; `s` and `dp` hold `ROWS` rows of 16, `ds_rows` `ROWS` rows of `KEYS` (with dQ).
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma")]
unsafe fn block_products(
    g: &Geometry,
    (len, mask): (usize, Option<&MaskRows<'_>>),
    kt: &mut KeyTile,
    q: &QueryBlock,
    (lse, delta): (&[f32], &[f32]),
    s: &mut [f32],
    dp: &mut [f32],
    ds_rows: &mut [f32],
    (dq, pair_rows): (&mut [f32], usize),
) {
    let (d, dv, rows) = (g.head_dim, g.v_dim, q.rows);
    let ((qp, qs), (op, os)) = (q.q, q.dout);
    let with_dq = !dq.is_empty();
    // The first row that sees a key of the current strip: visibility grows with position.
    let mut first = 0;
    for strip in 0..kt.n.div_ceil(BAND) {
        let key0 = kt.j0 + strip * BAND;
        while first < rows && g.visible(len, q.i0 + first) <= key0 {
            first += 1;
        }
        if first == rows {
            // No row sees this strip or a later one; dQ below stops before them.
            break;
        }
        let live = rows - first;
        let (sp, dpp) = (s.as_mut_ptr().add(first * BAND), dp.as_mut_ptr().add(first * BAND));
        let (q_live, dout_live) = (qp.add(first * qs), op.add(first * os));
        products(sp, kt.k_strips.as_ptr().add(strip * d * BAND), d, (q_live, 1, qs), live, false);
        products(dpp, kt.v_strips.as_ptr().add(strip * dv * BAND), dv, (dout_live, 1, os), live, false);
        for r in first..rows {
            let i = q.i0 + r;
            let mut seen = g.visible(len, i).saturating_sub(key0).min(BAND);
            let p: &mut [f32; BAND] = (&mut s[r * BAND..][..BAND]).try_into().expect("a strip row");
            let ds: &mut [f32; BAND] = (&mut dp[r * BAND..][..BAND]).try_into().expect("a strip row");
            if let Some(cap) = g.softcap {
                cap_strip_row(p, ds, cap as f32, &[delta[r]; BAND]);
            }
            if let Some(mask) = mask {
                if lse[r] == f32::NEG_INFINITY {
                    seen = 0; // hidden from every key: no probabilities (exp(−∞ + ∞) is NaN)
                } else {
                    mask.apply_strip(p, seen, (q.b, q.h, i), key0);
                }
            }
            score_grads(p, ds, seen, lse[r], delta[r]);
            if !kt.dmask.is_empty() {
                // dS is the bias's gradient, score by score.
                let sums = &mut kt.dmask[(q.pair_row + r) * KEYS + strip * BAND..][..BAND];
                sums.iter_mut().zip(ds.iter()).for_each(|(sum, x)| *sum += x);
            }
            if with_dq {
                ds_rows[r * KEYS + strip * BAND..][..BAND].copy_from_slice(ds);
            }
        }
        if with_dq {
            // Rows before `first` see none of these keys, but dQ's register tiles read them.
            for r in 0..first {
                ds_rows[r * KEYS + strip * BAND..][..BAND].fill(0.0);
            }
        }
        products(kt.dv.as_mut_ptr().add(strip * dv * BAND), sp, live, (dout_live, os, 1), dv, true);
        products(kt.dk.as_mut_ptr().add(strip * d * BAND), dpp, live, (q_live, qs, 1), d, true);
    }
    if !with_dq {
        return;
    }
    for r0 in (0..rows).step_by(COLS) {
        let cols = COLS.min(rows - r0);
        let steps = g.visible(len, q.i0 + r0 + cols - 1).saturating_sub(kt.j0).min(kt.n);
        if steps == 0 {
            continue;
        }
        for panel in 0..dq_width(g) / PANEL {
            let dst = dq.as_mut_ptr().add((panel * pair_rows + q.pair_row + r0) * PANEL);
            let k_panel = kt.k_panels.as_ptr().add(panel * KEYS * PANEL);
            products(dst, k_panel, steps, (ds_rows.as_ptr().add(r0 * KEYS), 1, KEYS), cols, true);
        }
    }
}

/// Keys per tile of the dQ launch (like the forward's: a tile is read in place or widened once
/// per unit and reused by every band).
const DQ_KEYS: usize = 128;
// `mask_band` holds a band's column of a forward tile's keys; a strip row is a mask's strip.
const _: () = assert!(DQ_KEYS <= crate::flash_avx2::KEYS && BAND == crate::attention::STRIP);

/// f32 scratch of one dQ block: `scale·Qᵀ`, dOutᵀ and the dQᵀ sums as band strips, one band's
/// Sᵀ/Pᵀ and dPᵀ/dSᵀ, each row's lse and δ, K and V widened (f16, bf16), a staging row.
fn dq_tiles(g: &Geometry) -> [usize; 9] {
    let (d, dv) = (g.head_dim, g.v_dim);
    let rp = (g.group() * g.tile_q()).next_multiple_of(BAND);
    let widened = if g.dtype == DType::F32 { 0 } else { DQ_KEYS };
    [d * rp, dv * rp, d * rp, DQ_KEYS * BAND, DQ_KEYS * BAND, 2 * rp, widened * d, widened * dv, d.max(dv)]
}

/// f32 elements of scratch one dQ block needs.
pub(crate) fn dq_scratch(g: &Geometry) -> usize {
    dq_tiles(g).iter().sum()
}

/// `dQ` for one (batch, kv head, query tile) per unit, all heads of the group together: the
/// forward's layout (query rows in the lanes, `Qᵀ` and `dOutᵀ` strips built once per unit, K and
/// V rows broadcast in place) with `dQᵀ[c, lanes] += Σ_j dSᵀ[j, lanes] · K[j, c]` in place of
/// the output product.
pub(crate) fn dq<T: FloatElement>(args: &KernelArgs, ctx: BlockCtx, g: Geometry, per_block: usize) {
    // SAFETY: `applies` chose these tiles only where AVX2 and FMA run.
    unsafe { dq_avx2::<T>(args, ctx, g, per_block) }
}

/// [`dq`], compiled for AVX2.
#[target_feature(enable = "avx2,fma")]
unsafe fn dq_avx2<T: FloatElement>(args: &KernelArgs, ctx: BlockCtx, g: Geometry, per_block: usize) {
    let a = BackwardArgs::of(args);
    let (d, dv) = (g.head_dim, g.v_dim);
    let n_rows = g.q_len * g.q_heads * g.batch;
    // SAFETY: as in dkv_avx2.
    let delta = unsafe { &*(args.workspace::<f32>(0, n_rows) as *const [f32]) };
    let ws = unsafe { args.workspace::<f32>(n_rows + ctx.block_idx as usize * per_block, per_block) };
    let [qt, dot, dqt, st, dpt, stats, kt, vt, row] = carve(ws, dq_tiles(&g));
    for u in ctx.split(g.units()) {
        let t = g.query_tile(g.unit(u), a.lens.as_ref(), "attention_backward");
        let (b, hkv, rows) = (t.b, t.hkv, t.rows());
        let rp = rows.next_multiple_of(BAND);
        load_strips(&t, a.q.storage::<T>().expect("dtype dispatched"), a.q_rows, g.scale, &mut row[..d], qt);
        load_strips(&t, a.dout.storage::<T>().expect("dtype dispatched"), a.dout_rows, 1.0, &mut row[..dv], dot);
        dqt[..d * rp].fill(0.0);
        let (lse, deltas) = stats.split_at_mut(rp);
        for r in 0..rows {
            let (h, i) = t.head_pos(r);
            (lse[r], deltas[r]) = (a.lse[row_index(&g, b, h, i)], delta[row_index(&g, b, h, i)]);
        }
        let kv_end = t.kv_end(&g);
        for j0 in (0..kv_end).step_by(DQ_KEYS) {
            let n = DQ_KEYS.min(kv_end - j0);
            let (kp, ks) = f32_rows::<T>(&a.k, a.k_rows, (b, hkv, j0), n, d, kt);
            let (vp, vs) = f32_rows::<T>(&a.v, a.v_rows, (b, hkv, j0), n, dv, vt);
            for band in (0..rp).step_by(BAND) {
                let (mut seen, keys) = band_seen(&g, &t, band, (j0, n));
                if keys == 0 || !band_live(a.mask.as_ref(), &g, &t, (b, band), (j0, n)) {
                    continue;
                }
                let (band_lse, band_delta) = (&lse[band..band + BAND], &deltas[band..band + BAND]);
                let (s, ds) = (st.as_mut_ptr(), dpt.as_mut_ptr());
                // SAFETY: AVX2 and FMA run; the band's strips hold d (Qᵀ, dQᵀ) and dv (dOutᵀ) rows
                // of 16, Sᵀ and dPᵀ DQ_KEYS ≥ `keys`; K and V cover `n` ≥ `keys` rows.
                unsafe {
                    products(s, qt[strip_at(band, d)..].as_ptr(), d, (kp, 1, ks), keys, false);
                    products(ds, dot[strip_at(band, dv)..].as_ptr(), dv, (vp, 1, vs), keys, false);
                }
                if let Some(cap) = g.softcap {
                    let band_delta: &[f32; BAND] = band_delta.try_into().expect("a band");
                    for j in 0..keys {
                        let s: &mut [f32; BAND] = (&mut st[j * BAND..][..BAND]).try_into().expect("a strip row");
                        let dp: &mut [f32; BAND] = (&mut dpt[j * BAND..][..BAND]).try_into().expect("a strip row");
                        cap_strip_row(s, dp, cap as f32, band_delta);
                    }
                }
                if let Some(mask) = &a.mask {
                    mask_band(mask, &t, (b, band), (&seen, j0), st);
                    // Rows hidden from every key: no probabilities (exp(−∞ + ∞) is NaN).
                    seen.iter_mut()
                        .zip(band_lse)
                        .filter(|(_, &lse)| lse == f32::NEG_INFINITY)
                        .for_each(|(s, _)| *s = 0);
                }
                for j in 0..keys {
                    let p: &[f32; BAND] = (&st[j * BAND..][..BAND]).try_into().expect("a strip row");
                    let ds: &mut [f32; BAND] = (&mut dpt[j * BAND..][..BAND]).try_into().expect("a strip row");
                    for x in 0..BAND {
                        // Masked lanes selected to 0, as in `score_grads` (0 · a non-finite V is NaN).
                        let seen = (j as u32) < seen[x];
                        ds[x] = if seen { math::exp(p[x] - band_lse[x]) * (ds[x] - band_delta[x]) } else { 0.0 };
                    }
                }
                // SAFETY: as above.
                unsafe { products(dqt[strip_at(band, d)..].as_mut_ptr(), ds, keys, (kp, ks, 1), d, true) };
            }
        }
        for r in 0..rows {
            get_strip_row(dqt, r, &mut row[..d]);
            let (h, i) = t.head_pos(r);
            // SAFETY: this unit owns rows (b, group heads, its positions) of dq.
            unsafe { store_row::<T>(&a.dq, a.dq_rows.at(b, h, i), &mut row[..d], g.scale) };
        }
    }
}

/// Soft-caps one strip row of scores `s` (scaled already) as the forward's tiles did, folding the
/// cap's derivative into `dp` with each lane's `δ` (see the module doc).
#[inline(always)]
fn cap_strip_row(s: &mut [f32; BAND], dp: &mut [f32; BAND], cap: f32, delta: &[f32; BAND]) {
    for lane in 0..BAND {
        cap_score_and_grad(&mut s[lane], &mut dp[lane], (1.0 / cap, cap), delta[lane]);
    }
}

/// `p ← exp(s − lse)` and `ds ← p ∘ (dp − δ)` on the first `seen` lanes, both 0 after (masked
/// keys), in place over one strip row. The masked lanes are selected, not multiplied by p = 0:
/// past a sequence's `kv_lens` the cache may hold anything (NaN), and 0 · NaN would carry it
/// into dK.
#[inline(always)]
fn score_grads(p: &mut [f32; BAND], ds: &mut [f32; BAND], seen: usize, lse: f32, delta: f32) {
    for lane in 0..BAND {
        let x = if lane < seen { math::exp(p[lane] - lse) } else { 0.0 };
        p[lane] = x;
        ds[lane] = if lane < seen { x * (ds[lane] - delta) } else { 0.0 };
    }
}

#[cfg(test)]
mod tests {
    use crate::attention::run_checked_forcing;
    use crate::attention_backward::{Route, ROUTE_FORCED};
    use crate::flash_avx2::FORCED;
    use uniop::half::{bf16, f16};
    use uniop::verify::Rng;
    use uniop::{AttrValue, Element, TensorRef};

    fn random<T: Element>(shape: &[usize], seed: u64) -> Vec<T> {
        let mut rng = Rng::new(seed);
        (0..shape.iter().product()).map(|_| T::from_f64(2.0 * rng.uniform())).collect()
    }

    fn view<'a, T: Element>(x: &'a [T], shape: &[usize]) -> Option<TensorRef<'a>> {
        Some(TensorRef::new(x, shape).unwrap())
    }

    /// The kernels this CPU runs: the GEMM tiles always, these where AVX2 and FMA are present.
    fn kernels() -> Vec<bool> {
        let avx2 = is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma");
        [false].into_iter().chain(avx2.then_some(true)).collect()
    }

    /// Gradients of type `T` on each kernel, each checked against the f64 reference: `batch`
    /// rows of q `[batch, 6, s, d]` over kv `[batch, 2, s, *]` (v with `dv` dims), the saved
    /// out and lse from the forward, `lens` as kv_lens.
    fn gradients<T: Element>(
        batch: usize,
        s: usize,
        (d, dv): (usize, usize),
        causal: bool,
        lens: Option<&[i64]>,
    ) -> Vec<Vec<Vec<f64>>> {
        masked_gradients::<T>((batch, s), (d, dv), (causal, None), (lens, None), None)
    }

    /// [`gradients`] under `softcap` and `mask` too (with its gradient when it is a float mask), on
    /// `route` when given.
    fn masked_gradients<T: Element>(
        (batch, s): (usize, usize),
        (d, dv): (usize, usize),
        (causal, softcap): (bool, Option<f64>),
        (lens, mask): (Option<&[i64]>, Option<TensorRef>),
        route: Option<Route>,
    ) -> Vec<Vec<Vec<f64>>> {
        let (q_shape, k_shape, v_shape) = ([batch, 6, s, d], [batch, 2, s, d], [batch, 2, s, dv]);
        let (q, k, v) = (random::<T>(&q_shape, 1), random::<T>(&k_shape, 2), random::<T>(&v_shape, 3));
        let o_shape = [batch, 6, s, dv];
        let dout = random::<T>(&o_shape, 4);
        let lens = lens.map(|l| TensorRef::new(l, &[batch]).unwrap());
        let softcap = softcap.map_or(AttrValue::None, AttrValue::Float);
        let attrs = [("causal", AttrValue::Bool(causal)), ("softcap", softcap)];
        let fwd = run_checked_forcing(
            "attention",
            &[view(&q, &q_shape), view(&k, &k_shape), view(&v, &v_shape), lens.clone(), mask.clone()],
            &attrs,
            || {},
        );
        // A float mask's gradient is asked for too.
        let needs_dmask = mask.as_ref().is_some_and(|m| m.dtype().is_float());
        let attrs = [attrs[0].clone(), attrs[1].clone(), ("needs_dmask", AttrValue::Bool(needs_dmask))];
        let out: Vec<T> = fwd[0].iter().map(|&x| T::from_f64(x)).collect();
        let lse: Vec<f32> = fwd[1].iter().map(|&x| x as f32).collect();
        let inputs = [
            view(&dout, &o_shape),
            view(&q, &q_shape),
            view(&k, &k_shape),
            view(&v, &v_shape),
            view(&out, &o_shape),
            view(&lse, &q_shape[..3]),
            lens,
            mask,
        ];
        kernels()
            .into_iter()
            .map(|key_lanes| {
                run_checked_forcing("attention_backward", &inputs, &attrs, || {
                    FORCED.with(|f| f.set(Some(key_lanes)));
                    ROUTE_FORCED.with(|f| f.set(route));
                })
            })
            .collect()
    }

    /// The two kernels' f32 gradients (when this CPU runs both) agree.
    fn assert_agree(runs: &[Vec<Vec<f64>>], what: &str) {
        if let [gemm, key_lanes] = runs {
            for (a, b) in gemm.iter().flatten().zip(key_lanes.iter().flatten()) {
                assert!(a == b || (a - b).abs() <= 1e-5 * (1.0 + a.abs()), "{what}: kernels disagree, {a} vs {b}");
            }
        }
    }

    /// Five key tiles, the last ending inside a strip (300 = 4·64 + 2·16 + 12); three query blocks
    /// per head, the last partial; GQA; a head dim that is no multiple of the 6 broadcast columns
    /// and ends inside a dQ panel (20); a value dim of 40; causal and not; on the fused launch
    /// (dQ summed with dK/dV: more (batch, kv head) pairs than twice the threads) and the split
    /// one; f32, f16 and bf16. In f32 the two kernels also agree with each other.
    #[test]
    fn both_dkv_kernels_match_the_reference_across_tiles_strips_and_panels() {
        let threads = uniop::runtime::Pool::global().threads();
        for batch in [1, threads] {
            for causal in [false, true] {
                assert_agree(
                    &gradients::<f32>(batch, 300, (20, 40), causal, None),
                    &format!("batch {batch} causal {causal}"),
                );
                gradients::<f16>(batch, 300, (20, 40), causal, None);
                gradients::<bf16>(batch, 300, (20, 40), causal, None);
            }
        }
    }

    /// Decode-style cache lengths under the bottom-right causal mask, one so short that most
    /// queries see no key (their rows get zero gradient), and not causal (keys past the length
    /// get zero gradient).
    #[test]
    fn both_dkv_kernels_read_kv_lens() {
        let threads = uniop::runtime::Pool::global().threads();
        let lens: Vec<i64> = (0..2 * threads).map(|b| if b % 2 == 0 { 100 } else { 30 }).collect();
        for causal in [true, false] {
            gradients::<f32>(2, 100, (16, 16), causal, Some(&lens[..2]));
            gradients::<f32>(2 * threads, 100, (16, 16), causal, Some(&lens));
        }
    }

    /// Masks on the fused launch (dQ with dK/dV) and the split one (dK/dV, then the dQ launch),
    /// causal and not, in f32 (the kernels also agreeing) and bf16: a sliding window (boolean
    /// `[s, s]`, whose tiles far from the diagonal are skipped), ALiBi-like biases with hidden keys
    /// (float, per head: shared by the batch, and one per batch row) and a left padding of batch
    /// row 0's first 200 keys (boolean, and as transformers 4.x's lowest-value float mask), under
    /// which, causal, 200 queries see no key (lse −∞, zero gradients). The float masks' gradients
    /// too: the two biases' summed by AVX2's dK/dV launch (over the batch for the shared one), the
    /// padding's by the `dmask` step.
    #[test]
    fn both_dkv_kernels_apply_masks() {
        let s = 300usize;
        let window: Vec<bool> = (0..s * s).map(|x| x % s + 40 > x / s && x % s <= x / s).collect();
        let alibi: Vec<f32> = (0..2 * 6 * s * s)
            .map(|x| {
                let (b, h, i, j) = (x / (6 * s * s), x / (s * s) % 6, x / s % s, x % s);
                if (i + j + b) % 7 == 3 && i != j {
                    f32::NEG_INFINITY
                } else {
                    -0.02 * (h + 1 + b) as f32 * i.abs_diff(j) as f32
                }
            })
            .collect();
        let padding: Vec<bool> = (0..2 * s).map(|x| x / s == 1 || x % s >= 200).collect();
        let lowest: Vec<f32> = padding.iter().map(|&keep| if keep { 0.0 } else { f32::MIN }).collect();
        let masks = [
            ("window", view(&window, &[s, s])),
            ("alibi", view(&alibi[..6 * s * s], &[1, 6, s, s])),
            ("alibi per row", view(&alibi, &[2, 6, s, s])),
            ("padding", view(&padding, &[2, 1, 1, s])),
            ("lowest", view(&lowest, &[2, 1, 1, s])),
        ];
        for (name, mask) in masks {
            for route in [Route::Fused { chunks: 1 }, Route::Split] {
                for causal in [false, true] {
                    let at = (2, s);
                    let masked = (None, mask.clone());
                    let runs = masked_gradients::<f32>(at, (20, 40), (causal, None), masked.clone(), Some(route));
                    assert_agree(&runs, &format!("{name} {route:?} causal {causal}"));
                    masked_gradients::<bf16>(at, (20, 40), (causal, None), masked, Some(route));
                }
            }
        }
    }

    /// An empty batch under a learned bias: its gradient is zeros, which the `dmask` step writes
    /// (this launch has no units to).
    #[test]
    fn an_empty_batch_gets_a_zero_dmask() {
        let s = 70;
        let bias = vec![0.25f32; 6 * s * s];
        for route in [Route::Fused { chunks: 1 }, Route::Split] {
            let masked = (None, view(&bias, &[1, 6, s, s]));
            for run in masked_gradients::<f32>((0, s), (20, 40), (false, None), masked, Some(route)) {
                assert!(run[3].len() == bias.len() && run[3].iter().all(|&g| g == 0.0), "{route:?}");
            }
        }
    }

    /// A softcap of 2 (the scaled scores reach ~5 here, so the cap bends most of them), on the
    /// fused and the split launches, causal and not, in f32 (the kernels also agreeing) and bf16:
    /// alone, with cache lengths, and under a float per-head bias with hidden keys, whose gradient
    /// (the capped scores', the cap's derivative left out) the `dmask` step sums.
    #[test]
    fn both_dkv_kernels_apply_softcap() {
        let s = 200usize;
        let bias: Vec<f32> =
            (0..6 * s * s).map(|x| if x % 13 == 4 { f32::NEG_INFINITY } else { 0.5 - (x % 7) as f32 * 0.1 }).collect();
        let lens = [200i64, 97];
        let cases = [
            ("alone", (None, None)),
            ("kv_lens", (Some(&lens[..]), None)),
            ("bias", (None, view(&bias, &[1, 6, s, s]))),
        ];
        for (name, extras) in cases {
            for route in [Route::Fused { chunks: 1 }, Route::Split] {
                for causal in [false, true] {
                    let capped = (causal, Some(2.0));
                    let runs = masked_gradients::<f32>((2, s), (20, 40), capped, extras.clone(), Some(route));
                    assert_agree(&runs, &format!("softcap {name} {route:?} causal {causal}"));
                    masked_gradients::<bf16>((2, s), (20, 40), capped, extras.clone(), Some(route));
                }
            }
        }
    }
}
