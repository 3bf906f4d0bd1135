//! `swiglu(x, dim=-1)` and `geglu(x, dim=-1, approximate='none', activate_left=False)`: a gated
//! activation of one tensor's two halves along `dim` — the fused `gate_up_proj` output of an MLP
//! (Phi-3's), or aclnn's SwiGlu and GeGlu. The output has `dim` halved.
//!
//! Which half is gated follows aclnn: SwiGlu gates the first half, `silu(a) · b`; GeGlu the second
//! unless `activate_left`, `a · gelu(b)` (as diffusers' `GEGLU`, which chunks `hidden, gate`), and
//! `gelu(a) · b` with it (HF's order, `act(gate) · up`). The activation is the kernel's
//! [`GateFn`] type parameter, as for [`gated_mul`](crate::gated_mul) (the reason is in
//! [`gate`](crate::gate)).
//!
//! Kernel: the executor makes `x` contiguous, so for each index `o` of the dims before `dim` the
//! halves are two dense runs of `H = shape[dim]/2 · (product of the dims after dim)` elements.

use crate::elementwise::{dense_map, fence, streams_bytes};
use crate::gate::{op_name, with_gate_fn, Activation, GateFn, Gating};
use crate::gated_mul::DTYPES;
use uniop::{
    block_dim_for, with_float_dtype, AttrValue, BlockCtx, DType, ErrorCode, Example, FloatElement, KernelArgs,
    LayoutNeed, Op, OpCx, Plan, RefTensor, Result, Step, TensorMeta,
};

/// `swiglu` or `geglu` (their backwards are [`GluBackward`](crate::glu_backward::GluBackward)).
pub struct Glu(Gating);

impl Glu {
    pub const SWIGLU: Glu = Glu(Gating::Silu);
    pub const GEGLU: Glu = Glu(Gating::Gelu);
}

/// How `x` splits: `outer` slices, each `[first (half elements) | second (half elements)]`, and
/// which of the two is the gate.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Halves {
    pub outer: usize,
    pub half: usize,
    /// Offsets of the gate's and the multiplied half's runs from their slice's start: `(0, half)`
    /// when the first half is gated, `(half, 0)` when the second is.
    pub gate: usize,
    pub up: usize,
}

/// One call of a GLU op or its backward: the split of `x`, the output shape and the activation.
pub(crate) struct GluCall {
    pub halves: Halves,
    pub out_shape: Vec<usize>,
    pub activation: Activation,
}

/// Validates `dim` against `x` (in range, even size) and the activation's arguments.
pub(crate) fn glu_call(gating: Gating, cx: &OpCx) -> Result<GluCall> {
    let shape = cx.input("x").shape();
    let rank = shape.len() as i64;
    let dim = cx.int("dim");
    if !(-rank..rank).contains(&dim) {
        return Err(cx.err(ErrorCode::ParamInvalid, "dim", format!("a dim in [-{rank}, {rank}) for x"), dim));
    }
    let d = dim.rem_euclid(rank.max(1)) as usize;
    if !shape[d].is_multiple_of(2) {
        return Err(cx.err(ErrorCode::Shape, "x", format!("an even size along dim {dim}"), shape[d]));
    }
    let mut out_shape = shape.to_vec();
    out_shape[d] /= 2;
    let half = out_shape[d..].iter().product();
    let gate_first = match gating {
        Gating::Silu => true,
        Gating::Gelu => matches!(cx.attr("activate_left"), AttrValue::Bool(true)),
    };
    let (gate, up) = if gate_first { (0, half) } else { (half, 0) };
    let halves = Halves { outer: shape[..d].iter().product(), half, gate, up };
    Ok(GluCall { halves, out_shape, activation: gating.activation(cx)? })
}

impl Halves {
    /// The dense runs of output elements `[start, end)` as `(o, i, len)`: output
    /// `o·half + i ..+len`, input halves at `o·2·half + i` and `o·2·half + half + i`. An iterator
    /// so that kernels keep the run bodies in their own (multiversioned) body: see
    /// [`uniop::StridedRuns::runs`].
    #[inline(always)]
    pub fn runs(&self, start: usize, end: usize) -> impl Iterator<Item = (usize, usize, usize)> + '_ {
        let mut idx = start;
        std::iter::from_fn(move || {
            (idx < end).then(|| {
                let (o, i) = (idx / self.half, idx % self.half);
                let len = (self.half - i).min(end - idx);
                idx += len;
                (o, i, len)
            })
        })
    }

    /// `(o, i)`'s element of the gate and of the multiplied half, as indices into `x`.
    #[inline(always)]
    pub fn pair(&self, o: usize, i: usize) -> (usize, usize) {
        let slice = o * 2 * self.half + i;
        (slice + self.gate, slice + self.up)
    }
}

