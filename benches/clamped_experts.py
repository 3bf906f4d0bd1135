"""One experts layer whose gate is one of uniop's ops on gate/up pairs (a clamped SwiGLU; Inkling 2's
softcapped one) through uniop and through what transformers runs it on, in the same run.

    .venv/bin/python benches/clamped_experts.py [--family GptOss|DeepseekV4|Step3p7|Inkling2] [--hidden H] [--width W]
                                                [--experts 32] [--top-k K] [--tokens 1,512] [--dtypes bf16,f32]
                                                [--rounds 2]

The family's experts module (transformers' own class, random weights; 32 experts of the model's sizes
by default) takes `--tokens` tokens routed at random (a decode step and a prefill by default), forward
only, in `--dtypes`. `GptOss` (GPT-OSS 20B: hidden and expert width 2880, 4 per token): transposed
weights with gate and up interleaved, biases, `(u' + 1) · g' · σ(1.702 g')`; `DeepseekV4` (DeepSeek V4's
default config: hidden 4096, expert width 2048, 6 per token): the default layout, gate and up halves,
no biases, `silu(g') · u'` (limit 10); `Step3p7` (Step 3.7 Flash's text config: hidden 4096, expert width
1280, 8 per token): the default layout, the limit after the activation, `min(silu(g), 7) · clamp(u, ±7)`
(7 in every layer here); `Inkling2` (Inkling 2 Small's text config: hidden 4608, expert width 2304, 8 per
token): the default layout, `4·tanh(g/4) · σ(g) · 25·tanh(u/25)`. Each runs on
1. `grouped_mm`: transformers' default experts implementation on CPU (tokens sorted by expert, one
   grouped product per projection, a bias gathered per row, the gate as torch ops);
2. `eager`: the class's own loop over experts (per expert a matmul, a bias add, the gate's five to
   seven torch ops, a matmul, a bias add);
3. uniop: `uniop.torch.register_experts()` — per expert `linear` (with bias; a transposed weight read
   through swapped strides), the gate's op (`clamped_swiglu`, `softcapped_swiglu`), `linear`, summed in
   float32.
Under `no_grad`, best of `--rounds` x a few calls; largest error of each against the float64 eager
forward (relative to the output's largest magnitude). A second table times the gate alone on the
largest call's gate/up product: uniop's gate op and its backward against the class's own
`_apply_gate`, eager and under `torch.compile`, and their autograd backward.
"""

import argparse
import importlib

import torch

import uniop.torch
from masked_attention import best_ms, grad_ms
from uniop.torch import experts_interface, nn as unn


# Per family: its experts class and config (as transformers names them), its default hidden size, expert
# width and experts per token, the config's arguments for a width and a number of experts, and the experts
# class's arguments after the config.
FAMILIES = {
    "GptOss": (
        "gpt_oss", "GptOssExperts", "GptOssConfig", 2880, 2880, 4,
        lambda width, experts: {"intermediate_size": width, "num_local_experts": experts}, (),
    ),
    "DeepseekV4": (
        "deepseek_v4", "DeepseekV4Experts", "DeepseekV4Config", 4096, 2048, 6,
        lambda width, experts: {"intermediate_size": width, "num_local_experts": experts}, (),
    ),
    "Step3p7": (
        "step3p7", "Step3p7Experts", "Step3p7TextConfig", 4096, 1280, 8,
        lambda width, experts: {"moe_intermediate_size": width, "n_routed_experts": experts, "swiglu_limits": [7.0]},
        (0,),
    ),
    "Inkling2": (
        "inkling2", "Inkling2Experts", "Inkling2TextConfig", 4608, 2304, 8,
        lambda width, experts: {"moe_intermediate_size": width, "n_routed_experts": experts}, (),
    ),
}


