//! attention / attention_backward semantics the generic registry tests cannot know: tiling
//! across many tiles, GQA as repeated kv heads, the bottom-right causal alignment, decode with
//! per-sequence cache lengths, boolean masks (padded batches, broadcast and strided masks), HF's
//! transposed layout read in place, soft-capping and sinks, gradients against finite differences,
//! and the bad-input contract.

mod common;

use common::*;
use uniop::{AttrValue, DType, ErrorCode, Tensor, TensorRef};

fn causal(on: bool) -> [(&'static str, AttrValue); 1] {
    [("causal", AttrValue::Bool(on))]
}

fn view<'a>(data: &'a [f32], shape: &[usize]) -> Option<TensorRef<'a>> {
    Some(TensorRef::new(data, shape).unwrap())
}

fn bf16(x: &[f32], shape: &[usize]) -> Tensor {
    let values: Vec<_> = x.iter().map(|&v| uniop::half::bf16::from_f32(v)).collect();
    Tensor::from_slice(&values, shape).unwrap()
}

fn assert_near(got: &[f64], want: &[f64], tol: f64, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!((g - w).abs() <= tol * (1.0 + w.abs()), "{what}[{i}]: got {g}, want {w}");
    }
}

/// Many query and key tiles (300 > 256 keys per tile, > 64 query rows per GQA tile): the online
/// softmax's rescaling across tiles is checked against the f64 reference, masked and not, in
/// f32 and bf16.
#[test]
fn attention_spans_many_tiles_and_matches_reference() {
    setup();
    let (q_shape, kv_shape) = ([1, 4, 300, 32], [1, 2, 300, 32]);
    let q = rand_vec(4 * 300 * 32, 1);
    let k = rand_vec(2 * 300 * 32, 2);
    let v: Vec<f32> = rand_vec(2 * 300 * 32, 3).iter().map(|x| 4.0 * x).collect();
    for c in [false, true] {
        run_checked("attention", &[view(&q, &q_shape), view(&k, &kv_shape), view(&v, &kv_shape), None], &causal(c));
    }
    let (qb, kb, vb) = (bf16(&q, &q_shape), bf16(&k, &kv_shape), bf16(&v, &kv_shape));
    run_checked("attention", &[Some(qb.view()), Some(kb.view()), Some(vb.view()), None], &causal(true));
}

/// One head of 2048 queries and keys in bf16: 16 query tiles, two to a forward block (8 blocks on
/// two threads), so a block's second tile multiplies the whole K and V tiles its first one packed;
/// causal (the last tile a query tile sees is partial: the leading part of its packed tile, in
/// diagonal pieces) and not.
#[test]
fn bf16_attention_reusing_packed_kv_tiles_matches_reference() {
    setup();
    let shape = [1, 1, 2048, 32];
    let n = 2048 * 32;
    let (q, k, v) = (bf16(&rand_vec(n, 21), &shape), bf16(&rand_vec(n, 22), &shape), bf16(&rand_vec(n, 23), &shape));
    for c in [true, false] {
        run_checked("attention", &[Some(q.view()), Some(k.view()), Some(v.view()), None], &causal(c));
    }
}

/// bf16 keeps a row's running max lazily (a key tile's exps are taken against the max of the tiles
/// before it unless the tile rises more than 8 above it). Here the key tiles' scores grow tile by
/// tile — the second tile's keys 3x the first's (rises of a few, taken against the old max: exps
/// above 1), the third's 300x (rises far past e^88, which only a new max survives) — with a ragged
/// last tile (600 keys), rows whose visible keys end mid-tile, and a negative scale (where the
/// largest scaled score comes from the smallest raw one), against the f64 reference.
#[test]
fn bf16_attention_with_scores_rising_from_tile_to_tile_matches_reference() {
    setup();
    let (q_shape, kv_shape) = ([1, 2, 600, 32], [1, 1, 600, 32]);
    let q = rand_vec(2 * 600 * 32, 41);
    let k: Vec<f32> =
        rand_vec(600 * 32, 42).iter().enumerate().map(|(i, x)| x * [1.0, 3.0, 300.0][i / 32 / 256]).collect();
    let v = rand_vec(600 * 32, 43);
    let (qb, kb, vb) = (bf16(&q, &q_shape), bf16(&k, &kv_shape), bf16(&v, &kv_shape));
    for (c, scale) in [(true, 0.2), (false, 0.2), (true, -0.2)] {
        let attrs = [("causal", AttrValue::Bool(c)), ("scale", AttrValue::from(scale))];
        run_checked("attention", &[Some(qb.view()), Some(kb.view()), Some(vb.view()), None], &attrs);
    }
}

/// A GQA group of 3 (its query tiles are rounded down to 32 positions, so tiles and their causal
/// key counts end at multiples of 16, except the last), rows whose visible keys end mid-step, a
/// negative scale, in f32 and bf16, causal and not. Scores reach about ±200 so that the scaled
/// ones reach ±60: the softmax must shift by the max of the *scaled* scores (a shift by the raw
/// max, harmless for small scores, underflows every exp here).
#[test]
fn attention_with_groups_of_three_and_a_negative_scale_matches_reference() {
    setup();
    let (q_shape, kv_shape) = ([1, 6, 203, 24], [1, 2, 203, 24]);
    let q: Vec<f32> = rand_vec(6 * 203 * 24, 11).iter().map(|x| 40.0 * x).collect();
    let k = rand_vec(2 * 203 * 24, 12);
    let v = rand_vec(2 * 203 * 24, 13);
    for (c, scale) in [(true, -0.3), (false, -0.3), (true, 0.7)] {
        let attrs = [("causal", AttrValue::Bool(c)), ("scale", AttrValue::from(scale))];
        run_checked("attention", &[view(&q, &q_shape), view(&k, &kv_shape), view(&v, &kv_shape), None], &attrs);
        let (qb, kb, vb) = (bf16(&q, &q_shape), bf16(&k, &kv_shape), bf16(&v, &kv_shape));
        run_checked("attention", &[Some(qb.view()), Some(kb.view()), Some(vb.view()), None], &attrs);
    }
}

/// Decode (one query per sequence): every q head of a GQA group is one row of the unit's tile,
/// so 6 or 8 q heads over 2 kv heads make 3 or 4 rows — the few-row path (dot-product scores,
/// V rows added into each query row). Keys span several key tiles and stop at per-sequence
/// `kv_lens`; K/V are views of a longer cache (HF's growing cache), the head dim is not a
/// multiple of the 64-lane steps; f32, f16 and bf16 against the f64 reference.
#[test]
fn decode_with_gqa_groups_matches_reference_in_every_dtype() {
    setup();
    fn case<T: uniop::FloatElement>(q_heads: usize) {
        let (batch, kv_heads, capacity, len, d) = (2, 2, 700, 600, 80);
        let typed = |x: Vec<f32>| x.into_iter().map(T::from_f32).collect::<Vec<T>>();
        let q = typed(rand_vec(batch * q_heads * d, 71));
        let k = typed(rand_vec(batch * kv_heads * capacity * d, 72));
        let v = typed(rand_vec(batch * kv_heads * capacity * d, 73));
        let cache_strides = [kv_heads * capacity * d, capacity * d, d, 1];
        let kv_shape = [batch, kv_heads, len, d];
        let kv_lens = Tensor::from_slice(&[len as i64, 333], &[batch]).unwrap();
        run_checked(
            "attention",
            &[
                Some(TensorRef::new(&q, &[batch, q_heads, 1, d]).unwrap()),
                Some(TensorRef::strided(&k, &kv_shape, &cache_strides, 0).unwrap()),
                Some(TensorRef::strided(&v, &kv_shape, &cache_strides, 0).unwrap()),
                Some(kv_lens.view()),
            ],
            &causal(true),
        );
    }
    for q_heads in [6, 8] {
        case::<f32>(q_heads);
        case::<uniop::half::f16>(q_heads);
        case::<uniop::half::bf16>(q_heads);
    }
}

#[test]
fn grouped_query_attention_equals_repeated_kv_heads() {
    setup();
    let (s, d) = (20, 8);
    let q = rand_vec(4 * s * d, 11);
    let k = rand_vec(2 * s * d, 12);
    let v = rand_vec(2 * s * d, 13);
    // kv head h serves q heads 2h and 2h+1: repeat each head twice for the MHA version.
    let repeat = |x: &[f32]| x.chunks(s * d).flat_map(|h| h.iter().chain(h).copied()).collect::<Vec<f32>>();
    let (k4, v4) = (repeat(&k), repeat(&v));
    let gqa = run_checked(
        "attention",
        &[view(&q, &[1, 4, s, d]), view(&k, &[1, 2, s, d]), view(&v, &[1, 2, s, d]), None],
        &causal(true),
    );
    let mha = run_checked(
        "attention",
        &[view(&q, &[1, 4, s, d]), view(&k4, &[1, 4, s, d]), view(&v4, &[1, 4, s, d]), None],
        &causal(true),
    );
    assert_near(&gqa[0], &mha[0], 1e-6, "out");
}

