//! `linear_silu_mul(x, gate_weight, up_weight) = silu(x · gate_weightᵀ) · (x · up_weightᵀ)`: the
//! gated half of HF's `LlamaMLP` (`act_fn(gate_proj(x)) * up_proj(x)`, before `down_proj`) as one
//! op, as inference engines fuse it (vLLM's merged gate/up projection and `SiluAndMul`); and
//! `linear_gelu_mul(x, gate_weight, up_weight, approximate)`, the same with GELU (Gemma's GeGLU MLP,
//! vLLM's `GeluAndMul`). Everything below is written once for both ([`crate::gate`]).
//!
//! Why one op rather than two [`linear`](crate::linear)s and a [`silu_mul`](crate::gated_mul):
//! both products read the same `x`, and the activation needs both sums of an output at once.
//! Taken as one packed GEMM whose B panels pair 16 columns of the gate weight with the same 16 of
//! the up weight ([`gemm_rows_pairs`]), `x` is packed once for both products and act·mul runs on
//! the f32 sums while they are in cache, rounding once: no `[rows, intermediate]` gate and up
//! tensors written and read back, no third pass. Where that GEMM does not serve (a few rows,
//! whose products stream the weights; f16; f32 without AVX-512 or deeper than its packed kernel
//! goes), the two products go through chunks of scratch into the same epilogue.
//!
//! No biases: Llama, Mistral, Qwen and Gemma MLPs have none (`mlp_bias=False`); a layer with them
//! is two `linear`s and a `silu_mul` (`gelu_mul`).
//!
//! Three forms of each share this file: `linear_silu_mul` returns `y` alone (inference: nothing
//! else is written), `linear_silu_mul_train` also returns the two products, rounded to the dtype,
//! for its backward to take instead of recomputing them — two of the backward's six products, at
//! the cost of two `[rows, intermediate]` tensors kept from forward to backward, as torch's
//! autograd of the composite keeps them — and `linear_silu_mul_packed` takes the weights packed
//! ahead by `pack_weight`.

use crate::gate::{op_name, with_gate_fn, GateFn, Gating};
use crate::linear::{reference_rows, x_and_weight, Bands, Dims};
use crate::matmul::{gemm_rows, Dst, Mat, DTYPES, PACKED_F32_MAX_K};
use crate::packed_gemm::{gemm_rows_pairs, pairs_apply, PairedWeights, HALF, PAIRED_COLUMNS};
use crate::skinny::{Dots, Simd};
use uniop::half::bf16;
use uniop::{
    with_float_dtype, BlockCtx, DType, Example, FloatElement, KernelArgs, LayoutNeed, Op, OpCx, Plan, RefTensor,
    Result, Step, TensorMeta,
};

pub struct LinearGatedMul {
    form: Form,
    gating: Gating,
}

#[derive(Clone, Copy, PartialEq)]
enum Form {
    /// `linear_silu_mul` (`linear_gelu_mul`): `y` only.
    Inference,
    /// `linear_silu_mul_train` (`linear_gelu_mul_train`): `y`, `gate` and `up`.
    Train,
    /// `linear_silu_mul_packed` (`linear_gelu_mul_packed`): `y` only, the weights packed ahead as a
    /// pair by `pack_weight`.
    Packed,
}

impl LinearGatedMul {
    pub const SILU: LinearGatedMul = LinearGatedMul { form: Form::Inference, gating: Gating::Silu };
    pub const SILU_TRAIN: LinearGatedMul = LinearGatedMul { form: Form::Train, gating: Gating::Silu };
    pub const SILU_PACKED: LinearGatedMul = LinearGatedMul { form: Form::Packed, gating: Gating::Silu };
    pub const GELU: LinearGatedMul = LinearGatedMul { form: Form::Inference, gating: Gating::Gelu };
    pub const GELU_TRAIN: LinearGatedMul = LinearGatedMul { form: Form::Train, gating: Gating::Gelu };
    pub const GELU_PACKED: LinearGatedMul = LinearGatedMul { form: Form::Packed, gating: Gating::Gelu };

    fn dims(&self, cx: &OpCx) -> Result<Dims> {
        match self.form {
            Form::Packed => crate::pack_weight::packed_dims(cx, true),
            _ => dims(cx),
        }
    }

    fn returns_products(&self) -> bool {
        self.form == Form::Train
    }
}

