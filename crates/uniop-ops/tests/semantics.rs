//! Op semantics that the generic registry tests cannot know (broadcasting patterns, integer
//! arithmetic, mixed-precision weights, multi-dim normalization, gradients against finite
//! differences) and the bad-input contract: each misuse returns its code and a message naming the
//! op, the argument, what was expected and what was given.

use uniop::half::bf16;
mod common;

use common::*;
use uniop::verify::{attr_refs, check_outputs, infer};
use uniop::{AttrValue, DType, ErrorCode, Executor, Registry, Stream, Tensor, TensorMeta, TensorMut, TensorRef};

#[test]
fn add_broadcasts_like_numpy() {
    setup();
    let a = rand_vec(6 * 5, 1);
    let ta = TensorRef::new(&a, &[6, 5]).unwrap();
    let row = rand_vec(5, 2);
    let col = rand_vec(6, 3);
    let scalar = [0.25f32];
    for (b, shape) in [(&row[..], &[5][..]), (&col[..], &[6, 1][..]), (&scalar[..], &[][..]), (&col[..], &[1, 6, 1])] {
        let tb = TensorRef::new(b, shape).unwrap();
        run_checked("add", &[Some(ta.clone()), Some(tb.clone())], &[("alpha", 2.0.into())]);
        // Broadcasting is symmetric.
        run_checked("add", &[Some(tb), Some(ta.clone())], &[]);
    }
}

/// Half types along runs long enough for whole steps (plus a ragged tail), with the other operand
/// one value per run (a column), one value in all, or a row: the repeated-value runs take the
/// one-input dense path with the value held fixed.
#[test]
fn half_binary_ops_broadcast_along_whole_steps() {
    setup();
    fn check<T: uniop::Element>(widen: impl Fn(f32) -> T) {
        let (rows, cols) = (3, 200);
        let a: Vec<T> = rand_vec(rows * cols, 11).into_iter().map(&widen).collect();
        let col: Vec<T> = rand_vec(rows, 12).into_iter().map(&widen).collect();
        let row: Vec<T> = rand_vec(cols, 13).into_iter().map(&widen).collect();
        let one = [widen(-1.75)];
        let ta = TensorRef::new(&a, &[rows, cols]).unwrap();
        for (b, shape) in [(&col[..], &[rows, 1][..]), (&one[..], &[][..]), (&row[..], &[cols][..])] {
            let tb = TensorRef::new(b, shape).unwrap();
            for op in ["add", "mul"] {
                run_checked(op, &[Some(ta.clone()), Some(tb.clone())], &[]);
                run_checked(op, &[Some(tb.clone()), Some(ta.clone())], &[]);
            }
        }
    }
    check(bf16::from_f32);
    check(uniop::half::f16::from_f32);
}

#[test]
fn integer_add_is_exact_and_wraps() {
    setup();
    let a = [1i32, -5, i32::MAX, 7];
    let b = [10i32, 3, 1, -2];
    let out = run_checked(
        "add",
        &[Some(TensorRef::new(&a, &[4]).unwrap()), Some(TensorRef::new(&b, &[4]).unwrap())],
        &[("alpha", AttrValue::Int(3))],
    );
    assert_eq!(out[0], vec![31.0, 4.0, (i32::MAX.wrapping_add(3)) as f64, 1.0]);
    let a64 = [1i64 << 40, 2];
    let b64 = [1i64, 1];
    let out = run_checked(
        "add",
        &[Some(TensorRef::new(&a64, &[2]).unwrap()), Some(TensorRef::new(&b64, &[1, 2]).unwrap())],
        &[],
    );
    assert_eq!(out[0], vec![(1i64 << 40) as f64 + 1.0, 3.0]);
    // alpha is a Scalar: an integer beyond f64's 53 bits stays exact for i64 tensors.
    let alpha = (1i64 << 53) + 1;
    let (mut y, zero, one) = ([0i64; 1], [0i64], [1i64]);
    Executor::by_name(
        "add",
        &[Some(TensorRef::new(&zero, &[1]).unwrap()), Some(TensorRef::new(&one, &[1]).unwrap())],
        &[("alpha", AttrValue::Int(alpha))],
        vec![TensorMut::new(&mut y, &[1]).unwrap()],
    )
    .unwrap()
    .run(&mut [], Stream::default_stream())
    .unwrap();
    assert_eq!(y[0], alpha);
}

#[test]
fn rms_norm_matches_hand_computed_values() {
    setup();
    let x = [3.0f32, 4.0];
    let w = [1.0f32, 2.0];
    let out = run_checked(
        "rms_norm",
        &[Some(TensorRef::new(&x, &[1, 2]).unwrap()), Some(TensorRef::new(&w, &[2]).unwrap())],
        &[("eps", 0.0.into())],
    );
    // mean(x²) = 12.5, rstd = 1/sqrt(12.5)
    let r = 1.0 / 12.5f64.sqrt();
    assert!((out[0][0] - 3.0 * r).abs() < 1e-6 && (out[0][1] - 8.0 * r).abs() < 1e-6);
    assert!((out[1][0] - r).abs() < 1e-6);
}

/// Phase 1 reuses plans across calls with the same signature: calls that differ only in an
/// attribute, in strides, in the offset or in the outputs' layout must still each get their own
/// plan, and a call that failed validation must fail again.
#[test]
fn cached_plans_never_leak_between_signatures() {
    setup();
    let x = [3.0f32, 4.0, 0.0, 0.0, 6.0, 8.0];
    let w = [1.0f32, 1.0];
    let rms = |eps: f64, x: TensorRef, out: TensorMut, rstd: TensorMut| {
        Executor::by_name(
            "rms_norm",
            &[Some(x), Some(TensorRef::new(&w, &[2]).unwrap())],
            &[("eps", eps.into())],
            vec![out, rstd],
        )
        .unwrap()
        .run(&mut [0u8; 4096], &Stream::default_stream().clone())
        .unwrap()
    };
    let check = |got: [f32; 2], row: [f64; 2], eps: f64| {
        let r = 1.0 / ((row[0] * row[0] + row[1] * row[1]) / 2.0 + eps).sqrt();
        let close = (0..2).all(|i| (got[i] as f64 - row[i] * r).abs() < 1e-6);
        assert!(close, "rms_norm of {row:?} with eps {eps}: got {got:?}");
    };
    for eps in [0.0, 0.5, 0.0, 2.0] {
        let (mut y, mut rstd) = ([0f32; 2], [0f32; 1]);
        rms(
            eps,
            TensorRef::new(&x[..2], &[1, 2]).unwrap(),
            TensorMut::new(&mut y, &[1, 2]).unwrap(),
            TensorMut::new(&mut rstd, &[1, 1]).unwrap(),
        );
        check(y, [3.0, 4.0], eps);
    }
    // Same shape, other offset, then other strides (a column pair read with stride 2 → staged).
    let (mut y, mut rstd) = ([0f32; 2], [0f32; 1]);
    rms(
        0.0,
        TensorRef::strided(&x, &[1, 2], &[2, 1], 4).unwrap(),
        TensorMut::new(&mut y, &[1, 2]).unwrap(),
        TensorMut::new(&mut rstd, &[1, 1]).unwrap(),
    );
    check(y, [6.0, 8.0], 0.0);
    rms(
        0.0,
        TensorRef::strided(&x, &[1, 2], &[2, 4], 0).unwrap(),
        TensorMut::new(&mut y, &[1, 2]).unwrap(),
        TensorMut::new(&mut rstd, &[1, 1]).unwrap(),
    );
    check(y, [3.0, 6.0], 0.0);
    // An output with other strides (written through a staged copy).
    let mut wide = [0f32; 4];
    rms(
        0.0,
        TensorRef::new(&x[..2], &[1, 2]).unwrap(),
        TensorMut::strided(&mut wide, &[1, 2], &[4, 2], 0).unwrap(),
        TensorMut::new(&mut rstd, &[1, 1]).unwrap(),
    );
    check([wide[0], wide[2]], [3.0, 4.0], 0.0);
    assert_eq!((wide[1], wide[3]), (0.0, 0.0));
    // A failing signature is never cached.
    for _ in 0..2 {
        let (mut y, mut rstd) = ([0f32; 2], [0f32; 1]);
        let e = plan_err(
            "rms_norm",
            &[Some(TensorRef::new(&x[..2], &[1, 2]).unwrap()), Some(TensorRef::new(&w, &[2]).unwrap())],
            &[("eps", (-1.0).into())],
            vec![TensorMut::new(&mut y, &[1, 2]).unwrap(), TensorMut::new(&mut rstd, &[1, 1]).unwrap()],
        );
        assert!(e.message().contains("eps"), "{e}");
    }
}

#[test]
fn rms_norm_accepts_f32_weight_with_bf16_input_and_multi_dim_weight() {
    setup();
    let x: Vec<bf16> = rand_vec(4 * 3 * 8, 4).into_iter().map(bf16::from_f32).collect();
    let w32 = rand_vec(8, 5);
    let tx = TensorRef::new(&x, &[4, 3, 8]).unwrap();
    run_checked("rms_norm", &[Some(tx.clone()), Some(TensorRef::new(&w32, &[8]).unwrap())], &[]);
    // Normalize over the last two dims: rstd has shape [4, 1, 1].
    let w2: Vec<bf16> = rand_vec(24, 6).into_iter().map(bf16::from_f32).collect();
    let inputs = [Some(tx), Some(TensorRef::new(&w2, &[3, 8]).unwrap())];
    let entry = Registry::global().get("rms_norm").unwrap();
    let metas = infer(&entry, &inputs, &[]).unwrap();
    assert_eq!(metas[1].shape(), &[4, 1, 1]);
    assert_eq!(metas[1].dtype, DType::F32);
    run_checked("rms_norm", &inputs, &[]);
}

/// rms_norm_backward against central finite differences of the f64 forward reference — an
/// independent check of the gradient formula, not of the kernel alone.
#[test]
fn rms_norm_backward_matches_finite_differences() {
    setup();
    let (rows, cols) = (3, 7);
    let x = rand_vec(rows * cols, 7);
    let w = rand_vec(cols, 8);
    let dy = rand_vec(rows * cols, 9);
    let eps = 1e-5;
    let forward = |x: &[f64], w: &[f64]| -> f64 {
        // loss = Σ y·dy
        let mut loss = 0.0;
        for r in 0..rows {
            let row = &x[r * cols..(r + 1) * cols];
            let rstd = 1.0 / (row.iter().map(|v| v * v).sum::<f64>() / cols as f64 + eps).sqrt();
            for c in 0..cols {
                loss += row[c] * rstd * w[c] * dy[r * cols + c] as f64;
            }
        }
        loss
    };
    let x64: Vec<f64> = x.iter().map(|&v| v as f64).collect();
    let w64: Vec<f64> = w.iter().map(|&v| v as f64).collect();
    let h = 1e-6;
    let num_dx: Vec<f64> = (0..x64.len())
        .map(|i| {
            let (mut p, mut m) = (x64.clone(), x64.clone());
            p[i] += h;
            m[i] -= h;
            (forward(&p, &w64) - forward(&m, &w64)) / (2.0 * h)
        })
        .collect();
    let num_dw: Vec<f64> = (0..cols)
        .map(|i| {
            let (mut p, mut m) = (w64.clone(), w64.clone());
            p[i] += h;
            m[i] -= h;
            (forward(&x64, &p) - forward(&x64, &m)) / (2.0 * h)
        })
        .collect();

    let tx = TensorRef::new(&x, &[rows, cols]).unwrap();
    let tw = TensorRef::new(&w, &[cols]).unwrap();
    let fwd = run_checked("rms_norm", &[Some(tx.clone()), Some(tw.clone())], &[("eps", eps.into())]);
    let rstd: Vec<f32> = fwd[1].iter().map(|&v| v as f32).collect();
    let grads = run_checked(
        "rms_norm_backward",
        &[
            Some(TensorRef::new(&dy, &[rows, cols]).unwrap()),
            Some(tx),
            Some(tw),
            Some(TensorRef::new(&rstd, &[rows, 1]).unwrap()),
        ],
        &[],
    );
    for (got, want) in grads[0].iter().zip(&num_dx).chain(grads[1].iter().zip(&num_dw)) {
        assert!((got - want).abs() < 1e-4 * (1.0 + want.abs()), "got {got}, finite difference {want}");
    }
}

#[test]
fn rms_norm_backward_is_deterministic() {
    setup();
    let (rows, cols) = (301, 515);
    let x = rand_vec(rows * cols, 1);
    let dy = rand_vec(rows * cols, 2);
    let w = rand_vec(cols, 3);
    let rstd = vec![0.7f32; rows];
    let inputs = [
        Some(TensorRef::new(&dy, &[rows, cols]).unwrap()),
        Some(TensorRef::new(&x, &[rows, cols]).unwrap()),
        Some(TensorRef::new(&w, &[cols]).unwrap()),
        Some(TensorRef::new(&rstd, &[rows, 1]).unwrap()),
    ];
    let a = run_checked("rms_norm_backward", &inputs, &[]);
    let b = run_checked("rms_norm_backward", &inputs, &[]);
    assert_eq!(a, b);
}

/// The norm backwards with dx (and add_rms_norm's dresidual) past the streaming threshold,
/// written with non-temporal stores, in f32 and bf16: long rows (a partial 64-lane step ends
/// each; few of them, so dweight's f32 sums stay short), the next row prefetched across row ends,
/// every output against the f64 references.
#[test]
fn norm_backwards_stream_a_big_dx() {
    fn run_all<T: uniop::Element>(rows: usize, cols: usize, widen: impl Fn(Vec<f32>) -> Vec<T>) {
        let [dy, x, dsum] = [161, 162, 163].map(|seed| widen(rand_vec(rows * cols, seed)));
        let w = widen(rand_vec(cols, 164));
        let [mean, rstd] = [165, 166].map(|seed| rand_vec(rows, seed));
        let [dy, x, dsum] = [&dy, &x, &dsum].map(|v| Some(TensorRef::new(v, &[rows, cols]).unwrap()));
        let [mean, rstd] = [&mean, &rstd].map(|v| Some(TensorRef::new(v, &[rows, 1]).unwrap()));
        let w = Some(TensorRef::new(&w, &[cols]).unwrap());
        run_checked("rms_norm_backward", &[dy.clone(), x.clone(), w.clone(), rstd.clone()], &[]);
        run_checked("add_rms_norm_backward", &[dy.clone(), dsum, x.clone(), w.clone(), rstd.clone()], &[]);
        run_checked("layer_norm_backward", &[dy, x, w, mean, rstd], &[]);
    }
    setup();
    let cols = 40_013;
    let rows = uniop_ops::streaming_threshold_bytes() / (2 * cols) + 1; // bf16 dx just past the threshold
    run_all(rows, cols, |v| v);
    run_all(rows, cols, |v| v.into_iter().map(bf16::from_f32).collect());
}

// ---------------------------------------------------------------- bad input

#[test]
fn bad_inputs_give_codes_and_messages() {
    setup();
    let x = [0f32; 8];
    let xi = [0i32; 8];
    let w3 = [0f32; 3];
    let w4 = [0f32; 4];
    let mut y = [0f32; 8];
    let mut r = [0f32; 2];
    let tx = || Some(TensorRef::new(&x, &[2, 4]).unwrap());
    let cases: Vec<(uniop::Error, ErrorCode, &str)> = vec![
        (
            plan_err("rms_norm", &[Some(TensorRef::new(&xi, &[2, 4]).unwrap()), tx()], &[], vec![]),
            ErrorCode::DType,
            "rms_norm: argument 'x': expected dtype in {float32, float16, bfloat16}, got int32",
        ),
        (
            plan_err("rms_norm", &[tx(), Some(TensorRef::new(&w3, &[3]).unwrap())], &[], vec![]),
            ErrorCode::Shape,
            "rms_norm: argument 'weight': expected a non-empty shape equal to trailing dims of x [2, 4], got [3]",
        ),
        (
            plan_err("rms_norm", &[tx(), Some(TensorRef::new(&w4, &[4]).unwrap())], &[("eps", (-1.0).into())], vec![]),
            ErrorCode::ParamInvalid,
            "rms_norm: argument 'eps': expected a finite value ≥ 0, got -1",
        ),
        (
            plan_err("rms_norm", &[tx(), None], &[], vec![]),
            ErrorCode::ParamNullptr,
            "rms_norm: argument 'weight': expected a tensor, got none",
        ),
        (
            plan_err("rms_norm", &[tx(), Some(TensorRef::new(&w4, &[4]).unwrap())], &[("epsilon", 1.0.into())], vec![]),
            ErrorCode::ParamInvalid,
            "rms_norm: unknown attribute 'epsilon' (attributes: eps)",
        ),
        (
            plan_err("rms_norm", &[tx(), Some(TensorRef::new(&w4, &[4]).unwrap())], &[("eps", "small".into())], vec![]),
            ErrorCode::ParamInvalid,
            "rms_norm: argument 'eps': expected a value of type float, got 'small'",
        ),
        (
            plan_err(
                "rms_norm",
                &[tx(), Some(TensorRef::new(&w4, &[4]).unwrap())],
                &[],
                vec![TensorMut::new(&mut y, &[4, 2]).unwrap(), TensorMut::new(&mut r, &[2, 1]).unwrap()],
            ),
            ErrorCode::Shape,
            "rms_norm: argument 'y': expected shape [2, 4], got shape [4, 2]",
        ),
        (
            plan_err("add", &[tx(), Some(TensorRef::new(&w3, &[3]).unwrap())], &[], vec![]),
            ErrorCode::Shape,
            "add: argument 'b': expected a shape broadcastable with a's [2, 4], got [3]",
        ),
        (
            plan_err("add", &[tx(), Some(TensorRef::new(&xi, &[2, 4]).unwrap())], &[], vec![]),
            ErrorCode::DType,
            "add: argument 'b': expected dtype float32 (same as 'a'), got int32",
        ),
        (
            plan_err(
                "add",
                &[Some(TensorRef::new(&xi, &[8]).unwrap()), Some(TensorRef::new(&xi, &[8]).unwrap())],
                &[("alpha", 0.5.into())],
                vec![],
            ),
            ErrorCode::ParamInvalid,
            "add: argument 'alpha': expected an integral value for int32 inputs, got 0.5",
        ),
        (plan_err("add", &[tx()], &[], vec![]), ErrorCode::ParamInvalid, "add: expected 2 tensor inputs, got 1"),
        (
            plan_err("rms_norm_bwd", &[], &[], vec![]),
            ErrorCode::ParamInvalid,
            "unknown op 'rms_norm_bwd' (did you mean: rms_norm)",
        ),
    ];
    for (err, code, message) in cases {
        assert_eq!(err.code(), code, "{err}");
        assert_eq!(err.message(), message);
    }
}

/// add's and mul's backwards refuse a `dout` that is not the shape the operands broadcast to, and
/// an operand of another dtype, naming the argument.
#[test]
fn broadcast_backwards_reject_mismatched_gradients() {
    setup();
    let (x, y) = ([0f32; 12], [0f64; 4]);
    let f32s = |shape: &[usize]| Some(TensorRef::new(&x[..shape.iter().product()], shape).unwrap());
    for op in ["add_backward", "mul_backward"] {
        let err = plan_err(op, &[f32s(&[3, 3]), f32s(&[3, 4]), f32s(&[4])], &[], vec![]);
        assert_eq!(err.code(), ErrorCode::Shape, "{err}");
        assert!(err.message().starts_with(&format!("{op}: argument 'dout': expected shape [3, 4]")), "{err}");
        let err = plan_err(op, &[f32s(&[3, 4]), f32s(&[3, 4]), Some(TensorRef::new(&y, &[4]).unwrap())], &[], vec![]);
        assert_eq!(err.code(), ErrorCode::DType, "{err}");
        assert!(err.message().starts_with(&format!("{op}: argument 'b': expected dtype float32")), "{err}");
    }
}

#[test]
fn backward_rejects_rstd_of_the_wrong_dtype() {
    setup();
    let x = [0f32; 8];
    let w = [0f32; 4];
    let rstd = [0f64; 2];
    let t = || Some(TensorRef::new(&x, &[2, 4]).unwrap());
    let err = plan_err(
        "rms_norm_backward",
        &[t(), t(), Some(TensorRef::new(&w, &[4]).unwrap()), Some(TensorRef::new(&rstd, &[2, 1]).unwrap())],
        &[],
        vec![],
    );
    assert_eq!(err.code(), ErrorCode::DType);
    assert_eq!(
        err.message(),
        "rms_norm_backward: argument 'rstd': expected dtype float32 (as rms_norm returns it), got float64"
    );
}

#[test]
fn size_overflow_is_a_shape_error() {
    setup();
    let e = Tensor::empty(DType::F32, &[1 << 40, 1 << 40]).unwrap_err();
    assert_eq!(e.code(), ErrorCode::Shape);
    // Countable elements whose bytes are not: refused when the description is made.
    let e = TensorMeta::contiguous(DType::F32, &[usize::MAX / 4, 2]).unwrap_err();
    assert_eq!(e.code(), ErrorCode::Shape);
}

/// Executors: workspace too small, single-use reuse, repeatable relaunch with rebinding.
#[test]
fn executor_lifecycle_rules() {
    setup();
    let (rows, cols) = (4, 16);
    let x: Vec<bf16> = rand_vec(rows * cols, 1).into_iter().map(bf16::from_f32).collect();
    let x2: Vec<bf16> = rand_vec(rows * cols, 2).into_iter().map(bf16::from_f32).collect();
    let w: Vec<bf16> = rand_vec(cols, 3).into_iter().map(bf16::from_f32).collect();
    let mut y = vec![bf16::ZERO; rows * cols];
    let mut rstd = vec![0f32; rows];
    let stream = Stream::default_stream();
    let inputs = [Some(TensorRef::new(&x, &[rows, cols]).unwrap()), Some(TensorRef::new(&w, &[cols]).unwrap())];
    {
        let outs = vec![TensorMut::new(&mut y, &[rows, cols]).unwrap(), TensorMut::new(&mut rstd, &[rows, 1]).unwrap()];
        let mut exec = Executor::by_name("rms_norm", &inputs, &[], outs).unwrap();
        let need = exec.workspace_size();
        assert!(need > 0, "bf16 rms_norm stages rows in f32 scratch");
        let mut small = vec![0u8; need - 1];
        let err = exec.run(&mut small, stream).unwrap_err();
        assert_eq!(err.code(), ErrorCode::WorkspaceTooSmall);
        assert_eq!(
            err.message(),
            format!("rms_norm: workspace of {} bytes is smaller than the {need} bytes phase 1 asked for", need - 1)
        );
        let mut ws = vec![0u8; need];
        exec.run(&mut ws, stream).unwrap();
        let err = exec.run(&mut ws, stream).unwrap_err();
        assert_eq!(err.code(), ErrorCode::ParamInvalid);
        assert!(err.message().contains("already launched and is single-use"), "{err}");
    }
    let first = y.clone();
    {
        let outs = vec![TensorMut::new(&mut y, &[rows, cols]).unwrap(), TensorMut::new(&mut rstd, &[rows, 1]).unwrap()];
        let mut exec = Executor::by_name("rms_norm", &inputs, &[], outs).unwrap();
        exec.set_repeatable();
        let mut ws = vec![0u8; exec.workspace_size()];
        exec.run(&mut ws, stream).unwrap();
        exec.run(&mut ws, stream).unwrap();
        exec.rebind_input(0, TensorRef::new(&x2, &[rows, cols]).unwrap()).unwrap();
        let err = exec.rebind_input(0, TensorRef::new(&x2, &[cols, rows]).unwrap()).unwrap_err();
        assert!(err.message().contains("rebinding input 0"), "{err}");
        exec.run(&mut ws, stream).unwrap();
    }
    assert_ne!(first, y, "rebinding changed the input");
    // The rebound result is the reference result for x2.
    let entry = Registry::global().get("rms_norm").unwrap();
    let inputs2 = [Some(TensorRef::new(&x2, &[rows, cols]).unwrap()), Some(TensorRef::new(&w, &[cols]).unwrap())];
    let outs = [TensorRef::new(&y, &[rows, cols]).unwrap(), TensorRef::new(&rstd, &[rows, 1]).unwrap()];
    assert!(check_outputs(&entry, &inputs2, &attr_refs(&[]), &outs).unwrap().pass());
}

