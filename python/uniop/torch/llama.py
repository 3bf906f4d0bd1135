"""Swap Hugging Face Llama's hot pieces for uniop ops, before or after a model is built.

:func:`patch_llama` replaces ``LlamaRMSNorm.forward`` (uniop ``rms_norm``, HF's dtype rule kept),
``LlamaMLP.forward`` (with SiLU or GELU: both projections and the activation as one
``linear_silu_mul`` or ``linear_gelu_mul`` where uniop's GEMM is the faster one — see below —, else
the projections around uniop's fused ``silu_mul`` or ``gelu_mul``), ``LlamaDecoderLayer.forward``
(its two residual adds fused into the ops beside them: ``add_rms_norm`` after attention,
``linear_add`` for the MLP's down projection),
``LlamaAttention.forward`` (plain calls on uniop attention run straight through, see
:func:`_attention_forward`), ``LlamaRotaryEmbedding.forward`` (uniop ``rope_cos_sin`` of the
module's own frequencies, see :func:`_rotary_forward`) and ``modeling_llama.apply_rotary_pos_emb``
(uniop ``rope``), and the same pieces of the families transformers builds as it builds Llama:
Mistral, Qwen2, Qwen3, Phi3, Gemma, Gemma2, Gemma3 and the mixture-of-experts Mixtral, Qwen2-MoE and
Qwen3-MoE, whose experts run uniop's experts implementation (see ``_FAMILIES``,
:mod:`.experts_interface`), and GPT-OSS's norms, rope (its tables one value per pair), attention
and experts. Methods are patched on the classes, so
existing instances change too. Given a model, it also switches the model's attention to uniop's flash
attention (registered with transformers as the ``"uniop"`` implementation by
:func:`~uniop.torch.register_attention`; transformers' 4-D masks, boolean or float, go to uniop
``attention``'s ``mask``, Gemma2's logit soft-capping to its ``softcap``, GPT-OSS's attention sinks
to its ``sinks``; dropout falls back to SDPA), a causal LM's loss to uniop
``cross_entropy`` (see :func:`_causal_lm_loss`) and its linear layers (projections and ``lm_head``)
to uniop ``linear``, which streams the weight at memory speed when there are few rows — decoding
spends most of its time there — and prefill-sized products too: in bfloat16 always, in float32 where
uniop's GEMM is the faster one on this CPU (with AVX-512 on CPUs other than Intel's). It also makes
transformers' ``DynamicLayer.update`` (the default KV cache) grow in place: the cache becomes a view
of a buffer with room to spare, so a decode step writes its new rows instead of copying the whole
cache with ``torch.cat`` (O(length) per layer and step). With ``pack_weights=True``, prefill-sized
products take weights packed once (see :func:`patch_llama`). The ops themselves are called through
:data:`uniop.torch.nn.uniop_ops`, which skips torch's dispatcher where it has nothing to do
(inference under ``no_grad``).
:func:`unpatch_llama` restores all of it.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

import uniop

from . import nn as unn
from .attention_interface import ATTENTION, register_attention, takes_mask
from .experts_interface import covers, register_experts

# {(class or module, attribute): what patch_llama replaced}
_originals = {}
# (model, its attention and experts implementations before patching (experts: None before
# transformers 5), its patched linears, its own `_loss_function` before patching: _NO_LOSS where it
# had none, None where its loss stays)
_models = []
_NO_LOSS = object()


# transformers families built as Llama is (module name: class-name prefix). Mistral's, Qwen2's,
# Qwen3's and Gemma's modeling files copy Llama's MLP, decoder layer and rotary embedding and its
# `apply_rotary_pos_emb`, and all but Gemma its RMSNorm (their forwards read as Llama's with the
# names changed; transformers 5.24, source against source). What differs, the patched forwards
# handle: a sliding window (Mistral, Phi3, Gemma3; Qwen2's and Qwen3's windowed layers), which
# transformers builds into each layer's mask; Qwen3's and Gemma3's RMSNorm of each head's queries
# and keys before the rope (`q_norm`, `k_norm`); Phi3's fused projections (`qkv_proj`,
# `gate_up_proj`), dropout on its residual branches and partial rotary dim (`rope` leaves the dims
# past the tables' as they are); Gemma's RMSNorm, which scales by `1 + weight` in float32
# (`_OFFSET_NORMS`), and its GELU-gated MLP (`gelu_pytorch_tanh`: uniop's GELU-gated ops, tanh
# form; an activation uniop has no gated op for keeps transformers' MLP and decoder layer);
# Gemma2's and Gemma3's decoder layers, which norm the attention's and the MLP's outputs before
# their residual adds (`_OWN_LAYERS`: transformers' forward); Gemma2's attention logit
# soft-capping (`attn_logit_softcapping`: uniop attention's `softcap`; transformers runs Gemma2 on
# its eager attention, SDPA having none) and Gemma3's rotary table per layer type.
# The mixture-of-experts families (Mixtral, Qwen2-MoE, Qwen3-MoE) copy Mistral's, Qwen2's and
# Qwen3's modules around their MoE blocks, whose experts run uniop's experts implementation
# (`experts_interface`) and whose layers keep transformers' forward (the fused residual add is the
# dense MLP's; Qwen's dense layers and shared experts are Llama's MLP). Mixtral has no dense MLP
# class. GPT-OSS copies Llama's RMSNorm but for its last step (`weight * x` in float32, rounded
# once: what uniop `rms_norm` computes) and attention but for its sinks (`s_aux`: uniop attention's
# `sinks`; transformers runs GPT-OSS on its eager attention, SDPA having none). Its `GptOssMLP` is
# the MoE block, whose experts (interleaved gate/up with biases, a clamped SwiGLU) run uniop's
# experts implementation (`linear` with bias, `clamped_swiglu`) and whose layer keeps transformers'
# forward; its rotary tables hold one value per rotated pair (half the head dim wide, yarn by
# default): uniop `rope`'s `per_pair` tables (`_PAIR_ROPES`).
_FAMILIES = {
    "llama": "Llama",
    "mistral": "Mistral",
    "qwen2": "Qwen2",
    "qwen3": "Qwen3",
    "phi3": "Phi3",
    "gemma": "Gemma",
    "gemma2": "Gemma2",
    "gemma3": "Gemma3",
    "mixtral": "Mixtral",
    "qwen2_moe": "Qwen2Moe",
    "qwen3_moe": "Qwen3Moe",
    "gpt_oss": "GptOss",
}
_OFFSET_NORMS = {"Gemma", "Gemma2", "Gemma3"}
_OWN_LAYERS = {"Gemma2", "Gemma3", "GptOss"}
_MOE_MLPS = {"GptOss"}
_PAIR_ROPES = {"GptOss"}


def _modelings():
    """``{class-name prefix: modeling module}`` of the families this transformers has (Qwen3
    came in 4.51)."""
    import importlib

    found = {}
    for family, prefix in _FAMILIES.items():
        try:
            found[prefix] = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
        except ImportError:
            continue
    return found


def _family_class(modeling, prefix, name):
    return getattr(modeling, prefix + name)


def _decoder_layers():
    return tuple(_family_class(m, prefix, "DecoderLayer") for prefix, m in _modelings().items())


def _offset_norm_forward(original):
    """Gemma's RMSNorm forward, ``(norm(x) * (1 + weight))`` in float32 rounded once to x's dtype,
    as one uniop ``rms_norm`` with the float32 weight ``1 + weight`` (its sums are float32 in
    every dtype, its output in x's; :func:`~uniop.torch.nn.offset_weight` keeps it between calls
    no gradient needs). Off the CPU, or in another dtype, transformers' forward."""

    def forward(self, x):
        if x.device.type != "cpu" or x.dtype not in unn._FLOATS:
            return original(self, x)
        return unn.uniop_ops.rms_norm(x, unn.offset_weight(self), self.eps)[0]

    return unn.scales_by_offset_weight(forward)


