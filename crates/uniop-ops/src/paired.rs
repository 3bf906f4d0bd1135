//! Gated activations on the gate/up pairs of one tensor — a mixture-of-experts layer's fused
//! `gate_up` product — whose gate takes a model's config values: [`clamped_swiglu`] (GPT-OSS,
//! DeepSeek V4, Step 3.7 and others) and [`softcapped_swiglu`] (Inkling 2). One forward and one
//! backward kernel over the pairs' layout ([`Pairs`]: interleaved or halves), each one pass in f32
//! rounded once, and one generic [`Op`] for each direction ([`PairOp`], [`PairBackwardOp`]); what
//! a family adds is a [`PairGate`]: its schemas, its constants (validated from the call), its f64
//! reference and the [`PairFn`] its kernels compute with.
//!
//! Why the function is a type of the kernels rather than a runtime choice: kernels are compiled
//! once per instruction set ([`simd_kernel!`](crate::simd_kernel)) and only code inlined into them
//! gets wide vectors (see [`gate`](crate::gate)'s note); a family with variants (the clamp's
//! placement) picks its type at plan time, so each variant compiles to a loop of its own.
//!
//! [`clamped_swiglu`]: crate::clamped_swiglu
//! [`softcapped_swiglu`]: crate::softcapped_swiglu

use crate::elementwise::{fence, store_step, streams_bytes, to_f32, LANES};
use crate::gated_mul::DTYPES;
use std::marker::PhantomData;
use std::ops::Range;
use uniop::{
    block_dim_for, with_float_dtype, AttrValue, BlockCtx, DType, Element, ErrorCode, Example, FloatElement, KernelArgs,
    LayoutNeed, Op, OpCx, OutputView, Plan, RefTensor, Result, Step, TensorMeta,
};

/// A gated activation of a pair as the kernels compute it, in f32 for results stored as `T`.
pub(crate) trait PairFn: Copy + Send + Sync + 'static {
    /// The output at gate `g` and up value `u`.
    fn value<T: Element>(self, g: f32, u: f32) -> f32;
    /// `(d gate, d up)` for the output's gradient `d`.
    fn grads<T: Element>(self, d: f32, g: f32, u: f32) -> (f32, f32);
}

/// What [`PairGate::with_fn`] hands its [`PairFn`] to: a generic function as a value.
pub(crate) trait PairFnUser {
    type Out;
    fn call<F: PairFn>(self, f: F) -> Self::Out;
}

/// A family of gated activations on pairs: its ops' schemas and docs, and one call's constants.
pub(crate) trait PairGate: Copy + Send + Sync + 'static {
    /// The forward's schema: `x`, then the family's constants, then `bool interleaved`.
    const SCHEMA: &'static str;
    const DOC: &'static str;
    /// The backward's schema: `dout, x` and the forward's arguments.
    const BACKWARD_SCHEMA: &'static str;
    const BACKWARD_DOC: &'static str;
    /// The range examples draw `x` from: past the family's bounds, so that they are exercised.
    const EXAMPLE_RANGE: (f64, f64);

    /// This call's constants, validated (an invalid one is named in the error).
    fn of(cx: &OpCx) -> Result<Self>;

    /// `(out, d out/d gate, d out/d up)` at `(g, u)` in f64, for references.
    fn exact(self, g: f64, u: f64) -> (f64, f64, f64);

    /// `user` called with the [`PairFn`] this call computes with.
    fn with_fn<U: PairFnUser>(self, user: U) -> U::Out;
}

/// Where output `j`'s gate and up value sit in `x` (both contiguous): `half` is the output's last
/// dim, `x`'s is twice it.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Pairs {
    /// `x[.., 2j]` and `x[.., 2j + 1]` (GPT-OSS).
    Interleaved,
    /// `x[.., j]` and `x[.., half + j]` (transformers' default experts layout).
    Halves { half: usize },
}

