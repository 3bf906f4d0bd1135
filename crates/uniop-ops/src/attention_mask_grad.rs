//! The gradient of attention's float `mask` (a bias added to the scaled scores): the
//! `attention_backward` step that runs when it is asked for `dmask` (`needs_dmask`).
//!
//! Why a bias needs a gradient: learned position biases are passed this way — T5's relative
//! attention bias, ALiBi with trained slopes, Swin's relative position table all reach the
//! attention as a float `attn_mask` that requires a gradient, and SDPA gives it one.
//!
//! The bias enters the scaled score unscaled, so its gradient is the score gradient itself,
//! `dS = P ∘ (dout·Vᵀ − δ)`, summed over every dimension the mask is broadcast along (a
//! `[B, 1, 1, Sk]` padding bias sums over heads and queries). The flash kernels never hold `dS`
//! whole and their units own keys or queries, not mask elements, so this step recomputes it:
//! each unit owns a tile of the mask's own elements (`MASK_GRAD_ROWS` rows × `TILE_KEYS` keys of
//! its broadcast shape), walks every (batch, head, query, key) that maps into the tile, and sums
//! there — no two units write one element, so the sums need no atomics and are deterministic.
//! With `batch_dims` each sample has its own copy of the mask's elements to sum into, and a unit
//! walks only its sample's batch rows.
//! Two tile products per (query rows, key tile), as the split route's `dQ` launch (S and dP),
//! on the bf16 GEMM for bf16 where the CPU has it, else on operands widened to f32: an extra 40%
//! of the backward's products, paid only when asked.
//!
//! On AVX2 CPUs a mask with an element of its own per score (a learned `[Hq, Sq, Sk]` bias,
//! shared by the batch or one per batch row: T5's) skips this step: the backward's dK/dV launch
//! holds `dS` strip by strip and sums it there ([`MaskGrad::rows_per_dmask_row`],
//! `flash_backward_avx2`), at the cost of one add per score instead of two products.

use crate::attention::{
    bf16_scores, bf16_tile, carve, f32_rows, load_scaled, row_len, scores, BatchStrides, Geometry, TILE_KEYS,
};
use crate::attention_backward::{
    bf16_of, cap_for_grads, narrow_into, on_bf16_gemm, probs_and_dscores_row, row_index, score_scale, BackwardArgs,
    SampleRows,
};
use uniop::{BlockCtx, FloatElement, KernelArgs};

/// Query rows a unit owns (when the mask has its own rows) and multiplies at a time.
const MASK_GRAD_ROWS: usize = 64;

/// The mask's shape as the kernel walks it: its batch rows (the product of its leading dims),
/// then `[Hq, Sq, Sk]`, 1 where the mask is broadcast; once per sample.
#[derive(Clone, Copy, Debug)]
pub(crate) struct MaskGrad {
    /// The mask's batch row of each of the call's flat batch rows (its own leading dims, dense).
    batch_row: BatchStrides,
    batch_rows: usize,
    dims: [usize; 3],
    samples: SampleRows,
}

impl MaskGrad {
    /// The gradient's layout for a mask of `shape` (broadcastable to `[..., Hq, Sq, Sk]` and clear
    /// of the sample dims, checked), summed per sample.
    pub fn of(g: &Geometry, shape: &[usize], samples: SampleRows) -> MaskGrad {
        let lead = shape.len().saturating_sub(3);
        let mut dims = [1; 3];
        dims[3 - (shape.len() - lead)..].copy_from_slice(&shape[lead..]);
        let batch = &shape[..lead];
        let mut dense = vec![1; lead];
        for k in (0..lead.saturating_sub(1)).rev() {
            dense[k] = dense[k + 1] * batch[k + 1];
        }
        let batch_row = BatchStrides::of(&g.batch_dims, batch, &dense);
        MaskGrad { batch_row, batch_rows: batch.iter().product(), dims, samples }
    }

    /// For a mask with an element of its own per (head, query, key) — a learned bias such as T5's,
    /// shared by the batch or one per batch row — how many consecutive batch rows sum into one
    /// of `dmask`'s rows (its flat leading dims, samples first): the batch's (each sample's) rows
    /// for a shared mask, 1 for one per row. `None` for any other broadcast, which this step
    /// sums instead of the launch that computes `dS` (`flash_backward_avx2`). So does an empty
    /// batch, whose `dmask` is zeros that only this step writes.
    pub fn rows_per_dmask_row(&self, g: &Geometry) -> Option<usize> {
        let rows = self.samples.rows;
        if self.dims != [g.q_heads, g.q_len, g.kv_len] || rows == 0 {
            return None;
        }
        if self.batch_rows == 1 {
            return Some(rows);
        }
        let own_rows = self.batch_rows == rows && (0..g.batch).all(|b| self.batch_row.offset(b) == b % rows);
        own_rows.then_some(1)
    }

