"""Every uniop op as ``torch.ops.uniop.<op>``: fake kernels, autograd, autocast — all generic.

Importing this module defines each registry schema in the ``uniop`` torch library namespace
(``torch.library.Library.define`` + ``impl``: about half the per-call cost of ``@custom_op``) and
attaches, with no per-op code:

- a CPU kernel: the uniop call itself (outputs allocated by torch, never aliasing inputs);
- a fake kernel from the op's Rust ``infer`` (same shapes, dtypes and contiguous strides as the
  real kernel), so ``torch.compile`` traces through without graph breaks; sizes that are symbols
  (``dynamic=True``, ``torch.export``'s ``Dim``) stay symbols (:mod:`uniop.torch.symbolic`);
- autograd from the op's backward op, wired by argument names (the convention documented on
  ``uniop::Op::backward``: ``d<return>`` is a gradient in, ``d<arg>`` a gradient out,
  ``needs_d<arg>`` whether ``<arg>`` requires a gradient, other arguments are the forward's
  arguments or returns of the same name); returns the backward does
  not take a gradient for (``rstd``, ``lse``) are marked non-differentiable. A call on plain CPU
  tensors records a C++ graph node (csrc/kernels.cpp, where built), any other call the
  ``autograd.Function`` of :func:`_autograd_kernel`, wired alike;
- autocast from the op's policy: GEMM-bound ops run in the region's lower precision, softmax-like
  reductions in float32, everything else in its inputs' dtype.

Ops loaded later with :func:`uniop.load_library` are registered here as well.
"""

from __future__ import annotations

import os
import warnings

import torch
from torch._C._functorch import _unwrap_batched
from torch._functorch.autograd_function import VmapInfo as _VmapInfo
from torch._functorch.predispatch import _add_batch_dim
from torch._functorch.pyfunctorch import retrieve_current_functorch_interpreter as _current_functorch_interpreter
from torch.utils import _pytree

import uniop as _uniop

from . import nn  # noqa: F401  (uniop.torch.nn.RMSNorm, ...)
from . import symbolic
from .attention_interface import register_attention  # noqa: F401
from .experts_interface import register_experts  # noqa: F401
from .llama import patch_llama, unpatch_llama  # noqa: F401

NAMESPACE = "uniop"
_lib = torch.library.Library(NAMESPACE, "DEF")
_registered = {}


def _dtype(name):
    return getattr(torch, name)


def _first_tensor(args):
    """The first tensor among `args`, looking inside lists (a `Tensor[]` argument)."""
    for a in args:
        if isinstance(a, torch.Tensor):
            return a
        if isinstance(a, (list, tuple)):
            found = _first_tensor(a)
            if found is not None:
                return found
    return None


def _fake_kernel(native):
    def fake(*args, **kwargs):
        like = _first_tensor(list(args) + list(kwargs.values()))
        shapes = symbolic.infer(native, args, kwargs)
        outs = [torch.empty(shape, dtype=_dtype(dt), device=like.device) for shape, dt in shapes]
        if native.returns_list:
            return outs
        if not outs:
            return None
        return outs[0] if len(outs) == 1 else tuple(outs)

    return fake


