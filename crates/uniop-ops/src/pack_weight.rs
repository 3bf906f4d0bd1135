//! `pack_weight(weight, up_weight=None)`: a linear layer's weight laid out once the way uniop's
//! GEMM reads it, for `linear_packed`, `linear_add_packed` and `linear_silu_mul_packed`.
//!
//! Why: a product with a weight in HF's `[out_features, in_features]` layout first packs it into
//! panels (a transpose of words, [`crate::packed_gemm`]), in every call and in every block that
//! multiplies it. At a 512-token prefill of a small model that is 5% of a bf16 `linear_silu_mul`
//! with the weights in cache and 9% with them evicted by the other layers. An inference weight
//! does not change between calls, so an engine packs it once, as CANN's `TransMatmulWeight`, oneDNN's
//! prepacked weights or llama.cpp's repacking do.
//!
//! The layout is a plain tensor of the weight's dtype, so it crosses every frontend (DLPack, the C
//! API, torch) like any other: `[panels, words, 32, per_word]`. `per_word` consecutive input
//! features make a 32-bit word (2 for bf16, the pairs `vdpbf16ps` and AMX multiply; 1 for f32),
//! `words = ceil(in_features / per_word)`, and each panel holds 32 output features (16 of each
//! weight when `up_weight` is given: `linear_silu_mul`'s gate and up weights side by side, so one
//! tile holds both sums of an output), zero-padded to whole words and panels. It depends on neither
//! the CPU nor the micro-kernel's blocking. A packed weight is for products of many rows (prefill):
//! few-row products (decode) stream the unpacked weight, which is the faster route for them.

use crate::linear::Dims;
use crate::matmul::Mat;
use crate::packed_gemm::{pack_weight_panels, packed_weight_shape, Packed, PackedWeight};
use uniop::half::bf16;
use uniop::layout::ShapeDisplay;
use uniop::{
    block_dim_for, BlockCtx, DType, ErrorCode, Example, KernelArgs, LayoutNeed, Op, OpCx, Plan, RefTensor, Result,
    Step, TensorMeta,
};

/// The dtypes uniop's packed GEMM multiplies.
pub(crate) const DTYPES: &[DType] = &[DType::BF16, DType::F32];

pub struct PackWeight;

/// `weight` `[n, k]` (and `up_weight` of the same shape and dtype) as `(n, k)`.
fn weight_dims(cx: &OpCx) -> Result<(usize, usize)> {
    let dtype = cx.expect_dtype_in("weight", DTYPES)?;
    let w = cx.input("weight").shape();
    if w.len() != 2 {
        return Err(cx.err(
            ErrorCode::Shape,
            "weight",
            "shape [out_features, in_features]",
            format!("shape {}", ShapeDisplay(w)),
        ));
    }
    if cx.optional_input("up_weight").is_some() {
        cx.expect_same_dtype("up_weight", dtype, "weight")?;
        cx.expect_shape("up_weight", w)?;
    }
    Ok((w[0], w[1]))
}

/// Checks a packed-weight consumer's `x` `[..., k]`, `out_features` n and `packed_weight`
/// against [`packed_weight_shape`] (a pair when `paired`).
pub(crate) fn packed_dims(cx: &OpCx, paired: bool) -> Result<Dims> {
    let dtype = cx.expect_dtype_in("x", DTYPES)?;
    cx.expect_same_dtype("packed_weight", dtype, "x")?;
    cx.expect_min_rank("x", 1)?;
    let x = cx.input("x").shape();
    let k = *x.last().unwrap();
    let n = cx.int("out_features");
    if n < 0 {
        return Err(cx.err(ErrorCode::ParamInvalid, "out_features", "out_features >= 0", n));
    }
    let n = n as usize;
    let got = cx.input("packed_weight").shape();
    // f64 calls (run by the reference) may carry a bf16 weight's layout, two features a word.
    let elem_size = if dtype == DType::F64 && got.get(3) == Some(&2) { 2 } else { dtype.size() };
    let want = packed_weight_shape(elem_size, n, k, paired);
    if got != want {
        let packed = if paired {
            "a pair of [out_features, in_features] weights"
        } else {
            "a [out_features, in_features] weight"
        };
        return Err(cx.err(
            ErrorCode::Shape,
            "packed_weight",
            format!("shape {} (pack_weight of {packed}, out_features {n}, x {})", ShapeDisplay(&want), ShapeDisplay(x)),
            format!("shape {}", ShapeDisplay(got)),
        ));
    }
    Ok(Dims { rows: x[..x.len() - 1].iter().product(), k, n })
}

/// The packed weight input `i` of a launch, as the GEMM reads it.
pub(crate) fn packed_weight(args: &uniop::KernelArgs, i: usize, d: Dims, paired: bool) -> PackedWeight {
    let t = args.input(i);
    let offset = t.layout().offset() * t.dtype().size();
    PackedWeight { words: t.as_ptr().wrapping_add(offset), n: d.n, k: d.k, paired }
}

