//! `linear_int8_backward(dy, x, weight, scales, batch_dims=0, needs_dx=True, needs_dscales=True) ->
//! (dx, dscales, dbias)`, the gradient of [`linear_int8`](crate::linear_int8) with respect to all
//! but its int8 weight (an integer tensor has no gradient: the quantized base is frozen):
//! `dx = dy · (weight · scales)`, `dscales[j] = Σ_rows dy[:, j] · (x · weight[j])`, `dbias = Σ_rows
//! dy` — the last two per sample of the first `batch_dims` dims of x (see
//! [`per_sample`](crate::per_sample)).
//!
//! Why: training adapters beside a quantized base layer (QLoRA's pattern: LoRA's low-rank update
//! next to a frozen quantized projection) needs dx through that layer, and tuning the
//! quantization scales alone (PEQA) needs dscales. Without this op the forward refuses to train.
//!
//! Two launches, each block owning a band of an output (deterministic, no atomics):
//! - dx, bands of its columns (the weight's input features). Few rows (up to [`SUM_ROWS`]): each
//!   weight row is widened as it is read and added, times `dy · scale`, into the f32 sums of those
//!   rows of dx, a tile of columns at a time (the sums stay in L1), rounded once. More rows: each band is dequantized slab by slab (every
//!   weight row across a slab of columns, `w · scale` rounded to x's dtype, as the forward's GEMM
//!   route) and multiplied by `linear`'s GEMM at the whole depth n: one rounding.
//! - dscales and dbias, bands of output features per sample: for tiles of weight rows, the
//!   forward's int8 dot products ([`dots`]) against each pair of rows of x, times dy, summed in
//!   f32. dscales costs the forward's products again, so it is computed only when asked for
//!   (`needs_dscales`: frontends pass whether the scales require a gradient; a frozen base's
//!   scales do not), and dbias is then one pass over dy.

use crate::linear::{output_shape, Dims, COLUMN_UNIT};
use crate::linear_int8::{dequantize, dots, quantized_dims};
use crate::matmul::{column_band, gemm_rows, Dst, Mat, DTYPES};
use crate::packed_gemm::GemmOut;
use crate::per_sample::{SampleBlocks, Samples};
use crate::rms_norm::param_f32;
use uniop::{
    with_float_dtype, BlockCtx, DType, Example, FloatElement, KernelArgs, LayoutNeed, Op, OpCx, Plan, RefTensor,
    Result, Step, TensorMeta,
};

pub struct LinearInt8Backward;

/// Rows of dx whose sums the few-rows route carries through one pass over its band of the weight,
/// and the most rows it takes: a second pass loses to dequantizing the weight once (AVX2 EPYC, bf16,
/// weight `[8192, 4096]`: at 8 rows the sums took 13.8 ms, the GEMM route 12.0; at 4, 7.0 and 14.1).
const SUM_ROWS: usize = 4;
/// Columns of dx per tile of the few-rows route: [`SUM_ROWS`] rows of their f32 sums take 16 KiB.
const SUM_COLUMNS: usize = 1024;
/// Bytes of one block's dequantized slab of weight columns in the many-rows route.
const SLAB_BYTES: usize = 4 << 20;
/// Weight rows per tile of the dscales launch: the int8 rows stay in L2 while x's rows pass.
const SCALE_TILE: usize = 64;

fn dims(cx: &OpCx) -> Result<Dims> {
    let d = quantized_dims(cx)?;
    cx.expect_same_dtype("dy", cx.input("x").dtype, "x")?;
    cx.expect_shape("dy", &output_shape(cx, d))?;
    Ok(d)
}

/// How `batch_dims` divides the rows of `x` into samples.
fn samples(cx: &OpCx) -> Result<Samples> {
    Samples::of(cx, "x", cx.input("x").rank() - 1)
}

