"""Decode-step attention (one new query per sequence against a KV cache) through uniop and
torch's SDPA in the same run.

    .venv/bin/python benches/decode_attention.py [--lens 512,2048,4096]

q `[1, Hq, 1, D]` against the first `len` positions of preallocated `[1, Hkv, capacity, D]` K and
V buffers (what a growing cache hands attention: views with a capacity stride), GQA for both
geometries: the tiny Llama of `llama_patch.py` (6 q / 2 kv heads, D 64) and a Llama-3-8B layer
(32 q / 8 kv heads, D 128). uniop.attention (causal, bottom-right: the last query sees every key)
against `scaled_dot_product_attention(..., enable_gqa=True)`; reports µs per call, the K/V bytes
read over the time, and uniop's speed-up. Mean of a fixed number of calls after one warm-up.
"""

import argparse

import torch
from decode_linear import per_call

import uniop


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--lens", default="512,2048,4096", help="comma-separated key counts")
    lens = [int(n) for n in p.parse_args().lens.split(",")]
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}\n")
    print("| dtype | heads (q/kv) x dim | keys | uniop µs | GB/s | SDPA µs | GB/s | speed-up |")
    print("|---|---|---|---|---|---|---|---|")
    sdpa = torch.nn.functional.scaled_dot_product_attention
    for dtype in (torch.bfloat16, torch.float32):
        for hq, hkv, d in ((6, 2, 64), (32, 8, 128)):
            capacity = max(lens)
            kbuf, vbuf = (torch.randn(1, hkv, capacity, d).to(dtype) for _ in range(2))
            q = torch.randn(1, hq, 1, d).to(dtype)
            for n in lens:
                k, v = kbuf[:, :, :n], vbuf[:, :, :n]
                calls = max(20, min(2000, int(4e8 / (hkv * n * d))))
                ours = per_call(lambda: uniop.attention(q, k, v, None, True), calls)
                theirs = per_call(lambda: sdpa(q, k, v, enable_gqa=True), calls)
                gb = 2 * hkv * n * d * q.element_size() / 1e9
                name = str(dtype).removeprefix("torch.")
                print(
                    f"| {name} | {hq}/{hkv} x {d} | {n} | {ours * 1e6:.1f} | {gb / ours:.1f} | {theirs * 1e6:.1f} | "
                    f"{gb / theirs:.1f} | {theirs / ours:.2f}x |"
                )


if __name__ == "__main__":
    main()
