//! Shared machinery for elementwise float kernels: operands are walked as strided runs
//! ([`StridedRuns`]); dense runs go through [`dense_map`] (f32) or whole widened steps
//! (f16/bf16), strided ones through fixed f32 chunks, so everything computes in f32 and
//! vectorizes; the op supplies only the function of one element, as a [`Map1`]/[`Map2`].
//!
//! Why traits instead of closures: kernels are compiled once per instruction set
//! ([`simd_kernel!`](crate::simd_kernel)), and only code *inlined* into those copies gets wide
//! vectors. A trait method marked `#[inline(always)]` is guaranteed to be; a closure is not.

use uniop::layout::ShapeDisplay;
use uniop::{
    broadcast_shapes, BlockCtx, DType, Element, Error, ErrorCode, FloatElement, KernelArgs, Layout, OpCx, OutputView,
    RefTensor, Result, StridedRuns, TensorMeta,
};

pub const CHUNK: usize = 64;

/// Whether a kernel writing `bytes` in all (every output together) should write them past the
/// cache with non-temporal stores: from [`streaming_threshold_bytes`] on, they cannot stay there
/// anyway, and skipping the read-for-ownership of each destination line removes a third of the
/// memory traffic of a read-one-write-one kernel. Below that size ordinary stores win: the lines
/// stay cached for the next op (and a repeated op), where streamed ones go to DRAM —
/// kv_cache_append writing 16 MiB of bf16 ran 0.60 ms streamed and 0.34–0.52 ms with ordinary
/// stores on a 32 MiB L3 (Zen 4), while 32 MiB of f32 ran 1.21 ms streamed and 1.31–1.60 without.
pub fn streams_bytes(bytes: usize) -> bool {
    bytes >= streaming_threshold_bytes()
}

/// Where streaming starts: the last-level cache's size, at most 32 MiB. A VM on a server socket
/// sees the socket's whole L3 in sysfs (300 MiB on the 2-vCPU AMX Xeon), but shares it with cores
/// it cannot see, so outputs far smaller than that already miss it. There, at 4096x4096, three
/// alternations of every memory-bound op with the threshold at 32 MiB against 300 MiB: softmax
/// f32 4.75 against 6.81 ms best, bf16 3.58 against 7.25; log_softmax f32 4.63 / 7.75; add f32
/// 4.92 / 6.33, bf16 2.22 / 3.16; mul f32 2.81 / 5.68; rms_norm bf16 2.23 / 2.84; rope (1x32x2048x128)
/// f32 2.69 / 3.33; silu and gelu (4096x11008) level within the noise (0.85–1.03). Rows of
/// 2048x4096 crossed over at 16–32 MiB there as on Zen 4.
///
/// `UNIOP_STREAMING_THRESHOLD` (bytes, or with a `K`/`M`/`G` suffix), read once, overrides it: on
/// a machine whose share of the cache sysfs misstates, or to run every kernel's streaming stores
/// on small tensors (the shape sweep does, at 0, where its shapes and layouts reach the stores'
/// unaligned heads and partial tails that large dense tensors rarely do).
pub(crate) fn streaming_threshold_bytes() -> usize {
    static BYTES: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *BYTES.get_or_init(|| uniop::runtime::env_bytes("UNIOP_STREAMING_THRESHOLD").unwrap_or_else(cache_threshold_bytes))
}

/// The threshold where `UNIOP_STREAMING_THRESHOLD` is not set.
fn cache_threshold_bytes() -> usize {
    last_level_cache_bytes().min(32 << 20)
}

/// Whether a kernel writing one tensor like `t` should stream it past the cache ([`streams_bytes`]).
pub fn streams(t: &TensorMeta) -> bool {
    streams_bytes(t.numel() * t.dtype.size())
}

/// The largest data cache CPU 0 reports (Linux sysfs); 32 MiB where there is none to read (the L3
/// of the Zen 3/4 machines the kernels were tuned on).
fn last_level_cache_bytes() -> usize {
    let entries = std::fs::read_dir("/sys/devices/system/cpu/cpu0/cache").into_iter().flatten().flatten();
    let largest = entries.filter_map(|entry| {
        let kind = std::fs::read_to_string(entry.path().join("type")).ok()?;
        let size = std::fs::read_to_string(entry.path().join("size")).ok()?;
        (kind.trim() != "Instruction").then(|| uniop::runtime::parse_bytes(size.trim())).flatten()
    });
    largest.max().unwrap_or(32 << 20)
}

/// Copies `src` to `dst` (same length) with non-temporal stores when `dst` is 16-byte aligned
/// and a whole number of 16-byte units (the case for every full chunk of a row kernel on an
/// aligned buffer); otherwise with ordinary stores. Callers must [`fence`] before the block ends
/// so later launches see the data.
#[inline(always)]
pub fn copy_streaming<T: Element>(dst: &mut [T], src: &[T]) {
    assert_eq!(dst.len(), src.len());
    let bytes = std::mem::size_of_val(src);
    #[cfg(target_arch = "x86_64")]
    if (dst.as_ptr() as usize).is_multiple_of(16) && bytes.is_multiple_of(16) {
        use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_stream_si128};
        let (d, s) = (dst.as_mut_ptr() as *mut __m128i, src.as_ptr() as *const __m128i);
        for i in 0..bytes / 16 {
            // SAFETY: `i < bytes/16` keeps both pointers inside their slices; `d` is 16-byte
            // aligned as `_mm_stream_si128` requires; SSE2 is part of the x86-64 baseline.
            unsafe { _mm_stream_si128(d.add(i), _mm_loadu_si128(s.add(i))) };
        }
        return;
    }
    dst.copy_from_slice(src);
}

