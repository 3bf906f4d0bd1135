//! Runtime calls (AscendCL's `aclrt*` set): init, device, streams, events, memory, and the kernel
//! direct call. A `NULL` stream means the default stream, as in CUDA and AscendCL.

use crate::handles;
use crate::{guard, non_null, uniopStatus};
use std::collections::HashMap;
use std::ffi::{c_char, c_void};
use std::sync::{Mutex, OnceLock};
use uniop::runtime::{Allocator, DeviceBuffer, MemPolicy, Profile};
use uniop::{Error, ErrorCode, Event, Result, Stream};

/// An ordered queue of work (opaque).
pub struct uniopStreamObj(pub(crate) Stream);
/// A point in a stream's work, for ordering and timing (opaque).
pub struct uniopEventObj(Event);

pub type uniopStream = *mut uniopStreamObj;
pub type uniopEvent = *mut uniopEventObj;

// Enumerations cross the ABI as plain integers (with named constants) so that an out-of-range
// value from C is an error to report, not undefined behaviour in a Rust enum.

/// `aclrtMalloc`'s policies: huge pages first (falling back to normal pages), huge only, normal only.
pub type uniopMemMallocPolicy = i32;
pub const UNIOP_MEM_MALLOC_HUGE_FIRST: uniopMemMallocPolicy = 0;
pub const UNIOP_MEM_MALLOC_HUGE_ONLY: uniopMemMallocPolicy = 1;
pub const UNIOP_MEM_MALLOC_NORMAL_ONLY: uniopMemMallocPolicy = 2;

/// Copy directions (all plain copies on the CPU device; checked for source compatibility).
pub type uniopMemcpyKind = i32;
pub const UNIOP_MEMCPY_HOST_TO_HOST: uniopMemcpyKind = 0;
pub const UNIOP_MEMCPY_HOST_TO_DEVICE: uniopMemcpyKind = 1;
pub const UNIOP_MEMCPY_DEVICE_TO_HOST: uniopMemcpyKind = 2;
pub const UNIOP_MEMCPY_DEVICE_TO_DEVICE: uniopMemcpyKind = 3;

/// One allocator counter, for `uniopGetMemStat`: a number, not a struct field, so that counters
/// added later reach C callers without changing any struct's size.
pub type uniopMemStat = i32;
/// Bytes in blocks currently handed out.
pub const UNIOP_MEM_STAT_ALLOCATED: uniopMemStat = 0;
/// Bytes held from the OS: handed out plus cached.
pub const UNIOP_MEM_STAT_RESERVED: uniopMemStat = 1;
/// The most bytes handed out at once since start (or the last peak reset).
pub const UNIOP_MEM_STAT_PEAK_ALLOCATED: uniopMemStat = 2;
/// Allocations served.
pub const UNIOP_MEM_STAT_ALLOC_COUNT: uniopMemStat = 3;
/// Buffers freed (returned to the cache).
pub const UNIOP_MEM_STAT_FREE_COUNT: uniopMemStat = 4;
/// Live buffers (allocations minus frees).
pub const UNIOP_MEM_STAT_LIVE_BUFFERS: uniopMemStat = 5;
/// Bytes the callers asked for (before rounding), currently live.
pub const UNIOP_MEM_STAT_REQUESTED: uniopMemStat = 6;
/// Allocations served from the cache instead of the OS.
pub const UNIOP_MEM_STAT_CACHE_HITS: uniopMemStat = 7;
/// Blocks obtained from the OS.
pub const UNIOP_MEM_STAT_OS_ALLOCS: uniopMemStat = 8;
/// Times the OS refused a block and the cache was returned to it before asking again: a loop that
/// keeps raising this runs at its memory limit.
pub const UNIOP_MEM_STAT_ALLOC_RETRIES: uniopMemStat = 9;
/// Allocations that failed even after that.
pub const UNIOP_MEM_STAT_OOMS: uniopMemStat = 10;

/// Allocator counters, in bytes and calls (six of them; `uniopGetMemStat` reads each).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct uniopMemStats {
    pub allocated: u64,
    pub reserved: u64,
    pub peakAllocated: u64,
    pub allocCount: u64,
    pub freeCount: u64,
    pub liveBuffers: u64,
}

