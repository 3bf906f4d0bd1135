//! `swiglu_backward(dout, x, dim=-1) -> dx`, the gradient of [`swiglu`]: for the halves
//! `a, b` of `x`, `da = dout · b · silu'(a)` and `db = dout · silu(a)`, written into the matching
//! halves of `dx` in one fused pass.
//!
//! [`swiglu`]: crate::swiglu

use crate::elementwise::{dense_map, fence, streams_bytes};
use crate::gated_mul::DTYPES;
use crate::math;
use crate::swiglu::{halves, Halves};
use uniop::{
    block_dim_for, with_float_dtype, BlockCtx, DType, Example, FloatElement, KernelArgs, LayoutNeed, Op, OpCx, Plan,
    RefTensor, Result, Step, TensorMeta,
};

pub struct SwigluBackward;

crate::simd_kernel! {
fn kernel<T: FloatElement>(args: &KernelArgs, ctx: BlockCtx, h: Halves, streaming: bool) {
    let (dout, x) = (args.input(0), args.input(1));
    let ds = &dout.storage::<T>().expect("dtype dispatched")[dout.layout().offset()..];
    let xs = &x.storage::<T>().expect("dtype dispatched")[x.layout().offset()..];
    let dx = args.output(0);
    let range = ctx.split(h.outer * h.half);
    for (o, i, len) in h.runs(range.start, range.end) {
        let (d, a) = (o * h.half + i, o * 2 * h.half + i);
        let b = a + h.half;
        // SAFETY: the runs of dx written here (both halves of output row `o`, columns i..i+len)
        // belong to this block's output elements alone.
        let (da, db) = unsafe {
            (dx.slice_mut::<T>(dx.layout().offset() + a, len), dx.slice_mut::<T>(dx.layout().offset() + b, len))
        };
        dense_map([&ds[d..d + len], &xs[a..a + len], &xs[b..b + len]], [da, db], streaming, |[d, a, b]| {
            let (da, db) = math::silu_mul_grad::<T>(d, a, b);
            [da, db]
        });
    }
    fence();
}
}

impl Op for SwigluBackward {
    fn schema(&self) -> &'static str {
        "swiglu_backward(Tensor dout, Tensor x, int dim=-1) -> Tensor dx"
    }

    fn doc(&self) -> &'static str {
        "Gradient of swiglu: dx holds d/da = dout * b * silu'(a) in its first half along dim and d/db = dout * silu(a) \
         in its second half. dout has swiglu's output shape."
    }

    fn dtypes(&self) -> &'static [DType] {
        DTYPES
    }

    fn infer(&self, cx: &OpCx) -> Result<Vec<TensorMeta>> {
        let dtype = cx.expect_dtype_in("x", DTYPES)?;
        cx.expect_same_dtype("dout", dtype, "x")?;
        let (_, out_shape) = halves(cx, "x")?;
        cx.expect_shape("dout", &out_shape)?;
        Ok(vec![TensorMeta::contiguous(dtype, cx.input("x").shape())?])
    }

    fn plan(&self, cx: &OpCx) -> Result<Plan> {
        let dtype = self.infer(cx)?[0].dtype;
        let (h, _) = halves(cx, "x")?;
        let n = h.outer * h.half;
        let block_dim = block_dim_for(n, 5 * dtype.size());
        let streaming = streams_bytes(2 * n * dtype.size());
        let step = with_float_dtype!(dtype, cx.op(), "x", |T| {
            Step::new("swiglu_backward", block_dim, move |args, ctx| kernel::<T>(args, ctx, h, streaming))
        });
        Ok(Plan::new(vec![step])
            .inputs_need(vec![LayoutNeed::Contiguous; 2])
            .outputs_need(vec![LayoutNeed::Contiguous]))
    }

    fn reference(&self, cx: &OpCx, inputs: &[Option<RefTensor>]) -> Result<Vec<RefTensor>> {
        let (d, x) = (inputs[0].as_ref().unwrap(), inputs[1].as_ref().unwrap());
        let (h, _) = halves(cx, "x")?;
        let mut dx = vec![0.0; x.data.len()];
        for o in 0..h.outer {
            for i in 0..h.half {
                let (a, b) = (o * 2 * h.half + i, o * 2 * h.half + h.half + i);
                (dx[a], dx[b]) = math::exact::silu_mul_grad(d.data[o * h.half + i], x.data[a], x.data[b]);
            }
        }
        Ok(vec![RefTensor::new(&x.shape, dx)])
    }

    /// x's shape, as for swiglu (the first input is the gradient of the half-width output).
    fn example_shape(&self, example: &Example) -> Vec<usize> {
        example.input_shape(1)
    }

    fn example(&self, shape: Option<&[usize]>, dtype: DType) -> Result<Example> {
        let mut shape = shape.unwrap_or(&[4096, 2 * 11008]).to_vec();
        if let Some(last) = shape.last_mut() {
            *last = last.next_multiple_of(2);
        }
        let mut out = shape.clone();
        if let Some(last) = out.last_mut() {
            *last /= 2;
        }
        let x = TensorMeta::contiguous(dtype, &shape)?;
        Ok(Example {
            inputs: vec![Some(TensorMeta::contiguous(dtype, &out)?), Some(x)],
            attrs: vec![],
            ..Default::default()
        })
    }
}
