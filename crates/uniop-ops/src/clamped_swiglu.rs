//! `clamped_swiglu(x, alpha=1.702, limit=7.0, up_shift=1.0, interleaved=True, limit_after_act=False)`:
//! the clamped gated activation of a mixture-of-experts layer's fused `gate_up` product. With `g` a
//! gate and `u` its up value along the last dim of `x`,
//!
//! `g' = min(g, limit)`, `u' = clamp(u, −limit, limit)`, `out = (u' + up_shift) · g' · σ(alpha · g')`;
//!
//! with `limit_after_act` the limit bounds the activation instead of the gate:
//! `out = (u' + up_shift) · min(g · σ(alpha · g), limit)` (Step 3.7 and Ling clip there).
//!
//! GPT-OSS (the defaults) interleaves the pairs (`2i, 2i+1`) and shifts `u` by 1 (its up projection
//! is trained around 1, not 0); DeepSeek V4, GLM-5 Next and HunYuan V4 store gate and up as the two
//! halves of the last dim (`i, i + n/2`, as [`swiglu`](crate::glu)) with `alpha = 1`, `up_shift = 0`
//! (`silu(g') · u'`); MiniMax M3 takes GPT-OSS's constants on halves. The clamps bound what a bf16
//! expert feeds its down projection. transformers writes it as five to seven elementwise torch ops
//! on strided views (each a pass over memory, each rounded to the model's dtype); here it is one
//! pass in f32, rounded once. Why an op of its own rather than another [`GateFn`](crate::gate) of
//! the gated family: the up side is transformed too (clamped, shifted), and `alpha`, `limit` and
//! the shift are a model's config values, not a kernel's constants.
//!
//! `clamped_swiglu_backward(dout, x, ...) -> dx` writes both members of each pair of `dx` (laid
//! out as `x`'s): with `s = σ(alpha · g)` on the clamped values, `d gate = dout · (u + up_shift) ·
//! s · (1 + alpha · g · (1 − s))` where the gate (`limit_after_act`: its activation `g · s`) is
//! below `limit`, and `d up = dout · act` (the activation as the forward bounds it) where the up
//! value is strictly within `±limit`; 0 where a clamp cut the value or left it on a bound (as torch
//! 2.15's clamp: the minimum-norm subgradient). The kernels and ops are [`paired`](crate::paired)'s.

use crate::math;
use crate::paired::{PairFn, PairFnUser, PairGate};
use std::marker::PhantomData;
use uniop::{AttrValue, DType, Element, ErrorCode, OpCx, Result};

/// One call's constants: `alpha` scales the gate inside its sigmoid, `limit` bounds the up value
/// and the gate (or, `after_act`, the gate's activation `g · σ(alpha · g)`: see [`LimitAt`]),
/// `up_shift` is added to the clamped up value (as given, for the f64 reference; kernels compute
/// in f32).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Clamp {
    alpha: f64,
    limit: f64,
    up_shift: f64,
    after_act: bool,
    /// Whether the kernels compute this call in f32 (all but the f64 reference's calls): the
    /// reference then decides whether the activation is below its limit on the activation as f32
    /// holds it (see `exact`).
    f32_kernel: bool,
}

/// Where the limit bounds the gate side: on the gate before its activation ([`LimitGate`]:
/// GPT-OSS, DeepSeek V4) or on the activation ([`LimitAct`]: Step 3.7, Ling). A type parameter of
/// the kernels rather than a flag, so each placement compiles to a loop without the other's bound:
/// with both bounds in one loop (the absent one +inf), alternated runs on a Zen 4 put GPT-OSS's bf16
/// forward at 1.28–1.31 ms against 1.07–1.10, its f32 backward at 3.4–5.5 against 2.5–3.7.
pub(crate) trait LimitAt: Copy + Send + Sync + 'static {
    /// The gate as the activation reads it, and whether the gate's gradient passes there.
    fn gate(g: f32, limit: f32) -> (f32, bool);
    /// The activation as the product reads it, and whether the gate's gradient passes there.
    fn act(act: f32, limit: f32) -> (f32, bool);
}