/// Columns per dequantized slab: [`SLAB_BYTES`] of `n` weight rows of `dtype`, whole
/// [`COLUMN_UNIT`]s (at least one).
fn slab_columns(n: usize, dtype: DType) -> usize {
    (SLAB_BYTES / (n.max(1) * dtype.size()) / COLUMN_UNIT).max(1) * COLUMN_UNIT
}

/// The route dx takes.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Route {
    Sums,
    Gemm,
}

impl Route {
    /// (A product of depth 0 takes the sums: there is nothing to dequantize.)
    fn of(d: Dims) -> Route {
        if d.rows <= SUM_ROWS || d.n == 0 {
            Route::Sums
        } else {
            Route::Gemm
        }
    }

    /// Scratch bytes of one block: the f32 sums of a tile, or a dequantized slab.
    fn scratch(self, d: Dims, dtype: DType) -> usize {
        match self {
            Route::Sums => SUM_ROWS * SUM_COLUMNS * 4,
            Route::Gemm => d.n * slab_columns(d.n, dtype) * dtype.size(),
        }
    }
}

/// `sums[i] += g[i] · w` for each row `i` of `sums` (`w.len()` wide), the int8 weights widened as
/// they are read.
#[inline(always)]
fn add_weight_row(sums: &mut [f32], g: &[f32], w: &[i8]) {
    for (row, &gi) in sums.chunks_exact_mut(w.len()).zip(g) {
        for (s, &q) in row.iter_mut().zip(w) {
            *s += gi * q as f32;
        }
    }
}

crate::simd_kernel! {
/// Launch 1: block `ctx`'s band of dx's columns, every row. `S`: the scales' element type.
fn dx_kernel<T: FloatElement + GemmOut, S: FloatElement>(args: &KernelArgs, ctx: BlockCtx, d: Dims, route: Route) {
    let cols = column_band(ctx, d.k, COLUMN_UNIT);
    if cols.is_empty() {
        return;
    }
    let (dy, w, dx) = (args.input(0), args.input(2), args.output(0));
    let (block, blocks) = (ctx.block_idx as usize, ctx.block_num as usize);
    // Workspace: a row of `n` f32 per block, its scales (widened when not f32); then each block's
    // scratch.
    // SAFETY: block b owns parameter row b.
    let scales = unsafe { param_f32::<S>(args, 3, block, d.n) };
    let scratch_at = blocks * d.n * 4 + block * route.scratch(d, T::DTYPE);
    let dys = &dy.storage::<T>().expect("dtype dispatched")[dy.layout().offset()..][..d.rows * d.n];
    let ws = &w.storage::<i8>().expect("int8 weight")[w.layout().offset()..][..d.n * d.k];
    // SAFETY: dx is contiguous `[rows, k]` (the plan asks for it); blocks write their own columns.
    let dx = unsafe { dx.as_mut_ptr::<T>().add(dx.layout().offset()) };
    if route == Route::Sums {
        // SAFETY: block b owns its scratch (sized by the plan).
        let sums = unsafe { args.workspace::<f32>(scratch_at / 4, SUM_ROWS * SUM_COLUMNS) };
        for c0 in cols.clone().step_by(SUM_COLUMNS) {
            let c1 = (c0 + SUM_COLUMNS).min(cols.end);
            let width = c1 - c0;
            for r0 in (0..d.rows).step_by(SUM_ROWS) {
                let r1 = (r0 + SUM_ROWS).min(d.rows);
                let sums = &mut sums[..(r1 - r0) * width];
                sums.fill(0.0);
                for j in 0..d.n {
                    let g: [f32; SUM_ROWS] =
                        std::array::from_fn(|i| if r0 + i < r1 { FloatElement::to_f32(dys[(r0 + i) * d.n + j]) * scales[j] } else { 0.0 });
                    add_weight_row(sums, &g[..r1 - r0], &ws[j * d.k + c0..j * d.k + c1]);
                }
                for (r, row) in (r0..r1).zip(sums.chunks_exact(width)) {
                    // SAFETY: columns c0..c1 of row r are this block's.
                    T::narrow(row, unsafe { std::slice::from_raw_parts_mut(dx.add(r * d.k + c0), width) });
                }
            }
        }
        return;
    }
    let slab = slab_columns(d.n, T::DTYPE);
    // SAFETY: as above.
    let deq = unsafe { args.workspace::<T>(scratch_at / T::DTYPE.size(), d.n * slab) };
    for c0 in cols.clone().step_by(slab) {
        let c1 = (c0 + slab).min(cols.end);
        let width = c1 - c0;
        // Columns c0..c1 of every weight row times its scale: a `[n, width]` row-major operand.
        for (j, row) in deq.chunks_exact_mut(width).take(d.n).enumerate() {
            dequantize(&ws[j * d.k + c0..j * d.k + c1], scales[j], row);
        }
        // SAFETY: dy and the slab hold the extents given; columns c0..c1 of dx are this block's.
        unsafe {
            gemm_rows(
                0..d.rows,
                width,
                d.n,
                Dst { ptr: dx.add(c0), rs: d.k as isize, cs: 1 },
                Mat { ptr: dys.as_ptr(), rs: d.n as isize, cs: 1 },
                Mat { ptr: deq.as_ptr(), rs: width as isize, cs: 1 },
                false,
            );
        }
    }
}
}

