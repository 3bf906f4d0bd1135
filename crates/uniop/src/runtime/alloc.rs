//! The caching allocator for device (here: host) memory.
//!
//! Why cache: on these machines the first write to a fresh page runs at ~2 GB/s while reused
//! memory runs at ~40 GB/s, so an op that gets fresh memory per call loses to the page-fault path,
//! not to its math. Freed blocks therefore go back to per-size-class free lists and are handed out
//! again; `empty_cache` returns them to the OS.
//!
//! Size classes: small requests (≤ 1 MiB) round up to one of four classes per power of two (≤ 25%
//! waste) and come from the system heap with 64-byte alignment; large requests round up to a
//! multiple of 2 MiB and are `mmap`ed on a 2 MiB boundary so transparent huge pages can back them.
//! The [`MemPolicy`] decides the huge-page advice, as `aclrtMalloc`'s policies do.
//!
//! Why the cache is bounded: shapes that change from call to call (a sequence length per batch, a
//! prompt per request) give large outputs a new class nearly every time. Cached by exact class
//! alone, each would keep its block for a request of its own size that may never come, and memory
//! would grow with the number of shapes seen (four `silu` calls 4 MiB apart held 2 GiB for a
//! 0.5 GiB working set). So a large request with no block of its class takes the smallest larger
//! cached block of its kind: whole when at most twice the request, else with the surplus tail
//! returned to the OS (`munmap` of whole 2 MiB pages; the pages it keeps are already faulted in).
//! And the free blocks held never exceed twice the most bytes ever live at once. Twice, because a
//! loop with fixed shapes can need more distinct blocks than it holds at its peak (one freed before
//! a block of another size is taken) and must keep them all to stay off the OS; a loop with
//! changing shapes then holds at most three times its peak. (A tiny Llama trained on lengths drawn
//! from 128–640: 1.20 GiB reserved for a 0.27 GiB peak before, 0.53 GiB after, steps level.)

use crate::error::{Error, ErrorCode, Result};
use rustc_hash::FxHashMap;
use std::fmt::Write as _;
use std::ptr::NonNull;
use std::sync::{Mutex, OnceLock};

pub const ALIGNMENT: usize = 64;
const SMALL_LIMIT: usize = 1 << 20;
const HUGE_PAGE: usize = 2 << 20;

/// Where large blocks come from (names follow `aclrtMemMallocPolicy`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum MemPolicy {
    /// Huge-page-advised when the block is large enough, normal pages otherwise.
    #[default]
    HugeFirst,
    /// Always huge-page-advised (the size rounds up to 2 MiB); fails if huge pages are disabled.
    HugeOnly,
    /// Never huge pages.
    NormalOnly,
}

