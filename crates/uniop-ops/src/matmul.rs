//! `matmul(a, b)`: batched matrix product with torch.matmul's broadcasting of batch dims
//! (`a` `[..., M, K]`, `b` `[..., K, N]`, both rank ≥ 2) and any strides — a transposed operand
//! is just swapped strides, so no copies are made.
//!
//! Kernels: the `gemm` crate (f32) called single-threaded inside uniop's SPMD blocks, each block
//! owning a band of rows of one batch — the pool stays the only source of parallelism (no second
//! thread pool spinning on the same cores). bf16 runs our own packed kernel
//! ([`crate::packed_gemm`]; the `gemm` crate has none), f32 sums rounded once, and so do f32
//! products whose B is dense along k (HF-layout weights) on AVX-512 and AVX2 CPUs. f16 runs on the
//! f32 kernels over widened operands, its sums rounded once (few rows times a weight: f16 dot
//! products; see [`gemm_rows_f16_in_f32`] for why not the crate's f16 kernels).

use crate::skinny::{Dots, Simd};
use uniop::half::{bf16, f16};
use uniop::layout::ShapeDisplay;
use uniop::{
    broadcast_shapes, with_float_dtype, BlockCtx, DType, Element, ErrorCode, Example, FloatElement, KernelArgs, Layout,
    Op, OpCx, Plan, RefTensor, Result, Step, TensorMeta,
};

pub struct Matmul;

pub(crate) const DTYPES: &[DType] = &[DType::F32, DType::F16, DType::BF16];

/// `[..., M, K] × [..., K, N]` with broadcast batch dims.
#[derive(Clone, Debug)]
pub(crate) struct Dims {
    pub batch: Vec<usize>,
    pub m: usize,
    pub k: usize,
    pub n: usize,
}

impl Dims {
    pub fn batches(&self) -> usize {
        self.batch.iter().product()
    }
    pub fn out_shape(&self) -> Vec<usize> {
        let mut s = self.batch.clone();
        s.extend([self.m, self.n]);
        s
    }
}

pub(crate) fn dims(cx: &OpCx) -> Result<Dims> {
    let dtype = cx.expect_dtype_in("a", DTYPES)?;
    cx.expect_same_dtype("b", dtype, "a")?;
    cx.expect_min_rank("a", 2)?;
    cx.expect_min_rank("b", 2)?;
    let (a, b) = (cx.input("a").shape(), cx.input("b").shape());
    let (m, k) = (a[a.len() - 2], a[a.len() - 1]);
    let (kb, n) = (b[b.len() - 2], b[b.len() - 1]);
    if kb != k {
        return Err(cx.err(
            ErrorCode::Shape,
            "b",
            format!("{k} rows (a is {}, so b must be [..., {k}, N])", ShapeDisplay(a)),
            format!("shape {}", ShapeDisplay(b)),
        ));
    }
    let batch = broadcast_shapes(&a[..a.len() - 2], &b[..b.len() - 2]).ok_or_else(|| {
        cx.err(
            ErrorCode::Shape,
            "b",
            format!("batch dims broadcastable with a's {}", ShapeDisplay(&a[..a.len() - 2])),
            ShapeDisplay(&b[..b.len() - 2]),
        )
    })?;
    Ok(Dims { batch, m, k, n })
}

/// One operand's batch layout (its matrix dims dropped), broadcast to `batch`.
fn batch_layout(l: &Layout, batch: &[usize]) -> Layout {
    let r = l.rank();
    Layout::strided(&l.shape()[..r - 2], &l.strides()[..r - 2], l.offset())
        .and_then(|b| b.broadcast_to(batch))
        .expect("checked by dims()")
}

/// Row and column strides of an operand's matrix dims.
fn matrix_strides(l: &Layout) -> (isize, isize) {
    let s = l.strides();
    (s[s.len() - 2] as isize, s[s.len() - 1] as isize)
}

/// Work split: `tiles` bands of rows per batch matrix, each cut into `col_tiles` bands of columns.
#[derive(Clone, Copy)]
struct Split {
    m: usize,
    k: usize,
    n: usize,
    tiles: usize,
    col_tiles: usize,
}