/// `src` copied to `dst` past the cache, a whole step: 64-byte non-temporal stores where `lines`
/// (the CPU has AVX-512, [`streams_lines`]) and `dst` starts a cache line, else
/// [`copy_streaming`]'s 16-byte ones. For steps that sit in memory anyway (f32 results staged in a
/// step array): each 16-byte load of the copy then waited on the step's 64-byte store (Zen 4,
/// 4096x4096, alternated: f32 log_softmax 6.0–6.2 → 5.2 ms, add 4.1–5.0 → 3.8–4.5, silu
/// (4096x11008) 7.7–7.9 → 7.4). Not for steps narrowed in registers ([`store_natively`]): storing
/// those to copy them 64 bytes at a time made bf16 softmax slower (2.65–2.72 → 3.10–3.12 ms).
#[inline(always)]
pub fn stream_step<T: Element>(dst: &mut [T; LANES], src: &[T; LANES], lines: bool) {
    #[cfg(target_arch = "x86_64")]
    if lines && (dst.as_ptr() as usize).is_multiple_of(64) {
        // SAFETY: `lines` only where AVX-512 was detected; `dst` is 64-byte aligned.
        unsafe { stream_step_avx512(dst, src) };
        return;
    }
    copy_streaming(dst, src);
}

/// Whether this CPU streams whole cache lines in [`stream_step`] (it has AVX-512). Asked once
/// before a loop, not per step: the check is a call (out of line the first time), and f32
/// rms_norm_backward at 4096x4096 (Zen 4), with [`stream_step`] in its step loop, ran 8.7 ms with
/// the check per step and 4.3 with it before the loop.
#[inline(always)]
pub fn streams_lines() -> bool {
    cfg!(target_arch = "x86_64") && crate::skinny::has_avx512()
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn stream_step_avx512<T: Element>(dst: &mut [T; LANES], src: &[T; LANES]) {
    use std::arch::x86_64::{__m512i, _mm512_loadu_si512, _mm512_stream_si512};
    const { assert!(std::mem::size_of::<[T; LANES]>().is_multiple_of(64)) };
    let (d, s) = (dst.as_mut_ptr() as *mut __m512i, src.as_ptr() as *const __m512i);
    for i in 0..std::mem::size_of::<[T; LANES]>() / 64 {
        _mm512_stream_si512(d.add(i), _mm512_loadu_si512(s.add(i)));
    }
}

/// A step buffer on the stack, aligned to a cache line, so that no vector load or store into it
/// splits a line or a page. Buffers that go through memory by design (staged for non-temporal
/// stores, or whole steps reread by a later loop) are wrapped in it: where the
/// stack happened to place them across a 4 KiB page boundary, the process ran slowly throughout —
/// bf16 softmax at 4096x4096 on one thread took 40 ms instead of 9.3 for the stack positions in a
/// window of about 256 bytes out of every 4 KiB (Zen 4, ASLR off, the stack shifted with
/// environment padding), so about one run in sixteen under ASLR.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
pub struct Aligned<A>(pub A);

impl<A> std::ops::Deref for Aligned<A> {
    type Target = A;
    #[inline(always)]
    fn deref(&self) -> &A {
        &self.0
    }
}

impl<A> std::ops::DerefMut for Aligned<A> {
    #[inline(always)]
    fn deref_mut(&mut self) -> &mut A {
        &mut self.0
    }
}

/// Starts loading the cache lines of `data` into L2 (a hint: never faults). L2, not L1: a row
/// kernel fetches its next row a whole row ahead, and in L1 those lines displaced the current
/// row's (4096x4096, alternated builds, best of 40: f32 layer_norm_backward 6.6–7.0 → 5.8–6.0 ms,
/// rms_norm_backward 6.8–7.2 → 5.7–6.2; the forwards and softmax level within the noise). The
/// L1 prefetcher brings the lines on from L2 as the row is walked.
#[inline(always)]
fn prefetch<T>(data: &[T]) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T1};
        let (ptr, bytes) = (data.as_ptr() as *const i8, std::mem::size_of_val(data));
        for off in (0..bytes).step_by(64) {
            // SAFETY: the address lies inside `data`; prefetches have no architectural effect.
            unsafe { _mm_prefetch::<_MM_HINT_T1>(ptr.add(off)) };
        }
    }
}

/// Prefetches `next` (the row a row kernel reads after the current one) in equal parts, one per
/// [`Ahead::step`]: called once per step of a compute-bound pass over the current row, it has
/// the next row on its way by the end of the pass, so memory and arithmetic overlap.
pub struct Ahead<'a, T> {
    parts: std::slice::Chunks<'a, T>,
}

impl<'a, T> Ahead<'a, T> {
    /// `steps`: how many times the pass will call [`Ahead::step`].
    #[inline(always)]
    pub fn new(next: &'a [T], steps: usize) -> Self {
        Ahead { parts: next.chunks(next.len().div_ceil(steps.max(1)).max(1)) }
    }

    #[inline(always)]
    pub fn step(&mut self) {
        if let Some(part) = self.parts.next() {
            prefetch(part);
        }
    }
}

/// Orders this thread's non-temporal stores before whatever it does next (completing a block).
#[inline(always)]
pub fn fence() {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: SSE is part of the x86-64 baseline.
    unsafe {
        std::arch::x86_64::_mm_sfence()
    }
}

/// Narrows f32 results into `dst`, streaming past the cache when `streaming`.
#[inline(always)]
pub fn narrow_into<T: FloatElement>(src: &[f32], dst: &mut [T], streaming: bool) {
    if !streaming {
        T::narrow(src, dst);
        return;
    }
    if let Some(dst) = T::as_f32_slice_mut(dst) {
        copy_streaming(dst, src);
        return;
    }
    let mut tmp = Aligned([T::default(); CHUNK]);
    for (s, d) in src.chunks(CHUNK).zip(dst.chunks_mut(CHUNK)) {
        T::narrow(s, &mut tmp[..s.len()]);
        copy_streaming(d, &tmp[..s.len()]);
    }
}

