//! Surviving `fork()`: a child process gets a copy of the parent's memory but only the thread that
//! called `fork`. PyTorch's `DataLoader` forks its workers by default on Linux, and
//! `multiprocessing` did up to Python 3.14, so a process that used uniop gets forked in practice.
//!
//! In the child, the compute pool's workers and every stream's worker are gone, work they had queued
//! never runs, and a lock another thread held at the fork stays held. Three rules keep the child
//! working, as PyTorch's `pthread_atfork` handler does for its own thread pool:
//! - Everything that owns threads lives in a [`PerProcess`] slot: the first use in a child builds
//!   it anew (a pool with fresh workers, a stream with a fresh worker), and the parent's copy is
//!   leaked, never touched: its locks may be held by threads that do not exist here.
//! - The locks every call takes (the op registry's, the allocator's, the profiler's while it
//!   records, and frontends' such as the C API's handle table) are held across the fork itself
//!   ([`prepare`]), so the child receives them unlocked and consistent.
//! - Work queued before the fork is reported, not waited for: a stream's first `synchronize` in
//!   the child names the tasks it lost, and waiting for an event recorded behind them is an error.
//!
//! Telling a child from its parent costs one atomic load of a generation counter that the child
//! handler bumps, not a system call (`getpid` is not cached by glibc since 2.25).

use std::any::Any;
use std::cell::RefCell;
use std::ptr;
use std::sync::atomic::{AtomicPtr, AtomicU64, Ordering};
use std::sync::{Mutex, Once, OnceLock};

static GENERATION: AtomicU64 = AtomicU64::new(0);

/// How many forks separate this process from the one that first used uniop: 0 there, one more in
/// each generation of children.
pub(crate) fn generation() -> u64 {
    GENERATION.load(Ordering::Acquire)
}

/// Takes a frontend's lock for the length of a fork and returns its guard (`None` while the lock
/// does not exist yet).
type Hold = Box<dyn Fn() -> Option<Box<dyn Any>> + Send>;

/// Frontends' locks to hold across a fork, in the order they were added.
static FRONTEND_LOCKS: Mutex<Vec<Hold>> = Mutex::new(Vec::new());

/// Makes every fork wait until no other thread holds `lock` (a C API handle table, say), so that
/// the child gets it unlocked. Call it from the lock's initializer. Frontends' locks are taken
/// before the core's, as calls take them: a frontend calls into the core while holding its own
/// lock, never the other way round.
pub fn hold_across_fork<T: Send + 'static>(lock: &'static OnceLock<Mutex<T>>) {
    install();
    // `get`, not `get_or_init`: the fork must not wait for a lock still being created.
    let hold: Hold = Box::new(|| {
        let guard = lock.get()?.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        Some(Box::new(guard))
    });
    FRONTEND_LOCKS.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).push(hold);
}

thread_local! {
    /// The locks [`prepare`] holds while the calling thread forks.
    static HELD: RefCell<Vec<Box<dyn Any>>> = const { RefCell::new(Vec::new()) };
}

/// Registers the fork handlers, once per process; every owner of threads or locks calls it before
/// it creates them.
pub(crate) fn install() {
    static INSTALLED: Once = Once::new();
    INSTALLED.call_once(|| {
        // SAFETY: three `extern "C"` handlers that live as long as the process.
        let status = unsafe { libc::pthread_atfork(Some(prepare), Some(release), Some(child)) };
        if status != 0 {
            eprintln!("uniop: pthread_atfork failed ({status}); a forked child may wait on the parent's threads");
        }
    })
}

/// Before `fork`: takes the frontends', the registry's, the allocator's and the profiler's locks
/// (in the order calls take them), so no other thread holds them at the moment of the fork.
extern "C" fn prepare() {
    // The list itself is held too: a child must be able to add to it.
    let frontends = FRONTEND_LOCKS.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let mut held: Vec<Box<dyn Any>> = frontends.iter().filter_map(|hold| hold()).collect();
    held.push(Box::new(frontends));
    held.extend(crate::registry::Registry::hold_for_fork());
    held.extend(super::alloc::Allocator::hold_for_fork());
    held.push(super::profiler::hold_for_fork());
    HELD.with(|h| *h.borrow_mut() = held);
}

