//! `linear(x, weight, bias=None) = x · weightᵀ + bias` with HF/torch's weight layout
//! `[out_features, in_features]`. The transpose is free (swapped strides into the GEMM); the bias
//! is written first and the product accumulated onto it, so the output is touched once.

use crate::matmul::{column_band, gemm_rows, Dst, Mat, DTYPES};
use crate::packed_gemm::{gemm_rows_packed_weight, split_columns, PackedWeight};
use uniop::half::bf16;
use uniop::layout::ShapeDisplay;
use uniop::{
    with_float_dtype, BlockCtx, DType, Element, ErrorCode, Example, KernelArgs, LayoutNeed, Op, OpCx, Plan, RefTensor,
    Result, Step, TensorMeta,
};

pub struct Linear;

/// `x` as `[rows, k]`, `weight` `[n, k]`.
#[derive(Clone, Copy)]
pub(crate) struct Dims {
    pub rows: usize,
    pub k: usize,
    pub n: usize,
}

/// Checks `x` `[..., k]` against a weight `[n, k]` named `weight` (shared with `linear_backward`
/// and `linear_silu_mul`).
pub(crate) fn x_and_weight(cx: &OpCx, weight: &str) -> Result<Dims> {
    let dtype = cx.expect_dtype_in("x", DTYPES)?;
    cx.expect_same_dtype(weight, dtype, "x")?;
    weight_dims(cx, weight)
}

/// [`x_and_weight`]'s shape checks alone, for a weight of another dtype than x's (`linear_int8`'s).
pub(crate) fn weight_dims(cx: &OpCx, weight: &str) -> Result<Dims> {
    cx.expect_min_rank("x", 1)?;
    let (x, w) = (cx.input("x").shape(), cx.input(weight).shape());
    let k = *x.last().unwrap();
    if w.len() != 2 || w[1] != k {
        return Err(cx.err(
            ErrorCode::Shape,
            weight,
            format!("shape [out_features, {k}] (x is {})", ShapeDisplay(x)),
            format!("shape {}", ShapeDisplay(w)),
        ));
    }
    Ok(Dims { rows: x[..x.len() - 1].iter().product(), k, n: w[0] })
}

fn dims(cx: &OpCx) -> Result<Dims> {
    let d = x_and_weight(cx, "weight")?;
    check_bias(cx, d)?;
    Ok(d)
}

/// Checks the optional `bias` against `x`'s dtype and `d.n` (shared with `linear_packed`).
pub(crate) fn check_bias(cx: &OpCx, d: Dims) -> Result<()> {
    if let Some(b) = cx.optional_input("bias") {
        cx.expect_same_dtype("bias", cx.input("x").dtype, "x")?;
        if b.shape() != [d.n] {
            return Err(cx.err(
                ErrorCode::Shape,
                "bias",
                format!("shape [{}]", d.n),
                format!("shape {}", ShapeDisplay(b.shape())),
            ));
        }
    }
    Ok(())
}

/// How blocks share the output: bands of rows, or — when there are too few rows to go around
/// (decode: one token per sequence), or a row band would pack more of the weight than it
/// multiplies ([`split_columns`]) — bands of output columns, each block streaming or packing its
/// share of the weight (shared with `linear_silu_mul`).
#[derive(Clone, Copy)]
pub(crate) enum Bands {
    Rows,
    Columns,
}

impl Bands {
    /// The bands for a `dtype` product of `d`'s shape, and how many (one per pool thread at
    /// most). `weight_columns`: the columns of the weights a row band packs (`n` per weight).
    pub(crate) fn choose(dtype: DType, d: Dims, weight_columns: usize) -> (Bands, usize) {
        let threads = uniop::runtime::Pool::global().threads();
        let columns = split_columns(dtype, d.rows, weight_columns, threads);
        if (d.rows < 16 * threads || columns) && d.n >= 2 * COLUMN_UNIT {
            (Bands::Columns, d.n.div_ceil(COLUMN_UNIT).min(threads))
        } else {
            (Bands::Rows, d.rows.div_ceil(16).clamp(1, threads))
        }
    }