/// `f(x)` for one element, computed in f32, for a result stored as `T` (which lets the function
/// trade accuracy the storage cannot hold for speed: [`math::exp_for`](crate::math::exp_for)).
pub trait Map1: Send + Sync + 'static {
    fn apply<T: Element>(&self, x: f32) -> f32;
}

/// `f(a, b)` for one element, computed in f32, for a result stored as `T` (as [`Map1`]).
pub trait Map2: Send + Sync + 'static {
    fn apply<T: Element>(&self, a: f32, b: f32) -> f32;
}

/// Loads `dst.len()` elements starting at storage offset `off` with stride `stride`.
#[inline(always)]
pub fn load<T: FloatElement>(data: &[T], off: usize, stride: usize, dst: &mut [f32]) {
    match stride {
        1 => T::widen(&data[off..off + dst.len()], dst),
        0 => dst.fill(data[off].to_f32()),
        s => {
            for (j, d) in dst.iter_mut().enumerate() {
                *d = data[off + j * s].to_f32();
            }
        }
    }
}

/// Stores `src` at storage offset `off` with stride `stride` of `out`.
///
/// # Safety
/// The elements written must belong to the calling block alone.
#[inline(always)]
pub unsafe fn store<T: FloatElement>(out: &OutputView<'_>, off: usize, stride: usize, src: &[f32], streaming: bool) {
    if stride == 1 {
        narrow_into(src, out.slice_mut::<T>(off, src.len()), streaming);
    } else {
        let base = out.as_mut_ptr::<T>();
        for (j, &v) in src.iter().enumerate() {
            *base.add(off + j * stride) = T::from_f32(v);
        }
    }
}

/// Elements per step of the dense path: four AVX-512 registers. One register per step left
/// long-latency chains (exp, division) and the out-of-line bf16 narrowing unoverlapped —
/// bf16 silu ran 4× slower than f32; four independent registers per step hide that latency.
pub const LANES: usize = 64;

/// Loads `LANES` elements at `off`: dense (stride 1) or one broadcast value (stride 0).
#[inline(always)]
fn load_lanes<T: FloatElement>(data: &[T], off: usize, stride: usize, dst: &mut [f32; LANES]) {
    if stride == 1 {
        *dst = T::widen_lanes(data[off..off + LANES].try_into().expect("LANES elements"));
    } else {
        *dst = [data[off].to_f32(); LANES];
    }
}

/// `LANES` results narrowed by the CPU's instruction into `out` (`LANES` long); past the cache
/// when `streaming`. In registers ([`FloatElement::narrow_lanes_natively`] takes the lanes by
/// value): callers compute `src` in a step loop, where it need not touch memory at all. Through
/// memory (the narrowing instruction reloading the stored step, 8 lanes a load) bf16 layer_norm
/// took 0.071 ms against 0.054 now, add_backward's broadcast sum 0.058 against 0.030, softmax
/// 0.098 against 0.078–0.096 (one thread, 64x4096, Zen 4; f16 alike).
///
/// # Safety
/// Only where `T::converts_natively()` (see [`FloatElement::narrow_lanes_natively`]).
#[inline(always)]
pub unsafe fn store_natively<T: FloatElement>(src: &[f32; LANES], out: &mut [T], streaming: bool) {
    let out: &mut [T; LANES] = out.try_into().expect("LANES elements");
    let narrowed = T::narrow_lanes_natively(*src);
    if streaming {
        copy_streaming(out, &narrowed);
    } else {
        *out = narrowed;
    }
}

/// `LANES` results into `out` (`LANES` long), by the CPU's narrowing instruction when `NATIVE`
/// (only where `T::converts_natively()`), past the cache when `streaming`.
#[inline(always)]
pub fn store_step<T: FloatElement, const NATIVE: bool>(src: &[f32; LANES], out: &mut [T], streaming: bool) {
    if NATIVE {
        // SAFETY: `NATIVE` only where `T::converts_natively()` (the caller's contract).
        unsafe { store_natively(src, out, streaming) }
    } else {
        store_lanes(src, out, streaming)
    }
}

/// Stores `LANES` results into a dense output run, streaming past the cache when asked: 16 bytes
/// at a time, as [`copy_streaming`]. [`stream_step`]'s 64-byte stores, with their check made once
/// per row, ran level or slower here (Zen 4, 4096x4096 f32, best of 3, alternated, 16 / 64 bytes:
/// rms_norm_backward 4.2 / 4.3 ms, layer_norm_backward 4.6 / 5.3, layer_norm 2.4 / 2.4).
#[inline(always)]
fn store_lanes<T: FloatElement>(src: &[f32; LANES], dst: &mut [T], streaming: bool) {
    if streaming {
        copy_streaming(dst, &Aligned(T::narrow_lanes(src))[..]);
    } else {
        dst.copy_from_slice(&T::narrow_lanes(src));
    }
}

/// Whether [`dense_map`] runs `T` with `O` outputs in its per-element form rather than staged.
/// f32 always. f16/bf16 with one output on AVX-512 CPUs (32 vector registers, where the staged
/// form's step arrays make round trips through the stack instead): in cache on Zen 4, bf16
/// log_softmax ran 0.111 → 0.080 ms, add 0.030 → 0.026, mul 0.035 → 0.027, softmax_backward 0.049
/// → 0.040, swiglu 0.042 → 0.035, silu and gelu level; the two-output gradients stay staged
/// (silu_mul_backward ran 0.091 → 0.120 in the per-element form). On AVX2, f32 and bf16 take
/// `rows_avx2::map` instead (see `dense_map`), but for two-output f32 maps.
#[inline(always)]
pub fn converts_per_element<T: FloatElement, const O: usize>() -> bool {
    T::DTYPE == DType::F32 || (O == 1 && crate::skinny::has_avx512())
}

