//! `layer_norm_backward(dy, x, weight, mean, rstd, batch_dims=0) -> (dx, dweight, dbias)`, the
//! gradient of [`layer_norm`](crate::layer_norm).
//!
//! With x̂ = (x − mean)·rstd, g = dy·w and n normalized elements per row:
//! dx = rstd·(g − mean(g) − x̂·mean(g·x̂)), dweight = Σ_rows dy·x̂, dbias = Σ_rows dy — the sums
//! per sample of the first `batch_dims` dims of x (see [`per_sample`](crate::per_sample)).
//!
//! Two launches, as `rms_norm_backward`: each block computes dx for its rows (of one sample) and
//! accumulates private f32 partials of dweight and dbias in the workspace (no atomics,
//! deterministic); a second launch sums each sample's partials column by column, in an order fixed
//! by the plan.

use crate::elementwise::{fence, store_step, streams_bytes, widen_lanes, Ahead, Aligned, LANES};
use crate::math;
use crate::per_sample::SampleBlocks;
use crate::rms_norm::{param_f32, KernelShape, NormShape};
use crate::rms_norm_backward::{check_statistic, param_grad, samples, sum_partials};
use uniop::{
    block_dim_for, with_float_dtype, BlockCtx, DType, ErrorCode, Example, FloatElement, KernelArgs, LayoutNeed, Op,
    OpCx, Plan, RefTensor, Result, Step, TensorMeta,
};

pub struct LayerNormBackward;

/// One row: its dx, and its `dy·x̂` and `dy` added to the block's dweight and dbias partials.
/// Steps of `LANES`, then a short tail element by element; the weights in f32. The second pass
/// reads the row from the cache, so it prefetches `next` (the next row's dy and x, see [`Ahead`]).
#[inline(always)]
fn backward_row<T: FloatElement, const NATIVE: bool>(
    (dy, x, w): (&[T], &[T], &[f32]),
    next: (&[T], &[T]),
    (mean, rstd): (f32, f32),
    (dx, streaming): (&mut [T], bool),
    (dw, db): (&mut [f32], &mut [f32]),
) {
    let (n, tail) = (x.len(), x.len() / LANES * LANES);
    let step = |row: &[T], at: usize| widen_lanes::<T, NATIVE, LANES>(row[at..at + LANES].try_into().expect("LANES"));
    // Weights copied, not borrowed, as in `rms_norm_backward` (the partials' stores could alias them).
    let weights = |at: usize| -> [f32; LANES] { w[at..at + LANES].try_into().expect("LANES") };
    let (mut sum_g, mut sum_gx) = ([0f32; LANES], [0f32; LANES]);
    for at in (0..tail).step_by(LANES) {
        let (d, xv, wv) = (step(dy, at), step(x, at), weights(at));
        for i in 0..LANES {
            let g = d[i] * wv[i];
            sum_g[i] += g;
            sum_gx[i] += g * (xv[i] - mean) * rstd;
        }
    }
    let (mut tail_g, mut tail_gx) = (0.0, 0.0);
    for i in tail..n {
        let g = dy[i].to_f32() * w[i];
        (tail_g, tail_gx) = (tail_g + g, tail_gx + g * (x[i].to_f32() - mean) * rstd);
    }
    let mean_g = (math::sum_lanes(sum_g) + tail_g) / n as f32;
    let mean_gx = (math::sum_lanes(sum_gx) + tail_gx) / n as f32;
    let mut ahead = [next.0, next.1].map(|row| Ahead::new(row, tail / LANES));
    for at in (0..tail).step_by(LANES) {
        ahead.iter_mut().for_each(Ahead::step);
        let (d, xv, wv) = (step(dy, at), step(x, at), weights(at));
        // Both partials loaded before either is stored: their rows lie a multiple of 4 KiB apart,
        // so a dbias load behind a dweight store would wait on it (4K aliasing).
        let (dwc, dbc) = (&mut dw[at..at + LANES], &mut db[at..at + LANES]);
        let (mut gw, mut gb): ([f32; LANES], [f32; LANES]) = (dwc.try_into().unwrap(), dbc.try_into().unwrap());
        let mut out = Aligned([0f32; LANES]);
        for i in 0..LANES {
            let xhat = (xv[i] - mean) * rstd;
            out[i] = rstd * (d[i] * wv[i] - mean_g - xhat * mean_gx);
            gw[i] += d[i] * xhat;
            gb[i] += d[i];
        }
        dwc.copy_from_slice(&gw);
        dbc.copy_from_slice(&gb);
        store_step::<T, NATIVE>(&out, &mut dx[at..at + LANES], streaming);
    }
    for i in tail..n {
        let (d, xhat) = (dy[i].to_f32(), (x[i].to_f32() - mean) * rstd);
        dx[i] = T::from_f32(rstd * (d * w[i] - mean_g - xhat * mean_gx));
        dw[i] += d * xhat;
        db[i] += d;
    }
}

