//! Sharing an OpenMP team (`Pool::share_openmp_team`), in a process of its own: whether an OpenMP
//! runtime is loaded is process-wide state, so these checks cannot share a process with the unit
//! tests. The system's libgomp (installed with gcc) plays the part torch's plays in Python.

use std::ffi::c_int;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use uniop::runtime::pool::KernelFn;
use uniop::runtime::{launch, BlockCtx, KernelStop, Pool, Stream};

/// `omp_get_level` of the loaded libgomp: the number of enclosing parallel regions of the caller.
fn openmp_level() -> c_int {
    // SAFETY: RTLD_NOLOAD only looks libgomp up; omp_get_level takes nothing.
    unsafe {
        let handle = libc::dlopen(c"libgomp.so.1".as_ptr(), libc::RTLD_NOLOAD | libc::RTLD_LAZY);
        assert!(!handle.is_null(), "libgomp is loaded by the test before it asks");
        let level = libc::dlsym(handle, c"omp_get_level".as_ptr());
        assert!(!level.is_null());
        std::mem::transmute::<*mut libc::c_void, unsafe extern "C" fn() -> c_int>(level)()
    }
}

/// Runs `blocks` blocks through `run`; returns how many ran inside an OpenMP parallel region,
/// after checking that every block ran exactly once.
fn blocks_in_parallel_region(blocks: u32, run: impl FnOnce(KernelFn)) -> u32 {
    let hits: Arc<Vec<AtomicU32>> = Arc::new((0..blocks).map(|_| AtomicU32::new(0)).collect());
    let inside = Arc::new(AtomicU32::new(0));
    let (h, i) = (hits.clone(), inside.clone());
    run(Arc::new(move |ctx: BlockCtx| {
        assert_eq!(ctx.block_num, blocks);
        h[ctx.block_idx as usize].fetch_add(1, Ordering::Relaxed);
        if openmp_level() == 1 {
            i.fetch_add(1, Ordering::Relaxed);
        }
    }));
    assert!(hits.iter().all(|c| c.load(Ordering::Relaxed) == 1), "every block runs exactly once");
    inside.load(Ordering::Relaxed)
}

#[test]
fn launches_share_a_loaded_openmp_team_and_stream_workers_keep_their_own() {
    let pool = Pool::global();
    let err = pool.share_openmp_team(true).unwrap_err();
    assert!(err.to_string().contains("expected an OpenMP runtime loaded in this process"), "{err}");

    // SAFETY: loading the system libgomp, as importing torch loads its own.
    let libgomp = unsafe { libc::dlopen(c"libgomp.so.1".as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    assert!(!libgomp.is_null(), "libgomp.so.1 (installed with gcc) is needed by this test");
    let team = pool.share_openmp_team(true).unwrap();
    assert!(team >= 1);
    assert_eq!(pool.threads(), team);

    // From this thread, every block runs inside one OpenMP parallel region.
    let inside = blocks_in_parallel_region(1000, |kernel| pool.run(&kernel, 1000).unwrap());
    assert_eq!(inside, 1000);

    // A kernel panic on an OpenMP thread is an error, and the team keeps working.
    let failing: KernelFn = Arc::new(|ctx: BlockCtx| {
        if ctx.block_idx == 5 {
            panic!("block five failed");
        }
    });
    assert_eq!(pool.run(&failing, 64).unwrap_err(), KernelStop::Panicked("block five failed".into()));
    assert_eq!(blocks_in_parallel_region(64, |kernel| pool.run(&kernel, 64).unwrap()), 64);

    // A stream worker would open a second team: its launches keep uniop's own workers.
    let stream = Stream::new();
    let inside = blocks_in_parallel_region(256, |kernel| {
        launch(&stream, 256, |ctx, kernel: &KernelFn| kernel(ctx), kernel);
        stream.synchronize().unwrap();
    });
    assert_eq!(inside, 0);

    // Stopping the sharing goes back to uniop's workers.
    pool.share_openmp_team(false).unwrap();
    assert_eq!(blocks_in_parallel_region(1000, |kernel| pool.run(&kernel, 1000).unwrap()), 0);
}
