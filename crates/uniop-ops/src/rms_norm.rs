//! `rms_norm(x, weight, eps) -> (y, rstd)`: y = x · rstd · weight, rstd = 1/√(mean(x²) + eps).
//!
//! The normalized dims are the trailing dims of `x` matching `weight`'s shape (aclnn semantics;
//! usually just the last dim). `rstd` is f32 and keeps the normalized dims as size 1, so it
//! broadcasts against `x` and feeds `rms_norm_backward` directly. `weight` may be the dtype of `x`
//! or f32 (mixed precision: f32 master weights with bf16 activations).
//!
//! Kernel: each block owns a contiguous range of rows and takes them a group at a time — one row
//! when rows are 4 KiB or longer, up to 8 shorter ones (see `KernelShape::group`). A row is read
//! twice (sum of squares, then scale), but the second read hits L1/L2, so the op moves each byte
//! of DRAM once — it is bandwidth-bound by design.

use crate::elementwise::{
    converts_per_element, copy_streaming, fence, store_natively, streams_bytes, to_f32, widen_lanes, Ahead, Aligned,
};
use crate::math;
use std::ops::Range;
use uniop::{
    block_dim_for, with_float_dtype, BlockCtx, DType, Element, ErrorCode, Example, FloatElement, KernelArgs, Layout,
    LayoutNeed, Op, OpCx, Plan, RefTensor, Result, Runs, Step, StridedRuns, TensorMeta, TensorRef,
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

/// Elements per step: four AVX-512 registers of independent work, so the bf16/f16 conversions
/// and the streaming stores of one step overlap with the arithmetic of the next.
const LANES: usize = 64;

/// Σ x² in f32, over `LANES` independent partial sums. Half types are widened one register at a
/// time, so the row never round-trips through memory as f32. f32 rows take the same loop: a
/// separate one with 32 lanes, which LLVM vectorized into a shuffle per load and a single
/// accumulator, ran f32 rms_norm at half the speed of this one in cache (16x4096, one thread, AMX
/// Xeon: 0.022 → 0.011 ms).
#[inline(always)]
pub(crate) fn sum_squares<T: FloatElement>(x: &[T]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if crate::rows_avx2::applies::<T>() {
        return crate::rows_avx2::sum_squares(x);
    }
    if T::converts_natively() {
        sum_squares_as::<T, true>(x)
    } else {
        sum_squares_as::<T, false>(x)
    }
}

#[inline(always)]
fn sum_squares_as<T: FloatElement, const NATIVE: bool>(x: &[T]) -> f32 {
    let mut acc = [0f32; LANES];
    let chunks = x.chunks_exact(LANES);
    let tail = chunks.remainder();
    for c in chunks {
        let buf: [f32; LANES] = widen_lanes::<T, NATIVE, LANES>(c.try_into().expect("LANES elements"));
        for i in 0..LANES {
            acc[i] += buf[i] * buf[i];
        }
    }
    tail.iter().map(|v| v.to_f32() * v.to_f32()).sum::<f32>() + math::sum_lanes(acc)
}

/// `y = x · rstd · w`, one register at a time; `streaming` writes y past the cache.
#[inline(always)]
pub(crate) fn scale_row<T: FloatElement>(x: &[T], next: &[T], w: &[f32], y: &mut [T], rstd: f32, streaming: bool) {
    #[cfg(target_arch = "x86_64")]
    if crate::rows_avx2::applies::<T>() {
        return crate::rows_avx2::scale_weighted(x, next, w, y, rstd, streaming);
    }
    if T::converts_natively() {
        scale_row_as::<T, true>(x, next, w, y, rstd, streaming)
    } else {
        scale_row_as::<T, false>(x, next, w, y, rstd, streaming)
    }
}

#[inline(always)]
fn scale_row_as<T: FloatElement, const NATIVE: bool>(
    x: &[T],
    next: &[T],
    w: &[f32],
    y: &mut [T],
    rstd: f32,
    streaming: bool,
) {
    let xs = x.chunks_exact(LANES);
    let tail = xs.len() * LANES;
    let mut ahead = Ahead::new(next, xs.len());
    let in_registers = !streaming && converts_per_element::<T, 1>();
    for ((xc, wc), yc) in xs.zip(w.chunks_exact(LANES)).zip(y.chunks_exact_mut(LANES)) {
        ahead.step();
        if NATIVE {
            // Results in f32, narrowed a step at a time by the CPU's instruction. In cache (Zen
            // 4), f16 rms_norm 0.044 → 0.027 ms, bf16 level; at 4096x4096 f16 2.33 → 1.47 ms,
            // bf16 2.59 → 1.84.
            let mut buf = Aligned([0f32; LANES]);
            for i in 0..LANES {
                buf[i] = to_f32::<T, true>(xc[i]) * rstd * wc[i];
            }
            // SAFETY: `NATIVE` only where `T::converts_natively()` (see `scale_row`).
            unsafe { store_natively(&buf, yc, streaming) };
            continue;
        }
        if in_registers {
            // Narrowed in registers (see `converts_per_element`; asked before the loop).
            for i in 0..LANES {
                yc[i] = T::from_f32(xc[i].to_f32() * rstd * wc[i]);
            }
            continue;
        }
        let mut buf: [f32; LANES] = T::widen_lanes(xc.try_into().expect("LANES elements"));
        for i in 0..LANES {
            buf[i] = buf[i] * rstd * wc[i];
        }
        let out = Aligned(T::narrow_lanes(&buf));
        if streaming {
            copy_streaming(yc, &out[..]);
        } else {
            yc.copy_from_slice(&out[..]);
        }
    }
    for i in tail..x.len() {
        y[i] = T::from_f32(x[i].to_f32() * rstd * w[i]);
    }
}

/// Input `i` (a weight or bias, contiguous, `cols` long) as f32: borrowed when it is f32, else
/// widened once per block into workspace row `scratch_row` (of `cols` f32), which the caller's
/// block owns and its plan reserves. Kernels then read f32 parameters straight from the cache
/// instead of widening them on every row.
///
/// # Safety
/// No other block may use workspace row `scratch_row` during the launch (a row past the plan's
/// workspace panics in [`KernelArgs::workspace`]).
#[inline(always)]
pub(crate) unsafe fn param_f32<W: FloatElement>(
    args: &KernelArgs,
    i: usize,
    scratch_row: usize,
    cols: usize,
) -> &[f32] {
    let w = args.input(i);
    let w = &w.storage::<W>().expect("dtype dispatched")[w.layout().offset()..][..cols];
    match W::as_f32_slice(w) {
        Some(wf) => wf,
        None => {
            // SAFETY: the caller's contract.
            let scratch = unsafe { args.workspace::<f32>(scratch_row * cols, cols) };
            W::widen(w, scratch);
            scratch
        }
    }
}

/// f64 RMSNorm of `rows × cols` values: `(y, rstd)`.
pub(crate) fn reference_rows(x: &[f64], w: &[f64], rows: usize, cols: usize, eps: f64) -> (Vec<f64>, Vec<f64>) {
    let mut y = vec![0.0; x.len()];
    let mut rstd = vec![0.0; rows];
    for r in 0..rows {
        let row = &x[r * cols..(r + 1) * cols];
        rstd[r] = 1.0 / (row.iter().map(|v| v * v).sum::<f64>() / cols as f64 + eps).sqrt();
        for c in 0..cols {
            y[r * cols + c] = row[c] * rstd[r] * w[c];
        }
    }
    (y, rstd)
}

crate::simd_kernel! {
/// Rows `split(rows)`, a group at a time ([`KernelShape::group`]): reduce each row of the
/// group, then scale each into y. The weight is widened to f32 once per block (into the
/// workspace) when it is not f32 already.
fn forward_kernel<T: FloatElement, W: FloatElement>(args: &KernelArgs, ctx: BlockCtx, s: &KernelShape) {
    let x = args.input(0);
    let (y, rstd_out) = (args.output(0), args.output(1));
    let cols = s.cols;
    // SAFETY: block b owns workspace row b (reserved when the weight is not f32).
    let wf = unsafe { param_f32::<W>(args, 1, ctx.block_idx as usize, cols) };
    // SAFETY: each block writes only the rstd entries of its own rows (below).
    let rstd_ptr = unsafe { rstd_out.as_mut_ptr::<f32>() };
    let xs = x.storage::<T>().expect("dtype dispatched");
    let walk = s.row_walk([x.layout(), y.layout(), rstd_out.layout()]);
    let mut groups = RowGroups::new(&walk, ctx.split(s.rows), s.group::<T>());
    let mut group = groups.next();
    while let Some(rows) = group {
        let ahead = groups.next();
        let mut rstd = [0f32; MAX_GROUP];
        for (j, [xo, ..]) in rows.offsets().iter().enumerate() {
            rstd[j] = 1.0 / (sum_squares(&xs[*xo..*xo + cols]) / cols as f32 + s.eps).sqrt();
        }
        for (j, [xo, yo, ro]) in rows.offsets().iter().enumerate() {
            // Half-precision rows: the matching row of the next group is fetched while this one is
            // scaled, so DRAM keeps streaming through the compute-only second pass (bf16 went from
            // ~2.8 to ~2.35 ms at 4096²). f32 rows already saturate DRAM and gained nothing.
            let next = match ahead.as_ref().and_then(|a| a.offsets().get(j)) {
                Some([next, ..]) if T::DTYPE != DType::F32 => &xs[*next..*next + cols],
                _ => &[],
            };
            // SAFETY: this block owns rows `split(rows)` of y and rstd.
            unsafe {
                *rstd_ptr.add(*ro) = rstd[j];
                scale_row(&xs[*xo..*xo + cols], next, wf, y.slice_mut::<T>(*yo, cols), rstd[j], s.streaming);
            }
        }
        group = ahead;
    }
    fence();
}
}

/// The most rows a row kernel takes together ([`KernelShape::group`]).
pub(crate) const MAX_GROUP: usize = 8;

/// Rows `range` of a [`StridedRuns`] walk over row starts, `size` rows at a time.
pub(crate) struct RowGroups<'a, const N: usize> {
    runs: Runs<'a, N>,
    steps: [usize; N],
    run: ([usize; N], usize),
    taken: usize,
    size: usize,
}