crate::simd_kernel! {
fn dx_kernel<T: FloatElement, W: FloatElement>(args: &KernelArgs, ctx: BlockCtx, s: &KernelShape, samples: SampleBlocks) {
    let (dy, x, mean, rstd) = (args.input(0), args.input(1), args.input(3), args.input(4));
    let dx = args.output(0);
    let (block, blocks) = (ctx.block_idx as usize, ctx.block_num as usize);
    // SAFETY: block b owns workspace row `2·blocks + b` (its widened weight, after the partials).
    let w = unsafe { param_f32::<W>(args, 2, 2 * blocks + block, s.cols) };
    let (means, rstds) = (mean.storage::<f32>().unwrap(), rstd.storage::<f32>().unwrap());
    // SAFETY: block b owns partial row b of the workspace (dweight's, then dbias's).
    let partial = unsafe { args.workspace::<f32>(block * 2 * s.cols, 2 * s.cols) };
    partial.fill(0.0);
    let (dw, db) = partial.split_at_mut(s.cols);
    let (_, rows) = samples.rows(ctx);
    for r in rows.clone() {
        let [dyr, xr, next_dy, next_x] = [(&dy, r), (&x, r), (&dy, r + 1), (&x, r + 1)].map(|(t, r)| s.row::<T>(t, r, &rows));
        let stats = (means[mean.layout().offset_of_linear(r)], rstds[rstd.layout().offset_of_linear(r)]);
        // SAFETY: this block owns row r of dx.
        let dxrow = unsafe { dx.slice_mut::<T>(dx.layout().outer_offset(r, s.inner_dims), s.cols) };
        if T::converts_natively() {
            backward_row::<T, true>((dyr, xr, w), (next_dy, next_x), stats, (dxrow, s.streaming), (dw, db));
        } else {
            backward_row::<T, false>((dyr, xr, w), (next_dy, next_x), stats, (dxrow, s.streaming), (dw, db));
        }
    }
    fence();
}
}

/// The checks of the backward's tensors: rms_norm_backward's (x, weight, dy, rstd), and the mean
/// like rstd.
fn check(cx: &OpCx) -> Result<NormShape> {
    let s = crate::rms_norm_backward::check(cx, "x", "layer_norm")?;
    check_statistic(cx, "mean", &s, "layer_norm")?;
    Ok(s)
}

