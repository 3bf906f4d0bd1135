//! The one call path every op shares: bind Python arguments to the schema, import the tensors
//! zero-copy through DLPack, infer, let the caller's framework allocate the outputs, run.

use crate::runtime::Stream as PyStream;
use crate::to_py_err;
use dlpark::python::{from_dlpack, ImportedDlpack};
use dlpark::DlpackFlags;
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple};
use pyo3::IntoPyObjectExt;
use std::sync::{Arc, OnceLock};
use uniop::runtime::{Allocator, MemPolicy};
use uniop::schema::{Arg, BaseType};
use uniop::{
    AttrValue, DType, Error, ErrorCode, Executor, Layout, OpCx, OpEntry, Stream, TensorMeta, TensorMut, TensorRef,
};

static ALLOCATOR: OnceLock<Py<PyAny>> = OnceLock::new();

pub fn set_allocator(alloc: Py<PyAny>) -> PyResult<()> {
    ALLOCATOR.set(alloc).map_err(|_| PyRuntimeError::new_err("uniop: the output allocator is already set"))
}

/// The schema's arguments matched to what the caller passed (`None`: use the default), and the
/// `stream=` keyword every op takes besides its schema.
fn bind<'py>(
    entry: &OpEntry,
    args: &Bound<'py, PyTuple>,
    kwargs: Option<&Bound<'py, PyDict>>,
) -> Result<(Vec<Option<Bound<'py, PyAny>>>, Option<Bound<'py, PyAny>>), Error> {
    let op = entry.name();
    let schema = &entry.schema.args;
    let positional = schema.iter().take_while(|a| !a.kwarg_only).count();
    if args.len() > positional {
        return Err(Error::new(
            ErrorCode::ParamInvalid,
            format!("{op}: takes {positional} positional arguments but {} were given", args.len()),
        ));
    }
    let mut bound: Vec<Option<Bound<'py, PyAny>>> = args.iter().map(Some).collect();
    bound.resize(schema.len(), None);
    let mut stream = None;
    if let Some(kwargs) = kwargs {
        for (key, value) in kwargs.iter() {
            let key: String =
                key.extract().map_err(|_| Error::invalid(format!("{op}: keyword names must be strings")))?;
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
    }
    for (arg, value) in schema.iter().zip(&bound) {
        if value.is_none() && arg.default.is_none() && !arg.ty.optional {
            return Err(Error::arg(ErrorCode::ParamNullptr, op, &arg.name, format!("a {}", arg.ty), "nothing"));
        }
    }
    Ok((bound, stream))
}

/// The keyword that picks the stream an op runs on (no schema may use it as an argument name).
const STREAM_KEYWORD: &str = "stream";

fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type().name().map(|n| n.to_string()).unwrap_or_else(|_| "?".to_string())
}

