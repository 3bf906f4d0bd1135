//! `softmax(x, dim=-1)` and `log_softmax(x, dim=-1)`: one kernel family, two ops.
//!
//! The tensor is viewed as `[outer, n, inner]` around `dim` (the executor makes it contiguous).
//! The usual case, `dim = -1` (`inner = 1`), reduces along dense rows; other dims reduce across
//! rows with `LANES` columns of `inner` at a time, so both vectorize. Each slice is read three
//! times (max, sum of exp, write) but only the first read misses cache for LLM-sized rows.
//! Numerically stable: `exp(x − max)`. A slice that is all `-inf` gives NaN, as in torch.

use crate::elementwise::{
    converts_per_element, dense_map, fence, for_lanes, store_natively, stream_step, streams, streams_lines,
    widen_lanes, Ahead, Aligned, LANES,
};
use crate::math;
use uniop::{
    block_dim_for, with_float_dtype, BlockCtx, DType, ErrorCode, Example, FloatElement, KernelArgs, LayoutNeed, Op,
    OpCx, Plan, RefTensor, Result, Step, TensorMeta,
};

pub(crate) const DTYPES: &[DType] = &[DType::F32, DType::F16, DType::BF16];

/// `x` viewed as `[outer, n, inner]` around the reduced dim.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Axis {
    pub outer: usize,
    pub n: usize,
    pub inner: usize,
}

impl Axis {
    pub fn of(cx: &OpCx, x: &str) -> Result<Axis> {
        let shape = cx.input(x).shape();
        let rank = shape.len().max(1) as i64;
        let dim = cx.int("dim");
        if !(-rank..rank).contains(&dim) {
            return Err(cx.err(ErrorCode::ParamInvalid, "dim", format!("a dim in [-{rank}, {rank}) for {x}"), dim));
        }
        if shape.is_empty() {
            return Ok(Axis { outer: 1, n: 1, inner: 1 });
        }
        let d = dim.rem_euclid(rank) as usize;
        Ok(Axis { outer: shape[..d].iter().product(), n: shape[d], inner: shape[d + 1..].iter().product() })
    }

    /// Independent slices: one per (outer, inner) position.
    pub fn slices(&self) -> usize {
        self.outer * self.inner
    }

    /// Units of work: whole rows when `inner == 1`, else groups of `LANES` neighbouring slices
    /// (same outer index, consecutive inner indices) reduced side by side.
    pub fn units(&self) -> usize {
        if self.inner == 1 {
            self.outer
        } else {
            self.outer * self.inner.div_ceil(LANES)
        }
    }

    /// For group `g` (when `inner > 1`): its width `w` and the storage index of element `k` of
    /// its first slice (the group's slices are the `w` consecutive indices from there).
    pub fn group(&self, g: usize) -> (usize, impl Fn(usize) -> usize + '_) {
        let per_outer = self.inner.div_ceil(LANES);
        let (o, i0) = (g / per_outer, (g % per_outer) * LANES);
        (LANES.min(self.inner - i0), move |k| (o * self.n + k) * self.inner + i0)
    }