/// Element `(j, p)` (output feature, input feature) of weight `which` (0, or 1 for a pair's
/// second) of an f64 packed weight laid out as [`packed_weight_shape`] gives: the reference's
/// weights, recovered from the layout.
pub(crate) fn unpacked(packed: &RefTensor, paired: bool) -> impl Fn(usize, usize, usize) -> f64 + '_ {
    let [_, words, lanes, per_word] = packed.shape[..] else { panic!("packed weights have rank 4") };
    let width = if paired { lanes / 2 } else { lanes };
    move |which, j, p| {
        let lane = which * width + j % width;
        packed.data[((j / width * words + p / per_word) * lanes + lane) * per_word + p % per_word]
    }
}

fn kernel<E: Packed>(args: &KernelArgs, ctx: BlockCtx, (n, k): (usize, usize), panels: usize) {
    let mat = |t: uniop::TensorRef| {
        let s = t.layout().strides();
        // SAFETY: the offset stays inside the bound storage (the executor checked the view).
        let ptr = unsafe { t.storage::<E>().expect("dtype dispatched").as_ptr().add(t.layout().offset()) };
        // [n, k] read as the product's [k, n].
        Mat { ptr, rs: s[1] as isize, cs: s[0] as isize }
    };
    let (first, second) = (mat(args.input(0)), args.optional_input(1).map(mat));
    let mine = ctx.split(panels);
    let out = args.output(0);
    let panel_bytes = out.meta().shape()[1..].iter().product::<usize>() * std::mem::size_of::<E>();
    // SAFETY: the output is contiguous (the plan asked for it) and this block owns panels `mine`.
    unsafe {
        let at = out.as_mut_ptr::<E>().add(out.layout().offset()) as *mut u8;
        pack_weight_panels::<E>(at.add(mine.start * panel_bytes), first, second, (n, k), mine);
    }
}

impl Op for PackWeight {
    fn schema(&self) -> &'static str {
        "pack_weight(Tensor weight, Tensor? up_weight=None) -> Tensor packed_weight"
    }

    fn doc(&self) -> &'static str {
        "A linear weight [out_features, in_features] (HF layout) packed once for linear_packed / \
         linear_add_packed, or with up_weight (same shape) a gate/up pair for linear_silu_mul_packed: \
         [panels, words, 32, per_word] in the weight's dtype, per_word input features a 32-bit word (2 for \
         bfloat16, 1 for float32), 32 output features a panel (16 of each weight for a pair), zero-padded. \
         Saves the GEMM re-packing the weight in every call; for prefill-sized products."
    }

    fn dtypes(&self) -> &'static [DType] {
        DTYPES
    }

    fn infer(&self, cx: &OpCx) -> Result<Vec<TensorMeta>> {
        let (n, k) = weight_dims(cx)?;
        let dtype = cx.input("weight").dtype;
        let paired = cx.optional_input("up_weight").is_some();
        Ok(vec![TensorMeta::contiguous(dtype, &packed_weight_shape(dtype.size(), n, k, paired))?])
    }

    fn plan(&self, cx: &OpCx) -> Result<Plan> {
        let dims = weight_dims(cx)?;
        let dtype = cx.input("weight").dtype;
        let shape = packed_weight_shape(dtype.size(), dims.0, dims.1, cx.optional_input("up_weight").is_some());
        let panels = shape[0];
        let block_dim = block_dim_for(panels, shape[1..].iter().product::<usize>() * dtype.size());
        let step = match dtype {
            DType::BF16 => Step::new("pack_weight", block_dim, move |a, c| kernel::<bf16>(a, c, dims, panels)),
            DType::F32 => Step::new("pack_weight", block_dim, move |a, c| kernel::<f32>(a, c, dims, panels)),
            other => unreachable!("weight_dims admits bfloat16 and float32, not {other}"),
        };
        Ok(Plan::new(vec![step])
            .inputs_need(vec![LayoutNeed::Any, LayoutNeed::Any])
            .outputs_need(vec![LayoutNeed::Contiguous]))
    }

    fn reference(&self, cx: &OpCx, inputs: &[Option<RefTensor>]) -> Result<Vec<RefTensor>> {
        let (n, k) = weight_dims(cx)?;
        let paired = inputs[1].is_some();
        let shape = packed_weight_shape(cx.input("weight").dtype.size(), n, k, paired);
        let [_, words, lanes, per_word] = shape;
        let width = if paired { lanes / 2 } else { lanes };
        let mut out = vec![0.0; shape.iter().product()];
        for (i, v) in out.iter_mut().enumerate() {
            let (e, lane, word, panel) =
                (i % per_word, i / per_word % lanes, i / per_word / lanes % words, i / (per_word * lanes * words));
            let (weight, column) = if lane < width { (0, lane) } else { (1, lane - width) };
            let (j, p) = (panel * width + column, word * per_word + e);
            if j < n && p < k {
                *v = inputs[weight].as_ref().unwrap().data[j * k + p];
            }
        }
        Ok(vec![RefTensor::new(&shape, out)])
    }

    fn example(&self, shape: Option<&[usize]>, dtype: DType) -> Result<Example> {
        // `shape` is the weight's, leading dims flattened into out_features.
        let shape = shape.unwrap_or(&[4096, 4096]);
        let k = shape.last().copied().unwrap_or(1);
        let n = shape[..shape.len().saturating_sub(1)].iter().product();
        Ok(Example { inputs: vec![Some(TensorMeta::contiguous(dtype, &[n, k])?), None], ..Default::default() })
    }
}
