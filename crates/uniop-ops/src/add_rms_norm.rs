//! `add_rms_norm(x, residual, weight, eps) -> (y, rstd, sum)`: the residual add of a transformer
//! block fused with the next RMSNorm (aclnn AddRmsNorm). `sum = x + residual` is rounded to the
//! input dtype — exactly what the unfused `add` then `rms_norm` would see — and normalized into
//! `y`; `sum` is returned because it is the next residual.
//!
//! Each row: add and store `sum` while reducing its squares (one read of both inputs), then
//! scale the row back from cache. `sum` is written with ordinary stores since it is re-read.

use crate::elementwise::{converts_per_element, fence, store_natively, streams_bytes, to_f32, Aligned, LANES};
use crate::math;
use crate::rms_norm::{check_eps, norm_shape, param_f32, reference_rows, scale_row, KernelShape, DTYPES};
use uniop::{
    block_dim_for, dispatch_element, with_float_dtype, BlockCtx, DType, Element, Example, FloatElement, KernelArgs,
    LayoutNeed, Op, OpCx, Plan, RefTensor, Result, Step, TensorMeta,
};

pub struct AddRmsNorm;

/// `out = a + b` (rounded to `T`) and Σ out², `LANES` at a time. The norm sees the sum as
/// stored (rounded to `T`), like a separate add then rms_norm.
#[inline(always)]
fn add_row<T: FloatElement>(a: &[T], b: &[T], out: &mut [T]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if crate::rows_avx2::applies::<T>() {
        return crate::rows_avx2::add_squares(a, b, out);
    }
    // The native form: in cache (Zen 4, four alternations) f16 0.064 → 0.055 ms, 4096x4096 4.12
    // → 3.59. bf16 ran slower this way (0.057 → 0.059, 3.72 → 3.97) while the narrowing reloaded
    // the stored step; narrowed in registers it gains too (0.076–0.093 → 0.059–0.069 ms, 4096x4096
    // on two threads 4.45–5.14 → 4.18–5.08).
    if T::converts_natively() {
        add_row_as::<T, true>(a, b, out)
    } else {
        add_row_as::<T, false>(a, b, out)
    }
}

#[inline(always)]
fn add_row_as<T: FloatElement, const NATIVE: bool>(a: &[T], b: &[T], out: &mut [T]) -> f32 {
    let mut acc = [0f32; LANES];
    let n = a.len();
    let full = n / LANES * LANES;
    let per_element = converts_per_element::<T, 1>();
    for j in (0..full).step_by(LANES) {
        let (ac, bc, oc) = (&a[j..j + LANES], &b[j..j + LANES], &mut out[j..j + LANES]);
        if NATIVE {
            // Narrowed by the CPU's instruction, then widened back from the stored row.
            let mut sum = Aligned([0f32; LANES]);
            for i in 0..LANES {
                sum[i] = to_f32::<T, true>(ac[i]) + to_f32::<T, true>(bc[i]);
            }
            // SAFETY: `NATIVE` only where `T::converts_natively()` (see `add_row`).
            unsafe { store_natively(&sum, oc, false) };
            for i in 0..LANES {
                let stored = to_f32::<T, true>(oc[i]);
                acc[i] += stored * stored;
            }
            continue;
        }
        if per_element {
            // Rounded and widened back in registers (see `converts_per_element`), then squared in
            // a loop of its own: summed in the rounding loop, the partial sums lived on the stack
            // (a load, add and store per register: f32 16x4096 on one thread ran 0.022 ms, now
            // 0.017–0.021 on the AMX Xeon).
            let mut stored = [0f32; LANES];
            for i in 0..LANES {
                let rounded = T::from_f32(ac[i].to_f32() + bc[i].to_f32());
                oc[i] = rounded;
                stored[i] = rounded.to_f32();
            }
            for i in 0..LANES {
                acc[i] += stored[i] * stored[i];
            }
            continue;
        }
        let mut sum: [f32; LANES] = T::widen_lanes(ac.try_into().expect("LANES elements"));
        let bb: [f32; LANES] = T::widen_lanes(bc.try_into().expect("LANES elements"));
        for i in 0..LANES {
            sum[i] += bb[i];
        }
        let rounded = T::narrow_lanes(&sum);
        let stored = T::widen_lanes(&rounded);
        for i in 0..LANES {
            acc[i] += stored[i] * stored[i];
        }
        oc.copy_from_slice(&rounded);
    }
    let mut tail = 0.0;
    for j in full..n {
        out[j] = T::from_f32(a[j].to_f32() + b[j].to_f32());
        tail += out[j].to_f32() * out[j].to_f32();
    }
    tail + math::sum_lanes(acc)
}

