//! `clamped_swiglu_backward(dout, x, alpha=1.702, limit=7.0, up_shift=1.0, interleaved=True,
//! limit_after_act=False) -> dx`, the gradient of [`clamped_swiglu`](crate::clamped_swiglu), one
//! pass writing both members of each pair of `dx` (laid out as `x`'s): with `s = σ(alpha · g)` on
//! the clamped values, `d gate = dout · (u + up_shift) · s · (1 + alpha · g · (1 − s))` where the
//! gate (`limit_after_act`: its activation `g · s`) is below `limit`, and `d up = dout · act` (the
//! activation as the forward bounds it) where the up value is strictly within `±limit`; 0 where a
//! clamp cut the value or left it on a bound (as torch 2.15's clamp: the minimum-norm subgradient).

use crate::clamped_swiglu::{pairs_shape, Clamp, LimitAct, LimitAt, LimitGate, Pairs};
use crate::elementwise::{fence, store_step, streams_bytes, to_f32, LANES};
use crate::gated_mul::DTYPES;
use crate::math;
use std::ops::Range;
use uniop::{
    block_dim_for, with_float_dtype, BlockCtx, DType, Example, FloatElement, KernelArgs, LayoutNeed, Op, OpCx,
    OutputView, Plan, RefTensor, Result, Step, TensorMeta,
};

pub struct ClampedSwigluBackward;

crate::simd_kernel! {
fn kernel<T: FloatElement, L: LimitAt>(args: &KernelArgs, ctx: BlockCtx, c: Clamp, pairs: Pairs, streaming: bool) {
    let (dout, x) = (args.input(0), args.input(1));
    let dx = args.output(0);
    let n = dout.layout().numel();
    let range = ctx.split(n);
    let ds = &dout.storage::<T>().expect("dtype dispatched")[dout.layout().offset()..][..n];
    let xs = &x.storage::<T>().expect("dtype dispatched")[x.layout().offset()..][..2 * n];
    if T::converts_natively() {
        stretches_through::<T, L, true>(ds, xs, &dx, range, pairs, c, streaming);
    } else {
        stretches_through::<T, L, false>(ds, xs, &dx, range, pairs, c, streaming);
    }
    fence();
}
}

/// The block's gradients for the outputs `range`, stretch by stretch of [`Pairs::stretches`].
#[inline(always)]
fn stretches_through<T: FloatElement, L: LimitAt, const NATIVE: bool>(
    ds: &[T],
    xs: &[T],
    dx: &OutputView,
    range: Range<usize>,
    pairs: Pairs,
    c: Clamp,
    streaming: bool,
) {
    let at = dx.layout().offset();
    for (outs, gate, up) in pairs.stretches(range) {
        let (d, n) = (&ds[outs.clone()], outs.len());
        match pairs {
            Pairs::Interleaved => {
                // SAFETY: blocks own disjoint output ranges, hence disjoint pairs of dx.
                let dst = unsafe { dx.slice_mut::<T>(at + gate, 2 * n) };
                interleaved_through::<T, L, NATIVE>(d, &xs[gate..2 * outs.end], dst, c, streaming);
            }
            Pairs::Halves { .. } => {
                // SAFETY: as above; a stretch's gate and up gradients lie in the two halves of one row.
                let (d_gates, d_ups) = unsafe { (dx.slice_mut::<T>(at + gate, n), dx.slice_mut::<T>(at + up, n)) };
                let (gates, ups) = (&xs[gate..][..n], &xs[up..][..n]);
                halves_through::<T, L, NATIVE>(d, gates, ups, d_gates, d_ups, c, streaming);
            }
        }
    }
}