/// With `Sq == Sk`, query 0 sees only key 0 (torch's `is_causal`); a decode step (one query
/// against a cache with per-row lengths) equals attention over the cache truncated to each
/// length; a chunk of queries appended after a prefix sees everything up to its own position.
#[test]
fn causal_mask_is_bottom_right_and_decode_reads_kv_lens() {
    setup();
    let d = 8;
    let (q, k, v) = (rand_vec(4 * d, 21), rand_vec(2 * 10 * d, 22), rand_vec(2 * 10 * d, 23));
    let out = run_checked(
        "attention",
        &[view(&q, &[1, 1, 4, d]), view(&k[..4 * d], &[1, 1, 4, d]), view(&v[..4 * d], &[1, 1, 4, d]), None],
        &causal(true),
    );
    assert_near(&out[0][..d], &v[..d].iter().map(|&x| x as f64).collect::<Vec<_>>(), 1e-6, "query 0 = v[0]");

    // Decode: 2 sequences, 2 q heads sharing 1 kv head, cache of 10 with lengths 3 and 7.
    let lens = [3i64, 7];
    let decode = run_checked(
        "attention",
        &[
            view(&q, &[2, 2, 1, d]),
            view(&k, &[2, 1, 10, d]),
            view(&v, &[2, 1, 10, d]),
            Some(TensorRef::new(&lens, &[2]).unwrap()),
        ],
        &causal(true),
    );
    for (b, &len) in lens.iter().enumerate() {
        let len = len as usize;
        let cache = |x: &[f32]| x[b * 10 * d..(b * 10 + len) * d].to_vec();
        let (kb, vb) = (cache(&k), cache(&v));
        let alone = run_checked(
            "attention",
            &[
                view(&q[b * 2 * d..(b + 1) * 2 * d], &[1, 2, 1, d]),
                view(&kb, &[1, 1, len, d]),
                view(&vb, &[1, 1, len, d]),
                None,
            ],
            &causal(false),
        );
        assert_near(&decode[0][b * 2 * d..(b + 1) * 2 * d], &alone[0], 1e-6, "decode row");
    }

    // Chunked prefill: 3 new queries after 4 cached keys; query i sees keys 0..=4+i.
    let chunk = run_checked(
        "attention",
        &[view(&q[..3 * d], &[1, 1, 3, d]), view(&k[..7 * d], &[1, 1, 7, d]), view(&v[..7 * d], &[1, 1, 7, d]), None],
        &causal(true),
    );
    for i in 0..3 {
        let seen = 5 + i;
        let one = run_checked(
            "attention",
            &[
                view(&q[i * d..(i + 1) * d], &[1, 1, 1, d]),
                view(&k[..seen * d], &[1, 1, seen, d]),
                view(&v[..seen * d], &[1, 1, seen, d]),
                None,
            ],
            &causal(false),
        );
        assert_near(&chunk[0][i * d..(i + 1) * d], &one[0], 1e-6, "chunk row");
    }
}

/// HF keeps q/k/v as `[B, S, H, D]` and transposes to `[B, H, S, D]`: a strided view, read in place.
#[test]
fn transposed_bshd_views_match_contiguous() {
    setup();
    let (b, s, h, d) = (2, 9, 2, 8);
    let bshd = rand_vec(b * s * h * d, 31);
    let strides = [s * h * d, d, h * d, 1];
    let t = || Some(TensorRef::strided(&bshd, &[b, h, s, d], &strides, 0).unwrap());
    let got = run_checked("attention", &[t(), t(), t(), None], &causal(true));
    let mut dense = vec![0f32; bshd.len()];
    for (bi, si, hi, di) in (0..b)
        .flat_map(|bi| (0..s).flat_map(move |si| (0..h).flat_map(move |hi| (0..d).map(move |di| (bi, si, hi, di)))))
    {
        dense[((bi * h + hi) * s + si) * d + di] = bshd[((bi * s + si) * h + hi) * d + di];
    }
    let want = run_checked(
        "attention",
        &[view(&dense, &[b, h, s, d]), view(&dense, &[b, h, s, d]), view(&dense, &[b, h, s, d]), None],
        &causal(true),
    );
    assert_eq!(got[0], want[0]);
}

/// Hugging Face's mask for a left-padded batch, `[B, 1, Sq, Sk]` (broadcast over the heads): batch
/// row `b`'s first `pad[b]` keys are padding, hidden from every query; with `causal_in_mask` the
/// causal mask (bottom-right, as `causal`) is part of it too.
fn left_padding_mask(pad: &[usize], q_len: usize, kv_len: usize, causal_in_mask: bool) -> Vec<bool> {
    let keep = |p: usize, i: usize, j: usize| j >= p && (!causal_in_mask || j <= i + kv_len - q_len);
    pad.iter().flat_map(|&p| (0..q_len).flat_map(move |i| (0..kv_len).map(move |j| keep(p, i, j)))).collect()
}

/// Boolean masks against the f64 reference: a left-padded batch over two key tiles (the causal
/// mask inside the boolean one, and given as `causal` beside it) in f32, bf16 and f16, whose
/// padding queries see no key (output 0, lse −∞); a decode step of the padded batch over 1100
/// keys (cut into key ranges on two or more threads); a random mask of the full shape with a
/// negative scale; a `[Sq, Sk]` mask broadcast over batch and heads; a strided (transposed) mask.
#[test]
fn masked_attention_matches_reference() {
    setup();
    let (q_shape, kv_shape) = ([2, 4, 300, 16], [2, 2, 300, 16]);
    let (q, k, v) = (rand_vec(2 * 4 * 300 * 16, 61), rand_vec(2 * 2 * 300 * 16, 62), rand_vec(2 * 2 * 300 * 16, 63));
    let pad = [0, 37];
    for (causal_in_mask, attrs) in [(true, causal(false)), (false, causal(true))] {
        let mask = left_padding_mask(&pad, 300, 300, causal_in_mask);
        let mask = Some(TensorRef::new(&mask, &[2, 1, 300, 300]).unwrap());
        let outs = run_checked(
            "attention",
            &[view(&q, &q_shape), view(&k, &kv_shape), view(&v, &kv_shape), None, mask.clone()],
            &attrs,
        );
        // Batch row 1's first 37 queries are padding: out 0, lse −∞ in every head.
        for h in 0..4 {
            let rows = (4 + h) * 300..(4 + h) * 300 + 37;
            assert!(rows.clone().all(|r| outs[1][r] == f64::NEG_INFINITY), "padding queries' lse");
            assert!(outs[0][rows.start * 16..rows.end * 16].iter().all(|&o| o == 0.0), "padding queries' out");
        }
        let (qb, kb, vb) = (bf16(&q, &q_shape), bf16(&k, &kv_shape), bf16(&v, &kv_shape));
        run_checked("attention", &[Some(qb.view()), Some(kb.view()), Some(vb.view()), None, mask.clone()], &attrs);
        let half = |x: &[f32], shape: &[usize]| {
            Tensor::from_slice(&x.iter().map(|&v| uniop::half::f16::from_f32(v)).collect::<Vec<_>>(), shape).unwrap()
        };
        let (qh, kh, vh) = (half(&q, &q_shape), half(&k, &kv_shape), half(&v, &kv_shape));
        run_checked("attention", &[Some(qh.view()), Some(kh.view()), Some(vh.view()), None, mask], &attrs);
    }

    let (dq_shape, dkv_shape) = ([2, 4, 1, 16], [2, 2, 1100, 16]);
    let (dk, dv) = (rand_vec(2 * 2 * 1100 * 16, 64), rand_vec(2 * 2 * 1100 * 16, 65));
    let mask = left_padding_mask(&[250, 0], 1, 1100, true);
    let mask = Some(TensorRef::new(&mask, &[2, 1, 1, 1100]).unwrap());
    let decode = [view(&q[..2 * 4 * 16], &dq_shape), view(&dk, &dkv_shape), view(&dv, &dkv_shape), None, mask];
    run_checked("attention", &decode, &causal(false));
    let (qb, kb, vb) = (bf16(&q[..2 * 4 * 16], &dq_shape), bf16(&dk, &dkv_shape), bf16(&dv, &dkv_shape));
    run_checked("attention", &[Some(qb.view()), Some(kb.view()), Some(vb.view()), None, decode[4].clone()], &[]);

    let random: Vec<bool> = rand_vec(2 * 4 * 300 * 300, 66).iter().map(|&x| x > 0.3).collect();
    let full = Some(TensorRef::new(&random, &[2, 4, 300, 300]).unwrap());
    let inputs = [view(&q, &q_shape), view(&k, &kv_shape), view(&v, &kv_shape), None, full];
    run_checked("attention", &inputs, &[("scale", AttrValue::Float(-0.3))]);
    let square = Some(TensorRef::new(&random[..300 * 300], &[300, 300]).unwrap());
    run_checked("attention", &[inputs[0].clone(), inputs[1].clone(), inputs[2].clone(), None, square], &causal(true));
    // The same [Sq, Sk] mask read through a transposed view of its [Sk, Sq] transpose.
    let transposed: Vec<bool> = (0..300 * 300).map(|x| random[(x % 300) * 300 + x / 300]).collect();
    let strided = Some(TensorRef::strided(&transposed, &[300, 300], &[1, 300], 0).unwrap());
    let got = run_checked("attention", &[inputs[0].clone(), inputs[1].clone(), inputs[2].clone(), None, strided], &[]);
    let square = Some(TensorRef::new(&random[..300 * 300], &[300, 300]).unwrap());
    let want = run_checked("attention", &[inputs[0].clone(), inputs[1].clone(), inputs[2].clone(), None, square], &[]);
    assert_eq!(got, want, "a strided mask reads the same elements");
}

