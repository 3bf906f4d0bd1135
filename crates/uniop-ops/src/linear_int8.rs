//! `linear_int8(x, weight, scales, bias=None) = x · (weight · scales)ᵀ + bias`: a linear layer whose
//! weight is int8, quantized symmetrically per output feature (weight-only quantization, "W8A16":
//! torchao's `int8_weight_only`, optimum-quanto's qint8 weights, `torch.ops.aten._weight_int8pack_mm`).
//!
//! Why an op of its own: decoding a token reads every weight once and does two flops per weight,
//! so a linear layer there runs at the speed its weight streams from memory. An int8 weight is
//! half a bf16 one and a quarter of an f32 one; dequantizing it to x's dtype first (what a
//! composite of torch ops does) writes and rereads the wide copy and loses exactly that. (On AVX2
//! the dot products below are bound by widening the weight before memory: see the bench results.)
//!
//! Two routes, by the number of rows of x:
//! - few rows (decode, up to [`DOT_ROWS`]): dot products that widen the int8 weight as they read it,
//!   four weight rows against one or two rows of x at a time, in f32; the scale and the bias are
//!   applied to each sum, rounded once to x's dtype.
//! - more rows (prefill): each block dequantizes chunks of its band of weight rows (`w · scale`,
//!   rounded to x's dtype) into its workspace and multiplies them with `linear`'s GEMM, so the
//!   product runs at `linear`'s rate after one pass over the weight; the bias is written first and
//!   the product accumulated onto it.
//!
//! Blocks own bands of output features in both routes, so each reads its share of the weight once.

use crate::linear::{check_bias, output_shape, reference_rows, weight_dims, Dims, COLUMN_UNIT};
use crate::matmul::{column_band, gemm_rows, Dst, Mat, DTYPES};
use crate::packed_gemm::GemmOut;
use crate::rms_norm::param_f32;
use uniop::{
    with_float_dtype, BlockCtx, DType, Example, FloatElement, KernelArgs, LayoutNeed, Op, OpCx, Plan, RefTensor,
    Result, Step, TensorMeta,
};

pub struct LinearInt8;

/// The most rows of x the dot products take; more go through the dequantized GEMM. At 32 rows the
/// dot products still win (AVX2 EPYC, f32, `[32, 4096]` by an `[8192, 4096]` weight: the GEMM route
/// 27.0 ms, 18.3 already at 9 rows, most of it the pass dequantizing the weight); at 128 rows the
/// GEMM route takes within 8% of `linear`'s time on the dense weight (`benches/int8_linear.py`).
const DOT_ROWS: usize = 32;

/// Bytes of one block's dequantized chunk of weight rows (whole [`COLUMN_UNIT`]s, at least one).
const CHUNK_BYTES: usize = 2 << 20;

/// Weight rows per dequantized chunk, for `k` input features of `dtype`.
fn chunk_rows(k: usize, dtype: DType) -> usize {
    (CHUNK_BYTES / (k.max(1) * dtype.size()) / COLUMN_UNIT).max(1) * COLUMN_UNIT
}

/// The checks of x `[..., k]` of a float dtype, weight int8 `[n, k]` and scales `[n]` of x's dtype
/// or float32 (shared with `linear_int8_backward`).
pub(crate) fn quantized_dims(cx: &OpCx) -> Result<Dims> {
    let dtype = cx.expect_dtype_in("x", DTYPES)?;
    cx.expect_dtype_in("weight", &[DType::I8])?;
    let d = weight_dims(cx, "weight")?;
    let scale_dtypes = [dtype, DType::F32];
    cx.expect_dtype_in("scales", &scale_dtypes[(dtype == DType::F32) as usize..])?;
    cx.expect_shape("scales", &[d.n])?;
    Ok(d)
}

/// [`quantized_dims`] and the optional bias `[n]` of x's dtype.
fn dims(cx: &OpCx) -> Result<Dims> {
    let d = quantized_dims(cx)?;
    check_bias(cx, d)?;
    Ok(d)
}

/// Sums of four weight rows against `R` rows of x, each `k` long: `sums[i][j] = Σ x[i]·w[j]`.
///
/// # Safety
/// Every pointer must be valid for `k` elements.
#[inline(always)]
pub(crate) unsafe fn dots<const R: usize>(x: [*const f32; R], w: [*const i8; 4], k: usize) -> [[f32; 4]; R] {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
        return dots_avx2(x, w, k);
    }
    dots_portable(x, w, k)
}