def _drops_residuals(layer):
    """Whether a decoder layer's residual branches go through live dropout (Phi3's, training with
    ``resid_pdrop`` > 0), which the fused residual adds leave out."""
    dropouts = (getattr(layer, name, None) for name in ("resid_attn_dropout", "resid_mlp_dropout"))
    return layer.training and any(d is not None and d.p > 0 for d in dropouts)


def _layer_forward(original, mlp_class):
    """``LlamaDecoderLayer.forward`` (or a family's copy, whose MLP is ``mlp_class``) with its
    residual adds fused: the one after attention into the post-attention RMSNorm
    (``add_rms_norm``), the one after the MLP into its down projection (``linear_add``). Layers
    called other than as ``LlamaModel`` calls them (hidden states, the rest by keyword), with a
    replaced MLP or with live dropout on the residual branches keep transformers' forward."""

    def forward(self, hidden_states, *args, **kwargs):
        mlp = self.mlp
        if args or type(mlp) is not mlp_class or unn.gating(mlp) is None or _drops_residuals(self):
            return original(self, hidden_states, *args, **kwargs)
        fuse, packed = _on_uniop_gemm(hidden_states), _packs(hidden_states)
        h, _ = self.self_attn(hidden_states=self.input_layernorm(hidden_states), **kwargs)
        h, residual = unn.add_rms_norm(self.post_attention_layernorm, h, hidden_states)
        return unn.linear_add(mlp.down_proj, unn.gated(mlp, h, fuse, packed), residual, fuse, packed)

    return forward


