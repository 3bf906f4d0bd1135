#!/usr/bin/env python3
"""uniop vs PyTorch on the same machine, in the same run.

Runs `uniop bench --json` (uniop's kernels plus a STREAM probe), then times PyTorch eager and
torch.compile (Inductor) on the same ops, shapes and dtypes with preallocated-free warm tensors,
best-of-N, and prints one markdown table of times and ratios. The peer implementations below are
what a PyTorch user writes today (HF LlamaRMSNorm semantics, F.silu, a + alpha*b).

Usage: python benches/torch_peer.py [--ops rms_norm,silu,add] [--dtypes f32,bf16] [--iters 20]
Needs torch (see scripts/bench-venv.sh); not part of the test suite.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DTYPES = {"f32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
          "f16": torch.float16, "float16": torch.float16}


def rms_norm(x, w, eps=1e-6):
    # HF LlamaRMSNorm: compute in f32, cast back, scale.
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope(x, cos, sin):
    # HF apply_rotary_pos_emb on [B, N, S, D] with [S, D] tables.
    return x * cos + rotate_half(x) * sin


def add_rms_norm(x, r, w):
    h = x + r
    return rms_norm(h, w), h


def swiglu(x):
    a, b = x.chunk(2, dim=-1)
    return F.silu(a) * b


PEERS = {
    "rms_norm": (lambda shape, dt: (torch.randn(shape, dtype=dt), torch.randn(shape[-1:], dtype=dt)), rms_norm),
    "silu": (lambda shape, dt: (torch.randn(shape, dtype=dt),), F.silu),
    "add": (lambda shape, dt: (torch.randn(shape, dtype=dt), torch.randn(shape, dtype=dt)), lambda a, b: a + b),
    "silu_mul": (lambda shape, dt: (torch.randn(shape, dtype=dt), torch.randn(shape, dtype=dt)),
                 lambda g, u: F.silu(g) * u),
    "swiglu": (lambda shape, dt: (torch.randn(shape, dtype=dt),), swiglu),
    "softmax": (lambda shape, dt: (torch.randn(shape, dtype=dt),), lambda x: torch.softmax(x, -1)),
    "log_softmax": (lambda shape, dt: (torch.randn(shape, dtype=dt),), lambda x: torch.log_softmax(x, -1)),
    "matmul": (lambda shape, dt: (torch.randn(shape, dtype=dt), torch.randn((shape[-1], shape[-1]), dtype=dt)),
               torch.matmul),
    "rope": (lambda shape, dt: (torch.randn(shape, dtype=dt), torch.randn(shape[-2:], dtype=dt),
                                torch.randn(shape[-2:], dtype=dt)), rope),
    # Causal prefill, as uniop's example (MHA at the default shape).
    "attention": (lambda shape, dt: tuple(torch.randn(shape, dtype=dt) for _ in range(3)),
                  lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)),
    "add_rms_norm": (lambda shape, dt: (torch.randn(shape, dtype=dt), torch.randn(shape, dtype=dt),
                                        torch.randn(shape[-1:], dtype=dt)), add_rms_norm),
}


def best_ms(fn, args, iters):
    fn(*args)
    fn(*args)
    best = float("inf")
    for _ in range(iters):
        t0 = time.perf_counter()
        fn(*args)
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--ops", default="rms_norm")
    p.add_argument("--dtypes", default="f32,bf16")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--uniop", default=os.path.join(ROOT, "target", "release", "uniop"))
    args = p.parse_args()

    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        subprocess.run([args.uniop, "bench", "--ops", args.ops, "--dtypes", args.dtypes, "--iters", str(args.iters),
                        "--json", f.name], check=True, stdout=sys.stderr)
        ours = json.load(open(f.name))

    torch.set_num_threads(os.cpu_count())
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"STREAM scale {ours['stream_scale_gbs']:.1f} GB/s, scale non-temporal {ours['stream_scale_nt_gbs']:.1f} GB/s, triad {ours['stream_triad_gbs']:.1f} GB/s\n")
    print("| op | dtype | shape | uniop ms | torch eager ms | torch.compile ms | vs eager | vs compile | uniop GB/s "
          "| % of scale | % of scale NT |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in ours["results"]:
        make, fn = PEERS[r["op"]]
        inputs = make(tuple(r["shape"]), DTYPES[r["dtype"]])
        eager = best_ms(fn, inputs, args.iters)
        compiled = torch.compile(fn, dynamic=False)
        comp = best_ms(compiled, inputs, args.iters)
        shape = "x".join(map(str, r["shape"]))
        print(f"| {r['op']} | {r['dtype']} | {shape} | {r['ms']:.3f} | {eager:.3f} | {comp:.3f} | "
              f"{eager / r['ms']:.2f}x | {comp / r['ms']:.2f}x | {r['gbs']:.1f} | "
              f"{100 * r['gbs'] / ours['stream_scale_gbs']:.0f}% | {100 * r['gbs'] / ours['stream_scale_nt_gbs']:.0f}% |")


if __name__ == "__main__":
    main()
