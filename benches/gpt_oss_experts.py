"""One GPT-OSS experts layer through uniop and through what transformers runs it on, in the same run.

    .venv/bin/python benches/gpt_oss_experts.py [--hidden 2880] [--experts 32] [--top-k 4]
                                                 [--tokens 1,512] [--dtypes bf16,f32] [--rounds 2]

A `GptOssExperts` module (transformers' own class, random weights at GPT-OSS 20B's sizes by default:
hidden and expert width 2880, 32 experts, 4 per token) takes `--tokens` tokens routed at random (a
decode step and a prefill by default), forward only, in `--dtypes`:
1. `grouped_mm`: transformers' default experts implementation on CPU (tokens sorted by expert, one
   grouped product per projection, its bias gathered per row, the clamped SwiGLU as torch ops);
2. `eager`: the class's own loop over experts (per expert a matmul, a bias add, the gate's seven torch
   ops, a matmul, a bias add);
3. uniop: `uniop.torch.register_experts()` — per expert `linear` with bias (the transposed weight read
   through swapped strides), `clamped_swiglu`, `linear` with bias, summed in float32.
Under `no_grad`, best of `--rounds` x a few calls; largest error of each against the float64 eager
forward (relative to the output's largest magnitude).
"""

import argparse

import torch

import uniop.torch
from masked_attention import best_ms


def experts_module(hidden, experts, dtype):
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    config = GptOssConfig(hidden_size=hidden, intermediate_size=hidden, num_local_experts=experts)
    module = GptOssExperts(config)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0.0, 0.02)  # GPT-OSS's initializer_range
    return module.to(dtype)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--hidden", type=int, default=2880)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--tokens", default="1,512")
    p.add_argument("--dtypes", default="bf16,f32")
    p.add_argument("--rounds", type=int, default=2)
    a = p.parse_args()
    torch.manual_seed(0)
    name = uniop.torch.register_experts()
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, uniop GEMM {uniop.gemm_kernels()}, "
          f"hidden {a.hidden}, {a.experts} experts, {a.top_k} per token\n")
    print("| dtype | tokens | uniop ms | grouped_mm ms | vs grouped_mm | eager ms | vs eager | uniop err | "
          "grouped_mm err | eager err |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    dtypes = {"bf16": torch.bfloat16, "f32": torch.float32}
    for dtype in (dtypes[d] for d in a.dtypes.split(",")):
        module = experts_module(a.hidden, a.experts, dtype)
        exact = experts_module(a.hidden, a.experts, torch.float64)
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
