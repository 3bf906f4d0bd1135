"""Swap Hugging Face Llama's hot pieces for uniop ops, before or after a model is built.

:func:`patch_llama` replaces ``LlamaRMSNorm.forward`` (uniop ``rms_norm``, HF's dtype rule kept),
``LlamaMLP.forward`` (uniop's fused ``silu_mul`` between the projections, when the activation is
SiLU) and ``modeling_llama.apply_rotary_pos_emb`` (uniop ``rope``). Methods are patched on the
classes, so existing instances change too; :func:`unpatch_llama` restores the originals. Passing a
model is optional and only checks that it is a Llama model.
"""

from __future__ import annotations

from torch import nn

from . import nn as unn

_originals = {}


def _modeling():
    from transformers.models.llama import modeling_llama

    return modeling_llama


def _mlp_forward(original):
    def forward(self, x):
        if isinstance(self.act_fn, nn.SiLU):
            return self.down_proj(unn.uniop_ops.silu_mul(self.gate_proj(x), self.up_proj(x)))
        return original(self, x)

    return forward


def patch_llama(model=None):
    """Routes Llama's RMSNorm, MLP and rotary embedding through uniop. Returns ``model``."""
    m = _modeling()
    if model is not None and not any(isinstance(mod, m.LlamaDecoderLayer) for mod in model.modules()):
        raise TypeError(f"patch_llama: expected a transformers Llama model, got {type(model).__name__}")
    if not _originals:
        _originals.update(
            rms_norm=m.LlamaRMSNorm.forward,
            mlp=m.LlamaMLP.forward,
            rope=m.apply_rotary_pos_emb,
        )
        m.LlamaRMSNorm.forward = unn.RMSNorm.forward
        m.LlamaMLP.forward = _mlp_forward(_originals["mlp"])
        m.apply_rotary_pos_emb = unn.apply_rotary_pos_emb
    return model


def unpatch_llama():
    """Restores transformers' own Llama implementations."""
    if _originals:
        m = _modeling()
        m.LlamaRMSNorm.forward = _originals.pop("rms_norm")
        m.LlamaMLP.forward = _originals.pop("mlp")
        m.apply_rotary_pos_emb = _originals.pop("rope")
