//! `softmax_backward(dy, y, dim)` and `log_softmax_backward(dy, y, dim)`: gradients from the
//! forward *output* `y` (what frameworks save), along the same `[outer, n, inner]` view as
//! [`softmax`](crate::softmax):
//! softmax: `dx = y · (dy − Σ dy·y)`; log_softmax: `dx = dy − exp(y) · Σ dy`.

use crate::elementwise::{dense_map, fence, for_lanes, streams, LANES};
use crate::math;
use crate::softmax::{Axis, Kind, DTYPES};
use uniop::{
    block_dim_for, with_float_dtype, BlockCtx, DType, Example, FloatElement, KernelArgs, LayoutNeed, Op, OpCx, Plan,
    RefTensor, Result, Step, TensorMeta,
};

crate::simd_kernel! {
/// `LANES` neighbouring slices at once (or, with `inner == 1`, one slice `LANES` elements at a
/// time): the reduction `Σ dy·y` / `Σ dy`, then `dx` (rows past the cache with non-temporal stores).
fn kernel<T: FloatElement>(args: &KernelArgs, ctx: BlockCtx, axis: Axis, kind: Kind, streaming: bool) {
    let (dy, y) = (args.input(0), args.input(1));
    let dys = &dy.storage::<T>().expect("dtype dispatched")[dy.layout().offset()..];
    let ys = &y.storage::<T>().expect("dtype dispatched")[y.layout().offset()..];
    let dx = args.output(0);
    let base = dx.layout().offset();
    #[cfg(target_arch = "x86_64")]
    if axis.inner == 1 && axis.n <= crate::rows_avx2::SHORT_ROW && crate::rows_avx2::applies::<T>() {
        // Short rows (a router's softmax over its experts) in one pass.
        let rows = ctx.split(axis.outer);
        let elements = rows.start * axis.n..rows.end * axis.n;
        if !elements.is_empty() {
            let (dyr, yr) = (&dys[elements.clone()], &ys[elements.clone()]);
            // SAFETY: this block owns rows `split(outer)` of dx.
            let out = unsafe { dx.slice_mut::<T>(base + elements.start, elements.len()) };
            crate::rows_avx2::short_grad_rows(dyr, yr, out, axis.n, kind == Kind::LogSoftmax);
        }
        return;
    }
    let (mut bd, mut by, mut acc) = ([0f32; LANES], [0f32; LANES], [0f32; LANES]);
    for u in ctx.split(axis.units()) {
        if axis.inner == 1 {
            let row = u * axis.n..(u + 1) * axis.n;
            let (dyr, yr) = (&dys[row.clone()], &ys[row.clone()]);
            // SAFETY: this block owns row `u` of dx.
            let out = unsafe { dx.slice_mut::<T>(base + row.start, axis.n) };
            if crate::rows_avx2::applies::<T>() {
                crate::rows_avx2::softmax_grad(dyr, yr, out, kind == Kind::LogSoftmax, streaming);
                continue;
            }
            // One loop per kind, not a `match` per element: LLVM left that branch in the loops.
            acc.fill(0.0);
            match kind {
                Kind::Softmax => {
                    for_lanes([dyr, yr], 0.0, |[d, y]| {
                        for j in 0..LANES {
                            acc[j] += d[j] * y[j];
                        }
                    });
                    let dot = math::sum_lanes(acc);
                    dense_map([dyr, yr], [out], streaming, |[d, y]| [y * (d - dot)]);
                }
                Kind::LogSoftmax => {
                    for_lanes([dyr], 0.0, |[d]| {
                        for j in 0..LANES {
                            acc[j] += d[j];
                        }
                    });
                    let dot = math::sum_lanes(acc);
                    dense_map([dyr, yr], [out], streaming, |[d, y]| [d - math::exp_for::<T>(y) * dot]);
                }
            }
        } else {
            let (w, at) = axis.group(u);
            acc[..w].fill(0.0);
            for k in 0..axis.n {
                T::widen(&dys[at(k)..at(k) + w], &mut bd[..w]);
                T::widen(&ys[at(k)..at(k) + w], &mut by[..w]);
                for j in 0..w {
                    acc[j] += if kind == Kind::Softmax { bd[j] * by[j] } else { bd[j] };
                }
            }
            for k in 0..axis.n {
                T::widen(&dys[at(k)..at(k) + w], &mut bd[..w]);
                T::widen(&ys[at(k)..at(k) + w], &mut by[..w]);
                for j in 0..w {
                    bd[j] = match kind {
                        Kind::Softmax => by[j] * (bd[j] - acc[j]),
                        Kind::LogSoftmax => bd[j] - math::exp_for::<T>(by[j]) * acc[j],
                    };
                }
                // SAFETY: columns i0..i0+w of every row k of slice `o` belong to this unit alone.
                T::narrow(&bd[..w], unsafe { dx.slice_mut::<T>(base + at(k), w) });
            }
        }
    }
    fence();
}
}