/// A true result past a half type's range is inf once rounded, and the check accepts the kernel's
/// inf for it; a finite value written there (the type's largest, say) is still off the reference.
#[test]
fn check_holds_an_overflowing_result_to_the_infinity_the_dtype_stores() {
    setup();
    let f16 = uniop::half::f16::from_f32;
    let (a, b) = ([f16(300.0), f16(-300.0), f16(2.0)], [f16(300.0), f16(300.0), f16(3.0)]);
    let inputs = [Some(TensorRef::new(&a, &[3]).unwrap()), Some(TensorRef::new(&b, &[3]).unwrap())];
    let got = run_checked("mul", &inputs, &[]);
    assert_eq!(got[0], [f64::INFINITY, f64::NEG_INFINITY, 6.0]);
    let entry = Registry::global().get("mul").unwrap();
    for wrong in [[uniop::half::f16::MAX, f16(-65504.0), f16(6.0)], [f16(6.0), f16(6.0), f16(f32::INFINITY)]] {
        let outs = [TensorRef::new(&wrong, &[3]).unwrap()];
        let report = check_outputs(&entry, &inputs, &attr_refs(&[]), &outs).unwrap();
        assert!(!report.pass(), "{wrong:?} passed:\n{report}");
    }
}

/// The harness's check catches what a value check alone cannot: an element the kernel left
/// unwritten (returns start as NaN, not as whatever the allocator held) and a write outside the
/// view (into a padded row's tail).
#[test]
fn harness_check_fails_unwritten_elements_and_writes_outside_the_view() {
    setup();
    let entry = Registry::global().get("mul").unwrap();
    let (a, b) = (rand_vec(6, 1), rand_vec(6, 2));
    let inputs = vec![Some(Tensor::from_slice(&a, &[2, 3]).unwrap()), Some(Tensor::from_slice(&b, &[2, 3]).unwrap())];
    // Rows padded by two elements, after one leading element: storage [_, r0 r0 r0, _, _, r1 r1 r1].
    let padded =
        |m: &TensorMeta| TensorMeta { dtype: m.dtype, layout: uniop::Layout::strided(m.shape(), &[5, 1], 1).unwrap() };
    let mut h = uniop::verify::OpHarness::with_inputs(entry, inputs, Vec::new(), padded).unwrap();
    assert!(h.outputs[0].view().to_f64_vec().iter().all(|v| v.is_nan()), "a return starts as NaN");
    let stream = Stream::default_stream();
    h.run(stream).unwrap();
    assert!(h.check().unwrap().pass());
    // SAFETY (each poke below): no kernel runs on the output while the test writes it.
    let storage = |h: &uniop::verify::OpHarness| h.outputs[0].buffer().as_ptr();
    let poke = |h: &uniop::verify::OpHarness, byte: usize, f: fn(u8) -> u8| unsafe {
        *storage(h).add(byte) = f(*storage(h).add(byte))
    };
    // A byte of the gap after row 0 (storage element 4) changed.
    poke(&h, 4 * 4, |b| b ^ 1);
    let report = h.check().unwrap();
    assert_eq!(report.outputs[0].wrote_outside, Some(4), "{report}");
    assert!(!report.pass());
    // Rerun (the view is rewritten, the gap is not), then row 1's last element back to its start.
    poke(&h, 4 * 4, |b| b ^ 1);
    h.run(stream).unwrap();
    assert!(h.check().unwrap().pass());
    (8 * 4..9 * 4).for_each(|byte| poke(&h, byte, |_| 0xFF));
    assert!(!h.check().unwrap().pass());
}

/// A repeatable executor pointed at new memory of the planned layout (what frontends do on a plan
/// cache hit) reads and writes there; memory too short or misaligned for the layout is refused.
#[test]
fn executor_rebinds_memory_of_the_planned_layout() {
    setup();
    let (rows, cols) = (3, 8);
    let (x, x2, w) = (rand_vec(rows * cols, 4), rand_vec(rows * cols, 5), rand_vec(cols, 6));
    let (mut y, mut rstd) = (vec![0f32; rows * cols], vec![0f32; rows]);
    let (mut y2, mut rstd2) = (vec![0f32; rows * cols], vec![0f32; rows]);
    let stream = Stream::default_stream();
    {
        let inputs = [Some(TensorRef::new(&x, &[rows, cols]).unwrap()), Some(TensorRef::new(&w, &[cols]).unwrap())];
        let outs = vec![TensorMut::new(&mut y, &[rows, cols]).unwrap(), TensorMut::new(&mut rstd, &[rows, 1]).unwrap()];
        let mut exec = Executor::by_name("rms_norm", &inputs, &[], outs).unwrap();
        exec.set_repeatable();
        let mut ws = vec![0u8; exec.workspace_size()];
        exec.run(&mut ws, stream).unwrap();
        let bytes = 4 * rows * cols;
        // SAFETY (all): each pointer is valid for the bytes given while `exec` lives.
        unsafe {
            let err = exec.rebind_input_memory(0, x2.as_ptr().cast(), bytes - 4).unwrap_err();
            assert_eq!(err.code(), ErrorCode::Shape);
            assert!(
                err.message().starts_with("rms_norm: rebinding input 0: view [3, 8] of float32 needs 96 bytes"),
                "{err}"
            );
            let err = exec.rebind_input_memory(0, x2.as_ptr().cast::<u8>().add(1), bytes - 4).unwrap_err();
            assert!(err.message().contains("rebinding input 0"), "{err}");
            let err = exec.rebind_output_memory(0, y2.as_mut_ptr().cast::<u8>().add(2), bytes).unwrap_err();
            assert!(err.message().contains("is not aligned to 4 bytes"), "{err}");
            assert!(exec.rebind_input_memory(2, x2.as_ptr().cast(), bytes).is_err());
            assert!(exec.rebind_output_memory(2, y2.as_mut_ptr().cast(), bytes).is_err());
            exec.rebind_input_memory(0, x2.as_ptr().cast(), bytes).unwrap();
            exec.rebind_output_memory(0, y2.as_mut_ptr().cast(), bytes).unwrap();
            exec.rebind_output_memory(1, rstd2.as_mut_ptr().cast(), 4 * rows).unwrap();
        }
        exec.run(&mut ws, stream).unwrap();
    }
    let entry = Registry::global().get("rms_norm").unwrap();
    let check = |x: &[f32], y: &[f32], rstd: &[f32]| {
        let inputs = [Some(TensorRef::new(x, &[rows, cols]).unwrap()), Some(TensorRef::new(&w, &[cols]).unwrap())];
        let outs = [TensorRef::new(y, &[rows, cols]).unwrap(), TensorRef::new(rstd, &[rows, 1]).unwrap()];
        assert!(check_outputs(&entry, &inputs, &attr_refs(&[]), &outs).unwrap().pass());
    };
    check(&x, &y, &rstd);
    check(&x2, &y2, &rstd2);
}

/// An output may not share memory with an input or another output (dense tensors are compared,
/// as torch does for `out=`), nor have elements that share memory — checked when planning, and
/// at launch for memory rebound since.
#[test]
fn outputs_own_their_memory() {
    setup();
    let (rows, cols) = (4, 8);
    let mut buf = rand_vec(rows * cols + cols, 7);
    let (w, mut rstd) = (rand_vec(cols, 8), vec![0f32; rows]);
    let x_ptr = buf.as_mut_ptr();
    let bytes = 4 * rows * cols;
    // SAFETY (all): views of `buf`, alive while they are used; the point is that they overlap.
    let x =
        unsafe { TensorRef::from_raw(x_ptr.cast(), bytes, TensorMeta::contiguous(DType::F32, &[rows, cols]).unwrap()) }
            .unwrap();
    let inputs = [Some(x), Some(TensorRef::new(&w, &[cols]).unwrap())];
    let out_at = |at: usize| unsafe {
        TensorMut::from_raw(x_ptr.add(at).cast(), bytes, TensorMeta::contiguous(DType::F32, &[rows, cols]).unwrap())
            .unwrap()
    };
    let rstd_ptr = rstd.as_mut_ptr();
    let rstd_out = || unsafe {
        TensorMut::from_raw(rstd_ptr.cast(), 4 * rows, TensorMeta::contiguous(DType::F32, &[rows, 1]).unwrap()).unwrap()
    };
    // y over x itself, and over x shifted by one row: both share memory with x.
    for at in [0, cols] {
        let err = Executor::by_name("rms_norm", &inputs, &[], vec![out_at(at), rstd_out()]).err().unwrap();
        assert_eq!(err.code(), ErrorCode::ParamInvalid);
        assert_eq!(err.message(), "rms_norm: argument 'y': expected memory of its own, got memory shared with 'x'");
    }
    // A broadcast output: every row the same memory.
    let mut row = vec![0f32; cols];
    let broadcast = TensorMut::strided(&mut row, &[rows, cols], &[0, 1], 0).unwrap();
    let err = Executor::by_name("rms_norm", &inputs, &[], vec![broadcast, rstd_out()]).err().unwrap();
    assert_eq!(err.code(), ErrorCode::ParamInvalid);
    assert_eq!(
        err.message(),
        "rms_norm: argument 'y': expected a layout in which no two elements share memory, got shape [4, 8] with strides [0, 1]"
    );
    // Apart at planning, rebound over the input afterwards: the launch refuses.
    let mut y = vec![0f32; rows * cols];
    let outs = vec![TensorMut::new(&mut y, &[rows, cols]).unwrap(), rstd_out()];
    let mut exec = Executor::by_name("rms_norm", &inputs, &[], outs).unwrap();
    exec.set_repeatable();
    let mut ws = vec![0u8; exec.workspace_size()];
    exec.run(&mut ws, Stream::default_stream()).unwrap();
    unsafe { exec.rebind_output_memory(0, x_ptr.add(cols).cast(), bytes).unwrap() };
    let err = exec.run(&mut ws, Stream::default_stream()).unwrap_err();
    assert_eq!(err.message(), "rms_norm: argument 'y': expected memory of its own, got memory shared with 'x'");
}

// ---------------------------------------------------------------- gradients vs finite differences

/// The gated ops' activations, each as the name part of its ops (`silu_mul`, `linear_gelu_mul`)
/// and the attributes of one form: SiLU, GELU's erf form and its tanh form.
fn gatings() -> [(&'static str, Vec<(&'static str, AttrValue)>); 3] {
    let approximate = |form: &str| vec![("approximate", AttrValue::Str(form.into()))];
    [("silu", vec![]), ("gelu", approximate("none")), ("gelu", approximate("tanh"))]
}

#[test]
fn gated_mul_backward_matches_finite_differences() {
    setup();
    let shape = vec![3, 9];
    let (g, u, d) = (rand_vec(27, 21), rand_vec(27, 22), rand_vec(27, 23));
    let f64s = |v: &[f32]| v.iter().map(|&x| x as f64).collect::<Vec<_>>();
    let inputs = [(f64s(&g), shape.clone()), (f64s(&u), shape.clone())];
    for (act, attrs) in gatings() {
        let (forward, backward) = (format!("{act}_mul"), format!("{act}_mul_backward"));
        let grads = run_checked(
            &backward,
            &[
                Some(TensorRef::new(&d, &shape).unwrap()),
                Some(TensorRef::new(&g, &shape).unwrap()),
                Some(TensorRef::new(&u, &shape).unwrap()),
            ],
            &attrs,
        );
        assert_close(&grads[0], &finite_difference(&forward, &inputs, &attrs, &f64s(&d), 0), "dgate");
        assert_close(&grads[1], &finite_difference(&forward, &inputs, &attrs, &f64s(&d), 1), "dup");
    }
}

/// The one-tensor GLUs and their attributes beyond `dim`: `swiglu`, `geglu` gating the second
/// half (erf) and the first (tanh).
fn glus() -> [(&'static str, Vec<(&'static str, AttrValue)>); 3] {
    let geglu = |form: &str, left: bool| {
        vec![("approximate", AttrValue::Str(form.into())), ("activate_left", AttrValue::Bool(left))]
    };
    [("swiglu", vec![]), ("geglu", geglu("none", false)), ("geglu", geglu("tanh", true))]
}

#[test]
fn glus_split_along_any_dim_and_their_gradients_match_finite_differences() {
    setup();
    let shape = vec![2, 6, 3];
    let x = rand_vec(36, 31);
    let tx = TensorRef::new(&x, &shape).unwrap();
    for (op, extra) in glus() {
        // dim -3 (first, negative) and 1 (middle); the last dim has odd size 3 (an error, below).
        for (dim, expect) in [(-3i64, vec![1, 6, 3]), (1, vec![2, 3, 3])] {
            let entry = Registry::global().get(op).unwrap();
            let inputs = [Some(tx.clone())];
            let mut attrs = vec![("dim", AttrValue::Int(dim))];
            attrs.extend(extra.iter().cloned());
            let out_shape = infer(&entry, &inputs, &attrs).unwrap()[0].shape().to_vec();
            assert_eq!(out_shape, expect);
            run_checked(op, &inputs, &attrs);
            let n: usize = out_shape.iter().product();
            let d = rand_vec(n, 32);
            let dout = Some(TensorRef::new(&d, &out_shape).unwrap());
            let dx = run_checked(&format!("{op}_backward"), &[dout, Some(tx.clone())], &attrs);
            let x64: Vec<f64> = x.iter().map(|&v| v as f64).collect();
            let d64: Vec<f64> = d.iter().map(|&v| v as f64).collect();
            assert_close(&dx[0], &finite_difference(op, &[(x64, shape.clone())], &attrs, &d64, 0), op);
        }
        let mut attrs = vec![("dim", AttrValue::Int(-1))];
        attrs.extend(extra.iter().cloned());
        let err = plan_err(op, &[Some(tx.clone())], &attrs, vec![]);
        assert_eq!(err.code(), ErrorCode::Shape);
        assert_eq!(err.message(), format!("{op}: argument 'x': expected an even size along dim -1, got 3"));
        attrs[0].1 = AttrValue::Int(3);
        let err = plan_err(op, &[Some(tx.clone())], &attrs, vec![]);
        assert_eq!(err.code(), ErrorCode::ParamInvalid);
        assert_eq!(err.message(), format!("{op}: argument 'dim': expected a dim in [-3, 3) for x, got 3"));
    }
    let attrs = [("dim", AttrValue::Int(1)), ("approximate", AttrValue::Str("fast".into()))];
    let err = plan_err("geglu", &[Some(tx)], &attrs, vec![]);
    assert_eq!(err.code(), ErrorCode::ParamInvalid);
    assert_eq!(err.message(), "geglu: argument 'approximate': expected 'none' or 'tanh', got 'fast'");
}

/// Which half `geglu` gates, checked against `gelu_mul` on the halves (aclnn: the second unless
/// `activate_left`).
#[test]
fn geglu_gates_the_second_half_unless_activate_left() {
    setup();
    let (rows, half) = (3, 5);
    let x = rand_vec(rows * 2 * half, 33);
    let first: Vec<f32> = x.chunks(2 * half).flat_map(|row| row[..half].to_vec()).collect();
    let second: Vec<f32> = x.chunks(2 * half).flat_map(|row| row[half..].to_vec()).collect();
    let tx = TensorRef::new(&x, &[rows, 2 * half]).unwrap();
    let (ta, tb) = (TensorRef::new(&first, &[rows, half]).unwrap(), TensorRef::new(&second, &[rows, half]).unwrap());
    for (left, gate, up) in [(false, &tb, &ta), (true, &ta, &tb)] {
        let attrs = [("approximate", AttrValue::Str("tanh".into())), ("activate_left", AttrValue::Bool(left))];
        let geglu = run_checked("geglu", &[Some(tx.clone())], &attrs);
        let gelu_mul = run_checked("gelu_mul", &[Some(gate.clone()), Some(up.clone())], &attrs[..1]);
        assert_eq!(geglu[0], gelu_mul[0], "activate_left={left}");
    }
}

/// GPT-OSS's gate by hand first — a pair inside the limit, one clamped on both sides (whose
/// gradient is 0: the clamps cut it), one on the limit itself (gradient 0 too: torch 2.15's clamp
/// there) — then across wider values with a gradient matching finite differences, and its bad
/// attributes and shapes.
#[test]
fn clamped_swiglu_clamps_both_sides_of_interleaved_pairs() {
    setup();
    let sigmoid = |v: f64| 1.0 / (1.0 + (-v).exp());
    let x = [0.5f32, 0.25, 8.0, -9.0, 7.0, 7.0];
    let d = [1.0f32, 1.0, 1.0];
    let tx = TensorRef::new(&x, &[3, 2]).unwrap();
    let attrs = [("alpha", AttrValue::Float(1.702)), ("limit", AttrValue::Float(7.0))];
    let out = run_checked("clamped_swiglu", &[Some(tx.clone())], &attrs);
    let alpha = 1.702;
    let want = [1.25 * 0.5 * sigmoid(alpha * 0.5), -6.0 * 7.0 * sigmoid(alpha * 7.0), 8.0 * 7.0 * sigmoid(alpha * 7.0)];
    assert_close(&out[0], &want, "by hand");
    let td = TensorRef::new(&d, &[3, 1]).unwrap();
    let dx = run_checked("clamped_swiglu_backward", &[Some(td), Some(tx)], &attrs);
    assert_eq!((dx[0][2], dx[0][3]), (0.0, 0.0), "both members clamped");
    assert_eq!((dx[0][4], dx[0][5]), (0.0, 0.0), "both members on the limit");
    let s = sigmoid(alpha * 0.5);
    assert_close(&dx[0][..2], &[1.25 * s * (1.0 + alpha * 0.5 * (1.0 - s)), 0.5 * s], "inside the limit");
    // A NaN gate or up value stays NaN through the clamps (torch's clamp passes NaN), and the
    // other pair is untouched.
    let nan = [f32::NAN, 1.0, 1.0, f32::NAN, 0.5, 0.25];
    let out = run_unchecked("clamped_swiglu", &[Some(TensorRef::new(&nan, &[3, 2]).unwrap())], &attrs);
    assert!(out[0][0].is_nan() && out[0][1].is_nan(), "NaN through the clamps: {:?}", out[0]);
    assert_close(&out[0][2..], &want[..1], "beside a NaN");

    let shape = vec![2, 3, 10];
    let wide: Vec<f32> = rand_vec(60, 41).iter().map(|v| 12.0 * v).collect();
    let up = rand_vec(30, 42);
    let attrs = [("alpha", AttrValue::Float(1.5)), ("limit", AttrValue::Float(6.0))];
    let tx = TensorRef::new(&wide, &shape).unwrap();
    run_checked("clamped_swiglu", &[Some(tx.clone())], &attrs);
    let dx = run_checked(
        "clamped_swiglu_backward",
        &[Some(TensorRef::new(&up, &[2, 3, 5]).unwrap()), Some(tx.clone())],
        &attrs,
    );
    let f64s = |v: &[f32]| v.iter().map(|&x| x as f64).collect::<Vec<_>>();
    let fd = finite_difference("clamped_swiglu", &[(f64s(&wide), shape)], &attrs, &f64s(&up), 0);
    assert_close(&dx[0], &fd, "dx");
    assert!(dx[0].contains(&0.0), "some values past the limit");

    let odd = TensorRef::new(&x[..3], &[3]).unwrap();
    let err = plan_err("clamped_swiglu", &[Some(odd)], &attrs, vec![]);
    assert_eq!(err.code(), ErrorCode::Shape);
    assert_eq!(
        err.message(),
        "clamped_swiglu: argument 'x': expected an even last dim (gate and up interleaved), got 3"
    );
    for (arg, value, expected) in [
        ("limit", -1.0, "a number >= 0 (inf clamps nothing)"),
        ("limit", f64::NAN, "a number >= 0 (inf clamps nothing)"),
        ("alpha", f64::INFINITY, "a finite number"),
    ] {
        let attrs = [(arg, AttrValue::Float(value))];
        let err = plan_err("clamped_swiglu", &[Some(tx.clone())], &attrs, vec![]);
        assert_eq!(err.code(), ErrorCode::ParamInvalid);
        assert_eq!(err.message(), format!("clamped_swiglu: argument '{arg}': expected {expected}, got {value}"));
    }
    let short = TensorRef::new(&up[..6], &[2, 3]).unwrap();
    let err = plan_err("clamped_swiglu_backward", &[Some(short), Some(tx)], &[], vec![]);
    assert_eq!(err.code(), ErrorCode::Shape);
    assert_eq!(err.message(), "clamped_swiglu_backward: argument 'dout': expected shape [2, 3, 5], got shape [2, 3]");
}

/// Rows of gate and up halves (`half` each) as rows of interleaved pairs.
fn interleaved<T: Copy>(halves: &[T], half: usize) -> Vec<T> {
    halves.chunks_exact(2 * half).flat_map(|row| (0..half).flat_map(move |i| [row[i], row[half + i]])).collect()
}

