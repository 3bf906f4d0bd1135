//! `fork()` while uniop has work in flight, in its own test binary: a forked child keeps only the
//! thread that called `fork`, so the child of a test harness must run nothing but its checks and
//! leave with `_exit`.
//!
//! This is what a PyTorch `DataLoader` (forking workers by default on Linux) or `multiprocessing`
//! does to a process that has used uniop. Before, the child inherited streams whose worker threads
//! did not exist there: its first call waited for them forever.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use uniop::runtime::{profiler, Allocator, Event, MemPolicy, Pool, Stream};

/// Runs `check` in a forked child and returns its verdict: the child's error, or that it hung or
/// crashed.
fn in_child(check: impl FnOnce() -> Result<(), String>) -> Result<(), String> {
    // SAFETY: the child runs `check` and leaves with `_exit`; it never returns into the harness.
    match unsafe { libc::fork() } {
        -1 => panic!("fork failed: {}", std::io::Error::last_os_error()),
        0 => {
            let code = match catch_unwind(AssertUnwindSafe(check)) {
                Ok(Ok(())) => 0,
                Ok(Err(why)) => {
                    eprintln!("child: {why}");
                    1
                }
                Err(_) => 2,
            };
            // SAFETY: ends the child without running the parent's exit handlers or destructors.
            unsafe { libc::_exit(code) }
        }
        pid => {
            let deadline = Instant::now() + Duration::from_secs(30);
            let mut status = 0;
            loop {
                // SAFETY: waits for our own child.
                match unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) } {
                    0 if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(10)),
                    0 => {
                        // SAFETY: our own child.
                        unsafe {
                            libc::kill(pid, libc::SIGKILL);
                            libc::waitpid(pid, &mut status, 0);
                        }
                        return Err("the child hung (killed after 30 s)".into());
                    }
                    _ if libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0 => return Ok(()),
                    _ if libc::WIFEXITED(status) => {
                        return Err(format!("the child failed (exit {})", libc::WEXITSTATUS(status)))
                    }
                    _ => return Err(format!("the child crashed (wait status {status})")),
                }
            }
        }
    }
}

fn expect(what: &str, ok: bool) -> Result<(), String> {
    ok.then_some(()).ok_or_else(|| what.to_string())
}

/// A launch of `blocks` blocks on `stream` that counts each block's runs.
fn count_blocks(stream: &Stream, blocks: u32) -> Arc<Vec<AtomicU32>> {
    let hits: Arc<Vec<AtomicU32>> = Arc::new((0..blocks).map(|_| AtomicU32::new(0)).collect());
    let seen = hits.clone();
    stream.launch(blocks, move |ctx| {
        seen[ctx.block_idx as usize].fetch_add(1, Ordering::SeqCst);
    });
    hits
}

fn each_ran_once(hits: &[AtomicU32]) -> bool {
    hits.iter().all(|h| h.load(Ordering::SeqCst) == 1)
}