class _BackwardWiring:
    """How one forward op's autograd calls its backward op (resolved once, at registration)."""

    def __init__(self, fwd, bwd):
        # Arguments that are lists of tensors (cat's): their items join the autograd graph one by
        # one (see `_autograd_kernel`), and their gradient is the backward's list return.
        self.lists = {i for i, a in enumerate(fwd.args) if a["type"].startswith("Tensor[")}
        self.backward_returns_list = bwd.returns_list
        self.returns = list(fwd.returns)
        # Resolved by the core (uniop::autograd), which raises for a backward breaking the naming
        # convention. sources: per backward argument ("grad", i) | ("arg", i) | ("out", i) |
        # ("needs", i) | ("default", None); grad_of: per backward return, the forward argument
        # it is the gradient of.
        self.sources, self.grad_of = fwd.backward_wiring
        # backward argument index: the default a ("default", None) source passes
        self.defaults = {j: bwd.args[j]["default"] for j, (kind, _) in enumerate(self.sources) if kind == "default"}
        fwd_args = [a["name"] for a in fwd.args]
        # Arguments the backward returns no gradient for: one that requires a gradient is an error,
        # since leaving its gradient out would give the caller a wrong (zero) one without a word.
        self.no_grad_message = {
            i: f"uniop.{fwd.name}: argument '{n}' requires a gradient, which {bwd.name} does not compute "
            f"(it returns {', '.join(bwd.returns)})"
            for i, n in enumerate(fwd_args)
            if i not in self.grad_of
        }
        self.differentiable = {i for kind, i in self.sources if kind == "grad"}
        self.saved_args = sorted({i for kind, i in self.sources if kind == "arg"})
        self.saved_outs = sorted({i for kind, i in self.sources if kind == "out"})
        self.backward_name = bwd.name

    _SOURCE_CODES = {"grad": 0, "arg": 1, "out": 2, "needs": 3, "default": 4}

    def as_numbers(self):
        """This wiring as csrc/kernels.cpp's ``register_autograd`` takes it (its ``Wiring``)."""
        return (
            self.backward_name,
            [(self._SOURCE_CODES[kind], -1 if i is None else i) for kind, i in self.sources],
            self.grad_of,
            sorted(self.no_grad_message.items()),
            [i in self.differentiable for i in range(len(self.returns))],
            self.saved_args,
            self.saved_outs,
        )


_PLAIN_CPU = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU) | torch._C.DispatchKeySet(torch._C.DispatchKey.AutogradCPU)
_grad_enabled = torch._C.is_grad_enabled
_any_requires_grad = torch._C._any_requires_grad
_single_level_functions_allowed = torch._functorch.utils.enable_single_level_autograd_function


_forward_ad = torch.autograd.forward_ad
_fwd_grad_enabled = torch._C._is_fwd_grad_enabled


def _carries_tangents(args):
    """Whether a tensor argument has a forward-mode tangent (``torch.autograd.forward_ad``,
    ``torch.func.jvp``) at the current dual level; none exists outside a ``dual_level``."""
    if _forward_ad._current_level < 0:
        return False
    return any(_forward_ad.unpack_dual(t).tangent is not None for a in args for t in symbolic._tensors(a))


def _refuse_forward_ad(op):
    raise NotImplementedError(
        f"uniop.{op._opname}: forward-mode AD (torch.func.jvp, jacfwd, torch.autograd.forward_ad) is not "
        "supported: the op has a backward op (reverse mode) and no forward-mode rule"
    )


def _load_cpp_kernels():
    """uniop's C++ CPU and Autograd kernels when built for this torch (``python -m
    uniop.torch.build_kernels``), else None: the Python kernels do the same work, 2-4 µs slower
    per call.
    ``UNIOP_TORCH_CPP_KERNELS=0`` picks the Python kernels on purpose."""
    if os.environ.get("UNIOP_TORCH_CPP_KERNELS") == "0":
        return None
    from . import build_kernels

    if not build_kernels.built_for_this_torch():
        warnings.warn(
            f"uniop.torch: the C++ kernels are not built for torch {torch.__version__} from the current source; "
            "using the Python ones (2-4 µs slower per call). Build them: python -m uniop.torch.build_kernels",
            stacklevel=3,
        )
        return None
    try:
        from . import _kernels

        _kernels.init(_uniop._native._torch_abi())
        _uniop._native._use_torch_tensors(torch.Tensor, _kernels.tensor_io())
    except (ImportError, RuntimeError) as e:  # a broken build or another uniop ABI: say so, keep working
        warnings.warn(f"uniop.torch: the C++ kernels did not load ({e}); using the Python ones", stacklevel=3)
        return None
    return _kernels


_cpp_kernels = _load_cpp_kernels()


def cpp_kernels_loaded():
    """Whether ``torch.ops.uniop`` ops run uniop's C++ CPU and Autograd kernels."""
    return _cpp_kernels is not None


