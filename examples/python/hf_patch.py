"""Patch a Hugging Face causal LM with uniop and generate, offline.

    .venv/bin/python examples/python/hf_patch.py [--family Qwen3] [--dtype bfloat16] [--layers 4]

Builds a small random model of a family ``uniop.torch.patch_llama`` covers (Llama, Mistral, Qwen2,
Qwen3, Phi3) from its config — nothing is downloaded; with a checkpoint you would call
``AutoModelForCausalLM.from_pretrained(name)`` instead — then generates greedily before and after
``patch_llama(model)`` and prints both rates. In float32 the two must give the same tokens; in
16-bit dtypes uniop's once-per-op rounding may flip a near-tie, so the example reports how many
agree.
"""

import argparse
import time

import torch
import transformers

import uniop.torch as ut


def build(family, layers, dtype):
    config = getattr(transformers, family + "Config")(
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=704,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=32,
        pad_token_id=0,
        eos_token_id=None,  # generate every requested token
    )
    torch.manual_seed(0)
    return getattr(transformers, family + "ForCausalLM")(config).to(dtype).eval()


def generate(model, prompt, new):
    with torch.inference_mode():
        model.generate(prompt, max_new_tokens=2, do_sample=False)  # warm-up
        start = time.perf_counter()
        tokens = model.generate(prompt, max_new_tokens=new, do_sample=False)
        return tokens, new / (time.perf_counter() - start)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--family", choices=["Llama", "Mistral", "Qwen2", "Qwen3", "Phi3"], default="Qwen3")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--new", type=int, default=32)
    a = p.parse_args()
    model = build(a.family, a.layers, getattr(torch, a.dtype))
    prompt = torch.randint(1, 4096, (1, a.prompt), generator=torch.Generator().manual_seed(1))

    want, base_rate = generate(model, prompt, a.new)
    ut.patch_llama(model)  # norms, MLP, rope, attention, linears and loss on uniop
    try:
        got, rate = generate(model, prompt, a.new)
    finally:
        ut.unpatch_llama()  # transformers' own modules again

    same = int((got[0, a.prompt :] == want[0, a.prompt :]).sum())
    print(f"{a.family} ({a.layers} layers, {a.dtype}) generate: transformers {base_rate:.0f} tok/s, uniop {rate:.0f}")
    print(f"greedy tokens: {same} of {a.new} the same")
    if a.dtype == "float32":
        assert same == a.new, "float32 greedy tokens must not change"


if __name__ == "__main__":
    main()
