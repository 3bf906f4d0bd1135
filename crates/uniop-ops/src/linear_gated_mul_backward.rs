//! `linear_silu_mul_backward(dy, x, gate_weight, up_weight, gate=None, up=None, batch_dims=0,
//! needs_dx=True, needs_dgate_weight=True, needs_dup_weight=True) -> (dx, dgate_weight,
//! dup_weight)`, the gradient of [`linear_silu_mul`](crate::linear_gated_mul), and
//! `linear_gelu_mul_backward(..., approximate, batch_dims=0, ...)`, `linear_gelu_mul`'s. With
//! `g = x · gate_weightᵀ` and `u = x · up_weightᵀ`: `dg = dy · u · act'(g)`, `du = dy · act(g)`,
//! then `dx = dg · gate_weight + du · up_weight`, `dgate_weight = dgᵀ · x`, `dup_weight = duᵀ · x`
//! — the weight gradients per sample of the first `batch_dims` dims of x (see
//! [`per_sample`](crate::per_sample)).
//!
//! Three launches, each block owning a band of what it writes (no atomics, deterministic): `dg`
//! and `du` into the workspace, then rows (or, for f32 and bf16 with few rows, columns) of `dx`,
//! then rows of one sample's two weight gradients. The first launch takes `g` and `u` as given (`gate` and
//! `up`, which `linear_silu_mul_train` returns) in one elementwise pass, or, when they were not
//! kept (`linear_silu_mul`'s autograd, which keeps no `[rows, n]` tensor), recomputes them with
//! the forward's paired GEMM and turns them into gradients in its epilogue: six products instead
//! of four, for that memory. A gradient nobody asked for is left out and comes back empty, as in
//! [`linear_backward`](crate::linear_backward): frozen weights (LoRA's base MLP) save the two
//! weight products, input data the dx ones.

use crate::elementwise::{dense_input, dense_map, fence, streams_bytes};
use crate::gate::{with_gate_fn, GateFn, Gating};
use crate::linear::Dims;
use crate::linear::COLUMN_UNIT;
use crate::linear_backward::samples;
use crate::linear_gated_mul::{dims as forward_dims, gate_up_rows, reference_products, Operands};
use crate::linear_gated_mul::{scratch_bytes, BLOCK_SCRATCH_BYTES};
use crate::matmul::{column_band, gemm_rows, Dst, Mat, DTYPES};
use crate::packed_gemm::{split_columns, HALF as GROUP, PAIRED_COLUMNS};
use crate::per_sample::SampleBlocks;
use uniop::layout::ShapeDisplay;
use uniop::{
    block_dim_for, with_float_dtype, BlockCtx, DType, ErrorCode, Example, FloatElement, KernelArgs, LayoutNeed, Op,
    OpCx, Plan, RefTensor, Result, Step, TensorMeta,
};

pub struct LinearGatedMulBackward(Gating);

impl LinearGatedMulBackward {
    pub const SILU: LinearGatedMulBackward = LinearGatedMulBackward(Gating::Silu);
    pub const GELU: LinearGatedMulBackward = LinearGatedMulBackward(Gating::Gelu);
}

/// The product dims, and whether the forward's products come saved (`gate` and `up`: both or
/// neither, each shaped as `dy`).
fn dims(cx: &OpCx) -> Result<(Dims, bool)> {
    let d = forward_dims(cx)?;
    let dtype = cx.input("x").dtype;
    cx.expect_same_dtype("dy", dtype, "x")?;
    let mut y = cx.input("x").shape().to_vec();
    *y.last_mut().unwrap() = d.n;
    cx.expect_shape("dy", &y)?;
    let saved = match (cx.optional_input("gate").is_some(), cx.optional_input("up").is_some()) {
        (false, false) => false,
        (true, true) => {
            for name in ["gate", "up"] {
                cx.expect_same_dtype(name, dtype, "x")?;
                cx.expect_shape(name, &y)?;
            }
            true
        }
        (gate, _) => {
            let (missing, given) = if gate { ("up", "gate") } else { ("gate", "up") };
            return Err(cx.err(
                ErrorCode::ParamNullptr,
                missing,
                format!("a tensor, as '{given}' is given (the saved products come as a pair)"),
                "none",
            ));
        }
    };
    Ok((d, saved))
}

/// Where the workspace keeps things: `dg` then `du` (`[rows, n]` each, in the op's dtype) from
/// element 0, and the gradient launch's per-block scratch from byte `scratch`.
#[derive(Clone, Copy)]
struct Workspace {
    scratch: usize,
}

