"""``nn.Module`` sugar over ``torch.ops.uniop``, with Hugging Face Llama's parameter names and
dtype rules, so a state dict loads into either and the modules drop into a Llama model.

- :class:`RMSNorm` — ``LlamaRMSNorm``: ``weight``; output dtype is ``promote(weight, input)``, as
  HF's ``weight * x.to(input_dtype)`` (fp32 weight with bf16 input gives fp32).
- :class:`SwiGLUMLP` — ``LlamaMLP``: ``gate_proj``, ``up_proj``, ``down_proj``;
  ``down(silu(gate(x)) * up(x))`` with both projections and the activation in one uniop op
  (``linear_silu_mul``, or ``linear_silu_mul_train`` where autograd records it; with biases, the
  activation alone). :func:`gated` runs the same for any HF MLP gated by SiLU or GELU (Gemma's).
- :class:`RotaryEmbedding` — HF's default rope: ``forward(x, position_ids) -> (cos, sin)`` shaped
  ``[B, S, head_dim]`` in ``x``'s dtype; :func:`apply_rotary_pos_emb` applies them (HF signature).
- :class:`LayerNorm` — ``torch.nn.LayerNorm`` (GPT-2, BERT, Falcon, Phi): ``weight``, ``bias``;
  output in the input's dtype, as torch's.
- :class:`Attention` — ``LlamaAttention``'s projections ``q_proj``/``k_proj``/``v_proj``/``o_proj``
  with GQA, rope and uniop's flash attention (causal).
- :class:`Int8Linear` — ``nn.Linear`` with its weight quantized to int8 per output feature
  (``weight`` int8, ``scales``, ``bias``), run by ``linear_int8``; :func:`quantize_int8` swaps a
  model's linear layers for it (a Llama's, patched or not, included).

The modules trace with ``torch.fx.symbolic_trace`` too: what a forward decides from its input
(dtype rules, whether autograd records the call, the kind of mask) happens inside a function
registered with ``torch.fx.wrap``, which the graph calls as one node and which decides again on
each run, since a symbolic trace sees no values to decide on.
"""

from __future__ import annotations

import weakref
from typing import NamedTuple

import torch
from torch import nn

import uniop


def _torch_must_see_the_call():
    """Whether a call has to go through torch's dispatcher to be right: autograd may record it,
    torch.compile/export, ``torch.jit.trace`` or ``torch.fx.symbolic_trace`` may be tracing it,
    autocast may cast its inputs, a torch function or dispatch mode (fake tensors,
    functionalization, a ``torch.device`` context) or a functorch transform (vmap, grad) wants to
    see it, or the torch profiler should list it under its op name. Cheapest and commonest first;
    ``is_compiling`` before any private check, so that dynamo, which folds it to True, never traces
    those."""
    return (
        torch.is_grad_enabled()
        or torch.compiler.is_compiling()
        or torch._C._is_any_autocast_enabled()
        or torch._C._is_torch_function_mode_enabled()
        or torch._C._len_torch_dispatch_stack() > 0
        or torch._C._functorch.peek_interpreter_stack() is not None
        or torch._C._get_tracing_state() is not None
        or torch._C._autograd._profiler_enabled()
        or _fx_symbolic_tracing()
    )


# torch.fx.symbolic_trace's per-thread flag. Its reader, `_get_is_fx_tracing`, takes 0.45 µs on a
# thread that has never traced (getattr's default after a missed attribute), a third of this
# check's time on the direct route; the thread's attribute dict answers in 0.05 µs.
_FX_TRACING = getattr(torch.fx._symbolic_trace, "_is_fx_tracing_tls", None)


def _fx_symbolic_tracing():
    if _FX_TRACING is None:
        return torch.fx._symbolic_trace.is_fx_symbolic_tracing()
    return _FX_TRACING.__dict__.get("flag", False)


