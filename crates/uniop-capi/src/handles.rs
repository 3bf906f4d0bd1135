//! Live-handle bookkeeping: every object handed to C is registered by address and type, so a
//! null, foreign, wrongly-typed or already-destroyed handle is reported instead of dereferenced.
//! Argument names are `Display` and only formatted when there is an error to report.

use rustc_hash::FxHashMap;
use std::any::TypeId;
use std::fmt::Display;
use std::sync::{Mutex, OnceLock};
use uniop::{Error, ErrorCode, Result};

/// Keys are addresses, so a cheap multiplicative hash is enough (every call checks its handles).
static LIVE: OnceLock<Mutex<FxHashMap<usize, TypeId>>> = OnceLock::new();

fn live() -> &'static Mutex<FxHashMap<usize, TypeId>> {
    LIVE.get_or_init(|| {
        // Every call takes this lock: a fork while another thread holds it would leave the child's
        // copy locked for good.
        uniop::runtime::fork::hold_across_fork(&LIVE);
        Default::default()
    })
}

/// Moves `value` to the heap and registers it; the pointer is the C handle.
pub fn register<T: 'static>(value: T) -> *mut T {
    let ptr = Box::into_raw(Box::new(value));
    live().lock().unwrap().insert(ptr as usize, TypeId::of::<T>());
    ptr
}

fn check<T: 'static>(ptr: *const T, func: &str, arg: impl Display, kind: &str) -> Result<()> {
    if ptr.is_null() {
        return Err(Error::arg(ErrorCode::ParamNullptr, func, &arg.to_string(), format!("a {kind}"), "NULL"));
    }
    if live().lock().unwrap().get(&(ptr as usize)) != Some(&TypeId::of::<T>()) {
        return Err(Error::arg(
            ErrorCode::ParamInvalid,
            func,
            &arg.to_string(),
            format!("a live {kind}"),
            format!("{ptr:p}, which is not one (destroyed already, or not created by uniop)"),
        ));
    }
    Ok(())
}

/// The object behind a live handle.
///
/// # Safety
/// No other thread may destroy the handle while the reference is in use (as with any C handle).
pub unsafe fn get<'a, T: 'static>(ptr: *const T, func: &str, arg: impl Display, kind: &str) -> Result<&'a T> {
    check(ptr, func, arg, kind)?;
    Ok(&*ptr)
}

/// Like [`get`], mutably.
///
/// # Safety
/// As [`get`], and the caller must not use the handle from two threads at once.
pub unsafe fn get_mut<'a, T: 'static>(ptr: *mut T, func: &str, arg: impl Display, kind: &str) -> Result<&'a mut T> {
    check(ptr, func, arg, kind)?;
    Ok(&mut *ptr)
}

/// Unregisters a live handle and returns the object (to drop it).
pub fn release<T: 'static>(ptr: *mut T, func: &str, arg: impl Display, kind: &str) -> Result<Box<T>> {
    check(ptr, func, arg, kind)?;
    live().lock().unwrap().remove(&(ptr as usize));
    // SAFETY: registered by `register` from a Box of this type and removed exactly once.
    Ok(unsafe { Box::from_raw(ptr) })
}
