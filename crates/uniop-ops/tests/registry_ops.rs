//! Every registered op, every dtype it declares: contiguous, strided (inputs and outputs) and
//! 0-size cases, each checked against the op's f64 reference. Generic over the registry — a new
//! op is covered the moment it is registered.

use uniop::verify::{attr_refs, check_outputs, fill_random_in, infer, OpHarness, Rng};
use uniop::{DType, Executor, Layout, Registry, Stream, Tensor, TensorMeta, TensorMut, TensorRef};

fn ops() -> Vec<std::sync::Arc<uniop::OpEntry>> {
    uniop_ops::init();
    let ops = Registry::global().list();
    assert!(ops.len() >= uniop_ops::builtin_ops().len());
    ops
}

fn check_example(entry: &std::sync::Arc<uniop::OpEntry>, shape: &[usize], dtype: DType) {
    let example = entry.op.example(Some(shape), dtype).unwrap();
    let mut h = OpHarness::new(entry.clone(), example, 7).unwrap();
    h.run(Stream::default_stream()).unwrap();
    let report = h.check().unwrap();
    assert!(report.pass(), "{} {dtype} {shape:?}:\n{report}", entry.name());
}

#[test]
fn contiguous_inputs_match_reference() {
    for entry in ops() {
        for &dtype in entry.op.dtypes() {
            // Odd sizes exercise vector tails; 3-D exercises multi-dim rows.
            for shape in [&[3usize, 70][..], &[2, 3, 129], &[1, 1], &[5, 4096]] {
                check_example(&entry, shape, dtype);
            }
        }
    }
}

#[test]
fn zero_size_inputs_are_valid() {
    for entry in ops() {
        for &dtype in entry.op.dtypes() {
            check_example(&entry, &[0, 64], dtype);
            check_example(&entry, &[2, 0, 64], dtype);
        }
    }
}

/// A layout with the same shape as `meta` but not contiguous: `pad` extra elements after every
/// row (dense inner dim), or an inner stride of 2 when `pad` is 0.
fn strided(meta: &TensorMeta, pad: usize) -> TensorMeta {
    let shape = meta.shape();
    let rank = shape.len();
    let mut strides = vec![0; rank];
    let mut acc = if pad == 0 { 2 } else { 1 };
    for d in (0..rank).rev() {
        strides[d] = acc;
        acc *= shape[d].max(1);
        if d == rank - 1 {
            acc += pad;
        }
    }
    TensorMeta { dtype: meta.dtype, layout: Layout::strided(shape, &strides, 3).unwrap() }
}

#[test]
fn strided_inputs_and_outputs_match_reference() {
    for entry in ops() {
        for &dtype in entry.op.dtypes() {
            for pad in [0, 5] {
                let example = entry.op.example(Some(&[4, 3, 67]), dtype).unwrap();
                let mut rng = Rng::new(11);
                let inputs: Vec<Option<Tensor>> = example
                    .inputs
                    .iter()
                    .enumerate()
                    .map(|(i, m)| {
                        // Optional inputs the example leaves out stay out.
                        let mut t = Tensor::with_meta(strided(m.as_ref()?, pad)).unwrap();
                        fill_random_in(&mut t.view_mut(), &mut rng, example.ranges.get(i).copied().flatten());
                        Some(t)
                    })
                    .collect();
                let attrs = attr_refs(&example.attrs);
                let views: Vec<Option<TensorRef>> = inputs.iter().map(|t| t.as_ref().map(Tensor::view)).collect();
                let out_metas = infer(&entry, &views, &attrs).unwrap();
                let mut outputs: Vec<Tensor> =
                    out_metas.iter().map(|m| Tensor::with_meta(strided(m, pad)).unwrap()).collect();
                let outs: Vec<TensorMut> = outputs.iter_mut().map(Tensor::view_mut).collect();
                let mut exec = Executor::new(entry.clone(), &views, &attrs, outs).unwrap();
                let mut ws = vec![0u8; exec.workspace_size()];
                exec.run(&mut ws, Stream::default_stream()).unwrap();
                let out_views: Vec<TensorRef> = outputs.iter().map(Tensor::view).collect();
                let report = check_outputs(&entry, &views, &attrs, &out_views).unwrap();
                assert!(report.pass(), "{} {dtype} pad {pad}:\n{report}", entry.name());
            }
        }
    }
}

#[test]
fn every_op_documents_itself_and_links_backward_to_a_registered_op() {
    for entry in ops() {
        assert!(!entry.op.doc().is_empty(), "{}", entry.name());
        assert!(!entry.op.dtypes().is_empty(), "{}", entry.name());
        if let Some(bw) = entry.op.backward() {
            assert!(Registry::global().contains(bw), "{} names missing backward {bw}", entry.name());
        }
    }
}
