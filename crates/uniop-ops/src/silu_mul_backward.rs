//! `silu_mul_backward(dout, gate, up) -> (dgate, dup)`, the gradient of [`silu_mul`]:
//! dup = dout · silu(gate), dgate = dout · up · s · (1 + gate · (1 − s)) with s = sigmoid(gate).
//! One fused pass over three inputs and two outputs.
//!
//! [`silu_mul`]: crate::silu_mul

use crate::elementwise::{dense_input, dense_map, dense_output, fence, streams_bytes};
use crate::math;
use crate::silu_mul::{check_gate_up, DTYPES};
use uniop::{
    block_dim_for, with_float_dtype, BlockCtx, DType, Example, FloatElement, KernelArgs, LayoutNeed, Op, OpCx, Plan,
    RefTensor, Result, Step, TensorMeta,
};

pub struct SiluMulBackward;

crate::simd_kernel! {
fn kernel<T: FloatElement>(args: &KernelArgs, ctx: BlockCtx, n: usize, streaming: bool) {
    let range = ctx.split(n);
    let ins = [0, 1, 2].map(|i| dense_input::<T>(args, i, range.clone()));
    // SAFETY: blocks own disjoint element ranges of both outputs.
    let outs = unsafe { [dense_output::<T>(args, 0, range.clone()), dense_output::<T>(args, 1, range)] };
    dense_map(ins, outs, streaming, |[d, g, u]| {
        let (dg, du) = math::silu_mul_grad::<T>(d, g, u);
        [dg, du]
    });
    fence();
}
}

impl Op for SiluMulBackward {
    fn schema(&self) -> &'static str {
        "silu_mul_backward(Tensor dout, Tensor gate, Tensor up) -> (Tensor dgate, Tensor dup)"
    }

    fn doc(&self) -> &'static str {
        "Gradients of silu_mul for the upstream gradient dout: dgate = dout * up * s * (1 + gate * (1 - s)) with \
         s = sigmoid(gate), dup = dout * silu(gate). All three inputs share shape and dtype."
    }

    fn dtypes(&self) -> &'static [DType] {
        DTYPES
    }

    fn elementwise(&self) -> bool {
        true
    }

    fn infer(&self, cx: &OpCx) -> Result<Vec<TensorMeta>> {
        let dtype = check_gate_up(cx)?;
        cx.expect_same_dtype("dout", dtype, "gate")?;
        cx.expect_shape("dout", cx.input("gate").shape())?;
        let meta = TensorMeta::contiguous(dtype, cx.input("gate").shape())?;
        Ok(vec![meta.clone(), meta])
    }

    fn plan(&self, cx: &OpCx) -> Result<Plan> {
        let out = self.infer(cx)?.remove(0);
        let n = out.numel();
        let block_dim = block_dim_for(n, 5 * out.dtype.size());
        let streaming = streams_bytes(2 * n * out.dtype.size());
        let step = with_float_dtype!(out.dtype, cx.op(), "gate", |T| {
            Step::new("silu_mul_backward", block_dim, move |args, ctx| kernel::<T>(args, ctx, n, streaming))
        });
        Ok(Plan::new(vec![step])
            .inputs_need(vec![LayoutNeed::Contiguous; 3])
            .outputs_need(vec![LayoutNeed::Contiguous; 2]))
    }

    fn reference(&self, _cx: &OpCx, inputs: &[Option<RefTensor>]) -> Result<Vec<RefTensor>> {
        let [d, g, u] = [0, 1, 2].map(|i| inputs[i].as_ref().unwrap());
        let (dg, du): (Vec<f64>, Vec<f64>) =
            (0..d.data.len()).map(|i| math::exact::silu_mul_grad(d.data[i], g.data[i], u.data[i])).unzip();
        Ok(vec![RefTensor::new(&g.shape, dg), RefTensor::new(&g.shape, du)])
    }

    fn example(&self, shape: Option<&[usize]>, dtype: DType) -> Result<Example> {
        let meta = TensorMeta::contiguous(dtype, shape.unwrap_or(&[4096, 11008]))?;
        Ok(Example {
            inputs: vec![Some(meta.clone()), Some(meta.clone()), Some(meta)],
            attrs: vec![],
            ..Default::default()
        })
    }
}