    /// The fewest output rows any of `blocks` blocks owns.
    pub(crate) fn least_rows(self, d: Dims, blocks: usize) -> usize {
        match self {
            Bands::Rows => d.rows / blocks,
            Bands::Columns => d.rows,
        }
    }

    /// The output rows × columns that block `ctx` owns.
    pub(crate) fn share(self, ctx: BlockCtx, d: Dims) -> (std::ops::Range<usize>, std::ops::Range<usize>) {
        match self {
            Bands::Rows => (ctx.split(d.rows), 0..d.n),
            Bands::Columns => (0..d.rows, column_band(ctx, d.n, COLUMN_UNIT)),
        }
    }
}

/// Output columns per unit of a column band (keeps bands on whole register tiles).
pub(crate) const COLUMN_UNIT: usize = 32;

/// What the output holds before the product is accumulated onto it: `linear`'s optional bias
/// (`[n]`, every row), or `linear_add`'s residual (`[rows, n]`, contiguous).
#[derive(Clone, Copy)]
pub(crate) enum Addend {
    Bias,
    Residual,
}

/// The weight of a `linear` form: as given (`[n, k]`, any strides) or packed by `pack_weight`.
#[derive(Clone, Copy, PartialEq)]
pub(crate) enum WeightForm {
    Given,
    Packed,
}

fn kernel<T: Element>(args: &KernelArgs, ctx: BlockCtx, d: Dims, bands: Bands, addend: Addend, form: WeightForm) {
    let (x, w, out) = (args.input(0), args.input(1), args.output(0));
    let third = args.optional_input(2);
    let xp = x.storage::<T>().unwrap().as_ptr();
    let (rows, cols) = bands.share(ctx, d);
    if cols.is_empty() {
        return;
    }
    let o = out.layout().offset();
    if let Some(t) = &third {
        let ts = &t.storage::<T>().unwrap()[t.layout().offset()..];
        for r in rows.clone() {
            let from = cols.start
                + match addend {
                    Addend::Bias => 0,
                    Addend::Residual => r * d.n,
                };
            // SAFETY: this block owns rows `rows` × columns `cols` of the (contiguous) output.
            unsafe { out.slice_mut::<T>(o + r * d.n + cols.start, cols.len()) }
                .copy_from_slice(&ts[from..][..cols.len()]);
        }
    }
    // SAFETY: x and out are contiguous [rows, k] / [rows, n] (the plan asked for it); weight is any
    // strided [n, k], read transposed, or packed (contiguous); this block owns output rows `rows` ×
    // columns `cols`.
    unsafe {
        let dst = Dst { ptr: out.as_mut_ptr::<T>().add(o + cols.start), rs: d.n as isize, cs: 1 };
        let lhs = Mat { ptr: xp.add(x.layout().offset()), rs: d.k as isize, cs: 1 };
        let accumulate = third.is_some();
        if form == WeightForm::Packed {
            let packed = crate::pack_weight::packed_weight(args, 1, d, false);
            let packed = PackedWeight { n: cols.end, ..packed };
            return if T::DTYPE == DType::BF16 {
                let packed = packed.columns_from::<bf16>(cols.start);
                gemm_rows_packed_weight::<bf16, bf16>(rows, dst.cast(), lhs.cast(), packed, accumulate)
            } else {
                debug_assert_eq!(T::DTYPE, DType::F32, "pack_weight packs bf16 and f32");
                let packed = packed.columns_from::<f32>(cols.start);
                gemm_rows_packed_weight::<f32, f32>(rows, dst.cast(), lhs.cast(), packed, accumulate)
            };
        }
        let (wp, ws) = (w.storage::<T>().unwrap().as_ptr(), w.layout().strides());
        let rhs = Mat { ptr: wp.add(w.layout().offset() + cols.start * ws[0]), rs: ws[1] as isize, cs: ws[0] as isize };
        gemm_rows(rows, cols.len(), d.k, dst, lhs, rhs, accumulate);
    }
}

/// `x`'s shape with its last dim `n`: the output's.
pub(crate) fn output_shape(cx: &OpCx, d: Dims) -> Vec<usize> {
    let mut shape = cx.input("x").shape().to_vec();
    *shape.last_mut().unwrap() = d.n;
    shape
}