/// [`dots`] in plain Rust.
///
/// # Safety
/// As [`dots`].
#[inline(always)]
unsafe fn dots_portable<const R: usize>(x: [*const f32; R], w: [*const i8; 4], k: usize) -> [[f32; 4]; R] {
    let mut sums = [[0f32; 4]; R];
    for (i, row) in x.iter().enumerate() {
        let row = std::slice::from_raw_parts(*row, k);
        for (j, weights) in w.iter().enumerate() {
            let weights = std::slice::from_raw_parts(*weights, k);
            // Eight partial sums, so the loop vectorizes without reassociating floats.
            let mut partial = [0f32; 8];
            let (xs, ws) = (row.chunks_exact(8), weights.chunks_exact(8));
            let tail: f32 = xs.remainder().iter().zip(ws.remainder()).map(|(&a, &b)| a * b as f32).sum();
            for (xc, wc) in xs.zip(ws) {
                for l in 0..8 {
                    partial[l] += xc[l] * wc[l] as f32;
                }
            }
            sums[i][j] = partial.iter().sum::<f32>() + tail;
        }
    }
    sums
}

/// [`dots`] with AVX2: eight weights of each row widened (sign-extended, converted) per step, one
/// FMA chain per (row of x, weight row).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dots_avx2<const R: usize>(x: [*const f32; R], w: [*const i8; 4], k: usize) -> [[f32; 4]; R] {
    use std::arch::x86_64::*;
    let mut acc = [[_mm256_setzero_ps(); 4]; R];
    let whole = k / 8 * 8;
    for p in (0..whole).step_by(8) {
        let weights =
            w.map(|row| _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(row.add(p) as *const __m128i))));
        for (row, acc) in x.iter().zip(acc.iter_mut()) {
            let xv = _mm256_loadu_ps(row.add(p));
            for (a, wv) in acc.iter_mut().zip(weights) {
                *a = _mm256_fmadd_ps(xv, wv, *a);
            }
        }
    }
    let mut sums = [[0f32; 4]; R];
    for i in 0..R {
        for j in 0..4 {
            let tail: f32 = (whole..k).map(|p| *x[i].add(p) * *w[j].add(p) as f32).sum();
            sums[i][j] = crate::rows_avx2::sum8(acc[i][j]) + tail;
        }
    }
    sums
}

/// `out[i] = q[i] · scale` rounded to `T` (shared with `linear_int8_backward`), through f32 in short
/// stretches so that the rounding runs vectorized ([`FloatElement::narrow`]): element by element,
/// bf16's rounding took most of the 33 ms that dequantizing an `[8192, 4096]` weight cost (AVX2).
#[inline(always)]
pub(crate) fn dequantize<T: FloatElement>(q: &[i8], scale: f32, out: &mut [T]) {
    const STRETCH: usize = 256;
    let mut wide = [0f32; STRETCH];
    for (q, out) in q.chunks(STRETCH).zip(out.chunks_mut(STRETCH)) {
        let wide = &mut wide[..q.len()];
        for (w, &v) in wide.iter_mut().zip(q) {
            *w = v as f32 * scale;
        }
        T::narrow(wide, out);
    }
}

/// What every route reads: block `ctx`'s band of output features `cols`, x's rows (as stored), the
/// int8 weight, the scales and bias widened to f32, and the output.
struct Band<'a, T> {
    d: Dims,
    cols: std::ops::Range<usize>,
    xs: &'a [T],
    ws: &'a [i8],
    scales: &'a [f32],
    bias: Option<&'a [f32]>,
    y: *mut T,
}

