//! Conversions used by the generated per-op functions (`ops.rs`): C attribute values to schema
//! values, with errors that name the function and the argument.

use crate::tensor::{dtype_of, text, uniopDataType};
use std::ffi::c_char;
use uniop::{AttrValue, Result};

pub(crate) fn string(func: &str, arg: &str, value: *const c_char) -> Result<AttrValue> {
    Ok(AttrValue::Str(text(value, func, arg)?.to_string()))
}

pub(crate) fn dtype(func: &str, arg: &str, code: uniopDataType) -> Result<AttrValue> {
    Ok(AttrValue::DType(dtype_of(code, func, arg)?))
}

/// An optional attribute passed by pointer: NULL is `None`.
pub(crate) fn optional<T: Copy>(value: *const T, convert: impl FnOnce(T) -> Result<AttrValue>) -> Result<AttrValue> {
    if value.is_null() {
        return Ok(AttrValue::None);
    }
    // SAFETY: non-null pointers from C point at one value.
    convert(unsafe { *value })
}