crate::simd_kernel! {
/// Launch 2: block `ctx`'s band of one sample's dscales (when `dscales`) and dbias. `S`: the
/// scales' element type.
fn dscales_kernel<T: FloatElement, S: FloatElement>(
    args: &KernelArgs,
    ctx: BlockCtx,
    d: Dims,
    samples: SampleBlocks,
    dscales: bool,
) {
    if samples.count == 0 {
        return; // the returns are empty
    }
    let (dy, x, w) = (args.input(0), args.input(1), args.input(2));
    let (ds, db) = (args.output(1), args.output(2));
    let (sample, place) = ctx.within(samples.count);
    let rows = sample * samples.rows..(sample + 1) * samples.rows;
    let owned = place.split(d.n);
    let dys = &dy.storage::<T>().expect("dtype dispatched")[dy.layout().offset()..][..d.rows * d.n];
    let xs = &x.storage::<T>().expect("dtype dispatched")[x.layout().offset()..][..d.rows * d.k];
    let ws = &w.storage::<i8>().expect("int8 weight")[w.layout().offset()..][..d.n * d.k];
    // Rows of x widened to f32 two at a time (x of another dtype, dscales asked for).
    // SAFETY: block b owns workspace row b of 2k f32 (sized by the plan when used).
    let mut wide = (dscales && T::DTYPE != DType::F32)
        .then(|| unsafe { args.workspace::<f32>(ctx.block_idx as usize * 2 * d.k, 2 * d.k) });
    for j0 in owned.clone().step_by(SCALE_TILE) {
        let j1 = (j0 + SCALE_TILE).min(owned.end);
        let (mut bias_sums, mut scale_sums) = ([0f32; SCALE_TILE], [0f32; SCALE_TILE]);
        for r in rows.clone() {
            for (s, v) in bias_sums.iter_mut().zip(&dys[r * d.n + j0..r * d.n + j1]) {
                *s += v.to_f32();
            }
        }
        for r in rows.clone().step_by(2).filter(|_| dscales) {
            let pair = (rows.end - r).min(2);
            let src = &xs[r * d.k..(r + pair) * d.k];
            let xf: &[f32] = match (T::as_f32_slice(src), wide.as_deref_mut()) {
                (Some(xf), _) => xf,
                (None, Some(wide)) => {
                    T::widen(src, &mut wide[..pair * d.k]);
                    &wide[..pair * d.k]
                }
                (None, None) => unreachable!("x other than f32 has its scratch"),
            };
            let x_row = |i: usize| xf[i * d.k..].as_ptr();
            for n0 in (j0..j1).step_by(4) {
                // A short last group repeats its last row; those sums are not used.
                let w_rows: [*const i8; 4] = std::array::from_fn(|q| ws[(n0 + q).min(j1 - 1) * d.k..].as_ptr());
                // SAFETY: the `pair` rows of x and the four weight rows hold k elements each.
                let sums = unsafe {
                    if pair == 2 {
                        dots::<2>([x_row(0), x_row(1)], w_rows, d.k)
                    } else {
                        [dots::<1>([x_row(0)], w_rows, d.k)[0], [0.0; 4]]
                    }
                };
                for (i, sums) in sums.iter().enumerate().take(pair) {
                    for (q, sum) in sums.iter().enumerate().take((n0 + 4).min(j1) - n0) {
                        scale_sums[n0 - j0 + q] += dys[(r + i) * d.n + n0 + q].to_f32() * sum;
                    }
                }
            }
        }
        let at = sample * d.n + j0;
        // SAFETY: entries j0..j1 of this sample's dscales and dbias are this block's.
        unsafe {
            T::narrow(&bias_sums[..j1 - j0], db.slice_mut::<T>(db.layout().offset() + at, j1 - j0));
            if dscales {
                S::narrow(&scale_sums[..j1 - j0], ds.slice_mut::<S>(ds.layout().offset() + at, j1 - j0));
            }
        }
    }
}
}

