//! `attention_backward(dout, q, k, v, out, lse, kv_lens, causal, scale, mask, needs_dmask, softcap,
//! sinks) -> (dq, dk, dv, dmask, dsinks)`: the gradient of [`attention`](crate::attention),
//! flash-style: probabilities are recomputed tile by tile from the saved `lse`, never stored whole.
//! A float mask's own gradient, `dmask`, is a step of its own, run only when asked for
//! ([`attention_mask_grad`](crate::attention_mask_grad)).
//!
//! With `P = exp(S − lse)`, `δ_i = Σ dout_i · out_i` and `dS = P ∘ (dout·Vᵀ − δ)`:
//! `dV = Pᵀ·dout`, `dK = scale · dSᵀ·Q`, `dQ = scale · dS·K`. Under a `softcap` S is the capped
//! score and dS takes the cap's derivative before dK and dQ ([`cap_for_grads`]). `sinks` change
//! none of this: the saved `lse` already counts each row's sink, so `P` is the real keys' share,
//! and a sink is a key whose value is zero (its `dout·v` term is 0, `δ` is unchanged). Its own
//! gradient is `dsinks[h] = −Σ_{b,i} exp(sinks[h] − lse) · δ` ([`sinks_grad_kernel`]).
//! `dsinks` and `dmask` sum over batch rows; `batch_dims` keeps those sums apart per sample (the
//! first `batch_dims` batch dims: see [`per_sample`](crate::per_sample)), so per-sample gradients
//! of a shared bias or of the sinks take one call.
//!
//! Each block owns what it writes (deterministic, no atomics). First δ per query row (into the
//! workspace). Then one launch walks each (batch, kv head) pair's key tiles, summing `dK`/`dV` per
//! tile over the group's q heads and every query tile that sees those keys, and `dQ` in an f32
//! workspace region: 5 tile products per (query tile, key tile). Where the pairs alone would leave
//! threads idle, each pair's query tiles are dealt to several units, which sum `dK`/`dV` over their
//! own query tiles into partial sums that a last launch adds up ([`Route`]). Only where a pair has
//! too few query tiles to deal out (or on AVX2 CPUs) is the work split over two launches — per
//! (batch, kv head, key tile) `dK`/`dV`, then per (batch, kv head, query tile) `dQ` like the
//! forward — which recompute the scores in both (7 tile products).
//! bf16 runs every product on the AVX512-BF16 GEMM with P and dS rounded to bf16, like the forward;
//! on CPUs without AVX512-BF16 its tiles are widened to f32 like f16's (see `on_bf16_gemm`).
//! Every product stops at the keys its rows see, so nothing past `kv_lens` is read. On the packed
//! GEMMs (bf16, and f32 on AVX-512: [`Products`]) the dK/dV launch packs a key tile's K and V
//! once for every query tile that multiplies them, and causal diagonal tiles go in pieces.
//!
//! On CPUs whose best level is AVX2 the dK/dV launch (with dQ when fused) runs the tiles of
//! `flash_backward_avx2.rs` instead: keys in the vector lanes, operands packed once per key tile
//! rather than per product, and causal diagonal tiles at about half cost (why, and the layout,
//! are there).

use crate::attention::{
    bf16_scores, bf16_tile, cap_scores, carve, f32_rows, geometry, load_scaled, narrow_step, parts_for_even_share,
    reference_bias, reference_cap, reference_mask_index, row_len, rows_of, scores, spreads_evenly, Geometry, MaskRows,
    Rows4, DIAGONAL_PIECE_ROWS, DTYPES, TILE_KEYS, TILE_ROWS, W,
};
use crate::attention_mask_grad::{mask_grad_kernel, MaskGrad};
use crate::math;
use crate::matmul::{gemm_rows, Dst, Mat};
use crate::packed_gemm::{gemm_rows_packed, gemm_rows_prepacked, Packed, PackedRhs};
use crate::per_sample::Samples;
use crate::skinny::{Dots, Simd};
use std::ops::Range;
use uniop::half::bf16;
use uniop::layout::ShapeDisplay;
use uniop::{
    with_float_dtype, AttrValue, BlockCtx, DType, ErrorCode, Example, FloatElement, KernelArgs, LayoutNeed, Op, OpCx,
    OutputView, Plan, RefTensor, Result, Step, TensorMeta, TensorRef,
};

pub struct AttentionBackward;

/// Flattened input positions (kv_lens and mask are optional).
const DOUT: usize = 0;
const Q: usize = 1;
const K: usize = 2;
const V: usize = 3;
const OUT: usize = 4;
const LSE: usize = 5;
const KV_LENS: usize = 6;
const MASK: usize = 7;
const SINKS: usize = 8;

/// How `batch_dims` cuts the call's flat batch rows into samples, each summing its own `dmask`
/// and `dsinks`: `count` samples of `rows` consecutive batch rows.
#[derive(Clone, Copy, Debug)]
pub(crate) struct SampleRows {
    pub count: usize,
    pub rows: usize,
}

impl SampleRows {
    fn of(samples: &Samples) -> SampleRows {
        SampleRows { count: samples.count, rows: samples.rows }
    }
}

/// The samples of `batch_dims` (checked: at most q's batch dims), whose dims come in front of
/// `dmask` and `dsinks`.
fn batch_samples(cx: &OpCx) -> Result<Samples> {
    Samples::of(cx, "q", cx.input("q").rank().saturating_sub(3))
}

/// The float mask whose gradient the call asks for (`needs_dmask`), or `None` when it asks for
/// none. Asking without a float mask is an error: a boolean mask (or none) has no gradient; so is
/// a mask reaching into the sample dims of `batch_dims`, whose per-sample gradient would be its
/// own slice (a per-sample mask is batched by the caller: one call per sample).
fn mask_grad<'c>(cx: &'c OpCx, samples: &Samples) -> Result<Option<&'c TensorMeta>> {
    if !cx.needs_grad("mask") {
        return Ok(None);
    }
    match cx.optional_input("mask") {
        Some(mask) if mask.dtype.is_float() => {
            let shared_dims = cx.input("q").rank() - samples.dims.len();
            if mask.rank() > shared_dims {
                return Err(cx.err(
                    ErrorCode::Shape,
                    "mask",
                    format!(
                        "at most {shared_dims} dims with needs_dmask and batch_dims {} (one mask shared by every \
                         sample, its gradient summed per sample)",
                        samples.dims.len()
                    ),
                    format!("shape {}", ShapeDisplay(mask.shape())),
                ));
            }
            Ok(Some(mask))
        }
        given => Err(cx.err(
            ErrorCode::ParamInvalid,
            "needs_dmask",
            "false unless mask is a float mask (a boolean mask, or none, has no gradient)",
            format!("true with {}", given.map_or("no mask".to_string(), |m| format!("a {} mask", m.dtype))),
        )),
    }
}

fn checked_geometry(cx: &OpCx) -> Result<Geometry> {
    let g = geometry(cx)?;
    let out_shape = g.batch_dims.then(&[g.q_heads, g.q_len, g.v_dim]);
    cx.expect_same_dtype("out", g.dtype, "q")?;
    cx.expect_shape("out", &out_shape)?;
    cx.expect_same_dtype("dout", g.dtype, "q")?;
    cx.expect_shape("dout", &out_shape)?;
    cx.expect_dtype_in("lse", &[DType::F32])?;
    cx.expect_shape("lse", &g.batch_dims.then(&[g.q_heads, g.q_len]))?;
    Ok(g)
}

#[cfg(test)]
thread_local! {
    /// Tests run bf16 both on the bf16 GEMM and widened, on any CPU.
    pub(crate) static BF16_GEMM_FORCED: std::cell::Cell<Option<bool>> = const { std::cell::Cell::new(None) };
}

/// Whether bf16 products run on the bf16 GEMM (Q and dout rows copied as they are into the f32
/// tiles' space, K and V read in place, P and dS rounded to bf16): where the CPU has
/// AVX512-BF16's pair products. Elsewhere bf16 tiles are widened to f32 like f16's and run on
/// the f32 GEMM — on AVX2 CPUs about twice as fast as the bf16 GEMM's widening micro-kernel.
pub(crate) fn on_bf16_gemm(g: &Geometry) -> bool {
    #[cfg(test)]
    if let Some(forced) = BF16_GEMM_FORCED.with(|f| f.get()) {
        return forced && g.dtype == DType::BF16;
    }
    g.dtype == DType::BF16 && <bf16 as Dots>::best() == Simd::Avx512
}

/// The last two scratch tiles of a kernel working on `rows` query rows: P and dS rounded to bf16
/// (on the bf16 GEMM), K and V widened to f32 (f16, bf16 off it), none (f32).
fn extra_tiles(g: &Geometry, rows: usize, bf16_gemm: bool) -> [usize; 2] {
    match g.dtype {
        DType::F32 => [0, 0],
        _ if bf16_gemm => [rows * TILE_KEYS / 2; 2],
        _ => [TILE_KEYS * g.head_dim, TILE_KEYS * g.v_dim],
    }
}

fn dkv_tiles(g: &Geometry, bf16_gemm: bool) -> [usize; 8] {
    let (d, dv, tr) = (g.head_dim, g.v_dim, TILE_ROWS.min(g.q_len.max(1)));
    let [x, y] = extra_tiles(g, KEY_GRAD_ROWS.min(g.q_len.max(1)), bf16_gemm);
    [tr * d, tr * dv, tr * TILE_KEYS, tr * TILE_KEYS, TILE_KEYS * d, TILE_KEYS * dv, x, y]
}

fn dq_tiles(g: &Geometry, bf16_gemm: bool) -> [usize; 7] {
    let (d, dv, rows) = (g.head_dim, g.v_dim, g.group() * g.tile_q());
    let [x, y] = extra_tiles(g, rows, bf16_gemm);
    [rows * d, rows * dv, rows * TILE_KEYS, rows * TILE_KEYS, rows * d, x, y]
}

/// Per-block scratch (f32 elements): the larger of the dK/dV and the dQ launches.
fn block_scratch(g: &Geometry, bf16_gemm: bool) -> usize {
    dkv_tiles(g, bf16_gemm).iter().sum::<usize>().max(dq_tiles(g, bf16_gemm).iter().sum())
}

/// A bf16 input's elements (the kernel was dispatched for bf16).
pub(crate) fn bf16_of<'a>(t: &uniop::TensorRef<'a>) -> &'a [bf16] {
    t.storage::<bf16>().expect("dtype dispatched")
}

