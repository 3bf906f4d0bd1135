//! `argmax(x, dim=-1, keepdim=False)`: int64 index of the largest element along `dim` — the
//! first one on ties, and the first NaN if any (NaN counts as the maximum, as in torch).

use crate::elementwise::{self, LANES};
use crate::softmax::Axis;
use uniop::layout::ShapeDisplay;
use uniop::{
    block_dim_for, with_float_dtype, AttrValue, BlockCtx, DType, ErrorCode, Example, FloatElement, KernelArgs,
    LayoutNeed, Op, OpCx, Plan, RefTensor, Result, Step, TensorMeta,
};

pub struct Argmax;

const DTYPES: &[DType] = &[DType::F32, DType::F16, DType::BF16];

/// Whether `v` at a later position replaces the current best `best`.
#[inline(always)]
pub(crate) fn beats(v: f64, best: f64) -> bool {
    v > best || (v.is_nan() && !best.is_nan())
}

/// Index of the first maximum of `values` (NaN first).
pub(crate) fn first_max(values: impl Iterator<Item = f64>) -> usize {
    let mut best = (0, f64::NEG_INFINITY);
    for (k, v) in values.enumerate() {
        if k == 0 || beats(v, best.1) {
            best = (k, v);
        }
    }
    best.0
}

fn axis(cx: &OpCx) -> Result<Axis> {
    cx.expect_dtype_in("x", DTYPES)?;
    let axis = Axis::of(cx, "x")?;
    if axis.n == 0 && cx.input("x").rank() > 0 {
        return Err(cx.err(
            ErrorCode::Shape,
            "x",
            "a non-empty dim to reduce",
            format!("shape {} reduced along dim {}", ShapeDisplay(cx.input("x").shape()), cx.int("dim")),
        ));
    }
    Ok(axis)
}

fn out_shape(cx: &OpCx) -> Vec<usize> {
    let shape = cx.input("x").shape();
    if shape.is_empty() {
        return vec![];
    }
    let d = cx.int("dim").rem_euclid(shape.len() as i64) as usize;
    let keep = matches!(cx.attr("keepdim"), AttrValue::Bool(true));
    let mut out = shape.to_vec();
    if keep {
        out[d] = 1;
    } else {
        out.remove(d);
    }
    out
}

/// [`first_max`] of a contiguous row, in two vectorized passes: the maximum (and whether a NaN
/// occurs), then the first position holding it — by then the row is in cache. A running
/// (index, value) pair carries a branch per element and ran at half of torch's speed on
/// vocabulary-sized rows.
#[inline(always)]
fn row_first_max<T: FloatElement>(row: &[T]) -> usize {
    let (mut max, mut nan) = ([f32::NEG_INFINITY; LANES], [false; LANES]);
    elementwise::for_lanes([row], f32::NEG_INFINITY, |[v]| {
        for j in 0..LANES {
            max[j] = if v[j] > max[j] { v[j] } else { max[j] };
            nan[j] |= v[j].is_nan();
        }
    });
    let target = max.iter().fold(f32::NEG_INFINITY, |m, &v| if v > m { v } else { m });
    // A NaN counts as the maximum: then the first NaN wins.
    let any_nan = nan.contains(&true);
    let hit = |v: f32| if any_nan { v.is_nan() } else { v == target };
    let mut buf = [0f32; LANES];
    for (c, chunk) in row.chunks(LANES).enumerate() {
        let lanes = &mut buf[..chunk.len()];
        T::widen(chunk, lanes);
        if lanes.iter().fold(false, |any, &v| any | hit(v)) {
            return c * LANES + lanes.iter().position(|&v| hit(v)).expect("a lane matched");
        }
    }
    0
}

crate::simd_kernel! {
fn kernel<T: FloatElement>(args: &KernelArgs, ctx: BlockCtx, axis: Axis) {
    let (x, out) = (args.input(0), args.output(0));
    let xs = &x.storage::<T>().expect("dtype dispatched")[x.layout().offset()..];
    let range = ctx.split(axis.slices());
    // SAFETY: this block owns output elements `range` (one per slice).
    let dst = unsafe { out.slice_mut::<i64>(out.layout().offset() + range.start, range.len()) };
    for (s, o) in range.zip(dst) {
        *o = if axis.inner == 1 {
            row_first_max(&xs[s * axis.n..][..axis.n])
        } else {
            first_max((0..axis.n).map(|k| xs[axis.index(s, k)].to_f32() as f64))
        } as i64;
    }
}
}

impl Op for Argmax {
    fn schema(&self) -> &'static str {
        "argmax(Tensor x, int dim=-1, bool keepdim=False) -> Tensor indices"
    }

    fn doc(&self) -> &'static str {
        "int64 index of the maximum along dim (first on ties; a NaN counts as the maximum), as torch.argmax with \
         a dim. keepdim keeps the reduced dim as size 1."
    }

    fn leading_batch_args(&self) -> &'static [&'static str] {
        &["x"]
    }

    fn dtypes(&self) -> &'static [DType] {
        DTYPES
    }

    fn infer(&self, cx: &OpCx) -> Result<Vec<TensorMeta>> {
        axis(cx)?;
        Ok(vec![TensorMeta::contiguous(DType::I64, &out_shape(cx))?])
    }

    fn plan(&self, cx: &OpCx) -> Result<Plan> {
        let axis = axis(cx)?;
        let x = cx.input("x");
        let block_dim = block_dim_for(axis.slices(), axis.n.max(1) * x.dtype.size());
        let step = with_float_dtype!(x.dtype, cx.op(), "x", |T| {
            Step::new("argmax", block_dim, move |args, ctx| kernel::<T>(args, ctx, axis))
        });
        Ok(Plan::new(vec![step]).inputs_need(vec![LayoutNeed::Contiguous]).outputs_need(vec![LayoutNeed::Contiguous]))
    }

    fn reference(&self, cx: &OpCx, inputs: &[Option<RefTensor>]) -> Result<Vec<RefTensor>> {
        let (x, axis) = (inputs[0].as_ref().unwrap(), axis(cx)?);
        let idx = (0..axis.slices()).map(|s| first_max((0..axis.n).map(|k| x.data[axis.index(s, k)])) as f64).collect();
        Ok(vec![RefTensor::new(&out_shape(cx), idx)])
    }

    fn example(&self, shape: Option<&[usize]>, dtype: DType) -> Result<Example> {
        // Greedy decoding: a batch of rows over LLaMA's vocabulary.
        let meta = TensorMeta::contiguous(dtype, shape.unwrap_or(&[64, 32000]))?;
        Ok(Example { inputs: vec![Some(meta)], ..Default::default() })
    }
}
