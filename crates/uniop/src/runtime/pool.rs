//! The SPMD engine: a persistent compute pool that runs `block_num` instances of one kernel.
//!
//! This is the CPU form of an Ascend C / CUDA kernel launch: the kernel sees `block_idx` and
//! `block_num` and picks its share of the work from them. Blocks are claimed dynamically from an
//! atomic counter, so a slow or descheduled thread delays only the blocks it holds.
//!
//! Why not rayon: waking rayon from an outside thread costs 13–18 µs here, while a spinning worker
//! picks up work in ~0.1 µs and a 4096-wide norm row takes < 1 µs. Workers therefore spin for a
//! short while after each job and only then park; the launching thread (a stream worker) always
//! runs blocks itself, so a launch never waits for a parked thread to wake.
//!
//! Inside a host that runs its own OpenMP team — PyTorch does, for every parallel op and GEMM —
//! two pools would spin on the same cores: right after a torch op its OpenMP threads keep spinning
//! for hundreds of microseconds, and a uniop worker woken then shares a core with one of them
//! (rms_norm on [512, 384] measured 65 µs alone, 218 µs right after `torch.mm`). So the pool can
//! *share* that team instead ([`Pool::share_openmp_team`]): a launch from the host's own threads
//! becomes one OpenMP parallel region whose threads claim blocks exactly like uniop's workers do,
//! and picks up the threads the host left spinning.

use super::fork::PerProcess;
use crate::error::{Error, Result};
use std::cell::Cell;
use std::ffi::{c_int, c_uint, c_void};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// What a kernel instance knows about itself (Ascend C `GetBlockIdx`/`GetBlockNum`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockCtx {
    pub block_idx: u32,
    pub block_num: u32,
}

impl BlockCtx {
    /// The contiguous share `[start, end)` of `n` items that this block owns when `n` items are
    /// split as evenly as possible over `block_num` blocks.
    pub fn split(&self, n: usize) -> std::ops::Range<usize> {
        let (b, nb) = (self.block_idx as usize, self.block_num as usize);
        let base = n / nb;
        let extra = n % nb;
        let start = b * base + b.min(extra);
        start..start + base + usize::from(b < extra)
    }

    /// The launch's blocks dealt out to `groups` groups of work in order, `block_num / groups`
    /// each (`block_num` a multiple of `groups`): the group this block works on, and its place
    /// among that group's blocks (to [`split`](Self::split) the group's share further).
    pub fn within(&self, groups: usize) -> (usize, BlockCtx) {
        let per_group = self.block_num / groups as u32;
        let group = self.block_idx / per_group;
        (group as usize, BlockCtx { block_idx: self.block_idx - group * per_group, block_num: per_group })
    }
}

/// A kernel as the engine stores it: shareable, so late-waking workers can hold it safely.
pub type KernelFn = Arc<dyn Fn(BlockCtx) + Send + Sync>;

/// How long an idle worker spins before parking.
const SPIN: Duration = Duration::from_micros(50);

struct Job {
    kernel: KernelFn,
    block_num: u32,
    next: AtomicU32,
    done: AtomicU32,
    stop: Mutex<Option<KernelStop>>,
}

impl Job {
    fn run_blocks(&self) {
        loop {
            let idx = self.next.fetch_add(1, Ordering::Relaxed);
            if idx >= self.block_num {
                return;
            }
            let ctx = BlockCtx { block_idx: idx, block_num: self.block_num };
            if let Err(payload) = catch_unwind(AssertUnwindSafe(|| (self.kernel)(ctx))) {
                self.stop.lock().unwrap().get_or_insert_with(|| stop_of(payload));
            }
            self.done.fetch_add(1, Ordering::Release);
        }
    }
}

/// Why a launch's blocks stopped early.
#[derive(Debug, PartialEq)]
pub enum KernelStop {
    /// [`refuse_launch`]: the data is wrong; the message says how.
    Refused(String),
    /// A panic: a bug in the kernel.
    Panicked(String),
}

/// The payload [`refuse_launch`] unwinds with.
struct Refusal(String);

/// Stops the calling kernel block because its data is wrong — an index past a table, a length
/// past a cache: values phase 1 cannot see. The launch fails with a `Runtime` error carrying
/// `message`, which should name the op, the argument, what was expected and what was found.
/// Unlike `panic!` it skips the panic hook, so nothing is printed to stderr: the error is the
/// caller's to handle, not a bug to report.
pub fn refuse_launch(message: String) -> ! {
    std::panic::resume_unwind(Box::new(Refusal(message)))
}