class _CallState:
    """What ``autograd.Function.apply`` (which passes positional arguments only) does not carry
    to ``forward``, passed as its last argument: the call's keyword-only arguments, whether
    forward-mode AD was on, and how list arguments were flattened.

    Why forward mode's state: ``apply`` runs ``forward`` with forward AD off, and ``forward`` calls the op
    again, on through the torch.func levels below this one. A jvp level there (``hessian``,
    ``jacfwd(jacrev(f))``) would then see no tangent, and get zeros without a word, instead of
    refusing the forward-mode call."""

    __slots__ = ("kwargs", "fwd_grad_enabled", "lengths")

    def __init__(self, kwargs):
        self.kwargs = kwargs
        self.fwd_grad_enabled = _fwd_grad_enabled()
        self.lengths = None  # per argument, a list argument's item count (see `_flatten_lists`)


def _flatten_lists(args, lists):
    """`args` with the items of the arguments at positions `lists` (lists of tensors) in their
    place, and per argument its item count (None for any other argument): an
    ``autograd.Function`` differentiates the tensors it is given, not those inside a list."""
    flat, lengths = [], []
    for i, a in enumerate(args):
        if i in lists:
            flat.extend(a)
            lengths.append(len(a))
        else:
            flat.append(a)
            lengths.append(None)
    return flat, lengths


def _unflatten_lists(flat, lengths):
    """The inverse of `_flatten_lists`; `flat` may be gradients (None for a list item: none)."""
    args, k = [], 0
    for n in lengths:
        if n is None:
            args.append(flat[k])
            k += 1
        else:
            args.append(list(flat[k : k + n]))
            k += n
    return args


def _autograd_kernel(op, setup_context, backward, lists):
    """``op``'s generic Autograd kernel, ``kernel(keyset, *args, **kwargs)``: a call with no
    gradient to record goes below autograd; one with a gradient to record goes through a
    single-level ``autograd.Function`` that records it at the autograd level the dispatcher is at.
    The items of list arguments (positions `lists`) are passed to it one by one, so each is an
    input it differentiates; ``backward`` gets and gives gradients per argument (a list for a
    list argument), with ``ctx.arg_needs_grad`` per argument as well.

    Why not torch.library.register_autograd's kernel: it applies a plain ``autograd.Function``,
    which under torch.func's transforms (``grad``, ``vjp``, ``jacrev``, ``vmap`` of a gradient)
    asks to be run as a transform of its own, one level above the dispatcher; from inside an
    Autograd kernel that fails. The dispatcher has already peeled the transforms' levels off down
    to this one, so recording the call here is all a transform needs — as functorch itself
    records a Function's backward. ``forward`` calls the op again: ``apply`` runs it with grad mode
    off, so that call goes below autograd, and on through the levels under this one.
    """
    schema = op._schema

    class Function(torch.autograd.function._SingleLevelFunction):
        @staticmethod
        def forward(*args):
            *args, state = args
            if state.lengths is not None:
                args = _unflatten_lists(args, state.lengths)
            with _forward_ad._set_fwd_grad_enabled(state.fwd_grad_enabled):
                return op(*args, **state.kwargs)

        @staticmethod
        def setup_context(ctx, inputs, output):
            *args, state = inputs
            ctx.lengths = state.lengths
            if state.lengths is not None:
                args = _unflatten_lists(args, state.lengths)
            ctx.passed = len(args)
            # The dispatcher drops arguments equal to their defaults; the backward may need them, and
            # keyword-only ones (add's alpha) too: every argument, in the schema's order.
            positional, keyword = torch._library.utils.fill_defaults(schema, args, state.kwargs)
            setup_context(ctx, (*positional, *keyword.values()), output)

        @staticmethod
        def backward(ctx, *grads):
            needs = ctx.needs_input_grad[:-1]
            if ctx.lengths is None:
                ctx.arg_needs_grad = needs
                return (*backward(ctx, *grads), None)
            per_arg = _unflatten_lists(needs, ctx.lengths)
            ctx.arg_needs_grad = [any(n) if isinstance(n, list) else n for n in per_arg]
            grads_in = backward(ctx, *grads)
            flat = []
            for g, n, item_needs in zip(grads_in, ctx.lengths, per_arg):
                if n is None:
                    flat.append(g)
                else:  # a list argument's gradient: one per item that needs one
                    flat.extend(gi if need else None for gi, need in zip(g or [None] * n, item_needs))
            return (*flat, None)

    def kernel(keyset, *args, **kwargs):
        if _carries_tangents(args):
            _refuse_forward_ad(op)
        if _grad_enabled() and _any_requires_grad(*args):
            state = _CallState(kwargs)
            if lists:
                args, state.lengths = _flatten_lists(args, lists)
            with _single_level_functions_allowed():
                return Function.apply(*args, state)
        with torch._C._AutoDispatchBelowAutograd():
            return op.redispatch(keyset & torch._C._after_autograd_keyset, *args, **kwargs)

    return kernel


