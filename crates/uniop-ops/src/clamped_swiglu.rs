//! `clamped_swiglu(x, alpha=1.702, limit=7.0)`: GPT-OSS's gated activation of its experts'
//! fused `gate_up` product, whose last dim interleaves the gate and the up projection (pairs
//! `(2i, 2i+1)`, not halves as in [`swiglu`](crate::glu)):
//!
//! `g = min(x[2i], limit)`, `u = clamp(x[2i+1], −limit, limit)`, `out[i] = (u + 1) · g · σ(alpha · g)`.
//!
//! The clamps bound what a bf16 expert feeds its down projection; `u + 1` is the model's own (its
//! up projection is trained around 1, not 0). transformers writes it as five elementwise torch
//! ops on strided views (each a pass over memory, each rounded to the model's dtype); here it is
//! one pass in f32, rounded once. Why an op of its own rather than another [`GateFn`](crate::gate)
//! of the gated family: the up side is transformed too (clamped, shifted), the pairs interleave,
//! and `alpha` and `limit` are a model's config values, not a kernel's constants.

use crate::elementwise::{fence, store_step, streams_bytes, to_f32, LANES};
use crate::gated_mul::DTYPES;
use crate::math;
use uniop::{
    block_dim_for, with_float_dtype, BlockCtx, DType, Element, ErrorCode, Example, FloatElement, KernelArgs,
    LayoutNeed, Op, OpCx, Plan, RefTensor, Result, Step, TensorMeta,
};

pub struct ClampedSwiglu;

/// One call's constants: `alpha` scales the gate inside its sigmoid, `limit` bounds both sides
/// (as given, for the f64 reference; kernels compute in f32).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Clamp {
    pub alpha: f64,
    pub limit: f64,
}

impl Clamp {
    /// Validates `x` (float, last dim even), `alpha` (finite) and `limit` (≥ 0; +inf clamps
    /// nothing); returns the constants and the output's shape (the last dim halved).
    pub(crate) fn of(cx: &OpCx) -> Result<(Clamp, Vec<usize>)> {
        cx.expect_dtype_in("x", DTYPES)?;
        cx.expect_min_rank("x", 1)?;
        let (alpha, limit) = (cx.float("alpha"), cx.float("limit"));
        if !alpha.is_finite() {
            return Err(cx.err(ErrorCode::ParamInvalid, "alpha", "a finite number", alpha));
        }
        if limit.is_nan() || limit < 0.0 {
            return Err(cx.err(ErrorCode::ParamInvalid, "limit", "a number >= 0 (inf clamps nothing)", limit));
        }
        let mut shape = cx.input("x").shape().to_vec();
        let last = shape.last_mut().unwrap();
        if !last.is_multiple_of(2) {
            return Err(cx.err(ErrorCode::Shape, "x", "an even last dim (gate and up interleaved)", *last));
        }
        *last /= 2;
        Ok((Clamp { alpha, limit }, shape))
    }

    /// The gate and the up value as the activation reads them, and whether each passes its
    /// gradient (torch's clamp passes it where the value is inside the bounds, bounds included).
    #[inline(always)]
    pub(crate) fn clamp(self, g: f32, u: f32) -> (f32, f32, bool, bool) {
        let limit = self.limit as f32;
        let g_in = g <= limit;
        let u_in = u >= -limit && u <= limit;
        // A NaN passes through both, as torch's clamp (`f32::min` would replace it); `limit >= 0`
        // (validated), so `clamp` cannot panic.
        (if g > limit { limit } else { g }, u.clamp(-limit, limit), g_in, u_in)
    }

    /// `(u + 1) · g · σ(alpha · g)` on clamped values, in f32 for a result stored as `T`.
    #[inline(always)]
    pub(crate) fn apply<T: Element>(self, g: f32, u: f32) -> f32 {
        let (g, u, _, _) = self.clamp(g, u);
        (u + 1.0) * g * math::sigmoid::<T>(self.alpha as f32 * g)
    }

    /// The same in f64, for references: `(out, d out/d gate, d out/d up)` at `(g, u)`.
    pub(crate) fn exact(self, g: f64, u: f64) -> (f64, f64, f64) {
        let (alpha, limit) = (self.alpha, self.limit);
        let (gc, uc) = (if g > limit { limit } else { g }, u.clamp(-limit, limit));
        let s = math::exact::sigmoid(alpha * gc);
        let glu = gc * s;
        let d_gate = if g <= limit { (uc + 1.0) * (s + alpha * gc * s * (1.0 - s)) } else { 0.0 };
        let d_up = if (-limit..=limit).contains(&u) { glu } else { 0.0 };
        ((uc + 1.0) * glu, d_gate, d_up)
    }
}

crate::simd_kernel! {
fn kernel<T: FloatElement>(args: &KernelArgs, ctx: BlockCtx, c: Clamp, streaming: bool) {
    let x = args.input(0);
    let out = args.output(0);
    let range = ctx.split(out.layout().numel());
    let xs = &x.storage::<T>().expect("dtype dispatched")[x.layout().offset() + 2 * range.start..][..2 * range.len()];
    // SAFETY: blocks own disjoint output element ranges.
    let dst = unsafe { out.slice_mut::<T>(out.layout().offset() + range.start, range.len()) };
    if T::converts_natively() {
        pairs_through::<T, true>(xs, dst, c, streaming);
    } else {
        pairs_through::<T, false>(xs, dst, c, streaming);
    }
    fence();
}
}