/// Columns per unit of a column band (whole register tiles of every kernel).
const COLUMN_UNIT: usize = 64;

/// The columns of `n` that `part` owns when they are cut into bands of whole `unit`s (the last
/// unit may be ragged): a block's share of the output columns in a column split.
pub(crate) fn column_band(part: BlockCtx, n: usize, unit: usize) -> std::ops::Range<usize> {
    let units = part.split(n.div_ceil(unit));
    units.start * unit..(units.end * unit).min(n)
}

/// A strided matrix operand: element 0 and the row and column strides, in elements.
#[derive(Clone, Copy)]
pub(crate) struct Mat<T> {
    pub ptr: *const T,
    pub rs: isize,
    pub cs: isize,
}

/// The output matrix, like [`Mat`].
#[derive(Clone, Copy)]
pub(crate) struct Dst<T> {
    pub ptr: *mut T,
    pub rs: isize,
    pub cs: isize,
}

impl<T> Mat<T> {
    /// The same matrix as elements of `U`: for generic code that has checked `T` is `U` (by dtype).
    pub fn cast<U>(self) -> Mat<U> {
        Mat { ptr: self.ptr as *const U, rs: self.rs, cs: self.cs }
    }
}

impl<T> Dst<T> {
    /// As [`Mat::cast`].
    pub fn cast<U>(self) -> Dst<U> {
        Dst { ptr: self.ptr as *mut U, rs: self.rs, cs: self.cs }
    }
}

/// `dst[rows] = lhs[rows] · rhs` (`+=` with `accumulate`) for `k`-deep products and `n` columns,
/// single-threaded: the SPMD block is the unit of parallelism.
///
/// # Safety
/// All three matrices must be valid for the given extents and strides, and no one else may
/// access rows `rows` of `dst` meanwhile.
pub(crate) unsafe fn gemm_rows<T: Element>(
    rows: std::ops::Range<usize>,
    n: usize,
    k: usize,
    dst: Dst<T>,
    lhs: Mat<T>,
    rhs: Mat<T>,
    accumulate: bool,
) {
    if rows.is_empty() || n == 0 {
        return;
    }
    if k == 0 {
        // An empty product is zero; don't rely on the GEMM to write it.
        if !accumulate {
            for r in rows {
                for c in 0..n {
                    *dst.ptr.offset(r as isize * dst.rs + c as isize * dst.cs) = T::from_f64(0.0);
                }
            }
        }
        return;
    }
    if T::DTYPE == DType::BF16 {
        let (dst, lhs, rhs) = (dst.cast::<bf16>(), lhs.cast::<bf16>(), rhs.cast::<bf16>());
        return crate::packed_gemm::gemm_rows_packed(rows, n, k, dst, lhs, rhs, accumulate);
    }
    // One row times a weight stays on the `gemm` crate's GEMV, which sums in f32 and walks the
    // weight row after row: 1.39-1.59 ms for [1, 4096] x [8192, 4096]ᵀ against 1.53-2.04 for the
    // dot products below, which read four rows at once. A row whose row stride is 1 as well reads to
    // the crate as a column of A, which it sums in f16 (see the unit-stride test below).
    if T::DTYPE == DType::F16 && !(rows.len() == 1 && lhs.cs == 1 && lhs.rs != 1 && rhs.rs == 1) {
        let (dst, lhs, rhs) = (dst.cast::<f16>(), lhs.cast::<f16>(), rhs.cast::<f16>());
        let simd = <f16 as Dots>::best();
        if crate::skinny::applies(&rows, lhs, rhs) && simd != Simd::Scalar {
            return crate::skinny::skinny(rows, n, k, dst, lhs, rhs, accumulate, simd);
        }
        return gemm_rows_f16_in_f32(rows, n, k, dst, lhs, rhs, accumulate);
    }
    let simd = <f32 as Dots>::best();
    if T::DTYPE == DType::F32 && crate::skinny::applies(&rows, lhs, rhs) && simd != Simd::Scalar {
        return crate::skinny::skinny(
            rows,
            n,
            k,
            dst.cast::<f32>(),
            lhs.cast::<f32>(),
            rhs.cast::<f32>(),
            accumulate,
            simd,
        );
    }
    if T::DTYPE == DType::F32 && rhs.rs == 1 && rhs.cs != 1 && rows.len() >= ROW_MAJOR_B_MIN_ROWS {
        let (dst, lhs, rhs) = (dst.cast::<f32>(), lhs.cast::<f32>(), rhs.cast::<f32>());
        if <f32 as Dots>::best() != Simd::Scalar && k <= PACKED_F32_MAX_K {
            // Packing transposes B's k-dense lines straight into panels: one pass over B.
            return crate::packed_gemm::gemm_rows_packed(rows, n, k, dst, lhs, rhs, accumulate);
        }
        return gemm_rows_with_row_major_b(rows, n, k, dst, lhs, rhs, accumulate, ROW_MAJOR_B_CHUNK_WORDS);
    }
    let start = rows.start as isize;
    // gemm computes dst := alpha·dst + beta·lhs·rhs, reading dst only when asked to.
    gemm::gemm(
        rows.len(),
        n,
        k,
        dst.ptr.offset(start * dst.rs),
        dst.cs,
        dst.rs,
        accumulate,
        lhs.ptr.offset(start * lhs.rs),
        lhs.cs,
        lhs.rs,
        rhs.ptr,
        rhs.cs,
        rhs.rs,
        T::from_f64(1.0),
        T::from_f64(1.0),
        false,
        false,
        false,
        gemm::Parallelism::None,
    );
}