impl MemPolicy {
    pub fn parse(s: &str) -> Result<MemPolicy> {
        match s.to_ascii_uppercase().as_str() {
            "HUGE_FIRST" => Ok(MemPolicy::HugeFirst),
            "HUGE_ONLY" => Ok(MemPolicy::HugeOnly),
            "NORMAL_ONLY" => Ok(MemPolicy::NormalOnly),
            _ => Err(Error::invalid(format!(
                "unknown memory policy '{s}': expected HUGE_FIRST, HUGE_ONLY or NORMAL_ONLY"
            ))),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Source {
    Heap,
    Mmap { huge: bool },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct Class {
    size: usize,
    source: Source,
}

struct Block {
    ptr: NonNull<u8>,
    class: Class,
}

// SAFETY: a block is plain memory owned by exactly one holder (free list or buffer).
unsafe impl Send for Block {}

/// Counters in bytes and calls. `allocated`/`reserved` count whole blocks (class sizes).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemStats {
    /// Bytes in blocks currently handed out.
    pub allocated: usize,
    /// Bytes held from the OS: handed out plus cached.
    pub reserved: usize,
    /// High-water mark of `allocated` since start or [`Allocator::reset_peak`].
    pub peak_allocated: usize,
    /// Bytes the callers asked for (before rounding), currently live.
    pub requested: usize,
    pub alloc_count: u64,
    pub free_count: u64,
    /// Allocations served from the cache instead of the OS.
    pub cache_hits: u64,
    /// Blocks obtained from the OS.
    pub os_allocs: u64,
    /// Live buffers (allocations minus frees).
    pub live_buffers: usize,
    /// Times the OS refused a block and the cache was emptied to ask again (PyTorch's
    /// `num_alloc_retries`): a loop that keeps doing this runs near its memory limit.
    pub alloc_retries: u64,
    /// Allocations that failed even after that (PyTorch's `num_ooms`).
    pub ooms: u64,
}

/// Fx hashing: these maps are touched several times per allocation, and SipHash's DoS
/// resistance buys nothing for keys the runtime itself computes.
#[derive(Default)]
struct State {
    free: FxHashMap<Class, Vec<Block>>,
    stats: MemStats,
    /// The most bytes ever allocated at once (never reset, unlike `stats.peak_allocated`): the free
    /// blocks may hold twice as much.
    most_allocated: usize,
    /// Live blocks by class size, for the leak report.
    live_by_size: FxHashMap<usize, usize>,
}

pub struct Allocator {
    state: Mutex<State>,
}

/// A block of device memory from the caching allocator. Returned to the cache on drop.
pub struct DeviceBuffer {
    ptr: NonNull<u8>,
    len: usize,
    class: Option<Class>,
    allocator: &'static Allocator,
}

// SAFETY: device memory is plain bytes; synchronisation of its contents is the user's (stream order).
unsafe impl Send for DeviceBuffer {}
unsafe impl Sync for DeviceBuffer {}

impl DeviceBuffer {
    /// Requested size in bytes.
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Bytes actually reserved for this buffer (its size class).
    pub fn capacity(&self) -> usize {
        self.class.map_or(0, |c| c.size)
    }
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }
    pub fn is_huge_page_advised(&self) -> bool {
        matches!(self.class, Some(Class { source: Source::Mmap { huge: true }, .. }))
    }
    /// # Safety
    /// No kernel may be writing the buffer concurrently (synchronize the streams that use it).
    pub unsafe fn as_slice(&self) -> &[u8] {
        std::slice::from_raw_parts(self.ptr.as_ptr(), self.len)
    }
    /// # Safety
    /// No kernel may be reading or writing the buffer concurrently, and no other slice of it may
    /// be alive.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn as_mut_slice(&self) -> &mut [u8] {
        std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len)
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        if let Some(class) = self.class {
            self.allocator.release(Block { ptr: self.ptr, class }, self.len);
        }
    }
}

impl std::fmt::Debug for DeviceBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DeviceBuffer({} bytes at {:p})", self.len, self.ptr)
    }
}

impl Block {
    /// This block as one of `class` (same source, no larger): a mapped block's pages past
    /// `class.size` go back to the OS.
    fn trimmed_to(self, class: Class) -> Block {
        if self.class.size > class.size {
            // SAFETY: the tail lies inside this block's mapping (sizes are multiples of 2 MiB, so
            // the cut is page-aligned) and nothing references it.
            unsafe {
                libc::munmap(self.ptr.as_ptr().add(class.size).cast(), self.class.size - class.size);
            }
        }
        Block { ptr: self.ptr, class }
    }
}

fn small_class(size: usize) -> usize {
    if size <= ALIGNMENT {
        return ALIGNMENT;
    }
    // Four classes per power of two (2^k, 1.25·2^k, 1.5·2^k, 1.75·2^k), in steps of at least 64.
    let pow = usize::BITS - 1 - (size - 1).leading_zeros();
    let step = ((1usize << pow) / 4).max(ALIGNMENT);
    size.div_ceil(step) * step
}

/// `bytes` as the summary and the errors print them: "12.50 MiB".
fn mib(bytes: usize) -> String {
    format!("{:.2} MiB", bytes as f64 / (1 << 20) as f64)
}

fn huge_pages_enabled() -> bool {
    std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled")
        .map(|s| !s.contains("[never]"))
        .unwrap_or(false)
}

fn oom(size: usize, why: impl std::fmt::Display) -> Error {
    Error::new(ErrorCode::Runtime, format!("out of memory: allocating {size} bytes failed ({why})"))
}

static GLOBAL: OnceLock<Allocator> = OnceLock::new();

