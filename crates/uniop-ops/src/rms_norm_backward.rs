//! `rms_norm_backward(dy, x, weight, rstd) -> (dx, dweight)`, the gradient of [`rms_norm`].
//!
//! With g = dy·w and n normalized elements per row:
//! dx = rstd·g − x·rstd³·(Σ g·x)/n, and dweight = Σ_rows dy·x·rstd.
//!
//! Two launches: each block computes dx for its rows and accumulates a private f32 partial of
//! dweight in the workspace (no atomics, deterministic); a second launch sums the partials column
//! by column. The order of summation is fixed by the plan, so results are reproducible run to run.
//!
//! [`rms_norm`]: crate::rms_norm

use crate::elementwise::{converts_with, narrow_step, widen_step, CHUNK, LANES};
use crate::math;
use crate::rms_norm::{norm_shape, KernelShape, NormShape, DTYPES};
use uniop::{
    block_dim_for, with_float_dtype, BlockCtx, DType, ErrorCode, Example, FloatElement, KernelArgs, LayoutNeed, Op,
    OpCx, Plan, RefTensor, Result, Step, TensorMeta,
};

pub struct RmsNormBackward;

/// One row: `dx = rstd·dy·w − x·rstd³·mean(dy·w·x)` (plus `dsum`, the gradient reaching
/// `add_rms_norm`'s sum directly, rounded once with it), and this row's `dy·x·rstd` added to the
/// block's dweight partial. Steps of `LANES`, the last one padded with zeros.
#[inline(always)]
fn backward_row<T: FloatElement, W: FloatElement>(
    (dy, dsum): (&[T], Option<&[T]>),
    x: &[T],
    w: &[W],
    rstd: f32,
    dx: &mut [T],
    dw: &mut [f32],
) {
    if T::converts_natively() {
        backward_row_as::<T, W, true>((dy, dsum), x, w, rstd, dx, dw)
    } else {
        backward_row_as::<T, W, false>((dy, dsum), x, w, rstd, dx, dw)
    }
}

#[inline(always)]
fn backward_row_as<T: FloatElement, W: FloatElement, const NATIVE: bool>(
    (dy, dsum): (&[T], Option<&[T]>),
    x: &[T],
    w: &[W],
    rstd: f32,
    dx: &mut [T],
    dw: &mut [f32],
) {
    const { assert!(converts_with::<T, W>(), "weight in x's dtype or f32") };
    let n = x.len();
    let mut dot = [0f32; LANES];
    for start in (0..n).step_by(LANES) {
        let end = (start + LANES).min(n);
        let [d, xv, wv]: [[f32; LANES]; 3] = [
            widen_step::<_, NATIVE, LANES>(&dy[start..end]),
            widen_step::<_, NATIVE, LANES>(&x[start..end]),
            widen_step::<_, NATIVE, LANES>(&w[start..end]),
        ];
        for i in 0..LANES {
            dot[i] += d[i] * wv[i] * xv[i];
        }
    }
    let coeff = rstd * rstd * rstd * math::sum_lanes(dot) / n as f32;
    for start in (0..n).step_by(LANES) {
        let end = (start + LANES).min(n);
        let [d, xv, wv]: [[f32; LANES]; 3] = [
            widen_step::<_, NATIVE, LANES>(&dy[start..end]),
            widen_step::<_, NATIVE, LANES>(&x[start..end]),
            widen_step::<_, NATIVE, LANES>(&w[start..end]),
        ];
        let mut out: [f32; LANES] = match dsum {
            Some(ds) => widen_step::<_, NATIVE, LANES>(&ds[start..end]),
            None => [0.0; LANES],
        };
        let mut gw: [f32; LANES] = widen_step::<_, NATIVE, LANES>(&dw[start..end]);
        for i in 0..LANES {
            out[i] += rstd * d[i] * wv[i] - xv[i] * coeff;
            gw[i] += d[i] * xv[i] * rstd;
        }
        narrow_step::<_, NATIVE, LANES>(&gw, &mut dw[start..end]);
        narrow_step::<_, NATIVE, LANES>(&out, &mut dx[start..end]);
    }
}

/// Where the kernels find their tensors: `rms_norm_backward(dy, x, weight, rstd) -> (dx,
/// dweight)`, or `add_rms_norm_backward(dy, dsum, sum, weight, rstd) -> (dx, dresidual,
/// dweight)`, which adds `dsum` to dx and writes the result twice (returns never alias).
#[derive(Clone, Copy)]
pub(crate) struct Slots {
    dsum: Option<usize>,
    x: usize,
    weight: usize,
    rstd: usize,
    dweight: usize,
}

const RMS_NORM: Slots = Slots { dsum: None, x: 1, weight: 2, rstd: 3, dweight: 1 };
pub(crate) const ADD_RMS_NORM: Slots = Slots { dsum: Some(1), x: 2, weight: 3, rstd: 4, dweight: 2 };

