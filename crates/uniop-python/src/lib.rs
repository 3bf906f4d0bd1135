//! `uniop._native`: the Python face of the registry.
//!
//! Like the C API, this module never names an op. It hands Python one [`Op`] object per registered
//! schema; calling it binds Python arguments to the schema, imports tensors zero-copy (torch through
//! `uniop.torch`'s C++ reader when loaded, else its DLPack exchange API; NumPy through its C API;
//! anything else through `__dlpack__`), makes
//! the outputs as the caller's kind (a torch caller gets torch tensors, a NumPy caller arrays) and
//! runs the executor on the default stream (with the GIL released unless the work is tiny).
//! `python/uniop/__init__.py` turns these objects into `uniop.<op>` functions with signatures and
//! docstrings, and `uniop.torch` registers the same objects with `torch.library`.
//!
//! Errors keep the core's code and message: they surface as `uniop.UniopError` with `.code` (the
//! stable number shared with the C API) and `.code_name`. No Rust panic unwinds into CPython: the
//! `uniop.<op>` builtins turn one into a `UniopError`, pyo3 catches those of the other methods (and
//! the core already turns kernel panics into runtime errors).

mod call;
mod ndarray;
mod runtime;
mod torch_abi;

use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyTuple};
use std::ffi::CString;
use std::sync::Arc;
use uniop::autograd::Source;
use uniop::schema::BaseType;
use uniop::{OpEntry, Registry};

pyo3::create_exception!(
    uniop,
    UniopError,
    pyo3::exceptions::PyRuntimeError,
    "An error from uniop: `.code` is the stable status code (as in the C API), `.code_name` its name."
);

/// Converts a core error into `UniopError` carrying its code.
pub(crate) fn to_py_err(e: uniop::Error) -> PyErr {
    Python::attach(|py| {
        let err = UniopError::new_err(e.message().to_string());
        let value = err.value(py);
        // Setting attributes on a fresh exception instance cannot fail short of memory exhaustion.
        let _ = value.setattr("code", e.code().value());
        let _ = value.setattr("code_name", e.code().name());
        err
    })
}

/// `uniop.<op>(...)`: the builtin [`Op::function`] makes, called the way CPython calls a
/// `METH_FASTCALL | METH_KEYWORDS` function — `nargs` positional arguments at `args`, then one
/// value per name in the `kwnames` tuple (null without keywords) — with `slf` the op's `Op`.
/// Errors become the Python exception the call raises; a panic becomes a `UniopError`, never an
/// unwind into CPython.
unsafe extern "C" fn call_builtin(
    slf: *mut ffi::PyObject,
    args: *const *mut ffi::PyObject,
    nargs: ffi::Py_ssize_t,
    kwnames: *mut ffi::PyObject,
) -> *mut ffi::PyObject {
    // SAFETY: CPython calls builtins with this thread attached.
    let py = unsafe { Python::assume_attached() };
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        // SAFETY: `slf` is the `Op` `function` made this builtin with, held by the builtin.
        let op = unsafe { Bound::ref_from_ptr(py, &slf).cast_unchecked::<Op>() }.get();
        // SAFETY: `kwnames`, when not null, is a tuple of strings.
        let names = unsafe { Bound::from_borrowed_ptr_or_opt(py, kwnames) };
        let names = names.map(|n| unsafe { n.cast_into_unchecked::<PyTuple>() });
        let count = nargs as usize + names.as_ref().map_or(0, |n| n.len());
        // SAFETY: CPython passes `nargs` positional values and one per keyword name at `args`
        // (which may dangle when there are none), alive for the call.
        let values = if count == 0 { &[][..] } else { unsafe { std::slice::from_raw_parts(args, count) } };
        let value = |&ptr: &*mut ffi::PyObject| unsafe { Bound::from_borrowed_ptr(py, ptr) };
        let (positional, keywords) = values.split_at(nargs as usize);
        let keywords = names.iter().flat_map(|n| n.iter()).zip(keywords.iter().map(value));
        let bound = call::bind(&op.entry, positional.iter().map(value), keywords).map_err(to_py_err)?;
        call::call(py, &op.entry, bound)
    }));
    let err = match result {
        Ok(Ok(obj)) => return obj.into_ptr(),
        Ok(Err(err)) => err,
        Err(_) => to_py_err(uniop::Error::internal("uniop: a panic in a Python call")),
    };
    err.restore(py);
    std::ptr::null_mut()
}

