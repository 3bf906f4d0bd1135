//! `matmul_backward(dout, a, b, needs_da=True, needs_db=True) -> (da, db)`, the gradient of
//! [`matmul`](crate::matmul):
//! `da = dout · bᵀ` and `db = aᵀ · dout` per batch, **summed over the batches an operand was
//! broadcast to** — a `[K, N]` weight shared by every batch gets the sum of all their products,
//! and `da`/`db` keep `a`'s and `b`'s own shapes.
//!
//! Two launches, each unit one (operand batch, band of rows) that owns its output rows and sums
//! the products of the output batches that read it, in order (see [`sum_of_products`]): no
//! atomics, so the sums are deterministic. Transposes are strides. A gradient nobody asked for
//! (`needs_d<operand>` false: a frozen weight, input data) is left out, its launch with it, and
//! comes back empty.

use crate::matmul::{dims, gemm_rows, narrow_matrix, widen_matrix, Dims, Dst, Mat, DTYPES};
use std::sync::Arc;
use uniop::{
    with_float_dtype, BlockCtx, DType, Example, FloatElement, KernelArgs, Layout, Op, OpCx, Plan, RefTensor, Result,
    Step, TensorMeta,
};

pub struct MatmulBackward;

fn checked_dims(cx: &OpCx) -> Result<Dims> {
    let d = dims(cx)?;
    cx.expect_same_dtype("dout", cx.input("a").dtype, "a")?;
    cx.expect_shape("dout", &d.out_shape())?;
    Ok(d)
}

/// Maps an output batch to the batch of an operand (shape `shape`, matrix dims last) it reads.
fn batch_index(shape: &[usize], batch: &[usize]) -> Layout {
    Layout::contiguous(&shape[..shape.len() - 2]).and_then(|own| own.broadcast_to(batch)).expect("checked by dims()")
}

/// For each batch of an operand (shape `shape`, matrix dims last), the output batches that read
/// it, in order.
fn readers(shape: &[usize], batch: &[usize]) -> Vec<Vec<usize>> {
    let index = batch_index(shape, batch);
    let mut readers = vec![Vec::new(); shape[..shape.len() - 2].iter().product()];
    for bi in 0..batch.iter().product() {
        readers[index.offset_of_linear(bi)].push(bi);
    }
    readers
}

/// Element offset of batch `i` of a tensor whose batch dims are its leading ones.
fn batch_offset(l: &Layout, i: usize) -> usize {
    let r = l.rank();
    Layout::strided(&l.shape()[..r - 2], &l.strides()[..r - 2], l.offset()).expect("a sub-layout").offset_of_linear(i)
}

fn matrix_strides(l: &Layout) -> (isize, isize) {
    let s = l.strides();
    (s[s.len() - 2] as isize, s[s.len() - 1] as isize)
}

/// The GEMM one step does per (operand batch, reader): `grad[own] (+)= lhs[..] · rhs[..]`.
#[derive(Clone, Copy)]
enum Grad {
    /// `da[ab] = Σ dout[bi] · b[bb]ᵀ`: `[M, N] · [N, K]`.
    A,
    /// `db[bb] = Σ a[ba]ᵀ · dout[bi]`: `[K, M] · [M, N]`.
    B,
}

fn kernel<T: FloatElement>(
    args: &KernelArgs,
    ctx: BlockCtx,
    d: &Dims,
    grad: Grad,
    readers: &[Vec<usize>],
    tiles: usize,
) {
    let (dout, a, b) = (args.input(0), args.input(1), args.input(2));
    let out = args.output(match grad {
        Grad::A => 0,
        Grad::B => 1,
    });
    let (rows, cols, depth) = match grad {
        Grad::A => (d.m, d.k, d.n),
        Grad::B => (d.k, d.n, d.m),
    };
    let (la, lb) = (a.layout(), b.layout());
    let (a_batch, b_batch) = (batch_index(la.shape(), &d.batch), batch_index(lb.shape(), &d.batch));
    let ((d_rs, d_cs), (a_rs, a_cs), (b_rs, b_cs), (o_rs, o_cs)) =
        (matrix_strides(dout.layout()), matrix_strides(la), matrix_strides(lb), matrix_strides(out.layout()));
    let (dp, ap, bp) =
        (dout.storage::<T>().unwrap().as_ptr(), a.storage::<T>().unwrap().as_ptr(), b.storage::<T>().unwrap().as_ptr());
    // SAFETY: each unit owns a band of rows of one operand batch of the output.
    let op = unsafe { out.as_mut_ptr::<T>() };
    for unit in ctx.split(readers.len() * tiles) {
        let (own, tile) = (unit / tiles, unit % tiles);
        let band = BlockCtx { block_idx: tile as u32, block_num: tiles as u32 }.split(rows);
        let dst = Dst { ptr: unsafe { op.add(batch_offset(out.layout(), own)) }, rs: o_rs, cs: o_cs };
        if readers[own].is_empty() {
            // Broadcast to a 0-size batch: nothing reads it, its gradient is zero.
            for r in band {
                for c in 0..cols {
                    // SAFETY: inside this unit's band.
                    unsafe { *dst.ptr.offset(r as isize * o_rs + c as isize * o_cs) = T::from_f64(0.0) };
                }
            }
            continue;
        }
        let product = |bi: usize| {
            let dout_m = Mat { ptr: unsafe { dp.add(batch_offset(dout.layout(), bi)) }, rs: d_rs, cs: d_cs };
            match grad {
                Grad::A => {
                    let bm = unsafe { bp.add(batch_offset(lb, b_batch.offset_of_linear(bi))) };
                    (dout_m, Mat { ptr: bm, rs: b_cs, cs: b_rs })
                }
                Grad::B => {
                    let am = unsafe { ap.add(batch_offset(la, a_batch.offset_of_linear(bi))) };
                    (Mat { ptr: am, rs: a_cs, cs: a_rs }, dout_m)
                }
            }
        };
        // SAFETY: offsets stay inside the checked views; this unit owns `band` of `dst`.
        unsafe { sum_of_products(band, cols, depth, dst, readers[own].iter().map(|&bi| product(bi))) };
    }
}

