"""Attention under boolean masks that hide whole tiles — sliding windows and document masks — and
a model that uses one, through uniop and torch's SDPA in the same run.

    .venv/bin/python benches/masked_attention.py [--shape 1,32,2048,128] [--window 512] [--docs 4]
                                                 [--bias-shape 4,8,512,64] [--model-tokens 2048]
                                                 [--model-window 256] [--skip-model]

1. The op: `uniop.attention(q, k, v, causal=True, mask=M)` against plain causal (what the mask's
   skipped tiles save) and against `scaled_dot_product_attention(q, k, v, attn_mask=M)` (SDPA given
   the same mask), forward and backward (`torch.autograd.grad` through `torch.ops.uniop.attention`
   and through SDPA), bf16 and f32. Masks: causal with a window of `--window` keys; `--docs`
   documents of equal length, each causal within itself (boolean); ALiBi's causal biases (a float
   mask of the inputs' dtype, which hides only the tiles above the diagonal: it costs what plain
   causal does plus the bias). Best of 2 rounds (3 for the backward).
2. A learned bias (`--bias-shape`, T5-encoder-like: bidirectional, a `[1, H, S, S]` float mask shared by
   the batch, as T5's relative position bias): the backward with the bias requiring a gradient (dq,
   dk, dv and dmask) against the same backward with a bias that requires none (what the dmask step
   costs) and against SDPA's backward with `attn_mask` requiring a gradient. Best of 3.
3. A model: a tiny random Mistral (hidden 384, 6 layers, 6 query / 2 kv heads, sliding window
   `--model-window`) prefilling `--model-tokens` tokens under transformers' `"sdpa"` attention and
   under `"uniop"` (`uniop.torch.register_attention()`; nothing else patched), alternated, best of 3.
"""

import argparse
import time

import torch
import torch.nn.functional as F

import uniop
import uniop.torch as ut


def best_ms(f, calls, rounds=2):
    f()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            f()
        times.append((time.perf_counter() - t0) / calls * 1e3)
    return min(times)


def grad_ms(out, wrt, calls, rounds=2):
    """Best ms of `out`'s backward into the tensors `wrt` (a random cotangent; the graph kept)."""
    grad = torch.randn_like(out)
    return best_ms(lambda: torch.autograd.grad(out, wrt, grad, retain_graph=True), calls, rounds=rounds)


