//! `rms_norm_backward(dy, x, weight, rstd, batch_dims=0) -> (dx, dweight)`, the gradient of
//! [`rms_norm`].
//!
//! With g = dy·w and n normalized elements per row:
//! dx = rstd·g − x·rstd³·(Σ g·x)/n, and dweight = Σ_rows dy·x·rstd — one sum per sample of the
//! first `batch_dims` dims of x (see [`per_sample`](crate::per_sample)).
//!
//! Two launches: each block computes dx for its rows (of one sample) and accumulates a private f32
//! partial of dweight in the workspace (no atomics, deterministic); a second launch sums each
//! sample's partials column by column. The order of summation is fixed by the plan, so results are
//! reproducible run to run.
//!
//! [`rms_norm`]: crate::rms_norm

use crate::elementwise::{fence, store_step, streams_bytes, widen_lanes, Ahead, Aligned, CHUNK, LANES};
use crate::math;
use crate::per_sample::{SampleBlocks, Samples};
use crate::rms_norm::{norm_shape, param_f32, KernelShape, NormShape, DTYPES};
use uniop::{
    block_dim_for, with_float_dtype, BlockCtx, DType, ErrorCode, Example, FloatElement, KernelArgs, LayoutNeed, Op,
    OpCx, Plan, RefTensor, Result, Step, TensorMeta,
};

pub struct RmsNormBackward;

/// One row's dy, dsum (add_rms_norm's only), x and weights.
type RowInputs<'a, T> = (&'a [T], Option<&'a [T]>, &'a [T], &'a [f32]);

/// One row: `dx = rstd·dy·w − x·rstd³·mean(dy·w·x)` (plus `dsum`, the gradient reaching
/// `add_rms_norm`'s sum directly, rounded once with it; written to `dres` as well where there is
/// one), and this row's `dy·x·rstd` added to the block's dweight partial. Steps of `LANES`, then a
/// short tail element by element. The second pass reads the row from the cache, so it prefetches
/// `next` (the next row's dy, x and dsum, see [`Ahead`]).
#[inline(always)]
fn backward_row<T: FloatElement>(
    (dy, dsum, x, w): RowInputs<T>,
    (rstd, next): (f32, [&[T]; 3]),
    (dx, dres, streaming): (&mut [T], Option<&mut [T]>, bool),
    dw: &mut [f32],
) {
    if T::converts_natively() {
        backward_row_as::<T, true>((dy, dsum, x, w), (rstd, next), (dx, dres, streaming), dw)
    } else {
        backward_row_as::<T, false>((dy, dsum, x, w), (rstd, next), (dx, dres, streaming), dw)
    }
}