impl Pairs {
    /// Validates `x` (float, last dim even) and reads `interleaved`; returns the pairs' layout and
    /// the output's shape (`x`'s with the last dim halved).
    pub(crate) fn of(cx: &OpCx) -> Result<(Pairs, Vec<usize>)> {
        cx.expect_dtype_in("x", DTYPES)?;
        cx.expect_min_rank("x", 1)?;
        let interleaved = matches!(cx.attr("interleaved"), AttrValue::Bool(true));
        let mut shape = cx.input("x").shape().to_vec();
        let last = shape.last_mut().unwrap();
        if !last.is_multiple_of(2) {
            let pairs = if interleaved { "gate and up interleaved" } else { "a gate half and an up half" };
            return Err(cx.err(ErrorCode::Shape, "x", format!("an even last dim ({pairs})"), *last));
        }
        *last /= 2;
        let pairs = if interleaved { Pairs::Interleaved } else { Pairs::Halves { half: *last } };
        Ok((pairs, shape))
    }

    /// The flat indices in `x` of output `j`'s gate and up value.
    pub(crate) fn at(self, j: usize) -> (usize, usize) {
        match self {
            Pairs::Interleaved => (2 * j, 2 * j + 1),
            Pairs::Halves { half } => {
                let gate = j / half * 2 * half + j % half;
                (gate, gate + half)
            }
        }
    }

    /// The output elements `range` as stretches whose gates and up values lie at one stride each
    /// (2 interleaved, 1 in halves) from their first ones: the whole range when interleaved, one
    /// stretch per row (or part of one) in halves.
    fn stretches(self, range: Range<usize>) -> Stretches {
        Stretches { pairs: self, at: range.start, end: range.end }
    }
}

/// See [`Pairs::stretches`]; yields each stretch's output elements and the flat indices in `x` of
/// its first gate and up value. An iterator rather than a callback: a closure may be built outside
/// the kernel's CPU-feature build (see [`forward_step`]).
struct Stretches {
    pairs: Pairs,
    at: usize,
    end: usize,
}

impl Iterator for Stretches {
    type Item = (Range<usize>, usize, usize);

    fn next(&mut self) -> Option<Self::Item> {
        if self.at >= self.end {
            return None;
        }
        let n = match self.pairs {
            Pairs::Interleaved => self.end - self.at,
            Pairs::Halves { half } => (half - self.at % half).min(self.end - self.at),
        };
        let (gate, up) = self.pairs.at(self.at);
        let outs = self.at..self.at + n;
        self.at += n;
        Some((outs, gate, up))
    }
}

crate::simd_kernel! {
fn forward_kernel<T: FloatElement, F: PairFn>(args: &KernelArgs, ctx: BlockCtx, f: F, pairs: Pairs, streaming: bool) {
    let x = args.input(0);
    let out = args.output(0);
    let n = out.layout().numel();
    let range = ctx.split(n);
    let xs = &x.storage::<T>().expect("dtype dispatched")[x.layout().offset()..][..2 * n];
    // SAFETY: blocks own disjoint output element ranges.
    let dst = unsafe { out.slice_mut::<T>(out.layout().offset() + range.start, range.len()) };
    if T::converts_natively() {
        forward_stretches::<T, F, true>(xs, dst, range, pairs, f, streaming);
    } else {
        forward_stretches::<T, F, false>(xs, dst, range, pairs, f, streaming);
    }
    fence();
}
}

/// The block's outputs `range` (`dst`), stretch by stretch of [`Pairs::stretches`].
#[inline(always)]
fn forward_stretches<T: FloatElement, F: PairFn, const NATIVE: bool>(
    xs: &[T],
    dst: &mut [T],
    range: Range<usize>,
    pairs: Pairs,
    f: F,
    streaming: bool,
) {
    let first = range.start;
    for (outs, gate, up) in pairs.stretches(range) {
        let dst = &mut dst[outs.start - first..outs.end - first];
        match pairs {
            Pairs::Interleaved => {
                forward_run::<T, F, NATIVE, 2>(&xs[gate..2 * outs.end], &xs[up..2 * outs.end], dst, f, streaming)
            }
            Pairs::Halves { .. } => {
                forward_run::<T, F, NATIVE, 1>(&xs[gate..][..outs.len()], &xs[up..][..outs.len()], dst, f, streaming)
            }
        }
    }
}

