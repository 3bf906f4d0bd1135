//! Gradients of the broadcasting elementwise ops (`add`, `mul`): an operand that broadcasting
//! stretched along some dims fed each of its elements to many outputs, so its gradient is the
//! output gradient (mapped elementwise, `f(dout, other)`) summed over those dims. torch calls this
//! `sum_to_size`; here it is one pass that maps and sums, never materialising the mapped tensor.
//!
//! An operand of the output's own shape needs no sum: its gradient is the elementwise kernel
//! ([`elementwise::unary_at`], [`elementwise::binary_at`]), which [`Reduction::of`] tells the
//! backward ops to take. Otherwise the output's dims split into *kept* ones (the operand has them
//! at full size) and *reduced* ones; each block owns a range of the gradient's elements
//! (deterministic, no atomics) and sums in f32 lanes, in the order that reads memory in runs:
//! - along: the innermost output dim is reduced (a `[.., S, 1]` scale's gradient over `[.., S, H]`):
//!   each gradient element sums runs of its own elements, as a dot product does;
//! - across: the innermost output dim is kept (a `[H]` weight's gradient over `[.., H]` rows):
//!   chunks of [`CHUNK`] neighbouring gradient elements are summed as vectors, one reduced row at
//!   a time, so each row is read in [`CHUNK`]-long runs.

use crate::elementwise::{self, broadcast, Map1, Map2, CHUNK};
use uniop::{
    block_dim_for, AttrValue, BlockCtx, DType, Element, Example, FloatElement, KernelArgs, Layout, OpCx, RefTensor,
    Result, Step, StridedRuns, TensorMeta,
};

/// Kernel argument positions shared by the backward ops: `(dout, a, b, ...) -> (da, db)`.
pub const DOUT: usize = 0;
pub const A: usize = 1;
pub const B: usize = 2;

/// Whether the caller asks for the gradient of `operand` (`needs_d<operand>`, true unless false).
pub fn needs(cx: &OpCx, operand: &str) -> bool {
    !matches!(cx.attr(&format!("needs_d{operand}")), AttrValue::Bool(false))
}

/// Checks the arguments of a broadcasting binary op's backward, `(dout, a, b, ..., needs_da,
/// needs_db)`, and returns the metas of `(da, db)`: each its operand's shape and dtype, or empty
/// (`[0]`) where not asked for.
pub fn infer(cx: &OpCx, dtypes: &[DType]) -> Result<Vec<TensorMeta>> {
    let dtype = cx.expect_dtype_in("dout", dtypes)?;
    cx.expect_same_dtype("a", dtype, "dout")?;
    cx.expect_same_dtype("b", dtype, "dout")?;
    cx.expect_shape("dout", &elementwise::broadcast_inputs(cx, "a", "b")?)?;
    ["a", "b"]
        .into_iter()
        .map(|operand| TensorMeta::contiguous(dtype, if needs(cx, operand) { cx.input(operand).shape() } else { &[0] }))
        .collect()
}

/// The reference gradient of `operand` from the mapped output gradient `mapped` (`f(dout, other)`
/// at each output position): summed down to the operand's shape, or empty where not asked for.
pub fn reference(cx: &OpCx, operand: &str, mapped: &RefTensor) -> RefTensor {
    if needs(cx, operand) {
        mapped.sum_to(cx.input(operand).shape())
    } else {
        RefTensor::new(&[0], Vec::new())
    }
}

/// How much larger than one rounding a gradient's error may be: an f32 sum of `n` terms grows
/// like √n, and the most any gradient element sums is `dout`'s size over its operand's.
pub fn error_scale(cx: &OpCx) -> f64 {
    let dout = cx.input("dout").numel().max(1) as f64;
    let fewest = cx.input("a").numel().min(cx.input("b").numel()).max(1) as f64;
    (dout / fewest).sqrt().max(1.0)
}