    fn query_tiles(&self) -> usize {
        self.dims[1].div_ceil(MASK_GRAD_ROWS)
    }

    fn key_tiles(&self) -> usize {
        self.dims[2].div_ceil(TILE_KEYS)
    }

    /// Units of work in one sample: tiles of the mask's elements.
    fn sample_units(&self) -> usize {
        self.batch_rows * self.dims[0] * self.query_tiles() * self.key_tiles()
    }

    /// Units of work: each sample's tiles.
    pub fn units(&self) -> usize {
        self.samples.count * self.sample_units()
    }

    /// Per-block f32 scratch: Q and dout rows, K and V rows widened, S, dP and the sums.
    pub fn scratch(g: &Geometry) -> usize {
        MaskGrad::tiles(g).iter().sum()
    }

    fn tiles(g: &Geometry) -> [usize; 7] {
        let (r, n) = (MASK_GRAD_ROWS, TILE_KEYS);
        [r * g.head_dim, r * g.v_dim, n * g.head_dim, n * g.v_dim, r * n, r * n, r * n]
    }

    /// The positions `0..full` of one dim that mask element `at` of it gathers, given that the
    /// unit's tile of that dim starts at `at`, `tile` long: the tile itself where the mask has
    /// the dim's full size, every position where it is broadcast (size 1).
    fn gathered(mask_size: usize, full: usize, at: usize, tile: usize) -> std::ops::Range<usize> {
        if mask_size == 1 {
            0..full
        } else {
            at..(at + tile).min(full)
        }
    }
}

