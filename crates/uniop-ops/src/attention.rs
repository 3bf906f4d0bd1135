//! `attention(q, k, v, kv_lens=None, causal=False, scale=None, mask=None, softcap=None, sinks=None)
//! -> (out, lse)`: scaled dot-product attention, flash-style.
//!
//! Layout is torch SDPA's: `q` `[B, Hq, Sq, D]`, `k` `[B, Hkv, Sk, D]`, `v` `[B, Hkv, Sk, Dv]`,
//! any strides with a dense last dim — so HF's `[B, S, H, D]` tensors transposed to
//! `[B, H, S, D]` are read in place. `Hkv` must divide `Hq` (grouped-query attention: q head `h`
//! reads kv head `h / (Hq / Hkv)`). As in SDPA, `B` stands for any number of leading batch dims
//! (none up to [`MAX_BATCH_DIMS`]), the same in q, k and v: the kernels number the batch rows
//! flat and find each tensor's row through its strides ([`BatchStrides`]), so the dims need not
//! merge into one (a k expanded along one of them, stride 0, is read in place). That is also how
//! `torch.func.vmap` batches attention in one call (`leading_batch_args`): its batch becomes one
//! more leading dim.
//!
//! Why flash-style: the `Sq × Sk` score matrix is never stored. Each unit of work is one
//! (batch, kv head, tile of query positions) with the tile holding that position range for every
//! q head of the group, so each K/V tile is loaded once per group (this is what makes GQA decode
//! cheap: it is bandwidth-bound on K/V). Scores for `TILE_KEYS` keys at a time go through a GEMM
//! (single-threaded inside our SPMD blocks, like matmul) and an online softmax (running max and
//! sum per row, output rescaled when the max grows — for bf16 only when it grows by more than
//! [`LAZY_MAX_MARGIN`], see [`online_softmax_row`]). Extra memory is O(tile) per block, plus in
//! bf16 (and f32 on AVX-512) one head's packed K and V per thread (O(Sk), never O(Sq·Sk)).
//! Blocks take their units head by head, so consecutive units reread the same K and V from cache
//! (at 1x32x2048x128 that order alone ran f32 9% faster than handing out the latest query tiles
//! of every head first). Where those units are too few for the threads — decode, with one per
//! (batch, kv head) — each unit's keys are cut into ranges whose softmax states a last step
//! merges, as flash-decoding does ([`key_splits`]).
//! f16 tiles are widened to f32; bf16 runs both products on the bf16 GEMM (K and V read in
//! place, P rounded to bf16 as torch's flash attention does, f32 sums), with whole K and V tiles
//! packed once per block for all the query tiles of their head ([`KvPanels`]); f32 does the same
//! on the packed f32 GEMM where it exists (AVX-512: 196 → 185 ms at 1x32x2048x128 causal against
//! the `gemm` crate, which packs both operands per product). Causal diagonal tiles run their
//! products in pieces ([`QueryTile::pieces`]). The softmax is f32 throughout.
//!
//! On CPUs whose best level is AVX2 (no AVX-512; for bf16, no AVX512-BF16) the forward runs
//! the tiles of `flash_avx2.rs` instead, held transposed so that neither product packs its
//! operands per call (why, and the layout, are there). Decode-sized tiles (under 16 rows) stay
//! here, on the few-row kernels: dot products with K's rows for the scores, and V's lines scaled
//! by the probabilities and summed for the output (neither packs K or V).
//!
//! Masking. `kv_lens` (int, of the batch dims' shape, optional) limits batch row `b` to its first
//! `kv_lens[b]` keys (decode against a preallocated KV cache). `causal` aligns the mask
//! **bottom-right**: query `i` sees key `j` iff `j <= i + (len - Sq)`, where `len` is the row's
//! key count. With `Sq == Sk` this is torch's `is_causal=True` (top-left); with `Sq < len` it is
//! what decode and chunked prefill need (the new queries are the last `Sq` positions). A query
//! that sees no key (possible only when `len < Sq`) gets output 0 and `lse = -inf`.
//!
//! `mask` (optional, broadcastable to `[B, Hq, Sq, Sk]`, torch SDPA's `attn_mask`) applies on top
//! of `kv_lens` and `causal`. Boolean (true = attend), it hides keys: padded batches (Hugging
//! Face's left-padded prompts and their decode steps), sliding windows, prefix-LM or document
//! masks. Float (f32, f16, bf16), it is added to the scaled scores (−∞ hides, and so does the
//! dtype's lowest value, `hiding_bias`): ALiBi and relative-position biases, transformers 4.x's
//! padding masks; its gradient is a step of the backward's own (`attention_mask_grad`). It is
//! applied to each score tile after its product (a hidden score becomes −∞ before the softmax, a
//! bias is added divided by the scale the softmax multiplies by), so the tiles and their causal and
//! `kv_lens` skipping stay as they are, and a tile whose keys it hides from every query of the
//! tile is skipped whole (`MaskRows::tile_live`: a sliding window or a document mask costs the
//! keys it shows). In a tile that is not skipped, the products start at the first key some row of
//! the product may see, rounded down to a whole panel of 32 keys (`MaskRows::lead`,
//! `QueryTile::walks`): a window's leading edge and a padding that ends inside a tile cost less
//! of what they hide. Hidden keys past that start still run through the products, and their K/V
//! rows must hold finite numbers (a hidden key's probability is 0, as in SDPA, and 0 · NaN is
//! NaN). A query whose keys are all hidden gets output 0 and `lse = -inf`, like one that sees no
//! key. AVX2's transposed tiles (`flash_avx2.rs`, and the backward's `flash_backward_avx2.rs`)
//! apply the mask the same way, to a band of query rows or a strip of keys at a time, skipping
//! whole key tiles of their own but not a tile's first keys.
//!
//! `softcap` (optional, positive) caps the scaled scores smoothly, `softcap · tanh(score /
//! softcap)`, before the mask's bias adds: Gemma 2's attention logit soft-capping, which torch's
//! SDPA lacks (transformers runs Gemma 2 on its eager attention, the `Sq × Sk` scores whole). Each
//! score tile is capped after its product, where the mask applies (on AVX2's transposed forward
//! tiles too; their backward takes none: soft-capped backward calls on AVX2 CPUs run the GEMM
//! tiles).
//!
//! `sinks` (optional, float `[Hq]`) are attention sinks, one learned logit per q head (GPT-OSS's
//! `sinks`, StreamingLLM's sink as a logit): each query's softmax takes one more term,
//! `exp(sinks[h])`, in its denominator — a key whose value is zero, so the probabilities of the
//! real keys sum to less than one. torch's SDPA has none (transformers runs GPT-OSS on its eager
//! attention on CPU). The tiles are unchanged: a row's sink joins its softmax sum once, where
//! the row is finished ([`ForwardArgs::finish_row`], which every route shares), so key ranges,
//! masks and softcap need nothing of their own. A query that sees no key gets output 0 and
//! `lse = sinks[h]`.
//!
//! `lse` (`[B, Hq, Sq]`, f32) is the log-sum-exp of each query's scaled scores, saved for
//! [`attention_backward`](crate::attention_backward).

use crate::math;
use crate::matmul::{gemm_rows, Dst, Mat};
use crate::packed_gemm::{gemm_rows_packed, gemm_rows_prepacked, Packed, PackedRhs, PREPACKED_STEP};
use crate::skinny::SKINNY_ROWS;
use crate::skinny::{Dots, Simd};
use std::ops::Range;
use uniop::half::{bf16, f16};
use uniop::layout::ShapeDisplay;
use uniop::{
    with_float_dtype, AttrValue, BlockCtx, DType, ErrorCode, Example, FloatElement, KernelArgs, LayoutNeed, Op, OpCx,
    Plan, RefTensor, Result, Step, TensorMeta, TensorRef,
};

pub struct Attention;

pub(crate) const DTYPES: &[DType] = &[DType::F32, DType::F16, DType::BF16];
const LEN_DTYPES: &[DType] = &[DType::I32, DType::I64];

/// Query rows per tile (all heads of a group together) and keys per score tile: 128 × 256 f32
/// tiles keep Q, S, O and a K/V tile inside a Zen core's 1 MiB L2.
pub(crate) const TILE_ROWS: usize = 128;
pub(crate) const TILE_KEYS: usize = 256;
/// Rows of a causal diagonal tile's pieces on the packed GEMM with panels packed once per key
/// tile (see [`QueryTile::pieces`]): as few as keep the products over them (this many rows deep,
/// in the backward) on the micro-kernel's fast path. Products that pack K per call (`gemm_rows`)
/// ran 14% slower in such pieces and keep whole tiles.
pub(crate) const DIAGONAL_PIECE_ROWS: usize = 32;

/// Shapes and attributes shared by the forward and backward ops.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Geometry {
    /// The leading batch dims' count of batch rows (their product): kernels index batch rows flat.
    pub batch: usize,
    /// Those dims themselves (SDPA's `[..., H, S, D]`: none, one, or more).
    pub batch_dims: BatchDims,
    pub q_heads: usize,
    pub kv_heads: usize,
    pub q_len: usize,
    pub kv_len: usize,
    pub head_dim: usize,
    pub v_dim: usize,
    pub causal: bool,
    /// The scale kernels apply (f32), and the attribute as given for the f64 reference.
    pub scale: f32,
    pub scale_f64: f64,
    pub dtype: DType,
    /// The `mask`'s dtype when one was given: bool keeps keys, a float one is added to the scores.
    pub mask: Option<DType>,
    /// `softcap`, when given: the scaled scores become `softcap · tanh(scaled / softcap)`.
    pub softcap: Option<f64>,
    /// Whether `sinks` were given (one extra logit per q head in each row's softmax).
    pub sinks: bool,
}

impl Geometry {
    pub fn group(&self) -> usize {
        self.q_heads / self.kv_heads.max(1)
    }

    /// Query positions per tile, so that a tile holds about `TILE_ROWS` rows over the group:
    /// a multiple of 16 where that many fit. Causal tiles then end on key counts that the GEMMs'
    /// 16-wide steps and the softmax's lanes divide, with no ragged tails (a group of 3 at
    /// 42 positions ran 1.2x slower than at 32: 1x6x512x64 bf16 and f32, causal).
    pub fn tile_q(&self) -> usize {
        let positions = TILE_ROWS / self.group().max(1);
        let positions = if positions >= 16 { positions / 16 * 16 } else { positions };
        positions.clamp(1, self.q_len.max(1))
    }

    pub fn q_tiles(&self) -> usize {
        self.q_len.div_ceil(self.tile_q())
    }

    /// Units of work `(batch, kv head, query tile)`.
    pub fn units(&self) -> usize {
        self.batch * self.kv_heads * self.q_tiles()
    }

    /// Unit `u`, ordered latest query tile first: under a causal mask those are the heaviest,
    /// and handing them out first balances the dynamically claimed blocks.
    pub fn unit(&self, u: usize) -> (usize, usize, usize) {
        let per_tile = self.batch * self.kv_heads;
        let tile = self.q_tiles() - 1 - u / per_tile;
        let bh = u % per_tile;
        (bh / self.kv_heads, bh % self.kv_heads, tile)
    }

    /// Keys visible to query `i` of a batch row with `len` keys: a prefix `[0, visible)`.
    pub fn visible(&self, len: usize, i: usize) -> usize {
        if self.causal {
            causal_prefix(i, self.q_len, len)
        } else {
            len
        }
    }

    /// Unit `u` ordered head by head, each head's query tiles latest first: consecutive units
    /// reread one head's K and V (from L3) and every block of a contiguous range gets whole
    /// heads, which balances it as well as [`Geometry::unit`].
    pub fn unit_by_head(&self, u: usize) -> (usize, usize, usize) {
        let bh = u / self.q_tiles();
        (bh / self.kv_heads, bh % self.kv_heads, self.q_tiles() - 1 - u % self.q_tiles())
    }

    /// Unit `(b, hkv, tile)` as a [`QueryTile`], reading its batch row's key count from `kv_lens`.
    pub fn query_tile(
        &self,
        (b, hkv, tile): (usize, usize, usize),
        lens: Option<&TensorRef<'_>>,
        op: &str,
    ) -> QueryTile {
        let tq = self.tile_q();
        let q0 = tile * tq;
        QueryTile {
            b,
            hkv,
            q0,
            n_pos: tq.min(self.q_len - q0),
            group: self.group(),
            len: row_len(lens, b, self.kv_len, op),
        }
    }

