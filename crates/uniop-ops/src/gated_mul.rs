//! `silu_mul(gate, up) = silu(gate) · up` and `gelu_mul(gate, up, approximate) = gelu(gate) · up`:
//! the gated activations of HF's MLPs (`act_fn(gate_proj(x)) * up_proj(x)`; SiLU for Llama's
//! SwiGLU, GELU for Gemma's GeGLU), fused so the activation never round-trips through memory.
//!
//! `gate` and `up` must have the same shape (they are two projections of one input); any strides.

use crate::elementwise::{self, Map2};
use crate::gate::{op_name, with_gate_fn, GateFn, Gating};
use uniop::{
    block_dim_for, with_float_dtype, DType, Element, Example, Op, OpCx, Plan, RefTensor, Result, Step, TensorMeta,
};

pub struct GatedMul(Gating);

impl GatedMul {
    pub const SILU: GatedMul = GatedMul(Gating::Silu);
    pub const GELU: GatedMul = GatedMul(Gating::Gelu);
}

pub(crate) const DTYPES: &[DType] = &[DType::F32, DType::F16, DType::BF16];

struct GatedMap<A>(A);

impl<A: GateFn> Map2 for GatedMap<A> {
    #[inline(always)]
    fn apply<T: Element>(&self, gate: f32, up: f32) -> f32 {
        A::act::<T>(gate) * up
    }
}

/// Checks the (gate, up) pair shared by forward and backward; returns their dtype.
pub(crate) fn check_gate_up(cx: &OpCx) -> Result<DType> {
    let dtype = cx.expect_dtype_in("gate", DTYPES)?;
    cx.expect_same_dtype("up", dtype, "gate")?;
    cx.expect_shape("up", cx.input("gate").shape())?;
    Ok(dtype)
}

impl Op for GatedMul {
    fn schema(&self) -> &'static str {
        match self.0 {
            Gating::Silu => "silu_mul(Tensor gate, Tensor up) -> Tensor out",
            Gating::Gelu => "gelu_mul(Tensor gate, Tensor up, str approximate='none') -> Tensor out",
        }
    }

    fn doc(&self) -> &'static str {
        match self.0 {
            Gating::Silu => {
                "silu(gate) * up elementwise (HF LlamaMLP's act_fn(gate_proj(x)) * up_proj(x)). gate and up share \
                 shape and dtype; any strides. f16/bf16 compute in float32."
            }
            Gating::Gelu => {
                "gelu(gate, approximate) * up elementwise (HF GemmaMLP's act_fn(gate_proj(x)) * up_proj(x); \
                 approximate 'none' or 'tanh' as torch.nn.functional.gelu's, Gemma's gelu_pytorch_tanh is 'tanh'). \
                 gate and up share shape and dtype; any strides. f16/bf16 compute in float32."
            }
        }
    }

    fn dtypes(&self) -> &'static [DType] {
        DTYPES
    }

    fn elementwise(&self) -> bool {
        true
    }

    fn backward(&self) -> Option<&'static str> {
        Some(match self.0 {
            Gating::Silu => "silu_mul_backward",
            Gating::Gelu => "gelu_mul_backward",
        })
    }

    fn infer(&self, cx: &OpCx) -> Result<Vec<TensorMeta>> {
        let dtype = check_gate_up(cx)?;
        self.0.activation(cx)?;
        Ok(vec![TensorMeta::contiguous(dtype, cx.input("gate").shape())?])
    }

    fn plan(&self, cx: &OpCx) -> Result<Plan> {
        let dtype = check_gate_up(cx)?;
        let activation = self.0.activation(cx)?;
        let n = cx.input("gate").numel();
        let block_dim = block_dim_for(n, 3 * dtype.size());
        let streaming = elementwise::streams_bytes(n * dtype.size());
        let name = op_name(self.schema());
        with_float_dtype!(dtype, cx.op(), "gate", |T| with_gate_fn!(activation, |A| {
            Ok(Plan::new(vec![Step::new(name, block_dim, move |args, ctx| {
                elementwise::binary::<T, _>(args, ctx, &GatedMap(A {}), streaming)
            })]))
        }))
    }

    fn reference(&self, cx: &OpCx, inputs: &[Option<RefTensor>]) -> Result<Vec<RefTensor>> {
        let activation = self.0.activation(cx)?;
        let (g, u) = (inputs[0].as_ref().unwrap(), inputs[1].as_ref().unwrap());
        let data = g.data.iter().zip(&u.data).map(|(&g, &u)| activation.exact(g) * u).collect();
        Ok(vec![RefTensor::new(&g.shape, data)])
    }

    fn example(&self, shape: Option<&[usize]>, dtype: DType) -> Result<Example> {
        let meta = TensorMeta::contiguous(dtype, shape.unwrap_or(&[4096, 11008]))?;
        Ok(Example { inputs: vec![Some(meta.clone()), Some(meta)], attrs: vec![], ..Default::default() })
    }
}