#[test]
fn a_forked_child_runs_its_own_work_and_reports_the_work_it_lost() {
    let stream = Stream::new();
    let threads = Pool::global().threads();
    // Recording: each launch the busy thread makes takes the profiler's lock too.
    profiler::start().unwrap();
    // Another thread keeps the allocator, the pool and the default stream busy, so that at each
    // fork their locks may be held and the default stream has tasks queued or running.
    let stop = Arc::new(AtomicBool::new(false));
    let busy = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut size = 1usize;
            while !stop.load(Ordering::Relaxed) {
                size = size * 7 % 4_000_037 + 1;
                let block = Allocator::global().allocate(size, MemPolicy::HugeFirst).unwrap();
                drop(block);
                Stream::default_stream().launch(8, |_| std::thread::sleep(Duration::from_micros(200)));
                Stream::default_stream().synchronize().unwrap();
            }
        })
    };
    for round in 0..4 {
        // Work the parent's workers are still running when the process forks: a sleeping kernel
        // and an event record behind it on `stream`, a sleeping kernel on the default stream.
        stream.launch(1, |_| std::thread::sleep(Duration::from_millis(150)));
        let event = Event::new();
        event.record(&stream);
        Stream::default_stream().launch(1, |_| std::thread::sleep(Duration::from_millis(150)));
        // Two more streams with work in flight, for the child to drop: one it never uses, one it does.
        let (unused, used) = (Stream::new(), Stream::new());
        unused.launch(1, |_| std::thread::sleep(Duration::from_millis(150)));
        used.launch(1, |_| std::thread::sleep(Duration::from_millis(150)));
        let verdict = in_child(|| {
            // The default stream: reports what it lost once, then runs the child's work.
            let lost = Stream::default_stream().synchronize().map_err(|e| e.message().to_string());
            let lost = lost.err().ok_or("the default stream reported no lost work")?;
            expect(&format!("the default stream's report: {lost}"), lost.contains("before this process forked"))?;
            let hits = count_blocks(Stream::default_stream(), 64);
            Stream::default_stream().synchronize().map_err(|e| e.to_string())?;
            expect("each of 64 blocks on the default stream ran once", each_ran_once(&hits))?;
            // The pool has its workers again.
            expect("the child's pool", Pool::global().threads() == threads)?;

            // The parent's stream: the child's launch runs; synchronize names the two lost tasks.
            let hits = count_blocks(&stream, 16);
            let lost = stream.synchronize().err().ok_or("the stream reported no lost work")?;
            let message = lost.message();
            expect(
                &format!("the stream's report: {message}"),
                message.contains(&format!("stream {}", stream.id()))
                    && message.contains("2 tasks")
                    && message.contains("before this process forked"),
            )?;
            expect("each of 16 blocks on the parent's stream ran once", each_ran_once(&hits))?;
            stream.synchronize().map_err(|e| format!("a second synchronize: {e}"))?;

            // The event was recorded behind the lost work: waiting for it is an error, not a hang.
            let never = event.synchronize().err().ok_or("the pre-fork event completed")?;
            expect(&format!("the event's error: {never}"), never.message().contains("before this process forked"))?;
            let waiting = Stream::new();
            waiting.wait_event(&event).map_err(|e| e.to_string())?;
            expect("a stream waiting on the pre-fork event reports it", waiting.synchronize().is_err())?;

            // New streams, and the allocator.
            let fresh = Stream::new();
            let hits = count_blocks(&fresh, 8);
            fresh.synchronize().map_err(|e| e.to_string())?;
            expect("each of 8 blocks on a new stream ran once", each_ran_once(&hits))?;
            let block = Allocator::global().allocate(3 << 20, MemPolicy::HugeFirst).map_err(|e| e.to_string())?;
            // SAFETY: the block holds 3 MiB.
            unsafe { block.as_ptr().write_bytes(7, 3 << 20) };

            // The profile goes on in the child, with the child's launches in it.
            let profile = profiler::stop().map_err(|e| e.to_string())?;
            let blocks = |n| profile.events().iter().filter(|e| e.label.block_dim == n).count();
            expect("the child's profile has its 64- and 16-block launches", blocks(64) == 1 && blocks(16) == 1)?;

            // Dropping the parent's streams joins no thread that is not here.
            drop(unused);
            let hits = count_blocks(&used, 4);
            expect("the used stream reports its lost task", used.synchronize().is_err())?;
            expect("each of 4 blocks on the used stream ran once", each_ran_once(&hits))?;
            drop(used);
            Ok(())
        });
        verdict.unwrap_or_else(|why| panic!("fork {round}: {why}"));
        // The parent's own work is untouched by the fork.
        stream.synchronize().unwrap();
        assert!(event.query().unwrap(), "fork {round}: the event completes in the parent");
    }
    stop.store(true, Ordering::Relaxed);
    busy.join().unwrap();
    assert!(profiler::stop().is_ok());
    Stream::default_stream().synchronize().unwrap();
}
