//! `rope(x, cos, sin, mode='half', per_pair=False)`: rotary position embedding.
//!
//! `cos` and `sin` have shape `[..., W]` and broadcast (NumPy rules) against `x` with its last dim
//! replaced by `W`, the tables' width. The rotary dim `R` (even, at most `x`'s last dim `D`) is `W`,
//! or `2W` with `per_pair`; elements `R..D` of each row pass through unchanged (partial rotary). So
//! `x` `[B, S, N, D]` takes `cos` `[S, 1, W]` and `[B, N, S, D]` takes `[S, W]` — any layout,
//! through strides.
//!
//! Modes (the two conventions in use): `half` pairs element `i` with `i + R/2` (HF/NeoX
//! `rotate_half`): `out = x·cos + rotate_half(x)·sin`, `rotate_half(x) = cat(−x₂, x₁)`;
//! `interleave` pairs `2i` with `2i+1` (GPT-J).
//!
//! Tables come in the two forms in use. By default one value per rotated element, in the same
//! layout as the rotated part of `x` (HF's `cat(freqs, freqs)` for `half`, `repeat_interleave` for
//! `interleave`). With `per_pair`, one value per pair (`W = R/2`, pair `i`'s angle at `i`): the
//! tables of flash-attn's `apply_rotary_emb`, vLLM's cache and GPT-OSS's rotary embedding, read at
//! half the bytes. A table width alone cannot tell the two apart (a partial rotary dim of `D/2` has
//! full tables `D/2` wide), so the caller says which. `rope_cos_sin` builds either.

use crate::elementwise::{converts_with, fence, narrow_step, streams_bytes, widen_step, LANES};
use uniop::layout::ShapeDisplay;
use uniop::{
    block_dim_for, with_float_dtype, BlockCtx, DType, ErrorCode, Example, FloatElement, KernelArgs, LayoutNeed, Op,
    OpCx, Plan, RefTensor, Result, Step, StridedRuns, TensorMeta,
};

pub struct Rope;

pub(crate) const DTYPES: &[DType] = &[DType::F32, DType::F16, DType::BF16];

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Mode {
    Half,
    Interleave,
}

/// Checked geometry shared by `rope` and `rope_backward` (`x` names the rotated tensor).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Geometry {
    pub dtype: DType,
    pub mode: Mode,
    pub per_pair: bool,
    pub rows: usize,
    pub d: usize,
    /// The rotary dim.
    pub r: usize,
    /// The tables' width: `r`, or `r / 2` with `per_pair`.
    pub w: usize,
}

/// How [`rotate_row`] pairs elements and reads their tables, and which way it turns them.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Rotation {
    pub mode: Mode,
    /// One table value per pair (see the module docs).
    pub per_pair: bool,
    /// The transposed rotation (the gradient).
    pub inverse: bool,
}

impl Rotation {
    /// The rotary dim of tables `w` wide.
    pub fn rotary_dim(self, w: usize) -> usize {
        if self.per_pair {
            2 * w
        } else {
            w
        }
    }
}

pub(crate) fn geometry(cx: &OpCx, x: &str) -> Result<Geometry> {
    let dtype = cx.expect_dtype_in(x, DTYPES)?;
    let mode = match cx.attr("mode") {
        uniop::AttrValue::Str(s) if s == "half" => Mode::Half,
        uniop::AttrValue::Str(s) if s == "interleave" => Mode::Interleave,
        other => return Err(cx.err(ErrorCode::ParamInvalid, "mode", "'half' or 'interleave'", other)),
    };
    cx.expect_min_rank(x, 1)?;
    let shape = cx.input(x).shape();
    let d = *shape.last().unwrap();
    let cos = cx.input("cos");
    for name in ["cos", "sin"] {
        let t = cx.input(name);
        if t.dtype != dtype && t.dtype != DType::F32 {
            return Err(cx.err(ErrorCode::DType, name, format!("dtype {dtype} (same as '{x}') or float32"), t.dtype));
        }
        if t.rank() == 0 {
            return Err(cx.err(ErrorCode::Shape, name, "rank ≥ 1 ([..., rotary_dim])", "a scalar"));
        }
    }
    if cx.input("sin").shape() != cos.shape() || cx.input("sin").dtype != cos.dtype {
        return Err(cx.err(ErrorCode::Shape, "sin", format!("the shape and dtype of cos ({cos})"), cx.input("sin")));
    }
    let per_pair = matches!(cx.attr("per_pair"), uniop::AttrValue::Bool(true));
    let w = *cos.shape().last().unwrap();
    let r = if per_pair { w.checked_mul(2).filter(|&r| r <= d) } else { Some(w).filter(|&r| r % 2 == 0 && r <= d) };
    let Some(r) = r else {
        let expected = if per_pair {
            format!(
                "one value per rotated pair (last dim) ≤ {}, half the head dim of {x} {}",
                d / 2,
                ShapeDisplay(shape)
            )
        } else {
            format!("an even rotary dim (last dim) ≤ {d}, the head dim of {x} {}", ShapeDisplay(shape))
        };
        return Err(cx.err(ErrorCode::Shape, "cos", expected, w));
    };
    let mut rotated = shape.to_vec();
    *rotated.last_mut().unwrap() = w;
    if uniop::broadcast_shapes(cos.shape(), &rotated).as_deref() != Some(&rotated[..]) {
        return Err(cx.err(
            ErrorCode::Shape,
            "cos",
            format!("a shape that broadcasts to {} ({x} with the tables' width last)", ShapeDisplay(&rotated)),
            ShapeDisplay(cos.shape()),
        ));
    }
    Ok(Geometry { dtype, mode, per_pair, rows: shape[..shape.len() - 1].iter().product(), d, r, w })
}

