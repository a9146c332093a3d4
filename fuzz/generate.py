"""Random programs: inputs of random shapes, dtypes and strides, then a chain of ops.

Generation runs every proposed op eagerly on the first call's input values, so it
knows each value's shape and dtype without a shape function per op, and eager PyTorch
is the judge of validity. A proposal that raises is dropped, except now and then
(``P_KEEP_RAISING``) when it is kept as the program's last op: the programs where eager
raises, on which dynajax must raise the same exception type.

Per value, the generator tracks what keeps the comparison meaningful:

- ``exact``: a floating value dynajax computes bit for bit as eager does (see
  ``fuzz.ops``); only exact values reach a discontinuous op (a comparison, a cast to
  an integer, argmax), so an ulp of accepted difference upstream never becomes a
  different integer.
- ``finite``: no inf or NaN can be in it; a float is cast to an integer only if exact
  and finite (the integer of NaN is undefined).
- ``root``: the value whose memory it shares (the input or op result a chain of views
  starts from), so an in-place write makes every alias inexact when it should.

Subnormal floats are flushed to zero by XLA (a documented difference): an op whose
result on the first call's values holds a subnormal is dropped.

Inputs come in every layout PyTorch hands a compiled graph (``fuzz.program.LAYOUTS``:
transposed, sliced with steps, expanded and broadcast with stride 0, overlapping,
channels_last, from a storage offset, ...; index inputs too), and zero-size and 0-dim
shapes among the others. A quarter of the programs are modules (``P_MODULE``): many of
their inputs are then the module's parameters and buffers, in those layouts too.
"""

from __future__ import annotations

import dataclasses
import random
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from fuzz import ops
from fuzz.program import (
    BROADCAST,
    BUFFER,
    CHANNELS_LAST,
    CONTIGUOUS,
    EXPANDED,
    FLOAT_DTYPES,
    INPUT,
    NORMAL,
    OFFSET,
    OUT_BASE,
    OVERLAPPING,
    PARAMETER,
    PERMUTED,
    SLICED,
    STEPPED,
    TRANSPOSED,
    UNIQUE,
    OpRecord,
    Program,
    TensorInput,
    compact,
    layout_fits,
    make_input,
    name,
)

P_KEEP_RAISING = 0.1  # how often a proposal that raises is kept as the last op
P_GRAD = 0.3  # how often a program compares gradients too
P_MODULE = 0.25  # how often a program is a module (some inputs its state)
P_STATE = 0.6  # how often an input of a module program is its parameter or buffer
MAX_NUMEL = 4096  # results larger than this are dropped (keeps programs fast)
MAX_INPUTS = 16  # (the fused encoder layer brings twelve weights)

# How often an input gets each layout (of those its shape can have: ``layout_fits``).
_LAYOUT_WEIGHTS = {
    CONTIGUOUS: 0.5,
    TRANSPOSED: 0.12,
    SLICED: 0.08,
    EXPANDED: 0.05,
    BROADCAST: 0.04,
    OVERLAPPING: 0.04,
    CHANNELS_LAST: 0.3,  # (4-D only)
    OFFSET: 0.06,
    PERMUTED: 0.05,
    STEPPED: 0.04,
}

_DTYPE_WEIGHTS = {
    "float32": 0.38,
    "float64": 0.1,
    "bfloat16": 0.12,
    "float16": 0.12,
    "int64": 0.12,
    "int32": 0.07,
    "bool": 0.09,
}
_SIZE_WEIGHTS = {0: 0.03, 1: 0.2, 2: 0.2, 3: 0.2, 4: 0.15, 5: 0.1, 6: 0.07, 7: 0.05}
_NDIM_WEIGHTS = {0: 0.08, 1: 0.2, 2: 0.34, 3: 0.26, 4: 0.12}


@dataclasses.dataclass
class ValueInfo:
    """What the generator knows of a value beyond its tensor (module docstring)."""

    exact: bool
    finite: bool
    root: int


