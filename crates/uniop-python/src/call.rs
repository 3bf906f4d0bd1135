//! The one call path every op shares: bind Python arguments to the schema, import the tensors
//! zero-copy through DLPack, infer, let the caller's framework allocate the outputs, run.

use crate::ndarray;
use crate::runtime::Stream as PyStream;
use crate::to_py_err;
use dlpark::ffi::{DLDataType, DLDataTypeCode, DLDevice, DLDeviceType, DLManagedTensorVersioned, DLTensor};
use dlpark::metadata::Dynamic;
use dlpark::python::consumer::exchange::ExchangeApi;
use dlpark::python::{from_dlpack, ImportedDlpack};
use dlpark::{DlpackFlags, Managed};
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple};
use pyo3::IntoPyObjectExt;
use rustc_hash::FxHashMap;
use smallvec::SmallVec;
use std::sync::{Arc, OnceLock};
use uniop::executor::SignatureKey;
use uniop::layout::ShapeDisplay;
use uniop::runtime::{Allocator, DeviceBuffer, MemPolicy};
use uniop::schema::{Arg, BaseType};
use uniop::{
    AttrValue, DType, Error, ErrorCode, Executor, Layout, MetaRef, OpCx, OpEntry, Stream, TensorMeta, TensorMut,
    TensorRef,
};

static ALLOCATOR: OnceLock<Py<PyAny>> = OnceLock::new();

pub fn set_allocator(alloc: Py<PyAny>) -> PyResult<()> {
    ALLOCATOR.set(alloc).map_err(|_| PyRuntimeError::new_err("uniop: the output allocator is already set"))
}

/// Per schema argument, what the caller passed (`None`: use the default); then the `stream=`
/// keyword every op takes besides its schema.
pub(crate) type BoundArgs<'py> = (SmallVec<[Option<Bound<'py, PyAny>>; 8]>, Option<Bound<'py, PyAny>>);

/// Matches the caller's arguments to the schema: `positional` in order, then `keywords` as
/// (name, value) pairs. Both calling conventions come here: a tuple and a dict (`Op.__call__`,
/// `Op.infer`, through [`bind_tuple`]) and a vectorcall's array (`uniop.<op>`).
pub(crate) fn bind<'py>(
    entry: &OpEntry,
    positional: impl ExactSizeIterator<Item = Bound<'py, PyAny>>,
    keywords: impl Iterator<Item = (Bound<'py, PyAny>, Bound<'py, PyAny>)>,
) -> Result<BoundArgs<'py>, Error> {
    let op = entry.name();
    let schema = &entry.schema.args;
    let takes = schema.iter().take_while(|a| !a.kwarg_only).count();
    if positional.len() > takes {
        return Err(Error::new(
            ErrorCode::ParamInvalid,
            format!("{op}: takes {takes} positional arguments but {} were given", positional.len()),
        ));
    }
    // Small per-call collections stay on the stack (SmallVec): a tiny op's call is a few
    // microseconds, and each heap allocation and free is a measurable part of it.
    let mut bound: SmallVec<[Option<Bound<'py, PyAny>>; 8]> = positional.map(Some).collect();
    bound.resize(schema.len(), None);
    let mut stream = None;
    for (key, value) in keywords {
        let key = key.cast::<PyString>().ok().and_then(|k| k.to_str().ok());
        let key = key.ok_or_else(|| Error::invalid(format!("{op}: keyword names must be strings")))?;
        if key == STREAM_KEYWORD {
            stream = Some(value).filter(|v| !v.is_none());
            continue;
        }
        let Some(i) = schema.iter().position(|a| a.name == key) else {
            let names: Vec<_> = schema.iter().map(|a| a.name.as_str()).collect();
            return Err(Error::invalid(format!(
                "{op}: unexpected keyword argument '{key}' (arguments: {})",
                names.join(", ")
            )));
        };
        if bound[i].is_some() {
            return Err(Error::invalid(format!("{op}: got multiple values for argument '{key}'")));
        }
        bound[i] = Some(value);
    }
    for (arg, value) in schema.iter().zip(&bound) {
        if value.is_none() && arg.default.is_none() && !arg.ty.optional {
            return Err(Error::arg(ErrorCode::ParamNullptr, op, &arg.name, a_value_of(&arg.ty), "nothing"));
        }
    }
    Ok((bound, stream))
}

/// [`bind`] for arguments passed as a tuple and a dict of keywords.
pub(crate) fn bind_tuple<'py>(
    entry: &OpEntry,
    args: &Bound<'py, PyTuple>,
    kwargs: Option<&Bound<'py, PyDict>>,
) -> Result<BoundArgs<'py>, Error> {
    bind(entry, args.iter(), kwargs.into_iter().flat_map(|k| k.iter()))
}

/// The keyword that picks the stream an op runs on (no schema may use it as an argument name).
const STREAM_KEYWORD: &str = "stream";

/// What an argument of schema type `ty` expects, with its article: "a float", "an int[]".
fn a_value_of(ty: &impl std::fmt::Display) -> String {
    let ty = ty.to_string();
    let article = if ty.starts_with(['a', 'e', 'i', 'o', 'u']) { "an" } else { "a" };
    format!("{article} {ty}")
}

fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type().name().map(|n| n.to_string()).unwrap_or_else(|_| "?".to_string())
}

/// The items of a `Tensor[]` argument's value (a list, tuple or any iterable).
fn list_items<'py>(op: &str, arg: &Arg, value: &Bound<'py, PyAny>) -> Result<Vec<Bound<'py, PyAny>>, Error> {
    let not_a_list = |_| Error::arg(ErrorCode::ParamInvalid, op, &arg.name, "a list of tensors", type_name(value));
    value.try_iter().map_err(not_a_list)?.collect::<PyResult<_>>().map_err(not_a_list)
}

