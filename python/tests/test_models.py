"""Models built from uniop ops: torch.compile without graph breaks, 2-process DDP, and the
transformers Llama patch."""

import math
import os
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn import functional as F

import uniop.torch as ut
from uniop.torch import nn as unn


class Block(nn.Module):
    """A pre-norm Llama block from uniop modules."""

    def __init__(self, hidden=64, heads=4, kv_heads=2, inter=96):
        super().__init__()
        self.norm1, self.norm2 = unn.RMSNorm(hidden), unn.RMSNorm(hidden)
        self.attn = unn.Attention(hidden, heads, kv_heads)
        self.mlp = unn.SwiGLUMLP(hidden, inter)
        self.rope = unn.RotaryEmbedding(hidden // heads)

    def forward(self, x):
        pos = torch.arange(x.shape[1]).expand(x.shape[0], -1)
        cos, sin = self.rope(x, pos)
        x = x + self.attn(self.norm1(x), cos, sin)
        return x + self.mlp(self.norm2(x))


def reference_block(block, x):
    """The same block in plain torch (HF Llama's formulas), for values and gradients."""

    def rms(m, x):
        return m.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + m.variance_epsilon))

    def rot(t, cos, sin):
        d = t.shape[-1] // 2
        return t * cos + torch.cat([-t[..., d:], t[..., :d]], -1) * sin

    a = block.attn
    b, s, _ = x.shape
    inv = 1.0 / 10000.0 ** (torch.arange(0, a.head_dim, 2).float() / a.head_dim)
    ang = torch.arange(s).float()[:, None] * inv
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    h = rms(block.norm1, x)
    q = a.q_proj(h).view(b, s, a.num_heads, -1).transpose(1, 2)
    k = a.k_proj(h).view(b, s, a.num_kv_heads, -1).transpose(1, 2)
    v = a.v_proj(h).view(b, s, a.num_kv_heads, -1).transpose(1, 2)
    q, k = rot(q, cos, sin), rot(k, cos, sin)
    o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    x = x + a.o_proj(o.transpose(1, 2).reshape(b, s, -1))
    h = rms(block.norm2, x)
    m = block.mlp
    return x + m.down_proj(torch.nn.functional.silu(m.gate_proj(h)) * m.up_proj(h))


def _grads(module):
    return {n: p.grad.clone() for n, p in module.named_parameters()}


def test_block_matches_plain_torch_values_and_grads():
    torch.manual_seed(0)
    block, x = Block(), torch.randn(2, 10, 64)
    block(x).square().mean().backward()
    got = _grads(block)
    block.zero_grad()
    reference_block(block, x).square().mean().backward()
    for name, g in _grads(block).items():
        assert torch.allclose(got[name], g, atol=2e-5, rtol=1e-4), name


@pytest.mark.parametrize(
    "x_dtype, param_dtype, affine, bias",
    [
        (torch.float32, torch.float32, True, True),
        (torch.bfloat16, torch.bfloat16, True, True),
        (torch.bfloat16, torch.float32, True, False),
        (torch.float16, torch.float16, False, False),
    ],
)
def test_layer_norm_module_matches_torch_layer_norm(x_dtype, param_dtype, affine, bias):
    """unn.LayerNorm loads torch.nn.LayerNorm's state dict and gives its outputs (in the input's
    dtype) and gradients, on GPT-2-like rows with a large common offset."""
    torch.manual_seed(0)
    ref = nn.LayerNorm(96, eps=1e-5, elementwise_affine=affine, bias=bias, dtype=param_dtype)
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(torch.randn_like(p))
    ours = unn.LayerNorm(96, eps=1e-5, elementwise_affine=affine, bias=bias, dtype=param_dtype)
    ours.load_state_dict(ref.state_dict())
    x = (torch.randn(3, 7, 96) * 2 + 30).to(x_dtype)
    xs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
    ys = [m(t) for m, t in zip((ours, ref), xs)]
    assert ys[0].dtype == ys[1].dtype == x_dtype
    tol = dict(atol=1e-5, rtol=1e-5) if x_dtype == torch.float32 else dict(atol=3e-2, rtol=2e-2)
    torch.testing.assert_close(ys[0], ys[1], **tol)
    dy = torch.randn_like(ys[0])
    grads = [torch.autograd.grad(y, [t, *m.parameters()], dy) for y, t, m in zip(ys, xs, (ours, ref))]
    for got, want in zip(*grads):
        # Gradients summed over 21 rows (dweight, dbias) keep bf16/f16 roundings of each term.
        torch.testing.assert_close(got, want, **(tol if x_dtype == torch.float32 else dict(atol=0.3, rtol=5e-2)))


def _module_qkv(attn, x, cos, sin):
    """An unn.Attention's (4 q heads, 2 kv heads of 16) queries, keys and values of ``x`` as
    ``[B, H, S, D]``, q and k roped: its forward's steps before the attention, for references."""
    b, s, _ = x.shape
    q = attn.q_proj(x).view(b, s, 4, 16).transpose(1, 2)
    k = attn.k_proj(x).view(b, s, 2, 16).transpose(1, 2)
    v = attn.v_proj(x).view(b, s, 2, 16).transpose(1, 2)
    return (*unn.apply_rotary_pos_emb(q, k, cos, sin), v)


def test_attention_module_takes_a_padding_mask():
    """unn.Attention with a tokenizer's [B, S] padding mask equals SDPA with the padding and causal
    masks combined, values and gradients, at the real positions (left-padded ones get 0)."""
    torch.manual_seed(0)
    attn, x = unn.Attention(64, 4, 2), torch.randn(2, 10, 64, requires_grad=True)
    cos, sin = unn.RotaryEmbedding(16)(x, torch.arange(10).expand(2, -1))
    padding = torch.ones(2, 10, dtype=torch.long)
    padding[1, :3] = 0
    real = padding.bool()

    def reference():
        b, s, _ = x.shape
        q, k, v = _module_qkv(attn, x, cos, sin)
        mask = torch.ones(s, s, dtype=torch.bool).tril() & real[:, None, None, :]
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        return attn.o_proj(o.transpose(1, 2).reshape(b, s, -1))

    got = attn(x, cos, sin, padding)
    assert torch.all(got[1, :3] == 0)  # padding queries see no key; o_proj has no bias
    got[real].square().sum().backward()
    got_grads, got_dx = _grads(attn), x.grad.clone()
    attn.zero_grad()
    x.grad = None
    want = reference()
    want[real].square().sum().backward()
    assert torch.allclose(got[real], want[real], atol=1e-5)
    for name, g in _grads(attn).items():
        assert torch.allclose(got_grads[name], g, atol=1e-5, rtol=1e-4), name
    assert torch.allclose(got_dx[real], x.grad[real], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("extra", [{"softcap": 1.5}, {"sinks": True}], ids=["softcap", "sinks"])
def test_attention_module_bends_its_softmax_as_gemma2_and_gpt_oss_do(extra):
    """unn.Attention(softcap=...) equals Gemma 2's eager attention (scores scaled, capped to
    ``softcap · tanh(score / softcap)``, causal mask, softmax), unn.Attention(sinks=True) GPT-OSS's
    (each head's sink logit one more column of the softmax, dropped after it), values and gradients
    (the sinks' too), on scores the cap bends (inputs of deviation 4) and sinks that take a share
    of the softmax (deviation 2)."""
    torch.manual_seed(1)
    attn, x = unn.Attention(64, 4, 2, **extra), (4 * torch.randn(2, 10, 64)).requires_grad_()
    if attn.sinks is not None:
        with torch.no_grad():
            attn.sinks.normal_(0.0, 2.0)
    cos, sin = unn.RotaryEmbedding(16)(x, torch.arange(10).expand(2, -1))

    def reference():
        b, s, _ = x.shape
        q, k, v = _module_qkv(attn, x, cos, sin)
        k, v = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
        scores = q @ k.transpose(-1, -2) / 4
        if attn.softcap is not None:
            scores = attn.softcap * torch.tanh(scores / attn.softcap)
        scores = scores.masked_fill(~torch.ones(s, s, dtype=torch.bool).tril(), float("-inf"))
        if attn.sinks is not None:
            scores = torch.cat([scores, attn.sinks.reshape(1, -1, 1, 1).expand(b, -1, s, 1)], -1)
        probs = scores.softmax(-1)[..., :s]
        return attn.o_proj((probs @ v).transpose(1, 2).reshape(b, s, -1))

    results = []
    for forward in (lambda: attn(x, cos, sin), reference):
        attn.zero_grad()
        x.grad = None
        y = forward()
        y.square().sum().backward()
        results.append((y.detach(), _grads(attn), x.grad.clone()))
    (got, got_grads, got_dx), (want, want_grads, want_dx) = results
    assert torch.allclose(got, want, atol=1e-5)
    assert set(want_grads) == {n for n, _ in attn.named_parameters()}
    # float32 sums over the sequence: errors relative to the largest gradient (~500 in q_proj's)
    for name, g in want_grads.items():
        assert torch.allclose(got_grads[name], g, atol=1e-5 * (1 + g.abs().max().item()), rtol=1e-4), name
    assert torch.allclose(got_dx, want_dx, atol=1e-4, rtol=1e-4)
    plain = unn.Attention(64, 4, 2)
    plain.load_state_dict(attn.state_dict(), strict=False)
    assert (plain(x, cos, sin) - got).abs().max() > 0.1  # the cap bends these scores, the sinks take a share


def _uniop_ops_run(fn):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return {e.key for e in prof.key_averages() if e.key.startswith("uniop::")}


def test_mlp_keeps_its_products_only_where_autograd_records():
    """SwiGLUMLP runs linear_silu_mul_train (whose backward takes the kept products) under autograd,
    linear_silu_mul (nothing kept) without it; the gradients are plain torch's either way."""
    torch.manual_seed(0)
    mlp, x = unn.SwiGLUMLP(32, 64), torch.randn(3, 32)
    with torch.no_grad():
        ran = _uniop_ops_run(lambda: mlp(x))
    assert "uniop::linear_silu_mul" in ran and "uniop::linear_silu_mul_train" not in ran, ran
    ran = _uniop_ops_run(lambda: mlp(x).square().sum().backward())
    assert {"uniop::linear_silu_mul_train", "uniop::linear_silu_mul_backward"} <= ran, ran
    assert "uniop::linear_silu_mul" not in ran, ran
    got = _grads(mlp)
    mlp.zero_grad()
    mlp.down_proj(torch.nn.functional.silu(mlp.gate_proj(x)) * mlp.up_proj(x)).square().sum().backward()
    for name, g in _grads(mlp).items():
        assert torch.allclose(got[name], g, atol=1e-5, rtol=1e-4), name


@pytest.mark.parametrize(
    "activation", ["silu", "torch-gelu", "torch-gelu-tanh", "gelu", "gelu_pytorch_tanh", "gelu_new"]
)
@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "unfused"])
def test_gated_runs_silu_and_gelu_activations(activation, fuse):
    """nn.gated on an MLP gated by SiLU or by GELU in either form — torch's modules and
    transformers' (ACT2FN: Gemma's gelu_pytorch_tanh, gelu_new, the erf gelu) — runs that
    activation's uniop op (linear_gelu_mul_train fused under autograd, linear_gelu_mul without it,
    gelu_mul unfused) and gives act(gate) * up and its gradients, on a fused gate_up_proj too."""
    from transformers.activations import ACT2FN

    torch.manual_seed(0)
    act = {"torch-gelu": nn.GELU(), "torch-gelu-tanh": nn.GELU(approximate="tanh")}.get(activation)
    act = act if act is not None else ACT2FN[activation]
    name = "silu" if activation == "silu" else "gelu"
    x = torch.randn(5, 32)
    for fused_weight in (False, True):
        mlp = nn.Module()
        mlp.act_fn = act
        if fused_weight:
            mlp.gate_up_proj = nn.Linear(32, 2 * 48, bias=False)
        else:
            mlp.gate_proj, mlp.up_proj = nn.Linear(32, 48, bias=False), nn.Linear(32, 48, bias=False)
        ran = _uniop_ops_run(lambda: unn.gated(mlp, x, fuse).square().sum().backward())
        if fuse:
            assert {f"uniop::linear_{name}_mul_train", f"uniop::linear_{name}_mul_backward"} <= ran, ran
        else:
            glu = "swiglu" if name == "silu" else "geglu"
            assert f"uniop::{glu if fused_weight else name + '_mul'}" in ran, ran
        got = {n: p.grad.clone() for n, p in mlp.named_parameters()}
        mlp.zero_grad()
        gate, up = mlp.gate_up_proj(x).chunk(2, -1) if fused_weight else (mlp.gate_proj(x), mlp.up_proj(x))
        want = act(gate) * up
        want.square().sum().backward()
        outs = []
        with torch.no_grad():
            ran = _uniop_ops_run(lambda: outs.append(unn.gated(mlp, x, fuse)))
        torch.testing.assert_close(outs[0], want, atol=1e-5, rtol=1e-5)
        assert (f"uniop::linear_{name}_mul" in ran) == fuse and f"uniop::linear_{name}_mul_train" not in ran, ran
        for n, p in mlp.named_parameters():
            torch.testing.assert_close(got[n], p.grad, atol=1e-5, rtol=1e-4)