/// The activation over one stretch, [`LANES`] outputs a step: gate `i` at `gates[STRIDE · i]`, its
/// up value at `ups[STRIDE · i]`. Each step's inputs are widened per element and its results
/// narrowed in registers, as [`dense_map`](crate::elementwise) does for ops whose operands are runs
/// of their own. Before, the kernel widened a chunk of pairs into a buffer and read the gates and
/// the up values back from it two by two: over `[2048, 5760]` on a Zen 4, alternated runs, bf16 took
/// 1.49–2.36 ms (now 0.97–1.23), f32 2.26–5.08 (1.45–2.02), f16 1.40–2.25 (1.16–1.47); the
/// backward's steps alike, bf16 2.38–4.06 → 1.59–1.94 ms.
#[inline(always)]
fn forward_run<T: FloatElement, F: PairFn, const NATIVE: bool, const STRIDE: usize>(
    gates: &[T],
    ups: &[T],
    dst: &mut [T],
    f: F,
    streaming: bool,
) {
    let (whole, tail) = dst.split_at_mut(dst.len() / LANES * LANES);
    for (k, out) in whole.chunks_exact_mut(LANES).enumerate() {
        let at = k * STRIDE * LANES;
        store_step::<T, NATIVE>(&forward_step::<T, F, NATIVE, STRIDE>(&gates[at..], &ups[at..], f), out, streaming);
    }
    if !tail.is_empty() {
        let at = whole.len() * STRIDE;
        let (mut g, mut u) = ([T::default(); 2 * LANES], [T::default(); 2 * LANES]);
        g[..gates.len() - at].copy_from_slice(&gates[at..]);
        u[..ups.len() - at].copy_from_slice(&ups[at..]);
        T::narrow(&forward_step::<T, F, NATIVE, STRIDE>(&g, &u, f)[..tail.len()], tail);
    }
}

/// One step's results: a function, not a closure, so that it is always inlined into the
/// kernel's CPU-feature build (as a closure f16's was left out of line, built for the baseline
/// target, with its conversions as calls: 43 ms instead of 1.4).
#[inline(always)]
fn forward_step<T: FloatElement, F: PairFn, const NATIVE: bool, const STRIDE: usize>(
    gates: &[T],
    ups: &[T],
    f: F,
) -> [f32; LANES] {
    let reach = STRIDE * (LANES - 1) + 1;
    let (gates, ups) = (&gates[..reach], &ups[..reach]);
    let mut results = [0f32; LANES];
    for (i, r) in results.iter_mut().enumerate() {
        *r = f.value::<T>(to_f32::<T, NATIVE>(gates[STRIDE * i]), to_f32::<T, NATIVE>(ups[STRIDE * i]));
    }
    results
}

crate::simd_kernel! {
fn backward_kernel<T: FloatElement, F: PairFn>(args: &KernelArgs, ctx: BlockCtx, f: F, pairs: Pairs, streaming: bool) {
    let (dout, x) = (args.input(0), args.input(1));
    let dx = args.output(0);
    let n = dout.layout().numel();
    let range = ctx.split(n);
    let ds = &dout.storage::<T>().expect("dtype dispatched")[dout.layout().offset()..][..n];
    let xs = &x.storage::<T>().expect("dtype dispatched")[x.layout().offset()..][..2 * n];
    if T::converts_natively() {
        backward_stretches::<T, F, true>(ds, xs, &dx, range, pairs, f, streaming);
    } else {
        backward_stretches::<T, F, false>(ds, xs, &dx, range, pairs, f, streaming);
    }
    fence();
}
}

/// The block's gradients for the outputs `range`, stretch by stretch of [`Pairs::stretches`]; each
/// pass writes both members of its pairs of `dx` (laid out as `x`'s).
#[inline(always)]
fn backward_stretches<T: FloatElement, F: PairFn, const NATIVE: bool>(
    ds: &[T],
    xs: &[T],
    dx: &OutputView,
    range: Range<usize>,
    pairs: Pairs,
    f: F,
    streaming: bool,
) {
    let at = dx.layout().offset();
    for (outs, gate, up) in pairs.stretches(range) {
        let (d, n) = (&ds[outs.clone()], outs.len());
        match pairs {
            Pairs::Interleaved => {
                // SAFETY: blocks own disjoint output ranges, hence disjoint pairs of dx.
                let dst = unsafe { dx.slice_mut::<T>(at + gate, 2 * n) };
                interleaved_backward::<T, F, NATIVE>(d, &xs[gate..2 * outs.end], dst, f, streaming);
            }
            Pairs::Halves { .. } => {
                // SAFETY: as above; a stretch's gate and up gradients lie in the two halves of one row.
                let (d_gates, d_ups) = unsafe { (dx.slice_mut::<T>(at + gate, n), dx.slice_mut::<T>(at + up, n)) };
                let (gates, ups) = (&xs[gate..][..n], &xs[up..][..n]);
                halves_backward::<T, F, NATIVE>(d, gates, ups, d_gates, d_ups, f, streaming);
            }
        }
    }
}