/// Gate and up as the two halves of the last dim (`interleaved=False`, transformers' default
/// experts layout) with DeepSeek V4's constants (`alpha` 1, no shift: `silu(g') · u'`): by hand in
/// f64, equal to the interleaved layout of the same pairs, forward and backward, over rows longer
/// than a step (the stretches cross rows, and blocks split them mid-row at the wide shape), with
/// the backward matching finite differences; bad shift and odd halves rejected.
#[test]
fn clamped_swiglu_reads_gate_and_up_halves() {
    setup();
    let deepseek = |interleaved| {
        [
            ("alpha", AttrValue::Float(1.0)),
            ("limit", AttrValue::Float(6.0)),
            ("up_shift", AttrValue::Float(0.0)),
            ("interleaved", AttrValue::Bool(interleaved)),
        ]
    };
    let silu = |v: f64| v / (1.0 + (-v).exp());
    for (rows, half) in [(3, 70), (33, 1030)] {
        let halves: Vec<f32> = rand_vec(rows * 2 * half, 43).iter().map(|v| 12.0 * v).collect();
        let pairs = interleaved(&halves, half);
        let shape = [rows, 2 * half];
        let (th, tp) = (TensorRef::new(&halves, &shape).unwrap(), TensorRef::new(&pairs, &shape).unwrap());
        let out = run_checked("clamped_swiglu", &[Some(th.clone())], &deepseek(false));
        assert_eq!(out, run_checked("clamped_swiglu", &[Some(tp.clone())], &deepseek(true)), "{rows}x{half}");
        let by_hand: Vec<f64> =
            pairs.chunks_exact(2).map(|p| silu((p[0] as f64).min(6.0)) * (p[1] as f64).clamp(-6.0, 6.0)).collect();
        assert_close(&out[0], &by_hand, "silu(g') * u'");

        let d = rand_vec(rows * half, 44);
        let td = TensorRef::new(&d, &[rows, half]).unwrap();
        let dx = run_checked("clamped_swiglu_backward", &[Some(td.clone()), Some(th)], &deepseek(false));
        let dx_pairs = run_checked("clamped_swiglu_backward", &[Some(td), Some(tp)], &deepseek(true));
        assert_eq!(interleaved(&dx[0], half), dx_pairs[0], "{rows}x{half}");
        if rows == 3 {
            let f64s = |v: &[f32]| v.iter().map(|&x| x as f64).collect::<Vec<_>>();
            let fd =
                finite_difference("clamped_swiglu", &[(f64s(&halves), shape.to_vec())], &deepseek(false), &f64s(&d), 0);
            assert_close(&dx[0], &fd, "dx in halves");
        }
    }
    let x = [0.5f32; 6];
    let err = plan_err("clamped_swiglu", &[Some(TensorRef::new(&x[..3], &[3]).unwrap())], &deepseek(false), vec![]);
    assert_eq!(
        err.message(),
        "clamped_swiglu: argument 'x': expected an even last dim (a gate half and an up half), got 3"
    );
    let shifted = [("up_shift", AttrValue::Float(f64::NAN))];
    let err = plan_err("clamped_swiglu", &[Some(TensorRef::new(&x, &[3, 2]).unwrap())], &shifted, vec![]);
    assert_eq!(err.code(), ErrorCode::ParamInvalid);
    assert_eq!(err.message(), "clamped_swiglu: argument 'up_shift': expected a finite number, got NaN");
}

/// The limit on the activation (`limit_after_act`, Step 3.7's and Ling's `min(silu(g), limit) ·
/// clamp(u, ±limit)`) by hand: a large gate is not cut before its activation, whose bound then
/// stops the gate's gradient (0 there, and on the bound itself) but passes the up value's (the
/// bounded activation); a negative activation is not bounded below. Then over random halves with a
/// gradient matching finite differences, and the same pairs interleaved equal bit for bit.
#[test]
fn clamped_swiglu_limits_the_activation_after_it() {
    setup();
    let silu = |v: f64| v / (1.0 + (-v).exp());
    let step3 = |interleaved| {
        [
            ("alpha", AttrValue::Float(1.0)),
            ("limit", AttrValue::Float(4.0)),
            ("up_shift", AttrValue::Float(0.0)),
            ("interleaved", AttrValue::Bool(interleaved)),
            ("limit_after_act", AttrValue::Bool(true)),
        ]
    };
    // Gates 2 (silu 1.76, inside), 4.2 (silu 4.14: past the bound, though the gate itself is not
    // past the limit — the gate-clamped form would give silu(4) = 3.93) and -3; ups inside, past
    // -4, and 1.
    let x = [2.0f32, 4.2, -3.0, 0.5, -9.0, 1.0];
    let tx = TensorRef::new(&x, &[1, 6]).unwrap();
    let out = run_checked("clamped_swiglu", &[Some(tx.clone())], &step3(false));
    assert_close(&out[0], &[silu(2.0) * 0.5, 4.0 * -4.0, silu(-3.0)], "min(silu(g), limit) * u'");
    let gated = run_checked("clamped_swiglu", &[Some(tx.clone())], &step3(false)[..4]);
    assert_close(&gated[0][1..2], &[silu(4.0) * -4.0], "the limit on the gate instead");
    let d = [1.0f32; 3];
    let dx =
        run_checked("clamped_swiglu_backward", &[Some(TensorRef::new(&d, &[1, 3]).unwrap()), Some(tx)], &step3(false));
    let dsilu = |v: f64| {
        let s = 1.0 / (1.0 + (-v).exp());
        s * (1.0 + v * (1.0 - s))
    };
    let want = [0.5 * dsilu(2.0), 0.0, dsilu(-3.0), silu(2.0), 0.0, silu(-3.0)];
    assert_close(&dx[0], &want, "the gate's gradient stops at the bounded activation, the up's does not");
    // A gate whose activation lands on the bound gets 0, as torch 2.15's clamp: the bound set to
    // the kernel's own f32 activation of the gate (read with no limit and an up value of 1).
    let unbounded = [
        ("alpha", AttrValue::Float(1.0)),
        ("limit", AttrValue::Float(f64::INFINITY)),
        ("up_shift", AttrValue::Float(0.0)),
    ];
    let x = [4.1f32, 1.0];
    let tx = TensorRef::new(&x, &[1, 2]).unwrap();
    let act = run_unchecked("clamped_swiglu", &[Some(tx.clone())], &unbounded)[0][0];
    let mut on_bound = step3(true);
    on_bound[1].1 = AttrValue::Float(act);
    let dx = run_unchecked(
        "clamped_swiglu_backward",
        &[Some(TensorRef::new(&d[..1], &[1, 1]).unwrap()), Some(tx)],
        &on_bound,
    );
    assert_eq!(dx[0], [0.0, act], "activation on the bound: the gate's gradient 0, the up's the activation");

    let (rows, half) = (5, 37);
    let halves: Vec<f32> = rand_vec(rows * 2 * half, 45).iter().map(|v| 12.0 * v).collect();
    let pairs = interleaved(&halves, half);
    let shape = [rows, 2 * half];
    let (th, tp) = (TensorRef::new(&halves, &shape).unwrap(), TensorRef::new(&pairs, &shape).unwrap());
    let out = run_checked("clamped_swiglu", &[Some(th.clone())], &step3(false));
    assert_eq!(out, run_checked("clamped_swiglu", &[Some(tp)], &step3(true)));
    let d = rand_vec(rows * half, 46);
    let dx = run_checked(
        "clamped_swiglu_backward",
        &[Some(TensorRef::new(&d, &[rows, half]).unwrap()), Some(th)],
        &step3(false),
    );
    let f64s = |v: &[f32]| v.iter().map(|&x| x as f64).collect::<Vec<_>>();
    let fd = finite_difference("clamped_swiglu", &[(f64s(&halves), shape.to_vec())], &step3(false), &f64s(&d), 0);
    assert_close(&dx[0], &fd, "dx");
    assert!(dx[0][..half].contains(&0.0), "some activations past the bound");
}

/// Inkling 2's softcapped SwiGLU by hand in f64 — `4 tanh(g/4) · σ(g) · 25 tanh(u/25)`: a gate and an
/// up value inside the caps, a gate far past its cap (its factor bounded by 4, its sigmoid by 1),
/// an up value far past its own (bounded by 25), a negative gate — with the gradients of the
/// smooth caps by hand too. Then over random halves past both caps with a gradient matching finite
/// differences and the same pairs interleaved equal bit for bit; NaN passes through, and caps that
/// are not finite and positive, or an odd last dim, are refused.
#[test]
fn softcapped_swiglu_caps_the_gate_factor_and_the_up_value() {
    setup();
    let sigmoid = |v: f64| 1.0 / (1.0 + (-v).exp());
    let cap = |v: f64, c: f64| c * (v / c).tanh();
    // One row: gates 0.5, 60, -3; ups 2, 1000, -40.
    let x = [0.5f32, 60.0, -3.0, 2.0, 1000.0, -40.0];
    let tx = TensorRef::new(&x, &[1, 6]).unwrap();
    let out = run_checked("softcapped_swiglu", &[Some(tx.clone())], &[]);
    let by_hand = |g: f64, u: f64| cap(g, 4.0) * sigmoid(g) * cap(u, 25.0);
    let want = [by_hand(0.5, 2.0), by_hand(60.0, 1000.0), by_hand(-3.0, -40.0)];
    assert_close(&out[0], &want, "by hand");
    assert!((out[0][1] - 100.0).abs() < 1e-4, "both caps reached: {}", out[0][1]);
    let d = [1.0f32; 3];
    let dx = run_checked("softcapped_swiglu_backward", &[Some(TensorRef::new(&d, &[1, 3]).unwrap()), Some(tx)], &[]);
    let grads = |g: f64, u: f64| {
        let (tg, tu, s) = ((g / 4.0).tanh(), (u / 25.0).tanh(), sigmoid(g));
        (25.0 * tu * (s * (1.0 - tg * tg) + 4.0 * tg * s * (1.0 - s)), 4.0 * tg * s * (1.0 - tu * tu))
    };
    let ((g0, u0), (g1, u1), (g2, u2)) = (grads(0.5, 2.0), grads(60.0, 1000.0), grads(-3.0, -40.0));
    assert_close(&dx[0], &[g0, g1, g2, u0, u1, u2], "gradients by hand");
    assert_eq!((dx[0][1], dx[0][4]), (0.0, 0.0), "flat past both caps");

    let (rows, half) = (4, 37);
    let halves: Vec<f32> = rand_vec(rows * 2 * half, 47).iter().map(|v| 40.0 * v).collect();
    let shape = [rows, 2 * half];
    let th = TensorRef::new(&halves, &shape).unwrap();
    let pairs = interleaved(&halves, half);
    let tp = TensorRef::new(&pairs, &shape).unwrap();
    let (in_halves, in_pairs) = ([("interleaved", AttrValue::Bool(false))], [("interleaved", AttrValue::Bool(true))]);
    let out = run_checked("softcapped_swiglu", &[Some(th.clone())], &in_halves);
    assert_eq!(out, run_checked("softcapped_swiglu", &[Some(tp.clone())], &in_pairs));
    let d = rand_vec(rows * half, 48);
    let td = TensorRef::new(&d, &[rows, half]).unwrap();
    let dx = run_checked("softcapped_swiglu_backward", &[Some(td.clone()), Some(th)], &in_halves);
    let dx_pairs = run_checked("softcapped_swiglu_backward", &[Some(td), Some(tp)], &in_pairs);
    assert_eq!(interleaved(&dx[0], half), dx_pairs[0]);
    let f64s = |v: &[f32]| v.iter().map(|&x| x as f64).collect::<Vec<_>>();
    let fd = finite_difference("softcapped_swiglu", &[(f64s(&halves), shape.to_vec())], &in_halves, &f64s(&d), 0);
    assert_close(&dx[0], &fd, "dx");

    let nan = [f32::NAN, 1.0, 1.0, f32::NAN, 0.5, 2.0];
    let out = run_unchecked("softcapped_swiglu", &[Some(TensorRef::new(&nan, &[1, 6]).unwrap())], &in_pairs);
    assert!(out[0][0].is_nan() && out[0][1].is_nan(), "NaN through the caps: {:?}", out[0]);
    assert_close(&out[0][2..], &[by_hand(0.5, 2.0)], "beside a NaN");
    for (arg, value) in
        [("gate_softcap", 0.0), ("up_softcap", -1.0), ("gate_softcap", f64::INFINITY), ("up_softcap", f64::NAN)]
    {
        let err = plan_err(
            "softcapped_swiglu",
            &[Some(TensorRef::new(&x, &[1, 6]).unwrap())],
            &[(arg, AttrValue::Float(value))],
            vec![],
        );
        assert_eq!(err.code(), ErrorCode::ParamInvalid);
        assert_eq!(
            err.message(),
            format!("softcapped_swiglu: argument '{arg}': expected a finite number > 0, got {value}")
        );
    }
    let err = plan_err(
        "softcapped_swiglu_backward",
        &[Some(TensorRef::new(&d[..3], &[3]).unwrap()), Some(TensorRef::new(&x[..5], &[5]).unwrap())],
        &[],
        vec![],
    );
    assert_eq!(err.code(), ErrorCode::Shape);
    assert_eq!(
        err.message(),
        "softcapped_swiglu_backward: argument 'x': expected an even last dim (a gate half and an up half), got 5"
    );
}

#[test]
fn gated_mul_requires_matching_gate_and_up_and_a_gelu_form() {
    setup();
    let a = [0f32; 6];
    let b = [0f32; 3];
    let (ta, tb) = (TensorRef::new(&a, &[2, 3]).unwrap(), TensorRef::new(&b, &[3]).unwrap());
    for op in ["silu_mul", "gelu_mul"] {
        let err = plan_err(op, &[Some(ta.clone()), Some(tb.clone())], &[], vec![]);
        assert_eq!(err.code(), ErrorCode::Shape);
        assert_eq!(err.message(), format!("{op}: argument 'up': expected shape [2, 3], got shape [3]"));
    }
    let fast = [("approximate", AttrValue::Str("fast".into()))];
    for (op, inputs) in [
        ("gelu_mul", vec![Some(ta.clone()), Some(ta.clone())]),
        ("gelu_mul_backward", vec![Some(ta.clone()), Some(ta.clone()), Some(ta.clone())]),
        ("linear_gelu_mul", vec![Some(ta.clone()), Some(ta.clone()), Some(ta.clone())]),
    ] {
        let err = plan_err(op, &inputs, &fast, vec![]);
        assert_eq!(err.code(), ErrorCode::ParamInvalid);
        assert_eq!(err.message(), format!("{op}: argument 'approximate': expected 'none' or 'tanh', got 'fast'"));
    }
}

#[test]
fn softmax_family_along_every_dim_with_gradients_matching_finite_differences() {
    setup();
    let shape = vec![3, 5, 20];
    let n = 300;
    let x: Vec<f32> = rand_vec(n, 41).iter().map(|v| 4.0 * v).collect();
    let tx = TensorRef::new(&x, &shape).unwrap();
    let x64: Vec<f64> = x.iter().map(|&v| v as f64).collect();
    for op in ["softmax", "log_softmax"] {
        for dim in [0i64, 1, -1] {
            let attrs = [("dim", AttrValue::Int(dim))];
            let y = run_checked(op, &[Some(tx.clone())], &attrs).remove(0);
            if op == "softmax" {
                // Each slice along `dim` sums to one.
                let total: f64 = y.iter().sum();
                let slices = n / shape[dim.rem_euclid(3) as usize];
                assert!((total - slices as f64).abs() < 1e-3, "{op} dim {dim}: {total}");
            }
            let y32: Vec<f32> = y.iter().map(|&v| v as f32).collect();
            let dy = rand_vec(n, 42);
            let dx = run_checked(
                &format!("{op}_backward"),
                &[Some(TensorRef::new(&dy, &shape).unwrap()), Some(TensorRef::new(&y32, &shape).unwrap())],
                &attrs,
            );
            let dy64: Vec<f64> = dy.iter().map(|&v| v as f64).collect();
            let want = finite_difference(op, &[(x64.clone(), shape.clone())], &attrs, &dy64, 0);
            // y was rounded to f32 before the backward, so allow f32-level differences.
            for (g, w) in dx[0].iter().zip(&want) {
                assert!((g - w).abs() < 2e-4 * (1.0 + w.abs()), "{op} dim {dim}: got {g}, finite difference {w}");
            }
        }
    }
    let err = plan_err("softmax", &[Some(tx)], &[("dim", AttrValue::Int(-4))], vec![]);
    assert_eq!(err.message(), "softmax: argument 'dim': expected a dim in [-3, 3) for x, got -4");
}

#[test]
fn add_rms_norm_equals_add_then_rms_norm() {
    setup();
    let (rows, cols) = (6, 200);
    let x: Vec<bf16> = rand_vec(rows * cols, 51).into_iter().map(bf16::from_f32).collect();
    let r: Vec<bf16> = rand_vec(rows * cols, 52).into_iter().map(bf16::from_f32).collect();
    let w: Vec<bf16> = rand_vec(cols, 53).into_iter().map(bf16::from_f32).collect();
    let (tx, tr, tw) = (
        TensorRef::new(&x, &[rows, cols]).unwrap(),
        TensorRef::new(&r, &[rows, cols]).unwrap(),
        TensorRef::new(&w, &[cols]).unwrap(),
    );
    let fused = run_checked("add_rms_norm", &[Some(tx.clone()), Some(tr.clone()), Some(tw.clone())], &[]);
    let sum = run_checked("add", &[Some(tx.clone()), Some(tr.clone())], &[]).remove(0);
    assert_eq!(fused[2], sum, "the fused sum is the add op's output, bit for bit");
    let sum16: Vec<bf16> = sum.iter().map(|&v| bf16::from_f64(v)).collect();
    let unfused =
        run_checked("rms_norm", &[Some(TensorRef::new(&sum16, &[rows, cols]).unwrap()), Some(tw.clone())], &[]);
    for (a, b) in fused[0].iter().zip(&unfused[0]) {
        assert!((a - b).abs() <= 1e-2 * (1.0 + b.abs()), "y: fused {a}, unfused {b}");
    }
    for (a, b) in fused[1].iter().zip(&unfused[1]) {
        assert!((a - b).abs() <= 1e-5 * b.abs(), "rstd: fused {a}, unfused {b}");
    }
    let short = [bf16::ZERO; 200];
    let err =
        plan_err("add_rms_norm", &[Some(tx), Some(TensorRef::new(&short, &[1, cols]).unwrap()), Some(tw)], &[], vec![]);
    assert_eq!(err.code(), ErrorCode::Shape);
    assert_eq!(err.message(), "add_rms_norm: argument 'residual': expected shape [6, 200], got shape [1, 200]");
}

/// HF tables for positions 0..s: `cat(freqs, freqs)` (half) or `repeat_interleave` (interleave).
fn rope_tables(s: usize, r: usize, interleave: bool) -> (Vec<f32>, Vec<f32>) {
    let (mut cos, mut sin) = (Vec::new(), Vec::new());
    for p in 0..s {
        for k in 0..r {
            let j = if interleave { k / 2 } else { k % (r / 2) };
            let angle = p as f64 * 10000f64.powf(-2.0 * j as f64 / r as f64);
            cos.push(angle.cos() as f32);
            sin.push(angle.sin() as f32);
        }
    }
    (cos, sin)
}

#[test]
fn rope_matches_hf_rotate_half_on_bsnd_and_bnsd_layouts_and_inverts() {
    setup();
    let (b, s, n, d, r) = (2, 5, 3, 8, 6); // partial rotary: 6 of 8 dims
    let x = rand_vec(b * s * n * d, 61);
    let (cos, sin) = rope_tables(s, r, false);
    // [B, S, N, D] with tables [S, 1, R].
    let tx = TensorRef::new(&x, &[b, s, n, d]).unwrap();
    let (tc, ts) = (TensorRef::new(&cos, &[s, 1, r]).unwrap(), TensorRef::new(&sin, &[s, 1, r]).unwrap());
    let out = run_checked("rope", &[Some(tx.clone()), Some(tc.clone()), Some(ts.clone())], &[]).remove(0);
    // HF: x * cos + rotate_half(x) * sin on the first r dims, the rest unchanged.
    for bi in 0..b {
        for si in 0..s {
            for ni in 0..n {
                let base = ((bi * s + si) * n + ni) * d;
                for k in 0..d {
                    let want = if k < r {
                        let rot = if k < r / 2 { -x[base + k + r / 2] } else { x[base + k - r / 2] };
                        x[base + k] * cos[si * r + k] + rot * sin[si * r + k]
                    } else {
                        x[base + k]
                    };
                    assert!((out[base + k] - want as f64).abs() < 1e-5, "[{bi},{si},{ni},{k}]");
                }
            }
        }
    }
    // The same data viewed as [B, N, S, D] through strides, with [S, R] tables.
    let strided = TensorRef::strided(&x, &[b, n, s, d], &[s * n * d, d, n * d, 1], 0).unwrap();
    let (tc2, ts2) = (TensorRef::new(&cos, &[s, r]).unwrap(), TensorRef::new(&sin, &[s, r]).unwrap());
    let out2 = run_checked("rope", &[Some(strided), Some(tc2), Some(ts2)], &[]).remove(0);
    for bi in 0..b {
        for ni in 0..n {
            for si in 0..s {
                for k in 0..d {
                    let a = out2[((bi * n + ni) * s + si) * d + k];
                    let e = out[((bi * s + si) * n + ni) * d + k];
                    assert!((a - e).abs() < 1e-6);
                }
            }
        }
    }
    // rope_backward of rope is the identity for a true rotation table.
    let out32: Vec<f32> = out.iter().map(|&v| v as f32).collect();
    let back =
        run_checked("rope_backward", &[Some(TensorRef::new(&out32, &[b, s, n, d]).unwrap()), Some(tc), Some(ts)], &[])
            .remove(0);
    for (got, want) in back.iter().zip(&x) {
        assert!((got - *want as f64).abs() < 1e-5);
    }
}

/// The per-pair form of [`rope_tables`]: pair `i`'s angle at `i` (flash-attn's and GPT-OSS's
/// tables, `r / 2` wide).
fn rope_pair_tables(s: usize, r: usize) -> (Vec<f32>, Vec<f32>) {
    let (cos, sin) = rope_tables(s, r, false);
    let first_half = |t: Vec<f32>| t.chunks(r).flat_map(|row| row[..r / 2].to_vec()).collect();
    (first_half(cos), first_half(sin))
}

/// Rows step in the widest of 64, 32 and 16 lanes that divides the rotated span (a half in mode
/// 'half'), else in padded 64-lane steps: every width, both modes, tables per element and per pair,
/// full and partial rotary, against the f64 reference (forward and backward), in f32 and in bf16
/// (narrowed by the CPU's instruction where it has one, whole steps and padded ones alike).
#[test]
fn rope_steps_of_every_width_match_the_reference() {
    setup();
    fn check<T: uniop::Element>(narrow: impl Fn(f32) -> T) {
        // (head dim, rotated dims): spans of 64, 32, 16 (and 48), and 40 (no width divides it).
        for (d, r) in [(128, 128), (64, 64), (32, 32), (96, 96), (80, 80), (128, 64)] {
            for (mode, interleave, per_pair) in
                [("half", false, false), ("interleave", true, false), ("half", false, true), ("interleave", true, true)]
            {
                let (s, n) = (3, 2);
                let x: Vec<T> = rand_vec(s * n * d, 81 + d as u64).into_iter().map(&narrow).collect();
                let (cos, sin) = if per_pair { rope_pair_tables(s, r) } else { rope_tables(s, r, interleave) };
                let w = cos.len() / s;
                let [cos, sin]: [Vec<T>; 2] = [cos, sin].map(|t| t.into_iter().map(&narrow).collect());
                let tables = [TensorRef::new(&cos, &[s, 1, w]).unwrap(), TensorRef::new(&sin, &[s, 1, w]).unwrap()];
                let attrs = [("mode", AttrValue::from(mode)), ("per_pair", AttrValue::Bool(per_pair))];
                for op in ["rope", "rope_backward"] {
                    let x = TensorRef::new(&x, &[s, n, d]).unwrap();
                    run_checked(op, &[Some(x), Some(tables[0].clone()), Some(tables[1].clone())], &attrs);
                }
            }
        }
    }
    check(|v| v);
    check(bf16::from_f32);
}

