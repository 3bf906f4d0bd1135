//! Every registered op, every dtype it declares: contiguous, strided (inputs, outputs and in-place
//! tensors) and 0-size cases, each checked against the op's f64 reference. Generic over the registry — a new
//! op is covered the moment it is registered.

use uniop::verify::{random_inputs, OpHarness};
use uniop::{DType, Layout, Registry, Stream, TensorMeta};

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

/// No rows, an empty middle dim, and rows of no elements — which kernels still walk, slicing each
/// from its offset in a zero-length buffer — contiguous and (padded rows from an offset) strided.
/// Every op takes the first two; rows of nothing it may refuse with an error (argmax and sample:
/// no element to pick).
#[test]
fn zero_size_inputs_are_valid() {
    for entry in ops() {
        for &dtype in entry.op.dtypes() {
            for shape in [&[0, 64][..], &[2, 0, 64], &[3, 0], &[2, 3, 0]] {
                let Ok(example) = entry.op.example(Some(shape), dtype) else {
                    // Rows of no classes leave cross_entropy no target to draw.
                    assert_eq!(shape.last(), Some(&0), "{}: no example on {shape:?}", entry.name());
                    continue;
                };
                for pad in [None, Some(5)] {
                    let layout = |m: &TensorMeta| pad.map_or_else(|| m.clone(), |p| strided(m, p));
                    let described = format!("{} {dtype} {shape:?} pad {pad:?}", entry.name());
                    let inputs = random_inputs(&example, 7, layout).unwrap();
                    let mut h = match OpHarness::with_inputs(entry.clone(), inputs, example.attrs.clone(), layout) {
                        Ok(h) => h,
                        Err(e) if shape.last() == Some(&0) && e.code() != uniop::ErrorCode::Internal => continue,
                        Err(e) => panic!("{described}: {e}"),
                    };
                    h.run(Stream::default_stream()).unwrap_or_else(|e| panic!("{described}: {e}"));
                    let report = h.check().unwrap();
                    assert!(report.pass(), "{described}:\n{report}");
                }
            }
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
                let inputs = random_inputs(&example, 11, |m| strided(m, pad)).unwrap();
                let mut h = OpHarness::with_inputs(entry.clone(), inputs, example.attrs, |m| strided(m, pad)).unwrap();
                h.run(Stream::default_stream()).unwrap();
                let report = h.check().unwrap();
                assert!(report.pass(), "{} {dtype} pad {pad}:\n{report}", entry.name());
            }
        }
    }
}

/// `example` with every floating tensor in f64.
fn in_f64(mut example: uniop::Example) -> uniop::Example {
    for meta in example.inputs.iter_mut().flatten() {
        if meta.dtype.is_float() {
            meta.dtype = DType::F64;
        }
    }
    example
}

/// Every op without f64 kernels and without in-place arguments runs f64 calls through its
/// reference (for gradient checks): the op's `infer` accepts them, floating outputs come back in
/// f64 (strided ones through staging), and the values are the reference's to f64 precision.
#[test]
fn f64_calls_run_the_reference() {
    let mut ran = 0;
    for entry in ops() {
        let float = entry.op.dtypes().iter().copied().find(|d| d.is_float());
        let Some(float) = float.filter(|_| !entry.op.dtypes().contains(&DType::F64)) else { continue };
        if entry.schema.mutated().next().is_some() {
            continue;
        }
        for pad in [None, Some(5)] {
            let example = in_f64(entry.op.example(Some(&[3, 2, 9]), float).unwrap());
            let layout = |m: &TensorMeta| pad.map_or_else(|| m.clone(), |p| strided(m, p));
            let inputs = random_inputs(&example, 13, layout).unwrap();
            let mut h = OpHarness::with_inputs(entry.clone(), inputs, example.attrs, layout)
                .unwrap_or_else(|e| panic!("{}: {e}", entry.name()));
            h.run(Stream::default_stream()).unwrap_or_else(|e| panic!("{}: {e}", entry.name()));
            let report = h.check().unwrap();
            assert!(report.pass(), "{} in f64, pad {pad:?}:\n{report}", entry.name());
            let floats_in_f64 = report.outputs.iter().all(|o| !o.dtype.is_float() || o.dtype == DType::F64);
            assert!(floats_in_f64, "{}: {report}", entry.name());
        }
        ran += 1;
    }
    assert!(ran >= 25, "only {ran} ops ran in f64");
}

#[test]
fn every_op_documents_itself_and_wires_its_backward() {
    for entry in ops() {
        assert!(!entry.op.doc().is_empty(), "{}", entry.name());
        assert!(!entry.op.dtypes().is_empty(), "{}", entry.name());
        // Every backward is registered and named so that frontends can wire it.
        Registry::global().backward_of(&entry).unwrap_or_else(|e| panic!("{e}"));
    }
}

/// The shape a benchmark reports for an op's default example (`Op::example_shape`) rebuilds that
/// example: `uniop bench --shape` and the torch peer (which makes its inputs from the reported
/// shape) then time the same inputs as the default run.
#[test]
fn example_shape_rebuilds_the_default_example() {
    let shapes = |e: &uniop::Example| -> Vec<Option<(DType, Vec<usize>)>> {
        e.inputs.iter().map(|m| m.as_ref().map(|m| (m.dtype, m.shape().to_vec()))).collect()
    };
    for entry in ops() {
        let dtype = entry.op.dtypes()[0];
        let default = entry.op.example(None, dtype).unwrap();
        let shape = entry.op.example_shape(&default);
        let rebuilt = entry.op.example(Some(&shape), dtype).unwrap();
        assert_eq!(shapes(&rebuilt), shapes(&default), "{} from shape {shape:?}", entry.name());
    }
}