/// One group of rows: each row's start in every operand of the walk.
pub(crate) struct RowGroup<const N: usize> {
    starts: [[usize; N]; MAX_GROUP],
    len: usize,
}

impl<const N: usize> RowGroup<N> {
    pub fn offsets(&self) -> &[[usize; N]] {
        &self.starts[..self.len]
    }
}

impl<'a, const N: usize> RowGroups<'a, N> {
    pub fn new(walk: &'a StridedRuns<N>, range: Range<usize>, size: usize) -> Self {
        let size = size.clamp(1, MAX_GROUP);
        RowGroups {
            runs: walk.runs(range.start, range.end),
            steps: walk.inner_strides(),
            run: ([0; N], 0),
            taken: 0,
            size,
        }
    }
}

impl<const N: usize> Iterator for RowGroups<'_, N> {
    type Item = RowGroup<N>;

    #[inline(always)]
    fn next(&mut self) -> Option<RowGroup<N>> {
        let mut group = RowGroup { starts: [[0; N]; MAX_GROUP], len: 0 };
        while group.len < self.size {
            if self.taken == self.run.1 {
                match self.runs.next() {
                    Some(run) => (self.run, self.taken) = (run, 0),
                    None => break,
                }
            }
            group.starts[group.len] = std::array::from_fn(|k| self.run.0[k] + self.taken * self.steps[k]);
            (group.len, self.taken) = (group.len + 1, self.taken + 1);
        }
        (group.len > 0).then_some(group)
    }
}

