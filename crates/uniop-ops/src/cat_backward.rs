//! `cat_backward(dout, tensors, dim)`: the gradient of [`cat`](crate::cat) — `dout` split back
//! along `dim` into one gradient per joined tensor, as torch.split / aclnnSplitWithSize.
//!
//! The joined tensors are taken for their shapes only (which give the split sizes), so autograd
//! frontends wire it by argument names like every backward op; their values are never read.
//! Each gradient is an elementwise strided copy of its region of `dout`: `dout`'s layout
//! restricted to the gradient's shape, shifted to its start along `dim` — cat's copy with source
//! and destination swapped, so a strided `dout` is read in place.

use crate::cat::{example, join, region, Joined, DTYPES};
use uniop::{
    BlockCtx, DType, ErrorCode, Example, KernelArgs, Layout, Op, OpCx, Plan, RefTensor, Result, Step, StridedRuns,
    TensorMeta,
};

pub struct CatBackward;

/// The validated call: the join's meta (checked against `dout`), its dim and starts, and the
/// gradients' metas (the tensors' shapes, contiguous).
fn split(cx: &OpCx) -> Result<(Joined, Vec<TensorMeta>)> {
    let joined = join(cx)?;
    let dout = cx.input("dout");
    cx.expect_same_dtype("dout", joined.out.dtype, "tensors")?;
    cx.expect_shape("dout", joined.out.shape())?;
    let grads = cx
        .input_list("tensors")
        .iter()
        .map(|t| TensorMeta::contiguous(dout.dtype, t.shape()))
        .collect::<Result<Vec<_>>>()?;
    Ok((joined, grads))
}

fn kernel(args: &KernelArgs, ctx: BlockCtx, regions: &[Layout], elem_size: usize) {
    let dout = args.input(0);
    // SAFETY: the regions lie inside the checked `dout` view, given relative to its offset.
    let src = unsafe { dout.as_ptr().add(dout.layout().offset() * elem_size) };
    for (i, region) in regions.iter().enumerate() {
        let out = args.output(i);
        let runs = StridedRuns::<2>::new([out.layout(), region]);
        // SAFETY: each output is its own checked view, and each block writes its own share of it.
        unsafe { runs.copy(out.as_mut_byte_ptr(), src, elem_size, ctx.split(region.numel())) };
    }
}

impl Op for CatBackward {
    fn schema(&self) -> &'static str {
        "cat_backward(Tensor dout, Tensor[] tensors, int dim=0) -> Tensor[] dtensors"
    }

    fn doc(&self) -> &'static str {
        "Gradient of cat: dout split along dim into one contiguous gradient per tensor of the join, sized as that \
         tensor (tensors and dim as given to cat; only the tensors' shapes are read). dout may have any strides. Any \
         dtype."
    }

    fn dtypes(&self) -> &'static [DType] {
        DTYPES
    }

    fn leading_batch_args(&self) -> &'static [&'static str] {
        &["dout", "tensors"]
    }

    fn infer(&self, cx: &OpCx) -> Result<Vec<TensorMeta>> {
        Ok(split(cx)?.1)
    }

    fn plan(&self, cx: &OpCx) -> Result<Plan> {
        let (Joined { dim, starts, .. }, grads) = split(cx)?;
        let dout = cx.input("dout");
        let regions = grads
            .iter()
            .zip(&starts)
            .map(|(g, &start)| region(dout, g.shape(), dim, start))
            .collect::<Result<Vec<_>>>()?;
        let elem_size = dout.dtype.size();
        let block_dim = uniop::block_dim_for(dout.numel(), 2 * elem_size);
        let step = Step::new("cat_backward", block_dim, move |a, c| kernel(a, c, &regions, elem_size));
        Ok(Plan::new(vec![step]).outputs_need(vec![uniop::LayoutNeed::Contiguous; grads.len()]))
    }

    fn reference(&self, cx: &OpCx, inputs: &[Option<RefTensor>]) -> Result<Vec<RefTensor>> {
        let (Joined { dim, .. }, grads) = split(cx)?;
        let dout = inputs[0].as_ref().ok_or_else(|| cx.err(ErrorCode::ParamNullptr, "dout", "a tensor", "none"))?;
        // Row-major: per index of the dims before `dim`, `dout` holds each gradient's slab of
        // (its size along dim) × (the product of the dims after it) elements in turn.
        let outer: usize = dout.shape[..dim].iter().product();
        let mut data: Vec<Vec<f64>> = grads.iter().map(|g| Vec::with_capacity(g.numel())).collect();
        let mut at = 0;
        for _ in 0..outer {
            for (g, d) in grads.iter().zip(&mut data) {
                let slab: usize = g.shape()[dim..].iter().product();
                d.extend_from_slice(&dout.data[at..at + slab]);
                at += slab;
            }
        }
        Ok(grads.iter().zip(data).map(|(g, d)| RefTensor::new(g.shape(), d)).collect())
    }

    fn bytes_moved(&self, cx: &OpCx) -> Option<usize> {
        // dout read once and written once as the gradients; the tensors' values are never read.
        let dout = cx.input("dout");
        Some(2 * dout.numel() * dout.dtype.size())
    }

    fn example(&self, shape: Option<&[usize]>, dtype: DType) -> Result<Example> {
        // cat's example, with the gradient of its join in front.
        let mut e = example(shape, dtype)?;
        let parts: Vec<&TensorMeta> = e.inputs.iter().flatten().collect();
        let dim = parts[0].rank().saturating_sub(2);
        let mut joined = parts[0].shape().to_vec();
        if let Some(d) = joined.get_mut(dim) {
            *d = parts.iter().map(|p| p.shape()[dim]).sum();
        }
        e.inputs.insert(0, Some(TensorMeta::contiguous(dtype, &joined)?));
        Ok(e)
    }

    fn example_shape(&self, example: &Example) -> Vec<usize> {
        example.input_shape(1)
    }
}