/// `dst[band] = Σⱼ lhsⱼ[band] · rhsⱼ` over `depth`-deep products, the sum rounded to `T` once.
///
/// For f32 and bf16, products whose operands follow each other in memory (each one `depth` rows of
/// the depth dim past the last: a weight shared by every batch of a contiguous activation) are one
/// product `depth · count` deep, which the GEMM sums in f32. Other f32 products are summed one at a
/// time in the output; other half-type products, and all of f16's, in an f32 scratch: rounding the
/// running sum to the half type after each of 96 batches took a `[96, 4, 33] · [33, 33]` weight's
/// gradient to 0.05 off.
///
/// # Safety
/// As [`gemm_rows`] for every pair.
unsafe fn sum_of_products<T: FloatElement>(
    band: std::ops::Range<usize>,
    cols: usize,
    depth: usize,
    dst: Dst<T>,
    products: impl ExactSizeIterator<Item = (Mat<T>, Mat<T>)> + Clone,
) {
    let Some((lhs, rhs)) = products.clone().next() else { return };
    let count = products.len();
    let follows = |(j, (l, r)): (usize, (Mat<T>, Mat<T>))| {
        let past = (j * depth) as isize;
        l.ptr == lhs.ptr.wrapping_offset(past * lhs.cs)
            && r.ptr == rhs.ptr.wrapping_offset(past * rhs.rs)
            && (l.rs, l.cs, r.rs, r.cs) == (lhs.rs, lhs.cs, rhs.rs, rhs.cs)
    };
    // Not f16: its GEMM widens B again for every block of rows, which a product 8192 deep cuts thin
    // (`[16, 512, 1024]` f16: 463-490 ms merged, 411-416 summed in f32 below; bf16 234 against 252).
    if T::DTYPE != DType::F16 && products.clone().enumerate().all(follows) {
        return gemm_rows(band, cols, depth * count, dst, lhs, rhs, false);
    }
    if T::DTYPE == DType::F32 || count == 1 {
        for (j, (lhs, rhs)) in products.enumerate() {
            gemm_rows(band.clone(), cols, depth, dst, lhs, rhs, j > 0);
        }
        return;
    }
    thread_local! {
        static SCRATCH: std::cell::RefCell<[Vec<f32>; 3]> = const { std::cell::RefCell::new([Vec::new(), Vec::new(), Vec::new()]) };
    }
    SCRATCH.with_borrow_mut(|[sum, l, r]| {
        sum.clear();
        sum.resize(band.len() * cols, 0.0);
        for (j, (lhs, rhs)) in products.enumerate() {
            let lhs =
                widen_matrix(Mat { ptr: lhs.ptr.offset(band.start as isize * lhs.rs), ..lhs }, band.len(), depth, l);
            let rhs = widen_matrix(rhs, depth, cols, r);
            let into = Dst { ptr: sum.as_mut_ptr(), rs: cols as isize, cs: 1 };
            gemm_rows(0..band.len(), cols, depth, into, lhs, rhs, j > 0);
        }
        narrow_matrix(sum, cols, Dst { ptr: dst.ptr.offset(band.start as isize * dst.rs), ..dst });
    });
}