/// A device kernel for the direct call: runs once per block with its index and the block count.
pub type uniopKernelFn = Option<unsafe extern "C" fn(block_idx: u32, block_num: u32, args: *mut c_void)>;

/// Buffers from `uniopMalloc`/`uniopMallocHost`, by address, with whether they are host memory.
static BUFFERS: OnceLock<Mutex<HashMap<usize, (DeviceBuffer, bool)>>> = OnceLock::new();

fn buffers() -> &'static Mutex<HashMap<usize, (DeviceBuffer, bool)>> {
    BUFFERS.get_or_init(|| {
        uniop::runtime::fork::hold_across_fork(&BUFFERS);
        Default::default()
    })
}

/// The stream behind a handle (`NULL`: the default stream).
pub(crate) unsafe fn stream_of<'a>(s: uniopStream, func: &str) -> Result<&'a Stream> {
    if s.is_null() {
        return Ok(Stream::default_stream());
    }
    Ok(&handles::get(s, func, "stream", "uniopStream")?.0)
}

/// Registers the built-in ops. Optional (every call initializes on demand); idempotent.
#[no_mangle]
pub extern "C" fn uniopInit() -> uniopStatus {
    guard(|| {
        uniop_ops::init();
        Ok(())
    })
}

/// Drains the default stream, returns cached memory to the OS and prints a report of buffers
/// still allocated to stderr (the leak report).
#[no_mangle]
pub extern "C" fn uniopFinalize() -> uniopStatus {
    guard(|| {
        Stream::default_stream().synchronize()?;
        Allocator::global().empty_cache();
        if let Some(report) = Allocator::global().leak_report() {
            eprint!("{report}");
        }
        Ok(())
    })
}

/// Selects the device; the CPU device is 0 (the only one in this build).
#[no_mangle]
pub extern "C" fn uniopSetDevice(deviceId: i32) -> uniopStatus {
    guard(|| match deviceId {
        0 => Ok(()),
        other => Err(Error::arg(ErrorCode::ParamInvalid, "uniopSetDevice", "deviceId", "0 (the CPU device)", other)),
    })
}

#[no_mangle]
pub extern "C" fn uniopCreateStream(stream: *mut uniopStream) -> uniopStatus {
    guard(|| {
        non_null(stream, "uniopCreateStream", "stream")?;
        // SAFETY: checked non-null; the caller provides a writable slot.
        unsafe { *stream = handles::register(uniopStreamObj(Stream::new())) };
        Ok(())
    })
}

/// Waits for the stream's work, then destroys it.
#[no_mangle]
pub extern "C" fn uniopDestroyStream(stream: uniopStream) -> uniopStatus {
    guard(|| {
        let s = handles::release(stream, "uniopDestroyStream", "stream", "uniopStream")?;
        s.0.synchronize()
    })
}

/// Blocks until the stream's work is done; reports the first error of its asynchronous work.
#[no_mangle]
pub extern "C" fn uniopSynchronizeStream(stream: uniopStream) -> uniopStatus {
    guard(|| unsafe { stream_of(stream, "uniopSynchronizeStream")? }.synchronize())
}

/// Work enqueued on `stream` later waits for `event`'s latest record.
#[no_mangle]
pub extern "C" fn uniopStreamWaitEvent(stream: uniopStream, event: uniopEvent) -> uniopStatus {
    guard(|| {
        let s = unsafe { stream_of(stream, "uniopStreamWaitEvent")? };
        let e = unsafe { handles::get(event, "uniopStreamWaitEvent", "event", "uniopEvent")? };
        s.wait_event(&e.0)
    })
}

#[no_mangle]
pub extern "C" fn uniopCreateEvent(event: *mut uniopEvent) -> uniopStatus {
    guard(|| {
        non_null(event, "uniopCreateEvent", "event")?;
        // SAFETY: checked non-null.
        unsafe { *event = handles::register(uniopEventObj(Event::new())) };
        Ok(())
    })
}

#[no_mangle]
pub extern "C" fn uniopDestroyEvent(event: uniopEvent) -> uniopStatus {
    guard(|| handles::release(event, "uniopDestroyEvent", "event", "uniopEvent").map(drop))
}