class GenState:
    """The program being generated, and its values on the first call's inputs.

    The op gens of ``fuzz.ops`` read values through it (``pick``, ``shape``, ``dtype``)
    and add inputs (``new_input``); ``propose`` runs a proposal and keeps it or not.
    """

    out_base = OUT_BASE
    rng: random.Random
    grad: bool

    def __init__(self, rng: random.Random, grad: bool, module: bool = False) -> None:
        self.rng = rng
        self.grad = grad
        self.module = module
        self.inputs: list[TensorInput] = []
        self.ops: list[OpRecord] = []
        self.namespace: dict[str, Any] = {"torch": torch, "F": F}
        self.info: dict[int, ValueInfo] = {}
        self.order: list[int] = []
        self.raised = False
        self._next_out = OUT_BASE

    # Reading values -----------------------------------------------------------------

    def tensor(self, v: int) -> torch.Tensor:
        """Value ``v`` on the first call's inputs."""
        t: torch.Tensor = self.namespace[name(v)]
        return t

    def shape(self, v: int) -> tuple[int, ...]:
        return tuple(self.tensor(v).shape)

    def ndim(self, v: int) -> int:
        return self.tensor(v).dim()

    def dtype(self, v: int) -> str:
        return str(self.tensor(v).dtype).removeprefix("torch.")

    def is_float(self, v: int) -> bool:
        return self.tensor(v).is_floating_point()

    def exact(self, v: int) -> bool:
        return self.info[v].exact or not self.is_float(v)

    def finite(self, v: int) -> bool:
        return self.info[v].finite or not self.is_float(v)

    def root(self, v: int) -> int:
        return self.info[v].root

    def pick(self, pred: Callable[[int], bool] | None = None) -> int | None:
        """A random value satisfying ``pred``; the newest one half the time, so that
        programs are chains rather than fans of ops on the inputs."""
        candidates = [v for v in self.order if pred is None or pred(v)]
        if not candidates:
            return None
        if self.rng.random() < 0.5:
            return candidates[-1]
        return self.rng.choice(candidates)

    def random_dtype(self) -> str:
        return self.rng.choices(list(_DTYPE_WEIGHTS), list(_DTYPE_WEIGHTS.values()))[0]

    # Adding inputs and ops ----------------------------------------------------------

    def new_input(
        self,
        shape: tuple[int, ...],
        dtype: str,
        *,
        kind: str = NORMAL,
        high: int = 0,
        requires_grad: bool | None = None,
        layout: str | None = None,
        scale: float | None = None,
        bad: bool = False,
        specials: bool | None = None,
    ) -> int:
        """Adds an input of ``shape`` and ``dtype`` (a random layout, unless ``layout``
        is given, and special values for normal ones; in a module program, now and then
        the module's parameter or buffer) and returns its value id."""
        rng = self.rng
        if layout is None:
            layout = CONTIGUOUS if kind == UNIQUE else random_layout(rng, shape)
        floating = dtype in FLOAT_DTYPES and kind == NORMAL
        if requires_grad is None:
            requires_grad = self.grad and floating and rng.random() < 0.6
        role = INPUT
        if self.module and rng.random() < P_STATE:
            role = PARAMETER if floating and rng.random() < 0.7 else BUFFER
        if scale is None:
            scale = rng.choices([2.0, 100.0, 0.05], [0.85, 0.08, 0.07])[0] if floating else 2.0
        spec = TensorInput(
            shape=tuple(shape),
            dtype=dtype,
            seed=rng.getrandbits(31),
            layout=layout,
            kind=kind,
            high=high,
            specials=floating and rng.random() < 0.1 and specials is not False,
            requires_grad=requires_grad and dtype in FLOAT_DTYPES and role != BUFFER,
            scale=scale,
            bad=bad,
            role=role,
        )
        vid = len(self.inputs)
        value = make_input(spec)  # (first: a layout that does not fit raises before it is added)
        self.inputs.append(spec)
        self.namespace[name(vid)] = value
        self.info[vid] = ValueInfo(exact=True, finite=not spec.specials, root=vid)
        self.order.append(vid)
        return vid

    def mark(self) -> int:
        """A point to roll the inputs back to (``rollback``) if a proposal is dropped."""
        return len(self.inputs)

    def rollback(self, mark: int) -> None:
        """Removes the inputs added since ``mark``."""
        while len(self.inputs) > mark:
            vid = len(self.inputs) - 1
            self.inputs.pop()
            del self.namespace[name(vid)], self.info[vid]
            self.order.remove(vid)

    def propose(self, kind: ops.OpKind, args: list[int], params: dict[str, Any]) -> bool:
        """Runs the op eagerly; keeps it if it runs and its result is usable, or (now and
        then) if it raises, as the last op. Returns whether it was kept."""
        floats = [a for a in args if self.is_float(a)]
        if kind.disc and not all(self.exact(a) for a in floats):
            return False
        if kind.signed and not all(self.finite(a) for a in floats):
            return False
        out = None if kind.inplace else self._next_out
        rec = OpRecord(kind.name, tuple(args), tuple(sorted(params.items())), out)
        line = ops.render(rec)
        try:
            exec(line, self.namespace)
        except Exception:
            # An index out of range (a bad index input): eager's value check, which
            # dynajax must make too; kept always. Any other error now and then.
            bad = any(a < OUT_BASE and self.inputs[a].bad for a in args)
            if bad or self.rng.random() < P_KEEP_RAISING:
                self.ops.append(rec)
                self.raised = True
                return True
            return False
        exact = kind.exact and all(self.exact(a) for a in floats)
        finite = not kind.nonfinite and all(self.finite(a) for a in floats)
        if kind.writes:  # it wrote args[0] too: its aliases are no longer exact
            target = self.root(args[0])
            for v in self.order:
                if self.info[v].root == target:
                    self.info[v].exact = False
        if out is None:
            target = self.root(args[0])
            for v in self.order:
                if self.info[v].root == target:
                    self.info[v].exact &= exact
                    self.info[v].finite &= finite
        else:
            t = self.namespace.get(name(out))
            most = ops.MAX_LARGE if kind.large else MAX_NUMEL
            if not isinstance(t, torch.Tensor) or t.numel() > most or _subnormal(t):
                self.namespace.pop(name(out), None)
                return False
            root = self.root(args[0]) if kind.view and args else out
            self.info[out] = ValueInfo(exact=exact, finite=finite, root=root)
            self.order.append(out)
            self._next_out += 1
        self.ops.append(rec)
        return True


