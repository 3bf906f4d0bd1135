//! `clamped_swiglu(x, alpha=1.702, limit=7.0, up_shift=1.0, interleaved=True, limit_after_act=False)`:
//! the clamped gated activation of a mixture-of-experts layer's fused `gate_up` product. With `g` a
//! gate and `u` its up value along the last dim of `x`,
//!
//! `g' = min(g, limit)`, `u' = clamp(u, −limit, limit)`, `out = (u' + up_shift) · g' · σ(alpha · g')`;
//!
//! with `limit_after_act` the limit bounds the activation instead of the gate:
//! `out = (u' + up_shift) · min(g · σ(alpha · g), limit)` (Step 3.7 and Ling clip there).
//!
//! GPT-OSS (the defaults) interleaves the pairs (`2i, 2i+1`) and shifts `u` by 1 (its up projection
//! is trained around 1, not 0); DeepSeek V4, GLM-5 Next and HunYuan V4 store gate and up as the two
//! halves of the last dim (`i, i + n/2`, as [`swiglu`](crate::glu)) with `alpha = 1`, `up_shift = 0`
//! (`silu(g') · u'`); MiniMax M3 takes GPT-OSS's constants on halves. The clamps bound what a bf16
//! expert feeds its down projection. transformers writes it as five to seven elementwise torch ops
//! on strided views (each a pass over memory, each rounded to the model's dtype); here it is one
//! pass in f32, rounded once. Why an op of its own rather than another [`GateFn`](crate::gate) of
//! the gated family: the up side is transformed too (clamped, shifted), and `alpha`, `limit` and
//! the shift are a model's config values, not a kernel's constants.

use crate::elementwise::{fence, store_step, streams_bytes, to_f32, LANES};
use crate::gated_mul::DTYPES;
use crate::math;
use std::ops::Range;
use uniop::{
    block_dim_for, with_float_dtype, AttrValue, BlockCtx, DType, Element, ErrorCode, Example, FloatElement, KernelArgs,
    LayoutNeed, Op, OpCx, Plan, RefTensor, Result, Step, TensorMeta,
};

pub struct ClampedSwiglu;

/// One call's constants: `alpha` scales the gate inside its sigmoid, `limit` bounds the up value
/// and the gate (or, `after_act`, the gate's activation `g · σ(alpha · g)`: see [`LimitAt`]),
/// `up_shift` is added to the clamped up value (as given, for the f64 reference; kernels compute
/// in f32).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Clamp {
    pub alpha: f64,
    pub limit: f64,
    pub up_shift: f64,
    pub after_act: bool,
}

/// Where the limit bounds the gate side: on the gate before its activation ([`LimitGate`]:
/// GPT-OSS, DeepSeek V4) or on the activation ([`LimitAct`]: Step 3.7, Ling). A type parameter of
/// the kernels rather than a flag, so each placement compiles to a loop without the other's bound:
/// with both bounds in one loop (the absent one +inf), alternated runs on a Zen 4 put GPT-OSS's bf16
/// forward at 1.28–1.31 ms against 1.07–1.10, its f32 backward at 3.4–5.5 against 2.5–3.7.
pub(crate) trait LimitAt: Copy + Send + Sync + 'static {
    /// The gate as the activation reads it, and whether the gate's gradient passes there.
    fn gate(g: f32, limit: f32) -> (f32, bool);
    /// The activation as the product reads it, and whether the gate's gradient passes there.
    fn act(act: f32, limit: f32) -> (f32, bool);
}

/// The limit on the gate: `min(g, limit)`.
#[derive(Clone, Copy)]
pub(crate) struct LimitGate;

/// The limit on the activation: `min(g · σ(alpha · g), limit)`.
#[derive(Clone, Copy)]
pub(crate) struct LimitAct;

// A gradient passes strictly inside its bound, as torch 2.15's clamp (the minimum-norm subgradient,
// 0 on a bound; torch releases before mid-2026 passed it there). A NaN passes through the bounds,
// as torch's clamp (`f32::min` would replace it).
impl LimitAt for LimitGate {
    #[inline(always)]
    fn gate(g: f32, limit: f32) -> (f32, bool) {
        (if g > limit { limit } else { g }, g < limit)
    }

    #[inline(always)]
    fn act(act: f32, _: f32) -> (f32, bool) {
        (act, true)
    }
}

impl LimitAt for LimitAct {
    #[inline(always)]
    fn gate(g: f32, _: f32) -> (f32, bool) {
        (g, true)
    }