/// Float masks are added to the scaled scores (SDPA's float `attn_mask`; −∞ hides a key): one of
/// only 0 and −∞ gives the boolean mask's results bit for bit (f32 and bf16 masks, the padded
/// batch over two key tiles), and so does one of 0 and the dtype's lowest value (f32, bf16, f16
/// masks; the backward too); an ALiBi-like bias (`−slope_h · (i − j)`, per head, with some keys at
/// −∞) against the f64 reference in f32, bf16 (with a bf16 mask) and with a negative scale; its
/// gradients against central finite differences of the f64 forward.
#[test]
fn float_masks_add_to_the_scaled_scores() {
    setup();
    let (q_shape, kv_shape) = ([2, 4, 300, 16], [2, 2, 300, 16]);
    let (q, k, v) = (rand_vec(2 * 4 * 300 * 16, 91), rand_vec(2 * 2 * 300 * 16, 92), rand_vec(2 * 2 * 300 * 16, 93));
    let keeps = left_padding_mask(&[0, 37], 300, 300, false);
    let bias: Vec<f32> = keeps.iter().map(|&keep| if keep { 0.0 } else { f32::NEG_INFINITY }).collect();
    let bias_bf16 = bf16(&bias, &[2, 1, 300, 300]);
    let qkv = [view(&q, &q_shape), view(&k, &kv_shape), view(&v, &kv_shape), None];
    let with = |mask: Option<TensorRef>| {
        let inputs = [qkv[0].clone(), qkv[1].clone(), qkv[2].clone(), None, mask];
        run_checked("attention", &inputs, &causal(true))
    };
    let want = with(Some(TensorRef::new(&keeps, &[2, 1, 300, 300]).unwrap()));
    assert_eq!(with(view(&bias, &[2, 1, 300, 300])), want, "a 0/−∞ f32 mask is the boolean mask");
    assert_eq!(with(Some(bias_bf16.view())), want, "a 0/−∞ bf16 mask is the boolean mask");
    // transformers 4.x's kind, the dtype's lowest value where hidden, hides as −∞ does: the padding
    // queries get out 0 and lse −∞ (as a number, the bias would weigh their keys), every route
    // skips the tiles it hides, and the backward (dmask too) agrees with the boolean mask's.
    let lowest: Vec<f32> = keeps.iter().map(|&keep| if keep { 0.0 } else { f32::MIN }).collect();
    fn padding_of<T: uniop::Element>(keeps: &[bool], (seen, hidden): (T, T)) -> Tensor {
        let values: Vec<T> = keeps.iter().map(|&keep| if keep { seen } else { hidden }).collect();
        Tensor::from_slice(&values, &[2, 1, 300, 300]).unwrap()
    }
    let (bf16_min, f16_min) =
        ((uniop::half::bf16::ZERO, uniop::half::bf16::MIN), (uniop::half::f16::ZERO, uniop::half::f16::MIN));
    let (lowest_bf16, lowest_f16) = (padding_of(&keeps, bf16_min), padding_of(&keeps, f16_min));
    assert_eq!(with(view(&lowest, &[2, 1, 300, 300])), want, "an f32 mask of 0 and f32::MIN is the boolean mask");
    assert_eq!(with(Some(lowest_bf16.view())), want, "a bf16 mask of 0 and its lowest is the boolean mask");
    assert_eq!(with(Some(lowest_f16.view())), want, "an f16 mask of 0 and its lowest is the boolean mask");
    let dout = rand_vec(2 * 4 * 300 * 16, 96);
    let grads = |mask| backward_after_forward((&q, &k, &v, &dout), (q_shape, kv_shape), (None, mask), &causal(true));
    let by_keeps = grads(Some(TensorRef::new(&keeps, &[2, 1, 300, 300]).unwrap()));
    let by_lowest = grads(view(&lowest, &[2, 1, 300, 300]));
    assert_eq!(by_lowest[..3], by_keeps[..3], "dq, dk, dv through an f32::MIN mask");
    assert!(by_lowest[3].iter().zip(&keeps).all(|(&g, &keep)| keep || g == 0.0), "dmask where hidden");

    let (sq, sk) = (300, 300);
    let alibi: Vec<f32> = (0..4 * sq * sk)
        .map(|x| {
            let (h, i, j) = (x / (sq * sk), x / sk % sq, x % sk);
            if (i + j) % 7 == 3 && i != j {
                f32::NEG_INFINITY
            } else {
                -(0.5f32).powi(h as i32 + 1) * (i as f32 - j as f32).abs()
            }
        })
        .collect();
    let alibi_view = || view(&alibi, &[1, 4, sq, sk]);
    run_checked("attention", &[qkv[0].clone(), qkv[1].clone(), qkv[2].clone(), None, alibi_view()], &[]);
    let scale = [("scale", AttrValue::Float(-0.3))];
    run_checked("attention", &[qkv[0].clone(), qkv[1].clone(), qkv[2].clone(), None, alibi_view()], &scale);
    let (qb, kb, vb, ab) =
        (bf16(&q, &q_shape), bf16(&k, &kv_shape), bf16(&v, &kv_shape), bf16(&alibi, &[1, 4, sq, sk]));
    run_checked(
        "attention",
        &[Some(qb.view()), Some(kb.view()), Some(vb.view()), None, Some(ab.view())],
        &causal(true),
    );
    let dout = rand_vec(2 * 4 * 300 * 16, 94);
    backward_after_forward((&q, &k, &v, &dout), (q_shape, kv_shape), (None, alibi_view()), &causal(true));

    // A finite bias on every key but two, which it hides.
    let bias: Vec<f32> = (0..2 * 3 * 5)
        .map(|x| if x == 4 || x == 22 { f32::NEG_INFINITY } else { 0.3 * (x % 4) as f32 - 0.5 })
        .collect();
    let values = bias.iter().map(|&b| b as f64).collect();
    small_masked_gradients_match_finite_differences(TensorRef::new(&bias, &[1, 2, 3, 5]).unwrap(), values, 95);
}

/// Gradients through a mask: a left-padded batch over two key tiles (padding queries get zero
/// gradients), and against central finite differences of the f64 forward with a mask that hides
/// a query's every key.
#[test]
fn masked_attention_backward_matches_reference_and_finite_differences() {
    setup();
    let (q_shape, kv_shape) = ([2, 4, 300, 16], [2, 2, 300, 16]);
    let (q, k, v) = (rand_vec(2 * 4 * 300 * 16, 71), rand_vec(2 * 2 * 300 * 16, 72), rand_vec(2 * 2 * 300 * 16, 73));
    let dout = rand_vec(2 * 4 * 300 * 16, 74);
    let mask = left_padding_mask(&[0, 37], 300, 300, true);
    let mask = Some(TensorRef::new(&mask, &[2, 1, 300, 300]).unwrap());
    let grads = backward_after_forward((&q, &k, &v, &dout), (q_shape, kv_shape), (None, mask), &[]);
    assert!(grads[0][(4 * 300) * 16..(4 * 300 + 37) * 16].iter().all(|&g| g == 0.0), "padding queries' dq");

    // Query 0 of head 1 sees no key; the others lose one or two.
    let mask: Vec<bool> = (0..2 * 3 * 5).map(|x| x != 7 && x != 11 && !(15..20).contains(&x)).collect();
    let values = mask.iter().map(|&m| m as u8 as f64).collect();
    small_masked_gradients_match_finite_differences(TensorRef::new(&mask, &[1, 2, 3, 5]).unwrap(), values, 81);
}

/// A float mask's gradient (`needs_dmask`) against the f64 reference, summed over the dims the
/// mask is broadcast along: a full `[B, Hq, Sq, Sk]` bias with hidden keys (two key tiles, five
/// 64-row query tiles), one shared by the batch (`[Hq, Sq, Sk]`), a per-key padding bias
/// `[B, 1, 1, Sk]` (summed over heads and queries), a per-query one `[Sq, 1]` (summed over keys:
/// zero, as a softmax is blind to it) — causal and not, with cache lengths, GQA; bf16 with a
/// bf16 mask, f16 with an f32 one.
#[test]
fn float_mask_gradients_sum_over_broadcast_dims() {
    setup();
    let (q_shape, kv_shape) = ([2, 4, 300, 16], [2, 2, 300, 16]);
    let (q, k, v) = (rand_vec(2 * 4 * 300 * 16, 301), rand_vec(2 * 2 * 300 * 16, 302), rand_vec(2 * 2 * 300 * 16, 303));
    let dout = rand_vec(2 * 4 * 300 * 16, 304);
    let bias = |shape: &[usize], seed: u64| -> Vec<f32> {
        let values = rand_vec(shape.iter().product(), seed);
        values.iter().enumerate().map(|(x, &r)| if x % 11 == 5 { f32::NEG_INFINITY } else { 2.0 * r }).collect()
    };
    let lens = [300i64, 251];
    let shapes: [&[usize]; 4] = [&[2, 4, 300, 300], &[4, 300, 300], &[2, 1, 1, 300], &[300, 1]];
    for (n, shape) in shapes.into_iter().enumerate() {
        let mask = bias(shape, 310 + n as u64);
        for (c, lens) in [(true, None), (false, Some(TensorRef::new(&lens, &[2]).unwrap()))] {
            let grads = backward_after_forward(
                (&q, &k, &v, &dout),
                (q_shape, kv_shape),
                (lens, Some(TensorRef::new(&mask, shape).unwrap())),
                &causal(c),
            );
            assert_eq!(grads[3].len(), mask.len(), "dmask has the mask's shape {shape:?}");
            assert!(grads[3].iter().any(|&g| g != 0.0) || *shape == [300, 1], "dmask {shape:?} is not all zero");
        }
    }
    let half = |x: &[f32], shape: &[usize]| {
        Tensor::from_slice(&x.iter().map(|&v| uniop::half::f16::from_f32(v)).collect::<Vec<_>>(), shape).unwrap()
    };
    let full = bias(&[2, 4, 300, 300], 320);
    let cases = [
        (bf16 as fn(&[f32], &[usize]) -> Tensor, bf16(&full, &[2, 4, 300, 300])),
        (half, Tensor::from_slice(&full, &[2, 4, 300, 300]).unwrap()),
    ];
    for (typed, mask) in cases {
        let (q, k, v, dout) = (typed(&q, &q_shape), typed(&k, &kv_shape), typed(&v, &kv_shape), typed(&dout, &q_shape));
        let grads =
            typed_backward_after_forward([&q, &k, &v, &dout], (None, Some(mask.view()), None), typed, &causal(true));
        assert_eq!(grads[3].len(), full.len());
    }
}