#[no_mangle]
pub extern "C" fn uniopRecordEvent(event: uniopEvent, stream: uniopStream) -> uniopStatus {
    guard(|| {
        let e = unsafe { handles::get(event, "uniopRecordEvent", "event", "uniopEvent")? };
        e.0.record(unsafe { stream_of(stream, "uniopRecordEvent")? });
        Ok(())
    })
}

/// `*done` = 1 when the event's latest record has completed, else 0.
#[no_mangle]
pub extern "C" fn uniopQueryEvent(event: uniopEvent, done: *mut i32) -> uniopStatus {
    guard(|| {
        non_null(done, "uniopQueryEvent", "done")?;
        let e = unsafe { handles::get(event, "uniopQueryEvent", "event", "uniopEvent")? };
        let finished = e.0.query()?;
        // SAFETY: checked non-null.
        unsafe { *done = finished as i32 };
        Ok(())
    })
}

#[no_mangle]
pub extern "C" fn uniopSynchronizeEvent(event: uniopEvent) -> uniopStatus {
    guard(|| unsafe { handles::get(event, "uniopSynchronizeEvent", "event", "uniopEvent")? }.0.synchronize())
}

/// Milliseconds between two completed records.
#[no_mangle]
pub extern "C" fn uniopEventElapsedTime(ms: *mut f32, start: uniopEvent, end: uniopEvent) -> uniopStatus {
    guard(|| {
        non_null(ms, "uniopEventElapsedTime", "ms")?;
        let s = unsafe { handles::get(start, "uniopEventElapsedTime", "start", "uniopEvent")? };
        let e = unsafe { handles::get(end, "uniopEventElapsedTime", "end", "uniopEvent")? };
        let elapsed = Event::elapsed_ms(&s.0, &e.0)?;
        // SAFETY: checked non-null.
        unsafe { *ms = elapsed as f32 };
        Ok(())
    })
}

fn allocate(func: &str, ptr: *mut *mut c_void, size: usize, policy: MemPolicy, host: bool) -> Result<()> {
    non_null(ptr, func, "devPtr")?;
    if size == 0 {
        return Err(Error::arg(ErrorCode::ParamInvalid, func, "size", "a size > 0", 0));
    }
    let buf = Allocator::global().allocate(size, policy).map_err(|e| e.context(func))?;
    let addr = buf.as_ptr();
    buffers().lock().unwrap().insert(addr as usize, (buf, host));
    // SAFETY: checked non-null.
    unsafe { *ptr = addr as *mut c_void };
    Ok(())
}

fn free(func: &str, ptr: *mut c_void, host: bool) -> Result<()> {
    non_null(ptr, func, "ptr")?;
    let mut map = buffers().lock().unwrap();
    match map.get(&(ptr as usize)) {
        Some((_, h)) if *h == host => {
            map.remove(&(ptr as usize));
            Ok(())
        }
        Some(_) => Err(Error::arg(
            ErrorCode::ParamInvalid,
            func,
            "ptr",
            format!("memory from {}", if host { "uniopMallocHost" } else { "uniopMalloc" }),
            format!("{ptr:p} from {}", if host { "uniopMalloc" } else { "uniopMallocHost" }),
        )),
        None => Err(Error::arg(
            ErrorCode::ParamInvalid,
            func,
            "ptr",
            "a pointer returned by uniop's allocator and not yet freed",
            format!("{ptr:p}"),
        )),
    }
}

/// Device memory from the caching allocator (64-byte aligned), under `policy`.
#[no_mangle]
pub extern "C" fn uniopMalloc(devPtr: *mut *mut c_void, size: usize, policy: uniopMemMallocPolicy) -> uniopStatus {
    guard(|| {
        let policy = match policy {
            UNIOP_MEM_MALLOC_HUGE_FIRST => MemPolicy::HugeFirst,
            UNIOP_MEM_MALLOC_HUGE_ONLY => MemPolicy::HugeOnly,
            UNIOP_MEM_MALLOC_NORMAL_ONLY => MemPolicy::NormalOnly,
            other => {
                return Err(Error::arg(
                    ErrorCode::ParamInvalid,
                    "uniopMalloc",
                    "policy",
                    "UNIOP_MEM_MALLOC_HUGE_FIRST, _HUGE_ONLY or _NORMAL_ONLY",
                    other,
                ))
            }
        };
        allocate("uniopMalloc", devPtr, size, policy, false)
    })
}