/// The backward's operands and outputs with their row addressing, as its kernels read them.
pub(crate) struct BackwardArgs<'a> {
    pub dout: TensorRef<'a>,
    pub q: TensorRef<'a>,
    pub k: TensorRef<'a>,
    pub v: TensorRef<'a>,
    pub lens: Option<TensorRef<'a>>,
    pub mask: Option<MaskRows<'a>>,
    /// The contiguous `[..., Hq, Sq]` lse from its first element.
    pub lse: &'a [f32],
    pub dq: OutputView<'a>,
    pub dk: OutputView<'a>,
    pub dv: OutputView<'a>,
    pub dout_rows: Rows4,
    pub q_rows: Rows4,
    pub k_rows: Rows4,
    pub v_rows: Rows4,
    pub dq_rows: Rows4,
    pub dk_rows: Rows4,
    pub dv_rows: Rows4,
}

impl<'a> BackwardArgs<'a> {
    pub fn of(args: &'a KernelArgs) -> BackwardArgs<'a> {
        let (dout, q, k, v, lse) = (args.input(DOUT), args.input(Q), args.input(K), args.input(V), args.input(LSE));
        let (dq, dk, dv) = (args.output(0), args.output(1), args.output(2));
        BackwardArgs {
            dout_rows: Rows4::of(dout.layout()),
            q_rows: Rows4::of(q.layout()),
            k_rows: Rows4::of(k.layout()),
            v_rows: Rows4::of(v.layout()),
            dq_rows: Rows4::of(dq.layout()),
            dk_rows: Rows4::of(dk.layout()),
            dv_rows: Rows4::of(dv.layout()),
            lse: &lse.storage::<f32>().expect("lse is f32")[lse.layout().offset()..],
            lens: args.optional_input(KV_LENS),
            mask: MaskRows::of(args.optional_input(MASK), &q),
            dout,
            q,
            k,
            v,
            dq,
            dk,
            dv,
        }
    }

    /// How many of the scores `s` of query `(b, h, i)` (keys from `j0`, the first `visible` of
    /// them unmasked by `kv_lens` and `causal`) enter the gradients: those, with the ones `mask`
    /// hides set to −∞ (probability 0), or none for a query that saw no key (lse −∞, which would
    /// turn a hidden score into NaN).
    #[inline(always)]
    pub(crate) fn live_keys(
        &self,
        s: &mut [f32],
        (b, h, i): (usize, usize, usize),
        j0: usize,
        visible: usize,
        lse: f32,
        scale: f32,
    ) -> usize {
        let Some(mask) = &self.mask else { return visible };
        if lse == f32::NEG_INFINITY {
            return 0;
        }
        let live = visible.min(s.len());
        mask.apply(&mut s[..live], (b, h, i), j0, scale);
        live
    }
}

/// Soft-caps the first `visible` raw scores of a row as the forward did ([`cap_scores`]), before
/// the mask applies, and folds the cap's derivative `1 − t²` (t the tanh) into the row's `dp`
/// (`dp ← (dp − δ)(1 − t²) + δ`), so that [`probs_and_dscores_row`]'s `dS = P ∘ (dp − δ)` comes
/// out as the gradient of the uncapped scores, which dQ and dK take. A float mask's gradient
/// (added after the cap) takes the capped scores' own: its step passes no `dp`.
pub(crate) fn cap_for_grads(
    g: &Geometry,
    (s, dp): (&mut [f32], Option<&mut [f32]>),
    visible: usize,
    scale: f32,
    delta: f32,
) {
    let Some(cap) = g.softcap else { return };
    let live = visible.min(s.len());
    match dp {
        Some(dp) => cap_row_and_grads(&mut s[..live], &mut dp[..live], (scale / cap as f32, cap as f32 / scale), delta),
        None => cap_scores(&mut s[..live], scale, cap as f32),
    }
}

crate::simd_kernel! {
/// [`cap_for_grads`]' loop with `dp`: `inward` scales a raw score into tanh's argument, `outward`
/// scales the tanh back to a raw score.
fn cap_row_and_grads(s: &mut [f32], dp: &mut [f32], (inward, outward): (f32, f32), delta: f32) {
    for (v, d) in s.iter_mut().zip(dp.iter_mut()) {
        cap_score_and_grad(v, d, (inward, outward), delta);
    }
}
}

/// One score of [`cap_for_grads`] with `dp`, inlined into the caller's vector level (the AVX2
/// backward tiles cap theirs a strip row at a time).
#[inline(always)]
pub(crate) fn cap_score_and_grad(s: &mut f32, dp: &mut f32, (inward, outward): (f32, f32), delta: f32) {
    let t = math::tanh(*s * inward);
    *s = outward * t;
    *dp = (*dp - delta).mul_add(t.mul_add(-t, 1.0), delta);
}

/// `lse` and `δ` of query `(b, h, i)`: index into the `[B, Hq, Sq]` row arrays.
pub(crate) fn row_index(g: &Geometry, b: usize, h: usize, i: usize) -> usize {
    (b * g.q_heads + h) * g.q_len + i
}

/// Where [`probs_and_dscores_row`] leaves P and dS: over the f32 score rows, or rounded to bf16
/// for the bf16 GEMM into rows of their own (dS, and P unless `None`: the dQ launch needs none).
type Bf16Rows<'a> = Option<(Option<&'a mut [bf16]>, &'a mut [bf16])>;

crate::simd_kernel! {
/// One row of the score tiles: `P = exp(scale·s − lse)` and `dS = P ∘ (dp − δ)` (the score
/// gradient) on the first `visible` entries, both 0 after (masked keys), where `bf16_rows` says.
/// Scores come unscaled from the bf16 GEMM (`scale` applied here) or from a pre-scaled Q
/// (`scale` 1); the exp is [`math::exp_for`] `T`, as the forward's. bf16 rows are rounded in
/// registers, in the same pass (a pass of its own over the f32 rows took as long as this one).
pub(crate) fn probs_and_dscores_row<T: FloatElement>(s: &mut [f32], dp: &mut [f32], bf16_rows: Bf16Rows<'_>, visible: usize, scale: f32, lse: f32, delta: f32) {
    let live = visible.min(s.len());
    let step = |v: f32, d: f32| {
        let p = math::exp_for::<T>(v.mul_add(scale, -lse));
        (p, p * (d - delta))
    };
    let Some((p, ds)) = bf16_rows else {
        s[live..].fill(0.0);
        dp[live..].fill(0.0);
        for (v, d) in s[..live].iter_mut().zip(&mut dp[..live]) {
            (*v, *d) = step(*v, *d);
        }
        return;
    };
    let (s, dp) = (&s[..live], &dp[..live]);
    ds[live..].fill(bf16::ZERO);
    match p {
        Some(p) => {
            p[live..].fill(bf16::ZERO);
            match bf16::converts_natively() {
                true => narrowed_grads::<true, true>(s, dp, (p, ds), step),
                false => narrowed_grads::<true, false>(s, dp, (p, ds), step),
            }
        }
        None if bf16::converts_natively() => narrowed_grads::<false, true>(s, dp, (&mut [], ds), step),
        None => narrowed_grads::<false, false>(s, dp, (&mut [], ds), step),
    }
}
}

/// [`probs_and_dscores_row`]'s bf16 rows of the visible entries: `step` maps a score and its
/// `dp` to P and dS; P is stored when `WITH_P`, both narrowed by the CPU's instruction when
/// `NATIVE` (only where `bf16::converts_natively()`, checked by the caller).
#[inline(always)]
fn narrowed_grads<const WITH_P: bool, const NATIVE: bool>(
    s: &[f32],
    dp: &[f32],
    (p, ds): (&mut [bf16], &mut [bf16]),
    step: impl Fn(f32, f32) -> (f32, f32),
) {
    let full = s.len() - s.len() % W;
    for (at, (sw, dpw)) in (0..full).step_by(W).zip(s.chunks_exact(W).zip(dp.chunks_exact(W))) {
        let (mut pw, mut dsw) = ([0f32; W], [0f32; W]);
        for (((p, ds), &x), &d) in pw.iter_mut().zip(&mut dsw).zip(sw).zip(dpw) {
            (*p, *ds) = step(x, d);
        }
        // SAFETY: `NATIVE` only where the caller found `bf16::converts_natively()`.
        unsafe {
            if WITH_P {
                narrow_step::<NATIVE>(&pw, (&mut p[at..at + W]).try_into().expect("W lanes"));
            }
            narrow_step::<NATIVE>(&dsw, (&mut ds[at..at + W]).try_into().expect("W lanes"));
        }
    }
    for i in full..s.len() {
        let (pv, dsv) = step(s[i], dp[i]);
        if WITH_P {
            p[i] = bf16::from_f32(pv);
        }
        ds[i] = bf16::from_f32(dsv);
    }
}

/// The scale the scores still need, and `dK` with them: the bf16 GEMM's come unscaled (scaled as
/// P is computed), the f32 path loads Q scaled.
pub(crate) fn score_scale(g: &Geometry, bf16_gemm: bool) -> f32 {
    if bf16_gemm {
        g.scale
    } else {
        1.0
    }
}

/// Step 1: `δ` for every query row, into the workspace's first `B·Hq·Sq` floats.
fn delta_kernel<T: FloatElement>(args: &KernelArgs, ctx: BlockCtx, g: Geometry) {
    let (dout, out) = (args.input(DOUT), args.input(OUT));
    let (dr, or) = (Rows4::of(dout.layout()), Rows4::of(out.layout()));
    let (ds, os) = (dout.storage::<T>().unwrap(), out.storage::<T>().unwrap());
    let rows = g.batch * g.q_heads * g.q_len;
    let range = ctx.split(rows);
    // SAFETY: block b writes only its rows of the δ region.
    let delta = unsafe { args.workspace::<f32>(range.start, range.len()) };
    const CHUNK: usize = 64;
    let (mut a, mut c) = ([0f32; CHUNK], [0f32; CHUNK]);
    for (row, dst) in range.zip(delta) {
        let (b, h, i) = (row / (g.q_heads * g.q_len), row / g.q_len % g.q_heads, row % g.q_len);
        let (dout_row, out_row) = (&ds[dr.at(b, h, i)..][..g.v_dim], &os[or.at(b, h, i)..][..g.v_dim]);
        *dst = 0.0;
        for (x, y) in dout_row.chunks(CHUNK).zip(out_row.chunks(CHUNK)) {
            T::widen(x, &mut a[..x.len()]);
            T::widen(y, &mut c[..y.len()]);
            *dst += a[..x.len()].iter().zip(&c[..y.len()]).map(|(x, y)| x * y).sum::<f32>();
        }
    }
}

/// `dsinks[s, h] = −Σ_{b,i} exp(sinks[h] − lse) · δ` over sample `s`'s batch rows `b`, for this
/// block's (sample, q head) pairs (f64 sums: a pair sums `rows · Sq` terms). A row with
/// `lse = −∞` (no key and a sink of −∞) adds nothing.
fn sinks_grad_kernel(args: &KernelArgs, ctx: BlockCtx, g: Geometry, samples: SampleRows) {
    let n_rows = g.batch * g.q_heads * g.q_len;
    // SAFETY: the δ rows are written by the first step and only read from then on.
    let delta = unsafe { &*(args.workspace::<f32>(0, n_rows) as *const [f32]) };
    let (lse, sinks) = (args.input(LSE), args.input(SINKS).to_f64_vec());
    let lse = &lse.storage::<f32>().expect("lse is f32")[lse.layout().offset()..][..n_rows];
    let dsinks = args.output(4);
    for pair in ctx.split(samples.count * g.q_heads) {
        let (sample, h) = (pair / g.q_heads, pair % g.q_heads);
        let rows = (sample * samples.rows..(sample + 1) * samples.rows).flat_map(|b| {
            let at = (b * g.q_heads + h) * g.q_len;
            lse[at..at + g.q_len].iter().zip(&delta[at..at + g.q_len])
        });
        let share = |l: f32| if l == f32::NEG_INFINITY { 0.0 } else { (sinks[h] - l as f64).exp() };
        let sum: f64 = rows.map(|(&l, &d)| share(l) * d as f64).sum();
        // SAFETY: this block alone owns element (sample, h) of dsinks.
        unsafe { narrow_into(&dsinks, dsinks.layout().offset() + pair, &[-sum as f32]) };
    }
}

/// Narrows `src` into `dst` from element `at`, in `dst`'s own float dtype (a mask's or the sinks'
/// gradient, whose dtype is theirs rather than the op's).
///
/// # Safety
/// The block must own those elements.
pub(crate) unsafe fn narrow_into(dst: &OutputView<'_>, at: usize, src: &[f32]) {
    match dst.meta().dtype {
        DType::F32 => f32::narrow(src, dst.slice_mut::<f32>(at, src.len())),
        DType::F16 => uniop::half::f16::narrow(src, dst.slice_mut::<uniop::half::f16>(at, src.len())),
        _ => bf16::narrow(src, dst.slice_mut::<bf16>(at, src.len())),
    }
}

/// Writes `src · scale` into row `at` of `dst` (this block's row).
///
/// # Safety
/// The block must own that row.
pub(crate) unsafe fn store_row<T: FloatElement>(dst: &OutputView<'_>, at: usize, src: &mut [f32], scale: f32) {
    if scale != 1.0 {
        src.iter_mut().for_each(|v| *v *= scale);
    }
    T::narrow(src, dst.slice_mut::<T>(at, src.len()));
}

/// Operands of the dK/dV products of some query rows and a key tile: `p` and `ds` are
/// `[rows][TILE_KEYS]` tiles, `dout` and `q` the rows' `rows × dv` and `rows × d` (scratch
/// copies, or the inputs' rows in place).
struct Tiles<E> {
    p: *const E,
    ds: *const E,
    dout: Mat<E>,
    q: Mat<E>,
}

/// A tile GEMM ([`gemm_rows`] or [`gemm_rows_packed`]) summing into f32.
type TileGemm<E> = unsafe fn(std::ops::Range<usize>, usize, usize, Dst<f32>, Mat<E>, Mat<E>, bool);

/// `dV += Pᵀ·dout`, `dK += dSᵀ·Q` (transposes are strides) over `rows` query rows, for `keys` of
/// the key tile.
///
/// # Safety
/// Every pointer valid for `(rows, keys.end, d, dv)` as laid out in [`Tiles`].
unsafe fn key_grad_products<E>(
    gemm: TileGemm<E>,
    t: Tiles<E>,
    (rows, keys, d, dv): (usize, Range<usize>, usize, usize),
    dv_acc: &mut [f32],
    dk_acc: &mut [f32],
) {
    let transposed = |ptr| Mat { ptr, rs: 1, cs: TILE_KEYS as isize };
    let sums = |ptr, width: usize| Dst { ptr, rs: width as isize, cs: 1 };
    unsafe {
        gemm(keys.clone(), dv, rows, sums(dv_acc.as_mut_ptr(), dv), transposed(t.p), t.dout, true);
        gemm(keys, d, rows, sums(dk_acc.as_mut_ptr(), d), transposed(t.ds), t.q, true);
    }
}

/// Query rows whose P and dS wait in the bf16 tiles for their dK/dV products: rows
/// `first..first + rows` of head `h`, seeing `keys` of the key tile at most. Products over
/// a few query rows are shallow (a causal diagonal piece is 32 deep), and each one loads and
/// stores the key tile's f32 dK/dV sums (256 KiB at 256 keys × 128 × 2): consecutive pieces of a
/// head go into one product instead.
#[derive(Clone, Copy)]
struct PendingRows {
    h: usize,
    first: usize,
    rows: usize,
    keys: (usize, usize),
}

/// Query rows the bf16 P and dS tiles of the dK/dV launch hold ([`PendingRows`]).
const KEY_GRAD_ROWS: usize = 512;

/// Which tiles the backward runs: the GEMM tiles here, or on AVX2 CPUs those of
/// `flash_backward_avx2.rs` (`scratch` is their per-block need, both launches of the split).
#[derive(Clone, Copy)]
struct KeyLanes {
    scratch: Option<usize>,
    key_tile: usize,
    /// Columns per query row of the fused launch's dQ sums.
    dq_width: usize,
    /// Whether the dK/dV launch sums `dmask` (in place of the `dmask` step), and how.
    dmask: Option<crate::flash_backward_avx2::DmaskSums>,
}

fn key_lanes(g: &Geometry, fused: bool, dmask: Option<&MaskGrad>) -> KeyLanes {
    #[cfg(target_arch = "x86_64")]
    if crate::flash_backward_avx2::applies(g) {
        use crate::flash_backward_avx2 as avx2;
        let sums = dmask.and_then(|m| avx2::sums_dmask(g, m));
        let scratch = match fused {
            true => avx2::scratch(g, true, sums),
            false => avx2::scratch(g, false, sums).max(avx2::dq_scratch(g)),
        };
        return KeyLanes { scratch: Some(scratch), key_tile: avx2::KEYS, dq_width: avx2::dq_width(g), dmask: sums };
    }
    let _ = dmask; // only AVX2's tiles sum it in their dK/dV launch
    KeyLanes { scratch: None, key_tile: TILE_KEYS, dq_width: g.head_dim, dmask: None }
}

/// How the backward divides its work between the launches and the threads.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Route {
    /// `dQ` summed inside the `dK`/`dV` launch (5 tile products per query tile and key tile),
    /// each (batch, kv head) pair's query tiles dealt to `chunks` units. With one chunk a unit
    /// owns its pair's `dK`/`dV` outright; with more, each unit sums them over its own query
    /// tiles into partial sums that one more launch adds up, so that a few pairs still keep every
    /// thread busy without the split's recomputed scores.
    Fused { chunks: usize },
    /// `dK`/`dV` per (pair, key tile), then `dQ` per (pair, query tile), both computing the scores
    /// (7 tile products): where a pair's query tiles are too few to deal out, and on AVX2 CPUs
    /// (whose tiles, in `flash_backward_avx2.rs`, sum dQ only with one chunk).
    Split,
}