/// Checks `x` `[..., k]` against `gate_weight` and `up_weight` `[n, k]` (shared with the backward).
pub(crate) fn dims(cx: &OpCx) -> Result<Dims> {
    let d = x_and_weight(cx, "gate_weight")?;
    cx.expect_same_dtype("up_weight", cx.input("x").dtype, "x")?;
    cx.expect_shape("up_weight", cx.input("gate_weight").shape())?;
    Ok(d)
}

/// Rows and columns of each product the generic route takes at a time (into block scratch): as
/// many columns as the paired GEMM hands over per row, so one epilogue serves both; rows enough
/// that an f32 product, which transposes its weight chunk first, does so once per 256 rows.
const CHUNK_ROWS: usize = 256;
const CHUNK_COLS: usize = PAIRED_COLUMNS;

/// Scratch bytes one block of the generic route uses: both products' chunks in the op's dtype
/// (at most 4 bytes), then one row of them paired as f32 sums.
pub(crate) const BLOCK_SCRATCH_BYTES: usize = (2 * CHUNK_ROWS * CHUNK_COLS + 2 * CHUNK_COLS) * 4;

/// The op's operands: `x` `[rows, k]` (contiguous) and the two weights, read transposed (`[k, n]`,
/// any strides) or packed ahead as a pair (`linear_silu_mul_packed`).
#[derive(Clone, Copy)]
pub(crate) struct Operands<T> {
    pub x: Mat<T>,
    pub weights: PairedWeights<T>,
}

impl<T: FloatElement> Operands<T> {
    /// From a launch whose inputs start with `x`, `gate_weight`, `up_weight` at `first`.
    pub fn of(args: &KernelArgs, first: usize, d: Dims) -> Operands<T> {
        let mat = |i: usize| {
            let t = args.input(first + i);
            let s = t.layout().strides();
            // SAFETY: the offset stays inside the bound storage (the executor checked the view).
            let ptr = unsafe { t.storage::<T>().unwrap().as_ptr().add(t.layout().offset()) };
            // x is contiguous [rows, k]; a weight [n, k] is read transposed.
            if i == 0 {
                Mat { ptr, rs: d.k as isize, cs: 1 }
            } else {
                Mat { ptr, rs: s[1] as isize, cs: s[0] as isize }
            }
        };
        Operands { x: mat(0), weights: PairedWeights::Weights(mat(1), mat(2)) }
    }

    /// From a `linear_silu_mul_packed` launch: `x`, then the packed pair.
    fn packed(args: &KernelArgs, d: Dims) -> Operands<T> {
        let x = args.input(0);
        // SAFETY: the offset stays inside the bound storage (the executor checked the view).
        let ptr = unsafe { x.storage::<T>().unwrap().as_ptr().add(x.layout().offset()) };
        let weights = PairedWeights::Packed(crate::pack_weight::packed_weight(args, 1, d, true));
        Operands { x: Mat { ptr, rs: d.k as isize, cs: 1 }, weights }
    }
}

/// Depth up to which f32 products pair on AVX-512 and AVX2 CPUs: twice as deep as `gemm_rows` runs its
/// packed kernel ([`PACKED_F32_MAX_K`], past which a column block of packed B leaves the cache),
/// because the generic route costs more here than a `linear` does: each of its 256-row chunks
/// transposes its weight chunk again. At k = 4096 (`uniop bench --ops linear_silu_mul --dtypes f32`,
/// 6 alternations, best-of ms): [512, 4096] on one thread 884-1304 (median 938) generic against
/// 799-1401 (882) paired, on two 450-583 (511) against 401-584 (483); [2048, 4096] on two over 4,
/// 1787-2456 against 1565-2271.
const PAIRED_F32_MAX_K: usize = 2 * PACKED_F32_MAX_K;

/// Whether a block of `rows` rows of a `dtype` product `k` deep takes both products as one paired
/// GEMM ([`gemm_rows_pairs`]) rather than the generic route.
fn paired(dtype: DType, rows: usize, k: usize) -> bool {
    pairs_apply(rows)
        && match dtype {
            DType::BF16 => true,
            DType::F32 => <f32 as Dots>::best() != Simd::Scalar && k <= PAIRED_F32_MAX_K,
            _ => false,
        }
}

