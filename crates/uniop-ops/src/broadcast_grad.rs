//! Gradients of the broadcasting elementwise ops (`add`, `mul`): an operand that broadcasting
//! stretched along some dims fed each of its elements to many outputs, so its gradient is the
//! output gradient (mapped elementwise, `f(dout, other)`) summed over those dims. torch calls this
//! `sum_to_size`; here it is one pass that maps and sums, never materialising the mapped tensor.
//!
//! An operand of the output's own shape needs no sum: its gradient is the elementwise kernel
//! ([`elementwise::unary_at`], [`elementwise::binary_at`]). Otherwise the output's dims split into
//! *kept* ones (the operand has them at full size) and *reduced* ones, and [`pair_steps`] picks
//! the order that reads memory in runs. Every route sums in f32 and is deterministic (no atomics):
//! - along: the innermost output dim is reduced (a `[.., S, 1]` scale's gradient over `[.., S, H]`):
//!   blocks split the gradient's elements, each summing runs of its own elements as a dot
//!   product does;
//! - partials: the innermost output dim is kept and the gradient is small (a `[H]` bias's over
//!   `[.., H]` rows): blocks split the reduced rows, each summing whole rows — memory in order —
//!   into an f32 partial of the whole gradient in the workspace; a second launch adds the partials
//!   (`x + bias`, and `x · scale` in f32 and natively narrowed bf16: the same pass writes `x`'s
//!   gradient);
//! - across: the same with a gradient too large for partials: blocks split the gradient's elements,
//!   summing strips of [`STRIP`] of them as vectors, one reduced row at a time.

use crate::elementwise::{self, broadcast, Map1, Map2, CHUNK, LANES};
use std::ops::Range;
use uniop::{
    block_dim_for, BlockCtx, DType, Element, Example, FloatElement, KernelArgs, Layout, OpCx, OutputView, RefTensor,
    Result, Step, StridedRuns, TensorMeta,
};

/// Kernel argument positions shared by the backward ops: `(dout, a, b, ...) -> (da, db)`.
pub const DOUT: usize = 0;
pub const A: usize = 1;
pub const B: usize = 2;

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
        .map(|operand| TensorMeta::contiguous(dtype, &cx.grad_shape(operand, cx.input(operand).shape())))
        .collect()
}

/// The reference gradient of `operand` from the mapped output gradient `mapped` (`f(dout, other)`
/// at each output position): summed down to the operand's shape, or empty where not asked for.
pub fn reference(cx: &OpCx, operand: &str, mapped: &RefTensor) -> RefTensor {
    if cx.needs_grad(operand) {
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
    // (Taken in usize: `rows as u32` wraps to 0 at 2^32 rows, and a launch of 0 blocks runs nothing.)
    Route::Partials { parts: rows.min(block_dim as usize) as u32 }
}

/// The steps writing output `o`, the gradient (of shape `grad`) of one operand:
/// `Σ f(dout, other)` over the dims the operand was broadcast along — elementwise where it was
/// not — and the workspace bytes they use. `other`: the input `f` reads beside `dout`, if any (`f`
/// sees 0 otherwise). Steps of several gradients may share the workspace: each launch completes
/// before the next starts.
fn steps<T: FloatElement, F: Map2>(
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
            let block_dim = grad.numel().clamp(1, block_dim as usize) as u32;
            (vec![Step::new(name, block_dim, move |args, ctx| sum_to::<T, F>(args, ctx, operands, &f))], 0)
        }
        Route::Partials { parts } => {
            let sums = Step::new(name, parts, move |args, ctx| {
                sum_rows_into_partials::<T, F, F>(args, ctx, operands, &f, None)
            });
            partial_steps::<T>(name, sums, grad.numel(), o, parts)
        }
    }
}