crate::simd_kernel! {
/// `(dg, du)` for one row's outputs from its paired sums of `g` and `u` (layout:
/// [`crate::packed_gemm::gemm_rows_pairs`]) and the upstream `dy`, widened and narrowed as whole
/// slices (as the forward's epilogue).
fn act_mul_grad_pairs<T: FloatElement, A: GateFn>(sums: &[f32], dy: &[T], dg: &mut [T], du: &mut [T]) {
    let len = dy.len();
    let (mut d, mut dgs, mut dus) = ([0f32; PAIRED_COLUMNS], [0f32; PAIRED_COLUMNS], [0f32; PAIRED_COLUMNS]);
    T::widen(dy, &mut d[..len]);
    let groups = sums.chunks_exact(2 * GROUP).zip(d.chunks_exact(GROUP));
    for ((sums, d), (dg, du)) in groups.zip(dgs.chunks_exact_mut(GROUP).zip(dus.chunks_exact_mut(GROUP))) {
        let (g, u) = sums.split_at(GROUP);
        for i in 0..GROUP {
            (dg[i], du[i]) = A::mul_grad::<T>(d[i], g[i], u[i]);
        }
    }
    T::narrow(&dgs[..len], dg);
    T::narrow(&dus[..len], du);
}
}

crate::simd_kernel! {
/// Step 1 from the saved products: `dg` and `du` elementwise from `dy`, `gate` and `up` (inputs
/// 0, 4 and 5), `len` elements each.
fn saved_gradients_kernel<T: FloatElement, A: GateFn>(args: &KernelArgs, ctx: BlockCtx, len: usize, streaming: bool) {
    let range = ctx.split(len);
    let ins = [0, 4, 5].map(|i| dense_input::<T>(args, i, range.clone()));
    // SAFETY: this block's elements of dg and du.
    let outs = unsafe {
        [args.workspace::<T>(range.start, range.len()), args.workspace::<T>(len + range.start, range.len())]
    };
    dense_map(ins, outs, streaming, |[d, g, u]| {
        let (dg, du) = A::mul_grad::<T>(d, g, u);
        [dg, du]
    });
    fence();
}
}

/// Step 1 without them: rows of `dg` and `du` from the recomputed products.
fn gradients_kernel<T: FloatElement, A: GateFn>(args: &KernelArgs, ctx: BlockCtx, d: Dims, ws: Workspace) {
    let rows = ctx.split(d.rows);
    if rows.is_empty() || d.n == 0 {
        return;
    }
    let dy = args.input(0);
    let dys = &dy.storage::<T>().unwrap()[dy.layout().offset()..];
    let band = rows.len() * d.n;
    // SAFETY: this block's rows of dg and du.
    let (dg, du) = unsafe {
        (args.workspace::<T>(rows.start * d.n, band), args.workspace::<T>(d.rows * d.n + rows.start * d.n, band))
    };
    // SAFETY: this block's own scratch (the plan sized it where blocks take the generic route).
    let scratch = || unsafe {
        args.workspace::<u8>(ws.scratch + ctx.block_idx as usize * BLOCK_SCRATCH_BYTES, BLOCK_SCRATCH_BYTES)
            .as_mut_ptr()
    };
    let first = rows.start;
    // SAFETY: dy and x contiguous (plan), weights any strided [n, k].
    unsafe {
        gate_up_rows::<T>(rows, 0..d.n, d, Operands::of(args, 1, d), scratch, |r, c, sums| {
            let len = (d.n - c).min(sums.len() / 2);
            let at = (r - first) * d.n + c;
            act_mul_grad_pairs::<T, A>(sums, &dys[r * d.n + c..][..len], &mut dg[at..][..len], &mut du[at..][..len]);
        });
    }
}

/// Step 2: `dx = dg · gate_weight + du · up_weight`, a band of rows or, where [`split_columns`]
/// says so, of columns.
fn dx_kernel<T: FloatElement>(args: &KernelArgs, ctx: BlockCtx, d: Dims, columns: bool) {
    let (rows, cols) =
        if columns { (0..d.rows, column_band(ctx, d.k, COLUMN_UNIT)) } else { (ctx.split(d.rows), 0..d.k) };
    if rows.is_empty() || cols.is_empty() {
        return;
    }
    let dx = args.output(0);
    // SAFETY: dg and du, written by step 1, only read here.
    let grads = unsafe { args.workspace::<T>(0, 2 * d.rows * d.n) }.as_ptr();
    for (i, input) in [2, 3].into_iter().enumerate() {
        let w = args.input(input);
        let s = w.layout().strides();
        // SAFETY: the weight [n, k] at any strides, dg/du and dx contiguous; this block owns dx
        // rows `rows` × columns `cols`.
        unsafe {
            let w = w.storage::<T>().unwrap().as_ptr().add(w.layout().offset() + cols.start * s[1]);
            gemm_rows(
                rows.clone(),
                cols.len(),
                d.n,
                Dst { ptr: dx.as_mut_ptr::<T>().add(dx.layout().offset() + cols.start), rs: d.k as isize, cs: 1 },
                Mat { ptr: grads.add(i * d.rows * d.n), rs: d.n as isize, cs: 1 },
                Mat { ptr: w, rs: s[0] as isize, cs: s[1] as isize },
                i == 1,
            );
        }
    }
}

