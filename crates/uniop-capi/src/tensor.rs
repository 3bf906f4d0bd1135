//! Tensor descriptors (aclnn's `aclCreateTensor`) and the generic two-phase call by op name, with
//! its executors. Attributes travel as one `"name=value, ..."` string, parsed against the schema.
//!
//! A descriptor only describes memory the caller owns; nothing is copied. The executor keeps the
//! addresses it was planned with, so tensors and workspace must stay valid until the launch has
//! run on its stream — the aclnn contract.

use crate::handles;
use crate::runtime::{stream_of, uniopStream};
use crate::{guard, non_null, uniopStatus};
use std::ffi::{c_char, c_void, CStr};
use std::fmt::Display;
use uniop::{AttrValue, DType, Error, ErrorCode, Executor, Layout, Registry, Result, TensorMeta, TensorMut, TensorRef};

/// Element types, numbered like `aclDataType`.
pub type uniopDataType = i32;
pub const UNIOP_FLOAT: uniopDataType = 0;
pub const UNIOP_FLOAT16: uniopDataType = 1;
pub const UNIOP_INT8: uniopDataType = 2;
pub const UNIOP_INT32: uniopDataType = 3;
pub const UNIOP_UINT8: uniopDataType = 4;
pub const UNIOP_INT64: uniopDataType = 9;
pub const UNIOP_DOUBLE: uniopDataType = 11;
pub const UNIOP_BOOL: uniopDataType = 12;
pub const UNIOP_BF16: uniopDataType = 27;

/// Memory formats, numbered like `aclFormat`; uniop tensors are plain strided (`ND`) arrays.
pub type uniopFormat = i32;
pub const UNIOP_FORMAT_ND: uniopFormat = 2;

/// A strided view of caller-owned memory (opaque).
pub struct uniopTensor {
    meta: TensorMeta,
    data: *mut u8,
    /// Bytes of the storage the view lives in.
    bytes: usize,
}

/// A planned op call: phase 1's result, launched by phase 2 (opaque).
pub struct uniopExecutor {
    exec: Executor<'static>,
}

/// Each `UNIOP_*` data type with the dtype it names: the one table both directions read.
pub(crate) const DTYPE_CODES: [(uniopDataType, DType); 9] = [
    (UNIOP_FLOAT, DType::F32),
    (UNIOP_FLOAT16, DType::F16),
    (UNIOP_BF16, DType::BF16),
    (UNIOP_DOUBLE, DType::F64),
    (UNIOP_INT8, DType::I8),
    (UNIOP_INT32, DType::I32),
    (UNIOP_INT64, DType::I64),
    (UNIOP_UINT8, DType::U8),
    (UNIOP_BOOL, DType::Bool),
];

pub(crate) fn dtype_of(code: uniopDataType, func: &str, arg: &str) -> Result<DType> {
    match DTYPE_CODES.iter().find(|(c, _)| *c == code) {
        Some(&(_, dtype)) => Ok(dtype),
        None => Err(Error::arg(
            ErrorCode::DType,
            func,
            arg,
            "a UNIOP_* data type (FLOAT, FLOAT16, BF16, DOUBLE, INT8, INT32, INT64, UINT8, BOOL)",
            code,
        )),
    }
}

/// `n` non-negative int64 values at `ptr` as sizes (`arg` names them in errors).
unsafe fn sizes(ptr: *const i64, n: u64, func: &str, arg: &str) -> Result<Vec<usize>> {
    if n == 0 {
        return Ok(Vec::new());
    }
    non_null(ptr, func, arg)?;
    let values = std::slice::from_raw_parts(ptr, n as usize);
    values
        .iter()
        .map(|&v| {
            usize::try_from(v).map_err(|_| {
                Error::arg(ErrorCode::ParamInvalid, func, arg, "non-negative values", format!("{values:?}"))
            })
        })
        .collect()
}