    /// f32 scratch tiles of one forward block for `rows` queries: Q, S, O, running max and sum,
    /// then K and V widened to f32 (f16), or P rounded to bf16 for the bf16 GEMM (bf16).
    fn forward_tiles(&self, rows: usize) -> [usize; 7] {
        let (x, y) = match self.dtype {
            DType::F32 => (0, 0),
            DType::BF16 => (rows * TILE_KEYS / 2, 0),
            _ => (TILE_KEYS * self.head_dim, TILE_KEYS * self.v_dim),
        };
        [rows * self.head_dim, rows * TILE_KEYS, rows * self.v_dim, rows, rows, x, y]
    }

    fn forward_scratch(&self, rows: usize) -> usize {
        self.forward_tiles(rows).iter().sum()
    }
}

/// Columns visible to query `i` of `q_len` queries over `len` keys under the bottom-right causal
/// mask: `j <= i + len − q_len`. Shared with [`causal_softmax`](crate::causal_softmax).
pub(crate) fn causal_prefix(i: usize, q_len: usize, len: usize) -> usize {
    (i + 1 + len).saturating_sub(q_len).min(len)
}

/// Whether `units` of equal work keep `threads` about equally busy: the busiest thread's units
/// within an eighth of an even share. Shared with the backward's routes.
pub(crate) fn spreads_evenly(units: usize, threads: usize) -> bool {
    units.div_ceil(threads) * threads * 8 <= units * 9
}

/// Parts to cut each of `units` into so that every one of `threads` gets the same number.
pub(crate) fn parts_for_even_share(units: usize, threads: usize) -> usize {
    let gcd = |mut a: usize, mut b: usize| {
        while b != 0 {
            (a, b) = (b, a % b);
        }
        a
    };
    threads / gcd(units, threads).max(1)
}

#[cfg(test)]
thread_local! {
    /// Tests cut the keys into any number of ranges, on any thread count.
    pub(crate) static KEY_SPLITS_FORCED: std::cell::Cell<Option<usize>> = const { std::cell::Cell::new(None) };
}

/// Ranges each unit's keys are cut into (as flash-decoding does), each with a softmax state of its
/// own that [`combine`] merges: where the query tiles alone — decode has one per (batch, kv head) —
/// would leave threads idle, as many as even the threads out, at least two key tiles each.
/// One multi-query kv head of 4096 keys (q `[1, 32, 1, 128]`, bf16) went from one thread to two.
fn key_splits(g: &Geometry, threads: usize) -> usize {
    #[cfg(test)]
    if let Some(forced) = KEY_SPLITS_FORCED.with(|f| f.get()) {
        return forced;
    }
    let units = g.units();
    if g.q_tiles() > 1 || spreads_evenly(units, threads) {
        return 1;
    }
    parts_for_even_share(units, threads).min(g.kv_len / (2 * TILE_KEYS)).max(1)
}

/// One unit of the forward and dQ kernels: query positions `q0..q0 + n_pos` of every q head
/// of kv head `hkv`'s group in batch row `b` (which has `len` keys). Tile row `r` is position
/// `q0 + r % n_pos` of q head `hkv·group + r / n_pos`.
pub(crate) struct QueryTile {
    pub b: usize,
    pub hkv: usize,
    pub q0: usize,
    pub n_pos: usize,
    pub group: usize,
    pub len: usize,
}

impl QueryTile {
    pub fn rows(&self) -> usize {
        self.group * self.n_pos
    }

    /// `(q head, position)` of tile row `r`.
    #[inline(always)]
    pub fn head_pos(&self, r: usize) -> (usize, usize) {
        (self.hkv * self.group + r / self.n_pos, self.q0 + r % self.n_pos)
    }

    /// Keys any row of the tile sees (the last row sees the most).
    pub fn kv_end(&self, g: &Geometry) -> usize {
        g.visible(self.len, self.q0 + self.n_pos - 1)
    }

    /// The tile's rows as `(rows, keys)` pieces for the key tile of `n` keys from `j0`: each
    /// piece's products need only the keys its last row sees. One piece, unless some head's rows
    /// see this key tile in very different counts (the causal diagonal): then each head's rows go
    /// in pieces of [`DIAGONAL_PIECE_ROWS`], which skip most of the diagonal block's masked half.
    pub fn pieces(&self, g: &Geometry, j0: usize, n: usize) -> impl Iterator<Item = (Range<usize>, usize)> + '_ {
        let g = *g;
        let seen = move |r: usize| n.min(g.visible(self.len, self.head_pos(r).1).saturating_sub(j0));
        let diagonal = seen(self.n_pos - 1) - seen(0) >= DIAGONAL_PIECE_ROWS;
        let (heads, step) = if diagonal { (self.group, DIAGONAL_PIECE_ROWS) } else { (1, self.rows()) };
        let segment = self.rows() / heads;
        (0..heads).flat_map(move |h| {
            let end = (h + 1) * segment;
            (h * segment..end).step_by(step).map(move |r0| {
                let r1 = (r0 + step).min(end);
                (r0..r1, seen(r1 - 1))
            })
        })
    }

    /// [`QueryTile::pieces`] with the keys of the key tile each piece's products walk (from `j0`,
    /// into `walks`): up to the keys its last row sees, and from the first key any of its rows may
    /// see under `mask` ([`MaskRows::lead`]: a sliding window's leading edge, a left padding that
    /// ends inside the tile). Cutting pieces further where their rows' first keys differ (32 rows
    /// each, at a window's edge) ran 10–20% slower with a 512-key window at 1x32x2048x128.
    pub fn walks(
        &self,
        g: &Geometry,
        mask: Option<&MaskRows<'_>>,
        (j0, n): (usize, usize),
        walks: &mut Vec<(Range<usize>, Range<usize>)>,
    ) {
        walks.clear();
        walks.extend(self.pieces(g, j0, n).map(|(rows, seen)| {
            let queries = rows.clone().map(|r| self.head_pos(r));
            let lead = mask.map_or(0, |m| m.lead(g, (self.b, self.len), queries, (j0, n)));
            (rows, lead.min(seen)..seen)
        }));
    }

    /// Copies the tile's rows of a `[B, Hq, Sq, width]` tensor into `dst` (`rows × width`) as they are.
    pub fn copy_rows<T: Copy>(&self, data: &[T], rows: Rows4, dst: &mut [T], width: usize) {
        for r in 0..self.rows() {
            let (h, i) = self.head_pos(r);
            let at = rows.at(self.b, h, i);
            dst[r * width..(r + 1) * width].copy_from_slice(&data[at..at + width]);
        }
    }

    /// Widens the tile's rows of a `[B, Hq, Sq, width]` tensor into `dst` (`rows × width`), scaled.
    pub fn load<T: FloatElement>(&self, data: &[T], rows: Rows4, dst: &mut [f32], width: usize, scale: f32) {
        for r in 0..self.rows() {
            let (h, i) = self.head_pos(r);
            load_scaled(data, rows.at(self.b, h, i), &mut dst[r * width..(r + 1) * width], scale);
        }
    }
}

/// Most leading batch dims attention takes in front of `[heads, seq, head_dim]`: SDPA's one,
/// and room for `torch.func.vmap` (which adds one per level) over it.
pub(crate) const MAX_BATCH_DIMS: usize = 4;

/// The leading batch dims of attention's tensors: any number up to [`MAX_BATCH_DIMS`], as SDPA's
/// `[..., H, S, D]`. Kernels number batch rows flat (`b` in `0..count`, row-major over these dims)
/// and find each tensor's row through its [`BatchStrides`].
#[derive(Clone, Copy, Debug)]
pub(crate) struct BatchDims {
    dims: [usize; MAX_BATCH_DIMS],
    rank: usize,
}

impl BatchDims {
    pub fn of(dims: &[usize]) -> BatchDims {
        let mut all = [1; MAX_BATCH_DIMS];
        all[..dims.len()].copy_from_slice(dims);
        BatchDims { dims: all, rank: dims.len() }
    }

    pub fn dims(&self) -> &[usize] {
        &self.dims[..self.rank]
    }

    /// These dims followed by `core` (at most 4 dims): the shape of a tensor of the call. On the
    /// stack: `geometry` builds several on every call.
    pub fn then(&self, core: &[usize]) -> CallShape {
        let mut dims = [0; MAX_BATCH_DIMS + 4];
        dims[..self.rank].copy_from_slice(self.dims());
        dims[self.rank..self.rank + core.len()].copy_from_slice(core);
        CallShape { dims, len: self.rank + core.len() }
    }

    /// The multi-index of flat batch row `b`.
    fn index(&self, mut b: usize) -> [usize; MAX_BATCH_DIMS] {
        let mut at = [0; MAX_BATCH_DIMS];
        for k in (0..self.rank).rev() {
            at[k] = b % self.dims[k];
            b /= self.dims[k];
        }
        at
    }
}

/// A shape built by [`BatchDims::then`], read as a slice.
pub(crate) struct CallShape {
    dims: [usize; MAX_BATCH_DIMS + 4],
    len: usize,
}

impl std::ops::Deref for CallShape {
    type Target = [usize];
    fn deref(&self) -> &[usize] {
        &self.dims[..self.len]
    }
}

/// Where flat batch row `b` of the call's [`BatchDims`] starts in one tensor whose own leading
/// dims broadcast to them (aligned at the right; a missing or size-1 dim repeats, stride 0).
/// Dims that one stride walks together are merged at construction, so the common cases (one
/// batch dim, or several of a contiguous tensor) cost one multiplication a row.
#[derive(Clone, Copy, Debug)]
pub(crate) struct BatchStrides {
    sizes: [usize; MAX_BATCH_DIMS],
    strides: [usize; MAX_BATCH_DIMS],
    rank: usize,
}

impl BatchStrides {
    /// `shape` and `strides`: the tensor's leading dims (at most `batch`'s count, each
    /// `batch`'s at its place or 1).
    pub fn of(batch: &BatchDims, shape: &[usize], strides: &[usize]) -> BatchStrides {
        let mut merged = BatchStrides { sizes: [1; MAX_BATCH_DIMS], strides: [0; MAX_BATCH_DIMS], rank: 0 };
        let pad = batch.rank - shape.len();
        for (k, &size) in batch.dims().iter().enumerate() {
            let stride = if k < pad || shape[k - pad] == 1 { 0 } else { strides[k - pad] };
            if size == 1 {
                continue; // no row index moves along it
            }
            let r = merged.rank;
            if r > 0 && merged.strides[r - 1] == stride * size {
                merged.sizes[r - 1] *= size; // the outer dim steps over whole runs of this one
                merged.strides[r - 1] = stride;
            } else {
                merged.sizes[r] = size;
                merged.strides[r] = stride;
                merged.rank += 1;
            }
        }
        merged
    }

    /// Storage offset (from the tensor's own) of flat batch row `b`.
    #[inline(always)]
    pub fn offset(&self, mut b: usize) -> usize {
        match self.rank {
            0 => 0,
            1 => b * self.strides[0],
            rank => {
                let mut at = 0;
                for k in (0..rank).rev() {
                    at += b % self.sizes[k] * self.strides[k];
                    b /= self.sizes[k];
                }
                at
            }
        }
    }
}

/// The shape of `arg` split as `(batch dims, [heads, seq, head_dim])`.
fn expect_heads_seq_dim<'c>(cx: &'c OpCx, arg: &str) -> Result<(&'c [usize], [usize; 3])> {
    let shape = cx.input(arg).shape();
    let core = shape.len().checked_sub(3).filter(|&lead| lead <= MAX_BATCH_DIMS);
    let expected = format!("rank 3 to {} ([..., heads, seq, head_dim])", 3 + MAX_BATCH_DIMS);
    let lead = core.ok_or_else(|| cx.err(ErrorCode::Shape, arg, expected, format!("shape {}", ShapeDisplay(shape))))?;
    Ok((&shape[..lead], [shape[lead], shape[lead + 1], shape[lead + 2]]))
}

