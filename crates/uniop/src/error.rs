//! One error type for the whole stack.
//!
//! Every failure a user can cause maps to a stable numeric [`ErrorCode`] (modelled on aclnn's status
//! codes, so C callers can switch on it) plus a message written for a human: it names the op, the
//! argument, what was expected and what was given. Frontends never invent their own messages; they
//! forward this one (the C API through a thread-local "recent error message").

use std::fmt;

/// Stable status codes. The numbers are part of the C ABI: never renumber, only append.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(i32)]
pub enum ErrorCode {
    /// A required pointer/handle/tensor was null or missing.
    ParamNullptr = 161001,
    /// An argument has a value outside what the op or API accepts (also: API misuse such as
    /// relaunching a single-use executor or waiting on an event that was never recorded).
    ParamInvalid = 161002,
    /// An argument has a dtype the op does not support, or dtypes that must match do not.
    DType = 161003,
    /// Shapes, ranks or strides do not fit together (including size overflow and failed broadcasts).
    Shape = 161004,
    /// The workspace handed to phase 2 is smaller than phase 1 asked for.
    WorkspaceTooSmall = 161005,
    /// Something went wrong while running: kernel panic, out of memory, a wait that can never finish.
    Runtime = 361001,
    /// A bug in uniop itself.
    Internal = 561000,
}

impl ErrorCode {
    /// The short, stable name used in messages and docs.
    pub fn name(self) -> &'static str {
        match self {
            ErrorCode::ParamNullptr => "param-nullptr",
            ErrorCode::ParamInvalid => "param-invalid",
            ErrorCode::DType => "dtype",
            ErrorCode::Shape => "shape",
            ErrorCode::WorkspaceTooSmall => "workspace-too-small",
            ErrorCode::Runtime => "runtime",
            ErrorCode::Internal => "internal",
        }
    }

    /// The numeric value used across the C ABI.
    pub fn value(self) -> i32 {
        self as i32
    }
}

/// A uniop error: a stable code and a message that says what went wrong where.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Error {
    code: ErrorCode,
    message: String,
}

impl Error {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        Error { code, message: message.into() }
    }

    pub fn code(&self) -> ErrorCode {
        self.code
    }

    pub fn message(&self) -> &str {
        &self.message
    }

    /// An error about one argument of one op:
    /// `rms_norm: argument 'weight': expected shape [4096], got [4095]`.
    pub fn arg(code: ErrorCode, op: &str, arg: &str, expected: impl fmt::Display, given: impl fmt::Display) -> Self {
        Error::new(code, format!("{op}: argument '{arg}': expected {expected}, got {given}"))
    }

    pub fn runtime(message: impl Into<String>) -> Self {
        Error::new(ErrorCode::Runtime, message)
    }

    pub fn invalid(message: impl Into<String>) -> Self {
        Error::new(ErrorCode::ParamInvalid, message)
    }

    pub fn internal(message: impl Into<String>) -> Self {
        Error::new(ErrorCode::Internal, message)
    }

    /// Prefix the message with context (e.g. the op name) without changing the code.
    pub fn context(self, what: impl fmt::Display) -> Self {
        Error { code: self.code, message: format!("{what}: {}", self.message) }
    }

    /// Append the reason a lower layer gave (an allocator's refusal) without changing the code.
    pub fn because(self, reason: impl fmt::Display) -> Self {
        Error { code: self.code, message: format!("{}: {reason}", self.message) }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "[{} {}] {}", self.code.value(), self.code.name(), self.message)
    }
}

impl std::error::Error for Error {}

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arg_error_names_everything() {
        let e = Error::arg(ErrorCode::Shape, "rms_norm", "weight", "shape [8]", "shape [7]");
        assert_eq!(e.code(), ErrorCode::Shape);
        assert_eq!(e.to_string(), "[161004 shape] rms_norm: argument 'weight': expected shape [8], got shape [7]");
    }

    #[test]
    fn codes_are_stable() {
        assert_eq!(ErrorCode::ParamNullptr.value(), 161001);
        assert_eq!(ErrorCode::WorkspaceTooSmall.value(), 161005);
        assert_eq!(ErrorCode::Runtime.value(), 361001);
        assert_eq!(ErrorCode::Internal.value(), 561000);
    }
}
