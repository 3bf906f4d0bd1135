"""uniop as a transformers experts implementation, for any mixture-of-experts model.

transformers 5 stores a MoE layer's experts as 3-D weights (``gate_up_proj`` ``[E, 2I, H]``, the
gate's rows then the up projection's, and ``down_proj`` ``[E, H, I]``) and looks the code that runs
them up by name (``config._experts_implementation``) in its ``ExpertsInterface``, as it does
attention. :func:`register_experts` adds ``"uniop"``: each expert a token picked runs its gated MLP
as one uniop ``linear_silu_mul`` (``linear_gelu_mul`` for GELU experts) on the two halves of its
``gate_up_proj`` (views, no copy) and its down projection as one ``linear``, on the rows routed to
it. On CPU the decode steps' few rows stream each expert's weights through uniop's few-row products.
Training in float32 runs one autograd node over the experts, its backward on uniop's backward ops
(see :class:`_Experts`); torch.compile, and training in other dtypes (but GPT-OSS's in bfloat16)
or under autocast, keep transformers' grouped forward.
Beam's experts (the default gate, computed in float32 and rounded once, as uniop's) run as those
of the default layout. Experts with a clamped SwiGLU gate — GPT-OSS's (transposed weights
``[E, H, 2I]`` with gate and up interleaved, biases), DeepSeek V4's, GLM-5 Next's and HunYuan V4's
(its VL model's too; the default layout, the gate ``silu(min(g, limit)) · clamp(u, ±limit)``),
Step 3.7's and Ling's (``min(silu(g), limit) · clamp(u, ±limit)``: the limit after the
activation), MiniMax M3's — run as a ``linear`` (with bias where they have one), uniop's
``clamped_swiglu`` and a ``linear``, and Inkling 2's softcapped SwiGLU (``cg·tanh(g/cg) · σ(g) ·
cu·tanh(u/cu)``) likewise on ``softcapped_swiglu``; trained on the same node in float32 and
bfloat16 (the backward on ``matmul_backward`` or ``linear_backward`` and the gate op's). Other layouts
(biases or transposed weights otherwise, no gate, an activation other than SiLU and GELU, a
post-expert norm) and tensors off the CPU run transformers' own (eager) forward.

    import uniop.torch
    model = AutoModelForCausalLM.from_pretrained(name, experts_implementation=uniop.torch.register_experts())

:func:`uniop.torch.patch_llama` registers it and switches the MoE models it covers to it.
"""

from __future__ import annotations