#[no_mangle]
pub extern "C" fn uniopFree(devPtr: *mut c_void) -> uniopStatus {
    guard(|| free("uniopFree", devPtr, false))
}

/// Host memory (the same allocator on the CPU device), freed with `uniopFreeHost`.
#[no_mangle]
pub extern "C" fn uniopMallocHost(hostPtr: *mut *mut c_void, size: usize) -> uniopStatus {
    guard(|| allocate("uniopMallocHost", hostPtr, size, MemPolicy::NormalOnly, true))
}

#[no_mangle]
pub extern "C" fn uniopFreeHost(hostPtr: *mut c_void) -> uniopStatus {
    guard(|| free("uniopFreeHost", hostPtr, true))
}

fn check_copy(
    func: &str,
    dst: *mut c_void,
    destMax: usize,
    src: *const c_void,
    count: usize,
    kind: uniopMemcpyKind,
) -> Result<()> {
    if !(UNIOP_MEMCPY_HOST_TO_HOST..=UNIOP_MEMCPY_DEVICE_TO_DEVICE).contains(&kind) {
        return Err(Error::arg(ErrorCode::ParamInvalid, func, "kind", "a UNIOP_MEMCPY_* direction", kind));
    }
    non_null(dst, func, "dst")?;
    non_null(src, func, "src")?;
    if count > destMax {
        return Err(Error::arg(ErrorCode::ParamInvalid, func, "count", format!("at most destMax = {destMax}"), count));
    }
    Ok(())
}

/// Copies `count` bytes; `kind` is checked but every direction is a host copy on the CPU device.
#[no_mangle]
pub extern "C" fn uniopMemcpy(
    dst: *mut c_void,
    destMax: usize,
    src: *const c_void,
    count: usize,
    kind: uniopMemcpyKind,
) -> uniopStatus {
    guard(|| {
        check_copy("uniopMemcpy", dst, destMax, src, count, kind)?;
        // SAFETY: the caller guarantees both ranges are valid; `copy` tolerates overlap.
        unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, count) };
        Ok(())
    })
}

/// Enqueues the copy on `stream`; both buffers must stay valid until it has run.
#[no_mangle]
pub extern "C" fn uniopMemcpyAsync(
    dst: *mut c_void,
    destMax: usize,
    src: *const c_void,
    count: usize,
    kind: uniopMemcpyKind,
    stream: uniopStream,
) -> uniopStatus {
    guard(|| {
        check_copy("uniopMemcpyAsync", dst, destMax, src, count, kind)?;
        let s = unsafe { stream_of(stream, "uniopMemcpyAsync")? };
        let (d, from) = (dst as usize, src as usize);
        s.launch_host_fn(move || {
            // SAFETY: the caller keeps both buffers valid until the stream reaches this copy.
            unsafe { std::ptr::copy(from as *const u8, d as *mut u8, count) };
            Ok(())
        });
        Ok(())
    })
}

/// Free and total physical memory of the device (the machine's RAM for the CPU device).
#[no_mangle]
pub extern "C" fn uniopGetMemInfo(free: *mut usize, total: *mut usize) -> uniopStatus {
    guard(|| {
        non_null(free, "uniopGetMemInfo", "free")?;
        non_null(total, "uniopGetMemInfo", "total")?;
        let info = std::fs::read_to_string("/proc/meminfo")
            .map_err(|e| Error::new(ErrorCode::Runtime, format!("uniopGetMemInfo: reading /proc/meminfo: {e}")))?;
        let field = |name: &str| -> usize {
            info.lines()
                .find_map(|l| l.strip_prefix(name))
                .and_then(|rest| rest.split_whitespace().next()?.parse::<usize>().ok())
                .map_or(0, |kib| kib * 1024)
        };
        // SAFETY: checked non-null.
        unsafe {
            *free = field("MemAvailable:");
            *total = field("MemTotal:");
        }
        Ok(())
    })
}

