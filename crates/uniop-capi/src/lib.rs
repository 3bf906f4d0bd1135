//! uniop's C ABI, in the shape CANN users know from AscendCL + aclnn: a runtime (init, streams,
//! events, memory), tensor descriptors, and two-phase op calls — `...GetWorkspaceSize` plans and
//! returns an executor, the second call launches it on a stream.
//!
//! Every entry point returns a `uniopStatus` (0 or one of the codes of [`uniop::ErrorCode`]) and
//! leaves the message in a thread-local slot read by `uniopGetRecentErrMsg`. Nothing unwinds
//! across the boundary: each body runs under `catch_unwind`, so a Rust panic becomes
//! `UNIOP_ERROR_INTERNAL` with its message. Handles are checked against the set of live ones
//! before use, so a null, foreign or destroyed handle is an error, never a dereference.
//!
//! `include/uniop.h` is generated from this crate by cbindgen (`uniop-header` binary); the test
//! suite fails when the committed header is stale.

#![allow(non_camel_case_types, non_snake_case)]
// The `extern "C"` functions take raw pointers from C; their contracts are the C header's.
#![allow(clippy::missing_safety_doc, clippy::not_unsafe_ptr_arg_deref)]
// Signatures follow aclnn/AscendCL (aclCreateTensor takes nine arguments).
#![allow(clippy::too_many_arguments)]

#[cfg(test)]
mod bad_input_sweep;
mod handles;
mod ops;
mod runtime;
mod tensor;
mod typed;

pub use ops::*;
pub use runtime::*;
pub use tensor::*;

use std::cell::RefCell;
use std::ffi::{c_char, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use uniop::{Error, ErrorCode};

/// Result of every call: `UNIOP_SUCCESS` or an error code.
pub type uniopStatus = i32;

// Literals (the header generator cannot evaluate casts); the asserts keep them equal to the core's codes.
pub const UNIOP_SUCCESS: uniopStatus = 0;
pub const UNIOP_ERROR_PARAM_NULLPTR: uniopStatus = 161001;
pub const UNIOP_ERROR_PARAM_INVALID: uniopStatus = 161002;
pub const UNIOP_ERROR_DTYPE: uniopStatus = 161003;
pub const UNIOP_ERROR_SHAPE: uniopStatus = 161004;
pub const UNIOP_ERROR_WORKSPACE_TOO_SMALL: uniopStatus = 161005;
pub const UNIOP_ERROR_RUNTIME: uniopStatus = 361001;
pub const UNIOP_ERROR_INTERNAL: uniopStatus = 561000;
const _: () = {
    assert!(UNIOP_ERROR_PARAM_NULLPTR == ErrorCode::ParamNullptr as i32);
    assert!(UNIOP_ERROR_PARAM_INVALID == ErrorCode::ParamInvalid as i32);
    assert!(UNIOP_ERROR_DTYPE == ErrorCode::DType as i32);
    assert!(UNIOP_ERROR_SHAPE == ErrorCode::Shape as i32);
    assert!(UNIOP_ERROR_WORKSPACE_TOO_SMALL == ErrorCode::WorkspaceTooSmall as i32);
    assert!(UNIOP_ERROR_RUNTIME == ErrorCode::Runtime as i32);
    assert!(UNIOP_ERROR_INTERNAL == ErrorCode::Internal as i32);
};

/// Bumped when a struct layout or a signature of this header changes incompatibly (2: `add`'s alpha
/// became a `uniopScalar`; 3: cross_entropy, its backward and the backwards summing parameter
/// gradients gained `batch_dims`; 4: so did linear_silu_mul_backward and linear_gelu_mul_backward, with
/// `needs_dx`, `needs_dgate_weight` and `needs_dup_weight`; linear_backward and linear_add_backward
/// gained `needs_dx` and `needs_dweight`, matmul_backward `needs_da` and `needs_db`; 5:
/// attention_backward gained `batch_dims`; 6: so did permute and permute_backward).
pub const UNIOP_ABI_VERSION: u32 = 6;

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

fn record(e: &Error) -> uniopStatus {
    let text = CString::new(e.message().replace('\0', " ")).unwrap_or_default();
    LAST_ERROR.with_borrow_mut(|slot| *slot = text);
    e.code() as i32
}

/// Runs a call body: errors and panics become a status plus the thread's recent message.
fn guard(body: impl FnOnce() -> uniop::Result<()>) -> uniopStatus {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(())) => UNIOP_SUCCESS,
        Ok(Err(e)) => record(&e),
        Err(panic) => {
            let what = panic
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| panic.downcast_ref::<&str>().copied())
                .unwrap_or("a panic without a message");
            record(&Error::new(ErrorCode::Internal, format!("internal error (please report): {what}")))
        }
    }
}

/// A required pointer argument of `func`, or the error naming it.
fn non_null<T>(ptr: *const T, func: &str, arg: &str) -> uniop::Result<*const T> {
    if ptr.is_null() {
        Err(Error::arg(ErrorCode::ParamNullptr, func, arg, "a non-null pointer", "NULL"))
    } else {
        Ok(ptr)
    }
}

/// The message of the calling thread's most recent failed call ("" when none). Valid until the
/// thread's next failing call.
#[no_mangle]
pub extern "C" fn uniopGetRecentErrMsg() -> *const c_char {
    LAST_ERROR.with_borrow(|s| s.as_ptr())
}

/// `UNIOP_ABI_VERSION` of the loaded library, to compare with the header's.
#[no_mangle]
pub extern "C" fn uniopGetAbiVersion() -> u32 {
    UNIOP_ABI_VERSION
}