/// [`gemm_rows`] for f16 through the f32 kernels: a block of rows of A, a block of columns of B and
/// (when accumulating) that block of the output are widened into f32 scratch, multiplied there, and
/// the sums rounded to f16 once. Blocks hold about [`WIDENED_WORDS`] words each, so the scratch stays
/// small whatever the product (widening a whole `[32000, 4096]` lm_head would keep 512 MiB per thread).
///
/// The `gemm` crate's f16 kernels round their running sums to f16 wherever they keep them in the
/// output: between its k blocks, and at every step of k in its GEMV for one row of A times a B
/// dense along n, which took `[1, 8198] · [8198, 256]` to 38 f16 ulps of error (torch: under one).
/// Widening costs a pass over each block of B per block of rows, which a product of few rows would
/// feel: those (decode against a weight) take [`crate::skinny`]'s f16 dot products instead, which
/// widen as they read.
#[allow(clippy::too_many_arguments)]
unsafe fn gemm_rows_f16_in_f32(
    rows: std::ops::Range<usize>,
    n: usize,
    k: usize,
    dst: Dst<f16>,
    lhs: Mat<f16>,
    rhs: Mat<f16>,
    accumulate: bool,
) {
    thread_local! {
        static WIDENED: std::cell::RefCell<[Vec<f32>; 3]> = const { std::cell::RefCell::new([Vec::new(), Vec::new(), Vec::new()]) };
    }
    let row_block = (WIDENED_WORDS / k).clamp(1, rows.len());
    let column_block = (WIDENED_WORDS / k.max(row_block)).next_multiple_of(16).min(n);
    WIDENED.with_borrow_mut(|[a, b, c]| {
        for r0 in rows.clone().step_by(row_block) {
            let m = row_block.min(rows.end - r0);
            let lhs = widen_matrix(Mat { ptr: lhs.ptr.offset(r0 as isize * lhs.rs), ..lhs }, m, k, a);
            for c0 in (0..n).step_by(column_block) {
                let cols = column_block.min(n - c0);
                let first = rhs.ptr.offset(c0 as isize * rhs.cs);
                // B keeps the orientation it is dense in, so a weight takes the f32 routes for weights.
                let rhs = if rhs.rs == 1 && rhs.cs != 1 {
                    let lines = widen_matrix(Mat { ptr: first, rs: rhs.cs, cs: 1 }, cols, k, b);
                    Mat { ptr: lines.ptr, rs: 1, cs: k as isize }
                } else {
                    widen_matrix(Mat { ptr: first, ..rhs }, k, cols, b)
                };
                let out = Dst { ptr: dst.ptr.offset(r0 as isize * dst.rs + c0 as isize * dst.cs), ..dst };
                c.resize(m * cols, 0.0);
                if accumulate {
                    widen_matrix(Mat { ptr: out.ptr, rs: out.rs, cs: out.cs }, m, cols, c);
                }
                gemm_rows(0..m, cols, k, Dst { ptr: c.as_mut_ptr(), rs: cols as isize, cs: 1 }, lhs, rhs, accumulate);
                narrow_matrix(&c[..m * cols], cols, out);
            }
        }
    });
}

