//! NumPy arrays read and created through NumPy's C API instead of DLPack capsules.
//!
//! DLPack is the contract (any `__dlpack__` object works), but for NumPy it is the slow road: each
//! input costs a `__dlpack__` call with keyword arguments and a capsule, and each output a trip
//! through the Python allocator (`np.empty`) and another capsule. On a tiny array that was half of
//! a call. An ndarray's header already says everything a DLPack descriptor would — data pointer,
//! dims, byte strides, dtype, writeable flag — so it is read directly, and outputs are made with
//! `PyArray_Empty`.
//!
//! Only what maps one-to-one is taken here; anything else (byte-swapped or unaligned arrays,
//! negative strides, dtypes uniop lacks) returns `None` and takes the DLPack route, which
//! explains what is wrong with it. So the two routes never disagree on what they accept.

use numpy::npyffi::{self, npy_intp, NPY_ARRAY_WRITEABLE, PY_ARRAY_API};
use numpy::{PyArrayDescr, PyArrayDescrMethods, PyUntypedArray, PyUntypedArrayMethods};
use pyo3::prelude::*;
use smallvec::SmallVec;
use uniop::{DType, TensorMeta};

/// Whether `obj` is an ndarray (or a subclass). NumPy is only asked once it has been imported by
/// someone: an object cannot be an array before that, and asking would import it (or fail where
/// it is not installed).
pub fn is_array(obj: &Bound<'_, PyAny>) -> bool {
    let py = obj.py();
    let numpy_loaded = py
        .import(pyo3::intern!(py, "sys"))
        .and_then(|sys| sys.getattr(pyo3::intern!(py, "modules")))
        .and_then(|modules| modules.contains(pyo3::intern!(py, "numpy")))
        .unwrap_or(false);
    numpy_loaded && obj.is_instance_of::<PyUntypedArray>()
}

/// The dtype, dims (shape, then strides in elements), first element and read-only flag of an
/// ndarray, or `None` when it needs the DLPack route. The caller keeps `array` alive while it
/// uses the pointer.
pub fn describe(array: &Bound<'_, PyAny>) -> Option<(DType, SmallVec<[usize; 8]>, *mut u8, bool)> {
    // SAFETY: callers pass objects `is_array` accepted (their type was checked once per type).
    let array = unsafe { array.cast_unchecked::<PyUntypedArray>() };
    let descr = array.dtype();
    if descr.is_native_byteorder() == Some(false) {
        return None;
    }
    let dtype = match (descr.kind(), descr.itemsize()) {
        (b'f', 4) => DType::F32,
        (b'f', 2) => DType::F16,
        (b'f', 8) => DType::F64,
        (b'i', 1) => DType::I8,
        (b'i', 4) => DType::I32,
        (b'i', 8) => DType::I64,
        (b'u', 1) => DType::U8,
        (b'b', 1) => DType::Bool,
        _ => return None,
    };
    let size = dtype.size() as isize;
    let shape = array.shape();
    let strides = array.strides().iter().map(|&s| (s >= 0 && s % size == 0).then_some((s / size) as usize));
    let dims = shape.iter().map(|&d| Some(d)).chain(strides).collect::<Option<_>>()?;
    // SAFETY: `array` is a live ndarray; its header fields are plain reads.
    let fields = unsafe { &*npyffi::_PyArray_GET_ITEM_DATA(array.as_array_ptr()) };
    let data = fields.data.cast::<u8>();
    if !(data as usize).is_multiple_of(dtype.size()) && !shape.contains(&0) {
        return None;
    }
    Some((dtype, dims, data, fields.flags & NPY_ARRAY_WRITEABLE == 0))
}

/// A new C-contiguous ndarray with `meta`'s shape and dtype, and its data pointer; `None` for a
/// dtype NumPy has no builtin type for (bfloat16).
pub fn empty<'py>(py: Python<'py>, meta: &TensorMeta) -> Option<PyResult<(Bound<'py, PyAny>, *mut u8)>> {
    let descr = match meta.dtype {
        DType::F32 => PyArrayDescr::of::<f32>(py),
        DType::F16 => PyArrayDescr::of::<half::f16>(py),
        DType::F64 => PyArrayDescr::of::<f64>(py),
        DType::I8 => PyArrayDescr::of::<i8>(py),
        DType::I32 => PyArrayDescr::of::<i32>(py),
        DType::I64 => PyArrayDescr::of::<i64>(py),
        DType::U8 => PyArrayDescr::of::<u8>(py),
        DType::Bool => PyArrayDescr::of::<bool>(py),
        DType::BF16 => return None,
    };
    let mut dims: SmallVec<[npy_intp; 6]> = meta.shape().iter().map(|&d| d as npy_intp).collect();
    // SAFETY: `dims` holds `len` dimensions; PyArray_Empty steals the descriptor reference
    // `into_dtype_ptr` hands over and returns a new reference (or null with an exception set).
    let made = unsafe {
        let obj = PY_ARRAY_API.PyArray_Empty(py, dims.len() as _, dims.as_mut_ptr(), descr.into_dtype_ptr(), 0);
        Bound::from_owned_ptr_or_err(py, obj)
    };
    Some(made.map(|obj| {
        // SAFETY: `obj` is the ndarray just created.
        let data = unsafe { (*npyffi::_PyArray_GET_ITEM_DATA(obj.as_ptr().cast())).data.cast::<u8>() };
        (obj, data)
    }))
}
