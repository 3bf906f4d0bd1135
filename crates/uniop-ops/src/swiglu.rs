//! `swiglu(x, dim=-1) = silu(a) · b` where `a, b` are the first and second halves of `x` along
//! `dim` — aclnn's SwiGlu semantics (the first half is gated). Output has `dim` halved.
//!
//! Kernel: the executor makes `x` contiguous, so for each index `o` of the dims before `dim` the
//! halves are two dense runs of `H = shape[dim]/2 · (product of the dims after dim)` elements.

use crate::elementwise::{dense_map, fence, streams_bytes};
use crate::gated_mul::DTYPES;
use crate::math;
use uniop::{
    block_dim_for, with_float_dtype, BlockCtx, DType, ErrorCode, Example, FloatElement, KernelArgs, LayoutNeed, Op,
    OpCx, Plan, RefTensor, Result, Step, TensorMeta,
};

pub struct Swiglu;

/// How `x` splits: `outer` slices, each `[a (half elements) | b (half elements)]`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Halves {
    pub outer: usize,
    pub half: usize,
}

/// Validates `dim` against `x` (in range, even size) and returns the split and the output shape.
pub(crate) fn halves(cx: &OpCx, x: &str) -> Result<(Halves, Vec<usize>)> {
    let shape = cx.input(x).shape();
    let rank = shape.len() as i64;
    let dim = cx.int("dim");
    if !(-rank..rank).contains(&dim) {
        return Err(cx.err(ErrorCode::ParamInvalid, "dim", format!("a dim in [-{rank}, {rank}) for {x}"), dim));
    }
    let d = dim.rem_euclid(rank.max(1)) as usize;
    if !shape[d].is_multiple_of(2) {
        return Err(cx.err(ErrorCode::Shape, x, format!("an even size along dim {dim}"), shape[d]));
    }
    let mut out = shape.to_vec();
    out[d] /= 2;
    let half = out[d..].iter().product();
    Ok((Halves { outer: shape[..d].iter().product(), half }, out))
}

impl Halves {
    /// The dense runs of output elements `[start, end)` as `(o, i, len)`: output
    /// `o·half + i ..+len`, input halves at `o·2·half + i` and `o·2·half + half + i`. An iterator
    /// so that kernels keep the run bodies in their own (multiversioned) body: see
    /// [`uniop::StridedRuns::runs`].
    #[inline(always)]
    pub fn runs(&self, start: usize, end: usize) -> impl Iterator<Item = (usize, usize, usize)> + '_ {
        let mut idx = start;
        std::iter::from_fn(move || {
            (idx < end).then(|| {
                let (o, i) = (idx / self.half, idx % self.half);
                let len = (self.half - i).min(end - idx);
                idx += len;
                (o, i, len)
            })
        })
    }
}

crate::simd_kernel! {
fn kernel<T: FloatElement>(args: &KernelArgs, ctx: BlockCtx, h: Halves, streaming: bool) {
    let x = args.input(0);
    let xs = &x.storage::<T>().expect("dtype dispatched")[x.layout().offset()..];
    let out = args.output(0);
    let range = ctx.split(h.outer * h.half);
    for (o, i, len) in h.runs(range.start, range.end) {
        let a = o * 2 * h.half + i;
        // SAFETY: blocks own disjoint output element ranges.
        let dst = unsafe { out.slice_mut::<T>(out.layout().offset() + o * h.half + i, len) };
        let (gate, up) = (&xs[a..a + len], &xs[a + h.half..a + h.half + len]);
        dense_map([gate, up], [dst], streaming, |[a, b]| [math::silu::<T>(a) * b]);
    }
    fence();
}
}

impl Op for Swiglu {
    fn schema(&self) -> &'static str {
        "swiglu(Tensor x, int dim=-1) -> Tensor out"
    }

    fn doc(&self) -> &'static str {
        "SwiGLU with aclnn semantics: x splits into halves a, b along dim (size must be even); out = silu(a) * b, \
         with dim halved. f16/bf16 compute in float32."
    }

    fn dtypes(&self) -> &'static [DType] {
        DTYPES
    }

    fn backward(&self) -> Option<&'static str> {
        Some("swiglu_backward")
    }

    fn infer(&self, cx: &OpCx) -> Result<Vec<TensorMeta>> {
        let dtype = cx.expect_dtype_in("x", DTYPES)?;
        let (_, out) = halves(cx, "x")?;
        Ok(vec![TensorMeta::contiguous(dtype, &out)?])
    }

    fn plan(&self, cx: &OpCx) -> Result<Plan> {
        let dtype = cx.input("x").dtype;
        let (h, _) = halves(cx, "x")?;
        let n = h.outer * h.half;
        let block_dim = block_dim_for(n, 3 * dtype.size());
        let streaming = streams_bytes(n * dtype.size());
        let step = with_float_dtype!(dtype, cx.op(), "x", |T| {
            Step::new("swiglu", block_dim, move |args, ctx| kernel::<T>(args, ctx, h, streaming))
        });
        Ok(Plan::new(vec![step]).inputs_need(vec![LayoutNeed::Contiguous]).outputs_need(vec![LayoutNeed::Contiguous]))
    }

    fn reference(&self, cx: &OpCx, inputs: &[Option<RefTensor>]) -> Result<Vec<RefTensor>> {
        let x = inputs[0].as_ref().unwrap();
        let (h, out_shape) = halves(cx, "x")?;
        let mut out = vec![0.0; h.outer * h.half];
        for o in 0..h.outer {
            for i in 0..h.half {
                let (a, b) = (x.data[o * 2 * h.half + i], x.data[o * 2 * h.half + h.half + i]);
                out[o * h.half + i] = math::exact::silu(a) * b;
            }
        }
        Ok(vec![RefTensor::new(&out_shape, out)])
    }

    fn example(&self, shape: Option<&[usize]>, dtype: DType) -> Result<Example> {
        let mut shape = shape.unwrap_or(&[4096, 2 * 11008]).to_vec();
        if let Some(last) = shape.last_mut() {
            *last = last.next_multiple_of(2);
        }
        Ok(Example { inputs: vec![Some(TensorMeta::contiguous(dtype, &shape)?)], attrs: vec![], ..Default::default() })
    }
}
