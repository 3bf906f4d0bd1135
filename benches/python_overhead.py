"""Per-call overhead of uniop from Python on a tiny tensor, with the peers in the same run.

    .venv/bin/python benches/python_overhead.py

Rows: uniop.<op> (torch and NumPy inputs), torch.ops.uniop.<op> (torch.library define/impl
route, with and without an autograd registration), a @torch.library.custom_op wrapping the same
torch math (the route uniop avoids), and plain torch eager; then calls that record a graph node
(inputs requiring a gradient) and whole tiny training steps, ``op(x).sum().backward()``, against
torch's own ops. Best of 7 repeats, microseconds.
"""

import timeit

import numpy as np
import torch

import uniop
import uniop.torch  # noqa: F401

torch.set_num_threads(1)


@torch.library.custom_op("uniop_bench::silu", mutates_args=())
def custom_silu(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.silu(x)


@custom_silu.register_fake
def _(x):
    return torch.empty_like(x)


def training_step(op, *args):
    def step():
        out = op(*args)
        (out[0] if isinstance(out, tuple) else out).sum().backward()

    return step


def per_call_us(fn, number=20000):
    fn()
    return min(timeit.repeat(fn, number=number, repeat=7)) / number * 1e6


def main():
    x, w = torch.randn(1, 16), torch.ones(16)
    xn, wn = x.numpy(), w.numpy()
    rows = [
        ("uniop.silu (torch)", lambda: uniop.silu(x)),
        ("uniop.silu (numpy)", lambda: uniop.silu(xn)),
        ("uniop.rms_norm (torch)", lambda: uniop.rms_norm(x, w)),
        ("uniop.rms_norm (numpy)", lambda: uniop.rms_norm(xn, wn)),
        ("torch.ops.uniop.silu (no autograd)", lambda: torch.ops.uniop.silu(x)),
        ("torch.ops.uniop.rms_norm (autograd registered)", lambda: torch.ops.uniop.rms_norm(x, w)),
        ("@custom_op silu (peer)", lambda: custom_silu(x)),
        ("torch F.silu eager (peer)", lambda: torch.nn.functional.silu(x)),
        ("torch F.rms_norm eager (peer)", lambda: torch.nn.functional.rms_norm(x, (16,), w, 1e-6)),
    ]
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    rms_norm = lambda x, w: torch.nn.functional.rms_norm(x, (16,), w, 1e-6)  # noqa: E731
    rows += [
        ("torch.ops.uniop.silu recording a graph node", lambda: torch.ops.uniop.silu(xg)),
        ("torch F.silu recording a graph node (peer)", lambda: torch.nn.functional.silu(xg)),
        ("training step through torch.ops.uniop.silu", training_step(torch.ops.uniop.silu, xg)),
        ("training step through torch F.silu (peer)", training_step(torch.nn.functional.silu, xg)),
        ("training step through torch.ops.uniop.rms_norm", training_step(torch.ops.uniop.rms_norm, xg, wg)),
        ("training step through torch F.rms_norm (peer)", training_step(rms_norm, xg, wg)),
    ]
    print(f"| call on a [1, 16] float32 tensor | µs per call |\n|---|---|")
    for name, fn in rows:
        print(f"| {name} | {per_call_us(fn, 2000 if 'training step' in name else 20000):.2f} |")


if __name__ == "__main__":
    main()