impl<T: FloatElement> Band<'_, T> {
    /// Row `r` of y, columns `c0..c1` (of this block's band).
    ///
    /// # Safety
    /// `c0..c1` within the band; no other reference to that span alive.
    #[allow(clippy::mut_from_ref)]
    unsafe fn out(&self, r: usize, c0: usize, c1: usize) -> &mut [T] {
        std::slice::from_raw_parts_mut(self.y.add(r * self.d.n + c0), c1 - c0)
    }

    /// Writes the bias over the band (the products are then accumulated onto it).
    fn write_bias(&self) {
        if let Some(b) = self.bias {
            for r in 0..self.d.rows {
                // SAFETY: the band is this block's.
                T::narrow(&b[self.cols.clone()], unsafe { self.out(r, self.cols.start, self.cols.end) });
            }
        }
    }

    /// Weight rows `c0..c1` times their scales, rounded to `T`, into `out` (`(c1 − c0) · k` elements).
    fn dequantize(&self, c0: usize, c1: usize, out: &mut [T]) {
        let k = self.d.k;
        for (c, row) in (c0..c1).zip(out.chunks_exact_mut(k)) {
            dequantize(&self.ws[c * k..(c + 1) * k], self.scales[c], row);
        }
    }

    /// Few rows (decode): int8 dot products, four weight rows against two rows of `x` (f32) at a
    /// time, each sum times its scale plus its bias rounded once.
    fn int8_dots(&self, x: &[f32]) {
        let (d, cols) = (self.d, &self.cols);
        let x_row = |r: usize| x[r * d.k..].as_ptr();
        for n0 in cols.clone().step_by(4) {
            // A short last group repeats its last row; those sums are not stored.
            let rows: [*const i8; 4] = std::array::from_fn(|j| self.ws[(n0 + j).min(cols.end - 1) * d.k..].as_ptr());
            let n1 = (n0 + 4).min(cols.end);
            let store = |r: usize, sums: [f32; 4]| {
                // SAFETY: the band is this block's.
                for (j, o) in unsafe { self.out(r, n0, n1) }.iter_mut().enumerate() {
                    *o = T::from_f32(sums[j] * self.scales[n0 + j] + self.bias.map_or(0.0, |b| b[n0 + j]));
                }
            };
            for r in (0..d.rows - d.rows % 2).step_by(2) {
                // SAFETY: rows r and r + 1 of x and the four weight rows hold k elements each.
                let [first, second] = unsafe { dots::<2>([x_row(r), x_row(r + 1)], rows, d.k) };
                store(r, first);
                store(r + 1, second);
            }
            if d.rows % 2 == 1 {
                // SAFETY: as above, for the last row.
                store(d.rows - 1, unsafe { dots::<1>([x_row(d.rows - 1)], rows, d.k) }[0]);
            }
        }
    }
}

impl<T: FloatElement + GemmOut> Band<'_, T> {
    /// Many rows (prefill): chunks of the band dequantized to x's dtype, each multiplied with x by
    /// `linear`'s GEMM.
    fn gemm(&self, chunk: &mut [T]) {
        let d = self.d;
        self.write_bias();
        let rows = chunk.len() / d.k;
        let lhs = Mat { ptr: self.xs.as_ptr(), rs: d.k as isize, cs: 1 };
        for c0 in self.cols.clone().step_by(rows) {
            let c1 = (c0 + rows).min(self.cols.end);
            self.dequantize(c0, c1, chunk);
            // SAFETY: x and the chunk hold the extents given; the band is this block's.
            unsafe {
                let dst = Dst { ptr: self.y.add(c0), rs: d.n as isize, cs: 1 };
                // The chunk's rows are the product's columns, k dense (the weight layout).
                let rhs = Mat { ptr: chunk.as_ptr(), rs: 1, cs: d.k as isize };
                gemm_rows(0..d.rows, c1 - c0, d.k, dst, lhs, rhs, self.bias.is_some());
            }
        }
    }
}

/// The route a product of `rows` rows takes.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Route {
    Dots,
    Gemm,
}

impl Route {
    /// (An empty product takes the dot products: there is nothing to dequantize.)
    fn of(d: Dims) -> Route {
        if d.rows <= DOT_ROWS || d.k == 0 {
            Route::Dots
        } else {
            Route::Gemm
        }
    }

    /// Scratch bytes of one block: x widened to f32 for the dot products (unless it is f32), a
    /// chunk of dequantized weight rows for the GEMM.
    fn scratch(self, d: Dims, dtype: DType) -> usize {
        match self {
            Route::Dots if dtype == DType::F32 => 0,
            Route::Dots => d.rows * d.k * 4,
            Route::Gemm => chunk_rows(d.k, dtype) * d.k * dtype.size(),
        }
    }
}

