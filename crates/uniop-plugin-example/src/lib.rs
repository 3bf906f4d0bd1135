//! A third-party op library: `squared_relu(x) = max(x, 0)²` (Primer / Nemotron MLPs), not in
//! uniop's built-in set. Written against the same `Op` trait as the built-ins and exported with
//! one macro; `uniopLoadOpLibrary("libuniop_plugin_example.so")` (or `uniop::plugin::load`) makes
//! it callable from every frontend.

use uniop::{
    block_dim_for, with_float_dtype, BlockCtx, DType, Example, FloatElement, KernelArgs, LayoutNeed, Op, OpCx, Plan,
    RefTensor, Result, Step, TensorMeta,
};

pub struct SquaredRelu;

const DTYPES: &[DType] = &[DType::F32, DType::F16, DType::BF16];

fn kernel<T: FloatElement>(args: &KernelArgs, ctx: BlockCtx, n: usize) {
    let (x, y) = (args.input(0), args.output(0));
    let range = ctx.split(n);
    let xs = &x.storage::<T>().expect("dtype dispatched")[x.layout().offset() + range.start..][..range.len()];
    // SAFETY: blocks own disjoint ranges of the (contiguous) output.
    let ys = unsafe { y.slice_mut::<T>(y.layout().offset() + range.start, range.len()) };
    for (o, &v) in ys.iter_mut().zip(xs) {
        let r = v.to_f32().max(0.0);
        *o = T::from_f32(r * r);
    }
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

    fn plan(&self, cx: &OpCx) -> Result<Plan> {
        let x = cx.input("x");
        let n = x.numel();
        let block_dim = block_dim_for(n, x.dtype.size());
        let step = with_float_dtype!(x.dtype, cx.op(), "x", |T| {
            Step::new("squared_relu", block_dim, move |a, c| kernel::<T>(a, c, n))
        });
        Ok(Plan::new(vec![step]).inputs_need(vec![LayoutNeed::Contiguous]).outputs_need(vec![LayoutNeed::Contiguous]))
    }

    fn reference(&self, _cx: &OpCx, inputs: &[Option<RefTensor>]) -> Result<Vec<RefTensor>> {
        let x = inputs[0].as_ref().expect("x is required");
        Ok(vec![RefTensor::new(&x.shape, x.data.iter().map(|v| v.max(0.0).powi(2)).collect())])
    }

    fn example(&self, shape: Option<&[usize]>, dtype: DType) -> Result<Example> {
        Ok(Example {
            inputs: vec![Some(TensorMeta::contiguous(dtype, shape.unwrap_or(&[4096, 4096]))?)],
            ..Default::default()
        })
    }
}

uniop::export_ops!(SquaredRelu);
