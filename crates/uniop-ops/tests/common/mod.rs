//! Helpers shared by the op test binaries.
#![allow(dead_code)] // each test binary uses its own subset

use uniop::verify::{check_outputs, infer, Rng};
use uniop::{AttrValue, DType, Executor, Registry, Tensor, TensorMeta, TensorMut, TensorRef};

pub fn setup() {
    uniop_ops::init();
}

pub fn rand_vec(n: usize, seed: u64) -> Vec<f32> {
    let mut rng = Rng::new(seed);
    (0..n).map(|_| rng.uniform() as f32).collect()
}

/// Runs `op` on views and returns the outputs as f64 vectors, after checking against the reference.
pub fn run_checked(op: &str, inputs: &[Option<TensorRef>], attrs: &[(&str, AttrValue)]) -> Vec<Vec<f64>> {
    run_then(op, inputs, attrs, |entry, views| {
        let report = check_outputs(entry, inputs, attrs, views).unwrap();
        assert!(report.pass(), "{op}:\n{report}");
    })
}

/// Runs `op` on views and returns the outputs as f64 vectors, for a test that judges them itself.
pub fn run_unchecked(op: &str, inputs: &[Option<TensorRef>], attrs: &[(&str, AttrValue)]) -> Vec<Vec<f64>> {
    run_then(op, inputs, attrs, |_, _| {})
}

fn run_then(
    op: &str,
    inputs: &[Option<TensorRef>],
    attrs: &[(&str, AttrValue)],
    check: impl FnOnce(&std::sync::Arc<uniop::OpEntry>, &[TensorRef]),
) -> Vec<Vec<f64>> {
    let entry = Registry::global().get(op).unwrap();
    let metas = infer(&entry, inputs, attrs).unwrap();
    let mut outs: Vec<Tensor> = metas.into_iter().map(|m| Tensor::with_meta(m).unwrap()).collect();
    uniop::call(op, inputs, attrs, outs.iter_mut().map(Tensor::view_mut).collect()).unwrap();
    let views: Vec<TensorRef> = outs.iter().map(Tensor::view).collect();
    check(&entry, &views);
    views.iter().map(|v| v.to_f64_vec()).collect()
}

pub fn plan_err(
    op: &str,
    inputs: &[Option<TensorRef>],
    attrs: &[(&str, AttrValue)],
    outs: Vec<TensorMut>,
) -> uniop::Error {
    match Executor::by_name(op, inputs, attrs, outs) {
        Ok(_) => panic!("{op}: expected an error"),
        Err(e) => e,
    }
}

/// Central finite differences of `Σ forward(inputs)[0] · dout` with respect to input `wrt`,
/// evaluated with the forward op's f64 reference (independent of every kernel).
pub fn finite_difference(
    op: &str,
    inputs: &[(Vec<f64>, Vec<usize>)],
    attrs: &[(&str, AttrValue)],
    dout: &[f64],
    wrt: usize,
) -> Vec<f64> {
    finite_difference_typed(op, inputs, &vec![DType::F32; inputs.len()], attrs, dout, wrt)
}

/// [`finite_difference`] for ops with non-float inputs (their values are passed as f64 anyway).
pub fn finite_difference_typed(
    op: &str,
    inputs: &[(Vec<f64>, Vec<usize>)],
    dtypes: &[DType],
    attrs: &[(&str, AttrValue)],
    dout: &[f64],
    wrt: usize,
) -> Vec<f64> {
    let entry = Registry::global().get(op).unwrap();
    let metas = inputs.iter().zip(dtypes).map(|((_, s), &d)| vec![TensorMeta::contiguous(d, s).unwrap()]).collect();
    let cx = entry.bind(metas, attrs).unwrap();
    let loss = |values: &[(Vec<f64>, Vec<usize>)]| -> f64 {
        let mut refs: Vec<Option<uniop::RefTensor>> =
            values.iter().map(|(v, s)| Some(uniop::RefTensor::new(s, v.clone()))).collect();
        // One slot per tensor argument, as the executor hands references (trailing optional ones absent).
        refs.resize_with(refs.len().max(entry.schema.inputs().count()), || None);
        let out = entry.op.reference(&cx, &refs).unwrap().remove(0);
        out.data.iter().zip(dout).map(|(o, d)| o * d).sum()
    };
    let h = 1e-6;
    (0..inputs[wrt].0.len())
        .map(|i| {
            let (mut p, mut m) = (inputs.to_vec(), inputs.to_vec());
            p[wrt].0[i] += h;
            m[wrt].0[i] -= h;
            (loss(&p) - loss(&m)) / (2.0 * h)
        })
        .collect()
}

pub fn assert_close(got: &[f64], want: &[f64], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (g, w) in got.iter().zip(want) {
        assert!((g - w).abs() < 1e-4 * (1.0 + w.abs()), "{what}: got {g}, finite difference {w}");
    }
}