#[cfg(test)]
thread_local! {
    /// Tests run every route on any thread count.
    pub(crate) static ROUTE_FORCED: std::cell::Cell<Option<Route>> = const { std::cell::Cell::new(None) };
}

/// The route for `threads`. Fused with one chunk where the pairs alone keep the threads about
/// equally busy (pairs carry the same work unless `kv_lens` differ); else with as many chunks per
/// pair as give every thread the same number of units, where each chunk gets at least two query
/// tiles; else, given at least two pairs per thread, with one chunk still; else split.
///
/// On 2 threads, causal, each against the route before chunks: `2x2048x128` (two q heads sharing
/// one kv head; split before) bf16 20.5 → 15.4 ms, f32 39.0 → 28.3 — level with one pair per
/// thread (`1x2x2048x128`, 14.6 and 28.0); 3 pairs (split before) bf16 32.0 → 22.7, f32 61.5 →
/// 43.2; 5 pairs (one chunk each before: 3 on one thread) bf16 43.3 → 38.3, f32 82.6 → 71.3.
fn route(g: &Geometry, threads: usize) -> Route {
    let pairs = g.batch * g.kv_heads;
    let chunks = parts_for_even_share(pairs, threads);
    // AVX2's tiles (`flash_backward_avx2.rs`) take one chunk per pair only.
    #[cfg(target_arch = "x86_64")]
    let one_chunk_only = crate::flash_backward_avx2::applies(g);
    #[cfg(not(target_arch = "x86_64"))]
    let one_chunk_only = false;
    let chosen = if spreads_evenly(pairs, threads) {
        Route::Fused { chunks: 1 }
    } else if !one_chunk_only && g.group() * g.q_len.div_ceil(TILE_ROWS) >= 2 * chunks {
        Route::Fused { chunks }
    } else if pairs >= 2 * threads {
        Route::Fused { chunks: 1 }
    } else {
        Route::Split
    };
    #[cfg(test)]
    let chosen = match ROUTE_FORCED.with(|f| f.get()) {
        Some(Route::Fused { chunks }) if one_chunk_only && chunks > 1 => Route::Split,
        Some(forced) => forced,
        None => chosen,
    };
    chosen
}

/// Which of `chunks` units of a pair owns its query tile `item` (the pair's tiles numbered head by
/// head): dealt back and forth (0, 1, …, c−1, c−1, …, 0, …), so that under a causal mask, where a
/// head's later tiles see more keys, every chunk gets early and late tiles alike.
fn chunk_of(item: usize, chunks: usize) -> usize {
    let (round, at) = (item / chunks, item % chunks);
    if round.is_multiple_of(2) {
        at
    } else {
        chunks - 1 - at
    }
}

/// The packed GEMM's operands (bf16, or f32 on AVX-512) taken from the current key tile, packed
/// once for every query tile that multiplies them (not once per product): `Kᵀ` for the scores,
/// `Vᵀ` for `dout·Vᵀ`, `K` for `dQ += dS·K`. Kept per thread, like the forward's panels, so that
/// a launch allocates nothing once the buffers have grown; every pack overwrites what an earlier
/// block left.
#[derive(Default)]
struct KeyPanels {
    k_t: PackedRhs,
    v_t: PackedRhs,
    k: PackedRhs,
}

impl KeyPanels {
    /// Packs the panels of `keys` keys from K and V rows (pointer, row stride), `d` and `dv` wide.
    ///
    /// # Safety
    /// Both must be valid for `keys` rows at their strides.
    unsafe fn pack<E: Packed>(
        &mut self,
        k: (*const E, usize),
        v: (*const E, usize),
        (keys, d, dv): (usize, usize, usize),
    ) {
        let ((kb, ks), (vb, vs)) = ((k.0, k.1 as isize), (v.0, v.1 as isize));
        self.k_t.pack(Mat { ptr: kb, rs: 1, cs: ks }, keys, d);
        self.v_t.pack(Mat { ptr: vb, rs: 1, cs: vs }, keys, dv);
        self.k.pack(Mat { ptr: kb, rs: ks, cs: 1 }, d, keys);
    }
}