fn stop_of(payload: Box<dyn std::any::Any + Send>) -> KernelStop {
    match payload.downcast::<Refusal>() {
        Ok(refusal) => KernelStop::Refused(refusal.0),
        Err(payload) => KernelStop::Panicked(panic_message(&*payload)),
    }
}

pub(crate) fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        s.to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "unknown panic payload".to_string()
    }
}

struct Shared {
    epoch: AtomicU64,
    job: Mutex<Option<Arc<Job>>>,
    sleepers: AtomicUsize,
    sleep_lock: Mutex<()>,
    wake: Condvar,
}

/// An OpenMP runtime already loaded in the process, reached through libgomp's ABI (which LLVM's
/// and Intel's runtimes export too), so uniop needs no OpenMP at build time.
#[derive(Clone, Copy)]
struct OpenMp {
    parallel: GompParallel,
    max_threads: OmpGetMaxThreads,
}

/// `GOMP_parallel(fn, data, num_threads, flags)`: runs `fn(data)` on every thread of a team (the
/// caller is thread 0) and returns when all have finished.
type GompParallel = unsafe extern "C" fn(extern "C" fn(*mut c_void), *mut c_void, c_uint, c_uint);
type OmpGetMaxThreads = unsafe extern "C" fn() -> c_int;

impl OpenMp {
    /// The runtime loaded in this process, if any. Only already-loaded libraries are looked at
    /// (`RTLD_NOLOAD`): sharing a team nobody else runs would gain nothing.
    fn loaded() -> Option<OpenMp> {
        for name in [c"libgomp.so.1", c"libomp.so", c"libomp.so.5", c"libiomp5.so"] {
            // SAFETY: dlopen of a NUL-terminated name; RTLD_NOLOAD never loads anything new. The
            // handle is kept open: the runtime stays resident for the process anyway.
            let handle = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_NOLOAD | libc::RTLD_LAZY) };
            if handle.is_null() {
                continue;
            }
            // SAFETY: symbol lookups in a live handle.
            let (parallel, max_threads) = unsafe {
                (libc::dlsym(handle, c"GOMP_parallel".as_ptr()), libc::dlsym(handle, c"omp_get_max_threads".as_ptr()))
            };
            if parallel.is_null() || max_threads.is_null() {
                continue;
            }
            // SAFETY: both symbols have these C signatures in every runtime that exports them.
            return Some(unsafe {
                OpenMp {
                    parallel: std::mem::transmute::<*mut c_void, GompParallel>(parallel),
                    max_threads: std::mem::transmute::<*mut c_void, OmpGetMaxThreads>(max_threads),
                }
            });
        }
        None
    }

    /// The team size a parallel region opened by this thread gets (the host's thread setting).
    fn threads(&self) -> usize {
        // SAFETY: omp_get_max_threads takes nothing and only reads the caller's ICVs.
        (unsafe { (self.max_threads)() }).max(1) as usize
    }

    /// Runs every block of `job` on the team; returns when all have run.
    fn run(&self, job: &Job) {
        extern "C" fn run_blocks(job: *mut c_void) {
            // SAFETY: `job` is the `&Job` below, alive until GOMP_parallel returns. run_blocks
            // catches kernel panics itself, so nothing unwinds through the C runtime.
            unsafe { &*(job as *const Job) }.run_blocks();
        }
        // SAFETY: a valid callback and data pointer; num_threads 0 means the default team.
        unsafe { (self.parallel)(run_blocks, job as *const Job as *mut c_void, 0, 0) };
    }
}

thread_local! {
    /// Set on uniop's stream workers: libgomp gives every thread that opens a parallel region a
    /// team of its own, so a stream worker sharing "the" OpenMP team would start a second one.
    static OWN_TEAM_ONLY: Cell<bool> = const { Cell::new(false) };
}

/// Makes launches from the current thread always use uniop's own workers.
pub(crate) fn use_own_team_on_this_thread() {
    OWN_TEAM_ONLY.with(|own| own.set(true));
}

pub struct Pool {
    shared: Arc<Shared>,
    /// Held while a job is published; a second concurrent launcher runs its blocks inline
    /// instead of queueing behind the first (two streams still run in parallel).
    busy: AtomicBool,
    workers: usize,
    /// The OpenMP runtime, once found by [`Pool::share_openmp_team`].
    openmp: OnceLock<OpenMp>,
    sharing_openmp: AtomicBool,
}