/// Workspace bytes for `blocks` blocks of at least `least_rows` rows each (shared with the
/// backward): the generic route's scratch per block, or none where every block pairs.
pub(crate) fn scratch_bytes(dtype: DType, k: usize, blocks: usize, least_rows: usize) -> usize {
    if paired(dtype, least_rows, k) {
        0
    } else {
        blocks * BLOCK_SCRATCH_BYTES
    }
}

/// Both products for output rows `rows` × columns `cols`, handed to `finish(row, first column,
/// sums)` in [`gemm_rows_pairs`]'s paired layout. `scratch` gives this block's
/// [`BLOCK_SCRATCH_BYTES`], which only the generic route asks for.
///
/// # Safety
/// `ops` valid for `d`'s extents.
pub(crate) unsafe fn gate_up_rows<T: FloatElement>(
    rows: std::ops::Range<usize>,
    cols: std::ops::Range<usize>,
    d: Dims,
    ops: Operands<T>,
    scratch: impl FnOnce() -> *mut u8,
    mut finish: impl FnMut(usize, usize, &[f32]),
) {
    let mut shifted = |r, c, sums: &[f32]| finish(r, cols.start + c, sums);
    let n = cols.len();
    // Weights packed ahead take the paired GEMM at any row count: they are packed for it.
    let packed = matches!(ops.weights, PairedWeights::Packed(_));
    if packed || paired(T::DTYPE, rows.len(), d.k) {
        return if T::DTYPE == DType::BF16 {
            let weights = ops.weights.cast::<bf16>().columns_from(cols.start);
            gemm_rows_pairs::<bf16>(rows, n, d.k, ops.x.cast(), weights, &mut shifted)
        } else {
            debug_assert_eq!(T::DTYPE, DType::F32, "only bf16 and f32 pair");
            let weights = ops.weights.cast::<f32>().columns_from(cols.start);
            gemm_rows_pairs::<f32>(rows, n, d.k, ops.x.cast(), weights, &mut shifted)
        };
    }
    let PairedWeights::Weights(gate, up) = ops.weights else { unreachable!("packed weights pair above") };
    let from_col = |m: Mat<T>| Mat { ptr: m.ptr.offset(cols.start as isize * m.cs), ..m };
    let (gate, up) = (from_col(gate), from_col(up));
    // The generic route: each product's chunk into scratch, then paired like gemm_rows_pairs's.
    let scratch = scratch();
    let products = scratch as *mut T;
    let chunk = CHUNK_ROWS * CHUNK_COLS;
    let paired = std::slice::from_raw_parts_mut(scratch.add(2 * chunk * 4) as *mut f32, 2 * CHUNK_COLS);
    for c0 in (0..n).step_by(CHUNK_COLS) {
        let nc = CHUNK_COLS.min(n - c0);
        let width = nc.div_ceil(HALF) * 2 * HALF;
        // Row chunks of even sizes: a last chunk of one row would be a matrix-vector product,
        // which the `gemm` crate sums in f16 for f16 (off by 40 units in the last place at k = 33).
        let chunks = rows.len().div_ceil(CHUNK_ROWS);
        for chunk_index in 0..chunks {
            let r0 = rows.start + chunk_index * rows.len() / chunks;
            let mr = rows.start + (chunk_index + 1) * rows.len() / chunks - r0;
            let x = Mat { ptr: ops.x.ptr.offset(r0 as isize * ops.x.rs), ..ops.x };
            for (i, w) in [gate, up].into_iter().enumerate() {
                let dst = Dst { ptr: products.add(i * chunk), rs: nc as isize, cs: 1 };
                gemm_rows(0..mr, nc, d.k, dst, x, Mat { ptr: w.ptr.offset(c0 as isize * w.cs), ..w }, false);
            }
            for r in 0..mr {
                let row = &mut paired[..width];
                for (half, product) in [products, products.add(chunk)].into_iter().enumerate() {
                    let values = std::slice::from_raw_parts(product.add(r * nc), nc);
                    for (group, values) in row.chunks_exact_mut(2 * HALF).zip(values.chunks(HALF)) {
                        T::widen(values, &mut group[half * HALF..][..values.len()]);
                    }
                }
                shifted(r0 + r, c0, row);
            }
        }
    }
}