thread_local! {
    static KEY_PANELS: std::cell::RefCell<KeyPanels> = std::cell::RefCell::default();
}

/// How the dK/dV launch multiplies its tiles.
#[derive(Clone, Copy, PartialEq)]
enum Products {
    /// bf16 operands on the AVX512-BF16 GEMM, the key tile's panels packed once ([`KeyPanels`]).
    Bf16Panels,
    /// f32 operands (f32, or f16/bf16 widened) on the packed f32 GEMM of AVX-512 CPUs, likewise
    /// with the key tile's panels packed once: the `gemm` crate packs both operands per call.
    F32Panels,
    /// f32 operands through [`gemm_rows`] (CPUs without AVX-512).
    Rows,
}

impl Products {
    fn of(bf16_gemm: bool) -> Products {
        #[cfg(test)]
        if F32_PANELS_OFF.with(|f| f.get()) && !bf16_gemm {
            return Products::Rows;
        }
        match bf16_gemm {
            true => Products::Bf16Panels,
            false if <f32 as Dots>::best() == Simd::Avx512 => Products::F32Panels,
            false => Products::Rows,
        }
    }
}

#[cfg(test)]
thread_local! {
    /// Tests run the f32 products through `gemm_rows` as CPUs without AVX-512 do.
    pub(crate) static F32_PANELS_OFF: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// `S = Q·Kᵀ` and `dP = dout·Vᵀ` of one query piece on the key tile's panels for `keys` of it,
/// into the f32 score tiles (`[rows][TILE_KEYS]`).
///
/// # Safety
/// `q` and `dout` valid for `rows × d` and `rows × dv`; the panels hold at least `keys.end` keys.
unsafe fn panel_scores<E: Packed>(
    q: Mat<E>,
    dout: Mat<E>,
    panels: &KeyPanels,
    (rows, keys, d, dv): (usize, Range<usize>, usize, usize),
    (st, dpt): (&mut [f32], &mut [f32]),
) {
    let sums = |t: &mut [f32]| Dst { ptr: t.as_mut_ptr(), rs: TILE_KEYS as isize, cs: 1 };
    gemm_rows_prepacked(0..rows, (keys.clone(), 0..d), sums(st), q, &panels.k_t, false);
    gemm_rows_prepacked(0..rows, (keys, 0..dv), sums(dpt), dout, &panels.v_t, false);
}

/// The query rows of one head that multiply the key tile starting at `j0`, as `(first row, rows)`
/// pieces: tiles of `tr` rows, except that a tile whose rows see this key tile's keys in very
/// different counts (the causal diagonal) goes in pieces of `diagonal_rows`, each multiplying
/// only the keys its last row sees (as the forward's [`QueryTile::pieces`](crate::attention::QueryTile::pieces)).
/// bf16 at 1x32x2048x128: halves ran 3.9% faster than whole tiles, quarters 1.4% faster again.
fn query_pieces(
    g: &Geometry,
    len: usize,
    j0: usize,
    (tr, diagonal_rows): (usize, usize),
) -> impl Iterator<Item = (usize, usize)> + '_ {
    let seen = move |i: usize| g.visible(len, i).saturating_sub(j0);
    (0..g.q_len).step_by(tr).flat_map(move |i0| {
        let rows = tr.min(g.q_len - i0);
        let diagonal = seen(i0 + rows - 1) - seen(i0) >= diagonal_rows;
        let step = if diagonal { diagonal_rows.min(rows) } else { rows };
        (i0..i0 + rows).step_by(step).map(move |i| (i, step.min(i0 + rows - i)))
    })
}

/// Where the fused route keeps its sums: f32 workspace offsets.
#[derive(Clone, Copy)]
struct FusedSums {
    /// `dQ`, as `[B, Hq, Sq, D]`.
    dq: usize,
    /// Units per (batch, kv head) pair ([`Route::Fused`]).
    chunks: usize,
    /// With more than one chunk, the partial `dK` sums as `[pair, chunk, Sk, D]` and the partial
    /// `dV` sums as `[pair, chunk, Sk, Dv]`.
    partial_dk: usize,
    partial_dv: usize,
}