/// Checks `mask` (when given): bool or float, of a rank up to `target`'s, each dim `target`'s or
/// 1 (aligned at the right, as torch broadcasts).
fn check_mask(cx: &OpCx, target: &[usize], scale: f64) -> Result<()> {
    let Some(mask) = cx.optional_input("mask") else { return Ok(()) };
    cx.expect_dtype_in("mask", &[DType::Bool, DType::F32, DType::F16, DType::BF16])?;
    let shape = mask.shape();
    let fits =
        shape.len() <= target.len() && shape.iter().rev().zip(target.iter().rev()).all(|(&m, &t)| m == t || m == 1);
    if !fits {
        return Err(cx.err(
            ErrorCode::Shape,
            "mask",
            format!("a shape broadcastable to [..., Hq, Sq, Sk] = {}", ShapeDisplay(target)),
            format!("shape {}", ShapeDisplay(shape)),
        ));
    }
    if scale == 0.0 {
        // A hidden score is −∞ before the scale is applied (0 · −∞ hides nothing), a bias is
        // added divided by the scale.
        return Err(cx.err(ErrorCode::ParamInvalid, "scale", "a nonzero scale when a mask is given", scale));
    }
    Ok(())
}

/// Checks `q`, `k`, `v`, `kv_lens`, `mask` and the attributes.
pub(crate) fn geometry(cx: &OpCx) -> Result<Geometry> {
    let dtype = cx.expect_dtype_in("q", DTYPES)?;
    cx.expect_same_dtype("k", dtype, "q")?;
    cx.expect_same_dtype("v", dtype, "q")?;
    let (batch, [q_heads, q_len, head_dim]) = expect_heads_seq_dim(cx, "q")?;
    let batch_dims = BatchDims::of(batch);
    let (_, [kv_heads, kv_len, _]) = expect_heads_seq_dim(cx, "k")?;
    cx.expect_shape("k", &batch_dims.then(&[kv_heads, kv_len, head_dim]))?;
    let (_, [.., v_dim]) = expect_heads_seq_dim(cx, "v")?;
    cx.expect_shape("v", &batch_dims.then(&[kv_heads, kv_len, v_dim]))?;
    if kv_heads == 0 || q_heads % kv_heads != 0 {
        return Err(cx.err(
            ErrorCode::Shape,
            "k",
            format!("a kv head count dividing q's {q_heads} heads"),
            format!("{kv_heads} heads (shape {})", ShapeDisplay(cx.input("k").shape())),
        ));
    }
    if cx.optional_input("kv_lens").is_some() {
        cx.expect_dtype_in("kv_lens", LEN_DTYPES)?;
        cx.expect_shape("kv_lens", batch)?;
    }
    let scale = match cx.attr("scale") {
        AttrValue::None => 1.0 / (head_dim.max(1) as f64).sqrt(),
        _ => cx.float("scale"),
    };
    if !scale.is_finite() {
        return Err(cx.err(ErrorCode::ParamInvalid, "scale", "a finite float or None (1/sqrt(head_dim))", scale));
    }
    check_mask(cx, &batch_dims.then(&[q_heads, q_len, kv_len]), scale)?;
    let softcap = match cx.attr("softcap") {
        AttrValue::None => None,
        _ => Some(cx.float("softcap")),
    };
    if let Some(cap) = softcap {
        if !(cap.is_finite() && cap > 0.0) {
            return Err(cx.err(
                ErrorCode::ParamInvalid,
                "softcap",
                "a positive finite float or None (no capping)",
                cap,
            ));
        }
        if scale == 0.0 {
            // The kernels cap scores that the softmax scales later, dividing the cap by the scale.
            return Err(cx.err(ErrorCode::ParamInvalid, "scale", "a nonzero scale when softcap is given", scale));
        }
    }
    let sinks = cx.optional_input("sinks").is_some();
    if sinks {
        cx.expect_dtype_in("sinks", DTYPES)?;
        cx.expect_shape("sinks", &[q_heads])?;
    }
    let causal = matches!(cx.attr("causal"), AttrValue::Bool(true));
    Ok(Geometry {
        batch: batch.iter().product(),
        batch_dims,
        q_heads,
        kv_heads,
        q_len,
        kv_len,
        head_dim,
        v_dim,
        causal,
        scale: scale as f32,
        scale_f64: scale,
        dtype,
        mask: cx.optional_input("mask").map(|m| m.dtype),
        softcap,
        sinks,
    })
}

/// Soft-caps a row of raw scores `s` that a softmax will multiply by `scale`, so that the scaled
/// scores become `cap · tanh(scaled / cap)`, still unscaled: `s = (cap / scale) · tanh(s · scale /
/// cap)`. Before a mask applies (a bias adds to the capped score, as Gemma 2 adds its mask).
pub(crate) fn cap_scores(s: &mut [f32], scale: f32, cap: f32) {
    let (inward, outward) = (scale / cap, cap / scale);
    cap_row(s, inward, outward);
}

crate::simd_kernel! {
/// [`cap_scores`]' loop, at the CPU's vector level.
fn cap_row(s: &mut [f32], inward: f32, outward: f32) {
    for v in s.iter_mut() {
        *v = outward * math::tanh(*v * inward);
    }
}
}

/// What a reference score (scaled, before the mask's bias) becomes under `softcap`, and its
/// derivative with respect to the uncapped one.
pub(crate) fn reference_cap(g: &Geometry, scaled: f64) -> (f64, f64) {
    match g.softcap {
        Some(cap) => {
            let t = (scaled / cap).tanh();
            (cap * t, 1.0 - t * t)
        }
        None => (scaled, 1.0),
    }
}

/// The optional `mask` as the kernels read it: element `(b, h, i, j)` of its broadcast to
/// `[..., Hq, Sq, Sk]` (`b` a flat batch row; broadcast dims have stride 0).
#[derive(Clone, Copy)]
pub(crate) struct MaskRows<'a> {
    data: MaskData<'a>,
    /// A float mask's [`hiding_bias`]: this value and −∞ hide a key.
    hides: f32,
    base: usize,
    batch: BatchStrides,
    strides: [usize; 3],
}

/// Keys per strip row of the AVX2 backward's tiles ([`MaskRows::apply_strip`]).
pub(crate) const STRIP: usize = 16;