/// Words of each f16 operand block [`gemm_rows_f16_in_f32`] widens at once (4 MiB of f32).
const WIDENED_WORDS: usize = 1 << 20;

/// `rows × cols` of `mat` as a dense row-major f32 matrix in `out` (resized to hold it).
///
/// # Safety
/// `mat` valid for the extents.
pub(crate) unsafe fn widen_matrix<T: FloatElement>(
    mat: Mat<T>,
    rows: usize,
    cols: usize,
    out: &mut Vec<f32>,
) -> Mat<f32> {
    out.resize(rows * cols, 0.0);
    for (r, line) in out.chunks_exact_mut(cols.max(1)).take(rows).enumerate() {
        let first = mat.ptr.offset(r as isize * mat.rs);
        if mat.cs == 1 {
            T::widen(std::slice::from_raw_parts(first, cols), line);
        } else {
            for (j, v) in line.iter_mut().enumerate() {
                *v = (*first.offset(j as isize * mat.cs)).to_f32();
            }
        }
    }
    Mat { ptr: out.as_ptr(), rs: cols as isize, cs: 1 }
}

/// Rounds the dense row-major f32 `rows` (each `cols` long) into `dst`, row by row: the other
/// half of [`widen_matrix`].
///
/// # Safety
/// `dst` valid for writes over `rows.len() / cols` rows of `cols`.
pub(crate) unsafe fn narrow_matrix<T: FloatElement>(rows: &[f32], cols: usize, dst: Dst<T>) {
    for (r, row) in rows.chunks_exact(cols.max(1)).enumerate() {
        let line = dst.ptr.offset(r as isize * dst.rs);
        if dst.cs == 1 {
            T::narrow(row, std::slice::from_raw_parts_mut(line, cols));
        } else {
            for (j, &v) in row.iter().enumerate() {
                *line.offset(j as isize * dst.cs) = T::from_f32(v);
            }
        }
    }
}

/// Rows that share a transposed copy of B, at least (below, the copy would cost more than it saves).
const ROW_MAJOR_B_MIN_ROWS: usize = 64;
/// Depth up to which an f32 product with a k-dense B runs the packed kernel on AVX-512 and AVX2 CPUs
/// (alternated `uniop bench --ops linear`, 2 threads): faster than the transposed copy at k = 384
/// (1.44 -> 1.40 ms), 1024 (11.4 -> 10.4) and 2048 (90 -> 83), slower at 4096 (660-680 -> 675-760 ms).
/// Since deep f32 products add their sums in the output slice by slice (`packed_gemm::multiply`), B's
/// packed column block (k × 512 words, 8 MiB at 4096) need not stay in cache, but at k = 4096 the
/// packed kernel still ran 4% slower on one core (x 1024 x 4096, weight 8192 x 4096: 487-496 ms against
/// 468-476). On AVX2 (Zen 3, 2 threads) the packed kernel ran x 2048 x 2048, weight 4096 x 2048 in 239 ms
/// against 288-336 for the transposed copy, and level with it at k = 1024 (k = 4096 not measured there).
pub(crate) const PACKED_F32_MAX_K: usize = 2048;
/// Words of B transposed at once: a column chunk of B stays this small whatever B's size.
const ROW_MAJOR_B_CHUNK_WORDS: usize = 1 << 20;

