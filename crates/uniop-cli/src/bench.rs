//! `uniop bench`: op throughput against the machine's own limits, measured in the same run.
//!
//! The limit for memory-bound ops is a STREAM-style probe (copy and triad over 64 MiB arrays, run
//! through the same SPMD engine, on warm memory). Op bytes count each input and output element once,
//! as STREAM counts its arrays. Times are best-of-N on preallocated tensors with a repeatable
//! executor, so they measure kernels rather than allocation.

use std::sync::Arc;
use std::time::{Duration, Instant};
use uniop::runtime::{Allocator, DeviceBuffer, MemPolicy, Pool};
use uniop::verify::OpHarness;
use uniop::{BlockCtx, DType, Registry, Result, Stream};

#[derive(clap::Args)]
pub struct BenchArgs {
    /// Comma-separated ops to time (default: rms_norm).
    #[arg(long, default_value = "rms_norm")]
    ops: String,
    /// Comma-separated dtypes (default: f32,bf16).
    #[arg(long, default_value = "f32,bf16")]
    dtypes: String,
    /// Main input shape (default: each op's representative shape, e.g. 4096x4096 for rms_norm).
    #[arg(long)]
    shape: Option<String>,
    /// Best-of repetitions.
    #[arg(long, default_value_t = 20)]
    iters: usize,
    /// Also write the results as JSON to this path (read by benches/torch_peer.py).
    #[arg(long)]
    json: Option<std::path::PathBuf>,
}

/// STREAM-style bandwidths in GB/s, each counting every array once as STREAM does.
struct Probe {
    /// `a = 3·b` with ordinary stores (a copy-shaped kernel the compiler cannot turn into memcpy,
    /// whose store strategy varies with size).
    scale_gbs: f64,
    /// The same with non-temporal stores: the ceiling for kernels that stream their outputs.
    scale_nt_gbs: f64,
    /// `a = b + 3·c` with ordinary stores.
    triad_gbs: f64,
}

#[derive(Clone, Copy)]
enum ProbeKind {
    Scale,
    ScaleStreaming,
    Triad,
}

fn best_of(iters: usize, mut f: impl FnMut() -> Result<()>) -> Result<Duration> {
    f()?;
    let mut best = Duration::MAX;
    for _ in 0..iters {
        let t0 = Instant::now();
        f()?;
        best = best.min(t0.elapsed());
    }
    Ok(best)
}

fn stream_probe(iters: usize) -> Result<Probe> {
    const N: usize = 16 << 20; // f32 elements: 64 MiB per array
    let alloc = Allocator::global();
    let bufs: Vec<Arc<DeviceBuffer>> =
        (0..3).map(|_| alloc.allocate(N * 4, MemPolicy::HugeFirst).map(Arc::new)).collect::<Result<_>>()?;
    let stream = Stream::default_stream();
    let blocks = (Pool::global().threads() * 4) as u32;
    let ptrs = Arc::new(bufs);
    // Fault the pages in (first touch is slow and not what we measure).
    for b in ptrs.iter() {
        // SAFETY: no kernel uses the buffers yet.
        unsafe { b.as_mut_slice() }.fill(1);
    }
    let launch = |kind: ProbeKind| {
        let ptrs = ptrs.clone();
        stream.launch(blocks, move |ctx: BlockCtx| {
            let r = ctx.split(N);
            // SAFETY: each block touches only its own element range of each buffer.
            let (a, b, c) = unsafe {
                (
                    std::slice::from_raw_parts_mut((ptrs[0].as_ptr() as *mut f32).add(r.start), r.len()),
                    std::slice::from_raw_parts((ptrs[1].as_ptr() as *const f32).add(r.start), r.len()),
                    std::slice::from_raw_parts((ptrs[2].as_ptr() as *const f32).add(r.start), r.len()),
                )
            };
            match kind {
                ProbeKind::Scale => a.iter_mut().zip(b).for_each(|(x, &y)| *x = 3.0 * y),
                ProbeKind::ScaleStreaming => scale_streaming(a, b),
                ProbeKind::Triad => a.iter_mut().zip(b).zip(c).for_each(|((x, &y), &z)| *x = y + 3.0 * z),
            }
        });
        stream.synchronize()
    };
    let seconds = |kind| best_of(iters, || launch(kind)).map(|d| d.as_secs_f64());
    let bytes = (N * 4) as f64;
    Ok(Probe {
        scale_gbs: 2.0 * bytes / seconds(ProbeKind::Scale)? / 1e9,
        scale_nt_gbs: 2.0 * bytes / seconds(ProbeKind::ScaleStreaming)? / 1e9,
        triad_gbs: 3.0 * bytes / seconds(ProbeKind::Triad)? / 1e9,
    })
}

