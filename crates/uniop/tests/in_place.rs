//! In-place (`Tensor(a!)`) arguments through the executor: bound with the outputs, visible to
//! the op as named inputs, staged through the workspace in both directions when the kernel needs
//! another layout, and rejected clearly when passed where a read-only input goes.

use uniop::{
    AttrValue, DType, Example, Executor, KernelArgs, LayoutNeed, Op, OpCx, Plan, RefTensor, Registry, Result, Step,
    Stream, TensorMeta, TensorMut, TensorRef,
};

/// `x += alpha · y` in place; its kernel insists on a contiguous `x`, so strided callers are staged.
struct AxpyInPlace;

impl Op for AxpyInPlace {
    fn schema(&self) -> &'static str {
        "test_axpy_(Tensor(a!) x, Tensor y, float alpha) -> ()"
    }
    fn doc(&self) -> &'static str {
        "x += alpha * y, in place (test op)"
    }
    fn dtypes(&self) -> &'static [DType] {
        &[DType::F32]
    }
    fn infer(&self, cx: &OpCx) -> Result<Vec<TensorMeta>> {
        cx.expect_dtype_in("x", &[DType::F32])?;
        cx.expect_same_dtype("y", DType::F32, "x")?;
        cx.expect_shape("y", cx.input("x").shape())?;
        Ok(vec![])
    }
    fn plan(&self, cx: &OpCx) -> Result<Plan> {
        let alpha = cx.float("alpha") as f32;
        let n = cx.input("x").numel();
        let step = Step::new("test_axpy_", 2, move |args: &KernelArgs, ctx| {
            let y = args.input(1).to_vec::<f32>().unwrap();
            let range = ctx.split(n);
            // SAFETY: blocks own disjoint ranges of the (contiguous, staged if need be) output.
            let x = unsafe { args.output(0).slice_mut::<f32>(range.start, range.len()) };
            for (xi, yi) in x.iter_mut().zip(&y[range]) {
                *xi += alpha * yi;
            }
        });
        Ok(Plan::new(vec![step]).outputs_need(vec![LayoutNeed::Contiguous]))
    }
    fn reference(&self, cx: &OpCx, inputs: &[Option<RefTensor>]) -> Result<Vec<RefTensor>> {
        let (x, y) = (inputs[0].as_ref().unwrap(), inputs[1].as_ref().unwrap());
        let data = x.data.iter().zip(&y.data).map(|(a, b)| a + cx.float("alpha") * b).collect();
        Ok(vec![RefTensor::new(&x.shape, data)])
    }
    fn example(&self, _shape: Option<&[usize]>, dtype: DType) -> Result<Example> {
        let m = TensorMeta::contiguous(dtype, &[4, 5])?;
        Ok(Example {
            inputs: vec![Some(m.clone()), Some(m)],
            attrs: vec![("alpha".into(), 2.0.into())],
            ..Default::default()
        })
    }
}

fn register() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| Registry::global().register(Box::new(AxpyInPlace)).unwrap());
}

#[test]
fn strided_in_place_tensor_is_staged_both_ways() {
    register();
    // x is the even columns of a [3, 8] buffer; the odd columns must stay untouched.
    let mut storage: Vec<f32> = (0..24).map(|i| i as f32).collect();
    let y: Vec<f32> = (0..12).map(|i| 100.0 * i as f32).collect();
    let expected: Vec<f32> =
        (0..24).map(|i| if i % 2 == 0 { i as f32 + 0.5 * 100.0 * (i / 2) as f32 } else { i as f32 }).collect();
    {
        let x = TensorMut::strided(&mut storage, &[3, 4], &[8, 2], 0).unwrap();
        let y = TensorRef::new(&y, &[3, 4]).unwrap();
        let alpha = [("alpha", AttrValue::Float(0.5))];
        let mut exec = Executor::by_name("test_axpy_", &[Some(y)], &alpha, vec![x]).unwrap();
        assert!(exec.workspace_size() >= 12 * 4, "a strided in-place tensor is staged");
        let mut ws = vec![0u8; exec.workspace_size()];
        exec.run(&mut ws, Stream::default_stream()).unwrap();
    }
    assert_eq!(storage, expected);
}

#[test]
fn in_place_tensor_passed_as_an_input_is_a_clear_error() {
    register();
    let (x, y) = (vec![1.0f32; 4], vec![2.0f32; 4]);
    let views = [Some(TensorRef::new(&x, &[4]).unwrap()), Some(TensorRef::new(&y, &[4]).unwrap())];
    let e = Executor::by_name("test_axpy_", &views, &[("alpha", AttrValue::Float(1.0))], vec![]).err().unwrap();
    assert_eq!(e.code(), uniop::ErrorCode::ParamInvalid);
    assert!(e.message().contains("in-place tensors (x) first among the outputs"), "{e}");
}

