//! `linear_packed` and `linear_add_packed`: `linear` and `linear_add` with a weight that
//! [`pack_weight`](crate::pack_weight) packed ahead, so no call packs it again. One op type,
//! registered once per addend; the kernels are `linear`'s, reading the packed panels in place.
//!
//! The packed tensor does not record how many output features it holds (its panels are padded to
//! 32), so the ops take `out_features`, checked against the packed shape.

use crate::linear::{check_bias, output_shape, reference_rows, Addend, Dims, WeightForm};
use crate::pack_weight::{packed_dims, unpacked, DTYPES};
use uniop::{DType, Example, Op, OpCx, Plan, RefTensor, Result, TensorMeta};

pub struct LinearPacked(Addend);

impl LinearPacked {
    /// `linear_packed`: an optional bias.
    pub const BIAS: LinearPacked = LinearPacked(Addend::Bias);
    /// `linear_add_packed`: a residual.
    pub const RESIDUAL: LinearPacked = LinearPacked(Addend::Residual);
}

fn dims(cx: &OpCx, addend: Addend) -> Result<Dims> {
    let d = packed_dims(cx, false)?;
    match addend {
        Addend::Bias => check_bias(cx, d)?,
        Addend::Residual => {
            cx.expect_same_dtype("residual", cx.input("x").dtype, "x")?;
            cx.expect_shape("residual", &output_shape(cx, d))?;
        }
    }
    Ok(d)
}

impl Op for LinearPacked {
    fn schema(&self) -> &'static str {
        match self.0 {
            Addend::Bias => {
                "linear_packed(Tensor x, Tensor packed_weight, int out_features, Tensor? bias=None) -> Tensor y"
            }
            Addend::Residual => {
                "linear_add_packed(Tensor x, Tensor packed_weight, int out_features, Tensor residual) -> Tensor y"
            }
        }
    }

    fn doc(&self) -> &'static str {
        match self.0 {
            Addend::Bias => {
                "linear with its weight packed ahead: y = x @ weight^T + bias for packed_weight = pack_weight(weight), \
                 weight [out_features, in_features]; x [..., in_features]; bias optional [out_features]. bfloat16 \
                 and float32, for prefill-sized x (few rows are faster through linear)."
            }
            Addend::Residual => {
                "linear_add with its weight packed ahead: y = residual + x @ weight^T for packed_weight = \
                 pack_weight(weight), weight [out_features, in_features]; x [..., in_features], residual [..., \
                 out_features]. bfloat16 and float32, for prefill-sized x."
            }
        }
    }

    fn leading_batch_args(&self) -> &'static [&'static str] {
        match self.0 {
            Addend::Bias => &["x"],
            Addend::Residual => &["x", "residual"],
        }
    }

    fn dtypes(&self) -> &'static [DType] {
        DTYPES
    }

    fn autocast(&self) -> uniop::Autocast {
        uniop::Autocast::LowerPrecision
    }

    fn error_scale(&self, cx: &OpCx) -> f64 {
        dims(cx, self.0).map_or(1.0, |d| (d.k.max(1) as f64).sqrt())
    }

    fn infer(&self, cx: &OpCx) -> Result<Vec<TensorMeta>> {
        let d = dims(cx, self.0)?;
        Ok(vec![TensorMeta::contiguous(cx.input("x").dtype, &output_shape(cx, d))?])
    }

    fn plan(&self, cx: &OpCx) -> Result<Plan> {
        let name = match self.0 {
            Addend::Bias => "linear_packed",
            Addend::Residual => "linear_add_packed",
        };
        crate::linear::plan(cx, dims(cx, self.0)?, self.0, WeightForm::Packed, name)
    }

    fn reference(&self, cx: &OpCx, inputs: &[Option<RefTensor>]) -> Result<Vec<RefTensor>> {
        let d = dims(cx, self.0)?;
        let weight = unpacked(inputs[1].as_ref().unwrap(), false);
        let addend = |r: usize, j: usize| match (self.0, &inputs[2]) {
            (_, None) => 0.0,
            (Addend::Bias, Some(b)) => b.data[j],
            (Addend::Residual, Some(residual)) => residual.data[r * d.n + j],
        };
        let y = reference_rows(d, inputs[0].as_ref().unwrap(), |j, p| weight(0, j, p), addend);
        Ok(vec![RefTensor::new(&output_shape(cx, d), y)])
    }

    fn example(&self, shape: Option<&[usize]>, dtype: DType) -> Result<Example> {
        // `shape` is x's; as `linear`'s and `linear_add`'s examples, the weight maps in_features to
        // 2·in_features (an MLP up projection) with a bias, or to in_features with a residual.
        let shape = shape.unwrap_or(&[2048, 4096]);
        let k = shape.last().copied().unwrap_or(1);
        let x = if shape.is_empty() { vec![1] } else { shape.to_vec() };
        let n = match self.0 {
            Addend::Bias => 2 * k,
            Addend::Residual => k,
        };
        let packed = crate::packed_gemm::packed_weight_shape(dtype.size(), n, k, false);
        let third = match self.0 {
            Addend::Bias => TensorMeta::contiguous(dtype, &[n])?,
            // n = k: the residual is shaped like x.
            Addend::Residual => TensorMeta::contiguous(dtype, &x)?,
        };
        Ok(Example {
            inputs: vec![
                Some(TensorMeta::contiguous(dtype, &x)?),
                Some(TensorMeta::contiguous(dtype, &packed)?),
                Some(third),
            ],
            attrs: vec![("out_features".into(), uniop::AttrValue::Int(n as i64))],
            ..Default::default()
        })
    }
}
