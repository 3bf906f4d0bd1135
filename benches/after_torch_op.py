"""A uniop op inside a torch program: alone, and right after a torch GEMM, with torch's peer op.

    .venv/bin/python benches/after_torch_op.py [--shape 512,384] [--iters 300]

torch runs its parallel ops on OpenMP threads that keep spinning for a while after each region;
uniop runs its blocks on its own pool. Right after a torch op, uniop's worker has to share a core
with a spinning OpenMP thread, while torch's next op reuses the threads that are already spinning.
This prints, for rms_norm on a Llama-prefill-sized activation ([512, 384] f32 by default), the
op's time alone and right after `torch.mm` ([512, 384] x [384, 1024]), for uniop
(`torch.ops.uniop.rms_norm`) and torch (`F.rms_norm`): min and median microseconds over --iters.
"""

import argparse
import time

import torch
import torch.nn.functional as F

import uniop.torch  # noqa: F401


def timings(op, before, iters):
    """Microseconds of `op()` (min, median), each call right after `before()` (untimed)."""
    for _ in range(20):
        before()
        op()
    times = []
    for _ in range(iters):
        before()
        start = time.perf_counter()
        op()
        times.append(time.perf_counter() - start)
    times.sort()
    return times[0] * 1e6, times[len(times) // 2] * 1e6


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="512,384")
    p.add_argument("--iters", type=int, default=300)
    a = p.parse_args()
    rows, cols = map(int, a.shape.split(","))
    x, w = torch.randn(rows, cols), torch.randn(cols)
    lhs, rhs = torch.randn(rows, cols), torch.randn(cols, 1024)
    ops = {
        "uniop rms_norm": lambda: torch.ops.uniop.rms_norm(x, w, 1e-6),
        "torch F.rms_norm": lambda: F.rms_norm(x, (cols,), w, 1e-6),
    }
    settings = {"alone": lambda: None, "right after torch.mm": lambda: torch.mm(lhs, rhs)}
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, x [{rows}, {cols}] f32\n")
    print("| op | when | min µs | median µs |\n|---|---|---|---|")
    for name, op in ops.items():
        for when, before in settings.items():
            best, median = timings(op, before, a.iters)
            print(f"| {name} | {when} | {best:.1f} | {median:.1f} |")


if __name__ == "__main__":
    main()