#[test]
fn in_place_tensor_is_validated_like_an_input() {
    register();
    let (mut x, y) = (vec![1.0f32; 4], vec![2.0f32; 5]);
    let x = TensorMut::new(&mut x, &[4]).unwrap();
    let y = TensorRef::new(&y, &[5]).unwrap();
    let e = Executor::by_name("test_axpy_", &[Some(y)], &[("alpha", AttrValue::Float(1.0))], vec![x]).err().unwrap();
    assert_eq!(e.code(), uniop::ErrorCode::Shape);
    assert!(e.message().contains("'y'") && e.message().contains("[4]"), "{e}");
}

/// Inputs are numbered as the caller passed them (in-place arguments skipped) when rebinding a
/// repeatable executor.
#[test]
fn rebinding_uses_the_callers_input_numbering() {
    register();
    let (mut x, y1, y2) = (vec![0.0f32; 4], vec![1.0f32; 4], vec![10.0f32; 4]);
    let alpha = [("alpha", AttrValue::Float(1.0))];
    let ys = [TensorRef::new(&y1, &[4]).unwrap(), TensorRef::new(&y2, &[4]).unwrap()];
    let mut exec =
        Executor::by_name("test_axpy_", &[Some(ys[0].clone())], &alpha, vec![TensorMut::new(&mut x, &[4]).unwrap()])
            .unwrap();
    exec.set_repeatable();
    assert_eq!(exec.input_meta(0), Some(ys[0].meta()));
    assert_eq!(exec.output_meta(0).map(|m| m.shape().to_vec()), Some(vec![4]));
    assert!(exec.input_meta(1).is_none());
    exec.run(&mut [], Stream::default_stream()).unwrap();
    exec.rebind_input(0, ys[1].clone()).unwrap();
    exec.run(&mut [], Stream::default_stream()).unwrap();
    let e = exec.rebind_input(1, ys[1].clone()).unwrap_err();
    assert!(e.message().contains("no input 1"), "{e}");
    drop(exec);
    assert_eq!(x, vec![11.0; 4]);
}

/// [`AxpyInPlace`]'s kernel under another schema, claiming `args` as its leading-batch arguments
/// and `cores` as its broadcast ones.
struct Claims {
    schema: &'static str,
    args: &'static [&'static str],
    cores: &'static [(&'static str, usize)],
}

impl Op for Claims {
    fn schema(&self) -> &'static str {
        self.schema
    }
    fn doc(&self) -> &'static str {
        "leading_batch_args and core_dims checks (test op)"
    }
    fn dtypes(&self) -> &'static [DType] {
        &[DType::F32]
    }
    fn leading_batch_args(&self) -> &'static [&'static str] {
        self.args
    }
    fn core_dims(&self) -> &'static [(&'static str, usize)] {
        self.cores
    }
    fn infer(&self, cx: &OpCx) -> Result<Vec<TensorMeta>> {
        AxpyInPlace.infer(cx)
    }
    fn plan(&self, cx: &OpCx) -> Result<Plan> {
        AxpyInPlace.plan(cx)
    }
    fn reference(&self, cx: &OpCx, inputs: &[Option<RefTensor>]) -> Result<Vec<RefTensor>> {
        AxpyInPlace.reference(cx, inputs)
    }
    fn example(&self, shape: Option<&[usize]>, dtype: DType) -> Result<Example> {
        AxpyInPlace.example(shape, dtype)
    }
}

/// Frontends batch an op along the arguments it names in `leading_batch_args`, so registration
/// refuses names that are not tensor arguments (or lists of them) read only, saying which and
/// what it found.
#[test]
fn leading_batch_args_must_name_tensor_arguments_read_only() {
    for (name, args, expected) in [
        (
            "test_batch_written_",
            &["x"][..],
            "names 'x' (expected a Tensor or Tensor[] argument not written in place, given Tensor(a!))",
        ),
        (
            "test_batch_missing_",
            &["z"][..],
            "names 'z' (expected a Tensor or Tensor[] argument not written in place, given no such argument)",
        ),
        (
            "test_batch_attr_",
            &["alpha"][..],
            "names 'alpha' (expected a Tensor or Tensor[] argument not written in place, given float)",
        ),
    ] {
        let schema = Box::leak(format!("{name}(Tensor(a!) x, Tensor y, float alpha) -> ()").into_boxed_str());
        let err = Registry::global().register(Box::new(Claims { schema, args, cores: &[] })).unwrap_err();
        let message = err.to_string();
        assert!(message.contains(&format!("op '{name}': leading_batch_args {expected}")), "{message}");
        assert!(!Registry::global().contains(name));
    }
    let schema = "test_batch_shared_(Tensor(a!) x, Tensor y, float alpha) -> ()";
    Registry::global().register(Box::new(Claims { schema, args: &["y"], cores: &[] })).unwrap();
    assert_eq!(Registry::global().get("test_batch_shared_").unwrap().op.leading_batch_args(), ["y"]);
    // A list batches item by item (cat's tensors).
    let schema = "test_batch_list_(Tensor(a!) x, Tensor[] ys, float alpha) -> ()";
    Registry::global().register(Box::new(Claims { schema, args: &["ys"], cores: &[] })).unwrap();
}

