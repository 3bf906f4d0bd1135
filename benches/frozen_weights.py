"""A Llama MLP's training step with its weights trainable and frozen (LoRA fine-tuning's base MLP,
gradients only for the activations), uniop against torch, in the same run.

    .venv/bin/python benches/frozen_weights.py [--rows 1024] [--hidden 1024] [--intermediate 2816]
                                               [--dtype f32] [--rounds 5]

uniop: ``linear(linear_silu_mul_train(x, gate, up).y, down)``, whose backwards take ``needs_d<arg>``
from autograd (a frozen weight's gradient is left out: ``linear_silu_mul_backward`` skips its two
weight products, ``linear_backward`` its one). torch: ``F.linear(F.silu(F.linear(x, gate)) *
F.linear(x, up), down)``, whose autograd leaves out the same products. Best of ``--rounds`` calls of
forward + backward, in milliseconds; x always requires a gradient (a later layer's input).
"""

import argparse

import torch
import torch.nn.functional as F

import uniop.torch  # noqa: F401  (registers torch.ops.uniop)
from masked_attention import best_ms

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}


def step(mlp, x, weights):
    out = mlp(x, *weights)
    torch.autograd.grad(out, [x] + [w for w in weights if w.requires_grad], torch.ones_like(out))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--intermediate", type=int, default=2816)
    p.add_argument("--dtype", choices=DTYPES, default="f32")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    torch.manual_seed(0)
    dtype = DTYPES[args.dtype]
    x = torch.randn(args.rows, args.hidden, dtype=dtype, requires_grad=True)
    shapes = [(args.intermediate, args.hidden)] * 2 + [(args.hidden, args.intermediate)]
    base = [torch.randn(s, dtype=dtype) / s[1] ** 0.5 for s in shapes]
    ops = torch.ops.uniop
    mlps = {
        "uniop": lambda x, g, u, d: ops.linear(ops.linear_silu_mul_train(x, g, u)[0], d),
        "torch": lambda x, g, u, d: F.linear(F.silu(F.linear(x, g)) * F.linear(x, u), d),
    }
    print(f"rows {args.rows}, hidden {args.hidden}, intermediate {args.intermediate}, {args.dtype}, "
          f"{torch.get_num_threads()} threads; forward + backward, best of {args.rounds}, ms\n")
    print("| weights | uniop | torch | uniop vs torch |\n|---|---|---|---|")
    for frozen in (False, True):
        weights = [w.clone().requires_grad_(not frozen) for w in base]
        ms = {name: best_ms(lambda: step(mlp, x, weights), 1, rounds=args.rounds) for name, mlp in mlps.items()}
        label = "frozen (LoRA base)" if frozen else "trainable"
        print(f"| {label} | {ms['uniop']:.2f} | {ms['torch']:.2f} | {ms['torch'] / ms['uniop']:.2f}x |")


if __name__ == "__main__":
    main()