/// `f` elementwise over dense runs: `I` inputs, `O` equally long outputs; `f` maps one element's
/// inputs, widened to f32, to its outputs. Outputs are written past the cache when `streaming`.
///
/// Steps of [`LANES`] elements, in three forms (see [`converts_per_element`] and the choice below
/// for which runs where):
/// - native (bf16 on AVX512-BF16 CPUs, f16 on AVX-512 ones: [`FloatElement::converts_natively`]):
///   as per element, but into f32 step arrays that the CPU's instruction then narrows in
///   registers, one op per 16 lanes instead of nine integer ops (bf16); f16 inputs are widened
///   by `vcvtph2ps` too (one op per 16 lanes instead of about ten) — these loops are bound by
///   their op count.
///   In cache (Zen 4), bf16 silu 0.065 → 0.051 ms, add 0.024 → 0.016, swiglu_backward 0.056 →
///   0.040 (now level with f32), silu_mul_backward 0.091 → 0.083; f16 silu 0.103 → 0.051, add
///   0.056 → 0.017, silu_mul_backward 0.130 → 0.085 (the staged form, which it ran before with
///   native narrowing, 0.103), and at DRAM sizes f16 silu 16.7 → 10.4 ms, add 2.2 → 1.5.
///   bf16 results differ from the other forms' only where an f32 result is subnormal (below
///   1.2e-38 in magnitude): the instruction gives a zero of its sign. Checking for subnormals to
///   keep those bits too (`vfpclassps` per 8 lanes) cost the whole gain back (silu 0.059 →
///   0.068 ms). Narrowing in registers rather than from the stored step (one thread, 64x4096,
///   three alternations, bf16 and f16 alike): gelu 0.105 → 0.097 ms, silu 0.079 → 0.070, add
///   0.030 → 0.024, swiglu 0.044 → 0.038, silu_mul_backward 0.129 → 0.113; at 4096x11008 on two
///   threads bf16 gelu 9.6–11.0 → 9.0–9.5 ms, silu_mul_backward 12.1–15.0 → 10.9–11.0.
///   The norms' and softmax's row passes narrow this way too ([`store_natively`]) and widen
///   natively ([`to_f32`], [`widen_lanes`]).
/// - per element: one loop over single elements, from the inputs straight into the outputs,
///   which LLVM vectorizes with a register or two per value (f16/bf16 converted in the loop).
///   Staging whole steps in f32 arrays, as both forms once did, takes `LANES / 8` registers per
///   operand on AVX2: five operands spilled, and silu_mul_backward ran 1.28× slower in f32 and
///   1.48× in bf16 than now.
/// - staged (f16/bf16): inputs widened a whole step at a time, `f` over the f32 step in place,
///   results narrowed a whole step at a time. `f` runs on the two halves of the step side by
///   side, so each iteration holds two independent chains: on AVX2 (Zen 3) the loops are bound
///   by latency (the scheduler holds about two vectors' worth of waiting ops), and bf16
///   silu_mul_backward ran 0.193 → 0.153 ms, swiglu_backward 0.098 → 0.068 (in cache), where
///   the per-element form lengthened the chain (swiglu_backward and log_softmax_backward 10–20%
///   slower). The f32 form gained nothing from it (silu lost 30%: its loop then spills).
#[inline(always)]
pub fn dense_map<T: FloatElement, const I: usize, const O: usize>(
    ins: [&[T]; I],
    mut outs: [&mut [T]; O],
    streaming: bool,
    f: impl Fn([f32; I]) -> [f32; O],
) {
    // AVX2: 16 lanes an iteration (bf16 as even and odd elements) instead of 64-lane steps,
    // which spilled. 4096x11008, Zen 3, best of 10-15, alternated: bf16 silu 17.2-18.7 -> 15.5-15.9
    // ms, gelu 22.3-22.6 -> 19.7-20.0, f32 silu 20.5-27.1 -> 16.2-16.8, silu_backward 28.0-29.0 ->
    // 21.6-26.5; bf16 mul 4096x4096 4.1-4.4 -> 2.3-3.2 (measured with per-op-arity forms of this pass,
    // which the generic one ran level with). Two-output bf16 maps too, 64 lanes an iteration (figures
    // at `rows_avx2::map`). Two-output f32 maps keep the per-element form: the pass ran level at
    // DRAM sizes (silu_mul_backward 43.6-46.9 -> 45.5-48.4 ms) and slower in cache (0.235 -> 0.282).
    if (O == 1 || T::DTYPE == DType::BF16) && crate::rows_avx2::applies::<T>() {
        return crate::rows_avx2::map(ins, outs, streaming, &f);
    }
    let n = outs[0].len();
    const { assert!(O <= I, "dense_map writes output k over input k's widened step") };
    let mut steps = Steps { wide: [[0f32; LANES]; I], staged: [[T::default(); LANES]; O], lines: streams_lines() };
    let full = n / LANES * LANES;
    // Loops chosen once: a branch inside one loop would leave the native conversions' calls (not
    // inlined where the CPU lacks the instructions) in every kernel's loop. The native form gets
    // `streaming` as a constant, one loop per store path: as a runtime flag, LLVM chose each
    // narrowed store's destination (output or staging buffer) with a `cmov`, and streamed
    // one-input bf16 maps ran faster in the per-element form; with the constant they run faster
    // natively (4096x11008, Zen 4, three alternations: silu 11.8 → 9.3 ms, gelu 11.7 → 9.4,
    // cross_entropy_backward (2048x32000) 15.7 → 12.2, log_softmax 4.8 → 4.4, softmax_backward
    // 2.6 → 2.0). The f32 per-element form keeps the runtime flag: with a constant, LLVM fused
    // its staging copy into the loop and silu ran 8.2 → 9.4 ms. The per-element and staged forms
    // are chosen here too (the check is a call, see `streams_lines`).
    match (T::converts_natively(), streaming, converts_per_element::<T, O>()) {
        (true, true, _) => steps.walk::<true, false>(ins, &mut outs, full, true, &f),
        (true, false, _) => steps.walk::<true, false>(ins, &mut outs, full, false, &f),
        (false, _, true) => steps.walk::<false, true>(ins, &mut outs, full, streaming, &f),
        (false, _, false) => steps.walk::<false, false>(ins, &mut outs, full, streaming, &f),
    }
    if full < n {
        // One step, in the per-element form (the staged form's results are the same).
        let last = ins.map(|run| padded(&run[full..n], T::default()));
        let mut tail = [[T::default(); LANES]; O];
        steps.run::<false, true>(last.each_ref(), tail.each_mut(), false, &f);
        for (dst, src) in outs.iter_mut().zip(&tail) {
            dst[full..].copy_from_slice(&src[..n - full]);
        }
    }
}