/// The gradient of interleaved pairs, `LANES` pairs a step (as the forward's `through`): each
/// step's gradients fill two `LANES` runs of `dx`, narrowed in registers.
#[inline(always)]
fn interleaved_through<T: FloatElement, L: LimitAt, const NATIVE: bool>(
    ds: &[T],
    xs: &[T],
    dst: &mut [T],
    c: Clamp,
    streaming: bool,
) {
    let (whole, tail) = dst.split_at_mut(dst.len() / (2 * LANES) * (2 * LANES));
    for (k, out) in whole.chunks_exact_mut(2 * LANES).enumerate() {
        let (d, pairs) = (&ds[k * LANES..], &xs[2 * k * LANES..]);
        let grads = step::<T, L, NATIVE, 2>(d, pairs, &pairs[1..], c);
        for (run, out) in grads.chunks_exact(LANES).zip(out.chunks_exact_mut(LANES)) {
            store_step::<T, NATIVE>(run.try_into().expect("a run"), out, streaming);
        }
    }
    if !tail.is_empty() {
        let pairs_done = whole.len() / 2;
        let (mut d, mut pairs) = ([T::default(); LANES], [T::default(); 2 * LANES]);
        d[..tail.len() / 2].copy_from_slice(&ds[pairs_done..]);
        pairs[..tail.len()].copy_from_slice(&xs[2 * pairs_done..]);
        T::narrow(&step::<T, L, NATIVE, 2>(&d, &pairs, &pairs[1..], c)[..tail.len()], tail);
    }
}

/// The gradient of a stretch of gate/up halves, `LANES` outputs a step: each step's gradients
/// fill a run of `d_gates` and one of `d_ups`.
#[inline(always)]
fn halves_through<T: FloatElement, L: LimitAt, const NATIVE: bool>(
    ds: &[T],
    gates: &[T],
    ups: &[T],
    d_gates: &mut [T],
    d_ups: &mut [T],
    c: Clamp,
    streaming: bool,
) {
    let whole = ds.len() / LANES * LANES;
    let (d_gates, gates_tail) = d_gates.split_at_mut(whole);
    let (d_ups, ups_tail) = d_ups.split_at_mut(whole);
    let outs = d_gates.chunks_exact_mut(LANES).zip(d_ups.chunks_exact_mut(LANES));
    for (k, (d_gate, d_up)) in outs.enumerate() {
        let at = k * LANES;
        let grads = step::<T, L, NATIVE, 1>(&ds[at..], &gates[at..], &ups[at..], c);
        let (g, u) = grads.split_at(LANES);
        store_step::<T, NATIVE>(g.try_into().expect("a run"), d_gate, streaming);
        store_step::<T, NATIVE>(u.try_into().expect("a run"), d_up, streaming);
    }
    if !gates_tail.is_empty() {
        let rest = gates_tail.len();
        let (mut d, mut g, mut u) = ([T::default(); LANES], [T::default(); LANES], [T::default(); LANES]);
        d[..rest].copy_from_slice(&ds[whole..]);
        g[..rest].copy_from_slice(&gates[whole..]);
        u[..rest].copy_from_slice(&ups[whole..]);
        let grads = step::<T, L, NATIVE, 1>(&d, &g, &u, c);
        T::narrow(&grads[..rest], gates_tail);
        T::narrow(&grads[LANES..LANES + rest], ups_tail);
    }
}

/// One step's gradients of `LANES` outputs (gate `i` at `gates[STRIDE · i]`, its up value at
/// `ups[STRIDE · i]`), in one array: interleaved (`STRIDE` 2) as `dx`'s pairs, in halves (1) the
/// gates' run then the ups'. A function, not a closure, so that it is always inlined into the
/// kernel's CPU-feature build. Indexing the array by `i / (LANES / 2)` inside the loop kept it from
/// vectorizing (6–20x slower), and computing the two gradients of interleaved pairs as runs of
/// their own, interleaved after, left bf16 at 0.97–1.05x the staged kernel before this one.
#[inline(always)]
fn step<T: FloatElement, L: LimitAt, const NATIVE: bool, const STRIDE: usize>(
    d: &[T],
    gates: &[T],
    ups: &[T],
    c: Clamp,
) -> [f32; 2 * LANES] {
    let reach = STRIDE * (LANES - 1) + 1;
    let (d, gates, ups) = (&d[..LANES], &gates[..reach], &ups[..reach]);
    let mut grads = [0f32; 2 * LANES];
    let (alpha, shift, limit) = (c.alpha as f32, c.up_shift as f32, c.limit as f32);
    for i in 0..LANES {
        let (g, u) = (to_f32::<T, NATIVE>(gates[STRIDE * i]), to_f32::<T, NATIVE>(ups[STRIDE * i]));
        let d = to_f32::<T, NATIVE>(d[i]);
        let (g, u, g_in, u_in) = c.clamp::<L>(g, u);
        let s = math::sigmoid::<T>(alpha * g);
        let (act, act_in) = L::act(g * s, limit);
        let (at_gate, at_up) = if STRIDE == 2 { (2 * i, 2 * i + 1) } else { (i, LANES + i) };
        // `&`, not `&&`: both are computed anyway, and a short circuit is a branch in the loop.
        grads[at_gate] = if g_in & act_in { d * (u + shift) * s * (1.0 + alpha * g * (1.0 - s)) } else { 0.0 };
        grads[at_up] = if u_in { d * act } else { 0.0 };
    }
    grads
}

