"""Tiny Llama training steps on CPU, transformers' own modules vs uniop.torch.patch_llama, in one run.

    .venv/bin/python benches/llama_train.py [--layers 6] [--batch 4] [--seq 128] [--steps 3] [--rounds 3]
                                            [--family Llama|Mistral|Qwen2|Qwen3|Phi3|Gemma|Gemma2|Gemma3|Mixtral|
                                                      Qwen2Moe|Qwen3Moe|GptOss]

The random LlamaForCausalLM of benches/llama_patch.py (hidden 384, GQA 6 query / 2 kv heads, built
offline from a config; or its sizes as another family's model, ``--family``) in train mode: one step
is the forward with labels (the causal-LM loss), its backward, and a fused AdamW update (the default
optimizer of transformers' Trainer with torch >= 2.8). fp32, bf16 (weights and activations in bf16,
as a bf16 fine-tune runs without autocast) and mixed precision (fp32 weights, the forward under bf16
autocast); unpatched and patched alternating for --rounds, each timing --steps steps from the same
weights and keeping the best. Prints a markdown table of ms per step with the patched/unpatched
ratio (best figures, and the median of each round's own ratio), and the largest difference between
the two versions' first-step losses and weight gradients.
"""

import argparse
import copy
import statistics
import time

import llama_patch  # benches/llama_patch.py: the same model
import torch

import uniop.torch as ut


def build(layers, dtype, family):
    return llama_patch.build(layers, dtype, family).train()


def train(model, ids, steps, patch, autocast):
    """Best ms per step over `steps` steps of a fresh copy of `model` (patched with
    `patch_llama(copy)` if `patch`: its attention, linear layers and loss too, not only the
    classes' modules; its forward under bf16 autocast if `autocast`); the first step's loss and
    gradients."""
    model = copy.deepcopy(model)
    if patch:
        ut.patch_llama(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    best, first = float("inf"), None
    for step in range(steps + 1):  # the first step also warms up
        t = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if step == 0:
            first = (loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step:
            best = min(best, time.perf_counter() - t)
    return best * 1e3, first


def difference(a, b):
    """The largest absolute difference of the losses, and of the gradients relative to each one's largest value."""
    loss = (a[0].float() - b[0].float()).abs().item()
    grads = max(
        ((a[1][n].float() - b[1][n].float()).abs().max() / a[1][n].float().abs().max().clamp_min(1e-12)).item()
        for n in a[1]
    )
    return loss, grads


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3, help="alternations of unpatched and patched; best kept")
    p.add_argument(
        "--family", choices=llama_patch.FAMILIES, default="Llama", help="the model's architecture, same sizes"
    )
    a = p.parse_args()
    ids = torch.randint(0, 8192, (a.batch, a.seq), generator=torch.Generator().manual_seed(1))
    print(
        f"torch {torch.__version__}, threads {torch.get_num_threads()}, batch {a.batch}, sequence {a.seq}, "
        f"{a.family}\n"
    )
    print("| dtype | version | ms per step | speed-up | speed-up, median of rounds | loss diff | max grad diff (rel) |")
    print("|---|---|---|---|---|---|---|")
    # Mixed precision as most training runs: float32 weights, the forward under bf16 autocast.
    for name, dtype, autocast in (
        ("float32", torch.float32, False),
        ("bfloat16", torch.bfloat16, False),
        ("autocast bf16", torch.float32, True),
    ):
        model = build(a.layers, dtype, a.family)
        base = patched = float("inf")
        ratios = []
        for _ in range(a.rounds):
            unpatched_ms, want = train(model, ids, a.steps, False, autocast)
            try:
                patched_ms, got = train(model, ids, a.steps, True, autocast)
            finally:
                ut.unpatch_llama()
            ratios.append(unpatched_ms / patched_ms)
            base, patched = min(base, unpatched_ms), min(patched, patched_ms)
        loss_diff, grad_diff = difference(want, got)
        print(f"| {name} | transformers | {base:.1f} | | | | |")
        print(
            f"| {name} | uniop patch | {patched:.1f} | {base / patched:.2f}x | {statistics.median(ratios):.2f}x "
            f"| {loss_diff:.2g} | {grad_diff:.2g} |"
        )


if __name__ == "__main__":
    main()