/// Step 2: `dK`, `dV` for one key tile of one kv head per unit; fused (`sums`), all key tiles of
/// one kv head for one chunk of its q heads' query tiles per unit, and `dQ` of those tiles too.
fn dkv_kernel<T: FloatElement>(
    args: &KernelArgs,
    ctx: BlockCtx,
    g: Geometry,
    (per_block, bf16_gemm): (usize, bool),
    sums: Option<FusedSums>,
) {
    let a = BackwardArgs::of(args);
    let (dout, q, k, v, lens, lse_s) = (&a.dout, &a.q, &a.k, &a.v, &a.lens, a.lse);
    let (dr, qr, kr, vr) = (a.dout_rows, a.q_rows, a.k_rows, a.v_rows);
    let (qs, ds) = (q.storage::<T>().unwrap(), dout.storage::<T>().unwrap());
    let (d, dv, group) = (g.head_dim, g.v_dim, g.group());
    let n_rows = g.q_len * g.q_heads * g.batch;
    // SAFETY: δ was written by step 1 and is only read now; block b owns scratch range b.
    let delta = unsafe { &*(args.workspace::<f32>(0, n_rows) as *const [f32]) };
    let ws = unsafe { args.workspace::<f32>(n_rows + ctx.block_idx as usize * per_block, per_block) };
    let tr = TILE_ROWS.min(g.q_len.max(1));
    let [qt, dot, st, dpt, dk_acc, dv_acc, kt, vt] = carve(ws, dkv_tiles(&g, bf16_gemm));
    let score_scale = score_scale(&g, bf16_gemm);
    let products = Products::of(bf16_gemm);
    let diagonal_rows = if products == Products::Rows { tr } else { DIAGONAL_PIECE_ROWS };
    let k_tiles = g.kv_len.div_ceil(TILE_KEYS);
    let mut key_panels = KEY_PANELS.take();
    let fused = sums.is_some();
    let chunks = sums.map_or(1, |s| s.chunks);
    let pairs = g.batch * g.kv_heads;
    let (units, tiles_per_unit) = if fused { (pairs * chunks, k_tiles) } else { (pairs * k_tiles, 1) };
    for u in ctx.split(units) {
        let (pair, chunk, first_tile) = if fused { (u / chunks, u % chunks, 0) } else { (u / k_tiles, 0, u % k_tiles) };
        let (b, hkv) = (pair / g.kv_heads, pair % g.kv_heads);
        // The query tiles of this unit: all (split), or its chunk's (fused; numbered head by head).
        let tiles_per_head = g.q_len.div_ceil(tr);
        let owns = |h: usize, i0: usize| chunk_of((h - hkv * group) * tiles_per_head + i0 / tr, chunks) == chunk;
        // The dQ sums of query rows (h, i0..i0+rows), `[rows][D]`.
        // SAFETY (of each call): a unit owns the rows of its query tiles; a piece lies in one tile.
        let dq_sums = |h: usize, i0: usize, rows: usize| -> Option<&mut [f32]> {
            let base = sums?.dq;
            Some(unsafe { args.workspace::<f32>(base + row_index(&g, b, h, i0) * d, rows * d) })
        };
        let own_tiles = || {
            let heads = hkv * group..(hkv + 1) * group;
            let tiles = heads.flat_map(move |h| (0..g.q_len).step_by(tr).map(move |i0| (h, i0, tr.min(g.q_len - i0))));
            tiles.filter(move |&(h, i0, _)| owns(h, i0))
        };
        for (h, i0, rows) in own_tiles() {
            if let Some(sums) = dq_sums(h, i0, rows) {
                sums.fill(0.0);
            }
        }
        let len = row_len(lens.as_ref(), b, g.kv_len, "attention_backward");
        // The unit's last query (the mask is a prefix per row: it sees the most keys).
        let last_query = own_tiles().map(|(_, i0, rows)| i0 + rows - 1).max();
        for tile in first_tile..first_tile + tiles_per_unit {
            let j0 = tile * TILE_KEYS;
            let keys = TILE_KEYS.min(g.kv_len - j0);
            dk_acc[..keys * d].fill(0.0);
            dv_acc[..keys * dv].fill(0.0);
            // Keys of this tile that some query of the unit sees, and per query piece below the
            // keys its last row sees: the products stop there, so causal tiles on the diagonal do
            // not multiply the masked half, and keys past `kv_lens` (perhaps never written, in a
            // preallocated cache) are never read into dQ.
            let seen = last_query.map_or(0, |i| keys.min(g.visible(len, i).saturating_sub(j0)));
            let (kp, vp) = if bf16_gemm || seen == 0 {
                ((std::ptr::null(), 0), (std::ptr::null(), 0))
            } else {
                (f32_rows::<T>(k, kr, (b, hkv, j0), seen, d, kt), f32_rows::<T>(v, vr, (b, hkv, j0), seen, dv, vt))
            };
            if seen > 0 {
                // SAFETY: K/V rows j0..j0+seen of this head lie inside the checked views (or, f32
                // rows, are the widened copies `f32_rows` made).
                unsafe {
                    match products {
                        Products::Bf16Panels => {
                            let (kb, vb) = (bf16_of(k).as_ptr(), bf16_of(v).as_ptr());
                            let (kb, vb) = (kb.add(kr.at(b, hkv, j0)), vb.add(vr.at(b, hkv, j0)));
                            key_panels.pack((kb, kr.seq_stride()), (vb, vr.seq_stride()), (seen, d, dv));
                        }
                        Products::F32Panels => key_panels.pack(kp, vp, (seen, d, dv)),
                        Products::Rows => {}
                    }
                }
            }
            // The in-place bf16 rows of Q or dout from row i0 of head h.
            let in_place = |t: &TensorRef<'_>, rows: Rows4, h: usize, i0: usize| Mat {
                // SAFETY: rows i0.. of head h lie inside the checked view.
                ptr: unsafe { bf16_of(t).as_ptr().add(rows.at(b, h, i0)) },
                rs: rows.seq_stride() as isize,
                cs: 1,
            };
            // bf16 pieces join the pending rows they continue (up to this many); f32 ones join none
            // (their P and dS stay in the f32 score tiles), so each is multiplied before the next
            // piece's scores overwrite them.
            let pending_rows = if bf16_gemm { KEY_GRAD_ROWS.min(g.q_len) } else { 0 };
            // dV += Pᵀ·dout, dK += dSᵀ·Q (scaled at the end) over the pending rows.
            let mut flush = |pending: &mut Option<PendingRows>, [qt, dot, st, dpt, kt, vt]: [&[f32]; 6]| {
                let Some(PendingRows { h, first, rows, keys: (lead, keys) }) = pending.take() else { return };
                let sizes = (rows, lead..keys, d, dv);
                // SAFETY: the pending rows' P and dS lie in the tiles (or st/dpt), their Q and
                // dout rows in place (or in qt/dot); the panels cover `keys` keys.
                unsafe {
                    if bf16_gemm {
                        let (p, ds) = (kt.as_ptr().cast::<bf16>(), vt.as_ptr().cast::<bf16>());
                        let tiles = Tiles { p, ds, dout: in_place(dout, dr, h, first), q: in_place(q, qr, h, first) };
                        key_grad_products(gemm_rows_packed::<bf16, f32>, tiles, sizes, dv_acc, dk_acc);
                    } else {
                        let tiles =
                            Tiles { p: st.as_ptr(), ds: dpt.as_ptr(), dout: rows_of(dot, dv), q: rows_of(qt, d) };
                        let gemm = if products == Products::F32Panels {
                            gemm_rows_packed::<f32, f32>
                        } else {
                            gemm_rows::<f32>
                        };
                        key_grad_products(gemm, tiles, sizes, dv_acc, dk_acc);
                    }
                }
            };
            let mut pending = None;
            for h in hkv * group..(hkv + 1) * group {
                for (i0, rows) in query_pieces(&g, len, j0, (tr, diagonal_rows)).filter(|&(i0, _)| owns(h, i0)) {
                    let n = seen.min(g.visible(len, i0 + rows - 1).saturating_sub(j0));
                    // The piece's products start at the first key a mask lets any of its rows see.
                    let lead =
                        a.mask.as_ref().map_or(0, |m| m.lead(&g, (b, len), (i0..i0 + rows).map(|i| (h, i)), (j0, n)));
                    if lead == n {
                        continue;
                    }
                    let joins = |p: &PendingRows| p.h == h && p.first + p.rows == i0 && p.rows + rows <= pending_rows;
                    if !pending.as_ref().is_some_and(joins) {
                        flush(&mut pending, [qt, dot, st, dpt, kt, vt]);
                    }
                    let at = pending.map_or(0, |p: PendingRows| p.rows);
                    let sizes = (rows, lead..n, d, dv);
                    // The bf16 GEMM reads the tile's Q and dout rows in place (one head's rows:
                    // one stride); f32 takes Q scaled (and f16 both widened) into scratch.
                    let bf16_rows = bf16_gemm.then(|| (in_place(q, qr, h, i0), in_place(dout, dr, h, i0)));
                    if !bf16_gemm {
                        for r in 0..rows {
                            load_scaled(qs, qr.at(b, h, i0 + r), &mut qt[r * d..(r + 1) * d], g.scale);
                            load_scaled(ds, dr.at(b, h, i0 + r), &mut dot[r * dv..(r + 1) * dv], 1.0);
                        }
                    }
                    let (q_f32, dout_f32) = (rows_of(qt, d), rows_of(dot, dv));
                    // SAFETY: the panels (and kp/vp) cover n keys; all else is this block's scratch.
                    unsafe {
                        if let Some((q_rows, dout_rows)) = bf16_rows {
                            panel_scores(q_rows, dout_rows, &key_panels, sizes, (st, dpt))
                        } else if products == Products::F32Panels {
                            panel_scores(q_f32, dout_f32, &key_panels, sizes, (st, dpt))
                        } else {
                            let (kp, vp) = (from_key(kp, lead), from_key(vp, lead));
                            scores(&mut st[lead..], TILE_KEYS, qt, d, rows, kp, n - lead);
                            scores(&mut dpt[lead..], TILE_KEYS, dot, dv, rows, vp, n - lead);
                        }
                    }
                    for r in 0..rows {
                        let at_row = row_index(&g, b, h, i0 + r);
                        let visible = g.visible(len, i0 + r).saturating_sub(j0 + lead);
                        let (s, dp) = (&mut st[r * TILE_KEYS..][lead..n], &mut dpt[r * TILE_KEYS..][lead..n]);
                        cap_for_grads(&g, (s, Some(dp)), visible, score_scale, delta[at_row]);
                        let visible = a.live_keys(s, (b, h, i0 + r), j0 + lead, visible, lse_s[at_row], score_scale);
                        let bf16_rows = if bf16_gemm {
                            let (p_row, ds_row) = (
                                &mut bf16_tile(kt)[(at + r) * TILE_KEYS..],
                                &mut bf16_tile(vt)[(at + r) * TILE_KEYS..],
                            );
                            // Zeros over the keys the pending rows' products may multiply.
                            for row in [&mut *p_row, &mut *ds_row] {
                                row[..lead].fill(bf16::ZERO);
                                row[n..seen].fill(bf16::ZERO);
                            }
                            Some((Some(&mut p_row[lead..n]), &mut ds_row[lead..n]))
                        } else {
                            None
                        };
                        probs_and_dscores_row::<T>(
                            s,
                            dp,
                            bf16_rows,
                            visible,
                            score_scale,
                            lse_s[at_row],
                            delta[at_row],
                        );
                    }
                    // dQ += dS·K (when fused), for this piece now: its sums are the piece's rows.
                    if let Some(dq) = dq_sums(h, i0, rows) {
                        let dst = Dst { ptr: dq.as_mut_ptr(), rs: d as isize, cs: 1 };
                        let f32_ds = Mat { ptr: dpt.as_ptr(), rs: TILE_KEYS as isize, cs: 1 };
                        let keys = lead..n;
                        // SAFETY: dS rows of this piece in the tiles; the panels (kp) cover n keys.
                        unsafe {
                            match products {
                                Products::Bf16Panels => {
                                    let ds = Mat {
                                        ptr: bf16_tile(vt)[at * TILE_KEYS..].as_ptr(),
                                        rs: TILE_KEYS as isize,
                                        cs: 1,
                                    };
                                    gemm_rows_prepacked(0..rows, (0..d, keys), dst, ds, &key_panels.k, true)
                                }
                                Products::F32Panels => {
                                    gemm_rows_prepacked(0..rows, (0..d, keys), dst, f32_ds, &key_panels.k, true)
                                }
                                Products::Rows => gemm_rows(
                                    0..rows,
                                    d,
                                    n - lead,
                                    dst,
                                    Mat { ptr: dpt[lead..].as_ptr(), ..f32_ds },
                                    Mat { ptr: from_key(kp, lead).0, rs: kp.1 as isize, cs: 1 },
                                    true,
                                ),
                            }
                        }
                    }
                    let joined = pending.unwrap_or(PendingRows { h, first: i0, rows: 0, keys: (lead, n) });
                    let keys = (joined.keys.0.min(lead), joined.keys.1.max(n));
                    pending = Some(PendingRows { rows: joined.rows + rows, keys, ..joined });
                }
            }
            flush(&mut pending, [qt, dot, st, dpt, kt, vt]);
            match sums {
                Some(s) if s.chunks > 1 => {
                    // SAFETY: unit (pair, chunk) alone owns its partial sums.
                    let partial = |base: usize, width: usize| unsafe {
                        args.workspace::<f32>(base + ((pair * s.chunks + chunk) * g.kv_len + j0) * width, keys * width)
                    };
                    partial(s.partial_dk, d).copy_from_slice(&dk_acc[..keys * d]);
                    partial(s.partial_dv, dv).copy_from_slice(&dv_acc[..keys * dv]);
                }
                // SAFETY: this unit owns keys j0..j0+keys of (b, hkv) in dk and dv.
                _ => unsafe { store_keys::<T>(&a, &g, (b, hkv, j0), (dk_acc, dv_acc), keys, score_scale) },
            }
        }
        for (h, i0, rows) in own_tiles() {
            let Some(sums) = dq_sums(h, i0, rows) else { break }; // split: dQ has a launch of its own

            // A head dim of 0 leaves dQ's rows empty: nothing to store.
            for (r, sums) in sums.chunks_exact_mut(d.max(1)).enumerate() {
                // SAFETY: this unit owns the rows of its query tiles in dq.
                unsafe { store_row::<T>(&a.dq, a.dq_rows.at(b, h, i0 + r), sums, g.scale) };
            }
        }
    }
    KEY_PANELS.set(key_panels);
}

/// Rows `(pointer, row stride)` of K or V from their row `j` on.
fn from_key((rows, stride): (*const f32, usize), j: usize) -> (*const f32, usize) {
    (rows.wrapping_add(j * stride), stride)
}

/// Stores the `dK` and `dV` sums of `keys` keys of kv head `hkv` from key `j0` on (`[keys][D]`
/// and `[keys][Dv]`), `dK` times `dk_scale` (the f32 path's Q carried the scale already).
///
/// # Safety
/// The calling block must own those rows of dk and dv.
unsafe fn store_keys<T: FloatElement>(
    a: &BackwardArgs<'_>,
    g: &Geometry,
    (b, hkv, j0): (usize, usize, usize),
    (dk_sums, dv_sums): (&mut [f32], &mut [f32]),
    keys: usize,
    dk_scale: f32,
) {
    // By index: a head dim of 0 (empty dK rows) still has dV rows to store.
    for j in 0..keys {
        let dk_row = &mut dk_sums[j * g.head_dim..][..g.head_dim];
        let dv_row = &mut dv_sums[j * g.v_dim..][..g.v_dim];
        unsafe {
            store_row::<T>(&a.dk, a.dk_rows.at(b, hkv, j0 + j), dk_row, dk_scale);
            store_row::<T>(&a.dv, a.dv_rows.at(b, hkv, j0 + j), dv_row, 1.0);
        }
    }
}