/// The rotation of one pair `(a, b)` by `(cos_a, sin_a)`, `(cos_b, sin_b)`; `inverse` applies
/// its transpose (the gradient).
#[inline(always)]
pub(crate) fn rotate(a: f32, b: f32, ca: f32, sa: f32, cb: f32, sb: f32, inverse: bool) -> (f32, f32) {
    if inverse {
        (a * ca + b * sb, b * cb - a * sa)
    } else {
        (a * ca - b * sa, b * cb + a * sb)
    }
}

/// Rotates one row of `d` elements (`rot.rotary_dim(cos.len())` of them rotated), `N` lanes at a
/// time (see [`step_lanes`]; the last step padded when `N` does not divide the rotated span);
/// widened by the CPU's instruction when `NATIVE` (only where `T::converts_natively()`: see
/// `elementwise::to_f32`).
#[inline(always)]
pub(crate) fn rotate_row<T: FloatElement, C: FloatElement, const N: usize, const NATIVE: bool>(
    x: &[T],
    cos: &[C],
    sin: &[C],
    out: &mut [T],
    rot: Rotation,
) {
    const { assert!(converts_with::<T, C>(), "cos/sin in x's dtype or f32") };
    let r = rot.rotary_dim(cos.len());
    let inverse = rot.inverse;
    match rot.mode {
        Mode::Half => {
            let h = r / 2;
            // The second half's tables: their own, or the first half's (one value per pair).
            let second = if rot.per_pair { 0 } else { h };
            for i in (0..h).step_by(N) {
                let n = N.min(h - i);
                let [bx, by]: [[f32; N]; 2] =
                    [widen_step::<_, NATIVE, N>(&x[i..i + n]), widen_step::<_, NATIVE, N>(&x[h + i..h + i + n])];
                let (j, n2) = (second + i, second + i + n);
                let [bc, bs, bc2, bs2]: [[f32; N]; 4] = [
                    widen_step::<_, NATIVE, N>(&cos[i..i + n]),
                    widen_step::<_, NATIVE, N>(&sin[i..i + n]),
                    widen_step::<_, NATIVE, N>(&cos[j..n2]),
                    widen_step::<_, NATIVE, N>(&sin[j..n2]),
                ];
                let (mut bo, mut bo2) = ([0f32; N], [0f32; N]);
                for k in 0..N {
                    (bo[k], bo2[k]) = rotate(bx[k], by[k], bc[k], bs[k], bc2[k], bs2[k], inverse);
                }
                narrow_step::<_, NATIVE, N>(&bo, &mut out[i..i + n]);
                narrow_step::<_, NATIVE, N>(&bo2, &mut out[h + i..h + i + n]);
            }
        }
        Mode::Interleave => {
            for i in (0..r).step_by(N) {
                let n = N.min(r - i);
                // The step's tables: one value per element, or per pair (half as many).
                let t = if rot.per_pair { i / 2..(i + n) / 2 } else { i..i + n };
                let [bx, bc, bs]: [[f32; N]; 3] = [
                    widen_step::<_, NATIVE, N>(&x[i..i + n]),
                    widen_step::<_, NATIVE, N>(&cos[t.clone()]),
                    widen_step::<_, NATIVE, N>(&sin[t]),
                ];
                let mut bo = [0f32; N];
                for k in (0..N).step_by(2) {
                    let (a, b) = if rot.per_pair { (k / 2, k / 2) } else { (k, k + 1) };
                    (bo[k], bo[k + 1]) = rotate(bx[k], bx[k + 1], bc[a], bs[a], bc[b], bs[b], inverse);
                }
                narrow_step::<_, NATIVE, N>(&bo, &mut out[i..i + n]);
            }
        }
    }
    out[r..].copy_from_slice(&x[r..]);
}