/// After `fork`, in the parent: lets the locks go.
extern "C" fn release() {
    HELD.with(|h| h.borrow_mut().clear());
}

/// After `fork`, in the child: a new generation, the locks released, and no stream task running
/// on this thread any more (the copy of one that was would never finish here).
extern "C" fn child() {
    GENERATION.fetch_add(1, Ordering::AcqRel);
    release();
    super::stream::forget_running_tasks();
}

/// A value that is built anew in each process forked from the one that built it — for values that
/// own threads, which a child does not inherit. The parent's copy is leaked in the child, never
/// used or dropped there: dropping it would join threads that do not exist and take locks that
/// may stay held forever.
pub(crate) struct PerProcess<T> {
    slot: AtomicPtr<Slot<T>>,
}

struct Slot<T> {
    generation: u64,
    value: OnceLock<T>,
}

impl<T> PerProcess<T> {
    pub(crate) const fn new() -> Self {
        PerProcess { slot: AtomicPtr::new(ptr::null_mut()) }
    }

    /// This process's value, built by `build` on its first use here; `build` receives the value
    /// of the process this one was forked from, if there was one (to read what it left behind,
    /// through atomics only).
    pub(crate) fn get_or_init(&self, build: impl FnOnce(Option<&T>) -> T) -> &T {
        self.get_or_init_in(generation(), build)
    }

    fn get_or_init_in(&self, generation: u64, build: impl FnOnce(Option<&T>) -> T) -> &T {
        let mut build = Some(build);
        loop {
            let current = self.slot.load(Ordering::Acquire);
            // SAFETY: a published slot is freed only by `drop` (which has `&mut self`).
            let inherited = match unsafe { current.as_ref() } {
                Some(slot) if slot.generation == generation => {
                    return slot.value.get_or_init(|| build.take().expect("built once")(None));
                }
                Some(slot) => slot.value.get(),
                None => None,
            };
            let fresh = Box::into_raw(Box::new(Slot { generation, value: OnceLock::new() }));
            match self.slot.compare_exchange(current, fresh, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => {
                    // SAFETY: just published; the parent's slot is leaked, never freed.
                    let slot = unsafe { &*fresh };
                    return slot.value.get_or_init(|| build.take().expect("built once")(inherited));
                }
                // Another thread of this process published first: use its slot.
                // SAFETY: `fresh` was never published.
                Err(_) => drop(unsafe { Box::from_raw(fresh) }),
            }
        }
    }

    /// A slot holding `value` for the current process.
    pub(crate) fn with(value: T) -> Self {
        let slot = Slot { generation: generation(), value: OnceLock::from(value) };
        PerProcess { slot: AtomicPtr::new(Box::into_raw(Box::new(slot))) }
    }
}

impl<T> Drop for PerProcess<T> {
    fn drop(&mut self) {
        let current = *self.slot.get_mut();
        if current.is_null() {
            return;
        }
        // SAFETY: the slot was published by `get_or_init` or `with` and is owned by `self`.
        let slot = unsafe { Box::from_raw(current) };
        if slot.generation != generation() {
            // A parent's value: its threads are not in this process.
            std::mem::forget(slot);
        }
    }
}

// SAFETY: a `PerProcess<T>` hands out `&T` to any thread, as a `OnceLock<T>` does.
unsafe impl<T: Send + Sync> Sync for PerProcess<T> {}
// SAFETY: it owns its `T`, as a `Box<T>` does.
unsafe impl<T: Send> Send for PerProcess<T> {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_new_generation_builds_a_new_value_that_sees_the_old_one() {
        // Generations passed in, not bumped: other tests of this binary use the real counter.
        let now = generation();
        let slot = PerProcess::with(1);
        assert_eq!(*slot.get_or_init_in(now, |_| unreachable!("built already")), 1);
        assert_eq!(*slot.get_or_init_in(now + 1, |old| old.copied().unwrap() + 1), 2);
        assert_eq!(*slot.get_or_init_in(now + 1, |_| unreachable!("built once per process")), 2);
        let lazy: PerProcess<u32> = PerProcess::new();
        assert_eq!(*lazy.get_or_init_in(now, |old| old.map_or(7, |o| o + 1)), 7);
    }
}