crate::simd_kernel! {
fn kernel<T: FloatElement, W: FloatElement>(args: &KernelArgs, ctx: BlockCtx, s: &KernelShape) {
    let (x, r) = (args.input(0), args.input(1));
    let (xs, rs) = (x.storage::<T>().expect("dtype dispatched"), r.storage::<T>().expect("dtype dispatched"));
    let (y, rstd_out, sum) = (args.output(0), args.output(1), args.output(2));
    let cols = s.cols;
    // SAFETY: block b owns workspace row b (reserved when the weight is not f32).
    let wf = unsafe { param_f32::<W>(args, 2, ctx.block_idx as usize, cols) };
    // SAFETY: each block writes only the rstd entries of its own rows (below).
    let rstd_ptr = unsafe { rstd_out.as_mut_ptr::<f32>() };
    for row in ctx.split(s.rows) {
        let (xo, ro) = (x.layout().outer_offset(row, s.inner_dims), r.layout().outer_offset(row, s.inner_dims));
        // SAFETY: this block owns rows `split(rows)` of every output.
        unsafe {
            let h = sum.slice_mut::<T>(sum.layout().outer_offset(row, s.inner_dims), cols);
            let squares = add_row(&xs[xo..xo + cols], &rs[ro..ro + cols], h);
            let rstd = 1.0 / (squares / cols as f32 + s.eps).sqrt();
            *rstd_ptr.add(rstd_out.layout().offset_of_linear(row)) = rstd;
            let yrow = y.slice_mut::<T>(y.layout().outer_offset(row, s.inner_dims), cols);
            scale_row(&*h, &[], wf, yrow, rstd, s.streaming);
        }
    }
    fence();
}
}

impl Op for AddRmsNorm {
    fn schema(&self) -> &'static str {
        "add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps=1e-06) -> (Tensor y, Tensor rstd, Tensor sum)"
    }

    fn doc(&self) -> &'static str {
        "Fused residual add + RMSNorm (aclnn AddRmsNorm): sum = x + residual (rounded to the input dtype), \
         y = rms_norm(sum, weight, eps), rstd as rms_norm returns it. x and residual share shape and dtype; \
         weight as for rms_norm. The backward is add_rms_norm_backward (rms_norm's on sum, plus the gradient of \
         sum itself, for both inputs)."
    }

    fn leading_batch_args(&self) -> &'static [&'static str] {
        &["x", "residual"]
    }

    fn dtypes(&self) -> &'static [DType] {
        DTYPES
    }

    fn backward(&self) -> Option<&'static str> {
        Some("add_rms_norm_backward")
    }

    fn infer(&self, cx: &OpCx) -> Result<Vec<TensorMeta>> {
        let s = norm_shape(cx, "x", "weight")?;
        cx.expect_same_dtype("residual", s.dtype, "x")?;
        cx.expect_shape("residual", cx.input("x").shape())?;
        check_eps(cx)?;
        let x = TensorMeta::contiguous(s.dtype, cx.input("x").shape())?;
        Ok(vec![x.clone(), TensorMeta::contiguous(DType::F32, &s.rstd_shape)?, x])
    }

    fn plan(&self, cx: &OpCx) -> Result<Plan> {
        self.infer(cx)?;
        let s = norm_shape(cx, "x", "weight")?;
        let weight_is_f32 = cx.input("weight").dtype == DType::F32;
        let ks = KernelShape {
            rows: s.rows,
            cols: s.cols,
            inner_dims: s.inner_dims,
            eps: check_eps(cx)?,
            // Two outputs: the sum and the normed rows.
            streaming: streams_bytes(2 * s.rows * s.cols * s.dtype.size()),
        };
        let block_dim = block_dim_for(s.rows, 4 * s.cols * s.dtype.size());
        let workspace = if weight_is_f32 { 0 } else { block_dim as usize * s.cols * 4 };
        let step = with_float_dtype!(s.dtype, cx.op(), "x", |T| {
            if weight_is_f32 {
                Step::new("add_rms_norm", block_dim, move |a, c| kernel::<T, f32>(a, c, &ks))
            } else {
                Step::new("add_rms_norm", block_dim, move |a, c| kernel::<T, T>(a, c, &ks))
            }
        });
        let row = s.row_need();
        Ok(Plan::new(vec![step])
            .workspace(workspace)
            .inputs_need(vec![row, row, LayoutNeed::Contiguous])
            .outputs_need(vec![row, LayoutNeed::Any, row]))
    }

    fn reference(&self, cx: &OpCx, inputs: &[Option<RefTensor>]) -> Result<Vec<RefTensor>> {
        let s = norm_shape(cx, "x", "weight")?;
        let [x, r, w] = [0, 1, 2].map(|i| inputs[i].as_ref().unwrap());
        // Round the sum to the input dtype, as the unfused ops would store it.
        let sum: Vec<f64> = dispatch_element!(s.dtype, |E| {
            x.data.iter().zip(&r.data).map(|(a, b)| <E as Element>::from_f64(a + b).to_f64()).collect()
        });
        let (y, rstd) = reference_rows(&sum, &w.data, s.rows, s.cols, cx.float("eps"));
        Ok(vec![RefTensor::new(&x.shape, y), RefTensor::new(&s.rstd_shape, rstd), RefTensor::new(&x.shape, sum)])
    }

    fn example(&self, shape: Option<&[usize]>, dtype: DType) -> Result<Example> {
        let shape = shape.unwrap_or(&[4096, 4096]);
        let x = TensorMeta::contiguous(dtype, shape)?;
        let w = TensorMeta::contiguous(dtype, &shape[shape.len().saturating_sub(1)..])?;
        Ok(Example { inputs: vec![Some(x.clone()), Some(x), Some(w)], attrs: vec![], ..Default::default() })
    }
}
