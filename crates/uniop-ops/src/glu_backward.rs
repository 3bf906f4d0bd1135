//! `swiglu_backward(dout, x, dim=-1) -> dx` and `geglu_backward(dout, x, dim=-1,
//! approximate='none', activate_left=False)`, the gradients of [`swiglu` and `geglu`](crate::glu):
//! for the gate half `g` and the multiplied half `u` of `x`, `dg = dout · u · act'(g)` and
//! `du = dout · act(g)`, written into the matching halves of `dx` in one fused pass.

use crate::elementwise::{dense_map, fence, streams_bytes};
use crate::gate::{op_name, with_gate_fn, GateFn, Gating};
use crate::gated_mul::DTYPES;
use crate::glu::{glu_call, glu_input_shape, GluCall, Halves};
use uniop::{
    block_dim_for, with_float_dtype, BlockCtx, DType, Example, FloatElement, KernelArgs, LayoutNeed, Op, OpCx, Plan,
    RefTensor, Result, Step, TensorMeta,
};

pub struct GluBackward(Gating);

impl GluBackward {
    pub const SWIGLU: GluBackward = GluBackward(Gating::Silu);
    pub const GEGLU: GluBackward = GluBackward(Gating::Gelu);
}

crate::simd_kernel! {
fn kernel<T: FloatElement, A: GateFn>(args: &KernelArgs, ctx: BlockCtx, h: Halves, streaming: bool) {
    let (dout, x) = (args.input(0), args.input(1));
    let ds = &dout.storage::<T>().expect("dtype dispatched")[dout.layout().offset()..];
    let xs = &x.storage::<T>().expect("dtype dispatched")[x.layout().offset()..];
    let dx = args.output(0);
    let range = ctx.split(h.outer * h.half);
    for (o, i, len) in h.runs(range.start, range.end) {
        let d = o * h.half + i;
        let (g, u) = h.pair(o, i);
        // SAFETY: the runs of dx written here (both halves of output row `o`, columns i..i+len)
        // belong to this block's output elements alone.
        let (dg, du) = unsafe {
            (dx.slice_mut::<T>(dx.layout().offset() + g, len), dx.slice_mut::<T>(dx.layout().offset() + u, len))
        };
        dense_map([&ds[d..d + len], &xs[g..g + len], &xs[u..u + len]], [dg, du], streaming, |[d, g, u]| {
            let (dg, du) = A::mul_grad::<T>(d, g, u);
            [dg, du]
        });
    }
    fence();
}
}

impl Op for GluBackward {
    fn schema(&self) -> &'static str {
        match self.0 {
            Gating::Silu => "swiglu_backward(Tensor dout, Tensor x, int dim=-1) -> Tensor dx",
            Gating::Gelu => {
                "geglu_backward(Tensor dout, Tensor x, int dim=-1, str approximate='none', bool activate_left=False) \
                 -> Tensor dx"
            }
        }
    }

    fn doc(&self) -> &'static str {
        match self.0 {
            Gating::Silu => {
                "Gradient of swiglu: dx holds d/da = dout * b * silu'(a) in its first half along dim and d/db = dout \
                 * silu(a) in its second half. dout has swiglu's output shape."
            }
            Gating::Gelu => {
                "Gradient of geglu: dx holds d/db = dout * a * gelu'(b) in its second half along dim and d/da = dout \
                 * gelu(b) in its first (the halves' roles swapped when activate_left). dout has geglu's output shape."
            }
        }
    }

    fn leading_batch_args(&self) -> &'static [&'static str] {
        &["dout", "x"]
    }

    fn dtypes(&self) -> &'static [DType] {
        DTYPES
    }

    fn infer(&self, cx: &OpCx) -> Result<Vec<TensorMeta>> {
        let dtype = cx.expect_dtype_in("x", DTYPES)?;
        cx.expect_same_dtype("dout", dtype, "x")?;
        cx.expect_shape("dout", &glu_call(self.0, cx)?.out_shape)?;
        Ok(vec![TensorMeta::contiguous(dtype, cx.input("x").shape())?])
    }

    fn plan(&self, cx: &OpCx) -> Result<Plan> {
        let dtype = self.infer(cx)?[0].dtype;
        let GluCall { halves, activation, .. } = glu_call(self.0, cx)?;
        let n = halves.outer * halves.half;
        let block_dim = block_dim_for(n, 5 * dtype.size());
        let streaming = streams_bytes(2 * n * dtype.size());
        let name = op_name(self.schema());
        let step = with_float_dtype!(dtype, cx.op(), "x", |T| with_gate_fn!(activation, |A| {
            Step::new(name, block_dim, move |args, ctx| kernel::<T, A>(args, ctx, halves, streaming))
        }));
        Ok(Plan::new(vec![step])
            .inputs_need(vec![LayoutNeed::Contiguous; 2])
            .outputs_need(vec![LayoutNeed::Contiguous]))
    }

    fn reference(&self, cx: &OpCx, inputs: &[Option<RefTensor>]) -> Result<Vec<RefTensor>> {
        let (d, x) = (inputs[0].as_ref().unwrap(), inputs[1].as_ref().unwrap());
        let GluCall { halves: h, activation, .. } = glu_call(self.0, cx)?;
        let mut dx = vec![0.0; x.data.len()];
        for o in 0..h.outer {
            for i in 0..h.half {
                let (g, u) = h.pair(o, i);
                (dx[g], dx[u]) = activation.exact_mul_grad(d.data[o * h.half + i], x.data[g], x.data[u]);
            }
        }
        Ok(vec![RefTensor::new(&x.shape, dx)])
    }

    /// x's shape, as for the forward (the first input is the gradient of the half-width output).
    fn example_shape(&self, example: &Example) -> Vec<usize> {
        example.input_shape(1)
    }

    fn example(&self, shape: Option<&[usize]>, dtype: DType) -> Result<Example> {
        Ok(Example { inputs: backward_example_inputs(&glu_input_shape(shape), dtype)?, ..Default::default() })
    }
}

/// The inputs of an example call of a gate's backward over pairs, given its forward's `x` shape
/// (last dim even): `dout`, shaped as the forward's output (that dim halved), and `x`.
pub(crate) fn backward_example_inputs(x: &[usize], dtype: DType) -> Result<Vec<Option<TensorMeta>>> {
    let mut dout = x.to_vec();
    if let Some(last) = dout.last_mut() {
        *last /= 2;
    }
    Ok(vec![Some(TensorMeta::contiguous(dtype, &dout)?), Some(TensorMeta::contiguous(dtype, x)?)])
}