/// Step 3 of the fused route with chunks: adds up the chunks' partial `dK`/`dV` sums of one key
/// tile of one kv head per unit (into the first chunk's) and stores them.
fn dkv_sum_kernel<T: FloatElement>(args: &KernelArgs, ctx: BlockCtx, g: Geometry, sums: FusedSums, dk_scale: f32) {
    let a = BackwardArgs::of(args);
    let k_tiles = g.kv_len.div_ceil(TILE_KEYS);
    for u in ctx.split(g.batch * g.kv_heads * k_tiles) {
        let (pair, j0) = (u / k_tiles, u % k_tiles * TILE_KEYS);
        let keys = TILE_KEYS.min(g.kv_len - j0);
        // SAFETY: unit (pair, key tile) alone owns these keys' partial sums in every chunk.
        let partial = |base: usize, width: usize, chunk: usize| unsafe {
            args.workspace::<f32>(base + ((pair * sums.chunks + chunk) * g.kv_len + j0) * width, keys * width)
        };
        let (dk_sums, dv_sums) = (partial(sums.partial_dk, g.head_dim, 0), partial(sums.partial_dv, g.v_dim, 0));
        for chunk in 1..sums.chunks {
            let add = |acc: &mut [f32], part: &[f32]| acc.iter_mut().zip(part).for_each(|(s, p)| *s += p);
            add(dk_sums, partial(sums.partial_dk, g.head_dim, chunk));
            add(dv_sums, partial(sums.partial_dv, g.v_dim, chunk));
        }
        let (b, hkv) = (pair / g.kv_heads, pair % g.kv_heads);
        // SAFETY: this unit owns keys j0..j0+keys of (b, hkv) in dk and dv.
        unsafe { store_keys::<T>(&a, &g, (b, hkv, j0), (dk_sums, dv_sums), keys, dk_scale) };
    }
}

/// Step 3: `dQ` for one (batch, kv head, query tile) per unit, all heads of the group together.
fn dq_kernel<T: FloatElement>(args: &KernelArgs, ctx: BlockCtx, g: Geometry, (per_block, bf16_gemm): (usize, bool)) {
    let a = BackwardArgs::of(args);
    let (dout, q, k, v, lens, lse_s, dq) = (&a.dout, &a.q, &a.k, &a.v, &a.lens, a.lse, &a.dq);
    let (dr, qr, kr, vr, dqr) = (a.dout_rows, a.q_rows, a.k_rows, a.v_rows, a.dq_rows);
    let (qs, ds) = (q.storage::<T>().unwrap(), dout.storage::<T>().unwrap());
    let (d, dv) = (g.head_dim, g.v_dim);
    let n_rows = g.q_len * g.q_heads * g.batch;
    // SAFETY: as in dkv_kernel.
    let delta = unsafe { &*(args.workspace::<f32>(0, n_rows) as *const [f32]) };
    let ws = unsafe { args.workspace::<f32>(n_rows + ctx.block_idx as usize * per_block, per_block) };
    let [qt, dot, st, dpt, dq_acc, kt, vt] = carve(ws, dq_tiles(&g, bf16_gemm));
    let score_scale = score_scale(&g, bf16_gemm);
    for u in ctx.split(g.units()) {
        let t = g.query_tile(g.unit(u), lens.as_ref(), "attention_backward");
        let (b, hkv, rows) = (t.b, t.hkv, t.rows());
        if bf16_gemm {
            t.copy_rows(bf16_of(q), qr, bf16_tile(qt), d);
            t.copy_rows(bf16_of(dout), dr, bf16_tile(dot), dv);
        } else {
            t.load(qs, qr, qt, d, g.scale);
            t.load(ds, dr, dot, dv, 1.0);
        }
        dq_acc[..rows * d].fill(0.0);
        let kv_end = t.kv_end(&g);
        for j0 in (0..kv_end).step_by(TILE_KEYS) {
            let n = TILE_KEYS.min(kv_end - j0);
            // The products start at the first key a mask lets any of the tile's rows see; a tile
            // it hides from all of them is skipped.
            let queries = (0..rows).map(|r| t.head_pos(r));
            let lead = a.mask.as_ref().map_or(0, |m| m.lead(&g, (b, t.len), queries, (j0, n)));
            if lead == n {
                continue;
            }
            let kp = if bf16_gemm {
                let (kb, vb) = (bf16_of(k).as_ptr(), bf16_of(v).as_ptr());
                let (kb, vb) = (kb.wrapping_add(kr.at(b, hkv, j0 + lead)), vb.wrapping_add(vr.at(b, hkv, j0 + lead)));
                // SAFETY: K/V rows j0+lead..j0+n of this head lie inside the checked views.
                unsafe {
                    bf16_scores(&mut st[lead..], bf16_tile(qt), d, rows, (kb, kr.seq_stride()), n - lead);
                    bf16_scores(&mut dpt[lead..], bf16_tile(dot), dv, rows, (vb, vr.seq_stride()), n - lead);
                }
                (std::ptr::null(), 0)
            } else {
                let kp = f32_rows::<T>(k, kr, (b, hkv, j0 + lead), n - lead, d, kt);
                let vp = f32_rows::<T>(v, vr, (b, hkv, j0 + lead), n - lead, dv, vt);
                // SAFETY: as in dkv_kernel.
                unsafe {
                    scores(&mut st[lead..], TILE_KEYS, qt, d, rows, kp, n - lead);
                    scores(&mut dpt[lead..], TILE_KEYS, dot, dv, rows, vp, n - lead);
                }
                kp
            };
            for r in 0..rows {
                let (h, i) = t.head_pos(r);
                let at = row_index(&g, b, h, i);
                let visible = g.visible(t.len, i).saturating_sub(j0 + lead);
                let (s, dp) = (&mut st[r * TILE_KEYS..][lead..n], &mut dpt[r * TILE_KEYS..][lead..n]);
                cap_for_grads(&g, (s, Some(dp)), visible, score_scale, delta[at]);
                let visible = a.live_keys(s, (b, h, i), j0 + lead, visible, lse_s[at], score_scale);
                let bf16_rows = bf16_gemm.then(|| (None, &mut bf16_tile(kt)[r * TILE_KEYS..][lead..n]));
                probs_and_dscores_row::<T>(s, dp, bf16_rows, visible, score_scale, lse_s[at], delta[at]);
            }
            // dQ += dS·K (the scale is applied once at the end).
            if bf16_gemm {
                let dsb = &bf16_tile(kt)[lead..];
                let kb = bf16_of(k).as_ptr();
                // SAFETY: as above.
                unsafe {
                    gemm_rows_packed(
                        0..rows,
                        d,
                        n - lead,
                        Dst { ptr: dq_acc.as_mut_ptr(), rs: d as isize, cs: 1 },
                        Mat { ptr: dsb.as_ptr(), rs: TILE_KEYS as isize, cs: 1 },
                        Mat { ptr: kb.add(kr.at(b, hkv, j0 + lead)), rs: kr.seq_stride() as isize, cs: 1 },
                        true,
                    );
                }
                continue;
            }
            unsafe {
                gemm_rows(
                    0..rows,
                    d,
                    n - lead,
                    Dst { ptr: dq_acc.as_mut_ptr(), rs: d as isize, cs: 1 },
                    Mat { ptr: dpt[lead..].as_ptr(), rs: TILE_KEYS as isize, cs: 1 },
                    Mat { ptr: kp.0, rs: kp.1 as isize, cs: 1 },
                    true,
                );
            }
        }
        for r in 0..rows {
            let (h, i) = t.head_pos(r);
            // SAFETY: this unit owns rows (b, group heads, q0..q0+n_pos) of dq.
            unsafe { store_row::<T>(dq, dqr.at(b, h, i), &mut dq_acc[r * d..(r + 1) * d], g.scale) };
        }
    }
}