impl Allocator {
    /// The process-wide allocator for the CPU device.
    pub fn global() -> &'static Allocator {
        GLOBAL.get_or_init(|| {
            super::fork::install();
            Allocator { state: Mutex::new(State::default()) }
        })
    }

    /// The global allocator's lock, held by [`fork`](super::fork)'s handler while the process
    /// forks, so the child's allocator is never caught halfway through an update.
    pub(crate) fn hold_for_fork() -> Option<Box<dyn std::any::Any>> {
        let guard = GLOBAL.get()?.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        Some(Box::new(guard))
    }

    fn class_for(size: usize, policy: MemPolicy) -> Result<Class> {
        let round_huge = |s: usize| {
            s.checked_next_multiple_of(HUGE_PAGE).ok_or_else(|| oom(size, "size overflows when rounded to 2 MiB"))
        };
        Ok(match policy {
            MemPolicy::HugeOnly => {
                if !huge_pages_enabled() {
                    return Err(Error::new(
                        ErrorCode::Runtime,
                        format!("allocating {size} bytes with HUGE_ONLY: transparent huge pages are disabled on this machine (use HUGE_FIRST)"),
                    ));
                }
                Class { size: round_huge(size)?, source: Source::Mmap { huge: true } }
            }
            _ if size <= SMALL_LIMIT => Class { size: small_class(size), source: Source::Heap },
            MemPolicy::HugeFirst => Class { size: round_huge(size)?, source: Source::Mmap { huge: true } },
            MemPolicy::NormalOnly => Class { size: round_huge(size)?, source: Source::Mmap { huge: false } },
        })
    }

    /// Allocates `size` bytes, 64-byte aligned, served from the cache when a block of the same
    /// class is free. Zero bytes is valid and takes no memory.
    pub fn allocate(&'static self, size: usize, policy: MemPolicy) -> Result<DeviceBuffer> {
        if size == 0 {
            let ptr = NonNull::new(ALIGNMENT as *mut u8).expect("non-zero");
            return Ok(DeviceBuffer { ptr, len: 0, class: None, allocator: self });
        }
        if size > isize::MAX as usize / 2 {
            return Err(oom(size, "larger than the address space allows"));
        }
        let class = Self::class_for(size, policy)?;
        let cached = {
            let mut st = self.state.lock().unwrap();
            let taken = st.take_cached(class);
            if let Some((_, given)) = taken {
                st.stats.cache_hits += 1;
                st.note_alloc(given.size, size);
            }
            taken
        };
        let block = match cached {
            Some((block, given)) => block.trimmed_to(given),
            None => {
                let b =
                    Self::os_alloc(class, size).or_else(|refused| self.retry_after_emptying(class, size, refused))?;
                let mut st = self.state.lock().unwrap();
                st.stats.os_allocs += 1;
                st.stats.reserved += class.size;
                st.note_alloc(class.size, size);
                b
            }
        };
        Ok(DeviceBuffer { ptr: block.ptr, len: size, class: Some(block.class), allocator: self })
    }

    fn os_alloc(class: Class, requested: usize) -> Result<Block> {
        let ptr = match class.source {
            Source::Heap => {
                let layout =
                    std::alloc::Layout::from_size_align(class.size, ALIGNMENT).map_err(|e| oom(requested, e))?;
                // SAFETY: layout has non-zero size.
                NonNull::new(unsafe { std::alloc::alloc(layout) })
                    .ok_or_else(|| oom(requested, "the system heap refused"))?
            }
            Source::Mmap { huge } => {
                // Over-map by one huge page and trim so the block starts on a 2 MiB boundary.
                let map_len = class.size + HUGE_PAGE;
                // SAFETY: anonymous private mapping; arguments are valid.
                let raw = unsafe {
                    libc::mmap(
                        std::ptr::null_mut(),
                        map_len,
                        libc::PROT_READ | libc::PROT_WRITE,
                        libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                        -1,
                        0,
                    )
                };
                if raw == libc::MAP_FAILED {
                    return Err(oom(requested, std::io::Error::last_os_error()));
                }
                let start = raw as usize;
                let aligned = start.next_multiple_of(HUGE_PAGE);
                // SAFETY: both ranges lie inside the mapping just made.
                unsafe {
                    if aligned > start {
                        libc::munmap(raw, aligned - start);
                    }
                    let tail = start + map_len - (aligned + class.size);
                    if tail > 0 {
                        libc::munmap((aligned + class.size) as *mut libc::c_void, tail);
                    }
                    let advice = if huge { libc::MADV_HUGEPAGE } else { libc::MADV_NOHUGEPAGE };
                    libc::madvise(aligned as *mut libc::c_void, class.size, advice);
                }
                NonNull::new(aligned as *mut u8).expect("mmap never returns null on success")
            }
        };
        Ok(Block { ptr, class })
    }

    /// The OS refused `class`: returns every cached block to it and asks once more, as PyTorch's
    /// CUDA allocator does. The cache may hold up to twice the peak in blocks of other sizes, which
    /// is what a process near its memory limit (a cgroup, `ulimit -v`, strict overcommit) needs
    /// back. When the OS refuses again, the error says what uniop holds, so the caller can tell its
    /// own live tensors from memory used elsewhere.
    fn retry_after_emptying(&self, class: Class, requested: usize, refused: Error) -> Result<Block> {
        let released = self.take_free_blocks();
        let freed: usize = released.iter().map(|b| b.class.size).sum();
        released.into_iter().for_each(Self::os_free);
        self.state.lock().unwrap().stats.alloc_retries += 1;
        Self::os_alloc(class, requested).map_err(|_| {
            let mut st = self.state.lock().unwrap();
            st.stats.ooms += 1;
            Error::new(
                ErrorCode::Runtime,
                format!(
                    "{}, also after returning {} of cached blocks to the OS; uniop holds {} in {} live buffers",
                    refused.message(),
                    mib(freed),
                    mib(st.stats.allocated),
                    st.stats.live_buffers
                ),
            )
        })
    }

    fn os_free(block: Block) {
        // SAFETY: the block came from `os_alloc` with this class and is no longer referenced.
        unsafe {
            match block.class.source {
                Source::Heap => {
                    let layout = std::alloc::Layout::from_size_align_unchecked(block.class.size, ALIGNMENT);
                    std::alloc::dealloc(block.ptr.as_ptr(), layout);
                }
                Source::Mmap { .. } => {
                    libc::munmap(block.ptr.as_ptr() as *mut libc::c_void, block.class.size);
                }
            }
        }
    }

    fn release(&self, block: Block, requested: usize) {
        let mut st = self.state.lock().unwrap();
        let size = block.class.size;
        st.stats.allocated -= size;
        st.stats.requested -= requested;
        st.stats.free_count += 1;
        st.stats.live_buffers -= 1;
        if let Some(n) = st.live_by_size.get_mut(&size) {
            *n -= 1;
            if *n == 0 {
                st.live_by_size.remove(&size);
            }
        }
        st.free.entry(block.class).or_default().push(block);
        let evicted = st.evict_over_limit();
        drop(st);
        evicted.into_iter().for_each(Self::os_free);
    }

    /// Returns every cached (free) block to the OS. Live buffers are untouched.
    pub fn empty_cache(&self) {
        self.take_free_blocks().into_iter().for_each(Self::os_free);
    }

    /// Every cached block, out of the cache and of `reserved`, for the caller to return to the OS
    /// once the lock is dropped.
    fn take_free_blocks(&self) -> Vec<Block> {
        let mut st = self.state.lock().unwrap();
        let blocks: Vec<Block> = st.free.drain().flat_map(|(_, v)| v).collect();
        st.stats.reserved -= blocks.iter().map(|b| b.class.size).sum::<usize>();
        blocks
    }

    pub fn stats(&self) -> MemStats {
        self.state.lock().unwrap().stats
    }

    pub fn reset_peak(&self) {
        let mut st = self.state.lock().unwrap();
        st.stats.peak_allocated = st.stats.allocated;
    }

    /// A human-readable table of the counters (like `torch.cuda.memory_summary`).
    pub fn memory_summary(&self) -> String {
        let s = self.stats();
        let cached = s.reserved - s.allocated;
        let rows: [(&str, String); 10] = [
            ("allocated (blocks in use)", mib(s.allocated)),
            ("requested by callers", mib(s.requested)),
            ("peak allocated", mib(s.peak_allocated)),
            ("reserved from the OS", mib(s.reserved)),
            ("cached, free for reuse", mib(cached)),
            ("live buffers", s.live_buffers.to_string()),
            ("allocations / frees", format!("{} / {}", s.alloc_count, s.free_count)),
            ("served from cache", s.cache_hits.to_string()),
            ("blocks from the OS", s.os_allocs.to_string()),
            ("alloc retries / OOMs", format!("{} / {}", s.alloc_retries, s.ooms)),
        ];
        let mut out = String::from("uniop memory summary (device cpu)\n");
        let _ = writeln!(out, "{:-<44}", "");
        for (k, v) in rows {
            let _ = writeln!(out, "{k:<28}{v:>16}");
        }
        let _ = write!(out, "{:-<44}", "");
        out
    }

    /// `None` when no buffer is live; otherwise a report of the live buffers by size.
    pub fn leak_report(&self) -> Option<String> {
        let st = self.state.lock().unwrap();
        if st.stats.live_buffers == 0 {
            return None;
        }
        let mut sizes: Vec<(usize, usize)> = st.live_by_size.iter().map(|(&s, &n)| (s, n)).collect();
        sizes.sort_unstable_by_key(|&(size, _)| std::cmp::Reverse(size));
        let mut out = format!(
            "uniop: {} device buffer(s) still allocated ({} bytes requested, {} bytes in blocks):\n",
            st.stats.live_buffers, st.stats.requested, st.stats.allocated
        );
        for (size, n) in sizes {
            let _ = writeln!(out, "  {n} × block of {size} bytes");
        }
        Some(out)
    }
}

