//! Gradients of the broadcasting elementwise ops (`add`, `mul`): an operand that broadcasting
//! stretched along some dims fed each of its elements to many outputs, so its gradient is the
//! output gradient (mapped elementwise, `f(dout, other)`) summed over those dims. torch calls this
//! `sum_to_size`; here it is one pass that maps and sums, never materialising the mapped tensor.
//!
//! An operand of the output's own shape needs no sum: its gradient is the elementwise kernel
//! ([`elementwise::unary_at`], [`elementwise::binary_at`]). Otherwise the output's dims split into
//! *kept* ones (the operand has them at full size) and *reduced* ones, and [`steps`] picks the
//! order that reads memory in runs. Every route sums in f32 and is deterministic (no atomics):
//! - along: the innermost output dim is reduced (a `[.., S, 1]` scale's gradient over `[.., S, H]`):
//!   blocks split the gradient's elements, each summing runs of its own elements as a dot
//!   product does;
//! - partials: the innermost output dim is kept and the gradient is small (a `[H]` bias's over
//!   `[.., H]` rows): blocks split the reduced rows, each summing whole rows — memory in order —
//!   into an f32 partial of the whole gradient in the workspace; a second launch adds the partials;
//! - across: the same with a gradient too large for partials: blocks split the gradient's elements,
//!   summing strips of [`STRIP`] of them as vectors, one reduced row at a time.

use crate::elementwise::{self, broadcast, Map1, Map2, CHUNK};
use std::ops::Range;
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

/// How one operand's gradient is computed, decided from the shapes at plan time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Route {
    /// The operand has the output's shape: elementwise.
    Elementwise,
    /// Blocks split the gradient's elements (the along or across order of [`sum_to`]).
    Direct,
    /// Blocks split the reduced rows into `parts` partial sums ([`sum_rows_into_partials`],
    /// then [`add_partials`]).
    Partials { parts: u32 },
}

/// The largest gradient the partials route sums (f32 elements per block's partial, 64 KiB: in L2
/// while the block reads its rows). Past it, rows are long enough for the across order's strips.
const PARTIAL_MAX: usize = 16 * 1024;

/// Whether the innermost dim of `out` of more than one element is one that an operand of shape
/// `grad` was broadcast along.
fn reduces_innermost(grad: &[usize], out: &[usize]) -> bool {
    let lead = out.len() - grad.len();
    let inner = out.iter().rposition(|&size| size != 1);
    inner.is_some_and(|d| d.checked_sub(lead).map_or(1, |g| grad[g]) != out[d])
}

fn route(grad: &[usize], out: &[usize], block_dim: u32) -> Route {
    let (grad_numel, out_numel) = (grad.iter().product::<usize>(), out.iter().product::<usize>());
    if grad == out {
        return Route::Elementwise;
    }
    let rows = out_numel / grad_numel.max(1);
    if grad_numel == 0 || grad_numel > PARTIAL_MAX || rows < 2 || reduces_innermost(grad, out) {
        return Route::Direct;
    }
    Route::Partials { parts: block_dim.min(rows as u32) }
}

/// The steps writing output `o`, the gradient (of shape `grad`) of one operand:
/// `Σ f(dout, other)` over the dims the operand was broadcast along — elementwise where it was
/// not — and the workspace bytes they use. `other`: the input `f` reads beside `dout`, if any (`f`
/// sees 0 otherwise). Steps of several gradients may share the workspace: each launch completes
/// before the next starts.
pub fn steps<T: FloatElement, F: Map2>(
    name: &'static str,
    cx: &OpCx,
    grad: &TensorMeta,
    other: Option<usize>,
    o: usize,
    f: F,
) -> (Vec<Step>, usize) {
    let dout = cx.input("dout");
    let block_dim = block_dim_for(dout.numel(), 3 * dout.dtype.size());
    let streaming = elementwise::streams(grad);
    let operands = Operands { dout: DOUT, other, o };
    match route(grad.shape(), dout.shape(), block_dim) {
        Route::Elementwise => {
            let step = match other {
                Some(x) => Step::new(name, block_dim, move |args, ctx| {
                    elementwise::binary_at::<T, F>(args, ctx, [DOUT, x], o, &f, streaming)
                }),
                None => {
                    let f = OfDout(f);
                    Step::new(name, block_dim, move |args, ctx| {
                        elementwise::unary_at::<T, _>(args, ctx, DOUT, o, &f, streaming)
                    })
                }
            };
            (vec![step], 0)
        }
        Route::Direct => {
            // Blocks split the gradient's elements, so no more of them than there are elements.
            let block_dim = block_dim.min(grad.numel().max(1) as u32);
            (vec![Step::new(name, block_dim, move |args, ctx| sum_to::<T, F>(args, ctx, operands, &f))], 0)
        }
        Route::Partials { parts } => {
            let len = grad.numel();
            let sums = Step::new(name, parts, move |args, ctx| sum_rows_into_partials::<T, F>(args, ctx, operands, &f));
            let block_dim = block_dim_for(len, 4 * parts as usize);
            let total = Step::new(name, block_dim, move |args, ctx| add_partials::<T>(args, ctx, o, parts as usize));
            (vec![sums, total], parts as usize * len * std::mem::size_of::<f32>())
        }
    }
}