#[no_mangle]
pub extern "C" fn uniopGetMemStats(stats: *mut uniopMemStats) -> uniopStatus {
    guard(|| {
        non_null(stats, "uniopGetMemStats", "stats")?;
        let s = Allocator::global().stats();
        // SAFETY: checked non-null.
        unsafe {
            *stats = uniopMemStats {
                allocated: s.allocated as u64,
                reserved: s.reserved as u64,
                peakAllocated: s.peak_allocated as u64,
                allocCount: s.alloc_count,
                freeCount: s.free_count,
                liveBuffers: s.live_buffers as u64,
            }
        };
        Ok(())
    })
}

/// One allocator counter (a `UNIOP_MEM_STAT_*` number) into `*value`.
#[no_mangle]
pub extern "C" fn uniopGetMemStat(stat: uniopMemStat, value: *mut u64) -> uniopStatus {
    guard(|| {
        const F: &str = "uniopGetMemStat";
        non_null(value, F, "value")?;
        let s = Allocator::global().stats();
        let counter = match stat {
            UNIOP_MEM_STAT_ALLOCATED => s.allocated as u64,
            UNIOP_MEM_STAT_RESERVED => s.reserved as u64,
            UNIOP_MEM_STAT_PEAK_ALLOCATED => s.peak_allocated as u64,
            UNIOP_MEM_STAT_ALLOC_COUNT => s.alloc_count,
            UNIOP_MEM_STAT_FREE_COUNT => s.free_count,
            UNIOP_MEM_STAT_LIVE_BUFFERS => s.live_buffers as u64,
            UNIOP_MEM_STAT_REQUESTED => s.requested as u64,
            UNIOP_MEM_STAT_CACHE_HITS => s.cache_hits,
            UNIOP_MEM_STAT_OS_ALLOCS => s.os_allocs,
            UNIOP_MEM_STAT_ALLOC_RETRIES => s.alloc_retries,
            UNIOP_MEM_STAT_OOMS => s.ooms,
            other => {
                let expected =
                    format!("a UNIOP_MEM_STAT_* counter ({UNIOP_MEM_STAT_ALLOCATED} to {UNIOP_MEM_STAT_OOMS})");
                return Err(Error::arg(ErrorCode::ParamInvalid, F, "stat", expected, other));
            }
        };
        // SAFETY: checked non-null.
        unsafe { *value = counter };
        Ok(())
    })
}

/// Writes the allocator's summary table, NUL-terminated and truncated to `len` bytes; `*needed`
/// (when not NULL) receives the full size including the NUL.
#[no_mangle]
pub extern "C" fn uniopMemorySummary(buf: *mut c_char, len: usize, needed: *mut usize) -> uniopStatus {
    guard(|| write_text("uniopMemorySummary", &Allocator::global().memory_summary(), buf, len, needed))
}

/// Copies `text` into the caller's `buf` of `len` bytes (truncated, NUL-terminated) and its full
/// size with the NUL into `*needed` when that is not NULL: the size-query convention of the
/// text-returning calls.
fn write_text(func: &str, text: &str, buf: *mut c_char, len: usize, needed: *mut usize) -> Result<()> {
    if !needed.is_null() {
        // SAFETY: checked non-null.
        unsafe { *needed = text.len() + 1 };
    }
    if len == 0 {
        return Ok(());
    }
    non_null(buf, func, "buf")?;
    let n = text.len().min(len - 1);
    // SAFETY: the caller provides `len` writable bytes.
    unsafe {
        std::ptr::copy_nonoverlapping(text.as_ptr(), buf as *mut u8, n);
        *buf.add(n) = 0;
    }
    Ok(())
}

/// The profile of the last `uniopProfilerStop`, read by the summary and trace calls.
static LAST_PROFILE: Mutex<Option<Profile>> = Mutex::new(None);

fn with_last_profile<T>(func: &str, f: impl FnOnce(&Profile) -> Result<T>) -> Result<T> {
    let last = LAST_PROFILE.lock().unwrap_or_else(|e| e.into_inner());
    let profile = last.as_ref().ok_or_else(|| {
        Error::new(
            ErrorCode::ParamInvalid,
            format!("{func}: no profile yet (call uniopProfilerStart, then uniopProfilerStop)"),
        )
    })?;
    f(profile)
}