/// `a = 3·b` with 16-byte non-temporal stores (SSE2, part of the x86-64 baseline).
fn scale_streaming(a: &mut [f32], b: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_loadu_ps, _mm_mul_ps, _mm_set1_ps, _mm_sfence, _mm_stream_ps};
        let head = a.as_ptr().align_offset(16).min(a.len());
        a[..head].iter_mut().zip(b).for_each(|(x, &y)| *x = 3.0 * y);
        let body = (a.len() - head) / 4 * 4;
        // SAFETY: indices stay below `head + body <= a.len() == b.len()`; the stream target is
        // 16-byte aligned (after `head`).
        unsafe {
            let three = _mm_set1_ps(3.0);
            for i in (head..head + body).step_by(4) {
                _mm_stream_ps(a.as_mut_ptr().add(i), _mm_mul_ps(three, _mm_loadu_ps(b.as_ptr().add(i))));
            }
            _mm_sfence();
        }
        a[head + body..].iter_mut().zip(&b[head + body..]).for_each(|(x, &y)| *x = 3.0 * y);
    }
    #[cfg(not(target_arch = "x86_64"))]
    a.iter_mut().zip(b).for_each(|(x, &y)| *x = 3.0 * y);
}

/// Peak f32 FMA throughput in GFLOP/s over the pool: every block runs independent FMA chains in
/// registers (12 chains hide the 4-cycle latency of two FMA pipes), no memory traffic.
fn fma_probe(iters: usize) -> Result<f64> {
    const STEPS: usize = 1 << 20;
    compute_probe(iters, || {
        let (flops, sink) = fma_chains(STEPS);
        std::hint::black_box(sink);
        flops
    })
}

/// Peak bf16 AMX tile throughput in GFLOP/s over the pool (the bf16 GEMM's block kernel on
/// operands in L1), or None without AMX.
fn amx_probe(iters: usize) -> Result<Option<f64>> {
    const ROUNDS: usize = 1 << 13;
    // The tiles' availability is asked once per process, so every block gets the same answer.
    if uniop_ops::amx_probe(1).is_none() {
        return Ok(None);
    }
    compute_probe(iters, || uniop_ops::amx_probe(ROUNDS).unwrap_or(0)).map(Some)
}

/// GFLOP/s over the pool of `work` (which returns the flops it did) run by every block at once,
/// best of a few launches.
fn compute_probe(iters: usize, work: impl Fn() -> u64 + Send + Sync + Clone + 'static) -> Result<f64> {
    let stream = Stream::default_stream();
    let blocks = Pool::global().threads() as u32;
    let least_flops = Arc::new(std::sync::atomic::AtomicU64::new(u64::MAX));
    let counter = least_flops.clone();
    let seconds = best_of(iters.min(5), || {
        let (counter, work) = (counter.clone(), work.clone());
        stream.launch(blocks, move |_ctx: BlockCtx| {
            counter.fetch_min(work(), std::sync::atomic::Ordering::Relaxed);
        });
        stream.synchronize()
    })?
    .as_secs_f64();
    let flops = least_flops.load(std::sync::atomic::Ordering::Relaxed);
    Ok(flops as f64 * blocks as f64 / seconds / 1e9)
}

