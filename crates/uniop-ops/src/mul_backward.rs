//! `mul_backward(dout, a, b, needs_da, needs_db) -> (da, db)`: the gradient of [`mul`](crate::mul):
//! `da = dout · b` and `db = dout · a`, each summed over the dims its operand was broadcast along
//! ([`broadcast_grad`](crate::broadcast_grad)) in the same pass as the product.

use crate::broadcast_grad::{self, A, B, DOUT};
use crate::elementwise::Map2;
use uniop::{with_float_dtype, DType, Element, Example, Op, OpCx, Plan, RefTensor, Result, TensorMeta};

pub struct MulBackward;

const DTYPES: &[DType] = &[DType::F32, DType::F16, DType::BF16];

struct Product;

impl Map2 for Product {
    #[inline(always)]
    fn apply<T: Element>(&self, dout: f32, other: f32) -> f32 {
        dout * other
    }
}

impl Op for MulBackward {
    fn schema(&self) -> &'static str {
        "mul_backward(Tensor dout, Tensor a, Tensor b, bool needs_da=True, bool needs_db=True) -> (Tensor da, Tensor db)"
    }

    fn doc(&self) -> &'static str {
        "Gradient of mul: da = dout * b and db = dout * a, each summed over the dims its operand was broadcast \
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
        let wanted =
            [("a", B), ("b", A)].map(|(operand, other)| cx.needs_grad(operand).then_some((Some(other), Product)));
        let (steps, workspace) = with_float_dtype!(grads[0].dtype, cx.op(), "dout", |T| {
            broadcast_grad::pair_steps::<T, _>("mul_backward", cx, &grads, wanted)
        });
        Ok(Plan::new(steps).workspace(workspace))
    }

    fn reference(&self, cx: &OpCx, inputs: &[Option<RefTensor>]) -> Result<Vec<RefTensor>> {
        let [dout, a, b] = [DOUT, A, B].map(|i| inputs[i].as_ref().unwrap());
        let times = |other: &RefTensor| {
            let n = dout.data.len();
            RefTensor::new(&dout.shape, (0..n).map(|i| dout.data[i] * other.broadcast_get(&dout.shape, i)).collect())
        };
        Ok(vec![broadcast_grad::reference(cx, "a", &times(b)), broadcast_grad::reference(cx, "b", &times(a))])
    }

    fn error_scale(&self, cx: &OpCx) -> f64 {
        broadcast_grad::error_scale(cx)
    }

    fn example(&self, shape: Option<&[usize]>, dtype: DType) -> Result<Example> {
        broadcast_grad::example(shape, dtype)
    }
}