impl Op for LayerNormBackward {
    fn schema(&self) -> &'static str {
        "layer_norm_backward(Tensor dy, Tensor x, Tensor weight, Tensor mean, Tensor rstd, int batch_dims=0) -> \
         (Tensor dx, Tensor dweight, Tensor dbias)"
    }

    fn doc(&self) -> &'static str {
        "Gradients of layer_norm: dx (dtype of x), dweight and dbias (dtype of weight; dbias = dy summed over \
         rows, to ignore when the layer has no bias), from the upstream gradient dy and the mean and rstd saved \
         by the forward. dweight and dbias sum over all rows, or per sample with batch_dims: then they are \
         x.shape[:batch_dims] + weight's shape. Deterministic: the dweight and dbias partials are per block, \
         summed in a fixed order."
    }

    /// Row by row; the parameter gradients per sample with `batch_dims`.
    fn leading_batch_args(&self) -> &'static [&'static str] {
        &["dy", "x", "mean", "rstd"]
    }

    fn dtypes(&self) -> &'static [DType] {
        crate::rms_norm::DTYPES
    }

    fn error_scale(&self, cx: &OpCx) -> f64 {
        crate::rms_norm_backward::sum_error_scale(cx, "x")
    }

    fn infer(&self, cx: &OpCx) -> Result<Vec<TensorMeta>> {
        let s = check(cx)?;
        let param = param_grad(cx, "x", &s)?;
        Ok(vec![TensorMeta::contiguous(s.dtype, cx.input("x").shape())?, param.clone(), param])
    }

    fn plan(&self, cx: &OpCx) -> Result<Plan> {
        let s = check(cx)?;
        let streaming = streams_bytes(s.rows * s.cols * s.dtype.size());
        let ks = KernelShape { rows: s.rows, cols: s.cols, inner_dims: s.inner_dims, eps: 0.0, streaming };
        let sb = samples(cx, "x", &s)?.blocks(cx, "x", block_dim_for(s.rows, 3 * s.cols * s.dtype.size()))?;
        let (blocks, partials) = (sb.total, sb.total as usize);
        let reduce_blocks = block_dim_for(sb.count * s.cols, 8 * sb.per_sample);
        // [block][dweight | dbias] partials, then the blocks' widened weights (when not f32).
        let per_block = if cx.input("weight").dtype == DType::F32 { 2 } else { 3 };
        let workspace = partials
            .checked_mul(s.cols)
            .and_then(|n| n.checked_mul(4 * per_block))
            .ok_or_else(|| cx.err(ErrorCode::Shape, "x", "a size whose workspace fits in memory", s.cols))?;
        let cols = s.cols;
        let steps = with_float_dtype!(s.dtype, cx.op(), "x", |T| {
            if cx.input("weight").dtype == DType::F32 {
                vec![
                    Step::new("layer_norm_backward.dx", blocks, move |a, c| dx_kernel::<T, f32>(a, c, &ks, sb)),
                    Step::new("layer_norm_backward.dweight", reduce_blocks, move |a, c| {
                        sum_partials::<f32>(a, c, cols, sb, &[1, 2])
                    }),
                ]
            } else {
                vec![
                    Step::new("layer_norm_backward.dx", blocks, move |a, c| dx_kernel::<T, T>(a, c, &ks, sb)),
                    Step::new("layer_norm_backward.dweight", reduce_blocks, move |a, c| {
                        sum_partials::<T>(a, c, cols, sb, &[1, 2])
                    }),
                ]
            }
        });
        let row = s.row_need();
        Ok(Plan::new(steps)
            .workspace(workspace)
            .inputs_need(vec![row, row, LayoutNeed::Contiguous, LayoutNeed::Any, LayoutNeed::Any])
            .outputs_need(vec![row, LayoutNeed::Contiguous, LayoutNeed::Contiguous]))
    }

    fn reference(&self, cx: &OpCx, inputs: &[Option<RefTensor>]) -> Result<Vec<RefTensor>> {
        let s = check(cx)?;
        let per_sample = samples(cx, "x", &s)?;
        let [dy, x, w, mean, rstd] = [0, 1, 2, 3, 4].map(|i| inputs[i].as_ref().unwrap());
        let n = s.cols;
        let params = per_sample.count * n;
        let (mut dx, mut dw, mut db) = (vec![0.0; x.data.len()], vec![0.0; params], vec![0.0; params]);
        for r in 0..s.rows {
            let at = r / per_sample.rows.max(1) * n;
            let (dw, db) = (&mut dw[at..at + n], &mut db[at..at + n]);
            let (dyr, xr) = (&dy.data[r * n..(r + 1) * n], &x.data[r * n..(r + 1) * n]);
            let xhat: Vec<f64> = xr.iter().map(|v| (v - mean.data[r]) * rstd.data[r]).collect();
            let g: Vec<f64> = (0..n).map(|i| dyr[i] * w.data[i]).collect();
            let mean_g = g.iter().sum::<f64>() / n as f64;
            let mean_gx = (0..n).map(|i| g[i] * xhat[i]).sum::<f64>() / n as f64;
            for i in 0..n {
                dx[r * n + i] = rstd.data[r] * (g[i] - mean_g - xhat[i] * mean_gx);
                dw[i] += dyr[i] * xhat[i];
                db[i] += dyr[i];
            }
        }
        let param = param_grad(cx, "x", &s)?;
        Ok(vec![
            RefTensor::new(cx.input("x").shape(), dx),
            RefTensor::new(param.shape(), dw),
            RefTensor::new(param.shape(), db),
        ])
    }

    fn example(&self, shape: Option<&[usize]>, dtype: DType) -> Result<Example> {
        // rms_norm_backward's (dy, x, weight, rstd), and the mean shaped like rstd.
        let mut example = crate::rms_norm_backward::example(shape, dtype, 2)?;
        example.inputs.push(example.inputs[3].clone());
        Ok(example)
    }
}
