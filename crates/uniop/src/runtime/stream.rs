//! Streams and events: ordered asynchronous queues, as in CUDA and AscendCL.
//!
//! Each stream owns one worker thread that executes its tasks in order; kernel launches fan out
//! to the shared [`Pool`]. Every task gets a sequence number when it is enqueued, so "has this
//! stream reached task n" is one atomic load, and an event is just "(stream, n)".
//!
//! A cross-stream wait binds to the event's most recent record at the time of the call (CUDA
//! semantics), so waits always point to work that was enqueued earlier and queue-to-queue waits
//! can never form a cycle. The one way to build a wait that can never finish is a *blocking* wait
//! from inside a stream — a host function that synchronizes on its own stream's future, or on a
//! stream that waits for it. Those are detected by walking the wait graph before blocking and
//! reported as a runtime error instead of hanging.
//!
//! In a process forked from one that used a stream, the stream gets a new worker on its first use
//! there ([`fork`](super::fork)); tasks it had not finished at the fork are reported by its first
//! `synchronize`, not run.
//!
//! A stream whose worker thread cannot be started (a thread limit: a container's `pids.max`,
//! `ulimit -u` or `-v`) runs its tasks on the threads that enqueue them instead, one at a time and
//! in order; see [`StreamInner::runner`].

use super::fork::{self, PerProcess};
use super::pool::{panic_message, BlockCtx, KernelFn, KernelStop, Pool};
use super::profiler::{self, Label, LaunchKind};
use crate::error::{Error, Result};
use crate::op::{KernelArgs, StepFn};
use std::cell::RefCell;
use std::collections::{HashMap, VecDeque};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

const SPIN: Duration = Duration::from_micros(50);

/// One SPMD launch as a stream holds it: the kernel, its block count, and — while the profiler
/// records — what it is.
pub(crate) struct Launch {
    pub block_num: u32,
    pub kernel: LaunchKernel,
    pub label: Option<Arc<Label>>,
}

/// What a launch runs for each block.
pub(crate) enum LaunchKernel {
    /// A closure over everything it reads (kernel direct calls, staging copies).
    Closure(KernelFn),
    /// An executor step over the arguments bound for the launch, which the plan's steps share.
    /// Kept as the two handles they are, so that making a launch allocates nothing: a launch of
    /// one block — every small op's — calls the step in place, and only blocks shared with the
    /// pool's workers get a closure over both.
    Step(StepFn, Arc<KernelArgs>),
}

impl Launch {
    /// Runs every block on `pool` (the calling thread included); a kernel's panic or refusal
    /// becomes an error.
    fn run(&self, pool: &Pool, stream: u64) -> Result<()> {
        let start = self.label.as_ref().map(|_| Instant::now());
        let result = match &self.kernel {
            LaunchKernel::Closure(kernel) => pool.run(kernel, self.block_num),
            LaunchKernel::Step(step, args) if self.block_num == 1 => Pool::run_one(|ctx| step(args, ctx)),
            LaunchKernel::Step(step, args) => {
                let (step, args) = (step.clone(), args.clone());
                pool.run(&(Arc::new(move |ctx| step(&args, ctx)) as KernelFn), self.block_num)
            }
        };
        if let (Some(label), Some(start)) = (&self.label, start) {
            profiler::record(label, stream, start, Instant::now());
        }
        result.map_err(|stop| match stop {
            KernelStop::Refused(message) => Error::runtime(message),
            KernelStop::Panicked(m) => Error::runtime(format!("kernel panicked on stream {stream}: {m}")),
        })
    }
}

enum Task {
    Launch(Launch),
    HostFn(Box<dyn FnOnce() -> Result<()> + Send>),
    Record(Arc<RecordPoint>),
    Wait { on: Arc<StreamInner>, seq: u64 },
}

struct Queue {
    tasks: VecDeque<(u64, Task)>,
    worker_sleeping: bool,
    shutdown: bool,
    /// A caller is running work in place ([`Stream::run_here_if_idle`]): the worker takes nothing.
    in_place: bool,
}

struct WaitEdge {
    at: u64,
    on: Arc<StreamInner>,
    seq: u64,
}

