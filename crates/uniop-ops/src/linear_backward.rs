//! `linear_backward(dy, x, weight, batch_dims=0, needs_dx=True, needs_dweight=True) -> (dx,
//! dweight, dbias)`, the gradient of [`linear`](crate::linear): `dx = dy · weight`, `dweight = dyᵀ · x`, `dbias =
//! Σ_rows dy` — the last two per sample of the first `batch_dims` dims of x (see
//! [`per_sample`](crate::per_sample)).
//!
//! Two launches, each block owning a band of an output (no atomics, deterministic): rows of `dx`
//! (or, for f32 and bf16 with few rows, its columns: `split_columns`), then rows of one sample's
//! `dweight` together with the matching entries of its `dbias`. Transposes are strides. A
//! gradient nobody asked for is left out and comes back empty, as torch's autograd leaves it out:
//! dx when x needs none (`needs_dx` false: a network's first projection of its data, per-sample
//! gradients of the weights alone); dweight when the weight is frozen (`needs_dweight` false:
//! LoRA's base weights, gradients with respect to inputs). Each is one of the two products, half
//! of the work (the bias sum is a pass over dy).

use crate::linear::{x_and_weight, Dims, COLUMN_UNIT};
use crate::matmul::{column_band, gemm_rows, Dst, Mat, DTYPES};
use crate::packed_gemm::split_columns;
use crate::per_sample::{SampleBlocks, Samples};
use uniop::{
    with_float_dtype, BlockCtx, DType, Element, Example, FloatElement, KernelArgs, LayoutNeed, Op, OpCx, Plan,
    RefTensor, Result, Step, TensorMeta,
};

pub struct LinearBackward;

pub(crate) fn dims(cx: &OpCx) -> Result<Dims> {
    let d = x_and_weight(cx, "weight")?;
    cx.expect_same_dtype("dy", cx.input("x").dtype, "x")?;
    let mut y = cx.input("x").shape().to_vec();
    *y.last_mut().unwrap() = d.n;
    cx.expect_shape("dy", &y)?;
    Ok(d)
}

/// Step 1: `dx = dy · weight` (`[rows, n] · [n, k]`), each block a band of rows or, where
/// [`split_columns`] says so, a band of columns (then it packs only its share of the weight).
fn dx_kernel<T: Element>(args: &KernelArgs, ctx: BlockCtx, d: Dims, columns: bool) {
    let (dy, w, dx) = (args.input(0), args.input(2), args.output(0));
    let (rows, cols) =
        if columns { (0..d.rows, column_band(ctx, d.k, COLUMN_UNIT)) } else { (ctx.split(d.rows), 0..d.k) };
    // SAFETY: all operands contiguous (plan); this block owns dx rows `rows` × columns `cols`.
    unsafe {
        let w = w.storage::<T>().unwrap().as_ptr().add(w.layout().offset() + cols.start);
        gemm_rows(
            rows,
            cols.len(),
            d.n,
            Dst { ptr: dx.as_mut_ptr::<T>().add(dx.layout().offset() + cols.start), rs: d.k as isize, cs: 1 },
            Mat { ptr: dy.storage::<T>().unwrap().as_ptr().add(dy.layout().offset()), rs: d.n as isize, cs: 1 },
            Mat { ptr: w, rs: d.k as isize, cs: 1 },
            false,
        );
    }
}

/// The backward's third return: `linear`'s `dbias` (`dy` summed over rows), or `linear_add`'s
/// `dresidual` (`dy` itself).
#[derive(Clone, Copy)]
pub(crate) enum Third {
    BiasSum,
    ResidualCopy,
}

