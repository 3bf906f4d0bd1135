"""Every op on views placed where small test tensors never are: past element 2^32 of their storage,
and one element past an aligned address.

Why past 2^32: an index or offset a kernel keeps in 32 bits (an `i32` gather index, a `u32` row
offset) works on every small tensor and reads the wrong elements only past 2^31 or 2^32.
test_large_tensors.py fills real tensors that large for a few ops; here every registered op gets its
case's floating inputs as views strided across 2^32 elements of a storage, so each view's last row
sits past the mark. Torch maps such a storage without touching it (untouched pages cost no memory):
only the elements the views show are written, and the op must read exactly those.

Why one element off: fresh tensors start on 64-byte boundaries, and a kernel that assumes it (an
aligned vector load, a non-temporal store) faults or misreads only on a view such as `x[1:]`.

Values are checked against the cases' independent references, through `uniop.<op>` and
`torch.ops.uniop.<op>`; kv_cache_append writes into caches placed both ways.
"""

import math

import pytest
import torch

import uniop
import uniop.torch  # noqa: F401  (torch.ops.uniop)
from cases import CASES
from test_torch_ops import _check

FAR = 2**32  # elements


def _spread_dim(t):
    """The dim of `t` to stride across 2^32 elements: its first of two or more rows, for floating
    tensors (integer and boolean ones hold indices and flags, and stay as they are)."""
    if not isinstance(t, torch.Tensor) or not t.is_floating_point():
        return None
    return next((i for i, n in enumerate(t.shape) if n >= 2), None)


def _far(t):
    """`t`'s values in a view whose spread dim is strided so that its last row lies past element
    2^32 of the view's storage (dims before it have one row; dims after it stay dense); `t` itself
    when it has no such dim."""
    k = _spread_dim(t)
    if k is None:
        return t
    inner = math.prod(t.shape[k + 1 :])
    stride = max(-(-FAR // (t.shape[k] - 1)), inner)
    strides = [stride * t.shape[k]] * k + [stride] + [math.prod(t.shape[i + 1 :]) for i in range(k + 1, t.dim())]
    storage = torch.empty((t.shape[k] - 1) * stride + inner, dtype=t.dtype)
    view = storage.as_strided(t.shape, strides)
    view.copy_(t)
    return view


def _shifted(t):
    """`t`'s values in a view starting one element into its storage (any dtype: indices too)."""
    if not isinstance(t, torch.Tensor):
        return t
    view = torch.empty(t.numel() + 1, dtype=t.dtype)[1:].view(t.shape)
    view.copy_(t)
    return view


def _tensors(args):
    """The arguments, with a list's items in its place."""
    return [x for a in args for x in (a if isinstance(a, list) else [a])]


def _placed(args, place):
    return [[place(x) for x in a] if isinstance(a, list) else place(a) for a in args]


def _has_spread_input(name):
    args, _ = CASES[name](torch.bfloat16, False)
    return any(_spread_dim(x) is not None for x in _tensors(args))


# Not here: kv_cache_append (in place: its own test below) and rope_cos_sin (integer positions only).
SPREAD = [n for n in sorted(CASES) if n != "kv_cache_append" and _has_spread_input(n)]


def _can_map_far_storage(dtype):
    try:
        torch.empty(FAR + 1, dtype=dtype)
        return True
    except RuntimeError:  # strict overcommit or an address-space limit refuses 8 or 16 GiB of mapping
        return False


DTYPES = [
    pytest.param(dt, id=str(dt), marks=pytest.mark.skipif(not _can_map_far_storage(dt), reason=f"cannot map {dt}"))
    for dt in (torch.float32, torch.bfloat16)
]


def test_only_ops_without_floating_inputs_are_left_out_of_the_far_views():
    assert sorted(set(CASES) - set(SPREAD)) == ["kv_cache_append", "rope_cos_sin"]


def _extent(x):
    return sum((n - 1) * s for n, s in zip(x.shape, x.stride())) + 1 if x.numel() else 0


def _placed_case(name, dtype, place):
    """The op's case with its arguments placed by `place`, and the reference's returns."""
    torch.manual_seed(0)
    args, ref = CASES[name](dtype, False)
    return _placed(args, place), ref(*args)


def _check_routes(name, args, want, dtype):
    _check(getattr(uniop, name)(*args), want, dtype, f"uniop.{name}")
    _check(getattr(torch.ops.uniop, name)(*args), want, dtype, f"torch.ops.uniop.{name}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", SPREAD)
def test_views_reaching_past_two_to_the_32_elements(name, dtype):
    far, want = _placed_case(name, dtype, _far)
    assert any(_extent(x) > FAR for x in _tensors(far) if isinstance(x, torch.Tensor))
    _check_routes(name, far, want, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", [n for n in sorted(CASES) if n != "kv_cache_append"])
def test_views_one_element_off_an_aligned_address(name, dtype):
    shifted, want = _placed_case(name, dtype, _shifted)
    assert all(x.data_ptr() % 64 for x in _tensors(shifted) if isinstance(x, torch.Tensor) and x.numel())
    _check_routes(name, shifted, want, dtype)


@pytest.mark.parametrize(
    "place, dtype",
    [pytest.param(_far, *p.values, id=f"far-{p.id}", marks=p.marks) for p in DTYPES]
    + [pytest.param(_shifted, dt, id=f"shifted-{dt}") for dt in (torch.float32, torch.bfloat16)],
)
def test_kv_cache_append_writes_into_placed_caches(place, dtype):
    (kc, vc, k, v, pos), _ = CASES["kv_cache_append"](dtype, False)
    want_k, want_v = kc.clone(), vc.clone()
    for b, p in enumerate(pos.tolist()):
        want_k[b, :, p : p + k.shape[2]] = k[b]
        want_v[b, :, p : p + v.shape[2]] = v[b]
    placed_k, placed_v = place(kc), place(vc)
    assert _extent(placed_k) > FAR if place is _far else placed_k.data_ptr() % 64
    uniop.kv_cache_append(placed_k, placed_v, place(k), place(v), place(pos))
    assert torch.equal(placed_k, want_k) and torch.equal(placed_v, want_v)

