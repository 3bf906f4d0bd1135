//! `add_rms_norm_backward(dy, dsum, sum, weight, rstd, batch_dims=0) -> (dx, dresidual, dweight)`, the gradient
//! of [`add_rms_norm`](crate::add_rms_norm): `rms_norm_backward` on `sum` with the gradient that
//! reaches `sum` directly (the residual stream's) added to its dx in the same pass, rounded once;
//! `x` and `residual` get the same gradient, written twice since returns never alias.

use crate::rms_norm_backward::{check, param_grad, plan, reference, ADD_RMS_NORM};
use uniop::{DType, Example, Op, OpCx, Plan, RefTensor, Result, TensorMeta};

pub struct AddRmsNormBackward;

impl Op for AddRmsNormBackward {
    fn schema(&self) -> &'static str {
        "add_rms_norm_backward(Tensor dy, Tensor dsum, Tensor sum, Tensor weight, Tensor rstd, int batch_dims=0) -> \
         (Tensor dx, Tensor dresidual, Tensor dweight)"
    }

    fn doc(&self) -> &'static str {
        "Gradients of add_rms_norm: dx = dresidual = rms_norm_backward's dx on sum + dsum, dweight as rms_norm_backward's \
         (dtype of weight; per sample with batch_dims), from the upstream gradients dy and dsum and the rstd and sum the forward returned."
    }

    /// Row by row; the parameter gradients per sample with `batch_dims`.
    fn leading_batch_args(&self) -> &'static [&'static str] {
        &["dy", "dsum", "sum", "rstd"]
    }

    fn dtypes(&self) -> &'static [DType] {
        crate::rms_norm::DTYPES
    }

    fn error_scale(&self, cx: &OpCx) -> f64 {
        crate::rms_norm_backward::sum_error_scale(cx, "sum")
    }

    fn infer(&self, cx: &OpCx) -> Result<Vec<TensorMeta>> {
        let s = check(cx, "sum", "add_rms_norm")?;
        cx.expect_same_dtype("dsum", s.dtype, "sum")?;
        cx.expect_shape("dsum", cx.input("sum").shape())?;
        let sum = TensorMeta::contiguous(s.dtype, cx.input("sum").shape())?;
        Ok(vec![sum.clone(), sum, param_grad(cx, "sum", &s)?])
    }

    fn plan(&self, cx: &OpCx) -> Result<Plan> {
        plan(cx, "sum", ADD_RMS_NORM, ["add_rms_norm_backward.dx", "add_rms_norm_backward.dweight"])
    }

    fn reference(&self, cx: &OpCx, inputs: &[Option<RefTensor>]) -> Result<Vec<RefTensor>> {
        let (dx, dw) = reference(cx, inputs, "sum", ADD_RMS_NORM)?;
        let dweight = param_grad(cx, "sum", &check(cx, "sum", "add_rms_norm")?)?;
        let shape = cx.input("sum").shape();
        Ok(vec![RefTensor::new(shape, dx.clone()), RefTensor::new(shape, dx), RefTensor::new(dweight.shape(), dw)])
    }

    /// sum's shape, as add_rms_norm's example takes it (x's).
    fn example_shape(&self, example: &Example) -> Vec<usize> {
        example.input_shape(2)
    }

    fn example(&self, shape: Option<&[usize]>, dtype: DType) -> Result<Example> {
        crate::rms_norm_backward::example(shape, dtype, 3)
    }
}