crate::simd_kernel! {
/// Block `ctx`'s band of output features, every row of x. `S`: the scales' element type.
fn kernel<T: FloatElement + GemmOut, S: FloatElement>(args: &KernelArgs, ctx: BlockCtx, d: Dims, bias: bool, route: Route) {
    let cols = column_band(ctx, d.n, COLUMN_UNIT);
    if cols.is_empty() {
        return;
    }
    let (x, w, y) = (args.input(0), args.input(1), args.output(0));
    let (block, blocks) = (ctx.block_idx as usize, ctx.block_num as usize);
    // Workspace: rows of `n` f32 per block, its scales then its bias (widened when not f32); then
    // each block's scratch.
    // SAFETY: block b owns parameter rows 2b and 2b + 1.
    let scales = unsafe { param_f32::<S>(args, 2, 2 * block, d.n) };
    let bias = bias.then(|| unsafe { param_f32::<T>(args, 3, 2 * block + 1, d.n) });
    let band = Band {
        d,
        cols,
        xs: &x.storage::<T>().expect("dtype dispatched")[x.layout().offset()..][..d.rows * d.k],
        ws: &w.storage::<i8>().expect("int8 weight")[w.layout().offset()..][..d.n * d.k],
        scales,
        bias,
        // SAFETY: y is contiguous `[rows, n]` (the plan asks for it); blocks write their own bands.
        y: unsafe { y.as_mut_ptr::<T>().add(y.layout().offset()) },
    };
    let scratch_at = 2 * blocks * d.n * 4 + block * route.scratch(d, T::DTYPE);
    if route == Route::Gemm {
        let rows = chunk_rows(d.k, T::DTYPE);
        // SAFETY: block b owns its scratch (sized by the plan).
        return band.gemm(unsafe { args.workspace::<T>(scratch_at / T::DTYPE.size(), rows * d.k) });
    }
    let x_f32 = match T::as_f32_slice(band.xs) {
        Some(x) => x,
        None => {
            // SAFETY: as above.
            let wide = unsafe { args.workspace::<f32>(scratch_at / 4, d.rows * d.k) };
            T::widen(band.xs, wide);
            wide
        }
    };
    band.int8_dots(x_f32);
}
}

