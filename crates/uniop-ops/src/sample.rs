//! `sample(logits, temperature=1.0, top_k=0, top_p=1.0, seed=0)`: one token per row of
//! `logits` `[..., V]`, drawn from `softmax(logits / temperature)` restricted to the top-k and
//! then the top-p nucleus, as HF's `TopKLogitsWarper` + `TopPLogitsWarper` + `multinomial`.
//!
//! Reproducible by construction: row `r` draws from its own counter-based stream
//! (SplitMix64 of `seed` and `r`), so results depend on neither the block split nor the
//! thread count. Definitions, so that any implementation can match exactly:
//! - `temperature == 0` is greedy (argmax, first on ties).
//! - candidates are ordered by probability, descending, ties by token id; `top_k > 0` keeps
//!   the first `top_k`; `top_p < 1` then keeps the shortest prefix whose mass, renormalized
//!   over the kept candidates, reaches `top_p` (at least one token).
//! - with `u` uniform in `[0, 1)`, the token is the first kept one (in token-id order) whose
//!   cumulative probability exceeds `u ·` (total kept probability).
//!
//! Probabilities are computed in f64 (sampling is a per-token step; exactness of the
//! definition above matters more than speed here).

use crate::argmax::first_max;
use uniop::layout::ShapeDisplay;
use uniop::{
    with_float_dtype, BlockCtx, DType, ErrorCode, Example, FloatElement, KernelArgs, LayoutNeed, Op, OpCx, Plan,
    RefTensor, Result, Step, TensorMeta,
};

pub struct Sample;

const DTYPES: &[DType] = &[DType::F32, DType::F16, DType::BF16];

#[derive(Clone, Copy, Debug)]
pub(crate) struct Sampling {
    temperature: f64,
    top_k: usize,
    top_p: f64,
    seed: u64,
}

fn sampling(cx: &OpCx) -> Result<(Sampling, usize, usize)> {
    cx.expect_dtype_in("logits", DTYPES)?;
    cx.expect_min_rank("logits", 1)?;
    let shape = cx.input("logits").shape();
    let vocab = *shape.last().unwrap();
    let rows = shape[..shape.len() - 1].iter().product::<usize>();
    if (vocab == 0 && rows > 0) || vocab > i32::MAX as usize {
        return Err(cx.err(ErrorCode::Shape, "logits", "a vocabulary (last dim) in [1, 2^31)", ShapeDisplay(shape)));
    }
    let temperature = cx.float("temperature");
    if !(temperature >= 0.0 && temperature.is_finite()) {
        return Err(cx.err(ErrorCode::ParamInvalid, "temperature", "a finite value ≥ 0 (0 = greedy)", temperature));
    }
    let top_k = cx.int("top_k");
    if top_k < 0 {
        return Err(cx.err(ErrorCode::ParamInvalid, "top_k", "a value ≥ 0 (0 = no top-k filter)", top_k));
    }
    let top_p = cx.float("top_p");
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(cx.err(ErrorCode::ParamInvalid, "top_p", "a value in (0, 1] (1 = no nucleus filter)", top_p));
    }
    let seed = cx.int("seed") as u64;
    Ok((Sampling { temperature, top_k: top_k as usize, top_p, seed }, rows, vocab))
}

