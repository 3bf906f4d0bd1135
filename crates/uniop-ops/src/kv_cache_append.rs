//! `kv_cache_append(k_cache, v_cache, k, v, positions)`: writes the new keys and values of a
//! step into preallocated caches, in place — the write half of decode, whose read half is
//! `attention(..., kv_lens)`.
//!
//! Caches are `[B, Hkv, S_max, D]`, the new `k`/`v` `[B, Hkv, S_new, D]`, both with any strides
//! (HF's `[B, S, H, D]` transposed is read in place). Sequence `b` writes its `S_new` rows at
//! `positions[b] .. positions[b] + S_new`; afterwards its cache length for `attention` is
//! `positions[b] + S_new`. A position that would write outside the cache is data, so phase 1
//! cannot see it: every block checks all positions before it writes anything, so the launch fails
//! with a runtime error naming the sequence and leaves both caches untouched.

use crate::elementwise::{copy_streaming, fence, streams_bytes};
use uniop::layout::ShapeDisplay;
use uniop::{
    dispatch_element, BlockCtx, DType, Element, ErrorCode, Example, KernelArgs, Layout, Op, OpCx, Plan, RefTensor,
    Result, Step, TensorMeta,
};

pub struct KvCacheAppend;

/// Floats, and int8 for quantized caches: the op only moves elements.
const DTYPES: &[DType] = &[DType::F32, DType::F16, DType::BF16, DType::I8];
const POSITION_DTYPES: &[DType] = &[DType::I64, DType::I32];

/// `(batch, heads, cache length, new rows, head dim)`, validated.
#[derive(Clone, Copy)]
struct Dims {
    b: usize,
    h: usize,
    s_max: usize,
    s_new: usize,
    d: usize,
}

fn dims(cx: &OpCx) -> Result<Dims> {
    let dtype = cx.expect_dtype_in("k_cache", DTYPES)?;
    for arg in ["v_cache", "k", "v"] {
        cx.expect_same_dtype(arg, dtype, "k_cache")?;
    }
    let cache = cx.input("k_cache").shape().to_vec();
    if cache.len() != 4 {
        return Err(cx.err(
            ErrorCode::Shape,
            "k_cache",
            "rank 4 ([batch, kv_heads, max_seq, head_dim])",
            format!("shape {}", ShapeDisplay(&cache)),
        ));
    }
    cx.expect_shape("v_cache", &cache)?;
    let (b, h, s_max, d) = (cache[0], cache[1], cache[2], cache[3]);
    let k = cx.input("k").shape().to_vec();
    if k.len() != 4 || k[0] != b || k[1] != h || k[3] != d || k[2] > s_max {
        return Err(cx.err(
            ErrorCode::Shape,
            "k",
            format!("shape [{b}, {h}, S_new, {d}] with S_new ≤ {s_max} (k_cache is {})", ShapeDisplay(&cache)),
            format!("shape {}", ShapeDisplay(&k)),
        ));
    }
    cx.expect_shape("v", &k)?;
    cx.expect_dtype_in("positions", POSITION_DTYPES)?;
    cx.expect_shape("positions", &[b])?;
    Ok(Dims { b, h, s_max, s_new: k[2], d })
}

/// The first row of sequence `b` in the cache, or the error message naming why it does not fit.
fn start_row(position: i64, b: usize, dims: Dims) -> std::result::Result<usize, String> {
    let last = dims.s_max - dims.s_new;
    if position < 0 || position as usize > last {
        return Err(format!(
            "kv_cache_append: argument 'positions': expected values in [0, {last}] (room for {} new rows in a \
             cache of {}), got {position} at position {b}",
            dims.s_new, dims.s_max
        ));
    }
    Ok(position as usize)
}

/// Element offset of row `(b, h, s)` of a rank-4 layout.
fn row_offset(l: &Layout, b: usize, h: usize, s: usize) -> usize {
    let st = l.strides();
    l.offset() + b * st[0] + h * st[1] + s * st[2]
}

fn kernel<E: Element, P: Element>(args: &KernelArgs, ctx: BlockCtx, dims: Dims, streaming: bool) {
    let positions = args.input(4);
    let pos_data = positions.storage::<P>().expect("dtype dispatched");
    let starts: Vec<usize> = (0..dims.b)
        .map(|b| {
            let p = pos_data[positions.layout().offset_of_linear(b)].to_i64();
            start_row(p, b, dims).unwrap_or_else(|message| uniop::refuse_launch(message))
        })
        .collect();
    for (cache_index, new_index) in [(0, 2), (1, 3)] {
        let (cache, new) = (args.output(cache_index), args.input(new_index));
        let (cl, nl) = (cache.layout().clone(), new.layout().clone());
        let (c_inner, n_inner) = (cl.strides()[3], nl.strides()[3]);
        let src = new.storage::<E>().expect("dtype dispatched");
        // SAFETY: blocks write disjoint rows (split below); offsets stay inside the checked view.
        let dst = unsafe { cache.as_mut_ptr::<E>() };
        // A block's rows, walked as runs within one (sequence, head) panel: a run's rows are
        // consecutive in both tensors, so dense panels copy as one slice (no per-row index
        // arithmetic: three divisions per 256-byte row cost as much as the copy).
        let rows = ctx.split(dims.b * dims.h * dims.s_new);
        let mut row = rows.start;
        while row < rows.end {
            let (panel, t0) = (row / dims.s_new, row % dims.s_new);
            let t1 = dims.s_new.min(t0 + rows.end - row);
            let (b, h) = (panel / dims.h, panel % dims.h);
            let (from, to) = (row_offset(&nl, b, h, t0), row_offset(&cl, b, h, starts[b] + t0));
            row += t1 - t0;
            let dense = |l: &Layout| l.strides()[3] == 1 && (t1 - t0 == 1 || l.strides()[2] == dims.d);
            if dense(&cl) && dense(&nl) {
                let len = (t1 - t0) * dims.d;
                // SAFETY: as above; dense rows this block owns.
                let dst_run = unsafe { std::slice::from_raw_parts_mut(dst.add(to), len) };
                if streaming {
                    copy_streaming(dst_run, &src[from..from + len]);
                } else {
                    dst_run.copy_from_slice(&src[from..from + len]);
                }
                continue;
            }
            let (c_row, n_row) = (cl.strides()[2], nl.strides()[2]);
            for t in 0..t1 - t0 {
                for j in 0..dims.d {
                    // SAFETY: as above; element `j` of a row this block owns.
                    unsafe { *dst.add(to + t * c_row + j * c_inner) = src[from + t * n_row + j * n_inner] };
                }
            }
        }
    }
    fence();
}

