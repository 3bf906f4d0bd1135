"""uniop as a transformers experts implementation, for any mixture-of-experts model.

transformers 5 stores a MoE layer's experts as 3-D weights (``gate_up_proj`` ``[E, 2I, H]``, the
gate's rows then the up projection's, and ``down_proj`` ``[E, H, I]``) and looks the code that runs
them up by name (``config._experts_implementation``) in its ``ExpertsInterface``, as it does
attention. :func:`register_experts` adds ``"uniop"``: each expert a token picked runs its gated MLP
as one uniop ``linear_silu_mul`` (``linear_gelu_mul`` for GELU experts) on the two halves of its
``gate_up_proj`` (views, no copy) and its down projection as one ``linear``, on the rows routed to
it. On CPU the decode steps' few rows stream each expert's weights through uniop's few-row products.
Training keeps transformers' grouped forward (see :func:`experts`). Other layouts (transposed or
interleaved weights, biases, no gate, an activation other than SiLU and GELU, a post-expert norm)
and tensors off the CPU run transformers' own (eager) forward.

    import uniop.torch
    model = AutoModelForCausalLM.from_pretrained(name, experts_implementation=uniop.torch.register_experts())

:func:`uniop.torch.patch_llama` registers it and switches the MoE models it covers to it.
"""

from __future__ import annotations

import torch

from . import nn as unn

EXPERTS = "uniop"


def register_experts():
    """Registers uniop's experts forward with transformers as the ``"uniop"`` experts
    implementation. Returns the name, for ``from_pretrained(..., experts_implementation=...)`` or
    ``model.set_experts_implementation(...)``."""
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(EXPERTS, experts)
    return EXPERTS


def _covered(module, x):
    """Whether uniop's forward computes what transformers' does for this experts module and input."""
    from transformers.integrations.moe import _default_apply_gate

    layout = module.has_gate and module.is_concatenated and not module.is_transposed
    extras = module.has_bias or module.has_post_expert_norm or getattr(module, "_is_expert_parallel", False)
    gate = type(module)._apply_gate is _default_apply_gate and unn.gating(module) is not None
    return layout and not extras and gate and x.device.type == "cpu" and x.dtype in unn._FLOATS


def _grouped_instead(module, x):
    """Whether the call goes to transformers' grouped forward: autograd records it (see
    :func:`experts`), or torch.compile traces it (the loop reads how many rows each expert got)."""
    records = torch.is_grad_enabled() and (x.requires_grad or module.gate_up_proj.requires_grad)
    return records or torch.compiler.is_compiling()


def experts(module, hidden_states, top_k_index, top_k_weights):
    """transformers' experts interface over uniop: ``hidden_states`` ``[tokens, H]``, each token's
    ``top_k_index`` / ``top_k_weights`` ``[tokens, k]``; returns ``[tokens, H]``, the experts'
    outputs weighted and summed per token in float32 (as transformers' grouped forward sums them),
    rounded once. The (token, slot) pairs are sorted by expert, so each expert multiplies all its
    rows at once.

    Calls autograd records run transformers' grouped forward instead (its eager one where torch's
    grouped product is missing): the gradient of one expert's slice of a 3-D weight is a buffer the
    size of the whole weight, so a backward through per-expert products wrote every expert's
    weights once per expert (a tiny Mixtral's training step ran 0.74x transformers' in float32).
    So do calls torch.compile traces."""
    if not _covered(module, hidden_states):
        return type(module).forward.__wrapped__(module, hidden_states, top_k_index, top_k_weights)
    if _grouped_instead(module, hidden_states):
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

        grouped = ALL_EXPERTS_FUNCTIONS.get("grouped_mm", type(module).forward.__wrapped__)
        return grouped(module, hidden_states, top_k_index, top_k_weights)
    k = top_k_index.shape[-1]
    picks = top_k_index.reshape(-1)
    order = torch.argsort(picks, stable=True)
    rows_of = torch.bincount(picks, minlength=module.num_experts)[: module.num_experts].tolist()
    tokens, weights = order // k, top_k_weights.reshape(-1)[order].float()
    out = torch.zeros(hidden_states.shape, dtype=torch.float32)
    act = unn.gating(module)
    gated = getattr(unn.uniop_ops, act.fused)
    start = 0
    for expert, count in enumerate(rows_of):
        if count == 0:
            continue
        rows = tokens[start : start + count]
        gate, up = module.gate_up_proj[expert].chunk(2)
        h = gated(hidden_states[rows], gate, up, *act.form)
        y = unn.uniop_ops.linear(h, module.down_proj[expert], None)
        out.index_add_(0, rows, y.float() * weights[start : start + count, None])
        start += count
    return out.to(hidden_states.dtype)