def _register_autograd(native, backward_native):
    wiring = _BackwardWiring(native, backward_native)
    backward_op = getattr(torch.ops.uniop, backward_native.name).default

    def setup_context(ctx, inputs, output):
        # `inputs` has every argument, defaults filled in; `ctx.passed` counts those the caller gave.
        outs = (output,) if len(wiring.returns) == 1 else tuple(output)
        tensors, plain, saved_lengths = [], {}, []
        for i in wiring.saved_args:
            if isinstance(inputs[i], torch.Tensor):
                tensors.append(inputs[i])
                saved_lengths.append(None)
            elif i in wiring.lists:  # saved item by item (keeps autograd's in-place checks)
                tensors.extend(inputs[i])
                saved_lengths.append(len(inputs[i]))
            else:
                plain[i] = inputs[i]
        ctx.tensor_args = [i for i in wiring.saved_args if i not in plain]
        ctx.saved_lengths = saved_lengths
        tensors.extend(outs[i] for i in wiring.saved_outs)
        ctx.save_for_backward(*tensors)
        ctx.plain = plain
        # Which arguments can take a gradient: tensors, and lists of them.
        ctx.is_tensor = [isinstance(x, torch.Tensor) or i in wiring.lists for i, x in enumerate(inputs)]
        for i, o in enumerate(outs):
            if i not in wiring.differentiable:
                ctx.mark_non_differentiable(o)

    def backward(ctx, *grads):
        saved = list(ctx.saved_tensors)
        n_args = sum(1 if n is None else n for n in ctx.saved_lengths)
        args_by_index = dict(zip(ctx.tensor_args, _unflatten_lists(saved[:n_args], ctx.saved_lengths)))
        args_by_index.update(ctx.plain)
        outs = dict(zip(wiring.saved_outs, saved[n_args:]))
        bwd_args = []
        for j, (kind, i) in enumerate(wiring.sources):
            if kind == "grad":
                bwd_args.append(grads[i])
            elif kind == "arg":
                bwd_args.append(args_by_index[i])
            elif kind == "out":
                bwd_args.append(outs[i])
            elif kind == "needs":
                bwd_args.append(i < len(ctx.arg_needs_grad) and ctx.arg_needs_grad[i] and ctx.is_tensor[i])
            else:  # its default, as a later argument may follow (linear_gelu_mul_backward's form)
                bwd_args.append(wiring.defaults[j])
        result = backward_op(*bwd_args)
        result = (result,) if isinstance(result, torch.Tensor) or wiring.backward_returns_list else result
        # One gradient per argument the caller passed; optional tensors that were None or left
        # out (linear's bias) get none.
        passed = ctx.passed
        for i, message in wiring.no_grad_message.items():
            if i < passed and ctx.arg_needs_grad[i] and ctx.is_tensor[i]:
                raise RuntimeError(message)
        grads_in = [None] * passed
        for g, i in zip(result, wiring.grad_of):
            if i < passed and ctx.arg_needs_grad[i] and ctx.is_tensor[i]:
                grads_in[i] = g
        return tuple(grads_in)

    op = getattr(torch.ops.uniop, native.name).default
    # `_autograd_kernel`'s generic kernel, plus a fast path in front of it: a call whose tensors are
    # plain CPU tensors none of which needs a gradient or carries a tangent goes straight to the
    # uniop kernel — exactly where the generic kernel's redispatch below autograd would land, minus
    # a second trip through the dispatcher (8.2 -> 5.5 µs for rms_norm on a tiny tensor). Any other
    # dispatch key set (fake tensors, modes, functionalization, vmap, torch.func) takes the generic
    # route.
    generic = _autograd_kernel(op, setup_context, backward, wiring.lists)

    if _cpp_kernels is not None:
        # The same fast path in C++ (csrc/kernels.cpp's AutogradKernel): no Python at all for it; and a
        # call on plain CPU tensors that needs a gradient records a C++ graph node (UniopFunction)
        # wired like `backward` below, ~4x faster than this module's autograd.Function.
        _cpp_kernels.register_autograd(NAMESPACE, native.name, generic, wiring.as_numbers())
        return

    def kernel(keyset, *args, **kwargs):
        if keyset == _PLAIN_CPU and not (_grad_enabled() and _any_requires_grad(*args)) and not _carries_tangents(args):
            return native(*args, **kwargs)
        return generic(keyset, *args, **kwargs)

    _lib.impl(native.name, kernel, "Autograd", with_keyset=True)


