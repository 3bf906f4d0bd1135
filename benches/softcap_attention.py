"""Soft-capped attention (Gemma 2's attention logit soft-capping) through uniop and what a torch user
has for it, in the same run.

    .venv/bin/python benches/softcap_attention.py [--shape 1,8,4,2048,256] [--softcap 50] [--rounds 2]

torch's `scaled_dot_product_attention` has no soft-capping, so transformers runs Gemma 2 on its eager
attention: the `Sq x Sk` scores whole, `softcap * tanh(scores / softcap)`, the causal mask added, a
float32 softmax, the product with V. The peers, on a GQA causal prefill of `--shape` (B, Hq, Hkv, S,
D; Gemma 2 2B's heads and head dim by default) and its backward (`torch.autograd.grad` of q, k, v):
1. that eager composite (Gemma 2's `eager_attention_forward`, with the additive causal mask
   transformers builds for it);
2. the same composite under `torch.compile` (Inductor);
3. `flex_attention` with a `tanh` score_mod and a causal block mask, compiled (what torch
   documents for soft-capping), where this torch runs it on CPU (the forward only: it has no CPU
   backward).
uniop: `torch.ops.uniop.attention(q, k, v, None, True, scale, None, softcap)` (GQA read in place),
and the same call without the cap (what the cap costs). Best of `--rounds` x 2 calls; bf16 and f32.
"""

import argparse

import torch

import uniop.torch  # noqa: F401  (registers torch.ops.uniop)
from masked_attention import best_ms, grad_ms


def eager(q, k, v, mask, scale, softcap):
    """Gemma 2's eager attention (transformers' modeling_gemma2.eager_attention_forward)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = torch.matmul(q, k.transpose(2, 3)) * scale
    s = torch.tanh(s / softcap) * softcap
    p = torch.softmax(s + mask, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(p, v)


def flex_peer(shape, softcap, scale):
    """Compiled flex_attention with a tanh score_mod and a causal block mask, or None where this
    torch has none for CPU."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError:
        return None
    b, h, _, s, _ = shape

    def cap(score, b, h, q_idx, kv_idx):
        return softcap * torch.tanh(score / softcap)

    block_mask = create_block_mask(lambda b, h, q, kv: q >= kv, None, None, s, s, device="cpu")
    compiled = torch.compile(flex_attention)
    return lambda q, k, v: compiled(q, k, v, score_mod=cap, block_mask=block_mask, scale=scale, enable_gqa=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="1,8,4,2048,256", help="B,Hq,Hkv,S,D")
    p.add_argument("--softcap", type=float, default=50.0)
    p.add_argument("--rounds", type=int, default=2)
    a = p.parse_args()
    shape = [int(x) for x in a.shape.split(",")]
    b, hq, hkv, s, d = shape
    scale = d**-0.5
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, q [{b}, {hq}, {s}, {d}], kv heads {hkv}, "
          f"softcap {a.softcap}\n")
    print("| dtype | pass | uniop ms | uniop uncapped ms | cap's cost | eager ms | vs eager | compile ms "
          "| vs compile | flex ms | vs flex |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    flex = flex_peer(shape, a.softcap, scale)
    errors_seen = []
    attention = torch.ops.uniop.attention
    for dtype in (torch.bfloat16, torch.float32):
        q = torch.randn(b, hq, s, d, dtype=dtype) * 4  # scores of deviation ~4: the cap bends some
        k, v = torch.randn(b, hkv, s, d, dtype=dtype), torch.randn(b, hkv, s, d, dtype=dtype)
        i = torch.arange(s)
        mask = torch.zeros(s, s, dtype=dtype).masked_fill(i[None, :] > i[:, None], torch.finfo(dtype).min)
        peers = {
            "uniop": lambda q, k, v: attention(q, k, v, None, True, scale, None, a.softcap)[0],
            "uncapped": lambda q, k, v: attention(q, k, v, None, True, scale)[0],
            "eager": lambda q, k, v: eager(q, k, v, mask, scale, a.softcap),
            "compile": torch.compile(lambda q, k, v: eager(q, k, v, mask, scale, a.softcap)),
        }
        if flex is not None:
            peers["flex"] = flex
        # Each peer's largest error against the composite in float64: uniop's may be no worse than
        # eager's own (bf16 rounds the scores, of magnitude ~10 here, to ~0.06).
        want = eager(q.double(), k.double(), v.double(), mask.double(), scale, a.softcap)
        capped = {name: f for name, f in peers.items() if name != "uncapped"}
        errors = {name: (f(q, k, v).double() - want).abs().max().item() for name, f in capped.items()}
        errors_seen.append(f"{dtype}: " + ", ".join(f"{name} {err:.1e}" for name, err in errors.items()))
        assert errors["uniop"] <= max(errors["eager"], 1e-4), errors
        qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
        for pass_ in ("forward", "backward"):
            ms = {}
            for name, f in peers.items():
                if pass_ == "backward" and name == "flex":
                    continue  # FlexAttention has no backward on CPU
                if pass_ == "forward":
                    with torch.no_grad():
                        ms[name] = best_ms(lambda: f(q, k, v), 2, rounds=a.rounds)
                else:
                    ms[name] = grad_ms(f(qg, kg, vg), (qg, kg, vg), 2, rounds=a.rounds)
            u = ms["uniop"]
            flex_cols = f"{ms['flex']:.1f} | {ms['flex'] / u:.2f}x" if "flex" in ms else "- | -"
            print(f"| {dtype} | {pass_} | {u:.1f} | {ms['uncapped']:.1f} | {u / ms['uncapped'] - 1:+.0%} "
                  f"| {ms['eager']:.1f} | {ms['eager'] / u:.2f}x | {ms['compile']:.1f} | {ms['compile'] / u:.2f}x "
                  f"| {flex_cols} |", flush=True)
    print("\nLargest error against the float64 composite: " + "; ".join(errors_seen))


if __name__ == "__main__":
    main()
