//! The activation of a gated pair, `act(gate) · up`: SiLU for SwiGLU MLPs (Llama, Mistral, Qwen,
//! Phi3), GELU for GeGLU ones (Gemma's `gelu_pytorch_tanh`, T5 v1.1's `gelu_new`). One place for
//! the ops built on the pair — `silu_mul`/`gelu_mul`, `swiglu`/`geglu` (one tensor's halves),
//! `linear_silu_mul`/`linear_gelu_mul` (each with its train and packed forms) and their
//! backwards — so a kernel is written once and each activation is a type parameter of it.
//!
//! Why a type parameter and not a runtime flag: kernels are compiled once per instruction set
//! ([`simd_kernel!`](crate::simd_kernel)) and only inlined code gets wide vectors; with a flag,
//! LLVM kept every form in the loops (see [`gelu`](crate::gelu)'s note: 2.7x slower in bf16).
//! [`Gating`] names the op family (its schemas), [`Activation`] is what one call resolved to, and
//! [`with_gate_fn!`] turns that into the [`GateFn`] type a kernel takes.

use crate::math;
use uniop::{Element, OpCx, Result};

/// Which activation an op's gate takes: the op's name says it (`silu_mul`, `gelu_mul`, `swiglu`,
/// `geglu`).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Gating {
    Silu,
    /// With the schema's `approximate` argument, as `gelu`'s: `'none'` (erf) or `'tanh'`.
    Gelu,
}

impl Gating {
    /// The activation of one call (GELU's form from its `approximate` argument).
    pub(crate) fn activation(self, cx: &OpCx) -> Result<Activation> {
        Ok(match self {
            Gating::Silu => Activation::Silu,
            Gating::Gelu if crate::gelu::tanh_approx(cx)? => Activation::GeluTanh,
            Gating::Gelu => Activation::GeluErf,
        })
    }
}

/// An op's name, from its schema (`"gelu_mul(Tensor gate, ...) -> ..."` names `gelu_mul`), for
/// the step names of ops whose schema depends on their gating.
pub(crate) fn op_name(schema: &'static str) -> &'static str {
    schema.split('(').next().unwrap_or(schema)
}

/// One call's activation.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Activation {
    Silu,
    GeluErf,
    GeluTanh,
}

impl Activation {
    /// act(g) in f64, for references.
    pub fn exact(self, g: f64) -> f64 {
        match self {
            Activation::Silu => math::exact::silu(g),
            Activation::GeluErf => math::exact::gelu(g, false),
            Activation::GeluTanh => math::exact::gelu(g, true),
        }
    }

    /// Gradients of act(g) · u for upstream d, `(d_g, d_u)`, in f64 for references.
    pub fn exact_mul_grad(self, d: f64, g: f64, u: f64) -> (f64, f64) {
        match self {
            Activation::Silu => math::exact::silu_mul_grad(d, g, u),
            Activation::GeluErf | Activation::GeluTanh => {
                let tanh = self == Activation::GeluTanh;
                (d * u * math::exact::gelu_grad(g, tanh), d * math::exact::gelu(g, tanh))
            }
        }
    }
}

/// An activation as a type, for kernels (see the module note).
pub(crate) trait GateFn: Copy + Send + Sync + 'static {
    /// act(g), for a result stored as `T`.
    fn act<T: Element>(g: f32) -> f32;
    /// Gradients of act(g) · u for upstream d: `(d_g, d_u)`, for results stored as `T`.
    fn mul_grad<T: Element>(d: f32, g: f32, u: f32) -> (f32, f32);
}

#[derive(Clone, Copy)]
pub(crate) struct SiluFn;

impl GateFn for SiluFn {
    #[inline(always)]
    fn act<T: Element>(g: f32) -> f32 {
        math::silu::<T>(g)
    }

    #[inline(always)]
    fn mul_grad<T: Element>(d: f32, g: f32, u: f32) -> (f32, f32) {
        math::silu_mul_grad::<T>(d, g, u)
    }
}

/// GELU, the tanh form when `TANH`.
#[derive(Clone, Copy)]
pub(crate) struct GeluFn<const TANH: bool>;

impl<const TANH: bool> GateFn for GeluFn<TANH> {
    #[inline(always)]
    fn act<T: Element>(g: f32) -> f32 {
        math::gelu::<T>(g, TANH)
    }

    #[inline(always)]
    fn mul_grad<T: Element>(d: f32, g: f32, u: f32) -> (f32, f32) {
        (d * u * math::gelu_grad::<T>(g, TANH), d * math::gelu::<T>(g, TANH))
    }
}

/// `with_gate_fn!(activation, |A| body)`: `body` with `A` the [`GateFn`] type of `activation`.
macro_rules! with_gate_fn {
    ($activation:expr, |$A:ident| $body:expr) => {
        match $activation {
            $crate::gate::Activation::Silu => {
                type $A = $crate::gate::SiluFn;
                $body
            }
            $crate::gate::Activation::GeluErf => {
                type $A = $crate::gate::GeluFn<false>;
                $body
            }
            $crate::gate::Activation::GeluTanh => {
                type $A = $crate::gate::GeluFn<true>;
                $body
            }
        }
    };
}
pub(crate) use with_gate_fn;
