"""Tiny Llama on CPU, transformers' own modules vs uniop.torch.patch_llama, in one run.

    .venv/bin/python benches/llama_patch.py [--layers 6] [--prompt 512] [--new 64] [--rounds 3] [--pack-weights]
                                            [--batch 1]
                                            [--family Llama|Mistral|Qwen2|Qwen3|Phi3|Gemma|Gemma2|Gemma3|Mixtral|
                                                      Qwen2Moe|Qwen3Moe|GptOss]

A random LlamaForCausalLM (hidden 384, GQA 6 query / 2 kv heads of 64, built offline from a config;
``--family`` builds the same sizes as a Mistral, Qwen2, Qwen3, Phi3, Gemma, Gemma2 or Gemma3 model, with their
own defaults otherwise: Qwen2's q/k/v bias, Qwen3's q/k norms, Phi3's fused projections, Gemma's GELU MLP,
Gemma2's attention logit soft-capping (transformers runs it on its eager attention: no SDPA); the MoE
families with 8 experts of the dense MLP's size, 2 per token; GptOss with its attention sinks and
128-key window on every other layer, its experts on uniop's experts implementation):
prefill of a prompt (time to the first token, ms) and greedy decode (the other tokens of
model.generate with the KV cache, tokens/s), fp32 and bf16, unpatched and patched alternating for --rounds, best of --repeats each. Prints a markdown table with
the patched/unpatched ratios — of the best figures over all rounds, and the median of each round's own ratio
(the two versions measured back to back, so a slow phase of a shared machine lands in both) — and checks that
both produce the same greedy tokens in fp32. With ``--batch N`` the prompts are a left-padded batch, as
transformers pads batched generation: N prompts from --prompt tokens down to about half of it (decode tok/s
then counts every sequence's tokens).
"""

import argparse
import statistics
import time

import torch
import transformers

import uniop.torch as ut


FAMILIES = (
    "Llama", "Mistral", "Qwen2", "Qwen3", "Phi3", "Gemma", "Gemma2", "Gemma3", "Mixtral", "Qwen2Moe", "Qwen3Moe",
    "GptOss",
)
# The MoE families' experts: 8 of the dense MLP's size, 2 per token (their defaults are 8 to 128).
MOE = {
    "Mixtral": {"num_local_experts": 8, "num_experts_per_tok": 2},
    "Qwen2Moe": {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 1024},
    "Qwen3Moe": {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 1024},
    "GptOss": {"num_local_experts": 8, "num_experts_per_tok": 2},
}


def build(layers, dtype, family="Llama"):
    # Phi3's default special tokens (32000) are past this vocabulary: Llama's ids instead.
    special = {"pad_token_id": 0, "eos_token_id": 2} if family == "Phi3" else {}
    config_class = transformers.Gemma3TextConfig if family == "Gemma3" else getattr(transformers, family + "Config")
    cfg = config_class(
        vocab_size=8192,
        hidden_size=384,
        intermediate_size=1024,
        num_hidden_layers=layers,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=2048,
        **special,
        **MOE.get(family, {}),
    )
    torch.manual_seed(0)
    return getattr(transformers, family + "ForCausalLM")(cfg).to(dtype).eval()


def best(fn, repeats):
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return min(times), out


def prompts(batch, length):
    """`batch` random prompts of `length` tokens down to about half of it, left-padded (pad token 0,
    attention mask 0) to `length`."""
    ids = torch.randint(0, 8192, (batch, length), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    for b in range(batch):
        mask[b, : b * length // (2 * batch)] = 0
    return ids.masked_fill(mask == 0, 0), mask


def measure(model, prompt, new, repeats):
    """Prefill as time to the first token (`generate` of one token) and decode as the rate of the
    other `new - 1`, both through `generate`: a bare forward pass computes logits for every prompt
    position, which generate does not, so subtracting it would misstate the decode rate (by up to
    2x in bf16 when the lm_head GEMM is slow)."""
    ids, mask = prompt
    run = lambda n: model.generate(  # noqa: E731
        ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0
    )
    with torch.inference_mode():
        run(new)  # warm-up
        prefill, _ = best(lambda: run(1), repeats)
        total, tokens = best(lambda: run(new), repeats)
    return prefill * 1e3, ids.shape[0] * (new - 1) / max(total - prefill, 1e-9), tokens


def better(kept, new):
    """The faster prefill and the faster decode of two `measure` results (tokens from the first)."""
    if kept is None:
        return new
    return min(kept[0], new[0]), max(kept[1], new[1]), kept[2]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3, help="alternations of unpatched and patched; best kept")
    p.add_argument(
        "--pack-weights", action="store_true", help="patch_llama(pack_weights=True): prefill products on weights packed once"
    )
    p.add_argument("--batch", type=int, default=1, help="prompts in a left-padded batch")
    p.add_argument("--family", choices=FAMILIES, default="Llama", help="the model's architecture, same sizes")
    a = p.parse_args()
    prompt = prompts(a.batch, a.prompt)
    print(
        f"torch {torch.__version__}, threads {torch.get_num_threads()}, prompt {a.prompt}, new tokens {a.new}, "
        f"pack_weights {a.pack_weights}, batch {a.batch}, {a.family}\n"
    )
    print(
        "| dtype | version | prefill ms | decode tok/s | prefill speed-up | decode speed-up "
        "| prefill, median of rounds | decode, median of rounds |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for dtype in (torch.float32, torch.bfloat16):
        model = build(a.layers, dtype, a.family)
        # Unpatched and patched alternate for --rounds, each keeping its best prefill and decode
        # rate: a slow phase of this shared machine then lands in both versions, not in one ratio.
        base = patched = None
        prefill_ratios, decode_ratios = [], []
        for _ in range(a.rounds):
            unpatched = measure(model, prompt, a.new, a.repeats)
            ut.patch_llama(model, pack_weights=a.pack_weights)
            try:
                this_round = measure(model, prompt, a.new, a.repeats)
            finally:
                ut.unpatch_llama()
            prefill_ratios.append(unpatched[0] / this_round[0])
            decode_ratios.append(this_round[1] / unpatched[1])
            base, patched = better(base, unpatched), better(patched, this_round)
        name = str(dtype).removeprefix("torch.")
        print(f"| {name} | transformers | {base[0]:.1f} | {base[1]:.1f} | | | | |")
        print(
            f"| {name} | uniop patch | {patched[0]:.1f} | {patched[1]:.1f} | "
            f"{base[0] / patched[0]:.2f}x | {patched[1] / base[1]:.2f}x | "
            f"{statistics.median(prefill_ratios):.2f}x | {statistics.median(decode_ratios):.2f}x |"
        )
        if dtype == torch.float32 and not torch.equal(base[2], patched[2]):
            print("WARNING: fp32 greedy tokens differ between the two versions")


if __name__ == "__main__":
    main()
