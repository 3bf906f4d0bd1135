//! `layer_norm(x, weight, bias, eps) -> (y, mean, rstd)`: y = (x − mean) · rstd · weight + bias,
//! rstd = 1/√(var + eps) with the biased variance, as `torch.nn.functional.layer_norm` (GPT-2,
//! BERT, Falcon, Phi and OPT normalize this way rather than with RMSNorm).
//!
//! The normalized dims are the trailing dims of `x` matching `weight`'s shape, as in
//! [`rms_norm`](crate::rms_norm); `bias` (optional) has the weight's shape and dtype. `mean` and
//! `rstd` are f32 with the normalized dims kept as size 1 (torch's `native_layer_norm` returns the
//! same pair), and feed `layer_norm_backward`.
//!
//! Kernel: one row per iteration, each block owning a contiguous range of rows. The variance is
//! taken around the mean in a second pass over the row (Σ(x − mean)², not Σx² − n·mean², which
//! loses every digit when the mean is large against the spread: activations with a large common
//! offset); the row is in L1/L2 by then, so DRAM still sees each byte once, and the next row is
//! fetched while the last pass writes this one.

use crate::elementwise::{fence, store_step, streams_bytes, widen_lanes, Ahead, Aligned, LANES};
use crate::math;
use crate::rms_norm::{check_eps, norm_shape, param_f32, KernelShape, NormShape};
use uniop::{
    block_dim_for, with_float_dtype, BlockCtx, DType, Example, FloatElement, KernelArgs, LayoutNeed, Op, OpCx, Plan,
    RefTensor, Result, Step, TensorMeta,
};

pub struct LayerNorm;

/// The checks of the forward's tensors: x and weight as `rms_norm`'s, and the bias (when given)
/// of the weight's shape and dtype.
fn layer_norm_shape(cx: &OpCx) -> Result<NormShape> {
    let s = norm_shape(cx, "x", "weight")?;
    if cx.optional_input("bias").is_some() {
        let w = cx.input("weight");
        cx.expect_same_dtype("bias", w.dtype, "weight")?;
        cx.expect_shape("bias", w.shape())?;
    }
    Ok(s)
}

/// `(mean, rstd)` of one row, each pass over `LANES` partial sums (a short tail added after). The
/// second pass reads the row from the cache, so it prefetches `next` (see [`Ahead`]).
#[inline(always)]
fn row_stats<T: FloatElement, const NATIVE: bool>(x: &[T], next: &[T], eps: f32) -> (f32, f32) {
    let (steps, tail) = (x.chunks_exact(LANES), x.len() / LANES * LANES);
    let widened = |c: &[T]| widen_lanes::<T, NATIVE, LANES>(c.try_into().expect("LANES elements"));
    let mut acc = [0f32; LANES];
    for c in steps.clone() {
        let v = widened(c);
        for i in 0..LANES {
            acc[i] += v[i];
        }
    }
    let tail_sum: f32 = x[tail..].iter().map(|v| v.to_f32()).sum();
    let mean = (math::sum_lanes(acc) + tail_sum) / x.len() as f32;
    let mut acc = [0f32; LANES];
    let mut ahead = Ahead::new(next, steps.len());
    for c in steps {
        ahead.step();
        let v = widened(c);
        for i in 0..LANES {
            acc[i] += (v[i] - mean) * (v[i] - mean);
        }
    }
    let tail_sum: f32 = x[tail..].iter().map(|v| (v.to_f32() - mean) * (v.to_f32() - mean)).sum();
    (mean, 1.0 / ((math::sum_lanes(acc) + tail_sum) / x.len() as f32 + eps).sqrt())
}

/// `y = (x − mean) · rstd · w + b` over one row; `b` is read only when `BIAS` (callers without a
/// bias pass the weight in its place); `streaming` writes whole steps past the cache.
#[inline(always)]
fn normalize_row<T: FloatElement, const NATIVE: bool, const BIAS: bool>(
    x: &[T],
    next: &[T],
    (w, b): (&[f32], &[f32]),
    (mean, rstd): (f32, f32),
    y: &mut [T],
    streaming: bool,
) {
    let steps = x.chunks_exact(LANES);
    let tail = steps.len() * LANES;
    let mut ahead = Ahead::new(next, steps.len());
    let params = w.chunks_exact(LANES).zip(b.chunks_exact(LANES));
    for ((xc, (wc, bc)), yc) in steps.zip(params).zip(y.chunks_exact_mut(LANES)) {
        ahead.step();
        let v = widen_lanes::<T, NATIVE, LANES>(xc.try_into().expect("LANES elements"));
        let mut out = Aligned([0f32; LANES]);
        for i in 0..LANES {
            out[i] = (v[i] - mean) * rstd * wc[i] + if BIAS { bc[i] } else { 0.0 };
        }
        store_step::<T, NATIVE>(&out, yc, streaming);
    }
    for i in tail..x.len() {
        y[i] = T::from_f32((x[i].to_f32() - mean) * rstd * w[i] + if BIAS { b[i] } else { 0.0 });
    }
}