/// [`gemm_rows`] for an f32 B that is dense along k — a weight in HF's `[N, K]` layout seen
/// through swapped strides — which the gemm crate runs at 55-65% of its speed on a row-major B once
/// k passes ~1000 ([512, 1024] x [1024, 384]: 113 vs 201 GFLOP/s here). B is transposed into a
/// row-major scratch copy a column chunk of about `chunk_words` at a time, and each chunk
/// multiplied from there.
#[allow(clippy::too_many_arguments)]
unsafe fn gemm_rows_with_row_major_b(
    rows: std::ops::Range<usize>,
    n: usize,
    k: usize,
    dst: Dst<f32>,
    lhs: Mat<f32>,
    rhs: Mat<f32>,
    accumulate: bool,
    chunk_words: usize,
) {
    thread_local! {
        static ROW_MAJOR_B: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    let chunk = (chunk_words / k).next_multiple_of(16).min(n);
    ROW_MAJOR_B.with_borrow_mut(|scratch| {
        if scratch.len() < k * chunk {
            scratch.resize(k * chunk, 0.0);
        }
        for jc in (0..n).step_by(chunk) {
            let cols = chunk.min(n - jc);
            // Column j of the chunk is a line of k words; it becomes column j of a [k, cols] copy.
            let lines = rhs.ptr.offset(jc as isize * rhs.cs) as *const u8;
            crate::transpose::transpose_words(scratch.as_mut_ptr() as *mut u32, cols, lines, 4 * rhs.cs, cols, k);
            let chunk_dst = Dst { ptr: dst.ptr.offset(jc as isize * dst.cs), ..dst };
            let row_major = Mat { ptr: scratch.as_ptr(), rs: cols as isize, cs: 1 };
            gemm_rows(rows.clone(), cols, k, chunk_dst, lhs, row_major, accumulate);
        }
    });
}

fn kernel<T: Element>(args: &KernelArgs, ctx: BlockCtx, batch: &[usize], s: Split) {
    let (a, b, out) = (args.input(0), args.input(1), args.output(0));
    let (la, lb, lo) =
        (batch_layout(a.layout(), batch), batch_layout(b.layout(), batch), batch_layout(out.layout(), batch));
    let ((a_rs, a_cs), (b_rs, b_cs), (o_rs, o_cs)) =
        (matrix_strides(a.layout()), matrix_strides(b.layout()), matrix_strides(out.layout()));
    let (ap, bp) = (a.storage::<T>().unwrap().as_ptr(), b.storage::<T>().unwrap().as_ptr());
    // SAFETY: blocks write disjoint row × column bands of the output (below).
    let op = unsafe { out.as_mut_ptr::<T>() };
    let per_batch = s.tiles * s.col_tiles;
    for unit in ctx.split(lo.numel() * per_batch) {
        let (bi, tile, col_tile) = (unit / per_batch, unit % per_batch / s.col_tiles, unit % s.col_tiles);
        let rows = BlockCtx { block_idx: tile as u32, block_num: s.tiles as u32 }.split(s.m);
        let cols =
            column_band(BlockCtx { block_idx: col_tile as u32, block_num: s.col_tiles as u32 }, s.n, COLUMN_UNIT);
        let (ao, bo, oo) = (la.offset_of_linear(bi), lb.offset_of_linear(bi), lo.offset_of_linear(bi));
        // SAFETY: every offset stays inside the views the executor checked; this block's output
        // rows `rows` × columns `cols` of batch `bi` are written by no one else.
        unsafe {
            gemm_rows(
                rows,
                cols.len(),
                s.k,
                Dst { ptr: op.offset(oo as isize + cols.start as isize * o_cs), rs: o_rs, cs: o_cs },
                Mat { ptr: ap.add(ao), rs: a_rs, cs: a_cs },
                Mat { ptr: bp.offset(bo as isize + cols.start as isize * b_cs), rs: b_rs, cs: b_cs },
                false,
            );
        }
    }
}

impl Op for Matmul {
    fn schema(&self) -> &'static str {
        "matmul(Tensor a, Tensor b) -> Tensor out"
    }

    fn doc(&self) -> &'static str {
        "Batched matrix product a [..., M, K] x b [..., K, N] -> [..., M, N]; batch dims broadcast (torch.matmul \
         for rank >= 2); any strides, so transposed operands cost nothing. float32 via the gemm crate, float32 \
         with b dense along K via uniop's packed GEMM on AVX-512/AVX2 CPUs, float16 on the float32 kernels \
         (operands widened, sums rounded once), bfloat16 via uniop's packed GEMM (AVX512-BF16, AMX tiles, or \
         FMAs on widened pairs; float32 sums), inside uniop's SPMD blocks."
    }

    /// Matrices over broadcast batch dims.
    fn core_dims(&self) -> &'static [(&'static str, usize)] {
        &[("a", 2), ("b", 2)]
    }

    fn dtypes(&self) -> &'static [DType] {
        DTYPES
    }

    fn backward(&self) -> Option<&'static str> {
        Some("matmul_backward")
    }

    fn autocast(&self) -> uniop::Autocast {
        uniop::Autocast::LowerPrecision
    }

    fn infer(&self, cx: &OpCx) -> Result<Vec<TensorMeta>> {
        let d = dims(cx)?;
        Ok(vec![TensorMeta::contiguous(cx.input("a").dtype, &d.out_shape())?])
    }

    fn plan(&self, cx: &OpCx) -> Result<Plan> {
        let d = dims(cx)?;
        let threads = uniop::runtime::Pool::global().threads();
        // Enough row bands to give every thread work, but no band thinner than 16 rows — or one
        // band of all rows where bands of columns pay (see `packed_gemm::split_columns`).
        let tiles = if d.batches() == 1 && crate::packed_gemm::split_columns(cx.input("a").dtype, d.m, d.n, threads) {
            1
        } else {
            threads.div_ceil(d.batches().max(1)).min(d.m.div_ceil(16)).max(1)
        };
        // Too few rows to go around (decode-sized products): bands of columns too, each block
        // streaming its share of b.
        let col_tiles = threads.div_ceil(d.batches().max(1) * tiles).min(d.n.div_ceil(COLUMN_UNIT)).max(1);
        let units = d.batches() * tiles * col_tiles;
        let block_dim = units.clamp(1, 4 * threads) as u32;
        let s = Split { m: d.m, k: d.k, n: d.n, tiles, col_tiles };
        let batch = std::sync::Arc::new(d.batch);
        let step = with_float_dtype!(cx.input("a").dtype, cx.op(), "a", |T| {
            Step::new("matmul", block_dim, move |args, ctx| kernel::<T>(args, ctx, &batch, s))
        });
        Ok(Plan::new(vec![step]))
    }

    fn reference(&self, cx: &OpCx, inputs: &[Option<RefTensor>]) -> Result<Vec<RefTensor>> {
        let d = dims(cx)?;
        let (a, b) = (inputs[0].as_ref().unwrap(), inputs[1].as_ref().unwrap());
        let mut out = vec![0.0; d.batches() * d.m * d.n];
        // Each operand's own batch index, looked up through broadcasting.
        let batch_index = |shape: &[usize]| {
            let batch = &shape[..shape.len() - 2];
            RefTensor::new(batch, (0..batch.iter().product::<usize>()).map(|i| i as f64).collect())
        };
        let (a_batch, b_batch) = (batch_index(&a.shape), batch_index(&b.shape));
        for bi in 0..d.batches() {
            let (ab, bb) = (a_batch.broadcast_get(&d.batch, bi) as usize, b_batch.broadcast_get(&d.batch, bi) as usize);
            for i in 0..d.m {
                for j in 0..d.n {
                    out[(bi * d.m + i) * d.n + j] =
                        (0..d.k).map(|p| a.data[(ab * d.m + i) * d.k + p] * b.data[(bb * d.k + p) * d.n + j]).sum();
                }
            }
        }
        Ok(vec![RefTensor::new(&d.out_shape(), out)])
    }

    fn error_scale(&self, cx: &OpCx) -> f64 {
        dims(cx).map_or(1.0, |d| (d.k.max(1) as f64).sqrt())
    }

    fn example(&self, shape: Option<&[usize]>, dtype: DType) -> Result<Example> {
        // `shape` is a's; b is a square [K, K] shared by every batch.
        let shape = shape.unwrap_or(&[2048, 2048]);
        let k = shape.last().copied().unwrap_or(1);
        let a = if shape.len() < 2 { vec![1, k] } else { shape.to_vec() };
        Ok(Example {
            inputs: vec![Some(TensorMeta::contiguous(dtype, &a)?), Some(TensorMeta::contiguous(dtype, &[k, k])?)],
            ..Default::default()
        })
    }
}