/// The step buffers of [`dense_map`], kept across steps so that none is re-initialized per step;
/// aligned as [`Aligned`] is (each buffer is a whole number of cache lines).
#[repr(C, align(64))]
struct Steps<T, const I: usize, const O: usize> {
    /// The staged form: the inputs widened, then overwritten by `f`'s results (output `k` in
    /// `wide[k]`); a separate results buffer measured slower.
    wide: [[f32; LANES]; I],
    /// Results in `T`: f16/bf16 ones narrowed, and f32 ones on their way to non-temporal stores.
    staged: [[T; LANES]; O],
    /// Whether streamed steps store whole cache lines ([`streams_lines`]), asked once per map.
    lines: bool,
}

impl<T: FloatElement, const I: usize, const O: usize> Steps<T, I, O> {
    /// The whole steps of [`dense_map`], the first `full` elements.
    #[inline(always)]
    fn walk<const NATIVE: bool, const PER_ELEMENT: bool>(
        &mut self,
        ins: [&[T]; I],
        outs: &mut [&mut [T]; O],
        full: usize,
        streaming: bool,
        f: &impl Fn([f32; I]) -> [f32; O],
    ) {
        for j in (0..full).step_by(LANES) {
            let step = ins.map(|run| run[j..j + LANES].try_into().expect("LANES elements"));
            let dst = outs.each_mut().map(|out| (&mut out[j..j + LANES]).try_into().expect("LANES elements"));
            self.run::<NATIVE, PER_ELEMENT>(step, dst, streaming, f);
        }
    }

    /// One step of [`dense_map`]: `LANES` elements through `f` into `outs`; `NATIVE`: converted
    /// by the CPU's instructions ([`FloatElement::narrow_lanes_natively`], [`to_f32`]) — only
    /// where `T::converts_natively()` (the caller checks it once per map); else in the
    /// per-element form where `PER_ELEMENT`, the staged one otherwise.
    #[inline(always)]
    fn run<const NATIVE: bool, const PER_ELEMENT: bool>(
        &mut self,
        ins: [&[T; LANES]; I],
        mut outs: [&mut [T; LANES]; O],
        streaming: bool,
        f: &impl Fn([f32; I]) -> [f32; O],
    ) {
        if NATIVE {
            // Inputs widened per element (f16: vectorized to `vcvtph2ps`), results in f32 first,
            // then narrowed a step at a time by the CPU's instruction, in registers (a step array
            // in `self` kept them in memory: stored, then reloaded to narrow).
            let mut results = [[0f32; LANES]; O];
            for i in 0..LANES {
                let mut x = [0f32; I];
                for (x, step) in x.iter_mut().zip(&ins) {
                    *x = to_f32::<T, true>(step[i]);
                }
                for (wide, r) in results.iter_mut().zip(f(x)) {
                    wide[i] = r;
                }
            }
            for (out, wide) in outs.iter_mut().zip(&results) {
                // SAFETY: `NATIVE` only where `dense_map` found `T::converts_natively()`.
                unsafe { store_natively(wide, &mut out[..], streaming) };
            }
            return;
        } else if PER_ELEMENT {
            let mut targets = if streaming { self.staged.each_mut() } else { outs.each_mut().map(|out| &mut **out) };
            // Plain loops build the per-element arrays (not `map`/`from_fn`, which the compiler
            // may leave out of line, built for the baseline target: see `widen_lanes`).
            for i in 0..LANES {
                let mut x = [0f32; I];
                for (x, step) in x.iter_mut().zip(&ins) {
                    *x = step[i].to_f32();
                }
                let r = f(x);
                for (out, r) in targets.iter_mut().zip(r) {
                    out[i] = T::from_f32(r);
                }
            }
        } else {
            for (wide, step) in self.wide.iter_mut().zip(ins) {
                *wide = T::widen_lanes(step);
            }
            const HALF: usize = LANES / 2;
            for i in 0..HALF {
                let (mut x, mut y) = ([0f32; I], [0f32; I]);
                for ((x, y), wide) in x.iter_mut().zip(&mut y).zip(&self.wide) {
                    *x = wide[i];
                    *y = wide[i + HALF];
                }
                let (r, q) = (f(x), f(y));
                for (k, (r, q)) in r.into_iter().zip(q).enumerate() {
                    self.wide[k][i] = r;
                    self.wide[k][i + HALF] = q;
                }
            }
            for (staged, r) in self.staged.iter_mut().zip(&self.wide) {
                *staged = T::narrow_lanes(r);
            }
            if !streaming {
                for (out, staged) in outs.iter_mut().zip(&self.staged) {
                    **out = *staged;
                }
            }
        }
        if streaming {
            for (out, staged) in outs.iter_mut().zip(&self.staged) {
                stream_step(out, staged, self.lines);
            }
        }
    }
}