def _logits_unpatched_and_patched(model, ids):
    """``model``'s logits for ``ids`` before and under ``patch_llama`` (no grad), and the names of
    the ops the patched call ran."""
    with torch.no_grad():
        want = model(ids).logits
    try:
        ut.patch_llama(model)
        with torch.no_grad(), torch.profiler.profile() as prof:
            got = model(ids).logits
    finally:
        ut.unpatch_llama()
    return want, got, {e.name for e in prof.events()}


def test_mlps_gated_by_other_activations_keep_transformers_forward():
    """An activation uniop has no gated op for: nn.gated refuses it (a ValueError naming it), and a
    patched MLP and decoder layer with it run transformers' forward (no gated uniop op) with its
    values."""
    import transformers

    model = _tiny_model(transformers.LlamaConfig, transformers.LlamaForCausalLM, hidden_act="relu")
    with pytest.raises(ValueError, match="expected a SiLU or GELU activation, got ReLU"):
        unn.gated(model.model.layers[0].mlp, torch.randn(2, 64))
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(3))
    want, got, ran = _logits_unpatched_and_patched(model, ids)
    assert "uniop::rms_norm" in ran and not {"uniop::linear_silu_mul", "uniop::linear_gelu_mul"} & ran
    assert "uniop::silu_mul" not in ran and "uniop::add_rms_norm" not in ran
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_module_ops_skip_the_dispatcher_only_where_torch_need_not_see_the_call(monkeypatch):
    """uniop.torch.nn's ops call uniop.<op> directly under no_grad (the same values as
    torch.ops.uniop), and go through torch's dispatcher wherever torch has to see the call:
    autograd, autocast, fake tensors, vmap, the profiler. Ops that write into an argument always
    take the dispatcher."""
    import uniop

    direct_calls = []
    real = uniop.rms_norm
    monkeypatch.setattr(uniop, "rms_norm", lambda *a, **k: direct_calls.append(1) or real(*a, **k))
    ops = unn._Ops()  # a fresh namespace picks up the spy
    x, w = torch.randn(3, 16), torch.randn(16)

    with torch.no_grad():
        y = ops.rms_norm(x, w, 1e-6)
    assert direct_calls and type(y[0]) is torch.Tensor
    assert all(torch.equal(a, b) for a, b in zip(y, torch.ops.uniop.rms_norm(x, w, 1e-6)))

    def dispatched(fn):
        direct_calls.clear()
        out = fn()
        assert not direct_calls
        return out

    xg = x.clone().requires_grad_()
    assert dispatched(lambda: ops.rms_norm(xg, w, 1e-6))[0].grad_fn is not None
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert dispatched(lambda: ops.rms_norm(x, w, 1e-6))[0].dtype == torch.float32
    from torch._subclasses.fake_tensor import FakeTensorMode

    with torch.no_grad(), FakeTensorMode():
        fake = dispatched(lambda: ops.rms_norm(torch.empty(3, 16), torch.empty(16), 1e-6))[0]
    assert fake.shape == (3, 16)
    with torch.no_grad():
        batched = dispatched(lambda: torch.vmap(lambda r: ops.rms_norm(r, w, 1e-6)[0])(x))
        assert torch.allclose(batched, y[0])
        assert "uniop::rms_norm" in dispatched(lambda: _uniop_ops_run(lambda: ops.rms_norm(x, w, 1e-6)))
    assert ops.kv_cache_append is torch.ops.uniop.kv_cache_append


def test_torch_compile_fullgraph_no_graph_breaks():
    torch.manual_seed(0)
    block, x = Block(), torch.randn(2, 16, 64)
    explanation = torch._dynamo.explain(block)(x)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    with torch.no_grad():  # where eager calls skip the dispatcher, a trace must still see the ops
        explanation = torch._dynamo.explain(block)(x)
        assert explanation.graph_break_count == 0, explanation.break_reasons
        traced = torch.jit.trace(block, x, check_trace=False)
        assert "uniop::attention" in traced.inlined_graph.str()
        assert torch.allclose(traced(x + 1), block(x + 1), atol=1e-5)
    _matches_eager(torch.compile(block, fullgraph=True), block, x)


def _matches_eager(compiled, block, x):
    """`compiled(x)`'s output and gradients (input and parameters) are eager `block`'s."""
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    eager_out = block(x1)
    eager_out.sum().backward()
    eager = _grads(block)
    block.zero_grad()
    out = compiled(x2)
    out.sum().backward()
    assert torch.allclose(out, eager_out, atol=1e-5)
    assert torch.allclose(x2.grad, x1.grad, atol=1e-5)
    for name, g in _grads(block).items():
        assert torch.allclose(g, eager[name], atol=1e-5, rtol=1e-4), name
    block.zero_grad()


class EveryModule(nn.Module):
    """Each uniop.torch.nn module, an attention padding mask and an MLP with biases included."""

    def __init__(self, hidden=64, heads=4):
        super().__init__()
        self.rope = unn.RotaryEmbedding(hidden // heads)
        self.norm, self.layer_norm = unn.RMSNorm(hidden), unn.LayerNorm(hidden)
        self.attn = unn.Attention(hidden, heads, 2)
        self.mlp, self.biased_mlp = unn.SwiGLUMLP(hidden, 96), unn.SwiGLUMLP(hidden, 96, bias=True)

    def forward(self, x, padding):
        cos, sin = self.rope(x, torch.arange(x.shape[1]).expand(x.shape[0], -1))
        x = x + self.attn(self.norm(x), cos, sin, padding)
        return self.biased_mlp(self.layer_norm(x + self.mlp(x)))


def test_fx_symbolic_trace_records_the_ops_and_decides_per_run():
    """torch.fx.symbolic_trace of uniop.torch.nn's modules, with autograd on or off while tracing,
    records the uniop ops and, as single nodes, the helpers that decide from their inputs (dtype
    rules, the MLP's autograd variant, the mask's kind). The traced module gives eager's values and
    gradients at other sizes, runs the MLP variant autograd asks for on each run, and keeps
    RMSNorm's dtype rule for an input dtype it was not traced with."""
    torch.manual_seed(0)
    model = EveryModule()
    for grad in (True, False):
        with torch.set_grad_enabled(grad):
            traced = torch.fx.symbolic_trace(model)
        called = {getattr(n.target, "__name__", "") for n in traced.graph.nodes if n.op == "call_function"}
        wanted = {"rope_cos_sin", "rope", "attention", "silu_mul", "_rms_norm", "_layer_norm", "_linear_gated_mul"}
        assert wanted | {"_key_mask"} <= called, called
        for batch, seq in ((2, 10), (3, 7)):
            x = torch.randn(batch, seq, 64)
            padding = torch.ones(batch, seq, dtype=torch.long)
            padding[-1, :2] = 0
            xs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
            outs = [m(t, padding) for m, t in zip((traced, model), xs)]
            grads = []
            for out, t in zip(outs, xs):
                out.square().sum().backward()
                grads.append((t.grad, _grads(model)))
                model.zero_grad()
            torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(grads[0], grads[1], atol=1e-5, rtol=1e-4)
        with torch.no_grad():
            assert "uniop::linear_silu_mul_train" not in _uniop_ops_run(lambda: traced(x, padding))
        assert "uniop::linear_silu_mul_train" in _uniop_ops_run(lambda: traced(x, padding))
    x = torch.randn(3, 64)
    for weight_dtype, x_dtype, out_dtype in [
        (torch.float32, torch.bfloat16, torch.float32),
        (torch.bfloat16, torch.float16, torch.float32),  # promote(bf16, f16), as HF's product
        (torch.bfloat16, torch.bfloat16, torch.bfloat16),
    ]:
        norm = unn.RMSNorm(64, dtype=weight_dtype)
        with torch.no_grad():
            norm.weight.copy_(torch.randn(64))
        xd = x.to(x_dtype)
        hf = norm.weight * (xd.float() * torch.rsqrt(xd.float().pow(2).mean(-1, keepdim=True) + 1e-6)).to(x_dtype)
        for y in (norm(xd), torch.fx.symbolic_trace(norm)(xd)):
            assert y.dtype == hf.dtype == out_dtype
            torch.testing.assert_close(y, hf, atol=2e-2, rtol=2e-2)


def test_torch_compile_dynamic_shapes_compile_once():
    """Under dynamic shapes a uniop block compiles once for every batch size and sequence length,
    forward and backward, and twice under torch.compile's default: the fake kernels keep sizes
    symbolic (uniop.torch.symbolic), where a size read as a number made torch compile again for
    each new one."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch.manual_seed(0)
    block = Block()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(block, backend=counter, fullgraph=True, dynamic=True)
    frames = None
    for batch, seq in ((2, 8), (3, 12), (2, 21)):
        _matches_eager(compiled, block, torch.randn(batch, seq, 64))
        frames = frames or counter.frame_count
    assert counter.frame_count == frames, f"compiled {counter.frame_count - frames} more times for new sizes"
    # torch.compile's default: a size seen to change is made a symbol, so a second graph serves
    # every later length (it was one graph per length, up to the recompile limit, then eager).
    torch._dynamo.reset()  # forget the sizes earlier compiles of this code saw change
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(block, backend=counter, fullgraph=True)
    with torch.no_grad():
        for seq in (8, 12, 16, 20, 24):
            x = torch.randn(2, seq, 64)
            assert torch.allclose(compiled(x), block(x), atol=1e-5)
    assert counter.frame_count == 2


class ShapeMix(nn.Module):
    """Ops whose output sizes follow their inputs' in different ways: halved (swiglu), summed
    (cat), broadcast (matmul's batch), kept (rms_norm)."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(10))

    def forward(self, x, y, a, b):
        halves = torch.ops.uniop.swiglu(x, -1)
        joined = torch.ops.uniop.cat([x, y], 1)
        product = torch.ops.uniop.matmul(a, b)
        return halves, joined, torch.ops.uniop.rms_norm(product, self.weight, 1e-6)[0]


def test_torch_export_with_dynamic_dims(tmp_path):
    """torch.export with Dims on uniop ops: output sizes are expressions of the inputs' (not the
    example's numbers), and the exported program, saved and loaded, runs at other sizes; so does
    an exported Llama block."""
    from torch.export import Dim

    torch.manual_seed(0)
    model = ShapeMix()
    seq, other, half, batch = Dim("seq", max=64), Dim("other", max=64), Dim("half", max=32), Dim("batch", max=64)
    example = (torch.randn(3, 5, 8), torch.randn(3, 7, 8), torch.randn(4, 6, 8), torch.randn(1, 8, 10))
    dims = {"x": {1: seq, 2: 2 * half}, "y": {1: other, 2: 2 * half}, "a": {0: batch}, "b": None}
    program = torch.export.export(model, example, dynamic_shapes=dims)
    outputs = next(n for n in program.graph.nodes if n.op == "output").args[0]
    shapes = [tuple(str(d) for d in o.meta["val"].shape) for o in outputs]
    assert all(not d.isdigit() for d in (shapes[0][1], shapes[0][2], shapes[1][1], shapes[1][2], shapes[2][0])), shapes
    assert "+" in shapes[1][1], shapes  # seq + other
    torch.export.save(program, tmp_path / "shape_mix.pt2")
    loaded = torch.export.load(tmp_path / "shape_mix.pt2")
    sizes = (torch.randn(3, 9, 12), torch.randn(3, 2, 12), torch.randn(7, 6, 8), torch.randn(1, 8, 10))
    for got, want in zip(loaded.module()(*sizes), model(*sizes)):
        assert got.shape == want.shape and torch.allclose(got, want, atol=1e-6)
    # A whole Llama block (rope tables, rope, GQA attention, the fused MLP) by batch and length.
    block = Block().eval()
    batch, seq = Dim("batch", max=16), Dim("seq", max=512)
    program = torch.export.export(block, (torch.randn(2, 8, 64),), dynamic_shapes={"x": {0: batch, 1: seq}})
    with torch.no_grad():
        for x in (torch.randn(3, 17, 64), torch.randn(1, 40, 64)):
            assert torch.allclose(program.module()(x), block(x), atol=1e-5)


def test_sizes_an_op_rounds_stay_static_under_dynamic_shapes():
    """pack_weight's panel count rounds up (panels of 32): no fitted expression holds for every
    size, so its sizes are specialized — compiled again for a new one, and refused as a Dim by
    torch.export — never given a wrong shape."""
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch.export import Dim

    def pack(w):
        return torch.ops.uniop.pack_weight(w)

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(pack, backend=counter, fullgraph=True, dynamic=True)
    with torch.no_grad():
        for rows in (64, 65, 96):
            w = torch.randn(rows, 16)
            assert torch.equal(compiled(w), pack(w)), rows
    assert counter.frame_count == 3  # one graph per size: a fitted floor(rows / 32) would serve all

    class Pack(nn.Module):
        def forward(self, w):
            return pack(w)

    with pytest.raises(torch._dynamo.exc.UserError, match="specialized"):
        torch.export.export(Pack(), (torch.randn(64, 16),), dynamic_shapes={"w": {0: Dim("rows", max=512)}})


class LearnedBiasAttention(torch.nn.Module):
    """T5's encoder attention in small: a learned relative position bias per head, shared by the
    batch, passed to attention as its float mask."""

    def __init__(self, heads=2, seq=16, max_distance=8):
        super().__init__()
        self.rel = torch.nn.Parameter(torch.randn(heads, 2 * max_distance + 1))
        i = torch.arange(seq)
        self.register_buffer("bucket", (i[None, :] - i[:, None]).clamp(-max_distance, max_distance) + max_distance)

    def bias(self):
        return self.rel[:, self.bucket][None]  # [1, H, S, S]

    def forward(self, q, k, v):
        return torch.ops.uniop.attention(q, k, v, None, False, None, self.bias())[0]


def test_torch_compile_learned_attention_bias():
    """A learned bias through attention's float mask compiles with no graph break, and its
    gradient (through dmask, the mask's gradient) matches eager uniop's and SDPA's."""
    torch.manual_seed(0)
    module, (q, k, v) = LearnedBiasAttention(), (torch.randn(2, 2, 16, 8) for _ in range(3))
    compiled = torch.compile(module, fullgraph=True)
    grads = []
    for run in (module, compiled, lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=module.bias())):
        module.zero_grad()
        xs = [x.clone().requires_grad_() for x in (q, k, v)]
        out = run(*xs)
        out.square().sum().backward()
        grads.append((out.detach(), *(x.grad for x in xs), module.rel.grad.clone()))
    assert module.rel.grad.abs().sum() > 0
    for got, want in zip(grads[1], grads[0]):
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-4), "compiled vs eager"
    for got, want in zip(grads[0], grads[2]):
        assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), "uniop vs SDPA"


