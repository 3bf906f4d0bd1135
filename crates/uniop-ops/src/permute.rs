//! `permute(x, dims)`: a contiguous copy of `x` with its dims reordered — `x.permute(dims)
//! .contiguous()` in torch, aclnnPermute in CANN. The layout changes of attention, e.g. HF's
//! `[B, S, H, D]` projections to `[B, H, S, D]` for a kernel or a cache that wants heads outer.
//! With `batch_dims` the leading dims stay in place and `dims` orders the rest: how a batch of
//! calls (torch.func.vmap) is one call.
//!
//! The copy reads `x` through its strides reordered by `dims`, so any input layout is read in
//! place. Where the last dim stays last, rows are copied in tiles ([`uniop::RowTiles`]) so that
//! reads and writes both run in order; otherwise the output is walked in order.

use crate::per_sample::Samples;
use uniop::{
    BlockCtx, DType, ErrorCode, Example, KernelArgs, Layout, Op, OpCx, Plan, RefTensor, Result, RowTiles, Step,
    StridedRuns, TensorMeta,
};

pub struct Permute;

/// Every element type: the op only moves elements.
pub(crate) const DTYPES: &[DType] =
    &[DType::F32, DType::F16, DType::BF16, DType::F64, DType::I8, DType::I32, DType::I64, DType::U8, DType::Bool];

/// The full permutation of the dims of tensor argument `arg`: its first `batch_dims` dims in
/// place, then `dims` (negative counting from the end, non-negative from the first dim after the
/// batch) checked to be a permutation of the rest; with `inverse`, the permutation that undoes
/// it (the backward's).
fn order(cx: &OpCx, arg: &str, inverse: bool) -> Result<Vec<usize>> {
    let rank = cx.input(arg).rank();
    let given = match cx.attr("dims") {
        uniop::AttrValue::Ints(v) => v.clone(),
        other => unreachable!("schema types dims as int[], got {other}"),
    };
    let batch = Samples::of(cx, arg, rank)?.dims.len();
    let permuted = rank - batch;
    let mut seen = vec![false; permuted];
    let bad = || {
        let of = if batch == 0 { String::new() } else { format!(" after its {batch} batch dims") };
        cx.err(
            ErrorCode::ParamInvalid,
            "dims",
            format!(
                "a permutation of the {permuted} dims of {arg}{of} (each of 0..{permuted} once, negative counting \
                 from the end)"
            ),
            format!("{given:?}"),
        )
    };
    if given.len() != permuted {
        return Err(bad());
    }
    let mut forward: Vec<usize> = (0..batch).collect();
    for &d in &given {
        let d = if d < 0 { d + permuted as i64 } else { d };
        let d = usize::try_from(d).ok().filter(|&d| d < permuted && !seen[d]).ok_or_else(bad)?;
        seen[d] = true;
        forward.push(batch + d);
    }
    if !inverse {
        return Ok(forward);
    }
    let mut undo = vec![0; rank];
    for (i, &d) in forward.iter().enumerate() {
        undo[d] = i;
    }
    Ok(undo)
}

/// `layout` viewed with its dims in `order`.
fn permuted(layout: &Layout, order: &[usize]) -> Result<Layout> {
    let shape: Vec<usize> = order.iter().map(|&d| layout.shape()[d]).collect();
    let strides: Vec<usize> = order.iter().map(|&d| layout.strides()[d]).collect();
    Layout::strided(&shape, &strides, layout.offset())
}

fn kernel(args: &KernelArgs, ctx: BlockCtx, order: &[usize], elem_size: usize) {
    let (x, out) = (args.input(0), args.output(0));
    let source = permuted(x.layout(), order).expect("a permutation of a checked layout");
    if let Some(tiles) = RowTiles::new(out.layout(), &source, elem_size) {
        // SAFETY: both layouts were checked against their buffers; each block writes the rows
        // of its own tiles.
        unsafe { tiles.copy(out.as_mut_byte_ptr(), x.as_ptr(), elem_size, ctx.split(tiles.items())) };
        return;
    }
    let runs = StridedRuns::<2>::new([out.layout(), &source]);
    // SAFETY: as above; each block writes its own range of the output.
    unsafe { runs.copy(out.as_mut_byte_ptr(), x.as_ptr(), elem_size, ctx.split(out.meta().numel())) };
}

