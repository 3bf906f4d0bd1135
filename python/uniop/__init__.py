"""uniop for Python: every registered op as ``uniop.<op>``, zero-copy over DLPack.

The functions are generated at import from the op registry (the same schemas the C header and
``torch.ops.uniop`` come from), so an op added in Rust — or loaded from a plugin with
:func:`load_library` — appears here with its signature and docstring and no Python code.

Tensors may be NumPy arrays, torch tensors or any object implementing ``__dlpack__``; they are
read in place (strided and broadcast views included). Outputs are allocated by the caller's
framework: torch inputs give torch tensors, NumPy inputs NumPy arrays (other DLPack producers get
NumPy arrays back). Every failure raises :class:`UniopError` with the core's message and status
code (``.code``, the same number the C API returns).

``import uniop.torch`` additionally registers every op as ``torch.ops.uniop.<op>`` with fake
kernels, autograd and autocast rules.
"""

from __future__ import annotations

import inspect
import sys

from . import _native
from ._native import (
    Event,
    Profiler,
    Stream,
    UniopError,
    empty_cache,
    gemm_kernels,
    memory_stats,
    memory_summary,
    reset_peak_memory_stats,
    share_openmp_threads,
    synchronize,
)

__all__ = [
    "Event",
    "Profiler",
    "Stream",
    "UniopError",
    "empty_cache",
    "gemm_kernels",
    "load_library",
    "memory_stats",
    "memory_summary",
    "op",
    "ops",
    "reset_peak_memory_stats",
    "share_openmp_threads",
    "synchronize",
]

# `uniop.torch` (when imported) registers ops loaded later through this hook.
_on_new_ops = []
_ops = {}


def _allocate(like, shape, dtype):
    """Allocates an output for a call whose first tensor is `like` when Rust cannot create it
    (torch >= 2.9 tensors and NumPy arrays are made in Rust): a torch tensor for an older torch,
    a NumPy array for other DLPack producers, and the bfloat16 error for NumPy callers."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(like, torch.Tensor):
        return torch.empty(shape, dtype=getattr(torch, dtype))
    import numpy as np

    if dtype == "bfloat16":
        err = UniopError(
            "NumPy has no bfloat16: this call returns a bfloat16 tensor, so pass torch tensors "
            "(or another DLPack producer with bfloat16) instead of NumPy arrays"
        )
        err.code, err.code_name = 161003, "dtype"
        raise err
    return np.empty(shape, dtype=dtype)


_native._set_allocator(_allocate)


def _signature(native):
    params = []
    for a in native.args:
        kind = inspect.Parameter.KEYWORD_ONLY if a["kwarg_only"] else inspect.Parameter.POSITIONAL_OR_KEYWORD
        default = a.get("default", inspect.Parameter.empty)
        params.append(inspect.Parameter(a["name"], kind, default=default, annotation=a["type"]))
    params.append(inspect.Parameter("stream", inspect.Parameter.KEYWORD_ONLY, default=None, annotation="Stream"))
    returns = native.returns
    ret = "None" if not returns else "Tensor" if len(returns) == 1 else f"tuple[{', '.join(['Tensor'] * len(returns))}]"
    return inspect.Signature(params, return_annotation=ret)


def _docstring(native):
    lines = [native.schema, "", native.doc, ""]
    mutated = [a["name"] for a in native.args if a["mutated"]]
    if mutated:
        lines.append(f"Updates in place: {', '.join(mutated)}.")
    if native.returns_list:
        lines.append(f"Returns: {native.returns[0]}, a list of tensors.")
    elif native.returns:
        lines.append(f"Returns: {', '.join(native.returns)}.")
    lines.append(f"Dtypes: {', '.join(native.dtypes)}.")
    if native.backward:
        lines.append(f"Backward: uniop.{native.backward} (autograd through uniop.torch).")
    lines.append("Runs on the default stream unless stream= is given; returns when the result is ready.")
    return "\n".join(lines)


def _function(native):
    """`uniop.<op>`: a builtin function (no Python frame per call) whose text signature and
    docstring come from the schema."""
    sig = _signature(native)
    plain = sig.replace(
        parameters=[p.replace(annotation=p.empty) for p in sig.parameters.values()],
        return_annotation=inspect.Signature.empty,
    )
    fn = native.function(f"{native.name}{plain}\n--\n\n{_docstring(native)}")
    fn.__module__ = __name__
    return fn


def _install(natives):
    new = []
    for native in natives:
        if native.name in _ops:
            continue
        _ops[native.name] = native
        setattr(sys.modules[__name__], native.name, _function(native))
        __all__.append(native.name)
        new.append(native)
    for hook in _on_new_ops:
        hook(new)
    return new


def ops():
    """Names of every registered op (built-ins and loaded plugins)."""
    return sorted(_ops)


def op(name):
    """The raw op object for `name`: its schema, args, returns, dtypes and backward."""
    try:
        return _ops[name]
    except KeyError:
        err = UniopError(f"unknown op '{name}' (registered: {', '.join(sorted(_ops))})")
        err.code, err.code_name = 161002, "param-invalid"
        raise err from None


def load_library(path):
    """Loads a uniop op library (a Rust crate exporting ops with ``uniop::export_ops!``).

    Its ops become ``uniop.<op>`` functions (and ``torch.ops.uniop.<op>`` once ``uniop.torch`` is
    imported). Returns their names.
    """
    names = _native.load_library(str(path))
    _install([o for o in _native.ops() if o.name in names])
    return names


_install(_native.ops())


def _share_torch_threads():
    """Runs uniop's launches on torch's OpenMP team when torch is loaded and uses one: torch's
    threads keep spinning after each of its ops, and uniop's own workers would share their cores."""
    torch = sys.modules.get("torch")
    if torch is not None and "parallel backend: OpenMP" in torch.__config__.parallel_info():
        share_openmp_threads()


_share_torch_threads()
