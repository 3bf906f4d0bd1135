//! Runtime integration tests: SPMD launches, stream ordering, events across streams, deadlock
//! detection, and error reporting from kernels.

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use uniop::runtime::launch;
use uniop::{BlockCtx, ErrorCode, Event, Stream};

#[test]
fn every_block_sees_its_index_and_count() {
    let stream = Stream::new();
    let seen: Arc<Vec<AtomicU32>> = Arc::new((0..37).map(|_| AtomicU32::new(u32::MAX)).collect());
    struct Args {
        seen: Arc<Vec<AtomicU32>>,
    }
    fn kernel(ctx: BlockCtx, args: &Args) {
        args.seen[ctx.block_idx as usize].store(ctx.block_num, Ordering::Relaxed);
    }
    launch(&stream, 37, kernel, Args { seen: seen.clone() });
    stream.synchronize().unwrap();
    assert!(seen.iter().all(|s| s.load(Ordering::Relaxed) == 37));
}

#[test]
fn launches_on_one_stream_run_in_order() {
    let stream = Stream::new();
    let log = Arc::new(Mutex::new(Vec::new()));
    for i in 0..2000u32 {
        let log = log.clone();
        // Multi-block launches too: the next launch may not start before all blocks finished.
        stream.launch(3, move |ctx| {
            if ctx.block_idx == 0 {
                log.lock().unwrap().push(i);
            }
        });
    }
    stream.synchronize().unwrap();
    let log = log.lock().unwrap();
    assert_eq!(*log, (0..2000).collect::<Vec<_>>());
}

#[test]
fn cross_stream_event_orders_work_and_times_it() {
    let (a, b) = (Stream::new(), Stream::new());
    let (start, produced) = (Event::new(), Event::new());
    let flag = Arc::new(AtomicBool::new(false));
    let observed = Arc::new(AtomicBool::new(false));
    start.record(&a);
    let f = flag.clone();
    a.launch(1, move |_| {
        std::thread::sleep(Duration::from_millis(30));
        f.store(true, Ordering::Release);
    });
    produced.record(&a);
    b.wait_event(&produced).unwrap();
    let (f, o) = (flag.clone(), observed.clone());
    b.launch(4, move |_| {
        if f.load(Ordering::Acquire) {
            o.fetch_or(true, Ordering::Relaxed);
        }
    });
    // Still running: the event cannot have completed yet.
    assert!(!produced.query().unwrap());
    b.synchronize().unwrap();
    assert!(observed.load(Ordering::Relaxed), "stream b ran before the event it waits for");
    assert!(produced.query().unwrap());
    let ms = Event::elapsed_ms(&start, &produced).unwrap();
    assert!((25.0..5000.0).contains(&ms), "elapsed {ms} ms");
}

#[test]
fn events_that_were_never_recorded_are_errors() {
    let s = Stream::new();
    let e = Event::new();
    for err in [s.wait_event(&e).unwrap_err(), e.query().unwrap_err(), e.synchronize().unwrap_err()] {
        assert_eq!(err.code(), ErrorCode::ParamInvalid);
        assert!(err.message().contains("never recorded"), "{err}");
    }
    let done = Event::new();
    done.record(&s);
    let err = Event::elapsed_ms(&done, &e).unwrap_err();
    assert!(err.message().contains("(end)"), "{err}");
}

#[test]
fn host_function_waiting_on_its_own_stream_is_a_deadlock_error() {
    let s = Stream::new();
    let inner = s.clone();
    s.launch_host_fn(move || inner.synchronize());
    let err = s.synchronize().unwrap_err();
    assert_eq!(err.code(), ErrorCode::Runtime);
    assert!(err.message().contains("deadlock"), "{err}");
    // The stream is healthy afterwards.
    s.launch(2, |_| {});
    s.synchronize().unwrap();
}

#[test]
fn wait_cycle_across_two_streams_is_detected() {
    let (a, b) = (Stream::new(), Stream::new());
    let after_host_fn = Event::new();
    let b_for_a = b.clone();
    // Task 1 on a: blocks on everything b has enqueued by then...
    a.launch_host_fn(move || {
        std::thread::sleep(Duration::from_millis(20));
        b_for_a.synchronize()
    });
    after_host_fn.record(&a);
    // ...and b waits for a task on a that comes after that host function: a cycle.
    b.wait_event(&after_host_fn).unwrap();
    let err = a.synchronize().unwrap_err();
    assert_eq!(err.code(), ErrorCode::Runtime);
    assert!(err.message().contains("deadlock"), "{err}");
    b.synchronize().unwrap();
}

#[test]
fn kernel_panic_is_reported_by_synchronize() {
    let s = Stream::new();
    s.launch(4, |ctx| {
        if ctx.block_idx == 2 {
            panic!("bad block");
        }
    });
    let err = s.synchronize().unwrap_err();
    assert_eq!(err.code(), ErrorCode::Runtime);
    assert!(err.message().contains("bad block"), "{err}");
    s.synchronize().unwrap();
}

#[test]
fn dropping_a_stream_drains_its_work() {
    let counter = Arc::new(AtomicU32::new(0));
    {
        let s = Stream::new();
        for _ in 0..100 {
            let c = counter.clone();
            s.launch(2, move |_| {
                c.fetch_add(1, Ordering::Relaxed);
            });
        }
    }
    assert_eq!(counter.load(Ordering::Relaxed), 200);
}
