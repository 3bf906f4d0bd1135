//! The C ABI of uniop's C++ torch kernels (`python/uniop/torch/csrc/kernels.cpp`).
//!
//! A `torch.ops.uniop` call whose kernel is Python pays for the GIL, a PyObject per argument and a
//! frame before the core sees a tensor (~2.5 µs on a tiny tensor, more than the op). The C++
//! kernel instead reads the dispatcher's stack into one [`BoxedValue`] per schema argument —
//! tensors as DLPack `DLTensor` views — and calls [`call`] here with no Python involved. The same
//! plan cache and executor as `uniop.<op>` run the op.
//!
//! Outputs are torch tensors from the start: once infer knows an output's shape, [`call`] asks
//! the C++ side (an [`OutputMaker`]) for it, and torch creates it with `at::empty`'s machinery
//! over a `c10::Allocator` whose blocks come from uniop's caching allocator ([`TorchAbi::allocate`]
//! and [`TorchAbi::release`]). Handing torch a finished DLPack tensor instead cost ~2,300
//! instructions per output (the DLPack shape/strides/context allocations, then
//! `at::fromDLPackVersioned`'s deleter context) against ~1,000 this way — an eighth of a tiny
//! `torch.ops.uniop.rms_norm` call, measured with callgrind.
//!
//! The C++ module gets this table from a capsule (`_native._torch_abi()`), so neither shared
//! library links the other, and the op as a handle (`Op._torch_handle()`). Errors become the
//! usual `uniop.UniopError`, set as the calling thread's Python error for the C++ side to raise;
//! panics are caught here and never cross into C++.

use crate::call::{
    cannot_create, describe_raw, dl_dtype, negative_view, past_storage, plan_and_run, CallTensors, Imported,
    KNOWN_DTYPES,
};
use crate::to_py_err;
use dlpark::ffi::{DLDataType, DLTensor};
use pyo3::ffi::PyObject;
use pyo3::prelude::*;
use pyo3::types::{PyCapsule, PyType};
use smallvec::SmallVec;
use std::cell::Cell;
use std::ffi::{c_void, CStr};
use std::mem::ManuallyDrop;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, OnceLock};
use uniop::runtime::{Allocator, DeviceBuffer, MemPolicy};
use uniop::schema::BaseType;
use uniop::{AttrValue, DType, Error, ErrorCode, OpEntry, Stream, TensorMeta};

/// What a [`BoxedValue`] holds (its `kind`). The numbers are the ABI: keep them in step with
/// `kernels.cpp`.
pub mod kind {
    pub const NONE: u32 = 0;
    /// `tensors[0]`.
    pub const TENSOR: u32 = 1;
    /// `tensors[..len]`.
    pub const TENSOR_LIST: u32 = 2;
    pub const INT: u32 = 3;
    pub const FLOAT: u32 = 4;
    /// `int_value` is 0 or 1.
    pub const BOOL: u32 = 5;
    /// `text[..len]`, UTF-8.
    pub const STR: u32 = 6;
    /// `ints[..len]`.
    pub const INTS: u32 = 7;
    /// `dtype`; for a dtype DLPack cannot name, code 255 and the framework's name in `text[..len]`.
    pub const DTYPE: u32 = 8;
}

/// One schema argument's value, as the C++ kernel read it off the dispatcher's stack.
#[repr(C)]
pub struct BoxedValue {
    pub kind: u32,
    pub len: u64,
    pub tensors: *const DLTensor,
    pub ints: *const i64,
    pub text: *const u8,
    pub int_value: i64,
    pub float_value: f64,
    pub dtype: DLDataType,
}

/// Where [`TorchAbi::call`] gets its outputs: `make(state, index, shape, ndim, dtype)` creates
/// return `index` as a contiguous framework tensor and returns its data pointer — null when it
/// could not (the C++ side catches its exceptions; none may unwind into Rust). The tensors stay
/// the maker's: it returns them to torch once `call` succeeds and drops them when it fails.
#[repr(C)]
pub struct OutputMaker {
    pub make: unsafe extern "C" fn(
        state: *mut c_void,
        index: u64,
        shape: *const i64,
        ndim: u64,
        dtype: DLDataType,
    ) -> *mut c_void,
    pub state: *mut c_void,
}

