//! `uniop demo`: the kernel direct call, shown end to end.
//!
//! Stream A runs a producer kernel (8 blocks, each filling its slice of a buffer), records an
//! event; stream B waits for that event, then runs a consumer kernel (4 blocks, each summing a
//! quarter). Events bracket both kernels for timing. The answer is checked against a closed form.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use uniop::runtime::{launch, Allocator, DeviceBuffer, MemPolicy};
use uniop::{BlockCtx, Error, Event, Result, Stream};

const N: usize = 1 << 24;

struct Producer {
    buf: Arc<DeviceBuffer>,
}

struct Consumer {
    buf: Arc<DeviceBuffer>,
    partial: Arc<Vec<AtomicU64>>,
}

fn produce(ctx: BlockCtx, args: &Producer) {
    let r = ctx.split(N);
    // SAFETY: block `block_idx` alone writes elements `r`; nothing else runs on the buffer now.
    let out = unsafe { std::slice::from_raw_parts_mut((args.buf.as_ptr() as *mut u32).add(r.start), r.len()) };
    for (i, v) in out.iter_mut().enumerate() {
        *v = ((r.start + i) % 7) as u32;
    }
}

fn consume(ctx: BlockCtx, args: &Consumer) {
    let r = ctx.split(N);
    // SAFETY: the producer finished (event dependency); consumers only read.
    let data = unsafe { std::slice::from_raw_parts((args.buf.as_ptr() as *const u32).add(r.start), r.len()) };
    let sum: u64 = data.iter().map(|&v| v as u64).sum();
    args.partial[ctx.block_idx as usize].store(sum, Ordering::Relaxed);
}

pub fn run() -> Result<()> {
    let buf = Arc::new(Allocator::global().allocate(N * 4, MemPolicy::HugeFirst)?);
    let (a, b) = (Stream::new(), Stream::new());
    let (start, produced, end) = (Event::new(), Event::new(), Event::new());
    let partial: Arc<Vec<AtomicU64>> = Arc::new((0..4).map(|_| AtomicU64::new(0)).collect());

    start.record(&a);
    launch(&a, 8, produce, Producer { buf: buf.clone() });
    produced.record(&a);
    b.wait_event(&produced)?;
    launch(&b, 4, consume, Consumer { buf: buf.clone(), partial: partial.clone() });
    end.record(&b);
    println!(
        "enqueued: stream {} produce<<<8>>> → event → stream {} consume<<<4>>> (host not blocked)",
        a.id(),
        b.id()
    );

    end.synchronize()?;
    a.synchronize()?;
    b.synchronize()?;
    let sums: Vec<u64> = partial.iter().map(|p| p.load(Ordering::Relaxed)).collect();
    let total: u64 = sums.iter().sum();
    let expected: u64 = (0..N as u64).map(|i| i % 7).sum();
    println!("per-block sums: {sums:?}");
    println!("total {total} (expected {expected}): {}", if total == expected { "OK" } else { "MISMATCH" });
    println!(
        "event timing: produce {:.3} ms, produce→consume end {:.3} ms",
        Event::elapsed_ms(&start, &produced)?,
        Event::elapsed_ms(&start, &end)?
    );
    drop(buf);
    println!("\n{}", Allocator::global().memory_summary());
    if total != expected {
        return Err(Error::runtime("demo: consumer saw data the producer did not write"));
    }
    Ok(())
}
