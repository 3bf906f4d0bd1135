//! `cast_backward(dy, x) -> dx`: the gradient of a float-to-float [`cast`](crate::cast) is the
//! output's gradient converted back to the argument's dtype (one rounding, as torch's `to`
//! backward does). Integer and bool casts have no gradient.

use crate::cast::{conversion_plan, reference_conversion};
use uniop::{DType, Example, Op, OpCx, Plan, RefTensor, Result, TensorMeta};

pub struct CastBackward;

const DTYPES: &[DType] = &[DType::F32, DType::F16, DType::BF16, DType::F64];

impl Op for CastBackward {
    fn schema(&self) -> &'static str {
        "cast_backward(Tensor dy, Tensor x) -> Tensor dx"
    }

    fn doc(&self) -> &'static str {
        "Gradient of cast between float dtypes: dx = dy converted to x's dtype (rounding to nearest even). dy and \
         x share a shape; both are float."
    }

    fn dtypes(&self) -> &'static [DType] {
        DTYPES
    }

    fn elementwise(&self) -> bool {
        true
    }

    fn infer(&self, cx: &OpCx) -> Result<Vec<TensorMeta>> {
        cx.expect_dtype_in("dy", DTYPES)?;
        let dtype = cx.expect_dtype_in("x", DTYPES)?;
        cx.expect_shape("dy", cx.input("x").shape())?;
        Ok(vec![TensorMeta::contiguous(dtype, cx.input("x").shape())?])
    }

    fn plan(&self, cx: &OpCx) -> Result<Plan> {
        let dx = self.infer(cx)?.remove(0);
        conversion_plan(cx, ("dy", "x"), dx.dtype)
    }

    fn reference(&self, cx: &OpCx, inputs: &[Option<RefTensor>]) -> Result<Vec<RefTensor>> {
        let dy = inputs[0].as_ref().unwrap();
        Ok(vec![reference_conversion(dy, cx.input("dy").dtype, cx.input("x").dtype)])
    }

    fn example(&self, shape: Option<&[usize]>, dtype: DType) -> Result<Example> {
        // `dtype` is x's (the gradient's), the dtype cast's example casts from.
        let shape = shape.unwrap_or(&[4096, 4096]);
        let cast_to = if dtype == DType::F32 { DType::BF16 } else { DType::F32 };
        Ok(Example {
            inputs: vec![Some(TensorMeta::contiguous(cast_to, shape)?), Some(TensorMeta::contiguous(dtype, shape)?)],
            ..Default::default()
        })
    }
}
