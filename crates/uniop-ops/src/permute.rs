//! `permute(x, dims)`: a contiguous copy of `x` with its dims reordered — `x.permute(dims)
//! .contiguous()` in torch, aclnnPermute in CANN. The layout changes of attention, e.g. HF's
//! `[B, S, H, D]` projections to `[B, H, S, D]` for a kernel or a cache that wants heads outer.
//!
//! The copy walks the output in order and reads `x` through its strides reordered by `dims`, so
//! any input layout is read in place and every block writes one contiguous range.

use uniop::{
    BlockCtx, DType, ErrorCode, Example, KernelArgs, Layout, Op, OpCx, Plan, RefTensor, Result, Step, StridedRuns,
    TensorMeta,
};

pub struct Permute;

/// Every element type: the op only moves elements.
const DTYPES: &[DType] =
    &[DType::F32, DType::F16, DType::BF16, DType::F64, DType::I8, DType::I32, DType::I64, DType::U8, DType::Bool];

/// `dims` normalized (negative counts from the end) and checked to be a permutation of `x`'s dims.
fn order(cx: &OpCx) -> Result<Vec<usize>> {
    let rank = cx.input("x").rank();
    let given = match cx.attr("dims") {
        uniop::AttrValue::Ints(v) => v.clone(),
        other => unreachable!("schema types dims as int[], got {other}"),
    };
    let mut seen = vec![false; rank];
    let bad = || {
        cx.err(
            ErrorCode::ParamInvalid,
            "dims",
            format!("a permutation of the {rank} dims of x (each of 0..{rank} once, negative counting from the end)"),
            format!("{given:?}"),
        )
    };
    if given.len() != rank {
        return Err(bad());
    }
    given
        .iter()
        .map(|&d| {
            let d = if d < 0 { d + rank as i64 } else { d };
            let d = usize::try_from(d).ok().filter(|&d| d < rank && !seen[d]).ok_or_else(bad)?;
            seen[d] = true;
            Ok(d)
        })
        .collect()
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
    let runs = StridedRuns::<2>::new([out.layout(), &source]);
    // SAFETY: both layouts were checked against their buffers; each block writes its own range
    // of the output.
    unsafe { runs.copy(out.as_mut_byte_ptr(), x.as_ptr(), elem_size, ctx.split(out.meta().numel())) };
}

impl Op for Permute {
    fn schema(&self) -> &'static str {
        "permute(Tensor x, int[] dims) -> Tensor out"
    }

    fn doc(&self) -> &'static str {
        "A contiguous copy of x with its dims reordered: out.shape[i] = x.shape[dims[i]] (torch's \
         x.permute(dims).contiguous()). dims is a permutation of x's dims; negative values count from the end. \
         x may have any strides. Any dtype."
    }

    fn dtypes(&self) -> &'static [DType] {
        DTYPES
    }

    fn infer(&self, cx: &OpCx) -> Result<Vec<TensorMeta>> {
        let x = cx.input("x");
        let dtype = cx.expect_dtype_in("x", DTYPES)?;
        let shape: Vec<usize> = order(cx)?.iter().map(|&d| x.shape()[d]).collect();
        Ok(vec![TensorMeta::contiguous(dtype, &shape)?])
    }

    fn plan(&self, cx: &OpCx) -> Result<Plan> {
        let order = order(cx)?;
        let x = cx.input("x");
        let elem_size = x.dtype.size();
        let block_dim = uniop::block_dim_for(x.numel(), 2 * elem_size);
        let step = Step::new("permute", block_dim, move |a, c| kernel(a, c, &order, elem_size));
        Ok(Plan::new(vec![step]).outputs_need(vec![uniop::LayoutNeed::Contiguous]))
    }

    fn reference(&self, cx: &OpCx, inputs: &[Option<RefTensor>]) -> Result<Vec<RefTensor>> {
        let order = order(cx)?;
        let x = inputs[0].as_ref().expect("x is required");
        let source = permuted(&Layout::contiguous(&x.shape)?, &order)?;
        let data = (0..x.data.len()).map(|i| x.data[source.offset_of_linear(i)]).collect();
        Ok(vec![RefTensor::new(source.shape(), data)])
    }

    fn example(&self, shape: Option<&[usize]>, dtype: DType) -> Result<Example> {
        // HF's [B, S, H, D] projection to [B, H, S, D] by default; for other ranks, the last two
        // dims swapped (counted from the end), or the identity for vectors.
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
}
