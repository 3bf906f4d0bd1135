//! `linear_add_backward(dy, x, weight, batch_dims=0, needs_dx=True, needs_dweight=True) -> (dx,
//! dweight, dresidual)`, the gradient of [`linear_add`](crate::linear_add): `linear_backward`'s two
//! launches (leaving out what the call does not ask for), the second writing `dresidual = dy` (a
//! copy: returns never alias inputs) in place of the bias sum.

use crate::linear_backward::{dims, dweight_shape, dx_shape, needs, samples, Third};
use crate::matmul::DTYPES;
use uniop::{DType, Example, Op, OpCx, Plan, RefTensor, Result, TensorMeta};

pub struct LinearAddBackward;

impl Op for LinearAddBackward {
    fn schema(&self) -> &'static str {
        "linear_add_backward(Tensor dy, Tensor x, Tensor weight, int batch_dims=0, bool needs_dx=True, bool \
         needs_dweight=True) -> (Tensor dx, Tensor dweight, Tensor dresidual)"
    }

    fn doc(&self) -> &'static str {
        "Gradients of linear_add: dx = dy @ weight, dweight = dy^T @ x (summed over all leading dims of x; per \
         sample with batch_dims: x.shape[:batch_dims] + [out_features, in_features]), dresidual = dy. \
         needs_dx=False leaves dx out (returned empty, [0]), needs_dweight=False dweight."
    }

    /// Row by row; the parameter gradients per sample with `batch_dims`.
    fn leading_batch_args(&self) -> &'static [&'static str] {
        &["dy", "x"]
    }

    fn dtypes(&self) -> &'static [DType] {
        DTYPES
    }

    fn error_scale(&self, cx: &OpCx) -> f64 {
        dims(cx).map_or(1.0, |d| (d.rows.max(d.n).max(1) as f64).sqrt())
    }

    fn infer(&self, cx: &OpCx) -> Result<Vec<TensorMeta>> {
        let (d, samples) = (dims(cx)?, samples(cx)?);
        let dtype = cx.input("x").dtype;
        Ok(vec![
            TensorMeta::contiguous(dtype, &dx_shape(cx))?,
            TensorMeta::contiguous(dtype, &dweight_shape(cx, &samples, d))?,
            TensorMeta::contiguous(dtype, cx.input("dy").shape())?,
        ])
    }

    fn plan(&self, cx: &OpCx) -> Result<Plan> {
        let names = ["linear_add_backward.dx", "linear_add_backward.dweight"];
        crate::linear_backward::plan(cx, dims(cx)?, Third::ResidualCopy, names)
    }

    fn reference(&self, cx: &OpCx, inputs: &[Option<RefTensor>]) -> Result<Vec<RefTensor>> {
        let (d, samples) = (dims(cx)?, samples(cx)?);
        let (dx, dw) = crate::linear_backward::reference(d, &samples, needs(cx), inputs);
        let dy = inputs[0].as_ref().unwrap();
        let dweight = RefTensor::new(&dweight_shape(cx, &samples, d), dw);
        Ok(vec![RefTensor::new(&dx_shape(cx), dx), dweight, dy.clone()])
    }

    /// x's shape, as for linear_add.
    fn example_shape(&self, example: &Example) -> Vec<usize> {
        example.input_shape(1)
    }

    fn example(&self, shape: Option<&[usize]>, dtype: DType) -> Result<Example> {
        // `shape` is x's, as for linear_add (a square weight).
        crate::linear_backward::example(shape, dtype, 1)
    }
}