class _Ops:
    """``torch.ops.uniop`` for the modules below, calling ``uniop.<op>`` directly where torch's
    dispatcher has nothing to do (see :func:`_torch_must_see_the_call`): inference under
    ``no_grad``/``inference_mode``, as in ``generate``. Both routes run the same kernel and return
    torch-made tensors; the direct one skips ``OpOverloadPacket.__call__``, the boxed stack and
    the dispatch tables, 2-3 µs a call with hot caches and 6-13 µs with cold ones (measured on a
    decode step's ops), which is how a decode step between weight reads finds them. Ops that write
    into an argument (its schema's ``Tensor(a!)``) always take the dispatcher, which bumps the
    argument's version counter."""

    def __getattr__(self, name):
        through_torch = getattr(torch.ops.uniop, name)
        if any(a["mutated"] for a in uniop.op(name).args):
            call = through_torch
        else:
            direct = getattr(uniop, name)

            def call(*args, **kwargs):
                if _torch_must_see_the_call():
                    return through_torch(*args, **kwargs)
                return direct(*args, **kwargs)

            call.__name__ = call.__qualname__ = name
            call.__doc__ = direct.__doc__
        setattr(self, name, call)
        return call


uniop_ops = _Ops()


class RMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype))
        self.variance_epsilon = eps

    def forward(self, x):
        return _rms_norm(x, self.weight, self.variance_epsilon)

    def extra_repr(self):
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


@torch.fx.wrap
def _rms_norm(x, weight, eps):
    """:class:`RMSNorm`'s output: in ``promote(weight, x)``, as HF's ``weight * x.to(input_dtype)``
    (the weight's own dtype, before it is cast to ``x``'s for the op)."""
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    if weight.dtype not in (x.dtype, torch.float32):
        weight = weight.to(x.dtype)
    y = uniop_ops.rms_norm(x, weight, eps)[0]
    return y if y.dtype == out_dtype else y.to(out_dtype)


class LayerNorm(nn.Module):
    """``torch.nn.LayerNorm`` over the last dims (``normalized_shape``) on uniop's ``layer_norm``,
    with its parameter names (``weight``, ``bias``) and its dtype rule: the output in the input's
    dtype, float32 parameters taken as they are. Without ``elementwise_affine`` the weight is a
    float32 ones buffer (``layer_norm`` takes a weight)."""

    def __init__(self, normalized_shape, eps=1e-5, elementwise_affine=True, bias=True, dtype=None):
        super().__init__()
        shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
        self.normalized_shape, self.eps, self.elementwise_affine = shape, eps, elementwise_affine
        if elementwise_affine:
            self.weight = nn.Parameter(torch.ones(shape, dtype=dtype))
            self.bias = nn.Parameter(torch.zeros(shape, dtype=dtype)) if bias else None
        else:
            self.register_buffer("weight", torch.ones(shape), persistent=False)
            self.bias = None

    def forward(self, x):
        return _layer_norm(x, self.weight, self.bias, self.eps)

    def extra_repr(self):
        return f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"


@torch.fx.wrap
def _layer_norm(x, weight, bias, eps):
    """:class:`LayerNorm`'s output, in ``x``'s dtype (float32 parameters taken as they are)."""
    if weight.dtype not in (x.dtype, torch.float32):
        weight, bias = weight.to(x.dtype), None if bias is None else bias.to(x.dtype)
    return uniop_ops.layer_norm(x, weight, bias, eps)[0]


class SwiGLUMLP(nn.Module):
    def __init__(self, hidden_size, intermediate_size, bias=False, dtype=None):
        super().__init__()
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias, dtype=dtype)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias, dtype=dtype)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias, dtype=dtype)
        self.act_fn = nn.SiLU()  # as LlamaMLP's: what `gated` reads

    def forward(self, x):
        return self.down_proj(gated(self, x))


# The slots on a module where `_kept` keeps what it derives from its weights.
_KEPT_SLOTS = ("_uniop_packed", "_uniop_packed_pair", "_uniop_offset_weight")


def _kept(owner, slot, weights, make):
    """``make()``, made on first use and kept on ``owner`` (outside its state dict) under ``slot``
    until one of ``weights`` changes: its storage, dtype, shape or version counter (which in-place
    updates such as ``load_state_dict``'s ``copy_`` bump)."""
    key = tuple((w.data_ptr(), w._version, w.dtype, tuple(w.shape)) for w in weights)
    cached = owner.__dict__.get(slot)
    if cached is not None and cached[0] == key:
        return cached[1]
    value = make()
    owner.__dict__[slot] = (key, value)
    return value