def _no_backward_kernel(native):
    """The Autograd kernel of an op without a backward op on the Python route — what torch's
    not-implemented kernel (``register_no_backward`` in csrc/kernels.cpp) does on the C++ one. The
    call runs below autograd; when a gradient could flow through it, its floating outputs get a
    node that raises "derivative for uniop::<op> is not implemented" once a gradient reaches it,
    and a forward-mode tangent raises at once. torch's default fallback for a kernel-less op only
    warns, and lets the gradient through as none or zero.

    The node is a single-level ``autograd.Function`` (see ``_autograd_kernel``) applied to the
    call's arguments flattened, so the tensors of a ``Tensor[]`` argument (cat's) join the graph
    as well."""
    op = getattr(torch.ops.uniop, native.name).default
    not_implemented = f"derivative for {op._schema.name} is not implemented"

    class Function(torch.autograd.function._SingleLevelFunction):
        @staticmethod
        def forward(spec, *flat):
            args, kwargs = _pytree.tree_unflatten(flat, spec)
            out = op(*args, **kwargs)
            # autograd tracks the tensors of a returned tuple, not of a list (cat_backward's return).
            return tuple(out) if native.returns_list else out

        @staticmethod
        def setup_context(ctx, inputs, output):
            pass

        @staticmethod
        def backward(ctx, *grads):
            raise RuntimeError(not_implemented)

    def kernel(keyset, *args, **kwargs):
        values = (*args, *kwargs.values())
        if _carries_tangents(values):
            raise NotImplementedError(f"Trying to use forward AD with {op._schema.name} that does not support it")
        if _grad_enabled() and _any_requires_grad(*values):  # (it looks into lists too)
            flat, spec = _pytree.tree_flatten((args, kwargs))
            with _single_level_functions_allowed():
                out = Function.apply(spec, *flat)
            return list(out) if native.returns_list else out
        if keyset == _PLAIN_CPU:
            return native(*args, **kwargs)  # where the redispatch would land, one dispatcher trip sooner
        with torch._C._AutoDispatchBelowAutograd():
            return op.redispatch(keyset & torch._C._after_autograd_keyset, *args, **kwargs)

    return kernel


