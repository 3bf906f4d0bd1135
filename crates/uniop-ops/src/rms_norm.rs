//! `rms_norm(x, weight, eps) -> (y, rstd)`: y = x · rstd · weight, rstd = 1/√(mean(x²) + eps).
//!
//! The normalized dims are the trailing dims of `x` matching `weight`'s shape (aclnn semantics;
//! usually just the last dim). `rstd` is f32 and keeps the normalized dims as size 1, so it
//! broadcasts against `x` and feeds `rms_norm_backward` directly. `weight` may be the dtype of `x`
//! or f32 (mixed precision: f32 master weights with bf16 activations).
//!
//! Kernel: one row per iteration, each block owns a contiguous range of rows. A row is read twice
//! (sum of squares, then scale), but the second read hits L1/L2, so the op moves each byte of DRAM
//! once — it is bandwidth-bound by design.

use crate::elementwise::{fence, narrow_into, CHUNK, STREAMING_BYTES};
use uniop::{
    block_dim_for, with_float_dtype, BlockCtx, DType, ErrorCode, Example, FloatElement, KernelArgs, LayoutNeed, Op, OpCx,
    Plan, RefTensor, Result, Step, TensorMeta,
};

pub struct RmsNorm;

pub(crate) const DTYPES: &[DType] = &[DType::F32, DType::F16, DType::BF16];

/// Shape facts shared by forward and backward: the checked input dtype, how many trailing dims
/// are normalized, and the `[rows, cols]` view.
pub(crate) struct NormShape {
    pub dtype: DType,
    pub inner_dims: usize,
    pub rows: usize,
    pub cols: usize,
    pub rstd_shape: Vec<usize>,
}

pub(crate) fn norm_shape(cx: &OpCx, x: &str, weight: &str) -> Result<NormShape> {
    let dtype = cx.expect_dtype_in(x, DTYPES)?;
    let w = cx.input(weight);
    if w.dtype != dtype && w.dtype != DType::F32 {
        return Err(cx.err(ErrorCode::DType, weight, format!("dtype {dtype} (same as '{x}') or float32"), w.dtype));
    }
    let xs = cx.input(x).shape();
    let k = w.rank();
    if k == 0 || k > xs.len() || xs[xs.len() - k..] != *w.shape() {
        return Err(cx.err(
            ErrorCode::Shape,
            weight,
            format!("a non-empty shape equal to trailing dims of {x} {}", uniop::layout::ShapeDisplay(xs)),
            uniop::layout::ShapeDisplay(w.shape()),
        ));
    }
    let cols = w.shape().iter().product();
    let rows = xs[..xs.len() - k].iter().product();
    let mut rstd_shape = xs[..xs.len() - k].to_vec();
    rstd_shape.extend(std::iter::repeat_n(1, k));
    Ok(NormShape { dtype, inner_dims: k, rows, cols, rstd_shape })
}

impl NormShape {
    /// Row kernels need each normalized slice dense: the last dim for 1-D weights, the whole
    /// tensor otherwise (the executor stages a copy when the caller's layout differs).
    pub fn row_need(&self) -> LayoutNeed {
        if self.inner_dims == 1 {
            LayoutNeed::InnerContiguous
        } else {
            LayoutNeed::Contiguous
        }
    }
}

pub(crate) fn check_eps(cx: &OpCx) -> Result<f32> {
    let eps = cx.float("eps");
    if !(eps.is_finite() && eps >= 0.0) {
        return Err(cx.err(ErrorCode::ParamInvalid, "eps", "a finite value ≥ 0", eps));
    }
    Ok(eps as f32)
}

/// Σ x² over a dense f32 slice with 32 independent lanes (two AVX-512 accumulators).
#[inline(always)]
pub(crate) fn sum_squares_f32(x: &[f32]) -> f32 {
    let mut acc = [0f32; 32];
    let chunks = x.chunks_exact(32);
    let tail = chunks.remainder();
    for c in chunks {
        for i in 0..32 {
            acc[i] += c[i] * c[i];
        }
    }
    for (a, v) in acc.iter_mut().zip(tail) {
        *a += v * v;
    }
    acc.iter().sum()
}

/// `src` as f32: borrowed when it already is, else widened into `scratch`.
#[inline(always)]
pub(crate) fn as_f32<'a, T: FloatElement>(src: &'a [T], scratch: &'a mut [f32]) -> &'a [f32] {
    match T::as_f32_slice(src) {
        Some(f) => f,
        None => {
            T::widen(src, &mut scratch[..src.len()]);
            &scratch[..src.len()]
        }
    }
}