impl Op for AttentionBackward {
    fn schema(&self) -> &'static str {
        "attention_backward(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor? kv_lens=None, \
         bool causal=False, float? scale=None, Tensor? mask=None, bool needs_dmask=False, float? softcap=None, \
         Tensor? sinks=None, int batch_dims=0) -> (Tensor dq, Tensor dk, Tensor dv, Tensor dmask, Tensor dsinks)"
    }

    fn doc(&self) -> &'static str {
        "Gradients of attention from its saved out and lse (same mask, scale, softcap and sinks rules). dk/dv sum over the q heads \
         of each kv-head group; keys past kv_lens get zero gradient. dmask is the gradient of a float mask (its \
         shape and dtype: the score gradient summed over the dims the mask is broadcast along) when needs_dmask, \
         else an empty tensor; asking for it adds two tile products to the five (about half the time again). \
         dsinks is the gradient of sinks (their shape and dtype) when given, else an empty tensor. \
         dmask and dsinks sum over every batch row, or per sample with batch_dims: then they are \
         q.shape[:batch_dims] + their argument's shape (the mask must not reach into those dims). \
         Deterministic (no atomics)."
    }

    fn dtypes(&self) -> &'static [DType] {
        DTYPES
    }

    fn leading_batch_args(&self) -> &'static [&'static str] {
        &["dout", "q", "k", "v", "out", "lse", "kv_lens"]
    }

    fn infer(&self, cx: &OpCx) -> Result<Vec<TensorMeta>> {
        let g = checked_geometry(cx)?;
        let mut metas: Vec<TensorMeta> = ["q", "k", "v"]
            .iter()
            .map(|a| TensorMeta::contiguous(cx.input(a).dtype, cx.input(a).shape()))
            .collect::<Result<_>>()?;
        let samples = batch_samples(cx)?;
        metas.push(match mask_grad(cx, &samples)? {
            Some(mask) => TensorMeta::contiguous(mask.dtype, &samples.shape(mask.shape()))?,
            None => TensorMeta::contiguous(g.dtype, &[0])?,
        });
        metas.push(match cx.optional_input("sinks") {
            Some(sinks) => TensorMeta::contiguous(sinks.dtype, &samples.shape(sinks.shape()))?,
            None => TensorMeta::contiguous(g.dtype, &[0])?,
        });
        Ok(metas)
    }

    fn plan(&self, cx: &OpCx) -> Result<Plan> {
        let g = checked_geometry(cx)?;
        let threads = uniop::runtime::Pool::global().threads();
        let blocks = |units: usize| units.clamp(1, 4 * threads) as u32;
        let route = route(&g, threads);
        let samples = batch_samples(cx)?;
        let sample_rows = SampleRows::of(&samples);
        let dmask = mask_grad(cx, &samples)?.map(|mask| MaskGrad::of(&g, mask.shape(), sample_rows));
        let key_lanes = key_lanes(&g, route != Route::Split, dmask.as_ref());
        let pairs = g.batch * g.kv_heads;
        let k_tiles = g.kv_len.div_ceil(TILE_KEYS);
        let dkv_groups = crate::flash_backward_avx2::row_groups(&g, key_lanes.dmask);
        let dkv_units = match route {
            Route::Fused { chunks } => dkv_groups * chunks,
            Route::Split => dkv_groups * g.kv_len.div_ceil(key_lanes.key_tile),
        };
        let bf16_gemm = on_bf16_gemm(&g);
        let per_block = key_lanes.scratch.unwrap_or_else(|| block_scratch(&g, bf16_gemm));
        let rows = g.batch * g.q_heads * g.q_len;
        let max_blocks = blocks(if route == Route::Split { dkv_units.max(g.units()) } else { dkv_units }) as usize;
        // δ, then each block's scratch, then (fused) the dQ sums and (with chunks) the partial
        // dK and dV sums.
        let scratch_end = rows + max_blocks * per_block;
        let sums = match route {
            Route::Fused { chunks } => {
                let partial_dk = scratch_end + rows * key_lanes.dq_width;
                let partial_dv = partial_dk + if chunks > 1 { pairs * chunks * g.kv_len * g.head_dim } else { 0 };
                Some(FusedSums { dq: scratch_end, chunks, partial_dk, partial_dv })
            }
            Route::Split => None,
        };
        let workspace = match sums {
            Some(s) if s.chunks > 1 => s.partial_dv + pairs * s.chunks * g.kv_len * g.v_dim,
            Some(s) => s.partial_dk,
            None => scratch_end,
        };
        // The dK/dV launch sums dmask, or a step of its own does.
        let dmask = dmask.filter(|_| key_lanes.dmask.is_none());
        let workspace =
            dmask.map_or(workspace, |m| workspace.max(rows + blocks(m.units()) as usize * MaskGrad::scratch(&g)));
        let steps = with_float_dtype!(g.dtype, cx.op(), "q", |T| {
            let dkv = Step::new("attention_backward.dkv", blocks(dkv_units), move |a, c| {
                #[cfg(target_arch = "x86_64")]
                if key_lanes.scratch.is_some() {
                    // `route` gives these tiles one chunk per pair at most.
                    let dq_sums = sums.map(|s| s.dq);
                    return crate::flash_backward_avx2::dkv::<T>(a, c, g, per_block, (dq_sums, key_lanes.dmask));
                }
                dkv_kernel::<T>(a, c, g, (per_block, bf16_gemm), sums)
            });
            let mut steps = vec![
                Step::new("attention_backward.delta", blocks(rows.div_ceil(64)), move |a, c| {
                    delta_kernel::<T>(a, c, g)
                }),
                dkv,
            ];
            if g.sinks {
                // It reads δ, which no later launch writes over.
                steps.insert(
                    1,
                    Step::new("attention_backward.dsinks", blocks(sample_rows.count * g.q_heads), move |a, c| {
                        sinks_grad_kernel(a, c, g, sample_rows)
                    }),
                );
            }
            match sums {
                Some(sums) if sums.chunks > 1 => {
                    let dk_scale = score_scale(&g, bf16_gemm);
                    steps.push(Step::new("attention_backward.dkv_sum", blocks(pairs * k_tiles), move |a, c| {
                        dkv_sum_kernel::<T>(a, c, g, sums, dk_scale)
                    }));
                }
                Some(_) => {}
                None => steps.push(Step::new("attention_backward.dq", blocks(g.units()), move |a, c| {
                    #[cfg(target_arch = "x86_64")]
                    if key_lanes.scratch.is_some() {
                        return crate::flash_backward_avx2::dq::<T>(a, c, g, per_block);
                    }
                    dq_kernel::<T>(a, c, g, (per_block, bf16_gemm))
                })),
            }
            if let Some(m) = dmask {
                // Last: it reads only δ, and its scratch may reuse every other launch's.
                let per_block = MaskGrad::scratch(&g);
                steps.push(Step::new("attention_backward.dmask", blocks(m.units()), move |a, c| {
                    mask_grad_kernel::<T>(a, c, g, m, per_block)
                }));
            }
            steps
        });
        let mut needs = vec![LayoutNeed::InnerContiguous; 5];
        needs.push(LayoutNeed::Contiguous);
        Ok(Plan::new(steps).workspace(workspace * 4).inputs_need(needs).outputs_need(vec![LayoutNeed::Contiguous; 5]))
    }

    fn reference(&self, cx: &OpCx, inputs: &[Option<RefTensor>]) -> Result<Vec<RefTensor>> {
        let g = checked_geometry(cx)?;
        let [dout, q, k, v, out, lse] = [DOUT, Q, K, V, OUT, LSE].map(|i| inputs[i].as_ref().unwrap());
        let (lens, mask) = (inputs[KV_LENS].as_ref(), inputs[MASK].as_ref());
        let (d, dv, group) = (g.head_dim, g.v_dim, g.group());
        let mut dq = vec![0.0; q.data.len()];
        let mut dk = vec![0.0; k.data.len()];
        let mut dvv = vec![0.0; v.data.len()];
        let samples = batch_samples(cx)?;
        let wants_dmask = mask_grad(cx, &samples)?.is_some();
        let per_sample = |shape: &[usize]| {
            let shape = samples.shape(shape);
            RefTensor::new(&shape, vec![0.0; shape.iter().product()])
        };
        let mut dmask = match (mask, wants_dmask) {
            (Some(mask), true) => per_sample(&mask.shape),
            _ => RefTensor::new(&[0], vec![]),
        };
        let sinks = inputs[SINKS].as_ref();
        let mut dsinks = sinks.map_or_else(|| RefTensor::new(&[0], vec![]), |s| per_sample(&s.shape));
        let scale = g.scale_f64;
        for b in 0..g.batch {
            let sample = b / samples.rows;
            let len = lens.map_or(g.kv_len, |l| l.data[b] as usize);
            for h in 0..g.q_heads {
                let kv = (b * g.kv_heads + h / group) * g.kv_len;
                for i in 0..g.q_len {
                    let row = row_index(&g, b, h, i);
                    let (qi, doi, oi) =
                        (&q.data[row * d..][..d], &dout.data[row * dv..][..dv], &out.data[row * dv..][..dv]);
                    let delta: f64 = doi.iter().zip(oi).map(|(a, b)| a * b).sum();
                    if let Some(sinks) = sinks.filter(|_| lse.data[row] != f64::NEG_INFINITY) {
                        dsinks.data[sample * g.q_heads + h] -= (sinks.data[h] - lse.data[row]).exp() * delta;
                    }
                    for j in 0..g.visible(len, i) {
                        let bias = reference_bias(&g, mask, [b, h, i, j]);
                        if bias == f64::NEG_INFINITY || lse.data[row] == f64::NEG_INFINITY {
                            continue;
                        }
                        let (kj, vj) = (&k.data[(kv + j) * d..][..d], &v.data[(kv + j) * dv..][..dv]);
                        let (capped, slope) =
                            reference_cap(&g, scale * qi.iter().zip(kj).map(|(a, b)| a * b).sum::<f64>());
                        let p = (capped + bias - lse.data[row]).exp();
                        let dp: f64 = doi.iter().zip(vj).map(|(a, b)| a * b).sum();
                        let ds = p * (dp - delta);
                        if wants_dmask {
                            let mask_shape = &dmask.shape[samples.dims.len()..];
                            let at = reference_mask_index(&g, mask_shape, [b, h, i, j]);
                            dmask.data[sample * mask_shape.iter().product::<usize>() + at] += ds;
                        }
                        let ds = ds * slope;
                        for c in 0..d {
                            dq[row * d + c] += scale * ds * kj[c];
                            dk[(kv + j) * d + c] += scale * ds * qi[c];
                        }
                        for c in 0..dv {
                            dvv[(kv + j) * dv + c] += p * doi[c];
                        }
                    }
                }
            }
        }
        Ok(vec![
            RefTensor::new(&q.shape, dq),
            RefTensor::new(&k.shape, dk),
            RefTensor::new(&v.shape, dvv),
            dmask,
            dsinks,
        ])
    }

    /// √ of the longest sum a gradient element gathers (a head dim, or the query rows sharing a
    /// key), times how much sharper than the default 1/√d the scale makes the softmax: a score's
    /// f32 rounding grows with the scale, and `dq`/`dk` carry it once more (at scale 30 and d 31,
    /// f32 `dq` came out 1.4e-3 off, 9 times the tolerance without this factor).
    fn error_scale(&self, cx: &OpCx) -> f64 {
        checked_geometry(cx).map_or(1.0, |g| {
            let sharpening = (g.scale_f64 * (g.head_dim as f64).sqrt()).abs().max(1.0);
            (g.head_dim.max(g.q_len * g.group()).max(1) as f64).sqrt() * sharpening
        })
    }

    fn example(&self, shape: Option<&[usize]>, dtype: DType) -> Result<Example> {
        let (q, kv) = crate::attention::example_shapes(shape);
        let t = |s: &[usize]| TensorMeta::contiguous(dtype, s).map(Some);
        Ok(Example {
            inputs: vec![
                t(&q)?,
                t(&q)?,
                t(&kv)?,
                t(&kv)?,
                t(&q)?,
                Some(TensorMeta::contiguous(DType::F32, &q[..q.len() - 1])?),
                None,
                None,
                None,
            ],
            attrs: vec![("causal".into(), AttrValue::Bool(true))],
            ..Default::default()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::{Route, BF16_GEMM_FORCED, F32_PANELS_OFF, ROUTE_FORCED};
    use crate::attention::run_checked_forcing;
    use uniop::half::bf16;
    use uniop::verify::Rng;
    use uniop::{AttrValue, Element, TensorRef};

    /// Values a bf16 holds exactly, as f64 (so every dtype's copy of them is the same input).
    fn bf16_values(shape: &[usize], seed: u64) -> Vec<f64> {
        let mut rng = Rng::new(seed);
        (0..shape.iter().product()).map(|_| bf16::from_f64(2.0 * rng.uniform()).to_f64()).collect()
    }

    fn view<'a, T: Element>(x: &'a [T], shape: &[usize]) -> Option<TensorRef<'a>> {
        Some(TensorRef::new(x, shape).unwrap())
    }

    /// A preallocated KV cache holds NaN (never-written slots) past each row's `kv_lens`: the
    /// gradients (and the forward) must not read them — dS is 0 there, but 0 · NaN is NaN, so
    /// dQ's product has to stop at the row's length. Odd lengths, inside the first key tile and in
    /// the second; causal and not; every route ([`ROUTES`]); f32 on the packed panels and through
    /// `gemm_rows` (as without AVX-512), and bf16 on and off the bf16 GEMM.
    #[test]
    fn backward_never_reads_keys_past_kv_lens() {
        let threads = uniop::runtime::Pool::global().threads();
        let lens_2 = (0..2 * threads as i32).map(|b| 287 - 86 * (b % 2)).collect();
        for (batch, kv_heads, lens) in [(1, 1, vec![201i32]), (2 * threads, 2, lens_2)] {
            let (q_shape, kv_shape) = ([batch, 4, 40, 16], [batch, kv_heads, 300, 16]);
            let cache = |seed| {
                let mut x = bf16_values(&kv_shape, seed);
                for (i, v) in x.iter_mut().enumerate() {
                    let (b, j) = (i / (kv_heads * 300 * 16), i / 16 % 300);
                    if j >= lens[b] as usize {
                        *v = f64::NAN;
                    }
                }
                x
            };
            let (q, k, v, dout) = (bf16_values(&q_shape, 1), cache(2), cache(3), bf16_values(&q_shape, 4));
            for causal in [true, false] {
                let attrs = [("causal", AttrValue::Bool(causal))];
                let case = ([&q[..], &k, &v, &dout], (q_shape, kv_shape), (Some(&lens[..]), None));
                for route in ROUTES {
                    for panels_off in [false, true] {
                        let force = || forcing(route, || F32_PANELS_OFF.with(|f| f.set(panels_off)));
                        backward_case::<f32>(&attrs, case, &force);
                    }
                    for bf16_gemm in [true, false] {
                        let force = || forcing(route, || BF16_GEMM_FORCED.with(|f| f.set(Some(bf16_gemm))));
                        backward_case::<bf16>(&attrs, case, &force);
                    }
                }
            }
        }
    }

    /// bf16 gradients on the bf16 GEMM and widened to f32, against the f64 reference: two key
    /// tiles and three query tiles per head, one (batch, kv head) pair on every route
    /// ([`ROUTES`]); more pairs than twice the threads on the route the op picks; causal GQA.
    /// 700 queries: more than the [`KEY_GRAD_ROWS`](super::KEY_GRAD_ROWS) the dK/dV products gather, so a head's rows
    /// go into two products per key tile, and with three chunks into one per owned query tile.
    #[test]
    fn bf16_backward_on_and_off_the_bf16_gemm() {
        let causal = [("causal", AttrValue::Bool(true))];
        let threads = uniop::runtime::Pool::global().threads();
        for (batch, kv_heads, s) in [(1, 1, 300), (1, 1, 700), (2 * threads, 2, 40)] {
            let (q_shape, kv_shape) = ([batch, 4, s, 16], [batch, kv_heads, s, 16]);
            let (q, k, v) = (bf16_values(&q_shape, 1), bf16_values(&kv_shape, 2), bf16_values(&kv_shape, 3));
            let dout = bf16_values(&q_shape, 4);
            let routes = if batch == 1 { &ROUTES[..] } else { &ROUTES[..1] };
            for (&route, bf16_gemm) in routes.iter().flat_map(|r| [(r, true), (r, false)]) {
                let force = || forcing(route, || BF16_GEMM_FORCED.with(|f| f.set(Some(bf16_gemm))));
                backward_case::<bf16>(&causal, ([&q, &k, &v, &dout], (q_shape, kv_shape), (None, None)), &force);
            }
        }
    }

    /// Masks that hide whole tiles, or a tile's first keys, from some query tiles and not others,
    /// on every route and kernel choice of the GEMM tiles against the f64 references: a sliding
    /// window of 100 keys (causal, over 800 positions: a query tile sees one or two key tiles of
    /// four, the first from a later key), and a left-padded batch whose padding fills batch row 1's
    /// first two key tiles and the first 40 keys of the third, the K/V rows of the tiles and the
    /// third's first panel ([`PREPACKED_STEP`] keys) holding NaN: keys hidden from every query of a
    /// product must be skipped, never read (a product over them would spread the NaN); the padding
    /// also as a float mask (−∞ hides).
    #[test]
    fn masks_skip_the_keys_they_hide() {
        use crate::attention::TILE_KEYS;
        use crate::packed_gemm::PREPACKED_STEP;
        let s = 800;
        let (q_shape, kv_shape) = ([2, 4, s, 16], [2, 2, s, 16]);
        let window: Vec<bool> = (0..s * s).map(|x| x % s + 100 > x / s).collect();
        let pad = 2 * TILE_KEYS + 40;
        let padding: Vec<bool> = (0..2 * s * s).map(|x| x < s * s || x % s >= pad).collect();
        let poisoned = |mut x: Vec<f64>| {
            let row_1 = 2 * s * 16; // batch row 1's first element
            for h in 0..2 {
                x[row_1 + h * s * 16..][..(2 * TILE_KEYS + PREPACKED_STEP) * 16].fill(f64::NAN);
            }
            x
        };
        let (q, dout) = (bf16_values(&q_shape, 1), bf16_values(&q_shape, 4));
        let (k, v) = (bf16_values(&kv_shape, 2), bf16_values(&kv_shape, 3));
        let (k_nan, v_nan) = (poisoned(k.clone()), poisoned(v.clone()));
        let causal = [("causal", AttrValue::Bool(true))];
        // The padding again as a float mask: 0 to keep, −∞ to hide.
        let padding_bias: Vec<f32> = padding.iter().map(|&keep| if keep { 0.0 } else { f32::NEG_INFINITY }).collect();
        let masks = [
            (MaskValues::Keeps(&window), [1, 1, s, s]),
            (MaskValues::Keeps(&padding), [2, 1, s, s]),
            (MaskValues::Bias(&padding_bias), [2, 1, s, s]),
        ];
        let cases = masks.map(|mask| {
            let (k, v) = if matches!(mask.1, [2, ..]) { (&k_nan, &v_nan) } else { (&k, &v) };
            ([&q[..], k, v, &dout], (q_shape, kv_shape), (None, Some(mask)))
        });
        // The GEMM tiles, on any CPU: AVX2's transposed ones skip at their own key tiles.
        fn gemm_tiles_and(force: impl Fn()) {
            crate::flash_avx2::FORCED.with(|f| f.set(Some(false)));
            force()
        }
        for case in cases {
            for route in ROUTES {
                for panels_off in [false, true] {
                    let force = || forcing(route, || gemm_tiles_and(|| F32_PANELS_OFF.with(|f| f.set(panels_off))));
                    backward_case::<f32>(&causal, case, &force);
                }
                for bf16_gemm in [true, false] {
                    let force =
                        || forcing(route, || gemm_tiles_and(|| BF16_GEMM_FORCED.with(|f| f.set(Some(bf16_gemm)))));
                    backward_case::<bf16>(&causal, case, &force);
                }
            }
        }
    }

    /// `softcap` on every route and kernel choice against the f64 references, with scores large
    /// enough that the cap bends them: causal GQA over two key tiles and three query tiles, with a
    /// float bias (whose gradient, asked for, takes the capped scores' own), f32 on and off the
    /// packed panels, bf16 on and off the bf16 GEMM, and with AVX2's tiles forced, which take no
    /// softcap and leave the call to the GEMM tiles.
    #[test]
    fn softcap_on_every_route() {
        let (q_shape, kv_shape) = ([1, 4, 300, 16], [1, 1, 300, 16]);
        let q: Vec<f64> = bf16_values(&q_shape, 1).iter().map(|x| 4.0 * x).collect();
        let (k, v, dout) = (bf16_values(&kv_shape, 2), bf16_values(&kv_shape, 3), bf16_values(&q_shape, 4));
        let bias: Vec<f32> = bf16_values(&[300, 300], 5).iter().map(|&x| x as f32).collect();
        let attrs = [("causal", AttrValue::Bool(true)), ("softcap", AttrValue::Float(5.0))];
        let case =
            ([&q[..], &k, &v, &dout], (q_shape, kv_shape), (None, Some((MaskValues::Bias(&bias), [1, 1, 300, 300]))));
        for route in ROUTES {
            for avx2 in [false, true] {
                let pick_tiles = || crate::flash_avx2::FORCED.with(|f| f.set(Some(avx2)));
                for panels_off in [false, true] {
                    let force = || {
                        forcing(route, || {
                            pick_tiles();
                            F32_PANELS_OFF.with(|f| f.set(panels_off))
                        })
                    };
                    backward_case::<f32>(&attrs, case, &force);
                }
                for bf16_gemm in [true, false] {
                    let force = || {
                        forcing(route, || {
                            pick_tiles();
                            BF16_GEMM_FORCED.with(|f| f.set(Some(bf16_gemm)))
                        })
                    };
                    backward_case::<bf16>(&attrs, case, &force);
                }
            }
        }
    }

    /// The route the op picks, then each one forced: split, and fused with three chunks per pair
    /// (an odd count, more than the query tiles of some heads, whatever the thread count).
    const ROUTES: [Option<Route>; 3] = [None, Some(Route::Split), Some(Route::Fused { chunks: 3 })];

    /// `force` (a kernel choice), then `route` when given.
    fn forcing(route: Option<Route>, force: impl Fn()) {
        force();
        ROUTE_FORCED.with(|f| f.set(route));
    }

    /// Inputs of one case: q, k, v, dout (f64 values), the q and kv shapes, `kv_lens` and `mask`.
    type Case<'a> = ([&'a [f64]; 4], ([usize; 4], [usize; 4]), (Option<&'a [i32]>, Option<Mask<'a>>));

    /// A mask (boolean, or a float bias) and its shape.
    type Mask<'a> = (MaskValues<'a>, [usize; 4]);

    #[derive(Clone, Copy)]
    enum MaskValues<'a> {
        Keeps(&'a [bool]),
        Bias(&'a [f32]),
    }

    /// Runs the forward and then the backward on `T` copies of the inputs (after `force`, which
    /// picks the backward's products), both checked against their f64 references; every gradient
    /// must be finite.
    fn backward_case<T: Element>(attrs: &[(&str, AttrValue)], case: Case<'_>, force: &(dyn Fn() + Sync)) {
        let ([q, k, v, dout], (q_shape, kv_shape), (lens, mask)) = case;
        let narrow = |x: &[f64]| x.iter().map(|&v| T::from_f64(v)).collect::<Vec<T>>();
        let (q, k, v, dout) = (narrow(q), narrow(k), narrow(v), narrow(dout));
        let lens_view = lens.and_then(|l| view(l, &[l.len()]));
        let mask_view = mask.and_then(|(values, shape)| match values {
            MaskValues::Keeps(keeps) => view(keeps, &shape),
            MaskValues::Bias(bias) => view(bias, &shape),
        });
        let forward_inputs =
            [view(&q, &q_shape), view(&k, &kv_shape), view(&v, &kv_shape), lens_view.clone(), mask_view.clone()];
        let fwd = run_checked_forcing("attention", &forward_inputs, attrs, force);
        let out = narrow(&fwd[0]);
        let lse: Vec<f32> = fwd[1].iter().map(|&x| x as f32).collect();
        let inputs = [
            view(&dout, &q_shape),
            view(&q, &q_shape),
            view(&k, &kv_shape),
            view(&v, &kv_shape),
            view(&out, &q_shape),
            view(&lse, &q_shape[..3]),
            lens_view,
            mask_view,
        ];
        // A float mask's gradient too (its step must skip the hidden keys as well).
        let needs_dmask = matches!(mask, Some((MaskValues::Bias(_), _)));
        let attrs: Vec<_> = attrs.iter().cloned().chain([("needs_dmask", AttrValue::Bool(needs_dmask))]).collect();
        let grads = run_checked_forcing("attention_backward", &inputs, &attrs, force);
        assert!(grads.iter().flatten().all(|g| g.is_finite()), "{:?}: a gradient is not finite", T::DTYPE);
    }
}
