"""What the user changes between steps, seen at the next one.

An eager training loop reads everything afresh at each step: the module's parameters
and submodules, which of them require a gradient, its train/eval mode, the optimizer's
param groups and hyperparameters, the tensors the loss function captures. A compiled
step bakes some of that into its program and holds the rest as JAX arrays, so each
step first asks ``Watch.look()`` what changed since the last, and takes it up:

    what changed                                      how the next step takes it up
    param groups (add_param_group, a group removed    resync: the state is written back
      or its params edited); a parameter, buffer or    to the module and optimizer and
      submodule replaced or added; a dtype or shape    loaded again (``Changes.reload``)
      (model.half())
    a trained parameter's requires_grad; the module's  a program for the new values
      train/eval mode; a tensor the loss function      (``Changes.program_key``; one
      captures (rebound, or written in place)          already compiled is reused)
    hyperparameters                                   read each step (``step.py``)

The look is cheap: flags and object identities read off lists made once (about 0.1 ms
for GPT-2 small's 164 modules). It installs nothing in torch: global registration hooks
would run inside a compiled model's forward (``ModuleList.__add__`` registers modules),
where Dynamo traces them and guards on what they count.
"""

from __future__ import annotations

import dataclasses
import functools
import types
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn


@dataclasses.dataclass
class Changes:
    """What ``Watch.look`` found.

    Attributes:
        reload: why the state must be written back and loaded again (None: no need).
        program_key: the part of the program's cache key that the user's settings make
            (requires_grad, train/eval mode, the loss function's tensors).
        retrace: why the program of the last step no longer fits (None: it does).
    """

    reload: str | None
    program_key: tuple[Any, ...]
    retrace: str | None


class Watch:
    """The user's settings a step depends on, as of the last look.

    Args:
        model: the trained module.
        optimizer: its optimizer.
        loss_fn: the loss function (the tensors it captures are watched).
        trained: the optimizer's parameters, in its param groups' order.
        tensors: every tensor of the step (parameters, frozen parameters, buffers).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: Callable[..., Any],
        trained: Sequence[torch.Tensor],
        tensors: Sequence[torch.Tensor],
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.trained = list(trained)
        self.tensors = list(tensors)
        self.modules = list(model.modules())
        # The step's own tensors and modules are watched apart (a loss function may
        # capture the model itself).
        self.own = {id(t) for t in self.tensors} | {id(m) for m in self.modules}
        self.members = self._members()
        self.groups = self._groups()
        self.layouts = self._layouts()
        self.flags = self._flags()

    def _members(self) -> list[Any]:
        """Each watched module's parameters, buffers and submodules, by name and
        identity (a new submodule shows in its parent's)."""
        found: list[Any] = []
        for m in self.modules:
            found.append(None)  # (where one module's members end)
            for members in (m._parameters, m._buffers, m._modules):
                if members:
                    found += members
                    found += map(id, members.values())
        return found

    def _groups(self) -> list[list[int]]:
        return [list(map(id, g["params"])) for g in self.optimizer.param_groups]

    def _layouts(self) -> list[Any]:
        return [(t.dtype, t.shape) for t in self.tensors]

    def _flags(self) -> tuple[Any, ...]:
        return (
            tuple([p.requires_grad for p in self.trained]),
            tuple([m.training for m in self.modules]),
            captured_tensors(self.loss_fn, self.own),
        )

    def look(self) -> Changes:
        """What changed since the last look (which this look becomes)."""
        reload = None
        if self._groups() != self.groups:
            reload = "the optimizer's param groups changed"
        elif self._layouts() != self.layouts:
            reload = "a parameter's or buffer's dtype or shape changed"
        elif self._members() != self.members:
            reload = "the module's parameters, buffers or submodules were replaced or added"
        flags = self._flags()
        retrace = None
        if flags != self.flags:
            which = [
                what
                for what, a, b in zip(
                    ("a parameter's requires_grad", "the train/eval mode", "the loss's tensors"),
                    flags,
                    self.flags,
                    strict=True,
                )
                if a != b
            ]
            retrace = " and ".join(which) + " changed"
            self.flags = flags
        return Changes(reload, flags, retrace)


def captured_tensors(fn: Any, skip: set[int]) -> tuple[tuple[int, int], ...]:
    """The tensors ``fn`` captures, by identity and version (a rebinding or an in-place
    write changes it): its closure's and the globals it names, a ``functools.partial``'s
    arguments, a module's parameters and buffers (``nn.CrossEntropyLoss(weight=w)``),
    a bound method's object's tensor attributes; one level into lists, tuples and
    dicts. Tensors and modules whose ``id`` is in ``skip`` are left out."""
    found: list[torch.Tensor] = []

    def take(value: Any, depth: int = 0) -> None:
        if id(value) in skip:
            return
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, nn.Module):
            found.extend(t for t in value.parameters() if id(t) not in skip)
            found.extend(t for t in value.buffers() if id(t) not in skip)
        elif depth == 0 and isinstance(value, list | tuple):
            for v in value:
                take(v, 1)
        elif depth == 0 and isinstance(value, dict):
            for v in value.values():
                take(v, 1)

    seen: set[int] = set()

    def visit(f: Any) -> None:
        if id(f) in seen:
            return
        seen.add(id(f))
        if isinstance(f, functools.partial):
            visit(f.func)
            for v in (*f.args, *f.keywords.values()):
                take(v)
        elif isinstance(f, types.MethodType):
            visit(f.__func__)
            take(f.__self__)
            if not isinstance(f.__self__, nn.Module):
                for v in vars(f.__self__).values() if hasattr(f.__self__, "__dict__") else ():
                    take(v)
        elif isinstance(f, types.FunctionType):
            for cell in f.__closure__ or ():
                try:
                    value = cell.cell_contents
                except ValueError:  # an empty cell
                    continue
                if callable(value) and not isinstance(value, nn.Module | torch.Tensor):
                    visit(value)
                else:
                    take(value)
            names = f.__code__.co_names
            for name in names:
                value = f.__globals__.get(name)
                if isinstance(value, torch.Tensor):
                    take(value)
        elif isinstance(f, nn.Module):
            take(f)

    visit(fn)
    return tuple((id(t), t._version) for t in found)
