//! `cross_entropy_backward(dloss, logits, target, lse, ignore_index=-100, batch_dims=0) -> dlogits`,
//! the gradient of [`cross_entropy`](crate::cross_entropy) (mean reduction):
//! `dlogits[r, c] = dloss / n · (softmax(logits[r])[c] − [c = target[r]])` for the `n` counted
//! rows, 0 for ignored rows — `dloss` and `n` those of row r's sample with `batch_dims` (`dloss`
//! then has the samples' shape). Uses the saved log-sum-exp, so each row is one pass.

use crate::cross_entropy::{example_logits, rows, samples, target_of, Rows, DTYPES};
use crate::elementwise::{dense_map, fence, streams};
use crate::embedding::index_at;
use crate::math;
use uniop::{
    block_dim_for, with_float_dtype, BlockCtx, DType, Element, Example, FloatElement, KernelArgs, LayoutNeed, Op, OpCx,
    Plan, RefTensor, Result, Step, TensorMeta,
};

pub struct CrossEntropyBackward;

crate::simd_kernel! {
fn kernel<T: FloatElement, I: Element>(args: &KernelArgs, ctx: BlockCtx, g: Rows, per_sample: usize, streaming: bool) {
    let (dloss, logits, target, lse) = (args.input(0), args.input(1), args.input(2), args.input(3));
    let xs = &logits.storage::<T>().expect("dtype dispatched")[logits.layout().offset()..];
    let ts = target.storage::<I>().expect("dtype dispatched");
    let lses = lse.storage::<f32>().expect("float32");
    let ds = dloss.storage::<f32>().expect("float32");
    // A block counts the rows that count in each sample it writes (cheap next to the C-wide rows).
    let scale_of = |sample: usize| {
        let rows = sample * per_sample..(sample + 1) * per_sample;
        let counted = rows.filter(|&r| index_at(&target, ts, r) != g.ignore).count();
        ds[dloss.layout().offset_of_linear(sample)] / counted as f32
    };
    let mut scale = (usize::MAX, 0.0);
    let out = args.output(0);
    for r in ctx.split(g.rows) {
        let sample = r / per_sample;
        if scale.0 != sample {
            scale = (sample, scale_of(sample));
        }
        let scale = scale.1;
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
        "cross_entropy_backward(Tensor dloss, Tensor logits, Tensor target, Tensor lse, int ignore_index=-100, int \
         batch_dims=0) -> Tensor dlogits"
    }

    fn doc(&self) -> &'static str {
        "Gradient of cross_entropy (mean): dlogits = dloss / n * (softmax(logits) - onehot(target)) on counted rows, \
         0 on ignored rows. dloss is the float32 scalar upstream gradient (one per sample with batch_dims, then \
         n counts the sample's rows); lse is cross_entropy's second output."
    }

    fn dtypes(&self) -> &'static [DType] {
        DTYPES
    }

    /// Row by row, `dloss` one per sample with `batch_dims`.
    fn leading_batch_args(&self) -> &'static [&'static str] {
        &["dloss", "logits", "target", "lse"]
    }

    fn infer(&self, cx: &OpCx) -> Result<Vec<TensorMeta>> {
        let (_, samples) = (rows(cx)?, samples(cx)?);
        for (name, shape) in [("dloss", &samples.dims[..]), ("lse", cx.input("target").shape())] {
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
        let per = samples(cx)?.rows;
        let step = with_float_dtype!(dtype, cx.op(), "logits", |T| match idx {
            DType::I32 =>
                Step::new("cross_entropy_backward", block_dim, move |a, c| kernel::<T, i32>(a, c, g, per, streaming)),
            _ => Step::new("cross_entropy_backward", block_dim, move |a, c| kernel::<T, i64>(a, c, g, per, streaming)),
        });
        Ok(Plan::new(vec![step])
            .inputs_need(vec![LayoutNeed::Any, LayoutNeed::Contiguous, LayoutNeed::Any, LayoutNeed::Any])
            .outputs_need(vec![LayoutNeed::Contiguous]))
    }

    fn reference(&self, cx: &OpCx, inputs: &[Option<RefTensor>]) -> Result<Vec<RefTensor>> {
        let (g, samples) = (rows(cx)?, samples(cx)?);
        let [d, x, t, lse] = [0, 1, 2, 3].map(|i| inputs[i].as_ref().unwrap());
        let mut dx = vec![0.0; x.data.len()];
        for r in 0..g.rows {
            if t.data[r] as i64 == g.ignore {
                continue;
            }
            let sample = r / samples.rows;
            let targets = &t.data[sample * samples.rows..(sample + 1) * samples.rows];
            let counted = targets.iter().filter(|&&v| v as i64 != g.ignore).count();
            let scale = d.data[sample] / counted as f64;
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
        let (logits, classes) = example_logits(shape.unwrap_or(&[2048, 32000]))?;
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