fn plan(cx: &OpCx, kind: Kind) -> Result<Plan> {
    let y = cx.input("y");
    let axis = Axis::of(cx, "y")?;
    let units = axis.units();
    let unit_bytes = (y.numel() / units.max(1)).max(1) * 3 * y.dtype.size();
    let block_dim = block_dim_for(units, unit_bytes);
    let streaming = streams(y);
    let step = with_float_dtype!(y.dtype, cx.op(), "y", |T| {
        Step::new("softmax_backward", block_dim, move |args, ctx| kernel::<T>(args, ctx, axis, kind, streaming))
    });
    Ok(Plan::new(vec![step]).inputs_need(vec![LayoutNeed::Contiguous; 2]).outputs_need(vec![LayoutNeed::Contiguous]))
}

fn reference(cx: &OpCx, inputs: &[Option<RefTensor>], kind: Kind) -> Result<Vec<RefTensor>> {
    let (dy, y) = (inputs[0].as_ref().unwrap(), inputs[1].as_ref().unwrap());
    let axis = Axis::of(cx, "y")?;
    let mut dx = vec![0.0; y.data.len()];
    for s in 0..axis.slices() {
        let idx = |k| axis.index(s, k);
        let dot: f64 = (0..axis.n)
            .map(|k| if kind == Kind::Softmax { dy.data[idx(k)] * y.data[idx(k)] } else { dy.data[idx(k)] })
            .sum();
        for k in 0..axis.n {
            let (d, v) = (dy.data[idx(k)], y.data[idx(k)]);
            dx[idx(k)] = match kind {
                Kind::Softmax => v * (d - dot),
                Kind::LogSoftmax => d - v.exp() * dot,
            };
        }
    }
    Ok(vec![RefTensor::new(&y.shape, dx)])
}

/// `softmax_backward` or `log_softmax_backward`, registered once per kind.
pub struct SoftmaxBackward(Kind);

impl SoftmaxBackward {
    pub const SOFTMAX: SoftmaxBackward = SoftmaxBackward(Kind::Softmax);
    pub const LOG_SOFTMAX: SoftmaxBackward = SoftmaxBackward(Kind::LogSoftmax);
}

impl Op for SoftmaxBackward {
    fn schema(&self) -> &'static str {
        match self.0 {
            Kind::Softmax => "softmax_backward(Tensor dy, Tensor y, int dim=-1) -> Tensor dx",
            Kind::LogSoftmax => "log_softmax_backward(Tensor dy, Tensor y, int dim=-1) -> Tensor dx",
        }
    }
    fn doc(&self) -> &'static str {
        match self.0 {
            Kind::Softmax => "Gradient of softmax from its output y: dx = y * (dy - sum(dy * y)) along dim.",
            Kind::LogSoftmax => "Gradient of log_softmax from its output y: dx = dy - exp(y) * sum(dy) along dim.",
        }
    }
    fn leading_batch_args(&self) -> &'static [&'static str] {
        &["dy", "y"]
    }

    fn dtypes(&self) -> &'static [DType] {
        DTYPES
    }
    fn infer(&self, cx: &OpCx) -> Result<Vec<TensorMeta>> {
        let dtype = cx.expect_dtype_in("y", DTYPES)?;
        cx.expect_same_dtype("dy", dtype, "y")?;
        cx.expect_shape("dy", cx.input("y").shape())?;
        Axis::of(cx, "y")?;
        Ok(vec![TensorMeta::contiguous(dtype, cx.input("y").shape())?])
    }
    fn plan(&self, cx: &OpCx) -> Result<Plan> {
        plan(cx, self.0)
    }
    fn reference(&self, cx: &OpCx, inputs: &[Option<RefTensor>]) -> Result<Vec<RefTensor>> {
        reference(cx, inputs, self.0)
    }
    /// Every element carries the error of an n-term sum (`Σ dy·y` or `Σ dy`) in f32.
    fn error_scale(&self, cx: &OpCx) -> f64 {
        Axis::of(cx, "y").map_or(1.0, |axis| (axis.n.max(1) as f64).sqrt())
    }
    fn example(&self, shape: Option<&[usize]>, dtype: DType) -> Result<Example> {
        let meta = TensorMeta::contiguous(dtype, shape.unwrap_or(&[4096, 4096]))?;
        Ok(Example { inputs: vec![Some(meta.clone()), Some(meta)], ..Default::default() })
    }
}
