"""Weight-only int8 linear layers (`linear_int8`) against what a torch user has for them, in the same run.

    .venv/bin/python benches/int8_linear.py [--k 4096] [--n 11008] [--rows 1,4,32,128] [--rounds 3]

An int8 weight `[n, k]` quantized per output feature and x `[rows, k]` (decode: one row per sequence;
prefill: many). Peers, per dtype (bf16, f32):
1. `torch.ops.aten._weight_int8pack_mm(x, w, scales)`: torch's CPU kernel for weight-only int8
   (what torchao's `int8_weight_only` and Inductor's weight-only-quantization pattern call);
2. the dequantizing composite a model file writes, `F.linear(x, w.to(x.dtype) * scales[:, None])`,
   eager and under `torch.compile` (Inductor);
3. the unquantized layer: `F.linear` and `uniop.linear` on the dense weight of x's dtype — the
   bytes an int8 weight saves.
Each call's largest error against the float64 product is printed; uniop's must be no worse than the
worst of the others' twice over. Best of `--rounds` series of 20 calls (4 rows or fewer) or 3,
milliseconds; "weight GB/s" counts the int8 weight once.

Then training through the frozen int8 layer (QLoRA's base: x needs a gradient, the weight and scales
none), `--train-rows` rows: forward and backward of `torch.ops.uniop.linear_int8` under autograd
against the dequantizing composite's autograd, eager and compiled, and `uniop.linear` on the dense
weight (frozen too); f32 only unless `--train-bf16`, since torch's bf16 `dy @ weight` took seconds
on AVX2 CPUs without AVX512-BF16 (5.1 s for 16 rows by `[11008, 4096]`).
"""

import argparse

import torch
import torch.nn.functional as F

import uniop.torch  # noqa: F401  (registers torch.ops.uniop)
from masked_attention import best_ms


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--k", type=int, default=4096)
    p.add_argument("--n", type=int, default=11008)
    p.add_argument("--rows", default="1,4,32,128")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--train-rows", type=int, default=512)
    p.add_argument("--train-bf16", action="store_true")
    a = p.parse_args()
    k, n = a.k, a.n
    torch.manual_seed(0)
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, weight int8 [{n}, {k}]\n")
    print("| dtype | rows | uniop ms | weight GB/s | _weight_int8pack_mm ms | vs it | composite ms | vs it "
          "| compiled ms | vs it | dense F.linear ms | vs it | dense uniop.linear ms | vs it |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    errors_seen = []
    for dtype in (torch.bfloat16, torch.float32):
        scales = (torch.rand(n) * 0.02 + 0.001).to(dtype)
        dense = w.to(dtype) * scales[:, None]
        composite = lambda x: F.linear(x, w.to(x.dtype) * scales[:, None])  # noqa: E731
        compiled = torch.compile(composite)
        for rows in (int(r) for r in a.rows.split(",")):
            x = torch.randn(rows, k).to(dtype)
            peers = {
                "uniop": lambda: torch.ops.uniop.linear_int8(x, w, scales),
                "int8pack": lambda: torch.ops.aten._weight_int8pack_mm(x, w, scales),
                "composite": lambda: composite(x),
                "compiled": lambda: compiled(x),
                "dense": lambda: F.linear(x, dense),
                "dense uniop": lambda: torch.ops.uniop.linear(x, dense),
            }
            want = x.double() @ (w.double() * scales.double()[:, None]).t()
            with torch.no_grad():
                errors = {name: (f().double() - want).abs().max().item() for name, f in peers.items()}
                # f32 sums in another order than torch's: within twice the worst of the others.
                assert errors["uniop"] <= 2 * max(e for m, e in errors.items() if m != "uniop"), errors
                errors_seen.append(f"{dtype} x {rows}: " + ", ".join(f"{m} {e:.1e}" for m, e in errors.items()))
                # Decode calls are short: more of them, so that torch's OpenMP threads, spinning for a
                # while after each torch op, cost the first uniop call of a series no more than noise.
                calls = 20 if rows <= 4 else 3
                ms = {name: best_ms(f, calls, rounds=a.rounds) for name, f in peers.items()}
            u = ms["uniop"]
            cols = " | ".join(f"{ms[m]:.3f} | {ms[m] / u:.2f}x" for m in ("int8pack", "composite", "compiled", "dense",
                                                                          "dense uniop"))
            print(f"| {dtype} | {rows} | {u:.3f} | {n * k / u / 1e6:.1f} | {cols} |", flush=True)
    print("\nLargest error against the float64 product: " + "; ".join(errors_seen))
    train(w, a)


def train(w, a):
    """Forward and backward through the frozen layer, gradient of x only, against the peers."""
    n, k = w.shape
    print(f"\nTraining through the frozen layer: x [{a.train_rows}, {k}] needs a gradient (forward + backward)\n")
    print("| dtype | uniop ms | composite ms | vs it | compiled ms | vs it | dense uniop.linear ms | vs it |")
    print("|---|---|---|---|---|---|---|---|")
    for dtype in (torch.bfloat16, torch.float32) if a.train_bf16 else (torch.float32,):
        scales = (torch.rand(n) * 0.02 + 0.001).to(dtype)
        dense = w.to(dtype) * scales[:, None]
        composite = lambda x: F.linear(x, w.to(x.dtype) * scales[:, None])  # noqa: E731
        compiled = torch.compile(composite)
        x = torch.randn(a.train_rows, k).to(dtype).requires_grad_()
        dy = torch.randn(a.train_rows, n).to(dtype)
        layers = {
            "uniop": lambda x: torch.ops.uniop.linear_int8(x, w, scales),
            "composite": composite,
            "compiled": compiled,
            "dense uniop": lambda x: torch.ops.uniop.linear(x, dense),
        }
        want = dy.double() @ (w.double() * scales.double()[:, None])
        ms, errors = {}, {}
        for name, layer in layers.items():
            def step(layer=layer):
                x.grad = None
                layer(x).backward(dy)
            step()
            errors[name] = (x.grad.double() - want).abs().max().item()
            ms[name] = best_ms(step, 1, rounds=a.rounds)
        assert errors["uniop"] <= 2 * max(e for m, e in errors.items() if m != "uniop"), errors
        u = ms["uniop"]
        cols = " | ".join(f"{ms[m]:.1f} | {ms[m] / u:.2f}x" for m in ("composite", "compiled", "dense uniop"))
        print(f"| {dtype} | {u:.1f} | {cols} |", flush=True)
        largest = ", ".join(f"{m} {e:.1e}" for m, e in errors.items())
        print(f"\nLargest error of dx against the float64 product: {largest}")


if __name__ == "__main__":
    main()
