//! `embedding_backward(dout, indices, weight, padding_idx=-1, batch_dims=0) -> dweight`: the gradient
//! of [`embedding`](crate::embedding), a scatter-add of `dout` rows into a tensor shaped like
//! `weight` — one per sample of the first `batch_dims` dims of `indices` (see
//! [`per_sample`](crate::per_sample)), a table of `[samples…, V, H]` whose sample `s`, row `v` is
//! row `s·V + v` of one tall table. `weight` is read for its shape only (never its data): taking
//! the forward's own argument keeps the schema in the backward naming convention frontends wire
//! autograd by.
//!
//! Deterministic and race-free without atomics: each block owns a range of weight rows, collects
//! the `(row, position)` pairs that land in it, sorts them, and sums each row's contributions in
//! position order in f32 before writing it once (rows nobody indexes, and `padding_idx`, get 0).
//! A large gradient is written with non-temporal stores: it is the size of the table and mostly
//! zeros, and ordinary stores would first read every line of it.

use crate::elementwise::{copy_streaming, fence, streams, Aligned, LANES};
use crate::embedding::{check_indices, check_padding, checked_row, index_at, table_shape, DTYPES};
use crate::per_sample::Samples;
use crate::softmax::scale_into;
use uniop::{
    block_dim_for, with_float_dtype, BlockCtx, DType, Element, ErrorCode, Example, FloatElement, KernelArgs,
    LayoutNeed, Op, OpCx, Plan, RefTensor, Result, Step, TensorMeta,
};

pub struct EmbeddingBackward;

#[derive(Clone, Copy)]
struct Shape {
    vocab: usize,
    hidden: usize,
    tokens: usize,
    /// Tokens per sample, and the rows of all samples' tables.
    sample_tokens: usize,
    rows: usize,
    padding: i64,
    /// Where the per-block `(row << 32 | position)` lists start in the workspace, in i64 units.
    pairs_at: usize,
    /// Rows are written past the cache (the table's gradient is mostly zeros, as large as the table).
    streaming: bool,
}

crate::simd_kernel! {
fn kernel<T: FloatElement, I: Element>(args: &KernelArgs, ctx: BlockCtx, s: Shape) {
    let (dout, indices) = (args.input(0), args.input(1));
    let ds = &dout.storage::<T>().expect("dtype dispatched")[dout.layout().offset()..];
    let ids = indices.storage::<I>().expect("dtype dispatched");
    let dw = args.output(0);
    let b = ctx.block_idx as usize;
    // SAFETY: block b owns accumulator row b and pair list b of the workspace.
    let (acc, pairs) = unsafe {
        (args.workspace::<f32>(b * s.hidden, s.hidden), args.workspace::<i64>(s.pairs_at + b * s.tokens, s.tokens))
    };
    let rows = ctx.split(s.rows);
    let mut count = 0;
    for pos in 0..s.tokens {
        let index = checked_row("embedding_backward", "indices", index_at(&indices, ids, pos), pos, s.vocab);
        let row = pos / s.sample_tokens * s.vocab + index;
        if rows.contains(&row) && index as i64 != s.padding {
            pairs[count] = (row as i64) << 32 | pos as i64;
            count += 1;
        }
    }
    let pairs = &mut pairs[..count];
    pairs.sort_unstable();
    let mut next = pairs.iter().peekable();
    let mut row_buf = [0f32; 64];
    let dw_at = dw.layout().offset();
    for row in rows {
        // SAFETY: this block owns rows `split(rows)` of the samples' tables.
        let dst = unsafe { dw.slice_mut::<T>(dw_at + row * s.hidden, s.hidden) };
        if next.peek().is_none_or(|&&p| (p >> 32) as usize != row) {
            // Nobody indexes this row (or it is padding_idx): zeros, no sums to narrow.
            zero_row(dst, s.streaming);
            continue;
        }
        acc.fill(0.0);
        while let Some(&&p) = next.peek() {
            if (p >> 32) as usize != row {
                break;
            }
            let pos = (p & 0xffff_ffff) as usize;
            for (a, c) in acc.chunks_mut(64).zip(ds[pos * s.hidden..(pos + 1) * s.hidden].chunks(64)) {
                T::widen(c, &mut row_buf[..c.len()]);
                for (x, y) in a.iter_mut().zip(&row_buf) {
                    *x += y;
                }
            }
            next.next();
        }
        scale_into(acc, dst, 1.0, s.streaming);
    }
    fence();
}
}

