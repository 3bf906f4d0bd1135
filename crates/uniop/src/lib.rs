//! # uniop core
//!
//! Write an operator's core logic once; call it from everywhere. This crate holds everything an op
//! and a frontend agree on — and nothing op-specific:
//!
//! - [`DType`], [`Layout`]/[`TensorMeta`] and the views [`TensorRef`]/[`TensorMut`];
//! - the schema language ([`OpSchema`]) and the op model ([`Op`]: infer → plan → kernels, plus an
//!   f64 reference);
//! - the [`Registry`] frontends read, and the two-phase [`Executor`];
//! - the CPU runtime ([`runtime`]): caching allocator, streams and events, and the SPMD launch
//!   engine that both the "kernel direct call" and every op kernel run on.
//!
//! Data flows one way: frontends → registry/executor → ops → this core. The core never names an op.

pub mod autograd;
pub mod dtype;
pub mod error;
pub mod executor;
pub mod layout;
pub mod op;
pub mod plugin;
pub mod registry;
pub mod runtime;
pub mod schema;
pub mod tensor;
pub mod verify;

pub use dtype::{DType, Element, FloatElement};
pub use error::{Error, ErrorCode, Result};
pub use executor::Executor;
pub use half;
pub use layout::{broadcast_shapes, Layout, MetaRef, RowTiles, Runs, StridedRuns, TensorMeta};
pub use op::{
    block_dim_for, min_block_bytes, Autocast, Example, KernelArgs, LayoutNeed, Op, OpCx, OutputView, Plan, RefTensor,
    Step,
};
pub use registry::{OpEntry, Registry};
pub use runtime::{launch, refuse_launch, BlockCtx, Event, Stream};
pub use schema::{AttrValue, OpSchema};
pub use tensor::{Tensor, TensorMut, TensorRef};

/// Runs `op` synchronously on the default stream: phase 1, a workspace from the caching
/// allocator, phase 2, wait. The convenient Rust entry point; frontends use [`Executor`] directly.
pub fn call(
    op: &str,
    inputs: &[Option<TensorRef<'_>>],
    attrs: &[(&str, AttrValue)],
    outputs: Vec<TensorMut<'_>>,
) -> Result<()> {
    let mut exec = Executor::by_name(op, inputs, attrs, outputs)?;
    let ws = runtime::Allocator::global().allocate(exec.workspace_size(), runtime::MemPolicy::HugeFirst)?;
    // SAFETY: the workspace is exclusively ours until `run` returns (it synchronizes).
    exec.run(unsafe { ws.as_mut_slice() }, Stream::default_stream())
}

impl From<f64> for AttrValue {
    fn from(v: f64) -> Self {
        AttrValue::Float(v)
    }
}
impl From<i64> for AttrValue {
    fn from(v: i64) -> Self {
        AttrValue::Int(v)
    }
}
impl From<bool> for AttrValue {
    fn from(v: bool) -> Self {
        AttrValue::Bool(v)
    }
}
impl From<&str> for AttrValue {
    fn from(v: &str) -> Self {
        AttrValue::Str(v.to_string())
    }
}