crate::simd_kernel! {
/// Input 0 is rotated into output 0 with inputs 1 (cos) and 2 (sin), row by row. `streaming`
/// (an output past the last-level cache) writes the rows past the cache where the AVX2 rows run;
/// the generic rows keep ordinary stores.
pub(crate) fn kernel<T: FloatElement, C: FloatElement, const N: usize>(
    args: &KernelArgs,
    ctx: BlockCtx,
    g: Geometry,
    inverse: bool,
    streaming: bool,
) {
    let (x, cos, sin) = (args.input(0), args.input(1), args.input(2));
    let out = args.output(0);
    let rot = Rotation { mode: g.mode, per_pair: g.per_pair, inverse };
    let (xs, cs, ss) = (x.storage::<T>().unwrap(), cos.storage::<C>().unwrap(), sin.storage::<C>().unwrap());
    // Rows of x, out and the tables stretched to x's rows (their last dims, not walked, differ).
    let walk = StridedRuns::broadcast(x.shape(), 1, [x.layout(), out.layout(), cos.layout(), sin.layout()]);
    let steps = walk.inner_strides();
    let range = ctx.split(g.rows);
    #[cfg(target_arch = "x86_64")]
    let avx2 = crate::rows_avx2::applies::<T>();
    for (starts, len) in walk.runs(range.start, range.end) {
        for j in 0..len {
            let [xo, oo, co, so] = std::array::from_fn(|k| starts[k] + j * steps[k]);
            // SAFETY: this block owns rows `split(rows)` of out.
            let dst = unsafe { out.slice_mut::<T>(oo, g.d) };
            // Tables of width 0 (nothing rotated) may have no storage to index.
            let (cos, sin) = if g.w == 0 { (&cs[..0], &ss[..0]) } else { (&cs[co..co + g.w], &ss[so..so + g.w]) };
            let x = &xs[xo..xo + g.d];
            #[cfg(target_arch = "x86_64")]
            if avx2 {
                crate::rows_avx2::rotate(x, cos, sin, dst, rot, streaming);
                continue;
            }
            if T::converts_natively() {
                rotate_row::<T, C, N, true>(x, cos, sin, dst, rot);
            } else {
                rotate_row::<T, C, N, false>(x, cos, sin, dst, rot);
            }
        }
    }
    fence();
}
}

/// Lanes per step for rows rotating `g.r` dims: the widest of 64, 32, 16 that divides the span
/// rotated together (a half in mode 'half'). head_dim 64 rotates 32-wide halves; 64-lane steps
/// there are all partial ones, staged through memory (rope on [1, 6, 512, 64] ran at a fifth of
/// the speed). Spans no width divides take 64-lane steps and a padded last one.
fn step_lanes(g: &Geometry) -> usize {
    let span = if g.mode == Mode::Half { g.r / 2 } else { g.r };
    [LANES, 32, 16].into_iter().find(|n| span.is_multiple_of(*n)).unwrap_or(LANES)
}

/// The plan shared with `rope_backward`: one row kernel; every tensor's last dim dense.
pub(crate) fn plan(cx: &OpCx, x: &str, inverse: bool) -> Result<Plan> {
    let g = geometry(cx, x)?;
    let block_dim = block_dim_for(g.rows, 2 * g.d * g.dtype.size());
    let cos_f32 = cx.input("cos").dtype == DType::F32;
    let streaming = streams_bytes(g.rows * g.d * g.dtype.size());
    let step = with_float_dtype!(g.dtype, cx.op(), x, |T| {
        // The kernel for this row width, with cos/sin read as f32 or as x's type.
        fn step<T: FloatElement, C: FloatElement, const N: usize>(
            g: Geometry,
            inverse: bool,
            streaming: bool,
            blocks: u32,
        ) -> Step {
            Step::new("rope", blocks, move |a, c| kernel::<T, C, N>(a, c, g, inverse, streaming))
        }
        let pick = |n: usize| -> fn(Geometry, bool, bool, u32) -> Step {
            match (cos_f32, n) {
                (true, 32) => step::<T, f32, 32>,
                (true, 16) => step::<T, f32, 16>,
                (true, _) => step::<T, f32, LANES>,
                (false, 32) => step::<T, T, 32>,
                (false, 16) => step::<T, T, 16>,
                (false, _) => step::<T, T, LANES>,
            }
        };
        pick(step_lanes(&g))(g, inverse, streaming, block_dim)
    });
    Ok(Plan::new(vec![step])
        .inputs_need(vec![LayoutNeed::InnerContiguous; 3])
        .outputs_need(vec![LayoutNeed::InnerContiguous]))
}