struct StreamInner {
    id: u64,
    /// The [`fork::generation`] of the process whose worker runs this queue.
    generation: u64,
    queue: Mutex<Queue>,
    work: Condvar,
    /// Sequence number of the last task enqueued / completed.
    enqueued: AtomicU64,
    completed: AtomicU64,
    done_lock: Mutex<()>,
    done: Condvar,
    done_waiters: AtomicUsize,
    /// Asynchronous failures not reported yet, with the task that failed: `synchronize` reports
    /// them all (the first), a wait for a range of tasks only its own — so one user of a shared
    /// stream never receives another's error.
    errors: Mutex<Vec<(u64, Error)>>,
    /// Pending cross-stream waits of this stream, for deadlock detection.
    waits: Mutex<Vec<WaitEdge>>,
    /// While a host function of this stream blocks: the task it runs in, and what it waits for.
    blocked_on: Mutex<Option<(u64, Arc<StreamInner>, u64)>>,
    /// Set when the worker thread could not be started: whoever holds this lock runs the queue's
    /// tasks, in order, on the thread that enqueued them ([`StreamInner::run_queued`]).
    runner: OnceLock<Mutex<()>>,
}

thread_local! {
    /// The stream tasks the calling thread is running, innermost last: one on a stream worker;
    /// more where a task enqueues onto a stream without a worker, which runs the new task inside
    /// it ([`StreamInner::run_queued`]).
    static RUNNING: RefCell<Vec<(Arc<StreamInner>, u64)>> = const { RefCell::new(Vec::new()) };
}

/// An ordered asynchronous queue of work. Cloning shares the stream; the worker thread stops
/// (after draining) when the last handle is dropped.
#[derive(Clone)]
pub struct Stream {
    owner: Arc<Owner>,
}

struct Owner {
    id: u64,
    /// The queue and its worker thread, built anew in a forked child.
    worker: PerProcess<Worker>,
}

struct Worker {
    inner: Arc<StreamInner>,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl Worker {
    /// A queue for stream `id` and the thread that runs it. In a forked child, `parent` is the
    /// worker of the process it was forked from: what that queue had not finished at the fork
    /// (read through its counters only) is reported by the first `synchronize`, never run.
    fn start(id: u64, parent: Option<&Worker>) -> Worker {
        let lost = parent.map_or(0, |w| {
            w.inner.enqueued.load(Ordering::Acquire).saturating_sub(w.inner.completed.load(Ordering::Acquire))
        });
        let report = (lost > 0).then(|| {
            let tasks = if lost == 1 { "task" } else { "tasks" };
            let why = format!(
                "stream {id}: {lost} {tasks} enqueued before this process forked had not finished; they do not run \
                 in the child process (pid {}), so what they write is missing or incomplete here",
                std::process::id()
            );
            (0, Error::runtime(why))
        });
        let inner = Arc::new(StreamInner {
            id,
            generation: fork::generation(),
            queue: Mutex::new(Queue {
                tasks: VecDeque::new(),
                worker_sleeping: false,
                shutdown: false,
                in_place: false,
            }),
            work: Condvar::new(),
            enqueued: AtomicU64::new(0),
            completed: AtomicU64::new(0),
            done_lock: Mutex::new(()),
            done: Condvar::new(),
            done_waiters: AtomicUsize::new(0),
            errors: Mutex::new(report.into_iter().collect()),
            waits: Mutex::new(Vec::new()),
            blocked_on: Mutex::new(None),
            runner: OnceLock::new(),
        });
        let worker = inner.clone();
        let spawned = std::thread::Builder::new().name(format!("uniop-stream-{id}")).spawn(move || stream_loop(worker));
        let thread = spawned
            .inspect_err(|e| {
                eprintln!("uniop: stream {id} runs its tasks on the threads that enqueue them (no worker: {e})");
                let _ = inner.runner.set(Mutex::new(()));
            })
            .ok();
        Worker { inner, thread: Mutex::new(thread) }
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        {
            let mut q = self.inner.queue.lock().unwrap();
            q.shutdown = true;
            self.inner.work.notify_one();
        }
        if let Some(t) = self.thread.lock().unwrap().take() {
            let _ = t.join();
        }
    }
}

impl Stream {
    pub fn new() -> Stream {
        static NEXT_ID: AtomicU64 = AtomicU64::new(1);
        fork::install();
        let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
        Stream { owner: Arc::new(Owner { id, worker: PerProcess::with(Worker::start(id, None)) }) }
    }

    /// The default stream: created on first use, lives for the whole process.
    pub fn default_stream() -> &'static Stream {
        static DEFAULT: OnceLock<Stream> = OnceLock::new();
        DEFAULT.get_or_init(Stream::new)
    }

