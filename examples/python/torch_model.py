"""uniop inside PyTorch: ``torch.ops.uniop.<op>`` with autograd, a model from ``uniop.torch.nn``
trained under ``torch.compile(fullgraph=True)``, and bf16 autocast.

    .venv/bin/python examples/python/torch_model.py
"""

import torch
import torch.nn.functional as F
from torch import nn

import uniop.torch  # noqa: F401  registers every op as torch.ops.uniop.<op>
from uniop.torch import nn as unn

torch.manual_seed(0)

# 1. One op with autograd: uniop's backward op against torch's own composite.
x = torch.randn(8, 512, requires_grad=True)
w = torch.randn(512, requires_grad=True)
y, _rstd = torch.ops.uniop.rms_norm(x, w, 1e-6)
want = F.rms_norm(x, (512,), w, 1e-6)
grad = torch.randn_like(y)
gx, gw = torch.autograd.grad(y, (x, w), grad)
want_gx, want_gw = torch.autograd.grad(want, (x, w), grad)
assert torch.allclose(y, want, atol=1e-5)
assert torch.allclose(gx, want_gx, atol=1e-4) and torch.allclose(gw, want_gw, atol=1e-3)
print("rms_norm forward and backward match torch")


# 2. A pre-norm Llama block from uniop.torch.nn (HF Llama's parameter names), compiled whole.
class Block(nn.Module):
    def __init__(self, hidden=128, heads=4, kv_heads=2, inter=344):
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm = unn.RMSNorm(hidden), unn.RMSNorm(hidden)
        self.self_attn = unn.Attention(hidden, heads, kv_heads)
        self.mlp = unn.SwiGLUMLP(hidden, inter)
        self.rotary = unn.RotaryEmbedding(hidden // heads)

    def forward(self, x):
        positions = torch.arange(x.shape[1]).expand(x.shape[0], -1)
        cos, sin = self.rotary(x, positions)
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


block = Block()
compiled = torch.compile(block, fullgraph=True)  # fullgraph: a graph break would raise
optimizer = torch.optim.AdamW(block.parameters(), lr=1e-3)
inputs, targets = torch.randn(4, 32, 128), torch.randn(4, 32, 128)
losses = []
for step in range(5):
    optimizer.zero_grad()
    loss = F.mse_loss(compiled(inputs), targets)
    loss.backward()
    optimizer.step()
    losses.append(loss.item())
with torch.no_grad():
    assert torch.allclose(compiled(inputs), block(inputs), atol=1e-5)  # compiled == eager
assert losses[-1] < losses[0]
print(f"compiled block trained: loss {losses[0]:.4f} -> {losses[-1]:.4f}")

# 3. Autocast: matmul-like ops run in the region's dtype, norms in their inputs' (Op::autocast).
with torch.no_grad():
    reference = block(inputs)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mlp_out = block.mlp(inputs)
        norm_out = block.input_layernorm(inputs)
        out = block(inputs)
assert mlp_out.dtype == torch.bfloat16 and norm_out.dtype == torch.float32
err = (out.float() - reference).abs().max().item()
assert err < 0.1, err
print(f"autocast bf16: MLP in {mlp_out.dtype}, RMSNorm in {norm_out.dtype}, block within {err:.3f} of float32")