/// Uniform `[0, 1)` draw for row `r`: SplitMix64 finalizer over (seed, row).
fn uniform(seed: u64, r: usize) -> f64 {
    let mut z = seed ^ (r as u64).wrapping_add(1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    (z >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

/// Zeroes every probability whose token is not in `kept` (which it sorts).
fn zero_outside(p: &mut [f64], kept: &mut [i32]) {
    kept.sort_unstable();
    let mut next = kept.iter().peekable();
    for (i, prob) in p.iter_mut().enumerate() {
        if next.peek().is_some_and(|&&j| j as usize == i) {
            next.next();
        } else {
            *prob = 0.0;
        }
    }
}

/// Draws row `r`'s token from its logits. `p` (len V) and `order` (len V) are scratch.
pub(crate) fn sample_row(logits: &[f64], s: &Sampling, r: usize, p: &mut [f64], order: &mut [i32]) -> usize {
    if s.temperature == 0.0 {
        return first_max(logits.iter().copied());
    }
    let m = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    for (p, &l) in p.iter_mut().zip(logits) {
        *p = ((l - m) / s.temperature).exp();
    }
    let v = logits.len();
    let k = if s.top_k == 0 { v } else { s.top_k.min(v) };
    if k < v || s.top_p < 1.0 {
        // Candidates by probability, descending, ties by token id.
        let by_prob = |a: &i32, b: &i32| p[*b as usize].total_cmp(&p[*a as usize]).then(a.cmp(b));
        for (i, o) in order.iter_mut().enumerate() {
            *o = i as i32;
        }
        if k < v {
            order.select_nth_unstable_by(k - 1, by_prob);
        }
        order[..k].sort_unstable_by(by_prob);
        let mut kept = k;
        if s.top_p < 1.0 {
            let total: f64 = order[..k].iter().map(|&i| p[i as usize]).sum();
            let mut acc = 0.0;
            kept = 1 + order[..k]
                .iter()
                .position(|&i| {
                    acc += p[i as usize];
                    acc >= s.top_p * total
                })
                .unwrap_or(k - 1);
        }
        zero_outside(p, &mut order[..kept]);
    }
    let total: f64 = p.iter().sum();
    let target = uniform(s.seed, r) * total;
    let mut acc = 0.0;
    let mut last = 0;
    for (i, &prob) in p.iter().enumerate().filter(|(_, &prob)| prob > 0.0) {
        acc += prob;
        last = i;
        if acc > target {
            return i;
        }
    }
    last
}

fn kernel<T: FloatElement>(args: &KernelArgs, ctx: BlockCtx, s: Sampling, rows: usize, vocab: usize) {
    let (x, out) = (args.input(0), args.output(0));
    let xs = &x.storage::<T>().expect("dtype dispatched")[x.layout().offset()..];
    let (b, blocks) = (ctx.block_idx as usize, ctx.block_num as usize);
    // SAFETY: block b owns its pieces of the scratch: 2·V f64 (logits, probabilities), then V ids.
    let (logits, p) = unsafe { args.workspace::<f64>(b * 2 * vocab, 2 * vocab) }.split_at_mut(vocab);
    let order = unsafe { args.workspace::<i32>(blocks * 4 * vocab + b * vocab, vocab) };
    let range = ctx.split(rows);
    // SAFETY: this block owns output tokens `range`.
    let dst = unsafe { out.slice_mut::<i64>(out.layout().offset() + range.start, range.len()) };
    for (r, o) in range.zip(dst) {
        for (l, &v) in logits.iter_mut().zip(&xs[r * vocab..(r + 1) * vocab]) {
            *l = v.to_f32() as f64;
        }
        *o = sample_row(logits, &s, r, p, order) as i64;
    }
}

impl Op for Sample {
    fn schema(&self) -> &'static str {
        "sample(Tensor logits, float temperature=1.0, int top_k=0, float top_p=1.0, int seed=0) -> Tensor tokens"
    }

    fn doc(&self) -> &'static str {
        "One int64 token per row of logits [..., V] from softmax(logits / temperature), filtered to the top_k \
         (0 = off) most likely and then the top_p nucleus (1 = off); temperature 0 is greedy. Seeded and \
         reproducible: row r uses its own random stream from (seed, r)."
    }

    fn dtypes(&self) -> &'static [DType] {
        DTYPES
    }

    fn infer(&self, cx: &OpCx) -> Result<Vec<TensorMeta>> {
        sampling(cx)?;
        let shape = cx.input("logits").shape();
        Ok(vec![TensorMeta::contiguous(DType::I64, &shape[..shape.len() - 1])?])
    }

    fn plan(&self, cx: &OpCx) -> Result<Plan> {
        let (s, rows, vocab) = sampling(cx)?;
        let threads = uniop::runtime::Pool::global().threads();
        let block_dim = rows.clamp(1, threads) as u32;
        let step = with_float_dtype!(cx.input("logits").dtype, cx.op(), "logits", |T| {
            Step::new("sample", block_dim, move |args, ctx| kernel::<T>(args, ctx, s, rows, vocab))
        });
        // Per block: 2·V f64 and V i32.
        Ok(Plan::new(vec![step])
            .workspace(block_dim as usize * vocab * 20)
            .inputs_need(vec![LayoutNeed::Contiguous])
            .outputs_need(vec![LayoutNeed::Contiguous]))
    }

    fn reference(&self, cx: &OpCx, inputs: &[Option<RefTensor>]) -> Result<Vec<RefTensor>> {
        let ((s, rows, vocab), x) = (sampling(cx)?, inputs[0].as_ref().unwrap());
        let (mut p, mut order) = (vec![0.0; vocab], vec![0i32; vocab]);
        let tokens =
            (0..rows).map(|r| sample_row(&x.data[r * vocab..(r + 1) * vocab], &s, r, &mut p, &mut order) as f64);
        let shape = &x.shape[..x.shape.len() - 1];
        Ok(vec![RefTensor::new(shape, tokens.collect())])
    }

    fn example(&self, shape: Option<&[usize]>, dtype: DType) -> Result<Example> {
        let meta = TensorMeta::contiguous(dtype, shape.unwrap_or(&[64, 32000]))?;
        Ok(Example {
            inputs: vec![Some(meta)],
            attrs: vec![("top_k".into(), 50i64.into()), ("top_p".into(), 0.9.into()), ("seed".into(), 7i64.into())],
            ranges: vec![Some((-4.0, 4.0))],
        })
    }
}
