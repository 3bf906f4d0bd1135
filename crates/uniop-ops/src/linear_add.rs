//! `linear_add(x, weight, residual) = residual + x · weightᵀ`: a projection that joins the
//! residual stream, as a transformer block's `h + down_proj(m)` and `h + o_proj(a)` do.
//!
//! Why an op: the separate add reads both `[rows, hidden]` tensors and writes a third after the
//! GEMM has written its output. Here each block copies its band of the residual into its band of
//! the output and accumulates the product onto it (what `linear` does with its bias), while the
//! band is in cache, and the sum is rounded once. In the tiny Llama's 512-token bf16 prefill the
//! separate add cost about as much as the RMSNorm beside it.

use crate::linear::{output_shape, x_and_weight, Addend, Dims, WeightForm};
use crate::matmul::DTYPES;
use uniop::{DType, Example, Op, OpCx, Plan, RefTensor, Result, TensorMeta};

pub struct LinearAdd;

fn dims(cx: &OpCx) -> Result<Dims> {
    let d = x_and_weight(cx, "weight")?;
    cx.expect_same_dtype("residual", cx.input("x").dtype, "x")?;
    cx.expect_shape("residual", &output_shape(cx, d))?;
    Ok(d)
}

impl Op for LinearAdd {
    fn schema(&self) -> &'static str {
        "linear_add(Tensor x, Tensor weight, Tensor residual) -> Tensor y"
    }

    fn doc(&self) -> &'static str {
        "y = residual + x @ weight^T, weight [out_features, in_features] (HF layout), x [..., in_features], residual \
         [..., out_features] (x's leading dims): a projection joining the residual stream (HF Llama's \
         `residual + down_proj(h)`) in one pass, the sum rounded once."
    }

    fn leading_batch_args(&self) -> &'static [&'static str] {
        &["x", "residual"]
    }

    fn dtypes(&self) -> &'static [DType] {
        DTYPES
    }

    fn backward(&self) -> Option<&'static str> {
        Some("linear_add_backward")
    }

    fn autocast(&self) -> uniop::Autocast {
        uniop::Autocast::LowerPrecision
    }

    fn error_scale(&self, cx: &OpCx) -> f64 {
        dims(cx).map_or(1.0, |d| (d.k.max(1) as f64).sqrt())
    }

    fn infer(&self, cx: &OpCx) -> Result<Vec<TensorMeta>> {
        let d = dims(cx)?;
        Ok(vec![TensorMeta::contiguous(cx.input("x").dtype, &output_shape(cx, d))?])
    }

    fn plan(&self, cx: &OpCx) -> Result<Plan> {
        crate::linear::plan(cx, dims(cx)?, Addend::Residual, WeightForm::Given, "linear_add")
    }

    fn reference(&self, cx: &OpCx, inputs: &[Option<RefTensor>]) -> Result<Vec<RefTensor>> {
        let d = dims(cx)?;
        let residual = inputs[2].as_ref().unwrap();
        let (x, w) = (inputs[0].as_ref().unwrap(), inputs[1].as_ref().unwrap());
        let y = crate::linear::reference_rows(d, x, |j, p| w.data[j * d.k + p], |r, j| residual.data[r * d.n + j]);
        Ok(vec![RefTensor::new(&output_shape(cx, d), y)])
    }

    fn example(&self, shape: Option<&[usize]>, dtype: DType) -> Result<Example> {
        // `shape` is x's; a square weight (an attention output projection) and the residual.
        let shape = shape.unwrap_or(&[2048, 4096]);
        let k = shape.last().copied().unwrap_or(1);
        let x = if shape.is_empty() { vec![1] } else { shape.to_vec() };
        Ok(Example {
            inputs: vec![
                Some(TensorMeta::contiguous(dtype, &x)?),
                Some(TensorMeta::contiguous(dtype, &[k, k])?),
                Some(TensorMeta::contiguous(dtype, &x)?),
            ],
            ..Default::default()
        })
    }
}