crate::simd_kernel! {
fn dx_kernel<T: FloatElement, W: FloatElement>(args: &KernelArgs, ctx: BlockCtx, s: &KernelShape, slots: Slots) {
    let (dy, x, w, rstd) = (args.input(0), args.input(slots.x), args.input(slots.weight), args.input(slots.rstd));
    let dsum = slots.dsum.map(|i| args.input(i));
    let dx = args.output(0);
    let w = &w.storage::<W>().expect("dtype dispatched")[w.layout().offset()..][..s.cols];
    let (dys, xs, rs) = (dy.storage::<T>().unwrap(), x.storage::<T>().unwrap(), rstd.storage::<f32>().unwrap());
    // SAFETY: block b owns partial row b of the workspace.
    let partial = unsafe { args.workspace::<f32>(ctx.block_idx as usize * s.cols, s.cols) };
    partial.fill(0.0);
    for r in ctx.split(s.rows) {
        let (dyo, xo) = (dy.layout().outer_offset(r, s.inner_dims), x.layout().outer_offset(r, s.inner_dims));
        let r_std = rs[rstd.layout().offset_of_linear(r)];
        let ds = dsum.as_ref().map(|t| &t.storage::<T>().unwrap()[t.layout().outer_offset(r, s.inner_dims)..][..s.cols]);
        // SAFETY: this block owns row r of dx (and of dresidual).
        let dxrow = unsafe { dx.slice_mut::<T>(dx.layout().outer_offset(r, s.inner_dims), s.cols) };
        backward_row((&dys[dyo..dyo + s.cols], ds), &xs[xo..xo + s.cols], w, r_std, dxrow, partial);
        if slots.dsum.is_some() {
            let dres = args.output(1);
            // SAFETY: as dx's row.
            unsafe { dres.slice_mut::<T>(dres.layout().outer_offset(r, s.inner_dims), s.cols) }.copy_from_slice(dxrow);
        }
    }
}
}

crate::simd_kernel! {
/// Column ranges `split(cols)` of the parameter gradients `outputs` (dweight; layer_norm's dbias
/// after it): each block of the first launch left one partial row per output, `[block][output]`
/// rows of `cols` f32 at the workspace's start, summed here in block order.
pub(crate) fn sum_partials<W: FloatElement>(args: &KernelArgs, ctx: BlockCtx, cols: usize, partials: usize, outputs: &[usize]) {
    let range = ctx.split(cols);
    for (k, &output) in outputs.iter().enumerate() {
        let out = args.output(output);
        let mut sum = [0f32; CHUNK];
        for start in range.clone().step_by(CHUNK) {
            let len = CHUNK.min(range.end - start);
            sum[..len].fill(0.0);
            for p in 0..partials {
                // SAFETY: the first launch has finished; every block of this one only reads.
                let part: &[f32] = unsafe { args.workspace::<f32>((p * outputs.len() + k) * cols + start, len) };
                sum.iter_mut().zip(part).for_each(|(acc, v)| *acc += v);
            }
            // SAFETY: blocks own disjoint column ranges of the (contiguous) outputs.
            W::narrow(&sum[..len], unsafe { out.slice_mut::<W>(out.layout().offset() + start, len) });
        }
    }
}
}

impl Op for RmsNormBackward {
    fn schema(&self) -> &'static str {
        "rms_norm_backward(Tensor dy, Tensor x, Tensor weight, Tensor rstd) -> (Tensor dx, Tensor dweight)"
    }

    fn doc(&self) -> &'static str {
        "Gradients of rms_norm: dx (dtype of x) and dweight (dtype of weight), from the upstream gradient dy \
         and the rstd saved by the forward. Deterministic: dweight partials are per block, summed in a fixed order."
    }

    fn dtypes(&self) -> &'static [DType] {
        DTYPES
    }

    fn infer(&self, cx: &OpCx) -> Result<Vec<TensorMeta>> {
        let s = check(cx, "x", "rms_norm")?;
        let w = cx.input("weight");
        Ok(vec![TensorMeta::contiguous(s.dtype, cx.input("x").shape())?, TensorMeta::contiguous(w.dtype, w.shape())?])
    }

    fn plan(&self, cx: &OpCx) -> Result<Plan> {
        plan(cx, "x", RMS_NORM, ["rms_norm_backward.dx", "rms_norm_backward.dweight"])
    }

    fn reference(&self, cx: &OpCx, inputs: &[Option<RefTensor>]) -> Result<Vec<RefTensor>> {
        let (dx, dw) = reference(cx, inputs, "x", RMS_NORM)?;
        Ok(vec![RefTensor::new(cx.input("x").shape(), dx), RefTensor::new(cx.input("weight").shape(), dw)])
    }

    fn example(&self, shape: Option<&[usize]>, dtype: DType) -> Result<Example> {
        example(shape, dtype, 2)
    }
}

/// The checks both backward ops make of `dy`, `rstd` and the normed input `x` (`"x"` or `"sum"`)
/// of `forward` (the op whose gradient they take).
pub(crate) fn check(cx: &OpCx, x: &str, forward: &str) -> Result<NormShape> {
    let s = norm_shape(cx, x, "weight")?;
    cx.expect_same_dtype("dy", s.dtype, x)?;
    cx.expect_shape("dy", cx.input(x).shape())?;
    check_statistic(cx, "rstd", &s, forward)?;
    Ok(s)
}

