//! Runtime objects for Python: streams and events (timing, ordering), the caching allocator's
//! statistics, the profiler, and plugin loading. Thin wrappers over `uniop::runtime`; errors keep their codes.

use crate::to_py_err;
use pyo3::prelude::*;
use pyo3::types::PyDict;
use uniop::runtime::{profiler, Allocator, Event as CoreEvent, Pool, Profile, Stream as CoreStream};

/// An ordered queue of work (`uniop.Stream()`); ops take it as `stream=`.
#[pyclass(frozen, name = "Stream", module = "uniop._native")]
pub struct Stream {
    pub(crate) inner: CoreStream,
}

#[pymethods]
impl Stream {
    #[new]
    fn new() -> Self {
        Stream { inner: CoreStream::new() }
    }

    /// The process-wide default stream (what ops use without `stream=`).
    #[staticmethod]
    fn default() -> Self {
        Stream { inner: CoreStream::default_stream().clone() }
    }

    /// Blocks until every task queued so far has finished.
    fn synchronize(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| self.inner.synchronize()).map_err(to_py_err)
    }

    /// Whether the stream is idle.
    fn query(&self) -> bool {
        self.inner.query()
    }

    /// Later work on this stream waits until `event`'s record is reached.
    fn wait_event(&self, event: &Event) -> PyResult<()> {
        self.inner.wait_event(&event.inner).map_err(to_py_err)
    }

    #[getter]
    fn id(&self) -> u64 {
        self.inner.id()
    }

    fn __repr__(&self) -> String {
        format!("<uniop.Stream {}>", self.inner.id())
    }
}

/// A marker in a stream's order, for timing and cross-stream waits.
#[pyclass(frozen, name = "Event", module = "uniop._native")]
pub struct Event {
    inner: CoreEvent,
}

#[pymethods]
impl Event {
    #[new]
    fn new() -> Self {
        Event { inner: CoreEvent::new() }
    }

    /// Records the event at the end of `stream` (the default stream when None).
    #[pyo3(signature = (stream=None))]
    fn record(&self, stream: Option<&Stream>) {
        self.inner.record(stream.map_or(CoreStream::default_stream(), |s| &s.inner));
    }

    fn query(&self) -> PyResult<bool> {
        self.inner.query().map_err(to_py_err)
    }

    fn synchronize(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| self.inner.synchronize()).map_err(to_py_err)
    }

    /// Milliseconds from this event's record to `end`'s.
    fn elapsed_time(&self, end: &Event) -> PyResult<f64> {
        CoreEvent::elapsed_ms(&self.inner, &end.inner).map_err(to_py_err)
    }
}

/// Records every uniop launch while active — from `uniop.<op>`, `torch.ops.uniop`, any other
/// frontend in the process, and raw kernel launches — one event per launch with its op, tensors,
/// bytes, block count, stream and time:
///
/// ```python
/// with uniop.Profiler() as prof:
///     model(x)
/// print(prof.summary(top=10))
/// prof.export_chrome_trace("trace.json")  # chrome://tracing or ui.perfetto.dev
/// ```
///
/// One profiler records at a time (a second `start` raises). Leaving the block waits for the
/// default stream; work queued on other streams must be synchronized before it ends to be seen.
#[pyclass(name = "Profiler", module = "uniop._native")]
pub struct Profiler {
    profile: Option<Profile>,
}

#[pymethods]
impl Profiler {
    #[new]
    fn new() -> Self {
        Profiler { profile: None }
    }

    /// Starts recording (what entering the `with` block does).
    fn start(&mut self) -> PyResult<()> {
        profiler::start().map_err(to_py_err)?;
        self.profile = None;
        Ok(())
    }

    /// Waits for the default stream, then stops recording and keeps the profile.
    fn stop(&mut self, py: Python<'_>) -> PyResult<()> {
        let synced = py.detach(uniop::runtime::synchronize);
        let profile = profiler::stop().map_err(to_py_err)?;
        self.profile = Some(profile);
        synced.map_err(to_py_err)
    }