    fn inner(&self) -> &Arc<StreamInner> {
        let Owner { id, worker } = &*self.owner;
        &worker.get_or_init(|parent| Worker::start(*id, parent)).inner
    }

    /// A process-unique id (for messages and profiles).
    pub fn id(&self) -> u64 {
        self.owner.id
    }

    fn enqueue(&self, make: impl FnOnce(u64) -> Task) -> u64 {
        let inner = self.inner();
        let mut q = inner.queue.lock().unwrap();
        let seq = inner.enqueued.load(Ordering::Relaxed) + 1;
        q.tasks.push_back((seq, make(seq)));
        inner.enqueued.store(seq, Ordering::Release);
        if q.worker_sleeping {
            inner.work.notify_one();
        }
        drop(q);
        if let Some(runner) = inner.runner.get() {
            inner.run_queued(runner);
        }
        seq
    }

    /// Kernel direct call: enqueue `block_num` instances of `kernel`, each seeing its
    /// [`BlockCtx`]. Returns at once; the kernel runs when the stream reaches it. A panic inside
    /// the kernel is caught and reported by the next `synchronize`.
    pub fn launch(&self, block_num: u32, kernel: impl Fn(BlockCtx) + Send + Sync + 'static) {
        let label = profiler::label(|| "kernel".into(), "kernel", LaunchKind::Kernel, || ("".into(), 0), block_num);
        self.launch_shared(Launch { block_num, kernel: LaunchKernel::Closure(Arc::new(kernel)), label });
    }

    /// Enqueues a launch and returns its task number (for [`Stream::wait_through`]).
    pub(crate) fn launch_shared(&self, launch: Launch) -> u64 {
        self.enqueue(|_| Task::Launch(launch))
    }

    /// Runs `tasks` in order on the calling thread (with the compute pool) if the stream is idle,
    /// as if they were enqueued and waited for; `None` when the stream has pending work (the
    /// caller enqueues instead). While they run, the worker starts nothing, so work other threads
    /// enqueue meanwhile still runs after them. A kernel panic is returned as an error.
    pub(crate) fn run_here_if_idle(&self, tasks: &[Launch]) -> Option<Result<()>> {
        let inner = self.inner();
        // A stream without a worker runs nothing else meanwhile (unless this thread is running
        // one of its tasks: then it is not idle).
        let _turn = match inner.runner.get() {
            Some(_) if inner.is_running_here() => return None,
            Some(runner) => Some(runner.lock().unwrap()),
            None => None,
        };
        {
            let mut q = inner.queue.lock().unwrap();
            let idle = q.tasks.is_empty()
                && !q.in_place
                && inner.completed.load(Ordering::Acquire) == inner.enqueued.load(Ordering::Acquire);
            if !idle {
                return None;
            }
            q.in_place = true;
        }
        let pool = Pool::global();
        let result = tasks.iter().try_for_each(|launch| launch.run(pool, inner.id));
        let mut q = inner.queue.lock().unwrap();
        q.in_place = false;
        if q.worker_sleeping && !q.tasks.is_empty() {
            inner.work.notify_one();
        }
        Some(result)
    }

    /// Blocks until task `last` has run and reports the first error of tasks `first..=last`
    /// (errors of other tasks stay for their owners or the next `synchronize`).
    pub(crate) fn wait_through(&self, first: u64, last: u64) -> Result<()> {
        let inner = self.inner();
        block_until(inner, last)?;
        let mut errors = inner.errors.lock().unwrap();
        let mine = errors.iter().position(|(seq, _)| (first..=last).contains(seq));
        match mine {
            Some(i) => {
                let (_, e) = errors.remove(i);
                errors.retain(|(seq, _)| !(first..=last).contains(seq));
                Err(e)
            }
            None => Ok(()),
        }
    }

    /// Enqueues a host function (like `aclrtLaunchCallback` / `cudaLaunchHostFunc`). An error it
    /// returns is reported by the next `synchronize`.
    pub fn launch_host_fn(&self, f: impl FnOnce() -> Result<()> + Send + 'static) {
        self.enqueue(|_| Task::HostFn(Box::new(f)));
    }