crate::simd_kernel! {
fn kernel<T: FloatElement, A: GateFn>(args: &KernelArgs, ctx: BlockCtx, h: Halves, streaming: bool) {
    let x = args.input(0);
    let xs = &x.storage::<T>().expect("dtype dispatched")[x.layout().offset()..];
    let out = args.output(0);
    let range = ctx.split(h.outer * h.half);
    for (o, i, len) in h.runs(range.start, range.end) {
        let (g, u) = h.pair(o, i);
        // SAFETY: blocks own disjoint output element ranges.
        let dst = unsafe { out.slice_mut::<T>(out.layout().offset() + o * h.half + i, len) };
        dense_map([&xs[g..g + len], &xs[u..u + len]], [dst], streaming, |[g, u]| [A::act::<T>(g) * u]);
    }
    fence();
}
}

impl Op for Glu {
    fn schema(&self) -> &'static str {
        match self.0 {
            Gating::Silu => "swiglu(Tensor x, int dim=-1) -> Tensor out",
            Gating::Gelu => {
                "geglu(Tensor x, int dim=-1, str approximate='none', bool activate_left=False) -> Tensor out"
            }
        }
    }

    fn doc(&self) -> &'static str {
        match self.0 {
            Gating::Silu => {
                "SwiGLU with aclnn semantics: x splits into halves a, b along dim (size must be even); out = silu(a) \
                 * b, with dim halved. f16/bf16 compute in float32."
            }
            Gating::Gelu => {
                "GeGLU with aclnn semantics: x splits into halves a, b along dim (size must be even); out = a * \
                 gelu(b), or gelu(a) * b when activate_left, with dim halved. approximate 'none' or 'tanh' as \
                 torch.nn.functional.gelu's. f16/bf16 compute in float32."
            }
        }
    }

    fn leading_batch_args(&self) -> &'static [&'static str] {
        &["x"]
    }

    fn dtypes(&self) -> &'static [DType] {
        DTYPES
    }

    fn backward(&self) -> Option<&'static str> {
        Some(match self.0 {
            Gating::Silu => "swiglu_backward",
            Gating::Gelu => "geglu_backward",
        })
    }

    fn infer(&self, cx: &OpCx) -> Result<Vec<TensorMeta>> {
        let dtype = cx.expect_dtype_in("x", DTYPES)?;
        let call = glu_call(self.0, cx)?;
        Ok(vec![TensorMeta::contiguous(dtype, &call.out_shape)?])
    }

    fn plan(&self, cx: &OpCx) -> Result<Plan> {
        let dtype = cx.input("x").dtype;
        let GluCall { halves, activation, .. } = glu_call(self.0, cx)?;
        let n = halves.outer * halves.half;
        let block_dim = block_dim_for(n, 3 * dtype.size());
        let streaming = streams_bytes(n * dtype.size());
        let name = op_name(self.schema());
        let step = with_float_dtype!(dtype, cx.op(), "x", |T| with_gate_fn!(activation, |A| {
            Step::new(name, block_dim, move |args, ctx| kernel::<T, A>(args, ctx, halves, streaming))
        }));
        Ok(Plan::new(vec![step]).inputs_need(vec![LayoutNeed::Contiguous]).outputs_need(vec![LayoutNeed::Contiguous]))
    }

    fn reference(&self, cx: &OpCx, inputs: &[Option<RefTensor>]) -> Result<Vec<RefTensor>> {
        let x = inputs[0].as_ref().unwrap();
        let GluCall { halves: h, out_shape, activation } = glu_call(self.0, cx)?;
        let mut out = vec![0.0; h.outer * h.half];
        for o in 0..h.outer {
            for i in 0..h.half {
                let (g, u) = h.pair(o, i);
                out[o * h.half + i] = activation.exact(x.data[g]) * x.data[u];
            }
        }
        Ok(vec![RefTensor::new(&out_shape, out)])
    }

    fn example(&self, shape: Option<&[usize]>, dtype: DType) -> Result<Example> {
        Ok(Example {
            inputs: vec![Some(TensorMeta::contiguous(dtype, &glu_input_shape(shape))?)],
            ..Default::default()
        })
    }
}

/// The `x` of a GLU example: `shape` (by default an MLP's fused [4096, 2 · 11008]) with its last
/// dim rounded up to even.
pub(crate) fn glu_input_shape(shape: Option<&[usize]>) -> Vec<usize> {
    let mut shape = shape.unwrap_or(&[4096, 2 * 11008]).to_vec();
    if let Some(last) = shape.last_mut() {
        *last = last.next_multiple_of(2);
    }
    shape
}
