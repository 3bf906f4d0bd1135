//! `cross_entropy(logits, target, ignore_index=-100, batch_dims=0) -> (loss, lse)`: mean negative
//! log-likelihood over the rows whose target is not `ignore_index` (torch's default `mean`
//! reduction; NaN when every row is ignored, as torch) — one mean per sample of the first
//! `batch_dims` dims of the logits (see [`per_sample`](crate::per_sample)), so `loss` has their
//! shape (a scalar by default). `lse` (per-row log-sum-exp, f32) is saved for the backward. Logits
//! `[..., C]` in f32/f16/bf16; targets int32/int64 of the leading shape.
//!
//! Deterministic: blocks write per-row losses, a second launch sums each sample's in row order.
//! A target outside `[0, C)` (and not `ignore_index`) fails the launch with a runtime error.

use crate::embedding::{checked_row, index_at, INDEX_DTYPES};
use crate::per_sample::Samples;
use crate::softmax::{exp_total, row_max};
use uniop::{
    block_dim_for, with_float_dtype, BlockCtx, DType, Element, Error, Example, FloatElement, KernelArgs, LayoutNeed,
    Op, OpCx, Plan, RefTensor, Result, Step, TensorMeta,
};

pub struct CrossEntropy;

pub(crate) const DTYPES: &[DType] = &[DType::F32, DType::F16, DType::BF16];

/// `[rows, classes]` view of the logits, checked against the targets.
#[derive(Clone, Copy)]
pub(crate) struct Rows {
    pub rows: usize,
    pub classes: usize,
    pub ignore: i64,
}

pub(crate) fn rows(cx: &OpCx) -> Result<Rows> {
    cx.expect_dtype_in("logits", DTYPES)?;
    cx.expect_dtype_in("target", INDEX_DTYPES)?;
    cx.expect_min_rank("logits", 1)?;
    let shape = cx.input("logits").shape();
    cx.expect_shape("target", &shape[..shape.len() - 1])?;
    Ok(Rows {
        rows: shape[..shape.len() - 1].iter().product(),
        classes: shape[shape.len() - 1],
        ignore: cx.int("ignore_index"),
    })
}

/// The target class of row `r`, or `None` when the row is ignored (refuses the launch when out
/// of range).
#[inline(always)]
pub(crate) fn target_of<I: Element>(
    op: &str,
    target: &uniop::TensorRef<'_>,
    ts: &[I],
    r: usize,
    g: Rows,
) -> Option<usize> {
    let t = index_at(target, ts, r);
    (t != g.ignore).then(|| checked_row(op, "target", t, r, g.classes))
}

/// Log-sum-exp of one row by softmax's exp pass (which prefetches `next`).
///
/// Its exps are [`math::exp_for`](crate::math::exp_for) the logits' type, as in the backward: for
/// f16/bf16 logits the coarse exp's 1e-5 relative error moves `lse` by about 1e-5, where the
/// logits' own rounding moves it by up to |x|·2⁻⁹ (bf16). The full exp is most of the pass's ops:
/// 2048 × 32000 bf16 logits on Zen 3 (AVX2), two threads, 24.4 → 18.0 ms with the coarse one.
#[inline(always)]
pub(crate) fn log_sum_exp<T: FloatElement>(row: &[T], next: &[T]) -> f32 {
    let m = row_max(row);
    m + exp_total(row, m, next).ln()
}

crate::simd_kernel! {
fn rows_kernel<T: FloatElement, I: Element>(args: &KernelArgs, ctx: BlockCtx, g: Rows) {
    let (logits, target) = (args.input(0), args.input(1));
    let xs = &logits.storage::<T>().expect("dtype dispatched")[logits.layout().offset()..];
    let ts = target.storage::<I>().expect("dtype dispatched");
    let lse_out = args.output(1);
    for r in ctx.split(g.rows) {
        let row = &xs[r * g.classes..(r + 1) * g.classes];
        let lse = log_sum_exp(row, xs.get((r + 1) * g.classes..(r + 2) * g.classes).unwrap_or_default());
        // Per-row loss (NaN marks an ignored row) goes to the workspace for the ordered sum.
        // SAFETY: this block owns rows `split(rows)` of lse and of the workspace.
        unsafe {
            *lse_out.as_mut_ptr::<f32>().add(lse_out.layout().offset() + r) = lse;
            args.workspace::<f32>(r, 1)[0] = match target_of("cross_entropy", &target, ts, r, g) {
                Some(t) => lse - row[t].to_f32(),
                None => f32::NAN,
            };
        }
    }
}
}

/// The mean losses of samples `split(samples)`, each over its `rows` per-row losses.
fn mean_kernel(args: &KernelArgs, ctx: BlockCtx, samples: usize, rows: usize) {
    let loss = args.output(0);
    for sample in ctx.split(samples) {
        // SAFETY: the row launch has finished; blocks of this one only read the workspace.
        let losses: &[f32] = unsafe { args.workspace::<f32>(sample * rows, rows) };
        let (sum, count) =
            losses.iter().filter(|l| !l.is_nan()).fold((0f64, 0usize), |(s, c), &l| (s + l as f64, c + 1));
        // SAFETY: this block owns the losses of samples `split(samples)`.
        unsafe { *loss.as_mut_ptr::<f32>().add(loss.layout().offset_of_linear(sample)) = (sum / count as f64) as f32 };
    }
}