impl State {
    /// A free block for a request of `class`, and the class it is handed out as: one of the class
    /// itself, else (for a mapped class) the smallest larger mapped block with the same huge-page
    /// advice — whole when at most twice the class (it goes back to the cache at its size, for the
    /// larger requests that shapes changing up and down bring back), else trimmed to the class by
    /// the caller ([`Block::trimmed_to`]; `reserved` already counts the surplus as returned).
    fn take_cached(&mut self, class: Class) -> Option<(Block, Class)> {
        if let Some(block) = self.free.get_mut(&class).and_then(|v| v.pop()) {
            return Some((block, class));
        }
        if class.source == Source::Heap {
            return None;
        }
        let larger = self
            .free
            .iter()
            .filter(|(c, blocks)| c.source == class.source && c.size > class.size && !blocks.is_empty())
            .map(|(c, _)| *c)
            .min_by_key(|c| c.size)?;
        let block = self.free.get_mut(&larger).and_then(|v| v.pop())?;
        if larger.size <= 2 * class.size {
            return Some((block, larger));
        }
        self.stats.reserved -= larger.size - class.size;
        Some((block, class))
    }

    /// Takes free blocks out of the cache, for the caller to return to the OS, while they hold more
    /// than twice [`State::most_allocated`]: mapped blocks first, smallest first (a larger block
    /// can serve more requests), then heap blocks (the small classes every tiny call reuses).
    fn evict_over_limit(&mut self) -> Vec<Block> {
        let mut evicted = Vec::new();
        let cached = self.stats.reserved - self.stats.allocated;
        let mut excess = cached.saturating_sub(2 * self.most_allocated);
        if excess == 0 {
            return evicted;
        }
        let mut classes: Vec<Class> = self.free.keys().copied().collect();
        classes.sort_unstable_by_key(|c| (c.source == Source::Heap, c.size));
        for class in classes {
            let blocks = self.free.get_mut(&class).expect("a key just listed");
            while excess > 0 {
                let Some(block) = blocks.pop() else { break };
                self.stats.reserved -= class.size;
                excess = excess.saturating_sub(class.size);
                evicted.push(block);
            }
            if blocks.is_empty() {
                self.free.remove(&class);
            }
        }
        evicted
    }