/// Which returns a call asks for (`needs_dx`, `needs_dgate_weight`, `needs_dup_weight`).
#[derive(Clone, Copy)]
struct Needs {
    dx: bool,
    dweights: [bool; 2],
}

impl Needs {
    fn of(cx: &OpCx) -> Needs {
        Needs { dx: cx.needs_grad("x"), dweights: [cx.needs_grad("gate_weight"), cx.needs_grad("up_weight")] }
    }

    /// The weight gradients asked for: 0 for dgate_weight, 1 for dup_weight.
    fn weights(self) -> impl Iterator<Item = usize> {
        (0..2).filter(move |&i| self.dweights[i])
    }
}

/// Step 3: rows of one sample's `dgate_weight = dgᵀ · x` and `dup_weight = duᵀ · x` (over that
/// sample's rows), those asked for stacked as `n` rows each to share out among the sample's blocks.
fn dweights_kernel<T: FloatElement>(args: &KernelArgs, ctx: BlockCtx, d: Dims, samples: SampleBlocks, needs: Needs) {
    if samples.count == 0 {
        return; // the returns are empty
    }
    let (sample, place) = ctx.within(samples.count);
    let first = sample * samples.rows;
    let owned = place.split(needs.weights().count() * d.n);
    let x = args.input(1);
    // SAFETY: dg and du only read here.
    let grads = unsafe { args.workspace::<T>(0, 2 * d.rows * d.n) }.as_ptr();
    for (slot, i) in needs.weights().enumerate() {
        let rows = slot * d.n..(slot + 1) * d.n;
        let part =
            owned.start.clamp(rows.start, rows.end) - rows.start..owned.end.clamp(rows.start, rows.end) - rows.start;
        let dw = args.output(1 + i);
        // SAFETY: all contiguous; this block owns rows `part` of this sample's weight gradient.
        unsafe {
            let xs = x.storage::<T>().unwrap().as_ptr().add(x.layout().offset() + first * d.k);
            gemm_rows(
                part,
                d.k,
                samples.rows,
                Dst {
                    ptr: dw.as_mut_ptr::<T>().add(dw.layout().offset() + sample * d.n * d.k),
                    rs: d.k as isize,
                    cs: 1,
                },
                Mat { ptr: grads.add(i * d.rows * d.n + first * d.n), rs: 1, cs: d.n as isize },
                Mat { ptr: xs, rs: d.k as isize, cs: 1 },
                false,
            );
        }
    }
}

/// The shapes of `(dx, dgate_weight, dup_weight)`: x's and the weights' (per sample with
/// `batch_dims`), or `[0]` for a gradient the call does not ask for.
fn return_shapes(cx: &OpCx, d: Dims) -> Result<[Vec<usize>; 3]> {
    let weight = samples(cx)?.shape(&[d.n, d.k]);
    Ok([
        cx.grad_shape("x", cx.input("x").shape()),
        cx.grad_shape("gate_weight", &weight),
        cx.grad_shape("up_weight", &weight),
    ])
}