/// A boolean mask's keeps, or a float mask's bias (added to the scaled scores; −∞ and the
/// dtype's lowest value hide).
#[derive(Clone, Copy)]
enum MaskData<'a> {
    Keeps(&'a [bool]),
    F32(&'a [f32]),
    F16(&'a [f16]),
    Bf16(&'a [bf16]),
}

impl<'a> MaskRows<'a> {
    /// The mask of a call whose q is `q` (its leading dims are the batch).
    pub fn of(mask: Option<TensorRef<'a>>, q: &TensorRef<'_>) -> Option<MaskRows<'a>> {
        let mask = mask?;
        let (shape, given) = (mask.shape(), mask.layout().strides());
        let lead = shape.len().saturating_sub(3);
        let mut strides = [0; 3];
        for (k, (&n, &st)) in shape[lead..].iter().rev().zip(given[lead..].iter().rev()).enumerate() {
            strides[2 - k] = if n == 1 { 0 } else { st };
        }
        let batch = BatchDims::of(&q.shape()[..q.shape().len() - 3]);
        let checked = "mask dtype checked";
        let data = match mask.dtype() {
            DType::Bool => MaskData::Keeps(mask.storage::<bool>().expect(checked)),
            DType::F32 => MaskData::F32(mask.storage::<f32>().expect(checked)),
            DType::F16 => MaskData::F16(mask.storage::<f16>().expect(checked)),
            _ => MaskData::Bf16(mask.storage::<bf16>().expect(checked)),
        };
        let batch = BatchStrides::of(&batch, &shape[..lead], &given[..lead]);
        Some(MaskRows { data, hides: hiding_bias(mask.dtype()), base: mask.layout().offset(), batch, strides })
    }

    /// Where row `(b, h, i)` starts in the data, and its key stride.
    fn row(&self, (b, h, i): (usize, usize, usize)) -> (usize, usize) {
        let [sh, si, sj] = self.strides;
        (self.base + self.batch.offset(b) + h * sh + i * si, sj)
    }

    /// The first of keys `j0..j0 + n` that query `(b, h, i)` may see, of those `kv_lens` (`len`,
    /// the row's key count) and `causal` leave it.
    #[inline(always)]
    fn first_shown(
        &self,
        g: &Geometry,
        (b, len): (usize, usize),
        (h, i): (usize, usize),
        (j0, n): (usize, usize),
    ) -> Option<usize> {
        let keys = j0..j0 + n.min(g.visible(len, i).saturating_sub(j0));
        let (row, sj) = self.row((b, h, i));
        let start = keys.start;
        let offset = match self.data {
            MaskData::Keeps(d) if sj == 1 => first_where(&d[row + keys.start..row + keys.end], |keep| keep),
            MaskData::Keeps(d) => keys.into_iter().position(|j| d[row + j * sj]),
            MaskData::F32(d) => first_unhidden(d, (row, sj), keys, self.hides),
            MaskData::F16(d) => first_unhidden(d, (row, sj), keys, self.hides),
            MaskData::Bf16(d) => first_unhidden(d, (row, sj), keys, self.hides),
        };
        offset.map(|o| start + o)
    }

    /// Whether any query `(b, h, i)` of `queries` may see one of keys `j0..j0 + n` that `kv_lens`
    /// (`len`, the row's key count) and `causal` leave it. A tile where none may is skipped
    /// whole, products included: what makes a sliding window, a document mask or a padded
    /// prefix cost the keys it shows rather than all of them.
    pub fn tile_live(
        &self,
        g: &Geometry,
        (b, len): (usize, usize),
        mut queries: impl Iterator<Item = (usize, usize)>,
        (j0, n): (usize, usize),
    ) -> bool {
        queries.any(|query| self.first_shown(g, (b, len), query, (j0, n)).is_some())
    }

    /// Where the products of `queries` `(h, i)` with keys `j0..j0 + n` may start: the first of those
    /// keys any of them may see (within what `kv_lens` (`len`) and `causal` leave it), counted from
    /// `j0` and rounded down to a whole panel of the packed products ([`PREPACKED_STEP`]); `n`
    /// when none may. The keys before it are never read: a left padding's may hold NaN.
    pub fn lead(
        &self,
        g: &Geometry,
        (b, len): (usize, usize),
        queries: impl Iterator<Item = (usize, usize)>,
        (j0, n): (usize, usize),
    ) -> usize {
        let first = queries.filter_map(|query| self.first_shown(g, (b, len), query, (j0, n))).min();
        first.map_or(n, |j| (j - j0) / PREPACKED_STEP * PREPACKED_STEP)
    }

    /// Whether the mask leaves the scores of query `(b, h, i)` over keys `j0..j0 + n` as they are:
    /// a boolean mask keeps them all, a float one adds ±0 to each (a padding mask's visible part).
    /// A vector scan of the row, far cheaper than [`apply`](Self::apply) where the scores lie down
    /// the columns of a transposed tile (`flash_avx2.rs`). False for a mask strided along keys.
    #[inline(always)]
    pub fn leaves(&self, at: (usize, usize, usize), j0: usize, n: usize) -> bool {
        let (row, sj) = self.row(at);
        let keys = row + j0..row + j0 + n;
        sj == 1
            && match self.data {
                MaskData::Keeps(d) => keeps_all(&d[keys]),
                MaskData::F32(d) => adds_zero(&d[keys]),
                MaskData::F16(d) => adds_zero(&d[keys]),
                MaskData::Bf16(d) => adds_zero(&d[keys]),
            }
    }

    /// [`apply`](Self::apply) to scaled scores `s` of query `(b, h, i)`, keys `j0..j0 + STRIP`, of
    /// which the first `seen` are visible: inlined into the caller's vector level where the strip
    /// is whole and the mask row contiguous. The AVX2 backward's dK/dV launch applies the mask a
    /// 16-key strip row at a time; a call through `apply`'s CPU dispatch per strip row, after a
    /// [`leaves`](Self::leaves) scan, took a full float bias's backward 6–9% past the GEMM tiles'
    /// (causal ALiBi at `4x8x1024x64`: 86–88 ms that way, 77–80 inlined).
    #[inline(always)]
    pub fn apply_strip(&self, s: &mut [f32; STRIP], seen: usize, at: (usize, usize, usize), j0: usize) {
        let (row, sj) = self.row(at);
        if seen < STRIP || sj != 1 {
            return self.apply(&mut s[..seen], at, j0, 1.0);
        }
        let keys = row + j0..row + j0 + STRIP;
        match self.data {
            // A strip the mask keeps whole (most of a causal or a padding mask's) costs one test:
            // selecting every strip cost a boolean causal mask's backward 9%.
            MaskData::Keeps(d) if keeps_all(&d[keys.clone()]) => {}
            MaskData::Keeps(d) => select_hidden(s, &d[keys], f32::NEG_INFINITY),
            MaskData::F32(d) => add_strip_bias(s, &d[keys], self.hides),
            MaskData::F16(d) => add_strip_bias(s, &d[keys], self.hides),
            MaskData::Bf16(d) => add_strip_bias(s, &d[keys], self.hides),
        }
    }

    /// Applies the mask to the raw scores `s` of query `(b, h, i)`, keys `j0..j0 + s.len()`, which
    /// a softmax will multiply by `scale`: a hidden key's score becomes the one the softmax turns
    /// into −∞; a bias is added divided by `scale` (so that it adds to the scaled score), a hiding
    /// one ([`hiding_bias`]) as −∞.
    #[inline(always)]
    pub fn apply(&self, s: &mut [f32], at: (usize, usize, usize), j0: usize, scale: f32) {
        let (row, sj) = self.row(at);
        let (row, n) = (row + j0 * sj, s.len());
        match self.data {
            MaskData::Keeps(d) if sj == 1 => hide_scores(s, &d[row..row + n], hidden_score(scale)),
            MaskData::Keeps(d) => {
                for (j, v) in s.iter_mut().enumerate() {
                    if !d[row + j * sj] {
                        *v = hidden_score(scale);
                    }
                }
            }
            MaskData::F32(d) => add_bias(s, d, (row, sj), (scale.recip(), self.hides)),
            MaskData::F16(d) => add_bias(s, d, (row, sj), (scale.recip(), self.hides)),
            MaskData::Bf16(d) => add_bias(s, d, (row, sj), (scale.recip(), self.hides)),
        }
    }
}

/// Adds a strip row's bias to its scores (`−∞` where it hides), inlined into the caller's vector
/// level ([`MaskRows::apply_strip`]).
#[inline(always)]
fn add_strip_bias<T: FloatElement>(s: &mut [f32; STRIP], bias: &[T], hides: f32) {
    // Widened as a whole strip first: element by element, bf16's widening stayed scalar.
    let bias = T::widen_lanes::<STRIP>(bias.try_into().expect("a strip of bias"));
    for (v, b) in s.iter_mut().zip(bias) {
        *v += unless_hiding(b, hides);
    }
}

/// Where the first element of `row` that `shown` holds for lies: 32 at a time by a vector OR,
/// then within the chunk that has it. The tiles a padding hides are found by this search, row by
/// row of each band (an element-by-element search cost a left-padded f32 batch `4x8x1024x64`
/// with a boolean mask a tenth of its time).
#[inline(always)]
fn first_where<T: Copy>(row: &[T], shown: impl Fn(T) -> bool) -> Option<usize> {
    let mut at = 0;
    for chunk in row.chunks(32) {
        if chunk.iter().fold(false, |any, &x| any | shown(x)) {
            return chunk.iter().position(|&x| shown(x)).map(|o| at + o);
        }
        at += chunk.len();
    }
    None
}

/// The bias at or below which a float mask of `dtype` hides a key: its lowest finite value, which
/// transformers 4.x fills its padding and causal masks with (`torch.finfo(dtype).min`), so that
/// its padded batches skip the tiles they hide as boolean and −∞ masks do.
///
/// Added to a score as a number, that bias leaves a query that sees some other key the same
/// probabilities (0 there: its difference to the row's max is about −3.4e38, or −65504 for f16),
/// but not a query it hides from every key: as a number it would weigh those keys by their scores
/// (or, where it absorbs them, equally); hidden, the query gets output 0 and `lse = -inf`, as one
/// that a boolean mask hides whole. Every route applies it as −∞, so they agree on those rows.
pub(crate) fn hiding_bias(dtype: DType) -> f32 {
    match dtype {
        DType::F16 => f16::MIN.to_f32(),
        DType::BF16 => bf16::MIN.to_f32(),
        _ => f32::MIN,
    }
}

/// Where the first of `keys` that a bias row (from `row`, stride `sj`) does not hide (is above
/// `hides`, the mask's [`hiding_bias`]; NaN is not hidden) lies among them.
fn first_unhidden<T: FloatElement>(
    d: &[T],
    (row, sj): (usize, usize),
    keys: Range<usize>,
    hides: f32,
) -> Option<usize> {
    let shown = |v: T| unless_hiding(v, hides) != f32::NEG_INFINITY;
    if sj == 1 {
        return first_where(&d[row + keys.start..row + keys.end], shown);
    }
    keys.into_iter().position(|j| shown(d[row + j * sj]))
}

/// Whether a boolean mask keeps every key of `keeps` (an AND that vectorizes).
#[inline(always)]
fn keeps_all(keeps: &[bool]) -> bool {
    keeps.iter().fold(true, |all, &keep| all & keep)
}

/// Whether every element of `bias` is ±0 (the bits past the sign OR-ed: a loop that vectorizes).
#[inline(always)]
fn adds_zero<T: FloatElement>(bias: &[T]) -> bool {
    bias.iter().fold(0, |bits, v| bits | v.to_f32().to_bits() << 1) == 0
}

/// `s[j] += bias[row + j·sj] · per_score`, a bias at or below `hides` taken as −∞.
fn add_bias<T: FloatElement>(s: &mut [f32], bias: &[T], (row, sj): (usize, usize), (per_score, hides): (f32, f32)) {
    if sj == 1 {
        add_bias_row(s, &bias[row..row + s.len()], per_score, hides);
    } else {
        for (j, v) in s.iter_mut().enumerate() {
            *v += unless_hiding(bias[row + j * sj], hides) * per_score;
        }
    }
}

/// `bias` widened, or −∞ where it is at or below `hides`.
#[inline(always)]
fn unless_hiding<T: FloatElement>(bias: T, hides: f32) -> f32 {
    let b = bias.to_f32();
    if b <= hides {
        f32::NEG_INFINITY
    } else {
        b
    }
}

crate::simd_kernel! {
/// `s[j] = hidden` where `keeps[j]` is false: a vector select a step. Built for the CPU's vector
/// level (the forward and backward bodies that call it are not): at the SSE2 baseline the select
/// took ~2 instructions a score, a tenth of a bf16 forward at 4x6x512x64.
fn hide_scores(s: &mut [f32], keeps: &[bool], hidden: f32) {
    select_hidden(s, keeps, hidden)
}
}

/// `s[j] = hidden` where `keeps[j]` is false, inlined into the caller's vector level: the body of
/// [`hide_scores`], and of [`MaskRows::apply_strip`]'s boolean strips.
#[inline(always)]
fn select_hidden(s: &mut [f32], keeps: &[bool], hidden: f32) {
    for (v, &keep) in s.iter_mut().zip(keeps) {
        *v = if keep { *v } else { hidden };
    }
}

crate::simd_kernel! {
/// `s[j] += bias[j] · per_score` (−∞ for a bias at or below `hides`), at the CPU's vector level
/// like [`hide_scores`].
fn add_bias_row<T: FloatElement>(s: &mut [f32], bias: &[T], per_score: f32, hides: f32) {
    for (v, &b) in s.iter_mut().zip(bias) {
        *v += unless_hiding(b, hides) * per_score;
    }
}
}

/// The raw score that a softmax with `scale` turns into −∞ (a hidden key).
pub(crate) fn hidden_score(scale: f32) -> f32 {
    if scale < 0.0 {
        f32::INFINITY
    } else {
        f32::NEG_INFINITY
    }
}

/// What element `(b, h, i, j)` of the f64 reference's `mask` (broadcast as [`MaskRows`]) adds to
/// the query's scaled score for the key: a float mask's value (−∞ at or below its
/// [`hiding_bias`]); a boolean one's 0 (keep, 1) or −∞ (hide, 0); 0 when there is no mask.
pub(crate) fn reference_bias(g: &Geometry, mask: Option<&RefTensor>, at: [usize; 4]) -> f64 {
    let Some(mask) = mask else { return 0.0 };
    match (g.mask, mask.data[reference_mask_index(g, &mask.shape, at)]) {
        (Some(DType::Bool), 0.0) => f64::NEG_INFINITY,
        (Some(DType::Bool), _) => 0.0,
        (Some(dtype), bias) if bias <= f64::from(hiding_bias(dtype)) => f64::NEG_INFINITY,
        (_, bias) => bias,
    }
}

/// Where element `(b, h, i, j)` (`b` a flat batch row) of the mask's broadcast to
/// `[..., Hq, Sq, Sk]` lies in the dense data of a mask of `shape` (size-1 dims broadcast).
pub(crate) fn reference_mask_index(g: &Geometry, shape: &[usize], [b, h, i, j]: [usize; 4]) -> usize {
    let rank = g.batch_dims.rank;
    let mut full = [0; MAX_BATCH_DIMS + 3];
    full[..rank].copy_from_slice(&g.batch_dims.index(b)[..rank]);
    full[rank..rank + 3].copy_from_slice(&[h, i, j]);
    let at = &full[rank + 3 - shape.len()..rank + 3];
    shape.iter().zip(at).fold(0, |acc, (&n, &x)| acc * n + if n == 1 { 0 } else { x })
}

/// Row addressing of a `[..., H, S, D]` view with a dense last dim (flat batch rows).
#[derive(Clone, Copy)]
pub(crate) struct Rows4 {
    base: usize,
    batch: BatchStrides,
    strides: [usize; 2],
}

impl Rows4 {
    pub fn of(t: &uniop::Layout) -> Rows4 {
        let (shape, s) = (t.shape(), t.strides());
        let lead = shape.len() - 3;
        let batch = BatchStrides::of(&BatchDims::of(&shape[..lead]), &shape[..lead], &s[..lead]);
        Rows4 { base: t.offset(), batch, strides: [s[lead], s[lead + 1]] }
    }
    /// Storage offset of row `(b, h, i)`.
    #[inline(always)]
    pub fn at(&self, b: usize, h: usize, i: usize) -> usize {
        self.base + self.batch.offset(b) + h * self.strides[0] + i * self.strides[1]
    }
    /// Distance between consecutive positions of one head.
    pub fn seq_stride(&self) -> usize {
        self.strides[1]
    }
}

/// Key count of batch row `b`: `kv_lens[b]` when given, else all `kv_len` keys.
/// Refuses the launch (a runtime error naming the argument) on a length outside `[0, kv_len]`.
pub(crate) fn row_len(lens: Option<&TensorRef<'_>>, b: usize, kv_len: usize, op: &str) -> usize {
    let Some(lens) = lens else { return kv_len };
    let at = lens.layout().offset_of_linear(b);
    let len = match lens.dtype() {
        DType::I32 => lens.storage::<i32>().expect("dtype checked")[at] as i64,
        _ => lens.storage::<i64>().expect("dtype checked")[at],
    };
    if len < 0 || len as usize > kv_len {
        uniop::refuse_launch(format!(
            "{op}: argument 'kv_lens': expected values in [0, {kv_len}] (the cache length of k), got {len} at position {b}"
        ));
    }
    len as usize
}

/// Keys `[j0, j0 + n)` of head `h` of `t` (K or V) as an f32 matrix with dense rows: the tensor
/// itself when it is f32, else the rows widened into `scratch`. Returns pointer and row stride.
#[inline(always)]
pub(crate) fn f32_rows<T: FloatElement>(
    t: &TensorRef<'_>,
    rows: Rows4,
    (b, h, j0): (usize, usize, usize),
    n: usize,
    width: usize,
    scratch: &mut [f32],
) -> (*const f32, usize) {
    let data = t.storage::<T>().expect("dtype dispatched");
    if T::DTYPE == DType::F32 {
        // SAFETY: T is f32 (checked above), so the cast reinterprets nothing.
        return (unsafe { data.as_ptr().add(rows.at(b, h, j0)) as *const f32 }, rows.seq_stride());
    }
    for j in 0..n {
        let at = rows.at(b, h, j0 + j);
        T::widen(&data[at..at + width], &mut scratch[j * width..(j + 1) * width]);
    }
    (scratch.as_ptr(), width)
}

/// `s[rows, :n] = a[rows, :w] · b[:n, :w]ᵀ` with the AVX512-BF16 GEMM: `a` a dense bf16 tile,
/// `b`'s rows read in place (row stride `bs`), f32 sums; `s` has rows of `TILE_KEYS`. Unscaled:
/// the softmax that reads the scores applies the scale.
///
/// # Safety
/// `b` must be valid for `n` rows of `w` elements at stride `bs`.
pub(crate) unsafe fn bf16_scores(
    s: &mut [f32],
    a: &[bf16],
    w: usize,
    rows: usize,
    (b, bs): (*const bf16, usize),
    n: usize,
) {
    gemm_rows_packed(
        0..rows,
        n,
        w,
        Dst { ptr: s.as_mut_ptr(), rs: TILE_KEYS as isize, cs: 1 },
        Mat { ptr: a.as_ptr(), rs: w as isize, cs: 1 },
        Mat { ptr: b, rs: 1, cs: bs as isize },
        false,
    );
}

/// An f32 scratch tile's space seen as twice as many bf16 elements.
#[inline(always)]
pub(crate) fn bf16_tile(tile: &mut [f32]) -> &mut [bf16] {
    // SAFETY: bf16 has half f32's size and a smaller alignment; the borrow is carried over.
    unsafe { std::slice::from_raw_parts_mut(tile.as_mut_ptr() as *mut bf16, tile.len() * 2) }
}

/// Widens row `at` of `data` into `dst`, multiplied by `scale`.
#[inline(always)]
pub(crate) fn load_scaled<T: FloatElement>(data: &[T], at: usize, dst: &mut [f32], scale: f32) {
    T::widen(&data[at..at + dst.len()], dst);
    dst.iter_mut().for_each(|v| *v *= scale);
}

/// `s[rows, :n] = q[rows, :d] · k[:n, :d]ᵀ` (row strides `sw`, `d`, `ks`).
///
/// # Safety
/// `k` must be valid for `n` rows of `d` elements at stride `ks`.
#[inline(always)]
pub(crate) unsafe fn scores(
    s: &mut [f32],
    sw: usize,
    q: &[f32],
    d: usize,
    rows: usize,
    k: (*const f32, usize),
    n: usize,
) {
    gemm_rows(
        0..rows,
        n,
        d,
        Dst { ptr: s.as_mut_ptr(), rs: sw as isize, cs: 1 },
        Mat { ptr: q.as_ptr(), rs: d as isize, cs: 1 },
        Mat { ptr: k.0, rs: 1, cs: k.1 as isize },
        false,
    );
}

/// Where [`online_softmax_row`] leaves a row's probabilities.
pub(crate) enum Probabilities<'a> {
    /// Over the row's scores, in f32 (for the f32 `P·V` product).
    InPlace,
    /// Rounded to bf16 into a row of their own, as torch's flash attention rounds P for bf16 (for
    /// the bf16 `P·V` product); the scores stay as they were.
    Bf16(&'a mut [bf16]),
}

/// How far (in scaled scores) a row's new scores may rise above its running max `m` before
/// [`online_softmax_row`] takes a new max: up to e^8 ≈ 3000 for a probability, far from f32's range.
const LAZY_MAX_MARGIN: f32 = 8.0;

crate::simd_kernel! {
/// One online-softmax step for a row of unscaled scores `s` (the first `visible` of which are
/// unmasked): updates the running max `m` and sum `l` of the scores times `scale`, rescales the
/// output row `o`, and leaves the probabilities (0 where masked) where `p` says, for the `P·V`
/// product. The scale is applied here, inside the passes the row needs anyway, rather than in
/// a pass of its own over the score tile. Their exp is [`math::exp_for`] the output type `T`.
///
/// With a separate bf16 row the running max is kept lazily (as FlashAttention-4 does): once a
/// row has one, a tile's exps are taken against it in the same pass that finds the tile's max,
/// and only a tile rising more than [`LAZY_MAX_MARGIN`] above it is taken again against its own
/// max. `o / l` is the same for any reference max; the separate max pass and its reduction were
/// a third of this function's time in bf16 attention on AMX (where the products are fast).
fn online_softmax_row<T: FloatElement>(s: &mut [f32], p: Probabilities<'_>, scale: f32, visible: usize, m: &mut f32, l: &mut f32, o: &mut [f32]) {
    let live = visible.min(s.len());
    let (sum, new_m) = match p {
        Probabilities::InPlace => {
            s[live..].fill(0.0);
            let Some(new_m) = running_max(&s[..live], scale, *m) else {
                s[..live].fill(0.0); // every visible key hidden by the mask: no probabilities
                return;
            };
            (exp_pass::<T, false, false>(&mut s[..live], &mut [], scale, new_m).0, new_m)
        }
        Probabilities::Bf16(p) if bf16::converts_natively() => bf16_probabilities::<T, true>(&mut s[..live], p, scale, *m),
        Probabilities::Bf16(p) => bf16_probabilities::<T, false>(&mut s[..live], p, scale, *m),
    };
    if new_m == f32::NEG_INFINITY {
        return; // nothing visible yet: the probabilities are zeros, m and l stay empty
    }
    if new_m > *m {
        let alpha = math::exp(*m - new_m);
        o.iter_mut().for_each(|v| *v *= alpha);
        *l *= alpha;
        *m = new_m;
    }
    *l += sum;
}
}

/// [`online_softmax_row`]'s bf16 probabilities of the visible scores `s` into `p` (zeros past
/// them), against the running max `m` unless the row rises too far above it (or has none yet).
/// Returns the probabilities' sum and the max they were taken against.
#[inline(always)]
fn bf16_probabilities<T: FloatElement, const NATIVE: bool>(
    s: &mut [f32],
    p: &mut [bf16],
    scale: f32,
    m: f32,
) -> (f32, f32) {
    let (live, masked) = p.split_at_mut(s.len());
    masked.fill(bf16::ZERO);
    if m > f32::NEG_INFINITY {
        let (sum, rise) = exp_pass::<T, true, NATIVE>(s, live, scale, m);
        if rise <= LAZY_MAX_MARGIN {
            return (sum, m);
        }
    }
    let Some(new_m) = running_max(s, scale, m) else {
        live.fill(bf16::ZERO);
        return (0.0, f32::NEG_INFINITY);
    };
    (exp_pass::<T, true, NATIVE>(s, live, scale, new_m).0, new_m)
}

/// The larger of `m` and the largest of `s` times `scale`; `None` while both are −∞.
#[inline(always)]
fn running_max(s: &[f32], scale: f32, m: f32) -> Option<f32> {
    // The largest scaled score is the scale times the largest raw one, or the smallest for a
    // negative scale: one compare a lane, no multiply.
    let extreme = if scale >= 0.0 { row_extreme::<false>(s) } else { row_extreme::<true>(s) };
    Some((extreme * scale).max(m)).filter(|&m| m > f32::NEG_INFINITY)
}

/// `e = exp(s · scale − m)` for a row of scores: into `s` itself, or rounded to bf16 into `p` when
/// `NARROW` (by the CPU's instruction when `NATIVE`). Returns `Σ e` and the largest `s · scale − m`.
///
/// The tail runs through the same vector code, padded to a whole step; its padding is kept out of
/// the sum and the max by selects (no scalar loop of exps: rows here are short, and a tail is up to
/// W − 1 of their elements).
#[inline(always)]
fn exp_pass<T: FloatElement, const NARROW: bool, const NATIVE: bool>(
    s: &mut [f32],
    p: &mut [bf16],
    scale: f32,
    m: f32,
) -> (f32, f32) {
    let mut acc = ExpSums { sums: [0f32; W], tops: [f32::NEG_INFINITY; W] };
    let full = s.len() - s.len() % W;
    let (body, tail) = s.split_at_mut(full);
    let (p_body, p_tail) = if NARROW { p.split_at_mut(full) } else { (&mut [][..], &mut [][..]) };
    for (at, c) in (0..full).step_by(W).zip(body.chunks_exact_mut(W)) {
        let p = if NARROW { &mut p_body[at..at + W] } else { &mut [][..] };
        acc.step::<T, NARROW, NATIVE>(c.try_into().expect("W scores"), p, W, scale, m);
    }
    let mut padded = [0f32; W];
    padded[..tail.len()].copy_from_slice(tail);
    let mut padded_p = [bf16::ZERO; W];
    acc.step::<T, NARROW, NATIVE>(&mut padded, &mut padded_p, tail.len(), scale, m);
    if NARROW {
        p_tail.copy_from_slice(&padded_p[..tail.len()]);
    } else {
        tail.copy_from_slice(&padded[..tail.len()]);
    }
    (math::sum_lanes(acc.sums), math::combine_lanes(acc.tops, |a, b| if b > a { b } else { a }))
}

/// [`exp_pass`]'s running sums and maxima, per lane.
struct ExpSums {
    sums: [f32; W],
    tops: [f32; W],
}

impl ExpSums {
    /// One step of [`exp_pass`]: the first `lanes` of `x`. A method, not a closure: a closure
    /// keeps the (baseline) target features of the function that defines it, and where LLVM left
    /// it out of line, its `mul_add` became a call per lane to compiler-builtins' `fmaf` — a third of
    /// bf16 decode attention's time on AVX2 (Zen 3).
    #[inline(always)]
    fn step<T: FloatElement, const NARROW: bool, const NATIVE: bool>(
        &mut self,
        x: &mut [f32; W],
        p: &mut [bf16],
        lanes: usize,
        scale: f32,
        m: f32,
    ) {
        let mut e = [0f32; W];
        for (i, (((a, t), e), &v)) in self.sums.iter_mut().zip(&mut self.tops).zip(&mut e).zip(x.iter()).enumerate() {
            let shifted = v.mul_add(scale, -m);
            let inside = i < lanes;
            *t = if inside && shifted > *t { shifted } else { *t };
            *e = if inside { math::exp_for::<T>(shifted) } else { 0.0 };
            *a += *e;
        }
        if NARROW {
            let p: &mut [bf16; W] = p.try_into().expect("W probabilities");
            // SAFETY: `NATIVE` only where the caller found `bf16::converts_natively()`.
            unsafe { narrow_step::<NATIVE>(&e, p) };
        } else {
            // The scores stay when the probabilities go to `p` (a row rising too far is taken again).
            *x = e;
        }
    }
}

/// One step of [`W`] lanes rounded to bf16 (probabilities, score gradients).
///
/// # Safety
/// `NATIVE` only where `bf16::converts_natively()`.
#[inline(always)]
pub(crate) unsafe fn narrow_step<const NATIVE: bool>(x: &[f32; W], p: &mut [bf16; W]) {
    if NATIVE {
        // In registers: the exps are still there, and storing them to reload cost a
        // store-forwarding stall per step on the AMX Xeon (a fifth of the row pass's samples).
        *p = bf16::narrow_lanes_natively(*x);
        return;
    }
    *p = bf16::narrow_lanes(x);
}

/// The largest (smallest when `MIN`) of a row's scores.
/// Compared with `>`/`<` rather than `f32::max`: one `vmaxps` a step where `max` added a NaN
/// fix-up, and LLVM split the loop into scalar and narrow pieces (a fifth of the row pass's time at
/// 1x6x512x64). NaN scores are skipped, as `max` skips them. The lanes are combined pairwise (a
/// chain of 16 scalar compares was a tenth of the row's time at 256 keys).
#[inline(always)]
fn row_extreme<const MIN: bool>(s: &[f32]) -> f32 {
    let beyond = |v: f32, e: f32| if MIN { v < e } else { v > e };
    let fold = |e: f32, v: f32| if beyond(v, e) { v } else { e };
    let mut lanes = [if MIN { f32::INFINITY } else { f32::NEG_INFINITY }; W];
    let body = s.chunks_exact(W);
    let tail = body.remainder();
    for c in body {
        for (e, &v) in lanes.iter_mut().zip(c) {
            *e = fold(*e, v);
        }
    }
    tail.iter().fold(math::combine_lanes(lanes, fold), |e, &v| fold(e, v))
}

/// Lanes of [`online_softmax_row`]'s vector code. Float reductions only vectorize with explicit
/// lanes (LLVM keeps a loop's sequential order).
pub(crate) const W: usize = 16;

/// Scratch pieces carved from one block's f32 workspace.
pub(crate) fn carve<const N: usize>(mut ws: &mut [f32], sizes: [usize; N]) -> [&mut [f32]; N] {
    sizes.map(|n| {
        let (head, tail) = std::mem::take(&mut ws).split_at_mut(n);
        ws = tail;
        head
    })
}

thread_local! {
    /// The forward blocks' packed K and V tiles (see [`KvPanels`]); kept per thread for the
    /// buffers' capacity, emptied at the start of every block.
    static KV_PANELS: std::cell::RefCell<KvPanels> = std::cell::RefCell::default();
}

/// Whole key tiles (`TILE_KEYS` keys) of one (batch row, kv head), K for the scores and V for
/// `P·V`, packed for the bf16 GEMM (or AVX-512's packed f32 one) the first time a query tile of
/// that head needs them: the head's other query tiles multiply the same tiles, and the forward's
/// blocks take their units head by head. Packing K is a transpose; packing per product took about
/// a sixth of the bf16 forward's time at 1x32x2048x128. A causal query tile's last tile, of which
/// it sees only the first keys, multiplies the leading part of the packed tile; a tile reaching
/// past the row's keys (the sequence's end, or `kv_lens`) is packed per product as before, so that
/// nothing past the row's last key is read (a never-written cache slot may hold NaN).
#[derive(Default)]
struct KvPanels {
    head: Option<(usize, usize)>,
    k: Vec<PackedRhs>,
    v: Vec<PackedRhs>,
    packed: Vec<bool>,
}

impl KvPanels {
    /// Key tile `tile` of `head` (packing it with `pack` unless that was done).
    fn tile(
        &mut self,
        head: (usize, usize),
        tile: usize,
        pack: impl FnOnce(&mut PackedRhs, &mut PackedRhs),
    ) -> (&PackedRhs, &PackedRhs) {
        if self.head != Some(head) {
            self.head = Some(head);
            self.packed.fill(false);
        }
        if self.packed.len() <= tile {
            self.k.resize_with(tile + 1, PackedRhs::default);
            self.v.resize_with(tile + 1, PackedRhs::default);
            self.packed.resize(tile + 1, false);
        }
        if !self.packed[tile] {
            pack(&mut self.k[tile], &mut self.v[tile]);
            self.packed[tile] = true;
        }
        (&self.k[tile], &self.v[tile])
    }
}

/// Packs one key tile's K (as `Kᵀ`, for the scores) and V (for `P·V`): `k` and `v` start at the
/// tile's first rows, `ks` and `vs` are their row strides, `d` and `dv` their widths.
///
/// # Safety
/// Both must hold `TILE_KEYS` rows at their strides.
unsafe fn pack_kv<E: Packed>(
    kp: &mut PackedRhs,
    vp: &mut PackedRhs,
    (k, v): (&[E], &[E]),
    (ks, vs): (usize, usize),
    (d, dv): (usize, usize),
) {
    kp.pack(Mat { ptr: k.as_ptr(), rs: 1, cs: ks as isize }, TILE_KEYS, d);
    vp.pack(Mat { ptr: v.as_ptr(), rs: vs as isize, cs: 1 }, dv, TILE_KEYS);
}

/// A dense row-major `[rows][width]` scratch tile as a GEMM operand.
pub(crate) fn rows_of<E>(tile: &[E], width: usize) -> Mat<E> {
    Mat { ptr: tile.as_ptr(), rs: width as isize, cs: 1 }
}

/// One product of a query tile on a packed key-tile panel, piece by piece (see
/// [`QueryTile::walks`]): `dst[rows] (+)= lhs[rows] · B`, walking `window(keys)` (columns, depth)
/// of the panel for a piece that walks `keys` of it.
///
/// # Safety
/// As [`gemm_rows_prepacked`] for every piece.
unsafe fn in_pieces<E: Packed>(
    pieces: &[(Range<usize>, Range<usize>)],
    window: impl Fn(Range<usize>) -> (Range<usize>, Range<usize>),
    dst: Dst<f32>,
    lhs: Mat<E>,
    rhs: &PackedRhs,
    accumulate: bool,
) {
    for (rows, keys) in pieces.iter().filter(|(_, keys)| !keys.is_empty()) {
        gemm_rows_prepacked(rows.clone(), window(keys.clone()), dst, lhs, rhs, accumulate);
    }
}

/// The forward's operands with their row addressing, as both tile kernels read them.
pub(crate) struct ForwardArgs<'a> {
    pub q: TensorRef<'a>,
    pub k: TensorRef<'a>,
    pub v: TensorRef<'a>,
    pub lens: Option<TensorRef<'a>>,
    pub mask: Option<MaskRows<'a>>,
    /// `sinks` widened to f32, one per q head (a few hundred bytes, once per block).
    sinks: Option<Vec<f32>>,
    out: uniop::OutputView<'a>,
    lse: uniop::OutputView<'a>,
    /// Rows of q, k, v and out.
    pub rows: [Rows4; 4],
}

impl<'a> ForwardArgs<'a> {
    pub fn of(args: &'a KernelArgs) -> ForwardArgs<'a> {
        let (q, k, v, out) = (args.input(0), args.input(1), args.input(2), args.output(0));
        let rows = [q.layout(), k.layout(), v.layout(), out.layout()].map(Rows4::of);
        let (lens, mask) = (args.optional_input(3), MaskRows::of(args.optional_input(4), &q));
        let sinks = args.optional_input(5).map(|s| s.to_f64_vec().into_iter().map(|x| x as f32).collect());
        ForwardArgs { q, k, v, lens, mask, sinks, out, lse: args.output(1), rows }
    }

    /// Writes query `(b, h, i)`'s output row from its unnormalised sums `o` (scaled in place by
    /// `1 / l`), and its lse from the running max `m` and sum `l` (`-inf`, out 0, when it saw
    /// no key). A sink joins the sum here: `l` grows by `exp(sink − m)` (against the larger of
    /// the two maxima), once per row whichever route ran the row's keys.
    ///
    /// # Safety
    /// The caller's unit must own that query.
    pub unsafe fn finish_row<T: FloatElement>(
        &self,
        g: Geometry,
        (b, h, i): (usize, usize, usize),
        o: &mut [f32],
        m: f32,
        l: f32,
    ) {
        let (inv, lse) = match &self.sinks {
            None if l > 0.0 => (1.0 / l, m + l.ln()),
            None => (0.0, f32::NEG_INFINITY),
            Some(sinks) if l > 0.0 => {
                let top = m.max(sinks[h]);
                let (kept, total) = (math::exp(m - top), l * math::exp(m - top) + math::exp(sinks[h] - top));
                (kept / total, top + total.ln())
            }
            Some(sinks) => (0.0, sinks[h]),
        };
        o.iter_mut().for_each(|x| *x *= inv);
        T::narrow(o, self.out.slice_mut::<T>(self.rows[3].at(b, h, i), o.len()));
        out_lse(&self.lse, g, b, h, i)[0] = lse;
    }
}

/// Per query row of a key range ([`key_splits`]): its running max and sum, then its unnormalised
/// output sums.
fn split_state_len(g: &Geometry) -> usize {
    2 + g.v_dim
}

/// The f32 workspace region of unit `u`'s key range `split` of `splits` (from `base`): one
/// [`split_state_len`] record per tile row.
///
/// # Safety
/// The caller must own that range's records for the launch.
#[allow(clippy::mut_from_ref)]
unsafe fn split_states<'a>(
    args: &'a KernelArgs,
    g: &Geometry,
    base: usize,
    (u, split, splits): (usize, usize, usize),
) -> &'a mut [f32] {
    let len = g.group() * g.tile_q() * split_state_len(g);
    args.workspace::<f32>(base + (u * splits + split) * len, len)
}

