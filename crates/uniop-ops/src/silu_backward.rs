//! `silu_backward(dy, x) -> dx`: `dx = dy · silu'(x)` with `silu'(x) = s · (1 + x · (1 − s))`,
//! `s = sigmoid(x)`: the gradient of [`silu`](crate::silu), one fused elementwise pass.

use crate::elementwise::{self, Map2};
use crate::math;
use uniop::{
    block_dim_for, with_float_dtype, DType, Element, Example, Op, OpCx, Plan, RefTensor, Result, Step, TensorMeta,
};

pub struct SiluBackward;

const DTYPES: &[DType] = &[DType::F32, DType::F16, DType::BF16];

struct SiluGrad;

impl Map2 for SiluGrad {
    #[inline(always)]
    fn apply<T: Element>(&self, dy: f32, x: f32) -> f32 {
        dy * math::silu_grad::<T>(x)
    }
}

impl Op for SiluBackward {
    fn schema(&self) -> &'static str {
        "silu_backward(Tensor dy, Tensor x) -> Tensor dx"
    }

    fn doc(&self) -> &'static str {
        "Gradient of silu: dx = dy * s * (1 + x * (1 - s)) with s = sigmoid(x). dy and x share shape and dtype."
    }

    fn dtypes(&self) -> &'static [DType] {
        DTYPES
    }

    fn elementwise(&self) -> bool {
        true
    }

    fn infer(&self, cx: &OpCx) -> Result<Vec<TensorMeta>> {
        let dtype = cx.expect_dtype_in("x", DTYPES)?;
        cx.expect_same_dtype("dy", dtype, "x")?;
        cx.expect_shape("dy", cx.input("x").shape())?;
        Ok(vec![TensorMeta::contiguous(dtype, cx.input("x").shape())?])
    }

    fn plan(&self, cx: &OpCx) -> Result<Plan> {
        let out = self.infer(cx)?.remove(0);
        let block_dim = block_dim_for(out.numel(), 3 * out.dtype.size());
        let streaming = elementwise::streams(&out);
        with_float_dtype!(out.dtype, cx.op(), "x", |T| {
            Ok(Plan::new(vec![Step::new("silu_backward", block_dim, move |args, ctx| {
                elementwise::binary::<T, _>(args, ctx, &SiluGrad, streaming)
            })]))
        })
    }

    fn reference(&self, _cx: &OpCx, inputs: &[Option<RefTensor>]) -> Result<Vec<RefTensor>> {
        let (dy, x) = (inputs[0].as_ref().unwrap(), inputs[1].as_ref().unwrap());
        let dx = dy.data.iter().zip(&x.data).map(|(&d, &v)| d * math::exact::silu_grad(v)).collect();
        Ok(vec![RefTensor::new(&x.shape, dx)])
    }

    fn example(&self, shape: Option<&[usize]>, dtype: DType) -> Result<Example> {
        let meta = TensorMeta::contiguous(dtype, shape.unwrap_or(&[4096, 11008]))?;
        Ok(Example {
            inputs: vec![Some(meta.clone()), Some(meta)],
            ranges: vec![None, Some((-8.0, 8.0))],
            ..Default::default()
        })
    }
}