/// GQA with q `[1, 2, 3, 4]` and k/v `[1, 1, 5, 4]` (inputs from `seed` on) under a `[1, 2, 3, 5]`
/// `mask` (`values`: its elements as f64): the gradients against central finite differences of
/// the f64 forward.
fn small_masked_gradients_match_finite_differences(mask: TensorRef<'_>, values: Vec<f64>, seed: u64) {
    small_masked_gradients_match_finite_differences_with(mask, values, seed, &[]);
}

/// [`small_masked_gradients_match_finite_differences`] under `attrs`.
fn small_masked_gradients_match_finite_differences_with(
    mask: TensorRef<'_>,
    values: Vec<f64>,
    seed: u64,
    attrs: &[(&str, AttrValue)],
) {
    let (q_shape, kv_shape) = ([1, 2, 3, 4], [1, 1, 5, 4]);
    let (q, k, v) = (rand_vec(24, seed), rand_vec(20, seed + 1), rand_vec(20, seed + 2));
    let dout = rand_vec(24, seed + 3);
    let dtype = mask.dtype();
    let grads = backward_after_forward((&q, &k, &v, &dout), (q_shape, kv_shape), (None, Some(mask)), attrs);
    let f64s = |x: &[f32]| x.iter().map(|&v| v as f64).collect::<Vec<_>>();
    let inputs = [
        (f64s(&q), q_shape.to_vec()),
        (f64s(&k), kv_shape.to_vec()),
        (f64s(&v), kv_shape.to_vec()),
        (vec![5.0], vec![1]), // kv_lens: every key
        (values, vec![1, 2, 3, 5]),
    ];
    let dtypes = [DType::F32, DType::F32, DType::F32, DType::I64, dtype];
    // A float mask's own gradient too (a boolean one has none).
    let wrts = if dtype.is_float() { [0, 1, 2, 4].as_slice() } else { &[0, 1, 2] };
    for &wrt in wrts {
        let fd = finite_difference_typed("attention", &inputs, &dtypes, attrs, &f64s(&dout), wrt);
        let (got, name) = if wrt == 4 { (&grads[3], "dmask") } else { (&grads[wrt], ["dq", "dk", "dv"][wrt]) };
        assert_near(got, &fd, 1e-4, name);
    }
}

/// Runs `attention`, then `attention_backward` on the forward's own `out` and `lse` (both
/// checked against their references, with a float mask's gradient asked for); returns
/// `[dq, dk, dv, dmask]`.
fn backward_after_forward(
    (q, k, v, dout): (&[f32], &[f32], &[f32], &[f32]),
    (q_shape, kv_shape): ([usize; 4], [usize; 4]),
    (lens, mask): (Option<TensorRef>, Option<TensorRef>),
    attrs: &[(&str, AttrValue)],
) -> Vec<Vec<f64>> {
    let f32s = |x: &[f32], shape: &[usize]| Tensor::from_slice(x, shape).unwrap();
    let (q, k, v, dout) = (f32s(q, &q_shape), f32s(k, &kv_shape), f32s(v, &kv_shape), f32s(dout, &q_shape));
    typed_backward_after_forward([&q, &k, &v, &dout], (lens, mask, None), f32s, attrs)
}

/// [`backward_after_forward`] for q, k, v and dout of any one dtype, which `typed` makes from
/// f32 values (the forward's out is passed back in it), with `sinks` when given (then the result
/// ends with `dsinks`).
fn typed_backward_after_forward(
    [q, k, v, dout]: [&Tensor; 4],
    (lens, mask, sinks): (Option<TensorRef>, Option<TensorRef>, Option<TensorRef>),
    typed: impl Fn(&[f32], &[usize]) -> Tensor,
    attrs: &[(&str, AttrValue)],
) -> Vec<Vec<f64>> {
    let inputs = [Some(q.view()), Some(k.view()), Some(v.view()), lens.clone(), mask.clone(), sinks.clone()];
    let fwd = run_checked("attention", &inputs, attrs);
    let q_shape = q.view().shape().to_vec();
    let out = typed(&fwd[0].iter().map(|&x| x as f32).collect::<Vec<_>>(), &q_shape);
    let lse: Vec<f32> = fwd[1].iter().map(|&x| x as f32).collect();
    // A float mask's gradient is asked for (and checked against the reference) too.
    let needs_dmask = mask.as_ref().is_some_and(|m| m.dtype().is_float());
    let attrs: Vec<_> = attrs.iter().cloned().chain([("needs_dmask", AttrValue::Bool(needs_dmask))]).collect();
    run_checked(
        "attention_backward",
        &[
            Some(dout.view()),
            Some(q.view()),
            Some(k.view()),
            Some(v.view()),
            Some(out.view()),
            view(&lse, &q_shape[..q_shape.len() - 1]),
            lens,
            mask,
            sinks,
        ],
        &attrs,
    )
}

/// Element run `at` of `n`-element runs of `x`, as a tensor of `shape`.
fn part<'a>(x: &'a [f32], at: usize, n: usize, shape: &[usize]) -> TensorRef<'a> {
    TensorRef::new(&x[at * n..(at + 1) * n], shape).unwrap()
}

/// SDPA's leading batch dims, any number: q `[2, 3, 4, 40, 16]` (batch dims `[2, 3]`, GQA 4:2), k
/// expanded along the second batch dim (stride 0: read in place, its two batch dims not one
/// stride), kv_lens of the batch dims' shape, sinks, and a float mask `[2, 1, 4, 40, 50]` broadcast
/// along the second batch dim. Forward and backward against the f64 reference, and against
/// rank-3 calls (no batch dim) on each batch row's slices of the same data: the row's outputs and
/// gradients, k's gradient per row of the expanded view, the mask's summed over the batch dim it is
/// broadcast along and the sinks' over every row. Then masks broadcast along the first batch dim
/// (`[3, 1, 1, 50]`) and along both (`[40, 50]`), and no mask (the AVX2 backward tiles' route),
/// against the reference; and the forward in bf16.
#[test]
fn leading_batch_dims_are_rows_of_one_flat_batch() {
    setup();
    let (q_shape, kv_shape, mask_shape) = ([2, 3, 4, 40, 16], [2, 3, 2, 50, 16], [2, 1, 4, 40, 50]);
    let (q_row, kv_row, mask_row) = (4 * 40 * 16, 2 * 50 * 16, 4 * 40 * 50);
    let q = rand_vec(6 * q_row, 501);
    let k = rand_vec(2 * kv_row, 502); // [2, 1, 2, 50, 16], expanded to kv_shape
    let v = rand_vec(6 * kv_row, 503);
    let dout = rand_vec(6 * q_row, 504);
    let mask: Vec<f32> = rand_vec(2 * mask_row, 505).iter().map(|x| 2.0 * x).collect();
    let sinks = rand_vec(4, 506);
    let lens = [50i64, 31, 7, 44, 50, 19];
    let k_strides = [kv_row, 0, 50 * 16, 16, 1];
    let k_view = || TensorRef::strided(&k, &kv_shape, &k_strides, 0).unwrap();
    let call = |[q, k, v, dout]: [TensorRef; 4], lens: TensorRef, mask: Option<TensorRef>| {
        let attrs = [("causal", AttrValue::Bool(true)), ("needs_dmask", AttrValue::Bool(mask.is_some()))];
        let fwd = run_checked(
            "attention",
            &[Some(q.clone()), Some(k.clone()), Some(v.clone()), Some(lens.clone()), mask.clone(), view(&sinks, &[4])],
            &attrs[..1],
        );
        let (out, lse): (Vec<f32>, Vec<f32>) =
            (fwd[0].iter().map(|&x| x as f32).collect(), fwd[1].iter().map(|&x| x as f32).collect());
        let rows = &q.shape()[..q.shape().len() - 1];
        let grads = run_checked(
            "attention_backward",
            &[
                Some(dout),
                Some(q.clone()),
                Some(k),
                Some(v),
                view(&out, q.shape()),
                view(&lse, rows),
                Some(lens),
                mask,
                view(&sinks, &[4]),
            ],
            &attrs,
        );
        [fwd, grads].concat()
    };
    let whole = call(
        [view(&q, &q_shape).unwrap(), k_view(), view(&v, &kv_shape).unwrap(), view(&dout, &q_shape).unwrap()],
        TensorRef::new(&lens, &[2, 3]).unwrap(),
        view(&mask, &mask_shape),
    );
    let (mut dmask, mut dsinks) = (vec![0.0; mask.len()], vec![0.0; 4]);
    for row in 0..6 {
        let a = row / 3;
        let got = call(
            [
                part(&q, row, q_row, &q_shape[2..]),
                part(&k, a, kv_row, &kv_shape[2..]),
                part(&v, row, kv_row, &kv_shape[2..]),
                part(&dout, row, q_row, &q_shape[2..]),
            ],
            TensorRef::new(&lens[row..row + 1], &[]).unwrap(),
            Some(part(&mask, a, mask_row, &mask_shape[2..])),
        );
        let [out, lse, dq, dk, dv, row_dmask, row_dsinks] = &got[..] else { panic!("7 results") };
        let rows = |x: &[f64], n: usize| x[row * n..(row + 1) * n].to_vec();
        assert_near(&rows(&whole[0], 4 * 40 * 16), out, 1e-5, "out");
        assert_near(&rows(&whole[1], 4 * 40), lse, 1e-5, "lse");
        assert_near(&rows(&whole[2], q_row), dq, 1e-5, "dq");
        assert_near(&rows(&whole[3], kv_row), dk, 1e-5, "dk (a row of k's expanded view)");
        assert_near(&rows(&whole[4], kv_row), dv, 1e-5, "dv");
        dmask[a * mask_row..(a + 1) * mask_row].iter_mut().zip(row_dmask).for_each(|(s, x)| *s += x);
        dsinks.iter_mut().zip(row_dsinks).for_each(|(s, x)| *s += x);
    }
    assert_near(&whole[5], &dmask, 1e-5, "dmask, summed over the batch dim it is broadcast along");
    assert_near(&whole[6], &dsinks, 1e-5, "dsinks, summed over every batch row");

    let (first, both) = (rand_vec(150, 507), rand_vec(2000, 508));
    for mask in [view(&first, &[3, 1, 1, 50]), view(&both, &[40, 50]), None] {
        call(
            [view(&q, &q_shape).unwrap(), k_view(), view(&v, &kv_shape).unwrap(), view(&dout, &q_shape).unwrap()],
            TensorRef::new(&lens, &[2, 3]).unwrap(),
            mask,
        );
    }
    let k_bf16: Vec<_> = k.iter().map(|&x| uniop::half::bf16::from_f32(x)).collect();
    let (qb, vb) = (bf16(&q, &q_shape), bf16(&v, &kv_shape));
    let kb = TensorRef::strided(&k_bf16, &kv_shape, &k_strides, 0).unwrap();
    run_checked("attention", &[Some(qb.view()), Some(kb), Some(vb.view()), None], &causal(true));
}