/// Key tiles of a unit with `kv_end` keys that range `split` of `splits` walks: whole tiles, as
/// evenly as they divide.
fn split_keys(kv_end: usize, (split, splits): (usize, usize)) -> Range<usize> {
    let tiles = kv_end.div_ceil(TILE_KEYS);
    let tile = |s: usize| tiles * s / splits * TILE_KEYS;
    tile(split)..tile(split + 1).min(kv_end)
}

/// The last step of a forward with key ranges: per query row, the ranges' states merged (each
/// range's sums weighed by `e^(m_range − m)` for the overall max `m`), normalised and stored.
fn combine<T: FloatElement>(args: &KernelArgs, ctx: BlockCtx, g: Geometry, (base, splits): (usize, usize)) {
    let fa = ForwardArgs::of(args);
    let (dv, width) = (g.v_dim, split_state_len(&g));
    // SAFETY: block b owns the start of its scratch range (no fewer blocks ran the key ranges).
    let o = unsafe { args.workspace::<f32>(ctx.block_idx as usize * g.forward_scratch(g.group() * g.tile_q()), dv) };
    for u in ctx.split(g.units()) {
        let t = g.query_tile(g.unit_by_head(u), fa.lens.as_ref(), "attention");
        for r in 0..t.rows() {
            // SAFETY: unit u alone reads its ranges' states (the key-range step has finished).
            let state = |s| &unsafe { split_states(args, &g, base, (u, s, splits)) }[r * width..(r + 1) * width];
            let rows = (0..splits).map(state);
            let m = rows.clone().fold(f32::NEG_INFINITY, |m, st| m.max(st[0]));
            o.fill(0.0);
            let mut l = 0.0;
            if m > f32::NEG_INFINITY {
                for st in rows {
                    let w = math::exp(st[0] - m);
                    l += w * st[1];
                    o.iter_mut().zip(&st[2..]).for_each(|(o, &x)| *o += w * x);
                }
            }
            let (h, i) = t.head_pos(r);
            // SAFETY: this unit owns rows (b, h, q0..q0+n_pos) of out and lse.
            unsafe { fa.finish_row::<T>(g, (t.b, h, i), o, m, l) };
        }
    }
}

