//! `silu(x) = x · sigmoid(x)` (a.k.a. swish), computed in f32 with a vectorized exp.

use crate::elementwise::{self, Map1};
use crate::math;
use uniop::{
    block_dim_for, with_float_dtype, DType, Element, Example, Op, OpCx, Plan, RefTensor, Result, Step, TensorMeta,
};

pub struct Silu;

struct SiluMap;

impl Map1 for SiluMap {
    #[inline(always)]
    fn apply<T: Element>(&self, x: f32) -> f32 {
        math::silu::<T>(x)
    }
}

const DTYPES: &[DType] = &[DType::F32, DType::F16, DType::BF16];

impl Op for Silu {
    fn schema(&self) -> &'static str {
        "silu(Tensor x) -> Tensor y"
    }

    fn doc(&self) -> &'static str {
        "Elementwise x / (1 + exp(-x)), as torch.nn.functional.silu. Any shape and strides."
    }

    fn dtypes(&self) -> &'static [DType] {
        DTYPES
    }

    fn elementwise(&self) -> bool {
        true
    }

    fn backward(&self) -> Option<&'static str> {
        Some("silu_backward")
    }

    fn infer(&self, cx: &OpCx) -> Result<Vec<TensorMeta>> {
        let dtype = cx.expect_dtype_in("x", DTYPES)?;
        Ok(vec![TensorMeta::contiguous(dtype, cx.input("x").shape())?])
    }

    fn plan(&self, cx: &OpCx) -> Result<Plan> {
        let x = cx.input("x");
        let block_dim = block_dim_for(x.numel(), 2 * x.dtype.size());
        let streaming = elementwise::streams(x);
        with_float_dtype!(x.dtype, cx.op(), "x", |T| {
            Ok(Plan::new(vec![Step::new("silu", block_dim, move |args, ctx| {
                elementwise::unary::<T, _>(args, ctx, &SiluMap, streaming)
            })]))
        })
    }

    fn reference(&self, _cx: &OpCx, inputs: &[Option<RefTensor>]) -> Result<Vec<RefTensor>> {
        let x = inputs[0].as_ref().unwrap();
        Ok(vec![RefTensor::new(&x.shape, x.data.iter().map(|&v| v / (1.0 + (-v).exp())).collect())])
    }

    fn example(&self, shape: Option<&[usize]>, dtype: DType) -> Result<Example> {
        let meta = TensorMeta::contiguous(dtype, shape.unwrap_or(&[4096, 11008]))?;
        Ok(Example { inputs: vec![Some(meta)], attrs: vec![], ..Default::default() })
    }
}