    /// Storage index of element `k` of slice `s` (contiguous layout).
    pub fn index(&self, s: usize, k: usize) -> usize {
        let (o, i) = (s / self.inner, s % self.inner);
        (o * self.n + k) * self.inner + i
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Softmax,
    LogSoftmax,
}

/// Row maximum, `LANES` partial maxima at a time. Compared with `>` rather than `f32::max`: one
/// `vmaxps` a vector where `max` adds a NaN fix-up; NaN elements are skipped all the same (a
/// partial maximum starts at −∞ and only ever takes a larger number).
#[inline(always)]
pub(crate) fn row_max<T: FloatElement>(row: &[T]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if crate::rows_avx2::applies::<T>() {
        return crate::rows_avx2::row_max(row);
    }
    let mut mx = [f32::NEG_INFINITY; LANES];
    for_lanes([row], f32::NEG_INFINITY, |[b]| {
        for (m, &v) in mx.iter_mut().zip(b) {
            *m = if v > *m { v } else { *m };
        }
    });
    math::max_lanes(mx)
}

/// `out = src · scale`, narrowed to `T`, `LANES` at a time; past the cache when `streaming`
/// (outputs too large to stay there: the stores then skip reading each line first). `src` may be
/// longer than `out` (a padded scratch row, see [`exp_into`]); its first `out.len()` are scaled.
#[inline(always)]
pub(crate) fn scale_into<T: FloatElement>(src: &[f32], out: &mut [T], scale: f32, streaming: bool) {
    #[cfg(target_arch = "x86_64")]
    if crate::rows_avx2::applies::<T>() {
        return crate::rows_avx2::scale_into(src, out, scale, streaming);
    }
    let src = &src[..out.len()];
    if T::converts_natively() {
        // Whole steps narrowed by the CPU's instruction (a loop of its own: see `dense_map`). In
        // cache (Zen 4), f16 softmax 0.078 → 0.066 ms, bf16 level; at 4096x4096 f16 4.97 → 3.82.
        let chunks = src.chunks_exact(LANES);
        let full = src.len() - chunks.remainder().len();
        for (c, o) in chunks.zip(out.chunks_exact_mut(LANES)) {
            let mut scaled = Aligned([0f32; LANES]);
            for (s, &v) in scaled.iter_mut().zip(c) {
                *s = v * scale;
            }
            // SAFETY: `converts_natively` was checked above.
            unsafe { store_natively(&scaled, o, streaming) };
        }
        for (o, &v) in out[full..].iter_mut().zip(&src[full..]) {
            *o = T::from_f32(v * scale);
        }
        return;
    }
    if !streaming && converts_per_element::<T, 1>() {
        // Narrowed in registers, as dense_map's per-element form: staging each step in an array
        // cost bf16 softmax a quarter of its time in cache, in store-forwarding stalls (Zen 4).
        for (o, &v) in out.iter_mut().zip(src) {
            *o = T::from_f32(v * scale);
        }
        return;
    }
    let chunks = src.chunks_exact(LANES);
    let tail = chunks.remainder();
    let full = src.len() - tail.len();
    let (per_element, lines) = (converts_per_element::<T, 1>(), streams_lines());
    for (c, o) in chunks.zip(out.chunks_exact_mut(LANES)) {
        let narrowed = if per_element {
            let mut narrowed = Aligned([T::default(); LANES]);
            for (n, &v) in narrowed.iter_mut().zip(c) {
                *n = T::from_f32(v * scale);
            }
            narrowed
        } else {
            let mut scaled = Aligned([0f32; LANES]);
            for (s, &v) in scaled.iter_mut().zip(c) {
                *s = v * scale;
            }
            Aligned(T::narrow_lanes(&scaled))
        };
        if streaming {
            stream_step(o.try_into().expect("LANES elements"), &narrowed, lines);
        } else {
            o.copy_from_slice(&narrowed[..]);
        }
    }
    for (o, &v) in out[full..].iter_mut().zip(tail) {
        *o = T::from_f32(v * scale);
    }
}

/// `out = exp(row − m)` in f32 (`out` at least as long as `row`; past the row it may be written
/// with anything: a scratch row padded to [`SCRATCH_LANES`] takes the row's last exps as one
/// whole vector, which [`scale_into`] reads back as one — masked stores and loads there had the
/// load wait for the store to retire, most of the time of short rows, Zen 3); returns
/// `Σ exp(row − m)`.
///
/// This pass is compute-bound and touches no new memory, so it prefetches `next` (the row the
/// caller reads after this one, or nothing): memory then streams while the exps run, instead of
/// only during the cheap max pass that comes first.
#[inline(always)]
pub(crate) fn exp_into<T: FloatElement>(row: &[T], out: &mut [f32], m: f32, next: &[T]) -> f32 {
    exp_sum::<T, true>(row, out, m, next)
}

/// `Σ exp(row − m)` alone, for log_softmax and cross_entropy (which need no exps kept: 4 bytes a
/// lane not written).
#[inline(always)]
pub(crate) fn exp_total<T: FloatElement>(row: &[T], m: f32, next: &[T]) -> f32 {
    exp_sum::<T, false>(row, &mut [], m, next)
}

/// [`exp_into`] and [`exp_total`]: the exps are stored in `out` when `STORE`. Whole steps and the
/// tail are separate loops so the step loop's accumulators have a constant length and stay in
/// registers (a shared closure over both kept them in memory).
#[inline(always)]
fn exp_sum<T: FloatElement, const STORE: bool>(row: &[T], out: &mut [f32], m: f32, next: &[T]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if crate::rows_avx2::applies::<T>() {
        return crate::rows_avx2::exp_sum::<T, STORE>(row, out, m, next);
    }
    // Lanes at a time: a whole step (four AVX-512 registers) where the CPU has AVX-512, so that
    // four exps run as independent chains — with one register an iteration the loop waited on
    // exp's chain (Zen 4, alternated, best of 3–4: f32 log_softmax 4096x4096 5.2–6.1 → 4.4–4.6
    // ms, softmax 4.5 → 3.6–4.2; in cache (64x4096) f32 softmax 0.056 → 0.050, log_softmax 0.055
    // → 0.047, bf16 5–10%). Elsewhere (f16 rows on AVX2, CPUs other than x86) 16 lanes, two AVX2
    // vectors whose exps and sums stay in registers: a whole step spilled there (16 vectors).
    if T::converts_natively() {
        exp_sum_as::<T, STORE, true, LANES>(row, out, m, next)
    } else if crate::skinny::has_avx512() {
        exp_sum_as::<T, STORE, false, LANES>(row, out, m, next)
    } else {
        exp_sum_as::<T, STORE, false, 16>(row, out, m, next)
    }
}

/// [`exp_sum`] with `EXP_LANES` lanes an iteration (a divisor of [`LANES`]).
#[inline(always)]
fn exp_sum_as<T: FloatElement, const STORE: bool, const NATIVE: bool, const EXP_LANES: usize>(
    row: &[T],
    out: &mut [f32],
    m: f32,
    next: &[T],
) -> f32 {
    const { assert!(LANES.is_multiple_of(EXP_LANES)) };
    let mut acc = [0f32; EXP_LANES];
    let steps = row.chunks_exact(LANES);
    let tail = steps.remainder();
    let full = row.len() - tail.len();
    let mut ahead = Ahead::new(next, steps.len());
    for (at, c) in (0..full).step_by(EXP_LANES).zip(row[..full].chunks_exact(EXP_LANES)) {
        if at % LANES == 0 {
            ahead.step();
        }
        let mut e: [f32; EXP_LANES] = widen_lanes::<T, NATIVE, EXP_LANES>(c.try_into().expect("EXP_LANES elements"));
        for j in 0..EXP_LANES {
            e[j] = math::exp_for::<T>(e[j] - m);
            acc[j] += e[j];
        }
        if STORE {
            out[at..at + EXP_LANES].copy_from_slice(&e);
        }
    }
    // The tail in EXP_LANES-wide pieces as well, the lanes past the row left out of the sums: a
    // row shorter than a step (attention's scores per head, 32 keys) is all tail, and one scalar
    // exp an element took f32 softmax [64, 4, 32, 32] 4.3x torch's time (0.52 ms against 0.12).
    let mut rest = [0f32; LANES];
    T::widen(tail, &mut rest[..tail.len()]);
    let mut tail_acc = [0f32; EXP_LANES];
    let padded = tail.len().next_multiple_of(EXP_LANES);
    for (at, c) in (0..padded).step_by(EXP_LANES).zip(rest[..padded].chunks_exact_mut(EXP_LANES)) {
        for j in 0..EXP_LANES {
            c[j] = math::exp_for::<T>(c[j] - m);
            tail_acc[j] += if at + j < tail.len() { c[j] } else { 0.0 };
        }
    }
    if STORE {
        out[full..row.len()].copy_from_slice(&rest[..tail.len()]);
    }
    math::sum_lanes(acc) + math::sum_lanes(tail_acc)
}

crate::simd_kernel! {
fn kernel<T: FloatElement>(args: &KernelArgs, ctx: BlockCtx, axis: Axis, kind: Kind, streaming: bool) {
    let x = args.input(0);
    let xs = &x.storage::<T>().expect("dtype dispatched")[x.layout().offset()..];
    let y = args.output(0);
    let base = y.layout().offset();
    let mut buf = [0f32; LANES];
    #[cfg(target_arch = "x86_64")]
    if axis.inner == 1 && axis.n <= crate::rows_avx2::SHORT_ROW && crate::rows_avx2::applies::<T>() {
        // Short rows (a router's softmax over its experts) in one pass.
        let rows = ctx.split(axis.outer);
        let (x_rows, len) = (&xs[rows.start * axis.n..rows.end * axis.n], rows.len() * axis.n);
        if len > 0 {
            // SAFETY: this block owns rows `split(outer)` of y.
            let out = unsafe { y.slice_mut::<T>(base + rows.start * axis.n, len) };
            crate::rows_avx2::short_rows(x_rows, out, axis.n, kind == Kind::LogSoftmax);
        }
        return;
    }
    if axis.inner == 1 {
        for r in ctx.split(axis.outer) {
            let row = &xs[r * axis.n..(r + 1) * axis.n];
            let m = row_max(row);
            let next = xs.get((r + 1) * axis.n..(r + 2) * axis.n).unwrap_or_default();
            // SAFETY: this block owns rows `split(outer)` of y.
            let out = unsafe { y.slice_mut::<T>(base + r * axis.n, axis.n) };
            match kind {
                Kind::Softmax => {
                    // exp(x − max) once, kept in f32 scratch (in cache) for the normalizing pass.
                    let padded = axis.n.next_multiple_of(SCRATCH_LANES);
                    // SAFETY: block b owns scratch row b (sized by the plan for softmax rows).
                    let scratch = unsafe { args.workspace::<f32>(ctx.block_idx as usize * padded, padded) };
                    let scale = 1.0 / exp_into(row, scratch, m, next);
                    scale_into(scratch, out, scale, streaming)
                }
                Kind::LogSoftmax => {
                    let shift = m + exp_total(row, m, next).ln();
                    dense_map([row], [out], streaming, |[b]| [b - shift])
                }
            }
        }
    } else {
        // Reduce across rows: LANES neighbouring slices at once.
        let (mut mx, mut acc) = ([0f32; LANES], [0f32; LANES]);
        for g in ctx.split(axis.units()) {
            let (w, at) = axis.group(g);
            mx[..w].fill(f32::NEG_INFINITY);
            acc[..w].fill(0.0);
            for k in 0..axis.n {
                T::widen(&xs[at(k)..at(k) + w], &mut buf[..w]);
                for j in 0..w {
                    mx[j] = mx[j].max(buf[j]);
                }
            }
            for k in 0..axis.n {
                T::widen(&xs[at(k)..at(k) + w], &mut buf[..w]);
                for j in 0..w {
                    acc[j] += math::exp_for::<T>(buf[j] - mx[j]);
                }
            }
            for k in 0..axis.n {
                T::widen(&xs[at(k)..at(k) + w], &mut buf[..w]);
                for j in 0..w {
                    buf[j] = match kind {
                        Kind::Softmax => math::exp_for::<T>(buf[j] - mx[j]) / acc[j],
                        Kind::LogSoftmax => buf[j] - mx[j] - acc[j].ln(),
                    };
                }
                // SAFETY: the group's columns i0..i0+w of every row k of slice `o` are this block's.
                T::narrow(&buf[..w], unsafe { y.slice_mut::<T>(base + at(k), w) });
            }
        }
    }
    fence();
}
}

/// What softmax's scratch rows are padded to: a vector of f32 on AVX2 (see [`exp_into`]).
const SCRATCH_LANES: usize = 8;

/// Plan shared by both ops (and their block split).
fn plan(cx: &OpCx, kind: Kind) -> Result<Plan> {
    let x = cx.input("x");
    let axis = Axis::of(cx, "x")?;
    let units = axis.units();
    let unit_bytes = (x.numel() / units.max(1)).max(1) * 2 * x.dtype.size();
    let block_dim = block_dim_for(units, unit_bytes);
    let streaming = streams(x);
    let step = with_float_dtype!(x.dtype, cx.op(), "x", |T| {
        Step::new("softmax", block_dim, move |args, ctx| kernel::<T>(args, ctx, axis, kind, streaming))
    });
    // Softmax rows keep their exps in one f32 scratch row per block.
    let padded = axis.n.next_multiple_of(SCRATCH_LANES);
    let workspace = if axis.inner == 1 && matches!(kind, Kind::Softmax) { block_dim as usize * padded * 4 } else { 0 };
    Ok(Plan::new(vec![step])
        .workspace(workspace)
        .inputs_need(vec![LayoutNeed::Contiguous])
        .outputs_need(vec![LayoutNeed::Contiguous]))
}

fn reference(cx: &OpCx, inputs: &[Option<RefTensor>], kind: Kind) -> Result<Vec<RefTensor>> {
    let x = inputs[0].as_ref().unwrap();
    let axis = Axis::of(cx, "x")?;
    let mut y = vec![0.0; x.data.len()];
    for s in 0..axis.slices() {
        let m = (0..axis.n).map(|k| x.data[axis.index(s, k)]).fold(f64::NEG_INFINITY, f64::max);
        let sum: f64 = (0..axis.n).map(|k| (x.data[axis.index(s, k)] - m).exp()).sum();
        for k in 0..axis.n {
            let v = x.data[axis.index(s, k)] - m;
            y[axis.index(s, k)] = match kind {
                Kind::Softmax => v.exp() / sum,
                Kind::LogSoftmax => v - sum.ln(),
            };
        }
    }
    Ok(vec![RefTensor::new(&x.shape, y)])
}

/// `softmax` or `log_softmax`: one op type, registered once per kind.
pub struct Softmax(pub(crate) Kind);

impl Softmax {
    pub const SOFTMAX: Softmax = Softmax(Kind::Softmax);
    pub const LOG_SOFTMAX: Softmax = Softmax(Kind::LogSoftmax);
}

impl Op for Softmax {
    fn schema(&self) -> &'static str {
        match self.0 {
            Kind::Softmax => "softmax(Tensor x, int dim=-1) -> Tensor y",
            Kind::LogSoftmax => "log_softmax(Tensor x, int dim=-1) -> Tensor y",
        }
    }
    fn doc(&self) -> &'static str {
        match self.0 {
            Kind::Softmax => {
                "exp(x - max) / sum(exp(x - max)) along dim, as torch.softmax. Any dim; f16/bf16 compute in float32."
            }
            Kind::LogSoftmax => {
                "x - max - log(sum(exp(x - max))) along dim, as torch.log_softmax. Any dim; f16/bf16 compute in float32."
            }
        }
    }
    fn leading_batch_args(&self) -> &'static [&'static str] {
        &["x"]
    }

    fn dtypes(&self) -> &'static [DType] {
        DTYPES
    }
    fn backward(&self) -> Option<&'static str> {
        Some(match self.0 {
            Kind::Softmax => "softmax_backward",
            Kind::LogSoftmax => "log_softmax_backward",
        })
    }
    fn autocast(&self) -> uniop::Autocast {
        uniop::Autocast::Float32
    }
    fn infer(&self, cx: &OpCx) -> Result<Vec<TensorMeta>> {
        let dtype = cx.expect_dtype_in("x", DTYPES)?;
        Axis::of(cx, "x")?;
        Ok(vec![TensorMeta::contiguous(dtype, cx.input("x").shape())?])
    }
    fn plan(&self, cx: &OpCx) -> Result<Plan> {
        plan(cx, self.0)
    }
    fn reference(&self, cx: &OpCx, inputs: &[Option<RefTensor>]) -> Result<Vec<RefTensor>> {
        reference(cx, inputs, self.0)
    }
    fn example(&self, shape: Option<&[usize]>, dtype: DType) -> Result<Example> {
        let meta = TensorMeta::contiguous(dtype, shape.unwrap_or(&[4096, 4096]))?;
        Ok(Example { inputs: vec![Some(meta)], ..Default::default() })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `scale_into`'s streamed stores (taken by outputs larger than the cache, which the op tests
    /// do not reach) write exactly what its cached ones write, for a row starting on a cache line
    /// (whole steps stored 64 bytes at a time where the CPU has AVX-512) and one that does not,
    /// with a tail.
    #[test]
    fn streamed_scaling_writes_what_cached_scaling_writes() {
        fn check<T: FloatElement>() {
            let n = 1000;
            let mut rng = uniop::verify::Rng::new(3);
            let src: Vec<f32> = (0..n).map(|_| (4.0 * rng.uniform() - 2.0) as f32).collect();
            let mut buf = vec![T::default(); n + 64];
            for shift in [0, 1] {
                let at = buf.as_ptr().align_offset(64) + shift;
                let mut got = Vec::new();
                for streaming in [false, true] {
                    let out = &mut buf[at..at + n - shift];
                    out.fill(T::from_f64(f64::NAN));
                    scale_into(&src[..n - shift], out, 0.75, streaming);
                    got.push(out.iter().map(|v| v.to_f64().to_bits()).collect::<Vec<_>>());
                }
                assert_eq!(got[0], got[1], "{} shift {shift}", T::DTYPE);
                let (first, want) = (f64::from_bits(got[1][0]), T::from_f32(src[0] * 0.75).to_f64());
                assert_eq!(first.to_bits(), want.to_bits(), "{}", T::DTYPE);
            }
        }
        check::<f32>();
        check::<uniop::half::f16>();
        check::<uniop::half::bf16>();
    }
}