import functools
import importlib
import itertools
from typing import Callable, NamedTuple

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
    :func:`_form`): the layout, biases and activation its flags and class declare."""
    return _form(module) is not None


def _form(module):
    """How uniop runs this experts module: :class:`_Gated` (transformers' default layout — gate rows
    then up rows, ``[E, 2I, H]``, no biases — with the default SiLU or GELU gate, or one of
    :data:`_GATES` that computes it), :class:`_PairGated` (a gate of :data:`_GATES` that one of
    uniop's ops on gate/up pairs computes, on the layout its flags declare), or None for any other."""
    from transformers.integrations.moe import _default_apply_gate

    if module.has_post_expert_norm or getattr(module, "_is_expert_parallel", False) or not module.has_gate:
        return None
    gate = type(module)._apply_gate
    own = _gates().get(gate)
    if gate is _default_apply_gate or own is _DEFAULT_GATE:
        act = unn.gating(module)
        simple = module.is_concatenated and not module.is_transposed and not module.has_bias
        return _Gated(act) if simple and act is not None else None
    if own is None or own.interleaved == module.is_concatenated:
        return None
    kwargs = own.kwargs(module)
    if kwargs is None:
        return None
    return _PairGated(own.op, module.is_transposed, module.has_bias, interleaved=own.interleaved, **kwargs)


class _PairGate(NamedTuple):
    """A transformers experts class's ``_apply_gate`` that one of uniop's ops on a gate/up product
    computes (``op``: ``clamped_swiglu``, ``softcapped_swiglu``): where it reads the gate and up
    values (``interleaved`` pairs or halves) and the op's other arguments from the module
    (``kwargs``; None where uniop's op does not compute this module's gate)."""

    op: str
    interleaved: bool
    kwargs: Callable[[torch.nn.Module], dict | None]


def _clamped(interleaved, constants, after_act=False):
    """A clamped SwiGLU gate (``clamped_swiglu``): ``constants(module)`` its ``(alpha, limit,
    up_shift)`` (None where its activation is not SiLU), ``after_act`` whether the limit bounds
    the activation rather than the gate."""

    def kwargs(module):
        values = constants(module)
        if values is None:
            return None
        return dict(zip(("alpha", "limit", "up_shift"), values), limit_after_act=after_act)

    return _PairGate("clamped_swiglu", interleaved, kwargs)


# An experts class's gate that computes transformers' default one (see _GATES).
_DEFAULT_GATE = "default"


def _silu_limited(module):
    """The constants of a gate ``silu`` without GPT-OSS's alpha and shift, bounded by the module's
    ``limit`` (None: the layer does not clip, +inf), where its ``act_fn`` is SiLU (None otherwise)."""
    if unn.gating(module) is not unn.SILU:
        return None
    return 1.0, float("inf") if module.limit is None else float(module.limit), 0.0


def _softcaps(module):
    """Inkling 2's caps, from its experts' ``act_fn``."""
    act = module.act_fn
    return {"gate_softcap": float(act.gate_softcap.softcap), "up_softcap": float(act.up_softcap.softcap)}


# transformers' experts classes whose gate one of uniop's ops on pairs computes. A clamped SwiGLU:
# GPT-OSS's, (u' + 1) · g' · σ(alpha · g') (its privacy filter's and MiniMax M3's on halves), the
# alpha-free silu(g') · u' of DeepSeek V4, GLM-5 Next and HunYuan V4 (DeepSeek V4 applies its act_fn,
# uniop's only where that is SiLU; the others call F.silu themselves), and Step 3.7's and Ling's
# min(act(g), limit) · u' (their act_fn; a per-layer limit, None where the layer does not clip).
# Inkling 2's softcapped SwiGLU, cg·tanh(g/cg) · σ(g) · cu·tanh(u/cu) (its act_fn's caps).
_GATES = {
    ("gpt_oss", "GptOssExperts"): _clamped(True, lambda m: (float(m.alpha), float(m.limit), 1.0)),
    ("openai_privacy_filter", "OpenAIPrivacyFilterExperts"): _clamped(
        False, lambda m: (float(m.alpha), float(m.limit), 1.0)
    ),
    ("minimax_m3_vl", "MiniMaxM3VLExperts"): _clamped(
        False, lambda m: (float(m.swiglu_alpha), float(m.swiglu_limit), 1.0)
    ),
    ("deepseek_v4", "DeepseekV4Experts"): _clamped(False, _silu_limited),
    ("glm5_next", "Glm5NextTextExperts"): _clamped(False, lambda m: (1.0, float(m.swiglu_limit), 0.0)),
    ("hy_v4", "HYV4Experts"): _clamped(False, lambda m: (1.0, float(m.swiglu_limit), 0.0)),
    ("hy_v4_vl", "HYV4VLExperts"): _clamped(False, lambda m: (1.0, float(m.swiglu_limit), 0.0)),
    ("step3p7", "Step3p7Experts"): _clamped(False, _silu_limited, after_act=True),
    ("bailing_hybrid", "BailingHybridExperts"): _clamped(False, _silu_limited, after_act=True),
    ("inkling2", "Inkling2Experts"): _PairGate("softcapped_swiglu", False, _softcaps),
    # The default gate, act(gate) · up, computed in float32 and rounded once (as uniop's gated products
    # do) rather than in the model's dtype.
    ("beam", "BeamExperts"): _DEFAULT_GATE,
}


@functools.cache
def _gates():
    """The ``_apply_gate`` functions of :data:`_GATES`' experts classes this transformers has, each
    with its value there."""
    gates = {}
    for (model, name), gate in _GATES.items():
        try:
            modeling = importlib.import_module(f"transformers.models.{model}.modeling_{model}")
        except ImportError:
            continue
        experts_class = getattr(modeling, name, None)
        if experts_class is not None:
            gates[experts_class._apply_gate] = gate
    return gates


def _covered(module, x):
    """How uniop runs this experts module on this input (see :func:`_form`), None where it doesn't."""
    return _form(module) if x.device.type == "cpu" and x.dtype in unn._FLOATS else None


def _records(x, top_k_weights, weights):
    """Whether autograd records the call, so that its backward needs what the forward computed."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in (x, top_k_weights, *weights))


def _grouped_instead(records, x, form):
    """Whether the call goes to transformers' grouped forward: torch.compile traces it (the loop
    reads how many rows each expert got), or autograd records it in a dtype the form does not
    train in (``form.trains_in``) or under autocast (:class:`_Experts` computes its gradients in
    the dtypes its inputs and kept products have; autocast's casts are not in its backward)."""
    trains_elsewhere = x.dtype not in form.trains_in or torch.is_autocast_enabled(x.device.type)
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

    Where autograd records the call (in float32; GPT-OSS's experts in bfloat16 too), one autograd
    node runs the experts forward and backward (:class:`_Experts`). Calls torch.compile traces,
    and those autograd records in other dtypes or under autocast, run transformers' grouped
    forward (its eager one where torch's grouped product is missing)."""
    form = _covered(module, hidden_states)
    if form is None:
        return type(module).forward.__wrapped__(module, hidden_states, top_k_index, top_k_weights)
    weights = form.weights(module)
    records = _records(hidden_states, top_k_weights, weights)
    if _grouped_instead(records, hidden_states, form):
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

        grouped = ALL_EXPERTS_FUNCTIONS.get("grouped_mm", type(module).forward.__wrapped__)
        return grouped(module, hidden_states, top_k_index, top_k_weights)
    routes = _Routes(module, top_k_index, top_k_weights)
    if records:
        return _Experts.apply(hidden_states, top_k_weights, routes, form, *weights)
    return _routed_sum(hidden_states, routes, form.mlp(weights))


def _routed_sum(hidden_states, routes, mlp):
    """Each expert's MLP (``mlp(expert, its rows)``) on the rows routed to it, weighted and summed
    per token in float32, rounded once to the input's dtype."""
    out = torch.zeros(hidden_states.shape, dtype=torch.float32)
    for expert, pairs in routes.slices:
        rows = routes.tokens[pairs]
        y = mlp(expert, hidden_states[rows])
        out.index_add_(0, rows, y.float() * routes.weights[pairs, None])
    return out.to(hidden_states.dtype)


class _Gated:
    """Experts in transformers' default layout: each one's gated MLP is one ``linear_silu_mul`` (or
    ``linear_gelu_mul``) on the two halves of its ``gate_up_proj`` (views) and one ``linear``.

    Trained on :class:`_Experts` in float32 only: a training step of the tiny Mixtral ran 1.09x as
    fast on it as on transformers' grouped forward in float32, 0.89x in bfloat16, 0.96x best and
    1.01x median on a later Zen 4 (``benches/results/llama_families.md``): no gain to switch for;
    float16 is unmeasured."""

    trains_in = frozenset({torch.float32})

    def __init__(self, act):
        self.act = act

    @staticmethod
    def weights(module):
        return module.gate_up_proj, module.down_proj

    def mlp(self, weights, kept=None):
        """``mlp(expert, x)``. With a ``kept`` list, the train form instead, and each expert's input
        rows, activation, gate and up products and output appended to it, for :meth:`backward`."""
        gate_up_proj, down_proj = weights
        gated = getattr(unn.uniop_ops, self.act.fused if kept is None else self.act.train)

        def mlp(expert, x):
            gate, up = gate_up_proj[expert].chunk(2)
            outputs = gated(x, gate, up, *self.act.form)  # the train form's: h, the gate and up products
            y = unn.uniop_ops.linear(outputs if kept is None else outputs[0], down_proj[expert], None)
            if kept is not None:
                kept.append((x, *outputs, y))
            return y

        return mlp

    def backward(self, expert, weights, grads, dy, kept):
        """One expert's ``linear_backward`` of its down projection and ``linear_silu_mul_backward``
        (``linear_gelu_mul_backward``) of its gate/up pair; writes its slices of ``grads``, returns
        the gradient of its input rows."""
        (gate_up_proj, down_proj), (d_gate_up, d_down) = weights, grads
        x, h, gate_product, up_product, _ = kept
        dh, d_down[expert], _ = unn.uniop_ops.linear_backward(dy, h, down_proj[expert])
        gate, up = gate_up_proj[expert].chunk(2)
        backward = getattr(unn.uniop_ops, self.act.backward)
        dx, d_gate, d_up = backward(dh, x, gate, up, gate_product, up_product, *self.act.form)
        d_gate_up[expert, : len(gate)], d_gate_up[expert, len(gate) :] = d_gate, d_up
        return dx


class _PairGated:
    """Experts whose gate is one of uniop's ops on a gate/up product (:data:`_GATES`): ``linear``
    onto the product (with its bias where the module has biases; a transposed weight, GPT-OSS's
    ``[E, H, 2I]``, read as ``[2I, H]`` through swapped strides, no copy), the gate's op with the
    module's arguments (``kwargs``) on the product's interleaved pairs or halves, and ``linear`` for
    the down projection.

    Trained on :class:`_Experts` in float32 and bfloat16: the tiny GPT-OSS's training step ran
    1.05–1.11x and 1.13–1.28x as fast as on transformers' grouped forward (which runs the gate as
    seven ops on strided views); float16 is unmeasured."""

    trains_in = frozenset({torch.float32, torch.bfloat16})

    def __init__(self, op, transposed, biased, **kwargs):
        self.op, self.transposed, self.biased, self.kwargs = op, transposed, biased, kwargs

    def weights(self, module):
        if self.biased:
            return module.gate_up_proj, module.gate_up_proj_bias, module.down_proj, module.down_proj_bias
        return module.gate_up_proj, module.down_proj

    def _split(self, weights):
        """The projections' weights and biases (None without): ``gate_up, gate_up_bias, down, down_bias``."""
        return weights if self.biased else (weights[0], None, weights[1], None)

    def _linear(self, x, weight, bias, expert):
        weight = weight[expert].mT if self.transposed else weight[expert]
        return unn.uniop_ops.linear(x, weight, None if bias is None else bias[expert])

    def mlp(self, weights, kept=None):
        """``mlp(expert, x)``; with a ``kept`` list, each expert's input rows, gate/up product,
        activation and output appended to it, for :meth:`backward`."""
        gate_up_proj, gate_up_bias, down_proj, down_bias = self._split(weights)

        def mlp(expert, x):
            gate_up = self._linear(x, gate_up_proj, gate_up_bias, expert)
            h = getattr(unn.uniop_ops, self.op)(gate_up, **self.kwargs)
            y = self._linear(h, down_proj, down_bias, expert)
            if kept is not None:
                kept.append((x, gate_up, h, y))
            return y

        return mlp

    def _linear_backward(self, dy, x, weight):
        """``(dx, d weight)`` of one expert's projection: ``matmul_backward`` for a weight stored
        ``[in, out]`` (``matmul``'s right operand, whose gradient comes in that layout;
        ``linear_backward``'s would come transposed), ``linear_backward`` for one stored ``[out, in]``."""
        if self.transposed:
            return unn.uniop_ops.matmul_backward(dy, x, weight)
        return unn.uniop_ops.linear_backward(dy, x, weight)[:2]

    def backward(self, expert, weights, grads, dy, kept):
        """One expert's backward of its down projection, its gate op's backward and the backward of
        its gate/up projection; writes its slices of ``grads`` (each bias's gradient its
        output's summed over rows), returns the gradient of its input rows."""
        gate_up_proj, _, down_proj, _ = self._split(weights)
        d_gate_up, d_gate_up_bias, d_down, d_down_bias = self._split(grads)
        x, gate_up, h, _ = kept
        dh, d_down[expert] = self._linear_backward(dy, h, down_proj[expert])
        d_gate_up_product = getattr(unn.uniop_ops, self.op + "_backward")(dh, gate_up, **self.kwargs)
        dx, d_gate_up[expert] = self._linear_backward(d_gate_up_product, x, gate_up_proj[expert])
        if self.biased:
            d_down_bias[expert], d_gate_up_bias[expert] = dy.float().sum(0), d_gate_up_product.float().sum(0)
        return dx


class _Experts(torch.autograd.Function):
    """The experts forward (the form's MLP keeping what its backward needs of each expert: input
    rows, products, activation, and its output last) and its backward: per expert, the form's backward on the
    kept products, each weight's gradient written into its expert's slice of one buffer.

    Why one node rather than autograd over the per-expert calls: there, the gradient of one
    expert's slice of a 3-D weight is a buffer the size of the whole weight, so the backward wrote
    every expert's weights once per expert (a tiny Mixtral's training step ran 0.74x transformers'
    in float32). The routing weights get their gradient too (the router trains): each pair's is
    the upstream gradient of its token dotted with its expert's output."""

    @staticmethod
    def forward(ctx, hidden_states, top_k_weights, routes, form, *weights):
        ctx.kept = []
        out = _routed_sum(hidden_states, routes, form.mlp(weights, ctx.kept))
        ctx.save_for_backward(*weights)
        ctx.routes, ctx.form = routes, form
        ctx.inputs = hidden_states.shape, hidden_states.dtype, top_k_weights.shape, top_k_weights.dtype
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        weights, routes = ctx.saved_tensors, ctx.routes
        hidden_shape, dtype, weights_shape, weights_dtype = ctx.inputs
        dout = dout.float()
        d_hidden = torch.zeros(hidden_shape, dtype=torch.float32)
        grads = [torch.zeros_like(w) for w in weights]
        d_sorted_weights = torch.zeros(routes.order.shape, dtype=torch.float32)
        for (expert, pairs), kept in zip(routes.slices, ctx.kept):
            rows = routes.tokens[pairs]
            d_rows = dout[rows]
            d_sorted_weights[pairs] = (d_rows * kept[-1].float()).sum(-1)
            dy = (d_rows * routes.weights[pairs, None]).to(dtype)
            d_hidden.index_add_(0, rows, ctx.form.backward(expert, weights, grads, dy, kept).float())
        d_weights = torch.empty_like(d_sorted_weights)
        d_weights[routes.order] = d_sorted_weights
        d_weights = d_weights.view(weights_shape).to(weights_dtype)
        return d_hidden.to(dtype), d_weights, None, None, *grads