/// The function table the capsule carries.
#[repr(C)]
pub struct TorchAbi {
    /// Bumped on any change to this table, [`BoxedValue`], [`OutputMaker`] or what the C++ module
    /// offers back (its [`TensorMaker`]); the C++ side refuses others.
    pub version: u32,
    /// Runs `op` (an `Op._torch_handle()`) on `args` (one per schema argument, schema order),
    /// writing into `num_outs` outputs (one per schema return) it gets from `outputs`; for an op
    /// returning a list (one return), into as many as the call returns, asked for in order. Returns 0,
    /// or a uniop status code with the error set as this thread's Python error (taking the GIL
    /// for that, so the caller may or may not hold it).
    pub call: unsafe extern "C" fn(
        op: *const OpEntry,
        args: *const BoxedValue,
        num_args: u64,
        outputs: *const OutputMaker,
        num_outs: u64,
    ) -> i32,
    /// A block of `bytes` from uniop's caching allocator for the C++ side's `c10::Allocator`: its
    /// address (null when out of memory), with `*context` set to what [`TorchAbi::release`]
    /// takes to give the block back.
    pub allocate: unsafe extern "C" fn(bytes: u64, context: *mut *mut c_void) -> *mut c_void,
    /// Gives back a block [`TorchAbi::allocate`] handed out (torch calls it as the deleter).
    pub release: unsafe extern "C" fn(context: *mut c_void),
}

pub const TORCH_ABI_VERSION: u32 = 5;
// The C++ side asserts the same size.
const _: () = assert!(std::mem::size_of::<BoxedValue>() == 64);
// Output shapes go to the maker as the core's usize dims.
const _: () = assert!(std::mem::size_of::<usize>() == std::mem::size_of::<i64>());

static TABLE: TorchAbi = TorchAbi { version: TORCH_ABI_VERSION, call, allocate, release };

const CAPSULE_NAME: &CStr = c"uniop._native.torch_abi";

