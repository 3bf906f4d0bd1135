//! `cast(x, dtype)`: converts every element to another dtype, with C/torch rules: between
//! integers (and bool) two's-complement wrapping through i64 — exact for all 64 bits; float to
//! integer truncates toward zero and saturates (NaN → 0, where torch leaves it undefined);
//! to bool is `!= 0`; to floats rounds to nearest even. Between f32/f16/bf16 the kernel runs the
//! bulk widen/narrow path (one rounding, vectorized). Outputs too big for the cache are written with
//! non-temporal stores: a cast reads and writes once, so memory traffic is all it costs.

use crate::elementwise::{self, dense_input, dense_output};
use uniop::{
    block_dim_for, dispatch_element, AttrValue, BlockCtx, DType, Element, ErrorCode, Example, FloatElement, KernelArgs,
    LayoutNeed, Op, OpCx, Plan, RefTensor, Result, Step, TensorMeta,
};

pub struct Cast;

const DTYPES: &[DType] =
    &[DType::F32, DType::F16, DType::BF16, DType::F64, DType::I8, DType::I32, DType::I64, DType::U8, DType::Bool];

fn is_integral(d: DType) -> bool {
    matches!(d, DType::I8 | DType::I32 | DType::I64 | DType::U8 | DType::Bool)
}

fn target(cx: &OpCx) -> Result<DType> {
    match cx.attr("dtype") {
        AttrValue::DType(d) => Ok(*d),
        other => Err(cx.err(ErrorCode::ParamInvalid, "dtype", "a dtype", other)),
    }
}

/// One element, by the rules in the module doc.
#[inline(always)]
fn convert<S: Element, D: Element>(v: S) -> D {
    if is_integral(S::DTYPE) && is_integral(D::DTYPE) {
        D::from_i64(v.to_i64())
    } else {
        D::from_f64(v.to_f64())
    }
}

fn kernel<S: Element, D: Element>(args: &KernelArgs, ctx: BlockCtx, n: usize, streaming: bool) {
    let range = ctx.split(n);
    let src = dense_input::<S>(args, 0, range.clone());
    // SAFETY: blocks own disjoint element ranges.
    let dst = unsafe { dense_output::<D>(args, 0, range) };
    if !streaming {
        for (d, &s) in dst.iter_mut().zip(src) {
            *d = convert(s);
        }
        return;
    }
    let mut tmp = elementwise::Aligned([D::default(); elementwise::CHUNK]);
    for (s, d) in src.chunks(elementwise::CHUNK).zip(dst.chunks_mut(elementwise::CHUNK)) {
        for (t, &v) in tmp.iter_mut().zip(s) {
            *t = convert(v);
        }
        elementwise::copy_streaming(d, &tmp[..s.len()]);
    }
    elementwise::fence();
}

crate::simd_kernel! {
/// f32/f16/bf16 to each other: widen to f32, narrow once.
fn float_kernel<S: FloatElement, D: FloatElement>(args: &KernelArgs, ctx: BlockCtx, n: usize, streaming: bool) {
    const CHUNK: usize = 256;
    let range = ctx.split(n);
    let src = dense_input::<S>(args, 0, range.clone());
    // SAFETY: blocks own disjoint element ranges.
    let dst = unsafe { dense_output::<D>(args, 0, range) };
    // f32 sources are narrowed straight from the input; the others widen into a staging chunk.
    if let Some(src) = S::as_f32_slice(src) {
        elementwise::narrow_into(src, dst, streaming);
    } else {
        let mut buf = [0f32; CHUNK];
        for (s, d) in src.chunks(CHUNK).zip(dst.chunks_mut(CHUNK)) {
            S::widen(s, &mut buf[..s.len()]);
            elementwise::narrow_into(&buf[..s.len()], d, streaming);
        }
    }
    elementwise::fence();
}
}

fn is_half_or_f32(d: DType) -> bool {
    matches!(d, DType::F32 | DType::F16 | DType::BF16)
}

/// The plan converting input 0 to dtype `to` into output 0: cast's, and cast_backward's (which
/// converts a gradient back to its argument's dtype). `(source, dtype)`: the arguments that give
/// the source and the target dtype, named in errors.
pub(crate) fn conversion_plan(cx: &OpCx, (source, dtype): (&str, &str), to: DType) -> Result<Plan> {
    let x = cx.input(source);
    let (from, n) = (x.dtype, x.numel());
    let block_dim = block_dim_for(n, from.size() + to.size());
    let streaming = elementwise::streams(&TensorMeta::contiguous(to, x.shape())?);
    let step = if is_half_or_f32(from) && is_half_or_f32(to) {
        uniop::with_float_dtype!(from, cx.op(), source, |S| uniop::with_float_dtype!(to, cx.op(), dtype, |D| {
            Step::new("cast", block_dim, move |args, ctx| float_kernel::<S, D>(args, ctx, n, streaming))
        }))
    } else {
        dispatch_element!(from, |S| dispatch_element!(to, |D| {
            Step::new("cast", block_dim, move |args, ctx| kernel::<S, D>(args, ctx, n, streaming))
        }))
    };
    Ok(Plan::new(vec![step]).inputs_need(vec![LayoutNeed::Contiguous]).outputs_need(vec![LayoutNeed::Contiguous]))
}

/// The f64 reference of converting `x` from dtype `from` to `to`, by the rules in the module doc.
pub(crate) fn reference_conversion(x: &RefTensor, from: DType, to: DType) -> RefTensor {
    let y = dispatch_element!(to, |D| {
        x.data
            .iter()
            .map(|&v| {
                let d: D = if is_integral(from) && is_integral(to) { D::from_i64(v as i64) } else { D::from_f64(v) };
                d.to_f64()
            })
            .collect()
    });
    RefTensor::new(&x.shape, y)
}

impl Op for Cast {
    fn schema(&self) -> &'static str {
        "cast(Tensor x, ScalarType dtype) -> Tensor y"
    }

    fn doc(&self) -> &'static str {
        "Converts x to dtype (any pair of the 9 dtypes). Integers/bool to integers wrap (two's complement), floats \
         to integers truncate toward zero and saturate (NaN -> 0), anything to bool is != 0, to floats rounds to \
         nearest even."
    }

    fn dtypes(&self) -> &'static [DType] {
        DTYPES
    }

    fn elementwise(&self) -> bool {
        true
    }

    fn backward(&self) -> Option<&'static str> {
        Some("cast_backward")
    }

    fn infer(&self, cx: &OpCx) -> Result<Vec<TensorMeta>> {
        Ok(vec![TensorMeta::contiguous(target(cx)?, cx.input("x").shape())?])
    }

    fn plan(&self, cx: &OpCx) -> Result<Plan> {
        conversion_plan(cx, ("x", "dtype"), target(cx)?)
    }

    fn reference(&self, cx: &OpCx, inputs: &[Option<RefTensor>]) -> Result<Vec<RefTensor>> {
        Ok(vec![reference_conversion(inputs[0].as_ref().unwrap(), cx.input("x").dtype, target(cx)?)])
    }

    fn example(&self, shape: Option<&[usize]>, dtype: DType) -> Result<Example> {
        let meta = TensorMeta::contiguous(dtype, shape.unwrap_or(&[4096, 4096]))?;
        let to = if dtype == DType::F32 { DType::BF16 } else { DType::F32 };
        Ok(Example {
            inputs: vec![Some(meta)],
            attrs: vec![("dtype".into(), AttrValue::DType(to))],
            ..Default::default()
        })
    }
}