/// The steps writing both gradients of a broadcasting binary op (`wanted[o]`: the input read
/// beside `dout` and the map for output `o`, where asked for) and the workspace bytes they use.
/// Where one operand has the output's shape and the other takes the partials route (`x + bias`,
/// `x · scale`), one pass over `dout` computes both: the row-splitting blocks write the full
/// operand's gradient at the positions they read for the small one's partials (add_backward at
/// 4096x4096 f32: 8.8 → 6.6–7.3 ms; bf16 level at 5.0–6.1) — in f16, and bf16 on CPUs without
/// AVX512-BF16, only where the full gradient reads `dout` alone (add's, not mul's).
pub fn pair_steps<T: FloatElement, F: Map2>(
    name: &'static str,
    cx: &OpCx,
    grads: &[TensorMeta],
    wanted: [Option<(Option<usize>, F)>; 2],
) -> (Vec<Step>, usize) {
    let dout = cx.input("dout");
    let block_dim = block_dim_for(dout.numel(), 3 * dout.dtype.size());
    let routes = [0, 1].map(|o| route(grads[o].shape(), dout.shape(), block_dim));
    let fused = match routes {
        [Route::Elementwise, Route::Partials { parts }] => Some((1, parts)),
        [Route::Partials { parts }, Route::Elementwise] => Some((0, parts)),
        _ => None,
    };
    // Where the full gradient reads a second input (mul's): f32, and bf16 where the CPU narrows it
    // (AVX512-BF16), not f16. With the dense steps in registers, the fused pass ran mul_backward
    // 4096x4096 f32 7.9–8.4 → 5.4–6.8 ms on Zen 4; bf16 ran level at that size and slower in cache
    // (0.053 → 0.059 ms, 64x4096, one thread) until its steps narrowed in registers too, then
    // faster (0.048–0.057 → 0.041–0.043), while f16 ran slower in cache (0.080 → 0.093) and level
    // at 4096x4096. Before the register steps, f32 ran level (10.3–11.3 against 11.2) and bf16
    // slower (8.7–10.3 against 7.7) on an AVX2 EPYC, which keeps two passes for bf16.
    let fuses_with_other = T::DTYPE == DType::F32 || (T::DTYPE == DType::BF16 && T::converts_natively());
    let fused = fused.filter(|&(small, _)| fuses_with_other || matches!(wanted[1 - small], Some((None, _))));
    match (fused, wanted) {
        (Some((small, parts)), [Some(a), Some(b)]) => {
            let ((small_other, fs), (full_other, ff)) = if small == 0 { (a, b) } else { (b, a) };
            let small_ops = Operands { dout: DOUT, other: small_other, o: small };
            let full_ops = Operands { dout: DOUT, other: full_other, o: 1 - small };
            let streaming = elementwise::streams(&grads[1 - small]);
            let sums = Step::new(name, parts, move |args, ctx| {
                sum_rows_into_partials::<T, F, F>(args, ctx, small_ops, &fs, Some((full_ops, &ff, streaming)))
            });
            partial_steps::<T>(name, sums, grads[small].numel(), small, parts)
        }
        (_, wanted) => {
            let (mut all, mut workspace) = (Vec::new(), 0);
            for (o, want) in wanted.into_iter().enumerate() {
                if let Some((other, f)) = want {
                    let (more, bytes) = steps::<T, F>(name, cx, &grads[o], other, o, f);
                    all.extend(more);
                    workspace = workspace.max(bytes);
                }
            }
            (all, workspace)
        }
    }
}

/// The partials route's steps: `sums` (its first launch, `parts` blocks) and the launch adding the
/// partials of a gradient of `len` elements into output `o`; and the workspace bytes they use.
fn partial_steps<T: FloatElement>(
    name: &'static str,
    sums: Step,
    len: usize,
    o: usize,
    parts: u32,
) -> (Vec<Step>, usize) {
    let block_dim = block_dim_for(len, 4 * parts as usize);
    let total = Step::new(name, block_dim, move |args, ctx| add_partials::<T>(args, ctx, o, parts as usize));
    (vec![sums, total], parts as usize * len * std::mem::size_of::<f32>())
}

/// The kernel arguments of one gradient: input `dout`, the input `other` read beside it (if
/// any), output `o`.
#[derive(Clone, Copy, Debug)]
struct Operands {
    dout: usize,
    other: Option<usize>,
    o: usize,
}

/// The output's index space split for one operand's gradient: `kept` walks the gradient's
/// elements (layouts of the gradient, `dout`, `other`, then the fused full gradient and its
/// `other`), `reduced` the output positions that each gradient element sums (the same but the
/// gradient, offsets relative to the kept ones). Without a fused gradient its two layouts are
/// `dout`'s, walked and unused, so that every walk merges dims alike.
struct Split<'a, T> {
    kept: StridedRuns<5>,
    reduced: StridedRuns<4>,
    dout: &'a [T],
    other: Option<&'a [T]>,
    fused_other: Option<&'a [T]>,
}