crate::simd_kernel! {
/// `out[c] = act(gate sum) · up sum` for one row of paired sums (layout: [`gemm_rows_pairs`]);
/// `out` is as long as the row's outputs (at most [`PAIRED_COLUMNS`]), which the sums may pad.
/// The results are narrowed as one slice: lane by lane, bf16's rounding stayed scalar and took
/// more time than the products.
fn act_mul_pairs<T: FloatElement, A: GateFn>(sums: &[f32], out: &mut [T]) {
    let mut values = [0f32; PAIRED_COLUMNS];
    for (group, v) in sums.chunks_exact(2 * HALF).zip(values.chunks_exact_mut(HALF)) {
        let (gate, up) = group.split_at(HALF);
        for i in 0..HALF {
            v[i] = A::act::<T>(gate[i]) * up[i];
        }
    }
    T::narrow(&values[..out.len()], out);
}
}

crate::simd_kernel! {
/// The gate and up products of one row's paired sums (layout: [`gemm_rows_pairs`]) narrowed into
/// `gate` and `up`, as long as the row's outputs.
fn unpair<T: FloatElement>(sums: &[f32], gate: &mut [T], up: &mut [T]) {
    let groups = sums.chunks_exact(2 * HALF).zip(gate.chunks_mut(HALF).zip(up.chunks_mut(HALF)));
    for (group, (gate, up)) in groups {
        T::narrow(&group[..gate.len()], gate);
        T::narrow(&group[HALF..][..up.len()], up);
    }
}
}

fn kernel<T: FloatElement, A: GateFn>(args: &KernelArgs, ctx: BlockCtx, d: Dims, bands: Bands, form: Form) {
    let (rows, cols) = bands.share(ctx, d);
    if cols.is_empty() || rows.is_empty() {
        return;
    }
    let out = args.output(0);
    let o = out.layout().offset();
    let end = cols.end;
    let products = (form == Form::Train).then(|| {
        [1, 2].map(|i| {
            let t = args.output(i);
            let offset = t.layout().offset();
            (t, offset)
        })
    });
    // SAFETY: this block's own share of the workspace (the plan sized it per block).
    let scratch = || {
        unsafe { args.workspace::<u8>(ctx.block_idx as usize * BLOCK_SCRATCH_BYTES, BLOCK_SCRATCH_BYTES) }.as_mut_ptr()
    };
    let operands = match form {
        Form::Packed => Operands::packed(args, d),
        _ => Operands::of(args, 0, d),
    };
    // SAFETY: x and the outputs are contiguous (the plan asked for it), the weights any strided
    // [n, k] or packed (contiguous); this block owns output rows `rows` × columns `cols` of every
    // output.
    unsafe {
        gate_up_rows::<T>(rows, cols, d, operands, scratch, |r, c, sums| {
            let len = (end - c).min(sums.len() / 2);
            act_mul_pairs::<T, A>(sums, out.slice_mut::<T>(o + r * d.n + c, len));
            if let Some([(gate, g), (up, u)]) = &products {
                let at = r * d.n + c;
                unpair(sums, gate.slice_mut::<T>(g + at, len), up.slice_mut::<T>(u + at, len));
            }
        });
    }
}

/// How much more than a plain GEMM's (√k) the error of a result may grow here, for reference
/// checks: each k-deep sum's error is multiplied by the other factor, itself a k-deep sum (√k-sized
/// for unit-sized inputs). That matters where the tolerance is the sums' error: f32, and f16,
/// whose products the `gemm` crate sums with f16 roundings on the way (its `linear` is off by 0.1
/// at k = 4096). bf16 sums are f32 rounded once, so a bf16 result's error is its own rounding,
/// relative to the result.
fn other_factor(cx: &OpCx, d: Dims) -> f64 {
    if cx.input("x").dtype == DType::BF16 {
        1.0
    } else {
        (d.k.max(1) as f64).sqrt()
    }
}