/// The limit on the gate: `min(g, limit)`.
#[derive(Clone, Copy)]
pub(crate) struct LimitGate;

/// The limit on the activation: `min(g · σ(alpha · g), limit)`.
#[derive(Clone, Copy)]
pub(crate) struct LimitAct;

// A gradient passes strictly inside its bound, as torch 2.15's clamp (the minimum-norm subgradient,
// 0 on a bound; torch releases before mid-2026 passed it there). A NaN passes through the bounds,
// as torch's clamp (`f32::min` would replace it).
impl LimitAt for LimitGate {
    #[inline(always)]
    fn gate(g: f32, limit: f32) -> (f32, bool) {
        (if g > limit { limit } else { g }, g < limit)
    }

    #[inline(always)]
    fn act(act: f32, _: f32) -> (f32, bool) {
        (act, true)
    }
}

impl LimitAt for LimitAct {
    #[inline(always)]
    fn gate(g: f32, _: f32) -> (f32, bool) {
        (g, true)
    }

    #[inline(always)]
    fn act(act: f32, limit: f32) -> (f32, bool) {
        (if act > limit { limit } else { act }, act < limit)
    }
}

impl Clamp {
    /// The gate and the up value as the activation reads them, and whether each passes its
    /// gradient (the gate's where [`LimitAt::gate`] passes it: see [`LimitAt::act`] too).
    #[inline(always)]
    fn clamp<L: LimitAt>(self, g: f32, u: f32) -> (f32, f32, bool, bool) {
        let limit = self.limit as f32;
        let u_in = u > -limit && u < limit;
        let (g, g_in) = L::gate(g, limit);
        // `limit >= 0` (validated), so `clamp` cannot panic; a NaN passes through it.
        (g, u.clamp(-limit, limit), g_in, u_in)
    }
}

/// The kernels' function: [`Clamp`]'s constants with the limit's placement as a type.
#[derive(Clone, Copy)]
struct Clamped<L>(Clamp, PhantomData<L>);

impl<L: LimitAt> PairFn for Clamped<L> {
    /// `(u + up_shift) · act` on clamped values, `act = g · σ(alpha · g)` within its bound.
    #[inline(always)]
    fn value<T: Element>(self, g: f32, u: f32) -> f32 {
        let c = self.0;
        let (g, u, _, _) = c.clamp::<L>(g, u);
        let (act, _) = L::act(g * math::sigmoid::<T>(c.alpha as f32 * g), c.limit as f32);
        (u + c.up_shift as f32) * act
    }

    #[inline(always)]
    fn grads<T: Element>(self, d: f32, g: f32, u: f32) -> (f32, f32) {
        let c = self.0;
        let (alpha, shift, limit) = (c.alpha as f32, c.up_shift as f32, c.limit as f32);
        let (g, u, g_in, u_in) = c.clamp::<L>(g, u);
        let s = math::sigmoid::<T>(alpha * g);
        let (act, act_in) = L::act(g * s, limit);
        // `&`, not `&&`: both are computed anyway, and a short circuit is a branch in the loop.
        let d_gate = if g_in & act_in { d * (u + shift) * s * (1.0 + alpha * g * (1.0 - s)) } else { 0.0 };
        (d_gate, if u_in { d * act } else { 0.0 })
    }
}