def test_autocast_bf16_block():
    torch.manual_seed(0)
    block, x = Block(), torch.randn(2, 8, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = block(x)
    want = reference_block(block, x)
    assert y.shape == want.shape
    assert torch.allclose(y.float(), want, atol=0.1, rtol=0.05)


def _ddp_worker(rank, world, rendezvous, x, state, out_dir):
    # Gloo over loopback; a file store for the rendezvous, so there is no TCP store server whose
    # port could be taken between choosing it and binding it.
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        block = Block()
        block.load_state_dict(state)
        ddp = nn.parallel.DistributedDataParallel(block)
        shard = x.chunk(world)[rank]
        ddp(shard).square().mean().backward()
        torch.save(_grads(block), os.path.join(out_dir, f"grads{rank}.pt"))
        # Neither rank tears its process group down while the other may still be talking to it.
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_ddp_two_processes_match_single_process(tmp_path):
    torch.manual_seed(0)
    block, x = Block(), torch.randn(4, 8, 64)
    block(x).square().mean().backward()
    want = _grads(block)
    for attempt in range(2):
        try:
            args = (2, tmp_path / f"rendezvous{attempt}", x, block.state_dict(), str(tmp_path))
            mp.spawn(_ddp_worker, args=args, nprocs=2, join=True)
            break
        except mp.ProcessExitedException as e:
            # A worker killed by a signal inside torch's gloo runtime (seen once in CI: SIGABRT,
            # "terminate called without an active exception", torch 2.15) gets one more try;
            # an exception raised by the worker's own code fails the test at once.
            if e.signal_name is None or attempt == 1:
                raise
            warnings.warn(f"DDP worker died ({e}); retrying once")
    for rank in range(2):
        got = torch.load(tmp_path / f"grads{rank}.pt")
        for name, g in want.items():
            assert torch.allclose(got[name], g, atol=1e-6, rtol=1e-5), (rank, name)


transformers = pytest.importorskip("transformers")


def _tiny_model(config_class, model_class, dtype=torch.float32, **config):
    """A tiny random model (2 layers, GQA 4/2 heads, hidden 64) of a transformers architecture."""
    cfg = config_class(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        **config,
    )
    torch.manual_seed(0)
    return model_class(cfg).to(dtype).eval()


def _left_padded_prompts(length, padding, seed):
    """Two random prompts of ``length`` tokens and their attention mask, the second left-padded by
    ``padding`` positions (mask 0), as transformers pads a batch for generation."""
    ids = torch.randint(0, 256, (2, length), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    mask[1, :padding] = 0
    return ids, mask


def _tiny_llama(dtype=torch.float32):
    from transformers import LlamaConfig, LlamaForCausalLM

    return _tiny_model(LlamaConfig, LlamaForCausalLM, dtype)


@pytest.mark.parametrize(
    "dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 0.15), (torch.float16, 5e-3)], ids=["f32", "bf16", "f16"]
)
def test_patch_llama_keeps_logits_and_greedy_tokens(dtype, tol):
    model = _tiny_llama(dtype)
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(ids).logits.float()
        want_tokens = model.generate(ids[:1], max_new_tokens=12, do_sample=False)
    try:
        ut.patch_llama(model)
        assert model.config._attn_implementation == "uniop"
        with torch.no_grad():
            got = model(ids).logits.float()
            tokens = model.generate(ids[:1], max_new_tokens=12, do_sample=False)
    finally:
        ut.unpatch_llama()
    assert (got - want).abs().max().item() < tol
    if dtype == torch.float32:
        assert torch.equal(tokens, want_tokens)
    else:
        # 16-bit rounding differs (uniop rounds once per op): the prompt's argmax tokens must agree
        # wherever the reference's top-2 margin exceeds the error bound.
        top2 = want.topk(2, -1).values
        clear = (top2[..., 0] - top2[..., 1]) > 2 * tol
        assert torch.equal(got.argmax(-1)[clear], want.argmax(-1)[clear])
    assert model.config._attn_implementation == "sdpa"


def _tiny_family_model(family, **overrides):
    """A tiny random causal LM of a family patch_llama covers besides Llama, with a 16-position
    sliding window: on every layer for Mistral and Phi3 (which also has fused q/k/v and gate/up
    projections; here half the head dim rotary), on the second of two for Qwen2 and Qwen3 (which
    also have bias on q/k/v and per-head q/k norms respectively). ``overrides`` go to the config."""
    import transformers

    config = {
        "Mistral": {"sliding_window": 16},
        # Phi3's default special tokens are past this vocabulary.
        "Phi3": {"sliding_window": 16, "partial_rotary_factor": 0.5, "pad_token_id": 0, "eos_token_id": None},
        "Gemma": {"head_dim": 16},
        "Gemma3": {"head_dim": 16, "sliding_window": 16, "layer_types": ["sliding_attention", "full_attention"]},
        # Gemma2 soft-caps its attention logits. Weights 10x the others' (initializer_range 0.2), so
        # that attention moves the logits, and a cap of 2, which bends the larger scores: dropping it
        # moves the logits by ~0.7.
        "Gemma2": {
            "head_dim": 16,
            "sliding_window": 16,
            "layer_types": ["sliding_attention", "full_attention"],
            "initializer_range": 0.2,
            "attn_logit_softcapping": 2.0,
        },
        # Mixture-of-experts families: 4 experts, 2 per token; Qwen3-MoE's second layer dense.
        "Mixtral": {"sliding_window": 16, "num_local_experts": 4, "num_experts_per_tok": 2},
        "Qwen2Moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 96},
        "Qwen3Moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 96, "mlp_only_layers": [1]},
        # GPT-OSS: its window on the first of the two layers.
        "GptOss": {"head_dim": 16, "sliding_window": 16, "num_local_experts": 4, "num_experts_per_tok": 2},
    }.get(family, {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1})
    config_class = transformers.Gemma3TextConfig if family == "Gemma3" else getattr(transformers, family + "Config")
    classes = config_class, getattr(transformers, family + "ForCausalLM")
    return _tiny_model(*classes, **config, **overrides)


def _padded_batch_run(model, ids, mask):
    """What the family tests compare: ``model``'s logits of a plain and of a left-padded batch,
    greedy tokens of the padded one, and a training step's loss and gradients on it. A padding query
    sees no key: SDPA and uniop give it output 0, eager attention (some references) the mean of
    every value. Its logits predict the first real token, which is left out of the loss with the
    padding."""
    labels = ids.masked_fill((mask == 0) | (nn.functional.pad(mask, (1, 0), value=1)[:, :-1] == 0), -100)
    with torch.no_grad():
        plain, padded = model(ids).logits, model(ids, attention_mask=mask).logits
        tokens = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    model.train().zero_grad()
    loss = model(ids, attention_mask=mask, labels=labels).loss
    loss.backward()
    model.eval()
    return plain, padded, tokens, loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _assert_same_run(got, want, mask):
    """Two :func:`_padded_batch_run` results agree: logits (the padded batch's at its real
    positions), tokens, loss and every gradient."""
    assert torch.allclose(got[0], want[0], atol=1e-4)
    assert torch.allclose(got[1][mask.bool()], want[1][mask.bool()], atol=1e-4)
    assert torch.equal(got[2], want[2])
    assert abs(got[3] - want[3]) < 1e-5
    for name, g in want[4].items():
        assert torch.allclose(got[4][name], g, atol=1e-5, rtol=1e-4), name


@pytest.mark.parametrize(
    "family", ["Mistral", "Qwen2", "Qwen3", "Phi3", "Gemma", "Gemma2", "Gemma3", "Mixtral", "Qwen2Moe", "Qwen3Moe"]
)
def test_patch_llama_covers_the_families_built_as_llama_is(family):
    """patch_llama patches Mistral, Qwen2, Qwen3 and Phi3 models as it does Llama's: on 40-token
    prompts, longer than the 16-position window (which changes these logits by ~0.1-0.3), a plain
    and a left-padded batch give transformers' logits (the padded one at its real positions),
    greedy decoding of the padded batch past the window gives its tokens, and a training step its
    loss and gradients; every attention call runs straight through (never the attention
    interface), and the norms, rope and projections run on uniop, the gated MLPs (SwiGLU; Gemma's
    GeGLU) and residual adds fused (Gemma2's and Gemma3's layers keep their own residual adds; MoE
    layers run their experts on uniop, their residual adds unfused). Gemma2's reference is
    transformers' eager attention (its soft-capping rules SDPA out)."""
    from transformers import AttentionInterface

    from uniop.torch import attention_interface, llama

    model = _tiny_family_model(family)
    ids, mask = _left_padded_prompts(40, padding=9, seed=4)
    want = _padded_batch_run(model, ids, mask)
    interface_calls = []
    try:
        ut.patch_llama(model)
        AttentionInterface.register(
            llama.ATTENTION, lambda *a, **k: interface_calls.append(1) or attention_interface.attention(*a, **k)
        )
        with torch.profiler.profile() as prof:
            got = _padded_batch_run(model, ids, mask)
        ran = {e.name for e in prof.events()}
    finally:
        ut.unpatch_llama()
        ut.register_attention()
    assert not interface_calls
    assert {"uniop::attention", "uniop::linear", "uniop::rope", "uniop::rope_cos_sin", "uniop::rms_norm"} <= ran
    assert {"uniop::attention_backward", "uniop::rms_norm_backward", "uniop::cross_entropy_backward"} <= ran
    gated = "uniop::linear_gelu_mul" if family.startswith("Gemma") else "uniop::linear_silu_mul"
    # The fused MLP runs where uniop's GEMM does: decode's few rows on every CPU, the 40-row prefill and
    # training step in float32 only where patch_llama picks uniop's GEMM for them (AVX-512, not Intel).
    fp32_prefill_on_uniop = torch.float32 in llama._ALL_ROWS
    assert {gated, gated + "_train", gated + "_backward"} <= ran if fp32_prefill_on_uniop else gated in ran
    assert not ({"uniop::linear_silu_mul", "uniop::linear_gelu_mul"} - {gated}) & ran
    residual_fusions = {"uniop::add_rms_norm", "uniop::linear_add"}
    if family in ("Gemma2", "Gemma3", "Mixtral", "Qwen2Moe"):  # own layers; MoE layers keep transformers'
        assert not residual_fusions & ran
    else:
        assert residual_fusions <= ran
    _assert_same_run(got, want, mask)


@pytest.mark.parametrize(
    "family, activation", [("Mixtral", "silu"), ("Qwen3Moe", "silu"), ("Mixtral", "gelu_pytorch_tanh")]
)
def test_registered_experts_run_any_moe_model(family, activation, monkeypatch):
    """``register_experts()`` makes uniop a transformers experts implementation, no patching: a
    tiny MoE model's logits and greedy tokens under ``"uniop"`` are transformers' eager ones, each
    expert's gated MLP one linear_silu_mul (GELU experts: linear_gelu_mul) on its gate/up halves;
    training runs the train form and its backward (:class:`_Experts`) with eager's gradients.
    Experts uniop does not cover (here flagged as having biases) run transformers' eager forward:
    fewer uniop calls, the same logits."""
    model = _tiny_family_model(family, hidden_act=activation)
    ids, mask = _left_padded_prompts(24, padding=5, seed=7)

    def run():
        with torch.no_grad():
            logits = model(ids, attention_mask=mask).logits
            tokens = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
        model.train().zero_grad()
        model(ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss.backward()
        model.eval()
        return logits, tokens, {n: p.grad.clone() for n, p in model.named_parameters()}

    model.set_experts_implementation("eager")
    want = run()
    model.set_experts_implementation(ut.register_experts())
    gate_shapes = []
    gated = "linear_silu_mul" if activation == "silu" else "linear_gelu_mul"
    real = getattr(unn.uniop_ops, gated)
    monkeypatch.setattr(unn.uniop_ops, gated, lambda *a: gate_shapes.append(tuple(a[1].shape)) or real(*a))
    got = run()
    experts = model.model.layers[0].mlp.experts
    _, both, hidden = experts.gate_up_proj.shape
    assert gate_shapes and set(gate_shapes) == {(both // 2, hidden)}
    gate_shapes.clear()
    model.train()
    ran = _uniop_ops_run(lambda: model(ids, labels=ids).loss.backward())
    model.eval()
    assert {f"uniop::{gated}_train", f"uniop::{gated}_backward", "uniop::linear_backward"} <= ran
    assert not gate_shapes
    assert torch.allclose(got[0][mask.bool()], want[0][mask.bool()], atol=1e-5)
    assert torch.equal(got[1], want[1])
    for name, g in want[2].items():
        assert torch.allclose(got[2][name], g, atol=1e-5, rtol=1e-4), name

    def logits_and_calls():
        gate_shapes.clear()
        with torch.no_grad():
            return model(ids).logits, len(gate_shapes)

    every, all_calls = logits_and_calls()
    experts.has_bias = True
    fallback, fewer_calls = logits_and_calls()
    assert fewer_calls < all_calls  # the first layer's experts went to the eager forward
    assert torch.allclose(fallback, every, atol=1e-5)


@pytest.mark.parametrize("family,activation", [("Mixtral", "silu"), ("Mixtral", "gelu_pytorch_tanh"), ("Beam", "silu")])
def test_experts_train_with_transformers_gradients(family, activation):
    """Where autograd records a float32 call, uniop's experts run as one autograd node (the train
    form of the gated op and linear forward, their backward ops): the output and the gradients of
    the hidden states, the routing weights and both 3-D weights are transformers' eager experts' (an
    expert no token picked gets a zero gradient), also over a retained graph's second backward.
    A bfloat16 call autograd records runs transformers' grouped forward (no uniop op) with the
    same results. Beam's experts compute the default gate in float32 with their own
    ``_apply_gate``, and run as the default layout's."""
    from uniop.torch import experts_interface

    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        if family == "Beam":
            sizes = {"moe_intermediate_size": 48, "num_experts": 4, "hidden_act": activation}
            module = _experts_of("beam", "BeamExperts", "BeamConfig", sizes, (), dtype)
        else:
            module = _tiny_family_model(family, hidden_act=activation, dtype=dtype).model.layers[0].mlp.experts
        assert isinstance(experts_interface._form(module), experts_interface._Gated)
        tokens, hidden = 9, module.gate_up_proj.shape[-1]
        x, weights = torch.randn(tokens, hidden, dtype=dtype), torch.rand(tokens, 2, dtype=dtype)
        index = torch.stack([torch.randperm(3)[:2] for _ in range(tokens)])  # the last of 4 experts idle
        dout = torch.randn(tokens, hidden)

        def run(forward):
            module.zero_grad()
            xs, ws = x.clone().requires_grad_(), weights.clone().requires_grad_()
            out = forward(module, xs, index, ws)
            loss = (out.float() * dout).sum()
            loss.backward(retain_graph=True)
            loss.backward()  # a second pass over the retained graph: the gradients twice
            return out, xs.grad, ws.grad, module.gate_up_proj.grad.clone(), module.down_proj.grad.clone()

        want = run(type(module).forward.__wrapped__)
        got = []
        ran = _uniop_ops_run(lambda: got.append(run(experts_interface.experts)))
        name = "linear_silu_mul" if activation == "silu" else "linear_gelu_mul"
        if dtype == torch.float32:
            assert {f"uniop::{name}_train", f"uniop::{name}_backward", "uniop::linear_backward"} <= ran
            assert not got[0][3][3].any() and not got[0][4][3].any()
        else:
            assert not ran
        tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: grouped and eager round at other points
        for what, g, w in zip(("out", "dx", "dweights", "dgate_up", "ddown"), got[0], want):
            assert g.dtype == w.dtype and g.shape == w.shape, what
            assert (g.float() - w.float()).abs().max() <= tol * w.float().abs().max(), what


# Experts classes with a clamped SwiGLU gate besides GPT-OSS's: (model, class, config class, the
# config's size arguments besides its hidden size, and the class's arguments after the config). Step 3.7
# and Ling clip after the activation, with one limit per layer.
_CLAMPED_EXPERTS = {
    "DeepseekV4": ("deepseek_v4", "DeepseekV4Experts", "DeepseekV4Config", {"intermediate_size": 48}, ()),
    "Glm5Next": ("glm5_next", "Glm5NextTextExperts", "Glm5NextTextConfig", {"moe_intermediate_size": 48}, ()),
    "HYV4": ("hy_v4", "HYV4Experts", "HYV4Config", {"moe_intermediate_size": 48}, ()),
    "HYV4VL": ("hy_v4_vl", "HYV4VLExperts", "HYV4VLTextConfig", {"moe_intermediate_size": 48}, ()),
    "MiniMaxM3": ("minimax_m3_vl", "MiniMaxM3VLExperts", "MiniMaxM3VLTextConfig", {"intermediate_size": 48}, ()),
    "PrivacyFilter": (
        "openai_privacy_filter", "OpenAIPrivacyFilterExperts", "OpenAIPrivacyFilterConfig",
        {"intermediate_size": 48}, (),
    ),
    "Step3p7": (
        "step3p7", "Step3p7Experts", "Step3p7TextConfig",
        {"moe_intermediate_size": 48, "n_routed_experts": 4, "swiglu_limits": [3.0]}, (0,),
    ),
    "BailingHybrid": (
        "bailing_hybrid", "BailingHybridExperts", "BailingHybridConfig",
        {"moe_intermediate_size": 48, "num_hidden_layers": 1, "swiglu_limits": [3.0]}, (0,),
    ),
}


def _experts_of(model, name, config, sizes, args, dtype):
    """transformers' experts class ``name`` of ``model`` built from its config (hidden 64, 4
    experts, 2 per token, ``sizes``), weights drawn with std 0.1."""
    import importlib

    modeling = importlib.import_module(f"transformers.models.{model}.modeling_{model}")
    configuration = importlib.import_module(f"transformers.models.{model}.configuration_{model}")
    cfg = getattr(configuration, config)(hidden_size=64, num_local_experts=4, num_experts_per_tok=2, **sizes)
    return _drawn(getattr(modeling, name)(cfg, *args).to(dtype))


def _drawn(module):
    """``module`` with its weights drawn (seeded) with std 0.1."""
    torch.manual_seed(1)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0.0, 0.1)
    return module


def _clamped_experts(family, dtype):
    """A clamped-SwiGLU experts module of ``family`` (4 experts, hidden 64): GPT-OSS's from its tiny
    model, the others' built from their config (:func:`_experts_of`), weights drawn with std 0.1."""
    if family != "GptOss":
        return _experts_of(*_CLAMPED_EXPERTS[family], dtype)
    return _drawn(_tiny_family_model("GptOss", dtype=dtype).model.layers[0].mlp.experts)


def _limit_in_a_gap(module, gate, up):
    """Sets the module's clamp limit (``limit`` or ``swiglu_limit``) in the widest gap between the
    gate values (the activations, where the module clips after it) and up magnitudes of its top
    tenth (below the top 0.2%, so that some are clamped), and checks that no value lies within two
    bfloat16 steps of it: uniop and eager round at other points, and a value moved across the limit
    changes its gradient by a whole term."""
    values = torch.cat([gate.flatten(), up.abs().flatten()]).sort().values
    top = values[int(0.9 * len(values)) : int(0.998 * len(values))]
    widest = (top[1:] - top[:-1]).argmax()
    limit = float(top[widest] + top[widest + 1]) / 2
    assert (values - limit).abs().min() >= 2 * 2.0 ** (math.floor(math.log2(limit)) - 7)
    for name in ("limit", "swiglu_limit"):
        if hasattr(module, name):
            setattr(module, name, limit)


def _routed_inputs(module, dtype):
    """11 tokens (deviation 3) for an experts module of 4 experts, each routed to 2 of the first 3
    (the last idle) with uniform weights."""
    tokens, hidden = 11, module.gate_up_proj.shape[1 if module.is_transposed else 2]
    x, weights = (3 * torch.randn(tokens, hidden)).to(dtype), torch.rand(tokens, 2, dtype=dtype)
    index = torch.stack([torch.randperm(3)[:2] for _ in range(tokens)])
    return x, index, weights


def _gate_up_products(module, x, interleaved):
    """The float32 gate and up values of every expert on ``x``: ``[tokens, E, I]`` each."""
    product = "th,ehn->ten" if module.is_transposed else "th,enh->ten"
    gate_up = torch.einsum(product, x.float(), module.gate_up_proj.detach().float())
    if module.has_bias:
        gate_up += module.gate_up_proj_bias.detach().float()[None]
    return (gate_up[..., ::2], gate_up[..., 1::2]) if interleaved else gate_up.chunk(2, -1)


def _experts_match_eager(module, x, index, weights, op):
    """uniop's experts (``linear`` and the gate's ``op``) give transformers' eager experts' output
    for the inputs of :func:`_routed_inputs`; where autograd records the call, the experts' node
    trains them (``matmul_backward`` of a transposed weight, ``linear_backward`` of an ``[out, in]``
    one, the op's backward) and the gradients of the input, the routing weights, the weights and
    biases are eager's, the idle expert's zero. Under autocast transformers' grouped forward runs
    (no uniop op)."""
    from uniop.torch import experts_interface

    dtype, form = x.dtype, experts_interface._form(module)
    eager = type(module).forward.__wrapped__
    with torch.no_grad():
        want = eager(module, x, index, weights)
        got = []
        ran = _uniop_ops_run(lambda: got.append(experts_interface.experts(module, x, index, weights)))
    assert {"uniop::linear", f"uniop::{op}"} <= ran
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: eager rounds each of its ops
    assert got[0].dtype == dtype and got[0].shape == want.shape
    assert (got[0].float() - want.float()).abs().max() <= tol * want.float().abs().max()

    dout = torch.randn(x.shape)

    def grads(forward):
        module.zero_grad()
        xs, ws = x.clone().requires_grad_(), weights.clone().requires_grad_()
        (forward(module, xs, index, ws).float() * dout).sum().backward()
        return xs.grad, ws.grad, *(p.grad.clone() for p in form.weights(module))

    want = grads(eager)
    got = []
    ran = _uniop_ops_run(lambda: got.append(grads(experts_interface.experts)))
    projection = "uniop::matmul_backward" if module.is_transposed else "uniop::linear_backward"
    assert {projection, f"uniop::{op}_backward"} <= ran
    assert not any(g[3].any() for g in got[0][2:])  # expert 3 idle
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not _uniop_ops_run(lambda: grads(experts_interface.experts))
    names = "dx", "dweights", *(f"d{n}" for n, _ in module.named_parameters())
    assert len(names) == len(got[0])
    for what, g, w in zip(names, got[0], want):
        assert g.dtype == w.dtype and g.shape == w.shape, what
        assert (g.float() - w.float()).abs().max() <= 2 * tol * w.float().abs().max(), what


@pytest.mark.parametrize("family", ["GptOss", *_CLAMPED_EXPERTS])
def test_clamped_experts_run_linear_and_clamped_swiglu(family):
    """Experts with a clamped SwiGLU gate on uniop — GPT-OSS's (transposed weights with gate and up
    interleaved, biases), DeepSeek V4's, GLM-5 Next's, HunYuan V4's (default layout, ``silu(g') ·
    u'``), MiniMax M3's (GPT-OSS's gate on halves) and the privacy filter's (that on transposed
    weights with biases): each expert a token picked runs ``linear`` (with its bias where it has
    one), ``clamped_swiglu`` and ``linear``, its output and gradients eager's in float32 and
    bfloat16 (:func:`_experts_match_eager`), with gate and up values past the clamp's limit on both
    sides. The other families' limit is set between the products (:func:`_limit_in_a_gap`); GPT-OSS
    keeps its 7. HunYuan V4's VL model's gate is HunYuan V4's; Step 3.7's and Ling's bound the
    activation (``limit_after_act``), ``min(silu(g), limit) · clamp(u, ±limit)``."""
    from uniop.torch import experts_interface

    for dtype in (torch.float32, torch.bfloat16):
        module = _clamped_experts(family, dtype)
        x, index, weights = _routed_inputs(module, dtype)
        form = experts_interface._form(module)
        assert isinstance(form, experts_interface._PairGated) and form.op == "clamped_swiglu"
        gate, up = _gate_up_products(module, x, form.kwargs["interleaved"])
        after_act = form.kwargs["limit_after_act"]
        assert after_act == (family in ("Step3p7", "BailingHybrid"))
        bounded = torch.nn.functional.silu(gate) if after_act else gate
        if family != "GptOss":
            _limit_in_a_gap(module, bounded, up)
        limit = experts_interface._form(module).kwargs["limit"]
        assert (bounded > limit).any() and (up.abs() > limit).any()
        _experts_match_eager(module, x, index, weights, "clamped_swiglu")


def test_softcapped_experts_run_linear_and_softcapped_swiglu():
    """Inkling 2's experts on uniop (default layout, the gate ``cg·tanh(g/cg) · σ(g) ·
    cu·tanh(u/cu)``): each expert a token picked runs ``linear``, ``softcapped_swiglu`` with the
    caps of the module's ``act_fn`` and ``linear``, its output and gradients eager's in float32 and
    bfloat16 (:func:`_experts_match_eager`). The caps are set where the products bend them (the
    defaults 4 and 25 are past a tiny model's products)."""
    from uniop.torch import experts_interface

    for dtype in (torch.float32, torch.bfloat16):
        sizes = {"moe_intermediate_size": 48}
        module = _experts_of("inkling2", "Inkling2Experts", "Inkling2TextConfig", sizes, (), dtype)
        module.act_fn.gate_softcap.softcap, module.act_fn.up_softcap.softcap = 1.5, 3.0
        x, index, weights = _routed_inputs(module, dtype)
        form = experts_interface._form(module)
        assert isinstance(form, experts_interface._PairGated) and form.op == "softcapped_swiglu"
        assert form.kwargs == {"gate_softcap": 1.5, "up_softcap": 3.0, "interleaved": False}
        gate, up = _gate_up_products(module, x, False)
        assert (gate.abs() > 3).any() and (up.abs() > 6).any()
        _experts_match_eager(module, x, index, weights, "softcapped_swiglu")


# Tiny random MoE models with clamped experts, their attention transformers' own: DeepSeek V4's
# (compressed attention, hyper-connections; the limit on the gate) and Ling's hybrid (linear attention
# beside MLA; the limit after the activation). Limits of 0.1, so that the clamps cut.
_CLAMPED_MODELS = {
    "DeepseekV4": lambda transformers: transformers.DeepseekV4ForCausalLM(
        transformers.DeepseekV4Config(
            vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, swiglu_limit=0.1,
        )
    ),
    "BailingHybrid": lambda transformers: transformers.BailingHybridForCausalLM(
        transformers.BailingHybridConfig(
            vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=4, num_local_experts=4, num_experts_per_tok=2, n_group=1,
            topk_group=1, first_k_dense_replace=0, kv_lora_rank=16, qk_rope_head_dim=8, v_head_dim=16,
            qk_nope_head_dim=16, head_dim=16, layer_group_size=2, pad_token_id=0, eos_token_id=1,
            expert_swiglu_limit_list=[0.1, 0.1], num_mtp_layers=0,
        )
    ),
}


@pytest.mark.parametrize("family", _CLAMPED_MODELS)
def test_clamped_moe_model_runs_its_experts_on_uniop(family):
    """A tiny random DeepSeek V4 and Ling hybrid (:data:`_CLAMPED_MODELS`) under
    ``experts_implementation="uniop"``: logits and greedy tokens equal eager experts', each
    expert's clamped gate one ``clamped_swiglu`` on its product's halves, and a float32 training
    step's gradients eager's."""
    import transformers

    torch.manual_seed(0)
    model = _CLAMPED_MODELS[family](transformers).eval()
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(3))

    def run():
        with torch.no_grad():
            logits = model(ids).logits
            tokens = model.generate(ids, max_new_tokens=5, do_sample=False)
        model.train().zero_grad()
        model(ids, labels=ids).loss.backward()
        model.eval()
        return logits, tokens, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    model.set_experts_implementation("eager")
    want = run()
    model.set_experts_implementation(ut.register_experts())
    got = []
    ran = _uniop_ops_run(lambda: got.append(run()))
    assert {"uniop::clamped_swiglu", "uniop::clamped_swiglu_backward", "uniop::linear_backward"} <= ran
    assert torch.allclose(got[0][0], want[0], atol=1e-5)
    assert torch.equal(got[0][1], want[1])
    assert got[0][2].keys() == want[2].keys()
    for name, g in want[2].items():
        assert torch.allclose(got[0][2][name], g, atol=1e-5, rtol=1e-4), name


def test_offset_weight_is_kept_until_the_weight_changes():
    """nn.offset_weight (Gemma's ``1 + weight`` in float32) is made once for calls no gradient
    needs and made again when the weight changes in place; where autograd records the call it is
    computed per call, so the gradient reaches the weight; drop_kept_weights forgets it."""
    norm = nn.Module()
    norm.weight = nn.Parameter(torch.randn(8, dtype=torch.bfloat16))
    with torch.no_grad():
        first = unn.offset_weight(norm)
        assert first.dtype == torch.float32 and torch.equal(first, 1.0 + norm.weight.float())
        assert unn.offset_weight(norm) is first
        norm.weight.add_(1.0)
        updated = unn.offset_weight(norm)
        assert updated is not first and torch.equal(updated, 1.0 + norm.weight.float())
    unn.offset_weight(norm).sum().backward()
    assert torch.equal(norm.weight.grad, torch.ones(8, dtype=torch.bfloat16))
    unn.drop_kept_weights(norm)
    assert "_uniop_offset_weight" not in norm.__dict__


def test_patched_gemma3_keeps_its_own_decoder_layer():
    """Gemma3's decoder layer norms the attention's and the MLP's outputs before their residual
    adds, so its forward stays transformers' even where its MLP is SwiGLU (which then runs as one
    linear_silu_mul — on every CPU at 12 tokens, few enough rows for uniop's GEMM): the logits stay
    transformers'."""
    import transformers

    model = _tiny_model(
        transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM, head_dim=16, hidden_activation="silu"
    )
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(6))
    want, got, ran = _logits_unpatched_and_patched(model, ids)
    assert "uniop::linear_silu_mul" in ran and "uniop::add_rms_norm" not in ran
    assert torch.allclose(got, want, atol=1e-4)


def _batch_logits(model, ids, mask):
    """A function of ``model``'s logits of a plain batch and of a left-padded one (at its real
    positions), keyword arguments passed to the model."""
    real = mask.bool()

    def logits(**extra):
        with torch.no_grad():
            return model(ids, **extra).logits, model(ids, attention_mask=mask, **extra).logits[real]

    return logits


def _logits_on_the_registered_interface(model, logits, monkeypatch):
    """``logits()`` (see :func:`_batch_logits`) of a model on transformers' eager attention, run on
    the registered ``"uniop"`` implementation instead: through the attention interface, and with
    ``output_attentions`` through its fallback to the model's eager attention (asserted to run, on
    every layer of both batches)."""
    from uniop.torch import attention_interface

    eager_calls = []
    eager_forward = attention_interface._eager_forward
    monkeypatch.setattr(attention_interface, "_eager_forward", lambda m: eager_calls.append(1) or eager_forward(m))
    model.set_attn_implementation(ut.register_attention())
    try:
        via_interface = logits()
        assert not eager_calls
        via_eager = logits(output_attentions=True)
        assert len(eager_calls) == 2 * len(model.model.layers)
    finally:
        model.set_attn_implementation("eager")
    return via_interface, via_eager


def test_gemma2_soft_capping_runs_in_uniop_attention(monkeypatch):
    """Gemma2's attention logit soft-capping is uniop attention's ``softcap`` on every route: under
    the registered ``"uniop"`` implementation without patching (the attention interface), with
    ``output_attentions`` (the interface falls back to the model's eager attention, which needs an
    additive mask where SDPA's builder gave a boolean one or none), and patched (straight
    through): the logits of a plain and a left-padded batch are transformers' eager ones. The cap
    matters here: with it dropped the patched logits move by far more than the tolerance."""
    model = _tiny_family_model("Gemma2")
    ids, mask = _left_padded_prompts(24, padding=5, seed=8)
    logits = _batch_logits(model, ids, mask)
    want = logits()
    via_interface, via_eager = _logits_on_the_registered_interface(model, logits, monkeypatch)
    try:
        ut.patch_llama(model)
        patched = logits()
        layers = model.model.layers
        for layer in layers:
            layer.self_attn.attn_logit_softcapping = None
        uncapped = logits()
    finally:
        for layer in layers:
            layer.self_attn.attn_logit_softcapping = model.config.attn_logit_softcapping
        ut.unpatch_llama()
    for got in (via_interface, via_eager, patched):
        assert all(torch.allclose(g, w, atol=1e-4) for g, w in zip(got, want))
    assert (uncapped[0] - want[0]).abs().max() > 0.1


def _tiny_gpt_oss():
    """A tiny random GPT-OSS (see :func:`_tiny_family_model`) whose attention sinks are large enough
    to matter: drawn at deviation 2 where GPT-OSS draws them at 0.02, they take from almost none to
    nearly all of a softmax."""
    model = _tiny_family_model("GptOss", initializer_range=0.1)
    torch.manual_seed(5)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, 2.0)
    return model


def test_gpt_oss_sinks_run_in_uniop_attention(monkeypatch):
    """GPT-OSS's attention sinks are uniop attention's ``sinks``: under the registered ``"uniop"``
    implementation without patching (the attention interface passes ``s_aux``), with
    ``output_attentions`` (the interface falls back to GPT-OSS's eager attention), and patched
    (norms, linears, loss, the attention straight through — never the interface — with its rope on
    uniop ``rope``'s per-pair tables, and its experts on uniop's ``clamped_swiglu``), a plain and a
    left-padded batch give transformers' eager logits, greedy decoding of the padded batch its
    tokens, and a training step its loss and every gradient — the sinks' too. The sinks matter:
    zeroed, the logits move by far more than the tolerance."""
    from transformers import AttentionInterface

    from uniop.torch import attention_interface

    model = _tiny_gpt_oss()
    assert model.config._attn_implementation == "eager"  # transformers' only CPU attention for GPT-OSS
    ids, mask = _left_padded_prompts(40, padding=9, seed=6)
    logits = _batch_logits(model, ids, mask)
    want = _padded_batch_run(model, ids, mask)
    for got in _logits_on_the_registered_interface(model, logits, monkeypatch):
        assert torch.allclose(got[0], want[0], atol=1e-4)
        assert torch.allclose(got[1], want[1][mask.bool()], atol=1e-4)
    interface_calls = []
    try:
        ut.patch_llama(model)
        assert model.config._experts_implementation == ut.register_experts()
        AttentionInterface.register(
            attention_interface.ATTENTION,
            lambda *a, **k: interface_calls.append(1) or attention_interface.attention(*a, **k),
        )
        with torch.profiler.profile() as prof:
            got = _padded_batch_run(model, ids, mask)
        ran = {e.name for e in prof.events()}
        sinks = [layer.self_attn.sinks for layer in model.model.layers]
        with torch.no_grad():
            kept = [s.clone() for s in sinks]
            for s in sinks:
                s.zero_()
            sinkless = logits()
            for s, k in zip(sinks, kept):
                s.copy_(k)
    finally:
        ut.unpatch_llama()
        ut.register_attention()
    assert model.config._attn_implementation == "eager"
    assert {"uniop::attention", "uniop::attention_backward", "uniop::rms_norm", "uniop::linear"} <= ran
    assert {"uniop::rms_norm_backward", "uniop::cross_entropy_backward", "uniop::clamped_swiglu"} <= ran
    assert {"uniop::rope", "uniop::rope_backward"} <= ran and not interface_calls
    _assert_same_run(got, want, mask)
    assert want[4]["model.layers.0.self_attn.sinks"].abs().max() > 1e-3
    assert (sinkless[0] - want[0]).abs().max() > 0.1


def test_patched_phi3_layers_keep_transformers_forward_while_residual_dropout_is_live():
    """A Phi3 layer's residual dropout, live in training, keeps transformers' layer forward (the
    fused residual adds have no dropout); at rate 0 training runs the fused ops."""
    model = _tiny_family_model("Phi3").train()
    ids = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(2))

    def ops_run():
        with torch.profiler.profile() as prof:
            model(ids, labels=ids).loss.backward()
        return {e.name for e in prof.events()}

    try:
        ut.patch_llama(model)
        fused = ops_run()
        for layer in model.model.layers:
            layer.resid_attn_dropout.p = layer.resid_mlp_dropout.p = 0.1
        dropping = ops_run()
    finally:
        ut.unpatch_llama()
    assert {"uniop::add_rms_norm", "uniop::linear_add"} <= fused
    assert not {"uniop::add_rms_norm", "uniop::linear_add"} & dropping
    assert "uniop::linear_silu_mul_train" in dropping