/// `batch_dims` keeps attention_backward's sums over batch rows — a shared float mask's gradient
/// and the sinks' — apart per sample (its first `batch_dims` batch dims), so per-sample gradients
/// take one call: q `[2, 3, 4, 40, 16]` with a mask `[3, 1, 1, 50]` (one bias per key, shared by
/// the first batch dim's samples) and batch_dims 1, a mask `[40, 50]` and batch_dims 2, and
/// biases with an element per score (summed where AVX2's backward tiles compute the scores'
/// gradients), `[3, 4, 40, 50]` and `[4, 40, 50]`, with batch_dims 1. Each
/// against the f64 reference and against calls on each sample's own slices; dq, dk and dv as
/// without batch_dims. A mask reaching into the sample dims, and more batch_dims than q has batch
/// dims, are errors.
#[test]
fn batch_dims_keep_the_shared_sums_per_sample() {
    setup();
    let (q_row, kv_row) = (4 * 40 * 16, 2 * 50 * 16);
    let (q, k, v, dout) =
        (rand_vec(6 * q_row, 511), rand_vec(6 * kv_row, 512), rand_vec(6 * kv_row, 513), rand_vec(6 * q_row, 514));
    let sinks = rand_vec(4, 515);
    let lens = [50i64, 31, 7, 44, 50, 19];
    // Forward, then backward with the mask's gradient, over `rows` flat batch rows from `first`
    // (leading dims `batch`).
    let grads = |batch: &[usize], first: usize, mask: TensorRef, batch_dims: i64| {
        let rows: usize = batch.iter().product();
        let (q_shape, kv_shape) = ([batch, &[4, 40, 16]].concat(), [batch, &[2, 50, 16]].concat());
        // `first` is a multiple of `rows`: the whole batch, or one sample of it.
        let part = |x, n, shape| Some(part(x, first / rows, rows * n, shape));
        let lens = Some(TensorRef::new(&lens[first..first + rows], batch).unwrap());
        let (q, k, v) = (part(&q, q_row, &q_shape), part(&k, kv_row, &kv_shape), part(&v, kv_row, &kv_shape));
        let fwd = run_checked(
            "attention",
            &[q.clone(), k.clone(), v.clone(), lens.clone(), Some(mask.clone()), view(&sinks, &[4])],
            &causal(true),
        );
        let (out, lse): (Vec<f32>, Vec<f32>) =
            (fwd[0].iter().map(|&x| x as f32).collect(), fwd[1].iter().map(|&x| x as f32).collect());
        let attrs = [
            causal(true)[0].clone(),
            ("needs_dmask", AttrValue::Bool(true)),
            ("batch_dims", AttrValue::Int(batch_dims)),
        ];
        run_checked(
            "attention_backward",
            &[
                part(&dout, q_row, &q_shape),
                q,
                k,
                v,
                view(&out, &q_shape),
                view(&lse, &q_shape[..q_shape.len() - 1]),
                lens,
                Some(mask),
                view(&sinks, &[4]),
            ],
            &attrs,
        )
    };
    let (first_mask, both_mask, full_mask) = (rand_vec(150, 516), rand_vec(2000, 517), rand_vec(3 * 8000, 518));
    for (batch_dims, mask) in [
        (1, TensorRef::new(&first_mask, &[3, 1, 1, 50]).unwrap()),
        (2, TensorRef::new(&both_mask, &[40, 50]).unwrap()),
        (1, TensorRef::new(&full_mask, &[3, 4, 40, 50]).unwrap()),
        (1, TensorRef::new(&full_mask[..8000], &[4, 40, 50]).unwrap()),
    ] {
        let whole = grads(&[2, 3], 0, mask.clone(), batch_dims);
        let summed = grads(&[2, 3], 0, mask.clone(), 0);
        for (at, name) in [(0, "dq"), (1, "dk"), (2, "dv")] {
            assert_near(&whole[at], &summed[at], 1e-6, name);
        }
        let (sample_dims, sample_rows) = (&[2, 3][batch_dims as usize..], [3, 1][batch_dims as usize - 1]);
        let (mut dmask, mut dsinks) = (vec![], vec![]);
        for sample in 0..6 / sample_rows {
            let own = grads(sample_dims, sample * sample_rows, mask.clone(), 0);
            dmask.extend_from_slice(&own[3]);
            dsinks.extend_from_slice(&own[4]);
        }
        assert_eq!(
            (whole[3].len(), whole[4].len()),
            (6 / sample_rows * mask.shape().iter().product::<usize>(), 6 / sample_rows * 4)
        );
        assert_near(&whole[3], &dmask, 1e-5, "dmask, one per sample");
        assert_near(&whole[4], &dsinks, 1e-5, "dsinks, one per sample");
    }

    let zeros = vec![0f32; 6 * q_row];
    let lse = vec![0f32; 6 * 4 * 40];
    let t = |x, shape: &[usize]| Some(part(x, 0, shape.iter().product(), shape));
    let call = |mask: Option<TensorRef>, batch_dims: i64| {
        let (q_shape, kv_shape) = ([2, 3, 4, 40, 16], [2, 3, 2, 50, 16]);
        let inputs = [
            t(&zeros, &q_shape),
            t(&zeros, &q_shape),
            t(&zeros, &kv_shape),
            t(&zeros, &kv_shape),
            t(&zeros, &q_shape),
            t(&lse, &[2, 3, 4, 40]),
            None,
            mask,
        ];
        let attrs = [("needs_dmask", AttrValue::Bool(true)), ("batch_dims", AttrValue::Int(batch_dims))];
        let err = plan_err("attention_backward", &inputs, &attrs, vec![]);
        (err.code(), err.message().to_string())
    };
    assert_eq!(
        call(t(&zeros, &[2, 1, 1, 1, 50]), 1),
        (
            ErrorCode::Shape,
            "attention_backward: argument 'mask': expected at most 4 dims with needs_dmask and batch_dims 1 (one mask \
             shared by every sample, its gradient summed per sample), got shape [2, 1, 1, 1, 50]"
                .to_string()
        )
    );
    assert_eq!(
        call(t(&zeros, &[40, 50]), 3),
        (
            ErrorCode::ParamInvalid,
            "attention_backward: argument 'batch_dims': expected 0 to 2 (the dims of q [2, 3, 4, 40, 16] that index \
             its rows), got 3"
                .to_string()
        )
    );
}

