"""Attention with sinks (GPT-OSS's learned per-head sink logits) through uniop and what a torch user
has for it, in the same run.

    .venv/bin/python benches/sinks_attention.py [--shape 1,64,8,2048,64] [--window 128] [--rounds 2]

torch's `scaled_dot_product_attention` has no sinks, so transformers runs GPT-OSS on its eager
attention on CPU: the `Sq x Sk` scores whole, the mask added, each head's sink concatenated as one more
column, the row max subtracted, a softmax, the sink column dropped, the product with V. The peers, on
a GQA causal prefill of `--shape` (B, Hq, Hkv, S, D; GPT-OSS 20B's heads and head dim by default),
plain causal and under GPT-OSS's sliding window (`--window` keys, its even layers), and the backward
(`torch.autograd.grad` of q, k, v and the sinks):
1. that eager composite (GPT-OSS's `eager_attention_forward`, with the additive mask transformers
   builds for it);
2. the same composite under `torch.compile` (Inductor).
uniop: `torch.ops.uniop.attention(q, k, v, None, True, scale, mask, None, sinks)` (GQA read in place;
the window as a boolean mask, whose hidden key tiles it skips), and the same call without sinks (what
they cost). Best of `--rounds` x 2 calls; bf16 and f32.
"""

import argparse

import torch
import torch._functorch.config

import uniop.torch  # noqa: F401  (registers torch.ops.uniop)
from masked_attention import best_ms, grad_ms


def eager(q, k, v, mask, scale, sinks):
    """GPT-OSS's eager attention (transformers' modeling_gpt_oss.eager_attention_forward)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = torch.matmul(q, k.transpose(2, 3)) * scale + mask
    sinks = sinks.reshape(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[-2], -1)
    logits = torch.cat([s, sinks], dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    p = torch.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1]
    return torch.matmul(p.to(v.dtype), v)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="1,64,8,2048,64", help="B,Hq,Hkv,S,D")
    p.add_argument("--window", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2)
    a = p.parse_args()
    b, hq, hkv, s, d = (int(x) for x in a.shape.split(","))
    scale = d**-0.5
    # The backward is timed on one graph, called again (retain_graph): Inductor's donated buffers
    # forbid that where the compiled backward frees its saved tensors.
    torch._functorch.config.donated_buffer = False
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, q [{b}, {hq}, {s}, {d}], kv heads {hkv}, "
          f"window {a.window}\n")
    print("| dtype | mask | pass | uniop ms | uniop sinkless ms | sinks' cost | eager ms | vs eager | compile ms "
          "| vs compile |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    errors_seen = []
    attention = torch.ops.uniop.attention
    i = torch.arange(s)
    masks = {"causal": i[None, :] <= i[:, None]}
    masks[f"window {a.window}"] = masks["causal"] & (i[:, None] - i[None, :] < a.window)
    for dtype in (torch.bfloat16, torch.float32):
        q, k, v = (torch.randn(b, h, s, d, dtype=dtype) for h in (hq, hkv, hkv))
        sinks = torch.randn(hq, dtype=dtype)  # from a share of ~none to most of a softmax
        for mask_name, keep in masks.items():
            additive = torch.zeros(s, s, dtype=dtype).masked_fill(~keep, torch.finfo(dtype).min)
            # Plain causal needs no mask on uniop (the flag skips the tiles above the diagonal).
            bool_mask = None if mask_name == "causal" else keep
            peers = {
                "uniop": lambda q, k, v, sk: attention(q, k, v, None, True, scale, bool_mask, None, sk)[0],
                "sinkless": lambda q, k, v, sk: attention(q, k, v, None, True, scale, bool_mask)[0],
                "eager": lambda q, k, v, sk: eager(q, k, v, additive, scale, sk),
                "compile": torch.compile(lambda q, k, v, sk: eager(q, k, v, additive, scale, sk)),
            }
            # Each peer's largest error against the composite in float64 (on the first kv head's
            # group, which keeps the float64 scores small): uniop's may be no worse than eager's own.
            group = (q[:, : hq // hkv], k[:, :1], v[:, :1], sinks[: hq // hkv])
            want = eager(*(x.double() for x in group[:3]), additive.double(), scale, group[3].double())
            with_sinks = {name: f for name, f in peers.items() if name != "sinkless"}
            errors = {name: (f(*group).double() - want).abs().max().item() for name, f in with_sinks.items()}
            errors_seen.append(f"{dtype} {mask_name}: " + ", ".join(f"{n} {e:.1e}" for n, e in errors.items()))
            assert errors["uniop"] <= max(errors["eager"], 1e-4), errors
            qg, kg, vg, sg = (x.clone().requires_grad_() for x in (q, k, v, sinks))
            for pass_ in ("forward", "backward"):
                ms = {}
                for name, f in peers.items():
                    if pass_ == "forward":
                        with torch.no_grad():
                            ms[name] = best_ms(lambda: f(q, k, v, sinks), 2, rounds=a.rounds)
                        continue
                    wrt = (qg, kg, vg) if name == "sinkless" else (qg, kg, vg, sg)
                    ms[name] = grad_ms(f(qg, kg, vg, sg), wrt, 2, rounds=a.rounds)
                u = ms["uniop"]
                print(f"| {dtype} | {mask_name} | {pass_} | {u:.1f} | {ms['sinkless']:.1f} "
                      f"| {u / ms['sinkless'] - 1:+.0%} | {ms['eager']:.1f} | {ms['eager'] / u:.2f}x "
                      f"| {ms['compile']:.1f} | {ms['compile'] / u:.2f}x |", flush=True)
    print("\nLargest error against the float64 composite: " + "; ".join(errors_seen))


if __name__ == "__main__":
    main()
