//! `softcapped_swiglu(x, gate_softcap=4.0, up_softcap=25.0, interleaved=False)`: Inkling 2's
//! experts' gated activation, a SwiGLU whose sigmoid sees the raw gate while soft caps bound its
//! linear factor and the up value. With `g` a gate and `u` its up value along the last dim of `x`
//! and `cap_c(v) = c · tanh(v / c)`,
//!
//! `out = cap_cg(g) · σ(g) · cap_cu(u)`.
//!
//! A cap is smooth (the identity near 0, bounded by ±c), so unlike [`clamped_swiglu`]'s clamps
//! every gradient passes: with `tg = tanh(g / cg)`, `s = σ(g)` and `tu = tanh(u / cu)`,
//! `d gate = dout · cap_cu(u) · s · (1 − tg² + cap_cg(g) · (1 − s))` and
//! `d up = dout · cap_cg(g) · s · (1 − tu²)` (`softcapped_swiglu_backward(dout, x, ...) -> dx`,
//! laid out as `x`).
//!
//! transformers computes it in float32 from the model's dtype and rounds once, as five elementwise
//! ops and three passes for the casts and halves; here it is one pass. The kernels and ops are
//! [`paired`](crate::paired)'s; this file is the function and its constants.
//!
//! [`clamped_swiglu`]: crate::clamped_swiglu

use crate::math;
use crate::paired::{PairFn, PairFnUser, PairGate};
use uniop::{Element, ErrorCode, OpCx, Result};

/// One call's caps: `gate` bounds the gate's linear factor, `up` the up value (each finite, > 0).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Softcaps {
    gate: f64,
    up: f64,
}

/// The kernels' form of [`Softcaps`]: each cap and its reciprocal in f32 (a product where
/// transformers divides, within an ulp of the quotient).
#[derive(Clone, Copy)]
struct Caps {
    gate: f32,
    over_gate: f32,
    up: f32,
    over_up: f32,
}

impl PairFn for Caps {
    /// The three quotients (two tanh, one sigmoid) through one division: the loop is bound by its
    /// arithmetic, not by memory. Alternated runs over `[2048, 5760]` on a Zen 4: f32 4.63–4.68 ms
    /// against 5.02 with three divisions, bf16 3.65–3.92 against 5.06–7.36 (with the coarse exp
    /// of 16-bit results, which [`math::tanh`] does not take).
    #[inline(always)]
    fn value<T: Element>(self, g: f32, u: f32) -> f32 {
        let (ng, dg) = math::tanh_fraction::<T>(g * self.over_gate);
        let (nu, du) = math::tanh_fraction::<T>(u * self.over_up);
        let (ns, ds) = math::sigmoid_fraction::<T>(g);
        (self.gate * ng) * (self.up * nu) * ns / (dg * du * ds)
    }

    /// Each quotient of its own here: `1 − tanh²` cancels near the caps, and tanh taken from the
    /// joint division (a few ulp off) put f32 gradients past the reference's tolerance.
    #[inline(always)]
    fn grads<T: Element>(self, d: f32, g: f32, u: f32) -> (f32, f32) {
        let (tg, tu, s) = (math::tanh(g * self.over_gate), math::tanh(u * self.over_up), math::sigmoid::<T>(g));
        let (gate, up) = (self.gate * tg, self.up * tu);
        let d_gate = d * up * s * ((1.0 - tg * tg) + gate * (1.0 - s));
        (d_gate, d * gate * s * (1.0 - tu * tu))
    }
}

impl PairGate for Softcaps {
    const SCHEMA: &'static str =
        "softcapped_swiglu(Tensor x, float gate_softcap=4.0, float up_softcap=25.0, bool interleaved=False) -> Tensor out";
    const DOC: &'static str = "Inkling 2's experts' gated activation: the last dim of x (even size) holds gate and up \
        values, as its two halves (i, n/2 + i) or interleaved (pairs 2i, 2i+1: interleaved=True); out = gate_softcap * \
        tanh(gate / gate_softcap) * sigmoid(gate) * up_softcap * tanh(up / up_softcap), with the last dim halved (the \
        sigmoid sees the raw gate). Caps finite and > 0. f16/bf16 compute in float32.";
    const BACKWARD_SCHEMA: &'static str = "softcapped_swiglu_backward(Tensor dout, Tensor x, float gate_softcap=4.0, \
        float up_softcap=25.0, bool interleaved=False) -> Tensor dx";
    const BACKWARD_DOC: &'static str = "Gradient of softcapped_swiglu: with tg = tanh(gate / gate_softcap), tu = \
        tanh(up / up_softcap), s = sigmoid(gate), d gate = dout * up_softcap * tu * s * (1 - tg^2 + gate_softcap * tg \
        * (1 - s)), d up = dout * gate_softcap * tg * s * (1 - tu^2); dx lays them out as x (halves or interleaved). \
        dout has softcapped_swiglu's output shape.";
    // Past both default caps, so that they bend the values.
    const EXAMPLE_RANGE: (f64, f64) = (-30.0, 30.0);

    fn of(cx: &OpCx) -> Result<Softcaps> {
        let (gate, up) = (cx.float("gate_softcap"), cx.float("up_softcap"));
        for (name, cap) in [("gate_softcap", gate), ("up_softcap", up)] {
            if !(cap.is_finite() && cap > 0.0) {
                return Err(cx.err(ErrorCode::ParamInvalid, name, "a finite number > 0", cap));
            }
        }
        Ok(Softcaps { gate, up })
    }

    fn exact(self, g: f64, u: f64) -> (f64, f64, f64) {
        let (tg, tu, s) = ((g / self.gate).tanh(), (u / self.up).tanh(), math::exact::sigmoid(g));
        let (gate, up) = (self.gate * tg, self.up * tu);
        (gate * s * up, up * s * (1.0 - tg * tg + gate * (1.0 - s)), gate * s * (1.0 - tu * tu))
    }

    fn with_fn<U: PairFnUser>(self, user: U) -> U::Out {
        let (gate, up) = (self.gate as f32, self.up as f32);
        user.call(Caps { gate, over_gate: 1.0 / gate, up, over_up: 1.0 / up })
    }
}