    fn note_alloc(&mut self, class_size: usize, requested: usize) {
        let s = &mut self.stats;
        s.allocated += class_size;
        s.requested += requested;
        s.peak_allocated = s.peak_allocated.max(s.allocated);
        self.most_allocated = self.most_allocated.max(s.allocated);
        s.alloc_count += 1;
        s.live_buffers += 1;
        *self.live_by_size.entry(class_size).or_default() += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_classes_waste_at_most_a_quarter() {
        for size in (1..5000).chain([SMALL_LIMIT - 1, SMALL_LIMIT]) {
            let c = small_class(size);
            assert!(c >= size && c.is_multiple_of(ALIGNMENT), "{size} -> {c}");
            assert!(c <= (size + size / 4).max(size + ALIGNMENT), "{size} -> {c}");
        }
    }

    /// An allocator of the test's own: the global one's counters move with every other test.
    fn fresh() -> &'static Allocator {
        Box::leak(Box::new(Allocator { state: Mutex::new(State::default()) }))
    }

    const MIB: usize = 1 << 20;

    #[test]
    fn a_fixed_working_set_stays_cached() {
        let alloc = fresh();
        for _ in 0..3 {
            let a = alloc.allocate(4 * MIB, MemPolicy::NormalOnly).unwrap();
            let b = alloc.allocate(6 * MIB, MemPolicy::NormalOnly).unwrap();
            let c = alloc.allocate(1000, MemPolicy::NormalOnly).unwrap();
            drop((a, b, c));
        }
        let s = alloc.stats();
        assert_eq!((s.os_allocs, s.cache_hits), (3, 6));
        assert_eq!(s.reserved, 10 * MIB + small_class(1000));
        // One block at a time, two sizes: more cached than ever live, and still no trip to the OS.
        let alloc = fresh();
        for _ in 0..3 {
            drop(alloc.allocate(4 * MIB, MemPolicy::NormalOnly).unwrap());
            drop(alloc.allocate(14 * MIB, MemPolicy::NormalOnly).unwrap());
        }
        let s = alloc.stats();
        assert_eq!((s.os_allocs, s.cache_hits, s.reserved), (2, 4, 18 * MIB));
    }