    fn __enter__(mut slf: PyRefMut<'_, Self>) -> PyResult<PyRefMut<'_, Self>> {
        slf.start()?;
        Ok(slf)
    }

    #[pyo3(signature = (*_exc))]
    fn __exit__(&mut self, py: Python<'_>, _exc: &Bound<'_, pyo3::types::PyTuple>) -> PyResult<bool> {
        self.stop(py)?;
        Ok(false)
    }

    /// The op summary table: launch time per op, step and tensor signature, longest first
    /// (`top` rows; 0 for all).
    #[pyo3(signature = (top=20))]
    fn summary(&self, top: usize) -> PyResult<String> {
        Ok(self.recorded()?.summary(top))
    }

    /// One dict per launch, in start order: op, step, kind (`op`, `staging`, `kernel`), tensors,
    /// bytes, block_dim, stream, start_us (since `start`) and duration_us.
    fn events<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyDict>>> {
        self.recorded()?
            .events()
            .iter()
            .map(|e| {
                let d = PyDict::new(py);
                let l = &e.label;
                d.set_item("op", l.op.as_ref())?;
                d.set_item("step", l.step)?;
                d.set_item("kind", l.kind.name())?;
                d.set_item("tensors", l.signature.as_ref())?;
                d.set_item("bytes", l.bytes)?;
                d.set_item("block_dim", l.block_dim)?;
                d.set_item("stream", e.stream)?;
                d.set_item("start_us", e.start_ns as f64 / 1e3)?;
                d.set_item("duration_us", e.duration_ns() as f64 / 1e3)?;
                Ok(d)
            })
            .collect()
    }

    /// Writes the launches as Chrome trace JSON to `path`.
    fn export_chrome_trace(&self, path: std::path::PathBuf) -> PyResult<()> {
        let trace = self.recorded()?.chrome_trace();
        std::fs::write(&path, trace).map_err(|e| {
            pyo3::exceptions::PyOSError::new_err(format!("uniop.Profiler: cannot write {}: {e}", path.display()))
        })
    }
}

impl Profiler {
    fn recorded(&self) -> PyResult<&Profile> {
        self.profile.as_ref().ok_or_else(|| {
            to_py_err(uniop::Error::new(
                uniop::ErrorCode::ParamInvalid,
                "uniop.Profiler: nothing recorded yet (use it as a `with` block, or call start() and stop())",
            ))
        })
    }
}

/// Blocks until the default stream is idle.
#[pyfunction]
fn synchronize(py: Python<'_>) -> PyResult<()> {
    py.detach(uniop::runtime::synchronize).map_err(to_py_err)
}

/// The caching allocator's counters as a dict: `allocated_bytes` in blocks handed out,
/// `reserved_bytes` held from the OS (handed out plus cached), `peak_allocated_bytes` since start
/// or `reset_peak_memory_stats()`, `requested_bytes` the callers asked for (before rounding to
/// blocks); `alloc_count`, `free_count`, `cache_hits` (served without the OS), `os_allocs` (blocks
/// from the OS), `live_buffers`; `alloc_retries`, the times the OS refused a block and the cache
/// was emptied to ask again (PyTorch's `num_alloc_retries`), and `ooms`, refused even then
/// (`num_ooms`).
#[pyfunction]
fn memory_stats(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let s = Allocator::global().stats();
    let d = PyDict::new(py);
    d.set_item("allocated_bytes", s.allocated)?;
    d.set_item("reserved_bytes", s.reserved)?;
    d.set_item("peak_allocated_bytes", s.peak_allocated)?;
    d.set_item("requested_bytes", s.requested)?;
    d.set_item("alloc_count", s.alloc_count)?;
    d.set_item("free_count", s.free_count)?;
    d.set_item("cache_hits", s.cache_hits)?;
    d.set_item("os_allocs", s.os_allocs)?;
    d.set_item("live_buffers", s.live_buffers)?;
    d.set_item("alloc_retries", s.alloc_retries)?;
    d.set_item("ooms", s.ooms)?;
    Ok(d)
}

/// The allocator's summary table (like `torch.cuda.memory_summary`).
#[pyfunction]
fn memory_summary() -> String {
    Allocator::global().memory_summary()
}

/// Returns cached blocks to the OS.
#[pyfunction]
fn empty_cache() {
    Allocator::global().empty_cache()
}

#[pyfunction]
fn reset_peak_memory_stats() {
    Allocator::global().reset_peak()
}

/// Loads a uniop op library (a Rust crate built with `uniop::export_ops!`); returns its op names.
#[pyfunction]
fn load_library(py: Python<'_>, path: &str) -> PyResult<Vec<String>> {
    py.detach(|| uniop::plugin::load(path)).map_err(to_py_err)
}

/// Runs uniop's launches from Python threads on the OpenMP thread team already loaded in the
/// process (torch's) instead of uniop's own workers, so the two never spin on the same cores;
/// `share=False` goes back to uniop's workers. Returns the team size. `import uniop.torch` turns
/// this on when torch's parallel backend is OpenMP.
#[pyfunction]
#[pyo3(signature = (share = true))]
fn share_openmp_threads(share: bool) -> PyResult<usize> {
    Pool::global().share_openmp_team(share).map_err(to_py_err)
}

/// The instruction sets uniop's GEMM kernels run with here, by operand dtype:
/// `{"bfloat16": "amx" | "avx512" | "avx2" | "scalar", "float32": "avx512" | "avx2" | "scalar"}`
/// (bf16's "avx512" has AVX512-BF16; "amx" means AMX tiles, which Linux granted this process).
#[pyfunction]
fn gemm_kernels(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let kernels = PyDict::new(py);
    for (dtype, level) in uniop_ops::gemm_kernels() {
        kernels.set_item(dtype, level)?;
    }
    Ok(kernels)
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Stream>()?;
    m.add_class::<Event>()?;
    m.add_class::<Profiler>()?;
    m.add_function(wrap_pyfunction!(synchronize, m)?)?;
    m.add_function(wrap_pyfunction!(memory_stats, m)?)?;
    m.add_function(wrap_pyfunction!(memory_summary, m)?)?;
    m.add_function(wrap_pyfunction!(empty_cache, m)?)?;
    m.add_function(wrap_pyfunction!(reset_peak_memory_stats, m)?)?;
    m.add_function(wrap_pyfunction!(load_library, m)?)?;
    m.add_function(wrap_pyfunction!(share_openmp_threads, m)?)?;
    m.add_function(wrap_pyfunction!(gemm_kernels, m)?)?;
    Ok(())
}
