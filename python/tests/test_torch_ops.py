"""Every op through both Python routes (uniop.<op> and torch.ops.uniop.<op>) against float64 torch
references, at f32/f16/bf16, contiguous and strided; opcheck for every registration; gradcheck for
every backward."""

import collections
import contextlib
import ctypes
import itertools
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import uniop
import uniop.torch  # noqa: F401  (registers torch.ops.uniop)
from cases import CASES, attention_mask, attention_ref, cos_sin_ref, rope_half_ref

# Tests of what only the C++ kernels do (their error types and messages, torch-made outputs) skip
# where the Python kernels were chosen on purpose; a failed C++ build still fails them.
python_kernels_chosen = pytest.mark.skipif(
    os.environ.get("UNIOP_TORCH_CPP_KERNELS") == "0", reason="UNIOP_TORCH_CPP_KERNELS=0 chose the Python kernels"
)

TOL = {torch.float32: 2e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def _tuple(x):
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def _check(got, want, dtype, what):
    got, want = _tuple(got), _tuple(want)
    assert len(got) >= len(want), what
    for i, (g, w) in enumerate(zip(got, want)):
        assert tuple(g.shape) == tuple(w.shape), f"{what} output {i}: shape {tuple(g.shape)} vs {tuple(w.shape)}"
        if not g.is_floating_point():
            assert torch.equal(g.to(torch.int64), w.to(torch.int64)), f"{what} output {i}"
            continue
        tol = TOL[dtype] * (1 + w.abs().max().item() if w.numel() else 1)
        err = (g.to(torch.float64) - w).abs().max().item() if g.numel() else 0.0
        assert err <= tol, f"{what} output {i}: max error {err:.3g} > {tol:.3g}"


def test_every_registered_op_has_a_case():
    assert sorted(CASES) == uniop.ops()


@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", [n for n in sorted(CASES) if n != "kv_cache_append"])  # in place: below
def test_values_match_torch_reference(name, dtype, strided):
    torch.manual_seed(0)
    args, ref = CASES[name](dtype, strided)
    want = ref(*args)
    _check(getattr(uniop, name)(*args), want, dtype, f"uniop.{name}")
    _check(getattr(torch.ops.uniop, name)(*args), want, dtype, f"torch.ops.uniop.{name}")


# Not here: in-place kv_cache_append, rope_cos_sin (integer input) and cast (f64 kernels; its
# output dtype is an argument).
@pytest.mark.parametrize("name", [n for n in sorted(CASES) if n not in ("kv_cache_append", "rope_cos_sin", "cast")])
def test_float64_matches_torch_reference(name):
    """Float64 calls (strided) run the op's f64 reference: equal to torch's float64 to ~1e-11."""
    torch.manual_seed(0)
    args, ref = CASES[name](torch.float64, True)
    args = [a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
    want = _tuple(ref(*args))
    for route in (getattr(uniop, name), getattr(torch.ops.uniop, name)):
        got = _tuple(route(*args))
        for g, w in zip(got, want):
            if w.is_floating_point():
                assert g.dtype == torch.float64, f"{name}: {g.dtype}"
                torch.testing.assert_close(g, w.to(torch.float64), rtol=1e-9, atol=1e-11)
            else:
                assert torch.equal(g.to(torch.int64), w.to(torch.int64))


def test_kv_cache_append_writes_in_place():
    for dt in (torch.float32, torch.bfloat16):
        (kc, vc, k, v, pos), _ = CASES["kv_cache_append"](dt, True)
        want_k, want_v = kc.clone(), vc.clone()
        for b, p in enumerate(pos.tolist()):
            want_k[b, :, p : p + 3] = k[b]
            want_v[b, :, p : p + 3] = v[b]
        assert torch.ops.uniop.kv_cache_append(kc, vc, k, v, pos) is None
        assert torch.equal(kc, want_k) and torch.equal(vc, want_v)
        with pytest.raises(uniop.UniopError, match="kv_cache_append") as e:
            uniop.kv_cache_append(kc, vc, k, v, torch.tensor([0, 6]))
        assert e.value.code_name == "runtime"
        assert torch.equal(kc, want_k), "a failed append leaves the cache untouched"


def _integer_values_at_the_ends(t):
    """Values for one element of an integer tensor at and past the ends of the range its sample
    holds and of its dtype: the sample's smallest and largest, one beyond each, 0 and -1."""
    info = torch.iinfo(t.dtype)
    lo, hi = int(t.min()), int(t.max())
    return sorted(v for v in {lo, hi, lo - 1, hi + 1, 0, -1, info.min, info.max} if info.min <= v <= info.max)


# Integer inputs that are values, not indices: rope_cos_sin's positions become float32 angles (as
# transformers computes them), whose rounding past 2**24 the float64 reference does not share.
_INTEGER_VALUES_UP_TO = {"rope_cos_sin": 1 << 24}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
# kv_cache_append writes in place; its positions' ends are tested above.
@pytest.mark.parametrize("name", [n for n in sorted(CASES) if n != "kv_cache_append"])
def test_integer_inputs_at_and_past_their_ends_match_the_reference_or_raise(name, dtype):
    """Indices (embedding ids, cross_entropy targets), int8 weights and positions set, one element
    at a time, to the ends of their sample's range and of their dtype and one past: where the torch
    reference computes a result both routes return it, where the reference refuses the value
    (an index out of range) both raise a UniopError — never a read past the table."""
    args, ref = CASES[name](dtype, False)
    limit = _INTEGER_VALUES_UP_TO.get(name)
    integer = [
        i
        for i, a in enumerate(args)
        if isinstance(a, torch.Tensor) and a.numel() and not a.is_floating_point() and a.dtype != torch.bool
    ]
    for i in integer:
        for value in _integer_values_at_the_ends(args[i]):
            if limit is not None and abs(value) > limit:
                continue
            changed = args[i].clone()
            changed.view(-1)[-1] = value
            call = (*args[:i], changed, *args[i + 1 :])
            try:
                want = ref(*call)
            except (IndexError, RuntimeError):
                want = None
            for route, fn in (("uniop", getattr(uniop, name)), ("torch.ops.uniop", getattr(torch.ops.uniop, name))):
                what = f"{route}.{name} with argument {i} = {value}"
                if want is None:
                    with pytest.raises(uniop.UniopError, match=name):
                        fn(*call)
                else:
                    _check(fn(*call), want, dtype, what)


@pytest.mark.parametrize("name", sorted(CASES))
def test_opcheck(name):
    torch.manual_seed(0)
    args, _ = CASES[name](torch.float32, False)
    torch.library.opcheck(getattr(torch.ops.uniop, name).default, args)


def _differentiable_call(name):
    """The float64 case of op `name` as `fn(*inputs)`, with `inputs` requiring a gradient where the
    backward op returns one, and `fn` returning the outputs that backward op takes a gradient of.
    A list argument's items (cat's tensors) are inputs of their own, gathered back by `fn`."""
    torch.manual_seed(0)
    args, _ = CASES[name](torch.float64, False)
    # Cases keep some tables in float32 (rope's cos/sin); here every floating tensor is float64.
    args = [a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
    lengths = [len(a) if isinstance(a, list) and isinstance(a[0], torch.Tensor) else None for a in args]
    op = _listing_call(getattr(torch.ops.uniop, name), lengths)
    args = [x for a, n in zip(args, lengths) for x in (a if n is not None else [a])]
    names = [a["name"] for a, n in zip(uniop.op(name).args, lengths) for _ in range(n or 1)]
    # Differentiate the arguments the backward op returns a gradient for (`d<arg>`); the others
    # (rope's cos/sin tables, cross_entropy's targets) get none by design; nor does a boolean
    # tensor (attention's boolean mask, in place of its differentiable float kind).
    backward = uniop.op(uniop.op(name).backward)
    has_grad = {r[1:] for r in backward.returns if r.startswith("d")}
    diff = [i for i, n in enumerate(names) if n in has_grad]
    assert diff, f"{name}: no argument gets a gradient"
    inputs = [
        a.detach().clone().requires_grad_(i in diff and a.is_floating_point()) if isinstance(a, torch.Tensor) else a
        for i, a in enumerate(args)
    ]
    n_returns = len(uniop.op(name).returns)
    wired = {a["name"][1:] for a in backward.args if a["name"].startswith("d")}
    keep = [i for i, r in enumerate(uniop.op(name).returns) if r in wired]

    def fn(*xs):
        out = _tuple(op(*xs)) if n_returns > 1 else (op(*xs),)
        return tuple(out[i] for i in keep)

    return fn, inputs


def _listing_call(op, lengths):
    """`op` called with the items of its list arguments (`lengths[i]` items for argument i, None
    for a plain one) passed one by one, as gradcheck and torch.func differentiate them."""

    def call(*flat):
        args, k = [], 0
        for n in lengths:
            args.append(flat[k] if n is None else list(flat[k : k + n]))
            k += 1 if n is None else n
        return op(*args)

    return call


WITH_BACKWARD = [n for n in sorted(CASES) if uniop.op(n).backward]


@pytest.mark.parametrize("name", WITH_BACKWARD, ids=lambda n: f"{n}->{uniop.op(n).backward}")
def test_gradcheck(name):
    """Numerical vs analytical Jacobian in float64 with torch's default steps and tolerances.
    uniop runs float64 calls through each op's f64 reference (forward and backward op alike), so
    this checks the backward op's formula against finite differences of the forward's."""
    fn, inputs = _differentiable_call(name)
    assert torch.autograd.gradcheck(fn, inputs)


@pytest.mark.parametrize("name", WITH_BACKWARD)
def test_torch_func_vjp_matches_autograd(name):
    """torch.func's transforms record a call at their own autograd level: ``torch.func.vjp`` of
    every op with a backward gives the gradients eager autograd gives (which gradcheck checks)."""
    fn, inputs = _differentiable_call(name)
    grad_at = [i for i, a in enumerate(inputs) if isinstance(a, torch.Tensor) and a.requires_grad]
    outs = fn(*inputs)
    torch.manual_seed(1)
    cotangents = tuple(torch.randn_like(o) for o in outs)
    want = torch.autograd.grad(outs, [inputs[i] for i in grad_at], cotangents)

    def of_grad_args(*xs):
        full = list(inputs)
        for i, x in zip(grad_at, xs):
            full[i] = x
        return fn(*full)

    _, vjp = torch.func.vjp(of_grad_args, *[inputs[i].detach() for i in grad_at])
    for i, got, w in zip(grad_at, vjp(cotangents), want):
        torch.testing.assert_close(got, w, rtol=1e-12, atol=1e-12, msg=f"{name}: gradient of argument {i}")


@pytest.mark.parametrize("name", WITH_BACKWARD)
def test_forward_mode_ad_is_refused_not_dropped(name):
    """An op with a backward op has no forward-mode rule: a tangent through it (torch.func.jvp, a
    dual tensor of torch.autograd.forward_ad in eager, or forward-over-reverse — torch.func.hessian,
    whose tangent reaches the op below a reverse-mode level) raises, instead of leaving as a zero
    tangent."""
    fn, inputs = _differentiable_call(name)
    i = next(i for i, a in enumerate(inputs) if isinstance(a, torch.Tensor) and a.requires_grad)
    primals = [a.detach() if isinstance(a, torch.Tensor) else a for a in inputs]

    def of_one(x):
        return fn(*primals[:i], x, *primals[i + 1 :])

    with pytest.raises(NotImplementedError, match=f"uniop.{name}: forward-mode AD"):
        torch.func.jvp(of_one, (primals[i],), (torch.ones_like(primals[i]),))
    with torch.autograd.forward_ad.dual_level(), pytest.raises(NotImplementedError, match=f"uniop.{name}: forward"):
        of_one(torch.autograd.forward_ad.make_dual(primals[i], torch.ones_like(primals[i])))

    def first_output_sum(x):
        out = of_one(x)
        return (out if isinstance(out, torch.Tensor) else out[0]).sum()

    with pytest.raises(NotImplementedError, match=f"uniop.{name}: forward-mode AD"):
        torch.func.hessian(first_output_sum)(primals[i])


ELEMENTWISE = [n for n in sorted(CASES) if uniop.op(n).elementwise]
LEADING_BATCH = [n for n in sorted(CASES) if uniop.op(n).leading_batch_args]
BLOCKS = [n for n in sorted(CASES) if uniop.op(n).core_dims]


@contextlib.contextmanager
def _no_vmap_fallback():
    """vmap of an op without a batching rule raises instead of calling the op once per sample."""
    was = torch._C._functorch._is_vmap_fallback_enabled()
    torch._C._functorch._set_vmap_fallback_enabled(False)
    try:
        yield
    finally:
        torch._C._functorch._set_vmap_fallback_enabled(was)


@pytest.mark.parametrize("name", ELEMENTWISE)
def test_elementwise_ops_vmap_in_one_call(name):
    """torch.func.vmap of an elementwise op runs its batching rule — one call on the whole batch,
    torch's per-sample fallback disabled — and gives the per-sample calls' results: with every
    operand batched (along its last dim), and with the first batched and the others shared (a
    gradient summed back to a shared operand is then one per sample)."""
    assert {"add", "mul", "silu", "add_backward", "mul_backward"} <= set(ELEMENTWISE)
    torch.manual_seed(0)
    args, _ = CASES[name](torch.float32, False)
    op = getattr(torch.ops.uniop, name)
    tensors = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
    for batched in (tensors, tensors[:1]):
        _check_vmap_matches_per_sample(op, args, batched)


def _check_vmap_matches_per_sample(op, args, batched):
    """vmap of ``op`` over three samples of the arguments at positions ``batched`` (stacked along
    their last dim; the others shared), torch's per-sample fallback disabled, against the per-sample
    calls' returns stacked."""
    samples = [[_another_sample(a) if i in batched else a for i, a in enumerate(args)] for _ in range(3)]
    stacked = [_stack_last([s[i] for s in samples]) if i in batched else a for i, a in enumerate(args)]
    in_dims = tuple((-1 if not isinstance(a, list) else [-1] * len(a)) if i in batched else None
                    for i, a in enumerate(args))
    with _no_vmap_fallback():
        got = torch.func.vmap(op, in_dims=in_dims)(*stacked)
    per_sample = [_tuple(op(*s)) for s in samples]
    want = [torch.stack(outs) for outs in zip(*per_sample)]
    torch.testing.assert_close(list(_tuple(got)), want, rtol=1e-6, atol=1e-6, msg=f"batched {batched}")


def _stack_last(samples):
    """Samples of a tensor, or of a list of them (item by item), stacked along a new last dim."""
    if isinstance(samples[0], list):
        return [torch.stack(items, dim=-1) for items in zip(*samples)]
    return torch.stack(samples, dim=-1)


def _another_sample(a):
    """A tensor like ``a`` with other values: normal floats, or ``a``'s own integers shuffled (indices
    stay in range); a list's items each."""
    if isinstance(a, list):
        return [_another_sample(t) for t in a]
    if a.is_floating_point():
        return torch.randn_like(a)
    return a.flatten()[torch.randperm(a.numel())].view_as(a)


@pytest.mark.parametrize("name", LEADING_BATCH)
def test_row_ops_vmap_in_one_call(name):
    """torch.func.vmap of an op working row by row (``leading_batch_args``) runs its batching rule,
    torch's per-sample fallback disabled, and gives the per-sample calls' results: with every such
    argument batched along its last dim, and with the first batched and the others shared; and
    with a shared argument (a weight) batched too, which the rule runs sample by sample. A list
    argument (cat's tensors) is batched item by item."""
    assert {"softmax", "rms_norm", "linear", "embedding", "argmax", "swiglu_backward", "attention", "cat",
            "cat_backward", "permute", "permute_backward"} <= set(LEADING_BATCH)
    torch.manual_seed(0)
    args, _ = CASES[name](torch.float32, False)
    op = getattr(torch.ops.uniop, name)
    names, row_args = [a["name"] for a in uniop.op(name).args], uniop.op(name).leading_batch_args
    rows = [i for i, a in enumerate(args) if isinstance(a, (torch.Tensor, list)) and names[i] in row_args]
    shared = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and i not in rows]
    for batched in (rows, rows[:1], rows[:1] + shared[:1]):
        _check_vmap_matches_per_sample(op, args, batched)


@pytest.mark.parametrize("name", BLOCKS)
def test_block_ops_vmap_in_one_call(name):
    """torch.func.vmap of an op mapping blocks over broadcast batch dims (``core_dims``: matmul and rope
    and their backwards, rope_cos_sin) runs its batching rule, torch's per-sample fallback disabled,
    and gives the per-sample calls' results: every broadcast operand batched, only the first (the
    others shared, their gradients one per sample), only the last (of fewer batch dims than the
    first: padded)."""
    assert {"matmul", "matmul_backward", "rope", "rope_backward", "rope_cos_sin"} <= set(BLOCKS)
    torch.manual_seed(0)
    args, _ = CASES[name](torch.float32, False)
    op = getattr(torch.ops.uniop, name)
    names = [a["name"] for a in uniop.op(name).args]
    cores = [i for i, a in enumerate(args) if names[i] in dict(uniop.op(name).core_dims)]
    for batched in (cores, cores[:1], cores[-1:]):
        _check_vmap_matches_per_sample(op, args, batched)


def test_matmul_vmap_broadcasts_batch_dims_and_refuses_what_a_sample_call_does():
    """vmap of matmul lines up each sample's batch dims with the other operand's: a batched ``[M, K]``
    against a shared ``[B, K, N]`` gives ``[B, M, N]`` per sample (not the batch against B), with a
    strided (transposed) operand too; a sample of rank 1, which matmul refuses, raises matmul's own
    error from the per-sample path."""
    torch.manual_seed(0)
    a, b = torch.randn(4, 5, 6), torch.randn(3, 7, 6).transpose(1, 2)  # 4 samples of [5, 6]; b [3, 6, 7]
    with _no_vmap_fallback():
        got = torch.func.vmap(torch.ops.uniop.matmul, in_dims=(0, None))(a, b)
        grads = torch.func.vmap(torch.func.grad(lambda a, b: torch.ops.uniop.matmul(a, b).square().sum(), (0, 1)),
                                in_dims=(0, None))(a, b)
    torch.testing.assert_close(got, torch.stack([s @ b for s in a]), rtol=1e-5, atol=1e-5)
    want = torch.func.vmap(torch.func.grad(lambda a, b: (a @ b).square().sum(), (0, 1)), in_dims=(0, None))(a, b)
    assert grads[1].shape == (4, 3, 6, 7)
    torch.testing.assert_close(grads, want, rtol=1e-4, atol=1e-4)
    with pytest.raises(uniop.UniopError, match=r"matmul: argument 'a'"):
        torch.func.vmap(torch.ops.uniop.matmul, in_dims=(0, None))(torch.randn(4, 6), b)


def test_block_ops_vmap_under_torch_compile_with_dynamic_shapes_compiles_once():
    """torch.compile(fullgraph=True, dynamic=True) traces the broadcast vmap rule (matmul's, and
    rope_cos_sin's over per-sample positions) with symbolic sizes: one sample's call is inferred
    symbolically, so batches of other sizes and samples of other shapes reuse the one graph."""
    import torch._dynamo.testing

    def f(a, b, positions):
        y = torch.func.vmap(torch.ops.uniop.matmul, in_dims=(0, None))(a, b)
        return y, torch.func.vmap(lambda p: torch.ops.uniop.rope_cos_sin(p, 8))(positions)

    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounter()
    compiled = torch.compile(f, backend=counter, fullgraph=True, dynamic=True)
    for n, m in ((4, 5), (6, 7), (9, 11)):
        args = torch.randn(n, m, 6), torch.randn(6, 7), torch.arange(n * m).view(n, m)
        torch.testing.assert_close(compiled(*args), f(*args))
    assert counter.frame_count == 1


@pytest.mark.parametrize("batch", [(), (2, 3), (0, 3), (2, 0)], ids=str)
def test_attention_takes_any_leading_batch_dims_as_sdpa_does(batch):
    """attention reads SDPA's ``[..., H, S, D]``: no batch dim, two (k and v expanded along the
    second, stride 0, read in place), an empty one — outputs and gradients (through autograd,
    summed over the expanded dim) against SDPA's with the kv heads repeated."""
    torch.manual_seed(0)
    q = torch.randn(*batch, 4, 9, 16, requires_grad=True)
    kv = torch.randn(*batch[:1], *([1] if batch else []), 2, 9, 16, requires_grad=True)
    k = v = kv.expand(*batch, 2, 9, 16)
    out, lse = torch.ops.uniop.attention(q, k, v, None, True)
    out.square().sum().backward()  # lse is saved for the backward, not differentiable
    got = (out, lse, q.grad, kv.grad)
    q.grad = kv.grad = None
    repeated = kv.expand(*batch, 2, 9, 16).repeat_interleave(2, -3)
    scores = q @ repeated.transpose(-1, -2) / 4 + torch.ones(9, 9, dtype=torch.bool).tril().logical_not() * -1e30
    want_out = torch.nn.functional.scaled_dot_product_attention(q, repeated, repeated, is_causal=True)
    want_lse = torch.logsumexp(scores, -1)
    want_out.square().sum().backward()
    for g, w in zip(got, (want_out, want_lse, q.grad, kv.grad)):
        assert g.shape == w.shape
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


def test_per_sample_gradients_through_cat_in_one_call():
    """vmap(grad) through cat (a learned prefix, shared, joined in front of each sample's tokens: prefix
    tuning) runs cat and cat_backward once each on the whole batch (torch's fallback disabled; the
    profiler counts their launches), the list's items batched one by one and the prefix's gradient
    one per sample, matching torch.cat vmapped the same way."""
    torch.manual_seed(0)
    x, params = torch.randn(5, 6, 8), [torch.randn(3, 8), torch.randn(4, 8)]

    def loss(join, p, xb):
        return torch.nn.functional.linear(join([p[0], xb], -2), p[1]).square().mean()

    per_sample = lambda join: torch.func.vmap(torch.func.grad(lambda p, xb: loss(join, p, xb)), (None, 0))  # noqa: E731
    with _no_vmap_fallback(), uniop.Profiler() as prof:
        got = per_sample(torch.ops.uniop.cat)(params, x)
    assert collections.Counter(e["step"] for e in prof.events()) == {"cat": 1, "cat_backward": 1}
    want = per_sample(torch.cat)(params, x)
    assert got[0].shape == (5, 3, 8)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_per_sample_gradients_through_attention_in_one_call():
    """vmap(grad) of a causal GQA attention layer (projections by linear, shared) over samples of
    ``[2, 12, 16]`` tokens: attention and its backward take the batch as one more leading dim, one
    call each (torch's fallback disabled; the profiler counts their launches), with a shared boolean
    mask, matching torch's per-sample gradients of the same layer written out. With a learned bias
    and sinks, whose gradients are sums over each sample's rows, the backward keeps them per sample
    (``batch_dims``): one call still, matching too; and vmap nested over each sample's own batch (every
    sequence a sample of its own: ``batch_dims`` 2), one call again."""
    torch.manual_seed(0)
    x = torch.randn(5, 2, 12, 16)  # 5 samples of a [2, 12, 16] batch
    weights = [torch.randn(n, 16) / 4 for n in (32, 16, 16)]  # q: 4 heads of 8, k and v: 2 heads
    keep = attention_mask(12, 12)[0, 0]
    bias, sinks = torch.randn(4, 12, 12) / 2, torch.randn(4)

    def layer(att, p, xb):
        heads = [torch.nn.functional.linear(xb, w).unflatten(-1, (-1, 8)).transpose(-3, -2) for w in p[:3]]
        return att(*heads, *p[3:]).square().mean()

    def uniop_att(q, k, v, *learned):
        mask, sinks = learned if learned else (keep, None)
        return torch.ops.uniop.attention(q, k, v, None, True, None, mask, None, sinks)[0]

    def torch_att(q, k, v, *learned):
        mask, sinks = learned if learned else (keep, None)
        return attention_ref(q, k, v, True, mask, None, sinks)[0].float()

    def per_sample(att):
        return torch.func.vmap(torch.func.grad(lambda p, xb: layer(att, p, xb)), in_dims=(None, 0))

    for params, nested in ((weights, False), (weights + [bias, sinks], False), (weights + [bias, sinks], True)):
        with _no_vmap_fallback(), uniop.Profiler() as prof:
            got = (torch.func.vmap(per_sample(uniop_att), in_dims=(None, 0)) if nested else per_sample(uniop_att))(
                params, x)
        ran = collections.Counter(e["step"] for e in prof.events())  # each call's first launch, once
        assert (ran["attention"], ran["attention_backward.delta"]) == (1, 1)
        grad = torch.func.grad(lambda p, xb: layer(torch_att, p, xb))
        # Per parameter: stacked over the samples (and over each one's sequences, a batch of one each,
        # when nested).
        units = [[grad(params, seq[None]) for seq in xb] if nested else grad(params, xb) for xb in x]
        want = [torch.stack([torch.stack([g[k] for g in u]) if nested else u[k] for u in units])
                for k in range(len(params))]
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


def test_per_sample_positions_through_rope_and_permute_in_one_call():
    """vmap(grad) of a rotary layer whose positions differ per sample (as in a left-padded batch):
    rope_cos_sin builds every sample's tables, a head-layout permute (``batch_dims``) and rope with
    those per-sample tables run forward and backward in one call each (torch's fallback disabled;
    the profiler counts the launches), matching torch's own rotation vmapped the same way. A sample
    whose tables have more dims than its x raises rope's own error, as the sample's call does,
    though the batched call's padding would let it through."""
    torch.manual_seed(0)
    x = torch.randn(5, 6, 4, 8)  # 5 samples of [S=6, H=4, D=8]
    positions = torch.stack([torch.arange(6) + start for start in range(5)])
    w = torch.randn(32, 32) / 6

    def uniop_layer(w, xb, pos):
        cos, sin = torch.ops.uniop.rope_cos_sin(pos, 8)
        heads = torch.ops.uniop.permute(torch.nn.functional.linear(xb.flatten(-2), w).unflatten(-1, (4, 8)), [1, 0, 2])
        return torch.ops.uniop.rope(heads, cos, sin).square().mean()

    def torch_layer(w, xb, pos):
        cos, sin = cos_sin_ref(pos, 8)
        heads = torch.nn.functional.linear(xb.flatten(-2), w).unflatten(-1, (4, 8)).permute(1, 0, 2)
        return rope_half_ref(heads, cos.float(), sin.float()).square().mean()

    per_sample = lambda layer: torch.func.vmap(torch.func.grad(layer), in_dims=(None, 0, 0))  # noqa: E731
    with _no_vmap_fallback(), uniop.Profiler() as prof:
        got = per_sample(uniop_layer)(w, x, positions)
    ran = collections.Counter(e["op"] for e in prof.events())
    assert {op: ran[op] for op in ("rope_cos_sin", "permute", "rope", "rope_backward", "permute_backward")} == {
        "rope_cos_sin": 1, "permute": 1, "rope": 1, "rope_backward": 1, "permute_backward": 1}, ran
    torch.testing.assert_close(got, per_sample(torch_layer)(w, x, positions), rtol=1e-4, atol=1e-6)

    x, tables = torch.randn(3, 6, 8), torch.randn(3, 1, 6, 8)
    with pytest.raises(uniop.UniopError, match=r"rope: argument 'cos'") as one:
        torch.ops.uniop.rope(x[0], tables[0], tables[0])
    with _no_vmap_fallback(), pytest.raises(uniop.UniopError, match=r"rope: argument 'cos'") as batched:
        torch.func.vmap(torch.ops.uniop.rope)(x, tables, tables)
    assert str(batched.value) == str(one.value)


def test_per_sample_gradients_through_matmul_attention_in_one_call():
    """vmap(grad) of attention written with matmul (``softmax(q kᵀ) v`` per head, the projections
    shared, by linear) batches matmul, its backward, the softmax pair and linear's backward (dx not
    asked for: the data needs no gradient) in one call each (torch's fallback disabled), matching
    torch's own ops vmapped the same way."""
    torch.manual_seed(0)
    x = torch.randn(6, 8, 16)  # 6 samples of 8 tokens
    params = [torch.randn(16, 16) / 4 for _ in range(3)]

    def loss(mm, softmax, linear, p, xb):
        q, k, v = (linear(xb, w) for w in p)
        heads = [t.unflatten(-1, (2, 8)).transpose(0, 1) for t in (q, k, v)]  # [2, 8, 8]
        out = mm(softmax(mm(heads[0], heads[1].transpose(-1, -2))), heads[2])
        return out.square().mean()

    ops, F = torch.ops.uniop, torch.nn.functional
    uniop_loss = lambda p, xb: loss(ops.matmul, lambda s: ops.softmax(s, -1), ops.linear, p, xb)  # noqa: E731
    torch_loss = lambda p, xb: loss(torch.matmul, lambda s: torch.softmax(s, -1), F.linear, p, xb)  # noqa: E731
    with _no_vmap_fallback():
        got = torch.func.vmap(torch.func.grad(uniop_loss), in_dims=(None, 0))(params, x)
    want = torch.func.vmap(torch.func.grad(torch_loss), in_dims=(None, 0))(params, x)
    for g, w in zip(got, want):
        assert g.shape == (6, 16, 16)
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


def test_matmul_backward_leaves_out_what_is_not_asked_for():
    """``needs_da`` / ``needs_db`` False return that gradient empty and the other unchanged, directly
    and under vmap; autograd asks only for the operands that require a gradient (a frozen ``b``)."""
    torch.manual_seed(0)
    dout, a, b = torch.randn(2, 3, 5), torch.randn(2, 3, 4), torch.randn(4, 5)
    op = torch.ops.uniop.matmul_backward
    full = op(dout, a, b)
    for k, flag in enumerate(("needs_da", "needs_db")):
        lean = op(dout, a, b, **{flag: False})
        assert lean[k].shape == (0,) and torch.equal(lean[1 - k], full[1 - k])
    with _no_vmap_fallback():
        batched = torch.func.vmap(lambda d, x: op(d, x, b, needs_db=False))(dout, a)
    assert batched[1].shape == (2, 0)
    torch.testing.assert_close(batched[0], full[0])
    for needs in ((False, True), (True, False), (True, True)):
        got = [t.clone().requires_grad_(n) for t, n in zip((a, b), needs)]
        torch.ops.uniop.matmul(*got).mul(dout).sum().backward()
        assert (got[0].grad is not None, got[1].grad is not None) == needs
        if needs[0]:
            torch.testing.assert_close(got[0].grad, dout @ b.T)
        if needs[1]:
            torch.testing.assert_close(got[1].grad, torch.einsum("bik,bin->kn", a, dout))


@pytest.mark.parametrize("name", ["linear_backward", "linear_add_backward"])
def test_linear_backwards_leave_out_what_is_not_asked_for(name):
    """``needs_dx=False`` / ``needs_dweight=False`` return that gradient empty and the others
    unchanged, directly and under vmap (the rule returns the placeholder unbatched); autograd asks
    only for the gradients of what requires one (data x, a frozen weight), and its gradients match
    torch's every way."""
    torch.manual_seed(0)
    dy, x, w = torch.randn(3, 4, 5), torch.randn(3, 4, 6), torch.randn(5, 6)
    op = getattr(torch.ops.uniop, name)
    full = op(dy, x, w)
    for k, flag in ((0, "needs_dx"), (1, "needs_dweight")):
        lean = op(dy, x, w, **{flag: False})
        assert lean[k].shape == (0,) and full[k].shape != (0,)
        for j in {0, 1, 2} - {k}:
            assert torch.equal(full[j], lean[j]), (flag, j)
        with _no_vmap_fallback():
            batched = torch.func.vmap(lambda d, a: op(d, a, w, **{flag: False}))(dy, x)
        assert batched[k].shape == (3, 0)  # the placeholder, unbatched, which vmap expands over the batch
        for j, per_sample in enumerate(zip(*(op(d, a, w) for d, a in zip(dy, x)))):
            if j != k:
                torch.testing.assert_close(batched[j], torch.stack(per_sample))
    forward = {"linear_backward": torch.ops.uniop.linear, "linear_add_backward": torch.ops.uniop.linear_add}[name]
    extra = [] if name == "linear_backward" else [torch.randn(3, 4, 5)]
    for x_needs, w_needs in ((False, True), (True, False), (True, True)):
        xs, ws = x.clone().requires_grad_(x_needs), w.clone().requires_grad_(w_needs)
        forward(xs, ws, *extra).mul(dy).sum().backward()
        assert (xs.grad is not None, ws.grad is not None) == (x_needs, w_needs)
        if w_needs:
            torch.testing.assert_close(ws.grad, torch.einsum("bio,bij->oj", dy, x), rtol=1e-5, atol=1e-5)
        if x_needs:
            torch.testing.assert_close(xs.grad, dy @ w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["linear_silu_mul_backward", "linear_gelu_mul_backward"])
def test_gated_linear_backwards_leave_out_what_is_not_asked_for(name):
    """The gated MLP's backward leaves out each gradient not asked for (frozen gate/up weights:
    LoRA's base MLP; data x) — returned empty, the others unchanged, directly and under vmap — and
    autograd asks only for what requires a gradient, matching torch's autograd of the composite."""
    torch.manual_seed(0)
    dy, x, wg, wu = torch.randn(3, 4, 5), torch.randn(3, 4, 6), torch.randn(5, 6), torch.randn(5, 6)
    op = getattr(torch.ops.uniop, name)
    full = op(dy, x, wg, wu)
    for k, flag in enumerate(("needs_dx", "needs_dgate_weight", "needs_dup_weight")):
        lean = op(dy, x, wg, wu, **{flag: False})
        assert lean[k].shape == (0,) and full[k].shape != (0,)
        for j in {0, 1, 2} - {k}:
            assert torch.equal(full[j], lean[j]), (flag, j)
        with _no_vmap_fallback():
            batched = torch.func.vmap(lambda d, a: op(d, a, wg, wu, **{flag: False}))(dy, x)
        assert batched[k].shape == (3, 0)
        for j, per_sample in enumerate(zip(*(op(d, a, wg, wu) for d, a in zip(dy, x)))):
            if j != k:
                torch.testing.assert_close(batched[j], torch.stack(per_sample))
    gated = "silu" if name == "linear_silu_mul_backward" else "gelu"
    forward, act = getattr(torch.ops.uniop, f"linear_{gated}_mul"), getattr(torch.nn.functional, gated)
    for needs in [n for n in itertools.product((False, True), repeat=3) if any(n)]:
        got, want = ([t.clone().requires_grad_(n) for t, n in zip((x, wg, wu), needs)] for _ in range(2))
        forward(*got).mul(dy).sum().backward()
        (act(want[0] @ want[1].T) * (want[0] @ want[2].T)).mul(dy).sum().backward()
        for g, w, n in zip(got, want, needs):
            assert (g.grad is not None) == n, needs
            if n:
                torch.testing.assert_close(g.grad, w.grad, rtol=1e-4, atol=1e-4)


def test_row_ops_vmap_an_empty_batch():
    """An empty vmap batch gives empty returns of the per-sample shapes, in one call and where a
    shared argument carries the batch (no sample to call: the rule calls the op once on zeros)."""
    x, w = torch.randn(4, 0, 8), torch.randn(0, 8)
    indices, table = torch.zeros(3, 0, dtype=torch.long), torch.randn(0, 5, 4)
    with _no_vmap_fallback():
        y, rstd = torch.func.vmap(torch.ops.uniop.rms_norm, in_dims=(1, None))(x, torch.ones(8))
        assert (y.shape, rstd.shape) == ((0, 4, 8), (0, 4, 1))
        y, rstd = torch.func.vmap(torch.ops.uniop.rms_norm, in_dims=(1, 0))(x, w)
        assert (y.shape, rstd.shape) == ((0, 4, 8), (0, 4, 1))
        rows = torch.func.vmap(lambda i, t: torch.ops.uniop.embedding(t, i), in_dims=(1, 0))(indices, table)
        assert rows.shape == (0, 3, 4)


def test_broadcast_ops_vmap_an_empty_batch():
    """The broadcast rule (elementwise and block ops) has no sample to infer in an empty batch: the
    returns come out empty, of the per-sample shapes (a shared operand's broadcast ones included)."""
    with _no_vmap_fallback():
        y = torch.func.vmap(torch.ops.uniop.matmul, in_dims=(0, None))(torch.randn(0, 5, 6), torch.randn(3, 6, 7))
        total = torch.func.vmap(torch.ops.uniop.add, in_dims=(1, None))(torch.randn(4, 0), torch.randn(2, 4))
        cos, sin = torch.func.vmap(lambda p: torch.ops.uniop.rope_cos_sin(p, 8))(torch.zeros(0, 3, dtype=torch.long))
    assert (y.shape, total.shape, cos.shape, sin.shape) == ((0, 3, 5, 7), (0, 2, 4), (0, 3, 8), (0, 3, 8))


def test_row_ops_vmap_counts_a_non_negative_dim_past_the_batch_and_takes_keywords():
    """A non-negative ``dim`` names the per-sample tensor's axis: the rule shifts it past the batch
    dim (softmax over dim 0 of each sample, argmax over dim 1 keeping it, swiglu halving dim 0,
    softmax_backward over dim 1 given by keyword, with its shared ``y`` by keyword too)."""
    torch.manual_seed(0)
    x = torch.randn(4, 6, 5)  # 5 samples along the last dim, each [4, 6]
    with _no_vmap_fallback():
        softmax = torch.func.vmap(lambda s: torch.ops.uniop.softmax(s, 0), in_dims=-1)(x)
        argmax = torch.func.vmap(lambda s: torch.ops.uniop.argmax(s, dim=1, keepdim=True), in_dims=-1)(x)
        swiglu = torch.func.vmap(lambda s: torch.ops.uniop.swiglu(s, 0), in_dims=-1)(x)
    samples = x.movedim(-1, 0)
    torch.testing.assert_close(softmax, torch.softmax(samples, 1), rtol=1e-6, atol=1e-6)
    # A shared row argument passed by keyword is expanded to the batch as a positional one is.
    dy = torch.randn(5, 4, 6)
    with _no_vmap_fallback():
        grads = torch.func.vmap(lambda d: torch.ops.uniop.softmax_backward(d, y=softmax[0], dim=1))(dy)
    torch.testing.assert_close(grads, torch.stack([torch.ops.uniop.softmax_backward(d, softmax[0], 1) for d in dy]))
    assert torch.equal(argmax, samples.argmax(2, keepdim=True))
    gate, up = samples.chunk(2, dim=1)
    torch.testing.assert_close(swiglu, torch.nn.functional.silu(gate) * up, rtol=1e-6, atol=1e-6)


def test_per_sample_gradients_of_elementwise_ops_in_one_call():
    """vmap(grad) — per-sample gradients of shared parameters through add, mul, silu and cast —
    batches the forward and the backward ops alike (no per-sample fallback) and matches each
    sample's own gradient."""
    torch.manual_seed(0)
    w, bias = torch.randn(16), torch.randn(5, 16)
    xs = torch.randn(4, 5, 16)

    def loss(w, bias, x):
        h = torch.ops.uniop.silu(torch.ops.uniop.mul(x, w))
        out = torch.ops.uniop.add(h, bias, alpha=-0.5)
        return torch.ops.uniop.cast(out, torch.float64).square().sum()

    with _no_vmap_fallback():
        got = torch.func.vmap(torch.func.grad(loss, argnums=(0, 1)), in_dims=(None, None, 0))(w, bias, xs)
    for i, x in enumerate(xs):
        want = torch.func.grad(loss, argnums=(0, 1))(w, bias, x)
        torch.testing.assert_close((got[0][i], got[1][i]), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_elementwise_ops_train_like_torch(dtype):
    """add (keyword alpha), mul, silu and cast in one graph with broadcast operands — a per-channel
    weight, a per-row scale, a bias — run on uniop's kernels (not the float64 reference) give
    torch's gradients for every input."""
    torch.manual_seed(0)
    x, w = torch.randn(3, 5, 16, dtype=dtype), torch.randn(16, dtype=dtype)
    scale, bias = torch.randn(3, 5, 1, dtype=dtype), torch.randn(5, 16, dtype=dtype)

    def model(ops, x, w, scale, bias):
        h = ops["mul"](ops["silu"](ops["mul"](x, w)), scale)
        return ops["cast"](ops["add"](h, bias, alpha=-0.5), torch.float32)

    uniop_ops = {
        "mul": torch.ops.uniop.mul,
        "silu": torch.ops.uniop.silu,
        "add": torch.ops.uniop.add,
        "cast": torch.ops.uniop.cast,
    }
    torch_ops = {"mul": torch.mul, "silu": torch.nn.functional.silu, "add": torch.add, "cast": torch.Tensor.to}
    inputs = (x, w, scale, bias)
    cotangent = torch.randn(3, 5, 16)
    grads = {}
    for kind, ops in (("uniop", uniop_ops), ("torch", torch_ops)):
        leaves = [t.detach().clone().requires_grad_() for t in inputs]
        model(ops, *leaves).backward(cotangent)
        grads[kind] = [t.grad for t in leaves]
    for name, got, want in zip(("x", "w", "scale", "bias"), grads["uniop"], grads["torch"]):
        assert got.dtype == dtype and got.shape == want.shape, name
        torch.testing.assert_close(got.float(), want.float(), rtol=TOL[dtype], atol=TOL[dtype], msg=name)


def test_torch_func_per_sample_gradients_match_torch():
    """vmap of grad — per-sample gradients — through uniop ops, against the same model on torch
    ops; and jacrev of softmax against torch's."""
    torch.manual_seed(0)
    f64 = torch.float64
    x, w, proj = torch.randn(6, 4, 16, dtype=f64), torch.rand(16, dtype=f64) + 0.5, torch.randn(8, 16, dtype=f64)

    def loss(ops, params, xb):
        norm_w, proj_w = params
        h = ops["norm"](xb, norm_w)
        return ops["softmax"](ops["linear"](h, proj_w)).pow(2).sum()

    uniop_ops = {
        "norm": lambda a, b: torch.ops.uniop.rms_norm(a, b)[0],
        "linear": torch.ops.uniop.linear,
        "softmax": lambda a: torch.ops.uniop.softmax(a, -1),
    }
    torch_ops = {
        "norm": lambda a, b: torch.nn.functional.rms_norm(a, (16,), b, 1e-6),
        "linear": torch.nn.functional.linear,
        "softmax": lambda a: torch.softmax(a, -1),
    }
    per_sample = {
        kind: torch.vmap(torch.func.grad(lambda p, xb, ops=ops: loss(ops, p, xb)), in_dims=(None, 0))((w, proj), x)
        for kind, ops in (("uniop", uniop_ops), ("torch", torch_ops))
    }
    for got, want in zip(per_sample["uniop"], per_sample["torch"]):
        assert got.shape == (6, *want.shape[1:])
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    row = x[0, 0]
    jacobians = [torch.func.jacrev(ops["softmax"])(row) for ops in (uniop_ops, torch_ops)]
    torch.testing.assert_close(*jacobians, rtol=1e-10, atol=1e-12)


def _per_sample_cases(dtype):
    """Arguments of the ops with ``batch_dims``, rows ``[2, 3, 5]``: x (logits, indices) with its two
    leading dims transposed (strided), float32 statistics, a target ignored in one sample."""
    rows, h, n = (2, 3, 5), 40, 24

    def t(*shape, dt=dtype):
        return torch.randn(*shape, dtype=dt)

    x = t(3, 2, 5, h).transpose(0, 1)
    stat = torch.rand(*rows, 1) + 0.5
    target = torch.randint(0, h, rows)
    target[1, 2, :2] = -100
    lse = torch.ops.uniop.cross_entropy(x, target)[1]
    return {
        "cross_entropy": (x, target),
        "cross_entropy_backward": (torch.rand(2, 3), x, target, lse),
        "rms_norm_backward": (t(*rows, h), x, t(h), stat),
        "add_rms_norm_backward": (t(*rows, h), t(*rows, h), x, t(h), stat),
        "layer_norm_backward": (t(*rows, h), x, t(h), t(*rows, 1, dt=torch.float32), stat),
        "linear_backward": (t(*rows, n), x, t(n, h)),
        "linear_add_backward": (t(*rows, n), x, t(n, h)),
        "embedding_backward": (t(*rows, h), torch.randint(0, n, (3, 2, 5)).transpose(0, 1), t(n, h)),
        # One with the forward's products saved, one recomputing them.
        "linear_silu_mul_backward": (t(*rows, n), x, t(n, h), t(n, h), t(*rows, n), t(*rows, n)),
        "linear_gelu_mul_backward": (t(*rows, n), x, t(n, h), t(n, h), None, None, "tanh"),
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_batch_dims_gives_each_sample_its_own_sums(dtype):
    """With ``batch_dims=2`` the ops summing over rows (the backwards' parameter gradients,
    cross_entropy's mean and its gradient) give one sum per sample of the first two dims, each what
    the op gives on that sample's rows alone (the row-wise returns unchanged); ``batch_dims`` past
    x's row dims is refused with the op, the argument and the range."""
    torch.manual_seed(0)
    for name, args in _per_sample_cases(dtype).items():
        op = getattr(torch.ops.uniop, name)
        names, row_args = [a["name"] for a in uniop.op(name).args], uniop.op(name).leading_batch_args
        got = _tuple(op(*args, batch_dims=2))
        for i, j in np.ndindex(2, 3):
            sample = [a[i, j] if names[k] in row_args and a is not None else a for k, a in enumerate(args)]
            for k, want in enumerate(_tuple(op(*sample))):
                assert got[k][i, j].shape == want.shape, (name, k)
                torch.testing.assert_close(got[k][i, j], want, rtol=TOL[dtype], atol=TOL[dtype], msg=name)
        with pytest.raises(uniop.UniopError, match=rf"{name}: argument 'batch_dims': expected 0 to 3 \(the dims of "):
            op(*args, batch_dims=4)


def test_per_sample_gradients_of_norms_and_linears_in_one_call():
    """vmap(grad) through layer_norm, linear (with a bias), add_rms_norm, linear_silu_mul, linear_add
    and cross_entropy: their backwards keep each sample's parameter gradients apart (``batch_dims``)
    and cross_entropy takes each sample's mean, so no op runs per sample (torch's fallback
    disabled); the gradients match torch's own ops vmapped the same way, with the batch in front
    and along dim 1."""
    torch.manual_seed(0)
    x = torch.randn(5, 3, 24)
    params = [torch.rand(24) + 0.5, torch.randn(24), torch.randn(32, 24), torch.randn(32), torch.rand(32) + 0.5,
              torch.randn(32, 48) / 4, torch.randn(48, 32) / 4, torch.randn(48, 32) / 4]
    uniop_ops = {
        "layer_norm": lambda a, w, b: torch.ops.uniop.layer_norm(a, w, b)[0],
        "linear": torch.ops.uniop.linear,
        "add_rms_norm": lambda a, r, w: torch.ops.uniop.add_rms_norm(a, r, w)[::2],
        "linear_silu_mul": torch.ops.uniop.linear_silu_mul,
        "linear_add": torch.ops.uniop.linear_add,
        "cross_entropy": lambda a, t: torch.ops.uniop.cross_entropy(a, t)[0],
    }
    torch_ops = {
        "layer_norm": lambda a, w, b: torch.nn.functional.layer_norm(a, (24,), w, b, 1e-5),
        "linear": torch.nn.functional.linear,
        "add_rms_norm": lambda a, r, w: (torch.nn.functional.rms_norm(a + r, (32,), w, 1e-6), a + r),
        "linear_silu_mul": lambda a, g, u: torch.nn.functional.silu(a @ g.T) * (a @ u.T),
        "linear_add": lambda a, w, r: torch.nn.functional.linear(a, w) + r,
        "cross_entropy": torch.nn.functional.cross_entropy,
    }
    targets = torch.randint(0, 32, (5, 3))
    targets[2, 1] = -100  # ignored: that sample's mean is over its other two rows

    def loss(ops, p, xb, tb):
        h = ops["linear"](ops["layer_norm"](xb, p[0], p[1]), p[2], p[3])
        y, residual = ops["add_rms_norm"](h, h.sin(), p[4])
        mlp = ops["linear_silu_mul"](y, p[6], p[7])
        return ops["cross_entropy"](ops["linear_add"](mlp, p[5], residual), tb)

    for in_dim, batch, tbatch in ((0, x, targets), (1, x.transpose(0, 1), targets.t())):
        grads = {}
        for kind, ops in (("uniop", uniop_ops), ("torch", torch_ops)):
            per_sample = torch.func.vmap(
                torch.func.grad(lambda p, xb, tb, ops=ops: loss(ops, p, xb, tb)), in_dims=(None, in_dim, in_dim)
            )
            with _no_vmap_fallback() if kind == "uniop" else contextlib.nullcontext():
                grads[kind] = per_sample(params, batch, tbatch)
        for got, want in zip(grads["uniop"], grads["torch"]):
            assert got.shape == want.shape and want.shape[0] == 5
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3)


WITHOUT_BACKWARD = [
    n for n in sorted(CASES) if not uniop.op(n).backward and not any(a["mutated"] for a in uniop.op(n).args)
]


@pytest.mark.parametrize("name", WITHOUT_BACKWARD)
def test_differentiating_an_op_without_a_backward_is_an_error(name):
    """An op without a backward op (the backward ops included: no double backward) raises when a
    gradient is asked through it — eagerly and under torch.func — instead of torch's default of a
    warning and a missing or zero gradient. Calls that record nothing are unaffected."""
    torch.manual_seed(0)
    args, _ = CASES[name](torch.float32, False)
    op = getattr(torch.ops.uniop, name)
    # The floating tensors, at the top level or in a Tensor[] argument (cat's), as (argument, item).
    floating = [
        (i, j)
        for i, a in enumerate(args)
        for j, t in enumerate(a if isinstance(a, list) else [a])
        if isinstance(t, torch.Tensor) and t.is_floating_point()
    ]

    def call_with(replace):
        full = [list(a) if isinstance(a, list) else a for a in args]
        for (i, j), t in replace.items():
            if isinstance(full[i], list):
                full[i][j] = t
            else:
                full[i] = t
        return [o for o in _tuple(op(*full)) if o.is_floating_point()]

    def at(i, j):
        return args[i][j] if isinstance(args[i], list) else args[i]

    leaves = {ij: at(*ij).detach().clone().requires_grad_() for ij in floating}
    outs = call_with(leaves)
    if not (floating and outs):
        pytest.skip(f"{name}'s case has no floating tensor to differentiate or none to differentiate through")
    torch.testing.assert_close([o.detach() for o in outs], call_with({}))
    message = f"derivative for uniop::{name} is not implemented"
    with pytest.raises(RuntimeError, match=message):
        torch.autograd.grad(sum(o.sum() for o in outs), list(leaves.values()))
    with pytest.raises(RuntimeError, match=message):
        torch.func.grad(lambda x: call_with({floating[0]: x})[0].sum())(at(*floating[0]))


def test_cat_gradients_flow_eagerly_and_under_torch_compile():
    """cat's gradient, cat_backward's list return, reaches each joined tensor (a strided one and one
    that needs none included), eagerly and through torch.compile(fullgraph=True, dynamic=True), equal
    to torch.cat's."""
    torch.manual_seed(0)
    weight = torch.randn(2, 9, 4)

    def loss(cat, a, b, c):
        return (cat([a * 2, b, c], -2) * weight).sum()

    def grads(cat):
        torch.manual_seed(1)  # the same values for every route
        a, b = torch.randn(2, 5, 4).requires_grad_(), torch.randn(2, 4, 3).requires_grad_()
        c = torch.randn(2, 1, 4)  # needs no gradient
        loss(cat, a, b.transpose(1, 2), c).backward()
        return a.grad, b.grad

    want = grads(torch.cat)
    eager = grads(torch.ops.uniop.cat)
    # dynamic=True: every size a symbol, which the list return's fake kernel must follow too.
    compiled = grads(torch.compile(lambda ts, dim: torch.ops.uniop.cat(ts, dim), fullgraph=True, dynamic=True))
    for got in (eager, compiled):
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_non_differentiable_returns_are_marked():
    x = torch.randn(3, 8, requires_grad=True)
    y, rstd = torch.ops.uniop.rms_norm(x, torch.ones(8))
    assert y.requires_grad and not rstd.requires_grad


def test_graph_nodes_keep_autograds_contracts():
    """The node a differentiable call records (C++ or Python) behaves as torch's own: a second
    backward through freed buffers raises and one through a retained graph adds up; an in-place
    change to a saved input is caught; saved-tensor hooks see what it saves; a second-order gradient
    through the backward op (which has none) raises instead of coming back wrong; activation
    checkpointing gives the gradients of the plain graph."""
    x = torch.randn(3, 8, requires_grad=True)
    y = torch.ops.uniop.silu(x)
    y.sum().backward(retain_graph=True)
    once = x.grad.clone()
    y.sum().backward()
    torch.testing.assert_close(x.grad, 2 * once)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        y.sum().backward()

    leaf = torch.randn(3, 8, requires_grad=True)
    x = leaf * 1
    y = torch.ops.uniop.silu(x)
    x.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()

    packed = []

    def pack(t):
        packed.append(t.shape)
        return t.clone()

    x, w = torch.randn(3, 8, requires_grad=True), torch.rand(8, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y, _ = torch.ops.uniop.rms_norm(x, w, 1e-6)
    assert sorted(packed) == sorted([(3, 8), (8,), (3, 1)]), packed  # x, weight, rstd
    y.sum().backward()
    xr, wr = x.detach().requires_grad_(), w.detach().requires_grad_()
    torch.nn.functional.rms_norm(xr, (8,), wr, 1e-6).sum().backward()
    torch.testing.assert_close((x.grad, w.grad), (xr.grad, wr.grad), rtol=1e-5, atol=1e-5)

    x = torch.randn(3, 8, requires_grad=True)
    (dx,) = torch.autograd.grad(torch.ops.uniop.silu(x).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="derivative for uniop::silu_backward is not implemented"):
        dx.sum().backward()

    def block(x, w):
        return torch.ops.uniop.silu(torch.ops.uniop.rms_norm(x, w)[0])

    x, w = torch.randn(4, 8, requires_grad=True), torch.rand(8, requires_grad=True)
    want = torch.autograd.grad(block(x, w).pow(2).sum(), (x, w))
    for reentrant in (False, True):  # activation checkpointing: saved-tensor hooks, or a rerun forward
        x.grad = w.grad = None
        torch.utils.checkpoint.checkpoint(block, x, w, use_reentrant=reentrant).pow(2).sum().backward()
        torch.testing.assert_close((x.grad, w.grad), want, rtol=0, atol=0)


@pytest.mark.parametrize("used", ["y", "sum"])
def test_a_return_left_unused_gets_a_zero_gradient(used):
    """add_rms_norm has two differentiable returns; a loss using one of them gives the backward op
    zeros for the other, and the gradients equal torch's composite's."""

    def grads(fn):
        torch.manual_seed(0)
        x, r, w = torch.randn(4, 8), torch.randn(4, 8), torch.rand(8) + 0.5
        leaves = [t.requires_grad_() for t in (x, r, w)]
        y, total = fn(*leaves)
        (y if used == "y" else total).pow(2).sum().backward()
        return [t.grad if t.grad is not None else torch.zeros_like(t) for t in leaves]

    def composite(x, r, w):
        total = x + r
        return torch.nn.functional.rms_norm(total, (8,), w, 1e-6), total

    def uniop_op(x, r, w):
        y, _, total = torch.ops.uniop.add_rms_norm(x, r, w)
        return y, total

    torch.testing.assert_close(grads(uniop_op), grads(composite), rtol=1e-5, atol=1e-5)


@python_kernels_chosen
def test_differentiable_calls_record_a_cpp_node_that_compiled_autograd_takes():
    """On plain CPU tensors the graph node is the C++ one (no Python per call or per backward) — also
    after a torch.func transform has run in the thread (inside one, the Python node records at the
    transform's level) — and compiled autograd, which traces the recorded graph, runs it to the same
    gradients."""
    from torch._dynamo import compiled_autograd

    x, w = torch.randn(4, 8, requires_grad=True), torch.rand(8, requires_grad=True)
    torch.func.grad(lambda x: torch.ops.uniop.silu(x).sum())(x.detach())
    y, rstd = torch.ops.uniop.rms_norm(x, w)
    assert type(y.grad_fn).__name__ == "CppFunction" and rstd.grad_fn is None

    def run():
        x.grad = w.grad = None
        y, _ = torch.ops.uniop.rms_norm(x, w)
        (torch.ops.uniop.silu(y) * torch.arange(8.0)).sum().backward()
        return x.grad, w.grad

    want = run()
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters["compiled_autograd"]
    captures = counters["captures"]
    with compiled_autograd._enable(torch.compile(backend="eager")):
        got = run()
    assert counters["captures"] == captures + 1, "compiled autograd did not capture the backward"
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_autograd_kernel_routes_calls_by_grad_mode_and_dispatch_keys():
    """The autograd kernel calls the uniop kernel directly only for plain CPU tensors needing no
    gradient; grad mode, inference mode and fake tensors each still get the right behaviour."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    x, w = torch.randn(3, 8, requires_grad=True), torch.rand(8) + 0.5
    want = torch.nn.functional.rms_norm(x.detach(), (8,), w, 1e-6)
    with torch.no_grad():
        y, _ = torch.ops.uniop.rms_norm(x, w)
    assert not y.requires_grad and y.grad_fn is None
    torch.testing.assert_close(y, want)
    with torch.inference_mode():
        y, _ = torch.ops.uniop.rms_norm(x, w)
    assert y.is_inference()
    torch.testing.assert_close(y, want)
    y, _ = torch.ops.uniop.rms_norm(x.detach(), w)
    assert y.grad_fn is None
    y, _ = torch.ops.uniop.rms_norm(x, w)
    assert y.grad_fn is not None, "a tensor needing a gradient takes the autograd route"
    plain = x.detach()
    with FakeTensorMode() as mode:
        fake, _ = torch.ops.uniop.rms_norm(mode.from_tensor(plain), mode.from_tensor(w))
    assert type(fake).__name__ == "FakeTensor" and fake.shape == (3, 8)


def test_every_op_dispatches_to_the_cpp_kernels():
    """scripts/python-env.sh builds the C++ kernels for the installed torch; without them every
    torch.ops.uniop call pays 2-4 µs more in Python. Each op's CPU kernel, and the Autograd kernel
    of each op with a backward, must be the C++ one."""
    assert uniop.torch.cpp_kernels_loaded(), "run: python -m uniop.torch.build_kernels"
    for name, native in uniop.torch._registered.items():
        table = dict(
            line.split(": ", 1) for line in torch._C._dispatch_dump(f"uniop::{name}").splitlines() if ": " in line
        )
        assert "csrc/kernels.cpp" in table["CPU"], f"{name}: CPU kernel {table['CPU']}"
        if native.backward:
            assert "csrc/kernels.cpp" in table["Autograd[alias]"], f"{name}: {table['Autograd[alias]']}"


@python_kernels_chosen
def test_cpp_kernel_reports_bad_attributes_as_uniop_errors():
    """Values the C++ kernel passes on but the core refuses come back as UniopError: a dtype DLPack
    cannot name (by torch's name for it), a gelu approximation that does not exist."""
    x = torch.randn(2, 3)
    with pytest.raises(uniop.UniopError, match="cast: argument 'dtype'.*ComplexFloat") as e:
        torch.ops.uniop.cast(x, torch.complex64)
    assert e.value.code_name == "dtype"
    with pytest.raises(uniop.UniopError, match="gelu: .*approximate"):
        torch.ops.uniop.gelu(x, approximate="fast")


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device_type", ctypes.c_int32),
        ("device_id", ctypes.c_int32),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class _BoxedValue(ctypes.Structure):
    """crates/uniop-python/src/torch_abi.rs's BoxedValue (64 bytes)."""

    _fields_ = [
        ("kind", ctypes.c_uint32),
        ("len", ctypes.c_uint64),
        ("tensors", ctypes.POINTER(_DLTensor)),
        ("ints", ctypes.c_void_p),
        ("text", ctypes.c_void_p),
        ("int_value", ctypes.c_int64),
        ("float_value", ctypes.c_double),
        ("dtype", _DLDataType),
    ]


_MAKE = ctypes.CFUNCTYPE(
    ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint64, ctypes.POINTER(ctypes.c_int64), ctypes.c_uint64, _DLDataType
)


class _OutputMaker(ctypes.Structure):
    _fields_ = [("make", _MAKE), ("state", ctypes.c_void_p)]


def _torch_abi_call():
    """The ABI's `call`, through ctypes.PYFUNCTYPE (which raises the Python error the ABI sets)."""
    capsule = uniop._native._torch_abi()
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    table = get(capsule, b"uniop._native.torch_abi")

    class TorchAbi(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("call", ctypes.c_void_p)]

    abi = TorchAbi.from_address(table)
    assert abi.version == 5
    proto = ctypes.PYFUNCTYPE(
        ctypes.c_int32, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_void_p, ctypes.c_uint64
    )
    return proto(abi.call)


def _f32_view(array):
    shape = (ctypes.c_int64 * array.ndim)(*array.shape)
    view = _DLTensor(array.ctypes.data, 1, 0, array.ndim, _DLDataType(2, 32, 1), shape, None, 0)
    return view, shape


def test_torch_abi_refuses_null_pointers_and_wrong_arity():
    """The C ABI behind the C++ kernels (uniop._native._torch_abi) checks what it is handed: a null
    op, argument array or output maker and an argument count that is not the schema's are
    UniopErrors, not crashes."""
    call = _torch_abi_call()
    never = _OutputMaker(_MAKE(lambda *_: pytest.fail("no output may be asked for")), None)
    with pytest.raises(uniop.UniopError, match="null pointer"):
        call(None, None, 0, ctypes.addressof(never), 1)
    handle = uniop.op("silu")._torch_handle()
    with pytest.raises(uniop.UniopError, match="null pointer"):
        call(handle, None, 0, None, 1)
    with pytest.raises(uniop.UniopError, match="silu: the torch kernel passed 0 arguments"):
        call(handle, None, 0, ctypes.addressof(never), 1)


def test_torch_abi_refuses_malformed_views():
    """The ABI reads each tensor as DLPack says (null strides: compact, as `_f32_view` passes them)
    and refuses a view it cannot read — a null shape for a rank above 0, a negative rank, a
    stride-0 view whose element count overflows — with a UniopError naming the argument."""
    call = _torch_abi_call()
    handle = uniop.op("silu")._torch_handle()
    never = _OutputMaker(_MAKE(lambda *_: pytest.fail("no output may be asked for")), None)
    x = np.ones(4, np.float32)
    huge = (ctypes.c_int64 * 2)(2**40, 2**40)
    zeros = (ctypes.c_int64 * 2)(0, 0)
    views = [
        (_DLTensor(x.ctypes.data, 1, 0, 1, _DLDataType(2, 32, 1), None, None, 0), "a valid DLPack tensor"),
        (_DLTensor(x.ctypes.data, 1, 0, -1, _DLDataType(2, 32, 1), None, None, 0), "a valid DLPack tensor"),
        (_DLTensor(x.ctypes.data, 1, 0, 2, _DLDataType(2, 32, 1), huge, zeros, 0), "a tensor whose element count fits"),
    ]
    for view, message in views:
        args = (_BoxedValue * 1)(_BoxedValue(kind=1, len=1, tensors=ctypes.pointer(view)))
        with pytest.raises(uniop.UniopError, match=f"silu: argument 'x': expected {message}"):
            call(handle, ctypes.addressof(args), 1, ctypes.addressof(never), 1)


def test_torch_abi_writes_outputs_the_maker_gives_and_reports_one_it_cannot():
    """The core asks the caller's output maker for each return once it knows the shape, and writes
    the result there (checked against NumPy's silu); a maker that cannot create one (returns null)
    is a UniopError naming the op and the return, not a write through a null pointer."""
    call = _torch_abi_call()
    handle = uniop.op("silu")._torch_handle()
    x = np.linspace(-4, 4, 12, dtype=np.float32).reshape(3, 4)
    view, _shape = _f32_view(x)
    args = (_BoxedValue * 1)(_BoxedValue(kind=1, len=1, tensors=ctypes.pointer(view)))
    out = np.full((3, 4), np.nan, dtype=np.float32)
    asked = []

    def into_out(_state, index, shape, ndim, dtype):
        asked.append((index, [shape[i] for i in range(ndim)], (dtype.code, dtype.bits, dtype.lanes)))
        return out.ctypes.data

    maker = _OutputMaker(_MAKE(into_out), None)
    assert call(handle, ctypes.addressof(args), 1, ctypes.addressof(maker), 1) == 0
    assert asked == [(0, [3, 4], (2, 32, 1))]
    np.testing.assert_allclose(out, x / (1 + np.exp(-x)), rtol=1e-6)

    refusing = _OutputMaker(_MAKE(lambda *_: None), None)
    with pytest.raises(uniop.UniopError, match=r"silu: torch could not create return 'y' \(\[3, 4\] float32"):
        call(handle, ctypes.addressof(args), 1, ctypes.addressof(refusing), 1)


def test_torch_abi_asks_a_list_return_for_each_item_in_order():
    """An op returning a list (cat_backward) has one return: the core asks the maker for each item,
    indices in order, and writes each gradient there."""
    call = _torch_abi_call()
    handle = uniop.op("cat_backward")._torch_handle()
    dout = np.arange(2 * 5 * 3, dtype=np.float32).reshape(2, 5, 3)
    parts = [np.zeros((2, 2, 3), np.float32), np.zeros((2, 3, 3), np.float32)]
    (dout_view, _s0), (a, _s1), (b, _s2) = _f32_view(dout), *(_f32_view(p) for p in parts)
    items = (_DLTensor * 2)(a, b)
    args = (_BoxedValue * 3)(
        _BoxedValue(kind=1, len=1, tensors=ctypes.pointer(dout_view)),
        _BoxedValue(kind=2, len=2, tensors=items),
        _BoxedValue(kind=3, int_value=1),
    )
    outs = [np.full(p.shape, np.nan, np.float32) for p in parts]
    asked = []

    def into_outs(_state, index, shape, ndim, _dtype):
        asked.append((index, [shape[i] for i in range(ndim)]))
        return outs[index].ctypes.data

    maker = _OutputMaker(_MAKE(into_outs), None)
    assert call(handle, ctypes.addressof(args), 3, ctypes.addressof(maker), 1) == 0
    assert asked == [(0, [2, 2, 3]), (1, [2, 3, 3])]
    np.testing.assert_array_equal(outs[0], dout[:, :2])
    np.testing.assert_array_equal(outs[1], dout[:, 2:])
    refusing = _OutputMaker(_MAKE(lambda *_: None), None)
    with pytest.raises(uniop.UniopError, match=r"cat_backward: torch could not create return 'dtensors\[0\]'"):
        call(handle, ctypes.addressof(args), 3, ctypes.addressof(refusing), 1)


def test_python_kernels_give_the_same_results():
    """The pure-Python CPU and Autograd kernels (used where the C++ ones are not built) pass the
    value, routing, optional-gradient, gradcheck, error, no-backward, forward-mode refusal and vmap
    tests too: run them in a process that refuses the C++ kernels."""
    tests = (
        "values_match or autograd_kernel_routes or linear_without_bias or gradcheck or errors_are_uniop"
        " or without_a_backward or forward_mode_ad or vmap_in_one_call or per_sample_gradients"
        " or autograds_contracts or left_unused"
    )
    env = dict(os.environ, UNIOP_TORCH_CPP_KERNELS="0")
    check = "import uniop.torch; assert not uniop.torch.cpp_kernels_loaded()"
    subprocess.run([sys.executable, "-c", check], env=env, check=True)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", tests],
        env=env,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert " passed" in done.stdout and " failed" not in done.stdout


def test_linear_without_bias_gets_no_bias_gradient():
    x, w = torch.randn(3, 4, requires_grad=True), torch.randn(5, 4, requires_grad=True)
    torch.ops.uniop.linear(x, w).sum().backward()
    want_x = torch.ones(3, 5) @ w.detach()
    assert torch.allclose(x.grad, want_x, atol=1e-5)


def test_attention_with_a_float_mask_passes_opcheck_and_gradcheck():
    """The generic opcheck and gradcheck run attention with the boolean mask (contiguous cases);
    here the float kind (ALiBi-like biases, −inf holes): registration, fake kernel and the f64
    backward against finite differences — the mask's own gradient too, for a mask of the full
    shape and one broadcast over the batch, heads and queries (summed over them)."""
    q, k, v = torch.randn(2, 4, 6, 8), torch.randn(2, 2, 6, 8), torch.randn(2, 2, 6, 8)
    bias = attention_mask(6, 6, torch.float32)
    torch.library.opcheck(torch.ops.uniop.attention.default, (q, k, v, None, True, None, bias))
    inputs = tuple(x.double().requires_grad_() for x in (q, k, v))
    fn = lambda *qkv: torch.ops.uniop.attention(*qkv, None, True, None, bias.double())[0]  # noqa: E731
    assert torch.autograd.gradcheck(fn, inputs)
    full = torch.randn(2, 4, 6, 6).masked_fill(~attention_mask(6, 6), float("-inf"))
    for mask in (full, torch.randn(2, 1, 1, 6)):
        inputs = tuple(x.double().requires_grad_() for x in (q, k, v, mask))
        fn = lambda q, k, v, m: torch.ops.uniop.attention(q, k, v, None, True, None, m)[0]  # noqa: E731
        assert torch.autograd.gradcheck(fn, inputs)


def _pair_rope_ref(x, cos, sin, mode):
    """Rope with one table value per pair, as GPT-OSS's ``_apply_rotary_emb`` writes it (mode
    'half'; 'interleave' pairs even elements with odd ones), in float64."""
    x, cos, sin = (t.to(torch.float64) for t in (x, cos, sin))
    first, second = x.chunk(2, -1) if mode == "half" else (x[..., 0::2], x[..., 1::2])
    out = first * cos - second * sin, second * cos + first * sin
    return torch.cat(out, -1) if mode == "half" else torch.stack(out, -1).flatten(-2)


@pytest.mark.parametrize("mode", ["half", "interleave"])
def test_rope_takes_one_table_value_per_pair(mode):
    """``per_pair`` tables (``[S, D/2]``: GPT-OSS's, flash-attn's) rotate as GPT-OSS's formula,
    through both routes, in every dtype, on a strided ``[B, H, S, D]`` view with tables in x's dtype
    and in float32; ``rope_cos_sin(per_pair=True)`` builds them from positions; opcheck and float64
    gradcheck (the backward takes ``per_pair`` from the forward). Tables of the full width with
    ``per_pair`` are an error naming ``cos``."""
    torch.manual_seed(0)
    pos = torch.arange(5)
    cos, sin = uniop.rope_cos_sin(pos, 8, mode=mode, per_pair=True)
    want_cos, want_sin = (t[..., :4] for t in cos_sin_ref(pos, 8))
    assert cos.shape == (5, 4)
    torch.testing.assert_close(cos.double(), want_cos, atol=1e-6, rtol=0)
    torch.testing.assert_close(sin.double(), want_sin, atol=1e-6, rtol=0)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        x = torch.randn(2, 5, 3, 8).to(dtype).transpose(1, 2)
        for tables in ((cos, sin), (cos.to(dtype), sin.to(dtype))):
            want = _pair_rope_ref(x, *tables, mode)
            _check(uniop.rope(x, *tables, mode, per_pair=True), want, dtype, f"uniop.rope {mode}")
            _check(torch.ops.uniop.rope(x, *tables, mode, True), want, dtype, f"torch.ops.uniop.rope {mode}")
    x = torch.randn(2, 3, 5, 8)
    torch.library.opcheck(torch.ops.uniop.rope.default, (x, cos, sin, mode, True))
    fn = lambda x: torch.ops.uniop.rope(x, cos.double(), sin.double(), mode, True)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (x.double().requires_grad_(),))
    full = cos_sin_ref(pos, 8)[0].float()
    with pytest.raises(uniop.UniopError, match="rope: argument 'cos': expected one value per rotated pair"):
        torch.ops.uniop.rope(x, full, full, mode, True)


def test_an_argument_without_a_backward_gradient_that_requires_one_is_an_error():
    """A tensor argument the backward op returns no gradient for (rope's cos/sin tables) that
    requires one: backward raises, naming the op, the argument and the backward op, instead of
    leaving its gradient out (a silent zero). Not requiring one is fine."""
    x = torch.randn(1, 2, 4, 8, requires_grad=True)
    cos, sin = torch.randn(4, 8, requires_grad=True), torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="uniop.rope: argument 'cos' requires a gradient"):
        torch.ops.uniop.rope(x, cos, sin).sum().backward()
    torch.ops.uniop.rope(x, cos.detach(), sin).sum().backward()
    assert x.grad is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_attention_float_mask_gradient_matches_sdpa(dtype, causal):
    """A learned bias (T5's relative position bias, trained ALiBi slopes) as attention's float
    mask gets SDPA's gradient: the same dq, dk, dv and dmask from torch's autograd through
    ``F.scaled_dot_product_attention(attn_mask=bias)`` (GQA as repeated kv heads; the causal mask
    folded into SDPA's), for masks of the full shape, shared by the batch, per key and per
    query-and-key pair, over two key tiles. Only a mask that requires a gradient costs the extra
    step: one that does not gets none computed (``needs_dmask`` false)."""
    torch.manual_seed(0)
    b, hq, hkv, s, d = 2, 4, 2, 300, 16
    q, k, v = torch.randn(b, hq, s, d, dtype=dtype), torch.randn(b, hkv, s, d, dtype=dtype), torch.randn(b, hkv, s, d, dtype=dtype)
    dout = torch.randn(b, hq, s, d, dtype=dtype)
    hidden = torch.rand(s, s) < 0.1
    hidden.fill_diagonal_(False)
    for shape in [(b, hq, s, s), (hq, s, s), (b, 1, 1, s), (s, s)]:
        bias = torch.randn(shape)
        bias = bias.masked_fill(hidden, float("-inf")).to(dtype) if shape[-2] == s else bias.to(dtype)
        xs = [t.clone().requires_grad_() for t in (q, k, v, bias)]
        torch.ops.uniop.attention(*xs[:3], None, causal, None, xs[3])[0].backward(dout)
        ref = [t.clone().requires_grad_() for t in (q, k, v, bias)]
        mask = ref[3]
        if causal:
            mask = mask.masked_fill(~torch.ones(s, s, dtype=torch.bool).tril(), float("-inf"))
        rep = hq // hkv
        out = torch.nn.functional.scaled_dot_product_attention(
            ref[0], ref[1].repeat_interleave(rep, 1), ref[2].repeat_interleave(rep, 1), attn_mask=mask
        )
        out.backward(dout)
        tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
        for name, got, want in zip(("dq", "dk", "dv", "dmask"), xs, ref):
            assert got.grad.shape == want.grad.shape, name
            err = (got.grad.double() - want.grad.double()).abs().max().item()
            assert err <= tol * (1 + want.grad.double().abs().max().item()), f"{shape} {name}: {err}"
    args = (dout, q, k, v, *torch.ops.uniop.attention(q, k, v, None, causal, None, bias), None, causal, None, bias)
    assert uniop.attention_backward(*args)[3].numel() == 0, "no dmask unless asked for"
    # Autograd asks for it (the backward's dmask step runs) only when the mask requires a gradient.
    for mask, wanted in ((bias.clone().requires_grad_(), True), (bias, False)):
        xs = [t.clone().requires_grad_() for t in (q, k, v)]
        with uniop.Profiler() as p:
            torch.ops.uniop.attention(*xs, None, causal, None, mask)[0].backward(dout)
        steps = {e["step"] for e in p.events()}
        assert "attention_backward.delta" in steps and ("attention_backward.dmask" in steps) == wanted, steps


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", [(2, 2, 8, 16), (2, 4, 300, 64)], ids=["small", "tiles"])
def test_attention_hides_keys_behind_the_dtype_lowest_value_on_every_route(dtype, shape):
    """transformers 4.x's masks (0 where a query sees a key, ``torch.finfo(dtype).min`` where not,
    the causal mask folded in) hide keys as −∞ does, whichever kernel runs (small calls take the
    GEMM tiles, longer ones AVX2's transposed tiles where the CPU has them): the results are the
    boolean mask's bit for bit, forward and backward, SDPA's at the queries that see a key, and
    out 0 at the left padding's queries, which see none (SDPA weighs their keys equally there)."""
    torch.manual_seed(0)
    b, h, s, d = shape
    q, k, v, dout = (torch.randn(b, h, s, d).to(dtype) for _ in range(4))
    pad = s // 3
    sees = torch.ones(s, s, dtype=torch.bool).tril().expand(b, 1, s, s).clone()
    sees[1, ..., :pad] = False
    lowest = torch.zeros(b, 1, s, s, dtype=dtype).masked_fill(~sees, torch.finfo(dtype).min)

    def run(mask):
        xs = [t.clone().requires_grad_() for t in (q, k, v)]
        out = torch.ops.uniop.attention(*xs, None, False, None, mask)[0]
        out.backward(dout)
        return out.detach(), [x.grad for x in xs]

    (got, grads), (want, want_grads) = run(lowest), run(sees)
    assert torch.equal(got, want)
    for name, g, w in zip(("dq", "dk", "dv"), grads, want_grads):
        assert torch.equal(g, w), name
    assert torch.equal(got[1, :, :pad], torch.zeros_like(got[1, :, :pad]))
    ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=lowest.float())
    real = sees.any(-1).expand(b, h, s)
    _check(got[real], ref[real].double(), dtype, "real queries against SDPA")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [5, 20, 100, 4096])
def test_masked_scores_get_probabilities_and_gradients_of_exactly_zero(dtype, n):
    """Scores hidden by a mask (−∞, or the dtype's lowest value as transformers' masks fill) get
    probabilities of exactly 0, as torch gives them, and so do their softmax gradients; a row
    hidden whole is NaN, as torch's. Rows of 5 and 20 take the short-row loop, 100 and 4096 the
    row passes (f16: the generic passes)."""
    x = torch.randn(16, n).to(dtype)
    hidden = torch.rand(16, n) < 0.5
    hidden[:, 0] = False
    for fill in (float("-inf"), torch.finfo(dtype).min):
        masked = x.masked_fill(hidden, fill)
        y = torch.ops.uniop.softmax(masked, -1)
        want = torch.softmax(masked.double(), -1)
        assert torch.equal(want[hidden], torch.zeros_like(want[hidden]))
        assert torch.equal(y[hidden].float(), torch.zeros(int(hidden.sum()))), f"fill {fill}"
        _check(y, want, dtype, f"softmax, fill {fill}")
        dx = torch.ops.uniop.softmax_backward(torch.randn(16, n).to(dtype), y, -1)
        assert torch.equal(dx[hidden].float(), torch.zeros(int(hidden.sum()))), f"fill {fill}"
    whole = torch.ops.uniop.softmax(torch.full((2, n), float("-inf"), dtype=dtype), -1)
    assert whole.isnan().all() and torch.softmax(torch.full((2, n), float("-inf")), -1).isnan().all()


@pytest.mark.parametrize("name", ["rms_norm", "softmax", "matmul", "silu_mul", "embedding"])
def test_zero_size(name):
    args, ref = CASES[name](torch.float32, False)
    args = list(args)
    if name == "embedding":
        args[1] = args[1][:0]
    else:
        args[0] = args[0][:0]
    if name == "silu_mul":
        args[1] = args[1][:0]
    _check(getattr(torch.ops.uniop, name)(*args), ref(*args), torch.float32, name)


def test_outputs_never_alias_inputs():
    x = torch.randn(4, 8)
    y = torch.ops.uniop.silu(x)
    assert y.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()


def test_autocast_policies():
    a, b = torch.randn(4, 8), torch.randn(8, 3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mm = torch.ops.uniop.matmul(a, b)
        sm = torch.ops.uniop.softmax(a.to(torch.bfloat16))
        keep = torch.ops.uniop.silu(a.to(torch.float16))
    assert mm.dtype == torch.bfloat16
    assert torch.allclose(mm.float(), a @ b, atol=0.1, rtol=0.02)
    assert sm.dtype == torch.float32, "softmax runs in float32 under autocast"
    assert keep.dtype == torch.float16, "elementwise ops keep their dtype"


def test_errors_are_uniop_errors_not_crashes():
    with pytest.raises(uniop.UniopError, match="rms_norm: argument 'weight'") as e:
        torch.ops.uniop.rms_norm(torch.randn(4, 8), torch.randn(7))
    assert e.value.code == 161004 and e.value.code_name == "shape"
    # torch's argument parser turns a None for a `Tensor` argument into an undefined tensor.
    with pytest.raises(uniop.UniopError, match="rms_norm: argument 'weight': expected a tensor, got None") as e:
        torch.ops.uniop.rms_norm(torch.randn(4, 8), None)
    assert e.value.code_name == "param-nullptr"
    with pytest.raises(uniop.UniopError, match="dtype") as e:
        uniop.softmax(torch.zeros(3, 4, dtype=torch.int32))
    assert e.value.code_name == "dtype"
    with pytest.raises(uniop.UniopError, match="expected a tensor"):
        uniop.silu([1.0, 2.0])
    meta = torch.empty(3, 4, device="meta")
    with pytest.raises(uniop.UniopError, match="CPU tensor"):
        uniop.silu(meta)
    with pytest.raises(uniop.UniopError, match="inner dim|shape"):
        uniop.matmul(torch.randn(3, 4), torch.randn(5, 6))


def test_repeated_calls_reuse_plans_only_for_identical_signatures():
    """Calls are planned once per signature (dtype, shape, strides, attributes) and rebound after:
    interleaving signatures must never run a plan made for another one."""
    torch.manual_seed(0)
    a, b = torch.randn(6, 10), torch.randn(3, 7)
    for _ in range(3):
        for x, dim in [(a, -1), (b, -1), (a.t(), -1), (a, 0), (a[::2], -1), (b.to(torch.bfloat16), 0)]:
            want = torch.softmax(x.double(), dim)
            got = uniop.softmax(x, dim)
            assert got.dtype == x.dtype and torch.allclose(got.double(), want, atol=TOL[x.dtype])
            assert got.data_ptr() != x.data_ptr()


def _run_in_threads(work, inputs):
    """`work(x)` for each of `inputs`, each in a thread of its own, all at once."""
    import threading

    threads = [threading.Thread(target=work, args=(x,)) for x in inputs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


@pytest.mark.parametrize("route", ["uniop", "torch.ops"])
def test_threads_run_ops_concurrently_with_correct_results(route):
    """Both routes, from four threads at once (torch.ops runs the C++ kernel without the GIL)."""
    rms_norm = uniop.rms_norm if route == "uniop" else torch.ops.uniop.rms_norm

    torch.manual_seed(0)
    xs = [torch.randn(64, 256) for _ in range(4)]
    w = torch.randn(256)
    errors = []

    def work(x):
        for _ in range(50):
            y, _ = rms_norm(x, w)
            want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
            if not torch.allclose(y, want, atol=1e-5):
                errors.append((y - want).abs().max().item())

    _run_in_threads(work, xs)
    assert not errors


def test_threads_train_through_the_recorded_nodes_at_once():
    """Four threads each record rms_norm and silu nodes and run their backward at the same time (the
    C++ node runs without the GIL); every thread's gradients equal torch's."""
    torch.manual_seed(0)
    xs = [torch.randn(64, 256) for _ in range(4)]
    w = torch.rand(256) + 0.5
    errors = []

    def grads(x, rms_norm, silu):
        x, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
        silu(rms_norm(x, wg)).pow(2).sum().backward()
        return x.grad, wg.grad

    def work(x):
        want = grads(x, lambda x, w: torch.nn.functional.rms_norm(x, (256,), w, 1e-6), torch.nn.functional.silu)
        for _ in range(20):
            got = grads(x, lambda x, w: torch.ops.uniop.rms_norm(x, w)[0], torch.ops.uniop.silu)
            errors.extend((g - e).abs().max().item() for g, e in zip(got, want) if not torch.allclose(g, e, atol=1e-3))

    _run_in_threads(work, xs)
    assert not errors


def test_launches_share_torchs_openmp_team():
    """`import uniop.torch` runs uniop's launches on torch's OpenMP team, sized by torch's thread
    setting; results equal those of uniop's own workers (rows split the same way)."""
    torch.manual_seed(0)
    x, w = torch.randn(512, 384), torch.randn(384)
    shared, _ = uniop.rms_norm(x, w)
    threads = torch.get_num_threads()
    try:
        assert uniop.share_openmp_threads() == threads
        torch.set_num_threads(1)
        assert uniop.share_openmp_threads() == 1
        one_thread, _ = uniop.rms_norm(x, w)
        uniop.share_openmp_threads(False)
        own_workers, _ = uniop.rms_norm(x, w)
    finally:
        torch.set_num_threads(threads)
        uniop.share_openmp_threads()
    assert torch.equal(shared, one_thread) and torch.equal(shared, own_workers)


def test_scalar_arguments_keep_integers_exact():
    """`add`'s alpha is a schema `Scalar`: ints stay ints (exact past 2**53), floats and bools work."""
    a, b = torch.zeros(1, dtype=torch.int64), torch.ones(1, dtype=torch.int64)
    alpha = 2**53 + 1
    assert uniop.add(a, b, alpha=alpha).item() == alpha
    assert torch.ops.uniop.add(a, b, alpha=alpha).item() == alpha
    x, y = torch.randn(4), torch.randn(4)
    torch.testing.assert_close(torch.ops.uniop.add(x, y, alpha=0.5), x + 0.5 * y)
    torch.testing.assert_close(uniop.add(x, y, alpha=True), x + y)
    with pytest.raises(uniop.UniopError, match="argument 'alpha': expected an integral value") as e:
        uniop.add(a, b, alpha=0.5)
    assert e.value.code_name == "param-invalid"


def test_profiler_sees_torch_ops_and_their_backward():
    x = torch.randn(8, 32, requires_grad=True)
    w = torch.randn(32, requires_grad=True)
    with uniop.Profiler() as prof:
        y, _ = torch.ops.uniop.rms_norm(x, w, 1e-6)
        y.sum().backward()
    steps = [(e["op"], e["step"]) for e in prof.events() if e["kind"] == "op"]
    # The forward, then the backward's two steps (dx per row, then the weight's reduction).
    assert [op for op, _ in steps] == ["rms_norm", "rms_norm_backward", "rms_norm_backward"], steps
    assert steps[1][1].endswith(".dx") and steps[2][1].endswith(".dweight"), steps


@python_kernels_chosen
@pytest.mark.parametrize("route", ["torch.ops.uniop", "uniop"])
def test_torch_outputs_are_plain_tensors_in_uniops_allocator(route):
    """Outputs for torch callers — torch.ops.uniop.<op>, and uniop.<op> once uniop.torch has loaded
    its C++ kernels — are made by torch over blocks of uniop's caching allocator: they count in
    uniop.memory_stats() while alive, go back to the cache when torch frees them, the next call of
    that size reuses the block instead of touching fresh pages, and they are ordinary tensors
    (writable, resizable: a tensor adopted from DLPack could not grow its storage)."""
    if route == "uniop" and not uniop.torch.cpp_kernels_loaded():
        pytest.skip("uniop.<op> makes torch outputs through DLPack without the C++ kernels")
    silu = torch.ops.uniop.silu if route == "torch.ops.uniop" else uniop.silu
    x = torch.randn(256, 1024)
    silu(x)  # plans the call (and any workspace) first; the output is dropped
    before = uniop.memory_stats()
    y = silu(x)
    during = uniop.memory_stats()
    assert during["live_buffers"] == before["live_buffers"] + 1
    assert during["allocated_bytes"] - before["allocated_bytes"] >= y.numel() * y.element_size()
    torch.testing.assert_close(y, torch.nn.functional.silu(x))
    y.add_(1)
    del y
    after = uniop.memory_stats()
    assert after["live_buffers"] == before["live_buffers"]
    assert after["allocated_bytes"] == before["allocated_bytes"]
    z = silu(x)
    assert uniop.memory_stats()["cache_hits"] > after["cache_hits"]
    torch.testing.assert_close(z, torch.nn.functional.silu(x))
    z.resize_(2 * z.numel())
    assert z.shape == (2 * x.numel(),)
    for dtype in (torch.bfloat16, torch.float16):  # and dtypes NumPy lacks, and nothing at all
        torch.testing.assert_close(silu(x.to(dtype)), torch.nn.functional.silu(x.to(dtype)))
    assert silu(torch.randn(0, 3)).shape == (0, 3)


@python_kernels_chosen
@pytest.mark.parametrize("route", ["torch.ops.uniop", "uniop"])
def test_an_output_torch_cannot_make_is_a_uniop_error(route):
    """A 1 PiB output (silu of a stride-0 view) is refused by uniop's allocator under torch: the call
    raises a UniopError naming the op, the output and its size, with the allocator's reason (torch's
    own exception for it stays in C++), and leaks no block."""
    if route == "uniop" and not uniop.torch.cpp_kernels_loaded():
        pytest.skip("uniop.<op> makes torch outputs through DLPack without the C++ kernels")
    silu = torch.ops.uniop.silu if route == "torch.ops.uniop" else uniop.silu
    what = "return 'y'" if route == "torch.ops.uniop" else "an output"
    huge = torch.zeros(1).expand(2**48)
    before = uniop.memory_stats()
    # Growing an output past memory is torch's own error (its storage's allocator is uniop's).
    with pytest.raises(torch.OutOfMemoryError, match="uniop: out of memory allocating an output of 562949953421312"):
        silu(torch.ones(4)).resize_(2**47)
    message = (
        rf"silu: torch could not create {what} \(\[281474976710656\] float32, 1125899906842624 bytes\): out of "
        r"memory: allocating 1125899906842624 bytes failed \(.+\), also after returning [0-9.]+ MiB of cached "
        r"blocks to the OS; uniop holds [0-9.]+ MiB in \d+ live buffers"
    )
    with pytest.raises(uniop.UniopError, match=message):
        silu(huge)
    after = uniop.memory_stats()
    assert after["live_buffers"] == before["live_buffers"]
    assert (after["alloc_retries"], after["ooms"]) == (before["alloc_retries"] + 2, before["ooms"] + 2)
    torch.testing.assert_close(silu(torch.ones(2)), torch.nn.functional.silu(torch.ones(2)))


def test_dataloader_workers_forked_while_the_parent_runs_ops_run_theirs():
    """A DataLoader's workers are forked (Linux's default) while another thread of the parent keeps
    running uniop ops on its own stream and through torch.ops. Each worker computes its batches
    with uniop and gets torch's values. Before, a worker forked while a stream had work queued
    waited forever on its first call (a DataLoader timeout here). The workers' uniop pools take the
    one thread torch gives its DataLoader workers, as uniop's launches in the parent ran on torch's
    OpenMP team. In a subprocess: the parent runs a thread that must not outlive the test."""
    code = """
import threading, time, torch, uniop, uniop.torch
torch.manual_seed(0)
x, w = torch.randn(64, 1024), torch.randn(1024)
stop = False
def busy():
    s = uniop.Stream()
    while not stop:
        uniop.silu(x, stream=s)
        torch.ops.uniop.rms_norm(x, w)
worker = threading.Thread(target=busy, daemon=True)
worker.start()
time.sleep(0.2)
class Rows(torch.utils.data.Dataset):
    def __len__(self):
        return 16
    def __getitem__(self, i):
        rows = x[4 * i:4 * (i + 1)]
        return torch.ops.uniop.rms_norm(rows, w)[0], uniop.silu(rows), uniop.share_openmp_threads(False)
loader = torch.utils.data.DataLoader(Rows(), batch_size=4, num_workers=2, multiprocessing_context="fork", timeout=60)
want_norm = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
assert uniop.share_openmp_threads(True) == torch.get_num_threads() > 1
for epoch in range(2):
    norms, silus, threads = zip(*loader)
    assert torch.cat(threads).tolist() == [1] * 16, threads
    torch.testing.assert_close(torch.cat(norms).reshape(64, 1024), want_norm, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(torch.cat(silus).reshape(64, 1024), torch.nn.functional.silu(x))
    print("epoch", epoch, "ok")
stop = True
worker.join()
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.splitlines() == ["epoch 0 ok", "epoch 1 ok"], run.stdout + run.stderr


@python_kernels_chosen
def test_an_output_the_os_refuses_is_retried_after_emptying_the_cache():
    """Near a process's memory limit the OS refuses a new block while uniop's cache holds freed ones
    of other sizes: uniop returns them and asks again, as PyTorch's CUDA allocator does; when the OS
    refuses again, the error says what uniop holds. In a subprocess capped by `ulimit -v` (RLIMIT_AS),
    where the OS refuses a mapping for real, as under a cgroup or strict overcommit."""
    code = """
import resource, torch, uniop, uniop.torch
MiB = 1 << 20
def address_space():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
small, large = torch.ones(150 * MiB // 4), torch.ones(250 * MiB // 4)
uniop.silu(small[: 1 << 20]), torch.ops.uniop.silu(small[: 1 << 20])  # plans and threads first
start = uniop.memory_stats()
# 150 MiB cached and a 250 MiB block do not fit; either alone does.
resource.setrlimit(resource.RLIMIT_AS, (address_space() + 380 * MiB, resource.getrlimit(resource.RLIMIT_AS)[1]))
uniop.silu(small)  # its 150 MiB output goes back to the cache (the input stays mapped)
y = uniop.silu(large)
print(all(torch.equal(y[i], torch.nn.functional.silu(large[i])) for i in (slice(4096), slice(-4096, None))))
for silu in (uniop.silu, torch.ops.uniop.silu):
    try:
        silu(large)
    except uniop.UniopError as e:
        print(e)
end = uniop.memory_stats()
print(end["alloc_retries"] - start["alloc_retries"], end["ooms"] - start["ooms"])
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    matches, direct, dispatched, counts = run.stdout.splitlines()
    assert matches == "True"
    held = "also after returning 0.00 MiB of cached blocks to the OS; uniop holds 250.00 MiB in 1 live buffers"
    assert direct.startswith("silu: torch could not create an output ([65536000] float32, 262144000 bytes)"), direct
    assert dispatched.startswith("silu: torch could not create return 'y' ([65536000] float32"), dispatched
    for message in (direct, dispatched):
        assert "out of memory: allocating 262144000 bytes failed (Cannot allocate memory" in message, message
        assert message.endswith(held), message
    assert counts == "3 2"  # the 250 MiB output's successful retry, then the two failures


def test_torch_tensor_io_takes_only_its_own_capsule():
    new_capsule = ctypes.pythonapi.PyCapsule_New
    new_capsule.restype = ctypes.py_object
    new_capsule.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    name = ctypes.create_string_buffer(b"uniop.torch.tensor_maker.v1")  # outlives the capsule below
    payload = ctypes.c_int(0)
    other = new_capsule(ctypes.addressof(payload), ctypes.addressof(name), None)
    with pytest.raises(ValueError, match="incorrect name"):
        uniop._native._use_torch_tensors(torch.Tensor, other)
    with pytest.raises(TypeError):
        uniop._native._use_torch_tensors(torch.Tensor, "not a capsule")
    x = torch.randn(5)  # the functions in use are still the real ones
    torch.testing.assert_close(uniop.silu(x), torch.nn.functional.silu(x))


def test_direct_calls_read_torch_views_as_torch_sees_them():
    """uniop.<op> reads torch arguments through uniop.torch's C++ reader: offsets, strides,
    broadcast (stride-0) and empty views, bf16/f16, Parameters and tensors that require grad."""
    base = torch.randn(6, 10)
    x = base.t()[2:, 1::2]  # transposed, offset, strided
    w = torch.randn(3).expand(5, 3)[1]  # a row of a stride-0 view
    cases = [
        (uniop.silu, (x,), lambda: torch.nn.functional.silu(x)),
        (uniop.silu, (x.to(torch.bfloat16),), lambda: torch.nn.functional.silu(x.to(torch.bfloat16))),
        (uniop.silu, (x.half(),), lambda: torch.nn.functional.silu(x.half())),
        (uniop.silu, (torch.randn(0, 4),), lambda: torch.empty(0, 4)),
        (uniop.mul, (x[:, :3], w), lambda: x[:, :3] * w),
        (uniop.silu, (torch.nn.Parameter(x.clone()),), lambda: torch.nn.functional.silu(x)),
        (uniop.silu, (x.clone().requires_grad_(),), lambda: torch.nn.functional.silu(x)),
    ]
    for fn, args, expected in cases:
        out = fn(*args)
        out = out[0] if isinstance(out, tuple) else out
        torch.testing.assert_close(out, expected().detach(), atol=1e-2 if out.dtype != torch.float32 else 1e-6, rtol=1e-2)
    # In place, through the views the reader gives: caches that are slices of a larger buffer.
    buffer = torch.zeros(2, 1, 2, 8, 4)
    k_cache, v_cache = buffer[0], buffer[1]
    k, v = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4)
    assert uniop.kv_cache_append(k_cache, v_cache, k, v, torch.tensor([2])) is None
    torch.testing.assert_close(k_cache[:, :, 2:5], k)
    torch.testing.assert_close(v_cache[:, :, 2:5], v)
    assert k_cache[:, :, :2].abs().sum() == 0 and v_cache[:, :, 5:].abs().sum() == 0


def test_direct_calls_refuse_views_they_cannot_read():
    """Each with a message naming the argument. A negative view's values are the negation of its
    memory's; DLPack cannot say so, and reading the memory as it is returned silu(x) for silu(-x).
    Meta tensors, complex dtypes and layouts DLPack lacks are refused as before the C++ reader."""
    x = torch.randn(4)
    with pytest.raises(uniop.UniopError, match=r"silu: argument 'x': expected a tensor without a pending negation"):
        uniop.silu(x._neg_view())
    torch.testing.assert_close(uniop.silu(x._neg_view().resolve_neg()), torch.nn.functional.silu(-x))
    with pytest.raises(uniop.UniopError, match=r"silu: argument 'x': expected a CPU tensor, got a tensor on meta"):
        uniop.silu(torch.randn(4, device="meta"))
    with pytest.raises(uniop.UniopError, match=r"silu: argument 'x': expected a dtype uniop knows"):
        uniop.silu(torch.randn(3, dtype=torch.complex64).conj())
    if torch.backends.mkldnn.is_available():  # on the CPU, but not a layout DLPack has: no "tensor on cpu"
        with pytest.raises(uniop.UniopError, match=r"silu: argument 'x': expected a tensor that can be shared"):
            uniop.silu(torch.randn(4, 4).to_mkldnn())


@pytest.mark.parametrize("with_reader", [True, False], ids=["cpp-reader", "dlpack-exchange"])
def test_direct_calls_refuse_tensors_without_memory(with_reader):
    """An efficient zero tensor is a view of no memory (a null data pointer): reading its elements
    crashed the process. uniop.<op> refuses it with or without uniop.torch's C++ reader;
    torch.ops.uniop gets it materialized by the dispatcher and computes on the zeros."""
    code = f"""
import torch, uniop
if {with_reader}:
    import uniop.torch
z = torch._efficientzerotensor(3)
try:
    uniop.silu(z)
except uniop.UniopError as e:
    print(e)
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "silu: argument 'x': expected a tensor with memory behind its elements" in run.stdout
    assert "a null data pointer for 12 bytes of elements" in run.stdout
    torch.testing.assert_close(torch.ops.uniop.silu(torch._efficientzerotensor(3)), torch.zeros(3))


def test_direct_calls_without_uniop_torch_refuse_views_dlpack_cannot_describe():
    """Without uniop.torch's C++ reader, uniop.<op> reads torch tensors through torch's DLPack
    exchange API, which says nothing of a pending negation (the values came back as silu(x) for
    silu(-x)) nor of a storage resized smaller under the view (reading it crashed the process):
    both are refused with the reader's messages (in a subprocess that never imports uniop.torch)."""
    code = """
import torch, uniop
x = torch.randn(4)
for view in (x._neg_view(), torch.randn(1 << 20)):
    if view.numel() > 4:
        view.untyped_storage().resize_(4)
    try:
        uniop.silu(view)
    except uniop.UniopError as e:
        print(e)
print(torch.allclose(uniop.silu(x._neg_view().resolve_neg()), torch.nn.functional.silu(-x)))
print(torch.allclose(uniop.silu(x[1::2]), torch.nn.functional.silu(x[1::2])), uniop.silu(x[4:]).shape)
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    negated, past_the_end, resolved, in_bounds = run.stdout.splitlines()
    assert negated == (
        "silu: argument 'x': expected a tensor without a pending negation (call .resolve_neg() on it), got a "
        "negative view"
    )
    assert past_the_end == (
        "silu: argument 'x': expected a tensor whose storage holds its elements, got a view reaching 4194304 bytes "
        "into a storage of 4"
    )
    assert resolved == "True"
    assert in_bounds == "True torch.Size([0])"


@python_kernels_chosen
@pytest.mark.parametrize("route", ["torch.ops.uniop", "uniop"])
def test_views_past_the_end_of_their_storage_are_refused(route):
    """A storage resized smaller under its view (`untyped_storage().resize_()`): reading the view
    read past the end of the memory and crashed the process; both routes refuse it now (in a
    subprocess, so that a regression fails this test instead of killing the run)."""
    code = f"""
import torch, uniop, uniop.torch
x = torch.randn(1 << 20)
x.untyped_storage().resize_(4)
try:
    {"torch.ops.uniop.silu" if route == "torch.ops.uniop" else "uniop.silu"}(x)
except (uniop.UniopError, RuntimeError) as e:
    print(type(e).__name__, e)
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    error = "UniopError" if route == "uniop" else "RuntimeError"  # the torch kernel checks before the core
    assert run.stdout.startswith(error), run.stdout
    assert "silu: argument 'x': expected a tensor whose storage holds its elements, got a view reaching" in run.stdout