/// Describes `tensorData` as a strided view (`stride` may be NULL for contiguous), `offset`
/// elements into a storage of `storageDims`. Returns NULL on bad arguments (see
/// `uniopGetRecentErrMsg`).
#[no_mangle]
pub extern "C" fn uniopCreateTensor(
    viewDims: *const i64,
    viewDimsNum: u64,
    dataType: uniopDataType,
    stride: *const i64,
    offset: i64,
    format: uniopFormat,
    storageDims: *const i64,
    storageDimsNum: u64,
    tensorData: *mut c_void,
) -> *mut uniopTensor {
    let mut out = std::ptr::null_mut();
    guard(|| {
        const F: &str = "uniopCreateTensor";
        let dtype = dtype_of(dataType, F, "dataType")?;
        if format != UNIOP_FORMAT_ND {
            return Err(Error::arg(ErrorCode::ParamInvalid, F, "format", "UNIOP_FORMAT_ND (2)", format));
        }
        let shape = unsafe { sizes(viewDims, viewDimsNum, F, "viewDims")? };
        let strides = if stride.is_null() {
            uniop::layout::contiguous_strides(&shape)?
        } else {
            unsafe { sizes(stride, viewDimsNum, F, "stride")? }
        };
        let offset = usize::try_from(offset)
            .map_err(|_| Error::arg(ErrorCode::ParamInvalid, F, "offset", "a non-negative offset", offset))?;
        let storage = unsafe { sizes(storageDims, storageDimsNum, F, "storageDims")? };
        let storage_elems = storage.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d)).ok_or_else(|| {
            Error::arg(ErrorCode::Shape, F, "storageDims", "a size that fits in memory", "an overflow")
        })?;
        let layout = Layout::strided(&shape, &strides, offset).map_err(|e| e.context(F))?;
        let extent = layout.storage_extent().map_err(|e| e.context(F))?;
        if layout.numel() > 0 && extent > storage_elems {
            return Err(Error::arg(
                ErrorCode::Shape,
                F,
                "storageDims",
                format!("storage of at least {extent} elements (offset {offset} plus the view's extent)"),
                format!("{storage_elems} elements"),
            ));
        }
        let bytes = storage_elems.checked_mul(dtype.size()).ok_or_else(|| {
            Error::arg(ErrorCode::Shape, F, "storageDims", "a size that fits in memory", "an overflow")
        })?;
        out = handles::register(uniopTensor { meta: TensorMeta { dtype, layout }, data: tensorData as *mut u8, bytes });
        Ok(())
    });
    out
}

#[no_mangle]
pub extern "C" fn uniopDestroyTensor(tensor: *const uniopTensor) -> uniopStatus {
    guard(|| handles::release(tensor as *mut uniopTensor, "uniopDestroyTensor", "tensor", "uniopTensor").map(drop))
}

/// A number passed by value of any dtype (aclnn's `aclScalar`), for `Scalar` arguments such as
/// `add`'s alpha (opaque). Integers stay exact.
pub struct uniopScalar {
    value: AttrValue,
}

/// Reads one value of `dataType` at `value` (FLOAT, FLOAT16, BF16, DOUBLE, INT8, INT32, INT64,
/// UINT8 or BOOL) into a scalar. Returns NULL on bad arguments (see `uniopGetRecentErrMsg`).
#[no_mangle]
pub extern "C" fn uniopCreateScalar(value: *const c_void, dataType: uniopDataType) -> *mut uniopScalar {
    let mut out = std::ptr::null_mut();
    guard(|| {
        const F: &str = "uniopCreateScalar";
        let dtype = dtype_of(dataType, F, "dataType")?;
        non_null(value, F, "value")?;
        // SAFETY: the caller points `value` at one element of `dataType` (read unaligned: C may
        // pass any address).
        let value = unsafe {
            let p = value as *const u8;
            match dtype {
                DType::F32 => AttrValue::Float(f64::from((p as *const f32).read_unaligned())),
                DType::F64 => AttrValue::Float((p as *const f64).read_unaligned()),
                DType::F16 => AttrValue::Float((p as *const uniop::half::f16).read_unaligned().to_f64()),
                DType::BF16 => AttrValue::Float((p as *const uniop::half::bf16).read_unaligned().to_f64()),
                DType::I8 => AttrValue::Int(i64::from((p as *const i8).read_unaligned())),
                DType::I32 => AttrValue::Int(i64::from((p as *const i32).read_unaligned())),
                DType::I64 => AttrValue::Int((p as *const i64).read_unaligned()),
                DType::U8 => AttrValue::Int(i64::from(p.read_unaligned())),
                DType::Bool => AttrValue::Bool(p.read_unaligned() != 0),
            }
        };
        out = handles::register(uniopScalar { value });
        Ok(())
    });
    out
}

