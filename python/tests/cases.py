"""Sample arguments and independent torch references for every built-in op.

`CASES[name](dtype, strided)` returns `(args, reference)`: `args` for the op (strided views when
`strided`), `reference(*args)` computing the expected returns in float64 with plain torch.
Backward ops are checked against torch autograd of the forward's reference.
"""

import math

import torch
import torch.nn.functional as F

D = torch.float64


def _rand(*shape, dtype, strided=False, gen=None):
    if strided and len(shape) >= 2:
        # A transposed view of a buffer with the last two dims swapped: non-contiguous strides.
        t = torch.randn(*shape[:-2], shape[-1], shape[-2], generator=gen).to(dtype)
        return t.transpose(-1, -2)
    return torch.randn(*shape, generator=gen).to(dtype)


def _stat(x, dtype):
    """A saved statistic (rstd, lse) as the forward returns it: float32, or float64 for float64
    calls (uniop runs those through the f64 reference, whose outputs are all float64)."""
    return x.to(D if dtype == D else torch.float32)


def _vjp(fn, inputs, grads, wrt):
    """Gradients of fn(*inputs) (a tuple of outputs) against `grads`, for the inputs in `wrt`."""
    xs = [
        x.detach().to(D).requires_grad_(i in wrt) if x is not None and x.is_floating_point() else x
        for i, x in enumerate(inputs)
    ]
    outs = fn(*xs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    torch.autograd.backward([o for o, g in zip(outs, grads) if g is not None], [g.to(D) for g in grads if g is not None])
    return tuple(xs[i].grad for i in wrt)


def rms_ref(x, w, eps=1e-6):
    x64 = x.to(D)
    rstd = torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)
    return x64 * rstd * w.to(D), rstd


def layer_norm_ref(x, w, b, eps=1e-5):
    """torch's layer_norm in float64, with its saved mean and rstd (normalized dim kept)."""
    x64 = x.to(D)
    mean = x64.mean(-1, keepdim=True)
    rstd = torch.rsqrt(x64.var(-1, unbiased=False, keepdim=True) + eps)
    y = F.layer_norm(x64, x64.shape[-1:], w.to(D), None if b is None else b.to(D), eps)
    return y, mean, rstd


def rope_half_ref(x, cos, sin):
    x = x.to(D)
    d = x.shape[-1]
    rot = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1)
    return x * cos.to(D) + rot * sin.to(D)


def cos_sin_ref(pos, dim, theta=10000.0):
    inv = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=D) / dim)
    ang = pos.to(D)[..., None] * inv
    ang = torch.cat([ang, ang], -1)
    return ang.cos(), ang.sin()


def silu_mul_ref(g, u):
    return F.silu(g.to(D)) * u.to(D)


def gelu_mul_ref(g, u, approximate="none"):
    return F.gelu(g.to(D), approximate=approximate) * u.to(D)


def geglu_ref(x, dim=-1, approximate="none", activate_left=False):
    """aclnn GeGlu: a · gelu(b) for x's halves a, b along dim; gelu(a) · b when activate_left."""
    a, b = x.to(D).chunk(2, dim)
    return gelu_mul_ref(a, b, approximate) if activate_left else gelu_mul_ref(b, a, approximate)


def clamped_swiglu_ref(x, alpha=1.702, limit=7.0, up_shift=1.0, interleaved=True, limit_after_act=False):
    """GPT-OSS's experts' gate (transformers' ``GptOssExperts._apply_gate``), in float64; with
    ``interleaved=False`` on gate and up halves (DeepSeek V4's, with ``alpha`` 1 and no shift);
    ``limit_after_act`` bounds the activation rather than the gate (Step 3.7's)."""
    x = x.to(D)
    gate, up = (x[..., ::2], x[..., 1::2]) if interleaved else x.chunk(2, -1)
    up = up.clamp(-limit, limit)
    if limit_after_act:
        return (up + up_shift) * (gate * torch.sigmoid(gate * alpha)).clamp(max=limit)
    gate = gate.clamp(max=limit)
    return (up + up_shift) * gate * torch.sigmoid(gate * alpha)