def packed_weight(owner, *weights):
    """``uniop.pack_weight(*weights)`` (one weight, or a gate/up pair), packed on first use and
    kept on ``owner`` until a weight changes (see :func:`_kept`). The packed copy is as large as
    the weights."""
    slot = "_uniop_packed_pair" if len(weights) == 2 else "_uniop_packed"
    return _kept(owner, slot, weights, lambda: uniop.pack_weight(*weights))


def offset_weight(norm):
    """``1 + norm.weight`` in float32, the weight a Gemma RMSNorm scales by: computed per call where
    torch has to see it (autograd records it, tracing, ...), else kept on ``norm`` until the weight
    changes (see :func:`_kept`): the add took ~7.5 µs, more than the ~6 µs ``rms_norm`` of a
    decode row it feeds."""
    weight = norm.weight
    if _torch_must_see_the_call():
        return 1.0 + weight.float()
    return _kept(norm, "_uniop_offset_weight", (weight,), lambda: 1.0 + weight.float())


def drop_kept_weights(module):
    """Drops what :func:`packed_weight` and :func:`offset_weight` kept on ``module`` and its
    submodules."""
    for mod in module.modules():
        for slot in _KEPT_SLOTS:
            mod.__dict__.pop(slot, None)


def _takes_packed(packed, x, *weights):
    """Whether a product of ``x`` goes through weights packed ahead: asked for (``packed``), no
    autograd, tracing or other torch machinery needs to see the call, and the weights are in
    ``x``'s dtype, one ``pack_weight`` packs (bfloat16, float32)."""
    return (
        packed
        and x.dtype in (torch.bfloat16, torch.float32)
        and all(w.dtype == x.dtype for w in weights)
        and not _torch_must_see_the_call()
    )


def _plain(linear):
    """Whether ``linear`` is a bias-free ``nn.Linear`` (an exact type: a wrapper such as a LoRA
    layer adds to its product)."""
    return type(linear) is nn.Linear and linear.bias is None


# The float dtypes uniop's ops take (their sums are float32 in each).
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


class Gating(NamedTuple):
    """One of uniop's gated activations: its ops' names and their trailing arguments
    (``linear_silu_mul(x, gate_weight, up_weight)``, ``linear_gelu_mul(x, gate_weight, up_weight,
    form)``) and their backward (``linear_silu_mul_backward``), named once rather than formatted
    in every call. ``glu`` is the op on one tensor's halves (``swiglu(x, -1)``, ``geglu(x, -1,
    form, True)``: the gate first, as HF's fused ``gate_up_proj``), with ``glu_args`` after ``x``."""

    mul: str
    fused: str
    train: str
    packed: str
    backward: str
    form: tuple
    glu: str
    glu_args: tuple


def _gating(name, glu, form=()):
    linear = f"linear_{name}_mul"
    # geglu gates the second half unless activate_left (aclnn's GeGlu); swiglu always the first.
    glu_args = (-1, *form, True) if form else (-1,)
    ops = [f"{name}_mul", linear, *(f"{linear}_{suffix}" for suffix in ("train", "packed", "backward"))]
    return Gating(*ops, form, glu, glu_args)


SILU = _gating("silu", "swiglu")
GELU_ERF = _gating("gelu", "geglu", ("none",))
GELU_TANH = _gating("gelu", "geglu", ("tanh",))
# transformers' activation modules by class name (ACT2FN): "silu"/"swish"; "gelu" and
# "gelu_python" (erf); "gelu_pytorch_tanh", "gelu_python_tanh" and "gelu_new" (the tanh form:
# one formula, evaluated alike up to rounding).
_HF_GATINGS = {
    "SiLUActivation": SILU,
    "GELUActivation": GELU_ERF,
    "GELUTanh": GELU_TANH,
    "PytorchGELUTanh": GELU_TANH,
    "NewGELUActivation": GELU_TANH,
}