/// Per-pair tables rotate as HF's full ones that repeat them (`cat(freqs, freqs)`,
/// `repeat_interleave`): the same outputs, forward and backward, in f32 and in bf16 (f32 tables and
/// tables of x's dtype), on a strided `[B, N, S, D]` view with partial rotary. The gradient through
/// per-pair tables matches finite differences of the forward.
#[test]
fn rope_per_pair_tables_rotate_as_the_full_ones() {
    setup();
    let (b, s, n, d, r) = (2, 5, 3, 40, 36);
    let x = rand_vec(b * s * n * d, 91);
    let (pair_cos, pair_sin) = rope_pair_tables(s, r);
    for (mode, interleave) in [("half", false), ("interleave", true)] {
        let (cos, sin) = rope_tables(s, r, interleave);
        let xb: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
        let to_bf16 = |t: &[f32]| t.iter().map(|&v| bf16::from_f32(v)).collect::<Vec<_>>();
        let [cb, sb, pcb, psb] = [&cos, &sin, &pair_cos, &pair_sin].map(|t| to_bf16(t));
        // [B, S, N, D] data viewed as [B, N, S, D]; tables [S, W].
        fn table<T: uniop::Element>(t: &[T], s: usize) -> Option<TensorRef<'_>> {
            Some(TensorRef::new(t, &[s, t.len() / s]).unwrap())
        }
        fn bnsd<T: uniop::Element>(x: &[T], [b, n, s, d]: [usize; 4]) -> Option<TensorRef<'_>> {
            Some(TensorRef::strided(x, &[b, n, s, d], &[s * n * d, d, n * d, 1], 0).unwrap())
        }
        let dims = [b, n, s, d];
        for op in ["rope", "rope_backward"] {
            let attrs = |per_pair| [("mode", AttrValue::from(mode)), ("per_pair", AttrValue::Bool(per_pair))];
            let want = run_checked(op, &[bnsd(&x, dims), table(&cos, s), table(&sin, s)], &attrs(false));
            let got = run_checked(op, &[bnsd(&x, dims), table(&pair_cos, s), table(&pair_sin, s)], &attrs(true));
            assert_eq!(got, want, "{op} {mode}");
            let want = run_checked(op, &[bnsd(&xb, dims), table(&cb, s), table(&sb, s)], &attrs(false));
            let got = run_checked(op, &[bnsd(&xb, dims), table(&pcb, s), table(&psb, s)], &attrs(true));
            assert_eq!(got, want, "{op} {mode} bf16");
            let want = run_checked(op, &[bnsd(&xb, dims), table(&cos, s), table(&sin, s)], &attrs(false));
            let got = run_checked(op, &[bnsd(&xb, dims), table(&pair_cos, s), table(&pair_sin, s)], &attrs(true));
            assert_eq!(got, want, "{op} {mode} bf16 with f32 tables");
        }
        let attrs = [("mode", AttrValue::from(mode)), ("per_pair", AttrValue::Bool(true))];
        let (x, dout) = (rand_vec(s * d, 92), rand_vec(s * d, 93));
        let dx = run_checked(
            "rope_backward",
            &[Some(TensorRef::new(&dout, &[s, d]).unwrap()), table(&pair_cos, s), table(&pair_sin, s)],
            &attrs,
        );
        let f64s = |v: &[f32]| v.iter().map(|&x| x as f64).collect::<Vec<_>>();
        let want = finite_difference(
            "rope",
            &[(f64s(&x), vec![s, d]), (f64s(&pair_cos), vec![s, r / 2]), (f64s(&pair_sin), vec![s, r / 2])],
            &attrs,
            &f64s(&dout),
            0,
        );
        assert_close(&dx[0], &want, "rope dx with per-pair tables");
    }
}

#[test]
fn rope_interleave_backward_matches_finite_differences() {
    setup();
    let (s, d) = (4, 6);
    let x = rand_vec(s * d, 71);
    let (cos, sin) = rope_tables(s, d, true);
    let attrs = [("mode", AttrValue::from("interleave"))];
    let (tc, ts) = (TensorRef::new(&cos, &[s, d]).unwrap(), TensorRef::new(&sin, &[s, d]).unwrap());
    let out =
        run_checked("rope", &[Some(TensorRef::new(&x, &[s, d]).unwrap()), Some(tc.clone()), Some(ts.clone())], &attrs)
            .remove(0);
    // GPT-J pairs (2i, 2i+1).
    assert!((out[0] - (x[0] * cos[0] - x[1] * sin[0]) as f64).abs() < 1e-6);
    let dout = rand_vec(s * d, 72);
    let dx = run_checked("rope_backward", &[Some(TensorRef::new(&dout, &[s, d]).unwrap()), Some(tc), Some(ts)], &attrs);
    let f64s = |v: &[f32]| v.iter().map(|&x| x as f64).collect::<Vec<_>>();
    let want = finite_difference(
        "rope",
        &[(f64s(&x), vec![s, d]), (f64s(&cos), vec![s, d]), (f64s(&sin), vec![s, d])],
        &attrs,
        &f64s(&dout),
        0,
    );
    assert_close(&dx[0], &want, "rope dx");
}

#[test]
fn rope_rejects_bad_tables_and_modes() {
    setup();
    let x = [0f32; 2 * 8 * 6];
    let tx = || Some(TensorRef::new(&x, &[2, 8, 6]).unwrap());
    let short = [0f32; 4 * 6];
    let odd = [0f32; 8 * 5];
    fn t<'a>(v: &'a [f32], shape: &[usize]) -> Option<TensorRef<'a>> {
        Some(TensorRef::new(v, shape).unwrap())
    }
    let cases = [
        (
            plan_err("rope", &[tx(), t(&short, &[4, 6]), t(&short, &[4, 6])], &[], vec![]),
            ErrorCode::Shape,
            "rope: argument 'cos': expected a shape that broadcasts to [2, 8, 6] (x with the tables' width last), got \
             [4, 6]",
        ),
        (
            // One value per pair: 6 pairs would rotate 12 dims of 6.
            plan_err("rope", &[tx(), t(&short, &[4, 6]), t(&short, &[4, 6])], &[("per_pair", true.into())], vec![]),
            ErrorCode::Shape,
            "rope: argument 'cos': expected one value per rotated pair (last dim) ≤ 3, half the head dim of x [2, 8, \
             6], got 6",
        ),
        (
            plan_err(
                "rope",
                &[tx(), t(&short[..12], &[4, 3]), t(&short[..12], &[4, 3])],
                &[("per_pair", true.into())],
                vec![],
            ),
            ErrorCode::Shape,
            "rope: argument 'cos': expected a shape that broadcasts to [2, 8, 3] (x with the tables' width last), got \
             [4, 3]",
        ),
        (
            plan_err("rope", &[tx(), t(&odd, &[8, 5]), t(&odd, &[8, 5])], &[], vec![]),
            ErrorCode::Shape,
            "rope: argument 'cos': expected an even rotary dim (last dim) ≤ 6, the head dim of x [2, 8, 6], got 5",
        ),
        (
            plan_err("rope", &[tx(), t(&short, &[4, 6]), t(&short, &[4, 6])], &[("mode", "neox".into())], vec![]),
            ErrorCode::ParamInvalid,
            "rope: argument 'mode': expected 'half' or 'interleave', got 'neox'",
        ),
    ];
    for (err, code, message) in cases {
        assert_eq!(err.code(), code, "{err}");
        assert_eq!(err.message(), message);
    }
}

#[test]
fn rope_cos_sin_builds_hf_tables() {
    setup();
    let positions: Vec<i64> = (0..6).collect();
    let tp = TensorRef::new(&positions, &[6]).unwrap();
    for (mode, interleave) in [("half", false), ("interleave", true)] {
        let attrs = [("dim", AttrValue::Int(8)), ("mode", AttrValue::from(mode))];
        let tables = run_checked("rope_cos_sin", &[Some(tp.clone()), None], &attrs);
        let (cos, sin) = rope_tables(6, 8, interleave);
        for (got, want) in tables[0].iter().zip(&cos).chain(tables[1].iter().zip(&sin)) {
            assert!((got - *want as f64).abs() < 1e-6, "{mode}: {got} vs {want}");
        }
    }
    // One column per frequency, either mode: rope's per-pair tables; scaled (YaRN's attention
    // factor) in f32 before rounding.
    for (mode, scale) in [("half", 1.0), ("interleave", 1.0), ("half", 1.3466)] {
        let attrs = [
            ("dim", AttrValue::Int(8)),
            ("mode", AttrValue::from(mode)),
            ("per_pair", AttrValue::Bool(true)),
            ("scale", AttrValue::Float(scale)),
        ];
        let tables = run_checked("rope_cos_sin", &[Some(tp.clone()), None], &attrs);
        let (cos, sin) = rope_pair_tables(6, 8);
        assert_eq!((tables[0].len(), tables[1].len()), (6 * 4, 6 * 4));
        for (got, want) in tables[0].iter().zip(&cos).chain(tables[1].iter().zip(&sin)) {
            let want = (*want * scale as f32) as f64;
            assert!((got - want).abs() < 2e-6, "{mode} per pair, scale {scale}: {got} vs {want}");
        }
    }
    let err = plan_err(
        "rope_cos_sin",
        &[Some(tp.clone()), None],
        &[("dim", AttrValue::Int(8)), ("scale", AttrValue::Float(f64::NAN))],
        vec![],
    );
    assert_eq!(err.message(), "rope_cos_sin: argument 'scale': expected a finite float32 factor, got NaN");
    let entry = Registry::global().get("rope_cos_sin").unwrap();
    let bf = infer(
        &entry,
        &[Some(tp.clone()), None],
        &[("dim", AttrValue::Int(4)), ("dtype", AttrValue::DType(DType::BF16))],
    )
    .unwrap();
    assert_eq!((bf[0].dtype, bf[0].shape()), (DType::BF16, &[6usize, 4][..]));
    let err = plan_err("rope_cos_sin", &[Some(tp.clone()), None], &[("dim", AttrValue::Int(7))], vec![]);
    assert_eq!(err.message(), "rope_cos_sin: argument 'dim': expected a positive even rotary dim, got 7");
    // A dim whose tables no memory holds is an error, not a panic (its frequency table was built
    // before the output's size was checked, and overflowed the allocator's capacity).
    let err = plan_err("rope_cos_sin", &[Some(tp.clone()), None], &[("dim", AttrValue::Int(1 << 62))], vec![]);
    assert_eq!(
        err.message(),
        "rope_cos_sin: argument 'dim': expected a rotary dim for which the tables [6, dim] have a size, got \
         4611686018427387904"
    );
    assert_eq!(err.code(), ErrorCode::Shape);
    let fpos = [0f32; 3];
    let err = plan_err(
        "rope_cos_sin",
        &[Some(TensorRef::new(&fpos, &[3]).unwrap()), None],
        &[("dim", AttrValue::Int(4))],
        vec![],
    );
    assert_eq!(err.code(), ErrorCode::DType);
}

/// A given `inv_freq` replaces theta's table: HF's scaled ropes pass their own frequencies (here
/// a quarter of the default's, as linear scaling by 4 makes them), dense or strided, and the
/// angles are `f32(position) · inv_freq[j]` exactly. A table of the wrong dtype or length is an
/// error naming `inv_freq`.
#[test]
fn rope_cos_sin_takes_a_models_own_frequencies() {
    setup();
    let positions: Vec<i64> = vec![0, 1, 9, 4000, 131_071];
    let tp = TensorRef::new(&positions, &[positions.len()]).unwrap();
    let dim = 40usize;
    let freqs: Vec<f32> = (0..dim / 2).map(|j| 0.25 / 10_000f32.powf(2.0 * j as f32 / dim as f32)).collect();
    let spread: Vec<f32> = freqs.iter().flat_map(|&f| [f, f32::NAN]).collect();
    let dense = TensorRef::new(&freqs, &[dim / 2]).unwrap();
    let strided = TensorRef::strided(&spread, &[dim / 2], &[2], 0).unwrap();
    for (given, mode) in [(dense.clone(), "half"), (strided, "interleave")] {
        let attrs = [("dim", AttrValue::Int(dim as i64)), ("mode", AttrValue::from(mode))];
        let tables = run_checked("rope_cos_sin", &[Some(tp.clone()), Some(given)], &attrs);
        for (r, &p) in positions.iter().enumerate() {
            for k in 0..dim {
                let j = if mode == "half" { k % (dim / 2) } else { k / 2 };
                let angle = (p as f32 * freqs[j]) as f64;
                let (cos, sin) = (tables[0][r * dim + k], tables[1][r * dim + k]);
                assert!((cos - angle.cos()).abs() < 1e-7 && (sin - angle.sin()).abs() < 1e-7, "{mode} {p} {k}");
            }
        }
    }
    let attrs = [("dim", AttrValue::Int(dim as i64))];
    let short = TensorRef::new(&freqs[..4], &[4]).unwrap();
    let err = plan_err("rope_cos_sin", &[Some(tp.clone()), Some(short)], &attrs, vec![]);
    assert_eq!(err.message(), "rope_cos_sin: argument 'inv_freq': expected shape [20], got shape [4]");
    let halves: Vec<uniop::half::f16> = freqs.iter().map(|&f| uniop::half::f16::from_f32(f)).collect();
    let err = plan_err("rope_cos_sin", &[Some(tp), Some(TensorRef::new(&halves, &[dim / 2]).unwrap())], &attrs, vec![]);
    assert_eq!(err.message(), "rope_cos_sin: argument 'inv_freq': expected dtype in {float32}, got float16");
}