/// Rows × a weight in `[n, k]` layout (or a row-major `[k, n]` B), for the kernels that take
/// such products (the skinny dot products, the transposed-copy GEMM, f16 through f32):
/// deterministic operands in `T` and a check against f64 sums.
#[cfg(test)]
pub(crate) struct WeightCase<T> {
    m: usize,
    k: usize,
    n: usize,
    a: Vec<T>,
    w: Vec<T>,
    start: Vec<T>,
    weight_layout: bool,
}

#[cfg(test)]
impl<T: FloatElement> WeightCase<T> {
    pub fn new(m: usize, k: usize, n: usize) -> WeightCase<T> {
        let value = |i: usize, seed: usize| ((i * 7919 + seed * 104729) % 2003) as f32 / 1001.0 - 1.0;
        let fill = |len: usize, seed: usize| (0..len).map(|i| T::from_f32(value(i, seed))).collect();
        WeightCase { m, k, n, a: fill(m * k, 1), w: fill(n * k, 2), start: fill(m * n, 3), weight_layout: true }
    }

    /// The same values with B row-major `[k, n]` (dense along n) instead of a weight.
    pub fn row_major(m: usize, k: usize, n: usize) -> WeightCase<T> {
        WeightCase { weight_layout: false, ..WeightCase::new(m, k, n) }
    }