crate::simd_kernel! {
/// Rows `split(rows)`: statistics, then the normalized row. The weight and bias are widened to
/// f32 once per block (into the workspace) when they are not f32 already.
fn forward_kernel<T: FloatElement, W: FloatElement>(args: &KernelArgs, ctx: BlockCtx, s: &KernelShape, bias: bool) {
    let x = args.input(0);
    let (y, mean_out, rstd_out) = (args.output(0), args.output(1), args.output(2));
    let cols = s.cols;
    let (block, blocks) = (ctx.block_idx as usize, ctx.block_num as usize);
    // SAFETY: block b owns workspace rows b (its widened weight) and `blocks + b` (its widened
    // bias), reserved when the parameters are not f32.
    let w = unsafe { param_f32::<W>(args, 1, block, cols) };
    let b = bias.then(|| unsafe { param_f32::<W>(args, 2, blocks + block, cols) });
    // SAFETY: each block writes only the mean and rstd entries of its own rows (below).
    let (mean_ptr, rstd_ptr) = unsafe { (mean_out.as_mut_ptr::<f32>(), rstd_out.as_mut_ptr::<f32>()) };
    let rows = ctx.split(s.rows);
    for r in rows.clone() {
        let row = s.row::<T>(&x, r, &rows);
        // The next row comes in over both passes that read this one from the cache.
        let next = s.row::<T>(&x, r + 1, &rows);
        let (next_early, next) = next.split_at(next.len() / 2);
        let native = T::converts_natively();
        let stats = if native {
            row_stats::<T, true>(row, next_early, s.eps)
        } else {
            row_stats::<T, false>(row, next_early, s.eps)
        };
        // SAFETY: this block owns rows `split(rows)` of y, mean and rstd.
        unsafe {
            *mean_ptr.add(mean_out.layout().offset_of_linear(r)) = stats.0;
            *rstd_ptr.add(rstd_out.layout().offset_of_linear(r)) = stats.1;
            let yrow = y.slice_mut::<T>(y.layout().outer_offset(r, s.inner_dims), cols);
            match (native, b) {
                (true, Some(b)) => normalize_row::<T, true, true>(row, next, (w, b), stats, yrow, s.streaming),
                (true, None) => normalize_row::<T, true, false>(row, next, (w, w), stats, yrow, s.streaming),
                (false, Some(b)) => normalize_row::<T, false, true>(row, next, (w, b), stats, yrow, s.streaming),
                (false, None) => normalize_row::<T, false, false>(row, next, (w, w), stats, yrow, s.streaming),
            }
        }
    }
    fence();
}
}

/// f64 LayerNorm of `rows × cols` values: `(y, mean, rstd)`.
fn reference_rows(
    x: &[f64],
    (w, b): (&[f64], Option<&[f64]>),
    (rows, cols): (usize, usize),
    eps: f64,
) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let mut y = vec![0.0; x.len()];
    let (mut mean, mut rstd) = (vec![0.0; rows], vec![0.0; rows]);
    for r in 0..rows {
        let row = &x[r * cols..(r + 1) * cols];
        mean[r] = row.iter().sum::<f64>() / cols as f64;
        let var = row.iter().map(|v| (v - mean[r]).powi(2)).sum::<f64>() / cols as f64;
        rstd[r] = 1.0 / (var + eps).sqrt();
        for c in 0..cols {
            y[r * cols + c] = (row[c] - mean[r]) * rstd[r] * w[c] + b.map_or(0.0, |b| b[c]);
        }
    }
    (y, mean, rstd)
}