def _broadcast_vmap_rule(native, cores):
    """The torch.func.vmap rule of an op broadcasting its operands: elementwise (``native.elementwise``:
    every tensor argument a core of rank 0) or mapping blocks over broadcast batch dims
    (``native.core_dims``: matmul's ``[.., M, K]`` and ``[.., K, N]``, cores of rank 2; rope's rows
    and its tables' rows, rank 1). ``cores`` gives each broadcast argument's core rank by position.
    One call on those operands with their batch dim moved to the front, where torch's fallback calls
    the op once per sample. Each operand's dims in front of its core are padded with size-1 dims to
    the operands' common count, so broadcasting lines the samples up, and one without a batch dim is
    expanded to the batch (a stride-0 view), so a gradient summed back to an operand (``d<arg>``)
    keeps one sum per sample. One sample's call is inferred first: it raises the op's own error
    where a sample's call would (a sample smaller than its core, a broadcast the op refuses that the
    padding would let through: rope's tables with more dims than x), and gives each return's
    per-sample shape, which the batched return takes. Where another tensor argument carries the
    batch, or the op returns the gradient of a tensor argument it does not broadcast (summed over
    the whole batch in one call), the op runs once per sample, as torch's fallback would."""
    names = [a["name"] for a in native.args]
    shared_sums = [r for r in native.returns
                   if r.startswith("d") and r[1:] in names and names.index(r[1:]) not in cores]
    declined = _declined_returns(native)
    returns = len(native.returns)
    op = getattr(torch.ops.uniop, native.name).default

    def rule(info, in_dims, *args, **kwargs):
        size = info.batch_size
        tensors = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        if size == 0 or shared_sums or any(in_dims[i] is not None for i in tensors if i not in cores):
            return _per_sample(op, size, in_dims, args, kwargs, returns)
        sample = [_sample_of(a, d, lambda t, d: t.select(d, 0)) for a, d in zip(args, in_dims)]
        shapes = [shape for shape, _ in symbolic.infer(native, sample, kwargs)]
        batch_rank = max((sample[i].dim() - cores[i] for i in tensors if i in cores), default=0)
        batched = list(args)
        for i in tensors:
            if i in cores:
                a, d = args[i], in_dims[i]
                x = a.movedim(d, 0) if d is not None else a.expand(size, *a.shape)
                batched[i] = x[(slice(None),) + (None,) * (batch_rank + cores[i] + 1 - x.dim())]
        out = op(*batched, **kwargs)
        outs = (out,) if returns == 1 else out
        left_out = declined(args, kwargs)
        # The placeholder of a gradient not asked for has no batch dim.
        results = [o if k in left_out else o.reshape(size, *shape) for k, (o, shape) in enumerate(zip(outs, shapes))]
        out_dims = [None if k in left_out else 0 for k in range(returns)]
        if returns == 1:
            return results[0], out_dims[0]
        return tuple(results), tuple(out_dims)

    return rule


def _leading_batch_vmap_rule(native):
    """The torch.func.vmap rule of an op working row by row along the leading dims of some tensor
    arguments (``native.leading_batch_args``; a list's items each, as cat's): one call with their
    batch dims moved to the front (an unbatched one expanded to the batch, a stride-0 view), a
    non-negative ``dim`` shifted past the new dim and ``batch_dims`` (the leading dims whose sums, a
    parameter's gradient or a mean loss, stay apart: one per sample) raised by one; every return (a
    list's items) carries the batch in front but the empty placeholder of a gradient not asked for
    (``needs_dx`` false). A gradient of a shared tensor argument (a sum over rows: attention_backward's
    ``dsinks``) comes per sample through ``batch_dims``, which the registry requires of an op returning
    one. Where another tensor argument carries the batch (a batched weight), the op runs once per
    sample, as torch's fallback would."""
    names, row_names = [a["name"] for a in native.args], set(native.leading_batch_args)
    rows = {names.index(n) for n in row_names}
    defaults = {a["name"]: a.get("default") for a in native.args}
    returns = len(native.returns)
    declined = _declined_returns(native)
    op = getattr(torch.ops.uniop, native.name).default

    def adjust(call, kwargs, name, change):
        """``change`` applied to attribute ``name``, passed positionally, by keyword or left at its default."""
        if name not in names:
            return
        at = names.index(name)
        if at < len(call):
            call[at] = change(call[at])
        else:
            kwargs[name] = change(kwargs.get(name, defaults[name]))

    def to_front(a, d, size):
        """Row argument ``a`` (a tensor, or a list of them: ``d`` then lists their dims) with its batch
        dim moved to the front, or expanded to the batch where it has none (shared)."""
        if isinstance(a, (list, tuple)):
            return [to_front(t, dt, size) for t, dt in zip(a, d if isinstance(d, (list, tuple)) else [d] * len(a))]
        if not isinstance(a, torch.Tensor):
            return a  # an optional argument not given
        return a.movedim(d, 0) if d is not None else a.expand(size, *a.shape)

    def batched(d):
        return any(batched(x) for x in d) if isinstance(d, (list, tuple)) else d is not None

    def rule(info, in_dims, *args, **kwargs):
        size = info.batch_size
        if any(batched(d) for i, d in enumerate(in_dims) if i not in rows):
            return _per_sample(op, size, in_dims, args, kwargs, returns)
        call = [to_front(a, in_dims[i], size) if i in rows else a for i, a in enumerate(args)]
        # Keyword arguments are never batched: shared.
        kwargs = {k: to_front(v, None, size) if k in row_names else v for k, v in kwargs.items()}
        adjust(call, kwargs, "dim", lambda dim: dim + 1 if dim >= 0 else dim)
        adjust(call, kwargs, "batch_dims", lambda count: count + 1)
        out = op(*call, **kwargs)
        if native.returns_list:
            return out, [0] * len(out)
        left_out = declined(args, kwargs)
        out_dims = tuple(None if k in left_out else 0 for k in range(returns))
        return out, out_dims[0] if returns == 1 else out_dims

    return rule