impl Op for LinearGatedMul {
    fn schema(&self) -> &'static str {
        match (self.gating, self.form) {
            (Gating::Silu, Form::Inference) => {
                "linear_silu_mul(Tensor x, Tensor gate_weight, Tensor up_weight) -> Tensor y"
            }
            (Gating::Silu, Form::Train) => {
                "linear_silu_mul_train(Tensor x, Tensor gate_weight, Tensor up_weight) -> (Tensor y, Tensor gate, Tensor up)"
            }
            (Gating::Silu, Form::Packed) => {
                "linear_silu_mul_packed(Tensor x, Tensor packed_weight, int out_features) -> Tensor y"
            }
            (Gating::Gelu, Form::Inference) => {
                "linear_gelu_mul(Tensor x, Tensor gate_weight, Tensor up_weight, str approximate='none') -> Tensor y"
            }
            (Gating::Gelu, Form::Train) => {
                "linear_gelu_mul_train(Tensor x, Tensor gate_weight, Tensor up_weight, str approximate='none') -> \
                 (Tensor y, Tensor gate, Tensor up)"
            }
            (Gating::Gelu, Form::Packed) => {
                "linear_gelu_mul_packed(Tensor x, Tensor packed_weight, int out_features, str approximate='none') -> \
                 Tensor y"
            }
        }
    }

    fn doc(&self) -> &'static str {
        match (self.gating, self.form) {
            (Gating::Silu, Form::Inference) => {
                "y = silu(x @ gate_weight^T) * (x @ up_weight^T): HF LlamaMLP's act_fn(gate_proj(x)) * up_proj(x) in \
                 one op (no biases). Weights [intermediate_size, hidden_size] (HF layout), x [..., hidden_size]. Both \
                 products run as one GEMM (x packed once, f32 sums, silu*mul applied before the single rounding). \
                 Under autograd its backward recomputes the products; linear_silu_mul_train returns them instead."
            }
            (Gating::Silu, Form::Train) => {
                "linear_silu_mul for training: y as linear_silu_mul's, plus the products gate = x @ gate_weight^T and \
                 up = x @ up_weight^T (rounded to x's dtype; not differentiable), which linear_silu_mul_backward takes \
                 instead of recomputing them: four products in the backward instead of six, for two [..., \
                 intermediate_size] tensors kept in between."
            }
            (Gating::Silu, Form::Packed) => {
                "linear_silu_mul with its weights packed ahead: y = silu(x @ gate_weight^T) * (x @ up_weight^T) for \
                 packed_weight = pack_weight(gate_weight, up_weight), out_features = intermediate_size. bfloat16 and \
                 float32, for prefill-sized x (few rows are faster through linear_silu_mul)."
            }
            (Gating::Gelu, Form::Inference) => {
                "y = gelu(x @ gate_weight^T, approximate) * (x @ up_weight^T): HF GemmaMLP's act_fn(gate_proj(x)) * \
                 up_proj(x) in one op (no biases; Gemma's gelu_pytorch_tanh is approximate='tanh'), as \
                 linear_silu_mul with GELU: weights [intermediate_size, hidden_size], x [..., hidden_size], both \
                 products as one GEMM. linear_gelu_mul_train returns the products for the backward."
            }
            (Gating::Gelu, Form::Train) => {
                "linear_gelu_mul for training: y as linear_gelu_mul's, plus the products gate = x @ gate_weight^T and \
                 up = x @ up_weight^T (rounded to x's dtype; not differentiable), which linear_gelu_mul_backward takes \
                 instead of recomputing them."
            }
            (Gating::Gelu, Form::Packed) => {
                "linear_gelu_mul with its weights packed ahead: y = gelu(x @ gate_weight^T, approximate) * (x @ \
                 up_weight^T) for packed_weight = pack_weight(gate_weight, up_weight), out_features = \
                 intermediate_size. bfloat16 and float32, for prefill-sized x."
            }
        }
    }

    fn leading_batch_args(&self) -> &'static [&'static str] {
        &["x"]
    }

    fn dtypes(&self) -> &'static [DType] {
        match self.form {
            Form::Packed => crate::pack_weight::DTYPES,
            _ => DTYPES,
        }
    }

    fn backward(&self) -> Option<&'static str> {
        let backward = match self.gating {
            Gating::Silu => "linear_silu_mul_backward",
            Gating::Gelu => "linear_gelu_mul_backward",
        };
        (self.form != Form::Packed).then_some(backward)
    }

    fn autocast(&self) -> uniop::Autocast {
        uniop::Autocast::LowerPrecision
    }

    fn error_scale(&self, cx: &OpCx) -> f64 {
        self.dims(cx).map_or(1.0, |d| (d.k.max(1) as f64).sqrt() * other_factor(cx, d))
    }

    fn infer(&self, cx: &OpCx) -> Result<Vec<TensorMeta>> {
        let d = self.dims(cx)?;
        self.gating.activation(cx)?;
        let mut shape = cx.input("x").shape().to_vec();
        *shape.last_mut().unwrap() = d.n;
        let y = TensorMeta::contiguous(cx.input("x").dtype, &shape)?;
        Ok(vec![y; if self.returns_products() { 3 } else { 1 }])
    }

    fn plan(&self, cx: &OpCx) -> Result<Plan> {
        let d = self.dims(cx)?;
        let (form, activation) = (self.form, self.gating.activation(cx)?);
        // A row band packs both weights (2n columns), unless they come packed.
        let packs = if form == Form::Packed { 0 } else { 2 * d.n };
        let (bands, block_dim) = Bands::choose(cx.input("x").dtype, d, packs);
        let name = op_name(self.schema());
        let step = with_float_dtype!(cx.input("x").dtype, cx.op(), "x", |T| with_gate_fn!(activation, |A| {
            Step::new(name, block_dim as u32, move |args, ctx| kernel::<T, A>(args, ctx, d, bands, form))
        }));
        let least_rows = bands.least_rows(d, block_dim);
        // Packed weights always take the paired GEMM, which needs no scratch.
        let workspace =
            if form == Form::Packed { 0 } else { scratch_bytes(cx.input("x").dtype, d.k, block_dim, least_rows) };
        let weights = if form == Form::Packed { LayoutNeed::Contiguous } else { LayoutNeed::Any };
        Ok(Plan::new(vec![step])
            .workspace(workspace)
            .inputs_need(vec![LayoutNeed::Contiguous, weights, LayoutNeed::Any])
            .outputs_need(vec![LayoutNeed::Contiguous; if self.returns_products() { 3 } else { 1 }]))
    }

    fn reference(&self, cx: &OpCx, inputs: &[Option<RefTensor>]) -> Result<Vec<RefTensor>> {
        let d = self.dims(cx)?;
        let activation = self.gating.activation(cx)?;
        let x = inputs[0].as_ref().unwrap();
        let (gate, up) = if self.form == Form::Packed {
            let weights = crate::pack_weight::unpacked(inputs[1].as_ref().unwrap(), true);
            let product = |which| reference_rows(d, x, |j, p| weights(which, j, p), |_, _| 0.0);
            (product(0), product(1))
        } else {
            reference_products(d, inputs, 0)
        };
        let y = gate.iter().zip(&up).map(|(&g, &u)| activation.exact(g) * u).collect();
        let mut shape = x.shape.clone();
        *shape.last_mut().unwrap() = d.n;
        let mut returns = vec![RefTensor::new(&shape, y)];
        if self.returns_products() {
            returns.extend([RefTensor::new(&shape, gate), RefTensor::new(&shape, up)]);
        }
        Ok(returns)
    }

    fn example(&self, shape: Option<&[usize]>, dtype: DType) -> Result<Example> {
        // `shape` is x's; the weights map hidden_size k to Llama's intermediate size for it
        // (8k/3 rounded up to a multiple of 256: 384 -> 1024, 4096 -> 11008).
        let shape = shape.unwrap_or(&[2048, 4096]);
        let k = shape.last().copied().unwrap_or(1);
        let x = Some(TensorMeta::contiguous(dtype, if shape.is_empty() { &[1] } else { shape })?);
        let n = (8 * k).div_ceil(3).next_multiple_of(256);
        if self.form == Form::Packed {
            let packed = crate::packed_gemm::packed_weight_shape(dtype.size(), n, k, true);
            return Ok(Example {
                inputs: vec![x, Some(TensorMeta::contiguous(dtype, &packed)?)],
                attrs: vec![("out_features".into(), uniop::AttrValue::Int(n as i64))],
                ..Default::default()
            });
        }
        let weight = TensorMeta::contiguous(dtype, &[n, k])?;
        Ok(Example { inputs: vec![x, Some(weight.clone()), Some(weight)], ..Default::default() })
    }
}

/// The gate and up products `[rows, n]` in f64, from reference inputs `x`, `gate_weight`,
/// `up_weight` at positions `first..first + 3` (shared with the backward's reference).
pub(crate) fn reference_products(d: Dims, inputs: &[Option<RefTensor>], first: usize) -> (Vec<f64>, Vec<f64>) {
    let x = inputs[first].as_ref().unwrap();
    let product = |w: &RefTensor| reference_rows(d, x, |j, p| w.data[j * d.k + p], |_, _| 0.0);
    (product(inputs[first + 1].as_ref().unwrap()), product(inputs[first + 2].as_ref().unwrap()))
}