/// Inputs `(dout, a, b)` for a backward op: `a` and `dout` of the given shape (default
/// 4096x4096), `b` its last dim, broadcast along the others as a per-channel scale or bias is.
pub fn example(shape: Option<&[usize]>, dtype: DType) -> Result<Example> {
    let shape = shape.unwrap_or(&[4096, 4096]);
    let full = TensorMeta::contiguous(dtype, shape)?;
    let b = TensorMeta::contiguous(dtype, &shape[shape.len().saturating_sub(1)..])?;
    Ok(Example { inputs: vec![Some(full.clone()), Some(full), Some(b)], ..Default::default() })
}

/// A [`Map2`] of `dout` alone as the [`Map1`] the elementwise kernel takes.
struct OfDout<F>(F);

impl<F: Map2> Map1 for OfDout<F> {
    #[inline(always)]
    fn apply<T: Element>(&self, dout: f32) -> f32 {
        self.0.apply::<T>(dout, 0.0)
    }
}

/// The step writing output `o`, the gradient (of shape `grad`) of one operand:
/// `Σ f(dout, other)` over the dims the operand was broadcast along — elementwise where it was
/// not. `other`: the input `f` reads beside `dout`, if any (`f` sees 0 otherwise).
pub fn step<T: FloatElement, F: Map2>(
    name: &'static str,
    cx: &OpCx,
    grad: &TensorMeta,
    other: Option<usize>,
    o: usize,
    f: F,
) -> Step {
    let dout = cx.input("dout");
    let block_dim = block_dim_for(dout.numel(), 3 * dout.dtype.size());
    if grad.shape() != dout.shape() {
        // Blocks split the gradient's elements, so no more of them than there are elements.
        let block_dim = block_dim.min(grad.numel().max(1) as u32);
        return Step::new(name, block_dim, move |args, ctx| sum_to::<T, F>(args, ctx, DOUT, other, o, &f));
    }
    let streaming = elementwise::streams(grad);
    match other {
        Some(x) => Step::new(name, block_dim, move |args, ctx| {
            elementwise::binary_at::<T, F>(args, ctx, [DOUT, x], o, &f, streaming)
        }),
        None => {
            let f = OfDout(f);
            Step::new(name, block_dim, move |args, ctx| {
                elementwise::unary_at::<T, _>(args, ctx, DOUT, o, &f, streaming)
            })
        }
    }
}

/// The output's index space split for one operand's gradient: `kept` walks the gradient's
/// elements (layouts of gradient, `dout`, `other`), `reduced` the output positions that each
/// gradient element sums (layouts of `dout`, `other`, offsets relative to the kept ones).
struct Split {
    kept: StridedRuns<3>,
    reduced: StridedRuns<2>,
    /// Whether the innermost output dim (of more than one element) is a reduced one.
    reduces_innermost: bool,
}

impl Split {
    fn new(grad: &Layout, dout: &Layout, other: &Layout) -> Split {
        let shape = dout.shape();
        let lead = shape.len() - grad.rank();
        let mut kept: [(Vec<usize>, Vec<usize>); 3] = Default::default();
        let mut reduced: [(Vec<usize>, Vec<usize>); 2] = Default::default();
        let mut reduces_innermost = false;
        for (d, &size) in shape.iter().enumerate() {
            let own = d.checked_sub(lead).map_or(1, |g| grad.shape()[g]);
            if own == size {
                let grad_stride = d.checked_sub(lead).map_or(0, |g| grad.strides()[g]);
                for (part, stride) in kept.iter_mut().zip([grad_stride, dout.strides()[d], other.strides()[d]]) {
                    part.0.push(size);
                    part.1.push(stride);
                }
                reduces_innermost &= size == 1;
            } else {
                for (part, stride) in reduced.iter_mut().zip([dout.strides()[d], other.strides()[d]]) {
                    part.0.push(size);
                    part.1.push(stride);
                }
                reduces_innermost = true;
            }
        }
        let layout = |(shape, strides): &(Vec<usize>, Vec<usize>), offset| {
            Layout::strided(shape, strides, offset).expect("a view of layouts the launch checked")
        };
        let [g, d, o] = &kept;
        let [rd, ro] = &reduced;
        Split {
            kept: StridedRuns::new([&layout(g, grad.offset()), &layout(d, dout.offset()), &layout(o, other.offset())]),
            reduced: StridedRuns::new([&layout(rd, 0), &layout(ro, 0)]),
            reduces_innermost,
        }
    }
}