def _declined_returns(native):
    """For a vmap rule: a function of a call's arguments giving the positions of the returns it
    declined — a gradient whose ``needs_d<arg>`` flag (``bool``, passed or defaulted) is false, or
    whose optional tensor argument was not given, which the op returns as an empty placeholder
    with no batch dim."""
    names = [a["name"] for a in native.args]
    flags = [(k, names.index(f"needs_{r}")) for k, r in enumerate(native.returns) if f"needs_{r}" in names]
    defaults = {at: native.args[at].get("default") for _, at in flags}
    optional = [(k, names.index(r[1:])) for k, r in enumerate(native.returns) if r.startswith("d") and r[1:] in names
                and native.args[names.index(r[1:])]["tensor"] and native.args[names.index(r[1:])]["optional"]]

    def value(args, kwargs, at, default=None):
        return args[at] if at < len(args) else kwargs.get(names[at], default)

    def declined(args, kwargs):
        return {k for k, at in flags if not value(args, kwargs, at, defaults[at])} | {
            k for k, at in optional if not isinstance(value(args, kwargs, at), torch.Tensor)
        }

    return declined


def _per_sample(op, size, in_dims, args, kwargs, returns):
    """``op`` called once per sample of a vmap batch of ``size``, its returns stacked in front. An
    empty batch has no sample to call: one call on zeros of a sample's shape gives the returns'."""
    if size == 0:
        zeros = [_sample_of(a, d, lambda t, d: t.new_zeros([n for k, n in enumerate(t.shape) if k != d % t.dim()]))
                 for a, d in zip(args, in_dims)]
        outs = op(*zeros, **kwargs)
        empty = [o.new_empty((0, *o.shape)) for o in ((outs,) if returns == 1 else outs)]
        return (empty[0], 0) if returns == 1 else (tuple(empty), (0,) * returns)
    samples = [[_sample_of(a, d, lambda t, d: t.select(d, b)) for a, d in zip(args, in_dims)] for b in range(size)]
    outs = [op(*sample, **kwargs) for sample in samples]
    if returns == 1:
        return torch.stack(outs), 0
    return tuple(torch.stack(o) for o in zip(*outs)), (0,) * returns


def _sample_of(a, d, take):
    """Argument ``a`` of a vmapped call, batched along ``d``, with ``take(tensor, d)`` applied where it
    is batched: a list's items one by one (``d`` then a list too: cat's tensors; a list attribute's,
    permute's ``dims``, all None)."""
    if isinstance(d, (list, tuple)):
        return [_sample_of(x, dx, take) for x, dx in zip(a, d)]
    return take(a, d) if d is not None else a


