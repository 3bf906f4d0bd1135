//! `mul(a, b) = a · b` elementwise with NumPy/torch broadcasting; f16/bf16 compute in f32.

use crate::elementwise::{self, Map2};
use uniop::{
    block_dim_for, with_float_dtype, DType, Element, Example, Op, OpCx, Plan, RefTensor, Result, Step, TensorMeta,
};

pub struct Mul;

const DTYPES: &[DType] = &[DType::F32, DType::F16, DType::BF16];

struct MulMap;

impl Map2 for MulMap {
    #[inline(always)]
    fn apply<T: Element>(&self, a: f32, b: f32) -> f32 {
        a * b
    }
}

impl Op for Mul {
    fn schema(&self) -> &'static str {
        "mul(Tensor a, Tensor b) -> Tensor out"
    }

    fn doc(&self) -> &'static str {
        "Elementwise a * b; a and b broadcast against each other and share a dtype."
    }

    fn dtypes(&self) -> &'static [DType] {
        DTYPES
    }

    fn elementwise(&self) -> bool {
        true
    }

    fn backward(&self) -> Option<&'static str> {
        Some("mul_backward")
    }

    fn infer(&self, cx: &OpCx) -> Result<Vec<TensorMeta>> {
        let dtype = cx.expect_dtype_in("a", DTYPES)?;
        cx.expect_same_dtype("b", dtype, "a")?;
        Ok(vec![TensorMeta::contiguous(dtype, &elementwise::broadcast_inputs(cx, "a", "b")?)?])
    }

    fn plan(&self, cx: &OpCx) -> Result<Plan> {
        let out = self.infer(cx)?.remove(0);
        let block_dim = block_dim_for(out.numel(), 3 * out.dtype.size());
        let streaming = elementwise::streams(&out);
        with_float_dtype!(out.dtype, cx.op(), "a", |T| {
            Ok(Plan::new(vec![Step::new("mul", block_dim, move |args, ctx| {
                elementwise::binary::<T, _>(args, ctx, &MulMap, streaming)
            })]))
        })
    }

    fn reference(&self, _cx: &OpCx, inputs: &[Option<RefTensor>]) -> Result<Vec<RefTensor>> {
        let (a, b) = (inputs[0].as_ref().unwrap(), inputs[1].as_ref().unwrap());
        Ok(vec![elementwise::reference_binary(a, b, |x, y| x * y)?])
    }

    fn example(&self, shape: Option<&[usize]>, dtype: DType) -> Result<Example> {
        let shape = shape.unwrap_or(&[4096, 4096]);
        let a = TensorMeta::contiguous(dtype, shape)?;
        // The second operand broadcasts along the leading dims, as a per-channel scale does.
        let b = TensorMeta::contiguous(dtype, &shape[shape.len().saturating_sub(1)..])?;
        Ok(Example { inputs: vec![Some(a), Some(b)], attrs: vec![], ..Default::default() })
    }
}