def _attention_forward(original, per_pair=False):
    """``LlamaAttention.forward`` for a model on uniop attention, straight through: the
    projections, ``rope``, the cache update and ``attention``, without the attention-interface
    lookup, the interface's output copy and the deprecated-argument wrapper. In a tiny Llama's fp32
    decode step the attention module took ~330 µs a layer of which its ops took ~235; this path
    decoded 1.02-1.06x faster (alternated in one process). A padded batch's 4-D mask (boolean, or
    float as transformers 4.x makes it) goes to ``attention``'s ``mask``, as does a sliding
    window's (transformers builds it per layer type; the interface's ``sliding_window`` argument
    only repeats it), Gemma2's ``attn_logit_softcapping`` to its ``softcap``, GPT-OSS's ``sinks``
    to its ``sinks`` (its rope tables one value per pair: ``per_pair``). Calls that need more —
    a mask of another rank or dtype, dropout, another attention implementation or cache type,
    positional extras — keep transformers' forward."""
    from transformers.cache_utils import DynamicCache

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, *args, **kwargs):
        plain = (
            not args
            and takes_mask(attention_mask)
            and position_embeddings is not None
            and self.config._attn_implementation == ATTENTION
            and not (self.training and self.attention_dropout)
            and not kwargs.get("output_attentions")
        )
        # transformers 5 passes the cache as `cache`, 4.x as `past_key_value(s)`.
        cache = kwargs.get("cache", kwargs.get("past_key_values", kwargs.get("past_key_value")))
        if not plain or not (cache is None or type(cache) is DynamicCache):
            return original(self, hidden_states, position_embeddings, attention_mask, *args, **kwargs)
        b, s, _ = hidden_states.shape
        q, k, v = (t.view(b, s, -1, self.head_dim) for t in _projections(self, hidden_states))
        if hasattr(self, "q_norm"):  # Qwen3 and Gemma3 normalize each head's queries and keys
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = unn.apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), *position_embeddings, per_pair=per_pair)
        v = v.transpose(1, 2)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        softcap, sinks = getattr(self, "attn_logit_softcapping", None), getattr(self, "sinks", None)
        out = unn.uniop_ops.attention(q, k, v, None, self.is_causal, self.scaling, attention_mask, softcap, sinks)[0]
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1)), None

    return forward