crate::simd_kernel! {
/// Output `o` (the gradient of an operand broadcast to `dout`'s shape) `= Σ f(dout, other)` over
/// the dims the operand was broadcast along; `other` (an input, broadcast to `dout`'s shape too)
/// is read only when given (`f` sees 0 otherwise). Blocks split the gradient's elements.
pub fn sum_to<T: FloatElement, F: Map2>(args: &KernelArgs, ctx: BlockCtx, dout: usize, other: Option<usize>, o: usize, f: &F) {
    let (dy, out) = (args.input(dout), args.output(o));
    let shape = dy.layout().shape();
    // Without an `other`, its walk reads `dout`'s offsets and they go unused.
    let other_layout = other.map_or_else(|| dy.layout().clone(), |i| broadcast(args.input(i).layout(), shape));
    let split = Split::new(out.layout(), dy.layout(), &other_layout);
    let dy = dy.storage::<T>().expect("dtype dispatched at plan time");
    let other = other.map(|i| args.input(i).storage::<T>().expect("dtype dispatched at plan time"));
    let range = ctx.split(out.layout().numel());
    let [so, sd, sx] = split.kept.inner_strides();
    let [rd, rx] = split.reduced.inner_strides();
    let reduced = split.reduced.numel();
    let (mut bd, mut bx) = ([0f32; CHUNK], [0f32; CHUNK]);
    let mut sum = [0f32; CHUNK];
    if split.reduces_innermost {
        for ([go, d0, x0], len) in split.kept.runs(range.start, range.end) {
            for j in 0..len {
                sum.fill(0.0);
                for ([d1, x1], run) in split.reduced.runs(0, reduced) {
                    let (d, x) = (d0 + j * sd + d1, x0 + j * sx + x1);
                    for i in (0..run).step_by(CHUNK) {
                        let n = CHUNK.min(run - i);
                        elementwise::load(dy, d + i * rd, rd, &mut bd[..n]);
                        if let Some(other) = other {
                            elementwise::load(other, x + i * rx, rx, &mut bx[..n]);
                        }
                        for ((s, &a), &b) in sum[..n].iter_mut().zip(&bd[..n]).zip(&bx[..n]) {
                            *s += f.apply::<T>(a, b);
                        }
                    }
                }
                let total = [sum.iter().sum::<f32>()];
                // SAFETY: blocks own disjoint ranges of gradient elements.
                unsafe { elementwise::store::<T>(&out, go + j * so, so, &total, false) };
            }
        }
        return;
    }
    for start in (range.start..range.end).step_by(CHUNK) {
        let end = (start + CHUNK).min(range.end);
        let n = end - start;
        sum[..n].fill(0.0);
        for ([d1, x1], run) in split.reduced.runs(0, reduced) {
            for i in 0..run {
                let mut at = 0;
                for ([_, d0, x0], len) in split.kept.runs(start, end) {
                    elementwise::load(dy, d0 + d1 + i * rd, sd, &mut bd[at..at + len]);
                    if let Some(other) = other {
                        elementwise::load(other, x0 + x1 + i * rx, sx, &mut bx[at..at + len]);
                    }
                    at += len;
                }
                for ((s, &a), &b) in sum[..n].iter_mut().zip(&bd[..n]).zip(&bx[..n]) {
                    *s += f.apply::<T>(a, b);
                }
            }
        }
        let mut at = 0;
        for ([go, _, _], len) in split.kept.runs(start, end) {
            // SAFETY: blocks own disjoint ranges of gradient elements.
            unsafe { elementwise::store::<T>(&out, go, so, &sum[at..at + len], false) };
            at += len;
        }
    }
}
}
