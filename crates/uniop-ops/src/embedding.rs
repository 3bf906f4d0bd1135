//! `embedding(weight, indices, padding_idx=-1)`: rows of `weight` `[V, H]` gathered by integer
//! `indices` of any shape; the output is `[*indices.shape, H]`. `padding_idx` only affects the
//! backward (its row gets no gradient), as in torch.
//!
//! An index outside `[0, V)` is data, not metadata, so phase 1 cannot see it: the kernel stops
//! at the first one and the launch fails with a runtime error naming the index and position
//! (reported by `synchronize`), never reading out of bounds.

use uniop::{
    block_dim_for, dispatch_element, BlockCtx, DType, Element, ErrorCode, Example, KernelArgs, LayoutNeed, Op, OpCx,
    Plan, RefTensor, Result, Step, TensorMeta,
};

pub struct Embedding;

pub(crate) const DTYPES: &[DType] = &[DType::F32, DType::F16, DType::BF16];
pub(crate) const INDEX_DTYPES: &[DType] = &[DType::I64, DType::I32];

/// `(V, H)` of an example's table from a user shape (its trailing dims) or LLaMA's default.
pub(crate) fn table_shape(shape: Option<&[usize]>) -> (usize, usize) {
    match shape.unwrap_or(&[32000, 4096]) {
        [.., v, h] => (*v, *h),
        [h] => (1, *h),
        [] => (1, 1),
    }
}

/// Reads index `i` of `indices` as i64.
#[inline(always)]
pub(crate) fn index_at<I: Element>(indices: &uniop::TensorRef<'_>, data: &[I], i: usize) -> i64 {
    data[indices.layout().offset_of_linear(i)].to_f64() as i64
}

/// Refuses the launch (a runtime error, see [`uniop::refuse_launch`]) on an out-of-range index.
#[inline(always)]
pub(crate) fn checked_row(op: &str, arg: &str, index: i64, position: usize, rows: usize) -> usize {
    if index < 0 || index as usize >= rows {
        uniop::refuse_launch(format!(
            "{op}: argument '{arg}': expected values in [0, {rows}), got {index} at position {position}"
        ));
    }
    index as usize
}

fn kernel<E: Element, I: Element>(args: &KernelArgs, ctx: BlockCtx, vocab: usize, hidden: usize) {
    let (weight, indices, out) = (args.input(0), args.input(1), args.output(0));
    let ws = &weight.storage::<E>().expect("dtype dispatched")[weight.layout().offset()..];
    let ids = indices.storage::<I>().expect("dtype dispatched");
    for pos in ctx.split(indices.layout().numel()) {
        let row = checked_row("embedding", "indices", index_at(&indices, ids, pos), pos, vocab);
        // SAFETY: this block owns output rows `split(n)`.
        let dst = unsafe { out.slice_mut::<E>(out.layout().offset() + pos * hidden, hidden) };
        dst.copy_from_slice(&ws[row * hidden..(row + 1) * hidden]);
    }
}

/// Checks `weight` `[V, H]` (name given) and integer `indices`; returns `(V, H)`.
pub(crate) fn check_indices(cx: &OpCx) -> Result<()> {
    cx.expect_dtype_in("indices", INDEX_DTYPES)?;
    Ok(())
}

pub(crate) fn check_padding(cx: &OpCx, vocab: usize) -> Result<()> {
    let p = cx.int("padding_idx");
    if p < -1 || p >= vocab as i64 {
        return Err(cx.err(ErrorCode::ParamInvalid, "padding_idx", format!("-1 (none) or a row in [0, {vocab})"), p));
    }
    Ok(())
}

impl Op for Embedding {
    fn schema(&self) -> &'static str {
        "embedding(Tensor weight, Tensor indices, int padding_idx=-1) -> Tensor out"
    }

    fn doc(&self) -> &'static str {
        "Gathers rows of weight [V, H] by int32/int64 indices of any shape: out[..., :] = weight[indices[...], :]. \
         An out-of-range index fails the launch with a runtime error. padding_idx (-1 = none) matters for the \
         backward only."
    }

    fn leading_batch_args(&self) -> &'static [&'static str] {
        &["indices"]
    }

    fn dtypes(&self) -> &'static [DType] {
        DTYPES
    }

    fn backward(&self) -> Option<&'static str> {
        Some("embedding_backward")
    }

    fn infer(&self, cx: &OpCx) -> Result<Vec<TensorMeta>> {
        let dtype = cx.expect_dtype_in("weight", DTYPES)?;
        let w = cx.input("weight");
        if w.rank() != 2 {
            return Err(cx.err(
                ErrorCode::Shape,
                "weight",
                "rank 2 ([num_embeddings, dim])",
                format!("rank {}", w.rank()),
            ));
        }
        check_indices(cx)?;
        check_padding(cx, w.shape()[0])?;
        let mut shape = cx.input("indices").shape().to_vec();
        shape.push(w.shape()[1]);
        Ok(vec![TensorMeta::contiguous(dtype, &shape)?])
    }

    fn plan(&self, cx: &OpCx) -> Result<Plan> {
        let out = self.infer(cx)?.remove(0);
        let (vocab, hidden) = (cx.input("weight").shape()[0], cx.input("weight").shape()[1]);
        let n = cx.input("indices").numel();
        let block_dim = block_dim_for(n, 2 * hidden * out.dtype.size());
        let idx = cx.input("indices").dtype;
        let step = dispatch_element!(out.dtype, |E| match idx {
            DType::I32 => Step::new("embedding", block_dim, move |a, c| kernel::<E, i32>(a, c, vocab, hidden)),
            _ => Step::new("embedding", block_dim, move |a, c| kernel::<E, i64>(a, c, vocab, hidden)),
        });
        Ok(Plan::new(vec![step])
            .inputs_need(vec![LayoutNeed::Contiguous, LayoutNeed::Any])
            .outputs_need(vec![LayoutNeed::Contiguous]))
    }

    fn reference(&self, _cx: &OpCx, inputs: &[Option<RefTensor>]) -> Result<Vec<RefTensor>> {
        let (w, idx) = (inputs[0].as_ref().unwrap(), inputs[1].as_ref().unwrap());
        let h = w.shape[1];
        let mut shape = idx.shape.clone();
        shape.push(h);
        let data =
            idx.data.iter().flat_map(|&i| w.data[i as usize * h..(i as usize + 1) * h].iter().copied()).collect();
        Ok(vec![RefTensor::new(&shape, data)])
    }

    fn bytes_moved(&self, cx: &OpCx) -> Option<usize> {
        // The gathered rows are read once and written once; the rest of the table is untouched.
        let (ids, w) = (cx.input("indices"), cx.input("weight"));
        Some(ids.numel() * (ids.dtype.size() + 2 * w.shape()[1] * w.dtype.size()))
    }

    fn example(&self, shape: Option<&[usize]>, dtype: DType) -> Result<Example> {
        // `shape` is the table's [V, H] (trailing dims); 2048 token indices drawn from [0, V).
        let (v, h) = table_shape(shape);
        let weight = TensorMeta::contiguous(dtype, &[v, h])?;
        Ok(Example {
            inputs: vec![Some(weight), Some(TensorMeta::contiguous(DType::I64, &[if v == 0 { 0 } else { 2048 }])?)],
            ranges: vec![None, Some((0.0, v as f64))],
            ..Default::default()
        })
    }
}