/// Where a backward argument comes from, as Python sees it: `(kind, index)` (see
/// `Op.backward_wiring`).
type WiredSource = (&'static str, Option<usize>);

/// One registered op, callable with the schema's arguments.
#[pyclass(frozen, module = "uniop._native")]
pub struct Op {
    entry: Arc<OpEntry>,
}

#[pymethods]
impl Op {
    /// Runs the op: tensors (any `__dlpack__` object) and attributes as in the schema. Returns the
    /// op's returns (one value, a tuple, or None for an op that only writes in place).
    #[pyo3(signature = (*args, **kwargs))]
    fn __call__(
        &self,
        py: Python<'_>,
        args: &Bound<'_, pyo3::types::PyTuple>,
        kwargs: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<Py<PyAny>> {
        call::call(py, &self.entry, call::bind_tuple(&self.entry, args, kwargs).map_err(to_py_err)?)
    }

    /// Output shapes and dtypes for tensor-like arguments that carry only metadata (torch fake
    /// tensors): `[(shape, dtype_name), ...]`, one per return, contiguous.
    #[pyo3(signature = (*args, **kwargs))]
    fn infer(
        &self,
        py: Python<'_>,
        args: &Bound<'_, pyo3::types::PyTuple>,
        kwargs: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<Py<PyAny>> {
        call::infer(py, &self.entry, call::bind_tuple(&self.entry, args, kwargs).map_err(to_py_err)?)
    }

    /// A builtin function that calls this op — what `uniop.<op>` is. `doc` becomes its
    /// `__doc__`; when it starts with `name(params)\n--\n\n` (CPython's text-signature
    /// convention) `inspect.signature` and `help` read the parameters from it. A builtin skips
    /// the Python frame a wrapper function costs on every call (~0.4 µs here), and this one takes
    /// CPython's vectorcall convention ([`call_builtin`]), so a call builds no argument tuple. Its
    /// `__self__` is this `Op`. The method def, name and doc stay allocated for the life of the
    /// process, like the registry's ops.
    fn function<'py>(slf: &Bound<'py, Self>, doc: &str) -> PyResult<Bound<'py, PyAny>> {
        let leak = |text: &str| -> PyResult<*const std::ffi::c_char> {
            let text = CString::new(text).map_err(|e| pyo3::exceptions::PyValueError::new_err(e.to_string()))?;
            Ok(Box::leak(text.into_boxed_c_str()).as_ptr())
        };
        let def = Box::leak(Box::new(ffi::PyMethodDef {
            ml_name: leak(slf.get().entry.name())?,
            ml_meth: ffi::PyMethodDefPointer { PyCFunctionFastWithKeywords: call_builtin },
            ml_flags: ffi::METH_FASTCALL | ffi::METH_KEYWORDS,
            ml_doc: leak(doc)?,
        }));
        // SAFETY: `def` lives for the process; `slf` is a live object the function keeps a
        // reference to; this thread is attached. The result is a new reference or null with an
        // exception set.
        unsafe {
            Bound::from_owned_ptr_or_err(slf.py(), ffi::PyCFunction_NewEx(def, slf.as_ptr(), std::ptr::null_mut()))
        }
    }

    /// This op as the handle uniop's C++ torch kernels pass to the ABI in `_torch_abi()`.
    fn _torch_handle(&self) -> usize {
        torch_abi::handle(&self.entry)
    }

    #[getter]
    fn name(&self) -> &str {
        self.entry.name()
    }

    /// The schema line (PyTorch schema language, accepted by `torch.library`).
    #[getter]
    fn schema(&self) -> String {
        self.entry.schema.to_string()
    }

    #[getter]
    fn doc(&self) -> &'static str {
        self.entry.op.doc()
    }

    #[getter]
    fn dtypes(&self) -> Vec<&'static str> {
        self.entry.op.dtypes().iter().map(|d| d.name()).collect()
    }

    /// Name of the op computing this op's input gradients (see `uniop::Op::backward`).
    #[getter]
    fn backward(&self) -> Option<&'static str> {
        self.entry.op.backward()
    }

    /// How autograd calls this op's backward (`uniop::autograd`): `(sources, grad_of)` with one
    /// `(kind, index)` per backward argument — kind "grad" (of return `index`), "arg" or "out"
    /// (this op's argument or return `index`), "needs" (whether argument `index` requires a
    /// gradient) or "default" (index None) — and, per backward return, the index of the argument
    /// it is the gradient of. None for an op without a backward; a `UniopError` for a backward
    /// whose schema breaks the naming convention.
    #[getter]
    fn backward_wiring(&self) -> PyResult<Option<(Vec<WiredSource>, Vec<usize>)>> {
        let Some((_, wiring)) = Registry::global().backward_of(&self.entry).map_err(to_py_err)? else {
            return Ok(None);
        };
        let sources = wiring
            .sources
            .iter()
            .map(|source| match *source {
                Source::Grad(i) => ("grad", Some(i)),
                Source::Arg(i) => ("arg", Some(i)),
                Source::Out(i) => ("out", Some(i)),
                Source::NeedsGrad(i) => ("needs", Some(i)),
                Source::Default => ("default", None),
            })
            .collect();
        Ok(Some((sources, wiring.grad_of)))
    }

    /// Torch's autocast rule for this op: "lower" (run in the autocast dtype), "float32", or None.
    #[getter]
    fn autocast(&self) -> Option<&'static str> {
        self.entry.op.autocast().name()
    }

    /// Whether the op is elementwise over broadcast operands, so that a batch of calls is one call
    /// with a leading batch dim (see `uniop::Op::elementwise`).
    #[getter]
    fn elementwise(&self) -> bool {
        self.entry.op.elementwise()
    }

    /// The tensor arguments a batch of calls stacks along a new leading dim, the op working row
    /// by row along their leading dims (see `uniop::Op::leading_batch_args`).
    #[getter]
    fn leading_batch_args(&self) -> Vec<&'static str> {
        self.entry.op.leading_batch_args().to_vec()
    }

    /// The tensor arguments mapped block by block over broadcast batch dims, with their blocks'
    /// ranks, as `(name, rank)` (see `uniop::Op::core_dims`).
    #[getter]
    fn core_dims(&self) -> Vec<(&'static str, usize)> {
        self.entry.op.core_dims().to_vec()
    }

    /// The arguments as dicts: name, type (schema spelling), tensor, optional, mutated,
    /// kwarg_only and default (absent when required).
    #[getter]
    fn args<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let list = PyList::empty(py);
        for arg in &self.entry.schema.args {
            let d = PyDict::new(py);
            d.set_item("name", &arg.name)?;
            d.set_item("type", arg.ty.to_string())?;
            d.set_item("tensor", arg.ty.is_tensor())?;
            d.set_item("optional", arg.ty.optional)?;
            d.set_item("mutated", arg.ty.mutated.is_some())?;
            d.set_item("kwarg_only", arg.kwarg_only)?;
            d.set_item("scalar_type", arg.ty.base == BaseType::ScalarType)?;
            if let Some(default) = &arg.default {
                d.set_item("default", call::attr_to_py(py, default)?)?;
            }
            list.append(d)?;
        }
        Ok(list)
    }

    /// Names of the returns, in order.
    #[getter]
    fn returns(&self) -> Vec<String> {
        (0..self.entry.schema.returns.len()).map(|i| self.entry.schema.return_name(i)).collect()
    }

    /// Whether the op returns a list of tensors: its only return, as many as each call returns.
    #[getter]
    fn returns_list(&self) -> bool {
        self.entry.schema.returns_list()
    }

    fn __repr__(&self) -> String {
        format!("<uniop op {}>", self.entry.schema)
    }
}