    #[inline(always)]
    fn act(act: f32, limit: f32) -> (f32, bool) {
        (if act > limit { limit } else { act }, act < limit)
    }
}

/// Where output `j`'s gate and up value sit in `x` (both contiguous): `half` is the output's last
/// dim, `x`'s is twice it.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Pairs {
    /// `x[.., 2j]` and `x[.., 2j + 1]` (GPT-OSS).
    Interleaved,
    /// `x[.., j]` and `x[.., half + j]` (transformers' default experts layout).
    Halves { half: usize },
}

impl Pairs {
    /// The flat indices in `x` of output `j`'s gate and up value.
    pub(crate) fn at(self, j: usize) -> (usize, usize) {
        match self {
            Pairs::Interleaved => (2 * j, 2 * j + 1),
            Pairs::Halves { half } => {
                let gate = j / half * 2 * half + j % half;
                (gate, gate + half)
            }
        }
    }

    /// The output elements `range` as stretches whose gates and up values lie at one stride each
    /// (2 interleaved, 1 in halves) from their first ones: the whole range when interleaved, one
    /// stretch per row (or part of one) in halves.
    pub(crate) fn stretches(self, range: Range<usize>) -> Stretches {
        Stretches { pairs: self, at: range.start, end: range.end }
    }
}

/// See [`Pairs::stretches`]; yields each stretch's output elements and the flat indices in `x` of
/// its first gate and up value. An iterator rather than a callback: a closure may be built outside
/// the kernel's CPU-feature build (see [`step`]).
pub(crate) struct Stretches {
    pairs: Pairs,
    at: usize,
    end: usize,
}

impl Iterator for Stretches {
    type Item = (Range<usize>, usize, usize);

    fn next(&mut self) -> Option<Self::Item> {
        if self.at >= self.end {
            return None;
        }
        let n = match self.pairs {
            Pairs::Interleaved => self.end - self.at,
            Pairs::Halves { half } => (half - self.at % half).min(self.end - self.at),
        };
        let (gate, up) = self.pairs.at(self.at);
        let outs = self.at..self.at + n;
        self.at += n;
        Some((outs, gate, up))
    }
}

impl Clamp {
    /// Validates `x` (float, last dim even), `alpha` and `up_shift` (finite) and `limit` (≥ 0; +inf
    /// clamps nothing); returns the constants, the pairs' layout and the output's shape (the last
    /// dim halved).
    pub(crate) fn of(cx: &OpCx) -> Result<(Clamp, Pairs, Vec<usize>)> {
        cx.expect_dtype_in("x", DTYPES)?;
        cx.expect_min_rank("x", 1)?;
        let (alpha, limit, up_shift) = (cx.float("alpha"), cx.float("limit"), cx.float("up_shift"));
        for (name, value) in [("alpha", alpha), ("up_shift", up_shift)] {
            if !value.is_finite() {
                return Err(cx.err(ErrorCode::ParamInvalid, name, "a finite number", value));
            }
        }
        if limit.is_nan() || limit < 0.0 {
            return Err(cx.err(ErrorCode::ParamInvalid, "limit", "a number >= 0 (inf clamps nothing)", limit));
        }
        let interleaved = matches!(cx.attr("interleaved"), AttrValue::Bool(true));
        let after_act = matches!(cx.attr("limit_after_act"), AttrValue::Bool(true));
        let mut shape = cx.input("x").shape().to_vec();
        let last = shape.last_mut().unwrap();
        if !last.is_multiple_of(2) {
            let pairs = if interleaved { "gate and up interleaved" } else { "a gate half and an up half" };
            return Err(cx.err(ErrorCode::Shape, "x", format!("an even last dim ({pairs})"), *last));
        }
        *last /= 2;
        let pairs = if interleaved { Pairs::Interleaved } else { Pairs::Halves { half: *last } };
        Ok((Clamp { alpha, limit, up_shift, after_act }, pairs, shape))
    }

    /// The gate and the up value as the activation reads them, and whether each passes its
    /// gradient (the gate's where [`LimitAt::gate`] passes it: see [`LimitAt::act`] too).
    #[inline(always)]
    pub(crate) fn clamp<L: LimitAt>(self, g: f32, u: f32) -> (f32, f32, bool, bool) {
        let limit = self.limit as f32;
        let u_in = u > -limit && u < limit;
        let (g, g_in) = L::gate(g, limit);
        // `limit >= 0` (validated), so `clamp` cannot panic; a NaN passes through it.
        (g, u.clamp(-limit, limit), g_in, u_in)
    }

