//! Op libraries loaded at run time: a Rust crate built as a `cdylib` defines ops with the same
//! [`Op`] trait and exports them with [`export_ops!`](crate::export_ops); [`load`] registers them,
//! after which every frontend (Rust, the C API, the CLI) serves them like built-ins.
//!
//! Rust has no stable ABI, so a plugin must be built by the same compiler against the same uniop
//! version as the library loading it. Both facts are exported by the macro and checked before any
//! Rust-ABI symbol is touched; a mismatch is a clear error, not a crash. The plugin keeps its own
//! copy of the core's statics, so ops should reach the runtime only through what they are handed
//! (`OpCx`, `KernelArgs`), as built-in ops do. A loaded library is never unloaded: its code backs
//! the registered ops.

use crate::error::{Error, ErrorCode, Result};
use crate::op::Op;
use crate::registry::Registry;
use std::ffi::{c_char, c_void, CStr, CString};

/// Bumped when the plugin entry points change.
pub const ABI_VERSION: u32 = 1;

/// What a plugin must match: uniop's version and the compiler (NUL-terminated for C).
pub const BUILD_ID: &str = concat!("uniop ", env!("CARGO_PKG_VERSION"), ", ", env!("UNIOP_RUSTC_VERSION"), "\0");

/// Exports ops from a plugin crate (built as a `cdylib`):
/// `uniop::export_ops!(MyOp, MyOtherOp);`
#[macro_export]
macro_rules! export_ops {
    ($($op:expr),* $(,)?) => {
        #[no_mangle]
        pub extern "C" fn uniop_plugin_abi_version() -> u32 {
            $crate::plugin::ABI_VERSION
        }
        #[no_mangle]
        pub extern "C" fn uniop_plugin_build_id() -> *const ::std::ffi::c_char {
            $crate::plugin::BUILD_ID.as_ptr().cast()
        }
        /// Rust ABI: called only after the version and compiler checks passed.
        #[no_mangle]
        pub fn uniop_plugin_ops() -> ::std::vec::Vec<::std::boxed::Box<dyn $crate::Op>> {
            ::std::vec![$(::std::boxed::Box::new($op) as ::std::boxed::Box<dyn $crate::Op>),*]
        }
    };
}

fn dl_error() -> String {
    // SAFETY: dlerror returns NULL or a NUL-terminated message owned by libc.
    let e = unsafe { libc::dlerror() };
    if e.is_null() {
        "unknown error".into()
    } else {
        unsafe { CStr::from_ptr(e) }.to_string_lossy().into_owned()
    }
}

fn invalid(path: &str, why: impl std::fmt::Display) -> Error {
    Error::new(ErrorCode::ParamInvalid, format!("load_op_library: '{path}' {why}"))
}

/// Loads the op library at `path` and registers its ops; returns their names.
pub fn load(path: &str) -> Result<Vec<String>> {
    let c_path = CString::new(path).map_err(|_| invalid(path, "contains a NUL byte"))?;
    // SAFETY: dlopen with a valid C string; the handle is checked.
    let handle = unsafe { libc::dlopen(c_path.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    if handle.is_null() {
        return Err(invalid(path, format!("cannot be loaded: {}", dl_error())));
    }
    let result = unsafe { register_from(handle, path) };
    if result.is_err() {
        // SAFETY: nothing from the library was kept.
        unsafe { libc::dlclose(handle) };
    }
    result
}

unsafe fn symbol(handle: *mut c_void, name: &CStr) -> *mut c_void {
    libc::dlsym(handle, name.as_ptr())
}

unsafe fn register_from(handle: *mut c_void, path: &str) -> Result<Vec<String>> {
    let abi = symbol(handle, c"uniop_plugin_abi_version");
    if abi.is_null() {
        return Err(invalid(
            path,
            "is not a uniop op library (no uniop_plugin_abi_version; export ops with uniop::export_ops!)",
        ));
    }
    let abi: extern "C" fn() -> u32 = std::mem::transmute(abi);
    let theirs = abi();
    if theirs != ABI_VERSION {
        return Err(invalid(
            path,
            format!(
                "speaks plugin ABI version {theirs}, this uniop speaks {ABI_VERSION}: rebuild it against this uniop"
            ),
        ));
    }
    let id = symbol(handle, c"uniop_plugin_build_id");
    if id.is_null() {
        return Err(invalid(path, "has no uniop_plugin_build_id"));
    }
    let id: extern "C" fn() -> *const c_char = std::mem::transmute(id);
    let theirs = CStr::from_ptr(id()).to_string_lossy().into_owned();
    let ours = BUILD_ID.trim_end_matches('\0');
    if theirs != ours {
        return Err(invalid(
            path,
            format!("was built as '{theirs}' but this library is '{ours}': build plugins with the same compiler and uniop version"),
        ));
    }
    let ops = symbol(handle, c"uniop_plugin_ops");
    if ops.is_null() {
        return Err(invalid(path, "has no uniop_plugin_ops"));
    }
    // SAFETY: same compiler and uniop version (checked above), so the Rust ABI and types agree.
    let ops: fn() -> Vec<Box<dyn Op>> = std::mem::transmute(ops);
    let ops = ops();
    let registry = Registry::global();
    let mut names = Vec::new();
    for op in &ops {
        let schema = crate::schema::OpSchema::parse(op.schema()).map_err(|e| e.context(path))?;
        if registry.contains(&schema.name) {
            return Err(invalid(path, format!("defines op '{}', which is already registered", schema.name)));
        }
        names.push(schema.name);
    }
    for op in ops {
        registry.register(op)?;
    }
    Ok(names)
}