/// `softcap` caps the scaled scores to `cap · tanh(score / cap)` before the mask adds (Gemma 2):
/// first by hand — one query, two keys with scaled scores ±3, values 1 and 0, so the output is
/// `sigmoid(2 · cap · tanh(3 / cap))` — then against the f64 reference over many tiles (GQA,
/// causal, scores large enough that the cap bends them: f32 and bf16, with a boolean padding
/// mask, with a float bias whose gradient is asked for, with kv_lens, decode with its keys cut
/// into ranges), forward and backward; the gradients (a float mask's too) against central finite
/// differences of the f64 forward.
#[test]
fn softcap_bends_the_scaled_scores_before_the_mask() {
    setup();
    let (q, k, v) = ([3.0f32, 0.0], [1.0f32, 0.0, -1.0, 0.0], [1.0f32, 0.0]);
    let inputs = [view(&q, &[1, 1, 1, 2]), view(&k, &[1, 1, 2, 2]), view(&v, &[1, 1, 2, 1]), None];
    for cap in [1.0, 2.5] {
        let attrs = [("scale", AttrValue::Float(1.0)), ("softcap", AttrValue::Float(cap))];
        let out = run_checked("attention", &inputs, &attrs)[0][0];
        let want = 1.0 / (1.0 + (-2.0 * cap * (3.0 / cap).tanh()).exp());
        assert!((out - want).abs() < 1e-6, "cap {cap}: {out} vs {want}");
    }

    let (q_shape, kv_shape) = ([2, 4, 300, 16], [2, 2, 300, 16]);
    let q: Vec<f32> = rand_vec(2 * 4 * 300 * 16, 401).iter().map(|x| 6.0 * x).collect();
    let (k, v) = (rand_vec(2 * 2 * 300 * 16, 402), rand_vec(2 * 2 * 300 * 16, 403));
    let dout = rand_vec(2 * 4 * 300 * 16, 404);
    let capped = |c: bool| [("causal", AttrValue::Bool(c)), ("softcap", AttrValue::Float(2.0))];
    let padding = left_padding_mask(&[0, 37], 300, 300, false);
    let padding = || Some(TensorRef::new(&padding, &[2, 1, 300, 300]).unwrap());
    let bias: Vec<f32> = rand_vec(4 * 300 * 300, 405)
        .iter()
        .enumerate()
        .map(|(x, &r)| if x % 13 == 2 { f32::NEG_INFINITY } else { r })
        .collect();
    let bias = || Some(TensorRef::new(&bias, &[4, 300, 300]).unwrap());
    let lens = [300i64, 211];
    let lens = || Some(TensorRef::new(&lens, &[2]).unwrap());
    for (lens, mask, c) in [(None, None, true), (None, padding(), true), (lens(), bias(), false), (None, bias(), true)]
    {
        backward_after_forward((&q, &k, &v, &dout), (q_shape, kv_shape), (lens, mask), &capped(c));
    }
    let (qb, kb, vb, db) = (bf16(&q, &q_shape), bf16(&k, &kv_shape), bf16(&v, &kv_shape), bf16(&dout, &q_shape));
    typed_backward_after_forward([&qb, &kb, &vb, &db], (None, padding(), None), bf16, &capped(true));
    let (dq_shape, dkv_shape) = ([2, 4, 1, 16], [2, 2, 1100, 16]);
    let (dk, dv) = (rand_vec(2 * 2 * 1100 * 16, 406), rand_vec(2 * 2 * 1100 * 16, 407));
    let decode = [view(&q[..2 * 4 * 16], &dq_shape), view(&dk, &dkv_shape), view(&dv, &dkv_shape), None];
    run_checked("attention", &decode, &capped(false));

    let bias: Vec<f32> =
        (0..2 * 3 * 5).map(|x| if x == 9 { f32::NEG_INFINITY } else { 0.4 * (x % 3) as f32 }).collect();
    let values = bias.iter().map(|&b| b as f64).collect();
    let attrs = [("scale", AttrValue::Float(3.0)), ("softcap", AttrValue::Float(1.5))];
    small_masked_gradients_match_finite_differences_with(
        TensorRef::new(&bias, &[1, 2, 3, 5]).unwrap(),
        values,
        408,
        &attrs,
    );
}

/// `sinks` add one logit per q head to each query's softmax, of a key whose value is zero
/// (GPT-OSS): first by hand — one query, keys with scaled scores ±1 and values 1 and 0, so the
/// output is `e / (e + 1/e + e^sink)`; a row with no key gets output 0 and `lse = sink` — then
/// against the f64 reference over many tiles (GQA, causal, f32 and bf16 — sinks in f32 and bf16 —,
/// with a padding mask, with a float bias and kv_lens, with softcap, decode with its keys cut into
/// ranges), forward and backward; the gradients (the sinks' too) against central finite
/// differences of the f64 forward.
#[test]
fn sinks_take_a_share_of_every_softmax() {
    setup();
    let (q, k, v) = ([1.0f32, 0.0], [1.0f32, 0.0, -1.0, 0.0], [1.0f32, 0.0]);
    let no_keys = [0i64];
    let scale = [("scale", AttrValue::Float(1.0))];
    // A sink of −∞ is no sink: a row without keys keeps lse −∞, and its gradient stays 0, not NaN.
    for sink in [0.5f32, -3.0, 4.0, f32::NEG_INFINITY] {
        let sinks = [sink];
        let inputs =
            [view(&q, &[1, 1, 1, 2]), view(&k, &[1, 1, 2, 2]), view(&v, &[1, 1, 2, 1]), None, None, view(&sinks, &[1])];
        let out = run_checked("attention", &inputs, &scale);
        let e = std::f64::consts::E;
        let want = e / (e + 1.0 / e + (sink as f64).exp());
        assert!((out[0][0] - want).abs() < 1e-6, "sink {sink}: {} vs {want}", out[0][0]);
        assert!((out[1][0] - (e + 1.0 / e + (sink as f64).exp()).ln()).abs() < 1e-5, "sink {sink}: lse {}", out[1][0]);
        let mut empty = inputs.clone();
        empty[3] = Some(TensorRef::new(&no_keys, &[1]).unwrap());
        let out = run_checked("attention", &empty, &scale);
        assert_eq!((out[0][0], out[1][0]), (0.0, sink as f64), "a row with no key");
        let (dout, lse) = ([1.0f32], [out[1][0] as f32]);
        let backward = [
            view(&dout, &[1, 1, 1, 1]),
            inputs[0].clone(),
            inputs[1].clone(),
            inputs[2].clone(),
            view(&[0.0f32], &[1, 1, 1, 1]),
            view(&lse, &[1, 1, 1]),
            empty[3].clone(),
            None,
            view(&sinks, &[1]),
        ];
        let grads = run_checked("attention_backward", &backward, &scale);
        assert_eq!(grads[4], [0.0], "sink {sink}: a row with no key and output 0 gives its sink no gradient");
    }

    let (q_shape, kv_shape) = ([2, 4, 300, 16], [2, 2, 300, 16]);
    let q: Vec<f32> = rand_vec(2 * 4 * 300 * 16, 501).iter().map(|x| 3.0 * x).collect();
    let (k, v) = (rand_vec(2 * 2 * 300 * 16, 502), rand_vec(2 * 2 * 300 * 16, 503));
    let dout = rand_vec(2 * 4 * 300 * 16, 504);
    // Sinks from well below the rows' scores to well above them.
    let sinks = [-4.0f32, 0.0, 1.5, 6.0];
    let sinks = || view(&sinks, &[4]);
    let f32s = |x: &[f32], shape: &[usize]| Tensor::from_slice(x, shape).unwrap();
    let (qf, kf, vf, df) = (f32s(&q, &q_shape), f32s(&k, &kv_shape), f32s(&v, &kv_shape), f32s(&dout, &q_shape));
    let padding = left_padding_mask(&[0, 37], 300, 300, false);
    let padding = || Some(TensorRef::new(&padding, &[2, 1, 300, 300]).unwrap());
    let bias: Vec<f32> = rand_vec(4 * 300 * 300, 505).iter().map(|&r| 2.0 * r).collect();
    let bias = || Some(TensorRef::new(&bias, &[4, 300, 300]).unwrap());
    let lens = [300i64, 211];
    let lens = || Some(TensorRef::new(&lens, &[2]).unwrap());
    let capped = [("causal", AttrValue::Bool(true)), ("softcap", AttrValue::Float(2.0))];
    for (lens, mask, attrs) in [
        (None, None, &causal(true)[..]),
        (None, padding(), &causal(true)),
        (lens(), bias(), &causal(false)),
        (None, padding(), &capped),
    ] {
        let grads = typed_backward_after_forward([&qf, &kf, &vf, &df], (lens, mask, sinks()), f32s, attrs);
        assert_eq!(grads[4].len(), 4, "dsinks");
    }
    let (qb, kb, vb, db) = (bf16(&q, &q_shape), bf16(&k, &kv_shape), bf16(&v, &kv_shape), bf16(&dout, &q_shape));
    let bf16_sinks = bf16(&[-4.0, 0.0, 1.5, 6.0], &[4]);
    typed_backward_after_forward([&qb, &kb, &vb, &db], (None, padding(), Some(bf16_sinks.view())), bf16, &causal(true));
    let (dq_shape, dkv_shape) = ([2, 4, 1, 16], [2, 2, 1100, 16]);
    let (dk, dv) = (rand_vec(2 * 2 * 1100 * 16, 506), rand_vec(2 * 2 * 1100 * 16, 507));
    let decode = [view(&q[..2 * 4 * 16], &dq_shape), view(&dk, &dkv_shape), view(&dv, &dkv_shape), None, None, sinks()];
    run_checked("attention", &decode, &causal(false));

    // Gradients against finite differences, through an all-true boolean mask (the finite
    // differences take every input up to the sinks).
    let (q_shape, kv_shape) = ([1, 2, 3, 4], [1, 1, 5, 4]);
    let (q, k, v, dout) = (rand_vec(24, 508), rand_vec(20, 509), rand_vec(20, 510), rand_vec(24, 511));
    let (keep, sinks) = ([true], [0.3f32, -0.7]);
    let (qf, kf, vf, df) = (f32s(&q, &q_shape), f32s(&k, &kv_shape), f32s(&v, &kv_shape), f32s(&dout, &q_shape));
    let mask = Some(TensorRef::new(&keep, &[1]).unwrap());
    let grads =
        typed_backward_after_forward([&qf, &kf, &vf, &df], (None, mask, view(&sinks, &[2])), f32s, &causal(true));
    let f64s = |x: &[f32]| x.iter().map(|&v| v as f64).collect::<Vec<_>>();
    let inputs = [
        (f64s(&q), q_shape.to_vec()),
        (f64s(&k), kv_shape.to_vec()),
        (f64s(&v), kv_shape.to_vec()),
        (vec![5.0], vec![1]),
        (vec![1.0], vec![1]),
        (f64s(&sinks), vec![2]),
    ];
    let dtypes = [DType::F32, DType::F32, DType::F32, DType::I64, DType::Bool, DType::F32];
    for (wrt, got, name) in [(0, 0, "dq"), (1, 1, "dk"), (2, 2, "dv"), (5, 4, "dsinks")] {
        let fd = finite_difference_typed("attention", &inputs, &dtypes, &causal(true), &f64s(&dout), wrt);
        assert_near(&grads[got], &fd, 1e-4, name);
    }
}