/// A Python value for an attribute of type `arg.ty` (None: absent or Python `None`).
fn attr_value(op: &str, arg: &Arg, obj: Option<&Bound<'_, PyAny>>) -> Result<Option<AttrValue>, Error> {
    let Some(obj) = obj else { return Ok(None) };
    if obj.is_none() {
        return Ok(Some(AttrValue::None));
    }
    let wrong = || Error::arg(ErrorCode::ParamInvalid, op, &arg.name, format!("a {}", arg.ty), type_name(obj));
    let is_int = obj.is_instance_of::<PyInt>() && !obj.is_instance_of::<PyBool>();
    let value = match arg.ty.base {
        BaseType::Bool if obj.is_instance_of::<PyBool>() => AttrValue::Bool(obj.is_truthy().map_err(|_| wrong())?),
        BaseType::Int if is_int => AttrValue::Int(obj.extract::<i64>().map_err(|_| {
            Error::arg(ErrorCode::ParamInvalid, op, &arg.name, "an int that fits in 64 bits", obj.to_string())
        })?),
        BaseType::Float if is_int || obj.is_instance_of::<PyFloat>() => {
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

/// A tensor imported through DLPack; the producer's memory stays alive while this lives.
struct Imported {
    _owner: ImportedDlpack,
    ptr: *mut u8,
    len: usize,
    meta: TensorMeta,
    read_only: bool,
}

fn import(op: &str, arg: &str, obj: &Bound<'_, PyAny>) -> Result<Imported, Error> {
    let py = obj.py();
    if !obj.hasattr(pyo3::intern!(py, "__dlpack__")).unwrap_or(false) {
        return Err(Error::arg(
            ErrorCode::ParamInvalid,
            op,
            arg,
            "a tensor (a NumPy array, a torch.Tensor or any object with __dlpack__)",
            type_name(obj),
        ));
    }
    let owner = from_dlpack(obj.as_borrowed(), None, None).map_err(|e| {
        // Producers refuse devices they cannot share (torch's meta tensors) with long native
        // traces: name the device when it says, else the first line of the producer's message.
        let device = obj.call_method0(pyo3::intern!(py, "__dlpack_device__")).ok();
        let device: Option<(u32, i32)> = device.and_then(|d| d.extract().ok());
        match obj.getattr(pyo3::intern!(py, "device")).ok().filter(|_| device.is_none_or(|(t, _)| t != 1)) {
            Some(name) => Error::arg(ErrorCode::ParamInvalid, op, arg, "a CPU tensor", format!("a tensor on {name}")),
            None => {
                let text = e.to_string();
                let first = text.lines().next().unwrap_or_default().to_string();
                Error::arg(ErrorCode::ParamInvalid, op, arg, "a tensor that can be shared through DLPack", first)
            }
        }
    })?;
    let bad = |expected: &str, given: String| Error::arg(ErrorCode::ParamInvalid, op, arg, expected, given);
    let (meta, ptr, read_only) = {
        let t = owner.validate().map_err(|e| bad("a valid DLPack tensor", e.to_string()))?;
        let device = t.device();
        if device.device_type.0 != 1 {
            let name = match device.device_type.0 {
                2 => "cuda".to_string(),
                3 => "cuda pinned host".to_string(),
                10 => "rocm".to_string(),
                other => format!("DLPack device type {other}"),
            };
            return Err(bad("a CPU tensor", format!("a tensor on {name}:{}", device.device_id)));
        }
        let dt = t.dtype();
        let dtype = if dt.lanes == 1 { DType::from_dlpack(dt.code.0, dt.bits).ok() } else { None };
        let dtype = dtype.ok_or_else(|| {
            Error::arg(
                ErrorCode::DType,
                op,
                arg,
                "a dtype uniop knows (float32/16, bfloat16, float64, int8/32/64, uint8, bool)",
                format!("DLPack type code {} with {} bits x {} lanes", dt.code.0, dt.bits, dt.lanes),
            )
        })?;
        let shape: Vec<usize> = t.shape().iter().map(|&d| d as usize).collect();
        let strides = t.strides_or_compact().map_err(|e| bad("valid strides", e.to_string()))?;
        if let Some(s) = strides.iter().find(|&&s| s < 0) {
            return Err(Error::arg(
                ErrorCode::Shape,
                op,
                arg,
                "non-negative strides (pass a copy of a reversed view)",
                format!("stride {s}"),
            ));
        }
        let strides: Vec<usize> = strides.iter().map(|&s| s as usize).collect();
        let layout = Layout::strided(&shape, &strides, 0).map_err(|e| e.context(op))?;
        let base = (t.data_ptr() as *mut u8).wrapping_add(t.byte_offset() as usize);
        if (base as usize) % dtype.size() != 0 && !layout.is_empty() {
            return Err(bad("data aligned to its element size", format!("address {base:p}")));
        }
        (TensorMeta { dtype, layout }, base, owner.flags().contains(DlpackFlags::READ_ONLY))
    };
    let len = if meta.layout.is_empty() {
        0
    } else {
        meta.layout.storage_extent().map_err(|e| e.context(op))? * meta.dtype.size()
    };
    // Empty tensors may come with a null data pointer; the core wants an aligned one.
    let ptr = if len == 0 { std::ptr::without_provenance_mut(meta.dtype.size()) } else { ptr };
    Ok(Imported { _owner: owner, ptr, len, meta, read_only })
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

fn allocate<'py>(like: &Bound<'py, PyAny>, meta: &TensorMeta) -> PyResult<Bound<'py, PyAny>> {
    let py = like.py();
    let alloc = ALLOCATOR
        .get()
        .ok_or_else(|| PyRuntimeError::new_err("uniop: no output allocator (import uniop, not uniop._native)"))?;
    alloc.bind(py).call1((like, meta.shape().to_vec(), meta.dtype.name()))
}

pub fn call(
    py: Python<'_>,
    entry: &Arc<OpEntry>,
    args: &Bound<'_, PyTuple>,
    kwargs: Option<&Bound<'_, PyDict>>,
) -> PyResult<Py<PyAny>> {
    let op = entry.name();
    let (bound, stream) = bind(entry, args, kwargs).map_err(to_py_err)?;
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

    // Tensors: in-place arguments go with the outputs, the rest are inputs (schema order).
    let mut inputs: Vec<Option<Imported>> = Vec::new();
    let mut in_place: Vec<Imported> = Vec::new();
    let mut like = None;
    for (arg, value) in entry.schema.args.iter().zip(&bound) {
        if !arg.ty.is_tensor() {
            continue;
        }
        let value = value.as_ref().filter(|v| !v.is_none());
        let Some(value) = value else {
            if arg.ty.mutated.is_some() || !arg.ty.optional {
                return Err(to_py_err(Error::arg(ErrorCode::ParamNullptr, op, &arg.name, "a tensor", "None")));
            }
            inputs.push(None);
            continue;
        };
        like.get_or_insert(value);
        let items: Vec<Bound<'_, PyAny>> = if arg.ty.base == BaseType::TensorList {
            value.try_iter()?.collect::<PyResult<_>>()?
        } else {
            vec![value.clone()]
        };
        for item in &items {
            let t = import(op, &arg.name, item).map_err(to_py_err)?;
            if arg.ty.mutated.is_some() {
                if t.read_only {
                    return Err(to_py_err(Error::arg(
                        ErrorCode::ParamInvalid,
                        op,
                        &arg.name,
                        "a writable tensor (the op updates it in place)",
                        "a read-only one",
                    )));
                }
                in_place.push(t);
            } else {
                inputs.push(Some(t));
            }
        }
    }

    // SAFETY (both views): each Imported keeps its producer's memory alive and unmoved until the
    // end of this function, after the synchronous run has finished with it.
    let input_refs: Vec<Option<TensorRef<'_>>> = inputs
        .iter()
        .map(|t| t.as_ref().map(|t| unsafe { TensorRef::from_raw(t.ptr, t.len, t.meta.clone()) }).transpose())
        .collect::<Result<_, _>>()
        .map_err(to_py_err)?;
    let expected = {
        let cx = bind_metas(entry, &inputs, &in_place, &attrs).map_err(to_py_err)?;
        entry.op.infer(&cx).map_err(to_py_err)?
    };
    let like = like.ok_or_else(|| to_py_err(Error::invalid(format!("{op}: needs at least one tensor"))))?;
    let mut returned = Vec::with_capacity(expected.len());
    let mut outputs = Vec::with_capacity(expected.len());
    for meta in &expected {
        let obj = allocate(like, meta)?;
        outputs.push(import(op, "output", &obj).map_err(to_py_err)?);
        returned.push(obj);
    }
    let output_views: Vec<TensorMut<'_>> = in_place
        .iter()
        .chain(&outputs)
        .map(|t| unsafe { TensorMut::from_raw(t.ptr, t.len, t.meta.clone()) })
        .collect::<Result<_, _>>()
        .map_err(to_py_err)?;
    let mut exec = Executor::new(entry.clone(), &input_refs, &attrs, output_views).map_err(to_py_err)?;
    let ws = Allocator::global().allocate(exec.workspace_size(), MemPolicy::HugeFirst).map_err(to_py_err)?;
    let work = Unattached((&mut exec, &ws, &stream));
    py.detach(move || {
        let (exec, ws, stream) = work.into_inner();
        // SAFETY: the workspace is exclusively ours until `run` returns (it synchronizes).
        exec.run(unsafe { ws.as_mut_slice() }, stream)
    })
    .map_err(to_py_err)?;
    drop(exec);
    match returned.len() {
        0 => Ok(py.None()),
        1 => Ok(returned.pop().expect("one return").unbind()),
        _ => Ok(PyTuple::new(py, returned)?.into_any().unbind()),
    }
}

/// Binds tensor metas (inputs in schema order; in-place arguments where the schema has them) for
/// `infer`.
fn bind_metas<'e>(
    entry: &'e OpEntry,
    inputs: &[Option<Imported>],
    in_place: &[Imported],
    attrs: &[(&str, AttrValue)],
) -> uniop::Result<OpCx<'e>> {
    let mut inputs = inputs.iter();
    let mut in_place = in_place.iter();
    let groups = entry
        .schema
        .inputs()
        .map(|arg| {
            let t = if arg.ty.mutated.is_some() { in_place.next() } else { inputs.next().and_then(Option::as_ref) };
            t.map(|t| t.meta.clone()).into_iter().collect()
        })
        .collect();
    OpCx::bind(&entry.schema, groups, attrs)
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

pub fn infer(
    py: Python<'_>,
    entry: &Arc<OpEntry>,
    args: &Bound<'_, PyTuple>,
    kwargs: Option<&Bound<'_, PyDict>>,
) -> PyResult<Py<PyAny>> {
    let op = entry.name();
    let run = || -> Result<Vec<TensorMeta>, Error> {
        let (bound, _stream) = bind(entry, args, kwargs)?;
        let attrs = attrs(entry, &bound)?;
        let mut groups = Vec::new();
        for (arg, value) in entry.schema.args.iter().zip(&bound) {
            if arg.ty.is_tensor() {
                let group = match value.as_ref().filter(|v| !v.is_none()) {
                    Some(v) => vec![meta_of(op, &arg.name, v)?],
                    None => Vec::new(),
                };
                groups.push(group);
            }
        }
        let cx = OpCx::bind(&entry.schema, groups, &attrs)?;
        entry.op.infer(&cx)
    };
    let metas = run().map_err(to_py_err)?;
    let list: Vec<(Vec<usize>, &str)> = metas.iter().map(|m| (m.shape().to_vec(), m.dtype.name())).collect();
    list.into_py_any(py)
}