    /// Makes all work enqueued later on this stream wait until `event`'s latest record completes.
    /// Errors when the event was never recorded.
    pub fn wait_event(&self, event: &Event) -> Result<()> {
        let point = event.latest("Stream::wait_event")?;
        let (on, seq) = (point.stream.clone(), point.seq);
        // The edge goes in before the task can run (and take it out again when it finishes).
        self.enqueue(|at| {
            self.inner().waits.lock().unwrap().push(WaitEdge { at, on: on.clone(), seq });
            Task::Wait { on, seq }
        });
        Ok(())
    }

    /// Blocks until every task enqueued so far has run, then reports (and clears) the first
    /// asynchronous error since the last synchronize.
    pub fn synchronize(&self) -> Result<()> {
        let inner = self.inner();
        block_until(inner, inner.enqueued.load(Ordering::Acquire))?;
        let mut errors = inner.errors.lock().unwrap();
        if errors.is_empty() {
            return Ok(());
        }
        Err(errors.drain(..).min_by_key(|(seq, _)| *seq).map(|(_, e)| e).expect("non-empty"))
    }

    /// Whether all enqueued work has finished (never blocks).
    pub fn query(&self) -> bool {
        let inner = self.inner();
        inner.completed.load(Ordering::Acquire) >= inner.enqueued.load(Ordering::Acquire)
    }
}

impl Default for Stream {
    fn default() -> Self {
        Stream::new()
    }
}

impl std::fmt::Debug for Stream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Stream({})", self.id())
    }
}

fn stream_loop(inner: Arc<StreamInner>) {
    super::pool::use_own_team_on_this_thread();
    let pool = Pool::global();
    let mut taken = 0u64;
    loop {
        // Spin briefly for new work before parking: back-to-back launches are the common case.
        let idle_since = Instant::now();
        let mut spins = 0u32;
        while inner.enqueued.load(Ordering::Acquire) == taken {
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(64) && idle_since.elapsed() > SPIN {
                break;
            }
            std::hint::spin_loop();
        }
        let (seq, task) = {
            let mut q = inner.queue.lock().unwrap();
            loop {
                if !q.in_place {
                    if let Some(t) = q.tasks.pop_front() {
                        break t;
                    }
                }
                if q.shutdown && q.tasks.is_empty() {
                    return;
                }
                q.worker_sleeping = true;
                q = inner.work.wait(q).unwrap();
                q.worker_sleeping = false;
            }
        };
        taken = seq;
        inner.run_task(pool, seq, task);
    }
}

impl StreamInner {
    /// Runs task `seq` on the calling thread and marks it complete.
    fn run_task(self: &Arc<Self>, pool: &Pool, seq: u64, task: Task) {
        RUNNING.with(|r| r.borrow_mut().push((self.clone(), seq)));
        let result = match task {
            Task::Launch(launch) => launch.run(pool, self.id),
            Task::HostFn(f) => catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|p| {
                Err(Error::runtime(format!("host function panicked on stream {}: {}", self.id, panic_message(&*p))))
            }),
            Task::Record(point) => {
                let _ = point.time.set(Instant::now());
                Ok(())
            }
            Task::Wait { on, seq: target } => {
                let r = block_until(&on, target);
                self.waits.lock().unwrap().retain(|w| w.at != seq);
                r
            }
        };
        RUNNING.with(|r| r.borrow_mut().pop());
        if let Err(e) = result {
            self.errors.lock().unwrap().push((seq, e));
        }
        self.completed.store(seq, Ordering::SeqCst);
        if self.done_waiters.load(Ordering::SeqCst) > 0 {
            let _g = self.done_lock.lock().unwrap();
            self.done.notify_all();
        }
    }

    /// Whether this queue belongs to a process this one was forked from: its worker is not here.
    fn is_from_before_fork(&self) -> bool {
        self.generation != fork::generation()
    }

    /// Whether the calling thread is running one of this stream's tasks.
    fn is_running_here(&self) -> bool {
        RUNNING.with(|r| r.borrow().iter().any(|(s, _)| s.id == self.id))
    }

    /// For a stream without a worker: runs every queued task on the calling thread, in order,
    /// unless the thread is already running one of them (a host function enqueuing onto its own
    /// stream: its tasks run after it, from the loop below that called it). Tasks other threads
    /// enqueue meanwhile run here too, or in their own turn, after this one's.
    fn run_queued(self: &Arc<Self>, runner: &Mutex<()>) {
        if self.is_running_here() {
            return;
        }
        let _turn = runner.lock().unwrap();
        let pool = Pool::global();
        loop {
            let Some((seq, task)) = self.queue.lock().unwrap().tasks.pop_front() else { return };
            self.run_task(pool, seq, task);
        }
    }
}

