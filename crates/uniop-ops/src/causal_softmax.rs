//! `causal_softmax(x)`: softmax over the last dim of `x` `[..., Sq, Sk]` with a causal mask on
//! the last two dims, aligned **bottom-right** like [`attention`](crate::attention): row `i`
//! sees columns `j <= i + Sk − Sq` (torch's `is_causal` when `Sq == Sk`), masked entries are 0,
//! and a row that sees nothing (only when `Sk < Sq`) is all zeros. The gradient is plain
//! `softmax_backward`: masked outputs are 0, so their gradients are too.

use crate::attention::causal_prefix;
use crate::elementwise::{fence, streams};
use crate::softmax::{exp_into, row_max, scale_into, DTYPES};
use uniop::{
    block_dim_for, with_float_dtype, BlockCtx, DType, Example, FloatElement, KernelArgs, LayoutNeed, Op, OpCx, Plan,
    RefTensor, Result, Step, TensorMeta,
};

pub struct CausalSoftmax;

/// `(rows, Sq, Sk)` of `x` viewed as `[rows, Sk]` rows, row `r` being query `r % Sq`.
fn dims(cx: &OpCx) -> Result<(usize, usize, usize)> {
    cx.expect_dtype_in("x", DTYPES)?;
    cx.expect_min_rank("x", 2)?;
    let s = cx.input("x").shape();
    let (sq, sk) = (s[s.len() - 2], s[s.len() - 1]);
    Ok((s[..s.len() - 1].iter().product(), sq, sk))
}

/// Columns row `r` sees (the attention mask rule).
#[inline(always)]
fn visible(r: usize, sq: usize, sk: usize) -> usize {
    causal_prefix(r % sq, sq, sk)
}

crate::simd_kernel! {
fn kernel<T: FloatElement>(args: &KernelArgs, ctx: BlockCtx, (sq, sk): (usize, usize), streaming: bool) {
    let (x, y) = (args.input(0), args.output(0));
    let xs = &x.storage::<T>().expect("dtype dispatched")[x.layout().offset()..];
    let base = y.layout().offset();
    // SAFETY: block b owns scratch row b.
    let scratch = unsafe { args.workspace::<f32>(ctx.block_idx as usize * sk, sk) };
    for r in ctx.split(x.layout().numel() / sk.max(1)) {
        let n = visible(r, sq, sk);
        let row = &xs[r * sk..r * sk + n];
        // SAFETY: this block owns rows `split(rows)` of y.
        let out = unsafe { y.slice_mut::<T>(base + r * sk, sk) };
        let (live, masked) = out.split_at_mut(n);
        masked.fill(T::from_f32(0.0));
        if n == 0 {
            continue;
        }
        let m = row_max(row);
        let next = xs.get((r + 1) * sk..(r + 1) * sk + visible(r + 1, sq, sk)).unwrap_or_default();
        // The whole scratch row: the row's last exps go there as one vector (see `exp_into`).
        let sum = exp_into(row, scratch, m, next);
        scale_into(scratch, live, 1.0 / sum, streaming);
    }
    fence();
}
}

impl Op for CausalSoftmax {
    fn schema(&self) -> &'static str {
        "causal_softmax(Tensor x) -> Tensor y"
    }

    fn doc(&self) -> &'static str {
        "Softmax over the last dim of x [..., Sq, Sk] with a causal mask aligned bottom-right: row i sees columns \
         j <= i + Sk - Sq (torch is_causal when Sq == Sk); masked entries are 0, a row seeing nothing is all 0. \
         Gradient: softmax_backward (dim -1)."
    }

    fn leading_batch_args(&self) -> &'static [&'static str] {
        &["x"]
    }

    fn dtypes(&self) -> &'static [DType] {
        DTYPES
    }

    fn backward(&self) -> Option<&'static str> {
        Some("softmax_backward")
    }

    fn infer(&self, cx: &OpCx) -> Result<Vec<TensorMeta>> {
        dims(cx)?;
        Ok(vec![TensorMeta::contiguous(cx.input("x").dtype, cx.input("x").shape())?])
    }

    fn plan(&self, cx: &OpCx) -> Result<Plan> {
        let (rows, sq, sk) = dims(cx)?;
        let block_dim = block_dim_for(rows, sk.max(1) * 2 * cx.input("x").dtype.size());
        let streaming = streams(cx.input("x"));
        let step = with_float_dtype!(cx.input("x").dtype, cx.op(), "x", |T| {
            Step::new("causal_softmax", block_dim, move |args, ctx| kernel::<T>(args, ctx, (sq, sk), streaming))
        });
        Ok(Plan::new(vec![step])
            .workspace(block_dim as usize * sk * 4)
            .inputs_need(vec![LayoutNeed::Contiguous])
            .outputs_need(vec![LayoutNeed::Contiguous]))
    }

    fn reference(&self, cx: &OpCx, inputs: &[Option<RefTensor>]) -> Result<Vec<RefTensor>> {
        let ((rows, sq, sk), x) = (dims(cx)?, inputs[0].as_ref().unwrap());
        let mut y = vec![0.0; x.data.len()];
        for r in 0..rows {
            let row = &x.data[r * sk..r * sk + visible(r, sq, sk)];
            let m = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let sum: f64 = row.iter().map(|v| (v - m).exp()).sum();
            for (o, v) in y[r * sk..].iter_mut().zip(row) {
                *o = (v - m).exp() / sum;
            }
        }
        Ok(vec![RefTensor::new(&x.shape, y)])
    }

    fn example(&self, shape: Option<&[usize]>, dtype: DType) -> Result<Example> {
        // Attention scores of one layer: [heads, S, S].
        let shape = shape.unwrap_or(&[32, 2048, 2048]);
        let shape = if shape.len() < 2 { vec![1, shape.first().copied().unwrap_or(1)] } else { shape.to_vec() };
        Ok(Example { inputs: vec![Some(TensorMeta::contiguous(dtype, &shape)?)], ..Default::default() })
    }
}