    #[test]
    fn a_smaller_large_request_takes_a_larger_free_block() {
        let alloc = fresh();
        let first = alloc.allocate(9 * MIB, MemPolicy::NormalOnly).unwrap();
        let address = first.as_ptr();
        drop(first);
        let reused = alloc.allocate(3 * MIB + 5, MemPolicy::NormalOnly).unwrap();
        assert_eq!(reused.as_ptr(), address);
        assert_eq!(reused.capacity(), 4 * MIB);
        // SAFETY: the buffer is this test's alone.
        let bytes = unsafe { reused.as_mut_slice() };
        bytes.fill(7);
        assert!(bytes.iter().all(|&b| b == 7));
        let s = alloc.stats();
        assert_eq!((s.os_allocs, s.cache_hits, s.reserved), (1, 1, 4 * MIB));
        // Up to twice the request, a larger block is handed out whole (and cached at its size again).
        drop(reused);
        alloc.empty_cache();
        drop(alloc.allocate(6 * MIB, MemPolicy::NormalOnly).unwrap());
        let whole = alloc.allocate(3 * MIB, MemPolicy::NormalOnly).unwrap();
        assert_eq!((whole.len(), whole.capacity()), (3 * MIB, 6 * MIB));
        drop(whole);
        let s = alloc.stats();
        assert_eq!((s.os_allocs, s.cache_hits, s.reserved), (2, 2, 6 * MIB));
        // A huge-page-advised block is another kind: it is not handed out for a normal one.
        drop(alloc.allocate(2 * MIB, MemPolicy::HugeFirst).unwrap());
        assert_eq!(alloc.stats().os_allocs, 3);
    }

    #[test]
    fn free_blocks_never_hold_more_than_twice_the_most_ever_live() {
        let alloc = fresh();
        // Growing shapes: no free block fits the next request.
        for size in [4, 6, 8, 10].map(|m| m * MIB) {
            drop(alloc.allocate(size, MemPolicy::NormalOnly).unwrap());
            let s = alloc.stats();
            assert!(s.reserved <= 2 * s.peak_allocated, "{size}: {s:?}");
        }
        // The smallest mapped blocks went first: 4 MiB when 8 came back, 6 MiB when 10 did.
        let s = alloc.stats();
        assert_eq!((s.os_allocs, s.reserved), (4, 18 * MIB));
        let (a, b) = (alloc.allocate(8 * MIB, MemPolicy::NormalOnly), alloc.allocate(10 * MIB, MemPolicy::NormalOnly));
        assert_eq!(alloc.stats().os_allocs, 4);
        drop((a, b));
        alloc.empty_cache();
        assert_eq!(alloc.stats().reserved, 0);
    }

    #[test]
    fn overflowing_sizes_are_errors() {
        let e = Allocator::global().allocate(usize::MAX - 3, MemPolicy::HugeFirst).unwrap_err();
        assert_eq!(e.code(), ErrorCode::Runtime);
        assert!(e.message().contains("out of memory"), "{e}");
        assert!(MemPolicy::parse("HUGE_SOMETIMES").is_err());
        assert_eq!(MemPolicy::parse("normal_only").unwrap(), MemPolicy::NormalOnly);
    }
}