/// Step 2: rows of one sample's `dweight = dyᵀ · x` (`[n, rows] · [rows, k]`), unless the call
/// asks for none, and the same columns of its third return.
fn dw_kernel<T: FloatElement>(
    args: &KernelArgs,
    ctx: BlockCtx,
    d: Dims,
    third: Third,
    samples: SampleBlocks,
    dweight: bool,
) {
    if samples.count == 0 {
        return; // the returns are empty
    }
    let (dy, x) = (args.input(0), args.input(1));
    let (dw, db) = (args.output(1), args.output(2));
    let (sample, place) = ctx.within(samples.count);
    let (first, rows) = (sample * samples.rows, samples.rows);
    let dys = &dy.storage::<T>().unwrap()[dy.layout().offset() + first * d.n..];
    let xs = &x.storage::<T>().unwrap()[x.layout().offset() + first * d.k..];
    let owned = place.split(d.n);
    // SAFETY: as above; this block owns rows `owned` of the sample's dweight and the third return's
    // entries (dbias) or columns of the sample's rows (dresidual) `owned`.
    unsafe {
        if dweight {
            gemm_rows(
                owned.clone(),
                d.k,
                rows,
                Dst {
                    ptr: dw.as_mut_ptr::<T>().add(dw.layout().offset() + sample * d.n * d.k),
                    rs: d.k as isize,
                    cs: 1,
                },
                Mat { ptr: dys.as_ptr(), rs: 1, cs: d.n as isize },
                Mat { ptr: xs.as_ptr(), rs: d.k as isize, cs: 1 },
                false,
            );
        }
        if let Third::ResidualCopy = third {
            for r in 0..rows {
                let row = &dys[r * d.n + owned.start..r * d.n + owned.end];
                let at = db.layout().offset() + (first + r) * d.n + owned.start;
                db.slice_mut::<T>(at, owned.len()).copy_from_slice(row);
            }
            return;
        }
        // Row by row (contiguous reads), each column's sum still in row order.
        let mut sums = vec![0f32; owned.len()];
        for r in 0..rows {
            for (s, v) in sums.iter_mut().zip(&dys[r * d.n + owned.start..r * d.n + owned.end]) {
                *s += v.to_f32();
            }
        }
        let bias = db.slice_mut::<T>(db.layout().offset() + sample * d.n + owned.start, owned.len());
        for (out, s) in bias.iter_mut().zip(sums) {
            *out = T::from_f32(s);
        }
    }
}

impl Op for LinearBackward {
    fn schema(&self) -> &'static str {
        "linear_backward(Tensor dy, Tensor x, Tensor weight, int batch_dims=0, bool needs_dx=True, bool \
         needs_dweight=True) -> (Tensor dx, Tensor dweight, Tensor dbias)"
    }

    fn doc(&self) -> &'static str {
        "Gradients of linear: dx = dy @ weight, dweight = dy^T @ x (summed over all leading dims of x), \
         dbias = dy summed over rows (ignore it when the layer has no bias). With batch_dims, dweight and dbias \
         are per sample: x.shape[:batch_dims] + their shape. needs_dx=False leaves dx out (returned empty, [0]), \
         needs_dweight=False dweight (a frozen weight): each half of the work."
    }

    /// Row by row; the parameter gradients per sample with `batch_dims`.
    fn leading_batch_args(&self) -> &'static [&'static str] {
        &["dy", "x"]
    }

    fn dtypes(&self) -> &'static [DType] {
        DTYPES
    }

    fn error_scale(&self, cx: &OpCx) -> f64 {
        dims(cx).map_or(1.0, |d| (d.rows.max(d.n).max(1) as f64).sqrt())
    }

    fn infer(&self, cx: &OpCx) -> Result<Vec<TensorMeta>> {
        let (d, samples) = (dims(cx)?, samples(cx)?);
        let dtype = cx.input("x").dtype;
        Ok(vec![
            TensorMeta::contiguous(dtype, &dx_shape(cx))?,
            TensorMeta::contiguous(dtype, &dweight_shape(cx, &samples, d))?,
            TensorMeta::contiguous(dtype, &samples.shape(&[d.n]))?,
        ])
    }

    fn plan(&self, cx: &OpCx) -> Result<Plan> {
        plan(cx, dims(cx)?, Third::BiasSum, ["linear_backward.dx", "linear_backward.dweight"])
    }

    fn reference(&self, cx: &OpCx, inputs: &[Option<RefTensor>]) -> Result<Vec<RefTensor>> {
        let (d, samples) = (dims(cx)?, samples(cx)?);
        let (dx, dw) = reference(d, &samples, needs(cx), inputs);
        let dy = &inputs[0].as_ref().unwrap().data;
        let mut db = vec![0.0; samples.count * d.n];
        for r in 0..d.rows {
            let sample = r / samples.rows.max(1);
            for j in 0..d.n {
                db[sample * d.n + j] += dy[r * d.n + j];
            }
        }
        Ok(vec![
            RefTensor::new(&dx_shape(cx), dx),
            RefTensor::new(&dweight_shape(cx, &samples, d), dw),
            RefTensor::new(&samples.shape(&[d.n]), db),
        ])
    }

    /// x's shape, as for linear (the first input is the gradient of the `[.., 2k]` output).
    fn example_shape(&self, example: &Example) -> Vec<usize> {
        example.input_shape(1)
    }

    fn example(&self, shape: Option<&[usize]>, dtype: DType) -> Result<Example> {
        // `shape` is x's, as for linear (weight [2k, k]).
        example(shape, dtype, 2)
    }
}

