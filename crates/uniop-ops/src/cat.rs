//! `cat(tensors, dim)`: joins tensors along one dimension (torch.cat / aclnnCat) — e.g. a past
//! KV block and the new rows of a step, or the heads of a split projection.
//!
//! Each input is an elementwise strided copy into its own region of the output: the output's
//! layout restricted to the input's shape, shifted to the input's start along `dim`. Every block
//! takes the same share of every input, so a short input and a long one cost the same to split,
//! and inputs of any strides are read in place (no staging copy).

use uniop::layout::ShapeDisplay;
use uniop::{
    BlockCtx, DType, Error, ErrorCode, Example, KernelArgs, Layout, Op, OpCx, Plan, RefTensor, Result, Step,
    StridedRuns, TensorMeta,
};

pub struct Cat;

/// Every element type: the op only moves elements.
pub(crate) const DTYPES: &[DType] =
    &[DType::F32, DType::F16, DType::BF16, DType::F64, DType::I8, DType::I32, DType::I64, DType::U8, DType::Bool];

/// The validated call: the output meta, the normalized dim, and each input's start along it.
pub(crate) struct Joined {
    pub out: TensorMeta,
    pub dim: usize,
    pub starts: Vec<usize>,
}

/// Checks `cx`'s `tensors` and `dim` (cat's arguments, which cat_backward takes too).
pub(crate) fn join(cx: &OpCx) -> Result<Joined> {
    let tensors = cx.input_list("tensors");
    let first = *tensors
        .first()
        .ok_or_else(|| cx.err(ErrorCode::ParamInvalid, "tensors", "at least one tensor", "an empty list"))?;
    let dtype = cx.expect_dtype_in("tensors", DTYPES)?;
    let rank = first.rank();
    let given = cx.int("dim");
    let dim = wrap_dim(given, rank).ok_or_else(|| {
        cx.err(
            ErrorCode::ParamInvalid,
            "dim",
            format!("a dim in [{}, {rank}) for rank-{rank} tensors", -(rank as i64)),
            given,
        )
    })?;
    let mut shape = first.shape().to_vec();
    let mut starts = Vec::with_capacity(tensors.len());
    let mut along = 0usize;
    for (i, t) in tensors.iter().enumerate() {
        let arg = format!("tensors[{i}]");
        if t.dtype != dtype {
            return Err(cx.err(ErrorCode::DType, &arg, format!("dtype {dtype} (as tensors[0])"), t.dtype));
        }
        let matches = t.rank() == rank && (0..rank).all(|d| d == dim || t.shape()[d] == shape[d]);
        if !matches {
            return Err(cx.err(
                ErrorCode::Shape,
                &arg,
                format!("the shape of tensors[0] {} except along dim {dim}", ShapeDisplay(first.shape())),
                format!("shape {}", ShapeDisplay(t.shape())),
            ));
        }
        starts.push(along);
        along = along.checked_add(t.shape()[dim]).ok_or_else(|| {
            Error::new(ErrorCode::Shape, format!("{}: the joined size along dim {dim} overflows", cx.op()))
        })?;
    }
    shape[dim] = along;
    Ok(Joined { out: TensorMeta::contiguous(dtype, &shape)?, dim, starts })
}

/// torch's dim wrapping: `-rank..rank` (a rank-0 tensor takes dim 0 or -1 and cannot be joined).
fn wrap_dim(dim: i64, rank: usize) -> Option<usize> {
    let r = rank as i64;
    let d = if dim < 0 { dim + r } else { dim };
    (0..r).contains(&d).then_some(d as usize)
}

/// Where a part of `shape` starting at `start` along `dim` lies in `whole`: the whole's strides,
/// shifted to `start` (the whole's own offset is added at launch, where the tensor may have been
/// rebound at another offset).
pub(crate) fn region(whole: &TensorMeta, shape: &[usize], dim: usize, start: usize) -> Result<Layout> {
    let strides = whole.layout.strides();
    Layout::strided(shape, strides, start * strides[dim])
}