    /// `(u + up_shift) · act` on clamped values, `act = g · σ(alpha · g)` within its bound, in f32
    /// for a result stored as `T`.
    #[inline(always)]
    pub(crate) fn apply<T: Element, L: LimitAt>(self, g: f32, u: f32) -> f32 {
        let (g, u, _, _) = self.clamp::<L>(g, u);
        let (act, _) = L::act(g * math::sigmoid::<T>(self.alpha as f32 * g), self.limit as f32);
        (u + self.up_shift as f32) * act
    }

    /// The same in f64, for references: `(out, d out/d gate, d out/d up)` at `(g, u)`.
    pub(crate) fn exact(self, g: f64, u: f64) -> (f64, f64, f64) {
        let (alpha, limit, shift) = (self.alpha, self.limit, self.up_shift);
        let (gate_bound, act_bound) = if self.after_act { (f64::INFINITY, limit) } else { (limit, f64::INFINITY) };
        let (gc, uc) = (if g > gate_bound { gate_bound } else { g }, u.clamp(-limit, limit));
        let s = math::exact::sigmoid(alpha * gc);
        let act = gc * s;
        let act_c = if act > act_bound { act_bound } else { act };
        let passes = g < gate_bound && act < act_bound;
        let d_gate = if passes { (uc + shift) * (s + alpha * gc * s * (1.0 - s)) } else { 0.0 };
        let d_up = if u > -limit && u < limit { act_c } else { 0.0 };
        ((uc + shift) * act_c, d_gate, d_up)
    }
}

crate::simd_kernel! {
fn kernel<T: FloatElement, L: LimitAt>(args: &KernelArgs, ctx: BlockCtx, c: Clamp, pairs: Pairs, streaming: bool) {
    let x = args.input(0);
    let out = args.output(0);
    let n = out.layout().numel();
    let range = ctx.split(n);
    let xs = &x.storage::<T>().expect("dtype dispatched")[x.layout().offset()..][..2 * n];
    // SAFETY: blocks own disjoint output element ranges.
    let dst = unsafe { out.slice_mut::<T>(out.layout().offset() + range.start, range.len()) };
    if T::converts_natively() {
        stretches_through::<T, L, true>(xs, dst, range, pairs, c, streaming);
    } else {
        stretches_through::<T, L, false>(xs, dst, range, pairs, c, streaming);
    }
    fence();
}
}

/// The block's outputs `range` (`dst`), stretch by stretch of [`Pairs::stretches`].
#[inline(always)]
fn stretches_through<T: FloatElement, L: LimitAt, const NATIVE: bool>(
    xs: &[T],
    dst: &mut [T],
    range: Range<usize>,
    pairs: Pairs,
    c: Clamp,
    streaming: bool,
) {
    let first = range.start;
    for (outs, gate, up) in pairs.stretches(range) {
        let dst = &mut dst[outs.start - first..outs.end - first];
        match pairs {
            Pairs::Interleaved => {
                through::<T, L, NATIVE, 2>(&xs[gate..2 * outs.end], &xs[up..2 * outs.end], dst, c, streaming)
            }
            Pairs::Halves { .. } => {
                through::<T, L, NATIVE, 1>(&xs[gate..][..outs.len()], &xs[up..][..outs.len()], dst, c, streaming)
            }
        }
    }
}

/// The activation over one stretch, [`LANES`] outputs a step: gate `i` at `gates[STRIDE · i]`, its
/// up value at `ups[STRIDE · i]`. Each step's inputs are widened per element and its results
/// narrowed in registers, as [`dense_map`](crate::elementwise) does for ops whose operands are runs
/// of their own. Before, the kernel widened a chunk of pairs into a buffer and read the gates and
/// the up values back from it two by two: over `[2048, 5760]` on a Zen 4, alternated runs, bf16 took
/// 1.49–2.36 ms (now 0.97–1.23), f32 2.26–5.08 (1.45–2.02), f16 1.40–2.25 (1.16–1.47); the
/// backward's steps alike, bf16 2.38–4.06 → 1.59–1.94 ms.
#[inline(always)]
fn through<T: FloatElement, L: LimitAt, const NATIVE: bool, const STRIDE: usize>(
    gates: &[T],
    ups: &[T],
    dst: &mut [T],
    c: Clamp,
    streaming: bool,
) {
    let (whole, tail) = dst.split_at_mut(dst.len() / LANES * LANES);
    for (k, out) in whole.chunks_exact_mut(LANES).enumerate() {
        let at = k * STRIDE * LANES;
        store_step::<T, NATIVE>(&step::<T, L, NATIVE, STRIDE>(&gates[at..], &ups[at..], c), out, streaming);
    }
    if !tail.is_empty() {
        let at = whole.len() * STRIDE;
        let (mut g, mut u) = ([T::default(); 2 * LANES], [T::default(); 2 * LANES]);
        g[..gates.len() - at].copy_from_slice(&gates[at..]);
        u[..ups.len() - at].copy_from_slice(&ups[at..]);
        T::narrow(&step::<T, L, NATIVE, STRIDE>(&g, &u, c)[..tail.len()], tail);
    }
}