impl Op for MatmulBackward {
    fn schema(&self) -> &'static str {
        "matmul_backward(Tensor dout, Tensor a, Tensor b, bool needs_da=True, bool needs_db=True) -> (Tensor da, Tensor \
         db)"
    }

    fn doc(&self) -> &'static str {
        "Gradients of matmul: da = dout @ b^T and db = a^T @ dout per batch, summed over the batches each operand \
         was broadcast to (da and db have a's and b's shapes). Deterministic (no atomics). A gradient whose \
         needs_d<operand> is false comes back empty ([0]) and costs nothing."
    }

    /// Matrices over broadcast batch dims, da and db summed back to a's and b's.
    fn core_dims(&self) -> &'static [(&'static str, usize)] {
        &[("dout", 2), ("a", 2), ("b", 2)]
    }

    fn dtypes(&self) -> &'static [DType] {
        DTYPES
    }

    fn infer(&self, cx: &OpCx) -> Result<Vec<TensorMeta>> {
        checked_dims(cx)?;
        let dtype = cx.input("a").dtype;
        Ok(vec![
            TensorMeta::contiguous(dtype, &cx.grad_shape("a", cx.input("a").shape()))?,
            TensorMeta::contiguous(dtype, &cx.grad_shape("b", cx.input("b").shape()))?,
        ])
    }

    fn plan(&self, cx: &OpCx) -> Result<Plan> {
        let d = Arc::new(checked_dims(cx)?);
        let threads = uniop::runtime::Pool::global().threads();
        let mut steps = Vec::new();
        for (grad, operand, rows) in [(Grad::A, "a", d.m), (Grad::B, "b", d.k)] {
            if !cx.needs_grad(operand) {
                continue;
            }
            let readers = Arc::new(readers(cx.input(operand).shape(), &d.batch));
            // Enough row bands to give every thread work, none thinner than 16 rows.
            let tiles = threads.div_ceil(readers.len().max(1)).min(rows.div_ceil(16)).max(1);
            let block_dim = (readers.len() * tiles).clamp(1, 4 * threads) as u32;
            let d = d.clone();
            steps.push(with_float_dtype!(cx.input("a").dtype, cx.op(), "a", |T| {
                Step::new("matmul_backward", block_dim, move |args, ctx| {
                    kernel::<T>(args, ctx, &d, grad, &readers, tiles)
                })
            }));
        }
        Ok(Plan::new(steps))
    }

    fn reference(&self, cx: &OpCx, inputs: &[Option<RefTensor>]) -> Result<Vec<RefTensor>> {
        let d = checked_dims(cx)?;
        let [dout, a, b] = [0, 1, 2].map(|i| inputs[i].as_ref().unwrap());
        let (a_readers, b_readers) = (readers(&a.shape, &d.batch), readers(&b.shape, &d.batch));
        let owner = |readers: &[Vec<usize>], bi: usize| readers.iter().position(|r| r.contains(&bi)).unwrap();
        let (mut da, mut db) = (vec![0.0; a.data.len()], vec![0.0; b.data.len()]);
        for bi in 0..d.batches() {
            let (ab, bb) = (owner(&a_readers, bi), owner(&b_readers, bi));
            let g = |i: usize, j: usize| dout.data[(bi * d.m + i) * d.n + j];
            for i in 0..d.m {
                for p in 0..d.k {
                    da[(ab * d.m + i) * d.k + p] +=
                        (0..d.n).map(|j| g(i, j) * b.data[(bb * d.k + p) * d.n + j]).sum::<f64>();
                }
            }
            for p in 0..d.k {
                for j in 0..d.n {
                    db[(bb * d.k + p) * d.n + j] +=
                        (0..d.m).map(|i| a.data[(ab * d.m + i) * d.k + p] * g(i, j)).sum::<f64>();
                }
            }
        }
        let asked = |operand, shape: &[usize], grad| {
            if cx.needs_grad(operand) {
                RefTensor::new(shape, grad)
            } else {
                RefTensor::new(&[0], Vec::new())
            }
        };
        Ok(vec![asked("a", &a.shape, da), asked("b", &b.shape, db)])
    }

    fn error_scale(&self, cx: &OpCx) -> f64 {
        // The longest sum: N terms for da, M · (batches sharing b) for db.
        checked_dims(cx).map_or(1.0, |d| (d.n.max(d.m * d.batches()).max(1) as f64).sqrt())
    }

    fn example(&self, shape: Option<&[usize]>, dtype: DType) -> Result<Example> {
        // matmul's example (b a [K, K] shared by every batch, so db sums over them) plus dout.
        let mut example = crate::matmul::Matmul.example(shape, dtype)?;
        // With b square, dout has a's shape.
        let dout = example.inputs[0].clone().expect("matmul's example has a");
        example.inputs.insert(0, Some(dout));
        Ok(example)
    }
}