/// Starts recording every launch in the process — op launches from any frontend, staging copies
/// and kernel direct calls — with its op, tensors, bytes, block count, stream and time. Fails
/// when a profiler is already recording.
#[no_mangle]
pub extern "C" fn uniopProfilerStart() -> uniopStatus {
    guard(uniop::runtime::profiler::start)
}

/// Stops recording and keeps the profile for `uniopProfilerSummary` / `uniopProfilerWriteTrace`
/// (replacing the previous one). Launches still queued are not recorded: synchronize first.
#[no_mangle]
pub extern "C" fn uniopProfilerStop() -> uniopStatus {
    guard(|| {
        let profile = uniop::runtime::profiler::stop()?;
        *LAST_PROFILE.lock().unwrap_or_else(|e| e.into_inner()) = Some(profile);
        Ok(())
    })
}

/// Writes the last profile's op summary (launch time per op, step and tensor signature, longest
/// first; `top` rows, 0 for all) like `uniopMemorySummary`: truncated to `len` bytes,
/// NUL-terminated, full size with the NUL in `*needed` when not NULL.
#[no_mangle]
pub extern "C" fn uniopProfilerSummary(top: usize, buf: *mut c_char, len: usize, needed: *mut usize) -> uniopStatus {
    guard(|| {
        let text = with_last_profile("uniopProfilerSummary", |p| Ok(p.summary(top)))?;
        write_text("uniopProfilerSummary", &text, buf, len, needed)
    })
}

/// Writes the last profile as Chrome trace JSON (open in chrome://tracing or ui.perfetto.dev)
/// to the file at `path`.
#[no_mangle]
pub extern "C" fn uniopProfilerWriteTrace(path: *const c_char) -> uniopStatus {
    guard(|| {
        const F: &str = "uniopProfilerWriteTrace";
        let path = crate::tensor::text(path, F, "path")?;
        let trace = with_last_profile(F, |p| Ok(p.chrome_trace()))?;
        std::fs::write(path, trace).map_err(|e| {
            Error::arg(ErrorCode::ParamInvalid, F, "path", "a writable file path", format!("'{path}' ({e})"))
        })
    })
}

/// Kernel direct call: enqueues `blockDim` instances of `kernel(blockIdx, blockDim, args)` on
/// `stream`, spread over the compute pool. `args` must stay valid until the launch has run.
#[no_mangle]
pub extern "C" fn uniopLaunchKernel(
    kernel: uniopKernelFn,
    blockDim: u32,
    args: *mut c_void,
    stream: uniopStream,
) -> uniopStatus {
    guard(|| {
        let Some(kernel) = kernel else {
            return Err(Error::arg(ErrorCode::ParamNullptr, "uniopLaunchKernel", "kernel", "a function", "NULL"));
        };
        if blockDim == 0 {
            return Err(Error::arg(ErrorCode::ParamInvalid, "uniopLaunchKernel", "blockDim", "at least 1", 0));
        }
        let s = unsafe { stream_of(stream, "uniopLaunchKernel")? };
        let args = args as usize;
        // SAFETY (in the closure): the C kernel's contract; `args` is the caller's to keep alive.
        s.launch(blockDim, move |ctx| unsafe { kernel(ctx.block_idx, ctx.block_num, args as *mut c_void) });
        Ok(())
    })
}

/// Loads a Rust op library (a crate built as a `cdylib` that exports its ops with
/// `uniop::export_ops!`) and registers its ops; they are then callable through
/// `uniopOpGetWorkspaceSize` by name. Fails with `UNIOP_ERROR_PARAM_INVALID` when the file is not
/// such a library, or was built for another plugin ABI, compiler or uniop version.
#[no_mangle]
pub extern "C" fn uniopLoadOpLibrary(path: *const c_char) -> uniopStatus {
    guard(|| {
        let path = crate::tensor::text(path, "uniopLoadOpLibrary", "path")?;
        uniop_ops::init();
        uniop::plugin::load(path).map(drop)
    })
}