/// Fills `dst` with zeros, past the cache when `streaming`.
#[inline(always)]
fn zero_row<T: FloatElement>(dst: &mut [T], streaming: bool) {
    if !streaming {
        return dst.fill(T::default());
    }
    let zeros = Aligned([T::default(); LANES]);
    let mut chunks = dst.chunks_exact_mut(LANES);
    for chunk in &mut chunks {
        copy_streaming(chunk, &zeros[..]);
    }
    chunks.into_remainder().fill(T::default());
}

/// How `batch_dims` divides the tokens (every dim of `indices`) into samples.
fn samples(cx: &OpCx) -> Result<Samples> {
    Samples::of(cx, "indices", cx.input("indices").rank())
}

impl Op for EmbeddingBackward {
    fn schema(&self) -> &'static str {
        "embedding_backward(Tensor dout, Tensor indices, Tensor weight, int padding_idx=-1, int batch_dims=0) -> \
         Tensor dweight"
    }

    fn doc(&self) -> &'static str {
        "Gradient of embedding: dweight[v] = sum of dout rows whose index is v (0 for padding_idx and unused rows). \
         dout has shape [*indices.shape, H]; weight (the forward's table, [V, H]) gives the shape of dweight and \
         is not read. With batch_dims, one table gradient per sample: indices.shape[:batch_dims] + [V, H]. \
         Deterministic: contributions are summed in token order in float32."
    }

    fn dtypes(&self) -> &'static [DType] {
        DTYPES
    }

    /// Token by token; the table's gradient per sample with `batch_dims`.
    fn leading_batch_args(&self) -> &'static [&'static str] {
        &["dout", "indices"]
    }

    fn infer(&self, cx: &OpCx) -> Result<Vec<TensorMeta>> {
        let dtype = cx.expect_dtype_in("dout", DTYPES)?;
        check_indices(cx)?;
        let (dout, idx) = (cx.input("dout"), cx.input("indices"));
        if dout.rank() != idx.rank() + 1 || dout.shape()[..idx.rank()] != *idx.shape() {
            return Err(cx.err(
                ErrorCode::Shape,
                "dout",
                format!("shape [*indices.shape, H] with indices.shape = {}", uniop::layout::ShapeDisplay(idx.shape())),
                uniop::layout::ShapeDisplay(dout.shape()),
            ));
        }
        let hidden = *dout.shape().last().unwrap();
        let weight = cx.input("weight");
        if weight.rank() != 2 || weight.shape()[1] != hidden {
            return Err(cx.err(
                ErrorCode::Shape,
                "weight",
                format!("shape [V, {hidden}] (H from dout)"),
                uniop::layout::ShapeDisplay(weight.shape()),
            ));
        }
        let n = weight.shape()[0];
        let samples = samples(cx)?;
        // Rows of all samples' tables go into the high half of an i64 sort key.
        if samples.count.checked_mul(n).is_none_or(|rows| rows >= 1 << 31) {
            let rows = if samples.dims.is_empty() { "rows".to_string() } else { "rows in all samples' tables".into() };
            return Err(cx.err(ErrorCode::Shape, "weight", format!("fewer than 2^31 {rows}"), n));
        }
        check_padding(cx, n)?;
        if idx.numel() >= (1usize << 32) {
            return Err(cx.err(ErrorCode::Shape, "indices", "fewer than 2^32 indices", idx.numel()));
        }
        Ok(vec![TensorMeta::contiguous(dtype, &samples.shape(&[n, hidden]))?])
    }

    fn plan(&self, cx: &OpCx) -> Result<Plan> {
        let out = self.infer(cx)?.remove(0);
        let (vocab, hidden) = (cx.input("weight").shape()[0], cx.input("weight").shape()[1]);
        let (tokens, samples) = (cx.input("indices").numel(), samples(cx)?);
        let rows = samples.count * vocab;
        let block_dim = block_dim_for(rows, hidden * out.dtype.size());
        let blocks = block_dim as usize;
        let pairs_at = (blocks * hidden * 4).div_ceil(8);
        let streaming = streams(&out);
        let padding = cx.int("padding_idx");
        let s = Shape { vocab, hidden, tokens, sample_tokens: samples.rows, rows, padding, pairs_at, streaming };
        let workspace = (pairs_at + blocks * tokens) * 8;
        let idx = cx.input("indices").dtype;
        let step = with_float_dtype!(out.dtype, cx.op(), "dout", |T| match idx {
            DType::I32 => Step::new("embedding_backward", block_dim, move |a, c| kernel::<T, i32>(a, c, s)),
            _ => Step::new("embedding_backward", block_dim, move |a, c| kernel::<T, i64>(a, c, s)),
        });
        Ok(Plan::new(vec![step])
            .workspace(workspace)
            .inputs_need(vec![LayoutNeed::Contiguous, LayoutNeed::Any, LayoutNeed::Any])
            .outputs_need(vec![LayoutNeed::Contiguous]))
    }

    fn reference(&self, cx: &OpCx, inputs: &[Option<RefTensor>]) -> Result<Vec<RefTensor>> {
        let (d, idx) = (inputs[0].as_ref().unwrap(), inputs[1].as_ref().unwrap());
        let (n, padding) = (cx.input("weight").shape()[0], cx.int("padding_idx"));
        let h = *d.shape.last().unwrap();
        let samples = samples(cx)?;
        let mut dw = vec![0.0; samples.count * n * h];
        for (pos, &i) in idx.data.iter().enumerate() {
            if i as i64 != padding {
                let row = pos / samples.rows * n + i as usize;
                for k in 0..h {
                    dw[row * h + k] += d.data[pos * h + k];
                }
            }
        }
        Ok(vec![RefTensor::new(&samples.shape(&[n, h]), dw)])
    }

    /// Each row of the gradient sums the `dout` rows of every position that indexed it, in f32: a
    /// reduction as long as a row's share of the positions (all of them for a one-row table).
    fn error_scale(&self, cx: &OpCx) -> f64 {
        let positions = cx.input("indices").numel() as f64;
        let rows = cx.input("weight").shape().first().copied().unwrap_or(1).max(1) as f64;
        (positions / rows).sqrt().max(1.0)
    }

    /// The table's `[V, H]`, as for embedding (the first input is the `[tokens, H]` gradient).
    fn example_shape(&self, example: &Example) -> Vec<usize> {
        example.input_shape(2)
    }

    fn example(&self, shape: Option<&[usize]>, dtype: DType) -> Result<Example> {
        // `shape` is the table's [V, H] (trailing dims), as for embedding.
        let (v, h) = table_shape(shape);
        let tokens = if v == 0 { 0 } else { 2048 };
        Ok(Example {
            inputs: vec![
                Some(TensorMeta::contiguous(dtype, &[tokens, h])?),
                Some(TensorMeta::contiguous(DType::I64, &[tokens])?),
                Some(TensorMeta::contiguous(dtype, &[v, h])?),
            ],
            attrs: vec![],
            ranges: vec![None, Some((0.0, v as f64)), None],
        })
    }

    fn bytes_moved(&self, cx: &OpCx) -> Option<usize> {
        // dout and indices are read once and dweight written once; weight is not read.
        let (dout, idx, w) = (cx.input("dout"), cx.input("indices"), cx.input("weight"));
        Some(dout.numel() * dout.dtype.size() + idx.numel() * idx.dtype.size() + w.numel() * dout.dtype.size())
    }
}