def _projections(attention, x):
    """The queries, keys and values of an attention module with HF's names: ``q_proj``,
    ``k_proj`` and ``v_proj``, or one ``qkv_proj`` whose features are the three one after the
    other (Phi3; split as views)."""
    if not hasattr(attention, "qkv_proj"):
        return attention.q_proj(x), attention.k_proj(x), attention.v_proj(x)
    q_width = attention.config.num_attention_heads * attention.head_dim
    kv_width = attention.config.num_key_value_heads * attention.head_dim
    return attention.qkv_proj(x).split([q_width, kv_width, kv_width], -1)


def _rotary_forward(original, per_pair=False):
    """``LlamaRotaryEmbedding.forward`` as one uniop ``rope_cos_sin`` of the module's own
    ``inv_freq`` (the same float32 angles, cos/sin within an ulp of transformers'; a table that a
    ``.to(torch.bfloat16)`` cast rounded is widened exactly, as transformers widens it) times its
    ``attention_scaling`` (1 but for YaRN and longrope) instead of six torch ops: one decode position
    took ~21-35 µs in transformers' forward and ~4 in uniop's, 512 positions in bf16 ~120 and ~65 µs.
    ``per_pair``: the family's tables hold one value per pair (GPT-OSS's).

    Every rope type's forward is that formula: the types differ in how ``inv_freq`` and the factor
    are made, at init or — dynamic NTK and longrope, which switch tables with the sequence length —
    in transformers' ``dynamic_rope_update`` decorator before the forward runs. The uniop forward
    keeps that decorator (so it updates the module exactly as before) and falls back to the
    undecorated original, not to the decorated one, which would run the update twice."""
    from transformers.modeling_rope_utils import dynamic_rope_update

    undecorated = getattr(original, "__wrapped__", original)

    def forward(self, x, position_ids, layer_type=None):
        # Gemma3 keeps a table per layer type: `{type}_inv_freq`, `{type}_attention_scaling`.
        prefix = "" if layer_type is None else f"{layer_type}_"
        inv_freq = getattr(self, prefix + "inv_freq")
        scale = getattr(self, prefix + "attention_scaling", None)
        on_cpu = x.device.type == inv_freq.device.type == "cpu"
        if scale is None or not on_cpu or x.dtype not in unn._FLOATS or position_ids.is_floating_point():
            extra = () if layer_type is None else (layer_type,)
            return undecorated(self, x, position_ids, *extra)
        inv_freq = inv_freq if inv_freq.dtype == torch.float32 else inv_freq.float()
        dim = 2 * inv_freq.numel()
        return unn.uniop_ops.rope_cos_sin(
            position_ids, dim, dtype=x.dtype, inv_freq=inv_freq, per_pair=per_pair, scale=scale
        )

    return dynamic_rope_update(forward)


def _transformers_causal_lm_loss():
    from transformers.loss.loss_utils import LOSS_MAPPING

    return LOSS_MAPPING["ForCausalLM"]


def _causal_lm_loss(
    logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100, shift_labels=None, **kwargs
):
    """transformers' ``ForCausalLMLoss`` (next-token cross-entropy, ``ignore_index`` skipped; the
    sum over ``num_items_in_batch`` when given, as gradient accumulation asks) as one uniop
    ``cross_entropy`` on the logits as they are. transformers first copies bf16 logits to float32
    (so its sums are float32); uniop's sums are float32 in every dtype, so the copy and its
    backward go: a tiny Llama's loss and its gradient (4x128 tokens, 8192 words) took 8.5 ms in
    bf16 that way and 2.1 ms this way, 4.4 and 2.6 ms in float32. Logits off the CPU or in
    another dtype keep transformers' loss."""
    if logits.device.type != "cpu" or logits.dtype not in unn._FLOATS:
        return _transformers_causal_lm_loss()(
            logits, labels, vocab_size, num_items_in_batch, ignore_index, shift_labels, **kwargs
        )
    if shift_labels is None:
        shift_labels = nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    target = shift_labels.reshape(-1).to(logits.device)
    loss = unn.uniop_ops.cross_entropy(logits.reshape(-1, vocab_size), target, ignore_index)[0]
    if num_items_in_batch is None:
        return loss
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(loss.device)
    counted = (target != ignore_index).sum()
    # The mean of no counted target is NaN; their sum, as transformers takes it, is 0.
    return torch.where(counted > 0, loss * counted, 0.0) / num_items_in_batch


