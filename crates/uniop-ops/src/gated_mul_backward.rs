//! `silu_mul_backward(dout, gate, up) -> (dgate, dup)` and `gelu_mul_backward(dout, gate, up,
//! approximate)`, the gradients of [`silu_mul` and `gelu_mul`](crate::gated_mul):
//! dup = dout · act(gate), dgate = dout · up · act'(gate) (for SiLU, act' = s · (1 + gate · (1 − s))
//! with s = sigmoid(gate)). One fused pass over three inputs and two outputs.

use crate::elementwise::{dense_input, dense_map, dense_output, fence, streams_bytes};
use crate::gate::{op_name, with_gate_fn, GateFn, Gating};
use crate::gated_mul::{check_gate_up, DTYPES};
use uniop::{
    block_dim_for, with_float_dtype, BlockCtx, DType, Example, FloatElement, KernelArgs, LayoutNeed, Op, OpCx, Plan,
    RefTensor, Result, Step, TensorMeta,
};

pub struct GatedMulBackward(Gating);

impl GatedMulBackward {
    pub const SILU: GatedMulBackward = GatedMulBackward(Gating::Silu);
    pub const GELU: GatedMulBackward = GatedMulBackward(Gating::Gelu);
}

crate::simd_kernel! {
fn kernel<T: FloatElement, A: GateFn>(args: &KernelArgs, ctx: BlockCtx, n: usize, streaming: bool) {
    let range = ctx.split(n);
    let ins = [0, 1, 2].map(|i| dense_input::<T>(args, i, range.clone()));
    // SAFETY: blocks own disjoint element ranges of both outputs.
    let outs = unsafe { [dense_output::<T>(args, 0, range.clone()), dense_output::<T>(args, 1, range)] };
    dense_map(ins, outs, streaming, |[d, g, u]| {
        let (dg, du) = A::mul_grad::<T>(d, g, u);
        [dg, du]
    });
    fence();
}
}

impl Op for GatedMulBackward {
    fn schema(&self) -> &'static str {
        match self.0 {
            Gating::Silu => "silu_mul_backward(Tensor dout, Tensor gate, Tensor up) -> (Tensor dgate, Tensor dup)",
            Gating::Gelu => {
                "gelu_mul_backward(Tensor dout, Tensor gate, Tensor up, str approximate='none') -> (Tensor dgate, \
                 Tensor dup)"
            }
        }
    }

    fn doc(&self) -> &'static str {
        match self.0 {
            Gating::Silu => {
                "Gradients of silu_mul for the upstream gradient dout: dgate = dout * up * s * (1 + gate * (1 - s)) \
                 with s = sigmoid(gate), dup = dout * silu(gate). All three inputs share shape and dtype."
            }
            Gating::Gelu => {
                "Gradients of gelu_mul for the upstream gradient dout: dgate = dout * up * gelu'(gate), dup = dout * \
                 gelu(gate), for the same approximate form. All three inputs share shape and dtype."
            }
        }
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
        self.0.activation(cx)?;
        let meta = TensorMeta::contiguous(dtype, cx.input("gate").shape())?;
        Ok(vec![meta.clone(), meta])
    }

    fn plan(&self, cx: &OpCx) -> Result<Plan> {
        let out = self.infer(cx)?.remove(0);
        let activation = self.0.activation(cx)?;
        let n = out.numel();
        let block_dim = block_dim_for(n, 5 * out.dtype.size());
        let streaming = streams_bytes(2 * n * out.dtype.size());
        let name = op_name(self.schema());
        let step = with_float_dtype!(out.dtype, cx.op(), "gate", |T| with_gate_fn!(activation, |A| {
            Step::new(name, block_dim, move |args, ctx| kernel::<T, A>(args, ctx, n, streaming))
        }));
        Ok(Plan::new(vec![step])
            .inputs_need(vec![LayoutNeed::Contiguous; 3])
            .outputs_need(vec![LayoutNeed::Contiguous; 2]))
    }

    fn reference(&self, cx: &OpCx, inputs: &[Option<RefTensor>]) -> Result<Vec<RefTensor>> {
        let activation = self.0.activation(cx)?;
        let [d, g, u] = [0, 1, 2].map(|i| inputs[i].as_ref().unwrap());
        let (dg, du): (Vec<f64>, Vec<f64>) =
            (0..d.data.len()).map(|i| activation.exact_mul_grad(d.data[i], g.data[i], u.data[i])).unzip();
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