fn kernel(args: &KernelArgs, ctx: BlockCtx, regions: &[Layout], elem_size: usize) {
    let out = args.output(0);
    // SAFETY: regions are disjoint parts of the checked output view, and each block writes its
    // own share of each region.
    let dst = unsafe { out.as_mut_byte_ptr().add(out.layout().offset() * elem_size) };
    for (i, region) in regions.iter().enumerate() {
        let src = args.input(i);
        let runs = StridedRuns::<2>::new([region, src.layout()]);
        // SAFETY: as above; the source layout was checked against its buffer.
        unsafe { runs.copy(dst, src.as_ptr(), elem_size, ctx.split(region.numel())) };
    }
}

impl Op for Cat {
    fn schema(&self) -> &'static str {
        "cat(Tensor[] tensors, int dim=0) -> Tensor out"
    }

    fn doc(&self) -> &'static str {
        "Joins tensors along dim (negative counts from the end), as torch.cat: at least one tensor, all of one \
         dtype and rank, equal sizes in every other dim; inputs may have any strides. Any dtype."
    }

    fn dtypes(&self) -> &'static [DType] {
        DTYPES
    }

    fn backward(&self) -> Option<&'static str> {
        Some("cat_backward")
    }

    fn leading_batch_args(&self) -> &'static [&'static str] {
        &["tensors"]
    }

    fn infer(&self, cx: &OpCx) -> Result<Vec<TensorMeta>> {
        Ok(vec![join(cx)?.out])
    }

    fn plan(&self, cx: &OpCx) -> Result<Plan> {
        let Joined { out, dim, starts } = join(cx)?;
        let regions = cx
            .input_list("tensors")
            .iter()
            .zip(&starts)
            .map(|(t, &start)| region(&out, t.shape(), dim, start))
            .collect::<Result<Vec<_>>>()?;
        let elem_size = out.dtype.size();
        let block_dim = uniop::block_dim_for(out.numel(), 2 * elem_size);
        let step = Step::new("cat", block_dim, move |a, c| kernel(a, c, &regions, elem_size));
        Ok(Plan::new(vec![step]).outputs_need(vec![uniop::LayoutNeed::Contiguous]))
    }

    fn reference(&self, cx: &OpCx, inputs: &[Option<RefTensor>]) -> Result<Vec<RefTensor>> {
        let Joined { out, dim, .. } = join(cx)?;
        // Row-major: each input contributes, per index of the dims before `dim`, one slab of
        // (its size along dim) × (the product of the dims after it) elements.
        let outer: usize = out.shape()[..dim].iter().product();
        let mut data = Vec::with_capacity(out.numel());
        for r in 0..outer {
            for t in inputs.iter().flatten() {
                let slab: usize = t.shape[dim..].iter().product();
                data.extend_from_slice(&t.data[r * slab..(r + 1) * slab]);
            }
        }
        Ok(vec![RefTensor::new(out.shape(), data)])
    }

    fn example(&self, shape: Option<&[usize]>, dtype: DType) -> Result<Example> {
        example(shape, dtype)
    }
}

/// A KV-cache step: the past (`shape`, default 1 batch × 8 heads × 1024 positions × 128) joined
/// with a shorter block and one new position along the sequence dim (the second to last; dim 0
/// for vectors); cat_backward's example splits the gradient of that join.
pub(crate) fn example(shape: Option<&[usize]>, dtype: DType) -> Result<Example> {
    let past = shape.unwrap_or(&[1, 8, 1024, 128]).to_vec();
    let dim = past.len().saturating_sub(2);
    let with_len = |n: usize| {
        let mut s = past.clone();
        if let Some(d) = s.get_mut(dim) {
            *d = n;
        }
        TensorMeta::contiguous(dtype, &s)
    };
    let len = past.get(dim).copied().unwrap_or(1);
    Ok(Example {
        inputs: vec![Some(with_len(len)?), Some(with_len(len.div_ceil(2))?), Some(with_len(1)?)],
        attrs: vec![("dim".into(), (dim as i64 - past.len() as i64).into())],
        ..Default::default()
    })
}