def _mlp_forward(original):
    def forward(self, x):
        if unn.gating(self) is not None:
            return self.down_proj(unn.gated(self, x, fuse=_on_uniop_gemm(x), packed=_packs(x)))
        return original(self, x)

    return forward


# Up to this many rows uniop's linear (weight streamed by column bands, all cores) beats torch's
# in every dtype. Past it, each dtype goes to the faster GEMM on this CPU, per
# `uniop.gemm_kernels()` and the CPU's vendor:
# - float32: uniop's with AVX-512 on CPUs other than Intel's, where torch's BLAS (MKL) does not
#   take its AVX-512 kernels: on an AVX-512 EPYC uniop's ran the Llama prefill linears 1.02-1.31x
#   torch's (the tiny Llama's fp32 prefill 1.03x -> 1.18x patched). On an Intel Xeon (AMX) MKL's
#   ran them faster: the tiny Llama's fp32 prefill took 0.89x the time with torch's GEMM (median of
#   8 alternated pairs), so prefill keeps torch's there. On AVX2 alone torch's too: it ran a
#   tiny-Llama layer's seven 512-row linears in 11.7 ms against the `gemm` crate's 13.2 (best of 12
#   alternations), and level with uniop's own AVX2 kernel since (0.95-0.99x), which did not speed
#   up the patched fp32 prefill either.
# - bfloat16: uniop's on every CPU. Without AVX512-BF16 torch's bf16 GEMM ran at ~17-20 GFLOP/s
#   and uniop's AVX2 one at ~146 (7.9-8.5x on the Llama shapes). With AMX both use tiles, and
#   uniop's ran the tiny Llama's four 512-row linears 1.03-1.17x oneDNN's in all (0.7-0.85x on
#   384 -> 1024, 1.2-1.4x on the others; alternated, medians): bf16 prefill 1.25x the speed of
#   torch's GEMM route (median of 8 alternated pairs, at b5bb1e4). With AVX512-BF16 alone (Zen 4)
#   both GEMMs run the pair instruction at its peak (~440 GFLOP/s on 2 cores at the tiny Llama's
#   512-row shapes, 1.01-1.05x for uniop's), and the MLP's fused gate/up (1.14x the two linears
#   and the activation) and down-plus-residual products tip it: prefill 1.04x the speed of
#   torch's GEMM route (median of 8 alternated pairs, all eight 1.03-1.07x).
# - float16 keeps torch's.
_FEW_ROWS = 16


def _cpu_vendor():
    """The CPU's vendor id from Linux's ``/proc/cpuinfo`` (``"GenuineIntel"``, ``"AuthenticAMD"``),
    or ``""`` where it cannot be read."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def _all_rows_dtypes():
    kernels = uniop.gemm_kernels()
    float32 = kernels["float32"] == "avx512" and _cpu_vendor() != "GenuineIntel"
    return {torch.bfloat16, torch.float32} if float32 else {torch.bfloat16}


# Dtypes whose linears run on uniop at every row count.
_ALL_ROWS = _all_rows_dtypes()


def _on_uniop_gemm(x):
    """Whether products of ``x`` with a weight run faster on uniop's GEMM here."""
    return x.dtype in _ALL_ROWS or x.numel() <= _FEW_ROWS * x.shape[-1]


# Whether prefill-sized products of patched models take weights packed once (patch_llama's
# `pack_weights`).
_PACK = {"on": False}


def _packs(x):
    """Whether products of ``x`` take weights packed ahead: asked for, prefill-sized (few rows
    stream the unpacked weight faster) and on uniop's GEMM at every row count."""
    return _PACK["on"] and x.dtype in _ALL_ROWS and x.numel() > _FEW_ROWS * x.shape[-1]