def softcapped_swiglu_ref(x, gate_softcap=4.0, up_softcap=25.0, interleaved=False):
    """Inkling 2's experts' gate (transformers' ``Inkling2SoftcappedSwiGLU`` on ``chunk(2, -1)``'s
    halves, or on interleaved pairs), in float64."""
    x = x.to(D)
    gate, up = (x[..., ::2], x[..., 1::2]) if interleaved else x.chunk(2, -1)
    capped_gate, capped_up = gate_softcap * torch.tanh(gate / gate_softcap), up_softcap * torch.tanh(up / up_softcap)
    return capped_gate * torch.sigmoid(gate) * capped_up


def gated_ref(x, gate_weight, up_weight, approximate=None):
    """linear_silu_mul: silu(x · gate_weightᵀ) · (x · up_weightᵀ); with ``approximate``,
    linear_gelu_mul (gelu of that form for silu)."""
    x = x.to(D)
    g, u = F.linear(x, gate_weight.to(D)), F.linear(x, up_weight.to(D))
    return silu_mul_ref(g, u) if approximate is None else gelu_mul_ref(g, u, approximate)


def attention_ref(q, k, v, causal, mask=None, softcap=None, sinks=None):
    q, k, v = q.to(D), k.to(D), v.to(D)
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if softcap is not None:  # Gemma 2's eager attention: capped, then masked
        s = softcap * torch.tanh(s / softcap)
    sq, sk = s.shape[-2:]
    if causal:
        s = s.masked_fill(~torch.ones(sq, sk, dtype=torch.bool).tril(sk - sq), float("-inf"))
    if mask is not None and mask.dtype == torch.bool:
        s = s.masked_fill(~mask, float("-inf"))
    elif mask is not None:
        s = s + mask.to(D)
    if sinks is not None:  # GPT-OSS's eager attention: one more logit per head, dropped after the softmax
        s = torch.cat([s, sinks.to(D).reshape(1, -1, 1, 1).expand(*s.shape[:-1], 1)], -1)
    return torch.softmax(s, -1)[..., :sk] @ v, torch.logsumexp(s, -1)


def attention_mask(sq, sk, dtype=torch.bool):
    """A mask broadcast over batch and heads that hides every third key from the other queries
    (each query keeps its own position, so none is left without keys): boolean, or as a float
    mask of ``dtype`` (SDPA's additive kind: −inf where hidden, an ALiBi-like −|i − j| / 4 where
    kept)."""
    i, j = torch.arange(sq)[:, None], torch.arange(sk)[None, :]
    keep = ((j % 3 != 1) | (i == j))[None, None]
    if dtype == torch.bool:
        return keep
    bias = -(i - j).abs().to(dtype) / 4
    return bias.masked_fill(~keep, float("-inf"))


def causal_softmax_ref(x):
    x = x.to(D)
    sq, sk = x.shape[-2:]
    mask = torch.ones(sq, sk, dtype=torch.bool).tril(sk - sq)
    return torch.softmax(x.masked_fill(~mask, float("-inf")), -1)


def ce_ref(logits, target, ignore_index=-100):
    lp = torch.log_softmax(logits.to(D), -1)
    return F.nll_loss(lp, target, ignore_index=ignore_index), torch.logsumexp(logits.to(D), -1)


