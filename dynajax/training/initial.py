"""The optimizer's initial state, made before its first step, so that the first step
runs the same program as every later one.

torch's optimizers create their state lazily, in their first ``step()``: Adam's
``exp_avg`` and ``exp_avg_sq`` as zeros, its ``step`` count as a 0-d zero, Adagrad's
``sum`` filled with ``initial_accumulator_value``, NAdam's ``mu_product`` as one. The
update that follows is the one every later step runs, on that state. A step whose
program creates the state is a program of its own, traced and compiled once more at the
second step (a second compile as long as the first, on a cold cache). Made before the
first step instead, the state is an input of the first step's program, which is then
the steady program.

What the state starts as is read from the optimizer itself, not from a table: its
``step()`` runs on meta tensors (no memory, no arithmetic) under the
same settings as the step's trace (``optimizer_on``), and each tensor it creates is
recorded with the value its creating op gives (``zeros_like`` 0, ``full_like`` its fill,
``torch.tensor(1.0)`` its constant). Where every state entry it leaves is such a tensor,
that value is the entry's initial state. Where one is not (SGD's momentum buffer is a
copy of the first gradient, a value only the step computes), the state is left to the
step: two programs, the first step's and the steady one.

Only torch's own optimizers (``describe_optimizer``), whose first step is their steady
step on the state they create; an optimizer of the user's code may compute its first
step otherwise, and keeps its two programs. The step's trace checks the one guess this
makes: that every parameter given a state gets a gradient (an unused parameter gets no
state in eager); where some do not, theirs is dropped and the step traced again
(``InitialStateUnread``).
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Sequence
from typing import Any

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from dynajax.training.graph import StateKey, compiling, describe_optimizer, optimizer_on

aten = torch.ops.aten

# The ops that create a tensor of one value, and that value (from their arguments).
_FILLED = {
    aten.zeros.default: lambda args: 0,
    aten.zeros_like.default: lambda args: 0,
    aten.new_zeros.default: lambda args: 0,
    aten.ones.default: lambda args: 1,
    aten.ones_like.default: lambda args: 1,
    aten.new_ones.default: lambda args: 1,
    aten.full.default: lambda args: args[1],
    aten.full_like.default: lambda args: args[1],
    aten.new_full.default: lambda args: args[2],
    aten.scalar_tensor.default: lambda args: args[0],
}
# Ops whose result holds their first argument's values (a copy, a cast, a view).
_SAME = {
    aten._to_copy.default,
    aten.clone.default,
    aten.detach.default,
    aten.alias.default,
    aten.lift_fresh.default,
    aten.lift_fresh_copy.default,
}


class _Creations(TorchDispatchMode):
    """Records, for each tensor an op creates with one known value, that value (a
    number, or a real tensor for a constant such as ``torch.tensor(0.0)``'s)."""

    def __init__(self) -> None:
        super().__init__()
        # id -> (the tensor, kept alive so that its id is not reused; its value)
        self.values: dict[int, tuple[torch.Tensor, Any]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if not isinstance(out, torch.Tensor):
            return out
        value: Any = None
        if func in _FILLED:
            value = _FILLED[func](args)
            if not isinstance(value, numbers.Number) or isinstance(value, complex):
                value = None
        elif func in _SAME and args and isinstance(args[0], torch.Tensor):
            source = args[0]
            if id(source) in self.values:
                value = self.values[id(source)][1]
            elif source.device.type != "meta":  # a constant of the optimizer's code
                constant = source if not is_fake(source) else getattr(source, "constant", None)
                if constant is not None:
                    with _disable_current_modes():
                        value = constant.detach().clone()
        if value is not None:
            self.values[id(out)] = (out, value)
        return out


@dataclasses.dataclass(frozen=True)
class Start:
    """What a state entry starts as: its shape, dtype and one value (a number, or a
    0-d or broadcastable constant tensor)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    value: Any

    def tensor(self) -> torch.Tensor:
        """The entry as a CPU tensor (made one at a time: the optimizer's state is
        as large as its parameters)."""
        if isinstance(self.value, torch.Tensor):
            return self.value.to(self.dtype).expand(self.shape).clone()
        return torch.full(self.shape, self.value, dtype=self.dtype)


def initial_state(
    optimizer: torch.optim.Optimizer,
    trained: Sequence[torch.Tensor],
    positions: Sequence[int],
    lrs: Sequence[float],
) -> dict[StateKey, Start] | None:
    """The state ``optimizer`` creates at its first step for the parameters at
    ``positions`` of ``trained`` (its param groups' parameters, in order), each entry's
    ``Start``; ``{}`` where it creates none (SGD without momentum). None
    where it is not one of torch's own optimizers, or an entry's initial value depends
    on the step (a copy of the gradient), or is not seen made (``torch.as_tensor`` on a
    device, ASGD's eta). ``lrs``: each group's learning rate now (what eager's first
    step reads)."""
    if not positions or describe_optimizer(optimizer) is None:
        return None
    wanted = set(positions)
    creations = _Creations()
    # (meta tensors: a quarter of FakeTensorMode's time, 0.4 s for GPT-2 of 24 layers)
    metas = []
    for i, p in enumerate(trained):
        meta = torch.empty(p.shape, dtype=p.dtype, device="meta")
        if i in wanted:
            meta.grad = torch.empty_like(meta)
        metas.append(meta)
    try:
        with (
            compiling(),
            optimizer_on(optimizer, metas, {}, list(lrs)) as state,
            creations,
        ):
            optimizer.step()
    except Exception:
        return None  # (its trace will say what fails)
    initial: dict[StateKey, Start] = {}
    for i, meta in enumerate(metas):
        for key, value in state.get(meta, {}).items():
            found = creations.values.get(id(value)) if isinstance(value, torch.Tensor) else None
            if found is None or i not in wanted:
                return None
            made, start = found
            initial[(i, key)] = Start(tuple(made.shape), made.dtype, start)
    return initial