/// The capsule handing [`TorchAbi`] to the C++ kernels.
pub fn capsule(py: Python<'_>) -> PyResult<Bound<'_, PyCapsule>> {
    let table = std::ptr::NonNull::from(&TABLE).cast::<std::ffi::c_void>();
    // SAFETY: the table is a static, valid for the life of the process.
    unsafe { PyCapsule::new_with_pointer(py, table, CAPSULE_NAME) }
}

/// How `uniop.<op>` makes outputs for a torch caller once `uniop.torch` has loaded its C++ kernels:
/// `make(shape, ndim, dtype, &mut data)` returns a new `torch.Tensor` reference over uniop's
/// allocator with `data` set to its first byte, or null (no Python error left set) when torch
/// could not. Handing torch a finished DLPack tensor instead costs twice as much per output
/// (`TensorMaker` and its deleter context), most of a tiny direct call's output cost.
type TensorMaker =
    unsafe extern "C" fn(shape: *const i64, ndim: u64, dtype: DLDataType, data: *mut *mut c_void) -> *mut PyObject;

/// How `uniop.<op>` reads a torch argument: fills `view` with the tensor's own data pointer,
/// sizes and strides (valid while the caller holds `obj`) and says what it did ([`read_status`]).
/// Anything but a plain CPU tensor of a dtype uniop knows is left to torch's DLPack exchange API,
/// whose errors name the problem. That API's pybind11 caster, GIL guard and work-stream query cost
/// ~1,100 instructions per tensor for the same view, against ~350 for the reader with its checks
/// (callgrind).
type TensorReader = unsafe extern "C" fn(obj: *mut PyObject, view: *mut DLTensor) -> i32;

/// What a [`TensorReader`] returns. The numbers are the ABI: keep them in step with `ReadStatus` in
/// `kernels.cpp`.
mod read_status {
    /// `view` is filled.
    pub const READ: i32 = 1;
    /// A negative view (`_neg_view()`): its values are the negation of its memory's, which DLPack
    /// cannot express and torch's exchange API hands over as plain memory.
    pub const NEGATIVE_VIEW: i32 = -1;
    /// The view reaches past the end of its storage (resized smaller under it).
    pub const PAST_STORAGE: i32 = -2;
}

/// What the `uniop.torch.tensor_io.v1` capsule points at (`kTensorIo` in kernels.cpp).
#[repr(C)]
struct TensorIo {
    make: TensorMaker,
    read: TensorReader,
}

/// The capsule name says the layout: another version is refused rather than called.
const TENSOR_IO_NAME: &CStr = c"uniop.torch.tensor_io.v1";

/// The tensor type the functions are for, and the functions. Set once (`uniop.torch` imports once).
static TENSOR_IO: OnceLock<(Py<PyType>, &'static TensorIo)> = OnceLock::new();

/// Makes `uniop.<op>` read arguments and create outputs of `tensor_type` (or a subclass) with the
/// functions in `capsule` (`uniop.torch._kernels.tensor_io()`).
pub fn use_tensor_io(tensor_type: Bound<'_, PyType>, capsule: &Bound<'_, PyCapsule>) -> PyResult<()> {
    let io = capsule.pointer_checked(Some(TENSOR_IO_NAME))?;
    // SAFETY: a capsule with this name points at a `TensorIo` static of the C++ module, which is
    // never unloaded.
    let io = unsafe { io.cast::<TensorIo>().as_ref() };
    let _ = TENSOR_IO.set((tensor_type.unbind(), io));
    Ok(())
}

/// The C++ side's functions when `obj` is a tensor of their type.
fn tensor_io_for(obj: &Bound<'_, PyAny>) -> Option<&'static TensorIo> {
    let (tensor_type, io) = TENSOR_IO.get()?;
    // SAFETY: both are type objects; PyType_IsSubtype reads their MROs (no Python code runs).
    let is_tensor = unsafe { pyo3::ffi::PyType_IsSubtype(obj.get_type_ptr(), tensor_type.as_ptr().cast()) } != 0;
    is_tensor.then_some(*io)
}

/// Argument `arg` read by the C++ side's reader: `None` when no reader is set or it does not take
/// `obj` (the caller reads it another way).
pub(crate) fn read_torch_input(op: &str, arg: &str, obj: &Bound<'_, PyAny>) -> Option<Result<Imported, Error>> {
    let io = tensor_io_for(obj)?;
    let mut view = std::mem::MaybeUninit::<DLTensor>::uninit();
    // SAFETY: `obj` is a live object and `view` room for one DLTensor; this thread holds the GIL.
    match unsafe { (io.read)(obj.as_ptr(), view.as_mut_ptr()) } {
        read_status::READ => {}
        read_status::NEGATIVE_VIEW => return Some(Err(negative_view(op, arg))),
        read_status::PAST_STORAGE => {
            let given = "a view reaching past the end of its storage".to_string();
            return Some(Err(past_storage(op, arg, given)));
        }
        _ => return None,
    }
    // SAFETY: a reader returning READ filled `view` (`dl_view`); its pointers are the tensor's, which
    // the caller holds for the whole call.
    Some(unsafe { describe_raw(op, arg, &view.assume_init()) })
}

/// An output for `like` from the C++ side's maker: `None` when no maker is set or `like` is not a
/// tensor of its type (the caller makes the output another way).
pub(crate) fn make_torch_output<'py>(
    op: &str,
    like: &Bound<'py, PyAny>,
    meta: &TensorMeta,
) -> Option<PyResult<(Bound<'py, PyAny>, Imported)>> {
    let make = tensor_io_for(like)?.make;
    let py = like.py();
    let shape = meta.shape();
    let mut data = std::ptr::null_mut();
    // SAFETY: `shape` outlives the call (usize and i64 have one size: asserted at the top); this
    // thread holds the GIL, as the maker requires.
    let obj = unsafe { make(shape.as_ptr().cast(), shape.len() as u64, dl_dtype(meta.dtype), &mut data) };
    // SAFETY: a non-null result is a new reference.
    let Some(obj) = (unsafe { Bound::from_owned_ptr_or_opt(py, obj) }) else {
        return Some(Err(to_py_err(torch_could_not_create(op, "an output", meta))));
    };
    Some(Imported::output(op, meta, data.cast()).map(|view| (obj, view)).map_err(to_py_err))
}

/// A handle for `entry` valid for the life of the process (ops are never unregistered; the leaked
/// count keeps it so even then).
pub fn handle(entry: &Arc<OpEntry>) -> usize {
    Arc::into_raw(entry.clone()) as usize
}

unsafe extern "C" fn call(
    op: *const OpEntry,
    args: *const BoxedValue,
    num_args: u64,
    outputs: *const OutputMaker,
    num_outs: u64,
) -> i32 {
    let result = catch_unwind(AssertUnwindSafe(|| {
        if op.is_null() || (args.is_null() && num_args > 0) || outputs.is_null() {
            return Err(to_py_err(Error::new(ErrorCode::ParamNullptr, "uniop torch kernel: a null pointer")));
        }
        // SAFETY: `op` comes from `handle`: an Arc leaked for the process, borrowed here without
        // touching its count. `args` points at `num_args` values and `outputs` at a maker, as the
        // ABI requires of the caller.
        let entry = ManuallyDrop::new(unsafe { Arc::from_raw(op) });
        let args = unsafe { slice(args, num_args) };
        run(&entry, args, unsafe { &*outputs }, num_outs)
    }));
    match result {
        Ok(Ok(())) => 0,
        Ok(Err(err)) => restore(err),
        Err(_) => restore(to_py_err(Error::internal("uniop torch kernel: a panic in the core"))),
    }
}

/// Sets `err` as this thread's Python error; returns its status code.
fn restore(err: PyErr) -> i32 {
    Python::attach(|py| {
        let code = err.value(py).getattr("code").and_then(|c| c.extract::<i32>()).unwrap_or(1);
        err.restore(py);
        code
    })
}

/// `len` items at `ptr` (which may be null or dangling when `len` is 0).
///
/// # Safety
/// A non-empty `ptr` must point at `len` initialized items that outlive the returned slice.
unsafe fn slice<'a, T>(ptr: *const T, len: u64) -> &'a [T] {
    if len == 0 {
        &[]
    } else {
        // SAFETY: the caller's promise.
        unsafe { std::slice::from_raw_parts(ptr, len as usize) }
    }
}

fn run(entry: &Arc<OpEntry>, args: &[BoxedValue], outputs: &OutputMaker, num_outs: u64) -> PyResult<()> {
    let op = entry.name();
    let schema = &entry.schema;
    if args.len() != schema.args.len() || num_outs != schema.returns.len() as u64 {
        return Err(to_py_err(Error::invalid(format!(
            "{op}: the torch kernel passed {} arguments and room for {num_outs} returns; the schema has {} and {}",
            args.len(),
            schema.args.len(),
            schema.returns.len()
        ))));
    }
    let mut tensors = CallTensors::default();
    let mut attrs: SmallVec<[(&str, AttrValue); 4]> = SmallVec::new();
    for (arg, value) in schema.args.iter().zip(args) {
        if !arg.ty.is_tensor() {
            attrs.push((arg.name.as_str(), attr(op, &arg.name, value).map_err(to_py_err)?));
            continue;
        }
        // SAFETY (both): the kind says how many tensors `tensors` points at.
        let items = match value.kind {
            kind::NONE => {
                tensors.absent(op, arg).map_err(to_py_err)?;
                continue;
            }
            kind::TENSOR => unsafe { slice(value.tensors, 1) },
            kind::TENSOR_LIST if arg.ty.base == BaseType::TensorList => unsafe { slice(value.tensors, value.len) },
            other => return Err(to_py_err(wrong_kind(op, &arg.name, other))),
        };
        for t in items {
            // SAFETY: the ABI's contract: the caller's views describe tensors it holds for the whole call.
            let imported = unsafe { describe_raw(op, &arg.name, t) }.map_err(to_py_err)?;
            tensors.push(op, arg, imported).map_err(to_py_err)?;
        }
    }
    // The maker takes any number of outputs for a list return (one room, as many items as the call
    // returns), else one per return.
    let mut index = 0;
    let in_place = schema.mutated().count();
    let made = plan_and_run(None, entry, &tensors, &attrs, Stream::default_stream(), |meta| {
        let output = make_output(entry, in_place + index, outputs, index, meta);
        index += 1;
        output.map(|view| ((), view)).map_err(to_py_err)
    })?;
    if !schema.returns_list() && made.len() != schema.returns.len() {
        return Err(to_py_err(Error::internal(format!(
            "{op}: infer gave {} outputs for {} schema returns",
            made.len(),
            schema.returns.len()
        ))));
    }
    Ok(())
}

/// Output `index` (written tensor `written` of `entry`'s schema, named in errors only: no string is
/// made per call) from the C++ side's maker, as the view the run writes through.
fn make_output(
    entry: &OpEntry,
    written: usize,
    outputs: &OutputMaker,
    index: usize,
    meta: &TensorMeta,
) -> Result<Imported, Error> {
    // The dims as they are: usize and i64 have one size here (asserted at the top), and a dim above
    // i64::MAX, read as negative, is refused by torch (a null from the maker) rather than wrapped.
    let shape = meta.shape();
    let dtype = dl_dtype(meta.dtype);
    // SAFETY: `shape` outlives the call; the maker is the C++ kernel's, valid for this call.
    let data = unsafe { (outputs.make)(outputs.state, index as u64, shape.as_ptr().cast(), shape.len() as u64, dtype) };
    if data.is_null() && meta.numel() > 0 {
        let name = entry.schema.output_name(written);
        return Err(torch_could_not_create(entry.name(), &format!("return '{name}'"), meta));
    }
    Imported::output(entry.name(), meta, data.cast())
}

thread_local! {
    /// Why uniop's allocator last refused torch a block on this thread, and the bytes asked. Torch
    /// turns the null into its own exception, which the C++ maker swallows (none may unwind into
    /// Rust), so the output's error takes the reason from here: how much was asked, what the OS
    /// said, what uniop holds.
    static REFUSAL: Cell<Option<(u64, Error)>> = const { Cell::new(None) };
}

/// The error for an output torch could not create, with the allocator's reason when it refused a
/// block of the output's size. (A refusal of another size is stale: a `resize_` of an earlier
/// output, say, whose error torch raised itself.)
fn torch_could_not_create(op: &str, what: &str, meta: &TensorMeta) -> Error {
    let err = cannot_create(op, "torch", what, meta);
    match REFUSAL.take() {
        Some((bytes, refusal)) if meta.contiguous_bytes().is_ok_and(|b| b as u64 == bytes) => {
            err.because(refusal.message())
        }
        _ => err,
    }
}

unsafe extern "C" fn allocate(bytes: u64, context: *mut *mut c_void) -> *mut c_void {
    // u64 and usize have one size here (asserted at the top).
    let block = catch_unwind(|| Allocator::global().allocate(bytes as usize, MemPolicy::HugeFirst));
    match (block, context.is_null()) {
        (Ok(Ok(block)), false) => {
            let data = block.as_ptr();
            // SAFETY: the caller passes a writable slot for the context.
            unsafe { *context = Box::into_raw(Box::new(block)).cast() };
            data.cast()
        }
        (Ok(Err(refusal)), _) => {
            REFUSAL.set(Some((bytes, refusal)));
            std::ptr::null_mut()
        }
        _ => std::ptr::null_mut(),
    }
}

unsafe extern "C" fn release(context: *mut c_void) {
    if context.is_null() {
        return;
    }
    // SAFETY: `context` is a Box<DeviceBuffer> `allocate` leaked, released once (torch's deleter).
    let block = unsafe { Box::from_raw(context.cast::<DeviceBuffer>()) };
    // No panic may unwind into torch's deleter; should dropping the block panic, it is leaked.
    let _ = catch_unwind(AssertUnwindSafe(move || drop(block)));
}

fn wrong_kind(op: &str, arg: &str, kind: u32) -> Error {
    Error::arg(ErrorCode::ParamInvalid, op, arg, "a value of its schema type", format!("boxed value kind {kind}"))
}

/// An attribute's value. Whether it fits the schema type is the core's check, as for every route.
fn attr(op: &str, arg: &str, v: &BoxedValue) -> Result<AttrValue, Error> {
    Ok(match v.kind {
        kind::NONE => AttrValue::None,
        kind::INT => AttrValue::Int(v.int_value),
        kind::FLOAT => AttrValue::Float(v.float_value),
        kind::BOOL => AttrValue::Bool(v.int_value != 0),
        kind::STR => {
            // SAFETY: `text[..len]` is the string the C++ kernel holds for the call.
            let bytes = unsafe { slice(v.text, v.len) };
            let text = std::str::from_utf8(bytes)
                .map_err(|_| Error::arg(ErrorCode::ParamInvalid, op, arg, "a UTF-8 string", "invalid UTF-8"))?;
            AttrValue::Str(text.to_string())
        }
        // SAFETY: `ints[..len]` is the list the C++ kernel holds for the call.
        kind::INTS => AttrValue::Ints(unsafe { slice(v.ints, v.len) }.to_vec()),
        kind::DTYPE => {
            AttrValue::DType(DType::from_dlpack(v.dtype.code.0, v.dtype.bits).map_err(|_| {
                // A dtype DLPack cannot name comes with the framework's name for it instead.
                // SAFETY: `text[..len]` is the name the C++ kernel holds for the call.
                let name = String::from_utf8_lossy(unsafe { slice(v.text, v.len) }).into_owned();
                Error::arg(
                    ErrorCode::DType,
                    op,
                    arg,
                    KNOWN_DTYPES,
                    if name.is_empty() {
                        format!("DLPack type code {} with {} bits", v.dtype.code.0, v.dtype.bits)
                    } else {
                        name
                    },
                )
            })?)
        }
        other => return Err(wrong_kind(op, arg, other)),
    })
}