/// The forward's tiles: one unit (a query tile, or with `splits` above 1 one key range of it, its
/// state then left at `states` for [`combine`]) at a time.
fn forward<T: FloatElement>(args: &KernelArgs, ctx: BlockCtx, g: Geometry, (states, splits): (usize, usize)) {
    let fa = ForwardArgs::of(args);
    let (q, k, v, lens) = (&fa.q, &fa.k, &fa.v, &fa.lens);
    let [qr, kr, vr, _] = fa.rows;
    let qs = q.storage::<T>().expect("dtype dispatched");
    let (d, dv, group, tq) = (g.head_dim, g.v_dim, g.group(), g.tile_q());
    let per_block = g.forward_scratch(group * tq);
    // SAFETY: block b owns scratch range b.
    let ws = unsafe { args.workspace::<f32>(ctx.block_idx as usize * per_block, per_block) };
    let [qt, st, ot, mt, lt, kt, vt] = carve(ws, g.forward_tiles(group * tq));
    // bf16 takes Q·Kᵀ straight from the bf16 rows through the AVX512-BF16 GEMM (K read in place);
    // its Q tile reuses the f32 Q tile's space. Both paths leave the scale to the softmax.
    let on_bf16_gemm = T::DTYPE == DType::BF16;
    // f32 runs on the packed f32 GEMM with the same panels where that GEMM exists (AVX-512); the
    // `gemm` crate would pack K and V on every product.
    let panels_apply = on_bf16_gemm || (T::DTYPE == DType::F32 && <f32 as Dots>::best() == Simd::Avx512);
    // By dtype, not by trying `storage::<bf16>()`: a failed one formats its error message.
    let (kb, vb) = match on_bf16_gemm {
        true => {
            (Some(k.storage::<bf16>().expect("dtype dispatched")), Some(v.storage::<bf16>().expect("v has q's dtype")))
        }
        false => (None, None),
    };
    let mut panels = KV_PANELS.take();
    panels.head = None;
    let mut walks = Vec::new();
    for unit in ctx.split(g.units() * splits) {
        let (u, split) = (unit / splits, unit % splits);
        let t = g.query_tile(g.unit_by_head(u), lens.as_ref(), "attention");
        let (b, hkv, rows) = (t.b, t.hkv, t.rows());
        if on_bf16_gemm {
            t.copy_rows(q.storage::<bf16>().expect("dtype dispatched"), qr, bf16_tile(qt), d);
        } else {
            t.load(qs, qr, qt, d, 1.0);
        }
        mt[..rows].fill(f32::NEG_INFINITY);
        lt[..rows].fill(0.0);
        ot[..rows * dv].fill(0.0);
        let keys = split_keys(t.kv_end(&g), (split, splits));
        for j0 in keys.clone().step_by(TILE_KEYS) {
            let n = TILE_KEYS.min(keys.end - j0);
            if fa.mask.is_some_and(|m| !m.tile_live(&g, (b, t.len), (0..rows).map(|r| t.head_pos(r)), (j0, n))) {
                continue;
            }
            // Tiles inside the row's keys come packed from `panels` (not for decode-sized tiles,
            // which the GEMM runs as dot products without packing).
            let reused = panels_apply && j0 + TILE_KEYS <= t.len && rows > SKINNY_ROWS;
            let tile_panels = reused.then(|| {
                panels.tile((b, hkv), j0 / TILE_KEYS, |kp, vp| {
                    let (k0, v0) = (kr.at(b, hkv, j0), vr.at(b, hkv, j0));
                    let strides = (kr.seq_stride(), vr.seq_stride());
                    // SAFETY: K's and V's rows j0..j0+TILE_KEYS of this head lie inside the checked views.
                    unsafe {
                        match (kb, vb) {
                            (Some(kb), Some(vb)) => pack_kv(kp, vp, (&kb[k0..], &vb[v0..]), strides, (d, dv)),
                            _ => {
                                let (kf, vf) = (k.storage::<f32>(), v.storage::<f32>());
                                let (kf, vf) = (kf.expect("f32 panels"), vf.expect("f32 panels"));
                                pack_kv(kp, vp, (&kf[k0..], &vf[v0..]), strides, (d, dv))
                            }
                        }
                    }
                })
            });
            // Pieces of rows and the keys their products walk, past those a mask hides from all
            // of a piece's rows (never read: a left padding's may be NaN). The panels' products go
            // piece by piece; the others take all rows at once, from the first key any row sees.
            t.walks(&g, fa.mask.as_ref(), (j0, n), &mut walks);
            let lead = walks.iter().map(|(_, keys)| keys.start).min().unwrap_or(0);
            if tile_panels.is_none() {
                walks.clear();
                walks.push((0..rows, lead..n));
            }
            if let Some((kp, _)) = tile_panels {
                // SAFETY: scratch tiles of this block.
                unsafe {
                    let (scores, walks) = (Dst { ptr: st.as_mut_ptr(), rs: TILE_KEYS as isize, cs: 1 }, &walks);
                    match on_bf16_gemm {
                        true => in_pieces(walks, |keys| (keys, 0..d), scores, rows_of(bf16_tile(qt), d), kp, false),
                        false => in_pieces(walks, |keys| (keys, 0..d), scores, rows_of(qt, d), kp, false),
                    }
                }
            } else if on_bf16_gemm {
                let kb = kb.expect("dtype dispatched");
                // SAFETY: K's rows j0+lead..j0+n of this head lie inside the checked view.
                unsafe {
                    let kp = kb.as_ptr().add(kr.at(b, hkv, j0 + lead));
                    bf16_scores(&mut st[lead..], bf16_tile(qt), d, rows, (kp, kr.seq_stride()), n - lead)
                };
            } else {
                let kp = f32_rows::<T>(k, kr, (b, hkv, j0 + lead), n - lead, d, kt);
                // SAFETY: kp covers n - lead rows of d elements (the views were checked when bound).
                unsafe { scores(&mut st[lead..], TILE_KEYS, qt, d, rows, kp, n - lead) };
            }
            for (r, lead) in walks.iter().flat_map(|(rows, keys)| rows.clone().map(|r| (r, keys.start))) {
                let (h, i) = t.head_pos(r);
                let visible = g.visible(t.len, i).saturating_sub(j0 + lead);
                let at = r * TILE_KEYS + lead;
                let s = &mut st[at..at + n - lead];
                if let Some(cap) = g.softcap {
                    cap_scores(&mut s[..visible.min(n - lead)], g.scale, cap as f32);
                }
                if let Some(mask) = &fa.mask {
                    mask.apply(&mut s[..visible.min(n - lead)], (b, h, i), j0 + lead, g.scale);
                }
                let p = match on_bf16_gemm {
                    true => Probabilities::Bf16(&mut bf16_tile(kt)[at..at + n - lead]),
                    false => Probabilities::InPlace,
                };
                online_softmax_row::<T>(s, p, g.scale, visible, &mut mt[r], &mut lt[r], &mut ot[r * dv..(r + 1) * dv]);
            }
            if let Some((_, vp)) = tile_panels {
                // SAFETY: scratch tiles of this block.
                unsafe {
                    let (out, walks) = (Dst { ptr: ot.as_mut_ptr(), rs: dv as isize, cs: 1 }, &walks);
                    match on_bf16_gemm {
                        true => {
                            in_pieces(walks, |keys| (0..dv, keys), out, rows_of(bf16_tile(kt), TILE_KEYS), vp, true)
                        }
                        false => in_pieces(walks, |keys| (0..dv, keys), out, rows_of(st, TILE_KEYS), vp, true),
                    }
                };
                continue;
            }
            if on_bf16_gemm {
                // P times V read in place, f32 sums.
                let pb = &bf16_tile(kt)[lead..];
                let vb = vb.expect("dtype dispatched");
                // SAFETY: V's rows j0+lead..j0+n of this head lie inside the checked view; `ot` is ours.
                unsafe {
                    gemm_rows_packed(
                        0..rows,
                        dv,
                        n - lead,
                        Dst { ptr: ot.as_mut_ptr(), rs: dv as isize, cs: 1 },
                        Mat { ptr: pb.as_ptr(), rs: TILE_KEYS as isize, cs: 1 },
                        Mat { ptr: vb.as_ptr().add(vr.at(b, hkv, j0 + lead)), rs: vr.seq_stride() as isize, cs: 1 },
                        true,
                    )
                };
                continue;
            }
            let vp = f32_rows::<T>(v, vr, (b, hkv, j0 + lead), n - lead, dv, vt);
            // SAFETY: as above; `ot` is this block's scratch.
            unsafe {
                gemm_rows(
                    0..rows,
                    dv,
                    n - lead,
                    Dst { ptr: ot.as_mut_ptr(), rs: dv as isize, cs: 1 },
                    Mat { ptr: st[lead..].as_ptr(), rs: TILE_KEYS as isize, cs: 1 },
                    Mat { ptr: vp.0, rs: vp.1 as isize, cs: 1 },
                    true,
                );
            }
        }
        if splits > 1 {
            // SAFETY: unit (u, split) alone writes its range's states.
            let dst = unsafe { split_states(args, &g, states, (u, split, splits)) };
            for (r, st) in dst.chunks_exact_mut(split_state_len(&g)).take(rows).enumerate() {
                st[..2].copy_from_slice(&[mt[r], lt[r]]);
                st[2..].copy_from_slice(&ot[r * dv..(r + 1) * dv]);
            }
            continue;
        }
        for r in 0..rows {
            let (h, i) = t.head_pos(r);
            // SAFETY: this unit owns rows (b, h, q0..q0+n_pos) of out and lse.
            unsafe { fa.finish_row::<T>(g, (b, h, i), &mut ot[r * dv..(r + 1) * dv], mt[r], lt[r]) };
        }
    }
    KV_PANELS.set(panels);
}