@pytest.mark.parametrize("family", ["Llama", "Phi3"])
def test_patched_llama_compiles_with_dynamic_shapes(family):
    """A patched Llama's forward under torch.compile(dynamic=True) generates the unpatched
    model's greedy tokens in at most three graphs for a prompt and eight decode steps (it was one
    per step, the cache being one longer each time): the cache update is transformers' own while
    traced, the uniop ops' sizes stay symbolic. So does a Phi3 with a sliding window shorter than
    the prompt (its q/k/v split from one product; the window's mask is sized by the cache's
    length, 0 in the prompt's graph, which the symbolic fit could not probe by multiples)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    model = _tiny_llama() if family == "Llama" else _tiny_family_model(family)
    ids = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(2))
    generate = lambda: model.generate(ids, max_new_tokens=8, do_sample=False)  # noqa: E731
    with torch.no_grad():
        want = generate()
    counter = CompileCounterWithBackend("aot_eager")
    try:
        ut.patch_llama(model)
        model.forward = torch.compile(model.forward, backend=counter, dynamic=True)
        with torch.no_grad():
            got = generate()
    finally:
        del model.forward
        ut.unpatch_llama()
    assert torch.equal(got, want)
    assert counter.frame_count <= 3, counter.frame_count


def test_patched_attention_runs_straight_through_padded_batches_included():
    """Under patch_llama, a plain call of LlamaAttention (the dynamic cache, no mask or the boolean
    mask of a left-padded batch) runs the projections, rope and uniop attention itself, never the
    attention interface; both match the unpatched model (the padded batch at its real positions),
    and greedy generation of a left-padded batch gives the unpatched model's tokens. A call uniop
    attention does not cover (dropout in training) still goes through transformers' forward and
    the interface."""
    from transformers import AttentionInterface

    model = _tiny_llama()
    ids, mask = _left_padded_prompts(12, padding=4, seed=3)
    generate = lambda: model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)  # noqa: E731
    with torch.no_grad():
        want_plain = model(ids).logits
        want_padded = model(ids, attention_mask=mask).logits
        want_tokens = model.generate(ids[:1], max_new_tokens=6, do_sample=False)
        want_batch = generate()
    interface_calls, masks_seen = [], []
    ops_attention = ut.nn.uniop_ops.attention
    try:
        ut.patch_llama(model)
        from uniop.torch import attention_interface, llama

        AttentionInterface.register(
            llama.ATTENTION, lambda *a, **k: interface_calls.append(1) or attention_interface.attention(*a, **k)
        )
        ut.nn.uniop_ops.attention = lambda *a: masks_seen.append(a[6] is not None) or ops_attention(*a)
        with torch.no_grad():
            got_plain = model(ids).logits
            tokens = model.generate(ids[:1], max_new_tokens=6, do_sample=False)
            got_padded = model(ids, attention_mask=mask).logits
            batch = generate()
            assert not interface_calls
            assert any(masks_seen) and not all(masks_seen)
            layer = model.model.layers[0].self_attn
            x = torch.randn(1, 5, 64)
            cos_sin = model.model.rotary_emb(x, torch.arange(5)[None])
            layer.attention_dropout = 0.5
            layer.train()
            layer(x, cos_sin, None)
            layer.eval()
            layer.attention_dropout = 0.0
            assert interface_calls
    finally:
        ut.nn.uniop_ops.attention = ops_attention
        ut.unpatch_llama()
    assert torch.allclose(got_plain, want_plain, atol=1e-4)
    assert torch.allclose(got_padded[mask.bool()], want_padded[mask.bool()], atol=1e-4)
    assert torch.equal(tokens, want_tokens)
    assert torch.equal(batch, want_batch)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 0.1)], ids=["f32", "bf16"])
def test_patched_attention_takes_float_masks(monkeypatch, dtype, tol):
    """A 4-D float mask (transformers 4.x's kind: 0 where a query sees a key, the dtype's lowest
    value where not, here for a left-padded batch) goes to uniop attention as its ``mask`` under
    patch_llama, straight through, and the logits at the real positions match the unpatched
    model's given the same mask."""
    model = _tiny_llama(dtype)
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(4))
    keep = torch.ones(2, 12, dtype=torch.bool)
    keep[1, :5] = False  # left padding
    causal = torch.ones(12, 12, dtype=torch.bool).tril()
    sees = causal[None, None] & keep[:, None, None, :]
    sees |= torch.eye(12, dtype=torch.bool)  # padding queries see themselves (no empty rows)
    float_mask = torch.zeros(2, 1, 12, 12, dtype=dtype).masked_fill(~sees, torch.finfo(dtype).min)
    with torch.no_grad():
        want = model(ids, attention_mask=float_mask).logits.float()
    masks_seen = []
    real = unn.uniop_ops.attention
    monkeypatch.setattr(unn.uniop_ops, "attention", lambda *a: masks_seen.append(a[6]) or real(*a))
    try:
        ut.patch_llama(model)
        with torch.no_grad():
            got = model(ids, attention_mask=float_mask).logits.float()
    finally:
        ut.unpatch_llama()
    assert masks_seen and all(m is not None and m.dtype == dtype for m in masks_seen)
    assert torch.allclose(got[keep], want[keep], atol=tol, rtol=tol)


