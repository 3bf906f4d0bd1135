//! `add_backward(dout, a, b, alpha, needs_da, needs_db) -> (da, db)`: the gradient of
//! [`add`](crate::add): `da = dout`, `db = alpha·dout`, each summed over the dims its operand was
//! broadcast along ([`broadcast_grad`](crate::broadcast_grad)). Float dtypes only: integer sums
//! have no gradient.

use crate::broadcast_grad::{self, DOUT};
use crate::elementwise::Map2;
use uniop::{with_float_dtype, AttrValue, DType, Element, Example, Op, OpCx, Plan, RefTensor, Result, TensorMeta};

pub struct AddBackward;

const DTYPES: &[DType] = &[DType::F32, DType::F16, DType::BF16];

/// `scale · dout` (the other operand is not read).
struct Scaled(f32);

impl Map2 for Scaled {
    #[inline(always)]
    fn apply<T: Element>(&self, dout: f32, _: f32) -> f32 {
        self.0 * dout
    }
}

impl Op for AddBackward {
    fn schema(&self) -> &'static str {
        "add_backward(Tensor dout, Tensor a, Tensor b, Scalar alpha=1, bool needs_da=True, bool needs_db=True) -> \
         (Tensor da, Tensor db)"
    }

    fn doc(&self) -> &'static str {
        "Gradient of add: da = dout and db = alpha * dout, each summed over the dims its operand was broadcast \
         along (so da has a's shape, db b's). A gradient whose needs_d<operand> is false comes back empty ([0]). \
         Deterministic (no atomics)."
    }

    fn dtypes(&self) -> &'static [DType] {
        DTYPES
    }

    fn elementwise(&self) -> bool {
        true
    }

    fn infer(&self, cx: &OpCx) -> Result<Vec<TensorMeta>> {
        broadcast_grad::infer(cx, DTYPES)
    }

    fn plan(&self, cx: &OpCx) -> Result<Plan> {
        let grads = self.infer(cx)?;
        let alpha = cx.float("alpha") as f32;
        let wanted =
            [("a", 1.0), ("b", alpha)].map(|(operand, scale)| cx.needs_grad(operand).then_some((None, Scaled(scale))));
        let (steps, workspace) = with_float_dtype!(grads[0].dtype, cx.op(), "dout", |T| {
            broadcast_grad::pair_steps::<T, _>("add_backward", cx, &grads, wanted)
        });
        Ok(Plan::new(steps).workspace(workspace))
    }

    fn reference(&self, cx: &OpCx, inputs: &[Option<RefTensor>]) -> Result<Vec<RefTensor>> {
        let dout = inputs[DOUT].as_ref().unwrap();
        let alpha = cx.float("alpha");
        let scaled = RefTensor::new(&dout.shape, dout.data.iter().map(|&d| alpha * d).collect());
        Ok(vec![broadcast_grad::reference(cx, "a", dout), broadcast_grad::reference(cx, "b", &scaled)])
    }

    fn error_scale(&self, cx: &OpCx) -> f64 {
        broadcast_grad::error_scale(cx)
    }

    fn example(&self, shape: Option<&[usize]>, dtype: DType) -> Result<Example> {
        let mut example = broadcast_grad::example(shape, dtype)?;
        example.attrs.push(("alpha".into(), AttrValue::Float(-0.5)));
        Ok(example)
    }
}