/// Scratch per block of `flash_avx2.rs`'s transposed tiles when the forward runs them (AVX2
/// CPUs), `None` when it runs the GEMM tiles above.
fn transposed_scratch(g: &Geometry) -> Option<usize> {
    #[cfg(target_arch = "x86_64")]
    if crate::flash_avx2::applies(g) {
        return Some(crate::flash_avx2::scratch(g));
    }
    None
}

/// Element `(b, h, i)` of the contiguous `[B, Hq, Sq]` lse tensor.
///
/// # Safety
/// The caller must own that element for the launch.
#[allow(clippy::mut_from_ref)]
unsafe fn out_lse<'a>(lse: &uniop::OutputView<'a>, g: Geometry, b: usize, h: usize, i: usize) -> &'a mut [f32] {
    lse.slice_mut::<f32>(lse.layout().offset() + (b * g.q_heads + h) * g.q_len + i, 1)
}

/// f64 reference of the forward: per query, softmax over its visible keys. Also used by the
/// backward's reference (it needs the probabilities).
pub(crate) fn reference_probs(
    g: &Geometry,
    q: &RefTensor,
    k: &RefTensor,
    lens: Option<&RefTensor>,
    mask: Option<&RefTensor>,
    sinks: Option<&RefTensor>,
) -> Vec<Vec<f64>> {
    let (d, group) = (g.head_dim, g.group());
    let mut probs = Vec::with_capacity(g.batch * g.q_heads * g.q_len);
    for b in 0..g.batch {
        let len = lens.map_or(g.kv_len, |l| l.data[b] as usize);
        for h in 0..g.q_heads {
            for i in 0..g.q_len {
                let qi = &q.data[((b * g.q_heads + h) * g.q_len + i) * d..][..d];
                let visible = g.visible(len, i);
                // Hidden keys (the mask's −∞) have no score; with none left the row is zeros, lse −∞.
                let s: Vec<Option<f64>> = (0..visible)
                    .map(|j| {
                        let kj = &k.data[((b * g.kv_heads + h / group) * g.kv_len + j) * d..][..d];
                        let bias = reference_bias(g, mask, [b, h, i, j]);
                        let scaled = || qi.iter().zip(kj).map(|(a, b)| a * b).sum::<f64>() * g.scale_f64;
                        (bias != f64::NEG_INFINITY).then(|| reference_cap(g, scaled()).0 + bias)
                    })
                    .collect();
                // The sink is one more logit in the softmax, of a key with no value.
                let sink = sinks.map_or(f64::NEG_INFINITY, |s| s.data[h]);
                let m = s.iter().flatten().copied().fold(sink, f64::max);
                if m == f64::NEG_INFINITY {
                    probs.push(vec![0.0; visible].into_iter().chain([f64::NEG_INFINITY]).collect());
                    continue;
                }
                let e: Vec<f64> = s.iter().map(|v| v.map_or(0.0, |v| (v - m).exp())).collect();
                let sum: f64 = e.iter().sum::<f64>() + (sink - m).exp();
                probs.push(e.iter().map(|v| v / sum).chain([m + sum.ln()]).collect());
            }
        }
    }
    probs
}