/// How `batch_dims` divides the rows of the logits into samples.
pub(crate) fn samples(cx: &OpCx) -> Result<Samples> {
    Samples::of(cx, "logits", cx.input("logits").rank() - 1)
}

impl Op for CrossEntropy {
    fn schema(&self) -> &'static str {
        "cross_entropy(Tensor logits, Tensor target, int ignore_index=-100, int batch_dims=0) -> (Tensor loss, Tensor \
         lse)"
    }

    fn doc(&self) -> &'static str {
        "Mean cross-entropy of logits [..., C] against int targets [...], skipping targets equal to ignore_index \
         (torch.nn.functional.cross_entropy, reduction='mean'). Returns the float32 scalar loss and the per-row \
         float32 log-sum-exp for cross_entropy_backward. With batch_dims, one mean per sample: the loss is \
         logits.shape[:batch_dims]."
    }

    fn dtypes(&self) -> &'static [DType] {
        DTYPES
    }

    /// Row by row; the mean per sample with `batch_dims`.
    fn leading_batch_args(&self) -> &'static [&'static str] {
        &["logits", "target"]
    }

    fn backward(&self) -> Option<&'static str> {
        Some("cross_entropy_backward")
    }

    fn autocast(&self) -> uniop::Autocast {
        uniop::Autocast::Float32
    }

    fn infer(&self, cx: &OpCx) -> Result<Vec<TensorMeta>> {
        let (_, samples) = (rows(cx)?, samples(cx)?);
        let shape = cx.input("target").shape();
        Ok(vec![TensorMeta::contiguous(DType::F32, &samples.dims)?, TensorMeta::contiguous(DType::F32, shape)?])
    }

    fn plan(&self, cx: &OpCx) -> Result<Plan> {
        let g = rows(cx)?;
        let dtype = cx.input("logits").dtype;
        let block_dim = block_dim_for(g.rows, g.classes * dtype.size());
        let idx = cx.input("target").dtype;
        let row_step = with_float_dtype!(dtype, cx.op(), "logits", |T| match idx {
            DType::I32 => Step::new("cross_entropy.rows", block_dim, move |a, c| rows_kernel::<T, i32>(a, c, g)),
            _ => Step::new("cross_entropy.rows", block_dim, move |a, c| rows_kernel::<T, i64>(a, c, g)),
        });
        let samples = samples(cx)?;
        let (count, per_sample) = (samples.count, samples.rows);
        let mean_blocks = block_dim_for(count, 4 * per_sample);
        let mean_step = Step::new("cross_entropy.mean", mean_blocks, move |a, c| mean_kernel(a, c, count, per_sample));
        Ok(Plan::new(vec![row_step, mean_step])
            .workspace(4 * g.rows)
            .inputs_need(vec![LayoutNeed::Contiguous, LayoutNeed::Any])
            .outputs_need(vec![LayoutNeed::Any, LayoutNeed::Contiguous]))
    }

    fn reference(&self, cx: &OpCx, inputs: &[Option<RefTensor>]) -> Result<Vec<RefTensor>> {
        let (g, samples) = (rows(cx)?, samples(cx)?);
        let (x, t) = (inputs[0].as_ref().unwrap(), inputs[1].as_ref().unwrap());
        let (mut sum, mut count) = (vec![0.0; samples.count], vec![0usize; samples.count]);
        let mut lse = vec![0.0; g.rows];
        for r in 0..g.rows {
            let row = &x.data[r * g.classes..(r + 1) * g.classes];
            let m = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            lse[r] = m + row.iter().map(|v| (v - m).exp()).sum::<f64>().ln();
            if t.data[r] as i64 != g.ignore {
                let sample = r / samples.rows;
                sum[sample] += lse[r] - row[t.data[r] as usize];
                count[sample] += 1;
            }
        }
        let loss = sum.iter().zip(&count).map(|(s, &c)| s / c as f64).collect();
        Ok(vec![RefTensor::new(&samples.dims, loss), RefTensor::new(&t.shape, lse)])
    }

    fn example(&self, shape: Option<&[usize]>, dtype: DType) -> Result<Example> {
        // `shape` is the logits'; targets are drawn from [0, C).
        let (logits, classes) = example_logits(shape.unwrap_or(&[2048, 32000]))?;
        Ok(Example {
            inputs: vec![
                Some(TensorMeta::contiguous(dtype, &logits)?),
                Some(TensorMeta::contiguous(DType::I64, &logits[..logits.len() - 1])?),
            ],
            ranges: vec![None, Some((0.0, classes as f64))],
            ..Default::default()
        })
    }
}

/// An example's logits shape (`shape`; a scalar stands for one class) and class count. Refuses
/// rows without classes: no target can be drawn for them (every one would be out of range).
pub(crate) fn example_logits(shape: &[usize]) -> Result<(Vec<usize>, usize)> {
    let logits = if shape.is_empty() { vec![1] } else { shape.to_vec() };
    let (lead, classes) = (&logits[..logits.len() - 1], logits[logits.len() - 1]);
    if classes == 0 && !lead.contains(&0) {
        return Err(Error::invalid(format!(
            "cross_entropy example: logits of shape {logits:?} have rows but no class to draw their targets from"
        )));
    }
    Ok((logits, classes))
}