/// attention_backward, fed the forward's own out and lse, against central finite differences of
/// the f64 forward — GQA, a causal chunk and a cache length that hides the last key.
#[test]
fn attention_backward_matches_finite_differences() {
    setup();
    let (q_shape, kv_shape) = ([1, 2, 3, 4], [1, 1, 5, 4]);
    let q = rand_vec(24, 41);
    let k = rand_vec(20, 42);
    let v = rand_vec(20, 43);
    let dout = rand_vec(24, 44);
    let lens = [4i64];
    let attrs = causal(true);
    let grads = backward_after_forward(
        (&q, &k, &v, &dout),
        (q_shape, kv_shape),
        (Some(TensorRef::new(&lens, &[1]).unwrap()), None),
        &attrs,
    );
    let f64s = |v: &[f32]| v.iter().map(|&x| x as f64).collect::<Vec<_>>();
    let inputs = [
        (f64s(&q), q_shape.to_vec()),
        (f64s(&k), kv_shape.to_vec()),
        (f64s(&v), kv_shape.to_vec()),
        (vec![4.0], vec![1]),
    ];
    let dtypes = [DType::F32, DType::F32, DType::F32, DType::I64];
    for (wrt, name) in [(0, "dq"), (1, "dk"), (2, "dv")] {
        let fd = finite_difference_typed("attention", &inputs, &dtypes, &attrs, &f64s(&dout), wrt);
        assert_close(&grads[wrt], &fd, name);
    }
    // The hidden fifth key gets no gradient.
    assert!(grads[1][16..].iter().chain(&grads[2][16..]).all(|&g| g == 0.0));
}

#[test]
fn attention_backward_spans_many_tiles() {
    setup();
    let (q_shape, kv_shape) = ([1, 4, 300, 16], [1, 2, 300, 16]);
    let n = 4 * 300 * 16;
    let (q, k, v, dout) = (rand_vec(n, 51), rand_vec(n / 2, 52), rand_vec(n / 2, 53), rand_vec(n, 54));
    backward_after_forward((&q, &k, &v, &dout), (q_shape, kv_shape), (None, None), &causal(true));
}

/// With many (batch, kv head) pairs the dK/dV launch also sums dQ (one unit per pair, no separate
/// dQ launch): 64 pairs take that route on machines of up to 32 threads (the tests above, 2 pairs,
/// take it on 1 or 2 threads, one pair per thread; the unit tests in `attention_backward.rs` force
/// every route with one pair). GQA, causal, per-sequence cache lengths.
#[test]
fn attention_backward_with_many_kv_heads_sums_dq_alongside_dk_dv() {
    setup();
    let (q_shape, kv_shape) = ([4, 32, 24, 8], [4, 16, 24, 8]);
    let n = 4 * 32 * 24 * 8;
    let (q, k, v, dout) = (rand_vec(n, 71), rand_vec(n / 2, 72), rand_vec(n / 2, 73), rand_vec(n, 74));
    let lens = [24i64, 17, 3, 1];
    for causal_mask in [true, false] {
        backward_after_forward(
            (&q, &k, &v, &dout),
            (q_shape, kv_shape),
            (Some(TensorRef::new(&lens, &[4]).unwrap()), None),
            &causal(causal_mask),
        );
    }
}

/// bf16 runs every tile product on the AVX512-BF16 GEMM (P and dS rounded to bf16): checked over
/// many query and key tiles against the f64 reference at bf16 tolerance.
#[test]
fn attention_backward_bf16_spans_many_tiles() {
    setup();
    let (q_shape, kv_shape) = ([1, 4, 300, 32], [1, 2, 300, 32]);
    let n = 4 * 300 * 32;
    let (q, k, v, dout) = (
        bf16(&rand_vec(n, 61), &q_shape),
        bf16(&rand_vec(n / 2, 62), &kv_shape),
        bf16(&rand_vec(n / 2, 63), &kv_shape),
        bf16(&rand_vec(n, 64), &q_shape),
    );
    typed_backward_after_forward([&q, &k, &v, &dout], (None, None, None), bf16, &causal(true));
}

#[test]
fn attention_rejects_bad_inputs() {
    setup();
    let x = [0f32; 3 * 8 * 4];
    let lse = [0i32; 6];
    let lse_f32 = [0f32; 6];
    let keep = [true; 8];
    let keep_mask = || Some(TensorRef::new(&keep[..4], &[2, 2]).unwrap());
    let t = |shape: &[usize]| view(&x[..shape.iter().product::<usize>()], shape);
    let q = || t(&[1, 3, 2, 4]);
    let lens2 = || Some(TensorRef::new(&lse[..2], &[2]).unwrap());
    let cases = [
        (
            plan_err("attention", &[q(), t(&[1, 2, 2, 4]), t(&[1, 2, 2, 4]), None], &[], vec![]),
            ErrorCode::Shape,
            "attention: argument 'k': expected a kv head count dividing q's 3 heads, got 2 heads (shape [1, 2, 2, 4])",
        ),
        (
            plan_err("attention", &[q(), t(&[1, 3, 2, 8]), t(&[1, 3, 2, 4]), None], &[], vec![]),
            ErrorCode::Shape,
            "attention: argument 'k': expected shape [1, 3, 2, 4], got shape [1, 3, 2, 8]",
        ),
        (
            plan_err("attention", &[t(&[2, 4]), q(), q(), None], &[], vec![]),
            ErrorCode::Shape,
            "attention: argument 'q': expected rank 3 to 7 ([..., heads, seq, head_dim]), got shape [2, 4]",
        ),
        (
            plan_err("attention", &[t(&[1, 1, 1, 1, 1, 3, 2, 4]), q(), q(), None], &[], vec![]),
            ErrorCode::Shape,
            "attention: argument 'q': expected rank 3 to 7 ([..., heads, seq, head_dim]), got shape [1, 1, 1, 1, 1, 3, \
             2, 4]",
        ),
        (
            plan_err("attention", &[t(&[2, 1, 3, 2, 4]), t(&[1, 2, 3, 2, 4]), t(&[1, 2, 3, 2, 4]), None], &[], vec![]),
            ErrorCode::Shape,
            "attention: argument 'k': expected shape [2, 1, 3, 2, 4], got shape [1, 2, 3, 2, 4]",
        ),
        (
            plan_err("attention", &[t(&[2, 1, 3, 2, 4]), t(&[2, 1, 3, 2, 4]), t(&[2, 1, 3, 2, 4]), lens2()], &[], vec![]),
            ErrorCode::Shape,
            "attention: argument 'kv_lens': expected shape [2, 1], got shape [2]",
        ),
        (
            plan_err("attention", &[q(), q(), q(), None, Some(TensorRef::new(&keep, &[2, 1, 1, 2, 2]).unwrap())], &[], vec![]),
            ErrorCode::Shape,
            "attention: argument 'mask': expected a shape broadcastable to [..., Hq, Sq, Sk] = [1, 3, 2, 2], got shape [2, \
             1, 1, 2, 2]",
        ),
        (
            plan_err("attention", &[q(), q(), q(), t(&[2])], &[], vec![]),
            ErrorCode::DType,
            "attention: argument 'kv_lens': expected dtype in {int32, int64}, got float32",
        ),
        (
            plan_err("attention", &[q(), q(), q(), None], &[("scale", f64::NAN.into())], vec![]),
            ErrorCode::ParamInvalid,
            "attention: argument 'scale': expected a finite float or None (1/sqrt(head_dim)), got NaN",
        ),
        (
            plan_err("attention", &[q(), q(), q(), None, Some(TensorRef::new(&[1i32; 4], &[2, 2]).unwrap())], &[], vec![]),
            ErrorCode::DType,
            "attention: argument 'mask': expected dtype in {bool, float32, float16, bfloat16}, got int32",
        ),
        (
            plan_err("attention", &[q(), q(), q(), None, Some(TensorRef::new(&keep, &[1, 2, 2, 2]).unwrap())], &[], vec![]),
            ErrorCode::Shape,
            "attention: argument 'mask': expected a shape broadcastable to [..., Hq, Sq, Sk] = [1, 3, 2, 2], got shape [1, 2, 2, \
             2]",
        ),
        (
            plan_err("attention", &[q(), q(), q(), None, Some(TensorRef::new(&keep[..4], &[2, 2]).unwrap())], &[("scale", 0.0.into())], vec![]),
            ErrorCode::ParamInvalid,
            "attention: argument 'scale': expected a nonzero scale when a mask is given, got 0",
        ),
        (
            plan_err("attention", &[q(), q(), q(), None], &[("softcap", 0.0.into())], vec![]),
            ErrorCode::ParamInvalid,
            "attention: argument 'softcap': expected a positive finite float or None (no capping), got 0",
        ),
        (
            plan_err("attention", &[q(), q(), q(), None], &[("softcap", f64::INFINITY.into())], vec![]),
            ErrorCode::ParamInvalid,
            "attention: argument 'softcap': expected a positive finite float or None (no capping), got inf",
        ),
        (
            plan_err("attention", &[q(), q(), q(), None], &[("softcap", 30.0.into()), ("scale", 0.0.into())], vec![]),
            ErrorCode::ParamInvalid,
            "attention: argument 'scale': expected a nonzero scale when softcap is given, got 0",
        ),
        (
            plan_err("attention", &[q(), q(), q(), None, None, t(&[2])], &[], vec![]),
            ErrorCode::Shape,
            "attention: argument 'sinks': expected shape [3], got shape [2]",
        ),
        (
            plan_err("attention", &[q(), q(), q(), None, None, Some(TensorRef::new(&[0i32; 3], &[3]).unwrap())], &[], vec![]),
            ErrorCode::DType,
            "attention: argument 'sinks': expected dtype in {float32, float16, bfloat16}, got int32",
        ),
        (
            plan_err(
                "attention_backward",
                &[q(), q(), q(), q(), q(), view(&lse_f32, &[1, 3, 2]), None, None, t(&[1, 3])],
                &[],
                vec![],
            ),
            ErrorCode::Shape,
            "attention_backward: argument 'sinks': expected shape [3], got shape [1, 3]",
        ),
        (
            plan_err(
                "attention_backward",
                &[q(), q(), q(), q(), q(), Some(TensorRef::new(&lse, &[1, 3, 2]).unwrap()), None],
                &[],
                vec![],
            ),
            ErrorCode::DType,
            "attention_backward: argument 'lse': expected dtype in {float32}, got int32",
        ),
        (
            plan_err(
                "attention_backward",
                &[q(), q(), q(), q(), q(), Some(TensorRef::new(&lse_f32, &[1, 3, 2]).unwrap()), None, keep_mask()],
                &[("needs_dmask", true.into())],
                vec![],
            ),
            ErrorCode::ParamInvalid,
            "attention_backward: argument 'needs_dmask': expected false unless mask is a float mask (a boolean mask, \
             or none, has no gradient), got true with a bool mask",
        ),
        (
            plan_err(
                "attention_backward",
                &[q(), q(), q(), q(), q(), Some(TensorRef::new(&lse_f32, &[1, 3, 2]).unwrap()), None, None],
                &[("needs_dmask", true.into())],
                vec![],
            ),
            ErrorCode::ParamInvalid,
            "attention_backward: argument 'needs_dmask': expected false unless mask is a float mask (a boolean mask, \
             or none, has no gradient), got true with no mask",
        ),
    ];
    for (err, code, msg) in cases {
        assert_eq!((err.code(), err.message()), (code, msg));
    }

    // A cache length beyond the cache is data, caught at launch time (cache overflow).
    let lens = [3i32];
    let mut out = Tensor::zeros(DType::F32, &[1, 3, 2, 4]).unwrap();
    let mut l = Tensor::zeros(DType::F32, &[1, 3, 2]).unwrap();
    let err = uniop::call(
        "attention",
        &[q(), q(), q(), Some(TensorRef::new(&lens, &[1]).unwrap())],
        &[],
        vec![out.view_mut(), l.view_mut()],
    )
    .unwrap_err();
    assert_eq!(err.code(), ErrorCode::Runtime);
    assert!(
        err.message().starts_with(
            "attention: argument 'kv_lens': expected values in [0, 2] (the cache length of k), got 3 at position 0"
        ),
        "{err}"
    );
}