/// rope_cos_sin's own sin/cos (a reduction by π/2 and polynomials, not libm) against libm on HF's
/// f32 angles, rounded to f32: within one f32 ulp at positions up to ten million (past 1.5M at
/// inv_freq 1 the kernel hands the row to std's sin/cos), negative positions, two thetas, both
/// layouts, and a dim that is not a multiple of the kernel's 16 lanes.
#[test]
fn rope_cos_sin_matches_libm_at_long_positions() {
    setup();
    let positions: Vec<i64> =
        vec![0, 1, 7, 1000, 4095, 65_537, 131_071, 500_000, 1_000_000, 1_499_999, 3_000_000, 10_000_000, -5, -123_456];
    let tp = TensorRef::new(&positions, &[positions.len()]).unwrap();
    let ulp = |v: f32| f32::from_bits(v.abs().to_bits() + 1) - v.abs();
    for (dim, theta) in [(128usize, 10_000.0), (128, 500_000.0), (72, 10_000.0)] {
        for mode in ["half", "interleave"] {
            let attrs = [
                ("dim", AttrValue::Int(dim as i64)),
                ("theta", AttrValue::Float(theta)),
                ("mode", AttrValue::from(mode)),
            ];
            let tables = run_checked("rope_cos_sin", &[Some(tp.clone()), None], &attrs);
            for (r, &p) in positions.iter().enumerate() {
                for k in 0..dim {
                    let j = if mode == "half" { k % (dim / 2) } else { k / 2 };
                    let inv_freq = (1.0 / theta.powf(2.0 * j as f64 / dim as f64)) as f32;
                    let angle = (p as f32 * inv_freq) as f64;
                    for (got, want) in [(tables[0][r * dim + k], angle.cos()), (tables[1][r * dim + k], angle.sin())] {
                        let (got, want) = (got as f32, want as f32);
                        assert!(
                            (got - want).abs() <= ulp(want),
                            "{mode}, theta {theta}, position {p}, column {k}: {got} vs {want}"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn embedding_gathers_rows_and_its_backward_scatters_with_padding() {
    setup();
    let (v, h) = (4, 3);
    let w = rand_vec(v * h, 81);
    let idx = [2i64, 0, 2, 3, 1, 2];
    let tw = TensorRef::new(&w, &[v, h]).unwrap();
    let ti = TensorRef::new(&idx, &[2, 3]).unwrap();
    let out = run_checked("embedding", &[Some(tw.clone()), Some(ti.clone())], &[]).remove(0);
    assert_eq!(out.len(), 6 * h);
    assert_eq!(out[3 * h..4 * h], w[3 * h..4 * h].iter().map(|&x| x as f64).collect::<Vec<_>>()[..]);

    let dout = rand_vec(6 * h, 82);
    let attrs = [("padding_idx", AttrValue::Int(2))];
    let dw = run_checked(
        "embedding_backward",
        &[Some(TensorRef::new(&dout, &[2, 3, h]).unwrap()), Some(ti.clone()), Some(tw.clone())],
        &attrs,
    )
    .remove(0);
    assert!(dw[2 * h..3 * h].iter().all(|&g| g == 0.0), "padding row gets no gradient");
    for k in 0..h {
        // Row 0 is used once (position 1), row 3 once (position 3).
        assert_eq!(dw[k], dout[h + k] as f64);
        assert_eq!(dw[3 * h + k], dout[3 * h + k] as f64);
    }

    // An out-of-range index fails the launch with a clear runtime error instead of reading past
    // the table.
    let bad = [1i64, 0, 7];
    let inputs = [Some(tw), Some(TensorRef::new(&bad, &[3]).unwrap())];
    let mut y = vec![0f32; 3 * h];
    let err = uniop::call("embedding", &inputs, &[], vec![TensorMut::new(&mut y, &[3, h]).unwrap()]).unwrap_err();
    assert_eq!(err.code(), ErrorCode::Runtime);
    assert!(
        err.message().starts_with("embedding: argument 'indices': expected values in [0, 4), got 7 at position 2"),
        "{err}"
    );
}

/// Both operands broadcast (a over b's batch dim, b over a's), and b read transposed: the
/// gradients sum over the batches each operand served, matching finite differences of matmul.
#[test]
fn matmul_backward_sums_over_broadcast_batches() {
    setup();
    let (a_shape, b_shape, out_shape) = (vec![2, 1, 3, 4], vec![3, 4, 5], vec![2, 3, 3, 5]);
    let (a, d) = (rand_vec(24, 81), rand_vec(90, 83));
    // b stored as [3, 5, 4] and viewed transposed.
    let b_t = rand_vec(60, 82);
    let b_view = TensorRef::strided(&b_t, &b_shape, &[20, 1, 4], 0).unwrap();
    let f64s = |v: &[f32]| v.iter().map(|&x| x as f64).collect::<Vec<_>>();
    let inputs = [(f64s(&a), a_shape.clone()), (b_view.to_f64_vec(), b_shape.clone())];
    let grads = run_checked(
        "matmul_backward",
        &[Some(TensorRef::new(&d, &out_shape).unwrap()), Some(TensorRef::new(&a, &a_shape).unwrap()), Some(b_view)],
        &[],
    );
    assert_close(&grads[0], &finite_difference("matmul", &inputs, &[], &f64s(&d), 0), "da");
    assert_close(&grads[1], &finite_difference("matmul", &inputs, &[], &f64s(&d), 1), "db");
}

/// The backwards of the products (matmul, linear plain, with a residual and gated) leave out the
/// gradients a call does not ask for (`needs_d<arg>`): those come back empty, the others equal the
/// full call's, per sample too.
#[test]
fn product_backwards_leave_out_gradients_not_asked_for() {
    setup();
    let (dy, x, w, w2) = (rand_vec(2 * 3 * 5, 91), rand_vec(2 * 3 * 4, 92), rand_vec(5 * 4, 93), rand_vec(5 * 4, 94));
    let (dy, x, w, w2) = (
        TensorRef::new(&dy, &[2, 3, 5]).unwrap(),
        TensorRef::new(&x, &[2, 3, 4]).unwrap(),
        TensorRef::new(&w, &[5, 4]).unwrap(),
        TensorRef::new(&w2, &[5, 4]).unwrap(),
    );
    let plain = [Some(dy.clone()), Some(x.clone()), Some(w.clone())];
    let gated = [Some(dy.clone()), Some(x.clone()), Some(w), Some(w2)];
    let b = rand_vec(4 * 5, 95);
    let product = [Some(dy), Some(x), Some(TensorRef::new(&b, &[4, 5]).unwrap())];
    let (two, three) = (["needs_dx", "needs_dweight"], ["needs_dx", "needs_dgate_weight", "needs_dup_weight"]);
    let (per_sample, whole) = ([Some(0), Some(1)], [None]);
    let cases = [
        ("matmul_backward", &product[..], &["needs_da", "needs_db"][..], &whole[..]),
        ("linear_backward", &plain[..], &two[..], &per_sample[..]),
        ("linear_add_backward", &plain[..], &two[..], &per_sample[..]),
        ("linear_silu_mul_backward", &gated[..], &three[..], &per_sample[..]),
        ("linear_gelu_mul_backward", &gated[..], &three[..], &per_sample[..]),
    ];
    for (op, inputs, flags, batch_dims) in cases {
        for &batch_dims in batch_dims {
            let call = |asked: u32| {
                let mut attrs: Vec<_> = batch_dims.map(|b| ("batch_dims", AttrValue::Int(b))).into_iter().collect();
                attrs.extend(flags.iter().enumerate().map(|(i, &f)| (f, AttrValue::Bool(asked >> i & 1 == 1))));
                run_checked(op, inputs, &attrs)
            };
            let all = (1 << flags.len()) - 1;
            let full = call(all);
            for asked in 0..all {
                let lean = call(asked);
                for (k, got) in lean.iter().enumerate() {
                    let want: &[f64] = if k >= flags.len() || asked >> k & 1 == 1 { &full[k] } else { &[] };
                    assert_eq!(got, want, "{op} batch_dims={batch_dims:?} asked {asked:b}: return {k}");
                }
            }
        }
    }
}

/// add's and mul's gradients sum over the dims each operand was broadcast along, in every pattern
/// the kernel walks differently — a weight over rows (summed across rows), a per-row scale (summed
/// along rows), a middle dim, a missing leading dim, both operands broadcast, a strided `dout` —
/// and match finite differences of the forward; a gradient not asked for comes back empty.
#[test]
fn add_and_mul_gradients_sum_over_broadcast_dims() {
    setup();
    let f64s = |v: &[f32]| v.iter().map(|&x| x as f64).collect::<Vec<_>>();
    let patterns: [(&[usize], &[usize]); 7] = [
        (&[2, 3, 70], &[70]),
        (&[2, 3, 70], &[2, 3, 1]),
        (&[2, 3, 70], &[2, 1, 70]),
        (&[3, 1], &[1, 70]),
        (&[1], &[4, 5]),
        (&[2, 3, 70], &[2, 3, 70]),
        (&[0, 5], &[5]),
    ];
    for (seed, (a_shape, b_shape)) in patterns.into_iter().enumerate() {
        let out_shape = uniop::broadcast_shapes(a_shape, b_shape).unwrap();
        let numel = |s: &[usize]| s.iter().product::<usize>();
        let seed = 10 * seed as u64;
        let (a, b) = (rand_vec(numel(a_shape), seed), rand_vec(numel(b_shape), seed + 1));
        // dout read through a view that skips every other element of its last dim.
        let mut dout_strides = vec![0; out_shape.len()];
        let mut stride = 2;
        for d in (0..out_shape.len()).rev() {
            dout_strides[d] = stride;
            stride *= out_shape[d];
        }
        let dout_store = rand_vec(2 * numel(&out_shape), seed + 2);
        let dout = TensorRef::strided(&dout_store, &out_shape, &dout_strides, 0).unwrap();
        let (inputs, dout_values) = ([(f64s(&a), a_shape.to_vec()), (f64s(&b), b_shape.to_vec())], dout.to_f64_vec());
        let views =
            [Some(dout), Some(TensorRef::new(&a, a_shape).unwrap()), Some(TensorRef::new(&b, b_shape).unwrap())];
        let what = format!("a {a_shape:?}, b {b_shape:?}");
        for (op, attrs) in [("add", vec![("alpha", AttrValue::Float(-0.5))]), ("mul", vec![])] {
            let grads = run_checked(&format!("{op}_backward"), &views, &attrs);
            for (wrt, grad) in grads.iter().enumerate() {
                let fd = finite_difference(op, &inputs, &attrs, &dout_values, wrt);
                assert_close(grad, &fd, &format!("{op}_backward d{} for {what}", ["a", "b"][wrt]));
            }
            let only_db = [attrs.clone(), vec![("needs_da", AttrValue::Bool(false))]].concat();
            let grads = run_checked(&format!("{op}_backward"), &views, &only_db);
            assert!(grads[0].is_empty(), "{op}_backward: da not asked for, {what}");
            assert_eq!(grads[1].len(), numel(b_shape), "{op}_backward: db, {what}");
        }
    }
    // Large enough for several blocks: a bias's gradient summed by row-splitting blocks into
    // partials, then added up (rows of whole 64-element steps and a ragged end, the full
    // operand's gradient narrowed as it is written); a per-row scale's, blocks splitting its
    // elements; and a bias too long for partials, summed across rows in strips. In every float dtype.
    fn check<T: uniop::Element>(narrow: fn(f32) -> T) {
        for (a_shape, b_shape) in [([40, 300], [1, 300]), ([40, 300], [40, 1]), ([3, 20000], [1, 20000])] {
            let numel = a_shape.iter().product();
            let values = |n: usize, seed| rand_vec(n, seed).into_iter().map(narrow).collect::<Vec<T>>();
            let (a, b, dout) = (values(numel, 91), values(b_shape.iter().product(), 92), values(numel, 93));
            let views: Vec<_> = [(&dout, &a_shape), (&a, &a_shape), (&b, &b_shape)]
                .map(|(v, s)| Some(TensorRef::new(v, s).unwrap()))
                .into();
            for op in ["add_backward", "mul_backward"] {
                run_checked(op, &views, &[]);
            }
        }
    }
    check(|x| x);
    check(bf16::from_f32);
    check(uniop::half::f16::from_f32);
}

#[test]
fn matmul_broadcasts_batches_and_takes_transposed_operands() {
    setup();
    let (m, k, n) = (5, 7, 3);
    let a = rand_vec(2 * m * k, 91);
    let b = rand_vec(k * n, 92);
    // b stored as [N, K] and viewed transposed: strides (1, K).
    let bt: Vec<f32> = (0..n * k).map(|i| b[(i % k) * n + i / k]).collect();
    let ta = TensorRef::new(&a, &[2, 1, m, k]).unwrap();
    let b3: Vec<f32> = b.iter().copied().cycle().take(3 * k * n).collect();
    let bt3: Vec<f32> = bt.iter().copied().cycle().take(3 * n * k).collect();
    // Batch dims [2, 1] x [3] broadcast to [2, 3].
    let r1 = run_checked("matmul", &[Some(ta.clone()), Some(TensorRef::new(&b3, &[3, k, n]).unwrap())], &[]).remove(0);
    assert_eq!(r1.len(), 2 * 3 * m * n);
    let r2 = run_checked(
        "matmul",
        &[Some(ta.clone()), Some(TensorRef::strided(&bt3, &[3, k, n], &[n * k, 1, k], 0).unwrap())],
        &[],
    )
    .remove(0);
    let r3 = run_checked("matmul", &[Some(ta), Some(TensorRef::new(&b, &[k, n]).unwrap())], &[]).remove(0);
    for i in 0..2 {
        for j in 0..3 {
            for e in 0..m * n {
                let x = r1[(i * 3 + j) * m * n + e];
                assert!((x - r2[(i * 3 + j) * m * n + e]).abs() < 1e-5 && (x - r3[i * m * n + e]).abs() < 1e-5);
            }
        }
    }
    let err = plan_err(
        "matmul",
        &[Some(TensorRef::new(&a, &[2, m, k]).unwrap()), Some(TensorRef::new(&b[..n * (k - 1)], &[k - 1, n]).unwrap())],
        &[],
        vec![],
    );
    assert_eq!(err.code(), ErrorCode::Shape);
    assert_eq!(
        err.message(),
        "matmul: argument 'b': expected 7 rows (a is [2, 5, 7], so b must be [..., 7, N]), got shape [6, 3]"
    );
    let ints: Vec<i32> = (0..2 * m * k).map(|i| i as i32).collect();
    let err = plan_err(
        "matmul",
        &[Some(TensorRef::new(&ints, &[2, m, k]).unwrap()), Some(TensorRef::new(&ints[..k * m], &[k, m]).unwrap())],
        &[],
        vec![],
    );
    assert_eq!(err.code(), ErrorCode::DType);
    assert!(err.message().contains("argument 'a'") && err.message().contains("bfloat16"), "{err}");
}

/// A failure stays with the launch that caused it: another executor's `run` on the same stream
/// succeeds, and the stream's `synchronize` still reports the failure once.
#[test]
fn launch_errors_belong_to_their_launch() {
    setup();
    let stream = uniop::Stream::new();
    // Keep the stream busy so the failing launch is queued (on an idle stream a launch this small
    // runs in place and returns its error directly — see the next test).
    stream.launch_host_fn(|| {
        std::thread::sleep(std::time::Duration::from_millis(20));
        Ok(())
    });
    let w = rand_vec(8, 101);
    let bad = [5i64];
    let mut y = vec![0f32; 2];
    let mut failing = Executor::by_name(
        "embedding",
        &[Some(TensorRef::new(&w, &[4, 2]).unwrap()), Some(TensorRef::new(&bad, &[1]).unwrap())],
        &[],
        vec![TensorMut::new(&mut y, &[1, 2]).unwrap()],
    )
    .unwrap();
    // SAFETY: every tensor outlives the stream work (we synchronize below).
    unsafe { failing.launch(std::ptr::null_mut(), 0, &stream).unwrap() };

    let x = rand_vec(8, 102);
    let (mut out, mut rstd) = (vec![0f32; 8], vec![0f32; 2]);
    let mut fine = Executor::by_name(
        "rms_norm",
        &[Some(TensorRef::new(&x, &[2, 4]).unwrap()), Some(TensorRef::new(&w[..4], &[4]).unwrap())],
        &[],
        vec![TensorMut::new(&mut out, &[2, 4]).unwrap(), TensorMut::new(&mut rstd, &[2, 1]).unwrap()],
    )
    .unwrap();
    fine.run(&mut [], &stream).unwrap();
    let err = stream.synchronize().unwrap_err();
    assert!(err.message().contains("expected values in [0, 4), got 5"), "{err}");
    stream.synchronize().unwrap();
}

/// A single-block launch on an idle stream runs in place: its failure comes back from `launch`,
/// and nothing is left for `synchronize`. On a busy stream the same launch is queued instead.
#[test]
fn small_launch_on_an_idle_stream_runs_in_place() {
    setup();
    let stream = uniop::Stream::new();
    let w = rand_vec(8, 103);
    let bad = [7i64];
    let mut y = vec![0f32; 2];
    let mut e = Executor::by_name(
        "embedding",
        &[Some(TensorRef::new(&w, &[4, 2]).unwrap()), Some(TensorRef::new(&bad, &[1]).unwrap())],
        &[],
        vec![TensorMut::new(&mut y, &[1, 2]).unwrap()],
    )
    .unwrap();
    e.set_repeatable();
    // SAFETY: every tensor outlives the stream work (we synchronize below).
    let err = unsafe { e.launch(std::ptr::null_mut(), 0, &stream) }.unwrap_err();
    assert!(err.message().contains("expected values in [0, 4), got 7"), "{err}");
    stream.synchronize().unwrap();

    let (started_tx, started_rx) = std::sync::mpsc::channel::<()>();
    let (release_tx, release_rx) = std::sync::mpsc::channel::<()>();
    stream.launch_host_fn(move || {
        started_tx.send(()).unwrap();
        release_rx.recv().unwrap();
        Ok(())
    });
    started_rx.recv().unwrap();
    // SAFETY: as above.
    unsafe { e.launch(std::ptr::null_mut(), 0, &stream) }.unwrap();
    release_tx.send(()).unwrap();
    let err = stream.synchronize().unwrap_err();
    assert!(err.message().contains("expected values in [0, 4), got 7"), "{err}");
}

#[test]
fn linear_is_matmul_with_the_transposed_weight_plus_bias() {
    setup();
    let (rows, k, n) = (6, 9, 4);
    let x = rand_vec(rows * k, 111);
    let w = rand_vec(n * k, 112);
    let b = rand_vec(n, 113);
    let tx = TensorRef::new(&x, &[2, 3, k]).unwrap();
    let tw = TensorRef::new(&w, &[n, k]).unwrap();
    let no_bias = run_checked("linear", &[Some(tx.clone()), Some(tw.clone()), None], &[]).remove(0);
    let wt = TensorRef::strided(&w, &[k, n], &[1, k], 0).unwrap();
    let mm = run_checked("matmul", &[Some(TensorRef::new(&x, &[rows, k]).unwrap()), Some(wt)], &[]).remove(0);
    for (a, c) in no_bias.iter().zip(&mm) {
        assert!((a - c).abs() < 1e-5);
    }
    let with_bias =
        run_checked("linear", &[Some(tx.clone()), Some(tw.clone()), Some(TensorRef::new(&b, &[n]).unwrap())], &[])
            .remove(0);
    for (i, (a, c)) in with_bias.iter().zip(&no_bias).enumerate() {
        assert!((a - c - b[i % n] as f64).abs() < 1e-5);
    }
    let err = plan_err("linear", &[Some(tx), Some(tw), Some(TensorRef::new(&b[..3], &[3]).unwrap())], &[], vec![]);
    assert_eq!(err.message(), "linear: argument 'bias': expected shape [4], got shape [3]");
}

#[test]
fn linear_backward_matches_finite_differences() {
    setup();
    let (rows, k, n) = (4, 5, 3);
    let x = rand_vec(rows * k, 121);
    let w = rand_vec(n * k, 122);
    let b = rand_vec(n, 123);
    let dy = rand_vec(rows * n, 124);
    let grads = run_checked(
        "linear_backward",
        &[
            Some(TensorRef::new(&dy, &[2, 2, n]).unwrap()),
            Some(TensorRef::new(&x, &[2, 2, k]).unwrap()),
            Some(TensorRef::new(&w, &[n, k]).unwrap()),
        ],
        &[],
    );
    let f64s = |v: &[f32]| v.iter().map(|&x| x as f64).collect::<Vec<_>>();
    let inputs = [(f64s(&x), vec![2, 2, k]), (f64s(&w), vec![n, k]), (f64s(&b), vec![n])];
    for (wrt, name) in [(0, "dx"), (1, "dweight"), (2, "dbias")] {
        assert_close(&grads[wrt], &finite_difference("linear", &inputs, &[], &f64s(&dy), wrt), name);
    }
}

/// `linear_silu_mul` and `linear_gelu_mul` on each of their routes — few rows (the weights
/// streamed), row bands of the paired GEMM over several of its row blocks, column bands, the
/// generic route over several row chunks and past the f32 packed depth, a strided weight — against
/// their references, and against `linear` then `silu_mul` (`gelu_mul`; which round the products
/// first) in every dtype; the train forms' returns against the same.
#[test]
fn linear_gated_mul_is_linear_then_gated_mul_on_every_route() {
    setup();
    fn check<T: uniop::Element>(cast: impl Fn(f32) -> T, tol: f64, act: &str, attrs: &[(&str, AttrValue)]) {
        let (fused_op, train_op, mul_op) =
            (format!("linear_{act}_mul"), format!("linear_{act}_mul_train"), format!("{act}_mul"));
        for (rows, k, n) in [(3, 40, 70), (300, 70, 45), (9, 100, 300), (130, 33, 200), (600, 20, 40), (70, 4100, 40)] {
            let values = |len, seed| rand_vec(len, seed).into_iter().map(&cast).collect::<Vec<T>>();
            let (x, gate, up) = (values(rows * k, 131), values(n * k, 132), values(n * k, 133));
            let tx = TensorRef::new(&x, &[rows, k]).unwrap();
            let tg = TensorRef::new(&gate, &[n, k]).unwrap();
            // The up weight read through a transposed [k, n] buffer: strides (1, k) over [n, k].
            let up_t: Vec<T> = (0..k * n).map(|i| up[(i % n) * k + i / n]).collect();
            let tu = TensorRef::strided(&up_t, &[n, k], &[1, n], 0).unwrap();
            let fused = run_checked(&fused_op, &[Some(tx.clone()), Some(tg.clone()), Some(tu.clone())], attrs);
            let product = |w: TensorRef| -> Vec<T> {
                let y = run_checked("linear", &[Some(tx.clone()), Some(w), None], &[]).remove(0);
                y.into_iter().map(|v| cast(v as f32)).collect()
            };
            // The train form: the same y (the same kernel), and its products as linear's.
            let train = run_checked(&train_op, &[Some(tx.clone()), Some(tg.clone()), Some(tu.clone())], attrs);
            assert_eq!(train[0], fused[0], "{:?} {rows}x{k}x{n}: {train_op}'s y", T::DTYPE);
            let (g, u) = (product(tg), product(tu));
            for (saved, linear) in [(&train[1], &g), (&train[2], &u)] {
                for (a, b) in saved.iter().zip(linear) {
                    let b = b.to_f64();
                    assert!(
                        (a - b).abs() <= tol * (1.0 + b.abs()),
                        "{:?} {rows}x{k}x{n}: product {a} vs {b}",
                        T::DTYPE
                    );
                }
            }
            let (tg, tu) = (TensorRef::new(&g, &[rows, n]).unwrap(), TensorRef::new(&u, &[rows, n]).unwrap());
            let composite = run_checked(&mul_op, &[Some(tg), Some(tu)], attrs).remove(0);
            for (a, b) in fused[0].iter().zip(&composite) {
                assert!((a - b).abs() <= tol * (1.0 + b.abs()), "{fused_op} {:?} {rows}x{k}x{n}: {a} vs {b}", T::DTYPE);
            }
        }
    }
    // SiLU and GELU's tanh form (Gemma's): the routes are one code for every activation.
    let [silu, _, gelu_tanh] = gatings();
    for (act, attrs) in [silu, gelu_tanh] {
        check(|v| v, 1e-5, act, &attrs);
        check(bf16::from_f32, 2e-2, act, &attrs);
        check(uniop::half::f16::from_f32, 4e-3, act, &attrs);
    }
    // Empty products (k = 0) run without error and give silu(0) · 0 = 0, on the paired route (6 rows)
    // and the few-row one.
    for rows in [6, 2] {
        let (x, w) = (vec![bf16::ZERO; 0], vec![bf16::ZERO; 0]);
        let tw = TensorRef::new(&w, &[40, 0]).unwrap();
        let inputs = [Some(TensorRef::new(&x, &[rows, 0]).unwrap()), Some(tw.clone()), Some(tw)];
        assert!(run_checked("linear_silu_mul", &inputs, &[])[0].iter().all(|&v| v == 0.0));
    }
    let (x, w) = (rand_vec(2 * 4, 1), rand_vec(3 * 5, 2));
    let (tx, tw) = (TensorRef::new(&x, &[2, 4]).unwrap(), TensorRef::new(&w, &[3, 5]).unwrap());
    let err = plan_err("linear_silu_mul", &[Some(tx), Some(tw.clone()), Some(tw)], &[], vec![]);
    assert_eq!(err.code(), ErrorCode::Shape);
    assert_eq!(
        err.message(),
        "linear_silu_mul: argument 'gate_weight': expected shape [out_features, 4] (x is [2, 4]), got shape [3, 5]"
    );
}

#[test]
fn add_rms_norm_backward_is_rms_norm_backward_on_the_sum_plus_dsum() {
    setup();
    let (rows, cols) = (3, 70);
    let (x, r, w) = (rand_vec(rows * cols, 161), rand_vec(rows * cols, 162), rand_vec(cols, 163));
    let (dy, dsum) = (rand_vec(rows * cols, 164), rand_vec(rows * cols, 165));
    fn t<'a>(v: &'a [f32], s: &[usize]) -> Option<TensorRef<'a>> {
        Some(TensorRef::new(v, s).unwrap())
    }
    let fwd = run_checked("add_rms_norm", &[t(&x, &[rows, cols]), t(&r, &[rows, cols]), t(&w, &[cols])], &[]);
    let (rstd, sum): (Vec<f32>, Vec<f32>) =
        (fwd[1].iter().map(|&v| v as f32).collect(), fwd[2].iter().map(|&v| v as f32).collect());
    let (td, ts, tw, tr) = (t(&dy, &[rows, cols]), t(&sum, &[rows, cols]), t(&w, &[cols]), t(&rstd, &[rows, 1]));
    let grads = run_checked(
        "add_rms_norm_backward",
        &[td.clone(), t(&dsum, &[rows, cols]), ts.clone(), tw.clone(), tr.clone()],
        &[],
    );
    let rms = run_checked("rms_norm_backward", &[td, ts, tw, tr], &[]);
    assert_eq!(grads[0], grads[1], "dx and dresidual are one gradient");
    let want: Vec<f64> = rms[0].iter().zip(&dsum).map(|(a, &b)| a + b as f64).collect();
    assert_close(&grads[0], &want, "dx");
    assert_eq!(grads[2], rms[1], "dweight is rms_norm_backward's");
    let err = plan_err(
        "add_rms_norm_backward",
        &[
            t(&dy, &[rows, cols]),
            t(&dsum[..cols], &[1, cols]),
            t(&sum, &[rows, cols]),
            t(&w, &[cols]),
            t(&rstd, &[rows, 1]),
        ],
        &[],
        vec![],
    );
    assert_eq!(err.message(), "add_rms_norm_backward: argument 'dsum': expected shape [3, 70], got shape [1, 70]");
}

#[test]
fn linear_add_is_linear_then_add_with_its_gradients() {
    setup();
    fn check<T: uniop::Element>(cast: impl Fn(f32) -> T, tol: f64) {
        // Few rows (column bands), row bands, and a depth past one packed slice.
        for (rows, k, n) in [(3, 40, 200), (300, 70, 45), (130, 600, 96)] {
            let values = |len, seed| rand_vec(len, seed).into_iter().map(&cast).collect::<Vec<T>>();
            let (x, w, residual) = (values(rows * k, 151), values(n * k, 152), values(rows * n, 153));
            let tx = TensorRef::new(&x, &[rows, k]).unwrap();
            let tw = TensorRef::new(&w, &[n, k]).unwrap();
            // The residual read through a transposed [n, rows] buffer: strides (1, rows).
            let res_t: Vec<T> = (0..rows * n).map(|i| residual[(i % rows) * n + i / rows]).collect();
            let tr = TensorRef::strided(&res_t, &[rows, n], &[1, rows], 0).unwrap();
            let fused = run_checked("linear_add", &[Some(tx.clone()), Some(tw.clone()), Some(tr)], &[]).remove(0);
            let product = run_checked("linear", &[Some(tx.clone()), Some(tw.clone()), None], &[]).remove(0);
            for (i, (a, p)) in fused.iter().zip(&product).enumerate() {
                let b = p + residual[i].to_f64();
                assert!((a - b).abs() <= tol * (1.0 + b.abs()), "{:?} {rows}x{k}x{n}: {a} vs {b}", T::DTYPE);
            }
            let dy = values(rows * n, 154);
            let inputs = [Some(TensorRef::new(&dy, &[rows, n]).unwrap()), Some(tx), Some(tw)];
            let grads = run_checked("linear_add_backward", &inputs, &[]);
            let linear_grads = run_checked("linear_backward", &inputs, &[]);
            assert_eq!(grads[..2], linear_grads[..2], "{:?}: dx and dweight are linear's", T::DTYPE);
            assert!(grads[2].iter().zip(&dy).all(|(a, b)| *a == b.to_f64()), "dresidual is dy");
        }
    }
    check(|v| v, 1e-5);
    check(bf16::from_f32, 1e-2);
    // f16 products are summed in f16 by the `gemm` crate: both sides carry that error at k = 600.
    check(uniop::half::f16::from_f32, 1e-2);
    let (x, w, r) = (rand_vec(2 * 4, 1), rand_vec(3 * 4, 2), rand_vec(2 * 4, 3));
    let inputs = [
        Some(TensorRef::new(&x, &[2, 4]).unwrap()),
        Some(TensorRef::new(&w, &[3, 4]).unwrap()),
        Some(TensorRef::new(&r, &[2, 4]).unwrap()),
    ];
    let err = plan_err("linear_add", &inputs, &[], vec![]);
    assert_eq!(err.code(), ErrorCode::Shape);
    assert_eq!(err.message(), "linear_add: argument 'residual': expected shape [2, 3], got shape [2, 4]");
}

#[test]
fn linear_gated_mul_backward_matches_finite_differences() {
    setup();
    let (rows, k, n) = (4, 5, 3);
    let (x, gate, up, dy) =
        (rand_vec(rows * k, 141), rand_vec(n * k, 142), rand_vec(n * k, 143), rand_vec(rows * n, 144));
    let f64s = |v: &[f32]| v.iter().map(|&x| x as f64).collect::<Vec<_>>();
    let inputs = [(f64s(&x), vec![2, 2, k]), (f64s(&gate), vec![n, k]), (f64s(&up), vec![n, k])];
    for (act, attrs) in gatings() {
        let forward = format!("linear_{act}_mul");
        let grads = run_checked(
            &format!("{forward}_backward"),
            &[
                Some(TensorRef::new(&dy, &[2, 2, n]).unwrap()),
                Some(TensorRef::new(&x, &[2, 2, k]).unwrap()),
                Some(TensorRef::new(&gate, &[n, k]).unwrap()),
                Some(TensorRef::new(&up, &[n, k]).unwrap()),
                None,
                None,
            ],
            &attrs,
        );
        for (wrt, name) in [(0, "dx"), (1, "dgate_weight"), (2, "dup_weight")] {
            let want = finite_difference(&forward, &inputs, &attrs, &f64s(&dy), wrt);
            assert_close(&grads[wrt], &want, &format!("{forward} {attrs:?}: {name}"));
        }
    }
    let err = plan_err(
        "linear_silu_mul_backward",
        &[
            Some(TensorRef::new(&dy, &[2, 2, n]).unwrap()),
            Some(TensorRef::new(&x, &[2, 2, k]).unwrap()),
            Some(TensorRef::new(&gate, &[n, k]).unwrap()),
            Some(TensorRef::new(&up[..k * (n - 1)], &[n - 1, k]).unwrap()),
            None,
            None,
        ],
        &[],
        vec![],
    );
    assert_eq!(
        err.message(),
        "linear_silu_mul_backward: argument 'up_weight': expected shape [3, 5], got shape [2, 5]"
    );
}

/// The backward with the forward's products given (from `linear_silu_mul_train`, on the few-row,
/// paired and generic routes; `linear_gelu_mul_train`'s on one) gives the recomputing backward's
/// gradients; the products come as a pair shaped as `dy`, or the call is refused.
#[test]
fn linear_gated_mul_backward_takes_the_saved_products() {
    setup();
    let gelu = [("approximate", AttrValue::Str("tanh".into()))];
    for (rows, k, n, act, attrs) in [
        (4, 5, 3, "silu", &[][..]),
        (150, 40, 70, "silu", &[]),
        (70, 4100, 40, "silu", &[]),
        (150, 40, 70, "gelu", &gelu),
    ] {
        let (train_op, backward_op) = (format!("linear_{act}_mul_train"), format!("linear_{act}_mul_backward"));
        let (x, gate_w, up_w, dy) =
            (rand_vec(rows * k, 151), rand_vec(n * k, 152), rand_vec(n * k, 153), rand_vec(rows * n, 154));
        let (tx, tg, tu) = (
            TensorRef::new(&x, &[rows, k]).unwrap(),
            TensorRef::new(&gate_w, &[n, k]).unwrap(),
            TensorRef::new(&up_w, &[n, k]).unwrap(),
        );
        let tdy = TensorRef::new(&dy, &[rows, n]).unwrap();
        let saved: Vec<Vec<f32>> =
            run_checked(&train_op, &[Some(tx.clone()), Some(tg.clone()), Some(tu.clone())], attrs)
                .into_iter()
                .map(|v| v.into_iter().map(|e| e as f32).collect())
                .collect();
        let products = [1, 2].map(|i| Some(TensorRef::new(&saved[i], &[rows, n]).unwrap()));
        let operands = [Some(tdy.clone()), Some(tx.clone()), Some(tg.clone()), Some(tu.clone())];
        let recomputed = run_checked(&backward_op, &[&operands[..], &[None, None]].concat(), attrs);
        let from_saved = run_checked(&backward_op, &[&operands[..], &products].concat(), attrs);
        for (i, name) in ["dx", "dgate_weight", "dup_weight"].into_iter().enumerate() {
            for (a, b) in from_saved[i].iter().zip(&recomputed[i]) {
                assert!((a - b).abs() <= 1e-4 * (1.0 + b.abs()), "{rows}x{k}x{n} {name}: {a} vs {b}");
            }
        }
        // One product without the other.
        let lone = [&operands[..], &[products[0].clone(), None]].concat();
        let err = plan_err(&backward_op, &lone, attrs, vec![]);
        assert_eq!(err.code(), ErrorCode::ParamNullptr);
        assert_eq!(
            err.message(),
            format!(
                "{backward_op}: argument 'up': expected a tensor, as 'gate' is given (the saved products come as a \
                 pair), got none"
            )
        );
    }
    // A product not shaped as dy.
    let (dy, x, w, short) = (rand_vec(6, 155), rand_vec(8, 156), rand_vec(12, 157), rand_vec(3, 158));
    let inputs = [
        Some(TensorRef::new(&dy, &[2, 3]).unwrap()),
        Some(TensorRef::new(&x, &[2, 4]).unwrap()),
        Some(TensorRef::new(&w, &[3, 4]).unwrap()),
        Some(TensorRef::new(&w, &[3, 4]).unwrap()),
        Some(TensorRef::new(&short, &[1, 3]).unwrap()),
        Some(TensorRef::new(&dy, &[2, 3]).unwrap()),
    ];
    let err = plan_err("linear_silu_mul_backward", &inputs, &[], vec![]);
    assert_eq!(err.code(), ErrorCode::Shape);
    assert_eq!(err.message(), "linear_silu_mul_backward: argument 'gate': expected shape [2, 3], got shape [1, 3]");
}

#[test]
fn cross_entropy_with_ignored_rows_and_its_gradient() {
    setup();
    let (rows, classes) = (4, 6);
    let x: Vec<f32> = rand_vec(rows * classes, 131).iter().map(|v| 3.0 * v).collect();
    let t = [2i64, -100, 5, 0];
    let attrs = [("ignore_index", AttrValue::Int(-100))];
    let (tx, tt) = (TensorRef::new(&x, &[rows, classes]).unwrap(), TensorRef::new(&t, &[rows]).unwrap());
    let out = run_checked("cross_entropy", &[Some(tx.clone()), Some(tt.clone())], &attrs);
    // torch semantics: mean over the three counted rows.
    let manual: f64 = [0usize, 2, 3]
        .iter()
        .map(|&r| {
            let row: Vec<f64> = x[r * classes..(r + 1) * classes].iter().map(|&v| v as f64).collect();
            let lse = row.iter().map(|v| v.exp()).sum::<f64>().ln();
            lse - row[t[r] as usize]
        })
        .sum::<f64>()
        / 3.0;
    assert!((out[0][0] - manual).abs() < 1e-5, "{} vs {manual}", out[0][0]);
    let lse: Vec<f32> = out[1].iter().map(|&v| v as f32).collect();
    let dloss = [1.5f32];
    let dx = run_checked(
        "cross_entropy_backward",
        &[Some(TensorRef::new(&dloss, &[]).unwrap()), Some(tx), Some(tt), Some(TensorRef::new(&lse, &[rows]).unwrap())],
        &attrs,
    );
    let x64: Vec<f64> = x.iter().map(|&v| v as f64).collect();
    let t64: Vec<f64> = t.iter().map(|&v| v as f64).collect();
    let want = finite_difference_typed(
        "cross_entropy",
        &[(x64, vec![rows, classes]), (t64, vec![rows])],
        &[DType::F32, DType::I64],
        &attrs,
        &[1.5],
        0,
    );
    assert_close(&dx[0], &want, "dlogits");
    assert!(dx[0][classes..2 * classes].iter().all(|&g| g == 0.0), "ignored row has no gradient");

    let bad = [7i64, 0, 0, 0];
    let mut loss = [0f32];
    let mut lse_out = [0f32; 4];
    let err = uniop::call(
        "cross_entropy",
        &[Some(TensorRef::new(&x, &[rows, classes]).unwrap()), Some(TensorRef::new(&bad, &[rows]).unwrap())],
        &[],
        vec![TensorMut::new(&mut loss, &[]).unwrap(), TensorMut::new(&mut lse_out, &[rows]).unwrap()],
    )
    .unwrap_err();
    assert!(
        err.message().starts_with("cross_entropy: argument 'target': expected values in [0, 6), got 7 at position 0"),
        "{err}"
    );
}

#[test]
fn cast_follows_c_and_torch_conversion_rules() {
    setup();
    let cast = |input: TensorRef, to: DType| -> Tensor {
        let mut out = Tensor::zeros(to, input.shape()).unwrap();
        uniop::call("cast", &[Some(input)], &[("dtype", AttrValue::DType(to))], vec![out.view_mut()]).unwrap();
        out
    };
    let big = [(1i64 << 60) + 1, -1, 1 << 40 | 7];
    // i64 → i64 keeps all 64 bits; → i32 wraps to the low 32 bits; → u8 wraps.
    assert_eq!(cast(TensorRef::new(&big, &[3]).unwrap(), DType::I64).view().to_vec::<i64>().unwrap(), big);
    assert_eq!(cast(TensorRef::new(&big, &[3]).unwrap(), DType::I32).view().to_vec::<i32>().unwrap(), [1, -1, 7]);
    assert_eq!(cast(TensorRef::new(&big, &[3]).unwrap(), DType::U8).view().to_vec::<u8>().unwrap(), [1, 255, 7]);
    // Floats to integers truncate toward zero and saturate; NaN → 0; to bool is != 0.
    let f = [3.7f32, -3.7, f32::NAN, 300.0, -0.0];
    assert_eq!(cast(TensorRef::new(&f, &[5]).unwrap(), DType::I32).view().to_vec::<i32>().unwrap(), [3, -3, 0, 300, 0]);
    assert_eq!(cast(TensorRef::new(&f, &[5]).unwrap(), DType::U8).view().to_vec::<u8>().unwrap(), [3, 0, 0, 255, 0]);
    assert_eq!(
        cast(TensorRef::new(&f, &[5]).unwrap(), DType::Bool).view().to_vec::<bool>().unwrap(),
        [true, true, true, true, false]
    );
    // f32 → bf16 rounds to nearest even, bit-identical to `half`.
    let x = rand_vec(1000, 140);
    let got = cast(TensorRef::new(&x, &[1000]).unwrap(), DType::BF16).view().to_vec::<bf16>().unwrap();
    assert!(got.iter().zip(&x).all(|(g, &v)| g.to_bits() == bf16::from_f32(v).to_bits()));
}

/// Outputs as large as the last-level cache are written with non-temporal stores (chunks plus an
/// unaligned tail): every route — f32 narrowed in place, a widened source, the generic per-element one —
/// must still produce exactly the scalar conversion.
#[test]
fn cast_of_outputs_too_big_for_the_cache_matches_the_scalar_conversion() {
    setup();
    let n = uniop_ops::streaming_threshold_bytes() / 2 + 13; // a bf16 output just past the streaming threshold, odd length
    let x = rand_vec(n, 141);
    let run = |input: TensorRef, to: DType| -> Tensor {
        let mut out = Tensor::zeros(to, input.shape()).unwrap();
        uniop::call("cast", &[Some(input)], &[("dtype", AttrValue::DType(to))], vec![out.view_mut()]).unwrap();
        out
    };
    let narrowed = run(TensorRef::new(&x, &[n]).unwrap(), DType::BF16).view().to_vec::<bf16>().unwrap();
    assert!(narrowed.iter().zip(&x).all(|(g, &v)| g.to_bits() == bf16::from_f32(v).to_bits()));
    let widened = run(TensorRef::new(&narrowed, &[n]).unwrap(), DType::F32).view().to_vec::<f32>().unwrap();
    assert!(widened.iter().zip(&narrowed).all(|(&g, v)| g.to_bits() == v.to_f32().to_bits()));
    let ints: Vec<i32> = x.iter().map(|v| (v * 1000.0) as i32).collect();
    let floats = run(TensorRef::new(&ints, &[n]).unwrap(), DType::F64).view().to_vec::<f64>().unwrap();
    assert!(floats.iter().zip(&ints).all(|(&g, &v)| g == v as f64));
}

/// Softmax/log-softmax gradients of a tensor too big for the cache (written with non-temporal
/// stores) whose rows end in a partial SIMD step (the reduction pads it with zeros).
#[test]
fn softmax_backward_streams_big_outputs_and_pads_row_tails() {
    setup();
    let cols = 4099; // 64·64 + 3
    let rows = uniop_ops::streaming_threshold_bytes() / (4 * cols) + 1; // f32 output past the threshold
    let (dy, y) = (rand_vec(rows * cols, 142), rand_vec(rows * cols, 143));
    for op in ["softmax_backward", "log_softmax_backward"] {
        let inputs =
            [Some(TensorRef::new(&dy, &[rows, cols]).unwrap()), Some(TensorRef::new(&y, &[rows, cols]).unwrap())];
        run_checked(op, &inputs, &[]);
    }
}

/// The dense elementwise paths past the streaming threshold, with a partial last step: f32 runs
/// one element loop straight into the outputs (`dense_map`), bf16 stages whole steps — unary
/// (silu), binary (silu_mul) and the fused multi-output kernel (silu_mul_backward), each against
/// the f64 reference.
#[test]
fn dense_elementwise_kernels_stream_big_outputs_in_f32_and_bf16() {
    setup();
    let n = uniop_ops::streaming_threshold_bytes() / 2 + 13; // bf16 outputs just past the threshold; 13 = a partial step
    let f32s = [144, 145, 146].map(|seed| rand_vec(n, seed));
    let bf16s = f32s.each_ref().map(|x| x.iter().map(|&v| bf16::from_f32(v)).collect::<Vec<_>>());
    let f32_refs = f32s.each_ref().map(|x| Some(TensorRef::new(x, &[n]).unwrap()));
    let bf16_refs = bf16s.each_ref().map(|x| Some(TensorRef::new(x, &[n]).unwrap()));
    for inputs in [f32_refs, bf16_refs] {
        run_checked("silu", &inputs[..1], &[]);
        run_checked("silu_mul", &inputs[1..], &[]);
        run_checked("silu_mul_backward", &inputs, &[]);
    }
}

/// A table gradient past the streaming threshold in f32 and bf16: rows nobody indexes
/// are written as zeros with non-temporal stores, indexed ones summed and narrowed. The output
/// starts as NaN, so a row the kernel skipped would show; hidden 1000 ends in a partial 64-lane
/// step; indices repeat, and padding_idx is one of them.
#[test]
fn embedding_backward_streams_a_big_table_gradient() {
    setup();
    let (h, tokens) = (1000, 300);
    let v = (uniop_ops::streaming_threshold_bytes() / (2 * h) + 1).max(3250); // bf16 past the threshold; indices reach 3237
    let idx: Vec<i64> = (0..tokens).map(|p| (p * 97 % 250) as i64 * 13).collect();
    let attrs = [("padding_idx", AttrValue::Int(idx[5]))];
    let dout = rand_vec(tokens * h, 91);
    let weight = vec![0f32; v * h];
    let run = |dout: Option<TensorRef>, weight: Option<TensorRef>, mut out: Tensor| {
        let inputs = [dout, Some(TensorRef::new(&idx, &[tokens]).unwrap()), weight];
        uniop::call("embedding_backward", &inputs, &attrs, vec![out.view_mut()]).unwrap();
        let entry = Registry::global().get("embedding_backward").unwrap();
        let report = check_outputs(&entry, &inputs, &attrs, &[out.view()]).unwrap();
        assert!(report.pass(), "{report}");
    };
    run(
        Some(TensorRef::new(&dout, &[tokens, h]).unwrap()),
        Some(TensorRef::new(&weight, &[v, h]).unwrap()),
        Tensor::from_slice(&vec![f32::NAN; v * h], &[v, h]).unwrap(),
    );
    let to_bf16 = |x: &[f32]| x.iter().map(|&v| bf16::from_f32(v)).collect::<Vec<_>>();
    let (dout, weight) = (to_bf16(&dout), to_bf16(&weight));
    run(
        Some(TensorRef::new(&dout, &[tokens, h]).unwrap()),
        Some(TensorRef::new(&weight, &[v, h]).unwrap()),
        Tensor::from_slice(&vec![bf16::NAN; v * h], &[v, h]).unwrap(),
    );
}

#[test]
fn argmax_takes_the_first_maximum_and_nan_along_any_dim() {
    setup();
    let x = [1.0f32, 3.0, 3.0, -1.0, f32::NAN, 2.0];
    let argmax = |shape: &[usize], attrs: &[(&str, AttrValue)]| -> Vec<i64> {
        let t = TensorRef::new(&x, shape).unwrap();
        let entry = Registry::global().get("argmax").unwrap();
        let meta = infer(&entry, &[Some(t.clone())], attrs).unwrap().remove(0);
        let mut out = Tensor::with_meta(meta).unwrap();
        uniop::call("argmax", &[Some(t)], attrs, vec![out.view_mut()]).unwrap();
        out.view().to_vec::<i64>().unwrap()
    };
    assert_eq!(argmax(&[2, 3], &[]), [1, 1]); // tie → first; NaN wins
    assert_eq!(argmax(&[2, 3], &[("dim", AttrValue::Int(0))]), [0, 1, 0]);
    assert_eq!(argmax(&[6], &[("keepdim", AttrValue::Bool(true))]), [4]);
}

/// argmax wants a contiguous x, so a `[S, H, V]` buffer viewed as `[H, S, V]` is staged first:
/// by the row-tiled copy (`uniop::RowTiles`), whose tiles are cut ragged at both ends here.
#[test]
fn argmax_of_a_permuted_view_is_staged_row_by_row() {
    setup();
    let (s, h, v) = (70, 9, 40);
    let x: Vec<f32> = (0..s * h * v).map(|i| ((i * 7919) % 1009) as f32).collect();
    let view = TensorRef::strided(&x, &[h, s, v], &[v, h * v, 1], 0).unwrap();
    let entry = Registry::global().get("argmax").unwrap();
    let meta = infer(&entry, &[Some(view.clone())], &[]).unwrap().remove(0);
    let mut out = Tensor::with_meta(meta).unwrap();
    uniop::call("argmax", &[Some(view)], &[], vec![out.view_mut()]).unwrap();
    let got = out.view().to_vec::<i64>().unwrap();
    for (head, row) in (0..h).flat_map(|head| (0..s).map(move |row| (head, row))) {
        let values = &x[(row * h + head) * v..][..v];
        let first_max = (0..v).fold(0, |best, i| if values[i] > values[best] { i } else { best });
        assert_eq!(got[head * s + row], first_max as i64, "argmax of [{head}, {row}]");
    }
}

#[test]
fn argmax_of_long_rows_finds_ties_nans_and_signed_zeros_in_any_chunk() {
    setup();
    // Rows longer than the kernel's 64-lane steps, with a ragged tail: what matters sits in
    // later chunks, after decoys.
    let n = 300;
    let mut rows: Vec<(Vec<f32>, i64)> = Vec::new();
    let ramp = |i: usize| ((i * 37) % 101) as f32 - 50.0;
    let mut tie = (0..n).map(ramp).collect::<Vec<_>>();
    tie[130] = 99.0;
    tie[290] = 99.0;
    rows.push((tie, 130));
    let mut nan = (0..n).map(ramp).collect::<Vec<_>>();
    nan[5] = 1e30;
    nan[200] = f32::NAN;
    nan[250] = f32::NAN;
    rows.push((nan, 200));
    let mut zeros = vec![f32::NEG_INFINITY; n];
    zeros[70] = -0.0;
    zeros[71] = 0.0;
    rows.push((zeros, 70));
    rows.push((vec![f32::NEG_INFINITY; n], 0));
    let mut last = (0..n).map(ramp).collect::<Vec<_>>();
    last[n - 1] = 1000.0;
    rows.push((last, n as i64 - 1));
    let flat: Vec<f32> = rows.iter().flat_map(|(r, _)| r.iter().copied()).collect();
    let want: Vec<i64> = rows.iter().map(|(_, i)| *i).collect();
    let as_bf16: Vec<bf16> = flat.iter().map(|&v| bf16::from_f32(v)).collect();
    let shape = [rows.len(), n];
    for x in [TensorRef::new(&flat, &shape).unwrap(), TensorRef::new(&as_bf16, &shape).unwrap()] {
        let entry = Registry::global().get("argmax").unwrap();
        let meta = infer(&entry, &[Some(x.clone())], &[]).unwrap().remove(0);
        let mut out = Tensor::with_meta(meta).unwrap();
        uniop::call("argmax", &[Some(x.clone())], &[], vec![out.view_mut()]).unwrap();
        assert_eq!(out.view().to_vec::<i64>().unwrap(), want, "{:?}", x.dtype());
    }
}

#[test]
fn sample_is_greedy_at_zero_temperature_reproducible_and_matches_the_distribution() {
    setup();
    let vocab = 6;
    let row = [0.5f32, 2.0, -1.0, 1.0, 0.0, 1.9];
    let rows = 20000;
    let logits: Vec<f32> = row.iter().copied().cycle().take(rows * vocab).collect();
    let draw = |attrs: &[(&str, AttrValue)]| -> Vec<i64> {
        let mut out = Tensor::zeros(DType::I64, &[rows]).unwrap();
        let x = TensorRef::new(&logits, &[rows, vocab]).unwrap();
        uniop::call("sample", &[Some(x)], attrs, vec![out.view_mut()]).unwrap();
        out.view().to_vec::<i64>().unwrap()
    };
    assert!(draw(&[("temperature", 0.0.into())]).iter().all(|&t| t == 1));
    assert!(draw(&[("top_k", 1i64.into())]).iter().all(|&t| t == 1));
    let plain = draw(&[("seed", 3i64.into())]);
    assert_eq!(plain, draw(&[("seed", 3i64.into())]), "same seed, same tokens");
    assert_ne!(plain, draw(&[("seed", 4i64.into())]), "another seed, other tokens");
    // Frequencies within 5 standard deviations of softmax(logits / T).
    let check = |tokens: &[i64], probs: &[f64]| {
        for (t, &p) in probs.iter().enumerate() {
            let freq = tokens.iter().filter(|&&x| x == t as i64).count() as f64 / rows as f64;
            let sigma = (p * (1.0 - p) / rows as f64).sqrt();
            assert!((freq - p).abs() <= 5.0 * sigma + 1e-12, "token {t}: frequency {freq}, probability {p}");
        }
    };
    let softmax = |t: f64, keep: &[usize]| -> Vec<f64> {
        let e: Vec<f64> = (0..vocab).map(|i| if keep.contains(&i) { (row[i] as f64 / t).exp() } else { 0.0 }).collect();
        let s: f64 = e.iter().sum();
        e.iter().map(|v| v / s).collect()
    };
    check(&plain, &softmax(1.0, &[0, 1, 2, 3, 4, 5]));
    check(&draw(&[("temperature", 0.5.into())]), &softmax(0.5, &[0, 1, 2, 3, 4, 5]));
    check(&draw(&[("top_k", 3i64.into())]), &softmax(1.0, &[1, 5, 3]));
    // Probabilities (T = 1): token 1 .373, 5 .338, 3 .137, 0 .083, ...: the 0.6 nucleus is {1, 5}.
    check(&draw(&[("top_p", 0.6.into())]), &softmax(1.0, &[1, 5]));
    // top_k first, then top_p renormalized over the k kept: {1, 5, 3} → .440, .398 → {1, 5} reach 0.8.
    check(&draw(&[("top_k", 3i64.into()), ("top_p", 0.8.into())]), &softmax(1.0, &[1, 5]));
    check(&draw(&[("top_k", 3i64.into()), ("top_p", 0.9.into())]), &softmax(1.0, &[1, 5, 3]));
}

#[test]
fn sample_rejects_bad_parameters() {
    setup();
    let x = [0f32; 4];
    let t = || Some(TensorRef::new(&x, &[1, 4]).unwrap());
    for (attrs, code, msg) in [
        (
            vec![("top_p", AttrValue::Float(0.0))],
            ErrorCode::ParamInvalid,
            "sample: argument 'top_p': expected a value in (0, 1] (1 = no nucleus filter), got 0",
        ),
        (
            vec![("top_p", AttrValue::Float(1.5))],
            ErrorCode::ParamInvalid,
            "sample: argument 'top_p': expected a value in (0, 1] (1 = no nucleus filter), got 1.5",
        ),
        (
            vec![("temperature", AttrValue::Float(-1.0))],
            ErrorCode::ParamInvalid,
            "sample: argument 'temperature': expected a finite value ≥ 0 (0 = greedy), got -1",
        ),
        (
            vec![("top_k", AttrValue::Int(-2))],
            ErrorCode::ParamInvalid,
            "sample: argument 'top_k': expected a value ≥ 0 (0 = no top-k filter), got -2",
        ),
    ] {
        let err = plan_err(
            "sample",
            &[t()],
            &attr_refs(&attrs.iter().map(|(k, v)| (k.to_string(), v.clone())).collect::<Vec<_>>()),
            vec![],
        );
        assert_eq!((err.code(), err.message()), (code, msg));
    }
}

/// causal_softmax = softmax of x with −inf above the bottom-right-aligned diagonal, and its
/// gradient is softmax_backward of its output (checked against finite differences).
#[test]
fn causal_softmax_masks_bottom_right_and_softmax_backward_is_its_gradient() {
    setup();
    let (sq, sk) = (3, 5);
    let x = rand_vec(2 * sq * sk, 150);
    let y = run_checked("causal_softmax", &[Some(TensorRef::new(&x, &[2, sq, sk]).unwrap())], &[]);
    let mut masked = x.clone();
    for (r, row) in masked.chunks_mut(sk).enumerate() {
        row[r % sq + 1 + sk - sq..].fill(f32::NEG_INFINITY); // row i sees i + 2 + 1 columns
    }
    let want = run_checked("softmax", &[Some(TensorRef::new(&masked, &[2, sq, sk]).unwrap())], &[]);
    assert_close(&y[0], &want[0], "causal_softmax vs masked softmax");
    let y32: Vec<f32> = y[0].iter().map(|&v| v as f32).collect();
    let dy = rand_vec(2 * sq * sk, 151);
    let dx = run_checked(
        "softmax_backward",
        &[Some(TensorRef::new(&dy, &[2, sq, sk]).unwrap()), Some(TensorRef::new(&y32, &[2, sq, sk]).unwrap())],
        &[],
    );
    let f64s = |v: &[f32]| v.iter().map(|&x| x as f64).collect::<Vec<_>>();
    let fd = finite_difference("causal_softmax", &[(f64s(&x), vec![2, sq, sk])], &[], &f64s(&dy), 0);
    assert_close(&dx[0], &fd, "dx");
}

/// Linears split by output columns across blocks: decode-shaped ones (a few rows, many outputs;
/// in bf16 dot products straight from the weight), and ones with more rows than that but fewer
/// than outputs per block (a prefill against an MLP weight: bf16, and f32 from AVX2 up, split them
/// by columns, and bf16 on AMX, at least 1024 deep, takes them transposed). Bias, ragged
/// bands and blocks, the weight dense along k and a transposed view of it, f32 and bf16.
#[test]
fn linear_split_by_columns_matches_the_reference() {
    setup();
    use uniop::half::bf16;
    let to_bf16 = |v: &[f32]| v.iter().map(|&f| bf16::from_f32(f)).collect::<Vec<_>>();
    for (rows, k, n) in [(1, 96, 200), (3, 33, 130), (2, 64, 64), (40, 1030, 300), (70, 301, 200)] {
        let (x, w, b) = (rand_vec(rows * k, 91), rand_vec(n * k, 92), rand_vec(n, 93));
        let (xb, wb, bb) = (to_bf16(&x), to_bf16(&w), to_bf16(&b));
        // The transposed view reads the weight's storage as `[k, n]`: other values, the same check.
        for strides in [[k, 1], [1, n]] {
            let inputs = [
                Some(TensorRef::new(&x, &[rows, k]).unwrap()),
                Some(TensorRef::strided(&w, &[n, k], &strides, 0).unwrap()),
                Some(TensorRef::new(&b, &[n]).unwrap()),
            ];
            assert_eq!(run_checked("linear", &inputs, &[]).remove(0).len(), rows * n);
            let inputs = [
                Some(TensorRef::new(&xb, &[rows, k]).unwrap()),
                Some(TensorRef::strided(&wb, &[n, k], &strides, 0).unwrap()),
                Some(TensorRef::new(&bb, &[n]).unwrap()),
            ];
            run_checked("linear", &inputs, &[]);
        }
    }
}

/// bf16 gradients of a linear with fewer rows than in_features per block: dx is split by
/// columns (each block packing its share of the weight); ragged column bands and blocks, the
/// 16-row groups of dyᵀ packed for dweight with a ragged rest and depth.
#[test]
fn linear_backward_with_few_rows_matches_the_reference() {
    setup();
    use uniop::half::bf16;
    let to_bf16 = |v: &[f32]| v.iter().map(|&f| bf16::from_f32(f)).collect::<Vec<_>>();
    // The last: no rows and no in_features (every output empty but dbias, all zeros; still a
    // split by columns, of none).
    for (rows, k, n) in [(40, 300, 100), (70, 200, 37), (0, 0, 3)] {
        let (dy, x, w) =
            (to_bf16(&rand_vec(rows * n, 125)), to_bf16(&rand_vec(rows * k, 126)), to_bf16(&rand_vec(n * k, 127)));
        let inputs = [
            Some(TensorRef::new(&dy, &[rows, n]).unwrap()),
            Some(TensorRef::new(&x, &[rows, k]).unwrap()),
            Some(TensorRef::new(&w, &[n, k]).unwrap()),
        ];
        let grads = run_checked("linear_backward", &inputs, &[]);
        assert_eq!(grads.iter().map(Vec::len).collect::<Vec<_>>(), [rows * k, n * k, n]);
    }
}

#[test]
fn matmul_with_few_rows_splits_columns() {
    // Fewer row bands than threads: blocks take bands of b's columns (row-major b: the bf16 line
    // kernel; transposed b: the dot products), a ragged last column unit, odd k, f32 and bf16.
    // The last two: more rows than those paths take, but fewer than columns per block, so one
    // band of all rows is split by columns (on AMX a transposed b at least 1024 deep, as in the
    // first of them, is taken transposed).
    setup();
    use uniop::half::bf16;
    for (rows, k, n) in [(1, 96, 200), (3, 33, 130), (4, 7, 65), (40, 1030, 300), (70, 301, 200)] {
        let (a, b) = (rand_vec(rows * k, 94), rand_vec(k * n, 95));
        let to_bf16 = |v: &[f32]| v.iter().map(|&f| bf16::from_f32(f)).collect::<Vec<_>>();
        let (ab, bb) = (to_bf16(&a), to_bf16(&b));
        run_checked(
            "matmul",
            &[Some(TensorRef::new(&a, &[rows, k]).unwrap()), Some(TensorRef::new(&b, &[k, n]).unwrap())],
            &[],
        );
        run_checked(
            "matmul",
            &[Some(TensorRef::new(&ab, &[rows, k]).unwrap()), Some(TensorRef::new(&bb, &[k, n]).unwrap())],
            &[],
        );
        let transposed = TensorRef::strided(&bb, &[k, n], &[1, k], 0).unwrap();
        run_checked("matmul", &[Some(TensorRef::new(&ab, &[rows, k]).unwrap()), Some(transposed)], &[]);
    }
}

#[test]
fn cat_joins_along_any_dim_and_reads_strided_inputs() {
    setup();
    let a = [1.0f32, 2.0, 3.0, 4.0];
    let (row, col) = ([5.0f32, 6.0], [7.0f32, 8.0]);
    let ta = TensorRef::new(&a, &[2, 2]).unwrap();
    let rows =
        run_checked("cat", &[Some(ta.clone()), Some(TensorRef::new(&row, &[1, 2]).unwrap())], &[("dim", 0i64.into())]);
    assert_eq!(rows[0], [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
    let cols =
        run_checked("cat", &[Some(ta), Some(TensorRef::new(&col, &[2, 1]).unwrap())], &[("dim", (-1i64).into())]);
    assert_eq!(cols[0], [1.0, 2.0, 7.0, 3.0, 4.0, 8.0]);
    // aᵀ read through its strides, joined with itself along dim 1.
    let at = TensorRef::strided(&a, &[2, 2], &[1, 2], 0).unwrap();
    let out = run_checked("cat", &[Some(at.clone()), Some(at)], &[("dim", 1i64.into())]);
    assert_eq!(out[0], [1.0, 3.0, 1.0, 3.0, 2.0, 4.0, 2.0, 4.0]);
}

#[test]
fn cat_rejects_empty_lists_mixed_dtypes_mismatched_shapes_and_bad_dims() {
    fn out_view<'a>(out: &'a mut [f32], shape: &[usize]) -> Vec<TensorMut<'a>> {
        vec![TensorMut::new(out, shape).unwrap()]
    }
    setup();
    let a = [1.0f32; 4];
    let b16 = [bf16::ONE; 2];
    let c = [1.0f32; 6];
    let mut out = [0f32; 16];
    let ta = || Some(TensorRef::new(&a, &[2, 2]).unwrap());
    let e = plan_err("cat", &[], &[], out_view(&mut out[..0], &[0]));
    assert_eq!(e.code(), ErrorCode::ParamInvalid);
    assert!(e.message().contains("'tensors'") && e.message().contains("at least one tensor"), "{e}");
    let e =
        plan_err("cat", &[ta(), Some(TensorRef::new(&b16, &[1, 2]).unwrap())], &[], out_view(&mut out[..6], &[3, 2]));
    assert_eq!(e.code(), ErrorCode::DType);
    assert!(e.message().contains("tensors[1]") && e.message().contains("bfloat16"), "{e}");
    let e =
        plan_err("cat", &[ta(), Some(TensorRef::new(&c, &[2, 3]).unwrap())], &[], out_view(&mut out[..10], &[5, 2]));
    assert_eq!(e.code(), ErrorCode::Shape);
    assert!(e.message().contains("tensors[1]") && e.message().contains("[2, 3]"), "{e}");
    let e = plan_err("cat", &[ta(), ta()], &[("dim", 2i64.into())], out_view(&mut out[..8], &[4, 2]));
    assert_eq!(e.code(), ErrorCode::ParamInvalid);
    assert!(e.message().contains("'dim'") && e.message().contains("[-2, 2)") && e.message().contains("got 2"), "{e}");
}

#[test]
fn cat_backward_splits_a_strided_gradient_back_to_each_joined_tensor() {
    setup();
    // dout [2, 3] read transposed from [3, 2] storage; split along dim 1 into widths 2 and 1.
    let d = [1.0f32, 4.0, 2.0, 5.0, 3.0, 6.0];
    let dout = TensorRef::strided(&d, &[2, 3], &[1, 2], 0).unwrap();
    let (a, b) = ([0f32; 4], [0f32; 2]);
    let parts = [TensorRef::new(&a, &[2, 2]).unwrap(), TensorRef::new(&b, &[2, 1]).unwrap()];
    let grads = run_checked(
        "cat_backward",
        &[Some(dout.clone()), Some(parts[0].clone()), Some(parts[1].clone())],
        &[("dim", (-1i64).into())],
    );
    assert_eq!(grads, [vec![1.0, 2.0, 4.0, 5.0], vec![3.0, 6.0]]);
    // Along dim 0: rows 0 and 1 of dout, each [1, 3].
    let row = [0f32; 3];
    let rows = [TensorRef::new(&row, &[1, 3]).unwrap(), TensorRef::new(&row, &[1, 3]).unwrap()];
    let grads = run_checked("cat_backward", &[Some(dout), Some(rows[0].clone()), Some(rows[1].clone())], &[]);
    assert_eq!(grads, [vec![1.0, 2.0, 3.0], vec![4.0, 5.0, 6.0]]);
}

#[test]
fn cat_backward_rejects_a_gradient_unlike_the_join() {
    setup();
    let (a, d) = ([0f32; 4], [0f32; 8]);
    let d16 = [bf16::ONE; 8];
    let ta = || Some(TensorRef::new(&a, &[2, 2]).unwrap());
    let mut g = [0f32; 8];
    fn outs(g: &mut [f32; 8], n: usize) -> Vec<TensorMut<'_>> {
        g.chunks_mut(4).take(n).map(|c| TensorMut::new(c, &[2, 2]).unwrap()).collect()
    }
    let e = plan_err("cat_backward", &[Some(TensorRef::new(&d, &[2, 4]).unwrap()), ta(), ta()], &[], outs(&mut g, 2));
    assert_eq!(e.code(), ErrorCode::Shape);
    assert!(e.message().contains("'dout'") && e.message().contains("[4, 2]") && e.message().contains("[2, 4]"), "{e}");
    let e = plan_err("cat_backward", &[Some(TensorRef::new(&d16, &[4, 2]).unwrap()), ta(), ta()], &[], outs(&mut g, 2));
    assert_eq!(e.code(), ErrorCode::DType);
    assert!(e.message().contains("'dout'") && e.message().contains("bfloat16"), "{e}");
    // One output short of the two tensors joined.
    let e = plan_err("cat_backward", &[Some(TensorRef::new(&d, &[4, 2]).unwrap()), ta(), ta()], &[], outs(&mut g, 1));
    assert_eq!(e.code(), ErrorCode::ParamInvalid);
    assert!(e.message().contains("expected 2 outputs, got 1"), "{e}");
}

#[test]
fn permute_reorders_dims_of_any_layout_and_rejects_non_permutations() {
    setup();
    // x[b, s, h] = 100b + 10s + h, shape [2, 3, 4]; out[b, h, s] must equal it.
    let x: Vec<f32> = (0..24).map(|i| (100 * (i / 12) + 10 * (i / 4 % 3) + i % 4) as f32).collect();
    let tx = TensorRef::new(&x, &[2, 3, 4]).unwrap();
    let out = run_checked("permute", &[Some(tx.clone())], &[("dims", AttrValue::Ints(vec![0, -1, 1]))]);
    for (i, v) in out[0].iter().enumerate() {
        let (b, h, s) = (i / 12, i / 3 % 4, i % 3);
        assert_eq!(*v, (100 * b + 10 * s + h) as f64, "out[{b}, {h}, {s}]");
    }
    // A strided (transposed) input: permuting it back gives x.
    let xt = TensorRef::strided(&x, &[2, 4, 3], &[12, 1, 4], 0).unwrap();
    let back = run_checked("permute", &[Some(xt)], &[("dims", AttrValue::Ints(vec![0, 2, 1]))]);
    assert!(back[0].iter().zip(&x).all(|(a, b)| *a == *b as f64));

    // The backward permutes back: permute_backward(permute(x, dims), dims) == x.
    let out_f32: Vec<f32> = out[0].iter().map(|&v| v as f32).collect();
    let dout = TensorRef::new(&out_f32, &[2, 4, 3]).unwrap();
    let dx = run_checked("permute_backward", &[Some(dout)], &[("dims", AttrValue::Ints(vec![0, -1, 1]))]);
    assert!(dx[0].iter().zip(&x).all(|(a, b)| *a == *b as f64));

    let mut y = [0f32; 24];
    for bad in [vec![0, 1], vec![0, 1, 1], vec![0, 1, 3], vec![0, 1, -4]] {
        let e = plan_err(
            "permute",
            &[Some(tx.clone())],
            &[("dims", AttrValue::Ints(bad.clone()))],
            vec![TensorMut::new(&mut y, &[2, 3, 4]).unwrap()],
        );
        assert_eq!(e.code(), ErrorCode::ParamInvalid);
        assert!(e.message().contains("'dims'") && e.message().contains(&format!("{bad:?}")), "{e}");
    }
}

/// `batch_dims` leaves the leading dims in place and permutes the rest: `dims` then counts from the
/// first dim after the batch (negative ones from the end, as before); the backward undoes it; a
/// `dims` of the wrong length or a `batch_dims` past the rank is refused, naming both.
#[test]
fn permute_leaves_batch_dims_in_place() {
    setup();
    // x[a, b, s, h] = 1000a + 100b + 10s + h, shape [2, 2, 3, 4]; with batch_dims 2 and dims
    // [1, 0] (or [-1, 0]) out[a, b, h, s] must equal it.
    let x: Vec<f32> =
        (0..48).map(|i| (1000 * (i / 24) + 100 * (i / 12 % 2) + 10 * (i / 4 % 3) + i % 4) as f32).collect();
    let tx = TensorRef::new(&x, &[2, 2, 3, 4]).unwrap();
    for dims in [vec![1, 0], vec![-1, 0]] {
        let attrs = [("dims", AttrValue::Ints(dims)), ("batch_dims", AttrValue::Int(2))];
        let out = run_checked("permute", &[Some(tx.clone())], &attrs);
        for (i, v) in out[0].iter().enumerate() {
            let (a, b, h, s) = (i / 24, i / 12 % 2, i / 3 % 4, i % 3);
            assert_eq!(*v, (1000 * a + 100 * b + 10 * s + h) as f64, "out[{a}, {b}, {h}, {s}]");
        }
        let out_f32: Vec<f32> = out[0].iter().map(|&v| v as f32).collect();
        let dout = TensorRef::new(&out_f32, &[2, 2, 4, 3]).unwrap();
        let dx = run_checked("permute_backward", &[Some(dout)], &attrs);
        assert!(dx[0].iter().zip(&x).all(|(a, b)| *a == *b as f64), "permute_backward undoes permute");
    }
    // batch_dims 1 is the same permutation as dims [0, 1 + d..] with no batch.
    let batched = run_checked(
        "permute",
        &[Some(tx.clone())],
        &[("dims", AttrValue::Ints(vec![2, 0, 1])), ("batch_dims", AttrValue::Int(1))],
    );
    let whole = run_checked("permute", &[Some(tx.clone())], &[("dims", AttrValue::Ints(vec![0, 3, 1, 2]))]);
    assert_eq!(batched, whole);

    let mut y = [0f32; 48];
    for (dims, batch_dims, what) in [
        (vec![0, 1, 2], 2, "a permutation of the 2 dims of x after its 2 batch dims"),
        (vec![1, 0], 5, "0 to 4"),
        (vec![1, 0], -1, "0 to 4"),
    ] {
        let e = plan_err(
            "permute",
            &[Some(tx.clone())],
            &[("dims", AttrValue::Ints(dims)), ("batch_dims", AttrValue::Int(batch_dims))],
            vec![TensorMut::new(&mut y, &[2, 2, 3, 4]).unwrap()],
        );
        assert_eq!(e.code(), ErrorCode::ParamInvalid);
        assert!(e.message().contains(what), "{e}");
    }
}

/// Permutes that keep the last dim in place copy whole rows in tiles (`permute::RowTiles`): tiles
/// cut ragged at both sides' ends, several outer dims, a padded (strided) input, bf16 rows, and
/// the backward undoing each, all element for element.
#[test]
fn permute_copies_rows_in_ragged_tiles_from_any_layout() {
    setup();
    // x[i0, i1, i2, i3, i4] over [2, 130, 3, 67, 16], permuted by [0, 3, 2, 1, 4]: the output's
    // rows step along x's dim 1 (130: tiles of 64, 64, 2) and its neighbours in x along dim 3
    // (67: 64, 3).
    let shape = [2, 130, 3, 67, 16];
    let dims = vec![0, 3, 2, 1, -1];
    let numel: usize = shape.iter().product();
    let x: Vec<f32> = (0..numel).map(|i| i as f32).collect();
    let contiguous = TensorRef::new(&x[..numel], &shape).unwrap();
    // The same values at padded strides (each dim-1 row set 20 elements apart beyond its 3216).
    let row = 3 * 67 * 16 + 20;
    let mut padded = vec![-1f32; 2 * 130 * row];
    for (i, v) in x.iter().enumerate() {
        padded[i / (3 * 67 * 16) * row + i % (3 * 67 * 16)] = *v;
    }
    let strided = TensorRef::strided(&padded, &shape, &[130 * row, row, 67 * 16, 16, 1], 0).unwrap();
    let attrs = [("dims", AttrValue::Ints(dims.clone()))];
    for input in [contiguous, strided] {
        let out = run_checked("permute", &[Some(input)], &attrs);
        for (o, v) in out[0].iter().enumerate() {
            // out[i0, i3, i2, i1, i4] with out's shape [2, 67, 3, 130, 16].
            let (i4, i1, i2, i3, i0) =
                (o % 16, o / 16 % 130, o / (16 * 130) % 3, o / (16 * 130 * 3) % 67, o / (16 * 130 * 3 * 67));
            let want = (((i0 * 130 + i1) * 3 + i2) * 67 + i3) * 16 + i4;
            assert_eq!(*v, want as f64, "out[{i0}, {i3}, {i2}, {i1}, {i4}]");
        }
        let out_f32: Vec<f32> = out[0].iter().map(|&v| v as f32).collect();
        let dout = TensorRef::new(&out_f32, &[2, 67, 3, 130, 16]).unwrap();
        let dx = run_checked("permute_backward", &[Some(dout)], &attrs);
        assert!(dx[0].iter().zip(&x).all(|(a, b)| *a == *b as f64), "permute_backward undoes permute");
    }
    // bf16 rows of 5 (10 bytes: tiles of 64 rows), HF's [B, S, H, D] -> [B, H, S, D].
    let xb: Vec<bf16> = (0..3 * 100 * 7 * 5).map(|i| bf16::from_f32((i % 251) as f32)).collect();
    let tb = TensorRef::new(&xb, &[3, 100, 7, 5]).unwrap();
    let out = run_checked("permute", &[Some(tb)], &[("dims", AttrValue::Ints(vec![0, 2, 1, 3]))]);
    for (o, v) in out[0].iter().enumerate() {
        let (d, s, h, b) = (o % 5, o / 5 % 100, o / 500 % 7, o / 3500);
        assert_eq!(*v, xb[((b * 100 + s) * 7 + h) * 5 + d].to_f64(), "out[{b}, {h}, {s}, {d}]");
    }
}

/// A float64 call runs the op's f64 reference: exact to f64 rounding (here silu against its
/// closed form), with f64 outputs. Mixing f64 with another floating dtype is not such a call and
/// gets the op's usual dtype error.
#[test]
fn float64_calls_run_the_reference_and_mixed_ones_are_refused() {
    setup();
    let x: Vec<f64> = (0..37).map(|i| (i as f64 - 18.0) * 0.37).collect();
    let mut y = vec![0f64; 37];
    uniop::call("silu", &[Some(TensorRef::new(&x, &[37]).unwrap())], &[], vec![TensorMut::new(&mut y, &[37]).unwrap()])
        .unwrap();
    for (&xi, &yi) in x.iter().zip(&y) {
        let want = xi / (1.0 + (-xi).exp());
        assert!((yi - want).abs() <= 1e-15 * want.abs().max(1.0), "silu({xi}) = {yi}, want {want}");
    }
    let w = [1f32; 37];
    let (mut out, mut rstd) = (vec![0f64; 37], [0f64; 1]);
    let err = plan_err(
        "rms_norm",
        &[Some(TensorRef::new(&x, &[1, 37]).unwrap()), Some(TensorRef::new(&w, &[37]).unwrap())],
        &[],
        vec![TensorMut::new(&mut out, &[1, 37]).unwrap(), TensorMut::new(&mut rstd, &[1, 1]).unwrap()],
    );
    assert_eq!(err.code(), ErrorCode::DType);
    assert!(
        err.message().contains("argument 'x': expected dtype in {float32, float16, bfloat16}, got float64"),
        "{err}"
    );
}

/// silu's and gelu's gradients over inputs far into the tails (|x| up to 100, where sigmoid and
/// φ are taken as 0 to keep the products off subnormal numbers) against their f64 references,
/// in f32 and bf16.
#[test]
fn activation_gradients_hold_far_into_the_tails() {
    setup();
    let n = 4096;
    let wide: Vec<f32> = rand_vec(n, 171).iter().map(|v| 200.0 * v).collect();
    let (d, u) = (rand_vec(n, 172), rand_vec(n, 173));
    assert!(wide.iter().any(|&x| x < -90.0) && wide.iter().any(|&x| x > 90.0));
    fn check<T: uniop::Element>(wide: &[f32], d: &[f32], u: &[f32], cast: impl Fn(f32) -> T) {
        let [wide, d, u] = [wide, d, u].map(|v| v.iter().map(|&x| cast(x)).collect::<Vec<T>>());
        fn view<T: uniop::Element>(v: &[T]) -> Option<TensorRef<'_>> {
            Some(TensorRef::new(v, &[v.len()]).unwrap())
        }
        run_checked("silu_mul_backward", &[view(&d), view(&wide), view(&u)], &[]);
        for approximate in ["none", "tanh"] {
            run_checked(
                "gelu_backward",
                &[view(&d), view(&wide)],
                &[("approximate", AttrValue::Str(approximate.into()))],
            );
        }
    }
    check(&wide, &d, &u, |v| v);
    check(&wide, &d, &u, bf16::from_f32);
}

/// `pack_weight` then the packed forms give what `linear`, `linear_add` and `linear_silu_mul`
/// give, in bf16 bit for bit (the same panels reach the same micro-kernel), each also checked
/// against its f64 reference by `run_checked`: a strided (transposed) weight, in_features odd (a padded
/// word), out_features not a multiple of a panel, x with two leading dims.
fn packed_forms_match_the_plain_ops<T: uniop::Element>() {
    let (rows, k, n) = (100, 45, 70);
    let values =
        |len: usize, seed: u64| -> Vec<T> { rand_vec(len, seed).into_iter().map(|v| T::from_f64(v as f64)).collect() };
    let (x, residual, bias) = (values(rows * k, 1), values(rows * n, 2), values(n, 3));
    // The weight as a transposed view of a [k, n] buffer; up_weight dense.
    let (w_t, up) = (values(k * n, 4), values(n * k, 5));
    let weight = TensorRef::strided(&w_t, &[n, k], &[1, n], 0).unwrap();
    let up = TensorRef::new(&up, &[n, k]).unwrap();
    let x = TensorRef::new(&x, &[2, rows / 2, k]).unwrap();
    let (residual, bias) =
        (TensorRef::new(&residual, &[2, rows / 2, n]).unwrap(), TensorRef::new(&bias, &[n]).unwrap());
    let pack = |inputs: &[Option<TensorRef>]| -> (Vec<T>, Vec<usize>) {
        let entry = Registry::global().get("pack_weight").unwrap();
        let shape = infer(&entry, inputs, &[]).unwrap()[0].shape().to_vec();
        let words = run_checked("pack_weight", inputs, &[]).remove(0);
        (words.into_iter().map(T::from_f64).collect(), shape)
    };
    let (single, single_shape) = pack(&[Some(weight.clone()), None]);
    let (pair, pair_shape) = pack(&[Some(weight.clone()), Some(up.clone())]);
    let single = TensorRef::new(&single, &single_shape).unwrap();
    let pair = TensorRef::new(&pair, &pair_shape).unwrap();
    let n_attr = [("out_features", AttrValue::Int(n as i64))];
    let cases = [
        (
            "linear",
            vec![Some(x.clone()), Some(weight.clone()), Some(bias.clone())],
            "linear_packed",
            vec![Some(x.clone()), Some(single.clone()), Some(bias)],
        ),
        (
            "linear_add",
            vec![Some(x.clone()), Some(weight.clone()), Some(residual.clone())],
            "linear_add_packed",
            vec![Some(x.clone()), Some(single), Some(residual)],
        ),
        (
            "linear_silu_mul",
            vec![Some(x.clone()), Some(weight), Some(up)],
            "linear_silu_mul_packed",
            vec![Some(x), Some(pair)],
        ),
    ];
    for (plain, plain_inputs, packed, packed_inputs) in cases {
        let want = run_checked(plain, &plain_inputs, &[]);
        let got = run_checked(packed, &packed_inputs, &n_attr);
        // The plain f32 products take the `gemm` crate (B row-major: the weight is a transposed view):
        // equal to the reference, not bit for bit to the packed kernel.
        if T::DTYPE == DType::BF16 {
            assert_eq!(got[0], want[0], "{packed} {:?} against {plain}", T::DTYPE);
        }
    }
}

#[test]
fn packed_weights_give_the_plain_ops_results_and_refuse_mismatches() {
    setup();
    packed_forms_match_the_plain_ops::<bf16>();
    packed_forms_match_the_plain_ops::<f32>();

    let x = vec![bf16::ZERO; 4 * 45];
    let x = TensorRef::new(&x, &[4, 45]).unwrap();
    let packed = vec![bf16::ZERO; 3 * 23 * 32 * 2];
    let packed = TensorRef::new(&packed, &[3, 23, 32, 2]).unwrap();
    let with_n = |n: i64| [("out_features", AttrValue::Int(n))];
    // 70 outputs fill 3 panels of 32; 100 need 4. A pair of 70 needs 5 panels of 16 of each.
    let err = plan_err("linear_packed", &[Some(x.clone()), Some(packed.clone()), None], &with_n(100), vec![]);
    assert_eq!(err.code(), ErrorCode::Shape);
    assert_eq!(
        err.message(),
        "linear_packed: argument 'packed_weight': expected shape [4, 23, 32, 2] (pack_weight of a [out_features, \
         in_features] weight, out_features 100, x [4, 45]), got shape [3, 23, 32, 2]"
    );
    let err = plan_err("linear_silu_mul_packed", &[Some(x.clone()), Some(packed.clone())], &with_n(70), vec![]);
    assert!(err.message().contains("expected shape [5, 23, 32, 2] (pack_weight of a pair of"), "{err}");
    let err = plan_err("linear_packed", &[Some(x.clone()), Some(packed.clone()), None], &with_n(-1), vec![]);
    assert_eq!(err.code(), ErrorCode::ParamInvalid);
    assert_eq!(err.message(), "linear_packed: argument 'out_features': expected out_features >= 0, got -1");
    let residual = vec![bf16::ZERO; 4 * 69];
    let residual = TensorRef::new(&residual, &[4, 69]).unwrap();
    let err = plan_err("linear_add_packed", &[Some(x), Some(packed), Some(residual)], &with_n(70), vec![]);
    assert_eq!(err.message(), "linear_add_packed: argument 'residual': expected shape [4, 70], got shape [4, 69]");
    let halves = vec![uniop::half::f16::ZERO; 6];
    let err = plan_err("pack_weight", &[Some(TensorRef::new(&halves, &[2, 3]).unwrap()), None], &[], vec![]);
    assert_eq!(err.message(), "pack_weight: argument 'weight': expected dtype in {bfloat16, float32}, got float16");
    let (w, up) = (vec![0f32; 6], vec![0f32; 6]);
    let (w, up) = (TensorRef::new(&w, &[2, 3]).unwrap(), TensorRef::new(&up, &[3, 2]).unwrap());
    let err = plan_err("pack_weight", &[Some(w), Some(up)], &[], vec![]);
    assert_eq!(err.message(), "pack_weight: argument 'up_weight': expected shape [2, 3], got shape [3, 2]");
}

// ---------------------------------------------------------------- layer_norm

/// layer_norm_backward's dx, dweight and dbias against central finite differences of the
/// forward's f64 reference (an independent check of the formulas), with the kernel's mean and
/// rstd fed through as autograd does.
#[test]
fn layer_norm_backward_matches_finite_differences() {
    setup();
    let (rows, cols) = (3, 70);
    let (x, w, b, dy) = (rand_vec(rows * cols, 11), rand_vec(cols, 12), rand_vec(cols, 13), rand_vec(rows * cols, 14));
    let (tx, tw, tb) = (
        TensorRef::new(&x, &[rows, cols]).unwrap(),
        TensorRef::new(&w, &[cols]).unwrap(),
        TensorRef::new(&b, &[cols]).unwrap(),
    );
    let fwd = run_checked("layer_norm", &[Some(tx.clone()), Some(tw.clone()), Some(tb)], &[]);
    let [mean, rstd] = [&fwd[1], &fwd[2]].map(|v| v.iter().map(|&v| v as f32).collect::<Vec<_>>());
    let grads = run_checked(
        "layer_norm_backward",
        &[
            Some(TensorRef::new(&dy, &[rows, cols]).unwrap()),
            Some(tx),
            Some(tw),
            Some(TensorRef::new(&mean, &[rows, 1]).unwrap()),
            Some(TensorRef::new(&rstd, &[rows, 1]).unwrap()),
        ],
        &[],
    );
    let f64s = |v: &[f32]| v.iter().map(|&v| v as f64).collect::<Vec<_>>();
    let inputs = [(f64s(&x), vec![rows, cols]), (f64s(&w), vec![cols]), (f64s(&b), vec![cols])];
    for (wrt, got) in grads.iter().enumerate() {
        let want = finite_difference("layer_norm", &inputs, &[], &f64s(&dy), wrt);
        for (i, (g, n)) in got.iter().zip(&want).enumerate() {
            assert!((g - n).abs() <= 1e-3 * (1.0 + n.abs()), "gradient {wrt} [{i}]: {g} against {n}");
        }
    }
}

/// Rows of f32 activations around 1000 with a spread of 1: the variance is summed around the
/// mean, so rstd keeps f32's precision (Σx²/n − mean² would lose about 0.1 of a variance of 1
/// here), and y is off by what f32's mean carries (ulp(1000)/2 · rstd: relative to the reference's
/// y near 0 that is large, which is why this test judges y by its absolute error).
#[test]
fn layer_norm_keeps_precision_under_a_large_offset() {
    setup();
    let (rows, cols) = (4, 4096);
    let x: Vec<f32> = rand_vec(rows * cols, 21).iter().map(|v| 1000.0 + 3.4 * (v - 0.5)).collect();
    let w = vec![1f32; cols];
    let out = run_unchecked(
        "layer_norm",
        &[Some(TensorRef::new(&x, &[rows, cols]).unwrap()), Some(TensorRef::new(&w, &[cols]).unwrap())],
        &[],
    );
    for r in 0..rows {
        let row: Vec<f64> = x[r * cols..(r + 1) * cols].iter().map(|&v| v as f64).collect();
        let mean = row.iter().sum::<f64>() / cols as f64;
        let rstd = 1.0 / (row.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / cols as f64 + 1e-5).sqrt();
        assert!((out[2][r] - rstd).abs() < 1e-4 * rstd, "row {r}: rstd {} against {rstd}", out[2][r]);
        for c in 0..cols {
            let want = (row[c] - mean) * rstd;
            assert!(
                (out[0][r * cols + c] - want).abs() < 2e-4,
                "y[{r}, {c}] = {} against {want}",
                out[0][r * cols + c]
            );
        }
    }
}

#[test]
fn layer_norm_bad_inputs_name_the_argument() {
    setup();
    let (x, w4, w3) = ([0f32; 8], [0f32; 4], [0f32; 3]);
    let b16 = [uniop::half::bf16::ZERO; 4];
    let (mean, mean_wide) = ([0f32; 2], [0f32; 8]);
    let tx = || Some(TensorRef::new(&x, &[2, 4]).unwrap());
    let tw = || Some(TensorRef::new(&w4, &[4]).unwrap());
    let cases: Vec<(uniop::Error, ErrorCode, &str)> = vec![
        (
            plan_err("layer_norm", &[tx(), tw(), Some(TensorRef::new(&w3, &[3]).unwrap())], &[], vec![]),
            ErrorCode::Shape,
            "layer_norm: argument 'bias': expected shape [4], got shape [3]",
        ),
        (
            plan_err("layer_norm", &[tx(), tw(), Some(TensorRef::new(&b16, &[4]).unwrap())], &[], vec![]),
            ErrorCode::DType,
            "layer_norm: argument 'bias': expected dtype float32 (same as 'weight'), got bfloat16",
        ),
        (
            plan_err("layer_norm", &[tx(), Some(TensorRef::new(&w3, &[3]).unwrap()), None], &[], vec![]),
            ErrorCode::Shape,
            "layer_norm: argument 'weight': expected a non-empty shape equal to trailing dims of x [2, 4], got [3]",
        ),
        (
            plan_err(
                "layer_norm_backward",
                &[
                    tx(),
                    tx(),
                    tw(),
                    Some(TensorRef::new(&mean_wide, &[2, 4]).unwrap()),
                    Some(TensorRef::new(&mean, &[2, 1]).unwrap()),
                ],
                &[],
                vec![],
            ),
            ErrorCode::Shape,
            "layer_norm_backward: argument 'mean': expected shape [2, 1], got shape [2, 4]",
        ),
    ];
    for (err, code, message) in cases {
        assert_eq!(err.code(), code, "{err}");
        assert_eq!(err.message(), message);
    }
}

/// linear_int8 against the f64 reference on both routes (dot products up to 32 rows, the
/// dequantized GEMM past them), with and without a bias, scales in float32 and in x's dtype, k
/// and n off the kernels' steps (k 37: a tail of 5 past the 8-wide steps; n 7: a short group of
/// four weight rows) — and against `linear` on the dequantized weight; then its bad input.
#[test]
fn linear_int8_is_a_linear_on_the_dequantized_weight() {
    setup();
    let to_bf16 = |v: &[f32]| v.iter().map(|&v| bf16::from_f32(v)).collect::<Vec<_>>();
    for (rows, k, n) in [(1, 64, 70), (2, 37, 7), (5, 37, 70), (33, 64, 70), (70, 37, 7)] {
        let x = rand_vec(rows * k, 1);
        let w: Vec<i8> = (0..n * k).map(|i| ((i * 37 + 11) % 255) as i8).collect();
        let scales: Vec<f32> = rand_vec(n, 2).iter().map(|v| 0.01 + 0.005 * v).collect();
        let bias = rand_vec(n, 3);
        let (tx, tw) = (TensorRef::new(&x, &[rows, k]).unwrap(), TensorRef::new(&w, &[n, k]).unwrap());
        let (ts, tb) = (TensorRef::new(&scales, &[n]).unwrap(), TensorRef::new(&bias, &[n]).unwrap());
        let with_bias =
            run_checked("linear_int8", &[Some(tx.clone()), Some(tw.clone()), Some(ts.clone()), Some(tb.clone())], &[]);
        run_checked("linear_int8", &[Some(tx.clone()), Some(tw.clone()), Some(ts.clone())], &[]);
        let dequantized: Vec<f32> = w.iter().enumerate().map(|(i, &q)| q as f32 * scales[i / k]).collect();
        let td = TensorRef::new(&dequantized, &[n, k]).unwrap();
        let linear = run_checked("linear", &[Some(tx.clone()), Some(td), Some(tb.clone())], &[]);
        for (i, (a, b)) in with_bias[0].iter().zip(&linear[0]).enumerate() {
            assert!((a - b).abs() <= 1e-5 * (1.0 + b.abs()), "{rows}x{k}x{n} element {i}: {a} vs {b}");
        }
        let (xb, sb, bb) = (to_bf16(&x), to_bf16(&scales), to_bf16(&bias));
        let txb = TensorRef::new(&xb, &[rows, k]).unwrap();
        let (tsb, tbb) = (TensorRef::new(&sb, &[n]).unwrap(), TensorRef::new(&bb, &[n]).unwrap());
        run_checked("linear_int8", &[Some(txb.clone()), Some(tw.clone()), Some(tsb), Some(tbb.clone())], &[]);
        run_checked("linear_int8", &[Some(txb), Some(tw.clone()), Some(ts.clone()), Some(tbb)], &[]);
    }

    let (x, w, s) = (vec![0.5f32; 2 * 8], vec![1i8; 3 * 8], vec![0.1f32; 3]);
    let (wf, s16) = (vec![1f32; 3 * 8], vec![uniop::half::f16::from_f32(0.1); 3]);
    let tx = TensorRef::new(&x, &[2, 8]).unwrap();
    let mut y = [0f32; 6];
    let wrong = [
        (
            TensorRef::new(&wf, &[3, 8]).unwrap(),
            TensorRef::new(&s, &[3]).unwrap(),
            "argument 'weight': expected dtype in {int8}",
        ),
        (
            TensorRef::new(&w, &[4, 6]).unwrap(),
            TensorRef::new(&s[..], &[3]).unwrap(),
            "argument 'weight': expected shape [out_features, 8]",
        ),
        (
            TensorRef::new(&w, &[3, 8]).unwrap(),
            TensorRef::new(&s[..2], &[2]).unwrap(),
            "argument 'scales': expected shape [3]",
        ),
        (
            TensorRef::new(&w, &[3, 8]).unwrap(),
            TensorRef::new(&s16, &[3]).unwrap(),
            "argument 'scales': expected dtype in {float32}",
        ),
    ];
    for (tw, ts, want) in wrong {
        let e = plan_err(
            "linear_int8",
            &[Some(tx.clone()), Some(tw), Some(ts)],
            &[],
            vec![TensorMut::new(&mut y, &[2, 3]).unwrap()],
        );
        assert!(e.message().starts_with(&format!("linear_int8: {want}")), "{e}");
    }
}

/// linear_int8's gradients through both dx routes (1 and 3 rows: f32 sums, one tile and two; 5, 33
/// and 40: the dequantized GEMM, one slab and two): each checked against the f64 reference, dx and dbias
/// against `linear_backward` on the dequantized weight, dscales against the forward with unit
/// scales (`Σ_rows dy · (x · w)`); bf16 with scales in f32 and in bf16; per sample (`batch_dims`)
/// as separate calls; gradients not asked for left out; bad input named.
#[test]
fn linear_int8_backward_is_linear_backward_on_the_dequantized_weight() {
    setup();
    let to_bf16 = |v: &[f32]| v.iter().map(|&v| bf16::from_f32(v)).collect::<Vec<_>>();
    for (rows, k, n) in [(1, 64, 70), (5, 37, 7), (3, 2100, 5), (33, 64, 70), (40, 300, 8192)] {
        let (x, dy) = (rand_vec(rows * k, 11), rand_vec(rows * n, 12));
        let w: Vec<i8> = (0..n * k).map(|i| ((i * 37 + 11) % 255) as i8).collect();
        let scales: Vec<f32> = rand_vec(n, 13).iter().map(|v| 0.01 + 0.005 * v).collect();
        let (tx, tdy) = (TensorRef::new(&x, &[rows, k]).unwrap(), TensorRef::new(&dy, &[rows, n]).unwrap());
        let (tw, ts) = (TensorRef::new(&w, &[n, k]).unwrap(), TensorRef::new(&scales, &[n]).unwrap());
        let grads = run_checked(
            "linear_int8_backward",
            &[Some(tdy.clone()), Some(tx.clone()), Some(tw.clone()), Some(ts.clone())],
            &[],
        );
        let what = |g: &str| format!("{g} of [{rows}, {k}] by [{n}, {k}]");
        let dequantized: Vec<f32> = w.iter().enumerate().map(|(i, &q)| q as f32 * scales[i / k]).collect();
        let dense = run_checked(
            "linear_backward",
            &[Some(tdy.clone()), Some(tx.clone()), Some(TensorRef::new(&dequantized, &[n, k]).unwrap())],
            &[("needs_dweight", AttrValue::Bool(false))],
        );
        assert_close(&grads[0], &dense[0], &what("dx"));
        assert_close(&grads[2], &dense[2], &what("dbias"));
        let ones = vec![1f32; n];
        let products = run_checked(
            "linear_int8",
            &[Some(tx.clone()), Some(tw.clone()), Some(TensorRef::new(&ones, &[n]).unwrap())],
            &[],
        );
        // Sums of rows · k terms that cancel: the f32 error is judged against their magnitude.
        for j in 0..n {
            let want: f64 = (0..rows).map(|r| dy[r * n + j] as f64 * products[0][r * n + j]).sum();
            let magnitude: f64 = (0..rows)
                .map(|r| {
                    (dy[r * n + j] as f64).abs()
                        * (0..k).map(|p| (x[r * k + p] * w[j * k + p] as f32).abs() as f64).sum::<f64>()
                })
                .sum();
            let got = grads[1][j];
            assert!((got - want).abs() <= 1e-5 * magnitude, "{} {j}: {got} vs {want}", what("dscales"));
        }

        let (xb, dyb, sb) = (to_bf16(&x), to_bf16(&dy), to_bf16(&scales));
        let (txb, tdyb) = (TensorRef::new(&xb, &[rows, k]).unwrap(), TensorRef::new(&dyb, &[rows, n]).unwrap());
        run_checked("linear_int8_backward", &[Some(tdyb.clone()), Some(txb.clone()), Some(tw.clone()), Some(ts)], &[]);
        run_checked(
            "linear_int8_backward",
            &[Some(tdyb), Some(txb), Some(tw), Some(TensorRef::new(&sb, &[n]).unwrap())],
            &[],
        );
    }

    // Two samples of three rows: dscales and dbias per sample equal each sample's own call; each
    // gradient not asked for comes back empty, the others as in the full call.
    let (k, n) = (37, 7);
    let (x, dy) = (rand_vec(6 * k, 14), rand_vec(6 * n, 15));
    let w: Vec<i8> = (0..n * k).map(|i| ((i * 53 + 5) % 255) as i8).collect();
    let scales = vec![0.02f32; n];
    let (tw, ts) = (TensorRef::new(&w, &[n, k]).unwrap(), TensorRef::new(&scales, &[n]).unwrap());
    let call = |x: &[f32], dy: &[f32], shape: &[usize], attrs: &[(&str, AttrValue)]| {
        let (mut xs, mut dys) = (shape.to_vec(), shape.to_vec());
        xs.push(k);
        dys.push(n);
        let (tx, tdy) = (TensorRef::new(x, &xs).unwrap(), TensorRef::new(dy, &dys).unwrap());
        run_checked("linear_int8_backward", &[Some(tdy), Some(tx), Some(tw.clone()), Some(ts.clone())], attrs)
    };
    let per_sample = call(&x, &dy, &[2, 3], &[("batch_dims", AttrValue::Int(1))]);
    for s in 0..2 {
        let alone = call(&x[s * 3 * k..(s + 1) * 3 * k], &dy[s * 3 * n..(s + 1) * 3 * n], &[3], &[]);
        assert_eq!(&per_sample[1][s * n..(s + 1) * n], &alone[1][..], "dscales of sample {s}");
        assert_eq!(&per_sample[2][s * n..(s + 1) * n], &alone[2][..], "dbias of sample {s}");
    }
    let full = call(&x, &dy, &[6], &[]);
    for (needs_dx, needs_dscales) in [(false, true), (true, false), (false, false)] {
        let attrs = [("needs_dx", AttrValue::Bool(needs_dx)), ("needs_dscales", AttrValue::Bool(needs_dscales))];
        let lean = call(&x, &dy, &[6], &attrs);
        let empty: &[f64] = &[];
        assert_eq!(lean[0], if needs_dx { &full[0][..] } else { empty }, "dx, needs_dx {needs_dx}");
        assert_eq!(lean[1], if needs_dscales { &full[1][..] } else { empty }, "dscales, needs {needs_dscales}");
        assert_eq!(lean[2], full[2], "dbias");
    }

    let (x, w, s, dy) = (vec![0.5f32; 2 * 8], vec![1i8; 3 * 8], vec![0.1f32; 3], vec![1f32; 2 * 4]);
    let dyh = vec![uniop::half::f16::from_f32(1.0); 2 * 3];
    let (tx, tw, ts) =
        (TensorRef::new(&x, &[2, 8]).unwrap(), TensorRef::new(&w, &[3, 8]).unwrap(), TensorRef::new(&s, &[3]).unwrap());
    let wrong = [
        (TensorRef::new(&dy, &[2, 4]).unwrap(), vec![], "argument 'dy': expected shape [2, 3]"),
        (TensorRef::new(&dyh, &[2, 3]).unwrap(), vec![], "argument 'dy': expected dtype float32"),
        (TensorRef::new(&dy[..6], &[2, 3]).unwrap(), vec![("batch_dims", AttrValue::Int(2))], "argument 'batch_dims'"),
    ];
    for (tdy, attrs, want) in wrong {
        let (mut dx, mut ds, mut db) = ([0f32; 16], [0f32; 3], [0f32; 3]);
        let outs = vec![
            TensorMut::new(&mut dx, &[2, 8]).unwrap(),
            TensorMut::new(&mut ds, &[3]).unwrap(),
            TensorMut::new(&mut db, &[3]).unwrap(),
        ];
        let e = plan_err(
            "linear_int8_backward",
            &[Some(tdy), Some(tx.clone()), Some(tw.clone()), Some(ts.clone())],
            &attrs,
            outs,
        );
        assert!(e.message().starts_with(&format!("linear_int8_backward: {want}")), "{e}");
    }
}