/// The gradient of interleaved pairs, `LANES` pairs a step (as the forward's [`forward_run`]):
/// each step's gradients fill two `LANES` runs of `dx`, narrowed in registers.
#[inline(always)]
fn interleaved_backward<T: FloatElement, F: PairFn, const NATIVE: bool>(
    ds: &[T],
    xs: &[T],
    dst: &mut [T],
    f: F,
    streaming: bool,
) {
    let (whole, tail) = dst.split_at_mut(dst.len() / (2 * LANES) * (2 * LANES));
    for (k, out) in whole.chunks_exact_mut(2 * LANES).enumerate() {
        let (d, pairs) = (&ds[k * LANES..], &xs[2 * k * LANES..]);
        let grads = backward_step::<T, F, NATIVE, 2>(d, pairs, &pairs[1..], f);
        for (run, out) in grads.chunks_exact(LANES).zip(out.chunks_exact_mut(LANES)) {
            store_step::<T, NATIVE>(run.try_into().expect("a run"), out, streaming);
        }
    }
    if !tail.is_empty() {
        let pairs_done = whole.len() / 2;
        let (mut d, mut pairs) = ([T::default(); LANES], [T::default(); 2 * LANES]);
        d[..tail.len() / 2].copy_from_slice(&ds[pairs_done..]);
        pairs[..tail.len()].copy_from_slice(&xs[2 * pairs_done..]);
        T::narrow(&backward_step::<T, F, NATIVE, 2>(&d, &pairs, &pairs[1..], f)[..tail.len()], tail);
    }
}

/// The gradient of a stretch of gate/up halves, `LANES` outputs a step: each step's gradients
/// fill a run of `d_gates` and one of `d_ups`.
#[inline(always)]
fn halves_backward<T: FloatElement, F: PairFn, const NATIVE: bool>(
    ds: &[T],
    gates: &[T],
    ups: &[T],
    d_gates: &mut [T],
    d_ups: &mut [T],
    f: F,
    streaming: bool,
) {
    let whole = ds.len() / LANES * LANES;
    let (d_gates, gates_tail) = d_gates.split_at_mut(whole);
    let (d_ups, ups_tail) = d_ups.split_at_mut(whole);
    let outs = d_gates.chunks_exact_mut(LANES).zip(d_ups.chunks_exact_mut(LANES));
    for (k, (d_gate, d_up)) in outs.enumerate() {
        let at = k * LANES;
        let grads = backward_step::<T, F, NATIVE, 1>(&ds[at..], &gates[at..], &ups[at..], f);
        let (g, u) = grads.split_at(LANES);
        store_step::<T, NATIVE>(g.try_into().expect("a run"), d_gate, streaming);
        store_step::<T, NATIVE>(u.try_into().expect("a run"), d_up, streaming);
    }
    if !gates_tail.is_empty() {
        let rest = gates_tail.len();
        let (mut d, mut g, mut u) = ([T::default(); LANES], [T::default(); LANES], [T::default(); LANES]);
        d[..rest].copy_from_slice(&ds[whole..]);
        g[..rest].copy_from_slice(&gates[whole..]);
        u[..rest].copy_from_slice(&ups[whole..]);
        let grads = backward_step::<T, F, NATIVE, 1>(&d, &g, &u, f);
        T::narrow(&grads[..rest], gates_tail);
        T::narrow(&grads[LANES..LANES + rest], ups_tail);
    }
}