def test_registered_attention_runs_any_model_sliding_windows_included(monkeypatch):
    """``register_attention()`` makes uniop attention a transformers attention implementation for
    any model, no patching: a tiny Mistral whose sliding window (16 positions) is shorter than its
    40-token prompts gives SDPA's logits (a left-padded batch's at its real positions too) and
    greedy tokens under ``"uniop"``; every attention call runs uniop attention (none falls back
    to SDPA), and the window reaches it as the mask (the last query does not see the first key)."""
    import transformers.integrations.sdpa_attention as sdpa_module
    from transformers import MistralConfig, MistralForCausalLM

    model = _tiny_model(MistralConfig, MistralForCausalLM, sliding_window=16)
    ids, mask = _left_padded_prompts(40, padding=7, seed=5)

    def run():
        with torch.no_grad():
            plain, padded = model(ids).logits, model(ids, attention_mask=mask).logits
            return plain, padded, model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)

    model.set_attn_implementation("sdpa")
    want = run()
    masks_seen, fallbacks = [], []
    real_attention, real_sdpa = unn.uniop_ops.attention, sdpa_module.sdpa_attention_forward
    monkeypatch.setattr(unn.uniop_ops, "attention", lambda *a: masks_seen.append(a[6]) or real_attention(*a))
    monkeypatch.setattr(sdpa_module, "sdpa_attention_forward", lambda *a, **k: fallbacks.append(1) or real_sdpa(*a, **k))
    model.set_attn_implementation(ut.register_attention())
    got = run()
    assert masks_seen and not fallbacks
    assert any(m is not None and m.shape[-2:] == (40, 40) and not m[0, :, -1, 0].any() for m in masks_seen)
    assert torch.allclose(got[0], want[0], atol=1e-4)
    assert torch.allclose(got[1][mask.bool()], want[1][mask.bool()], atol=1e-4)
    assert torch.equal(got[2], want[2])


