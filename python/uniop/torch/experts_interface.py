"""uniop as a transformers experts implementation, for any mixture-of-experts model.

transformers 5 stores a MoE layer's experts as 3-D weights (``gate_up_proj`` ``[E, 2I, H]``, the
gate's rows then the up projection's, and ``down_proj`` ``[E, H, I]``) and looks the code that runs
them up by name (``config._experts_implementation``) in its ``ExpertsInterface``, as it does
attention. :func:`register_experts` adds ``"uniop"``: each expert a token picked runs its gated MLP
as one uniop ``linear_silu_mul`` (``linear_gelu_mul`` for GELU experts) on the two halves of its
``gate_up_proj`` (views, no copy) and its down projection as one ``linear``, on the rows routed to
it. On CPU the decode steps' few rows stream each expert's weights through uniop's few-row products.
Training in float32 runs one autograd node over the experts, its backward on uniop's backward ops
(see :class:`_Experts`); torch.compile, and training in other dtypes or under autocast, keep
transformers' grouped forward.
GPT-OSS's experts (transposed weights ``[E, H, 2I]`` with gate and up interleaved, biases, a
clamped SwiGLU) run as a ``linear`` with bias, uniop's ``clamped_swiglu`` and a ``linear`` with bias;
training them keeps transformers' grouped forward. Other layouts (biases or transposed weights
otherwise, no gate, an activation other than SiLU and GELU, a post-expert norm) and tensors off the
CPU run transformers' own (eager) forward.

    import uniop.torch
    model = AutoModelForCausalLM.from_pretrained(name, experts_implementation=uniop.torch.register_experts())

:func:`uniop.torch.patch_llama` registers it and switches the MoE models it covers to it.
"""

from __future__ import annotations

import functools
import itertools

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


def covers(module):
    """Whether uniop's forward computes what transformers' does for this experts module (of a class
    transformers' ``use_experts_implementation`` decorated), for the inputs it takes (see
    :func:`_covered`): the layout, biases and activation its flags and class declare."""
    return _form(module) is not None


def _form(module):
    """How uniop runs this experts module: ``"gated"`` (transformers' default layout — gate rows
    then up rows, ``[E, 2I, H]``, no biases — with a SiLU or GELU gate), ``"clamped"`` (GPT-OSS's:
    transposed ``[E, H, 2I]`` with gate and up interleaved, biases, its clamped SwiGLU gate), or
    None for any other."""
    from transformers.integrations.moe import _default_apply_gate

    if module.has_post_expert_norm or getattr(module, "_is_expert_parallel", False) or not module.has_gate:
        return None
    gate = type(module)._apply_gate
    if module.is_concatenated and not module.is_transposed and not module.has_bias:
        return "gated" if gate is _default_apply_gate and unn.gating(module) is not None else None
    if not module.is_concatenated and module.is_transposed and module.has_bias and gate is _clamped_gate():
        return "clamped"
    return None


@functools.cache
def _clamped_gate():
    """GPT-OSS's ``_apply_gate`` (the gate uniop's ``clamped_swiglu`` computes), None where this
    transformers has no GPT-OSS."""
    try:
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
    except ImportError:
        return None
    return GptOssExperts._apply_gate


def _covered(module, x):
    """Whether uniop's forward computes what transformers' does for this experts module and input."""
    return covers(module) and x.device.type == "cpu" and x.dtype in unn._FLOATS


def _records(module, x, top_k_weights):
    """Whether autograd records the call, so that its backward needs what the forward computed."""
    inputs = (x, top_k_weights, module.gate_up_proj, module.down_proj)
    return torch.is_grad_enabled() and any(t.requires_grad for t in inputs)