impl<'a, T: FloatElement> Split<'a, T> {
    fn new(args: &'a KernelArgs, operands: Operands, fused: Option<Operands>) -> Split<'a, T> {
        let (dy, out) = (args.input(operands.dout), args.output(operands.o));
        let (dout, grad) = (dy.layout(), out.layout());
        let shape = dout.shape();
        let broadcast_input =
            |i: Option<usize>| i.map_or_else(|| dout.clone(), |i| broadcast(args.input(i).layout(), shape));
        let other = broadcast_input(operands.other);
        let fused_out = fused.map_or_else(|| dout.clone(), |f| args.output(f.o).layout().clone());
        let fused_other = broadcast_input(fused.and_then(|f| f.other));
        let lead = shape.len() - grad.rank();
        let mut kept: [(Vec<usize>, Vec<usize>); 5] = Default::default();
        let mut reduced: [(Vec<usize>, Vec<usize>); 4] = Default::default();
        for (d, &size) in shape.iter().enumerate() {
            let own = d.checked_sub(lead).map_or(1, |g| grad.shape()[g]);
            let strides = [dout, &other, &fused_out, &fused_other].map(|l| l.strides()[d]);
            if own == size {
                let grad_stride = d.checked_sub(lead).map_or(0, |g| grad.strides()[g]);
                for (part, stride) in kept.iter_mut().zip(std::iter::once(grad_stride).chain(strides)) {
                    part.0.push(size);
                    part.1.push(stride);
                }
            } else {
                for (part, stride) in reduced.iter_mut().zip(strides) {
                    part.0.push(size);
                    part.1.push(stride);
                }
            }
        }
        let layout = |(shape, strides): &(Vec<usize>, Vec<usize>), offset| {
            Layout::strided(shape, strides, offset).expect("a view of layouts the launch checked")
        };
        let offsets = [grad, dout, &other, &fused_out, &fused_other].map(Layout::offset);
        let kept: [Layout; 5] = std::array::from_fn(|k| layout(&kept[k], offsets[k]));
        let reduced: [Layout; 4] = std::array::from_fn(|k| layout(&reduced[k], 0));
        let storage = |i: usize| args.input(i).storage::<T>().expect("dtype dispatched at plan time");
        Split {
            kept: StridedRuns::new(kept.each_ref()),
            reduced: StridedRuns::new(reduced.each_ref()),
            dout: storage(operands.dout),
            other: operands.other.map(storage),
            fused_other: fused.and_then(|f| f.other).map(storage),
        }
    }

    /// Adds `f(dout, other)` of reduced rows `rows` (flat indices of the reduced dims) at gradient
    /// elements `elems` into `sum` (one per element), row by row; and where `fused` gives the full
    /// operand's gradient, writes it at the positions read (`g(dout, its other)`), narrowed by the
    /// CPU's instruction where `NATIVE` (only where `T::converts_natively()`).
    #[inline(always)]
    fn add_rows<F: Map2, G: Map2, const NATIVE: bool>(
        &self,
        rows: Range<usize>,
        elems: Range<usize>,
        sum: &mut [f32],
        f: &F,
        fused: Option<(&OutputView, &G, bool)>,
    ) {
        let [_, sd, sx, sf, sy] = self.kept.inner_strides();
        let [rd, rx, rf, ry] = self.reduced.inner_strides();
        let dense = sd == 1
            && (self.other.is_none() || sx == 1)
            && (fused.is_none() || sf == 1 && (self.fused_other.is_none() || sy == 1));
        let (mut bd, mut bx, mut by) = ([0f32; CHUNK], [0f32; CHUNK], [0f32; CHUNK]);
        for ([d1, x1, f1, y1], run) in self.reduced.runs(rows.start, rows.end) {
            for i in 0..run {
                let mut at = 0;
                for ([_, d0, x0, f0, y0], len) in self.kept.runs(elems.start, elems.end) {
                    let (d, x) = (d0 + d1 + i * rd, x0 + x1 + i * rx);
                    let (fo, y) = (f0 + f1 + i * rf, y0 + y1 + i * ry);
                    let whole = if dense { len / LANES * LANES } else { 0 };
                    for j in (0..whole).step_by(LANES) {
                        let fused = fused.map(|(out, g, streaming)| (out, g, streaming, fo + j, y + j));
                        self.add_lanes::<F, G, NATIVE>(d + j, x + j, &mut sum[at + j..at + j + LANES], f, fused);
                    }
                    for j in (whole..len).step_by(CHUNK) {
                        let n = CHUNK.min(len - j);
                        elementwise::load(self.dout, d + j * sd, sd, &mut bd[..n]);
                        if let Some(other) = self.other {
                            elementwise::load(other, x + j * sx, sx, &mut bx[..n]);
                        }
                        for ((s, &a), &b) in sum[at + j..at + j + n].iter_mut().zip(&bd[..n]).zip(&bx[..n]) {
                            *s += f.apply::<T>(a, b);
                        }
                        if let Some((out, g, streaming)) = fused {
                            match self.fused_other {
                                Some(other) => elementwise::load(other, y + j * sy, sy, &mut by[..n]),
                                None => by[..n].fill(0.0),
                            }
                            for (b, &a) in by[..n].iter_mut().zip(&bd[..n]) {
                                *b = g.apply::<T>(a, *b);
                            }
                            // SAFETY: each output position is read for one reduced row and gradient
                            // element, which one block owns.
                            unsafe { elementwise::store::<T>(out, fo + j * sf, sf, &by[..n], streaming) };
                        }
                    }
                    at += len;
                }
            }
        }
    }

    /// [`Self::add_rows`] on one dense step of `LANES` elements: `dout` at `d`, `other` at `x`,
    /// and the fused gradient's output and other at the two offsets `fused` ends with. The step
    /// stays in registers: through the chunk buffers, Zen 4 reloaded as 512-bit vectors what it had
    /// just stored, which it does not forward, at about a cycle an element. add_backward with a
    /// bias, alternated on Zen 4: 64x4096 in cache, one thread, f32 0.078–0.159 → 0.040–0.050 ms,
    /// bf16 0.068–0.097 → 0.058–0.076; 4096x4096 f32 3.5–8.8 → 2.8–4.3, bf16 2.9–4.8 → 2.6–3.2.
    #[inline(always)]
    fn add_lanes<F: Map2, G: Map2, const NATIVE: bool>(
        &self,
        d: usize,
        x: usize,
        sum: &mut [f32],
        f: &F,
        fused: Option<(&OutputView, &G, bool, usize, usize)>,
    ) {
        let widen = |data: &[T], at: usize| T::widen_lanes::<LANES>(data[at..at + LANES].try_into().expect("a step"));
        let dout = widen(self.dout, d);
        let other = self.other.map_or([0.0; LANES], |other| widen(other, x));
        for ((s, &a), &b) in sum.iter_mut().zip(&dout).zip(&other) {
            *s += f.apply::<T>(a, b);
        }
        let Some((out, g, streaming, fo, y)) = fused else { return };
        // A second loop rather than one writing both: that ran f32 2.5x slower (0.040 -> 0.10-0.13
        // ms, the shape above) for bf16 0.059 -> 0.055.
        let mut grad = self.fused_other.map_or([0.0; LANES], |other| widen(other, y));
        for (r, &a) in grad.iter_mut().zip(&dout) {
            *r = g.apply::<T>(a, *r);
        }
        // SAFETY: as in `add_rows`, the block owns these output positions.
        let dst = unsafe { out.slice_mut::<T>(fo, LANES) };
        elementwise::store_step::<T, NATIVE>(&grad, dst, streaming);
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
    let split = Split::<T>::new(args, operands, None);
    let out = args.output(operands.o);
    let range = ctx.split(out.layout().numel());
    let [so, sd, sx, _, _] = split.kept.inner_strides();
    let rows = split.reduced.numel();
    if reduces_innermost(out.layout().shape(), args.input(operands.dout).layout().shape()) {
        let [rd, rx, _, _] = split.reduced.inner_strides();
        let (mut bd, mut bx, mut sum) = ([0f32; CHUNK], [0f32; CHUNK], [0f32; CHUNK]);
        for ([go, d0, x0, _, _], len) in split.kept.runs(range.start, range.end) {
            for j in 0..len {
                sum.fill(0.0);
                for ([d1, x1, _, _], run) in split.reduced.runs(0, rows) {
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
        split.add_rows::<F, F, false>(0..rows, start..end, sum, f, None);
        let mut at = 0;
        for ([go, ..], len) in split.kept.runs(start, end) {
            // SAFETY: blocks own disjoint ranges of gradient elements.
            unsafe { elementwise::store::<T>(&out, go, so, &sum[at..at + len], false) };
            at += len;
        }
    }
}
}

crate::simd_kernel! {
/// The partials route's first launch: block `b` sums its share of the reduced rows, for every
/// gradient element, into workspace partial `b`; and writes the `fused` full gradient (operands,
/// map, whether to stream) at the positions it reads.
fn sum_rows_into_partials<T: FloatElement, F: Map2, G: Map2>(
    args: &KernelArgs,
    ctx: BlockCtx,
    operands: Operands,
    f: &F,
    fused: Option<(Operands, &G, bool)>,
) {
    let split = Split::<T>::new(args, operands, fused.map(|(full, ..)| full));
    let len = args.output(operands.o).layout().numel();
    // SAFETY: each block owns its partial; the plan sized the workspace for one per block.
    let sum = unsafe { args.workspace::<f32>(ctx.block_idx as usize * len, len) };
    sum.fill(0.0);
    let rows = ctx.split(split.reduced.numel());
    match fused {
        Some((full, g, streaming)) => {
            let out = Some((&args.output(full.o), g, streaming));
            if T::converts_natively() {
                split.add_rows::<F, G, true>(rows, 0..len, sum, f, out);
            } else {
                split.add_rows::<F, G, false>(rows, 0..len, sum, f, out);
            }
            elementwise::fence();
        }
        None => split.add_rows::<F, G, false>(rows, 0..len, sum, f, None),
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partial_sums_take_every_block_however_many_rows() {
        // 2^32 rows: as many parts as blocks, not `2^32 as u32` = 0 of them.
        assert!(matches!(route(&[2], &[1 << 32, 2], 8), Route::Partials { parts: 8 }));
        assert!(matches!(route(&[4], &[3, 4], 8), Route::Partials { parts: 3 }));
    }
}