impl Op for ClampedSwigluBackward {
    fn schema(&self) -> &'static str {
        "clamped_swiglu_backward(Tensor dout, Tensor x, float alpha=1.702, float limit=7.0, float up_shift=1.0, \
         bool interleaved=True, bool limit_after_act=False) -> Tensor dx"
    }

    fn doc(&self) -> &'static str {
        "Gradient of clamped_swiglu: d gate = dout * (u + up_shift) * s * (1 + alpha * g * (1 - s)) where gate < \
         limit (limit_after_act: where g * s < limit), d up = dout * act where |up| < limit, act = g * s as the \
         forward bounds it (0 where a clamp cut the value or left it on a bound, as torch's clamp), with s = \
         sigmoid(alpha * g) on the clamped g, u; dx lays them out as x (interleaved or halves). dout has \
         clamped_swiglu's output shape."
    }

    fn dtypes(&self) -> &'static [DType] {
        DTYPES
    }

    fn infer(&self, cx: &OpCx) -> Result<Vec<TensorMeta>> {
        let (_, _, out_shape) = Clamp::of(cx)?;
        let dtype = cx.input("x").dtype;
        cx.expect_same_dtype("dout", dtype, "x")?;
        cx.expect_shape("dout", &out_shape)?;
        Ok(vec![TensorMeta::contiguous(dtype, cx.input("x").shape())?])
    }

    fn plan(&self, cx: &OpCx) -> Result<Plan> {
        let dx = self.infer(cx)?.remove(0);
        let (c, pairs, _) = Clamp::of(cx)?;
        let n = dx.numel() / 2;
        let block_dim = block_dim_for(n, 5 * dx.dtype.size());
        let streaming = streams_bytes(dx.numel() * dx.dtype.size());
        let step = with_float_dtype!(dx.dtype, cx.op(), "x", |T| {
            if c.after_act {
                Step::new("clamped_swiglu_backward", block_dim, move |args, ctx| {
                    kernel::<T, LimitAct>(args, ctx, c, pairs, streaming)
                })
            } else {
                Step::new("clamped_swiglu_backward", block_dim, move |args, ctx| {
                    kernel::<T, LimitGate>(args, ctx, c, pairs, streaming)
                })
            }
        });
        Ok(Plan::new(vec![step])
            .inputs_need(vec![LayoutNeed::Contiguous; 2])
            .outputs_need(vec![LayoutNeed::Contiguous]))
    }

    fn reference(&self, cx: &OpCx, inputs: &[Option<RefTensor>]) -> Result<Vec<RefTensor>> {
        let (d, x) = (inputs[0].as_ref().unwrap(), inputs[1].as_ref().unwrap());
        let (c, pairs, _) = Clamp::of(cx)?;
        let mut dx = vec![0.0; x.data.len()];
        for (j, &d) in d.data.iter().enumerate() {
            let (gate, up) = pairs.at(j);
            let (_, d_gate, d_up) = c.exact(x.data[gate], x.data[up]);
            (dx[gate], dx[up]) = (d * d_gate, d * d_up);
        }
        Ok(vec![RefTensor::new(&x.shape, dx)])
    }

    /// x's shape, as for the forward (the first input is the gradient of the half-width output).
    fn example_shape(&self, example: &Example) -> Vec<usize> {
        example.input_shape(1)
    }

    fn example(&self, shape: Option<&[usize]>, dtype: DType) -> Result<Example> {
        let shape = pairs_shape(shape);
        let mut out = shape.clone();
        if let Some(last) = out.last_mut() {
            *last /= 2;
        }
        Ok(Example {
            inputs: vec![Some(TensorMeta::contiguous(dtype, &out)?), Some(TensorMeta::contiguous(dtype, &shape)?)],
            ranges: vec![None, Some((-10.0, 10.0))],
            ..Default::default()
        })
    }
}
