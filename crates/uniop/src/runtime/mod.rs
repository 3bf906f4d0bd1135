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

/// A size in bytes as sysfs writes a cache's and uniop's size settings take it: `"32768K"`,
/// `"2M"`, `"1G"` (powers of 1024) or plain bytes.
pub fn parse_bytes(text: &str) -> Option<usize> {
    let (digits, unit) = match text.as_bytes().last()? {
        b'K' => (&text[..text.len() - 1], 1 << 10),
        b'M' => (&text[..text.len() - 1], 1 << 20),
        b'G' => (&text[..text.len() - 1], 1 << 30),
        _ => (text, 1),
    };
    digits.parse::<usize>().ok()?.checked_mul(unit)
}

/// The size environment variable `name` sets ([`parse_bytes`]); `None` where it is unset or
/// unreadable, so the caller keeps its default (as `UNIOP_NUM_THREADS` does).
pub fn env_bytes(name: &str) -> Option<usize> {
    parse_bytes(std::env::var(name).ok()?.trim())
}

#[cfg(test)]
mod tests {
    use super::parse_bytes;

    #[test]
    fn sizes_read_as_sysfs_writes_them() {
        assert_eq!(parse_bytes("32768K"), Some(32 << 20));
        assert_eq!(parse_bytes("2M"), Some(2 << 20));
        assert_eq!(parse_bytes("1G"), Some(1 << 30));
        assert_eq!(parse_bytes("4096"), Some(4096));
        assert_eq!(parse_bytes("0"), Some(0));
        for bad in ["", "K", "12Q", "-1K", "1.5M", "99999999999999999999G"] {
            assert_eq!(parse_bytes(bad), None, "{bad:?}");
        }
    }
}