crate::simd_kernel! {
/// Rows `split(rows)`: widen the row once (f16/bf16) into the block's scratch, reduce, then scale
/// chunk by chunk into y.
fn forward_kernel<T: FloatElement, W: FloatElement>(args: &KernelArgs, ctx: BlockCtx, s: &KernelShape) {
    let (x, w) = (args.input(0), args.input(1));
    let (y, rstd_out) = (args.output(0), args.output(1));
    let cols = s.cols;
    let w = &w.storage::<W>().expect("dtype dispatched")[w.layout().offset()..][..cols];
    let xs = x.storage::<T>().expect("dtype dispatched");
    // SAFETY: block b owns scratch rows 2b and 2b+1 (sized by the plan when a widen is needed).
    let (row_scratch, w_scratch): (&mut [f32], &mut [f32]) = if s.scratch {
        unsafe { args.workspace::<f32>(2 * ctx.block_idx as usize * cols, 2 * cols).split_at_mut(cols) }
    } else {
        (&mut [], &mut [])
    };
    let wf = as_f32(w, w_scratch);
    // SAFETY: each block writes only the rstd entries of its own rows (below).
    let rstd_ptr = unsafe { rstd_out.as_mut_ptr::<f32>() };
    let mut out = [0f32; CHUNK];
    for r in ctx.split(s.rows) {
        let xo = x.layout().outer_offset(r, s.inner_dims);
        let xf = as_f32(&xs[xo..xo + cols], row_scratch);
        let rstd = 1.0 / (sum_squares_f32(xf) / cols as f32 + s.eps).sqrt();
        // SAFETY: this block owns rows `split(rows)` of y and rstd.
        let yrow = unsafe { y.slice_mut::<T>(y.layout().outer_offset(r, s.inner_dims), cols) };
        unsafe { *rstd_ptr.add(rstd_out.layout().offset_of_linear(r)) = rstd };
        for ((xc, wc), yc) in xf.chunks(CHUNK).zip(wf.chunks(CHUNK)).zip(yrow.chunks_mut(CHUNK)) {
            let n = xc.len();
            for ((o, &a), &g) in out[..n].iter_mut().zip(xc).zip(wc) {
                *o = a * rstd * g;
            }
            narrow_into(&out[..n], yc, s.streaming);
        }
    }
    fence();
}
}

/// Plan-time constants of the row kernels.
#[derive(Clone, Copy)]
pub(crate) struct KernelShape {
    pub rows: usize,
    pub cols: usize,
    pub inner_dims: usize,
    pub eps: f32,
    /// Whether blocks have f32 scratch rows in the workspace (f16/bf16 data or weight).
    pub scratch: bool,
    /// Whether outputs are written with non-temporal stores.
    pub streaming: bool,
}

impl Op for RmsNorm {
    fn schema(&self) -> &'static str {
        "rms_norm(Tensor x, Tensor weight, float eps=1e-06) -> (Tensor y, Tensor rstd)"
    }

    fn doc(&self) -> &'static str {
        "Root-mean-square normalization (LLaMA's RMSNorm): y = x / sqrt(mean(x^2) + eps) * weight over the \
         trailing dims matching weight's shape. rstd (float32, normalized dims kept as 1) is returned for \
         the backward. weight: same dtype as x, or float32. f16/bf16 accumulate in float32."
    }

    fn dtypes(&self) -> &'static [DType] {
        DTYPES
    }

    fn backward(&self) -> Option<&'static str> {
        Some("rms_norm_backward")
    }

    fn infer(&self, cx: &OpCx) -> Result<Vec<TensorMeta>> {
        let s = norm_shape(cx, "x", "weight")?;
        check_eps(cx)?;
        Ok(vec![TensorMeta::contiguous(s.dtype, cx.input("x").shape())?, TensorMeta::contiguous(DType::F32, &s.rstd_shape)?])
    }

    fn plan(&self, cx: &OpCx) -> Result<Plan> {
        let s = norm_shape(cx, "x", "weight")?;
        let weight_f32 = cx.input("weight").dtype == DType::F32;
        let scratch = s.dtype != DType::F32 || !weight_f32;
        let bytes = s.rows * s.cols * s.dtype.size();
        let ks = KernelShape {
            rows: s.rows,
            cols: s.cols,
            inner_dims: s.inner_dims,
            eps: check_eps(cx)?,
            scratch,
            streaming: bytes >= STREAMING_BYTES,
        };
        let block_dim = block_dim_for(s.rows, 2 * s.cols * s.dtype.size());
        let workspace = if scratch { block_dim as usize * 2 * s.cols * 4 } else { 0 };
        let step = with_float_dtype!(s.dtype, cx.op(), "x", |T| {
            if weight_f32 {
                Step::new("rms_norm", block_dim, move |a, c| forward_kernel::<T, f32>(a, c, &ks))
            } else {
                Step::new("rms_norm", block_dim, move |a, c| forward_kernel::<T, T>(a, c, &ks))
            }
        });
        Ok(Plan::new(vec![step])
            .workspace(workspace)
            .inputs_need(vec![s.row_need(), LayoutNeed::Contiguous])
            .outputs_need(vec![s.row_need(), LayoutNeed::Any]))
    }

    fn reference(&self, cx: &OpCx, inputs: &[Option<RefTensor>]) -> Result<Vec<RefTensor>> {
        let s = norm_shape(cx, "x", "weight")?;
        let (x, w) = (inputs[0].as_ref().unwrap(), inputs[1].as_ref().unwrap());
        let eps = cx.float("eps");
        let mut y = vec![0.0; x.data.len()];
        let mut rstd = vec![0.0; s.rows];
        for r in 0..s.rows {
            let row = &x.data[r * s.cols..(r + 1) * s.cols];
            let ms = row.iter().map(|v| v * v).sum::<f64>() / s.cols as f64;
            rstd[r] = 1.0 / (ms + eps).sqrt();
            for c in 0..s.cols {
                y[r * s.cols + c] = row[c] * rstd[r] * w.data[c];
            }
        }
        Ok(vec![RefTensor::new(&x.shape, y), RefTensor::new(&s.rstd_shape, rstd)])
    }

    fn example(&self, shape: Option<&[usize]>, dtype: DType) -> Result<Example> {
        let shape = shape.unwrap_or(&[4096, 4096]);
        let x = TensorMeta::contiguous(dtype, shape)?;
        let w = TensorMeta::contiguous(dtype, &shape[shape.len().saturating_sub(1)..])?;
        Ok(Example { inputs: vec![Some(x), Some(w)], attrs: vec![] })
    }
}