/// A statistic the forward saved for the backward (`rstd`, layer_norm's `mean`): f32 (f64 in f64
/// calls), shaped like the normed input with the normalized dims kept as 1.
pub(crate) fn check_statistic(cx: &OpCx, name: &str, s: &NormShape, forward: &str) -> Result<()> {
    let t = cx.input(name);
    let want = cx.statistics_dtype();
    if t.dtype != want {
        return Err(cx.err(ErrorCode::DType, name, format!("dtype {want} (as {forward} returns it)"), t.dtype));
    }
    cx.expect_shape(name, &s.rstd_shape)
}

/// The plan of both backward ops (`x`: the normed input's name; steps `names`).
pub(crate) fn plan(cx: &OpCx, x: &str, slots: Slots, names: [&'static str; 2]) -> Result<Plan> {
    let s = norm_shape(cx, x, "weight")?;
    let ks = KernelShape { rows: s.rows, cols: s.cols, inner_dims: s.inner_dims, eps: 0.0, streaming: false };
    let blocks = block_dim_for(s.rows, 3 * s.cols * s.dtype.size());
    let reduce_blocks = block_dim_for(s.cols, 4 * blocks as usize);
    let partials = blocks as usize;
    let workspace = partials
        .checked_mul(s.cols)
        .and_then(|n| n.checked_mul(4))
        .ok_or_else(|| cx.err(ErrorCode::Shape, x, "a size whose workspace fits in memory", s.cols))?;
    let weight_f32 = cx.input("weight").dtype == DType::F32;
    let cols = s.cols;
    let steps = with_float_dtype!(s.dtype, cx.op(), x, |T| {
        if weight_f32 {
            vec![
                Step::new(names[0], blocks, move |a, c| dx_kernel::<T, f32>(a, c, &ks, slots)),
                Step::new(names[1], reduce_blocks, move |a, c| {
                    sum_partials::<f32>(a, c, cols, partials, &[slots.dweight])
                }),
            ]
        } else {
            vec![
                Step::new(names[0], blocks, move |a, c| dx_kernel::<T, T>(a, c, &ks, slots)),
                Step::new(names[1], reduce_blocks, move |a, c| {
                    sum_partials::<T>(a, c, cols, partials, &[slots.dweight])
                }),
            ]
        }
    });
    let row = s.row_need();
    // Row-addressed: dy, dsum, x; the weight contiguous; rstd any. Outputs: dx (dresidual) by rows.
    let mut inputs = vec![row; slots.x + 1];
    inputs.extend([LayoutNeed::Contiguous, LayoutNeed::Any]);
    let mut outputs = vec![row; slots.dweight];
    outputs.push(LayoutNeed::Contiguous);
    Ok(Plan::new(steps).workspace(workspace).inputs_need(inputs).outputs_need(outputs))
}

/// f64 `(dx, dweight)` of both backward ops (`dx` with `dsum` added where there is one).
pub(crate) fn reference(
    cx: &OpCx,
    inputs: &[Option<RefTensor>],
    x: &str,
    slots: Slots,
) -> Result<(Vec<f64>, Vec<f64>)> {
    let s = norm_shape(cx, x, "weight")?;
    let [dy, x, w, rstd] = [0, slots.x, slots.weight, slots.rstd].map(|i| inputs[i].as_ref().unwrap());
    let dsum = slots.dsum.map(|i| &inputs[i].as_ref().unwrap().data);
    let n = s.cols;
    let mut dx = vec![0.0; x.data.len()];
    let mut dw = vec![0.0; n];
    for r in 0..s.rows {
        let (dyr, xr, rs) = (&dy.data[r * n..(r + 1) * n], &x.data[r * n..(r + 1) * n], rstd.data[r]);
        let dot: f64 = (0..n).map(|i| dyr[i] * w.data[i] * xr[i]).sum();
        for i in 0..n {
            let direct = dsum.map_or(0.0, |d| d[r * n + i]);
            dx[r * n + i] = rs * dyr[i] * w.data[i] - xr[i] * rs.powi(3) * dot / n as f64 + direct;
            dw[i] += dyr[i] * xr[i] * rs;
        }
    }
    Ok((dx, dw))
}

/// Inputs of both backward ops for a normed input of `shape` (or the default): `rows` tensors of
/// that shape (dy, x; or dy, dsum, sum), the weight over its last dim, and `rstd`.
pub(crate) fn example(shape: Option<&[usize]>, dtype: DType, rows: usize) -> Result<Example> {
    let shape = shape.unwrap_or(&[4096, 4096]);
    let split = shape.len().saturating_sub(1);
    let x = TensorMeta::contiguous(dtype, shape)?;
    let w = TensorMeta::contiguous(dtype, &shape[split..])?;
    let mut rstd_shape = shape[..split].to_vec();
    rstd_shape.push(1);
    let rstd = TensorMeta::contiguous(DType::F32, &rstd_shape)?;
    let mut inputs = vec![Some(x); rows];
    inputs.extend([Some(w), Some(rstd)]);
    Ok(Example { inputs, attrs: vec![], ..Default::default() })
}