/// Calls `f` on equally long `rows` widened to f32, `LANES` elements at a time. In the last,
/// shorter step the lanes past the end hold `pad` — the reduction's neutral value (0 for a sum,
/// −∞ for a maximum; exact in every float type) — so `f` always sees whole steps: its loops have
/// a constant length once inlined and its accumulators stay in registers. (With a runtime length
/// they lived in memory, and each step waited for the previous step's stores.)
#[inline(always)]
pub fn for_lanes<T: FloatElement, const N: usize>(rows: [&[T]; N], pad: f32, f: impl FnMut(&[[f32; LANES]; N])) {
    if T::converts_natively() {
        for_lanes_as::<T, N, true>(rows, pad, f)
    } else {
        for_lanes_as::<T, N, false>(rows, pad, f)
    }
}

#[inline(always)]
fn for_lanes_as<T: FloatElement, const N: usize, const NATIVE: bool>(
    rows: [&[T]; N],
    pad: f32,
    mut f: impl FnMut(&[[f32; LANES]; N]),
) {
    let mut buf = [[0f32; LANES]; N];
    let n = rows[0].len();
    let full = n / LANES * LANES;
    for j in (0..full).step_by(LANES) {
        for k in 0..N {
            buf[k] = widen_lanes::<T, NATIVE, LANES>(rows[k][j..j + LANES].try_into().expect("LANES elements"));
        }
        f(&buf);
    }
    if full < n {
        for k in 0..N {
            buf[k] = widen_lanes::<T, NATIVE, LANES>(&padded(&rows[k][full..], T::from_f32(pad)));
        }
        f(&buf);
    }
}

/// `x` widened to f32, by the CPU's instruction when `NATIVE`
/// ([`FloatElement::to_f32_natively`]; in an element loop LLVM vectorizes f16's to `vcvtph2ps`).
///
/// The `NATIVE` forms of the helpers here are chosen once per loop: row helpers take the
/// `converts_natively` branch at their top and run a loop generic over `NATIVE`, since a choice
/// per step keeps the step's lanes in memory. `NATIVE` is `T::converts_natively()` — the safety
/// condition of the `*_natively` conversions; a kernel that widens a second element type with
/// the same choice asserts [`converts_with`].
#[inline(always)]
pub fn to_f32<T: FloatElement, const NATIVE: bool>(x: T) -> f32 {
    if NATIVE {
        // SAFETY: `NATIVE` only where `T::converts_natively()` (see above).
        unsafe { x.to_f32_natively() }
    } else {
        x.to_f32()
    }
}

/// `src` widened by the CPU's instruction when `NATIVE` (see [`to_f32`]), else by
/// [`FloatElement::widen_lanes`].
#[inline(always)]
pub fn widen_lanes<T: FloatElement, const NATIVE: bool, const N: usize>(src: &[T; N]) -> [f32; N] {
    if NATIVE {
        // SAFETY: as in `to_f32`.
        unsafe { T::widen_lanes_natively(src) }
    } else {
        T::widen_lanes(src)
    }
}

/// Whether `U` may be widened with the `NATIVE` choice made for `T`: it is `T`, or f32, whose
/// native widening is its plain one. For kernels with a second element type (rope's cos/sin,
/// rms_norm_backward's weight), as a compile-time assertion.
pub const fn converts_with<T: Element, U: Element>() -> bool {
    U::DTYPE as u8 == T::DTYPE as u8 || U::DTYPE as u8 == DType::F32 as u8
}

/// Up to `N` elements widened into a whole step (lanes past `src` are 0), by value, natively
/// when `NATIVE` (see [`widen_lanes`]). `N` is [`LANES`] except where a narrower step divides a
/// row exactly (see `rope`).
#[inline(always)]
pub fn widen_step<T: FloatElement, const NATIVE: bool, const N: usize>(src: &[T]) -> [f32; N] {
    match src.try_into() {
        Ok(whole) => widen_lanes::<T, NATIVE, N>(whole),
        Err(_) => widen_lanes::<T, NATIVE, N>(&padded(src, T::default())),
    }
}

/// The first `dst.len()` (≤ `N`, a multiple of 16) lanes of a step, narrowed into `dst` — by the
/// CPU's instruction when `NATIVE` (see [`to_f32`]; bf16's `vcvtneps2bf16`, where
/// [`FloatElement::narrow_lanes`] rounds in integer ops and checks the CPU on every call: rope's
/// head-dim-64 rows spent most of their time there).
#[inline(always)]
pub fn narrow_step<T: FloatElement, const NATIVE: bool, const N: usize>(src: &[f32; N], dst: &mut [T]) {
    let narrow = |whole: &mut [T; N]| {
        if NATIVE {
            // SAFETY: `NATIVE` only where `T::converts_natively()` (see `to_f32`).
            unsafe { *whole = T::narrow_lanes_natively(*src) }
        } else {
            *whole = T::narrow_lanes(src);
        }
    };
    if dst.len() == N {
        narrow(dst.try_into().expect("a whole step"));
    } else {
        let mut whole = [T::default(); N];
        narrow(&mut whole);
        let n = dst.len();
        dst.copy_from_slice(&whole[..n]);
    }
}