def _grouped_instead(records, x, form):
    """Whether the call goes to transformers' grouped forward: torch.compile traces it (the loop
    reads how many rows each expert got), or autograd records it other than in float32 or under
    autocast, or for GPT-OSS's experts (uniop has their forward only). :class:`_Experts` computes
    its gradients in the dtypes its inputs and kept products have (autocast's casts are not in its
    backward); in bfloat16 a training step of the tiny Mixtral ran 0.89x as fast on it as on the
    grouped forward (oneDNN's bf16 products of an expert's 128 rows outrun uniop's backward ones),
    in float32 1.09x (``benches/results/llama_families.md``); float16 is unmeasured."""
    trains_elsewhere = x.dtype != torch.float32 or torch.is_autocast_enabled(x.device.type) or form != "gated"
    return torch.compiler.is_compiling() or (records and trains_elsewhere)


class _Routes:
    """A call's (token, slot) pairs sorted by expert, so each expert multiplies all its rows at
    once: ``order`` the sort, ``tokens`` each sorted pair's token, ``weights`` its routing weight
    (float32), ``slices`` each expert with rows and its range of sorted pairs."""

    def __init__(self, module, top_k_index, top_k_weights):
        k = top_k_index.shape[-1]
        picks = top_k_index.reshape(-1)
        self.order = torch.argsort(picks, stable=True)
        rows_of = torch.bincount(picks, minlength=module.num_experts)[: module.num_experts].tolist()
        # Detached: where autograd records, _Experts gives the routing weights their gradient.
        self.tokens, self.weights = self.order // k, top_k_weights.detach().reshape(-1)[self.order].float()
        starts = itertools.accumulate(rows_of, initial=0)
        self.slices = [(e, slice(s, s + n)) for e, (s, n) in enumerate(zip(starts, rows_of)) if n]


def experts(module, hidden_states, top_k_index, top_k_weights):
    """transformers' experts interface over uniop: ``hidden_states`` ``[tokens, H]``, each token's
    ``top_k_index`` / ``top_k_weights`` ``[tokens, k]``; returns ``[tokens, H]``, the experts'
    outputs weighted and summed per token in float32 (as transformers' grouped forward sums them),
    rounded once.

    Where autograd records the call in float32, one autograd node runs the experts forward and
    backward (:class:`_Experts`). Calls torch.compile traces, and those autograd records in other
    dtypes, under autocast or for GPT-OSS's experts, run transformers' grouped forward (its eager
    one where torch's grouped product is missing)."""
    if not _covered(module, hidden_states):
        return type(module).forward.__wrapped__(module, hidden_states, top_k_index, top_k_weights)
    form = _form(module)
    records = _records(module, hidden_states, top_k_weights)
    if _grouped_instead(records, hidden_states, form):
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

        grouped = ALL_EXPERTS_FUNCTIONS.get("grouped_mm", type(module).forward.__wrapped__)
        return grouped(module, hidden_states, top_k_index, top_k_weights)
    routes = _Routes(module, top_k_index, top_k_weights)
    if form == "clamped":
        return _routed_sum(hidden_states, routes, _clamped_mlp(module))
    act = unn.gating(module)
    if records:
        return _Experts.apply(hidden_states, top_k_weights, module.gate_up_proj, module.down_proj, routes, act)
    return _routed_sum(hidden_states, routes, _gated_mlp(module.gate_up_proj, module.down_proj, act))


def _routed_sum(hidden_states, routes, mlp):
    """Each expert's MLP (``mlp(expert, its rows)``) on the rows routed to it, weighted and summed
    per token in float32, rounded once to the input's dtype."""
    out = torch.zeros(hidden_states.shape, dtype=torch.float32)
    for expert, pairs in routes.slices:
        rows = routes.tokens[pairs]
        y = mlp(expert, hidden_states[rows])
        out.index_add_(0, rows, y.float() * routes.weights[pairs, None])
    return out.to(hidden_states.dtype)


def _gated_mlp(gate_up_proj, down_proj, act, kept=None):
    """An expert's gated MLP in transformers' default layout: one ``linear_silu_mul`` (or
    ``linear_gelu_mul``) on the two halves of its ``gate_up_proj`` (views) and one ``linear``. With
    a ``kept`` list, the train form instead, and each expert's input rows, activation, gate and up
    products and output appended to it, for :class:`_Experts`'s backward."""
    gated = getattr(unn.uniop_ops, act.fused if kept is None else act.train)

    def mlp(expert, x):
        gate, up = gate_up_proj[expert].chunk(2)
        outputs = gated(x, gate, up, *act.form)  # the train form's: h, the gate and up products
        y = unn.uniop_ops.linear(outputs if kept is None else outputs[0], down_proj[expert], None)
        if kept is not None:
            kept.append((x, *outputs, y))
        return y

    return mlp


