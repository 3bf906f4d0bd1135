"""One experts layer with a clamped SwiGLU gate through uniop and through what transformers runs it
on, in the same run.

    .venv/bin/python benches/clamped_experts.py [--family GptOss|DeepseekV4] [--hidden H] [--width W]
                                                [--experts 32] [--top-k K] [--tokens 1,512] [--dtypes bf16,f32]
                                                [--rounds 2]

The family's experts module (transformers' own class, random weights; 32 experts of the model's sizes
by default) takes `--tokens` tokens routed at random (a decode step and a prefill by default), forward
only, in `--dtypes`. `GptOss` (GPT-OSS 20B: hidden and expert width 2880, 4 per token): transposed
weights with gate and up interleaved, biases, `(u' + 1) · g' · σ(1.702 g')`; `DeepseekV4` (DeepSeek V4's
default config: hidden 4096, expert width 2048, 6 per token): the default layout, gate and up halves,
no biases, `silu(g') · u'` (limit 10). Each runs on
1. `grouped_mm`: transformers' default experts implementation on CPU (tokens sorted by expert, one
   grouped product per projection, a bias gathered per row, the clamped gate as torch ops);
2. `eager`: the class's own loop over experts (per expert a matmul, a bias add, the gate's five to
   seven torch ops, a matmul, a bias add);
3. uniop: `uniop.torch.register_experts()` — per expert `linear` (with bias; a transposed weight read
   through swapped strides), `clamped_swiglu`, `linear`, summed in float32.
Under `no_grad`, best of `--rounds` x a few calls; largest error of each against the float64 eager
forward (relative to the output's largest magnitude).
"""

import argparse
import importlib

import torch
import transformers

import uniop.torch
from masked_attention import best_ms


# Per family: its experts class and config (as transformers names them), and its default hidden size,
# expert width and experts per token.
FAMILIES = {
    "GptOss": ("gpt_oss", "GptOssExperts", "GptOssConfig", 2880, 2880, 4),
    "DeepseekV4": ("deepseek_v4", "DeepseekV4Experts", "DeepseekV4Config", 4096, 2048, 6),
}


def experts_module(family, hidden, width, experts, dtype):
    model, experts_class, config_class, *_ = FAMILIES[family]
    modeling = importlib.import_module(f"transformers.models.{model}.modeling_{model}")
    config = getattr(transformers, config_class)(hidden_size=hidden, intermediate_size=width, num_local_experts=experts)
    module = getattr(modeling, experts_class)(config)
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
    *_, hidden, width, top_k = FAMILIES[a.family]
    a.hidden, a.width, a.top_k = a.hidden or hidden, a.width or width, a.top_k or top_k
    torch.manual_seed(0)
    name = uniop.torch.register_experts()
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, uniop GEMM {uniop.gemm_kernels()}, "
          f"{a.family}, hidden {a.hidden}, expert width {a.width}, {a.experts} experts, {a.top_k} per token\n")
    print("| dtype | tokens | uniop ms | grouped_mm ms | vs grouped_mm | eager ms | vs eager | uniop err | "
          "grouped_mm err | eager err |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    dtypes = {"bf16": torch.bfloat16, "f32": torch.float32}
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


if __name__ == "__main__":
    main()