/// One step's gradients of `LANES` outputs (gate `i` at `gates[STRIDE · i]`, its up value at
/// `ups[STRIDE · i]`), in one array: interleaved (`STRIDE` 2) as `dx`'s pairs, in halves (1) the
/// gates' run then the ups'. A function, not a closure, so that it is always inlined into the
/// kernel's CPU-feature build. Indexing the array by `i / (LANES / 2)` inside the loop kept it from
/// vectorizing (6–20x slower), and computing the two gradients of interleaved pairs as runs of
/// their own, interleaved after, left bf16 at 0.97–1.05x the staged kernel before this one.
#[inline(always)]
fn backward_step<T: FloatElement, F: PairFn, const NATIVE: bool, const STRIDE: usize>(
    d: &[T],
    gates: &[T],
    ups: &[T],
    f: F,
) -> [f32; 2 * LANES] {
    let reach = STRIDE * (LANES - 1) + 1;
    let (d, gates, ups) = (&d[..LANES], &gates[..reach], &ups[..reach]);
    let mut grads = [0f32; 2 * LANES];
    for i in 0..LANES {
        let (g, u) = (to_f32::<T, NATIVE>(gates[STRIDE * i]), to_f32::<T, NATIVE>(ups[STRIDE * i]));
        let (at_gate, at_up) = if STRIDE == 2 { (2 * i, 2 * i + 1) } else { (i, LANES + i) };
        (grads[at_gate], grads[at_up]) = f.grads::<T>(to_f32::<T, NATIVE>(d[i]), g, u);
    }
    grads
}

/// The forward op of a [`PairGate`] family.
pub(crate) struct PairOp<G>(PhantomData<fn() -> G>);

/// The backward op of a [`PairGate`] family: `dx` (laid out as `x`) from `dout` (the forward's
/// output shape) and `x`.
pub(crate) struct PairBackwardOp<G>(PhantomData<fn() -> G>);

impl<G> PairOp<G> {
    pub(crate) const OP: Self = Self(PhantomData);
}

impl<G> PairBackwardOp<G> {
    pub(crate) const OP: Self = Self(PhantomData);
}

/// The [`Step`] of one call, named for its op, running [`forward_kernel`] or [`backward_kernel`]
/// for `T` with the call's [`PairFn`] (a [`PairFnUser`]: the function's type is the family's
/// choice, made in [`PairGate::with_fn`]).
struct StepOf<T> {
    name: &'static str,
    block_dim: u32,
    pairs: Pairs,
    streaming: bool,
    backward: bool,
    dtype: PhantomData<fn() -> T>,
}

impl<T: FloatElement> PairFnUser for StepOf<T> {
    type Out = Step;

    fn call<F: PairFn>(self, f: F) -> Step {
        let StepOf { pairs, streaming, .. } = self;
        if self.backward {
            Step::new(self.name, self.block_dim, move |args, ctx| {
                backward_kernel::<T, F>(args, ctx, f, pairs, streaming)
            })
        } else {
            Step::new(self.name, self.block_dim, move |args, ctx| {
                forward_kernel::<T, F>(args, ctx, f, pairs, streaming)
            })
        }
    }
}

/// The plan of one call of the forward or the backward (`schema` names its op): one step over
/// the output's elements, blocks sized by their memory traffic (per output element the pair read
/// and the output written; the backward also reads the output's gradient and writes a pair).
fn plan_call<G: PairGate>(cx: &OpCx, schema: &'static str, backward: bool) -> Result<Plan> {
    let ((pairs, shape), gate) = (Pairs::of(cx)?, G::of(cx)?);
    let (outputs, size) = (shape.iter().product::<usize>(), cx.input("x").dtype.size());
    let name = crate::gate::op_name(schema);
    let block_dim = block_dim_for(outputs, if backward { 5 } else { 3 } * size);
    let streaming = streams_bytes(outputs * size * if backward { 2 } else { 1 });
    let step = with_float_dtype!(cx.input("x").dtype, cx.op(), "x", |T| {
        gate.with_fn(StepOf::<T> { name, block_dim, pairs, streaming, backward, dtype: PhantomData })
    });
    let inputs = if backward { 2 } else { 1 };
    Ok(Plan::new(vec![step])
        .inputs_need(vec![LayoutNeed::Contiguous; inputs])
        .outputs_need(vec![LayoutNeed::Contiguous]))
}

/// An example `x` of `shape` (by default a GPT-OSS 20B expert's 2048 rows of 2 · 2880) with its
/// last dim rounded up to even.
fn pairs_shape(shape: Option<&[usize]>) -> Vec<usize> {
    crate::glu::glu_input_shape(Some(shape.unwrap_or(&[2048, 2 * 2880])))
}