impl Op for LayerNorm {
    fn schema(&self) -> &'static str {
        "layer_norm(Tensor x, Tensor weight, Tensor? bias=None, float eps=1e-05) -> (Tensor y, Tensor mean, Tensor \
         rstd)"
    }

    fn doc(&self) -> &'static str {
        "Layer normalization (torch.nn.functional.layer_norm): y = (x - mean) / sqrt(var + eps) * weight, plus bias, \
         over the trailing dims matching weight's shape, var biased (divided by n). mean and rstd (float32, \
         normalized dims kept as 1) are returned for the backward. weight: same dtype as x, or float32; bias \
         (optional): weight's shape and dtype. f16/bf16 accumulate in float32; the variance is summed around \
         the mean (a second pass over the row in cache), so a large common offset costs no precision."
    }

    fn leading_batch_args(&self) -> &'static [&'static str] {
        &["x"]
    }

    fn dtypes(&self) -> &'static [DType] {
        crate::rms_norm::DTYPES
    }

    fn backward(&self) -> Option<&'static str> {
        Some("layer_norm_backward")
    }

    fn infer(&self, cx: &OpCx) -> Result<Vec<TensorMeta>> {
        let s = layer_norm_shape(cx)?;
        check_eps(cx)?;
        let stats = TensorMeta::contiguous(DType::F32, &s.rstd_shape)?;
        Ok(vec![TensorMeta::contiguous(s.dtype, cx.input("x").shape())?, stats.clone(), stats])
    }

    fn plan(&self, cx: &OpCx) -> Result<Plan> {
        let s = layer_norm_shape(cx)?;
        let bias = cx.optional_input("bias").is_some();
        let weight_f32 = cx.input("weight").dtype == DType::F32;
        let streaming = streams_bytes(s.rows * s.cols * s.dtype.size());
        let ks = KernelShape { rows: s.rows, cols: s.cols, inner_dims: s.inner_dims, eps: check_eps(cx)?, streaming };
        let block_dim = block_dim_for(s.rows, 2 * s.cols * s.dtype.size());
        // Widened weight (and bias) rows, one per block each, when they are not f32.
        let widened = if weight_f32 { 0 } else { 1 + bias as usize };
        let workspace = widened * block_dim as usize * s.cols * 4;
        let step = with_float_dtype!(s.dtype, cx.op(), "x", |T| {
            if weight_f32 {
                Step::new("layer_norm", block_dim, move |a, c| forward_kernel::<T, f32>(a, c, &ks, bias))
            } else {
                Step::new("layer_norm", block_dim, move |a, c| forward_kernel::<T, T>(a, c, &ks, bias))
            }
        });
        Ok(Plan::new(vec![step])
            .workspace(workspace)
            .inputs_need(vec![s.row_need(), LayoutNeed::Contiguous, LayoutNeed::Contiguous])
            .outputs_need(vec![s.row_need(), LayoutNeed::Any, LayoutNeed::Any]))
    }

    /// `y = (x − mean) · rstd · w + b` with the mean in f32: its rounding (half an ulp of x, |x| ≤ 1
    /// in the checks) reaches y multiplied by rstd, which a row of nearly equal values takes to
    /// 1/√eps — 3e-8/√eps in all, 2.7 times f32's tolerance at eps = 5e-6 (two-element rows,
    /// 1.2e-5 off). torch's f32 layer_norm rounds its mean the same way. eps = 0 bounds nothing;
    /// the plain tolerance stays.
    fn error_scale(&self, cx: &OpCx) -> f64 {
        let eps = cx.float("eps");
        let amplified = f64::from(f32::EPSILON) / 2.0 / eps.sqrt();
        if eps > 0.0 {
            (amplified / uniop::verify::tolerance(DType::F32).0).max(1.0)
        } else {
            1.0
        }
    }

    fn reference(&self, cx: &OpCx, inputs: &[Option<RefTensor>]) -> Result<Vec<RefTensor>> {
        let s = layer_norm_shape(cx)?;
        let (x, w) = (inputs[0].as_ref().unwrap(), inputs[1].as_ref().unwrap());
        let b = inputs[2].as_ref().map(|b| &b.data[..]);
        let (y, mean, rstd) = reference_rows(&x.data, (&w.data, b), (s.rows, s.cols), cx.float("eps"));
        Ok(vec![RefTensor::new(&x.shape, y), RefTensor::new(&s.rstd_shape, mean), RefTensor::new(&s.rstd_shape, rstd)])
    }

    fn example(&self, shape: Option<&[usize]>, dtype: DType) -> Result<Example> {
        let shape = shape.unwrap_or(&[4096, 4096]);
        let x = TensorMeta::contiguous(dtype, shape)?;
        let w = TensorMeta::contiguous(dtype, &shape[shape.len().saturating_sub(1)..])?;
        Ok(Example { inputs: vec![Some(x), Some(w.clone()), Some(w)], attrs: vec![], ..Default::default() })
    }
}
