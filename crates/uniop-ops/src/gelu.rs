//! `gelu(x, approximate='none')`: `x·Φ(x)` with Φ the standard normal CDF (`'none'`, via a
//! vectorizable erf), or torch's `'tanh'` approximation. Elementwise, any strides.

use crate::elementwise::{self, Map1};
use crate::math;
use uniop::{
    block_dim_for, with_float_dtype, AttrValue, DType, Element, ErrorCode, Example, Op, OpCx, Plan, RefTensor, Result,
    Step, TensorMeta,
};

pub struct Gelu;

pub(crate) const DTYPES: &[DType] = &[DType::F32, DType::F16, DType::BF16];

/// Whether `approximate` asks for the tanh form (torch's two spellings: 'none' and 'tanh').
pub(crate) fn tanh_approx(cx: &OpCx) -> Result<bool> {
    match cx.attr("approximate") {
        AttrValue::Str(s) if s == "none" => Ok(false),
        AttrValue::Str(s) if s == "tanh" => Ok(true),
        other => Err(cx.err(ErrorCode::ParamInvalid, "approximate", "'none' or 'tanh'", other)),
    }
}

/// The form is a type parameter, not a field: with a runtime flag LLVM kept both forms in the
/// bf16 loops (each computing an exp and a division, one result thrown away).
struct GeluMap<const TANH: bool>;

impl<const TANH: bool> Map1 for GeluMap<TANH> {
    #[inline(always)]
    fn apply<T: Element>(&self, x: f32) -> f32 {
        math::gelu::<T>(x, TANH)
    }
}

impl Op for Gelu {
    fn schema(&self) -> &'static str {
        "gelu(Tensor x, str approximate='none') -> Tensor y"
    }

    fn doc(&self) -> &'static str {
        "Elementwise x * Phi(x) (approximate='none', erf form) or 0.5x(1 + tanh(sqrt(2/pi)(x + 0.044715x^3))) \
         (approximate='tanh'), as torch.nn.functional.gelu. Any shape and strides."
    }

    fn dtypes(&self) -> &'static [DType] {
        DTYPES
    }

    fn elementwise(&self) -> bool {
        true
    }

    fn backward(&self) -> Option<&'static str> {
        Some("gelu_backward")
    }

    fn infer(&self, cx: &OpCx) -> Result<Vec<TensorMeta>> {
        let dtype = cx.expect_dtype_in("x", DTYPES)?;
        tanh_approx(cx)?;
        Ok(vec![TensorMeta::contiguous(dtype, cx.input("x").shape())?])
    }

    fn plan(&self, cx: &OpCx) -> Result<Plan> {
        let x = cx.input("x");
        let tanh = tanh_approx(cx)?;
        let block_dim = block_dim_for(x.numel(), 2 * x.dtype.size());
        let streaming = elementwise::streams(x);
        let step = with_float_dtype!(x.dtype, cx.op(), "x", |T| match tanh {
            true =>
                Step::new("gelu", block_dim, move |a, c| elementwise::unary::<T, _>(a, c, &GeluMap::<true>, streaming)),
            false =>
                Step::new("gelu", block_dim, move |a, c| elementwise::unary::<T, _>(a, c, &GeluMap::<false>, streaming)),
        });
        Ok(Plan::new(vec![step]))
    }

    fn reference(&self, cx: &OpCx, inputs: &[Option<RefTensor>]) -> Result<Vec<RefTensor>> {
        let (x, tanh) = (inputs[0].as_ref().unwrap(), tanh_approx(cx)?);
        Ok(vec![RefTensor::new(&x.shape, x.data.iter().map(|&v| math::exact::gelu(v, tanh)).collect())])
    }

    fn example(&self, shape: Option<&[usize]>, dtype: DType) -> Result<Example> {
        // x spans [-4, 4) so both tails and the curved middle are exercised.
        let meta = TensorMeta::contiguous(dtype, shape.unwrap_or(&[4096, 11008]))?;
        Ok(Example { inputs: vec![Some(meta)], ranges: vec![Some((-4.0, 4.0))], ..Default::default() })
    }
}