impl Op for LinearInt8 {
    fn schema(&self) -> &'static str {
        "linear_int8(Tensor x, Tensor weight, Tensor scales, Tensor? bias=None) -> Tensor y"
    }

    fn doc(&self) -> &'static str {
        "y = x @ (weight * scales[:, None])^T + bias: a linear layer with an int8 weight [out_features, \
         in_features] quantized per output feature (weight-only int8, as torchao's int8_weight_only and \
         torch.ops.aten._weight_int8pack_mm). x [..., in_features] float32/float16/bfloat16; scales [out_features] \
         of x's dtype or float32; bias optional [out_features] of x's dtype. Up to 32 rows (decode) run as dot \
         products that widen the weight as they read it (float32 sums; half a bf16 weight's bytes); more rows \
         dequantize chunks of the weight to x's dtype and run linear's GEMM."
    }

    fn backward(&self) -> Option<&'static str> {
        Some("linear_int8_backward")
    }

    fn leading_batch_args(&self) -> &'static [&'static str] {
        &["x"]
    }

    fn dtypes(&self) -> &'static [DType] {
        DTYPES
    }

    /// As linear: a product, run in the region's lower precision (the int8 weight stays int8).
    fn autocast(&self) -> uniop::Autocast {
        uniop::Autocast::LowerPrecision
    }

    fn error_scale(&self, cx: &OpCx) -> f64 {
        dims(cx).map_or(1.0, |d| (d.k.max(1) as f64).sqrt())
    }

    fn infer(&self, cx: &OpCx) -> Result<Vec<TensorMeta>> {
        let d = dims(cx)?;
        Ok(vec![TensorMeta::contiguous(cx.input("x").dtype, &output_shape(cx, d))?])
    }

    fn plan(&self, cx: &OpCx) -> Result<Plan> {
        let d = dims(cx)?;
        let x = cx.input("x").dtype;
        let threads = uniop::runtime::Pool::global().threads();
        let blocks = d.n.div_ceil(COLUMN_UNIT).clamp(1, threads);
        let bias = cx.optional_input("bias").is_some();
        let route = Route::of(d);
        let scales_f32 = cx.input("scales").dtype == DType::F32;
        let step = with_float_dtype!(x, cx.op(), "x", |T| {
            let kernel = if scales_f32 { kernel::<T, f32> } else { kernel::<T, T> };
            Step::new("linear_int8", blocks as u32, move |args, ctx| kernel(args, ctx, d, bias, route))
        });
        let scratch = route.scratch(d, x);
        Ok(Plan::new(vec![step])
            .workspace(blocks * (2 * d.n * 4 + scratch))
            .inputs_need(vec![LayoutNeed::Contiguous; 4])
            .outputs_need(vec![LayoutNeed::Contiguous]))
    }

    fn reference(&self, cx: &OpCx, inputs: &[Option<RefTensor>]) -> Result<Vec<RefTensor>> {
        let d = dims(cx)?;
        let (x, w, s) = (inputs[0].as_ref().unwrap(), inputs[1].as_ref().unwrap(), inputs[2].as_ref().unwrap());
        let bias = |_, j: usize| inputs[3].as_ref().map_or(0.0, |b| b.data[j]);
        let y = reference_rows(d, x, |j, p| w.data[j * d.k + p] * s.data[j], bias);
        Ok(vec![RefTensor::new(&output_shape(cx, d), y)])
    }

    fn example(&self, shape: Option<&[usize]>, dtype: DType) -> Result<Example> {
        // `shape` is x's (default: one decode row); weight maps in_features to 2·in_features (an MLP
        // up projection), int8 over its whole range, with scales of a typical magnitude and a bias.
        let shape = shape.unwrap_or(&[1, 4096]);
        let k = shape.last().copied().unwrap_or(1);
        let x = if shape.is_empty() { vec![1] } else { shape.to_vec() };
        Ok(Example {
            inputs: vec![
                Some(TensorMeta::contiguous(dtype, &x)?),
                Some(TensorMeta::contiguous(DType::I8, &[2 * k, k])?),
                Some(TensorMeta::contiguous(dtype, &[2 * k])?),
                Some(TensorMeta::contiguous(dtype, &[2 * k])?),
            ],
            ranges: vec![None, Some((-127.0, 128.0)), Some((0.001, 0.02)), None],
            ..Default::default()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The dot products of every form this CPU runs (the portable one always; AVX2 where it can)
    /// against f64 sums, for one and two rows of x and lengths around the 8-wide steps.
    #[test]
    fn every_form_of_the_dot_products_matches_f64() {
        for k in [0, 1, 7, 8, 9, 37, 1000] {
            let x: Vec<f32> = (0..2 * k).map(|i| ((i * 7919) % 2003) as f32 / 1001.0 - 1.0).collect();
            let w: Vec<i8> = (0..4 * k).map(|i| ((i * 37 + 11) % 255) as i8).collect();
            let (xr, wr) = ([0, 1].map(|i| x[i * k..].as_ptr()), [0, 1, 2, 3].map(|j| w[j * k..].as_ptr()));
            let want = |i: usize, j: usize| (0..k).map(|p| x[i * k + p] as f64 * w[j * k + p] as f64).sum::<f64>();
            let magnitude =
                |i: usize, j: usize| (0..k).map(|p| (x[i * k + p] * w[j * k + p] as f32).abs() as f64).sum::<f64>();
            let check = |form: &str, got: &[[f32; 4]]| {
                for (i, row) in got.iter().enumerate() {
                    for (j, &v) in row.iter().enumerate() {
                        let err = (v as f64 - want(i, j)).abs();
                        assert!(err <= 1e-6 * magnitude(i, j) + 1e-6, "{form} k {k} ({i}, {j}): {v} vs {}", want(i, j));
                    }
                }
            };
            // SAFETY: x holds two rows of k, w four.
            unsafe {
                check("portable, two rows", &dots_portable::<2>(xr, wr, k));
                check("portable, one row", &dots_portable::<1>([xr[0]], wr, k));
                #[cfg(target_arch = "x86_64")]
                if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
                    check("avx2, two rows", &dots_avx2::<2>(xr, wr, k));
                    check("avx2, one row", &dots_avx2::<1>([xr[0]], wr, k));
                }
            }
        }
    }
}