def test_patched_rotary_tables_come_from_rope_cos_sin_of_the_models_own_frequencies(monkeypatch):
    """Under patch_llama, LlamaRotaryEmbedding builds its tables with uniop rope_cos_sin from its
    own inv_freq: the same shape and dtype as transformers' and the same values (the f32 angles are
    the same; only cos/sin's last bit may differ) for the default rope, a linear-scaled, a llama3
    and a YaRN one (tables scaled by its attention factor), GPT-OSS's (YaRN, one value per pair),
    a table a ``.to(bfloat16)`` cast rounded, and the ropes whose tables follow the sequence length:
    dynamic NTK (grown past the trained length, then reset) and Phi3's longrope (long factors past
    the original length, short ones below), each module updated as transformers updates it.
    Float64 tables (not a rope_cos_sin dtype) keep transformers' forward, bit for bit, and its
    update runs once."""
    import copy

    from transformers import GptOssConfig, LlamaConfig, Phi3Config
    from transformers.models.gpt_oss import modeling_gpt_oss
    from transformers.models.llama import modeling_llama as m
    from transformers.models.phi3 import modeling_phi3

    calls = []
    real = unn.uniop_ops.rope_cos_sin
    monkeypatch.setattr(unn.uniop_ops, "rope_cos_sin", lambda *a, **k: calls.append(1) or real(*a, **k))

    def rotary(**rope):
        rope = {"rope_theta": 500000.0, **rope} if rope else {"rope_type": "default", "rope_theta": 10000.0}
        cfg = LlamaConfig(hidden_size=512, num_attention_heads=4, max_position_embeddings=8192, rope_parameters=rope)
        return m.LlamaRotaryEmbedding(cfg)

    llama3 = dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=1024
    )
    gpt_oss = modeling_gpt_oss.GptOssRotaryEmbedding(GptOssConfig(head_dim=64))
    assert gpt_oss.rope_type == "yarn" and gpt_oss.attention_scaling > 1
    longrope = dict(
        rope_type="longrope",
        rope_theta=10000.0,
        factor=8.0,
        short_factor=[1.0 + i / 32 for i in range(24)],
        long_factor=[1.0 + i / 4 for i in range(24)],
        original_max_position_embeddings=1024,
    )
    phi3_cfg = Phi3Config(
        hidden_size=256,
        num_attention_heads=4,
        max_position_embeddings=8192,
        partial_rotary_factor=0.75,
        rope_parameters=longrope,
    )
    phi3 = modeling_phi3.Phi3RotaryEmbedding(phi3_cfg)
    assert phi3.rope_type == "longrope" and phi3.attention_scaling > 1
    # Past every module's trained (or original) length, then within it.
    positions = [
        torch.tensor([[0, 1, 7, 511, 4000, 8191], [3, 2, 1, 0, 2047, 65537]]),
        torch.tensor([[0, 1, 7, 511, 1000, 1023], [3, 2, 1, 0, 17, 900]]),
    ]
    cases = [  # (module, dtype of x, on uniop)
        (rotary(), torch.float32, True),
        (rotary(), torch.bfloat16, True),
        (rotary(rope_type="linear", factor=4.0), torch.float32, True),
        (rotary(**llama3), torch.float32, True),
        (rotary().to(torch.bfloat16), torch.bfloat16, True),
        (rotary(), torch.float64, False),
        (rotary(rope_type="dynamic", factor=2.0), torch.float32, True),
        (rotary(rope_type="dynamic", factor=2.0), torch.bfloat16, True),
        (rotary(rope_type="dynamic", factor=2.0), torch.float64, False),
        (rotary(rope_type="yarn", factor=4.0, original_max_position_embeddings=1024), torch.float32, True),
        (rotary(rope_type="yarn", factor=4.0, original_max_position_embeddings=1024), torch.bfloat16, True),
        (gpt_oss, torch.float32, True),
        (gpt_oss, torch.bfloat16, True),
        (phi3, torch.float32, True),
        (copy.deepcopy(phi3), torch.bfloat16, True),
        (copy.deepcopy(phi3), torch.float64, False),
    ]
    # transformers' tables from a copy of each module, updated by the same calls in the same order.
    twins = [copy.deepcopy(rot) for rot, _, _ in cases]
    wants = [[twin(torch.zeros(1, dtype=dtype), pos) for pos in positions] for twin, (_, dtype, _) in zip(twins, cases)]
    try:
        ut.patch_llama()
        with torch.no_grad():
            for (rot, dtype, on_uniop), twin, want in zip(cases, twins, wants):
                for pos, want_at in zip(positions, want):
                    calls.clear()
                    got = rot(torch.zeros(1, dtype=dtype), pos)
                    assert bool(calls) == on_uniop, rot.rope_type
                    for g, w in zip(got, want_at):
                        assert g.shape == w.shape and g.dtype == w.dtype
                        if on_uniop:
                            # One ulp of the f32 value (or of bf16, where rounding the f32 one may tip);
                            # scaled by a factor s > 1 (YaRN's, longrope's), an ulp of cos times s and
                            # half an ulp of each product (values to s < 2).
                            scale = rot.attention_scaling
                            tol = (1.2e-7 if scale == 1 else 6e-8 * scale + 2.4e-7) if dtype == torch.float32 else 8e-3
                            torch.testing.assert_close(g, w, atol=tol, rtol=0)
                        else:
                            assert torch.equal(g, w)
                # The module's own state followed transformers' (dynamic NTK's grown and reset table).
                assert torch.equal(rot.inv_freq, twin.inv_freq), rot.rope_type
    finally:
        ut.unpatch_llama()


