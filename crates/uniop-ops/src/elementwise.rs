//! Shared machinery for elementwise float kernels: operands are walked as strided runs
//! ([`StridedRuns`]), staged through fixed f32 chunks (so f16/bf16 compute in f32 and contiguous
//! runs vectorize), and the op supplies only the chunk computation as a [`Map1`]/[`Map2`].
//!
//! Why traits instead of closures: kernels are compiled once per instruction set
//! ([`simd_kernel!`](crate::simd_kernel)), and only code *inlined* into those copies gets wide
//! vectors. A trait method marked `#[inline(always)]` is guaranteed to be; a closure is not.

use uniop::{BlockCtx, FloatElement, KernelArgs, Layout, OutputView, StridedRuns};

pub const CHUNK: usize = 64;

/// `v[i] = f(v[i])` over one chunk.
pub trait Map1: Send + Sync + 'static {
    fn apply(&self, v: &mut [f32]);
}

/// `a[i] = f(a[i], b[i])` over one chunk.
pub trait Map2: Send + Sync + 'static {
    fn apply(&self, a: &mut [f32], b: &[f32]);
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
pub unsafe fn store<T: FloatElement>(out: &OutputView<'_>, off: usize, stride: usize, src: &[f32]) {
    if stride == 1 {
        T::narrow(src, out.slice_mut::<T>(off, src.len()));
    } else {
        let base = out.as_mut_ptr::<T>();
        for (j, &v) in src.iter().enumerate() {
            *base.add(off + j * stride) = T::from_f32(v);
        }
    }
}

crate::simd_kernel! {
/// `out = f(x)` elementwise over this block's share of the output.
pub fn unary<T: FloatElement, F: Map1>(args: &KernelArgs, ctx: BlockCtx, f: &F) {
    let (x, out) = (args.input(0), args.output(0));
    let runs = StridedRuns::<2>::new([out.layout(), x.layout()]);
    let range = ctx.split(runs.numel());
    let data = x.storage::<T>().expect("dtype dispatched at plan time");
    let [so, sx] = runs.inner_strides();
    let mut buf = [0f32; CHUNK];
    runs.for_each_run(range.start, range.end, |[o, xo], len| {
        let mut j = 0;
        while j < len {
            let n = CHUNK.min(len - j);
            load(data, xo + j * sx, sx, &mut buf[..n]);
            f.apply(&mut buf[..n]);
            // SAFETY: blocks own disjoint ranges of output elements.
            unsafe { store::<T>(&out, o + j * so, so, &buf[..n]) };
            j += n;
        }
    });
}
}

crate::simd_kernel! {
/// `out = f(a, b)` elementwise, `a` and `b` broadcast to the output's shape.
pub fn binary<T: FloatElement, F: Map2>(args: &KernelArgs, ctx: BlockCtx, f: &F) {
    let (a, b, out) = (args.input(0), args.input(1), args.output(0));
    let shape = out.layout().shape();
    let la = broadcast(a.layout(), shape);
    let lb = broadcast(b.layout(), shape);
    let runs = StridedRuns::<3>::new([out.layout(), &la, &lb]);
    let range = ctx.split(runs.numel());
    let (da, db) = (a.storage::<T>().expect("dtype dispatched"), b.storage::<T>().expect("dtype dispatched"));
    let [so, sa, sb] = runs.inner_strides();
    let mut bufa = [0f32; CHUNK];
    let mut bufb = [0f32; CHUNK];
    runs.for_each_run(range.start, range.end, |[o, ao, bo], len| {
        let mut j = 0;
        while j < len {
            let n = CHUNK.min(len - j);
            load(da, ao + j * sa, sa, &mut bufa[..n]);
            load(db, bo + j * sb, sb, &mut bufb[..n]);
            f.apply(&mut bufa[..n], &bufb[..n]);
            // SAFETY: blocks own disjoint ranges of output elements.
            unsafe { store::<T>(&out, o + j * so, so, &bufa[..n]) };
            j += n;
        }
    });
}
}

/// Broadcast of an input layout that `infer` already checked.
pub fn broadcast(layout: &Layout, shape: &[usize]) -> Layout {
    layout.broadcast_to(shape).expect("broadcast checked by infer")
}