def gating(module):
    """A Hugging Face MLP's or experts module's activation (``act_fn``; Phi3's
    ``activation_fn``) as uniop's gated ops take it (:data:`SILU`, :data:`GELU_ERF`,
    :data:`GELU_TANH`): ``nn.SiLU``, ``nn.GELU`` and transformers' own (see ``_HF_GATINGS``;
    Gemma's "gelu_pytorch_tanh" is ``GELU_TANH``). None for any other activation."""
    activation = getattr(module, "act_fn", getattr(module, "activation_fn", None))
    if isinstance(activation, nn.SiLU):
        return SILU
    if isinstance(activation, nn.GELU):
        return GELU_TANH if activation.approximate == "tanh" else GELU_ERF
    return _HF_GATINGS.get(type(activation).__name__)


def gated(mlp, x, fuse=True, packed=False):
    """``act(gate(x)) * up(x)`` for an MLP with HF's projection names: ``gate_proj`` and
    ``up_proj``, or one ``gate_up_proj`` whose output's first half is the gate and second half the
    up projection (Phi3); ``act`` its activation, SiLU or GELU (see :func:`gating`; a ValueError
    for any other). One ``linear_silu_mul`` (``linear_gelu_mul``) when ``fuse`` and the
    projections are bias-free ``nn.Linear`` layers (a fused one's weight read as its two halves,
    views), else the projections and ``silu_mul`` (``gelu_mul``; ``swiglu``, ``geglu``, of a fused
    one's output). Where autograd records the call, ``linear_silu_mul_train`` instead: it keeps the two
    products for the backward, which then takes four products rather than six. With ``packed``
    (inference), ``linear_silu_mul_packed`` on the pair packed once (:func:`packed_weight`)."""
    act = gating(mlp)
    if act is None:
        activation = getattr(mlp, "act_fn", getattr(mlp, "activation_fn", None))
        raise ValueError(f"uniop.torch.nn.gated: expected a SiLU or GELU activation, got {activation!r}")
    fused = getattr(mlp, "gate_up_proj", None)
    projections = [fused] if fused is not None else [mlp.gate_proj, mlp.up_proj]
    if not (fuse and all(_plain(p) for p in projections)):
        if fused is not None:
            return getattr(uniop_ops, act.glu)(fused(x), *act.glu_args)
        return getattr(uniop_ops, act.mul)(mlp.gate_proj(x), mlp.up_proj(x), *act.form)
    weights = fused.weight.chunk(2) if fused is not None else [p.weight for p in projections]
    if _takes_packed(packed, x, *weights):
        packed_op = getattr(uniop_ops, act.packed)
        return packed_op(x, packed_weight(mlp, *weights), weights[0].shape[0], *act.form)
    return _linear_gated_mul(x, *weights, act)


@torch.fx.wrap
def _linear_gated_mul(x, gate_weight, up_weight, act):
    """``act(x @ gate_weightᵀ) * (x @ up_weightᵀ)`` in one op, the one that keeps the two products
    where autograd records the call (see :func:`gated`)."""
    if torch.is_grad_enabled() and (x.requires_grad or gate_weight.requires_grad or up_weight.requires_grad):
        return getattr(uniop_ops, act.train)(x, gate_weight, up_weight, *act.form)[0]
    return getattr(uniop_ops, act.fused)(x, gate_weight, up_weight, *act.form)


def add_rms_norm(norm, x, residual):
    """``(norm(residual + x), residual + x)`` for an :class:`RMSNorm` (or a patched ``LlamaRMSNorm``)
    or a norm whose forward scales by :func:`offset_weight` (a patched Gemma RMSNorm, see
    :func:`scales_by_offset_weight`): one ``add_rms_norm`` where it computes the same (inputs of
    one dtype, and for an ``RMSNorm`` its weight too), else the add and ``norm``."""
    forward = type(norm).forward
    if x.dtype == residual.dtype:
        if forward is RMSNorm.forward and norm.weight.dtype == x.dtype:
            y, _, total = uniop_ops.add_rms_norm(x, residual, norm.weight, norm.variance_epsilon)
            return y, total
        if forward in _OFFSET_FORWARDS and x.device.type == "cpu" and x.dtype in _FLOATS:
            # As the forward's rms_norm: float32 sums and weight, one rounding to x's dtype.
            y, _, total = uniop_ops.add_rms_norm(x, residual, offset_weight(norm), norm.eps)
            return y, total
    total = residual + x
    return norm(total), total


