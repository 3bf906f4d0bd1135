//! The runtime where no thread can be started, in its own test binary: the test caps the process's
//! address space (`RLIMIT_AS`) so that no thread stack can be mapped. A container's `pids.max` or
//! `ulimit -u` refuses thread creation the same way (root ignores `ulimit -u`; it cannot ignore
//! this). Before, spawning the compute pool's workers or a stream's worker panicked, and every
//! call failed.

mod common;

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use uniop::runtime::{Event, Pool, Stream};
use uniop::Error;

#[test]
fn without_threads_streams_run_their_tasks_on_the_threads_that_enqueue_them() {
    let hits: Arc<Vec<AtomicU32>> = Arc::new((0..64).map(|_| AtomicU32::new(0)).collect());
    let order = Arc::new(Mutex::new(Vec::new()));
    // Room for the heap, not for a thread's 2 MiB stack.
    common::cap_address_space(3 << 19);
    assert!(std::thread::Builder::new().spawn(|| {}).is_err(), "the cap leaves no room for a thread");

    // The pool starts with no workers: the launching thread runs every block.
    assert_eq!(Pool::global().threads(), 1);
    let stream = Stream::new();
    let seen = hits.clone();
    stream.launch(64, move |ctx| {
        seen[ctx.block_idx as usize].fetch_add(1, Ordering::SeqCst);
    });
    stream.synchronize().unwrap();
    assert!(hits.iter().all(|h| h.load(Ordering::SeqCst) == 1), "every block ran once");

    // Errors and panics are reported as with a worker.
    stream.launch_host_fn(|| Err(Error::runtime("the host function says no")));
    assert!(stream.synchronize().unwrap_err().message().contains("says no"));
    stream.launch(2, |_| panic!("a block panics"));
    assert!(stream.synchronize().unwrap_err().message().contains("kernel panicked"));

    // A host function enqueuing onto its own stream: the new task runs after it, not inside it.
    let (inner, log) = (stream.clone(), order.clone());
    stream.launch_host_fn(move || {
        let later = log.clone();
        inner.launch_host_fn(move || {
            later.lock().unwrap().push(2);
            Ok(())
        });
        log.lock().unwrap().push(1);
        Ok(())
    });
    stream.synchronize().unwrap();
    assert_eq!(*order.lock().unwrap(), [1, 2]);

    // A host function waiting for its own stream is still a deadlock error, not a hang.
    let inner = stream.clone();
    stream.launch_host_fn(move || inner.synchronize());
    assert!(stream.synchronize().unwrap_err().message().starts_with("deadlock"));

    // Events and cross-stream waits, and the default stream.
    let (event, other) = (Event::new(), Stream::new());
    event.record(&stream);
    other.wait_event(&event).unwrap();
    let seen = hits.clone();
    other.launch(4, move |ctx| {
        seen[ctx.block_idx as usize].fetch_add(1, Ordering::SeqCst);
    });
    other.synchronize().unwrap();
    assert!(event.query().unwrap());
    assert_eq!(hits[3].load(Ordering::SeqCst), 2);
    // A host function making another such stream wait for work queued after it on its own: the
    // other stream would run the wait inside it, so it is a deadlock error there, not a hang.
    let (inner, waiting) = (stream.clone(), other.clone());
    stream.launch_host_fn(move || {
        let later = Event::new();
        later.record(&inner);
        waiting.wait_event(&later)
    });
    stream.synchronize().unwrap();
    assert!(other.synchronize().unwrap_err().message().starts_with("deadlock"));

    Stream::default_stream().launch(3, |_| {});
    Stream::default_stream().synchronize().unwrap();
}