/// A Python value for an attribute of type `arg.ty` (None: absent or Python `None`).
fn attr_value(op: &str, arg: &Arg, obj: Option<&Bound<'_, PyAny>>) -> Result<Option<AttrValue>, Error> {
    let Some(obj) = obj else { return Ok(None) };
    if obj.is_none() {
        return Ok(Some(AttrValue::None));
    }
    let wrong = || Error::arg(ErrorCode::ParamInvalid, op, &arg.name, a_value_of(&arg.ty), type_name(obj));
    let is_int = obj.is_instance_of::<PyInt>() && !obj.is_instance_of::<PyBool>();
    let value = match arg.ty.base {
        BaseType::Bool | BaseType::Scalar if obj.is_instance_of::<PyBool>() => {
            AttrValue::Bool(obj.is_truthy().map_err(|_| wrong())?)
        }
        BaseType::Int | BaseType::Scalar if is_int => AttrValue::Int(obj.extract::<i64>().map_err(|_| {
            Error::arg(ErrorCode::ParamInvalid, op, &arg.name, "an int that fits in 64 bits", obj.to_string())
        })?),
        // (A `Scalar` int was taken above and stays exact.)
        BaseType::Float | BaseType::Scalar if is_int || obj.is_instance_of::<PyFloat>() => {
            AttrValue::Float(obj.extract::<f64>().map_err(|_| wrong())?)
        }
        BaseType::Str if obj.is_instance_of::<PyString>() => AttrValue::Str(obj.extract().map_err(|_| wrong())?),
        BaseType::IntList if obj.is_instance_of::<PyList>() || obj.is_instance_of::<PyTuple>() => {
            AttrValue::Ints(obj.extract::<Vec<i64>>().map_err(|_| wrong())?)
        }
        // torch.bfloat16, numpy.dtype('float32') and "bf16" all print as a dtype name.
        BaseType::ScalarType => {
            let text = obj.str().map_err(|_| wrong())?.to_string();
            let dtype = DType::parse(text.strip_prefix("torch.").unwrap_or(&text)).map_err(|_| {
                Error::arg(ErrorCode::DType, op, &arg.name, "a dtype (torch.bfloat16, 'float32', ...)", &text)
            })?;
            AttrValue::DType(dtype)
        }
        _ => return Err(wrong()),
    };
    Ok(Some(value))
}

pub fn attr_to_py(py: Python<'_>, v: &AttrValue) -> PyResult<Py<PyAny>> {
    match v {
        AttrValue::None => Ok(py.None()),
        AttrValue::Int(i) => i.into_py_any(py),
        AttrValue::Float(f) => f.into_py_any(py),
        AttrValue::Bool(b) => b.into_py_any(py),
        AttrValue::Str(s) => s.into_py_any(py),
        AttrValue::Ints(v) => v.into_py_any(py),
        AttrValue::DType(d) => d.name().into_py_any(py),
    }
}

/// The attributes the caller gave, by name (defaults are the core's job).
fn attrs<'a>(entry: &'a OpEntry, bound: &[Option<Bound<'_, PyAny>>]) -> Result<Vec<(&'a str, AttrValue)>, Error> {
    let mut out = Vec::new();
    for (arg, value) in entry.schema.args.iter().zip(bound) {
        if !arg.ty.is_tensor() {
            if let Some(v) = attr_value(entry.name(), arg, value.as_ref())? {
                out.push((arg.name.as_str(), v));
            }
        }
    }
    Ok(out)
}

/// A tensor imported through DLPack. Its memory stays alive while the producer object the call
/// holds does (views from the C exchange API) or while `_owner` lives (managed tensors).
pub(crate) struct Imported {
    _owner: Option<ImportedDlpack>,
    /// The first element (the view's offset is 0).
    ptr: *mut u8,
    len: usize,
    dtype: DType,
    /// The shape, then the strides in elements: kept inline rather than as a [`TensorMeta`],
    /// whose dims are an allocation that a call with a cached plan never needs.
    dims: Dims,
    read_only: bool,
}

/// Inline up to rank 4.
type Dims = SmallVec<[usize; INLINE_DIMS]>;
const INLINE_DIMS: usize = 8;

impl Imported {
    /// A view of `ptr` (null or dangling when empty) as `dtype` with `shape` and `strides`.
    /// Fails when the extent overflows; alignment is the caller's check, made with the argument's
    /// name where it has one.
    pub(crate) fn new(
        op: &str,
        owner: Option<ImportedDlpack>,
        dtype: DType,
        dims: Dims,
        ptr: *mut u8,
        read_only: bool,
    ) -> Result<Imported, Error> {
        let rank = dims.len() / 2;
        let meta = MetaRef { dtype, shape: &dims[..rank], strides: &dims[rank..], offset: 0 };
        let len = meta.storage_bytes().map_err(|e| e.context(op))?;
        // Empty tensors may come with a null data pointer; the core wants an aligned one.
        let ptr = if len == 0 { std::ptr::without_provenance_mut(dtype.size()) } else { ptr };
        Ok(Imported { _owner: owner, ptr, len, dtype, dims, read_only })
    }

    /// A view of `ptr` laid out as `meta` (an output the call made).
    pub(crate) fn output(op: &str, meta: &TensorMeta, ptr: *mut u8) -> Result<Imported, Error> {
        Imported::new(op, None, meta.dtype, dims_of(meta), ptr, false)
    }

