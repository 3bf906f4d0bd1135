//! `gelu_backward(dy, x, approximate='none')`: `dx = dy · gelu'(x)` for either form of
//! [`gelu`](crate::gelu). One fused elementwise pass over two inputs.

use crate::elementwise::{self, Map2};
use crate::gelu::{tanh_approx, DTYPES};
use crate::math;
use uniop::{
    block_dim_for, with_float_dtype, DType, Element, Example, Op, OpCx, Plan, RefTensor, Result, Step, TensorMeta,
};

pub struct GeluBackward;

/// The form as a type parameter, as [`gelu`](crate::gelu)'s: with a runtime flag the bf16 loop
/// computed the tanh form's exp and division beside the erf form's, and ran 2.7x slower than f32.
struct GeluGrad<const TANH: bool>;

impl<const TANH: bool> Map2 for GeluGrad<TANH> {
    #[inline(always)]
    fn apply<T: Element>(&self, dy: f32, x: f32) -> f32 {
        dy * math::gelu_grad::<T>(x, TANH)
    }
}

impl Op for GeluBackward {
    fn schema(&self) -> &'static str {
        "gelu_backward(Tensor dy, Tensor x, str approximate='none') -> Tensor dx"
    }

    fn doc(&self) -> &'static str {
        "Gradient of gelu: dx = dy * gelu'(x) for the same approximate form. dy and x share shape and dtype."
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
        tanh_approx(cx)?;
        Ok(vec![TensorMeta::contiguous(dtype, cx.input("x").shape())?])
    }

    fn plan(&self, cx: &OpCx) -> Result<Plan> {
        let out = self.infer(cx)?.remove(0);
        let tanh = tanh_approx(cx)?;
        let block_dim = block_dim_for(out.numel(), 3 * out.dtype.size());
        let streaming = elementwise::streams(&out);
        let step = with_float_dtype!(out.dtype, cx.op(), "x", |T| match tanh {
            true => Step::new("gelu_backward", block_dim, move |a, c| {
                elementwise::binary::<T, _>(a, c, &GeluGrad::<true>, streaming)
            }),
            false => Step::new("gelu_backward", block_dim, move |a, c| {
                elementwise::binary::<T, _>(a, c, &GeluGrad::<false>, streaming)
            }),
        });
        Ok(Plan::new(vec![step]))
    }

    fn reference(&self, cx: &OpCx, inputs: &[Option<RefTensor>]) -> Result<Vec<RefTensor>> {
        let (dy, x, tanh) = (inputs[0].as_ref().unwrap(), inputs[1].as_ref().unwrap(), tanh_approx(cx)?);
        let dx = dy.data.iter().zip(&x.data).map(|(&d, &v)| d * math::exact::gelu_grad(v, tanh)).collect();
        Ok(vec![RefTensor::new(&x.shape, dx)])
    }

    fn example(&self, shape: Option<&[usize]>, dtype: DType) -> Result<Example> {
        let meta = TensorMeta::contiguous(dtype, shape.unwrap_or(&[4096, 11008]))?;
        Ok(Example {
            inputs: vec![Some(meta.clone()), Some(meta)],
            ranges: vec![None, Some((-4.0, 4.0))],
            ..Default::default()
        })
    }
}
