//! The `uniop` binary end to end, as a user runs it.

use std::process::{Command, Output};

fn uniop(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_uniop")).args(args).output().expect("running uniop")
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

#[test]
fn list_and_describe_come_from_the_registry() {
    let out = uniop(&["list"]);
    assert!(out.status.success());
    for op in ["add", "silu", "rms_norm", "rms_norm_backward"] {
        assert!(stdout(&out).lines().any(|l| l.starts_with(op)), "{op} missing:\n{}", stdout(&out));
    }
    let out = uniop(&["describe", "rms_norm"]);
    assert!(out.status.success());
    let text = stdout(&out);
    assert!(text.starts_with("rms_norm(Tensor x, Tensor weight, float eps=1e-6) -> (Tensor y, Tensor rstd)"), "{text}");
    assert!(text.contains("backward: rms_norm_backward"), "{text}");
    assert!(
        text.contains("batching: row by row along the leading dims of x: one call over a leading batch dim"),
        "{text}"
    );
    for (op, batching) in [
        ("add", "batching: elementwise: one call over operands given a leading batch dim"),
        ("add_rms_norm", "batching: row by row along the leading dims of x, residual"),
        (
            "rms_norm_backward",
            "batching: row by row along the leading dims of dy, x, rstd: one call over a leading batch dim, batch_dims \
             raised by one",
        ),
        (
            "matmul",
            "batching: blocks over broadcast batch dims of a (core rank 2), b (core rank 2): one call over a leading \
             batch dim",
        ),
        (
            "attention",
            "batching: row by row along the leading dims of q, k, v, kv_lens: one call over a leading batch dim\n",
        ),
        (
            "attention_backward",
            "batching: row by row along the leading dims of dout, q, k, v, out, lse, kv_lens: one call over a leading \
             batch dim, batch_dims raised by one",
        ),
        ("cat", "batching: row by row along the leading dims of tensors: one call over a leading batch dim\n"),
        (
            "permute",
            "batching: row by row along the leading dims of x: one call over a leading batch dim, batch_dims raised \
             by one",
        ),
        (
            "rope_cos_sin",
            "batching: blocks over broadcast batch dims of positions (core rank 0): one call over a leading batch dim",
        ),
        ("sample", "batching: one call per sample"),
    ] {
        let text = stdout(&uniop(&["describe", op]));
        assert!(text.contains(batching), "{text}");
    }
}

#[test]
fn run_checks_every_op_against_its_reference() {
    let out = uniop(&["run", "all", "--shape", "6x130", "--iters", "2"]);
    let text = stdout(&out);
    assert!(out.status.success(), "{text}\n{}", String::from_utf8_lossy(&out.stderr));
    // Every op at every dtype it declares.
    let expected: usize = uniop_ops::builtin_ops().iter().map(|op| op.dtypes().len()).sum();
    assert_eq!(text.matches(": PASS |").count(), expected, "{text}");
    let out = uniop(&["run", "rms_norm", "--shape", "4x4096", "--dtype", "bf16", "--attr", "eps=1e-5"]);
    assert!(out.status.success());
    assert!(stdout(&out).contains("rms_norm bfloat16 inputs (bf16[4, 4096], bf16[4096]): PASS"), "{}", stdout(&out));
}

#[test]
fn profile_summarises_the_launches_and_writes_a_trace() {
    let trace = std::env::temp_dir().join(format!("uniop-cli-trace-{}.json", std::process::id()));
    let out = uniop(&["profile", "rms_norm", "--shape", "8x512", "--iters", "3", "--trace", trace.to_str().unwrap()]);
    let text = stdout(&out);
    assert!(out.status.success(), "{text}\n{}", String::from_utf8_lossy(&out.stderr));
    // The op's launches as one row: a first call, the check's call, then warm-up and 3 timed calls.
    let row =
        text.lines().find(|l| l.starts_with("rms_norm ") && l.contains(" op ")).unwrap_or_else(|| panic!("{text}"));
    assert!(row.contains("f32[8, 512], f32[512] -> f32[8, 512], f32[8, 1]"), "{row}");
    let json = std::fs::read_to_string(&trace).unwrap();
    std::fs::remove_file(&trace).unwrap();
    let events: serde_json::Value = serde_json::from_str(&json).unwrap();
    let calls = row.split_whitespace().nth(3).unwrap().parse::<usize>().unwrap();
    let in_trace = events["traceEvents"].as_array().unwrap().iter().filter(|e| e["cat"] == "op").count();
    assert_eq!(calls, in_trace, "{row}");
    assert!(calls >= 4, "{row}");
}

#[test]
fn bad_requests_exit_2_with_the_error() {
    for (args, message) in [
        (&["run", "rms_norm", "--dtype", "int32"][..], "rms_norm: argument 'x': expected dtype in"),
        (&["run", "no_such_op"][..], "unknown op 'no_such_op'"),
        (&["run", "rms_norm", "--shape", "4xq"][..], "bad --shape '4xq'"),
        (&["run", "rms_norm", "--attr", "eps=-1"][..], "argument 'eps': expected a finite value"),
        (&["describe", "nope"][..], "unknown op 'nope'"),
    ] {
        let out = uniop(args);
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(message), "{args:?}: {err}");
    }
}

#[test]
fn demo_runs_two_streams_with_an_event_dependency() {
    let out = uniop(&["demo"]);
    let text = stdout(&out);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("(expected 50331645): OK"), "{text}");
    assert!(text.contains("event timing: produce"), "{text}");
}

/// An op library loaded with `--plugin` is listed, described and run like a built-in; a file
/// that is not one is a clear error.
#[test]
fn plugin_ops_work_like_built_ins() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let profile_dir = std::path::Path::new(env!("CARGO_BIN_EXE_uniop")).parent().unwrap().to_path_buf();
    // `cargo test` does not build cdylibs: build the example plugin with this test's profile.
    let mut cargo = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    cargo.current_dir(&root).args(["build", "-q", "-p", "uniop-plugin-example"]);
    if profile_dir.ends_with("release") {
        cargo.arg("--release");
    }
    assert!(cargo.status().unwrap().success());
    let plugin = profile_dir.join("libuniop_plugin_example.so");
    let plugin = plugin.to_str().unwrap();
    let out = uniop(&["--plugin", plugin, "list"]);
    assert!(stdout(&out).lines().any(|l| l.starts_with("squared_relu")), "{}", stdout(&out));
    let out = uniop(&["run", "squared_relu", "--dtype", "bf16", "--shape", "3x70", "--plugin", plugin]);
    assert!(out.status.success(), "{}{}", stdout(&out), String::from_utf8_lossy(&out.stderr));
    assert!(stdout(&out).contains("squared_relu bfloat16 inputs (bf16[3, 70]): PASS"), "{}", stdout(&out));
    let out = uniop(&["--plugin", "/nonexistent/lib.so", "list"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot be loaded"));
}