/// Plan-time constants of the row kernels.
#[derive(Clone, Copy)]
pub(crate) struct KernelShape {
    pub rows: usize,
    pub cols: usize,
    pub inner_dims: usize,
    pub eps: f32,
    /// Whether outputs are written with non-temporal stores.
    pub streaming: bool,
}

impl KernelShape {
    /// Rows of `T` a row kernel takes together: their reductions, each ending in a chain of
    /// dependent steps (the horizontal sum, a square root, a division), overlap where one short
    /// row's would stall the core — RMSNorm over 128-wide heads (QK-norm) ran at half the
    /// bandwidth of 4096-wide rows. As many rows as fill 4 KiB, at most [`MAX_GROUP`]; long rows
    /// go one at a time.
    pub fn group<T: Element>(&self) -> usize {
        (4096 / (self.cols * size_of::<T>()).max(1)).clamp(1, MAX_GROUP)
    }

    /// A walk over the starts of the rows of `layouts` (each with this shape's rows and
    /// `inner_dims` normalized dims).
    pub fn row_walk<const N: usize>(&self, layouts: [&Layout; N]) -> StridedRuns<N> {
        StridedRuns::broadcast(layouts[0].shape(), self.inner_dims, layouts)
    }

    /// Row `r` of `t` (one of the row-addressed tensors); empty past the block's `rows`, where a
    /// kernel asks for the row after its last one (to prefetch).
    #[inline(always)]
    pub fn row<'a, T: Element>(&self, t: &TensorRef<'a>, r: usize, rows: &Range<usize>) -> &'a [T] {
        if r >= rows.end {
            return &[];
        }
        &t.storage::<T>().expect("dtype dispatched")[t.layout().outer_offset(r, self.inner_dims)..][..self.cols]
    }
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

    fn leading_batch_args(&self) -> &'static [&'static str] {
        &["x"]
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
        Ok(vec![
            TensorMeta::contiguous(s.dtype, cx.input("x").shape())?,
            TensorMeta::contiguous(DType::F32, &s.rstd_shape)?,
        ])
    }

    fn plan(&self, cx: &OpCx) -> Result<Plan> {
        let s = norm_shape(cx, "x", "weight")?;
        let weight_f32 = cx.input("weight").dtype == DType::F32;
        let bytes = s.rows * s.cols * s.dtype.size();
        let ks = KernelShape {
            rows: s.rows,
            cols: s.cols,
            inner_dims: s.inner_dims,
            eps: check_eps(cx)?,
            streaming: streams_bytes(bytes),
        };
        let block_dim = block_dim_for(s.rows, 2 * s.cols * s.dtype.size());
        let workspace = if weight_f32 { 0 } else { block_dim as usize * s.cols * 4 };
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
        let (y, rstd) = reference_rows(&x.data, &w.data, s.rows, s.cols, cx.float("eps"));
        Ok(vec![RefTensor::new(&x.shape, y), RefTensor::new(&s.rstd_shape, rstd)])
    }

    fn example(&self, shape: Option<&[usize]>, dtype: DType) -> Result<Example> {
        let shape = shape.unwrap_or(&[4096, 4096]);
        let x = TensorMeta::contiguous(dtype, shape)?;
        let w = TensorMeta::contiguous(dtype, &shape[shape.len().saturating_sub(1)..])?;
        Ok(Example { inputs: vec![Some(x), Some(w)], attrs: vec![], ..Default::default() })
    }
}