#[inline(always)]
fn backward_row_as<T: FloatElement, const NATIVE: bool>(
    (dy, dsum, x, w): RowInputs<T>,
    (rstd, next): (f32, [&[T]; 3]),
    (dx, mut dres, streaming): (&mut [T], Option<&mut [T]>, bool),
    dw: &mut [f32],
) {
    let (n, tail) = (x.len(), x.len() / LANES * LANES);
    let step = |row: &[T], at: usize| widen_lanes::<T, NATIVE, LANES>(row[at..at + LANES].try_into().expect("LANES"));
    // A copy, not a borrow: with the weights in memory, the compiler must assume the dweight
    // stores may alias them and reloads them (f32 ran 5.8 -> 7.1 ms at 4096x4096).
    let weights = |at: usize| -> [f32; LANES] { w[at..at + LANES].try_into().expect("LANES") };
    let mut dot = [0f32; LANES];
    for at in (0..tail).step_by(LANES) {
        let (d, xv, wv) = (step(dy, at), step(x, at), weights(at));
        for i in 0..LANES {
            dot[i] += d[i] * wv[i] * xv[i];
        }
    }
    let tail_dot: f32 = (tail..n).map(|i| dy[i].to_f32() * w[i] * x[i].to_f32()).sum();
    let coeff = rstd * rstd * rstd * (math::sum_lanes(dot) + tail_dot) / n as f32;
    let mut ahead = next.map(|row| Ahead::new(row, tail / LANES));
    for at in (0..tail).step_by(LANES) {
        ahead.iter_mut().for_each(Ahead::step);
        let (d, xv, wv) = (step(dy, at), step(x, at), weights(at));
        let mut out = Aligned(dsum.map_or([0.0; LANES], |ds| step(ds, at)));
        let gw = &mut dw[at..at + LANES];
        for i in 0..LANES {
            out[i] += rstd * d[i] * wv[i] - xv[i] * coeff;
            gw[i] += d[i] * xv[i] * rstd;
        }
        store_step::<T, NATIVE>(&out, &mut dx[at..at + LANES], streaming);
        if let Some(dres) = dres.as_deref_mut() {
            store_step::<T, NATIVE>(&out, &mut dres[at..at + LANES], streaming);
        }
    }
    for i in tail..n {
        let (d, xv) = (dy[i].to_f32(), x[i].to_f32());
        let direct = dsum.map_or(0.0, |ds| ds[i].to_f32());
        dx[i] = T::from_f32(direct + rstd * d * w[i] - xv * coeff);
        if let Some(dres) = dres.as_deref_mut() {
            dres[i] = dx[i];
        }
        dw[i] += d * xv * rstd;
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
fn dx_kernel<T: FloatElement, W: FloatElement>(args: &KernelArgs, ctx: BlockCtx, s: &KernelShape, slots: Slots, samples: SampleBlocks) {
    let (dy, x, rstd) = (args.input(0), args.input(slots.x), args.input(slots.rstd));
    let dsum = slots.dsum.map(|i| args.input(i));
    let (dx, dres) = (args.output(0), slots.dsum.map(|_| args.output(1)));
    let (block, blocks) = (ctx.block_idx as usize, ctx.block_num as usize);
    // SAFETY: block b owns workspace row `blocks + b` (its widened weight, after the partials).
    let w = unsafe { param_f32::<W>(args, slots.weight, blocks + block, s.cols) };
    let rs = rstd.storage::<f32>().unwrap();
    // SAFETY: block b owns partial row b of the workspace.
    let partial = unsafe { args.workspace::<f32>(block * s.cols, s.cols) };
    partial.fill(0.0);
    let (_, rows) = samples.rows(ctx);
    for r in rows.clone() {
        let [dyr, xr, next_dy, next_x] = [(&dy, r), (&x, r), (&dy, r + 1), (&x, r + 1)].map(|(t, r)| s.row::<T>(t, r, &rows));
        let (dsr, next_ds) = dsum.as_ref().map_or((None, &[][..]), |t| (Some(s.row::<T>(t, r, &rows)), s.row(t, r + 1, &rows)));
        let (inputs, next) = ((dyr, dsr, xr, w), [next_dy, next_x, next_ds]);
        let r_std = rs[rstd.layout().offset_of_linear(r)];
        // SAFETY: this block owns row r of dx (and of dresidual).
        let dxrow = unsafe { dx.slice_mut::<T>(dx.layout().outer_offset(r, s.inner_dims), s.cols) };
        // SAFETY: as dx's row.
        let dres = dres.as_ref().map(|t| unsafe { t.slice_mut::<T>(t.layout().outer_offset(r, s.inner_dims), s.cols) });
        backward_row(inputs, (r_std, next), (dxrow, dres, s.streaming), partial);
    }
    fence();
}
}

crate::simd_kernel! {
/// Ranges `split(samples · cols)` of the parameter gradients `outputs` (dweight; layer_norm's dbias
/// after it; `[sample][cols]`): each block of the first launch left one partial row per output,
/// `[block][output]` rows of `cols` f32 at the workspace's start, and a sample's are summed here
/// in block order.
pub(crate) fn sum_partials<W: FloatElement>(args: &KernelArgs, ctx: BlockCtx, cols: usize, samples: SampleBlocks, outputs: &[usize]) {
    let range = ctx.split(samples.count * cols);
    for (k, &output) in outputs.iter().enumerate() {
        let out = args.output(output);
        let mut sum = [0f32; CHUNK];
        let mut start = range.start;
        while start < range.end {
            let (sample, col) = (start / cols, start % cols);
            let len = CHUNK.min(range.end - start).min(cols - col);
            sum[..len].fill(0.0);
            for p in sample * samples.per_sample..(sample + 1) * samples.per_sample {
                // SAFETY: the first launch has finished; every block of this one only reads.
                let part: &[f32] = unsafe { args.workspace::<f32>((p * outputs.len() + k) * cols + col, len) };
                sum.iter_mut().zip(part).for_each(|(acc, v)| *acc += v);
            }
            // SAFETY: blocks own disjoint ranges of the (contiguous) outputs.
            W::narrow(&sum[..len], unsafe { out.slice_mut::<W>(out.layout().offset() + start, len) });
            start += len;
        }
    }
}
}

/// The norms' backward ops' [`Op::error_scale`]: their longest f32 sums are dweight's (and
/// dbias's) over the rows and each row's over its `n` elements. A sum over 2064 rows that cancels
/// to 2e-3 is off by about 2e-5 from rounding its terms' f32 products alone.
pub(crate) fn sum_error_scale(cx: &OpCx, x: &str) -> f64 {
    let shape = cx.input(x).shape();
    let n = shape.last().copied().unwrap_or(1);
    let rows: usize = shape.iter().rev().skip(1).product();
    (rows.max(n).max(1) as f64).sqrt()
}

impl Op for RmsNormBackward {
    fn schema(&self) -> &'static str {
        "rms_norm_backward(Tensor dy, Tensor x, Tensor weight, Tensor rstd, int batch_dims=0) -> (Tensor dx, Tensor \
         dweight)"
    }

    fn doc(&self) -> &'static str {
        "Gradients of rms_norm: dx (dtype of x) and dweight (dtype of weight), from the upstream gradient dy \
         and the rstd saved by the forward. dweight sums over all rows, or per sample with batch_dims: then it is \
         x.shape[:batch_dims] + weight's shape. Deterministic: dweight partials are per block, summed in a fixed \
         order."
    }

    /// Row by row; the parameter gradients per sample with `batch_dims`.
    fn leading_batch_args(&self) -> &'static [&'static str] {
        &["dy", "x", "rstd"]
    }

    fn dtypes(&self) -> &'static [DType] {
        DTYPES
    }

    fn error_scale(&self, cx: &OpCx) -> f64 {
        sum_error_scale(cx, "x")
    }

    fn infer(&self, cx: &OpCx) -> Result<Vec<TensorMeta>> {
        let s = check(cx, "x", "rms_norm")?;
        Ok(vec![TensorMeta::contiguous(s.dtype, cx.input("x").shape())?, param_grad(cx, "x", &s)?])
    }

    fn plan(&self, cx: &OpCx) -> Result<Plan> {
        plan(cx, "x", RMS_NORM, ["rms_norm_backward.dx", "rms_norm_backward.dweight"])
    }

    fn reference(&self, cx: &OpCx, inputs: &[Option<RefTensor>]) -> Result<Vec<RefTensor>> {
        let (dx, dw) = reference(cx, inputs, "x", RMS_NORM)?;
        let dweight = param_grad(cx, "x", &norm_shape(cx, "x", "weight")?)?;
        Ok(vec![RefTensor::new(cx.input("x").shape(), dx), RefTensor::new(dweight.shape(), dw)])
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

/// How `batch_dims` divides the rows of the normed input `x` into samples.
pub(crate) fn samples(cx: &OpCx, x: &str, s: &NormShape) -> Result<Samples> {
    Samples::of(cx, x, cx.input(x).rank() - s.inner_dims)
}

/// The meta of a parameter gradient (dweight, dbias): one weight per sample.
pub(crate) fn param_grad(cx: &OpCx, x: &str, s: &NormShape) -> Result<TensorMeta> {
    let w = cx.input("weight");
    TensorMeta::contiguous(w.dtype, &samples(cx, x, s)?.shape(w.shape()))
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
    // dx (and dresidual) past the cache when they cannot stay there.
    let written = s.rows * s.cols * s.dtype.size() * (1 + slots.dsum.is_some() as usize);
    let ks = KernelShape {
        rows: s.rows,
        cols: s.cols,
        inner_dims: s.inner_dims,
        eps: 0.0,
        streaming: streams_bytes(written),
    };
    let sb = samples(cx, x, &s)?.blocks(cx, x, block_dim_for(s.rows, 3 * s.cols * s.dtype.size()))?;
    let (blocks, partials) = (sb.total, sb.total as usize);
    let reduce_blocks = block_dim_for(sb.count * s.cols, 4 * sb.per_sample);
    let weight_f32 = cx.input("weight").dtype == DType::F32;
    // The blocks' dweight partials, then their widened weights (when not f32).
    let per_block = if weight_f32 { 1 } else { 2 };
    let workspace = partials
        .checked_mul(s.cols)
        .and_then(|n| n.checked_mul(4 * per_block))
        .ok_or_else(|| cx.err(ErrorCode::Shape, x, "a size whose workspace fits in memory", s.cols))?;
    let cols = s.cols;
    let steps = with_float_dtype!(s.dtype, cx.op(), x, |T| {
        if weight_f32 {
            vec![
                Step::new(names[0], blocks, move |a, c| dx_kernel::<T, f32>(a, c, &ks, slots, sb)),
                Step::new(names[1], reduce_blocks, move |a, c| sum_partials::<f32>(a, c, cols, sb, &[slots.dweight])),
            ]
        } else {
            vec![
                Step::new(names[0], blocks, move |a, c| dx_kernel::<T, T>(a, c, &ks, slots, sb)),
                Step::new(names[1], reduce_blocks, move |a, c| sum_partials::<T>(a, c, cols, sb, &[slots.dweight])),
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

/// f64 `(dx, dweight)` of both backward ops (`dx` with `dsum` added where there is one; dweight
/// per sample).
pub(crate) fn reference(
    cx: &OpCx,
    inputs: &[Option<RefTensor>],
    x: &str,
    slots: Slots,
) -> Result<(Vec<f64>, Vec<f64>)> {
    let s = norm_shape(cx, x, "weight")?;
    let per_sample = samples(cx, x, &s)?;
    let [dy, x, w, rstd] = [0, slots.x, slots.weight, slots.rstd].map(|i| inputs[i].as_ref().unwrap());
    let dsum = slots.dsum.map(|i| &inputs[i].as_ref().unwrap().data);
    let n = s.cols;
    let mut dx = vec![0.0; x.data.len()];
    let mut dw = vec![0.0; per_sample.count * n];
    for r in 0..s.rows {
        let dw = &mut dw[r / per_sample.rows.max(1) * n..][..n];
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