impl Op for Attention {
    fn schema(&self) -> &'static str {
        "attention(Tensor q, Tensor k, Tensor v, Tensor? kv_lens=None, bool causal=False, float? scale=None, \
         Tensor? mask=None, float? softcap=None, Tensor? sinks=None) -> (Tensor out, Tensor lse)"
    }

    fn doc(&self) -> &'static str {
        "Scaled dot-product attention, flash-style (O(tile) memory, never the Sq x Sk scores). q [B, Hq, Sq, D], \
         k [B, Hkv, Sk, D], v [B, Hkv, Sk, Dv] (any strides, dense last dim), B any number of leading batch dims \
         (up to 4, as SDPA's [..., H, S, D]); Hkv divides Hq (GQA). kv_lens (int [B]) \
         limits each batch row to its first keys (KV-cache decode). causal aligns bottom-right: query i sees key j \
         iff j <= i + len - Sq (torch is_causal when Sq == Sk). scale defaults to 1/sqrt(D). mask (broadcastable \
         to [B, Hq, Sq, Sk], as SDPA's attn_mask: bool, true = attend; or float32/float16/bfloat16, added to \
         the scaled scores; -inf and the dtype's lowest value, transformers 4.x's padding, hide) applies on top \
         of kv_lens and causal (key tiles it hides from a whole query tile are skipped, and the keys up to the \
         first one some query of a tile's product sees, in 32-key panels: a sliding window or a document mask \
         costs the keys it shows); the K/V rows of hidden keys it does not skip must be finite. softcap (Gemma \
         2's attn_logit_softcapping) caps the scaled scores to softcap * tanh(score / softcap) before the mask \
         adds. sinks (float [Hq], GPT-OSS's attention sinks) adds one logit per q head to each query's softmax, \
         of a key with value 0. lse: float32 \
         log-sum-exp of the (capped, masked) scaled scores and the sink per query (-inf, with out = 0, for a \
         query that sees no key and has no sink)."
    }

    fn dtypes(&self) -> &'static [DType] {
        DTYPES
    }

    fn backward(&self) -> Option<&'static str> {
        Some("attention_backward")
    }

    fn autocast(&self) -> uniop::Autocast {
        uniop::Autocast::LowerPrecision
    }

    fn leading_batch_args(&self) -> &'static [&'static str] {
        &["q", "k", "v", "kv_lens"]
    }

    fn infer(&self, cx: &OpCx) -> Result<Vec<TensorMeta>> {
        let g = geometry(cx)?;
        Ok(vec![
            TensorMeta::contiguous(g.dtype, &g.batch_dims.then(&[g.q_heads, g.q_len, g.v_dim]))?,
            TensorMeta::contiguous(DType::F32, &g.batch_dims.then(&[g.q_heads, g.q_len]))?,
        ])
    }

    fn plan(&self, cx: &OpCx) -> Result<Plan> {
        let g = geometry(cx)?;
        let threads = uniop::runtime::Pool::global().threads();
        let transposed = transposed_scratch(&g);
        // AVX2's transposed tiles hold query tiles of a band or more: never decode-sized.
        let splits = if transposed.is_some() { 1 } else { key_splits(&g, threads) };
        let block_dim = (g.units() * splits).clamp(1, 4 * threads) as u32;
        let per_block = transposed.unwrap_or_else(|| g.forward_scratch(g.group() * g.tile_q()));
        let transposed = transposed.is_some();
        // Each block's scratch, then (with key ranges) every range's states.
        let states = block_dim as usize * per_block;
        let states_len = if splits > 1 { g.units() * splits * g.group() * g.tile_q() * split_state_len(&g) } else { 0 };
        let steps = with_float_dtype!(g.dtype, cx.op(), "q", |T| {
            let tiles = Step::new("attention", block_dim, move |args, ctx| {
                #[cfg(target_arch = "x86_64")]
                if transposed {
                    return crate::flash_avx2::forward::<T>(args, ctx, g);
                }
                forward::<T>(args, ctx, g, (states, splits))
            });
            let mut steps = vec![tiles];
            if splits > 1 {
                let blocks = g.units().clamp(1, 4 * threads) as u32;
                steps.push(Step::new("attention.combine", blocks, move |args, ctx| {
                    combine::<T>(args, ctx, g, (states, splits))
                }));
            }
            steps
        });
        Ok(Plan::new(steps)
            .workspace((states + states_len) * 4)
            .inputs_need(vec![LayoutNeed::InnerContiguous; 3])
            .outputs_need(vec![LayoutNeed::Contiguous; 2]))
    }

    fn reference(&self, cx: &OpCx, inputs: &[Option<RefTensor>]) -> Result<Vec<RefTensor>> {
        let g = geometry(cx)?;
        let [q, k, v] = [0, 1, 2].map(|i| inputs[i].as_ref().unwrap());
        let probs = reference_probs(&g, q, k, inputs[3].as_ref(), inputs[4].as_ref(), inputs[5].as_ref());
        let dv = g.v_dim;
        let mut out = vec![0.0; g.batch * g.q_heads * g.q_len * dv];
        let mut lse = vec![0.0; probs.len()];
        for (row, p) in probs.iter().enumerate() {
            let (b, h) = (row / (g.q_heads * g.q_len), row / g.q_len % g.q_heads);
            let (weights, l) = p.split_at(p.len() - 1);
            lse[row] = l[0];
            // Hidden keys (weight 0) are not read: their values may be anything.
            for (j, w) in weights.iter().enumerate().filter(|(_, &w)| w != 0.0) {
                let vj = &v.data[((b * g.kv_heads + h / g.group()) * g.kv_len + j) * dv..][..dv];
                for (o, x) in out[row * dv..(row + 1) * dv].iter_mut().zip(vj) {
                    *o += w * x;
                }
            }
        }
        Ok(vec![
            RefTensor::new(&g.batch_dims.then(&[g.q_heads, g.q_len, dv]), out),
            RefTensor::new(&g.batch_dims.then(&[g.q_heads, g.q_len]), lse),
        ])
    }

    fn error_scale(&self, cx: &OpCx) -> f64 {
        geometry(cx).map_or(1.0, |g| (g.head_dim.max(1) as f64).sqrt())
    }

    fn example(&self, shape: Option<&[usize]>, dtype: DType) -> Result<Example> {
        let (q, kv) = example_shapes(shape);
        Ok(Example {
            inputs: vec![
                Some(TensorMeta::contiguous(dtype, &q)?),
                Some(TensorMeta::contiguous(dtype, &kv)?),
                Some(TensorMeta::contiguous(dtype, &kv)?),
                None,
                None,
                None,
            ],
            attrs: vec![("causal".into(), AttrValue::Bool(true))],
            ..Default::default()
        })
    }
}

/// `q` and `k`/`v` shapes for an example. By default LLaMA-7B prefill, `[1, 32, 2048, 128]` for
/// all three (the benchmark shape, comparable with torch SDPA). A given `shape` of rank 4 or more
/// (batch dims, then heads, seq, head dim) is all three's too (so the shape a benchmark reports
/// rebuilds its example); a shorter one is q's trailing dims, padded with leading 1s to rank 4,
/// and k/v get half its heads when that divides — so the generic registry tests (which pass 1-
/// to 3-dim shapes) exercise grouped-query attention.
pub(crate) fn example_shapes(shape: Option<&[usize]>) -> (Vec<usize>, Vec<usize>) {
    let Some(shape) = shape else { return (vec![1, 32, 2048, 128], vec![1, 32, 2048, 128]) };
    if shape.len() >= 4 {
        return (shape.to_vec(), shape.to_vec());
    }
    let mut q = vec![1; 4];
    q[4 - shape.len()..].copy_from_slice(shape);
    let heads = if q[1].is_multiple_of(2) { q[1] / 2 } else { q[1] };
    let kv = vec![q[0], heads, q[2], q[3]];
    (q, kv)
}

/// Runs `op` after `force` (which sets a test-only kernel choice), checks its outputs against
/// the f64 reference and returns them. On a fresh thread: the choice is read when the call is
/// planned, and plans are cached per thread by signature, so a plan made under another choice
/// would be reused.
#[cfg(test)]
pub(crate) fn run_checked_forcing(
    op: &str,
    inputs: &[Option<TensorRef>],
    attrs: &[(&str, AttrValue)],
    force: impl Fn() + Sync,
) -> Vec<Vec<f64>> {
    use uniop::verify::{check_outputs, infer};
    use uniop::{Registry, Tensor};
    crate::init();
    let entry = Registry::global().get(op).unwrap();
    let mut outs: Vec<Tensor> =
        infer(&entry, inputs, attrs).unwrap().into_iter().map(|m| Tensor::with_meta(m).unwrap()).collect();
    std::thread::scope(|scope| {
        scope.spawn(|| {
            force();
            uniop::call(op, inputs, attrs, outs.iter_mut().map(Tensor::view_mut).collect()).unwrap();
        });
    });
    let views: Vec<TensorRef> = outs.iter().map(Tensor::view).collect();
    let report = check_outputs(&entry, inputs, attrs, &views).unwrap();
    assert!(report.pass(), "{op}:\n{report}");
    views.iter().map(|v| v.to_f64_vec()).collect()
}

#[cfg(test)]
mod tests {
    use super::{run_checked_forcing, KEY_SPLITS_FORCED, PREPACKED_STEP};
    use uniop::half::{bf16, f16};
    use uniop::verify::Rng;
    use uniop::{AttrValue, Element, TensorRef};

    /// Decode (one query, and three: a short chunk) against a cache whose batch rows hold 700 and
    /// 301 keys, with NaN in the never-written slots past them, its keys cut into 1 (as on one
    /// thread), 2, 3 and 5 ranges ([`key_splits`](super::key_splits)) — 5 leaves some ranges of the
    /// shorter row without keys, and 3 gives it one empty range; GQA groups of 3; causal and not;
    /// f32, bf16 and f16. Every result is checked against the f64 reference.
    ///
    /// Then the same with batch row 0 left-padded by 550 keys (a `[B, 1, Sq, Sk]` mask, as
    /// transformers passes in a padded batch's decode steps), the K/V rows of the two key tiles
    /// the padding fills and of the third's first panel ([`PREPACKED_STEP`] keys) holding NaN:
    /// those keys are hidden from every query, so they must be skipped, never read (a product
    /// over them would spread the NaN: 0 · NaN). Decode-sized tiles take K and V in place, not
    /// from packed panels: the skip's other path.
    #[test]
    fn decode_with_keys_cut_into_ranges_matches_reference() {
        let lens = [700i32, 301];
        let kv_shape = [2, 2, 700, 16];
        let mut rng = Rng::new(7);
        let mut values = |n: usize| (0..n).map(|_| bf16::from_f64(2.0 * rng.uniform()).to_f64()).collect::<Vec<_>>();
        let cache = |mut x: Vec<f64>, pad: usize| {
            for (i, v) in x.iter_mut().enumerate() {
                let (b, j) = (i / (2 * 700 * 16), i / 16 % 700);
                if j >= lens[b] as usize || (b == 0 && j < pad / PREPACKED_STEP * PREPACKED_STEP) {
                    *v = f64::NAN;
                }
            }
            x
        };
        for pad in [0, 550] {
            let (k, v) = (cache(values(2 * 2 * 700 * 16), pad), cache(values(2 * 2 * 700 * 16), pad));
            for q_len in [1, 3] {
                let q_shape = [2, 6, q_len, 16];
                let q = values(q_shape.iter().product());
                let keeps: Vec<bool> = (0..2 * q_len * 700).map(|x| x >= q_len * 700 || x % 700 >= pad).collect();
                let mask = (pad > 0).then(|| (&keeps[..], [2, 1, q_len, 700]));
                for causal in [false, true] {
                    let attrs = [("causal", AttrValue::Bool(causal))];
                    for splits in [1, 2, 3, 5] {
                        let force = || KEY_SPLITS_FORCED.with(|f| f.set(Some(splits)));
                        run_case::<f32>([&q, &k, &v], (q_shape, kv_shape), (&lens, mask), &attrs, &force);
                        run_case::<bf16>([&q, &k, &v], (q_shape, kv_shape), (&lens, mask), &attrs, &force);
                        run_case::<f16>([&q, &k, &v], (q_shape, kv_shape), (&lens, mask), &attrs, &force);
                    }
                }
            }
        }
    }

    /// A boolean mask and its shape.
    type Keeps<'a> = (&'a [bool], [usize; 4]);

    fn run_case<T: Element>(
        [q, k, v]: [&[f64]; 3],
        (q_shape, kv_shape): ([usize; 4], [usize; 4]),
        (lens, mask): (&[i32], Option<Keeps<'_>>),
        attrs: &[(&str, AttrValue)],
        force: &(dyn Fn() + Sync),
    ) {
        let narrow = |x: &[f64]| x.iter().map(|&v| T::from_f64(v)).collect::<Vec<T>>();
        let (q, k, v) = (narrow(q), narrow(k), narrow(v));
        let inputs = [
            Some(TensorRef::new(&q, &q_shape).unwrap()),
            Some(TensorRef::new(&k, &kv_shape).unwrap()),
            Some(TensorRef::new(&v, &kv_shape).unwrap()),
            Some(TensorRef::new(lens, &[2]).unwrap()),
            mask.map(|(keeps, shape)| TensorRef::new(keeps, &shape).unwrap()),
        ];
        let outs = run_checked_forcing("attention", &inputs, attrs, force);
        assert!(outs.iter().flatten().all(|x| x.is_finite()), "{:?}: an output is not finite", T::DTYPE);
    }
}
