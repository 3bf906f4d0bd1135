"""uniop from NumPy alone (no torch needed): every registered op is a function generated from its
schema, called on arrays in place, with errors that name the op and the argument.

    .venv/bin/python examples/python/numpy_ops.py

A decoder step of a tiny GQA attention layer — RMSNorm, projections, rotary embedding, attention
against a KV cache — written with uniop ops and checked against NumPy at every stage.
"""

import numpy as np

import uniop

rng = np.random.default_rng(0)
hidden, heads, kv_heads, head_dim, cached = 256, 8, 2, 32, 40


def close(got, want, what, tol=1e-4):
    err = float(np.max(np.abs(got - want)))
    assert err < tol, f"{what}: max abs error {err:.3g} against NumPy"
    print(f"{what:<34} matches NumPy (max abs error {err:.1e})")


# The generated functions carry their schema: help(uniop.rms_norm) prints it with the op's doc.
print(uniop.rms_norm.__doc__.splitlines()[0], "\n")

x = rng.standard_normal((1, 1, hidden), dtype=np.float32)  # [batch, new tokens, hidden]
norm_weight = rng.standard_normal(hidden, dtype=np.float32)
h, _rstd = uniop.rms_norm(x, norm_weight, 1e-6)
want_h = x / np.sqrt((x**2).mean(-1, keepdims=True) + 1e-6) * norm_weight
close(h, want_h, "rms_norm")

# Projections in HF's weight layout ([out, in]).
wq = rng.standard_normal((heads * head_dim, hidden), dtype=np.float32) / 16
wk = rng.standard_normal((kv_heads * head_dim, hidden), dtype=np.float32) / 16
wv = rng.standard_normal((kv_heads * head_dim, hidden), dtype=np.float32) / 16
q, k, v = (uniop.linear(h, w) for w in (wq, wk, wv))
close(q, h @ wq.T, "linear")

# [B, S, H, D] viewed as [B, H, S, D]: a transposed NumPy view is read in place, no copy.
q = q.reshape(1, 1, heads, head_dim).transpose(0, 2, 1, 3)
k = k.reshape(1, 1, kv_heads, head_dim).transpose(0, 2, 1, 3)
v = v.reshape(1, 1, kv_heads, head_dim).transpose(0, 2, 1, 3)

# Rotary embedding at position `cached` (HF's default rope, 'half' pairs i and i + D/2).
cos, sin = uniop.rope_cos_sin(np.array([[cached]], dtype=np.int64), head_dim)
q_rot = uniop.rope(q, cos[:, None], sin[:, None], "half")
half = head_dim // 2
rotated = np.concatenate([-q[..., half:], q[..., :half]], -1)
close(q_rot, q * cos[:, None] + rotated * sin[:, None], "rope")
k_rot = uniop.rope(k, cos[:, None], sin[:, None], "half")

# Append the new key and value to a preallocated cache, then attend over everything cached.
k_cache = np.zeros((1, kv_heads, 64, head_dim), dtype=np.float32)
v_cache = np.zeros_like(k_cache)
k_cache[:, :, :cached] = rng.standard_normal((1, kv_heads, cached, head_dim), dtype=np.float32)
v_cache[:, :, :cached] = rng.standard_normal((1, kv_heads, cached, head_dim), dtype=np.float32)
positions = np.array([cached], dtype=np.int64)
uniop.kv_cache_append(k_cache, v_cache, k_rot, v, positions)  # writes the caches in place
assert np.array_equal(k_cache[:, :, cached], k_rot[:, :, 0]) and np.array_equal(v_cache[:, :, cached], v[:, :, 0])
lengths = np.array([cached + 1], dtype=np.int32)
out, _lse = uniop.attention(q_rot, k_cache, v_cache, lengths, True)

keys = np.repeat(k_cache[:, :, : cached + 1], heads // kv_heads, axis=1)  # GQA: each kv head serves 4 q heads
values = np.repeat(v_cache[:, :, : cached + 1], heads // kv_heads, axis=1)
scores = q_rot @ keys.transpose(0, 1, 3, 2) / np.sqrt(head_dim)
p = np.exp(scores - scores.max(-1, keepdims=True))
close(out, (p / p.sum(-1, keepdims=True)) @ values, "kv_cache_append + attention")

# float16 works the same way (bfloat16 needs a framework that has it: torch, JAX).
h16, _ = uniop.rms_norm(x.astype(np.float16), norm_weight.astype(np.float16), 1e-6)
close(h16.astype(np.float32), want_h, "rms_norm in float16", tol=2e-2)

# Bad input raises uniop.UniopError naming the op, the argument, what it expected and got.
try:
    uniop.linear(h, rng.standard_normal((64, hidden + 1), dtype=np.float32))
except uniop.UniopError as e:
    print(f"\nuniop.UniopError (code {e.code}): {e}")
else:
    raise AssertionError("a shape mismatch must raise")
