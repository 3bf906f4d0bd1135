"""Output sizes of a uniop op for tensors whose sizes are symbols (dynamic shapes).

Why this exists: a fake kernel asks the op's Rust ``infer`` for its output shapes, and ``infer``
computes with plain integers. Handing it a size that is a ``torch.SymInt`` turns the symbol into
its current value and makes torch guard on that value: ``torch.compile(dynamic=True)`` then
compiled the graph again for every new sequence length, and ``torch.export`` with a ``Dim``
refused the op ("your code specialized it to be a constant").

What it does, with no per-op code: ``infer`` runs on the sizes the symbols have now, then with one
symbol at a time at two and three times its value and one above and below it, then with all of
them doubled at once. Each output size is fitted as ``offset + Σ floor(a_s · s)``, with each slope
``a_s`` a whole number or one over a whole number (``swiglu`` halves its last dim, ``cat`` adds two sizes),
and must reproduce every run; it is then built from the symbols with SymInt arithmetic, so torch
carries it. All uniop ops' output sizes have that form except ``pack_weight``'s panel count (rows
over 32, rounded up: the runs one off a multiple tell it from a floor); for those, and for a symbol
the op takes only at its current value (x's last dim against a static weight), torch guards on
the value, as before: correct, but compiled again for each new size. Symbols of equal value that
the op takes only together (export gives each input's size a symbol of its own until it has seen
the op that ties them) are probed together, with a guard on their equality, as aten's checks add.

The checks ``infer`` makes on sizes that stay symbolic hold at the probed sizes, not as guards: a
later call with sizes the op refuses fails in the real kernel, with uniop's error. The probes run
while torch traces, never per call.
"""

from __future__ import annotations

from fractions import Fraction

import torch

_SCALES = (2, 3)  # a symbol's probe sizes, as multiples of its value: a slope and its check


class _Meta:
    """What ``infer`` reads from a tensor (``shape``, ``stride()``, ``dtype``), at chosen sizes."""

    __slots__ = ("shape", "_strides", "dtype")

    def __init__(self, shape, strides, dtype):
        self.shape, self._strides, self.dtype = shape, strides, dtype

    def stride(self):
        return self._strides


class _Unfit(Exception):
    """The sizes cannot be inferred symbolically; the caller specializes them."""


def _tensors(obj):
    """The tensors in one argument (a tensor, or a list of them for ``Tensor[]``)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors(item)


def _sizes(t):
    return (*t.shape, *t.stride())


def infer(native, args, kwargs):
    """``native.infer``'s ``[(shape, dtype_name), ...]``, with sizes of ``torch.SymInt`` where
    they follow the inputs' symbols."""
    values = [*args, *kwargs.values()]
    nodes = [d.node for a in values for t in _tensors(a) for d in _sizes(t) if isinstance(d, torch.SymInt)]
    if nodes and not any(isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)) for v in values):
        # (A symbolic attribute is left to infer, which reads attributes as numbers.)
        try:
            return _fitted(native, args, kwargs, nodes)
        except _Unfit:
            pass
    return native.infer(*args, **kwargs)