def experts_module(family, hidden, width, experts, dtype):
    model, experts_class, config_class, *_, sizes, args = FAMILIES[family]
    modeling = importlib.import_module(f"transformers.models.{model}.modeling_{model}")
    configuration = importlib.import_module(f"transformers.models.{model}.configuration_{model}")
    config = getattr(configuration, config_class)(hidden_size=hidden, **sizes(width, experts))
    module = getattr(modeling, experts_class)(config, *args)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0.0, 0.02)  # the models' initializer_range
    return module.to(dtype)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--family", choices=FAMILIES, default="GptOss")
    p.add_argument("--hidden", type=int, help="hidden size (default: the family's)")
    p.add_argument("--width", type=int, help="each expert's width (default: the family's)")
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--top-k", type=int, help="experts per token (default: the family's)")
    p.add_argument("--tokens", default="1,512")
    p.add_argument("--dtypes", default="bf16,f32")
    p.add_argument("--rounds", type=int, default=2)
    a = p.parse_args()
    *_, hidden, width, top_k, _, _ = FAMILIES[a.family]
    a.hidden, a.width, a.top_k = a.hidden or hidden, a.width or width, a.top_k or top_k
    torch.manual_seed(0)
    name = uniop.torch.register_experts()
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, uniop GEMM {uniop.gemm_kernels()}, "
          f"{a.family}, hidden {a.hidden}, expert width {a.width}, {a.experts} experts, {a.top_k} per token\n")
    print("| dtype | tokens | uniop ms | grouped_mm ms | vs grouped_mm | eager ms | vs eager | uniop err | "
          "grouped_mm err | eager err |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    dtypes = {"bf16": torch.bfloat16, "f32": torch.float32}
    gates = []
    for dtype in (dtypes[d] for d in a.dtypes.split(",")):
        module = experts_module(a.family, a.hidden, a.width, a.experts, dtype)
        exact = experts_module(a.family, a.hidden, a.width, a.experts, torch.float64)
        exact.load_state_dict(module.state_dict())
        for tokens in (int(t) for t in a.tokens.split(",")):
            x = torch.randn(tokens, a.hidden, dtype=dtype)
            index = torch.stack([torch.randperm(a.experts)[: a.top_k] for _ in range(tokens)])
            weights = torch.softmax(torch.randn(tokens, a.top_k), -1).to(dtype)
            with torch.no_grad():
                want = exact(x.double(), index, weights.double())
                ms, err = {}, {}
                for implementation in (name, "grouped_mm", "eager"):
                    module.config._experts_implementation = implementation
                    run = lambda: module(x, index, weights)  # noqa: E731
                    err[implementation] = ((run().double() - want).abs().max() / want.abs().max()).item()
                    ms[implementation] = best_ms(run, 3 if tokens > 64 else 20, a.rounds)
            u, g, e = ms[name], ms["grouped_mm"], ms["eager"]
            print(f"| {str(dtype)[6:]} | {tokens} | {u:.2f} | {g:.2f} | {g / u:.2f}x | {e:.2f} | {e / u:.2f}x | "
                  f"{err[name]:.1e} | {err['grouped_mm']:.1e} | {err['eager']:.1e} |")
        gates.append(gate_alone(module, max(int(t) for t in a.tokens.split(",")) * a.top_k, 2 * a.width, a.rounds))
    op = experts_interface._form(module).op
    print(f"\nThe gate alone on the largest call's product (`[tokens x top-k, 2 x width]`, values 4 x N(0, 1)): uniop "
          f"`{op}` (`{op}_backward`) against the class's `_apply_gate` eager and under `torch.compile` (their "
          "autograd backward).\n")
    print("| dtype | rows | uniop fwd ms | vs eager | vs compile | uniop bwd ms | vs eager | vs compile |")
    print("|---|---|---|---|---|---|---|---|")
    for row in gates:
        print(row)


def gate_alone(module, rows, width, rounds):
    """One markdown row: uniop's op of the module's gate and its backward against the module's own
    gate, on a ``[rows, width]`` gate/up product."""
    dtype = module.down_proj.dtype
    product = (4 * torch.randn(rows, width)).to(dtype)
    form = experts_interface._form(module)
    forward, backward = getattr(unn.uniop_ops, form.op), getattr(unn.uniop_ops, form.op + "_backward")
    eager, compiled = module._apply_gate, torch.compile(module._apply_gate, fullgraph=True)
    fwd = {"uniop": best_ms(lambda: forward(product, **form.kwargs), 5, rounds)}
    bwd = {}
    dout = torch.randn(rows, width // 2).to(dtype)
    bwd["uniop"] = best_ms(lambda: backward(dout, product, **form.kwargs), 5, rounds)
    for name, gate in (("eager", eager), ("compile", compiled)):
        with torch.no_grad():
            fwd[name] = best_ms(lambda: gate(product), 5, rounds)
        leaf = product.clone().requires_grad_()
        bwd[name] = grad_ms(gate(leaf), [leaf], 5, rounds)
    return (f"| {str(dtype)[6:]} | {rows} | {fwd['uniop']:.2f} | {fwd['eager'] / fwd['uniop']:.2f}x | "
            f"{fwd['compile'] / fwd['uniop']:.2f}x | {bwd['uniop']:.2f} | {bwd['eager'] / bwd['uniop']:.2f}x | "
            f"{bwd['compile'] / bwd['uniop']:.2f}x |")


if __name__ == "__main__":
    main()
