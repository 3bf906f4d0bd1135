"""Decode-shaped linears (1 and 4 rows) through uniop and torch in the same run.

    .venv/bin/python benches/decode_linear.py [--rows 1,4]

`--rows 512` times the prefill-sized product instead (on an AVX2-only CPU, where torch's bf16 GEMM
is slow, uniop's bf16 GEMM ran the tiny Llama's 1152 x 384 projection several times faster).

`uniop.linear(x, w)` against `torch.nn.functional.linear` for f32 and bf16 weights in HF's
`[out, in]` layout: a 7B MLP projection (11008 x 4096, out of cache) and the tiny Llama's fused
QKV-sized one (1152 x 384, in cache). Reports ms per call, the weight bandwidth (bytes of the
weight over the time) and uniop's speed-up. Mean of a fixed number of calls after one warm-up.
"""

import argparse
import time

import torch

import uniop


def per_call(fn, calls):
    fn()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t) / calls


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rows", default="1,4", help="comma-separated row counts")
    row_counts = [int(r) for r in p.parse_args().rows.split(",")]
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}\n")
    print("| dtype | rows | weight | uniop ms | GB/s | torch ms | GB/s | speed-up |")
    print("|---|---|---|---|---|---|---|---|")
    for dtype in (torch.bfloat16, torch.float32):
        for n, k in ((11008, 4096), (1152, 384)):
            for rows in row_counts:
                x, w = torch.randn(rows, k).to(dtype), torch.randn(n, k).to(dtype)
                calls = max(3, min(2000, int(2e9 / (rows * n * k))))
                ours = per_call(lambda: uniop.linear(x, w), calls)
                theirs = per_call(lambda: torch.nn.functional.linear(x, w), calls)
                gb = n * k * x.element_size() / 1e9
                name = str(dtype).removeprefix("torch.")
                print(
                    f"| {name} | {rows} | {n}x{k} | {ours * 1e3:.3f} | {gb / ours:.1f} | {theirs * 1e3:.3f} | "
                    f"{gb / theirs:.1f} | {theirs / ours:.2f}x |"
                )


if __name__ == "__main__":
    main()