/// The kernel arguments of one gradient: input `dout`, the input `other` read beside it (if
/// any), output `o`.
#[derive(Clone, Copy, Debug)]
pub struct Operands {
    dout: usize,
    other: Option<usize>,
    o: usize,
}

/// The output's index space split for one operand's gradient: `kept` walks the gradient's
/// elements (layouts of gradient, `dout`, `other`), `reduced` the output positions that each
/// gradient element sums (layouts of `dout`, `other`, offsets relative to the kept ones).
struct Split<'a, T> {
    kept: StridedRuns<3>,
    reduced: StridedRuns<2>,
    dout: &'a [T],
    other: Option<&'a [T]>,
}

impl<'a, T: FloatElement> Split<'a, T> {
    fn new(args: &'a KernelArgs, operands: Operands) -> Split<'a, T> {
        let (dy, out) = (args.input(operands.dout), args.output(operands.o));
        let (dout, grad) = (dy.layout(), out.layout());
        let shape = dout.shape();
        // Without an `other`, its walk reads `dout`'s offsets and they go unused.
        let other = operands.other.map_or_else(|| dout.clone(), |i| broadcast(args.input(i).layout(), shape));
        let lead = shape.len() - grad.rank();
        let mut kept: [(Vec<usize>, Vec<usize>); 3] = Default::default();
        let mut reduced: [(Vec<usize>, Vec<usize>); 2] = Default::default();
        for (d, &size) in shape.iter().enumerate() {
            let own = d.checked_sub(lead).map_or(1, |g| grad.shape()[g]);
            if own == size {
                let grad_stride = d.checked_sub(lead).map_or(0, |g| grad.strides()[g]);
                for (part, stride) in kept.iter_mut().zip([grad_stride, dout.strides()[d], other.strides()[d]]) {
                    part.0.push(size);
                    part.1.push(stride);
                }
            } else {
                for (part, stride) in reduced.iter_mut().zip([dout.strides()[d], other.strides()[d]]) {
                    part.0.push(size);
                    part.1.push(stride);
                }
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
            dout: dy.storage::<T>().expect("dtype dispatched at plan time"),
            other: operands.other.map(|i| args.input(i).storage::<T>().expect("dtype dispatched at plan time")),
        }
    }

    /// Adds `f(dout, other)` of reduced rows `rows` (flat indices of the reduced dims) at gradient
    /// elements `elems` into `sum` (one per element), row by row.
    #[inline(always)]
    fn add_rows<F: Map2>(&self, rows: Range<usize>, elems: Range<usize>, sum: &mut [f32], f: &F) {
        let [_, sd, sx] = self.kept.inner_strides();
        let [rd, rx] = self.reduced.inner_strides();
        let (mut bd, mut bx) = ([0f32; CHUNK], [0f32; CHUNK]);
        for ([d1, x1], run) in self.reduced.runs(rows.start, rows.end) {
            for i in 0..run {
                let mut at = 0;
                for ([_, d0, x0], len) in self.kept.runs(elems.start, elems.end) {
                    let (d, x) = (d0 + d1 + i * rd, x0 + x1 + i * rx);
                    for j in (0..len).step_by(CHUNK) {
                        let n = CHUNK.min(len - j);
                        elementwise::load(self.dout, d + j * sd, sd, &mut bd[..n]);
                        if let Some(other) = self.other {
                            elementwise::load(other, x + j * sx, sx, &mut bx[..n]);
                        }
                        for ((s, &a), &b) in sum[at + j..at + j + n].iter_mut().zip(&bd[..n]).zip(&bx[..n]) {
                            *s += f.apply::<T>(a, b);
                        }
                    }
                    at += len;
                }
            }
        }
    }
}

/// Gradient elements the across order sums together: their f32 sums stay in L1/L2 (8 KiB) while
/// each reduced row is read in runs this long. In runs of [`CHUNK`] instead, every run of a
/// 4096-row column strip touched a new page (add_backward's bias gradient over 4096x4096 bf16:
/// 38 ms against torch's 10).
const STRIP: usize = 2048;

crate::simd_kernel! {
/// The gradient `= Σ f(dout, other)` over the dims its operand was broadcast along, blocks
/// splitting the gradient's elements (the along and across orders).
fn sum_to<T: FloatElement, F: Map2>(args: &KernelArgs, ctx: BlockCtx, operands: Operands, f: &F) {
    let split = Split::<T>::new(args, operands);
    let out = args.output(operands.o);
    let range = ctx.split(out.layout().numel());
    let [so, sd, sx] = split.kept.inner_strides();
    let rows = split.reduced.numel();
    if reduces_innermost(out.layout().shape(), args.input(operands.dout).layout().shape()) {
        let [rd, rx] = split.reduced.inner_strides();
        let (mut bd, mut bx, mut sum) = ([0f32; CHUNK], [0f32; CHUNK], [0f32; CHUNK]);
        for ([go, d0, x0], len) in split.kept.runs(range.start, range.end) {
            for j in 0..len {
                sum.fill(0.0);
                for ([d1, x1], run) in split.reduced.runs(0, rows) {
                    let (d, x) = (d0 + j * sd + d1, x0 + j * sx + x1);
                    for i in (0..run).step_by(CHUNK) {
                        let n = CHUNK.min(run - i);
                        elementwise::load(split.dout, d + i * rd, rd, &mut bd[..n]);
                        if let Some(other) = split.other {
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
    let mut sum = vec![0f32; STRIP.min(range.len())];
    for start in (range.start..range.end).step_by(STRIP) {
        let end = (start + STRIP).min(range.end);
        let sum = &mut sum[..end - start];
        sum.fill(0.0);
        split.add_rows(0..rows, start..end, sum, f);
        let mut at = 0;
        for ([go, _, _], len) in split.kept.runs(start, end) {
            // SAFETY: blocks own disjoint ranges of gradient elements.
            unsafe { elementwise::store::<T>(&out, go, so, &sum[at..at + len], false) };
            at += len;
        }
    }
}
}

crate::simd_kernel! {
/// The partials route's first launch: block `b` sums its share of the reduced rows, for every
/// gradient element, into workspace partial `b`.
fn sum_rows_into_partials<T: FloatElement, F: Map2>(args: &KernelArgs, ctx: BlockCtx, operands: Operands, f: &F) {
    let split = Split::<T>::new(args, operands);
    let len = args.output(operands.o).layout().numel();
    // SAFETY: each block owns its partial; the plan sized the workspace for one per block.
    let sum = unsafe { args.workspace::<f32>(ctx.block_idx as usize * len, len) };
    sum.fill(0.0);
    split.add_rows(ctx.split(split.reduced.numel()), 0..len, sum, f);
}
}

/// The partials route's second launch: output `o` = the sum of the `parts` partials, blocks
/// splitting its elements.
fn add_partials<T: FloatElement>(args: &KernelArgs, ctx: BlockCtx, o: usize, parts: usize) {
    let out = args.output(o);
    let len = out.layout().numel();
    let range = ctx.split(len);
    // SAFETY: the first launch has completed; this one only reads the partials.
    let partials = unsafe { &*(args.workspace::<f32>(0, parts * len) as *const [f32]) };
    // The output's elements in order are the gradient's, in the order the partials hold them.
    let walk = StridedRuns::<1>::new([out.layout()]);
    let [so] = walk.inner_strides();
    let mut sum = [0f32; CHUNK];
    let mut at = range.start;
    for ([go], run) in walk.runs(range.start, range.end) {
        for j in (0..run).step_by(CHUNK) {
            let (n, e) = (CHUNK.min(run - j), at + j);
            sum[..n].copy_from_slice(&partials[e..e + n]);
            for part in partials.chunks_exact(len).skip(1) {
                for (s, &v) in sum[..n].iter_mut().zip(&part[e..e + n]) {
                    *s += v;
                }
            }
            // SAFETY: blocks own disjoint ranges of gradient elements.
            unsafe { elementwise::store::<T>(&out, go + j * so, so, &sum[..n], false) };
        }
        at += run;
    }
}