/// The `dmask` step: one tile of the mask's elements per unit (see the module doc). It reads the
/// δ rows the first step left at the workspace's start; `per_block` is its scratch per block,
/// after them.
pub(crate) fn mask_grad_kernel<T: FloatElement>(
    args: &KernelArgs,
    ctx: BlockCtx,
    g: Geometry,
    m: MaskGrad,
    per_block: usize,
) {
    let a = BackwardArgs::of(args);
    let (d, dv) = (g.head_dim, g.v_dim);
    let n_rows = g.batch * g.q_heads * g.q_len;
    // SAFETY: the δ rows are written by the first step and only read from then on; each block
    // owns its scratch.
    let delta = unsafe { &*(args.workspace::<f32>(0, n_rows) as *const [f32]) };
    let ws = unsafe { args.workspace::<f32>(n_rows + ctx.block_idx as usize * per_block, per_block) };
    let [qt, dot, kt, vt, st, dpt, sums] = carve(ws, MaskGrad::tiles(&g));
    let [mh, mq, mk] = m.dims;
    let bf16_gemm = on_bf16_gemm(&g);
    let scale = score_scale(&g, bf16_gemm);
    let (qs, dos) = (a.q.storage::<T>().expect("dtype dispatched"), a.dout.storage::<T>().expect("dtype dispatched"));
    for u in ctx.split(m.units()) {
        let (sample, u) = (u / m.sample_units(), u % m.sample_units());
        let (bh, tile) = (u / (m.query_tiles() * m.key_tiles()), u % (m.query_tiles() * m.key_tiles()));
        let (i0, j0) = (tile / m.key_tiles() * MASK_GRAD_ROWS, tile % m.key_tiles() * TILE_KEYS);
        let (own_rows, own_keys) = (MASK_GRAD_ROWS.min(mq - i0), TILE_KEYS.min(mk - j0));
        sums[..own_rows * TILE_KEYS].fill(0.0);
        let sample_rows = sample * m.samples.rows..(sample + 1) * m.samples.rows;
        for b in sample_rows.filter(|&b| m.batch_row.offset(b) == bh / mh) {
            let len = row_len(a.lens.as_ref(), b, g.kv_len, "attention_backward");
            for h in MaskGrad::gathered(mh, g.q_heads, bh % mh, 1) {
                let hkv = h / g.group();
                let queries = MaskGrad::gathered(mq, g.q_len, i0, MASK_GRAD_ROWS);
                let keys = MaskGrad::gathered(mk, g.kv_len, j0, TILE_KEYS);
                for q0 in queries.clone().step_by(MASK_GRAD_ROWS) {
                    let rows = MASK_GRAD_ROWS.min(queries.end - q0);
                    // The last row sees the most keys (causal prefixes grow with the position).
                    let key_end = keys.end.min(g.visible(len, q0 + rows - 1));
                    if key_end <= keys.start {
                        continue;
                    }
                    for r in 0..rows {
                        let (qa, da) = (a.q_rows.at(b, h, q0 + r), a.dout_rows.at(b, h, q0 + r));
                        if bf16_gemm {
                            // As they are, for the bf16 GEMM (the scale goes on the scores).
                            bf16_tile(qt)[r * d..(r + 1) * d].copy_from_slice(&bf16_of(&a.q)[qa..qa + d]);
                            bf16_tile(dot)[r * dv..(r + 1) * dv].copy_from_slice(&bf16_of(&a.dout)[da..da + dv]);
                            continue;
                        }
                        load_scaled(qs, qa, &mut qt[r * d..(r + 1) * d], g.scale);
                        load_scaled(dos, da, &mut dot[r * dv..(r + 1) * dv], 1.0);
                    }
                    for k0 in (keys.start..key_end).step_by(TILE_KEYS) {
                        let n = TILE_KEYS.min(key_end - k0);
                        // Keys before the first one a mask lets these rows see are not read (they
                        // may hold anything, as in the other launches).
                        let queries = (q0..q0 + rows).map(|i| (h, i));
                        let lead = a.mask.as_ref().map_or(0, |mask| mask.lead(&g, (b, len), queries, (k0, n)));
                        if lead == n {
                            continue;
                        }
                        let (ka, va) = (a.k_rows.at(b, hkv, k0 + lead), a.v_rows.at(b, hkv, k0 + lead));
                        // SAFETY: K/V rows k0+lead..k0+n of this head lie inside the checked views.
                        unsafe {
                            if bf16_gemm {
                                let (kb, vb) = (bf16_of(&a.k)[ka..].as_ptr(), bf16_of(&a.v)[va..].as_ptr());
                                bf16_scores(
                                    &mut st[lead..],
                                    bf16_tile(qt),
                                    d,
                                    rows,
                                    (kb, a.k_rows.seq_stride()),
                                    n - lead,
                                );
                                bf16_scores(
                                    &mut dpt[lead..],
                                    bf16_tile(dot),
                                    dv,
                                    rows,
                                    (vb, a.v_rows.seq_stride()),
                                    n - lead,
                                );
                            } else {
                                let kp = f32_rows::<T>(&a.k, a.k_rows, (b, hkv, k0 + lead), n - lead, d, kt);
                                let vp = f32_rows::<T>(&a.v, a.v_rows, (b, hkv, k0 + lead), n - lead, dv, vt);
                                scores(&mut st[lead..], TILE_KEYS, qt, d, rows, kp, n - lead);
                                scores(&mut dpt[lead..], TILE_KEYS, dot, dv, rows, vp, n - lead);
                            }
                        }
                        for r in 0..rows {
                            let i = q0 + r;
                            let at = row_index(&g, b, h, i);
                            let visible = g.visible(len, i).saturating_sub(k0 + lead);
                            let (s, dp) = (&mut st[r * TILE_KEYS..][lead..n], &mut dpt[r * TILE_KEYS..][lead..n]);
                            cap_for_grads(&g, (s, None), visible, scale, delta[at]);
                            let visible = a.live_keys(s, (b, h, i), k0 + lead, visible, a.lse[at], scale);
                            probs_and_dscores_row::<T>(s, dp, None, visible, scale, a.lse[at], delta[at]);
                            // dp now holds dS; sum it into the mask element each score maps to.
                            let own_row = if mq == 1 { 0 } else { i - i0 };
                            let sum_row = &mut sums[own_row * TILE_KEYS..][..own_keys];
                            if mk == 1 {
                                sum_row[0] += dp.iter().sum::<f32>();
                            } else {
                                let from = k0 + lead - j0;
                                sum_row[from..from + dp.len()].iter_mut().zip(dp.iter()).for_each(|(s, x)| *s += x);
                            }
                        }
                    }
                }
            }
        }
        let dmask = args.output(3);
        let base = (((sample * m.batch_rows * mh + bh) * mq + i0) * mk + j0) + dmask.layout().offset();
        for r in 0..own_rows {
            let row = &sums[r * TILE_KEYS..][..own_keys];
            // SAFETY: this unit alone owns mask elements (sample, bh, i0.., j0..) of dmask.
            unsafe { narrow_into(&dmask, base + r * mk, row) };
        }
    }
}