/// f64 rotation of every row (`inverse` for the gradient).
pub(crate) fn reference(
    cx: &OpCx,
    x_name: &str,
    inputs: &[Option<RefTensor>],
    inverse: bool,
) -> Result<Vec<RefTensor>> {
    let g = geometry(cx, x_name)?;
    let [x, cos, sin] = [0, 1, 2].map(|i| inputs[i].as_ref().unwrap());
    let mut rotated = x.shape.clone();
    *rotated.last_mut().unwrap() = g.w;
    let mut out = x.data.clone();
    let h = g.r / 2;
    for row in 0..g.rows {
        let c = |k: usize| cos.broadcast_get(&rotated, row * g.w + k);
        let s = |k: usize| sin.broadcast_get(&rotated, row * g.w + k);
        for p in 0..h {
            let (i, j) = match g.mode {
                Mode::Half => (p, p + h),
                Mode::Interleave => (2 * p, 2 * p + 1),
            };
            // The tables' index of each element of the pair: its own, or the pair's.
            let (ti, tj) = if g.per_pair { (p, p) } else { (i, j) };
            let (a, b) = (x.data[row * g.d + i], x.data[row * g.d + j]);
            let (oa, ob) = if inverse {
                (a * c(ti) + b * s(tj), b * c(tj) - a * s(ti))
            } else {
                (a * c(ti) - b * s(ti), b * c(tj) + a * s(tj))
            };
            out[row * g.d + i] = oa;
            out[row * g.d + j] = ob;
        }
    }
    Ok(vec![RefTensor::new(&x.shape, out)])
}

/// `[B, N, S, D]` activations with `[S, D]` tables (HF's layout after the head transpose).
pub(crate) fn example(shape: Option<&[usize]>, dtype: DType) -> Result<Example> {
    let shape = shape.unwrap_or(&[1, 32, 2048, 128]);
    let x = TensorMeta::contiguous(dtype, shape)?;
    // Rotate the largest even part of the head dim (all of it for even head dims).
    let mut table = shape[shape.len().saturating_sub(2)..].to_vec();
    if let Some(d) = table.last_mut() {
        *d -= *d % 2;
    }
    let cos = TensorMeta::contiguous(dtype, &table)?;
    Ok(Example { inputs: vec![Some(x), Some(cos.clone()), Some(cos)], attrs: vec![], ..Default::default() })
}

impl Op for Rope {
    fn schema(&self) -> &'static str {
        "rope(Tensor x, Tensor cos, Tensor sin, str mode='half', bool per_pair=False) -> Tensor out"
    }

    fn doc(&self) -> &'static str {
        "Rotary position embedding. cos/sin: [..., W], broadcasting against x with its last dim replaced by W. \
         The rotary dim R (even, <= head dim; the rest passes through) is W: one value per rotated element, in \
         the rotated part's layout (HF's tables), or with per_pair 2W: one value per pair (flash-attn's, vLLM's, \
         GPT-OSS's tables). mode 'half' pairs i with i+R/2 (HF/NeoX rotate_half), 'interleave' pairs 2i with 2i+1 \
         (GPT-J). cos/sin in x's dtype or float32."
    }

    /// A row of x and the tables' rows at its broadcast index: a batch of x, of the tables (one per
    /// sample's positions) or of both is one call.
    fn core_dims(&self) -> &'static [(&'static str, usize)] {
        &[("x", 1), ("cos", 1), ("sin", 1)]
    }

    fn dtypes(&self) -> &'static [DType] {
        DTYPES
    }

    fn backward(&self) -> Option<&'static str> {
        Some("rope_backward")
    }

    fn infer(&self, cx: &OpCx) -> Result<Vec<TensorMeta>> {
        let g = geometry(cx, "x")?;
        Ok(vec![TensorMeta::contiguous(g.dtype, cx.input("x").shape())?])
    }

    fn plan(&self, cx: &OpCx) -> Result<Plan> {
        plan(cx, "x", false)
    }

    fn reference(&self, cx: &OpCx, inputs: &[Option<RefTensor>]) -> Result<Vec<RefTensor>> {
        reference(cx, "x", inputs, false)
    }

    fn example(&self, shape: Option<&[usize]>, dtype: DType) -> Result<Example> {
        example(shape, dtype)
    }
}