def _linear_forward(self, x):
    if unn._takes_packed(_packs(x), x, self.weight):
        return unn.uniop_ops.linear_packed(x, unn.packed_weight(self, self.weight), self.out_features, self.bias)
    if _on_uniop_gemm(x):
        return unn.uniop_ops.linear(x, self.weight, self.bias)
    return nn.functional.linear(x, self.weight, self.bias)


# Room a growing cache layer reserves at least (positions), and its growth factor when full.
_MIN_CAPACITY = 256
_GROWTH = 2


def _dynamic_layer():
    """transformers' default KV cache layer (imported here: transformers is optional)."""
    from transformers.cache_utils import DynamicLayer

    return DynamicLayer


def _growing_update(self, key_states, value_states, *args, **kwargs):
    """``DynamicLayer.update`` writing into reserved room: the keys/values returned (and kept on
    the layer) are views of larger buffers. Anything else that replaced ``keys``/``values`` since
    (``crop``, beam reordering, ``reset``) is taken over on the next update. Traced by
    ``torch.compile``, it is transformers' update: a graph cannot write into room a previous call
    reserved (AOTAutograd fails on the views of it that come in as graph inputs). Sliding-window
    layers (``DynamicSlidingWindowLayer``) keep their own update, which drops the keys the window
    has passed."""
    if torch.compiler.is_compiling():
        return _originals[(_dynamic_layer(), "update")](self, key_states, value_states, *args, **kwargs)
    if not self.is_initialized:
        self.lazy_initialization(key_states, value_states)
    room = getattr(self, "_uniop_room", None)
    if room is None or self.keys is not room[2] or self.values is not room[3]:
        room = _take_over(self.keys, self.values, key_states)
    kbuf, vbuf, keys, _ = room
    length, new = keys.shape[-2], key_states.shape[-2]
    if length + new > kbuf.shape[-2]:
        room = _take_over(keys, room[3], key_states)
        kbuf, vbuf = room[0], room[1]
    kbuf[..., length : length + new, :].copy_(key_states)
    vbuf[..., length : length + new, :].copy_(value_states)
    self.keys, self.values = kbuf[..., : length + new, :], vbuf[..., : length + new, :]
    self._uniop_room = (kbuf, vbuf, self.keys, self.values)
    return self.keys, self.values


def _take_over(keys, values, incoming):
    """Fresh buffers holding ``keys``/``values`` (empty before the first update) with room for
    ``incoming`` and more: ``(key buffer, value buffer, keys view, values view)``."""
    length = keys.shape[-2] if keys.dim() == incoming.dim() else 0
    capacity = max(_MIN_CAPACITY, _GROWTH * (length + incoming.shape[-2]))
    shape = (*incoming.shape[:-2], capacity, incoming.shape[-1])
    kbuf = torch.empty(shape, dtype=incoming.dtype, device=incoming.device)
    vbuf = torch.empty(shape, dtype=incoming.dtype, device=incoming.device)
    if length:
        kbuf[..., :length, :].copy_(keys)
        vbuf[..., :length, :].copy_(values)
    return kbuf, vbuf, kbuf[..., :length, :], vbuf[..., :length, :]


def _swap(owner, name, make):
    """Sets ``owner.name`` to ``make(its current value)``, keeping that value for unpatching."""
    original = getattr(owner, name)
    _originals[(owner, name)] = original
    setattr(owner, name, make(original))