/// In a forked child: the thread's stream tasks were the parent's and never finish here. They are
/// leaked, not dropped: this runs in `fork`'s child handler.
pub(crate) fn forget_running_tasks() {
    RUNNING.with(|r| {
        if let Ok(mut running) = r.try_borrow_mut() {
            std::mem::forget(std::mem::take(&mut *running));
        }
    });
}

/// Blocks the calling thread until `target` has completed task `seq`.
fn block_until(target: &Arc<StreamInner>, seq: u64) -> Result<()> {
    if target.completed.load(Ordering::Acquire) >= seq {
        return Ok(());
    }
    if target.is_from_before_fork() {
        return Err(Error::runtime(format!(
            "waiting for task {seq} of stream {}, enqueued before this process forked: it never runs in this \
             process (pid {})",
            target.id,
            std::process::id()
        )));
    }
    // Every task this thread is running waits with it (more than one where a stream without a
    // worker runs a task inside another's).
    let blocking = RUNNING.with(|r| {
        let running = r.borrow();
        for (me, my_seq) in running.iter() {
            if let Some(why) = find_deadlock(me, *my_seq, target, seq) {
                return Err(Error::runtime(why));
            }
        }
        for (me, my_seq) in running.iter() {
            *me.blocked_on.lock().unwrap() = Some((*my_seq, target.clone(), seq));
        }
        Ok(!running.is_empty())
    })?;
    let idle_since = Instant::now();
    let mut spins = 0u32;
    while target.completed.load(Ordering::Acquire) < seq {
        spins = spins.wrapping_add(1);
        if !spins.is_multiple_of(64) || idle_since.elapsed() < SPIN {
            std::hint::spin_loop();
            continue;
        }
        let mut g = target.done_lock.lock().unwrap();
        target.done_waiters.fetch_add(1, Ordering::SeqCst);
        while target.completed.load(Ordering::SeqCst) < seq {
            g = target.done.wait(g).unwrap();
        }
        target.done_waiters.fetch_sub(1, Ordering::SeqCst);
    }
    if blocking {
        RUNNING.with(|r| r.borrow().iter().for_each(|(me, _)| drop(me.blocked_on.lock().unwrap().take())));
    }
    Ok(())
}

/// Walks "task (stream, n) cannot finish before task (stream', n')" edges from the task being
/// waited for. Reaching the waiting task itself (or anything after it on its stream) means the
/// wait can never complete.
fn find_deadlock(me: &Arc<StreamInner>, my_seq: u64, target: &Arc<StreamInner>, seq: u64) -> Option<String> {
    let mut stack = vec![(target.clone(), seq)];
    let mut visited: HashMap<u64, u64> = HashMap::new();
    while let Some((s, n)) = stack.pop() {
        // A queue from before a fork is never waited for (that wait is an error), and its locks
        // may be held by threads that are not in this process.
        if s.completed.load(Ordering::Acquire) >= n || s.is_from_before_fork() {
            continue;
        }
        if s.id == me.id {
            if n >= my_seq {
                return Some(format!(
                    "deadlock: task {my_seq} on stream {} blocks waiting for task {seq} on stream {}, which can only run after task {my_seq} itself finishes",
                    me.id, target.id
                ));
            }
            continue;
        }
        if visited.get(&s.id).is_some_and(|&v| v >= n) {
            continue;
        }
        visited.insert(s.id, n);
        for w in s.waits.lock().unwrap().iter().filter(|w| w.at <= n) {
            stack.push((w.on.clone(), w.seq));
        }
        if let Some((at, on, on_seq)) = s.blocked_on.lock().unwrap().as_ref() {
            if *at <= n {
                stack.push((on.clone(), *on_seq));
            }
        }
    }
    None
}

struct RecordPoint {
    stream: Arc<StreamInner>,
    seq: u64,
    time: OnceLock<Instant>,
}

impl RecordPoint {
    fn is_complete(&self) -> bool {
        self.stream.completed.load(Ordering::Acquire) >= self.seq
    }
}

/// A marker in a stream's task order: record it, then query, wait for it from the host, make
/// another stream wait for it, or time the distance between two events.
#[derive(Clone, Default)]
pub struct Event {
    latest: Arc<Mutex<Option<Arc<RecordPoint>>>>,
}

