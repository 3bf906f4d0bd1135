"""uniop flash attention as a transformers attention implementation, for any model.

transformers looks a model's attention up by name (``config._attn_implementation``) in its
``AttentionInterface`` and the mask builder in its ``AttentionMaskInterface``.
:func:`register_attention` adds ``"uniop"`` to both: the attention is uniop ``attention`` (GQA
read in place, bottom-right causal — HF's causal prefill and its decode over the whole cache —
and transformers' 4-D masks, boolean or float, as its ``mask``); the mask builder is the one
SDPA uses, so a model gets the masks SDPA would: ``None`` for an unpadded causal batch (uniop
then runs plain causal), a boolean mask for padded batches, sliding windows (Mistral, Qwen2's
windowed layers), chunked or bidirectional attention. The kernel skips the key tiles such a mask
hides from a whole tile of queries, so a sliding window costs the keys it shows. Gemma2's logit
soft-capping (the interface's ``softcap``) is the kernel's ``softcap``, GPT-OSS's attention sinks
(``s_aux``) its ``sinks``. Calls uniop does not cover (dropout, returning the attention weights, a
mask of another rank or dtype) run transformers' SDPA forward, as ``"sdpa"`` would — or, where they
soft-cap or have sinks (which SDPA lacks), the model's own eager attention, as ``"eager"`` would.

    import uniop.torch
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation=uniop.torch.register_attention())

:func:`uniop.torch.patch_llama` registers it and switches the models it is given (Llama and the families it
covers) to it.
"""

from __future__ import annotations

import torch

from . import nn as unn

ATTENTION = "uniop"


def register_attention():
    """Registers uniop attention with transformers as the ``"uniop"`` attention implementation
    (and SDPA's mask builder under the same name). Returns the name, for
    ``from_pretrained(..., attn_implementation=...)`` or ``model.set_attn_implementation(...)``."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(ATTENTION, attention)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)
    return ATTENTION


_MASK_DTYPES = (torch.bool, torch.float32, torch.float16, torch.bfloat16)


def takes_mask(mask):
    """Whether uniop ``attention`` takes transformers' attention mask as it is: none, or a 4-D mask
    — the boolean one (true = attend) its SDPA mask builder makes, or a float one added to the
    scores (transformers 4.x's, and its eager builder's: 0 or the dtype's lowest value). Its causal
    part repeats the causal flag, which the kernel also gets (so it skips the tiles above the
    diagonal)."""
    return mask is None or (mask.dim() == 4 and mask.dtype in _MASK_DTYPES)


def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """transformers' attention interface over uniop ``attention``: ``query`` ``[B, Hq, Sq, D]``,
    ``key``/``value`` ``[B, Hkv, Sk, D]``; returns ``([B, Sq, Hq, D], None)``. ``softcap`` (Gemma2's)
    caps the scaled scores, ``s_aux`` (GPT-OSS's sinks, ``[Hq]``) adds a logit per head to each
    softmax; other keyword arguments of the interface (``sliding_window``: the mask carries it) are
    not needed."""
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    softcap, sinks = kwargs.get("softcap"), kwargs.get("s_aux")
    unsupported = not takes_mask(attention_mask) or dropout
    if unsupported or kwargs.get("cache") is not None or kwargs.get("output_attentions"):
        if softcap is not None or sinks is not None:
            mask = _additive_mask(query, key, attention_mask, causal)
            return _eager_forward(module)(module, query, key, value, mask, dropout=dropout, scaling=scaling, **kwargs)
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    out = unn.uniop_ops.attention(query, key, value, None, bool(causal), scaling, attention_mask, softcap, sinks)[0]
    return out.transpose(1, 2).contiguous(), None


def _eager_forward(module):
    """The eager attention of ``module``'s modeling file (Gemma2's soft-caps, GPT-OSS's has sinks),
    which ``"eager"`` runs for it."""
    import sys

    return sys.modules[type(module).__module__].eager_attention_forward


def _additive_mask(query, key, mask, causal):
    """The mask an eager attention adds to its scores, for what SDPA's mask builder gave (a boolean
    mask, or None where the flag ``causal`` stands for it): float in the query's dtype, the dtype's
    lowest value where hidden; None for an unmasked, non-causal call."""
    sq, sk = query.shape[-2], key.shape[-2]
    keep = torch.ones(sq, sk, dtype=torch.bool, device=query.device).tril(sk - sq) if causal else None
    if mask is not None and mask.dtype == torch.bool:
        keep, mask = (mask if keep is None else mask & keep), None
    if keep is None:
        return mask
    hidden = torch.zeros(keep.shape, dtype=query.dtype, device=query.device).masked_fill(
        ~keep, torch.finfo(query.dtype).min
    )
    return hidden if mask is None else hidden + mask