/// Runs `steps` rounds of 12 independent vector FMAs at the widest width the CPU has; returns
/// the flops done and a value the optimizer must keep.
fn fma_chains(steps: usize) -> (u64, f32) {
    #[cfg(target_arch = "x86_64")]
    {
        if is_x86_feature_detected!("avx512f") {
            // SAFETY: the feature was detected just above.
            return (steps as u64 * 12 * 16 * 2, unsafe { fma_chains_avx512(steps) });
        }
        if is_x86_feature_detected!("fma") && is_x86_feature_detected!("avx2") {
            // SAFETY: as above.
            return (steps as u64 * 12 * 8 * 2, unsafe { fma_chains_avx2(steps) });
        }
    }
    let mut acc = [1.0f32; 12];
    for _ in 0..steps {
        acc.iter_mut().for_each(|a| *a = a.mul_add(0.999_999, 1e-7));
    }
    (steps as u64 * 12 * 2, acc.iter().sum())
}

macro_rules! fma_chains_x86 {
    ($name:ident, $feature:literal, $set1:ident, $fmadd:ident, $store:ident, $lanes:literal) => {
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = $feature)]
        unsafe fn $name(steps: usize) -> f32 {
            use std::arch::x86_64::*;
            let (m, c) = ($set1(0.999_999), $set1(1e-7));
            let mut acc = [$set1(1.0); 12];
            for _ in 0..steps {
                for a in acc.iter_mut() {
                    *a = $fmadd(*a, m, c);
                }
            }
            let mut out = [0f32; $lanes];
            let mut sum = 0.0;
            for a in acc {
                // SAFETY: `out` holds one full vector.
                unsafe { $store(out.as_mut_ptr(), a) };
                sum += out.iter().sum::<f32>();
            }
            sum
        }
    };
}
fma_chains_x86!(fma_chains_avx512, "avx512f", _mm512_set1_ps, _mm512_fmadd_ps, _mm512_storeu_ps, 16);
fma_chains_x86!(fma_chains_avx2, "avx2,fma", _mm256_set1_ps, _mm256_fmadd_ps, _mm256_storeu_ps, 8);

/// Launch overhead on the default stream: amortised cost per launch of an empty kernel, and the
/// latency from enqueue to the first block starting (stream worker warm, and after it parked).
fn launch_overhead() -> Result<()> {
    let stream = Stream::default_stream();
    let threads = Pool::global().threads() as u32;
    for block_dim in [1, threads] {
        let n = 100_000;
        let per = best_of(3, || {
            for _ in 0..n {
                stream.launch(block_dim, |_| {});
            }
            stream.synchronize()
        })?;
        println!(
            "empty-kernel launch, block_dim {block_dim}: {:.3} µs per launch (amortised over {n})",
            per.as_secs_f64() * 1e6 / n as f64
        );
    }
    for (label, pause) in [("warm worker", Duration::ZERO), ("parked worker", Duration::from_millis(2))] {
        let mut lat = Vec::new();
        for _ in 0..200 {
            std::thread::sleep(pause);
            let started = Arc::new(std::sync::OnceLock::new());
            let s = started.clone();
            let t0 = Instant::now();
            stream.launch(1, move |_| {
                let _ = s.set(Instant::now());
            });
            stream.synchronize()?;
            lat.push(started.get().expect("kernel ran").duration_since(t0));
        }
        lat.sort();
        println!(
            "enqueue-to-start latency, {label}: median {:.2} µs, p90 {:.2} µs",
            lat[lat.len() / 2].as_secs_f64() * 1e6,
            lat[lat.len() * 9 / 10].as_secs_f64() * 1e6
        );
    }
    Ok(())
}

/// `bytes` in the largest binary unit that divides it: "32 MiB", "48 KiB", "1000 B".
fn size_text(bytes: usize) -> String {
    let unit = ["GiB", "MiB", "KiB"]
        .into_iter()
        .zip([30, 20, 10])
        .find(|&(_, shift)| bytes >= 1 << shift && bytes.is_multiple_of(1 << shift));
    match unit {
        Some((name, shift)) => format!("{} {name}", bytes >> shift),
        None => format!("{bytes} B"),
    }
}