# Norm forwards that compute `rms_norm(x, offset_weight(norm), norm.eps)` on CPU floats (weakly
# held: an unpatched class's forward goes away with it).
_OFFSET_FORWARDS = weakref.WeakSet()


def scales_by_offset_weight(forward):
    """Marks a norm's ``forward`` as computing ``rms_norm(x, offset_weight(norm), norm.eps)`` for
    float tensors on the CPU, which lets :func:`add_rms_norm` fuse the residual add into it.
    Returns ``forward``."""
    _OFFSET_FORWARDS.add(forward)
    return forward


def linear_add(linear, x, residual, fuse=True, packed=False):
    """``residual + linear(x)``: one ``linear_add`` (the sum rounded once) when ``fuse`` and ``linear``
    is a bias-free ``nn.Linear`` (an exact type, see :func:`_plain`) in the inputs' dtype outside
    autocast (which would cast the residual too), else the layer and an add. With ``packed``
    (inference), ``linear_add_packed`` on the weight packed once (:func:`packed_weight`)."""
    same = linear.weight.dtype == x.dtype == residual.dtype and not torch.is_autocast_enabled(x.device.type)
    if fuse and _plain(linear) and same:
        if _takes_packed(packed, x, linear.weight):
            weight = packed_weight(linear, linear.weight)
            return uniop_ops.linear_add_packed(x, weight, linear.out_features, residual)
        return uniop_ops.linear_add(x, linear.weight, residual)
    return residual + linear(x)


class Int8Linear(nn.Module):
    """``nn.Linear`` with a weight-only int8 weight: ``y = x @ (weight * scales[:, None]).T + bias``,
    one ``linear_int8``. ``weight`` (a buffer) is int8 ``[out_features, in_features]``, quantized
    symmetrically per output feature: ``scales`` ``[out_features]`` (float32, or the input's dtype)
    and ``bias`` are parameters that do not require a gradient (a quantized base is frozen; set
    ``requires_grad`` to tune them, PEQA's way). Gradients flow to the input, so adapters train
    beside it (QLoRA's pattern). Build one from a trained layer with :meth:`from_linear`."""

    def __init__(self, in_features, out_features, bias=True, dtype=None, scale_dtype=torch.float32):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=torch.int8))
        self.scales = nn.Parameter(torch.ones(out_features, dtype=scale_dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype), requires_grad=False) if bias else None

    @classmethod
    def from_linear(cls, linear, scale_dtype=torch.float32):
        """``linear`` (an ``nn.Linear``) quantized: each output feature's weights divided by
        ``max |w| / 127`` (its scale) and rounded to the nearest int8 in [-127, 127] (torchao's
        ``int8_weight_only``, symmetric); the bias kept in the layer's dtype."""
        w = linear.weight.detach().float()
        scales = (w.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, linear.weight.dtype, scale_dtype)
        layer.weight.copy_(torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8))
        layer.scales.data.copy_(scales)
        if linear.bias is not None:
            layer.bias.data.copy_(linear.bias.detach())
        return layer

    def dequantized(self):
        """The weight as the layer computes with it, in float32: ``weight * scales[:, None]``."""
        return self.weight.float() * self.scales.float()[:, None]

    def forward(self, x):
        return uniop_ops.linear_int8(x, self.weight, self.scales, self.bias)

    def extra_repr(self):
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def quantize_int8(module, skip=("lm_head",), scale_dtype=torch.float32):
    """Swaps every ``nn.Linear`` inside ``module`` (exactly that type) for
    :meth:`Int8Linear.from_linear` of it, in place, and returns ``module``; layers whose qualified
    name ends with an entry of ``skip`` stay (a model's output head, by default, whose error every
    logit carries). Quantize before adding adapters (QLoRA's order): a LoRA wrapper's own
    ``nn.Linear`` layers (its base and its adapters alike) are reached through it, so afterwards
    the adapters would need naming in ``skip``. Quantizing after ``patch_llama`` or before both
    work: the patched MLPs call a projection that is not an ``nn.Linear`` as a module."""
    for name, child in list(module.named_modules()):
        for attr, layer in list(child.named_children()):
            qualified = f"{name}.{attr}" if name else attr
            if type(layer) is nn.Linear and not any(qualified.endswith(s) for s in skip):
                setattr(child, attr, Int8Linear.from_linear(layer, scale_dtype))
    return module