/// The activation over dense pairs, [`LANES`] outputs a step: each step's `2 · LANES` inputs are
/// widened per element and its results narrowed in registers, as [`dense_map`](crate::elementwise)
/// does for ops whose operands are runs of their own. Before, the kernel widened a chunk of pairs
/// into a buffer and read the gates and the up values back from it two by two: over `[2048, 5760]`
/// on a Zen 4, alternated runs, bf16 took 1.49–2.36 ms (now 0.97–1.23), f32 2.26–5.08 (1.45–2.02),
/// f16 1.40–2.25 (1.16–1.47); the backward's steps alike, bf16 2.38–4.06 → 1.59–1.94 ms.
#[inline(always)]
fn pairs_through<T: FloatElement, const NATIVE: bool>(xs: &[T], dst: &mut [T], c: Clamp, streaming: bool) {
    let (whole, tail) = dst.split_at_mut(dst.len() / LANES * LANES);
    for (pairs, out) in xs.chunks_exact(2 * LANES).zip(whole.chunks_exact_mut(LANES)) {
        store_step::<T, NATIVE>(&step::<T, NATIVE>(pairs.try_into().expect("a step"), c), out, streaming);
    }
    if !tail.is_empty() {
        let mut pairs = [T::default(); 2 * LANES];
        pairs[..2 * tail.len()].copy_from_slice(&xs[2 * whole.len()..]);
        T::narrow(&step::<T, NATIVE>(&pairs, c)[..tail.len()], tail);
    }
}

/// One step's results: a function, not a closure, so that it is always inlined into the
/// kernel's CPU-feature build (as a closure f16's was left out of line, built for the baseline
/// target, with its conversions as calls: 43 ms instead of 1.4).
#[inline(always)]
fn step<T: FloatElement, const NATIVE: bool>(pairs: &[T; 2 * LANES], c: Clamp) -> [f32; LANES] {
    let mut results = [0f32; LANES];
    for (i, r) in results.iter_mut().enumerate() {
        *r = c.apply::<T>(to_f32::<T, NATIVE>(pairs[2 * i]), to_f32::<T, NATIVE>(pairs[2 * i + 1]));
    }
    results
}

impl Op for ClampedSwiglu {
    fn schema(&self) -> &'static str {
        "clamped_swiglu(Tensor x, float alpha=1.702, float limit=7.0) -> Tensor out"
    }

    fn doc(&self) -> &'static str {
        "GPT-OSS's gated activation: the last dim of x interleaves gate and up (pairs 2i, 2i+1; even size); g = \
         min(gate, limit), u = clamp(up, -limit, limit), out = (u + 1) * g * sigmoid(alpha * g), with the last dim \
         halved. limit >= 0 (inf: no clamp). f16/bf16 compute in float32."
    }

    fn dtypes(&self) -> &'static [DType] {
        DTYPES
    }

    fn backward(&self) -> Option<&'static str> {
        Some("clamped_swiglu_backward")
    }

    fn infer(&self, cx: &OpCx) -> Result<Vec<TensorMeta>> {
        let (_, shape) = Clamp::of(cx)?;
        Ok(vec![TensorMeta::contiguous(cx.input("x").dtype, &shape)?])
    }

    fn plan(&self, cx: &OpCx) -> Result<Plan> {
        let (c, shape) = Clamp::of(cx)?;
        let dtype = cx.input("x").dtype;
        let n: usize = shape.iter().product();
        let block_dim = block_dim_for(n, 3 * dtype.size());
        let streaming = streams_bytes(n * dtype.size());
        let step = with_float_dtype!(dtype, cx.op(), "x", |T| {
            Step::new("clamped_swiglu", block_dim, move |args, ctx| kernel::<T>(args, ctx, c, streaming))
        });
        Ok(Plan::new(vec![step]).inputs_need(vec![LayoutNeed::Contiguous]).outputs_need(vec![LayoutNeed::Contiguous]))
    }

    fn reference(&self, cx: &OpCx, inputs: &[Option<RefTensor>]) -> Result<Vec<RefTensor>> {
        let x = inputs[0].as_ref().unwrap();
        let (c, shape) = Clamp::of(cx)?;
        let out = x.data.chunks_exact(2).map(|p| c.exact(p[0], p[1]).0).collect();
        Ok(vec![RefTensor::new(&shape, out)])
    }

    fn example(&self, shape: Option<&[usize]>, dtype: DType) -> Result<Example> {
        Ok(Example {
            inputs: vec![Some(TensorMeta::contiguous(dtype, &pairs_shape(shape))?)],
            // Past the limit on both sides, so that the clamps are exercised.
            ranges: vec![Some((-10.0, 10.0))],
            ..Default::default()
        })
    }
}

/// The `x` of an example: `shape` (by default a GPT-OSS 20B expert's 2048 rows of 2 · 2880) with
/// its last dim rounded up to even.
pub(crate) fn pairs_shape(shape: Option<&[usize]>) -> Vec<usize> {
    crate::glu::glu_input_shape(Some(shape.unwrap_or(&[2048, 2 * 2880])))
}
