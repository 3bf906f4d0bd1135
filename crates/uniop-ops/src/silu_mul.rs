//! `silu_mul(gate, up) = silu(gate) · up` — the gated activation of HF's `LlamaMLP`
//! (`act_fn(gate_proj(x)) * up_proj(x)`), fused so the product never round-trips through memory.
//!
//! `gate` and `up` must have the same shape (they are two projections of one input); any strides.

use crate::elementwise::{self, Map2};
use crate::math;
use uniop::{
    block_dim_for, with_float_dtype, DType, Element, Example, Op, OpCx, Plan, RefTensor, Result, Step, TensorMeta,
};

pub struct SiluMul;

pub(crate) const DTYPES: &[DType] = &[DType::F32, DType::F16, DType::BF16];

struct SiluMulMap;

impl Map2 for SiluMulMap {
    #[inline(always)]
    fn apply<T: Element>(&self, gate: f32, up: f32) -> f32 {
        math::silu::<T>(gate) * up
    }
}

/// Checks the (gate, up) pair shared by forward and backward; returns their dtype.
pub(crate) fn check_gate_up(cx: &OpCx) -> Result<DType> {
    let dtype = cx.expect_dtype_in("gate", DTYPES)?;
    cx.expect_same_dtype("up", dtype, "gate")?;
    cx.expect_shape("up", cx.input("gate").shape())?;
    Ok(dtype)
}

impl Op for SiluMul {
    fn schema(&self) -> &'static str {
        "silu_mul(Tensor gate, Tensor up) -> Tensor out"
    }

    fn doc(&self) -> &'static str {
        "silu(gate) * up elementwise (HF LlamaMLP's act_fn(gate_proj(x)) * up_proj(x)). gate and up share shape \
         and dtype; any strides. f16/bf16 compute in float32."
    }

    fn dtypes(&self) -> &'static [DType] {
        DTYPES
    }

    fn elementwise(&self) -> bool {
        true
    }

    fn backward(&self) -> Option<&'static str> {
        Some("silu_mul_backward")
    }

    fn infer(&self, cx: &OpCx) -> Result<Vec<TensorMeta>> {
        let dtype = check_gate_up(cx)?;
        Ok(vec![TensorMeta::contiguous(dtype, cx.input("gate").shape())?])
    }

    fn plan(&self, cx: &OpCx) -> Result<Plan> {
        let dtype = check_gate_up(cx)?;
        let n = cx.input("gate").numel();
        let block_dim = block_dim_for(n, 3 * dtype.size());
        let streaming = elementwise::streams_bytes(n * dtype.size());
        with_float_dtype!(dtype, cx.op(), "gate", |T| {
            Ok(Plan::new(vec![Step::new("silu_mul", block_dim, move |args, ctx| {
                elementwise::binary::<T, _>(args, ctx, &SiluMulMap, streaming)
            })]))
        })
    }

    fn reference(&self, _cx: &OpCx, inputs: &[Option<RefTensor>]) -> Result<Vec<RefTensor>> {
        let (g, u) = (inputs[0].as_ref().unwrap(), inputs[1].as_ref().unwrap());
        let data = g.data.iter().zip(&u.data).map(|(&g, &u)| math::exact::silu(g) * u).collect();
        Ok(vec![RefTensor::new(&g.shape, data)])
    }

    fn example(&self, shape: Option<&[usize]>, dtype: DType) -> Result<Example> {
        let meta = TensorMeta::contiguous(dtype, shape.unwrap_or(&[4096, 11008]))?;
        Ok(Example { inputs: vec![Some(meta.clone()), Some(meta)], attrs: vec![], ..Default::default() })
    }
}