/// Output meta of a permute of tensor argument `arg` (`inverse`: by the inverse of `dims`).
pub(crate) fn infer(cx: &OpCx, arg: &str, inverse: bool) -> Result<Vec<TensorMeta>> {
    let x = cx.input(arg);
    let dtype = cx.expect_dtype_in(arg, DTYPES)?;
    let shape: Vec<usize> = order(cx, arg, inverse)?.iter().map(|&d| x.shape()[d]).collect();
    Ok(vec![TensorMeta::contiguous(dtype, &shape)?])
}

pub(crate) fn plan(cx: &OpCx, arg: &str, inverse: bool) -> Result<Plan> {
    let order = order(cx, arg, inverse)?;
    let x = cx.input(arg);
    let elem_size = x.dtype.size();
    let block_dim = uniop::block_dim_for(x.numel(), 2 * elem_size);
    let step = Step::new("permute", block_dim, move |a, c| kernel(a, c, &order, elem_size));
    Ok(Plan::new(vec![step]).outputs_need(vec![uniop::LayoutNeed::Contiguous]))
}

pub(crate) fn reference(cx: &OpCx, arg: &str, inverse: bool, inputs: &[Option<RefTensor>]) -> Result<Vec<RefTensor>> {
    let order = order(cx, arg, inverse)?;
    let x = inputs[0].as_ref().expect("the tensor is required");
    let source = permuted(&Layout::contiguous(&x.shape)?, &order)?;
    let data = (0..x.data.len()).map(|i| x.data[source.offset_of_linear(i)]).collect();
    Ok(vec![RefTensor::new(source.shape(), data)])
}

/// HF's [B, S, H, D] projection to [B, H, S, D] by default; for other ranks, the last two dims
/// swapped (counted from the end), or the identity for vectors.
pub(crate) fn example(shape: Option<&[usize]>, dtype: DType) -> Result<Example> {
    let shape = shape.unwrap_or(&[1, 2048, 32, 128]);
    let rank = shape.len() as i64;
    let dims: Vec<i64> = match rank {
        4 => vec![0, 2, 1, 3],
        r if r >= 2 => (0..r - 2).chain([-1, -2]).collect(),
        r => (0..r).collect(),
    };
    Ok(Example {
        inputs: vec![Some(TensorMeta::contiguous(dtype, shape)?)],
        attrs: vec![("dims".into(), uniop::AttrValue::Ints(dims))],
        ..Default::default()
    })
}

impl Op for Permute {
    fn schema(&self) -> &'static str {
        "permute(Tensor x, int[] dims, int batch_dims=0) -> Tensor out"
    }

    fn doc(&self) -> &'static str {
        "A contiguous copy of x with its dims reordered: out.shape[i] = x.shape[dims[i]] (torch's \
         x.permute(dims).contiguous()). dims is a permutation of x's dims; negative values count from the end. \
         With batch_dims, x's first batch_dims dims stay in place and dims permutes the others (its non-negative \
         values counted from the first of them). x may have any strides. Any dtype."
    }

    fn dtypes(&self) -> &'static [DType] {
        DTYPES
    }

    fn backward(&self) -> Option<&'static str> {
        Some("permute_backward")
    }

    /// Each batch dim of x moves nowhere: a batch is one more of them.
    fn leading_batch_args(&self) -> &'static [&'static str] {
        &["x"]
    }

    fn infer(&self, cx: &OpCx) -> Result<Vec<TensorMeta>> {
        infer(cx, "x", false)
    }

    fn plan(&self, cx: &OpCx) -> Result<Plan> {
        plan(cx, "x", false)
    }

    fn reference(&self, cx: &OpCx, inputs: &[Option<RefTensor>]) -> Result<Vec<RefTensor>> {
        reference(cx, "x", false, inputs)
    }

    fn example(&self, shape: Option<&[usize]>, dtype: DType) -> Result<Example> {
        example(shape, dtype)
    }
}