impl<G: PairGate> Op for PairOp<G> {
    fn schema(&self) -> &'static str {
        G::SCHEMA
    }

    fn doc(&self) -> &'static str {
        G::DOC
    }

    fn leading_batch_args(&self) -> &'static [&'static str] {
        &["x"]
    }

    fn dtypes(&self) -> &'static [DType] {
        DTYPES
    }

    fn backward(&self) -> Option<&'static str> {
        Some(crate::gate::op_name(G::BACKWARD_SCHEMA))
    }

    fn infer(&self, cx: &OpCx) -> Result<Vec<TensorMeta>> {
        let (_, shape) = Pairs::of(cx)?;
        G::of(cx)?;
        Ok(vec![TensorMeta::contiguous(cx.input("x").dtype, &shape)?])
    }

    fn plan(&self, cx: &OpCx) -> Result<Plan> {
        plan_call::<G>(cx, G::SCHEMA, false)
    }

    fn reference(&self, cx: &OpCx, inputs: &[Option<RefTensor>]) -> Result<Vec<RefTensor>> {
        let x = inputs[0].as_ref().unwrap();
        let ((pairs, shape), gate) = (Pairs::of(cx)?, G::of(cx)?);
        let n = x.data.len() / 2;
        let out = (0..n).map(|j| pairs.at(j)).map(|(g, u)| gate.exact(x.data[g], x.data[u]).0).collect();
        Ok(vec![RefTensor::new(&shape, out)])
    }

    fn example(&self, shape: Option<&[usize]>, dtype: DType) -> Result<Example> {
        Ok(Example {
            inputs: vec![Some(TensorMeta::contiguous(dtype, &pairs_shape(shape))?)],
            ranges: vec![Some(G::EXAMPLE_RANGE)],
            ..Default::default()
        })
    }
}

impl<G: PairGate> Op for PairBackwardOp<G> {
    fn schema(&self) -> &'static str {
        G::BACKWARD_SCHEMA
    }

    fn doc(&self) -> &'static str {
        G::BACKWARD_DOC
    }

    fn leading_batch_args(&self) -> &'static [&'static str] {
        &["dout", "x"]
    }

    fn dtypes(&self) -> &'static [DType] {
        DTYPES
    }

    fn infer(&self, cx: &OpCx) -> Result<Vec<TensorMeta>> {
        let (_, out_shape) = Pairs::of(cx)?;
        G::of(cx)?;
        let dtype = cx.input("x").dtype;
        cx.expect_same_dtype("dout", dtype, "x")?;
        cx.expect_shape("dout", &out_shape)?;
        Ok(vec![TensorMeta::contiguous(dtype, cx.input("x").shape())?])
    }

    fn plan(&self, cx: &OpCx) -> Result<Plan> {
        self.infer(cx)?;
        plan_call::<G>(cx, G::BACKWARD_SCHEMA, true)
    }

    fn reference(&self, cx: &OpCx, inputs: &[Option<RefTensor>]) -> Result<Vec<RefTensor>> {
        let (d, x) = (inputs[0].as_ref().unwrap(), inputs[1].as_ref().unwrap());
        let ((pairs, _), gate) = (Pairs::of(cx)?, G::of(cx)?);
        let mut dx = vec![0.0; x.data.len()];
        for (j, &d) in d.data.iter().enumerate() {
            let (g, u) = pairs.at(j);
            let (_, d_gate, d_up) = gate.exact(x.data[g], x.data[u]);
            (dx[g], dx[u]) = (d * d_gate, d * d_up);
        }
        Ok(vec![RefTensor::new(&x.shape, dx)])
    }

    /// x's shape, as for the forward (the first input is the gradient of the half-width output).
    fn example_shape(&self, example: &Example) -> Vec<usize> {
        example.input_shape(1)
    }

    fn example(&self, shape: Option<&[usize]>, dtype: DType) -> Result<Example> {
        Ok(Example {
            inputs: crate::glu_backward::backward_example_inputs(&pairs_shape(shape), dtype)?,
            ranges: vec![None, Some(G::EXAMPLE_RANGE)],
            ..Default::default()
        })
    }
}