def packed_ref(w, up=None):
    """pack_weight's layout built with plain torch: `[panels, words, 32, per_word]`, `per_word`
    input features a word (2 for bfloat16), 32 output features a panel (16 of each of a pair)."""
    per_word = 2 if w.dtype == torch.bfloat16 else 1
    width = 32 if up is None else 16
    n, k = w.shape
    words, panels = -(-k // per_word), -(-n // width)

    def panel_rows(m):
        m = F.pad(m, (0, words * per_word - k, 0, panels * width - n))
        return m.reshape(panels, width, words, per_word)

    parts = [panel_rows(w)] + ([] if up is None else [panel_rows(up)])
    return torch.cat(parts, 1).permute(0, 2, 1, 3).contiguous()


def _packable(dt):
    """pack_weight packs bfloat16 and float32 (and float64 calls run its reference): float16 cases
    take bfloat16."""
    return torch.bfloat16 if dt == torch.float16 else dt


def _cases():
    c = {}

    def case(fn):
        c[fn.__name__] = fn
        return fn

    @case
    def rms_norm(dt, strided):
        return (_rand(6, 16, dtype=dt, strided=strided), torch.randn(16).to(dt), 1e-6), rms_ref

    @case
    def rms_norm_backward(dt, strided):
        x, w, dy = _rand(6, 16, dtype=dt, strided=strided), torch.randn(16).to(dt), torch.randn(6, 16).to(dt)
        rstd = _stat(rms_ref(x, w)[1], dt)
        return (dy, x, w, rstd), lambda dy, x, w, r: _vjp(lambda x, w: rms_ref(x, w)[0], (x, w), (dy,), (0, 1))

    @case
    def add_rms_norm(dt, strided):
        def ref(x, r, w, eps=1e-6):
            s = x.to(D) + r.to(D)
            y, rstd = rms_ref(s, w, eps)
            return y, rstd, s

        return (_rand(5, 16, dtype=dt, strided=strided), torch.randn(5, 16).to(dt), torch.randn(16).to(dt)), ref

    @case
    def add_rms_norm_backward(dt, strided):
        total, w = torch.randn(5, 16).to(dt), torch.randn(16).to(dt)
        dy, dsum = _rand(5, 16, dtype=dt, strided=strided), torch.randn(5, 16).to(dt)
        rstd = _stat(rms_ref(total, w)[1], dt)

        def ref(dy, dsum, total, w, rstd):
            # The sum as x + 0: its gradient is dx and dresidual both.
            zero = torch.zeros_like(total)
            fwd = lambda x, r, w: (rms_ref(x + r, w)[0], x + r)  # noqa: E731
            return _vjp(fwd, (total, zero, w), (dy, dsum), (0, 1, 2))

        return (dy, dsum, total, w, rstd), ref

    @case
    def layer_norm(dt, strided):
        # An offset of 8 on unit-spread rows: a variance taken as E[x²] − mean² would lose it.
        x = _rand(6, 16, dtype=dt, strided=strided) + 8
        return (x, torch.randn(16).to(dt), torch.randn(16).to(dt), 1e-5), layer_norm_ref

    @case
    def layer_norm_backward(dt, strided):
        x, w, dy = _rand(6, 16, dtype=dt, strided=strided), torch.randn(16).to(dt), torch.randn(6, 16).to(dt)
        _, mean, rstd = layer_norm_ref(x, w, None)
        bias = torch.zeros(16, dtype=D)

        def ref(dy, x, w, mean, rstd):
            return _vjp(lambda x, w, b: layer_norm_ref(x, w, b)[0], (x, w, bias), (dy,), (0, 1, 2))

        return (dy, x, w, _stat(mean, dt), _stat(rstd, dt)), ref

    @case
    def rope(dt, strided):
        x = _rand(2, 3, 5, 8, dtype=dt, strided=strided)
        cos, sin = cos_sin_ref(torch.arange(5), 8)
        return (x, cos.float(), sin.float(), "half"), lambda x, c, s, m: rope_half_ref(x, c, s)

    @case
    def rope_backward(dt, strided):
        dout = _rand(2, 3, 5, 8, dtype=dt, strided=strided)
        cos, sin = cos_sin_ref(torch.arange(5), 8)
        x = torch.randn(2, 3, 5, 8)
        return (dout, cos.float(), sin.float(), "half"), lambda d, c, s, m: _vjp(
            lambda x: rope_half_ref(x, c, s), (x,), (d,), (0,)
        )

    @case
    def rope_cos_sin(dt, strided):
        return (torch.arange(7).view(1, 7), 8, 10000.0, "half", dt), lambda p, d, t, m, dt: cos_sin_ref(p, d, t)

    @case
    def swiglu(dt, strided):
        def ref(x, dim=-1):
            g, u = x.to(D).chunk(2, dim)
            return silu_mul_ref(g, u)

        return (_rand(4, 12, dtype=dt, strided=strided), -1), ref

    @case
    def swiglu_backward(dt, strided):
        x, dout = _rand(4, 12, dtype=dt, strided=strided), torch.randn(4, 6).to(dt)
        return (dout, x, -1), lambda d, x, dim: _vjp(lambda x: silu_mul_ref(*x.chunk(2, -1)), (x,), (d,), (0,))

    @case
    def geglu(dt, strided):
        return (_rand(6, 5, dtype=dt, strided=strided), 0, "none", False), geglu_ref

    @case
    def geglu_backward(dt, strided):
        x, dout = _rand(4, 12, dtype=dt, strided=strided), torch.randn(4, 6).to(dt)
        return (dout, x, -1, "tanh", True), lambda d, x, *form: _vjp(lambda x: geglu_ref(x, *form), (x,), (d,), (0,))

    @case
    def clamped_swiglu(dt, strided):
        # Deviation 5: a share of the gates and up values past the limit of 7, on both sides.
        return (_rand(4, 12, dtype=dt, strided=strided).mul_(5), 1.702, 7.0), clamped_swiglu_ref

    @case
    def clamped_swiglu_backward(dt, strided):
        # The gate/up halves layout here, the limit after the activation (the forward's case takes
        # GPT-OSS's interleaved pairs, the limit on the gate).
        x, dout = _rand(4, 12, dtype=dt, strided=strided).mul_(5), torch.randn(4, 6).to(dt)
        return (dout, x, 1.5, 6.0, 0.5, False, True), lambda d, x, *form: _vjp(
            lambda x: clamped_swiglu_ref(x, *form), (x,), (d,), (0,)
        )

    @case
    def softcapped_swiglu(dt, strided):
        # Deviation 15: gates past their cap of 4, up values near and past theirs of 25 (halves).
        return (_rand(4, 12, dtype=dt, strided=strided).mul_(15),), softcapped_swiglu_ref

    @case
    def softcapped_swiglu_backward(dt, strided):
        # Interleaved pairs and other caps here (the forward's case takes the defaults on halves).
        x, dout = _rand(4, 12, dtype=dt, strided=strided).mul_(5), torch.randn(4, 6).to(dt)
        return (dout, x, 2.0, 6.0, True), lambda d, x, *form: _vjp(
            lambda x: softcapped_swiglu_ref(x, *form), (x,), (d,), (0,)
        )

    @case
    def silu_mul(dt, strided):
        return (_rand(4, 10, dtype=dt, strided=strided), torch.randn(4, 10).to(dt)), silu_mul_ref

    @case
    def silu_mul_backward(dt, strided):
        g, u, d = _rand(4, 10, dtype=dt, strided=strided), torch.randn(4, 10).to(dt), torch.randn(4, 10).to(dt)
        return (d, g, u), lambda d, g, u: _vjp(silu_mul_ref, (g, u), (d,), (0, 1))

    @case
    def gelu_mul(dt, strided):
        return (_rand(4, 10, dtype=dt, strided=strided), torch.randn(4, 10).to(dt), "tanh"), gelu_mul_ref

    @case
    def gelu_mul_backward(dt, strided):
        g, u, d = _rand(4, 10, dtype=dt, strided=strided), torch.randn(4, 10).to(dt), torch.randn(4, 10).to(dt)
        return (d, g, u, "none"), lambda d, g, u, a: _vjp(lambda g, u: gelu_mul_ref(g, u, a), (g, u), (d,), (0, 1))

    @case
    def silu(dt, strided):
        return (_rand(3, 9, dtype=dt, strided=strided),), lambda x: F.silu(x.to(D))

    @case
    def silu_backward(dt, strided):
        dy, x = _rand(3, 9, dtype=dt, strided=strided), (4 * torch.randn(3, 9)).to(dt)
        return (dy, x), lambda dy, x: _vjp(F.silu, (x,), (dy,), (0,))

    @case
    def gelu(dt, strided):
        return (_rand(3, 9, dtype=dt, strided=strided), "tanh"), lambda x, a: F.gelu(x.to(D), approximate=a)

    @case
    def gelu_backward(dt, strided):
        x, dy = _rand(3, 9, dtype=dt, strided=strided), torch.randn(3, 9).to(dt)
        return (dy, x, "none"), lambda dy, x, a: _vjp(lambda x: F.gelu(x, approximate=a), (x,), (dy,), (0,))

    @case
    def softmax(dt, strided):
        return (_rand(4, 11, dtype=dt, strided=strided), -1), lambda x, dim: torch.softmax(x.to(D), dim)

    @case
    def log_softmax(dt, strided):
        return (_rand(4, 11, dtype=dt, strided=strided), 0), lambda x, dim: torch.log_softmax(x.to(D), dim)

    @case
    def softmax_backward(dt, strided):
        x, dy = torch.randn(4, 11), _rand(4, 11, dtype=dt, strided=strided)
        y = torch.softmax(x, -1).to(dt)
        return (dy, y, -1), lambda dy, y, dim: (y.to(D) * (dy.to(D) - (dy.to(D) * y.to(D)).sum(dim, keepdim=True)),)

    @case
    def log_softmax_backward(dt, strided):
        x, dy = torch.randn(4, 11), _rand(4, 11, dtype=dt, strided=strided)
        y = torch.log_softmax(x, -1).to(dt)
        return (dy, y, -1), lambda dy, y, dim: (dy.to(D) - y.to(D).exp() * dy.to(D).sum(dim, keepdim=True),)

    @case
    def causal_softmax(dt, strided):
        return (_rand(2, 5, 7, dtype=dt, strided=strided),), causal_softmax_ref

    @case
    def matmul(dt, strided):
        return (_rand(2, 5, 7, dtype=dt, strided=strided), _rand(7, 3, dtype=dt, strided=strided)), lambda a, b: a.to(
            D
        ) @ b.to(D)

    @case
    def matmul_backward(dt, strided):
        a, b, d = _rand(2, 5, 7, dtype=dt, strided=strided), torch.randn(7, 3).to(dt), torch.randn(2, 5, 3).to(dt)
        return (d, a, b), lambda d, a, b: _vjp(lambda a, b: a @ b, (a, b), (d,), (0, 1))

    @case
    def linear(dt, strided):
        x, w, b = _rand(4, 6, dtype=dt, strided=strided), _rand(5, 6, dtype=dt, strided=strided), torch.randn(5).to(dt)
        return (x, w, b), lambda x, w, b: F.linear(x.to(D), w.to(D), b.to(D))

    @case
    def linear_backward(dt, strided):
        x, w, dy = _rand(4, 6, dtype=dt, strided=strided), torch.randn(5, 6).to(dt), torch.randn(4, 5).to(dt)
        b = torch.zeros(5)
        return (dy, x, w), lambda dy, x, w: _vjp(lambda x, w, b: F.linear(x, w, b), (x, w, b), (dy,), (0, 1, 2))

    @case
    def linear_add(dt, strided):
        x, w, r = _rand(4, 6, dtype=dt, strided=strided), _rand(5, 6, dtype=dt, strided=strided), _rand(4, 5, dtype=dt, strided=strided)
        return (x, w, r), lambda x, w, r: r.to(D) + F.linear(x.to(D), w.to(D))

    @case
    def linear_add_backward(dt, strided):
        x, w, dy = _rand(4, 6, dtype=dt, strided=strided), torch.randn(5, 6).to(dt), torch.randn(4, 5).to(dt)
        r = torch.zeros(4, 5)
        return (dy, x, w), lambda dy, x, w: _vjp(lambda x, w, r: r + F.linear(x, w), (x, w, r), (dy,), (0, 1, 2))

    @case
    def linear_silu_mul(dt, strided):
        x, wg, wu = _rand(4, 6, dtype=dt, strided=strided), _rand(5, 6, dtype=dt, strided=strided), torch.randn(5, 6).to(dt)
        return (x, wg, wu), gated_ref

    @case
    def linear_silu_mul_train(dt, strided):
        x, wg, wu = _rand(4, 6, dtype=dt, strided=strided), _rand(5, 6, dtype=dt, strided=strided), torch.randn(5, 6).to(dt)

        def ref(x, wg, wu):
            g, u = F.linear(x.to(D), wg.to(D)), F.linear(x.to(D), wu.to(D))
            return silu_mul_ref(g, u), g, u

        return (x, wg, wu), ref

    @case
    def linear_silu_mul_backward(dt, strided):
        # With the products saved, as linear_silu_mul_train's autograd passes them (strided here:
        # a transposed view of each); linear_silu_mul's gradcheck covers the recomputing route.
        x, wg, wu = _rand(4, 6, dtype=dt, strided=strided), torch.randn(5, 6).to(dt), torch.randn(5, 6).to(dt)
        dy = torch.randn(4, 5).to(dt)
        products = [F.linear(x.to(D), w.to(D)).to(dt) for w in (wg, wu)]
        if strided:
            products = [p.t().contiguous().t() for p in products]
        return (dy, x, wg, wu, *products), lambda dy, x, wg, wu, g, u: _vjp(gated_ref, (x, wg, wu), (dy,), (0, 1, 2))

    @case
    def linear_gelu_mul(dt, strided):
        x, wg, wu = _rand(4, 6, dtype=dt, strided=strided), _rand(5, 6, dtype=dt, strided=strided), torch.randn(5, 6).to(dt)
        return (x, wg, wu, "tanh"), gated_ref

    @case
    def linear_gelu_mul_train(dt, strided):
        x, wg, wu = _rand(4, 6, dtype=dt, strided=strided), _rand(5, 6, dtype=dt, strided=strided), torch.randn(5, 6).to(dt)

        def ref(x, wg, wu, approximate):
            g, u = F.linear(x.to(D), wg.to(D)), F.linear(x.to(D), wu.to(D))
            return gelu_mul_ref(g, u, approximate), g, u

        return (x, wg, wu, "none"), ref

    @case
    def linear_gelu_mul_backward(dt, strided):
        # Without the products (the recomputing route; linear_silu_mul_backward's case takes them).
        x, wg, wu = _rand(4, 6, dtype=dt, strided=strided), torch.randn(5, 6).to(dt), torch.randn(5, 6).to(dt)
        dy = torch.randn(4, 5).to(dt)
        return (dy, x, wg, wu, None, None, "tanh"), lambda dy, x, wg, wu, g, u, a: _vjp(
            lambda x, wg, wu: gated_ref(x, wg, wu, a), (x, wg, wu), (dy,), (0, 1, 2)
        )

    @case
    def pack_weight(dt, strided):
        dt = _packable(dt)
        w, up = _rand(40, 9, dtype=dt, strided=strided), torch.randn(40, 9).to(dt)
        return (w, up), lambda w, up: packed_ref(w, up)

    @case
    def linear_packed(dt, strided):
        dt = _packable(dt)
        x, w, b = _rand(4, 9, dtype=dt, strided=strided), torch.randn(40, 9).to(dt), torch.randn(40).to(dt)
        return (x, packed_ref(w), 40, b), lambda x, packed, n, b: F.linear(x.to(D), w.to(D), b.to(D))

    @case
    def linear_int8(dt, strided):
        """An int8 weight quantized per output feature (torchao's int8_weight_only layout); the
        reference dequantizes it in float64."""
        x = _rand(4, 9, dtype=dt, strided=strided)
        w = torch.randint(-127, 128, (9, 40) if strided else (40, 9), dtype=torch.int8)
        w = w.t() if strided else w
        s, b = (torch.rand(40) * 0.02 + 0.001).to(dt), torch.randn(40).to(dt)
        return (x, w, s, b), lambda x, w, s, b: F.linear(x.to(D), w.to(D) * s.to(D)[:, None], b.to(D))

    @case
    def linear_int8_backward(dt, strided):
        """Gradients of x, the scales and the bias through the dequantized weight (float64 autograd);
        the int8 weight gets none."""
        x, dy = _rand(4, 9, dtype=dt, strided=strided), _rand(4, 40, dtype=dt, strided=strided)
        w = torch.randint(-127, 128, (40, 9), dtype=torch.int8)
        s, b = (torch.rand(40) * 0.02 + 0.001).to(dt), torch.zeros(40)
        return (dy, x, w, s), lambda dy, x, w, s: _vjp(
            lambda x, s, b: F.linear(x, w.to(D) * s[:, None], b), (x, s, b), (dy,), (0, 1, 2)
        )

    @case
    def linear_add_packed(dt, strided):
        dt = _packable(dt)
        x, w, r = _rand(4, 9, dtype=dt, strided=strided), torch.randn(40, 9).to(dt), _rand(4, 40, dtype=dt, strided=strided)
        return (x, packed_ref(w), 40, r), lambda x, packed, n, r: r.to(D) + F.linear(x.to(D), w.to(D))

    @case
    def linear_silu_mul_packed(dt, strided):
        dt = _packable(dt)
        x, wg, wu = _rand(4, 9, dtype=dt, strided=strided), torch.randn(40, 9).to(dt), torch.randn(40, 9).to(dt)
        return (x, packed_ref(wg, wu), 40), lambda x, packed, n: gated_ref(x, wg, wu)

    @case
    def linear_gelu_mul_packed(dt, strided):
        dt = _packable(dt)
        x, wg, wu = _rand(4, 9, dtype=dt, strided=strided), torch.randn(40, 9).to(dt), torch.randn(40, 9).to(dt)
        return (x, packed_ref(wg, wu), 40, "tanh"), lambda x, packed, n, a: gated_ref(x, wg, wu, a)

    # The strided variants carry a float mask of the inputs' dtype, a softcap (which bends the
    # scaled scores, of deviation ~1, by up to a third) and strided sinks, the contiguous ones a
    # boolean mask.
    @case
    def attention(dt, strided):
        q = _rand(1, 4, 6, 8, dtype=dt, strided=strided)
        k, v = torch.randn(1, 2, 6, 8).to(dt), torch.randn(1, 2, 6, 8).to(dt)
        mask = attention_mask(6, 6, dt if strided else torch.bool)
        cap, sinks = (2.0, torch.randn(8).to(dt)[::2]) if strided else (None, None)
        return (q, k, v, None, True, None, mask, cap, sinks), lambda q, k, v, n, causal, s, m, cap, sinks: (
            attention_ref(q, k, v, causal, m, cap, sinks)
        )

    @case
    def attention_backward(dt, strided):
        q, k, v = torch.randn(1, 4, 6, 8).to(dt), torch.randn(1, 2, 6, 8).to(dt), torch.randn(1, 2, 6, 8).to(dt)
        mask = attention_mask(6, 6, dt if strided else torch.bool)
        cap, sinks = (2.0, torch.randn(8).to(dt)[::2]) if strided else (None, None)
        out, lse = attention_ref(q, k, v, True, mask, cap, sinks)
        dout = _rand(1, 4, 6, 8, dtype=dt, strided=strided)
        # The float mask's gradient is asked for too (summed over the batch and heads it is
        # broadcast along), and the sinks'; a boolean mask has none.
        args = (dout, q, k, v, out.to(dt), _stat(lse, dt), None, True, None, mask, strided, cap, sinks)
        return args, lambda d, q, k, v, o, l, n, c, s, m, needs_dmask, cap, sinks: _vjp(
            lambda q, k, v, m, sinks: attention_ref(q, k, v, True, m, cap, sinks)[0],
            (q, k, v, m, sinks),
            (d,),
            (0, 1, 2, 3, 4) if strided else (0, 1, 2),
        )

    @case
    def embedding(dt, strided):
        w = _rand(10, 6, dtype=dt, strided=strided)
        return (w, torch.tensor([[1, 9, 3], [0, 1, 1]])), lambda w, i: F.embedding(i, w.to(D))

    @case
    def embedding_backward(dt, strided):
        i, w = torch.tensor([[1, 9, 3], [0, 1, 1]]), torch.randn(10, 6).to(dt)
        d = _rand(2, 3, 6, dtype=dt, strided=strided)
        return (d, i, w), lambda d, i, w: _vjp(lambda w: F.embedding(i, w), (w,), (d,), (0,))

    @case
    def cross_entropy(dt, strided):
        logits = _rand(5, 9, dtype=dt, strided=strided)
        return (logits, torch.tensor([1, 8, -100, 0, 3])), ce_ref

    @case
    def cross_entropy_backward(dt, strided):
        logits, t = _rand(5, 9, dtype=dt, strided=strided), torch.tensor([1, 8, -100, 0, 3])
        lse = _stat(torch.logsumexp(logits.to(D), -1), dt)
        return (_stat(torch.tensor(1.5), dt), logits, t, lse), lambda dl, lg, t, lse: _vjp(
            lambda lg: ce_ref(lg, t)[0], (lg,), (dl,), (0,)
        )

    @case
    def argmax(dt, strided):
        return (_rand(4, 9, dtype=dt, strided=strided), 1, True), lambda x, dim, k: x.to(D).argmax(dim, keepdim=k)

    @case
    def add(dt, strided):
        return (_rand(4, 6, dtype=dt, strided=strided), torch.randn(6).to(dt)), lambda a, b: a.to(D) + b.to(D)

    @case
    def add_backward(dt, strided):
        # a broadcasts over the batch and along the rows, b along the columns.
        a, b, dout = torch.randn(4, 1).to(dt), torch.randn(2, 1, 6).to(dt), _rand(2, 4, 6, dtype=dt, strided=strided)
        return (dout, a, b, -0.5), lambda d, a, b, alpha: _vjp(lambda a, b: a + alpha * b, (a, b), (d,), (0, 1))

    @case
    def mul(dt, strided):
        return (_rand(4, 6, dtype=dt, strided=strided), torch.randn(4, 1).to(dt)), lambda a, b: a.to(D) * b.to(D)

    @case
    def mul_backward(dt, strided):
        a, b, dout = torch.randn(3, 1, 6).to(dt), torch.randn(4, 1).to(dt), _rand(3, 4, 6, dtype=dt, strided=strided)
        return (dout, a, b), lambda d, a, b: _vjp(torch.mul, (a, b), (d,), (0, 1))

    @case
    def cast(dt, strided):
        # float64 calls (the gradient checks) cast to float64: the derivative of a rounding to
        # float32 is not what finite differences in float64 can check.
        to = D if dt == D else torch.float32
        return (_rand(3, 5, dtype=dt, strided=strided), to), lambda x, d: x.to(D)

    @case
    def cast_backward(dt, strided):
        # The gradient comes back in the argument's dtype, rounded once.
        x = torch.randn(3, 5).to(torch.bfloat16 if dt == torch.float32 else torch.float32)
        return (_rand(3, 5, dtype=dt, strided=strided), x), lambda dy, x: dy.to(x.dtype).to(D)

    @case
    def sample(dt, strided):
        # Temperature 0 is greedy: the reference is argmax.
        return (_rand(3, 17, dtype=dt, strided=strided), 0.0), lambda x, t: x.to(D).argmax(-1)

    @case
    def cat(dt, strided):
        # A list argument: a KV block, a strided one (when asked) and one new row along dim -2.
        ts = [torch.randn(2, 5, 4).to(dt), _rand(2, 3, 4, dtype=dt, strided=strided), torch.randn(2, 1, 4).to(dt)]
        return (ts, -2), lambda ts, dim: torch.cat([t.to(D) for t in ts], dim)

    @case
    def cat_backward(dt, strided):
        # The gradient of cat's case (a KV block, a shorter one and a new row along dim -2), split
        # back to the three; strided when asked.
        ts = [torch.randn(2, 5, 4).to(dt), torch.randn(2, 3, 4).to(dt), torch.randn(2, 1, 4).to(dt)]
        dout = _rand(2, 9, 4, dtype=dt, strided=strided)
        return (dout, ts, -2), lambda d, ts, dim: _vjp(lambda *xs: torch.cat(xs, dim), ts, (d,), (0, 1, 2))

    @case
    def permute(dt, strided):
        # HF's [B, S, H, D] to [B, H, S, D], with a negative dim.
        return (_rand(2, 5, 3, 4, dtype=dt, strided=strided), [0, 2, 1, -1]), lambda x, d: x.to(D).permute(d)

    @case
    def permute_backward(dt, strided):
        dout = _rand(2, 3, 5, 4, dtype=dt, strided=strided)
        x = torch.randn(2, 5, 3, 4)
        return (dout, [0, 2, 1, -1]), lambda d, dims: _vjp(lambda x: x.permute(dims), (x,), (d,), (0,))

    @case
    def kv_cache_append(dt, strided):
        kc, vc = torch.zeros(2, 2, 8, 4).to(dt), torch.zeros(2, 2, 8, 4).to(dt)
        k, v = _rand(2, 2, 3, 4, dtype=dt, strided=strided), torch.randn(2, 2, 3, 4).to(dt)
        return (kc, vc, k, v, torch.tensor([0, 5])), None

    return c


CASES = _cases()