/// One step's results: a function, not a closure, so that it is always inlined into the
/// kernel's CPU-feature build (as a closure f16's was left out of line, built for the baseline
/// target, with its conversions as calls: 43 ms instead of 1.4).
#[inline(always)]
fn step<T: FloatElement, L: LimitAt, const NATIVE: bool, const STRIDE: usize>(
    gates: &[T],
    ups: &[T],
    c: Clamp,
) -> [f32; LANES] {
    let reach = STRIDE * (LANES - 1) + 1;
    let (gates, ups) = (&gates[..reach], &ups[..reach]);
    let mut results = [0f32; LANES];
    for (i, r) in results.iter_mut().enumerate() {
        *r = c.apply::<T, L>(to_f32::<T, NATIVE>(gates[STRIDE * i]), to_f32::<T, NATIVE>(ups[STRIDE * i]));
    }
    results
}

impl Op for ClampedSwiglu {
    fn schema(&self) -> &'static str {
        "clamped_swiglu(Tensor x, float alpha=1.702, float limit=7.0, float up_shift=1.0, bool interleaved=True, \
         bool limit_after_act=False) -> Tensor out"
    }

    fn doc(&self) -> &'static str {
        "A mixture-of-experts' clamped gated activation: the last dim of x (even size) holds gate and up values, \
         interleaved (pairs 2i, 2i+1: GPT-OSS) or as its two halves (i, n/2 + i: interleaved=False, as DeepSeek V4 \
         stores them); g = min(gate, limit), u = clamp(up, -limit, limit), out = (u + up_shift) * g * \
         sigmoid(alpha * g), with the last dim halved. GPT-OSS's defaults; DeepSeek V4's silu(g) * u is alpha=1, \
         up_shift=0. limit_after_act=True bounds the activation instead of the gate: out = (u + up_shift) * \
         min(gate * sigmoid(alpha * gate), limit) (Step 3.7, Ling). limit >= 0 (inf: no clamp). f16/bf16 compute \
         in float32."
    }

    fn dtypes(&self) -> &'static [DType] {
        DTYPES
    }

    fn backward(&self) -> Option<&'static str> {
        Some("clamped_swiglu_backward")
    }

    fn infer(&self, cx: &OpCx) -> Result<Vec<TensorMeta>> {
        let (_, _, shape) = Clamp::of(cx)?;
        Ok(vec![TensorMeta::contiguous(cx.input("x").dtype, &shape)?])
    }

    fn plan(&self, cx: &OpCx) -> Result<Plan> {
        let (c, pairs, shape) = Clamp::of(cx)?;
        let dtype = cx.input("x").dtype;
        let n: usize = shape.iter().product();
        let block_dim = block_dim_for(n, 3 * dtype.size());
        let streaming = streams_bytes(n * dtype.size());
        let step = with_float_dtype!(dtype, cx.op(), "x", |T| {
            if c.after_act {
                Step::new("clamped_swiglu", block_dim, move |args, ctx| {
                    kernel::<T, LimitAct>(args, ctx, c, pairs, streaming)
                })
            } else {
                Step::new("clamped_swiglu", block_dim, move |args, ctx| {
                    kernel::<T, LimitGate>(args, ctx, c, pairs, streaming)
                })
            }
        });
        Ok(Plan::new(vec![step]).inputs_need(vec![LayoutNeed::Contiguous]).outputs_need(vec![LayoutNeed::Contiguous]))
    }

    fn reference(&self, cx: &OpCx, inputs: &[Option<RefTensor>]) -> Result<Vec<RefTensor>> {
        let x = inputs[0].as_ref().unwrap();
        let (c, pairs, shape) = Clamp::of(cx)?;
        let n = x.data.len() / 2;
        let out = (0..n).map(|j| pairs.at(j)).map(|(g, u)| c.exact(x.data[g], x.data[u]).0).collect();
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