/// A row's last, partial step as a whole one, the lanes past its end set to `pad`. Kernels then
/// handle every lane array by value (whole-array loads and stores), which lets them live in
/// registers; one slice access with a runtime length keeps an array in memory for the whole loop.
#[inline(always)]
fn padded<T: Element, const N: usize>(tail: &[T], pad: T) -> [T; N] {
    let mut step = [pad; N];
    step[..tail.len()].copy_from_slice(tail);
    step
}

/// Elements `range` of contiguous input `i` (the plan asked for [`LayoutNeed::Contiguous`]).
///
/// [`LayoutNeed::Contiguous`]: uniop::LayoutNeed::Contiguous
pub fn dense_input<T: Element>(args: &KernelArgs, i: usize, range: std::ops::Range<usize>) -> &[T] {
    let t = args.input(i);
    &t.storage::<T>().expect("dtype dispatched at plan time")[t.layout().offset() + range.start..][..range.len()]
}

/// Elements `range` of contiguous output `o`.
///
/// # Safety
/// No other block may access these elements during the launch.
#[allow(clippy::mut_from_ref)]
pub unsafe fn dense_output<T: Element>(args: &KernelArgs, o: usize, range: std::ops::Range<usize>) -> &mut [T] {
    let out = args.output(o);
    out.slice_mut::<T>(out.layout().offset() + range.start, range.len())
}

/// Whether a run can take the register-at-a-time path: dense output, inputs dense or broadcast.
#[inline(always)]
fn dense_run<const N: usize>(strides: [usize; N]) -> bool {
    strides[0] == 1 && strides[1..].iter().all(|&s| s <= 1)
}

/// `out = f(x)` elementwise over this block's share of the output (input 0 to output 0).
#[inline(always)]
pub fn unary<T: FloatElement, F: Map1>(args: &KernelArgs, ctx: BlockCtx, f: &F, streaming: bool) {
    unary_at::<T, F>(args, ctx, 0, 0, f, streaming)
}

crate::simd_kernel! {
/// [`unary`] from input `x` to output `o`: for ops with several inputs or outputs.
pub fn unary_at<T: FloatElement, F: Map1>(args: &KernelArgs, ctx: BlockCtx, x: usize, o: usize, f: &F, streaming: bool) {
    let (x, out) = (args.input(x), args.output(o));
    let runs = StridedRuns::<2>::new([out.layout(), x.layout()]);
    let range = ctx.split(runs.numel());
    let data = x.storage::<T>().expect("dtype dispatched at plan time");
    let strides = runs.inner_strides();
    let [so, sx] = strides;
    let mut buf = [0f32; CHUNK];
    for ([o, xo], len) in runs.runs(range.start, range.end) {
        let mut j = 0;
        if dense_run(strides) {
            // SAFETY: blocks own disjoint ranges of output elements.
            let dst = unsafe { out.slice_mut::<T>(o, len) };
            if sx == 1 && (converts_per_element::<T, 1>() || crate::rows_avx2::applies::<T>()) {
                dense_map([&data[xo..xo + len]], [dst], streaming, |[x]| [f.apply::<T>(x)]);
                continue;
            }
            let mut lanes = [0f32; LANES];
            while j + LANES <= len {
                load_lanes(data, xo + j * sx, sx, &mut lanes);
                for x in &mut lanes {
                    *x = f.apply::<T>(*x);
                }
                store_lanes(&lanes, &mut dst[j..j + LANES], streaming);
                j += LANES;
            }
        }
        while j < len {
            let n = CHUNK.min(len - j);
            load(data, xo + j * sx, sx, &mut buf[..n]);
            for x in &mut buf[..n] {
                *x = f.apply::<T>(*x);
            }
            // SAFETY: blocks own disjoint ranges of output elements.
            unsafe { store::<T>(&out, o + j * so, so, &buf[..n], streaming) };
            j += n;
        }
    }
    fence();
}
}

/// `out = f(a, b)` elementwise, `a` and `b` (inputs 0 and 1) broadcast to the output's shape.
#[inline(always)]
pub fn binary<T: FloatElement, F: Map2>(args: &KernelArgs, ctx: BlockCtx, f: &F, streaming: bool) {
    binary_at::<T, F>(args, ctx, [0, 1], 0, f, streaming)
}

crate::simd_kernel! {
/// [`binary`] of inputs `[a, b]` into output `o`: for ops with more inputs or outputs.
pub fn binary_at<T: FloatElement, F: Map2>(
    args: &KernelArgs,
    ctx: BlockCtx,
    ab: [usize; 2],
    o: usize,
    f: &F,
    streaming: bool,
) {
    let (a, b, out) = (args.input(ab[0]), args.input(ab[1]), args.output(o));
    let runs = StridedRuns::broadcast(out.layout().shape(), 0, [out.layout(), a.layout(), b.layout()]);
    let range = ctx.split(runs.numel());
    let (da, db) = (a.storage::<T>().expect("dtype dispatched"), b.storage::<T>().expect("dtype dispatched"));
    let strides = runs.inner_strides();
    let [so, sa, sb] = strides;
    let mut bufa = [0f32; CHUNK];
    let mut bufb = [0f32; CHUNK];
    for ([o, ao, bo], len) in runs.runs(range.start, range.end) {
        let mut j = 0;
        if dense_run(strides) {
            // SAFETY: blocks own disjoint ranges of output elements.
            let dst = unsafe { out.slice_mut::<T>(o, len) };
            if converts_per_element::<T, 1>() || crate::rows_avx2::applies::<T>() {
                // Both dense, or one a value repeated along the run (a row's bias or scale).
                match (sa, sb) {
                    (1, 1) => {
                        let ins = [&da[ao..ao + len], &db[bo..bo + len]];
                        dense_map(ins, [dst], streaming, |[a, b]| [f.apply::<T>(a, b)]);
                        continue;
                    }
                    (1, 0) => {
                        let b = db[bo].to_f32();
                        dense_map([&da[ao..ao + len]], [dst], streaming, |[a]| [f.apply::<T>(a, b)]);
                        continue;
                    }
                    (0, 1) => {
                        let a = da[ao].to_f32();
                        dense_map([&db[bo..bo + len]], [dst], streaming, |[b]| [f.apply::<T>(a, b)]);
                        continue;
                    }
                    _ => {}
                }
            }
            let (mut la, mut lb) = ([0f32; LANES], [0f32; LANES]);
            while j + LANES <= len {
                load_lanes(da, ao + j * sa, sa, &mut la);
                load_lanes(db, bo + j * sb, sb, &mut lb);
                for (a, &b) in la.iter_mut().zip(&lb) {
                    *a = f.apply::<T>(*a, b);
                }
                store_lanes(&la, &mut dst[j..j + LANES], streaming);
                j += LANES;
            }
        }
        while j < len {
            let n = CHUNK.min(len - j);
            load(da, ao + j * sa, sa, &mut bufa[..n]);
            load(db, bo + j * sb, sb, &mut bufb[..n]);
            for (a, &b) in bufa[..n].iter_mut().zip(&bufb[..n]) {
                *a = f.apply::<T>(*a, b);
            }
            // SAFETY: blocks own disjoint ranges of output elements.
            unsafe { store::<T>(&out, o + j * so, so, &bufa[..n], streaming) };
            j += n;
        }
    }
    fence();
}
}