#[no_mangle]
pub extern "C" fn uniopDestroyScalar(scalar: *const uniopScalar) -> uniopStatus {
    guard(|| handles::release(scalar as *mut uniopScalar, "uniopDestroyScalar", "scalar", "uniopScalar").map(drop))
}

/// The value of a `Scalar` argument.
pub(crate) fn scalar_value(func: &str, arg: &str, scalar: *const uniopScalar) -> Result<AttrValue> {
    Ok(unsafe { handles::get(scalar, func, arg, "uniopScalar")? }.value.clone())
}

/// Integers passed as one argument (aclnn's `aclIntArray`), for `int[]` arguments such as
/// `permute`'s dims (opaque). The values are copied.
pub struct uniopIntArray {
    values: Vec<i64>,
}

/// Copies `size` integers from `value` (NULL allowed when `size` is 0). Returns NULL on bad
/// arguments (see `uniopGetRecentErrMsg`).
#[no_mangle]
pub extern "C" fn uniopCreateIntArray(value: *const i64, size: u64) -> *mut uniopIntArray {
    let mut out = std::ptr::null_mut();
    guard(|| {
        let values = if size == 0 {
            Vec::new()
        } else {
            non_null(value, "uniopCreateIntArray", "value")?;
            // SAFETY: the caller passes `size` readable integers.
            unsafe { std::slice::from_raw_parts(value, size as usize) }.to_vec()
        };
        out = handles::register(uniopIntArray { values });
        Ok(())
    });
    out
}

#[no_mangle]
pub extern "C" fn uniopDestroyIntArray(array: *const uniopIntArray) -> uniopStatus {
    guard(|| handles::release(array as *mut uniopIntArray, "uniopDestroyIntArray", "array", "uniopIntArray").map(drop))
}

/// The values of an `int[]` argument.
pub(crate) fn int_array_value(func: &str, arg: &str, array: *const uniopIntArray) -> Result<AttrValue> {
    Ok(AttrValue::Ints(unsafe { handles::get(array, func, arg, "uniopIntArray")? }.values.clone()))
}

/// Tensors passed as one argument (aclnn's `aclTensorList`), e.g. `cat`'s inputs (opaque).
/// Like aclnn, the list owns its tensors: destroying it destroys them.
pub struct uniopTensorList {
    tensors: Vec<*const uniopTensor>,
}

/// Groups `size` tensor descriptors (each live; the same one may repeat) into a list that takes
/// them over. Returns NULL on bad arguments (see `uniopGetRecentErrMsg`).
#[no_mangle]
pub extern "C" fn uniopCreateTensorList(value: *const *const uniopTensor, size: u64) -> *mut uniopTensorList {
    let mut out = std::ptr::null_mut();
    guard(|| {
        const F: &str = "uniopCreateTensorList";
        let tensors = unsafe { handle_array(value, size, F, "value")? };
        for (i, t) in tensors.iter().enumerate() {
            unsafe { handles::get(*t, F, TensorName::Item("value", i), "uniopTensor")? };
        }
        out = handles::register(uniopTensorList { tensors });
        Ok(())
    });
    out
}

/// Destroys the list and the tensors in it (each once).
#[no_mangle]
pub extern "C" fn uniopDestroyTensorList(list: *const uniopTensorList) -> uniopStatus {
    guard(|| {
        const F: &str = "uniopDestroyTensorList";
        let mut list = handles::release(list as *mut uniopTensorList, F, "list", "uniopTensorList")?;
        list.tensors.sort_unstable();
        list.tensors.dedup();
        // Release every tensor still alive, then report the first that was not.
        let released: Vec<_> = list
            .tensors
            .iter()
            .enumerate()
            .map(|(i, &t)| handles::release(t as *mut uniopTensor, F, TensorName::Item("list", i), "uniopTensor"))
            .collect();
        released.into_iter().try_for_each(|r| r.map(drop))
    })
}

/// The tensors of a list argument, each named `arg[i]` in errors.
pub(crate) fn list_items(
    func: &str,
    arg: &'static str,
    list: *const uniopTensorList,
) -> Result<Vec<(TensorName, *const uniopTensor)>> {
    let list = unsafe { handles::get(list, func, arg, "uniopTensorList")? };
    Ok(list.tensors.iter().enumerate().map(|(i, &t)| (TensorName::Item(arg, i), t)).collect())
}

