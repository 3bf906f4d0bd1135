//! `clamped_swiglu_backward(dout, x, alpha=1.702, limit=7.0) -> dx`, the gradient of
//! [`clamped_swiglu`](crate::clamped_swiglu), one pass writing both members of each pair of `dx`:
//! with `s = σ(alpha · g)` on the clamped values,
//! `d gate = dout · (u + 1) · s · (1 + alpha · g · (1 − s))` where the gate is at most `limit`, and
//! `d up = dout · g · s` where the up value is within `±limit`; 0 where a clamp cut the value
//! (torch's clamp passes the gradient at the bounds themselves).

use crate::clamped_swiglu::{pairs_shape, Clamp};
use crate::elementwise::{fence, store_step, streams_bytes, to_f32, LANES};
use crate::gated_mul::DTYPES;
use crate::math;
use uniop::{
    block_dim_for, with_float_dtype, BlockCtx, DType, Example, FloatElement, KernelArgs, LayoutNeed, Op, OpCx, Plan,
    RefTensor, Result, Step, TensorMeta,
};

pub struct ClampedSwigluBackward;

crate::simd_kernel! {
fn kernel<T: FloatElement>(args: &KernelArgs, ctx: BlockCtx, c: Clamp, streaming: bool) {
    let (dout, x) = (args.input(0), args.input(1));
    let dx = args.output(0);
    let range = ctx.split(dout.layout().numel());
    let ds = &dout.storage::<T>().expect("dtype dispatched")[dout.layout().offset() + range.start..][..range.len()];
    let xs = &x.storage::<T>().expect("dtype dispatched")[x.layout().offset() + 2 * range.start..][..2 * range.len()];
    // SAFETY: blocks own disjoint pair ranges of dx (output elements `range`).
    let dst = unsafe { dx.slice_mut::<T>(dx.layout().offset() + 2 * range.start, 2 * range.len()) };
    if T::converts_natively() {
        pairs_through::<T, true>(ds, xs, dst, c, streaming);
    } else {
        pairs_through::<T, false>(ds, xs, dst, c, streaming);
    }
    fence();
}
}

/// The gradient over dense pairs, `LANES` pairs a step (as the forward's `pairs_through`): each
/// step's gradients fill two `LANES` runs of `dx`, narrowed in registers.
#[inline(always)]
fn pairs_through<T: FloatElement, const NATIVE: bool>(ds: &[T], xs: &[T], dst: &mut [T], c: Clamp, streaming: bool) {
    let (whole, tail) = dst.split_at_mut(dst.len() / (2 * LANES) * (2 * LANES));
    let steps = ds.chunks_exact(LANES).zip(xs.chunks_exact(2 * LANES)).zip(whole.chunks_exact_mut(2 * LANES));
    for ((d, pairs), out) in steps {
        let grads = step::<T, NATIVE>(d.try_into().expect("a step"), pairs.try_into().expect("a step"), c);
        for (run, out) in grads.chunks_exact(LANES).zip(out.chunks_exact_mut(LANES)) {
            store_step::<T, NATIVE>(run.try_into().expect("a run"), out, streaming);
        }
    }
    if !tail.is_empty() {
        let pairs_done = whole.len() / 2;
        let (mut d, mut pairs) = ([T::default(); LANES], [T::default(); 2 * LANES]);
        d[..tail.len() / 2].copy_from_slice(&ds[pairs_done..]);
        pairs[..tail.len()].copy_from_slice(&xs[2 * pairs_done..]);
        T::narrow(&step::<T, NATIVE>(&d, &pairs, c)[..tail.len()], tail);
    }
}

/// One step's gradients, `dx` of its `LANES` pairs; a function, not a closure, so that it is
/// always inlined into the kernel's CPU-feature build. Written two by two into one array, which
/// the caller narrows as two runs: indexing the two runs by `i / (LANES / 2)` inside the
/// loop kept it from vectorizing (6–20x slower), and computing the two gradients as runs of their
/// own, interleaved after, left bf16 at 0.97–1.05x the staged kernel before this one.
#[inline(always)]
fn step<T: FloatElement, const NATIVE: bool>(d: &[T; LANES], pairs: &[T; 2 * LANES], c: Clamp) -> [f32; 2 * LANES] {
    let mut grads = [0f32; 2 * LANES];
    let alpha = c.alpha as f32;
    for i in 0..LANES {
        let (g, u) = (to_f32::<T, NATIVE>(pairs[2 * i]), to_f32::<T, NATIVE>(pairs[2 * i + 1]));
        let d = to_f32::<T, NATIVE>(d[i]);
        let (g, u, g_in, u_in) = c.clamp(g, u);
        let s = math::sigmoid::<T>(alpha * g);
        grads[2 * i] = if g_in { d * (u + 1.0) * s * (1.0 + alpha * g * (1.0 - s)) } else { 0.0 };
        grads[2 * i + 1] = if u_in { d * g * s } else { 0.0 };
    }
    grads
}

impl Op for ClampedSwigluBackward {
    fn schema(&self) -> &'static str {
        "clamped_swiglu_backward(Tensor dout, Tensor x, float alpha=1.702, float limit=7.0) -> Tensor dx"
    }

    fn doc(&self) -> &'static str {
        "Gradient of clamped_swiglu: dx[2i] = dout * (u + 1) * s * (1 + alpha * g * (1 - s)) where gate <= limit, \
         dx[2i+1] = dout * g * s where |up| <= limit (0 where a clamp cut the value), with s = sigmoid(alpha * g) \
         on the clamped g, u. dout has clamped_swiglu's output shape."
    }

    fn dtypes(&self) -> &'static [DType] {
        DTYPES
    }

    fn infer(&self, cx: &OpCx) -> Result<Vec<TensorMeta>> {
        let (_, out_shape) = Clamp::of(cx)?;
        let dtype = cx.input("x").dtype;
        cx.expect_same_dtype("dout", dtype, "x")?;
        cx.expect_shape("dout", &out_shape)?;
        Ok(vec![TensorMeta::contiguous(dtype, cx.input("x").shape())?])
    }

    fn plan(&self, cx: &OpCx) -> Result<Plan> {
        let dx = self.infer(cx)?.remove(0);
        let (c, _) = Clamp::of(cx)?;
        let n = dx.numel() / 2;
        let block_dim = block_dim_for(n, 5 * dx.dtype.size());
        let streaming = streams_bytes(dx.numel() * dx.dtype.size());
        let step = with_float_dtype!(dx.dtype, cx.op(), "x", |T| {
            Step::new("clamped_swiglu_backward", block_dim, move |args, ctx| kernel::<T>(args, ctx, c, streaming))
        });
        Ok(Plan::new(vec![step])
            .inputs_need(vec![LayoutNeed::Contiguous; 2])
            .outputs_need(vec![LayoutNeed::Contiguous]))
    }

    fn reference(&self, cx: &OpCx, inputs: &[Option<RefTensor>]) -> Result<Vec<RefTensor>> {
        let (d, x) = (inputs[0].as_ref().unwrap(), inputs[1].as_ref().unwrap());
        let (c, _) = Clamp::of(cx)?;
        let dx = (x.data.chunks_exact(2).zip(&d.data))
            .flat_map(|(p, &d)| {
                let (_, d_gate, d_up) = c.exact(p[0], p[1]);
                [d * d_gate, d * d_up]
            })
            .collect();
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