def _fitted(native, args, kwargs, nodes):
    """The fit described above, for the arguments whose sizes and strides hold the symbolic
    `nodes`; raises `_Unfit` where the sizes are left to be specialized."""
    shape_env = nodes[0].shape_env
    symbols = sorted({s for n in nodes for s in n.expr.free_symbols}, key=str)
    # Backed symbols' current values (renamed from var_to_val in torch 2.10); unbacked ones have none.
    known = getattr(shape_env, "backed_var_to_val", None)
    if known is None:
        known = shape_env.var_to_val
    if any(s not in known for s in symbols):
        raise _Unfit
    hint = {s: int(known[s]) for s in symbols}
    # Imported here, not with the module: sympy takes ~0.6 s to import and is needed only while
    # torch traces with symbolic sizes, by which time torch has imported it.
    import sympy

    def run(at):
        exact = {s: sympy.Integer(v) for s, v in at.items()}

        def concrete(d):
            if not isinstance(d, torch.SymInt):
                return d
            value = d.node.expr.xreplace(exact)
            if not value.is_number:
                raise _Unfit
            return int(value)

        def swap(a):
            if isinstance(a, torch.Tensor):
                return _Meta([concrete(d) for d in a.shape], [concrete(d) for d in a.stride()], a.dtype)
            if isinstance(a, (list, tuple)) and any(isinstance(i, torch.Tensor) for i in a):
                return [swap(i) for i in a]
            return a

        try:
            return native.infer(*[swap(a) for a in args], **{k: swap(v) for k, v in kwargs.items()})
        except Exception as e:  # a refused probe: the op relates sizes of different symbols
            raise _Unfit from e

    base = run(hint)
    structure = _structure(base)
    symint = {s: shape_env.create_symintnode(s, hint=hint[s]) for s in symbols}

    def runs_at(sizes):
        """`(sizes, outputs)` per entry, or None where the op refuses one or changes its outputs' ranks."""
        try:
            runs = [(at, run(at)) for at in sizes]
        except _Unfit:
            return None
        return runs if all(_structure(outs) == structure for _, outs in runs) else None

    def scaled(unit, k):
        return {**hint, **{s: k * hint[s] for s in unit}}

    # Units: symbols the outputs may follow, each probed alone, or with the symbols of the same
    # value where the op needs them equal (export gives each input's size a symbol of its own
    # until it has seen the ops that tie them: cat's inputs' widths).
    probes, units, doubled, left = [], [], {}, list(symbols)
    while left:
        s = left.pop(0)
        if hint[s] == 0:
            # Multiples of 0 probe nothing (a KV cache's length before its first update, which
            # sizes a sliding window's mask): torch guards on it as below.
            int(symint[s])
            continue
        peers = [r for r in left if hint[r] == hint[s]]
        for unit in ([s], [s, *peers]) if peers else ([s],):
            runs = runs_at([scaled(unit, k) for k in _SCALES])
            if runs:
                break
        if not runs:
            int(symint[s])  # the op takes this size only as it is: torch guards on its value
            continue
        for r in unit[1:]:
            left.remove(r)
            bool(symint[r] == symint[s])  # torch guards on their equality, as aten's checks do
        units.append(unit)
        doubled[s] = runs[0][1]
        probes += runs
        # Sizes off the multiples, where the op takes them: a count rounded up (pack_weight's
        # panels of 32) agrees with a fitted floor on every multiple of the current size.
        for by in (1, -1):
            probes += runs_at([{**hint, **{r: hint[r] + by for r in unit}}]) or []
    if len(units) > 1:  # all at once: sizes that multiply two symbols do not add up
        joint = runs_at([{**hint, **{s: 2 * hint[s] for unit in units for s in unit}}])
        if joint is None:
            raise _Unfit
        probes += joint

    # Per output size: its slope in each unit (from the run that doubled it alone; a unit's sizes
    # are equal, so its first symbol stands for it) and its offset; the size is
    # offset + Σ floor(a · s), for ints and SymInts alike.
    def fit(i, j):
        slopes = []
        for s in doubled:
            a = Fraction(doubled[s][i][0][j] - base[i][0][j], hint[s])
            if abs(a.numerator) != 1 and a.denominator != 1:
                raise _Unfit  # sizes grow as n·s or s/n; 2/65 is a rounded count seen at 65
            if a:
                slopes.append((s, a))
        return base[i][0][j] - _sum_floors(slopes, hint), slopes

    fits = [[fit(i, j) for j in range(rank)] for i, (rank, _) in enumerate(structure)]
    for at, outs in probes:
        for fitted, (shape, _) in zip(fits, outs):
            if any(offset + _sum_floors(slopes, at) != d for (offset, slopes), d in zip(fitted, shape)):
                raise _Unfit
    return [
        ([offset + _sum_floors(slopes, symint) for offset, slopes in fitted], dtype)
        for fitted, (_, dtype) in zip(fits, base)
    ]


def _structure(outputs):
    """Each output's rank and dtype: what sizes may not change."""
    return [(len(shape), dtype) for shape, dtype in outputs]


def _sum_floors(slopes, at):
    """Σ floor(a · s) over ``(s, a)`` with each ``s`` taking its value in ``at`` (int or SymInt)."""
    total = 0
    for s, a in slopes:
        total = total + (a.numerator * at[s]) // a.denominator
    return total