unsafe fn handle_array<T>(ptr: *const *const T, n: u64, func: &str, arg: &str) -> Result<Vec<*const T>> {
    if n == 0 {
        return Ok(Vec::new());
    }
    non_null(ptr, func, arg)?;
    Ok(std::slice::from_raw_parts(ptr, n as usize).to_vec())
}

/// The descriptor behind `t`, checked to have data.
unsafe fn bound<'a>(t: *const uniopTensor, func: &str, arg: impl Display) -> Result<&'a uniopTensor> {
    let d = handles::get(t, func, &arg, "uniopTensor")?;
    if d.data.is_null() && d.bytes > 0 {
        return Err(Error::arg(
            ErrorCode::ParamNullptr,
            func,
            &arg.to_string(),
            "a tensor with data",
            "a descriptor whose data is NULL",
        ));
    }
    Ok(d)
}

unsafe fn view(d: &uniopTensor, func: &str, arg: impl Display) -> Result<TensorRef<'static>> {
    TensorRef::from_raw(d.data, d.bytes, d.meta.clone()).map_err(|e| e.context(format!("{func}: {arg}")))
}

unsafe fn view_mut(d: &uniopTensor, func: &str, arg: impl Display) -> Result<TensorMut<'static>> {
    TensorMut::from_raw(d.data, d.bytes, d.meta.clone()).map_err(|e| e.context(format!("{func}: {arg}")))
}

/// Phase 1 shared by the by-name call and the generated per-op calls: `inputs` are the tensors
/// the op reads (NULL: an absent optional), `outputs` its in-place tensors then its returns, each
/// with the name errors should use.
pub(crate) fn plan<I: Display, O: Display>(
    op: &str,
    func: &str,
    inputs: &[(I, *const uniopTensor)],
    attrs: &[(&str, AttrValue)],
    outputs: &[(O, *const uniopTensor)],
    workspaceSize: *mut u64,
    executor: *mut *mut uniopExecutor,
) -> Result<()> {
    non_null(workspaceSize, func, "workspaceSize")?;
    non_null(executor, func, "executor")?;
    let mut in_views = Vec::with_capacity(inputs.len());
    for (arg, t) in inputs {
        in_views.push(if t.is_null() { None } else { Some(unsafe { view(bound(*t, func, arg)?, func, arg)? }) });
    }
    let mut out_views = Vec::with_capacity(outputs.len());
    for (arg, t) in outputs {
        out_views.push(unsafe { view_mut(bound(*t, func, arg)?, func, arg)? });
    }
    uniop_ops::init();
    let entry = Registry::global().get(op)?;
    let exec = Executor::new(entry, &in_views, attrs, out_views)?;
    // SAFETY: checked non-null.
    unsafe {
        *workspaceSize = exec.workspace_size() as u64;
        *executor = handles::register(uniopExecutor { exec });
    }
    Ok(())
}

/// Phase 1 by op name: binds `inputs` (the tensors the op reads, schema order; NULL for an
/// absent optional), `attrs` (`"name=value, ..."`, may be NULL) and `outputs` (tensors the op
/// updates in place, then its returns, each in memory of its own), checks them, plans, and
/// returns the workspace size and a single-use executor.
#[no_mangle]
pub extern "C" fn uniopOpGetWorkspaceSize(
    opName: *const c_char,
    inputs: *const *const uniopTensor,
    numInputs: u64,
    attrs: *const c_char,
    outputs: *const *const uniopTensor,
    numOutputs: u64,
    workspaceSize: *mut u64,
    executor: *mut *mut uniopExecutor,
) -> uniopStatus {
    guard(|| {
        const F: &str = "uniopOpGetWorkspaceSize";
        let op = text(opName, F, "opName")?;
        let attrs = if attrs.is_null() {
            Vec::new()
        } else {
            AttrValue::parse_assignments(text(attrs, F, "attrs")?).map_err(|e| e.context(op))?
        };
        let attr_refs: Vec<(&str, AttrValue)> = attrs.iter().map(|(k, v)| (k.as_str(), v.clone())).collect();
        let (ins, outs) = unsafe {
            (handle_array(inputs, numInputs, F, "inputs")?, handle_array(outputs, numOutputs, F, "outputs")?)
        };
        let ins: Vec<_> = ins.into_iter().enumerate().map(|(i, t)| (TensorName::Item("inputs", i), t)).collect();
        let outs: Vec<_> = outs.into_iter().enumerate().map(|(i, t)| (TensorName::Item("outputs", i), t)).collect();
        plan(op, F, &ins, &attr_refs, &outs, workspaceSize, executor)
    })
}