def _register_vmap(native, rule):
    """``rule`` as the op's FuncTorchBatched kernel, as ``torch.library.register_vmap`` installs one,
    without its pytree passes over the arguments and the returns (which it makes to keep the
    identity of a return that is an argument: a uniop op's returns never are). On a small batch
    those passes cost more than the rule; here an argument is a tensor, a list (its items each) or
    a plain value, and a return a tensor, or a tuple or list of them."""
    op = getattr(torch.ops.uniop, native.name).default
    batched_key = torch._C.DispatchKeySet(torch._C.DispatchKey.FuncTorchBatched)

    def unwrap(a, level):
        if isinstance(a, torch.Tensor):
            return _unwrap_batched(a, level)
        if isinstance(a, list):
            pairs = [unwrap(item, level) for item in a]
            return [value for value, _ in pairs], [d for _, d in pairs]
        return a, None

    def batched(d):
        return any(batched(x) for x in d) if isinstance(d, list) else d is not None

    def kernel(_keyset, *args, **kwargs):
        interpreter = _current_functorch_interpreter()
        level = interpreter.level()
        pairs = [unwrap(a, level) for a in args]
        in_dims = tuple(d for _, d in pairs)
        with torch._C._ExcludeDispatchKeyGuard(batched_key):
            if not any(batched(d) for d in in_dims):  # batched at another level only: this one skips the call
                return op(*args, **kwargs)
            info = _VmapInfo(batch_size=interpreter.batch_size(), randomness=interpreter.randomness())
            out, out_dims = rule(info, in_dims, *(value for value, _ in pairs), **kwargs)
        if isinstance(out, torch.Tensor):
            return out if out_dims is None else _add_batch_dim(out, out_dims, level)
        wrapped = [o if d is None else _add_batch_dim(o, d, level) for o, d in zip(out, out_dims)]
        return wrapped if isinstance(out, list) else tuple(wrapped)

    _lib.impl(native.name, kernel, "FuncTorchBatched", with_keyset=True)


def _register_autocast(native):
    op = getattr(torch.ops.uniop, native.name).default
    lower = native.autocast == "lower"
    keyset = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)

    def cast(x, dtype):
        return x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x

    def kernel(_keyset, *args, **kwargs):
        dtype = torch.get_autocast_dtype("cpu") if lower else torch.float32
        with torch._C._ExcludeDispatchKeyGuard(keyset):
            return op(*[cast(a, dtype) for a in args], **{k: cast(v, dtype) for k, v in kwargs.items()})

    _lib.impl(native.name, kernel, "AutocastCPU", with_keyset=True)


def _register(natives):
    natives = [n for n in natives if n.name not in _registered]
    for native in natives:
        _lib.define(native.schema)
        cpp = _cpp_kernels is not None and _cpp_kernels.register_cpu(NAMESPACE, native.name, native._torch_handle())
        if not cpp:
            _lib.impl(native.name, native, "CPU")  # the op object itself: no Python frame between
        torch.library.register_fake(f"{NAMESPACE}::{native.name}", _fake_kernel(native), lib=_lib)
        _registered[native.name] = native
    for native in natives:
        if native.backward:
            _register_autograd(native, _uniop.op(native.backward))
        elif _cpp_kernels is not None:
            _cpp_kernels.register_no_backward(NAMESPACE, native.name)
        else:
            _lib.impl(native.name, _no_backward_kernel(native), "Autograd", with_keyset=True)
        if native.autocast:
            _register_autocast(native)
        if native.elementwise or native.core_dims:
            names = [a["name"] for a in native.args]
            cores = {i: 0 for i in range(len(names))} if native.elementwise else {
                names.index(name): rank for name, rank in native.core_dims
            }
            _register_vmap(native, _broadcast_vmap_rule(native, cores))
        elif native.leading_batch_args:
            _register_vmap(native, _leading_batch_vmap_rule(native))


def ops():
    """The registered ``torch.ops.uniop`` overload packets, by name."""
    return {name: getattr(torch.ops.uniop, name) for name in _registered}


_register(_uniop._ops.values())
_uniop._share_torch_threads()
_uniop._on_new_ops.append(_register)