    /// Runs `product(dst, rows, b)` on a fresh copy of the starting output and checks that rows
    /// `band` hold the product (added to the start with `accumulate`) and the others are untouched:
    /// f32 within 1e-4 relative, f16 and bf16 within one rounding of the result plus the f32 sums' own
    /// error (which scales with the terms, and stays when the result cancels to near zero).
    pub fn check(&self, band: std::ops::Range<usize>, accumulate: bool, product: impl FnOnce(Dst<T>, Mat<T>, Mat<T>)) {
        let (m, k, n) = (self.m, self.k, self.n);
        let mut out = self.start.clone();
        let (rs, cs) = if self.weight_layout { (1, k as isize) } else { (n as isize, 1) };
        product(
            Dst { ptr: out.as_mut_ptr(), rs: n as isize, cs: 1 },
            Mat { ptr: self.a.as_ptr(), rs: k as isize, cs: 1 },
            Mat { ptr: self.w.as_ptr(), rs, cs },
        );
        let b = |p: usize, c: usize| if self.weight_layout { self.w[c * k + p] } else { self.w[p * n + c] }.to_f64();
        for r in 0..m {
            for c in 0..n {
                let start = self.start[r * n + c].to_f64();
                let terms = (0..k).map(|p| self.a[r * k + p].to_f64() * b(p, c));
                let (want, magnitude) = match (band.contains(&r), accumulate) {
                    (false, _) => (start, 0.0),
                    (true, true) => {
                        (terms.clone().sum::<f64>() + start, terms.map(f64::abs).sum::<f64>() + start.abs())
                    }
                    (true, false) => (terms.clone().sum::<f64>(), terms.map(f64::abs).sum::<f64>()),
                };
                let tolerance = match T::DTYPE {
                    DType::F16 => 2f64.powi(want.abs().max(6.2e-5).log2().floor() as i32 - 10) + magnitude * 1e-6,
                    DType::BF16 => 2f64.powi(want.abs().max(1e-30).log2().floor() as i32 - 7) + magnitude * 1e-6,
                    _ => 1e-4 * (1.0 + want.abs()),
                };
                let got = out[r * n + c].to_f64();
                assert!(
                    (got - want).abs() <= tolerance,
                    "{m}x{k}x{n} weight layout {} ({r}, {c}): {got} vs {want}",
                    self.weight_layout
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A row band of f32 rows times a weight in `[n, k]` layout, through the transposed copy, in one
    /// chunk and in several (the last ragged), with and without accumulation, against f64 sums.
    #[test]
    fn weight_layout_b_multiplies_from_row_major_chunks() {
        let case = WeightCase::<f32>::new(140, 37, 45);
        for (chunk_words, accumulate) in [(ROW_MAJOR_B_CHUNK_WORDS, false), (16 * 37, true), (20 * 37, false)] {
            case.check(70..140, accumulate, |dst, lhs, rhs| {
                // SAFETY: WeightCase's buffers hold the extents it describes.
                unsafe { gemm_rows_with_row_major_b(70..140, 45, 37, dst, lhs, rhs, accumulate, chunk_words) }
            });
        }
    }

    /// f16 products round their f32 sums once, whichever route a shape takes: one row times a B
    /// dense along n (the `gemm` crate's GEMV kept its sums in f16 there: 38 ulps off at k = 8198),
    /// few rows times a weight (the skinny dot products), bands of rows times either (f32 kernels
    /// over widened operands, in one block and in several) accumulating or not, and a product too
    /// shallow for any GEMM.
    #[test]
    fn f16_products_round_their_sums_once() {
        for (m, k, n, weight_layout, accumulate) in [
            (1, 3000, 40, false, false),
            (1, 3000, 40, true, true),
            (3, 1500, 33, true, false),
            (70, 300, 50, false, true),
            (70, 300, 50, true, false),
            (2, 2, 7, false, true),
            // Deep enough that the widened blocks split both the rows and the columns (52 and 64).
            (70, 20_000, 80, true, true),
            (70, 20_000, 80, false, false),
        ] {
            let case = if weight_layout { WeightCase::<f16>::new(m, k, n) } else { WeightCase::row_major(m, k, n) };
            case.check(0..m, accumulate, |dst, lhs, rhs| {
                // SAFETY: WeightCase's buffers hold the extents it describes.
                unsafe { gemm_rows(0..m, n, k, dst, lhs, rhs, accumulate) }
            });
        }
    }

    /// A 1 × 1 f16 product with every stride 1 (`linear_backward`'s dweight for one input and one
    /// output feature: `dyᵀ` and `x` are single columns), which the `gemm` crate took for a GEMV along
    /// n and summed in f16: 0.17 off (11 ulps) over 1683 rows.
    #[test]
    fn f16_dot_product_of_unit_stride_columns_rounds_once() {
        let case = WeightCase::<f16>::row_major(1, 3000, 1);
        case.check(0..1, false, |dst, lhs, rhs| {
            // SAFETY: as above; with one row, the row strides address nothing else.
            unsafe { gemm_rows(0..1, 1, 3000, Dst { rs: 1, ..dst }, Mat { rs: 1, ..lhs }, rhs, false) }
        });
    }

    /// `gemm_rows` on a band of enough f32 rows times a weight-layout B, at a depth that takes the
    /// packed kernel on AVX-512 CPUs and at one past [`PACKED_F32_MAX_K`] (the transposed copy).
    #[test]
    fn weight_layout_b_through_gemm_rows_at_both_depths() {
        for (k, accumulate) in [(300, true), (PACKED_F32_MAX_K + 5, false)] {
            let case = WeightCase::<f32>::new(70, k, 40);
            case.check(3..70, accumulate, |dst, lhs, rhs| {
                // SAFETY: WeightCase's buffers hold the extents it describes.
                unsafe { gemm_rows(3..70, 40, k, dst, lhs, rhs, accumulate) }
            });
        }
    }
}
