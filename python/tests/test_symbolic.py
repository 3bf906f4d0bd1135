"""uniop.torch.symbolic's fit of output sizes over symbolic input sizes, on stand-in ops whose
size rules are known: what it keeps symbolic must hold at every size, what it cannot fit it
specializes (plain ints, as before). The ops' own fake kernels are covered through
torch.compile and torch.export in test_models.py and opcheck's dynamic-shape checks."""

import math

import pytest
import sympy
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

import uniop
from uniop.torch import symbolic


class Rule:
    """A stand-in op whose ``infer``, as the Rust one does, reads sizes as ints: float32 outputs of
    the shapes ``rule`` gives for the inputs' shapes (raising where the op would refuse them)."""

    def __init__(self, rule):
        self.rule = rule

    def infer(self, *tensors):
        return [(shape, "float32") for shape in self.rule(*[[int(d) for d in t.shape] for t in tensors])]


def symbolic_inputs(*shapes):
    """Fake tensors whose every size is a symbol of its own."""
    mode = FakeTensorMode(shape_env=ShapeEnv())
    context = lambda n: StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC] * n)  # noqa: E731
    return [mode.from_tensor(torch.empty(s), symbolic_context=context(len(s))) for s in shapes]


def fitted(rule, *shapes):
    tensors = symbolic_inputs(*shapes)
    return tensors, symbolic.infer(Rule(rule), tensors, {})


def holds_everywhere(rule, tensors, outputs, trials=20):
    """The fitted sizes, at random values of the inputs' symbols, equal ``rule``'s there (inputs
    the rule refuses skipped)."""
    symbols = sorted({s for t in tensors for d in t.shape for s in d.node.expr.free_symbols}, key=str)
    rng = torch.Generator().manual_seed(0)
    checked = 0
    for _ in range(trials):
        at = {s: int(torch.randint(2, 300, (1,), generator=rng)) for s in symbols}
        value = lambda d: int(d.node.expr.xreplace({s: sympy.Integer(v) for s, v in at.items()}))  # noqa: E731
        try:
            want = rule(*[[value(d) for d in t.shape] for t in tensors])
        except ValueError:
            continue
        got = [[value(d) if isinstance(d, torch.SymInt) else d for d in shape] for shape, _ in outputs]
        assert got == want, at
        checked += 1
    assert checked, "no trial size the rule takes"


def is_symbolic(outputs):
    return [[isinstance(d, torch.SymInt) for d in shape] for shape, _ in outputs]


def even_last(x):
    if x[-1] % 2:
        raise ValueError("odd")
    return [[*x[:-1], x[-1] // 2]]


def test_sizes_kept_halved_and_added_stay_symbolic_and_hold_at_every_size():
    for rule, shapes, symbolic_sizes in [
        (lambda x: [x, [*x[:-1], 1]], [(3, 6, 8)], [[True] * 3, [True, True, False]]),  # rms_norm: y, rstd
        (even_last, [(4, 10)], [[True, True]]),  # swiglu
        (lambda a, b: [[a[0], a[1] + b[1] + 3]], [(2, 5), (2, 7)], [[True, True]]),
    ]:
        tensors, outputs = fitted(rule, *shapes)
        assert is_symbolic(outputs) == symbolic_sizes, outputs
        holds_everywhere(rule, tensors, outputs)


def test_a_size_the_op_takes_only_at_its_value_is_specialized_alone():
    """x's width must match a static 8 (a weight's): that size becomes 8, the rows stay symbols."""

    def rule(x):
        if x[1] != 8:
            raise ValueError("width")
        return [x]

    tensors, outputs = fitted(rule, (5, 8))
    assert is_symbolic(outputs) == [[True, False]] and outputs[0][0][1] == 8
    holds_everywhere(rule, tensors, outputs)


def test_sizes_no_affine_fit_holds_for_are_specialized():
    """A product of two symbols and a count rounded up (at a multiple of 32, where it agrees with
    a floor) fall back to the ints infer gives: never a symbolic size that is wrong elsewhere."""
    for rule, shapes in [
        (lambda x: [[x[0] * x[1]]], [(6, 10)]),
        (lambda w: [[math.ceil(w[0] / 32), w[1]]], [(64, 16)]),
        (lambda w: [[math.ceil(w[0] / 32), w[1]]], [(65, 16)]),
    ]:
        _, outputs = fitted(rule, *shapes)
        assert not any(any(row) for row in is_symbolic(outputs)), (shapes, outputs)


@pytest.mark.parametrize("width", [7, 8])
def test_equal_sizes_the_op_ties_are_probed_together(width):
    """cat's inputs must agree in width; with each width a symbol of its own, they are doubled
    together (and guarded equal) instead of being specialized."""

    def rule(a, b):
        if a[1] != b[1]:
            raise ValueError("widths differ")
        return [[a[0] + b[0], a[1]]]

    tensors, outputs = fitted(rule, (3, width), (4, width))
    assert is_symbolic(outputs) == [[True, True]]
    holds_everywhere(rule, tensors, outputs)


def test_sizes_the_op_refuses_raise_its_error():
    """Inputs the op refuses at their current sizes get the op's own error (uniop's UniopError for
    a real op), not a fit: the probes never hide a bad call."""

    def rule(x, w):
        if x[-1] != w[0]:
            raise ValueError("rms_norm: argument 'weight': expected a shape equal to trailing dims of x")
        return [x]

    with pytest.raises(ValueError, match="argument 'weight'"):
        fitted(rule, (3, 8), (5,))

    class Norm(torch.nn.Module):
        def forward(self, x, w):
            return torch.ops.uniop.rms_norm(x, w, 1e-6)[0]

    rows = torch.export.Dim("rows")
    with pytest.raises(uniop.UniopError, match="rms_norm: argument 'weight'"):
        torch.export.export(Norm(), (torch.randn(3, 8), torch.randn(5)), dynamic_shapes={"x": {0: rows}, "w": None})