impl Op for KvCacheAppend {
    fn schema(&self) -> &'static str {
        "kv_cache_append(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor k, Tensor v, Tensor positions) -> ()"
    }

    fn doc(&self) -> &'static str {
        "In place: k_cache[b, :, positions[b] + t] = k[b, :, t] (and v likewise) for caches [B, Hkv, S_max, D] and \
         new rows [B, Hkv, S_new, D], any strides; positions int32/int64 [B]. After it, sequence b's cache length \
         (attention's kv_lens) is positions[b] + S_new. A position that does not fit fails the launch with a \
         runtime error before any row is written. float32/float16/bfloat16/int8."
    }

    fn dtypes(&self) -> &'static [DType] {
        DTYPES
    }

    fn infer(&self, cx: &OpCx) -> Result<Vec<TensorMeta>> {
        dims(cx)?;
        Ok(vec![])
    }

    fn plan(&self, cx: &OpCx) -> Result<Plan> {
        let dims = dims(cx)?;
        let dtype = cx.input("k").dtype;
        let rows = dims.b * dims.h * dims.s_new;
        let block_dim = uniop::block_dim_for(rows, 4 * dims.d * dtype.size());
        // A prefill-sized append writes more than the cache holds: stream it past the cache. A
        // decode step's few rows are read back by attention right away, so they stay cached.
        let streaming = streams_bytes(2 * rows * dims.d * dtype.size());
        let step = dispatch_element!(dtype, |E| match cx.input("positions").dtype {
            DType::I32 => Step::new("kv_cache_append", block_dim, move |a, c| kernel::<E, i32>(a, c, dims, streaming)),
            _ => Step::new("kv_cache_append", block_dim, move |a, c| kernel::<E, i64>(a, c, dims, streaming)),
        });
        Ok(Plan::new(vec![step]))
    }

    fn reference(&self, cx: &OpCx, inputs: &[Option<RefTensor>]) -> Result<Vec<RefTensor>> {
        let dims = dims(cx)?;
        let [k_cache, v_cache, k, v, positions] = inputs else { unreachable!("five tensor arguments") };
        let mut written = Vec::new();
        for (cache, new) in [(k_cache, k), (v_cache, v)] {
            let (cache, new) = (cache.as_ref().unwrap(), new.as_ref().unwrap());
            let mut data = cache.data.clone();
            for b in 0..dims.b {
                let start = start_row(positions.as_ref().unwrap().data[b] as i64, b, dims)
                    .map_err(|msg| uniop::Error::new(ErrorCode::Runtime, msg))?;
                for h in 0..dims.h {
                    for t in 0..dims.s_new {
                        let to = ((b * dims.h + h) * dims.s_max + start + t) * dims.d;
                        let from = ((b * dims.h + h) * dims.s_new + t) * dims.d;
                        data[to..to + dims.d].copy_from_slice(&new.data[from..from + dims.d]);
                    }
                }
            }
            written.push(RefTensor::new(&cache.shape, data));
        }
        Ok(written)
    }

    fn example(&self, shape: Option<&[usize]>, dtype: DType) -> Result<Example> {
        // `shape` is the cache's (leading dims padded with 1 to rank 4); a quarter of its length
        // is appended. Default: a 256-token prefill chunk into two 4096-long, 16-head caches.
        let mut cache = shape.unwrap_or(&[2, 16, 4096, 128]).to_vec();
        while cache.len() < 4 {
            cache.insert(0, 1);
        }
        let (b, s_max) = (cache[0], cache[2]);
        let s_new = s_max.div_ceil(4);
        let new = [cache[0], cache[1], s_new, cache[3]];
        let cache_meta = TensorMeta::contiguous(dtype, &cache)?;
        let new_meta = TensorMeta::contiguous(dtype, &new)?;
        Ok(Example {
            inputs: vec![
                Some(cache_meta.clone()),
                Some(cache_meta),
                Some(new_meta.clone()),
                Some(new_meta),
                Some(TensorMeta::contiguous(DType::I64, &[b])?),
            ],
            ranges: vec![None, None, None, None, Some((0.0, (s_max - s_new + 1) as f64))],
            ..Default::default()
        })
    }

    fn bytes_moved(&self, cx: &OpCx) -> Option<usize> {
        // Each new row is read once and written once, per cache.
        let k = cx.input("k");
        Some(4 * k.numel() * k.dtype.size())
    }
}