def _patch_classes():
    _swap(_dynamic_layer(), "update", lambda _: _growing_update)
    for prefix, modeling in _modelings().items():
        mlp = None if prefix in _MOE_MLPS else getattr(modeling, prefix + "MLP", None)
        norm = _offset_norm_forward if prefix in _OFFSET_NORMS else lambda _: unn.RMSNorm.forward
        _swap(_family_class(modeling, prefix, "RMSNorm"), "forward", norm)
        if mlp is not None:
            _swap(mlp, "forward", _mlp_forward)
        if mlp is not None and prefix not in _OWN_LAYERS:
            _swap(_family_class(modeling, prefix, "DecoderLayer"), "forward", lambda f, m=mlp: _layer_forward(f, m))
        pairs = prefix in _PAIR_ROPES
        rope = functools.partial(unn.apply_rotary_pos_emb, per_pair=True) if pairs else unn.apply_rotary_pos_emb
        _swap(modeling, "apply_rotary_pos_emb", lambda _: rope)
        _swap(_family_class(modeling, prefix, "Attention"), "forward", lambda f: _attention_forward(f, pairs))
        _swap(_family_class(modeling, prefix, "RotaryEmbedding"), "forward", lambda f: _rotary_forward(f, pairs))


def patch_llama(model=None, pack_weights=False):
    """Routes Llama's RMSNorm, MLP and rotary embedding (and, given a model, its attention, its
    linear layers and a causal LM's loss) through uniop. Returns ``model``. Training runs through
    all of it: every op has its backward. Models of the families transformers builds as it builds
    Llama — Mistral, Qwen2, Qwen3, Phi3, Gemma, Gemma2, Gemma3, Mixtral, Qwen2-MoE, Qwen3-MoE,
    GPT-OSS (see ``_FAMILIES``) — are patched the same way, MoE models' experts switched to uniop's
    experts implementation where it covers them; other models raise a TypeError.

    ``pack_weights``: prefill-sized products (more than 16 rows, in a dtype that runs on uniop's
    GEMM here) take their weights packed once by ``pack_weight`` instead of packing them in every
    call (``linear_packed``, ``linear_add_packed``, ``linear_silu_mul_packed``), at the price of a
    packed copy of every linear weight a prefill uses, made on first use and kept beside the
    weight (repacked when the weight changes). Inference only: calls autograd records keep the
    unpacked route. The setting of the latest call holds for every patched model."""
    if model is not None:
        layers = _decoder_layers()
        if not any(isinstance(mod, layers) for mod in model.modules()):
            families = ", ".join(_FAMILIES.values())
            raise TypeError(f"patch_llama: expected a transformers {families} model, got {type(model).__name__}")
    if not _originals:
        _patch_classes()
    _PACK["on"] = bool(pack_weights)
    if model is not None and all(patched is not model for patched, *_ in _models):
        register_attention()
        linears = [mod for mod in model.modules() if type(mod) is nn.Linear]
        own_loss = None
        # A causal LM on transformers' own loss (a base model has no loss; a loss the user set stays).
        if getattr(model, "loss_type", None) == "ForCausalLM" and model.loss_function is _transformers_causal_lm_loss():
            own_loss = model.__dict__.get("_loss_function", _NO_LOSS)
            model.loss_function = _causal_lm_loss
        # transformers >= 5's MoE layers, switched where uniop covers every experts module (those
        # transformers' `use_experts_implementation` built, which carry its layout flags); others
        # stay on the implementation they had.
        experts = getattr(model.config, "_experts_implementation", None)
        if not all(covers(mod) for mod in model.modules() if hasattr(mod, "is_transposed")):
            experts = None
        _models.append((model, model.config._attn_implementation, experts, linears, own_loss))
        model.set_attn_implementation(ATTENTION)
        if experts is not None:
            model.set_experts_implementation(register_experts())
        for mod in linears:
            mod.forward = _linear_forward.__get__(mod)
    return model


def unpatch_llama():
    """Restores transformers' own implementations (and patched models' attention and experts
    implementations)."""
    _PACK["on"] = False
    while _models:
        model, previous, experts, linears, own_loss = _models.pop()
        model.set_attn_implementation(previous)
        if experts is not None:
            model.set_experts_implementation(experts)
        if own_loss is _NO_LOSS:
            del model._loss_function
        elif own_loss is not None:
            model._loss_function = own_loss
        for mod in linears:
            del mod.forward
        unn.drop_kept_weights(model)
    for (owner, name), original in _originals.items():
        setattr(owner, name, original)
    _originals.clear()