fn strided_view<'a>(x: &'a [f32], shape: &[usize], strides: &[usize], offset: usize) -> TensorRef<'a> {
    TensorRef::strided(x, shape, strides, offset).unwrap()
}

/// Appends `k`/`v` (`[B, H, S_new, D]` views) at `positions` into the caches, in place.
fn append(
    k_cache: &mut [f32],
    v_cache: &mut [f32],
    cache_shape: &[usize],
    k: TensorRef,
    v: TensorRef,
    positions: &[i32],
) -> uniop::Result<()> {
    let pos = TensorRef::new(positions, &[positions.len()]).unwrap();
    let caches = vec![
        uniop::TensorMut::new(k_cache, cache_shape).unwrap(),
        uniop::TensorMut::new(v_cache, cache_shape).unwrap(),
    ];
    uniop::call("kv_cache_append", &[Some(k), Some(v), Some(pos)], &[], caches)
}

/// New rows land at each sequence's position and every other cache row keeps its value, for
/// HF's `[B, S, H, D]` transposed views (row by row) and for dense `[B, H, S, D]` rows long enough
/// that blocks split the (sequence, head) panels mid-way (each block copies runs of whole rows).
#[test]
fn kv_cache_append_writes_rows_at_positions() {
    setup();
    // (b, h, s_max, s_new, d, new rows stored as [B, S, H, D])
    for (b, h, s_max, s_new, d, bshd) in [(2, 3, 8, 3, 4, true), (2, 3, 160, 101, 64, false)] {
        let cache_shape = [b, h, s_max, d];
        let mut k_cache = rand_vec(b * h * s_max * d, 41);
        let mut v_cache = rand_vec(b * h * s_max * d, 42);
        let (k0, v0) = (k_cache.clone(), v_cache.clone());
        let k_new = rand_vec(b * s_new * h * d, 43);
        let v_new = rand_vec(b * s_new * h * d, 44);
        // Element offset of (sequence, head, new row) in the new rows' storage.
        let at = |bi: usize, hi: usize, t: usize| {
            if bshd {
                ((bi * s_new + t) * h + hi) * d
            } else {
                ((bi * h + hi) * s_new + t) * d
            }
        };
        let strides = if bshd { [s_new * h * d, d, h * d, 1] } else { [h * s_new * d, s_new * d, d, 1] };
        let positions = [s_max as i32 - s_new as i32, 0];
        append(
            &mut k_cache,
            &mut v_cache,
            &cache_shape,
            strided_view(&k_new, &[b, h, s_new, d], &strides, 0),
            strided_view(&v_new, &[b, h, s_new, d], &strides, 0),
            &positions,
        )
        .unwrap();
        for (cache, before, new) in [(&k_cache, &k0, &k_new), (&v_cache, &v0, &v_new)] {
            for (bi, &p) in positions.iter().enumerate() {
                for hi in 0..h {
                    for s in 0..s_max {
                        let row = &cache[((bi * h + hi) * s_max + s) * d..][..d];
                        let want: &[f32] = if (p as usize..p as usize + s_new).contains(&s) {
                            &new[at(bi, hi, s - p as usize)..][..d]
                        } else {
                            &before[((bi * h + hi) * s_max + s) * d..][..d]
                        };
                        assert_eq!(row, want, "b {bi} h {hi} s {s} (shape {cache_shape:?}, bshd {bshd})");
                    }
                }
            }
        }
    }
}

/// Prefill a chunk, append one decode step, then attend with `kv_lens`: the same as attention over
/// the whole sequence held contiguously.
#[test]
fn kv_cache_append_then_decode_equals_full_attention() {
    setup();
    let (h, s_max, d, total) = (2, 16, 8, 6);
    let k_all = rand_vec(h * total * d, 51);
    let v_all = rand_vec(h * total * d, 52);
    let q = rand_vec(2 * h * d, 53);
    let (mut k_cache, mut v_cache) = (vec![f32::NAN; h * s_max * d], vec![f32::NAN; h * s_max * d]);
    let cache_shape = [1, h, s_max, d];
    // Tokens [0, 5) as a prefill chunk, token 5 as a decode step: views into the [1, H, total, D] tensors.
    for (start, len) in [(0, total - 1), (total - 1, 1)] {
        let (shape, strides) = ([1, h, len, d], [h * total * d, total * d, d, 1]);
        let (k, v) =
            (strided_view(&k_all, &shape, &strides, start * d), strided_view(&v_all, &shape, &strides, start * d));
        append(&mut k_cache, &mut v_cache, &cache_shape, k, v, &[start as i32]).unwrap();
    }
    let q_view = || view(&q, &[1, 2 * h, 1, d]);
    let kv_lens = [total as i64];
    let decode = run_checked(
        "attention",
        &[
            q_view(),
            view(&k_cache, &cache_shape),
            view(&v_cache, &cache_shape),
            Some(TensorRef::new(&kv_lens, &[1]).unwrap()),
        ],
        &causal(true),
    );
    let full = run_checked(
        "attention",
        &[q_view(), view(&k_all, &[1, h, total, d]), view(&v_all, &[1, h, total, d]), None],
        &causal(true),
    );
    assert_near(&decode[0], &full[0], 1e-6, "decode after append");
}

/// A position that does not leave room for the new rows fails the launch, naming the sequence,
/// and neither cache changes; shape errors are caught in phase 1.
#[test]
fn kv_cache_append_rejects_overflow_and_bad_shapes() {
    setup();
    let cache_shape = [2, 1, 8, 4];
    let mut k_cache = rand_vec(64, 61);
    let mut v_cache = rand_vec(64, 62);
    let (k0, v0) = (k_cache.clone(), v_cache.clone());
    let new = rand_vec(2 * 3 * 4, 63);
    let new_view = || TensorRef::new(&new, &[2, 1, 3, 4]).unwrap();
    let e = append(&mut k_cache, &mut v_cache, &cache_shape, new_view(), new_view(), &[1, 6]).unwrap_err();
    assert_eq!(e.code(), ErrorCode::Runtime);
    assert!(
        e.message().starts_with("kv_cache_append: argument 'positions': expected values in [0, 5]")
            && e.message().contains("got 6 at position 1"),
        "{e}"
    );
    assert_eq!((k_cache.clone(), v_cache.clone()), (k0, v0), "caches untouched");
    let e = append(&mut k_cache, &mut v_cache, &cache_shape, new_view(), new_view(), &[-1, 0]).unwrap_err();
    assert!(e.message().contains("got -1 at position 0"), "{e}");

    let long = rand_vec(2 * 9 * 4, 64);
    let e = append(
        &mut k_cache,
        &mut v_cache,
        &cache_shape,
        TensorRef::new(&long, &[2, 1, 9, 4]).unwrap(),
        TensorRef::new(&long, &[2, 1, 9, 4]).unwrap(),
        &[0, 0],
    )
    .unwrap_err();
    assert_eq!(e.code(), ErrorCode::Shape);
    assert!(e.message().contains("argument 'k'") && e.message().contains("S_new ≤ 8"), "{e}");
    let e = append(&mut k_cache, &mut v_cache, &cache_shape, new_view(), new_view(), &[0]).unwrap_err();
    assert!(e.message().contains("argument 'positions'") && e.message().contains("[2]"), "{e}");
}
