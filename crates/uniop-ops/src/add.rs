//! `add(a, b, alpha=1) = a + alpha·b` with NumPy/torch broadcasting.
//!
//! Float dtypes compute in f32 (f16/bf16 widened); integer dtypes compute natively with wrapping
//! arithmetic and need an integral `alpha`, as torch requires.

use crate::elementwise::{self, Map2};
use uniop::{
    block_dim_for, with_float_dtype, BlockCtx, DType, Element, ErrorCode, Example, KernelArgs, Op, OpCx, Plan,
    RefTensor, Result, Step, StridedRuns, TensorMeta,
};

pub struct Add;

/// `a + alpha·b` on one f32 chunk.
struct AxpyMap(f32);

impl Map2 for AxpyMap {
    #[inline(always)]
    fn apply<T: Element>(&self, a: f32, b: f32) -> f32 {
        a + self.0 * b
    }
}

const DTYPES: &[DType] = &[DType::F32, DType::F16, DType::BF16, DType::I32, DType::I64];

impl Op for Add {
    fn schema(&self) -> &'static str {
        "add(Tensor a, Tensor b, *, Scalar alpha=1) -> Tensor out"
    }

    fn doc(&self) -> &'static str {
        "Elementwise a + alpha * b. `a` and `b` broadcast against each other (trailing dims aligned, \
         size-1 or missing dims stretch) and must share a dtype. Integer dtypes need an integral alpha \
         and wrap on overflow."
    }

    fn dtypes(&self) -> &'static [DType] {
        DTYPES
    }

    fn elementwise(&self) -> bool {
        true
    }

    fn backward(&self) -> Option<&'static str> {
        Some("add_backward")
    }

    fn infer(&self, cx: &OpCx) -> Result<Vec<TensorMeta>> {
        let dtype = cx.expect_dtype_in("a", DTYPES)?;
        cx.expect_same_dtype("b", dtype, "a")?;
        let shape = elementwise::broadcast_inputs(cx, "a", "b")?;
        if !dtype.is_float() && cx.scalar_int("alpha").is_none() {
            return Err(cx.err(
                ErrorCode::ParamInvalid,
                "alpha",
                format!("an integral value for {dtype} inputs"),
                cx.attr("alpha"),
            ));
        }
        Ok(vec![TensorMeta::contiguous(dtype, &shape)?])
    }

    fn plan(&self, cx: &OpCx) -> Result<Plan> {
        let out = &self.infer(cx)?[0];
        let block_dim = block_dim_for(out.numel(), 3 * out.dtype.size());
        let streaming = elementwise::streams(out);
        // Integer alphas are exact (checked integral in infer); i32 wraps like the arithmetic.
        let int_alpha = cx.scalar_int("alpha").unwrap_or_default();
        let step = match out.dtype {
            DType::I32 => Step::new("add_i32", block_dim, move |args, ctx| add_int::<i32>(args, ctx, int_alpha as i32)),
            DType::I64 => Step::new("add_i64", block_dim, move |args, ctx| add_int::<i64>(args, ctx, int_alpha)),
            dtype => with_float_dtype!(dtype, cx.op(), "a", |T| {
                let map = AxpyMap(cx.float("alpha") as f32);
                Step::new("add", block_dim, move |args, ctx| elementwise::binary::<T, _>(args, ctx, &map, streaming))
            }),
        };
        Ok(Plan::new(vec![step]))
    }

    fn reference(&self, cx: &OpCx, inputs: &[Option<RefTensor>]) -> Result<Vec<RefTensor>> {
        let (a, b) = (inputs[0].as_ref().unwrap(), inputs[1].as_ref().unwrap());
        let alpha = cx.float("alpha");
        // Integer results wrap at the dtype's width, as the kernel's do.
        let wrap: fn(f64) -> f64 = match cx.input("a").dtype {
            DType::I32 => |v| v as i64 as i32 as f64,
            _ => |v| v,
        };
        Ok(vec![elementwise::reference_binary(a, b, |x, y| wrap(x + alpha * y))?])
    }

    fn example(&self, shape: Option<&[usize]>, dtype: DType) -> Result<Example> {
        let shape = shape.unwrap_or(&[4096, 4096]);
        let meta = TensorMeta::contiguous(dtype, shape)?;
        Ok(Example { inputs: vec![Some(meta.clone()), Some(meta)], attrs: vec![], ..Default::default() })
    }
}

trait WrappingInt: Element {
    fn mul_add(self, alpha: Self, b: Self) -> Self;
}
impl WrappingInt for i32 {
    #[inline(always)]
    fn mul_add(self, alpha: i32, b: i32) -> i32 {
        self.wrapping_add(alpha.wrapping_mul(b))
    }
}
impl WrappingInt for i64 {
    #[inline(always)]
    fn mul_add(self, alpha: i64, b: i64) -> i64 {
        self.wrapping_add(alpha.wrapping_mul(b))
    }
}

crate::simd_kernel! {
fn add_int<T: WrappingInt>(args: &KernelArgs, ctx: BlockCtx, alpha: T) {
    let (a, b, out) = (args.input(0), args.input(1), args.output(0));
    let runs = StridedRuns::broadcast(out.layout().shape(), 0, [out.layout(), a.layout(), b.layout()]);
    let range = ctx.split(runs.numel());
    let (da, db) = (a.storage::<T>().expect("dtype dispatched"), b.storage::<T>().expect("dtype dispatched"));
    let [so, sa, sb] = runs.inner_strides();
    for ([o, ao, bo], len) in runs.runs(range.start, range.end) {
        if so == 1 && sa == 1 && sb == 1 {
            // SAFETY: blocks own disjoint output ranges.
            let dst = unsafe { out.slice_mut::<T>(o, len) };
            for ((d, &x), &y) in dst.iter_mut().zip(&da[ao..ao + len]).zip(&db[bo..bo + len]) {
                *d = x.mul_add(alpha, y);
            }
        } else {
            // SAFETY: as above; scattered writes stay within this block's elements.
            let base = unsafe { out.as_mut_ptr::<T>() };
            for j in 0..len {
                unsafe { *base.add(o + j * so) = da[ao + j * sa].mul_add(alpha, db[bo + j * sb]) };
            }
        }
    }
}
}