    fn meta_ref(&self) -> MetaRef<'_> {
        let (shape, strides) = self.dims.split_at(self.dims.len() / 2);
        MetaRef { dtype: self.dtype, shape, strides, offset: 0 }
    }

    /// The full meta, for planning (a call with a cached plan needs none).
    fn meta(&self) -> Result<TensorMeta, Error> {
        self.meta_ref().to_meta()
    }
}

fn dims_of(meta: &TensorMeta) -> Dims {
    dims(meta.shape(), meta.layout.strides())
}

/// Shape, then strides (one per dim).
fn dims(shape: &[usize], strides: &[usize]) -> Dims {
    debug_assert_eq!(shape.len(), strides.len());
    let rank = shape.len();
    if 2 * rank > INLINE_DIMS {
        return shape.iter().chain(strides).copied().collect();
    }
    // Written into the inline buffer by a plain loop: SmallVec's extends and slice inserts cost
    // several times as much for a few dims, per callgrind.
    let mut buf = [0; INLINE_DIMS];
    for (i, (&d, &s)) in shape.iter().zip(strides).enumerate() {
        (buf[i], buf[rank + i]) = (d, s);
    }
    Dims::from_buf_and_len(buf, 2 * rank)
}

/// How uniop talks to a tensor's producer, decided once per Python type.
#[derive(Clone, Copy)]
enum Producer {
    /// The producer's DLPack C exchange API (torch has one): borrowed views and direct tensor
    /// creation without capsules. Torch tensors the C++ reader of `uniop.torch` takes, once it is
    /// loaded ([`crate::torch_abi::read_torch_input`]), never get here; `torch` says the type is a
    /// `torch.Tensor`, whose views the exchange API describes only in part ([`check_torch_view`]).
    Exchange { api: &'static ExchangeApi, torch: bool },
    /// A NumPy array: its header is read, and outputs are made, through NumPy's C API.
    NumPy,
    /// Anything else: `__dlpack__` capsules in, outputs from the Python allocator.
    Capsules,
}

/// The producer of `obj`, looked up once per type and thread — the DLPack spec has an exchange
/// API live for the whole process and lets consumers cache it per type — and kept (an exchange
/// API is leaked, one small handle per type seen) so a call pays no attribute lookup. Each type
/// seen is kept alive for the same reason: its address keys the cache and must never be reused by
/// another type.
fn producer(obj: &Bound<'_, PyAny>) -> Producer {
    thread_local! {
        static PRODUCERS: std::cell::RefCell<Vec<(usize, Producer)>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    let ty = obj.get_type_ptr() as usize;
    if let Some(known) = PRODUCERS.with(|c| c.borrow().iter().find(|(t, _)| *t == ty).map(|(_, p)| *p)) {
        return known;
    }
    let producer = match ExchangeApi::from_object(obj.as_borrowed()).ok().flatten() {
        Some(api) => Producer::Exchange { api: Box::leak(Box::new(api)), torch: is_torch_tensor(obj) },
        None if ndarray::is_array(obj) => Producer::NumPy,
        None => Producer::Capsules,
    };
    std::mem::forget(obj.get_type().unbind());
    PRODUCERS.with(|c| c.borrow_mut().push((ty, producer)));
    producer
}

/// Whether `obj` is a `torch.Tensor` (or a subclass's, such as `Parameter`). Looked up in
/// `sys.modules`, never imported: a torch tensor means torch is loaded.
fn is_torch_tensor(obj: &Bound<'_, PyAny>) -> bool {
    let py = obj.py();
    let tensor_type = py
        .import("sys")
        .and_then(|sys| sys.getattr("modules"))
        .and_then(|modules| modules.get_item("torch"))
        .and_then(|torch| torch.getattr("Tensor"));
    tensor_type.is_ok_and(|t| obj.is_instance(&t).unwrap_or(false))
}

/// A torch view whose values are the negation of its memory's (`_neg_view()`; torch makes them
/// lazily, e.g. the imaginary part of a conjugated tensor): neither DLPack nor a raw view can say so.
pub(crate) fn negative_view(op: &str, arg: &str) -> Error {
    let expected = "a tensor without a pending negation (call .resolve_neg() on it)";
    Error::arg(ErrorCode::ParamInvalid, op, arg, expected, "a negative view")
}

/// A torch view reaching past the end of its storage (one resized smaller under it).
pub(crate) fn past_storage(op: &str, arg: &str, given: String) -> Error {
    Error::arg(ErrorCode::ParamInvalid, op, arg, "a tensor whose storage holds its elements", given)
}

/// What torch's DLPack export leaves out of a view, checked through torch's Python API (about
/// 0.5 µs a tensor, on the route taken only without uniop.torch's C++ reader, which checks the
/// same in C++): a pending negation, whose values read as they are gave `silu(x)` for
/// `silu(-x)`, and a storage resized smaller under the view, whose reading crashed the process.
fn check_torch_view(op: &str, arg: &str, obj: &Bound<'_, PyAny>, view: &Imported) -> Result<(), Error> {
    let py = obj.py();
    let uninspectable = |e: PyErr| {
        Error::arg(ErrorCode::ParamInvalid, op, arg, "a torch tensor whose storage can be read", e.to_string())
    };
    if obj.call_method0(pyo3::intern!(py, "is_neg")).and_then(|v| v.is_truthy()).map_err(uninspectable)? {
        return Err(negative_view(op, arg));
    }
    if view.len == 0 {
        return Ok(());
    }
    let storage = obj.call_method0(pyo3::intern!(py, "untyped_storage")).map_err(uninspectable)?;
    let start: usize =
        storage.call_method0(pyo3::intern!(py, "data_ptr")).and_then(|v| v.extract()).map_err(uninspectable)?;
    let nbytes: usize =
        storage.call_method0(pyo3::intern!(py, "nbytes")).and_then(|v| v.extract()).map_err(uninspectable)?;
    let (first, end) = (view.ptr as usize, (view.ptr as usize).saturating_add(view.len));
    if first < start || end > start.saturating_add(nbytes) {
        let reach = end.wrapping_sub(start) as isize;
        return Err(past_storage(op, arg, format!("a view reaching {reach} bytes into a storage of {nbytes}")));
    }
    Ok(())
}

/// What a dtype error says was expected, on every route into the core.
pub(crate) const KNOWN_DTYPES: &str = "a dtype uniop knows (float32/16, bfloat16, float64, int8/32/64, uint8, bool)";

/// Reads a DLPack descriptor as a view of the tensor's memory (no owner; the caller keeps the
/// tensor alive): as DLPack says (null strides: compact), checked like any foreign descriptor. Views
/// lent for a call (torch's exchange API, uniop.torch's C++ reader and kernels, any caller of the
/// torch ABI) come here as they are; dlpark's `TensorRef`, whose element and byte counts are about
/// a third of reading a tensor and which the checks below cover, is built only for capsules
/// ([`describe`]).
///
/// # Safety
/// A non-null `shape`, and `strides`, must point at `ndim` values that outlive the call.
pub(crate) unsafe fn describe_raw(op: &str, arg: &str, t: &DLTensor) -> Result<Imported, Error> {
    let invalid =
        |e: dlpark::tensor::Error| Error::arg(ErrorCode::ParamInvalid, op, arg, "a valid DLPack tensor", e.to_string());
    // SAFETY: the caller's promise; both check the rank and null pointers.
    let (shape, strides) = unsafe { (t.shape().map_err(invalid)?, t.strides_or_compact().map_err(invalid)?) };
    describe_parts(op, arg, t.device, t.dtype, shape, &strides, t.data, t.byte_offset)
}

/// [`describe_raw`] for a validated capsule.
fn describe(op: &str, arg: &str, t: &dlpark::TensorRef<'_>) -> Result<Imported, Error> {
    let strides = t
        .strides_or_compact()
        .map_err(|e| Error::arg(ErrorCode::ParamInvalid, op, arg, "valid strides", e.to_string()))?;
    describe_parts(op, arg, t.device(), t.dtype(), t.shape(), &strides, t.data_ptr(), t.byte_offset())
}

/// The checks and the view [`describe_raw`] and [`describe`] make of a descriptor's parts.
#[allow(clippy::too_many_arguments)]
fn describe_parts(
    op: &str,
    arg: &str,
    device: DLDevice,
    dt: DLDataType,
    shape: &[i64],
    strides: &[i64],
    data: *const std::ffi::c_void,
    byte_offset: u64,
) -> Result<Imported, Error> {
    let bad = |expected: &str, given: String| Error::arg(ErrorCode::ParamInvalid, op, arg, expected, given);
    if device.device_type.0 != 1 {
        let name = match device.device_type.0 {
            2 => "cuda".to_string(),
            3 => "cuda pinned host".to_string(),
            10 => "rocm".to_string(),
            other => format!("DLPack device type {other}"),
        };
        return Err(bad("a CPU tensor", format!("a tensor on {name}:{}", device.device_id)));
    }
    let dtype = if dt.lanes == 1 { DType::from_dlpack(dt.code.0, dt.bits).ok() } else { None };
    let dtype = dtype.ok_or_else(|| {
        Error::arg(
            ErrorCode::DType,
            op,
            arg,
            KNOWN_DTYPES,
            format!("DLPack type code {} with {} bits x {} lanes", dt.code.0, dt.bits, dt.lanes),
        )
    })?;
    if let Some(s) = strides.iter().find(|&&s| s < 0) {
        return Err(Error::arg(
            ErrorCode::Shape,
            op,
            arg,
            "non-negative strides (pass a copy of a reversed view)",
            format!("stride {s}"),
        ));
    }
    // Read as usize (same size): the strides were just checked non-negative, and a negative dim,
    // read as a huge one, fails the extent's overflow check.
    let shape: &[usize] = bytemuck::cast_slice(shape);
    // A view's extent can be small while its element count overflows (stride-0 dims): refused here,
    // where the view comes in, so that no later count of its elements can wrap.
    if uniop::layout::checked_numel(shape).is_err() {
        let given = format!("shape {}", ShapeDisplay(shape));
        return Err(Error::arg(ErrorCode::Shape, op, arg, "a tensor whose element count fits in usize", given));
    }
    let dims = dims(shape, bytemuck::cast_slice(strides));
    let base = (data as *mut u8).wrapping_add(byte_offset as usize);
    let view = Imported::new(op, None, dtype, dims, base, false)?;
    // Torch's efficient zero tensors (gradients autograd knows to be zero) are views of no memory.
    if data.is_null() && view.len > 0 {
        let given = format!("a null data pointer for {} bytes of elements", view.len);
        return Err(bad("a tensor with memory behind its elements", given));
    }
    if !(view.ptr as usize).is_multiple_of(dtype.size()) {
        return Err(bad("data aligned to its element size", format!("address {base:p}")));
    }
    Ok(view)
}

fn import(op: &str, arg: &str, obj: &Bound<'_, PyAny>) -> Result<Imported, Error> {
    let py = obj.py();
    let refused = |e: PyErr| {
        // Producers refuse devices they cannot share (torch's meta tensors) with long native
        // traces: name the device when it is not the CPU, else give the first line of the
        // producer's message (a CPU tensor of a layout DLPack lacks, such as torch's mkldnn ones,
        // reports no DLPack device but is on "cpu").
        let device = obj.call_method0(pyo3::intern!(py, "__dlpack_device__")).ok();
        let device: Option<(u32, i32)> = device.and_then(|d| d.extract().ok());
        let name = obj.getattr(pyo3::intern!(py, "device")).ok().map(|d| d.to_string());
        let elsewhere = match device {
            Some((device_type, _)) => device_type != 1,
            None => name.as_deref().is_some_and(|n| n != "cpu"),
        };
        match name.filter(|_| elsewhere) {
            Some(name) => Error::arg(ErrorCode::ParamInvalid, op, arg, "a CPU tensor", format!("a tensor on {name}")),
            None => {
                let text = e.to_string();
                let first = text.lines().next().unwrap_or_default().to_string();
                Error::arg(ErrorCode::ParamInvalid, op, arg, "a tensor that can be shared through DLPack", first)
            }
        }
    };
    // Fast paths: a borrowed view, no managed tensor; the caller holds `obj` for the whole call.
    // Torch tensors first, before the per-type producer lookup they do not need.
    if let Some(read) = crate::torch_abi::read_torch_input(op, arg, obj) {
        return read;
    }
    let (api, torch) = match producer(obj) {
        Producer::Exchange { api, torch } => (Some(api), torch),
        Producer::NumPy => match ndarray::describe(obj) {
            Some((dtype, dims, ptr, read_only)) => return Imported::new(op, None, dtype, dims, ptr, read_only),
            None => (None, false),
        },
        Producer::Capsules => (None, false),
    };
    if let Some(api) = api {
        let described = api
            .with_tensor_view_no_sync(obj.as_borrowed(), |t, _stream| {
                // SAFETY: the view is valid during this callback and only read in it.
                unsafe { describe_raw(op, arg, t) }
            })
            .map_err(refused)?;
        let view = described?;
        if torch {
            check_torch_view(op, arg, obj, &view)?;
        }
        return Ok(view);
    }
    if !obj.hasattr(pyo3::intern!(py, "__dlpack__")).unwrap_or(false) {
        return Err(Error::arg(
            ErrorCode::ParamInvalid,
            op,
            arg,
            "a tensor (a NumPy array, a torch.Tensor or any object with __dlpack__)",
            type_name(obj),
        ));
    }
    // Ask for the capsule ourselves (DLPack 1.x first): handing dlpark a capsule skips its probe
    // for an exchange API this type is known not to have.
    let capsule = obj
        .call_method(pyo3::intern!(py, "__dlpack__"), (), Some(&max_version_kwargs(py)?))
        .or_else(|_| obj.call_method0(pyo3::intern!(py, "__dlpack__")))
        .map_err(refused)?;
    let owner = from_dlpack(capsule.as_borrowed(), None, None).map_err(refused)?;
    let t = owner
        .validate()
        .map_err(|e| Error::arg(ErrorCode::ParamInvalid, op, arg, "a valid DLPack tensor", e.to_string()))?;
    let view = describe(op, arg, &t)?;
    let read_only = owner.flags().contains(DlpackFlags::READ_ONLY);
    Ok(Imported { _owner: Some(owner), read_only, ..view })
}

fn max_version_kwargs(py: Python<'_>) -> Result<Bound<'_, PyDict>, Error> {
    let kwargs = PyDict::new(py);
    kwargs
        .set_item(pyo3::intern!(py, "max_version"), (dlpark::ffi::DLPACK_MAJOR_VERSION, 0u32))
        .map_err(|e| Error::internal(e.to_string()))?;
    Ok(kwargs)
}

/// Kernel work runs with the GIL released; the views it touches are kept alive by the caller's
/// frame until it returns.
struct Unattached<T>(T);
// SAFETY: the executor's raw views point at memory owned by Python objects this thread holds
// references to for the whole call; no Python API is used while detached.
unsafe impl<T> Send for Unattached<T> {}

impl<T> Unattached<T> {
    /// Taking `self` whole makes closures capture the wrapper, not its (non-Send) fields.
    fn into_inner(self) -> T {
        self.0
    }
}

/// `dtype` as DLPack names it (one lane).
pub(crate) fn dl_dtype(dtype: DType) -> DLDataType {
    let (code, bits) = dtype.dlpack();
    DLDataType { code: DLDataTypeCode(code), bits, lanes: 1 }
}

/// A new contiguous output over a block of uniop's caching allocator, as a DLPack managed tensor
/// whose deleter returns the block (whenever the consuming framework frees the tensor), and the
/// view the run writes through.
fn dlpack_output(op: &str, meta: &TensorMeta) -> PyResult<(Managed<DLManagedTensorVersioned>, Imported)> {
    let bytes = meta.contiguous_bytes().map_err(to_py_err)?;
    let buffer = Allocator::global().allocate(bytes, MemPolicy::HugeFirst).map_err(to_py_err)?;
    let ptr = buffer.as_ptr();
    let shape: Vec<i64> = meta.shape().iter().map(|&d| d as i64).collect();
    let mut tensor = Dynamic::compact(shape)
        .initialize(Box::new(buffer))
        .map_err(|e| to_py_err(Error::internal(format!("{op}: DLPack output: {e}"))))?;
    tensor
        .set_data(ptr.cast())
        .set_device(DLDevice { device_type: DLDeviceType::CPU, device_id: 0 })
        .set_dtype(dl_dtype(meta.dtype));
    // SAFETY: data, device, dtype, shape and compact strides describe the buffer the tensor owns
    // (its context), which lives until the consumer's deleter runs.
    let managed = unsafe { tensor.finish() };
    let view = Imported::output(op, meta, ptr).map_err(to_py_err)?;
    Ok((managed, view))
}

/// A new output like `like`. Producers with a C exchange API (torch) get a tensor created
/// directly over a block of uniop's caching allocator, returned to it when the framework frees
/// the tensor — no Python call, no capsule; NumPy callers get an array from NumPy's C API. Others
/// go through the Python allocator (`uniop._allocate`).
fn allocate<'py>(op: &str, like: &Bound<'py, PyAny>, meta: &TensorMeta) -> PyResult<(Bound<'py, PyAny>, Imported)> {
    let py = like.py();
    let producer = producer(like);
    if let Producer::NumPy = producer {
        if let Some(made) = ndarray::empty(py, meta) {
            let (obj, ptr) =
                made.map_err(|e| to_py_err(cannot_create(op, "NumPy", "an output", meta).because(e.value(py))))?;
            let view = Imported::output(op, meta, ptr).map_err(to_py_err)?;
            return Ok((obj, view));
        }
    }
    if let Producer::Exchange { api, .. } = producer {
        if let Some(made) = crate::torch_abi::make_torch_output(op, like, meta) {
            return made;
        }
        let (managed, view) = dlpack_output(op, meta)?;
        let obj = api.managed_tensor_to_py_object_no_sync(managed, py)?;
        return Ok((obj, view));
    }
    let alloc = ALLOCATOR
        .get()
        .ok_or_else(|| PyRuntimeError::new_err("uniop: no output allocator (import uniop, not uniop._native)"))?;
    let obj = alloc.bind(py).call1((like, meta.shape().to_vec(), meta.dtype.name()))?;
    let mut view = import(op, "output", &obj).map_err(to_py_err)?;
    // An empty array's strides say nothing (NumPy 2 reports zeros): plan with the inferred ones,
    // as the other routes do, so a cached plan fits whichever route the next call takes.
    if view.len == 0 && view.dtype == meta.dtype && view.meta_ref().shape == meta.shape() {
        view.dims = dims_of(meta);
    }
    Ok((obj, view))
}

/// Runs `entry` on arguments [`bind`] matched to its schema.
pub fn call(py: Python<'_>, entry: &Arc<OpEntry>, (bound, stream): BoundArgs<'_>) -> PyResult<Py<PyAny>> {
    let op = entry.name();
    let attrs = attrs(entry, &bound).map_err(to_py_err)?;
    let stream = match stream {
        None => Stream::default_stream().clone(),
        Some(s) => match s.cast::<PyStream>() {
            Ok(s) => s.get().inner.clone(),
            Err(_) => {
                return Err(to_py_err(Error::arg(
                    ErrorCode::ParamInvalid,
                    op,
                    STREAM_KEYWORD,
                    "a uniop.Stream",
                    type_name(&s),
                )))
            }
        },
    };

    let mut tensors = CallTensors::default();
    let mut like = None;
    for (arg, value) in entry.schema.args.iter().zip(&bound) {
        if !arg.ty.is_tensor() {
            continue;
        }
        let value = value.as_ref().filter(|v| !v.is_none());
        let Some(value) = value else {
            tensors.absent(op, arg).map_err(to_py_err)?;
            continue;
        };
        let items: SmallVec<[Bound<'_, PyAny>; 1]> = if arg.ty.base == BaseType::TensorList {
            list_items(op, arg, value).map_err(to_py_err)?.into()
        } else {
            smallvec::smallvec![value.clone()]
        };
        // Outputs are created like the first tensor (a list's first item, not the list).
        if let Some(first) = items.first() {
            like.get_or_insert_with(|| first.clone());
        }
        for item in &items {
            tensors.push(op, arg, import(op, &arg.name, item).map_err(to_py_err)?).map_err(to_py_err)?;
        }
    }

    let like = like.ok_or_else(|| to_py_err(Error::invalid(format!("{op}: needs at least one tensor"))))?;
    let mut returned = plan_and_run(Some(py), entry, &tensors, &attrs, &stream, |meta| allocate(op, &like, meta))?;
    if entry.schema.returns_list() {
        return Ok(PyList::new(py, returned)?.into_any().unbind());
    }
    match returned.len() {
        0 => Ok(py.None()),
        1 => Ok(returned.pop().expect("one return").unbind()),
        _ => Ok(PyTuple::new(py, returned)?.into_any().unbind()),
    }
}

/// The tensors of one call as the executor binds them: arguments the op updates in place go with
/// the outputs, the rest are inputs (schema order; `None` for an absent optional tensor).
#[derive(Default)]
pub(crate) struct CallTensors {
    inputs: SmallVec<[Option<Imported>; 4]>,
    in_place: Vec<Imported>,
}

impl CallTensors {
    /// The caller gave no tensor (None) for `arg`.
    pub(crate) fn absent(&mut self, op: &str, arg: &Arg) -> Result<(), Error> {
        if arg.ty.mutated.is_some() || !arg.ty.optional {
            return Err(Error::arg(ErrorCode::ParamNullptr, op, &arg.name, "a tensor", "None"));
        }
        self.inputs.push(None);
        Ok(())
    }

    /// `t` is (an item of) `arg`.
    pub(crate) fn push(&mut self, op: &str, arg: &Arg, t: Imported) -> Result<(), Error> {
        if arg.ty.mutated.is_none() {
            self.inputs.push(Some(t));
            return Ok(());
        }
        if t.read_only {
            return Err(Error::arg(
                ErrorCode::ParamInvalid,
                op,
                &arg.name,
                "a writable tensor (the op updates it in place)",
                "a read-only one",
            ));
        }
        self.in_place.push(t);
        Ok(())
    }
}

/// Phases 1 and 2 for imported tensors, shared by every route into the core (`uniop.<op>`, the
/// C++ torch kernel): the plan cached for this signature (else infer, plan and cache it), one
/// output per return made by `allocate` (what the caller's framework will own), the run.
/// Given the GIL (`py`), work bigger than one block runs with it released.
pub(crate) fn plan_and_run<O>(
    py: Option<Python<'_>>,
    entry: &Arc<OpEntry>,
    tensors: &CallTensors,
    attrs: &[(&str, AttrValue)],
    stream: &Stream,
    mut allocate: impl FnMut(&TensorMeta) -> PyResult<(O, Imported)>,
) -> PyResult<SmallVec<[O; 2]>> {
    let (inputs, in_place) = (&tensors.inputs[..], &tensors.in_place[..]);
    let key = signature(entry, inputs, in_place, attrs);
    // Taken out of its slot while in use: allocating outputs may call back into Python, which
    // may call uniop again. (The slot stays, so putting the plan back moves no key.)
    let cached = PLANS.with(|plans| plans.borrow_mut().get_mut(&key).and_then(Option::take));
    let expected = match &cached {
        Some(plan) => plan.outputs.clone(),
        None => {
            let cx = bind_metas(entry, inputs, in_place, attrs).map_err(to_py_err)?;
            entry.infer(&cx).map_err(to_py_err)?.into()
        }
    };
    let mut returned: SmallVec<[O; 2]> = SmallVec::new();
    let mut outputs: SmallVec<[Imported; 2]> = SmallVec::new();
    for meta in expected.iter() {
        let (obj, view) = allocate(meta)?;
        outputs.push(view);
        returned.push(obj);
    }
    // SAFETY (every view below): each Imported keeps its producer's memory alive and unmoved until
    // the caller is done with it, after the synchronous run has finished with it. The cached
    // executor keeps the pointers afterwards but never uses them: every tensor is rebound before
    // its next run.
    let input_view = |t: &Imported| unsafe { TensorRef::<'static>::from_raw(t.ptr, t.len, t.meta()?) };
    let output_view = |t: &Imported| unsafe { TensorMut::<'static>::from_raw(t.ptr, t.len, t.meta()?) };
    let mut plan = match cached {
        // The signature matched, so inputs and in-place tensors are laid out as the plan's and only
        // their addresses change. Outputs are not in the signature: one made like the plan's (every
        // route but a foreign allocator's) is rebound by address too, any other as a new view,
        // which refuses a layout other than the planned one.
        Some(mut plan) => {
            let given = inputs.iter().enumerate().filter_map(|(i, t)| Some((i, t.as_ref()?)));
            for (i, t) in given {
                unsafe { plan.exec.rebind_input_memory(i, t.ptr, t.len) }.map_err(to_py_err)?;
            }
            for (i, t) in in_place.iter().chain(&outputs).enumerate() {
                let as_planned =
                    i < in_place.len() || plan.exec.output_meta(i).is_some_and(|m| m.as_meta_ref() == t.meta_ref());
                let rebound = if as_planned {
                    unsafe { plan.exec.rebind_output_memory(i, t.ptr, t.len) }
                } else {
                    output_view(t).and_then(|view| plan.exec.rebind_output(i, view))
                };
                rebound.map_err(to_py_err)?;
            }
            plan
        }
        None => {
            let input_refs = inputs
                .iter()
                .map(|t| t.as_ref().map(input_view).transpose())
                .collect::<Result<Vec<_>, _>>()
                .map_err(to_py_err)?;
            let output_views =
                in_place.iter().chain(&outputs).map(output_view).collect::<Result<_, _>>().map_err(to_py_err)?;
            let mut exec = Executor::new(entry.clone(), &input_refs, attrs, output_views).map_err(to_py_err)?;
            exec.set_repeatable();
            let size = exec.workspace_size();
            let workspace = if size <= CACHED_WORKSPACE_LIMIT {
                Some(Allocator::global().allocate(size, MemPolicy::HugeFirst).map_err(to_py_err)?)
            } else {
                None
            };
            Plan { exec, outputs: expected, workspace }
        }
    };
    let scratch = match plan.workspace {
        Some(_) => None,
        None => {
            Some(Allocator::global().allocate(plan.exec.workspace_size(), MemPolicy::HugeFirst).map_err(to_py_err)?)
        }
    };
    let run = |plan: &mut Plan, scratch: &Option<DeviceBuffer>, stream: &Stream| {
        let ws = plan.workspace.as_ref().or(scratch.as_ref()).expect("a workspace");
        // SAFETY: the workspace is exclusively this plan's until `run` returns (it synchronizes).
        plan.exec.run(unsafe { ws.as_mut_slice() }, stream)
    };
    // Work the op keeps in one block runs in microseconds on this thread: releasing and retaking
    // the GIL would cost more than it lets other threads gain. Anything bigger, or a wait behind
    // other work on the stream, runs with the GIL released.
    let result = match py {
        Some(py) if !(plan.exec.is_single_block() && stream.query()) => {
            let work = Unattached((&mut plan, &scratch, stream));
            py.detach(move || {
                let (plan, scratch, stream) = work.into_inner();
                run(plan, scratch, stream)
            })
        }
        _ => run(&mut plan, &scratch, stream),
    };
    result.map_err(to_py_err)?;
    PLANS.with(|plans| {
        let mut plans = plans.borrow_mut();
        if let Some(slot) = plans.get_mut(&key) {
            *slot = Some(plan);
            return;
        }
        if plans.len() >= CACHED_PLANS {
            plans.clear();
        }
        plans.insert(key, Some(plan));
    });
    Ok(returned)
}

/// A phase-1 result kept for the next call with the same signature: a repeatable executor
/// (rebound to each call's tensors) and its workspace, so a repeated call skips binding, infer,
/// planning and allocation — the aclnn "repeatable executor" idea applied per signature.
struct Plan {
    exec: Executor<'static>,
    outputs: Arc<[TensorMeta]>,
    workspace: Option<DeviceBuffer>,
}

/// Plans kept per thread (cleared when full: shapes in a model repeat, so a few dozen suffice).
const CACHED_PLANS: usize = 256;
/// Larger workspaces go back to the caching allocator between calls instead of staying with a plan.
const CACHED_WORKSPACE_LIMIT: usize = 1 << 20;

thread_local! {
    /// `None` while a call uses the plan.
    static PLANS: std::cell::RefCell<FxHashMap<SignatureKey, Option<Plan>>> = std::cell::RefCell::new(FxHashMap::default());
}

/// Everything phase 1 depends on besides the outputs (which infer derives from the rest): the
/// core's call signature over the inputs, then the in-place tensors.
fn signature(
    entry: &Arc<OpEntry>,
    inputs: &[Option<Imported>],
    in_place: &[Imported],
    attrs: &[(&str, AttrValue)],
) -> SignatureKey {
    let mut key = SignatureKey::new();
    uniop::executor::signature(entry, inputs.iter().map(|t| t.as_ref().map(Imported::meta_ref)), attrs, &mut key);
    for t in in_place {
        uniop::executor::meta_words(Some(t.meta_ref()), &mut key);
    }
    key
}

/// Binds tensor metas (inputs in schema order; in-place arguments where the schema has them) for
/// `infer`.
fn bind_metas<'e>(
    entry: &'e OpEntry,
    inputs: &[Option<Imported>],
    in_place: &[Imported],
    attrs: &[(&str, AttrValue)],
) -> uniop::Result<OpCx<'e>> {
    let mut flat = Vec::new();
    let (mut read, mut in_place) = (inputs.iter(), in_place.iter());
    for (arg, take) in entry.schema.tensor_args(inputs.len(), false) {
        if arg.ty.mutated.is_some() {
            flat.push(in_place.next().map(Imported::meta).transpose()?);
        } else {
            for t in read.by_ref().take(take) {
                flat.push(t.as_ref().map(Imported::meta).transpose()?);
            }
        }
    }
    entry.bind_flat(flat, attrs)
}

/// Metadata of a torch-like object (`.shape`, `.stride()`, `.dtype`), for fake tensors.
fn meta_of(op: &str, arg: &str, obj: &Bound<'_, PyAny>) -> Result<TensorMeta, Error> {
    let py = obj.py();
    let bad =
        |why: String| Error::arg(ErrorCode::ParamInvalid, op, arg, "a tensor with shape, stride() and dtype", why);
    let shape: Vec<usize> =
        obj.getattr(pyo3::intern!(py, "shape")).and_then(|s| s.extract()).map_err(|e| bad(e.to_string()))?;
    let strides: Vec<usize> =
        obj.call_method0(pyo3::intern!(py, "stride")).and_then(|s| s.extract()).map_err(|e| bad(e.to_string()))?;
    let dtype_text = obj.getattr(pyo3::intern!(py, "dtype")).map_err(|e| bad(e.to_string()))?.to_string();
    let dtype = DType::parse(dtype_text.strip_prefix("torch.").unwrap_or(&dtype_text))
        .map_err(|_| Error::arg(ErrorCode::DType, op, arg, "a dtype uniop knows", &dtype_text))?;
    Ok(TensorMeta { dtype, layout: Layout::strided(&shape, &strides, 0)? })
}

/// The output metas of `entry` on arguments [`bind`] matched to its schema.
pub fn infer(py: Python<'_>, entry: &Arc<OpEntry>, (bound, _stream): BoundArgs<'_>) -> PyResult<Py<PyAny>> {
    let op = entry.name();
    let run = || -> Result<Vec<TensorMeta>, Error> {
        let attrs = attrs(entry, &bound)?;
        let mut groups = Vec::new();
        for (arg, value) in entry.schema.args.iter().zip(&bound) {
            if arg.ty.is_tensor() {
                let group = match value.as_ref().filter(|v| !v.is_none()) {
                    Some(v) if arg.ty.base == BaseType::TensorList => list_items(op, arg, v)?
                        .iter()
                        .map(|item| meta_of(op, &arg.name, item))
                        .collect::<Result<_, _>>()?,
                    Some(v) => vec![meta_of(op, &arg.name, v)?],
                    None => Vec::new(),
                };
                groups.push(group);
            }
        }
        let cx = entry.bind(groups, &attrs)?;
        entry.infer(&cx)
    };
    let metas = run().map_err(to_py_err)?;
    let list: Vec<(Vec<usize>, &str)> = metas.iter().map(|m| (m.shape().to_vec(), m.dtype.name())).collect();
    list.into_py_any(py)
}

/// The error for an output the framework (`maker`: "torch", "NumPy") could not create; `what`
/// is the output as the caller can tell it (`return 'y'`, `return 1`, `an output`).
pub(crate) fn cannot_create(op: &str, maker: &str, what: &str, meta: &TensorMeta) -> Error {
    Error::new(
        ErrorCode::Runtime,
        format!(
            "{op}: {maker} could not create {what} ({} {}, {} bytes)",
            ShapeDisplay(meta.shape()),
            meta.dtype.name(),
            meta.contiguous_bytes().unwrap_or(0)
        ),
    )
}
