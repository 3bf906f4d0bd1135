//! The CPU runtime: memory, streams, events and the SPMD launch engine.

pub mod alloc;
pub mod fork;
pub mod pool;
pub mod profiler;
pub mod stream;

pub use alloc::{Allocator, DeviceBuffer, MemPolicy, MemStats};
pub use pool::{refuse_launch, BlockCtx, KernelStop, Pool};
pub use profiler::{LaunchEvent, LaunchKind, Profile};
pub use stream::{Event, Stream};

/// Kernel direct call, in the shape of an Ascend C `<<<blockDim, stream>>>` launch: runs
/// `kernel(ctx, &args)` for `block_dim` blocks on `stream`, asynchronously. `args` moves into the
/// launch and is dropped after the last block ran.
pub fn launch<A: Send + Sync + 'static>(stream: &Stream, block_dim: u32, kernel: fn(BlockCtx, &A), args: A) {
    stream.launch(block_dim, move |ctx| kernel(ctx, &args));
}

/// Blocks until the default stream is idle.
pub fn synchronize() -> crate::Result<()> {
    Stream::default_stream().synchronize()
}