def _subnormal(t: torch.Tensor) -> bool:
    if not t.is_floating_point() or t.numel() == 0:
        return False
    a = t.detach().abs()
    return bool(((a > 0) & (a < torch.finfo(t.dtype).tiny)).any())


def _weighted(rng: random.Random, weights: dict[int, float]) -> int:
    return rng.choices(list(weights), list(weights.values()))[0]


def random_layout(rng: random.Random, shape: tuple[int, ...]) -> str:
    """A layout for a tensor of ``shape`` (``_LAYOUT_WEIGHTS``, of those that fit)."""
    fit = {k: w for k, w in _LAYOUT_WEIGHTS.items() if layout_fits(k, tuple(shape))}
    return rng.choices(list(fit), list(fit.values()))[0]


def _input_shapes(rng: random.Random, n: int) -> list[tuple[int, ...]]:
    """Shapes of the first inputs: variations of one base shape, so they broadcast."""
    base = [_weighted(rng, _SIZE_WEIGHTS) for _ in range(_weighted(rng, _NDIM_WEIGHTS))]
    shapes = []
    for _ in range(n):
        dims = list(base)
        if dims and rng.random() < 0.3:
            dims = dims[rng.randint(1, len(dims)) :]
        shapes.append(tuple(1 if rng.random() < 0.15 else d for d in dims))
    return shapes


def _outputs(state: GenState) -> tuple[int, ...]:
    """The values returned: those no later op reads (so every op counts), at most four,
    and now and then an input (an output that aliases an input)."""
    used = {a for rec in state.ops for a in rec.args}
    defined = [rec.out for rec in state.ops if rec.out is not None]
    written = [rec.args[0] for rec in state.ops if rec.out is None and rec.args]
    sinks = [v for v in defined if v not in used]
    sinks += [v for v in written if v >= OUT_BASE and v not in sinks]
    if not sinks:
        sinks = defined[-1:] or [0]
    outputs = state.rng.sample(sinks, min(len(sinks), 4))
    if state.rng.random() < 0.1:
        outputs.append(state.rng.randrange(len(state.inputs)))
    return tuple(sorted(set(outputs), key=outputs.index))


def generate(seed: int, *, max_ops: int = 8) -> Program:
    """The random program of ``seed`` (the same program for the same seed and torch).

    Args:
        seed: seeds the structure and the input values.
        max_ops: the most op records the program gets (at least one is tried for).
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager warns about some of what it is given
        return _generate(seed, max_ops)


def _generate(seed: int, max_ops: int) -> Program:
    rng = random.Random(seed)
    state = GenState(rng, grad=rng.random() < P_GRAD, module=rng.random() < P_MODULE)
    for shape in _input_shapes(rng, rng.choice([1, 1, 2, 2, 3])):
        state.new_input(shape, state.random_dtype())
    kinds = [k for k in ops.KINDS.values() if k.weight > 0]
    weights = [k.weight for k in kinds]
    n_ops = rng.randint(1, max_ops)
    attempts = 0
    while len(state.ops) < n_ops and attempts < 40 * n_ops and not state.raised:
        attempts += 1
        kind = rng.choices(kinds, weights)[0]
        mark = state.mark()
        try:
            proposal = kind.gen(state)
        except (RuntimeError, ValueError, IndexError):  # a gen's arithmetic on odd shapes
            proposal = None
        if proposal is None or len(state.inputs) > MAX_INPUTS:
            state.rollback(mark)
            continue
        if not state.propose(kind, list(proposal[0]), proposal[1]):
            state.rollback(mark)
    inputs = tuple(state.inputs)
    grad = state.grad and any(i.requires_grad for i in inputs)
    return compact(Program(inputs, tuple(state.ops), _outputs(state), grad))


def program_seed(seed: int, index: int) -> int:
    """The seed of program ``index`` of a run with ``seed`` (stable across runs)."""
    return random.Random(f"dynajax-fuzz-{seed}-{index}").getrandbits(48)