impl Op for LinearInt8Backward {
    fn schema(&self) -> &'static str {
        "linear_int8_backward(Tensor dy, Tensor x, Tensor weight, Tensor scales, int batch_dims=0, bool \
         needs_dx=True, bool needs_dscales=True) -> (Tensor dx, Tensor dscales, Tensor dbias)"
    }

    fn doc(&self) -> &'static str {
        "Gradients of linear_int8 (the int8 weight is frozen: it has none): dx = dy @ (weight * scales[:, None]), \
         dscales[j] = sum over rows of dy[:, j] * (x @ weight[j]), dbias = dy summed over rows (ignore it when the \
         layer has no bias). With batch_dims, dscales and dbias are per sample: x.shape[:batch_dims] + [out_features]. \
         needs_dx=False leaves dx out, needs_dscales=False dscales (frozen scales: it costs the forward's products \
         again); each comes back empty, [0]."
    }

    /// Row by row; the parameter gradients per sample with `batch_dims`.
    fn leading_batch_args(&self) -> &'static [&'static str] {
        &["dy", "x"]
    }

    fn dtypes(&self) -> &'static [DType] {
        DTYPES
    }

    /// dx sums n terms; dscales sums rows · k terms, each carrying an int8 weight (up to 128).
    fn error_scale(&self, cx: &OpCx) -> f64 {
        dims(cx).map_or(1.0, |d| {
            let dscales = if cx.needs_grad("scales") { 128.0 * ((d.rows * d.k).max(1) as f64).sqrt() } else { 0.0 };
            (d.n.max(1) as f64).sqrt().max(dscales)
        })
    }

    fn infer(&self, cx: &OpCx) -> Result<Vec<TensorMeta>> {
        let (d, samples) = (dims(cx)?, samples(cx)?);
        let dtype = cx.input("x").dtype;
        Ok(vec![
            TensorMeta::contiguous(dtype, &cx.grad_shape("x", cx.input("x").shape()))?,
            TensorMeta::contiguous(cx.input("scales").dtype, &cx.grad_shape("scales", &samples.shape(&[d.n])))?,
            TensorMeta::contiguous(dtype, &samples.shape(&[d.n]))?,
        ])
    }

    fn plan(&self, cx: &OpCx) -> Result<Plan> {
        let (d, samples) = (dims(cx)?, samples(cx)?);
        let x = cx.input("x").dtype;
        let threads = uniop::runtime::Pool::global().threads();
        let dx_blocks = d.k.div_ceil(COLUMN_UNIT).clamp(1, threads);
        let sb = samples.blocks(cx, "x", d.n.div_ceil(SCALE_TILE).clamp(1, threads) as u32)?;
        let route = Route::of(d);
        let (needs_dx, needs_dscales) = (cx.needs_grad("x"), cx.needs_grad("scales"));
        let scales_f32 = cx.input("scales").dtype == DType::F32;
        let steps = with_float_dtype!(x, cx.op(), "x", |T| {
            let dx = if scales_f32 { dx_kernel::<T, f32> } else { dx_kernel::<T, T> };
            let ds = if scales_f32 { dscales_kernel::<T, f32> } else { dscales_kernel::<T, T> };
            let dx = needs_dx
                .then(|| Step::new("linear_int8_backward.dx", dx_blocks as u32, move |a, c| dx(a, c, d, route)));
            let ds = Step::new("linear_int8_backward.dscales", sb.total, move |a, c| ds(a, c, d, sb, needs_dscales));
            dx.into_iter().chain([ds]).collect()
        });
        // The launches run one after the other, so they share the workspace.
        let dx_bytes = if needs_dx { dx_blocks * (d.n * 4 + route.scratch(d, x)) } else { 0 };
        let dscales_bytes = if needs_dscales && x != DType::F32 { sb.total as usize * 2 * d.k * 4 } else { 0 };
        Ok(Plan::new(steps)
            .workspace(dx_bytes.max(dscales_bytes))
            .inputs_need(vec![LayoutNeed::Contiguous; 4])
            .outputs_need(vec![LayoutNeed::Contiguous; 3]))
    }

    fn reference(&self, cx: &OpCx, inputs: &[Option<RefTensor>]) -> Result<Vec<RefTensor>> {
        let (d, samples) = (dims(cx)?, samples(cx)?);
        let [dy, x, w, s] = [0, 1, 2, 3].map(|i| &inputs[i].as_ref().unwrap().data);
        let (needs_dx, needs_dscales) = (cx.needs_grad("x"), cx.needs_grad("scales"));
        let mut dx = vec![0.0; if needs_dx { d.rows * d.k } else { 0 }];
        let mut ds = vec![0.0; if needs_dscales { samples.count * d.n } else { 0 }];
        let mut db = vec![0.0; samples.count * d.n];
        for r in 0..d.rows {
            let sample = r / samples.rows.max(1);
            let xr = &x[r * d.k..(r + 1) * d.k];
            for j in 0..d.n {
                let (g, wj) = (dy[r * d.n + j], &w[j * d.k..(j + 1) * d.k]);
                db[sample * d.n + j] += g;
                if needs_dx {
                    for (o, &q) in dx[r * d.k..(r + 1) * d.k].iter_mut().zip(wj) {
                        *o += g * s[j] * q;
                    }
                }
                if needs_dscales {
                    ds[sample * d.n + j] += g * xr.iter().zip(wj).map(|(a, b)| a * b).sum::<f64>();
                }
            }
        }
        Ok(vec![
            RefTensor::new(&cx.grad_shape("x", cx.input("x").shape()), dx),
            RefTensor::new(&cx.grad_shape("scales", &samples.shape(&[d.n])), ds),
            RefTensor::new(&samples.shape(&[d.n]), db),
        ])
    }

    /// x's shape, as for linear_int8 (the first input is the gradient of its output).
    fn example_shape(&self, example: &Example) -> Vec<usize> {
        example.input_shape(1)
    }

    fn example(&self, shape: Option<&[usize]>, dtype: DType) -> Result<Example> {
        // `shape` is x's (default: a training batch's rows): dy and x as linear_backward's example,
        // its weight `[2k, k]` int8 with scales, as linear_int8's example.
        let mut example = crate::linear_backward::example(Some(shape.unwrap_or(&[512, 4096])), dtype, 2)?;
        let weight = example.input_shape(2);
        example.inputs[2] = Some(TensorMeta::contiguous(DType::I8, &weight)?);
        example.inputs.push(Some(TensorMeta::contiguous(dtype, &weight[..1])?));
        example.ranges = vec![None, None, Some((-127.0, 128.0)), Some((0.001, 0.02))];
        Ok(example)
    }
}