@pytest.mark.parametrize(
    "f32, bf16, vendor, want",
    [
        ("avx512", "avx512", "AuthenticAMD", {torch.float32, torch.bfloat16}),
        ("avx512", "amx", "GenuineIntel", {torch.bfloat16}),
        ("avx512", "avx512", "GenuineIntel", {torch.bfloat16}),
        ("avx2", "avx2", "AuthenticAMD", {torch.bfloat16}),
        ("avx512", "amx", "", {torch.float32, torch.bfloat16}),
    ],
)
def test_prefill_gemm_goes_where_it_is_faster(monkeypatch, f32, bf16, vendor, want):
    """Which dtypes' prefill-sized linears patch_llama gives uniop's GEMM: float32 with AVX-512
    except on Intel CPUs (where MKL runs AVX-512 too), bfloat16 everywhere."""
    import uniop
    from uniop.torch import llama

    monkeypatch.setattr(uniop, "gemm_kernels", lambda: {"float32": f32, "bfloat16": bf16})
    monkeypatch.setattr(llama, "_cpu_vendor", lambda: vendor)
    assert llama._all_rows_dtypes() == want


def test_cpu_vendor_reads_proc_cpuinfo(monkeypatch):
    """The vendor id from the first `vendor_id` line; "" where /proc/cpuinfo has none or cannot be read."""
    import io

    from uniop.torch import llama

    text = "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nvendor_id\t: Other\n"
    monkeypatch.setattr(llama, "open", lambda path: io.StringIO(text), raising=False)
    assert llama._cpu_vendor() == "AuthenticAMD"
    monkeypatch.setattr(llama, "open", lambda path: io.StringIO("processor\t: 0\n"), raising=False)
    assert llama._cpu_vendor() == ""

    def unreadable(path):
        raise FileNotFoundError(path)

    monkeypatch.setattr(llama, "open", unreadable, raising=False)
    assert llama._cpu_vendor() == ""


def test_patched_layers_fuse_residual_adds_and_train_like_transformers():
    """The patched decoder layer runs its residual adds inside add_rms_norm and linear_add (a
    9-token prompt is few rows: uniop's GEMM on every CPU), and a training step through them gives
    transformers' loss and gradients."""
    model = _tiny_llama().train()
    ids = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(2))

    def step():
        model.zero_grad()
        loss = model(ids, labels=ids).loss
        loss.backward()
        return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}

    want_loss, want = step()
    try:
        ut.patch_llama(model)
        with torch.profiler.profile() as prof:
            got_loss, got = step()
        ran = {e.name for e in prof.events()}
    finally:
        ut.unpatch_llama()
    assert {"uniop::add_rms_norm", "uniop::linear_add", "uniop::cross_entropy"} <= ran
    assert {"uniop::add_rms_norm_backward", "uniop::linear_add_backward", "uniop::cross_entropy_backward"} <= ran
    assert abs(got_loss - want_loss) < 1e-5
    for name, g in want.items():
        assert torch.allclose(got[name], g, atol=1e-5, rtol=1e-4), name


def test_patch_before_instantiation_and_unpatch():
    """patch_llama() without a model patches the classes of every family it covers, so a model
    built after it runs patched; unpatch_llama() restores every attribute it replaced."""
    import importlib

    from transformers.models.llama import modeling_llama as m

    from uniop.torch import llama

    def attributes():
        found = {}
        for family, prefix in llama._FAMILIES.items():
            modeling = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
            found[family, "rope"] = modeling.apply_rotary_pos_emb
            names = ["RMSNorm", "Attention", "RotaryEmbedding"]
            # Mixtral has no dense MLP, GPT-OSS's is its MoE block (its own, as its layer); Gemma2's and
            # Gemma3's decoder layers stay transformers' (see test_patched_gemma3_keeps_its_own_decoder_layer),
            # as do the layers of models without an MLP.
            own_layer = prefix in ("Gemma2", "Gemma3")
            no_mlp = prefix in ("Mixtral", "GptOss")
            names += [] if no_mlp else ["MLP"] if own_layer else ["MLP", "DecoderLayer"]
            for name in names:
                found[family, name] = getattr(modeling, prefix + name).forward
        return found

    original = attributes()
    ut.patch_llama()
    try:
        assert m.LlamaRMSNorm.forward is unn.RMSNorm.forward
        assert all(now is not original[key] for key, now in attributes().items())
        model = _tiny_llama()
        ids = torch.randint(0, 256, (1, 9))
        with torch.no_grad():
            patched = model(ids).logits
    finally:
        ut.unpatch_llama()
    assert attributes() == original
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, patched, atol=1e-4)
    families = "Llama, Mistral, Qwen2, Qwen3, Phi3, Gemma, Gemma2, Gemma3, Mixtral, Qwen2Moe, Qwen3Moe, GptOss"
    with pytest.raises(TypeError, match=f"expected a transformers {families} model, got Linear"):
        ut.patch_llama(nn.Linear(2, 2))