impl Event {
    pub fn new() -> Event {
        Event::default()
    }

    /// Records the event at the current end of `stream`'s queue (replacing any earlier record).
    pub fn record(&self, stream: &Stream) {
        let mut slot = self.latest.lock().unwrap();
        let mut point = None;
        stream.enqueue(|seq| {
            let p = Arc::new(RecordPoint { stream: stream.inner().clone(), seq, time: OnceLock::new() });
            point = Some(p.clone());
            Task::Record(p)
        });
        *slot = point;
    }

    fn latest(&self, what: &str) -> Result<Arc<RecordPoint>> {
        self.latest.lock().unwrap().clone().ok_or_else(|| {
            Error::invalid(format!("{what}: the event was never recorded (call Event::record on a stream first)"))
        })
    }

    /// Whether the latest record has been reached. Errors when the event was never recorded.
    pub fn query(&self) -> Result<bool> {
        Ok(self.latest("Event::query")?.is_complete())
    }

    /// Blocks until the latest record has been reached.
    pub fn synchronize(&self) -> Result<()> {
        let p = self.latest("Event::synchronize")?;
        block_until(&p.stream, p.seq)
    }

    /// Milliseconds from `start`'s record to `end`'s record. Both must be recorded and complete.
    pub fn elapsed_ms(start: &Event, end: &Event) -> Result<f64> {
        let (a, b) = (start.latest("Event::elapsed_ms (start)")?, end.latest("Event::elapsed_ms (end)")?);
        match (a.time.get(), b.time.get()) {
            (Some(ta), Some(tb)) => {
                let ms =
                    if tb >= ta { tb.duration_since(*ta).as_secs_f64() } else { -ta.duration_since(*tb).as_secs_f64() };
                Ok(ms * 1e3)
            }
            _ => Err(Error::invalid("Event::elapsed_ms: an event has not completed yet (synchronize it first)")),
        }
    }
}

impl std::fmt::Debug for Event {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.latest.lock().unwrap().as_ref() {
            Some(p) => write!(f, "Event(stream {}, task {})", p.stream.id, p.seq),
            None => write!(f, "Event(never recorded)"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU32;

    fn one_block(kernel: &KernelFn) -> [Launch; 1] {
        [Launch { block_num: 1, kernel: LaunchKernel::Closure(kernel.clone()), label: None }]
    }

    /// Work another thread enqueues while a caller runs in place still runs after it, and a busy
    /// stream refuses in-place work.
    #[test]
    fn in_place_runs_keep_stream_order() {
        let stream = Stream::new();
        let state = Arc::new(AtomicU32::new(0));
        let seen = Arc::new(AtomicU32::new(u32::MAX));
        let s = state.clone();
        let slow: KernelFn = Arc::new(move |_| {
            std::thread::sleep(Duration::from_millis(60));
            s.store(1, Ordering::SeqCst);
        });
        let runner = {
            let stream = stream.clone();
            std::thread::spawn(move || stream.run_here_if_idle(&one_block(&slow)))
        };
        std::thread::sleep(Duration::from_millis(15));
        let (st, sn) = (state.clone(), seen.clone());
        stream.launch(1, move |_| sn.store(st.load(Ordering::SeqCst), Ordering::SeqCst));
        assert!(matches!(runner.join().unwrap(), Some(Ok(()))));
        stream.synchronize().unwrap();
        assert_eq!(seen.load(Ordering::SeqCst), 1, "the enqueued kernel ran after the in-place one");

        let gate = Arc::new(AtomicU32::new(0));
        let g = gate.clone();
        stream.launch(1, move |_| {
            while g.load(Ordering::SeqCst) == 0 {
                std::hint::spin_loop();
            }
        });
        let noop: KernelFn = Arc::new(|_| {});
        assert!(stream.run_here_if_idle(&one_block(&noop)).is_none(), "a busy stream runs nothing in place");
        gate.store(1, Ordering::SeqCst);
        stream.synchronize().unwrap();
        let panicking: KernelFn = Arc::new(|_| panic!("boom"));
        let err = stream.run_here_if_idle(&one_block(&panicking)).unwrap().unwrap_err();
        assert!(err.message().contains("kernel panicked") && err.message().contains("boom"), "{err}");
        assert!(stream.run_here_if_idle(&one_block(&noop)).unwrap().is_ok(), "the stream is usable after a panic");
    }
}