/// The plan of `linear`, `linear_add` and their packed forms (step `name`; their third input:
/// `addend`).
pub(crate) fn plan(cx: &OpCx, d: Dims, addend: Addend, form: WeightForm, name: &'static str) -> Result<Plan> {
    // A packed weight leaves a row band nothing to pack.
    let packs = if form == WeightForm::Packed { 0 } else { d.n };
    let (bands, block_dim) = Bands::choose(cx.input("x").dtype, d, packs);
    let step = with_float_dtype!(cx.input("x").dtype, cx.op(), "x", |T| {
        Step::new(name, block_dim as u32, move |args, ctx| kernel::<T>(args, ctx, d, bands, addend, form))
    });
    let weight = if form == WeightForm::Packed { LayoutNeed::Contiguous } else { LayoutNeed::Any };
    Ok(Plan::new(vec![step])
        .inputs_need(vec![LayoutNeed::Contiguous, weight, LayoutNeed::Contiguous])
        .outputs_need(vec![LayoutNeed::Contiguous]))
}

/// f64 `x · weightᵀ` (`weight(j, p)`: output feature `j`, input feature `p`) plus `start(r, j)` at
/// each output `(r, j)`.
pub(crate) fn reference_rows(
    d: Dims,
    x: &RefTensor,
    weight: impl Fn(usize, usize) -> f64,
    start: impl Fn(usize, usize) -> f64,
) -> Vec<f64> {
    let mut y = vec![0.0; d.rows * d.n];
    for r in 0..d.rows {
        for j in 0..d.n {
            let dot: f64 = (0..d.k).map(|p| x.data[r * d.k + p] * weight(j, p)).sum();
            y[r * d.n + j] = dot + start(r, j);
        }
    }
    y
}

impl Op for Linear {
    fn schema(&self) -> &'static str {
        "linear(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor y"
    }

    fn doc(&self) -> &'static str {
        "y = x @ weight^T + bias, weight [out_features, in_features] (torch.nn.functional.linear / HF layout); x \
         [..., in_features]; bias optional [out_features]. bfloat16 via uniop's packed GEMM (AVX512-BF16, AMX \
         tiles, or FMAs on widened pairs; float32 sums); float32 via it too on AVX-512/AVX2 CPUs (64 rows or more, \
         in_features up to 2048), else via the gemm crate, as float16; few rows run as dot products."
    }

    fn leading_batch_args(&self) -> &'static [&'static str] {
        &["x"]
    }

    fn dtypes(&self) -> &'static [DType] {
        DTYPES
    }

    fn backward(&self) -> Option<&'static str> {
        Some("linear_backward")
    }

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
        plan(cx, dims(cx)?, Addend::Bias, WeightForm::Given, "linear")
    }

    fn reference(&self, cx: &OpCx, inputs: &[Option<RefTensor>]) -> Result<Vec<RefTensor>> {
        let d = dims(cx)?;
        let (x, w) = (inputs[0].as_ref().unwrap(), inputs[1].as_ref().unwrap());
        let y = reference_rows(d, x, |j, p| w.data[j * d.k + p], |_, j| inputs[2].as_ref().map_or(0.0, |b| b.data[j]));
        Ok(vec![RefTensor::new(&output_shape(cx, d), y)])
    }

    fn example(&self, shape: Option<&[usize]>, dtype: DType) -> Result<Example> {
        // `shape` is x's; weight maps in_features to 2·in_features (an MLP up projection), with bias.
        let shape = shape.unwrap_or(&[2048, 4096]);
        let k = shape.last().copied().unwrap_or(1);
        let x = if shape.is_empty() { vec![1] } else { shape.to_vec() };
        Ok(Example {
            inputs: vec![
                Some(TensorMeta::contiguous(dtype, &x)?),
                Some(TensorMeta::contiguous(dtype, &[2 * k, k])?),
                Some(TensorMeta::contiguous(dtype, &[2 * k])?),
            ],
            ..Default::default()
        })
    }
}
