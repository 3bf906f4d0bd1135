//! `cross_entropy_backward(dloss, logits, target, lse, ignore_index=-100) -> dlogits`, the
//! gradient of [`cross_entropy`](crate::cross_entropy) (mean reduction):
//! `dlogits[r, c] = dloss / n · (softmax(logits[r])[c] − [c = target[r]])` for the `n` counted
//! rows, 0 for ignored rows. Uses the saved log-sum-exp, so each row is one pass.

use crate::cross_entropy::{rows, target_of, Rows, DTYPES};
use crate::elementwise::{dense_map, fence, streams};
use crate::embedding::index_at;
use crate::math;
use uniop::{
    block_dim_for, with_float_dtype, BlockCtx, DType, Element, Example, FloatElement, KernelArgs, LayoutNeed, Op, OpCx,
    Plan, RefTensor, Result, Step, TensorMeta,
};

pub struct CrossEntropyBackward;

crate::simd_kernel! {
fn kernel<T: FloatElement, I: Element>(args: &KernelArgs, ctx: BlockCtx, g: Rows, streaming: bool) {
    let (dloss, logits, target, lse) = (args.input(0), args.input(1), args.input(2), args.input(3));
    let xs = &logits.storage::<T>().expect("dtype dispatched")[logits.layout().offset()..];
    let ts = target.storage::<I>().expect("dtype dispatched");
    let lses = lse.storage::<f32>().expect("float32");
    let d = dloss.storage::<f32>().expect("float32")[dloss.layout().offset()];
    // Every block counts the rows that count (cheap next to the C-wide rows it writes).
    let counted = (0..g.rows).filter(|&r| index_at(&target, ts, r) != g.ignore).count();
    let scale = d / counted as f32;
    let out = args.output(0);
    for r in ctx.split(g.rows) {
        // SAFETY: this block owns rows `split(rows)` of dlogits.
        let dst = unsafe { out.slice_mut::<T>(out.layout().offset() + r * g.classes, g.classes) };
        match target_of("cross_entropy_backward", &target, ts, r, g) {
            None => dst.fill(T::from_f32(0.0)),
            Some(t) => {
                let l = lses[lse.layout().offset_of_linear(r)];
                let row = &xs[r * g.classes..(r + 1) * g.classes];
                dense_map([row], [&mut *dst], streaming, |[v]| [math::exp_for::<T>(v - l) * scale]);
                dst[t] = T::from_f32(dst[t].to_f32() - scale);
            }
        }
    }
    fence();
}
}

impl Op for CrossEntropyBackward {
    fn schema(&self) -> &'static str {
        "cross_entropy_backward(Tensor dloss, Tensor logits, Tensor target, Tensor lse, int ignore_index=-100) -> Tensor dlogits"
    }

    fn doc(&self) -> &'static str {
        "Gradient of cross_entropy (mean): dlogits = dloss / n * (softmax(logits) - onehot(target)) on counted rows, \
         0 on ignored rows. dloss is the float32 scalar upstream gradient; lse is cross_entropy's second output."
    }

    fn dtypes(&self) -> &'static [DType] {
        DTYPES
    }

    fn infer(&self, cx: &OpCx) -> Result<Vec<TensorMeta>> {
        let _ = rows(cx)?;
        for (name, shape) in [("dloss", &[][..]), ("lse", cx.input("target").shape())] {
            let t = cx.input(name);
            let want = cx.statistics_dtype();
            if t.dtype != want {
                return Err(cx.err(
                    uniop::ErrorCode::DType,
                    name,
                    format!("dtype {want} (as cross_entropy returns it)"),
                    t.dtype,
                ));
            }
            cx.expect_shape(name, shape)?;
        }
        let logits = cx.input("logits");
        Ok(vec![TensorMeta::contiguous(logits.dtype, logits.shape())?])
    }

    fn plan(&self, cx: &OpCx) -> Result<Plan> {
        self.infer(cx)?;
        let g = rows(cx)?;
        let dtype = cx.input("logits").dtype;
        let block_dim = block_dim_for(g.rows, 2 * g.classes * dtype.size());
        let idx = cx.input("target").dtype;
        let streaming = streams(cx.input("logits"));
        let step = with_float_dtype!(dtype, cx.op(), "logits", |T| match idx {
            DType::I32 =>
                Step::new("cross_entropy_backward", block_dim, move |a, c| kernel::<T, i32>(a, c, g, streaming)),
            _ => Step::new("cross_entropy_backward", block_dim, move |a, c| kernel::<T, i64>(a, c, g, streaming)),
        });
        Ok(Plan::new(vec![step])
            .inputs_need(vec![LayoutNeed::Any, LayoutNeed::Contiguous, LayoutNeed::Any, LayoutNeed::Any])
            .outputs_need(vec![LayoutNeed::Contiguous]))
    }

    fn reference(&self, cx: &OpCx, inputs: &[Option<RefTensor>]) -> Result<Vec<RefTensor>> {
        let g = rows(cx)?;
        let [d, x, t, lse] = [0, 1, 2, 3].map(|i| inputs[i].as_ref().unwrap());
        let counted = t.data.iter().filter(|&&v| v as i64 != g.ignore).count();
        let scale = d.data[0] / counted as f64;
        let mut dx = vec![0.0; x.data.len()];
        for r in 0..g.rows {
            if t.data[r] as i64 == g.ignore {
                continue;
            }
            for c in 0..g.classes {
                let p = (x.data[r * g.classes + c] - lse.data[r]).exp();
                dx[r * g.classes + c] = scale * (p - if c == t.data[r] as usize { 1.0 } else { 0.0 });
            }
        }
        Ok(vec![RefTensor::new(&x.shape, dx)])
    }

    /// The logits' shape (the first input, dloss, is a scalar).
    fn example_shape(&self, example: &Example) -> Vec<usize> {
        example.input_shape(1)
    }

    fn example(&self, shape: Option<&[usize]>, dtype: DType) -> Result<Example> {
        let shape = shape.unwrap_or(&[2048, 32000]);
        let classes = shape.last().copied().unwrap_or(1);
        let logits = if shape.is_empty() { vec![1] } else { shape.to_vec() };
        let lead = &logits[..logits.len() - 1];
        Ok(Example {
            inputs: vec![
                Some(TensorMeta::contiguous(DType::F32, &[])?),
                Some(TensorMeta::contiguous(dtype, &logits)?),
                Some(TensorMeta::contiguous(DType::I64, lead)?),
                Some(TensorMeta::contiguous(DType::F32, lead)?),
            ],
            ranges: vec![None, None, Some((0.0, classes as f64)), Some((2.0, 4.0))],
            ..Default::default()
        })
    }
}
