//! A third-party op library: `squared_relu(x) = max(x, 0)²` (Primer / Nemotron MLPs), not in
//! uniop's built-in set, and its gradient `squared_relu_backward`. Written against the same `Op`
//! trait as the built-ins and exported with one macro; `uniopLoadOpLibrary("libuniop_plugin_example.so")`
//! (or `uniop::plugin::load`) makes both callable from every frontend, and naming the second as the
//! first's `backward` makes `squared_relu` trainable wherever uniop wires autograd (torch.ops.uniop).

use uniop::{
    block_dim_for, with_float_dtype, BlockCtx, DType, Example, FloatElement, KernelArgs, LayoutNeed, Op, OpCx, Plan,
    RefTensor, Result, Step, TensorMeta,
};

pub struct SquaredRelu;

const DTYPES: &[DType] = &[DType::F32, DType::F16, DType::BF16];

/// `y[i] = f(inputs[0][i], inputs[1][i], …)` over contiguous inputs and output of `n` elements.
fn elementwise<T: FloatElement, const N: usize>(
    args: &KernelArgs,
    ctx: BlockCtx,
    n: usize,
    f: impl Fn([f32; N]) -> f32,
) {
    let range = ctx.split(n);
    let inputs: [&[T]; N] = std::array::from_fn(|i| {
        let x = args.input(i);
        &x.storage::<T>().expect("dtype dispatched")[x.layout().offset() + range.start..][..range.len()]
    });
    let y = args.output(0);
    // SAFETY: blocks own disjoint ranges of the (contiguous) output.
    let ys = unsafe { y.slice_mut::<T>(y.layout().offset() + range.start, range.len()) };
    for (k, o) in ys.iter_mut().enumerate() {
        *o = T::from_f32(f(std::array::from_fn(|i| inputs[i][k].to_f32())));
    }
}

/// A plan running `f` elementwise over the op's (contiguous) inputs into its one output. `f` is a
/// type parameter, not a function pointer, so that it inlines into the loop, which then vectorizes.
fn elementwise_plan<const N: usize, F>(cx: &OpCx, name: &'static str, f: F) -> Result<Plan>
where
    F: Fn([f32; N]) -> f32 + Copy + Send + Sync + 'static,
{
    let x = cx.input("x");
    let n = x.numel();
    let block_dim = block_dim_for(n, (N + 1) * x.dtype.size());
    let step = with_float_dtype!(x.dtype, cx.op(), "x", |T| {
        Step::new(name, block_dim, move |a, c| elementwise::<T, N>(a, c, n, f))
    });
    Ok(Plan::new(vec![step]).inputs_need(vec![LayoutNeed::Contiguous; N]).outputs_need(vec![LayoutNeed::Contiguous]))
}

fn required(inputs: &[Option<RefTensor>], i: usize) -> &RefTensor {
    inputs[i].as_ref().expect("tensor arguments are required")
}

impl Op for SquaredRelu {
    fn schema(&self) -> &'static str {
        "squared_relu(Tensor x) -> Tensor y"
    }

    fn doc(&self) -> &'static str {
        "y = max(x, 0)^2 elementwise (example plugin op)."
    }

    fn dtypes(&self) -> &'static [DType] {
        DTYPES
    }

    fn infer(&self, cx: &OpCx) -> Result<Vec<TensorMeta>> {
        let dtype = cx.expect_dtype_in("x", DTYPES)?;
        Ok(vec![TensorMeta::contiguous(dtype, cx.input("x").shape())?])
    }

    fn backward(&self) -> Option<&'static str> {
        Some("squared_relu_backward")
    }

    fn plan(&self, cx: &OpCx) -> Result<Plan> {
        elementwise_plan(cx, "squared_relu", |[x]| x.max(0.0) * x.max(0.0))
    }

    fn reference(&self, _cx: &OpCx, inputs: &[Option<RefTensor>]) -> Result<Vec<RefTensor>> {
        let x = required(inputs, 0);
        Ok(vec![RefTensor::new(&x.shape, x.data.iter().map(|v| v.max(0.0).powi(2)).collect())])
    }

    fn example(&self, shape: Option<&[usize]>, dtype: DType) -> Result<Example> {
        Ok(Example {
            inputs: vec![Some(TensorMeta::contiguous(dtype, shape.unwrap_or(&[4096, 4096]))?)],
            ..Default::default()
        })
    }
}

pub struct SquaredReluBackward;

impl Op for SquaredReluBackward {
    fn schema(&self) -> &'static str {
        "squared_relu_backward(Tensor dy, Tensor x) -> Tensor dx"
    }

    fn doc(&self) -> &'static str {
        "Gradient of squared_relu: dx = dy * 2 * max(x, 0) elementwise (example plugin op)."
    }

    fn dtypes(&self) -> &'static [DType] {
        DTYPES
    }

    fn infer(&self, cx: &OpCx) -> Result<Vec<TensorMeta>> {
        let dtype = cx.expect_dtype_in("x", DTYPES)?;
        cx.expect_same_dtype("dy", dtype, "x")?;
        cx.expect_shape("dy", cx.input("x").shape())?;
        Ok(vec![TensorMeta::contiguous(dtype, cx.input("x").shape())?])
    }

    fn plan(&self, cx: &OpCx) -> Result<Plan> {
        // d/dx max(x, 0)² = 2·max(x, 0)
        elementwise_plan(cx, "squared_relu_backward", |[dy, x]| dy * 2.0 * x.max(0.0))
    }

    fn reference(&self, _cx: &OpCx, inputs: &[Option<RefTensor>]) -> Result<Vec<RefTensor>> {
        let (dy, x) = (required(inputs, 0), required(inputs, 1));
        let dx = dy.data.iter().zip(&x.data).map(|(g, v)| g * 2.0 * v.max(0.0)).collect();
        Ok(vec![RefTensor::new(&x.shape, dx)])
    }

    fn example(&self, shape: Option<&[usize]>, dtype: DType) -> Result<Example> {
        let meta = TensorMeta::contiguous(dtype, shape.unwrap_or(&[4096, 4096]))?;
        Ok(Example { inputs: vec![Some(meta.clone()), Some(meta)], ..Default::default() })
    }
}

uniop::export_ops!(SquaredRelu, SquaredReluBackward);