impl Pool {
    /// The process-wide pool: `UNIOP_NUM_THREADS` (default: available cores) minus one, because
    /// the launching thread always computes too.
    ///
    /// In a forked child, a new pool with workers of its own (see [`fork`](super::fork)). Where
    /// the parent's launches ran on the host's OpenMP team, the child's pool takes that team's
    /// size as the host now sets it (PyTorch's DataLoader workers set one thread) but not the
    /// team itself: the team's threads did not survive the fork.
    pub fn global() -> &'static Pool {
        static POOL: PerProcess<Pool> = PerProcess::new();
        POOL.get_or_init(|parent| {
            super::fork::install();
            let host_team = parent.filter(|p| p.sharing_openmp.load(Ordering::Acquire)).and_then(|p| p.openmp.get());
            let threads = std::env::var("UNIOP_NUM_THREADS")
                .ok()
                .and_then(|v| v.parse::<usize>().ok())
                .filter(|&n| n > 0)
                .or(host_team.map(OpenMp::threads))
                .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
            Pool::new(threads - 1)
        })
    }

    fn new(workers: usize) -> Pool {
        let shared = Arc::new(Shared {
            epoch: AtomicU64::new(0),
            job: Mutex::new(None),
            sleepers: AtomicUsize::new(0),
            sleep_lock: Mutex::new(()),
            wake: Condvar::new(),
        });
        let mut started = 0;
        for i in 0..workers {
            let shared = shared.clone();
            let spawned =
                std::thread::Builder::new().name(format!("uniop-compute-{i}")).spawn(move || worker_loop(&shared));
            if let Err(e) = spawned {
                // A thread limit (a container's pids.max, `ulimit -u` or `-v`) ends the pool here:
                // launches run on the workers that started and the launching thread — slower, but
                // complete, where a panic would fail every call.
                eprintln!("uniop: started {started} of {workers} compute workers ({e}); launches use fewer threads");
                break;
            }
            started += 1;
        }
        Pool {
            shared,
            busy: AtomicBool::new(false),
            workers: started,
            openmp: OnceLock::new(),
            sharing_openmp: AtomicBool::new(false),
        }
    }

    /// Threads that compute a launch from the current thread: the OpenMP team's size when it is
    /// shared, else uniop's workers plus the launching thread.
    pub fn threads(&self) -> usize {
        match self.openmp_team() {
            Some(openmp) => openmp.threads(),
            None => self.workers + 1,
        }
    }

    /// Starts (`share == true`) or stops running launches on the team of the OpenMP runtime
    /// already loaded in the process, as a host like PyTorch runs its own parallel ops; returns
    /// the team's size. Launches from uniop's stream workers keep uniop's own workers. Errors when
    /// no OpenMP runtime is loaded.
    pub fn share_openmp_team(&self, share: bool) -> Result<usize> {
        if share && self.openmp.get().is_none() {
            let openmp = OpenMp::loaded().ok_or_else(|| {
                Error::runtime(
                    "share_openmp_team: expected an OpenMP runtime loaded in this process (libgomp, \
                     libomp or libiomp5, e.g. by importing torch); found none",
                )
            })?;
            let _ = self.openmp.set(openmp);
        }
        self.sharing_openmp.store(share, Ordering::Release);
        Ok(self.threads())
    }

    /// The shared OpenMP team, when launches from this thread run on it.
    fn openmp_team(&self) -> Option<&OpenMp> {
        if !self.sharing_openmp.load(Ordering::Acquire) || OWN_TEAM_ONLY.with(Cell::get) {
            return None;
        }
        self.openmp.get()
    }

    /// Runs the one block of a launch of one on the calling thread.
    pub(crate) fn run_one(kernel: impl FnOnce(BlockCtx)) -> Result<(), KernelStop> {
        catch_unwind(AssertUnwindSafe(|| kernel(BlockCtx { block_idx: 0, block_num: 1 }))).map_err(stop_of)
    }

    /// Runs blocks `0..block_num` of `kernel` and returns when all have finished. A block that
    /// panics or refuses its data stops the launch with the first such stop.
    pub fn run(&self, kernel: &KernelFn, block_num: u32) -> Result<(), KernelStop> {
        if block_num == 0 {
            return Ok(());
        }
        if block_num == 1 {
            // Nothing to share: run it here without publishing a job (an allocation and a lock).
            return Self::run_one(|ctx| kernel(ctx));
        }
        let job = Arc::new(Job {
            kernel: kernel.clone(),
            block_num,
            next: AtomicU32::new(0),
            done: AtomicU32::new(0),
            stop: Mutex::new(None),
        });
        let openmp = if block_num > 1 { self.openmp_team() } else { None };
        let helped = openmp.is_some() || self.workers > 0;
        let share = block_num > 1 && helped && !self.busy.swap(true, Ordering::Acquire);
        if let (true, Some(openmp)) = (share, openmp) {
            openmp.run(&job);
        } else if share {
            *self.shared.job.lock().unwrap() = Some(job.clone());
            self.shared.epoch.fetch_add(1, Ordering::SeqCst);
            if self.shared.sleepers.load(Ordering::SeqCst) > 0 {
                let _guard = self.shared.sleep_lock.lock().unwrap();
                self.shared.wake.notify_all();
            }
        }
        job.run_blocks();
        let mut spins = 0u32;
        while job.done.load(Ordering::Acquire) < block_num {
            spins += 1;
            if spins < 4096 {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
        if share {
            if openmp.is_none() {
                self.shared.job.lock().unwrap().take();
            }
            self.busy.store(false, Ordering::Release);
        }
        let stop = job.stop.lock().unwrap().take();
        stop.map_or(Ok(()), Err)
    }
}

fn worker_loop(shared: &Shared) {
    let mut seen = shared.epoch.load(Ordering::SeqCst);
    loop {
        let idle_since = Instant::now();
        let mut spins = 0u32;
        loop {
            let epoch = shared.epoch.load(Ordering::SeqCst);
            if epoch != seen {
                seen = epoch;
                break;
            }
            spins = spins.wrapping_add(1);
            if !spins.is_multiple_of(64) || idle_since.elapsed() < SPIN {
                std::hint::spin_loop();
                continue;
            }
            let mut guard = shared.sleep_lock.lock().unwrap();
            shared.sleepers.fetch_add(1, Ordering::SeqCst);
            while shared.epoch.load(Ordering::SeqCst) == seen {
                guard = shared.wake.wait(guard).unwrap();
            }
            shared.sleepers.fetch_sub(1, Ordering::SeqCst);
        }
        let job = shared.job.lock().unwrap().clone();
        if let Some(job) = job {
            job.run_blocks();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn within_deals_blocks_to_groups_in_order() {
        let places: Vec<_> = (0..6).map(|b| BlockCtx { block_idx: b, block_num: 6 }.within(3)).collect();
        let ctx = |block_idx| BlockCtx { block_idx, block_num: 2 };
        assert_eq!(places, [(0, ctx(0)), (0, ctx(1)), (1, ctx(0)), (1, ctx(1)), (2, ctx(0)), (2, ctx(1))]);
        assert_eq!(BlockCtx { block_idx: 4, block_num: 5 }.within(1), (0, BlockCtx { block_idx: 4, block_num: 5 }));
    }

    #[test]
    fn split_covers_everything_once() {
        for n in [0usize, 1, 7, 64, 1000] {
            for nb in 1..9u32 {
                let mut next = 0;
                for b in 0..nb {
                    let r = BlockCtx { block_idx: b, block_num: nb }.split(n);
                    assert_eq!(r.start, next);
                    assert!(r.len() <= n / nb as usize + 1);
                    next = r.end;
                }
                assert_eq!(next, n);
            }
        }
    }

    #[test]
    fn every_block_runs_exactly_once() {
        let pool = Pool::new(3);
        let hits: Arc<Vec<AtomicU32>> = Arc::new((0..1000).map(|_| AtomicU32::new(0)).collect());
        let h = hits.clone();
        let kernel: KernelFn = Arc::new(move |ctx: BlockCtx| {
            assert_eq!(ctx.block_num, 1000);
            h[ctx.block_idx as usize].fetch_add(1, Ordering::Relaxed);
        });
        for _ in 0..50 {
            pool.run(&kernel, 1000).unwrap();
        }
        assert!(hits.iter().all(|c| c.load(Ordering::Relaxed) == 50));
    }

    #[test]
    fn panics_become_errors() {
        let pool = Pool::new(1);
        let kernel: KernelFn = Arc::new(|ctx: BlockCtx| {
            if ctx.block_idx == 3 {
                panic!("block three failed");
            }
        });
        assert_eq!(pool.run(&kernel, 8).unwrap_err(), KernelStop::Panicked("block three failed".into()));
        let refusing: KernelFn = Arc::new(|ctx: BlockCtx| refuse_launch(format!("block {} refused", ctx.block_idx)));
        assert_eq!(pool.run(&refusing, 1).unwrap_err(), KernelStop::Refused("block 0 refused".into()));
        // The pool keeps working afterwards.
        let ok: KernelFn = Arc::new(|_| {});
        pool.run(&ok, 8).unwrap();
    }
}