pub fn run(args: &BenchArgs) -> Result<()> {
    println!(
        "uniop bench — {} compute threads; outputs from {} stream past the cache; blocks of {} or more",
        Pool::global().threads(),
        size_text(uniop_ops::streaming_threshold_bytes()),
        size_text(uniop::min_block_bytes())
    );
    let probe = stream_probe(args.iters)?;
    println!(
        "STREAM probe: scale {:.1} GB/s, scale with non-temporal stores {:.1} GB/s, triad {:.1} GB/s",
        probe.scale_gbs, probe.scale_nt_gbs, probe.triad_gbs
    );
    let fma_gflops = fma_probe(args.iters)?;
    println!("FMA probe: {fma_gflops:.0} GFLOP/s f32 peak over the pool");
    let amx_gflops = amx_probe(args.iters)?;
    match amx_gflops {
        Some(gflops) => println!("AMX probe: {gflops:.0} GFLOP/s bf16 tile peak over the pool"),
        None => println!("AMX probe: this CPU (or OS) offers no AMX tiles"),
    }
    launch_overhead()?;
    let shape = args.shape.as_deref().map(crate::parse_shape).transpose()?;
    println!("\n| op | dtype | shape | best ms | GB/s | % of STREAM scale | % of scale (non-temporal) |\n|---|---|---|---|---|---|---|");
    let mut rows = Vec::new();
    for op in args.ops.split(',').filter(|s| !s.is_empty()) {
        let entry = Registry::global().get(op)?;
        for d in args.dtypes.split(',').filter(|s| !s.is_empty()) {
            let dtype = DType::parse(d)?;
            if !entry.op.dtypes().contains(&dtype) {
                eprintln!("(skipping {op} {}: not one of its dtypes)", dtype.name());
                continue;
            }
            let example = entry.op.example(shape.as_deref(), dtype)?;
            let main_shape = entry.op.example_shape(&example);
            let mut h = OpHarness::new(entry.clone(), example, 1)?;
            let best = h.bench(Stream::default_stream(), args.iters)?;
            let gbs = h.bytes_moved()? as f64 / best.as_secs_f64() / 1e9;
            let ms = best.as_secs_f64() * 1e3;
            let shape_s = main_shape.iter().map(|d| d.to_string()).collect::<Vec<_>>().join("x");
            println!(
                "| {op} | {} | {shape_s} | {ms:.3} | {gbs:.1} | {:.0}% | {:.0}% |",
                dtype.name(),
                100.0 * gbs / probe.scale_gbs,
                100.0 * gbs / probe.scale_nt_gbs
            );
            rows.push(format!(
                "{{\"op\":\"{op}\",\"dtype\":\"{}\",\"shape\":{:?},\"ms\":{ms},\"gbs\":{gbs}}}",
                dtype.name(),
                main_shape
            ));
        }
    }
    if let Some(path) = &args.json {
        let json = format!(
            "{{\"stream_scale_gbs\":{},\"stream_scale_nt_gbs\":{},\"stream_triad_gbs\":{},\"fma_gflops\":{},\
             \"amx_gflops\":{},\"results\":[{}]}}\n",
            probe.scale_gbs,
            probe.scale_nt_gbs,
            probe.triad_gbs,
            fma_gflops,
            amx_gflops.map_or("null".to_string(), |g| g.to_string()),
            rows.join(",")
        );
        std::fs::write(path, json).map_err(|e| uniop::Error::runtime(format!("writing {}: {e}", path.display())))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::size_text;

    #[test]
    fn sizes_print_in_the_largest_unit_that_divides_them() {
        assert_eq!(size_text(32 << 20), "32 MiB");
        assert_eq!(size_text(48 << 10), "48 KiB");
        assert_eq!(size_text((1 << 20) + (1 << 10)), "1025 KiB");
        assert_eq!(size_text(1000), "1000 B");
        assert_eq!(size_text(0), "0 B");
        assert_eq!(size_text(2 << 30), "2 GiB");
    }
}