class RotaryEmbedding(nn.Module):
    """cos/sin tables from positions (uniop's ``rope_cos_sin``: HF's default rope, mode 'half')."""

    def __init__(self, head_dim, base=10000.0):
        super().__init__()
        self.head_dim, self.base = head_dim, float(base)

    def forward(self, x, position_ids):
        cos, sin = uniop_ops.rope_cos_sin(position_ids, self.head_dim, self.base, "half", x.dtype)
        return cos, sin


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1, per_pair=False):
    """HF's ``apply_rotary_pos_emb``: q/k ``[B, H, S, D]``, cos/sin ``[B, S, D]`` (any strides).
    ``per_pair``: cos/sin ``[B, S, D/2]``, one value per rotated pair (GPT-OSS's tables)."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return uniop_ops.rope(q, cos, sin, "half", per_pair), uniop_ops.rope(k, cos, sin, "half", per_pair)


class Attention(nn.Module):
    """Causal self-attention with GQA: ``forward(x [B, S, hidden], cos, sin, attention_mask=None)
    -> [B, S, hidden]``. ``attention_mask`` hides keys on top of the causal mask: a ``[B, S]``
    padding mask (1 for tokens, 0 for padding, as tokenizers return it) or a mask broadcastable to
    ``[B, heads, S, S]``: boolean (true = attend) or float (added to the scaled scores; −inf and the
    dtype's lowest value, transformers 4.x's padding, hide; no gradient flows to it). A query left
    without keys (a left-padded position) gets 0.
    ``softcap`` caps the scaled scores to ``softcap · tanh(score / softcap)`` before the masks
    (Gemma 2's ``attn_logit_softcapping``). ``sinks=True`` learns one sink logit per head
    (``self.sinks``, GPT-OSS's name; zeros at first), one more term in each softmax's denominator."""

    def __init__(
        self,
        hidden_size,
        num_heads,
        num_kv_heads=None,
        head_dim=None,
        bias=False,
        dtype=None,
        softcap=None,
        sinks=False,
    ):
        super().__init__()
        self.softcap = softcap
        self.sinks = nn.Parameter(torch.zeros(num_heads, dtype=dtype)) if sinks else None
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads or num_heads
        self.head_dim = head_dim or hidden_size // num_heads
        kv = self.num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(hidden_size, num_heads * self.head_dim, bias=bias, dtype=dtype)
        self.k_proj = nn.Linear(hidden_size, kv, bias=bias, dtype=dtype)
        self.v_proj = nn.Linear(hidden_size, kv, bias=bias, dtype=dtype)
        self.o_proj = nn.Linear(num_heads * self.head_dim, hidden_size, bias=bias, dtype=dtype)

    def forward(self, x, cos, sin, attention_mask=None):
        b, s = x.shape[0], x.shape[1]
        mask = None if attention_mask is None else _key_mask(attention_mask)
        # [B, S, H, D] projections viewed as [B, H, S, D]: uniop reads the strides in place.
        q = self.q_proj(x).view(b, s, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        out = uniop_ops.attention(q, k, v, None, True, None, mask, self.softcap, self.sinks)[0]
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


@torch.fx.wrap
def _key_mask(mask):
    """:class:`Attention`'s ``attention_mask`` as ``attention``'s ``mask``: a ``[B, S]`` padding mask
    as booleans broadcast over heads and queries, any other as it is."""
    return mask.bool()[:, None, None, :] if mask.dim() == 2 else mask
