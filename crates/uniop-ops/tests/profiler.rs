//! The profiler sees op launches the way a user calls them: one event per plan step with the op's
//! name, its tensors and bytes, staging copies as their own events, and nothing once stopped.
//! (Its own binary: the profiler is process-wide, and other tests' launches would mix in.)

mod common;

use common::*;
use uniop::runtime::{profiler, LaunchKind};
use uniop::{Executor, Stream, TensorMut, TensorRef};

fn rms_norm(x: TensorRef, y: TensorMut, rstd: TensorMut, stream: &Stream) {
    let w = vec![1f32; x.meta().shape()[1]];
    let mut e =
        Executor::by_name("rms_norm", &[Some(x), Some(TensorRef::new(&w, &[w.len()]).unwrap())], &[], vec![y, rstd])
            .unwrap();
    e.run(&mut vec![0u8; e.workspace_size()], stream).unwrap();
}

#[test]
fn op_launches_and_staging_copies_are_recorded() {
    setup();
    let stream = Stream::new();
    let x = rand_vec(4 * 8, 1);
    let (mut y, mut rstd, mut wide) = (vec![0f32; 32], vec![0f32; 4], vec![0f32; 32]);
    let contiguous = || TensorRef::new(&x, &[4, 8]).unwrap();
    // Before start: not recorded.
    rms_norm(
        contiguous(),
        TensorMut::new(&mut y, &[4, 8]).unwrap(),
        TensorMut::new(&mut rstd, &[4, 1]).unwrap(),
        &stream,
    );

    profiler::start().unwrap();
    for _ in 0..3 {
        rms_norm(
            contiguous(),
            TensorMut::new(&mut y, &[4, 8]).unwrap(),
            TensorMut::new(&mut rstd, &[4, 1]).unwrap(),
            &stream,
        );
    }
    // A transposed output is written through workspace and copied out.
    let strided_y = TensorMut::strided(&mut wide, &[4, 8], &[1, 4], 0).unwrap();
    rms_norm(contiguous(), strided_y, TensorMut::new(&mut rstd, &[4, 1]).unwrap(), &stream);
    stream.synchronize().unwrap();
    let profile = profiler::stop().unwrap();

    let ours: Vec<_> = profile.events().iter().filter(|e| e.stream == stream.id()).collect();
    let ops: Vec<_> = ours.iter().filter(|e| e.label.kind == LaunchKind::Op).collect();
    assert_eq!(ops.len(), 4, "{ours:#?}");
    for e in &ops {
        assert_eq!(e.label.op.as_ref(), "rms_norm");
        assert_eq!(e.label.signature.as_ref(), "f32[4, 8], f32[8] -> f32[4, 8], f32[4, 1]");
        assert_eq!(e.label.bytes, 4 * (32 + 8 + 32 + 4));
        assert!(e.end_ns >= e.start_ns && e.label.block_dim >= 1);
    }
    assert!(ops.windows(2).all(|w| w[0].end_ns <= w[1].start_ns), "launches of one stream do not overlap");
    let staged: Vec<_> = ours.iter().filter(|e| e.label.kind == LaunchKind::Staging).collect();
    assert_eq!(staged.len(), 1, "{ours:#?}");
    assert_eq!((staged[0].label.op.as_ref(), staged[0].label.step), ("rms_norm", "copy_out"));
    assert!(staged[0].start_ns >= ops[3].end_ns, "the copy out follows its op");

    let rows = profile.summary_rows();
    let row = rows.iter().find(|r| r.op.as_ref() == "rms_norm" && r.kind == LaunchKind::Op).unwrap();
    assert_eq!(row.calls, 4);
    assert!(row.min_ns <= row.max_ns && row.total_ns >= row.max_ns);
    let table = profile.summary(1);
    assert_eq!(table.lines().count(), 4, "header lines, one row, and the count of the rest:\n{table}");
    let trace: serde_json::Value = serde_json::from_str(&profile.chrome_trace()).unwrap();
    let named = trace["traceEvents"].as_array().unwrap().iter().filter(|t| t["name"] == "rms_norm").count();
    assert_eq!(named, 5);

    // Stopped: nothing more is recorded, and the profile keeps what it had.
    rms_norm(
        contiguous(),
        TensorMut::new(&mut y, &[4, 8]).unwrap(),
        TensorMut::new(&mut rstd, &[4, 1]).unwrap(),
        &stream,
    );
    profiler::start().unwrap();
    assert!(profiler::stop().unwrap().events().iter().all(|e| e.stream != stream.id()));
    assert_eq!(profile.events().iter().filter(|e| e.stream == stream.id()).count(), 5);
}