def _clamped_mlp(module):
    """A GPT-OSS expert: ``linear`` with its bias onto the interleaved gate/up product (its
    transposed weight read as ``[2I, H]`` through swapped strides, no copy), ``clamped_swiglu``
    with the module's ``alpha`` and ``limit``, and ``linear`` with its bias for the down projection."""
    ops = unn.uniop_ops

    def mlp(expert, x):
        gate_up = ops.linear(x, module.gate_up_proj[expert].mT, module.gate_up_proj_bias[expert])
        h = ops.clamped_swiglu(gate_up, float(module.alpha), float(module.limit))
        return ops.linear(h, module.down_proj[expert].mT, module.down_proj_bias[expert])

    return mlp


class _Experts(torch.autograd.Function):
    """The experts forward (:func:`_gated_mlp`'s train form, keeping each expert's input rows, gate
    and up products, activation and output) and its backward: per expert, ``linear_backward`` of its down
    projection and ``linear_silu_mul_backward`` (``linear_gelu_mul_backward``) of its gate/up pair
    on the kept products, each weight's gradient written into its expert's slice of one buffer.

    Why one node rather than autograd over the per-expert calls: there, the gradient of one
    expert's slice of a 3-D weight is a buffer the size of the whole weight, so the backward wrote
    every expert's weights once per expert (a tiny Mixtral's training step ran 0.74x transformers'
    in float32). The routing weights get their gradient too (the router trains): each pair's is
    the upstream gradient of its token dotted with its expert's output."""

    @staticmethod
    def forward(ctx, hidden_states, top_k_weights, gate_up_proj, down_proj, routes, act):
        ctx.kept = []
        out = _routed_sum(hidden_states, routes, _gated_mlp(gate_up_proj, down_proj, act, ctx.kept))
        ctx.save_for_backward(gate_up_proj, down_proj)
        ctx.routes, ctx.act = routes, act
        ctx.inputs = hidden_states.shape, hidden_states.dtype, top_k_weights.shape, top_k_weights.dtype
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        gate_up_proj, down_proj = ctx.saved_tensors
        routes, act = ctx.routes, ctx.act
        hidden_shape, dtype, weights_shape, weights_dtype = ctx.inputs
        backward = getattr(unn.uniop_ops, act.backward)
        dout = dout.float()
        d_hidden = torch.zeros(hidden_shape, dtype=torch.float32)
        d_gate_up, d_down = torch.zeros_like(gate_up_proj), torch.zeros_like(down_proj)
        d_sorted_weights = torch.zeros(routes.order.shape, dtype=torch.float32)
        intermediate = gate_up_proj.shape[1] // 2
        for (expert, pairs), (x, h, gate_product, up_product, y) in zip(routes.slices, ctx.kept):
            rows = routes.tokens[pairs]
            d_rows = dout[rows]
            d_sorted_weights[pairs] = (d_rows * y.float()).sum(-1)
            dy = (d_rows * routes.weights[pairs, None]).to(dtype)
            dh, d_down[expert], _ = unn.uniop_ops.linear_backward(dy, h, down_proj[expert])
            gate, up = gate_up_proj[expert].chunk(2)
            dx, d_gate, d_up = backward(dh, x, gate, up, gate_product, up_product, *act.form)
            d_gate_up[expert, :intermediate], d_gate_up[expert, intermediate:] = d_gate, d_up
            d_hidden.index_add_(0, rows, dx.float())
        d_weights = torch.empty_like(d_sorted_weights)
        d_weights[routes.order] = d_sorted_weights
        d_weights = d_weights.view(weights_shape).to(weights_dtype)
        return d_hidden.to(dtype), d_weights, d_gate_up, d_down, None, None