/// Frontends raise `batch_dims` by one per batch, so it must be an int counting from 0 on an op
/// whose rows they batch.
#[test]
fn batch_dims_must_be_an_int_from_0_on_a_batched_op() {
    for (name, batch_dims, args, given) in [
        ("test_batch_dims_float_", "float batch_dims=0.0", &["y"][..], "given `float batch_dims=0.0`)"),
        ("test_batch_dims_from_1_", "int batch_dims=1", &["y"][..], "given `int batch_dims=1`)"),
        (
            "test_batch_dims_unbatched_",
            "int batch_dims=0",
            &[][..],
            "given `int batch_dims=0` without leading_batch_args)",
        ),
    ] {
        let schema =
            Box::leak(format!("{name}(Tensor(a!) x, Tensor y, float alpha, {batch_dims}) -> ()").into_boxed_str());
        let err = Registry::global().register(Box::new(Claims { schema, args, cores: &[] })).unwrap_err();
        let message = err.to_string();
        let expected = "argument 'batch_dims' (expected `int batch_dims=0` on an op declaring leading_batch_args";
        assert!(message.contains(&format!("op '{name}': {expected}, {given}")), "{message}");
        assert!(!Registry::global().contains(name));
    }
    let schema = "test_batch_dims_(Tensor(a!) x, Tensor y, float alpha, int batch_dims=0) -> ()";
    Registry::global().register(Box::new(Claims { schema, args: &["y"], cores: &[] })).unwrap();
}

/// A gradient of an argument outside the rows (`dw`, with `w` shared) sums over every row: one
/// per sample of a batch needs `batch_dims`, so registration refuses such an op without it. A
/// gradient of a row argument (`dy`) is per row already.
#[test]
fn a_sum_over_the_rows_needs_batch_dims() {
    let schema = "test_batch_sum_(Tensor(a!) x, Tensor y, Tensor w, float alpha) -> (Tensor dy, Tensor dw)";
    let err = Registry::global().register(Box::new(Claims { schema, args: &["y"], cores: &[] })).unwrap_err();
    let expected = "op 'test_batch_sum_': returns dw (the gradient of an argument outside leading_batch_args \
                    [\"y\"], a sum over every row) without `int batch_dims=0` (expected one, to keep those sums per \
                    sample)";
    assert!(err.to_string().contains(expected), "{err}");
    assert!(!Registry::global().contains("test_batch_sum_"));
    let schema =
        "test_batch_sums_(Tensor(a!) x, Tensor y, Tensor w, float alpha, int batch_dims=0) -> (Tensor dy, Tensor dw)";
    Registry::global().register(Box::new(Claims { schema, args: &["y"], cores: &[] })).unwrap();
    let schema = "test_batch_rows_(Tensor(a!) x, Tensor y, Tensor w, float alpha) -> (Tensor dy)";
    Registry::global().register(Box::new(Claims { schema, args: &["y"], cores: &[] })).unwrap();
}

/// Frontends broadcast the arguments an op names in `core_dims` against each other, so
/// registration refuses a name that is not a plain tensor argument, one named twice, or the
/// declaration next to another way of batching.
#[test]
fn core_dims_must_name_each_plain_tensor_argument_once() {
    for (name, args, cores, expected) in [
        (
            "test_cores_written_",
            &[][..],
            &[("x", 2)][..],
            "core_dims names 'x' (expected a Tensor argument not written in place, given Tensor(a!))",
        ),
        ("test_cores_twice_", &[][..], &[("y", 2), ("y", 1)][..], "core_dims names 'y' twice"),
        (
            "test_cores_and_rows_",
            &["y"][..],
            &[("y", 2)][..],
            "core_dims [(\"y\", 2)] on an op that is elementwise or declares leading_batch_args",
        ),
    ] {
        let schema = Box::leak(format!("{name}(Tensor(a!) x, Tensor y, float alpha) -> ()").into_boxed_str());
        let err = Registry::global().register(Box::new(Claims { schema, args, cores })).unwrap_err();
        let message = err.to_string();
        assert!(message.contains(&format!("op '{name}': {expected}")), "{message}");
        assert!(!Registry::global().contains(name));
    }
    // A list's items have no common core to broadcast (leading_batch_args takes them item by item).
    let schema = "test_cores_list_(Tensor(a!) x, Tensor[] ys, float alpha) -> ()";
    let err = Registry::global().register(Box::new(Claims { schema, args: &[], cores: &[("ys", 2)] })).unwrap_err();
    assert!(err
        .to_string()
        .contains("core_dims names 'ys' (expected a Tensor argument not written in place, given Tensor[])"));
    let schema = "test_cores_(Tensor(a!) x, Tensor y, float alpha) -> ()";
    Registry::global().register(Box::new(Claims { schema, args: &[], cores: &[("y", 2)] })).unwrap();
    assert_eq!(Registry::global().get("test_cores_").unwrap().op.core_dims(), [("y", 2)]);
}