/// A tensor's name in error messages, formatted only when needed: an argument (`dout`), or an item
/// of a list argument (`tensors[2]`).
#[derive(Clone, Copy)]
pub(crate) enum TensorName {
    Arg(&'static str),
    Item(&'static str, usize),
}

impl Display for TensorName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TensorName::Arg(name) => f.write_str(name),
            TensorName::Item(list, i) => write!(f, "{list}[{i}]"),
        }
    }
}

/// NUL-terminated UTF-8 text from C.
pub(crate) fn text<'a>(ptr: *const c_char, func: &str, arg: &str) -> Result<&'a str> {
    non_null(ptr, func, arg)?;
    unsafe { CStr::from_ptr(ptr) }
        .to_str()
        .map_err(|_| Error::arg(ErrorCode::ParamInvalid, func, arg, "UTF-8 text", "invalid UTF-8"))
}

/// Phase 2: launches the executor on `stream` (NULL: default) with `workspace`. A single-use
/// executor is consumed by a successful launch; a repeatable one stays until destroyed.
#[no_mangle]
pub extern "C" fn uniopOpRun(
    workspace: *mut c_void,
    workspaceSize: u64,
    executor: *mut uniopExecutor,
    stream: uniopStream,
) -> uniopStatus {
    guard(|| {
        const F: &str = "uniopOpRun";
        let e = unsafe { handles::get_mut(executor, F, "executor", "uniopExecutor")? };
        let s = unsafe { stream_of(stream, F)? };
        // SAFETY: the C contract: tensors and workspace stay valid until the stream has run this.
        unsafe { e.exec.launch(workspace as *mut u8, workspaceSize as usize, s)? };
        if !e.exec.is_repeatable() {
            handles::release(executor, F, "executor", "uniopExecutor")?;
        }
        Ok(())
    })
}

/// Lets the executor launch any number of times (aclnn's `aclSetAclOpExecutorRepeatable`).
#[no_mangle]
pub extern "C" fn uniopSetExecutorRepeatable(executor: *mut uniopExecutor) -> uniopStatus {
    guard(|| {
        unsafe { handles::get_mut(executor, "uniopSetExecutorRepeatable", "executor", "uniopExecutor")? }
            .exec
            .set_repeatable();
        Ok(())
    })
}

#[no_mangle]
pub extern "C" fn uniopDestroyExecutor(executor: *mut uniopExecutor) -> uniopStatus {
    guard(|| handles::release(executor, "uniopDestroyExecutor", "executor", "uniopExecutor").map(drop))
}

/// Points input `index` of a repeatable executor at new memory laid out like the planned one.
#[no_mangle]
pub extern "C" fn uniopSetInputTensorAddr(executor: *mut uniopExecutor, index: u64, addr: *mut c_void) -> uniopStatus {
    guard(|| rebind(executor, index, addr, false))
}

/// Points output `index` (in-place tensors first, then returns) at new memory.
#[no_mangle]
pub extern "C" fn uniopSetOutputTensorAddr(executor: *mut uniopExecutor, index: u64, addr: *mut c_void) -> uniopStatus {
    guard(|| rebind(executor, index, addr, true))
}

fn rebind(executor: *mut uniopExecutor, index: u64, addr: *mut c_void, output: bool) -> Result<()> {
    let func = if output { "uniopSetOutputTensorAddr" } else { "uniopSetInputTensorAddr" };
    let e = unsafe { handles::get_mut(executor, func, "executor", "uniopExecutor")? };
    non_null(addr, func, "addr")?;
    let i = index as usize;
    let planned = if output { e.exec.output_meta(i) } else { e.exec.input_meta(i) };
    let meta = planned.cloned().ok_or_else(|| {
        Error::arg(ErrorCode::ParamInvalid, func, "index", "the index of a bound tensor of this executor", index)
    })?;
    let bytes = meta.layout.storage_extent()? * meta.dtype.size();
    // SAFETY: the caller provides memory laid out like the planned tensor.
    unsafe {
        if output {
            e.exec.rebind_output(i, TensorMut::from_raw(addr as *mut u8, bytes, meta)?)
        } else {
            e.exec.rebind_input(i, TensorRef::from_raw(addr as *const u8, bytes, meta)?)
        }
    }
}