/// Which of dx and dweight the call asks for (`needs_dx`, `needs_dweight`).
#[derive(Clone, Copy)]
pub(crate) struct Needs {
    pub dx: bool,
    pub dweight: bool,
}

pub(crate) fn needs(cx: &OpCx) -> Needs {
    Needs { dx: cx.needs_grad("x"), dweight: cx.needs_grad("weight") }
}

/// dx's shape: x's, or `[0]` when the call asks for none.
pub(crate) fn dx_shape(cx: &OpCx) -> Vec<usize> {
    cx.grad_shape("x", cx.input("x").shape())
}

/// dweight's shape: one weight per sample, or `[0]` when the call asks for none.
pub(crate) fn dweight_shape(cx: &OpCx, samples: &Samples, d: Dims) -> Vec<usize> {
    cx.grad_shape("weight", &samples.shape(&[d.n, d.k]))
}

/// How `batch_dims` divides the rows of `x` into samples.
pub(crate) fn samples(cx: &OpCx) -> Result<Samples> {
    Samples::of(cx, "x", cx.input("x").rank() - 1)
}

/// The plan of `linear_backward` and `linear_add_backward` (steps `names`).
pub(crate) fn plan(cx: &OpCx, d: Dims, third: Third, names: [&'static str; 2]) -> Result<Plan> {
    let threads = uniop::runtime::Pool::global().threads();
    let columns = split_columns(cx.input("x").dtype, d.rows, d.k, threads);
    let dx_blocks =
        if columns { d.k.div_ceil(COLUMN_UNIT).clamp(1, threads) } else { d.rows.div_ceil(16).clamp(1, threads) };
    let sb = samples(cx)?.blocks(cx, "x", d.n.div_ceil(16).clamp(1, threads) as u32)?;
    let needs = needs(cx);
    let steps = with_float_dtype!(cx.input("x").dtype, cx.op(), "x", |T| {
        let dx = needs.dx.then(|| Step::new(names[0], dx_blocks as u32, move |a, c| dx_kernel::<T>(a, c, d, columns)));
        let dw = Step::new(names[1], sb.total, move |a, c| dw_kernel::<T>(a, c, d, third, sb, needs.dweight));
        dx.into_iter().chain([dw]).collect()
    });
    Ok(Plan::new(steps).inputs_need(vec![LayoutNeed::Contiguous; 3]).outputs_need(vec![LayoutNeed::Contiguous; 3]))
}

/// f64 `(dx, dweight)` of `dy`, `x`, `weight` (inputs 0–2), dweight per sample (each empty unless
/// the call `needs` it).
pub(crate) fn reference(
    d: Dims,
    samples: &Samples,
    needs: Needs,
    inputs: &[Option<RefTensor>],
) -> (Vec<f64>, Vec<f64>) {
    let [dy, x, w] = [0, 1, 2].map(|i| inputs[i].as_ref().unwrap());
    // Sized only when asked for: a frozen weight's per-sample gradient may not fit in memory.
    let mut dx = vec![0.0; if needs.dx { d.rows * d.k } else { 0 }];
    let mut dw = vec![0.0; if needs.dweight { samples.count * d.n * d.k } else { 0 }];
    for r in 0..d.rows {
        let sample = r / samples.rows.max(1);
        for j in 0..d.n {
            let g = dy.data[r * d.n + j];
            if needs.dx {
                for p in 0..d.k {
                    dx[r * d.k + p] += g * w.data[j * d.k + p];
                }
            }
            if needs.dweight {
                for p in 0..d.k {
                    dw[(sample * d.n + j) * d.k + p] += g * x.data[r * d.k + p];
                }
            }
        }
    }
    (dx, dw)
}

/// `dy`, `x`, `weight` for x of `shape` (or the default) and a weight `[out · k, k]`.
pub(crate) fn example(shape: Option<&[usize]>, dtype: DType, out: usize) -> Result<Example> {
    let shape = shape.unwrap_or(&[2048, 4096]);
    let k = shape.last().copied().unwrap_or(1);
    let x = if shape.is_empty() { vec![1] } else { shape.to_vec() };
    let mut y = x.clone();
    *y.last_mut().unwrap() = out * k;
    Ok(Example {
        inputs: vec![
            Some(TensorMeta::contiguous(dtype, &y)?),
            Some(TensorMeta::contiguous(dtype, &x)?),
            Some(TensorMeta::contiguous(dtype, &[out * k, k])?),
        ],
        ..Default::default()
    })
}