def test_patched_cache_grows_in_place_and_matches_concatenation():
    """Under patch_llama, DynamicLayer.update writes into reserved room; what it returns must equal
    transformers' own concatenation across prefill, many decode steps (past the first capacity),
    a crop, and after unpatching."""
    from transformers.cache_utils import DynamicLayer

    original = DynamicLayer.update
    steps = [torch.randn(2, 3, n, 8) for n in [5] + [1] * 300]
    ut.patch_llama()
    try:
        assert DynamicLayer.update is not original
        layer, want = DynamicLayer(), torch.empty(2, 3, 0, 8)
        for i, new in enumerate(steps):
            keys, values = layer.update(new, 2 * new)
            want = torch.cat([want, new], -2)
            assert torch.equal(keys, want) and torch.equal(values, 2 * want), f"step {i}"
            if i == 0:
                first_storage = keys.untyped_storage().data_ptr()
            elif i == 10:
                assert keys.untyped_storage().data_ptr() == first_storage, "decode steps write in place"
        layer.crop(-4)
        want = want[..., :-4, :]
        keys, _ = layer.update(steps[1], steps[1])
        assert torch.equal(keys, torch.cat([want, steps[1]], -2))
    finally:
        ut.unpatch_llama()
    assert DynamicLayer.update is original
    keys, _ = layer.update(steps[2], steps[2])
    assert torch.equal(keys, torch.cat([want, steps[1], steps[2]], -2))


def test_packed_weights_are_packed_once_follow_updates_and_keep_logits(monkeypatch):
    """patch_llama(pack_weights=True): a bf16 prefill's products run the packed ops on weights
    packed on first use, a second prefill packs nothing, an in-place weight update repacks that
    weight, decode-sized calls keep the unpacked weights, the logits are the unpacked route's
    (the same panels reach the same kernel) and unpatching drops the packed copies."""
    import uniop
    from uniop.torch import llama

    model = _tiny_llama(torch.bfloat16)
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(2))
    packs, packed_calls = [], []
    real_pack = uniop.pack_weight
    monkeypatch.setattr(uniop, "pack_weight", lambda *w: packs.append(len(w)) or real_pack(*w))
    for name in ("linear_packed", "linear_add_packed", "linear_silu_mul_packed"):
        real = getattr(unn.uniop_ops, name)
        monkeypatch.setattr(unn.uniop_ops, name, lambda *a, _n=name, _r=real: packed_calls.append(_n) or _r(*a))
    try:
        ut.patch_llama(model)
        with torch.no_grad():
            want = model(ids).logits
        assert packs == [] and packed_calls == []
        ut.patch_llama(model, pack_weights=True)
        with torch.no_grad():
            got = model(ids).logits
            # Per layer q, k, v, o, the gate/up pair and down_proj; lm_head (every position's logits).
            assert sorted(packs) == sorted([1, 1, 1, 1, 2, 1] * 2 + [1])
            assert sorted(set(packed_calls)) == ["linear_add_packed", "linear_packed", "linear_silu_mul_packed"]
            model(ids)
            assert len(packs) == 13, "a second prefill packed again"
            model(ids[:, :3])  # 6 rows: decode-sized, unpacked weights
            assert len(packs) == 13
            down = model.model.layers[0].mlp.down_proj.weight
            down.mul_(2)
            doubled = model(ids).logits
            assert len(packs) == 14, "the updated weight was not repacked"
            llama._PACK["on"] = False
            assert torch.equal(model(ids).logits, doubled)
            down.div_(2)
        assert torch.equal(got, want)
    finally:
        ut.unpatch_llama()
    assert not any("_uniop_packed" in m.__dict__ or "_uniop_packed_pair" in m.__dict__ for m in model.modules())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("num_items", [None, 7, "tensor"], ids=["mean", "sum-int", "sum-tensor"])
def test_patched_causal_lm_loss_matches_transformers(dtype, num_items):
    """patch_llama(model) gives a causal LM uniop's cross_entropy as its loss: transformers'
    ForCausalLMLoss (its float32 copy of the logits skipped) in value and gradient, with ignored
    labels, given shift_labels, the sum over num_items_in_batch (int or tensor), and a batch whose
    every label is ignored (NaN for the mean, 0 for the sum, as transformers gives)."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    from uniop.torch import llama

    gen = torch.Generator().manual_seed(3)
    num = torch.tensor(7) if num_items == "tensor" else num_items
    labels = torch.randint(0, 50, (2, 9), generator=gen)
    labels[0, 3:5] = -100
    shifted = torch.randint(0, 50, (2, 9), generator=gen)
    shifted[1, :4] = -100
    cases = [
        dict(labels=labels),
        dict(labels=None, shift_labels=shifted),
        dict(labels=torch.full((2, 9), -100)),
    ]
    for kwargs in cases:
        base = torch.randn(2, 9, 50, generator=gen).to(dtype)
        grads = []
        for loss_fn in (ForCausalLMLoss, llama._causal_lm_loss):
            logits = base.clone().requires_grad_(True)
            loss = loss_fn(logits, vocab_size=50, num_items_in_batch=num, **kwargs)
            assert loss.dtype == torch.float32 and loss.dim() == 0
            if not loss.isnan():
                loss.backward()
                grads.append((loss.detach(), logits.grad))
            else:
                grads.append((loss.detach(), None))
        (want, want_grad), (got, got_grad) = grads
        torch.testing.assert_close(got, want, equal_nan=True, atol=1e-5, rtol=1e-5)
        if want_grad is not None:
            assert got_grad.dtype == dtype
            atol = 1e-6 if dtype == torch.float32 else 2e-3
            torch.testing.assert_close(got_grad.float(), want_grad.float(), atol=atol, rtol=0)


def test_patch_llama_sets_and_restores_the_loss_but_keeps_a_users_own():
    from transformers.loss.loss_utils import ForCausalLMLoss

    from uniop.torch import llama

    model = _tiny_llama()
    try:
        ut.patch_llama(model)
        assert model.loss_function is llama._causal_lm_loss
    finally:
        ut.unpatch_llama()
    assert model.loss_function is ForCausalLMLoss and "_loss_function" not in model.__dict__

    def own(logits, labels, vocab_size, **kwargs):
        return logits.float().square().mean()

    model.loss_function = own
    try:
        ut.patch_llama(model)
        assert model.loss_function is own
        base = _tiny_llama().model  # a base model has no loss to patch
        ut.patch_llama(base)
        assert "_loss_function" not in base.__dict__
    finally:
        ut.unpatch_llama()
    assert model.loss_function is own


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_int8_linear_is_a_linear_on_its_dequantized_weight(dtype):
    """``Int8Linear.from_linear`` rounds each weight to the nearest step of its row's scale
    (``max |w| / 127``); the layer computes ``F.linear`` on that dequantized weight, and its
    gradients (of the input; of the scales and bias once they require one) are that linear's."""
    torch.manual_seed(0)
    linear = nn.Linear(48, 40).to(dtype)
    layer = unn.Int8Linear.from_linear(linear)
    assert layer.weight.dtype == torch.int8 and not layer.scales.requires_grad and not layer.bias.requires_grad
    w = linear.weight.detach().float()
    step = w.abs().amax(1, keepdim=True) / 127
    assert ((layer.dequantized() - w).abs() <= step / 2 * (1 + 1e-6)).all()
    x = torch.randn(3, 5, 48).to(dtype).requires_grad_()
    y = layer(x)
    dense = F.linear(x.detach().double(), layer.dequantized().double(), layer.bias.double())
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(y.double(), dense, rtol=tol, atol=tol)
    layer.scales.requires_grad_(True)
    layer.bias.requires_grad_(True)
    y = layer(x)
    dy = torch.randn_like(y)
    y.backward(dy)
    leaves = [t.detach().double().requires_grad_() for t in (x, layer.scales, layer.bias)]
    F.linear(leaves[0], layer.weight.double() * leaves[1][:, None], leaves[2]).backward(dy.double())
    for name, got, want in zip(["x", "scales", "bias"], [x.grad, layer.scales.grad, layer.bias.grad], leaves):
        scale = want.grad.abs().max().item()
        torch.testing.assert_close(got.double(), want.grad, rtol=tol, atol=tol * scale, msg=f"gradient of {name}")


def _dequantized_twin(model):
    """A copy of ``model`` after ``quantize_int8``: its ``Int8Linear`` layers back as ``nn.Linear``
    on their dequantized weights (what the quantized model should compute, by plain torch)."""
    import copy

    twin = copy.deepcopy(model)
    for name, child in list(twin.named_modules()):
        for attr, layer in list(child.named_children()):
            if isinstance(layer, unn.Int8Linear):
                dense = nn.Linear(layer.in_features, layer.out_features, layer.bias is not None)
                dense.weight.data = layer.dequantized().to(layer.scales.dtype)
                if layer.bias is not None:
                    dense.bias.data = layer.bias.detach().float()
                setattr(child, attr, dense)
    return twin


def test_quantized_llama_runs_as_its_dequantized_twin_patched_or_not():
    """``quantize_int8`` turns a tiny Llama's projections (not its head) into ``Int8Linear``; its
    logits and greedy tokens equal those of plain transformers on the dequantized weights, before
    and after ``patch_llama``; and a LoRA adapter beside a quantized projection trains: its
    gradients are the twin's."""
    model = unn.quantize_int8(_tiny_llama())
    layers = [m for m in model.modules() if isinstance(m, unn.Int8Linear)]
    assert len(layers) == 2 * 7 and isinstance(model.lm_head, nn.Linear)
    twin = _dequantized_twin(model)
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = twin(ids).logits
        want_tokens = twin.generate(ids[:1], max_new_tokens=12, do_sample=False)
        got = model(ids).logits
        tokens = model.generate(ids[:1], max_new_tokens=12, do_sample=False)
        try:
            ut.patch_llama(model)
            patched = model(ids).logits
            patched_tokens = model.generate(ids[:1], max_new_tokens=12, do_sample=False)
        finally:
            ut.unpatch_llama()
    for logits in (got, patched):
        assert (logits - want).abs().max().item() < 1e-4
    assert torch.equal(tokens, want_tokens) and torch.equal(patched_tokens, want_tokens)

    # A LoRA update beside the first layer's quantized q_proj: y = base(x) + (x @ Aᵀ) @ Bᵀ.
    torch.manual_seed(2)
    lora_a, lora_b = torch.randn(4, 64) * 0.1, torch.randn(64, 4) * 0.1
    grads = []
    for m in (model, twin):
        a, b = lora_a.clone().requires_grad_(), lora_b.clone().requires_grad_()
        q_proj = m.model.layers[0].self_attn.q_proj
        handle = q_proj.register_forward_hook(lambda mod, inp, out: out + inp[0] @ a.t() @ b.t())
        try:
            F.cross_entropy(m(ids).logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).backward()
        finally:
            handle.remove()
        grads.append((a.grad, b.grad))
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