impl PairGate for Clamp {
    const SCHEMA: &'static str = "clamped_swiglu(Tensor x, float alpha=1.702, float limit=7.0, float up_shift=1.0, \
        bool interleaved=True, bool limit_after_act=False) -> Tensor out";
    const DOC: &'static str = "A mixture-of-experts' clamped gated activation: the last dim of x (even size) holds \
        gate and up values, interleaved (pairs 2i, 2i+1: GPT-OSS) or as its two halves (i, n/2 + i: interleaved=False, \
        as DeepSeek V4 stores them); g = min(gate, limit), u = clamp(up, -limit, limit), out = (u + up_shift) * g * \
        sigmoid(alpha * g), with the last dim halved. GPT-OSS's defaults; DeepSeek V4's silu(g) * u is alpha=1, \
        up_shift=0. limit_after_act=True bounds the activation instead of the gate: out = (u + up_shift) * min(gate * \
        sigmoid(alpha * gate), limit) (Step 3.7, Ling). limit >= 0 (inf: no clamp). f16/bf16 compute in float32.";
    const BACKWARD_SCHEMA: &'static str = "clamped_swiglu_backward(Tensor dout, Tensor x, float alpha=1.702, float \
        limit=7.0, float up_shift=1.0, bool interleaved=True, bool limit_after_act=False) -> Tensor dx";
    const BACKWARD_DOC: &'static str = "Gradient of clamped_swiglu: d gate = dout * (u + up_shift) * s * (1 + alpha * \
        g * (1 - s)) where gate < limit (limit_after_act: where g * s < limit), d up = dout * act where |up| < limit, \
        act = g * s as the forward bounds it (0 where a clamp cut the value or left it on a bound, as torch's clamp), \
        with s = sigmoid(alpha * g) on the clamped g, u; dx lays them out as x (interleaved or halves). dout has \
        clamped_swiglu's output shape.";
    const EXAMPLE_RANGE: (f64, f64) = (-10.0, 10.0);

    /// Validates `alpha` and `up_shift` (finite) and `limit` (≥ 0; +inf clamps nothing).
    fn of(cx: &OpCx) -> Result<Clamp> {
        let (alpha, limit, up_shift) = (cx.float("alpha"), cx.float("limit"), cx.float("up_shift"));
        for (name, value) in [("alpha", alpha), ("up_shift", up_shift)] {
            if !value.is_finite() {
                return Err(cx.err(ErrorCode::ParamInvalid, name, "a finite number", value));
            }
        }
        if limit.is_nan() || limit < 0.0 {
            return Err(cx.err(ErrorCode::ParamInvalid, "limit", "a number >= 0 (inf clamps nothing)", limit));
        }
        let after_act = matches!(cx.attr("limit_after_act"), AttrValue::Bool(true));
        Ok(Clamp { alpha, limit, up_shift, after_act, f32_kernel: cx.input("x").dtype != DType::F64 })
    }

    fn exact(self, g: f64, u: f64) -> (f64, f64, f64) {
        let (alpha, limit, shift) = (self.alpha, self.limit, self.up_shift);
        let (gate_bound, act_bound) = if self.after_act { (f64::INFINITY, limit) } else { (limit, f64::INFINITY) };
        let (gc, uc) = (if g > gate_bound { gate_bound } else { g }, u.clamp(-limit, limit));
        let s = math::exact::sigmoid(alpha * gc);
        let act = gc * s;
        let act_c = if act > act_bound { act_bound } else { act };
        // The gate's gradient jumps to 0 where the activation reaches its limit. With a large
        // alpha, σ rounds to 1 in f32 and a gate on the limit (bf16's 7.0) has the activation of
        // the limit itself, which f64 puts 3e-10 below it: a jump no f32 kernel can place as f64
        // does, so a check of one places it where f32 does.
        let act_held = if self.f32_kernel { act as f32 as f64 } else { act };
        let passes = g < gate_bound && act_held < act_bound;
        let d_gate = if passes { (uc + shift) * (s + alpha * gc * s * (1.0 - s)) } else { 0.0 };
        let d_up = if u > -limit && u < limit { act_c } else { 0.0 };
        ((uc + shift) * act_c, d_gate, d_up)
    }

    fn with_fn<U: PairFnUser>(self, user: U) -> U::Out {
        if self.after_act {
            user.call(Clamped::<LimitAct>(self, PhantomData))
        } else {
            user.call(Clamped::<LimitGate>(self, PhantomData))
        }
    }
}
