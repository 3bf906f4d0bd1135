"""Bad input never crashes: every op's sample arguments (``cases.py``), each one in turn replaced by
a wrong value — an empty, integer, boolean, 0-d, reshaped, broadcast, truncated, negatively
strided or meta tensor, one with a dim one longer or shorter or its last two dims transposed,
None, a list, an out-of-range or mistyped attribute — through ``uniop.<op>`` and
``torch.ops.uniop.<op>``. Each call must either run or raise
``uniop.UniopError``: no other exception (a ``PanicException`` from a Rust panic, an error from
torch's internals about an undefined tensor) and no crash.

Through ``torch.ops`` torch parses the arguments first: a list in a ``Tensor`` place, None where no
other tensor is given, a mistyped attribute and an extra argument get torch's own errors (naming
the op and the argument) before uniop sees the call, so those are left out of the torch route."""

import numpy as np
import pytest
import torch

import uniop
import uniop.torch  # noqa: F401  (registers torch.ops.uniop)
from cases import CASES


def tensor_variants(t):
    yield "empty", t.new_empty((0, *t.shape[1:])) if t.dim() else t.reshape(-1)[:0]
    if t.is_floating_point():
        yield "int32", t.to(torch.int32)
    else:
        yield "float32", t.float()
    yield "float64", t.double()
    yield "float16", t.half()
    yield "bool", t.bool()
    yield "0-d", t.reshape(-1)[:1].reshape(()) if t.numel() else t.reshape(())
    yield "leading broadcast dim", t.unsqueeze(0).expand(3, *t.shape)
    yield "flattened", t.reshape(-1)
    yield "meta", torch.empty(t.shape, dtype=t.dtype, device="meta")
    # Counted elements past any memory: one element broadcast to 2**62.
    yield "huge broadcast", t.reshape(-1)[:1].expand(1 << 31, 1 << 31) if t.numel() else t
    if t.dim() and t.shape[-1] > 1:
        yield "last dim shortened", t[..., :-1]
        yield "stride 2", t.repeat_interleave(2, -1)[..., ::2]
    # Each dim one longer, and each leading dim one shorter (the last one's is above): sizes that
    # disagree with the other arguments' in one place at a time.
    for d in range(t.dim()):
        if t.shape[d]:
            yield f"dim {d} one longer", torch.cat([t, t.narrow(d, 0, 1)], d)
        if t.shape[d] > 1 and d != t.dim() - 1:
            yield f"dim {d} one shorter", t.narrow(d, 0, t.shape[d] - 1)
    if t.dim() >= 2 and t.shape[-1] != t.shape[-2]:
        yield "last two dims transposed", t.transpose(-1, -2)


def attribute_variants():
    yield from [("negative", -5), ("2**62", 1 << 62), ("nan", float("nan")), ("text", "zzz"), ("tensor", torch.ones(2))]


def replaced(args, i, value):
    return args[:i] + (value,) + args[i + 1 :]


def calls(args):
    """(label, arguments, whether torch.ops parses them) for every one-argument replacement."""
    for i, a in enumerate(args):
        if not isinstance(a, torch.Tensor):
            for label, v in attribute_variants():
                yield f"arg {i} {label}", replaced(args, i, v), True
            yield f"arg {i} None", replaced(args, i, None), True
            continue
        for label, v in tensor_variants(a):
            yield f"arg {i} {label}", replaced(args, i, v), True
        others = any(isinstance(b, torch.Tensor) for j, b in enumerate(args) if j != i)
        yield f"arg {i} None", replaced(args, i, None), others
        yield f"arg {i} list", replaced(args, i, [1.0, 2.0]), False
        if a.dim() and a.shape[-1] > 1 and a.dtype != torch.bfloat16:
            yield f"arg {i} negative strides (NumPy)", replaced(args, i, np.ascontiguousarray(a.numpy())[..., ::-1]), False
    yield "one argument too many", args + (1,), False


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", sorted(CASES))
def test_wrong_arguments_raise_uniop_errors(name, dtype):
    args, _ = CASES[name](dtype, False)
    wrong = []
    for label, call_args, through_torch in calls(tuple(args)):
        routes = [("uniop", getattr(uniop, name))]
        if through_torch:
            routes.append(("torch.ops", getattr(torch.ops.uniop, name)))
        for route, fn in routes:
            try:
                fn(*call_args)
            except uniop.UniopError:
                pass
            except BaseException as e:  # noqa: BLE001 — a PanicException is a BaseException
                if isinstance(e, KeyboardInterrupt):
                    raise
                if route == "torch.ops" and "Expected a value of type" in str(e):
                    continue  # torch's argument parser, before uniop (a mistyped attribute)
                wrong.append(f"{route} {label}: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
    assert not wrong, f"{name} ({dtype}):\n" + "\n".join(wrong)