impl Op for LinearGatedMulBackward {
    fn schema(&self) -> &'static str {
        match self.0 {
            Gating::Silu => {
                "linear_silu_mul_backward(Tensor dy, Tensor x, Tensor gate_weight, Tensor up_weight, Tensor? \
                 gate=None, Tensor? up=None, int batch_dims=0, bool needs_dx=True, bool needs_dgate_weight=True, \
                 bool needs_dup_weight=True) -> (Tensor dx, Tensor dgate_weight, Tensor dup_weight)"
            }
            Gating::Gelu => {
                "linear_gelu_mul_backward(Tensor dy, Tensor x, Tensor gate_weight, Tensor up_weight, Tensor? \
                 gate=None, Tensor? up=None, str approximate='none', int batch_dims=0, bool needs_dx=True, bool \
                 needs_dgate_weight=True, bool needs_dup_weight=True) -> (Tensor dx, Tensor dgate_weight, Tensor \
                 dup_weight)"
            }
        }
    }

    fn doc(&self) -> &'static str {
        match self.0 {
            Gating::Silu => {
                "Gradients of linear_silu_mul (and linear_silu_mul_train): with g = x @ gate_weight^T, u = x @ \
                 up_weight^T (given as gate and up, both or neither, else recomputed), dg = dy * u * silu'(g), du = \
                 dy * silu(g); dx = dg @ gate_weight + du @ up_weight, dgate_weight = dg^T @ x, dup_weight = du^T @ \
                 x (summed over all leading dims of x; with batch_dims, per sample: x.shape[:batch_dims] + the \
                 weight's shape). needs_dx / needs_dgate_weight / needs_dup_weight=False leave that gradient out \
                 (returned empty, [0]): frozen weights save two of the products."
            }
            Gating::Gelu => {
                "Gradients of linear_gelu_mul (and linear_gelu_mul_train), as linear_silu_mul_backward's with \
                 gelu(g, approximate) for silu(g): dg = dy * u * gelu'(g), du = dy * gelu(g); dx = dg @ \
                 gate_weight + du @ up_weight, dgate_weight = dg^T @ x, dup_weight = du^T @ x (per sample with \
                 batch_dims; each left out, returned empty, when its needs_ flag is False)."
            }
        }
    }

    /// Row by row; the weight gradients per sample with `batch_dims`.
    fn leading_batch_args(&self) -> &'static [&'static str] {
        &["dy", "x", "gate", "up"]
    }

    fn dtypes(&self) -> &'static [DType] {
        DTYPES
    }

    /// As `linear_backward`'s, times the size of `dg` and `du`'s other factor (`u`, `silu(g)`:
    /// k-deep sums, √k-sized for unit-sized inputs), which are rounded to the dtype before the
    /// sums over n and rows.
    fn error_scale(&self, cx: &OpCx) -> f64 {
        dims(cx).map_or(1.0, |(d, _)| ((d.rows.max(d.n).max(d.k).max(1) * d.k.max(1)) as f64).sqrt())
    }

    fn infer(&self, cx: &OpCx) -> Result<Vec<TensorMeta>> {
        let (d, _) = dims(cx)?;
        self.0.activation(cx)?;
        let dtype = cx.input("x").dtype;
        let [dx, dgate_weight, dup_weight] = return_shapes(cx, d)?;
        Ok(vec![
            TensorMeta::contiguous(dtype, &dx)?,
            TensorMeta::contiguous(dtype, &dgate_weight)?,
            TensorMeta::contiguous(dtype, &dup_weight)?,
        ])
    }

    fn plan(&self, cx: &OpCx) -> Result<Plan> {
        let (d, saved) = dims(cx)?;
        let activation = self.0.activation(cx)?;
        let dtype = cx.input("x").dtype;
        let threads = uniop::runtime::Pool::global().threads();
        let row_blocks = d.rows.div_ceil(16).clamp(1, threads);
        let columns = split_columns(dtype, d.rows, d.k, threads);
        let dx_blocks = if columns { d.k.div_ceil(COLUMN_UNIT).clamp(1, threads) } else { row_blocks };
        let needs = Needs::of(cx);
        let stacked = needs.weights().count() * d.n;
        let dw_blocks = samples(cx)?.blocks(cx, "x", stacked.div_ceil(16).clamp(1, threads) as u32)?;
        let grads = (2 * d.rows).checked_mul(d.n).and_then(|e| e.checked_mul(dtype.size()));
        let scratch = grads.and_then(|g| g.checked_next_multiple_of(64)).ok_or_else(|| {
            let y = ShapeDisplay(cx.input("dy").shape());
            cx.err(ErrorCode::Shape, "dy", "gradients whose workspace fits in memory", format!("shape {y}"))
        })?;
        let ws = Workspace { scratch };
        let len = d.rows * d.n;
        let streaming = streams_bytes(2 * len * dtype.size());
        let names = match self.0 {
            Gating::Silu => [
                "linear_silu_mul_backward.saved_gradients",
                "linear_silu_mul_backward.gradients",
                "linear_silu_mul_backward.dx",
                "linear_silu_mul_backward.dweights",
            ],
            Gating::Gelu => [
                "linear_gelu_mul_backward.saved_gradients",
                "linear_gelu_mul_backward.gradients",
                "linear_gelu_mul_backward.dx",
                "linear_gelu_mul_backward.dweights",
            ],
        };
        let steps = with_float_dtype!(dtype, cx.op(), "x", |T| {
            let gradients = with_gate_fn!(activation, |A| if saved {
                Step::new(names[0], block_dim_for(len, 5 * dtype.size()), move |a, c| {
                    saved_gradients_kernel::<T, A>(a, c, len, streaming)
                })
            } else {
                Step::new(names[1], row_blocks as u32, move |a, c| gradients_kernel::<T, A>(a, c, d, ws))
            });
            let dx =
                needs.dx.then(|| Step::new(names[2], dx_blocks as u32, move |a, c| dx_kernel::<T>(a, c, d, columns)));
            let dweights = (stacked > 0).then(|| {
                Step::new(names[3], dw_blocks.total, move |a, c| dweights_kernel::<T>(a, c, d, dw_blocks, needs))
            });
            std::iter::once(gradients).chain(dx).chain(dweights).collect()
        });
        let needs = vec![
            LayoutNeed::Contiguous,
            LayoutNeed::Contiguous,
            LayoutNeed::Any,
            LayoutNeed::Any,
            LayoutNeed::Contiguous,
            LayoutNeed::Contiguous,
        ];
        let gradient_scratch = if saved { 0 } else { scratch_bytes(dtype, d.k, row_blocks, d.rows / row_blocks) };
        Ok(Plan::new(steps)
            .workspace(scratch + gradient_scratch)
            .inputs_need(needs)
            .outputs_need(vec![LayoutNeed::Contiguous; 3]))
    }

    fn reference(&self, cx: &OpCx, inputs: &[Option<RefTensor>]) -> Result<Vec<RefTensor>> {
        let (d, saved) = dims(cx)?;
        let activation = self.0.activation(cx)?;
        let samples = samples(cx)?;
        let [dy, x, wg, wu] = [0, 1, 2, 3].map(|i| inputs[i].as_ref().unwrap());
        let (g, u) = if saved {
            let [g, u] = [4, 5].map(|i| inputs[i].as_ref().unwrap().data.clone());
            (g, u)
        } else {
            reference_products(d, inputs, 1)
        };
        let (dg, du): (Vec<f64>, Vec<f64>) =
            (0..g.len()).map(|i| activation.exact_mul_grad(dy.data[i], g[i], u[i])).unzip();
        // Each sized only when asked for: a frozen weight's per-sample gradient may not fit in memory.
        let shapes = return_shapes(cx, d)?;
        let [mut dx, mut dwg, mut dwu] = shapes.each_ref().map(|s| vec![0.0; s.iter().product()]);
        let needs = Needs::of(cx);
        for r in 0..d.rows {
            let sample = r / samples.rows.max(1) * d.n * d.k;
            for j in 0..d.n {
                let (a, b) = (dg[r * d.n + j], du[r * d.n + j]);
                for p in 0..d.k {
                    if needs.dx {
                        dx[r * d.k + p] += a * wg.data[j * d.k + p] + b * wu.data[j * d.k + p];
                    }
                    if needs.dweights[0] {
                        dwg[sample + j * d.k + p] += a * x.data[r * d.k + p];
                    }
                    if needs.dweights[1] {
                        dwu[sample + j * d.k + p] += b * x.data[r * d.k + p];
                    }
                }
            }
        }
        let [dx_shape, dwg_shape, dwu_shape] = shapes;
        Ok(vec![RefTensor::new(&dx_shape, dx), RefTensor::new(&dwg_shape, dwg), RefTensor::new(&dwu_shape, dwu)])
    }

    /// x's shape, as for linear_silu_mul (the first input is the gradient of its output).
    fn example_shape(&self, example: &Example) -> Vec<usize> {
        example.input_shape(1)
    }

    /// With the products saved, as `linear_silu_mul_train`'s autograd calls it (and torch's
    /// autograd of the composite works: four products).
    fn example(&self, shape: Option<&[usize]>, dtype: DType) -> Result<Example> {
        let forward = crate::linear_gated_mul::LinearGatedMul::SILU_TRAIN.example(shape, dtype)?;
        let x = forward.input_shape(0);
        let mut y = x.clone();
        *y.last_mut().unwrap() = forward.input_shape(1)[0];
        let y = TensorMeta::contiguous(dtype, &y)?;
        let mut inputs = vec![Some(y.clone())];
        inputs.extend(forward.inputs);
        inputs.extend([Some(y.clone()), Some(y)]);
        Ok(Example { inputs, ..Default::default() })
    }
}
