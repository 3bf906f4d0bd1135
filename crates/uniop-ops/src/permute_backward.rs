//! `permute_backward(dout, dims)`: the gradient of [`permute`](crate::permute) — `dout` permuted
//! back by the inverse of `dims` (a permutation only moves elements).

use crate::permute::{example, infer, plan, reference, DTYPES};
use uniop::{DType, Example, Op, OpCx, Plan, RefTensor, Result, TensorMeta};

pub struct PermuteBackward;

impl Op for PermuteBackward {
    fn schema(&self) -> &'static str {
        "permute_backward(Tensor dout, int[] dims, int batch_dims=0) -> Tensor dx"
    }

    fn doc(&self) -> &'static str {
        "Gradient of permute: dx = dout with the inverse permutation of dims applied (contiguous); dims and \
         batch_dims as given to permute. Any dtype."
    }

    fn dtypes(&self) -> &'static [DType] {
        DTYPES
    }

    fn leading_batch_args(&self) -> &'static [&'static str] {
        &["dout"]
    }

    fn infer(&self, cx: &OpCx) -> Result<Vec<TensorMeta>> {
        infer(cx, "dout", true)
    }

    fn plan(&self, cx: &OpCx) -> Result<Plan> {
        plan(cx, "dout", true)
    }

    fn reference(&self, cx: &OpCx, inputs: &[Option<RefTensor>]) -> Result<Vec<RefTensor>> {
        reference(cx, "dout", true, inputs)
    }

    fn example(&self, shape: Option<&[usize]>, dtype: DType) -> Result<Example> {
        example(shape, dtype)
    }
}