/// Every registered op (built-ins and loaded plugins), sorted by name.
#[pyfunction]
fn ops() -> Vec<Op> {
    uniop_ops::init();
    Registry::global().list().into_iter().map(|entry| Op { entry }).collect()
}

/// Sets the function that allocates outputs like a given input: `alloc(like, shape, dtype_name)`.
#[pyfunction]
fn _set_allocator(alloc: Py<PyAny>) -> PyResult<()> {
    call::set_allocator(alloc)
}

/// Makes `uniop.<op>` read torch arguments and create torch outputs with uniop.torch's C++
/// functions.
#[pyfunction]
fn _use_torch_tensors(
    tensor_type: Bound<'_, pyo3::types::PyType>,
    capsule: Bound<'_, pyo3::types::PyCapsule>,
) -> PyResult<()> {
    torch_abi::use_tensor_io(tensor_type, &capsule)
}

/// The capsule (`uniop._native.torch_abi`) with the C ABI uniop's C++ torch kernels call.
#[pyfunction]
fn _torch_abi(py: Python<'_>) -> PyResult<Bound<'_, pyo3::types::PyCapsule>> {
    torch_abi::capsule(py)
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    uniop_ops::init();
    m.add("UniopError", m.py().get_type::<UniopError>())?;
    m.add_class::<Op>()?;
    m.add_function(wrap_pyfunction!(ops, m)?)?;
    m.add_function(wrap_pyfunction!(_set_allocator, m)?)?;
    m.add_function(wrap_pyfunction!(_torch_abi, m)?)?;
    m.add_function(wrap_pyfunction!(_use_torch_tensors, m)?)?;
    runtime::register(m)?;
    Ok(())
}
