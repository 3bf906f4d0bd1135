//! `rope_backward(dout, cos, sin, mode, per_pair)`: the gradient of [`rope`](crate::rope). The rotation is
//! linear and orthogonal per pair, so `dx` applies its transpose to `dout` — the same kernel with
//! the sign of the cross terms swapped.

use crate::rope::{example, geometry, plan, reference, DTYPES};
use uniop::{DType, Example, Op, OpCx, Plan, RefTensor, Result, TensorMeta};

pub struct RopeBackward;

impl Op for RopeBackward {
    fn schema(&self) -> &'static str {
        "rope_backward(Tensor dout, Tensor cos, Tensor sin, str mode='half', bool per_pair=False) -> Tensor dx"
    }

    fn doc(&self) -> &'static str {
        "Gradient of rope: applies the transposed rotation to dout (same cos/sin/mode/per_pair rules as rope)."
    }

    /// Row by row over broadcast tables, as rope.
    fn core_dims(&self) -> &'static [(&'static str, usize)] {
        &[("dout", 1), ("cos", 1), ("sin", 1)]
    }

    fn dtypes(&self) -> &'static [DType] {
        DTYPES
    }

    fn infer(&self, cx: &OpCx) -> Result<Vec<TensorMeta>> {
        let g = geometry(cx, "dout")?;
        Ok(vec![TensorMeta::contiguous(g.dtype, cx.input("dout").shape())?])
    }

    fn plan(&self, cx: &OpCx) -> Result<Plan> {
        plan(cx, "dout", true)
    }

    fn reference(&self, cx: &OpCx, inputs: &[Option<RefTensor>]) -> Result<Vec<RefTensor>> {
        reference(cx, "dout", inputs, true)
    }

    fn example(&self, shape: Option<&[usize]>, dtype: DType) -> Result<Example> {
        example(shape, dtype)
    }
}