def masks(heads, seq, window, docs, dtype):
    """Boolean `[1, 1, S, S]` masks, and ALiBi as a float `[1, H, S, S]` mask of `dtype` (causal:
    −inf above the diagonal, −slope_h · (i − j) below, slopes 2^(−8(h+1)/H)). The causal mask
    itself (what a mask costs where it hides nothing the flag does not), and a left padding of a
    quarter of the keys, boolean, as a float mask of 0 and −inf, and as transformers 4.x builds it
    (0 and the dtype's lowest value)."""
    i = torch.arange(seq)
    causal = i[None, :] <= i[:, None]
    slopes = 2.0 ** (-8.0 * torch.arange(1, heads + 1) / heads)
    alibi = -slopes[:, None, None] * (i[:, None] - i[None, :]).float()
    padded = causal & (i[None, :] >= seq // 4)
    padding_bias = torch.zeros(seq, seq).masked_fill(~padded, float("-inf")).to(dtype)
    padding_lowest = torch.zeros(seq, seq, dtype=dtype).masked_fill(~padded, torch.finfo(dtype).min)
    return {
        "causal (boolean)": causal[None, None],
        f"left padding {seq // 4}": padded[None, None],
        f"left padding {seq // 4} (float)": padding_bias[None, None],
        f"left padding {seq // 4} (float, lowest)": padding_lowest[None, None],
        f"causal, window {window}": (causal & (i[None, :] > i[:, None] - window))[None, None],
        f"{docs} documents": (causal & (i[None, :] * docs // seq == i[:, None] * docs // seq))[None, None],
        "ALiBi (float)": alibi.masked_fill(~causal, float("-inf")).to(dtype)[None],
    }


def op_rows(shape, window, docs):
    b, h, s, d = shape
    print("| dtype | mask | pass | uniop masked ms | uniop causal ms | vs causal | SDPA masked ms | vs SDPA |")
    print("|---|---|---|---|---|---|---|---|")
    attention = torch.ops.uniop.attention
    for dtype in (torch.bfloat16, torch.float32):
        q, k, v = (torch.randn(b, h, s, d, dtype=dtype) for _ in range(3))
        causal_fwd = best_ms(lambda: uniop.attention(q, k, v, None, True), 3)
        qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
        out = attention(qq, kk, vv, None, True)[0]
        grad = torch.randn_like(out)
        causal_bwd = best_ms(lambda: torch.autograd.grad(out, (qq, kk, vv), grad, retain_graph=True), 1, rounds=3)
        for name, m in masks(h, s, window, docs, dtype).items():
            ours = best_ms(lambda: uniop.attention(q, k, v, None, True, None, m), 3)
            sdpa = best_ms(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=m), 2)
            print(f"| {dtype} | {name} | forward | {ours:.1f} | {causal_fwd:.1f} | {causal_fwd / ours:.2f}x "
                  f"| {sdpa:.1f} | {sdpa / ours:.2f}x |", flush=True)
            out_m = attention(qq, kk, vv, None, True, None, m)[0]
            ours = best_ms(lambda: torch.autograd.grad(out_m, (qq, kk, vv), grad, retain_graph=True), 1, rounds=3)
            out_s = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=m)
            sdpa = best_ms(lambda: torch.autograd.grad(out_s, (qq, kk, vv), grad, retain_graph=True), 1, rounds=3)
            print(f"| {dtype} | {name} | backward | {ours:.1f} | {causal_bwd:.1f} | {causal_bwd / ours:.2f}x "
                  f"| {sdpa:.1f} | {sdpa / ours:.2f}x |", flush=True)


def bias_rows(shape):
    b, h, s, d = shape
    print("\n| dtype | shape | uniop backward with dmask ms | without ms | dmask's share | SDPA with dmask ms | vs SDPA |")
    print("|---|---|---|---|---|---|---|")
    for dtype in (torch.bfloat16, torch.float32):
        q, k, v = (torch.randn(b, h, s, d, dtype=dtype, requires_grad=True) for _ in range(3))
        bias = torch.randn(1, h, s, s, dtype=dtype, requires_grad=True)
        grad = torch.randn(b, h, s, d, dtype=dtype)

        def backward(out, wrt):
            return lambda: torch.autograd.grad(out, wrt, grad, retain_graph=True)

        out = torch.ops.uniop.attention(q, k, v, None, False, None, bias)[0]
        with_dmask = best_ms(backward(out, (q, k, v, bias)), 1, rounds=3)
        out = torch.ops.uniop.attention(q, k, v, None, False, None, bias.detach())[0]
        without = best_ms(backward(out, (q, k, v)), 1, rounds=3)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        sdpa = best_ms(backward(out, (q, k, v, bias)), 1, rounds=3)
        print(f"| {dtype} | {b}x{h}x{s}x{d} | {with_dmask:.1f} | {without:.1f} | {with_dmask / without - 1:.0%} "
              f"| {sdpa:.1f} | {sdpa / with_dmask:.2f}x |", flush=True)


def model_rows(tokens, window):
    from transformers import MistralConfig, MistralForCausalLM

    print("\n| dtype | prefill tokens | window | sdpa ms | uniop attention ms | speed-up |")
    print("|---|---|---|---|---|---|")
    ids = torch.randint(0, 32000, (1, tokens), generator=torch.Generator().manual_seed(0))
    for dtype in (torch.float32, torch.bfloat16):
        cfg = MistralConfig(
            vocab_size=32000,
            hidden_size=384,
            intermediate_size=1024,
            num_hidden_layers=6,
            num_attention_heads=6,
            num_key_value_heads=2,
            max_position_embeddings=max(4096, tokens),
            sliding_window=window,
        )
        torch.manual_seed(0)
        model = MistralForCausalLM(cfg).to(dtype).eval()
        times = {}
        for _ in range(3):
            for impl in ("sdpa", ut.register_attention()):
                model.set_attn_implementation(impl)
                with torch.no_grad():
                    times.setdefault(impl, []).append(best_ms(lambda: model(ids), 1, rounds=1))
        theirs, ours = min(times["sdpa"]), min(times["uniop"])
        print(f"| {dtype} | {tokens} | {window} | {theirs:.0f} | {ours:.0f} | {theirs / ours:.2f}x |", flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="1,32,2048,128", help="B,H,S,D of q, k and v")
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--docs", type=int, default=4)
    p.add_argument("--bias-shape", default="4,8,512,64", help="B,H,S,D of the learned-bias rows")
    p.add_argument("--model-tokens", type=int, default=2048)
    p.add_argument("--model-window", type=int, default=256)
    p.add_argument("--skip-model", action="store_true")
    args = p.parse_args()
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}\n")
    op_rows([int(x) for x in args.shape.split(",")], args.window, args.docs)
    bias_rows([int(x) for x in args.bias_shape.split(",")])
    if not args.skip_model:
        model_rows(args.model_tokens, args.model_window)


if __name__ == "__main__":
    main()