/// The broadcast shape of inputs `a` and `b`, or the error naming `b`.
pub fn broadcast_inputs(cx: &OpCx, a: &str, b: &str) -> Result<Vec<usize>> {
    let (sa, sb) = (cx.input(a).shape(), cx.input(b).shape());
    broadcast_shapes(sa, sb).ok_or_else(|| {
        cx.err(ErrorCode::Shape, b, format!("a shape broadcastable with {a}'s {}", ShapeDisplay(sa)), ShapeDisplay(sb))
    })
}

/// f64 reference of a broadcasting binary op.
pub fn reference_binary(a: &RefTensor, b: &RefTensor, f: impl Fn(f64, f64) -> f64) -> Result<RefTensor> {
    let shape =
        broadcast_shapes(&a.shape, &b.shape).ok_or_else(|| Error::internal("reference: shapes do not broadcast"))?;
    let n = shape.iter().product();
    Ok(RefTensor::new(&shape, (0..n).map(|i| f(a.broadcast_get(&shape, i), b.broadcast_get(&shape, i))).collect()))
}

/// Broadcast of an input layout that `infer` already checked.
pub fn broadcast(layout: &Layout, shape: &[usize]) -> Layout {
    layout.broadcast_to(shape).expect("broadcast checked by infer")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The streamed store paths (taken by outputs larger than the cache, which the op tests do
    /// not reach) write exactly what the cached ones write: one and two inputs, two outputs, a
    /// tail, and an output start that is not 16-byte aligned (ordinary stores then).
    #[test]
    fn streamed_maps_write_what_cached_ones_write() {
        fn check<T: FloatElement>() {
            let n = 1000;
            let mut rng = uniop::verify::Rng::new(7);
            let a: Vec<T> = (0..n).map(|_| T::from_f64(4.0 * rng.uniform() - 2.0)).collect();
            let b: Vec<T> = (0..n).map(|_| T::from_f64(4.0 * rng.uniform() - 2.0)).collect();
            let mut bufs = [vec![T::default(); n + 64], vec![T::default(); n + 64]];
            for shift in [0, 1] {
                let mut got = Vec::new();
                for streaming in [false, true] {
                    let [x, y] = &mut bufs;
                    let at = x.as_ptr().align_offset(64) + shift;
                    let (x, y) = (&mut x[at..at + n - shift], &mut y[..n - shift]);
                    let (a, b) = (&a[..n - shift], &b[..n - shift]);
                    let unwritten = T::from_f64(f64::NAN);
                    x.fill(unwritten);
                    dense_map([a], [&mut *x], streaming, |[v]| [crate::math::exp(v) - v]);
                    let one = x.to_vec();
                    x.fill(unwritten);
                    y.fill(unwritten);
                    dense_map([a, b], [&mut *x, &mut *y], streaming, |[u, v]| [u * v - 1.0, u / (1.0 + v * v)]);
                    got.push([one, x.to_vec(), y.to_vec()]);
                }
                let bits = |runs: &[Vec<T>; 3]| {
                    runs.each_ref().map(|r| r.iter().map(|v| v.to_f64().to_bits()).collect::<Vec<_>>())
                };
                assert_eq!(bits(&got[0]), bits(&got[1]), "{} shift {shift}", T::DTYPE);
                let want = (crate::math::exp(a[3].to_f32()) - a[3].to_f32()) as f64;
                assert!((got[0][0][3].to_f64() - want).abs() <= 0.01 * want.abs().max(1.0), "{}", T::DTYPE);
            }
        }
        check::<f32>();
        check::<uniop::half::f16>();
        check::<uniop::half::bf16>();
    }

    #[test]
    fn outputs_stream_from_the_cache_size_up_to_32_mib() {
        let (by_cache, llc) = (cache_threshold_bytes(), last_level_cache_bytes());
        assert!(by_cache > 0 && by_cache <= llc && by_cache <= 32 << 20, "threshold {by_cache}, cache {llc}");
        let threshold = streaming_threshold_bytes(); // by_cache, unless UNIOP_STREAMING_THRESHOLD is set
        assert!(streams_bytes(threshold) && (threshold == 0 || !streams_bytes(threshold - 1)));
    }
}
